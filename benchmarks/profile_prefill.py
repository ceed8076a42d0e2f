"""Per-kernel device time of one layer's prefill step, through ``AttentionSubBlock`` (where a layer's prefill time
goes, PyTorch glue included: ``bench_write`` times the cache-write ops alone, on inputs prepared outside its timer).

    python benchmarks/profile_prefill.py                                  # H200: V4-Flash CSA, 8,192 tokens from 0
    python benchmarks/profile_prefill.py --kind hca --tokens 65536 --start 4096
    python benchmarks/profile_prefill.py --smoke                          # tiny shapes on the CPU: kernel list only

One layer of ``--kind`` at the preset's widths (random weights, ``dsv4.engine.bench.bench_config``), a
``KVCacheManager`` with one request, and one step of ``--tokens`` tokens at positions [start, start + tokens): for
``--start`` > 0 the request first runs a prefill of ``start`` tokens through the layer (untimed), so the timed step
reads a real window and compressor state.  Each profiled call plans the step, runs the layer and cancels the plan
(``KVCacheManager.cancel``), so every call writes the same cache rows from the same state.  Per kernel: average device
time per call and launches per call (torch.profiler, CUDA activity); then the total, its wall time per call
(CUDA events, eager, plan included), and the share of the kernels dsv4 launches (``_``-prefixed Triton / Gluon names)
against the rest (cuBLAS GEMMs, PyTorch elementwise and copies).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from profile_decode import kernel_times  # noqa: E402

from dsv4.cache.manager import KVCacheManager  # noqa: E402
from dsv4.cache.schema import CacheSchema  # noqa: E402
from dsv4.engine import bench as eb  # noqa: E402
from dsv4.model.attention import AttentionSubBlock  # noqa: E402
from dsv4.model.weights import random_attention_weights  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v4-flash")
    ap.add_argument("--kind", default="csa", choices=sorted(eb.KIND_RATIO))
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the timed step")
    ap.add_argument("--start", type=int, default=0, help="cached tokens before the step (prefilled first, untimed)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30, help="kernels listed")
    ap.add_argument("--smoke", action="store_true", help="tiny config on the CPU (torch backend)")
    ap.add_argument("--bands", type=int, default=None, help="HCA prefill row bands on / off (model.attention)")
    ap.add_argument(
        "--shared-keys", type=int, default=None, help="CSA indexer scores over keys folded once a request on / off"
    )
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.bands is not None:
        from dsv4.model import attention as attention_mod

        attention_mod.PREFILL_BANDS = bool(args.bands)
    if args.shared_keys is not None:
        from dsv4.kernels.indexer import select as select_mod

        select_mod.PREFILL_SHARED_KEYS = bool(args.shared_keys)
    model, tokens, start = ("tiny", 160, 64) if args.smoke else (args.model, args.tokens, args.start)
    backend = "auto" if cuda else "torch"
    total_tokens = start + tokens
    cfg = eb.bench_config(model, args.kind, total_tokens)
    gen = torch.Generator(device=device).manual_seed(0)
    blk = AttentionSubBlock(cfg, 0, random_attention_weights(cfg, 0, seed=0, device=device), backend=backend)
    schema = CacheSchema(cfg)
    pages = {m_: rc.pages_for_tokens(total_tokens) + 2 for m_, rc in schema.ratio_classes.items()}
    m = KVCacheManager(cfg, max_requests=2, num_pages=pages or 1, device=device)
    m.add("r")
    if start:
        plan = m.plan({"r": start})
        x0 = torch.randn(start, cfg.dim, generator=gen, device=device).to(torch.bfloat16)
        blk(x0, m.acquire(0, plan))
        m.commit(plan)
    x = torch.randn(tokens, cfg.dim, generator=gen, device=device).to(torch.bfloat16)

    def step():
        plan = m.plan({"r": tokens})
        out = blk(x, m.acquire(0, plan))
        m.cancel(plan)
        return out

    ks = kernel_times(step, args.reps, cuda)
    total = sum(t for t, _ in ks.values())
    launches = sum(n for _, n in ks.values())
    ours = sum(t for k, (t, _) in ks.items() if k.startswith("_"))
    dev_name = torch.cuda.get_device_name() if cuda else "cpu (host times of top-level ops)"
    print(
        f"device: {dev_name}; {model} {args.kind}: {tokens} tokens at positions {start}..{start + tokens - 1}"
        + ("" if args.bands is None else f"; HCA row bands {args.bands}")
        + ("" if args.shared_keys is None else f"; shared keys {args.shared_keys}")
    )
    for k, (t, n) in sorted(ks.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"   {t * 1e6:9.1f} us  x{n:<4.0f} {k[:110]}")
    print(f"== {total * 1e6:.1f} us device time in {launches:.0f} launches a call; dsv4's kernels {ours * 1e6:.1f} us")
    if cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        step()
        torch.cuda.synchronize()
        begin.record()
        for _ in range(args.reps):
            step()
        end.record()
        torch.cuda.synchronize()
        print(f"== wall {begin.elapsed_time(end) * 1e3 / args.reps:.1f} us a call (eager, the host's plan included)")


if __name__ == "__main__":
    main()
