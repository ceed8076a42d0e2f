"""Lightning-indexer scores over paged indexer keys (spec §4, §9.3, §13).

For every query row ``t`` and logical entry ``j`` of that row's request::

    score[t, j] = sum_h  w[t, h] * ReLU(q[t, h] . k_j)      for j < n_visible[t]
                = -inf                                        otherwise

``k_j`` lives at page ``block_table[token_row[t], j // bs]``, row ``j % bs`` (bs = entries per page).

Two key formats:

- **MXFP4** (``KeyPages``, 68 bytes a key, the format of record): the Triton kernel reads the packed
  e2m1 bytes and UE8M0 scales straight from the pages and converts them in registers to bf16 (every
  e2m1 value times a power of two is exact in bf16), then runs a bf16 ``tl.dot`` against the query of
  all heads.  Nothing is dequantised to HBM.
- **FP8** (``FP8KeyPages``, 132 bytes a key: 128 e4m3 + one fp32 scale, vLLM's default indexer cache):
  the same kernel shape, kept for comparison (it moves 1.94x more bytes).

Kernel layout: grid = (query rows, chunks of ``tiles_per_program * block_n`` entries).  A program loads
its query [Hi, 128] once, then for each tile of ``block_n`` entries gathers the keys through the block
table, converts them, computes the [Hi, block_n] logits with ``tl.dot`` (fp32 accumulation), applies
ReLU, the head weights and the head sum, and writes ``block_n`` scores.  Tiles at or past
``n_visible[t]`` load nothing and write -inf.  To avoid interleaving the packed nibbles, the MXFP4
kernel splits the head dim into even and odd elements: ``q.k = q[0::2].k_lo + q[1::2].k_hi`` (low
nibble = even element), i.e. two K=64 dots into one accumulator.  A key's four UE8M0 bytes are read as
one int32 word (the [P, bs, 4] scale view reinterpreted in place).  ``impl="dot_scaled"`` swaps the
conversion + dots for ``tl.dot_scaled`` (performance.md "Leads"; for measurement on the H200).

Under ``TRITON_INTERPRET`` the dots run in fp32 on operands widened from bf16 (exact), because the
interpreter's bf16 ``tl.dot`` is wrong in triton 3.9; on the GPU they are bf16 tensor-core MMAs.

Numerics: q (MXFP4-simulated, exact in bf16) and the keys (exact in bf16) are multiplied exactly and
summed in fp32 by the tensor core; the reference sums in fp32 in another order, so the two agree to a
few fp32 ulps of ``sum_d |q_d k_d|`` (tests use rtol = atol = 1e-5 on O(1) data).  Entries whose page
is -1 (outside the block table) score -inf in both paths.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.formats import FP8_DTYPE, KeyPages, MXFP4KeyFormat
from dsv4.formats.ue8m0 import ceil_log2_ratio
from dsv4.kernels.dispatch import interpreter_enabled, use_triton

__all__ = [
    "FP8KeyPages",
    "fp8_key_pages",
    "fp8_key_pages_from_mxfp4",
    "indexer_scores",
    "indexer_scores_fp8keys",
    "indexer_scores_fp8keys_reference",
    "indexer_scores_reference",
]

_FMT = MXFP4KeyFormat()
_FP8_MAX = torch.finfo(FP8_DTYPE).max
_FP8_AMAX_FLOOR = 1e-4  # same floor as the FP8 entry format (spec §13)


class FP8KeyPages(NamedTuple):
    """FP8 indexer keys in pages (vLLM's default): ``data`` [pages, bs, 128] uint8 (e4m3 bit patterns),
    ``scale`` [pages, bs] fp32 (one dequant multiplier a key).  Value = fp32(e4m3) * scale."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def entries_per_page(self) -> int:
        return self.data.shape[1]


def fp8_key_pages(keys: torch.Tensor) -> FP8KeyPages:
    """Quantise keys [pages, bs, dim] (any float dtype) to ``FP8KeyPages``.

    Per key: ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``, stored ``e4m3(rne(x / s))`` (torch's cast,
    round-to-nearest-even; ``x / s`` is within range by construction).
    """
    check_tensor("keys", keys, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=3)
    x = keys.float()
    e = ceil_log2_ratio(x.abs().amax(-1), _FP8_MAX, _FP8_AMAX_FLOOR)
    v = torch.ldexp(x, -e.unsqueeze(-1)).clamp(-_FP8_MAX, _FP8_MAX)
    data = v.to(FP8_DTYPE).view(torch.uint8).contiguous()
    scale = torch.ldexp(torch.ones_like(x[..., 0]), e).contiguous()
    return FP8KeyPages(data, scale)


def fp8_key_pages_from_mxfp4(keys: KeyPages) -> FP8KeyPages:
    """The same keys as ``keys`` (MXFP4) in the FP8 format.  Exact whenever a key's four block
    exponents lie within ~12 of each other (always, for RMS-normalised keys)."""
    return fp8_key_pages(_FMT.dequantize(keys.data, keys.scale))


# ---------------------------------------------------------------------------------------- validation
def _check_common(q, weights, block_table, token_row, n_visible, max_entries) -> tuple[int, int]:
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if D != _FMT.dim:
        raise ValueError(f"q: expected last dim {_FMT.dim}, got {list(q.shape)}")
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), device=q.device)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=q.device)
    check_tensor("token_row", token_row, dtype=torch.int32, shape=(T,), device=q.device)
    check_tensor("n_visible", n_visible, dtype=torch.int32, shape=(T,), device=q.device)
    if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 0:
        raise ValueError(f"max_entries: expected a host int >= 0, got {max_entries!r}")
    return T, H


