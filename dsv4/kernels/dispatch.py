"""The one place that decides whether an operation runs its PyTorch reference or its Triton kernel.

Every operation has a public function that validates its arguments and then calls
``use_triton(backend, *tensors)``:

- ``"torch"``  — the PyTorch reference (readable; the definition of correct; any device);
- ``"triton"`` — the Triton kernel: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``
  (how CI tests kernel logic without a GPU);
- ``"auto"``   — Triton when every tensor is on a CUDA device and the op has a kernel, else torch.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "torch", "triton")
# Programmatic dependent launch of dsv4's Triton and Gluon kernels (``pdl_launch``); the environment variable
# DSV4_PDL=1 / 0 overrides it.  Off: on the H200 (session 19) the prefill write rows gained 1.9-4.1 us at 8,192 tokens
# and were mixed at 65,536 (-3.5 to +3.5 us); the decode step with it and its GPU tests run to the end are
# ``run_h200.sh s27b``, not yet run.
PDL = False
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


def pdl_launch(device: torch.device) -> dict:
    """Launch keywords for a kernel with a ``PDL`` constexpr that calls ``_triton_sync.pdl_enter`` first:
    ``{"PDL": True, "launch_pdl": True}`` where programmatic dependent launch is on (``PDL``, or DSV4_PDL=1 / 0) and
    ``device`` is a CUDA device of compute capability 9 or more, outside the interpreter; else ``{"PDL": False}``."""
    env = os.environ.get("DSV4_PDL", "")
    on = PDL if env not in ("0", "1") else env == "1"
    if on and device.type == "cuda" and not interpreter_enabled() and sm_major(device) >= 9:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
