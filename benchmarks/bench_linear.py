"""Benchmark of the fp32 pair linear of the compressor projections (tf32x3 Triton) against torch fp32.

    python benchmarks/bench_linear.py --out FILE.jsonl          # on the H200 (~2 min)
    python benchmarks/bench_linear.py --smoke                   # tiny shapes, correctness only (CPU interpreter or GPU)
    python benchmarks/bench_linear.py --sweep [--out FILE]      # decode launch configs, fastest printed (~3-5 min)

Op: ``linear_fp32_pair(x, w1, w2)`` = (x·w1ᵀ, x·w2ᵀ) in fp32, x [M, 4096], w1 = w2 shape [c·d, 4096] for the
three compressor widths c·d = 1024 (CSA main), 512 (HCA), 256 (CSA indexer), M = 1, 8, 64 (decode tokens)
and 65,536 (prefill).  Baseline, measured in the same run on the same data: two ``F.linear`` calls in fp32
(cuBLAS SIMT; ``torch.backends.cuda.matmul.allow_tf32`` off).

Timings (GPU):
- ``time_s`` / ``baseline_time_s``: ``triton.testing.do_bench`` median of one eager call (it clears L2 between
  calls, so the weights come from HBM; the Python launch path is included when it is slower than the GPU).
- ``graph_time_fused_s``: the layer's call (bf16 x: two tf32 products a K block, ``linear.TF32X2``; the K-split sum
  in the launch), ``graph_time_fused_tf32x3_s`` the same with tf32x3's three products, ``graph_time_fused_bf16x3_s``
  with ``precision="bf16x3"`` (three bf16 products of exact weight pieces; ``max_rel_err_fp64_bf16x3`` its error),
  ``graph_time_fused_bf16w_s`` with ``precision="bf16w"`` on the weights rounded to bf16 and passed as bf16 tensors
  (one bf16 product, half the weight bytes: what an FP8 checkpoint's compressor weights allow, as the layer runs them
  with ``BF16_EXACT_COMPRESSOR``; ``max_rel_err_fp64_bf16w`` against fp64 on those weights).
- ``graph_time_s`` / ``baseline_graph_time_s``: GPU time per call from a CUDA graph (``sweep_indexer.GraphTimer``) of
  GRAPH_CALLS (L2 flush, call) pairs, minus the time of a graph of the flushes alone (median of replays):
  what a captured decode step pays when the other layers' weights have evicted these from L2.
Bytes: x + both weights + both outputs, fp32 (the split-K partials, <= 1/4 of the weight bytes, are not
counted).  FLOPs: 2·M·K·(N1 + N2).  ``roofline_s`` = max(bytes / 4.17e12, flops / 495e12) (H200 HBM, dense
tf32 tensor-core peak); tf32x3 does 3 tf32 products per fp32 one, so ``roofline_tf32x3_s`` uses 3·flops.
Errors (elementwise, normalised by |x|·|w|ᵀ, the magnitude of the terms each output sums):
``max_rel_err`` of the Triton result vs torch fp32; ``max_rel_err_fp64`` / ``baseline_max_rel_err_fp64``
of each vs an fp64 product.

``--sweep``: at M = ``--sweep-m`` (64) and each width, every combination of ``--sweep-grid`` (block sizes,
warps, stages, split_k, orientation) is checked against torch fp32 and timed with the graph timer; the five
fastest correct launches per width are printed beside the default's time.  Configs that do not compile or fit
are skipped.  The default grid builds ~70 kernels (split_k is a runtime argument), ~2 s each.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.sweep_indexer import GraphTimer, bench_time  # noqa: E402
from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.kernels.linear import (  # noqa: E402
    GEMV_MAX_M,
    linear_counters,
    linear_fp32_pair,
    linear_fp32_pair_reference,
    linear_launch,
)

PEAK_HBM_BYTES = 4.17e12
PEAK_TF32_FLOPS = 495e12  # H200 dense tf32 tensor cores
K = 4096
WIDTHS = {"csa_main": 1024, "hca": 512, "csa_indexer": 256}
TOKENS = (1, 8, 64, 65536)
GRAPH_CALLS = 20
DEFAULT_SWEEP_GRID = "block_n=32,64,128;block_k=32,64;num_warps=4,8;num_stages=3,4,5;split_k=1,2,4,8,16;swap_ab=1"
MAX_REL_ERR = 1e-5  # vs torch fp32 and vs fp64, normalised by |x|·|w|ᵀ (tests/kernels/test_linear.py)
SMOKE_REL = 2 * 128 * 2.0**-24 + 3 * 2.0**-22  # two fp32 orders at K <= 128, plus tf32x3 (tests/kernels/test_linear.py)


# ---------------------------------------------------------------------------- data, errors
def make_inputs(m: int, n: int, k: int, device, seed: int = 0):
    """x ~ N(0, 1) [m, k], w1, w2 ~ N(0, 0.02²) [n, k], fp32 (generated on the CPU: the same data everywhere)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w1, w2 = (torch.randn(n, k, generator=g) * 0.02 for _ in range(2))
    return x.to(device), w1.to(device), w2.to(device)


