"""Indexer selection of a whole step in bounded memory: scores + top-k over row chunks (spec §4).

``indexer_scores`` returns a [T, N] fp32 tensor and ``topk_indices`` needs a [T, cols(N)] int32 workspace
(``topk_scratch_cols``: 2.6-3.5 N a row on its filter path).  Called once on a whole prefill chunk they hold
14-18 N bytes a query row at once: 19.6 GB for a 65,536-token prefill from position 0 (N = 16,384 entries) and
30.6 GB for an 8,192-token chunk at 1M tokens (N = 262,144), on the H200's 141 GB that also holds the cache.

``indexer_topk`` gives the same indices (rows are independent: each row's scores and selection depend
only on that row) from a sequence of row chunks whose scores + workspace stay under ``max_bytes``
(``MAX_SCRATCH_BYTES`` by default): one chunk of transient memory, reused through the caching allocator.
With each row's visible entry count known on the host (a prefill plan knows every token's position), a
chunk also scores only ``cols`` columns, its rows' largest ``n_visible`` rounded up to ``COL_ALIGN``,
instead of the step's ``max_entries``: the early rows of a prefill from position 0 see few entries, and
a plan built with a fixed block-table width (``max_blocks``) has ``max_entries`` far above any row's.

A row that sees at most k entries selects all of them, whatever their scores (the reference's
``topk(min(k, visible))`` does too), so nothing is scored for it: its indices are 0 .. n_visible - 1, then -1.  With
host counts that covers the first 4 x k tokens of a prefill from position 0 (2,051 for top-512); without them, a step
whose ``max_entries`` is at most k (no request past ~4 x k tokens) scores nothing at all.

Decode steps pass no host counts: every chunk keeps ``max_entries`` columns and the chunking depends on
host ints only (T, N, k), so the call stays CUDA-graph capturable (one chunk unless T rows exceed the
budget).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from dsv4.formats import KeyPages
from dsv4.kernels.dispatch import use_triton
from dsv4.kernels.indexer.prefill import FoldedKeys, fold_keys, prefill_scores
from dsv4.kernels.indexer.scores import _check_common, indexer_scores
from dsv4.kernels.indexer.topk import topk_indices, topk_scratch_cols, visible_logical

MAX_SCRATCH_BYTES = 512 << 20  # scores + top-k workspace of one row chunk
COL_ALIGN = 256  # a chunk's column count is rounded up to this (fewer distinct kernel shapes)
# Prefill rows of one request scored against that request's keys folded once (``prefill_scores``: fold_keys +
# prefill_scores, gluon_fold's numerics) instead of by ``indexer_scores`` (which converts every key tile once a row).
# H100, 2026-12-05 (2026-12-05_h100_prefill_idx_s21.txt): the scores of 2,048 rows at P = 8,192 123.6 us against
# indexer_scores' 195.6, 4,096 rows at P = 65,536 1,196 against 2,335; a whole prefill's indexer_topk 1.16 ms against
# 1.60 (8,192) and 22.8 against 31.4 (65,536), the same selections.  ``indexer_topk(shared_keys=...)`` overrides it.
PREFILL_SHARED_KEYS = True
SHARED_MIN_ROWS = 64  # a request's rows in a chunk below this count take indexer_scores


def chunk_row_bytes(cols: int, k: int) -> int:
    """Transient bytes one query row of a chunk holds with ``cols`` score columns: fp32 scores, the int32
    top-k workspace of ``topk_indices``' default method (``topk_scratch_cols``) and the int32 [k] result."""
    return 4 * (cols + topk_scratch_cols(cols) + k)


