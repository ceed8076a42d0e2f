"""fp32 pair linear for the compressor projections (dsv4/kernels/linear.py) against its PyTorch reference.

On the CPU the Triton kernel runs under the interpreter, where ``tl.dot`` computes in fp32 whatever the
``input_precision``: those tests check the tiling, masking, K splits and the w1/w2 selection.  The tf32x3
numerics are checked by the GPU tests at the real widths (K = 4096).
"""

import pytest
import torch

from dsv4.engine.graphs import capture_graph
from dsv4.kernels import linear as linear_mod
from dsv4.kernels.linear import (
    linear_counters,
    linear_fp32_group,
    linear_fp32_pair,
    linear_fp32_pair_reference,
    linear_launch,
)

U = 2.0**-24  # fp32 unit roundoff


def _inputs(m, k, n1, n2, device, seed=0, integer=False):
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers: every product and partial sum is exact in fp32 and in tf32 parts
        x, w1, w2 = (torch.randint(-4, 5, shape, generator=g).float() for shape in ((m, k), (n1, k), (n2, k)))
    else:
        x = torch.randn(m, k, generator=g)
        w1, w2 = torch.randn(n1, k, generator=g) * 0.05, torch.randn(n2, k, generator=g) * 0.05
    return x.to(device), w1.to(device), w2.to(device)


def _scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x|·|w|ᵀ in fp64: the sum of the magnitudes of the terms of each output, which rounding errors scale with."""
    return x.double().abs() @ w.double().abs().T


def _assert_close_fp32(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rel: float) -> None:
    """|got - want| <= rel · (|x|·|w|ᵀ) elementwise (plus a subnormal-sized floor for all-zero rows)."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want.double()).abs()
    bound = rel * _scale(x, w) + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.3g} x the bound rel={rel:.3g}·(|x|·|w|ᵀ)"


# Interpreter / small shapes: two fp32 sums of the same K terms in different orders (the kernel's tiles and
# splits, torch's blocking) each differ from the exact sum by at most γ_K·Σ|terms| ≈ K·2^-24·(|x|·|w|ᵀ)
# (the standard worst-case bound), so they differ from each other by at most twice that.  On a GPU the
# tf32x3 products add their own <= 3·2^-22 per product.  Any tiling bug (a missed or doubled K block, a
# wrong row or column) moves an output by O(1)·(|x|·|w|ᵀ), far outside this bound.
def _small_shape_rel(k: int) -> float:
    return 2 * k * U + 3 * 2.0**-22


