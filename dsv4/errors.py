"""Errors and the one validation helper every public entry point uses.

Misuse raises (``ValueError`` for bad arguments, ``KeyError`` for unknown ids); "not now"
(no free slot or page) is a return value, never an exception.  ``check_tensor`` only looks at
metadata (shape, dtype, device), so it never forces a device->host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_tensor", "check_same_device"]


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    device: torch.device | str | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check a tensor argument's metadata and raise ``ValueError`` naming expected vs got.

    ``shape`` entries of ``None`` match any size; ``contiguous``: the tensor must be contiguous (a kernel's flat
    table or state).  Returns the tensor for chaining.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise ValueError(f"{name}: expected dtype {want}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        ok = t.dim() == len(shape) and all(
            want is None or want == got for want, got in zip(shape, t.shape, strict=False)
        )
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: expected device {torch.device(device)}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")
    return t


def check_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` if any given tensor is not on ``device`` (index-agnostic for cuda)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device.type != device.type or (
            device.index is not None and t.device.index is not None and t.device.index != device.index
        ):
            raise ValueError(f"{name}: expected device {device}, got {t.device}")