def _gather_pages(block_table, token_row, n_visible, bs: int, n: int):
    """(page [T, N] int64 clamped >= 0, row-in-page [N], visible [T, N] bool) of logical entries 0..N-1."""
    dev = block_table.device
    j = torch.arange(n, device=dev)
    col = j // bs
    max_blocks = block_table.shape[1]
    in_table = col < max_blocks
    rows = block_table.long()[token_row.long()] if max_blocks else None
    if rows is None:
        page = torch.full((token_row.shape[0], n), -1, dtype=torch.long, device=dev)
    else:
        page = rows[:, col.clamp(max=max_blocks - 1)]
    vis = (j[None, :] < n_visible.long()[:, None]) & in_table[None, :] & (page >= 0)
    return page.clamp(min=0), j % bs, vis


def _score_from_keys(q, weights, k, vis):
    logits = torch.einsum("thd,tnd->thn", q.float(), k)
    s = (torch.relu(logits) * weights[:, :, None]).sum(1)
    return torch.where(vis, s, torch.full_like(s, float("-inf")))


# ---------------------------------------------------------------------------------------- references
def indexer_scores_reference(q, weights, keys: KeyPages, block_table, token_row, n_visible, max_entries: int):
    """PyTorch reference of ``indexer_scores`` (fp32 math on keys dequantised by MXFP4KeyFormat)."""
    page, prow, vis = _gather_pages(block_table, token_row, n_visible, keys.entries_per_page, max_entries)
    k = _FMT.dequantize(keys.data[page, prow], keys.scale[page, prow])  # [T, N, 128] fp32
    return _score_from_keys(q, weights, k, vis)


def indexer_scores_fp8keys_reference(
    q, weights, keys: FP8KeyPages, block_table, token_row, n_visible, max_entries: int
):
    """PyTorch reference of ``indexer_scores_fp8keys``."""
    page, prow, vis = _gather_pages(block_table, token_row, n_visible, keys.entries_per_page, max_entries)
    k = keys.data[page, prow].view(FP8_DTYPE).float() * keys.scale[page, prow].unsqueeze(-1)
    return _score_from_keys(q, weights, k, vis)


