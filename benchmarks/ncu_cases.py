"""One kernel case, called a few times, for Nsight Compute (``ncu``) to profile on the H200.

    ncu -k regex:_mxfp4_scores --launch-skip 2 --launch-count 1 --section SpeedOfLight ... \
        python3 benchmarks/ncu_cases.py indexer
    ncu -k regex:_dense_attn_fwd --launch-skip 2 --launch-count 1 ... python3 benchmarks/ncu_cases.py attention

Cases (the benchmark shapes): ``indexer`` = MXFP4 scores at 1M context (262,144 keys), B = 4, 64 heads
(``bench_indexer.make_problem``); ``attention`` = V4-Pro sparse decode attention, B = 64, 128 window + 1,024
top-k entries (``bench_attention.make_case``) on the gathered path with the Triton dense kernel (not the sm_90
default), ``attention:gluon`` the same with the Gluon dense kernel,
``attention:gluon_fused`` with the fused Gluon kernel;
``write:OP:MODE:N`` = ``bench_write``'s case of a cache write op (e.g. ``write:csa_indexer:prefill:65536``,
``write:hca:decode:64``), its Triton path; ``indexer:IMPL`` = the indexer case with that ``impl``.
``run_h200.sh ncu`` runs the read-path cases with the sections below.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_attention import fused_knobs, make_case  # noqa: E402
from benchmarks.bench_indexer import make_problem  # noqa: E402
from dsv4.config import get_preset  # noqa: E402
from dsv4.kernels.attention import sparse_attention_triton  # noqa: E402
from dsv4.kernels.indexer import indexer_scores  # noqa: E402

CALLS = 4


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "indexer"
    dev = torch.device("cuda")
    if case.startswith("indexer"):
        B, n = 4, 262144
        impl = case.partition(":")[2] or "auto"
        keys, bt, q, w, tr, nv = make_problem(B, n, 64, 64, dev, torch.Generator(device=dev).manual_seed(0))
        for _ in range(CALLS):
            if impl == "gluon_ws":  # the warp-specialised Gluon kernel (indexer_scores_gluon)
                from dsv4.kernels.indexer._gluon_scores import indexer_scores_gluon

                indexer_scores_gluon(q, w, keys, bt, tr, nv, n)
            else:
                indexer_scores(q, w, keys, bt, tr, nv, n, "triton", impl=impl)
    elif case.startswith("write:"):
        import bench_write as bw

        _, op, mode, n = case.split(":")
        tri, _, ok, note, _ = bw.case_compressor(op, get_preset("v4-flash"), mode, int(n), dev, torch.Generator())
        print(f"{case}: {'ok' if ok else 'MISMATCH'} ({note})")
        for _ in range(CALLS):
            tri()
    elif case in ("attention", "attention:gluon", "attention:gluon_fused"):
        # DSV4_FUSED_KNOBS="DEQUANT=2+STAGES=3": sparse_attention.GLUON_FUSED_* for the fused kernel
        SA = sys.modules["dsv4.kernels.attention.sparse_attention"]
        for k, v in fused_knobs(os.environ.get("DSV4_FUSED_KNOBS", "")).items():
            setattr(SA, k, v)
        pro = get_preset("v4-pro")
        q, caches, sink = make_case(64, pro.n_heads, pro.window_size, 4 * pro.index_topk, pro.index_topk, dev)
        for _ in range(CALLS):
            if case == "attention":  # the gathered path with the Triton dense kernel (run_h200.sh ncu's kernels)
                sparse_attention_triton(q, caches, sink, pro.head_dim**-0.5, path="gathered", dense="triton")
            elif case == "attention:gluon":  # the gathered path with the opt-in Gluon dense kernel
                sparse_attention_triton(q, caches, sink, pro.head_dim**-0.5, path="gathered", dense="gluon")
            else:  # the fused Gluon kernel (FP8 entries read directly)
                sparse_attention_triton(q, caches, sink, pro.head_dim**-0.5, path="gluon_fused")
    else:
        expected = "'indexer[:IMPL]', 'attention[:gluon|:gluon_fused]' or 'write:OP:MODE:N'"
        raise SystemExit(f"case: expected {expected}, got {case!r}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
