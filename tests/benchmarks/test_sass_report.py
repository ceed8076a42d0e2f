"""``benchmarks/sass_report.py``: compiles an op's kernels for sm_90 without a GPU and reports ptxas's figures."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton without its bundled ptxas")
def test_reports_registers_of_the_hca_decode_kernel():
    """A fresh process (the tool swaps Triton's driver and forces compile-only launches): the one fused HCA decode
    kernel is compiled for sm_90 and its register count, stack and instruction mix are printed."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "sass_report.py"), "hca:decode:2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"_compressor_decode_emit_main_kernel\s+regs\s+(\d+)\s+stack\s+(\d+) B", out.stdout)
    assert m, out.stdout
    assert 16 <= int(m[1]) <= 255
    assert re.search(r"\d+ instructions: ", out.stdout)
