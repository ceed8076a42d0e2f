"""Top-k selection of indexer scores, and logical -> physical entry slots (spec §4 "Selection").

``topk_indices(scores, k, n_visible)`` returns, per row, the logical indices of the
``min(k, #selectable)`` largest scores, where an entry is selectable iff ``j < n_visible[t]`` and its
score is neither -inf nor NaN.  The rest of the row is padded with -1.

Set, ties and order (deterministic, identical in both backends): the chosen set is that of a stable
descending sort (among equal scores at the boundary the lower index wins a place; -0.0 and +0.0 are
equal), and it is returned in ascending index order (the attention consumer does not care about the
order; index order is the cheapest to produce and gives its gathers locality).

Scores are mapped to 32-bit order-preserving integer keys (float bits, magnitude bits flipped for
negatives; -0.0 folded to +0.0), so "larger score" = "larger key".  Digits of the key, high to low,
are d1 = bits 31..24 (sign-flipped), d2 = 23..16, d3 = 15..8, d4 = 7..0.  No host sync, static shapes,
no data-dependent launch sizes, CUDA-graph capturable, deterministic (atomics only build order-free data).

Three Triton paths (``method``; the result never depends on the path or on ``splits``):

Filter path (default for long rows; S = ``splits`` programs per row in launches A and C, each owning a
contiguous chunk of the row's visible prefix: CH_r = ceil(nv / S) entries rounded up to whole groups of G
entries).  G = the largest power of two in [2, 256] leaving >= 2 k groups (G = 128 for N = 262,144,
k = 1,024; from 32 rows on up to 16 k groups of >= 32 entries, ``_GROUPS_PER_K_MANY``), raised if needed so that
NG = ceil(N / G) <= 8,192.  A row with fewer visible entries nv (block tables sized for an engine's longest
request) uses groups of G / 2^lv (down to 8 entries): the smallest that keeps ceil(nv / (G / 2^lv)) <= NG
(``_row_plan``, the same in every launch), so it has nearly as many group maxima as a full row and as tight a
level; with groups of G its rows of nv < k G would list every entry.
No histogram over the row (on the H200 the radix split path's two 256-bin ``tl.histogram`` passes over
4 x 262,144 scores take 7.2 and 7.7 us; the group maxima 2.4 us):

A. ``_filter_max``, grid (T, S): reads the chunk once; GM[t, g] = max key of group g over its
   selectable entries (INT32_MIN for a group without any); W[t, s] = the chunk's selectable count.
B. ``_filter_level``, grid (T,): kk = min(k, sum of W[t, :]) and the level L = the kk-th largest group
   max rounded down to its 16-bit key prefix (a radix search of the top 16 key bits over the NG maxima,
   ``_kth_largest``; ~1 % below the exact value for scores near 1, a few more candidates, half the
   steps).  At least kk selectable entries have key >= L (one per group), so every chosen entry has
   key >= L.
C. ``_filter_cand``, grid (T, S): re-reads only the groups of the chunk whose max is >= L and lists the
   selectable entries with key >= L (index, key) in the program's own region of the workspace, which
   starts at the chunk's first column (it cannot overflow), in index order (a cumsum over the tile, no
   atomics), and their count in C[t, s].  For i.i.d. scores there are about 1.3-1.5 kk candidates
   (k = 1,024, N = 262,144: ~1,500).
   With ``counters`` (a zeroed int32 vector of >= T, left zero; not for >= 256 rows at k <= 512, where B runs on 4
   warps), A and B are one launch (``_filter_max_level``):
   the last of a row's S programs of A to finish (``last_arrival`` on the row's counter: it then sees the others'
   stores) runs B's program for the row.  Three launches instead of four; C and D stay apart (D's ~215 registers
   would halve C's programs an SM).
D. ``_filter_write``, grid (T,): if the total count fits SB2 register slots (SB1 = next_pow2(2 k), or
   SB2 = min(8,192, 4 SB1) when more), the regions are copied into one dense list in region order,
   which is index order ([64, CPB] tiles of (region, position)), loaded into registers, the exact
   threshold key thr = the kk-th largest is found by a radix search (``_kth_largest``), and the chosen
   candidates (key > thr, then the first ties at thr in list order: the lowest indices) are compacted
   into the output row with a cumsum: already ascending, no sort; -1 padded.  Otherwise (adversarial
   rows: many equal scores, sorted rows) the program runs the single-program radix select over the
   whole row (exact for any row; slow: one program for the row).

Workspace contract (filter path): every scratch value is written before it is read within the same
call (W and GM by A, kk and L by B, C and the regions by C, the dense list by D), so the buffer needs
no zeroing and may hold garbage; columns [0, 256) are never touched.  Layout per row: kk / L at 513 /
514, W at 520 + s, C at 584 + s, the dense list at [704, 704 + M) (indices) and [704 + M, 704 + 2 M)
(keys) with M = min(8,192, N) (it never holds more than SB2 <= 8,192 candidates, nor more than N),
group maxima at [704 + 2 M, 704 + 2 M + NG), then the regions: indices at [R, R + N), keys at
[R + N, R + 2 N) with R = 704 + 2 M + NG (NG <= N / 2); the fallback uses [R, R + N).

Radix split path (``method="radix"``, splits >= 2: S = ``splits`` programs per row, each owning a contiguous chunk of
CH = ``ceil(N / S)`` entries rounded up to a multiple of 16; four launches of grid (T, S)):

1. ``_split_hist1``: the chunk's 256-bin d1 histogram (selectable entries), added into the row's H1
   with integer ``tl.atomic_add`` (sums of integers: the same result in any order).  Program s == 0
   zeroes the row's H2 and candidate counter (only the next launches use them).
2. ``_split_hist2``: every program reads H1[t] (1 KiB) and derives the bucket b1 holding the kk-th
   largest (kk = min(k, #selectable)); the chunk's d2 histogram of entries with d1 == b1 is added into
   H2[t] with atomics.
3. ``_split_cand``: from H1, H2 every program derives the 16-bit prefix P = (b1, b2) of the kk-th
   largest key; it stores its chunk's winner count (prefix > P) in W[t, s] (own slot) and appends its
   candidates (prefix == P: index and key) to the row's candidate list at a range reserved with one
   atomic on the row's counter per block.  The list order depends on timing; nothing below depends on
   the order.  Program s == 0 stores kk, P and the number of candidates to take.
4. ``_split_write``: every program of the row repeats the same radix select on the candidates' d3, d4
   (contiguous reads; ~45 candidates for 262,144 normal scores at k = 1,024), giving the exact
   threshold key and ``need_eq``, the number of entries equal to it to take (the first ones in index
   order).  Its output offset = winners of earlier chunks (sum of W[t, :s]) + candidates of earlier
   chunks (index < its chunk start) above the threshold + min(ties at the threshold there, need_eq).
   It re-reads its chunk and writes each chosen entry (prefix > P; or prefix == P and low 16 bits
   above the threshold's; or equal to the threshold with tie rank < need_eq) at offset + running
   count, i.e. in index order; positions kk .. k-1 get -1 (shared in stripes).  Program s == 0 zeroes
   H1[t] for the next call.

Workspace contract (split path): columns [0, 256) of each row (H1) must be zero when a call starts;
``topk_workspace`` returns zeros, every call leaves them zero again (launch 4), so one buffer serves
every call of a CUDA graph -- as long as only this function writes it, one call at a time (one
stream).  H2, the counter, W and the list are scratch, reset or overwritten inside each call.  The
single-program path uses only columns >= 704 (never touches H1).

Race freedom (the interpreter runs programs one after another and cannot show races, so none may
exist): within a launch, programs exchange data only through atomics whose result is
order-independent (the histogram sums; the list ranges, which are disjoint whatever the order);
everything else crosses programs at launch boundaries (stream order).  Every output position has
exactly one writer: offsets are exclusive prefix sums, over chunks, of counts that the writer of each
chunk then reproduces exactly (same classification, same bounds, same threshold in every program).

Cost per call (T rows of N fp32 scores, S splits; T = 4, N = 262,144, auto S = 32): four launches.
Launch 1 reads the scores once from HBM (4 N T bytes = 4 MiB); launches 2-4 re-read them from L2
(12 MiB in all).  Histogram traffic: T S x 256 atomics into H1 and at most as many into H2 (only
non-zero bins), T S x 2 KiB of H1 / H2 reads (256 KiB): no longer O(T S^2).  Launch 4 reads the
candidate list 3 times per program (T S x 3 x 8 bytes x #candidates: ~140 KiB for normal scores;
every copy of the threshold value when many scores are exactly equal), W (S ints) and writes k T ints.

Why 8 + 8 histogram bits and not one 12-bit pass: ``tl.histogram`` lowers to a warp-ballot histogram
whose cost per element grows with the bins each lane owns (bins / 32), so 4,096 bins cost ~16x the
instructions of 256 per element, more than the second 256-bin pass saves.

Single-program path (``splits == 1`` with method "auto" or "radix", and method "auto" with
N <= 4,096; one program per row, scratch = the output row plus N int32 of the workspace):

1-2. Full-row 256-bin histogram of d1; suffix sums give the bucket b0 holding the kk-th largest.
3. Full row again: d1 > b0 -> winners to out[t]; d1 == b0 -> candidate indices to the workspace.
4. Radix select on the candidates over d2, d3, d4 (each pass gathers the candidates' scores).
5. Compaction of the candidates in index order: key > thr, or key == thr among the first ``need``.
6. The kk indices are sorted ascending with ``tl.sort``; the rest of the row is -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.kernels._triton_sync import last_arrival, pdl_enter
from dsv4.kernels.dispatch import interpreter_enabled, pdl_launch, use_triton

__all__ = [
    "to_physical",
    "to_physical_reference",
    "topk_indices",
    "topk_indices_reference",
    "topk_workspace",
    "visible_logical",
    "visible_physical",
]

_MAX_K = 4096  # largest k the Triton kernels sort in registers
_BINS = 256  # histogram bins per 8-bit digit (the kernels hard-code 256)
_MAX_SPLITS = 64  # programs per row on the split path (W holds one count per split)
_TARGET_PROGRAMS = 128  # auto splits: about one program per SM in all
_MIN_CHUNK = 4096  # auto splits: entries per program at least
_MAX_BLOCK = 8192  # split path: entries per loop iteration of a (T, S) program at most
_CBLOCK = 256  # split path, launch 4: candidates per iteration of the threshold search
_PBLOCK = 128  # split path, launch 4: -1 padding stripe per program
_SINGLE_MAX_N = 4096  # method "auto", splits None: one program per row up to this row length ...
# ... for fewer rows than this: a prefill chunk's many short rows go to the filter path (one split).  H200 2026-12-05
# (2026-12-05_h200_profile_topk_prefill_tune_s20.txt, 8,192 rows x 4,096, k = 512): filter 696.7 us, the
# single-program kernel 1,210.1 (2,048 x 16,384: 312.4 vs 769.3).  Fewer rows (decode steps) were tuned before.
_SINGLE_MAX_ROWS = 256
# method "auto": the filter path for every multi-program case.  H200 2026-12-03 (2026-12-03_h200_topk_s6.jsonl,
# in_graph_time_s, rows x 262,144, k = 1,024): filter 24.1 / 39.9 / 53.1 / 169.0 us vs radix 25.8 / 40.2 / 65.8 /
# 430.4 at 1 / 4 / 8 / 64 rows; k = 512: filter 23.4 / 27.1 / 34.4 / 149.1 vs radix 26.2 / 40.2 / 65.5 / 422.0.
_FILTER_PROGRAMS = 256  # filter path, auto splits: programs of launches A and C in all (about 2 per SM)
_G_MIN, _G_MAX = 2, 256  # filter path: group size range (then raised so that NG <= _MAX_GROUPS)
# filter path: G = the largest that leaves >= (groups a k) k groups; launch C re-reads ~1 / (groups a k) of a
# row, launch B searches more maxima.  H200 2026-12-04 (2026-12-04_h200_profile_topk_groups_s12.txt, 262,144
# columns, graph time, groups a k 2 / 4 / 8 / 16): 1 row k = 512 21.6 / 22.7 / 23.2 / 30.4 us; 8 rows 31.5 /
# 33.6 / 32.8 / 36.6; 64 rows 150.5 / 135.8 / 131.4 / 118.3 (k = 1,024: 151.7 / 143.9 / 124.2 / 125.5).
# Between 8 and 64 rows: not measured.
_GROUPS_PER_K = 2  # fewer than _MANY_ROWS rows
_GROUPS_PER_K_MANY = 16  # _MANY_ROWS rows or more
_MANY_ROWS = 32
# groups of at least this many entries with many rows: 64 rows of 32,768, k = 512 (the decode step's top-k, V4-Flash
# 128K): 36.8 us with 16 k groups of 4 entries against 30.6 with 2 k of 16 (H200, graph time; sessions 12-13)
_G_MANY_MIN = 32
_MAX_GROUPS = 8192  # filter path: group maxima sorted by launch B at most
# filter path: the finest group size of a short row's level (``_row_plan``).  <= 8: a row whose groups at this size
# number fewer than kk has < 8 kk <= SB2 entries (k <= 1,024): its candidates always fit launch D's list.
_G_FINEST = 8
_MAX_LIST = 8192  # filter path: candidates held in registers by launch D at most (SB2)
_LEVEL_BITS = 16  # filter path, launch B: key bits of the level searched (the rest is 0: a lower bound)
# filter path, launches B and D: key bits resolved per step of _kth_largest.  H200 2026-12-03
# (2026-12-03_h200_topk_kth_s6.txt, 4 x 262,144, k = 1,024, graph): 2 bits 28.4 us, 4 bits 35.2 us (a 16-wide
# compare tile a step costs more than the halved step count saves), 2 bits as three counts packed in one
# int64 sum 28.3 us.
_RADIX_STEP_BITS = 2
_COPY_COLS = 64  # filter path, launch D: positions per region copied per iteration (x 64 / SP: 4,096-value tiles)
# filter path, launch D with one split (a prefill chunk's rows: T >= 256): the region is the dense list, no copy.  The
# copy's [64, 64] tiles held one region in 64 rows (SP was _MAX_SPLITS whatever the splits): ~11 masked tiles a row
# for ~700 candidates.  H200 2026-12-05 (2026-12-05_h200_profile_topk_prefill_s20.txt, 2,048 rows x 16,384, k = 512):
# D 131.7 -> 109.6 us, the call 337.7 -> 312.4.
_ONE_REGION = True
# filter path, launch D: 0 = the threshold by the 32-bit radix search; > 0 = ``_kth_by_rank`` with this many slots
# for the threshold's 16-bit bucket (8 search steps fewer).  H200 2026-12-03 (2026-12-03_h200_profile_topk_rank_loop_s7
# .txt, device time 0 / 64 slots): 4 x 262,144 k = 1,024 26.1 / 24.7 us; 1 x 262,144 22.1 / 20.8; 64 x 32,768 k = 512
# 28.4 / 27.7 (graph 28.9 / 27.1, 23.5 / 22.2, 29.4 / 29.9).
_RANK_SLOTS = 64
_FILTER_TILE = 4096  # filter path, launches A and C: entries per tile (loop iteration) at most
# filter path: warps of launches A and C, and of launches B and D (tuned on few long rows, the decode step).  A prefill
# chunk (2,048 rows x 16,384, k = 512, one split; H200 2026-12-05_h200_profile_topk_prefill_s20.txt) spends 138 us in C
# and 110 in D of 312.
_FILTER_WARPS_AC = 8
_FILTER_WARPS_BD = 8
# ... and launches B and D from _FILTER_MANY_ROWS rows (the prefill chunk above: D 109.6 -> 63.4 us, B 26.0 -> 23.0, the
# call 312.4 -> 330.7 with A / C at 4 warps too, which cost C 55 us; A / C stay at 8).  Not for the decode step: 4 x
# 32,768 / 64 x 32,768 (k = 512) / 4 x 262,144 (k = 1,024) took 19.1 / 27.6 / 28.4 us at 8 warps, 21.6 / 28.7 / 32.4 at
# 4 (2026-12-05_h200_profile_topk_warps_bd_decode_s20.txt).
# Measured at k = 512 only; launch D's sm_90 build on 4 warps holds 255 registers + 312 B of stack at k = 512 and
# 1,504 B at k = 1,024 (on 8 warps: 215 + 0 and 255 + 160; ``sass_report.py topk512:2048:16384``), so k <= 512 only.
_FILTER_WARPS_BD_MANY = 4
_FILTER_MANY_ROWS = 256
_FILTER_BD_MANY_MAX_K = 512
_FILTER_TILE_INTERP = 512  # the same under the interpreter (more tiles per chunk in small tests)
# Launch D as two launches (``_split_d``; ``_filter_write`` PART 1, 2) from _SPLIT_D_MIN_ROWS rows: the rows whose
# candidates fit SB1 slots (nearly all) in a build without the SB2 list and the whole-row fallback, then the others.
# sm_90 SASS (triton 3.6, ``sass_report.py topk512:2048:16384``, 4 warps): PART 1 168 registers, no stack, 2,344
# static instructions (3 programs a SM) against 255 + 312 B of stack and 26,368 for the one launch (2 a SM); the
# second launch's programs mostly return at once (~2-3 us), so not for the decode step's few rows.  H100, 2026-12-05
# (2026-12-05_h100_profile_topk_split_d_s21.txt, k = 512, graph time, D on 4 warps): 2,048 rows x 16,384 280.3 ->
# 270.6 us, 8,192 x 4,096 531.4 -> 482.1 (on 8 warps 332.7 -> 290.2, 734.2 -> 573.5).
_SPLIT_D = True
_SPLIT_D_MIN_ROWS = 256
# Workspace layout of a row (int32 columns); the kernels see the offsets as constexpr globals.
_WS_H2, _WS_CNT, _WS_META, _WS_W = _BINS, 2 * _BINS, 2 * _BINS + 1, 2 * _BINS + 8
_WS_C = _WS_W + _MAX_SPLITS
_WS_LIST = 704  # >= _WS_C + _MAX_SPLITS, a multiple of 16: candidate lists, group maxima
_H1 = tl.constexpr(0)  # [256] row histogram of d1: zero between calls
_H2 = tl.constexpr(_WS_H2)  # [256] row histogram of d2 (within bucket b1)
_CNT = tl.constexpr(_WS_CNT)  # candidate counter
_META = tl.constexpr(_WS_META)  # kk, P, candidates to take
_W = tl.constexpr(_WS_W)  # [S] winners (radix) / selectable entries (filter) per chunk
_C = tl.constexpr(_WS_C)  # [S] listed candidates per chunk (filter)


# ---------------------------------------------------------------------------------------- reference
def _selectable(scores: torch.Tensor, n_visible: torch.Tensor | None) -> torch.Tensor:
    sel = ~(torch.isneginf(scores) | torch.isnan(scores))
    if n_visible is not None:
        j = torch.arange(scores.shape[1], device=scores.device)
        sel &= j[None, :] < n_visible.long()[:, None]
    return sel


def topk_indices_reference(scores: torch.Tensor, k: int, n_visible: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference: the first ``min(k, #selectable)`` of a stable descending sort of the selectable
    scores (ties: lower index first), returned in ascending index order, -1 padded to k."""
    sel = _selectable(scores, n_visible)
    s = torch.where(sel, scores + 0.0, torch.full_like(scores, float("-inf")))  # + 0.0 folds -0.0
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
    n_sel = sel.sum(1, keepdim=True)
    pos = torch.arange(order.shape[1], device=scores.device)[None, :]
    big = torch.iinfo(torch.int64).max
    order = torch.where(pos < n_sel, order, torch.full_like(order, big)).sort(dim=1).values  # index order
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
def _sort_winners(out_row, kk, K, KP: tl.constexpr):
    """out_row[:kk] holds the chosen indices (any order): sort them ascending; -1 pad to K."""
    offs_k = tl.arange(0, KP)
    live = offs_k < kk
    idx = tl.load(out_row + offs_k, mask=live, other=2147483647)
    res = tl.sort(idx)
    tl.debug_barrier()  # every thread has read out_row before any overwrites it
    tl.store(out_row + offs_k, tl.where(live, res, -1), mask=offs_k < K)


