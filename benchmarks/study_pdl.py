"""What programmatic dependent launch saves a kernel boundary on this GPU: a chain of small dependent kernels in a CUDA
graph, launched plainly and with PDL (``dsv4.kernels._triton_sync.pdl_enter``), and a chain of independent kernels
whose programs work before they wait (``pdl_start`` / ``pdl_end`` with LATE, as a prefill's emit does beside the
state write).

    python3 benchmarks/study_pdl.py --out F.jsonl          # on the H200 (sm_90), < 30 s
    python3 benchmarks/study_pdl.py --smoke                # CPU interpreter: the chains' values only, no PDL

Each kernel adds 1 to a float32 vector of ``n`` values (dependent: reading the previous kernel's output; independent:
its own input and output).  Every chain's result is checked before it is timed.  Time: one replay of the captured
chain (``triton.testing.do_bench``, median), divided by the chain's length; printed as JSON lines (``name``, ``gpu``,
``torch``, ``triton``, ``shape``, ``time_s`` a kernel, ``baseline`` = the same chain without PDL and its
``baseline_time_s``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.kernels._triton_sync import pdl_end, pdl_start  # noqa: E402

BLOCK = 1024


@triton.jit
def _add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr, LATE: tl.constexpr):
    """y = x + 1 over ``n`` values; with PDL, wait for the previous kernel first (or, LATE, after the work)."""
    pdl_start(PDL, LATE)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) + 1.0, mask=m)
    pdl_end(PDL, LATE)


def chain(bufs: list[torch.Tensor], dependent: bool, pdl: bool, late: bool):
    """The function the graph captures: len(bufs) - 1 launches (dependent: bufs[i] -> bufs[i + 1]; independent:
    bufs[0] -> bufs[i + 1])."""
    n = bufs[0].numel()
    kw = {"launch_pdl": True} if pdl else {}

    def run():
        for i in range(len(bufs) - 1):
            src = bufs[i] if dependent else bufs[0]
            _add_one_kernel[(triton.cdiv(n, BLOCK),)](src, bufs[i + 1], n, BLOCK=BLOCK, PDL=pdl, LATE=late, **kw)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--smoke", action="store_true", help="tiny chains on the CPU (values only)")
    ap.add_argument("--length", type=int, default=32, help="kernels a chain")
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    pdl_ok = gpu and torch.cuda.get_device_capability()[0] >= 9
    length = 4 if args.smoke else args.length
    sizes = [4096] if args.smoke else [4096, 262144, 4194304]
    info = {
        "gpu": torch.cuda.get_device_name() if gpu else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rows = []
    for n in sizes:
        for dependent in (True, False):
            variants = [("plain", False, False)]
            if pdl_ok:
                variants.append(("pdl", True, False))
                if not dependent:
                    variants.append(("pdl_late", True, True))
            base = None
            for name, pdl, late in variants:
                bufs = [torch.zeros(n, device=dev)] + [torch.full((n,), -7.0, device=dev) for _ in range(length)]
                run = chain(bufs, dependent, pdl, late)
                run()
                want = torch.arange(1, length + 1, device=dev, dtype=torch.float32) if dependent else None
                got = torch.stack([b[0] for b in bufs[1:]])
                ok = torch.equal(got, want) if dependent else bool((got == 1.0).all())
                t = None
                if gpu:
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    for b in bufs[1:]:
                        b.fill_(-7.0)
                    graph.replay()
                    torch.cuda.synchronize()
                    got = torch.stack([b[0] for b in bufs[1:]])
                    ok = ok and (torch.equal(got, want) if dependent else bool((got == 1.0).all()))
                    t = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e-3 / length
                base = t if name == "plain" else base
                rec = {
                    "name": f"pdl/{'dependent' if dependent else 'independent'}/{name}",
                    **info,
                    "shape": {"n": n, "length": length},
                    "time_s": t,
                    "bytes": 8 * n,
                    "roofline_s": 8 * n / 4.17e12,
                    "baseline": "the same chain launched without PDL",
                    "baseline_time_s": base,
                    "correct": ok,
                }
                rows.append(rec)
                ts = f"{t * 1e6:8.2f} us" if t is not None else "     n/a"
                print(f"{rec['name']:28s} n={n:8d}  {ts} a kernel  {'ok' if ok else 'WRONG'}", flush=True)
    if args.out:
        write_jsonl(rows, args.out, append=True)


if __name__ == "__main__":
    main()
