"""RMSNorm with a weight over the last dim, in one launch: the query latent's ``q_norm`` (spec §2 step 1).

``rms_norm(x, weight, eps)``: x [T, n] bf16 -> ``bf16(weight * (x * rsqrt(mean(x²) + eps)))`` with fp32
math, the definition being ``dsv4.model.functional.rms_norm``.  In a decode step the reference is eight
PyTorch launches (cast, square, mean, add, rsqrt, two products, cast: ~20 us at T = 64 on the H200,
``2026-12-03_h200_profile_decode_s5b.txt``); the kernel is one program per row.

``projections.query`` calls it on its kernel path (backend "auto" / "triton").  H200 (2026-12-03):
``test_gpu_rms_norm_real_shapes`` passed (T = 64 and 8,192 rows of 1,024; 64 rows of 1,536).

Numerics (the kernel repeats the reference's fp32 operations one by one):

- ``x²`` is one rounded fp32 product per element (``mul_rn``: never contracted into an FMA with the sum),
  summed in fp32 -- in the kernel's reduction order, not torch's: the one source of differences;
- the mean: the sum times ``fp32(1 / n)`` on a GPU (torch's CUDA ``MeanOps``), the IEEE quotient
  ``sum / n`` under the interpreter (torch's CPU ``mean`` divides); the same for power-of-two n;
- ``+ eps`` in fp32, ``rsqrt`` as torch's (``rope._rsqrt``), then ``x * r`` and ``weight * y`` rounded to
  fp32 each, then bf16 (round to nearest even).

Two fp32 summation orders give sums a few ulps apart, so ``r`` can differ by an ulp and an output by one
bf16 step when its fp32 value lies within an ulp of a bf16 rounding boundary (about 1e-5 of the
outputs); the tests bound the difference by one bf16 step.  NaN/Inf inputs are out of contract.

Bytes per call: read 2 T n (x) + 2 n (weight), write 2 T n; e.g. 0.26 MB at T = 64, n = 1,024.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.kernels._triton_sync import pdl_enter
from dsv4.kernels.cache._triton_quant import bf16_bits, bf16_rne, mul_rn
from dsv4.kernels.dispatch import interpreter_enabled, pdl_launch, use_triton
from dsv4.kernels.rope import _rsqrt
from dsv4.model import functional as F

__all__ = ["rms_norm", "rms_norm_reference"]

_MAX_N = 16384  # widest row one program holds in registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch definition of ``rms_norm``: ``functional.rms_norm(x, weight, eps)``."""
    return F.rms_norm(x, weight, eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr, stride_x, w_ptr, out_ptr, n, n_f, inv_n, eps, INTERP: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Row ``program_id(0)``: out[t] = bf16(w * (x * rsqrt(mean(x²) + eps))), fp32 math (module docstring)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    m = c < n
    x = tl.load(x_ptr + t * stride_x + c, mask=m, other=0.0).to(tl.float32)
    ss = tl.sum(mul_rn(x, x, INTERP), axis=0, keep_dims=True)  # [1]: the row's statistics stay tensors
    if INTERP:
        ms = tl.div_rn(ss, tl.full([1], n_f, tl.float32))
    else:
        ms = mul_rn(ss, tl.full([1], inv_n, tl.float32), INTERP)  # (no FMA with the + eps below)
    r = tl.broadcast_to(_rsqrt(ms + eps, INTERP), [BLOCK])
    w = tl.load(w_ptr + c, mask=m, other=0.0).to(tl.float32)
    y = mul_rn(w, mul_rn(x, r, INTERP), INTERP)
    tl.store(out_ptr + t * n + c, bf16_bits(bf16_rne(y, INTERP)), mask=m)  # (an int16 view of the bf16 output)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dim with a weight, fp32 math, bf16 result: ``functional.rms_norm(x, weight, eps)``.

    x [T, n] bf16 (unit stride in n); weight [n] (bf16 or fp32, applied in fp32); eps >= 0.  Returns a new
    contiguous bf16 [T, n] tensor.  Numerics: see the module docstring (the reference's values up to the fp32
    sum order of the mean: a rare output one bf16 step away).  The Triton kernel takes n <= 16,384.
    """
    check_tensor("x", x, dtype=torch.bfloat16, ndim=2)
    t, n = x.shape
    check_tensor("weight", weight, dtype=(torch.bfloat16, torch.float32), shape=[n], device=x.device)
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    if x.stride(1) != 1:
        raise ValueError(f"x: expected unit stride in the last dim, got strides {x.stride()}")
    fits = 1 <= n <= _MAX_N
    if backend == "triton" and not fits:
        raise ValueError(f"x: the Triton kernel takes rows of 1..{_MAX_N} values, got {n}")
    if not use_triton(backend, x, weight, has_kernel=fits):
        return rms_norm_reference(x, weight, eps)
    out = torch.empty((t, n), dtype=torch.bfloat16, device=x.device)
    if t == 0:
        return out
    block = triton.next_power_of_2(n)
    inv_n = float(np.float32(1.0 / n))  # fp32(1 / n), as torch's CUDA mean (no torch op: host time)
    _rms_norm_kernel[(t,)](
        x, x.stride(0), weight.contiguous(), out.view(torch.int16), n, float(n), inv_n, float(eps),
        INTERP=interpreter_enabled(), BLOCK=block, num_warps=max(1, min(8, block // 256)), **pdl_launch(x.device),
    )  # fmt: skip
    return out
