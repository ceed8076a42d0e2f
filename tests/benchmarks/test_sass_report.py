"""``benchmarks/sass_report.py``: compiles an op's kernels for sm_90 without a GPU and reports ptxas's figures."""

from __future__ import annotations

import os
import re

import pytest
import triton

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton without its bundled ptxas")
def test_reports_registers_of_the_hca_decode_kernel(sass_report):
    """A fresh process (the tool swaps Triton's driver and forces compile-only launches): the one fused HCA decode
    kernel is compiled for sm_90 and its register count, stack and instruction mix are printed."""
    stdout = sass_report("hca:decode:2")
    m = re.search(r"_compressor_decode_emit_main_kernel\s+regs\s+(\d+)\s+stack\s+(\d+) B", stdout)
    assert m, stdout
    assert 16 <= int(m[1]) <= 255
    assert re.search(r"\d+ instructions: ", stdout)


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton without its bundled ptxas")
def test_writes_sass_with_source_lines(sass_report, tmp_path):
    """``--sass DIR`` writes each kernel's SASS, PTX and the listing with Python source lines that
    ``ncu_source_summary.py --lines`` reads; the few-token compressor projection (``linear:1:1``) as the case."""
    stdout = sass_report("linear:1:1", "--sass", str(tmp_path))
    assert "_linear_gemv_kernel" in stdout
    listing = (tmp_path / "_linear_gemv_kernel.lines.sass").read_text()
    assert re.search(r'//## File ".*linear\.py", line \d+', listing)
    assert (tmp_path / "_linear_gemv_kernel.sass").exists() and (tmp_path / "_linear_gemv_kernel.ptx").exists()


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton without its bundled ptxas")
def test_pdl_compiles_the_grid_dependency_instructions(sass_report, tmp_path):
    """``--pdl`` compiles the kernels as ``dispatch.pdl_launch`` would launch them with programmatic dependent launch:
    the SASS holds the grid-dependency wait (ACQBULK) and release (PREEXIT); without it, neither."""
    for flags, want in ((("--pdl",), True), ((), False)):
        out = tmp_path / ("pdl" if want else "plain")
        sass_report("hca:decode:2", "--sass", str(out), *flags)
        sass = (out / "_compressor_decode_emit_main_kernel.sass").read_text()
        assert ("ACQBULK" in sass) == want and ("PREEXIT" in sass) == want


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="triton without its bundled ptxas")
def test_fp8_linear_converts_weights_without_f2f(sass_report, tmp_path):
    """The FP8-weight projection kernel (``fp8_linear:64:wq_b``) compiles for sm_90 with its inline-PTX conversion:
    e4m3 pairs through F2FP and one bf16x2 multiply (HMUL2), no per-value F2F on the conversion unit; with
    ``cvt_asm=0`` Triton's cast, which has them."""
    sass_report("fp8_linear:64:wq_b", "--sass", str(tmp_path / "asm"))
    sass_report("fp8_linear:64:wq_b", "--tune", "fp8_linear:cvt_asm=0", "--sass", str(tmp_path / "cast"))
    asm = (tmp_path / "asm" / "_fp8_linear_kernel.sass").read_text()
    cast = (tmp_path / "cast" / "_fp8_linear_kernel.sass").read_text()
    assert "HMUL2" in asm and not re.search(r"\bF2F\.", asm) and "HGMMA" in asm
    assert re.search(r"\bF2F\.BF16", cast)


def test_loops_of_a_saved_sass_finds_the_innermost_loops(sass_report, tmp_path):
    """``--loops-of FILE`` (no compiling, no ptxas): a backward branch over enough instructions is a loop, reported
    with its instruction count, spills and mix; an mbarrier spin (a short backward branch) and a wait stub's branch
    back across a loop and the kernel's EXIT are not."""
    code = ["BAR.SYNC.DEFER_BLOCKING 0x0", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3", "@!P0 BRA 0x10"]
    code += ["HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24", "FMUL R4, R4, R5", "STL [R1], R4", "LDL R4, [R1]"]
    code += ["FMUL R6, R6, R5"] * 4 + ["ISETP.NE.AND P1, PT, R7, RZ, PT", "@P1 BRA 0x30", "EXIT"]
    code += ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3", "BRA 0x10"]
    sass = "\n".join(f"        /*{16 * i:04x}*/                   {t} ;" for i, t in enumerate(code))
    (tmp_path / "k.sass").write_text(sass)
    out = sass_report("--loops-of", str(tmp_path / "k.sass")).strip().splitlines()
    assert out == ["loop 0x30-0xc0: 10 instructions, LDL+STL 2: FMUL 5, HGMMA 1, STL 1, LDL 1, ISETP 1, BRA 1"], out
