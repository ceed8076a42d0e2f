"""The attention layer's dense projections on the checkpoint's FP8 weights: ``fp8_linear``.

A decode step's projections (``wq_a``, ``wq_b``, ``wkv``, grouped ``wo_a``, ``wo_b`` and the indexer's ``wq_b`` and
``weights_proj``) are GEMMs of a few tokens against large weights: their time is the weights' bytes.  The layer
used to run them as cuBLAS bf16 GEMMs on weights dequantised at load (2 bytes a weight).  DeepSeek-V4's checkpoints
store these weights as e4m3 with one power-of-two (UE8M0) scale per 128 x 128 block (``formats.fp8_weight``), so
``fp8_linear`` keeps them so (1 byte a weight) and dequantises in the kernel:

    y[m, n] = bf16( Σ_kb  s[n // 128, kb] · Σ_{k in block kb} x[m, k] · e4m3[n, k] )

Each 128-wide K block is one bf16 MMA of x (bf16) and the weight bytes converted to bf16 (exact: e4m3 has 4
significant bits), its fp32 partial multiplied by the block's scale and added to the fp32 accumulator.  For a
power-of-two scale that product is exact, so the sum has the same terms as a bf16 GEMM on the dequantised weight
(``x·bf16(e4m3·s)``, every product exact in fp32); results differ from cuBLAS's only by the order of the fp32
additions (and from there, rarely, in the last bit of the bf16 output).  A non-power-of-two fp32 scale (a Hugging
Face conversion) is applied the same way: the exact ``x·e4m3·s`` up to fp32 rounding, where the dequantised bf16
weight rounds ``e4m3·s`` to 8 bits first.

``derotate``: ``wo_a``'s x is the attention output, whose heads' last 64 lanes still carry the query's RoPE; the
kernel undoes it in the K block that ends each head as it loads it (at the (cos, sin) the query's RoPE launch wrote),
so the layer's separate inverse-RoPE launch goes (the same bf16 values; ``projections.FUSE_DEROTATE``).

``out_dtype=torch.float32`` gives the fp32 sums themselves: the compressors' projections (fp32 in the reference) on
FP8 compressor weights, a quarter of the bytes of their fp32 form, all of a layer's in one launch.

Groups (``groups=G``): the weight's rows are G blocks of N (``wo_a``: o_groups blocks of o_lora_rank rows) and x's
columns G blocks of K; block g of the output is x's block g times the weight's block g (``einsum("mgk,gnk->mgn")``).
Each group's rows must start on a scale block (N a multiple of 128 when G > 1).

Launch (M <= ``DECODE_MAX_M`` tokens): grid (G·N / BLOCK_N, M / BLOCK_M, K splits); the MMA computes w·xᵀ (the 64
weight rows on the wgmma's M side, the tokens padded to >= 16 on its N side; the weight tile is converted in
registers and feeds the MMA from there), K split until the grid has ~2 programs per SM, each split at least two
K blocks.  With a split the partial tiles go to a [split, M, G·N] fp32 buffer summed in split order, by the last
program of each output tile (``counters``, M <= ``FUSED_SUM_MAX_M``) or by a second launch: deterministic.
Above DECODE_MAX_M tokens (a prefill chunk: compute-bound) the weight is dequantised to bf16 by one launch and the
GEMM is cuBLAS's (its bytes are then ~2 % of the GEMM's time at 8,192 tokens).

Cost in decode: ``N·K + 4·N·K/128²`` weight bytes + ``2·M·(K + N)`` activation bytes, against ``2·N·K`` for the
bf16 GEMM: ~half.  Not yet timed on the H200 (``benchmarks/bench_fp8_linear.py``; ``run_h200.sh fp8_linear_s22``).

Nothing is read back to the host and every buffer comes from the caching allocator: CUDA-graph capturable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.formats.fp8_weight import WEIGHT_BLOCK, FP8Weight
from dsv4.kernels._triton_sync import pdl_enter
from dsv4.kernels.cache._triton_quant import bf16_rne, mul_rn
from dsv4.kernels.dispatch import DEFAULT_NUM_SMS, interpreter_enabled, num_sms, pdl_launch, use_triton
from dsv4.kernels.linear import _store_out, _store_tile, _sum_splits_kernel, check_counters, linear_fp32_group

__all__ = [
    "DECODE_MAX_M",
    "FP8LinearLaunch",
    "fp8_linear",
    "fp8_linear_launch",
    "fp8_linear_mixed",
    "fp8_linear_reference",
    "grouped_linear",
]

DECODE_MAX_M = 128  # tokens up to which the kernel runs; above, dequantise + cuBLAS
FUSED_SUM_MAX_M = 16  # ``counters`` fuse the split sum into the launch up to here (as ``linear.FUSED_SUM_MAX_M``)
_BLOCK_K = WEIGHT_BLOCK  # one scale a K block of a tile (BLOCK_N divides 128: a tile's rows share a scale row)
_SUM_BLOCK = 1024
_DEQUANT_BLOCK_N = 32
# The weight bytes become bf16 through ``_e4m3_to_bf16`` (integer ops and one bf16 multiply a pair) instead of Triton's
# cast (an F2F a value on the conversion unit).  Static sm_90 figures in the results README; not yet timed
# (``bench_fp8_linear.py`` times both).
CVT_ASM = True
# Up to this many tokens the kernel may take its GEMV form (``gemv``): no MMA, the tokens' tile [next_pow2(M), BLOCK_K]
# times the converted weight tile [BLOCK_N, BLOCK_K] as fp32 products summed along K in registers, so a program's
# tile pads M to 1-4 rows instead of the MMA's 16 and the weight needs no trip through the tensor core.  At one token
# the present kernel reads the wide weights at 35-44 % of the H200's HBM rate (``wq_b``, ``wo_a``, ``wo_b``; session
# 25's sweep) where cuBLAS's bf16 GEMV reaches 60-65 %.  0 (off) until timed (``bench_fp8_linear.py --sweep``).
GEMV_MAX_M = 0
_GEMV_LIMIT = 4  # the largest M the GEMV form takes (its [BLOCK_N, M, BLOCK_K] product tile lives in registers)


class FP8LinearLaunch(NamedTuple):
    """Launch of ``fp8_linear``'s kernel: tile rows (weights) and columns (tokens), warps, pipeline stages, K splits."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split_k: int


