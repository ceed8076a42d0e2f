"""Top-k selection of indexer scores, and logical -> physical entry slots (spec §4 "Selection").

``topk_indices(scores, k, n_visible)`` returns, per row, the logical indices of the
``min(k, #selectable)`` largest scores, where an entry is selectable iff ``j < n_visible[t]`` and its
score is neither -inf nor NaN.  The rest of the row is padded with -1.

Order and ties (deterministic, identical in both backends): indices are sorted by score descending,
then by index ascending; among equal scores the lower index wins a place at the boundary.  -0.0 and
+0.0 are equal.

Scores are mapped to 32-bit order-preserving integer keys (float bits, magnitude bits flipped for
negatives; -0.0 folded to +0.0), so "larger score" = "larger key".  Digits of the key, high to low,
are d1 = bits 31..24 (sign-flipped), d2 = 23..16, d3 = 15..8, d4 = 7..0.  Both Triton paths are radix
selects on these digits; no host sync, static shapes, no data-dependent launch sizes, and the
workspace is scratch only (never needs zeroing).

Split path (long rows, few rows: S = ``splits`` programs per row, each owning a contiguous chunk of
``ceil(N / S)`` entries rounded up to a multiple of 16; four launches, no atomics):

1. ``_split_hist1`` grid (T, S): 256-bin histogram of d1 over the chunk's selectable entries ->
   H1[t, s, :] in the workspace (each program writes only its own row of H1).
2. ``_split_hist2`` grid (T, S): every program sums H1[t] over the splits (identical inputs, so every
   program of the row derives the same bucket b1 holding the kk-th largest, kk = min(k, #selectable)),
   then histograms d2 over its chunk's entries with d1 == b1 -> H2[t, s, :].
3. ``_split_scatter`` grid (T, S): from H1[t], H2[t] every program derives the 16-bit prefix
   P = (b1, b2) of the kk-th largest and, per split s', the number of winners (key prefix > P) and
   candidates (prefix == P).  Exclusive prefix sums over s' < s give this program's own ranges of the
   row's list L = [winners in index order | candidates in index order] (|L| <= N); it re-reads its chunk
   and writes (index, 32-bit key) of each winner / candidate to L in the workspace.  Program s == 0
   also writes the row's counts (meta).
4. ``_split_finish`` grid (T, R), R = ``finish_programs`` (default ceil(k / 32)): every program of the
   row repeats the same radix select on the candidates' d3, d4 (contiguous reads, no gather), giving the
   exact threshold key ``thr`` and ``idx_thr``, the index of the last candidate equal to it that is
   taken (the first ``need`` in index order), so "chosen" = winner, or key > thr, or key == thr and
   index <= idx_thr; it also bounds L to the prefix ``end`` holding every chosen entry.  Then a rank
   sort replaces a one-program ``tl.sort``: the program ranks its slices of 32 entries of L (strided by
   32 R) against all of L[:end] ([32, 512] compare tiles: score desc, index asc) and stores each chosen
   entry at out[t, rank]; ranks of the chosen are exactly 0 .. kk-1 (everything ahead of a chosen entry
   is chosen, and L holds every chosen entry), so each output position has one writer.  Positions
   kk .. k-1 get -1, each program writing its own 32-wide stripes.

Race freedom by construction (the interpreter runs programs one after another and cannot show
races, so none may exist): programs of one launch never read what another program of the same launch
writes; data crosses programs only through launch boundaries (stream order).  Every output position
has exactly one writer: programs derive their ranges from exclusive prefix sums of counts that all of
them compute identically (integer sums of the same H1/H2), and those counts equal what each program
then counts in its own chunk (same classification function, same chunk bounds); in the last launch,
positions come from ranks under a total order (unique (key, index) pairs).  The result (values and
positions) is therefore deterministic run to run.

Cost per call (T rows of N fp32 scores, S splits): four launches.  Launch 1 reads the scores (4 N T
bytes, from HBM) and writes S KiB of H1 per row; launches 2 and 3 re-read them (mostly from L2) and
each of their T S programs also reads its row's S x 256 int32 histograms (S KiB: T S^2 KiB in all,
twice in launch 3); launch 3 writes L (8 bytes per winner / candidate).  Each of the T R programs of
launch 4 reads the candidates three times (the threshold), its slices of L and L[:end] once per slice
(|L| / (32 R) slices): ~ |L|^2 / R compares per program, ~35 K for k = 1,024 (|L| ~ 1,070, R = 32).
The candidates are the entries sharing the kk-th largest key's top 16 bits (sign, exponent, 7 mantissa
bits): ~45 for 262,144 normal scores at k = 1,024 (vs ~5,850 sharing its top 8 bits), but every copy of
the threshold value when many scores are exactly equal (then every finishing program loops over them
for the threshold, but ranks only L[:end], i.e. up to the last chosen one).
For T = 4, N = 262,144 (auto S = 32): 4 MiB from HBM, ~20 MiB from L2.

Why 8 + 8 histogram bits and not one 12-bit pass: ``tl.histogram`` lowers to a warp-ballot histogram
whose cost per element grows with the bins each lane owns (bins / 32), so 4,096 bins cost ~16x the
instructions of 256 per element, more than the second 256-bin pass saves; and each scatter program
would then read S x 4,096 per-split counts instead of S x 256.

Single-program path (``splits == 1``: short rows or many rows; one program per row, scratch = the
output row plus N int32 of the workspace):

1-2. Full-row 256-bin histogram of d1; suffix sums give the bucket b0 holding the kk-th largest.
3. Full row again: d1 > b0 -> winners to out[t]; d1 == b0 -> candidate indices to the workspace.
4. Radix select on the candidates over d2, d3, d4 (each pass gathers the candidates' scores).
5. Compaction of the candidates in index order: key > thr, or key == thr among the first ``need``.
6. The kk indices are re-read with their scores, turned into int64 keys ``key << 32 | (2^32-1-index)``
   (unique, so the order is total) and sorted descending with ``tl.sort``; the rest of the row is -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.kernels.dispatch import interpreter_enabled, use_triton

__all__ = ["to_physical", "topk_indices", "topk_indices_reference", "topk_workspace"]

_MAX_K = 4096  # largest k the Triton kernels sort in registers
_BINS = 256  # histogram bins per 8-bit digit (the kernels hard-code 256)
_META = 4  # per-row counts the split path passes to its last launch: n_win, n_cand, need (+ 1 spare)
_MAX_SPLITS = 64  # programs per row on the split path ([64, 256] histogram tiles stay in registers)
_TARGET_PROGRAMS = 128  # auto splits: about one program per SM in all
_MIN_CHUNK = 4096  # auto splits: entries per program at least
_MAX_BLOCK = 8192  # split path: entries per loop iteration of a (T, S) program at most
_FINISH_SLICE = 32  # split path, finish: list entries ranked per slice ([E, BJ] compare tiles)
_FINISH_BJ = 512  # split path, finish: list entries compared against per inner iteration
_FINISH_CBLOCK = 256  # split path, finish: candidates per iteration of the threshold search
_MAX_FINISH = 64  # split path: finishing programs per row at most


# ---------------------------------------------------------------------------------------- reference
def _selectable(scores: torch.Tensor, n_visible: torch.Tensor | None) -> torch.Tensor:
    sel = ~(torch.isneginf(scores) | torch.isnan(scores))
    if n_visible is not None:
        j = torch.arange(scores.shape[1], device=scores.device)
        sel &= j[None, :] < n_visible.long()[:, None]
    return sel


def topk_indices_reference(scores: torch.Tensor, k: int, n_visible: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference: a stable descending sort of the selectable scores (ties keep index order)."""
    sel = _selectable(scores, n_visible)
    s = torch.where(sel, scores + 0.0, torch.full_like(scores, float("-inf")))  # + 0.0 folds -0.0
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
    n_sel = sel.sum(1, keepdim=True)
    pos = torch.arange(order.shape[1], device=scores.device)[None, :]
    idx = torch.where(pos < n_sel, order, torch.full_like(order, -1)).to(torch.int32)
    if idx.shape[1] < k:  # k > N: pad
        idx = torch.cat([idx, idx.new_full((idx.shape[0], k - idx.shape[1]), -1)], dim=1)
    return idx


