"""fp32 linear for the compressor projections: ``[x·w_iᵀ]`` of up to 4 weights in one Triton GEMM, 3xTF32 products.

The compressor projections of DeepSeek-V4 are fp32 (spec §3): ``kv = x·wkvᵀ`` and ``score = x·wgateᵀ`` with
x [T, 4096] and wkv, wgate [c·d, 4096] (c·d = 1024 CSA main, 512 HCA, 256 CSA indexer).  cuBLAS runs them as
SIMT fp32 GEMMs.  ``linear_fp32_group`` runs every projection of a layer (both of a compressor, or the four of a
CSA layer's main and indexer compressors: 2 x 1,024 + 2 x 256 rows) in one launch on the tensor cores with
``tl.dot(..., input_precision="tf32x3")``, into one [T, sum of widths] buffer; ``linear_fp32_pair`` is its
two-weight case.  In decode one launch for all four CSA weights fills the GPU where the indexer pair alone (8 N
tiles) did not: H200, decode step at B = 1, the compressor part 31.8 -> 27.8 us.

Numerics of tf32x3.  tf32 keeps fp32's 8 exponent bits and 10 of its 23 mantissa bits.  Each fp32 operand is
split into a tf32 "big" part and the tf32 rounding of the residual, ``a = a_big + a_small + δa`` with
``|a_small| <= 2^-11·|a|`` and ``|δa| <= 2^-22·|a|``, and three tensor-core products are summed:
``a_small·b_big + a_big·b_small + a_big·b_big`` (each exact in fp32: 11 x 11 significant bits).  What is dropped
(``a_small·b_small``, ``δa·b``, ``a·δb``) is at most ~3·2^-22 ≈ 7e-7 of ``|a·b|`` per product.  The sum over K
is fp32: Triton computes each BLOCK_K chunk's three products on the tensor cores (whose fp32 accumulation
truncates) and adds the chunk into an fp32 accumulator (round to nearest).  So an output element's error is
``|y - y_exact| <= (3·2^-22 + c·2^-24) · (|x|·|w|ᵀ)``, c counting the sequential roundings (a truncation
counts 2): K/BLOCK_K chunk additions plus ~2 per tensor-core step within a chunk, c ≈ 100-150 at K = 4096
and BLOCK_K 32-64, i.e. up to ~1e-5 if every rounding went the same way and orders of magnitude less on
random-sign data, against c = K (2.4e-4) for a sequential fp32 dot.  The GPU tests check this kernel and
cuBLAS fp32 against an fp64 product at K = 4096 on random-sign data with the bound 1e-5·(|x|·|w|ᵀ).  The split is
relative to each operand, so the error does not depend on the scale of x or w.  ``precision="ieee"`` uses
Triton's exact fp32 dot (FMA, no tensor cores; slow): for comparisons.

Cost (fp32 everywhere, N = N1 + N2): bytes ``4·(M·K + N·K + M·N)`` (the weights dominate in decode:
33.6 MB for a CSA main pair, 8.0 µs at 4.17 TB/s), FLOPs ``2·M·N·K`` as fp32, i.e. ``3·2·M·N·K`` on the tf32
tensor cores (495 TFLOP/s dense on the H200): the kernel is memory-bound up to M ≈ 80 tokens and
compute-bound above (a 65,536-token prefill of a CSA main pair: 1.1 TFLOP, 6.7 ms of tf32x3 tensor-core
work at peak, against >= 16 ms at the H200's 67 TFLOP/s SIMT fp32 peak).

Launch (``linear_launch``): grid (N tiles of w1, then of w2, w3, w4; M tiles; K splits); a program takes its weight
and its output columns by its N-tile index (N tiles vary fastest, so programs in flight share x tiles in L2).  Decode
(M <= 128): BLOCK_M covers M (the weights are streamed once), 64-wide N tiles, the MMA computes w·xᵀ (the
weight rows on the wgmma's M side), and K is split until there are ~2 programs per SM (so that enough
loads are in flight to use HBM bandwidth).  With a K split each program writes its fp32 partial tile to a
[split, M, N] buffer and the splits are summed in a fixed order: deterministic (bit-identical from run to
run), unlike fp32 atomics, at the cost of 2·4·split·M·N bytes (<= 1/4 of the weight bytes by construction).
The sum is a second small launch, or, given ``counters`` (the layer passes them), done by the last program of
each output tile to finish (an acquire-release counter, ``_triton_sync.last_arrival``) in the same launch and
order.  x may be bf16 (the layer's activations): it is widened to fp32 as it is loaded, which is exact, so no
cast launch precedes the GEMM.  Prefill: 128 x 128 tiles, x·wᵀ, no split.

Few tokens (M <= GEMV_MAX_M, no launch parameter given, or ``gemv=True``): ``_linear_gemv_kernel`` instead, exact
fp32 FMAs on the CUDA cores (2·M FLOPs a weight element: far below the SIMT peak at this M, so the weight stream
alone sets its time), 16 weight rows x 512 K a program with its four weight loads in flight together, 8 K splits at
K = 4096 summed as above (in the launch with ``counters``).  No product is rounded, so its error is that of ~20
sequential fp32 additions (4 in a thread, 7 in the reduction over a block's K lanes, the splits), below tf32x3's.

Nothing is read back to the host and the buffers come from the caching allocator: CUDA-graph capturable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.kernels._triton_sync import last_arrival, pdl_enter
from dsv4.kernels.cache._triton_quant import bf16_round
from dsv4.kernels.dispatch import DEFAULT_NUM_SMS, interpreter_enabled, num_sms, pdl_launch, use_triton

__all__ = [
    "MAX_GROUP",
    "PRECISIONS",
    "LinearLaunch",
    "bf16_exact",
    "linear_counters",
    "linear_fp32_group",
    "linear_fp32_pair",
    "linear_fp32_pair_reference",
    "linear_launch",
]

PRECISIONS = ("tf32x3", "ieee", "bf16x3", "bf16w")
# bf16 x (the layer's activations) is exact in tf32, so tf32x3's x_small·w_big product is zero: the GEMM runs the
# other two (``_dot_tf32x2``; same bits).  Static sm_90 SASS (triton 3.6, ``sass_report.py linear:65536:0``): 24 ->
# 16 wgmma a K loop.  Not yet timed on the H200 (``run_h200.sh tf32x2_s21``).
TF32X2 = True
DECODE_MAX_M = 128  # up to here a single M tile covers the tokens (decode regime of ``linear_launch``)
_SUM_BLOCK = 1024  # elements a program of the split-sum launch adds up
# ``counters`` fuse the split sum into the GEMM's launch up to this M.  H200 2026-12-04 (bench_linear, graph time with
# an L2 flush, bf16 x; two launches -> fused): CSA main pair M = 1 / 16 / 32 / 64: 17.2 -> 15.8, 18.2 -> 16.5,
# 18.9 -> 19.6, 23.6 -> 26.5 us (the last program of a tile then reads split x 16 KB alone); HCA and CSA indexer
# pairs likewise (-2.6 us at M <= 16, +3 us at 64).
FUSED_SUM_MAX_M = 16
# Up to GEMV_MAX_M tokens (and no launch parameter given) the projections run ``_linear_gemv_kernel``: exact fp32
# FMAs on the CUDA cores, every program streaming a [_GEMV_BLOCK_N, _GEMV_BLOCK_K * _GEMV_ITERS] weight block with all
# its loads issued at once (no tensor-core operand split, no padding of the tokens to an MMA's 16).  H200
# (2026-12-04_h200_linear_gemv_s15.txt, graph time with an L2 flush, bf16 x, split sum in the launch), GEMV vs the
# tensor-core kernel: 1 token, CSA main / HCA / CSA indexer pair 15.3 / 10.8 / 8.7 us vs 16.1 / 11.4 / 9.1; 4 tokens
# 26.7 / 17.0 / 10.5 vs 16.7 / 11.5 / 9.2 (the [M, 16, 128] accumulator: 138 registers).  So one token only.
# ``gemv=True`` takes it up to GEMV_LIMIT_M tokens (tested on the H200 up to there).
GEMV_MAX_M = 1
GEMV_LIMIT_M = 4
_GEMV_BLOCK_N = 16
_GEMV_BLOCK_K = 128
_GEMV_ITERS = 4
_GEMV_WARPS = 4


class LinearLaunch(NamedTuple):
    """Launch of ``linear_fp32_pair``: tile sizes (powers of two >= 16, for ``tl.dot``), warps, software
    pipelining stages, K splits (1 = no split, no second launch) and the MMA orientation (``swap_ab``:
    compute w·xᵀ, the weight rows on the MMA's M side and the tokens on its N side)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int
    swap_ab: bool


def _check_pow2(name: str, value: int, least: int, most: int) -> None:
    ok = isinstance(value, int) and least <= value <= most and value & (value - 1) == 0
    if not ok:
        raise ValueError(f"{name}: expected a power of two in [{least}, {most}], got {value!r}")


def linear_launch(
    m: int,
    n1: int,
    n2: int,
    k: int,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    swap_ab: bool | None = None,
) -> LinearLaunch:
    """The launch ``linear_fp32_pair`` uses for x [m, k], w1 [n1, k], w2 [n2, k]; given values override.

    Decode (m <= DECODE_MAX_M): BLOCK_M = the next power of two >= m (>= 16, ``tl.dot``'s minimum) so one M
    tile reads each weight once; BLOCK_N 64, BLOCK_K 64, 3 stages, 4 warps (8 at BLOCK_M 128); swapped
    orientation, so that the MMA is a Hopper wgmma with the 64 weight rows as its M and the tokens as its N
    (16..128) and the big operand, the weight tile, is split into its tf32 parts in registers rather than
    written back to shared memory.  Prefill: 128 x 128 x 64 tiles, 8 warps, 3 stages, x·wᵀ (H200 sweep at M = 65,536,
    2026-12-05_h200_linear_sweep_prefill_s20.*: BLOCK_K 64 against the first default's 32, pair widths 1,024 / 512 /
    256: 11.39 / 5.84 / 2.94 ms vs 13.21 / 6.71 / 3.36; 128 x 256 and 256 x 128 tiles 1.6-3x slower, K 64 with them
    does not fit shared memory).
    ``split_k`` (unless given): doubled while the grid has fewer than ~2 programs per SM (1.9 x num_sms),
    every split keeps at least 4 K blocks for the pipeline, and the partials (written and read:
    2·split·M·N·4 bytes, mostly in L2) stay within 1/2 of the weight bytes (N·K·4), i.e. ``4·split·m <= k``.
    Decode M = 64 at K = 4096: split 8 for a CSA main pair (32 N tiles -> 256 programs), 16 for HCA
    (16 -> 256) and the CSA indexer (8 -> 128).  H200 sweep, 2026-12-03 (benchmarks/results/
    2026-12-03_h200_linear_sweep_s5.jsonl, graph-timed with an L2 flush): these launches were the fastest
    of 25 per width, 23.2 / 17.0 / 13.5 us vs 24.4 / 19.3 / 18.1 us for the first defaults (BLOCK_K 32,
    4 stages, split 8 everywhere); other M were not swept.
    """
    decode = m <= DECODE_MAX_M
    bm = (max(16, triton.next_power_of_2(max(m, 1))) if decode else 128) if block_m is None else block_m
    bn = (64 if decode else 128) if block_n is None else block_n
    bk = 64 if block_k is None else block_k
    warps = (4 if decode and bm <= 64 else 8) if num_warps is None else num_warps
    stages = 3 if num_stages is None else num_stages
    swap = decode if swap_ab is None else swap_ab
    for name, value in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        _check_pow2(name, value, 16, 256)
    _check_pow2("num_warps", warps, 1, 16)
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"num_stages: expected an int >= 1, got {stages!r}")
    if not isinstance(swap, bool):
        raise ValueError(f"swap_ab: expected a bool, got {swap!r}")
    if split_k is None:
        tiles = triton.cdiv(m, bm) * (triton.cdiv(n1, bn) + triton.cdiv(n2, bn))
        split_k = 1
        while tiles * split_k < 1.9 * num_sms and k >= 2 * split_k * 4 * bk and 4 * 2 * split_k * m <= k:
            split_k *= 2
    elif not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k: expected an int >= 1, got {split_k!r}")
    return LinearLaunch(bm, bn, bk, warps, stages, split_k, swap)


