"""Typed strided views over a flat byte buffer (how pools expose formats without copies)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def byte_view(
    flat: torch.Tensor,
    dtype: torch.dtype,
    shape: Sequence[int],
    byte_strides: Sequence[int],
    byte_offset: int = 0,
) -> torch.Tensor:
    """A ``dtype`` view of ``flat`` (1-D contiguous uint8) with strides and offset in bytes.

    Every stride and the offset must be multiples of the dtype's item size; the view aliases
    ``flat`` (writes through it land in the buffer).
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"flat: expected a contiguous 1-D uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    item = torch.empty((), dtype=dtype).element_size()
    for s in (*byte_strides, byte_offset, flat.numel()):
        if s % item:
            raise ValueError(f"byte_view: {s} bytes is not a multiple of {dtype}'s item size {item}")
    base = flat.view(dtype)
    return base.as_strided(
        tuple(shape),
        tuple(s // item for s in byte_strides),
        base.storage_offset() + byte_offset // item,
    )