@triton.jit
def _visible(nv_ptr, r, N, HAS_NV: tl.constexpr):
    """Visible entries of row r: n_visible[r] clamped to [0, N] (N without n_visible)."""
    if HAS_NV:
        nv = tl.minimum(tl.maximum(tl.load(nv_ptr + r), 0), N)
    else:
        nv = N
    return nv


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
    PDL: tl.constexpr = False,
):
    """Grid (T,): the single-program path, one program per row (scratch: N int32 at ws_ptr's row)."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    nv = _visible(nv_ptr, r, N, HAS_NV)
    _select_row(s_ptr + r * stride_s, nv, out_ptr + r * stride_o, ws_ptr + r * stride_w, K, BLOCK, KP)


@triton.jit
def _select_row(row, nv, out_row, ws_row, K, BLOCK: tl.constexpr, KP: tl.constexpr):
    """Exact top-k of one row of nv scores by one program (any row; ws_row: nv int32 of scratch)."""
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

    _sort_winners(out_row, kk, K, KP)


# ---------------------------------------------------------------------------------------- split path
@triton.jit
def _chunk_bounds(nv_ptr, r, sp, N, CH, HAS_NV: tl.constexpr):
    """[lo, hi) of split sp of row r: its chunk of CH entries, clipped to the visible prefix."""
    nv = _visible(nv_ptr, r, N, HAS_NV)
    lo = sp * CH
    hi = tl.minimum(lo + CH, nv)
    return lo, hi


@triton.jit
def _row_plan(nv, S, NG, G: tl.constexpr, ALIGN: tl.constexpr, LEVELS: tl.constexpr):
    """The filter path's geometry of a row with nv visible entries (the same in launches A-D): its chunk
    CH_r = ceil(nv / S) rounded up to ALIGN (the S programs share the visible prefix, however short), and its
    level lv (groups of G >> lv entries): the smallest G >> lv (lv < LEVELS) that keeps ceil(nv / (G >> lv))
    <= NG, the group maxima launch B has slots for (a row of N / 8 entries gets groups of G / 8: as many maxima
    as a full row, and as tight a level)."""
    ch = tl.cdiv(tl.cdiv(nv, S), ALIGN) * ALIGN
    lv = nv * 0
    for i in tl.static_range(1, LEVELS):  # fits at i -> fits at every coarser level
        lv = tl.where(tl.cdiv(nv, G >> i) <= NG, i, lv)
    return ch, lv


@triton.jit
def _row_chunk(nv_ptr, r, sp, N, S, NG, HAS_NV: tl.constexpr, G: tl.constexpr, ALIGN: tl.constexpr,
               LEVELS: tl.constexpr):  # fmt: skip
    """[lo, hi) of split sp of row r on the filter path (its chunk of the visible prefix, ``_row_plan``) and the
    row's level lv (launches A and C)."""
    nv = _visible(nv_ptr, r, N, HAS_NV)
    ch, lv = _row_plan(nv, S, NG, G, ALIGN, LEVELS)
    lo = sp * ch
    return lo, tl.minimum(lo + ch, nv), lv


