"""Per-step index bookkeeping of the window ring, one launch each (a decode step runs these once per layer).

In a CUDA-graph decode step every tiny PyTorch op is a kernel of its own (~2 us each on the H200, launch
plus the dependent-read latency), so the few lines of torch that build the window index or move the ring
head cost tens of microseconds per layer.  Each function here has its PyTorch reference beside it and
one Triton launch on the GPU path:

- ``ring_window_slots``: the physical ring slots a decode query reads (its own and its 127 predecessors); the
  layer's decode step has the window store write them instead (``store_window(window_index=)``, defined by
  ``ring_window_from_slots_reference``).
- ``advance_ring_head``: ``ring_head[slot] = seq_len mod ring`` for the step's requests.
- ``record_ring_positions``: ``ring_positions[slot] = position`` for the rows a step stored (``append_swa``;
  ``append_window`` does it inside its store launch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.errors import check_tensor
from dsv4.kernels._triton_sync import pdl_enter
from dsv4.kernels.dispatch import pdl_launch, use_triton

__all__ = [
    "advance_ring_head",
    "advance_ring_head_reference",
    "record_ring_heads_reference",
    "record_ring_positions",
    "record_ring_positions_reference",
    "ring_window_from_slots_reference",
    "ring_window_slots",
    "ring_window_slots_reference",
]

_INT = (torch.int32, torch.int64)
_ROWS_PER_PROGRAM = 8  # ring_window_slots: query rows a program writes (8 x 128 int32 = 4 KiB)


def _check_ring(ring: int) -> None:
    if not isinstance(ring, int) or ring <= 0:
        raise ValueError(f"ring: expected a positive int, got {ring!r}")


# ============================================================================ window slots
def ring_window_slots_reference(positions: torch.Tensor, token_slots: torch.Tensor, ring: int) -> torch.Tensor:
    """PyTorch definition of ``ring_window_slots``."""
    kp = positions.long()[:, None] - (ring - 1) + torch.arange(ring, device=positions.device)
    slot = token_slots.long()[:, None] * ring + kp.remainder(ring)
    return torch.where(kp >= 0, slot, -1).to(torch.int32)


def ring_window_from_slots_reference(
    slots: torch.Tensor, positions: torch.Tensor, ring: int, num_slots: int
) -> torch.Tensor:
    """A decode step's window index from its window store's ring slots (``store_window(window_index=)``): [T, ring]
    int32, row t the slots ``page * ring + (k mod ring)`` of positions k = p - ring + 1 .. p (oldest first) in the ring
    page ``page = slots[t] // ring`` of its stored row, -1 for k < 0; the whole row -1 where ``slots[t]`` is outside
    [0, num_slots) (a padded row: not stored, nothing to attend).  Equal to ``ring_window_slots`` of the step's
    positions and request slots on every stored row (a plan's window slot is ``request_slot * ring + pos mod ring``)."""
    ok = (slots >= 0) & (slots < num_slots)
    page = torch.where(ok, slots.long(), 0) // ring
    return torch.where(ok[:, None], ring_window_slots_reference(positions, page, ring), -1).to(torch.int32)


@triton.jit
def _ring_window_kernel(
    pos_ptr, tslot_ptr, out_ptr, T, RING: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False
):
    pdl_enter(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = r < T
    p = tl.load(pos_ptr + r, mask=rm, other=0).to(tl.int64)
    s = tl.load(tslot_ptr + r, mask=rm, other=0).to(tl.int64)
    kp = p[:, None] - (RING - 1) + tl.arange(0, RING)[None, :]
    # kp mod RING for kp >= 0 (the only slots kept)
    slot = s[:, None] * RING + kp % RING
    out = tl.where(kp >= 0, slot, -1).to(tl.int32)
    tl.store(out_ptr + r[:, None].to(tl.int64) * RING + tl.arange(0, RING)[None, :], out, mask=rm[:, None])


def ring_window_slots(
    positions: torch.Tensor, token_slots: torch.Tensor, ring: int, backend: str = "auto"
) -> torch.Tensor:
    """Physical ring slots [T, ring] int32 a decode query at position t reads: positions t-ring+1 .. t
    (oldest first) live in ring page ``token_slots[t]`` at row ``pos mod ring``, i.e. slot
    ``token_slot * ring + pos mod ring``; positions < 0 give -1 (skipped by attention).

    positions, token_slots: [T] int32/int64 (a padded token's slot -1 gives negative slots, also skipped).
    ``ring`` (entries a ring page holds, host int) must be a power of two on the Triton path (tl.arange).
    """
    check_tensor("positions", positions, dtype=_INT, ndim=1)
    t = positions.shape[0]
    check_tensor("token_slots", token_slots, dtype=_INT, shape=[t], device=positions.device)
    _check_ring(ring)
    if not use_triton(backend, positions, token_slots, has_kernel=ring & (ring - 1) == 0):
        return ring_window_slots_reference(positions, token_slots, ring)
    out = torch.empty(t, ring, dtype=torch.int32, device=positions.device)
    if t:
        _ring_window_kernel[(triton.cdiv(t, _ROWS_PER_PROGRAM),)](
            positions.contiguous(), token_slots.contiguous(), out, t, RING=ring, ROWS=_ROWS_PER_PROGRAM, num_warps=4,
            **pdl_launch(positions.device),
        )  # fmt: skip
    return out


# ============================================================================ table writes
def _scatter_to_table_reference(slots: torch.Tensor, values: torch.Tensor, table: torch.Tensor) -> None:
    """``table[slots[i]] = values[i]`` for slots in [0, numel - 1); other rows go to the last (scratch)
    element, so there is no data-dependent branch and no host sync."""
    scratch = table.numel() - 1
    valid = (slots >= 0) & (slots < scratch)
    idx = torch.where(valid, slots.long(), torch.full_like(slots, scratch, dtype=torch.long))
    table.scatter_(0, idx, values.to(table.dtype))


@triton.jit
def _scatter_to_table_kernel(
    slot_ptr, val_ptr, table_ptr, n, scratch, mod, MOD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    """``table[slot] = value`` (``value mod mod`` with MOD) for slots in [0, scratch); the others are skipped."""
    pdl_enter(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    im = i < n
    s = tl.load(slot_ptr + i, mask=im, other=-1).to(tl.int64)
    v = tl.load(val_ptr + i, mask=im, other=0).to(tl.int64)
    if MOD:
        v = v % mod
    tl.store(table_ptr + s, v.to(tl.int32), mask=im & (s >= 0) & (s < scratch))


def _scatter_to_table(slots: torch.Tensor, values: torch.Tensor, table: torch.Tensor, mod: int = 0) -> None:
    """The one launch of ``record_ring_positions`` / ``advance_ring_head`` (``mod``: 0 = values as they are)."""
    n = slots.shape[0]
    if n:
        block = max(16, min(1024, triton.next_power_of_2(n)))
        _scatter_to_table_kernel[(triton.cdiv(n, block),)](
            slots.contiguous(), values.contiguous(), table, n, table.numel() - 1, mod, MOD=mod != 0, BLOCK=block,
            num_warps=4, **pdl_launch(slots.device),
        )  # fmt: skip


def record_ring_positions_reference(slots: torch.Tensor, positions: torch.Tensor, ring_positions: torch.Tensor) -> None:
    """PyTorch definition of ``record_ring_positions``: ``ring_positions[slots[i]] = positions[i]``; slots outside
    [0, numel - 1) go to the last (scratch) element."""
    _scatter_to_table_reference(slots, positions, ring_positions)


def record_ring_positions(
    swa_slots: torch.Tensor, positions: torch.Tensor, ring_positions_flat: torch.Tensor, backend: str = "auto"
) -> None:
    """Set ``ring_positions_flat[swa_slots[i]] = positions[i]`` (one launch on the Triton path).  Slots
    outside [0, numel - 1) are skipped (the reference parks them in the last, scratch element)."""
    if not use_triton(backend, swa_slots, positions, ring_positions_flat):
        record_ring_positions_reference(swa_slots, positions, ring_positions_flat)
        return
    _scatter_to_table(swa_slots, positions, ring_positions_flat)


def record_ring_heads_reference(
    slots: torch.Tensor, positions: torch.Tensor, ring_head_flat: torch.Tensor, ring: int
) -> None:
    """The ring heads a step's window rows set (``store_window(ring_head=)``): for rows [T] of the ring slots
    ``slots`` (page = request slot, ``ring`` rows a page; -1 / out of range: none) at ``positions``, requests' rows
    consecutive, each request's last row sets ``ring_head_flat[page] = (position + 1) mod ring``.  The same table as
    ``advance_ring_head`` of the step's sequence lengths (a request's last row is at seq_len - 1)."""
    n_slots = (ring_head_flat.numel() - 1) * ring
    ok = (slots >= 0) & (slots < n_slots)
    page = torch.where(ok, slots.long(), 0) // ring
    last = ok.clone()
    last[:-1] &= ~(ok[1:] & (page[1:] == page[:-1]))
    ring_head_flat[page[last]] = ((positions[last].long() + 1) % ring).to(torch.int32)


def advance_ring_head_reference(
    seq_lens: torch.Tensor, request_slots: torch.Tensor, ring_head_flat: torch.Tensor, ring: int
) -> None:
    """PyTorch definition of ``advance_ring_head``."""
    _scatter_to_table_reference(request_slots, seq_lens.long() % ring, ring_head_flat)


def advance_ring_head(
    seq_lens: torch.Tensor,
    request_slots: torch.Tensor,
    ring_head_flat: torch.Tensor,
    ring: int,
    backend: str = "auto",
) -> None:
    """``ring_head_flat[request_slots[b]] = seq_lens[b] mod ring`` for the step's requests, in place.

    seq_lens (tokens after the step), request_slots: [B] int32/int64; ring_head_flat: int32 [num_slots + 1],
    the last element a scratch that the reference writes for padded requests (slot -1; the kernel skips
    them).  Slots are distinct among the step's real requests (the plan's contract), so no order matters.
    """
    check_tensor("seq_lens", seq_lens, dtype=_INT, ndim=1)
    b = seq_lens.shape[0]
    dev = seq_lens.device
    check_tensor("request_slots", request_slots, dtype=_INT, shape=[b], device=dev)
    check_tensor("ring_head_flat", ring_head_flat, dtype=torch.int32, ndim=1, device=dev, contiguous=True)
    _check_ring(ring)
    if not use_triton(backend, seq_lens, request_slots, ring_head_flat):
        advance_ring_head_reference(seq_lens, request_slots, ring_head_flat, ring)
        return
    _scatter_to_table(request_slots, seq_lens, ring_head_flat, ring)
