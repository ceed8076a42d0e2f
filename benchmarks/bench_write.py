"""Benchmark of the cache write path (window store, CSA/HCA compressors) against its PyTorch references.

    python benchmarks/bench_write.py --out FILE.jsonl     # on the H200
    python benchmarks/bench_write.py --smoke              # tiny shapes, CPU (interpreter) or GPU
    python benchmarks/bench_write.py --prefill-only       # prefill rows + HCA decode B=64 only
    python benchmarks/bench_write.py --prefill-only --models v4-flash --tune store_window: --tune store_window:iters=4

Ops (each = what one layer does per step on the write path):
- ``store_window``: kv_norm -> RoPE -> FP8 -> ring slot, for T tokens (prefill also writes the bf16
  ``out`` rows, as ``append_window`` does for the chunk's own keys);
- ``csa_main``: compressor_step (m=4, overlap, d=head_dim) + emit_entries(kind="main");
- ``csa_indexer``: compressor_step (m=4, overlap, d=index_head_dim) + emit_entries(kind="indexer");
- ``hca``: compressor_step (m=128, d=head_dim) + emit_entries(kind="main"), the reference state layout (128 rows);
- ``hca_online``: the same with the online state (``state_pos``: the running softmax of the open chunk before its
  newest row, that row raw and its position; the cache's default for HCA).
Shapes: decode B = 1, 8, 64 (one token per request, at a position where it emits: the worst case) and
prefill of one request of 8K / 64K tokens from position 0, for the V4-Flash and V4-Pro configs (their
write-path widths are the same: head_dim 512, rope 64, index_head_dim 128).  In one process and on the
same data: correctness of Triton vs the torch reference first, then timings.

Timings (GPU; on the CPU only the wall clock of one eager call):
- ``time_s``: the Triton op inside a CUDA graph: ``GRAPH_CALLS`` back-to-back calls on static inputs are
  captured once, ``graph.replay`` is timed with ``triton.testing.do_bench`` (CUDA events, median) and
  divided by ``GRAPH_CALLS``: what an engine that captures its decode step pays (no Python, no launch
  latency on the critical path; per-kernel launch gaps inside the graph remain).
- ``eager_time_s``: ``do_bench`` of one eager call (Python validation + launch overhead included).
- ``baseline_time_s``: the torch reference (``backend="torch"``), eager.  It syncs with the host
  (``nonzero``, ``.tolist()``, ``bool(tensor)``), so it cannot be captured; ``baseline_graph_time_s`` is
  None, and ``baseline_syncs`` / ``syncs`` count the synchronising calls torch reports
  (``torch.cuda.set_sync_debug_mode("warn")``) during one call of each.
- ``launches``: GPU kernels (and ``memcpy``/``memset`` operations) of one eager call, counted with
  ``torch.profiler`` (CUPTI activity records, so every Triton and torch kernel is seen); ``graph_ok``:
  whether the op could be captured at all.
Bytes (``bytes``: the minimum the op must move; roofline_s = bytes / 4.17e12, H200 HBM):
- store_window: read kv (T x head_dim bf16) + positions + slots (int32), write T entries (nope e4m3 +
  rope bf16 + tile scales; the pad byte is not written) [+ the bf16 ``out`` rows in prefill];
- compressor decode (B tokens, all emitting; the op is ``compress_decode``, one launch, or with the tuning key
  ``two_launch=1`` compressor_step + emit_entries): read kv + score of the step (B x c*d fp32 each), read the
  (c*m - 1) x d state values the pooling takes from the ring (kv + score), write the step's state row
  (c*d, kv + score), [two_launch: pass ``pooled`` between the two kernels (B x d fp32, written + read)],
  write B entries; ``hca_online``: read the row (kv + score), read the state's prefix (max, den, acc: 3 x d fp32)
  and position, write prefix + raw row (5 x d) and position, write B entries (the timed calls re-run the same
  positions, so the raw row is replaced, not read: a first run reads 2 x d x 4 bytes a request more);
- compressor prefill (T tokens from 0, E = T/m entries; the op is ``compress_prefill``, pool then emit and state
  write, the latter on a side stream with the tuning key ``overlap_write=1``; ``fuse_emit=1``: the pool kernel
  emits, where the geometry allows): read kv + score once, write the last c*m rows of the state (``hca_online``:
  the 5 x d state + position a request), pooled written + read (E x d fp32; not with the fused emit, where they
  stay in registers or L2, as in the decode kernel), write E entries.
The norm weights and inv_freq (< 3 KB) are not counted.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dsv4.kernels.cache.compressor_prefill as compressor_prefill  # noqa: E402
from dsv4.config import get_preset  # noqa: E402
from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.engine.graphs import capture_graph  # noqa: E402
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat  # noqa: E402
from dsv4.kernels.cache.compressor import (  # noqa: E402
    compress_decode,
    compressor_step,
    emit_entries,
    online_state,
    state_unread_by_step,
)
from dsv4.kernels.cache.compressor_prefill import compress_prefill  # noqa: E402
from dsv4.kernels.cache.store import store_window  # noqa: E402
from dsv4.kernels.dispatch import pdl_launch  # noqa: E402

PEAK_HBM_BYTES = 4.17e12
ENTRIES_PER_PAGE = 64
GRAPH_CALLS = 20


def timeit(fn, smoke: bool) -> float:
    """Eager time of one call: do_bench median on a GPU, wall clock on the CPU."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    ts = []
    for _ in range(1 if smoke else 3):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def graph_time(fn) -> tuple[float | None, str]:
    """Per-call time of ``fn`` replayed from a CUDA graph of GRAPH_CALLS back-to-back calls (None if it
    cannot be captured, with the reason)."""
    if not torch.cuda.is_available():
        return None, "no CUDA"
    try:
        g, _ = capture_graph(fn, warmup=3, calls=GRAPH_CALLS)
    except Exception as e:  # noqa: BLE001 - report why it does not capture
        torch.cuda.synchronize()
        return None, f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    g.replay()
    torch.cuda.synchronize()
    t = triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median") * 1e-3
    return t / GRAPH_CALLS, "ok"


