"""Top-k of indexer scores (Triton kernels vs stable-sort reference) and to_physical.

Every Triton case of ``run_both`` runs the three paths: ``splits=1`` (one program per row), the default
group-max filter path (several programs per row in launches A and C, candidates listed per chunk in index
order, copied to one dense list, in-register exact selection or the whole-row fallback) and the 4-launch
radix split path (atomics into per-row histograms, zero-on-exit workspace) at small sizes, so chunk
boundaries, the tie rule across chunks and the workspace contracts are exercised under the interpreter.
The ``filter`` tests pin which tier of launch D a row takes (from the per-chunk candidate counts).  The
output is the chosen set in ascending index order.  ``_kth_largest`` (the radix search of launches B and
D) is tested on its own against a sort.
"""

import pytest
import torch
import triton
import triton.language as tl

from dsv4.kernels.indexer import to_physical, topk_indices, topk_indices_reference, visible_logical, visible_physical
from dsv4.kernels.indexer import topk as topk_mod
from dsv4.kernels.indexer.topk import to_physical_reference, topk_workspace

NEG_INF = float("-inf")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def check_contract(idx, scores, k, n_visible):
    """Properties that hold without any reference: selection, padding, ascending index order, tie-break."""
    T, N = scores.shape
    for t in range(T):
        nv = N if n_visible is None else int(n_visible[t])
        s = scores[t, :nv]
        sel = s[~(torch.isneginf(s) | torch.isnan(s))]
        kk = min(k, sel.numel())
        row = idx[t]
        assert (row[kk:] == -1).all() and (row[:kk] >= 0).all() and (row[:kk] < nv).all()
        chosen = row[:kk].long()
        assert chosen.unique().numel() == kk
        vals = scores[t, chosen]
        assert (chosen[1:] > chosen[:-1]).all()  # ascending index order
        if kk:
            # nothing left out beats the smallest chosen (ties: a left-out equal one has a larger index)
            thr = vals.min()
            last = chosen[vals == thr].max()
            mask = torch.ones(nv, dtype=torch.bool)
            mask[chosen] = False
            rest = scores[t, :nv][mask]
            rest_idx = torch.arange(nv)[mask]
            assert not (rest > thr).any()
            assert not ((rest == thr) & (rest_idx < last)).any()


def run_both(scores, k, nv=None, splits=(1, 4)):
    """Reference vs Triton: the default method for every split count (1: single program; >= 2: the
    group-max filter path), the radix split path for the smallest split count >= 2, and the filter path with one
    split (a prefill chunk's auto choice: launch D reads the one region in place)."""
    b = topk_indices(scores, k, nv, backend="torch")
    check_contract(b, scores, k, nv)
    runs = [(sp, "auto") for sp in splits] + [(min(sp for sp in splits if sp > 1), "radix")] * (max(splits) > 1)
    runs += [(1, "filter")] * (1 in splits)
    for sp, method in runs:
        a = topk_indices(scores, k, nv, backend="triton", splits=sp, method=method)
        assert a.dtype == torch.int32 and a.shape == (scores.shape[0], k)
        assert torch.equal(a, b), f"splits={sp} method={method}"
    return b


@pytest.mark.parametrize("N,k", [(300, 32), (64, 16), (257, 1)])
def test_random_rows(N, k):
    g = torch.Generator().manual_seed(N + k)
    run_both(torch.randn(4, N, generator=g), k)


def test_duplicates_and_ties_lower_index_wins():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(-3, 4, (4, 300), generator=g).float()  # only 7 distinct values
    s[1] = 1.0  # whole row tied
    idx = run_both(s, 32)
    assert torch.equal(idx[1], torch.arange(32, dtype=torch.int32))


def test_boundary_ties_before_larger_values():
    """Ties at the threshold come before (in index order) larger values: exactly `need` of them are taken."""
    s = torch.tensor([[1.0, 1.0, 1.0, 5.0, 1.0, 4.0], [2.0, 2.0, 2.0, 2.0, 2.0, 9.0]])
    idx = run_both(s, 3)
    assert idx.tolist() == [[0, 3, 5], [0, 1, 5]]


def test_signed_zero_is_one_value():
    s = torch.tensor([[-0.0, 0.0, -1.0, -0.0, 0.0, -2.0] + [NEG_INF] * 10])
    idx = run_both(s, 3)
    assert idx[0].tolist() == [0, 1, 3]


def test_fewer_visible_than_k_and_inf_and_nan():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 200, generator=g)
    s[0, ::3] = NEG_INF
    s[2, 7] = float("nan")
    s[2, 9] = float("inf")
    nv = torch.tensor([200, 10, 150, 0], dtype=torch.int32)
    idx = run_both(s, 32, nv)
    assert (idx[1, 10:] == -1).all() and (idx[1, :10] >= 0).all()
    assert (idx[3] == -1).all()
    assert 9 in idx[2].tolist() and 7 not in idx[2].tolist()


def test_all_minus_inf():
    s = torch.full((2, 100), NEG_INF)
    assert (run_both(s, 16) == -1).all()


def test_k_equals_n_and_k_above_n():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(3, 48, generator=g)
    idx = run_both(s, 48)
    assert torch.equal(idx, torch.arange(48, dtype=torch.int32).expand(3, 48))
    idx = run_both(s, 64)
    assert (idx[:, 48:] == -1).all()


