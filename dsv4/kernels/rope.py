"""Query-side RoPE of the attention layer, each in one launch (spec §2 steps 1 and 5).

Two operations, each a validating public function over a PyTorch reference (``dsv4.model.functional``,
the definition of correct) and a Triton kernel:

- ``q_norm_rope``: q [T, H, D] bf16 -> per-head RMSNorm (``head_rms_norm``) -> RoPE at each token's
  position (``apply_rope``): what ``projections.query`` does after ``wq_b``;
- ``rope_inverse``: o [T, H, D] bf16 -> inverse RoPE at each token's position (``apply_rope(...,
  inverse=True)``): what ``projections.output_projection`` does before ``wo_a`` (an FP8 ``wo_a`` of a decode-sized
  step does it in its own load instead, ``fp8_linear(derotate=)``, at the (cos, sin) ``q_norm_rope(cos_sin_out=)``
  wrote: the same values).

RoPE rotates the last ``rd = 2 * len(inv_freq)`` channels as interleaved pairs (2k, 2k+1); the other
``D - rd`` channels are copied (``q_norm_rope``: normed).  All heads of a token share its position.

Numerics (the kernel repeats the reference's operations and roundings one by one):

- ``head_rms_norm`` in bf16: ``q²`` rounded to bf16 per element, their sum in fp32 times ``1/D`` (exact:
  D is a power of two) rounded to bf16 (the mean), ``+ eps`` rounded to bf16 (eps as torch adds a Python
  scalar to a bf16 tensor: narrowed to bf16 first on the CPU, measured; kept in fp32 on CUDA, whose binary
  kernels compute in fp32 op-math: see ``_eps_as_added``), ``rsqrt`` rounded to bf16,
  ``q * r`` rounded to bf16.  The one difference is the **order of the fp32 sum** (the kernel's
  reduction tree over the nope channels plus the one over the rope pairs; torch: its own order).  Two
  orders give fp32 sums a few ulps apart, which round to a different bf16 mean only when they straddle a
  bf16 rounding boundary (0 of 20,000 random head rows of 512 on the CPU, 0 of 4,096 in the interpreter);
  such a (token, head) row then differs by at most 2 bf16 steps in its nope channels.  ``rsqrt``: IEEE
  ``1 / sqrt`` under the interpreter, as torch's vectorised CPU kernel (its scalar tail, the last < 64
  elements of a tensor, rounds the square root to bf16 before dividing: a second rounding nobody else
  has), ``libdevice.rsqrt`` on a GPU (``rsqrt.approx.ftz.f32``; torch's CUDA kernel calls CUDA's ``rsqrtf``,
  ``rsqrt.approx.f32``: two forms of one hardware approximation that differ only on subnormal inputs,
  and ``mean + eps`` is at least eps).
- RoPE: the angle is the reference's single fp32 product ``fp32(pos) * inv_freq[k]``; cos/sin are
  libdevice's IEEE-accurate ``cosf``/``sinf`` on a GPU (the CUDA math library's functions, as torch's
  CUDA kernels; ``tl.cos``/``tl.sin`` may lower to ``.approx`` instructions whose error grows with the
  angle, and positions reach 1M), numpy's under the interpreter (within one fp32 ulp of torch's CPU
  values, not always equal).  The rotation ``a*cos - b*sin``, ``a*sin + b*cos`` is computed as torch
  computes it: each product rounded to fp32 on its own (on a GPU by ``mul.rn.f32`` in inline PTX, so the
  compiler cannot contract a product and the following add/sub into an FMA, which would round once
  instead of twice), then the add/sub in fp32, then bf16.  The inverse rotation negates sin first, as
  the reference does.

So on a GPU the kernels are expected to give the reference's bytes, except for the rare (token, head)
rows whose bf16 mean rounds the other way (``q_norm_rope`` only) and, should libdevice's and torch's
cosf/sinf ever differ in the last fp32 bit, a one-bf16-step difference on a rotated value with
probability ~1e-5.  Under the interpreter, numpy's cos/sin differ from torch's CPU values by one fp32
ulp in ~15 % of angles: a rotated value then rarely differs by one bf16 step (7 of 524,288 measured).
NaN/Inf inputs are out of contract.

Bytes moved per call (both ops): read T*H*D*2 (q or o) + write T*H*D*2 + T * 4 or 8 (positions)
+ rd*2 (inv_freq); e.g. 8.4 MB at T = 64, H = 64, D = 512, 2.0 us at 4.17 TB/s.

Grid: one program per (token, block of ``block_h`` heads); each program computes its token's cos/sin once
(rd/2 pairs) and applies them to its heads.  ``block_h`` defaults to the largest power of two <= 8 that
still gives >= 264 programs (2 per H200 SM) when there are enough rows, so a decode step of T = 1..64
tokens spreads over the whole GPU and prefill (T = 8192) runs 8-head (8 KB) programs.  Each Triton path
is one launch, allocates only its output, and never synchronises with the host (CUDA-graph friendly).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsv4.errors import check_tensor
from dsv4.kernels._triton_sync import pdl_enter
from dsv4.kernels.cache._triton_quant import bf16_bits, bf16_rne, mul_rn, rope_cos_sin_pos
from dsv4.kernels.cache.store import rope_cos_sin
from dsv4.kernels.dispatch import interpreter_enabled, pdl_launch, use_triton
from dsv4.model import functional as F

__all__ = ["q_norm_rope", "q_norm_rope_reference", "rope_inverse", "rope_inverse_reference"]

_POS_DTYPES = (torch.int32, torch.int64)
_TARGET_PROGRAMS = 264  # 2 programs per SM of an H200 (132 SMs)
_MAX_BLOCK_H = 8  # heads per program: 8 KB of bf16 in, 8 KB out at D = 512
_ELEMS_PER_WARP = 256  # default num_warps = block_h * D / this (8 values = one 16-byte vector per thread)
_MAX_WARPS = 8


# ============================================================================ references
def q_norm_rope_reference(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    """PyTorch definition of ``q_norm_rope``: ``apply_rope(head_rms_norm(q, eps), positions[:, None], inv_freq)``."""
    return F.apply_rope(F.head_rms_norm(q, eps), positions[:, None], inv_freq)


def rope_inverse_reference(o: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """PyTorch definition of ``rope_inverse``: ``apply_rope(o, positions[:, None], inv_freq, inverse=True)``."""
    return F.apply_rope(o, positions[:, None], inv_freq, inverse=True)


# ============================================================================ Triton kernel
@triton.jit
def _rsqrt(x, INTERP: tl.constexpr):
    """fp32 ``rsqrt`` as torch computes it: IEEE ``1 / sqrt(x)`` (vectorised CPU kernel), ``rsqrt.approx`` (CUDA)."""
    if INTERP:
        return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), tl.sqrt_rn(x))
    else:
        return libdevice.rsqrt(x)


@triton.jit
def _rope_heads_kernel(
    x_ptr,
    stride_xt,
    stride_xh,
    out_ptr,
    stride_ot,
    stride_oh,
    pos_ptr,
    stride_pos,
    inv_ptr,
    stride_inv,
    n_heads,
    eps,
    NORM: tl.constexpr,
    INVERSE: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    NOPE_PAD: tl.constexpr,
    HR: tl.constexpr,
    ROPE_ONLY: tl.constexpr = False,
    cs_ptr=None,
    CS_OUT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Token ``program_id(0)``, heads [program_id(1) * BLOCK_H, ...): x -> [per-head RMSNorm] -> RoPE -> out.

    x [T, H, D] bf16 (strides stride_xt, stride_xh, 1); out [T, H, D] bf16 (strides stride_ot, stride_oh, 1), written
    through an int16 view (bf16 bit patterns: no float conversion of the interpreter is relied on).  ``ROPE_ONLY``
    (not NORM; out may be x itself): only the rope lanes are read and written, the nope channels left as they are.
    The row is read as two tiles: the D - 2*HR nope channels [BLOCK_H, NOPE_PAD] (lanes >= D - 2*HR masked) and the rope
    pairs [BLOCK_H, HR, 2], split into their even / odd lanes in registers.  ``eps``: the norm's epsilon
    as torch adds it on the tensor's device (``_eps_as_added``).  ``CS_OUT``: the programs of head block 0 also write
    their token's (cos, sin) [HR, 2] fp32 at ``cs_ptr + t * 2 * HR`` (the forward angles, before INVERSE negates sin).
    """
    pdl_enter(PDL)
    NOPE: tl.constexpr = D - 2 * HR
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < n_heads
    c = tl.arange(0, NOPE_PAD)
    j = tl.arange(0, HR)
    roff = NOPE + 2 * j[:, None] + tl.arange(0, 2)[None, :]  # [HR, 2]: channels of the pairs (2k, 2k+1)
    src = x_ptr + t * stride_xt + h.to(tl.int64) * stride_xh  # [BLOCK_H] head rows
    dst = out_ptr + t * stride_ot + h.to(tl.int64) * stride_oh
    nmask = hm[:, None] & (c < NOPE)[None, :]
    if not ROPE_ONLY:
        xn = tl.load(src[:, None] + c[None, :], mask=nmask, other=0.0).to(tl.float32)
    xr = tl.load(src[:, None, None] + roff[None, :, :], mask=hm[:, None, None], other=0.0).to(tl.float32)
    xe, xo = tl.split(xr)
    if NORM:  # head_rms_norm in bf16: every intermediate rounded to bf16 as torch does
        ss = tl.sum(bf16_rne(xn * xn, INTERP), axis=1)
        ss += tl.sum(bf16_rne(xe * xe, INTERP) + bf16_rne(xo * xo, INTERP), axis=1)
        mean = bf16_rne(ss * (1.0 / D), INTERP)  # D a power of two: the scaling is exact
        r = bf16_rne(_rsqrt(bf16_rne(mean + eps, INTERP), INTERP), INTERP)[:, None]
        xn = bf16_rne(xn * r, INTERP)
        xe = bf16_rne(xe * r, INTERP)
        xo = bf16_rne(xo * r, INTERP)
    p = tl.load(pos_ptr + t * stride_pos + tl.arange(0, 1))  # [1]: the token's position
    cos, sin = rope_cos_sin_pos(p, 1, inv_ptr + j * stride_inv, INTERP)  # [1, HR], shared by the heads
    if CS_OUT:
        if tl.program_id(1) == 0:
            cso = cs_ptr + t * (2 * HR) + 2 * j[None, :, None] + tl.arange(0, 2)[None, None, :]
            tl.store(cso, tl.join(cos, sin))
    if INVERSE:
        sin = -sin
    ye = bf16_rne(mul_rn(xe, cos, INTERP) - mul_rn(xo, sin, INTERP), INTERP)
    yo = bf16_rne(mul_rn(xe, sin, INTERP) + mul_rn(xo, cos, INTERP), INTERP)
    if not ROPE_ONLY:
        tl.store(dst[:, None] + c[None, :], bf16_bits(xn), mask=nmask)
    tl.store(dst[:, None, None] + roff[None, :, :], bf16_bits(tl.join(ye, yo)), mask=hm[:, None, None])


