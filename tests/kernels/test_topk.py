"""Top-k of indexer scores (radix-select Triton kernels vs stable-sort reference) and to_physical.

Every Triton case runs both paths: ``splits=1`` (one program per row) and the split path (several
programs per row, four launches) at small sizes, so its chunk boundaries, per-split prefix offsets,
the tie order across splits and the rank sort shared by several finishing programs are all exercised
under the interpreter.
"""

import pytest
import torch

from dsv4.kernels.indexer import to_physical, topk_indices, topk_indices_reference
from dsv4.kernels.indexer.topk import topk_workspace

NEG_INF = float("-inf")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def check_contract(idx, scores, k, n_visible):
    """Properties that hold without any reference: selection, padding, order, tie-break."""
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
        # sorted by score descending, then index ascending
        for a in range(kk - 1):
            assert vals[a] > vals[a + 1] or (vals[a] == vals[a + 1] and chosen[a] < chosen[a + 1])
        if kk:
            # nothing left out beats the smallest chosen (ties: a left-out equal one has a larger index)
            thr, last = vals[-1], chosen[vals == vals[-1]].max()
            mask = torch.ones(nv, dtype=torch.bool)
            mask[chosen] = False
            rest = scores[t, :nv][mask]
            rest_idx = torch.arange(nv)[mask]
            assert not (rest > thr).any()
            assert not ((rest == thr) & (rest_idx < last)).any()


def run_both(scores, k, nv=None, splits=(1, 4)):
    b = topk_indices(scores, k, nv, backend="torch")
    check_contract(b, scores, k, nv)
    for sp in splits:
        a = topk_indices(scores, k, nv, backend="triton", splits=sp)
        assert a.dtype == torch.int32 and a.shape == (scores.shape[0], k)
        assert torch.equal(a, b), f"splits={sp}"
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
    assert idx.tolist() == [[3, 5, 0], [5, 0, 1]]


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
    assert idx[2, 0] == 9 and 7 not in idx[2].tolist()


def test_all_minus_inf():
    s = torch.full((2, 100), NEG_INF)
    assert (run_both(s, 16) == -1).all()


def test_k_equals_n_and_k_above_n():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(3, 48, generator=g)
    idx = run_both(s, 48)
    ref = torch.sort(s, dim=1, descending=True).indices.to(torch.int32)
    assert torch.equal(idx, ref)
    idx = run_both(s, 64)
    assert (idx[:, 48:] == -1).all()


def test_large_row_matches_torch_topk_set():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 4096, generator=g)
    nv = torch.tensor([4096, 3000], dtype=torch.int32)
    idx = run_both(s, 256, nv)
    want = torch.topk(s[0], 256).indices
    assert torch.equal(idx[0].long(), want)  # distinct values: same order as torch.topk


@pytest.mark.parametrize("splits", [1, 3])
def test_workspace_passed_in_and_candidate_heavy_rows(splits):
    """Every element shares the top 16 key bits: all are candidates (several finishing blocks), with ties."""
    g = torch.Generator().manual_seed(5)
    s = torch.rand(3, 1500, generator=g) * 1e-3 + 1.0
    s[1, 700:] = 1.0  # many exact ties inside the candidate bucket, spread over two splits
    s[2, ::2] = 1.0005  # ties among the largest values too
    ws = torch.randint(-(2**31), 2**31 - 1, (4, 4600), generator=g, dtype=torch.int32)  # garbage: never zeroed
    a = topk_indices(s, 40, backend="triton", workspace=ws, splits=splits)
    assert torch.equal(a, topk_indices_reference(s, 40))
    check_contract(a, s, 40, None)
    with pytest.raises(ValueError, match="workspace"):
        topk_indices(s, 40, backend="triton", workspace=ws[:, :100], splits=splits)


def test_split_workspace_size_and_helper():
    g = torch.Generator().manual_seed(6)
    s = torch.randn(2, 300, generator=g)
    want = topk_indices_reference(s, 16)
    need = 2 * 300 + 2 * 256 * 4 + 4  # split path: list indices + keys, H1 + H2, counts
    ws = torch.zeros((2, need), dtype=torch.int32)
    assert torch.equal(topk_indices(s, 16, backend="triton", workspace=ws, splits=4), want)
    with pytest.raises(ValueError, match="workspace"):
        topk_indices(s, 16, backend="triton", workspace=ws[:, : need - 1], splits=4)
    with pytest.raises(ValueError, match="workspace"):  # the single-program path needs only N columns
        topk_indices(s, 16, backend="triton", workspace=ws[:, :299], splits=1)
    big = topk_workspace(2, 300)
    assert big.dtype == torch.int32 and big.shape == (2, 2 * 300 + 2 * 256 * 64 + 4)
    for sp in (1, 2, 64):
        assert torch.equal(topk_indices(s, 16, backend="triton", workspace=big, splits=sp), want)


def test_split_boundary_ties_across_splits_take_lowest_indices():
    """300 entries, 4 splits of 80: equal scores at the boundary lie in every split; the lowest indices win."""
    s = torch.full((2, 300), -5.0)
    tie = [290, 81, 230, 80, 160, 159, 155, 79, 11]  # in all four splits, incl. both sides of chunk edges
    s[0, tie] = 1.0
    s[0, [299, 0, 150]] = 2.0  # winners in the first, middle and last split
    idx = run_both(s, 7, splits=(1, 2, 3, 4, 7))
    assert idx[0].tolist() == [0, 150, 299, 11, 79, 80, 81]
    # row 1: the boundary value is the largest one, tied in all splits; winners come after ties in index order
    s[1, ::7] = 3.0
    s[1, [298, 1]] = 4.0
    idx = run_both(s, 5, splits=(1, 4, 5))
    assert idx[1].tolist() == [1, 298, 0, 7, 14]