def test_large_row_matches_torch_topk_set():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 4096, generator=g)
    nv = torch.tensor([4096, 3000], dtype=torch.int32)
    idx = run_both(s, 256, nv)
    want = torch.topk(s[0], 256).indices.sort().values
    assert torch.equal(idx[0].long(), want)  # distinct values: same set as torch.topk


@pytest.mark.parametrize("splits", [1, 3])
def test_workspace_passed_in_and_candidate_heavy_rows(splits):
    """Every element shares the top 16 key bits: all are candidates (many list blocks), with ties."""
    g = torch.Generator().manual_seed(5)
    s = torch.rand(3, 1500, generator=g) * 1e-3 + 1.0
    s[1, 700:] = 1.0  # many exact ties inside the candidate bucket, spread over two splits
    s[2, ::2] = 1.0005  # ties among the largest values too
    ws = torch.randint(-(2**31), 2**31 - 1, (4, topk_mod._workspace_cols(1500, False)), generator=g, dtype=torch.int32)
    ws[:, :256] = 0  # except the row histograms: zero on entry (as from topk_workspace)
    for _ in range(2):  # the call leaves them zero: a second call on the same buffer is right too
        a = topk_indices(s, 40, backend="triton", workspace=ws, splits=splits, method="radix")
        assert torch.equal(a, topk_indices_reference(s, 40))
        assert (ws[:, :256] == 0).all()
    check_contract(a, s, 40, None)
    with pytest.raises(ValueError, match="workspace"):
        topk_indices(s, 40, backend="triton", workspace=ws[:, :100], splits=splits)


@pytest.mark.parametrize("method, splits", [("filter", 3), ("radix", 3), ("radix", 1)])
def test_allocated_workspace_is_not_zeroed(monkeypatch, method, splits):
    """Without a workspace argument the scratch comes uninitialised (only the radix split path's histogram
    columns are zeroed): the result must not depend on what the memory held.  torch.empty is made to return
    garbage so that a path relying on zeros would fail here."""
    g = torch.Generator().manual_seed(9)
    s = torch.randn(3, 1500, generator=g)
    s[1, 200:900] = 0.5  # ties at the boundary
    real_empty = torch.empty

    def garbage_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype == torch.int32:
            t.copy_(torch.randint(-(2**31), 2**31 - 1, t.shape, generator=g, dtype=torch.int32))
        return t

    monkeypatch.setattr(torch, "empty", garbage_empty)
    a = topk_indices(s, 40, backend="triton", splits=splits, method=method)
    monkeypatch.undo()
    assert torch.equal(a, topk_indices_reference(s, 40))


def test_split_workspace_size_and_helper():
    g = torch.Generator().manual_seed(6)
    s = torch.randn(2, 300, generator=g)
    want = topk_indices_reference(s, 16)
    need = 704 + 2 * 300 + 2 * 300 + 150  # split paths: counters, dense list (min(8192, N)), regions, group maxima
    ws = torch.zeros((2, need), dtype=torch.int32)
    assert torch.equal(topk_indices(s, 16, backend="triton", workspace=ws, splits=4), want)
    with pytest.raises(ValueError, match="workspace"):
        topk_indices(s, 16, backend="triton", workspace=ws[:, : need - 1], splits=4)
    assert torch.equal(topk_indices(s, 16, backend="triton", workspace=ws[:, : 704 + 300], splits=1), want)
    with pytest.raises(ValueError, match="workspace"):  # the single-program path needs 704 + N columns
        topk_indices(s, 16, backend="triton", workspace=ws[:, : 704 + 299], splits=1)
    big = topk_workspace(2, 300)
    assert big.dtype == torch.int32 and big.shape == (2, need) and (big == 0).all()
    for sp in (1, 2, 64):
        assert torch.equal(topk_indices(s, 16, backend="triton", workspace=big, splits=sp), want)


def test_split_boundary_ties_across_splits_take_lowest_indices():
    """300 entries, 4 splits of 80: equal scores at the boundary lie in every split; the lowest indices win."""
    s = torch.full((2, 300), -5.0)
    tie = [290, 81, 230, 80, 160, 159, 155, 79, 11]  # in all four splits, incl. both sides of chunk edges
    s[0, tie] = 1.0
    s[0, [299, 0, 150]] = 2.0  # winners in the first, middle and last split
    idx = run_both(s, 7, splits=(1, 2, 3, 4, 7))
    assert idx[0].tolist() == [0, 11, 79, 80, 81, 150, 299]
    # row 1: the boundary value is the largest one, tied in all splits; winners come after ties in index order
    s[1, ::7] = 3.0
    s[1, [298, 1]] = 4.0
    idx = run_both(s, 5, splits=(1, 4, 5))
    assert idx[1].tolist() == [0, 1, 7, 14, 298]


def test_split_chunks_empty_or_cut_by_n_visible():
    g = torch.Generator().manual_seed(7)
    s = torch.randn(5, 300, generator=g)
    s[4, 100:] = s[4, 99]  # ties reaching into hidden entries
    nv = torch.tensor([300, 80, 81, 0, 159], dtype=torch.int32)  # 4 splits: at / past / inside chunk edges
    idx = run_both(s, 40, nv, splits=(1, 4, 32))  # 32 splits of 16 entries: most chunks past the row
    assert (idx[3] == -1).all() and (idx[1, :40] < 80).all()
    tiny = torch.tensor([[0.5, -1.0, 2.0, NEG_INF, 0.5]])
    assert run_both(tiny, 3, splits=(1, 8))[0].tolist() == [0, 2, 4]  # more splits than entries