def fp8_linear_launch(
    m: int,
    rows: int,
    k: int,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
) -> FP8LinearLaunch:
    """The launch for x [m, G·k] and a weight of ``rows`` = G·N rows: BLOCK_M the next power of two >= m (>= 16,
    ``tl.dot``'s minimum), BLOCK_N 64, 4 warps (8 at BLOCK_M 128), 4 stages; ``split_k`` (unless given) doubled while
    the grid has fewer than ~2 programs per SM while the doubled split keeps >= 2 K blocks a split and its partials'
    traffic (written and read again: 2·4·split·m·rows bytes) within the weight bytes (rows·k).  Given values override
    (checked).  The partials' bound was 1/4 of the weight bytes until the H200 sweep of 2026-12-05
    (``bench_fp8_linear.py --sweep``): at 64 tokens it kept ``wq_a`` / ``wkv`` / ``weights_proj`` (K = 4,096) at 2
    splits, 14.5 / 14.9 / 14.1 µs, where 8 splits took 9.4 / 8.8 / ~7 µs."""
    if not isinstance(m, int) or not 1 <= m <= DECODE_MAX_M:
        raise ValueError(f"m: expected tokens in [1, {DECODE_MAX_M}], got {m!r}")
    bm = max(16, triton.next_power_of_2(m))
    bn = 64 if block_n is None else block_n
    if not isinstance(bn, int) or bn not in (16, 32, 64, 128):
        raise ValueError(f"block_n: expected 16, 32, 64 or 128 (a divisor of the 128-row scale block), got {bn!r}")
    warps = (4 if bm <= 64 else 8) if num_warps is None else num_warps
    if not isinstance(warps, int) or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps: expected a power of two in [1, 16], got {warps!r}")
    stages = 4 if num_stages is None else num_stages
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"num_stages: expected an int >= 1, got {stages!r}")
    if split_k is None:
        tiles = triton.cdiv(rows, bn)
        split_k = 1
        while tiles * split_k < 1.9 * num_sms and k >= 2 * (2 * split_k) * _BLOCK_K and 8 * (2 * split_k) * m <= k:
            split_k *= 2
    elif not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k: expected an int >= 1, got {split_k!r}")
    return FP8LinearLaunch(bm, bn, warps, stages, split_k)


