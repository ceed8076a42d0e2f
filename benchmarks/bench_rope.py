"""Benchmark of the query-side RoPE kernels (dsv4/kernels/rope.py) against their PyTorch references.

    python benchmarks/bench_rope.py --out FILE.jsonl          # on the H200
    python benchmarks/bench_rope.py --smoke                   # CPU (Triton interpreter): correctness only
    python benchmarks/bench_rope.py --block-h 4 --num-warps 4 # another launch geometry than the default

Ops, at V4-Flash widths (H = 64 query heads, D = 512, rope 64), T in {1, 8, 64, 8192} tokens:
- ``q_norm_rope``: per-head RMSNorm + RoPE of q (``projections.query`` after ``wq_b``); baseline
  ``apply_rope(head_rms_norm(q, eps), positions[:, None], inv_freq)`` in PyTorch;
- ``rope_inverse``: inverse RoPE of the attention output (``projections.output_projection`` before
  ``wo_a``); baseline ``apply_rope(o, positions[:, None], inv_freq, inverse=True)``;
- ``rope_inverse_inplace``: the same with ``in_place=True`` (what the layer runs: only the rope channels read and
  written; checked on a copy, timed rotating the same tensor again each call); same baseline;
- ``indexer_query``: ``kernels.indexer.indexer_query_tail`` at the indexer's widths (Hi = 64, Di = 128; RoPE ->
  Hadamard -> MXFP4 of the query, head weights); baseline its PyTorch reference.

Correctness first, on the same data: bf16 values equal to the reference's, and (token, head) rows with any
difference (the kernel's tolerance, see tests/kernels/test_rope.py: rows whose norm's fp32 sum order rounds
the mean the other way, rare one-step differences on rotated values); ``correct`` = at most 1 % of the rows
(or one row) differ.  Then timings (GPU only; ``--smoke`` skips them):
- ``time_s``: the Triton op in a CUDA graph of ``GRAPH_CALLS`` back-to-back calls, ``graph.replay`` timed
  with ``triton.testing.do_bench`` (median) / GRAPH_CALLS; ``eager_time_s``: do_bench of one eager call;
- ``baseline_graph_time_s`` / ``baseline_time_s``: the same for the reference (it has no host syncs, so
  it captures: the fair comparison is graph against graph, ``speedup``);
- ``launches`` / ``baseline_launches``: GPU kernels of one eager call (torch.profiler's CUDA activity).
Bytes: read T*H*D*2 (q or o) + T*4 (int32 positions) + rd*2 (inv_freq), write T*H*D*2 (in place: T*H*rd*2 each
way); indexer query: read T*Hi*Di*2 + T*Hi*2, write T*Hi*Di*2 + T*Hi*4; ``roofline_s`` = bytes / 4.17e12 (H200 HBM).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.engine.graphs import capture_graph  # noqa: E402
from dsv4.formats import MXFP4KeyFormat  # noqa: E402
from dsv4.kernels.indexer.query import indexer_query_tail, indexer_query_tail_reference  # noqa: E402
from dsv4.kernels.rope import (  # noqa: E402
    q_norm_rope,
    q_norm_rope_reference,
    rope_inverse,
    rope_inverse_reference,
)

PEAK_HBM_BYTES = 4.17e12
GRAPH_CALLS = 20
HEADS, HEAD_DIM, ROPE_DIM, EPS = 64, 512, 64, 1e-6
INDEX_HEADS, INDEX_DIM = 64, 128
TOKENS = (1, 8, 64, 8192)
# smoke: T * H a multiple of 64 so torch's CPU kernels take their vectorised path for every row (their scalar
# tail rounds bf16 rsqrt twice; see tests/kernels/test_rope.py::_padded_reference)
SMOKE_TOKENS = (1, 2)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def graph_time(fn) -> float:
    """Per-call time of ``fn`` replayed from a CUDA graph of GRAPH_CALLS back-to-back calls."""
    g, _ = capture_graph(fn, warmup=3, calls=GRAPH_CALLS)
    g.replay()
    torch.cuda.synchronize()
    return bench(g.replay) / GRAPH_CALLS


def count_kernels(fn) -> int:
    """GPU kernels (and memcpy / memset) of one eager call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def check(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    """(correct, summary): equal values, rows with a difference, the largest difference in bf16 steps."""
    same = got == want
    rows_off = int((~same).any(-1).sum())
    rows = same.shape[0] * same.shape[1]

    def key(x: torch.Tensor) -> torch.Tensor:
        i = x.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    steps = int((key(got) - key(want)).abs().max()) if got.numel() else 0
    ok = rows_off <= max(1, rows // 100)
    return ok, f"equal {same.float().mean().item():.6f}, rows differing {rows_off}/{rows}, max {steps} bf16 steps"


def make_ops(op: str, t: int, g: torch.Generator, device: torch.device, geometry: dict):
    """(Triton call, reference call, bytes, check) of ``op`` on fresh inputs of T = ``t`` tokens; check() compares
    one Triton result with the reference's."""
    pos = torch.randint(0, 1_000_000, (t,), generator=g, dtype=torch.int32).to(device)
    if op == "indexer_query":
        fmt = MXFP4KeyFormat()
        q = torch.randn(t, INDEX_HEADS * INDEX_DIM, generator=g).bfloat16().to(device)
        w = torch.randn(t, INDEX_HEADS, generator=g).bfloat16().to(device)
        inv = _inv_freq(INDEX_DIM // 2, device)
        kw = {k: v for k, v in geometry.items() if k in ("block_h", "num_warps") and v}
        tri = lambda: indexer_query_tail(q, w, pos, inv, fmt, backend="triton", **kw)  # noqa: E731
        ref = lambda: indexer_query_tail_reference(q, w, pos, inv, fmt)  # noqa: E731
        nbytes = t * INDEX_HEADS * (2 * INDEX_DIM * 2 + 2 + 4) + t * 4
        return tri, ref, nbytes, lambda: check(tri()[0], ref()[0])
    inv = _inv_freq(ROPE_DIM, device)
    x = torch.randn(t, HEADS, HEAD_DIM, generator=g).bfloat16().to(device)
    kw = {k: v for k, v in geometry.items() if k in ("block_h", "num_warps")}
    full = 2 * t * HEADS * HEAD_DIM * 2 + t * pos.element_size() + inv.numel() * 4
    if op == "q_norm_rope":
        tri = lambda: q_norm_rope(x, pos, inv, EPS, backend="triton", **kw)  # noqa: E731
        ref = lambda: q_norm_rope_reference(x, pos, inv, EPS)  # noqa: E731
        return tri, ref, full, lambda: check(tri(), ref())
    if op == "rope_inverse":
        tri = lambda: rope_inverse(x, pos, inv, backend="triton", **kw)  # noqa: E731
        ref = lambda: rope_inverse_reference(x, pos, inv)  # noqa: E731
        return tri, ref, full, lambda: check(tri(), ref())
    if op == "rope_inverse_inplace":
        tri = lambda: rope_inverse(x, pos, inv, backend="triton", in_place=True, **kw)  # noqa: E731
        ref = lambda: rope_inverse_reference(x, pos, inv)  # noqa: E731
        nbytes = 2 * t * HEADS * ROPE_DIM * 2 + t * pos.element_size() + inv.numel() * 4
        one = lambda: check(rope_inverse(x.clone(), pos, inv, backend="triton", in_place=True, **kw), ref())  # noqa: E731
        return tri, ref, nbytes, one
    sys.exit(f"unknown op {op!r}")


def _inv_freq(rope_dim: int, device: torch.device) -> torch.Tensor:
    return (1.0 / (160000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))).to(device)


def us(x: float | None) -> str:
    return "      n/a" if x is None else f"{x * 1e6:9.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, correctness only (CPU interpreter friendly)")
    ap.add_argument("--ops", default="q_norm_rope,rope_inverse", help="comma-separated subset")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,8,64,8192)")
    ap.add_argument("--block-h", type=int, default=None, help="heads per program (default: the op's heuristic)")
    ap.add_argument("--num-warps", type=int, default=None, help="warps per program (default: the op's heuristic)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        sys.exit("timings need CUDA; use --smoke on the CPU")
    device = torch.device("cuda" if cuda else "cpu")
    gpu = torch.cuda.get_device_name() if cuda else "cpu (triton interpreter)"
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (SMOKE_TOKENS if args.smoke else TOKENS)
    geometry = {"block_h": args.block_h, "num_warps": args.num_warps}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows = []
    for op in args.ops.split(","):
        for t in tokens:
            g = torch.Generator().manual_seed(t)
            tri, ref, nbytes, one_check = make_ops(op, t, g, device, geometry)
            ok, note = one_check()
            roof = nbytes / PEAK_HBM_BYTES
            t_graph = t_eager = t_ref = t_ref_graph = None
            launches = ref_launches = None
            if cuda:
                t_graph, t_eager = graph_time(tri), bench(tri)
                t_ref_graph, t_ref = graph_time(ref), bench(ref)
                launches, ref_launches = count_kernels(tri), count_kernels(ref)
            rec = {
                "name": f"rope/{op}",
                "gpu": gpu,
                "torch": torch.__version__,
                "triton": triton.__version__,
                "shape": {"T": t, "H": INDEX_HEADS, "D": INDEX_DIM, "rope_dim": INDEX_DIM // 2}
                if op == "indexer_query"
                else {"T": t, "H": HEADS, "D": HEAD_DIM, "rope_dim": ROPE_DIM},
                "geometry": geometry,
                "time_s": t_graph,
                "time_kind": "cuda graph replay / call" if cuda else None,
                "eager_time_s": t_eager,
                "launches": launches,
                "bytes": nbytes,
                "roofline_s": roof,
                "pct_of_roofline": None if t_graph is None else 100.0 * roof / t_graph,
                "baseline": "torch reference (dsv4.model.functional), same graph / eager timing",
                "baseline_time_s": t_ref,
                "baseline_graph_time_s": t_ref_graph,
                "baseline_launches": ref_launches,
                "speedup": None if t_graph is None else t_ref_graph / t_graph,
                "speedup_eager": None if t_eager is None else t_ref / t_eager,
                "correct": ok,
                "check": note,
                "date": date,
            }
            rows.append(rec)
            pct = "" if t_graph is None else f" ({rec['pct_of_roofline']:5.1f}%)"
            print(
                f"{op:20s} T={t:5d}  graph {us(t_graph)} us  eager {us(t_eager)} us  launches {launches}"
                f"  torch graph {us(t_ref_graph)} us  eager {us(t_ref)} us  launches {ref_launches}"
                f"  roofline {roof * 1e6:8.2f} us{pct}  {'ok' if ok else 'MISMATCH'} ({note})",
                flush=True,
            )
    if args.out:
        write_jsonl(rows, args.out, append=True)
    if not all(r["correct"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
