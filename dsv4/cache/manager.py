"""KVCacheManager: admission, slots, pages, block tables, the step plan, freeing and accounting.

Life of a request::

    add(rid) ──► plan({rid: n}) ──► [step: acquire(layer, plan) per layer] ──► commit(plan) ──► ...
        │            │ None = "not now" (pages short): preempt someone and retry    │
        │ False = no free slot                                                       ▼
        └──────────────────────────── preempt(rid) / free(rid) ◄──────────────── finished

Rules (design §2, §4):

- "Not now" is a return value: ``add`` returns False without a free slot, ``plan`` returns None when
  a ratio class lacks pages.  Misuse raises (unknown or duplicate ids, bad token counts, a second
  plan while one is outstanding, a stale plan).  A call that returns "not now" or raises changes
  nothing.
- ``free`` is idempotent: freeing an unknown, never-started or already-freed id is a no-op that
  returns False.  ``preempt`` of a finished/unknown/already-preempted id is also a no-op (False).
- A request named by the outstanding plan is still being written by that step: its ``free`` /
  ``preempt`` is deferred until ``commit``/``cancel`` (so a page is never handed to a new owner
  while a step still writes it).
- Preemption releases everything the request holds; re-``add`` it later and re-run its tokens
  (recompute).  ``check_invariants`` proves every page and slot is free or owned exactly once.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4.cache.handle import LayerCacheHandle
from dsv4.cache.paged_cache import PagedKVPool
from dsv4.cache.plan import RatioPlan, StepPlan, int32_to_device
from dsv4.cache.schema import DEFAULT_BLOCK_TOKENS, ONLINE_STATE, CacheSchema
from dsv4.cache.snapshot import RequestSnapshot, check_snapshot, load_request, save_request
from dsv4.cache.state_cache import StateCachePool
from dsv4.config import ModelConfig


class InvariantError(RuntimeError):
    """Raised by ``check_invariants`` when accounting is broken (a bug, never a user error)."""


class _Deferred(enum.Enum):
    FREE = "free"
    PREEMPT = "preempt"


@dataclass
class _Request:
    slot: int
    num_tokens: int = 0  # committed tokens (cached)
    blocks: dict[int, list[int]] = field(default_factory=dict)  # ratio -> page ids, logical order


@dataclass(frozen=True)
class PoolStats:
    """Accounting of one ratio class.  Units in the names."""

    ratio: int
    pages_total: int
    pages_used: int
    pages_free: int
    entries_stored: int
    entries_capacity_used: int  # entries the used pages could hold
    bytes_total: int
    bytes_used: int


@dataclass(frozen=True)
class CacheStats:
    """Whole-manager accounting.  ``bytes_by_region`` is allocated device memory per region."""

    requests_active: int
    requests_preempted: int
    slots_total: int
    slots_used: int
    tokens_cached: int
    pools: dict[int, PoolStats]
    bytes_by_region: dict[str, int]

    @property
    def bytes_total(self) -> int:
        return sum(self.bytes_by_region.values())


class KVCacheManager:
    """The cache of one model replica (see module docstring).

    Args:
        config: the model.
        max_requests: state slots (requests holding cache at once).
        num_pages: pages per ratio class, an int for every class or ``{ratio: pages}``.
        block_tokens: raw tokens per logical block (page) in every ratio class.
        device: where the cache lives.
        debug: run ``check_invariants`` after every mutation (host-side only; never syncs the device).
        online_state: HCA compressors keep the running softmax of the open chunk instead of its rows
            (``CacheSchema``; default ``ONLINE_STATE``).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_requests: int,
        num_pages: int | Mapping[int, int],
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        device: torch.device | str = "cpu",
        debug: bool = False,
        online_state: bool = ONLINE_STATE,
    ) -> None:
        self.schema = CacheSchema(config, block_tokens, online_state)
        self.config = config
        self.device = torch.device(device)
        self.debug = debug
        classes = self.schema.ratio_classes
        if isinstance(num_pages, Mapping):
            if set(num_pages) != set(classes):
                raise ValueError(f"num_pages: expected keys {sorted(classes)}, got {sorted(num_pages)}")
            pages = dict(num_pages)
        else:
            pages = {m: num_pages for m in classes}
        self.pools: dict[int, PagedKVPool] = {m: PagedKVPool(rc, pages[m], self.device) for m, rc in classes.items()}
        self._paging = tuple((m, rc.entries_per_page) for m, rc in classes.items())  # (ratio, entries a page)
        # host mirror of every active request's page ids, row = its state slot (``_tables``: int32 [slots, capacity],
        # -1 past the pages held; ``_held``: pages held), kept by ``_put_request`` / ``_extend_pages`` /
        # ``_release``: a plan's block tables are one gather of the scheduled rows, not a conversion of every page id
        # from the Python lists (2 ms a decode step at B = 64, 128K tokens)
        self._tables = {m: np.full((max_requests, 16), -1, np.int32) for m in self.pools}
        self._held = {m: np.zeros(max_requests, np.int64) for m in self.pools}
        self.state = StateCachePool(self.schema, max_requests, self.device)
        self._requests: dict[Hashable, _Request] = {}
        self._preempted: set[Hashable] = set()
        self._outstanding: StepPlan | None = None
        self._deferred: dict[Hashable, _Deferred] = {}
        self._epoch = 0
        self._shared: dict[int, dict[int, int]] = {m: {} for m in self.pools}  # ratio -> {page: owners >= 2}

    @classmethod
    def from_memory_budget(
        cls,
        config: ModelConfig,
        *,
        max_requests: int,
        budget_bytes: int,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        online_state: bool = ONLINE_STATE,
        **kwargs,
    ) -> KVCacheManager:
        """Size the page pools so that slots + pages fit ``budget_bytes``.

        After the per-slot state, the remaining bytes are split so that every ratio class can hold
        the same number of tokens (pages per class = tokens / block_tokens).
        """
        schema = CacheSchema(config, block_tokens, online_state)
        left = budget_bytes - max_requests * schema.per_request_fixed_bytes()
        per_block = sum(rc.block_bytes for rc in schema.ratio_classes.values())
        if left < 0 or (per_block and left < per_block):
            raise ValueError(
                f"budget_bytes: {budget_bytes} cannot hold {max_requests} request slots and one page per ratio class"
            )
        n = left // per_block if per_block else 0
        return cls(
            config, max_requests=max_requests, num_pages=n, block_tokens=block_tokens, online_state=online_state,
            **kwargs,
        )  # fmt: skip

    # ------------------------------------------------------------------ queries
    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._requests

    @property
    def request_ids(self) -> tuple[Hashable, ...]:
        return tuple(self._requests)

    def num_tokens(self, rid: Hashable) -> int:
        """Committed (cached) tokens of an active request."""
        return self._get(rid).num_tokens

    def slot_of(self, rid: Hashable) -> int:
        return self._get(rid).slot

    def block_ids(self, rid: Hashable, ratio: int) -> list[int]:
        """Page ids of ``rid`` in ratio class ``ratio``, logical order (a copy)."""
        if ratio not in self.pools:
            raise ValueError(f"ratio: expected one of {sorted(self.pools)}, got {ratio!r}")
        return list(self._get(rid).blocks.get(ratio, []))

    def is_preempted(self, rid: Hashable) -> bool:
        return rid in self._preempted

    @property
    def outstanding_plan(self) -> StepPlan | None:
        return self._outstanding

    def _get(self, rid: Hashable) -> _Request:
        try:
            return self._requests[rid]
        except (KeyError, TypeError):
            raise KeyError(f"request {rid!r}: not an active request of this manager") from None

    # ------------------------------------------------------------------ admission
    def can_add(self) -> bool:
        return self.state.num_free_slots > 0

    def add(self, rid: Hashable) -> bool:
        """Admit a request (or resume a preempted one, from zero tokens).  False = no free slot."""
        self._check_new_id(rid)
        slot = self.state.allocate()
        if slot is None:
            return False
        self._preempted.discard(rid)
        self._put_request(rid, _Request(slot=slot, blocks={m: [] for m in self.pools}))
        self._after_mutation()
        return True

    def _check_new_id(self, rid: Hashable) -> None:
        try:
            hash(rid)
        except TypeError:
            raise ValueError(f"request id: expected a hashable id, got {type(rid).__name__}") from None
        if rid in self._requests:
            raise ValueError(f"request {rid!r}: already added")

    def pages_needed(self, rid: Hashable, num_new_tokens: int) -> dict[int, int]:
        """Pages per ratio class that scheduling ``num_new_tokens`` more tokens of ``rid`` takes."""
        return dict(zip(self.pools, self._needs(self._get(rid), num_new_tokens), strict=True))

    def _needs(self, req: _Request, num_new_tokens: int) -> tuple[int, ...]:
        """``pages_needed`` of a request as a tuple in ``self.pools`` order (the planning loop's form: no dict, no
        method calls a class; ``RatioClass.pages_for_tokens`` inlined)."""
        new_len = req.num_tokens + num_new_tokens
        return tuple(max(0, -(-(new_len // m) // per_page) - len(req.blocks[m])) for m, per_page in self._paging)

    def _normalise_schedule(self, schedule) -> list[tuple[Hashable, int]]:
        if isinstance(schedule, Mapping):
            items = list(schedule.items())
        elif isinstance(schedule, Iterable) and not isinstance(schedule, (str, bytes)):
            items = list(schedule)
        else:
            got = type(schedule).__name__
            raise ValueError(f"schedule: expected {{request id: num_new_tokens}} or (id, n) pairs, got {got}")
        if not items:
            raise ValueError("schedule: expected at least one (request id, num_new_tokens)")
        seen = set()
        for item in items:
            if not isinstance(item, tuple) or len(item) != 2:
                raise ValueError(f"schedule: expected (request id, num_new_tokens) pairs, got {item!r}")
            rid, n = item
            req = self._get(rid)
            if rid in seen:
                raise ValueError(f"schedule: request {rid!r} appears twice")
            seen.add(rid)
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
                raise ValueError(f"schedule[{rid!r}]: expected num_new_tokens >= 1, got {n!r}")
            if req.num_tokens + n > self.config.max_seq_len:
                raise ValueError(
                    f"schedule[{rid!r}]: {req.num_tokens} + {n} tokens exceeds max_seq_len={self.config.max_seq_len}"
                )
        return [(rid, int(n)) for rid, n in items]

    def can_schedule(self, schedule: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]]) -> bool:
        """Whether ``plan(schedule)`` would find enough pages now (it mutates nothing)."""
        items = self._normalise_schedule(schedule)
        return self._plan_needs(items)[1] is None

    def _plan_needs(self, items: list[tuple[Hashable, int]]) -> tuple[list[tuple[int, ...]], dict[int, int] | None]:
        """(each scheduled request's ``_needs``, the pages short per ratio class or None when every class has
        enough free pages)."""
        needs = [self._needs(self._requests[rid], n) for rid, n in items]
        want = [sum(col) for col in zip(*needs, strict=True)]
        short = {
            m: k - pool.num_free_pages
            for (m, pool), k in zip(self.pools.items(), want, strict=True)
            if k > pool.num_free_pages
        }
        return needs, short or None

    # ------------------------------------------------------------------ the step
    def plan(
        self,
        schedule: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]],
        *,
        pad_batch_to: int | None = None,
        max_blocks: int | Mapping[int, int] | None = None,
    ) -> StepPlan | None:
        """Allocate the step's pages and build its ``StepPlan``; None = "not now" (pages short).

        ``schedule`` maps request id -> new tokens this step (batch order = iteration order).  Only one
        plan may be outstanding: ``commit`` or ``cancel`` it before planning the next step.

        For a CUDA graph of a decode step every shape must be fixed: ``pad_batch_to`` appends padded rows
        (decode steps only; see ``StepPlan``) up to that batch size, and ``max_blocks`` fixes the width of
        every block table (an int for every ratio class or ``{ratio: blocks}``), so that
        ``max_entries`` = ``max_blocks * entries_per_page`` is static too.
        """
        if self._outstanding is not None:
            raise RuntimeError("plan: a plan is outstanding; commit() or cancel() it first")
        items = self._normalise_schedule(schedule)
        pad = self._check_padding(items, pad_batch_to)
        needs, short = self._plan_needs(items)
        widths = self._check_max_blocks(items, needs, max_blocks)
        if short is not None:
            return None
        for (rid, _), ks in zip(items, needs, strict=True):
            req = self._requests[rid]
            for (m, pool), k in zip(self.pools.items(), ks, strict=True):
                if k:
                    got = pool.allocate(k)
                    assert got is not None  # checked above
                    self._extend_pages(req, m, got)
        self._epoch += 1
        plan = self._build_plan(items, pad, widths)
        self._outstanding = plan
        self._after_mutation()
        return plan

    def _check_padding(self, items: list[tuple[Hashable, int]], pad_batch_to: int | None) -> int:
        if pad_batch_to is None:
            return 0
        if not isinstance(pad_batch_to, int) or pad_batch_to < len(items):
            raise ValueError(f"pad_batch_to: expected an int >= the batch size {len(items)}, got {pad_batch_to!r}")
        if pad_batch_to > len(items) and any(n != 1 for _, n in items):
            raise ValueError("pad_batch_to: padding is for decode steps (one new token per request) only")
        return pad_batch_to - len(items)

    def _check_max_blocks(
        self,
        items: list[tuple[Hashable, int]],
        needs: list[tuple[int, ...]],
        max_blocks: int | Mapping[int, int] | None,
    ) -> dict[int, int] | None:
        """``max_blocks`` as {ratio: width}, None without it; ValueError unless each width covers the pages every
        scheduled request holds after the step: those held (a cancel() can leave more than the step needs) plus its
        ``needs`` (``_plan_needs``)."""
        if max_blocks is None:
            return None
        widths = dict(max_blocks) if isinstance(max_blocks, Mapping) else {m: max_blocks for m in self.pools}
        if set(widths) != set(self.pools):
            raise ValueError(f"max_blocks: expected keys {sorted(self.pools)}, got {sorted(map(repr, widths))}")
        reqs = [self._requests[rid] for rid, _ in items]
        for c, m in enumerate(self.pools):
            w = widths[m]
            need = max(len(r.blocks[m]) + ks[c] for r, ks in zip(reqs, needs, strict=True))
            if not isinstance(w, int) or w < max(1, need):
                raise ValueError(
                    f"max_blocks[{m}]: expected an int >= {max(1, need)} (pages this step needs), got {w!r}"
                )
        return widths

    def _build_plan(
        self, items: list[tuple[Hashable, int]], pad: int = 0, widths: dict[int, int] | None = None
    ) -> StepPlan:
        reqs = [self._requests[rid] for rid, _ in items]
        nr = len(items)
        n_rows = nr + pad
        counts = np.fromiter((n for _, n in items), np.int64, nr)
        starts = np.fromiter((r.num_tokens for r in reqs), np.int64, nr)
        slots = np.fromiter((r.slot for r in reqs), np.int64, nr)
        if pad:
            counts = np.concatenate([counts, np.ones(pad, np.int64)])
            starts = np.concatenate([starts, np.zeros(pad, np.int64)])
            slots = np.concatenate([slots, np.full(pad, -1, np.int64)])
        qstart = np.zeros(n_rows + 1, np.int64)
        np.cumsum(counts, out=qstart[1:])
        if int(qstart[-1]) == n_rows:  # one token a row (decode): the row of token i is i
            row = np.arange(n_rows)
            pos = starts
        else:
            row = np.repeat(np.arange(n_rows), counts)
            pos = np.arange(int(qstart[-1])) - qstart[row] + starts[row]
        end = (starts + counts)[row]  # exclusive end position of the token's request
        token_slots = slots[row]
        real = token_slots >= 0
        ring = self.schema.ring_size
        swa = np.where(real & (pos >= end - ring), token_slots * ring + pos % ring, -1)

        # every int32 field of the plan, sent to the device in one copy (``int32_to_device``)
        names, arrays = [], []

        def put(name: str, a) -> None:
            names.append(name)
            arrays.append(np.asarray(a))  # (integers; int32_to_device makes them int32)

        max_entries = {}
        for m, per_page in self._paging:
            lens = np.zeros(n_rows, np.int64)
            lens[:nr] = self._held[m][slots[:nr]]
            width = widths[m] if widths else max(1, int(lens.max()))
            table = np.full((n_rows, width), -1, dtype=np.int32)  # (the mirror's dtype: no conversion on the way)
            cols = min(width, self._tables[m].shape[1])  # (columns past the mirror's are -1 in every row)
            table[:nr, :cols] = self._tables[m][slots[:nr], :cols]
            entry = pos // m
            emits = real & ((pos + 1) % m == 0)
            page = table[row, np.minimum(entry // per_page, width - 1)].astype(np.int64)
            num_entries = np.where(slots >= 0, (starts + counts) // m, 0)
            put(f"{m}.block_table", table)
            put(f"{m}.block_lens", lens)
            put(f"{m}.num_entries", num_entries)
            put(f"{m}.n_visible", np.where(real, (pos + 1) // m, 0))
            put(f"{m}.emit_slots", np.where(emits & (page >= 0), page * per_page + entry % per_page, -1))
            max_entries[m] = width * per_page if widths else int(num_entries.max())
        put("request_slots", slots)
        put("positions", pos)
        put("request_ids", row)
        put("query_start", qstart)
        put("seq_lens", starts + counts)
        put("token_slots", token_slots)
        put("swa_slots", swa)
        t = dict(zip(names, int32_to_device(arrays, self.device), strict=True))
        ratios = {
            m: RatioPlan(
                ratio=m,
                entries_per_page=pool.entries_per_page,
                **{k: t[f"{m}.{k}"] for k in ("block_table", "block_lens", "num_entries", "n_visible", "emit_slots")},
                max_entries=max_entries[m],
            )
            for m, pool in self.pools.items()
        }
        return StepPlan(
            epoch=self._epoch,
            request_keys=tuple(rid for rid, _ in items),
            slot_ids=tuple(slots[:nr].tolist()),
            num_new_tokens=tuple(counts[:nr].tolist()),
            context_lens=tuple(starts[:nr].tolist()),
            request_slots=t["request_slots"],
            positions=t["positions"],
            request_ids=t["request_ids"],
            query_start=t["query_start"],
            seq_lens=t["seq_lens"],
            token_slots=t["token_slots"],
            swa_slots=t["swa_slots"],
            ratios=ratios,
            num_padded=pad,
        )

    def _check_outstanding(self, plan: StepPlan, what: str) -> None:
        if not isinstance(plan, StepPlan):
            raise ValueError(f"{what}: expected a StepPlan, got {type(plan).__name__}")
        if plan is not self._outstanding:
            raise ValueError(f"{what}: plan {plan.epoch} is not the outstanding plan of this manager")

    def acquire(self, layer_id: int, plan: StepPlan) -> LayerCacheHandle:
        """The handle through which layer ``layer_id`` reads and writes its cache in ``plan``'s step."""
        self._check_outstanding(plan, "acquire")
        ls = self.schema.layer(layer_id)
        paged = self.pools[ls.ratio].layer(layer_id) if ls.ratio else None
        return LayerCacheHandle(
            layer=ls,
            schema=self.schema,
            plan=plan,
            paged=paged,
            state=self.state.layer(layer_id),
            ratio_plan=plan.ratios.get(ls.ratio),
        )

    def commit(self, plan: StepPlan) -> None:
        """The step ran: advance every planned request by its new tokens, then apply deferred frees."""
        self._check_outstanding(plan, "commit")
        for rid, n in zip(plan.request_keys, plan.num_new_tokens, strict=True):
            self._requests[rid].num_tokens += n
        self._close_step()

    def cancel(self, plan: StepPlan) -> None:
        """Drop the outstanding plan without advancing lengths (its pages stay with their requests and
        are reused when the same tokens are planned again).  Deferred frees are applied.

        Cancel a step that has not run, or a decode step (re-running it rewrites the same rows).  A prefill
        chunk that already ran has overwritten ring rows its re-run would read: preempt such requests instead.
        """
        self._check_outstanding(plan, "cancel")
        self._close_step()

    def _close_step(self) -> None:
        self._outstanding = None
        deferred, self._deferred = self._deferred, {}
        for rid, what in deferred.items():
            self._release(rid, preempted=what is _Deferred.PREEMPT)
        self._after_mutation()

    # ------------------------------------------------------------------ release
    def free(self, rid: Hashable) -> bool:
        """Release a finished/aborted request.  Unknown or already-freed ids: no-op, returns False."""
        try:
            hash(rid)
        except TypeError:
            return False
        if rid in self._preempted:
            self._preempted.discard(rid)
            return True
        if rid not in self._requests:
            return False
        if self._in_flight(rid):
            if self._deferred.get(rid) is _Deferred.FREE:
                return False  # already freed (deferred)
            self._deferred[rid] = _Deferred.FREE
            return True
        self._release(rid, preempted=False)
        self._after_mutation()
        return True

    def preempt(self, rid: Hashable) -> bool:
        """Release everything ``rid`` holds but remember it as preempted (re-``add`` to resume).

        No-op returning False for unknown, finished (freed) or already-preempted ids.
        """
        try:
            hash(rid)
        except TypeError:
            return False
        if rid not in self._requests:
            return False
        if self._in_flight(rid):
            if rid in self._deferred:
                return False  # already freed or preempted (deferred)
            self._deferred[rid] = _Deferred.PREEMPT
            return True
        self._release(rid, preempted=True)
        self._after_mutation()
        return True

    # ------------------------------------------------------------------ save / load
    def save(self, rid: Hashable, device: torch.device | str = "cpu") -> RequestSnapshot:
        """Copy every region of ``rid``'s cache (window rings, compressor states, pages) to ``device``
        (``dsv4.cache.snapshot``).  The request stays; ``free`` / ``preempt`` it to give its memory back, and
        ``load`` the snapshot later (here or in another manager of the same model) to go on without recomputing.
        Not while ``rid`` is in the outstanding plan (ValueError: commit or cancel it first).  A copy to another
        device waits for the work queued on the cache's stream (a host copy synchronises); bytes: ``nbytes``."""
        req = self._get(rid)
        if self._in_flight(rid):
            raise ValueError(f"save: request {rid!r} is in the outstanding plan; commit or cancel it first")
        return save_request(self.schema, self.state, self.pools, req.slot, self._filled(req), req.num_tokens, device)

    def _filled(self, req: _Request) -> dict[int, list[int]]:
        """The pages holding ``req``'s committed entries (a cancelled step can leave it more: they hold nothing)."""
        return {m: req.blocks[m][: p.ratio_class.pages_for_tokens(req.num_tokens)] for m, p in self.pools.items()}

    def load(self, rid: Hashable, snapshot: RequestSnapshot) -> bool:
        """Admit ``rid`` with the cache of ``snapshot`` (``save``): a fresh slot and pages, every region copied in,
        ``num_tokens`` = the snapshot's.  False = not now (no free slot or too few free pages), nothing taken.
        ValueError (nothing changed) for an id already active or a snapshot of another model, block size or state
        layout."""
        self._check_new_id(rid)
        check_snapshot(self.schema, self.state, self.pools, snapshot)
        need = {m: pool.ratio_class.pages_for_tokens(snapshot.num_tokens) for m, pool in self.pools.items()}
        taken = self._take_and_load(need, snapshot)
        if taken is None:
            return False
        slot, blocks = taken
        self._preempted.discard(rid)
        self._put_request(rid, _Request(slot=slot, num_tokens=snapshot.num_tokens, blocks=blocks))
        self._after_mutation()
        return True

    def _can_take(self, need: dict[int, int]) -> bool:
        """Whether a slot and ``need[m]`` pages of each ratio class are free."""
        return self.state.num_free_slots > 0 and all(self.pools[m].num_free_pages >= n for m, n in need.items())

    def _take_and_load(self, need: dict[int, int], snap: RequestSnapshot) -> tuple[int, dict[int, list[int]]] | None:
        """A free slot and ``need[m]`` free pages of each ratio class with ``snap`` copied in: (slot, pages), or None
        (not now: too few free; nothing taken).  If a copy raises, the slot and pages go back before the error."""
        if not self._can_take(need):
            return None
        slot, blocks = self.state.allocate(), {}
        try:
            for m, n in need.items():
                blocks[m] = self.pools[m].allocate(n)
            load_request(self.state, self.pools, slot, blocks, snap)
        except Exception:  # (check_snapshot rules this out for load; fork's snapshot is its own)
            self.state.release(slot)
            for m, pages in blocks.items():
                self.pools[m].release(pages)
            raise
        return slot, blocks

    def fork(self, rid: Hashable, new_rid: Hashable, share: bool = True) -> bool:
        """Admit ``new_rid`` with ``rid``'s cache: n samples of one prompt prefill it once.  ``share``: the pages
        both requests have filled (the first ``num_tokens // block_tokens`` of each ratio class: pages are append-only,
        neither request writes them again) are shared, counted per page and freed with their last owner; the window
        rings, the compressor states and the partly filled page are copied into a slot and a page of its own.
        ``share=False``: every page copied.  The copies go through a snapshot on the cache's device (a transient
        second copy of those bytes).  False = not now (no slot or pages), nothing taken; ValueError as ``save``."""
        self._check_new_id(new_rid)
        req = self._get(rid)
        if self._in_flight(rid):
            raise ValueError(f"fork: request {rid!r} is in the outstanding plan; commit or cancel it first")
        n_shared = req.num_tokens // self.schema.block_tokens if share else 0
        tail = {m: pages[n_shared:] for m, pages in self._filled(req).items()}  # the pages copied
        need = {m: len(t) for m, t in tail.items()}
        if not self._can_take(need):
            return False  # (before the snapshot copy: a fork that does not fit copies nothing)
        snap = save_request(self.schema, self.state, self.pools, req.slot, tail, req.num_tokens, self.device)
        slot, blocks = self._take_and_load(need, snap)
        for m in self.pools:
            for p in req.blocks[m][:n_shared]:
                self._shared[m][p] = self._shared[m].get(p, 1) + 1
            blocks[m] = req.blocks[m][:n_shared] + blocks[m]
        self._put_request(new_rid, _Request(slot=slot, num_tokens=req.num_tokens, blocks=blocks))
        self._preempted.discard(new_rid)
        self._after_mutation()
        return True

    def _put_request(self, rid: Hashable, req: _Request) -> None:
        """Make ``req`` the active request ``rid`` and mirror its page ids into row ``req.slot`` of ``_tables``."""
        self._requests[rid] = req
        for m, pages in req.blocks.items():
            self._held[m][req.slot] = 0
            self._extend_pages(req, m, pages, append=False)

    def _extend_pages(self, req: _Request, m: int, pages: list[int], append: bool = True) -> None:
        """Append ``pages`` to ``req``'s ratio-``m`` page ids (``append=False``: they are already its list, only
        mirrored), and to its ``_tables`` row (grown by doubling when a request outgrows the columns)."""
        if append:
            req.blocks[m].extend(pages)
        held, n = int(self._held[m][req.slot]), len(pages)
        table = self._tables[m]
        if held + n > table.shape[1]:
            grown = np.full((table.shape[0], max(2 * table.shape[1], held + n)), -1, np.int32)
            grown[:, : table.shape[1]] = table
            table = self._tables[m] = grown
        table[req.slot, held : held + n] = pages
        self._held[m][req.slot] = held + n

    def _in_flight(self, rid: Hashable) -> bool:
        return self._outstanding is not None and rid in self._outstanding.request_keys

    def _release(self, rid: Hashable, preempted: bool) -> None:
        req = self._requests.pop(rid, None)
        if req is None:
            return
        for m, pages in req.blocks.items():
            self._tables[m][req.slot, : len(pages)] = -1
            self._held[m][req.slot] = 0
            shared, last = self._shared[m], []
            for p in pages:
                owners = shared.pop(p, 1) - 1  # a shared page goes back when its last owner lets go
                if owners > 1:
                    shared[p] = owners
                elif owners == 0:
                    last.append(p)
            self.pools[m].release(last)
        self.state.release(req.slot)
        if preempted:
            self._preempted.add(rid)

    # ------------------------------------------------------------------ accounting
    def stats(self) -> CacheStats:
        pools = {}
        for m, pool in self.pools.items():
            rc = pool.ratio_class
            used = pool.num_used_pages
            pools[m] = PoolStats(
                ratio=m,
                pages_total=pool.num_pages,
                pages_used=used,
                pages_free=pool.num_free_pages,
                entries_stored=sum(rc.entries_for_tokens(r.num_tokens) for r in self._requests.values()),
                entries_capacity_used=used * rc.entries_per_page,
                bytes_total=pool.num_pages * rc.block_bytes,
                bytes_used=used * rc.block_bytes,
            )
        n_slots = self.state.num_slots
        fixed = self.schema.per_request_fixed_bytes_by_region()
        entry_bytes = sum(p.num_pages * p.ratio_class.entry_page_bytes * len(p.layers) for p in self.pools.values())
        key_bytes = sum(p.num_pages * p.ratio_class.key_page_bytes * len(p.layers) for p in self.pools.values())
        return CacheStats(
            requests_active=len(self._requests),
            requests_preempted=len(self._preempted),
            slots_total=n_slots,
            slots_used=n_slots - self.state.num_free_slots,
            tokens_cached=sum(r.num_tokens for r in self._requests.values()),
            pools=pools,
            bytes_by_region={
                "compressed_entries": entry_bytes,
                "indexer_keys": key_bytes,
                **{k: v * n_slots for k, v in fixed.items()},
            },
        )

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless every page and slot is free or owned exactly once (a page ``fork`` shared:
        by as many requests as its count says)."""
        for m, pool in self.pools.items():
            free = pool.free_page_ids()
            owners = collections.Counter(p for r in self._requests.values() for p in r.blocks[m])
            many = {p: c for p, c in owners.items() if c > 1}
            if many != self._shared[m]:
                raise InvariantError(f"ratio {m} pages: shared {self._shared[m]} but held by {many} requests")
            _check_partition(f"ratio {m} pages", pool.num_pages, free, sorted(owners))
            for rid, r in self._requests.items():
                need = pool.ratio_class.pages_for_tokens(r.num_tokens)
                if len(r.blocks[m]) < need:
                    raise InvariantError(f"request {rid!r} holds {len(r.blocks[m])} ratio-{m} pages < {need} needed")
        slots = [r.slot for r in self._requests.values()]
        _check_partition("state slots", self.state.num_slots, self.state.free_slot_ids(), slots)
        for m, table in self._tables.items():  # the block-table mirror: each active row its list, every other row -1
            want = np.full_like(table, -1)
            for r in self._requests.values():
                want[r.slot, : len(r.blocks[m])] = r.blocks[m]
            held = np.zeros_like(self._held[m])
            for r in self._requests.values():
                held[r.slot] = len(r.blocks[m])
            if not np.array_equal(table, want) or not np.array_equal(self._held[m], held):
                raise InvariantError(f"ratio {m}: the host block-table mirror differs from the requests' page lists")
        both = self._preempted & set(self._requests)
        if both:
            raise InvariantError(f"requests both active and preempted: {sorted(map(repr, both))}")
        stray = set(self._deferred) - set(self._requests)
        if stray:
            raise InvariantError(f"deferred releases of unknown requests: {sorted(map(repr, stray))}")

    def _after_mutation(self) -> None:
        if self.debug:
            self.check_invariants()


def _check_partition(what: str, total: int, free: list[int], owned: list[int]) -> None:
    ids = free + owned
    if len(ids) != total or sorted(ids) != list(range(total)):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        missing = sorted(set(range(total)) - set(ids))
        raise InvariantError(
            f"{what}: free ({len(free)}) + owned ({len(owned)}) != total ({total}); duplicated {dup[:8]}, "
            f"missing {missing[:8]}"
        )