def rel_err(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |got - want| / (|x|·|w|ᵀ), elementwise, computed in fp64."""
    if got.numel() == 0:
        return 0.0
    scale = x.double().abs() @ w.double().abs().T
    return ((got.double() - want.double()).abs() / scale.clamp_min(1e-300)).max().item()


# ---------------------------------------------------------------------------- benchmark
def cost(m: int, n: int, k: int) -> tuple[int, int, float, float]:
    """bytes, flops, roofline_s (fp32-equivalent flops on tf32 peak), roofline_tf32x3_s (3x the flops)."""
    nbytes = 4 * (m * k + 2 * n * k + 2 * m * n)
    flops = 2 * m * k * 2 * n
    mem = nbytes / PEAK_HBM_BYTES
    return nbytes, flops, max(mem, flops / PEAK_TF32_FLOPS), max(mem, 3 * flops / PEAK_TF32_FLOPS)


def run_case(op: str, m: int, n: int, timer: GraphTimer, meta: dict) -> dict:
    """One (width, M) row on the GPU: errors vs torch fp32 and fp64, then timings of both."""
    x, w1, w2 = make_inputs(m, n, K, "cuda")
    tri = lambda: linear_fp32_pair(x, w1, w2)
    cnt, xb = linear_counters("cuda"), x.bfloat16()
    # the layer's call: bf16 x widened in the kernel, the K-split sum inside the launch (``counters``)
    layer_call = lambda: linear_fp32_pair(xb, w1, w2, counters=cnt)
    base = lambda: linear_fp32_pair_reference(x, w1, w2)  # TF32 is off (main)
    y, t = tri(), base()
    err = max(rel_err(y[i], t[i], x, w) for i, w in enumerate((w1, w2)))
    err64 = max(rel_err(y[i], x.double() @ w.double().T, x, w) for i, w in enumerate((w1, w2)))
    base_err64 = max(rel_err(t[i], x.double() @ w.double().T, x, w) for i, w in enumerate((w1, w2)))
    del y, t
    nbytes, flops, roof, roof3 = cost(m, n, K)
    rec = {
        "name": f"linear/{op}",
        **meta,
        "shape": {"M": m, "N1": n, "N2": n, "K": K},
        "launch": linear_launch(m, n, n, K, num_sms=meta["sms"])._asdict(),
        "time_s": bench_time(tri),
        "graph_time_s": timer(tri),
        "bytes": nbytes,
        "flops": flops,
        "roofline_s": roof,
        "roofline_tf32x3_s": roof3,
        "graph_time_fused_s": timer(layer_call),
        "graph_time_fused_tf32x3_s": _without_tf32x2(timer, layer_call),
        "graph_time_fused_bf16x3_s": timer(lambda: linear_fp32_pair(xb, w1, w2, counters=cnt, precision="bf16x3")),
        "max_rel_err_fp64_bf16x3": max(
            rel_err(linear_fp32_pair(xb, w1, w2, precision="bf16x3")[i], xb.double() @ w.double().T, xb.float(), w)
            for i, w in enumerate((w1, w2))
        ),
        **_bf16w_cols(xb, w1, w2, cnt, timer),
        "baseline": "torch fp32: two F.linear (cuBLAS, TF32 off)",
        "baseline_time_s": bench_time(base),
        "baseline_graph_time_s": timer(base),
        "max_rel_err": err,
        "max_rel_err_fp64": err64,
        "baseline_max_rel_err_fp64": base_err64,
    }
    rec["gemv"] = m <= GEMV_MAX_M  # the few-token kernel (default up to GEMV_MAX_M tokens)
    if rec["gemv"]:  # the tensor-core kernel on the same call, for comparison
        rec["graph_time_fused_tc_s"] = timer(lambda: linear_fp32_pair(xb, w1, w2, counters=cnt, gemv=False))
    rec["speedup_graph"] = rec["baseline_graph_time_s"] / rec["graph_time_s"] if rec["graph_time_s"] else None
    return rec


def _bf16w_cols(xb, w1, w2, cnt, timer: GraphTimer) -> dict:
    """The layer's call with ``precision="bf16w"`` on the weights rounded to bf16 (as an FP8 checkpoint's are exact
    in bf16): its graph time and its error against fp64 on those weights."""
    b1, b2 = w1.bfloat16(), w2.bfloat16()  # (the layer's bf16 copies of exact weights)
    y = linear_fp32_pair(xb, b1, b2, precision="bf16w")
    err = max(rel_err(y[i], xb.double() @ w.double().T, xb.float(), w.float()) for i, w in enumerate((b1, b2)))
    t = timer(lambda: linear_fp32_pair(xb, b1, b2, counters=cnt, precision="bf16w"))
    return {"graph_time_fused_bf16w_s": t, "max_rel_err_fp64_bf16w": err}


def _without_tf32x2(timer: GraphTimer, fn) -> float:
    """``timer(fn)`` with the bf16 GEMM's two-product path off (``linear.TF32X2``): tf32x3's three products."""
    from dsv4.kernels import linear as linear_mod

    old, linear_mod.TF32X2 = linear_mod.TF32X2, False
    try:
        return timer(fn)
    finally:
        linear_mod.TF32X2 = old


def us(t: float | None) -> str:
    return "     n/a" if t is None else f"{t * 1e6:8.1f}"


def print_row(r: dict) -> None:
    s = r["shape"]
    g = r["graph_time_s"]
    pct = f"{100 * r['roofline_tf32x3_s'] / g:5.1f}%" if g else "   n/a"
    tc = f"; tensor cores {us(r['graph_time_fused_tc_s'])}" if r.get("gemv") else ""
    print(
        f"{r['name']:20s} M {s['M']:6d} N {s['N1']:5d}  graph {us(g)} us"
        f" (bf16 x, fused sum {us(r['graph_time_fused_s'])}; its tf32x3 {us(r['graph_time_fused_tf32x3_s'])}"
        f", bf16x3 {us(r['graph_time_fused_bf16x3_s'])} err {r['max_rel_err_fp64_bf16x3']:.1e}"
        f", bf16w {us(r['graph_time_fused_bf16w_s'])} err {r['max_rel_err_fp64_bf16w']:.1e}{tc})"
        f"  eager {us(r['time_s'])} us"
        f"  torch graph {us(r['baseline_graph_time_s'])} us  eager {us(r['baseline_time_s'])} us"
        f"  roofline {us(r['roofline_s'])} / x3 {us(r['roofline_tf32x3_s'])} us ({pct})"
        f"  err vs torch {r['max_rel_err']:.2e}  vs fp64 {r['max_rel_err_fp64']:.2e}"
        f" (torch {r['baseline_max_rel_err_fp64']:.2e})",
        flush=True,
    )


def smoke(meta: dict) -> list[dict]:
    """Tiny shapes through the Triton path (interpreter on the CPU): correctness only."""
    rows = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = [(1, 96, 48, {}), (5, 96, 40, {"split_k": 3, "block_k": 64}), (33, 128, 100, {"swap_ab": False})]
    for m, k, n, kw in cases:  # default launch; a K split ending in a masked block; x·wᵀ orientation
        x, w1, w2 = make_inputs(m, n, k, device, seed=m)
        y = linear_fp32_pair(x, w1, w2, backend="triton", **kw)
        t = linear_fp32_pair_reference(x, w1, w2)
        err = max(rel_err(y[i], t[i], x, w) for i, w in enumerate((w1, w2)))
        ok = err <= SMOKE_REL
        shape = {"M": m, "N1": n, "N2": n, "K": k}
        rows.append({"name": "linear/smoke", **meta, "shape": shape, "launch": kw, "max_rel_err": err, "correct": ok})
        print(f"smoke {shape} {kw}: err {err:.2e} (bound {SMOKE_REL:.2e}) {'ok' if ok else 'MISMATCH'}")
    return rows


def parse_grid(spec: str) -> list[dict]:
    """``"key=v,v;key=v"`` -> every combination as launch keyword dicts (swap_ab as 0/1)."""
    keys, values = [], []
    for item in filter(None, spec.split(";")):
        key, _, vals = item.partition("=")
        keys.append(key.strip())
        values.append([bool(int(v)) if key.strip() == "swap_ab" else int(v) for v in vals.split(",")])
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def sweep(m: int, grid: list[dict], timer: GraphTimer, meta: dict) -> list[dict]:
    """The default launch and every launch of ``grid`` at M = m for each width: checked against torch fp32,
    graph-timed; prints the default's time and the five fastest correct launches."""
    rows = []
    for op, n in WIDTHS.items():
        x, w1, w2 = make_inputs(m, n, K, "cuda")
        want = linear_fp32_pair_reference(x, w1, w2)
        default = linear_launch(m, n, n, K, num_sms=meta["sms"])._asdict()
        results = []
        for kw in [{}] + grid:
            launch = {**default, **kw}
            fn = functools.partial(linear_fp32_pair, x, w1, w2, **launch)
            try:
                y = fn()
                err = max(rel_err(y[i], want[i], x, w) for i, w in enumerate((w1, w2)))
                t = timer(fn)
            except Exception as e:  # noqa: BLE001 - out of shared memory / registers: skip the config
                torch.cuda.synchronize()
                print(f"  skip {launch}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                continue
            results.append((t, err, launch))
            rows.append({"name": f"linear/sweep/{op}", **meta, "shape": {"M": m, "N1": n, "N2": n, "K": K},
                         "launch": launch, "graph_time_s": t, "max_rel_err": err,
                         "default": launch == default})  # fmt: skip
        t_default = next((t for t, _, launch in results if launch == default), None)
        good = sorted((r for r in results if r[1] <= MAX_REL_ERR), key=lambda r: r[0])
        print(f"{op} M {m} N {n}: default {us(t_default)} us {default}; {len(good)} of {len(results)} launches correct")
        for t, err, launch in good[:5]:
            print(f"  {us(t)} us  err {err:.1e}  {launch}{' (default)' if launch == default else ''}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (CPU interpreter friendly)")
    ap.add_argument("--sweep", action="store_true", help="time a grid of launch configs at the decode shape")
    ap.add_argument("--sweep-m", type=int, default=64, help="tokens of the sweep (default 64)")
    ap.add_argument("--sweep-grid", default=DEFAULT_SWEEP_GRID, help="'key=v,v;key=v' (linear_launch keywords)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M values")
    ap.add_argument("--ops", default=",".join(WIDTHS), help="comma-separated subset of " + ",".join(WIDTHS))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    meta = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)",
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else 132,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    if args.smoke:
        rows = smoke(meta)
        ok = all(r["correct"] for r in rows)
    elif not cuda:
        sys.exit("needs a CUDA device (or --smoke)")
    elif args.sweep:
        rows = sweep(args.sweep_m, parse_grid(args.sweep_grid), GraphTimer(n=GRAPH_CALLS), meta)
        ok = True
    else:
        timer = GraphTimer(n=GRAPH_CALLS)
        rows = []
        for op in args.ops.split(","):
            for m in map(int, args.tokens.split(",")):
                rows.append(run_case(op, m, WIDTHS[op], timer, meta))
                print_row(rows[-1])
                torch.cuda.empty_cache()
        ok = all(r["max_rel_err_fp64"] <= MAX_REL_ERR for r in rows)
    if args.out:
        write_jsonl(rows, args.out, append=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
