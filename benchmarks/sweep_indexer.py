"""Launch-parameter sweep of the indexer scores kernels (MXFP4 keys: convert / dot_scaled / fp8mma / fold; FP8 keys).

    python benchmarks/sweep_indexer.py --batches 4 --variants fp4_fold fp4_fold4 fp4_fp8mma fp8keys \
        --out benchmarks/results/sweep_indexer.jsonl                                  # H200, ~1-2 min
    python benchmarks/sweep_indexer.py --smoke                                       # CPU, interpreter

Variants: fp4_{convert,dot_scaled,fp8mma,fold,fold4} (``indexer_scores(impl=...)``), fp4_fp8mma_noasm /
fp4_fold_noasm (the byte re-encoding in Triton integer ops instead of inline PTX), fp8keys
(``indexer_scores_fp8keys``), gluon_ws (sm_90, not in the default list: the warp-specialised Gluon kernel of
``_gluon_scores``; the launch knobs other than tiles do not apply to it).

Shape: 1M-token context (262,144 entries), Hi = 64 heads x 128, pages of 64 entries shuffled through one
pool, one query row per request, B = 4 (and 1, 8), every entry visible.  Grid per variant: ``--grid fast``
(default) = (block_n, warps, stages) in FAST_LAUNCHES x tiles_per_program {4, 8, 16}; ``--grid full`` =
block_n {64, 128, 256} x tiles_per_program {1, 2, 4, 8, 16} x num_warps {4, 8} x num_stages {1, 2, 3, 4}.

Timing.  ``--timer graph`` (default) measures GPU time only: the call is captured 20 times into a CUDA
graph, each preceded by a write of a buffer larger than L2 (so the keys come from HBM), and the time of
an identical graph of the L2 flushes alone is subtracted; median of several replays.  This is the time
an engine running decode under CUDA graphs sees.  ``--timer bench`` uses ``triton.testing.do_bench``
(median), which also counts the Python launch path of the wrapper when that is slower than the GPU work:
the first H200 run shows a ~115 us floor for every variant, even at 4K context, i.e. host-bound.  Each
variant's default launch is also timed with do_bench (name suffix ``+host``) to show that gap.

Compilation: tiles_per_program is a runtime argument, so a variant has 7 (fast grid) or 24 (full) binaries; they are
compiled first in parallel worker processes (Triton's disk cache), then loaded by this process.  Configs
that fail to compile or to run (e.g. shared memory) are skipped with a note.  Each variant's output is
checked against the fp32 reference (once per variant at full tolerance; every config's output against it).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import partial

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_indexer import FMT, FP8_KEY_BYTES, HBM_BYTES_PER_S, make_problem  # noqa: E402
from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.kernels.indexer import (  # noqa: E402
    fp8_key_pages_from_mxfp4,
    indexer_scores,
    indexer_scores_fp8keys,
    indexer_scores_reference,
)
from dsv4.kernels.indexer import scores as scores_mod  # noqa: E402
from dsv4.kernels.indexer.scores import launch_config  # noqa: E402

VARIANTS = [
    "fp4_convert",
    "fp4_dot_scaled",
    "fp4_fp8mma",
    "fp4_fp8mma_noasm",
    "fp4_fold",
    "fp4_fold4",
    "fp4_fold_noasm",
    "fp8keys",
    "gluon_ws",
]
FULL_GRID = {"block_n": [64, 128, 256], "tiles": [1, 2, 4, 8, 16], "num_warps": [4, 8], "num_stages": [1, 2, 3, 4]}
# default (--grid fast): the (block_n, warps, stages) combos that compile without spills for the fold/fp8mma
# kernels (sm90 AOT check: 256 entries need 8 warps), x tiles {4, 8, 16} -- 21 configs a variant
FAST_LAUNCHES = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2), (256, 8, 3)]
FAST_TILES = [4, 8, 16]
SMOKE_GRID = {"block_n": [16, 32], "tiles": [1, 4], "num_warps": [4], "num_stages": [1]}
L2_FLUSH_BYTES = 128 * 1024 * 1024  # > the H200's L2
RTOL = ATOL = 1e-5


def run_fn(variant: str, prob: dict, cfg: dict):
    """A no-argument callable running `variant` on `prob` with launch `cfg`."""
    kw = {"block_n": cfg["block_n"], "tiles_per_program": cfg["tiles"]}
    kw.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg.get("maxnreg"))
    q, w, bt, tr, nv, n = prob["q"], prob["w"], prob["bt"], prob["tr"], prob["nv"], prob["n"]
    if variant == "fp8keys":
        return partial(indexer_scores_fp8keys, q, w, prob["fk"], bt, tr, nv, n, "triton", **kw)
    if variant == "gluon_ws":  # the warp-specialised Gluon kernel (sm_90; launch knobs but tiles ignored)
        from dsv4.kernels.indexer._gluon_scores import indexer_scores_gluon

        tiles = None if cfg.get("default") else cfg["tiles"]
        return partial(indexer_scores_gluon, q, w, prob["keys"], bt, tr, nv, n, tiles=tiles)
    if variant == "fp4_fold_noasm":  # the fold table lookup in Triton integer ops instead of PTX prmt

        def run_fold():
            scores_mod._FOLD_ASM = False
            try:
                return indexer_scores(q, w, prob["keys"], bt, tr, nv, n, "triton", impl="fold", **kw)
            finally:
                scores_mod._FOLD_ASM = True

        return run_fold
    if variant == "fp4_fp8mma_noasm":  # the e2m1 -> e4m3 re-encoding in Triton integer ops instead of PTX

        def run():
            scores_mod._FP8MMA_ASM = False
            try:
                return indexer_scores(q, w, prob["keys"], bt, tr, nv, n, "triton", impl="fp8mma", **kw)
            finally:
                scores_mod._FP8MMA_ASM = True

        return run
    return partial(indexer_scores, q, w, prob["keys"], bt, tr, nv, n, "triton", impl=variant[len("fp4_") :], **kw)


def build_problem(B: int, entries: int, heads: int, page: int, dev, seed: int = 0) -> dict:
    gen = torch.Generator(device=dev).manual_seed(seed)
    keys, bt, q, w, tr, nv = make_problem(B, entries, heads, page, dev, gen)
    return {
        "keys": keys,
        "fk": fp8_key_pages_from_mxfp4(keys),
        "bt": bt,
        "q": q,
        "w": w,
        "tr": tr,
        "nv": nv,
        "n": entries,
    }


# ------------------------------------------------------------------------------------------ compile
_WORKER_PROB: dict = {}


def _worker_init(entries: int, heads: int, page: int):
    _WORKER_PROB["p"] = build_problem(
        1, entries, heads, page, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )


def _worker_compile(job):
    variant, cfg = job
    try:
        run_fn(variant, _WORKER_PROB["p"], cfg)()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return job, None
    except Exception as e:  # noqa: BLE001 - report, do not stop the sweep
        return job, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def precompile(jobs, args) -> dict:
    """Compile every (variant, block_n, warps, stages) in worker processes (filling Triton's disk cache);
    returns {key: error} of those that failed to compile or run.  Same strides and sizes as the timed
    problems (B only changes the grid), so this process then loads the same binaries."""
    workers = min(args.jobs, len(jobs))
    errors: dict = {}
    if workers <= 1:
        return errors
    ctx = mp.get_context("spawn")
    init = (args.entries, args.heads, args.page)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=init)
    try:
        futs = [pool.submit(_worker_compile, j) for j in jobs]
        for f in as_completed(futs, timeout=args.compile_timeout):
            job, err = f.result()
            # a CUDA error poisons the worker's context: let this process retry those configs itself
            if err and "CUDA" not in err:
                errors[_key(job)] = err
        pool.shutdown()
    except Exception as e:  # noqa: BLE001 - broken pool / timeout: the rest compiles in this process
        print(f"parallel compile stopped early ({type(e).__name__}: {e}); compiling the rest serially")
        pool.shutdown(wait=False, cancel_futures=True)
    return errors


def _key(job):
    v, c = job
    return (v, c["block_n"], c["num_warps"], c["num_stages"], c.get("maxnreg"))


# ------------------------------------------------------------------------------------------ timing
class GraphTimer:
    """GPU time of fn from CUDA graphs of n (L2 flush, fn) pairs minus a graph of n flushes.

    ``flush_mode``: "write" zero-fills a buffer larger than the L2 (the L2 is then full of dirty lines, whose
    write-back the next kernel may pay for), "read" sums it (clean lines: only the eviction of fn's data)."""

    def __init__(self, n: int = 20, reps: int = 5, flush: bool = True, flush_mode: str = "write"):
        if flush_mode not in ("write", "read"):
            raise ValueError(f"flush_mode: expected 'write' or 'read', got {flush_mode!r}")
        self.n, self.reps, self.mode = n, reps, flush_mode
        self.buf = torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush else None
        self.sink = torch.zeros((), dtype=torch.int64, device="cuda")
        self.base = self._replay_time(self._capture(None)) if flush else 0.0

    def _capture(self, fn):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(self.n):
                if self.buf is not None and self.mode == "write":
                    self.buf.zero_()
                elif self.buf is not None:
                    torch.sum(self.buf, dim=0, dtype=torch.int64, out=self.sink)  # a read of every line
                if fn is not None:
                    fn()
        return g

    def _replay_time(self, g) -> float:
        g.replay()
        ts = []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e-3)
        return statistics.median(ts)

    def __call__(self, fn) -> float:
        fn()
        torch.cuda.synchronize()
        g = self._capture(fn)
        t = self._replay_time(g)
        del g
        return max(t - self.base, 0.0) / self.n


def bench_time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def cpu_time(fn) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ sweep
def max_rel_err(out, ref) -> float:
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isneginf(out), torch.isneginf(ref)):
        return float("inf")
    if not fin.any():
        return 0.0
    return ((out[fin] - ref[fin]).abs().max() / ref[fin].abs().max().clamp_min(1e-30)).item()


