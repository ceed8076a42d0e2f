"""Triton kernels of the sparse attention read path (see ``sparse_attention.py`` for the design).

Two kernels:

- ``_sparse_attn_fwd``: one program per (query row, block of heads, key split).  It walks the key
  blocks of up to two caches (A then B) that fall into its split, gathers each block of entries once
  (FP8 nope part dequantised in registers, bf16 rope part), runs QK^T and P.V with ``tl.dot`` for all
  heads of the block, and keeps an fp32 online softmax.  With ``SPLIT=False`` it adds the sink and
  writes the final bf16 output and lse; with ``SPLIT=True`` it writes its un-normalised partial state
  (running max, running sum, accumulator) to a workspace.
- ``_sparse_attn_combine``: merges the partial states of all splits of one (row, head), adds the sink
  and writes the output and lse.

Internally the running max lives in the log2 domain (logits times ``scale * log2(e)``) so that the
exponentials are ``exp2``; lse is converted back to the natural log on store.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels._triton_sync import pdl_enter

LOG2E = 1.4426950408889634


@triton.jit
def _mma(a, b, INTERPRETER: tl.constexpr):
    """``tl.dot`` of bf16 operands with an fp32 result.

    Under ``TRITON_INTERPRET=1`` (triton 3.9) ``tl.dot`` multiplies the raw bits of bf16 operands, so the
    interpreter path upcasts the (bf16-exact) operands to fp32 first; the GPU uses the bf16 MMA.
    """
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _to_bf16(x, INTERPRETER: tl.constexpr):
    """fp32 -> bf16, round to nearest even.

    The triton 3.9 interpreter's fp32 -> bf16 cast truncates, so under the interpreter the rounding is
    done on the bits first (finite values; the cast after it is exact); the GPU's cast is nearest-even.
    """
    if INTERPRETER:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        x = b.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _load_tiles(
    nope_ptr,
    rope_ptr,
    scale_ptr,
    nope_base,
    rope_base,
    scale_base,
    valid,
    t0,
    NT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE: tl.constexpr,
    NOPE_TILES: tl.constexpr,
):
    """Dequantised tiles ``t0 .. t0+NT`` of BLOCK_N entries as [BLOCK_N, NT*TILE] bf16 (tile NOPE_TILES = rope).

    Each entry's FP8 bytes of these tiles are contiguous (one wide load per entry row), its UE8M0 scale
    bytes are loaded once ([BLOCK_N, NT]) and ``2**(b - 127)`` is built from the exponent bits (exact).
    """
    offs_t = t0 + tl.arange(0, NT)
    offs_j = tl.arange(0, TILE)
    is_nope = offs_t < NOPE_TILES
    nope_off = nope_base[:, None, None] + (offs_t * TILE)[None, :, None] + offs_j[None, None, :]
    x = tl.load(nope_ptr + nope_off, mask=valid[:, None, None] & is_nope[None, :, None], other=0.0).to(tl.float32)
    sb = tl.load(scale_ptr + scale_base[:, None] + offs_t[None, :], mask=valid[:, None] & is_nope[None, :], other=0)
    sc = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    has_rope = (offs_j * 0 + t0 + NT) > NOPE_TILES  # only a chunk holding the rope tile reads it
    r = tl.load(rope_ptr + rope_base[:, None] + offs_j[None, :], mask=valid[:, None] & has_rope[None, :], other=0.0)
    k3 = tl.where(is_nope[None, :, None], x * sc[:, :, None], r.to(tl.float32)[:, None, :])
    # Exact in bf16: an e4m3 value times a power of two; the rope part was bf16 already.
    return tl.reshape(k3, (BLOCK_N, NT * TILE)).to(tl.bfloat16)


@triton.jit
def _attend_block(
    q,
    q_row_ptr,
    offs_h,
    h_mask,
    stride_qh,
    m_i,
    l_i,
    acc,
    idx_row_ptr,
    key_start,
    num_keys,
    nope_ptr,
    rope_ptr,
    scale_ptr,
    s_nope_p,
    s_nope_r,
    s_rope_p,
    s_rope_r,
    s_scale_p,
    s_scale_r,
    entries_per_page,
    num_slots,
    qk_scale_log2,
    v_t0,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE: tl.constexpr,
    N_TILES: tl.constexpr,
    NOPE_TILES: tl.constexpr,
    QK_TILES: tl.constexpr,
    V_TILES: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """One block of BLOCK_N keys of one cache: gather + dequantise, update the online softmax.

    Variants (constexpr):
    - ``QK_TILES == N_TILES`` and ``V_TILES == N_TILES`` (default): the whole [BLOCK_N, D] tile is dequantised
      once and serves both dots (``tl.trans`` for K^T); ``q`` is the [BLOCK_H, D] tile held by the caller.
    - ``QK_TILES < N_TILES``: QK^T is accumulated over D-chunks of QK_TILES tiles; each q chunk is re-loaded
      from global memory (L1/L2-resident) and each K chunk dequantised just before its dot (``q`` unused).
    - ``V_TILES < N_TILES`` (output split): P.V only for the V_TILES tiles from ``v_t0`` (a separate, smaller
      gather of the same entries, served from L1/L2).  Also used whenever QK is chunked.
    """
    offs_n = key_start + tl.arange(0, BLOCK_N)
    slot = tl.load(idx_row_ptr + offs_n, mask=offs_n < num_keys, other=-1).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    page = slot // entries_per_page
    row = slot % entries_per_page
    nope_base = page * s_nope_p + row * s_nope_r
    rope_base = page * s_rope_p + row * s_rope_r
    scale_base = page * s_scale_p + row * s_scale_r

    if QK_TILES == N_TILES:
        k = _load_tiles(
            nope_ptr, rope_ptr, scale_ptr, nope_base, rope_base, scale_base, valid, 0, N_TILES, BLOCK_N, TILE,
            NOPE_TILES,
        )  # fmt: skip
        s = _mma(q, tl.trans(k), INTERPRETER)
    else:
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        offs_c = tl.arange(0, QK_TILES * TILE)
        for c in tl.static_range(N_TILES // QK_TILES):
            qc = tl.load(
                q_row_ptr + offs_h[:, None].to(tl.int64) * stride_qh + (c * QK_TILES * TILE + offs_c)[None, :],
                mask=h_mask[:, None],
                other=0.0,
            )
            kc = _load_tiles(
                nope_ptr, rope_ptr, scale_ptr, nope_base, rope_base, scale_base, valid, c * QK_TILES, QK_TILES,
                BLOCK_N, TILE, NOPE_TILES,
            )  # fmt: skip
            s += _mma(qc, tl.trans(kc), INTERPRETER)
    s = s * qk_scale_log2  # [BLOCK_H, BLOCK_N] fp32, log2 domain
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if QK_TILES == N_TILES and V_TILES == N_TILES:
        v = k
    else:
        v = _load_tiles(
            nope_ptr, rope_ptr, scale_ptr, nope_base, rope_base, scale_base, valid, v_t0, V_TILES, BLOCK_N, TILE,
            NOPE_TILES,
        )  # fmt: skip
    acc = acc * alpha[:, None] + _mma(_to_bf16(p, INTERPRETER), v, INTERPRETER)
    return m_new, l_i, acc


@triton.jit
def _write_result(
    m_i,
    l_i,
    acc,
    offs_h,
    h_mask,
    offs_d,
    pid_t,
    pid_d,
    pid_s,
    split_offset,
    sink_ptr,
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
    D: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERPRETER: tl.constexpr,
):
    """Epilogue of a program's online softmax (running max ``m_i`` in the log2 domain, sum ``l_i``, ``acc``
    [BLOCK_H, DV] for output dims ``offs_d``): with ``SPLIT`` the partial state goes to the workspace row of
    split ``split_offset + pid_s``; otherwise the sink is added and the bf16 output and the lse are stored."""
    if SPLIT:
        # workspace: m, l [T, H, ws_splits]; acc [T, H, ws_splits, D] (all fp32, contiguous)
        ws_row = (pid_t * num_heads + offs_h) * ws_splits + split_offset + pid_s
        first = h_mask & ((offs_h * 0 + pid_d) == 0)  # every output split holds the same (m, l)
        tl.store(ws_m_ptr + ws_row, m_i, mask=first)
        tl.store(ws_l_ptr + ws_row, l_i, mask=first)
        tl.store(ws_acc_ptr + ws_row[:, None] * D + offs_d[None, :], acc, mask=h_mask[:, None])
    else:
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=float("-inf")) * 1.4426950408889634
        m_all = tl.maximum(m_i, sink)
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        w = tl.exp2(m_i - m_safe)
        denom = l_i * w + tl.exp2(sink - m_safe)
        safe = tl.where(denom > 0.0, denom, 1.0)  # denom == 0 only when acc == 0 (no key, sink -inf)
        o = acc * (w / safe)[:, None]
        lse = tl.where(denom > 0.0, (m_safe + tl.log2(safe)) * 0.6931471805599453, float("-inf"))
        tl.store(
            out_ptr + pid_t * stride_ot + offs_h[:, None].to(tl.int64) * stride_oh + offs_d[None, :],
            _to_bf16(o, INTERPRETER),
            mask=h_mask[:, None],
        )
        tl.store(lse_ptr + pid_t * stride_lt + offs_h * stride_lh, lse, mask=h_mask & ((offs_h * 0 + pid_d) == 0))


@triton.jit
def _sparse_attn_fwd(
    q_ptr,
    stride_qt,
    stride_qh,
    sink_ptr,
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
    # outputs
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
    split_offset,
    blocks_per_split,
    num_heads,
    qk_scale_log2,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE: tl.constexpr,
    N_TILES: tl.constexpr,
    NOPE_TILES: tl.constexpr,
    HAS_B: tl.constexpr,
    SPLIT: tl.constexpr,
    QK_TILES: tl.constexpr,
    D_SPLIT: tl.constexpr,
    INTERPRETER: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    D: tl.constexpr = N_TILES * TILE
    V_TILES: tl.constexpr = N_TILES // D_SPLIT  # output tiles of this program
    DV: tl.constexpr = V_TILES * TILE
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1) // D_SPLIT
    pid_d = tl.program_id(1) % D_SPLIT
    pid_s = tl.program_id(2)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    q_row = q_ptr + pid_t * stride_qt
    if QK_TILES == N_TILES:
        offs_q = tl.arange(0, D)
        q = tl.load(q_row + offs_h[:, None].to(tl.int64) * stride_qh + offs_q[None, :], mask=h_mask[:, None], other=0.0)
    else:
        q = 0.0  # chunks are re-loaded inside _attend_block
    v_t0 = pid_d * V_TILES
    offs_d = pid_d * DV + tl.arange(0, DV)  # output dims of this program

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)

    # This split's key blocks, numbered over the concatenation (blocks of A, then blocks of B).
    blk_start = pid_s * blocks_per_split
    blk_end = tl.minimum(blk_start + blocks_per_split, a_blocks + b_blocks)
    a_end = tl.minimum(blk_end, a_blocks)
    a_idx_row = a_idx + pid_t * a_s_idx
    for blk in range(blk_start, a_end):
        m_i, l_i, acc = _attend_block(
            q,
            q_row,
            offs_h,
            h_mask,
            stride_qh,
            m_i,
            l_i,
            acc,
            a_idx_row,
            blk * BLOCK_N,
            a_keys,
            a_nope,
            a_rope,
            a_scale,
            a_s_nope_p,
            a_s_nope_r,
            a_s_rope_p,
            a_s_rope_r,
            a_s_scale_p,
            a_s_scale_r,
            a_bs,
            a_slots,
            qk_scale_log2,
            v_t0,
            BLOCK_H,
            BLOCK_N,
            TILE,
            N_TILES,
            NOPE_TILES,
            QK_TILES,
            V_TILES,
            INTERPRETER,
        )
    if HAS_B:
        b_begin = tl.maximum(blk_start, a_blocks)
        b_idx_row = b_idx + pid_t * b_s_idx
        for blk in range(b_begin, blk_end):
            m_i, l_i, acc = _attend_block(
                q,
                q_row,
                offs_h,
                h_mask,
                stride_qh,
                m_i,
                l_i,
                acc,
                b_idx_row,
                (blk - a_blocks) * BLOCK_N,
                b_keys,
                b_nope,
                b_rope,
                b_scale,
                b_s_nope_p,
                b_s_nope_r,
                b_s_rope_p,
                b_s_rope_r,
                b_s_scale_p,
                b_s_scale_r,
                b_bs,
                b_slots,
                qk_scale_log2,
                v_t0,
                BLOCK_H,
                BLOCK_N,
                TILE,
                N_TILES,
                NOPE_TILES,
                QK_TILES,
                V_TILES,
                INTERPRETER,
            )

    _write_result(
        m_i, l_i, acc, offs_h, h_mask, offs_d, pid_t, pid_d, pid_s, split_offset, sink_ptr, out_ptr, stride_ot,
        stride_oh, lse_ptr, stride_lt, stride_lh, ws_m_ptr, ws_l_ptr, ws_acc_ptr, ws_splits, num_heads, D, SPLIT,
        INTERPRETER,
    )  # fmt: skip


@triton.jit
def _sparse_attn_combine(
    ws_m_ptr,
    ws_l_ptr,
    ws_acc_ptr,
    ws_splits,
    sink_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    lse_ptr,
    stride_lt,
    stride_lh,
    num_heads,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    INTERPRETER: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < ws_splits
    offs_d = tl.arange(0, D)
    base = (pid_t * num_heads + pid_h) * ws_splits
    m = tl.load(ws_m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    ll = tl.load(ws_l_ptr + base + offs_s, mask=s_mask, other=0.0)
    acc = tl.load(ws_acc_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    sink = tl.load(sink_ptr + pid_h) * 1.4426950408889634
    m_all = tl.maximum(tl.max(m, 0), sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_safe)
    denom = tl.sum(ll * w, 0) + tl.exp2(sink - m_safe)
    safe = tl.where(denom > 0.0, denom, 1.0)
    o = tl.sum(acc * w[:, None], 0) / safe
    lse = tl.where(denom > 0.0, (m_safe + tl.log2(safe)) * 0.6931471805599453, float("-inf"))
    tl.store(out_ptr + pid_t * stride_ot + pid_h * stride_oh + offs_d, _to_bf16(o, INTERPRETER))
    tl.store(lse_ptr + pid_t * stride_lt + pid_h * stride_lh, lse)


__all__ = [
    "LOG2E",
    "_load_tiles",
    "_mma",
    "_sparse_attn_combine",
    "_sparse_attn_fwd",
    "_to_bf16",
    "_write_result",
    "triton",
]
