"""Gluon (sm_90) sparse decode attention reading the FP8 cache entries directly (``path="gluon_fused"``, the
default on sm_90).

The gathered path (``_gather_dequant_kernel`` + the dense kernel of ``_gluon_dense_attention``) writes every
attended entry as bf16 into a workspace and reads it back: at V4-Pro B = 64 the gather launch alone is 34 us of
~94.  This kernel removes the workspace: four warpgroups (16 warps) per (row, 64-head block, key split) program.

- **Producers** H = 0, 1 (4 warps each, 48 registers): producer H owns half H of every entry (H = 0: FP8 tiles
  0-3, H = 1: tiles 4-6 and the 64 bf16 rope lanes).  Per key block (``BLOCK_N`` entries of cache A's index list,
  then cache B's) it loads the index rows two blocks ahead, ``cp.async``s its part of every indexed entry into a
  raw ring of ``RAW`` stages and loads each key's 8 scale bytes as one int64, one block ahead; it then
  dequantises the block (an e4m3 value times a power of two: exact in bf16) into its [BLOCK_N, 256] bf16
  NVMMA half-tile of one of ``STAGES`` stages with one store, H = 0 also writes each key's bias (0, or -inf for
  -1 / out-of-range / past-the-list keys), and arrives on the stage's ready barrier (count 2).  They produce one
  block past the end (all keys masked: zeros, -inf), which pads an odd block count to whole pairs.
- **Consumers** W = 0, 1, symmetric pairs (``_consumer``, since session 29): blocks in pairs, W computes block
  2 i + W's logits over all 512 dims (q's two halves, the stage's two half-tiles); the two exchange their blocks'
  row maxima, so both compute their softmax at once in the pair's frame, and hand each other bf16 probabilities
  and row sums through shared memory; each rescales its accumulator once a pair, multiplies both blocks' P with
  its own value half (dims [256 W, 256 W + 256)) and frees both stages once those P.V have retired (count 2).
  P.V is two m64 n128 wgmmas: ptxas refuses a 256-wide one under the 128 registers a thread gets at launch with
  16 warps, even where ``setmaxnreg`` raises the partition's budget (208 for the consumers).
- Before: the dense kernel's lockstep loop (until session 28: W owned head dims [256 W, 256 W + 256) of every QK,
  the two swapped partial logits once per block and both ran every block's softmax), then the seesaw (session 28:
  W = 1's softmax waited for W = 0's max, probabilities and sums, and each rescaled twice a pair).

Numerics equal the gathered path's (the workspace held the same exact bf16 values); the consumers apply each
pair's softmax on the running max the pair has reached (an online-softmax order, within the same tolerance).

Session 29 (2026-12-06, H100, CUDA-graph time, ``profile_attention.py --fused``):

- Ablations (``ABLATE``, results not checked), V4-Pro B = 64 at 72.9 us: the consumers alone (the producers copy
  and dequantise nothing) 57.6, their softmax and handoffs alone (no MMAs either) 30.8; the producers alone (the
  consumers free each stage once ready) 39.2, with their copies but no index loads 29.8, their skeleton 11.3.  So
  the consumers bound the kernel, and about half of their time is their non-MMA chain, which the tensor pipe does
  not overlap.  At 64-key blocks (two stages; only possible here with the raw rings unused) the consumers alone
  take 50.8, their chain 23.9.
- Symmetric pairs against the seesaw, three runs: V4-Pro B = 64 72.6 / 73.5 -> 70.9 / 71.7 us, V4-Flash B = 64
  37.9 / 37.5 -> 37.8 / 37.6, V4-Pro B = 8 25.8 -> 25.3, HCA-8192 B = 8 60.2 -> 59.0; 126 fewer instructions a
  pair in each consumer.  Measured and removed: issuing the next pair's QK early (W = 0 only, as three stages
  allow: 73.7; the seesaw's own such variant 70.6 / 73.0 / 70.7 against 72.8 / 72.6 / 72.9), and producers loading
  the entries into registers as 32-bit words instead of ``cp.async`` into raw stages (no raw rings, so a fourth
  stage fits and both consumers can issue ahead): 86.1 us with three stages or four, both schedules: the
  producers, waiting on their loads, fell behind.

Session 28 (2026-12-06, CUDA-graph time, ``profile_attention.py --fused``):

- The producers' e4m3 -> bf16 step three ways (``DEQ``; all exact for every code and scale byte on the GPU): through
  fp32 (F2FP unpack, two HADD2.F32, FMUL, F2FP pack a pair), with the pack replaced by a ``prmt`` (a truncation,
  since removed), and with integer bit moves + ``mul.rn.bf16x2`` (no conversion instruction).  H100, V4-Pro B = 64:
  74.9 / 76.7 / 74.7 us; V4-Flash B = 64 38.4 / 38.6 / 38.4: the conversion pipe is not what bounds this kernel
  (FlashMLA's sparse FP8 kernel was dequantisation-bound; ours waits on its consumers' dependent chain).  The
  default stays the fp32 form.
- Seesaw against lockstep (H200): V4-Pro B = 64 73.4 -> 70.6 us (263 -> 274 TFLOP/s), V4-Flash B = 64 34.3 -> 33.1,
  HCA-8192 B = 8 61.2 -> 59.2; with the integer dequantisation as well 70.5 / 33.2 / 59.6.  Every wgmma still
  retires inside its iteration (ptxas serialises them otherwise), so a warpgroup cannot start its next pair's QK
  while it waits for the other's probabilities; that wait is what is left between this kernel and the tensor pipe.

H200 2026-12-04 (torch.profiler device time / CUDA-graph time of the whole call), and what shaped it:

- V4-Pro B = 64 (128 window + 1,024 top-k keys): 73.2 us / 73.6 us = 263 TFLOP/s, vs gather 34.2 + Gluon dense
  58.8 (94.1 us graph).  V4-Flash B = 64 29.2 + combine 4.5 / 34.8 us (vs 52.4); HCA-8192 B = 8 V4-Flash 61.0 us.
- First version (session 9): each consumer dequantised its own half at the top of its iteration: 121.9 us (the
  dequantisation on the consumers' critical chain).
- One producer warpgroup: 91.4 us; Nsight's per-instruction stall samples put 24 % of all samples on the
  consumers' wait for a ready stage and 17 % of the producer's on an index load whose value was selected
  between the two caches right after the load (long scoreboard).  Loading the index rows a block earlier with
  no arithmetic on them, picking the cache as scalars, reading the scale bytes as one int64 and converting them
  a block later: 75.9 us.  Two producers (a half each): 73.2 us.
- Triton puts a warpgroup barrier between two stores to one shared buffer (its alias analysis sees the whole
  buffer): the dequantisation stores each half-tile with one [BLOCK_N, 256] store, not one per 64-wide tile.
- A select between two per-key offset tensors loses their 16-byte divisibility in Triton's axis analysis, and
  ``cp.async`` then refuses them (1-byte copies); the cache is picked as scalars (``_pick``) and the offsets
  are annotated 16-byte multiples, which the host checks (``_fused_aligned``).
"""