# ---------------------------------------------------------------------------------------- kernel
@triton.jit
def _order_key(x):
    """fp32 -> int32 key with the same order (-0.0 -> +0.0; larger float = larger signed key)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _pick_bucket(hist, need, bins):
    """Bucket b holding the need-th largest element (buckets ordered high = larger) and the count above it."""
    total = tl.sum(hist, axis=0)
    suffix = total - tl.cumsum(hist, axis=0) + hist  # elements in buckets >= b (non-increasing in b)
    b = tl.sum((suffix >= need).to(tl.int32), axis=0) - 1
    above = tl.sum(tl.where(bins == b, suffix - hist, 0), axis=0)
    return b, above


@triton.jit
def _sort_winners(row, out_row, kk, K, KP: tl.constexpr):
    """out_row[:kk] holds the chosen indices (any order): sort them by score desc, index asc; -1 pad to K."""
    offs_k = tl.arange(0, KP)
    live = offs_k < kk
    idx = tl.load(out_row + offs_k, mask=live, other=0)
    key = _order_key(tl.load(row + idx, mask=live, other=0.0)).to(tl.int64)
    comp = (key << 32) | (4294967295 - idx.to(tl.int64))  # unique per index: a total order
    comp = tl.where(live, comp, -9223372036854775807 - 1)
    comp = tl.sort(comp, descending=True)
    res = (4294967295 - (comp & 4294967295)).to(tl.int32)
    tl.debug_barrier()  # every thread has read out_row before any overwrites it
    tl.store(out_row + offs_k, tl.where(live, res, -1), mask=offs_k < K)


@triton.jit
def _topk_kernel(
    s_ptr,
    nv_ptr,
    out_ptr,
    ws_ptr,
    stride_s,
    stride_o,
    stride_w,
    N,
    K,
    HAS_NV: tl.constexpr,
    BLOCK: tl.constexpr,
    KP: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = s_ptr + r * stride_s
    out_row = out_ptr + r * stride_o
    ws_row = ws_ptr + r * stride_w
    if HAS_NV:
        nv = tl.minimum(tl.maximum(tl.load(nv_ptr + r), 0), N)
    else:
        nv = N
    bins = tl.arange(0, 256)

    # Pass 1 (full row): histogram of the top 8 key bits over the selectable elements.
    hist = tl.zeros((256,), tl.int32)
    n_other = 0
    for start in range(0, nv, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < nv
        x = tl.load(row + offs, mask=m, other=float("-inf"))
        ok = m & (x > float("-inf"))  # NaN and -inf are never selectable
        top = ((_order_key(x) >> 24) & 255) ^ 128
        hist += tl.histogram(tl.where(ok, top, 0), 256)
        n_other += tl.sum((~ok).to(tl.int32), axis=0)
    hist = tl.where(bins == 0, hist - n_other, hist)
    kk = tl.minimum(tl.sum(hist, axis=0), K)  # how many indices this row returns
    b0, above = _pick_bucket(hist, kk, bins)
    need = kk - above

    # Pass 2 (full row): top digit > b0 -> winner (straight to out, index order);
    # top digit == b0 -> candidate (index to the workspace, index order).
    taken = 0
    n_cand = 0
    for start in range(0, nv, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < nv
        x = tl.load(row + offs, mask=m, other=float("-inf"))
        ok = m & (x > float("-inf"))
        top = ((_order_key(x) >> 24) & 255) ^ 128
        win = ok & (top > b0)
        cand = ok & (top == b0)
        pos = taken + tl.cumsum(win.to(tl.int32), axis=0) - 1
        tl.store(out_row + pos, offs.to(tl.int32), mask=win)
        cpos = n_cand + tl.cumsum(cand.to(tl.int32), axis=0) - 1
        tl.store(ws_row + cpos, offs.to(tl.int32), mask=cand)
        taken += tl.sum(win.to(tl.int32), axis=0)
        n_cand += tl.sum(cand.to(tl.int32), axis=0)
    tl.debug_barrier()

    # Passes 3-5 (candidates only): the remaining three 8-bit digits.
    prefix = (b0 ^ 128) << 24
    for p in tl.static_range(1, 4):
        SHIFT = 24 - 8 * p  # constexpr: p is a static_range index
        hist = tl.zeros((256,), tl.int32)
        n_other = 0
        for start in range(0, n_cand, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n_cand
            idx = tl.load(ws_row + offs, mask=m, other=0)
            key = _order_key(tl.load(row + idx, mask=m, other=0.0))
            match = m & ((key >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
            hist += tl.histogram(tl.where(match, (key >> SHIFT) & 255, 0), 256)
            n_other += tl.sum((~match).to(tl.int32), axis=0)
        hist = tl.where(bins == 0, hist - n_other, hist)
        b, above = _pick_bucket(hist, need, bins)
        need = need - above
        prefix = prefix | (b << SHIFT)

    # Compaction of the candidates (index order): key > thr, then the first `need` keys == thr.
    thr = prefix
    eq_seen = 0
    for start in range(0, n_cand, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n_cand
        idx = tl.load(ws_row + offs, mask=m, other=0)
        key = _order_key(tl.load(row + idx, mask=m, other=0.0))
        gt = m & (key > thr)
        eq = m & (key == thr)
        eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        take = gt | (eq & (eq_rank < need))
        pos = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_row + pos, idx, mask=take)
        taken += tl.sum(take.to(tl.int32), axis=0)
        eq_seen += tl.sum(eq.to(tl.int32), axis=0)
    tl.debug_barrier()

    _sort_winners(row, out_row, kk, K, KP)


# ---------------------------------------------------------------------------------------- split path
@triton.jit
def _chunk_bounds(nv_ptr, r, sp, N, CH, HAS_NV: tl.constexpr):
    """[lo, hi) of split sp of row r: its chunk of CH entries, clipped to the visible prefix."""
    if HAS_NV:
        nv = tl.minimum(tl.maximum(tl.load(nv_ptr + r), 0), N)
    else:
        nv = N
    lo = sp * CH
    hi = tl.minimum(lo + CH, nv)
    return lo, hi


@triton.jit
def _load_keys(row, offs, hi):
    """Keys of entries offs (< hi) and whether each is selectable (in range, not -inf, not NaN)."""
    m = offs < hi
    x = tl.load(row + offs, mask=m, other=float("-inf"))
    return _order_key(x), m & (x > float("-inf"))


@triton.jit
def _row_hist(h_ptr, S, SP: tl.constexpr):
    """The [S, 256] per-split histograms at h_ptr (int32, row-major) as a [SP, 256] tile (0-padded)."""
    sidx = tl.arange(0, SP)
    bins = tl.arange(0, 256)
    return tl.load(h_ptr + sidx[:, None] * 256 + bins[None, :], mask=sidx[:, None] < S, other=0)


@triton.jit
def _split_hist1(
    s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, CH, H1_OFF,
    HAS_NV: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    row = s_ptr + r * stride_s
    lo, hi = _chunk_bounds(nv_ptr, r, sp, N, CH, HAS_NV)
    bins = tl.arange(0, 256)
    hist = tl.zeros((256,), tl.int32)
    n_other = 0
    for start in range(lo, hi, BLOCK):
        key, ok = _load_keys(row, start + tl.arange(0, BLOCK), hi)
        d1 = ((key >> 24) & 255) ^ 128
        hist += tl.histogram(tl.where(ok, d1, 0), 256)  # the rest is counted in bin 0, then removed
        n_other += tl.sum((~ok).to(tl.int32), axis=0)
    hist = tl.where(bins == 0, hist - n_other, hist)
    tl.store(ws_ptr + r * stride_w + H1_OFF + sp * 256 + bins, hist)


@triton.jit
def _split_hist2(
    s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, K, S, CH, H1_OFF, H2_OFF,
    HAS_NV: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    row = s_ptr + r * stride_s
    ws_row = ws_ptr + r * stride_w
    bins = tl.arange(0, 256)
    hist1 = tl.sum(_row_hist(ws_row + H1_OFF, S, SP), axis=0)  # the whole row's d1 histogram
    kk = tl.minimum(tl.sum(hist1, axis=0), K)
    b1, above1 = _pick_bucket(hist1, kk, bins)

    lo, hi = _chunk_bounds(nv_ptr, r, sp, N, CH, HAS_NV)
    hist = tl.zeros((256,), tl.int32)
    n_other = 0
    for start in range(lo, hi, BLOCK):
        key, ok = _load_keys(row, start + tl.arange(0, BLOCK), hi)
        match = ok & ((((key >> 24) & 255) ^ 128) == b1)
        hist += tl.histogram(tl.where(match, (key >> 16) & 255, 0), 256)
        n_other += tl.sum((~match).to(tl.int32), axis=0)
    hist = tl.where(bins == 0, hist - n_other, hist)
    tl.store(ws_row + H2_OFF + sp * 256 + bins, hist)


@triton.jit
def _split_scatter(
    s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, K, S, CH, KEY_OFF, H1_OFF, H2_OFF, META_OFF,
    HAS_NV: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    row = s_ptr + r * stride_s
    ws_row = ws_ptr + r * stride_w
    bins = tl.arange(0, 256)[None, :]
    before = tl.arange(0, SP)[:, None] < sp  # splits whose output precedes this one's

    t1 = _row_hist(ws_row + H1_OFF, S, SP)
    hist1 = tl.sum(t1, axis=0)
    kk = tl.minimum(tl.sum(hist1, axis=0), K)
    b1, above1 = _pick_bucket(hist1, kk, tl.arange(0, 256))
    w_off = tl.sum(tl.sum(tl.where(before & (bins > b1), t1, 0), axis=1), axis=0)

    t2 = _row_hist(ws_row + H2_OFF, S, SP)
    hist2 = tl.sum(t2, axis=0)
    b2, above2 = _pick_bucket(hist2, kk - above1, tl.arange(0, 256))
    w_off += tl.sum(tl.sum(tl.where(before & (bins > b2), t2, 0), axis=1), axis=0)
    n_cand = tl.sum(tl.where(tl.arange(0, 256) == b2, hist2, 0), axis=0)
    n_win = above1 + above2
    # The row's list L = winners (index order), then candidates (index order): indices at ws[0 : n_win +
    # n_cand], their keys at ws[KEY_OFF : ...].  Winners + candidates are disjoint entries: at most N.
    c_off = n_win + tl.sum(tl.sum(tl.where(before & (bins == b2), t2, 0), axis=1), axis=0)
    is_first = sp == 0  # one writer of the row's counts
    tl.store(ws_row + META_OFF, n_win, mask=is_first)
    tl.store(ws_row + META_OFF + 1, n_cand, mask=is_first)
    tl.store(ws_row + META_OFF + 2, kk - n_win, mask=is_first)

    prefix = b1 * 256 + b2  # the kk-th largest key's top 16 bits (sign-flipped, so unsigned order)
    lo, hi = _chunk_bounds(nv_ptr, r, sp, N, CH, HAS_NV)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key, ok = _load_keys(row, offs, hi)
        top = ((key >> 16) & 65535) ^ 32768
        win = ok & (top > prefix)
        cand = ok & (top == prefix)
        pos = w_off + tl.cumsum(win.to(tl.int32), axis=0) - 1
        pos = tl.where(cand, c_off + tl.cumsum(cand.to(tl.int32), axis=0) - 1, pos)
        keep = win | cand
        tl.store(ws_row + pos, offs.to(tl.int32), mask=keep)
        tl.store(ws_row + KEY_OFF + pos, key, mask=keep)
        w_off += tl.sum(win.to(tl.int32), axis=0)
        c_off += tl.sum(cand.to(tl.int32), axis=0)


@triton.jit
def _cand_hist(digit, m, bins):
    """256-bin histogram of digit over the lanes where m holds."""
    hist = tl.histogram(tl.where(m, digit, 0), 256)
    return tl.where(bins == 0, hist - tl.sum((~m).to(tl.int32), axis=0), hist)


@triton.jit
def _thr_scan(low, idx, offs, m, thr, need, idx_thr, last, eq_seen):
    """One block of candidates (list order): the index of the need-th one with low == thr, if in it, and
    the list position of the last chosen one so far."""
    eq = m & (low == thr)
    eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    at_thr = eq & (eq_rank == need - 1)
    idx_thr = tl.maximum(idx_thr, tl.max(tl.where(at_thr, idx, -1), axis=0))
    last = tl.maximum(last, tl.max(tl.where(at_thr | (m & (low > thr)), offs, -1), axis=0))
    return idx_thr, last, eq_seen + tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def _split_finish(
    out_ptr, ws_ptr, stride_o, stride_w, K, KEY_OFF, META_OFF,
    CBLOCK: tl.constexpr, E: tl.constexpr, BJ: tl.constexpr,
):  # fmt: skip
    """Grid (T, R).  Every program of row t derives the same exact threshold from the candidates, then
    ranks its share of the list L (slices of E entries, strided by R E) against all of L and writes each
    chosen entry at its rank; out[t] positions >= kk of its share of [0, K) get -1."""
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    R = tl.num_programs(1)
    out_row = out_ptr + r * stride_o
    ws_row = ws_ptr + r * stride_w
    bins = tl.arange(0, 256)
    n_win = tl.load(ws_row + META_OFF)
    n_cand = tl.load(ws_row + META_OFF + 1)
    need = tl.load(ws_row + META_OFF + 2)  # how many candidates to take (>= 1 unless the row is empty)
    kk = n_win + need
    n_l = n_win + n_cand

    # Radix select over the candidates' low 16 key bits (all candidates share the top 16): d3, then d4.
    # The first CBLOCK candidates (usually all of them) stay in registers for the three passes.
    offs0 = n_win + tl.arange(0, CBLOCK)
    m0 = offs0 < n_l
    low0 = tl.load(ws_row + KEY_OFF + offs0, mask=m0, other=0) & 65535
    idx0 = tl.load(ws_row + offs0, mask=m0, other=0)
    hist = _cand_hist(low0 >> 8, m0, bins)
    for start in range(n_win + CBLOCK, n_l, CBLOCK):
        offs = start + tl.arange(0, CBLOCK)
        m = offs < n_l
        low = tl.load(ws_row + KEY_OFF + offs, mask=m, other=0) & 65535
        hist += _cand_hist(low >> 8, m, bins)
    b3, above = _pick_bucket(hist, need, bins)
    need = need - above
    hist = _cand_hist(low0 & 255, m0 & ((low0 >> 8) == b3), bins)
    for start in range(n_win + CBLOCK, n_l, CBLOCK):
        offs = start + tl.arange(0, CBLOCK)
        m = offs < n_l
        low = tl.load(ws_row + KEY_OFF + offs, mask=m, other=0) & 65535
        hist += _cand_hist(low & 255, m & ((low >> 8) == b3), bins)
    b4, above = _pick_bucket(hist, need, bins)
    need = need - above  # candidates with low == thr to take: the first `need` in index order
    thr = b3 * 256 + b4
    # Index of the last of them: a candidate is chosen iff low > thr, or low == thr and index <= idx_thr.
    # Also the end of the chosen part of L (list position after the last chosen entry): nothing past it
    # is chosen, so nothing past it can precede a chosen entry in the output either.
    idx_thr, last, eq_seen = _thr_scan(low0, idx0, offs0, m0, thr, need, -1, n_win - 1, 0)
    for start in range(n_win + CBLOCK, n_l, CBLOCK):
        offs = start + tl.arange(0, CBLOCK)
        m = offs < n_l
        low = tl.load(ws_row + KEY_OFF + offs, mask=m, other=0) & 65535
        idx = tl.load(ws_row + offs, mask=m, other=0)
        idx_thr, last, eq_seen = _thr_scan(low, idx, offs, m, thr, need, idx_thr, last, eq_seen)
    end = last + 1

    # Rank sort: the position of a chosen entry x is the number of entries of L[:end] before it in the
    # output order (score desc, index asc); every such entry is itself chosen, so the ranks are 0 .. kk-1.
    for base in range(p * E, end, R * E):
        q = base + tl.arange(0, E)
        mq = q < end
        ix = tl.load(ws_row + q, mask=mq, other=0)
        kx = tl.load(ws_row + KEY_OFF + q, mask=mq, other=0)
        lx = kx & 65535
        chosen = mq & ((q < n_win) | (lx > thr) | ((lx == thr) & (ix <= idx_thr)))
        if tl.max(chosen.to(tl.int32), axis=0) > 0:
            rank = tl.zeros((E,), tl.int32)
            for jb in range(0, end, BJ):
                j = jb + tl.arange(0, BJ)
                mj = j < end
                iy = tl.load(ws_row + j, mask=mj, other=0)
                ky = tl.load(ws_row + KEY_OFF + j, mask=mj, other=0)
                kyb, iyb = ky[None, :], iy[None, :]
                kxb, ixb = kx[:, None], ix[:, None]
                first = mj[None, :] & ((kyb > kxb) | ((kyb == kxb) & (iyb < ixb)))
                rank += tl.sum(first.to(tl.int32), axis=1)
            tl.store(out_row + rank, ix, mask=chosen & (rank < kk))  # always true: a guard against OOB

    # Padding: positions [kk, K) of this program's share of the row.
    for base in range(p * E, K, R * E):
        offs = base + tl.arange(0, E)
        tl.store(out_row + offs, tl.full((E,), -1, tl.int32), mask=(offs < K) & (offs >= kk))


# ---------------------------------------------------------------------------------------- public ops
def _auto_splits(T: int, N: int) -> int:
    """Programs per row for the split path (1 = single-program kernel): about _TARGET_PROGRAMS programs in
    all, chunks of at least _MIN_CHUNK entries, at most _MAX_SPLITS (host ints only)."""
    return max(1, min(_MAX_SPLITS, _TARGET_PROGRAMS // max(T, 1), triton.cdiv(N, _MIN_CHUNK)))


def _workspace_cols(N: int, splits: int) -> int:
    if splits == 1:
        return max(N, 1)
    return 2 * N + 2 * splits * _BINS + _META


def topk_workspace(T: int, N: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A [T, cols] int32 workspace that fits ``topk_indices`` on [T, N] scores for any ``splits``.

    cols = 2 N + 2 x 64 x 256 + 4 (winner + candidate indices and keys, per-split histograms, counts).
    Its contents never matter (no zeroing needed), so one buffer can serve every call of a CUDA graph.
    """
    return torch.empty((T, _workspace_cols(N, _MAX_SPLITS)), dtype=torch.int32, device=device)


