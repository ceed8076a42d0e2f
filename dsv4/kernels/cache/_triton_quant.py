"""Triton device helpers shared by the cache write kernels: exact bit-level rounding.

Everything here is integer arithmetic on the IEEE bits of fp32 values, or fp32 operations that are exact or
correctly rounded by IEEE (a product by a power of two, one add), so it gives the same bytes under
``TRITON_INTERPRET=1`` (numpy) and on a GPU, independent of how a Triton version lowers fp8 casts, fp32 division
or fast-math:

- ``bf16_round``: fp32 -> nearest-even bf16 value (returned as fp32);
- ``ceil_log2_ratio``: ``ceil(log2(max(amax, floor) / qmax))`` without a division (see below);
- ``pow2_neg``: the fp32 ``2**-e`` built from its exponent field;
- ``e4m3_code``: fp32 with |v| <= 448 -> float8_e4m3fn byte, round to nearest even, sign kept;
- ``bf16_rne``: ``bf16_round`` by the hardware conversion on a GPU (the same values);
- ``e2m1_code``: fp32 -> e2m1 code, nearest with ties to the even code (the format's thresholds);
- ``e2m1_round``: fp32 -> the e2m1 value of that code (as fp32, +0 for a value that rounds to zero);
- ``parity_sign``: the signs of the Sylvester Hadamard matrix;
- ``mul_rn``: an fp32 product that is never fused into an FMA (torch's rounding of ``a*c - b*s``);
- ``rope_cos_sin_at``: cos/sin of the RoPE angle ``fp32(ratio * (pos // ratio)) * inv_freq`` (fp32),
  the reference's angle bit for bit, through libdevice's IEEE-accurate ``cosf``/``sinf`` (full range
  reduction; the same CUDA math-library functions ``torch.cos``/``torch.sin`` use on the GPU, so the
  values match the reference's; ``tl.cos``/``tl.sin`` may lower to the ``.approx`` instructions, whose
  error grows with the angle, and positions reach 1M).  Under the interpreter (``INTERP``) libdevice
  is not available: ``tl.cos``/``tl.sin`` (numpy float32, within an ulp of torch's CPU values);
- ``rope_cos_sin_pos``: the same for a block of rows ([rows, rope_dim/2]) with a compile-time ratio.

NaN/Inf inputs are out of contract (the PyTorch references define those cases).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from triton.language.extra import libdevice


def qmax_split(qmax: float) -> tuple[int, int]:
    """``qmax = (1 + mant / 2**23) * 2**exp`` -> (exp, mant): what ``ceil_log2_ratio`` compares against."""
    m, e = math.frexp(qmax)  # qmax = m * 2**e, m in [0.5, 1)
    mant = round((2 * m - 1) * 2**23)
    if (1 + mant / 2**23) * 2.0 ** (e - 1) != qmax:
        raise ValueError(f"qmax={qmax} is not an fp32 value")
    return e - 1, mant


@triton.jit
def bf16_round(x):
    """Round fp32 ``x`` to the nearest bf16 (ties to even); the result is returned as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    bits = bits & -65536  # 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits(x):
    """Bit pattern (int16) of an fp32 value that is exactly representable in bf16."""
    return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16)


@triton.jit
def ceil_log2_ratio(amax, FLOOR: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr):
    """Exact ``ceil(log2(fp32(max(amax, FLOOR) / qmax)))`` for qmax = (1 + Q_MANT/2**23) * 2**Q_EXP.

    With a = max(amax, FLOOR) = (1 + ma) * 2**ea (a normal fp32), the quotient a/qmax lies in
    [2**(ea-Q_EXP-1), 2**(ea-Q_EXP+1)); it is >= 2**(ea-Q_EXP) iff ma >= Q_MANT, and equals it iff
    ma == Q_MANT.  Rounding the fp32 quotient cannot land on that power of two from either side for
    qmax in [1, 2) * 2**k with a short mantissa (448 = 1.75 * 2**8, 6 = 1.5 * 2**2), so the answer
    is ``ea - Q_EXP + (ma > Q_MANT)``: the same as ``frexp`` of the fp32 division in the reference.
    """
    a = tl.maximum(amax, FLOOR)
    bits = a.to(tl.int32, bitcast=True)
    ea = ((bits >> 23) & 0xFF) - 127
    ma = bits & 0x7FFFFF
    return ea - Q_EXP + (ma > Q_MANT).to(tl.int32)