# ---------------------------------------------------------------------------------------- kernels
@triton.jit
def _e2m1_to_bf16(code, sbyte):
    """e2m1 code (int32, 0..15) times 2**(sbyte-127) as bf16, built from bits (exact).

    Magnitude index em = e<<1 | m.  Placing em at bit 6 gives bf16 exponent e and mantissa bit m; adding
    (sbyte-1)<<7 rebiases the exponent (value 2**(e-1) * (1 + m/2) * 2**(sbyte-127) for e >= 1); the
    subnormal code em = 1 (0.5) has no mantissa bit, and em = 0 is zero.  Needs 1 <= sbyte <= 252.
    """
    em = code & 7
    bits = (em << 6) + ((sbyte - 1) << 7)
    bits = tl.where(em == 1, bits - 64, bits)
    bits = tl.where(em == 0, 0, bits)
    bits = bits | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a @ b for bf16 a, b with fp32 accumulation.  Under TRITON_INTERPRET the interpreter's bf16
    dot is wrong (triton 3.9), so there both operands are widened to fp32 first (exact) and multiplied
    in IEEE fp32; on the GPU it is the bf16 tensor-core MMA."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _mxfp4_scores_kernel(
    q_ptr,
    w_ptr,
    data_ptr,
    scale_ptr,
    bt_ptr,
    row_ptr,
    nv_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_dp,
    stride_dr,
    stride_sp,
    stride_sr,
    stride_bt,
    stride_ot,
    H,
    N,
    BS,
    MAX_BLOCKS,
    HP: tl.constexpr,
    HALF_D: tl.constexpr,
    QBLOCK: tl.constexpr,
    N_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DOT_SCALED: tl.constexpr,
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(row_ptr + t).to(tl.int64)
    nv = tl.load(nv_ptr + t)

    offs_h = tl.arange(0, HP)
    offs_i = tl.arange(0, HALF_D)  # packed byte i holds elements 2i (low nibble) and 2i+1 (high)
    h_ok = offs_h < H
    q_row = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    if DOT_SCALED:
        q_full = tl.load(q_row + tl.arange(0, 2 * HALF_D)[None, :], mask=h_ok[:, None], other=0.0)
        q_even = q_full
        q_odd = q_full
    else:
        q_even = tl.load(q_row + 2 * offs_i[None, :], mask=h_ok[:, None], other=0.0)
        q_odd = tl.load(q_row + 2 * offs_i[None, :] + 1, mask=h_ok[:, None], other=0.0)
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0)
    sidx = (2 * offs_i) // QBLOCK  # scale index of both elements of byte i

    out_row = out_ptr + t.to(tl.int64) * stride_ot
    for tile in range(TILES):
        start = (chunk * TILES + tile) * BLOCK_N
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < N
        if start < nv:
            blk = offs_n // BS
            vis = (offs_n < nv) & (blk < MAX_BLOCKS)
            page = tl.load(bt_ptr + row * stride_bt + blk, mask=vis, other=-1)
            ok = vis & (page >= 0)
            page = tl.where(ok, page, 0).to(tl.int64)
            prow = (offs_n % BS).to(tl.int64)
            dptr = data_ptr + page * stride_dp + prow * stride_dr
            packed = tl.load(dptr[:, None] + offs_i[None, :], mask=ok[:, None], other=0)
            # the key's 4 UE8M0 bytes as one little-endian int32 load
            s4 = tl.load(scale_ptr + page * stride_sp + prow * stride_sr, mask=ok, other=0x7F7F7F7F)
            acc = tl.zeros((HP, BLOCK_N), tl.float32)
            if DOT_SCALED:
                sc = ((s4[:, None] >> (8 * tl.arange(0, N_SCALES)[None, :])) & 255).to(tl.uint8)
                acc = tl.dot_scaled(q_full, None, "bf16", tl.trans(packed), sc, "e2m1", acc)
            else:
                sbyte = (s4[:, None] >> (8 * sidx[None, :])) & 255  # scale byte (2i)//32 of byte i
                p32 = packed.to(tl.int32)
                k_lo = _e2m1_to_bf16(p32 & 15, sbyte)  # [BLOCK_N, HALF_D] even elements
                k_hi = _e2m1_to_bf16(p32 >> 4, sbyte)  # odd elements
                acc = _dot(q_even, tl.trans(k_lo), acc, FP32_DOT)
                acc = _dot(q_odd, tl.trans(k_hi), acc, FP32_DOT)  # [HP, BLOCK_N]
            s = tl.sum(tl.maximum(acc, 0.0) * w[:, None], axis=0)
            s = tl.where(ok, s, float("-inf"))
            tl.store(out_row + offs_n, s, mask=in_range)
        else:
            tl.store(out_row + offs_n, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=in_range)


