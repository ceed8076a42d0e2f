"""Prefill indexer scores over folded keys: fold_keys and prefill_scores (Triton under the interpreter on the CPU,
the H200 at real shapes) against their PyTorch references and against indexer_scores."""

import pytest
import torch

from dsv4.formats import FP8_DTYPE, KeyPages, MXFP4KeyFormat
from dsv4.kernels.indexer import indexer_scores, indexer_scores_reference
from dsv4.kernels.indexer import prefill as ps
from tests.kernels.test_indexer_scores import make_keys, make_query

FMT = MXFP4KeyFormat()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# interpreter: exact products, IEEE fp32 sums in another order than the reference's einsum
ATOL_INTERP = 1e-5
# GPU: the FP8 MMA accumulates K = 128 in the tensor core (~14 significant bits reported for Hopper); bounded
# relative to the row's largest |score|, as impl="gluon_fold" (2.4e-5 of it on the benchmark's keys)
REL_GPU = 1e-4


def _bytes(f: ps.FoldedKeys) -> tuple[torch.Tensor, torch.Tensor]:
    return f.codes.view(torch.uint8), f.factor


def assert_close_rowmax(out, ref, rel):
    """-inf where ref is, and |out - ref| <= rel * (the row's largest |ref|) elsewhere."""
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    scale = torch.where(fin, ref.abs(), 0.0).amax(dim=1, keepdim=True).clamp(min=1e-30)
    err = torch.where(fin, (out - ref).abs() / scale, 0.0)
    assert err.max().item() <= rel, f"max error {err.max().item():.3g} of the row's largest score > {rel}"


# ------------------------------------------------------------------------------------------------ fold_keys
FOLD_CASES = {
    # name: (pages, bs, block-table rows, row, n)
    "pages_shuffled": (6, 16, [[5, 1, 3, 0, 2, 4]], 0, 96),
    "minus_one_and_short_table": (6, 16, [[2, -1, 4], [0, 1, 2]], 0, 90),
    "second_row_page_outside_pool": (4, 8, [[0, 1, 2, 3], [3, 9, 1, -1]], 1, 30),
    "n_zero": (2, 8, [[0, 1]], 0, 0),
}


