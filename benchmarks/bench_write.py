"""Benchmark of the cache write path (window store, CSA/HCA compressors) against its PyTorch references.

    python benchmarks/bench_write.py --out FILE.jsonl     # on the H200
    python benchmarks/bench_write.py --smoke              # tiny shapes, CPU (interpreter) or GPU

Ops (each = what one layer does per step on the write path):
- ``store_window``: kv_norm -> RoPE -> FP8 -> ring slot, for T tokens;
- ``csa_main``: compressor_step (m=4, overlap, d=head_dim) + emit_entries(kind="main");
- ``csa_indexer``: compressor_step (m=4, overlap, d=index_head_dim) + emit_entries(kind="indexer");
- ``hca``: compressor_step (m=128, d=head_dim) + emit_entries(kind="main").
Shapes: decode B = 1, 8, 64 (one token per request, at a position where it emits: the worst case) and
prefill of one request of 8K / 64K tokens from position 0, for the V4-Flash and V4-Pro configs (their
write-path widths are the same: head_dim 512, rope 64, index_head_dim 128).  In one process and on the
same data: correctness of Triton vs the torch reference first, then the median time
(``triton.testing.do_bench`` on a GPU, wall clock on the CPU) of both.  Bytes are counted explicitly
(the minimum the op must move, see ``*_bytes``); roofline_s = bytes / 4.17e12 (H200 HBM).
"""

from __future__ import annotations

import argparse
import datetime
import json
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
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat  # noqa: E402
from dsv4.kernels.cache.compressor import compressor_step, emit_entries  # noqa: E402
from dsv4.kernels.cache.store import store_window  # noqa: E402

PEAK_HBM_BYTES = 4.17e12
ENTRIES_PER_PAGE = 64


def timeit(fn, smoke: bool) -> float:
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3
    ts = []
    for _ in range(1 if smoke else 3):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def inv_freq_of(rope_dim: int, device) -> torch.Tensor:
    return (1.0 / (160000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))).to(device)


def token_layout(mode: str, n: int, ratio: int, device):
    """positions, token_slot for decode (n requests, one emitting token each) or prefill (one request)."""
    if mode == "decode":
        pos = (torch.arange(n, dtype=torch.int32) * 7 + 3) * ratio + ratio - 1
        return pos.to(device), torch.arange(n, dtype=torch.int32, device=device), n
    return torch.arange(n, dtype=torch.int32, device=device), torch.zeros(n, dtype=torch.int32, device=device), 1


# ---------------------------------------------------------------------------- cases
def case_store_window(fmt, mode, n, device, gen):
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

    def make():
        flat = torch.zeros(fmt.page_bytes(bs) * pages_n, dtype=torch.uint8, device=device)
        return flat, fmt.entry_pages(flat, pages_n, bs)

    (fk, pk), (fr, pr) = make(), make()

    def run(backend, pages):
        return lambda: store_window(kv, w, 1e-6, pos, inv, slots, pages, fmt, backend=backend)

    run("triton", pk)()
    run("torch", pr)()
    same = (fk == fr).float().mean().item()
    ok = same > 0.999
    nbytes = t * (fmt.head_dim * 2 + 8 + fmt.rope_dim * 4 * 2 + fmt.data_bytes + fmt.n_tiles)
    return run("triton", pk), run("torch", pr), ok, f"bytes equal {same:.6f}", nbytes


