"""Per-kernel device time of the cache write path (which launch of an op is far from its own roofline).

    python benchmarks/profile_write.py                      # on the H200: V4-Flash widths, < 40 s
    python benchmarks/profile_write.py --smoke              # tiny shapes, CPU (interpreter): no device times
    python benchmarks/profile_write.py --ops hca --tune hca: --tune hca:emit_scan=32

For each op (``store_window``, ``csa_main``, ``csa_indexer``, ``hca``, ``hca_online``) in prefill (T = ``--tokens``,
default 65,536, of one request from position 0) and for HCA decode (B = 64), the Triton path built by
``bench_write``'s case builders (same data, same correctness check against the torch reference) is called ``--reps``
times under
``torch.profiler`` (CUDA activity); each kernel's device time is averaged per call and set against the
bytes that kernel must move by the accounting of ``kernel_bytes`` (roofline = bytes / 4.17e12 B/s, the
H200's HBM peak, as in ``bench_write``).  ``--tune`` takes bench_write's syntax (one variant per item).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_write as bw  # noqa: E402  (sets TRITON_INTERPRET=1 without CUDA, before triton is imported)
from profile_decode import kernel_times  # noqa: E402

from dsv4.config import get_preset  # noqa: E402
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat  # noqa: E402

KERNELS = {
    "store_window": ("_norm_rope_fp8_kernel",),
    "csa_main": ("_compressor_pool_kernel", "_compressor_write_kernel", "_norm_rope_fp8_kernel"),
    "csa_indexer": ("_compressor_pool_kernel", "_compressor_write_kernel", "_emit_indexer_kernel"),
    "hca": ("_compressor_pool_kernel", "_compressor_write_kernel", "_norm_rope_fp8_kernel"),
}


def kernel_bytes(op: str, cfg, mode: str, n: int, fused: bool = False, in_pool: bool = False) -> dict[str, int]:
    """Bytes each kernel of ``op`` must move (DRAM, minimum) for bench_write's case of ``n`` tokens.

    store_window: as bench_write.  Compressor prefill (one request from position 0, E = T // m entries):
    pool = read kv + score of every token once (CSA: each half of a row belongs to one entry) + positions +
    slots, write ``emits`` (1 B / token) + pooled (E x d fp32); state write = positions + slots (and the
    look-ahead re-read, from L2: not counted) + the last c*m rows (kv + score) written; emit = read
    ``emits`` + E pooled rows + E positions / slots, write E entries; ``in_pool``: the state write's bytes counted in
    the pool's (``compress_prefill(state_unread=True)``).  Decode (B emitting tokens): the fused
    pool + own-row kernel reads the step's rows and the (c*m - 1) x d pooled state values (kv + score),
    writes the own rows, pooled, emits; emit as above with E = B.  ``fused`` (prefill: ``compress_prefill``'s fused
    emit): one pool + emit kernel reads kv + score, positions and slots, reads E entry slots and writes E entries
    (no ``emits``; the indexer's pooled scratch row is read back by the program that wrote it, from L2: not counted).
    """
    if op == "store_window":
        fmt = FP8EntryFormat(cfg.head_dim, cfg.rope_head_dim)
        per = fmt.head_dim * 2 + 4 + 4 + bw.fp8_written_bytes(fmt) + (fmt.head_dim * 2 if mode == "prefill" else 0)
        return {"_norm_rope_fp8_kernel": n * per}
    ratio, c = (4, 2) if op.startswith("csa") else (128, 1)
    d = cfg.index_head_dim if op == "csa_indexer" else cfg.head_dim
    if op == "csa_indexer":
        entry_w, emit_k = bw.mxfp4_written_bytes(MXFP4KeyFormat(cfg.index_head_dim)), "_emit_indexer_kernel"
    else:
        entry_w, emit_k = bw.fp8_written_bytes(FP8EntryFormat(cfg.head_dim, cfg.rope_head_dim)), "_norm_rope_fp8_kernel"
    kvsc = 4 * 2  # fp32 kv + score
    if mode == "decode":  # one fused launch (compress_decode); the pooled hand-off stays in L2, not counted
        e = n
        dec = n * c * d * kvsc + e * (c * ratio - 1) * d * kvsc + n * c * d * kvsc + n + n * 8 + e * (8 + entry_w)
        kind = "indexer" if op == "csa_indexer" else "main"
        return {f"_compressor_decode_emit_{kind}_kernel": dec}
    e = n // ratio
    pool = n * c * d * kvsc + n * 8 + n + e * d * 4
    write = n * 8 + min(n, c * ratio) * c * d * kvsc
    if fused:
        kind = "indexer" if op == "csa_indexer" else "main"
        fused_k = n * c * d * kvsc + n * 8 + e * (4 + entry_w)
        return {f"_pool_emit_{kind}_kernel": fused_k, "_compressor_write_kernel": write}
    emit = n + e * (d * 4 + 8 + entry_w)
    if in_pool:  # (compress_prefill(state_unread=True): the pool launch writes the state)
        return {"_compressor_pool_kernel": pool + write, emit_k: emit}
    return {"_compressor_pool_kernel": pool, "_compressor_write_kernel": write, emit_k: emit}


def device_times(fn, reps: int) -> dict[str, float]:
    """Average device seconds per call of ``fn`` for each CUDA kernel name (torch.profiler, CUDA activity)."""
    return {name: t for name, (t, _) in kernel_times(fn, reps, cuda=True).items()}


def short(name: str) -> str:
    """The kernel name as ``kernel_bytes`` keys it (the indexer emit's MMA variant counts as the emit, the lanes
    state-write kernel as the state write)."""
    if name.startswith("_emit_indexer"):
        return "_emit_indexer_kernel"
    if name.startswith("_compressor_write_lanes"):
        return "_compressor_write_kernel"
    for ks in KERNELS.values():
        for k in ks + ("_compressor_decode_emit_main_kernel", "_compressor_decode_emit_indexer_kernel"):
            if name.startswith(k):
                return k
    return name[:40]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter): byte accounting only")
    ap.add_argument("--ops", default="store_window,csa_main,csa_indexer,hca", help="comma-separated subset")
    ap.add_argument("--models", default="v4-flash", help="comma-separated presets")
    ap.add_argument("--reps", type=int, default=5, help="profiled calls per case")
    ap.add_argument("--tune", action="append", default=[], metavar="OP:KEY=VAL[,KEY=VAL]", help="as bench_write")
    ap.add_argument("--modes", default="decode,prefill", help="comma-separated subset (decode: HCA at B = 64 only)")
    ap.add_argument("--tokens", type=int, default=65536, help="prefill tokens (one request from position 0)")
    args = ap.parse_args()
    modes = set(args.modes.split(","))
    tune = bw.parse_tune(args.tune)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    t_pre, b_dec = (64, 2) if args.smoke else (args.tokens, 64)
    print(f"device: {torch.cuda.get_device_name() if gpu else 'cpu (triton interpreter: no device times)'}")
    for model in args.models.split(","):
        cfg = get_preset(model)
        for op in args.ops.split(","):
            cases = [("prefill", 130 if args.smoke and op == "hca" else t_pre)] if "prefill" in modes else []
            if op == "hca" and "decode" in modes:
                cases.append(("decode", b_dec))
            for (mode, n), variant in [(c, v) for c in cases for v in tune.get(op, [{}])]:
                gen = torch.Generator().manual_seed(0)
                if op == "store_window":
                    fmt = FP8EntryFormat(cfg.head_dim, cfg.rope_head_dim)
                    tri, _, ok, note, _ = bw.case_store_window(fmt, mode, n, device, gen, variant)
                else:
                    tri, _, ok, note, _ = bw.case_compressor(op, cfg, mode, n, device, gen, variant)
                d = cfg.index_head_dim if op == "csa_indexer" else cfg.head_dim
                rows = 8 if op.startswith("csa") else 128
                fused = mode == "prefill" and bw._fused_prefill(variant.get("fuse_emit"), op == "hca_online", rows, d)
                # (bench_write's prefill is from position 0: the pool writes the state unless state_unread=0)
                in_pool = mode == "prefill" and not fused and op != "hca_online" and int(variant.get("state_unread", 1))
                want = kernel_bytes(op, cfg, mode, n, fused, bool(in_pool))
                if gpu:
                    got = {}
                    for name, s in device_times(tri, args.reps).items():
                        got[short(name)] = got.get(short(name), 0.0) + s
                else:
                    tri()
                    got = {}
                tag = f"{model} {op} {mode} {n}" + (f" tune {variant}" if variant else "")
                total = sum(got.values())
                roof_all = sum(want.values()) / bw.PEAK_HBM_BYTES
                tot = f"{total * 1e6:8.1f} us" if gpu else "     n/a"
                status = "ok" if ok else "MISMATCH"
                print(f"== {tag}: {status} ({note}); device {tot}, roofline {roof_all * 1e6:.1f} us")
                for name in sorted(set(want) | set(got), key=lambda k: -got.get(k, 0.0)):
                    nb = want.get(name)
                    roof = nb / bw.PEAK_HBM_BYTES if nb else None
                    t = got.get(name)
                    t_s = f"{t * 1e6:8.1f} us" if t is not None else "     n/a   "
                    r_s = f"{nb / 1e6:9.2f} MB  roofline {roof * 1e6:7.2f} us" if nb else " " * 34
                    pct = f" ({100 * roof / t:5.1f}%)" if t and roof else ""
                    print(f"   {name:28s} {t_s}  {r_s}{pct}", flush=True)


if __name__ == "__main__":
    main()
