"""Per-kernel device time of one sparse decode attention call (where its time goes), per path / dense kernel.

    python benchmarks/profile_attention.py                                # H200: V4-Pro CSA, B = 64, 128 + 1,024 keys
    python benchmarks/profile_attention.py --model v4-flash --batch 8
    python benchmarks/profile_attention.py --smoke                        # tiny shapes on the CPU (interpreter)

The step is ``bench_attention.make_case`` (window ring of 128 + the top-k of ``--context`` pool entries, or all of
them with ``--hca``).  Each variant is checked against the reference first (``bench_attention.check``), then called
``--reps`` times under ``torch.profiler``: every kernel's average device time per call and launches per call
(launch gaps excluded), and the CUDA-graph time of the call (20 calls per graph, no L2 flush).  Variants: the
gathered path with the Triton dense kernel (the default off sm_90), with the Gluon dense kernel (sm_90 only), the
fused Triton kernel, and the fused Gluon kernel (``gluon_fused``, sm_90 only; the default there).
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

from benchmarks.bench_attention import FMT, check, fused_knobs, make_case  # noqa: E402
from benchmarks.profile_decode import kernel_times  # noqa: E402
from benchmarks.sweep_indexer import GraphTimer  # noqa: E402
from dsv4.config import get_preset  # noqa: E402
from dsv4.kernels.attention import sparse_attention_reference, sparse_attention_triton  # noqa: E402
from dsv4.kernels.attention.sparse_attention import gluon_dense_supported  # noqa: E402

VARIANTS = {
    "gathered+triton": {"path": "gathered", "dense": "triton"},
    "gathered+gluon": {"path": "gathered", "dense": "gluon"},
    "fused": {"path": "fused"},
    "gluon_fused": {"path": "gluon_fused"},
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v4-pro")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096, help="pool entries per request")
    ap.add_argument("--hca", action="store_true", help="attend every pool entry (no top-k)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {sorted(VARIANTS)}")
    ap.add_argument(
        "--fused",
        help="gluon_fused runs with sparse_attention.GLUON_FUSED_* knobs: comma-separated runs, each KEY=VAL[+KEY=VAL] "
        "(e.g. DEQUANT=0,DEQUANT=2,ABLATE=3+DEQUANT=2; an ABLATE run is timed, not checked)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = get_preset(args.model)
    if args.smoke:
        B, H, window, ctx, topk = 2, 8, 32, 64, 16
    else:
        B, H, window, ctx = args.batch, cfg.n_heads, cfg.window_size, args.context
        topk = None if args.hca else cfg.index_topk
    q, caches, sink = make_case(B, H, window, ctx, topk, dev)
    scale = FMT.head_dim**-0.5
    ref, _ = sparse_attention_reference(q, caches, sink, scale)
    keys = sum(idx.shape[1] for _, idx in caches)
    flops = 4 * B * H * keys * FMT.head_dim
    timer = GraphTimer(n=20, flush=False) if cuda else None
    SA = sys.modules["dsv4.kernels.attention.sparse_attention"]
    defaults = {k: getattr(SA, k) for k in dir(SA) if k.startswith("GLUON_FUSED_")}
    runs = []
    for name in args.variants.split(","):
        if name == "gluon_fused" and args.fused:
            for spec in args.fused.split(","):
                runs.append((f"{name}:{spec}", VARIANTS[name], fused_knobs(spec)))
        else:
            runs.append((name, VARIANTS[name], {}))
    for name, kw, knobs in runs:
        for k, v in {**defaults, **knobs}.items():
            setattr(SA, k, v)
        if "gluon" in name and not gluon_dense_supported(q, q.shape[-1]):
            print(f"== {name}: skipped (needs an sm_90 GPU and Gluon)")
            continue
        run = partial(sparse_attention_triton, q, caches, sink, scale, **kw)
        ok, err = check(run()[0], ref)
        if knobs.get("GLUON_FUSED_ABLATE"):  # an ablation computes something else: timed, not checked
            print(f"== {name}: an ablation (GLUON_FUSED_ABLATE), its result is not checked")
        elif not ok:
            raise SystemExit(f"{name}: differs from the reference (max abs err {err:.3e})")
        times = kernel_times(run, 1 if args.smoke else args.reps, cuda)
        total = sum(t for t, _ in times.values())
        g = timer(run) if timer else None
        rate = f", {flops / g / 1e12:.0f} TFLOP/s" if g else ""
        gtxt = f"graph {g * 1e6:.1f} us{rate}, " if g else ""
        print(f"== {args.model} B {B} keys {keys} {name}: {gtxt}device {total * 1e6:.1f} us")
        for kname, (t, c) in sorted(times.items(), key=lambda x: -x[1][0]):
            print(f"   {t * 1e6:8.1f} us  x{c:g}  {kname[:90]}")


if __name__ == "__main__":
    main()
