"""RMSNorm with a weight (the query latent's q_norm): the Triton kernel against ``functional.rms_norm``.

The kernel sums the squares in its own order, so an output may differ from the reference by one bf16
step (module docstring of ``dsv4.kernels.norm``); the tests allow that and count how often it happens.
"""

import pytest
import torch

from dsv4.kernels.norm import rms_norm, rms_norm_reference

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 steps (ulps of the larger magnitude) per element."""
    ulp = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30)
    ulp = torch.exp2(torch.floor(torch.log2(ulp)) - 7)
    return (a.float() - b.float()).abs() / ulp


def check(x, w, eps, max_frac=1e-3):
    got = rms_norm(x, w, eps, backend="triton")
    want = rms_norm_reference(x, w, eps)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape and got.is_contiguous()
    steps = bf16_steps(got, want)
    assert steps.max() <= 1, steps.max()
    assert (steps > 0).float().mean() <= max_frac
    return got


@pytest.mark.parametrize("n", [1, 48, 1024, 1536])
def test_rms_norm_matches_reference(n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(5, n, generator=g) * 3).bfloat16()
    w = (torch.rand(n, generator=g) + 0.5).bfloat16()
    check(x, w, 1e-6)
    check(x, w.float(), 1e-2)  # fp32 weight, larger eps


def test_rms_norm_strided_rows_zero_rows_and_empty():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(4, 300, generator=g).bfloat16()
    x = big[:, 20:276]  # row stride 300, unit stride in n
    w = torch.ones(256, dtype=torch.bfloat16)
    check(x, w, 1e-6)
    z = torch.zeros(3, 64, dtype=torch.bfloat16)
    assert (rms_norm(z, w[:64], 1e-6, backend="triton") == 0).all()  # mean 0: rsqrt(eps), times 0
    assert rms_norm(torch.empty(0, 64, dtype=torch.bfloat16), w[:64], 1e-6, backend="triton").shape == (0, 64)


def test_rms_norm_rejects_bad_input():
    x = torch.randn(2, 8).bfloat16()
    w = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x"):
        rms_norm(x.float(), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="stride"):
        rms_norm(torch.randn(8, 2).bfloat16().t(), w, 1e-6)  # [2, 8] with stride 2 in n
    assert torch.equal(rms_norm(x, w, 1e-6, backend="torch"), rms_norm_reference(x, w, 1e-6))


@gpu
@needs_cuda
@pytest.mark.parametrize("t, n", [(64, 1024), (8192, 1024), (64, 1536)])
def test_gpu_rms_norm_real_shapes(t, n):
    """V4-Flash / V4-Pro latent widths at decode and prefill sizes: at most one bf16 step, rarely."""
    g = torch.Generator().manual_seed(t + n)
    x = (torch.randn(t, n, generator=g) * 2).bfloat16().cuda()
    w = (torch.rand(n, generator=g) + 0.5).bfloat16().cuda()
    check(x, w, 1e-6, max_frac=1e-4)
