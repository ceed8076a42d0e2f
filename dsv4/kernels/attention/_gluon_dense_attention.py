"""Gluon (sm_90) flash-decoding kernel over the gathered bf16 workspace: the dense launch of the gathered path.

The Triton kernel ``_dense_attn_fwd`` gives each (row, 64-head block) program one [64, 512] fp32 accumulator
over 8 warps; Triton splits both dots across its two warpgroups along N, so every key block needs cross-warpgroup
exchanges (the row max and the probabilities) through shared memory behind CTA-wide barriers, and the tensor
cores idle while the softmax runs (Nsight, H200 2026-12-04: barrier stalls 2.7 and long-scoreboard 1.8 cycles
per issued instruction; 4.3 cycles between issues).  This kernel is written one level lower (Gluon: explicit
layouts, shared memory, mbarriers, asynchronous ``wgmma``) and splits the work by *head dimension* instead:

- Two warpgroups, ``W = 0, 1`` (a warp-specialised region: the default partition is W = 0, the one worker
  partition W = 1; both run ``_wg_body``).  Warpgroup W owns dims ``[256 W, 256 W + 256)`` of q, of every key
  (= value) row and of the output: q half [64, 256] bf16 in shared memory, accumulator [64, 256] fp32 in
  registers, and its own ring of ``STAGES`` key half-tiles [BLOCK_N, 256] bf16 filled by ``cp.async`` (each
  thread's copies arrive on the stage's mbarrier).
- Per key block: each warpgroup computes the partial logits over its 256 dims (``wgmma`` m64 nBLOCK_N k256),
  the two [64, BLOCK_N] fp32 partials are swapped through shared memory (one mbarrier pair per direction) and
  both warpgroups add them (fp32 addition commutes: both get the same bits) and run the same online softmax;
  each then multiplies P with its own value half (m64 n256 k BLOCK_N).  No reduction crosses a warpgroup.
- Software pipeline inside a warpgroup: the QK of block j + 1 is issued (asynchronous ``wgmma``) before the
  softmax of block j and runs under it; then the P.V of block j is issued, the QK retires first (wgmma groups
  retire in order) and its partial logits go to the other warpgroup while the P.V still runs; the P.V retires at
  the end of the iteration.  A stage is refilled ``STAGES - 1`` blocks ahead, once the P.V that last read it
  has retired.

H200 (2026-12-04, torch.profiler device time, V4-Pro B = 64, 128 + 1,024 keys): 58.8 us vs 76.1 for
``_dense_attn_fwd``; V4-Flash B = 64 25.5 vs 29.8.  What shaped it, measured:

- The exchange of block j + 1's partials under block j's P.V (instead of before block j's softmax): 70.2 ->
  59.0 us (V4-Pro B = 64), 55.0 -> 43.7 us (V4-Flash HCA-8192 B = 8): the store, its warpgroup barrier and the
  arrive left the critical chain.

- The partial-logit exchange buffers are padded by 8 fp32 a row.  Unpadded, the 8 rows a warp's MMA fragment
  touches all start in bank 0 (8-way conflicts; Nsight: 33 % excess shared wavefronts) and the kernel took 83.9 us.
- The P.V retires at the end of its own iteration.  Leaving it in flight across the loop's back edge (the textbook
  ``wait(1)`` pipeline) makes ptxas serialise every wgmma of the kernel (info C7514); CI's compile test checks
  that the HGMMAs are not each followed by a wait.
- 32- or 64-key blocks, 2 to 6 stages: the same time (measured before the padding).  Before the exchange moved,
  the cost grew ~61 ns a key per program; switching off the exchange, the softmax, the P.V or the loads saved
  3-10 us each: both warpgroups
  run one dependent chain in lockstep with 2 warps a scheduler (the tensor pipe is ~25 % busy).  Overlapping
  one warpgroup's softmax with the other's MMAs (FlashMLA's ping-pong) is the next step; its full-width K tiles
  need a load schedule that fits shared memory.
- Short lists split across programs (B = 1, 8) are slower than with the Triton kernel (fixed cost per program), so
  ``dense="auto"`` uses this kernel only from ``GLUON_MIN_KEYS`` keys a program.

Numerics equal the Triton kernel's: fp32 logits (the two 256-dim halves summed in fp32 instead of one 512-long
MMA accumulation, both exact products of bf16 values), log2-domain online softmax, probabilities rounded to bf16
for P.V, the same epilogue formulas (sink, lse, split partial states).

Requirements (checked by the host, ``gluon_dense_supported``): an sm_90 CUDA device, Triton with Gluon's Hopper
module, head dim 512.  Gluon kernels do not run under ``TRITON_INTERPRET``; CI compiles this one for sm_90
(``tests/kernels/test_gluon_dense_attention.py``) and the GPU tests compare it with the reference.
"""