# ============================================================================ launch
def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _default_block_h(t: int, h: int) -> int:
    """Largest power of two <= min(_MAX_BLOCK_H, next_pow2(h)) that keeps >= _TARGET_PROGRAMS programs (or 1)."""
    bh = 1
    while bh < _MAX_BLOCK_H and bh < h and t * triton.cdiv(h, 2 * bh) >= _TARGET_PROGRAMS:
        bh *= 2
    return bh


@functools.lru_cache(maxsize=16)
def _bf16_scalar(v: float) -> float:
    """``v`` as torch's CPU kernels add it to a bf16 tensor: narrowed to the tensor's dtype first (bf16)."""
    return torch.tensor(v, dtype=torch.float64).to(torch.bfloat16).item()


def _eps_as_added(eps: float, device: torch.device) -> float:
    """The norm's epsilon as torch adds it to the bf16 mean on ``device``: narrowed to bf16 on the CPU; in fp32
    on CUDA (its binary kernels take a Python scalar in the op-math type, fp32: H200, 2026-12-03, narrowing
    there moved 278 of 8,192 head rows whose mean of squares is near eps)."""
    return _bf16_scalar(eps) if device.type == "cpu" else eps


def _launch(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    norm: bool,
    inverse: bool,
    block_h: int | None,
    num_warps: int | None,
    in_place: bool = False,
    cos_sin_out: torch.Tensor | None = None,
) -> torch.Tensor:
    t, h, d = x.shape
    out = x if in_place else torch.empty((t, h, d), dtype=torch.bfloat16, device=x.device)
    if out.numel() == 0:
        return out
    bh = _default_block_h(t, h) if block_h is None else block_h
    if not _is_pow2(bh):
        raise ValueError(f"block_h: expected a power of two, got {bh!r}")
    nw = num_warps or max(1, min(_MAX_WARPS, bh * d // _ELEMS_PER_WARP))
    hr = inv_freq.shape[0]
    o16 = out.view(torch.int16)
    _rope_heads_kernel[(t, triton.cdiv(h, bh))](
        x, x.stride(0), x.stride(1), o16, out.stride(0), out.stride(1), positions, positions.stride(0), inv_freq,
        inv_freq.stride(0), h, _eps_as_added(float(eps), x.device), NORM=norm, INVERSE=inverse,
        INTERP=interpreter_enabled(), BLOCK_H=bh, D=d, NOPE_PAD=triton.next_power_of_2(max(1, d - 2 * hr)), HR=hr,
        ROPE_ONLY=in_place, cs_ptr=cos_sin_out, CS_OUT=cos_sin_out is not None, num_warps=nw, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def _check_args(name: str, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    check_tensor(name, x, dtype=torch.bfloat16, ndim=3)
    t, _, d = x.shape
    if x.stride(2) != 1:
        raise ValueError(f"{name}: expected unit stride in the last dim, got strides {x.stride()}")
    check_tensor("positions", positions, dtype=_POS_DTYPES, shape=[t], device=x.device)
    check_tensor("inv_freq", inv_freq, dtype=torch.float32, ndim=1, device=x.device)
    n = inv_freq.shape[0]
    if not 1 <= n <= d // 2:
        raise ValueError(f"inv_freq: expected 1..{d // 2} frequencies (rope dims <= head dim {d}), got {n}")


def _triton_ok(
    backend: str, name: str, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, pow2_head_dim: bool
) -> bool:
    """Whether the Triton kernel takes this call; ``backend="triton"`` with a shape it cannot take raises."""
    problems = []
    if not _is_pow2(inv_freq.shape[0]):
        problems.append(
            f"inv_freq: the Triton kernel needs a power-of-two number of frequencies, got {inv_freq.shape[0]}"
        )
    if pow2_head_dim and not _is_pow2(x.shape[2]):
        problems.append(f"{name}: the Triton kernel needs a power-of-two head dim, got shape {list(x.shape)}")
    if backend == "triton" and problems:
        raise ValueError(problems[0])
    return use_triton(backend, x, positions, inv_freq, has_kernel=not problems)


# ============================================================================ public API
def q_norm_rope(
    q: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    backend: str = "auto",
    *,
    block_h: int | None = None,
    num_warps: int | None = None,
    cos_sin_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head RMSNorm then RoPE of the query, in one launch: ``apply_rope(head_rms_norm(q, eps),
    positions[:, None], inv_freq)``.

    q [T, H, D] bf16 (any strides with a unit stride in D; the ``wq_b`` output viewed as heads);
    positions [T] int32/int64 (absolute token positions, one per token, shared by its heads);
    inv_freq [rd/2] fp32 (the layer's RoPE frequencies, YaRN applied; rd <= D); eps: the norm's epsilon.
    Returns a new contiguous bf16 [T, H, D] tensor: the first D - rd channels normed, the last rd normed
    and rotated.  Numerics: see the module docstring (the reference's bytes except for the fp32 sum order
    of the norm's mean, which can move a rare head row by <= 2 bf16 steps).  Bytes: reads 2*T*H*D + 4*T
    (int32 positions), writes 2*T*H*D.  The Triton kernel needs D and rd/2 to be powers of two
    (``backend="auto"`` falls back to torch otherwise).  Tuning (Triton only; results do not depend on it):
    ``block_h`` heads per program (a power of two), ``num_warps``.  ``cos_sin_out`` (fp32 [T, rd/2, 2], contiguous):
    receives each token's (cos, sin) of its rotation, as computed for it (the Triton path: in the same launch), for
    an op that undoes it later at the same angles (``fp8_linear(derotate=)``).
    """
    _check_args("q", q, positions, inv_freq)
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    if cos_sin_out is not None:
        shape = [q.shape[0], inv_freq.shape[0], 2]
        check_tensor("cos_sin_out", cos_sin_out, dtype=torch.float32, shape=shape, device=q.device, contiguous=True)
    if not _triton_ok(backend, "q", q, positions, inv_freq, pow2_head_dim=True):
        if cos_sin_out is not None:
            cos_sin_out.copy_(torch.stack(rope_cos_sin(positions, inv_freq), dim=-1))
        return q_norm_rope_reference(q, positions, inv_freq, eps)
    return _launch(q, positions, inv_freq, eps, True, False, block_h, num_warps, cos_sin_out=cos_sin_out)


def rope_inverse(
    o: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    backend: str = "auto",
    *,
    block_h: int | None = None,
    num_warps: int | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """Inverse RoPE of the attention output at its query's position, in one launch: ``apply_rope(o,
    positions[:, None], inv_freq, inverse=True)``.

    o [T, H, D] bf16 (any strides with a unit stride in D); positions [T] int32/int64; inv_freq [rd/2]
    fp32 (rd <= D).  Returns a new contiguous bf16 [T, H, D] tensor: the first D - rd channels copied, the
    last rd rotated by the conjugate (fp32 rotation, bf16 result).  Numerics: see the module docstring
    (the reference's bytes on a GPU, up to libdevice's vs torch's cosf/sinf).  Bytes: reads 2*T*H*D + 4*T,
    writes 2*T*H*D.  The Triton kernel needs rd/2 to be a power of two.  Tuning as ``q_norm_rope``.
    ``in_place``: rotate o's rope channels where they are and return o (the nope channels are neither read nor
    written: 2*T*H*rd bytes each way instead of 2*T*H*D, 1/8 of them at V4's D = 512, rd = 64); for a caller that
    owns o and has no further use for it unrotated.  H200 (2026-12-05_h200_rope_tails_s20.*, V4-Flash widths, graph
    time): 65,536 tokens 802 us in place vs 2,500 for the copy (8,192: 101 vs 317).
    """
    _check_args("o", o, positions, inv_freq)
    if not isinstance(in_place, bool):
        raise ValueError(f"in_place: expected a bool, got {in_place!r}")
    if not _triton_ok(backend, "o", o, positions, inv_freq, pow2_head_dim=False):
        ref = rope_inverse_reference(o, positions, inv_freq)
        return o.copy_(ref) if in_place else ref
    return _launch(o, positions, inv_freq, 0.0, False, True, block_h, num_warps, in_place)
