"""Hypothesis state machine over the manager: add / plan+commit / plan+cancel / free / preempt / resume / save /
load / fork (pages shared or copied), with frees and preempts landing inside a step; invariants (shared pages
counted) and a shadow model checked after every rule, every plan's fields against the per-token reference."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dsv4.cache import KVCacheManager
from dsv4.config import get_preset
from tests.cache.test_plan import assert_plan_matches_reference

IDS = st.integers(0, 7)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(get_preset("tiny"), max_requests=3, num_pages={4: 6, 128: 5}, block_tokens=128)
        self.tokens: dict[int, int] = {}  # shadow: active id -> committed tokens
        self.preempted: set[int] = set()
        self.saved: dict[int, object] = {}  # id -> its last snapshot

    @rule(rid=IDS)
    def add(self, rid):
        if rid in self.tokens:
            return
        ok = self.m.add(rid)
        assert ok == (len(self.tokens) < 3)
        if ok:
            self.tokens[rid] = 0
            self.preempted.discard(rid)

    @precondition(lambda self: self.tokens)
    @rule(
        data=st.data(),
        commit=st.booleans(),
        free_mid=IDS,
        preempt_mid=IDS,
        mid=st.sampled_from(["none", "free", "preempt"]),
    )
    def step(self, data, commit, free_mid, preempt_mid, mid):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        sizes = [data.draw(st.sampled_from([1, 1, 2, 3, 4, 5, 31, 127, 128, 129, 300])) for _ in ids]
        before = self.m.stats()
        # the oracle: per ratio class m, pages are whole 128-token blocks of entries (token // m entries, 128 // m a
        # page); the step is "not now" exactly when some class needs more new pages than it has free
        need = {
            m: sum(max(0, -(-((self.tokens[r] + n) // m) // (128 // m)) - len(self.m.block_ids(r, m)))
                   for r, n in zip(ids, sizes, strict=True))
            for m in (4, 128)
        }  # fmt: skip
        short = any(need[m] > self.m.pools[m].num_free_pages for m in need)
        assert self.m.can_schedule(list(zip(ids, sizes, strict=True))) == (not short)
        plan = self.m.plan(list(zip(ids, sizes, strict=True)))
        assert (plan is None) == short, (need, {m: p.num_free_pages for m, p in self.m.pools.items()})
        if plan is None:  # "not now" changed nothing
            assert self.m.stats() == before
            return
        assert plan.num_tokens == sum(sizes)
        assert_plan_matches_reference(self.m, plan, list(zip(ids, sizes, strict=True)))
        # A free/preempt that arrives while the step runs
        victim = {"free": free_mid, "preempt": preempt_mid}.get(mid)
        if victim is not None:
            (self.m.free if mid == "free" else self.m.preempt)(victim)
        (self.m.commit if commit else self.m.cancel)(plan)
        if commit:
            for rid, n in zip(ids, sizes, strict=True):
                self.tokens[rid] += n
        if victim is not None and victim in self.tokens:
            del self.tokens[victim]
            if mid == "preempt":
                self.preempted.add(victim)
        elif mid == "free" and victim in self.preempted:
            self.preempted.discard(victim)

    @rule(rid=IDS)
    def free(self, rid):
        expect = rid in self.tokens or rid in self.preempted
        assert self.m.free(rid) == expect
        self.tokens.pop(rid, None)
        self.preempted.discard(rid)

    @rule(rid=IDS)
    def preempt(self, rid):
        assert self.m.preempt(rid) == (rid in self.tokens)
        if rid in self.tokens:
            del self.tokens[rid]
            self.preempted.add(rid)

    @rule(rid=IDS)
    def save(self, rid):
        if rid in self.tokens:
            self.saved[rid] = self.m.save(rid)
            assert self.saved[rid].num_tokens == self.tokens[rid]

    @precondition(lambda self: self.saved)
    @rule(data=st.data())
    def load(self, data):
        rid = data.draw(st.sampled_from(sorted(self.saved)))
        if rid in self.tokens:
            return
        before = self.m.stats()
        snap = self.saved[rid]
        pools = self.m.pools.items()
        fits = len(self.tokens) < 3 and all(
            p.num_free_pages >= p.ratio_class.pages_for_tokens(snap.num_tokens) for _, p in pools
        )
        assert self.m.load(rid, snap) == fits
        if fits:
            self.tokens[rid] = snap.num_tokens
            self.preempted.discard(rid)
        else:  # "not now" changed nothing
            assert self.m.stats() == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), dst=IDS, share=st.booleans())
    def fork(self, data, dst, share):
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        if dst in self.tokens:
            return
        n = self.tokens[src]
        full = n // self.m.schema.block_tokens if share else 0
        fits = len(self.tokens) < 3 and all(
            p.num_free_pages >= p.ratio_class.pages_for_tokens(n) - full for p in self.m.pools.values()
        )
        before = self.m.stats()
        assert self.m.fork(src, dst, share=share) == fits
        if fits:
            self.tokens[dst] = n
            self.preempted.discard(dst)
        else:
            assert self.m.stats() == before

    @invariant()
    def consistent(self):
        self.m.check_invariants()
        assert set(self.m.request_ids) == set(self.tokens)
        for rid, n in self.tokens.items():
            assert self.m.num_tokens(rid) == n
            for m, pool in self.m.pools.items():
                assert len(self.m.block_ids(rid, m)) >= pool.ratio_class.pages_for_tokens(n)
        s = self.m.stats()
        assert s.requests_preempted == len(self.preempted)
        assert s.tokens_cached == sum(self.tokens.values())

    def teardown(self):
        for rid in list(self.tokens) + list(self.preempted):
            self.m.free(rid)
        s = self.m.stats()
        assert s.slots_used == 0 and all(p.pages_used == 0 for p in s.pools.values())
        self.m.check_invariants()


TestManagerStateful = ManagerMachine.TestCase
TestManagerStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
