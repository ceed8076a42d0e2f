"""Where a warp-specialised kernel's warps wait: Nsight Compute's per-instruction stall samples, per partition.

    ncu -k regex:_sparse_attn_ws_kernel --launch-skip 1 --launch-count 1 --section WarpStateStats \\
        --section SourceCounters --import-source no --page source --print-source sass --csv \\
        python3 benchmarks/ncu_cases.py attention:gluon_fused > src.csv
    python benchmarks/ncu_source_summary.py src.csv [--top 40]        # also reads .csv.gz

The CSV has one row per SASS instruction (address, source, "Warp Stall Sampling (All Samples)", executions ...).
The kernel's partitions are told apart by the register reconfiguration each one starts with (``USETMAXREG``: a
warp-specialised region begins with its ``setmaxnreg``); each region is named by that instruction and its share of
all samples printed, then the ``--top`` instructions by samples with their region.  A spin on an mbarrier
(``SYNCS.PHASECHK`` + branch) high in the list is a partition waiting for another.

    python benchmarks/ncu_source_summary.py src.csv --lines KERNEL.lines.sass   # per Python source line

With ``--lines`` (the ``nvdisasm -gi`` listing that ``sass_report.py --sass DIR`` writes for the same kernel, compiled
off the device with the same Triton and ptxas) the executed instructions and stall samples are also summed per
source line (the innermost one: a helper's line, not its caller's), to see which lines of a kernel cost the most.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import linecache
import os
import re
import sys
from typing import NamedTuple

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


class Row(NamedTuple):
    offset: int  # bytes from the kernel's first instruction
    source: str  # the SASS text
    samples: float
    executed: float
    region: str  # the USETMAXREG instruction that opened the partition this instruction is in


def _number(text: str) -> float:
    text = text.replace(",", "").strip()
    return float(text) if text and text != "-" else 0.0


def read_rows(path: str) -> list[Row]:
    """The per-instruction rows of an ``ncu --page source --csv`` file (plain or gzip), in address order."""
    raw = gzip.open(path, "rb").read() if path.endswith(".gz") else open(path, "rb").read()  # noqa: SIM115
    lines = list(csv.reader(io.StringIO(raw.decode("utf-8", errors="replace"))))
    try:
        start = next(i for i, r in enumerate(lines) if r and r[0] == "Address")
    except StopIteration:
        raise SystemExit(f"{path}: no 'Address' header row (expected ncu --page source --csv output)") from None
    hdr = lines[start]
    ia, isrc, isamp, iexe = hdr.index("Address"), hdr.index("Source"), hdr.index(SAMPLES), hdr.index(EXECUTED)
    rows, base, region = [], None, "entry"
    for r in lines[start + 1 :]:
        if len(r) <= max(ia, isrc, isamp, iexe) or not r[ia].startswith("0x"):
            continue
        addr = int(r[ia], 16)
        base = addr if base is None else base
        src = r[isrc].strip()
        if "USETMAXREG" in src:
            region = src
        rows.append(Row(addr - base, src, _number(r[isamp]), _number(r[iexe]), region))
    return rows


def summary(rows: list[Row], top: int) -> str:
    total = sum(r.samples for r in rows) or 1.0
    by_region: dict[str, float] = {}
    for r in rows:
        by_region[r.region] = by_region.get(r.region, 0.0) + r.samples
    out = [f"{len(rows)} instructions, {total:.0f} stall samples"]
    out += [f"  {100 * v / total:5.1f} %  {k}" for k, v in sorted(by_region.items(), key=lambda kv: -kv[1])]
    out.append(f"top {top} instructions (offset, samples, share, executions, region | SASS):")
    for r in sorted(rows, key=lambda r: -r.samples)[:top]:
        out.append(
            f"  {r.offset:#7x} {r.samples:7.0f} {100 * r.samples / total:5.1f} % {r.executed:9.0f}  "
            f"{r.region.split()[-1] if r.region != 'entry' else 'entry':>6} | {r.source[:80]}"
        )
    return "\n".join(out)


def line_map(path: str) -> dict[int, str]:
    """Offset -> "file.py:line" from an ``nvdisasm -gi`` listing, plain or gzip (each instruction takes the last line
    marker)."""
    where, out = "?", {}
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)  # noqa: SIM115
    for text in raw:
        m = re.search(r'//## File "([^"]+)", line (\d+)', text)
        if m:
            where = f"{m[1]}:{m[2]}"
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", text)
        if m:
            out[int(m[1], 16)] = where
    return out


def by_line(rows: list[Row], lines: dict[int, str], top: int) -> str:
    """Executed instructions and stall samples summed per source line; fails if the listings disagree in size."""
    if len(lines) != len(rows):
        raise SystemExit(f"--lines: {len(lines)} instructions in the listing, {len(rows)} in the csv (not one kernel?)")
    exe: dict[str, float] = {}
    smp: dict[str, float] = {}
    for r in rows:
        key = lines.get(r.offset, "?")
        exe[key] = exe.get(key, 0.0) + r.executed
        smp[key] = smp.get(key, 0.0) + r.samples
    te, ts = sum(exe.values()) or 1.0, sum(smp.values()) or 1.0
    out = [f"per source line: {te:.0f} warp instructions executed, {ts:.0f} samples (line, executed, samples | code):"]
    for key in sorted(exe, key=lambda k: -exe[k])[:top]:
        path, _, num = key.rpartition(":")
        code = linecache.getline(path, int(num)).strip() if num.isdigit() else ""
        share = f"{100 * exe[key] / te:5.1f} % {100 * smp[key] / ts:5.1f} %"
        out.append(f"  {os.path.basename(path)}:{num:<5} {share}  | {code[:90]}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--lines", help="the kernel's nvdisasm -gi listing (sass_report.py --sass): sums per source line")
    args = ap.parse_args(argv)
    rows = read_rows(args.csv)
    print(summary(rows, args.top))
    if args.lines:
        print(by_line(rows, line_map(args.lines), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
