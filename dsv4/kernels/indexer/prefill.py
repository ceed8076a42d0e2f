"""Indexer scores of a prefill: many query rows of one request against that request's keys (spec §4, §9.3).

``indexer_scores`` gives every query row its own programs: each gathers its row's key tiles through the block
table and re-encodes them (MXFP4 -> e4m3) before its MMA.  In a prefill the rows of one request share their keys
(row t sees the request's first ``n_visible[t]`` entries), so that per-row work is repeated once a query row: at
65,536 tokens from position 0 the Gluon kernel took 20.6 ms of a 101 ms V4-Flash CSA layer on the H200 (session
19's profile), with 64 heads on the MMA's N side and the key conversion, loads and hand-offs paid per (row, tile).

Here it is done in two launches:

1. ``fold_keys``: the request's first ``n`` entries, read once through its block-table row, as dense e4m3 codes
   [n_pad, 128] (natural element order) and one fp32 factor an entry: the "fold" encoding of
   ``scores._fold_tables`` / ``impl="gluon_fold"`` (auto's choice for the indexer): element v of a block d binades
   below the key's largest block is stored as v * 2**(6 - d), blocks with d > 11 are flushed to zero, and the
   factor is 2**(s_max - 127) (0 for an entry that is not in the pool: page -1, past the table, past ``n``).
   68 bytes read and 132 written an entry (2.2 MB at 16,384 entries).
2. ``prefill_scores``: a Triton kernel over groups of ``rows`` consecutive query rows (default 2): the query of
   the group is one e4m3 operand [rows x heads, 128] (a power-of-two scale a (row, head), as ``gluon_fold``), and
   every key tile [block_n, 128] is loaded once for the group and multiplied by one K = 128 FP8 ``tl.dot`` into
   [block_n, rows x heads] fp32; then ReLU, the head weights (with the query's scale and the codes' 2**-6), the
   head sum of each row and the key factor.  A group whose query is not exact with one scale a head (never for
   MXFP4-simulated queries whose blocks lie within ~8 binades) takes a second loop: one scale a (row, head,
   32-block), four K = 32 dots a tile, each block's partial scaled back before the sum.

Numerics are ``gluon_fold``'s (not bit-equal to it: the K order differs, and the tensor core's FP8 accumulation is
not exact): the products are exact, the sum over K = 128 is the FP8 MMA's.  The reference
(``prefill_scores_reference``) computes the same scores from the folded keys in fp32; on keys without flushed
blocks that is ``indexer_scores_reference``.

Entries at or past a row's ``n_visible`` (and entries with factor 0) score -inf, as ``indexer_scores``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.formats import FP8_DTYPE, KeyPages, MXFP4KeyFormat
from dsv4.kernels.dispatch import interpreter_enabled, num_sms, use_triton
from dsv4.kernels.indexer import scores as _scores
from dsv4.kernels.indexer.scores import _dot, _e2m1_to_bf16, _pow2

_FMT = MXFP4KeyFormat()
_DIM = _FMT.dim  # 128 values a key
_QBLOCK = _FMT.block  # 32 values a UE8M0 scale
FOLD_C = tl.constexpr(_scores._FOLD_C)
FOLD_MAX_D = tl.constexpr(_scores._FOLD_MAX_D)
PAD = 128  # fold_keys pads its outputs to a multiple of this many entries (the largest block_n)
# prefill_scores' launch (query rows a program: the MMA's N side is rows x 64 heads; entries a tile: its M side; warps;
# pipelining stages), from sm_90 SASS compiled offline (triton 3.6, ``sass_report.py prefill_idx:4096:16384``), not
# yet timed: rows 2 / 64 entries / 4 warps needs 144 registers a thread (3 programs a SM, so one program's MMA can
# run under another's epilogue); 4 / 128 / 8 needs 242 (one program a SM), 2 / 128 / 8 154 (one), 4 / 64 / 4 238
# (two).  Timed on the H100, 2026-12-05 (2026-12-05_h100_prefill_idx_s21.txt, rows / entries / warps / stages): 2,048
# rows at P = 8,192 2/64/4/3 123.6 us, 1/128/4/3 112.9, 2/128/4/3 125.6, 4/64/4/3 141.1, 4/128/8/3 208.9; 4,096 rows
# at P = 65,536 2/64/4/3 1,196 (the best), 2/64/4/4 1,212, 2/128/4/3 1,236, 1/128/4/3 1,264, 4/128/8/3 1,465.
DEFAULT_ROWS = 2
DEFAULT_BLOCK_N = 64
DEFAULT_WARPS = 4
DEFAULT_STAGES = 3
_PROGRAMS_PER_SM = 8  # grid target: a group's key range is split over programs until the grid has this many a SM
_MIN_TILES = 8  # ... with at least this many tiles a program


class FoldedKeys(NamedTuple):
    """One request's keys in the fold encoding: ``codes`` [n_pad, 128] e4m3 (``torch.float8_e4m3fn``), ``factor``
    [n_pad] fp32 (2**(s_max - 127), 0 for an entry not in the pool); entry j's value is codes[j] * factor[j] / 64
    with blocks more than 11 binades below the key's largest flushed to 0.  ``n`` (host int): entries folded; rows
    n .. n_pad - 1 hold zeros."""

    codes: torch.Tensor
    factor: torch.Tensor
    n: int


# ------------------------------------------------------------------------------------------------ references
def fold_keys_reference(keys: KeyPages, block_table: torch.Tensor, table_row: int, n: int) -> FoldedKeys:
    """PyTorch reference of ``fold_keys``."""
    bs, n_pad = keys.entries_per_page, _padded(n)
    dev = keys.data.device
    j = torch.arange(n_pad, device=dev)
    blk = j // bs
    max_blocks = block_table.shape[1]
    page = block_table[table_row].long()[blk.clamp(max=max(max_blocks - 1, 0))] if max_blocks else -torch.ones_like(j)
    ok = (j < n) & (blk < max_blocks) & (page >= 0) & (page < keys.data.shape[0])
    page, row = torch.where(ok, page, 0), j % bs
    sb = keys.scale[page, row].long()  # [n_pad, 4] UE8M0 bytes
    v = _FMT.dequantize(keys.data[page, row], torch.full_like(keys.scale[page, row], 127))  # e2m1 values
    smax = sb.max(dim=1).values
    d = smax[:, None] - sb
    mult = torch.where(d <= _scores._FOLD_MAX_D, torch.exp2((_scores._FOLD_C - d).double()), 0.0).float()
    codes = (v.unflatten(1, (_FMT.n_blocks, _QBLOCK)) * mult[:, :, None]).flatten(1)
    codes = torch.where(ok[:, None], codes, 0.0).to(FP8_DTYPE)
    factor = torch.where(ok, torch.exp2((smax.clamp(min=1) - 127).double()), 0.0).float()
    return FoldedKeys(codes, factor, n)


def folded_values(folded: FoldedKeys) -> torch.Tensor:
    """fp32 [n_pad, 128]: the key values the folded codes stand for (exact)."""
    return folded.codes.float() * (folded.factor[:, None] * 2.0**-_scores._FOLD_C)


def prefill_scores_reference(
    q: torch.Tensor, weights: torch.Tensor, folded: FoldedKeys, n_visible: torch.Tensor, n_cols: int
) -> torch.Tensor:
    """PyTorch reference of ``prefill_scores``: fp32 [T, n_cols], sum_h w[t, h] ReLU(q[t, h] . k_j) over the folded
    keys' values for j < n_visible[t] with factor[j] > 0, -inf elsewhere."""
    k = folded_values(folded)[:n_cols]
    logits = torch.einsum("thd,nd->thn", q.float(), k)
    s = (torch.relu(logits) * weights[:, :, None]).sum(1)
    j = torch.arange(n_cols, device=q.device)
    vis = (j[None, :] < n_visible.long()[:, None]) & (folded.factor[:n_cols] > 0)[None, :]
    return torch.where(vis, s, torch.full_like(s, float("-inf")))