def case_compressor(kind, cfg, mode, n, device, gen):
    fmt8, fmt4 = FP8EntryFormat(cfg.head_dim, cfg.rope_head_dim), MXFP4KeyFormat(cfg.index_head_dim)
    ratio, overlap = (4, True) if kind.startswith("csa") else (128, False)
    c = 2 if overlap else 1
    d = cfg.index_head_dim if kind == "csa_indexer" else cfg.head_dim
    fmt, ekind = (fmt4, "indexer") if kind == "csa_indexer" else (fmt8, "main")
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

    def make():
        flat = torch.zeros(fmt.page_bytes(bs) * pages_n, dtype=torch.uint8, device=device)
        pages = fmt.entry_pages(flat, pages_n, bs) if ekind == "main" else fmt.key_pages(flat, pages_n, bs)
        return flat, pages, st0[0].clone(), st0[1].clone()

    (fk, pk, ksk, ssk), (fr, pr, ksr, ssr) = make(), make()

    def run(backend, pages, ks, ss):
        def f():
            pooled, emits = compressor_step(
                kv, sc, pos, tslot, ks, ss, ratio, overlap, decode=mode == "decode", backend=backend
            )
            emit_entries(pooled, emits, pos, w, 1e-6, inv, eslot, pages, fmt, ratio, ekind, backend=backend)

        return f

    # correctness on this data (from the same initial state), before timing
    run("triton", pk, ksk, ssk)()
    run("torch", pr, ksr, ssr)()
    same = (fk == fr).float().mean().item()
    state_ok = torch.equal(ksk, ksr) and torch.equal(ssk, ssr)
    ok = same > 0.999 and state_ok
    e = n_entries
    rows_in = t * c * d * 4 * 2  # kv + score of every token, read once
    state = min(t, c * ratio) * n_req * c * d * 4 * 2 if mode == "prefill" else t * c * d * 4 * 2  # state writes
    state_reads = e * (c * ratio - 1) * d * 4 * 2 if mode == "decode" else 0
    nbytes = rows_in + state + state_reads + e * d * 4 * 2 + e * fmt.entry_bytes
    return (
        run("triton", pk, ksk, ssk),
        run("torch", pr, ksr, ssr),
        ok,
        f"bytes equal {same:.6f}, state {state_ok}",
        nbytes,
    )


# ---------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter friendly)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (triton interpreter)"
    decode_b = (1, 2) if args.smoke else (1, 8, 64)
    prefill_t = (64,) if args.smoke else (8192, 65536)
    models = ("v4-flash",) if args.smoke else ("v4-flash", "v4-pro")
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for model in models:
        cfg = get_preset(model)
        for op in ("store_window", "csa_main", "csa_indexer", "hca"):
            for mode, sizes in (("decode", decode_b), ("prefill", prefill_t)):
                for n in sizes:
                    if op == "hca" and mode == "prefill" and args.smoke:
                        n = 130  # at least one HCA entry
                    gen = torch.Generator().manual_seed(0)
                    if op == "store_window":
                        tri, ref, ok, note, nbytes = case_store_window(
                            FP8EntryFormat(cfg.head_dim, cfg.rope_head_dim), mode, n, device, gen
                        )
                    else:
                        tri, ref, ok, note, nbytes = case_compressor(op, cfg, mode, n, device, gen)
                    t_tri = timeit(tri, args.smoke)
                    t_ref = timeit(ref, args.smoke)
                    roof = nbytes / PEAK_HBM_BYTES
                    rec = {
                        "name": f"write/{op}",
                        "model": model,
                        "gpu": gpu,
                        "torch": torch.__version__,
                        "triton": triton.__version__,
                        "shape": {"mode": mode, ("B" if mode == "decode" else "T"): n},
                        "time_s": t_tri,
                        "bytes": nbytes,
                        "roofline_s": roof,
                        "pct_of_roofline": 100.0 * roof / t_tri,
                        "baseline": "torch reference (eager, backend='torch')",
                        "baseline_time_s": t_ref,
                        "speedup": t_ref / t_tri,
                        "correct": ok,
                        "check": note,
                        "date": date,
                    }
                    rows.append(rec)
                    print(
                        f"{model:9s} {op:12s} {mode:7s} {n:6d}  triton {t_tri * 1e6:10.1f} us"
                        f"  torch {t_ref * 1e6:10.1f} us"
                        f"  x{t_ref / t_tri:6.1f}  roofline {roof * 1e6:8.2f} us ({rec['pct_of_roofline']:5.1f}%)"
                        f"  {'ok' if ok else 'MISMATCH'} ({note})",
                        flush=True,
                    )
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if not all(r["correct"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
