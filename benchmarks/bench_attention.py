"""Benchmark of the sparse attention read path (DeepSeek-V4 decode shapes) against plain PyTorch.

    python benchmarks/bench_attention.py --out results.jsonl          # on the H200
    python benchmarks/bench_attention.py --smoke                       # tiny shapes, CPU (interpreter) or GPU
    python benchmarks/bench_attention.py --sweep --out sweep.jsonl     # also try Triton block configs

Shapes: V4-Flash (64 heads, CSA top-k 512) and V4-Pro (128 heads, top-k 1024) decode at B = 1, 8, 64
with the 128-entry window + top-k entries; HCA with 8192 compressed entries + window at B = 1, 8.
Every entry is valid (full window, full top-k).  For each shape, in one process and on the same data:
correctness of the Triton kernel vs the PyTorch reference first, then the median time of the Triton op
(``time_s``: CUDA-graph replay of the default path ``path`` (``selected_path``), i.e. GPU time as a captured
decode step pays it; ``eager_time_s``: ``triton.testing.do_bench`` of one eager call, launch path included;
``fused_time_s``: graph time of the fused Triton kernel; ``gathered_time_s``: of the two-launch gathered path
(Triton dense kernel); ``gathered_gluon_dense_time_s`` / ``gluon_fused_time_s``: with the Gluon dense kernel / of
the fused Gluon kernel, sm_90 only; all checked too), of the PyTorch reference (eager)
and of ``torch.compile`` of a plain PyTorch version (gather -> dequantise -> matmul -> softmax with sink),
both with ``do_bench`` (they cannot all be captured).

FLOPs = 2*T*H*N*(D + D) (QK and PV), bytes = T*N*entry_bytes (each query row reads its N entries once),
roofline = max(flops / 776e12, bytes / 4.17e12) (spec performance.md, H200).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv4.config import get_preset  # noqa: E402
from dsv4.formats import FP8EntryFormat  # noqa: E402
from dsv4.kernels.attention import sparse_attention_reference, sparse_attention_triton  # noqa: E402
from dsv4.kernels.attention.sparse_attention import gluon_dense_supported, selected_path  # noqa: E402
from dsv4.kernels.dispatch import pdl_launch  # noqa: E402

PEAK_BF16_FLOPS = 776e12
PEAK_HBM_BYTES = 4.17e12
FMT = FP8EntryFormat()


def _us(t: float | None) -> str:
    """Seconds as microseconds with one decimal, or "-" for a path that was not run."""
    return "-" if t is None else f"{t * 1e6:.1f}"


# ---------------------------------------------------------------------------- data
def fused_knobs(spec: str) -> dict[str, int]:
    """``"KEY=VAL[+KEY=VAL]"`` -> ``{"GLUON_FUSED_KEY": VAL}``, the fused Gluon kernel's module knobs
    (``sparse_attention.GLUON_FUSED_*``) for one run of ``profile_attention.py --fused`` or ``ncu_cases.py``; a key
    the module does not have is refused (SystemExit), so a typo does not time the default."""
    SA = sys.modules["dsv4.kernels.attention.sparse_attention"]
    known = sorted(k for k in dir(SA) if k.startswith("GLUON_FUSED_"))
    knobs = {f"GLUON_FUSED_{k}": int(v) for k, v in (kv.split("=") for kv in spec.split("+") if kv)}
    if not knobs.keys() <= set(known):
        raise SystemExit(f"--fused {spec}: expected knobs among {known}")
    return knobs


def make_pool(num_entries: int, bs: int, device, gen: torch.Generator):
    """A pool of ``num_entries`` random unit-RMS entries in MODEL1 pages of ``bs`` rows."""
    pages_n = math.ceil(num_entries / bs)
    flat = torch.zeros(pages_n * FMT.page_bytes(bs), dtype=torch.uint8, device=device)
    pages = FMT.entry_pages(flat, pages_n, bs)
    chunk = max(1, (1 << 24) // (bs * FMT.head_dim))  # pages quantised per step (bounded temp memory)
    for p0 in range(0, pages_n, chunk):
        p1 = min(pages_n, p0 + chunk)
        x = torch.randn(p1 - p0, bs, FMT.head_dim, generator=gen, device="cpu").to(device)
        nope, rope, scale = FMT.quantize(x)
        pages.nope[p0:p1].view(torch.uint8).copy_(nope.view(torch.uint8))
        pages.rope[p0:p1].copy_(rope)
        pages.scale[p0:p1].copy_(scale)
    return pages


def make_case(B: int, H: int, window: int, ctx: int, topk: int | None, device, seed: int = 0, one_request=False):
    """Caches and queries of one step: window ring + pool (top-k of ``ctx`` or all ``ctx`` entries).

    Decode: B requests, each with its own ring page and pool pages.  ``one_request``: B query rows of one
    request (a prefill chunk): one ring and one pool shared by every row, each row with its own top-k."""
    gen = torch.Generator().manual_seed(seed)
    owners = 1 if one_request else B
    win = make_pool(owners * window, window, device, gen)  # one ring page per request
    widx = torch.arange(owners * window, dtype=torch.int32).view(owners, window).expand(B, window).contiguous()
    bs = 64
    pages_per_req = math.ceil(ctx / bs)
    pool = make_pool(owners * pages_per_req * bs, bs, device, gen)
    page_of = torch.randperm(owners * pages_per_req, generator=gen).view(owners, pages_per_req).expand(B, -1)
    if topk is None:
        logical = torch.arange(ctx).expand(B, ctx)
    else:
        logical = torch.rand(B, ctx, generator=gen).topk(topk, dim=1).indices
    pidx = (torch.gather(page_of, 1, logical // bs) * bs + logical % bs).int()
    q = torch.randn(B, H, FMT.head_dim, generator=gen)
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)  # per-head RMS norm, as the model does
    sink = torch.randn(H, generator=gen)
    caches = [(win, widx.to(device)), (pool, pidx.to(device))]
    return q.to(torch.bfloat16).to(device), caches, sink.to(device)


# ---------------------------------------------------------------------------- plain PyTorch baseline
def plain_attention(q, flat_caches, sink, sm_scale):
    """What a user would write: gather -> dequantise -> bf16 matmul -> softmax with a sink column -> matmul."""
    keys, valids = [], []
    for nope, rope, scale, idx in flat_caches:
        num_pages, bs, nope_dim = nope.shape
        n_tiles = scale.shape[-1]
        valid = (idx >= 0) & (idx < num_pages * bs)
        slot = torch.where(valid, idx, 0).long()
        page, row = slot // bs, slot % bs
        n = nope.view(torch.uint8)[page, row].view(nope.dtype).float()
        s = torch.exp2(scale[page, row].float() - 127.0)
        k = (n.unflatten(-1, (n_tiles, nope_dim // n_tiles)) * s[..., None]).flatten(-2)
        keys.append(torch.cat([k.to(torch.bfloat16), rope[page, row]], dim=-1))
        valids.append(valid)
    k = torch.cat(keys, dim=1)  # [T, N, D] bf16
    valid = torch.cat(valids, dim=1)
    logits = torch.matmul(q, k.transpose(1, 2)).float() * sm_scale  # [T, H, N]
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    full = torch.cat([logits, sink[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return torch.matmul(p.to(torch.bfloat16), k)


# ---------------------------------------------------------------------------- timing
def bench(fn, smoke: bool) -> float:
    """Median seconds of ``fn()``: do_bench on CUDA, a few wall-clock runs on the CPU."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(2 if smoke else 5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_call(fn, smoke: bool) -> tuple[float, str]:
    """Median seconds per call: CUDA-graph replay of 10 calls, else do_bench, else wall clock (CPU)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, "wall"
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up / compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(15):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / 10)
        return statistics.median(times), "graph"
    except Exception:  # noqa: BLE001 - any capture problem: fall back to the eager timer
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3, "do_bench"


def check(out, ref) -> tuple[bool, float]:
    diff = (out.float() - ref.float()).abs()
    ok = bool(torch.isfinite(out.float()).all()) and bool((diff <= 2e-2 + 1.6e-2 * ref.float().abs()).all())
    return ok, float(diff.max())


def shapes(smoke: bool):
    flash, pro = get_preset("v4-flash"), get_preset("v4-pro")
    win = flash.window_size
    if smoke:
        return [
            ("smoke/csa/B2", 2, 8, win // 4, 64, 16),
            ("smoke/hca/B1", 1, 4, win // 4, 80, None),
            ("smoke/csa/prefill6", 6, 4, win // 4, 64, 16),
        ]
    out = []
    for cfg in (flash, pro):
        for B in (1, 8, 64):
            out.append((f"{cfg.name}/csa/B{B}", B, cfg.n_heads, win, 4 * cfg.index_topk, cfg.index_topk))
    for cfg in (flash, pro):
        for B in (1, 8):
            out.append((f"{cfg.name}/hca8192/B{B}", B, cfg.n_heads, win, 8192, None))
    # prefill chunks: T query rows, each with its own window + top-k list (per-query visibility)
    out.append((f"{flash.name}/csa/prefill2048", 2048, flash.n_heads, win, 16 * flash.index_topk, flash.index_topk))
    out.append((f"{pro.name}/csa/prefill1024", 1024, pro.n_heads, win, 16 * pro.index_topk, pro.index_topk))
    return out


SWEEP = [
    {"block_h": bh, "block_n": bn, "num_warps": nw, "num_stages": ns}
    for bh in (16, 32, 64)
    for bn in (16, 32, 64)
    for nw in (4, 8)
    for ns in (1, 2)
]

SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
# paths timed next to the default (``selected_path``: the fused Gluon kernel on sm_90, else gathered with
# dense="auto") in every row: the fused Triton kernel, the gathered path with the Triton dense kernel and with the
# Gluon dense kernel, and the fused Gluon kernel (the last two sm_90 only)
PATHS = {
    "fused": {"path": "fused"},
    "gathered": {"path": "gathered", "dense": "triton"},
    "gathered_gluon_dense": {"path": "gathered", "dense": "gluon"},
    "gluon_fused": {"path": "gluon_fused"},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="append JSON lines to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on the CPU under the interpreter)")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of Triton block configs")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    common = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pdl": pdl_launch(device)["PDL"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    compiled = None if args.no_compile else torch.compile(plain_attention, dynamic=False)
    sm_scale = FMT.head_dim**-0.5
    rows = []
    out_file = open(args.out, "a") if args.out else None  # noqa: SIM115
    for name, B, H, window, ctx, topk in shapes(args.smoke):
        q, caches, sink = make_case(B, H, window, ctx, topk, device, one_request="prefill" in name)
        flat = [(p.nope, p.rope, p.scale, idx) for p, idx in caches]
        N = sum(idx.shape[1] for _, idx in caches)
        flops = 2 * B * H * N * (FMT.head_dim + FMT.head_dim)
        nbytes = B * N * FMT.entry_bytes
        roofline = max(flops / PEAK_BF16_FLOPS, nbytes / PEAK_HBM_BYTES)

        ref, _ = sparse_attention_reference(q, caches, sink, sm_scale)
        out, _ = sparse_attention_triton(q, caches, sink, sm_scale)
        ok, err = check(out, ref)
        t_triton_eager = bench(lambda q=q, c=caches, s=sink: sparse_attention_triton(q, c, s, sm_scale), args.smoke)
        t_triton, timer = time_call(
            lambda q=q, c=caches, s=sink: sparse_attention_triton(q, c, s, sm_scale), args.smoke
        )
        t_path = {}
        for path, kw in PATHS.items():
            gluon = kw.get("dense") == "gluon" or kw["path"] == "gluon_fused"
            if gluon and not gluon_dense_supported(q, q.shape[-1]):
                continue  # CPU / not sm_90: the Gluon kernel cannot run
            o, _ = sparse_attention_triton(q, caches, sink, sm_scale, **kw)
            ok = ok and check(o, ref)[0]
            t_path[path], _ = time_call(
                lambda q=q, c=caches, s=sink, k=kw: sparse_attention_triton(q, c, s, sm_scale, **k), args.smoke
            )
        t_eager = bench(lambda q=q, c=caches, s=sink: sparse_attention_reference(q, c, s, sm_scale), args.smoke)
        t_comp, comp_err, comp_note = None, None, None
        t_plain = bench(lambda q=q, f=flat, s=sink: plain_attention(q, f, s, sm_scale), args.smoke)
        if compiled is not None:
            try:
                comp_out = compiled(q, flat, sink, sm_scale)
                comp_err = float((comp_out.float() - ref.float()).abs().max())
                t_comp = bench(lambda q=q, f=flat, s=sink: compiled(q, f, s, sm_scale), args.smoke)
            except Exception as e:  # a missing compiler on a CPU box must not stop the smoke run
                comp_note = f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}"
        row = {
            "name": f"sparse_attention/{name}",
            **common,
            "shape": {
                "B": B,
                "T": B,
                "H": H,
                "D": FMT.head_dim,
                "window": window,
                "pool_ctx": ctx,
                "topk": topk,
                "N": N,
            },
            "time_s": t_triton,
            "timer": timer,
            "eager_time_s": t_triton_eager,
            "path": selected_path(q, caches),
            "fused_time_s": t_path["fused"],
            "gathered_time_s": t_path["gathered"],
            "gathered_gluon_dense_time_s": t_path.get("gathered_gluon_dense"),
            "gluon_fused_time_s": t_path.get("gluon_fused"),
            "flops": flops,
            "bytes": nbytes,
            "roofline_s": roofline,
            "pct_roofline": 100.0 * roofline / t_triton,
            "tflops": flops / t_triton / 1e12,
            "gbps": nbytes / t_triton / 1e9,
            "baseline": "sparse_attention_reference (eager) | torch.compile(plain_attention)",
            "baseline_time_s": t_eager,
            "baseline_eager_time_s": t_eager,
            "baseline_compiled_time_s": t_comp,
            "baseline_plain_eager_time_s": t_plain,
            "speedup_vs_eager": t_eager / t_triton,
            "speedup_vs_compiled": (t_comp / t_triton) if t_comp else None,
            "correct": ok,
            "max_abs_err": err,
            "compiled_max_abs_err": comp_err,
            "note": comp_note,
            "config": "default",
        }
        rows.append(row)
        if out_file:
            out_file.write(json.dumps(row) + "\n")
            out_file.flush()
        print(json.dumps(row), flush=True)
        if args.sweep:
            for cfg in SWEEP + [{"num_splits": n} for n in SPLIT_SWEEP]:
                try:
                    o, _ = sparse_attention_triton(q, caches, sink, sm_scale, **cfg)
                    cok, cerr = check(o, ref)
                    t = bench(
                        lambda q=q, c=caches, s=sink, k=cfg: sparse_attention_triton(q, c, s, sm_scale, **k), True
                    )
                except Exception as e:  # e.g. out of shared memory for a large block
                    print(f"# {name} {cfg}: {type(e).__name__}", flush=True)
                    continue
                srow = {
                    **row,
                    "config": cfg,
                    "time_s": t,
                    "pct_roofline": 100.0 * roofline / t,
                    "correct": cok,
                    "max_abs_err": cerr,
                    "name": f"sparse_attention_sweep/{name}",
                }
                if out_file:
                    out_file.write(json.dumps(srow) + "\n")
                print(f"# sweep {name} {cfg} {t * 1e6:.1f} us ok={cok}", flush=True)
        del q, caches, flat, ref, out
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if out_file:
        out_file.close()

    print(
        f"\n{'shape':<24}{'path':>12}{'triton us':>11}{'fused us':>10}{'gather us':>10}{'g+gluon':>9}{'gl.fused':>9}"
        f"{'eager us':>11}"
        f"{'compile us':>12}{'roofline us':>13}{'%roof':>7}{'TFLOP/s':>9}{'GB/s':>8}  ok"
    )
    for r in rows:
        comp = f"{r['baseline_compiled_time_s'] * 1e6:12.1f}" if r["baseline_compiled_time_s"] else f"{'-':>12}"
        print(
            f"{r['name'].split('/', 1)[1]:<24}{r['path']:>12}{r['time_s'] * 1e6:11.1f}{r['fused_time_s'] * 1e6:10.1f}"
            f"{r['gathered_time_s'] * 1e6:10.1f}{_us(r['gathered_gluon_dense_time_s']):>9}"
            f"{_us(r['gluon_fused_time_s']):>9}"
            f"{r['baseline_eager_time_s'] * 1e6:11.1f}"
            f"{comp}{r['roofline_s'] * 1e6:13.2f}{r['pct_roofline']:7.1f}{r['tflops']:9.1f}{r['gbps']:8.0f}"
            f"  {r['correct']}"
        )
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