# ------------------------------------------------------------------------------------------------ kernels
@triton.jit
def _fold_keys_kernel(
    data_ptr, scale_ptr, bt_ptr, codes_ptr, factor_ptr,
    stride_dp, stride_dr, stride_sp, stride_sr, table_row, stride_bt,
    n, max_blocks, num_pages,
    BS: tl.constexpr, BLOCK: tl.constexpr, HALF_D: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """Entries [pid * BLOCK, pid * BLOCK + BLOCK): codes [BLOCK, 2 HALF_D] e4m3 and factors [BLOCK]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    blk = offs // BS
    vis = (offs < n) & (blk < max_blocks)
    page = tl.load(bt_ptr + table_row * stride_bt + blk, mask=vis, other=-1)
    ok = vis & (page >= 0) & (page < num_pages)
    page = tl.where(ok, page, 0).to(tl.int64)
    row = (offs % BS).to(tl.int64)
    i = tl.arange(0, HALF_D)
    packed = tl.load(data_ptr + page[:, None] * stride_dp + row[:, None] * stride_dr + i[None, :], mask=ok[:, None])
    packed = packed.to(tl.int32)
    sw = tl.load(scale_ptr + page * stride_sp + row * stride_sr, mask=ok, other=0)  # 4 UE8M0 bytes, one word
    smax = tl.maximum(tl.maximum(sw & 255, (sw >> 8) & 255), tl.maximum((sw >> 16) & 255, (sw >> 24) & 255))
    # block of byte i: elements 2i and 2i + 1 lie in block (2 i) // 32
    sb = (sw[:, None] >> (8 * ((2 * i) // (2 * HALF_D // NB)))[None, :]) & 255
    d = smax[:, None] - sb
    near = d <= FOLD_MAX_D
    keep = tl.where(near, 1.0, 0.0)  # blocks further down flushed (to a zero of the value's sign)
    sadd = (FOLD_C + 126 - tl.where(near, d, 0)) << 7  # the nibbles' values times 2**(FOLD_C - d), as bf16
    lo = _e2m1_to_bf16(packed & 15, sadd).to(tl.float32) * keep  # element 2i
    hi = _e2m1_to_bf16(packed >> 4, sadd).to(tl.float32) * keep  # element 2i + 1
    codes = tl.reshape(tl.join(lo, hi), [BLOCK, 2 * HALF_D])  # exact in e4m3 (normals: d <= 11)
    codes = tl.where(ok[:, None], codes, 0.0)
    j = tl.arange(0, 2 * HALF_D)
    tl.store(codes_ptr + offs.to(tl.int64)[:, None] * (2 * HALF_D) + j[None, :], codes.to(tl.float8e4nv))
    tl.store(factor_ptr + offs, tl.where(ok, _pow2(tl.maximum(smax, 1)), 0.0))


@triton.jit
def _epilogue(acc, wq, f, offs_n, nv, t_ok, out_ptrs, N_COLS, R: tl.constexpr, HP: tl.constexpr):
    """[BLOCK_N, R HP] logits -> ReLU, head weights, head sum of each row, key factor; -inf where not visible."""
    BLOCK_N: tl.constexpr = acc.shape[0]
    s = tl.sum(tl.reshape(tl.maximum(acc, 0.0) * wq[None, :], [BLOCK_N, R, HP]), axis=2)  # [BLOCK_N, R]
    ok = (offs_n[:, None] < nv[None, :]) & (f > 0.0)[:, None]
    tl.store(out_ptrs, tl.where(ok, s * f[:, None], float("-inf")), mask=t_ok[None, :] & (offs_n < N_COLS)[:, None])


@triton.jit
def _prefill_scores_kernel(
    q_ptr, w_ptr, codes_ptr, factor_ptr, nv_ptr, out_ptr, flag_ptr,
    stride_qt, stride_qh, stride_wt, stride_ot,
    T, H, N_COLS, tiles,
    R: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, QB: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, GENERAL: tl.constexpr,
):  # fmt: skip
    """Program (g, c): query rows [g R, g R + R), key tiles [c tiles, c tiles + tiles) of BLOCK_N entries.

    GENERAL = False (launch 1): groups whose query is exact with one scale a (row, head) are scored; program (g, 0)
    writes ``flag[g]`` = 1 for a group that is not (0 else), and tiles at or past the group's largest n_visible are
    written -inf without loads.  GENERAL = True (launch 2): the flagged groups' live tiles with one scale a (row,
    head, 32-block); the others return at once.  (Two launches keep the rare path's registers out of the fast one.)"""
    g = tl.program_id(0)
    first = tl.program_id(1) * tiles
    if GENERAL:
        if tl.load(flag_ptr + g) == 0:
            return
    t = g * R + tl.arange(0, R)
    t_ok = t < T
    nv = tl.minimum(tl.load(nv_ptr + t, mask=t_ok, other=0), N_COLS)  # (a larger count reads nothing past it)
    n_live = tl.minimum(tl.maximum((tl.max(nv, axis=0) - first * BLOCK_N + BLOCK_N - 1) // BLOCK_N, 0), tiles)
    out_base = out_ptr + t.to(tl.int64)[None, :] * stride_ot  # [1, R]
    tile0 = first * BLOCK_N + tl.arange(0, BLOCK_N)

    # the group's query [R HP, D]: (row, head) r HP + h; each (row, head) scaled by 2**(127 - e), e the biased
    # exponent of its largest |value| (its largest value in [1, 2)); exact in e4m3 for MXFP4-simulated queries
    rh = tl.arange(0, R * HP)
    qt = g * R + rh // HP
    qh = rh % HP
    q_ok = (qt < T) & (qh < H)
    q_rows = q_ptr + qt.to(tl.int64)[:, None] * stride_qt + qh[:, None] * stride_qh
    qf = tl.load(q_rows + tl.arange(0, D)[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)
    e = (tl.max(tl.abs(qf), axis=1).to(tl.int32, bitcast=True) >> 23) & 255
    e = tl.where(e == 0, 127, e)
    qs = qf * _pow2(254 - e)[:, None]
    q8 = qs.to(tl.float8e4nv)
    exact = tl.min(tl.min((q8.to(tl.float32) == qs).to(tl.int32), axis=1), axis=0)
    w = tl.load(w_ptr + qt.to(tl.int64) * stride_wt + qh, mask=q_ok, other=0.0)
    wq = w * _pow2(e) * (2.0**-FOLD_C)  # the query's scale and the codes' 2**6, undone after the ReLU

    if not GENERAL:
        if tl.program_id(1) == 0:
            tl.store(flag_ptr + g, 1 - exact)
        if exact != 0:
            q8t = tl.trans(q8)  # [D, R HP]
            for i in range(0, n_live):
                offs_n = tile0 + i * BLOCK_N
                k = tl.load(codes_ptr + offs_n.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :])  # [BLOCK_N, D]
                f = tl.load(factor_ptr + offs_n)
                acc = _dot(k, q8t, None, FP32_DOT)  # [BLOCK_N, R HP]
                _epilogue(acc, wq, f, offs_n, nv, t_ok, out_base + offs_n[:, None], N_COLS, R, HP)
        for i in range(n_live, tiles):
            offs_n = tile0 + i * BLOCK_N
            tl.store(out_base + offs_n[:, None], tl.full((BLOCK_N, R), float("-inf"), tl.float32),
                     mask=t_ok[None, :] & (offs_n < N_COLS)[:, None])  # fmt: skip
    else:
        # one scale a (row, head, block): block b's partial times 2**(e_b - e) (exact powers of two; 0 below 2**-126)
        for i in range(0, n_live):
            offs_n = tile0 + i * BLOCK_N
            f = tl.load(factor_ptr + offs_n)
            acc = tl.zeros((BLOCK_N, R * HP), tl.float32)
            for b in tl.static_range(D // QB):
                cols = b * QB + tl.arange(0, QB)
                qb = tl.load(q_rows + cols[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)  # [R HP, QB]
                eb = (tl.max(tl.abs(qb), axis=1).to(tl.int32, bitcast=True) >> 23) & 255
                eb = tl.where(eb == 0, 127, eb)
                q8b = (qb * _pow2(254 - eb)[:, None]).to(tl.float8e4nv)
                rel = eb - e + 127
                cb = tl.where(rel >= 1, _pow2(tl.maximum(rel, 1)), 0.0)
                kb = tl.load(codes_ptr + offs_n.to(tl.int64)[:, None] * D + cols[None, :])  # [BLOCK_N, QB]
                acc += _dot(kb, tl.trans(q8b), None, FP32_DOT) * cb[None, :]
            _epilogue(acc, wq, f, offs_n, nv, t_ok, out_base + offs_n[:, None], N_COLS, R, HP)


# ------------------------------------------------------------------------------------------------ launchers
def _padded(n: int) -> int:
    return max(PAD, -(-n // PAD) * PAD)


def fold_keys(keys: KeyPages, block_table: torch.Tensor, table_row: int, n: int, backend: str = "auto") -> FoldedKeys:
    """One request's first ``n`` keys (block-table row ``table_row``) in the fold encoding (see ``FoldedKeys``).

    Args:
        keys: ``KeyPages`` (data [P, bs, 64] uint8, scale [P, bs, 4] uint8, last dims contiguous).
        block_table: [B, max_blocks] int32 physical page of each logical page, -1 padded.
        table_row: host int in [0, B), the request's row.
        n: host int >= 0, entries to fold (entries past the table or on page -1 get factor 0).
        backend: "auto" | "torch" | "triton".

    Returns:
        ``FoldedKeys`` with ``n_pad`` = n rounded up to a multiple of ``PAD`` (at least ``PAD``).
    """
    bs = _scores._check_mxfp4_keys(keys, keys.data.device)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=keys.data.device)
    B = block_table.shape[0]
    for name, v, hi in (("table_row", table_row, B - 1), ("n", n, None)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (hi is not None and v > hi):
            raise ValueError(f"{name}: expected a host int in [0, {hi if hi is not None else 'inf'}], got {v!r}")
    if not use_triton(backend, keys.data, keys.scale, block_table):
        return fold_keys_reference(keys, block_table, table_row, n)
    if keys.data.stride(2) != 1 or keys.scale.stride(2) != 1:
        raise ValueError("keys: the last dim of data and scale must be contiguous")
    n_pad = _padded(n)
    dev = keys.data.device
    codes = torch.empty((n_pad, _DIM), dtype=FP8_DTYPE, device=dev)
    factor = torch.empty((n_pad,), dtype=torch.float32, device=dev)
    scale32 = _scores._scale_words(keys.scale)
    block = 32 if interpreter_enabled() else 64
    bt = block_table.contiguous()
    _fold_keys_kernel[(n_pad // block,)](
        keys.data, scale32, bt, codes, factor, keys.data.stride(0), keys.data.stride(1), scale32.stride(0),
        scale32.stride(1), table_row, bt.stride(0), n, bt.shape[1], keys.data.shape[0], BS=bs, BLOCK=block,
        HALF_D=_DIM // 2, NB=_FMT.n_blocks, num_warps=4,
    )  # fmt: skip
    return FoldedKeys(codes, factor, n)


def prefill_launch(T: int, n_cols: int, device: torch.device, rows: int, block_n: int) -> tuple[int, int, int]:
    """(groups, programs a group, tiles a program): ``cdiv(T, rows)`` groups; a group's ``cdiv(n_cols, block_n)``
    tiles are split over programs until the grid has about ``_PROGRAMS_PER_SM`` programs a SM, keeping at least
    ``_MIN_TILES`` tiles a program."""
    groups, n_tiles = -(-T // rows), max(1, -(-n_cols // block_n))
    target = _PROGRAMS_PER_SM * num_sms(device)  # (~2.7 waves of 3 resident programs a SM: a short tail wave)
    per = max(1, min(n_tiles, -(-target // max(groups, 1))))  # programs a group
    tiles = max(min(_MIN_TILES, n_tiles), -(-n_tiles // per))
    return groups, -(-n_tiles // tiles), tiles


def prefill_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    folded: FoldedKeys,
    n_visible: torch.Tensor,
    n_cols: int,
    backend: str = "auto",
    *,
    out: torch.Tensor | None = None,
    rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Indexer scores of query rows that all belong to the request whose keys ``folded`` holds.

    Args:
        q: [T, Hi, 128] bf16 index query (RoPE'd, Hadamard-rotated, MXFP4-simulated); rows x HP <= 256 with HP the
            next power of two >= max(Hi, 16) (the MMA's N side; V4: 64 heads).
        weights: [T, Hi] fp32 head weights.
        folded: ``fold_keys`` of the request, with ``folded.n >= n_cols``.
        n_visible: [T] int32 entries visible to each row, in [0, n_cols].
        n_cols: host int, output columns.
        backend: "auto" | "torch" | "triton".
        out: optional [T, n_cols] fp32 destination (last dim contiguous; e.g. a slice of a chunk's scores).
        rows, block_n, num_warps, num_stages: the Triton launch (query rows a program, entries a tile, warps,
            pipelining stages); None: ``DEFAULT_ROWS`` (fewer where rows x HP would pass 256), ``DEFAULT_BLOCK_N``,
            ``DEFAULT_WARPS``, ``DEFAULT_STAGES`` (interpreter: 2, 32, 4, 1).

    Returns:
        [T, n_cols] fp32 (``out`` when given): ``prefill_scores_reference``'s scores up to the FP8 MMA's accumulation.
    """
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if D != _DIM or H < 1:
        raise ValueError(f"q: expected [T, Hi >= 1, {_DIM}], got {list(q.shape)}")
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), device=q.device)
    check_tensor("n_visible", n_visible, dtype=torch.int32, shape=(T,), device=q.device)
    if not isinstance(n_cols, int) or isinstance(n_cols, bool) or not 0 <= n_cols <= folded.n:
        raise ValueError(f"n_cols: expected a host int in [0, folded.n = {folded.n}], got {n_cols!r}")
    check_tensor("folded.codes", folded.codes, dtype=FP8_DTYPE, shape=(None, _DIM), device=q.device)
    check_tensor("folded.factor", folded.factor, dtype=torch.float32, shape=(folded.codes.shape[0],), device=q.device)
    if folded.codes.shape[0] < _padded(folded.n) or not folded.codes.is_contiguous():
        raise ValueError(f"folded: expected contiguous codes of >= {_padded(folded.n)} rows (fold_keys' padding)")
    if out is not None:
        check_tensor("out", out, dtype=torch.float32, shape=(T, n_cols), device=q.device)
        if n_cols and out.stride(1) != 1:
            raise ValueError(f"out: expected a contiguous last dim, got strides {out.stride()}")
    if not use_triton(backend, q, weights, folded.codes, n_visible):
        ref = prefill_scores_reference(q, weights, folded, n_visible, n_cols)
        return ref if out is None else out.copy_(ref)
    out = torch.empty((T, n_cols), dtype=torch.float32, device=q.device) if out is None else out
    if T == 0 or n_cols == 0:
        return out
    interp = interpreter_enabled()
    hp = max(16, 1 << (H - 1).bit_length())
    rows = rows if rows is not None else max(1, min(2 if interp else DEFAULT_ROWS, 256 // hp))
    block_n = block_n if block_n is not None else (32 if interp else DEFAULT_BLOCK_N)
    for name, v in (("rows", rows), ("block_n", block_n)):
        if not isinstance(v, int) or v < 1 or v & (v - 1) or (name == "block_n" and not 16 <= v <= PAD):
            raise ValueError(f"{name}: expected a power of two{' in [16, 128]' if name == 'block_n' else ''}, got {v}")
    if rows * hp > 256:
        raise ValueError(f"rows: expected rows x {hp} (heads, padded) <= 256 (the MMA's N side), got rows = {rows}")
    groups, per, tiles = prefill_launch(T, n_cols, q.device, rows, block_n)
    q = q if q.stride(2) == 1 else q.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    flags = torch.empty((groups,), dtype=torch.int32, device=q.device)
    for general in (False, True):
        _prefill_scores_kernel[(groups, per)](
            q, weights, folded.codes, folded.factor, n_visible.contiguous(), out, flags, q.stride(0), q.stride(1),
            weights.stride(0), out.stride(0), T, H, n_cols, tiles, R=rows, HP=hp, D=_DIM, QB=_QBLOCK,
            BLOCK_N=block_n, FP32_DOT=interp, GENERAL=general, num_warps=num_warps or DEFAULT_WARPS,
            num_stages=num_stages or (1 if interp else DEFAULT_STAGES),
        )  # fmt: skip
    return out


__all__ = [
    "FoldedKeys",
    "fold_keys",
    "fold_keys_reference",
    "folded_values",
    "prefill_launch",
    "prefill_scores",
    "prefill_scores_reference",
]
