"""Lightning-indexer scores over paged indexer keys (spec §4, §9.3, §13).

For every query row ``t`` and logical entry ``j`` of that row's request::

    score[t, j] = sum_h  w[t, h] * ReLU(q[t, h] . k_j)      for j < n_visible[t]
                = -inf                                        otherwise

``k_j`` lives at page ``block_table[token_row[t], j // bs]``, row ``j % bs`` (bs = entries per page).

Two key formats:

- **MXFP4** (``KeyPages``, 68 bytes a key, the format of record): the Triton kernel reads the packed
  e2m1 bytes and UE8M0 scales straight from the pages and converts them in registers to bf16 (every
  e2m1 value times a power of two is exact in bf16), then runs a bf16 ``tl.dot`` against the query of
  all heads.  Nothing is dequantised to HBM.
- **FP8** (``FP8KeyPages``, 132 bytes a key: 128 e4m3 + one fp32 scale, vLLM's default indexer cache):
  the same kernel shape, kept for comparison (it moves 1.94x more bytes).

Kernel layout: grid = (query rows, chunks of ``tiles_per_program * block_n`` entries).  A program loads
its query [Hi, 128] once, then for each tile of ``block_n`` entries gathers the keys through the block
table, converts them, computes the [Hi, block_n] logits with ``tl.dot`` (fp32 accumulation), applies
ReLU, the head weights and the head sum, and writes ``block_n`` scores.  Tiles at or past
``n_visible[t]`` load nothing and write -inf.  To avoid interleaving the packed nibbles, the MXFP4
kernel splits the head dim into even and odd elements: ``q.k = q[0::2].k_lo + q[1::2].k_hi`` (low
nibble = even element), i.e. two K=64 dots into one accumulator.  A key's four UE8M0 bytes are read as
one int32 word (the [P, bs, 4] scale view reinterpreted in place).  ``impl="dot_scaled"`` swaps the
conversion + dots for ``tl.dot_scaled`` (performance.md "Leads"; for measurement on the H200).

On sm_90 with Gluon, ``impl="gluon"`` runs the warp-specialised kernel of ``_gluon_scores`` (the fp8mma math in
loader / converter / consumer warps, TMA key loads; 1.36x faster than fp8mma at 1M, B = 4 on the H200, 2.4x with
rows of 1/8 of max_entries); ``impl="auto"``'s choice where it applies (``GLUON_AUTO``, ``_gluon_scores_or_none``).
``impl="fp8mma"`` is the default elsewhere (``AUTO_IMPL_ORDER``): the fastest Triton kernel on the H200 (2026-12-02,
``2026-12-02_h200_sweep_indexer_fold.jsonl``: 1M entries, B = 4: fp8mma 75.8 us, fold4 104.6 us, fold ~102 us
(bench_indexer) and 6 of 1,048,576 scores off by up to 5e-5 absolute, i.e. the tensor core's truncated
accumulation over K = 128, so it is also not exact; fewer SASS instructions did not make it faster).

Where the fp8mma time goes (H200 2026-12-03, ``benchmarks/study_indexer.py`` and Nsight Compute, 1M entries,
B = 4): the kernel is latency-bound, not issue- or bandwidth-bound -- 255 registers a thread (2 programs = 8 warps a
SM), 0.45 instructions issued per scheduler-cycle, DRAM 17 % busy.  With the key loads switched off it takes 55 us
of 71, with loads, re-encoding, block scales and epilogue all off 33 us; one K = 128 MMA (139 registers, 44 % fewer
instructions) is no faster.  A program pays ~4 us of set-up and ~2.2 us a 128-entry tile (the serial chain loads ->
re-encode -> shared memory -> barrier -> MMA -> wait -> epilogue); overlapping consecutive tiles is the lever.
In the compiled loop (sm_90 SASS, ``benchmarks/sass_report.py``) every tile waits for its block-table entries and then
its scale words; only the key bytes are pipelined (cp.async, one tile ahead).  The loop therefore prefetches tile
i + 2's key bytes and scale words into L2 (``prefetch.global.L2``; its block-table entries are read an iteration
earlier): 1M, B = 4 76.3 -> 71.4 us (H200 2026-12-04, ``2026-12-04_h200_sweep_indexer_*_s8.jsonl``; the same file
records two dropped variants: the loads carried a tile early in registers, 104 us, and one accumulator with the block
scales applied between the MMAs, 128 registers, 74.8 us and not exact).

``impl="fold"``: each key's block scales are folded into the FP8 re-encoding, so one K=128
FP8 MMA a tile does the whole dot product.  With d = smax - s_blk (binades below the key's largest block),
element e2m1 v is stored as the e4m3 byte of v * 2**(6 - d) (6 -> 384 fits; every code stays an exact e4m3
normal for d <= 11): one 8-entry byte table per (key, block), two words that are affine in d, indexed by the
e2m1 codes with PTX ``prmt`` (4 lookups an instruction; signs by a second ``prmt`` in sign mode), i.e. ~6
integer ops per 4 elements and no fp32 scale passes.  The key factor 2**(smax - 133) multiplies the head sum;
the query is one e4m3 operand with one power-of-two scale a head (folded into the weights).  Keys with
blocks more than 11 binades apart (e.g. an all-zero block, UE8M0 byte 1, next to a large one) or with
smax <= 6, and every key when the query does not fit one e4m3 scale a head, are not stored by the fast loop;
a second loop over the program's tiles (run only then) scores exactly those with the "convert" math, in
sub-tiles of 64 entries so that its registers do not lower the fast loop's occupancy.  The key byte order
is the one the PTX emits (column 32b + 16w + 4g + j = element 32b + 8g + 4w + j); the query follows it.
``impl="fold4"``: the same encoding and K=128 dot, with Triton's ``max_num_imprecise_acc=32``: each 32-block's
MMA starts from zero and is added in fp32 (exact, see Numerics; +~200 FADD a tile).

Under ``TRITON_INTERPRET`` the dots run in fp32 on operands widened from bf16 (exact), because the
interpreter's bf16 ``tl.dot`` is wrong in triton 3.9; on the GPU they are bf16 tensor-core MMAs.

Numerics: q (MXFP4-simulated, exact in bf16) and the keys (exact in bf16) are multiplied exactly and
summed in fp32 by the tensor core; the reference sums in fp32 in another order, so the two agree to a
few fp32 ulps of ``sum_d |q_d k_d|`` (tests use rtol = atol = 1e-5 on O(1) data).  Entries whose page
is -1 (outside the block table) score -inf in both paths.  FP8 MMAs (fp8mma, fold, fold4): the products of
two e2m1-valued e4m3 numbers are exact; Hopper's FP8 MMA is reported to accumulate with ~14 significant
bits (DeepSeek-V3, H800).  fp8mma and fold4 start every 32-block's MMA from zero, where the sum needs
< 14 bits: exact.  fold accumulates 4 blocks in the tensor core: exact while each partial sum of a
(key, head) needs <= 14 bits -- always for the MXFP4 keys/queries of realistic data (a CPU model of a
14-bit accumulator gives 0 error on quantised Gaussians at the GPU test's shapes), not guaranteed for
adversarial codes with block scales far apart (same model: up to ~2**-13 of the score);
tests/kernels/test_indexer_scores.py::test_gpu_fold_adversarial_keys records the H200's behaviour.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.formats import FP8_DTYPE, KeyPages, MXFP4KeyFormat, e2m1_decode
from dsv4.formats.ue8m0 import ceil_log2_ratio
from dsv4.kernels._triton_sync import pdl_enter
from dsv4.kernels.dispatch import check_maxnreg, interpreter_enabled, num_sms, pdl_launch, use_triton

__all__ = [
    "FP8KeyPages",
    "fp8_key_pages",
    "fp8_key_pages_from_mxfp4",
    "indexer_scores",
    "indexer_scores_fp8keys",
    "indexer_scores_fp8keys_reference",
    "indexer_scores_reference",
]

_FMT = MXFP4KeyFormat()
_FP8_MAX = torch.finfo(FP8_DTYPE).max
_FP8_AMAX_FLOOR = 1e-4  # same floor as the FP8 entry format (spec §13)


class FP8KeyPages(NamedTuple):
    """FP8 indexer keys in pages (vLLM's default): ``data`` [pages, bs, 128] uint8 (e4m3 bit patterns),
    ``scale`` [pages, bs] fp32 (one dequant multiplier a key).  Value = fp32(e4m3) * scale."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def entries_per_page(self) -> int:
        return self.data.shape[1]


def fp8_key_pages(keys: torch.Tensor) -> FP8KeyPages:
    """Quantise keys [pages, bs, dim] (any float dtype) to ``FP8KeyPages``.

    Per key: ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``, stored ``e4m3(rne(x / s))`` (torch's cast,
    round-to-nearest-even; ``x / s`` is within range by construction).
    """
    check_tensor("keys", keys, dtype=(torch.bfloat16, torch.float16, torch.float32), ndim=3)
    x = keys.float()
    e = ceil_log2_ratio(x.abs().amax(-1), _FP8_MAX, _FP8_AMAX_FLOOR)
    v = torch.ldexp(x, -e.unsqueeze(-1)).clamp(-_FP8_MAX, _FP8_MAX)
    data = v.to(FP8_DTYPE).view(torch.uint8).contiguous()
    scale = torch.ldexp(torch.ones_like(x[..., 0]), e).contiguous()
    return FP8KeyPages(data, scale)


def fp8_key_pages_from_mxfp4(keys: KeyPages) -> FP8KeyPages:
    """The same keys as ``keys`` (MXFP4) in the FP8 format.  Exact whenever a key's four block
    exponents lie within ~12 of each other (always, for RMS-normalised keys)."""
    return fp8_key_pages(_FMT.dequantize(keys.data, keys.scale))


# ---------------------------------------------------------------------------------------- validation
def _check_common(q, weights, block_table, token_row, n_visible, max_entries) -> tuple[int, int]:
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    if D != _FMT.dim:
        raise ValueError(f"q: expected last dim {_FMT.dim}, got {list(q.shape)}")
    check_tensor("weights", weights, dtype=torch.float32, shape=(T, H), device=q.device)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=q.device)
    check_tensor("token_row", token_row, dtype=torch.int32, shape=(T,), device=q.device)
    check_tensor("n_visible", n_visible, dtype=torch.int32, shape=(T,), device=q.device)
    if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 0:
        raise ValueError(f"max_entries: expected a host int >= 0, got {max_entries!r}")
    return T, H