def fp8_linear_reference(x: torch.Tensor, w: FP8Weight, groups: int = 1) -> torch.Tensor:
    """PyTorch definition: per group g, ``x[:, g·K:(g+1)·K] @ dequantize(w)[g·N:(g+1)·N]ᵀ`` in fp64 (exact
    products and sums of the fp32 values), rounded to x's dtype.  x [M, G·K]; w [G·N, K] -> [M, G·N]."""
    wd = w.dequantize().double()
    n, k = wd.shape[0] // groups, wd.shape[1]
    xg = x.double().unflatten(-1, (groups, k))
    y = torch.einsum("mgk,gnk->mgn", xg, wd.view(groups, n, k))
    return y.flatten(-2).float().to(x.dtype)


def _check_derotate(derotate, x: torch.Tensor, cols: int) -> tuple[torch.Tensor, int] | None:
    """``fp8_linear``'s ``derotate`` checked: (cos_sin [M, rd/2, 2] fp32 contiguous, head_dim >= rd dividing x's
    columns), or None."""
    if derotate is None:
        return None
    if not (isinstance(derotate, tuple) and len(derotate) == 2):
        raise ValueError(f"derotate: expected (cos_sin, head_dim), got {type(derotate).__name__}")
    cs, hd = derotate
    check_tensor("derotate cos_sin", cs, dtype=torch.float32, ndim=3, device=x.device)
    if cs.shape[0] != x.shape[0] or cs.shape[2] != 2:
        raise ValueError(f"derotate cos_sin: expected shape [{x.shape[0]}, rd/2, 2], got {list(cs.shape)}")
    if not isinstance(hd, int) or hd < 2 * cs.shape[1] or cols % hd:
        raise ValueError(
            f"derotate head_dim: expected an int >= the rope dims ({2 * cs.shape[1]}) dividing x's {cols} columns, "
            f"got {hd!r}"
        )
    return cs.contiguous(), hd


def _check_gemv(gemv: bool | None, m: int) -> bool:
    """Whether the launch takes the kernel's GEMV form: ``gemv`` (None: M <= ``GEMV_MAX_M``), which needs M <= 4."""
    if gemv is None:
        return m <= min(GEMV_MAX_M, _GEMV_LIMIT)
    if gemv and m > _GEMV_LIMIT:
        raise ValueError(f"gemv: the GEMV form takes at most {_GEMV_LIMIT} tokens, got {m}")
    return bool(gemv)


def _check(x: torch.Tensor, w: FP8Weight, groups: int) -> tuple[int, int, int]:
    if not isinstance(w, FP8Weight):
        raise ValueError(f"w: expected an FP8Weight, got {type(w).__name__}")
    check_tensor("x", x, dtype=torch.bfloat16, ndim=2, device=w.device)
    rows, k = w.shape
    if not isinstance(groups, int) or groups < 1 or rows % groups:
        raise ValueError(f"groups: expected a positive divisor of the weight's {rows} rows, got {groups!r}")
    n = rows // groups
    if groups > 1 and n % WEIGHT_BLOCK:
        raise ValueError(f"groups: expected each group's rows ({n}) to be a multiple of {WEIGHT_BLOCK} (a scale block)")
    if x.shape[1] != groups * k:
        raise ValueError(f"x: expected {groups * k} columns ({groups} group(s) of the weight's {k}), got {x.shape[1]}")
    return n, k, x.shape[0]


