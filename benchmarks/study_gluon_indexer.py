"""Study (H200): the warp-specialised Gluon indexer-scores kernel's ring depths and program sizes.

    python3 benchmarks/study_gluon_indexer.py [--batches 4 64] [--out FILE.jsonl]
    python3 benchmarks/study_gluon_indexer.py --host      # host time a call, and where it goes (cProfile)
    python3 benchmarks/study_gluon_indexer.py --visible 8 --quick   # rows see 1/8 of the table (static tables)
    python3 benchmarks/study_gluon_indexer.py --prefill 8192 --entries 2048 16384   # causal prefill rows

For each batch (1M-token context: 262,144 MXFP4 entries a row, 64 heads) it times ``indexer_scores_gluon`` for
stages (converted 128-entry tiles the consumers may lag) x raw (TMA tiles in flight + 1) x tiles (128-entry tiles a
program; "auto" = one program an SM) with ``sweep_indexer``'s CUDA-graph timer (L2 flushed between calls), next to
Triton's fp8mma kernel in the same run, and checks every output against that kernel's.  With
``--visible V`` each row sees only its first entries // V entries and its block table is -1 past their pages (an
engine's block tables sized for the longest request under CUDA graphs); ``--quick`` times only the default
configuration.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

from benchmarks.bench_indexer import HBM_BYTES_PER_S, make_problem  # noqa: E402
from benchmarks.sweep_indexer import GraphTimer  # noqa: E402
from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.kernels.indexer import indexer_scores  # noqa: E402
from dsv4.kernels.indexer._gluon_scores import GLUON_PRODUCERS, indexer_scores_gluon  # noqa: E402

CONFIGS = [(4, 4), (2, 4), (4, 8), (8, 4), (2, 8)]  # (stages, raw): powers of two, shared memory <= ~200 KB


def host_study() -> None:
    """Host (Python + launch) time a call at a tiny shape (GPU work << host work): 200 calls without a sync, per
    call; then cProfile's top functions of the default ``indexer_scores``."""
    import cProfile
    import pstats
    import time

    from dsv4.kernels.indexer._gluon_scores import launch_gluon_scores

    dev = torch.device("cuda")
    n = 4096
    keys, bt, q, w, tr, nv = make_problem(1, n, 64, 64, dev, torch.Generator(device=dev).manual_seed(0))
    calls = {
        "indexer_scores (default)": partial(indexer_scores, q, w, keys, bt, tr, nv, n, "triton"),
        "indexer_scores impl=fp8mma": partial(indexer_scores, q, w, keys, bt, tr, nv, n, "triton", impl="fp8mma"),
        "launch_gluon_scores": partial(launch_gluon_scores, q, w, keys, bt, tr, nv, n),
    }
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{name:32s} host {1e6 * (t1 - t0) / 200:7.1f} us a call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        calls["indexer_scores (default)"]()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def prefill_study(rows: int, entries: list[int], timer, info) -> list[dict]:
    """Causal prefill of one request: ``rows`` query rows over ``entries`` entries, row t seeing
    max(1, (t + 1) entries / rows) of them (the last chunk of a prompt of 4 x entries tokens); the Gluon kernel
    and fp8mma (``impl="auto"`` takes the Gluon kernel from 2**21 rows x entries), graph-timed, outputs
    compared."""
    dev = torch.device("cuda")
    out_rows = []
    for n in entries:
        gen = torch.Generator(device=dev).manual_seed(1)
        keys, bt, _, _, _, _ = make_problem(1, n, 64, 64, dev, gen)
        _, _, q, w, _, _ = make_problem(rows, 64, 64, 64, dev, gen)  # rows queries (and unused keys)
        tr = torch.zeros(rows, dtype=torch.int32, device=dev)
        nv = torch.clamp((torch.arange(1, rows + 1, device=dev) * n) // rows, min=1).to(torch.int32)
        f8 = partial(indexer_scores, q, w, keys, bt, tr, nv, n, "triton", impl="fp8mma")
        fg = partial(indexer_scores_gluon, q, w, keys, bt, tr, nv, n)
        ref = f8()
        err = float(((fg() - ref).abs() / ref.abs().clamp(min=1e-30)).nan_to_num(0.0).max())
        t8, tg = timer(f8), timer(fg)
        print(f"prefill rows={rows} entries={n}: fp8mma {t8 * 1e6:.1f} us, gluon {tg * 1e6:.1f} us (rel err {err:.1e})")
        nbytes = int(nv.sum()) * 68 + rows * n * 4
        out_rows.append(dict(info, name="indexer_gluon_ws_prefill",
                             date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                             shape={"rows": rows, "entries": n, "visible": "causal", "heads": 64, "page": 64},
                             time_s=tg, bytes=nbytes, roofline_s=nbytes / HBM_BYTES_PER_S,
                             baseline="indexer_fp4_fp8mma", baseline_time_s=t8, timer="graph",
                             max_rel_err_vs_baseline=err))  # fmt: skip
    return out_rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[4, 64])
    ap.add_argument("--entries", type=int, nargs="+", default=[262144])
    ap.add_argument("--prefill", type=int, default=0, help="causal prefill study with this many query rows")
    ap.add_argument("--out")
    ap.add_argument("--host", action="store_true", help="host time a call instead (see host_study)")
    ap.add_argument("--visible", type=int, default=1, help="rows see entries // VISIBLE entries")
    ap.add_argument("--quick", action="store_true", help="only the default stages / raw / tiles")
    ap.add_argument("--fold", action="store_true", help="also the fold variant (fold=True) of each configuration")
    ap.add_argument("--hsum", action="store_true", help="with --fold: also its head sum on the tensor core (hsum=True)")
    ap.add_argument("--producers", type=int, nargs="+", default=[GLUON_PRODUCERS], help="producer warpgroups (1, 2)")
    flush_help = "L2 flush before each call: write (dirty lines the kernel may write back), read (clean), none"
    ap.add_argument("--flush", choices=["write", "read", "none"], default="write", help=flush_help)
    ap.add_argument("--ablate", type=int, nargs="+", default=[0], help="bits of ABLATE_* to time (scores unchecked)")
    ap.add_argument("--configs", nargs="+", help="stages,raw pairs to try (default: 4,4 with --quick, else CONFIGS)")
    ap.add_argument("--regs", nargs="+", default=[None], help="(consumer,producer) registers to try, e.g. 176,48")
    args = ap.parse_args()
    if args.host:
        host_study()
        return
    dev = torch.device("cuda")
    timer = GraphTimer(flush=args.flush != "none", flush_mode="read" if args.flush == "read" else "write")
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows = []
    if args.prefill:
        rows = prefill_study(args.prefill, args.entries, timer, info)
    for B, n in [] if args.prefill else itertools.product(args.batches, args.entries):
        keys, bt, q, w, tr, nv = make_problem(B, n, 64, 64, dev, torch.Generator(device=dev).manual_seed(0))
        n_vis = n // args.visible
        nv.fill_(n_vis)
        bt[:, -(-n_vis // 64) :] = -1
        nbytes = B * n_vis * 68 + q.numel() * 2 + B * n * 4
        base = partial(indexer_scores, q, w, keys, bt, tr, nv, n, "triton", impl="fp8mma")  # (auto: the Gluon kernel)
        ref = base()
        t_ref = timer(base)
        fin = torch.isfinite(ref)
        top = ref.where(fin, 0.0).abs().amax().clamp(min=1e-30)
        print(f"B={B} visible {n_vis}/{n}: fp8mma {t_ref * 1e6:.1f} us, "
              f"roofline {nbytes / HBM_BYTES_PER_S * 1e6:.1f} us")  # fmt: skip
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else None
        for stages, raw in configs or (CONFIGS[:1] if args.quick else CONFIGS):
            variants = itertools.product(
                (None,) if args.quick else (None, 32, 16),
                (False, True) if args.fold else (False,),
                args.producers,
                [None if r is None else tuple(int(x) for x in r.split(",")) for r in args.regs],
                args.ablate,
                (False, True) if args.hsum else (False,),
            )
            for tiles, fold, producers, regs, ablate, hsum in variants:
                if hsum and (not fold or ablate):
                    continue
                knobs = dict(stages=stages, raw=raw, fold=fold, producers=producers, regs=regs, ablate=ablate)
                if hsum:
                    knobs["hsum"] = True
                fn = partial(indexer_scores_gluon, q, w, keys, bt, tr, nv, n, tiles=tiles, **knobs)
                cfg = f"stages={stages} raw={raw} tiles={tiles or 'auto':>4} fold={fold:d} producers={producers}"
                cfg += (f" regs={regs[0]},{regs[1]}" if regs else "") + (f" ablate={ablate}" if ablate else "")
                cfg += " hsum=1" if hsum else ""
                try:
                    out = fn()
                except Exception as exc:  # a configuration that does not compile (e.g. shared memory): reported
                    print(f"  {cfg}: failed: {str(exc)[:200]}")
                    continue
                if ablate:  # work left out: the scores are not compared
                    err = float("nan")
                elif not torch.equal(torch.isneginf(out), torch.isneginf(ref)):
                    raise SystemExit(f"B={B} fold={fold}: -inf entries differ from fp8mma's")
                else:
                    err = float((out[fin] - ref[fin]).abs().max() / top)  # 0: bit-equal (fold: FP8 accumulation)
                t = timer(fn)
                row = dict(info, name="indexer_gluon_ws", date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                           shape={"entries": n, "visible": n_vis, "B": B, "heads": 64, "page": 64},
                           config={"stages": stages, "raw": raw, "tiles": tiles or "auto", "fold": fold,
                                   "producers": producers, "regs": regs, "ablate": ablate, "hsum": hsum}, time_s=t,
                           bytes=nbytes,
                           roofline_s=nbytes / HBM_BYTES_PER_S, baseline="indexer_fp4_fp8mma", baseline_time_s=t_ref,
                           timer="graph", flush=args.flush, max_abs_err_over_max_vs_baseline=err)  # fmt: skip
                rows.append(row)
                print(f"  {cfg}: {t * 1e6:7.1f} us  (max |diff| / max |fp8mma| {err:.1e})")
    if args.out:
        write_jsonl(rows, args.out)


if __name__ == "__main__":
    main()