from __future__ import annotations

try:  # Gluon's Hopper API (triton >= 3.5); absent -> the host never selects this kernel
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

    # triton 3.6 names the pointer-based cp.async ``async_copy_global_to_shared``; later versions ``async_load``
    _cp_async = getattr(async_copy, "async_load", None) or getattr(async_copy, "async_copy_global_to_shared", None)
    HAVE_GLUON = _cp_async is not None
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

HALF = 256  # head dims a warpgroup owns
BLOCK_HEADS = 64  # heads a program owns (wgmma M)
WG_THREADS = 128

if HAVE_GLUON:
    _HALF = gl.constexpr(HALF)
    _BH = gl.constexpr(BLOCK_HEADS)
    _WG_THREADS = gl.constexpr(WG_THREADS)

    @gluon.jit
    def _load_half(kv_row, blk, blk_end, smem, bar, W: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr):
        """cp.async of key block ``blk`` (rows ``blk * BLOCK_N ..``), dims of warpgroup W, into ``smem``; every
        thread's copies arrive on ``bar`` (count 128) when they land.  Blocks past ``blk_end`` are zero-filled."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        offs_r = blk * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        offs_c = W * _HALF + gl.arange(0, _HALF, layout=gl.SliceLayout(0, ld))
        ptrs = kv_row + offs_r[:, None].to(gl.int64) * D + offs_c[None, :]
        ok = (offs_r < blk_end * BLOCK_N)[:, None] & (offs_c < D)[None, :]
        _cp_async(smem, ptrs, mask=ok)
        async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def _split_blocks(blocks_per_split, n_blocks):
        """This program's key blocks: (first, end, count) of split ``program_id(2)``."""
        blk_start = gl.program_id(2) * blocks_per_split
        blk_end = gl.minimum(blk_start + blocks_per_split, n_blocks)
        return blk_start, blk_end, gl.maximum(blk_end - blk_start, 0)

    @gluon.jit
    def _q_half_to_smem(q_ptr, stride_qt, stride_qh, num_heads, W: gl.constexpr, qw, qbar):
        """Warpgroup W's q half [64 heads, 256] of row ``program_id(0)``, head block ``program_id(1)`` -> ``qw``
        (bf16 NVMMA), visible to the async proxy (wgmma) once every thread of W has stored: fence, then an
        arrive/wait on W's own barrier ``qbar``.  Heads past ``num_heads`` are zeros."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        offs_h = gl.program_id(1) * _BH + gl.arange(0, _BH, layout=gl.SliceLayout(1, ld))
        offs_c = W * _HALF + gl.arange(0, _HALF, layout=gl.SliceLayout(0, ld))
        row = q_ptr + gl.program_id(0).to(gl.int64) * stride_qt
        ptrs = row + offs_h[:, None].to(gl.int64) * stride_qh + offs_c[None, :]
        q = gl.load(ptrs, mask=(offs_h < num_heads)[:, None], other=0.0)
        qw.store(q)
        fence_async_shared()
        mbarrier.arrive(qbar)
        mbarrier.wait(qbar, 0)

    @gluon.jit
    def _write_rows(acc, offs_d, m_i, l_i, args_out, WRITE_STATS: gl.constexpr):
        """Epilogue of one accumulator chunk [64 heads, len(offs_d)] (the formulas of
        ``_triton_sparse_attention._write_result``).  Both outcomes are written under masks instead of a runtime
        branch (triton 3.6 fails to lower the branch): with a key split (ws_splits > 1) the partial state goes to
        the workspace and the combine kernel adds the sink; otherwise the sink is added here and the bf16 output
        (and, ``WRITE_STATS``, the lse) stored.  ``WRITE_STATS`` also writes the split's (max, sum) rows."""
        (
            sink_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
            ws_splits, num_heads,
        ) = args_out  # fmt: skip
        row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        pid_t = gl.program_id(0).to(gl.int64)
        offs_h = gl.program_id(1) * _BH + gl.arange(0, _BH, layout=row_o)
        h_mask = offs_h < num_heads
        m_o = gl.convert_layout(m_i, row_o)
        l_o = gl.convert_layout(l_i, row_o)
        split = ws_splits > 1
        ws_row = (pid_t * num_heads + offs_h) * ws_splits + gl.program_id(2)
        gl.store(ws_acc_ptr + ws_row[:, None] * (2 * _HALF) + offs_d[None, :], acc, mask=(h_mask & split)[:, None])
        sink = gl.load(sink_ptr + offs_h, mask=h_mask, other=float("-inf")) * 1.4426950408889634
        m_all = gl.maximum(m_o, sink)
        m_safe = gl.where(m_all == float("-inf"), 0.0, m_all)
        w = gl.exp2(m_o - m_safe)
        denom = l_o * w + gl.exp2(sink - m_safe)
        safe = gl.where(denom > 0.0, denom, 1.0)
        o = acc * (w / safe)[:, None]
        final = h_mask & (ws_splits <= 1)
        gl.store(
            out_ptr + pid_t * stride_ot + offs_h[:, None].to(gl.int64) * stride_oh + offs_d[None, :],
            o.to(gl.bfloat16),
            mask=final[:, None],
        )
        if WRITE_STATS:
            gl.store(ws_m_ptr + ws_row, m_o, mask=h_mask & split)
            gl.store(ws_l_ptr + ws_row, l_o, mask=h_mask & split)
            lse = gl.where(denom > 0.0, (m_safe + gl.log2(safe)) * 0.6931471805599453, float("-inf"))
            gl.store(lse_ptr + pid_t * stride_lt + offs_h * stride_lh, lse, mask=final)

    @gluon.jit
    def _wg_body(W: gl.constexpr, args):
        """Warpgroup W's share of one (row, head block, key split) program; see the module docstring.

        ``bars`` rows: [0, 2 STAGES) stage-ready (W's ring at W * STAGES), 2 STAGES + W: W's partial logits are in
        its exchange buffer (``x0_s`` / ``x1_s``), 2 STAGES + 2 + W: that buffer has been read, 2 STAGES + 4 + W:
        W's q half is in shared memory.
        Stage-ready barriers count 128 arrivals (each thread's cp.async group), the others one."""
        (
            q_ptr, stride_qt, stride_qh, sink_ptr, kv_ptr, bias_ptr, stride_kt, stride_bt, n_blocks, blocks_per_split,
            out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr, ws_splits,
            num_heads, qk_scale_log2, q_s, k_s, x0_s, x1_s, bars,
        ) = args  # fmt: skip
        # int constexprs do not survive a partition's argument list (triton 3.6): geometry from the buffers' shapes
        STAGES: gl.constexpr = k_s.type.shape[0] // 2
        BLOCK_N: gl.constexpr = k_s.type.shape[1]
        D: gl.constexpr = 2 * _HALF
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, _HALF, 16]
        )
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
        row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
        col_s: gl.constexpr = gl.SliceLayout(0, mma_s)
        col_o: gl.constexpr = gl.SliceLayout(0, mma_o)
        if W == 0:
            x_mine = x0_s
            x_other = x1_s
        else:
            x_mine = x1_s
            x_other = x0_s
        RDY: gl.constexpr = W * STAGES
        FULL: gl.constexpr = 2 * STAGES
        EMPTY: gl.constexpr = 2 * STAGES + 2
        QBAR: gl.constexpr = 2 * STAGES + 4

        pid_t = gl.program_id(0).to(gl.int64)
        blk_start, blk_end, n_my = _split_blocks(blocks_per_split, n_blocks)
        kv_row = kv_ptr + pid_t * stride_kt
        bias_row = bias_ptr + pid_t * stride_bt

        # the first STAGES - 1 key blocks (their stages are free), then the q half -> shared memory
        for i0 in gl.static_range(STAGES - 1):
            _load_half(kv_row, blk_start + i0, blk_end, k_s.index(RDY + i0), bars.index(RDY + i0), W, BLOCK_N, D)
        qw = q_s.index(W)
        _q_half_to_smem(q_ptr, stride_qt, stride_qh, num_heads, W, qw, bars.index(QBAR + W))

        offs_n = gl.arange(0, BLOCK_N, layout=col_s)
        zero_s = gl.zeros([_BH, BLOCK_N], gl.float32, mma_s)
        # QK of the first block (stage 0)
        mbarrier.wait(bars.index(RDY), 0)
        fence_async_shared()
        s_tok = warpgroup_mma(qw, k_s.index(RDY).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s_w = warpgroup_mma_wait(0, deps=[s_tok])
        bias = gl.load(bias_row + blk_start * BLOCK_N + offs_n, mask=(offs_n * 0 + n_my) > 0, other=0.0)
        x_mine.store(s_w)  # block 0's partial (block j + 1's is stored at the end of iteration j)
        mbarrier.arrive(bars.index(FULL + W))

        m_i = gl.full([_BH], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([_BH], gl.float32, row_s)
        acc = gl.zeros([_BH, _HALF], gl.float32, mma_o)
        for j in range(n_my):
            st = j % STAGES
            # 1. the other warpgroup's partial logits of block j
            mbarrier.wait(bars.index(FULL + 1 - W), j & 1)
            s_o = x_other.load(mma_s)
            mbarrier.arrive(bars.index(EMPTY + 1 - W))
            # 2. QK of block j + 1 (its stage was filled at least one iteration ago); runs under the softmax
            jn = j + 1
            stn = jn % STAGES
            mbarrier.wait(bars.index(RDY + stn), (jn // STAGES) & 1)
            fence_async_shared()
            s_tok = warpgroup_mma(qw, k_s.index(RDY + stn).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            bias_next = gl.load(
                bias_row + (blk_start + jn) * BLOCK_N + offs_n, mask=(offs_n * 0 + jn) < n_my, other=0.0
            )
            # 3. online softmax (log2 domain), identical in both warpgroups
            s = (s_w + s_o) * qk_scale_log2 + bias[None, :]
            m_new = gl.maximum(m_i, gl.max(s, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            p16 = gl.convert_layout(p.to(gl.bfloat16), p_l)
            # 4. block j - 1's P.V retired at the end of the last iteration: refill its stage
            refill = j + STAGES - 1
            _load_half(kv_row, blk_start + refill, blk_end, k_s.index(RDY + refill % STAGES),
                       bars.index(RDY + refill % STAGES), W, BLOCK_N, D)  # fmt: skip
            # 5. P.V of block j into this warpgroup's dims
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(p16, k_s.index(RDY + st), acc, is_async=True)
            # 6. the QK of block j + 1 retires first (wgmma groups retire in order): hand its partial to the other
            #    warpgroup while the P.V runs (the other read block j's at its step 1: EMPTY phase j)
            s_w = warpgroup_mma_wait(1, deps=[s_tok])
            mbarrier.wait(bars.index(EMPTY + W), j & 1)
            x_mine.store(s_w)
            mbarrier.arrive(bars.index(FULL + W))
            # 7. the P.V retires inside the iteration (in flight across the back edge, ptxas serialises every wgmma)
            acc = warpgroup_mma_wait(0, deps=[acc])
            bias = bias_next
        acc = warpgroup_mma_wait(0, deps=[acc])

        args_out = (
            sink_ptr, out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
            ws_splits, num_heads,
        )  # fmt: skip
        _write_rows(acc, W * _HALF + gl.arange(0, _HALF, layout=col_o), m_i, l_i, args_out, W == 0)

    @gluon.jit
    def _dense_attn_ws_kernel(
        q_ptr,
        stride_qt,
        stride_qh,
        sink_ptr,
        kv_ptr,
        bias_ptr,
        stride_kt,
        stride_bt,
        n_blocks,
        blocks_per_split,
        out_ptr,
        stride_ot,
        stride_oh,
        lse_ptr,
        stride_lt,
        stride_lh,
        ws_m_ptr,
        ws_l_ptr,
        ws_acc_ptr,
        ws_splits,
        num_heads,
        qk_scale_log2,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        WORKER_REGS: gl.constexpr,
        PDL: gl.constexpr = False,
    ):
        """Grid (T, cdiv(H, 64), splits); launched with ``num_warps=4`` (+ 4 worker warps).  See the module doc."""
        pdl_enter_gl(PDL)
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        # exchange rows padded by 8 fp32: the 8 rows a warp's MMA fragment touches start 8 banks apart, so a
        # warp's 64 words take the minimum 2 wavefronts (unpadded, the 128-byte rows all start in bank 0: 8-way)
        padded: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[BLOCK_N, 8]], [_BH, BLOCK_N], [1, 0])
        q_s = gl.allocate_shared_memory(gl.bfloat16, [2, _BH, _HALF], sw)
        k_s = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BLOCK_N, _HALF], sw)
        x0_s = gl.allocate_shared_memory(gl.float32, [_BH, BLOCK_N], padded)
        x1_s = gl.allocate_shared_memory(gl.float32, [_BH, BLOCK_N], padded)
        bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES + 6, 1], mbarrier.MBarrierLayout())
        # stage-ready barriers: every thread's cp.async group arrives (128); the others get one arrive per
        # warpgroup (Triton lowers mbarrier.arrive to a warpgroup barrier + one thread's arrive)
        for i in gl.static_range(2 * STAGES):
            mbarrier.init(bars.index(i), count=_WG_THREADS)
        for i in gl.static_range(6):
            mbarrier.init(bars.index(2 * STAGES + i), count=1)
        args = (
            q_ptr, stride_qt, stride_qh, sink_ptr, kv_ptr, bias_ptr, stride_kt, stride_bt, n_blocks, blocks_per_split,
            out_ptr, stride_ot, stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr, ws_splits,
            num_heads, qk_scale_log2, q_s, k_s, x0_s, x1_s, bars,
        )  # fmt: skip
        gl.warp_specialize([(_wg_body, (0, args)), (_wg_body, (1, args))], [4], [WORKER_REGS])


__all__ = ["BLOCK_HEADS", "HALF", "HAVE_GLUON"] + (["_dense_attn_ws_kernel"] if HAVE_GLUON else [])