def linear_counters(device: torch.device | str, tiles: int = 4096) -> torch.Tensor:
    """Zeroed int32 tile counters for ``linear_fp32_group(counters=...)`` (``tiles`` >= the output tiles of any
    call that uses them: sum of N_i / BLOCK_N x M / BLOCK_M, e.g. 40 for a CSA layer's four weights in decode)."""
    return torch.zeros(tiles, dtype=torch.int32, device=device)


def linear_fp32_pair_reference(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch definition of ``linear_fp32_pair``: two fp32 ``F.linear`` calls."""
    return torch.nn.functional.linear(x, w1), torch.nn.functional.linear(x, w2)


@triton.jit
def _tile_weight(
    pid_n, w1_ptr, w2_ptr, w3_ptr, w4_ptr, N1, N2, N3, N4, stride_w1, stride_w2, stride_w3, stride_w4, t1, t2, t3,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The weight of N tile ``pid_n`` (tiles [0, t1) are w1's, [t1, t2) w2's, [t2, t3) w3's, the rest w4's): its
    pointer, rows and row stride, its first output column and the tile's rows of it [BLOCK_N]."""
    s1 = pid_n >= t1
    s2 = pid_n >= t2
    s3 = pid_n >= t3
    w_ptr = tl.where(s3, w4_ptr, tl.where(s2, w3_ptr, tl.where(s1, w2_ptr, w1_ptr)))
    n = tl.where(s3, N4, tl.where(s2, N3, tl.where(s1, N2, N1)))
    stride_w = tl.where(s3, stride_w4, tl.where(s2, stride_w3, tl.where(s1, stride_w2, stride_w1)))
    first_tile = tl.where(s3, t3, tl.where(s2, t2, tl.where(s1, t1, 0)))
    col0 = tl.where(s3, N1 + N2 + N3, tl.where(s2, N1 + N2, tl.where(s1, N1, 0)))
    return w_ptr, n, stride_w, col0, (pid_n - first_tile) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _store_out(y, ptrs, mask, BF16_RNE: tl.constexpr):
    """fp32 ``y`` stored at ``ptrs`` (converted to their type: fp32, or bf16 rounded to nearest even).  BF16_RNE (a bf16
    output under the interpreter, whose cast truncates): the rounding is done on the bits first, so the cast is
    exact."""
    if BF16_RNE:
        y = bf16_round(y)
    tl.store(ptrs, y, mask=mask)


@triton.jit
def _store_tile(
    y, out_ptr, part_ptr, cnt_ptr, offs, mask, part_off, part_stride, split, PARTIAL: tl.constexpr,
    FUSED_SUM: tl.constexpr, SPLIT: tl.constexpr, BF16_RNE: tl.constexpr = False,
):  # fmt: skip
    """An output tile ``y`` (fp32) at ``offs``: into out, or (PARTIAL) into its split's fp32 partial buffer at
    ``part_off`` and, with FUSED_SUM, by the tile's last program to arrive (counter ``cnt_ptr``) the partials summed in
    split order (``part_stride`` apart) into out.  out may be bf16 (``_store_out``'s BF16_RNE)."""
    if PARTIAL:
        tl.store(part_ptr + part_off + offs, y, mask=mask)
        if FUSED_SUM:
            if last_arrival(cnt_ptr, split):
                total = tl.load(part_ptr + offs, mask=mask, other=0.0)
                for s in tl.static_range(1, SPLIT):
                    total += tl.load(part_ptr + s * part_stride + offs, mask=mask, other=0.0)
                _store_out(total, out_ptr + offs, mask, BF16_RNE)
    else:
        _store_out(y, out_ptr + offs, mask, BF16_RNE)


@triton.jit
def _tf32_rna(v):
    """fp32 ``v`` rounded to tf32 (10 mantissa bits), to nearest with ties away from zero: the bits of PTX
    ``cvt.rna.tf32.f32``, which Triton's tf32x3 applies to each operand (half a tf32 unit added to the magnitude
    bits, then the 13 low bits cleared; infinities stay infinite)."""
    return ((v.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)


@triton.jit
def _dot_tf32x2(a, b, acc, SWAP_AB: tl.constexpr):
    """``acc + a·bᵀ`` (SWAP_AB: ``acc + b·aᵀ``) for an ``a`` exact in tf32 (x widened from bf16): tf32x3 without
    its ``a_small·b_big`` product, which is zero for such an ``a``.  The same steps as Triton's tf32x3 otherwise (its
    F32DotTC lowering, triton 3.6): b split into ``b_big = rna(b)`` and ``b_small = b - b_big``, the chunk's
    ``a·b_small`` from zero, NaN there replaced by 0 (an infinite b), then ``+ a·b_big`` on the tensor core, and the
    chunk added to ``acc`` in fp32: so the result has the bits of tf32x3 on ``a`` (up to the sign of zeros) with two
    MMAs a K block instead of three."""
    b_big = _tf32_rna(b)
    b_small = b - b_big
    if SWAP_AB:
        part = tl.dot(b_small, tl.trans(a), input_precision="tf32")
        part = tl.where(part != part, 0.0, part)
        part = tl.dot(b_big, tl.trans(a), part, input_precision="tf32")
    else:
        part = tl.dot(a, tl.trans(b_small), input_precision="tf32")
        part = tl.where(part != part, 0.0, part)
        part = tl.dot(a, tl.trans(b_big), part, input_precision="tf32")
    return acc + part


@triton.jit
def _dot_w(a, b, acc, SWAP_AB: tl.constexpr, FP32_DOT: tl.constexpr):
    """``acc + a·bᵀ`` (SWAP_AB: ``acc + b·aᵀ``, the weight tile on the MMA's M side) of bf16 tiles ``a`` (x) and
    ``b`` (a weight piece), fp32 result; ``acc`` None: from zero.  FP32_DOT (the interpreter, whose bf16 dot is
    wrong): both widened to fp32 and multiplied in IEEE fp32 (exact products)."""
    if FP32_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        if SWAP_AB:
            out = tl.dot(b, tl.trans(a), acc, input_precision="ieee")
        else:
            out = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    elif SWAP_AB:
        out = tl.dot(b, tl.trans(a), acc)
    else:
        out = tl.dot(a, tl.trans(b), acc)
    return out


@triton.jit
def _dot_bf16x3(a, b, acc, SWAP_AB: tl.constexpr, FP32_DOT: tl.constexpr):
    """``acc + a·bᵀ`` (SWAP_AB: ``acc + b·aᵀ``) for bf16 ``a`` and fp32 ``b`` on bf16 MMAs: b = b_hi + b_mid + b_lo
    exactly (three bf16 pieces of 8 significant bits hold fp32's 24; each remainder is exact in fp32), the three
    products from the smallest piece up, each exact in fp32 (8 x 8 bits), summed by the tensor core into a chunk
    that is added to ``acc`` in fp32.  Nothing is dropped: the only error is the fp32 accumulation."""
    b_hi = b.to(tl.bfloat16)
    r = b - b_hi.to(tl.float32)
    b_mid = r.to(tl.bfloat16)
    b_lo = (r - b_mid.to(tl.float32)).to(tl.bfloat16)
    part = _dot_w(a, b_lo, None, SWAP_AB, FP32_DOT)
    part = _dot_w(a, b_mid, part, SWAP_AB, FP32_DOT)
    part = _dot_w(a, b_hi, part, SWAP_AB, FP32_DOT)
    return acc + part


@triton.jit
def _dot_bf16w(a, b, acc, SWAP_AB: tl.constexpr, FP32_DOT: tl.constexpr):
    """``acc + a·bᵀ`` (SWAP_AB: ``acc + b·aᵀ``) for bf16 ``a`` and a bf16 ``b``, or an fp32 one whose every value is
    exact in bf16 (a weight dequantised from an FP8 or bf16 checkpoint; the caller's precondition): one bf16 MMA, its
    products exact in fp32 (8 x 8 bits), the chunk added to ``acc`` in fp32."""
    return acc + _dot_w(a, b.to(tl.bfloat16), None, SWAP_AB, FP32_DOT)


@triton.jit(do_not_specialize=["t1", "t2", "t3"])  # one binary for every set of weight widths
def _linear_group_kernel(
    x_ptr, w1_ptr, w2_ptr, w3_ptr, w4_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N1, N2, N3, N4, K, k_per_split, stride_xm, stride_w1, stride_w2, stride_w3, stride_w4, t1, t2, t3, split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
    FUSED_SUM: tl.constexpr = False, SPLIT: tl.constexpr = 1, TF32X2: tl.constexpr = False,
    FP32_DOT: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of x·w_iᵀ over K range [pid_k·k_per_split, +k_per_split), into columns
    N1 + ... + N_(i-1) + [0, N_i) of out [M, N1 + N2 + N3 + N4] (row stride the total).  The program's weight is
    picked by its N tile: tiles [0, t1) are w1's, [t1, t2) w2's, [t2, t3) w3's, the rest w4's (an unused weight
    has N 0 and no tiles).  x is fp32 or bf16 (widened to fp32 as loaded: exact).  TF32X2 (x bf16, PRECISION
    tf32x3): the two products of ``_dot_tf32x2`` a K block instead of tf32x3's three, same bits.

    PARTIAL: store the fp32 tile at part[pid_k, rows, columns] (a [split, M, NT] buffer) instead of into out.
    FUSED_SUM (with PARTIAL): the last of the tile's ``split`` programs to finish (``last_arrival`` on the tile's
    counter ``cnt_ptr[pid_m * tiles_n + pid_n]``) adds the partials in the order s = 0, 1, ... and stores the tile
    into out -- the sum, order and bits of ``_sum_splits_kernel``, without its launch (SPLIT = split, a
    compile-time count so that the partials' loads are all issued at once).
    """
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    w_ptr, n, stride_w, col0, rn = _tile_weight(
        pid_n, w1_ptr, w2_ptr, w3_ptr, w4_ptr, N1, N2, N3, N4, stride_w1, stride_w2, stride_w3, stride_w4, t1, t2, t3,
        BLOCK_N,
    )  # fmt: skip
    nt = N1 + N2 + N3 + N4
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # Rows past M / N are loaded from valid rows (wrapped) so that the loop needs no row masks; they are
    # masked at the store.  Both tiles are read K-contiguous: x as [BLOCK_M, BLOCK_K], w as [BLOCK_N, BLOCK_K].
    x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + (rn % n).to(tl.int64)[:, None] * stride_w + (k_lo + rk)[None, :]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            in_k = (k + rk < K)[None, :]
            a = tl.load(x_ptrs, mask=in_k, other=0.0)
            b = tl.load(w_ptrs, mask=in_k, other=0.0)
        if PRECISION != "bf16w":  # (bf16 weights: their exact fp32 values; bf16w converts fp32 ones to bf16)
            b = b.to(tl.float32)
        if PRECISION == "bf16x3":  # (bf16 x, as loaded)
            acc = _dot_bf16x3(a, b, acc, SWAP_AB, FP32_DOT)
        elif PRECISION == "bf16w":
            acc = _dot_bf16w(a, b, acc, SWAP_AB, FP32_DOT)
        elif TF32X2:
            acc = _dot_tf32x2(a.to(tl.float32), b, acc, SWAP_AB)
        elif SWAP_AB:  # w·xᵀ: the weight tile is the MMA's A operand (kept in registers), the tokens its N side
            acc = tl.dot(b, tl.trans(a.to(tl.float32)), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a.to(tl.float32), tl.trans(b), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    mask = (rm < M)[:, None] & (rn < n)[None, :]
    offs = rm.to(tl.int64)[:, None] * nt + (col0 + rn)[None, :]
    _store_tile(
        acc, out_ptr, part_ptr, cnt_ptr + pid_m * tl.num_programs(0) + pid_n, offs, mask, pid_k * M * nt, M * nt, split,
        PARTIAL, FUSED_SUM, SPLIT,
    )  # fmt: skip


@triton.jit(do_not_specialize=["t1", "t2", "t3"])
def _linear_gemv_kernel(
    x_ptr, w1_ptr, w2_ptr, w3_ptr, w4_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N1, N2, N3, N4, K, stride_xm, stride_w1, stride_w2, stride_w3, stride_w4, t1, t2, t3, split,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ITERS: tl.constexpr, EVEN_K: tl.constexpr,
    PARTIAL: tl.constexpr, FUSED_SUM: tl.constexpr, SPLIT: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Few tokens (M <= M_PAD): program (n tile, k split) computes the [M, BLOCK_N] block of x·w_iᵀ over K range
    [pid_k·BLOCK_K·ITERS, +BLOCK_K·ITERS) with fp32 FMAs, weights chosen and outputs placed as in
    ``_linear_group_kernel`` (its PARTIAL / FUSED_SUM split sum too).  The ITERS weight tiles [BLOCK_N, BLOCK_K]
    are loaded in an unrolled loop with nothing stored in between, so all of them are in flight at once; each
    token row accumulates x[m, k]·w[n, k] elementwise in an [M_PAD, BLOCK_N, BLOCK_K] fp32 tile, reduced over K
    once at the end: every product exact in fp32, the sum's order fixed by the launch."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    w_ptr, n, stride_w, col0, rn = _tile_weight(
        pid_n, w1_ptr, w2_ptr, w3_ptr, w4_ptr, N1, N2, N3, N4, stride_w1, stride_w2, stride_w3, stride_w4, t1, t2, t3,
        BLOCK_N,
    )  # fmt: skip
    nt = N1 + N2 + N3 + N4
    rm = tl.arange(0, M_PAD)
    rk = tl.arange(0, BLOCK_K)
    k0 = pid_k * (BLOCK_K * ITERS)
    # rows past M / N read valid rows (wrapped) and are masked at the store, as in ``_linear_group_kernel``
    w_ptrs = w_ptr + (rn % n).to(tl.int64)[:, None] * stride_w + (k0 + rk)[None, :]
    x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * stride_xm + (k0 + rk)[None, :]
    acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in tl.static_range(ITERS):
        if EVEN_K:
            w = tl.load(w_ptrs + i * BLOCK_K).to(tl.float32)
            x = tl.load(x_ptrs + i * BLOCK_K).to(tl.float32)
        else:
            in_k = k0 + i * BLOCK_K + rk < K
            w = tl.load(w_ptrs + i * BLOCK_K, mask=in_k[None, :], other=0.0).to(tl.float32)
            x = tl.load(x_ptrs + i * BLOCK_K, mask=in_k[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    mask = (rm < M)[:, None] & (rn < n)[None, :]
    offs = rm.to(tl.int64)[:, None] * nt + (col0 + rn)[None, :]
    _store_tile(
        y, out_ptr, part_ptr, cnt_ptr + pid_n, offs, mask, pid_k * M * nt, M * nt, split, PARTIAL, FUSED_SUM, SPLIT
    )


@triton.jit
def _sum_splits_kernel(
    part_ptr, out_ptr, numel, split, BLOCK: tl.constexpr, PDL: tl.constexpr = False, BF16_RNE: tl.constexpr = False,
    out32_ptr=None, NT=1, N32=0, MIXED: tl.constexpr = False,
):  # fmt: skip
    """out = Σ_s part[s] in the order s = 0, 1, ... (part [split, M, NT] fp32, out [M, NT] fp32 or bf16 (BF16_RNE:
    ``_store_out``'s), numel = M·NT).  MIXED: columns below N32 go to ``out32_ptr`` ([M, NT] fp32) instead."""
    pdl_enter(PDL)
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = e < numel
    ptrs = part_ptr + e
    acc = tl.load(ptrs, mask=ok, other=0.0)
    for _ in range(1, split):
        ptrs += numel
        acc += tl.load(ptrs, mask=ok, other=0.0)
    if MIXED:
        col = e % NT
        _store_out(acc, out32_ptr + e, ok & (col < N32), False)
        _store_out(acc, out_ptr + e, ok & (col >= N32), BF16_RNE)
    else:
        _store_out(acc, out_ptr + e, ok, BF16_RNE)


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


MAX_GROUP = 4  # weights one ``linear_fp32_group`` launch takes


def linear_fp32_group(
    x: torch.Tensor,
    ws: list[torch.Tensor] | tuple[torch.Tensor, ...],
    backend: str = "auto",
    *,
    precision: str = "tf32x3",
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    split_k: int | None = None,
    swap_ab: bool | None = None,
    counters: torch.Tensor | None = None,
    gemv: bool | None = None,
) -> list[torch.Tensor]:
    """``[x·w_iᵀ for w_i in ws]`` in fp32 in one GEMM launch (two with a K split above FUSED_SUM_MAX_M tokens or
    without ``counters``): x [M, K] fp32 or bf16 (taken as its exact fp32 value), 1 to MAX_GROUP weights w_i
    [N_i, K] fp32, or all bf16 (their exact fp32 values: half the bytes, for weights exact in bf16) -> [M, N_i] fp32
    each.  A CSA layer's two compressors (four weights) are one launch.

    M may be 0.  x and the weights may be strided views (any row stride; a last stride other than 1 costs
    a copy).  Triton path: the outputs are column views of one [M, ΣN_i] buffer (row stride ΣN_i, unit inner
    stride; as the compressor kernels take them), ``precision`` "tf32x3" (3xTF32 tensor-core products, ~fp32
    accuracy; two of them for bf16 x, ``TF32X2``), "ieee" (exact fp32 FMA dot) or "bf16x3" (bf16 x only: each
    weight tile split exactly into three bf16 pieces, three bf16 MMAs with exact products, ``_dot_bf16x3``: more
    accurate than tf32x3, half its tensor-core cycles a product) or "bf16w" (bf16 x and weights whose every value is
    exact in bf16, ``bf16_exact``, e.g. dequantised from an FP8 checkpoint: one bf16 MMA with exact products; the
    weights' exactness is the caller's precondition); launch parameters default to ``linear_launch``
    (its n1 + n2 read as the total width).  ``counters``: int32 [>= output tiles] of zeros (``linear_counters``):
    with a K split and M <= FUSED_SUM_MAX_M the last program of each output tile adds the partials (same order, same
    bits as the second launch) in the one launch, and leaves its counter 0 again; launches sharing ``counters`` must not
    overlap (one stream).  Torch path (CPU, or ``backend="torch"``): ``F.linear`` of x in fp32 per weight (new
    contiguous tensors).  ``gemv``: the few-token kernel (``_linear_gemv_kernel``, exact fp32 FMAs, either
    ``precision``; M <= GEMV_LIMIT_M); None takes it for M <= GEMV_MAX_M when no launch parameter is given.
    """
    check_tensor("x", x, dtype=(torch.float32, torch.bfloat16), ndim=2)
    k = x.shape[1]
    if not isinstance(ws, (list, tuple)) or not 1 <= len(ws) <= MAX_GROUP:
        got = len(ws) if isinstance(ws, (list, tuple)) else type(ws).__name__
        raise ValueError(f"ws: expected a list of 1 to {MAX_GROUP} weights, got {got}")
    for i, w in enumerate(ws):
        check_tensor(f"w{i + 1}", w, dtype=(torch.float32, torch.bfloat16), shape=(None, k), device=x.device)
    if len({w.dtype for w in ws}) != 1:
        raise ValueError(f"ws: expected one dtype for every weight, got {[str(w.dtype) for w in ws]}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if precision in ("bf16x3", "bf16w") and x.dtype != torch.bfloat16:
        raise ValueError(f"precision={precision!r}: expected bf16 x (its products are exact only then), got {x.dtype}")
    m, ns = x.shape[0], [w.shape[0] for w in ws]
    launch = linear_launch(
        m, ns[0], sum(ns[1:]), k, num_sms=num_sms(x.device), block_m=block_m, block_n=block_n, block_k=block_k,
        num_warps=num_warps, num_stages=num_stages, split_k=split_k, swap_ab=swap_ab,
    )  # fmt: skip
    if not use_triton(backend, x, *ws, counters):
        xf = x.float()
        return [torch.nn.functional.linear(xf, w.float()) for w in ws]
    nt = sum(ns)
    out = torch.empty(m, nt, dtype=torch.float32, device=x.device)
    views = list(torch.split(out, ns, dim=1))
    if m == 0 or nt == 0:
        return views
    x = _unit_last_stride(x)
    wl = [_unit_last_stride(w) for w in ws]
    bm, bn, bk, warps, stages, split, swap = launch
    k_per_split = triton.cdiv(triton.cdiv(k, split), bk) * bk  # whole K blocks per split
    part = torch.empty(split, m, nt, dtype=torch.float32, device=x.device) if split > 1 else out
    tiles = [triton.cdiv(n, bn) for n in ns]
    bounds = [sum(tiles[: i + 1]) for i in range(MAX_GROUP - 1)]  # t1, t2, t3 (unused weights: no tiles)
    grid = (sum(tiles), triton.cdiv(m, bm), split)
    fused = counters is not None and split > 1 and m <= FUSED_SUM_MAX_M
    check_counters(counters, x.device)
    pad = MAX_GROUP - len(wl)
    wl, ns4 = wl + [wl[-1]] * pad, ns + [0] * pad
    if gemv is None:
        given = (block_m, block_n, block_k, num_warps, num_stages, split_k, swap_ab)
        gemv = m <= GEMV_MAX_M and all(v is None for v in given)
    if gemv:
        _linear_gemv(x, wl, ns, ns4, out, counters)  # (which checks the counters against its own tiles)
        return views
    # (only a launch that sums its splits in place uses them: a prefill's GEMM has more tiles than a layer keeps)
    if fused and counters.shape[0] < grid[0] * grid[1]:
        raise ValueError(
            f"counters: expected a contiguous int32 tensor of >= {grid[0] * grid[1]} (output tiles), got "
            f"shape {tuple(counters.shape)}"
        )
    _linear_group_kernel[grid](
        x, *wl, out, part, counters if fused else out, m, *ns4, k, k_per_split, x.stride(0),
        *(w.stride(0) for w in wl), *bounds, split,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, SWAP_AB=swap, PARTIAL=split > 1, PRECISION=precision,
        FUSED_SUM=fused, SPLIT=split if fused else 1, num_warps=warps, num_stages=stages,
        TF32X2=TF32X2 and precision == "tf32x3" and x.dtype == torch.bfloat16, FP32_DOT=interpreter_enabled(),
        **pdl_launch(x.device),
    )  # fmt: skip
    if split > 1 and not fused:
        numel = m * nt
        _sum_splits_kernel[(triton.cdiv(numel, _SUM_BLOCK),)](
            part, out, numel, split, BLOCK=_SUM_BLOCK, num_warps=4, **pdl_launch(part.device)
        )
    return views


def check_counters(counters: torch.Tensor | None, device: torch.device) -> None:
    """ValueError unless ``counters`` is None or a contiguous int32 vector on ``device`` (a launch's tile counters,
    ``linear_counters``; whether there are enough is the launch's own check, against its output tiles)."""
    if counters is not None:
        check_tensor("counters", counters, dtype=torch.int32, ndim=1, device=device)
        if not counters.is_contiguous():
            raise ValueError("counters: expected a contiguous int32 tensor")


def bf16_exact(*ws: torch.Tensor) -> bool:
    """Every value of the fp32 tensors ``ws`` is exactly representable in bf16 (``precision="bf16w"``'s precondition;
    true of weights dequantised from an FP8 checkpoint's e4m3 values and power-of-two block scales).  Reads the
    values back to the host: a check for load time, not for a step."""
    return all(bool(torch.equal(w.to(torch.bfloat16).float(), w)) for w in ws)


def _linear_gemv(x, wl, ns, ns4, out, counters) -> None:
    """``linear_fp32_group``'s few-token path into ``out`` [M, ΣN] (M <= GEMV_LIMIT_M; wl, ns4: the four weights
    and widths, padded)."""
    m, k = x.shape
    if m > GEMV_LIMIT_M:
        raise ValueError(f"gemv: expected at most {GEMV_LIMIT_M} tokens (rows of x), got {m}")
    chunk = _GEMV_BLOCK_K * _GEMV_ITERS
    split = triton.cdiv(k, chunk)
    tiles = [triton.cdiv(n, _GEMV_BLOCK_N) for n in ns]
    bounds = [sum(tiles[: i + 1]) for i in range(MAX_GROUP - 1)]
    grid = (sum(tiles), split)
    fused = counters is not None and split > 1
    if fused and counters.shape[0] < grid[0]:
        raise ValueError(f"counters: expected >= {grid[0]} (output tiles), got shape {tuple(counters.shape)}")
    part = torch.empty(split, m, out.shape[1], dtype=torch.float32, device=x.device) if split > 1 else out
    _linear_gemv_kernel[grid](
        x, *wl, out, part, counters if fused else out, m, *ns4, k, x.stride(0), *(w.stride(0) for w in wl), *bounds,
        split, M_PAD=triton.next_power_of_2(m), BLOCK_N=_GEMV_BLOCK_N, BLOCK_K=_GEMV_BLOCK_K, ITERS=_GEMV_ITERS,
        EVEN_K=k % chunk == 0, PARTIAL=split > 1, FUSED_SUM=fused, SPLIT=split if fused else 1, num_warps=_GEMV_WARPS,
        **pdl_launch(x.device),
    )  # fmt: skip
    if split > 1 and not fused:
        numel = out.numel()
        _sum_splits_kernel[(triton.cdiv(numel, _SUM_BLOCK),)](
            part, out, numel, split, BLOCK=_SUM_BLOCK, num_warps=4, **pdl_launch(part.device)
        )


def linear_fp32_pair(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    backend: str = "auto",
    **kw,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x·w1ᵀ, x·w2ᵀ)`` in fp32: ``linear_fp32_group(x, [w1, w2], backend, **kw)`` (x [M, K] fp32 or bf16,
    w1 [N1, K], w2 [N2, K] fp32 -> [M, N1], [M, N2] fp32; on the Triton path column views of one [M, N1 + N2]
    buffer).  The compressor passes (x, wkv, wgate)."""
    y1, y2 = linear_fp32_group(x, [w1, w2], backend, **kw)
    return y1, y2
