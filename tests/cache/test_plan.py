"""StepPlan: every field of a built plan against a per-token reference; the packed host -> device transfer of a
plan's int32 fields; the per-plan memo."""

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


def reference_plan_fields(m: KVCacheManager, items, pad: int = 0, widths=None) -> dict:
    """What ``m.plan(items, pad_batch_to=len(items) + pad, max_blocks=widths)`` must hold, one token at a time from
    the manager's state right after that call (pages allocated, lengths not yet advanced): the readable definition
    of every field that ``KVCacheManager._build_plan`` computes with array operations."""
    rows = [(m._requests[rid].num_tokens, n, m._requests[rid].slot, m._requests[rid].blocks) for rid, n in items]
    rows += [(0, 1, -1, None)] * pad
    ring = m.schema.ring_size
    f = {"positions": [], "request_ids": [], "token_slots": [], "swa_slots": [], "query_start": [0]}
    for b, (start, n, slot, _) in enumerate(rows):
        for pos in range(start, start + n):
            f["positions"].append(pos)
            f["request_ids"].append(b)
            f["token_slots"].append(slot)
            f["swa_slots"].append(slot * ring + pos % ring if slot >= 0 and pos >= start + n - ring else -1)
        f["query_start"].append(f["query_start"][-1] + n)
    f["request_slots"] = [slot for _, _, slot, _ in rows]
    f["seq_lens"] = [start + n for start, n, _, _ in rows]
    for ratio, pool in m.pools.items():
        per_page = pool.ratio_class.entries_per_page
        held = [len(blocks[ratio]) if blocks else 0 for *_, blocks in rows]
        width = widths[ratio] if widths else max(1, *held)
        table = [
            (list(blocks[ratio]) if blocks else []) + [-1] * (width - h)
            for (*_, blocks), h in zip(rows, held, strict=True)
        ]
        f[f"{ratio}.block_table"] = table
        f[f"{ratio}.block_lens"] = held
        f[f"{ratio}.num_entries"] = [(start + n) // ratio if slot >= 0 else 0 for start, n, slot, _ in rows]
        f[f"{ratio}.n_visible"], f[f"{ratio}.emit_slots"] = [], []
        for b, pos in zip(f["request_ids"], f["positions"], strict=True):
            real = rows[b][2] >= 0
            f[f"{ratio}.n_visible"].append((pos + 1) // ratio if real else 0)
            entry = pos // ratio
            page = table[b][min(entry // per_page, width - 1)]
            emits = real and (pos + 1) % ratio == 0 and page >= 0
            f[f"{ratio}.emit_slots"].append(page * per_page + entry % per_page if emits else -1)
        f[f"{ratio}.max_entries"] = width * per_page if widths else max(f[f"{ratio}.num_entries"])
    return f


def assert_plan_matches_reference(m: KVCacheManager, plan, items, pad: int = 0, widths=None) -> None:
    want = reference_plan_fields(m, items, pad, widths)
    got = {k: getattr(plan, k) for k in ("positions", "request_ids", "token_slots", "swa_slots", "query_start")}
    got.update(request_slots=plan.request_slots, seq_lens=plan.seq_lens)
    for ratio, rp in plan.ratios.items():
        for k in ("block_table", "block_lens", "num_entries", "n_visible", "emit_slots"):
            got[f"{ratio}.{k}"] = getattr(rp, k)
        got[f"{ratio}.max_entries"] = rp.max_entries
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, int):
            assert got[k] == v, k
        else:
            assert got[k].dtype == torch.int32 and torch.equal(
                got[k], torch.tensor(v, dtype=torch.int32).view(got[k].shape)
            ), k
    n = len(items)
    assert plan.slot_ids == tuple(want["request_slots"][:n])
    assert plan.num_new_tokens == tuple(c for _, c in items)
    assert plan.context_lens == tuple(s - c for s, (_, c) in zip(want["seq_lens"][:n], items, strict=True))


@pytest.mark.parametrize("online", [True, False])
def test_plan_fields_equal_the_per_token_reference(online):
    """Prefill chunks not aligned to entries or pages, mixed prefill + decode, decode padded for a graph bucket with
    fixed table widths (one wider than the manager's host mirror), a forked request sharing pages, a cancelled step
    replanned, a request freed mid-way."""
    rng = np.random.default_rng(3)
    m = KVCacheManager(TINY, max_requests=5, num_pages=64, block_tokens=128, online_state=online)
    for rid in range(4):
        m.add(rid)
    steps = [
        ([(0, 300), (1, 7), (2, 129)], 0, None),
        ([(0, 1), (1, 250), (2, 1), (3, 4)], 0, None),
        ([(0, 1), (1, 1), (9, 1), (3, 1)], 3, {4: 8, 128: 4}),
        ([(0, 1), (1, 1), (9, 1), (3, 1)], 1, {4: 40, 128: 40}),  # wider than the host mirror's columns
        ([(3, 517), (1, 1)], 0, None),
        ([(1, 2000), (0, 1)], 0, None),  # request 1 past the host mirror's first 16 columns: the mirror grows
    ]
    for i, (items, pad, widths) in enumerate(steps):
        plan = m.plan(items, pad_batch_to=len(items) + pad if pad else None, max_blocks=widths)
        assert_plan_matches_reference(m, plan, items, pad, widths)
        if i == 1:  # cancelled, then planned again over the pages it kept
            m.cancel(plan)
            plan = m.plan(items)
            assert_plan_matches_reference(m, plan, items)
        m.commit(plan)
        if i == 1:
            assert m.fork(0, 9, share=True)
            m.free(2)
    for _ in range(20):  # random decode / short-chunk steps over the live requests
        live = [r for r in (0, 1, 3, 9) if r in m]
        items = [(r, int(rng.choice([1, 1, 1, 2, 3, 5, 64]))) for r in live if rng.random() < 0.8] or [(live[0], 1)]
        plan = m.plan(items)
        if plan is None:
            break
        assert_plan_matches_reference(m, plan, items)
        m.commit(plan)
    m.check_invariants()


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