def count_launches(fn) -> dict | None:
    """GPU work items of one eager call, from torch.profiler's CUDA activity (kernels / memcpy / memset)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a profiler problem must not stop the benchmark
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    kernels, copies, sets, names = 0, 0, 0, []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        n = e.name.lower()
        if "memcpy" in n:
            copies += 1
        elif "memset" in n:
            sets += 1
        else:
            kernels += 1
            names.append(e.name[:60])
    # the distinct kernel names, first-seen order, at most _MAX_NAMES (a reference run launches thousands of kernels)
    distinct = list(dict.fromkeys(names))
    return {"kernels": kernels, "memcpy": copies, "memset": sets, "names": distinct[:_MAX_NAMES]}


def count_syncs(fn) -> int | None:
    """Host synchronisations torch reports during one call (sync debug mode 'warn')."""
    if not torch.cuda.is_available():
        return None
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # The debug mode's own "prototype feature" notice also mentions synchronization: not a sync.
    return sum("synchroniz" in str(x.message).lower() and "prototype" not in str(x.message) for x in w)


def inv_freq_of(rope_dim: int, device) -> torch.Tensor:
    return (1.0 / (160000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))).to(device)


def token_layout(mode: str, n: int, ratio: int, device):
    """positions, token_slot for decode (n requests, one emitting token each) or prefill (one request)."""
    if mode == "decode":
        pos = (torch.arange(n, dtype=torch.int32) * 7 + 3) * ratio + ratio - 1
        return pos.to(device), torch.arange(n, dtype=torch.int32, device=device), n
    return torch.arange(n, dtype=torch.int32, device=device), torch.zeros(n, dtype=torch.int32, device=device), 1


def fp8_written_bytes(fmt: FP8EntryFormat) -> int:
    return fmt.data_bytes + fmt.n_tiles  # nope + rope + tile scales (the pad is never written)


def mxfp4_written_bytes(fmt: MXFP4KeyFormat) -> int:
    return fmt.data_bytes + fmt.n_blocks


# ---------------------------------------------------------------------------- cases
_MAX_NAMES = 32


def parse_tune(items: list[str]) -> dict[str, list[dict[str, int | str]]]:
    """``["op:k=v,k=v", ...]`` -> {op: [{k: int(v) or v}, ...]}: each item is one variant of its op (an op given
    several times is measured once per variant, in order; ``op:`` alone is the default geometry)."""
    out: dict[str, list[dict[str, int]]] = {}
    for item in items:
        op, _, kvs = item.partition(":")
        variant = {}
        for kv in filter(None, kvs.split(",")):
            k, _, v = kv.partition("=")
            variant[k] = int(v) if v.lstrip("-").isdigit() else v  # e.g. impl=fp8pf (sass_report's indexer)
        out.setdefault(op, []).append(variant)
    return out


def case_store_window(fmt, mode, n, device, gen, tune=None):
    t = n
    kv = torch.randn(t, fmt.head_dim, generator=gen).bfloat16().to(device)
    w = (torch.rand(fmt.head_dim, generator=gen) + 0.5).to(device)
    pos = token_layout(mode, t, 1, device)[0] if mode == "decode" else torch.arange(t, dtype=torch.int32, device=device)
    ring = 128
    pages_n = max(1, t // ring) if mode == "prefill" else t  # decode: one ring page per request
    bs = ring
    if mode == "decode":  # request i's ring is page i; its slot is pos mod ring
        slots = (torch.arange(t, device=device) * bs + pos.long() % bs).to(torch.int32)
    else:  # every token of the chunk to its own slot (measures quantise + store throughput)
        slots = (torch.arange(t, device=device) % (pages_n * bs)).to(torch.int32)
    inv = inv_freq_of(fmt.rope_dim, device)
    kw_t = dict(tune or {})
    # copy=1 (prefill): what a layer's prefill now runs, the entries also into a workspace of T rows (copy_to) and no
    # bf16 rows out; else the bf16 rows out, which the layer then quantised into its workspace in a second launch
    copy = mode == "prefill" and bool(int(kw_t.pop("copy", 0)))
    with_out = mode == "prefill" and not copy
    ws_slots = torch.arange(t, dtype=torch.int32, device=device)

    def make():
        flat = torch.zeros(fmt.page_bytes(bs) * pages_n, dtype=torch.uint8, device=device)
        out = torch.empty(t, fmt.head_dim, dtype=torch.bfloat16, device=device) if with_out else None
        ws = None
        if copy:
            ws_pages = -(-t // bs)
            ws_flat = torch.zeros(fmt.page_bytes(bs) * ws_pages, dtype=torch.uint8, device=device)
            ws = (ws_slots, fmt.entry_pages(ws_flat, ws_pages, bs), ws_flat)
        # the ring's position and head tables, which the layer's window write also sets in its launch, and (decode)
        # the queries' window index
        tables = (
            torch.zeros(pages_n * bs + 1, dtype=torch.int32, device=device),
            torch.zeros(pages_n + 1, dtype=torch.int32, device=device),
        ) + ((torch.empty(t, ring, dtype=torch.int32, device=device),) if mode == "decode" else ())
        return flat, fmt.entry_pages(flat, pages_n, bs), out, ws, tables

    (fk, pk, ok_, wk, tk), (fr, pr, or_, wr, tr) = make(), make()

    def run(backend, pages, out, ws, tables):
        kw = kw_t if backend == "triton" else {}
        cp = (ws[0], ws[1]) if ws is not None else None
        return lambda: store_window(
            kv, w, 1e-6, pos, inv, slots, pages, fmt, out=out, backend=backend, copy_to=cp, ring_positions=tables[0],
            ring_head=tables[1], window_index=tables[2] if len(tables) > 2 else None, **kw,
        )  # fmt: skip

    run("triton", pk, ok_, wk, tk)()
    run("torch", pr, or_, wr, tr)()
    same = (fk == fr).float().mean().item()
    if copy:
        same = min(same, (wk[2] == wr[2]).float().mean().item())
    ok = same > 0.999 and all(torch.equal(a[:-1], b[:-1]) for a, b in zip(tk, tr, strict=True))
    ok = ok and all(torch.equal(a, b) for a, b in zip(tk[2:], tr[2:], strict=True))  # the window index, whole
    out_b = fmt.head_dim * 2 if with_out else fp8_written_bytes(fmt) if copy else 0
    # per row: kv in, position and slot in, entry out, its ring position out (+ the heads: 4 B a request; decode: the
    # window index, ring int32 slots a row)
    nbytes = t * (fmt.head_dim * 2 + 4 + 4 + fp8_written_bytes(fmt) + out_b + 4 + (ring * 4 if mode == "decode" else 0))
    return run("triton", pk, ok_, wk, tk), run("torch", pr, or_, wr, tr), ok, f"bytes equal {same:.6f}", nbytes


def _fused_prefill(fuse_emit, online: bool, rows: int, d: int) -> bool:
    """Whether ``compress_prefill`` takes its fused launch for this compressor (``compressor_prefill._fusable``'s
    geometry rule, for the released formats)."""
    fuse = compressor_prefill._FUSE_EMIT if fuse_emit is None else bool(int(fuse_emit))
    return fuse and not online and triton.next_power_of_2(rows) * d <= compressor_prefill._FUSE_TILE_MAX


def _state_unread(pos: torch.Tensor, tslot: torch.Tensor, ratio: int, overlap: bool) -> bool:
    """``state_unread_by_step`` of a batch given by its tokens (runs of one state slot = requests)."""
    ph, sh = pos.cpu().long(), tslot.cpu().long()
    cut = [0, *((sh[1:] != sh[:-1]).nonzero().flatten() + 1).tolist(), ph.numel()]
    starts = [int(ph[a]) for a in cut[:-1]]
    return state_unread_by_step(starts, [b - a for a, b in zip(cut, cut[1:], strict=False)], ratio, overlap)


def case_compressor(kind, cfg, mode, n, device, gen, tune=None):
    fmt8, fmt4 = FP8EntryFormat(cfg.head_dim, cfg.rope_head_dim), MXFP4KeyFormat(cfg.index_head_dim)
    ratio, overlap = (4, True) if kind.startswith("csa") else (128, False)
    online = kind == "hca_online"
    c = 2 if overlap else 1
    d = cfg.index_head_dim if kind == "csa_indexer" else cfg.head_dim
    fmt, ekind = (fmt4, "indexer") if kind == "csa_indexer" else (fmt8, "main")
    entry_w = mxfp4_written_bytes(fmt4) if ekind == "indexer" else fp8_written_bytes(fmt8)
    pos, tslot, n_req = token_layout(mode, n, ratio, device)
    t = pos.numel()
    kv = torch.randn(t, c * d, generator=gen).to(device)
    sc = torch.randn(t, c * d, generator=gen).to(device)
    w = (torch.rand(d, generator=gen) + 0.5).to(device)
    inv = inv_freq_of(cfg.rope_head_dim, device)
    n_entries = int(((pos + 1) % ratio == 0).sum()) if mode == "prefill" else t
    bs = ENTRIES_PER_PAGE
    pages_n = max(1, -(-n_entries // bs))
    eslot = torch.where((pos + 1) % ratio == 0, pos // ratio, -1).to(torch.int32)
    if mode == "decode":
        eslot = torch.arange(t, dtype=torch.int32, device=device)  # one entry per request, distinct slots
    g2 = torch.Generator().manual_seed(1)
    st0 = (
        torch.randn(n_req, c * ratio, c * d, generator=g2).to(device),
        torch.randn(n_req, c * ratio, c * d, generator=g2).to(device),
    )
    if mode == "prefill":
        st0 = (torch.zeros_like(st0[0]), torch.full_like(st0[1], float("-inf")))
    sp0 = None
    if online:  # fresh for a prefill; for a decode a running state of random rows, its raw row the previous token's
        k0, s0, sp0 = online_state(n_req, d, device)
        if mode == "decode":
            k0.copy_(torch.randn(k0.shape, generator=g2).to(device))
            k0[:, 1].abs_().add_(1.0)
            s0.copy_(torch.randn(s0.shape, generator=g2).to(device))
            sp0[tslot.long()] = (pos - 1).to(torch.int32)
        st0 = (k0, s0)

    def make():
        flat = torch.zeros(fmt.page_bytes(bs) * pages_n, dtype=torch.uint8, device=device)
        pages = fmt.entry_pages(flat, pages_n, bs) if ekind == "main" else fmt.key_pages(flat, pages_n, bs)
        if online:
            buf = torch.cat(st0, 1).clone()
            return flat, pages, buf[:, 0:3], buf[:, 3:5], sp0.clone()
        return flat, pages, st0[0].clone(), st0[1].clone(), None

    (fk, pk, ksk, ssk, spk), (fr, pr, ksr, ssr, spr) = make(), make()

    tune = dict(tune or {})
    emit_kw = {k[len("emit_") :]: tune.pop(k) for k in list(tune) if k.startswith("emit_")}

    two_launch = bool(tune.pop("two_launch", 0))
    overlap_write = tune.pop("overlap_write", None)  # prefill: the state write on a side stream (compress_prefill)
    fuse_emit = tune.pop("fuse_emit", None)  # prefill: the pool kernel emits (compress_prefill's fused launch)
    # ape=1: the score rows are wgate(x) alone and the kernels add ape[pos mod m] (what a layer passes; both backends
    # get the same raw scores and ape, so the check compares the same sums)
    ape = (torch.randn(ratio, c * d, generator=gen) * 0.5).to(device) if int(tune.pop("ape", 0)) else None
    counters = torch.zeros(n_req, dtype=torch.int32, device=device)
    # prefill: what the layer's handle promises for this batch (requests from position 0: the pool launch writes the
    # state), unless state_unread=0 (the separate state-write launch)
    unread = int(tune.pop("state_unread", 1)) and mode == "prefill" and _state_unread(pos, tslot, ratio, overlap)

    def run(backend, pages, ks, ss, spos):
        kw_s, kw_e = (tune, emit_kw) if backend == "triton" else ({}, {})
        if spos is not None:
            kw_s = {**kw_s, "state_pos": spos}

        def f():
            if mode == "decode" and not two_launch:  # what a layer's decode step runs: one fused launch
                compress_decode(
                    kv, sc, pos, tslot, ks, ss, counters, ratio, overlap, w, 1e-6, inv, eslot, pages, fmt, ekind,
                    backend=backend, ape=ape, **kw_s,
                )  # fmt: skip
                return
            if mode == "prefill":  # what a layer's prefill step runs (LayerCacheHandle.compress)
                sk = {k: v for k, v in kw_s.items() if k != "state_pos"}
                compress_prefill(
                    kv, sc, pos, tslot, ks, ss, ratio, overlap, w, 1e-6, inv, eslot, pages, fmt, ekind, backend,
                    state_pos=kw_s.get("state_pos"), counters=counters if online else None, ape=ape,
                    overlap_write=None if backend == "torch" else overlap_write,
                    fuse_emit=None if backend == "torch" else fuse_emit, state_unread=bool(unread),
                    step_kw=sk, emit_kw=kw_e,
                )  # fmt: skip
                return
            pooled, emits = compressor_step(
                kv, sc, pos, tslot, ks, ss, ratio, overlap, decode=True, backend=backend, ape=ape, **kw_s
            )
            emit_entries(pooled, emits, pos, w, 1e-6, inv, eslot, pages, fmt, ratio, ekind, backend=backend, **kw_e)

        return f

    # correctness on this data (from the same initial state), before timing
    run("triton", pk, ksk, ssk, spk)()
    run("torch", pr, ksr, ssr, spr)()
    same = (fk == fr).float().mean().item()
    state_ok = torch.equal(ksk, ksr) and torch.equal(ssk, ssr)
    if online:  # the prefix sums round differently in fp32; the max, raw rows and positions are exact
        state_ok = torch.equal(ssk, ssr) and torch.equal(spk, spr) and torch.allclose(ksk, ksr, rtol=1e-5, atol=1e-5)
    ok = same > 0.999 and state_ok
    e = n_entries
    rows_in = t * c * d * 4 * 2  # kv + score of every token, read once
    if online and mode == "prefill":
        state = n_req * (5 * d * 4 + 4)  # prefix + raw row + position a request
        state_reads = 0
    elif online:
        state = t * (5 * d * 4 + 4)  # prefix + raw row + position written
        state_reads = t * (3 * d * 4 + 4)  # prefix + position read (a re-run: the raw row is replaced)
    elif mode == "prefill":
        state = min(t, c * ratio) * n_req * c * d * 4 * 2  # the last c*m rows written
        state_reads = 0
    else:
        state = t * c * d * 4 * 2  # each token's own row written
        state_reads = e * (c * ratio - 1) * d * 4 * 2  # the other pooled rows, kv + score
    idx = t * 4 * 3  # positions, token slots, entry slots
    handoff = e * d * 4 * 2 if mode == "prefill" or two_launch else 0  # pooled rows between launches
    if mode == "prefill" and _fused_prefill(fuse_emit, online, c * ratio, d):
        handoff = 0  # fused: registers (main) or a scratch row the writing program reads back from L2 (indexer)
    nbytes = rows_in + state + state_reads + handoff + e * entry_w + idx
    return (
        run("triton", pk, ksk, ssk, spk),
        run("torch", pr, ksr, ssr, spr),
        ok,
        f"bytes equal {same:.6f}, state {state_ok}",
        nbytes,
    )


# ---------------------------------------------------------------------------- main
def us(x: float | None) -> str:
    return "       n/a" if x is None else f"{x * 1e6:10.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter friendly)")
    ap.add_argument("--ops", default="store_window,csa_main,csa_indexer,hca,hca_online", help="comma-separated subset")
    ap.add_argument("--models", default=None, help="comma-separated presets (default: v4-flash,v4-pro)")
    ap.add_argument("--modes", default="decode,prefill", help="comma-separated subset of decode,prefill")
    ap.add_argument("--prefill-tokens", default=None, help="comma-separated prefill sizes (default 8192,65536)")
    ap.add_argument(
        "--prefill-only",
        action="store_true",
        help="quick rerun: the prefill rows of every op plus HCA decode at the largest B (overrides --modes)",
    )
    ap.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="OP:KEY=VAL[,KEY=VAL]",
        help="launch tuning of the Triton path, e.g. store_window:block_t=4,num_warps=4,iters=2 or "
        "hca:pool_block_t=128,block_d=64,row_loads=1,write_block_t=64,write_warps=8 or csa_main:emit_scan=16 "
        "(keys of compressor_step; emit_block_t / emit_num_warps / emit_iters / emit_scan go to emit_entries); "
        "repeatable: each one is a variant "
        "measured separately (store_window: alone = the default geometry)",
    )
    args = ap.parse_args()
    tune = parse_tune(args.tune)
    modes = {"decode", "prefill"} if args.prefill_only else set(args.modes.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)"
    decode_b = (1, 2) if args.smoke else (1, 8, 64)
    prefill_t = (64,) if args.smoke else (8192, 65536)
    if args.prefill_tokens:
        prefill_t = tuple(int(v) for v in args.prefill_tokens.split(","))
    models = tuple(args.models.split(",")) if args.models else (("v4-flash",) if args.smoke else ("v4-flash", "v4-pro"))
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for model in models:
        cfg = get_preset(model)
        for op in args.ops.split(","):
            for mode, sizes in (("decode", decode_b), ("prefill", prefill_t)):
                if mode not in modes:
                    continue
                if args.prefill_only and mode == "decode":
                    if not op.startswith("hca"):
                        continue
                    sizes = sizes[-1:]
                for n, variant in [(n, v) for n in sizes for v in tune.get(op, [{}])]:
                    if op.startswith("hca") and mode == "prefill" and args.smoke:
                        n = 130  # at least one HCA entry
                    gen = torch.Generator().manual_seed(0)
                    if op == "store_window":
                        tri, ref, ok, note, nbytes = case_store_window(
                            FP8EntryFormat(cfg.head_dim, cfg.rope_head_dim), mode, n, device, gen, variant
                        )
                    else:
                        tri, ref, ok, note, nbytes = case_compressor(op, cfg, mode, n, device, gen, variant)
                    launches = count_launches(tri)
                    ref_launches = count_launches(ref)
                    syncs, ref_syncs = count_syncs(tri), count_syncs(ref)
                    t_graph, graph_note = graph_time(tri)
                    t_eager = timeit(tri, args.smoke)
                    t_ref = timeit(ref, args.smoke)
                    t_tri = t_graph if t_graph is not None else t_eager
                    roof = nbytes / PEAK_HBM_BYTES
                    rec = {
                        "name": f"write/{op}",
                        "model": model,
                        "gpu": gpu,
                        "torch": torch.__version__,
                        "triton": triton.__version__,
                        "pdl": pdl_launch(device)["PDL"],
                        "shape": {"mode": mode, ("B" if mode == "decode" else "T"): n},
                        "tune": variant,
                        "time_s": t_tri,
                        "time_kind": "cuda graph replay / call" if t_graph is not None else "eager",
                        "eager_time_s": t_eager,
                        "graph_ok": graph_note,
                        "launches": launches,
                        "syncs": syncs,
                        "bytes": nbytes,
                        "roofline_s": roof,
                        "pct_of_roofline": 100.0 * roof / t_tri,
                        "baseline": "torch reference (eager, backend='torch'; host-syncing: not capturable)",
                        "baseline_time_s": t_ref,
                        "baseline_graph_time_s": None,
                        "baseline_launches": ref_launches,
                        "baseline_syncs": ref_syncs,
                        "speedup": t_ref / t_tri,
                        "speedup_eager": t_ref / t_eager,
                        "correct": ok,
                        "check": note,
                        "date": date,
                    }
                    rows.append(rec)
                    nk = "?" if not launches or "error" in launches else launches["kernels"] + launches["memcpy"]
                    nk = nk if nk == "?" else nk + launches["memset"]
                    print(
                        f"{model:9s} {op:12s} {mode:7s} {n:6d}  graph {us(t_graph)} us  eager {us(t_eager)} us"
                        f"  launches {nk}  torch {us(t_ref)} us  x{t_ref / t_tri:7.1f}"
                        f"  roofline {roof * 1e6:8.2f} us ({rec['pct_of_roofline']:5.1f}%)"
                        f"  {'ok' if ok else 'MISMATCH'} ({note})"
                        + ("" if graph_note == "ok" else f" [{graph_note}]")
                        + (f"  tune {variant}" if variant else ""),
                        flush=True,
                    )
    if args.out:
        write_jsonl(rows, args.out, append=True)
    if not all(r["correct"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