def test_result_independent_of_splits():
    g = torch.Generator().manual_seed(8)
    s = torch.randint(-20, 20, (3, 700), generator=g).float() * 0.25  # many ties of a few values
    s[0] = torch.randn(700, generator=g) * 1e4  # wide exponent range
    s[1, 100:400] = NEG_INF
    s[2, 5::9] = float("nan")
    nv = torch.tensor([700, 650, 333], dtype=torch.int32)
    for k in (1, 37, 128):
        run_both(s, k, nv, splits=(1, 2, 5, 16))


@pytest.mark.parametrize("splits", [2, 64])
def test_split_padding_shared_and_many_winner_chunks(splits):
    """k > #selectable and k large: the -1 padding is written in stripes by all programs of a row; winners
    and ties spread over every chunk (per-chunk offsets from all earlier chunks)."""
    g = torch.Generator().manual_seed(10)
    s = torch.randn(3, 900, generator=g)
    s[1] = (s[1] * 2).round()  # ties among winners and at the threshold
    s[2, 250:] = NEG_INF  # fewer selectable than k
    nv = torch.tensor([900, 900, 800], dtype=torch.int32)
    want = topk_indices_reference(s, 300, nv)
    check_contract(want, s, 300, nv)
    for method in ("filter", "radix"):
        assert torch.equal(topk_indices(s, 300, nv, backend="triton", splits=splits, method=method), want), method


def test_split_all_tied_row():
    """Every entry is a candidate with the same key: only the first k (index order) are chosen."""
    s = torch.full((2, 1000), 0.75)
    s[1, 500] = 2.0  # one winner, placed in the middle of the row
    for method in ("filter", "radix"):  # filter: every entry is a candidate, > CAP: the fallback
        got = topk_indices(s, 50, backend="triton", splits=4, method=method)
        assert got[0].tolist() == list(range(50))
        assert got[1].tolist() == list(range(49)) + [500]


def test_workspace_reused_across_shapes_and_paths():
    """One zeroed buffer for many calls (as in a CUDA graph): different T, N, k, splits and the single path;
    the row histograms are zero after each call."""
    g = torch.Generator().manual_seed(11)
    ws = topk_workspace(6, 800)
    cases = [(6, 800, 64, 5, "radix"), (2, 333, 17, 3, "filter"), (6, 800, 1, 1, "auto"), (5, 257, 300, 16, "filter")]
    cases += [(6, 800, 100, 2, "radix"), (6, 800, 100, 2, "filter")]
    for T, N, k, sp, method in cases:
        s = (torch.randn(T, N, generator=g) * 3).round()
        nv = torch.randint(0, N + 1, (T,), generator=g, dtype=torch.int32)
        got = topk_indices(s, k, nv, backend="triton", workspace=ws, splits=sp, method=method)
        assert torch.equal(got, topk_indices_reference(s, k, nv)), method
        assert (ws[:, :256] == 0).all()


def test_many_rows_split_path():
    g = torch.Generator().manual_seed(12)
    s = torch.randn(65, 32, generator=g).round()  # T > 64: row index arithmetic of every launch
    s[::3, 10:] = float("nan")
    run_both(s, 12, splits=(2,))


