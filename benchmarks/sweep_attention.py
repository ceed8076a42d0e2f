"""Variant x block-config sweep of the sparse FP8 decode attention kernel (H200, < 2 minutes).

    python benchmarks/sweep_attention.py --out benchmarks/results/sweep_attention.jsonl   # H200
    python benchmarks/sweep_attention.py --smoke                                        # CPU, interpreter

Shapes: V4-Flash CSA B=64 (64 heads, 128 window + 512 top-k), V4-Pro CSA B=64 (128 heads, 128 + 1024),
V4-Pro HCA B=8 (128 heads, 128 window + 8192 compressed entries), V4-Flash CSA B=1, V4-Pro CSA B=8; data from
``bench_attention.make_case``.

Variants (``sparse_attention_triton`` keyword arguments):
  gathered      two launches: entries dequantised into a bf16 workspace, then a pipelined dense flash-decoding
                kernel (``path="gathered"``; the default for decode-sized steps); configs from GATHERED_CONFIGS
  base          fused: one [BLOCK_N, 512] dequantised tile feeds both dots, q [BLOCK_H, 512] held (``path="fused"``)
  qk2 / qk1     QK^T in D-chunks of 128 / 64 dims, q chunks re-loaded from global (``qk_tiles=2 / 1``)
  ds2 / ds4     output dims split over 2 / 4 programs (``d_split``): full QK^T each, P.V for 256 / 128 dims
  ds2_qk2       both
Block configs: (block_h, block_n, num_warps, num_stages) from CONFIGS (block_h > heads skipped), each with the
automatic key split; the base variant also with ``num_splits=1``.

Timing: the call is captured 10 times into a CUDA graph and the graph replayed (median over replays / 10),
i.e. GPU time without the Python launch path; if capture fails, ``triton.testing.do_bench`` (median, launch
overhead included: see the ``timer`` field).  Every (variant, config, shape) output is checked against the
PyTorch reference (bench_attention's tolerance) before timing; a wrong variant is reported and skipped for that
shape.  Order: variant, config, shape (each binary compiles once).  ``--budget`` seconds (default 110) bounds
the sweep: configs not reached are listed as skipped.
Output: a table sorted by time per shape, and JSON lines (name, gpu, torch, triton, shape, config, time_s,
flops, bytes, roofline_s, tflops, date).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_attention import FMT, PEAK_BF16_FLOPS, PEAK_HBM_BYTES, check, make_case, time_call  # noqa: E402

from dsv4.config import get_preset  # noqa: E402
from dsv4.kernels.attention import sparse_attention_reference, sparse_attention_triton  # noqa: E402

VARIANTS = {
    "gathered": {"path": "gathered"},
    "base": {"path": "fused"},
    "qk2": {"qk_tiles": 2},
    "qk1": {"qk_tiles": 1},
    "ds2": {"d_split": 2},
    "ds4": {"d_split": 4},
    "ds2_qk2": {"d_split": 2, "qk_tiles": 2},
}
CONFIGS = [  # (block_h, block_n, num_warps, num_stages)
    (64, 64, 8, 1),
    (64, 64, 16, 1),
    (64, 32, 8, 2),
    (64, 32, 16, 2),
    (128, 64, 16, 1),
    (32, 64, 8, 1),
]
GATHERED_CONFIGS = [  # the dense kernel: num_stages is its software-pipeline depth
    (64, 64, 8, 2),
    (64, 32, 8, 3),
    (64, 32, 8, 2),
    (64, 64, 8, 1),
    (64, 128, 8, 1),
    (64, 64, 8, 3),
]
GATHERED_SPLITS = (1, 2, 3, 4, 6, 8, 12)
SMOKE_CONFIGS = [(16, 16, 4, 1)]


def shapes(smoke: bool):
    flash, pro = get_preset("v4-flash"), get_preset("v4-pro")
    win = flash.window_size
    if smoke:
        return [("smoke/csa/B2", 2, 8, win // 4, 64, 16)]
    return [
        (f"{flash.name}/csa/B64", 64, flash.n_heads, win, 4 * flash.index_topk, flash.index_topk),
        (f"{pro.name}/csa/B64", 64, pro.n_heads, win, 4 * pro.index_topk, pro.index_topk),
        (f"{pro.name}/hca8192/B8", 8, pro.n_heads, win, 8192, None),
        (f"{flash.name}/csa/B1", 1, flash.n_heads, win, 4 * flash.index_topk, flash.index_topk),
        (f"{pro.name}/csa/B8", 8, pro.n_heads, win, 4 * pro.index_topk, pro.index_topk),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="append JSON lines to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, one config (CPU interpreter or GPU)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--budget", type=float, default=110.0, help="stop starting new configs after this many s")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    variants = {k: VARIANTS[k] for k in args.variants.split(",") if k}
    configs = SMOKE_CONFIGS if args.smoke else CONFIGS
    out_file = open(args.out, "a") if args.out else None  # noqa: SIM115
    rows, skipped = [], []
    cases = []
    for shape, B, H, window, ctx, topk in shapes(args.smoke):
        q, caches, sink = make_case(B, H, window, ctx, topk, device)
        scale = FMT.head_dim**-0.5
        ref, _ = sparse_attention_reference(q, caches, sink, scale)
        N = sum(idx.shape[1] for _, idx in caches)
        flops = 2 * B * H * N * (FMT.head_dim + FMT.head_dim)
        nbytes = B * N * FMT.entry_bytes
        roofline = max(flops / PEAK_BF16_FLOPS, nbytes / PEAK_HBM_BYTES)
        cases.append((shape, H, q, caches, sink, scale, ref, flops, nbytes, roofline))
    # variant-major, then config, then shape: a config's binary is compiled once and timed on every shape,
    # and the budget cuts whole (variant, config) pairs, not the last shape.
    wrong = set()
    for vname, vkw in variants.items():
        vconfigs = GATHERED_CONFIGS if vname == "gathered" and not args.smoke else configs
        runs = [(c, None) for c in vconfigs] + ([(vconfigs[0], 1)] if vname == "base" else [])
        if vname == "gathered":  # calibrates GATHERED_FILL: explicit key splits with the first config
            runs += [(vconfigs[0], n) for n in GATHERED_SPLITS]
        for (bh, bn, nw, ns), splits in runs:
            for shape, H, q, caches, sink, scale, ref, flops, nbytes, roofline in cases:
                if (bh > max(16, H) and not args.smoke) or (shape, vname) in wrong:
                    continue
                config = {"block_h": bh, "block_n": bn, "num_warps": nw, "num_stages": ns, **vkw}
                if splits is not None:
                    config["num_splits"] = splits
                if time.perf_counter() - t_start > args.budget:
                    skipped.append((shape, vname, config))
                    continue
                fn = functools.partial(sparse_attention_triton, q, caches, sink, scale, **config)
                try:
                    ok, err = check(fn()[0], ref)  # cheap next to the timing; every config is checked
                    if not ok:
                        print(f"# {shape} {vname} {config}: WRONG (max |delta| {err:.3g}); variant skipped", flush=True)
                        wrong.add((shape, vname))
                        continue
                    t, timer = time_call(fn, args.smoke)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory / registers for a config
                    print(f"# {shape} {vname} {config}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                row = {
                    "name": f"sweep_attention/{vname}",
                    "gpu": gpu,
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "shape": shape,
                    "config": config,
                    "timer": timer,
                    "time_s": t,
                    "flops": flops,
                    "bytes": nbytes,
                    "roofline_s": roofline,
                    "tflops": flops / t / 1e12,
                    "date": date,
                }
                rows.append(row)
                print(f"# {shape} {vname} {config} {t * 1e6:.1f} us ({timer})", flush=True)
                if out_file:
                    out_file.write(json.dumps(row) + "\n")
                    out_file.flush()
    if out_file:
        out_file.close()
    print(f"{'shape':22} {'variant':9} {'config':58} {'us':>9} {'TFLOP/s':>8} {'%roof':>6}")
    for r in sorted(rows, key=lambda r: (r["shape"], r["time_s"])):
        cfg = {k: v for k, v in r["config"].items() if k not in ("qk_tiles", "d_split")}
        cfg_s = " ".join(f"{k}={v}" for k, v in cfg.items())
        print(
            f"{r['shape']:22} {r['name'].split('/')[1]:9} {cfg_s:58} {r['time_s'] * 1e6:9.1f} "
            f"{r['tflops']:8.1f} {100 * r['roofline_s'] / r['time_s']:6.1f}"
        )
    for shape, vname, config in skipped:
        print(f"# skipped (budget): {shape} {vname} {config}")
    print(f"# total {time.perf_counter() - t_start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
