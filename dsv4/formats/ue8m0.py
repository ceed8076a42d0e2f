"""UE8M0 power-of-two block scales, shared by the FP8 entry and the MXFP4 key formats.

A UE8M0 byte ``b`` encodes the scale ``2**(b - 127)``.  The scale of a block is the smallest power
of two ``s`` with ``amax / s <= qmax`` (spec §13): ``s = 2**ceil(log2(max(amax, floor) / qmax))``,
where the ratio is computed in fp32 and its ceil-log2 is exact (exponent field, +1 if any mantissa
bit is set).
"""

from __future__ import annotations

import torch

UE8M0_BIAS = 127


def ceil_log2_ratio(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """Exact ``ceil(log2(max(amax, floor) / qmax))`` of fp32 values, as int32."""
    r = torch.clamp(amax.float(), min=floor) / qmax
    mant, exp = torch.frexp(r)  # r = mant * 2**exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)


def exponent_to_byte(e: torch.Tensor) -> torch.Tensor:
    """Scale exponent (int) -> UE8M0 byte (uint8).  Exponents outside [-127, 127] are clamped."""
    return (e.to(torch.int32) + UE8M0_BIAS).clamp(0, 254).to(torch.uint8)


def byte_to_scale(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte (uint8) -> fp32 scale ``2**(b - 127)``."""
    return torch.ldexp(torch.ones_like(b, dtype=torch.float32), b.to(torch.int32) - UE8M0_BIAS)
