"""Study: the grouped output projection's copies (``model.projections.project_groups``), einsum vs a strided bmm.

    python benchmarks/study_out_proj.py            # H200: V4-Flash widths, T = 64 and 65,536
    python benchmarks/study_out_proj.py --smoke    # CPU: the two forms agree bit for bit

A 65,536-token prefill layer profile (session 19/20) shows one ``direct_copy`` kernel of ~1.3 ms beside the
projections.  ``torch.einsum("...gc,grc->...gr")`` permutes o [T, g, c] to [g, T, c] for its bmm and the [g, T, r]
result back: on the CPU it copies both.  The alternative writes ``torch.bmm`` of the strided views straight into a
[T, g, r] tensor (its transpose as ``out``), which cuBLAS's strided-batched GEMM can take without copies if PyTorch
passes the strides through.  This script prints, per form, the CUDA kernels of one call (copies included) and its
median time (``triton.testing.do_bench``), and checks the two results are equal.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

G, C, R, H, D = 8, 4096, 1024, 64, 512  # V4-Flash: o_groups, channels a group (H * D / G), o_lora_rank, heads, dim


def einsum_form(o: torch.Tensor, wo_a: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...gc,grc->...gr", o.flatten(-2).unflatten(-1, (G, -1)), wo_a).flatten(-2)


def bmm_form(o: torch.Tensor, wo_a: torch.Tensor) -> torch.Tensor:
    t = o.shape[0]
    out = torch.empty(t, G, R, dtype=o.dtype, device=o.device)
    torch.bmm(o.reshape(t, G, C).transpose(0, 1), wo_a.transpose(1, 2), out=out.transpose(0, 1))
    return out.flatten(-2)


def kernels(fn) -> list[str]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:80] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", default="64,65536")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    g = torch.Generator().manual_seed(0)
    wo_a = (torch.randn(G * R, C, generator=g) * C**-0.5).bfloat16().view(G, R, C).to(dev)
    for t in (4, 3) if args.smoke else [int(x) for x in args.tokens.split(",")]:
        o = torch.randn(t, H, D, generator=g).bfloat16().to(dev)
        a, b = einsum_form(o, wo_a), bmm_form(o, wo_a)
        print(f"T={t}: equal {torch.equal(a, b)}")
        if not cuda:
            continue
        import triton

        for name, fn in (("einsum", einsum_form), ("bmm", bmm_form)):
            ms = triton.testing.do_bench(lambda fn=fn, o=o: fn(o, wo_a), warmup=10, rep=50, return_mode="median")
            print(f"  {name:6s} {ms * 1e3:10.1f} us  kernels {kernels(lambda fn=fn, o=o: fn(o, wo_a))}")


if __name__ == "__main__":
    main()
