"""flush_compression: quantise emitted compressed entries (and CSA indexer keys) into their pages.

The slots were assigned by the manager when it built the step's plan (page * P + row; -1 skipped),
so this allocates nothing.  Entries go through ``store_fp8_entries`` (584-byte FP8, MODEL1 pages),
indexer keys through ``store_mxfp4_keys`` (68-byte MXFP4) at the same slots.
"""

from __future__ import annotations

import torch

from dsv4.formats import EntryPages, FP8EntryFormat, KeyPages, MXFP4KeyFormat
from dsv4.kernels.cache.store import (
    _check_entry_pages,
    _check_key_pages,
    _check_rows,
    _check_slots,
    store_fp8_entries,
    store_mxfp4_keys,
)


def flush_compression(
    compressed: torch.Tensor,
    slots: torch.Tensor,
    entries: EntryPages,
    entry_fmt: FP8EntryFormat,
    indexer_keys: torch.Tensor | None = None,
    keys: KeyPages | None = None,
    key_fmt: MXFP4KeyFormat | None = None,
    backend: str = "auto",
) -> None:
    """Store ``compressed`` [N, head_dim] (and ``indexer_keys`` [N, index_head_dim]) at ``slots`` [N].  Both stores'
    arguments are checked before either writes: a rejected call changes no byte."""
    if (indexer_keys is None) != (keys is None) or (keys is not None and key_fmt is None):
        raise ValueError("indexer_keys, keys, key_fmt: expected all three (CSA) or no indexer keys")
    _check_entry_pages(entries, entry_fmt)
    n = _check_rows("compressed", compressed, entry_fmt.head_dim, entries.nope.device)
    _check_slots(slots, n, entries.nope.device)
    if indexer_keys is not None:
        _check_key_pages(keys, key_fmt)
        if _check_rows("indexer_keys", indexer_keys, key_fmt.dim, keys.data.device) != n:
            raise ValueError(f"indexer_keys: expected {n} rows (one per compressed entry), got {indexer_keys.shape[0]}")
        _check_slots(slots, n, keys.data.device)
    store_fp8_entries(compressed, slots, entries, entry_fmt, backend=backend)
    if indexer_keys is not None:
        store_mxfp4_keys(indexer_keys, slots, keys, key_fmt, backend=backend)
