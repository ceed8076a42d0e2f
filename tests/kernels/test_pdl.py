"""Programmatic dependent launch of the cache-write kernels (``dispatch.pdl_launch``, ``_triton_sync.pdl_enter``).

The switch is checked everywhere; the launches themselves need Hopper: there the whole write path (window store,
compressor prefill in order and fused, compressor decode) with PDL must write the bytes it writes without, eagerly
and replayed from a captured CUDA graph.  In order, a prefill's state write loads its rows before it waits for the
pool and its emit runs whole before it waits for the state write (``pdl_late``), so these runs are where a wrong
ordering would show.

Every kernel that takes a ``PDL`` constexpr is also checked statically (its source): a program launched with
``launch_pdl`` must reach ``griddepcontrol.wait`` before it reads what the previous kernel wrote and before it
exits, or it races that kernel (or holds back the next one).
"""

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest
import torch

import dsv4.kernels.dispatch as dispatch
from dsv4.engine.graphs import capture_graph
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat
from dsv4.kernels.cache.compressor import compress_decode, online_state
from dsv4.kernels.cache.compressor_prefill import compress_prefill
from dsv4.kernels.cache.store import store_window

ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}
_ENTERS = {"pdl_enter", "pdl_enter_gl"}  # wait, then release the next kernel (the helpers themselves)


def _pdl_kernels() -> dict[str, ast.FunctionDef]:
    """Every Triton / Gluon function of ``dsv4.kernels`` (kernels and the helpers they hand PDL to; not the wait
    helpers of ``_triton_sync`` / ``_gluon_sync``) with a ``PDL`` parameter: name -> its AST."""
    import dsv4.kernels

    found = {}
    for info in pkgutil.walk_packages(dsv4.kernels.__path__, dsv4.kernels.__name__ + "."):
        if info.name.endswith(("._triton_sync", "._gluon_sync")):  # the wait helpers themselves
            continue
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            fn = getattr(obj, "fn", None)  # JITFunction / GluonJITFunction wrap the Python function
            if not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
                continue
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
            if "PDL" in [a.arg for a in tree.args.args]:
                found[fn.__name__] = tree
    return found


def _call_name(node: ast.AST) -> str | None:
    return node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else None


def _passes_pdl(call: ast.Call) -> bool:
    return any(isinstance(a, ast.Name) and a.id == "PDL" for a in call.args) or any(
        isinstance(k.value, ast.Name) and k.value.id == "PDL" for k in call.keywords
    )


