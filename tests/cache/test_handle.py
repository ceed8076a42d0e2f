"""LayerCacheHandle writes through the manager's plan: the right bytes land in the right rows, nothing else moves."""

import pytest
import torch

import dsv4.kernels.cache.compressor_prefill as prefill_module
from dsv4.cache import KVCacheManager
from dsv4.config import get_preset
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat

TINY = get_preset("tiny")
F, K = FP8EntryFormat(), MXFP4KeyFormat()


def _manager(device="cpu"):
    return KVCacheManager(TINY, max_requests=3, num_pages=4, block_tokens=128, device=device)


def _ring_entry(view, slot, row):
    return F.dequantize(view.fp8[slot, row], view.rope[slot, row], view.inv_scale[slot, row])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_write_swa_chunked_prefill_and_decode(backend, device):
    m = _manager(device)
    m.add("a")
    m.add("b")
    g = torch.Generator().manual_seed(0)
    history = {"a": [], "b": []}
    for sched in ({"a": 150, "b": 3}, {"a": 1, "b": 1}, {"b": 130}):
        plan = m.plan(sched)
        kv = torch.randn(plan.num_tokens, 512, generator=g).to(torch.bfloat16).to(device)
        h = m.acquire(0, plan)
        ring_before = h.state.ring.nope.view(torch.uint8).clone()
        h.write_swa(kv, backend=backend)
        rows = 0
        for rid, n in zip(plan.request_keys, plan.num_new_tokens, strict=True):
            history[rid].extend(kv[rows : rows + n].unbind(0))
            rows += n
        m.commit(plan)
        assert not torch.equal(ring_before, h.state.ring.nope.view(torch.uint8))
    view = m.acquire(0, m.plan({"a": 1})).read_swa_view()
    for rid in ("a", "b"):
        slot, hist = m.slot_of(rid), history[rid]
        n = len(hist)
        assert m.num_tokens(rid) == n
        for t in range(max(0, n - 128), n):
            row = t % 128
            assert view.positions[slot, row] == t
            assert torch.equal(_ring_entry(view, slot, row), F.roundtrip(hist[t][None])[0])
        assert view.head[slot] == n % 128
    # the unused slot 2 was never touched
    assert (view.positions[2] == -1).all()


def _check_window(m, history):
    """Field bug (a window tail shorter than the window after an insert): every one of a request's last 128 tokens
    is in its ring, at row t mod 128 with position t and its bytes, and the head is n mod 128."""
    probe = m.plan({next(iter(history)): 1})
    view = m.acquire(0, probe).read_swa_view()
    for rid, hist in history.items():
        slot, n = m.slot_of(rid), len(hist)
        assert m.num_tokens(rid) == n
        for t in range(max(0, n - 128), n):
            assert view.positions[slot, t % 128] == t, (rid, n, t)
            assert torch.equal(_ring_entry(view, slot, t % 128), F.roundtrip(hist[t][None])[0]), (rid, n, t)
        assert view.head[slot] == n % 128
    m.cancel(probe)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_window_holds_the_last_128_tokens_after_every_step(backend, device):
    """Chunks of 1, 127, 128, 129 and 300 tokens (one past, at and short of the window), two requests in mixed
    steps: the window invariant after every commit, not only at the end."""
    m = KVCacheManager(TINY, max_requests=3, num_pages=16, block_tokens=128, device=device)
    m.add("a")
    m.add("b")
    g = torch.Generator().manual_seed(1)
    history = {"a": [], "b": []}
    steps = ({"a": 127, "b": 1}, {"a": 1, "b": 128}, {"a": 129}, {"b": 300}, {"a": 300, "b": 1}, {"a": 1, "b": 127})
    for sched in steps:
        plan = m.plan(sched)
        kv = torch.randn(plan.num_tokens, 512, generator=g).to(torch.bfloat16).to(device)
        m.acquire(0, plan).write_swa(kv, backend=backend)
        rows = 0
        for rid, n in zip(plan.request_keys, plan.num_new_tokens, strict=True):
            history[rid].extend(kv[rows : rows + n].unbind(0))
            rows += n
        m.commit(plan)
        _check_window(m, history)


