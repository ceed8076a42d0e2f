"""A warp-specialised Gluon (sm_90) kernel for the lightning-indexer scores over MXFP4 keys: the fp8mma math of
``scores._mxfp4_scores_kernel`` split across warps: ``indexer_scores(impl="gluon")`` on sm_90, or with its launch
knobs ``indexer_scores_gluon``; ``impl="auto"``'s choice where it applies (``scores.GLUON_AUTO``).  A row's tiles
are strided over its programs and those at or past its n_visible are written -inf without loads (``_my_tiles``), so
rows far shorter than max_entries (static block tables) cost what their visible entries cost.

Why: the Triton fp8mma kernel is latency-bound (~70 us at 1M entries, B = 4, H200): one warpgroup runs the serial
chain block-table load -> key load -> re-encode -> shared memory -> MMA -> wait -> epilogue per 128-entry tile.  The
work itself is small: 71 MB of keys (17 us of HBM), 17 GFLOP of FP8 MMA (~9 us), and ~6 CUDA-core operations per
(entry, head) for the block-scale combine, ReLU and weighted head sum (~12 us at 1M x 64).  Here they overlap, in
five partitions (20 warps, one program an SM by default):

- **Loader** (1 warp): per 128-entry tile, the block-table entries a tile ahead, then TMA of the tile's boxes (one
  page's rows each: packed bytes [1, rows, 64] and scale words [1, rows]) into a raw ring.  A box whose page is -1
  or outside the pool is read at an out-of-range page: TMA zero-fills it without touching memory.
- **Producers** P = 0, 1 (4 warps each, tiles P, P + 2, ...; ``producers=1``: one producer, 16 warps): re-encode
  the raw tile's e2m1 bytes as e4m3 (exact: value * 2**-6) into a 128-byte-
  swizzled stage (``_e2m1_words_to_e4m3``: 10 instructions for the two e4m3 words of a packed word's 8 elements, in
  element order; the int32 stage is read back as e4m3 by the wgmmas), and decode each entry's scale word into five
  factors (2**(s_b - s_max) for its four 32-blocks, flushed below 2**-126, and 2**(s_max - 127), 0 when the entry
  is not visible), each factor row its own buffer (Triton puts a warpgroup barrier between stores to one buffer).
- **Consumers** W = 0, 1 (4 warps each): entries [64 W, 64 W + 64) of every tile: four m64 n64 k32 FP8 wgmmas (one a
  block, each from zero: exact, as in fp8mma); the first two run under the previous tile's epilogue, the last two
  under the combine of the first two; then ReLU, the head weights (with the query's and the code's scales folded
  in), the head sum, the key factor; -inf where it is 0.

The query of a row is made e4m3 inside the kernel (``_query_prep``): with one power-of-two scale a head where that
is exact for every head (fp8mma's fast path: realistic MXFP4 queries), else with one scale a 32-block, block b's
partial multiplied back by 2**(e_hb - e_h) per head in the epilogue (a second copy of the consumer loop, one more
multiply a value and block).  Both are exact for MXFP4-simulated queries, as fp8mma's two paths are.

H200 (triton 3.6, 2026-12-04, ``benchmarks/results/2026-12-04_h200_*gluon_indexer*_s11*``): 1M-token context
(262,144 entries), 64 heads: B = 4 53.1 us (fp8mma 71.3 us in the same run), B = 64 792 us (1,077 us); scores
equal to fp8mma's bit for bit.  (Measured before the scale-a-block path was added; the one-scale loop is the same
code, and the decode step measured after it took the same time: V4-Flash CSA 128K B = 64 363.8 us, 365.6 before.)
The way there, B = 4: key loads carried a tile ahead in registers 144.6 us (about one tile in flight an SM),
cp.async ring 93.0, page size constexpr (no divisions) 78.5, TMA boxes 66.1, one-warp loader + per-factor buffers
61.3, MMAs overlapped with the epilogue 57.9 (tiles = 32) / 53.1 (one program an SM).
Ring depths do not matter (stages 2-8, raw 4-8: within 1.5 us).  Nsight's stall samples (v4): consumer warps are
selected in ~22 % of their samples (26-31 % waiting on barriers / long scoreboard, 17 % on shared loads), producer
warps in 18 % and ready but not selected in 31 %: the schedulers issue in ~60 % of cycles and no partition is
saturated.  The remaining work is the float epilogue (~285 instructions a consumer warp a tile) and the conversion
(~240 a producer warp).

Session 13 (``..._s13*``): a second producer warpgroup (alternate tiles; registers 176 a consumer thread, 48 a
producer thread, the 20-warp pool being 96 x 640) took B = 4 from 53.6 to 48.1 us and B = 64 from 782 to 679 (exact,
same run), so it is the default.  Ablations at B = 4 / 64 (``ablate``, two producers, clean L2 where noted):
without the key conversion the exact kernel takes 40.5 / 523 us; the fold variant 42.5 / 578 in full, 37.8 / 395
without the conversion, 36.9 / 382 without the epilogue, 37.1 / 406 without the MMAs, and 28-35 / 300-312 with none
of the three (loads and hand-offs only).  That skeleton is ~8 us a launch plus ~0.3 us a tile an SM (3.8 TB/s; at
B = 64 it runs at 97 % of the HBM roofline), so 1M-token B = 4 (62 tiles an SM) cannot go below ~27 us in this
structure, and every partition's work shows in the time: the SM is issue- and latency-bound as a whole, with no
single partition to unblock.  Neither the loader's block-table lookahead (1 or 4 tiles) nor the ring depths
(stages 4-8, raw 4-16) nor the L2 flush kind changed the time.

``fold=True`` (``impl="gluon_fold"``) trades exactness for instructions: the producer folds each
block's scale into the e4m3 codes (the Triton fold encoding, ``scores._fold_tables``; ``_fold_words``, 10
instructions a word, blocks more than 11 binades below their key's largest flushed to zero), so a consumer runs one
K = 128 wgmma chain a tile into one accumulator (the tensor core's FP8 accumulation: not exact, as DeepSeek's own FP8
indexer kernels; the reference computes these scores in bf16) and needs no block combine; it takes its tiles in pairs
so the two accumulators alternate without register copies.  Static SASS of the loops (triton 3.6, sm_90,
``sass_report.py``): 122.5 instructions a consumer warp a tile (283 exact) and 290 a producer warp (245), ~2,240 a
tile an SM against ~3,340: about 1.5x fewer, if the schedulers stay as busy.  Measured (H200, session 13, two
producers): B = 1 / 4 / 8 / 64 at 1M 15.5 / 42.2 / 79.5 / 572 us against the exact kernel's 17.3 / 48.1 / 90.8 /
679; within 2.4e-5 of the row's largest |score| of fp8mma's exact scores.  ``impl="auto"`` takes it since session 14
(``scores.GLUON_AUTO_FOLD``).

``hsum=True`` (with fold; session 22, not yet timed): the weighted head sum on the tensor core
(``_consume_fold_pairs`` with ``HSUM``).  A consumer's fp32 logits [64 entries, 64 heads] become bf16 with the ReLU
in the same instruction (``F2FP.RELU.BF16.F32.PACK_AB``, one a pair) and, as an m64 accumulator's registers are the
A fragment of the next wgmma, feed an m64 n8 k64 bf16 wgmma against the head weights' bf16 high and low parts
(columns 0 and 1 of an [8, 64] tile in shared memory), replacing the ReLU, multiply and tree sum on the CUDA cores.
Static SASS of the pair loop (triton 3.6): 98 / 90 instructions a consumer warp a tile (consumers 0 / 1) against
125 / 122.  The logits are rounded to bf16 first (as the official reference's bf16 einsum rounds them), so each term
is within 2**-9 of exact: 2**-9 · Σ_h |w_h| ReLU(logit_h) an entry on top of fold's error.
"""

from __future__ import annotations

