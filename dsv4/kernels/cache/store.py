"""Write path of the cache: quantise rows and store them at physical slots (spec §2 step 2, §5, §13).

Three operations, each a validating public function over a PyTorch reference and a Triton kernel:

- ``store_fp8_entries``: rows [N, head_dim] -> FP8 entries (MODEL1 pages) at ``slots``;
- ``store_mxfp4_keys``: rows [N, 128] -> MXFP4 indexer keys at ``slots``;
- ``store_window``: the raw window KV (wkv output) -> kv_norm -> RoPE(t) -> FP8 entry at ``slots``,
  optionally also returning the normed + roped bf16 rows (the prefill attention's own keys).

Slots are physical (``page * entries_per_page + row``).  A slot < 0 or >= the number of slots is
skipped; nothing else in the pages changes (the FP8 pad byte is never written: the pool zeroes it).
Slots of one call must be distinct: two rows for one slot leave undefined bytes (on a GPU an entry may
mix one row's scales with the other's data).

How the Triton kernels quantise (the same bytes on a GPU and under ``TRITON_INTERPRET=1``): all
rounding is done on fp32 bits (``_triton_quant``): power-of-two scale from the exponent field,
``x * 2**-e`` (exact), round-to-nearest-even to e4m3 / e2m1 / bf16 by integer arithmetic.  The fp8
pages are written through ``uint8`` views and the bf16 rope lanes through ``int16`` views, so no fp8
or bf16 cast of Triton is relied on.  RoPE's cos/sin are computed in the kernel
(``_triton_quant.rope_cos_sin_at``: the reference's fp32 angle ``fp32(pos) * inv_freq`` bit for bit,
then libdevice's accurate cosf/sinf; positions reach 1M, where approximate ``tl.cos`` is not
trustworthy).  RMSNorm uses IEEE ``sqrt_rn``/``div_rn``; its sum order differs from PyTorch's, so the normed
values agree with the reference to fp32 rounding (after the bf16 rounding almost always exactly).

Each Triton path is one kernel launch with no host synchronisation (no ``.item()``/``nonzero``), no
copies and no allocation, so it can be captured in a CUDA graph; the public functions only check
metadata in Python.  Grids: ``store_fp8_entries`` / ``store_mxfp4_keys`` one program per row;
``store_window`` and the main emit one program of one warp per row by default (``_ROW_BLOCK``: a
[1, 8, 64] nope tile + [1, 32, 2] rope pairs, 16-byte vectors per thread, every reduction inside the
warp); tunable to blocks of rows and several blocks per program (``block_t``, ``num_warps``, ``iters``).
On a GPU the kernel rounds to bf16 / e4m3 with the hardware's round-to-nearest-even conversions (the same
values as the integer emulation used under the interpreter).

"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.formats.fp8_entry import FP8_DTYPE, ROPE_DTYPE, EntryPages, FP8EntryFormat
from dsv4.formats.mxfp4_key import KeyPages, MXFP4KeyFormat
from dsv4.kernels._triton_sync import pdl_end, pdl_enter, pdl_start
from dsv4.kernels.cache._triton_quant import (
    bf16_bits,
    bf16_rne,
    bf16_round,
    ceil_log2_ratio,
    e2m1_code,
    e4m3_code,
    pow2_neg,
    qmax_split,
    rope_cos_sin_pos,
)
from dsv4.kernels.cache.ring import (
    record_ring_heads_reference,
    record_ring_positions_reference,
    ring_window_from_slots_reference,
)
from dsv4.kernels.dispatch import interpreter_enabled, pdl_launch, use_triton
from dsv4.model.functional import apply_rope, rms_norm

__all__ = [
    "store_fp8_entries",
    "store_fp8_entries_reference",
    "store_mxfp4_keys",
    "store_mxfp4_keys_reference",
    "store_window",
    "store_window_reference",
    "rope_cos_sin",
]

_FLOAT_IN = (torch.bfloat16, torch.float16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)
# store_window / main emit geometry (``_norm_rope_fp8_kernel``): one row per block and one warp per row by
# default (sm_90a SASS: ~300 instructions per row on the main path, no shared memory, no barriers; blocks of
# several rows over several warps need cross-warp reductions and cost 340-590 per row), _ROW_ITERS blocks per
# program (the next one prefetched during the current one's compute).
_ROW_BLOCK = 1
_MAX_WARPS = 8
_ROW_ITERS = 1
# main emit (``HAS_EMIT``): rows per program whose emit flags are scanned at once, default min(ratio, this).
# (H200 write_v5: HCA prefill 65,536 took 172.7 us after the emit moved to one-row programs, 150.4 before
# with 8-row programs: 65,536 programs of which 512 have a row to emit.)
_EMIT_SCAN_MAX = 128
_EMIT_SCAN_MIN_PROGRAMS = 512
# values per contiguous run the window kernel hands each thread: 16 bytes of bf16 (one 128-bit access)
_VEC_ELEMS = 8
_VEC = tl.constexpr(_VEC_ELEMS)


# ============================================================================ validation helpers
def _check_entry_pages(pages: EntryPages, fmt: FP8EntryFormat) -> None:
    check_tensor("pages.nope", pages.nope, dtype=FP8_DTYPE, shape=[None, None, fmt.nope_dim])
    p, bs = pages.nope.shape[:2]
    check_tensor("pages.rope", pages.rope, dtype=ROPE_DTYPE, shape=[p, bs, fmt.rope_dim], device=pages.nope.device)
    check_tensor("pages.scale", pages.scale, dtype=torch.uint8, shape=[p, bs, fmt.n_tiles], device=pages.nope.device)
    for name, t in (("pages.nope", pages.nope), ("pages.rope", pages.rope), ("pages.scale", pages.scale)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}: expected unit stride in the last dim, got strides {t.stride()}")


def _check_key_pages(pages: KeyPages, fmt: MXFP4KeyFormat) -> None:
    check_tensor("pages.data", pages.data, dtype=torch.uint8, shape=[None, None, fmt.data_bytes])
    p, bs = pages.data.shape[:2]
    check_tensor("pages.scale", pages.scale, dtype=torch.uint8, shape=[p, bs, fmt.n_blocks], device=pages.data.device)
    for name, t in (("pages.data", pages.data), ("pages.scale", pages.scale)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}: expected unit stride in the last dim, got strides {t.stride()}")


def _check_rows(name: str, x: torch.Tensor, width: int, device: torch.device) -> int:
    check_tensor(name, x, dtype=_FLOAT_IN, ndim=2, device=device)
    if x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(
            f"{name}: expected shape [N, {width}] with unit inner stride, got {list(x.shape)} {x.stride()}"
        )
    return x.shape[0]


def _check_slots(slots: torch.Tensor, n: int, device: torch.device) -> None:
    check_tensor("slots", slots, dtype=_SLOT_DTYPES, shape=[n], device=device)


def _valid_rows(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask of rows with an in-range slot, their page, their row) — a host sync (reference only)."""
    s = slots.long()
    ok = (s >= 0) & (s < num_slots)
    return ok, s[ok], ok.nonzero().squeeze(1)


