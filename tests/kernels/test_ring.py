"""Window-ring bookkeeping kernels (dsv4/kernels/cache/ring.py): each launch against its PyTorch reference."""

import pytest
import torch

from dsv4.kernels.cache.ring import (
    advance_ring_head,
    advance_ring_head_reference,
    ring_window_slots,
    ring_window_slots_reference,
)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ring_window_slots(device, backend):
    """Positions before, at and past the ring size, a padded token (slot -1), int64 inputs, T not a multiple
    of the kernel's row block."""
    ring = 8
    pos = torch.tensor([0, 3, 7, 8, 100, 5, 1_000_003, 9, 2, 15, 64], dtype=torch.int64, device=device)
    slots = torch.tensor([0, 1, 2, 3, 4, -1, 5, 6, 7, 0, 2], dtype=torch.int64, device=device)
    got = ring_window_slots(pos, slots, ring, backend=backend)
    assert got.dtype == torch.int32 and got.shape == (11, ring)
    assert torch.equal(got, ring_window_slots_reference(pos, slots, ring))
    # by hand: position 3 in slot 1 sees positions -4 .. 3 -> -1 x4, then rows 0..3 of page 1
    assert got[1].tolist() == [-1, -1, -1, -1, 8, 9, 10, 11]
    # position 100 (slot 4) sees 93 .. 100: rows 93 % 8 = 5, 6, 7, 0, ..., 4
    assert got[4].tolist() == [4 * 8 + (p % 8) for p in range(93, 101)]
    assert ring_window_slots(pos[:0], slots[:0], ring, backend=backend).shape == (0, ring)


def test_ring_window_slots_validation(device):
    pos = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="token_slots"):
        ring_window_slots(pos, pos[:2], 8)
    with pytest.raises(ValueError, match="ring"):
        ring_window_slots(pos, pos, 0)
    with pytest.raises(ValueError, match="positions"):
        ring_window_slots(pos.float(), pos, 8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_advance_ring_head(device, backend):
    """Real requests get seq_len mod ring; a padded request (slot -1) changes no real slot; other slots keep
    their values.  (The reference parks padded rows in the scratch element; the kernel skips them.)"""
    ring = 128
    head = torch.arange(10, dtype=torch.int32, device=device) + 1000  # 9 slots + scratch
    want = head.clone()
    lens = torch.tensor([1, 128, 129, 1_000_000, 7], dtype=torch.int32, device=device)
    rslots = torch.tensor([3, 0, -1, 8, 5], dtype=torch.int32, device=device)
    advance_ring_head(lens, rslots, head, ring, backend=backend)
    advance_ring_head_reference(lens, rslots, want, ring)
    assert torch.equal(head[:-1], want[:-1])
    assert head[:-1].tolist() == [0, 1001, 1002, 1, 1004, 7, 1006, 1007, 1_000_000 % 128]
    with pytest.raises(ValueError, match="ring_head_flat"):
        advance_ring_head(lens, rslots, head.long(), ring, backend=backend)
