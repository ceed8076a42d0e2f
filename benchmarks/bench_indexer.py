"""Benchmark of the lightning-indexer read path: scores over paged keys, and top-k.

    python benchmarks/bench_indexer.py --out benchmarks/results/indexer.jsonl     # H200
    python benchmarks/bench_indexer.py --smoke                                   # CPU, interpreter, tiny

Scores (decode: one query row per request, B requests, Hi = 64 heads x 128, every entry visible):
contexts 4K / 128K / 1M tokens -> entries = ctx / 4 (up to 262,144), B = 1, 4, 8, pages of 64 entries
scattered through a shared pool.  In one run, on the same data:

- ``indexer_fp4``      the default (``impl="auto"``: on sm_90 the Gluon kernel, in eager calls from 2**21 rows x
                       entries on, else Triton's fp8mma: 68-byte MXFP4 keys re-encoded as e4m3, FP8 MMAs);
- ``indexer_fp4_gluon``  ``impl="gluon"``: the warp-specialised Gluon kernel (sm_90; same math, TMA key loads);
- ``indexer_fp4_fp8mma``  ``impl="fp8mma"``: the Triton kernel alone;
- ``indexer_fp4_gluon_fold``  ``impl="gluon_fold"``: the Gluon kernel's fold variant (not exact: FP8 accumulation);
- ``indexer_fp4_convert``  the Triton kernel with ``impl="convert"`` (e2m1 -> bf16 in registers, bf16 MMAs);
- ``indexer_fp4_dot_scaled``  the same with ``tl.dot_scaled`` doing the e2m1 operand (experiment;
                       skipped with a message if it does not compile or is wrong);
- ``indexer_fp8keys``  Triton, 132-byte FP8 keys (same values: built from the MXFP4 keys, exactly);
- ``torch_fp8keys``    plain PyTorch eager: gather FP8 pages, dequantise to bf16, bmm, ReLU, weighted
                       head sum (the baseline of both kernels); ``torch_compile_fp8keys`` when
                       torch.compile works.

bytes = B x entries x (68 | 132) + q + weights + scores written; roofline_s = bytes / 4.17e12.

Top-k: k = 1024 and 512 over R x 262,144 fp32 scores (R = 1, 4, 8, 64), checked against the reference
(and its set against ``torch.topk``; ours returns ascending indices).  bytes = one read of the scores.
``topk_filter`` = the default (group-max filter) path eager, ``topk_<method>_graph`` = replayed from a CUDA
graph: ``filter``, ``radix`` (4-launch radix split path), ``radix_s1`` (one program per row).  Their
``time_s`` is one replay of a one-call graph (L2 flushed, the replay's launch included: comparable with the
earlier result files); ``in_graph_time_s`` is the time per call inside a graph of 20 calls, each after an L2
flush (``sweep_indexer.GraphTimer``): what a captured decode step pays, with the scores read from HBM;
``in_graph_clean_flush_time_s`` the same with a flush that only reads (no dirty lines left to write back);
``--topk-splits S ...`` adds ``topk_filter_s<S>_graph``; ``topk_filter_graph_sorted_rows`` = sorted rows
(the filter's whole-row fallback), R = 4, k = 1024.
Also the whole step (FP4 scores + top-1024) vs PyTorch eager (scores + torch.topk) at 1M.

Correctness is checked on each shape's data before timing (kernels vs the fp32 references).  Times are
``triton.testing.do_bench`` medians on the GPU (perf_counter means under --smoke).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from functools import partial

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.formats import FP8_DTYPE, MXFP4KeyFormat  # noqa: E402
from dsv4.kernels.dispatch import pdl_launch  # noqa: E402
from dsv4.kernels.indexer import (  # noqa: E402
    fp8_key_pages_from_mxfp4,
    indexer_scores,
    indexer_scores_fp8keys,
    indexer_scores_reference,
    topk_indices,
    topk_indices_reference,
)
from dsv4.kernels.indexer.topk import topk_workspace  # noqa: E402

HBM_BYTES_PER_S = 4.17e12
FP8_MMA_FLOPS_PER_S = 1354e12  # H200, measured (performance.md)
FMT = MXFP4KeyFormat()
FP8_KEY_BYTES = FMT.dim * torch.finfo(FP8_DTYPE).bits // 8 + torch.finfo(torch.float32).bits // 8  # 132


def timer(fn, smoke: bool) -> float:
    if smoke:
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3


def make_problem(B: int, entries: int, H: int, bs: int, dev, gen):
    """B requests of `entries` MXFP4 keys each, pages shuffled in one pool; q, weights for one row each."""
    pages_per_req = triton.cdiv(entries, bs)
    P = B * pages_per_req
    flat = torch.empty(P * FMT.page_bytes(bs), dtype=torch.uint8, device=dev)
    keys = FMT.key_pages(flat, P, bs)
    # random codes (every e2m1 value) and scales around 1: valid MXFP4 keys of unit-ish size
    keys.data.copy_(torch.randint(0, 256, keys.data.shape, device=dev, dtype=torch.uint8, generator=gen))
    keys.scale.copy_(torch.randint(122, 127, keys.scale.shape, device=dev, dtype=torch.uint8, generator=gen))
    perm = torch.randperm(P, device=dev, generator=gen).to(torch.int32)
    block_table = perm.view(B, pages_per_req)
    q = FMT.roundtrip(torch.randn(B, H, FMT.dim, device=dev, generator=gen), dtype=torch.bfloat16)
    w = torch.rand(B, H, device=dev, generator=gen) * (FMT.dim**-0.5 * H**-0.5)
    token_row = torch.arange(B, dtype=torch.int32, device=dev)
    n_visible = torch.full((B,), entries, dtype=torch.int32, device=dev)
    return keys, block_table, q, w, token_row, n_visible


def torch_scores_fp8(q, w, fp8_keys, block_table, n: int):
    """Plain PyTorch: gather each request's FP8 pages, dequantise to bf16, bmm, ReLU, weighted head sum."""
    B = q.shape[0]
    data = fp8_keys.data[block_table.long()]  # [B, pages, bs, 128] uint8
    scale = fp8_keys.scale[block_table.long()]  # [B, pages, bs]
    k = (data.view(FP8_DTYPE).to(torch.bfloat16) * scale.unsqueeze(-1).to(torch.bfloat16)).view(B, -1, FMT.dim)
    logits = torch.bmm(q, k[:, :n].transpose(1, 2))  # [B, H, n]
    return (torch.relu(logits.float()) * w[:, :, None]).sum(1)


