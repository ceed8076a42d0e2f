"""How many kernels one decode step of a layer launches on the kernel path, and that it reads nothing back.

A decode step at B = 1 is latency-bound: each launch costs a few microseconds of a ~200 us step even inside a CUDA
graph, so the number of launches is a property to keep, like a kernel's bytes.  This counts, under the Triton
interpreter (CPU), one decode step of two requests past top-k (CSA: the indexer runs) after a prefill:

- the Triton kernels launched (the interpreter's launches: one each on the GPU),
- the PyTorch ops that launch a kernel on the GPU (every op but allocations, views and host scalars; the bf16 path's
  cuBLAS GEMMs show as ``mm`` / ``bmm``),
- and no host scalar read (``_local_scalar_dense``: on the GPU a sync, which a CUDA graph cannot hold).

The expected counts are the current design's; a change that adds or removes a launch updates them here, knowingly.
"""

import collections

import pytest
import torch

from dsv4.cache import KVCacheManager
from dsv4.config import get_preset
from dsv4.kernels.dispatch import interpreter_enabled
from dsv4.kernels.indexer import topk as topk_mod
from dsv4.model import attention as attention_mod
from dsv4.model.attention import AttentionSubBlock
from dsv4.model.weights import random_attention_weights

TINY = get_preset("tiny")
LAYERS = {"swa": 0, "csa": 1, "hca": 2}
# ops that launch nothing on the GPU: allocations, views, host scalars / constants
NO_LAUNCH = {
    "empty", "empty_like", "new_empty", "empty_strided", "view", "_unsafe_view", "split", "split_with_sizes", "slice",
    "select", "unsqueeze", "squeeze", "t", "transpose", "expand", "as_strided", "unflatten", "alias", "detach",
    "reshape", "permute", "unbind", "flatten", "narrow", "lift_fresh",
}  # fmt: skip

# (kind, weights, stacked) -> (Triton launches, {torch op: launches})
EXPECTED = {
    ("swa", "bf16", False): (6, {"mm": 4, "bmm": 1}),
    ("swa", "bf16", True): (6, {"mm": 3, "bmm": 1}),
    ("swa", "fp8", False): (11, {}),
    ("swa", "fp8", True): (10, {}),
    ("csa", "bf16", False): (14, {"mm": 6, "bmm": 1}),
    ("csa", "bf16", True): (14, {"mm": 3, "bmm": 1}),
    ("csa", "fp8", False): (21, {}),
    ("csa", "fp8", True): (17, {}),  # the compressors in the x stack (STACK_COMPRESSORS)
    ("hca", "bf16", False): (8, {"mm": 4, "bmm": 1}),
    ("hca", "bf16", True): (8, {"mm": 3, "bmm": 1}),
    ("hca", "fp8", False): (13, {}),
    ("hca", "fp8", True): (11, {}),
}


class _Launches(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the Triton interpreter's launches (``triton``, by kernel) and the PyTorch ops outside them (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        import triton.runtime.interpreter as interp

        self._cls, self._inside = interp.InterpretedFunction, 0
        self.triton: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()

    def __enter__(self):
        real, counter = self._cls.run, self

        def run(fn_self, *a, **k):
            counter.triton[fn_self.fn.__name__] += 1
            counter._inside += 1
            try:
                return real(fn_self, *a, **k)
            finally:
                counter._inside -= 1

        self._real = real
        self._cls.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        self._cls.run = self._real
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self._inside and name not in NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not interpreter_enabled(), reason="counts the Triton interpreter's launches (CPU)")
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_decode_step_launches(monkeypatch, kind, weights, stacked):
    layer = LAYERS[kind]
    monkeypatch.setattr(attention_mod, "STACK_PROJECTIONS", stacked)
    # top-k as on the GPU's shapes (32,768 entries a row at 128K: the filter path, 3 launches), not the one-program
    # kernel that these tiny rows would take
    monkeypatch.setattr(topk_mod, "_SINGLE_MAX_N", 0)
    w = random_attention_weights(TINY, layer, seed=0, fp8=weights == "fp8")
    blk = AttentionSubBlock(TINY, layer, w, backend="triton")
    m = KVCacheManager(TINY, max_requests=2, num_pages=16, block_tokens=256)
    n = 80  # CSA: 20 entries a request, past top-k (16): the indexer runs
    x = torch.randn(2, n + 2, TINY.dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for r in range(2):
        m.add(r)
    plan = m.plan({0: n, 1: n})
    # (the prefill on the torch backend: the same cache contents, without the interpreter's time)
    AttentionSubBlock(TINY, layer, w, backend="torch")(x[:, :n].reshape(2 * n, TINY.dim), m.acquire(layer, plan))
    m.commit(plan)
    for t in (n, n + 1):  # a first decode step (one-time host setup: CPU-only scalar tables), then the counted one
        plan = m.plan({0: 1, 1: 1})
        handle, xd = m.acquire(layer, plan), x[:, t].contiguous()
        with _Launches() as seen:
            y = blk(xd, handle)
        m.commit(plan)
    assert y.shape == (2, TINY.dim) and not torch.isnan(y).any()
    assert "_local_scalar_dense" not in seen.ops, "a host read in the decode step"
    want_triton, want_ops = EXPECTED[(kind, weights, stacked)]
    assert (sum(seen.triton.values()), dict(seen.ops)) == (want_triton, want_ops), dict(seen.triton)


@pytest.mark.skipif(not interpreter_enabled(), reason="counts the Triton interpreter's launches (CPU)")
def test_layers_of_a_pass_share_the_visible_index():
    """In a pass opened by ``plan.begin_forward`` (``decode_stack``, the engine's forward) the second layer of a ratio
    that attends every visible entry (here CSA with fewer entries than top-k; HCA alike) reuses the first one's
    index: one launch fewer, the same output as the layer run alone."""
    layers = (1, 3)
    blocks = [AttentionSubBlock(TINY, i, random_attention_weights(TINY, i, seed=i), backend="triton") for i in layers]
    m = KVCacheManager(TINY, max_requests=2, num_pages=16, block_tokens=256)
    n = 20  # 5 entries a request, fewer than top-k (16)
    x = torch.randn(2, n + 1, TINY.dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for r in range(2):
        m.add(r)
    plan = m.plan({0: n, 1: n})
    for blk, i in zip(blocks, layers, strict=True):  # (the prefill on the torch backend, as above)
        AttentionSubBlock(TINY, i, blk.w, backend="torch")(x[:, :n].reshape(2 * n, TINY.dim), m.acquire(i, plan))
    m.commit(plan)
    plan = m.plan({0: 1, 1: 1})
    xd = x[:, n].contiguous()
    alone = blocks[1](xd, m.acquire(3, plan))  # no pass open: computes its own index
    plan.begin_forward()
    counts = []
    for blk, i in zip(blocks, layers, strict=True):
        with _Launches() as seen:
            y = blk(xd, m.acquire(i, plan))
        counts.append(sum(seen.triton.values()))
    m.cancel(plan)
    assert counts[1] == counts[0] - 1, counts
    assert torch.equal(y, alone)