@functools.lru_cache(maxsize=64)
def _row_bytes_table(max_entries: int, k: int, align: int) -> np.ndarray:
    """int64 [ceil(max_entries / align) + 1]: ``chunk_row_bytes`` of min(i * align, max_entries) columns at i."""
    n = -(-max_entries // align)
    return np.array([chunk_row_bytes(min(i * align, max_entries), k) for i in range(n + 1)], dtype=np.int64)


def row_chunks(
    num_rows: int,
    max_entries: int,
    k: int,
    n_visible_host: Sequence[int] | np.ndarray | None = None,
    max_bytes: int | None = None,
) -> list[tuple[int, int, int]]:
    """Row chunks ``(start, stop, cols)`` covering rows [0, num_rows) in order.

    cols is None for a chunk whose rows all see at most k entries (nothing to score: they select every visible
    entry), i.e. every row when ``max_entries <= k``, and with ``n_visible_host`` (one host int a row, the entries that
    row sees) each maximal run of such rows.  Otherwise cols is ``max_entries`` without ``n_visible_host``, and with it
    the chunk's largest count rounded up to ``COL_ALIGN`` and capped at ``max_entries``; such a chunk holds as many
    rows as keep ``rows * chunk_row_bytes(cols, k) <= max_bytes`` (None: ``MAX_SCRATCH_BYTES``), and at least one.
    """
    max_bytes = MAX_SCRATCH_BYTES if max_bytes is None else max_bytes
    for name, v in (("num_rows", num_rows), ("max_entries", max_entries), ("k", k), ("max_bytes", max_bytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name in ("k", "max_bytes") else 0):
            raise ValueError(f"{name}: expected a host int >= {int(name in ('k', 'max_bytes'))}, got {v!r}")
    if n_visible_host is None or max_entries <= k:
        if n_visible_host is not None:
            _check_host_counts(n_visible_host, num_rows, max_entries)
        if max_entries <= k:
            return [(0, num_rows, None)] if num_rows else []
        per = chunk_row_bytes(max_entries, k)
        step = max(1, max_bytes // per)
        return [(a, min(a + step, num_rows), max_entries) for a in range(0, num_rows, step)]
    nv = _check_host_counts(n_visible_host, num_rows, max_entries)
    align = COL_ALIGN
    cols_of = np.minimum(-(-nv // align) * align, max_entries)  # per row, rounded up
    table = _row_bytes_table(max_entries, k, align)  # bytes a row of a chunk of cols c: table[ceil(c / align)]
    easy = nv <= k
    cuts = [0, *(np.flatnonzero(easy[1:] != easy[:-1]) + 1).tolist(), num_rows]  # runs of equal ``easy``
    out = []
    for a, end in zip(cuts[:-1], cuts[1:], strict=True):
        if a == end:
            continue
        if easy[a]:
            out.append((a, end, None))
            continue
        while a < end:
            # cols of a chunk [a, b) = running max from a: non-decreasing, so a row bound from cols_of[a] holds
            span = min(end - a, max(1, max_bytes // int(table[-(-cols_of[a] // align)])))
            run = np.maximum.accumulate(cols_of[a : a + span])
            need = np.arange(1, span + 1, dtype=np.int64) * table[-(-run // align)]
            over = np.flatnonzero(need > max_bytes)
            n = max(1, int(over[0]) if len(over) else span)
            out.append((a, a + n, int(run[n - 1])))
            a += n
    return out


def _check_host_counts(n_visible_host, num_rows: int, max_entries: int) -> np.ndarray:
    nv = np.asarray(n_visible_host, dtype=np.int64)
    if nv.shape != (num_rows,):
        raise ValueError(f"n_visible_host: expected {num_rows} host ints, got shape {list(nv.shape)}")
    if num_rows and (nv.min() < 0 or nv.max() > max_entries):
        raise ValueError(f"n_visible_host: expected values in [0, {max_entries}], got [{nv.min()}, {nv.max()}]")
    return nv


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: KeyPages,
    block_table: torch.Tensor,
    token_row: torch.Tensor,
    n_visible: torch.Tensor,
    max_entries: int,
    k: int,
    backend: str = "auto",
    *,
    n_visible_host: Sequence[int] | np.ndarray | None = None,
    token_row_host: Sequence[int] | np.ndarray | None = None,
    shared_keys: bool | None = None,
    max_bytes: int | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """``topk_indices(indexer_scores(...), k, n_visible)`` of every query row, computed over ``row_chunks``.

    Args:
        q, weights, keys, block_table, token_row, n_visible, max_entries, backend: as ``indexer_scores``
            (q [T, Hi, 128] bf16, weights [T, Hi] fp32, n_visible [T] int32 in [0, max_entries]).
        k: host int >= 1, entries selected a row.
        n_visible_host: optional, T host ints equal to ``n_visible`` (e.g. ``StepPlan.host_n_visible``):
            lets each chunk score only the columns its rows can see, and rows that see at most k entries skip
            scoring (``row_chunks``).  A chunk clamps its rows' ``n_visible`` to its column count (k for rows
            that skip), so a host count below the device one can only drop entries, never read or write out of
            bounds.  Leave it None inside a CUDA-graph capture (the chunking must not depend on a step's values).
        token_row_host: optional, T host ints equal to ``token_row`` (e.g. ``StepPlan.host_request_ids``); with
            ``n_visible_host`` and ``shared_keys``, a chunk's runs of >= ``SHARED_MIN_ROWS`` rows of one request are
            scored by ``prefill_scores`` against that request's keys folded once (``fold_keys``; on the Triton
            path only): gluon_fold's numerics, not bit-equal to ``indexer_scores``.  A request's folded keys (132
            bytes an entry of its widest chunk) live from its first chunk to its last, outside ``max_bytes``.
        shared_keys: use ``token_row_host`` so (None: ``PREFILL_SHARED_KEYS``).
        max_bytes: bound on one chunk's scores + top-k workspace (``chunk_row_bytes``; None:
            ``MAX_SCRATCH_BYTES``); a single row above it still runs, as a chunk of one.
        counters: ``topk_indices``'s (its launches A and B as one where they hold a chunk's rows).

    Returns:
        [T, k] int32 logical entry indices, ascending, -1 padded (as ``topk_indices``).  One difference, on invalid
        input only: a row that sees at most k entries selects them all, where ``topk_indices`` would leave out
        entries whose score is NaN or -inf (a visible entry on page -1, a non-finite query).
    """
    T, _ = _check_common(q, weights, block_table, token_row, n_visible, max_entries)
    chunks = row_chunks(T, max_entries, k, n_visible_host, max_bytes)
    shared = PREFILL_SHARED_KEYS if shared_keys is None else shared_keys
    runs = {}
    if shared and token_row_host is not None and n_visible_host is not None:
        tr = np.asarray(token_row_host, dtype=np.int64)
        if tr.shape != (T,) or (T and (tr.min() < 0 or tr.max() >= block_table.shape[0])):
            raise ValueError(
                f"token_row_host: expected {T} host ints in [0, {block_table.shape[0]}), got shape {list(tr.shape)}"
            )
        if use_triton(backend, q, weights, keys.data, keys.scale, block_table) and q.shape[1] <= 256:
            runs = _shared_runs(tr, chunks)  # (prefill_scores holds up to 256 heads a program)
    if len(chunks) == 1 and chunks[0][2] == max_entries and not runs:  # the plain two calls (decode steps)
        scores = indexer_scores(q, weights, keys, block_table, token_row, n_visible, max_entries, backend)
        return topk_indices(scores, k, n_visible, backend, counters=counters)
    if len(chunks) == 1 and chunks[0][2] is None:  # every row sees at most k entries
        return visible_logical(n_visible.clamp(max=min(k, max_entries)), k)
    folded: dict[int, FoldedKeys] = {}  # table row -> its folded keys, from its first chunk to its last
    last = {row: a for a, v in runs.items() for _, _, row, _ in v if row is not None}  # (chunks in order)
    out = torch.empty((T, k), dtype=torch.int32, device=q.device)
    for a, b, cols in chunks:
        if cols is None:
            out[a:b] = visible_logical(n_visible[a:b].clamp(max=min(k, max_entries)), k)
            continue
        nv = n_visible[a:b] if cols == max_entries else n_visible[a:b].clamp(max=cols)
        mine = runs.get(a, [])
        if not mine:
            scores = indexer_scores(q[a:b], weights[a:b], keys, block_table, token_row[a:b], nv, cols, backend)
        else:
            scores = torch.empty((b - a, cols), dtype=torch.float32, device=q.device)
            for r0, r1, row, n_fold in mine:
                if row is None:  # rows of a short run: their own programs
                    scores[r0:r1] = indexer_scores(
                        q[a + r0 : a + r1], weights[a + r0 : a + r1], keys, block_table, token_row[a + r0 : a + r1],
                        nv[r0:r1], cols, backend,
                    )  # fmt: skip
                    continue
                if row not in folded:
                    folded[row] = fold_keys(keys, block_table, row, n_fold, backend)
                sl = slice(a + r0, a + r1)
                prefill_scores(q[sl], weights[sl], folded[row], nv[r0:r1], cols, backend, out=scores[r0:r1])
        out[a:b] = topk_indices(scores, k, nv, backend, counters=counters)
        del scores  # free before the next chunk allocates its own
        for row in [r for r, at in last.items() if at == a]:
            folded.pop(row, None)  # (a batch of long prefills holds one request's folded keys at a time)
    return out


def _shared_runs(token_row_host: np.ndarray, chunks) -> dict[int, list[tuple[int, int, int | None, int]]]:
    """Per scored chunk (keyed by its start) that has a run of >= ``SHARED_MIN_ROWS`` rows of one block-table row:
    its runs ``(r0, r1, row, n_fold)`` relative to the chunk, ``row`` None for the rows of short runs (scored by
    ``indexer_scores``), ``n_fold`` the entries to fold for ``row``: the largest column count of the chunks that
    score it (one ``fold_keys`` a request serves all of them)."""
    tr = token_row_host
    per_chunk, n_fold = {}, {}
    for a, b, cols in chunks:
        if cols is None:
            continue
        cuts = [0, *(np.flatnonzero(tr[a + 1 : b] != tr[a : b - 1]) + 1).tolist(), b - a]
        runs = [(r0, r1, int(tr[a + r0])) for r0, r1 in zip(cuts[:-1], cuts[1:], strict=True)]
        if not any(r1 - r0 >= SHARED_MIN_ROWS for r0, r1, _ in runs):
            continue
        per_chunk[a] = [(r0, r1, row if r1 - r0 >= SHARED_MIN_ROWS else None) for r0, r1, row in runs]
        for _, _, row in per_chunk[a]:
            if row is not None:
                n_fold[row] = max(n_fold.get(row, 0), cols)
    return {a: [(r0, r1, row, n_fold.get(row, 0)) for r0, r1, row in v] for a, v in per_chunk.items()}
