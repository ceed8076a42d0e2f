"""DecodeGraphRunner: bucketed, padded decode steps through static plan buffers.

CPU: the ``capture=False`` path (the static plan, handles and input of each bucket, run eagerly) gives
the same rows, bit for bit, as the stack run on unpadded plans, across buckets and many steps that emit
CSA (every 4 tokens) and HCA (every 128 tokens) entries, and leaves the same cache bytes.
GPU: graph replay equals the eager static path bit for bit and does not sync with the host.
"""

import pytest
import torch

from dsv4.cache import KVCacheManager
from dsv4.config import get_preset
from dsv4.engine.graphs import DecodeGraphRunner, decode_stack, pick_bucket
from dsv4.model.attention import AttentionSubBlock
from dsv4.model.weights import random_attention_weights

TINY = get_preset("tiny")
STACK = (0, 1, 2)  # SWA, CSA (m=4), HCA (m=128)
BLOCK = 128  # tokens per page: CSA 32 entries a page, HCA 1
MAX_BLOCKS = {4: 3, 128: 3}


def _blocks(layers, backend, device):
    return [
        AttentionSubBlock(TINY, i, random_attention_weights(TINY, i, seed=11 + i, device=device), backend=backend)
        for i in layers
    ]


def _manager(device, slots=5):
    return KVCacheManager(TINY, max_requests=slots, num_pages=12, block_tokens=BLOCK, debug=True, device=device)


def _prefill(m, blocks, prompts, xs):
    for rid in prompts:
        m.add(rid)
    plan = m.plan(prompts)
    x = torch.cat([xs[rid][:n] for rid, n in prompts.items()])
    decode_stack(blocks, [m.acquire(b.layer_id, plan) for b in blocks], x)
    m.commit(plan)


def _cache_bytes(m):
    st = m.state
    parts = [st._ring_buf, st._pos[:, :-1], st._head[:, :-1], *(x for pair in st._comp.values() for x in pair)]
    parts += [layer.buffer for pool in m.pools.values() for layer in pool.layers.values()]
    return [p.clone() for p in parts]