@triton.jit
def _load_keys(row, offs, hi):
    """Keys of entries offs (< hi) and whether each is selectable (in range, not -inf, not NaN)."""
    m = offs < hi
    x = tl.load(row + offs, mask=m, other=float("-inf"))
    return _order_key(x), m & (x > float("-inf"))


@triton.jit
def _masked_hist(digit, m, bins):
    """256-bin histogram of digit over the lanes where m holds (the rest is counted in bin 0, then removed)."""
    hist = tl.histogram(tl.where(m, digit, 0), 256)
    return tl.where(bins == 0, hist - tl.sum((~m).to(tl.int32), axis=0), hist)


@triton.jit
def _split_hist1(
    s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, CH,
    HAS_NV: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, S): the chunk's d1 histogram, added into the row's H1 (zero on entry) with integer atomics.
    Program s == 0 also zeroes the row's H2 and candidate counter (first used by the next launches)."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    row = s_ptr + r * stride_s
    ws_row = ws_ptr + r * stride_w
    bins = tl.arange(0, 256)
    lo, hi = _chunk_bounds(nv_ptr, r, sp, N, CH, HAS_NV)
    hist = tl.zeros((256,), tl.int32)
    for start in range(lo, hi, BLOCK):
        key, ok = _load_keys(row, start + tl.arange(0, BLOCK), hi)
        hist += _masked_hist(((key >> 24) & 255) ^ 128, ok, bins)
    tl.atomic_add(ws_row + _H1 + bins, hist, mask=hist != 0, sem="relaxed")
    if sp == 0:
        tl.store(ws_row + _H2 + bins, tl.zeros((256,), tl.int32))
        tl.store(ws_row + _CNT, 0)


@triton.jit
def _split_hist2(
    s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, K, CH,
    HAS_NV: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, S): from the row's H1, the bucket b1 holding the kk-th largest; the chunk's d2 histogram of
    the entries with d1 == b1, added into the row's H2 (zeroed by launch 1) with integer atomics."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    row = s_ptr + r * stride_s
    ws_row = ws_ptr + r * stride_w
    bins = tl.arange(0, 256)
    hist1 = tl.load(ws_row + _H1 + bins)
    kk = tl.minimum(tl.sum(hist1, axis=0), K)
    b1, above1 = _pick_bucket(hist1, kk, bins)
    lo, hi = _chunk_bounds(nv_ptr, r, sp, N, CH, HAS_NV)
    hist = tl.zeros((256,), tl.int32)
    for start in range(lo, hi, BLOCK):
        key, ok = _load_keys(row, start + tl.arange(0, BLOCK), hi)
        hist += _masked_hist((key >> 16) & 255, ok & ((((key >> 24) & 255) ^ 128) == b1), bins)
    tl.atomic_add(ws_row + _H2 + bins, hist, mask=hist != 0, sem="relaxed")