@triton.jit
def _e4m3_to_bf16(b):
    """e4m3 -> bf16 (exact) without Triton's per-element F2F: per pair, ``cvt.rn.f16x2.e4m3x2`` (exact: every e4m3
    value is a normal f16 or zero), the f16 bits moved to bf16's fields (magnitude >> 3: f16's exponent field read as
    bf16's, so the value is v·2^-112; f16's 7 low mantissa bits are zero for an e4m3 value, nothing is lost; sign
    kept; zero stays zero), then ``mul.rn.bf16x2`` by 2^112 (exact: a power of two, results normal).  5 instructions
    a pair, none on the conversion unit that F2F uses (16 a clock per SM, below the HBM rate of weight bytes).
    e4m3 NaN (not in a checkpoint) gives a finite garbage value."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 h, t;
        cvt.rn.f16x2.e4m3x2 h, $1;
        and.b32 t, h, 0x7FFF7FFF;
        shr.b32 t, t, 3;
        and.b32 h, h, 0x80008000;
        or.b32 t, t, h;
        mov.b32 h, 0x77807780;
        mul.rn.bf16x2 $0, t, h;
        }
        """,
        constraints="=r,h",
        args=[b.to(tl.uint8, bitcast=True)],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _derotate_tile(a, cos, sin, lane, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] bf16 x tile -> the same with its pairs (2j, 2j + 1) where ``lane[j]`` rotated by
    (cos, sin) [BLOCK_M, BLOCK_K / 2] (sin already negated: the inverse), as ``rope_inverse`` rotates them: fp32
    products each rounded (``mul_rn``), the sum rounded to bf16; the other pairs as they are."""
    xe, xo = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))
    xe = xe.to(tl.float32)
    xo = xo.to(tl.float32)
    ye = bf16_rne(mul_rn(xe, cos, INTERP) - mul_rn(xo, sin, INTERP), INTERP)
    yo = bf16_rne(mul_rn(xe, sin, INTERP) + mul_rn(xo, cos, INTERP), INTERP)
    ye = tl.where(lane[None, :], ye, xe)
    yo = tl.where(lane[None, :], yo, xo)
    return tl.reshape(tl.join(ye, yo), [BLOCK_M, BLOCK_K]).to(tl.bfloat16)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, NT, stride_xm, k_per_split, split, tiles_n, kblocks,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    PARTIAL: tl.constexpr, FUSED_SUM: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr,
    CVT_ASM: tl.constexpr = True, BF16_RNE: tl.constexpr = False, cs_ptr=None, HEAD_D: tl.constexpr = 0,
    HR: tl.constexpr = 1, PDL: tl.constexpr = False, out32_ptr=None, N32=0, MIXED: tl.constexpr = False,
    GEMV: tl.constexpr = False,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of group g's x_g·w_gᵀ over K range [pid_k·k_per_split, +k_per_split).

    Program (g·tiles_n + n tile, m tile, k split).  x [M, G·K] bf16 (row stride ``stride_xm``), w [G·N, K] e4m3
    (contiguous), s [ceil(G·N/128), kblocks] fp32, out [M, NT = G·N] bf16 (OUT_FP32: fp32), contiguous.  Per K
    block: the weight tile as bf16 (exact), one MMA w·xᵀ from zero (exact products, fp32 sum), times the block's
    scale, into the fp32 accumulator.  PARTIAL: the fp32 tile goes to part[pid_k] ([split, M, G·N]); FUSED_SUM:
    the last of the tile's ``split`` programs (``last_arrival`` on ``cnt_ptr[pid_m·tiles + pid_n]``) adds the
    partials in split order and stores the tile.  INTERP (the interpreter): operands widened to fp32 (its bf16 dot
    multiplies raw bits).  CVT_ASM: the weight bytes to bf16 by ``_e4m3_to_bf16`` (else Triton's cast: the same
    values).  BF16_RNE: ``linear._store_out``'s (a bf16 out under the interpreter).  HEAD_D > 0 (``derotate``): x's
    columns are heads of HEAD_D (a multiple of BLOCK_K), the last 2·HR of each (<= BLOCK_K) RoPE pairs; the K block
    that ends a head is de-rotated as it is loaded (``_derotate_tile``) by its row's (cos, sin) (``cs_ptr`` [M, HR, 2]
    fp32, read there: a few hundred bytes from L2).  MIXED (one group): the tiles of columns below N32 (a multiple of
    BLOCK_N) go to ``out32_ptr`` ([M, NT] fp32) unrounded, the others to out (bf16).  GEMV (BLOCK_M <= 4): no MMA;
    each K block's products x·(e4m3·s) (exact for a power-of-two scale: bf16 times e4m3 times 2^e) added lane by lane
    into a [BLOCK_N, BLOCK_M, BLOCK_K] fp32 accumulator, summed along K once after the loop (no shuffles a block)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    g = pid_n // tiles_n
    tn = pid_n - g * tiles_n
    rn = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # rows past M / N read valid rows (wrapped) so that the loop needs no row masks; they are masked at the store
    w_rows = (g * N + rn % N).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * K + (k_lo + rk)[None, :]
    x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * stride_xm + (g * K + k_lo + rk)[None, :]
    s_ptrs = s_ptr + ((g * N + tn * BLOCK_N) // BLOCK_K) * kblocks + k_lo // BLOCK_K
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GEMV:  # per-lane partial sums across the K blocks, reduced along K once after the loop
        acc3 = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            in_k = (k + rk < K)[None, :]
            a = tl.load(x_ptrs, mask=in_k, other=0.0)
            b = tl.load(w_ptrs, mask=in_k, other=0.0)
        if HEAD_D > 0:
            if k % HEAD_D == HEAD_D - BLOCK_K:  # a head's last block: its last HR pairs by (cos, -sin), the rest (1, 0)
                j = tl.arange(0, BLOCK_K // 2) - (BLOCK_K // 2 - HR)
                lane = j >= 0
                cso = cs_ptr + (rm % M).to(tl.int64)[:, None] * (2 * HR) + 2 * tl.maximum(j, 0)[None, :]
                cos = tl.load(cso, mask=lane[None, :], other=1.0)
                sin = -tl.load(cso + 1, mask=lane[None, :], other=0.0)
                a = _derotate_tile(a, cos, sin, lane, BLOCK_M, BLOCK_K, INTERP)
        s = tl.load(s_ptrs)
        if GEMV:
            wf = _e4m3_to_bf16(b).to(tl.float32) if CVT_ASM and not INTERP else b.to(tl.float32)
            acc3 += wf[:, None, :] * (a.to(tl.float32) * s)[None, :, :]
        elif INTERP:
            part = tl.dot(b.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        elif CVT_ASM:
            part = tl.dot(_e4m3_to_bf16(b), tl.trans(a))
        else:
            part = tl.dot(b.to(tl.bfloat16), tl.trans(a))
        if not GEMV:
            acc += part * s
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        s_ptrs += 1
    if GEMV:
        acc = tl.sum(acc3, axis=2)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm.to(tl.int64)[:, None] * NT + (g * N + rn)[None, :]
    cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
    if MIXED and tn * BLOCK_N < N32:  # (tile-uniform: N32 is whole tiles)
        _store_tile(tl.trans(acc), out32_ptr, part_ptr, cnt, offs, mask, pid_k * M * NT, M * NT, split, PARTIAL,
                    FUSED_SUM, SPLIT, False)  # fmt: skip
    else:
        _store_tile(tl.trans(acc), out_ptr, part_ptr, cnt, offs, mask, pid_k * M * NT, M * NT, split, PARTIAL,
                    FUSED_SUM, SPLIT, BF16_RNE)  # fmt: skip


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, R, K, kblocks, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    INTERP: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """out [R, K] bf16 = e4m3 w [R, K] times its block scale (s [ceil(R/128), kblocks] fp32): one [BLOCK_N, BLOCK_K]
    tile a program (BLOCK_K = 128: one scale column)."""
    pdl_enter(PDL)
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (r < R)[:, None] & (c < K)[None, :]
    offs = r.to(tl.int64)[:, None] * K + c[None, :]
    s = tl.load(s_ptr + (r // BLOCK_K) * kblocks + tl.program_id(1), mask=r < R, other=0.0)
    v = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32) * s[:, None]
    _store_out(v, out_ptr + offs, ok, INTERP)


def dequantize(w: FP8Weight, backend: str = "auto") -> torch.Tensor:
    """``w`` as a bf16 [out, in] tensor (``FP8Weight.dequantize(torch.bfloat16)``; on the Triton path one launch,
    no fp32 intermediate)."""
    if not use_triton(backend, w.data, w.scale):
        return w.dequantize(torch.bfloat16)
    rows, k = w.shape
    out = torch.empty(rows, k, dtype=torch.bfloat16, device=w.device)
    if out.numel():
        grid = (triton.cdiv(rows, _DEQUANT_BLOCK_N), triton.cdiv(k, _BLOCK_K))
        _dequant_kernel[grid](
            w.data, w.scale, out, rows, k, w.scale.shape[1], BLOCK_N=_DEQUANT_BLOCK_N, BLOCK_K=_BLOCK_K,
            INTERP=interpreter_enabled(), num_warps=4, **pdl_launch(w.device),
        )  # fmt: skip
    return out


def grouped_linear(x: torch.Tensor, w: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x [..., G·K] times a weight tensor w [G·N, K] of x's dtype per group: block g of x's columns times block g of
    w's rows, -> [..., G·N] (PyTorch: cuBLAS on a GPU; ``F.linear`` for one group).  The layer's projections on
    tensor weights, and ``fp8_linear``'s torch and prefill paths on the dequantised weight."""
    if groups == 1:
        return torch.nn.functional.linear(x, w)
    k = w.shape[1]
    n = w.shape[0] // groups
    if x.dim() != 2 or x.stride(1) != 1:
        return torch.einsum("...gk,gnk->...gn", x.unflatten(-1, (groups, k)), w.view(groups, n, k)).flatten(-2)
    # one batched GEMM over the groups reading x and writing y in place as [G, T, K] / [G, T, N] views (row stride G·K /
    # G·N): no copy of either (einsum would make x's groups contiguous first: a launch and T·G·K elements more)
    y = torch.empty(x.shape[0], groups * n, dtype=x.dtype, device=x.device)
    xg = x.unflatten(1, (groups, k)).transpose(0, 1)
    torch.bmm(xg, w.view(groups, n, k).transpose(1, 2), out=y.view(-1, groups, n).transpose(0, 1))
    return y