def test_reference_and_validation():
    s = torch.tensor([[3.0, 1.0, 3.0, 2.0]])
    assert topk_indices_reference(s, 3).tolist() == [[0, 2, 3]]
    with pytest.raises(ValueError, match="k"):
        topk_indices(s, 0)
    with pytest.raises(ValueError, match="scores"):
        topk_indices(s.double(), 2)
    with pytest.raises(ValueError, match="n_visible"):
        topk_indices(s, 2, torch.tensor([1, 2], dtype=torch.int32))
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="splits"):
            topk_indices(s, 2, splits=bad)
    with pytest.raises(ValueError, match="method"):
        topk_indices(s, 2, method="fast")
    with pytest.raises(ValueError, match="method"):
        topk_indices(s, 2, method="sort")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_to_physical(device, backend):
    bt = torch.tensor([[5, 2, -1], [7, 0, 3]], dtype=torch.int32, device=device)
    tr = torch.tensor([0, 1], dtype=torch.int32, device=device)
    idx = torch.tensor([[0, 5, 4, -1, 9, 12], [11, 4, 0, -1, -1, 12]], dtype=torch.int32, device=device)
    phys = to_physical(idx, bt, tr, 4, backend=backend)
    # row 0: 0 -> page 5 row 0 = 20; 5 -> page 2 row 1 = 9; 4 -> 8; -1; 9 -> page -1 -> -1; 12 -> col 3 -> -1
    assert phys.tolist() == [[20, 9, 8, -1, -1, -1], [15, 0, 28, -1, -1, -1]]
    assert phys.dtype == torch.int32
    # a strided index tensor (every other column) and an empty block table
    assert torch.equal(to_physical(idx[:, ::2], bt, tr, 4, backend=backend), phys[:, ::2])
    assert (to_physical(idx, bt[:, :0], tr, 4, backend=backend) == -1).all()
    with pytest.raises(ValueError, match="entries_per_page"):
        to_physical(idx, bt, tr, 0, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_to_physical_random_and_visible_physical(device, backend):
    """Random tables (pages -1 included), query rows mapped to block-table rows, widths not a power of two:
    the Triton launch equals the reference, and visible_physical equals to_physical of visible_logical."""
    g = torch.Generator().manual_seed(3)
    bt = torch.randint(-1, 50, (5, 9), generator=g, dtype=torch.int32).to(device)
    tr = torch.randint(0, 5, (7,), generator=g, dtype=torch.int32).to(device)
    idx = torch.randint(-1, 9 * 16 + 20, (7, 37), generator=g, dtype=torch.int32).to(device)
    want = to_physical_reference(idx, bt, tr, 16)
    assert torch.equal(to_physical(idx, bt, tr, 16, backend=backend), want)
    nv = torch.tensor([0, 1, 16, 17, 100, 144, 300], dtype=torch.int32, device=device)
    for width in (0, 5, 150):
        got = visible_physical(nv, width, bt, tr, 16, backend=backend)
        assert torch.equal(got, to_physical_reference(visible_logical(nv, width), bt, tr, 16))
        assert got.shape == (7, width)


@gpu
@needs_cuda
@pytest.mark.parametrize("k", [512, 1024])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_gpu_real_shape_random_rows(rows, k):
    """The benchmark shape: rows x 262,144 normal scores, auto splits, shared workspace, twice in a row; and with
    counters (launches A and B as one: the last program of a row runs B; a race would show here, not under the
    interpreter), the counters left zero."""
    g = torch.Generator().manual_seed(rows * k)
    s = torch.randn(rows, 262144, generator=g).cuda()
    want = topk_indices_reference(s, k)
    ws = topk_workspace(rows, 262144, s.device)
    cnt = torch.zeros(rows, dtype=torch.int32, device=s.device)
    for _ in range(2):
        assert torch.equal(topk_indices(s, k, backend="triton", workspace=ws), want)
        assert torch.equal(topk_indices(s, k, backend="triton", workspace=ws, counters=cnt), want)
    assert (ws[:, :256] == 0).all() and not cnt.any()


@gpu
@needs_cuda
@pytest.mark.parametrize("split_d", [False, True])
def test_gpu_split_d_at_a_prefill_chunks_rows(split_d, monkeypatch):
    """A prefill chunk's row count (512 rows, above ``_SPLIT_D_MIN_ROWS``): launch D in two parts (``_SPLIT_D``) and
    as one give the reference's indices, with rows whose candidates overflow the SB1 slots (all tied, ties among the
    winners: the second part's rows) and rows seeing fewer entries than k."""
    monkeypatch.setattr(topk_mod, "_SPLIT_D", split_d)
    assert topk_mod._split_d(512) == split_d
    g = torch.Generator().manual_seed(17)
    s = torch.randn(512, 4096, generator=g)
    s[0] = 1.0
    s[1, ::3] = 2.0
    s[2] = (s[2] * 1e-3).round()
    nv = torch.randint(0, 4097, (512,), generator=g, dtype=torch.int32)
    nv[:3] = 4096
    s, nv = s.cuda(), nv.cuda()
    assert torch.equal(topk_indices(s, 512, nv, backend="triton"), topk_indices_reference(s, 512, nv))


@gpu
@needs_cuda
def test_gpu_many_rows_and_tied_rows():
    g = torch.Generator().manual_seed(13)
    s = torch.randn(66, 20000, generator=g)
    s[0] = 1.0  # all tied: every entry is a candidate
    s[1, ::5] = 2.0  # ties among the winners
    s[2] = (s[2] * 1e-3).round()  # ties at the threshold in every chunk
    s[3, :100] = float("nan")
    nv = torch.randint(0, 20001, (66,), generator=g, dtype=torch.int32)
    nv[:4] = 20000
    s, nv = s.cuda(), nv.cuda()
    for k in (1, 512, 4096):
        want = topk_indices_reference(s, k, nv)
        for splits in (None, 1, 2, 5, 64):
            assert torch.equal(topk_indices(s, k, nv, backend="triton", splits=splits), want), f"{k} {splits}"


@gpu
@needs_cuda
@pytest.mark.parametrize("k", [512, 1024])
def test_gpu_long_rows(k):
    g = torch.Generator().manual_seed(4)
    s = torch.randn(7, 262144, generator=g)
    s[1] = s[1].round()  # heavy ties
    s[2, 100000:] = NEG_INF
    s[4, 32768:] = NEG_INF  # rows far shorter than the table (finer groups, topk._row_plan)
    nv = torch.tensor([262144, 262144, 200000, 700, 32768, 5000, 131073], dtype=torch.int32)
    s, nv = s.cuda(), nv.cuda()
    b = topk_indices_reference(s, k, nv)
    for splits in (None, 1, 8, 64):
        assert torch.equal(topk_indices(s, k, nv, backend="triton", splits=splits), b), f"splits={splits}"


@gpu
@needs_cuda
def test_gpu_one_row_repeatable_and_graph_capturable():
    """Split path on one long row: same result on every call (integer atomics only), and it captures in a CUDA
    graph whose replays reuse the workspace (its histograms are left zero)."""
    g = torch.Generator().manual_seed(9)
    s = (torch.randn(1, 262144, generator=g) * 4).round().cuda()  # heavy ties across all splits
    want = topk_indices_reference(s, 4096)
    ws = topk_workspace(1, 262144, s.device)
    for _ in range(3):
        assert torch.equal(topk_indices(s, 4096, backend="triton", workspace=ws), want)
    topk_indices(s, 1024, backend="triton", workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = topk_indices(s, 1024, backend="triton", workspace=ws)
    for _ in range(3):
        s.copy_(torch.randn_like(s))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, topk_indices_reference(s, 1024))
    assert (ws[:, :256] == 0).all()


def test_strided_n_visible_is_read_by_element():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 64, generator=g)
    nv = torch.tensor([[10, 0], [20, 0], [64, 0]], dtype=torch.int32)[:, 0]
    assert nv.stride(0) == 2
    want = topk_indices_reference(scores, 4, nv)
    assert torch.equal(topk_indices(scores, 4, nv, backend="triton"), want)