# The default K block is 32; the other launches take 64 so that K = 96 (and 160) ends in a masked partial block.
LAUNCHES = {
    "default": {},
    "split3": {"split_k": 3, "block_k": 64},  # at K = 96 the second split is a partial block, the third empty
    "tiles16": {"block_m": 16, "block_n": 16, "block_k": 64, "split_k": 2, "swap_ab": False},
}


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("n1,n2", [(16, 16), (48, 100), (100, 48)])
@pytest.mark.parametrize("k", [64, 96, 256])
@pytest.mark.parametrize("m", [0, 1, 5, 33])
def test_linear_pair_matches_reference(device, m, k, n1, n2, launch):
    """Both outputs against two F.linear calls: M = 0, M below / above a 16-row tile, K not a multiple of
    the K block (masked tail), N1 != N2 (the program's weight is picked by its N tile), with and without K
    splits, both MMA orientations."""
    x, w1, w2 = _inputs(m, k, n1, n2, device, seed=m * 1000 + k + n1)
    y1, y2 = linear_fp32_pair(x, w1, w2, backend="triton", **LAUNCHES[launch])
    r1, r2 = linear_fp32_pair_reference(x, w1, w2)
    assert y1.shape == (m, n1) and y2.shape == (m, n2)
    _assert_close_fp32(y1, r1, x, w1, _small_shape_rel(k))
    _assert_close_fp32(y2, r2, x, w2, _small_shape_rel(k))


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_linear_pair_exact_on_integers(device, launch):
    """With small integer inputs every product and partial sum is exact (in fp32 and in tf32 parts), so the
    kernel must return exactly the reference whatever its tiling, split or summation order."""
    x, w1, w2 = _inputs(37, 160, 72, 24, device, seed=5, integer=True)
    y1, y2 = linear_fp32_pair(x, w1, w2, backend="triton", **LAUNCHES[launch])
    r1, r2 = linear_fp32_pair_reference(x, w1, w2)
    assert torch.equal(y1, r1) and torch.equal(y2, r2)


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_linear_pair_bf16x3(device, launch):
    """precision="bf16x3" (bf16 x; each weight tile split exactly into three bf16 pieces): exact on small integers
    whatever the tiling (products and sums exact), within the fp32 summation bound on random data, and refused for
    an fp32 x (its products would not be exact)."""
    x, w1, w2 = _inputs(37, 160, 72, 24, device, seed=5, integer=True)
    y = linear_fp32_pair(x.bfloat16(), w1, w2, backend="triton", precision="bf16x3", **LAUNCHES[launch])
    r = linear_fp32_pair_reference(x, w1, w2)
    assert torch.equal(y[0], r[0]) and torch.equal(y[1], r[1])
    x, w1, w2 = _inputs(33, 96, 48, 100, device, seed=6)
    xb = x.bfloat16()
    y = linear_fp32_pair(xb, w1, w2, backend="triton", precision="bf16x3", **LAUNCHES[launch])
    r = linear_fp32_pair_reference(xb.float(), w1, w2)
    for g, w, t in ((y[0], w1, r[0]), (y[1], w2, r[1])):
        _assert_close_fp32(g, t, xb.float(), w, 2 * 96 * U)  # no tf32 term: only the two fp32 sums' orders
    with pytest.raises(ValueError, match="bf16x3"):
        linear_fp32_pair(x, w1, w2, backend="triton", precision="bf16x3")


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_linear_pair_bf16w(device, launch):
    """precision="bf16w" (bf16 x, weights exact in bf16): exact on small integers, within the fp32 summation bound on
    weights rounded to bf16; ``bf16_exact`` tells such weights from fp32 ones; an fp32 x is refused."""
    x, w1, w2 = _inputs(37, 160, 72, 24, device, seed=5, integer=True)
    assert linear_mod.bf16_exact(w1, w2)
    y = linear_fp32_pair(x.bfloat16(), w1, w2, backend="triton", precision="bf16w", **LAUNCHES[launch])
    r = linear_fp32_pair_reference(x, w1, w2)
    assert torch.equal(y[0], r[0]) and torch.equal(y[1], r[1])
    x, w1, w2 = _inputs(33, 96, 48, 100, device, seed=7)
    assert not linear_mod.bf16_exact(w1)
    xb, w1, w2 = x.bfloat16(), w1.bfloat16().float(), w2.bfloat16().float()
    assert linear_mod.bf16_exact(w1, w2)
    y = linear_fp32_pair(xb, w1, w2, backend="triton", precision="bf16w", **LAUNCHES[launch])
    r = linear_fp32_pair_reference(xb.float(), w1, w2)
    for g, w, t in ((y[0], w1, r[0]), (y[1], w2, r[1])):
        _assert_close_fp32(g, t, xb.float(), w, 2 * 96 * U)
    with pytest.raises(ValueError, match="bf16w"):
        linear_fp32_pair(x, w1, w2, backend="triton", precision="bf16w")


@pytest.mark.parametrize("precision", ["tf32x3", "bf16w", "bf16x3"])
@pytest.mark.parametrize("launch", [{}, {"split_k": 3, "block_k": 64}, {"gemv": True}])
def test_linear_group_bf16_weights_are_their_fp32_values(device, precision, launch):
    """Weights given in bf16 (half the bytes) give the bits of the same values given in fp32, on every path; one
    dtype a group."""
    x, w1, w2 = _inputs(3 if "gemv" in launch else 9, 96, 48, 40, device, seed=8)
    xb, b1, b2 = x.bfloat16(), w1.bfloat16(), w2.bfloat16()
    if "gemv" in launch and precision != "tf32x3":
        pytest.skip("the few-token kernel has one precision (exact fp32 FMAs)")
    got = linear_fp32_group(xb, [b1, b2], backend="triton", precision=precision, **launch)
    want = linear_fp32_group(xb, [b1.float(), b2.float()], backend="triton", precision=precision, **launch)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    ref = linear_fp32_group(xb, [b1, b2], backend="torch")
    for r, w in zip(ref, (b1, b2), strict=True):  # the torch path: F.linear of the fp32 values
        assert torch.equal(r, torch.nn.functional.linear(xb.float(), w.float()))
    with pytest.raises(ValueError, match="one dtype"):
        linear_fp32_group(xb, [b1, w2], backend="triton")


