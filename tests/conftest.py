"""Test setup: on a machine without CUDA, Triton kernels run under the interpreter.

TRITON_INTERPRET must be set before triton is imported (it is read when a kernel is decorated).
"""

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every device this machine has: CPU always (Triton under the interpreter), CUDA when present."""
    return torch.device(request.param)


@pytest.fixture
def sass_report():
    """``run(*args) -> stdout`` of ``benchmarks/sass_report.py`` in a fresh process (the tool swaps Triton's driver and
    forces compile-only launches, so it must not run inside the test process); a non-zero exit fails the test."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(*args: str) -> str:
        env = dict(os.environ, PYTHONPATH=root)
        env.pop("TRITON_INTERPRET", None)
        tool = os.path.join(root, "benchmarks", "sass_report.py")
        out = subprocess.run([sys.executable, tool, *args], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    return run