import functools

import torch

from dsv4.kernels.indexer import scores as _scores

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dsv4.kernels._gluon_sync import pdl_enter_gl

    # triton 3.6 names the TMA load ``async_copy_global_to_shared``; later versions also ``async_load``
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

TILE_N = 128  # entries a stage (the producer's tile); each consumer takes 64
HEADS = 64  # index heads (wgmma N)
DIM = 128  # key / query dims
QBLOCK = 32  # elements a UE8M0 block = one FP8 wgmma's K
CODE_SCALE_LOG2 = 6  # the e4m3 re-encoding stores e2m1 value * 2**-6
HSUM_N = 8  # ``hsum``: the head-sum MMA's N (rows 0 / 1 of its B operand hold the weights' bf16 high / low parts)
# fold (``fold=True``): the Triton fold impl's encoding (``scores._fold_tables``): e2m1 value v of a block d =
# s_max - s_b binades below its key's largest block is stored as the e4m3 byte of v * 2**(6 - d), exact for
# d <= scores._FOLD_MAX_D (11; the tables are affine in d there); blocks further down are flushed to zero here
# (the Triton fold impls score such keys exactly in a second loop instead).

if HAVE_GLUON:
    _TILE_N = gl.constexpr(TILE_N)
    _HEADS = gl.constexpr(HEADS)
    _DIM = gl.constexpr(DIM)
    _QBLOCK = gl.constexpr(QBLOCK)
    _CODE_SCALE_LOG2 = gl.constexpr(CODE_SCALE_LOG2)
    _FOLD_MAX_D = gl.constexpr(_scores._FOLD_MAX_D)
    _FOLD_B0 = gl.constexpr(_scores._FOLD_B0)
    _FOLD_LO_OFF = gl.constexpr(_scores._FOLD_LO_OFF)
    _FOLD_HI_OFF = gl.constexpr(_scores._FOLD_HI_OFF)
    _FOLD_CODE_SCALE = gl.constexpr(2.0**-_scores._FOLD_C)
    _FOLD_WORD_PTX = gl.constexpr(_scores.fold_lookup_ptx("$3", "$4"))  # pack = 1: w, lo, hi are $2, $3, $4
    _HSUM_N = gl.constexpr(HSUM_N)

    @gluon.jit
    def _e2m1_words_to_e4m3(w):
        """A word of 4 packed e2m1 bytes (elements 8c .. 8c + 7, low nibble first) -> two words of e4m3 bytes in
        element order (value * 2**-6): each nibble shifted to bits 2-5 of its own byte (z), the sign moved from bit 5
        to bit 7 by z + 3 (z & 0x20) (no carry leaves a byte), and the bytes interleaved with ``prmt``: 10
        instructions a word."""
        return gl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 zl, zh, a, b, t;
            shl.b32 zl, $2, 2;
            and.b32 zl, zl, 0x3C3C3C3C;
            shr.b32 zh, $2, 2;
            and.b32 zh, zh, 0x3C3C3C3C;
            prmt.b32 a, zl, zh, 0x5140;
            prmt.b32 b, zl, zh, 0x7362;
            and.b32 t, a, 0x20202020;
            mad.lo.u32 $0, t, 3, a;
            and.b32 t, b, 0x20202020;
            mad.lo.u32 $1, t, 3, b;
            }
            """,
            constraints="=r,=r,r",
            args=[w],
            dtype=(gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _fold_words(w, lo, hi):
        """A word of 4 packed e2m1 bytes (elements 8c .. 8c + 7, low nibble first) -> two words of e4m3 bytes in
        element order: each magnitude code (3 bits) replaced by its byte of the table {hi, lo} (``prmt``; the
        selector's low 16 bits, nibbles with bit 3 clear), each sign bit replicated over its byte by ``prmt``'s
        sign mode and kept as bit 7 (``lop3``): ``scores.fold_lookup_ptx``, 10 instructions a word."""
        return gl.inline_asm_elementwise(
            asm=_FOLD_WORD_PTX,
            constraints="=r,=r,r,r,r",
            args=[w, lo, hi],
            dtype=(gl.int32, gl.int32),
            is_pure=True,
            pack=1,
        )

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # ``buf``'s bytes as another dtype / shape / layout

        @gluon.jit
        def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return buf.reinterpret(dtype, shape, layout)

    else:  # triton 3.6 names it ``_reinterpret``

        @gluon.jit
        def _reinterpret(buf, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
            return buf._reinterpret(dtype, shape, layout)

    @gluon.jit
    def _my_tiles(nv, N):
        """This program's tiles: c, c + G, c + 2 G, ... below cdiv(N, TILE_N) (c = program_id(1), G = programs a
        row), so the live tiles of a row (those below its n_visible ``nv``) are spread over all of its programs
        however short the row is.  Returns (c, G, n_my: tiles, n_live: the first n_live of them hold visible
        entries)."""
        c = gl.program_id(1)
        G = gl.num_programs(1)
        n_my = (gl.cdiv(N, _TILE_N) - c + G - 1) // G
        n_live = gl.minimum(gl.maximum((gl.cdiv(nv, _TILE_N) - c + G - 1) // G, 0), n_my)
        return c, G, n_my, n_live

    @gluon.jit
    def _box_page(tile, k: gl.constexpr, row, nv, bt_ptr, stride_bt, MAX_BLOCKS, BS: gl.constexpr,
                  BOXR: gl.constexpr):  # fmt: skip
        """Block-table entry (scalar int32) of box k of ``tile`` (entries [tile TILE_N + k BOXR, + BOXR), one page's
        rows); -1 where none of them is visible.  Nothing is computed from it here (its latency overlaps an
        iteration)."""
        e0 = tile * _TILE_N + k * BOXR
        blk = e0 // BS
        return gl.load(bt_ptr + row * stride_bt + blk, mask=(e0 < nv) & (blk < MAX_BLOCKS), other=-1)

    @gluon.jit
    def _loader(args):
        """One warp: TMA of each tile's NP boxes (packed bytes [1, BOXR, 64] and scale words [1, BOXR] of one page
        each) into raw slot i % RAW, once the converter has freed it; block-table entries a tile ahead.  A box whose
        page is -1 or outside the pool is read at page NUM_PAGES: outside the tensor, so TMA zero-fills it (scale
        word 0: not visible) without touching memory, and still counts its bytes."""
        (
            q_ptr, w_ptr, d_desc, s_desc, bt_ptr, row_ptr, nv_ptr, out_ptr, stride_qt, stride_qh,
            stride_wt, stride_bt, stride_ot, N, MAX_BLOCKS, NUM_PAGES, k_s, k_w, f0, f1, f2, f3, f4, q_s,
            raw_d, raw_c, bars, page_s, c_s, fold_s, abl_s, hw_s, hbars, hsum_s,
        ) = args  # fmt: skip
        STAGES: gl.constexpr = k_s.type.shape[0]
        BOXR: gl.constexpr = raw_d.type.shape[2]
        NP: gl.constexpr = _TILE_N // BOXR
        RAW: gl.constexpr = raw_d.type.shape[0] // NP
        BS: gl.constexpr = page_s.type.shape[0]
        RAWRDY: gl.constexpr = 2 * STAGES + 1
        RAWFREE: gl.constexpr = RAWRDY + RAW
        t = gl.program_id(0)
        row = gl.load(row_ptr + t).to(gl.int64)
        nv = gl.load(nv_ptr + t)
        c, G, n_my, n_live = _my_tiles(nv, N)
        p0n = _box_page(c, 0, row, nv, bt_ptr, stride_bt, MAX_BLOCKS, BS, BOXR)
        p1n = _box_page(c, NP - 1, row, nv, bt_ptr, stride_bt, MAX_BLOCKS, BS, BOXR)
        for i in range(n_live):
            tile = c + i * G
            p0 = p0n
            p1 = p1n
            p0n = _box_page(tile + G, 0, row, nv, bt_ptr, stride_bt, MAX_BLOCKS, BS, BOXR)
            p1n = _box_page(tile + G, NP - 1, row, nv, bt_ptr, stride_bt, MAX_BLOCKS, BS, BOXR)
            r = i % RAW
            mbarrier.wait(bars.index(RAWFREE + r), ((i // RAW) & 1) ^ 1, pred=i >= RAW)
            bar = bars.index(RAWRDY + r)
            mbarrier.expect(bar, NP * BOXR * (_DIM // 2 + 4))
            for k in gl.static_range(NP):
                if k == 0:
                    p = p0
                else:
                    p = p1
                pc = gl.where((p >= 0) & (p < NUM_PAGES), p, NUM_PAGES)
                r0 = (tile * _TILE_N + k * BOXR) % BS
                _tma_load(d_desc, [pc, r0, 0], bar, raw_d.index(r * NP + k))
                _tma_load(s_desc, [pc, r0], bar, raw_c.index(r * NP + k))

    @gluon.jit
    def _producer_of(P: gl.constexpr, NPROD: gl.constexpr, args):
        """Producer P of NPROD (four warps each; tiles i = P, P + NPROD, ... of the program's live tiles): re-encode
        each raw tile into a stage and decode each entry's scale word into the consumers' factors: ``f0``-``f3`` 2**(s_b
        - s_max) for the four blocks (0 when below 2**-126), ``f4`` 2**(s_max - 127) (0 for an entry that is not
        visible: past n_visible, or zero-filled by the loader; the format never writes a scale word of 0, every UE8M0
        byte being >= 1).  Barriers: raw-ready r (TMA bytes), raw-free r (count 1), stage-ready s (count 1), stage-free
        s (count 2: the consumers)."""
        (
            q_ptr, w_ptr, d_desc, s_desc, bt_ptr, row_ptr, nv_ptr, out_ptr, stride_qt, stride_qh,
            stride_wt, stride_bt, stride_ot, N, MAX_BLOCKS, NUM_PAGES, k_s, k_w, f0, f1, f2, f3, f4, q_s,
            raw_d, raw_c, bars, page_s, c_s, fold_s, abl_s, hw_s, hbars, hsum_s,
        ) = args  # fmt: skip
        STAGES: gl.constexpr = k_s.type.shape[0]
        BOXR: gl.constexpr = raw_d.type.shape[2]
        NP: gl.constexpr = _TILE_N // BOXR
        RAW: gl.constexpr = raw_d.type.shape[0] // NP
        READY: gl.constexpr = 0
        FREE: gl.constexpr = STAGES
        RAWRDY: gl.constexpr = 2 * STAGES + 1
        RAWFREE: gl.constexpr = RAWRDY + RAW
        NO_CONVERT: gl.constexpr = (abl_s.type.shape[0] & 0xAA) != 0  # ablate & ABLATE_CONVERT
        lp: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        sl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        r_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        c_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        raw_w = _reinterpret(raw_d, gl.int32, [RAW, _TILE_N, _DIM // 8], r_l)  # the same bytes as words
        raw_s = _reinterpret(raw_c, gl.int32, [RAW, _TILE_N], c_l)
        nv = gl.load(nv_ptr + gl.program_id(0))
        c, G, n_my, n_live = _my_tiles(nv, N)
        if fold_s.type.shape[0] == 2:
            _produce_fold(raw_d, raw_c, k_w, f4, bars, nv, c, G, n_live, STAGES, RAW, P, NPROD, NO_CONVERT)
        else:
            e = gl.arange(0, _TILE_N, layout=sl)
            for i in range(P, n_live, NPROD):
                r = i % RAW
                st = i % STAGES
                mbarrier.wait(bars.index(RAWRDY + r), (i // RAW) & 1)
                packed = raw_w.index(r).load(lp)
                sw = raw_s.index(r).load(sl)
                mbarrier.wait(bars.index(FREE + st), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
                if not NO_CONVERT:
                    w0, w1 = _e2m1_words_to_e4m3(packed)  # elements 8c .. 8c + 3 and 8c + 4 .. 8c + 7 of word c
                    k_w.index(st).store(gl.reshape(gl.join(w0, w1), [_TILE_N, _DIM // 4]))
                b0 = sw & 255
                b1 = (sw >> 8) & 255
                b2 = (sw >> 16) & 255
                b3 = (sw >> 24) & 255
                s0 = gl.maximum(gl.maximum(b0, b1), gl.maximum(b2, b3))
                f0.index(st).store(_rel_scale(b0, s0))
                f1.index(st).store(_rel_scale(b1, s0))
                f2.index(st).store(_rel_scale(b2, s0))
                f3.index(st).store(_rel_scale(b3, s0))
                _store_key_factor(f4, st, sw, s0, (c + i * G) * _TILE_N + e, nv)
                fence_async_shared()
                mbarrier.arrive(bars.index(READY + st))
                mbarrier.arrive(bars.index(RAWFREE + r))  # every read of the raw slot ended before the arrive's barrier

    @gluon.jit
    def _produce_fold(raw_d, raw_c, k_w, f4, bars, nv, c, G, n_live, STAGES: gl.constexpr, RAW: gl.constexpr,
                      P: gl.constexpr, NPROD: gl.constexpr, NO_CONVERT: gl.constexpr):  # fmt: skip
        """The producer with fold: each raw tile's codes re-encoded with their block's shift folded in
        (``_fold_words``, the tables built once a (entry, block)), and only ``f4`` (2**(s_max - 127), 0 when not
        visible) stored: the consumers need no per-block factors."""
        READY: gl.constexpr = 0
        FREE: gl.constexpr = STAGES
        RAWRDY: gl.constexpr = 2 * STAGES + 1
        RAWFREE: gl.constexpr = RAWRDY + RAW
        # [entry, block, word of the block]: a thread's 4 words are one block's, as the [128, 16] layout of the
        # one-scale producer; the tables [entry, block] broadcast over the words
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 4, 1], [4, 1, 1], [2, 1, 0])
        lb: gl.constexpr = gl.SliceLayout(2, l3)
        sl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        r3_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])
        c_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        raw_w = _reinterpret(raw_d, gl.int32, [RAW, _TILE_N, _DIM // _QBLOCK, _QBLOCK // 8], r3_l)
        raw_s = _reinterpret(raw_c, gl.int32, [RAW, _TILE_N], c_l)
        e = gl.arange(0, _TILE_N, layout=sl)
        sh = 8 * gl.arange(0, _DIM // _QBLOCK, layout=gl.SliceLayout(0, lb))
        for i in range(P, n_live, NPROD):
            r = i % RAW
            st = i % STAGES
            mbarrier.wait(bars.index(RAWRDY + r), (i // RAW) & 1)
            packed = raw_w.index(r).load(l3)
            sw_b = raw_s.index(r).load(gl.SliceLayout(1, lb))
            sw = raw_s.index(r).load(sl)
            mbarrier.wait(bars.index(FREE + st), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
            sb = (sw_b[:, None] >> sh[None, :]) & 255  # [entry, block] UE8M0 bytes
            d = _max_scale_byte(sw_b)[:, None] - sb  # (every thread holds its entries' whole scale word: no shuffles)
            b = _FOLD_B0 - (d << 3)  # the byte of 0.5 * 2**(6 - d); the tables are affine in it
            near = d <= _FOLD_MAX_D
            lo = gl.where(near, _FOLD_LO_OFF + b * 0x01010100, 0)
            hi = gl.where(near, _FOLD_HI_OFF + b * 0x01010101, 0)
            zero = gl.zeros_like(packed)
            if not NO_CONVERT:
                w0, w1 = _fold_words(packed, lo[:, :, None] + zero, hi[:, :, None] + zero)
                k_w.index(st).store(gl.reshape(gl.join(w0, w1), [_TILE_N, _DIM // 4]))
            _store_key_factor(f4, st, sw, _max_scale_byte(sw), (c + i * G) * _TILE_N + e, nv)
            fence_async_shared()
            mbarrier.arrive(bars.index(READY + st))
            mbarrier.arrive(bars.index(RAWFREE + r))

    @gluon.jit
    def _max_scale_byte(sw):
        """The largest of the four UE8M0 bytes of scale words ``sw`` (int32)."""
        return gl.maximum(gl.maximum(sw & 255, (sw >> 8) & 255), gl.maximum((sw >> 16) & 255, (sw >> 24) & 255))

    @gluon.jit
    def _store_key_factor(f4, st, sw, s0, offs, nv):
        """Stage ``st``'s key factors 2**(s0 - 127), 0 for an entry that is not visible: at or past ``nv``
        (``offs``: the entries' indices), or zero-filled by the loader (scale word 0)."""
        ok = (sw != 0) & (offs < nv)
        f4.index(st).store(gl.where(ok, _pow2(gl.maximum(s0, 1)), 0.0))

    @gluon.jit
    def _rel_scale(b, s0):
        """2**(b - s0) as fp32, 0 where that is below 2**-126 (b, s0: UE8M0 bytes, int32)."""
        return gl.where(b - s0 + 127 >= 1, _pow2(gl.maximum(b - s0 + 127, 1)), 0.0)

    @gluon.jit
    def _pow2(biased_exp):
        """2**(biased_exp - 127) as fp32 (biased_exp int32 in [1, 254])."""
        return (biased_exp << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _query_prep(q_ptr, w_ptr, stride_qt, stride_qh, stride_wt, q_s, c_s, qbar, W: gl.constexpr,
                    col_l: gl.constexpr, FOLD: gl.constexpr):  # fmt: skip
        """Row t's query as e4m3 for the block MMAs.  Head h times 2**(127 - e_h), e_h the biased exponent of its
        largest |value| (127 for an all-zero head), when that is exact for every head (fp8mma's fast path, always
        for realistic MXFP4 queries); otherwise ("general") each 32-block times 2**(127 - e_hb), e_hb its own
        largest exponent (exact for any MXFP4 query), and block b's partial is multiplied back by
        c_b[h] = 2**(e_hb - e_h) in the epilogue.  Consumer 0 stores the query into ``q_s`` and c into ``c_s``
        [4, HEADS] (0 below 2**-126), then arrives on ``qbar``.

        Returns (the weights times 2**(e_h - 127 + 6) -- the query's and the keys' code scale -- [HEADS] fp32 in
        ``col_l``, general: int1 scalar)."""
        t = gl.program_id(0).to(gl.int64)
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [4, 4, 2], [4, 1, 1], [2, 1, 0])  # [head, block, element]
        lhb: gl.constexpr = gl.SliceLayout(2, l3)
        h = gl.arange(0, _HEADS, layout=gl.SliceLayout(1, lhb))
        b = gl.arange(0, _DIM // _QBLOCK, layout=gl.SliceLayout(0, lhb))
        j = gl.arange(0, _QBLOCK, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
        col = (b * _QBLOCK)[None, :, None] + j[None, None, :]
        qf = gl.load(q_ptr + t * stride_qt + h[:, None, None] * stride_qh + col).to(gl.float32)  # [64, 4, 32]
        eb = (gl.max(gl.abs(qf), axis=2).to(gl.int32, bitcast=True) >> 23) & 255  # [64, 4]
        e = gl.max(eb, axis=1)
        e = gl.where(e == 0, 127, e)
        qs = qf * _pow2(254 - e)[:, None, None]
        same = (qs.to(gl.float8e4nv).to(gl.float32) == qs).to(gl.int32)
        general = gl.min(gl.min(gl.min(same, axis=2), axis=1), axis=0) == 0
        qs = gl.where(general, qf * _pow2(254 - eb)[:, :, None], qs)
        if W == 0:
            q_s.store(gl.reshape(qs.to(gl.float8e4nv), [_HEADS, _DIM]))
            rel = eb - e[:, None] + 127
            c = gl.where(rel >= 1, _pow2(gl.maximum(rel, 1)), 0.0)  # [64, 4]
            for k in gl.static_range(_DIM // _QBLOCK):
                c_s.index(k).store(gl.sum(gl.where(b[None, :] == k, c, 0.0), axis=1))
            fence_async_shared()
            mbarrier.arrive(qbar)
        w = gl.load(w_ptr + t * stride_wt + gl.arange(0, _HEADS, layout=col_l))
        if FOLD:  # codes v * 2**(6 - d): 2**(e - 127) * 2**-6
            wq = (w * _pow2(gl.convert_layout(e, col_l))) * _FOLD_CODE_SCALE
        else:
            wq = w * _pow2(gl.convert_layout(e, col_l) + _CODE_SCALE_LOG2)
        return wq, general

    @gluon.jit
    def _consumer(W: gl.constexpr, args):
        (
            q_ptr, w_ptr, d_desc, s_desc, bt_ptr, row_ptr, nv_ptr, out_ptr, stride_qt, stride_qh,
            stride_wt, stride_bt, stride_ot, N, MAX_BLOCKS, NUM_PAGES, k_s, k_w, f0, f1, f2, f3, f4, q_s,
            raw_d, raw_c, bars, page_s, c_s, fold_s, abl_s, hw_s, hbars, hsum_s,
        ) = args  # fmt: skip
        STAGES: gl.constexpr = k_s.type.shape[0]
        QBAR: gl.constexpr = 2 * STAGES
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        c, G, n_my, n_live = _my_tiles(gl.load(nv_ptr + gl.program_id(0)), N)
        FOLD: gl.constexpr = fold_s.type.shape[0] == 2
        wq, general = _query_prep(
            q_ptr, w_ptr, stride_qt, stride_qh, stride_wt, q_s, c_s, bars.index(QBAR), W, col_l, FOLD
        )
        mbarrier.wait(bars.index(QBAR), 0)
        out_row = out_ptr + gl.program_id(0).to(gl.int64) * stride_ot
        HSUM: gl.constexpr = hsum_s.type.shape[0] == 2
        if FOLD:
            if general:  # four blocks from zero times the query's c_b (the keys carry their block scales)
                _consume(W, k_s, q_s, f0, f1, f2, f3, f4, c_s, bars, wq, out_row, c, G, n_live, N, True, True)
            else:
                hw = hw_s.index(W if HSUM else 0)  # (one tile when not HSUM, never read)
                if HSUM:  # the head sum on the tensor core (bf16 logits)
                    _head_weights_tile(wq, hw, hbars.index(W))
                _consume_fold_pairs(W, k_s, q_s, f4, bars, wq, hw, out_row, c, G, n_live, N, abl_s.type.shape[0], HSUM)
        elif general:  # a query that needs a scale a block (see _query_prep): one more multiply a value and block
            _consume(W, k_s, q_s, f0, f1, f2, f3, f4, c_s, bars, wq, out_row, c, G, n_live, N, True, False)
        else:
            _consume(W, k_s, q_s, f0, f1, f2, f3, f4, c_s, bars, wq, out_row, c, G, n_live, N, False, False)
        # the tiles past n_visible: -inf, nothing loaded
        dead_l: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
        rows = 64 * W + gl.arange(0, 64, layout=dead_l)
        for i in range(n_live, n_my):
            offs = (c + i * G) * _TILE_N + rows
            gl.store(out_row + offs, gl.full([64], float("-inf"), gl.float32, dead_l), mask=offs < N)

    @gluon.jit
    def _consume(W: gl.constexpr, k_s, q_s, f0, f1, f2, f3, f4, c_s, bars, wq, out_row, c, G, n_live, N,
                 GENERAL: gl.constexpr, FOLD: gl.constexpr):  # fmt: skip
        """Consumer W's loop over the program's live tiles (c + i G, i < n_live): entries [64 W, 64 W + 64) of
        each stage.  FOLD (with GENERAL only): the keys carry their block scales, no ``f0``-``f3`` factors."""
        STAGES: gl.constexpr = k_s.type.shape[0]
        READY: gl.constexpr = 0
        FREE: gl.constexpr = STAGES
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        zero = gl.zeros([64, _HEADS], gl.float32, mma)
        # each tile's blocks 0-1 run under the previous tile's epilogue, its blocks 2-3 under the combine of 0-1;
        # no MMA is in flight across iterations (ptxas would serialise the chain)
        acc = zero
        fk = gl.zeros([64], gl.float32, row_l)
        rows = 64 * W + gl.arange(0, 64, layout=row_l)
        for i in range(n_live):
            st = i % STAGES
            mbarrier.wait(bars.index(READY + st), (i // STAGES) & 1)
            a0 = _block_mma(k_s, q_s, st, W, 0, zero)
            a1 = _block_mma(k_s, q_s, st, W, 1, zero)
            _write_scores(acc, fk, wq, out_row, (c + (i - 1) * G) * _TILE_N + rows, N, i > 0)
            a2 = _block_mma(k_s, q_s, st, W, 2, zero)
            a3 = _block_mma(k_s, q_s, st, W, 3, zero)
            if not FOLD:
                r0 = f0.index(st).slice(64 * W, 64).load(row_l)
                r1 = f1.index(st).slice(64 * W, 64).load(row_l)
                r2 = f2.index(st).slice(64 * W, 64).load(row_l)
                r3 = f3.index(st).slice(64 * W, 64).load(row_l)
            fk = f4.index(st).slice(64 * W, 64).load(row_l)
            a0, a1 = warpgroup_mma_wait(2, deps=[a0, a1])
            if FOLD:
                acc = a0 * c_s.index(0).load(col_l)[None, :] + a1 * c_s.index(1).load(col_l)[None, :]
            elif GENERAL:  # the query's block factors re-read each tile (registers are short)
                acc = a0 * c_s.index(0).load(col_l)[None, :] * r0[:, None]
                acc = acc + a1 * c_s.index(1).load(col_l)[None, :] * r1[:, None]
            else:
                acc = a0 * r0[:, None] + a1 * r1[:, None]
            a2, a3 = warpgroup_mma_wait(0, deps=[a2, a3])
            if FOLD:
                acc = acc + a2 * c_s.index(2).load(col_l)[None, :] + a3 * c_s.index(3).load(col_l)[None, :]
            elif GENERAL:
                acc = acc + a2 * c_s.index(2).load(col_l)[None, :] * r2[:, None]
                acc = acc + a3 * c_s.index(3).load(col_l)[None, :] * r3[:, None]
            else:
                acc = acc + a2 * r2[:, None] + a3 * r3[:, None]
            mbarrier.arrive(bars.index(FREE + st))  # the factor loads were performed before the arrive's barrier
        _write_scores(acc, fk, wq, out_row, (c + (n_live - 1) * G) * _TILE_N + rows, N, n_live > 0)

    @gluon.jit
    def _fold_mma(k_s, q_s, f4, bars, i, W: gl.constexpr, zero, SKIP: gl.constexpr):
        """Waits for stage i % STAGES, issues its K = 128 wgmma chain (async) for consumer W's 64 entries; returns
        (the MMA's token, the stage, the entries' f4 factors).  SKIP (an ablation): no MMA, ``zero`` instead."""
        STAGES: gl.constexpr = k_s.type.shape[0]
        READY: gl.constexpr = 0
        row_l: gl.constexpr = gl.SliceLayout(1, zero.type.layout)
        st = i % STAGES
        mbarrier.wait(bars.index(READY + st), (i // STAGES) & 1)
        if SKIP:
            a = zero
        else:
            a = warpgroup_mma(k_s.index(st).slice(64 * W, 64, dim=0), q_s.permute((1, 0)), zero, use_acc=False,
                              is_async=True)  # fmt: skip
        return a, st, f4.index(st).slice(64 * W, 64).load(row_l)

    @gluon.jit
    def _consume_fold_pairs(W: gl.constexpr, k_s, q_s, f4, bars, wq, hw, out_row, c, G, n_live, N,
                            ABL: gl.constexpr, HSUM: gl.constexpr):  # fmt: skip
        """Consumer W's loop with fold and a one-scale query: one K = 128 wgmma chain a tile into one accumulator
        (the tensor core's FP8 accumulation: not exact, unlike the K = 32 blocks from zero), two tiles an
        iteration: each tile's MMA runs under the other accumulator's epilogue, and the two accumulators alternate
        without register copies (one accumulator carried across iterations costs a copy of its 32 registers a
        tile).  ABL: 2**ablate (``ABLATE_EPILOGUE``, ``ABLATE_MMA``).  HSUM: the epilogue's head sum on the tensor
        core (``_hsum``, issued and waited for before the next tile's chain, since wgmma groups retire in order;
        its column sum and store under that chain), ``hw`` its weights; else ``_write_scores`` with ``wq``."""
        STAGES: gl.constexpr = k_s.type.shape[0]
        FREE: gl.constexpr = STAGES
        NO_EPI: gl.constexpr = (ABL & 0xCC) != 0  # ablate & ABLATE_EPILOGUE
        NO_MMA: gl.constexpr = (ABL & 0xF0) != 0  # ablate & ABLATE_MMA
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma)
        zero = gl.zeros([64, _HEADS], gl.float32, mma)
        rows = 64 * W + gl.arange(0, 64, layout=row_l)
        acc_b = zero
        fk_b = gl.zeros([64], gl.float32, row_l)
        for p in range(n_live // 2):
            i = 2 * p
            r_b = _epi_issue(acc_b, hw, HSUM)
            a, st, fk_a = _fold_mma(k_s, q_s, f4, bars, i, W, zero, NO_MMA)
            _epi_store(r_b, fk_b, wq, out_row, (c + (i - 1) * G) * _TILE_N, rows, N, i > 0, W, HSUM, NO_EPI)
            acc_a = _mma_done(a, NO_MMA)
            mbarrier.arrive(bars.index(FREE + st))
            r_a = _epi_issue(acc_a, hw, HSUM)
            b, st, fk_b = _fold_mma(k_s, q_s, f4, bars, i + 1, W, zero, NO_MMA)
            _epi_store(r_a, fk_a, wq, out_row, (c + i * G) * _TILE_N, rows, N, True, W, HSUM, NO_EPI)
            acc_b = _mma_done(b, NO_MMA)
            mbarrier.arrive(bars.index(FREE + st))
        i = n_live - 1  # the last tile (its predecessor's epilogue still pending when n_live is odd)
        if n_live % 2 == 1:
            r_b = _epi_issue(acc_b, hw, HSUM)
            a, st, fk_a = _fold_mma(k_s, q_s, f4, bars, i, W, zero, NO_MMA)
            _epi_store(r_b, fk_b, wq, out_row, (c + (i - 1) * G) * _TILE_N, rows, N, i > 0, W, HSUM, NO_EPI)
            acc_a = _mma_done(a, NO_MMA)
            mbarrier.arrive(bars.index(FREE + st))
            r_a = _epi_issue(acc_a, hw, HSUM)
            _epi_store(r_a, fk_a, wq, out_row, (c + i * G) * _TILE_N, rows, N, True, W, HSUM, NO_EPI)
        else:
            r_b = _epi_issue(acc_b, hw, HSUM)
            _epi_store(r_b, fk_b, wq, out_row, (c + i * G) * _TILE_N, rows, N, n_live > 0, W, HSUM, NO_EPI)

    @gluon.jit
    def _epi_issue(acc, hw, HSUM: gl.constexpr):
        """The epilogue's part before the next MMA is issued: with HSUM the head-sum MMA (``_hsum``), else nothing
        (``acc`` itself)."""
        if HSUM:
            return _hsum(acc, hw)
        else:
            return acc

    @gluon.jit
    def _epi_store(r, fk, wq, out_row, first, rows, N, live, W: gl.constexpr, HSUM: gl.constexpr,
                   NO_EPI: gl.constexpr):  # fmt: skip
        """The epilogue's rest, under the next MMA: the scores of tile entries ``first + rows`` from ``r``
        (``_epi_issue``'s): ``_hsum_store`` with HSUM, else ``_write_scores`` on the logits."""
        if HSUM:
            _hsum_store(r, fk, out_row, first + 64 * W, N, live)
        else:
            _write_scores(r, fk, wq, out_row, first + rows, N, live, NO_EPI)

    @gluon.jit
    def _relu_bf16(x):
        """max(x, 0) as bf16 (round to nearest even), two values an instruction: PTX ``cvt.rn.relu.bf16x2.f32``
        (its first source goes to the upper half, so element 1 is passed first)."""
        return gl.inline_asm_elementwise(
            asm="cvt.rn.relu.bf16x2.f32 $0, $2, $1;",
            constraints="=r,r,r",
            args=[x],
            dtype=gl.bfloat16,
            is_pure=True,
            pack=2,
        )

    @gluon.jit
    def _head_weights_tile(wq, hw, bar):
        """Consumer's B operand of the head-sum MMA, ``hw`` [HSUM_N, HEADS] bf16: row 0 the head weights ``wq``
        (fp32, [HEADS] in the accumulator's column layout) rounded to bf16, row 1 what that rounding left (so hi +
        lo holds wq to ~16 bits), the other rows 0.  Stored by the warpgroup, fenced for the async proxy and waited
        for on ``bar`` (count 1: Triton makes the arrive a warpgroup barrier and one thread's arrive)."""
        tl_: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [1, 4], [1, 0])  # [8, 64] over 4 warps
        r = gl.arange(0, _HSUM_N, layout=gl.SliceLayout(1, tl_))
        w = gl.convert_layout(wq, gl.SliceLayout(0, tl_))
        hi = w.to(gl.bfloat16).to(gl.float32)
        lo = (w - hi).to(gl.bfloat16).to(gl.float32)
        tile = gl.where(r[:, None] == 0, hi[None, :], gl.where(r[:, None] == 1, lo[None, :], 0.0))
        hw.store(tile.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(bar)
        mbarrier.wait(bar, 0)

    @gluon.jit
    def _hsum(acc, hw):
        """Σ_h w_h · ReLU(logit) of one consumer's [64 entries, 64 heads] logits on the tensor core: the ReLU'd
        logits rounded to bf16 (``_relu_bf16``) are the A operand in registers -- the accumulator's own fragment
        (an m64 accumulator's registers are the A fragment of the next wgmma: no data moves) -- times ``hw`` (the
        weights' bf16 high and low parts in columns 0 and 1), one m64 nHSUM_N k64 wgmma, waited for.  Returns the
        [64, HSUM_N] fp32 result (columns 0 + 1: the weighted sum).  Nothing else may be in flight (the wait is
        for all groups)."""
        mma_h: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _HSUM_N, 16]
        )
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_h, k_width=2)
        p = gl.convert_layout(_relu_bf16(acc), a_l, assert_trivial=True)
        tok = warpgroup_mma(
            p, hw.permute((1, 0)), gl.zeros([64, _HSUM_N], gl.float32, mma_h), use_acc=False, is_async=True
        )
        return warpgroup_mma_wait(0, deps=[tok])

    @gluon.jit
    def _hsum_store(r, fk, out_row, first, N, live):
        """Scores of ``_hsum``'s result ``r`` times each entry's 2**(s_max - 127) (``fk``; 0 -> -inf: not visible),
        stored for entries ``first`` .. ``first + 63`` (< N, only when ``live``)."""
        row_h: gl.constexpr = gl.SliceLayout(1, r.type.layout)
        s = gl.sum(r, axis=1)
        fkh = gl.convert_layout(fk, row_h)
        offs = first + gl.arange(0, 64, layout=row_h)
        gl.store(out_row + offs, gl.where(fkh > 0.0, s * fkh, float("-inf")), mask=(offs < N) & live)

    @gluon.jit
    def _write_scores(acc, fk, wq, out_row, offs, N, live, SKIP: gl.constexpr = False):
        """ReLU, head weights and head sum of one consumer's [64 entries, 64 heads] logits, times each entry's
        2**(s_max - 127) (``fk``; 0 -> -inf: not visible), stored at ``offs`` (< N, and only when ``live``).  SKIP
        (an ablation): nothing."""
        if not SKIP:
            s = gl.sum(gl.maximum(acc, 0.0) * wq[None, :], axis=1)
            gl.store(out_row + offs, gl.where(fk > 0.0, s * fk, float("-inf")), mask=(offs < N) & live)

    @gluon.jit
    def _mma_done(a, SKIP: gl.constexpr):
        """The accumulator of async MMA ``a`` once it has completed (SKIP: ``a`` is no MMA)."""
        if SKIP:
            return a
        else:
            return warpgroup_mma_wait(0, deps=[a])

    @gluon.jit
    def _block_mma(k_s, q_s, st, W: gl.constexpr, b: gl.constexpr, zero):
        """Async FP8 wgmma of 32-element block b: stage ``st``'s entries [64 W, 64 W + 64) x the query, from zero
        (exact, see the module docstring), [64 entries, 64 heads] fp32."""
        kt = k_s.index(st).slice(64 * W, 64, dim=0).slice(b * _QBLOCK, _QBLOCK, dim=1)
        qt = q_s.slice(b * _QBLOCK, _QBLOCK, dim=1).permute((1, 0))
        return warpgroup_mma(kt, qt, zero, use_acc=False, is_async=True)

    @gluon.jit
    def _mxfp4_scores_ws_kernel(
        q_ptr, w_ptr, d_desc, s_desc, bt_ptr, row_ptr, nv_ptr, out_ptr, stride_qt, stride_qh, stride_wt,
        stride_bt, stride_ot, N, MAX_BLOCKS, NUM_PAGES, BS: gl.constexpr, STAGES: gl.constexpr,
        RAW: gl.constexpr, WORKER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
        FOLD: gl.constexpr = False, PRODUCERS: gl.constexpr = 1, ABLATE: gl.constexpr = 0,
        HSUM: gl.constexpr = False, PDL: gl.constexpr = False,
    ):  # fmt: skip
        """Grid (T, programs a row); ``num_warps=4`` (consumer W = 0) + 4 (consumer W = 1) + 4 (producer) + 1
        (loader; its warpgroup padded to 4).
        Program (t, c) of G a row scores row t's tiles c, c + G, ... (``_my_tiles``): those at or past the row's
        n_visible are written -inf without loads, the others are spread over all G programs.
        ``q`` [T, 64, 128] bf16 (last dim contiguous), ``w`` [T, 64] fp32, ``d_desc`` / ``s_desc``: TMA descriptors
        of the packed bytes [P, bs, 64] uint8 (box [1, BOXR, 64]) and the scale words [P, bs] int32 (box [1, BOXR]),
        BOXR = min(bs, 128); ``out`` [T, N] fp32 scores."""
        pdl_enter_gl(PDL)
        BOXR: gl.constexpr = s_desc.block_type.shape[1]
        NP: gl.constexpr = _TILE_N // BOXR
        k_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        w_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        # the producer writes int32 words, the wgmmas read e4m3 bytes: the same 128-byte swizzle on the same bytes
        k_w = gl.allocate_shared_memory(gl.int32, [STAGES, _TILE_N, _DIM // 4], w_l)
        k_s = _reinterpret(k_w, gl.float8e4nv, [STAGES, _TILE_N, _DIM], k_l)
        q_s = gl.allocate_shared_memory(gl.float8e4nv, [_HEADS, _DIM], k_l)
        # the entries' factors, one buffer each (stores to one buffer would be separated by warpgroup barriers)
        f_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        f0 = gl.allocate_shared_memory(gl.float32, [STAGES, _TILE_N], f_l)
        f1 = gl.allocate_shared_memory(gl.float32, [STAGES, _TILE_N], f_l)
        f2 = gl.allocate_shared_memory(gl.float32, [STAGES, _TILE_N], f_l)
        f3 = gl.allocate_shared_memory(gl.float32, [STAGES, _TILE_N], f_l)
        f4 = gl.allocate_shared_memory(gl.float32, [STAGES, _TILE_N], f_l)
        raw_d = gl.allocate_shared_memory(gl.uint8, [RAW * NP, 1, BOXR, _DIM // 2], d_desc.layout)
        raw_c = gl.allocate_shared_memory(gl.int32, [RAW * NP, 1, BOXR], s_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES + 1 + 2 * RAW, 1], mbarrier.MBarrierLayout())
        # never accessed: its shape carries the page size into the partitions as a constexpr (divisions -> shifts)
        s_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        page_s = gl.allocate_shared_memory(gl.int8, [BS], s_l)
        # the query's per-block factors c_b [4, HEADS] (see _query_prep), read only on the scale-a-block path
        c_s = gl.allocate_shared_memory(gl.float32, [_DIM // _QBLOCK, _HEADS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        # never accessed: its shape (2 with fold, else 1) carries FOLD into the partitions
        fold_s = gl.allocate_shared_memory(gl.int8, [2 if FOLD else 1], s_l)
        # never accessed: its shape (2**ABLATE) carries ABLATE into the partitions
        abl_s = gl.allocate_shared_memory(gl.int8, [1 << ABLATE], s_l)
        # hsum: each consumer's head-weight tile (B of its head-sum MMA) and the barrier its stores are waited on;
        # the shape of hsum_s (never accessed: 2 with hsum, else 1) carries HSUM into the partitions
        hw_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        hw_s = gl.allocate_shared_memory(gl.bfloat16, [2 if HSUM else 1, _HSUM_N, _HEADS], hw_l)
        hbars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        hsum_s = gl.allocate_shared_memory(gl.int8, [2 if HSUM else 1], s_l)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
            mbarrier.init(bars.index(STAGES + i), count=2)
        mbarrier.init(bars.index(2 * STAGES), count=1)
        for i in gl.static_range(2 * RAW):  # raw-ready (TMA bytes), raw-free (the producer)
            mbarrier.init(bars.index(2 * STAGES + 1 + i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(hbars.index(i), count=1)
        args = (
            q_ptr, w_ptr, d_desc, s_desc, bt_ptr, row_ptr, nv_ptr, out_ptr, stride_qt, stride_qh,
            stride_wt, stride_bt, stride_ot, N, MAX_BLOCKS, NUM_PAGES, k_s, k_w, f0, f1, f2, f3, f4, q_s,
            raw_d, raw_c, bars, page_s, c_s, fold_s, abl_s, hw_s, hbars, hsum_s,
        )  # fmt: skip
        if PRODUCERS == 2:  # alternate tiles, each its own stages and raw slots (STAGES, RAW even)
            gl.warp_specialize(
                [(_consumer, (0, args)), (_consumer, (1, args)), (_producer_of, (0, 2, args)),
                 (_producer_of, (1, 2, args)), (_loader, (args,))],
                [4, 4, 4, 1],
                [WORKER_REGS, PRODUCER_REGS, PRODUCER_REGS, LOADER_REGS],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                [(_consumer, (0, args)), (_consumer, (1, args)), (_producer_of, (0, 1, args)), (_loader, (args,))],
                [4, 4, 1],
                [WORKER_REGS, PRODUCER_REGS, LOADER_REGS],
            )


if HAVE_GLUON:  # the TMA boxes' shared layouts (unswizzled), built once: ~9 us of host time a call otherwise
    _KEY_BOX_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
    _SCALE_BOX_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)

GLUON_STAGES = 4
GLUON_RAW = 4  # raw tiles in flight + 1 (8.5 KB each)
GLUON_WORKER_REGS = 192
GLUON_PRODUCER_REGS = 96
GLUON_LOADER_REGS = 32
GLUON_PRODUCERS = 2  # producer warpgroups (1 or 2: alternate tiles; 2 measured 10-13 % faster at 1M B = 4-64, H200)
# ``ablate`` (timing studies only: the scores are wrong): bits of work left out, to see which partition bounds the time
ABLATE_CONVERT = 1  # the producers store no keys (their factors still)
ABLATE_EPILOGUE = 2  # the consumers write nothing (their MMAs still run); fold's one-scale loop only
ABLATE_MMA = 4  # the consumers run no MMA (the epilogue on zeros); fold's one-scale loop only
# (consumer, producer) registers a thread with two producers: the 20 warps (8 consumer, 8 producer, the loader's
# padded 4) launch at 96 registers a thread, a pool of 20 x 96 a lane that the partitions share, so consumer +
# producer <= 224 with the loader at 32.  The consumers' scale-a-block loop keeps four block accumulators live
# (spills below ~176); the producers do not spill at 48 (sass_report, triton 3.6, exact and fold).
GLUON_REGS_TWO_PRODUCERS = (176, 48)


def _prep_query(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8mma's fast-path query: each head's values times 2**(127 - e) as e4m3, e the biased exponent of the head's
    largest |value| (127 for an all-zero head), and the weights times 2**(e - 127 + 6) (the query scale and the
    keys' code scale).  Returns (q8 [T, 64, 128] e4m3, wq [T, 64] fp32, exact [T] bool: q8 holds the query
    exactly)."""
    qf = q.float()
    amax = qf.abs().amax(dim=-1)
    e = (amax.view(torch.int32) >> 23) & 255
    e = torch.where(e == 0, torch.full_like(e, 127), e)
    up = ((254 - e) << 23).view(torch.float32)  # 2**(127 - e)
    q8 = (qf * up[..., None]).to(torch.float8_e4m3fn)
    back = q8.float() / up[..., None]
    exact = (back == qf).all(dim=-1).all(dim=-1)
    wq = weights.float() * ((e << 23).view(torch.float32) * 2.0**CODE_SCALE_LOG2)  # 2**(e - 127) * 2**6
    return q8.contiguous(), wq.contiguous(), exact


def gluon_unsupported(q: torch.Tensor, keys) -> str | None:
    """Why the Gluon kernel cannot score ``q`` [T, H, D] against ``keys`` (``KeyPages``), or None when it can: an
    sm_90 CUDA device outside the interpreter, Triton with Gluon's Hopper TMA API, 64 heads x 128, a power-of-two
    page of >= 64 entries, and key bytes and scale bytes laid out as TMA needs (rows contiguous, 16-byte aligned
    page strides and bases; true of the pool's pages)."""
    from dsv4.kernels.dispatch import interpreter_enabled, sm_major

    if not HAVE_GLUON:
        return "triton without Gluon's Hopper TMA API"
    if not q.is_cuda or interpreter_enabled():
        return "needs a CUDA device (not the interpreter)"
    if sm_major(q.device) != 9:
        return "needs an sm_90 device"
    if tuple(q.shape[1:]) != (HEADS, DIM):
        return f"needs q [T, {HEADS}, {DIM}], got {list(q.shape)}"
    data, scale = keys.data, keys.scale
    bs = data.shape[1]
    if bs & (bs - 1) or bs < TILE_N // 2:
        return f"needs a power-of-two page of >= {TILE_N // 2} entries, got {bs}"
    for name, x, row in (("key bytes", data, DIM // 2), ("scale bytes", scale, DIM // QBLOCK)):
        if x.stride(2) != 1 or x.stride(1) != row or x.stride(0) % 16 or x.data_ptr() % 16:
            return f"{name} not laid out for TMA (strides {tuple(x.stride())})"
    return None


PROGRAM_OVERHEAD_TILES = 2  # a program's start (query prep, ring fill) in tiles' time, for programs_per_row


@functools.lru_cache(maxsize=4096)
def programs_per_row(T: int, n_tiles: int, sms: int) -> int:
    """Programs a row G for T rows of n_tiles 128-entry tiles on ``sms`` SMs (one program an SM at a time): the G
    in [1, n_tiles] of least modelled time for rows whose tiles are all visible, waves x (tiles a program + a
    program's start): ceil(T G / sms) x (ceil(n_tiles / G) + ``PROGRAM_OVERHEAD_TILES``); the smallest such G.
    Rows shorter than max_entries cost less and stay spread: a program's tiles are strided (``_my_tiles``).
    E.g. 132 SMs, 2,048 tiles (1M tokens): T = 1 -> 128, T = 4 -> 33, T = 64 -> 2, T = 100 -> 25."""
    best, best_cost = 1, None
    for g in range(1, min(n_tiles, 4 * sms) + 1):
        cost = -(-T * g // sms) * (-(-n_tiles // g) + PROGRAM_OVERHEAD_TILES)
        if best_cost is None or cost < best_cost:
            best, best_cost = g, cost
    return best


def launch_gluon_scores(
    q, weights, keys, block_table, token_row, n_visible, max_entries: int, tiles=None, stages=None, raw=None,
    fold: bool = False, producers: int | None = None, regs: tuple[int, int] | None = None, ablate: int = 0,
    hsum: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The kernel's scores [T, max_entries] fp32 (-inf where not visible).  No host sync; preconditions:
    ``gluon_unsupported`` is None, ``block_table`` / ``token_row`` / ``n_visible`` contiguous int32, ``weights``
    [T, 64] fp32 with unit stride.  ``fold``: the block scales folded into the keys' e4m3 codes and one K = 128
    wgmma chain an entry tile (the encoding of ``scores._fold_tables``): not exact (the tensor core's FP8
    accumulation, and blocks more than ``scores._FOLD_MAX_D`` binades below their key's largest flushed to
    zero).  ``producers``: producer warpgroups (1, or 2 taking alternate tiles; ``GLUON_PRODUCERS``), ``regs``:
    (consumer, producer) registers a thread (default by producers and fold), ``ablate``: bits of ``ABLATE_*`` (work
    left out, for timing studies; the scores are then wrong).  ``hsum`` (with ``fold``; the one-scale query path):
    the weighted head sum on the tensor core (``_consume_fold_pairs`` with ``HSUM``): the ReLU'd logits are rounded
    to bf16 first (as the official reference's bf16 logits are), the weights kept to ~16 bits, so each term is within
    2**-9 of its exact value: an error bound of 2**-9 · Σ_h |w_h| ReLU(logit_h) an entry on top of fold's."""
    from dsv4.kernels.dispatch import num_sms, pdl_launch

    producers = producers or GLUON_PRODUCERS
    if regs is None:
        regs = (GLUON_WORKER_REGS, GLUON_PRODUCER_REGS) if producers == 1 else GLUON_REGS_TWO_PRODUCERS

    T = q.shape[0]
    out = torch.empty(T, max_entries, dtype=torch.float32, device=q.device)
    if T == 0 or max_entries == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    sw = _scores._scale_words(keys.scale)
    data = keys.data
    P, bs, row_bytes = data.shape
    boxr = min(bs, TILE_N)
    d_desc = TensorDescriptor(data, [P, bs, row_bytes], list(data.stride()), [1, boxr, row_bytes], _KEY_BOX_LAYOUT)
    s_desc = TensorDescriptor(sw, [P, bs], list(sw.stride()), [1, boxr], _SCALE_BOX_LAYOUT)
    n_tiles = -(-max_entries // TILE_N)
    grid = (T, programs_per_row(T, n_tiles, num_sms(q.device)) if tiles is None else -(-n_tiles // tiles))
    _mxfp4_scores_ws_kernel[grid](
        q, weights, d_desc, s_desc, block_table, token_row, n_visible, out, q.stride(0), q.stride(1),
        weights.stride(0), block_table.stride(0), out.stride(0), max_entries, block_table.shape[1], P, bs,
        STAGES=stages or GLUON_STAGES, RAW=raw or GLUON_RAW, WORKER_REGS=regs[0], PRODUCER_REGS=regs[1],
        LOADER_REGS=GLUON_LOADER_REGS, FOLD=bool(fold), PRODUCERS=producers, ABLATE=ablate,
        HSUM=bool(hsum) and bool(fold), num_warps=4, **pdl_launch(q.device),
    )  # fmt: skip
    return out


def indexer_scores_gluon(
    q,
    weights,
    keys,
    block_table,
    token_row,
    n_visible,
    max_entries: int,
    tiles=None,
    stages: int = GLUON_STAGES,
    raw: int = GLUON_RAW,
    fold: bool = False,
    producers: int = GLUON_PRODUCERS,
    regs: tuple[int, int] | None = None,
    ablate: int = 0,
    hsum: bool = False,
):
    """The scores of ``indexer_scores`` (same arguments; 64 heads) by this kernel, with its launch knobs:
    ``tiles`` 128-entry tiles a program (programs a row = cdiv(tiles of max_entries, tiles); None:
    ``programs_per_row``), ``stages`` / ``raw`` the depths of its stage and raw rings (powers of two), ``fold``
    (``launch_gluon_scores``), ``producers``, ``regs``, ``ablate``, ``hsum`` (``launch_gluon_scores``; needs fold).
    ValueError for
    arguments ``indexer_scores`` refuses, for bad knobs, and where ``gluon_unsupported`` says why it cannot run."""
    _scores._check_common(q, weights, block_table, token_row, n_visible, max_entries)
    _scores._check_mxfp4_keys(keys, q.device)
    for name, v in (("tiles", tiles), ("stages", stages), ("raw", raw)):
        if v is not None and (not isinstance(v, int) or v < 1 or (name != "tiles" and v & (v - 1))):
            kind = "an int >= 1" if name == "tiles" else "a power of two"
            raise ValueError(f"indexer_scores_gluon: {name}: expected {kind}, got {v!r}")
    if not isinstance(fold, bool):
        raise ValueError(f"indexer_scores_gluon: fold: expected a bool, got {fold!r}")
    if not isinstance(hsum, bool) or (hsum and not fold):
        raise ValueError(f"indexer_scores_gluon: hsum: expected a bool, True only with fold=True, got {hsum!r}")
    if hsum and ablate:
        raise ValueError("indexer_scores_gluon: hsum: no ablations (its loop has none)")
    if producers not in (1, 2):
        raise ValueError(f"indexer_scores_gluon: producers: expected 1 or 2, got {producers!r}")
    if ablate not in range(8):
        raise ValueError(f"indexer_scores_gluon: ablate: expected bits of ABLATE_* (0-7), got {ablate!r}")
    if producers == 2 and ((stages or GLUON_STAGES) < 2 or (raw or GLUON_RAW) < 2):
        raise ValueError(f"indexer_scores_gluon: two producers need stages and raw >= 2, got {stages}, {raw}")
    if regs is not None and (
        len(regs) != 2 or any(not isinstance(r, int) or r % 8 or not 24 <= r <= 256 for r in regs)
    ):
        raise ValueError(
            f"indexer_scores_gluon: regs: expected (consumer, producer) multiples of 8 in [24, 256], got {regs!r}"
        )
    why = gluon_unsupported(q, keys)
    if why is not None:
        raise ValueError(f"indexer_scores_gluon: {why}")
    return launch_gluon_scores(
        q, weights.contiguous(), keys, block_table.contiguous(), token_row.contiguous(), n_visible.contiguous(),
        max_entries, tiles, stages, raw, fold, producers, regs, ablate, hsum,
    )  # fmt: skip