def test_flush_compression_writes_only_assigned_slots(device):
    m = _manager(device)
    m.add("a")
    plan = m.plan({"a": 70})  # CSA (32 entries/page): 17 entries -> page 0 rows 0..16
    h = m.acquire(1, plan)
    buf_before = h.paged.buffer.clone()
    emit = (plan.positions + 1) % 4 == 0
    tok = torch.nonzero(emit).flatten()
    comp = torch.randn(len(tok), 512, device=device)
    keys = torch.randn(len(tok), 128, device=device)
    h.flush_compression(comp, keys, token_index=tok)
    cv, iv = h.read_classical_view(), h.read_indexer_view()
    page = m.block_ids("a", 4)[0]
    for i in range(len(tok)):
        got = F.dequantize(cv.entries_fp8[page, i], cv.entries_rope[page, i], cv.inv_scale[page, i])
        assert torch.equal(got, F.roundtrip(comp[i : i + 1])[0])
        assert torch.equal(
            K.dequantize(iv.keys_fp4[page, i], iv.scale[page, i]), K.roundtrip(keys[i : i + 1], torch.float32)[0]
        )
    # bytes outside the 17 entries (and their scales) are unchanged
    changed = torch.nonzero(h.paged.buffer != buf_before).flatten()
    rc = m.schema.ratio_classes[4]
    base = page * rc.entry_page_bytes
    in_data = (changed >= base) & (changed < base + 17 * F.data_bytes)
    so = base + F.scale_offset(rc.entries_per_page)
    in_scale = (changed >= so) & (changed < so + 17 * F.scale_stride) & ((changed - so) % F.scale_stride < F.n_tiles)
    kbase = 4 * rc.entry_page_bytes + page * rc.key_page_bytes
    in_keys = (changed >= kbase) & (changed < kbase + 17 * K.data_bytes)
    kso = kbase + K.scale_offset(rc.entries_per_page)
    in_kscale = (changed >= kso) & (changed < kso + 17 * K.n_blocks)
    assert (in_data | in_scale | in_keys | in_kscale).all()


@pytest.mark.parametrize("bad", [-1, 70, 1000])
def test_flush_compression_refuses_a_cpu_token_index_out_of_range(bad):
    """A CPU ``token_index`` outside [0, T) is a ValueError that names it, and nothing is written (it used to be
    torch's IndexError, or for -1 the last token's slot)."""
    m = _manager()
    m.add("a")
    plan = m.plan({"a": 70})
    h = m.acquire(1, plan)
    before = h.paged.buffer.clone()
    tok = torch.tensor([3, 7, bad])
    with pytest.raises(ValueError, match=r"token_index: expected indices of step tokens in \[0, 70\)"):
        h.flush_compression(torch.randn(3, 512), torch.randn(3, 128), token_index=tok)
    assert torch.equal(h.paged.buffer, before)


def test_emit_slots_at_without_a_host_check_skips_bad_indices():
    """The accelerator path of ``_emit_slots_at`` (no host sync): indices outside [0, T), negative ones included,
    give slot -1 (skipped by the stores), the others their token's slot; an empty step gives -1 for all."""
    from dsv4.cache.handle import _emit_slots_at

    emit_slots = torch.tensor([4, -1, -1, 5, -1, -1, -1, 9], dtype=torch.int32)
    got = _emit_slots_at(emit_slots, torch.tensor([3, 7, -1, 8, 100, 0]), check_on_host=False)
    assert got.dtype == emit_slots.dtype
    assert got.tolist() == [5, 9, -1, -1, -1, 4]  # (-1 neither wraps to token 7 nor clamps to token 0)
    assert _emit_slots_at(emit_slots[:0], torch.tensor([0, 2]), check_on_host=False).tolist() == [-1, -1]
    assert _emit_slots_at(emit_slots, torch.tensor([3, 7])).tolist() == [5, 9]  # host-checked, in range
    with pytest.raises(ValueError, match="token_index"):
        _emit_slots_at(emit_slots, torch.tensor([8]))


