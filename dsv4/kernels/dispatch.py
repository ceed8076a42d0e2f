"""The one place that decides whether an operation runs its PyTorch reference or its Triton kernel.

Every operation has a public function that validates its arguments and then calls
``use_triton(backend, *tensors)``:

- ``"torch"``  — the PyTorch reference (readable; the definition of correct; any device);
- ``"triton"`` — the Triton kernel: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``
  (how CI tests kernel logic without a GPU);
- ``"auto"``   — Triton when every tensor is on a CUDA device and the op has a kernel, else torch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "torch", "triton")
# Programmatic dependent launch of dsv4's Triton and Gluon kernels (``pdl_launch``): ``PDL`` everywhere, unless a
# ``pdl_scope`` says otherwise (a layer's decode step: ``PDL_DECODE``); the environment variable DSV4_PDL=1 / 0
# overrides both.  Measured (H100, session 27, ``2026-12-05_h100_{decode,write}_pdl{0,1}_s27.*``, graph time, off ->
# on): the V4-Flash decode step at 128K, B = 1: CSA 206.2 -> 198.9 us, HCA 152.4 -> 146.8; B = 64: 330.5 -> 329.3 and
# 197.0 -> 193.3; the decode-size write launches 0.3-0.7 us each faster.  Prefill-size launches are mixed: the window
# store 7.9 -> 10.6 us at 8,192 tokens and 64.2 -> 80.0 at 65,536 (a chain of many-wave grids), the CSA indexer 12.0 ->
# 13.2 at 8,192, HCA online 21.8 -> 17.5 (H200, session 19: gains at 8,192, -3.5 to +3.5 us at 65,536).  So on in a
# decode step only.
PDL = False
PDL_DECODE = True
_PDL_SCOPE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("dsv4_pdl_scope", default=None)
DEFAULT_NUM_SMS = 132  # the H200's SM count, assumed by launch heuristics when no CUDA device is present


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (for grid sizing); ``DEFAULT_NUM_SMS`` off CUDA (interpreter)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_major(device: torch.device) -> int:
    """Compute-capability major of CUDA ``device`` (9 for Hopper); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return _sm_major(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(backend: str, *tensors: torch.Tensor | None, has_kernel: bool = True) -> bool:
    """Resolve ``backend`` for an op whose tensor arguments are ``tensors``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if backend == "torch":
        return False
    if backend == "triton":
        if not has_kernel:
            raise ValueError("backend='triton': this operation has no Triton kernel")
        if not on_cuda and not interpreter_enabled():
            raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
        return True
    return has_kernel and on_cuda


def check_maxnreg(name: str, value: int | None) -> None:
    """ValueError unless ``value`` is None or a ptxas register cap Triton accepts (an int in [24, 255])."""
    if value is not None and (not isinstance(value, int) or not 24 <= value <= 255):
        raise ValueError(f"{name}: expected None or an int in [24, 255], got {value!r}")


@contextlib.contextmanager
def pdl_scope(on: bool) -> Iterator[None]:
    """Within the block, ``pdl_launch`` answers ``on`` instead of ``PDL`` (DSV4_PDL=1 / 0 still overrides it); scopes
    nest, and each restores the one outside it.  Host-side: it decides how kernels are launched (and captured)."""
    token = _PDL_SCOPE.set(bool(on))
    try:
        yield
    finally:
        _PDL_SCOPE.reset(token)


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr that calls ``_triton_sync.pdl_enter`` first:
    ``{"PDL": True, "launch_pdl": True}`` where programmatic dependent launch is on (DSV4_PDL=1 / 0, else the innermost
    ``pdl_scope``, else ``PDL``) and ``device`` is a CUDA device of compute capability 9 or more, outside the
    interpreter; else ``{"PDL": False}``."""
    env = os.environ.get("DSV4_PDL", "")
    scope = _PDL_SCOPE.get()
    on = env == "1" if env in ("0", "1") else PDL if scope is None else scope
    if on and device.type == "cuda" and not interpreter_enabled() and sm_major(device) >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
