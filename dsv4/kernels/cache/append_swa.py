"""append_swa: write this step's window KV into the per-request FP8 rings (seed kernel name).

One row per token: FP8-quantise into ring slot ``swa_slots[i]`` (= request_slot * ring_size +
pos mod ring_size; -1 skipped) and record the token's absolute position for that row.  The quantise +
store is ``store_fp8_entries`` (PyTorch reference or Triton kernel, chosen by ``backend``); the position
write is one more launch (``record_ring_positions``), or part of the store launch in ``append_window``.
No data-dependent branch and no host sync.
"""

from __future__ import annotations

import torch

from dsv4.errors import check_tensor
from dsv4.formats import EntryPages, FP8EntryFormat
from dsv4.kernels.cache.ring import record_ring_positions
from dsv4.kernels.cache.store import store_fp8_entries, store_window


def append_swa(
    kv: torch.Tensor,
    swa_slots: torch.Tensor,
    positions: torch.Tensor,
    ring: EntryPages,
    ring_positions_flat: torch.Tensor,
    fmt: FP8EntryFormat,
    backend: str = "auto",
) -> None:
    """Quantise ``kv`` [T, head_dim] into ``ring`` at ``swa_slots`` [T] and record ``positions`` [T].

    ``ring_positions_flat``: int32 [ring.num_slots + 1], the last element is a scratch row.  Slots
    outside [0, ring.num_slots) are skipped (never written out of bounds).
    """
    t = kv.shape[0]
    check_tensor("swa_slots", swa_slots, dtype=(torch.int32, torch.int64), shape=(t,))
    check_tensor("positions", positions, dtype=torch.int32, shape=(t,))
    check_tensor("ring_positions_flat", ring_positions_flat, dtype=torch.int32, shape=(ring.num_slots + 1,))
    store_fp8_entries(kv, swa_slots, ring, fmt, backend=backend)
    record_ring_positions(swa_slots, positions, ring_positions_flat, backend=backend)


def append_window(
    kv_raw: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    swa_slots: torch.Tensor,
    positions: torch.Tensor,
    ring: EntryPages,
    ring_positions_flat: torch.Tensor,
    fmt: FP8EntryFormat,
    backend: str = "auto",
    *,
    copy_to: tuple[torch.Tensor, EntryPages] | None = None,
    rows: bool = True,
    ring_head_flat: torch.Tensor | None = None,
    window_index: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Fused window write from the raw ``wkv`` output: kv_norm -> RoPE(t) -> FP8 -> ring, positions recorded.

    ``kv_raw`` [T, head_dim] bf16 (pre-norm).  Returns the normed + RoPE'd bf16 rows [T, head_dim] (before
    FP8), which a prefill chunk's attention needs as its own keys (``rows=False``: None, and they are not
    written).  ``copy_to`` = (slots, pages): the entries also there (a chunk's attention workspace).
    ``ring_head_flat`` (int32 [ring pages + 1]): each request's ring head set from its last row, in the same launch.
    ``window_index`` (int32 [T, ring]): each row's decode window index, in the same launch.  See ``store_window``.
    """
    t = kv_raw.shape[0]
    check_tensor("swa_slots", swa_slots, dtype=(torch.int32, torch.int64), shape=(t,))
    check_tensor("ring_positions_flat", ring_positions_flat, dtype=torch.int32, shape=(ring.num_slots + 1,))
    out = torch.empty_like(kv_raw) if rows else None
    store_window(
        kv_raw, norm_weight, eps, positions, inv_freq, swa_slots, ring, fmt, out=out, backend=backend,
        ring_positions=ring_positions_flat, copy_to=copy_to, ring_head=ring_head_flat, window_index=window_index,
    )  # fmt: skip
    return out
