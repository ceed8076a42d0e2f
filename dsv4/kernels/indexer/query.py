"""The indexer query after its GEMMs, in one launch (spec §4, §13): RoPE -> Hadamard -> MXFP4, head weights.

The lightning indexer's query side is two GEMMs (``wq_b`` on the normed q latent, ``weights_proj`` on x)
followed by elementwise work that PyTorch runs as ~80 small launches (about 170 us of device time at
V4-Flash widths, B = 64, on the H200).  ``indexer_query_tail`` does all of it in one launch:

    q_lin [T, Hi*Di] bf16 --RoPE(t) on the last rd dims--> bf16 --Hadamard (fp32, x Di^-1/2)--> bf16
          --MXFP4 quantise + dequantise (blocks of 32)--> q_idx [T, Hi, Di] bf16 (e2m1 x 2^k values)
    w_lin [T, Hi] bf16 --x (Di^-1/2 * Hi^-1/2), rounded to bf16--> weights [T, Hi] fp32

The reference (``indexer_query_tail_reference``) is the composition of the model's own functions
(``apply_rope``, ``hadamard``, ``mxfp4_simulate``), which the dense reference layer uses too.

Kernel: one program per (token, block of 16 heads); the token's cos/sin are computed once for its heads.  The
Hadamard uses H_Di = H_2 (x) H_{Di/2} with the nope and rope halves as the two factors' operands:
z[:Di/2] = A + B, z[Di/2:] = A - B, A = nope @ H, B = rope @ H, two tf32 MMAs with one [Di/2, Di/2] sign
matrix built in registers.  The operands are bf16 values and +-1, so every product is exact in tf32 and
only the fp32 summation order differs from the reference's fp32 matmul: the sums agree exactly unless a
row's values span more binades than fp32's 24 bits absorb (not the case for real activations).  The RoPE
rotation rounds ``a*cos`` and ``b*sin`` separately as torch does (``mul_rn``: no FMA contraction), with
libdevice cos/sin (numpy's under the interpreter: within an fp32 ulp).  So q_idx equals the reference
except where an fp32 rounding of a sum or an ulp of cos/sin moves a value across a bf16 / e2m1 rounding
boundary: then that value (or its block's scale) differs by one quantisation step.  The head
weights are one fp32 multiplication rounded to bf16, as torch does: equal.

Bytes (per token): q_lin Hi*Di*2 + w_lin Hi*2 read, q_idx Hi*Di*2 + weights Hi*4 written; at Hi = 64,
Di = 128: 33.2 KB a token (2.1 MB at B = 64, 0.5 us at 4.17 TB/s).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.formats import MXFP4KeyFormat
from dsv4.kernels._triton_sync import pdl_enter
from dsv4.kernels.cache._triton_quant import (
    bf16_rne,
    ceil_log2_ratio,
    e2m1_round,
    hadamard_dots,
    mul_rn,
    pow2_neg,
    qmax_split,
    rope_cos_sin_pos,
    sylvester_signs,
)
from dsv4.kernels.dispatch import interpreter_enabled, pdl_launch, use_triton
from dsv4.model import functional as F

__all__ = ["indexer_query_tail", "indexer_query_tail_reference"]

_INTS = (torch.int32, torch.int64)
_BLOCK_H = 16  # heads of one token a program: the MMA's M (>= 16); V4: 64 heads -> 4 programs a token
_WARPS = 4
# (Several tokens a program, one after another with the sign matrix built once, were no faster on the H200, 2026-12-05
# (2026-12-05_h200_rope_tails_s20.*, graph time, 8,192 / 65,536 tokens): 1 token a program 394.7 / 3,094 us, 2 469.2 /
# 3,698, 4 466.2 / 3,650, 8 453.0 / 3,458, 16 457.2 / 3,375: the kernel is bound by its per-value instructions (rope
# roundings, MXFP4 round trip), not by the per-program set-up; removed.)


def indexer_query_tail_reference(
    q_lin: torch.Tensor,
    w_lin: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    fmt: MXFP4KeyFormat,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of ``indexer_query_tail`` (the model's functions, as the dense reference layer)."""
    hi, di = w_lin.shape[-1], fmt.dim
    q = q_lin.unflatten(-1, (hi, di))
    q_idx = F.mxfp4_simulate(F.hadamard(F.apply_rope(q, positions[:, None], inv_freq)), fmt)
    return q_idx, (w_lin * F.indexer_weight_scale(hi, di)).float()