@triton.jit
def _split_cand(
    s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, K, CH, LIST_OFF, KEY_OFF,
    HAS_NV: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, S): from H1, H2 the 16-bit prefix P of the kk-th largest key.  Counts the chunk's winners
    (prefix > P) into W[t, s] (own slot) and appends its candidates (prefix == P: index, key) to the row's
    candidate list at a position reserved with one atomic per block (list order is arbitrary; the last
    launch only uses order-free functions of it).  Program s == 0 writes the row's kk, P, need."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    row = s_ptr + r * stride_s
    ws_row = ws_ptr + r * stride_w
    bins = tl.arange(0, 256)
    hist1 = tl.load(ws_row + _H1 + bins)
    kk = tl.minimum(tl.sum(hist1, axis=0), K)
    b1, above1 = _pick_bucket(hist1, kk, bins)
    b2, above2 = _pick_bucket(tl.load(ws_row + _H2 + bins), kk - above1, bins)
    prefix = b1 * 256 + b2  # top 16 bits of the kk-th largest key (sign-flipped: unsigned order)
    if sp == 0:
        tl.store(ws_row + _META, kk)
        tl.store(ws_row + _META + 1, prefix)
        tl.store(ws_row + _META + 2, kk - above1 - above2)  # candidates to take

    lo, hi = _chunk_bounds(nv_ptr, r, sp, N, CH, HAS_NV)
    n_win = 0
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key, ok = _load_keys(row, offs, hi)
        top = ((key >> 16) & 65535) ^ 32768
        n_win += tl.sum((ok & (top > prefix)).to(tl.int32), axis=0)
        cand = ok & (top == prefix)
        n_c = tl.sum(cand.to(tl.int32), axis=0)
        if n_c > 0:
            base = tl.atomic_add(ws_row + _CNT, n_c, sem="relaxed")
            pos = base + tl.cumsum(cand.to(tl.int32), axis=0) - 1
            tl.store(ws_row + LIST_OFF + pos, offs.to(tl.int32), mask=cand)
            tl.store(ws_row + KEY_OFF + pos, key, mask=cand)
    tl.store(ws_row + _W + sp, n_win)


@triton.jit
def _split_write(
    s_ptr, nv_ptr, out_ptr, ws_ptr, stride_s, stride_o, stride_w, N, K, CH, LIST_OFF, KEY_OFF,
    HAS_NV: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr, SP: tl.constexpr, PBLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid (T, S): every program of the row derives the same exact threshold from the candidate list
    (radix select on the low 16 key bits), counts the chosen entries of the chunks before its own (W and
    the list), re-reads its chunk and writes its chosen entries in index order.  Pads its share of
    out[t, kk:K] with -1.  Program s == 0 zeroes the row's H1 for the next call."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    S = tl.num_programs(1)
    row = s_ptr + r * stride_s
    out_row = out_ptr + r * stride_o
    ws_row = ws_ptr + r * stride_w
    bins = tl.arange(0, 256)
    kk = tl.load(ws_row + _META)
    prefix = tl.load(ws_row + _META + 1)
    need = tl.load(ws_row + _META + 2)
    n_c = tl.load(ws_row + _CNT)
    lo, hi = _chunk_bounds(nv_ptr, r, sp, N, CH, HAS_NV)

    # Radix select over the candidates' low 16 key bits (d3, then d4).  The first CBLOCK candidates
    # (usually all of them) stay in registers.
    c0 = tl.arange(0, CBLOCK)
    m0 = c0 < n_c
    low0 = tl.load(ws_row + KEY_OFF + c0, mask=m0, other=0) & 65535
    idx0 = tl.load(ws_row + LIST_OFF + c0, mask=m0, other=0)
    hist = _masked_hist(low0 >> 8, m0, bins)
    for start in range(CBLOCK, n_c, CBLOCK):
        c = start + tl.arange(0, CBLOCK)
        m = c < n_c
        low = tl.load(ws_row + KEY_OFF + c, mask=m, other=0) & 65535
        hist += _masked_hist(low >> 8, m, bins)
    b3, above = _pick_bucket(hist, need, bins)
    need = need - above
    hist = _masked_hist(low0 & 255, m0 & ((low0 >> 8) == b3), bins)
    for start in range(CBLOCK, n_c, CBLOCK):
        c = start + tl.arange(0, CBLOCK)
        m = c < n_c
        low = tl.load(ws_row + KEY_OFF + c, mask=m, other=0) & 65535
        hist += _masked_hist(low & 255, m & ((low >> 8) == b3), bins)
    b4, above = _pick_bucket(hist, need, bins)
    need_eq = need - above  # candidates equal to the threshold to take: the first need_eq in index order
    thr = b3 * 256 + b4  # low 16 bits of the kk-th largest key
    # Candidates of earlier chunks (index < lo): chosen ones above the threshold, and ties at it.
    before = m0 & (idx0 < lo)
    gt_before = tl.sum((before & (low0 > thr)).to(tl.int32), axis=0)
    eq_before = tl.sum((before & (low0 == thr)).to(tl.int32), axis=0)
    for start in range(CBLOCK, n_c, CBLOCK):
        c = start + tl.arange(0, CBLOCK)
        m = c < n_c
        low = tl.load(ws_row + KEY_OFF + c, mask=m, other=0) & 65535
        before = m & (tl.load(ws_row + LIST_OFF + c, mask=m, other=0) < lo)
        gt_before += tl.sum((before & (low > thr)).to(tl.int32), axis=0)
        eq_before += tl.sum((before & (low == thr)).to(tl.int32), axis=0)
    w = tl.load(ws_row + _W + tl.arange(0, SP), mask=tl.arange(0, SP) < sp, other=0)
    pos0 = tl.sum(w, axis=0) + gt_before + tl.minimum(eq_before, need_eq)

    # The chunk again: winners, candidates above the threshold, and the first need_eq ties (row order).
    eq_seen = eq_before
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key, ok = _load_keys(row, offs, hi)
        top = ((key >> 16) & 65535) ^ 32768
        low = key & 65535
        cand = ok & (top == prefix)
        eq = cand & (low == thr)
        eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        take = (ok & (top > prefix)) | (cand & (low > thr)) | (eq & (eq_rank < need_eq))
        pos = pos0 + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_row + pos, offs.to(tl.int32), mask=take & (pos < kk))  # always < kk: an OOB guard
        pos0 += tl.sum(take.to(tl.int32), axis=0)
        eq_seen += tl.sum(eq.to(tl.int32), axis=0)

    # Padding: positions [kk, K), in PBLOCK stripes shared among the row's programs.
    for base in range(sp * PBLOCK, K, S * PBLOCK):
        offs = base + tl.arange(0, PBLOCK)
        tl.store(out_row + offs, tl.full((PBLOCK,), -1, tl.int32), mask=(offs < K) & (offs >= kk))
    if sp == 0:
        tl.store(ws_row + _H1 + bins, tl.zeros((256,), tl.int32))


# ---------------------------------------------------------------------------------------- filter path
@triton.jit
def _group_max_tile(row, gm_row, start, tile, gi, hi, G: tl.constexpr, MASKED: tl.constexpr):
    """Launch A on one [NGB, G] tile at start: stores the group maxima (groups starting below hi), returns the
    number of selectable entries.  MASKED False: every entry of the tile is < hi (no load mask)."""
    offs = start + tile
    if MASKED:
        m = offs < hi
        x = tl.load(row + offs, mask=m, other=float("-inf"))
        ok = m & (x > float("-inf"))
    else:
        x = tl.load(row + offs)
        ok = x > float("-inf")
    gmax = tl.max(tl.where(ok, _order_key(x), -2147483648), axis=1)
    g = start // G + gi
    tl.store(gm_row + g, gmax, mask=g * G < hi)
    return tl.sum(tl.sum(ok.to(tl.int32), axis=1), axis=0)