@pytest.mark.parametrize("random_bytes", [False, True])
@pytest.mark.parametrize("case", list(FOLD_CASES))
def test_fold_keys_matches_reference_bytes(case, random_bytes):
    pages, bs, rows, r, n = FOLD_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    kp = make_keys(pages, bs, random_bytes=random_bytes, gen=g)
    bt = torch.tensor(rows, dtype=torch.int32)
    ref = ps.fold_keys_reference(kp, bt, r, n)
    out = ps.fold_keys(kp, bt, r, n, backend="triton")
    assert out.n == ref.n == n and out.codes.dtype == FP8_DTYPE and out.codes.shape == (ps._padded(n), FMT.dim)
    for a, b in zip(_bytes(out), _bytes(ref), strict=True):
        assert torch.equal(a, b)
    # visible entries are the keys themselves with blocks > 11 binades below the key's largest zeroed (random
    # bytes: scales 110-139, so some are), the rest are zero
    vis = ref.factor > 0
    j = torch.arange(ref.factor.shape[0])
    page = bt[r].long()[(j // bs).clamp(max=bt.shape[1] - 1)]
    expect = (j < n) & (j // bs < bt.shape[1]) & (page >= 0) & (page < pages)
    assert torch.equal(vis, expect)
    if vis.any():
        p, row = page[vis], j[vis] % bs
        sc = kp.scale[p, row].long()
        far = (sc.amax(dim=1, keepdim=True) - sc > 11).repeat_interleave(FMT.block, dim=1)
        want = torch.where(far, 0.0, FMT.dequantize(kp.data[p, row], kp.scale[p, row]))
        assert torch.equal(ps.folded_values(ref)[vis], want)
        assert far.any() == random_bytes
    assert not ps.folded_values(ref)[~vis].any()


def test_fold_keys_flushes_far_blocks():
    """A block more than 11 binades below its key's largest is flushed to zero; 11 below is kept exactly."""
    kp = make_keys(1, 8, gen=torch.Generator().manual_seed(3))
    kp.data.fill_(0x77)  # every element 6.0
    kp.scale[0, :, :] = torch.tensor([130, 130 - 11, 130 - 12, 130], dtype=torch.uint8)
    bt = torch.tensor([[0]], dtype=torch.int32)
    for f in (ps.fold_keys_reference(kp, bt, 0, 8), ps.fold_keys(kp, bt, 0, 8, backend="triton")):
        v = ps.folded_values(f)[:8].view(8, 4, 32)
        assert torch.equal(v[:, 1], torch.full((8, 32), 6.0 * 2.0**-8))  # 2**(119 - 127)
        assert not v[:, 2].any()
        assert torch.equal(v[:, 0], torch.full((8, 32), 6.0 * 2.0**3))


def test_fold_keys_errors():
    kp = make_keys(2, 8, gen=torch.Generator().manual_seed(0))
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="table_row"):
        ps.fold_keys(kp, bt, 1, 8)
    with pytest.raises(ValueError, match="n: expected"):
        ps.fold_keys(kp, bt, 0, -1)
    with pytest.raises(ValueError, match="block_table"):
        ps.fold_keys(kp, bt.long(), 0, 8)
    with pytest.raises(ValueError, match="keys.scale"):
        ps.fold_keys(KeyPages(kp.data, kp.scale[..., :2]), bt, 0, 8)


# ------------------------------------------------------------------------------------------------ prefill_scores
def _problem(T, H, n, nv, *, seed, bs=16, wide_q=False):
    g = torch.Generator().manual_seed(seed)
    pages = -(-n // bs) + 1
    kp = make_keys(pages, bs, gen=g)
    bt = torch.randperm(pages, generator=g).to(torch.int32)[None, :]
    q, w = make_query(T, H, g)
    if wide_q:  # blocks of a head 26+ binades apart: one e4m3 scale a head cannot hold them (the general path)
        x = torch.randn(T, H, FMT.dim, generator=g) * torch.tensor([2.0**-20, 1.0, 2.0**6, 1.0]).repeat_interleave(32)
        q = FMT.roundtrip(x, dtype=torch.bfloat16)
    return kp, bt, q, w, torch.tensor(nv, dtype=torch.int32)


SCORE_CASES = {
    # name: (T, H, n, n_visible)
    "causal_rows": (7, 64, 90, [0, 5, 33, 40, 64, 80, 90]),
    "few_heads_odd_rows": (5, 8, 70, [70, 1, 69, 32, 31]),
    "rows_see_nothing": (3, 64, 40, [0, 0, 0]),
    "one_row": (1, 64, 100, [100]),
}


@pytest.mark.parametrize("wide_q", [False, True])
@pytest.mark.parametrize("launch", [{}, {"rows": 4, "block_n": 16}, {"rows": 1, "block_n": 64}])
@pytest.mark.parametrize("case", list(SCORE_CASES))
def test_prefill_scores_matches_reference(case, launch, wide_q):
    T, H, n, nv = SCORE_CASES[case]
    kp, bt, q, w, nv = _problem(T, H, n, nv, seed=len(case) + T, wide_q=wide_q)
    folded = ps.fold_keys(kp, bt, 0, n, backend="triton")
    ref = ps.prefill_scores_reference(q, w, folded, nv, n)
    out = ps.prefill_scores(q, w, folded, nv, n, backend="triton", **launch)
    assert_close_rowmax(out, ref, ATOL_INTERP)
    # without flushed blocks the folded keys are the keys: the scores are indexer_scores' (one request, row 0)
    full = indexer_scores_reference(q, w, kp, bt, torch.zeros(T, dtype=torch.int32), nv, n)
    assert_close_rowmax(out, full, ATOL_INTERP)


def test_prefill_scores_zero_query_heads_and_weights():
    """A row whose query is all zero scores 0 on every visible entry; an all-zero head (its scale exponent taken as
    127) and a zero weight change nothing; negative weights are kept (the head sum is signed)."""
    kp, bt, q, w, nv = _problem(3, 64, 64, [64, 64, 40], seed=9)
    q[0] = 0
    q[1, 5] = 0
    w[2, :8] = -w[2, :8]
    w[1, 7] = 0
    folded = ps.fold_keys(kp, bt, 0, 64, backend="triton")
    out = ps.prefill_scores(q, w, folded, nv, 64, backend="triton")
    assert (out[0] == 0).all()
    assert_close_rowmax(out, ps.prefill_scores_reference(q, w, folded, nv, 64), ATOL_INTERP)


def test_prefill_scores_more_than_64_heads():
    """80 heads pad to 128 on the MMA's N side (two rows a program at most): the reference's scores."""
    kp, bt, q, w, nv = _problem(5, 80, 64, [64, 1, 40, 63, 0], seed=12)
    folded = ps.fold_keys(kp, bt, 0, 64, backend="triton")
    out = ps.prefill_scores(q, w, folded, nv, 64, backend="triton", rows=2)
    assert_close_rowmax(out, ps.prefill_scores_reference(q, w, folded, nv, 64), ATOL_INTERP)


def test_prefill_scores_out_slice_and_fewer_columns():
    """``out`` a column-contiguous slice of a wider buffer; n_cols below folded.n; rows outside stay untouched."""
    kp, bt, q, w, nv = _problem(4, 64, 96, [10, 50, 60, 64], seed=2)
    folded = ps.fold_keys(kp, bt, 0, 96, backend="triton")
    buf = torch.full((6, 64), 7.0)
    out = ps.prefill_scores(q, w, folded, nv, 64, backend="triton", out=buf[1:5])
    assert out.data_ptr() == buf[1:5].data_ptr()
    assert_close_rowmax(buf[1:5], ps.prefill_scores_reference(q, w, folded, nv, 64), ATOL_INTERP)
    assert (buf[0] == 7.0).all() and (buf[5] == 7.0).all()


def test_prefill_scores_counts_past_columns_read_nothing_more():
    """n_visible above n_cols (bad input) is clamped to n_cols in the kernel: no read past the folded keys."""
    kp, bt, q, w, _ = _problem(2, 64, 32, [32, 32], seed=4)
    folded = ps.fold_keys(kp, bt, 0, 32, backend="triton")
    out = ps.prefill_scores(q, w, folded, torch.tensor([32, 1000], dtype=torch.int32), 32, backend="triton")
    assert torch.isfinite(out).all()


def test_prefill_scores_torch_backend_is_the_reference():
    kp, bt, q, w, nv = _problem(3, 64, 40, [40, 20, 0], seed=5)
    folded = ps.fold_keys(kp, bt, 0, 40, backend="torch")
    out = ps.prefill_scores(q, w, folded, nv, 40, backend="torch")
    assert torch.equal(out, ps.prefill_scores_reference(q, w, folded, nv, 40))


def test_prefill_scores_errors():
    kp, bt, q, w, nv = _problem(2, 64, 32, [32, 32], seed=6)
    folded = ps.fold_keys(kp, bt, 0, 32, backend="torch")
    with pytest.raises(ValueError, match="n_cols"):
        ps.prefill_scores(q, w, folded, nv, 33)
    with pytest.raises(ValueError, match="q: expected"):
        ps.prefill_scores(torch.zeros(2, 64, 64, dtype=torch.bfloat16), w, folded, nv, 32)
    with pytest.raises(ValueError, match="rows x 128"):  # 65 heads pad to 128: two rows fill the N side
        q65 = torch.zeros(2, 65, 128, dtype=torch.bfloat16)
        ps.prefill_scores(q65, torch.zeros(2, 65), folded, nv, 32, backend="triton", rows=4)
    with pytest.raises(ValueError, match="weights"):
        ps.prefill_scores(q, w.double(), folded, nv, 32)
    with pytest.raises(ValueError, match="out"):
        ps.prefill_scores(q, w, folded, nv, 32, out=torch.empty(2, 31))
    with pytest.raises(ValueError, match="folded"):
        ps.prefill_scores(q, w, ps.FoldedKeys(folded.codes[:64], folded.factor[:64], 200), nv, 32)
    with pytest.raises(ValueError, match="block_n"):
        ps.prefill_scores(q, w, folded, nv, 32, backend="triton", block_n=256)
    with pytest.raises(ValueError, match="rows"):
        ps.prefill_scores(q, w, folded, nv, 32, backend="triton", rows=3)


def test_prefill_launch_grid():
    """Groups of rows; a group's tiles split over programs only while the grid is small."""
    cpu = torch.device("cpu")
    assert ps.prefill_launch(65536, 16384, cpu, 4, 128) == (16384, 1, 128)
    groups, per, tiles = ps.prefill_launch(8, 16384, cpu, 4, 128)
    assert groups == 2 and per * tiles >= 128 and tiles >= ps._MIN_TILES and (per - 1) * tiles < 128
    assert ps.prefill_launch(1, 10, cpu, 4, 128) == (1, 1, 1)


# ------------------------------------------------------------------------------------------------ GPU
@gpu
@needs_cuda
@pytest.mark.parametrize("launch", [{}, {"rows": 2, "block_n": 64, "num_warps": 4}, {"rows": 2}])
@pytest.mark.parametrize("wide_q", [False, True])
def test_gpu_prefill_scores_real_shapes(launch, wide_q):
    """V4-Flash indexer shapes (64 heads, 64-entry pages): 1,024 query rows of one request seeing a causal
    prefix of 4,096 entries, against the reference on the folded keys and against indexer_scores(gluon_fold)."""
    T, n, bs = 1024, 4096, 64
    nv = ((torch.arange(T) * 4 + 4) * n // (4 * T)).clamp(max=n).tolist()
    kp, bt, q, w, nvt = _problem(T, 64, n, nv, seed=11, bs=bs, wide_q=wide_q)
    dev = torch.device("cuda")
    kp = KeyPages(kp.data.to(dev), kp.scale.to(dev))
    bt, q, w, nvt = bt.to(dev), q.to(dev), w.to(dev), nvt.to(dev)
    folded = ps.fold_keys(kp, bt, 0, n)
    ref_f = ps.fold_keys_reference(kp, bt, 0, n)
    assert torch.equal(folded.codes.view(torch.uint8), ref_f.codes.view(torch.uint8))
    assert torch.equal(folded.factor, ref_f.factor)
    out = ps.prefill_scores(q, w, folded, nvt, n, **launch)
    ref = ps.prefill_scores_reference(q, w, folded, nvt, n)
    assert_close_rowmax(out.cpu(), ref.cpu(), REL_GPU)
    tr = torch.zeros(T, dtype=torch.int32, device=dev)
    gf = indexer_scores(q, w, kp, bt, tr, nvt, n, impl="gluon_fold")
    assert_close_rowmax(out.cpu(), gf.cpu(), 2 * REL_GPU)