@triton.jit
def pow2_neg(e):
    """fp32 ``2**-e`` for int32 ``e`` in [-126, 126]."""
    return ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_code(v):
    """float8_e4m3fn byte (int32 in [0, 256)) of fp32 ``v`` with |v| <= 448, round to nearest even.

    The quantum of e4m3 at |v| is 2**(max(E, -6) - 3) (E = unbiased exponent; -6 is the smallest
    normal exponent, below it the subnormal step 2**-9).  With n = round(|v| / quantum), the code is
    ``((qe + 10) << 3) + n - 8`` in the normal and the subnormal range alike (n = 16 after rounding
    carries into the next exponent; n <= 8 with qe = -9 is the subnormal code n).  The sign bit is
    copied from ``v``, so negative values that round to zero give 0x80 (-0), as a cast does.
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    qe = tl.maximum(e - 130, -9)  # log2 of the quantum
    sh = tl.minimum(150 + qe - e, 25)  # mantissa bits below the quantum (>= 20); 25 drops everything
    n = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    n = n + ((rem > half) | ((rem == half) & ((n & 1) == 1))).to(tl.int32)
    code = ((qe + 10) << 3) + n - 8
    return sign | code


@triton.jit
def rope_cos_sin_at(pos_ptr, ratio, inv_ptrs, INTERP: tl.constexpr):
    """(cos, sin) fp32 at the angle ``fp32(ratio * (pos // ratio)) * inv_freq`` for the scalar int position
    at ``pos_ptr`` (int32/int64) and the fp32 frequencies at ``inv_ptrs`` (a block of pointers).

    The product is one IEEE fp32 multiplication of the same operands as the reference's, so the angle is
    identical; ``fp32(pos)`` is exact below 2**24.  Negative positions floor as torch's ``//``."""
    p = tl.load(pos_ptr).to(tl.int64)
    q = p // ratio
    q = tl.where((q * ratio != p) & (p < 0), q - 1, q)  # floor division, as torch's ``//``
    p = q * ratio
    ang = p.to(tl.float32) * tl.load(inv_ptrs)
    if INTERP:
        c = tl.cos(ang)
        s = tl.sin(ang)
    else:
        c = libdevice.cos(ang)
        s = libdevice.sin(ang)
    return c, s


@triton.jit
def rope_cos_sin_pos(p, RATIO: tl.constexpr, inv_ptrs, INTERP: tl.constexpr):
    """``rope_cos_sin_at`` for a block of rows: loaded positions ``p`` [R] (int32/int64), a compile-time ``RATIO``
    (1: no division; a power of two: a shift), fp32 frequencies at ``inv_ptrs`` [H]: (cos, sin) [R, H] at
    ``fp32(RATIO * (p // RATIO)) * inv_freq``, computed once per (row, rope pair); the angle is the same single fp32
    multiplication as the reference's."""
    if RATIO != 1:
        p = p.to(tl.int64)
        q = p // RATIO
        q = tl.where((q * RATIO != p) & (p < 0), q - 1, q)  # floor division, as torch's ``//``
        p = q * RATIO
    ang = p.to(tl.float32)[:, None] * tl.load(inv_ptrs)[None, :]
    if INTERP:
        c = tl.cos(ang)
        s = tl.sin(ang)
    else:
        c = libdevice.cos(ang)
        s = libdevice.sin(ang)
    return c, s


@triton.jit
def mul_rn(a, b, INTERP: tl.constexpr):
    """fp32 ``a * b`` rounded on its own, as torch computes ``a * c - b * s``: on a GPU by ``mul.rn.f32`` (inline
    PTX), which the compiler never contracts with a following add/sub into an FMA (one rounding instead of two)."""
    if INTERP:
        return a * b
    else:
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def parity_sign(v):
    """(-1)^popcount(v) as fp32 for int32 v in [0, 2**16): the Sylvester Hadamard sign H[i, k] = parity_sign(i & k)."""
    v = v ^ (v >> 8)
    v = v ^ (v >> 4)
    v = v ^ (v >> 2)
    v = v ^ (v >> 1)
    return 1.0 - 2.0 * (v & 1).to(tl.float32)


@triton.jit
def sylvester_signs(cn, INTERP: tl.constexpr):
    """The Sylvester signs [n, n] of ``cn`` = arange(n) as an MMA operand (``hadamard_dots``): bf16 on the GPU (+-1
    are exact), fp32 under the interpreter (its tf32 dot)."""
    h = parity_sign(cn[:, None] & cn[None, :])
    if not INTERP:
        h = h.to(tl.bfloat16)
    return h


@triton.jit
def hadamard_dots(a, b, h, INTERP: tl.constexpr):
    """(a @ h, b @ h) for rows a, b [M, n] holding bf16 values (fp32) and the signs h of ``sylvester_signs``: the two
    halves' products of H_2 (x) H_n, every product exact; bf16 MMAs with fp32 accumulation on the GPU, tf32 under
    the interpreter (its bf16 dot is wrong; tf32 holds bf16 values exactly)."""
    if INTERP:
        za = tl.dot(a, h, input_precision="tf32")
        zb = tl.dot(b, h, input_precision="tf32")
    else:
        za = tl.dot(a.to(tl.bfloat16), h)
        zb = tl.dot(b.to(tl.bfloat16), h)
    return za, zb


@triton.jit
def bf16_rne(x, INTERP: tl.constexpr):
    """fp32 -> nearest-even bf16 value (as fp32): the hardware conversion (``cvt.rn.bf16x2.f32``) on a GPU,
    ``bf16_round``'s integer emulation under the interpreter (same values)."""
    if INTERP:
        return bf16_round(x)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def e2m1_round(v):
    """fp32 value of ``e2m1_code(v)`` (the decoded code: 0, +-.5, ..., +-6; a value that rounds to zero is +0), in the
    value domain without the code: with the same scaling f = 2, 1 or 1/2 of the three evenly spaced runs, the value is
    min(rint(min(a f, 8)) / f, 6) -- rint's ties to even are the even code's (the runs' code offsets 0, 2, 4 are
    even), a run's upper end lands on the next run's first value as the code does, and past 6 it saturates.  Every
    step is exact (products by powers of two, a round to integer by the fp32 add of 1.5 * 2**23).  For a round trip
    (``indexer.query``'s MXFP4 simulation) this skips the code-to-value decode."""
    a = tl.abs(v)
    lo = a < 2.0
    mid = a < 4.0
    f = tl.where(lo, 2.0, tl.where(mid, 1.0, 0.5))
    # rint, ties to even (exact for 0 <= y <= 8), read from the sum's low bits as ``e2m1_code`` does (an fp32
    # (y + c) - c could be folded to y by a compiler that reassociates)
    r = ((tl.minimum(a * f, 8.0) + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000).to(tl.float32)
    mag = tl.minimum(r * tl.where(lo, 0.5, tl.where(mid, 1.0, 2.0)), 6.0)
    return tl.where((v < 0) & (mag > 0), -mag, mag)


@triton.jit
def e2m1_code(v):
    """e2m1 code (int32, sign << 3 | magnitude index) of fp32 ``v``: round to the nearest e2m1 magnitude, ties to the
    even code, |v| > 6 saturating to 6 (``dsv4.formats.mxfp4_key.e2m1_encode``'s thresholds).

    The magnitudes 0, .5, 1, 1.5 | 2, 3 | 4, 6 are three evenly spaced runs, so with y = 2a (a < 2), a (2 <= a < 4)
    or a / 2 (a >= 4) the code is rint(y) + (0, 2, 4): one exact scaling by a power of two and one round to
    integer, ties to even, whose parity is the code's.  At a run's upper end rint(y) lands on the next run's
    first code (2a -> 4 for a in [1.75, 2); a -> 4 for a in [3.5, 4)), as the thresholds do.  The round is the
    fp32 add of 1.5 * 2**23 (exact for 0 <= y < 2**22; y is clamped to 8 first), so the code is read from the
    sum's low bits: ~10 instructions instead of seven compare-and-adds.  A value that rounds to zero is +0
    (code 0)."""
    a = tl.abs(v)
    lo = a < 2.0
    mid = a < 4.0
    y = tl.minimum(a * tl.where(lo, 2.0, tl.where(mid, 1.0, 0.5)), 8.0)
    r = (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000  # rint(y), ties to even
    mag = tl.minimum(r + tl.where(lo, 0, tl.where(mid, 2, 4)), 7)
    return tl.where((v < 0) & (mag > 0), mag | 8, mag)