def _why_not_entered(name: str, kernels: dict, seen: frozenset = frozenset()) -> str | None:
    """None when every program of ``name`` reaches the PDL wait on every path, else why not: its first statement
    (after the docstring) enters -- ``pdl_enter``, or ``pdl_start`` paired with a final ``pdl_end``, or a call
    handing PDL to a function that enters -- or, with no ``return`` anywhere, an unconditional statement of its body
    does."""
    tree = kernels[name]
    body = [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    returns = any(isinstance(n, ast.Return) for n in ast.walk(tree))

    def enters(stmt: ast.stmt) -> bool:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        callee = _call_name(call)
        if callee is None or not _passes_pdl(call):
            return False
        if callee in _ENTERS:
            return True
        if callee == "pdl_start":  # (enters here, or at the pdl_end that must then close the body)
            return _call_name(getattr(body[-1], "value", None)) == "pdl_end" and not returns
        return callee in kernels and callee not in seen and _why_not_entered(callee, kernels, seen | {name}) is None

    if body and enters(body[0]):
        return None
    if not returns and any(enters(s) for s in body):
        return None
    return "no unconditional PDL wait on every path (first statement, or a body without returns)"


def test_every_kernel_with_pdl_waits_for_the_previous_kernel_on_every_path():
    kernels = _pdl_kernels()
    assert len(kernels) >= 40, sorted(kernels)  # the scan found the kernels (47 in 2026-12)
    bad = {n: why for n in kernels if (why := _why_not_entered(n, kernels))}
    assert not bad, bad


def test_the_pdl_check_catches_a_kernel_that_never_waits():
    src = (
        "def k(x_ptr, PDL):\n    if tl.program_id(0) > 0:\n        return\n    pdl_enter(PDL)\n    tl.store(x_ptr, 1)\n"
    )
    ok = "def k(x_ptr, PDL):\n    pdl_enter(PDL)\n    if tl.program_id(0) > 0:\n        return\n"
    late = "def k(x_ptr, PDL, LATE):\n    pdl_start(PDL, LATE)\n    tl.store(x_ptr, 1)\n    pdl_end(PDL, LATE)\n"
    late_bad = "def k(x_ptr, PDL, LATE):\n    pdl_start(PDL, LATE)\n    tl.store(x_ptr, 1)\n"
    for text, want in ((src, False), (ok, True), (late, True), (late_bad, False)):
        kernels = {"k": ast.parse(text).body[0]}
        assert (_why_not_entered("k", kernels) is None) == want, text


def test_pdl_launch_switch(monkeypatch):
    """Off by default; DSV4_PDL=1 / 0 overrides ``dispatch.PDL``; only CUDA devices of compute capability >= 9 outside
    the interpreter get the launch keywords."""
    monkeypatch.setattr(dispatch, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(dispatch, "sm_major", lambda device: 9)
    monkeypatch.delenv("DSV4_PDL", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(dispatch, "PDL", False)
    assert dispatch.pdl_launch(cuda) == OFF
    monkeypatch.setenv("DSV4_PDL", "1")
    assert dispatch.pdl_launch(cuda) == ON and dispatch.pdl_launch(cpu) == OFF
    monkeypatch.setattr(dispatch, "sm_major", lambda device: 8)
    assert dispatch.pdl_launch(cuda) == OFF
    monkeypatch.setattr(dispatch, "sm_major", lambda device: 9)
    monkeypatch.setattr(dispatch, "interpreter_enabled", lambda: True)
    assert dispatch.pdl_launch(cuda) == OFF
    monkeypatch.setattr(dispatch, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(dispatch, "PDL", True)
    monkeypatch.setenv("DSV4_PDL", "0")
    assert dispatch.pdl_launch(cuda) == OFF
    monkeypatch.setenv("DSV4_PDL", "")
    assert dispatch.pdl_launch(cuda) == ON
    # a scope answers instead of PDL, nested scopes restore the outer one, the environment overrides every scope
    with dispatch.pdl_scope(False):
        assert dispatch.pdl_launch(cuda) == OFF
        with dispatch.pdl_scope(True):
            assert dispatch.pdl_launch(cuda) == ON and dispatch.pdl_launch(cpu) == OFF
        assert dispatch.pdl_launch(cuda) == OFF
        monkeypatch.setenv("DSV4_PDL", "1")
        assert dispatch.pdl_launch(cuda) == ON
        monkeypatch.setenv("DSV4_PDL", "")
    monkeypatch.setattr(dispatch, "PDL", False)
    with dispatch.pdl_scope(True):
        assert dispatch.pdl_launch(cuda) == ON
        monkeypatch.setenv("DSV4_PDL", "0")
        assert dispatch.pdl_launch(cuda) == OFF
    assert dispatch._PDL_SCOPE.get() is None


@pytest.mark.parametrize("pdl_decode", [True, False])
def test_a_layer_launches_its_decode_steps_in_a_pdl_scope(monkeypatch, pdl_decode):
    """``AttentionSubBlock`` runs a decode step's kernels inside ``pdl_scope(True)`` (when ``dispatch.PDL_DECODE``) and
    a prefill chunk's outside any scope (``dispatch.PDL`` decides)."""
    from dsv4.cache import KVCacheManager
    from dsv4.config import get_preset
    from dsv4.model.attention import AttentionSubBlock
    from dsv4.model.weights import random_attention_weights

    cfg, layer = get_preset("tiny"), 1
    monkeypatch.setattr(dispatch, "PDL_DECODE", pdl_decode)
    blk = AttentionSubBlock(cfg, layer, random_attention_weights(cfg, layer, seed=1), backend="torch")
    seen = []
    inner = AttentionSubBlock._forward
    monkeypatch.setattr(
        AttentionSubBlock, "_forward", lambda self, x, h: seen.append(dispatch._PDL_SCOPE.get()) or inner(self, x, h)
    )
    m = KVCacheManager(cfg, max_requests=2, num_pages=8, block_tokens=256)
    m.add(0), m.add(1)
    x = torch.randn(40, cfg.dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for sched in ({0: 30, 1: 10}, {0: 1, 1: 1}, {0: 1, 1: 3}):
        plan = m.plan(sched)
        blk(x[: plan.num_tokens], m.acquire(layer, plan))
        m.commit(plan)
    assert seen == [None, True if pdl_decode else None, None]
    assert dispatch._PDL_SCOPE.get() is None


def _write_path(dev: torch.device):
    """A function that runs one prefill of every write op (window store; CSA main, CSA indexer, HCA, HCA online
    compressors, in order; CSA main and indexer fused) and one decode step of the CSA main and HCA online compressors
    over fresh buffers, and returns every buffer it wrote."""
    g = torch.Generator().manual_seed(17)
    f8, f4 = FP8EntryFormat(), MXFP4KeyFormat()
    inv = (1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))).to(dev)
    t = 300
    pos = torch.arange(t, dtype=torch.int32, device=dev)
    zero = torch.zeros(t, dtype=torch.int32, device=dev)
    rnd = {}

    def rand(name, *shape):
        if name not in rnd:
            rnd[name] = torch.randn(*shape, generator=g).to(dev)
        return rnd[name]

    def run():
        out = []
        x = rand("x", t, 512).to(torch.bfloat16)
        flat = torch.zeros(f8.page_bytes(128) * 3, dtype=torch.uint8, device=dev)
        store_window(
            x, rand("w", 512).abs() + 0.5, 1e-6, pos, inv, pos % 384, f8.entry_pages(flat, 3, 128), f8, backend="triton"
        )
        out.append(flat)
        csa_main, csa_indexer = ("main", 4, True, f8, 512), ("indexer", 4, True, f4, 128)
        for (kind, ratio, overlap, fmt, d), fuse in (
            (csa_main, False), (csa_indexer, False), (("main", 128, False, f8, 512), False), (csa_main, True),
            (csa_indexer, True), (("online", 128, False, f8, 512), False),
        ):  # fmt: skip
            c = 2 if overlap else 1
            kv, sc = rand(f"kv{d}{c}", t, c * d), rand(f"sc{d}{c}", t, c * d)
            n_pages = t // ratio // 4 + 1
            flat = torch.zeros(fmt.page_bytes(4) * n_pages, dtype=torch.uint8, device=dev)
            pages = fmt.entry_pages(flat, n_pages, 4) if fmt is f8 else fmt.key_pages(flat, n_pages, 4)
            eslot = torch.where((pos + 1) % ratio == 0, pos // ratio, -1).to(torch.int32)
            if kind == "online":
                ks, ss, sp = online_state(1, d, dev)
            else:
                ks, ss, sp = torch.zeros(1, c * ratio, c * d, device=dev), None, None
                ss = torch.full_like(ks, float("-inf"))
            compress_prefill(
                kv, sc, pos, zero, ks, ss, ratio, overlap, rand(f"w{d}", d).abs() + 0.5, 1e-6, inv, eslot, pages,
                fmt, "indexer" if fmt is f4 else "main", "triton", state_pos=sp, fuse_emit=fuse,
            )  # fmt: skip
            out += [flat, ks, ss] + ([sp] if sp is not None else [])
            if kind == "main" and ratio == 4 and not fuse:  # four decode steps after it, the last one emits
                cnt = torch.zeros(1, dtype=torch.int32, device=dev)
                for p in range(t, t + 4):
                    compress_decode(
                        rand(f"kv1{p}", 1, c * d), rand(f"sc1{p}", 1, c * d), pos[:1] + p, zero[:1], ks, ss, cnt,
                        ratio, overlap, rand(f"w{d}", d).abs() + 0.5, 1e-6, inv, pos[:1] + p // ratio, pages, fmt,
                        "main", "triton",
                    )  # fmt: skip
        return out

    return run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs sm_90")
def test_write_path_with_pdl_writes_the_same_bytes_eagerly_and_from_a_graph(monkeypatch):
    dev = torch.device("cuda")
    monkeypatch.setenv("DSV4_PDL", "0")
    want = [x.clone() for x in _write_path(dev)()]
    monkeypatch.setenv("DSV4_PDL", "1")
    run = _write_path(dev)
    got = run()
    torch.cuda.synchronize()
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    graph, static = capture_graph(run)  # (the buffers are made inside: each replay starts from fresh ones)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(static, want, strict=True))
