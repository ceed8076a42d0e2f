"""Triton kernels of the *gathered* sparse attention path (see ``sparse_attention.py`` for when it is used).

The fused kernel (``_triton_sparse_attention._sparse_attn_fwd``) gathers, dequantises and attends in one
program, so every key block is a serial chain (index load -> entry loads -> dequantise -> QK -> softmax ->
PV) with nothing to overlap it on the SM.  This path splits the work in two launches:

- ``_gather_dequant_kernel``: grid (T, column blocks).  Each program dequantises BLOCK_G entries of one
  query row's index list into a dense bf16 workspace row ``kv[t, col, :]`` (exact: an e4m3 value times a
  power of two, or the bf16 rope lanes) and writes ``bias[t, col]`` = 0 for a valid entry, -inf for a
  skipped one (``-1``, out of range, or padding past the list).  Memory-bound: it reads the entries once
  and writes 2 bytes per dimension.
- ``_dense_attn_fwd``: grid (T, head blocks, key splits).  A plain flash-decoding loop over contiguous
  [BLOCK_N, 512] bf16 tiles (the same tile is K and V: MQA) with an fp32 online softmax; the tile loads
  are ordinary strided loads that Triton software-pipelines (``num_stages``), so HBM/L2 traffic overlaps
  the MMAs.  Its epilogue (sink, normalisation, lse, or the partial state of a key split) is the fused
  kernel's ``_write_result``, so both paths round and combine identically.

The workspace costs ``T x columns x (2 x 512 + 4)`` bytes, so the host only takes this path when that is
small (decode-sized T); prefill chunks use the fused kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels._triton_sync import pdl_enter
from dsv4.kernels.attention._triton_sparse_attention import _mma, _to_bf16, _write_result


@triton.jit
def _gather_one(
    ws_ptr,
    bias_ptr,
    stride_wt,
    stride_bt,
    pid_t,
    col0,
    key0,
    nope_ptr,
    rope_ptr,
    scale_ptr,
    idx_ptr,
    s_nope_p,
    s_nope_r,
    s_rope_p,
    s_rope_r,
    s_scale_p,
    s_scale_r,
    s_idx,
    num_keys,
    entries_per_page,
    num_slots,
    BLOCK_G: tl.constexpr,
    TILE: tl.constexpr,
    N_TILES: tl.constexpr,
    NOPE_TILES: tl.constexpr,
):
    """Entries key0 .. key0 + BLOCK_G of one cache's index row -> workspace columns col0 .. col0 + BLOCK_G."""
    offs_n = key0 + tl.arange(0, BLOCK_G)
    slot = tl.load(idx_ptr + pid_t * s_idx + offs_n, mask=offs_n < num_keys, other=-1)  # int32
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    page = (slot // entries_per_page).to(tl.int64)  # 32-bit division, then 64-bit byte offsets
    row = (slot % entries_per_page).to(tl.int64)
    # nope: [BLOCK_G, N_TILES, TILE] with the rope tile's slot masked off; rope: [BLOCK_G, TILE] bf16 lanes.
    # Stored in the load layout (no reshape / layout conversion); each value is exact in bf16.
    D: tl.constexpr = N_TILES * TILE
    offs_t = tl.arange(0, N_TILES)
    offs_j = tl.arange(0, TILE)
    is_nope = (offs_t < NOPE_TILES)[None, :, None]
    nbase = page * s_nope_p + row * s_nope_r
    x = tl.load(
        nope_ptr + nbase[:, None, None] + (offs_t * TILE)[None, :, None] + offs_j[None, None, :],
        mask=valid[:, None, None] & is_nope,
        other=0.0,
    ).to(tl.float32)
    sb = tl.load(
        scale_ptr + (page * s_scale_p + row * s_scale_r)[:, None] + offs_t[None, :],
        mask=valid[:, None] & (offs_t < NOPE_TILES)[None, :],
        other=0,
    )
    sc = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2**(b - 127), exact
    cols = col0 + tl.arange(0, BLOCK_G)
    dst = ws_ptr + pid_t * stride_wt + cols.to(tl.int64) * D
    doffs = (offs_t * TILE)[:, None] + offs_j[None, :]
    tl.store(dst[:, None, None] + doffs[None, :, :], (x * sc[:, :, None]).to(tl.bfloat16), mask=is_nope)
    r = tl.load(
        rope_ptr + (page * s_rope_p + row * s_rope_r)[:, None] + offs_j[None, :], mask=valid[:, None], other=0.0
    )
    tl.store(dst[:, None] + NOPE_TILES * TILE + offs_j[None, :], r)
    tl.store(bias_ptr + pid_t * stride_bt + cols, tl.where(valid, 0.0, float("-inf")))


@triton.jit
def _gather_dequant_kernel(
    ws_ptr,
    bias_ptr,
    stride_wt,
    stride_bt,
    col_offset,
    # cache A
    a_nope,
    a_rope,
    a_scale,
    a_idx,
    a_s_nope_p,
    a_s_nope_r,
    a_s_rope_p,
    a_s_rope_r,
    a_s_scale_p,
    a_s_scale_r,
    a_s_idx,
    a_keys,
    a_bs,
    a_slots,
    a_blocks,
    # cache B (ignored unless HAS_B)
    b_nope,
    b_rope,
    b_scale,
    b_idx,
    b_s_nope_p,
    b_s_nope_r,
    b_s_rope_p,
    b_s_rope_r,
    b_s_scale_p,
    b_s_scale_r,
    b_s_idx,
    b_keys,
    b_bs,
    b_slots,
    b_blocks,
    BLOCK_G: tl.constexpr,
    TILE: tl.constexpr,
    N_TILES: tl.constexpr,
    NOPE_TILES: tl.constexpr,
    HAS_B: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Column block ``pid_c`` of row ``pid_t``: blocks of cache A's list first, then cache B's (each list
    padded to a whole number of BLOCK_G blocks); columns start at ``col_offset``."""
    pdl_enter(PDL)
    pid_t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    col0 = col_offset + blk * BLOCK_G
    if blk < a_blocks:
        _gather_one(
            ws_ptr, bias_ptr, stride_wt, stride_bt, pid_t, col0, blk * BLOCK_G, a_nope, a_rope, a_scale, a_idx,
            a_s_nope_p, a_s_nope_r, a_s_rope_p, a_s_rope_r, a_s_scale_p, a_s_scale_r, a_s_idx, a_keys, a_bs, a_slots,
            BLOCK_G, TILE, N_TILES, NOPE_TILES,
        )  # fmt: skip
    elif HAS_B:
        _gather_one(
            ws_ptr, bias_ptr, stride_wt, stride_bt, pid_t, col0, (blk - a_blocks) * BLOCK_G, b_nope, b_rope,
            b_scale, b_idx, b_s_nope_p, b_s_nope_r, b_s_rope_p, b_s_rope_r, b_s_scale_p, b_s_scale_r, b_s_idx,
            b_keys, b_bs, b_slots, BLOCK_G, TILE, N_TILES, NOPE_TILES,
        )  # fmt: skip


@triton.jit
def _dense_attn_fwd(
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
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERPRETER: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Flash-decoding over the gathered bf16 rows ``kv[t, :, :]`` (K = V) with additive ``bias[t, :]``."""
    pdl_enter(PDL)
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_d = tl.arange(0, D)
    q = tl.load(
        q_ptr + pid_t * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
        mask=h_mask[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    kv_row = kv_ptr + pid_t * stride_kt
    bias_row = bias_ptr + pid_t * stride_bt
    blk_start = pid_s * blocks_per_split
    blk_end = tl.minimum(blk_start + blocks_per_split, n_blocks)
    for blk in range(blk_start, blk_end):
        offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.load(kv_row + offs_n[:, None].to(tl.int64) * D + offs_d[None, :])
        b = tl.load(bias_row + offs_n)
        s = _mma(q, tl.trans(k), INTERPRETER) * qk_scale_log2 + b[None, :]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mma(_to_bf16(p, INTERPRETER), k, INTERPRETER)
        m_i = m_new
    _write_result(
        m_i, l_i, acc, offs_h, h_mask, offs_d, pid_t, 0, pid_s, 0, sink_ptr, out_ptr, stride_ot, stride_oh,
        lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr, ws_splits, num_heads, D, SPLIT, INTERPRETER,
    )  # fmt: skip


__all__ = ["_dense_attn_fwd", "_gather_dequant_kernel", "triton"]
