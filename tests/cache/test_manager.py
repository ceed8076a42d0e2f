"""KVCacheManager: exact ids and accounting on tiny pools, the step plan, and the field bugs that apply."""

import pytest
import torch

from dsv4.cache import InvariantError, KVCacheManager
from dsv4.config import get_preset

TINY = get_preset("tiny")  # layers: 0 SWA, 1 CSA, 2 HCA, 3 CSA, 4 MTP (SWA); ratios 4 and 128


def make(max_requests=2, pages=4):
    # block 128 tokens: 32 CSA entries per page, 1 HCA entry per page
    return KVCacheManager(TINY, max_requests=max_requests, num_pages=pages, block_tokens=128, debug=True)


mk128 = make


def test_add_allocates_slots_in_order_and_not_now_when_full():
    m = mk128(max_requests=2)
    assert m.add("a") and m.add("b")
    assert (m.slot_of("a"), m.slot_of("b")) == (0, 1)
    assert m.add("c") is False  # "not now"
    assert "c" not in m
    m.check_invariants()
    with pytest.raises(ValueError, match="already added"):
        m.add("a")


def test_plan_allocates_exact_pages_and_builds_tensors():
    m = mk128(max_requests=2, pages=4)  # CSA: 32 entries/page; HCA: 1 entry/page
    m.add("a")
    m.add("b")
    plan = m.plan({"a": 130, "b": 1})
    assert plan.batch_size == 2 and plan.num_tokens == 131
    # a: 130 tokens -> 32 CSA entries (1 page), 1 HCA entry (1 page); b: 0 entries, no pages
    assert m.block_ids("a", 4) == [0] and m.block_ids("a", 128) == [0]
    assert m.block_ids("b", 4) == [] and m.block_ids("b", 128) == []
    assert plan.positions[:3].tolist() == [0, 1, 2] and plan.positions[-2:].tolist() == [129, 0]
    assert plan.request_ids[-2:].tolist() == [0, 1] and plan.query_start.tolist() == [0, 130, 131]
    assert plan.seq_lens.tolist() == [130, 1] and plan.request_slots.tolist() == [0, 1]
    csa = plan.ratios[4]
    assert csa.block_table.tolist() == [[0], [-1]] and csa.block_lens.tolist() == [1, 0]
    assert csa.num_entries.tolist() == [32, 0] and csa.max_entries == 32
    emit = csa.emit_slots.tolist()
    assert emit[3] == 0 and emit[7] == 1 and emit[127] == 31 and emit[0] == -1 and emit[128] == -1
    assert csa.n_visible[:8].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    assert plan.host_positions().tolist() == plan.positions.tolist()
    assert plan.host_request_ids().tolist() == plan.request_ids.tolist()
    for m_, rp in plan.ratios.items():
        assert plan.host_n_visible(m_).tolist() == rp.n_visible.tolist()
    with pytest.raises(ValueError, match="ratio: expected one of"):
        plan.host_n_visible(8)
    hca = plan.ratios[128]
    assert hca.emit_slots.tolist()[127] == 0 and hca.emit_slots.tolist().count(-1) == 130
    # window ring of 128 rows: tokens 0 and 1 of a are overwritten later in the step -> skipped
    swa = plan.swa_slots.tolist()
    assert swa[:2] == [-1, -1] and swa[2] == 2 and swa[129] == 1 and swa[130] == 128  # b: slot 1 * 128 + 0
    m.commit(plan)
    assert m.num_tokens("a") == 130 and m.num_tokens("b") == 1


def test_not_now_when_pages_short_changes_nothing():
    m = make(max_requests=2, pages=2)  # 128-token pages: CSA 32 entries, HCA 1 entry a page
    m.add("a")
    m.add("b")
    before = (m.stats(), m.block_ids("a", 4))
    assert m.plan({"a": 128, "b": 384}) is None  # needs 1 + 3 pages per class, 2 free
    assert (m.stats(), m.block_ids("a", 4)) == before and m.outstanding_plan is None
    assert not m.can_schedule({"a": 128, "b": 384}) and m.can_schedule({"a": 128, "b": 128})


def test_one_outstanding_plan_and_stale_plans_rejected():
    m = make()
    m.add("a")
    p = m.plan({"a": 5})
    with pytest.raises(RuntimeError, match="outstanding"):
        m.plan({"a": 1})
    m.commit(p)
    with pytest.raises(ValueError, match="not the outstanding plan"):
        m.commit(p)
    with pytest.raises(ValueError, match="not the outstanding plan"):
        m.acquire(1, p)


