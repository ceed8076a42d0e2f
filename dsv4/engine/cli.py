"""``dsv4 demo``: the engine runner on the ``tiny`` model with seeded random weights; ``dsv4 bench``: the
decode-step benchmark of ``dsv4.engine.bench``.

Requests of different lengths arrive over time, prefill in chunks, decode and finish; the page pool
is small enough that requests get preempted and recomputed.  Progress lines while it runs, then memory
by region and by layer kind, tokens/s, and the dense check of every finished request.  Exit code 0
only if every request verified.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import TextIO

import torch

from dsv4.config import get_preset
from dsv4.engine.runner import EngineRunner, RunResult, StepInfo, make_workload, memory_by_layer_kind

# Defaults: ~3k tokens through the 5-layer tiny stack; the pool (8 pages of 128 tokens per ratio
# class for 4 slots) is too small for 4 long requests at once, so preemptions happen.
DEMO_DEFAULTS = dict(
    requests=12,
    max_requests=4,
    pages=8,
    block_tokens=128,
    prefill_chunk=64,
    token_budget=128,
    min_prompt=16,
    max_prompt=400,
    min_new=4,
    max_new=24,
    arrival_every=3,
)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:,.2f} GiB"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of ints, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one value")
    return out


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(v for v in text.replace(",", " ").split() if v)


def add_bench_subcommand(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` (the decode-step benchmark, ``dsv4.engine.bench``) to the subparsers."""
    from dsv4.engine.bench import BenchSettings

    d = BenchSettings()
    p = sub.add_parser(
        "bench",
        help="decode step of one layer of each kind: dsv4 (eager, CUDA graph) vs plain PyTorch vs roofline",
    )
    p.add_argument("--models", type=_str_list, default=d.models, help="presets (default v4-flash,v4-pro)")
    p.add_argument(
        "--contexts", type=_int_list, default=d.contexts, help="tokens, multiples of 128 (default 4096,131072,1048576)"
    )
    p.add_argument("--batches", type=_int_list, default=d.batches, help="requests a step (default 1,8,64)")
    p.add_argument("--kinds", type=_str_list, default=d.kinds, help="layer kinds (default swa,csa,hca)")
    p.add_argument("--no-graph", action="store_true", help="eager timings only (no CUDA graphs)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the plain PyTorch step")
    p.add_argument("--out", default=None, help="write JSON lines here (and the table to the same name .txt)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when present")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="dsv4 kernel backend")
    p.add_argument("--seed", type=int, default=0, help="weights, inputs and cache content seed")
    p.add_argument(
        "--table-context",
        type=int,
        default=None,
        help="size the block tables for this many tokens (an engine's static max length; default: the context)",
    )
    p.add_argument(
        "--fp8-weights",
        action="store_true",
        help="keep the layer's linear weights FP8 as a checkpoint stores them (kernels.fp8_linear); plain: bf16",
    )
    p.add_argument(
        "--stack-projections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the projections of one input as one GEMM launch (AttentionSubBlock(stack_projections=); default: the "
        "layer's, attention.STACK_PROJECTIONS)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model, contexts 256/512, batches 1/3, CPU, torch backend")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from dsv4.engine.bench import SMOKE, BenchSettings, format_table, run_bench, write_jsonl

    if args.smoke:
        s = dataclasses.replace(SMOKE, fp8_weights=args.fp8_weights, stack_projections=args.stack_projections)
    else:
        s = BenchSettings(
            models=args.models,
            contexts=args.contexts,
            batches=args.batches,
            kinds=args.kinds,
            graph=not args.no_graph,
            compile=args.compile,
            device=args.device,
            backend=args.backend,
            seed=args.seed,
            table_context=args.table_context,
            fp8_weights=args.fp8_weights,
            stack_projections=args.stack_projections,
        )
    print(f"dsv4 bench: models {','.join(s.models)} kinds {','.join(s.kinds)} contexts {s.contexts} "
          f"batches {s.batches} graph {s.graph}" + (" fp8-weights" if s.fp8_weights else "")
          + (" stacked" if s.stacked else " unstacked"), flush=True)  # fmt: skip
    rows = run_bench(s, log=lambda line: print(line, flush=True))
    table = format_table(rows)
    print(table)
    if args.out:
        write_jsonl(rows, args.out)
        with open(args.out.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write(table + "\n")
        print(f"wrote {len(rows)} rows to {args.out}")
    return 0 if all(r.get("match", True) and r.get("graph_equal") is not False for r in rows) else 1


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` and ``bench`` to the ``dsv4`` command's subparsers."""
    add_bench_subcommand(sub)
    d = DEMO_DEFAULTS
    p = sub.add_parser("demo", help="continuous batching over the tiny model, checked against the dense reference")
    p.add_argument("--requests", type=int, default=d["requests"], help=f"requests (default {d['requests']})")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and workload seed (default 0)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when present")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"], help="kernel backend")
    p.add_argument("--json", action="store_true", help="print one JSON summary object (no progress lines)")
    p.add_argument("--max-requests", type=int, default=d["max_requests"], help="state slots (default 4)")
    p.add_argument("--pages", type=int, default=d["pages"], help="pages per ratio class (default 8)")
    p.add_argument("--block-tokens", type=int, default=d["block_tokens"], help="tokens per page (default 128)")
    p.add_argument("--prefill-chunk", type=int, default=d["prefill_chunk"], help="tokens (default 64)")
    p.add_argument("--token-budget", type=int, default=d["token_budget"], help="tokens per step (default 128)")
    p.add_argument("--min-prompt", type=int, default=d["min_prompt"], help="shortest prompt (default 16)")
    p.add_argument("--max-prompt", type=int, default=d["max_prompt"], help="longest prompt (default 400)")
    p.add_argument("--min-new", type=int, default=d["min_new"], help="fewest generated tokens (default 4)")
    p.add_argument("--max-new", type=int, default=d["max_new"], help="most generated tokens (default 24)")
    p.add_argument("--arrival-every", type=int, default=d["arrival_every"], help="mean steps between arrivals")
    p.add_argument("--progress-every", type=int, default=5, help="a progress line every N steps (default 5)")
    p.add_argument("--swap", action="store_true", help="preempted requests keep their cache on the host (no recompute)")
    p.add_argument("--samples", type=int, default=1, help="continuations of each prompt, forked from its cache")
    p.add_argument("--fp8-weights", action="store_true", help="linear weights kept FP8 (kernels.fp8_linear)")
    p.set_defaults(func=cmd_demo)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def _progress_printer(out: TextIO, every: int):
    t0 = time.perf_counter()

    def on_step(info: StepInfo, eng: EngineRunner) -> None:
        for rid in info.preempted:
            print(f"  step {info.step:4d}: pages short -> preempted request {rid!r}", file=out)
        if info.step % every and not info.preempted and not eng.done:
            return
        pages = " ".join(f"r{m}:{info.pages_used[m]}/{info.pages_total[m]}" for m in sorted(info.pages_used))
        r = eng.result
        print(
            f"step {info.step:4d} | running {info.running} waiting {info.waiting} finished {info.finished_total}"
            f" | pages {pages} | {r.tokens} tokens, {r.tokens_per_s:,.0f} tok/s | {time.perf_counter() - t0:.1f}s",
            file=out,
            flush=True,
        )

    return on_step


def format_summary(eng: EngineRunner, setup: dict) -> str:
    """The human-readable summary of a finished (and verified) run."""
    r: RunResult = eng.result
    st = eng.manager.stats()
    kinds = memory_by_layer_kind(eng.manager, st)
    tol = r.tolerance
    lines = [
        "",
        f"dsv4 demo: model {setup['model']} ({setup['layers']}), device {setup['device']}, backend {setup['backend']}",
        f"  {setup['requests']} requests, {setup['max_requests']} slots, {setup['pages']} pages/ratio class of "
        f"{setup['block_tokens']} tokens, prefill chunk {setup['prefill_chunk']}, token budget {setup['token_budget']}",
        "",
        f"steps {r.steps} (idle {r.idle_steps}); tokens: prefill {r.prefill_tokens}, decode {r.decode_tokens}, "
        f"recomputed {r.recomputed_tokens}; preemptions {r.preemptions}"
        + (f" (swapped to the host: {_fmt_bytes(r.swapped_bytes)})" if setup.get("swap") else "")
        + (f"; prompt tokens forked to samples {r.forked_tokens}" if setup.get("samples", 1) > 1 else ""),
        f"engine time {r.wall_s:.1f}s -> {r.tokens_per_s:,.1f} tokens/s; dense check {r.verify_s:.1f}s",
        "",
        "cache memory by region (allocated):",
        *(f"  {k:22s} {_fmt_bytes(v):>14s}" for k, v in st.bytes_by_region.items()),
        f"  {'total':22s} {_fmt_bytes(st.bytes_total):>14s}",
        "pages by ratio class (peak used / total):",
        *(f"  ratio {m:<16d} {r.peak_pages_used.get(m, 0):>6d} / {p.pages_total}" for m, p in st.pools.items()),
        "cache memory by layer kind (allocated, peak in use):",
        *(
            f"  {k:4s} x{v['layers']:<3d} {_fmt_bytes(v['bytes_allocated']):>14s} "
            f"{_fmt_bytes(r.peak_bytes_used_by_kind.get(k, 0)):>14s}"
            for k, v in kinds.items()
        ),
        "",
        f"dense check (pass: per layer max|Δ| <= {tol.layer_max_abs}, mean <= {tol.layer_mean_abs}; "
        f"stack max|Δ| <= {tol.max_abs}, mean <= {tol.mean_abs}):",
        f"  {'id':>4s} {'prompt':>6s} {'new':>4s} {'tokens':>6s} {'preempt':>7s} {'recomp':>6s} "
        f"{'layer max':>9s} {'layer mean':>10s} {'stack max':>9s} {'stack mean':>10s}  result",
    ]
    for q in r.requests:
        lines.append(
            f"  {q.id!s:>4s} {q.prompt_len:6d} {q.max_new_tokens:4d} {q.tokens:6d} {q.preemptions:7d} "
            f"{q.recomputed_tokens:6d} {q.layer_max_abs:9.4f} {q.layer_mean_abs:10.2e} {q.max_abs:9.4f} "
            f"{q.mean_abs:10.2e}  {'ok' if q.passed else 'FAIL'}"
        )
    n_ok = sum(q.passed for q in r.requests)
    lines.append(f"verified {n_ok}/{len(r.requests)} requests: {'PASS' if r.all_passed else 'FAIL'}")
    return "\n".join(lines)


def run_demo(args: argparse.Namespace, out: TextIO | None = None) -> tuple[EngineRunner, dict]:
    """Build the workload and the runner from ``args``, run and verify; returns (runner, setup).
    Progress goes to ``out`` (default: stdout)."""
    out = sys.stdout if out is None else out
    for name in ("requests", "max_requests", "pages", "progress_every", "min_prompt", "min_new"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.max_prompt < args.min_prompt or args.max_new < args.min_new:
        raise ValueError("--max-prompt/--max-new: expected >= --min-prompt/--min-new")
    cfg = get_preset("tiny")
    device = _resolve_device(args.device)
    workload = make_workload(
        args.requests,
        seed=args.seed,
        prompt_len=(args.min_prompt, args.max_prompt),
        new_tokens=(args.min_new, args.max_new),
        arrival_every=args.arrival_every,
    )
    if args.samples < 1:
        raise ValueError(f"--samples: expected >= 1, got {args.samples}")
    workload = [dataclasses.replace(r, samples=args.samples) for r in workload]
    eng = EngineRunner(
        cfg,
        max_requests=args.max_requests,
        num_pages=args.pages,
        block_tokens=args.block_tokens,
        prefill_chunk=args.prefill_chunk,
        token_budget=args.token_budget,
        device=device,
        backend=args.backend,
        seed=args.seed,
        swap=args.swap,
        fp8_weights=args.fp8_weights,
    )
    setup = dict(
        model=cfg.name,
        layers=" ".join(f"{i}:{cfg.layer_kind(i).value}{'(mtp)' if cfg.is_mtp(i) else ''}" for i in eng.layers),
        device=str(device),
        backend=args.backend,
        requests=args.requests,
        max_requests=args.max_requests,
        pages=args.pages,
        block_tokens=args.block_tokens,
        prefill_chunk=args.prefill_chunk,
        token_budget=args.token_budget,
        seed=args.seed,
        swap=args.swap,
        samples=args.samples,
        fp8_weights=args.fp8_weights,
    )
    on_step = None if args.json else _progress_printer(out, args.progress_every)
    if not args.json:
        print(f"dsv4 demo: {args.requests} requests over {setup['layers']} on {device}", file=out, flush=True)
    try:
        eng.run(workload, on_step=on_step)
    except RuntimeError as e:  # the pool cannot hold one request: a sizing error of the arguments
        raise ValueError(f"{e} (--pages, --block-tokens, --max-prompt)") from None
    if not args.json:
        print(f"verifying {eng.num_finished} requests against the dense reference ...", file=out, flush=True)
    eng.verify()
    return eng, setup


def cmd_demo(args: argparse.Namespace) -> int:
    eng, setup = run_demo(args)
    r = eng.result
    if args.json:
        st = eng.manager.stats()
        summary = dict(
            setup=setup,
            result=r.to_dict(),
            memory_bytes_by_region=st.bytes_by_region,
            memory_by_layer_kind=memory_by_layer_kind(eng.manager, st),
            pages_total={str(m): p.pages_total for m, p in st.pools.items()},
        )
        print(json.dumps(summary))
    else:
        print(format_summary(eng, setup))
    return 0 if r.all_passed else 1
