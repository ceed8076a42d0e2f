"""Top-k of indexer scores (radix-select Triton kernel vs stable-sort reference) and to_physical."""

import pytest
import torch

from dsv4.kernels.indexer import to_physical, topk_indices, topk_indices_reference

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


def run_both(scores, k, nv=None):
    a = topk_indices(scores, k, nv, backend="triton")
    b = topk_indices(scores, k, nv, backend="torch")
    assert a.dtype == torch.int32 and a.shape == (scores.shape[0], k)
    assert torch.equal(a, b)
    check_contract(a, scores, k, nv)
    return a


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


def test_workspace_passed_in_and_candidate_heavy_rows():
    g = torch.Generator().manual_seed(5)
    s = torch.rand(3, 1500, generator=g) * 1e-3 + 1.0  # all in one top-8-bit bucket: every element a candidate
    s[1, 700:] = 1.0  # many exact ties inside the candidate bucket
    ws = torch.full((4, 1600), 7, dtype=torch.int32)
    a = topk_indices(s, 40, backend="triton", workspace=ws)
    assert torch.equal(a, topk_indices_reference(s, 40))
    check_contract(a, s, 40, None)
    with pytest.raises(ValueError, match="workspace"):
        topk_indices(s, 40, backend="triton", workspace=ws[:, :100])


def test_reference_and_validation():
    s = torch.tensor([[3.0, 1.0, 3.0, 2.0]])
    assert topk_indices_reference(s, 3).tolist() == [[0, 2, 3]]
    with pytest.raises(ValueError, match="k"):
        topk_indices(s, 0)
    with pytest.raises(ValueError, match="scores"):
        topk_indices(s.double(), 2)
    with pytest.raises(ValueError, match="n_visible"):
        topk_indices(s, 2, torch.tensor([1, 2], dtype=torch.int32))


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
    a = topk_indices(s, k, nv, backend="triton")
    b = topk_indices_reference(s, k, nv)
    assert torch.equal(a, b)