def test_cancel_keeps_pages_and_replans_without_new_allocation():
    m = make(pages=4)
    m.add("a")
    p = m.plan({"a": 160})  # 40 CSA entries -> 2 pages, 1 HCA entry -> 1 page
    m.cancel(p)
    assert m.num_tokens("a") == 0 and m.block_ids("a", 4) == [0, 1]
    p = m.plan({"a": 160})
    assert m.block_ids("a", 4) == [0, 1] and m.stats().pools[4].pages_used == 2
    m.commit(p)


def test_free_is_idempotent_and_unknown_ids_are_noops():
    m = make()
    assert m.free("never") is False and m.preempt("never") is False
    m.add("a")
    m.commit(m.plan({"a": 17}))
    assert m.free("a") is True
    assert m.free("a") is False  # double free: no-op
    s = m.stats()
    assert s.pools[4].pages_free == 4 and s.slots_used == 0 and s.requests_active == 0
    assert m.free(["unhashable"]) is False


def test_finish_then_preempt_in_same_step_does_not_double_free():
    m = make()
    m.add("a")
    m.commit(m.plan({"a": 8}))
    m.free("a")
    assert m.preempt("a") is False
    m.check_invariants()
    assert m.stats().pools[4].pages_free == 4


def test_preempt_releases_everything_and_resume_restarts():
    m = make(max_requests=1, pages=4)
    m.add("a")
    m.commit(m.plan({"a": 32}))
    assert m.preempt("a") and m.is_preempted("a") and "a" not in m
    assert m.preempt("a") is False  # already preempted
    assert m.stats().pools[4].pages_free == 4 and m.stats().requests_preempted == 1
    assert m.add("b")  # slot was released
    assert m.add("a") is False  # no slot: still preempted
    assert m.free("b")
    assert m.add("a") and m.num_tokens("a") == 0 and not m.is_preempted("a")
    assert m.free("a") and m.stats().requests_preempted == 0


def test_free_of_in_flight_request_is_deferred_until_commit():
    m = make(max_requests=2, pages=2)
    m.add("a")
    m.add("b")
    p = m.plan({"a": 16})
    page = m.block_ids("a", 4)
    assert m.free("a") is True
    # The step still writes a's page: nobody else may get it before commit.
    assert m.block_ids("a", 4) == page and m.stats().pools[4].pages_free == 1
    m.commit(p)
    assert "a" not in m and m.stats().pools[4].pages_free == 2
    m.check_invariants()


def test_preempt_of_in_flight_request_is_deferred_until_cancel():
    m = make()
    m.add("a")
    p = m.plan({"a": 4})
    assert m.preempt("a")
    assert "a" in m
    m.cancel(p)
    assert m.is_preempted("a") and m.stats().pools[4].pages_free == 4


def test_bad_schedules_raise_and_change_nothing():
    m = make()
    m.add("a")
    before = m.stats()
    for bad, err in [
        ({"zzz": 1}, KeyError),
        ({"a": 0}, ValueError),
        ({"a": -3}, ValueError),
        ({"a": 1.5}, ValueError),
        ({}, ValueError),
        ([("a", 1), ("a", 2)], ValueError),
        ({"a": TINY.max_seq_len + 1}, ValueError),
        ([("a",)], ValueError),
        (5, ValueError),  # not a schedule at all: was a bare TypeError
        ("a", ValueError),
    ]:
        with pytest.raises(err):
            m.plan(bad)
        assert m.stats() == before and m.outstanding_plan is None
    with pytest.raises(ValueError, match=r"max_blocks: expected keys \[4, 128\]"):
        m.plan({"a": 1}, max_blocks={"x": 1, 4: 1})  # mixed key types: was a TypeError from sorted()
    assert m.stats() == before and m.outstanding_plan is None
    with pytest.raises(ValueError, match="hashable"):
        m.add(["x"])


def test_acquire_gives_only_the_views_of_the_layer_kind():
    m = mk128()
    m.add("a")
    p = m.plan({"a": 3})
    swa, csa, hca = m.acquire(0, p), m.acquire(1, p), m.acquire(2, p)
    assert swa.paged is None and swa.read_swa_view().fp8.shape == (2, 128, 448)
    for what in ("read_classical_view", "read_indexer_view", "compressor_state"):
        with pytest.raises(ValueError, match="SWA-only"):
            getattr(swa, what)()
    with pytest.raises(ValueError, match="only CSA"):
        hca.read_indexer_view()
    assert hca.read_classical_view().entries_per_page == 1 and hca.compressor_state().indexer is None
    iv = csa.read_indexer_view()
    assert iv.keys_fp4.shape[-1] == 64 and iv.global_scale is None
    assert csa.compressor_state().main.kv.shape == (2, 8, 1024)
    with pytest.raises(ValueError, match="layer_id"):
        m.acquire(5, p)