# ---------------------------------------------------------------------------------------- filter path
def filter_run(s, k, nv=None, splits=3, ws=None):
    """The filter path on s; returns (result, listed candidates per row, the plan) after checking the result
    against the reference.  The count is the sum of the per-chunk counts C[t, :splits] in the workspace."""
    T, N = s.shape
    if ws is None:  # garbage scratch: the filter path needs no zeroing
        ws = torch.randint(-(2**31), 2**31 - 1, (T, topk_mod._workspace_cols(N, False)), dtype=torch.int32)
    got = topk_indices(s, k, nv, backend="triton", workspace=ws, splits=splits, method="filter")
    assert torch.equal(got, topk_indices_reference(s, k, nv)), (k, splits)
    cnt = ws[:T, topk_mod._WS_C : topk_mod._WS_C + splits].sum(1).tolist()
    return got, cnt, topk_mod._filter_plan(N, k, splits, True)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 16, 40])
def test_filter_random_rows_few_candidates(k, splits):
    """Normal scores: the candidates (key >= L) are few, all fit the list; any split count; garbage scratch."""
    g = torch.Generator().manual_seed(20 + k)
    s = torch.randn(3, 1200, generator=g)
    _, cnt, plan = filter_run(s, k, splits=splits)
    assert all(k <= c <= plan["SB1"] for c in cnt), (cnt, plan)  # the small in-register tier


def test_filter_one_split_with_and_without_the_copy(monkeypatch):
    """One split: launch D reading its region in place gives the bits of the copy to the dense list."""
    g = torch.Generator().manual_seed(27)
    s = torch.randn(5, 1500, generator=g)
    s[1, 200:900:2] = 3.0  # ties
    nv = torch.tensor([1500, 1400, 40, 0, 777], dtype=torch.int32)
    outs = []
    for one in (True, False):
        monkeypatch.setattr(topk_mod, "_ONE_REGION", one)
        outs.append(topk_indices(s, 24, nv, backend="triton", splits=1, method="filter"))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], topk_indices_reference(s, 24, nv))


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_filter_launches_a_and_b_as_one_with_counters(splits, monkeypatch):
    """``counters``: launches A and B as one (each row's last A program runs B's program for the row): the same
    indices as the four launches, and the counters left zero for the next call (run twice); with fewer counters than
    rows, the four launches.  Ties, rows cut by n_visible, an empty row."""
    g = torch.Generator().manual_seed(31)
    s = torch.randn(5, 1500, generator=g)
    s[1, 200:900:2] = 3.0
    nv = torch.tensor([1500, 1400, 40, 0, 777], dtype=torch.int32)
    want = topk_indices(s, 24, nv, backend="triton", splits=splits, method="filter")
    assert torch.equal(want, topk_indices_reference(s, 24, nv))
    cnt = torch.zeros(8, dtype=torch.int32)
    with monkeypatch.context() as mp:  # (the one launch: launches A and B on their own are not called)
        mp.setattr(topk_mod, "_filter_max", None)
        mp.setattr(topk_mod, "_filter_level", None)
        for _ in range(2):
            got = topk_indices(s, 24, nv, backend="triton", splits=splits, method="filter", counters=cnt)
            assert torch.equal(got, want) and not cnt.any()
    assert torch.equal(topk_indices(s, 24, nv, backend="triton", splits=splits, counters=cnt[:4]), want)
    with pytest.raises(ValueError, match="counters"):
        topk_indices(s, 24, nv, backend="triton", splits=splits, counters=cnt.long())