def env_info(dev) -> dict:
    return {
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "pdl": pdl_launch(dev)["PDL"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def record(rows, info, name, shape, t, nbytes, baseline=None, baseline_t=None, **extra):
    row = {
        "name": name,
        **info,
        "shape": shape,
        "time_s": t,
        "bytes": nbytes,
        "roofline_s": nbytes / HBM_BYTES_PER_S,
        "baseline": baseline,
        "baseline_time_s": baseline_t,
        **extra,
    }
    rows.append(row)
    return row


def check_close(out, ref, what):
    inf_ok = torch.equal(torch.isneginf(out), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    err = ((out[fin] - ref[fin]).abs() / (ref[fin].abs() + 1e-3)).max().item() if fin.any() else 0.0
    if not inf_ok or err > 1e-4:
        raise SystemExit(f"{what}: mismatch (inf pattern ok={inf_ok}, max rel err {err:.3g})")
    return err


def bench_scores(args, dev, info, rows, gen):
    ctxs = [1024] if args.smoke else [4096, 131072, 1048576]
    batches = [1, 2] if args.smoke else [1, 4, 8]
    compiled = None
    if not args.smoke and not args.no_compile:
        try:
            compiled = torch.compile(torch_scores_fp8, dynamic=False)
        except Exception as e:  # pragma: no cover - depends on the machine
            print(f"torch.compile unavailable: {e}")
    for ctx in ctxs:
        for B in batches:
            with_step = ctx == ctxs[-1] and B == batches[len(batches) // 2]
            compiled = bench_scores_shape(args, dev, info, rows, gen, ctx, B, compiled, with_step)


def bench_scores_shape(args, dev, info, rows, gen, ctx, B, compiled, with_step):
    """One (context, batch) shape: check, then time every variant.  Returns `compiled` (None once it fails)."""
    entries = ctx // 4
    H = args.heads
    keys, bt, q, w, tr, nv = make_problem(B, entries, H, args.page, dev, gen)
    fk = fp8_key_pages_from_mxfp4(keys)
    kw = {"block_n": args.block_n, "tiles_per_program": args.tiles, "num_warps": args.warps, "num_stages": args.stages}
    run_fp4 = partial(indexer_scores, q, w, keys, bt, tr, nv, entries, "triton", **kw)
    run_fp8 = partial(indexer_scores_fp8keys, q, w, fk, bt, tr, nv, entries, "triton", **kw)
    run_torch = partial(torch_scores_fp8, q, w, fk, bt, entries)

    ref = indexer_scores_reference(q, w, keys, bt, tr, nv, entries)
    err4 = check_close(run_fp4(), ref, f"fp4 ctx={ctx} B={B}")
    err8 = check_close(run_fp8(), ref, f"fp8 ctx={ctx} B={B}")
    torch_err = ((run_torch() - ref).abs().max() / ref.abs().max()).item()  # bf16 logits: loose
    if torch_err > 2e-2:
        raise SystemExit(f"torch baseline ctx={ctx} B={B}: rel err {torch_err:.3g}")
    del ref

    shape = {"ctx_tokens": ctx, "entries": entries, "B": B, "heads": H, "head_dim": FMT.dim, "page": args.page}
    extra_bytes = q.numel() * q.element_size() + w.numel() * 4 + B * entries * 4
    b4 = B * entries * FMT.entry_bytes + extra_bytes
    b8 = B * entries * FP8_KEY_BYTES + extra_bytes
    t_torch = timer(run_torch, args.smoke)
    record(rows, info, "torch_fp8keys", shape, t_torch, b8)
    if compiled is not None:
        try:
            run_c = partial(compiled, q, w, fk, bt, entries)
            run_c()
            record(rows, info, "torch_compile_fp8keys", shape, timer(run_c, False), b8, "torch_fp8keys", t_torch)
        except Exception as e:  # pragma: no cover
            print(f"torch.compile failed: {type(e).__name__}: {e}")
            compiled = None
    t4, t8 = timer(run_fp4, args.smoke), timer(run_fp8, args.smoke)
    record(rows, info, "indexer_fp4", shape, t4, b4, "torch_fp8keys", t_torch, max_rel_err=err4)
    record(rows, info, "indexer_fp8keys", shape, t8, b8, "torch_fp8keys", t_torch, max_rel_err=err8)
    for impl in ("gluon", "fp8mma", "gluon_fold", "convert", "dot_scaled"):  # the impls next to the default
        try:
            run_x = partial(indexer_scores, q, w, keys, bt, tr, nv, entries, "triton", impl=impl, **kw)
            err_x = check_close(run_x(), indexer_scores_reference(q, w, keys, bt, tr, nv, entries), impl)
            t_x = timer(run_x, args.smoke)
            record(rows, info, f"indexer_fp4_{impl}", shape, t_x, b4, "torch_fp8keys", t_torch, max_rel_err=err_x)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - an optional variant must not stop the run
            print(f"indexer_fp4_{impl} ctx={ctx} B={B} skipped: {type(e).__name__}: {str(e)[:200]}")

    if with_step:  # the whole selection step: scores + top-k
        k = min(1024, entries)

        def step_fp4():
            return topk_indices(run_fp4(), k, nv, "triton")

        def step_torch():
            return torch.topk(run_torch(), k, dim=1).indices

        t_step_torch = timer(step_torch, args.smoke)
        record(rows, info, "torch_scores_topk", {**shape, "k": k}, t_step_torch, b8)
        t_step = timer(step_fp4, args.smoke)
        record(rows, info, "indexer_fp4_topk", {**shape, "k": k}, t_step, b4, "torch_scores_topk", t_step_torch)
    return compiled


def bench_topk(args, dev, info, rows, gen):
    """Top-k over R x 262,144 normal scores (R = 1, 4, 8, 64; 64 = the decode step at 1M context), each checked
    against the reference first: the default method (group-max filter) eager and from a CUDA graph, the
    radix split path and the single-program kernel from a graph, torch.topk eager; ``--topk-splits`` adds
    graph-timed split counts of the filter path.  One adversarial case (sorted rows: the filter's whole-row
    fallback) at R = 4; rows that see only n / 8 of the columns (``topk_filter_graph_visible8``)."""

    from benchmarks.sweep_indexer import GraphTimer  # (sweep_indexer imports this module)

    n = 2048 if args.smoke else 262144
    in_graph = None if args.smoke else GraphTimer(n=20, flush=True)
    in_graph_clean = None if args.smoke else GraphTimer(n=20, flush=True, flush_mode="read")
    for k in [64] if args.smoke else [1024, 512]:
        for R in [2] if args.smoke else [1, 4, 8, 64]:
            s = torch.randn(R, n, device=dev, generator=gen)
            nv = torch.full((R,), n, dtype=torch.int32, device=dev)
            ws = topk_workspace(R, n, dev)
            shape = {"rows": R, "n": n, "k": k}
            nbytes = R * n * 4 + R * k * 4
            want = topk_indices_reference(s, k, nv)
            base = partial(torch.topk, s, k, dim=1)
            variants = [("filter", {}), ("radix", {"method": "radix"}), ("radix_s1", {"method": "radix", "splits": 1})]
            variants += [(f"filter_s{sp}", {"method": "filter", "splits": sp}) for sp in args.topk_splits]
            for tag, kw in variants:
                got = topk_indices(s, k, nv, "triton", workspace=ws, **kw)
                if not torch.equal(got, want):
                    raise SystemExit(f"topk {tag} R={R} k={k}: differs from the reference")
            if not torch.equal(want.long(), base().indices.sort(1).values):  # ours: ascending indices
                raise SystemExit(f"topk R={R} k={k}: reference set differs from torch.topk")
            t_base = timer(base, args.smoke)
            record(rows, info, "torch_topk", shape, t_base, nbytes)
            run = partial(topk_indices, s, k, nv, "triton", workspace=ws)
            record(rows, info, "topk_filter", shape, timer(run, args.smoke), nbytes, "torch_topk", t_base)
            if args.smoke:
                continue
            for tag, kw in variants:
                run_k = partial(topk_indices, s, k, nv, "triton", workspace=ws, **kw)
                t = graph_timer(run_k)
                extra = dict(in_graph_time_s=in_graph(run_k), in_graph_clean_flush_time_s=in_graph_clean(run_k))
                if not torch.equal(run_k(), want):  # after the replays: the workspace contract held
                    raise SystemExit(f"topk {tag} R={R} k={k}: differs from the reference after replays")
                record(rows, info, f"topk_{tag}_graph", shape, t, nbytes, "torch_topk", t_base, **extra, **kw)
            # rows seeing 1/8 of the columns (block tables sized for a longer request; -inf past n_visible, as the
            # scores kernels write): the filter's finer groups (topk._row_plan)
            nv8 = torch.full((R,), n // 8, dtype=torch.int32, device=dev)
            s8 = torch.where(torch.arange(n, device=dev)[None, :] < n // 8, s, float("-inf"))
            run_8 = partial(topk_indices, s8, k, nv8, "triton", workspace=ws)
            if not torch.equal(run_8(), topk_indices_reference(s8, k, nv8)):
                raise SystemExit(f"topk visible n/8 R={R} k={k}: differs from the reference")
            record(rows, info, "topk_filter_graph_visible8", {**shape, "visible": n // 8}, graph_timer(run_8),
                   R * (n // 8) * 4 + R * k * 4, in_graph_time_s=in_graph(run_8))  # fmt: skip
            if R == 4 and k == 1024:  # adversarial rows: many candidates -> the filter's whole-row fallback
                srt = torch.sort(s, dim=1).values
                run_f = partial(topk_indices, srt, k, nv, "triton", workspace=ws)
                if not torch.equal(run_f(), topk_indices_reference(srt, k, nv)):
                    raise SystemExit(f"topk sorted rows R={R} k={k}: differs from the reference")
                record(rows, info, "topk_filter_graph_sorted_rows", shape, graph_timer(run_f), nbytes)


def event_timer(fn, reps: int = 3) -> float:
    """Median of ``reps`` timed calls (CUDA events) after one warm-up: for calls of tens of milliseconds."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return sorted(times)[len(times) // 2]


def peak_bytes(fn, dev) -> int:
    """Device memory ``fn`` allocates at its peak above what was allocated before it (0 on the CPU)."""
    if dev.type != "cuda":
        fn()
        return 0
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base


def bench_prefill_select(args, dev, info, rows, gen):
    """A prefill chunk's whole indexer selection (scores + top-k of every query row, one request, causal counts):
    ``indexer_topk`` (row chunks of <= ``MAX_SCRATCH_BYTES`` scores + workspace, each only as wide as its rows see)
    against the one-call form it replaces (``indexer_scores`` over ``max_entries`` columns, then ``topk_indices``),
    same indices checked first.  Compute-bound: flops = 2 x Hi x 128 x the visible (row, entry) pairs, roofline at
    the H200's FP8 MMA rate (1354 TFLOP/s); ``peak_bytes`` = device memory held above the inputs at the peak."""
    from dsv4.kernels.indexer import indexer_topk, row_chunks
    from dsv4.kernels.indexer.select import chunk_row_bytes

    H, k = args.heads, 64 if args.smoke else 512  # V4-Flash's top-k
    # (query rows, context tokens after the chunk): a 64K prompt's last 8K chunk, a whole 64K prefill, a 1M
    # context's 4K chunk
    cases = [(32, 256)] if args.smoke else [(8192, 65536), (65536, 65536), (4096, 1048576)]
    for T, ctx in cases:
        n = ctx // 4
        keys, block_table, _, _, _, _ = make_problem(1, n, H, args.page, dev, gen)
        q = FMT.roundtrip(torch.randn(T, H, FMT.dim, device=dev, generator=gen), dtype=torch.bfloat16)
        w = torch.rand(T, H, device=dev, generator=gen) * (FMT.dim**-0.5 * H**-0.5)
        pos = torch.arange(ctx - T, ctx, device=dev)
        nv = ((pos + 1) // 4).to(torch.int32)
        nv_host = nv.cpu().numpy()
        tr = torch.zeros(T, dtype=torch.int32, device=dev)
        max_bytes = 8 * chunk_row_bytes(n, k) if args.smoke else None  # smoke: several chunks
        chunked = partial(indexer_topk, q, w, keys, block_table, tr, nv, n, k, "triton", n_visible_host=nv_host,
                          max_bytes=max_bytes)  # fmt: skip

        def one_call(q=q, w=w, keys=keys, block_table=block_table, tr=tr, nv=nv, n=n):
            return topk_indices(indexer_scores(q, w, keys, block_table, tr, nv, n, "triton"), k, nv, "triton")

        if not torch.equal(chunked(), one_call()):
            raise SystemExit(f"prefill select T={T} ctx={ctx}: the row chunks differ from the one call")
        shape = {"rows": T, "context": ctx, "entries": n, "heads": H, "k": k, "page": args.page}
        flops = 2 * H * FMT.dim * int(nv_host.sum())
        time_fn = partial(timer, smoke=True) if args.smoke else event_timer
        t_one, m_one = time_fn(one_call), peak_bytes(one_call, dev)
        t_ch, m_ch = time_fn(chunked), peak_bytes(chunked, dev)
        chunks = row_chunks(T, n, k, nv_host, max_bytes)
        common = dict(flops=flops, chunks=len(chunks))
        r1 = record(rows, info, "indexer_select_one_call", shape, t_one, 0, peak_bytes=m_one, **common)
        r2 = record(rows, info, "indexer_select_prefill", shape, t_ch, 0, "indexer_select_one_call", t_one,
                    peak_bytes=m_ch, baseline_peak_bytes=m_one, **common)  # fmt: skip
        for r in (r1, r2):  # compute-bound: the roofline is the FP8 MMA rate's
            r["roofline_s"], r["bytes"] = flops / FP8_MMA_FLOPS_PER_S, None
        del q, w, keys, chunked


def graph_timer(fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph (launch overhead excluded)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e-3


def print_table(rows):
    head = f"{'name':24} {'shape':52} {'time_us':>10} {'roofline_us':>12} {'%roof':>6} {'vs baseline':>12}"
    print(head + f" {'in_graph_us':>12}")
    for r in rows:
        sh = ",".join(f"{k}={v}" for k, v in r["shape"].items() if k not in ("head_dim", "page"))
        pct = 100 * r["roofline_s"] / r["time_s"]
        vs = f"{r['baseline_time_s'] / r['time_s']:.2f}x" if r["baseline_time_s"] else ""
        t_in = f"{r['in_graph_time_s'] * 1e6:12.1f}" if r.get("in_graph_time_s") else ""
        print(
            f"{r['name']:24} {sh:52} {r['time_s'] * 1e6:10.1f} {r['roofline_s'] * 1e6:12.1f} {pct:6.1f} {vs:>12} {t_in}"
        )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU/interpreter allowed")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--page", type=int, default=64, help="entries per page")
    ap.add_argument("--block-n", type=int, default=None, help="scores kernel: entries per tile")
    ap.add_argument("--tiles", type=int, default=None, help="scores kernel: tiles per program")
    ap.add_argument("--warps", type=int, default=None, help="scores kernel: num_warps")
    ap.add_argument("--stages", type=int, default=None, help="scores kernel: num_stages")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--only", choices=["scores", "topk", "prefill"], default=None)
    ap.add_argument("--topk-splits", type=int, nargs="*", default=[], help="top-k: graph-timed filter split counts")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke")
    if args.smoke:
        args.heads = min(args.heads, 16)
        args.page = min(args.page, 16)
    gen = torch.Generator(device=dev).manual_seed(0)
    info = env_info(dev)
    rows: list[dict] = []
    if args.only in (None, "scores"):
        bench_scores(args, dev, info, rows, gen)
    if args.only in (None, "topk"):
        bench_topk(args, dev, info, rows, gen)
    if args.only in (None, "prefill"):
        bench_prefill_select(args, dev, info, rows, gen)
    if args.out:
        write_jsonl(rows, args.out, append=True)
    print_table(rows)


if __name__ == "__main__":
    main()