# ============================================================================ references
def store_fp8_entries_reference(x: torch.Tensor, slots: torch.Tensor, pages: EntryPages, fmt: FP8EntryFormat) -> None:
    """PyTorch definition of ``store_fp8_entries`` (``fmt.quantize`` then an indexed write)."""
    bs = pages.entries_per_page
    ok, s, _ = _valid_rows(slots, pages.num_slots)
    if not bool(ok.any()):
        return
    nope, rope, scale = fmt.quantize(x[ok])
    pg, rw = s // bs, s % bs
    pages.nope.view(torch.uint8)[pg, rw] = nope.view(torch.uint8)
    pages.rope[pg, rw] = rope
    pages.scale[pg, rw] = scale


def store_mxfp4_keys_reference(x: torch.Tensor, slots: torch.Tensor, pages: KeyPages, fmt: MXFP4KeyFormat) -> None:
    """PyTorch definition of ``store_mxfp4_keys`` (``fmt.quantize`` then an indexed write)."""
    bs = pages.entries_per_page
    ok, s, _ = _valid_rows(slots, pages.data.shape[0] * bs)
    if not bool(ok.any()):
        return
    packed, scale = fmt.quantize(x[ok])
    pg, rw = s // bs, s % bs
    pages.data[pg, rw] = packed
    pages.scale[pg, rw] = scale


