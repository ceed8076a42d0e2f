"""KVCacheManager.save / load (``dsv4/cache/snapshot.py``): a request's cache taken out and put back -- into the same
manager (a swap) or another one (a migration) with other slot and page ids -- decodes on exactly as if it had never
left, every region is in the snapshot (its size is the schema's per-request bytes), and a load that cannot fit is
"not now" with nothing taken."""

import dataclasses
import re

import pytest
import torch

from dsv4.cache import REGIONS, KVCacheManager, RequestSnapshot
from dsv4.config import get_preset
from dsv4.model.attention import AttentionSubBlock
from dsv4.model.weights import random_attention_weights

TINY = get_preset("tiny")
LAYERS = (0, 1, 2)  # SWA, CSA, HCA
X = torch.randn(400, TINY.dim, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
_BLOCKS: dict[str, dict[int, AttentionSubBlock]] = {}


def blocks(device: torch.device) -> dict[int, AttentionSubBlock]:
    """The three layers (torch backend) with their weights on ``device``, built once a device."""
    if str(device) not in _BLOCKS:
        _BLOCKS[str(device)] = {
            i: AttentionSubBlock(TINY, i, random_attention_weights(TINY, i, seed=5, device=device), backend="torch")
            for i in LAYERS
        }
    return _BLOCKS[str(device)]


def manager(**kw):
    return KVCacheManager(TINY, max_requests=4, num_pages=kw.pop("num_pages", 8), block_tokens=256, debug=True, **kw)


def step(m, sched, xs):
    """One step of every layer on the manager's device; returns {layer: y}."""
    plan = m.plan(sched)
    ys = {i: blk(xs.to(m.device), m.acquire(i, plan)) for i, blk in blocks(m.device).items()}
    m.commit(plan)
    return ys


def prefill(m, rid, n):
    m.add(rid)
    return step(m, {rid: n}, X[:n])


def decode(m, rid, pos):
    return step(m, {rid: 1}, X[pos : pos + 1])


def assert_same(a: RequestSnapshot, b: RequestSnapshot):
    assert a.num_tokens == b.num_tokens and a.fingerprint == b.fingerprint
    for region in REGIONS:
        ra, rb = getattr(a, region), getattr(b, region)
        assert ra.keys() == rb.keys(), region
        for k in ra:
            va, vb = ra[k], rb[k]
            if region == "pages":
                for layer in va:
                    for ta, tb in zip(va[layer], vb[layer], strict=True):
                        assert (ta is None and tb is None) or torch.equal(ta, tb), (region, k, layer)
            else:
                for ta, tb in zip(va, vb, strict=True):
                    assert torch.equal(ta, tb), (region, k)


def test_snapshot_holds_every_region_of_the_request():
    m = manager()
    prefill(m, "r", 300)
    snap = m.save("r")
    fixed = m.schema.per_request_fixed_bytes()
    pages = sum(p.ratio_class.pages_for_tokens(300) * p.ratio_class.block_bytes for p in m.pools.values())
    assert snap.nbytes == fixed + pages  # window rings and their positions, compressor states, pages: all of it
    assert snap.num_tokens == 300 and all(t.device.type == "cpu" for t in snap.window[0])


def _storages(v, out: dict) -> dict:
    """{storage data_ptr: nbytes} of every tensor reachable from ``v`` (tensors, dicts / lists / tuples of them, and
    dsv4 objects' attributes), each storage once."""
    if isinstance(v, torch.Tensor):
        out[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    elif isinstance(v, dict):
        for x in v.values():
            _storages(x, out)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _storages(x, out)
    elif type(v).__module__.startswith("dsv4") and hasattr(v, "__dict__"):
        for x in vars(v).values():
            _storages(x, out)
    return out


def _storage_bytes(obj, skip: str | None = None) -> int:
    """Bytes of the distinct storages ``obj`` reaches, less those its attribute ``skip`` reaches."""
    left_out = _storages(getattr(obj, skip), {}) if skip else {}
    return sum(n for ptr, n in _storages(obj, {}).items() if ptr not in left_out)


@pytest.mark.parametrize("online_state", [True, False])
def test_snapshot_bytes_equal_what_a_request_holds_in_the_buffers(online_state):
    """Field bug (a restore that misses a region): the snapshot's bytes equal, independently of the schema's own
    arithmetic, what one more slot and one more page add to the managers' buffers (every tensor storage the state
    and page pools reach, found by walking their attributes: a buffer added later is counted without naming it),
    times the request's pages; only the fused launch's arrival counters (0 between steps) are left out."""

    def make(slots, pages):
        return KVCacheManager(TINY, max_requests=slots, num_pages=pages, block_tokens=256, online_state=online_state)

    a, b, c = make(2, 8), make(3, 8), make(2, 9)
    per_slot = _storage_bytes(b.state, "_counters") - _storage_bytes(a.state, "_counters")
    per_page = {r: _storage_bytes(c.pools[r]) - _storage_bytes(a.pools[r]) for r in a.pools}
    m = manager(online_state=online_state)
    prefill(m, "r", 300)
    snap = m.save("r")
    held = sum(per_page[r] * len(m.block_ids("r", r)) for r in m.pools)
    assert snap.nbytes == per_slot + held


@pytest.mark.parametrize("online_state", [True, False])
def test_migrated_request_decodes_as_if_it_never_left(device, online_state):
    """(On a GPU too: the snapshot goes through the host, the copies are the device's.)"""
    a = manager(online_state=online_state, device=device)
    prefill(a, "r", 300)
    snap = a.save("r")
    b = manager(online_state=online_state, device=device)
    prefill(b, "other", 260)  # other slot and page ids in b
    assert b.load("r", snap)
    assert b.slot_of("r") != a.slot_of("r") and b.block_ids("r", 4) != a.block_ids("r", 4)
    assert b.num_tokens("r") == 300
    for pos in (300, 301):  # position 303 completes the next CSA entry; HCA's running state goes on
        ya, yb = decode(a, "r", pos), decode(b, "r", pos)
        for i in LAYERS:
            assert torch.equal(ya[i], yb[i]), i
    assert_same(a.save("r"), b.save("r"))
    b.check_invariants()


def test_swap_out_and_back_in_the_same_manager():
    ref = manager()
    prefill(ref, "r", 127)
    m = manager()
    prefill(m, "r", 127)
    snap = m.save("r")
    assert m.preempt("r") and m.is_preempted("r")
    prefill(m, "x", 40)  # the freed slot and pages are reused meanwhile
    assert m.load("r", snap) and not m.is_preempted("r")
    ya, yb = decode(ref, "r", 127), decode(m, "r", 127)  # position 127 completes the first HCA entry
    for i in LAYERS:
        assert torch.equal(ya[i], yb[i]), i


def test_load_that_does_not_fit_is_not_now_and_takes_nothing():
    a = manager()
    prefill(a, "r", 300)
    snap = a.save("r")
    small = manager(num_pages=2)  # 300 tokens need 2 pages a class; one is taken below
    prefill(small, "y", 10)
    before = small.stats()
    assert small.load("r", snap) is False
    assert small.stats() == before and "r" not in small
    full = manager()
    for r in range(4):
        full.add(r)
    assert full.load("r", snap) is False and "r" not in full
    small.check_invariants()
    full.check_invariants()


def test_save_and_load_errors_change_nothing():
    m = manager()
    prefill(m, "r", 300)
    snap = m.save("r")
    plan = m.plan({"r": 1})
    with pytest.raises(ValueError, match="outstanding plan"):
        m.save("r")
    m.cancel(plan)
    with pytest.raises(KeyError):
        m.save("nobody")
    with pytest.raises(ValueError, match="already added"):
        m.load("r", snap)
    other = manager(online_state=False)
    before = other.stats()
    with pytest.raises(ValueError, match="state layout"):
        other.load("r", snap)
    missing = dataclasses.replace(snap, window={k: v for k, v in snap.window.items() if k != 0})
    with pytest.raises(ValueError, match="window rings"):
        manager().load("r", missing)
    short = dataclasses.replace(snap, num_tokens=600)
    with pytest.raises(ValueError, match="pages"):
        manager().load("r", short)
    with pytest.raises(ValueError, match="RequestSnapshot"):
        manager().load("r", {"num_tokens": 3})
    for n in (300.0, -1, True, "300"):
        fresh = manager()
        with pytest.raises(ValueError, match="num_tokens: expected an int"):
            fresh.load("r", dataclasses.replace(snap, num_tokens=n))
        assert fresh.stats() == manager().stats()
        fresh.check_invariants()
    assert other.stats() == before and "r" not in other


def _bad_variants(snap: RequestSnapshot) -> dict[str, RequestSnapshot]:
    """The snapshot with one region tensor of the wrong shape or dtype (each passed the older checks, and the load
    then failed half-way with the slot and pages taken)."""
    cm, cl = next((m, layer) for m, per in snap.pages.items() for layer in per)
    ent, keys = snap.pages[cm][cl]
    ring, pos, head = snap.window[1]
    ckey = next(iter(snap.compressor))
    kv, *rest = snap.compressor[ckey]

    def with_pages(parts):
        return dataclasses.replace(snap, pages={**snap.pages, cm: {**snap.pages[cm], cl: parts}})

    return {
        "window[1] page": dataclasses.replace(snap, window={**snap.window, 1: (ring[:-1], pos, head)}),
        "window[1] positions": dataclasses.replace(snap, window={**snap.window, 1: (ring, pos.long(), head)}),
        f"pages[{cm}][{cl}] entries": with_pages((ent[:, :-1], keys)),
        f"compressor[{ckey[0]}, {ckey[1]!r}] kv": dataclasses.replace(
            snap, compressor={**snap.compressor, ckey: (kv[:-1], *rest)}
        ),
        f"compressor[{ckey[0]}, {ckey[1]!r}]: expected": dataclasses.replace(
            snap, compressor={**snap.compressor, ckey: (kv,)}
        ),
        "window[1] head": dataclasses.replace(snap, window={**snap.window, 1: (ring, pos, head.to("meta"))}),
    }


def test_load_of_a_malformed_snapshot_is_an_error_that_takes_nothing():
    """A region tensor of the wrong shape or dtype (or a missing one): ValueError naming it, and the manager keeps
    every slot and page free (it used to take them and then fail in the copy)."""
    m = manager()
    prefill(m, "r", 300)
    snap = m.save("r")
    for name, bad in _bad_variants(snap).items():
        other = manager()
        before = other.stats()
        with pytest.raises(ValueError, match=re.escape(f"snapshot: {name}")):
            other.load("r", bad)
        assert other.stats() == before and "r" not in other
        other.check_invariants()
        assert other.load("r", snap)  # the good one still loads


@pytest.mark.parametrize("share", [True, False])
def test_fork_decodes_as_the_same_prompt_prefilled_twice(share):
    """n samples of one prompt: a fork decodes as a second request that prefilled the same prompt would, and the two
    diverge without touching each other.  ``share``: the filled page (300 tokens: the first 256) is shared, the
    partly filled one copied; across the next page boundary each request takes pages of its own."""
    ref = manager()
    prefill(ref, "p", 300)
    prefill(ref, "q", 300)  # the same prompt prefilled twice
    m = manager()
    prefill(m, "p", 300)
    used = m.stats().pools[4].pages_used
    assert m.fork("p", "s1", share=share)
    common = set(m.block_ids("s1", 4)) & set(m.block_ids("p", 4))
    assert common == ({m.block_ids("p", 4)[0]} if share else set()) and m.slot_of("s1") != m.slot_of("p")
    assert m.stats().pools[4].pages_used == used + (1 if share else 2)
    xs = torch.cat([X[300:301], X[350:351]])  # different next tokens
    for _ in range(220):  # to 520 tokens: 130 entries, a third page
        y_ref, ys = step(ref, {"p": 1, "q": 1}, xs), step(m, {"p": 1, "s1": 1}, xs)
    for i in LAYERS:
        assert torch.equal(ys[i], y_ref[i]), i
    assert len(set(m.block_ids("s1", 4)) & set(m.block_ids("p", 4))) == (1 if share else 0)
    with pytest.raises(ValueError, match="already added"):
        m.fork("p", "s1")
    first = m.block_ids("s1", 4)[0]
    m.free("p")  # a shared page stays with s1 ...
    assert m.stats().pools[4].pages_used == 3 and first not in m.pools[4].free_page_ids()
    m.free("s1")  # ... and goes back with its last owner
    assert all(p.pages_used == 0 for p in m.stats().pools.values())


@pytest.mark.parametrize("n", [1, 255, 256])
def test_fork_shares_only_whole_filled_pages(n):
    """Field bug (prefix-hit granularity): a prompt shorter than one page shares no page (its only page is still
    being filled, so each request gets a copy); at exactly one page it shares that page.  Invariants hold and
    both requests decode on."""
    m = manager()
    prefill(m, "p", n)
    assert m.fork("p", "s", share=True)
    common = set(m.block_ids("s", 4)) & set(m.block_ids("p", 4))
    assert len(common) == n // 256
    m.check_invariants()
    step(m, {"p": 1, "s": 1}, X[n : n + 2])
    m.check_invariants()
    assert m.num_tokens("p") == m.num_tokens("s") == n + 1


def test_fork_that_does_not_fit_is_not_now():
    full = manager()
    prefill(full, "p", 300)
    for r in range(3):
        full.add(r)
    before = full.stats()
    for share in (True, False):
        assert full.fork("p", "s2", share=share) is False and "s2" not in full
    assert full.stats() == before
    full.check_invariants()


def test_pack_unpack_round_trip_of_mixed_tensors():
    """``pack`` / ``unpack`` (the one-transfer save and load): any dtypes and shapes, 0-dim and empty tensors, odd
    byte counts and non-contiguous views come back equal, each view aligned for its dtype."""
    from dsv4.cache.snapshot import _ALIGN, move, pack, unpack

    g = torch.Generator().manual_seed(0)
    parts = [
        torch.randint(0, 256, (3, 7), dtype=torch.uint8, generator=g),
        torch.tensor(5, dtype=torch.int32),
        torch.randn(5, 4, generator=g)[:, 1:3],  # non-contiguous
        torch.empty(0, 9, dtype=torch.uint8),
        torch.randint(-9, 9, (11,), dtype=torch.int32, generator=g),
        torch.randn(2, 3, generator=g).double(),
    ]
    flat = pack(parts)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    back = unpack(flat, parts)
    for a, b in zip(parts, back, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert b.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert (b.data_ptr() - flat.data_ptr()) % _ALIGN == 0
    copies = move(parts, torch.device("cpu"))  # same device kind: one copy a tensor, new storage
    for a, b in zip(parts, copies, strict=True):
        fresh = a.numel() == 0 or b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
        assert torch.equal(a, b) and fresh


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_move_is_one_transfer_each_way():
    """GPU -> host and back: the parts come back equal, the host copies are views of one pinned buffer."""
    from dsv4.cache.snapshot import move

    dev = torch.device("cuda")
    shapes = ((5, torch.uint8), (7, torch.int32), (3, torch.float32))
    parts = [torch.arange(n, device=dev, dtype=dt) for n, dt in shapes]
    parts.append(torch.tensor(9, device=dev, dtype=torch.int32))
    host = move(parts, torch.device("cpu"))
    assert all(h.device.type == "cpu" and h.is_pinned() for h in host)
    assert len({h.untyped_storage().data_ptr() for h in host}) == 1
    back = move(host, dev)
    torch.cuda.synchronize()
    for a, b in zip(parts, back, strict=True):
        assert b.device.type == "cuda" and torch.equal(a, b)
