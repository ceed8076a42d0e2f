"""StateCachePool: the fixed-size per-request state, indexed by request slot.

For every layer (MTP included) a **window ring**: one MODEL1 FP8 page of ``ring_size`` entries per
slot (entry of position ``t`` in row ``t mod ring_size``), the absolute position held by each row
(-1 = empty) and the ring head (next row to write = tokens written mod ring_size).

For every CSA/HCA layer the **compressor state** (spec §3.1): fp32 ``kv`` and ``score`` rows of shape
``[c*m, c*d]`` per slot, and for CSA the same for the indexer's compressor; an online compressor (HCA, as
``CacheSchema.online_state`` makes them) keeps ``kv`` [3, d] (acc, den, raw kv) and ``score`` [2, d] (max, raw
score) per slot, views of one [5, d] buffer, and ``positions`` (int32, the raw row's; -1 fresh)
(``dsv4.kernels.cache.compressor``, "online state"); fresh: kv 0, score -inf.
Rows form a ring indexed by *absolute position mod c*m* (as vLLM does), not the reference's "previous
chunk | open chunk" halves: the same bytes, but no row copy at a chunk boundary and chunked prefill needs no special
case.  A fresh slot has kv 0 and score -inf, so rows of positions < 0 (CSA entry 0's missing previous
chunk) get zero weight; ``reset`` restores that when a slot is reused (the reference never does).

Storage is one tensor per region for all layers of a kind (so a reset is one fill per region);
``LayerState`` holds one layer's views.  Position tables carry one scratch element at the end that
absorbs writes of skipped (-1) slots without a data-dependent branch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.schema import CacheSchema, CompressorShape
from dsv4.formats import EntryPages


@dataclass(frozen=True)
class CompressorState:
    """One compressor's state views: ``kv``/``score`` fp32 [num_slots, rows, width] (online: [num_slots, 3, d] and
    [num_slots, 2, d], ``shape.online``, with ``positions``); ``counters`` int32
    [num_slots], all 0 between launches: the fused decode kernel's per-slot arrival counters
    (``dsv4.kernels.cache.compressor.compress_decode``)."""

    shape: CompressorShape
    kv: torch.Tensor
    score: torch.Tensor
    counters: torch.Tensor
    positions: torch.Tensor | None = None  # online: int32 [num_slots], the raw row's position (-1 = none)


@dataclass(frozen=True)
class LayerState:
    """One layer's per-slot state views."""

    layer_id: int
    ring: EntryPages  # [num_slots, ring_size, ...]: request slot s is page s
    ring_positions: torch.Tensor  # int32 [num_slots, ring_size], -1 = empty
    ring_positions_flat: torch.Tensor  # int32 [num_slots * ring_size + 1], last element = scratch
    ring_head: torch.Tensor  # int32 [num_slots]
    ring_head_flat: torch.Tensor  # int32 [num_slots + 1], last element = scratch
    compressor: CompressorState | None
    indexer_compressor: CompressorState | None


