"""Compile the Triton kernels an operation launches for sm_90 on a machine without a GPU, and report what
ptxas made of each: registers, spill / local-memory bytes, shared memory, SASS instruction mix.

    python benchmarks/sass_report.py csa_indexer:prefill:8192           # any bench_write op:mode:n
    python benchmarks/sass_report.py hca:decode:64 --sass /tmp/sass      # also write each kernel's SASS
    python benchmarks/sass_report.py attention:v4-pro:64 --tune attention:dense=gluon   # decode attention
    python benchmarks/sass_report.py topk:4:262144                      # top-k's kernels (k = 1,024)
    python benchmarks/sass_report.py linear:1:1                         # compressor projections, 1 token, GEMV
    python benchmarks/sass_report.py iquery:65536:0 rope_inv:65536:1    # indexer query tail, inverse RoPE in place
    python benchmarks/sass_report.py prefill_idx:4096:16384             # prefill indexer: fold_keys + prefill_scores
    python benchmarks/sass_report.py fp8_linear:1:all --model v4-pro    # the projections on FP8 weights, 1 token
    python benchmarks/sass_report.py attention:v4-pro:64 --loops        # + each kernel's innermost loops' mix
    python benchmarks/sass_report.py --loops-of DIR/KERNEL.sass         # the loops of a SASS file --sass wrote

The operation is built by ``bench_write``'s case builders on CPU tensors; every Triton launch is replaced by
a compile-only ``warmup`` against a stand-in driver that reports an H100/H200 (``GPUTarget("cuda", 90, 32)``),
so nothing runs and the results of the call are meaningless; only the compiled binaries are kept.  The
figures are ptxas's (``cuobjdump -res-usage``) and the instruction counts are static (SASS lines of the
binary, not executed instructions).  Use it to see register pressure, spills and libdevice calls before
spending device time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"  # before bench_write, which turns the interpreter on without CUDA

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver as _driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _StandInDriver:
    """Just enough of a Triton driver for ``JITFunction.run(warmup=True)``: one sm_90 device, stream 0."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


COMPILED: list = []


def _install(pdl: bool = False) -> None:
    """Stand-in driver, every launch a compile-only warmup, and the dsv4 dispatch forced onto Triton (``pdl``: and
    onto programmatic dependent launch, which ``dispatch.pdl_launch`` gives CUDA tensors only)."""
    _driver.set_active(_StandInDriver())
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        k = run(self, *args, grid=grid, warmup=True, **kwargs)
        if k is not None and all(k is not c for _, c in COMPILED):
            COMPILED.append((self.fn.__name__, k))
        return k

    JITFunction.run = compile_only
    import dsv4.kernels.dispatch as dispatch

    orig = dispatch.use_triton

    def forced(backend, *tensors, has_kernel=True):
        if backend == "torch":
            return orig(backend, *tensors, has_kernel=has_kernel)
        return has_kernel

    dispatch.use_triton = forced
    import dsv4.kernels.attention.sparse_attention  # noqa: F401 (the package attribute is the function of that name)

    attn = sys.modules["dsv4.kernels.attention.sparse_attention"]
    attn.gluon_dense_supported = lambda q, head_dim: True  # CPU tensors: compile the sm_90 Gluon kernel anyway
    orig_pdl = dispatch.pdl_launch
    if pdl:
        dispatch.pdl_launch = lambda device: {"PDL": True, "launch_pdl": True}
    for mod in list(sys.modules.values()):  # modules that imported the names before the patch
        if getattr(mod, "__name__", "").startswith("dsv4") and getattr(mod, "use_triton", None) is orig:
            mod.use_triton = forced
        if getattr(mod, "__name__", "").startswith("dsv4") and getattr(mod, "pdl_launch", None) is orig_pdl:
            mod.pdl_launch = dispatch.pdl_launch


def res_usage(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out.stdout)
    return f"regs {m[1]:>3}  stack {m[2]:>4} B  shared {m[3]:>6} B  local {m[4]:>4} B" if m else out.stdout.strip()


