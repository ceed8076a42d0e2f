"""The dense projections on FP8 weights (dsv4/kernels/fp8_linear.py) against the fp64 reference.

On the CPU the kernel runs under the interpreter (its dot widened to exact fp32 products there): these tests check
the tiling, the groups, the per-block scales, K splits (in-launch and second-launch sums), masking and the bf16
rounding of the output.  The GPU tests run the real projection widths against the reference and against cuBLAS on
the dequantised bf16 weight (the layer's computation before this kernel).

The bound: every product x·e4m3 is exact in fp32 and a power-of-two scale multiplies exactly, so the kernel's fp32
result differs from the exact sum only by its fp32 additions, at most ~K·2^-24·(|x|·|w|ᵀ) in the worst case; the
output is then rounded to bf16 (half an ulp: 2^-9 of |y|).  A wrong block scale, row, group or a missed K block moves
an output by O(|x|·|w|ᵀ), far outside ``2^-8·|y| + K·2^-23·(|x|·|w|ᵀ)``.
"""

import pytest
import torch

from dsv4.engine.graphs import capture_graph
from dsv4.formats.fp8_weight import FP8Weight
from dsv4.kernels import fp8_linear as fl
from dsv4.kernels.fp8_linear import (
    DECODE_MAX_M,
    dequantize,
    fp8_linear,
    fp8_linear_launch,
    fp8_linear_mixed,
    fp8_linear_reference,
    grouped_linear,
)

U = 2.0**-24


def _weight(rows, k, seed=0, device="cpu", spread=6, pow2=True):
    g = torch.Generator().manual_seed(seed)
    w = FP8Weight.quantize(torch.randn(rows, k, generator=g) / k**0.5)
    # blocks of different scales, so a block's scale applied to the wrong K block or rows shows
    e = torch.randint(-spread, spread + 1, tuple(w.scale.shape), generator=g).float()
    s = w.scale * torch.exp2(e) * (1.0 if pow2 else 1.37)
    return FP8Weight(w.data, s.contiguous()).to(device)


def _exact(x, w, groups=1):
    """fp64 x·wᵀ per group (no rounding) and |x|·|w|ᵀ."""
    wd = w.dequantize().double()
    n, k = wd.shape[0] // groups, wd.shape[1]
    xg = x.double().unflatten(-1, (groups, k))
    y = torch.einsum("mgk,gnk->mgn", xg, wd.view(groups, n, k)).flatten(-2)
    mag = torch.einsum("mgk,gnk->mgn", xg.abs(), wd.abs().view(groups, n, k)).flatten(-2)
    return y, mag


def _assert_within(y, x, w, groups=1):
    assert y.dtype == torch.bfloat16
    exact, mag = _exact(x.cpu(), w.to("cpu"), groups)
    k = w.shape[1]
    err = (y.cpu().double() - exact).abs()
    bound = 2.0**-8 * exact.abs() + k * 2 * U * mag + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.3g} x the bound"


SHAPES = [  # m, n (rows a group), k, groups
    (1, 64, 256, 1),
    (3, 200, 300, 1),  # rows past a 64-tile and a scale block; K ends in a partial block
    (16, 128, 512, 1),
    (17, 96, 384, 1),  # M past a 16 tile: BLOCK_M 32
    (5, 256, 384, 2),  # groups: x's column blocks times the weight's row blocks
    (2, 128, 200, 4),  # groups with a partial K block
]


@pytest.mark.parametrize("launch", [{}, {"split_k": 2}, {"split_k": 3, "block_n": 32}, {"block_n": 128}])
@pytest.mark.parametrize("m, n, k, groups", SHAPES)
def test_fp8_linear_matches_reference(device, m, n, k, groups, launch):
    w = _weight(groups * n, k, seed=m + n, device=device)
    x = torch.randn(m, groups * k, device=device).bfloat16()
    y = fp8_linear(x, w, "triton", groups=groups, **launch)
    assert y.shape == (m, groups * n)
    _assert_within(y, x, w, groups)
    ref = fp8_linear_reference(x, w, groups)
    assert ref.dtype == torch.bfloat16 and ref.shape == y.shape