def test_linear_pair_strided_inputs(device):
    """x a column slice of a wider tensor (row stride 200, unit last stride), w1 a column slice, w2 rows of a
    fused [N1 + N2, K] weight; and x with a non-unit last stride (a transposed view: copied)."""
    m, k, n1, n2 = 9, 96, 40, 24
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(m, 200, generator=g).to(device)
    x = wide[:, 8 : 8 + k]
    assert x.stride() == (200, 1)
    w1 = (torch.randn(n1, k + 32, generator=g) * 0.05).to(device)[:, 32:]
    fused = (torch.randn(n1 + n2, k, generator=g) * 0.05).to(device)
    w2 = fused[n1:]
    xt = x.contiguous().T.contiguous().T
    assert xt.stride(1) != 1
    for xx in (x, xt):
        y1, y2 = linear_fp32_pair(xx, w1, w2, backend="triton", split_k=2)
        r1, r2 = linear_fp32_pair_reference(x, w1, w2)
        _assert_close_fp32(y1, r1, x, w1, _small_shape_rel(k))
        _assert_close_fp32(y2, r2, x, w2, _small_shape_rel(k))


@pytest.mark.parametrize("launch", ["split3", "tiles16", "split2_m33"])
def test_linear_pair_fused_split_sum_is_bit_identical(device, launch, monkeypatch):
    """``counters``: the last program of each output tile adds the K-split partials inside the one launch.  Same
    order as the second launch, so the outputs are bit-identical to it; every counter is back at 0 afterwards
    (a second call with the same counters gives the same bits).  Random data, so the order matters: a fused sum
    in another order would differ in the last bits.  The M limit of the fused sum is lifted so that M = 33 in
    16-row tiles exercises one counter per (M tile, N tile)."""
    monkeypatch.setattr(linear_mod, "FUSED_SUM_MAX_M", 1 << 30)
    extra = {"split2_m33": {"split_k": 2, "block_m": 16, "block_k": 32}}  # 3 M tiles: counters per (m, n) tile
    kw = extra[launch] if launch in extra else LAUNCHES[launch]
    x, w1, w2 = _inputs(33, 160, 72, 40, device, seed=11)
    two = linear_fp32_pair(x, w1, w2, backend="triton", **kw)
    cnt = torch.zeros(64, dtype=torch.int32, device=device)
    for _ in range(2):
        one = linear_fp32_pair(x, w1, w2, backend="triton", counters=cnt, **kw)
        assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
        assert int(cnt.abs().sum()) == 0