def sweep_shape(args, dev, info, B, configs, compile_errors, timer, rows, notes):
    prob = build_problem(B, args.entries, args.heads, args.page, dev, seed=B)
    ref = indexer_scores_reference(prob["q"], prob["w"], prob["keys"], prob["bt"], prob["tr"], prob["nv"], prob["n"])
    entries, H = args.entries, args.heads
    shape = {"ctx_tokens": entries * 4, "entries": entries, "B": B, "heads": H, "head_dim": FMT.dim, "page": args.page}
    extra = prob["q"].numel() * 2 + prob["w"].numel() * 4 + B * entries * 4
    for variant in args.variants:
        key_bytes = FP8_KEY_BYTES if variant == "fp8keys" else FMT.entry_bytes
        nbytes = B * entries * key_bytes + extra
        # once per variant: the default launch against the reference at full tolerance
        try:
            out = run_fn(variant, prob, _default_cfg(B, args, dev))()
            torch.testing.assert_close(out[torch.isfinite(ref)], ref[torch.isfinite(ref)], rtol=RTOL, atol=ATOL)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{variant} B={B}: default launch wrong or failed, variant skipped: {str(e)[:200]}")
            continue
        for cfg in configs:
            k = _key((variant, cfg))
            if k in compile_errors:
                continue
            fn = run_fn(variant, prob, cfg)
            try:
                err = max_rel_err(fn(), ref)
                if not err <= 1e-5:
                    notes.append(f"{variant} B={B} {cfg}: max rel err {err:.3g}, skipped")
                    continue
                t = timer(fn)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this config
                compile_errors[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                continue
            rows.append(_row(info, variant, shape, cfg, t, nbytes, args.timer, err))
        if not args.smoke:  # the default launch through the full Python path (host overhead included)
            cfg = _default_cfg(B, args, dev)
            rows.append(
                _row(info, variant + "+host", shape, cfg, bench_time(run_fn(variant, prob, cfg)), nbytes, "bench")
            )
    del prob, ref
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _default_cfg(B, args, dev) -> dict:
    c = launch_config(B, args.heads, args.entries, dev)
    if args.smoke:
        c = c._replace(block_n=16, tiles=1)
    return {
        "block_n": c.block_n,
        "tiles": c.tiles,
        "num_warps": c.num_warps,
        "num_stages": c.num_stages,
        "maxnreg": c.maxnreg,
        "default": True,
    }


def _row(info, name, shape, cfg, t, nbytes, timer, err=None):
    return {
        "name": f"indexer_{name}",
        **info,
        "shape": shape,
        "config": cfg,
        "time_s": t,
        "bytes": nbytes,
        "roofline_s": nbytes / HBM_BYTES_PER_S,
        "timer": timer,
        "max_rel_err": err,
    }


def print_table(rows, top: int):
    by_shape: dict = {}
    for r in rows:
        by_shape.setdefault(r["shape"]["B"], []).append(r)
    for B, rs in sorted(by_shape.items()):
        rs = sorted(rs, key=lambda r: r["time_s"])
        print(f"\n== entries={rs[0]['shape']['entries']} B={B} heads={rs[0]['shape']['heads']}  (fastest first)")
        print(
            f"{'name':28} {'block_n':>7} {'tiles':>5} {'warps':>5} {'stages':>6} {'maxnreg':>7} "
            f"{'time_us':>9} {'roof_us':>8} {'x roof':>7}"
        )
        best: dict = {}
        for r in rs:
            best.setdefault(r["name"], r)
        shown = rs[:top] + [r for r in best.values() if r not in rs[:top]]
        for r in shown:
            c = r["config"]
            print(
                f"{r['name']:28} {c['block_n']:7} {c['tiles']:5} {c['num_warps']:5} {c['num_stages']:6} "
                f"{str(c.get('maxnreg')):>7} {r['time_s'] * 1e6:9.1f} {r['roofline_s'] * 1e6:8.1f} "
                f"{r['time_s'] / r['roofline_s']:7.2f}"
            )
        f8 = best.get("indexer_fp8keys")
        print("best config per variant:")
        for name, r in sorted(best.items(), key=lambda kv: kv[1]["time_s"]):
            c = r["config"]
            vs = f", {f8['time_s'] / r['time_s']:.2f}x vs best fp8keys" if f8 else ""
            print(
                f"  {name:28} {r['time_s'] * 1e6:7.1f} us ({r['time_s'] / r['roofline_s']:.2f}x roof{vs}): "
                f"block_n={c['block_n']} tiles={c['tiles']} warps={c['num_warps']} stages={c['num_stages']} "
                f"maxnreg={c.get('maxnreg')}"
            )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--smoke", action="store_true", help="tiny shape and grid, CPU/interpreter allowed")
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 1, 8])
    ap.add_argument("--entries", type=int, default=262144)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "gluon_ws"], choices=VARIANTS)
    ap.add_argument("--grid", choices=["fast", "full"], default="fast", help="fast: 21 configs a variant")
    ap.add_argument("--timer", choices=["graph", "bench"], default="graph")
    ap.add_argument("--no-flush", action="store_true", help="graph timer: keep L2 warm between calls")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="parallel compile workers")
    ap.add_argument("--compile-timeout", type=float, default=120.0, help="seconds for the parallel compile")
    ap.add_argument(
        "--maxnreg", nargs="+", default=["none"], help="register caps to sweep (ints, or 'none' = ptxas's choice)"
    )
    ap.add_argument("--launches", nargs="+", default=None, help="fast grid: block_n,warps,stages triples")
    ap.add_argument("--tiles", type=int, nargs="+", default=None, help="fast grid: tiles per program")
    ap.add_argument("--top", type=int, default=25, help="rows shown per shape (plus each variant's best)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke")
    grid = SMOKE_GRID if args.smoke else FULL_GRID
    if args.smoke:
        args.entries, args.heads, args.page, args.batches = min(args.entries, 96), min(args.heads, 16), 16, [2]
        args.timer, args.jobs = "cpu", min(args.jobs, 2)
    t_start = time.perf_counter()
    info = {
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    configs = [dict(zip(grid, v, strict=True)) for v in itertools.product(*grid.values())]
    if args.grid == "fast" and not args.smoke:
        launches = [tuple(int(x) for x in t.split(",")) for t in args.launches] if args.launches else FAST_LAUNCHES
        configs = [
            {"block_n": bn, "tiles": t, "num_warps": nw, "num_stages": ns}
            for bn, nw, ns in launches
            for t in (args.tiles or FAST_TILES)
        ]
    caps = [None if m == "none" else int(m) for m in args.maxnreg]
    configs = [{**c, "maxnreg": m} for c in configs for m in caps]
    compile_cfgs = [c for c in configs if c["tiles"] == configs[0]["tiles"]]
    jobs = [(v, c) for v in args.variants for c in compile_cfgs]
    compile_errors = precompile(jobs, args)
    print(f"compiled {len(jobs)} binaries in {time.perf_counter() - t_start:.1f} s ({len(compile_errors)} failed)")
    if args.smoke:
        timer = cpu_time
    elif args.timer == "graph":
        timer = GraphTimer(flush=not args.no_flush)
    else:
        timer = bench_time
    rows: list[dict] = []
    notes: list[str] = []
    for B in args.batches:
        sweep_shape(args, dev, info, B, configs, compile_errors, timer, rows, notes)
        print(f"B={B} done at {time.perf_counter() - t_start:.1f} s")
    if args.out:
        write_jsonl(rows, args.out, append=True)
    print_table(rows, args.top)
    for k, e in sorted(compile_errors.items()):
        print(f"skipped {k[0]} block_n={k[1]} warps={k[2]} stages={k[3]} maxnreg={k[4]}: {e}")
    for n in notes:
        print(n)
    print(f"total {time.perf_counter() - t_start:.1f} s, {len(rows)} timings")


if __name__ == "__main__":
    main()