def fp8_linear(
    x: torch.Tensor,
    w: FP8Weight,
    backend: str = "auto",
    *,
    groups: int = 1,
    counters: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    cvt_asm: bool | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    derotate: tuple[torch.Tensor, int] | None = None,
    gemv: bool | None = None,
) -> torch.Tensor:
    """``y = x·wᵀ`` per group (module docstring): x [M, G·K] bf16 (any row stride, unit column stride), w an
    ``FP8Weight`` [G·N, K] -> y [M, G·N] bf16, new and contiguous.  M may be 0.  ``out_dtype`` torch.float32 (one
    group): the fp32 sums themselves (the compressor's projections), on the torch path ``F.linear`` in fp32 on the
    fp32 dequantised weight, above DECODE_MAX_M ``linear.linear_fp32_group(precision="bf16w")`` on the bf16 one.

    Torch path (CPU, or ``backend="torch"``): ``F.linear`` per group on the weight dequantised to bf16 -- the layer's
    computation before this kernel.  Triton path: up to ``DECODE_MAX_M`` tokens the kernel; above, ``dequantize`` then
    ``F.linear`` (cuBLAS).  ``counters``: int32 zeros (``linear.linear_counters``) of >= the output tiles; with a K
    split and M <= FUSED_SUM_MAX_M the split sum is done in the launch (left 0 again; launches sharing them must not
    overlap).  The launch keywords override ``fp8_linear_launch``'s choice; ``cvt_asm`` (default ``CVT_ASM``) picks the
    weight conversion (``_e4m3_to_bf16`` or Triton's cast: same values); ``gemv`` (default: M <= ``GEMV_MAX_M``) the
    kernel's GEMV form (M <= 4: the K-block partials as fp32 products summed in registers, no MMA; the same terms,
    another fp32 summation order).

    ``derotate`` = (cos_sin [M, rd/2, 2] fp32, head_dim): x's columns are heads of ``head_dim`` and each head's last
    rd columns carry RoPE at its row's angles, whose (cos, sin) ``cos_sin`` holds (``q_norm_rope(cos_sin_out=)``
    writes them): the rotation is undone first, as ``rope_inverse`` does it (``model.functional.rotate_pairs``), and
    the result is that of the de-rotated x (the attention output before ``wo_a``).  The kernel rotates a head's last
    K block as it loads it (head_dim a multiple of 128, rd <= 128, heads within groups): no launch and no pass over x
    of its own; elsewhere the reference rotation runs first (x is not changed)."""
    n, k, m = _check(x, w, groups)
    use_gemv = _check_gemv(gemv, m)
    rot = _check_derotate(derotate, x, groups * k)
    if out_dtype not in (torch.bfloat16, torch.float32) or (out_dtype == torch.float32 and groups != 1):
        raise ValueError(f"out_dtype: expected torch.bfloat16, or torch.float32 with one group, got {out_dtype}")
    out_fp32 = out_dtype == torch.float32
    in_kernel = rot is not None and rot[1] % _BLOCK_K == 0 and 2 * rot[0].shape[1] <= _BLOCK_K and k % rot[1] == 0
    if rot is not None and not (in_kernel and m <= DECODE_MAX_M and use_triton(backend, x, w.data, w.scale, counters)):
        from dsv4.model.functional import rotate_pairs

        cs, hd = rot
        x = rotate_pairs(x.unflatten(1, (x.shape[1] // hd, hd)), cs[:, None, :, 0], -cs[:, None, :, 1]).flatten(1)
        rot = None
    if not use_triton(backend, x, w.data, w.scale, counters):
        if out_fp32:
            return torch.nn.functional.linear(x.float(), w.dequantize())
        return grouped_linear(x, w.dequantize(torch.bfloat16), groups)
    rows = groups * n
    if m > DECODE_MAX_M:
        if out_fp32:
            return linear_fp32_group(x, [dequantize(w, backend)], backend, precision="bf16w")[0]
        return grouped_linear(x, dequantize(w, backend), groups)
    out = torch.empty(m, rows, dtype=out_dtype, device=x.device)
    _run(x, w, groups, out, None, 0, rot, counters, block_n, num_warps, num_stages, split_k, cvt_asm, use_gemv)
    return out


def fp8_linear_mixed(
    x: torch.Tensor,
    w: FP8Weight,
    fp32_rows: int,
    backend: str = "auto",
    *,
    counters: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    cvt_asm: bool | None = None,
    gemv: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x·wᵀ`` (one group) in one launch with the outputs of w's first ``fp32_rows`` rows in fp32 and the rest's in
    bf16: (y32 [M, fp32_rows] fp32, y16 [M, rows - fp32_rows] bf16), row-strided views.  The values of
    ``fp8_linear(x, w.rows(0, fp32_rows), out_dtype=torch.float32)`` and ``fp8_linear(x, w.rows(fp32_rows, rows))``
    (the layer's compressor projections and the x stack's, ``STACK_PROJECTIONS``), up to the order of the fp32 sums
    where the launch's K split differs from theirs.  ``fp32_rows``: a multiple of 128, below the weight's rows.  Paths
    and keywords as ``fp8_linear``'s: the torch path and, above DECODE_MAX_M tokens, the two parts computed apart."""
    n, k, m = _check(x, w, 1)
    use_gemv = _check_gemv(gemv, m)
    if not isinstance(fp32_rows, int) or not 0 < fp32_rows < n or fp32_rows % _BLOCK_K:
        raise ValueError(f"fp32_rows: expected a multiple of {_BLOCK_K} in (0, {n}), got {fp32_rows!r}")
    if not use_triton(backend, x, w.data, w.scale, counters) or m > DECODE_MAX_M:
        kw = dict(
            counters=counters, block_n=block_n, num_warps=num_warps, num_stages=num_stages, split_k=split_k, gemv=gemv
        )
        return (
            fp8_linear(x, w.rows(0, fp32_rows), backend, out_dtype=torch.float32, cvt_asm=cvt_asm, **kw),
            fp8_linear(x, w.rows(fp32_rows, n), backend, cvt_asm=cvt_asm, **kw),
        )
    out32 = torch.empty(m, n, dtype=torch.float32, device=x.device)  # (full rows: the tiles keep one row stride)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    _run(x, w, 1, out, out32, fp32_rows, None, counters, block_n, num_warps, num_stages, split_k, cvt_asm, use_gemv)
    return out32[:, :fp32_rows], out[:, fp32_rows:]


def _run(
    x: torch.Tensor, w: FP8Weight, groups: int, out: torch.Tensor, out32: torch.Tensor | None, n32: int,
    rot: tuple[torch.Tensor, int] | None, counters: torch.Tensor | None, block_n: int | None, num_warps: int | None,
    num_stages: int | None, split_k: int | None, cvt_asm: bool | None, use_gemv: bool = False,
) -> None:  # fmt: skip
    """The kernel launch (and, for an unfused K split, the sum's) of ``fp8_linear`` / ``fp8_linear_mixed`` into
    ``out`` [M, G·N] (and, ``out32`` given, its first ``n32`` columns into ``out32`` [M, G·N] fp32); the launch
    keywords as ``fp8_linear``'s, ``use_gemv`` its GEMV form as ``_check_gemv`` decided."""
    m, rows, k = x.shape[0], out.shape[1], w.shape[1]
    n = rows // groups
    out_fp32 = out.dtype == torch.float32
    if m == 0 or rows == 0:
        return
    if k and x.stride(1) != 1:
        x = x.contiguous()
    if use_gemv and block_n is None:  # (its accumulator holds BLOCK_N x BLOCK_M x 128 values: 64 / BLOCK_M rows)
        block_n = 64 // triton.next_power_of_2(m)
    launch = fp8_linear_launch(
        m, rows, k, num_sms=num_sms(x.device), block_n=block_n, num_warps=num_warps, num_stages=num_stages,
        split_k=split_k,
    )  # fmt: skip
    bm, bn, warps, stages, split = launch
    if use_gemv:
        bm = triton.next_power_of_2(m)
    if out32 is not None and n32 % bn:
        raise ValueError(f"block_n: expected a divisor of the fp32 rows ({n32}), got {bn}")
    k_per_split = triton.cdiv(triton.cdiv(k, split), _BLOCK_K) * _BLOCK_K  # whole K blocks per split
    tiles_n = triton.cdiv(n, bn)
    grid = (groups * tiles_n, triton.cdiv(m, bm), split)
    fused = counters is not None and split > 1 and m <= FUSED_SUM_MAX_M
    check_counters(counters, x.device)
    if fused and counters.shape[0] < grid[0] * grid[1]:
        raise ValueError(f"counters: expected >= {grid[0] * grid[1]} (output tiles), got shape {tuple(counters.shape)}")
    part = torch.empty(split, m, rows, dtype=torch.float32, device=x.device) if split > 1 else out
    interp = interpreter_enabled()
    _fp8_linear_kernel[grid](
        x, w.data, w.scale, out, part, counters if fused else out, m, n, k, rows, x.stride(0), k_per_split, split,
        tiles_n, w.scale.shape[1],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=_BLOCK_K, EVEN_K=k % _BLOCK_K == 0, PARTIAL=split > 1, FUSED_SUM=fused,
        SPLIT=split if fused else 1, INTERP=interp, CVT_ASM=CVT_ASM if cvt_asm is None else bool(cvt_asm),
        BF16_RNE=interp and not out_fp32, cs_ptr=rot[0] if rot else None, HEAD_D=rot[1] if rot else 0,
        HR=rot[0].shape[1] if rot else 1, num_warps=warps, num_stages=stages, out32_ptr=out32, N32=n32,
        MIXED=out32 is not None, GEMV=use_gemv, **pdl_launch(x.device),
    )  # fmt: skip
    if split > 1 and not fused:
        numel = m * rows
        _sum_splits_kernel[(triton.cdiv(numel, _SUM_BLOCK),)](
            part, out, numel, split, BLOCK=_SUM_BLOCK, BF16_RNE=interp and not out_fp32, out32_ptr=out32, NT=rows,
            N32=n32, MIXED=out32 is not None, num_warps=4, **pdl_launch(x.device),
        )  # fmt: skip
