"""StepPlan helpers: the packed host -> device transfer of a plan's int32 fields, and the per-plan memo."""

import numpy as np
import pytest
import torch

from dsv4.cache import KVCacheManager
from dsv4.cache import manager as manager_mod
from dsv4.cache.plan import int32_to_device
from dsv4.config import get_preset
from dsv4.model import attention as attention_mod
from dsv4.model.attention import AttentionSubBlock
from dsv4.model.weights import random_attention_weights

TINY = get_preset("tiny")


def test_packed_transfer_equals_one_tensor_each():
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(-(2**31), 2**31 - 1, size=(5, 3)),
        np.zeros(0, dtype=np.int64),
        rng.integers(-5, 5, size=7),
        np.full((2, 0), 3),
        np.arange(9, dtype=np.int32),
    ]
    packed = int32_to_device(arrays, "cpu", packed=True)
    plain = int32_to_device(arrays, "cpu")
    for a, p, q in zip(arrays, packed, plain, strict=True):
        assert p.dtype == q.dtype == torch.int32 and p.shape == q.shape == a.shape
        assert torch.equal(p, q) and torch.equal(p, torch.as_tensor(a.astype(np.int32)))
        assert p.storage_offset() % 4 == 0  # 16-byte aligned starts in the one buffer
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1


def test_plans_built_from_one_packed_buffer_run_the_same(monkeypatch):
    """A plan whose tensors are views of one buffer (the CUDA form) computes what per-field tensors compute."""
    layer = 1  # CSA
    w = random_attention_weights(TINY, layer, seed=5)
    x = torch.randn(140, TINY.dim, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)

    def run():
        m = KVCacheManager(TINY, max_requests=2, num_pages=4, block_tokens=256, debug=True)
        blk = AttentionSubBlock(TINY, layer, w, backend="torch")
        m.add(0), m.add(1)
        out = []
        for sched in ({0: 70, 1: 60}, {0: 5, 1: 1}, {0: 1, 1: 1}):
            plan = m.plan(sched)
            out.append(blk(x[: plan.num_tokens], m.acquire(layer, plan)))
            m.commit(plan)
        return out, plan

    plain, _ = run()
    monkeypatch.setattr(manager_mod, "int32_to_device", lambda a, d: int32_to_device(a, d, packed=True))
    packed, last = run()
    assert len({t.untyped_storage().data_ptr() for t in last.device_tensors().values()}) == 1
    for a, b in zip(plain, packed, strict=True):
        assert torch.equal(a, b)


def test_memo_once_per_plan_and_key(monkeypatch):
    """Every layer of a prefill step shares one window-workspace index, built once for the plan."""
    m = KVCacheManager(TINY, max_requests=1, num_pages=4, block_tokens=256)
    m.add("a")
    plan = m.plan({"a": 40})
    calls = []
    real = attention_mod.window_workspace_index
    monkeypatch.setattr(attention_mod, "window_workspace_index", lambda p, r: calls.append(r) or real(p, r))
    x = torch.randn(40, TINY.dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for layer in (0, 1, 2):
        blk = AttentionSubBlock(TINY, layer, random_attention_weights(TINY, layer, seed=layer), backend="torch")
        blk(x, m.acquire(layer, plan))
    assert calls == [TINY.window_size]
    assert plan.memo("k", lambda: 1) == 1 and plan.memo("k", lambda: 2) == 1
    with pytest.raises(ZeroDivisionError):
        plan.memo("bad", lambda: 1 / 0)
    assert plan.memo("bad", lambda: 3) == 3  # a failed make stores nothing


def test_forward_memo_once_per_pass(monkeypatch):
    """Layers of one ratio share their visible-entry index within a pass opened by ``begin_forward`` (one launch a
    step, not one a layer), compute it again in the next pass, and compute it every time where no pass is open; the
    outputs are the same bit for bit either way."""
    from dsv4.engine.graphs import decode_stack

    layers = (1, 2, 3)  # CSA, HCA, CSA: at 21 tokens the CSA layers see fewer entries than top-k (16) and attend
    blocks = [  # all they see through visible_physical; the HCA layer sees none yet
        AttentionSubBlock(TINY, i, random_attention_weights(TINY, i, seed=i), backend="torch") for i in layers
    ]
    calls = []
    real = attention_mod.visible_physical
    monkeypatch.setattr(attention_mod, "visible_physical", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    x = torch.randn(22, TINY.dim, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    outs = {}
    for shared in (True, False):
        m = KVCacheManager(TINY, max_requests=1, num_pages=8, block_tokens=256)
        m.add("a")
        plan = m.plan({"a": 21})
        decode_stack(blocks, [m.acquire(i, plan) for i in layers], x[:21])
        m.commit(plan)
        plan = m.plan({"a": 1})
        calls.clear()
        with monkeypatch.context() as mp:
            if not shared:
                mp.setattr(type(plan), "begin_forward", lambda self: None)
            outs[shared] = [decode_stack(blocks, [m.acquire(i, plan) for i in layers], x[21:]) for _ in range(2)]
        assert calls == ([TINY.index_topk] * (2 if shared else 4)), calls  # once a pass / once a CSA layer
        m.commit(plan)
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False], strict=True))

    plan = m.plan({"a": 1})
    assert plan.forward_memo("k", lambda: 1) == 1 and plan.forward_memo("k", lambda: 2) == 2  # no pass: no memo
    plan.begin_forward()
    assert plan.forward_memo("k", lambda: 1) == 1 and plan.forward_memo("k", lambda: 2) == 1
    with pytest.raises(ZeroDivisionError):
        plan.forward_memo("bad", lambda: 1 / 0)
    assert plan.forward_memo("bad", lambda: 3) == 3  # a failed make stores nothing
    plan.begin_forward()
    assert plan.forward_memo("k", lambda: 4) == 4  # a new pass computes again
    m.cancel(plan)