def _check_mxfp4_keys(keys: KeyPages, device: torch.device) -> int:
    """Validate MXFP4 ``keys`` (data [P, bs, 64] uint8, scale [P, bs, 4] uint8 on ``device``); returns bs."""
    check_tensor("keys.data", keys.data, dtype=torch.uint8, ndim=3, device=device)
    P, bs, _ = keys.data.shape
    check_tensor("keys.data", keys.data, shape=(P, bs, _FMT.data_bytes))
    check_tensor("keys.scale", keys.scale, dtype=torch.uint8, shape=(P, bs, _FMT.n_blocks), device=device)
    return bs


def _gather_pages(block_table, token_row, n_visible, bs: int, n: int, num_pages: int):
    """(page [T, N] int64 clamped to the pool, row-in-page [N], visible [T, N] bool) of logical entries 0..N-1;
    a page of -1 or outside [0, num_pages) is not visible (never read)."""
    dev = block_table.device
    j = torch.arange(n, device=dev)
    col = j // bs
    max_blocks = block_table.shape[1]
    in_table = col < max_blocks
    rows = block_table.long()[token_row.long()] if max_blocks else None
    if rows is None:
        page = torch.full((token_row.shape[0], n), -1, dtype=torch.long, device=dev)
    else:
        page = rows[:, col.clamp(max=max_blocks - 1)]
    vis = (j[None, :] < n_visible.long()[:, None]) & in_table[None, :] & (page >= 0) & (page < num_pages)
    return torch.where(vis, page, 0), j % bs, vis


def _score_from_keys(q, weights, k, vis):
    logits = torch.einsum("thd,tnd->thn", q.float(), k)
    s = (torch.relu(logits) * weights[:, :, None]).sum(1)
    return torch.where(vis, s, torch.full_like(s, float("-inf")))


# ---------------------------------------------------------------------------------------- references
def indexer_scores_reference(q, weights, keys: KeyPages, block_table, token_row, n_visible, max_entries: int):
    """PyTorch reference of ``indexer_scores`` (fp32 math on keys dequantised by MXFP4KeyFormat)."""
    page, prow, vis = _gather_pages(
        block_table, token_row, n_visible, keys.entries_per_page, max_entries, keys.data.shape[0]
    )
    k = _FMT.dequantize(keys.data[page, prow], keys.scale[page, prow])  # [T, N, 128] fp32
    return _score_from_keys(q, weights, k, vis)


def indexer_scores_fp8keys_reference(
    q, weights, keys: FP8KeyPages, block_table, token_row, n_visible, max_entries: int
):
    """PyTorch reference of ``indexer_scores_fp8keys``."""
    page, prow, vis = _gather_pages(
        block_table, token_row, n_visible, keys.entries_per_page, max_entries, keys.data.shape[0]
    )
    k = keys.data[page, prow].view(FP8_DTYPE).float() * keys.scale[page, prow].unsqueeze(-1)
    return _score_from_keys(q, weights, k, vis)


# ---------------------------------------------------------------------------------------- kernels
# e2m1 bits placed in an e4m3 byte as  sign<<7 | e1 e0 m <<2  read as e4m3 equal the e2m1 value times
# 2**-(e4m3 bias - e2m1 bias) = 2**-6 for every code, the subnormal 0.5 included; the kernels multiply
# the head weights by this factor back (ReLU commutes with a positive scale).
_E4M3_BIAS, _E2M1_BIAS = 7, 1
_FP8_CODE_SCALE = float(2 ** (_E4M3_BIAS - _E2M1_BIAS))
_IMPLS = {"convert": 0, "dot_scaled": 1, "fp8mma": 2, "fold": 3, "fold4": 3}
_KSPLIT = {"fold": 1, "fold4": 4}  # "fold": one K=128 FP8 MMA a tile; "fold4": one K=32 MMA a block, fp32 sum


def _fold_tables() -> tuple[list[int], list[int]]:
    """The e4m3 magnitude bytes of every e2m1 magnitude code em (0..7) times 2**(C - d), for each block-scale
    distance d = 0.._FOLD_MAX_D, as two little-endian words a d (codes 0-3, codes 4-7): the 8-entry byte table
    the fold kernels index with PTX ``prmt``.  C = 6 puts the largest code (6 -> 384) just under the e4m3
    maximum; every code stays exact up to d = 14 (0.5 * 2**-8 = 2**-9 is e4m3's smallest subnormal), and an
    e4m3 normal up to d = 11, where the table is affine in d (2 integer ops a key-block); the kernels use
    d <= _FOLD_MAX_D = 11 and send keys with blocks further apart to the general path."""
    mags = e2m1_decode(torch.arange(8, dtype=torch.uint8)).double()
    lo, hi = [], []
    for d in range(_FOLD_MAX_D + 1):
        v = (mags * 2.0 ** (_FOLD_C - d)).float()
        b = v.to(FP8_DTYPE)
        if not torch.equal(b.float(), v):
            raise AssertionError(f"fold table: d={d} not exact in e4m3")
        w = b.view(torch.uint8).to(torch.int64).tolist()
        lo.append(sum(x << (8 * i) for i, x in enumerate(w[:4])))
        hi.append(sum(x << (8 * i) for i, x in enumerate(w[4:])))
    return lo, hi


_FOLD_C = 6  # keys are encoded as value * 2**(6 - d): e2m1 6 -> 384 <= e4m3 max 448
_FOLD_MAX_D = 11  # largest block-scale distance (binades below the key's largest block) encoded (all normals)
_FOLD_LO, _FOLD_HI = _fold_tables()
# the tables are affine in d while every code stays an e4m3 normal (d <= 11): byte(em) = B(d) + off(em)
# for em >= 1 with B(d) = (C + 6 - d) << 3 (the byte of 0.5), 0 for em = 0.
_FOLD_B0 = _FOLD_LO[0] >> 8 & 0xFF
_FOLD_LO_OFF = _FOLD_LO[0] - _FOLD_B0 * 0x01010100
_FOLD_HI_OFF = _FOLD_HI[0] - _FOLD_B0 * 0x01010101
for _d in range(_FOLD_MAX_D + 1):
    _b = _FOLD_B0 - (_d << 3)
    if (_FOLD_LO_OFF + _b * 0x01010100, _FOLD_HI_OFF + _b * 0x01010101) != (_FOLD_LO[_d], _FOLD_HI[_d]):
        raise AssertionError(f"fold table: d={_d} is not affine")
FOLD_B0 = tl.constexpr(_FOLD_B0)
FOLD_LO_OFF = tl.constexpr(_FOLD_LO_OFF)
FOLD_HI_OFF = tl.constexpr(_FOLD_HI_OFF)
FOLD_MAX_D = tl.constexpr(_FOLD_MAX_D)
FOLD_C = tl.constexpr(_FOLD_C)


