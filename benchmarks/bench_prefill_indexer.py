"""Benchmark of a prefill's indexer scores: rows of one request against its keys folded once (``fold_keys`` +
``prefill_scores``) against ``indexer_scores`` (its default: the Gluon fold kernel on sm_90) on the same rows.

    python benchmarks/bench_prefill_indexer.py --out FILE.jsonl                 # H200
    python benchmarks/bench_prefill_indexer.py --launches 2,64,4,3 4,128,8,3     # rows,block_n,warps,stages each
    python benchmarks/bench_prefill_indexer.py --select 65536                   # + indexer_topk of a whole prefill
    python benchmarks/bench_prefill_indexer.py --smoke                          # CPU interpreter, correctness only

Problem (V4-Flash indexer widths: 64 heads x 128, pages of 64 MXFP4 keys shuffled in a pool): a chunk of T query
rows at the end of a P-token prefill of one request, row t seeing (position + 1) // 4 entries (the causal rule),
``cols`` = P / 4 score columns; (P, T) in {(8192, 2048), (65536, 4096)} by default.  Rows:

- ``prefill_idx/shared_keys``: ``fold_keys`` + ``prefill_scores`` (one entry a launch in ``--launches``); the fold
  is timed with the scores, as the selection pays it once a request and call);
- ``prefill_idx/fold_keys``: the fold alone;
- baseline ``indexer_scores`` (impl auto: ``gluon_fold`` on sm_90) on the same rows, same timing;
- ``torch_bf16``: plain PyTorch a user would write: the keys dequantised to bf16 once, then per 256 rows
  ``relu(q @ k^T)`` times the weights, summed over heads (bf16 MMAs), causal mask.

Times: ``triton.testing.do_bench`` medians (eager calls; L2 not flushed: the keys of one request are 2 MB at P =
65,536 and stay in L2 anyway).  FLOPs = 2 x 64 x 128 x (visible entries summed over rows); ``roofline_s`` = FLOPs /
1354e12 (the H200's measured FP8 MMA rate, spec/performance.md).  Correctness on the same data before timing:
against ``prefill_scores_reference`` on 64 rows and against the baseline's scores on all rows, both relative to
each row's largest |score| (the FP8 MMA accumulates in the tensor core: ~1e-5 expected).

``--select P``: ``indexer_topk`` (k = 512) of a whole P-token prefill from 0 (every row chunk, scores + top-k), with
``shared_keys`` on and off, timed by CUDA events (median of 3), with the fraction of equal selections.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.formats import MXFP4KeyFormat  # noqa: E402
from dsv4.kernels.indexer import indexer_scores, indexer_topk  # noqa: E402
from dsv4.kernels.indexer import prefill as ps  # noqa: E402

FMT = MXFP4KeyFormat()
FP8_MMA_FLOPS = 1354e12
HEADS, BS = 64, 64
CASES = ((8192, 2048), (65536, 4096))
SMOKE_CASES = ((512, 64),)


def make_problem(P: int, T: int, device, gen):
    """One request with P tokens (P // 4 keys in shuffled pages), the last T rows' query, weights, counts."""
    n = P // 4
    pages = -(-n // BS)
    flat = torch.empty(pages * FMT.page_bytes(BS), dtype=torch.uint8, device=device)
    keys = FMT.key_pages(flat, pages, BS)
    d, s = FMT.quantize(torch.randn(pages, BS, FMT.dim, generator=gen))
    keys.data.copy_(d)
    keys.scale.copy_(s)
    bt = torch.randperm(pages, generator=gen).to(torch.int32)[None].to(device)
    q = FMT.roundtrip(torch.randn(T, HEADS, FMT.dim, generator=gen), dtype=torch.bfloat16).to(device)
    w = (torch.rand(T, HEADS, generator=gen) * (FMT.dim**-0.5 * HEADS**-0.5)).to(device)
    nv = ((torch.arange(P - T, P) + 1) // 4).to(torch.int32).to(device)
    return keys, bt, q, w, nv, n


def torch_bf16(q, w, kv_bf16, nv, n, rows: int = 256):
    """Plain PyTorch: per ``rows`` query rows, bf16 logits against every key, ReLU, weights, head sum, mask."""
    out = torch.empty((q.shape[0], n), dtype=torch.float32, device=q.device)
    j = torch.arange(n, device=q.device)
    for a in range(0, q.shape[0], rows):
        lg = torch.einsum("thd,nd->thn", q[a : a + rows], kv_bf16)
        s = (torch.relu(lg.float()) * w[a : a + rows, :, None]).sum(1)
        out[a : a + rows] = torch.where(j[None, :] < nv[a : a + rows, None], s, float("-inf"))
    return out


def rel_err(out, ref) -> float:
    """max |out - ref| / (the row's largest |ref|) over finite ref; inf when the -inf patterns differ."""
    if not torch.equal(torch.isneginf(out), torch.isneginf(ref)):
        return float("inf")
    fin = torch.isfinite(ref)
    scale = torch.where(fin, ref.abs(), 0.0).amax(dim=1, keepdim=True).clamp(min=1e-30)
    return float(torch.where(fin, (out - ref).abs() / scale, 0.0).max())


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e-3


def event_time(fn, reps: int = 3) -> float:
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return float(np.median(ts))


def parse_launch(text: str) -> dict:
    r, bn, nw, st = (int(x) for x in text.split(","))
    return {"rows": r, "block_n": bn, "num_warps": nw, "num_stages": st}


def run_case(P: int, T: int, dev, launches, with_torch: bool, emit) -> bool:
    """The scores rows of one (P, T) problem; returns whether every launch was correct."""
    cuda = dev.type == "cuda"
    g = torch.Generator().manual_seed(P + T)
    keys, bt, q, w, nv, n = make_problem(P, T, dev, g)
    flops = 2 * HEADS * FMT.dim * int(nv.long().sum())
    shape = {"P": P, "T": T, "cols": n, "heads": HEADS, "page": BS}
    tr = torch.zeros(T, dtype=torch.int32, device=dev)
    base = indexer_scores(q, w, keys, bt, tr, nv, n)
    t_base = bench(lambda: indexer_scores(q, w, keys, bt, tr, nv, n)) if cuda else None
    folded = ps.fold_keys(keys, bt, 0, n)
    t_fold = bench(lambda: ps.fold_keys(keys, bt, 0, n)) if cuda else None
    fold_bytes = n * (FMT.data_bytes + FMT.n_blocks + FMT.dim + 4)
    emit({"name": "prefill_idx/fold_keys", "shape": shape, "time_s": t_fold, "bytes": fold_bytes,
          "roofline_s": fold_bytes / 4.17e12})  # fmt: skip
    ok_all = True
    for launch in launches:
        out = ps.prefill_scores(q, w, folded, nv, n, **launch)
        sub = slice(0, min(T, 64))
        ref = ps.prefill_scores_reference(q[sub], w[sub], folded, nv[sub], n)
        e_ref, e_base = rel_err(out[sub], ref), rel_err(out, base)
        ok = e_ref <= 1e-4 and e_base <= 2e-4
        ok_all &= ok
        t = None
        if cuda:
            t = bench(lambda launch=launch: ps.prefill_scores(q, w, ps.fold_keys(keys, bt, 0, n), nv, n, **launch))
        emit({
            "name": "prefill_idx/shared_keys", "shape": shape, "launch": launch, "time_s": t, "flops": flops,
            "roofline_s": flops / FP8_MMA_FLOPS, "pct_of_roofline": None if t is None else
            100 * flops / FP8_MMA_FLOPS / t, "baseline": "indexer_scores (impl auto: gluon_fold on sm_90)",
            "baseline_time_s": t_base, "speedup": None if t is None else t_base / t, "max_rel_err": e_ref,
            "max_rel_err_vs_baseline": e_base, "correct": ok,
        })  # fmt: skip
    if with_torch:
        kv = FMT.dequantize(keys.data[bt[0].long()], keys.scale[bt[0].long()]).flatten(0, 1)[:n].bfloat16()
        t_torch = bench(lambda: torch_bf16(q, w, kv, nv, n))
        e = rel_err(torch_bf16(q, w, kv, nv, n), base)
        emit({"name": "prefill_idx/torch_bf16", "shape": shape, "time_s": t_torch, "flops": flops,
              "roofline_s": flops / 776e12, "max_rel_err_vs_baseline": e})  # fmt: skip
    return ok_all


def run_select(P: int, dev, emit) -> None:
    """indexer_topk (k = 512) of a whole P-token prefill from 0, shared keys on and off."""
    g = torch.Generator().manual_seed(P)
    keys, bt, q, w, nv, n = make_problem(P, P, dev, g)
    tr = torch.zeros(P, dtype=torch.int32, device=dev)
    nv_host, tr_host = nv.cpu().numpy(), np.zeros(P, dtype=np.int64)
    res = {}
    for shared in (False, True):

        def call(shared=shared):
            return indexer_topk(q, w, keys, bt, tr, nv, n, 512, n_visible_host=nv_host, token_row_host=tr_host,
                                shared_keys=shared)  # fmt: skip

        res[shared] = (call(), event_time(call))
    same = (res[True][0] == res[False][0]).all(dim=1).float().mean().item()
    emit({"name": "prefill_idx/select_shared_keys", "shape": {"P": P, "from": 0, "k": 512},
          "time_s": res[True][1], "baseline": "indexer_topk shared_keys=False", "baseline_time_s": res[False][1],
          "rows_equal": same})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (CPU interpreter)")
    ap.add_argument("--cases", nargs="*", default=None, help="P:T pairs (default 8192:2048 65536:4096)")
    ap.add_argument("--launches", nargs="*", default=None, help="rows,block_n,warps,stages (default: the defaults)")
    ap.add_argument("--select", type=int, nargs="*", default=[], help="prefill lengths for the indexer_topk rows")
    ap.add_argument("--no-torch", action="store_true", help="skip the plain PyTorch baseline")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("timings need CUDA; use --smoke on the CPU")
    dev = torch.device("cuda" if cuda else "cpu")
    gpu = torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)"
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases] if args.cases else (
        SMOKE_CASES if args.smoke else CASES
    )  # fmt: skip
    launches = [parse_launch(x) for x in args.launches] if args.launches else [{}]
    rows, ok_all = [], True

    def emit(rec):
        rec.update(gpu=gpu, torch=torch.__version__, triton=triton.__version__, date=date)
        rows.append(rec)
        t, b = rec.get("time_s"), rec.get("baseline_time_s")
        print(
            f"{rec['name']:28s} {json.dumps(rec['shape'])}  {json.dumps(rec.get('launch', {}))}"
            f"  time {t * 1e6 if t else float('nan'):10.1f} us  baseline {b * 1e6 if b else float('nan'):10.1f} us"
            f"  roofline {rec.get('roofline_s', 0) * 1e6:8.1f} us  err {rec.get('max_rel_err', 0):.2g}"
            f"  {'ok' if rec.get('correct', True) else 'MISMATCH'}",
            flush=True,
        )

    for P, T in cases:
        ok_all &= run_case(P, T, dev, launches, cuda and not args.no_torch, emit)
    for P in args.select if cuda else []:
        run_select(P, dev, emit)
    if args.out:
        write_jsonl(rows, args.out, append=True)
    if not ok_all:
        sys.exit(1)


if __name__ == "__main__":
    main()