@pytest.mark.parametrize("split_d", [False, True])
@pytest.mark.parametrize("splits", [4, 1])
def test_filter_boundary_ties_and_fallback_rows(splits, split_d, monkeypatch):
    """Ties at the boundary (lower index wins), an all-equal row, sorted rows (every group max is near L: more
    candidates than SB2 slots -> the whole-row fallback) and a row for the second in-register tier; with one split
    each tier reads the one region in place (``ONE_REGION``).  split_d: launch D as its two parts (``_SPLIT_D``:
    the SB1 rows, then the second tier and the fallback rows), every row written once, the same result."""
    monkeypatch.setattr(topk_mod, "_SPLIT_D", split_d)
    monkeypatch.setattr(topk_mod, "_SPLIT_D_MIN_ROWS", 1)
    assert topk_mod._split_d(6) == split_d
    g = torch.Generator().manual_seed(21)
    N, k = 2048, 16
    s = torch.randn(6, N, generator=g)
    s[0] = (s[0] * 2).round()  # a few values: ties among winners and at the threshold
    s[1] = 0.25  # all equal
    s[2] = torch.linspace(-1, 1, N)  # ascending
    s[3] = torch.linspace(1, -1, N)  # descending
    s[4, :60] = 10 + torch.rand(60, generator=g)  # two groups full of large values: SB1 < candidates <= SB2
    s[5, 100:700:3] = 7.0  # many ties at the top value, spread over several groups and chunks
    got, cnt, plan = filter_run(s, k, splits=splits)
    assert plan["SB1"] < plan["SB2"]
    assert cnt[1] == N and cnt[2] > plan["SB2"] and cnt[3] > plan["SB2"]  # fallback rows
    assert plan["SB1"] < cnt[4] <= plan["SB2"]  # second tier
    assert got[1].tolist() == list(range(k)) and got[5].tolist() == list(range(100, 148, 3))
    assert got[2].tolist() == list(range(N - k, N)) and got[3].tolist() == list(range(k))


def test_filter_nan_inf_n_visible_and_k_above_selectable():
    g = torch.Generator().manual_seed(22)
    s = torch.randn(5, 1000, generator=g)
    s[0, ::2] = NEG_INF
    s[1, 3::7] = float("nan")
    s[1, 500] = float("inf")
    s[2, :] = NEG_INF
    s[2, [5, 900]] = -3.0  # two selectable entries: k > #selectable
    s[3, 40:] = s[3, 40:] + 100.0  # the largest values are hidden by n_visible
    nv = torch.tensor([1000, 999, 1000, 40, 0], dtype=torch.int32)
    for k in (1, 30):
        got, _, _ = filter_run(s, k, nv, splits=5)
        kk = min(k, 2)
        assert got[2, :kk].tolist() == [5, 900][:kk] and (got[2, kk:] == -1).all() and (got[4] == -1).all()
        assert (got[3, :k] < 40).all() and 500 in got[1].tolist()  # +inf: the largest


def test_filter_dense_copy_of_a_crowded_chunk():
    """One chunk lists more candidates than a copy tile has positions (_COPY_COLS): launch D copies its region
    in several iterations; the dense list stays in index order across the regions (the winners straddle the
    chunk edge and ties are cut by index)."""
    g = torch.Generator().manual_seed(26)
    N, k, sp = 2048, 16, 2
    plan = topk_mod._filter_plan(N, k, sp, True)
    s = torch.randn(2, N, generator=g)
    s[0, :100] = 5.0 + torch.rand(100, generator=g)  # chunk 0: > 64 candidates, all above the level
    s[1, 900:1100] = 9.0  # 200 ties at the top over both chunks (chunk edge 1024): the lowest 16 indices win
    got, cnt, _ = filter_run(s, k, splits=sp)
    assert cnt[0] > topk_mod._COPY_COLS and plan["SB1"] < cnt[0] <= plan["SB2"], (cnt, plan)
    assert got[0].tolist() == sorted(s[0, :100].topk(k).indices.tolist())
    assert got[1].tolist() == list(range(900, 916))


def test_filter_short_visible_rows_use_finer_groups():
    """Rows far shorter than N (an engine's block tables sized for its longest request): the S programs share
    the visible prefix and the group size shrinks with it, so the level stays tight and the candidates fit the
    in-register list (with groups sized for N, 1,024 visible entries would form 4 groups of 256 < k: every
    entry a candidate, more than SB2 -> the slow whole-row fallback)."""
    g = torch.Generator().manual_seed(27)
    N, k = 8192, 16
    s = torch.randn(5, N, generator=g)
    nv = torch.tensor([1024, 300, N, 5, 4100], dtype=torch.int32)
    s[1, 300:] = 50.0  # hidden: never chosen
    _, cnt, plan = filter_run(s, k, nv, splits=4)
    assert plan["G"] == 256 and plan["LEVELS"] == 6  # groups of 256 .. 8
    assert all(c <= plan["SB2"] for c in cnt), (cnt, plan)
    assert cnt[0] <= plan["SB1"], cnt  # 1,024 entries: 32 groups of 32, as many as the full row's


