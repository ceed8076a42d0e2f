"""Top-k selection of indexer scores, and logical -> physical entry slots (spec §4 "Selection").

``topk_indices(scores, k, n_visible)`` returns, per row, the logical indices of the
``min(k, #selectable)`` largest scores, where an entry is selectable iff ``j < n_visible[t]`` and its
score is neither -inf nor NaN.  The rest of the row is padded with -1.

Order and ties (deterministic, identical in both backends): indices are sorted by score descending,
then by index ascending; among equal scores the lower index wins a place at the boundary.  -0.0 and
+0.0 are equal.

Triton kernel (one program per row; no host sync, static shapes; scratch = the output row plus a
[T, N] int32 workspace, allocated per call or passed in):

1. Scores are mapped to 32-bit order-preserving integer keys (float bits, magnitude bits flipped for
   negatives; -0.0 folded to +0.0), so "larger score" = "larger key".
2. Pass 1 (full row): 256-bin histogram of the top 8 key bits over the selectable elements; suffix
   sums give the bucket b0 holding the kk-th largest (kk = min(k, #selectable)) and the count above it.
3. Pass 2 (full row): elements with top digit > b0 are winners, written to out[t] in index order;
   elements with top digit == b0 are candidates, their indices written to the workspace in index order.
4. Radix select on the candidates only, three more 8-bit digits: each pass histograms the digit over
   the candidates whose higher digits equal the prefix so far, picks the bucket holding the ``need``-th
   largest and subtracts the count above it.  The final prefix is the exact key ``thr`` of the kk-th
   largest and ``need`` the number of elements equal to it still to take.
5. Compaction of the candidates in index order: key > thr, or key == thr and among the first ``need``
   such (cumulative counts per block plus a running count) -> appended to out[t].  Exactly kk indices.
6. The kk indices are re-read with their scores, turned into int64 keys ``key << 32 | (2^32-1-index)``
   (unique, so the order is total) and sorted descending with ``tl.sort``; the rest of the row is -1.

Cost: two streaming reads of the row, a few small passes over the candidates (the bucket of the k-th
largest: ~N/256 for smooth data, all N in the worst case of massive ties), and a k-element sort.
One program per row keeps it deterministic and simple; splitting long rows over several programs
(histograms merged through the workspace) is the next step if few-row batches need more than one SM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.kernels.dispatch import interpreter_enabled, use_triton

__all__ = ["to_physical", "topk_indices", "topk_indices_reference"]

_RADIX_BITS = 8
_MAX_K = 4096  # largest k the Triton kernel sorts in registers


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

    # Order the kk winners: score descending, index ascending.
    offs_k = tl.arange(0, KP)
    live = offs_k < kk
    idx = tl.load(out_row + offs_k, mask=live, other=0)
    key = _order_key(tl.load(row + idx, mask=live, other=0.0)).to(tl.int64)
    comp = (key << 32) | (4294967295 - idx.to(tl.int64))
    comp = tl.where(live, comp, -9223372036854775807 - 1)
    comp = tl.sort(comp, descending=True)
    res = (4294967295 - (comp & 4294967295)).to(tl.int32)
    tl.debug_barrier()
    tl.store(out_row + offs_k, tl.where(live, res, -1), mask=offs_k < K)


# ---------------------------------------------------------------------------------------- public ops
def topk_indices(
    scores: torch.Tensor,
    k: int,
    n_visible: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logical indices of the top-``min(k, #selectable)`` scores of each row, -1 padded.

    Args:
        scores: [T, N] fp32 (e.g. from ``indexer_scores``); -inf and NaN entries are never selected.
        k: host int, 1 <= k (the Triton kernel supports k <= 4096; typical 512 / 1024).
        n_visible: optional [T] int32; entries j >= n_visible[t] are never selected.
        backend: "auto" | "torch" | "triton".
        workspace: optional [T, >= N] int32 scratch for the Triton kernel (allocated per call if None;
            pass one in to keep allocations out of a captured CUDA graph).

    Returns:
        [T, k] int32, sorted by score descending then index ascending; -1 after the selected ones.
    """
    check_tensor("scores", scores, dtype=torch.float32, ndim=2)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k: expected a host int >= 1, got {k!r}")
    T, N = scores.shape
    if n_visible is not None:
        check_tensor("n_visible", n_visible, dtype=torch.int32, shape=(T,), device=scores.device)
    if workspace is not None:
        check_tensor("workspace", workspace, dtype=torch.int32, ndim=2, device=scores.device)
        if workspace.shape[0] < T or workspace.shape[1] < N or workspace.stride(1) != 1:
            raise ValueError(
                f"workspace: expected a row-contiguous [>= {T}, >= {N}] tensor, got {list(workspace.shape)}"
            )
    if not use_triton(backend, scores, n_visible):
        return topk_indices_reference(scores, k, n_visible)
    if k > _MAX_K:
        raise ValueError(f"k: the Triton kernel supports k <= {_MAX_K}, got {k}")
    out = torch.empty((T, k), dtype=torch.int32, device=scores.device)
    if T == 0:
        return out
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    if workspace is None:
        workspace = torch.empty((T, max(N, 1)), dtype=torch.int32, device=scores.device)
    block = 1024 if interpreter_enabled() else 4096
    _topk_kernel[(T,)](
        scores,
        n_visible if n_visible is not None else out,
        out,
        workspace,
        scores.stride(0),
        out.stride(0),
        workspace.stride(0),
        N,
        k,
        HAS_NV=n_visible is not None,
        BLOCK=block,
        KP=max(16, triton.next_power_of_2(k)),
        num_warps=8,
    )
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
