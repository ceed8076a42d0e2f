"""Per-kernel device time of ``topk_indices`` (where a top-k call's time goes), and its CUDA-graph time.

    python benchmarks/profile_topk.py                                   # H200: 4 x 262,144, k = 1,024, every method
    python benchmarks/profile_topk.py --rows 64 --n 32768 --k 512       # the V4-Flash decode step at 128K, B = 64
    python benchmarks/profile_topk.py --smoke                           # tiny shapes on the CPU (interpreter)

Scores are i.i.d. normal (as ``bench_indexer.py``).  Each method's result is checked against
``topk_indices_reference`` first.  Device times from ``torch.profiler`` (launch gaps excluded); the graph
time is a replay of 20 calls (no L2 flush: the scores of a decode step were just written by the indexer).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.profile_decode import kernel_times  # noqa: E402
from benchmarks.sweep_indexer import GraphTimer  # noqa: E402
from dsv4.kernels.indexer import topk as topk_mod  # noqa: E402
from dsv4.kernels.indexer import topk_indices, topk_indices_reference  # noqa: E402
from dsv4.kernels.indexer.topk import topk_workspace  # noqa: E402

METHODS = {"filter": {"method": "filter"}, "radix": {"method": "radix"}, "auto": {}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="*", default=[4])
    ap.add_argument("--n", type=int, default=262144)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {sorted(METHODS)}")
    ap.add_argument("--splits", type=int, nargs="*", default=[None], help="splits per row (None = auto)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--rank-slots", type=int, nargs="*", default=[None], help="filter path: topk._RANK_SLOTS values to try"
    )
    ap.add_argument("--groups-per-k", type=int, default=None, help="filter path: topk._GROUPS_PER_K")
    ap.add_argument("--one-region", type=int, default=None, help="filter path, one split: topk._ONE_REGION (0 / 1)")
    ap.add_argument("--warps-ac", type=int, default=None, help="filter path: topk._FILTER_WARPS_AC (launches A, C)")
    ap.add_argument("--warps-bd", type=int, default=None, help="filter path: topk._FILTER_WARPS_BD (launches B, D)")
    ap.add_argument("--tile", type=int, default=None, help="filter path: topk._FILTER_TILE (A, C entries a tile)")
    ap.add_argument("--split-d", type=int, default=None, help="filter path: topk._SPLIT_D (launch D in two parts)")
    ap.add_argument("--warps-bd-many", type=int, default=None, help="filter path: topk._FILTER_WARPS_BD_MANY")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    knobs = (("warps_ac", "_FILTER_WARPS_AC"), ("warps_bd", "_FILTER_WARPS_BD"), ("tile", "_FILTER_TILE"),
             ("warps_bd_many", "_FILTER_WARPS_BD_MANY"))  # fmt: skip
    for flag, name in knobs:
        if getattr(args, flag) is not None:
            setattr(topk_mod, name, getattr(args, flag))
    if args.one_region is not None:
        topk_mod._ONE_REGION = bool(args.one_region)
    if args.split_d is not None:
        topk_mod._SPLIT_D = bool(args.split_d)
    if args.groups_per_k is not None:
        topk_mod._GROUPS_PER_K = topk_mod._GROUPS_PER_K_MANY = args.groups_per_k
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    n, k, rows = (2048, 64, [2]) if args.smoke else (args.n, args.k, args.rows)
    timer = GraphTimer(n=20, flush=False) if cuda else None
    gen = torch.Generator(device=dev).manual_seed(0)
    for r in rows:
        s = torch.randn(r, n, device=dev, generator=gen)
        nv = torch.full((r,), n, dtype=torch.int32, device=dev)
        ws = topk_workspace(r, n, dev)
        want = topk_indices_reference(s, k, nv)
        for name, rank in [(m, slots) for m in args.methods.split(",") for slots in args.rank_slots]:
            if rank is not None:
                topk_mod._RANK_SLOTS = rank
            for sp in args.splits:
                kw = dict(METHODS[name], splits=sp) if sp is not None else METHODS[name]
                run = partial(topk_indices, s, k, nv, "triton", workspace=ws, **kw)
                if not torch.equal(run(), want):
                    raise SystemExit(f"{name} splits={sp} rows={r}: differs from the reference")
                times = kernel_times(run, 1 if args.smoke else args.reps, cuda)
                total = sum(t for t, _ in times.values())
                g = f"graph {timer(run) * 1e6:.1f} us, " if timer else ""
                tag = f" rank_slots {topk_mod._RANK_SLOTS} groups_per_k {topk_mod._GROUPS_PER_K}"
                tag += f" one_region {int(topk_mod._ONE_REGION)} warps {topk_mod._FILTER_WARPS_AC}/"
                many = f"({topk_mod._FILTER_WARPS_BD_MANY} from {topk_mod._FILTER_MANY_ROWS})"
                tag += f"{topk_mod._FILTER_WARPS_BD} {many}"
                tag += f" tile {topk_mod._FILTER_TILE} split_d {int(topk_mod._SPLIT_D)}"
                tag = tag if name != "radix" else ""
                print(f"== rows {r} n {n} k {k} {name}{tag} splits {sp}: {g}device {total * 1e6:.1f} us")
                for kname, (t, c) in sorted(times.items(), key=lambda x: -x[1][0]):
                    print(f"   {t * 1e6:8.1f} us  x{c:g}  {kname[:90]}")


if __name__ == "__main__":
    main()