def test_linear_pair_counters_above_the_fused_limit(device):
    """Above FUSED_SUM_MAX_M tokens ``counters`` are not used: the split sum is the second launch (same bits)."""
    m = linear_mod.FUSED_SUM_MAX_M + 1
    x, w1, w2 = _inputs(m, 128, 64, 64, device, seed=4)
    cnt = torch.full((64,), 7, dtype=torch.int32, device=device)  # would break a fused sum: must stay untouched
    got = linear_fp32_pair(x, w1, w2, backend="triton", split_k=2, counters=cnt)
    want = linear_fp32_pair(x, w1, w2, backend="triton", split_k=2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert bool((cnt == 7).all())


@pytest.mark.parametrize("tf32x2", [True, False])
@pytest.mark.parametrize("launch", [{"split_k": 2}, {"swap_ab": False, "block_m": 16}])
def test_linear_pair_bf16_input_is_its_fp32_value(device, tf32x2, launch, monkeypatch):
    """x in bf16 is widened in the kernel: the result of passing x.float().  With ``TF32X2`` (two products a K block,
    x being exact in tf32) the GPU gives the very bits of tf32x3 on x.float(); the interpreter's dots are plain fp32
    (no tf32 rounding), where splitting w into its tf32 parts only reorders the sum: within the fp32 bound.  On the
    GPU (H100, triton 3.6, 2026-12-05) the unswapped launch (x the MMA's A operand) gives other last bits for a bf16
    x than for its fp32 value, with and without TF32X2: there only the bound is checked."""
    monkeypatch.setattr(linear_mod, "TF32X2", tf32x2)
    x, w1, w2 = _inputs(6, 96, 48, 32, device, seed=3)
    xb = x.to(torch.bfloat16)
    got = linear_fp32_pair(xb, w1, w2, backend="triton", **launch)
    want = linear_fp32_pair(xb.float(), w1, w2, backend="triton", **launch)
    if (device.type == "cuda" and launch.get("swap_ab", True)) or (device.type == "cpu" and not tf32x2):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = linear_fp32_pair(xb, w1, w2, backend="torch")
    for g, w, r in ((got[0], w1, ref[0]), (got[1], w2, ref[1])):
        _assert_close_fp32(g, r, xb.float(), w, _small_shape_rel(96))


def test_tf32_rounding_is_cvt_rna(device):
    """``_tf32_rna``'s bit trick: nearest tf32 with ties away from zero (the rule written out on the bits, at and
    around each rounding case, both signs, subnormals), infinities kept."""
    import triton
    import triton.language as tl

    @triton.jit
    def rna(x_ptr, y_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(y_ptr + i, linear_mod._tf32_rna(tl.load(x_ptr + i)))

    bits = torch.tensor([0x3F800000, 0x3F800FFF, 0x3F801000, 0x3F801001, 0x3F803000, 0xBF801000, 0xBF800FFF,
                         0x7F800000, 0xFF800000, 0x00000FFF, 0x00001000, 0x7F7FE000, 0x80001000, 0x3F7FF000,
                         0x40000000, 0xC0001FFF], dtype=torch.int64)  # fmt: skip
    v = bits.to(torch.int32).view(torch.float32).to(device)
    out = torch.empty_like(v)
    rna[(1,)](v, out, N=16)
    got = out.cpu().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mag = bits & 0x7FFFFFFF
    want = torch.where(mag >= 0x7F800000, bits, ((mag + 0x1000) & ~0x1FFF) | (bits & 0x80000000))
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("m, split_k", [("above", 2), (40, 1)])
def test_linear_pair_short_counters_when_not_summing_in_place(device, m, split_k):
    """Counters are only checked where the launch sums its splits in place: above FUSED_SUM_MAX_M tokens or without a
    split (a prefill's GEMM has more tiles than a layer's counters: 10,240 at 65,536 tokens of V4-Flash CSA, 4,096
    counters), a short buffer is fine and untouched."""
    m = linear_mod.FUSED_SUM_MAX_M + 1 if m == "above" else m
    x, w1, w2 = _inputs(m, 128, 64, 64, device, seed=5)
    cnt = torch.zeros(1, dtype=torch.int32, device=device)
    got = linear_fp32_pair(x, w1, w2, backend="triton", split_k=split_k, block_n=32, block_m=16, counters=cnt)
    want = linear_fp32_pair(x, w1, w2, backend="triton", split_k=split_k, block_n=32, block_m=16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and int(cnt[0]) == 0


def test_linear_pair_counters_too_small(device):
    x, w1, w2 = _inputs(4, 64, 64, 64, device)
    with pytest.raises(ValueError, match="counters: expected a contiguous int32 tensor of >= 2"):
        cnt = torch.zeros(1, dtype=torch.int32, device=device)
        linear_fp32_pair(x, w1, w2, backend="triton", split_k=2, block_n=64, counters=cnt)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("ns", [(40,), (64, 48, 16), (72, 72, 24, 40)])
def test_linear_group_matches_reference(device, ns, fused):
    """1, 3 and 4 weights in one launch (a CSA layer's two compressors are four), with a K split summed by a
    second launch or inside the launch: each output against F.linear; on the Triton path the outputs are
    column views of one buffer (row stride the total width, unit inner stride)."""
    m, k = 7, 160
    g = torch.Generator().manual_seed(sum(ns))
    x = torch.randn(m, k, generator=g).to(device)
    ws = [(torch.randn(n, k, generator=g) * 0.05).to(device) for n in ns]
    cnt = torch.zeros(64, dtype=torch.int32, device=device) if fused else None
    ys = linear_fp32_group(x, ws, backend="triton", split_k=2, block_k=64, counters=cnt)
    assert len(ys) == len(ns)
    for y, w in zip(ys, ws, strict=True):
        assert y.shape == (m, w.shape[0]) and y.stride() == (sum(ns), 1)
        _assert_close_fp32(y, torch.nn.functional.linear(x, w), x, w, _small_shape_rel(k))
    if fused:
        assert int(cnt.abs().sum()) == 0
        two = linear_fp32_group(x, ws, backend="triton", split_k=2, block_k=64)
        assert all(torch.equal(a, b) for a, b in zip(ys, two, strict=True))


@pytest.mark.parametrize("k", [64, 700, 1536])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_linear_gemv_matches_reference(device, m, k):
    """The few-token kernel (auto's choice for M <= GEMV_MAX_M; up to GEMV_LIMIT_M with gemv=True, padded token
    rows included): four weights with widths that leave partial N tiles, K in one split (64), several with a partial
    last one (700) and several whole (1,536, i.e. 3 splits); bf16 x as its fp32 value; the split sum in a second
    launch and inside the launch give the same bits, counters back to 0."""
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g).bfloat16().to(device)
    ns = (40, 72, 24, 8)
    ws = [(torch.randn(n, k, generator=g) * 0.05).to(device) for n in ns]
    two = linear_fp32_group(x, ws, backend="triton", gemv=True)
    cnt = linear_counters(device)
    one = linear_fp32_group(x, ws, backend="triton", counters=cnt, gemv=True)
    if m <= linear_mod.GEMV_MAX_M:  # auto's choice: the same kernel, the same bits
        auto = linear_fp32_group(x, ws, backend="triton")
        assert all(torch.equal(a, b) for a, b in zip(auto, two, strict=True))
    for y, z, w in zip(two, one, ws, strict=True):
        assert y.shape == (m, w.shape[0]) and y.stride() == (sum(ns), 1)
        assert torch.equal(y, z)
        _assert_close_fp32(y, torch.nn.functional.linear(x.float(), w), x.float(), w, _small_shape_rel(k))
    assert int(cnt.abs().sum()) == 0


def test_linear_gemv_refuses_many_tokens_and_short_counters(device):
    """gemv=True above GEMV_LIMIT_M tokens, or counters shorter than its output tiles: an error, nothing written."""
    m = linear_mod.GEMV_LIMIT_M + 1
    x, w1, w2 = _inputs(m, 64, 48, 16, device)
    with pytest.raises(ValueError, match=f"gemv: expected at most {linear_mod.GEMV_LIMIT_M} tokens"):
        linear_fp32_pair(x, w1, w2, backend="triton", gemv=True)
    cnt = torch.zeros(2, dtype=torch.int32, device=device)  # 48 + 16 columns: 4 tiles of 16
    big = torch.randn(48, 1024).to(device), torch.randn(16, 1024).to(device)  # K = 1,024: 2 splits, fused sum
    with pytest.raises(ValueError, match="counters: expected >= 4"):
        linear_fp32_pair(torch.randn(1, 1024).to(device), *big, backend="triton", counters=cnt, gemv=True)
    assert int(cnt.abs().sum()) == 0


@pytest.mark.parametrize("n_weights", [0, 5])
def test_linear_group_refuses_bad_group_sizes(n_weights):
    with pytest.raises(ValueError, match=f"ws: expected a list of 1 to 4 weights, got {n_weights}"):
        linear_fp32_group(torch.zeros(2, 32), [torch.zeros(8, 32)] * n_weights)


def test_linear_pair_one_empty_weight(device):
    """N2 = 0: no program takes w2; out2 is [M, 0]."""
    x, w1, w2 = _inputs(5, 64, 48, 0, device, integer=True)
    y1, y2 = linear_fp32_pair(x, w1, w2, backend="triton", split_k=2)
    assert y2.shape == (5, 0)
    assert torch.equal(y1, torch.nn.functional.linear(x, w1))


def test_linear_pair_torch_and_auto_backends():
    """backend="torch" and "auto" on CPU tensors are the reference: two F.linear calls, bit for bit."""
    x, w1, w2 = _inputs(5, 96, 48, 100, "cpu")
    for backend in ("torch", "auto"):
        y1, y2 = linear_fp32_pair(x, w1, w2, backend=backend)
        assert torch.equal(y1, torch.nn.functional.linear(x, w1))
        assert torch.equal(y2, torch.nn.functional.linear(x, w2))


def test_linear_launch_defaults():
    """The documented launch defaults: decode tiles cover M, K split for ~2 programs per SM (1.9 x SMs) within
    the partial budget (4·split·M <= K) and >= 4 K blocks a split; prefill 128 x 128 x 32 without a split."""
    assert linear_launch(64, 1024, 1024, 4096) == (64, 64, 64, 4, 3, 8, True)  # 32 N tiles x 8 = 256 programs
    assert linear_launch(64, 512, 512, 4096).split_k == 16  # 16 N tiles x 16 = 256 programs
    assert linear_launch(64, 256, 256, 4096).split_k == 16  # 4 K blocks a split at most 16: 128 programs
    assert linear_launch(1, 1024, 1024, 4096) == (16, 64, 64, 4, 3, 8, True)  # 256 programs
    assert linear_launch(8, 512, 512, 4096)[:2] == (16, 64)
    assert linear_launch(100, 1024, 1024, 4096) == (128, 64, 64, 8, 3, 8, True)  # partial budget: 4·8·100 <= 4096
    assert linear_launch(65536, 1024, 1024, 4096) == (128, 128, 64, 8, 3, 1, False)
    assert linear_launch(64, 1024, 1024, 4096, split_k=1, block_n=128, swap_ab=False)[1:] == (128, 64, 4, 3, 1, False)


_GOOD = {"x": torch.zeros(4, 32), "w1": torch.zeros(8, 32), "w2": torch.zeros(16, 32)}


@pytest.mark.parametrize(
    "change,name",
    [
        ({"x": torch.zeros(4, 32, dtype=torch.float16)}, "x"),
        ({"x": torch.zeros(32)}, "x"),
        ({"x": torch.zeros(2, 4, 32)}, "x"),
        ({"w1": torch.zeros(8, 32, dtype=torch.float16)}, "w1"),
        ({"w1": torch.zeros(8, 31)}, "w1"),
        ({"w2": torch.zeros(16, 64)}, "w2"),
        ({"w2": torch.zeros(16 * 32)}, "w2"),
        ({"precision": "tf32"}, "precision"),
        ({"backend": "cuda"}, "backend"),
        ({"block_m": 8}, "block_m"),
        ({"block_n": 0}, "block_n"),
        ({"block_k": 48}, "block_k"),
        ({"num_warps": 3}, "num_warps"),
        ({"num_stages": 0}, "num_stages"),
        ({"split_k": 0}, "split_k"),
        ({"swap_ab": 1}, "swap_ab"),
    ],
)
def test_linear_pair_validation(change, name):
    """Bad arguments raise ValueError naming the argument (on every backend, before dispatch)."""
    kw = {**_GOOD, **change}
    with pytest.raises(ValueError, match=f"^{name}"):
        linear_fp32_pair(kw.pop("x"), kw.pop("w1"), kw.pop("w2"), **kw)


def test_linear_pair_validation_message_names_expected_and_got():
    with pytest.raises(ValueError, match=r"w2: expected shape \[\*, 32\], got \[16, 64\]"):
        linear_fp32_pair(_GOOD["x"], _GOOD["w1"], torch.zeros(16, 64))
    with pytest.raises(ValueError, match=r"x: expected dtype .*torch.float32.*, got torch.float16"):
        linear_fp32_pair(_GOOD["x"].half(), _GOOD["w1"], _GOOD["w2"])


# ---------------------------------------------------------------------------------------------- GPU
# Real widths, K = 4096, against an fp64 product.  Bound 1e-5·(|x|·|w|ᵀ) (see the module docstring): the
# tf32x3 products lose <= 3·2^-22 ≈ 7e-7 each; the fp32 accumulation sees ~100-150 sequential roundings
# (K/BLOCK_K chunk additions and the tensor-core steps within a chunk), <= ~1e-5 even if all went the same
# way, ~1e-7 on random-sign data.  cuBLAS fp32 (SIMT, TF32 off) is held to the same bound as a check of it.
GPU_REL = 1e-5


def _gpu_inputs(m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = 4096
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m).unsqueeze(1)  # the bound is scale-free
    w1 = torch.randn(n, k, generator=g) * 0.02
    w2 = torch.randn(n, k, generator=g) * 0.02
    return x.cuda(), w1.cuda(), w2.cuda()


def _fp64(x, w):
    return x.double() @ w.double().T


@pytest.fixture
def no_tf32():
    """The torch fp32 baseline in IEEE fp32 (cuBLAS SIMT), whatever the process default."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1024, 256])
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_linear_pair_tf32x3_real_shapes_on_gpu(m, n, no_tf32):
    """tf32x3 at the compressor widths (decode 1 / 64 tokens, prefill 4,096): within 1e-5·(|x|·|w|ᵀ) of fp64,
    like torch fp32; deterministic (bit-identical on a second call)."""
    x, w1, w2 = _gpu_inputs(m, n, seed=m + n)
    y1, y2 = linear_fp32_pair(x, w1, w2)
    t1, t2 = linear_fp32_pair_reference(x, w1, w2)
    for y, t, w in ((y1, t1, w1), (y2, t2, w2)):
        ref = _fp64(x, w)
        _assert_close_fp32(y, ref, x, w, GPU_REL)
        _assert_close_fp32(t, ref, x, w, GPU_REL)
    z1, z2 = linear_fp32_pair(x, w1, w2)
    assert torch.equal(z1, y1) and torch.equal(z2, y2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("launch", [{}, {"split_k": 4}])
@pytest.mark.parametrize("m", [64, 4096])
def test_linear_group_bf16_two_products_equal_tf32x3_on_gpu(m, launch, monkeypatch):
    """bf16 x at the CSA layer's four compressor widths: the two-product path (``TF32X2``) gives tf32x3's bits."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=g).bfloat16()
    ws = [torch.randn(n, 4096, device="cuda", generator=g) * 0.02 for n in (1024, 1024, 256, 256)]
    got = linear_fp32_group(x, ws, **launch)
    monkeypatch.setattr(linear_mod, "TF32X2", False)
    want = linear_fp32_group(x, ws, **launch)
    for a, b, w in zip(got, want, ws, strict=True):
        assert torch.equal(a, b)
        _assert_close_fp32(a, _fp64(x.float(), w), x.float(), w, GPU_REL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("launch", [{}, {"split_k": 4}, {"swap_ab": False, "block_m": 64}])
@pytest.mark.parametrize("m", [64, 4096])
def test_linear_group_bf16w_real_shapes_on_gpu(m, launch):
    """precision="bf16w" at the CSA layer's four widths with weights as an FP8 checkpoint gives them (e4m3 values
    times power-of-two 128 x 128 block scales, dequantised: exact in bf16): within the tf32x3 bound of fp64."""
    from dsv4.model.weights import dequantize_fp8_weight

    g = torch.Generator(device="cuda").manual_seed(m + 2)
    x = (torch.randn(m, 4096, device="cuda", generator=g) * 4).bfloat16()
    ws = []
    for n in (1024, 1024, 256, 256):
        # (clamped to e4m3's range: a larger value converts to NaN, not to the largest code)
        w8 = (torch.randn(n, 4096, device="cuda", generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        sc = torch.exp2(torch.randint(-16, -10, (n // 128, 32), device="cuda", generator=g).float())
        ws.append(dequantize_fp8_weight(w8, sc))
    assert linear_mod.bf16_exact(*ws)
    got = linear_fp32_group(x, ws, precision="bf16w", **launch)
    for a, w in zip(got, ws, strict=True):
        _assert_close_fp32(a, _fp64(x.float(), w), x.float(), w, GPU_REL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("launch", [{}, {"split_k": 4}, {"swap_ab": False, "block_m": 64}])
@pytest.mark.parametrize("m", [64, 4096])
def test_linear_group_bf16x3_real_shapes_on_gpu(m, launch):
    """precision="bf16x3" at the CSA layer's four compressor widths (K = 4,096): within the tf32x3 bound of fp64
    (its only error is the fp32 accumulation); both errors printed for the record."""
    g = torch.Generator(device="cuda").manual_seed(m + 1)
    x = (torch.randn(m, 4096, device="cuda", generator=g) * 4).bfloat16()
    ws = [torch.randn(n, 4096, device="cuda", generator=g) * 0.02 for n in (1024, 1024, 256, 256)]
    got = linear_fp32_group(x, ws, precision="bf16x3", **launch)
    tf = linear_fp32_group(x, ws, **launch)
    for a, b, w in zip(got, tf, ws, strict=True):
        ref, scale = _fp64(x.float(), w), _scale(x.float(), w)
        _assert_close_fp32(a, ref, x.float(), w, GPU_REL)
        e_bf, e_tf = ((a.double() - ref).abs() / scale).max().item(), ((b.double() - ref).abs() / scale).max().item()
        print(f"m {m} n {w.shape[0]} {launch}: bf16x3 {e_bf:.3g}, tf32x3 {e_tf:.3g} of |x||w|")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "launch",
    [
        {"split_k": 1},
        {"split_k": 2},
        {"split_k": 16},
        {"swap_ab": False},
        {"block_m": 16, "block_n": 128, "num_warps": 8},
        {"block_m": 128, "block_n": 128, "block_k": 32, "num_warps": 8, "num_stages": 3, "split_k": 1},
        {"precision": "ieee"},
    ],
)
def test_linear_pair_launch_variants_on_gpu(launch):
    """Decode M = 64 with other splits, orientations and tiles, and the exact-fp32 "ieee" dot: same bound."""
    x, w1, w2 = _gpu_inputs(64, 1024, seed=3)
    y1, y2 = linear_fp32_pair(x, w1, w2, **launch)
    _assert_close_fp32(y1, _fp64(x, w1), x, w1, GPU_REL)
    _assert_close_fp32(y2, _fp64(x, w2), x, w2, GPU_REL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1024, 256])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_linear_pair_fused_split_sum_on_gpu(m, n):
    """Decode widths with ``counters`` (the split sum inside the launch, programs running concurrently): the same
    bits as the two-launch sum, bf16 x the same as its fp32 value, counters back to 0, and the same again in a
    CUDA graph replay."""
    x, w1, w2 = _gpu_inputs(m, n, seed=21 + m)
    xb = x.bfloat16()
    want = linear_fp32_pair(xb.float(), w1, w2)
    cnt = linear_counters(x.device)
    got = linear_fp32_pair(xb, w1, w2, counters=cnt)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(cnt.abs().sum()) == 0
    g, out = capture_graph(lambda: linear_fp32_pair(xb, w1, w2, counters=cnt))
    for _ in range(3):
        out[0].zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert int(cnt.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 4])
def test_linear_gemv_real_shapes_on_gpu(m, no_tf32):
    """The few-token kernel at a CSA layer's four compressor widths (K = 4,096): within GPU_REL of fp64 (exact fp32
    products; ~20 sequential roundings: 4 a thread, 7 in the K reduction, 8 splits), the same bits with the split
    sum in the launch and in a CUDA graph replay, and against the tensor-core kernel within the bound."""
    g = torch.Generator().manual_seed(40 + m)
    x = (torch.randn(m, 4096, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)).bfloat16().cuda()
    ws = [(torch.randn(n, 4096, generator=g) * 0.02).cuda() for n in (1024, 1024, 256, 256)]
    cnt = linear_counters(x.device)
    ys = linear_fp32_group(x, ws, counters=cnt, gemv=True)
    tc = linear_fp32_group(x, ws, gemv=False)
    for y, t, w in zip(ys, tc, ws, strict=True):
        _assert_close_fp32(y, _fp64(x.float(), w), x.float(), w, GPU_REL)
        _assert_close_fp32(t, _fp64(x.float(), w), x.float(), w, GPU_REL)
    two = linear_fp32_group(x, ws, gemv=True)
    assert all(torch.equal(a, b) for a, b in zip(ys, two, strict=True))
    gr, out = capture_graph(lambda: linear_fp32_group(x, ws, counters=cnt, gemv=True))
    out[0].zero_()
    gr.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, ys, strict=True))
    assert int(cnt.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 64, 300])
def test_linear_pair_sync_free_and_capturable(m):
    """No host synchronisation, and a CUDA graph replay gives the eager result bit for bit (split and not)."""
    x, w1, w2 = _gpu_inputs(m, 512, seed=9)
    want = linear_fp32_pair(x, w1, w2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        linear_fp32_pair(x, w1, w2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    g, out = capture_graph(lambda: linear_fp32_pair(x, w1, w2))
    out[0].zero_()
    out[1].zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
