"""Host time of a step's plan: ``KVCacheManager.plan`` + ``commit`` of a decode step (one token a request), the
Python and NumPy work an engine's scheduler pays once a step before it launches the layers.

    python benchmarks/bench_plan.py --out FILE.jsonl                  # default grid, any machine (CPU is enough)
    python benchmarks/bench_plan.py --batches 64 --contexts 131072    # one row
    python benchmarks/bench_plan.py --table-blocks 4096               # tables as wide as a 1M-token graph bucket's

Each row: V4-Flash's schema (ratio classes 4 and 128, 256-token pages), B requests each holding ``context`` committed
tokens (prefilled in 16,384-token chunks first), then ``plan({r: 1 for r in range(B)})`` + ``commit`` timed as the
median of ``--reps`` rounds of ``--iters`` steps (``time_s``: one step).  The manager lives on the ``meta`` device, so
the plan's host -> device copy is not part of the time (on CUDA it is one packed non-blocking copy, see
``cache.plan.int32_to_device``).  Pages: enough for every request to reach ``context`` + the timed steps.
``--table-blocks W``: the step planned as a CUDA graph bucket plans it (``pad_batch_to=B``, ``max_blocks=W`` for both
classes: block tables W pages wide whatever the context).

Work a step must do: O(B) Python for the schedule's checks and page needs, and O(B x table width) for the block
tables: before session 27 every page id was converted from the requests' Python lists each step (O(B x pages));
since then the tables are gathered from a slot-indexed host mirror (``KVCacheManager._tables``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from dsv4.cache.manager import KVCacheManager
from dsv4.config import get_preset


def measure(batch: int, context: int, iters: int, reps: int, table_blocks: int | None = None) -> dict:
    cfg = get_preset("v4-flash")
    steps = iters * (reps + 1)
    pages = batch * (-(-(context + steps) // 256) + 1)
    m = KVCacheManager(cfg, max_requests=batch, num_pages=pages, device="meta")
    for r in range(batch):
        m.add(r)
    done = 0
    while done < context:
        n = min(16384, context - done)
        plan = m.plan({r: n for r in range(batch)})
        m.commit(plan)
        done += n
    sched = {r: 1 for r in range(batch)}

    wide = {"pad_batch_to": batch, "max_blocks": table_blocks} if table_blocks else {}

    def step() -> None:
        m.commit(m.plan(sched, **wide))

    for _ in range(iters):  # warm-up round
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        times.append((time.perf_counter() - t0) / iters)
    m.check_invariants()
    row = {"name": "plan_commit_decode", "batch": batch, "context": context, "time_s": statistics.median(times)}
    return {**row, "table_blocks": table_blocks} if table_blocks else row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64", help="comma-separated requests a step")
    ap.add_argument("--contexts", default="4096,131072", help="comma-separated committed tokens a request")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--table-blocks", type=int, help="plan with max_blocks = this and pad_batch_to = B (graph buckets)")
    ap.add_argument("--out", help="JSON lines file to append to")
    args = ap.parse_args(argv)
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = ""
    meta = {
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "commit": rev,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            row = {**measure(b, ctx, args.iters, args.reps, args.table_blocks), **meta}
            rows.append(row)
            wide = f", tables {args.table_blocks} pages wide" if args.table_blocks else ""
            print(f"plan + commit, decode, B = {b:3d}, {ctx:7d} tokens a request{wide}: {row['time_s'] * 1e6:8.1f} us")
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