@triton.jit
def _e2m1_to_bf16(code, sadd):
    """e2m1 code (int32, 0..15) times 2**(sbyte-127) as bf16, built from bits (exact).

    ``sadd = (sbyte - 1) << 7`` (shared by the two nibbles of a byte).  Magnitude index em = e<<1 | m.
    Placing em at bit 6 gives bf16 exponent e and mantissa bit m; adding sadd rebiases the exponent
    (value 2**(e-1) * (1 + m/2) * 2**(sbyte-127) for e >= 1); the subnormal code em = 1 (0.5) has no
    mantissa bit, and em = 0 is zero.  Needs 1 <= sbyte <= 252.
    """
    em = code & 7
    bits = (em << 6) + sadd
    bits = tl.where(em == 1, sadd, bits)
    bits = tl.where(em == 0, 0, bits)
    bits = bits | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a @ b (bf16 or fp8 a, b) with fp32 accumulation.  Under TRITON_INTERPRET the interpreter's
    low-precision dot is wrong (triton 3.9), so there both operands are widened to fp32 first (exact)
    and multiplied in IEEE fp32; on the GPU it is the tensor-core MMA."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _pow2(biased_exp):
    """2**(biased_exp - 127) as fp32 from the exponent bits (biased_exp int32 in [1, 254])."""
    return (biased_exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def _rel_scale(sbyte, smax):
    """2**(sbyte - smax) for UE8M0 bytes sbyte <= smax, flushed to 0 below 2**-126."""
    rel = sbyte - smax + 127
    return tl.where(rel >= 1, _pow2(tl.maximum(rel, 1)), 0.0)


@triton.jit
def _q_block(q_base, c: tl.constexpr, h_ok, QBLOCK: tl.constexpr):
    """Query block ``c`` (elements c*QBLOCK ...) of every head, fp32 [QBLOCK, HP], and the biased fp32
    exponent of each head's block amax [HP] (0 for an all-zero block)."""
    k = tl.arange(0, QBLOCK)
    offs_k = c * QBLOCK + tl.where(k < QBLOCK // 2, 2 * k, 2 * k - QBLOCK + 1)  # even elements, then odd
    qc = tl.load(q_base + offs_k[:, None], mask=h_ok[None, :], other=0.0).to(tl.float32)
    return qc, (tl.max(tl.abs(qc), axis=0).to(tl.int32, bitcast=True) >> 23) & 255


@triton.jit
def _to_fp8(qc, be):
    """qc * 2**(127 - be) per head (column) as e4m3, and whether that is exact (int32 scalar 0/1)."""
    q8 = (qc * _pow2(254 - be)[None, :]).to(tl.float8e4nv)
    back = q8.to(tl.float32) * _pow2(be)[None, :]
    return q8, tl.min(tl.min((back == qc).to(tl.int32), axis=1), axis=0)


@triton.jit
def _e2m1_bytes_to_e4m3_asm(pc):
    """The two e4m3 bytes (low nibble, high nibble) of packed e2m1 bytes, 4 bytes a 32-bit register
    (SWAR, ~8 integer instructions per 8 codes).  GPU only (inline PTX); same bits as the Triton ops."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, u;
        shl.b32 t, $2, 2;
        and.b32 t, t, 0x1C1C1C1C;
        shl.b32 u, $2, 4;
        and.b32 u, u, 0x80808080;
        or.b32 $0, t, u;
        shr.b32 t, $2, 2;
        and.b32 t, t, 0x1C1C1C1C;
        and.b32 u, $2, 0x80808080;
        or.b32 $1, t, u;
        }
        """,
        constraints="=r,=r,r",
        args=[pc],
        dtype=(tl.uint8, tl.uint8),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _fp8_block_dot(kptr, ok, q8, c: tl.constexpr, QBLOCK: tl.constexpr, FP32_DOT: tl.constexpr, ASM: tl.constexpr):
    """Keys' block c . q8 [BN, HP] in fp32, unscaled: the keys' packed e2m1 bytes re-encoded as e4m3
    bytes (value * 2**-6, see _FP8_CODE_SCALE) by 4 integer ops a byte, one K=QBLOCK FP8 MMA."""
    offs_b = c * (QBLOCK // 2) + tl.arange(0, QBLOCK // 2)
    pc = tl.load(kptr[:, None] + offs_b[None, :], mask=ok[:, None], other=0)  # [BN, QBLOCK/2] uint8
    if ASM:
        lo, hi = _e2m1_bytes_to_e4m3_asm(pc)
    else:
        lo = ((pc & 7) << 2) | ((pc & 8) << 4)  # even element (low nibble)
        hi = ((pc >> 2) & 0x1C) | (pc & 0x80)  # odd element (high nibble)
    k8 = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (lo.shape[0], QBLOCK))
    k8 = k8.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return _dot(k8, q8, tl.zeros((lo.shape[0], q8.shape[1]), tl.float32), FP32_DOT)


@triton.jit
def _prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` of each address where ``mask`` (GPU only: inline PTX; nothing is returned)."""
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        constraints="=r,l,r",
        args=[ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _convert_logits(kptr, ok, s4, q_even, q_odd, offs_i, sidx, FP32_DOT: tl.constexpr):
    """Logits [BN, HP] of the keys at ``kptr`` [BN] by the "convert" math: the packed e2m1 bytes made exact bf16
    keys with their block scales (``sidx``: the scale index of each byte), two K=64 bf16 MMAs (even elements
    against ``q_even``, odd against ``q_odd``) into one fp32 accumulator.  The "convert" impl's loop and the fold
    impls' general path."""
    packed = tl.load(kptr[:, None] + offs_i[None, :], mask=ok[:, None], other=0)  # [BN, 64]
    sadd = (((s4[:, None] >> (8 * sidx[None, :])) & 255) - 1) << 7  # [BN, 64]
    p32 = packed.to(tl.int32)
    k_lo = _e2m1_to_bf16(p32 & 15, sadd)  # [BN, HALF_D] even elements
    k_hi = _e2m1_to_bf16(p32 >> 4, sadd)  # odd elements
    acc = _dot(k_lo, q_even, tl.zeros((kptr.shape[0], q_even.shape[1]), tl.float32), FP32_DOT)
    return _dot(k_hi, q_odd, acc, FP32_DOT)


@triton.jit
def _sbyte(s4, c: tl.constexpr):
    return (s4 >> (8 * c)) & 255


@triton.jit
def _tile_keys(
    offs_n,
    nv,
    row,
    bt_ptr,
    stride_bt,
    MAX_BLOCKS,
    NUM_PAGES,
    BS,
    data_ptr,
    stride_dp,
    stride_dr,
    scale_ptr,
    stride_sp,
    stride_sr,
):
    """Entries offs_n of a row: (valid mask, pointer to each key's packed bytes, its 4 UE8M0 bytes as one
    little-endian int32 word; 127s where invalid)."""
    ok, page = _tile_pages(offs_n, nv, row, bt_ptr, stride_bt, MAX_BLOCKS, NUM_PAGES, BS)
    kptr, sptr = _tile_ptrs(offs_n, page, BS, data_ptr, stride_dp, stride_dr, scale_ptr, stride_sp, stride_sr)
    return ok, kptr, tl.load(sptr, mask=ok, other=0x7F7F7F7F)


@triton.jit
def _tile_pages(offs_n, nv, row, bt_ptr, stride_bt, MAX_BLOCKS, NUM_PAGES, BS):
    """Entries offs_n of a row: (valid mask, physical page of each; 0 where invalid) -- the block-table load."""
    blk = offs_n // BS
    vis = (offs_n < nv) & (blk < MAX_BLOCKS)
    page = tl.load(bt_ptr + row * stride_bt + blk, mask=vis, other=-1)
    ok = vis & (page >= 0) & (page < NUM_PAGES)  # a page outside the pool is skipped, never read
    return ok, tl.where(ok, page, 0)


@triton.jit
def _tile_ptrs(offs_n, page, BS, data_ptr, stride_dp, stride_dr, scale_ptr, stride_sp, stride_sr):
    """Pointers to the packed bytes and to the scale word of entries offs_n on their pages."""
    page = page.to(tl.int64)
    prow = (offs_n % BS).to(tl.int64)
    return data_ptr + page * stride_dp + prow * stride_dr, scale_ptr + page * stride_sp + prow * stride_sr


@triton.jit
def _store_scores(out_row, offs_n, acc, w, ok, N):
    """Epilogue in registers: ReLU, x head weights, sum over heads (axis 1 of [BLOCK_N, HP])."""
    s = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
    tl.store(out_row + offs_n, tl.where(ok, s, float("-inf")), mask=offs_n < N)


@triton.jit
def _fold_words(d):
    """The fold table of block-scale distance d (int32, 0 <= d <= FOLD_MAX_D): two words of 4 e4m3 magnitude
    bytes, codes 0-3 and 4-7 (see _fold_tables; affine in d: 2 integer multiply-adds)."""
    b = FOLD_B0 - (d << 3)
    lo = b * 0x01010100 + FOLD_LO_OFF
    hi = b * 0x01010101 + FOLD_HI_OFF
    return lo, hi


def fold_lookup_ptx(lo: str, hi: str) -> str:
    """The fold impls' PTX for one 32-bit word of 4 packed e2m1 bytes (``$2``; 8 codes, low nibble first) and the
    key-block's table words ``lo`` / ``hi`` (operand names: the Triton and Gluon kernels number them differently):
    one ``prmt`` for 4 magnitudes (selector = code & 7); one ``prmt`` in sign mode (selector bit 3) replicating
    each element's sign bit -- bit 7 of a byte of p (odd elements) or of p << 4 (even elements) -- over its output
    byte; one lop3 m | (s & 0x80808080).  Outputs ``$0`` (elements 0-3) and ``$1`` (4-7), 10 instructions."""
    return f"""
        {{
        .reg .b32 m, s, x, y;
        shl.b32 y, $2, 4;
        and.b32 m, $2, 0x7777;
        prmt.b32 m, {lo}, {hi}, m;
        prmt.b32 s, $2, y, 0x9D8C;
        lop3.b32 $0, m, s, 0x80808080, 0xF8;
        shr.u32 x, $2, 16;
        and.b32 m, x, 0x7777;
        prmt.b32 m, {lo}, {hi}, m;
        prmt.b32 s, $2, y, 0xBFAE;
        lop3.b32 $1, m, s, 0x80808080, 0xF8;
        }}
        """


_FOLD_PTX = tl.constexpr(fold_lookup_ptx("$3", "$7"))  # pack = 4: lo, hi are $3..$6, $7..$10 (one value each)


@triton.jit
def _fold_bytes_asm(pc, lo, hi):
    """e4m3 bytes of 4 packed e2m1 bytes p (8 codes, elements 0..7 of a 32-bit register) looked up in the
    key-block's table (lo, hi) (``fold_lookup_ptx``: 5 instructions for 4 elements).  Returns (elements 0-3,
    elements 4-7) as 4 bytes each.  GPU only (inline PTX)."""
    return tl.inline_asm_elementwise(
        asm=_FOLD_PTX,
        constraints="=r,=r,r,r,r,r,r,r,r,r,r",
        args=[pc, lo, hi],
        dtype=(tl.uint8, tl.uint8),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _fold_keys(pc, lo, hi, ASM: tl.constexpr):
    """Packed e2m1 bytes pc [BN, NB, 16] (NB blocks of a key) and each (key, block)'s fold table words lo, hi
    [BN, NB, 1] -> e4m3 keys [BN, NB * 32] with every element = value * 2**(FOLD_C - d), in the fold K order:
    column 32b + 16w + 4g + j holds element 32b + 8g + 4w + j (block b, g = group of 8 elements = 4 packed
    bytes) -- the order of the PTX path's output registers (no byte shuffle of the key tile); the query is
    loaded in the same order (_fold_q_order)."""
    BN: tl.constexpr = pc.shape[0]
    NB: tl.constexpr = pc.shape[1]
    W: tl.constexpr = pc.shape[2]
    lo = tl.broadcast_to(lo, pc.shape)
    hi = tl.broadcast_to(hi, pc.shape)
    if ASM:
        e03, e47 = _fold_bytes_asm(pc, lo, hi)
        # [.., 16 bytes of e03, 16 bytes of e47] a block: the pair dim moved outside the bytes, so each thread's
        # 32-bit registers from the PTX are used as they are (join + reshape would interleave their bytes)
        k8 = tl.reshape(tl.permute(tl.join(e03, e47), (0, 1, 3, 2)), (BN, NB * W * 2))
    else:
        p = pc.to(tl.int32)
        c0 = p & 7  # even element (low nibble)
        m0 = (tl.where(c0 < 4, lo, hi) >> ((c0 & 3) * 8)) & 255
        c1 = (p >> 4) & 7  # odd element
        m1 = (tl.where(c1 < 4, lo, hi) >> ((c1 & 3) * 8)) & 255
        even = m0 | ((p & 8) << 4)
        odd = m1 | (p & 0x80)
        nat = tl.reshape(tl.join(even, odd), (BN, NB, W // 4, 2, 4))  # natural order in a block: (g, w, j)
        k8 = tl.reshape(tl.permute(nat, (0, 1, 3, 2, 4)), (BN, NB * W * 2))
    return k8.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fold_q_order(r):
    """Element held by column r of the fold K order (see _fold_keys)."""
    return (r // 32) * 32 + ((r % 16) // 4) * 8 + ((r % 32) // 16) * 4 + r % 4


@triton.jit
def _fold_load(kptr, ok, s4, smax, c: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, ASM: tl.constexpr):
    """Blocks c .. c+NB-1 of the tile's keys as fold-encoded e4m3 [BN, NB * QBLOCK], each element = value *
    2**(FOLD_C - d) with d = smax - the block's scale byte (keys with d > FOLD_MAX_D get garbage: the caller
    routes them to the general path)."""
    nb = tl.arange(0, NB)
    d = smax[:, None] - ((s4[:, None] >> (8 * (c + nb))[None, :]) & 255)  # [BN, NB]
    lo, hi = _fold_words(tl.minimum(d, FOLD_MAX_D))
    offs = (c + nb)[:, None] * (QBLOCK // 2) + tl.arange(0, QBLOCK // 2)[None, :]  # [NB, 16] packed bytes
    pc = tl.load(kptr[:, None, None] + offs[None, :, :], mask=ok[:, None, None], other=0)
    return _fold_keys(pc, lo[:, :, None], hi[:, :, None], ASM)


@triton.jit
def _fold_far(s4, smax):
    """Keys the fold encoding cannot hold exactly: blocks more than FOLD_MAX_D binades apart, or a largest
    scale byte <= FOLD_C (the key factor 2**(smax - 127 - FOLD_C) would be an fp32 subnormal)."""
    smin = tl.minimum(tl.minimum(_sbyte(s4, 0), _sbyte(s4, 1)), tl.minimum(_sbyte(s4, 2), _sbyte(s4, 3)))
    return (smax - smin > FOLD_MAX_D) | (smax <= FOLD_C)


@triton.jit(do_not_specialize=["tiles"])
def _mxfp4_scores_kernel(
    q_ptr,
    w_ptr,
    data_ptr,
    scale_ptr,
    bt_ptr,
    row_ptr,
    nv_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_dp,
    stride_dr,
    stride_sp,
    stride_sr,
    stride_bt,
    stride_ot,
    H,
    N,
    MAX_BLOCKS,
    NUM_PAGES,
    tiles,
    BS: tl.constexpr,
    HP: tl.constexpr,
    HALF_D: tl.constexpr,
    QBLOCK: tl.constexpr,
    N_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    IMPL: tl.constexpr,
    W_SCALE: tl.constexpr,
    ASM: tl.constexpr = False,
    KSPLIT: tl.constexpr = 1,
    GENERAL: tl.constexpr = True,
    GEN_N: tl.constexpr = 1,
    PDL: tl.constexpr = False,
):
    """One program: query row t, tiles [chunk*tiles, (chunk+1)*tiles) of BLOCK_N entries.  Logits are
    computed as keys @ q^T, [BLOCK_N, HP] (entries on the MMA's M side, heads on N), so the head sum is a
    reduction along axis 1, within a warp.  Tiles at or past n_visible are written -inf without loads;
    the loop over live tiles has no branch inside, so Triton can software-pipeline its loads."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(row_ptr + t).to(tl.int64)
    nv = tl.load(nv_ptr + t)

    offs_h = tl.arange(0, HP)
    offs_i = tl.arange(0, HALF_D)  # packed byte i holds elements 2i (low nibble) and 2i+1 (high)
    h_ok = offs_h < H
    q_base = q_ptr + t.to(tl.int64) * stride_qt + offs_h[None, :] * stride_qh  # [1, HP]
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0) * W_SCALE
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    first = chunk * tiles
    n_live = tl.minimum(tl.maximum((nv - first * BLOCK_N + BLOCK_N - 1) // BLOCK_N, 0), tiles)
    tile0 = first * BLOCK_N + tl.arange(0, BLOCK_N)

    if IMPL == 2:
        tl.static_assert(N_SCALES == 4)
        # the query as e4m3 [QBLOCK, HP] operands, one per 32-block
        qc0, be0 = _q_block(q_base, 0, h_ok, QBLOCK)
        qc1, be1 = _q_block(q_base, 1, h_ok, QBLOCK)
        qc2, be2 = _q_block(q_base, 2, h_ok, QBLOCK)
        qc3, be3 = _q_block(q_base, 3, h_ok, QBLOCK)
        bmax = tl.maximum(tl.maximum(be0, be1), tl.maximum(be2, be3))
        bmax = tl.where(bmax == 0, 127, bmax)
        # fast path: one power-of-two scale per head (folded into w), exact when every block of the head
        # is within ~8 binades of its largest (always after the Hadamard rotation; checked here)
        q8_0, x0 = _to_fp8(qc0, bmax)
        q8_1, x1 = _to_fp8(qc1, bmax)
        q8_2, x2 = _to_fp8(qc2, bmax)
        q8_3, x3 = _to_fp8(qc3, bmax)
        if (x0 & x1 & x2 & x3) != 0:
            wq = w * _pow2(bmax)
            # L2 prefetch of tile i + 2 (its block-table entries read an iteration earlier): the loop below waits for
            # tile i's block-table entries, then its scale words and key bytes, every tile (the compiler pipelines
            # the key bytes one tile ahead only); from L2 rather than HBM those waits are shorter
            if ASM:
                ok_p, pg_p = _tile_pages(tile0 + 2 * BLOCK_N, nv, row, bt_ptr, stride_bt, MAX_BLOCKS, NUM_PAGES, BS)
            for i in range(0, n_live):
                offs_n = tile0 + i * BLOCK_N
                if ASM:  # (inline PTX: not under the interpreter)
                    kp_p, sp_p = _tile_ptrs(
                        offs_n + 2 * BLOCK_N, pg_p, BS, data_ptr, stride_dp, stride_dr, scale_ptr, stride_sp, stride_sr
                    )
                    _prefetch_l2(kp_p, ok_p)
                    _prefetch_l2(sp_p, ok_p)
                    ok_p, pg_p = _tile_pages(
                        offs_n + 3 * BLOCK_N, nv, row, bt_ptr, stride_bt, MAX_BLOCKS, NUM_PAGES, BS
                    )
                ok, kptr, s4 = _tile_keys(
                    offs_n,
                    nv,
                    row,
                    bt_ptr,
                    stride_bt,
                    MAX_BLOCKS,
                    NUM_PAGES,
                    BS,
                    data_ptr,
                    stride_dp,
                    stride_dr,
                    scale_ptr,
                    stride_sp,
                    stride_sr,
                )
                # block scales relative to the key's largest one (exact powers of two, or 0 for a block more
                # than 126 binades below it: its products are < 2**-126 of the largest block's); the largest
                # scale is applied after the head sum.  Relative to block 0 instead, a key whose block 0 is far
                # smaller than another block overflowed to inf.
                s0 = tl.maximum(tl.maximum(_sbyte(s4, 0), _sbyte(s4, 1)), tl.maximum(_sbyte(s4, 2), _sbyte(s4, 3)))
                acc = _fp8_block_dot(kptr, ok, q8_0, 0, QBLOCK, FP32_DOT, ASM) * _rel_scale(_sbyte(s4, 0), s0)[:, None]
                acc += _fp8_block_dot(kptr, ok, q8_1, 1, QBLOCK, FP32_DOT, ASM) * _rel_scale(_sbyte(s4, 1), s0)[:, None]
                acc += _fp8_block_dot(kptr, ok, q8_2, 2, QBLOCK, FP32_DOT, ASM) * _rel_scale(_sbyte(s4, 2), s0)[:, None]
                acc += _fp8_block_dot(kptr, ok, q8_3, 3, QBLOCK, FP32_DOT, ASM) * _rel_scale(_sbyte(s4, 3), s0)[:, None]
                s = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], axis=1) * _pow2(s0)
                tl.store(out_row + offs_n, tl.where(ok, s, float("-inf")), mask=offs_n < N)
        else:
            # general: one scale per (head, block) and per (key, block), applied to each block's partial
            be0 = tl.where(be0 == 0, 127, be0)
            be1 = tl.where(be1 == 0, 127, be1)
            be2 = tl.where(be2 == 0, 127, be2)
            be3 = tl.where(be3 == 0, 127, be3)
            g8_0, _ = _to_fp8(qc0, be0)
            g8_1, _ = _to_fp8(qc1, be1)
            g8_2, _ = _to_fp8(qc2, be2)
            g8_3, _ = _to_fp8(qc3, be3)
            for i in range(0, n_live):
                offs_n = tile0 + i * BLOCK_N
                ok, kptr, s4 = _tile_keys(
                    offs_n,
                    nv,
                    row,
                    bt_ptr,
                    stride_bt,
                    MAX_BLOCKS,
                    NUM_PAGES,
                    BS,
                    data_ptr,
                    stride_dp,
                    stride_dr,
                    scale_ptr,
                    stride_sp,
                    stride_sr,
                )
                acc = _fp8_block_dot(kptr, ok, g8_0, 0, QBLOCK, FP32_DOT, ASM) * (
                    _pow2(_sbyte(s4, 0))[:, None] * _pow2(be0)[None, :]
                )
                acc += _fp8_block_dot(kptr, ok, g8_1, 1, QBLOCK, FP32_DOT, ASM) * (
                    _pow2(_sbyte(s4, 1))[:, None] * _pow2(be1)[None, :]
                )
                acc += _fp8_block_dot(kptr, ok, g8_2, 2, QBLOCK, FP32_DOT, ASM) * (
                    _pow2(_sbyte(s4, 2))[:, None] * _pow2(be2)[None, :]
                )
                acc += _fp8_block_dot(kptr, ok, g8_3, 3, QBLOCK, FP32_DOT, ASM) * (
                    _pow2(_sbyte(s4, 3))[:, None] * _pow2(be3)[None, :]
                )
                _store_scores(out_row, offs_n, acc, w, ok, N)
    elif IMPL == 3:
        tl.static_assert(N_SCALES == 4)
        # the query as one e4m3 [128, HP] operand in the fold K order, one power-of-two scale a head putting
        # its largest |q| in [2**8, 2**9) (MXFP4 values: <= 384); exact if no block is > ~16 binades below
        r = tl.arange(0, 2 * HALF_D)
        qf = tl.load(q_base + _fold_q_order(r)[:, None], mask=h_ok[None, :], other=0.0)
        qf = qf.to(tl.float32)
        be = (tl.max(tl.abs(qf), axis=0).to(tl.int32, bitcast=True) >> 23) & 255
        qe = tl.minimum(tl.maximum(262 - be, 8), 246)  # biased exponent of the scale 2**(135 - be)
        q8 = (qf * _pow2(qe)[None, :]).to(tl.float8e4nv)
        q_exact = tl.min(tl.min((q8.to(tl.float32) * _pow2(254 - qe)[None, :] == qf).to(tl.int32), axis=1), axis=0)
        wq = w * _pow2(254 - qe)  # undo the query scale; the key scale 2**(smax - 127 - FOLD_C) is per key
        far_any = tl.zeros((BLOCK_N,), tl.int32)
        if q_exact != 0:
            for i in range(0, n_live):
                offs_n = tile0 + i * BLOCK_N
                ok, kptr, s4 = _tile_keys(
                    offs_n,
                    nv,
                    row,
                    bt_ptr,
                    stride_bt,
                    MAX_BLOCKS,
                    NUM_PAGES,
                    BS,
                    data_ptr,
                    stride_dp,
                    stride_dr,
                    scale_ptr,
                    stride_sp,
                    stride_sr,
                )
                smax = tl.maximum(tl.maximum(_sbyte(s4, 0), _sbyte(s4, 1)), tl.maximum(_sbyte(s4, 2), _sbyte(s4, 3)))
                k8 = _fold_load(kptr, ok, s4, smax, 0, N_SCALES, QBLOCK, ASM)
                if KSPLIT == 1:
                    acc = _dot(k8, q8, tl.zeros((BLOCK_N, HP), tl.float32), FP32_DOT)
                elif FP32_DOT:
                    acc = _dot(k8, q8, tl.zeros((BLOCK_N, HP), tl.float32), FP32_DOT)
                else:
                    # the MMA's partial sums moved into an fp32 accumulator every QBLOCK of K (i.e. every
                    # block's sum starts from zero in the tensor core: exact), by Triton's promotion
                    acc = tl.dot(k8, q8, tl.zeros((BLOCK_N, HP), tl.float32), max_num_imprecise_acc=QBLOCK)
                far = ok & _fold_far(s4, smax)
                s = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], axis=1) * _pow2(tl.maximum(smax - FOLD_C, 1))
                tl.store(out_row + offs_n, tl.where(ok, s, float("-inf")), mask=(offs_n < N) & ~far)
                far_any |= far.to(tl.int32)
        # general path (exact for every key and query, the "convert" kernel's math): the keys the fold
        # encoding cannot hold, or every key if the query does not fit one e4m3 scale a head
        if GENERAL and ((q_exact == 0) | (tl.max(far_any, axis=0) != 0)):
            q_even = tl.load(q_base + 2 * offs_i[:, None], mask=h_ok[None, :], other=0.0)  # [64, HP]
            q_odd = tl.load(q_base + 2 * offs_i[:, None] + 1, mask=h_ok[None, :], other=0.0)
            sidx = (2 * offs_i) // QBLOCK
            # sub-tiles of GEN_N entries: this rare path's registers must not cut the fast loop's occupancy
            for i in range(0, n_live * (BLOCK_N // GEN_N)):
                offs_n = first * BLOCK_N + i * GEN_N + tl.arange(0, GEN_N)
                ok, kptr, s4 = _tile_keys(
                    offs_n,
                    nv,
                    row,
                    bt_ptr,
                    stride_bt,
                    MAX_BLOCKS,
                    NUM_PAGES,
                    BS,
                    data_ptr,
                    stride_dp,
                    stride_dr,
                    scale_ptr,
                    stride_sp,
                    stride_sr,
                )
                smax = tl.maximum(tl.maximum(_sbyte(s4, 0), _sbyte(s4, 1)), tl.maximum(_sbyte(s4, 2), _sbyte(s4, 3)))
                redo = (ok & _fold_far(s4, smax)) | (offs_n < N * (1 - q_exact))  # every entry if q is not exact
                acc = _convert_logits(kptr, ok, s4, q_even, q_odd, offs_i, sidx, FP32_DOT)
                s = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
                tl.store(out_row + offs_n, tl.where(ok, s, float("-inf")), mask=(offs_n < N) & redo)
    elif IMPL == 1:
        q_full = tl.load(q_base + tl.arange(0, 2 * HALF_D)[:, None], mask=h_ok[None, :], other=0.0)  # [128, HP]
        for i in range(0, n_live):
            offs_n = tile0 + i * BLOCK_N
            ok, kptr, s4 = _tile_keys(
                offs_n,
                nv,
                row,
                bt_ptr,
                stride_bt,
                MAX_BLOCKS,
                NUM_PAGES,
                BS,
                data_ptr,
                stride_dp,
                stride_dr,
                scale_ptr,
                stride_sp,
                stride_sr,
            )
            packed = tl.load(kptr[:, None] + offs_i[None, :], mask=ok[:, None], other=0)  # [BN, 64]
            sc = ((s4[:, None] >> (8 * tl.arange(0, N_SCALES)[None, :])) & 255).to(tl.uint8)
            acc = tl.dot_scaled(packed, sc, "e2m1", q_full, None, "bf16")
            _store_scores(out_row, offs_n, acc, w, ok, N)
    else:
        q_even = tl.load(q_base + 2 * offs_i[:, None], mask=h_ok[None, :], other=0.0)  # [64, HP]
        q_odd = tl.load(q_base + 2 * offs_i[:, None] + 1, mask=h_ok[None, :], other=0.0)
        sidx = (2 * offs_i) // QBLOCK  # scale index of both elements of byte i
        for i in range(0, n_live):
            offs_n = tile0 + i * BLOCK_N
            ok, kptr, s4 = _tile_keys(
                offs_n,
                nv,
                row,
                bt_ptr,
                stride_bt,
                MAX_BLOCKS,
                NUM_PAGES,
                BS,
                data_ptr,
                stride_dp,
                stride_dr,
                scale_ptr,
                stride_sp,
                stride_sr,
            )
            acc = _convert_logits(kptr, ok, s4, q_even, q_odd, offs_i, sidx, FP32_DOT)  # [BLOCK_N, HP]
            _store_scores(out_row, offs_n, acc, w, ok, N)
    for i in range(n_live, tiles):
        offs_n = tile0 + i * BLOCK_N
        tl.store(out_row + offs_n, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=offs_n < N)


@triton.jit(do_not_specialize=["tiles"])
def _fp8_scores_kernel(
    q_ptr,
    w_ptr,
    data_ptr,
    scale_ptr,
    bt_ptr,
    row_ptr,
    nv_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_dp,
    stride_dr,
    stride_sp,
    stride_sr,
    stride_bt,
    stride_ot,
    H,
    N,
    MAX_BLOCKS,
    NUM_PAGES,
    tiles,
    BS: tl.constexpr,
    HP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The MXFP4 kernel's layout on FP8 keys: logits = bf16(keys) @ q^T, scaled by each key's scale."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(row_ptr + t).to(tl.int64)
    nv = tl.load(nv_ptr + t)

    offs_h = tl.arange(0, HP)
    offs_d = tl.arange(0, D)
    h_ok = offs_h < H
    q = tl.load(
        q_ptr + t.to(tl.int64) * stride_qt + offs_h[None, :] * stride_qh + offs_d[:, None],
        mask=h_ok[None, :],
        other=0.0,
    )  # [D, HP]
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0)

    out_row = out_ptr + t.to(tl.int64) * stride_ot
    first = chunk * tiles
    n_live = tl.minimum(tl.maximum((nv - first * BLOCK_N + BLOCK_N - 1) // BLOCK_N, 0), tiles)
    for i in range(0, n_live):
        offs_n = (first + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        blk = offs_n // BS
        vis = (offs_n < nv) & (blk < MAX_BLOCKS)
        page = tl.load(bt_ptr + row * stride_bt + blk, mask=vis, other=-1)
        ok = vis & (page >= 0) & (page < NUM_PAGES)  # a page outside the pool is skipped, never read
        page = tl.where(ok, page, 0).to(tl.int64)
        prow = (offs_n % BS).to(tl.int64)
        bits = tl.load(
            (data_ptr + page * stride_dp + prow * stride_dr)[:, None] + offs_d[None, :], mask=ok[:, None], other=0
        )
        k = bits.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)  # [BLOCK_N, D], exact
        ks = tl.load(scale_ptr + page * stride_sp + prow * stride_sr, mask=ok, other=0.0)
        acc = _dot(k, q, tl.zeros((BLOCK_N, HP), tl.float32), FP32_DOT)
        s = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1) * ks  # ReLU(ks * x) = ks * ReLU(x), ks > 0
        s = tl.where(ok, s, float("-inf"))
        tl.store(out_row + offs_n, s, mask=offs_n < N)
    for i in range(n_live, tiles):
        offs_n = (first + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_row + offs_n, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=offs_n < N)


def _scale_words(scale: torch.Tensor) -> torch.Tensor:
    """The [P, bs, 4] UE8M0 bytes as [P, bs] int32 words (one load a key).  A page-layout view
    (4-byte aligned rows) reinterprets in place; anything else is copied first."""
    n = scale.shape[-1]
    word = torch.iinfo(torch.int32).bits // 8
    if n != word:
        raise ValueError(f"keys.scale: expected {word} scale bytes a key for the word load, got {n}")
    try:
        return scale.view(torch.int32).squeeze(-1)
    except RuntimeError:
        return scale.contiguous().view(torch.int32).squeeze(-1)


_PROGRAMS_PER_SM = 2  # H200 sweep 2026-12-02: fewer, longer programs won (see launch_config)
_MAX_TILES = 16


class LaunchConfig(NamedTuple):
    """Triton launch of the scores kernels: padded heads, entries a tile, tiles a program, warps,
    software-pipelining stages, grid (query rows, programs a row)."""

    hp: int
    block_n: int
    tiles: int
    num_warps: int
    num_stages: int
    grid: tuple[int, int]
    maxnreg: int | None = None


def launch_config(
    T: int,
    H: int,
    N: int,
    device: torch.device,
    block_n: int | None = None,
    tiles_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
) -> LaunchConfig:
    """The scores kernels' launch; every None is chosen by the heuristic below (``maxnreg``: None = no
    register cap, i.e. ptxas's choice; a cap trades spills for resident programs a SM).

    Heuristic (sm90; set from the H200 sweep of 2026-12-02, benchmarks/results/2026-12-02_h200_sweep_indexer.txt,
    where 128/4 warps/2 stages with 8 tiles at B=1 and 16 tiles at B=4 and 8 were fastest): 128-entry tiles (the
    MMA's M side), 4 warps (one warpgroup; [128, 64] fp32 logits = 64 registers a thread), 2 pipelining
    stages; tiles per program such that the grid holds ~2 programs per SM (one resident wave), a power of
    two capped at 16 and at the row's tiles: T x N = 1 x 262,144 -> 8 tiles; 4 x 262,144 -> 16; 8 x 262,144 -> 16.
    """
    return _launch_config(
        T, H, N, device, block_n, tiles_per_program, num_warps, num_stages, maxnreg, interpreter_enabled()
    )


@functools.lru_cache(maxsize=4096)
def _launch_config(T, H, N, device, block_n, tiles_per_program, num_warps, num_stages, maxnreg, interp) -> LaunchConfig:
    hp = max(16, 1 << max(H - 1, 0).bit_length())
    if block_n is None:
        block_n = 32 if interp else 128
    if not isinstance(block_n, int) or block_n < 1:
        raise ValueError(f"block_n: expected a positive int, got {block_n!r}")
    n_tiles = -(-N // block_n)
    if tiles_per_program is None:
        target = _PROGRAMS_PER_SM * num_sms(device)
        per_program = max(1.0, min(float(_MAX_TILES), n_tiles * T / target, float(n_tiles)))
        tiles_per_program = 1 << round(math.log2(per_program))  # the nearest power of two
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 2
    for name, v in (("block_n", block_n), ("tiles_per_program", tiles_per_program), ("num_warps", num_warps)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive int, got {v!r}")
    if block_n & (block_n - 1) or num_warps & (num_warps - 1):
        raise ValueError(f"block_n and num_warps: expected powers of two, got {block_n}, {num_warps}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages: expected a positive int, got {num_stages!r}")
    check_maxnreg("maxnreg", maxnreg)
    grid = (T, -(-n_tiles // tiles_per_program))
    return LaunchConfig(hp, block_n, tiles_per_program, num_warps, num_stages, grid, None if interp else maxnreg)


# impl="auto": the first of these that compiles on the device (checked once a device, at the first call)
AUTO_IMPL_ORDER = ("fp8mma", "convert")  # H200 2026-12-02: fp8mma 75.8 us vs fold ~102, fold4 104.6 (1M, B=4)
_AUTO_IMPL: dict[int, str] = {}
_GEN_N = 64  # entries a sub-tile of the fold impls' general path (keeps its registers below the fast loop's)
_FOLD_ASM = True  # GPU: the fold impls' e2m1 -> scaled e4m3 table lookup by inline PTX ``prmt``; False: Triton ops
_FP8MMA_ASM = True  # GPU: e2m1 -> e4m3 bytes by inline PTX (4 bytes a register); False: Triton integer ops


def _reg_cap(cfg: LaunchConfig) -> dict:
    """The launch's register cap as a Triton launch option (none when uncapped)."""
    return {} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}


def _launch_mxfp4(impl, q, weights, data, scale32, block_table, token_row, n_visible, out, n, bs, cfg) -> None:
    interp = interpreter_enabled()
    _mxfp4_scores_kernel[cfg.grid](
        q,
        weights,
        data,
        scale32,
        block_table,
        token_row,
        n_visible,
        out,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        data.stride(0),
        data.stride(1),
        scale32.stride(0),
        scale32.stride(1),
        block_table.stride(0),
        out.stride(0),
        q.shape[1],
        n,
        block_table.shape[1],
        data.shape[0],
        cfg.tiles,
        BS=bs,
        HP=cfg.hp,
        HALF_D=_FMT.data_bytes,
        QBLOCK=_FMT.block,
        N_SCALES=_FMT.n_blocks,
        BLOCK_N=cfg.block_n,
        FP32_DOT=interp,
        IMPL=_IMPLS[impl],
        W_SCALE=_FP8_CODE_SCALE if impl == "fp8mma" else 1.0,
        ASM=_FP8MMA_ASM and not interp if impl == "fp8mma" else _FOLD_ASM and not interp if impl in _KSPLIT else False,
        KSPLIT=_KSPLIT.get(impl, 1),
        GEN_N=min(cfg.block_n, _GEN_N),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **_reg_cap(cfg),
        **pdl_launch(q.device),
    )


# ---------------------------------------------------------------------------------------- public ops
_GLUON_STATE: dict[int, bool] = {}  # device -> the Gluon kernel ran (True) / failed once (False: not retried)
# Eager calls with fewer query rows x entries take fp8mma: the Gluon launch costs ~45 us more host time a call
# (H200 host, 2026-12-04: indexer_scores 107 vs 61 us a call, ``study_gluon_indexer.py --host``), which the
# kernel's ~17 ps an entry-row (53.1 vs 71.3 us at 4 x 262,144) only repays from ~2.6M entry-rows on.
GLUON_EAGER_MIN_WORK = 1 << 21
# auto picks the Gluon kernel (sm_90).  H200, 2026-12-04 (``2026-12-04_h200_*_s12``), CUDA graphs, 262,144 entries
# a row: full rows B = 1 / 4 / 8 / 64 17.8 / 53.0 / 102.3 / 775.7 us vs fp8mma 22.6 / 71.9 / 139.1 / 1,079.9;
# rows seeing 1/8 of them (static block tables) 6.9 / 12.9 / 20.1 / 118.9 vs 18.1 / 31.0 / 36.8 / 242.3; V4-Flash CSA
# decode step at 128K, B = 1 / 8 / 64: 200.1 / 218.4 / 359.3 us (fp8mma: 199.7 / 223.2 / 396.7, session 10), with
# block tables for 1M tokens 386.8 / 428.9 / 644.4 vs 395.3 / 444.9 / 767.5.  False: fp8mma only.
GLUON_AUTO = True
# auto takes the Gluon kernel's fold variant (``impl="gluon_fold"``) instead of the exact one.  H200, session 13, two
# producers, 1M entries: B = 1 / 4 / 8 / 64 15.5 / 42.2 / 79.5 / 572 us against 17.3 / 48.1 / 90.8 / 679, within
# 2.4e-5 of a row's largest |score| (the reference's own bf16 scores are ~4e-3); its GPU unit tests pass.  The
# decode step's real-shape check (``dsv4 bench``, V4-Flash CSA, contexts 128K and 1M, B = 1 / 4 / 64; session 14)
# gave the same outputs with it as with the exact kernel, bit for bit, and steps as fast or faster: graph time
# 337.6 vs 348.3 us at 128K B = 64, 251.5 vs 256.0 at 1M B = 4, 921.5 vs 1022.8 at 1M B = 64 (B = 1: within
# 2 us).  False: auto takes the exact kernel (bit-equal to fp8mma).
GLUON_AUTO_FOLD = True


def _auto_gluon(state: bool | None, capturing: bool, work: int) -> bool:
    """impl="auto"'s choice of the Gluon kernel (see ``_gluon_scores_or_none``): ``state`` the device's record
    (None: never run, True: ran, False: failed), ``work`` query rows x entries.  False when ``GLUON_AUTO`` is."""
    if not GLUON_AUTO or state is False:
        return False
    if capturing:
        return state is True  # never built inside a capture
    return state is None or work >= GLUON_EAGER_MIN_WORK


def _gluon_scores_or_none(impl, q, weights, keys, block_table, token_row, n_visible, n):
    """``impl="gluon"`` / ``"gluon_fold"``, or ``"auto"`` where it applies: the warp-specialised Gluon kernel
    (``_gluon_scores``; gluon_fold: its fold variant, ``launch_gluon_scores(fold=True)``).

    auto uses it on sm_90 (``gluon_unsupported``) inside a CUDA-graph capture once it has run on the device, and in
    eager calls the first time (which builds it: an engine's eager warm-up before capturing) and from
    ``GLUON_EAGER_MIN_WORK`` query rows x entries on (below, fp8mma's lower host cost wins).  Both give the same scores
    (exact, the same math), unless ``GLUON_AUTO_FOLD`` makes auto take the fold variant.  None: not used here, or failed
    once on this device (auto: warned, and the Triton path is used from then on)."""
    from dsv4.kernels.indexer import _gluon_scores as gs

    why = gs.gluon_unsupported(q, keys)
    if why is not None:
        if impl != "auto":
            raise ValueError(f"indexer_scores: impl={impl!r} {why}")
        return None
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if impl == "auto" and not _auto_gluon(
        _GLUON_STATE.get(dev), torch.cuda.is_current_stream_capturing(), q.shape[0] * n
    ):
        return None
    try:
        fold = impl == "gluon_fold" or (impl == "auto" and GLUON_AUTO_FOLD)
        out = gs.launch_gluon_scores(q, weights, keys, block_table, token_row, n_visible, n, fold=fold)
    except Exception as e:  # noqa: BLE001 - auto: a kernel that fails to build falls back, once, loudly
        if impl != "auto":
            raise
        warnings.warn(
            f"indexer_scores: the Gluon kernel failed ({type(e).__name__}: {str(e)[:300]}); using Triton's fp8mma",
            stacklevel=3,
        )
        _GLUON_STATE[dev] = False
        return None
    _GLUON_STATE[dev] = True
    return out


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: KeyPages,
    block_table: torch.Tensor,
    token_row: torch.Tensor,
    n_visible: torch.Tensor,
    max_entries: int,
    backend: str = "auto",
    *,
    block_n: int | None = None,
    tiles_per_program: int | None = None,
    impl: str = "auto",
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """Indexer scores of every query row against its request's MXFP4 keys.

    Args:
        q: [T, Hi, 128] bf16 index query, already RoPE'd, Hadamard-rotated and MXFP4-simulated.
        weights: [T, Hi] fp32 head weights, already multiplied by 128^-1/2 * Hi^-1/2.
        keys: ``KeyPages`` — data [P, bs, 64] uint8 (packed e2m1, low nibble = even element), scale
            [P, bs, 4] uint8 UE8M0 (bytes in [1, 252]; every key made by MXFP4KeyFormat.quantize of
            finite normalised values qualifies).
        block_table: [B, max_blocks] int32 physical page of each logical page, -1 padded.
        token_row: [T] int32 block-table row of each query row.
        n_visible: [T] int32 entries (not tokens) visible to each query row; 0 <= n_visible <= max_entries
            (causal rule ``j < (t + 1) // 4`` applied by the caller).
        max_entries: host int N, the static number of output columns.
        backend: "auto" | "torch" | "triton".
        block_n, tiles_per_program, num_warps, num_stages, maxnreg: Triton launch (entries per tile,
            tiles per program, warps, pipelining stages, register cap a thread); None = ``launch_config``'s
            heuristic.
        impl: the kernel's inner product.
            "auto" (default): "gluon" where it applies and no Triton launch knob is given (``GLUON_AUTO``,
            see ``_gluon_scores_or_none``), else "fp8mma", or "convert" if fp8mma fails to
            compile on this device (decided at the first call on a device, with a warning;
            ``AUTO_IMPL_ORDER``).
            "gluon": the warp-specialised Gluon kernel (``_gluon_scores``: sm_90, 64 heads, pages of a
            power of two >= 64 entries; fp8mma's math and numbers, both of its query paths).  H200, 1M
            entries, two producer warpgroups (session 13): B = 4 47.9 us vs fp8mma 72.0; B = 64 676 vs 1,079;
            tiles past a row's n_visible are written -inf without loads, and a row's live tiles are spread over
            its programs.
            "gluon_fold": that kernel with the block scales folded into the keys' e4m3 codes (the "fold"
            encoding) and one K = 128 wgmma chain a tile: ~1.5x fewer instructions a tile (static SASS,
            ``sass_report.py``), not exact (FP8 tensor-core accumulation; blocks > 11 binades below their key's
            largest flushed to zero; within 2.4e-5 of a row's largest |score| on the benchmark's keys).  H200,
            1M entries: B = 4 42.5 us, B = 64 570 (the exact kernel 47.9 / 676 in the same run).
            "convert": e2m1 -> bf16 by bit manipulation in registers, bf16 ``tl.dot`` (K = 2 x 64).
            "dot_scaled": ``tl.dot_scaled(keys, scales, "e2m1", q, None, "bf16")`` (Triton lowers the
            MXFP4 operand; on sm90 by up-conversion); an experiment for the H200.
            "fold": block scales folded into the e2m1 -> e4m3 re-encoding (``prmt`` table lookups), one
            K=128 FP8 MMA a tile; keys with blocks > 11 binades apart (and all keys if q needs more than
            one e4m3 scale a head) are scored by the "convert" math in a second, rarely run loop.  See
            the module docstring (Numerics) for the FP8 MMA's accumulation precision.
            "fold4": the same with each 32-block's MMA partial added in fp32 (exact, a bit slower).
            "fp8mma": the e2m1 bytes re-encoded as e4m3 (SWAR, 4 bytes a register), q as e4m3, one
            K=32 FP8 MMA per 32-block with the key's block scale (and, if q's blocks of a head span
            more than ~8 binades, q's) applied to the block's fp32 partial.  Exact: the products are
            e2m1 x e2m1 values and a block's sum of 32 needs < 10 bits, so the MMA's reduced-precision
            accumulation loses nothing; requires q MXFP4-simulated as stated above (a q with more
            mantissa bits is rounded to e4m3 by this impl) and |q| < 2**126.

    Returns:
        [T, N] fp32 scores; -inf for entries at or past n_visible (or on page -1).
    """
    T, H = _check_common(q, weights, block_table, token_row, n_visible, max_entries)
    if impl not in ("auto", "gluon", "gluon_fold") and impl not in _IMPLS:
        raise ValueError(f"impl: expected 'auto', 'gluon', 'gluon_fold' or one of {tuple(_IMPLS)}, got {impl!r}")
    bs = _check_mxfp4_keys(keys, q.device)
    if not use_triton(backend, q, weights, keys.data, keys.scale, block_table, token_row, n_visible):
        return indexer_scores_reference(q, weights, keys, block_table, token_row, n_visible, max_entries)
    # the kernels index these as ptr + i (block_table rows as ptr + row * stride + j)
    block_table, token_row, n_visible = block_table.contiguous(), token_row.contiguous(), n_visible.contiguous()

    cfg = launch_config(T, H, max_entries, q.device, block_n, tiles_per_program, num_warps, num_stages, maxnreg)
    if T == 0 or max_entries == 0:
        return torch.empty((T, max_entries), dtype=torch.float32, device=q.device)
    if keys.data.stride(2) != 1 or keys.scale.stride(2) != 1:
        raise ValueError("keys: the last dim of data and scale must be contiguous")
    q = q if q.stride(2) == 1 else q.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    knobs = (block_n, tiles_per_program, num_warps, num_stages, maxnreg)
    if impl in ("gluon", "gluon_fold") or (impl == "auto" and all(k is None for k in knobs)):
        gout = _gluon_scores_or_none(impl, q, weights, keys, block_table, token_row, n_visible, max_entries)
        if gout is not None:  # it allocates its own output and scale words
            return gout
    out = torch.empty((T, max_entries), dtype=torch.float32, device=q.device)
    scale32 = _scale_words(keys.scale)
    args = (q, weights, keys.data, scale32, block_table, token_row, n_visible, out, max_entries, bs, cfg)
    if impl != "auto":
        _launch_mxfp4(impl, *args)
        return out
    dev = q.device.index if q.is_cuda else -1
    if dev in _AUTO_IMPL:
        _launch_mxfp4(_AUTO_IMPL[dev], *args)
        return out
    first, fallback = AUTO_IMPL_ORDER[0], AUTO_IMPL_ORDER[-1]
    try:
        _launch_mxfp4(first, *args)
        _AUTO_IMPL[dev] = first
    except Exception as e:  # noqa: BLE001 - a compile failure of the fast path falls back, once, loudly
        if first == fallback:
            raise
        msg = f"indexer_scores: impl {first!r} failed ({type(e).__name__}: {str(e)[:300]}); using {fallback!r}"
        warnings.warn(msg, stacklevel=2)
        _AUTO_IMPL[dev] = fallback
        _launch_mxfp4(fallback, *args)
    return out


def indexer_scores_fp8keys(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: FP8KeyPages,
    block_table: torch.Tensor,
    token_row: torch.Tensor,
    n_visible: torch.Tensor,
    max_entries: int,
    backend: str = "auto",
    *,
    block_n: int | None = None,
    tiles_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """``indexer_scores`` on 132-byte FP8 keys (``FP8KeyPages``: data [P, bs, 128] uint8 e4m3 bits,
    scale [P, bs] fp32, > 0).  Same arguments, result and launch knobs otherwise."""
    T, H = _check_common(q, weights, block_table, token_row, n_visible, max_entries)
    check_tensor("keys.data", keys.data, dtype=torch.uint8, ndim=3, device=q.device)
    P, bs, _ = keys.data.shape
    check_tensor("keys.data", keys.data, shape=(P, bs, _FMT.dim))
    check_tensor("keys.scale", keys.scale, dtype=torch.float32, shape=(P, bs), device=q.device)
    if not use_triton(backend, q, weights, keys.data, keys.scale, block_table, token_row, n_visible):
        return indexer_scores_fp8keys_reference(q, weights, keys, block_table, token_row, n_visible, max_entries)
    # the kernels index these as ptr + i (block_table rows as ptr + row * stride + j)
    block_table, token_row, n_visible = block_table.contiguous(), token_row.contiguous(), n_visible.contiguous()

    cfg = launch_config(T, H, max_entries, q.device, block_n, tiles_per_program, num_warps, num_stages, maxnreg)
    out = torch.empty((T, max_entries), dtype=torch.float32, device=q.device)
    if T == 0 or max_entries == 0:
        return out
    if keys.data.stride(2) != 1:
        raise ValueError("keys.data: the last dim must be contiguous")
    q = q if q.stride(2) == 1 else q.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    _fp8_scores_kernel[cfg.grid](
        q,
        weights,
        keys.data,
        keys.scale,
        block_table,
        token_row,
        n_visible,
        out,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        keys.data.stride(0),
        keys.data.stride(1),
        keys.scale.stride(0),
        keys.scale.stride(1),
        block_table.stride(0),
        out.stride(0),
        H,
        max_entries,
        block_table.shape[1],
        keys.data.shape[0],
        cfg.tiles,
        BS=bs,
        HP=cfg.hp,
        D=_FMT.dim,
        BLOCK_N=cfg.block_n,
        FP32_DOT=interpreter_enabled(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **_reg_cap(cfg),
        **pdl_launch(q.device),
    )
    return out