@triton.jit
def _fp8_scores_kernel(
    q_ptr,
    w_ptr,
    data_ptr,
    scale_ptr,
    bt_ptr,
    row_ptr,
    nv_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_dp,
    stride_dr,
    stride_sp,
    stride_sr,
    stride_bt,
    stride_ot,
    H,
    N,
    BS,
    MAX_BLOCKS,
    HP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(row_ptr + t).to(tl.int64)
    nv = tl.load(nv_ptr + t)

    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, D)
    h_ok = offs_h < H
    q = tl.load(
        q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_ok[:, None],
        other=0.0,
    )
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0)

    out_row = out_ptr + t.to(tl.int64) * stride_ot
    for tile in range(TILES):
        start = (chunk * TILES + tile) * BLOCK_N
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < N
        if start < nv:
            blk = offs_n // BS
            vis = (offs_n < nv) & (blk < MAX_BLOCKS)
            page = tl.load(bt_ptr + row * stride_bt + blk, mask=vis, other=-1)
            ok = vis & (page >= 0)
            page = tl.where(ok, page, 0).to(tl.int64)
            prow = (offs_n % BS).to(tl.int64)
            bits = tl.load(
                (data_ptr + page * stride_dp + prow * stride_dr)[:, None] + offs_d[None, :], mask=ok[:, None], other=0
            )
            k = bits.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)  # [BLOCK_N, D], exact
            ks = tl.load(scale_ptr + page * stride_sp + prow * stride_sr, mask=ok, other=0.0)
            acc = _dot(q, tl.trans(k), tl.zeros((HP, BLOCK_N), tl.float32), FP32_DOT) * ks[None, :]
            s = tl.sum(tl.maximum(acc, 0.0) * w[:, None], axis=0)
            s = tl.where(ok, s, float("-inf"))
            tl.store(out_row + offs_n, s, mask=in_range)
        else:
            tl.store(out_row + offs_n, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=in_range)


def _scale_words(scale: torch.Tensor) -> torch.Tensor:
    """The [P, bs, 4] UE8M0 bytes as [P, bs] int32 words (one load a key).  A page-layout view
    (4-byte aligned rows) reinterprets in place; anything else is copied first."""
    n = scale.shape[-1]
    word = torch.iinfo(torch.int32).bits // 8
    if n != word:
        raise ValueError(f"keys.scale: expected {word} scale bytes a key for the word load, got {n}")
    try:
        return scale.view(torch.int32).squeeze(-1)
    except RuntimeError:
        return scale.contiguous().view(torch.int32).squeeze(-1)


