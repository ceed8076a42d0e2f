"""Kernel times of one layer's projections in a decode step (``input_projections`` + ``output_projection``, as the
layer runs them), by the torch profiler: where the projections part of ``dsv4 bench`` goes.

    python benchmarks/profile_projections.py [--model v4-flash] [--layer 2] [--batch 64] [--fp8] [--stack]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv4.config import get_preset  # noqa: E402
from dsv4.model.attention import AttentionSubBlock  # noqa: E402
from dsv4.model.projections import output_projection  # noqa: E402
from dsv4.model.weights import random_attention_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v4-flash")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--stack", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    cfg, dev = get_preset(a.model), torch.device("cuda")
    w = random_attention_weights(cfg, a.layer, seed=0, device=dev, fp8=a.fp8)
    blk = AttentionSubBlock(cfg, a.layer, w, backend="triton", stack_projections=a.stack)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(a.batch, cfg.dim, device=dev, generator=g).bfloat16()
    pos = torch.randint(0, 1 << 17, (a.batch,), device=dev, generator=g)
    o0 = torch.randn(a.batch, cfg.n_heads, cfg.head_dim, device=dev, generator=g).bfloat16()
    cnt = blk._linear_counters  # noqa: SLF001

    def step():
        ip = blk.input_projections(x, pos)
        o = o0.clone()
        return output_projection(cfg, blk.w, o, pos[:, None], blk.inv_freq, "triton", consume_o=True, counters=cnt,
                                 cos_sin=ip.cos_sin)  # fmt: skip

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(a.iters):
            step()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:70]] += e.device_time_total / a.iters
    tag = f"{a.model} layer {a.layer} B {a.batch} {'fp8' if a.fp8 else 'bf16'}{' stacked' if a.stack else ''}"
    print(f"{tag}: {sum(per.values()):.1f} us of kernels a step (o's clone included)")
    for name, t in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"  {t:8.2f} us  {name}")
    # one step's kernels in launch order (which call is which: input projections first, then wo_a, wo_b)
    evs = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    n = len(evs) // a.iters
    print("  one step in order: " + ", ".join(f"{e.name[:18]} {e.device_time_total:.1f}" for e in evs[-n:]))


if __name__ == "__main__":
    main()
