"""A non-decode (prefill) step of one compressor: pool the entries that complete, emit them, roll the state
(``compress_prefill``; the pieces are ``compressor.compressor_step`` and ``compressor.emit_entries``).

Two ways to run it on the Triton path, same arguments, same results:

- **In order** (default): ``compressor_step``'s pool launch writes each completed entry's pooled fp32 row to a
  scratch tensor, its state-write launch rolls the state, and ``emit_entries`` reads the pooled rows back to
  finish and store the entries: 3 launches (4 with an online state and no ``counters``).  ``overlap_write`` puts
  the state write on a side stream beside the emit (both wait only for the pool).  With programmatic dependent
  launch on (``dispatch.PDL``) the same overlap comes without a second stream: the state write loads its rows before
  it waits for the pool, and the emit (``pdl_late``) runs whole before it waits for the state write.
- **Fused emit** (``fuse_emit``): where one pool program can hold a token's whole pooled row -- the pool tile
  [next_pow2(c*m), d] is at most ``_FUSE_TILE_MAX`` values: CSA main [8, 512] and the CSA indexer [8, 128], not
  HCA's [128, 512] -- the pool program emits the entry itself, then the state write runs: 2 launches, and the
  pooled rows of the main compressor never leave registers (the indexer's go through an L2-resident scratch row
  that the same program reads back after a CTA barrier, as the fused decode kernel's do).  The pool programs then
  span all d channels (no channel split; for the CSA indexer at T >= 32,768 the in-order pool splits them).

Emit numerics are those of ``emit_entries`` (RMSNorm in fp32 on the bf16-rounded pooled row, RoPE at the entry
position, FP8 / Hadamard + MXFP4): the fused kernels call the same Triton helpers on the same fp32 pooled values;
only the RMSNorm / Hadamard sums may be taken in another order (the program's warps differ), as between any two
Triton launch geometries of ``emit_entries``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.formats.fp8_entry import EntryPages, FP8EntryFormat
from dsv4.formats.mxfp4_key import KeyPages, MXFP4KeyFormat
from dsv4.kernels._triton_sync import pdl_enter
from dsv4.kernels.cache.compressor import (
    _ape_kw,
    _check_ape,
    _check_step,
    _emit_indexer_rows,
    _indexer_emit_geometry,
    _kernel_head,
    _launch_state_write,
    _pool_block_head,
    _pool_block_token,
    _pool_launch_params,
    _pool_token,
    _state_in_pool,
    check_emit_arguments,
    compressor_step,
    emit_entries,
)
from dsv4.kernels.cache.store import _VEC_ELEMS, _fp8_args, _fp8_row_offsets, _mxfp4_args, _norm_rope_rows
from dsv4.kernels.dispatch import pdl_launch, use_triton

__all__ = ["compress_prefill"]

# The state write and the emit of a prefill both wait only for the pool: on one stream they run one after the other,
# on two they can share the GPU (the emit's grid is one wave at 65,536 tokens).  Off until measured on the H200
# (``run_h200.sh overlap_s18``).
_OVERLAP_WRITE = False
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}
# The pool programs emit the entries themselves where a program holds a whole pooled row.  Off: it loses on the H200
# (session 19, ``2026-12-05_h200_write_writes_s19.txt``, graph time, in order -> fused): CSA main 8,192 tokens 28.3 ->
# 33.4 us, 65,536 155.8 -> 191.8; CSA indexer 13.3 -> 17.1 and 56.3 -> 115.0 (the fused pools lose their occupancy).
_FUSE_EMIT = False
_FUSE_TILE_MAX = 4096  # [rows, d] values of a fused pool program's tile (CSA main [8, 512]; HCA's [128, 512] not)


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The per-device stream ``compress_prefill`` writes the state on; None (run in order) when it does not exist yet
    and the current stream is being captured (a stream is created outside a capture only)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDE_STREAMS.get(idx)
    if side is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        side = _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return side


def compress_prefill(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    token_slot: torch.Tensor,
    kv_state: torch.Tensor,
    score_state: torch.Tensor,
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
    state_pos: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    ape: torch.Tensor | None = None,
    overlap_write: bool | None = None,
    fuse_emit: bool | None = None,
    state_unread: bool = False,
    step_kw: dict | None = None,
    emit_kw: dict | None = None,
) -> None:
    """A non-decode step of one compressor: ``compressor_step`` then ``emit_entries`` (same arguments, same effect).

    The emit's arguments are checked first, so a call that fails changes nothing.  ``overlap_write`` (default
    _OVERLAP_WRITE; CUDA Triton path only): the state write runs on a per-device side stream while the emit runs on
    the caller's; both start after the pool, and the caller's stream waits for the side stream before this returns
    (every tensor the write reads is referenced here until then), so to the caller (and in a captured CUDA graph, as
    two branches joined) the call stays one ordered unit.  The
    side stream is created on first use outside a capture; a call captured before that runs in order.
    ``fuse_emit`` (default _FUSE_EMIT; Triton path): the pool kernel emits the entries (module docstring) where the
    geometry allows (``_fusable``), else the call runs in order; ``overlap_write`` then has nothing to overlap and
    is ignored.  ``step_kw`` / ``emit_kw``: tuning keywords of the two calls (the fused launch takes the pool and
    state-write ones of ``step_kw``, all but ``block_d`` and ``row_loads``, and no ``emit_kw``).
    A token without a state slot emits nothing when fused; in order, its entry slot is written from a pooled row
    that was never computed, so give such tokens entry slot -1 (padding does).  ``counters``: ``compressor_step``'s
    (with an online state, its positions are then written by its state write: one launch fewer).  ``ape``:
    ``compressor_step``'s (``score`` is ``wgate(x)`` alone; the kernels add ``ape[pos mod ratio]`` as they read it).
    ``state_unread``: ``compressor_step``'s promise (no pooling of the step reads a state row,
    ``compressor.state_unread_by_step``): in order, the pool launch then writes the state too (up to
    ``compressor._STATE_IN_POOL_MAX_T`` tokens; an online state only with ``counters`` and
    ``compressor._ONLINE_STATE_IN_POOL``) and the emit follows it (2 launches; ``overlap_write`` has nothing to
    overlap); the fused launch keeps its own state write.
    """
    check_emit_arguments(positions, norm_weight, inv_freq, slots, pages, fmt, ratio, kind, backend)
    geometry = _check_step(kv, score, positions, token_slot, kv_state, score_state, ratio, overlap, state_pos)
    d = geometry[-1]
    d_fmt = fmt.head_dim if kind == "main" else fmt.dim
    if d != d_fmt:
        raise ValueError(f"fmt: expected a {kind} format of width {d} (the compressor's), got {d_fmt}")
    fuse = _FUSE_EMIT if fuse_emit is None else bool(fuse_emit)
    if fuse and _fusable(
        kv, score, positions, token_slot, kv_state, score_state, geometry, norm_weight, inv_freq, slots, fmt, kind,
        backend, state_pos, step_kw, emit_kw,
    ):  # fmt: skip
        _pool_emit(
            kv, score, positions, token_slot, kv_state, score_state, geometry, ratio, overlap, norm_weight, eps,
            inv_freq, slots, pages, fmt, kind, dict(step_kw or {}), ape,
        )  # fmt: skip
        return
    positions, token_slot = positions.contiguous(), token_slot.contiguous()  # held here until the join below
    side = None
    if (_OVERLAP_WRITE if overlap_write is None else overlap_write) and kv.is_cuda and use_triton(backend, kv, score):
        side = _side_stream(kv.device)
    in_pool = _state_in_pool(state_unread, state_pos is not None, kv.shape[0], counters is not None)  # (its rule)
    if in_pool:
        side = None
    pooled, emits = compressor_step(
        kv, score, positions, token_slot, kv_state, score_state, ratio, overlap, backend=backend,
        state_pos=state_pos, counters=counters, ape=ape, write_stream=side, state_unread=in_pool,
        **(step_kw or {}),
    )  # fmt: skip
    try:
        # in order, the state write is the launch before the emit: neither touches what the other reads or writes,
        # and the pool that wrote ``pooled`` came before it, so with PDL the emit runs beside the state write (not
        # where the pool itself wrote the state: the launch before the emit is then the one that wrote ``pooled``)
        emit_entries(
            pooled, emits, positions, norm_weight, eps, inv_freq, slots, pages, fmt, ratio, kind, backend=backend,
            pdl_late=side is None and not in_pool, **(emit_kw or {}),
        )  # fmt: skip
    finally:
        if side is not None:
            torch.cuda.current_stream(kv.device).wait_stream(side)


# ============================================================================ fused emit
def _fusable(
    kv, score, positions, token_slot, kv_state, score_state, geometry, norm_weight, inv_freq, slots, fmt, kind, backend,
    state_pos, step_kw, emit_kw,
) -> bool:  # fmt: skip
    """Whether ``compress_prefill(fuse_emit=True)`` can run this step as the fused launch: Triton path, a row-ring
    state (not online), no emit tuning and no step tuning the fused kernels lack, d a power of two and the pool tile
    within _FUSE_TILE_MAX values, contiguous weights; for the main kind an FP8 format whose rope is the one tile after
    the nope tiles (the pooled row splits in registers as [NT + 1 tiles] = [d]).  ``geometry``: ``_check_step``'s
    (c, c*m, T, c*d, d)."""
    _, cm, _, _, d = geometry
    if state_pos is not None or emit_kw or (step_kw or {}).get("row_loads") or (step_kw or {}).get("block_d"):
        return False
    if not use_triton(backend, kv, score, positions, token_slot, kv_state, score_state, slots):
        return False
    if d & (d - 1) or triton.next_power_of_2(cm) * d > _FUSE_TILE_MAX:
        return False
    if not (norm_weight.is_contiguous() and inv_freq.is_contiguous()):
        return False
    if kind == "main":
        nt_pad = triton.next_power_of_2(fmt.n_tiles)
        return fmt.nope_dim == fmt.n_tiles * fmt.tile and fmt.rope_dim == fmt.tile and nt_pad * fmt.tile == d
    return True


def _pool_emit(
    kv, score, positions, token_slot, kv_state, score_state, geometry, ratio, overlap, norm_weight, eps, inv_freq,
    slots, pages, fmt, kind, step_kw, ape=None,
) -> None:  # fmt: skip
    """The fused launch (pool + emit, ``_pool_emit_main_kernel`` / ``_pool_emit_indexer_kernel``), then the state
    write (``compressor._launch_state_write``), for a step ``_fusable`` accepted (``geometry``: ``_check_step``'s)."""
    _, cm, t, cd, d = geometry
    if t == 0:
        return
    _check_ape(ape, ratio, cd, kv.device)
    positions, token_slot, slots = positions.contiguous(), token_slot.contiguous(), slots.contiguous()
    write = [step_kw.pop(k, None) for k in ("write_block_t", "write_warps", "write_lanes")]
    grid, kw, bd, fast_exp = _pool_launch_params(
        kv, score, t, d, cm, ratio, False, whole_rows=True, ape=ape is not None, **step_kw
    )
    for k in ("BLOCK_D", "ROW_LOADS", "ONLINE", "ONLINE_ROWS_IN_STEP"):
        kw.pop(k)
    head = _kernel_head(kv, score, positions, token_slot, kv_state, score_state)
    emit = (norm_weight, float(eps), inv_freq, slots)
    kw.update(_ape_kw(ape, kv))
    if kind == "main":
        pargs, fkw = _fp8_args(pages, fmt)
        _pool_emit_main_kernel[grid[:1]](
            *head, t, *emit, pages.num_slots, pages.entries_per_page, *pargs, OVERLAP=overlap, NOPE=fmt.nope_dim,
            VEC_RUNS=fmt.tile % _VEC_ELEMS == 0, **kw, **fkw, **pdl_launch(kv.device),
        )  # fmt: skip
    else:
        geo = _indexer_emit_geometry(fmt, d, 2 * inv_freq.shape[0])
        pargs, fkw = _mxfp4_args(pages, fmt)
        bs = pages.entries_per_page
        pooled = torch.empty(t, d, dtype=torch.float32, device=kv.device)  # the emitting rows' scratch
        _pool_emit_indexer_kernel[grid[:1]](
            *head, t, pooled, *emit, pages.data.shape[0] * bs, bs, *pargs, OVERLAP=overlap, **geo, **kw, **fkw,
            **pdl_launch(kv.device),
        )  # fmt: skip
    _launch_state_write(
        head, t, d, cd, cm, ratio, triton.next_power_of_2(cm), bd, False, None, fast_exp, positions, token_slot,
        kv_state.shape[0], *write, None, ape,
    )  # fmt: skip


@triton.jit
def _take_flagged(a, fa, b, fb):
    """``tl.reduce`` combine of (value, flag) pairs: the flagged value (no arithmetic: -0.0 stays -0.0)."""
    return tl.where(fb, b, a), fa | fb


@triton.jit
def _entry_row_split(out, tin, NT: tl.constexpr, NT_PAD: tl.constexpr, TILE: tl.constexpr, HR: tl.constexpr):
    """A pooled row ``out`` [NT_PAD * TILE] as ``_norm_rope_rows`` takes it: the nope tiles [1, NT_PAD, TILE] (tile
    NT and above masked to 0 by ``tin``) and the rope pairs [1, HR, 2] = tile NT (TILE = 2 * HR), picked out of the
    tiles by a select-reduction (exact, signed zeros included)."""
    xn = tl.where(tin, tl.reshape(out, [1, NT_PAD, TILE]), 0.0)
    x4 = tl.reshape(out, [1, NT_PAD, HR, 2])
    f4 = tl.broadcast_to((tl.arange(0, NT_PAD) == NT)[None, :, None, None], [1, NT_PAD, HR, 2])
    xr, _ = tl.reduce((x4, f4), 1, _take_flagged)
    return xn, xr


@triton.jit
def _pool_emit_main_kernel(
    kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots, T,
    w_ptr, eps, inv_ptr, eslot_ptr, num_slots, bs, nope_ptr, nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr,
    scale_sp, scale_sr, M: tl.constexpr, CM: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, DIV_AFTER: tl.constexpr, FAST_ROWS: tl.constexpr,
    FAST_EXP: tl.constexpr, INTERP: tl.constexpr, NOPE: tl.constexpr, NT: tl.constexpr, NT_PAD: tl.constexpr,
    TILE: tl.constexpr, HR: tl.constexpr, FLOOR: tl.constexpr, QMAX: tl.constexpr, Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr, VEC_RUNS: tl.constexpr,
    ape_ptr=None, HAS_APE: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program a: the pool kernel's token block a over all D channels (``_compressor_pool_kernel``), each emitting
    token's pooled row [D] then, from registers, its FP8 entry (``_norm_rope_rows``: RMSNorm -> RoPE at the entry
    position -> quantise -> store at ``eslot_ptr[i]``, -1 = skip).  The row splits as the emit loads it: nope tiles
    [1, NT_PAD, TILE] (tile NT, the rope, masked to 0) and rope pairs [1, HR, 2] = tile NT (D = NT_PAD * TILE,
    TILE = 2 * HR)."""
    pdl_enter(PDL)
    a = tl.program_id(0).to(tl.int64)
    tt, ss, tp, sp, work = _pool_block_head(
        a, 0, T, pos_ptr, tslot_ptr, pos_ptr, num_state_slots, M, BLOCK_T, BLOCK_R, False, False
    )
    noff, tin, roff, _rin = _fp8_row_offsets(D, NOPE, NT, NT_PAD, TILE, HR, VEC_RUNS)
    kk = tl.arange(0, BLOCK_T)
    k = tl.min(tl.where(work, kk, BLOCK_T), axis=0)
    while k < BLOCK_T:
        t, slot, i0 = _pool_block_token(a, k, kk, tt, ss, tp, sp, BLOCK_T, BLOCK_R, False)
        i = a * BLOCK_T + k
        out = _pool_token(
            i, t, slot, 0, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
            kv_ptr, T, M, CM, D, OVERLAP, BLOCK_R, D, False, i0, False, ape_ptr, HAS_APE, DIV_AFTER, FAST_ROWS,
            FAST_EXP, INTERP, False, False,
        )  # fmt: skip
        xn, xr = _entry_row_split(out, tin, NT, NT_PAD, TILE, HR)
        ii = i + tl.arange(0, 1)
        _norm_rope_rows(
            xn, xr, ii, ii >= 0, w_ptr, eps, pos_ptr, inv_ptr, eslot_ptr, num_slots, bs, kv_ptr, 0, nope_ptr, nope_sp,
            nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp, scale_sr, noff, tin, roff, M, False, INTERP,
            1, D, NOPE, NT, NT_PAD, TILE, HR, FLOOR, QMAX, Q_EXP, Q_MANT,
        )  # fmt: skip
        k = tl.min(tl.where(work & (kk > k), kk, BLOCK_T), axis=0)


@triton.jit
def _pool_emit_indexer_kernel(
    kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr, num_state_slots, T,
    pooled_ptr, w_ptr, eps, inv_ptr, eslot_ptr, num_slots, bs, data_ptr, data_sp, data_sr, scale_ptr, scale_sp,
    scale_sr, M: tl.constexpr, CM: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr, DIV_AFTER: tl.constexpr, FAST_ROWS: tl.constexpr, FAST_EXP: tl.constexpr,
    INTERP: tl.constexpr, NOPE: tl.constexpr, HR: tl.constexpr, HAD_SCALE: tl.constexpr, KB: tl.constexpr,
    NA: tl.constexpr, RA: tl.constexpr, NB: tl.constexpr, HB: tl.constexpr, FLOOR: tl.constexpr, Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
    ape_ptr=None, HAS_APE: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """``_pool_emit_main_kernel`` for the CSA indexer's compressor: each emitting token's pooled row goes to its
    ``pooled_ptr`` row, a CTA barrier, and ``_emit_indexer_rows`` reads it back (RMSNorm -> RoPE -> Hadamard ->
    MXFP4 key at ``eslot_ptr[i]``, -1 = skip)."""
    pdl_enter(PDL)
    a = tl.program_id(0).to(tl.int64)
    tt, ss, tp, sp, work = _pool_block_head(
        a, 0, T, pos_ptr, tslot_ptr, pos_ptr, num_state_slots, M, BLOCK_T, BLOCK_R, False, False
    )
    kk = tl.arange(0, BLOCK_T)
    k = tl.min(tl.where(work, kk, BLOCK_T), axis=0)
    while k < BLOCK_T:
        t, slot, i0 = _pool_block_token(a, k, kk, tt, ss, tp, sp, BLOCK_T, BLOCK_R, False)
        i = a * BLOCK_T + k
        _pool_token(
            i, t, slot, 0, kv_ptr, sc_ptr, stride_kv, stride_sc, pos_ptr, tslot_ptr, kvs_ptr, scs_ptr, st_ss, st_sr,
            pooled_ptr, T, M, CM, D, OVERLAP, BLOCK_R, D, False, i0, False, ape_ptr, HAS_APE, DIV_AFTER, FAST_ROWS,
            FAST_EXP, INTERP, False, True,
        )  # fmt: skip
        tl.debug_barrier()  # the emit reads back values other threads of this program stored
        ii = i + tl.arange(0, 1)
        sl = tl.load(eslot_ptr + ii).to(tl.int64)
        _emit_indexer_rows(
            pooled_ptr, D, ii, (sl >= 0) & (sl < num_slots), sl, w_ptr, eps, pos_ptr, inv_ptr, M, bs, data_ptr,
            data_sp, data_sr, scale_ptr, scale_sp, scale_sr, INTERP, 1, D, NOPE, HR, HAD_SCALE, KB, NA, RA, NB, HB,
            FLOOR, Q_EXP, Q_MANT,
        )  # fmt: skip
        k = tl.min(tl.where(work & (kk > k), kk, BLOCK_T), axis=0)