def test_handle_rejects_bad_input_and_changes_nothing():
    m = _manager()
    m.add("a")
    plan = m.plan({"a": 8})
    swa, csa, hca = m.acquire(0, plan), m.acquire(1, plan), m.acquire(2, plan)
    before = swa.state.ring.nope.view(torch.uint8).clone()
    with pytest.raises(ValueError, match="kv: expected shape"):
        swa.write_swa(torch.zeros(7, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        swa.write_swa(torch.zeros(8, 512))
    with pytest.raises(ValueError, match="device"):
        swa.write_swa(torch.zeros(8, 512, dtype=torch.bfloat16, device="meta"))
    assert torch.equal(before, swa.state.ring.nope.view(torch.uint8))
    with pytest.raises(ValueError, match="SWA-only"):
        swa.flush_compression(torch.zeros(8, 512))
    with pytest.raises(ValueError, match="indexer_keys: required"):
        csa.flush_compression(torch.zeros(8, 512))
    with pytest.raises(ValueError, match="has no indexer"):
        hca.flush_compression(torch.zeros(8, 512), torch.zeros(8, 128))
    with pytest.raises(ValueError, match="one per token"):
        hca.flush_compression(torch.zeros(3, 512))
    with pytest.raises(ValueError, match="device"):
        hca.flush_compression(torch.zeros(8, 512, device="meta"))
    other = _manager()
    other.add("a")
    other_plan = other.plan({"a": 8})  # same epoch number, another manager
    with pytest.raises(ValueError, match="not the outstanding plan"):
        m.acquire(0, other_plan)


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_low_level_compressor_calls_equal_compress(backend, device, fuse, monkeypatch):
    """``update_compressor`` then ``emit_compressed`` (the handle's low-level API) write the state and page bytes
    that ``compress`` writes for a prefill (which runs ``compress_prefill``, in order or, ``fuse``, with its fused
    emit), for both CSA compressors."""
    monkeypatch.setattr(prefill_module, "_FUSE_EMIT", fuse)
    g = torch.Generator().manual_seed(4)
    inputs = {}
    results = []
    for low_level in (False, True):
        m = _manager(device)
        m.add("a")
        plan = m.plan({"a": 21})
        h = m.acquire(1, plan)  # CSA
        for which in ("main", "indexer"):
            st = getattr(h.compressor_state(), which)
            if which not in inputs:
                w = st.kv.shape[-1]
                d = TINY.head_dim if which == "main" else TINY.index_head_dim
                inputs[which] = [
                    x.to(device)
                    for x in (
                        torch.randn(21, w, generator=g),
                        torch.randn(21, w, generator=g),
                        torch.rand(d, generator=g) + 0.5,
                        1.0 / (160000.0 ** (torch.arange(0, TINY.rope_head_dim, 2).float() / TINY.rope_head_dim)),
                    )
                ]
            kv, sc, w, inv = inputs[which]
            if low_level:
                pooled, emits = h.update_compressor(kv, sc, which, backend=backend)
                h.emit_compressed(pooled, emits, w, inv, which, backend=backend)
            else:
                h.compress(kv, sc, w, inv, which, backend=backend)
        c = h.compressor_state()
        results.append((c.main.kv.clone(), c.main.score.clone(), c.indexer.kv.clone(), h.paged.buffer.clone()))
        m.commit(plan)
    for a, b in zip(*results, strict=True):
        if fuse and a.is_cuda and a.dtype == torch.uint8:  # pages: the fused emit's norm sums run on other warps,
            assert (a != b).sum() <= 4  # so a bf16 rounding may rarely differ (tests/kernels/test_compressor_prefill)
        else:
            assert torch.equal(a, b)
    assert results[0][3].any()


def test_compress_promises_an_unread_state_only_where_the_plan_allows(monkeypatch):
    """A prefill ``compress`` passes ``compress_prefill`` ``state_unread`` from the plan's host counts: True for
    requests from position 0 (CSA) and for an HCA chunk from a multiple of 128, False for a CSA chunk continuing a
    request (its first entry pools the previous chunk's rows from the state) and for a plan ``load_`` overwrote."""
    seen = []
    monkeypatch.setattr(prefill_module, "compress_prefill", lambda *a, **kw: seen.append(kw["state_unread"]))
    m = _manager()
    m.add("a")
    m.add("b")
    w, inv = torch.ones(TINY.head_dim), torch.ones(TINY.rope_head_dim // 2)
    for sched, want in (({"a": 128, "b": 5}, {1: True, 2: True}), ({"a": 128, "b": 1}, {1: False, 2: True})):
        plan = m.plan(sched)
        for layer in (1, 2):  # CSA, HCA
            h = m.acquire(layer, plan)
            width = h.compressor_state().main.kv.shape[-1]
            kv = torch.zeros(plan.num_tokens, width)
            h.compress(kv, kv, w, inv)
            assert seen.pop() is want[layer], (sched, layer)
        m.commit(plan)
    plan = m.plan({"a": 3})
    assert not plan.loaded
    plan.load_(plan)
    assert plan.loaded
    h = m.acquire(2, plan)
    kv = torch.zeros(3, h.compressor_state().main.kv.shape[-1])
    h.compress(kv, kv, w, inv)
    assert seen.pop() is False
    m.cancel(plan)


def test_failed_compress_or_flush_changes_no_state_or_page_byte():
    """A prefill ``compress`` whose emit arguments are bad fails before the compressor state moves; a CSA
    ``flush_compression`` whose indexer keys are bad (strided, another device) fails before the entries are stored."""
    m = _manager()
    m.add("a")
    plan = m.plan({"a": 8})
    h = m.acquire(1, plan)  # CSA
    st = h.state.compressor
    g = torch.Generator().manual_seed(3)
    kv, sc = torch.randn(8, st.kv.shape[-1], generator=g), torch.randn(8, st.kv.shape[-1], generator=g)
    inv = torch.rand(TINY.rope_head_dim // 2, generator=g)
    state_before = (st.kv.clone(), st.score.clone())
    pages_before = h.paged.buffer.clone()
    with pytest.raises(ValueError, match="norm_weight"):
        h.compress(kv, sc, torch.ones(7), inv)
    with pytest.raises(ValueError, match="inv_freq"):
        h.compress(kv, sc, torch.ones(TINY.head_dim), inv.double())
    assert torch.equal(st.kv, state_before[0]) and torch.equal(st.score, state_before[1])
    comp = torch.randn(8, TINY.head_dim, generator=g)
    with pytest.raises(ValueError, match="indexer_keys: expected shape"):
        h.flush_compression(comp, torch.randn(TINY.index_head_dim, 8, generator=g).t())
    with pytest.raises(ValueError, match="indexer_keys: expected device"):
        h.flush_compression(comp, torch.zeros(8, TINY.index_head_dim, device="meta"))
    assert torch.equal(h.paged.buffer, pages_before)
    m.cancel(plan)
    m.check_invariants()