def _launch_config(T: int, H: int, N: int, block_n: int | None, tiles_per_program: int | None):
    hp = max(16, triton.next_power_of_2(H))
    if block_n is None:
        block_n = 32 if interpreter_enabled() else 128
    n_tiles = triton.cdiv(N, block_n)
    if tiles_per_program is None:
        # Amortise the query load over several tiles while keeping >= ~1024 programs in flight.
        tiles_per_program = max(1, min(8, (n_tiles * T) // 1024))
    grid = (T, triton.cdiv(n_tiles, tiles_per_program))
    return hp, block_n, tiles_per_program, grid


# ---------------------------------------------------------------------------------------- public ops
def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: KeyPages,
    block_table: torch.Tensor,
    token_row: torch.Tensor,
    n_visible: torch.Tensor,
    max_entries: int,
    backend: str = "auto",
    *,
    block_n: int | None = None,
    tiles_per_program: int | None = None,
    impl: str = "convert",
) -> torch.Tensor:
    """Indexer scores of every query row against its request's MXFP4 keys.

    Args:
        q: [T, Hi, 128] bf16 index query, already RoPE'd, Hadamard-rotated and MXFP4-simulated.
        weights: [T, Hi] fp32 head weights, already multiplied by 128^-1/2 * Hi^-1/2.
        keys: ``KeyPages`` — data [P, bs, 64] uint8 (packed e2m1, low nibble = even element), scale
            [P, bs, 4] uint8 UE8M0 (bytes in [1, 252]; every key made by MXFP4KeyFormat.quantize of
            finite normalised values qualifies).
        block_table: [B, max_blocks] int32 physical page of each logical page, -1 padded.
        token_row: [T] int32 block-table row of each query row.
        n_visible: [T] int32 entries (not tokens) visible to each query row; 0 <= n_visible <= max_entries
            (causal rule ``j < (t + 1) // 4`` applied by the caller).
        max_entries: host int N, the static number of output columns.
        backend: "auto" | "torch" | "triton".
        block_n, tiles_per_program: Triton tiling (entries per tile, tiles per program); None = heuristic.
        impl: Triton inner product. "convert" (default): e2m1 -> bf16 by bit manipulation in registers,
            then bf16 ``tl.dot``.  "dot_scaled": ``tl.dot_scaled(q, None, "bf16", keys, scales, "e2m1")``,
            letting Triton lower the MXFP4 operand (on sm90 by up-conversion); an experiment for the H200.

    Returns:
        [T, N] fp32 scores; -inf for entries at or past n_visible (or on page -1).
    """
    T, H = _check_common(q, weights, block_table, token_row, n_visible, max_entries)
    if impl not in ("convert", "dot_scaled"):
        raise ValueError(f"impl: expected 'convert' or 'dot_scaled', got {impl!r}")
    check_tensor("keys.data", keys.data, dtype=torch.uint8, ndim=3, device=q.device)
    P, bs, _ = keys.data.shape
    check_tensor("keys.data", keys.data, shape=(P, bs, _FMT.data_bytes))
    check_tensor("keys.scale", keys.scale, dtype=torch.uint8, shape=(P, bs, _FMT.n_blocks), device=q.device)
    if not use_triton(backend, q, weights, keys.data, keys.scale, block_table, token_row, n_visible):
        return indexer_scores_reference(q, weights, keys, block_table, token_row, n_visible, max_entries)

    out = torch.empty((T, max_entries), dtype=torch.float32, device=q.device)
    if T == 0 or max_entries == 0:
        return out
    if keys.data.stride(2) != 1 or keys.scale.stride(2) != 1:
        raise ValueError("keys: the last dim of data and scale must be contiguous")
    q = q if q.stride(2) == 1 else q.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    scale32 = _scale_words(keys.scale)
    hp, bn, tiles, grid = _launch_config(T, H, max_entries, block_n, tiles_per_program)
    _mxfp4_scores_kernel[grid](
        q,
        weights,
        keys.data,
        scale32,
        block_table,
        token_row,
        n_visible,
        out,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        keys.data.stride(0),
        keys.data.stride(1),
        scale32.stride(0),
        scale32.stride(1),
        block_table.stride(0),
        out.stride(0),
        H,
        max_entries,
        bs,
        block_table.shape[1],
        HP=hp,
        HALF_D=_FMT.data_bytes,
        QBLOCK=_FMT.block,
        N_SCALES=_FMT.n_blocks,
        BLOCK_N=bn,
        TILES=tiles,
        FP32_DOT=interpreter_enabled(),
        DOT_SCALED=impl == "dot_scaled",
        num_warps=4,
    )
    return out


def indexer_scores_fp8keys(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: FP8KeyPages,
    block_table: torch.Tensor,
    token_row: torch.Tensor,
    n_visible: torch.Tensor,
    max_entries: int,
    backend: str = "auto",
    *,
    block_n: int | None = None,
    tiles_per_program: int | None = None,
) -> torch.Tensor:
    """``indexer_scores`` on 132-byte FP8 keys (``FP8KeyPages``: data [P, bs, 128] uint8 e4m3 bits,
    scale [P, bs] fp32).  Same arguments, result and tiling otherwise."""
    T, H = _check_common(q, weights, block_table, token_row, n_visible, max_entries)
    check_tensor("keys.data", keys.data, dtype=torch.uint8, ndim=3, device=q.device)
    P, bs, _ = keys.data.shape
    check_tensor("keys.data", keys.data, shape=(P, bs, _FMT.dim))
    check_tensor("keys.scale", keys.scale, dtype=torch.float32, shape=(P, bs), device=q.device)
    if not use_triton(backend, q, weights, keys.data, keys.scale, block_table, token_row, n_visible):
        return indexer_scores_fp8keys_reference(q, weights, keys, block_table, token_row, n_visible, max_entries)

    out = torch.empty((T, max_entries), dtype=torch.float32, device=q.device)
    if T == 0 or max_entries == 0:
        return out
    if keys.data.stride(2) != 1:
        raise ValueError("keys.data: the last dim must be contiguous")
    q = q if q.stride(2) == 1 else q.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    hp, bn, tiles, grid = _launch_config(T, H, max_entries, block_n, tiles_per_program)
    _fp8_scores_kernel[grid](
        q,
        weights,
        keys.data,
        keys.scale,
        block_table,
        token_row,
        n_visible,
        out,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        keys.data.stride(0),
        keys.data.stride(1),
        keys.scale.stride(0),
        keys.scale.stride(1),
        block_table.stride(0),
        out.stride(0),
        H,
        max_entries,
        bs,
        block_table.shape[1],
        HP=hp,
        D=_FMT.dim,
        BLOCK_N=bn,
        TILES=tiles,
        FP32_DOT=interpreter_enabled(),
        num_warps=4,
    )
    return out