def topk_indices(
    scores: torch.Tensor,
    k: int,
    n_visible: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    workspace: torch.Tensor | None = None,
    splits: int | None = None,
    finish_programs: int | None = None,
) -> torch.Tensor:
    """Logical indices of the top-``min(k, #selectable)`` scores of each row, -1 padded.

    Args:
        scores: [T, N] fp32 (e.g. from ``indexer_scores``); -inf and NaN entries are never selected.
        k: host int, 1 <= k (the Triton kernel supports k <= 4096; typical 512 / 1024).
        n_visible: optional [T] int32; entries j >= n_visible[t] are never selected.
        backend: "auto" | "torch" | "triton".
        workspace: optional row-contiguous [>= T, >= cols] int32 scratch for the Triton kernels, contents
            irrelevant (allocated per call if None; ``topk_workspace(T, N)`` makes one that fits every
            path -- pass it in to keep allocations out of a captured CUDA graph).  cols = N when
            splits == 1, else 2 N + 2 x 256 x splits + 4.
        splits: Triton only, host int in [1, 64]: programs per row (1 = one program per row, the
            whole row in it; >= 2 = the split path of the module docstring).  None picks from T and N
            (about 128 programs in all, chunks of >= 4096 entries).  The result never depends on it.
        finish_programs: Triton split path only, host int in [1, 64]: programs per row of the last launch
            (each ranks a share of the row's winners + candidates).  None = ceil(k / 32), at most 64.
            The result never depends on it.

    Returns:
        [T, k] int32, sorted by score descending then index ascending; -1 after the selected ones.
    """
    check_tensor("scores", scores, dtype=torch.float32, ndim=2)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k: expected a host int >= 1, got {k!r}")
    T, N = scores.shape
    if n_visible is not None:
        check_tensor("n_visible", n_visible, dtype=torch.int32, shape=(T,), device=scores.device)
    if splits is None:
        splits = _auto_splits(T, N)
    elif not isinstance(splits, int) or isinstance(splits, bool) or not 1 <= splits <= _MAX_SPLITS:
        raise ValueError(f"splits: expected None or a host int in [1, {_MAX_SPLITS}], got {splits!r}")
    if finish_programs is not None and (
        not isinstance(finish_programs, int)
        or isinstance(finish_programs, bool)
        or not 1 <= finish_programs <= _MAX_FINISH
    ):
        raise ValueError(f"finish_programs: expected None or a host int in [1, {_MAX_FINISH}], got {finish_programs!r}")
    cols = _workspace_cols(N, splits)
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.int32, ndim=2, device=scores.device)
        if workspace.shape[0] < T or workspace.shape[1] < cols or workspace.stride(1) != 1:
            raise ValueError(
                f"workspace: expected a row-contiguous [>= {T}, >= {cols}] tensor, got {list(workspace.shape)}"
            )
    if not use_triton(backend, scores, n_visible):
        return topk_indices_reference(scores, k, n_visible)
    if n_visible is not None:
        n_visible = n_visible.contiguous()  # indexed as ptr + t
    if k > _MAX_K:
        raise ValueError(f"k: the Triton kernel supports k <= {_MAX_K}, got {k}")
    out = torch.empty((T, k), dtype=torch.int32, device=scores.device)
    if T == 0:
        return out
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    if workspace is None:
        workspace = torch.empty((T, cols), dtype=torch.int32, device=scores.device)
    interp = interpreter_enabled()
    nv = n_visible if n_visible is not None else out  # placeholder pointer when HAS_NV is False
    has_nv = n_visible is not None
    kp = max(16, triton.next_power_of_2(k))
    ss, so, sw = scores.stride(0), out.stride(0), workspace.stride(0)
    if splits == 1:
        _topk_kernel[(T,)](
            scores, nv, out, workspace, ss, so, sw, N, k,
            HAS_NV=has_nv, BLOCK=1024 if interp else 4096, KP=kp, num_warps=8,
        )  # fmt: skip
        return out
    S, sp = splits, triton.next_power_of_2(splits)
    ch = triton.cdiv(triton.cdiv(N, S), 16) * 16  # chunk start offsets stay 16-aligned (vector loads)
    key_off, h1_off = N, 2 * N
    h2_off = h1_off + S * _BINS
    meta_off = h2_off + S * _BINS
    # One loop iteration per program where the chunk allows: all of its loads are issued at once.
    block = 256 if interp else max(256, min(_MAX_BLOCK, triton.next_power_of_2(ch)))
    grid = (T, S)
    _split_hist1[grid](scores, nv, workspace, ss, sw, N, ch, h1_off, HAS_NV=has_nv, BLOCK=block, num_warps=8)
    _split_hist2[grid](
        scores, nv, workspace, ss, sw, N, k, S, ch, h1_off, h2_off,
        HAS_NV=has_nv, BLOCK=block, SP=sp, num_warps=8,
    )  # fmt: skip
    _split_scatter[grid](
        scores, nv, workspace, ss, sw, N, k, S, ch, key_off, h1_off, h2_off, meta_off,
        HAS_NV=has_nv, BLOCK=block, SP=sp, num_warps=8,
    )  # fmt: skip
    # Finish: R programs per row, each ranking its slices of E list entries against the whole list
    # (~ (k + #candidates) / R x (k + #candidates) compares each); R E >= k, so ~one slice per program.
    fe = _FINISH_SLICE
    rf = finish_programs if finish_programs is not None else max(1, min(_MAX_FINISH, triton.cdiv(k, fe)))
    _split_finish[(T, rf)](
        out, workspace, so, sw, k, key_off, meta_off,
        CBLOCK=_FINISH_CBLOCK, E=fe, BJ=_FINISH_BJ, num_warps=8,
    )  # fmt: skip
    return out