def _inputs(n_req, n_tok, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {r: torch.randn(n_tok, TINY.dim, generator=g).to(torch.bfloat16).to(device) for r in range(n_req)}


# batches of the decode steps (request ids): sizes 1..4 cross buckets 1, 2, 4; request 1 crosses
# position 127 (an HCA entry) and every request emits CSA entries.
BATCHES = [[0], [0, 1], [2, 0, 1], [1], [0, 1, 2, 3], [3, 2], [1, 3, 0], [0, 1, 2, 3], [1, 2], [1]]
PROMPTS = {0: 9, 1: 124, 2: 40, 3: 3}


def test_static_path_equals_fresh_plans_across_buckets_and_entry_boundaries():
    """Static buffers reloaded each step == a freshly planned step of the same padded shape (bit for bit,
    same cache bytes); and == the unpadded step up to bf16 rounding: a CPU GEMM over 3 rows rounds
    differently from one over 4 (~1 ulp), which the 3-layer residual stack (fp32 h of O(2)) carries on.
    Observed max 0.013, mean 2.5e-3; bounds 0.05 / 6e-3 (a wrong row, position or entry moves the mean
    of a layer's output by > 1e-2)."""
    dev = torch.device("cpu")
    blocks = _blocks(STACK, "torch", dev)
    xs = _inputs(len(PROMPTS), 140, dev)
    ma, mb, mc = _manager(dev), _manager(dev), _manager(dev)
    runner = DecodeGraphRunner(ma, blocks, buckets=(4, 1, 2), max_blocks=MAX_BLOCKS, capture=False)
    runner.capture()
    assert runner.captured and runner.buckets == (1, 2, 4)
    assert ma.outstanding_plan is None and len(ma.request_ids) == 0
    ma.check_invariants()
    for m in (ma, mb, mc):
        _prefill(m, blocks, PROMPTS, xs)
    pos = dict(PROMPTS)
    emitted = {4: 0, 128: 0}
    for batch in BATCHES:
        sched = {r: 1 for r in batch}
        x = torch.stack([xs[r][pos[r]] for r in batch])
        y = runner.step(sched, x)
        plan_a = ma.outstanding_plan
        size = runner.bucket_for(len(batch))
        assert plan_a.batch_size == size and plan_a.num_padded == size - len(batch)
        for m_ in (4, 128):
            emitted[m_] += sum((pos[r] + 1) % m_ == 0 for r in batch)
        y = y.clone()
        ma.commit(plan_a)
        outs = []
        for m, kw in ((mb, {"pad_batch_to": size}), (mc, {})):
            plan = m.plan(sched, max_blocks=MAX_BLOCKS, **kw)
            xp = torch.cat([x, torch.zeros(plan.num_padded, TINY.dim, dtype=x.dtype)])
            outs.append(decode_stack(blocks, [m.acquire(b.layer_id, plan) for b in blocks], xp)[: len(batch)])
            m.commit(plan)
        assert y.shape == (len(batch), TINY.dim)
        assert torch.equal(y, outs[0]), (batch, (y - outs[0]).abs().max().item())
        d = (y - outs[1]).abs()
        assert d.max() <= 0.05 and d.mean() <= 6e-3, (batch, d.max().item(), d.mean().item())
        for r in batch:
            pos[r] += 1
    assert emitted[4] >= 5 and emitted[128] >= 1  # the steps did cross entry boundaries
    for a, b in zip(_cache_bytes(ma), _cache_bytes(mb), strict=True):
        assert torch.equal(a, b)


def test_bucket_selection_and_errors():
    assert pick_bucket((1, 8, 64), 1) == 1
    assert pick_bucket((1, 8, 64), 2) == 8
    assert pick_bucket((1, 8, 64), 8) == 8
    assert pick_bucket((1, 8, 64), 9) == 64
    with pytest.raises(ValueError, match="exceed the largest"):
        pick_bucket((1, 8, 64), 65)
    with pytest.raises(ValueError, match=">= 1"):
        pick_bucket((1, 8), 0)

    dev = torch.device("cpu")
    blocks = _blocks((1,), "torch", dev)
    m = _manager(dev, slots=4)
    runner = DecodeGraphRunner(m, blocks, buckets=(1, 2), max_blocks=MAX_BLOCKS, capture=False)
    with pytest.raises(RuntimeError, match="capture"):
        runner.step({0: 1}, torch.zeros(1, TINY.dim, dtype=torch.bfloat16))
    runner.capture()
    for r in range(3):
        m.add(r)
    x3 = torch.zeros(3, TINY.dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="largest CUDA-graph bucket 2"):
        runner.step({0: 1, 1: 1, 2: 1}, x3)
    assert m.outstanding_plan is None  # nothing planned
    with pytest.raises(ValueError, match="x: expected"):
        runner.step({0: 1}, x3)
    with pytest.raises(ValueError, match="exactly one token"):
        runner.step({0: 2}, x3[:1])
    assert m.outstanding_plan is None
    y = runner.step({2: 1}, x3[:1])
    assert y.shape == (1, TINY.dim) and m.outstanding_plan.batch_size == 1
    with pytest.raises(ValueError, match="capture=True needs a CUDA"):
        DecodeGraphRunner(m, blocks, max_blocks=MAX_BLOCKS, capture=True)
    with pytest.raises(ValueError, match="max_blocks"):
        DecodeGraphRunner(m, blocks, capture=False)
    with pytest.raises(ValueError, match="buckets"):
        DecodeGraphRunner(m, blocks, buckets=(0, 2), max_blocks=MAX_BLOCKS, capture=False)


def test_capture_needs_a_free_slot_and_changes_nothing():
    dev = torch.device("cpu")
    blocks = _blocks(STACK, "torch", dev)
    m = _manager(dev, slots=1)
    m.add("only")
    runner = DecodeGraphRunner(m, blocks, buckets=(1,), max_blocks=MAX_BLOCKS, capture=False)
    with pytest.raises(RuntimeError, match="free request slot"):
        runner.capture()
    m.free("only")
    before = _cache_bytes(m)
    runner.capture()
    m.check_invariants()
    assert m.outstanding_plan is None and not m.request_ids
    runner.static_input(1).normal_()
    runner.replay(1)  # what warm-up and capture run: the all-padded static plan writes nothing
    for a, b in zip(before, _cache_bytes(m), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layer", [0, 1, 2], ids=["swa", "csa", "hca"])
def test_gpu_replay_equals_eager_bit_for_bit_without_host_sync(layer):
    dev = torch.device("cuda")
    blocks = _blocks((layer,), "triton", dev)
    xs = _inputs(len(PROMPTS), 160, dev, seed=layer)
    ma, mb = _manager(dev), _manager(dev)
    graph = DecodeGraphRunner(ma, blocks, buckets=(1, 2, 4), max_blocks=MAX_BLOCKS, capture=True)
    eager = DecodeGraphRunner(mb, blocks, buckets=(1, 2, 4), max_blocks=MAX_BLOCKS, capture=False)
    graph.capture()
    eager.capture()
    for m in (ma, mb):
        _prefill(m, blocks, PROMPTS, xs)
    pos = dict(PROMPTS)
    batches = (BATCHES * 2)[:20]
    for batch in batches:
        x = torch.stack([xs[r][pos[r]] for r in batch])
        sched = {r: 1 for r in batch}
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:  # planning (one pinned non-blocking copy), loading the static plan and the replay: no host wait
            _, size = graph.prepare(sched)
            graph.static_input(size)[: len(batch)].copy_(x)
            graph.static_input(size)[len(batch) :].zero_()
            y = graph.replay(size)[: len(batch)].clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = eager.step(sched, x)
        ma.commit(ma.outstanding_plan)
        mb.commit(mb.outstanding_plan)
        assert torch.equal(y, ref), (layer, batch, (y - ref).abs().max().item())
        for r in batch:
            pos[r] += 1
    for a, b in zip(_cache_bytes(ma), _cache_bytes(mb), strict=True):
        assert torch.equal(a, b)