@pytest.mark.parametrize("split", [2, 4])
def test_fp8_linear_fused_split_sum_is_bit_identical(device, split):
    w = _weight(256, 1024, seed=3, device=device)
    x = torch.randn(5, 1024, device=device).bfloat16()
    two = fp8_linear(x, w, "triton", split_k=split)
    cnt = torch.zeros(64, dtype=torch.int32, device=device)
    one = fp8_linear(x, w, "triton", split_k=split, counters=cnt)
    assert torch.equal(one, two)
    assert int(cnt.abs().sum()) == 0  # the last arrival of every tile set its counter back to 0
    with pytest.raises(ValueError, match="output tiles"):
        fp8_linear(x, w, "triton", split_k=split, counters=torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.parametrize("m, launch", [(1, {}), (5, {"split_k": 3}), (20, {"split_k": 2}), (DECODE_MAX_M + 2, {})])
def test_fp8_linear_fp32_out_is_the_fp32_sum(device, m, launch):
    """``out_dtype=torch.float32`` (the compressor's projections): the fp32 sums themselves, within the fp32 bound
    K·2^-24·(|x|·|w|ᵀ) of fp64 (twice for the order), the split sums in the launch bit-equal to the second launch's;
    above DECODE_MAX_M tokens through ``linear_fp32_group(precision="bf16w")`` on the dequantised weight."""
    w = _weight(384, 640, seed=21 + m, device=device)
    x = torch.randn(m, 640, device=device).bfloat16()
    y = fp8_linear(x, w, "triton", out_dtype=torch.float32, **launch)
    assert y.dtype == torch.float32 and y.shape == (m, 384)
    exact, mag = _exact(x.cpu(), w.to("cpu"))
    assert bool(((y.cpu().double() - exact).abs() <= 2 * 640 * U * mag + 1e-30).all())
    if launch.get("split_k", 1) > 1 and m <= fl.FUSED_SUM_MAX_M:
        cnt = torch.zeros(64, dtype=torch.int32, device=device)
        assert torch.equal(fp8_linear(x, w, "triton", out_dtype=torch.float32, counters=cnt, **launch), y)
    want = torch.nn.functional.linear(x.cpu().float(), w.to("cpu").dequantize())
    assert torch.equal(fp8_linear(x.cpu(), w.to("cpu"), "torch", out_dtype=torch.float32), want)
    with pytest.raises(ValueError, match="out_dtype"):
        fp8_linear(x, w, "triton", out_dtype=torch.float16)


@pytest.mark.parametrize(
    "m, launch",
    [(1, {}), (3, {"split_k": 2}), (7, {"split_k": 3, "block_n": 128}), (20, {"split_k": 2}), (DECODE_MAX_M + 2, {})],
)
def test_fp8_linear_mixed_equals_the_two_calls(device, m, launch):
    """``fp8_linear_mixed`` (the compressors' fp32 projections and the x stack's bf16 ones, one launch): bit-equal to
    ``fp8_linear`` on the two row ranges at the same launch (fp32 / bf16 outputs), with the split sum in the launch
    (counters, <= FUSED_SUM_MAX_M tokens) or by the second launch; on the torch path and above DECODE_MAX_M tokens
    the two calls themselves.  The last rows end on a partial scale block (a 64-row weight last in the stack)."""
    w = _weight(256 + 192, 384, seed=31 + m, device=device)
    x = torch.randn(m, 384, device=device).bfloat16()
    top, rest = w.rows(0, 256), w.rows(256, 448)
    cnt = torch.zeros(64, dtype=torch.int32, device=device)
    y32, y16 = fp8_linear_mixed(x, w, 256, "triton", counters=cnt, **launch)
    assert (y32.dtype, y32.shape, y16.dtype, y16.shape) == (torch.float32, (m, 256), torch.bfloat16, (m, 192))
    want32 = fp8_linear(x, top, "triton", out_dtype=torch.float32, **launch)
    want16 = fp8_linear(x, rest, "triton", **launch)
    assert torch.equal(y32, want32) and torch.equal(y16, want16)
    assert int(cnt.abs().sum()) == 0
    for bad in (0, 100, 448, 512):
        with pytest.raises(ValueError, match="fp32_rows"):
            fp8_linear_mixed(x, w, bad, "triton")
    xc, wc = x.cpu(), w.to("cpu")
    t32, t16 = fp8_linear_mixed(xc, wc, 256, "torch")
    assert torch.equal(t32, fp8_linear(xc, wc.rows(0, 256), "torch", out_dtype=torch.float32))
    assert torch.equal(t16, fp8_linear(xc, wc.rows(256, 448), "torch"))


def test_fp8_weight_rows_are_views():
    w = _weight(300, 256, seed=2)
    v = w.rows(128, 300)
    assert v.data.data_ptr() == w.data[128:].data_ptr() and v.scale.data_ptr() == w.scale[1:].data_ptr()
    assert torch.equal(v.dequantize(), w.dequantize()[128:])
    for a, b in ((0, 0), (64, 128), (0, 200), (128, 301), (-128, 128)):
        with pytest.raises(ValueError, match="rows"):
            w.rows(a, b)


def test_fp8_linear_non_pow2_scales_are_the_exact_product(device):
    """fp32 block scales that are not powers of two (a Hugging Face conversion): still x·(e4m3·s), exactly up to the
    fp32 sum and the bf16 output."""
    w = _weight(192, 384, seed=5, device=device, pow2=False)
    assert not w.pow2_scales()
    x = torch.randn(4, 384, device=device).bfloat16()
    _assert_within(fp8_linear(x, w, "triton", split_k=2), x, w)


def test_fp8_linear_strided_x_and_empty(device):
    w = _weight(128, 256, seed=7, device=device)
    big = torch.randn(6, 600, device=device).bfloat16()
    x = big[:, 100:356]  # row stride 600
    _assert_within(fp8_linear(x, w, "triton"), x, w)
    assert fp8_linear(big[:0, :256], w, "triton").shape == (0, 128)


def test_fp8_linear_above_decode_dequantises(device, monkeypatch):
    """More than DECODE_MAX_M tokens: the weight is dequantised (one launch) and the GEMM is PyTorch's."""
    calls = []
    real = fl.dequantize
    monkeypatch.setattr(fl, "dequantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w = _weight(256, 256, seed=9, device=device)
    x = torch.randn(DECODE_MAX_M + 3, 256, device=device).bfloat16()
    y = fp8_linear(x, w, "triton")
    assert calls == [1]
    _assert_within(y, x, w)


def test_dequantize_kernel_equals_the_format(device):
    w = _weight(200, 300, seed=11, device=device)
    assert torch.equal(dequantize(w, "triton"), w.dequantize(torch.bfloat16))
    assert torch.equal(dequantize(w, "torch"), w.dequantize(torch.bfloat16))


def test_fp8_linear_torch_path_is_the_bf16_linear():
    """The torch path (and "auto" on the CPU) is F.linear on the dequantised bf16 weight: the layer's computation
    before FP8 weights, bit for bit."""
    w = _weight(256, 384, seed=13)
    x = torch.randn(3, 768).bfloat16()
    wd = w.dequantize(torch.bfloat16)
    assert torch.equal(fp8_linear(x[:, :384], w, "torch"), torch.nn.functional.linear(x[:, :384], wd))
    assert torch.equal(fp8_linear(x[:, :384], w), torch.nn.functional.linear(x[:, :384], wd))
    w2 = _weight(256, 384, seed=14)
    want = torch.einsum("mgk,gnk->mgn", x.view(3, 2, 384), w2.dequantize(torch.bfloat16).view(2, 128, 384))
    assert torch.equal(fp8_linear(x, w2, "torch", groups=2), want.flatten(-2))


def test_e4m3_to_bf16_bit_trick_on_every_code():
    """The arithmetic of ``_e4m3_to_bf16``'s PTX, modelled on the host for every non-NaN e4m3 code: the value as f16
    (exact), its magnitude bits shifted right by 3 with the sign kept, read as bf16, times 2^112 gives the value back
    exactly (zeros and subnormals included).  (The GPU test runs the PTX itself.)"""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    v = codes.view(torch.float8_e4m3fn).float()
    h = v.half().view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(h.to(torch.int16).view(torch.float16).float(), v)  # e4m3 -> f16 is exact
    t = ((h & 0x7FFF) >> 3) | (h & 0x8000)
    as_bf16 = (t << 16).to(torch.int32).view(torch.float32).double()  # bf16 bits widened to fp32: same value
    assert torch.equal(as_bf16 * 2.0**112, v.double())
    assert bool(((h & 0x7F) == 0).all())  # f16's low 7 mantissa bits are zero: the shift loses nothing


@pytest.mark.parametrize(
    "m, heads, hd, groups, launch",
    [
        (1, 4, 256, 2, {}),  # V4's layout in small: heads of 2 K blocks, rope in the second; 2 heads a group
        (5, 4, 256, 2, {"split_k": 2}),  # each split one head: its rope block in each split
        (3, 2, 384, 1, {"split_k": 3}),  # splits of one K block: only the last holds a rope block
        (17, 2, 128, 2, {"block_n": 32}),  # a head = one K block; BLOCK_M 32 (rows wrap for the positions)
    ],
)
def test_fp8_linear_derotate_equals_rope_inverse_first(device, monkeypatch, m, heads, hd, groups, launch):
    """``derotate``: the kernel de-rotates each head's rope lanes as it loads x, at the (cos, sin) the query's RoPE
    launch wrote (``q_norm_rope(cos_sin_out=)``), the result the bits of ``fp8_linear(rope_inverse(x))`` (the layer's
    two launches) -- on the kernel path, on the torch path, and where the kernel cannot (head_dim off the 128-column
    K blocks: the reference rotation first).  x is not changed."""
    from dsv4.kernels.rope import q_norm_rope, rope_inverse

    g = torch.Generator().manual_seed(m)
    rd = 64
    inv = (1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))).to(device)
    w = _weight(groups * 128, heads * hd // groups, seed=m, device=device)
    x = torch.randn(m, heads * hd, generator=g).bfloat16().to(device)
    pos = torch.randint(0, 70_000, (m,), generator=g, dtype=torch.int32).to(device)
    x0 = x.clone()

    def cos_sin(inv, backend):
        cs = torch.empty(m, inv.shape[0], 2, device=device)
        q_norm_rope(torch.ones(m, 1, 128, device=device).bfloat16(), pos, inv, 1e-6, backend, cos_sin_out=cs)
        return cs

    for backend in ("triton", "torch"):
        kw = launch if backend == "triton" else {}
        want = fp8_linear(
            rope_inverse(x.unflatten(1, (heads, hd)), pos, inv, backend=backend).flatten(1), w, backend, groups=groups,
            **kw,
        )  # fmt: skip
        cs = cos_sin(inv, backend)
        with monkeypatch.context() as mp:
            if backend == "triton":  # (the kernel's own rotation: no reference rotation runs)
                mp.setattr("dsv4.model.functional.rotate_pairs", None)
            got = fp8_linear(x, w, backend, groups=groups, derotate=(cs, hd), **kw)
        assert torch.equal(got, want), backend
        assert torch.equal(x, x0)
    # the rotation matters: without it the result differs
    assert not torch.equal(fp8_linear(x, w, "triton", groups=groups, **launch), want)
    # head_dim 64 (rd 32: not on the kernel's K blocks): the reference rotation first, the same result
    inv32 = inv[:16].contiguous()
    want = fp8_linear(rope_inverse(x.unflatten(1, (-1, 64)), pos, inv32, backend="triton").flatten(1), w, "triton",
                      groups=groups)  # fmt: skip
    assert torch.equal(fp8_linear(x, w, "triton", groups=groups, derotate=(cos_sin(inv32, "triton"), 64)), want)
    with pytest.raises(ValueError, match="derotate cos_sin"):
        fp8_linear(x, w, "triton", groups=groups, derotate=(cs[:-1], hd))
    with pytest.raises(ValueError, match="derotate head_dim"):
        fp8_linear(x, w, "triton", groups=groups, derotate=(cs, hd + 1))


def test_fp8_linear_launch_defaults_and_overrides():
    # V4-Flash decode, 1 token: wq_a (1,024 rows) splits, wq_b (32,768 rows) does not
    assert fp8_linear_launch(1, 1024, 4096, num_sms=132) == (16, 64, 4, 4, 16)
    assert fp8_linear_launch(1, 32768, 1024, num_sms=132).split_k == 1
    # 64 tokens: split while the partials' traffic stays within the weight's bytes (8 splits: 2 MB of partials each
    # way for wq_a's 4 MB); a wide weight (wq_b) fills the GPU without a split
    assert fp8_linear_launch(64, 1024, 4096, num_sms=132) == (64, 64, 4, 4, 8)
    assert fp8_linear_launch(64, 32768, 1024, num_sms=132).split_k == 1
    assert fp8_linear_launch(128, 4096, 8192, num_sms=132).block_m == 128
    assert fp8_linear_launch(128, 4096, 8192, num_sms=132).num_warps == 8
    assert fp8_linear_launch(3, 64, 4096, num_sms=132, split_k=5, block_n=32, num_stages=2) == (16, 32, 4, 2, 5)
    for bad in ({"block_n": 256}, {"block_n": 48}, {"num_warps": 3}, {"num_stages": 0}, {"split_k": 0}):
        with pytest.raises(ValueError):
            fp8_linear_launch(1, 64, 256, **bad)
    with pytest.raises(ValueError, match="tokens"):
        fp8_linear_launch(DECODE_MAX_M + 1, 64, 256)


def test_fp8_linear_validation():
    w = _weight(256, 256)
    x = torch.randn(2, 256).bfloat16()
    with pytest.raises(ValueError, match="FP8Weight"):
        fp8_linear(x, w.dequantize(torch.bfloat16))
    with pytest.raises(ValueError, match="x"):
        fp8_linear(x.float(), w)
    with pytest.raises(ValueError, match="columns"):
        fp8_linear(x[:, :200], w)
    with pytest.raises(ValueError, match="divisor"):
        fp8_linear(torch.randn(2, 768).bfloat16(), w, groups=3)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_linear(torch.randn(2, 1024).bfloat16(), w, groups=4)  # 64 rows a group
    with pytest.raises(ValueError, match="counters"):
        fp8_linear(x, w, "triton", split_k=2, counters=torch.zeros(8, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["v4-flash", "v4-pro"])
@pytest.mark.parametrize("m", [1, 8, 64, 128])
def test_fp8_linear_real_widths_on_gpu(model, m):
    """Every projection of the layer at its real width: within the bound of fp64, and against cuBLAS on the
    dequantised bf16 weight (the same products, another order of fp32 sums) at most one bf16 ulp apart in rare
    elements (printed)."""
    from dsv4.config import get_preset

    cfg = get_preset(model)
    h, d, dim, ql, g, r = cfg.n_heads, cfg.head_dim, cfg.dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    shapes = {  # name: (rows, k, groups)
        "wq_a": (ql, dim, 1), "wq_b": (h * d, ql, 1), "wkv": (d, dim, 1), "wo_a": (g * r, (h // g) * d, g),
        "wo_b": (dim, g * r, 1), "idx_wq_b": (cfg.index_n_heads * cfg.index_head_dim, ql, 1),
        "weights_proj": (cfg.index_n_heads, dim, 1),
    }  # fmt: skip
    cnt = torch.zeros(4096, dtype=torch.int32, device="cuda")
    for name, (rows, k, groups) in shapes.items():
        w = _weight(rows, k, seed=rows + m, device="cuda")
        x = torch.randn(m, groups * k, device="cuda").bfloat16()
        y = fp8_linear(x, w, groups=groups, counters=cnt)
        _assert_within(y, x, w, groups)
        if m <= 4:  # the GEMV form too (opt-in, fl.GEMV_MAX_M)
            _assert_within(fp8_linear(x, w, groups=groups, counters=cnt, gemv=True), x, w, groups)
        cub = fp8_linear(x, w, "torch", groups=groups)
        ulp = (y.float() - cub.float()).abs() / torch.finfo(torch.bfloat16).eps / cub.float().abs().clamp_min(1e-30)
        share = (y != cub).float().mean().item()
        print(f"{model} m {m} {name}: {share:.2%} differ from cuBLAS, max {ulp.max():.2f} ulp")
        assert int(cnt.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_linear_in_a_cuda_graph():
    w = _weight(1024, 4096, seed=1, device="cuda")
    x = torch.randn(4, 4096, device="cuda").bfloat16()
    cnt = torch.zeros(64, dtype=torch.int32, device="cuda")
    want = fp8_linear(x, w, counters=cnt)
    graph, out = capture_graph(lambda: fp8_linear(x, w, counters=cnt))
    graph.replay()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cvt_asm", [True, False])
def test_fp8_linear_every_e4m3_code_on_gpu(cvt_asm):
    """x = the identity (128 tokens): y[m, n] = w[n, m]·s, one exact product each, so the output is the dequantised
    weight bit for bit -- over every non-NaN e4m3 code (both signs, zeros, subnormals, 448), with power-of-two block
    scales far apart, through either weight conversion (``_e4m3_to_bf16`` or Triton's cast)."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 254 codes
    data = codes.repeat(128 * 256 // 254 + 1)[: 256 * 128].view(256, 128).contiguous().view(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0**-20], [2.0**10]])
    w = FP8Weight(data, scale).to("cuda")
    x = torch.eye(128, device="cuda").bfloat16()
    y = fp8_linear(x, w, cvt_asm=cvt_asm)
    assert torch.equal(y, w.dequantize(torch.bfloat16).T.contiguous())


@pytest.mark.parametrize("groups", [1, 4])
def test_grouped_linear_matches_einsum(device, groups):
    """``grouped_linear`` on bf16 weights (the layer's wo_a when not FP8): a 2-D x, contiguous or a column slice of a
    wider tensor (row-strided), runs one batched GEMM into its output (no copy of x); a 3-D x the einsum.  Same
    values as the einsum of each group's block (fp64 reference, bf16 rounding: within one bf16 ulp)."""
    g = torch.Generator().manual_seed(groups)
    t, k, n = 5, 64, 48
    wide = torch.randn(t, groups * k + 16, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(groups * n, k, generator=g).to(torch.bfloat16).to(device)
    want = torch.einsum("tgk,gnk->tgn", wide[:, 16:].double().unflatten(1, (groups, k)), w.double().view(groups, n, k))
    want = want.flatten(1)
    for x in (wide[:, 16:].contiguous(), wide[:, 16:], wide[:, 16:].unsqueeze(0)):
        y = grouped_linear(x, w, groups).reshape(t, groups * n)
        assert y.dtype == torch.bfloat16 and y.is_contiguous()
        assert ((y.double() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()


@pytest.mark.parametrize("launch", [{}, {"split_k": 2}, {"split_k": 3, "block_n": 32}, {"block_n": 128}])
@pytest.mark.parametrize("m, n, k, groups", [s for s in SHAPES if s[0] <= 4] + [(4, 64, 256, 1)])
def test_fp8_linear_gemv_form_matches_reference(device, m, n, k, groups, launch):
    """The kernel's GEMV form (``gemv=True``: no MMA, M padded to 1-4 rows) over the shapes and launches of the MMA
    form: within the fp64 bound, and equal to the MMA form's output up to the fp32 summation order (bounded)."""
    w = _weight(groups * n, k, seed=m + n, device=device)
    x = torch.randn(m, groups * k, device=device).bfloat16()
    y = fp8_linear(x, w, "triton", groups=groups, gemv=True, **launch)
    assert y.shape == (m, groups * n)
    _assert_within(y, x, w, groups)
    cnt = torch.zeros(64, dtype=torch.int32, device=device)
    y2 = fp8_linear(x, w, "triton", groups=groups, gemv=True, counters=cnt, **launch)  # (the fused split sum)
    _assert_within(y2, x, w, groups)
    assert not cnt.any()


def test_fp8_linear_gemv_fp32_mixed_and_limits(device, monkeypatch):
    """GEMV form: the fp32 output within the fp32 bound of fp64; ``fp8_linear_mixed`` bit-equal to the two
    ``fp8_linear`` calls of the same form; the default from ``GEMV_MAX_M`` (at most 4 tokens); more than 4 tokens
    with ``gemv=True`` refused on every path."""
    w = _weight(384, 256, seed=3, device=device)
    x = torch.randn(2, 256, device=device).bfloat16()
    y32 = fp8_linear(x, w, "triton", out_dtype=torch.float32, gemv=True)
    exact, mag = _exact(x.cpu(), w.to("cpu"))
    assert y32.dtype == torch.float32 and bool(((y32.cpu().double() - exact).abs() <= 2 * 256 * U * mag).all())
    a32, a16 = fp8_linear_mixed(x, w, 128, "triton", gemv=True)
    assert torch.equal(a32, fp8_linear(x, w.rows(0, 128), "triton", out_dtype=torch.float32, gemv=True))
    assert torch.equal(a16, fp8_linear(x, w.rows(128, 384), "triton", gemv=True))
    x5 = torch.zeros(5, 256).bfloat16()
    with pytest.raises(ValueError, match="at most 4 tokens"):
        fp8_linear(x5.to(device), w, "triton", gemv=True)
    with pytest.raises(ValueError, match="at most 4 tokens"):
        fp8_linear_mixed(x5, w.to("cpu"), 128, "torch", gemv=True)
    monkeypatch.setattr(fl, "GEMV_MAX_M", 2)
    assert fl._check_gemv(None, 2) and not fl._check_gemv(None, 3) and not fl._check_gemv(False, 1)
    monkeypatch.setattr(fl, "GEMV_MAX_M", 64)
    assert fl._check_gemv(None, 4) and not fl._check_gemv(None, 5)