class StateCachePool:
    """Per-request-slot state of all layers, with a free list of slots.

    Args:
        schema: the model's cache schema.
        num_slots: requests that can hold state at once.
        device: where the tensors live.
    """

    def __init__(self, schema: CacheSchema, num_slots: int, device: torch.device | str = "cpu") -> None:
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots: expected a positive int, got {num_slots!r}")
        self.schema = schema
        self.num_slots = num_slots
        self.device = dev = torch.device(device)
        n_layers, ring = schema.config.num_cache_layers, schema.ring_size
        fmt = schema.entry_fmt
        page = schema.ring_page_bytes
        self._ring_buf = torch.zeros(n_layers, num_slots * page, dtype=torch.uint8, device=dev)
        self._pos = torch.full((n_layers, num_slots * ring + 1), -1, dtype=torch.int32, device=dev)
        self._head = torch.zeros(n_layers, num_slots + 1, dtype=torch.int32, device=dev)
        # Compressor states grouped by shape, so one fill resets every layer of a kind.
        self._comp: dict[CompressorShape, tuple[torch.Tensor, torch.Tensor]] = {}
        self._counters: dict[CompressorShape, torch.Tensor] = {}
        self._comp_pos: dict[CompressorShape, torch.Tensor] = {}  # online states: position of the raw row
        index_in_group: dict[tuple[int, str], tuple[CompressorShape, int]] = {}
        group_sizes: dict[CompressorShape, int] = {}
        for ls in schema.layers:
            for role, shape in (("main", ls.compressor), ("indexer", ls.indexer_compressor)):
                if shape is not None:
                    index_in_group[(ls.layer_id, role)] = (shape, group_sizes.get(shape, 0))
                    group_sizes[shape] = group_sizes.get(shape, 0) + 1
        for shape, n in group_sizes.items():
            if shape.online:  # (acc, den, raw kv | max, raw score) rows of one buffer: equal strides for the kernels
                buf = torch.zeros(n, num_slots, 5, shape.width, dtype=torch.float32, device=dev)
                kv, score = buf[:, :, 0:3], buf[:, :, 3:5]
                score.fill_(float("-inf"))
                self._comp_pos[shape] = torch.full((n, num_slots), -1, dtype=torch.int32, device=dev)
            else:
                kv = torch.zeros(n, num_slots, shape.rows, shape.width, dtype=torch.float32, device=dev)
                score = torch.full_like(kv, float("-inf"))
            self._comp[shape] = (kv, score)
            self._counters[shape] = torch.zeros(n, num_slots, dtype=torch.int32, device=dev)

        def comp_view(layer_id: int, role: str) -> CompressorState | None:
            if (layer_id, role) not in index_in_group:
                return None
            shape, i = index_in_group[(layer_id, role)]
            kv, score = self._comp[shape]
            pos = self._comp_pos[shape][i] if shape.online else None
            return CompressorState(shape, kv[i], score[i], self._counters[shape][i], pos)

        self.layers: tuple[LayerState, ...] = tuple(
            LayerState(
                layer_id=i,
                ring=fmt.entry_pages(self._ring_buf[i], num_slots, ring),
                ring_positions=self._pos[i, :-1].view(num_slots, ring),
                ring_positions_flat=self._pos[i],
                ring_head=self._head[i, :-1],
                ring_head_flat=self._head[i],
                compressor=comp_view(i, "main"),
                indexer_compressor=comp_view(i, "indexer"),
            )
            for i in range(n_layers)
        )
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._is_free = [True] * num_slots

    # ------------------------------------------------------------------ slots
    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """Take a slot and reset its state, or return None if none is free."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = False
        self.reset([slot])
        return slot

    def release(self, slot: int) -> None:
        """Return a slot.  ValueError (nothing changed) for one out of [0, num_slots) or already free."""
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.num_slots:
            raise ValueError(f"release: expected a slot in [0, {self.num_slots}), got {slot!r}")
        if self._is_free[slot]:
            raise ValueError(f"release: slot {slot} is already free (a double free)")
        self._is_free[slot] = True
        self._free.append(slot)

    def free_slot_ids(self) -> list[int]:
        return list(self._free)

    def reset(self, slots: list[int]) -> None:
        """Empty the ring and compressor state of ``slots`` in every layer (kv 0, score -inf).

        Fills of each slot's slices: no slot list is copied to the device (a pageable copy would wait for every
        queued kernel, i.e. admitting a request would stall the GPU's queue)."""
        ring = self.schema.ring_size
        for s in slots:
            self._pos[:, s * ring : (s + 1) * ring].fill_(-1)
            self._head[:, s].fill_(0)
            for kv, score in self._comp.values():
                kv[:, s].fill_(0.0)
                score[:, s].fill_(float("-inf"))
            for pos in self._comp_pos.values():
                pos[:, s].fill_(-1)

    def layer(self, layer_id: int) -> LayerState:
        self.schema.layer(layer_id)
        return self.layers[layer_id]

    @property
    def total_bytes(self) -> int:
        t = [self._ring_buf, self._pos, self._head, *(x for pair in self._comp.values() for x in pair)]
        t += list(self._counters.values()) + list(self._comp_pos.values())
        return sum(x.numel() * x.element_size() for x in t)
