"""Per-kernel device time of each part of one layer's decode step (where ``dsv4 bench``'s part times go).

    python benchmarks/profile_decode.py                                  # H200: V4-Flash CSA, 128K, B = 64
    python benchmarks/profile_decode.py --kind hca --context 1048576 --batch 8
    python benchmarks/profile_decode.py --smoke                          # tiny shapes on the CPU: kernel list only

Builds the same layer, cache fill and static decode plan as ``dsv4 bench`` (``dsv4.engine.bench``), takes the
same part closures (window_store, compressor, indexer, topk, attention, projections), calls each ``--reps``
times under ``torch.profiler`` (CUDA activity) and prints, per part, every kernel's average device time per
call and how many launches of it one call makes.  Device time only: launch gaps are not in these sums (a
CUDA-graph replay of a part takes about the sum plus ~1 us per launch).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv4.cache.manager import KVCacheManager  # noqa: E402
from dsv4.cache.schema import CacheSchema  # noqa: E402
from dsv4.engine import bench as eb  # noqa: E402
from dsv4.engine.graphs import DecodeGraphRunner  # noqa: E402
from dsv4.model.attention import AttentionSubBlock  # noqa: E402
from dsv4.model.weights import random_attention_weights  # noqa: E402


def kernel_times(fn, reps: int, cuda: bool) -> dict[str, tuple[float, float]]:
    """{kernel name: (device seconds per call, launches per call)} of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    acc: dict[str, list[float]] = {}
    for ev in prof.events():
        if cuda and ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if not cuda and ev.cpu_parent is not None:
            continue
        a = acc.setdefault(ev.name, [0.0, 0.0])
        a[0] += (ev.device_time if cuda else ev.cpu_time) * 1e-6
        a[1] += 1
    return {k: (v[0] / reps, v[1] / reps) for k, v in acc.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v4-flash")
    ap.add_argument("--kind", default="csa", choices=sorted(eb.KIND_RATIO))
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", default=",".join(eb.PARTS), help="comma-separated subset")
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU (torch backend)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    model, context, bsz = ("tiny", 512, 2) if args.smoke else (args.model, args.context, args.batch)
    backend = "auto" if cuda else "torch"
    cfg = eb.bench_config(model, args.kind, context)
    gen = torch.Generator(device=device).manual_seed(0)
    w = random_attention_weights(cfg, 0, seed=0, device=device)
    blk = AttentionSubBlock(cfg, 0, w, backend=backend)
    schema = CacheSchema(cfg)
    per_req = {m_: rc.pages_for_tokens(context) for m_, rc in schema.ratio_classes.items()}
    pages = {m_: (n + 1) * bsz + 4 for m_, n in per_req.items()}
    m = KVCacheManager(cfg, max_requests=bsz + 2, num_pages=pages or 1, device=device)
    eb.fill_cache(m, bsz, context, gen, backend)
    runner = DecodeGraphRunner(m, [blk], buckets=(bsz,), max_blocks=per_req or None, capture=False,
                               forward=eb._single_layer)  # fmt: skip
    runner.capture()
    plan, _ = runner.prepare({r: 1 for r in range(bsz)})
    m.cancel(plan)
    x = runner.static_input(bsz)
    x.copy_(torch.randn(bsz, cfg.dim, generator=gen, device=device).to(torch.bfloat16))
    handle = runner._buckets[bsz].handles[0]  # noqa: SLF001 - the static plan's handle
    parts = eb._parts(blk, handle, x)
    dev_name = torch.cuda.get_device_name() if cuda else "cpu (host times of top-level ops)"
    print(f"device: {dev_name}; {model} {args.kind} context {context} B {bsz}; per call, {args.reps} reps")
    grand = 0.0
    for name in args.parts.split(","):
        if name not in parts:
            continue
        ks = kernel_times(parts[name], args.reps, cuda)
        total = sum(t for t, _ in ks.values())
        launches = sum(n for _, n in ks.values())
        grand += total
        print(f"== {name}: {total * 1e6:.1f} us in {launches:.0f} launches")
        for k, (t, n) in sorted(ks.items(), key=lambda kv: -kv[1][0]):
            print(f"   {t * 1e6:8.1f} us  x{n:<4.0f} {k[:110]}")
    print(f"== all parts: {grand * 1e6:.1f} us")


if __name__ == "__main__":
    main()