def sass_of(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout


def sass_lines_of(cubin: bytes) -> str:
    """The SASS annotated with the Python source line of each instruction (``nvdisasm -gi``: inlined frames too)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        cmd = [os.path.join(BIN, "nvdisasm"), "-gi", "-c", f.name]
        return subprocess.run(cmd, capture_output=True, text=True).stdout


_OPCODE = re.compile(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")  # an instruction's text -> its opcode, less modifiers


def _opcode(text: str) -> str | None:
    m = _OPCODE.match(text)
    return m[1] if m else None


def mix(sass: str, top: int = 12) -> str:
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*)", line)
        op = _opcode(m[1]) if m else None
        if op:
            ops[op] += 1
    total = sum(ops.values())
    return f"{total} instructions: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(top))


_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def loops(sass: str, top: int = 10, min_len: int = 8) -> list[str]:
    """The innermost loops of one kernel's SASS, one line each: address range, static instructions per iteration,
    local-memory traffic (LDL / STL: spills) and the opcode mix.  A loop is a backward branch over at least
    ``min_len`` instructions (an mbarrier's try-wait spin is shorter) that contains no other such loop (the wait
    stubs after a warp-specialised kernel's code branch back across whole partitions) and no ``EXIT``."""
    ins = [(int(m[1], 16), m[2]) for m in map(_INSTR.match, sass.splitlines()) if m]
    at = {a: i for i, (a, _) in enumerate(ins)}
    spans = []
    for i, (_, text) in enumerate(ins):
        m = re.search(r"\bBRA\s+(?:`\(\S+\)\s*)?(0x[0-9a-f]+)", text)
        lo = at.get(int(m[1], 16)) if m else None
        if lo is not None and lo < i and i - lo + 1 >= min_len:
            spans.append((lo, i))
    out = []
    for lo, hi in spans:
        ops = collections.Counter(_opcode(t) for _, t in ins[lo : hi + 1])
        if ops["EXIT"] or any(lo <= lo2 and hi2 <= hi and (lo2, hi2) != (lo, hi) for lo2, hi2 in spans):
            continue
        spill = ops["LDL"] + ops["STL"]
        mixed = ", ".join(f"{k} {v}" for k, v in ops.most_common(top))
        out.append(f"loop {ins[lo][0]:#x}-{ins[hi][0]:#x}: {hi - lo + 1} instructions, LDL+STL {spill}: {mixed}")
    return out


def wgmma_waits(sass: str) -> str:
    """``wgmma N, waits M`` for a kernel with Hopper warpgroup MMAs: when ptxas serialises them (its C7512 / C7514
    notes) every HGMMA is followed by its own ``WARPGROUP.DEPBAR`` wait, so M approaches N."""
    n = len(re.findall(r"\b[HQ]GMMA\.", sass))
    waits = len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    return f"; wgmma {n}, waits {waits}" if n else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "cases",
        nargs="*",
        help="bench_write op:mode:n (csa_indexer:prefill:8192, hca:decode:64), indexer:B:entries or attention:MODEL:B",
    )
    ap.add_argument("--model", default="v4-flash")
    ap.add_argument("--tune", action="append", default=[], metavar="OP:KEY=VAL[,KEY=VAL]", help="as bench_write")
    ap.add_argument("--sass", help="write each kernel's SASS (also with source lines) and PTX into this folder")
    ap.add_argument("--pdl", action="store_true", help="compile with PDL where dispatch.pdl_launch applies")
    ap.add_argument("--loops", action="store_true", help="also print each kernel's innermost loops (static mix)")
    ap.add_argument("--loops-of", metavar="SASS", help="only print the innermost loops of a saved .sass file")
    args = ap.parse_args()
    if args.loops_of:
        with open(args.loops_of) as f:
            print("\n".join(loops(f.read())) or "no loops")
        return
    if not args.cases:
        ap.error("expected at least one case (or --loops-of)")
    _install(args.pdl)
    import bench_write as bw
    from bench_indexer import make_problem

    from dsv4.config import get_preset
    from dsv4.formats import FP8EntryFormat
    from dsv4.kernels.indexer import indexer_scores

    cfg = get_preset(args.model)
    tune = bw.parse_tune(args.tune)
    for case in args.cases:
        op, mode, n = case.split(":")
        for variant in tune.get(op, [{}]):
            COMPILED.clear()
            gen = torch.Generator().manual_seed(0)
            if op == "attention":  # attention:MODEL:B (decode step: 128 window + top-k entries, bench_attention)
                from bench_attention import make_case

                from dsv4.kernels.attention import sparse_attention_triton

                mc = get_preset(mode)
                cpu = torch.device("cpu")
                q, caches, sink = make_case(int(n), mc.n_heads, mc.window_size, 4096, mc.index_topk, cpu)

                def tri(q=q, caches=caches, sink=sink, kw=variant):
                    sparse_attention_triton(q, caches, sink, 0.0625, **kw)
            elif op.startswith("indexer_gluon"):  # indexer_gluon[_fold[_hsum]][_p1|_p2]:B:entries, the Gluon kernel
                from dsv4.kernels.indexer._gluon_scores import launch_gluon_scores

                keys, bt, q, w, tr, nv = make_problem(int(mode), int(n), 64, 64, torch.device("cpu"), gen)

                fold, producers = "_fold" in op, {"_p1": 1, "_p2": 2}.get(op[-3:])  # None: the default
                hs = "_hsum" in op

                def tri(keys=keys, bt=bt, q=q, w=w, tr=tr, nv=nv, n=int(n), fold=fold, producers=producers, kw=variant,
                        hs=hs):  # fmt: skip
                    launch_gluon_scores(q, w, keys, bt, tr, nv, n, fold=fold, producers=producers, hsum=hs, **kw)
            elif op == "indexer":  # indexer:B:entries (MXFP4 scores, 64 heads, the bench_indexer problem)
                keys, bt, q, w, tr, nv = make_problem(int(mode), int(n), 64, 64, torch.device("cpu"), gen)

                def tri(keys=keys, bt=bt, q=q, w=w, tr=tr, nv=nv, n=int(n), kw=variant):
                    indexer_scores(q, w, keys, bt, tr, nv, n, "triton", **kw)
            elif op == "prefill_idx":  # prefill_idx:T:cols (fold_keys + prefill_scores: T rows of one request)
                from dsv4.kernels.indexer.prefill import fold_keys, prefill_scores

                keys, bt, q, w, tr, nv = make_problem(1, int(n), 64, 64, torch.device("cpu"), gen)
                qp, wp = q.expand(int(mode), -1, -1).contiguous(), w.expand(int(mode), -1).contiguous()
                nvp = torch.full((int(mode),), int(n), dtype=torch.int32)

                def tri(keys=keys, bt=bt, q=qp, w=wp, nv=nvp, n=int(n), kw=variant):
                    prefill_scores(q, w, fold_keys(keys, bt, 0, n, "triton"), nv, n, "triton", **kw)
            elif op in ("topk", "topk512"):  # topk:rows:n (k = 1,024; topk512: k = 512), n_visible given
                from dsv4.kernels.indexer import topk_indices

                sc = torch.randn(int(mode), int(n), generator=gen)
                nvk = torch.full((int(mode),), int(n), dtype=torch.int32)

                def tri(sc=sc, nvk=nvk, k=512 if op == "topk512" else 1024, kw=variant):
                    kw = dict(kw)  # counters=1: launches A and B as one (the layer's call)
                    cnt = torch.zeros(sc.shape[0], dtype=torch.int32) if int(kw.pop("counters", 0)) else None
                    topk_indices(sc, k, nvk, "triton", counters=cnt, **kw)
            elif op == "linear":  # linear:M:gemv (a CSA layer's four compressor weights, K = 4096, bf16 x, counters)
                from dsv4.kernels.linear import linear_counters, linear_fp32_group

                x = torch.randn(int(mode), 4096, generator=gen).bfloat16()
                ws = [torch.randn(nw, 4096, generator=gen) for nw in (1024, 1024, 256, 256)]

                def tri(x=x, ws=ws, gemv=bool(int(n)), kw=variant):
                    linear_fp32_group(x, ws, "triton", counters=linear_counters("cpu"), gemv=gemv, **kw)
            elif op == "fp8_linear":  # fp8_linear:M:NAME (--model's projection NAME of bench_fp8_linear, or "all")
                from bench_fp8_linear import make_case, projection_shapes

                from dsv4.kernels.fp8_linear import fp8_linear

                shapes = projection_shapes(args.model)
                picked = {k: v for k, v in shapes.items() if n in ("all", k)}
                cases = [(make_case(*shape, int(mode), "cpu")[::2], shape[2]) for shape in picked.values()]

                def tri(cases=cases, kw=variant):
                    cnt = torch.zeros(4096, dtype=torch.int32)
                    kw = dict(kw)
                    rot = int(kw.pop("derotate", 0))  # derotate=1: x's heads de-rotated in the load (wo_a)
                    for (w, x), groups in cases:
                        cs = torch.rand(x.shape[0], cfg.rope_head_dim // 2, 2)
                        kw["derotate"] = (cs, cfg.head_dim) if rot else None
                        fp8_linear(x, w, "triton", groups=groups, counters=cnt, **kw)
            elif op in ("iquery", "rope_inv"):  # iquery:T:0 (indexer query tail), rope_inv:T:in_place
                from bench_rope import make_ops

                which = "indexer_query" if op == "iquery" else "rope_inverse" + ("_inplace" if int(n) else "")
                tri, *_ = make_ops(which, int(mode), gen, torch.device("cpu"), dict(variant))
            elif op == "csa_pair":  # csa_pair:decode:B (compress_decode_csa: a CSA layer's two compressors, one launch)
                from dsv4.formats import MXFP4KeyFormat
                from dsv4.kernels.cache.compressor import compress_decode_csa

                b = int(n)
                pos, slots = torch.arange(b, dtype=torch.int32) * 4 + 3, torch.arange(b, dtype=torch.int32)
                pair = []
                for fmt in (FP8EntryFormat(cfg.head_dim, cfg.rope_head_dim), MXFP4KeyFormat(cfg.index_head_dim)):
                    main = isinstance(fmt, FP8EntryFormat)
                    d = cfg.head_dim if main else cfg.index_head_dim
                    flat = torch.zeros(fmt.page_bytes(64) * b, dtype=torch.uint8)
                    pages = fmt.entry_pages(flat, b, 64) if main else fmt.key_pages(flat, b, 64)
                    st = torch.zeros(b, 8, 2 * d)
                    pair.append(dict(
                        kv=torch.randn(b, 2 * d), score=torch.randn(b, 2 * d), positions=pos, token_slot=slots,
                        kv_state=st, score_state=st.clone(), counters=torch.zeros(b, dtype=torch.int32), ratio=4,
                        overlap=True, norm_weight=torch.ones(d), eps=1e-6, inv_freq=bw.inv_freq_of(cfg.rope_head_dim,
                        "cpu"), slots=slots, pages=pages, fmt=fmt, ape=torch.zeros(4, 2 * d),
                    ))  # fmt: skip

                def tri(pair=pair):
                    compress_decode_csa(*pair, backend="triton")
            elif op == "store_window":
                fmt = FP8EntryFormat(cfg.head_dim, cfg.rope_head_dim)
                tri, *_ = bw.case_store_window(fmt, mode, int(n), torch.device("cpu"), gen, variant)
            else:
                tri, *_ = bw.case_compressor(op, cfg, mode, int(n), torch.device("cpu"), gen, variant)
            tri()
            print(f"== {args.model} {case}" + (f" tune {variant}" if variant else ""))
            seen = collections.Counter()
            for name, k in COMPILED:
                seen[name] += 1
                name = name if seen[name] == 1 else f"{name}.{seen[name]}"  # (one kernel, two specialisations)
                cubin = k.asm["cubin"]
                sass = sass_of(cubin)
                calls = sorted(set(re.findall(r"CALL\.\w+\s+(?:\S+\s+)?`?\(?([\w.$]+)", sass)))
                print(f"   {name:40s} {res_usage(cubin)}  warps {k.metadata.num_warps}")
                print(f"      {mix(sass)}" + (f"; calls {', '.join(calls)}" if calls else "") + wgmma_waits(sass))
                for line in loops(sass) if args.loops else ():
                    print(f"      {line}")
                if args.sass:
                    os.makedirs(args.sass, exist_ok=True)
                    with open(os.path.join(args.sass, f"{name}.sass"), "w") as f:
                        f.write(sass)
                    with open(os.path.join(args.sass, f"{name}.ptx"), "w") as f:  # for ptxas -v (its notes)
                        f.write(k.asm["ptx"])
                    with open(os.path.join(args.sass, f"{name}.ttgir"), "w") as f:  # the layouts and their conversions
                        f.write(k.asm["ttgir"])
                    with open(os.path.join(args.sass, f"{name}.lines.sass"), "w") as f:  # ncu_source_summary --lines
                        f.write(sass_lines_of(cubin))


if __name__ == "__main__":
    main()