from __future__ import annotations

import torch

from dsv4.kernels.attention._gluon_dense_attention import BLOCK_HEADS, HALF, HAVE_GLUON, WG_THREADS

TILE = 64  # fp8 values per UE8M0 scale (the entry format's tile)
BF16_2_POW_120 = 0x7B80  # bf16 bits of 2**120: the bias gap between e4m3 (7) and bf16 (127)


def e4m3_to_bf16_bits(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """PyTorch model of the producers' integer dequantisation (``DEQ=2``, ``_e4m3_to_bf16_int``): e4m3 ``codes``
    (uint8) times ``2**(scale_byte - 127)`` (uint8, broadcastable) -> bf16.

    The 7 low bits of a code (exponent, mantissa) are moved to bits 10..4 of a 16-bit lane and its sign to bit 15:
    read as bf16 that is the e4m3 value times 2**-120 (the exponent field keeps e4m3's 4 bits; an e4m3 subnormal
    becomes a bf16 subnormal with the same ratio).  Multiplying by 2**120 is exact and the multiply by the scale
    rounds once, so the result is the reference's ``bf16(fp32(code) * scale)`` for every code but the two NaNs
    (0x7F / 0xFF, which the quantiser never writes: they read as +-480 times the scale).  A scale byte of 0 is the
    bf16 subnormal 2**-127."""
    p = codes.to(torch.int32)
    lane = ((p + 15 * (p & 0x80)) << 4).to(torch.int16)  # bit 7 -> 15, bits 6..0 -> 10..4 (wraps: the bf16 bits)
    b = scale_bytes.to(torch.int32)
    scale = torch.where(b == 0, 0x40, b << 7).to(torch.int16).view(torch.bfloat16)
    two120 = torch.tensor(BF16_2_POW_120, dtype=torch.int16).view(torch.bfloat16)
    return lane.view(torch.bfloat16) * two120 * scale


if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from dsv4.kernels._gluon_sync import pdl_enter_gl
    from dsv4.kernels.attention._gluon_dense_attention import (
        _cp_async,
        _q_half_to_smem,
        _split_blocks,
        _write_rows,
    )

    _HALF = gl.constexpr(HALF)
    _QUARTER = gl.constexpr(HALF // 2)
    _BH = gl.constexpr(BLOCK_HEADS)
    _WG_THREADS = gl.constexpr(WG_THREADS)
    _TILE = gl.constexpr(TILE)

    @gluon.jit
    def _pick(use_a, ca, cb):
        """The cache block ``b`` reads (``use_a``: cache A): each field selected as a scalar, so the per-key
        arithmetic is done once (a select of two per-key offset tensors loses their alignment in Triton's analysis,
        and cp.async then refuses them)."""
        (a_idx, a_sidx, a_keys, a_bs, a_slots, a_nope, a_rope, a_scale, a_snp, a_snr, a_srp, a_srr, a_ssp, a_ssr) = ca
        (b_idx, b_sidx, b_keys, b_bs, b_slots, b_nope, b_rope, b_scale, b_snp, b_snr, b_srp, b_srr, b_ssp, b_ssr) = cb
        return (
            gl.where(use_a, a_idx, b_idx), gl.where(use_a, a_sidx, b_sidx), gl.where(use_a, a_keys, b_keys),
            gl.where(use_a, a_bs, b_bs), gl.where(use_a, a_slots, b_slots), gl.where(use_a, a_nope, b_nope),
            gl.where(use_a, a_rope, b_rope), gl.where(use_a, a_scale, b_scale), gl.where(use_a, a_snp, b_snp),
            gl.where(use_a, a_snr, b_snr), gl.where(use_a, a_srp, b_srp), gl.where(use_a, a_srr, b_srr),
            gl.where(use_a, a_ssp, b_ssp), gl.where(use_a, a_ssr, b_ssr),
        )  # fmt: skip

    @gluon.jit
    def _block_slots(b, blk_end, a_blocks, pid_t, ca, cb, BLOCK_N: gl.constexpr, IDX: gl.constexpr = True):
        """Block ``b``'s index entries (physical slots, -1 = none or past the list / the split), [BLOCK_N] int32 in
        the key layout of ``_issue_block``.  Loaded a block before ``_issue_block`` needs them (one load, nothing
        computed from it here, so its latency overlaps the iteration).  ``IDX`` False (an ablation, ``ABLATE`` bit
        4): no load, the block's key positions as slots."""
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, 4, 1], [2, 1, 0])
        key_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, l3))
        # a block lies wholly in one cache (cache A's list is padded to whole blocks)
        use_a = b < a_blocks
        (idx, sidx, keys, _bs, _sl, _n, _r, _s, _a, _b, _c, _d, _e, _f) = _pick(use_a, ca, cb)
        offs = gl.where(use_a, b, b - a_blocks) * BLOCK_N + gl.arange(0, BLOCK_N, layout=key_l)
        if IDX:
            return gl.load(idx + pid_t * sidx + offs, mask=(offs < keys) & (b < blk_end), other=-1)
        return gl.where((offs < keys) & (b < blk_end), offs, -1)  # (an ablation: slots 0, 1, ... of the page pool)

    @gluon.jit
    def _issue_block(H: gl.constexpr, b, slot, a_blocks, ca, cb, r8, rr, bar, BLOCK_N: gl.constexpr,
                     GATHER: gl.constexpr = True):  # fmt: skip
        """cp.async of block ``b``'s half H into the raw stage: FP8 tiles 4 H .. 4 H + 3 (H = 1: 4-6) into ``r8``
        ([4, BLOCK_N, 64] fp8, tile-major) and, H = 1, the rope lanes into ``rr`` ([BLOCK_N, 64] bf16); ``slot`` the
        block's index entries (``_block_slots``).  Every thread of producer H arrives on ``bar`` (count 128) when its
        copies land.  Masked keys (invalid, or past the split) read nothing and are zero-filled.

        Returns (valid [BLOCK_N] bool, the 8 scale bytes of each key as one int64 [BLOCK_N], 0 where masked): they
        are only unpacked when the block is dequantised (an iteration later), so the load latency stays hidden.
        ``GATHER`` False (an ablation, ``ABLATE`` bit 0): nothing is copied or loaded (scale bytes 0)."""
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [1, 8, 4], [1, 4, 1], [2, 1, 0])
        lr: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        kt: gl.constexpr = gl.SliceLayout(2, gl.BlockedLayout([1, 1, 16], [8, 1, 4], [4, 1, 1], [2, 1, 0]))
        use_a = b < a_blocks
        (_i, _si, _k, bs, n_slots, nope, rope, scale, snp, snr, srp, srr, ssp, ssr) = _pick(use_a, ca, cb)
        valid = (slot >= 0) & (slot < n_slots)
        if GATHER:
            slot = gl.where(valid, slot, 0)
            page = (slot // bs).to(gl.int64)
            row = (slot % bs).to(gl.int64)
            # FP8 tiles [4, BLOCK_N, 64]; entry rows are 16-byte aligned (the host checks)
            t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
            c = gl.arange(0, _TILE, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
            off8 = gl.multiple_of(page * snp + row * snr, 16)
            m8 = valid[None, :, None] & (t < 4 - H)[:, None, None] & (c < _TILE)[None, None, :]
            col = ((4 * H + t) * _TILE)[:, None, None] + c[None, None, :]
            _cp_async(r8, nope + off8[None, :, None] + col, mask=m8)
            if H == 1:  # rope lanes [BLOCK_N, 64] bf16
                vr = gl.convert_layout(valid, gl.SliceLayout(1, lr))
                offr = gl.multiple_of(gl.convert_layout(page * srp + row * srr, gl.SliceLayout(1, lr)), 8)
                cr = gl.arange(0, _TILE, layout=gl.SliceLayout(0, lr))
                _cp_async(rr, rope + offr[:, None] + cr[None, :], mask=vr[:, None] & (cr < _TILE)[None, :])
            async_copy.mbarrier_arrive(bar, increment_count=False)
            # the 7 UE8M0 bytes + 1 pad byte of each key: one int64 (``scale`` is the host's int64 view)
            vs = gl.convert_layout(valid, gl.SliceLayout(1, kt))
            offs = gl.convert_layout(page * ssp + row * ssr, gl.SliceLayout(1, kt))
            sbytes = gl.load(scale + offs, mask=vs, other=0)
        else:
            sbytes = gl.zeros([BLOCK_N], gl.int64, gl.SliceLayout(1, kt))
        return valid, sbytes

    @gluon.jit
    def _e4m3_to_bf16_int(x8, sc):
        """e4m3 bytes ``x8`` (uint8) times ``sc`` (bf16 powers of two, broadcast to ``x8``'s shape) -> bf16, with
        integer ops and bf16 multiplies instead of conversions (``e4m3_to_bf16_bits`` is its PyTorch model): each
        byte's 7 low bits go to bits 10..4 of a 16-bit lane and its sign to bit 15 (``(p + 15 s) << 4``), which
        reads as the bf16 ``v * 2**-120`` (e4m3 subnormals as bf16 subnormals); times ``2**120`` (exact) and times
        the scale (one rounding, as the reference's fp32 product rounded to bf16).  Four elements a call: two
        ``prmt`` spread the bytes into 16-bit lanes, then per pair and, shift, mad, and two ``mul.rn.bf16x2``."""
        return gl.inline_asm_elementwise(
            """
            {
            .reg .b32 lo, hi, s, c, z;
            mov.b32 z, 0;
            mov.b32 c, 0x7B807B80;  // 2**120 twice (BF16_2_POW_120)
            prmt.b32 lo, $2, z, 0x4140;
            prmt.b32 hi, $2, z, 0x4342;
            and.b32 s, lo, 0x00800080;
            mad.lo.u32 lo, s, 15, lo;
            shl.b32 lo, lo, 4;
            and.b32 s, hi, 0x00800080;
            mad.lo.u32 hi, s, 15, hi;
            shl.b32 hi, hi, 4;
            mul.rn.bf16x2 lo, lo, c;
            mul.rn.bf16x2 hi, hi, c;
            mul.rn.bf16x2 $0, lo, $3;
            mul.rn.bf16x2 $1, hi, $3;
            }
            """,
            "=r,=r,r,r,r",
            [x8, sc],
            dtype=gl.bfloat16,
            is_pure=True,
            pack=4,
        )

    @gluon.jit
    def _dequant_half(H: gl.constexpr, r8, rr, sbytes, valid, kb, bias, BLOCK_N: gl.constexpr, DEQ: gl.constexpr):
        """Raw stage of half H -> the bf16 half-tile ``kb`` [BLOCK_N, 256] (one store): FP8 tile 4 H + t times its
        scale into dims [64 t, 64 t + 64), and for H = 1 the rope lanes into [192, 256) (dims 448-511 of the
        entry).  H = 0 also writes ``bias`` [BLOCK_N] fp32: 0 for valid keys, -inf for the others."""
        l3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [8, 1, 4], [4, 1, 1], [2, 1, 0])
        kl: gl.constexpr = gl.SliceLayout(1, l3)
        t4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
        x8 = r8.permute((1, 0, 2)).load(l3)  # [BLOCK_N, 4, 64] e4m3: key, tile, byte
        sb = ((sbytes[:, None] >> (8 * (4 * H + t4))[None, :]) & 0xFF).to(gl.int32)  # [BLOCK_N, 4] UE8M0 bytes
        if DEQ == 2:  # integer ops + bf16 multiplies; 2**(byte - 127) as bf16 (byte 0: the subnormal 2**-127)
            sc = gl.where(sb == 0, 0x40, sb << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
            y = _e4m3_to_bf16_int(x8.to(gl.uint8, bitcast=True), sc[:, :, None])
            if H == 1:  # "tile 7" is the rope lanes
                y = gl.where((t4 == 3)[None, :, None], rr.load(kl)[:, None, :], y)
        else:  # via fp32: e4m3 -> f16 -> f32 conversions, times 2**(byte - 127) (exact; byte 0: 2**-127)
            y = x8.to(gl.float32) * gl.where(sb == 0, 0x400000, sb << 23).to(gl.float32, bitcast=True)[:, :, None]
            if H == 1:
                y = gl.where((t4 == 3)[None, :, None], rr.load(kl).to(gl.float32)[:, None, :], y)
            y = y.to(gl.bfloat16)
        kb.store(gl.reshape(y, [BLOCK_N, 4 * _TILE]))
        if H == 0:
            bl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            bias.store(gl.where(gl.convert_layout(valid, bl), 0.0, float("-inf")))

    @gluon.jit
    def _producer(H: gl.constexpr, args, DEQ: gl.constexpr, ABLATE: gl.constexpr):
        """Producer warpgroup H (half H of every entry): blocks [blk_start, blk_end] (one past the end) of this
        program's split.

        Barriers (see ``_sparse_attn_ws_kernel``): raw-ready H RAW + r (count 128, cp.async), stage-ready s (count
        2: one arrival a producer), stage-free s (count 2: each consumer after its P.V of the stage's block)."""
        (
            q_ptr, stride_qt, stride_qh, sink_ptr, ca, cb, a_blocks, n_blocks, blocks_per_split,
            out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr, ws_splits,
            num_heads, qk_scale_log2, q_s, kb_s, r8_s, rr_s, bias_s, x0_s, x1_s, v_s, bars,
        ) = args  # fmt: skip
        RAW: gl.constexpr = rr_s.type.shape[0]
        STAGES: gl.constexpr = kb_s.type.shape[0] // 2
        BLOCK_N: gl.constexpr = bias_s.type.shape[1]
        READY: gl.constexpr = 2 * RAW
        FREE: gl.constexpr = 2 * RAW + STAGES
        RB: gl.constexpr = H * RAW
        GATHER: gl.constexpr = (ABLATE & 1) == 0
        DEQUANT: gl.constexpr = (ABLATE & 2) == 0
        IDX: gl.constexpr = (ABLATE & 16) == 0
        # block i + 1's copies are issued into its raw stage before block i's is dequantised
        gl.static_assert(RAW >= 2, "the producers need at least two raw stages")
        pid_t = gl.program_id(0).to(gl.int64)
        blk_start, blk_end, n_my = _split_blocks(blocks_per_split, n_blocks)

        # index rows two blocks ahead, cp.async + scale bytes one block ahead of the dequantisation
        slots_next = _block_slots(blk_start + 1, blk_end, a_blocks, pid_t, ca, cb, BLOCK_N, IDX)
        slots = _block_slots(blk_start, blk_end, a_blocks, pid_t, ca, cb, BLOCK_N, IDX)
        valid, sbytes = _issue_block(H, blk_start, slots, a_blocks, ca, cb, r8_s.index(RB), rr_s.index(0),
                                     bars.index(RB), BLOCK_N, GATHER)  # fmt: skip
        # one block past the end: it pads an odd count to whole pairs (all keys masked)
        for i in range(n_my + 1):
            slots_after = _block_slots(blk_start + i + 2, blk_end, a_blocks, pid_t, ca, cb, BLOCK_N, IDX)
            # the next block's raw stage was dequantised an iteration ago (all threads passed that stage-ready
            # arrive's warpgroup barrier)
            rn = (i + 1) % RAW
            valid_n, sbytes_n = _issue_block(H, blk_start + i + 1, slots_next, a_blocks, ca, cb, r8_s.index(RB + rn),
                                             rr_s.index(rn), bars.index(RB + rn), BLOCK_N, GATHER)  # fmt: skip
            r = i % RAW
            st = i % STAGES
            if GATHER:
                mbarrier.wait(bars.index(RB + r), (i // RAW) & 1)
            mbarrier.wait(bars.index(FREE + st), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
            if DEQUANT:
                _dequant_half(H, r8_s.index(RB + r), rr_s.index(r), sbytes, valid, kb_s.index(2 * st + H),
                              bias_s.index(st), BLOCK_N, DEQ)  # fmt: skip
            elif H == 0:
                bl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
                bias_s.index(st).store(gl.where(gl.convert_layout(valid, bl), 0.0, float("-inf")))
            fence_async_shared()
            mbarrier.arrive(bars.index(READY + st))
            valid = valid_n
            sbytes = sbytes_n
            slots_next = slots_after

    @gluon.jit
    def _qk_full(q_s, kb_s, st, zero_s):
        """Issue the logits of the block in stage ``st`` over all 512 dims (q's halves times the stage's half-tiles,
        one accumulator): asynchronous, returns the token."""
        tok = warpgroup_mma(q_s.index(0), kb_s.index(2 * st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return warpgroup_mma(q_s.index(1), kb_s.index(2 * st + 1).permute((1, 0)), tok, is_async=True)

    @gluon.jit
    def _qk(q_s, kb_s, st, zero_s, MMA: gl.constexpr):
        """The logits of the block in stage ``st`` (``_qk_full``, waited for); zeros without ``MMA`` (an ablation)."""
        if MMA:
            return warpgroup_mma_wait(0, deps=[_qk_full(q_s, kb_s, st, zero_s)])
        return zero_s

    @gluon.jit
    def _pv(p, v, acc0, acc1, MMA: gl.constexpr):
        """Issue ``p`` [64, BLOCK_N] times the value half ``v`` [BLOCK_N, 256] into (acc0, acc1) (dims [0, 128),
        [128, 256) of the half) as two m64 n128 wgmmas; nothing without ``MMA`` (an ablation)."""
        if MMA:
            acc0 = warpgroup_mma(p, v.slice(0, _QUARTER, dim=1), acc0, is_async=True)
            acc1 = warpgroup_mma(p, v.slice(_QUARTER, _QUARTER, dim=1), acc1, is_async=True)
        return acc0, acc1

    @gluon.jit
    def _pv_wait(acc0, acc1, MMA: gl.constexpr):
        """Retire every wgmma in flight (the accumulators' last group)."""
        if MMA:
            acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
        return acc0, acc1

    @gluon.jit
    def _rescaled(acc0, acc1, alpha_s):
        """The accumulator halves times the per-row factor ``alpha_s`` [64] (the row layout of the logits)."""
        alpha = gl.convert_layout(alpha_s, gl.SliceLayout(1, acc0.type.layout))[:, None]
        return acc0 * alpha, acc1 * alpha

    @gluon.jit
    def _consumer(W: gl.constexpr, args, ABLATE: gl.constexpr, LAZY: gl.constexpr):
        """Consumer warpgroup W, symmetric pairs (since session 29): blocks go in pairs (2 i, 2 i + 1) and W computes
        block 2 i + W's logits over all 512 dims (q's two halves times the stage's two half-tiles).  The two
        warpgroups settle the pair's running max together: each publishes its block's row maxima (``v_s`` row
        4 (i % 2) + W), arrives on its max barrier and reads the other's, so both hold the same
        m = max(m_i, max_a, max_b) (max is exact) and compute their probabilities in that one frame at the same
        time.  Each hands its bf16 probabilities (``x0_s`` / ``x1_s``, NVMMA [64, BLOCK_N] tiles the other's P.V
        reads as its A operand) and row sums (row 4 (i % 2) + 2 + W) to the other, rescales its accumulator once a
        pair (times 2**(m_i - m)) and multiplies its own P (registers) and then the other's (shared memory) with
        its value half (dims [256 W, 256 W + 256)); it frees both stages once that P.V has retired (count 2).  The
        maxima and sums rows alternate between two sets by the pair's parity: a warpgroup writes a set again only
        after the other has passed the next pair's exchange.  The producers make one block past the end, which pads
        an odd count to whole pairs (all keys masked).

        ``LAZY`` > 0 (``GLUON_FUSED_LAZY``): the frame moves, and the accumulator is rescaled, only in pairs where
        some row's max grew by more than ``LAZY`` (log2 units): otherwise the pair's probabilities are taken on the
        old max (up to 2**LAZY; exact in bf16's relative precision, and the sums and accumulator are fp32).

        ``ABLATE`` bit 2 (timing only): no QK (logits 0) and no P.V."""
        (
            q_ptr, stride_qt, stride_qh, sink_ptr, ca, cb, a_blocks, n_blocks, blocks_per_split,
            out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr, ws_splits,
            num_heads, qk_scale_log2, q_s, kb_s, r8_s, rr_s, bias_s, x0_s, x1_s, v_s, bars,
        ) = args  # fmt: skip
        RAW: gl.constexpr = rr_s.type.shape[0]
        STAGES: gl.constexpr = kb_s.type.shape[0] // 2
        BLOCK_N: gl.constexpr = bias_s.type.shape[1]
        READY: gl.constexpr = 2 * RAW
        FREE: gl.constexpr = 2 * RAW + STAGES
        FULL: gl.constexpr = 2 * RAW + 2 * STAGES
        EMPTY: gl.constexpr = FULL + 2
        QBAR: gl.constexpr = FULL + 4
        MX: gl.constexpr = FULL + 6
        MMA: gl.constexpr = (ABLATE & 4) == 0
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _QUARTER, 16]
        )
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        col_s: gl.constexpr = gl.SliceLayout(0, mma_s)
        col_o: gl.constexpr = gl.SliceLayout(0, mma_o)

        _, _, n_my = _split_blocks(blocks_per_split, n_blocks)
        n_pairs = (n_my + 1) // 2
        _q_half_to_smem(q_ptr, stride_qt, stride_qh, num_heads, W, q_s.index(W), bars.index(QBAR + W))
        mbarrier.wait(bars.index(QBAR + 1 - W), 0)  # the other half of q (both halves for the full-width QK)
        if W == 0:
            x_own = x0_s
            x_oth = x1_s
        else:
            x_own = x1_s
            x_oth = x0_s

        zero_s = gl.zeros([_BH, BLOCK_N], gl.float32, mma_s)
        m_i = gl.full([_BH], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([_BH], gl.float32, row_s)
        acc0 = gl.zeros([_BH, _QUARTER], gl.float32, mma_o)
        acc1 = gl.zeros([_BH, _QUARTER], gl.float32, mma_o)
        for i in range(n_pairs):
            vrow = 4 * (i % 2)
            mine = 2 * i + W  # the block whose logits this warpgroup computes
            other = 2 * i + 1 - W
            st = mine % STAGES
            so = other % STAGES
            mbarrier.wait(bars.index(READY + st), (mine // STAGES) & 1)
            s = _qk(q_s, kb_s, st, zero_s, MMA)
            bias = bias_s.index(st).load(col_s)
            s = s * qk_scale_log2 + bias[None, :]
            # the pair's max, exchanged (max is exact: both warpgroups get the same m)
            mx = gl.max(s, 1)
            v_s.index(vrow + W).store(mx)
            mbarrier.arrive(bars.index(MX + W))
            mbarrier.wait(bars.index(MX + 1 - W), i & 1)
            m_new = gl.maximum(m_i, gl.maximum(mx, v_s.index(vrow + 1 - W).load(row_s)))
            if LAZY > 0:  # keep the frame unless some row's max grew by more than LAZY (the same in both)
                grow = gl.max((m_new > m_i + LAZY).to(gl.int32), 0)
                m_new = gl.where(grow > 0, m_new, m_i)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_safe[:, None])
            rs = gl.sum(p, 1)
            p16 = p.to(gl.bfloat16)
            mbarrier.wait(bars.index(EMPTY + W), (i & 1) ^ 1, pred=i > 0)  # the other has read my previous P
            x_own.store(p16)
            v_s.index(vrow + 2 + W).store(rs)
            fence_async_shared()
            mbarrier.arrive(bars.index(FULL + W))
            # one rescale a pair, then my block's P.V (probabilities from registers)
            alpha_s = gl.exp2(m_i - m_safe)
            if LAZY > 0:
                if grow > 0:
                    acc0, acc1 = _rescaled(acc0, acc1, alpha_s)
            else:
                acc0, acc1 = _rescaled(acc0, acc1, alpha_s)
            acc0, acc1 = _pv(gl.convert_layout(p16, p_l), kb_s.index(2 * st + W), acc0, acc1, MMA)
            # the other block's P.V with its probabilities (shared memory)
            mbarrier.wait(bars.index(FULL + 1 - W), i & 1)
            mbarrier.wait(bars.index(READY + so), (other // STAGES) & 1)
            acc0, acc1 = _pv(x_oth, kb_s.index(2 * so + W), acc0, acc1, MMA)
            acc0, acc1 = _pv_wait(acc0, acc1, MMA)
            mbarrier.arrive(bars.index(EMPTY + 1 - W))
            mbarrier.arrive(bars.index(FREE + st))
            mbarrier.arrive(bars.index(FREE + so))
            # the same sums in the same order (block a's, then b's) in both warpgroups: (m, l) stay identical
            ro = v_s.index(vrow + 3 - W).load(row_s)
            if W == 0:
                l_i = l_i * alpha_s + rs + ro
            else:
                l_i = l_i * alpha_s + ro + rs
            m_i = m_new

        args_out = (
            sink_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
            ws_splits, num_heads,
        )  # fmt: skip
        offs_d = W * _HALF + gl.arange(0, _QUARTER, layout=col_o)
        _write_rows(acc0, offs_d, m_i, l_i, args_out, W == 0)
        _write_rows(acc1, offs_d + _QUARTER, m_i, l_i, args_out, False)

    @gluon.jit
    def _consumer_idle(args):
        """A consumer that only frees every stage once it is ready (an ablation, ``ABLATE`` bit 3): the producers'
        own pace."""
        kb_s = args[22]
        bars = args[29]
        RAW: gl.constexpr = args[24].type.shape[0]
        STAGES: gl.constexpr = kb_s.type.shape[0] // 2
        _, _, n_my = _split_blocks(args[8], args[7])
        for i in range(2 * ((n_my + 1) // 2)):
            mbarrier.wait(bars.index(2 * RAW + i % STAGES), (i // STAGES) & 1)
            mbarrier.arrive(bars.index(2 * RAW + STAGES + i % STAGES))

    @gluon.jit
    def _consumer_or_idle(W: gl.constexpr, args, ABLATE: gl.constexpr, LAZY: gl.constexpr):
        """Consumer warpgroup W: ``_consumer``, or ``_consumer_idle`` under ``ABLATE`` bit 3."""
        if (ABLATE & 8) != 0:
            _consumer_idle(args)
        else:
            _consumer(W, args, ABLATE, LAZY)

    @gluon.jit
    def _sparse_attn_ws_kernel(
        q_ptr, stride_qt, stride_qh, sink_ptr,
        a_idx, a_sidx, a_keys, a_bs, a_slots, a_nope, a_rope, a_scale, a_snp, a_snr, a_srp, a_srr, a_ssp, a_ssr,
        b_idx, b_sidx, b_keys, b_bs, b_slots, b_nope, b_rope, b_scale, b_snp, b_snr, b_srp, b_srr, b_ssp, b_ssr,
        a_blocks, n_blocks, blocks_per_split,
        out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr, ws_splits,
        num_heads, qk_scale_log2,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RAW: gl.constexpr,
        WORKER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        DEQ: gl.constexpr = 0, PDL: gl.constexpr = False, ABLATE: gl.constexpr = 0, LAZY: gl.constexpr = 0,
    ):  # fmt: skip
        """Grid (T, cdiv(H, 64), splits); ``num_warps=4`` (consumer W = 0) + 4 (consumer W = 1) + 4 + 4 (producers).

        Blocks [0, a_blocks) are cache A's index list in BLOCK_N-key blocks, then cache B's; with one cache the
        ``b_*`` arguments repeat A's with ``b_keys = 0``.  Per cache: index rows (``*_idx``, row stride
        ``*_sidx``, ``*_keys`` columns; -1 = none), page size ``*_bs`` and slot count ``*_slots``, and the
        ``EntryPages`` views with their (page, row) strides.

        Barriers: [0, 2 RAW) raw-ready (producer H at H RAW), then STAGES stage-ready, STAGES stage-free, then
        FULL + W, EMPTY + W (W's probabilities handed to the other consumer), QBAR + W (W's half of q stored) and
        MX + W (W's row maxima published).

        ``DEQ``: the producers' dequantisation (``sparse_attention.GLUON_FUSED_DEQUANT``).

        ``ABLATE`` (timing experiments only: the results are wrong; ``GLUON_FUSED_ABLATE``), bits: 1 the producers
        copy and load nothing, 2 they dequantise nothing (H = 0 still writes the bias), 4 the consumers issue no
        MMAs (logits 0), 8 the consumers only free each stage when it is ready, 16 the producers load no index rows
        (keys 0, 1, ... of the pool).  With bits 1 and 2 the raw rings shrink to 8 keys (unused), which leaves room
        for ``BLOCK_N = 64`` with two stages."""
        pdl_enter_gl(PDL)
        gl.static_assert((DEQ == 0) or (DEQ == 2), "DEQ: expected 0 or 2")
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        plain8: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[2, 1, 0])
        plain2: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=1, order=[1, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_s = gl.allocate_shared_memory(gl.bfloat16, [2, _BH, _HALF], sw)
        kb_s = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BLOCK_N, _HALF], sw)
        RAW_N: gl.constexpr = 8 if (ABLATE & 3) == 3 else BLOCK_N  # (ablations: unused rings of 8 keys)
        r8_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * RAW, 4, RAW_N, _TILE], plain8)  # producer H at H RAW
        rr_s = gl.allocate_shared_memory(gl.bfloat16, [RAW, RAW_N, _TILE], plain2)
        bias_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_N], flat)  # STAGES <= 4 rows used (a power of 2)
        # each consumer's bf16 probabilities (the A operand of the other's P.V), max and row sums of blocks a, b
        p_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BH, BLOCK_N], gl.bfloat16)
        x0_s = gl.allocate_shared_memory(gl.bfloat16, [_BH, BLOCK_N], p_sh)
        x1_s = gl.allocate_shared_memory(gl.bfloat16, [_BH, BLOCK_N], p_sh)
        v_s = gl.allocate_shared_memory(gl.float32, [8, _BH], flat)  # two sets of (max W = 0, 1, sums W = 0, 1)
        n_bars: gl.constexpr = 2 * RAW + 2 * STAGES + 8
        bars = gl.allocate_shared_memory(gl.int64, [n_bars, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * RAW):
            mbarrier.init(bars.index(i), count=_WG_THREADS)
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(2 * RAW + i), count=2)
            mbarrier.init(bars.index(2 * RAW + STAGES + i), count=2)
        for i in gl.static_range(8):
            mbarrier.init(bars.index(2 * RAW + 2 * STAGES + i), count=1)
        ca = (a_idx, a_sidx, a_keys, a_bs, a_slots, a_nope, a_rope, a_scale, a_snp, a_snr, a_srp, a_srr, a_ssp, a_ssr)
        cb = (b_idx, b_sidx, b_keys, b_bs, b_slots, b_nope, b_rope, b_scale, b_snp, b_snr, b_srp, b_srr, b_ssp, b_ssr)
        args = (
            q_ptr, stride_qt, stride_qh, sink_ptr, ca, cb, a_blocks, n_blocks, blocks_per_split,
            out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr, ws_splits,
            num_heads, qk_scale_log2, q_s, kb_s, r8_s, rr_s, bias_s, x0_s, x1_s, v_s, bars,
        )  # fmt: skip
        gl.warp_specialize(
            [
                (_consumer_or_idle, (0, args, ABLATE, LAZY)),
                (_consumer_or_idle, (1, args, ABLATE, LAZY)),
                (_producer, (0, args, DEQ, ABLATE)),
                (_producer, (1, args, DEQ, ABLATE)),
            ],
            [4, 4, 4],
            [WORKER_REGS, PRODUCER_REGS, PRODUCER_REGS],
        )


__all__ = ["BF16_2_POW_120", "HAVE_GLUON", "TILE", "e4m3_to_bf16_bits"]
if HAVE_GLUON:
    __all__ += ["_sparse_attn_ws_kernel"]