def test_filter_many_rows_use_more_groups():
    """From _MANY_ROWS rows on the filter path plans up to _GROUPS_PER_K_MANY k groups (smaller G: launch C re-reads
    less of each row), but groups of >= _G_MANY_MIN entries (a short row keeps fewer, larger groups); the result is
    the same."""
    g = torch.Generator().manual_seed(28)
    N, k, T = 8192, 16, topk_mod._MANY_ROWS
    few, many = topk_mod._filter_plan(N, k, 4, True, 1), topk_mod._filter_plan(N, k, 4, True, T)
    assert N // few["G"] >= 2 * k and N // many["G"] >= topk_mod._GROUPS_PER_K_MANY * k and many["G"] < few["G"]
    assert many["G"] >= topk_mod._G_MANY_MIN
    short = topk_mod._filter_plan(N // 4, k, 4, True, T)  # 2,048 entries: 4 k groups of 32
    assert short["G"] == topk_mod._G_MANY_MIN and N // 4 // short["G"] == 4 * k
    assert topk_mod._filter_plan(N // 8, k, 4, True, T)["G"] == topk_mod._filter_plan(N // 8, k, 4, True, 1)["G"]
    s = torch.randn(T, N, generator=g)
    nv = torch.randint(0, N + 1, (T,), generator=g, dtype=torch.int32)
    filter_run(s, k, nv, splits=4)


def test_filter_small_rows_k_above_groups_and_many_rows():
    """Fewer groups than k (level = INT32_MIN: every selectable entry is a candidate), k > N, T > 1."""
    g = torch.Generator().manual_seed(23)
    filter_run(torch.randn(2, 48, generator=g), 64, splits=2)
    filter_run(torch.randn(9, 100, generator=g).round(), 20, splits=3)
    tiny = torch.tensor([[0.5, -1.0, 2.0, NEG_INF, 0.5]])
    assert filter_run(tiny, 3, splits=8)[0][0].tolist() == [0, 2, 4]
    assert (filter_run(torch.empty(2, 0), 4)[0] == -1).all()  # empty rows


def test_filter_reuses_workspace_without_zeroing():
    """Every scratch value is written before it is read in the same call: the same (garbage) buffer serves
    consecutive calls of different shapes; the radix path's histograms (columns [0, 256)) are not touched."""
    g = torch.Generator().manual_seed(24)
    ws = torch.randint(-(2**31), 2**31 - 1, (4, topk_mod._workspace_cols(1500, False)), generator=g, dtype=torch.int32)
    ws[:, :256] = 0
    for T, N, k, sp in [(4, 1500, 32, 6), (2, 700, 5, 2), (4, 1500, 32, 6)]:
        s = torch.randn(T, N, generator=g)
        filter_run(s, k, splits=sp, ws=ws)
    assert (ws[:, :256] == 0).all()
    assert torch.equal(
        topk_indices(s, 32, backend="triton", workspace=ws, splits=6, method="radix"), filter_run(s, 32)[0]
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("k", [512, 1024])
@pytest.mark.parametrize("rows", [1, 4, 8, 64])
def test_gpu_filter_real_shapes(rows, k):
    """rows x 262,144 normal scores (64 rows: the decode step at 1M context): the filter path twice on one
    workspace (its candidate count is the fast in-register tier); the radix path and the auto choice agree."""
    g = torch.Generator().manual_seed(rows + k)
    s = torch.randn(rows, 262144, generator=g).cuda()
    want = topk_indices_reference(s, k)
    ws = topk_workspace(rows, 262144, s.device)
    for _ in range(2):
        assert torch.equal(topk_indices(s, k, backend="triton", workspace=ws, method="filter"), want)
    cnt = ws[:, topk_mod._WS_C : topk_mod._WS_C + topk_mod._auto_splits_filter(rows, 262144)].sum(1)
    assert (cnt >= k).all() and (cnt <= 2 * k).all(), cnt  # few candidates: the fast in-register tier
    assert torch.equal(topk_indices(s, k, backend="triton", workspace=ws, method="radix"), want)
    assert torch.equal(topk_indices(s, k, backend="triton", workspace=ws), want)


@gpu
@needs_cuda
def test_gpu_filter_adversarial_rows_and_graph():
    """Ties, sorted rows (fallback), NaN, n_visible on long rows; then a CUDA graph of the default path replayed
    on new data (the workspace needs no reset between replays)."""
    g = torch.Generator().manual_seed(25)
    N = 262144
    s = torch.randn(6, N, generator=g)
    s[0] = (s[0] * 4).round()
    s[1] = 1.0
    s[2] = torch.linspace(0, 1, N)
    s[3, ::5] = float("nan")
    s[4, 1000:] = s[4, 1000:] + 50  # hidden by n_visible
    nv = torch.tensor([N, N, N, N, 1000, 77777], dtype=torch.int32)
    s, nv = s.cuda(), nv.cuda()
    for k in (1, 512, 1024, 4096):
        want = topk_indices_reference(s, k, nv)
        for splits in (None, 1, 7, 64):
            got = topk_indices(s, k, nv, backend="triton", splits=splits, method="filter")
            assert torch.equal(got, want), (k, splits)
    x = torch.randn(4, N, device="cuda")
    ws = topk_workspace(4, N, x.device)
    topk_indices(x, 1024, backend="triton", workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = topk_indices(x, 1024, backend="triton", workspace=ws)
    for i in range(3):
        x.copy_(torch.randn_like(x) if i != 1 else (torch.randn_like(x) * 2).round())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, topk_indices_reference(x, 1024))


# ------------------------------------------------------------------------------ the radix search helper
@triton.jit
def _kth_kernel(v_ptr, valid_ptr, kk_ptr, out_ptr, BITS: tl.constexpr, R: tl.constexpr, NP: tl.constexpr):
    i = tl.arange(0, NP)
    v = tl.load(v_ptr + i)
    valid = tl.load(valid_ptr + i) != 0
    tl.store(out_ptr, topk_mod._kth_largest(v, valid, tl.load(kk_ptr), BITS, R))


def kth_reference(v, valid, kk, bits=32):
    """The kk-th largest of v[valid] (INT32_MIN if kk > #valid, INT32_MAX if kk <= 0), rounded down to a
    multiple of 2^(32 - bits) in the unsigned order (v + 2^31)."""
    x = v[valid].long()
    if kk <= 0:
        exact = 2**31 - 1
    elif kk > x.numel():
        exact = -(2**31)
    else:
        exact = int(x.sort(descending=True).values[kk - 1])
    u = exact + 2**31
    return (u >> (32 - bits) << (32 - bits)) - 2**31


@pytest.mark.parametrize("bits, r", [(32, 4), (16, 4), (32, 2), (16, 2)])
def test_kth_largest_radix_search(bits, r):
    """``_kth_largest`` (launches B and D of the filter path) against a sort: duplicates, extreme values,
    masked slots, kk = 0, kk above the valid count; BITS = 16 gives the lower edge of the 16-bit bucket."""
    g = torch.Generator().manual_seed(31)
    n = 64
    cases = [torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)]
    cases.append(torch.randint(-3, 3, (n,), generator=g, dtype=torch.int32))  # many duplicates
    ext = torch.randint(-5, 5, (n,), generator=g, dtype=torch.int32)
    ext[:4] = torch.tensor([2**31 - 1, -(2**31), 2**31 - 1, 65536], dtype=torch.int32)
    cases.append(ext)
    for v in cases:
        valid = torch.rand(n, generator=g) < 0.8
        for kk in (0, 1, 2, 7, int(valid.sum()), int(valid.sum()) + 1, n + 5):
            dev = "cuda" if torch.cuda.is_available() else "cpu"  # (the interpreter on a CPU-only machine)
            out = torch.empty(1, dtype=torch.int32, device=dev)
            kk_t = torch.tensor([kk], dtype=torch.int32, device=dev)
            _kth_kernel[(1,)](v.to(dev), valid.to(dev, torch.int32), kk_t, out, BITS=bits, R=r, NP=n)
            assert int(out) == kth_reference(v, valid, kk, bits), (kk, bits, r)


@pytest.mark.parametrize("rank_slots", [0, 64])
def test_filter_threshold_by_rank_in_the_bucket(monkeypatch, rank_slots):
    """Launch D's threshold through ``_kth_by_rank`` (the 16-bit bucket's keys ranked by comparison; the radix
    search over the low bits when the bucket holds more than RANK_SLOTS keys) gives the same rows as the plain
    search: normal scores, many ties in the threshold's bucket, duplicates at the threshold, k > #selectable."""
    monkeypatch.setattr(topk_mod, "_RANK_SLOTS", rank_slots)
    g = torch.Generator().manual_seed(27)
    s = torch.randn(5, 3000, generator=g)
    s[1, ::3] = 1.5  # 1,000 equal keys: the bucket exceeds the rank slots (search fallback)
    s[2] = (s[2] * 8).round() / 8  # few distinct values: duplicates at the threshold
    s[3, 7:] = NEG_INF  # k > #selectable
    s[4] = 1.0 + torch.rand(3000, generator=g) * 1e-3  # every key in one or two 16-bit buckets
    for k in (1, 40, 300):
        for sp in (1, 3, 8):
            filter_run(s, k, splits=sp)


@gpu
@needs_cuda
@pytest.mark.parametrize("rows, n, k", [(4, 262144, 1024), (64, 32768, 512)])
def test_gpu_filter_threshold_by_rank(monkeypatch, rows, n, k):
    """Launch D with ``_kth_by_rank`` at the benchmark shapes (its workspace round trip between two CTA
    barriers is what the interpreter cannot check), and with ties filling the threshold's bucket."""
    monkeypatch.setattr(topk_mod, "_RANK_SLOTS", 64)
    g = torch.Generator().manual_seed(rows)
    s = torch.randn(rows, n, generator=g)
    s[0] = (s[0] * 16).round() / 16
    s = s.cuda()
    ws = topk_workspace(rows, n, s.device)
    for _ in range(2):
        assert torch.equal(
            topk_indices(s, k, backend="triton", workspace=ws, method="filter"), topk_indices_reference(s, k)
        )


def test_many_short_rows_take_the_filter_path(monkeypatch):
    """A prefill chunk's shape (>= _SINGLE_MAX_ROWS rows, N <= _SINGLE_MAX_N): "auto" runs the filter path with one
    split (and launches B / D on _FILTER_WARPS_BD_MANY warps), not the single-program kernel; same indices as the
    reference, with causal n_visible and ties."""
    g = torch.Generator().manual_seed(33)
    T, N, k = topk_mod._SINGLE_MAX_ROWS, 300, 24
    s = torch.randn(T, N, generator=g)
    s[::7, 50:120] = 1.5  # ties across the boundary
    nv = torch.arange(1, T + 1, dtype=torch.int32).clamp(max=N)
    launched = []
    real = topk_mod._launch_filter
    monkeypatch.setattr(topk_mod, "_launch_filter", lambda *a: launched.append(a[5]) or real(*a))
    got = topk_indices(s, k, nv, backend="triton")
    assert launched == [1]  # the filter path, one split
    assert torch.equal(got, topk_indices_reference(s, k, nv))
    launched.clear()
    topk_indices(s[: T - 1], k, nv[: T - 1], backend="triton")
    assert launched == []  # one row fewer: the single-program kernel
