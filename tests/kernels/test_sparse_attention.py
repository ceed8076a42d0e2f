"""Sparse attention read path: Triton kernel vs PyTorch reference vs an independent dense softmax.

Tolerances (kernel vs reference): the kernel rounds the probabilities to bf16 before P.V (the reference
does not) and both round the output to bf16, so outputs agree to a couple of bf16 ulps:
|delta| <= 2e-2 + 1.6e-2 * |ref| and mean |delta| <= 2e-3; lse (fp32 on both sides, only the summation
order differs) to 1e-4 absolute.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from dsv4.formats import FP8EntryFormat
from dsv4.kernels.attention import (
    MIN_KEYS_PER_SPLIT,
    choose_num_splits,
    sparse_attention,
    sparse_attention_reference,
    sparse_attention_triton,
)

FMT = FP8EntryFormat()
D = FMT.head_dim
SCALE = D**-0.5
NEG_INF = float("-inf")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_pages(num_pages: int, bs: int, gen: torch.Generator, device="cpu"):
    """Random entries written through the format into MODEL1 pages; returns (pages, values [slots, D] fp32)."""
    flat = torch.zeros(num_pages * FMT.page_bytes(bs), dtype=torch.uint8)
    pages = FMT.entry_pages(flat, num_pages, bs)
    x = torch.randn(num_pages, bs, D, generator=gen)
    # different magnitudes per 64-wide tile so that the UE8M0 scales differ across tiles and entries
    mag = 2.0 ** torch.randint(-3, 3, (num_pages, bs, D // FMT.tile, 1), generator=gen).float()
    x = (x.unflatten(-1, (D // FMT.tile, FMT.tile)) * mag).flatten(-2)
    nope, rope, scale = FMT.quantize(x)
    pages.nope.view(torch.uint8).copy_(nope.view(torch.uint8))
    pages.rope.copy_(rope)
    pages.scale.copy_(scale)
    values = FMT.dequantize(nope, rope, scale).float().reshape(num_pages * bs, D)
    if device != "cpu":
        flat = flat.to(device)
        pages = FMT.entry_pages(flat, num_pages, bs)
    return pages, values.to(device)


def make_q(T: int, H: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    q = torch.randn(T, H, D, generator=gen) * 2.0
    return q.to(torch.bfloat16).to(device)


def dense_attention(q, caches_values, sink, scale):
    """Independent oracle: torch.softmax over concatenated logits with the sink as an extra column."""
    T, H, _ = q.shape
    outs, lses = [], []
    for t in range(T):
        keys = []
        for values, idx in caches_values:
            for s in idx[t].tolist():
                if 0 <= s < values.shape[0]:
                    keys.append(values[s])
        k = torch.stack(keys) if keys else torch.zeros(0, D, dtype=torch.float32, device=q.device)
        logits = q[t].double() @ k.double().T * scale  # [H, N]
        full = torch.cat([logits, sink.double()[:, None]], dim=1)
        probs = torch.softmax(full, dim=1)[:, :-1]  # the sink column's value vector is zero: drop it
        outs.append(probs @ k.double())
        lses.append(torch.logsumexp(full, dim=1))
    return torch.stack(outs), torch.stack(lses)


def assert_close_bf16(got, ref):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all()
    diff = (got - ref).abs()
    bound = 2e-2 + 1.6e-2 * ref.abs()
    assert (diff <= bound).all(), f"max |delta| {diff.max().item():.4g} at {divmod(int(diff.argmax()), ref.shape[-1])}"
    assert diff.mean() <= 2e-3, f"mean |delta| {diff.mean().item():.4g}"


def two_caches(T, gen, k_win=32, k_pool=64, device="cpu"):
    """A window ring (one page of 128 rows per request) and a pool of 16-entry pages, random index rows."""
    win, win_vals = make_pages(T, 128, gen, device)
    pool, pool_vals = make_pages(8, 16, gen, device)
    widx = torch.stack([t * 128 + torch.randperm(128, generator=gen)[:k_win] for t in range(T)]).int()
    pidx = torch.randint(0, pool.num_slots, (T, k_pool), generator=gen).int()
    return [(win, widx.to(device)), (pool, pidx.to(device))], [(win_vals, widx), (pool_vals, pidx)]


# ---------------------------------------------------------------------------- reference vs dense oracle
def test_reference_matches_dense_softmax():
    gen = torch.Generator().manual_seed(1)
    T, H = 3, 4
    caches, vals = two_caches(T, gen, k_win=20, k_pool=24)
    caches[1][1][0, ::2] = -1  # interleaved invalid
    caches[0][1][1, :] = -1  # empty window for row 1
    sink = torch.randn(H, generator=gen)
    q = make_q(T, H, gen)
    out, lse = sparse_attention_reference(q, caches, sink, SCALE)
    o_ref, l_ref = dense_attention(q.float(), vals, sink, SCALE)
    torch.testing.assert_close(out.float(), o_ref.float(), atol=1e-2, rtol=8e-3)  # bf16 output rounding
    torch.testing.assert_close(lse, l_ref.float(), atol=1e-4, rtol=1e-5)


def test_reference_duplicates_count_twice():
    """[s, s] with sink c equals [s] with sink c - ln 2: duplicates are attended, not de-duplicated."""
    gen = torch.Generator().manual_seed(2)
    pages, _ = make_pages(2, 16, gen)
    q = make_q(2, 4, gen)
    sink = torch.randn(4, generator=gen)
    dup = torch.tensor([[5, 5], [20, 20]], dtype=torch.int32)
    one = torch.tensor([[5, -1], [20, -1]], dtype=torch.int32)
    o2, l2 = sparse_attention_reference(q, [(pages, dup)], sink, SCALE)
    o1, l1 = sparse_attention_reference(q, [(pages, one)], sink - math.log(2.0), SCALE)
    torch.testing.assert_close(o2.float(), o1.float(), atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(l2, l1 + math.log(2.0), atol=1e-5, rtol=1e-6)
    assert not torch.allclose(o2.float(), sparse_attention_reference(q, [(pages, one)], sink, SCALE)[0].float())


# ---------------------------------------------------------------------------- kernel vs reference
PATHS = ["fused", "gathered"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T,H", [(1, 4), (4, 8), (8, 16)])
def test_kernel_matches_reference(T, H, path):
    gen = torch.Generator().manual_seed(10 + H)
    caches, _ = two_caches(T, gen)
    sink = torch.randn(H, generator=gen)
    q = make_q(T, H, gen)
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, path=path)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_kernel_invalid_patterns_and_sink_only_rows(path):
    """Empty window, fewer valid entries than K, interleaved -1, out-of-range slots, a sink-only row."""
    gen = torch.Generator().manual_seed(3)
    T, H = 5, 8
    caches, vals = two_caches(T, gen, k_win=24, k_pool=40)
    (win, widx), (pool, pidx) = caches
    widx[0] = -1  # row 0: empty window, pool only
    pidx[1, 17:] = -1  # row 1: fewer valid pool entries than K
    pidx[2, 1::2] = -1  # row 2: interleaved -1
    widx[3, ::3] = -7  # row 3: other negative values and out-of-range slots are skipped too
    pidx[3, ::4] = pool.num_slots + 5
    widx[4] = -1  # row 4: nothing valid -> only the sink
    pidx[4] = -1
    sink = torch.randn(H, generator=gen)
    sink[H - 1] = NEG_INF  # a padded head: with no entries its lse is -inf and its output 0
    q = make_q(T, H, gen)
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, path=path)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    o_dense, l_dense = dense_attention(q.float(), vals, sink, SCALE)
    assert_close_bf16(out, o_ref)
    assert_close_bf16(o_ref, o_dense)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(lse[:4], l_dense[:4].float(), atol=1e-4, rtol=1e-5)
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert torch.equal(lse[4, : H - 1], sink[: H - 1])
    assert lse[4, H - 1] == NEG_INF and torch.isfinite(lse[:4]).all()
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("path", PATHS)
def test_kernel_split_path_matches_reference(path):
    """A long key list with few heads through the flash-decoding split + combine path."""
    gen = torch.Generator().manual_seed(4)
    T, H = 2, 4
    caches, _ = two_caches(T, gen, k_win=32, k_pool=128)
    caches[1][1][1, 50:] = -1  # some splits of row 1 see no valid key at all
    sink = torch.randn(H, generator=gen)
    q = make_q(T, H, gen)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    for splits in (3, 5):
        out, lse = sparse_attention_triton(q, caches, sink, SCALE, num_splits=splits, block_n=16, path=path)
        assert_close_bf16(out, o_ref)
        torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "variant",
    [
        {"qk_tiles": 2},
        {"d_split": 2},
        {"qk_tiles": 1, "d_split": 4},
        {"qk_tiles": 4, "d_split": 2, "num_splits": 3},
        {"d_split": 8, "block_h": 32, "num_splits": 1},
    ],
)
def test_kernel_variants_match_reference(variant):
    """D-chunked QK^T (q re-loaded per chunk) and the output-dim split, alone, together and with key splits.

    Heads not a multiple of block_h, invalid slots and a sink-only row exercise the masks of every variant.
    """
    gen = torch.Generator().manual_seed(7)
    T, H = 3, 20
    caches, _ = two_caches(T, gen, k_win=24, k_pool=40)
    caches[1][1][0, ::3] = -1
    caches[0][1][2] = -1
    caches[1][1][2] = -1  # row 2: no valid key -> out 0, lse = sink
    sink = torch.randn(H, generator=gen)
    q = make_q(T, H, gen)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, block_n=16, **variant)
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("path", PATHS)
def test_kernel_strided_index_rows_and_sink(path):
    """Index rows and a sink that are views with non-unit inner strides: the kernels read them as ptr + i."""
    gen = torch.Generator().manual_seed(14)
    T, H = 3, 8
    caches, _ = two_caches(T, gen, k_win=16, k_pool=24)
    wide = [(pages, torch.stack([idx, torch.full_like(idx, -1)], dim=-1).flatten(-2)) for pages, idx in caches]
    strided = [(pages, w[:, ::2]) for pages, w in wide]
    assert all(idx.stride(-1) == 2 for _, idx in strided)
    sink2 = torch.randn(2 * H, generator=gen)
    sink = sink2[::2]
    q = make_q(T, H, gen)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink.contiguous(), SCALE)
    out, lse = sparse_attention_triton(q, strided, sink, SCALE, path=path)
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)


def test_gathered_path_row_slices(monkeypatch):
    """A workspace cap smaller than the step: the rows run in slices (2 rows each here), same results."""
    sa = importlib.import_module("dsv4.kernels.attention.sparse_attention")  # the package attr is the function

    gen = torch.Generator().manual_seed(13)
    T, H = 5, 8
    caches, _ = two_caches(T, gen, k_win=16, k_pool=40)
    caches[1][1][3, ::2] = -1
    sink, q = torch.randn(H, generator=gen), make_q(T, H, gen)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    cols = 2 * 16 + 3 * 16  # both lists padded to block_n = 16
    monkeypatch.setattr(sa, "GATHERED_MAX_BYTES", 2 * cols * (2 * D + 4))
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, block_n=16, path="gathered")
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)


def test_gathered_path_no_keys_and_choice():
    """Every list empty (K = 0) on the gathered path: out 0, lse = sink; an unknown path is rejected."""
    gen = torch.Generator().manual_seed(9)
    caches, _ = two_caches(2, gen, k_win=8, k_pool=8)
    caches = [(caches[0][0], caches[0][1][:, :0]), (caches[1][0], caches[1][1][:, :0])]
    q, sink = make_q(2, 4, gen), torch.randn(4, generator=gen)
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, path="gathered")
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, sink.expand(2, 4))
    with pytest.raises(ValueError, match="path"):
        sparse_attention_triton(q, caches, sink, SCALE, path="dense")


def test_kernel_variant_arguments_rejected():
    gen = torch.Generator().manual_seed(8)
    caches, _ = two_caches(1, gen, k_win=8, k_pool=8)
    q, sink = make_q(1, 4, gen), torch.zeros(4)
    for bad in ({"qk_tiles": 3}, {"qk_tiles": 16}, {"d_split": 0}, {"d_split": 3}):
        with pytest.raises(ValueError, match="qk_tiles|d_split"):
            sparse_attention_triton(q, caches, sink, SCALE, **bad)


def test_choose_num_splits():
    per_split = MIN_KEYS_PER_SPLIT // 32  # blocks of 32 keys per split, at least
    # decode of one request with few heads and 8192 HCA entries: split
    assert choose_num_splits(rows=1, head_blocks=1, total_blocks=8320 // 32, block_n=32, num_sms=132) > 8
    # enough programs already, or a short list: no split
    assert choose_num_splits(rows=64, head_blocks=8, total_blocks=36, block_n=32, num_sms=132) == 1
    assert choose_num_splits(rows=1, head_blocks=1, total_blocks=per_split, block_n=32, num_sms=132) == 1
    # never more splits than allowed by the minimum keys per split
    assert choose_num_splits(rows=1, head_blocks=1, total_blocks=5 * per_split, block_n=32, num_sms=132) == 5
    # a grid of >= num_sms / 4 programs is not split (B = 64 decode: the workspace round trip costs more)
    assert choose_num_splits(rows=8, head_blocks=8, total_blocks=1000, block_n=32, num_sms=132) == 1
    assert choose_num_splits(rows=64, head_blocks=2, total_blocks=1000, block_n=64, num_sms=132) == 1
    # smaller grids are split up to ~num_sms / 4 programs: B = 8, one head block -> ceil(132 / 32) = 5
    assert choose_num_splits(rows=8, head_blocks=1, total_blocks=1000, block_n=32, num_sms=132) == 5
    # B = 1 with 2 head blocks (V4-Pro) -> ceil(132 / 8) = 17
    assert choose_num_splits(rows=1, head_blocks=2, total_blocks=130, block_n=64, num_sms=132) == 17


@pytest.mark.parametrize("path", PATHS)
def test_kernel_duplicates_pages_and_three_caches(path):
    """Duplicated slots, entries spread over pages, a third cache (pairs + combine), an empty (K=0) cache."""
    gen = torch.Generator().manual_seed(5)
    T, H = 3, 8
    caches, vals = two_caches(T, gen, k_win=16, k_pool=32)
    pool = caches[1][0]
    dup = torch.tensor([[0, 0, 0, 17, 17, 127], [127, 126, 16, 15, 15, -1], [64, 64, 64, 64, 1, 2]], dtype=torch.int32)
    empty = torch.zeros(T, 0, dtype=torch.int32)
    caches = [*caches, (pool, dup), (pool, empty)]
    vals = [*vals, (vals[1][0], dup), (vals[1][0], empty)]
    sink = torch.randn(H, generator=gen)
    q = make_q(T, H, gen)
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, path=path)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    o_dense, _ = dense_attention(q.float(), vals, sink, SCALE)
    assert_close_bf16(out, o_ref)
    assert_close_bf16(o_ref, o_dense)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)


def test_out_given_and_strided():
    gen = torch.Generator().manual_seed(6)
    T, H = 2, 4
    caches, _ = two_caches(T, gen, k_win=16, k_pool=16)
    sink = torch.randn(H, generator=gen)
    q = make_q(T, H, gen)
    o_ref, _ = sparse_attention_reference(q, caches, sink, SCALE)
    for backend in ("torch", "triton"):
        big = torch.full((T, H + 2, D), 7.0, dtype=torch.bfloat16)
        view = big[:, 1 : H + 1]  # strided: row stride (H + 2) * D, not H * D
        out, _ = sparse_attention(q, caches, sink, SCALE, backend=backend, out=view)
        assert out is view
        assert_close_bf16(view, o_ref)
        assert (big[:, 0] == 7).all() and (big[:, H + 1] == 7).all()  # nothing written outside out


def test_auto_on_cpu_is_reference_and_validation():
    gen = torch.Generator().manual_seed(7)
    T, H = 2, 4
    caches, _ = two_caches(T, gen, k_win=8, k_pool=8)
    sink = torch.randn(H, generator=gen)
    q = make_q(T, H, gen)
    o_auto, l_auto = sparse_attention(q, caches, sink, SCALE)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    assert torch.equal(o_auto, o_ref) and torch.equal(l_auto, l_ref)
    with pytest.raises(ValueError, match="q"):
        sparse_attention(q.float(), caches, sink, SCALE)
    with pytest.raises(ValueError, match="sink"):
        sparse_attention(q, caches, sink[:2], SCALE)
    with pytest.raises(ValueError, match="idx"):
        sparse_attention(q, [(caches[0][0], caches[0][1].long())], sink, SCALE)
    with pytest.raises(ValueError, match="idx"):
        sparse_attention(q, [(caches[0][0], caches[0][1][:1])], sink, SCALE)
    with pytest.raises(ValueError, match="caches"):
        sparse_attention(q, [], sink, SCALE)
    with pytest.raises(ValueError, match="out"):
        sparse_attention(q, caches, sink, SCALE, out=torch.empty(T, H, D))
    with pytest.raises(ValueError, match="backend"):
        sparse_attention(q, caches, sink, SCALE, backend="cuda")


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T,H,k_pool,splits", [(4, 64, 512, None), (2, 128, 1024, None), (1, 64, 2048, 8)])
def test_kernel_matches_reference_gpu(T, H, k_pool, splits, path):
    gen = torch.Generator().manual_seed(11)
    win, _ = make_pages(T, 128, gen, "cuda")
    pool, _ = make_pages(64, 64, gen, "cuda")
    widx = torch.arange(T * 128, dtype=torch.int32).view(T, 128).cuda()
    widx[0, 100:] = -1
    pidx = torch.randint(0, pool.num_slots, (T, k_pool), generator=gen).int().cuda()
    pidx[-1, k_pool // 3 :] = -1
    caches = [(win, widx), (pool, pidx)]
    sink = torch.randn(H, generator=gen).cuda()
    q = make_q(T, H, gen, "cuda")
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, num_splits=splits, path=path)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "variant",
    [
        {"num_warps": 16},
        {"qk_tiles": 2},
        {"qk_tiles": 1, "num_warps": 16},
        {"d_split": 2},
        {"d_split": 4, "qk_tiles": 2},
        {"path": "gathered", "num_stages": 3, "block_n": 32},
        {"path": "gathered", "num_splits": 5},
        # {"block_h": 128, "num_warps": 16} does not compile on sm90 (ptxas: "Insufficient registers (128)",
        # H200 2026-12-02): a 128 x 512 fp32 accumulator does not fit 16 warps' register budget.
    ],
)
def test_kernel_variants_match_reference_gpu(variant):
    gen = torch.Generator().manual_seed(12)
    T, H = 3, 128
    win, _ = make_pages(T, 128, gen, "cuda")
    pool, _ = make_pages(64, 64, gen, "cuda")
    widx = torch.arange(T * 128, dtype=torch.int32).view(T, 128).cuda()
    pidx = torch.randint(0, pool.num_slots, (T, 1024), generator=gen).int().cuda()
    pidx[1, 300:] = -1
    caches = [(win, widx), (pool, pidx)]
    sink = torch.randn(H, generator=gen).cuda()
    q = make_q(T, H, gen, "cuda")
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, **variant)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)
