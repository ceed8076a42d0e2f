"""``benchmarks/ncu_source_summary.py`` on the committed Nsight source-counter file of the one-producer fused kernel."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import ncu_source_summary as nss  # noqa: E402

CSV = os.path.join(ROOT, "benchmarks", "results", "2026-12-04_h200_ncu_source_gluon_fused_1prod_s10.csv.gz")


def test_partition_shares_and_top_instructions():
    """The file's regions are the kernel's setmaxnreg partitions; the consumers' waits for a ready stage (the
    mbarrier spin at 0x2060 / 0xac90, 12.5 / 11.4 % of the samples, recorded in the session-10 notes) lead."""
    rows = nss.read_rows(CSV)
    assert len(rows) > 3000 and rows[0].offset == 0
    assert sum(r.samples for r in rows) == 9393
    regions = {r.region for r in rows}
    assert any("0x40" in g for g in regions)  # the producer's 64-register partition
    text = nss.summary(rows, 3)
    lines = text.splitlines()
    top = lines[-3:]
    assert "0x2060" in top[0] and "12.5 %" in top[0] and "BRA" in top[0], text
    assert "0xac90" in top[1] and "11.4 %" in top[1], text


EMIT_CSV = os.path.join(ROOT, "benchmarks", "results", "2026-12-04_h200_ncu_source_emit_s15.csv.gz")
EMIT_LINES = os.path.join(ROOT, "benchmarks", "results", "2026-12-04_emit_indexer_dot_kernel_sm90_s15.lines.sass.gz")


def test_executed_instructions_per_source_line():
    """``--lines``: the session-15 Nsight file of the CSA indexer's MMA emit (before its rewrite) with the listing of
    the same kernel compiled off the device: 11,984,896 warp instructions, the sum reductions first (7.9 %), the
    int64 compaction of emitting tokens (compressor.py:1225) among the top."""
    rows = nss.read_rows(EMIT_CSV)
    lines = nss.line_map(EMIT_LINES)
    assert len(lines) == len(rows) == 4304
    text = nss.by_line(rows, lines, 5)
    first = text.splitlines()
    assert "11984896 warp instructions" in first[0], text
    assert "standard.py:293" in first[1] and "7.9 %" in first[1], text
    assert any("compressor.py:1225" in t for t in first[1:]), text
    try:
        nss.by_line(rows[:-1], lines, 5)
    except SystemExit as e:
        assert "4304 instructions in the listing, 4303 in the csv" in str(e)
    else:
        raise AssertionError("a listing of another size must be refused")