def rope_cos_sin(rope_positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rope_dim/2] fp32 of the angle ``fp32(pos) * inv_freq`` (fp32), as the reference."""
    ang = rope_positions.float().unsqueeze(-1) * inv_freq.float().unsqueeze(0)
    return ang.cos(), ang.sin()


def store_window_reference(
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    slots: torch.Tensor,
    pages: EntryPages,
    fmt: FP8EntryFormat,
    out: torch.Tensor | None = None,
    copy_to: tuple[torch.Tensor, EntryPages] | None = None,
) -> None:
    """PyTorch definition of ``store_window``: kv_norm -> RoPE(pos) -> ``store_fp8_entries_reference`` (also at
    ``copy_to`` = (slots, pages) when given)."""
    y = apply_rope(rms_norm(kv, norm_weight, eps), positions, inv_freq)
    if out is not None:
        out.copy_(y)
    store_fp8_entries_reference(y, slots, pages, fmt)
    if copy_to is not None:
        store_fp8_entries_reference(y, copy_to[0], copy_to[1], fmt)


# ============================================================================ Triton kernels
@triton.jit
def _fp8_store_row(
    xn,  # [NT_PAD, TILE] fp32 nope values
    xe,  # [HR] fp32 even rope lanes (bf16-representable)
    xo,  # [HR] fp32 odd rope lanes
    page,
    row,
    ok,
    nope_ptr,
    nope_sp,
    nope_sr,
    rope_ptr,
    rope_sp,
    rope_sr,
    scale_ptr,
    scale_sp,
    scale_sr,
    NT: tl.constexpr,
    NT_PAD: tl.constexpr,
    TILE: tl.constexpr,
    HR: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
):
    tiles = tl.arange(0, NT_PAD)
    cols = tl.arange(0, TILE)
    # (scalar bool & block bool is mis-typed by the interpreter: broadcast ``ok`` by hand)
    tmask = (tiles < NT) & ((tl.zeros([NT_PAD], tl.int32) + ok.to(tl.int32)) != 0)
    amax = tl.max(tl.abs(xn), axis=1)
    e = ceil_log2_ratio(amax, FLOOR, Q_EXP, Q_MANT)
    v = xn * pow2_neg(e)[:, None]
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    code = e4m3_code(v)
    nbase = nope_ptr + page * nope_sp + row * nope_sr
    tl.store(nbase + tiles[:, None] * TILE + cols[None, :], code.to(tl.uint8), mask=tmask[:, None])
    sbyte = tl.minimum(tl.maximum(e + 127, 0), 254)
    tl.store(scale_ptr + page * scale_sp + row * scale_sr + tiles, sbyte.to(tl.uint8), mask=tmask)
    j = tl.arange(0, HR)
    jmask = (tl.zeros([HR], tl.int32) + ok.to(tl.int32)) != 0
    rbase = rope_ptr + page * rope_sp + row * rope_sr
    tl.store(rbase + 2 * j, bf16_bits(xe), mask=jmask)
    tl.store(rbase + 2 * j + 1, bf16_bits(xo), mask=jmask)


@triton.jit
def _store_fp8_kernel(
    x_ptr,
    stride_x,
    slot_ptr,
    num_slots,
    bs,
    nope_ptr,
    nope_sp,
    nope_sr,
    rope_ptr,
    rope_sp,
    rope_sr,
    scale_ptr,
    scale_sp,
    scale_sr,
    NOPE: tl.constexpr,
    NT: tl.constexpr,
    NT_PAD: tl.constexpr,
    TILE: tl.constexpr,
    HR: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        page = slot // bs
        row = slot % bs
        tiles = tl.arange(0, NT_PAD)
        cols = tl.arange(0, TILE)
        xrow = x_ptr + i * stride_x
        xn = tl.load(xrow + tiles[:, None] * TILE + cols[None, :], mask=(tiles < NT)[:, None], other=0.0)
        j = tl.arange(0, HR)
        xe = bf16_round(tl.load(xrow + NOPE + 2 * j).to(tl.float32))
        xo = bf16_round(tl.load(xrow + NOPE + 2 * j + 1).to(tl.float32))
        _fp8_store_row(
            xn.to(tl.float32), xe, xo, page, row, slot >= 0,
            nope_ptr, nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp, scale_sr,
            NT, NT_PAD, TILE, HR, FLOOR, QMAX, Q_EXP, Q_MANT,
        )  # fmt: skip


@triton.jit
def _norm_rope_rows(
    xn,  # [BLOCK_T, NT_PAD, TILE] the nope values as loaded (0 where masked)
    xr,  # [BLOCK_T, HR, 2] the rope pairs as loaded
    ii,  # [BLOCK_T] int64 row indices
    go,  # [BLOCK_T] rows to process
    w_ptr,
    eps,
    pos_ptr,
    inv_ptr,
    slot_ptr,
    num_slots,
    bs,
    out_ptr,
    stride_out,
    nope_ptr,
    nope_sp,
    nope_sr,
    rope_ptr,
    rope_sp,
    rope_sr,
    scale_ptr,
    scale_sp,
    scale_sr,
    noff,
    tin,
    roff,
    RATIO: tl.constexpr,
    HAS_OUT: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NOPE: tl.constexpr,
    NT: tl.constexpr,
    NT_PAD: tl.constexpr,
    TILE: tl.constexpr,
    HR: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
    rpos_ptr=None,
    HAS_RPOS: tl.constexpr = False,
    slot2_ptr=None,
    num_slots2=0,
    bs2=1,
    nope2_ptr=None,
    nope2_sp=0,
    nope2_sr=0,
    rope2_ptr=None,
    rope2_sp=0,
    rope2_sr=0,
    scale2_ptr=None,
    scale2_sp=0,
    scale2_sr=0,
    HAS_DST2: tl.constexpr = False,
    n_rows=0,
    head_ptr=None,
    HAS_HEAD: tl.constexpr = False,
    win_ptr=None,
    HAS_WIN: tl.constexpr = False,
    WIN: tl.constexpr = 1,
):
    """RMSNorm -> RoPE -> [out] -> FP8 entry of one block of loaded rows (see ``_norm_rope_fp8_kernel``);
    ``HAS_RPOS``: also ``rpos_ptr[slot] = position`` for every stored row (the window ring's positions);
    ``HAS_DST2``: the same entry bytes also at ``slot2_ptr[row]`` of a second pool (``*2`` page views);
    ``HAS_HEAD``: a stored row that is its request's last of the step (the next of the ``n_rows`` rows is not in its
    ring page) sets ``head_ptr[page] = (position + 1) mod bs`` (the window ring's head); ``HAS_WIN``: every row writes
    its decode window index ``win_ptr[row, :WIN]`` (WIN = bs: the ring slots of positions p - WIN + 1 .. p in the row's
    ring page, -1 before position 0 and for a row not stored)."""
    slot = tl.load(slot_ptr + ii, mask=go, other=-1)
    ok = go & (slot >= 0) & (slot < num_slots)
    # page / row in int32 (a pool has < 2**31 slots; an int64 division is a ~100-instruction call), the byte
    # offsets below in int64
    s32 = tl.where(ok, slot, 0).to(tl.int32)
    page = (s32 // bs).to(tl.int64)
    row = (s32 % bs).to(tl.int64)
    p = tl.load(pos_ptr + ii, mask=go, other=0)
    tiles = tl.arange(0, NT_PAD)
    cols = tl.arange(0, TILE)
    j = tl.arange(0, HR)
    # the weight in its own (load) layout, broadcast over the rows (loaded here, not once per program: a
    # program whose rows all skip never reads it; with ITERS > 1 the re-reads hit L1)
    if BLOCK_T == 1:  # the tile's own shape and vector runs: the same register layout as xn, no conversion
        wn = tl.load(w_ptr + noff, mask=tin, other=0.0).to(tl.float32)
    else:  # [NT_PAD, TILE] (converted once, not the [BLOCK_T, ...] products)
        wn = tl.load(w_ptr + tiles[:, None] * TILE + cols[None, :], mask=(tiles < NT)[:, None], other=0.0)
        wn = wn.to(tl.float32)[None, :, :]
    we, wo = tl.split(tl.load(w_ptr + roff).to(tl.float32))
    xn = bf16_rne(xn.to(tl.float32), INTERP)
    xe, xo = tl.split(bf16_rne(xr.to(tl.float32), INTERP))
    ss = tl.sum(tl.sum(xn * xn, axis=2), axis=1) + tl.sum(xe * xe + xo * xo, axis=1)
    r = tl.div_rn(tl.zeros([BLOCK_T], tl.float32) + 1.0, tl.sqrt_rn(tl.div_rn(ss, HEAD_DIM) + eps))
    yn = bf16_rne(wn * (xn * r[:, None, None]), INTERP)
    ye = bf16_rne(we * (xe * r[:, None]), INTERP)
    yo = bf16_rne(wo * (xo * r[:, None]), INTERP)
    c, s = rope_cos_sin_pos(p, RATIO, inv_ptr + j, INTERP)
    rot = tl.join(bf16_rne(ye * c - yo * s, INTERP), bf16_rne(ye * s + yo * c, INTERP))  # [BLOCK_T, HR, 2]
    rin = roff < HEAD_DIM
    if HAS_OUT:
        orow = out_ptr + ii * stride_out
        tl.store(orow[:, None, None] + noff, bf16_bits(yn), mask=go[:, None, None] & tin)
        tl.store(orow[:, None, None] + roff, bf16_bits(rot), mask=go[:, None, None] & rin)
    # quantise: one UE8M0 scale per (row, tile)
    amax = tl.max(tl.abs(yn), axis=2)
    e = ceil_log2_ratio(amax, FLOOR, Q_EXP, Q_MANT)
    v = yn * pow2_neg(e)[:, :, None]
    if INTERP:
        code = e4m3_code(tl.minimum(tl.maximum(v, -QMAX), QMAX)).to(tl.uint8)
    else:  # |v| <= QMAX by construction; cvt.rn.satfinite.e4m3x2.f32 rounds to nearest even and keeps -0
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    sbyte = tl.minimum(tl.maximum(e + 127, 0), 254).to(tl.uint8)
    rbits = bf16_bits(rot)
    _store_entry_rows(
        code, sbyte, rbits, ok, page, row, nope_ptr, nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp,
        scale_sr, noff, tin, roff, rin, NT, NT_PAD, NOPE,
    )  # fmt: skip
    if HAS_RPOS:
        tl.store(rpos_ptr + s32, p.to(tl.int32), mask=ok)
    if HAS_HEAD:  # a request's rows are consecutive: its last one is the row whose next row is in another page
        nxt = tl.load(slot_ptr + ii + 1, mask=go & (ii + 1 < n_rows), other=-1)
        lo = page.to(tl.int32) * bs  # the page's first slot: the next row is in it if lo <= next < lo + bs
        same = (nxt >= lo) & (nxt < lo + bs)
        # (int32 like the ring positions above: an int64 modulo is a ~100-instruction call)
        tl.store(head_ptr + page, (p.to(tl.int32) + 1) % bs, mask=ok & ~same)
    if HAS_WIN:  # (int32; WIN a power of two: the ring row of a position >= 0 is its low bits)
        kp = p.to(tl.int32)[:, None] - (WIN - 1) + tl.arange(0, WIN)[None, :]
        wslot = tl.where(ok[:, None] & (kp >= 0), page.to(tl.int32)[:, None] * WIN + (kp & (WIN - 1)), -1)
        tl.store(win_ptr + ii[:, None] * WIN + tl.arange(0, WIN)[None, :], wslot, mask=go[:, None])
    if HAS_DST2:  # the same bytes at a second slot (another entry pool, e.g. a prefill's window workspace)
        slot2 = tl.load(slot2_ptr + ii, mask=go, other=-1)
        ok2 = go & (slot2 >= 0) & (slot2 < num_slots2)
        t32 = tl.where(ok2, slot2, 0).to(tl.int32)
        _store_entry_rows(
            code, sbyte, rbits, ok2, (t32 // bs2).to(tl.int64), (t32 % bs2).to(tl.int64), nope2_ptr, nope2_sp,
            nope2_sr, rope2_ptr, rope2_sp, rope2_sr, scale2_ptr, scale2_sp, scale2_sr, noff, tin, roff, rin, NT,
            NT_PAD, NOPE,
        )  # fmt: skip


@triton.jit
def _store_entry_rows(
    code, sbyte, rbits, ok, page, row, nope_ptr, nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp,
    scale_sr, noff, tin, roff, rin, NT: tl.constexpr, NT_PAD: tl.constexpr, NOPE: tl.constexpr,
):  # fmt: skip
    """Store quantised rows (``code`` [BLOCK_T, NT_PAD, TILE] e4m3 bytes, ``sbyte`` [BLOCK_T, NT_PAD] UE8M0 bytes,
    ``rbits`` [BLOCK_T, HR, 2] bf16 bits of the rope pairs) at (``page``, ``row``) of one pool where ``ok``."""
    tiles = tl.arange(0, NT_PAD)
    nbase = nope_ptr + page * nope_sp + row * nope_sr
    tl.store(nbase[:, None, None] + noff, code, mask=ok[:, None, None] & tin)
    smask = ok[:, None] & (tiles < NT)[None, :]
    tl.store((scale_ptr + page * scale_sp + row * scale_sr)[:, None] + tiles[None, :], sbyte, mask=smask)
    rb = (rope_ptr + page * rope_sp + row * rope_sr)[:, None, None] + (roff - NOPE)
    tl.store(rb, rbits, mask=ok[:, None, None] & rin)


@triton.jit
def _fp8_row_offsets(
    HEAD_DIM: tl.constexpr, NOPE: tl.constexpr, NT: tl.constexpr, NT_PAD: tl.constexpr, TILE: tl.constexpr,
    HR: tl.constexpr, VEC_RUNS: tl.constexpr,
):  # fmt: skip
    """Offsets (in values) and masks of one row's two tiles as ``_norm_rope_rows`` takes them: nope
    ``noff`` / ``tin`` [1, NT_PAD, TILE] (tiles >= NT masked) and rope pairs ``roff`` / ``rin`` [1, HR, 2].

    With ``VEC_RUNS`` the columns are runs of _VEC contiguous values (16 bytes of bf16): the loads, the bf16
    stores and the e4m3 stores then share one register layout (contiguity TILE lets the loads take 32 bytes
    per thread but the stores only 16, which costs a shared-memory layout conversion of the whole tile)."""
    tiles = tl.arange(0, NT_PAD)
    cols = tl.arange(0, TILE)
    j = tl.arange(0, HR)
    k = tl.arange(0, 2)
    if VEC_RUNS:
        vcols = tl.max_contiguous(cols, _VEC)
    else:
        vcols = cols
    noff = (tiles[:, None] * TILE + vcols[None, :])[None, :, :]
    tin = ((tiles < NT)[:, None] & (cols < TILE)[None, :])[None, :, :]
    roff = (NOPE + 2 * j[:, None] + k[None, :])[None, :, :]
    rin = roff < HEAD_DIM
    return noff, tin, roff, rin


@triton.jit
def _rows_to_do(ii, n_rows, emit_ptr, HAS_EMIT: tl.constexpr):
    go = ii < n_rows
    if HAS_EMIT:
        go = go & (tl.load(emit_ptr + ii, mask=go, other=0) != 0)
    return go


@triton.jit
def _norm_rope_fp8_kernel(
    x_ptr,
    stride_x,
    n_rows,
    w_ptr,
    eps,
    pos_ptr,
    inv_ptr,
    emit_ptr,
    slot_ptr,
    num_slots,
    bs,
    out_ptr,
    stride_out,
    nope_ptr,
    nope_sp,
    nope_sr,
    rope_ptr,
    rope_sp,
    rope_sr,
    scale_ptr,
    scale_sp,
    scale_sr,
    RATIO: tl.constexpr,
    HAS_EMIT: tl.constexpr,
    HAS_OUT: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ITERS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NOPE: tl.constexpr,
    NT: tl.constexpr,
    NT_PAD: tl.constexpr,
    TILE: tl.constexpr,
    HR: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
    VEC_RUNS: tl.constexpr,
    SCAN: tl.constexpr = 1,
    rpos_ptr=None,
    HAS_RPOS: tl.constexpr = False,
    slot2_ptr=None,
    num_slots2=0,
    bs2=1,
    nope2_ptr=None,
    nope2_sp=0,
    nope2_sr=0,
    rope2_ptr=None,
    rope2_sp=0,
    rope2_sr=0,
    scale2_ptr=None,
    scale2_sp=0,
    scale2_sr=0,
    HAS_DST2: tl.constexpr = False,
    head_ptr=None,
    HAS_HEAD: tl.constexpr = False,
    win_ptr=None,
    HAS_WIN: tl.constexpr = False,
    WIN: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    PDL_LATE: tl.constexpr = False,
):
    """Rows [a*ITERS*BLOCK_T, ...): x -> bf16 -> RMSNorm (fp32, bf16 out) -> RoPE (fp32, bf16 out) -> [out] + FP8.

    Two tiles per block of BLOCK_T rows, both read and written as contiguous runs (16-byte vectors per
    thread on a GPU): the nope part [BLOCK_T, NT_PAD, TILE] (tiles >= NT masked) and the rope part
    [BLOCK_T, HR, 2], split into its even / odd lanes in registers (``tl.split``), rotated, re-interleaved
    (``tl.join``).  cos/sin once per (row, pair) at ``RATIO * (pos // RATIO)``.  A program handles ITERS
    blocks one after the other, loading block i+1 before computing block i (its loads stay in flight during
    the compute).  With ``HAS_DST2`` every row's entry bytes are also stored at ``slot2_ptr[row]`` of a second
    pool (``*2``: its slot count, page size and page views).  With ``HAS_RPOS`` every stored row also records its
    position at ``rpos_ptr[slot]`` (the
    window ring's position table), with ``HAS_HEAD`` each request's last row its ring head at ``head_ptr[page]``, and
    with ``HAS_WIN`` every row its decode window index at ``win_ptr[row]`` (``store_window(window_index=)``).
    With ``HAS_EMIT`` only rows with ``emits`` != 0 are read and stored; a block without
    any is skipped after one vector load of its flags.  bf16 and e4m3 rounding: the hardware's
    round-to-nearest-even conversions on a GPU, the bit-exact integer emulation under the interpreter
    (``INTERP``); both give the reference's bytes.

    ``SCAN`` > 1 (``HAS_EMIT``, BLOCK_T = ITERS = 1: the compressor's emit): the program owns rows
    [a*SCAN, ...), reads their SCAN flags with one vector load and processes the flagged rows one after
    another (a prefill emits one row in ``ratio``: with SCAN = ratio most programs do one row and none is
    empty, instead of ``ratio`` one-row programs of which ``ratio - 1`` only read their flag)."""
    pdl_start(PDL, PDL_LATE)
    a = tl.program_id(0).to(tl.int64)
    noff, tin, roff, rin = _fp8_row_offsets(HEAD_DIM, NOPE, NT, NT_PAD, TILE, HR, VEC_RUNS)
    if SCAN > 1:
        kk = tl.arange(0, SCAN)
        fl = _rows_to_do(a * SCAN + kk, n_rows, emit_ptr, True)
        k = tl.min(tl.where(fl, kk, SCAN), axis=0)
        while k < SCAN:
            ii = a * SCAN + k + tl.arange(0, BLOCK_T)
            go = ii < n_rows
            xrow = x_ptr + ii * stride_x
            xn = tl.load(xrow[:, None, None] + noff, mask=go[:, None, None] & tin, other=0.0)
            xr = tl.load(xrow[:, None, None] + roff, mask=go[:, None, None] & rin, other=0.0)
            _norm_rope_rows(
                xn, xr, ii, go, w_ptr, eps, pos_ptr, inv_ptr, slot_ptr, num_slots, bs, out_ptr, stride_out,
                nope_ptr, nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp, scale_sr,
                noff, tin, roff, RATIO, HAS_OUT, INTERP, BLOCK_T, HEAD_DIM, NOPE, NT, NT_PAD, TILE, HR,
                FLOOR, QMAX, Q_EXP, Q_MANT, rpos_ptr, HAS_RPOS, slot2_ptr, num_slots2, bs2, nope2_ptr, nope2_sp,
                nope2_sr, rope2_ptr, rope2_sp, rope2_sr, scale2_ptr, scale2_sp, scale2_sr, HAS_DST2, n_rows, head_ptr,
                HAS_HEAD, win_ptr, HAS_WIN, WIN,
            )  # fmt: skip
            pdl_end(PDL, PDL_LATE)
            k = tl.min(tl.where(fl & (kk > k), kk, SCAN), axis=0)
    else:
        ii = a * (ITERS * BLOCK_T) + tl.arange(0, BLOCK_T)
        lim = tl.minimum(n_rows, (a + 1) * (ITERS * BLOCK_T))  # end of this program's rows
        go = _rows_to_do(ii, lim, emit_ptr, HAS_EMIT)
        xrow = x_ptr + ii * stride_x
        xn = tl.load(xrow[:, None, None] + noff, mask=go[:, None, None] & tin, other=0.0)
        xr = tl.load(xrow[:, None, None] + roff, mask=go[:, None, None] & rin, other=0.0)
        for _ in range(ITERS):
            if ITERS > 1:  # prefetch the next block (masked off after the last one)
                ii_n = ii + BLOCK_T
                go_n = _rows_to_do(ii_n, lim, emit_ptr, HAS_EMIT)
                xrow_n = x_ptr + ii_n * stride_x
                xn_n = tl.load(xrow_n[:, None, None] + noff, mask=go_n[:, None, None] & tin, other=0.0)
                xr_n = tl.load(xrow_n[:, None, None] + roff, mask=go_n[:, None, None] & rin, other=0.0)
            if tl.sum(go.to(tl.int32), axis=0) > 0:
                _norm_rope_rows(
                    xn, xr, ii, go, w_ptr, eps, pos_ptr, inv_ptr, slot_ptr, num_slots, bs, out_ptr, stride_out,
                    nope_ptr, nope_sp, nope_sr, rope_ptr, rope_sp, rope_sr, scale_ptr, scale_sp, scale_sr,
                    noff, tin, roff, RATIO, HAS_OUT, INTERP, BLOCK_T, HEAD_DIM, NOPE, NT, NT_PAD, TILE, HR,
                    FLOOR, QMAX, Q_EXP, Q_MANT, rpos_ptr, HAS_RPOS, slot2_ptr, num_slots2, bs2, nope2_ptr, nope2_sp,
                    nope2_sr, rope2_ptr, rope2_sp, rope2_sr, scale2_ptr, scale2_sp, scale2_sr, HAS_DST2, n_rows,
                    head_ptr, HAS_HEAD, win_ptr, HAS_WIN, WIN,
                )  # fmt: skip
            if ITERS > 1:
                ii, go, xn, xr = ii_n, go_n, xn_n, xr_n
    pdl_end(PDL, PDL_LATE)


@triton.jit
def _mxfp4_store_row(
    ze,  # [NB, HB] fp32: values 2j of each block
    zo,  # [NB, HB] fp32: values 2j+1
    page,
    row,
    ok,
    data_ptr,
    data_sp,
    data_sr,
    scale_ptr,
    scale_sp,
    scale_sr,
    NB: tl.constexpr,
    HB: tl.constexpr,
    FLOOR: tl.constexpr,
    Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
):
    amax = tl.maximum(tl.max(tl.abs(ze), axis=1), tl.max(tl.abs(zo), axis=1))
    e = ceil_log2_ratio(amax, FLOOR, Q_EXP, Q_MANT)
    inv = pow2_neg(e)[:, None]
    ce = e2m1_code(ze * inv)
    co = e2m1_code(zo * inv)
    b = tl.arange(0, NB)
    jj = tl.arange(0, HB)
    bmask = (tl.zeros([NB], tl.int32) + ok.to(tl.int32)) != 0
    tl.store(
        data_ptr + page * data_sp + row * data_sr + b[:, None] * HB + jj[None, :],
        (ce | (co << 4)).to(tl.uint8),
        mask=bmask[:, None],
    )
    sbyte = tl.minimum(tl.maximum(e + 127, 0), 254)
    tl.store(scale_ptr + page * scale_sp + row * scale_sr + b, sbyte.to(tl.uint8), mask=bmask)


@triton.jit
def _store_mxfp4_kernel(
    x_ptr,
    stride_x,
    slot_ptr,
    num_slots,
    bs,
    data_ptr,
    data_sp,
    data_sr,
    scale_ptr,
    scale_sp,
    scale_sr,
    NB: tl.constexpr,
    HB: tl.constexpr,
    FLOOR: tl.constexpr,
    Q_EXP: tl.constexpr,
    Q_MANT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        b = tl.arange(0, NB)
        jj = tl.arange(0, HB)
        off = b[:, None] * (2 * HB) + 2 * jj[None, :]
        ze = tl.load(x_ptr + i * stride_x + off).to(tl.float32)
        zo = tl.load(x_ptr + i * stride_x + off + 1).to(tl.float32)
        _mxfp4_store_row(
            ze, zo, slot // bs, slot % bs, slot >= 0, data_ptr, data_sp, data_sr, scale_ptr, scale_sp, scale_sr,
            NB, HB, FLOOR, Q_EXP, Q_MANT,
        )  # fmt: skip


# ============================================================================ launch helpers
@functools.lru_cache(maxsize=16)
def _fp8_constexprs(fmt: FP8EntryFormat) -> dict:
    q_exp, q_mant = qmax_split(fmt.fp8_max)
    return dict(
        NT=fmt.n_tiles,
        NT_PAD=triton.next_power_of_2(fmt.n_tiles),
        TILE=fmt.tile,
        HR=fmt.rope_dim // 2,
        FLOOR=fmt.amax_floor,
        QMAX=fmt.fp8_max,
        Q_EXP=q_exp,
        Q_MANT=q_mant,
    )


@functools.lru_cache(maxsize=16)
def _mxfp4_constexprs(fmt: MXFP4KeyFormat) -> dict:
    q_exp, q_mant = qmax_split(fmt.fp4_max)
    return dict(NB=fmt.n_blocks, HB=fmt.block // 2, FLOOR=fmt.amax_floor, Q_EXP=q_exp, Q_MANT=q_mant)


def _fp8_args(pages: EntryPages, fmt: FP8EntryFormat) -> tuple[list, dict]:
    nope = pages.nope.view(torch.uint8)
    rope = pages.rope.view(torch.int16)
    args = [
        nope, nope.stride(0), nope.stride(1),
        rope, rope.stride(0), rope.stride(1),
        pages.scale, pages.scale.stride(0), pages.scale.stride(1),
    ]  # fmt: skip
    return args, _fp8_constexprs(fmt)


def _mxfp4_args(pages: KeyPages, fmt: MXFP4KeyFormat) -> tuple[list, dict]:
    args = [
        pages.data, pages.data.stride(0), pages.data.stride(1),
        pages.scale, pages.scale.stride(0), pages.scale.stride(1),
    ]  # fmt: skip
    return args, _mxfp4_constexprs(fmt)


def _check_pow2(name: str, n: int) -> None:
    if n & (n - 1):
        raise ValueError(f"{name}: the Triton kernel needs a power of two, got {n}")


def check_fp8_kernel_geometry(fmt: FP8EntryFormat, pages: EntryPages) -> None:
    """ValueError unless the Triton FP8-entry kernels (``_norm_rope_fp8_kernel``) take this format and these pages:
    power-of-two tile and rope half, slots indexable in int32."""
    _check_pow2("fmt.tile", fmt.tile)
    _check_pow2("fmt.rope_dim // 2", fmt.rope_dim // 2)
    if pages.num_slots >= 2**31:
        raise ValueError(f"pages: the Triton kernel indexes slots in int32, got {pages.num_slots} slots")


def _launch_norm_rope_fp8(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    ratio: int,
    inv_freq: torch.Tensor,
    slots: torch.Tensor,
    pages: EntryPages,
    fmt: FP8EntryFormat,
    out: torch.Tensor | None,
    emits: torch.Tensor | None,
    block_t: int | None = None,
    num_warps: int | None = None,
    iters: int | None = None,
    scan: int | None = None,
    ring_positions: torch.Tensor | None = None,
    pdl_late: bool = False,
    copy_to: tuple[torch.Tensor, EntryPages] | None = None,
    ring_head: torch.Tensor | None = None,
    window_index: torch.Tensor | None = None,
) -> None:
    """One launch, shared by ``store_window`` (ratio 1) and the main compressor's ``emit_entries``:
    RoPE at ``ratio * (positions // ratio)``, computed in the kernel (no cos/sin tensors).
    Geometry: ``block_t`` rows per block (power of two, default 1), ``num_warps`` (default
    min(block_t, 8): a warp per row), ``iters`` blocks per program, each prefetched while the previous one
    is computed (default 1).  With ``emits``: ``scan`` rows per program whose flags are read at once, the
    flagged ones processed in turn (power of two; default min(next_pow2(ratio), _EMIT_SCAN_MAX, the largest
    power of two <= max(1, n / _EMIT_SCAN_MIN_PROGRAMS)); 1 = the row-block path above, which ``block_t`` /
    ``iters`` then select).  ``pdl_late``: with PDL on, the kernel runs whole before it waits for the previous launch
    (``_triton_sync``; the caller vouches that this is safe).  ``copy_to`` (slots [n], pages): every row's entry
    also at those slots of those pages (same format).  ``ring_head`` (int32 [pages + 1]): each request's last row
    sets its page's ring head; ``window_index`` (int32 [n, entries_per_page]): every row's decode window index
    (both ``store_window``)."""
    n = x.shape[0]
    if n == 0:
        return
    check_fp8_kernel_geometry(fmt, pages)
    bt = _ROW_BLOCK if block_t is None else block_t
    _check_pow2("block_t", bt)
    nw = num_warps or min(bt, _MAX_WARPS)
    it = _ROW_ITERS if iters is None else iters
    if not isinstance(it, int) or it < 1:
        raise ValueError(f"iters: expected a positive int, got {it!r}")
    it = min(it, triton.cdiv(n, bt))
    sc = 1
    if emits is not None and block_t is None and iters is None:
        # keep >= _EMIT_SCAN_MIN_PROGRAMS programs (a decode step, where every token may emit, keeps one row
        # per program; H200 write_v5 HCA decode B = 64: 11.9 us with one-row programs)
        keep = 1 << max(0, (n // _EMIT_SCAN_MIN_PROGRAMS).bit_length() - 1)
        sc = min(triton.next_power_of_2(ratio), _EMIT_SCAN_MAX, keep) if scan is None else scan
        _check_pow2("scan", sc)
    elif scan not in (None, 1):
        raise ValueError(f"scan: needs emits and no block_t / iters, got scan={scan}")
    if sc > 1:
        bt, it = 1, 1
    pargs, kw = _fp8_args(pages, fmt)
    o = out.view(torch.int16) if out is not None else x
    e = emits.view(torch.uint8) if emits is not None else slots
    _norm_rope_fp8_kernel[(triton.cdiv(n, bt * it * sc),)](
        x, x.stride(0), n, norm_weight, float(eps), positions, inv_freq, e, slots, pages.num_slots,
        pages.entries_per_page, o, o.stride(0), *pargs,
        RATIO=ratio, HAS_EMIT=emits is not None, HAS_OUT=out is not None, INTERP=interpreter_enabled(), BLOCK_T=bt,
        ITERS=it, HEAD_DIM=fmt.head_dim, NOPE=fmt.nope_dim, VEC_RUNS=fmt.tile % _VEC_ELEMS == 0, SCAN=sc,
        rpos_ptr=ring_positions if ring_positions is not None else slots, HAS_RPOS=ring_positions is not None,
        head_ptr=ring_head if ring_head is not None else slots, HAS_HEAD=ring_head is not None,
        win_ptr=window_index if window_index is not None else slots, HAS_WIN=window_index is not None,
        WIN=pages.entries_per_page if window_index is not None else 1, num_warps=nw, **kw,
        **pdl_launch(x.device), PDL_LATE=pdl_late, **_dst2_args(copy_to, fmt),
    )  # fmt: skip


_DST2_PAGE_ARGS = ("nope2_ptr", "nope2_sp", "nope2_sr", "rope2_ptr", "rope2_sp", "rope2_sr", "scale2_ptr", "scale2_sp",
                   "scale2_sr")  # fmt: skip


def _dst2_args(copy_to: tuple[torch.Tensor, EntryPages] | None, fmt: FP8EntryFormat) -> dict:
    """``_norm_rope_fp8_kernel``'s second-destination keywords for ``copy_to`` = (slots, pages), or none: the page
    views as ``_fp8_args`` gives them for the first."""
    if copy_to is None:
        return {}
    slots2, pages2 = copy_to
    page_args = dict(zip(_DST2_PAGE_ARGS, _fp8_args(pages2, fmt)[0], strict=True))
    return dict(slot2_ptr=slots2, num_slots2=pages2.num_slots, bs2=pages2.entries_per_page, HAS_DST2=True, **page_args)


# ============================================================================ public API
def store_fp8_entries(
    x: torch.Tensor, slots: torch.Tensor, pages: EntryPages, fmt: FP8EntryFormat, backend: str = "auto"
) -> None:
    """Quantise rows ``x`` [N, head_dim] (bf16/fp16/fp32) as ``fmt.quantize`` and store them as FP8 entries.

    Row ``i`` goes to physical slot ``slots[i]`` (int32/int64 [N]; page = slot // entries_per_page,
    row = slot % entries_per_page) of the MODEL1 page views ``pages``.  Slots < 0 or >= pages.num_slots
    are skipped.  Writes the 448 e4m3 bytes, the 64 bf16 rope lanes and the 7 scale bytes; never the pad.
    Bytes equal ``fmt.quantize`` on every backend.
    """
    _check_entry_pages(pages, fmt)
    dev = pages.nope.device
    n = _check_rows("x", x, fmt.head_dim, dev)
    _check_slots(slots, n, dev)
    if not use_triton(backend, x, slots, pages.nope):
        store_fp8_entries_reference(x, slots, pages, fmt)
        return
    slots = slots.contiguous()  # the kernels index 1-D tensors as ptr + i
    if n == 0:
        return
    _check_pow2("fmt.tile", fmt.tile)
    _check_pow2("fmt.rope_dim // 2", fmt.rope_dim // 2)
    pargs, kw = _fp8_args(pages, fmt)
    _store_fp8_kernel[(n,)](
        x,
        x.stride(0),
        slots,
        pages.num_slots,
        pages.entries_per_page,
        *pargs,
        NOPE=fmt.nope_dim,
        **kw,
        **pdl_launch(x.device),
    )


def store_mxfp4_keys(
    x: torch.Tensor, slots: torch.Tensor, pages: KeyPages, fmt: MXFP4KeyFormat, backend: str = "auto"
) -> None:
    """Quantise rows ``x`` [N, fmt.dim] (bf16/fp16/fp32) to MXFP4 keys (as ``fmt.quantize``) at ``slots``.

    Same slot rules as ``store_fp8_entries``; writes the packed e2m1 bytes and the UE8M0 block scales.
    The e2m1 rounding (ties to the even code) is exact integer / IEEE arithmetic (``e2m1_code``): bytes are exact
    everywhere.
    """
    _check_key_pages(pages, fmt)
    dev = pages.data.device
    n = _check_rows("x", x, fmt.dim, dev)
    _check_slots(slots, n, dev)
    if not use_triton(backend, x, slots, pages.data):
        store_mxfp4_keys_reference(x, slots, pages, fmt)
        return
    slots = slots.contiguous()
    if n == 0:
        return
    _check_pow2("fmt.block", fmt.block)
    pargs, kw = _mxfp4_args(pages, fmt)
    bs = pages.entries_per_page
    _store_mxfp4_kernel[(n,)](x, x.stride(0), slots, pages.data.shape[0] * bs, bs, *pargs, **kw, **pdl_launch(x.device))


def store_window(
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    slots: torch.Tensor,
    pages: EntryPages,
    fmt: FP8EntryFormat,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    ring_positions: torch.Tensor | None = None,
    copy_to: tuple[torch.Tensor, EntryPages] | None = None,
    ring_head: torch.Tensor | None = None,
    window_index: torch.Tensor | None = None,
    block_t: int | None = None,
    num_warps: int | None = None,
    iters: int | None = None,
) -> None:
    """Fused window-KV write (spec §2 step 2): kv_norm -> RoPE(t) -> FP8 -> ring slot.

    ``kv`` [T, head_dim] bf16 is the raw ``wkv`` output (pre-norm); ``norm_weight`` [head_dim]
    (fp32 or bf16) and ``eps`` are kv_norm's; ``positions`` [T] int32/int64 are absolute token
    positions; ``inv_freq`` [rope_dim/2] fp32 the layer's RoPE frequencies (YaRN already applied);
    ``slots`` [T] the physical ring slots (-1 / out of range: not stored).  RMSNorm in fp32, rounded
    to bf16; interleaved RoPE on the last rope_dim dims in fp32 at angle ``fp32(pos) * inv_freq``,
    rounded to bf16; then quantised as ``fmt.quantize``.  If ``out`` [T, head_dim] bf16 is given it
    receives the normed + roped rows for every token (whatever its slot).  If ``ring_positions`` (int32
    [pages.num_slots + 1], the ring's position table) is given, every stored row also records its position
    there (``ring_positions[slot] = position``, as ``record_ring_positions``; in the same launch).  ``copy_to`` =
    (slots2 [T] int32/int64, pages2 EntryPages of ``fmt``): every row's entry bytes are also stored at ``slots2``
    (-1 / out of range: not stored) in the same launch, as ``store_fp8_entries`` of the rows would (a prefill
    chunk's own keys into its attention workspace, without the bf16 rows through memory).  ``ring_head`` (int32
    [pages.num_pages + 1], the ring's head table; rows of a request consecutive, as a plan orders them): each
    request's last stored row sets its page's head to ``(position + 1) mod entries_per_page``, as
    ``advance_ring_head`` of the step's sequence lengths (``record_ring_heads_reference``; in the same launch).
    ``window_index`` (int32 [T, entries_per_page], written whole): each row's decode window, the ring slots of
    positions p - ring + 1 .. p in the row's ring page (-1 before position 0, and the whole row -1 where the row is
    not stored), as ``ring_window_from_slots_reference``: a decode step's window index without a launch of its own
    (``entries_per_page`` a power of two on the Triton path).
    Triton vs reference: the bf16 rows agree up to the fp32 sum order of RMSNorm (rarely one bf16
    ulp); the stored bytes always equal ``fmt.quantize`` of the kernel's own bf16 rows.
    Tuning (Triton path only; results do not depend on them): ``block_t`` rows per block (a power of
    two; default 1), ``num_warps`` (default min(block_t, 8)), ``iters`` blocks per program (default 1).
    """
    _check_entry_pages(pages, fmt)
    dev = pages.nope.device
    t = _check_rows("kv", kv, fmt.head_dim, dev)
    check_tensor("kv", kv, dtype=torch.bfloat16)
    check_tensor("norm_weight", norm_weight, dtype=_FLOAT_IN, shape=[fmt.head_dim], device=dev)
    check_tensor("positions", positions, dtype=_SLOT_DTYPES, shape=[t], device=dev)
    check_tensor("inv_freq", inv_freq, dtype=torch.float32, shape=[fmt.rope_dim // 2], device=dev)
    _check_slots(slots, t, dev)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=[t, fmt.head_dim], device=dev)
        if out.stride(1) != 1:
            raise ValueError(f"out: expected unit inner stride, got strides {out.stride()}")
    if ring_positions is not None:
        shape = [pages.num_slots + 1]
        check_tensor("ring_positions", ring_positions, dtype=torch.int32, shape=shape, device=dev, contiguous=True)
    if ring_head is not None:
        shape = [pages.num_pages + 1]
        check_tensor("ring_head", ring_head, dtype=torch.int32, shape=shape, device=dev, contiguous=True)
    if window_index is not None:
        shape = [t, pages.entries_per_page]
        check_tensor("window_index", window_index, dtype=torch.int32, shape=shape, device=dev, contiguous=True)
    if copy_to is not None:
        if not (isinstance(copy_to, tuple) and len(copy_to) == 2):
            raise ValueError(f"copy_to: expected (slots, EntryPages), got {type(copy_to).__name__}")
        _check_entry_pages(copy_to[1], fmt)
        check_tensor("copy_to[0] (slots)", copy_to[0], dtype=_SLOT_DTYPES, shape=[t], device=dev)
        if copy_to[1].nope.device != dev:
            raise ValueError(f"copy_to: expected pages on {dev}, got {copy_to[1].nope.device}")
    pow2_ring = pages.entries_per_page & (pages.entries_per_page - 1) == 0
    if not use_triton(backend, kv, slots, pages.nope, has_kernel=window_index is None or pow2_ring):
        store_window_reference(kv, norm_weight, eps, positions, inv_freq, slots, pages, fmt, out, copy_to)
        if ring_positions is not None:
            record_ring_positions_reference(slots, positions, ring_positions)
        if ring_head is not None:
            record_ring_heads_reference(slots, positions, ring_head, pages.entries_per_page)
        if window_index is not None:
            bs = pages.entries_per_page
            window_index.copy_(ring_window_from_slots_reference(slots, positions, bs, pages.num_slots))
        return
    slots, positions = slots.contiguous(), positions.contiguous()
    if not norm_weight.is_contiguous() or not inv_freq.is_contiguous():
        raise ValueError("norm_weight, inv_freq: expected contiguous tensors")
    if copy_to is not None:
        check_fp8_kernel_geometry(fmt, copy_to[1])
        copy_to = (copy_to[0].contiguous(), copy_to[1])
    _launch_norm_rope_fp8(
        kv, norm_weight, eps, positions, 1, inv_freq, slots, pages, fmt, out, None, block_t, num_warps, iters,
        ring_positions=ring_positions, copy_to=copy_to, ring_head=ring_head, window_index=window_index,
    )  # fmt: skip