def to_physical(
    idx: torch.Tensor, block_table: torch.Tensor, token_row: torch.Tensor, entries_per_page: int
) -> torch.Tensor:
    """Logical entry indices [T, k] -> physical slots ``page * entries_per_page + row`` (int32).

    -1 stays -1, and so does an index whose logical page is past the block table or maps to page -1.
    ``block_table`` [B, max_blocks] int32, ``token_row`` [T] int32 (block-table row of each query row).
    """
    check_tensor("idx", idx, dtype=torch.int32, ndim=2)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=idx.device)
    check_tensor("token_row", token_row, dtype=torch.int32, shape=(idx.shape[0],), device=idx.device)
    if not isinstance(entries_per_page, int) or entries_per_page < 1:
        raise ValueError(f"entries_per_page: expected a host int >= 1, got {entries_per_page!r}")
    max_blocks = block_table.shape[1]
    if max_blocks == 0:
        return torch.full_like(idx, -1)
    i = idx.long()
    col = i.clamp(min=0) // entries_per_page
    page = block_table.long()[token_row.long()].gather(1, col.clamp(max=max_blocks - 1))
    ok = (i >= 0) & (col < max_blocks) & (page >= 0)
    phys = page * entries_per_page + i % entries_per_page
    return torch.where(ok, phys, torch.full_like(phys, -1)).to(torch.int32)
