"""Indexer selection over row chunks (``kernels.indexer.select``): the same indices as one scores + top-k call,
chunks that respect their memory bound, and only as many columns as their rows see."""

import numpy as np
import pytest
import torch

from dsv4.kernels.indexer import indexer_scores, indexer_topk, row_chunks, topk_indices
from dsv4.kernels.indexer import select as select_mod
from dsv4.kernels.indexer.select import chunk_row_bytes
from dsv4.kernels.indexer.topk import topk_scratch_cols, topk_workspace
from tests.kernels.test_indexer_scores import FMT, make_keys, make_query


def check_chunks(chunks, num_rows, max_entries, k, nv, max_bytes, align):
    """Contiguous cover of [0, num_rows); rows that see <= k entries in chunks of no scoring (cols None), maximal
    runs of them; the other chunks under the bound (or one row), as wide as their rows need."""
    assert [a for a, _, _ in chunks] == [0] + [b for _, b, _ in chunks[:-1]]
    assert (chunks[-1][1] if chunks else 0) == num_rows
    easy = np.ones(num_rows, bool) if max_entries <= k else None if nv is None else nv <= k
    for i, (a, b, cols) in enumerate(chunks):
        assert b > a
        if cols is None:
            assert easy is not None and easy[a:b].all()
            if i + 1 < len(chunks):  # a maximal run: the next chunk starts with a row to score
                assert not easy[b]
            continue
        assert (easy is None or not easy[a:b].any()) and 0 <= cols <= max_entries
        assert (b - a) * chunk_row_bytes(cols, k) <= max_bytes or b - a == 1
        if nv is None:
            assert cols == max_entries
        else:
            top = int(np.max(nv[a:b]))
            assert cols >= top and (cols == max_entries or cols == -(-top // align) * align)


@pytest.mark.parametrize("seed", range(6))
def test_row_chunks_bound_cover_and_width(seed):
    rng = np.random.default_rng(seed)
    n, max_entries = int(rng.integers(1, 400)), int(rng.integers(0, 5000))
    k = int(rng.integers(1, 600)) if seed != 5 else max_entries + 1  # (seed 5: every row sees <= k)
    # a prefill from 0 (non-decreasing counts) followed by a few decode-like rows
    nv = np.minimum(np.sort(rng.integers(0, max_entries + 1, n)), max_entries)
    nv[-3:] = rng.integers(0, max_entries + 1, min(3, n))
    budget = int(rng.integers(1, 40)) * chunk_row_bytes(max_entries, k) // 7 + 1
    for host in (None, nv):
        chunks = row_chunks(n, max_entries, k, host, budget)
        check_chunks(chunks, n, max_entries, k, host, budget, select_mod.COL_ALIGN)
    # greedy: no chunk could have taken its successor's first row (within a run of rows to score)
    for (a, b, cols), (_, _, nxt) in zip(chunks, chunks[1:], strict=False):
        if cols is None or nxt is None:
            continue
        wider = max(cols, min(-(-int(nv[b]) // select_mod.COL_ALIGN) * select_mod.COL_ALIGN, max_entries))
        assert (b + 1 - a) * chunk_row_bytes(wider, k) > budget


def test_row_chunks_prefill_from_zero_narrows_early_chunks():
    pos = np.arange(65536)
    nv = (pos + 1) // 4
    chunks = row_chunks(len(nv), 16384, 512, nv)
    check_chunks(chunks, len(nv), 16384, 512, nv, select_mod.MAX_SCRATCH_BYTES, select_mod.COL_ALIGN)
    assert chunks[0] == (0, 4 * 513 - 1, None)  # positions 0 .. 2,050 see <= 512 entries: nothing to score
    assert chunks[1][2] <= 16384 / 4 and chunks[-1][2] == 16384
    assert chunks[1][1] - chunks[1][0] > chunks[-1][1] - chunks[-1][0]
    # the causal triangle: about half of the [T, N] cells are scored and selected from
    assert sum((b - a) * c for a, b, c in chunks if c is not None) < 0.6 * len(nv) * 16384
    # a whole-step call would hold ~19 GB here
    assert len(nv) * chunk_row_bytes(16384, 512) > 30 * select_mod.MAX_SCRATCH_BYTES


def test_row_chunks_validation():
    with pytest.raises(ValueError, match="n_visible_host: expected 3 host ints"):
        row_chunks(3, 10, 2, [1, 2])
    with pytest.raises(ValueError, match=r"expected values in \[0, 10\]"):
        row_chunks(3, 10, 2, [1, 2, 11])
    with pytest.raises(ValueError, match="k: expected a host int >= 1"):
        row_chunks(3, 10, 0)
    with pytest.raises(ValueError, match="max_bytes"):
        row_chunks(3, 10, 2, max_bytes=0)
    assert row_chunks(0, 10, 2, []) == [] and row_chunks(0, 10, 2) == []


@pytest.mark.parametrize("rows, N", [(2, 1), (2, 100), (2, 4096), (2, 4097), (2, 20000), (256, 100), (256, 1)])
def test_scratch_cols_is_what_topk_allocates(rows, N):
    """topk_indices accepts a workspace of exactly topk_scratch_cols(N, rows) columns (and refuses one fewer): few
    short rows take the single-program kernel, many (a prefill chunk's) the filter path; without rows the bound
    covers both."""
    cols = topk_scratch_cols(N, rows)
    assert cols <= topk_scratch_cols(N)
    scores, ws = _on("triton", torch.randn(rows, N), topk_workspace(rows, N)[:, :cols].contiguous())
    want = topk_indices(scores.cpu(), 4, backend="torch")
    assert torch.equal(topk_indices(scores, 4, backend="triton", workspace=ws).cpu(), want)
    with pytest.raises(ValueError, match="workspace"):
        topk_indices(scores, 4, backend="triton", workspace=ws[:, :-1].contiguous())


def _on(backend, *ts):
    """The tensors where ``backend`` runs here: the Triton kernels on CUDA when this machine has it (else the
    interpreter, on the CPU)."""
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    return [t.to(dev) if isinstance(t, torch.Tensor) else type(t)(*(x.to(dev) for x in t)) for t in ts]


def _step(T, H, max_entries, gen, backend="torch"):
    """Three requests over pages of 16 entries: a prefill from 0, a continued prefill, a short one (tensors where
    ``backend`` runs; the last item: the host counts)."""
    bs = 16
    kp = make_keys(24, bs, gen=gen)
    width = max_entries // bs
    perm = torch.randperm(24, generator=gen)[: 3 * width].view(3, width).to(torch.int32)
    lens = [T // 2, T // 3, T - T // 2 - T // 3]
    starts = [0, 4 * max_entries - 4 * lens[1] - 8, 37]
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
    nv = np.minimum((pos + 1) // 4, max_entries)
    tr = np.repeat(np.arange(3), lens)
    q, w = make_query(T, H, gen)
    i32 = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int32)  # noqa: E731
    return *_on(backend, q, w, kp, perm, i32(tr), i32(nv)), nv


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("host", [True, False])
def test_chunks_give_the_one_call_indices(monkeypatch, backend, host):
    monkeypatch.setattr(select_mod, "COL_ALIGN", 16)
    g = torch.Generator().manual_seed(7)
    T, N, k = 40, 96, 6
    q, w, kp, bt, tr, nv, nv_host = _step(T, 4, N, g, backend)
    want = topk_indices(indexer_scores(q, w, kp, bt, tr, nv, N, backend), k, nv, backend)
    shapes = []
    real_scores = select_mod.indexer_scores

    def spy(q_, *args):
        out = real_scores(q_, *args)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(select_mod, "indexer_scores", spy)
    budget = 7 * chunk_row_bytes(N, k)
    got = indexer_topk(q, w, kp, bt, tr, nv, N, k, backend, n_visible_host=nv_host if host else None, max_bytes=budget)
    assert torch.equal(got, want)
    chunks = row_chunks(T, N, k, nv_host if host else None, budget)
    assert shapes == [(b - a, cols) for a, b, cols in chunks if cols is not None] and len(shapes) > 1
    assert all(rows * chunk_row_bytes(cols, k) <= budget for rows, cols in shapes)
    if host:  # the prefill from 0: its rows that see <= k entries are not scored, the next ones in narrower chunks
        assert sum(rows for rows, _ in shapes) == int((nv_host > k).sum()) < T
        assert min(cols for _, cols in shapes) < N


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_row_chunks_and_rows_that_see_at_most_k(monkeypatch, backend):
    """max_bytes = 1: a chunk a row, except the run of rows that see <= k entries (incl. none): one chunk, unscored."""
    monkeypatch.setattr(select_mod, "COL_ALIGN", 16)
    g = torch.Generator().manual_seed(3)
    q, w, kp, bt, tr, nv, nv_host = _step(12, 4, 96, g, backend)
    chunks = row_chunks(12, 96, 8, nv_host, 1)
    assert [(b - a, c is None) for a, b, c in chunks] == [(6, True)] + [(1, False)] * 6
    want = topk_indices(indexer_scores(q, w, kp, bt, tr, nv, 96, backend), 8, nv, backend)
    got = indexer_topk(q, w, kp, bt, tr, nv, 96, 8, backend, n_visible_host=nv_host, max_bytes=1)
    assert torch.equal(got, want) and (got[0] == -1).all()


@pytest.mark.parametrize("host", [True, False])
def test_rows_that_see_at_most_k_are_not_scored(monkeypatch, host):
    """Every row sees <= k entries (max_entries <= k, or the host counts say so): no scores, the one call's indices."""
    g = torch.Generator().manual_seed(9)
    q, w, kp, bt, tr, nv, nv_host = _step(20, 4, 96, g)
    want = topk_indices(indexer_scores(q, w, kp, bt, tr, nv, 96, "torch"), 96, nv, "torch")
    monkeypatch.setattr(select_mod, "indexer_scores", lambda *a: pytest.fail("scored"))
    got = indexer_topk(q, w, kp, bt, tr, nv, 96, 96, "torch", n_visible_host=nv_host if host else None)
    assert torch.equal(got, want)
    if host:  # k below max_entries, but no row sees more than k
        k = int(nv_host.max())
        want = topk_indices(indexer_scores(q, w, kp, bt, tr, nv, 96, "torch"), k, nv, "torch")
        assert torch.equal(indexer_topk(q, w, kp, bt, tr, nv, 96, k, "torch", n_visible_host=nv_host), want)


def test_host_count_below_device_count_only_drops_entries(monkeypatch):
    """A host count that understates n_visible: the chunk clamps, nothing past its columns is read or chosen."""
    monkeypatch.setattr(select_mod, "COL_ALIGN", 16)
    g = torch.Generator().manual_seed(3)
    T, N, k = 12, 96, 8
    q, w, kp, bt, tr, nv, nv_host = _step(T, 4, N, g)
    low = np.minimum(nv_host, 16)
    got = indexer_topk(q, w, kp, bt, tr, nv, N, k, "torch", n_visible_host=low, max_bytes=1)
    chunks = row_chunks(T, N, k, low, 1)
    assert {c for _, _, c in chunks} == {None, 16}  # rows to score (1-row chunks of 16 columns) and rows not to
    bound = torch.tensor([k if c is None else c for a, b, c in chunks for _ in range(a, b)], dtype=torch.int32)
    clamped = torch.minimum(nv, bound)  # a row not scored takes its first k entries (host count <= k)
    want = topk_indices(indexer_scores(q, w, kp, bt, tr, clamped, N, "torch"), k, clamped, "torch")
    assert torch.equal(got, want) and (clamped < nv).any()


def test_single_chunk_is_the_plain_call_and_validation(monkeypatch):
    g = torch.Generator().manual_seed(5)
    q, w, kp, bt, tr, nv, nv_host = _step(10, 4, 64, g)
    calls = []
    monkeypatch.setattr(select_mod, "indexer_scores", lambda *a: calls.append(a[6]) or indexer_scores(*a))
    out = indexer_topk(q, w, kp, bt, tr, nv, 64, 3, "torch")
    assert calls == [64] and out.shape == (10, 3)
    with pytest.raises(ValueError, match="weights"):
        indexer_topk(q, w[:-1], kp, bt, tr, nv, 64, 3, "torch")
    with pytest.raises(ValueError, match="n_visible_host: expected 10 host ints"):
        indexer_topk(q, w, kp, bt, tr, nv, 64, 3, "torch", n_visible_host=nv_host[:-1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shared_keys_runs_give_the_one_call_indices(monkeypatch, backend):
    """With token_row_host and shared_keys: runs of >= SHARED_MIN_ROWS rows of one request are scored by
    prefill_scores over that request's keys folded once, shorter runs by indexer_scores, chunks split inside a
    request; the indices are the one call's (keys without far blocks: the folded keys are the keys).  The torch
    backend never takes the shared path (no Triton)."""
    monkeypatch.setattr(select_mod, "COL_ALIGN", 16)
    monkeypatch.setattr(select_mod, "SHARED_MIN_ROWS", 5)
    g = torch.Generator().manual_seed(11)
    T, N, k = 40, 96, 6
    q, w, kp, bt, tr, nv, nv_host = _step(T, 64, N, g, backend)
    want = topk_indices(indexer_scores(q, w, kp, bt, tr, nv, N, backend), k, nv, backend)
    calls = {"fold": [], "prefill": [], "indexer": []}
    real = (select_mod.fold_keys, select_mod.prefill_scores, select_mod.indexer_scores)

    def fold(keys, bt_, row, n, *a):
        calls["fold"].append((row, n))
        return real[0](keys, bt_, row, n, *a)

    def pre(q_, *a, **kw):
        calls["prefill"].append(q_.shape[0])
        return real[1](q_, *a, **kw)

    def ind(q_, *a):
        calls["indexer"].append(q_.shape[0])
        return real[2](q_, *a)

    monkeypatch.setattr(select_mod, "fold_keys", fold)
    monkeypatch.setattr(select_mod, "prefill_scores", pre)
    monkeypatch.setattr(select_mod, "indexer_scores", ind)
    tr_host = tr.cpu().numpy()
    budget = 9 * chunk_row_bytes(N, k)
    got = indexer_topk(q, w, kp, bt, tr, nv, N, k, backend, n_visible_host=nv_host, token_row_host=tr_host,
                       shared_keys=True, max_bytes=budget)  # fmt: skip
    assert torch.equal(got, want)
    if backend == "torch":
        assert not calls["fold"] and not calls["prefill"]
        return
    scored = sum(b - a for a, b, c in row_chunks(T, N, k, nv_host, budget) if c is not None)
    assert calls["prefill"] and sum(calls["prefill"]) + sum(calls["indexer"]) == scored
    assert all(n < 5 for n in calls["indexer"]) and min(calls["prefill"]) >= 5
    rows = [r for r, _ in calls["fold"]]
    assert len(rows) == len(set(rows))  # one fold a request
    with pytest.raises(ValueError, match="token_row_host"):
        indexer_topk(q, w, kp, bt, tr, nv, N, k, backend, n_visible_host=nv_host, token_row_host=tr_host[:-1],
                     shared_keys=True)  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_shared_keys_random_batches(monkeypatch, seed):
    """Random prefill batches (1-4 requests of random lengths and starts, random chunk budgets, random run minimum):
    the shared-keys selection gives the one call's indices (keys without far blocks), and every fold serves one
    request."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(select_mod, "COL_ALIGN", 16)
    monkeypatch.setattr(select_mod, "SHARED_MIN_ROWS", int(rng.integers(2, 5)))
    g = torch.Generator().manual_seed(100 + seed)
    bs, N, k = 16, 96, int(rng.integers(2, 9))
    n_req = int(rng.integers(1, 5))
    lens = rng.integers(1, 24, n_req)
    starts = [int(rng.integers(0, 4 * N - int(n) + 1)) for n in lens]
    kp = make_keys(6 * n_req + 1, bs, gen=g)
    bt = torch.randperm(6 * n_req + 1, generator=g)[: 6 * n_req].view(n_req, 6).to(torch.int32)
    pos = np.concatenate([np.arange(s0, s0 + n) for s0, n in zip(starts, lens, strict=True)])
    nv_host = np.minimum((pos + 1) // 4, N)
    tr_host = np.repeat(np.arange(n_req), lens)
    T = len(pos)
    q, w = make_query(T, 64, g)
    i32 = lambda a: torch.as_tensor(np.asarray(a), dtype=torch.int32)  # noqa: E731
    q, w, kp, bt, tr, nv = _on("triton", q, w, kp, bt, i32(tr_host), i32(nv_host))
    want = topk_indices(indexer_scores(q, w, kp, bt, tr, nv, N, "triton"), k, nv, "triton")
    folds = []
    real = select_mod.fold_keys
    monkeypatch.setattr(
        select_mod, "fold_keys", lambda kp_, bt_, row, n, *a: folds.append(row) or real(kp_, bt_, row, n, *a)
    )
    budget = int(rng.integers(2, 12)) * chunk_row_bytes(N, k)
    got = indexer_topk(q, w, kp, bt, tr, nv, N, k, "triton", n_visible_host=nv_host, token_row_host=tr_host,
                       shared_keys=True, max_bytes=budget)  # fmt: skip
    assert torch.equal(got, want)
    assert len(folds) == len(set(folds))
    runs = select_mod._shared_runs(tr_host, row_chunks(T, N, k, nv_host, budget))
    assert set(folds) == {row for v in runs.values() for _, _, row, _ in v if row is not None}


def test_shared_runs_fold_width_covers_every_chunk(monkeypatch):
    """_shared_runs: a request split over chunks folds the widest of their column counts; short runs get None; a
    chunk without a long run (or not scored) is left to indexer_scores."""
    monkeypatch.setattr(select_mod, "SHARED_MIN_ROWS", 40)
    tr = np.array([0] * 100 + [1] * 3 + [2] * 200 + [3] * 10)
    chunks = [(0, 50, 256), (50, 120, 512), (120, 303, 768), (303, 313, 768), (313, 313, None)]
    runs = select_mod._shared_runs(tr, chunks)
    assert runs == {
        0: [(0, 50, 0, 512)],
        50: [(0, 50, 0, 512), (50, 53, None, 0), (53, 70, None, 0)],
        120: [(0, 183, 2, 768)],
    }


def _gpu_problem(T, n, seed, H=64, bs=64):
    """One request of n random MXFP4 keys in shuffled pages of bs on the GPU, T query rows of H heads:
    (generator, q, weights, keys, block table, token rows)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    kp = make_keys(n // bs, bs, gen=None, device=dev)
    kp.data.copy_(torch.randint(0, 256, kp.data.shape, device=dev, dtype=torch.uint8, generator=g))
    kp.scale.copy_(torch.randint(122, 127, kp.scale.shape, device=dev, dtype=torch.uint8, generator=g))
    bt = torch.randperm(n // bs, device=dev, generator=g).to(torch.int32)[None]
    q = FMT.roundtrip(torch.randn(T, H, 128, device=dev, generator=g), dtype=torch.bfloat16)
    w = torch.rand(T, H, device=dev, generator=g) * (128**-0.5 * H**-0.5)
    return g, q, w, kp, bt, torch.zeros(T, dtype=torch.int32, device=dev)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_selection_equal_and_memory_bounded():
    """2,048 rows of a prefill against 65,536 entries (a 256K-token context; pages of 64, 64 heads): the row
    chunks give the one call's indices, and hold at most the chunk bound plus the result and the Gluon kernel's
    per-call inputs (query copy, key scale words) at once, against ~1.9 GB for the one call."""
    T, n, k = 2048, 65536, 512
    g, q, w, kp, bt, tr = _gpu_problem(T, n, seed=0)
    dev = q.device
    nv = ((torch.arange(4 * n - T, 4 * n, device=dev) + 1) // 4).to(torch.int32)
    want = topk_indices(indexer_scores(q, w, kp, bt, tr, nv, n), k, nv)
    budget = 128 << 20
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = indexer_topk(q, w, kp, bt, tr, nv, n, k, n_visible_host=nv.cpu().numpy(), max_bytes=budget)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert torch.equal(got, want)
    assert len(row_chunks(T, n, k, nv.cpu().numpy(), budget)) > 8
    slack = 2 * T * k * 4 + q.numel() * 2 + kp.scale.numel() * 4 + (4 << 20)
    assert peak <= budget + slack, (peak, budget, slack)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_shared_keys_selects_the_top_scores():
    """2,048 prefill rows of one request against 65,536 entries, shared keys on: each row's selection is a top k
    of the exact scores up to the fold path's error (its smallest selected exact score is at least the k-th
    largest minus 1e-4 of the row's largest), and it equals the default path's on all but near-tied entries."""
    T, n, k = 2048, 65536, 512
    g, q, w, kp, bt, tr = _gpu_problem(T, n, seed=1)
    dev = q.device
    nv = ((torch.arange(4 * n - T, 4 * n, device=dev) + 1) // 4).to(torch.int32)
    nv_host = nv.cpu().numpy()
    ref = indexer_scores(q, w, kp, bt, tr, nv, n, impl="fp8mma")  # exact
    got = indexer_topk(q, w, kp, bt, tr, nv, n, k, n_visible_host=nv_host, token_row_host=np.zeros(T, np.int64),
                       shared_keys=True, max_bytes=128 << 20)  # fmt: skip
    base = indexer_topk(q, w, kp, bt, tr, nv, n, k, n_visible_host=nv_host, shared_keys=False, max_bytes=128 << 20)
    assert (got >= 0).all()
    picked = ref.gather(1, got.long()).amin(dim=1)
    kth = ref.topk(k, dim=1).values[:, -1]
    top = ref.amax(dim=1)
    assert (picked >= kth - 1e-4 * top.abs()).all()
    same = torch.tensor([len(set(a) & set(b)) for a, b in zip(got.tolist(), base.tolist(), strict=True)])
    print(f"shared keys vs default: {same.float().mean().item() / k:.5f} of the selections agree")
    assert same.float().mean().item() >= 0.99 * k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_rows_in_several_chunks_capture_and_replay():
    """Decode-shaped rows (no host counts) split into several static chunks by a small bound: the call captures in a
    CUDA graph, and replays give the eager indices after the query and the counts change in place."""
    from dsv4.engine.graphs import capture_graph

    T, n, k = 16, 8192, 512
    g, q, w, kp, bt, tr = _gpu_problem(T, n, seed=1)
    dev, H = q.device, q.shape[1]
    nv = torch.randint(0, n + 1, (T,), device=dev, generator=g).to(torch.int32)
    budget = 5 * chunk_row_bytes(n, k)
    assert len(row_chunks(T, n, k, None, budget)) == 4

    def call():
        return indexer_topk(q, w, kp, bt, tr, nv, n, k, max_bytes=budget)

    graph, out = capture_graph(call)
    for _ in range(2):
        q.copy_(FMT.roundtrip(torch.randn(T, H, 128, device=dev, generator=g), dtype=torch.bfloat16))
        nv.copy_(torch.randint(0, n + 1, (T,), device=dev, generator=g).to(torch.int32))
        graph.replay()
        want = topk_indices(indexer_scores(q, w, kp, bt, tr, nv, n), k, nv)
        assert torch.equal(out, want)