@triton.jit
def _filter_max(
    s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, NG, S, GM_OFF,
    HAS_NV: tl.constexpr, G: tl.constexpr, NGB: tl.constexpr, ALIGN: tl.constexpr, LEVELS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """A, grid (T, S): the max key of every group of the row's level (G >> lv entries, ``_row_plan``) of the
    chunk's visible entries (selectable entries only; INT32_MIN for a group without any) into GM[t, g], the
    chunk's selectable count into W[t, s] (own slots)."""
    pdl_enter(PDL)
    _filter_max_chunk(
        tl.program_id(0).to(tl.int64), tl.program_id(1), s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, NG, S, GM_OFF,
        HAS_NV, G, NGB, ALIGN, LEVELS,
    )  # fmt: skip


@triton.jit
def _filter_max_chunk(
    r, sp, s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, NG, S, GM_OFF,
    HAS_NV: tl.constexpr, G: tl.constexpr, NGB: tl.constexpr, ALIGN: tl.constexpr, LEVELS: tl.constexpr,
):  # fmt: skip
    """Launch A's program (row r, split sp)."""
    row = s_ptr + r * stride_s
    ws_row = ws_ptr + r * stride_w
    lo, hi, lv = _row_chunk(nv_ptr, r, sp, N, S, NG, HAS_NV, G, ALIGN, LEVELS)
    n_ok = sp * 0
    for i in tl.static_range(LEVELS):  # the same tile size at every level: [NGB << i, G >> i]
        if lv == i:
            n_ok = _group_max_chunk(row, ws_row + GM_OFF, lo, hi, G >> i, NGB << i)
    tl.store(ws_row + _W + sp, n_ok)


@triton.jit
def _filter_max_level(
    s_ptr, nv_ptr, ws_ptr, cnt_ptr, stride_s, stride_w, N, K, NG, S, GM_OFF,
    HAS_NV: tl.constexpr, G: tl.constexpr, NGB: tl.constexpr, ALIGN: tl.constexpr, LEVELS: tl.constexpr,
    NGP: tl.constexpr, SP: tl.constexpr, BITS: tl.constexpr = 32, R: tl.constexpr = 2, PDL: tl.constexpr = False,
):  # fmt: skip
    """A then B in one launch, grid (T, S) (``topk_indices(counters=)``): each program is launch A's; the last of a
    row's S programs to finish (``last_arrival`` on ``cnt_ptr[t]``, 0 on entry and left 0) sees every group max and
    count of the row and runs launch B's program for it."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    _filter_max_chunk(
        r, tl.program_id(1), s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, NG, S, GM_OFF, HAS_NV, G, NGB, ALIGN,
        LEVELS,
    )  # fmt: skip
    if last_arrival(cnt_ptr + r, S):
        _filter_level_row(r, nv_ptr, ws_ptr, stride_w, N, K, NG, S, GM_OFF, HAS_NV, G, ALIGN, LEVELS, NGP, SP, BITS, R)


@triton.jit
def _group_max_chunk(row, gm_row, lo, hi, G: tl.constexpr, NGB: tl.constexpr):
    """Launch A over [lo, hi) in [NGB, G] tiles: the maxima of its groups of G; returns the selectable count."""
    gi = tl.arange(0, NGB)
    tile = gi[:, None] * G + tl.arange(0, G)[None, :]
    n_ok = 0
    n_full = (hi - lo) // (NGB * G)  # tiles with every entry visible: unmasked (vector) loads
    for t in range(0, n_full):
        start = lo + t * (NGB * G)
        n_ok += _group_max_tile(row, gm_row, start, tile, gi, hi, G, False)
    for start in range(lo + n_full * (NGB * G), hi, NGB * G):
        n_ok += _group_max_tile(row, gm_row, start, tile, gi, hi, G, True)
    return n_ok


@triton.jit
def _filter_level(
    nv_ptr, ws_ptr, stride_w, N, K, NG, S, GM_OFF,
    HAS_NV: tl.constexpr, G: tl.constexpr, ALIGN: tl.constexpr, LEVELS: tl.constexpr, NGP: tl.constexpr,
    SP: tl.constexpr, BITS: tl.constexpr = 32, R: tl.constexpr = 2,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """B, grid (T,): kk = min(K, selectable entries of the row) and L = the kk-th largest group max, its
    low 32 - BITS key bits cleared (``_kth_largest``; INT32_MIN when fewer than kk groups hold a selectable
    entry) into META.  At least kk selectable entries have key >= L (one per such group), so every chosen
    entry has key >= L."""
    pdl_enter(PDL)
    _filter_level_row(
        tl.program_id(0).to(tl.int64), nv_ptr, ws_ptr, stride_w, N, K, NG, S, GM_OFF, HAS_NV, G, ALIGN, LEVELS, NGP, SP,
        BITS, R,
    )  # fmt: skip


@triton.jit
def _filter_level_row(
    r, nv_ptr, ws_ptr, stride_w, N, K, NG, S, GM_OFF,
    HAS_NV: tl.constexpr, G: tl.constexpr, ALIGN: tl.constexpr, LEVELS: tl.constexpr, NGP: tl.constexpr,
    SP: tl.constexpr, BITS: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    """Launch B's program for row r."""
    ws_row = ws_ptr + r * stride_w
    sidx = tl.arange(0, SP)
    kk = tl.minimum(tl.sum(tl.load(ws_row + _W + sidx, mask=sidx < S, other=0), axis=0), K)
    nv = _visible(nv_ptr, r, N, HAS_NV)
    _, lv = _row_plan(nv, S, NG, G, ALIGN, LEVELS)
    ng = tl.cdiv(nv, G >> lv)  # the row's groups (<= NG)
    g = tl.arange(0, NGP)
    gm = tl.load(ws_row + GM_OFF + g, mask=g < ng, other=-2147483648)
    level = _kth_largest(gm, g < ng, kk, BITS, R, UNROLL=True)
    tl.store(ws_row + _META, kk)
    tl.store(ws_row + _META + 1, level)


@triton.jit
def _kth_largest(v, valid, kk, BITS: tl.constexpr = 32, R: tl.constexpr = 2, UNROLL: tl.constexpr = False):
    """The kk-th largest of the int32 values v[valid] (duplicates counted): the largest x with
    #(v >= x) >= kk, found from the top bit down R bits a step (BITS / R steps; the 2^R - 1 counts of a
    step are one reduction of a [n, 2^R] compare tile; R = 2 measured fastest, see ``_RADIX_STEP_BITS``).
    INT32_MIN when kk > #valid, INT32_MAX when kk <= 0 (BITS = 32).  BITS < 32: only the top BITS bits are
    searched and the result is the lower edge of the kk-th largest value's bucket of 2^(32 - BITS) keys
    (<= the exact one).  UNROLL: the steps unrolled (launch B, 8 steps: ~0.3 us faster on the H200) or a
    loop (launch D's two 16-step instances: ~0.6 us slower, but the kernel compiles in half the time:
    16 s instead of 29 s for sm_90, which the first call of a process pays)."""
    d = tl.arange(0, 2**R).to(tl.int64)
    ans = tl.zeros((), tl.int64)  # the answer + 2^31 (unsigned order), built from the top bit down
    if UNROLL:
        for b in tl.static_range(32 - R, 31 - BITS, -R):
            ans = _radix_step(v, valid, kk, ans, d, b)
    else:
        for step in range(0, BITS // R):
            ans = _radix_step(v, valid, kk, ans, d, 32 - R - step * R)
    return (ans - 2147483648).to(tl.int32)


@triton.jit
def _radix_step(v, valid, kk, ans, d, b):
    """One step of ``_kth_largest``: the digit d of bits [b, b + R) for which #(v >= ans | d << b) >= kk
    still holds, largest first (the 2^R - 1 counts as one reduction of a [n, 2^R] compare tile)."""
    thr = ((ans | (d << b)) - 2147483648).to(tl.int32)
    cnt = tl.sum(((v[:, None] >= thr[None, :]) & valid[:, None]).to(tl.int32), axis=0)
    digit = tl.sum(((cnt >= kk) & (d > 0)).to(tl.int64), axis=0)
    return ans | (digit << b)


@triton.jit
def _cand_tile(row, ws_row, start, tile, gi, hi, level, n_c, GM_OFF, ridx, rkey, G: tl.constexpr, MASKED: tl.constexpr):
    """Launch C on one [NGB, G] tile at start: reads the groups whose max is >= level and appends their
    selectable entries with key >= level (index, key) to the program's region (ridx, rkey) after the n_c
    already there, in index order.  Returns the new count.  MASKED False: every entry of the tile is < hi."""
    g = start // G + gi
    offs = start + tile
    if MASKED:
        gmax = tl.load(ws_row + GM_OFF + g, mask=g * G < hi, other=-2147483648)
        m = ((gmax >= level) & (g * G < hi))[:, None] & (offs < hi)
    else:
        gmax = tl.load(ws_row + GM_OFF + g)
        m = (gmax >= level)[:, None] & (offs >= 0)
    x = tl.load(row + offs, mask=m, other=float("-inf"))
    key = _order_key(x)
    cand = (m & (x > float("-inf")) & (key >= level)).to(tl.int32)
    per_g = tl.sum(cand, axis=1)
    pos = n_c + (tl.cumsum(per_g, axis=0) - per_g)[:, None] + tl.cumsum(cand, axis=1) - 1  # row-major = index order
    tl.store(ridx + pos, offs.to(tl.int32), mask=cand != 0)
    tl.store(rkey + pos, key, mask=cand != 0)
    return n_c + tl.sum(per_g, axis=0)


@triton.jit
def _kth_by_rank(ws_row, key, valid, kk, SCRATCH, R: tl.constexpr, RB: tl.constexpr):
    """``_kth_largest(key, valid, kk)`` in fewer serial steps: the radix search of the top 16 bits gives the
    threshold's 16-bit bucket; when at most RB keys fall in it, they are compacted through the workspace at
    SCRATCH (RB int32, free to overwrite) and the threshold is found among them by rank (one [RB, RB]
    comparison) instead of 8 more search steps; otherwise the search goes on over the low 16 bits."""
    lo_edge = _kth_largest(key, valid, kk, 16, R)  # low 16 bits 0: the bucket's smallest key
    top = lo_edge >> 16  # arithmetic shift: the bucket's index in signed order
    in_b = valid & ((key >> 16) == top)
    need = kk - tl.sum((valid & ((key >> 16) > top)).to(tl.int32), axis=0)  # >= 1 when kk <= #valid
    n_b = tl.sum(in_b.to(tl.int32), axis=0)
    if (n_b <= RB) & (need >= 1):
        tl.debug_barrier()  # every thread has read the dense list before it is overwritten
        pos = tl.cumsum(in_b.to(tl.int32), axis=0) - 1
        tl.store(ws_row + SCRATCH + pos, key, mask=in_b)
        tl.debug_barrier()  # the compacted bucket is complete before any thread reads it
        i = tl.arange(0, RB)
        bm = i < n_b
        bk = tl.load(ws_row + SCRATCH + i, mask=bm, other=0)
        gt = tl.sum(((bk[None, :] > bk[:, None]) & bm[None, :]).to(tl.int32), axis=1)  # keys above bk[i]
        ge = tl.sum(((bk[None, :] >= bk[:, None]) & bm[None, :]).to(tl.int32), axis=1)
        hit = bm & (gt < need) & (ge >= need)  # bk[i] is the need-th largest of the bucket
        thr = tl.max(tl.where(hit, bk, -2147483648), axis=0)
    else:
        thr = _kth_largest(key, valid, kk, 32, R)
    return thr


@triton.jit
def _take_dense(
    ws_row, out_row, total, kk, K, DIDX, DKEY,
    SB: tl.constexpr, KP: tl.constexpr, R: tl.constexpr, RANK_SLOTS: tl.constexpr,
):  # fmt: skip
    """The exact top kk of the ``total`` (<= SB) candidates of the dense list (DIDX / DKEY, in index order),
    held in SB register slots, written to out_row in ascending index order, -1 padded to K.  Threshold key =
    the kk-th largest (``_kth_by_rank`` when RANK_SLOTS > 0, else the 32-bit radix search); ties at it are
    taken in list order (lowest indices first)."""
    j = tl.arange(0, SB)
    valid = j < total
    idx = tl.load(ws_row + DIDX + j, mask=valid, other=0)
    key = tl.load(ws_row + DKEY + j, mask=valid, other=0)
    if RANK_SLOTS > 0:
        thr = _kth_by_rank(ws_row, key, valid, kk, DKEY, R, RANK_SLOTS)
    else:
        thr = _kth_largest(key, valid, kk, 32, R)
    gt = valid & (key > thr)
    eq = valid & (key == thr)
    need_eq = kk - tl.sum(gt.to(tl.int32), axis=0)
    take = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need_eq))
    pos = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_row + pos, idx, mask=take)
    offs_k = tl.arange(0, KP)
    tl.store(out_row + offs_k, tl.full((KP,), -1, tl.int32), mask=(offs_k >= kk) & (offs_k < K))


