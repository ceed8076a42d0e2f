"""What host waits cost a step: a small V4-Flash stack prefilled and decoded through the manager, with the plan's
fields and the window-workspace index sent as today (one pinned non-blocking copy a plan, the index built once a
step: ``async``) and as before session 19 (a pageable copy a field, each waiting for the queued kernels, and the
index rebuilt and copied by every layer: ``synced``), in the same run on the same data.

    python benchmarks/bench_step_sync.py --out benchmarks/results/F.jsonl       # H200
    python benchmarks/bench_step_sync.py --smoke                                # tiny config on the CPU

Stack: ``--layers`` attention layers of V4-Flash (CSA and HCA alternating, random weights), one request per
``--batch`` row.  Timed (CUDA events around the whole loop, one synchronise at its end): ``--chunks`` prefill steps of
``--chunk`` tokens a request, then ``--decode`` decode steps (eager: an engine's graphs replay decode steps, but
plans are built eagerly either way).  The outputs of both modes are checked equal first.  ``time_s`` is the loop's
wall time; ``device_time_s`` the device time of the same loop (its kernels and copies, torch.profiler, GPU only): the
floor both modes approach.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_decode import kernel_times  # noqa: E402

from dsv4.cache import manager as manager_mod  # noqa: E402
from dsv4.cache.manager import KVCacheManager  # noqa: E402
from dsv4.cache.plan import StepPlan, int32_to_device  # noqa: E402
from dsv4.config import LayerKind, get_preset  # noqa: E402
from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.model import attention as attention_mod  # noqa: E402
from dsv4.model.attention import AttentionSubBlock  # noqa: E402
from dsv4.model.weights import random_attention_weights  # noqa: E402


@contextlib.contextmanager
def synced_transfers():
    """The pre-session-19 transfers: one pageable (stream-synchronising) copy per field, no per-plan memo."""
    saved = manager_mod.int32_to_device, attention_mod.int32_to_device, StepPlan.memo
    manager_mod.int32_to_device = attention_mod.int32_to_device = lambda a, d: int32_to_device(a, d, packed=False)
    StepPlan.memo = lambda self, key, make: make()
    try:
        yield
    finally:
        manager_mod.int32_to_device, attention_mod.int32_to_device, StepPlan.memo = saved


def make_stack(cfg, n_layers: int, device):
    csa = [i for i in range(cfg.n_layers) if cfg.layer_kind(i) is LayerKind.CSA]
    hca = [i for i in range(cfg.n_layers) if cfg.layer_kind(i) is LayerKind.HCA]
    ids = [(csa if j % 2 == 0 else hca)[j // 2] for j in range(n_layers)]
    return [AttentionSubBlock(cfg, i, random_attention_weights(cfg, i, seed=i, device=device)) for i in ids]


def run(cfg, stack, xs, args, device):
    """The timed loop on a fresh manager; returns (outputs of the last step, wall seconds)."""
    m = KVCacheManager(cfg, max_requests=args.batch, num_pages=args.pages, device=device)
    for b in range(args.batch):
        m.add(b)
    sched = [args.chunk] * args.chunks + [1] * args.decode
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    off = 0
    for n in sched:
        plan = m.plan({b: n for b in range(args.batch)})
        h = xs[off : off + plan.num_tokens]
        for blk in stack:
            h = blk(h, m.acquire(blk.layer_id, plan))
        m.commit(plan)
        off = (off + plan.num_tokens) % (len(xs) - args.batch * args.chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return h, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    cfg = get_preset("tiny" if args.smoke else "v4-flash")
    if args.smoke:
        args.layers, args.chunk, args.chunks, args.decode, args.pages, args.reps = 2, 40, 2, 3, 8, 1
    stack = make_stack(cfg, args.layers, device)
    gen = torch.Generator(device=device).manual_seed(0)
    xs = torch.randn(args.batch * args.chunk * 2, cfg.dim, generator=gen, device=device).to(torch.bfloat16)

    a_out, _ = run(cfg, stack, xs, args, device)  # warm-up (kernel builds) and the reference outputs
    with synced_transfers():
        s_out, _ = run(cfg, stack, xs, args, device)
    diff = (a_out.float() - s_out.float()).abs().max().item()
    if diff > 0.05:  # (bit-equal unless a kernel's summation order varies between runs)
        raise SystemExit(f"synced and async transfers gave different outputs: max |d| {diff}")
    times = {"async": [], "synced": []}
    for _ in range(args.reps):
        times["async"].append(run(cfg, stack, xs, args, device)[1])
        with synced_transfers():
            times["synced"].append(run(cfg, stack, xs, args, device)[1])
    info = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    shape = {k: getattr(args, k) for k in ("layers", "batch", "chunk", "chunks", "decode")}
    floor = None
    if cuda:  # the loop's device time (kernels and copies, torch.profiler): what no host wait can go below
        floor = sum(t for t, _ in kernel_times(lambda: run(cfg, stack, xs, args, device), 1, True).values())
        print(f"device  {floor * 1e3:9.2f} ms  (the loop's kernels and copies, torch.profiler)")
    t_sync = sorted(times["synced"])[len(times["synced"]) // 2]
    rows = []
    print(f"outputs of the two modes: max |d| {diff}")
    for mode in ("async", "synced"):
        t = sorted(times[mode])[len(times[mode]) // 2]
        rows.append({"name": f"step_loop_{mode}", **info, "shape": shape, "time_s": t, "bytes": None,
                     "roofline_s": None, "baseline": "step_loop_synced", "baseline_time_s": t_sync,
                     "device_time_s": floor})  # fmt: skip
        print(f"{mode:7s} {t * 1e3:9.2f} ms  ({', '.join(f'{x * 1e3:.2f}' for x in times[mode])})")
    if args.out:
        write_jsonl(rows, args.out, append=True)


if __name__ == "__main__":
    main()
