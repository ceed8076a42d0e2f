"""The compressor's cache side (spec §3, §3.1, §6.1): fold a step's projections into the position-indexed
state ring, pool the entries that complete in this step, and emit them into the paged pools.

State layout (fixed by the cache): per CSA/HCA layer, fp32 ``kv_state`` and ``score_state`` of shape
[num_state_slots, c*m, c*d] (c = 2, m = 4 for CSA with overlap; c = 1, m = 128 for HCA; d = 512 main,
128 for the CSA indexer's compressor).  Row ``pos mod (c*m)`` of a request's slot holds the projections
of position ``pos`` (a ring indexed by absolute position, like vLLM's; not the reference's
previous/current halves).  A fresh slot holds kv 0 / score -inf; score rows already include ``ape``.

**Online state** (``state_pos`` given; non-overlapping compressors only: HCA).  Instead of the last m rows the
state holds, per channel, the running softmax of the open chunk's rows before the newest -- ``max`` (the
largest score), ``den`` (sum of exp(score - max)) and ``acc`` (sum of exp(score - max) * kv) -- plus the newest
row itself (raw kv and score) and its position (``state_pos``, int32 per slot).  kv_state [S, 3, d] = (acc, den,
raw kv) and score_state [S, 2, d] = (max, raw score) are views of one fp32 [S, 5, d] buffer (``online_state``).
Combining running softmaxes: M = max(max_a, max_b), den = den_a exp(max_a - M) + den_b exp(max_b - M), acc
likewise; the entry is acc / den over the chunk's m rows.  A step whose request starts at p0 uses the state only
if its chunk began before p0: the prefix, and the raw row when its position is < p0.  Keeping the newest row raw
makes a step re-runnable: re-running position p0 (a cancelled decode step, ``KVCacheManager.cancel``) replaces
the row instead of folding it twice, and a replayed CUDA graph gives the same result each time.  The state of
HCA (d = 512) shrinks from 2 x 128 x 512 fp32 (512 KiB) a request and layer to 5 x 512 + 1 (10 KiB), and a decode
step that emits reads ~10 KiB a request instead of 512 KiB.  The pooled values equal the softmax pooling up to
fp32 rounding (the exp-weighted sums are summed in another order): against fp64 pooling a chunk folded one row
at a time is off by at most ~1e-6 of the row's largest value, as the reference's own fp32 formula is (CPU, 64
chunks of 128 rows x 512 channels, score scales 1 / 4 / 16: 7.0e-7 / 1.1e-6 / 3.6e-7 vs 5.7e-7 / 9.7e-7 / 4.1e-7;
tested).

Pooling of the entry completed at position t (t + 1 ≡ 0 mod m; entry index t // m)::

    HCA:  rows t-m+1 .. t          channels [0, d)
    CSA:  rows t-2m+1 .. t-m  "A"  channels [0, d)     (the previous chunk; absent for entry 0)
          rows t-m+1  .. t    "B"  channels [d, 2d)
    pooled[ch] = sum_rows softmax_rows(score[row, ch]) * kv[row, ch]     (fp32)

A row comes from this step's inputs when its position is in the step, else from the state as it was
*before* this step (a long chunk would otherwise overwrite rows it still needs); positions < 0 count
as absent.  After the step the state holds each request's last c*m positions.

Which tokens write the state: token i (position t, state slot s) writes row t mod c*m unless the same
request has position t + c*m in this step.  The kernels compute this from ``positions`` and
``token_slot`` (no precomputed write rows are needed), assuming the step contract below.

Launches (Triton path; no host synchronisation, no copies, no fills, CUDA-graph capturable):
``compressor_step(decode=True)`` 1 (pool + own state row: safe in one launch as each request has one
token); otherwise 2 (token-blocked pool pass, then the tiled state-write pass: a pool must read the state
as it was before the step, so the writes wait for a grid-wide boundary; the state write spreads the blocks that
hold writing tokens over lanes of a superblock where c*d >= 512, ``_compressor_write_lanes_kernel``), or 1 where
the caller knows that no pooling of the step reads a state row (``state_unread``: e.g. every request starts at
position 0, ``state_unread_by_step``), the pool programs then writing the state rows of their own tokens; with an
online state the state write also writes the positions given the slots' counters (``counters``; else a third launch
does); ``compress_prefill`` runs them and the emit, the state write
optionally on a side stream alongside the emit (both wait only for the pool).  ``emit_entries`` 1 (RMSNorm,
RoPE at the entry position computed in the kernel, [Hadamard], quantise, store; a block of tokens per
program, only the emitting ones read; the indexer's Hadamard factorised as H_NB (x) H_32).  A decode step is one
launch a compressor (``compress_decode``: the last channel-block program of an emitting token emits it), and one
launch for both compressors of a CSA layer (``compress_decode_csa``: the two programs' grids side by side).  In a
prefill, ``compressor_prefill.compress_prefill(fuse_emit=True)`` lets the pool program emit where it holds a token's
whole pooled row (CSA's 8-row tiles); HCA's would be 128 x 512 values, so its channel blocks stay spread over many
programs and its emit a launch of its own.

Step contract (not checked: it would need a host sync): the tokens of one request are contiguous in
the batch, in increasing consecutive positions; a request appears in one run only; its state holds
positions p0 - c*m .. p0 - 1 (those >= 0), p0 being its first position in the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.formats.fp8_entry import EntryPages, FP8EntryFormat
from dsv4.formats.mxfp4_key import KeyPages, MXFP4KeyFormat
from dsv4.kernels._triton_sync import last_arrival, pdl_end, pdl_enter, pdl_start
from dsv4.kernels.cache._triton_quant import (
    bf16_rne,
    bf16_round,
    ceil_log2_ratio,
    e2m1_code,
    hadamard_dots,
    parity_sign,
    pow2_neg,
    rope_cos_sin_at,
    rope_cos_sin_pos,
    sylvester_signs,
)
from dsv4.kernels.cache.store import (
    _VEC_ELEMS,
    _check_entry_pages,
    _check_key_pages,
    _check_pow2,
    _fp8_args,
    _fp8_row_offsets,
    _launch_norm_rope_fp8,
    _mxfp4_args,
    _mxfp4_store_row,
    _norm_rope_rows,
    check_fp8_kernel_geometry,
    store_fp8_entries_reference,
    store_mxfp4_keys_reference,
)
from dsv4.kernels.dispatch import check_maxnreg, interpreter_enabled, num_sms, pdl_launch, use_triton
from dsv4.model.functional import ape_rows, apply_rope, hadamard, rms_norm

__all__ = [
    "online_combine",
    "online_state",
    "compress_decode",
    "compress_decode_csa",
    "compressor_step",
    "compressor_step_reference",
    "check_emit_arguments",
    "emit_entries",
    "emit_entries_reference",
    "entry_positions",
    "state_unread_by_step",
]

_INT = (torch.int32, torch.int64)
# Non-decode launch geometry: the pool pass scans min(m, _POOL_BLOCK_T) tokens per program and pools their
# emitting tokens one after another (a prefill block of m consecutive positions holds exactly one), each over
# a [c*m, block_d] tile of <= _POOL_TILE values read with one load per tensor (full tiles at 4 warps: 32 values
# per thread per tensor, CSA main [8, 512] and HCA [128, 32]; CSA indexer [8, 128] at 2 warps); the
# state-write pass copies [_WRITE_BLOCK_T, _WRITE_BLOCK_D] tiles.  Decode: [c*m, block_d] tiles of
# <= _DECODE_TILE values; HCA (c*m = 128) at 4 warps.
_POOL_BLOCK_T = 128
# CSA main (full [8, 512] tiles): two emitting tokens a program.  H200, V4-Flash prefill of 65,536 tokens
# (2026-12-04_h200_write_prefill_s15.txt, 2 warps): 173.8 us with 8 tokens a program vs 179.6 with 4 (8,192: 32.9 vs
# 32.7)
_POOL_BLOCK_T_CSA_MAIN = 8
_POOL_TILE = 4096
# small pool tiles (the CSA indexer compressor, d = 128): 2 warps, H200 2026-12-02 (write_pool: T = 65,536
# csa_indexer 109.7 us with 2 warps vs 192.4 with 4)
_POOL_WARPS_SMALL = 2
# full pool tiles: 4 warps, H200 2026-12-02 session 3 (write_tune2, T = 65,536 with the register run start):
# CSA main 176.9 us with 4 vs 206.1 with 8; HCA 94.4 us with 4 vs 134.7 with 8 and 111.2 with 2.  Session 15
# (2026-12-04_h200_write_main_s15.txt): CSA main 182.9 us with 2 vs 195.3 with 4 (T = 8,192: 35.0 vs 38.5), so
# every CSA pool (c*m = 8 rows a tile) takes _POOL_WARPS_SMALL and only HCA's 128-row tiles _POOL_WARPS.
_POOL_WARPS = 4
# Small pool tiles (the CSA indexer's [8, 128]) on one warp: with two, the warps split the 8 rows, so each of the
# softmax's three row reductions crossed warps through shared memory (Nsight: 35 % of stalls on MIO,
# 2026-12-04_h200_ncu_indexer_pool_s17.txt).  Pool device time, 2 warps / 1 warp / 1 warp with 64 channels a program
# (2026-12-04_h200_profile_ipool_*_s17.txt): T = 65,536 46.8 / 41.7 / 36.5 us (94 % of its bytes' roofline);
# T = 8,192 7.5 / 4.9 / 5.5.  So 1 warp, and half the channels from _POOL_SPLIT_D_MIN_BLOCKS token blocks (between
# the two measured grids, 2,048 and 16,384 blocks).
_POOL_WARPS_TINY = 1
_POOL_SPLIT_D_MIN_BLOCKS = 8192
# The pool's softmax division: once a channel after the weighted sum on full tiles (CSA main [8, 512], HCA [128, 32]),
# once a row's weight on the CSA indexer's [8, 128].  Nsight put the HCA pool at 0.56 instructions issued a scheduler
# cycle with one eligible warp (2026-12-04_h200_ncu_hca_pool_s16.txt); pool device time at 65,536 tokens, a division
# a row vs a channel (2026-12-04_h200_profile_div_s16.txt): CSA main 150.7 vs 139.2 us (98 % of its bytes' roofline),
# HCA 82.5 vs 80.8, HCA online 83.0 vs 81.2, CSA indexer 47.4 vs 48.5.  So from tiles of _POOL_DIV_AFTER_MIN values.
_POOL_DIV_AFTER_MIN = 4096
# Two more instruction cuts of the pool (``_pool_token``): FAST_ROWS, an entry whose rows are all in the step loaded
# without the select between step and state pointers (one 64-bit base, 32-bit offsets); FAST_EXP, exp as one FMA +
# ex2.approx.ftz.  sm_90 SASS of the HCA pool (Triton 3.6, ``sass_report.py --sass``, static instructions by source
# line): the general row loads and their addressing ~470 instructions a program, the fast loads ~115; exp 192 -> 68.
# Pool device time at 65,536 tokens, H200 (2026-12-04_h200_profile_lean_s17.txt), neither / FAST_ROWS / FAST_EXP /
# both: HCA 79.7 / 77.3 / 75.4 / 74.0 us; HCA online 80.5 / 88.5 / 76.3 / 81.5 (FAST_ROWS takes the online pool past
# 128 registers: 168 with both); CSA main 139.5 / 133.7 / 143.6 / 133.6; CSA indexer 46.8 / 48.9 / 46.8 / 49.5.  So
# FAST_ROWS on full tiles (_POOL_DIV_AFTER_MIN) of the reference layout, FAST_EXP where an entry's rows do not overlap
# (cm = 1: HCA); ``_pool_fast_defaults``.


# The online pool's entries that take no state share: their rows are all in the step, so only the fast loads could be
# compiled for them (``_compressor_pool_kernel``'s ONLINE_ROWS_IN_STEP).  sm_90 (Triton 3.6, sass_report, hca_online
# prefill 65,536): the default 128 registers / 2,384 static instructions; ONLINE_ROWS_IN_STEP 165 / 2,072 (3 programs
# an SM instead of 4: fast rows with both paths compiled took 168 and were slower on the H200, 88.5 vs 80.5 us);
# with ``pool_maxnreg=128`` 128 / 2,160, no spills.  Off until timed (``run_h200.sh sweep_s18``).
_POOL_ONLINE_ROWS_IN_STEP = False
# A pool that adds ape (``compressor_step(ape=)``) holds the ape rows beside the score rows: sm_90 (Triton 3.6,
# sass_report, V4-Flash prefill 65,536) HCA's [128, 32] tile 128 -> 168 registers, online 128 -> 143 (3 programs an SM
# instead of 4), CSA main 223 -> 254 (still 4).  HCA's pools with ape are capped at this many (HCA 16 B of stack,
# online none) unless ``pool_maxnreg`` says otherwise.  Not timed.
_POOL_APE_MAXNREG = 128
# (A one-dimensional pool grid with a token block's channel blocks as consecutive programs, so that the programs
# resident together read HCA's 2 KB rows whole rather than 128 B of each, was slower on the H200, 2026-12-05
# (2026-12-05_h200_profile_grid_{65536,8192}_s20.txt, pool device time at 65,536 tokens): HCA 85.3 vs 76.0 us, HCA
# online 83.0 vs 80.5, CSA indexer 36.1 vs 36.5; removed.)


def _pool_fast_defaults(cm: int, full_tile: bool, online: bool) -> tuple[bool, bool]:
    """(FAST_ROWS, FAST_EXP) of the pool kernel when the caller leaves them (see the measurements above)."""
    return full_tile and not online, cm == 1


_DECODE_TILE = 4096
# H200, 2026-12-02: HCA decode at B = 64 took 13.1 us with 4 warps (write_v2) and 18.1 us with 8 (write_v3).
_DECODE_WARPS = 4
_EMIT_BLOCK_T = 8  # indexer emit: tokens scanned per program (m = 4: 2 emitting ones at most in a prefill)
# indexer emit warps: H200, 2026-12-02 (write_v5), CSA indexer prefill T = 65,536: 193.4 us with 1 warp vs 224.7
# with 4 and 206.9 with 2 (T = 8,192: 31.0 vs 34.6 / 32.7)
_EMIT_INDEXER_WARPS = 1
# indexer emit, MMA variant (``_emit_indexer_dot_kernel``): tokens a program, emitting rows a group (MMA M), warps.
# H200, CSA indexer prefill T = 65,536 (2026-12-03_h200_profile_write_emit_dot*_s7.txt; emit kernel device time):
# the one-warp factored kernel 54.8 us; MMA kernel with the emitting rows compacted, (block_t, rows) = (64, 16)
# 51.1, (128, 16) 41.5, (128, 32) 51.4, (256, 16) 48.7, (256, 32) 75.1, (512, 16) 84.0 (before the compaction,
# (64, all 64 rows) 58.0).  Session 15 (the cheaper e2m1 code, the compaction through a scratch scatter: 224 -> 80
# registers; 2026-12-04_h200_{profile_write,write}_emit_s15.txt): emit kernel 23.8 us; whole op, graph time, (128, 16)
# 77.6 us, (128, 32) 80.6, (64, 16) 79.9, (256, 16) 84.1, (32, 16) 99.4; at T = 8,192: (64, 16) 18.8, (32, 16) 20.7,
# (256, 16) 31.8, the factored kernel 20.1.  ``dot=None``: 128 tokens a program where that grid has
# _EMIT_DOT_MIN_PROGRAMS per SM (T >= 33,792 on 132 SMs), 64 from T = _EMIT_DOT_MIN_T_64 (measured there), the factored
# kernel below (not measured).  Session 17 (2026-12-04_h200_{ncu_emit,profile_emit,profile_emit2}*_s17.txt): Nsight put
# the kernel on shared memory, 63 % of its wavefronts excess (fp32 tf32 operands; the rope rows loaded with 16 lanes
# down the rows, then read from unswizzled shared memory); bf16 MMA operands 23.8 -> 22.0 us, then the rope values as
# one row-major load 22.0 -> 15.0 us (excess wavefronts 9 %); at T = 8,192 7.7 -> 6.2 us.  num_stages 1 and 32 rows
# a group within 1 us of the defaults (_EMIT_DOT_STAGES).
_EMIT_DOT_BLOCK_T = 128
_EMIT_DOT_ROWS = 16
_EMIT_DOT_WARPS = 4
# a grid of at most one program an SM (T = 8,192: 128 programs of 64 tokens, one 16-row group each, latency-bound):
# 8 warps, 6.2 -> 5.2 us (2 warps 8.9; 2026-12-04_h200_profile_emit_warps8k_s17.txt); at T = 65,536 (512 programs)
# 8 warps were slower, 15.1 -> 19.5 us
_EMIT_DOT_WARPS_FEW = 8
_EMIT_DOT_STAGES: int | None = None  # Triton's num_stages of the group loop (None: Triton's default)
_EMIT_DOT_MIN_PROGRAMS = 2
_EMIT_DOT_BLOCK_T_SMALL = 64
_EMIT_DOT_MIN_T_64 = 8192
# pool kernel: which pooled rows are in the step, from per-row index loads (True: a dependent round trip) or
# from the registers of the program's first load (False; ``_compressor_pool_kernel``)
_POOL_ROW_LOADS = False
# State-write pass: one program per _WRITE_BLOCK_T tokens, [_WRITE_BLOCK_T, _WRITE_BLOCK_D] tiles looped over the
# channels.  (It was a (token block, channel block) grid of [32, 256] tiles at 8 warps: sm_90a ptxas 182
# registers, so one program per SM, and 4,096 (HCA) / 8,192 (CSA main) programs at T = 65,536, all but the
# last c*m tokens' exiting after their index loads.)
_WRITE_BLOCK_T = 32
_WRITE_BLOCK_D = 64
_WRITE_WARPS = 4
# The lanes variant (``_compressor_write_lanes_kernel``): LANES programs a superblock of min(max(T / SUPERBLOCKS, 256),
# 2,048) tokens (a power of two), [4,096 / c*d, c*d] tiles (one round trip a writing block).  H200, V4-Flash prefill
# (2026-12-04_h200_{profile_write,write}_s16.*): write kernel device time at 65,536 tokens, one program a 32-token
# block vs 16 / 32 lanes: HCA 7.7 vs 5.1 / 5.7 us, CSA main 7.9 vs 3.9 / 5.2, CSA indexer 4.2 vs 3.8 / 5.1; the op's
# graph time with 16 lanes: CSA main 174.5 -> 171.4 us (8,192 tokens: 32.8 -> 30.4), HCA 93.6 -> 90.6 (20.0 -> 19.3),
# CSA indexer 75.8 -> 75.7 but 18.2 -> 19.0 at 8,192.  So 16 lanes from c*d >= _WRITE_LANES_MIN_CD (CSA main: 1,024,
# HCA: 512), the one-program-a-block kernel for the CSA indexer's compressor (256).
_WRITE_LANES = 16
_WRITE_LANES_MIN_CD = 512
_WRITE_LANE_TILE = 4096
_WRITE_SUPERBLOCKS = 32
# Online state (HCA): a decode program takes all d channels (``_online_block_d``: d = 512, one program a token, the
# emit in the same program, no counters); the non-decode state write scans _ONLINE_WRITE_BLOCK_T tokens a program
# for each request's last one (one per request: most programs exit after their index loads).  H200, V4-Flash HCA
# prefill of 65,536 tokens (2026-12-04_h200_write_hca_online_wbt_s14.txt): 118.2 us with 128, 112.4 with 512,
# 113.1 with 2,048 (the reference-layout kernels: 94.3 us).
_ONLINE_WRITE_BLOCK_T = 512
# (Pooling in two launches, one compiled for the chunks wholly in the step and one for those that began before it,
# cuts the pool kernel's registers from 154 to 116 (sm_90 ptxas) but was slower on the H200, V4-Flash HCA prefill of
# 65,536 tokens, 2026-12-04_h200_write_hca_split_s15.txt: 125.8 us vs 111.8 for one launch; removed.)


def _geometry(ratio: int, overlap: bool) -> tuple[int, int]:
    """(c, c*m) for a compressor of ratio m."""
    if not isinstance(ratio, int) or ratio <= 0:
        raise ValueError(f"ratio: expected a positive int, got {ratio!r}")
    c = 2 if overlap else 1
    return c, c * ratio


def entry_positions(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """RoPE position of the entry a token at ``positions`` belongs to: ``ratio * (pos // ratio)`` (int64)."""
    return positions.long() // ratio * ratio


# ============================================================================ reference
def compressor_step_reference(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    kv_state: torch.Tensor,
    score_state: torch.Tensor,
    ratio: int,
    overlap: bool,
    state_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch definition of ``compressor_step`` (a loop over the step's requests; syncs to the host).

    Rows of ``pooled`` for tokens that do not emit are 0 here (unspecified for the Triton path).
    """
    if state_pos is not None:
        return _online_step_reference(kv, score, positions, token_slot, kv_state, score_state, state_pos, ratio)
    c, cm = _geometry(ratio, overlap)
    d = kv.shape[1] // c
    t_all = kv.shape[0]
    pooled = torch.zeros(t_all, d, dtype=torch.float32, device=kv.device)
    emits = (positions.long() + 1) % ratio == 0
    for s in torch.unique(token_slot).tolist():
        if not 0 <= s < kv_state.shape[0]:
            continue  # no state slot: nothing pooled, nothing written
        idx = (token_slot == s).nonzero().squeeze(1)
        pos = positions[idx].long()
        p0, n = int(pos[0]), idx.numel()
        # history: positions p0-cm .. p0-1 from the state (as before this step), then the step's rows
        hist_pos = torch.arange(p0 - cm, p0 + n, device=kv.device)
        st_rows = hist_pos[:cm] % cm
        h_kv = torch.cat([kv_state[s, st_rows], kv[idx].float()], dim=0)
        h_sc = torch.cat([score_state[s, st_rows], score[idx].float()], dim=0)
        absent = hist_pos < 0
        h_kv[absent] = 0.0
        h_sc[absent] = float("-inf")
        e_loc = emits[idx].nonzero().squeeze(1)
        if e_loc.numel():
            # token at local index l has history index l + cm; its rows are history l+1 .. l+cm
            rows = e_loc.unsqueeze(1) + 1 + torch.arange(cm, device=kv.device).unsqueeze(0)
            g_kv, g_sc = h_kv[rows], h_sc[rows]  # [E, cm, c*d]
            if overlap:
                g_kv = torch.cat([g_kv[:, :ratio, :d], g_kv[:, ratio:, d:]], dim=1)
                g_sc = torch.cat([g_sc[:, :ratio, :d], g_sc[:, ratio:, d:]], dim=1)
            pooled[idx[e_loc]] = (g_kv * g_sc.softmax(dim=1)).sum(dim=1)
        # the state keeps the request's last cm positions
        keep = idx[-cm:]
        kp = positions[keep].long() % cm
        kv_state[s, kp] = kv[keep].float()
        score_state[s, kp] = score[keep].float()
    return pooled, emits


def online_state(
    num_state_slots: int, d: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fresh online state (module docstring): kv_state [S, 3, d] (acc 0, den 0, raw kv 0) and score_state
    [S, 2, d] (max -inf, raw score -inf), views of one fp32 [S, 5, d] buffer, and state_pos int32 [S] (-1)."""
    buf = torch.zeros(num_state_slots, 5, d, dtype=torch.float32, device=device)
    buf[:, 3:] = float("-inf")
    return buf[:, 0:3], buf[:, 3:5], torch.full((num_state_slots,), -1, dtype=torch.int32, device=device)


Running = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (max, den, acc), each [d] fp32


def online_combine(a: Running, b: Running) -> Running:
    """Two running softmaxes (max, den, acc) of disjoint row sets -> the one of their union (fp32).  A set with
    max -inf holds no rows and contributes nothing (two empty sets give an empty one)."""
    mx = torch.maximum(a[0], b[0])
    ref = torch.where(mx == float("-inf"), 0.0, mx)  # (both empty: exp(-inf - 0) = 0, no inf - inf)
    fa, fb = torch.exp(a[0] - ref), torch.exp(b[0] - ref)
    return mx, a[1] * fa + b[1] * fb, a[2] * fa + b[2] * fb


def _online_rows(kv: torch.Tensor, sc: torch.Tensor) -> Running:
    """(max, den, acc) of rows kv, sc [n, d] fp32 (n = 0: the empty set, max -inf)."""
    if kv.shape[0] == 0:
        z = torch.zeros(kv.shape[1], dtype=torch.float32, device=kv.device)
        return torch.full_like(z, float("-inf")), z, z.clone()
    mx = sc.max(0).values
    e = torch.exp(sc - mx)
    return mx, e.sum(0), (e * kv).sum(0)


def _online_step_reference(kv, score, positions, token_slot, kv_state, score_state, state_pos, ratio):
    """``compressor_step_reference`` with an online state (module docstring): per request and chunk the step
    touches, the running softmax of the chunk's rows before its last one in the step -- the state's prefix (and
    its raw row when older than the step) if the chunk began before the step, then the step's rows -- combined
    with that last row; an emitting chunk pools acc / den; the state keeps the request's last chunk."""
    t_all, d = kv.shape
    pooled = torch.zeros(t_all, d, dtype=torch.float32, device=kv.device)
    emits = (positions.long() + 1) % ratio == 0
    for s in torch.unique(token_slot).tolist():
        if not 0 <= s < kv_state.shape[0]:
            continue
        idx = (token_slot == s).nonzero().squeeze(1)
        pos = positions[idx].long()
        p0, tag = int(pos[0]), int(state_pos[s])
        chunk = pos // ratio
        for ch in torch.unique(chunk).tolist():
            sel, c0 = idx[chunk == ch], ch * ratio
            part = _online_rows(kv[:0].float(), score[:0].float())
            if c0 < p0:  # the chunk's rows before the step are in the state
                part = (score_state[s, 0], kv_state[s, 1], kv_state[s, 0])
                if c0 <= tag < p0:  # its raw row is one of them (not a re-run of the step's first position)
                    part = online_combine(part, _online_rows(kv_state[s, 2:3], score_state[s, 1:2]))
            excl = online_combine(part, _online_rows(kv[sel[:-1]].float(), score[sel[:-1]].float()))
            last = sel[-1]
            if emits[last]:
                full = online_combine(excl, _online_rows(kv[last : last + 1].float(), score[last : last + 1].float()))
                pooled[last] = full[2] / full[1]
        score_state[s, 0], kv_state[s, 1], kv_state[s, 0] = excl
        kv_state[s, 2], score_state[s, 1] = kv[last].float(), score[last].float()
        state_pos[s] = int(pos[-1])
    return pooled, emits


# ============================================================================ Triton
@triton.jit
def _online_combine(mx_a, den_a, acc_a, mx_b, den_b, acc_b):
    """``online_combine`` in a kernel (max -inf: an empty set)."""
    mx = tl.maximum(mx_a, mx_b)
    ref = tl.where(mx == float("-inf"), 0.0, mx)  # (both empty: exp(-inf - 0) = 0, no inf - inf)
    fa = tl.exp(mx_a - ref)
    fb = tl.exp(mx_b - ref)
    return mx, den_a * fa + den_b * fb, acc_a * fa + acc_b * fb


@triton.jit
def _vec_flag(ch, flag):
    """A scalar condition as a [BLOCK_D] mask (the interpreter rejects masks made of a vector & a scalar)."""
    return (ch * 0 + flag.to(tl.int32)) != 0


@triton.jit
def _online_state_part(slot, t, p0, ch, chm, kvs_ptr, scs_ptr, st_ss, st_sr, spos_ptr, M: tl.constexpr):
    """The state's share of the chunk of position t for a step whose request starts at p0: nothing if the chunk
    begins in the step; else its prefix, combined with its raw row when that row is older than the step (a
    re-run of position p0 replaces it)."""
    c0 = t - t % M
    use = _vec_flag(ch, c0 < p0) & chm
    tag = tl.load(spos_ptr + slot).to(tl.int64)
    base = slot * st_ss + ch
    mx = tl.load(scs_ptr + base, mask=use, other=float("-inf"))
    den = tl.load(kvs_ptr + base + st_sr, mask=use, other=0.0)
    acc = tl.load(kvs_ptr + base, mask=use, other=0.0)
    # the raw row is loaded with the prefix (not masked by the tag: no round trip waits for the tag) and dropped after
    r_sc = tl.load(scs_ptr + base + st_sr, mask=use, other=float("-inf"))
    r_kv = tl.load(kvs_ptr + base + 2 * st_sr, mask=use, other=0.0)
    raw = use & _vec_flag(ch, (tag < p0) & (tag >= c0))
    r_sc = tl.where(raw, r_sc, float("-inf"))
    return _online_combine(mx, den, acc, r_sc, tl.where(raw, 1.0, 0.0), tl.where(raw, r_kv, 0.0))


@triton.jit
def _store_online_state(kvs_ptr, scs_ptr, base, st_sr, chm, mx, den, acc, sc_row, kv_row):
    """Write a slot's online state at ``base`` (= slot * st_ss + channels): the prefix (max, den, acc) and the newest
    row raw (the row layout ``_online_state_part`` reads: kv rows acc, den, raw kv; score rows max, raw score)."""
    tl.store(scs_ptr + base, mx, mask=chm)
    tl.store(kvs_ptr + base + st_sr, den, mask=chm)
    tl.store(kvs_ptr + base, acc, mask=chm)
    tl.store(scs_ptr + base + st_sr, sc_row, mask=chm)
    tl.store(kvs_ptr + base + 2 * st_sr, kv_row, mask=chm)


@triton.jit
def _store_pooled(pooled_ptr, i, ch, chm, mx, den, acc, sc_row, kv_row, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token i's pooled row: the prefix (max, den, acc) of its chunk combined with its own row, acc / den."""
    _, den, acc = _online_combine(mx, den, acc, sc_row, tl.full([BLOCK_D], 1.0, tl.float32), kv_row)
    tl.store(pooled_ptr + i * D + ch, acc / den, mask=chm)


@triton.jit
def _rows_in_step(j, p, jin, slot, i0, tslot_ptr, pos_ptr, ROW_LOADS: tl.constexpr):
    """Which candidate rows (batch index j, position p; ``jin``: j is a valid index) are this request's tokens in
    the step: with ``ROW_LOADS`` by loading their slots and positions, else by the step contract: j >= i0, the
    batch index of the request's first token in the step."""
    if ROW_LOADS:
        js = tl.load(tslot_ptr + j, mask=jin, other=-1).to(tl.int64)
        jp = tl.load(pos_ptr + j, mask=jin, other=-1).to(tl.int64)
        in_step = jin & (js == slot) & (jp == p)
    else:
        in_step = jin & (j >= i0)
    return in_step


@triton.jit
def _online_prefix(
    i, t, slot, ch, chm, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
    spos_ptr, M: tl.constexpr, BLOCK_R: tl.constexpr, i0=0, ROW_LOADS: tl.constexpr = True,
    FAST_EXP: tl.constexpr = False, INTERP: tl.constexpr = False, ape_ptr=None, HAS_APE: tl.constexpr = False,
    D: tl.constexpr = 1,
):  # fmt: skip
    """Online state, non-decode: the running softmax (max, den, acc) [BLOCK_D] of channels ``ch`` over the rows of
    token i's chunk *before* position t: those in this step combined with the state's share
    (``_online_state_part``, as it was before the step).  Which rows are in the step: with ``ROW_LOADS`` by loading
    their tokens' slots and positions, else from ``i0``, the batch index of the request's first token in the step
    (the caller's registers, as ``_pool_token``).  ``HAS_APE``: the step's score rows get ape row (position mod M)
    [D] added (the state's share holds score + ape already).

    The step's rows are folded into an empty running softmax (max -inf) before the state's share: the same values as
    taking their (max, den, acc) directly (exp(0) = 1, the empty side's factor exp(-inf) = 0), and with it sm_90
    ptxas gives the pool kernel 128 registers instead of 154 (V4-Flash HCA, Triton 3.6, ``sass_report.py``), so 4
    programs an SM as in the reference layout's (119) instead of 3."""
    k = 1 + tl.arange(0, BLOCK_R)  # row k: position t - k, batch index i - k if it is in this step
    p = t - k
    j = i - k
    jin = (k <= t % M) & (j >= 0)
    in_step = _rows_in_step(j, p, jin, slot, i0, tslot_ptr, pos_ptr, ROW_LOADS)
    m2 = in_step[:, None] & chm[None, :]
    kv_r = tl.load(kv_ptr + j[:, None] * stride_kv + ch[None, :], mask=m2, other=0.0)
    sc_r = tl.load(sc_ptr + j[:, None] * stride_sc + ch[None, :], mask=m2, other=float("-inf"))
    if HAS_APE:  # (the step's rows: positions p >= 0 where m2)
        sc_r += tl.load(ape_ptr + tl.where(p >= 0, p % M, 0)[:, None] * D + ch[None, :], mask=m2, other=0.0)
    mx_p = tl.max(sc_r, axis=0)
    ref = tl.where(mx_p == float("-inf"), 0.0, mx_p)
    e = tl.where(m2, _softmax_exp(sc_r, ref, FAST_EXP, INTERP), 0.0)
    empty = tl.full(ch.shape, float("-inf"), tl.float32)
    zero = tl.zeros(ch.shape, tl.float32)
    mx, den, acc = _online_combine(empty, zero, zero, mx_p, tl.sum(e, axis=0), tl.sum(e * kv_r, axis=0))
    p0 = t - tl.sum(in_step.to(tl.int64), axis=0)  # the request's first position in the step
    mx_s, den_s, acc_s = _online_state_part(slot, t, p0, ch, chm, kvs_ptr, scs_ptr, st_ss, st_sr, spos_ptr, M)
    return _online_combine(mx_s, den_s, acc_s, mx, den, acc)


@triton.jit
def _pool_token_online(
    i, t, slot, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
    spos_ptr, pooled_ptr, M: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, i0,
    ROW_LOADS: tl.constexpr, FAST_EXP: tl.constexpr = False, INTERP: tl.constexpr = False, ape_ptr=None,
    HAS_APE: tl.constexpr = False,
):  # fmt: skip
    """``_pool_token`` for an online state (non-decode): ``_online_prefix`` of the entry's chunk combined with the
    emitting token's own row, then acc / den (``HAS_APE`` as ``_pool_token``)."""
    ch = b * BLOCK_D + tl.arange(0, BLOCK_D)
    chm = ch < D
    mx, den, acc = _online_prefix(
        i, t, slot, ch, chm, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
        spos_ptr, M, BLOCK_R, i0, ROW_LOADS, FAST_EXP, INTERP, ape_ptr, HAS_APE, D,
    )  # fmt: skip
    kv_t = tl.load(kv_ptr + i * stride_kv + ch, mask=chm, other=0.0)
    sc_t = tl.load(sc_ptr + i * stride_sc + ch, mask=chm, other=0.0)
    if HAS_APE:
        sc_t += tl.load(ape_ptr + (t % M) * D + ch, mask=chm, other=0.0)
    _store_pooled(pooled_ptr, i, ch, chm, mx, den, acc, sc_t, kv_t, D, BLOCK_D)


_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp2_ftz(x, INTERP: tl.constexpr):
    """2^x elementwise, fp32: one ``ex2.approx.ftz.f32`` on a GPU (no denormal fix-up around it: results below
    2^-126 are 0), ``exp2`` under the interpreter."""
    if INTERP:
        return tl.math.exp2(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _softmax_exp(sc, ref, FAST_EXP: tl.constexpr, INTERP: tl.constexpr):
    """exp(sc - ref[None, :]) of a [rows, channels] score tile against its per-channel reference (max); ``FAST_EXP``:
    one FMA and one ``_exp2_ftz`` an element."""
    if FAST_EXP:
        return _exp2_ftz(sc * _LOG2E - (ref * _LOG2E)[None, :], INTERP)
    return tl.exp(sc - ref[None, :])


@triton.jit
def _pool_rows(
    i, t, slot, k, rmask, col, chm, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss,
    st_sr, T, M: tl.constexpr, CM: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr, DECODE: tl.constexpr, i0,
    ROW_LOADS: tl.constexpr, ape_ptr, HAS_APE: tl.constexpr,
):  # fmt: skip
    """``_pool_token``'s rows [BLOCK_R, BLOCK_D] (kv, score; absent rows 0 / -inf), each from this step's input or
    from the state ring."""
    p = t - CM + 1 + k  # positions of the pooled rows
    j = i - CM + 1 + k  # the batch index position p would have if it is in this step
    jin = rmask & (j >= 0) & (j < T)
    if DECODE:  # one token per request: only the token's own row (k = CM - 1, j = i) is in the step
        in_step = rmask & (k == CM - 1)
    else:
        in_step = _rows_in_step(j, p, jin, slot, i0, tslot_ptr, pos_ptr, ROW_LOADS)
    from_state = rmask & (in_step == 0) & (p >= 0)
    m_any = (in_step | from_state)[:, None] & chm[None, :]
    if (CM & (CM - 1)) == 0:  # (c*m a power of two: the same row as p % CM for p >= 0, fewer instructions)
        row = tl.where(p >= 0, p & (CM - 1), 0)
    else:
        row = tl.where(p >= 0, p % CM, 0)
    in_kv = j[:, None] * stride_kv + col
    in_sc = j[:, None] * stride_sc + col
    st_off = slot * st_ss + row[:, None] * st_sr + col
    sel = in_step[:, None]
    # one load per tensor: each row's pointer is into this step's input or into the state ring (the select
    # depends on the row only, so the pointers stay contiguous along the channels: wide loads)
    kv_r = tl.load(tl.where(sel, kv_ptr + in_kv, kvs_ptr + st_off), mask=m_any, other=0.0)
    sc_r = tl.load(tl.where(sel, sc_ptr + in_sc, scs_ptr + st_off), mask=m_any, other=float("-inf"))
    if HAS_APE:  # (ape rows are [c*d] wide, contiguous): added to this step's rows (the state's include it)
        cd = 2 * D if OVERLAP else D
        if DECODE:  # the one row of the step is the token's own (position t)
            sc_r += tl.load(ape_ptr + (t % M) * cd + col, mask=sel & chm[None, :], other=0.0)
        else:
            prow = tl.where(p >= 0, p % M, 0)
            sc_r += tl.load(ape_ptr + prow[:, None] * cd + col, mask=sel & chm[None, :], other=0.0)
    return kv_r, sc_r


@triton.jit
def _step_rows(
    i, k, rmask, col, chm, kv_ptr, sc_ptr, stride_kv, stride_sc, CM: tl.constexpr, t=0, ape_ptr=None,
    HAS_APE: tl.constexpr = False, M: tl.constexpr = 1, CD: tl.constexpr = 1,
):  # fmt: skip
    """kv / score tiles [BLOCK_R, BLOCK_D] of the entry completed by token i when all its rows i-CM+1 .. i are this
    step's: one 64-bit base a tensor, 32-bit offsets from it (rows k < CM; the caller keeps stride * CM < 2^31).
    ``HAS_APE``: ape row (position mod M) [CD] added to each score row (token i at position t)."""
    j0 = i - CM + 1
    m2 = rmask[:, None] & chm[None, :]
    kv_r = tl.load((kv_ptr + j0 * stride_kv) + (k[:, None] * stride_kv + col), mask=m2, other=0.0)
    sc_r = tl.load((sc_ptr + j0 * stride_sc) + (k[:, None] * stride_sc + col), mask=m2, other=float("-inf"))
    if HAS_APE:
        sc_r += tl.load(ape_ptr + ((t - CM + 1 + k) % M)[:, None] * CD + col, mask=m2, other=0.0)
    return kv_r, sc_r


@triton.jit
def _pool_token(
    i,
    t,
    slot,
    b,
    kv_ptr,
    sc_ptr,
    stride_kv,
    stride_sc,
    pos_ptr,
    tslot_ptr,
    kvs_ptr,
    scs_ptr,
    st_ss,
    st_sr,
    pooled_ptr,
    T,
    M: tl.constexpr,
    CM: tl.constexpr,
    D: tl.constexpr,
    OVERLAP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DECODE: tl.constexpr,
    i0=0,
    ROW_LOADS: tl.constexpr = True,
    ape_ptr=None,
    HAS_APE: tl.constexpr = False,
    DIV_AFTER: tl.constexpr = False,
    FAST_ROWS: tl.constexpr = False,
    FAST_EXP: tl.constexpr = False,
    INTERP: tl.constexpr = False,
    ROWS_IN_STEP: tl.constexpr = False,
    STORE: tl.constexpr = True,
):
    """Pool channels [b*BLOCK_D, ...) of the entry completed by token i (position t, state slot ``slot``): returns
    them ([BLOCK_D] fp32) and, with ``STORE``, writes them to ``pooled_ptr`` row i.

    Which of the pooled rows come from this step (non-decode): with ``ROW_LOADS`` by loading the slots and
    positions of their candidate tokens (a dependent round trip before the bulk loads); otherwise from
    ``i0``, the batch index of the request's first token in the step, which the caller found in registers:
    by the step contract row j is in the step iff j >= i0.  ``HAS_APE``: the step's score rows are ``wgate(x)``
    without ape; ``ape_ptr`` [M, C*D] fp32 row ``position mod M`` is added to each of them here (the state's rows
    hold score + ape already).

    Fewer instructions a row (the HCA pool is issue-bound, ``_POOL_DIV_AFTER_MIN``'s note): ``DIV_AFTER`` divides
    once a channel; ``FAST_ROWS`` (non-decode, not ``ROW_LOADS``) loads an entry whose rows are all in the step
    without the per-row select between step and state pointers; ``FAST_EXP`` takes exp as one FMA and one
    ``ex2.approx.ftz`` (``_exp2_ftz``: weights below 2^-126 of the channel's largest flush to 0).  ``ROWS_IN_STEP``:
    the caller knows every pooled row is this step's (the online pool's whole-chunk entries), so only the fast
    loads are compiled (no state pointers, no branch)."""
    k = tl.arange(0, BLOCK_R)
    rmask = k < CM
    ch = b * BLOCK_D + tl.arange(0, BLOCK_D)
    chm = ch < D
    if OVERLAP:
        coff = (k >= M).to(tl.int32) * D  # (a multiply, not a select: keeps the divisibility of D)
    else:
        coff = tl.zeros([BLOCK_R], tl.int32)
    col = coff[:, None] + ch[None, :]
    CD: tl.constexpr = 2 * D if OVERLAP else D
    if ROWS_IN_STEP:
        kv_r, sc_r = _step_rows(
            i, k, rmask, col, chm, kv_ptr, sc_ptr, stride_kv, stride_sc, CM, t, ape_ptr, HAS_APE, M, CD
        )
    else:
        fast = False
        if FAST_ROWS:
            fast = (i0 <= i - CM + 1) & (t >= CM - 1)  # every pooled row is this step's, none before position 0
        if fast:
            kv_r, sc_r = _step_rows(
                i, k, rmask, col, chm, kv_ptr, sc_ptr, stride_kv, stride_sc, CM, t, ape_ptr, HAS_APE, M, CD
            )
        else:
            kv_r, sc_r = _pool_rows(
                i, t, slot, k, rmask, col, chm, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr,
                scs_ptr, st_ss, st_sr, T, M, CM, D, OVERLAP, DECODE, i0, ROW_LOADS, ape_ptr, HAS_APE,
            )  # fmt: skip
    mx = tl.max(sc_r, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # all-absent (padding) channels: no inf - inf
    e = _softmax_exp(sc_r, mx, FAST_EXP, INTERP)
    den = tl.sum(e, axis=0)
    if DIV_AFTER:  # one division a channel, after the sum (_POOL_DIV_AFTER_MIN)
        out = tl.sum(kv_r * e, axis=0) / tl.where(den == 0.0, 1.0, den)
    else:
        out = tl.sum(kv_r * (e / tl.where(den == 0.0, 1.0, den)[None, :]), axis=0)
    if STORE:
        tl.store(pooled_ptr + i * D + ch, out, mask=chm)
    return out


@triton.jit
def _decode_pool_write(
    i, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots,
    pooled_ptr, emits_ptr, T, M: tl.constexpr, CM: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr,
    C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ape_ptr=None, HAS_APE: tl.constexpr = False,
):  # fmt: skip
    """decode=True, token i, channel block b: pool (if i emits) and write its own state row (``HAS_APE``:
    ``sc_ptr`` rows are wgate(x) and ape row t mod M [C*D] is added, as ``_pool_token``).  Returns
    (pooled: whether this program pooled a channel block of an entry, the token's state slot).

    One launch is safe because every request has one token: its write (row t mod c*m, which held
    position t - c*m) never touches a row that a pooling of this step reads."""
    t = tl.load(pos_ptr + i).to(tl.int64)
    slot = tl.load(tslot_ptr + i).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < num_state_slots)
    emit = ((t + 1) % M) == 0
    if b == 0:
        tl.store(emits_ptr + i, emit.to(tl.uint8))
    pooled = emit & slot_ok & (b * BLOCK_D < D)
    if pooled:
        _pool_token(
            i, t, slot, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
            pooled_ptr, T, M, CM, D, OVERLAP, BLOCK_R, BLOCK_D, True, 0, True, ape_ptr, HAS_APE,
        )  # fmt: skip
    jn = i + CM
    later = jn < T
    js2 = tl.load(tslot_ptr + jn, mask=later, other=-1).to(tl.int64)
    jp2 = tl.load(pos_ptr + jn, mask=later, other=-1).to(tl.int64)
    superseded = later & (js2 == slot) & (jp2 == t + CM)
    if slot_ok & (superseded == 0) & (t >= 0) & (b * BLOCK_D < C * D):
        wch = b * BLOCK_D + tl.arange(0, BLOCK_D)
        wm = wch < C * D
        dst = slot * st_ss + (t % CM) * st_sr + wch
        tl.store(kvs_ptr + dst, tl.load(kv_ptr + i * stride_kv + wch, mask=wm), mask=wm)
        sc_own = tl.load(sc_ptr + i * stride_sc + wch, mask=wm)
        if HAS_APE:
            sc_own += tl.load(ape_ptr + (t % M) * (C * D) + wch, mask=wm)
        tl.store(scs_ptr + dst, sc_own, mask=wm)
    return pooled, slot


@triton.jit
def _decode_online(
    i, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots,
    spos_ptr, pooled_ptr, emits_ptr, M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ape_ptr=None,
    HAS_APE: tl.constexpr = False,
):  # fmt: skip
    """``_decode_pool_write`` for an online state, one program a token over all D channels (BLOCK_D >= D: the
    program reads its slot's ``state_pos`` before it writes it): the prefix of token i's chunk before position t
    (``_online_state_part`` with p0 = t) becomes the state's prefix, the token's row its raw row, t its position;
    an emitting token stores prefix + row as acc / den.  Returns (pooled, slot) as ``_decode_pool_write``."""
    t = tl.load(pos_ptr + i).to(tl.int64)
    slot = tl.load(tslot_ptr + i).to(tl.int64)
    work = (slot >= 0) & (slot < num_state_slots) & (t >= 0)
    emit = ((t + 1) % M) == 0
    if b == 0:
        tl.store(emits_ptr + i, emit.to(tl.uint8))
    ch = b * BLOCK_D + tl.arange(0, BLOCK_D)
    chm = ch < D
    if work:
        kv_o = tl.load(kv_ptr + i * stride_kv + ch, mask=chm, other=0.0)
        sc_o = tl.load(sc_ptr + i * stride_sc + ch, mask=chm, other=0.0)
        if HAS_APE:
            sc_o += tl.load(ape_ptr + (t % M) * D + ch, mask=chm, other=0.0)
        mx, den, acc = _online_state_part(slot, t, t, ch, chm, kvs_ptr, scs_ptr, st_ss, st_sr, spos_ptr, M)
        tl.debug_barrier()  # every thread has read the state (and state_pos) before any writes it
        _store_online_state(kvs_ptr, scs_ptr, slot * st_ss + ch, st_sr, chm, mx, den, acc, sc_o, kv_o)
        tl.store(spos_ptr + slot, t.to(tl.int32))
        if emit:
            _store_pooled(pooled_ptr, i, ch, chm, mx, den, acc, sc_o, kv_o, D, BLOCK_D)
    return emit & work & (b * BLOCK_D < D), slot


@triton.jit
def _compressor_decode_kernel(
    kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots,
    pooled_ptr, emits_ptr, T, spos_ptr, M: tl.constexpr, CM: tl.constexpr, D: tl.constexpr,
    OVERLAP: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ONLINE: tl.constexpr = False,
    ape_ptr=None, HAS_APE: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """decode=True, program (token i, channel block b): ``_decode_pool_write`` (``ONLINE``: ``_decode_online``;
    ``spos_ptr``: its ``state_pos``, unused otherwise; ``HAS_APE``: ``ape_ptr`` added to the score rows)."""
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    if ONLINE:
        _decode_online(
            i, tl.program_id(1), kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss,
            st_sr, num_state_slots, spos_ptr, pooled_ptr, emits_ptr, M, D, BLOCK_D, ape_ptr, HAS_APE,
        )  # fmt: skip
    else:
        _decode_pool_write(
            i, tl.program_id(1), kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss,
            st_sr, num_state_slots, pooled_ptr, emits_ptr, T, M, CM, D, OVERLAP, C, BLOCK_R, BLOCK_D, ape_ptr, HAS_APE,
        )  # fmt: skip


@triton.jit
def _last_arrival(pooled, cnt_ptr, slot, N_POOL: tl.constexpr):
    """Whether this program is the last of the N_POOL channel-block programs of its entry to finish pooling
    (``pooled``: this program pooled one): ``last_arrival`` on the entry's counter ``cnt_ptr[slot]`` (int32,
    the state slot's: one token per slot in a decode step), so the last one observes every other program's
    pooled values; the counters start and end each launch at 0.  N_POOL = 1: no atomics, a CTA barrier (the
    emit reads back values other threads of this program stored)."""
    if N_POOL == 1:
        tl.debug_barrier()
        last = pooled
    else:
        last = pooled & False
        if pooled:
            last = last_arrival(cnt_ptr + slot, N_POOL)
    return last


@triton.jit
def _decode_emit_main(
    i, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots,
    pooled_ptr, emits_ptr, T, cnt_ptr, ape_ptr, spos_ptr, w_ptr, eps, inv_ptr, eslot_ptr, num_slots, bs, nope_ptr,
    nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp, scale_sr, M: tl.constexpr, CM: tl.constexpr,
    D: tl.constexpr, OVERLAP: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    N_POOL: tl.constexpr, INTERP: tl.constexpr, NOPE: tl.constexpr, NT: tl.constexpr, NT_PAD: tl.constexpr,
    TILE: tl.constexpr, HR: tl.constexpr, FLOOR: tl.constexpr, QMAX: tl.constexpr, Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr, VEC_RUNS: tl.constexpr, HAS_APE: tl.constexpr, ONLINE: tl.constexpr,
):  # fmt: skip
    """Program (token i, channel block b) of a main compressor's decode step: ``_decode_pool_write`` (``ONLINE``:
    ``_decode_online``), then the last channel-block program of each emitting token (``_last_arrival``) reads the
    token's pooled row back and emits its FP8 entry (``_norm_rope_rows``: RMSNorm -> RoPE at the entry position ->
    quantise -> store)."""
    if ONLINE:
        pooled, slot = _decode_online(
            i, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
            num_state_slots, spos_ptr, pooled_ptr, emits_ptr, M, D, BLOCK_D, ape_ptr, HAS_APE,
        )  # fmt: skip
    else:
        pooled, slot = _decode_pool_write(
            i, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
            num_state_slots, pooled_ptr, emits_ptr, T, M, CM, D, OVERLAP, C, BLOCK_R, BLOCK_D, ape_ptr, HAS_APE,
        )  # fmt: skip
    if _last_arrival(pooled, cnt_ptr, slot, N_POOL):
        noff, tin, roff, rin = _fp8_row_offsets(D, NOPE, NT, NT_PAD, TILE, HR, VEC_RUNS)
        ii = i + tl.arange(0, 1)
        go = ii >= 0
        xrow = pooled_ptr + ii * D
        xn = tl.load(xrow[:, None, None] + noff, mask=tin, other=0.0)
        xr = tl.load(xrow[:, None, None] + roff, mask=rin, other=0.0)
        _norm_rope_rows(
            xn, xr, ii, go, w_ptr, eps, pos_ptr, inv_ptr, eslot_ptr, num_slots, bs, pooled_ptr, 0, nope_ptr, nope_sp,
            nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp, scale_sr, noff, tin, roff, M, False, INTERP,
            1, D, NOPE, NT, NT_PAD, TILE, HR, FLOOR, QMAX, Q_EXP, Q_MANT,
        )  # fmt: skip


@triton.jit
def _compressor_decode_emit_main_kernel(
    kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots,
    pooled_ptr, emits_ptr, T, cnt_ptr, ape_ptr, spos_ptr, w_ptr, eps, inv_ptr, eslot_ptr, num_slots, bs, nope_ptr,
    nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp, scale_sr, M: tl.constexpr, CM: tl.constexpr,
    D: tl.constexpr, OVERLAP: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    N_POOL: tl.constexpr, INTERP: tl.constexpr, NOPE: tl.constexpr, NT: tl.constexpr, NT_PAD: tl.constexpr,
    TILE: tl.constexpr, HR: tl.constexpr, FLOOR: tl.constexpr, QMAX: tl.constexpr, Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr, VEC_RUNS: tl.constexpr, HAS_APE: tl.constexpr = False, ONLINE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Decode step of a main compressor in one launch, programs (token, channel block): ``_decode_emit_main``."""
    pdl_enter(PDL)
    _decode_emit_main(
        tl.program_id(0).to(tl.int64), tl.program_id(1), kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr,
        kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots, pooled_ptr, emits_ptr, T, cnt_ptr, ape_ptr, spos_ptr, w_ptr,
        eps, inv_ptr, eslot_ptr, num_slots, bs, nope_ptr, nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr,
        scale_sp, scale_sr, M, CM, D, OVERLAP, C, BLOCK_R, BLOCK_D, N_POOL, INTERP, NOPE, NT, NT_PAD, TILE, HR, FLOOR,
        QMAX, Q_EXP, Q_MANT, VEC_RUNS, HAS_APE, ONLINE,
    )  # fmt: skip


@triton.jit
def _decode_emit_indexer(
    i, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots,
    pooled_ptr, emits_ptr, T, cnt_ptr, ape_ptr, spos_ptr, w_ptr, eps, inv_ptr, eslot_ptr, num_slots, bs, data_ptr,
    data_sp, data_sr, scale_ptr, scale_sp, scale_sr, M: tl.constexpr, CM: tl.constexpr, D: tl.constexpr,
    OVERLAP: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, N_POOL: tl.constexpr,
    INTERP: tl.constexpr, NOPE: tl.constexpr, HR: tl.constexpr, HAD_SCALE: tl.constexpr, KB: tl.constexpr,
    NA: tl.constexpr, RA: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr, FLOOR: tl.constexpr, Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr, HAS_APE: tl.constexpr,
):  # fmt: skip
    """``_decode_emit_main`` for the CSA indexer's compressor: the emit is ``_emit_indexer_rows`` (RMSNorm -> RoPE ->
    Hadamard -> MXFP4 key)."""
    pooled, slot = _decode_pool_write(
        i, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
        num_state_slots, pooled_ptr, emits_ptr, T, M, CM, D, OVERLAP, C, BLOCK_R, BLOCK_D, ape_ptr, HAS_APE,
    )  # fmt: skip
    if _last_arrival(pooled, cnt_ptr, slot, N_POOL):
        ii = i + tl.arange(0, 1)
        sl = tl.load(eslot_ptr + ii).to(tl.int64)
        work = (sl >= 0) & (sl < num_slots)
        _emit_indexer_rows(
            pooled_ptr, D, ii, work, sl, w_ptr, eps, pos_ptr, inv_ptr, M, bs, data_ptr, data_sp, data_sr, scale_ptr,
            scale_sp, scale_sr, INTERP, 1, D, NOPE, HR, HAD_SCALE, KB, NA, RA, NB, HB, FLOOR, Q_EXP, Q_MANT,
        )  # fmt: skip


@triton.jit
def _compressor_decode_emit_indexer_kernel(
    kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots,
    pooled_ptr, emits_ptr, T, cnt_ptr, ape_ptr, spos_ptr, w_ptr, eps, inv_ptr, eslot_ptr, num_slots, bs, data_ptr,
    data_sp, data_sr, scale_ptr, scale_sp, scale_sr, M: tl.constexpr, CM: tl.constexpr, D: tl.constexpr,
    OVERLAP: tl.constexpr, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, N_POOL: tl.constexpr,
    INTERP: tl.constexpr, NOPE: tl.constexpr, HR: tl.constexpr, HAD_SCALE: tl.constexpr, KB: tl.constexpr,
    NA: tl.constexpr, RA: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr, FLOOR: tl.constexpr, Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr, HAS_APE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Decode step of the CSA indexer's compressor in one launch: ``_decode_emit_indexer``."""
    pdl_enter(PDL)
    _decode_emit_indexer(
        tl.program_id(0).to(tl.int64), tl.program_id(1), kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr,
        kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots, pooled_ptr, emits_ptr, T, cnt_ptr, ape_ptr, spos_ptr, w_ptr,
        eps, inv_ptr, eslot_ptr, num_slots, bs, data_ptr, data_sp, data_sr, scale_ptr, scale_sp, scale_sr, M, CM, D,
        OVERLAP, C, BLOCK_R, BLOCK_D, N_POOL, INTERP, NOPE, HR, HAD_SCALE, KB, NA, RA, NB, HB, FLOOR, Q_EXP, Q_MANT,
        HAS_APE,
    )  # fmt: skip


@triton.jit
def _compressor_decode_emit_csa_kernel(
    kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots,
    pooled_ptr, emits_ptr, T, cnt_ptr, ape_ptr, spos_ptr, w_ptr, eps, inv_ptr, eslot_ptr, num_slots, bs, nope_ptr,
    nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp, scale_sr,
    i_kv_ptr, i_sc_ptr, i_stride_kv, i_stride_sc, i_pos_ptr, i_tslot_ptr, i_kvs_ptr, i_scs_ptr, i_st_ss, i_st_sr,
    i_num_state_slots, i_pooled_ptr, i_emits_ptr, i_T, i_cnt_ptr, i_ape_ptr, i_spos_ptr, i_w_ptr, i_eps, i_inv_ptr,
    i_eslot_ptr, i_num_slots, i_bs, data_ptr, data_sp, data_sr, i_scale_ptr, i_scale_sp, i_scale_sr,
    NB_MAIN: tl.constexpr, M: tl.constexpr, CM: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr, C: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, N_POOL: tl.constexpr, INTERP: tl.constexpr, NOPE: tl.constexpr,
    NT: tl.constexpr, NT_PAD: tl.constexpr, TILE: tl.constexpr, HR: tl.constexpr, FLOOR: tl.constexpr,
    QMAX: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr, VEC_RUNS: tl.constexpr, HAS_APE: tl.constexpr,
    I_D: tl.constexpr, I_BLOCK_D: tl.constexpr, I_N_POOL: tl.constexpr, I_NOPE: tl.constexpr, I_HR: tl.constexpr,
    HAD_SCALE: tl.constexpr, KB: tl.constexpr, NA: tl.constexpr, RA: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr,
    I_FLOOR: tl.constexpr, I_Q_EXP: tl.constexpr, I_Q_MANT: tl.constexpr, I_HAS_APE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """A CSA layer's two compressors' decode steps in one launch (``compress_decode_csa``): programs (token, channel
    block b), b < NB_MAIN the main compressor's ``_decode_emit_main`` (its args first), the others the indexer
    compressor's ``_decode_emit_indexer`` at block b - NB_MAIN (its args ``i_*`` / ``I_*``; M, CM, OVERLAP, C,
    BLOCK_R, INTERP shared: one ratio).  Each keeps its own counters, state and outputs: the same bytes as the two
    launches."""
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    if b < NB_MAIN:
        _decode_emit_main(
            i, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
            num_state_slots, pooled_ptr, emits_ptr, T, cnt_ptr, ape_ptr, spos_ptr, w_ptr, eps, inv_ptr, eslot_ptr,
            num_slots, bs, nope_ptr, nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp, scale_sr, M, CM,
            D, OVERLAP, C, BLOCK_R, BLOCK_D, N_POOL, INTERP, NOPE, NT, NT_PAD, TILE, HR, FLOOR, QMAX, Q_EXP, Q_MANT,
            VEC_RUNS, HAS_APE, False,
        )  # fmt: skip
    else:
        _decode_emit_indexer(
            i, b - NB_MAIN, i_kv_ptr, i_sc_ptr, i_stride_kv, i_stride_sc, i_pos_ptr, i_tslot_ptr, i_kvs_ptr, i_scs_ptr,
            i_st_ss, i_st_sr, i_num_state_slots, i_pooled_ptr, i_emits_ptr, i_T, i_cnt_ptr, i_ape_ptr, i_spos_ptr,
            i_w_ptr, i_eps, i_inv_ptr, i_eslot_ptr, i_num_slots, i_bs, data_ptr, data_sp, data_sr, i_scale_ptr,
            i_scale_sp, i_scale_sr, M, CM, I_D, OVERLAP, C, BLOCK_R, I_BLOCK_D, I_N_POOL, INTERP, I_NOPE, I_HR,
            HAD_SCALE, KB, NA, RA, NB, HB, I_FLOOR, I_Q_EXP, I_Q_MANT, I_HAS_APE,
        )  # fmt: skip


@triton.jit
def _pool_block_head(
    a, b, T, pos_ptr, tslot_ptr, emits_ptr, num_state_slots, M: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr, ROW_LOADS: tl.constexpr, EMITS: tl.constexpr,
):  # fmt: skip
    """Token block a of a pool program: positions ``tt`` and state slots ``ss`` (int64) [BLOCK_T], unless
    ``ROW_LOADS`` the BLOCK_R tokens before the block (``_tokens_before``: ``tp``, ``sp``; else ``tt``, ``ss`` again,
    unused), and which tokens to pool (``work``: they complete an entry and have a state slot).  ``EMITS``: channel
    block b == 0 also writes the block's ``emits`` flags."""
    ii = a * BLOCK_T + tl.arange(0, BLOCK_T)
    im = ii < T
    tt = tl.load(pos_ptr + ii, mask=im, other=0).to(tl.int64)
    ss = tl.load(tslot_ptr + ii, mask=im, other=-1).to(tl.int64)
    if not ROW_LOADS:
        tp, sp = _tokens_before(a, pos_ptr, tslot_ptr, BLOCK_T, BLOCK_R)
    else:
        tp, sp = tt, ss
    ee = ((tt + 1) % M) == 0
    if EMITS:
        if b == 0:
            tl.store(emits_ptr + ii, ee.to(tl.uint8), mask=im)
    work = im & ee & (ss >= 0) & (ss < num_state_slots)
    return tt, ss, tp, sp, work


@triton.jit
def _pool_block_token(a, k, kk, tt, ss, tp, sp, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, ROW_LOADS: tl.constexpr):
    """Token k of block a (``_pool_block_head``'s registers): its position, state slot, and (unless ``ROW_LOADS``)
    the batch index of its request's first token in the step (``_run_start``; with ``ROW_LOADS`` the token's own
    index, unused)."""
    t, slot = _token_at(kk, k, tt, ss)
    i0 = a * BLOCK_T + k
    if not ROW_LOADS:
        i0 = _run_start(a, k, kk, tt, ss, tp, sp, t, slot, BLOCK_T, BLOCK_R)
    return t, slot, i0


@triton.jit
def _compressor_pool_kernel(
    kv_ptr,
    sc_ptr,
    stride_kv,
    stride_sc,
    pos_ptr,
    tslot_ptr,
    kvs_ptr,
    scs_ptr,
    st_ss,
    st_sr,
    num_state_slots,
    pooled_ptr,
    emits_ptr,
    T,
    spos_ptr,
    M: tl.constexpr,
    CM: tl.constexpr,
    D: tl.constexpr,
    OVERLAP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROW_LOADS: tl.constexpr = False,
    ONLINE: tl.constexpr = False,
    DIV_AFTER: tl.constexpr = False,
    FAST_ROWS: tl.constexpr = False,
    FAST_EXP: tl.constexpr = False,
    INTERP: tl.constexpr = False,
    ONLINE_ROWS_IN_STEP: tl.constexpr = False,
    ape_ptr=None,
    HAS_APE: tl.constexpr = False,
    PDL: tl.constexpr = False,
    WRITE_STATE: tl.constexpr = False,
    cnt_ptr=None,
    N_CB: tl.constexpr = 1,
):
    """Program (token block a, channel block b): write ``emits`` of tokens [a*BLOCK_T, ...) (b == 0) and
    pool channels [b*BLOCK_D, ...) of each emitting token with a state slot, one after another (visiting
    only those: their positions / slots are taken from the block's registers, no per-token loads).  A
    block without such a token exits after one vector load of its positions and slots.

    Unless ``ROW_LOADS``, the same first load also takes the positions / slots of the BLOCK_R tokens before
    the block, and each emitting token's request start i0 (``_pool_token``) is found from these registers:
    the first index of the run of tokens ending at the token with the same slot and consecutive positions
    (the step contract makes it the request's first token of the step, or the run reaches back past every
    row the pooling needs).  ``ONLINE_ROWS_IN_STEP`` (online, not ``ROW_LOADS``): an entry that does not combine the
    state has, by that test, all its rows in the step (for HCA, t + 1 = 0 mod m, so none before position 0), so it
    is pooled by the fast loads alone, without the state-reading path compiled beside them (``_pool_token``'s
    ``ROWS_IN_STEP``).  ``WRITE_STATE`` (only where no pooling of the step reads a state row, which the caller
    vouches for: ``compressor_step(state_unread=True)``): then the program also writes the state rows of its block's
    writing tokens, channel block b of each half (``_pool_block_state_write``); with an online state, the state of
    each request whose last token of the step is in its block (``_online_write_block`` over the N_CB channel blocks,
    the positions by the last arrival on ``cnt_ptr``)."""
    pdl_enter(PDL)
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    tt, ss, tp, sp, work = _pool_block_head(
        a, b, T, pos_ptr, tslot_ptr, emits_ptr, num_state_slots, M, BLOCK_T, BLOCK_R, ROW_LOADS, True
    )
    if WRITE_STATE and not ONLINE:  # (loaded before the pooling, so their round trip overlaps it: used after it)
        w_ii = a * BLOCK_T + tl.arange(0, BLOCK_T)
        w_tt, w_ss, w_wr = _state_writers(w_ii, T, CM, pos_ptr, tslot_ptr, num_state_slots)
    kk = tl.arange(0, BLOCK_T)
    # visit the emitting tokens only; their position / slot come from the registers loaded above
    k = tl.min(tl.where(work, kk, BLOCK_T), axis=0)
    while k < BLOCK_T:
        t, slot, i0 = _pool_block_token(a, k, kk, tt, ss, tp, sp, BLOCK_T, BLOCK_R, ROW_LOADS)
        # online: a chunk whose rows are all in the step pools as the ring does (touching no state); one that began
        # before the step combines the state's share (``_pool_token_online``)
        partial = ONLINE and (i0 > a * BLOCK_T + k - t % M)
        if partial:
            _pool_token_online(
                a * BLOCK_T + k, t, slot, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr,
                scs_ptr, st_ss, st_sr, spos_ptr, pooled_ptr, M, D, BLOCK_R, BLOCK_D, i0, ROW_LOADS, FAST_EXP, INTERP,
                ape_ptr, HAS_APE,
            )  # fmt: skip
        else:
            _pool_token(
                a * BLOCK_T + k, t, slot, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr,
                scs_ptr, st_ss, st_sr, pooled_ptr, T, M, CM, D, OVERLAP, BLOCK_R, BLOCK_D, False, i0, ROW_LOADS,
                ape_ptr, HAS_APE, DIV_AFTER, FAST_ROWS and not ROW_LOADS, FAST_EXP, INTERP,
                ONLINE and ONLINE_ROWS_IN_STEP and not ROW_LOADS,
            )  # fmt: skip
        k = tl.min(tl.where(work & (kk > k), kk, BLOCK_T), axis=0)
    if WRITE_STATE:
        if ONLINE:
            _online_write_block(
                a, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
                num_state_slots, T, spos_ptr, cnt_ptr, M, D, BLOCK_T, BLOCK_R, BLOCK_D, FAST_EXP, INTERP, N_CB, True,
                ape_ptr, HAS_APE, False,
            )  # fmt: skip
        else:
            _pool_block_state_write(
                a, b, w_tt, w_ss, w_wr, kv_ptr, sc_ptr, stride_kv, stride_sc, kvs_ptr, scs_ptr, st_ss, st_sr, M, CM, D,
                2 if OVERLAP else 1, BLOCK_T, BLOCK_D, ape_ptr, HAS_APE,
            )  # fmt: skip


@triton.jit
def _pool_block_state_write(
    a, b, tt, ss, wr, kv_ptr, sc_ptr, stride_kv, stride_sc, kvs_ptr, scs_ptr, st_ss, st_sr, M: tl.constexpr,
    CM: tl.constexpr, D: tl.constexpr, C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ape_ptr,
    HAS_APE: tl.constexpr,
):  # fmt: skip
    """The state write of ``_compressor_write_kernel`` for tokens [a*BLOCK_T, ...) (their positions ``tt``, slots
    ``ss`` and which write, ``wr``: ``_state_writers``), channels [b*BLOCK_D, ...) of each of the C halves
    [h*D, (h+1)*D) of a row (kv; score + ape row position mod M where ``HAS_APE``), to row t mod CM of the token's
    state slot.  A block without a writing token stores nothing."""
    ii = a * BLOCK_T + tl.arange(0, BLOCK_T)
    if tl.sum(wr.to(tl.int32), axis=0) > 0:
        cb = b * BLOCK_D + tl.arange(0, BLOCK_D)
        m = wr[:, None] & (cb < D)[None, :]
        dst = tl.where(wr, ss.to(tl.int64) * st_ss + (tt.to(tl.int64) % CM) * st_sr, 0)
        for h in tl.static_range(C):
            ch = h * D + cb
            kv = tl.load(kv_ptr + ii[:, None] * stride_kv + ch[None, :], mask=m)
            sc = tl.load(sc_ptr + ii[:, None] * stride_sc + ch[None, :], mask=m)
            if HAS_APE:  # the state keeps score + ape ([M, C*D] rows)
                arow = (tl.where(wr, tt, 0) % M).to(tl.int64) * (C * D)
                sc += tl.load(ape_ptr + arow[:, None] + ch[None, :], mask=m)
            tl.store(kvs_ptr + dst[:, None] + ch[None, :], kv, mask=m)
            tl.store(scs_ptr + dst[:, None] + ch[None, :], sc, mask=m)


@triton.jit
def _compressor_write_kernel(
    kv_ptr,
    sc_ptr,
    stride_kv,
    stride_sc,
    pos_ptr,
    tslot_ptr,
    kvs_ptr,
    scs_ptr,
    st_ss,
    st_sr,
    num_state_slots,
    T,
    CM: tl.constexpr,
    CD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    M: tl.constexpr = 1,
    ape_ptr=None,
    HAS_APE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Program a (token block): copy this step's rows [a*BLOCK_T, ...) into the state ring, masked to the
    tokens not superseded by a later token of their request (position t + c*m in this step), in [BLOCK_T,
    BLOCK_D] tiles over the channels (a compile-time loop: the channel mask folds away, wide accesses).  A
    block with no such token (in a prefill all but the request's last c*m tokens) exits after its index
    loads: one program per token block keeps the grid small.  ``HAS_APE``: the score rows are wgate(x) and get ape
    row (position mod M) added before they are stored.  PDL: the rows are loaded before the wait for the
    previous launch (the pool, which reads the state), the state stored after it (``_triton_sync``)."""
    a = tl.program_id(0).to(tl.int64)
    ii = a * BLOCK_T + tl.arange(0, BLOCK_T)
    tt, ss, wr = _state_writers(ii, T, CM, pos_ptr, tslot_ptr, num_state_slots)
    if tl.sum(wr.to(tl.int32), axis=0) > 0:
        src_kv = ii * stride_kv
        src_sc = ii * stride_sc
        # (the strides are multiples of 16 elements, as the launch checks; without the hint the select hides
        # it and the stores fall back to narrow accesses through a shared-memory layout conversion)
        dst = ss.to(tl.int64) * st_ss + (tt.to(tl.int64) % CM) * st_sr
        dst_row = tl.multiple_of(tl.where(wr, dst, 0), 16)
        # two channel blocks of both tensors a round: four loads in flight before the stores (the compiler keeps
        # a load after an earlier store in order, since the state may alias the input: one round trip a block of
        # one tensor made the writing program a chain of 2 * CD / BLOCK_D latencies)
        for c0 in tl.static_range(0, CD, 2 * BLOCK_D):
            ch0 = c0 + tl.arange(0, BLOCK_D)
            ch1 = ch0 + BLOCK_D
            m0 = wr[:, None] & (ch0 < CD)[None, :]
            m1 = wr[:, None] & (ch1 < CD)[None, :]
            kv0 = tl.load(kv_ptr + src_kv[:, None] + ch0[None, :], mask=m0)
            sc0 = tl.load(sc_ptr + src_sc[:, None] + ch0[None, :], mask=m0)
            kv1 = tl.load(kv_ptr + src_kv[:, None] + ch1[None, :], mask=m1)
            sc1 = tl.load(sc_ptr + src_sc[:, None] + ch1[None, :], mask=m1)
            if HAS_APE:  # the state keeps score + ape (row position mod M, [CD])
                arow = (tl.where(wr, tt, 0) % M).to(tl.int64) * CD
                sc0 += tl.load(ape_ptr + arow[:, None] + ch0[None, :], mask=m0)
                sc1 += tl.load(ape_ptr + arow[:, None] + ch1[None, :], mask=m1)
            pdl_enter(PDL)
            tl.store(kvs_ptr + dst_row[:, None] + ch0[None, :], kv0, mask=m0)
            tl.store(scs_ptr + dst_row[:, None] + ch0[None, :], sc0, mask=m0)
            tl.store(kvs_ptr + dst_row[:, None] + ch1[None, :], kv1, mask=m1)
            tl.store(scs_ptr + dst_row[:, None] + ch1[None, :], sc1, mask=m1)
    pdl_enter(PDL)


@triton.jit
def _state_writers(ii, T, CM: tl.constexpr, pos_ptr, tslot_ptr, num_state_slots):
    """Tokens ``ii``: (positions, slots, writes), positions and slots as int32 (positions < 2^31); ``writes``: which
    write their state row (row t mod c*m of slot s), i.e. have a state slot and are not superseded by position
    t + c*m of their request in this step (token i + c*m)."""
    im = ii < T
    tt = tl.load(pos_ptr + ii, mask=im, other=-1).to(tl.int32)
    ss = tl.load(tslot_ptr + ii, mask=im, other=-1).to(tl.int32)
    jn = ii + CM
    later = jn < T
    js = tl.load(tslot_ptr + jn, mask=later, other=-1).to(tl.int32)
    jp = tl.load(pos_ptr + jn, mask=later, other=-1).to(tl.int32)
    superseded = later & (js == ss) & (jp == tt + CM)
    return tt, ss, im & (ss >= 0) & (ss < num_state_slots) & (tt >= 0) & (superseded == 0)


@triton.jit
def _compressor_write_lanes_kernel(
    kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots, T,
    CM: tl.constexpr, CD: tl.constexpr, SUPER: tl.constexpr, SUB: tl.constexpr, LANES: tl.constexpr,
    BLOCK_D: tl.constexpr, M: tl.constexpr = 1, ape_ptr=None, HAS_APE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """``_compressor_write_kernel`` with fewer programs and one round trip a writing block: program (superblock g of
    SUPER tokens, lane w) finds which of the superblock's SUB-token blocks hold a writing token (one vector load of
    the SUPER tokens' positions and slots) and copies the w-th, (w + LANES)-th, ... of them ([SUB, BLOCK_D] tiles
    of both tensors, every channel block's loads before its stores).  A prefill's writers (its last c*m tokens)
    are thus spread over the lanes of one superblock while the other superblocks' programs exit.  PDL: as
    ``_compressor_write_kernel``, loads before the wait, stores after it."""
    g = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1)
    NS: tl.constexpr = SUPER // SUB
    _, _, wr = _state_writers(g * SUPER + tl.arange(0, SUPER), T, CM, pos_ptr, tslot_ptr, num_state_slots)
    f = tl.max(tl.reshape(wr.to(tl.int32), [NS, SUB]), axis=1)  # [NS]: the sub-block has a writer
    rank = tl.cumsum(f, axis=0) - f
    n = tl.sum(f, axis=0)
    sbi = tl.arange(0, NS)
    r = w
    while r < n:
        sb = tl.min(tl.where((f > 0) & (rank == r), sbi, NS), axis=0)
        jj = g * SUPER + sb * SUB + tl.arange(0, SUB)
        tt, ss, wj = _state_writers(jj, T, CM, pos_ptr, tslot_ptr, num_state_slots)  # (L2 hits)
        tt = tt.to(tl.int64)
        ss = ss.to(tl.int64)
        # (row strides are multiples of 16 elements, as the launch checks; the hint keeps the stores wide)
        dst_row = tl.multiple_of(tl.where(wj, ss * st_ss + (tt % CM) * st_sr, 0), 16)
        for c0 in tl.static_range(0, CD, BLOCK_D):
            ch = c0 + tl.arange(0, BLOCK_D)
            m = wj[:, None] & (ch < CD)[None, :]
            kv = tl.load(kv_ptr + jj[:, None] * stride_kv + ch[None, :], mask=m)
            sc = tl.load(sc_ptr + jj[:, None] * stride_sc + ch[None, :], mask=m)
            if HAS_APE:  # as ``_compressor_write_kernel``
                sc += tl.load(ape_ptr + ((tl.where(wj, tt, 0) % M).to(tl.int64) * CD)[:, None] + ch[None, :], mask=m)
            pdl_enter(PDL)
            tl.store(kvs_ptr + dst_row[:, None] + ch[None, :], kv, mask=m)
            tl.store(scs_ptr + dst_row[:, None] + ch[None, :], sc, mask=m)
        r += LANES
    pdl_enter(PDL)


@triton.jit
def _tokens_before(a, pos_ptr, tslot_ptr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    """Positions and slots [BLOCK_R] (int32, as positions < 2^31; -1 / -2 before token 0) of the BLOCK_R tokens
    before token block a."""
    pi = a * BLOCK_T - BLOCK_R + tl.arange(0, BLOCK_R)
    pm = pi >= 0
    tp = tl.load(pos_ptr + pi, mask=pm, other=-1).to(tl.int32)
    sp = tl.load(tslot_ptr + pi, mask=pm, other=-2).to(tl.int32)
    return tp, sp


@triton.jit
def _run_start(a, k, kk, tt, ss, tp, sp, t, slot, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    """Batch index of the first token of the run that ends at token k of block a (position t, slot ``slot``): the
    same slot at consecutive positions, from the block's registers ``tt`` / ``ss`` [BLOCK_T] and the BLOCK_R
    tokens before it (``_tokens_before``).  By the step contract it is the request's first token in the step, or
    the run reaches back past BLOCK_R tokens before the block."""
    # the run in the block (index kk holds position t - (k - kk)), then before it
    run = (kk <= k) & (ss == slot) & (tt == t - (k - kk))
    k0 = tl.min(tl.where(run, kk, k), axis=0)
    r = tl.arange(0, BLOCK_R)
    prun = (sp == slot) & (tp == t - (k + BLOCK_R - r))
    r0 = tl.min(tl.where(prun, r, BLOCK_R), axis=0)
    return tl.where(k0 > 0, a * BLOCK_T + k0, a * BLOCK_T - BLOCK_R + r0)


@triton.jit
def _token_at(kk, k, tt, ss):
    """(position, slot) of the block's token k, from the block's registers ``tt`` / ``ss`` [BLOCK_T]."""
    sel = kk == k
    return tl.sum(tl.where(sel, tt, 0), axis=0), tl.sum(tl.where(sel, ss, 0), axis=0)


@triton.jit
def _online_last_tokens(a, T, pos_ptr, tslot_ptr, num_state_slots, BLOCK_T: tl.constexpr):
    """Tokens [a*BLOCK_T, ...): positions, slots and which are their request's last in the step (the next token has
    another slot or is not the next position), with a state slot: ``_state_writers`` with a ring of one row (a
    token is superseded by its request's next position)."""
    return _state_writers(a * BLOCK_T + tl.arange(0, BLOCK_T), T, 1, pos_ptr, tslot_ptr, num_state_slots)


@triton.jit
def _compressor_online_write_kernel(
    kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots, T,
    spos_ptr, cnt_ptr, M: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, FAST_EXP: tl.constexpr = False, INTERP: tl.constexpr = False, N_CB: tl.constexpr = 1,
    POS_IN_WRITE: tl.constexpr = False, ape_ptr=None, HAS_APE: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Online state, non-decode, after the pool pass: program (token block a, channel block b) writes, for each
    token of [a*BLOCK_T, ...) that is its request's last in the step, its chunk's prefix (``_online_prefix``) and
    its own row as its slot's state.  The N_CB channel blocks of one request all read the old ``state_pos``; with
    ``POS_IN_WRITE`` the last of them to arrive on the slot's counter (``cnt_ptr``, int32, 0 before and after,
    ``_last_arrival``) then writes the new one, else the next launch does (``_online_pos_kernel``).  PDL: everything
    is loaded and computed before the wait for the previous launch (the pool, which reads the state), the state
    stored after it."""
    _online_write_block(
        tl.program_id(0).to(tl.int64), tl.program_id(1), kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr,
        kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots, T, spos_ptr, cnt_ptr, M, D, BLOCK_T, BLOCK_R, BLOCK_D,
        FAST_EXP, INTERP, N_CB, POS_IN_WRITE, ape_ptr, HAS_APE, PDL,
    )  # fmt: skip


@triton.jit
def _online_write_block(
    a, b, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots, T,
    spos_ptr, cnt_ptr, M: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, FAST_EXP: tl.constexpr, INTERP: tl.constexpr, N_CB: tl.constexpr,
    POS_IN_WRITE: tl.constexpr, ape_ptr, HAS_APE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (token block a, channel block b) of ``_compressor_online_write_kernel`` (its body; also run by the pool
    kernel's programs where they write the state, ``WRITE_STATE``)."""
    tt, ss, last = _online_last_tokens(a, T, pos_ptr, tslot_ptr, num_state_slots, BLOCK_T)
    tp, sp = _tokens_before(a, pos_ptr, tslot_ptr, BLOCK_T, BLOCK_R)
    ch = b * BLOCK_D + tl.arange(0, BLOCK_D)
    chm = ch < D
    kk = tl.arange(0, BLOCK_T)
    k = tl.min(tl.where(last, kk, BLOCK_T), axis=0)
    while k < BLOCK_T:
        t, slot = _token_at(kk, k, tt, ss)
        i = a * BLOCK_T + k
        t = t.to(tl.int64)
        slot = slot.to(tl.int64)
        # which rows are the step's: from the registers (no dependent round trip for their slots / positions)
        i0 = _run_start(a, k, kk, tt, ss, tp, sp, t, slot, BLOCK_T, BLOCK_R)
        mx, den, acc = _online_prefix(
            i, t, slot, ch, chm, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss,
            st_sr, spos_ptr, M, BLOCK_R, i0, False, FAST_EXP, INTERP, ape_ptr, HAS_APE, D,
        )  # fmt: skip
        sc_row = tl.load(sc_ptr + i * stride_sc + ch, mask=chm)
        if HAS_APE:
            sc_row += tl.load(ape_ptr + (t % M) * D + ch, mask=chm)
        kv_row = tl.load(kv_ptr + i * stride_kv + ch, mask=chm)
        pdl_enter(PDL)
        _store_online_state(kvs_ptr, scs_ptr, slot * st_ss + ch, st_sr, chm, mx, den, acc, sc_row, kv_row)
        if POS_IN_WRITE:
            if _last_arrival(True, cnt_ptr, slot, N_CB):  # every channel block has read the old position
                tl.store(spos_ptr + slot, t.to(tl.int32))
        k = tl.min(tl.where(last & (kk > k), kk, BLOCK_T), axis=0)
    pdl_enter(PDL)


@triton.jit
def _online_pos_kernel(
    pos_ptr, tslot_ptr, num_state_slots, T, spos_ptr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False
):
    """Online state, non-decode, last launch: ``state_pos[slot]`` = the position of each request's last token
    (PDL: stored after the wait for the state write, which reads it)."""
    a = tl.program_id(0).to(tl.int64)
    tt, ss, last = _online_last_tokens(a, T, pos_ptr, tslot_ptr, num_state_slots, BLOCK_T)
    pdl_enter(PDL)
    tl.store(spos_ptr + tl.where(last, ss, 0), tt.to(tl.int32), mask=last)


def _check_step(kv, score, positions, token_slot, kv_state, score_state, ratio, overlap, state_pos=None):
    """Validate ``compressor_step``'s tensors (``state_pos`` given: an online state); returns (c, c*m, T, c*d, d)."""
    c, cm = _geometry(ratio, overlap)
    check_tensor("kv", kv, dtype=torch.float32, ndim=2)
    t, cd = kv.shape
    dev = kv.device
    if cd % c:
        raise ValueError(f"kv: expected an even width for overlap=True, got {cd}")
    check_tensor("score", score, dtype=torch.float32, shape=[t, cd], device=dev)
    check_tensor("positions", positions, dtype=_INT, shape=[t], device=dev)
    check_tensor("token_slot", token_slot, dtype=_INT, shape=[t], device=dev)
    if state_pos is not None:
        if overlap:
            raise ValueError("state_pos (an online state): expected a compressor without overlap (HCA), got overlap")
        check_tensor("kv_state", kv_state, dtype=torch.float32, shape=[None, 3, cd], device=dev)
        n = kv_state.shape[0]
        check_tensor("score_state", score_state, dtype=torch.float32, shape=[n, 2, cd], device=dev)
        check_tensor("state_pos", state_pos, dtype=torch.int32, shape=[n], device=dev, contiguous=True)
    else:
        check_tensor("kv_state", kv_state, dtype=torch.float32, shape=[None, cm, cd], device=dev)
        check_tensor("score_state", score_state, dtype=torch.float32, shape=list(kv_state.shape), device=dev)
    if kv.stride(1) != 1 or score.stride(1) != 1:
        raise ValueError(f"kv, score: expected unit inner strides, got {kv.stride()} {score.stride()}")
    if kv_state.stride() != score_state.stride() or kv_state.stride(2) != 1:
        raise ValueError("kv_state, score_state: expected equal strides with a unit inner stride")
    return c, cm, t, cd, cd // c


def _check_ape(ape: torch.Tensor | None, ratio: int, cd: int, device: torch.device) -> None:
    """ValueError unless ``ape`` is None or the compressor's positional bias as the kernels read it: contiguous fp32
    [ratio, c*d] on ``device``."""
    if ape is not None:
        check_tensor("ape", ape, dtype=torch.float32, shape=[ratio, cd], device=device, contiguous=True)


def _ape_kw(ape: torch.Tensor | None, placeholder: torch.Tensor) -> dict:
    """The ``ape_ptr`` / ``HAS_APE`` keywords of a compressor kernel (``placeholder``: any tensor, never read, where
    there is no ape)."""
    return dict(ape_ptr=ape if ape is not None else placeholder, HAS_APE=ape is not None)


def _kernel_head(kv, score, positions, token_slot, kv_state, score_state) -> tuple:
    """The leading arguments every compressor kernel takes: inputs and their row strides, positions, token slots,
    the state tensors with their slot and row strides, and the number of state slots."""
    return (
        kv, score, kv.stride(0), score.stride(0), positions, token_slot, kv_state, score_state, kv_state.stride(0),
        kv_state.stride(1), kv_state.shape[0],
    )  # fmt: skip


def _online_block_d(block_d: int | None, d: int) -> int:
    """Channels a decode program of an online state: all d (it reads its slot's state_pos before writing it)."""
    bd = block_d or max(16, triton.next_power_of_2(d))
    if bd < d:
        raise ValueError(f"block_d: an online state's decode program takes all {d} channels, got {bd}")
    return bd


# The pool launch writes the state (``compressor_step(state_unread=True)``) up to this many tokens, else the state-write
# launch runs.  H100, 2026-12-05 (2026-12-05_h100_write_unread_s26.txt, V4-Flash prefill from 0, graph time, pool
# writing vs the state-write launch): 8,192 tokens CSA main 33.4 vs 34.9 us, CSA indexer 11.8 vs 13.6, HCA 18.3 vs
# 19.0; 65,536 CSA main 210.2 vs 213.2, CSA indexer 71.4 vs 69.6, HCA 106.9 vs 104.0 (every pool program checks its
# block for writing tokens, 32,768 of them for the CSA indexer, against the write launch's 2,048).  Since then the
# check's loads are issued before the pooling rather than after it (their round trip overlapped instead of added to
# each program): sm_90 registers at 8,192 tokens (Triton 3.6, sass_report), without the write / check after / check
# before: CSA indexer 96 / 108 / 107, CSA main 223 / 239 / 249, HCA 128 / 154 / 146.  Not yet timed
# (``run_h200.sh s27a`` sweeps the token counts).
_STATE_IN_POOL_MAX_T = 8192


# An online state's write (``_online_write_block``) in the pool launch as well (with ``counters``): not yet timed
# (``run_h200.sh s27a``), so off.
_ONLINE_STATE_IN_POOL = False


def _state_in_pool(state_unread: bool, online: bool, t: int, counters: bool) -> bool:
    """Whether a non-decode Triton ``compressor_step`` of T = ``t`` tokens writes the state in its pool launch (an
    online state: only with ``counters``, which carry the positions' last arrival)."""
    if online and not (_ONLINE_STATE_IN_POOL and counters):
        return False
    return bool(state_unread) and t <= _STATE_IN_POOL_MAX_T


def state_unread_by_step(context_lens, num_new_tokens, ratio: int, overlap: bool) -> bool:
    """Whether no entry pooled in a step reads a compressor state row (``compressor_step(state_unread=)``), from the
    host's per-request counts: ``context_lens`` (tokens cached before the step, i.e. the first position s) and
    ``num_new_tokens`` (n), sequences of ints.  A request's first entry completes at t1 = m*(s // m) + m - 1 and
    pools positions from t1 - c*m + 1; it reads the state iff t1 < s + n and max(0, t1 - c*m + 1) < s (later entries
    start later), i.e. for s > 0 with overlap, or s not a multiple of m without."""
    if len(context_lens) != len(num_new_tokens):
        raise ValueError(f"context_lens / num_new_tokens: expected equal lengths, got {len(context_lens)}, "
                         f"{len(num_new_tokens)}")  # fmt: skip
    cm = (2 if overlap else 1) * ratio
    for s, n in zip(context_lens, num_new_tokens, strict=True):
        t1 = ratio * (s // ratio) + ratio - 1
        if n > 0 and t1 < s + n and max(0, t1 - cm + 1) < s:
            return False
    return True


def compressor_step(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    kv_state: torch.Tensor,
    score_state: torch.Tensor,
    ratio: int,
    overlap: bool,
    decode: bool = False,
    backend: str = "auto",
    *,
    state_pos: torch.Tensor | None = None,
    pool_block_t: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
    row_loads: int | None = None,
    write_block_t: int | None = None,
    write_warps: int | None = None,
    write_lanes: int | None = None,
    pool_div_after: bool | None = None,
    pool_fast_rows: bool | None = None,
    pool_fast_exp: bool | None = None,
    pool_online_rows_in_step: bool | None = None,
    pool_maxnreg: int | None = None,
    write_stream: torch.cuda.Stream | None = None,
    counters: torch.Tensor | None = None,
    ape: torch.Tensor | None = None,
    state_unread: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one step's compressor projections into the state ring and pool the entries that complete.

    Args:
        kv, score: [T, c*d] fp32, this step's ``wkv(x)`` and ``wgate(x) + ape[pos mod m]`` (tokens).
        positions: [T] int32/int64 absolute positions; token_slot: [T] int32/int64 state slot per token
            (a slot outside [0, num_state_slots) is ignored: no pooling, no state write).
        kv_state, score_state: [num_state_slots, c*m, c*d] fp32, updated in place (module docstring); an online
            state: [num_state_slots, 3, d] (acc, den, raw kv) and [num_state_slots, 2, d] (max, raw score), equal
            strides (``online_state``).
        ratio: m (4 for CSA, 128 for HCA); overlap: the CSA two-half pooling (c = 2).
        state_pos: int32 [num_state_slots], given for an online state (its raw row's position; overlap=False).
        decode: promise that every request has exactly one token in this step; the Triton path then
            runs one fused launch (write own row + pool) instead of two (pool, then write).
    Returns:
        pooled [T, d] fp32 (meaningful where ``emits``; other rows unspecified: 0 in the reference,
        unwritten by the kernel), emits [T] bool (``(pos + 1) % m == 0``; entry index ``pos // m``).
    Tuning (Triton path only; results do not depend on them): ``pool_block_t`` tokens scanned per pool
        program (power of two; default min(m, 128): one emitting token per program in a prefill; CSA main's full
        tiles: _POOL_BLOCK_T_CSA_MAIN),
        ``block_d`` channels per program (power of two; pool and decode kernels; default: [c*m, block_d] tiles of
        _POOL_TILE values, halved on small tiles from _POOL_SPLIT_D_MIN_BLOCKS token blocks), ``num_warps`` of the
        pool / decode kernel (pool default: _POOL_WARPS on HCA's 128-row tiles, _POOL_WARPS_TINY on tiles under
        _POOL_TILE values, else _POOL_WARPS_SMALL), ``row_loads`` (0/1, pool kernel: find the pooled rows that are
        in the step by loading their tokens' slots / positions, see ``_pool_token``; default ``_POOL_ROW_LOADS``),
        ``write_block_t`` /
        ``write_warps`` (state-write kernel: tokens per program, power of two, and warps; default
        _WRITE_BLOCK_T / _WRITE_WARPS), ``write_lanes`` (0: ``_compressor_write_kernel``; > 0: the lanes of
        ``_compressor_write_lanes_kernel``, ``write_block_t`` its superblock; default _WRITE_LANES where
        c*d >= _WRITE_LANES_MIN_CD, else 0), ``pool_div_after`` (pool kernel: divide the channel's weighted sum
        by the softmax denominator once instead of each row's weight; default from tiles of _POOL_DIV_AFTER_MIN
        values), ``pool_fast_rows`` / ``pool_fast_exp`` (``_pool_token``'s FAST_ROWS / FAST_EXP, the latter also
        in the online state's prefix; default ``_pool_fast_defaults``), ``pool_online_rows_in_step`` (online
        state: the pool kernel's ONLINE_ROWS_IN_STEP; default _POOL_ONLINE_ROWS_IN_STEP), ``pool_maxnreg`` (the pool
        kernel's register cap, ptxas ``maxnreg``, an int in [24, 255]; default none; ignored by the interpreter).
    ``write_stream`` (non-decode Triton path on CUDA; ignored otherwise): the state-write launches go to this
        stream, after it waits for the pool; the call then returns with the write possibly still running, and the
        caller must make its stream wait for ``write_stream`` before anything reads or writes the state, and keep
        ``kv`` / ``score`` / ``positions`` / ``token_slot`` alive and unchanged until then (no ``record_stream``:
        it is not safe under graph capture).  ``positions`` / ``token_slot`` must then be contiguous (a copy made
        here would be freed before the write runs).  ``compress_prefill`` does all this.
    ``counters`` (online state, non-decode, Triton path; ignored otherwise): the state slots' arrival counters, int32
        [num_state_slots], all 0 (``CompressorState.counters``, which the fused decode launch also uses; they are 0
        again after the call).  With them the state write also writes ``state_pos`` (one launch fewer).
    ``ape`` (fp32 [ratio, c*d], optional): then ``score`` is ``wgate(x)`` alone and the kernels add
        ``ape[pos mod ratio]`` to each of this step's score rows where they read them (pooling, state writes), as
        ``compress_decode`` does: the same fp32 sums as adding it first, without writing the [T, c*d] sum.
    ``state_unread`` (non-decode Triton path; an online state only with ``counters`` and ``_ONLINE_STATE_IN_POOL``;
        ignored otherwise): the caller's promise that no entry
        pooled in this step reads a state row (``state_unread_by_step``, from the host's context lengths: every
        request starts at position 0, or at a multiple of m without overlap, or completes no entry).  The pool
        launch then writes the state as well up to _STATE_IN_POOL_MAX_T tokens (one launch instead of two;
        ``write_stream`` has nothing to run); longer steps keep the state-write launch (measured faster).  Not
        checked (it would need the positions on the host): a false promise lets a state write race a pooling that
        reads the row, so do not keep it in a captured graph that is replayed for other steps.
    Preconditions: the step contract of the module docstring.
    """
    c, cm, t, cd, d = _check_step(kv, score, positions, token_slot, kv_state, score_state, ratio, overlap, state_pos)
    online = state_pos is not None
    dev = kv.device
    bd_online = _online_block_d(block_d, d) if online and decode else None
    _check_ape(ape, ratio, cd, dev)
    if not use_triton(backend, kv, score, positions, token_slot, kv_state, score_state):
        if ape is not None:
            score = score + ape_rows(ape, positions, ratio)
        return compressor_step_reference(
            kv, score, positions, token_slot, kv_state, score_state, ratio, overlap, state_pos
        )
    if write_stream is not None and not (positions.is_contiguous() and token_slot.is_contiguous()):
        raise ValueError("positions / token_slot: expected contiguous tensors with write_stream")
    if counters is not None:
        check_tensor("counters", counters, dtype=torch.int32, shape=[kv_state.shape[0]], device=dev, contiguous=True)
    positions, token_slot = positions.contiguous(), token_slot.contiguous()  # indexed as ptr + i
    pooled = torch.empty(t, d, dtype=torch.float32, device=dev)
    emits = torch.empty(t, dtype=torch.bool, device=dev)
    if t == 0:
        return pooled, emits
    block_r = triton.next_power_of_2(cm)
    head = _kernel_head(kv, score, positions, token_slot, kv_state, score_state)
    if decode:
        # channels span c*d (the own-row write); [block_r, block_d] <= _DECODE_TILE values (online: [block_d])
        bd = bd_online or block_d or max(16, min(triton.next_power_of_2(cd), _DECODE_TILE // block_r))
        nw = num_warps or _DECODE_WARPS
        _compressor_decode_kernel[(t, triton.cdiv(cd, bd))](
            *head, pooled, emits.view(torch.uint8), t, state_pos if online else kv_state,
            M=ratio, CM=cm, D=d, OVERLAP=overlap, C=c, BLOCK_R=block_r, BLOCK_D=bd, ONLINE=online, num_warps=nw,
            **_ape_kw(ape, kv), **pdl_launch(dev),
        )  # fmt: skip
        return pooled, emits
    # pooling reads the state as it was before the step: every pool finishes before any state write
    grid, kw, bd, fast_exp = _pool_launch_params(
        kv, score, t, d, cm, ratio, online, pool_block_t=pool_block_t, block_d=block_d, num_warps=num_warps,
        row_loads=row_loads, pool_div_after=pool_div_after, pool_fast_rows=pool_fast_rows, pool_fast_exp=pool_fast_exp,
        pool_online_rows_in_step=pool_online_rows_in_step, pool_maxnreg=pool_maxnreg, ape=ape is not None,
    )  # fmt: skip
    in_pool = _state_in_pool(state_unread, online, t, counters is not None)
    _compressor_pool_kernel[grid](
        *head, pooled, emits.view(torch.uint8), t, state_pos if online else kv_state, OVERLAP=overlap, **kw,
        **_ape_kw(ape, kv), **pdl_launch(dev), WRITE_STATE=in_pool, cnt_ptr=counters if in_pool and online else None,
        N_CB=grid[1],
    )  # fmt: skip
    if in_pool:
        return pooled, emits
    side = write_stream is not None and kv.is_cuda  # the state write on the caller's side stream, after the pool
    if side:
        write_stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(write_stream) if side else contextlib.nullcontext():
        _launch_state_write(
            head, t, d, cd, cm, ratio, block_r, bd, online, state_pos, fast_exp, positions, token_slot,
            kv_state.shape[0], write_block_t, write_warps, write_lanes, counters if online else None, ape,
        )  # fmt: skip
    return pooled, emits


def _pool_launch_params(
    kv: torch.Tensor,
    score: torch.Tensor,
    t: int,
    d: int,
    cm: int,
    ratio: int,
    online: bool,
    *,
    whole_rows: bool = False,
    pool_block_t: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
    row_loads: int | None = None,
    pool_div_after: bool | None = None,
    pool_fast_rows: bool | None = None,
    pool_fast_exp: bool | None = None,
    pool_online_rows_in_step: bool | None = None,
    pool_maxnreg: int | None = None,
    ape: bool = False,
) -> tuple[tuple[int, int], dict, int, bool]:
    """The non-decode pool launch of ``compressor_step`` for T = ``t`` tokens: (grid, keyword arguments of
    ``_compressor_pool_kernel`` but OVERLAP, channels a program, FAST_EXP), from the tuning arguments
    (``compressor_step``'s docstring).  ``whole_rows``: a program takes all d channels (``block_d`` ignored; d a
    power of two), as the fused emit of ``compress_prefill`` needs; ``ape``: the pool adds ape
    (``_POOL_APE_MAXNREG``)."""
    block_r = triton.next_power_of_2(cm)
    if whole_rows:
        block_d = triton.next_power_of_2(d)
    bd = block_d or max(16, min(triton.next_power_of_2(d), _POOL_TILE // block_r))
    full_csa = block_r <= 8 and block_r * bd >= _POOL_TILE  # CSA main's [8, 512] tiles
    bt = pool_block_t or (_POOL_BLOCK_T_CSA_MAIN if full_csa else min(triton.next_power_of_2(ratio), _POOL_BLOCK_T))
    tiny = block_r <= 8 and block_r * bd < _POOL_TILE  # the CSA indexer's [8, 128] tiles (_POOL_WARPS_TINY)
    if tiny and block_d is None and bd >= 32 and triton.cdiv(t, bt) >= _POOL_SPLIT_D_MIN_BLOCKS:
        bd //= 2
    _check_pow2("pool_block_t", bt)
    _check_pow2("block_d", bd)
    rl = bool(_POOL_ROW_LOADS if row_loads is None else row_loads)
    full_tile = block_r * bd >= _POOL_DIV_AFTER_MIN
    div_after = bool(full_tile if pool_div_after is None else pool_div_after)
    auto_rows, auto_exp = _pool_fast_defaults(cm, full_tile, online)
    fast_exp = bool(auto_exp if pool_fast_exp is None else pool_fast_exp)
    offsets32 = max(kv.stride(0), score.stride(0)) * cm < 2**31  # (the fast loads' 32-bit row offsets)
    check_maxnreg("pool_maxnreg", pool_maxnreg)
    if pool_maxnreg is None and ape and block_r > 8:
        pool_maxnreg = _POOL_APE_MAXNREG
    cap = {} if pool_maxnreg is None or interpreter_enabled() else {"maxnreg": pool_maxnreg}
    kw = dict(
        M=ratio, CM=cm, D=d, BLOCK_T=bt, BLOCK_R=block_r, BLOCK_D=bd, ROW_LOADS=rl, ONLINE=online, DIV_AFTER=div_after,
        FAST_ROWS=bool(auto_rows if pool_fast_rows is None else pool_fast_rows) and offsets32,
        ONLINE_ROWS_IN_STEP=online and offsets32 and bool(
            _POOL_ONLINE_ROWS_IN_STEP if pool_online_rows_in_step is None else pool_online_rows_in_step
        ),
        FAST_EXP=fast_exp, INTERP=interpreter_enabled(),
        num_warps=num_warps or (_POOL_WARPS if block_r > 8 else _POOL_WARPS_TINY if tiny else _POOL_WARPS_SMALL),
        **cap,
    )  # fmt: skip
    return (triton.cdiv(t, bt), triton.cdiv(d, bd)), kw, bd, fast_exp


def _launch_state_write(
    head, t, d, cd, cm, ratio, block_r, bd, online, state_pos, fast_exp, positions, token_slot, n_slots,
    write_block_t, write_warps, write_lanes, counters=None, ape=None,
) -> None:  # fmt: skip
    """The state-write launches of a non-decode ``compressor_step`` (after its pool launch; ``head`` its kernel
    arguments up to the state's slot count): the online state's write and positions (one launch with ``counters``),
    else the lanes or the token-block write kernel (``ape``: added to the score rows they store)."""
    kw = {**pdl_launch(positions.device), **_ape_kw(ape, head[0])}
    if online:
        wbt = write_block_t or _ONLINE_WRITE_BLOCK_T
        _check_pow2("write_block_t", wbt)
        _compressor_online_write_kernel[(triton.cdiv(t, wbt), triton.cdiv(d, bd))](
            *head, t, state_pos, counters if counters is not None else state_pos, M=ratio, D=d, BLOCK_T=wbt,
            BLOCK_R=block_r, BLOCK_D=bd, FAST_EXP=fast_exp, INTERP=interpreter_enabled(), N_CB=triton.cdiv(d, bd),
            POS_IN_WRITE=counters is not None,
            num_warps=write_warps or (_POOL_WARPS if block_r * bd >= _POOL_TILE else _POOL_WARPS_SMALL), **kw,
        )  # fmt: skip
        if counters is None:
            _online_pos_kernel[(triton.cdiv(t, wbt),)](
                positions, token_slot, n_slots, t, state_pos, BLOCK_T=wbt, num_warps=_WRITE_WARPS,
                **pdl_launch(positions.device),
            )  # fmt: skip
        return
    lanes = (_WRITE_LANES if cd >= _WRITE_LANES_MIN_CD else 0) if write_lanes is None else write_lanes
    if not isinstance(lanes, int) or lanes < 0:
        raise ValueError(f"write_lanes: expected an int >= 0, got {lanes!r}")
    if lanes:
        wd = min(triton.next_power_of_2(cd), _WRITE_LANE_TILE)
        sub = max(1, _WRITE_LANE_TILE // wd)
        sup = write_block_t or min(max(triton.next_power_of_2(triton.cdiv(t, _WRITE_SUPERBLOCKS)), 256), 2048)
        _check_pow2("write_block_t", sup)
        sub = min(sub, sup)
        _compressor_write_lanes_kernel[(triton.cdiv(t, sup), lanes)](
            *head, t, CM=cm, CD=cd, SUPER=sup, SUB=sub, LANES=lanes, BLOCK_D=wd, num_warps=write_warps or _WRITE_WARPS,
            M=ratio, **kw,
        )  # fmt: skip
        return
    wd = min(triton.next_power_of_2(cd), _WRITE_BLOCK_D)
    wbt = write_block_t or _WRITE_BLOCK_T
    _check_pow2("write_block_t", wbt)
    _compressor_write_kernel[(triton.cdiv(t, wbt),)](
        *head, t, CM=cm, CD=cd, BLOCK_T=wbt, BLOCK_D=wd, num_warps=write_warps or _WRITE_WARPS, M=ratio, **kw,
    )  # fmt: skip


# ============================================================================ emit
def emit_entries_reference(
    pooled: torch.Tensor,
    emits: torch.Tensor,
    positions: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    slots: torch.Tensor,
    pages: EntryPages | KeyPages,
    fmt: FP8EntryFormat | MXFP4KeyFormat,
    ratio: int,
    kind: str = "main",
) -> None:
    """PyTorch definition of ``emit_entries``: bf16 -> RMSNorm -> RoPE(entry position) -> [Hadamard] -> store."""
    sel = emits.nonzero().squeeze(1)
    if sel.numel() == 0:
        return
    y = rms_norm(pooled[sel].to(torch.bfloat16), norm_weight, eps)
    y = apply_rope(y, entry_positions(positions[sel], ratio), inv_freq)
    if kind == "main":
        store_fp8_entries_reference(y, slots[sel], pages, fmt)
    else:
        store_mxfp4_keys_reference(hadamard(y), slots[sel], pages, fmt)


@triton.jit
def _emit_indexer_kernel(
    x_ptr,
    stride_x,
    n_rows,
    w_ptr,
    eps,
    pos_ptr,
    inv_ptr,
    ratio,
    emit_ptr,
    slot_ptr,
    num_slots,
    bs,
    data_ptr,
    data_sp,
    data_sr,
    scale_ptr,
    scale_sp,
    scale_sr,
    INTERP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DIM: tl.constexpr,
    NOPE: tl.constexpr,
    HR: tl.constexpr,
    HAD_SCALE: tl.constexpr,
    KB: tl.constexpr,  # 2 * HB: the MXFP4 block
    NA: tl.constexpr,  # NOPE // KB: input blocks of nope values
    RA: tl.constexpr,  # 2 * HR // KB: input blocks of rope values
    NB: tl.constexpr,
    HB: tl.constexpr,
    FLOOR: tl.constexpr,
    Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
    PDL: tl.constexpr = False,
    PDL_LATE: tl.constexpr = False,
):
    """Tokens [a*BLOCK_T, ...), each emitting one in turn: bf16 -> RMSNorm -> RoPE -> Sylvester Hadamard
    (fp32, x DIM^-1/2, bf16) -> MXFP4.

    Input index k = KB*ka + kb and output index o = KB*blk + 2*jj + odd (KB = 2*HB, the MXFP4 block) split
    the Sylvester sign: (-1)^popcount(o & k) = (-1)^popcount(blk & ka) * (-1)^popcount((2jj + odd) & kb), so
    the transform is H_NB (x) H_KB: a [KB x KB] pass inside each input block, then an [NB x NB] pass across
    blocks (~DIM * (KB + NB) products instead of DIM**2).  The row is loaded straight in that layout: nope
    values as [NOPE/KB, KB], rope pairs as [2*HR/KB, HB] even / odd lanes (cos/sin once per pair)."""
    pdl_start(PDL, PDL_LATE)
    a = tl.program_id(0).to(tl.int64)
    ii = a * BLOCK_T + tl.arange(0, BLOCK_T)
    im = ii < n_rows
    ee = tl.load(emit_ptr + ii, mask=im, other=0) != 0
    sl = tl.load(slot_ptr + ii, mask=im & ee, other=-1).to(tl.int64)
    work = im & ee & (sl >= 0) & (sl < num_slots)
    _emit_indexer_rows(
        x_ptr, stride_x, ii, work, sl, w_ptr, eps, pos_ptr, inv_ptr, ratio, bs, data_ptr, data_sp, data_sr,
        scale_ptr, scale_sp, scale_sr, INTERP, BLOCK_T, DIM, NOPE, HR, HAD_SCALE, KB, NA, RA, NB, HB, FLOOR, Q_EXP,
        Q_MANT,
    )  # fmt: skip
    pdl_end(PDL, PDL_LATE)


@triton.jit
def _emit_indexer_rows(
    x_ptr, stride_x, ii, work, sl, w_ptr, eps, pos_ptr, inv_ptr, ratio, bs, data_ptr, data_sp, data_sr, scale_ptr,
    scale_sp, scale_sr, INTERP: tl.constexpr, BLOCK_T: tl.constexpr, DIM: tl.constexpr, NOPE: tl.constexpr,
    HR: tl.constexpr, HAD_SCALE: tl.constexpr, KB: tl.constexpr, NA: tl.constexpr, RA: tl.constexpr, NB: tl.constexpr,
    HB: tl.constexpr, FLOOR: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr,
):  # fmt: skip
    """The rows ``ii`` [BLOCK_T] flagged in ``work``, one after another, to their key slots ``sl``: the body of
    ``_emit_indexer_kernel`` (also the emit of the fused decode kernel, BLOCK_T = 1)."""
    kk = tl.arange(0, BLOCK_T)
    # sign tables (shared by the rows of the program)
    jj = tl.arange(0, HB)
    kb = tl.arange(0, KB)
    jb = tl.arange(0, HB)
    s_e = parity_sign((2 * jj)[:, None] & kb[None, :])  # [HB, KB]: even outputs x nope lanes
    s_o = parity_sign((2 * jj + 1)[:, None] & kb[None, :])
    p_ee = parity_sign((2 * jj)[:, None] & (2 * jb)[None, :])  # [HB, HB]: outputs x rope lanes
    p_eo = parity_sign((2 * jj)[:, None] & (2 * jb + 1)[None, :])
    p_oe = parity_sign((2 * jj + 1)[:, None] & (2 * jb)[None, :])
    p_oo = parity_sign((2 * jj + 1)[:, None] & (2 * jb + 1)[None, :])
    blk = tl.arange(0, NB)
    na = tl.arange(0, NA)
    ra = tl.arange(0, RA)
    h_n = parity_sign(blk[:, None] & na[None, :])  # [NB, NA]
    h_r = parity_sign(blk[:, None] & (NA + ra)[None, :])  # [NB, RA]
    noff = na[:, None] * KB + kb[None, :]  # [NA, KB]
    roff = NOPE + ra[:, None] * KB + 2 * jb[None, :]  # [RA, HB] even rope lanes
    wn = tl.load(w_ptr + noff).to(tl.float32)
    we = tl.load(w_ptr + roff).to(tl.float32)
    wo = tl.load(w_ptr + roff + 1).to(tl.float32)
    jpair = ra[:, None] * HB + jb[None, :]  # rope pair index of each [RA, HB] lane
    k = tl.min(tl.where(work, kk, BLOCK_T), axis=0)
    while k < BLOCK_T:
        i = tl.sum(tl.where(kk == k, ii, 0), axis=0)
        slot = tl.sum(tl.where(kk == k, sl, 0), axis=0)
        xrow = x_ptr + i * stride_x
        xn = bf16_round(tl.load(xrow + noff).to(tl.float32))
        xe = bf16_round(tl.load(xrow + roff).to(tl.float32))
        xo = bf16_round(tl.load(xrow + roff + 1).to(tl.float32))
        ss = tl.sum(tl.sum(xn * xn, axis=1), axis=0) + tl.sum(tl.sum(xe * xe + xo * xo, axis=1), axis=0)
        r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, DIM) + eps))
        yn = bf16_round(wn * (xn * r))
        ye = bf16_round(we * (xe * r))
        yo = bf16_round(wo * (xo * r))
        c, s = rope_cos_sin_at(pos_ptr + i, ratio, inv_ptr + jpair, INTERP)
        re = bf16_round(ye * c - yo * s)
        ro = bf16_round(ye * s + yo * c)
        # pass 1, inside each input block: [blocks, HB outputs (even / odd)]
        yn3 = yn[:, None, :]
        zn_e = tl.sum(yn3 * s_e[None, :, :], axis=2)  # [NA, HB]
        zn_o = tl.sum(yn3 * s_o[None, :, :], axis=2)
        re3 = re[:, None, :]
        ro3 = ro[:, None, :]
        zr_e = tl.sum(re3 * p_ee[None, :, :] + ro3 * p_eo[None, :, :], axis=2)  # [RA, HB]
        zr_o = tl.sum(re3 * p_oe[None, :, :] + ro3 * p_oo[None, :, :], axis=2)
        # pass 2, across blocks: [NB, HB]
        ze = tl.sum(h_n[:, :, None] * zn_e[None, :, :], axis=1) + tl.sum(h_r[:, :, None] * zr_e[None, :, :], axis=1)
        zo = tl.sum(h_n[:, :, None] * zn_o[None, :, :], axis=1) + tl.sum(h_r[:, :, None] * zr_o[None, :, :], axis=1)
        ze = bf16_round(ze * HAD_SCALE)
        zo = bf16_round(zo * HAD_SCALE)
        _mxfp4_store_row(
            ze, zo, slot // bs, slot % bs, slot >= 0, data_ptr, data_sp, data_sr, scale_ptr, scale_sp, scale_sr,
            NB, HB, FLOOR, Q_EXP, Q_MANT,
        )  # fmt: skip
        k = tl.min(tl.where(work & (kk > k), kk, BLOCK_T), axis=0)


@triton.jit
def _mxfp4_store_rows(
    z, go, dbase, sbase, HAD_SCALE: tl.constexpr, INTERP: tl.constexpr, BLOCK_T: tl.constexpr, NBH: tl.constexpr,
    HB: tl.constexpr, FLOOR: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr,
):  # fmt: skip
    """Rows z [BLOCK_T, NBH * 2 * HB] fp32 (Hadamard sums) -> x HAD_SCALE -> bf16 -> NBH MXFP4 blocks each,
    stored at ``dbase`` [BLOCK_T] (NBH * HB bytes) and ``sbase`` [BLOCK_T] (NBH scale bytes) where ``go``."""
    z = bf16_rne(z * HAD_SCALE, INTERP)
    ze, zo = tl.split(tl.reshape(z, [BLOCK_T, NBH, HB, 2]))
    amax = tl.maximum(tl.max(tl.abs(ze), axis=2), tl.max(tl.abs(zo), axis=2))  # [BLOCK_T, NBH]
    e = ceil_log2_ratio(amax, FLOOR, Q_EXP, Q_MANT)
    inv = pow2_neg(e)[:, :, None]
    code = (e2m1_code(ze * inv) | (e2m1_code(zo * inv) << 4)).to(tl.uint8)
    b = tl.arange(0, NBH)
    tl.store(dbase[:, None, None] + (b[:, None] * HB + tl.arange(0, HB)[None, :])[None, :, :], code,
             mask=go[:, None, None])  # fmt: skip
    sbyte = tl.minimum(tl.maximum(e + 127, 0), 254).to(tl.uint8)
    tl.store(sbase[:, None] + b[None, :], sbyte, mask=go[:, None])


@triton.jit
def _emit_indexer_dot_kernel(
    x_ptr,
    stride_x,
    n_rows,
    w_ptr,
    eps,
    pos_ptr,
    inv_ptr,
    emit_ptr,
    slot_ptr,
    scratch_ptr,
    num_slots,
    bs,
    data_ptr,
    data_sp,
    data_sr,
    scale_ptr,
    scale_sp,
    scale_sr,
    INTERP: tl.constexpr,
    RATIO: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
    NOPE: tl.constexpr,
    HR: tl.constexpr,
    HAD_SCALE: tl.constexpr,
    NB: tl.constexpr,
    HB: tl.constexpr,
    FLOOR: tl.constexpr,
    Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
    PDL: tl.constexpr = False,
    PDL_LATE: tl.constexpr = False,
):
    """``_emit_indexer_kernel`` for BLOCK_T tokens a program, the Hadamard as two MMAs over ROWS (>= 16)
    emitting rows at a time.

    The program's emitting tokens (flag set, slot in range) are numbered in token order by a cumsum; group g
    takes numbers [g * ROWS, (g + 1) * ROWS): each number's token index is scattered into the program's slice of
    ``scratch_ptr`` (int32 [grid * BLOCK_T]) and read back by the lanes after a barrier, so every MMA row is an
    emitting token (a prefill with m = 4 has BLOCK_T / 4 of them; without the compaction
    3 of 4 rows were masked work).  Each group: rows loaded ([ROWS, NOPE] nope values, [ROWS, HR, 2] rope
    pairs), normed and roped as in the window store, then the Hadamard as H_2 (x) H_NOPE (needs NOPE = 2*HR =
    DIM / 2): two MMAs (bf16 operands on the GPU, tf32 under the interpreter) with one [NOPE, NOPE] sign matrix
    (built in registers once per program) and a sum / difference.  The operands are bf16 values and +-1, so
    every product is exact and only the fp32 accumulation order differs from the reference's matmul (as with the
    factorised kernel).  The two halves are quantised to MXFP4 blocks and stored separately."""
    pdl_start(PDL, PDL_LATE)
    a = tl.program_id(0).to(tl.int64)
    ii = a * BLOCK_T + tl.arange(0, BLOCK_T)
    im = ii < n_rows
    ee = tl.load(emit_ptr + ii, mask=im, other=0) != 0
    sl = tl.load(slot_ptr + ii, mask=im & ee, other=-1)
    go = im & ee & (sl >= 0) & (sl < num_slots)
    n_go = tl.sum(go.to(tl.int32), axis=0)
    if n_go > 0:
        # compaction: emitting token number r (token order) -> its index in the block, through the program's slice of
        # ``scratch`` (a scatter, a barrier, one load a group: no [ROWS, BLOCK_T] select-and-reduce)
        kk = tl.arange(0, BLOCK_T)
        rank = tl.cumsum(go.to(tl.int32), axis=0) - 1
        tl.store(scratch_ptr + a * BLOCK_T + rank, kk, mask=go)
        tl.debug_barrier()
        cn = tl.arange(0, NOPE)
        h = sylvester_signs(cn, INTERP)  # [NOPE, NOPE]
        roff = NOPE + 2 * tl.arange(0, HR)[:, None] + tl.arange(0, 2)[None, :]  # [HR, 2]
        wn = tl.load(w_ptr + cn).to(tl.float32)
        we, wo = tl.split(tl.load(w_ptr + roff).to(tl.float32))
        for g0 in range(0, n_go, ROWS):
            jj = g0 + tl.arange(0, ROWS)
            gm = jj < n_go
            rows = a * BLOCK_T + tl.load(scratch_ptr + a * BLOCK_T + jj, mask=gm, other=0)
            slot = tl.load(slot_ptr + rows, mask=gm, other=0)  # (read by this program above: cached)
            _emit_indexer_dot_rows(
                x_ptr, stride_x, rows, gm, slot, wn, we, wo, eps, pos_ptr, inv_ptr, RATIO, bs, h, data_ptr,
                data_sp, data_sr, scale_ptr, scale_sp, scale_sr, INTERP, ROWS, DIM, NOPE, HR, HAD_SCALE, NB, HB, FLOOR,
                Q_EXP, Q_MANT,
            )  # fmt: skip
    pdl_end(PDL, PDL_LATE)


@triton.jit
def _emit_indexer_dot_rows(
    x_ptr, stride_x, ii, go, sl, wn, we, wo, eps, pos_ptr, inv_ptr, RATIO: tl.constexpr, bs, h, data_ptr,
    data_sp, data_sr, scale_ptr, scale_sp, scale_sr, INTERP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
    NOPE: tl.constexpr, HR: tl.constexpr, HAD_SCALE: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr,
    FLOOR: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr,
):  # fmt: skip
    """Rows ``ii`` [ROWS] where ``go`` to key slots ``sl``: the body of ``_emit_indexer_dot_kernel`` (h: the
    [NOPE, NOPE] Sylvester signs; wn [NOPE], we / wo [HR]: the fp32 norm weights of the nope values and of the even /
    odd rope lanes)."""
    cn = tl.arange(0, NOPE)
    j = tl.arange(0, HR)
    xrow = x_ptr + ii.to(tl.int64) * stride_x
    xn = bf16_rne(tl.load(xrow[:, None] + cn[None, :], mask=go[:, None], other=0.0), INTERP)
    # the rope values as one contiguous [ROWS, 2 * HR] load (row-major lanes, as the nope values), split in registers
    cr = NOPE + tl.arange(0, 2 * HR)
    xr = bf16_rne(tl.load(xrow[:, None] + cr[None, :], mask=go[:, None], other=0.0), INTERP)
    xe, xo = tl.split(tl.reshape(xr, [ROWS, HR, 2]))
    ss = tl.sum(xn * xn, axis=1) + tl.sum(xe * xe + xo * xo, axis=1)
    r = tl.div_rn(tl.zeros([ROWS], tl.float32) + 1.0, tl.sqrt_rn(tl.div_rn(ss, DIM) + eps))
    yn = bf16_rne(wn[None, :] * (xn * r[:, None]), INTERP)
    ye = bf16_rne(we[None, :] * (xe * r[:, None]), INTERP)
    yo = bf16_rne(wo[None, :] * (xo * r[:, None]), INTERP)
    c, s = rope_cos_sin_pos(tl.load(pos_ptr + ii, mask=go, other=0), RATIO, inv_ptr + j, INTERP)
    rot = tl.reshape(tl.join(bf16_rne(ye * c - yo * s, INTERP), bf16_rne(ye * s + yo * c, INTERP)), [ROWS, 2 * HR])
    # H_DIM = H_2 (x) H_NOPE (nope = rope = DIM / 2): z[:NOPE] = A + B, z[NOPE:] = A - B with
    # A = yn @ H_NOPE, B = rope @ H_NOPE.  The values are bf16 and the signs +-1, so every product is exact in
    # bf16 MMAs (fp32 accumulation) on the GPU; the interpreter's bf16 dot is wrong, so it takes tf32 (also exact)
    za, zb = hadamard_dots(yn, rot, h, INTERP)
    s32 = tl.where(go, sl, 0).to(tl.int32)
    page = (s32 // bs).to(tl.int64)
    row = (s32 % bs).to(tl.int64)
    dbase = data_ptr + page * data_sp + row * data_sr
    sbase = scale_ptr + page * scale_sp + row * scale_sr
    _mxfp4_store_rows(za + zb, go, dbase, sbase, HAD_SCALE, INTERP, ROWS, NB // 2, HB, FLOOR, Q_EXP, Q_MANT)
    _mxfp4_store_rows(
        za - zb, go, dbase + (NB // 2) * HB, sbase + NB // 2, HAD_SCALE, INTERP, ROWS, NB // 2, HB, FLOOR, Q_EXP,
        Q_MANT,
    )  # fmt: skip


def _emit_indexer_dot_block_t(t: int, n_sms: int) -> int:
    """Tokens a program of the MMA kernel that ``emit_entries(kind="indexer", dot=None)`` runs for T = ``t`` tokens,
    0 for the factored kernel: ``_EMIT_DOT_BLOCK_T`` when that grid has at least ``_EMIT_DOT_MIN_PROGRAMS`` programs
    per SM, else ``_EMIT_DOT_BLOCK_T_SMALL`` from ``_EMIT_DOT_MIN_T_64`` tokens."""
    if triton.cdiv(t, _EMIT_DOT_BLOCK_T) >= _EMIT_DOT_MIN_PROGRAMS * n_sms:
        return _EMIT_DOT_BLOCK_T
    return _EMIT_DOT_BLOCK_T_SMALL if t >= _EMIT_DOT_MIN_T_64 else 0


def _check_emit(t, positions, norm_weight, inv_freq, slots, pages, fmt, ratio, kind) -> tuple[int, int]:
    """Validate ``emit_entries``'s arguments other than pooled / emits (T rows); returns (d, rope dims)."""
    if kind not in ("main", "indexer"):
        raise ValueError(f"kind: expected 'main' or 'indexer', got {kind!r}")
    if kind == "main":
        if not isinstance(fmt, FP8EntryFormat):
            raise ValueError(f"fmt: expected FP8EntryFormat for kind='main', got {type(fmt).__name__}")
        _check_entry_pages(pages, fmt)
        dev, d, rd = pages.nope.device, fmt.head_dim, fmt.rope_dim
    else:
        if not isinstance(fmt, MXFP4KeyFormat):
            raise ValueError(f"fmt: expected MXFP4KeyFormat for kind='indexer', got {type(fmt).__name__}")
        _check_key_pages(pages, fmt)
        dev, d, rd = pages.data.device, fmt.dim, 2 * inv_freq.shape[-1]
    check_tensor("positions", positions, dtype=_INT, shape=[t], device=dev)
    check_tensor("norm_weight", norm_weight, dtype=(torch.float32, torch.bfloat16), shape=[d], device=dev)
    check_tensor("inv_freq", inv_freq, dtype=torch.float32, shape=[rd // 2], device=dev)
    check_tensor("slots", slots, dtype=_INT, shape=[t], device=dev)
    if not 0 < rd < d or rd % 2:
        raise ValueError(f"inv_freq: expected 0 < 2*len(inv_freq) < {d}, got {rd}")
    if not isinstance(ratio, int) or ratio <= 0:
        raise ValueError(f"ratio: expected a positive int, got {ratio!r}")
    return d, rd


def check_emit_arguments(
    positions, norm_weight, inv_freq, slots, pages, fmt, ratio: int, kind: str, backend: str = "auto"
) -> None:
    """ValueError unless ``emit_entries`` (with ``backend``) would accept these arguments for T = len(positions) rows,
    including the Triton kernels' own preconditions where that backend runs them (a caller that changes state
    before the emit, e.g. ``LayerCacheHandle.compress`` / ``compress_prefill``, checks first)."""
    t = positions.shape[0] if isinstance(positions, torch.Tensor) and positions.ndim == 1 else -1
    if t < 0:
        raise ValueError(f"positions: expected a 1-D tensor, got {type(positions).__name__}")
    d, rd = _check_emit(t, positions, norm_weight, inv_freq, slots, pages, fmt, ratio, kind)
    if t == 0 or not use_triton(backend, positions, slots, norm_weight, inv_freq):
        return
    if kind == "main":
        check_fp8_kernel_geometry(fmt, pages)
    else:
        _indexer_emit_geometry(fmt, d, rd)


def _indexer_emit_geometry(fmt: MXFP4KeyFormat, d: int, rd: int) -> dict:
    """The indexer emit kernels' constexprs (nope / rope widths, Hadamard scale, MXFP4 block split) after
    checking their preconditions: power-of-two widths, nope and rope power-of-two multiples of the block."""
    _check_pow2("fmt.dim", d)
    _check_pow2("rope_dim // 2", rd // 2)
    kb = fmt.block
    if (d - rd) % kb or rd % kb or d - rd < kb:
        raise ValueError(f"indexer emit: the Triton kernel needs nope ({d - rd}) and rope ({rd}) multiples of {kb}")
    _check_pow2("nope // fmt.block", (d - rd) // kb)
    _check_pow2("rope_dim // fmt.block", rd // kb)
    return dict(NOPE=d - rd, HR=rd // 2, HAD_SCALE=d**-0.5, KB=kb, NA=(d - rd) // kb, RA=rd // kb)


def emit_entries(
    pooled: torch.Tensor,
    emits: torch.Tensor,
    positions: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    slots: torch.Tensor,
    pages: EntryPages | KeyPages,
    fmt: FP8EntryFormat | MXFP4KeyFormat,
    ratio: int,
    kind: str = "main",
    backend: str = "auto",
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
    iters: int | None = None,
    scan: int | None = None,
    dot: int | None = None,
    rows: int | None = None,
    stages: int | None = None,
    pdl_late: bool = False,
) -> None:
    """Finish and store the entries pooled by ``compressor_step`` (spec §3 "after pooling").

    For every token i with ``emits[i]`` and an in-range ``slots[i]`` (physical entry slot, int32/int64
    [T]; -1 = skip): bf16(pooled[i]) -> RMSNorm(norm_weight, eps; fp32 math, bf16) -> interleaved RoPE on
    the last ``2 * len(inv_freq)`` dims at the entry position ``ratio * (positions[i] // ratio)`` ->
    ``kind="main"``: FP8 entry (``fmt`` FP8EntryFormat, ``pages`` EntryPages) exactly as
    ``store_fp8_entries``; ``kind="indexer"``: Sylvester Hadamard x dim^-1/2 (fp32, bf16) then an MXFP4
    key (``fmt`` MXFP4KeyFormat, ``pages`` KeyPages) as ``store_mxfp4_keys``.
    ``pooled`` [T, d] fp32 with d = fmt.head_dim (main) / fmt.dim (indexer); rows of non-emitting
    tokens are never read.  Triton vs reference: as ``store_window`` (RMSNorm / Hadamard sum order).
    Tuning (Triton path only; results do not depend on them): ``block_t`` tokens per program (power of
    two; main: 1 row per block and a warp per row by default, ``iters`` blocks per program (default 1), as
    ``store_window``; indexer: min(m, 8), emitting ones handled in turn), ``num_warps`` (main: min(block_t, 8);
    indexer: 1; its MMA kernel: _EMIT_DOT_WARPS, _EMIT_DOT_WARPS_FEW on grids of at most one program an SM),
    ``scan`` (main, when neither ``block_t`` nor ``iters`` is given: rows per program whose
    flags are read at once, the emitting ones stored in turn by one warp; power of two, default
    min(next_pow2(m), 128, T / 512 rounded down to a power of two); 1 = one-row programs), ``dot``
    (indexer, 0/1: the Hadamard as MMAs over ``block_t`` >= 16 tokens per program, default
    _EMIT_DOT_BLOCK_T; None: the MMA kernel when ``block_t`` is None and T is long enough, with the block of
    ``_emit_indexer_dot_block_t``), ``rows`` (indexer, dot=1 only: emitting rows a group of MMAs, power of two in
    [16, block_t], default min(_EMIT_DOT_ROWS, block_t)), ``stages`` (dot=1 only: Triton's ``num_stages`` of the MMA
    kernel's group loop, default _EMIT_DOT_STAGES; None = Triton's).
    The indexer kernel needs nope and rope widths that are power-of-two multiples of the MXFP4 block
    (128 = 64 + 64, blocks of 32 in the released model).
    ``pdl_late`` (Triton path with PDL on, ``dispatch.pdl_launch``): the kernel runs whole before it waits for the
    previous launch on the stream, so it overlaps that launch.  Only for a caller that knows that launch neither
    writes what the emit reads nor touches the pages, that ``pooled`` / ``emits`` were written before it started
    (``compress_prefill``: the state write after the pool), and that nothing that launch uses was freed since it was
    launched (the MMA kernel's scratch, allocated here, is written before the wait).
    """
    check_tensor("pooled", pooled, dtype=torch.float32, ndim=2)
    t = pooled.shape[0]
    d, rd = _check_emit(t, positions, norm_weight, inv_freq, slots, pages, fmt, ratio, kind)
    check_tensor("pooled", pooled, shape=[t, d], device=slots.device)
    check_tensor("emits", emits, dtype=torch.bool, shape=[t], device=slots.device)
    if not use_triton(backend, pooled, emits, slots):
        emit_entries_reference(pooled, emits, positions, norm_weight, eps, inv_freq, slots, pages, fmt, ratio, kind)
        return
    emits, positions, slots = emits.contiguous(), positions.contiguous(), slots.contiguous()
    if t == 0:
        return
    if pooled.stride(1) != 1 or not norm_weight.is_contiguous() or not inv_freq.is_contiguous():
        raise ValueError("pooled (unit inner stride), norm_weight, inv_freq (contiguous): bad layout")
    for name, v in (("rows", rows), ("stages", stages)):
        if v is not None and (kind == "main" or dot != 1):
            raise ValueError(f"{name}: the indexer's MMA emit only (kind='indexer', dot=1), got {v!r} with dot={dot!r}")
    if kind == "main":
        _launch_norm_rope_fp8(
            pooled, norm_weight, eps, positions, ratio, inv_freq, slots, pages, fmt, None, emits, block_t, num_warps,
            iters, scan, pdl_late=pdl_late,
        )  # fmt: skip
        return
    if scan is not None or iters is not None:
        raise ValueError("scan / iters: main emit only (the indexer emit scans block_t tokens per program)")
    geo = _indexer_emit_geometry(fmt, d, rd)
    pargs, kw = _mxfp4_args(pages, fmt)
    bs = pages.entries_per_page
    mma_geometry = d - rd == rd and fmt.n_blocks % 2 == 0  # the MMA kernel's H_2 (x) H_NOPE split
    auto_bt = _emit_indexer_dot_block_t(t, num_sms(pooled.device)) if block_t is None and mma_geometry else 0
    use_dot = bool(auto_bt) if dot is None else bool(dot)
    if use_dot:
        bt = block_t or auto_bt or _EMIT_DOT_BLOCK_T
        nr = rows or min(_EMIT_DOT_ROWS, bt)
        _check_pow2("block_t", bt)
        _check_pow2("rows", nr)
        if bt < 16 or not 16 <= nr <= bt or not mma_geometry:
            raise ValueError(
                f"dot=1: needs 16 <= rows <= block_t (got {nr}, {bt}), nope = rope (got {d - rd}, {rd}), even blocks"
            )
        scratch = torch.empty(triton.cdiv(t, bt) * bt, dtype=torch.int32, device=pooled.device)
        nw = _EMIT_DOT_WARPS_FEW if triton.cdiv(t, bt) <= num_sms(pooled.device) else _EMIT_DOT_WARPS
        _emit_indexer_dot_kernel[(triton.cdiv(t, bt),)](
            pooled, pooled.stride(0), t, norm_weight, float(eps), positions, inv_freq, emits.view(torch.uint8),
            slots, scratch, pages.data.shape[0] * bs, bs, *pargs,
            INTERP=interpreter_enabled(), RATIO=ratio, BLOCK_T=bt, ROWS=nr, DIM=d, NOPE=geo["NOPE"], HR=geo["HR"],
            HAD_SCALE=geo["HAD_SCALE"], num_warps=num_warps or nw, **kw, **pdl_launch(pooled.device), PDL_LATE=pdl_late,
            **({"num_stages": ns} if (ns := stages or _EMIT_DOT_STAGES) else {}),
        )  # fmt: skip
        return
    bt = block_t or min(triton.next_power_of_2(ratio), _EMIT_BLOCK_T)
    _check_pow2("block_t", bt)
    _emit_indexer_kernel[(triton.cdiv(t, bt),)](
        pooled, pooled.stride(0), t, norm_weight, float(eps), positions, inv_freq, ratio, emits.view(torch.uint8),
        slots, pages.data.shape[0] * bs, bs, *pargs,
        INTERP=interpreter_enabled(), BLOCK_T=bt, DIM=d, num_warps=num_warps or _EMIT_INDEXER_WARPS, **geo, **kw,
        **pdl_launch(pooled.device), PDL_LATE=pdl_late,
    )  # fmt: skip


# ============================================================================ fused decode step
def compress_decode(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    kv_state: torch.Tensor,
    score_state: torch.Tensor,
    counters: torch.Tensor,
    ratio: int,
    overlap: bool,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    slots: torch.Tensor,
    pages: EntryPages | KeyPages,
    fmt: FP8EntryFormat | MXFP4KeyFormat,
    kind: str = "main",
    backend: str = "auto",
    *,
    ape: torch.Tensor | None = None,
    state_pos: torch.Tensor | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> None:
    """A decode step of one compressor in ONE launch: ``compressor_step(decode=True)`` followed by
    ``emit_entries`` (same arguments, same results: state rows, entry / key bytes), with no pooled rows
    handed between launches.

    Programs are (token, channel block) as in the decode pool kernel; the last channel-block program of an
    emitting token to finish (an atomic counter per state slot, ``counters``) reads the token's pooled row
    back (written by the others, fenced by the counter's acquire-release) and emits the entry.
    Args: those of ``compressor_step`` and ``emit_entries`` (``slots``: physical entry / key slot per
        token, -1 = skip; a token without a state slot emits nothing), plus ``counters`` int32
        [num_state_slots], all 0 (each launch leaves them 0;
        ``CompressorState.counters``).  Concurrent launches on one ``counters`` tensor are not allowed.
        ``ape`` (fp32 [ratio, c*d], optional): then ``score`` is ``wgate(x)`` alone and the kernel adds
        ``ape[pos mod ratio]`` to each token's row (spec §3: the state keeps score + ape), saving the
        gather and add launches; the result is the same fp32 sum.  ``state_pos``: an online state
        (``compressor_step``; main compressors only): each token is one program over all d channels that pools
        and emits (no counters).
    Preconditions: decode (every request has exactly one token; the step contract of ``compressor_step``).
    Tuning (Triton path only): ``block_d``, ``num_warps`` as ``compressor_step``'s decode kernel.
    The torch backend runs ``compressor_step_reference`` + ``emit_entries_reference``.
    """
    _run_decode(
        _prepare_decode(
            kv, score, positions, token_slot, kv_state, score_state, counters, ratio, overlap, norm_weight, eps,
            inv_freq, slots, pages, fmt, kind, backend, ape, state_pos, block_d, num_warps,
        )
    )  # fmt: skip


class _DecodeLaunch(NamedTuple):
    """One compressor's checked decode step (``_prepare_decode``): the reference to run (torch path), or the Triton
    kernel's grid (t, nb) and arguments (positional, in ``_decode_emit_main`` / ``_decode_emit_indexer``'s order, and
    constexprs); nothing has run yet."""

    reference: Callable[[], None] | None
    kind: str
    t: int
    nb: int
    args: tuple
    geo: dict
    num_warps: int
    device: torch.device


def _prepare_decode(
    kv, score, positions, token_slot, kv_state, score_state, counters, ratio, overlap, norm_weight, eps, inv_freq,
    slots, pages, fmt, kind, backend, ape, state_pos, block_d, num_warps,
) -> _DecodeLaunch:  # fmt: skip
    """``compress_decode``'s checks and launch arguments (module docstring); raises before anything is written."""
    c, cm, t, cd, d = _check_step(kv, score, positions, token_slot, kv_state, score_state, ratio, overlap, state_pos)
    online = state_pos is not None
    if online and kind != "main":
        raise ValueError(f"state_pos (an online state): expected kind='main', got {kind!r}")
    bd_online = _online_block_d(block_d, d) if online else None
    dev = kv.device
    d_emit, rd = _check_emit(t, positions, norm_weight, inv_freq, slots, pages, fmt, ratio, kind)
    if d_emit != d:
        raise ValueError(f"fmt: expected a {kind} format of width {d} (the compressor's), got {d_emit}")
    check_tensor("counters", counters, dtype=torch.int32, shape=[kv_state.shape[0]], device=dev)
    if ape is not None:
        check_tensor("ape", ape, dtype=torch.float32, shape=[ratio, cd], device=dev)
    if not use_triton(backend, kv, score, positions, token_slot, kv_state, score_state, counters, slots):

        def reference() -> None:
            sc = score if ape is None else score + ape_rows(ape, positions, ratio)
            pooled, emits = compressor_step_reference(
                kv, sc, positions, token_slot, kv_state, score_state, ratio, overlap, state_pos
            )
            emits = emits & (token_slot >= 0) & (token_slot < kv_state.shape[0])  # nothing pooled: no entry
            emit_entries_reference(pooled, emits, positions, norm_weight, eps, inv_freq, slots, pages, fmt, ratio, kind)

        return _DecodeLaunch(reference, kind, t, 0, (), {}, 0, dev)
    if t == 0:
        return _DecodeLaunch(None, kind, 0, 0, (), {}, 0, dev)
    if not counters.is_contiguous() or not norm_weight.is_contiguous() or not inv_freq.is_contiguous():
        raise ValueError("counters, norm_weight, inv_freq: expected contiguous tensors")
    if ape is not None and not ape.is_contiguous():
        raise ValueError("ape: expected a contiguous tensor")
    block_r = triton.next_power_of_2(cm)
    bd = bd_online or block_d or max(16, min(triton.next_power_of_2(cd), _DECODE_TILE // block_r))
    _check_pow2("block_d", bd)
    positions, token_slot, slots = positions.contiguous(), token_slot.contiguous(), slots.contiguous()
    pooled = torch.empty(t, d, dtype=torch.float32, device=dev)
    emits = torch.empty(t, dtype=torch.uint8, device=dev)
    head = _kernel_head(kv, score, positions, token_slot, kv_state, score_state)
    head = head + (pooled, emits, t, counters, ape if ape is not None else kv)
    head = head + (state_pos if online else counters,)
    geo = dict(M=ratio, CM=cm, D=d, OVERLAP=overlap, C=c, BLOCK_R=block_r, BLOCK_D=bd, N_POOL=triton.cdiv(d, bd))
    geo.update(HAS_APE=ape is not None, INTERP=interpreter_enabled())
    if online:
        geo["ONLINE"] = True
    emit = (norm_weight, float(eps), inv_freq, slots)
    if kind == "main":
        pargs, kw = _fp8_args(pages, fmt)
        args = (*head, *emit, pages.num_slots, pages.entries_per_page, *pargs)
        geo.update(NOPE=fmt.nope_dim, VEC_RUNS=fmt.tile % _VEC_ELEMS == 0, **kw)
    else:
        pargs, kw = _mxfp4_args(pages, fmt)
        bs = pages.entries_per_page
        args = (*head, *emit, pages.data.shape[0] * bs, bs, *pargs)
        geo.update(**_indexer_emit_geometry(fmt, d, rd), **kw)
    return _DecodeLaunch(None, kind, t, triton.cdiv(cd, bd), args, geo, num_warps or _DECODE_WARPS, dev)


def _run_decode(launch: _DecodeLaunch) -> None:
    """Run one prepared compressor decode step: its reference, or its one launch."""
    if launch.reference is not None:
        launch.reference()
    elif launch.t:
        main = launch.kind == "main"
        kernel = _compressor_decode_emit_main_kernel if main else _compressor_decode_emit_indexer_kernel
        kernel[(launch.t, launch.nb)](
            *launch.args, **launch.geo, num_warps=launch.num_warps, **pdl_launch(launch.device)
        )


# the CSA kernel's shared constexprs (one ratio) and the indexer's renamed ones (``_compressor_decode_emit_csa_kernel``)
_CSA_SHARED = ("M", "CM", "OVERLAP", "C", "BLOCK_R", "INTERP")
_CSA_INDEXER = {"D": "I_D", "BLOCK_D": "I_BLOCK_D", "N_POOL": "I_N_POOL", "NOPE": "I_NOPE", "HR": "I_HR",
                "FLOOR": "I_FLOOR", "Q_EXP": "I_Q_EXP", "Q_MANT": "I_Q_MANT", "HAS_APE": "I_HAS_APE"}  # fmt: skip


def compress_decode_csa(main: dict, indexer: dict, backend: str = "auto") -> None:
    """A CSA layer's decode step of both compressors: ``compress_decode(**main, kind="main")`` and
    ``compress_decode(**indexer, kind="indexer")`` (each dict: ``compress_decode``'s arguments but ``kind`` and
    ``backend``), in ONE launch on the Triton path where they share the step (the same tokens, ratio and warps; a
    non-online main state): programs (token, channel block) over both compressors' channel blocks
    (``_compressor_decode_emit_csa_kernel``), the same bytes as the two launches.  Both are checked before anything
    is written."""
    lm = _prepare_decode(**_decode_kwargs(main, "main", backend))
    li = _prepare_decode(**_decode_kwargs(indexer, "indexer", backend))
    together = (
        lm.reference is None and li.reference is None and lm.t == li.t and lm.t > 0 and "ONLINE" not in lm.geo
        and lm.num_warps == li.num_warps and all(lm.geo[k] == li.geo[k] for k in _CSA_SHARED)
    )  # fmt: skip
    if not together:
        _run_decode(lm)
        _run_decode(li)
        return
    geo = dict(lm.geo)
    for k, v in li.geo.items():
        if k not in _CSA_SHARED:
            geo[_CSA_INDEXER.get(k, k)] = v
    _compressor_decode_emit_csa_kernel[(lm.t, lm.nb + li.nb)](
        *lm.args, *li.args, NB_MAIN=lm.nb, **geo, num_warps=lm.num_warps, **pdl_launch(lm.device)
    )


_DECODE_PARAMS = (
    "kv", "score", "positions", "token_slot", "kv_state", "score_state", "counters", "ratio", "overlap", "norm_weight",
    "eps", "inv_freq", "slots", "pages", "fmt",
)  # fmt: skip
_DECODE_OPTIONS = {"ape": None, "state_pos": None, "block_d": None, "num_warps": None}


def _decode_kwargs(call: dict, kind: str, backend: str) -> dict:
    """``_prepare_decode``'s keywords from one ``compress_decode_csa`` call dict (ValueError on a missing or unknown
    name)."""
    missing = [k for k in _DECODE_PARAMS if k not in call]
    unknown = [k for k in call if k not in _DECODE_PARAMS and k not in _DECODE_OPTIONS]
    if missing or unknown:
        raise ValueError(f"{kind}: expected compress_decode's arguments, missing {missing}, unknown {unknown}")
    return {**_DECODE_OPTIONS, **call, "kind": kind, "backend": backend}