@triton.jit
def _filter_cand(
    s_ptr, nv_ptr, ws_ptr, stride_s, stride_w, N, NG, S, GM_OFF, RIDX, RKEY,
    HAS_NV: tl.constexpr, G: tl.constexpr, NGB: tl.constexpr, ALIGN: tl.constexpr, LEVELS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """C, grid (T, S): lists the chunk's selectable entries with key >= L (index, key; only groups whose max
    is >= L are read) in its own region of the workspace (region s starts at the chunk start: it cannot
    overflow), in index order, and their count into C[t, s]."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    row = s_ptr + r * stride_s
    ws_row = ws_ptr + r * stride_w
    level = tl.load(ws_row + _META + 1)
    lo, hi, lv = _row_chunk(nv_ptr, r, sp, N, S, NG, HAS_NV, G, ALIGN, LEVELS)
    n_c = sp * 0
    for i in tl.static_range(LEVELS):  # the row's level, as in launch A
        if lv == i:
            n_c = _cand_chunk(row, ws_row, lo, hi, level, GM_OFF, RIDX, RKEY, G >> i, NGB << i)
    tl.store(ws_row + _C + sp, n_c)


@triton.jit
def _cand_chunk(row, ws_row, lo, hi, level, GM_OFF, RIDX, RKEY, G: tl.constexpr, NGB: tl.constexpr):
    """Launch C over [lo, hi) in [NGB, G] tiles (groups of G); returns the candidates listed."""
    gi = tl.arange(0, NGB)
    tile = gi[:, None] * G + tl.arange(0, G)[None, :]
    ridx = ws_row + RIDX + lo
    rkey = ws_row + RKEY + lo
    n_c = 0
    n_full = (hi - lo) // (NGB * G)  # tiles with every entry visible: group-uniform load masks
    for t in range(0, n_full):
        start = lo + t * (NGB * G)
        n_c = _cand_tile(row, ws_row, start, tile, gi, hi, level, n_c, GM_OFF, ridx, rkey, G, False)
    for start in range(lo + n_full * (NGB * G), hi, NGB * G):
        n_c = _cand_tile(row, ws_row, start, tile, gi, hi, level, n_c, GM_OFF, ridx, rkey, G, True)
    return n_c


@triton.jit
def _filter_write(
    s_ptr, nv_ptr, out_ptr, ws_ptr, stride_s, stride_o, stride_w, N, K, NG, S, RIDX, RKEY, DIDX, DKEY,
    HAS_NV: tl.constexpr, G: tl.constexpr, ALIGN: tl.constexpr, LEVELS: tl.constexpr,
    SB1: tl.constexpr, SB2: tl.constexpr, CPB: tl.constexpr,
    BLOCK: tl.constexpr, KP: tl.constexpr, SP: tl.constexpr, R: tl.constexpr, RANK_SLOTS: tl.constexpr = 0,
    ONE_REGION: tl.constexpr = False, PART: tl.constexpr = 0, PDL: tl.constexpr = False,
):  # fmt: skip
    """D, grid (T,): when the listed candidates fit SB2 register slots, copies the S regions into one dense
    list in region order (= index order; [SP, CPB] tiles of (region, position)), then takes the exact top kk
    of it (``_take_dense``); else runs the single-program radix select over the whole row (adversarial rows:
    many equal scores; exact, slow).  Writes the whole output row.  ``ONE_REGION`` (S = 1): the one region, which
    starts at column 0 of the row's lists, is already the dense list: no copy, ``_take_dense`` reads it there.

    PART: 0 every row here; 1 only rows whose candidates fit SB1 slots (the others are left alone); 2 only the
    others (rows that fit SB1 return at once).  Launched as PART 1 then PART 2, the common case compiles without
    the SB2 list and the whole-row fallback, whose registers otherwise set the occupancy of every row's program."""
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    ws_row = ws_ptr + r * stride_w
    out_row = out_ptr + r * stride_o
    kk = tl.load(ws_row + _META)
    sidx = tl.arange(0, SP)
    c = tl.load(ws_row + _C + sidx, mask=sidx < S, other=0)
    total = tl.sum(c, axis=0)
    if PART == 1:
        if total > SB1:
            return
    if PART == 2:
        if total <= SB1:
            return
    nv = _visible(nv_ptr, r, N, HAS_NV)
    if (total <= SB1) if PART == 1 else (total <= SB2):
        if ONE_REGION:  # the list is the region itself
            li, lk = RIDX, RKEY
        else:
            ch, _ = _row_plan(nv, S, NG, G, ALIGN, LEVELS)
            starts = tl.cumsum(c, axis=0) - c
            src0 = sidx.to(tl.int64)[:, None] * ch
            for p0 in range(0, tl.max(c, axis=0), CPB):
                pcol = p0 + tl.arange(0, CPB)
                m = pcol[None, :] < c[:, None]
                src = src0 + pcol[None, :]
                dst = starts[:, None] + pcol[None, :]
                tl.store(ws_row + DIDX + dst, tl.load(ws_row + RIDX + src, mask=m), mask=m)
                tl.store(ws_row + DKEY + dst, tl.load(ws_row + RKEY + src, mask=m), mask=m)
            tl.debug_barrier()  # the dense list is complete before any thread reads it
            li, lk = DIDX, DKEY
        if PART == 1:
            _take_dense(ws_row, out_row, total, kk, K, li, lk, SB1, KP, R, RANK_SLOTS)
        elif PART == 2:
            _take_dense(ws_row, out_row, total, kk, K, li, lk, SB2, KP, R, RANK_SLOTS)
        elif total <= SB1:
            _take_dense(ws_row, out_row, total, kk, K, li, lk, SB1, KP, R, RANK_SLOTS)
        else:
            _take_dense(ws_row, out_row, total, kk, K, li, lk, SB2, KP, R, RANK_SLOTS)
    elif PART != 1:
        _select_row(s_ptr + r * stride_s, nv, out_row, ws_row + RIDX, K, BLOCK, KP)


# ---------------------------------------------------------------------------------------- public ops
def _auto_splits(T: int, N: int) -> int:
    """Programs per row for the split path (1 = single-program kernel): about _TARGET_PROGRAMS programs in
    all, chunks of at least _MIN_CHUNK entries, at most _MAX_SPLITS (host ints only)."""
    return max(1, min(_MAX_SPLITS, _TARGET_PROGRAMS // max(T, 1), triton.cdiv(N, _MIN_CHUNK)))


def _auto_splits_filter(T: int, N: int) -> int:
    """Programs per row for launches A and C of the filter path: about _FILTER_PROGRAMS in all, chunks of
    at least _MIN_CHUNK entries, at most _MAX_SPLITS."""
    return max(1, min(_MAX_SPLITS, triton.cdiv(_FILTER_PROGRAMS, max(T, 1)), triton.cdiv(N, _MIN_CHUNK)))


def _dense_slots(N: int) -> int:
    """Slots of the filter path's dense candidate list: at most SB2 <= _MAX_LIST candidates, and at most N."""
    return min(_MAX_LIST, max(N, 1))


def _workspace_cols(N: int, single: bool) -> int:
    """Columns a row of the workspace needs: the single-program path N of scratch, the others two lists of
    N (indices, keys) and up to N / 2 group maxima (the filter path; G >= 2)."""
    n = max(N, 1)
    return _WS_LIST + (n if single else 2 * _dense_slots(n) + 2 * n + triton.cdiv(n, 2))


def topk_scratch_cols(N: int, rows: int | None = None) -> int:
    """Workspace columns a row of ``topk_indices`` allocates on [``rows``, N] scores with the default method and splits
    (the single-program kernel up to N = 4,096 for fewer than _SINGLE_MAX_ROWS rows, else the filter path); with
    ``rows`` None the larger of the two (any row count).  Host ints only."""
    few = rows is not None and rows < _SINGLE_MAX_ROWS
    return _workspace_cols(N, N <= _SINGLE_MAX_N and few)


def topk_workspace(T: int, N: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A zeroed [T, 704 + 2 min(8,192, N) + 2 N + ceil(N / 2)] int32 workspace that fits ``topk_indices`` on
    [T, N] scores for any ``splits`` and method (about 10 MiB for 4 x 262,144).

    Columns: [0, 256) the row histogram H1 of the radix split path, which must be zero when a call starts
    and which every call leaves zero (the other paths never touch it); then scratch (counters, per-split
    counts, candidate lists, group maxima), written before it is read in every call.  Only
    ``topk_indices`` may write it, one call at a time; then one buffer serves every call of a CUDA graph.
    """
    return torch.zeros((T, _workspace_cols(N, False)), dtype=torch.int32, device=device)


def topk_indices(
    scores: torch.Tensor,
    k: int,
    n_visible: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    workspace: torch.Tensor | None = None,
    splits: int | None = None,
    method: str = "auto",
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logical indices of the top-``min(k, #selectable)`` scores of each row, ascending, -1 padded.

    Args:
        scores: [T, N] fp32 (e.g. from ``indexer_scores``); -inf and NaN entries are never selected.
        k: host int, 1 <= k (the Triton kernel supports k <= 4096; typical 512 / 1024).
        n_visible: optional [T] int32; entries j >= n_visible[t] are never selected.
        backend: "auto" | "torch" | "triton".
        workspace: optional row-contiguous [>= T, >= cols] int32 buffer for the Triton kernels, from
            ``topk_workspace`` (zeroed; the radix split path needs columns [0, 256) of each row zero on
            entry and leaves them zero, the other paths never touch them and need nothing zeroed; pass it
            in to keep allocations out of a captured CUDA graph).  Allocated per call if None (only the columns
            the radix split path needs zeroed: a 2 N-column zero fill cost 4.6 us at T = 64, N = 32,768).
            cols = 704 + N on the single-program path, else 704 + 2 min(8,192, N) + 2 N + ceil(N / 2).
        splits: Triton only, host int in [1, 64]: programs per row of the launches over the row (A and
            C of the filter path, all four of the radix split path).  None picks from T, N and the
            method.  The result never depends on it.
        method: Triton only: "filter" (group-max filter, any splits), "radix" (splits == 1: the
            single-program kernel; else the 4-launch radix split path), or "auto": the single-program
            kernel when splits == 1 or (splits is None, N <= 4096 and T < 256), else "filter" (measured faster than
            the radix split path at every shape of ``benchmarks/bench_indexer.py``, and than the single-program
            kernel on a prefill chunk's many rows).
        counters: optional zeroed int32 vector (e.g. ``linear.linear_counters``; left zero): with at least T of them
            the filter path runs its launches A and B as one (``_filter_max_level``: each row's last A program runs
            B), three launches instead of four, the same result (except from 256 rows at k <= 512, where B runs on
            4 warps: the four launches there).  Calls sharing them must not overlap (one stream).

    Returns:
        [T, k] int32: the chosen indices in ascending order (chosen = the top kk = min(k, #selectable)
        by score, ties at the boundary to the lower index), then -1.
    """
    check_tensor("scores", scores, dtype=torch.float32, ndim=2)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k: expected a host int >= 1, got {k!r}")
    T, N = scores.shape
    if n_visible is not None:
        check_tensor("n_visible", n_visible, dtype=torch.int32, shape=(T,), device=scores.device)
    if method not in ("auto", "filter", "radix"):
        raise ValueError(f"method: expected 'auto', 'filter' or 'radix', got {method!r}")
    if method == "auto":
        single = splits == 1 or (splits is None and N <= _SINGLE_MAX_N and T < _SINGLE_MAX_ROWS)
        method = "radix" if single else "filter"
    if splits is None:
        splits = _auto_splits_filter(T, N) if method == "filter" else _auto_splits(T, N)
    elif not isinstance(splits, int) or isinstance(splits, bool) or not 1 <= splits <= _MAX_SPLITS:
        raise ValueError(f"splits: expected None or a host int in [1, {_MAX_SPLITS}], got {splits!r}")
    cols = _workspace_cols(N, method == "radix" and splits == 1)
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.int32, ndim=2, device=scores.device)
        if workspace.shape[0] < T or workspace.shape[1] < cols or workspace.stride(1) != 1:
            raise ValueError(
                f"workspace: expected a row-contiguous [>= {T}, >= {cols}] tensor, got {list(workspace.shape)}"
            )
    if counters is not None:
        check_tensor("counters", counters, dtype=torch.int32, ndim=1, device=scores.device, contiguous=True)
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
    if workspace is None:  # only the radix split path needs zeros (its H1 columns); the others need nothing
        workspace = torch.empty((T, cols), dtype=torch.int32, device=scores.device)
        if method == "radix" and splits > 1 and N > 0:
            workspace[:, :_BINS].zero_()
    interp = interpreter_enabled()
    nv = n_visible if n_visible is not None else out  # placeholder pointer when HAS_NV is False
    has_nv = n_visible is not None
    ss, so, sw = scores.stride(0), out.stride(0), workspace.stride(0)
    if (method == "radix" and splits == 1) or N == 0:
        _topk_kernel[(T,)](
            scores, nv, out, workspace[:, _WS_LIST:], ss, so, sw, N, k,
            HAS_NV=has_nv, BLOCK=1024 if interp else 4096, KP=max(16, triton.next_power_of_2(k)), num_warps=8,
            **pdl_launch(scores.device),
        )  # fmt: skip
        return out
    if method == "filter" and N > 0:  # (N == 0: the single-program kernel pads the rows)
        _launch_filter(scores, nv, out, workspace, k, splits, has_nv, interp, counters)
        return out
    S = splits
    ch = triton.cdiv(triton.cdiv(N, S), 16) * 16  # chunk start offsets stay 16-aligned (vector loads)
    list_off, key_off = _WS_LIST, _WS_LIST + N
    # One loop iteration per program where the chunk allows: all of its loads are issued at once.
    block = 256 if interp else max(256, min(_MAX_BLOCK, triton.next_power_of_2(ch)))
    grid = (T, S)
    pdl = pdl_launch(scores.device)
    _split_hist1[grid](scores, nv, workspace, ss, sw, N, ch, HAS_NV=has_nv, BLOCK=block, num_warps=8, **pdl)
    _split_hist2[grid](scores, nv, workspace, ss, sw, N, k, ch, HAS_NV=has_nv, BLOCK=block, num_warps=8, **pdl)
    _split_cand[grid](
        scores, nv, workspace, ss, sw, N, k, ch, list_off, key_off, HAS_NV=has_nv, BLOCK=block, num_warps=8, **pdl
    )
    _split_write[grid](
        scores, nv, out, workspace, ss, so, sw, N, k, ch, list_off, key_off,
        HAS_NV=has_nv, BLOCK=block, CBLOCK=_CBLOCK, SP=_MAX_SPLITS, PBLOCK=_PBLOCK,
        num_warps=8, **pdl,
    )  # fmt: skip
    return out


def _filter_plan(N: int, k: int, splits: int, interp: bool, T: int = 1) -> dict:
    """Host ints of the filter path for T rows (see the module docstring): group size G, groups NG, chunk CH, tile,
    register slot counts SB1 <= SB2 of launch D, and the workspace offsets (see the module docstring)."""
    g = _G_MIN
    per_k = _GROUPS_PER_K
    if T >= _MANY_ROWS:  # more, smaller groups, but groups of >= _G_MANY_MIN entries (short rows: more cost more)
        per_k = min(_GROUPS_PER_K_MANY, max(_GROUPS_PER_K, N // (_G_MANY_MIN * k)))
    while g < _G_MAX and triton.cdiv(N, 2 * g) >= per_k * k:  # the largest G with >= per_k k groups
        g *= 2
    g = max(g, triton.next_power_of_2(triton.cdiv(N, _MAX_GROUPS)))  # level sort of <= _MAX_GROUPS maxima
    ng = triton.cdiv(N, g)
    align = max(g, 16)
    ch = triton.cdiv(triton.cdiv(N, splits), align) * align  # whole groups per chunk, 16-aligned starts
    tile = max(g, min(_FILTER_TILE_INTERP if interp else _FILTER_TILE, triton.next_power_of_2(ch)))
    kp = max(16, triton.next_power_of_2(k))
    sb1 = max(kp, triton.next_power_of_2(2 * k))
    sb2 = max(sb1, min(_MAX_LIST, 4 * sb1))
    dn = _dense_slots(N)
    gm = _WS_LIST + 2 * dn  # after the dense list (indices, keys)
    levels = (g // min(g, _G_FINEST)).bit_length()  # G, G / 2, ..., min(G, _G_FINEST)
    return dict(G=g, NG=ng, NGP=triton.next_power_of_2(ng), CH=ch, NGB=tile // g, KP=kp, SB1=sb1, SB2=sb2,
                ALIGN=align, LEVELS=levels,
                DIDX=_WS_LIST, DKEY=_WS_LIST + dn, GM=gm, RIDX=gm + ng, RKEY=gm + ng + N)  # fmt: skip


def _split_d(T: int) -> bool:
    """Launch D as its two parts for T rows (see ``_SPLIT_D``)."""
    return _SPLIT_D and T >= _SPLIT_D_MIN_ROWS


def _launch_filter(scores, nv, out, ws, k, splits, has_nv, interp, counters=None):
    T, N = scores.shape
    ss, so, sw = scores.stride(0), out.stride(0), ws.stride(0)
    p = _filter_plan(N, k, splits, interp, T)
    grid = (T, splits)
    many = T >= _FILTER_MANY_ROWS and k <= _FILTER_BD_MANY_MAX_K
    bd_warps = _FILTER_WARPS_BD_MANY if many else _FILTER_WARPS_BD
    row = dict(HAS_NV=has_nv, G=p["G"], ALIGN=p["ALIGN"], LEVELS=p["LEVELS"], num_warps=bd_warps)
    row.update(pdl_launch(scores.device))
    ac = {**row, "num_warps": _FILTER_WARPS_AC}
    sp = triton.next_power_of_2(splits)  # the per-split counts' vector (was always _MAX_SPLITS wide)
    level = dict(NGP=p["NGP"], SP=sp, BITS=_LEVEL_BITS, R=_RADIX_STEP_BITS)
    # A and B in one launch (B by each row's last A program); from _FILTER_MANY_ROWS rows B runs on bd_warps (4), which
    # one launch with A's warps would not: the four launches there (not measured merged)
    if counters is not None and counters.shape[0] >= T and not many:
        _filter_max_level[grid](
            scores, nv, ws, counters, ss, sw, N, k, p["NG"], splits, p["GM"], NGB=p["NGB"], **level, **ac
        )
    else:
        _filter_max[grid](scores, nv, ws, ss, sw, N, p["NG"], splits, p["GM"], NGB=p["NGB"], **ac)
        _filter_level[(T,)](nv, ws, sw, N, k, p["NG"], splits, p["GM"], **level, **row)
    _filter_cand[grid](scores, nv, ws, ss, sw, N, p["NG"], splits, p["GM"], p["RIDX"], p["RKEY"], NGB=p["NGB"], **ac)
    parts = (1, 2) if _split_d(T) else (0,)
    for part in parts:
        _filter_write[(T,)](
            scores, nv, out, ws, ss, so, sw, N, k, p["NG"], splits, p["RIDX"], p["RKEY"], p["DIDX"], p["DKEY"],
            SB1=p["SB1"], SB2=p["SB2"], CPB=_COPY_COLS * _MAX_SPLITS // sp, BLOCK=1024 if interp else 4096,
            KP=p["KP"], SP=sp, R=_RADIX_STEP_BITS, RANK_SLOTS=_RANK_SLOTS, ONE_REGION=splits == 1 and _ONE_REGION,
            PART=part, **row,
        )  # fmt: skip


def to_physical_reference(
    idx: torch.Tensor, block_table: torch.Tensor, token_row: torch.Tensor, entries_per_page: int
) -> torch.Tensor:
    """PyTorch definition of ``to_physical``."""
    max_blocks = block_table.shape[1]
    if max_blocks == 0:
        return torch.full_like(idx, -1)
    i = idx.long()
    col = i.clamp(min=0) // entries_per_page
    page = block_table.long()[token_row.long()].gather(1, col.clamp(max=max_blocks - 1))
    ok = (i >= 0) & (col < max_blocks) & (page >= 0)
    phys = page * entries_per_page + i % entries_per_page
    return torch.where(ok, phys, torch.full_like(phys, -1)).to(torch.int32)


def visible_logical(n_visible: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width] int32: ``j`` where ``j < n_visible[t]``, else -1 (an HCA query's list: every visible entry)."""
    ids = torch.arange(width, device=n_visible.device, dtype=torch.int32)
    return torch.where(ids[None, :] < n_visible[:, None], ids[None, :], -1)


@triton.jit
def _to_physical_kernel(
    idx_ptr, s_idx, nv_ptr, bt_ptr, s_bt, row_ptr, out_ptr, s_out, K, max_blocks,
    EPP: tl.constexpr, ALL: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Program (row t, column block c): columns [c*BLOCK, ...) of row t.  ALL: the logical indices are
    ``j if j < n_visible[t] else -1`` (no index tensor is read)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    jm = j < K
    if ALL:
        nv = tl.load(nv_ptr + t)
        i = tl.where(j < nv, j, -1).to(tl.int64)
    else:
        i = tl.load(idx_ptr + t * s_idx + j, mask=jm, other=-1).to(tl.int64)
    row = tl.load(row_ptr + t).to(tl.int64)
    col = tl.maximum(i, 0) // EPP
    ok = jm & (i >= 0) & (col < max_blocks)
    page = tl.load(bt_ptr + row * s_bt + col, mask=ok, other=-1).to(tl.int64)
    ok = ok & (page >= 0)
    phys = page * EPP + i % EPP
    tl.store(out_ptr + t * s_out + j, tl.where(ok, phys, -1).to(tl.int32), mask=jm)


def _launch_to_physical(idx, n_visible, width, block_table, token_row, entries_per_page) -> torch.Tensor:
    T = token_row.shape[0]
    out = torch.empty(T, width, dtype=torch.int32, device=token_row.device)
    if T == 0 or width == 0:
        return out
    if block_table.shape[1] == 0:
        return out.fill_(-1)
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    src = idx if idx is not None else out  # (unread when ALL)
    block = min(1024, triton.next_power_of_2(width))
    _to_physical_kernel[(T, triton.cdiv(width, block))](
        src, src.stride(0), n_visible if n_visible is not None else token_row, bt, bt.stride(0),
        token_row.contiguous(), out, out.stride(0), width, bt.shape[1],
        EPP=entries_per_page, ALL=idx is None, BLOCK=block, num_warps=4, **pdl_launch(src.device),
    )  # fmt: skip
    return out


def _check_physical_args(block_table, token_row, n_rows, device, entries_per_page) -> None:
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=device)
    check_tensor("token_row", token_row, dtype=torch.int32, shape=(n_rows,), device=device)
    if not isinstance(entries_per_page, int) or entries_per_page < 1:
        raise ValueError(f"entries_per_page: expected a host int >= 1, got {entries_per_page!r}")


def to_physical(
    idx: torch.Tensor,
    block_table: torch.Tensor,
    token_row: torch.Tensor,
    entries_per_page: int,
    backend: str = "auto",
) -> torch.Tensor:
    """Logical entry indices [T, k] -> physical slots ``page * entries_per_page + row`` (int32).

    -1 stays -1, and so does an index whose logical page is past the block table or maps to page -1.
    ``block_table`` [B, max_blocks] int32, ``token_row`` [T] int32 (block-table row of each query row).
    Triton path: one launch (a decode step does this once per CSA layer; the reference is ~12 kernels).
    """
    check_tensor("idx", idx, dtype=torch.int32, ndim=2)
    _check_physical_args(block_table, token_row, idx.shape[0], idx.device, entries_per_page)
    if not use_triton(backend, idx, block_table, token_row):
        return to_physical_reference(idx, block_table, token_row, entries_per_page)
    idx = idx if idx.stride(1) == 1 else idx.contiguous()
    return _launch_to_physical(idx, None, idx.shape[1], block_table, token_row, entries_per_page)


def visible_physical(
    n_visible: torch.Tensor,
    width: int,
    block_table: torch.Tensor,
    token_row: torch.Tensor,
    entries_per_page: int,
    backend: str = "auto",
) -> torch.Tensor:
    """``to_physical(visible_logical(n_visible, width), ...)`` in one launch: the physical slots [T, width] of
    every entry a query row sees (HCA), -1 past ``n_visible[t]`` (int32/int64 [T])."""
    check_tensor("n_visible", n_visible, dtype=(torch.int32, torch.int64), ndim=1)
    if not isinstance(width, int) or width < 0:
        raise ValueError(f"width: expected a host int >= 0, got {width!r}")
    _check_physical_args(block_table, token_row, n_visible.shape[0], n_visible.device, entries_per_page)
    if not use_triton(backend, n_visible, block_table, token_row):
        return to_physical_reference(visible_logical(n_visible, width), block_table, token_row, entries_per_page)
    return _launch_to_physical(None, n_visible.contiguous(), width, block_table, token_row, entries_per_page)