@triton.jit
def _mxfp4_roundtrip(z, ROWS: tl.constexpr, NBH: tl.constexpr, QB: tl.constexpr, FLOOR: tl.constexpr,
                     Q_EXP: tl.constexpr, Q_MANT: tl.constexpr):  # fmt: skip
    """Rows z [ROWS, NBH * QB] fp32 (bf16 values) -> MXFP4 blocks of QB -> dequantised fp32 values."""
    zb = tl.reshape(z, [ROWS, NBH, QB])
    amax = tl.max(tl.abs(zb), axis=2)
    e = ceil_log2_ratio(amax, FLOOR, Q_EXP, Q_MANT)  # in [-126, 126]: amax >= FLOOR, finite bf16 input
    v = e2m1_round(zb * pow2_neg(e)[:, :, None]) * pow2_neg(-e)[:, :, None]
    return tl.reshape(v, [ROWS, NBH * QB])


@triton.jit
def _indexer_query_kernel(
    q_ptr,
    stride_qt,
    w_ptr,
    stride_wt,
    pos_ptr,
    inv_ptr,
    out_ptr,
    wout_ptr,
    w_scale,
    HI: tl.constexpr,
    DI: tl.constexpr,
    HR: tl.constexpr,
    HAD_SCALE: tl.constexpr,
    QB: tl.constexpr,
    FLOOR: tl.constexpr,
    Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Token ``program_id(0)``, heads [program_id(1) * BLOCK_H, ...); see the module docstring.  The token's
    cos/sin are computed once for its heads.  Requires DI = 2 * (2 * HR): nope and rope halves of equal width.  The
    Hadamard MMAs take bf16 operands on the GPU (the values are bf16 and the signs +-1: exact products, as tf32 would
    give) and tf32 under the interpreter (its bf16 dot is wrong)."""
    pdl_enter(PDL)
    NOPE: tl.constexpr = DI // 2
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < HI
    row = q_ptr + t * stride_qt + h * DI  # [BLOCK_H]
    cn = tl.arange(0, NOPE)
    j = tl.arange(0, HR)
    xn = tl.load(row[:, None] + cn[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    roff = NOPE + 2 * j[:, None] + tl.arange(0, 2)[None, :]  # [HR, 2] (even, odd) lanes of each rope pair
    xr = tl.load(row[:, None, None] + roff[None, :, :], mask=ok[:, None, None], other=0.0).to(tl.float32)
    xe, xo = tl.split(xr)
    c, s = rope_cos_sin_pos(tl.load(pos_ptr + t + tl.arange(0, 1)), 1, inv_ptr + j, INTERP)  # [1, HR]
    ye = bf16_rne(mul_rn(xe, c, INTERP) - mul_rn(xo, s, INTERP), INTERP)  # torch's roundings (no FMA)
    yo = bf16_rne(mul_rn(xe, s, INTERP) + mul_rn(xo, c, INTERP), INTERP)
    rot = tl.reshape(tl.join(ye, yo), [BLOCK_H, NOPE])
    za, zb = hadamard_dots(xn, rot, sylvester_signs(cn, INTERP), INTERP)
    lo = _mxfp4_roundtrip(bf16_rne((za + zb) * HAD_SCALE, INTERP), BLOCK_H, NOPE // QB, QB, FLOOR, Q_EXP, Q_MANT)
    hi = _mxfp4_roundtrip(bf16_rne((za - zb) * HAD_SCALE, INTERP), BLOCK_H, NOPE // QB, QB, FLOOR, Q_EXP, Q_MANT)
    orow = out_ptr + (t * HI + h) * DI
    tl.store(orow[:, None] + cn[None, :], lo.to(tl.bfloat16), mask=ok[:, None])
    tl.store(orow[:, None] + NOPE + cn[None, :], hi.to(tl.bfloat16), mask=ok[:, None])
    wv = tl.load(w_ptr + t * stride_wt + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(wout_ptr + t * HI + h, bf16_rne(wv * w_scale, INTERP), mask=ok)


def indexer_query_tail(
    q_lin: torch.Tensor,
    w_lin: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    fmt: MXFP4KeyFormat,
    backend: str = "auto",
    *,
    block_h: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer query from its GEMM outputs, as the scores kernel takes it.

    Args:
        q_lin: [T, Hi*Di] bf16, ``qr @ wq_b.T`` (the last dim contiguous); Di = ``fmt.dim``.
        w_lin: [T, Hi] bf16, ``x @ weights_proj.T`` (the last dim contiguous).
        positions: [T] int32/int64 absolute token positions (the RoPE angle of every head of the token).
        inv_freq: [rd/2] fp32 RoPE frequencies of the layer; rd = rope dims, the last rd of each head.
        fmt: the indexer key format (the query is quantised like the keys: MXFP4 blocks of ``fmt.block``).
        backend: "auto" | "torch" | "triton".

    Returns:
        (q_idx [T, Hi, Di] bf16: RoPE'd, Hadamard-rotated, MXFP4-simulated; weights [T, Hi] fp32: w_lin x
        Di^-1/2 Hi^-1/2 rounded to bf16).  New tensors.  The Triton kernel needs Di = 2 rd (nope = rope
        half), Di/2 a power of two and a multiple of ``fmt.block``; other geometries use the reference.

    Tuning (Triton only; the results do not depend on it): ``block_h`` heads a program (power of two >= 16; default
    _BLOCK_H), ``num_warps``.
    """
    check_tensor("w_lin", w_lin, dtype=torch.bfloat16, ndim=2)
    t, hi = w_lin.shape
    di = fmt.dim
    dev = w_lin.device
    check_tensor("q_lin", q_lin, dtype=torch.bfloat16, shape=(t, hi * di), device=dev)
    check_tensor("positions", positions, dtype=_INTS, shape=(t,), device=dev)
    check_tensor("inv_freq", inv_freq, dtype=torch.float32, ndim=1, device=dev)
    rd = 2 * inv_freq.shape[0]
    if not 0 < rd < di:
        raise ValueError(f"inv_freq: expected 0 < 2 * len(inv_freq) < Di = {di}, got {rd}")
    if q_lin.stride(-1) != 1 or w_lin.stride(-1) != 1:
        raise ValueError("q_lin, w_lin: the last dim must be contiguous")
    half = di // 2
    fits = rd == half and half & (half - 1) == 0 and half % fmt.block == 0 and half >= 16
    if not (use_triton(backend, q_lin, w_lin, positions, inv_freq) and fits):
        return indexer_query_tail_reference(q_lin, w_lin, positions, inv_freq, fmt)
    bh = block_h or _BLOCK_H
    if not isinstance(bh, int) or bh < 16 or bh & (bh - 1):
        raise ValueError(f"block_h: expected a power of two >= 16, got {bh!r}")
    q_out = torch.empty((t, hi, di), dtype=torch.bfloat16, device=dev)
    w_out = torch.empty((t, hi), dtype=torch.float32, device=dev)
    if t * hi == 0:
        return q_out, w_out
    q_exp, q_mant = qmax_split(fmt.fp4_max)
    _indexer_query_kernel[(t, triton.cdiv(hi, bh))](
        q_lin, q_lin.stride(0), w_lin, w_lin.stride(0), positions, inv_freq, q_out, w_out,
        F.indexer_weight_scale(hi, di), HI=hi, DI=di, HR=rd // 2, HAD_SCALE=di**-0.5, QB=fmt.block,
        FLOOR=fmt.amax_floor, Q_EXP=q_exp, Q_MANT=q_mant, BLOCK_H=bh, INTERP=interpreter_enabled(),
        num_warps=num_warps or _WARPS, **pdl_launch(q_lin.device),
    )  # fmt: skip
    return q_out, w_out
