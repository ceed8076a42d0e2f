"""Benchmark of the layer's dense projections on FP8 weights (``kernels.fp8_linear``) against cuBLAS bf16.

    python benchmarks/bench_fp8_linear.py --out FILE.jsonl      # on the H200 (~1-2 min)
    python benchmarks/bench_fp8_linear.py --smoke               # tiny shapes, correctness only (CPU interpreter or GPU)

Ops: each projection of one attention layer at the real widths of V4-Flash and V4-Pro (``wq_a``, ``wq_b``, ``wkv``,
grouped ``wo_a``, ``wo_b``, the indexer's ``wq_b`` and ``weights_proj``) for M = 1, 8, 64, 128 tokens (a decode
step's requests; 128: 64 requests verifying a draft token each), and ``all``: the seven back to back (a CSA layer's
projections in one decode step), and ``compressors_csa``: a CSA layer's four compressor weights as the layer keeps
them in FP8 (one launch, fp32 outputs) against the layer's tf32x3 GEMM on the fp32 weights.  dsv4:
``fp8_linear(x, w)`` on the e4m3 weight and its UE8M0 block scales, the split sum in the launch (``counters``).
Baseline, in the same run on the same values: what the layer ran before, ``F.linear`` (cuBLAS bf16; ``wo_a`` a
grouped einsum) on the weight dequantised to bf16 once (the same products).

Timing: GPU time per call from a CUDA graph of 20 (L2 flush, call) pairs minus a graph of the flushes alone
(``sweep_indexer.GraphTimer``): the weights come from HBM, as in a decode step whose other layers evicted them.
Bytes: the weights (dsv4: 1 byte an element + fp32 block scales; baseline: 2), x and y in bf16; FLOPs 2·M·N·K.
``roofline_s`` = max(bytes / 4.17e12, flops / 776e12) of dsv4's bytes, ``baseline_roofline_s`` of the baseline's.
``max_err_bound`` (must be <= 1): the largest error against fp64 divided by the bound of
``tests/kernels/test_fp8_linear.py`` (half a bf16 ulp of |y| plus the fp32 sum's).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_indexer import env_info  # noqa: E402
from dsv4.config import get_preset  # noqa: E402
from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.formats.fp8_weight import FP8Weight  # noqa: E402
from dsv4.kernels import fp8_linear as fp8_mod  # noqa: E402
from dsv4.kernels.dispatch import num_sms  # noqa: E402
from dsv4.kernels.fp8_linear import fp8_linear, fp8_linear_launch, grouped_linear  # noqa: E402
from dsv4.kernels.linear import linear_fp32_group  # noqa: E402

PEAK_HBM_BYTES = 4.17e12
PEAK_BF16_FLOPS = 776e12
TOKENS = (1, 8, 64, 128)
MODELS = ("v4-flash", "v4-pro")
GRAPH_CALLS = 20


def projection_shapes(model: str) -> dict[str, tuple[int, int, int]]:
    """name -> (weight rows, K, groups) of one layer's projections (x has groups·K columns)."""
    c = get_preset(model)
    return {
        "wq_a": (c.q_lora_rank, c.dim, 1),
        "wq_b": (c.n_heads * c.head_dim, c.q_lora_rank, 1),
        "wkv": (c.head_dim, c.dim, 1),
        "wo_a": (c.o_groups * c.o_lora_rank, (c.n_heads // c.o_groups) * c.head_dim, c.o_groups),
        "wo_b": (c.dim, c.o_groups * c.o_lora_rank, 1),
        "idx_wq_b": (c.index_n_heads * c.index_head_dim, c.q_lora_rank, 1),
        "weights_proj": (c.index_n_heads, c.dim, 1),
    }


def make_case(rows: int, k: int, groups: int, m: int, device, seed: int = 0):
    """An FP8 weight as a checkpoint holds it (N(0, 1/K) quantised with UE8M0 block scales), its bf16 dequantisation
    and x ~ N(0, 1) [m, groups·k] bf16 (generated on the CPU: the same data everywhere)."""
    g = torch.Generator().manual_seed(seed)
    w = FP8Weight.quantize(torch.randn(rows, k, generator=g) / k**0.5).to(device)
    x = torch.randn(m, groups * k, generator=g).to(torch.bfloat16).to(device)
    return w, w.dequantize(torch.bfloat16), x


def err_vs_bound(y: torch.Tensor, x: torch.Tensor, w: FP8Weight, groups: int) -> float:
    """max |y - exact| / (2^-8·|exact| + 2·K·2^-24·(|x|·|w|ᵀ)) against fp64 (tests/kernels/test_fp8_linear.py); an
    fp32 y (the compressors' projections) without the bf16 rounding's 2^-8·|exact|."""
    wd = w.dequantize().double()
    k = wd.shape[1]
    xg = x.double().unflatten(-1, (groups, k))
    wg = wd.view(groups, -1, k)
    exact = torch.einsum("mgk,gnk->mgn", xg, wg).flatten(-2)
    mag = torch.einsum("mgk,gnk->mgn", xg.abs(), wg.abs()).flatten(-2)
    rel = 2.0**-8 if y.dtype == torch.bfloat16 else 0.0
    bound = rel * exact.abs() + 2 * k * 2.0**-24 * mag + 1e-30
    return ((y.double() - exact).abs() / bound).max().item()


def _bytes(w_bytes: int, m: int, rows: int, k: int, groups: int) -> int:
    return w_bytes + 2 * m * (groups * k + rows)


def run_model(model: str, m: int, timer, meta: dict, cvt_asm: bool | None = None, device="cuda") -> list[dict]:
    """The rows of one model and token count (``timer(fn) -> seconds``; ``device`` "cpu": the interpreter, for the
    tests of this script)."""
    rows_out = []
    meta = {**meta, "cvt_asm": fp8_mod.CVT_ASM if cvt_asm is None else cvt_asm}
    cnt = torch.zeros(4096, dtype=torch.int32, device=device)
    shapes = projection_shapes(model)
    cases = {name: make_case(*shape, m, device, seed=i) for i, (name, shape) in enumerate(shapes.items())}
    for name, (w, wd, x) in cases.items():
        rows, k, groups = shapes[name]
        y = fp8_linear(x, w, "triton", groups=groups, counters=cnt, cvt_asm=cvt_asm)
        ratio = err_vs_bound(y, x, w, groups)
        yb = grouped_linear(x, wd, groups)
        t = timer(lambda w=w, x=x, g=groups: fp8_linear(x, w, "triton", groups=g, counters=cnt, cvt_asm=cvt_asm))
        tb = timer(lambda wd=wd, x=x, groups=groups: grouped_linear(x, wd, groups))
        nb, nbb = _bytes(w.nbytes, m, rows, k, groups), _bytes(2 * rows * k, m, rows, k, groups)
        fl = 2.0 * m * rows * k
        launch = fp8_linear_launch(m, rows, k, num_sms=meta["sms"])
        rows_out.append({
            "name": f"fp8_linear_{name}", "model": model, **meta,
            "shape": {"m": m, "rows": rows, "k": k, "groups": groups},
            "launch": launch._asdict(), "time_s": t, "bytes": nb, "flops": fl,
            "roofline_s": max(nb / PEAK_HBM_BYTES, fl / PEAK_BF16_FLOPS),
            "baseline": "F.linear bf16 (cuBLAS) on the dequantised weight", "baseline_time_s": tb,
            "baseline_bytes": nbb, "baseline_roofline_s": max(nbb / PEAK_HBM_BYTES, fl / PEAK_BF16_FLOPS),
            "max_err_bound": ratio, "baseline_max_err_bound": err_vs_bound(yb, x, w, groups),
            "differ_from_baseline": (y != yb).float().mean().item(),
        })  # fmt: skip
        print_row(rows_out[-1])

    def all_fp8():
        for name, (w, _, x) in cases.items():
            fp8_linear(x, w, "triton", groups=shapes[name][2], counters=cnt, cvt_asm=cvt_asm)

    def all_base():
        for name, (_, wd, x) in cases.items():
            grouped_linear(x, wd, shapes[name][2])

    nb = sum(r["bytes"] for r in rows_out)
    nbb = sum(r["baseline_bytes"] for r in rows_out)
    fl = sum(r["flops"] for r in rows_out)
    all_row = {
        "name": "fp8_linear_all", "model": model, **meta, "shape": {"m": m, "ops": list(cases)},
        "time_s": timer(all_fp8), "bytes": nb, "flops": fl,
        "roofline_s": max(nb / PEAK_HBM_BYTES, fl / PEAK_BF16_FLOPS),
        "baseline": "F.linear bf16 (cuBLAS) on the dequantised weights", "baseline_time_s": timer(all_base),
        "baseline_bytes": nbb, "baseline_roofline_s": max(nbb / PEAK_HBM_BYTES, fl / PEAK_BF16_FLOPS),
    }  # fmt: skip
    rows_out.append(all_row)
    print_row(rows_out[-1])
    rows_out.append(compressor_row(model, m, timer, meta, cnt, cvt_asm, device))
    print_row(rows_out[-1])
    return rows_out


def compressor_row(model: str, m: int, timer, meta: dict, cnt: torch.Tensor, cvt_asm: bool | None, device) -> dict:
    """A CSA layer's four compressor weights (main wkv, wgate [2·head_dim, dim]; the indexer's [2·index_head_dim,
    dim]) stacked as the layer keeps them in FP8, one ``fp8_linear`` with fp32 outputs, against the layer's GEMM on
    the fp32 weights (``linear_fp32_group``: tf32x3, two products on bf16 x)."""
    c = get_preset(model)
    widths = [2 * c.head_dim] * 2 + [2 * c.index_head_dim] * 2
    w, _, x = make_case(sum(widths), c.dim, 1, m, device, seed=99)
    wf = list(torch.split(w.dequantize(), widths))  # the exact fp32 weights
    y = fp8_linear(x, w, "triton", counters=cnt, cvt_asm=cvt_asm, out_dtype=torch.float32)
    ratio = err_vs_bound(y, x, w, 1)
    yb = torch.cat(linear_fp32_group(x, wf, "triton", counters=cnt), dim=1)
    t = timer(lambda: fp8_linear(x, w, "triton", counters=cnt, cvt_asm=cvt_asm, out_dtype=torch.float32))
    tb = timer(lambda: linear_fp32_group(x, wf, "triton", counters=cnt))
    rows, k = w.shape
    nb, nbb = w.nbytes + 2 * m * k + 4 * m * rows, 4 * rows * k + 2 * m * k + 4 * m * rows
    fl = 2.0 * m * rows * k
    return {
        "name": "fp8_linear_compressors_csa", "model": model, **meta, "shape": {"m": m, "rows": rows, "k": k},
        "time_s": t, "bytes": nb, "flops": fl, "roofline_s": max(nb / PEAK_HBM_BYTES, fl / PEAK_BF16_FLOPS),
        "baseline": "linear_fp32_group (tf32x3 Triton, the layer's) on the fp32 weights", "baseline_time_s": tb,
        "baseline_bytes": nbb, "baseline_roofline_s": max(nbb / PEAK_HBM_BYTES, fl / PEAK_BF16_FLOPS),
        "max_err_bound": ratio, "baseline_max_err_bound": err_vs_bound(yb, x, w, 1),
    }  # fmt: skip


SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_SPLIT = (1, 2, 4, 8, 16)


def sweep_model(model: str, m: int, timer, meta: dict, device="cuda") -> list[dict]:
    """``--sweep``: each projection at M tokens over launch geometries (BLOCK_N x K split, ``fp8_linear_launch``'s
    other choices; at M <= 4 each also in the kernel's GEMV form, ``gemv=True``), one row a projection: the default
    launch's time, the best one's, and every time tried."""
    out = []
    cnt = torch.zeros(65536, dtype=torch.int32, device=device)
    for i, (name, (rows, k, groups)) in enumerate(projection_shapes(model).items()):
        w, _, x = make_case(rows, k, groups, m, device, seed=i)
        default = fp8_linear_launch(m, rows, k, num_sms=meta["sms"])
        times = {}
        for bn in SWEEP_BLOCK_N:
            for sk in SWEEP_SPLIT:
                if sk > 1 and k < 2 * sk * fp8_mod._BLOCK_K:  # (a split of at least two K blocks)
                    continue

                for gv in (False, True) if m <= fp8_mod._GEMV_LIMIT else (False,):  # (the GEMV form: "_gemv")

                    def call(w=w, x=x, g=groups, bn=bn, sk=sk, gv=gv):
                        return fp8_linear(x, w, "triton", groups=g, counters=cnt, block_n=bn, split_k=sk, gemv=gv)

                    times[f"bn{bn}_s{sk}" + ("_gemv" if gv else "")] = timer(call)
        t_default = timer(lambda w=w, x=x, g=groups: fp8_linear(x, w, "triton", groups=g, counters=cnt))
        best = min(times, key=times.get)
        out.append({
            "name": f"fp8_linear_sweep_{name}", "model": model, **meta, "shape": {"m": m, "rows": rows, "k": k,
            "groups": groups}, "default_launch": default._asdict(), "time_s": t_default, "best": best,
            "best_time_s": times[best], "times_s": times, "bytes": _bytes(w.nbytes, m, rows, k, groups),
        })  # fmt: skip
        r = out[-1]
        print(
            f"{model:9s} sweep {name:13s} m {m:4d} default bn{default.block_n}_s{default.split_k} "
            f"{1e6 * t_default:8.2f} us  best {best} {1e6 * times[best]:8.2f} us  "
            f"({100 * r['bytes'] / PEAK_HBM_BYTES / times[best]:5.1f}% of roofline)",
            flush=True,
        )
    return out


def print_row(r: dict) -> None:
    s = r["shape"]
    pct = 100 * r["roofline_s"] / r["time_s"] if r["time_s"] else float("nan")
    bpct = 100 * r["baseline_roofline_s"] / r["baseline_time_s"] if r["baseline_time_s"] else float("nan")
    err = f" err/bound {r['max_err_bound']:.2f}" if "max_err_bound" in r else ""
    print(
        f"{r['model']:9s} cvt_asm {int(r['cvt_asm'])} {r['name']:24s} m {s['m']:4d}  "
        f"fp8 {1e6 * r['time_s']:8.2f} us ({pct:5.1f}% of roofline)  "
        f"bf16 {1e6 * r['baseline_time_s']:8.2f} us ({bpct:5.1f}%)  x{r['baseline_time_s'] / r['time_s']:.2f}{err}",
        flush=True,
    )


def smoke(meta: dict) -> list[dict]:
    """Tiny shapes (CPU interpreter friendly): the kernel within the bound, with and without groups and splits."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for rows, k, groups, m, kw in [(128, 256, 1, 1, {}), (200, 300, 1, 5, {"split_k": 2}), (256, 256, 2, 3, {})]:
        w, _, x = make_case(rows, k, groups, m, dev)
        ratio = err_vs_bound(fp8_linear(x, w, "triton", groups=groups, **kw).cpu(), x.cpu(), w.to("cpu"), groups)
        out.append({"name": "fp8_linear_smoke", **meta, "shape": {"m": m, "rows": rows, "k": k, "groups": groups},
                    "max_err_bound": ratio, "correct": ratio <= 1.0})  # fmt: skip
        print(out[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (CPU interpreter friendly)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M values")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    ap.add_argument("--cvt-asm", default="default", choices=["default", "0", "1"], help="weight conversion (CVT_ASM)")
    ap.add_argument("--sweep", action="store_true", help="launch geometries of each projection instead (sweep_model)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    meta = {**env_info(dev), "sms": num_sms(dev)}
    if args.smoke:
        rows = smoke(meta)
        ok = all(r["correct"] for r in rows)
    elif not cuda:
        sys.exit("needs a CUDA device (or --smoke)")
    else:
        from benchmarks.sweep_indexer import GraphTimer

        timer = GraphTimer(n=GRAPH_CALLS)
        rows = []
        for model in args.models.split(","):
            for m in map(int, args.tokens.split(",")):
                cvt = None if args.cvt_asm == "default" else args.cvt_asm == "1"
                rows += sweep_model(model, m, timer, meta) if args.sweep else run_model(model, m, timer, meta, cvt)
                torch.cuda.empty_cache()
        ok = all(r.get("max_err_bound", 0.0) <= 1.0 for r in rows)
    if args.out:
        write_jsonl(rows, args.out, append=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