def test_stats_units_and_regions():
    m = make(max_requests=2, pages=3)
    m.add("a")
    m.commit(m.plan({"a": 18}))  # 4 CSA entries (1 page of 32), 0 HCA entries
    s = m.stats()
    csa = s.pools[4]
    assert (csa.pages_used, csa.pages_free, csa.entries_stored, csa.entries_capacity_used) == (1, 2, 4, 32)
    assert s.pools[128].pages_used == 0
    assert csa.bytes_used == m.schema.ratio_classes[4].block_bytes
    assert s.tokens_cached == 18 and s.slots_used == 1
    assert s.bytes_by_region["compressor_state"] == 2 * m.schema.per_request_fixed_bytes_by_region()["compressor_state"]
    # every allocated byte of the pools is in a region
    pools_bytes = sum(p.total_bytes for p in m.pools.values())
    assert s.bytes_by_region["compressed_entries"] + s.bytes_by_region["indexer_keys"] == pools_bytes


def test_check_invariants_detects_corruption():
    m = make()
    m.add("a")
    m.commit(m.plan({"a": 16}))
    m.pools[4]._free.append(m.block_ids("a", 4)[0])  # the same page both free and owned
    with pytest.raises(InvariantError, match="ratio 4 pages"):
        m.check_invariants()


def test_pools_refuse_double_and_foreign_frees():
    """Field bug: a page (or state slot) freed twice, or an id that was never a page (-1, past the end), corrupts
    the free list and later hands one page to two requests.  The pools refuse such a release with a ValueError and
    change nothing."""
    m = make(pages=4)
    pool = m.pools[4]
    pages = pool.allocate(2)
    before = pool.free_page_ids()
    for bad in ([pages[1], pages[1]], [-1], [pool.num_pages], [before[-1]], [pages[0], before[0]], [True]):
        with pytest.raises(ValueError, match="release"):
            pool.release(bad)
        assert pool.free_page_ids() == before, bad
    pool.release(pages)
    assert pool.num_free_pages == pool.num_pages
    slot = m.state.allocate()
    free = m.state.free_slot_ids()
    for bad in (m.state.num_slots, -1, free[0]):
        with pytest.raises(ValueError, match="release"):
            m.state.release(bad)
        assert m.state.free_slot_ids() == free
    m.state.release(slot)
    with pytest.raises(ValueError, match="already free"):
        m.state.release(slot)
    m.check_invariants()


def test_from_memory_budget():
    per_req = KVCacheManager(TINY, max_requests=1, num_pages=0, block_tokens=128).schema.per_request_fixed_bytes()
    m = KVCacheManager.from_memory_budget(TINY, max_requests=2, budget_bytes=2 * per_req + 10_000_000, block_tokens=128)
    used = m.stats().bytes_total
    assert used <= 2 * per_req + 10_000_000 + 2 * 4 * TINY.num_cache_layers  # + scratch ints
    assert m.pools[4].num_pages == m.pools[128].num_pages > 0
    with pytest.raises(ValueError, match="budget_bytes"):
        KVCacheManager.from_memory_budget(TINY, max_requests=2, budget_bytes=1000)


def test_manager_on_meta_free_device_types():
    m = KVCacheManager(TINY, max_requests=1, num_pages=1, block_tokens=128, device=torch.device("cpu"))
    m.add(0)
    p = m.plan([(0, 1)])
    assert p.positions.dtype == torch.int32 and p.device.type == "cpu"