def test_split_chunks_empty_or_cut_by_n_visible():
    g = torch.Generator().manual_seed(7)
    s = torch.randn(5, 300, generator=g)
    s[4, 100:] = s[4, 99]  # ties reaching into hidden entries
    nv = torch.tensor([300, 80, 81, 0, 159], dtype=torch.int32)  # 4 splits: at / past / inside chunk edges
    idx = run_both(s, 40, nv, splits=(1, 4, 64))  # 64 splits of 16 entries: most chunks past the row
    assert (idx[3] == -1).all() and (idx[1, :40] < 80).all()
    tiny = torch.tensor([[0.5, -1.0, 2.0, NEG_INF, 0.5]])
    assert run_both(tiny, 3, splits=(1, 8))[0].tolist() == [2, 0, 4]  # more splits than entries


def test_result_independent_of_splits():
    g = torch.Generator().manual_seed(8)
    s = torch.randint(-20, 20, (3, 700), generator=g).float() * 0.25  # many ties of a few values
    s[0] = torch.randn(700, generator=g) * 1e4  # wide exponent range
    s[1, 100:400] = NEG_INF
    s[2, 5::9] = float("nan")
    nv = torch.tensor([700, 650, 333], dtype=torch.int32)
    for k in (1, 37, 128):
        run_both(s, k, nv, splits=(1, 2, 5, 16))


@pytest.mark.parametrize("finish_programs", [1, 2, 5])
def test_split_finish_programs_share_the_ranking(finish_programs):
    """The last launch ranks the winners + candidates in slices of 32 spread over R programs per row: few
    programs (several slices each, strided), more programs than slices, and -1 padding shared among them."""
    g = torch.Generator().manual_seed(10)
    s = torch.randn(3, 900, generator=g)
    s[1] = (s[1] * 2).round()  # ties among winners and at the threshold, in list and in index order
    s[2, 450:] = NEG_INF  # fewer selectable than k: padding written by every program's share
    nv = torch.tensor([900, 900, 800], dtype=torch.int32)
    want = topk_indices_reference(s, 600, nv)
    check_contract(want, s, 600, nv)
    for sp in (3, 8):
        got = topk_indices(s, 600, nv, backend="triton", splits=sp, finish_programs=finish_programs)
        assert torch.equal(got, want), f"splits={sp}"


def test_split_finish_all_tied_row_bounds_the_ranking():
    """Every entry is a candidate with the same key: only the first k (index order) are chosen and ranked."""
    s = torch.full((2, 1000), 0.75)
    s[1, 500] = 2.0  # one winner, placed in the middle of the row
    got = topk_indices(s, 50, backend="triton", splits=4, finish_programs=3)
    assert got[0].tolist() == list(range(50))
    assert got[1].tolist() == [500] + list(range(49))


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
        with pytest.raises(ValueError, match="finish_programs"):
            topk_indices(s, 2, finish_programs=bad)


def test_to_physical():
    bt = torch.tensor([[5, 2, -1], [7, 0, 3]], dtype=torch.int32)
    tr = torch.tensor([0, 1], dtype=torch.int32)
    idx = torch.tensor([[0, 5, 4, -1, 9, 12], [11, 4, 0, -1, -1, 12]], dtype=torch.int32)
    phys = to_physical(idx, bt, tr, 4)
    # row 0: 0 -> page 5 row 0 = 20; 5 -> page 2 row 1 = 9; 4 -> 8; -1; 9 -> page -1 -> -1; 12 -> col 3 -> -1
    assert phys.tolist() == [[20, 9, 8, -1, -1, -1], [15, 0, 28, -1, -1, -1]]
    assert phys.dtype == torch.int32
    with pytest.raises(ValueError, match="entries_per_page"):
        to_physical(idx, bt, tr, 0)


@gpu
@needs_cuda
@pytest.mark.parametrize("k", [512, 1024])
def test_gpu_long_rows(k):
    g = torch.Generator().manual_seed(4)
    s = torch.randn(4, 262144, generator=g)
    s[1] = s[1].round()  # heavy ties
    s[2, 100000:] = NEG_INF
    nv = torch.tensor([262144, 262144, 200000, 700], dtype=torch.int32)
    s, nv = s.cuda(), nv.cuda()
    b = topk_indices_reference(s, k, nv)
    for splits in (None, 1, 8, 64):
        assert torch.equal(topk_indices(s, k, nv, backend="triton", splits=splits), b), f"splits={splits}"


@gpu
@needs_cuda
def test_gpu_one_row_repeatable_and_graph_capturable():
    """Split path on one long row: same result on every call (no atomics), and it captures in a CUDA graph."""
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
    s.copy_(torch.randn_like(s))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, topk_indices_reference(s, 1024))


def test_strided_n_visible_is_read_by_element():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 64, generator=g)
    nv = torch.tensor([[10, 0], [20, 0], [64, 0]], dtype=torch.int32)[:, 0]
    assert nv.stride(0) == 2
    want = topk_indices_reference(scores, 4, nv)
    assert torch.equal(topk_indices(scores, 4, nv, backend="triton"), want)