def test_padded_decode_plan_for_graph_buckets():
    m = make(max_requests=3, pages=4)
    m.add("a")
    m.add("b")
    m.commit(m.plan({"a": 7, "b": 130}))
    p = m.plan({"a": 1, "b": 1}, pad_batch_to=4, max_blocks=3)
    assert p.batch_size == 4 and p.num_tokens == 4 and p.num_padded == 2 and p.request_keys == ("a", "b")
    assert p.positions.tolist() == [7, 130, 0, 0] and p.token_slots.tolist() == [0, 1, -1, -1]
    assert p.swa_slots.tolist()[2:] == [-1, -1] and p.request_slots.tolist()[2:] == [-1, -1]
    for rp in p.ratios.values():
        assert rp.block_table.shape == (4, 3) and rp.max_entries == 3 * rp.entries_per_page
        assert rp.emit_slots.tolist()[2:] == [-1, -1]
        assert rp.n_visible.tolist()[2:] == [0, 0] and (rp.block_table[2:] == -1).all()
        assert p.host_n_visible(rp.ratio).tolist() == rp.n_visible.tolist()
    assert p.host_positions().tolist() == p.positions.tolist()
    assert p.host_request_ids().tolist() == p.request_ids.tolist()
    m.commit(p)
    assert (m.num_tokens("a"), m.num_tokens("b")) == (8, 131)
    # A later plan with the same bucket loads into the first one's tensors (the graph's static buffers).
    q = m.plan({"b": 1}, pad_batch_to=4, max_blocks=3)
    p.load_(q)
    assert p.positions.tolist() == [131, 0, 0, 0] and p.token_slots.tolist() == [1, -1, -1, -1]
    m.cancel(q)
    with pytest.raises(ValueError, match="decode steps"):
        m.plan({"a": 2}, pad_batch_to=2)
    with pytest.raises(ValueError, match="pad_batch_to"):
        m.plan({"a": 1, "b": 1}, pad_batch_to=1)
    with pytest.raises(ValueError, match="max_blocks"):
        m.plan({"b": 1}, max_blocks=1)  # b needs 2 HCA pages
    r = m.plan({"a": 1}, pad_batch_to=2, max_blocks=5)
    with pytest.raises(ValueError, match="shape"):
        p.load_(r)
    assert m.outstanding_plan is r


def test_max_blocks_covers_pages_held_after_cancel_and_failure_changes_nothing():
    m = make(max_requests=2, pages=8)
    m.add("a")
    m.add("b")
    m.cancel(m.plan({"a": 300}))  # a keeps 3 CSA pages (75 entries) while holding 0 tokens
    before = m.stats()
    with pytest.raises(ValueError, match="max_blocks"):
        m.plan({"b": 128, "a": 1}, max_blocks=1)
    assert m.stats() == before and m.outstanding_plan is None
    p = m.plan({"b": 128, "a": 1}, max_blocks=3)
    assert p.ratios[4].block_table.shape == (2, 3)


def test_repeated_free_or_preempt_during_a_step_is_a_noop():
    m = make()
    m.add("a")
    p = m.plan({"a": 4})
    assert m.free("a") is True
    assert m.free("a") is False and m.preempt("a") is False
    m.commit(p)
    assert "a" not in m and not m.is_preempted("a")
    m.add("b")
    p = m.plan({"b": 4})
    assert m.preempt("b") is True and m.preempt("b") is False
    m.commit(p)
    assert m.is_preempted("b")


@pytest.mark.parametrize("online", [True, False])
def test_reused_slot_starts_empty_and_other_slots_keep_their_state(online):
    """A slot taken by a new request is reset in every layer (ring positions -1, head 0, compressor kv 0 / score -inf,
    online positions -1); the other slots' state is untouched."""
    m = KVCacheManager(TINY, max_requests=2, num_pages=4, block_tokens=128, online_state=online)
    st = m.state
    m.add("a"), m.add("b")
    for layer in st.layers:  # dirty both slots as steps would
        layer.ring_positions.fill_(7), layer.ring_head.fill_(3)
        for c in (layer.compressor, layer.indexer_compressor):
            if c is not None:
                c.kv.fill_(1.5), c.score.fill_(2.5)
                if c.positions is not None:
                    c.positions.fill_(9)
    s_a = m.slot_of("a")
    m.free("a")
    m.add("c")
    assert m.slot_of("c") == s_a
    for layer in st.layers:
        for s, fresh in ((s_a, True), (m.slot_of("b"), False)):
            assert (layer.ring_positions[s] == (-1 if fresh else 7)).all()
            assert int(layer.ring_head[s]) == (0 if fresh else 3)
            for c in (layer.compressor, layer.indexer_compressor):
                if c is None:
                    continue
                assert (c.kv[s] == (0.0 if fresh else 1.5)).all()
                assert (c.score[s] == (float("-inf") if fresh else 2.5)).all()
                if c.positions is not None:
                    assert int(c.positions[s]) == (-1 if fresh else 9)
