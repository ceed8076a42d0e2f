"""A small continuous-batching engine over the cache manager and the attention sub-blocks.

The "model" is a residual stack of the config's attention layers (by default *every* cache layer,
the MTP layers included, in id order; ``layers=`` picks a subset), with seeded random weights and no
FFN / MoE, embedding or head::

    h_0 = x                       (x: the token's input embedding, bf16; h kept in fp32)
    h_l = h_{l-1} + attn_l(rms_norm(h_{l-1}) as bf16)        for every layer l of the stack
    out = h_L                     (the token's final hidden state, fp32)

Requests.  ``Request(id, prompt_len, max_new_tokens, arrival_step)``: the prompt is ``prompt_len``
seeded random embeddings (unit RMS).  The step that computes a request's last known input "generates"
a token: its next input is ``rms_norm(out)`` of that last token, rounded to bf16 (autoregression
without a vocabulary).  A request feeds ``prompt_len + max_new_tokens - 1`` inputs in all and finishes
when it has generated ``max_new_tokens`` tokens.  Every input is recorded, so the dense check replays
exactly what the engine fed.

One step (``EngineRunner.step``):

1. admit: waiting requests (preempted ones first, then arrivals, FIFO) are ``add``-ed while a slot is
   free and every ratio class has the pages of the request's first chunk free.  A preempted request
   is only re-admitted after some request has finished since its preemption (or when nothing runs):
   this keeps the engine from re-admitting a victim straight into the same shortage.
2. schedule: decodes first (requests with one pending input), then prefill chunks of at most
   ``prefill_chunk`` tokens, all within ``token_budget`` tokens; admission order.
3. ``plan``; on None ("pages short") preempt the most recently admitted running request (whether or
   not it is in the schedule) and retry.  A preempted request loses its cache; after re-admission its
   recorded inputs are recomputed in prefill chunks (their outputs are overwritten; the largest change
   is reported as ``recompute_max_diff``).  With ``swap=True`` its cache is first saved to the host
   (``KVCacheManager.save``) and re-admission ``load``s it: nothing is recomputed (``swapped_bytes``).
4. run the stack: every layer through ``acquire(layer, plan)``; ``commit``.
5. generate / finish: ``free`` finished requests; ``check_invariants`` (when enabled).

Verification (``verify``): for every finished request, the dense reference of the stack
(``dsv4.reference.dense.dense_attention`` layer by layer over the request's full recorded input)
against the engine's per-token final hidden states: max and mean |Δ|, pass iff both are within
``Tolerance``.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from dsv4.cache.manager import CacheStats, KVCacheManager
from dsv4.cache.plan import StepPlan
from dsv4.cache.snapshot import RequestSnapshot
from dsv4.config import ModelConfig
from dsv4.kernels.dispatch import BACKENDS
from dsv4.model import functional as F
from dsv4.model.attention import AttentionSubBlock
from dsv4.model.weights import random_attention_weights
from dsv4.reference.dense import dense_attention

__all__ = [
    "EngineRunner",
    "Request",
    "RequestResult",
    "RunResult",
    "StepInfo",
    "Tolerance",
    "make_workload",
    "memory_by_layer_kind",
]

_LAYER_SEED_STRIDE = 1_000_003  # weights of layer l use seed * stride + l (distinct per layer)


@dataclass(frozen=True)
class Request:
    """A request of the workload: ``prompt_len`` prompt tokens, then ``max_new_tokens`` generated ones;
    it becomes visible to the engine at step ``arrival_step``."""

    id: Hashable
    prompt_len: int
    max_new_tokens: int
    arrival_step: int = 0
    samples: int = 1  # continuations of the prompt: samples - 1 forks (ids (id, k)) once the prompt is cached

    def __post_init__(self) -> None:
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"Request {self.id!r}: expected samples >= 1, got {self.samples!r}")
        if not isinstance(self.prompt_len, int) or self.prompt_len < 1:
            raise ValueError(f"Request {self.id!r}: expected prompt_len >= 1, got {self.prompt_len!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"Request {self.id!r}: expected max_new_tokens >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.arrival_step, int) or self.arrival_step < 0:
            raise ValueError(f"Request {self.id!r}: expected arrival_step >= 0, got {self.arrival_step!r}")

    @property
    def total_inputs(self) -> int:
        """Inputs the request feeds in all (prompt + every generated token but the last)."""
        return self.prompt_len + self.max_new_tokens - 1


@dataclass(frozen=True)
class Tolerance:
    """Pass criteria of the dense check (|Δ| in absolute units; activations are O(0.2) per layer).

    Two checks, both must pass:

    - ``layer_*`` (the sharp one): each layer's cached output against ``dense_attention`` of that
      layer applied to the *engine's own* recorded input of that layer (teacher forcing).  The two
      paths share every cache-independent function; they differ by bf16 rounding only: an output
      element is at most an ulp or two off (0.0078 at O(1), 0.0156 at O(2-4)).  Some decode tokens
      have ~50% of their elements one ulp off (cause not isolated; consistent with a different fp32
      reduction order in the gathered vs masked-dense attention, whose bf16-rounded output the
      o-projection spreads over every channel), which lifts a short request's mean to ~5e-4.  Measured on
      ``tiny`` (5 layers, torch backend, with preemptions): max ≤ 0.0156, mean ≤ 5.2e-4.  Bounds:
      0.05 / 3e-3 (≈ every element one ulp off); a wrong position, a lost or stale cache entry or a
      bad recompute moves outputs by O(0.1).
    - ``max_abs`` / ``mean_abs`` (end to end): final hidden states against the dense stack run on the
      request's recorded inputs only.  The stack amplifies ulp-level differences: a 1-ulp change in
      the layer input can flip an FP8 (3 mantissa bits) rounding, a UE8M0 block scale or a near-tie
      in the CSA top-k.  Measured: perturbing 1% of layer 0's outputs of the *dense* stack by one
      ulp changes its final states by max 0.21, mean 0.011 (attention contribution ≈ 0.55);
      engine vs dense stack measured max ≤ 0.28, mean ≤ 8.6e-3 (seeds 0-2 of ``dsv4 demo``).
      Bounds: 0.5 / 0.03.
    """

    max_abs: float = 0.5
    mean_abs: float = 0.03
    layer_max_abs: float = 0.05
    layer_mean_abs: float = 3e-3


@dataclass
class _Live:
    req: Request
    inputs: torch.Tensor  # [total_inputs, dim] bf16, rows [0, n_inputs) known
    outputs: torch.Tensor  # [total_inputs, dim] fp32, rows [0, max_computed) valid
    layer_in: torch.Tensor  # [total_inputs, n_layers, dim] bf16: each layer's input (after the norm)
    layer_out: torch.Tensor  # [total_inputs, n_layers, dim] bf16: each layer's attention output
    n_inputs: int
    num_computed: int = 0  # tokens in the cache now (0 after a preemption)
    max_computed: int = 0  # tokens ever computed (outputs recorded)
    generated: int = 0
    order: int = -1  # admission counter of the latest add
    preemptions: int = 0
    preempted_at_finish_count: int | None = None  # finishes seen when last preempted
    recomputed_tokens: int = 0
    recompute_max_diff: float = 0.0
    admitted_step: int | None = None
    finished_step: int | None = None
    snapshot: RequestSnapshot | None = None  # its cache while swapped out (swap=True)
    sample: int = 0  # k of a forked continuation (id (parent id, k)); 0: the request itself
    forked: bool = False  # its samples were created

    @property
    def pending(self) -> int:
        return self.n_inputs - self.num_computed


@dataclass(frozen=True)
class StepInfo:
    """What one step did.  ``schedule``: (request id, new tokens) in batch order."""

    step: int
    schedule: tuple[tuple[Hashable, int], ...]
    admitted: tuple[Hashable, ...]
    preempted: tuple[Hashable, ...]
    finished: tuple[Hashable, ...]
    running: int
    waiting: int
    finished_total: int
    pages_used: dict[int, int]
    pages_total: dict[int, int]
    seconds: float


@dataclass(frozen=True)
class RequestResult:
    """The dense check of one finished request (``max_abs``/``mean_abs``: |Δ| of final hidden states)."""

    id: Hashable
    prompt_len: int
    max_new_tokens: int
    tokens: int
    preemptions: int
    recomputed_tokens: int
    recompute_max_diff: float
    max_abs: float
    mean_abs: float
    ref_scale: float  # mean |h_L - x| of the reference: the scale of what the attention stack added
    layer_max_abs: float  # worst layer: |y_l - dense_l(engine's input of layer l)|, max
    layer_mean_abs: float  # worst layer: the same, mean
    passed: bool


@dataclass
class RunResult:
    """Statistics of a run and, after ``verify``, the per-request checks."""

    steps: int = 0
    idle_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens, first computation
    decode_tokens: int = 0  # generated tokens fed back, first computation
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    preemptions: int = 0
    swapped_bytes: int = 0  # cache bytes saved to the host at preemptions (swap=True)
    forked_tokens: int = 0  # prompt tokens a sample got by ``fork`` instead of computing them
    finished: int = 0
    wall_s: float = 0.0
    peak_pages_used: dict[int, int] = field(default_factory=dict)  # ratio -> most pages in use at once
    peak_bytes_used_by_kind: dict[str, int] = field(default_factory=dict)  # layer kind -> most bytes in use
    peak_running: int = 0
    verify_s: float = 0.0
    requests: list[RequestResult] = field(default_factory=list)
    tolerance: Tolerance = field(default_factory=Tolerance)

    @property
    def tokens(self) -> int:
        """Every token the engine computed (recomputation included)."""
        return self.prefill_tokens + self.decode_tokens + self.recomputed_tokens

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.requests) and all(r.passed for r in self.requests)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["requests"] = [dict(asdict(r), id=str(r.id)) for r in self.requests]
        d["peak_pages_used"] = {str(k): v for k, v in self.peak_pages_used.items()}
        d.update(tokens=self.tokens, tokens_per_s=self.tokens_per_s, all_passed=self.all_passed)
        return d


def make_workload(
    n: int,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (16, 320),
    new_tokens: tuple[int, int] = (4, 16),
    arrival_every: int = 3,
) -> list[Request]:
    """``n`` seeded requests: prompt lengths and new-token counts uniform in the inclusive ranges,
    request ``i`` arriving at a random step in ``[0, i * arrival_every]`` (sorted by arrival)."""
    if n < 1:
        raise ValueError(f"n: expected >= 1 requests, got {n}")
    gen = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    reqs = [Request(i, draw(*prompt_len), draw(*new_tokens), draw(0, i * arrival_every) if i else 0) for i in range(n)]
    return sorted(reqs, key=lambda r: (r.arrival_step, r.id))


def memory_by_layer_kind(manager: KVCacheManager, stats: CacheStats | None = None) -> dict[str, dict[str, int]]:
    """Allocated and in-use bytes of ``manager``'s cache per layer kind ("swa" | "csa" | "hca").

    Per layer: its window ring + ring metadata + compressor state for every slot, plus its share of
    the pages of its ratio class.  "used" counts occupied slots and used pages only.
    """
    schema, st = manager.schema, stats or manager.stats()
    out: dict[str, dict[str, int]] = {}
    for ls in schema.layers:
        per_slot = schema.ring_page_bytes + schema.ring_meta_bytes + schema.compressor_state_bytes(ls.layer_id)
        alloc, used = per_slot * st.slots_total, per_slot * st.slots_used
        if ls.ratio:
            rc, ps = schema.ratio_classes[ls.ratio], st.pools[ls.ratio]
            alloc += ps.pages_total * rc.layer_page_bytes
            used += ps.pages_used * rc.layer_page_bytes
        k = out.setdefault(ls.kind.value, {"layers": 0, "bytes_allocated": 0, "bytes_used": 0})
        k["layers"] += 1
        k["bytes_allocated"] += alloc
        k["bytes_used"] += used
    return out


class EngineRunner:
    """Continuous batching of ``Request``s over a ``KVCacheManager`` (see module docstring).

    Args:
        cfg: the model config.
        max_requests: state slots (requests holding cache at once).
        num_pages: pages per ratio class (int or ``{ratio: pages}``); or give ``budget_bytes`` instead.
        budget_bytes: size the pools with ``KVCacheManager.from_memory_budget``.
        block_tokens: raw tokens per page.
        prefill_chunk: most tokens of one request in one step.
        token_budget: most tokens of one step (decodes are scheduled first).
        device: where weights, activations and the cache live.
        backend: "auto" | "torch" | "triton", passed to every sub-block.
        seed: weights (per layer), prompts (per request id).
        layers: the stack's layer ids (default: every cache layer of ``cfg``, MTP included).
        check_invariants: call ``manager.check_invariants()`` after every step.
        swap: a preempted request's cache goes to the host and comes back on re-admission (no recompute).
        fp8_weights: the layers' linear weights kept FP8 as a checkpoint stores them (``random_attention_weights``'s
            ``fp8``; the projections then run ``kernels.fp8_linear``; the dense reference dequantises them).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_requests: int = 4,
        num_pages: int | Mapping[int, int] | None = None,
        budget_bytes: int | None = None,
        block_tokens: int = 128,
        prefill_chunk: int = 64,
        token_budget: int = 128,
        device: torch.device | str = "cpu",
        backend: str = "auto",
        seed: int = 0,
        layers: Sequence[int] | None = None,
        check_invariants: bool = True,
        swap: bool = False,
        fp8_weights: bool = False,
    ) -> None:
        if (num_pages is None) == (budget_bytes is None):
            raise ValueError("EngineRunner: give exactly one of num_pages and budget_bytes")
        if prefill_chunk < 1 or token_budget < 1:
            raise ValueError(f"prefill_chunk, token_budget: expected >= 1, got {prefill_chunk}, {token_budget}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        self.cfg, self.device, self.backend, self.seed = cfg, torch.device(device), backend, seed
        self.prefill_chunk, self.token_budget = prefill_chunk, token_budget
        self.check = check_invariants
        self.swap = swap
        kw = dict(max_requests=max_requests, block_tokens=block_tokens, device=self.device)
        if budget_bytes is not None:
            self.manager = KVCacheManager.from_memory_budget(cfg, budget_bytes=budget_bytes, **kw)
        else:
            self.manager = KVCacheManager(cfg, num_pages=num_pages, **kw)
        self.layers = tuple(range(cfg.num_cache_layers)) if layers is None else tuple(layers)
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"layers: expected a non-empty sequence of distinct layer ids, got {layers!r}")
        for i in self.layers:
            cfg.ratio(i)  # validates
        self.weights = {
            i: random_attention_weights(cfg, i, seed=seed * _LAYER_SEED_STRIDE + i, device=self.device, fp8=fp8_weights)
            for i in self.layers
        }
        self.blocks = {i: AttentionSubBlock(cfg, i, self.weights[i], backend=backend) for i in self.layers}
        # the layers' own weights (views of their stacks, STACK_PROJECTIONS: the same values, no second copy)
        self.weights = {i: blk.w for i, blk in self.blocks.items()}

        self.step_no = 0
        self.result = RunResult()
        self._future: list[Request] = []  # not yet arrived, sorted by arrival
        self._waiting: deque[_Live] = deque()  # arrived (or preempted), not admitted
        self._running: dict[Hashable, _Live] = {}  # admitted, admission order
        self._finished: dict[Hashable, _Live] = {}
        self._ids: set[Hashable] = set()
        self._admissions = 0

    # ------------------------------------------------------------------ workload
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests (ids must be unique over the runner's life).  The whole batch is checked first: a
        ValueError (a duplicate id, one too long for the model or for the whole cache) queues none of it."""
        batch, ids = list(requests), set(self._ids)
        for r in batch:
            if not isinstance(r, Request):
                raise ValueError(f"requests: expected Request items, got {type(r).__name__}")
            if r.id in ids:
                raise ValueError(f"Request {r.id!r}: duplicate id")
            if r.total_inputs > self.cfg.max_seq_len:
                raise ValueError(f"Request {r.id!r}: {r.total_inputs} tokens exceed max_seq_len={self.cfg.max_seq_len}")
            for m, pool in self.manager.pools.items():
                need = pool.ratio_class.pages_for_tokens(r.total_inputs)
                if need > pool.num_pages:
                    raise ValueError(
                        f"Request {r.id!r}: {r.total_inputs} tokens need {need} ratio-{m} pages, the cache has "
                        f"{pool.num_pages}: it could never run"
                    )
            children = [(r.id, k) for k in range(1, r.samples)]
            if any(c in ids for c in children):
                raise ValueError(f"Request {r.id!r}: a sample id (id, k) is taken")
            ids.update([r.id, *children])
        self._ids = ids
        self._future.extend(batch)
        self._future.sort(key=lambda r: r.arrival_step)

    @property
    def done(self) -> bool:
        return not (self._future or self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_finished(self) -> int:
        return len(self._finished)

    def _prompt(self, req: Request) -> torch.Tensor:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/prompt/{req.id!r}".encode()))
        x = torch.randn(req.prompt_len, self.cfg.dim, generator=gen)
        return x.to(device=self.device, dtype=torch.bfloat16)

    def _arrive(self) -> None:
        while self._future and self._future[0].arrival_step <= self.step_no:
            req = self._future.pop(0)
            n, nl, dim, dev = req.total_inputs, len(self.layers), self.cfg.dim, self.device
            live = _Live(
                req=req,
                inputs=torch.zeros(n, dim, dtype=torch.bfloat16, device=dev),
                outputs=torch.zeros(n, dim, dtype=torch.float32, device=dev),
                layer_in=torch.zeros(n, nl, dim, dtype=torch.bfloat16, device=dev),
                layer_out=torch.zeros(n, nl, dim, dtype=torch.bfloat16, device=dev),
                n_inputs=req.prompt_len,
            )
            live.inputs[: req.prompt_len] = self._prompt(req)
            self._waiting.append(live)

    # ------------------------------------------------------------------ one step
    def _first_chunk_fits(self, live: _Live) -> bool:
        n = min(live.pending, self.prefill_chunk)
        for pool in self.manager.pools.values():
            if pool.ratio_class.pages_for_tokens(n) > pool.num_free_pages:
                return False
        return True

    def _admit(self) -> list[Hashable]:
        admitted = []
        while self._waiting and self.manager.can_add():
            live = self._waiting[0]
            if live.preempted_at_finish_count is not None and self._running:
                if self.num_finished <= live.preempted_at_finish_count:
                    break  # resume only after something finished since the preemption
            if live.snapshot is not None:  # swapped out: its cache comes back as it was (False: not now)
                if not self.manager.load(live.req.id, live.snapshot):
                    break
                live.snapshot = None
            elif self._running and not self._first_chunk_fits(live):
                break
            elif not self.manager.add(live.req.id):
                break
            self._waiting.popleft()
            live.order = self._admissions
            self._admissions += 1
            if live.admitted_step is None:
                live.admitted_step = self.step_no
            self._running[live.req.id] = live
            admitted.append(live.req.id)
        return admitted

    def _schedule(self) -> list[tuple[Hashable, int]]:
        budget = self.token_budget
        sched = []
        by_order = sorted(self._running.values(), key=lambda r: r.order)
        for live in by_order:  # decodes first
            if live.pending == 1 and live.num_computed > 0 and budget > 0:
                sched.append((live.req.id, 1))
                budget -= 1
        chosen = {rid for rid, _ in sched}
        for live in by_order:
            if live.req.id in chosen or budget <= 0:
                continue
            n = min(live.pending, self.prefill_chunk, budget)
            sched.append((live.req.id, n))
            budget -= n
        return sched

    def _preempt_one(self) -> Hashable:
        victim = max(self._running.values(), key=lambda r: r.order)
        self._preempt(victim, self.swap)
        return victim.req.id

    def _preempt(self, victim: _Live, swap: bool) -> None:
        """Take ``victim`` off the GPU: its cache saved to the host (``swap``) or dropped (recomputed later)."""
        rid = victim.req.id
        if swap:
            victim.snapshot = self.manager.save(rid, "cpu")
            self.result.swapped_bytes += victim.snapshot.nbytes
        self.manager.preempt(rid)
        del self._running[rid]
        if not swap:
            victim.num_computed = 0
        victim.preemptions += 1
        victim.preempted_at_finish_count = self.num_finished
        self._waiting.appendleft(victim)
        self.result.preemptions += 1

    def _plan(self, sched: list[tuple[Hashable, int]], preempted: list[Hashable]) -> StepPlan | None:
        while True:
            sched[:] = [(rid, n) for rid, n in sched if rid in self._running]
            if not sched:
                return None
            plan = self.manager.plan(sched)
            if plan is not None:
                return plan
            if len(self._running) == 1:
                only = next(iter(self._running))
                raise RuntimeError(
                    f"request {only!r} alone does not fit the cache ({self.manager.stats().pools}); "
                    "give the engine more pages"
                )
            preempted.append(self._preempt_one())

    def forward(self, x: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stack over one step's tokens: x [T, dim] bf16 (plan order) -> (final hidden [T, dim] fp32,
        layer inputs [T, n_layers, dim] bf16, layer outputs [T, n_layers, dim] bf16)."""
        plan.begin_forward()  # what the layers share is computed once in this pass
        h = x.float()
        ins, outs = [], []
        for i in self.layers:
            a = F.rms_norm(h, None, self.cfg.norm_eps).to(torch.bfloat16)
            y = self.blocks[i](a, self.manager.acquire(i, plan))
            h = h + y.float()
            ins.append(a)
            outs.append(y)
        return h, torch.stack(ins, 1), torch.stack(outs, 1)

    def step(self) -> StepInfo:
        """Run one engine step (see module docstring); an idle step when nothing can run."""
        t0 = time.perf_counter()
        self._arrive()
        admitted = self._admit()
        preempted: list[Hashable] = []
        finished: list[Hashable] = []
        sched = self._schedule()
        plan = self._plan(sched, preempted) if sched else None
        if plan is None:
            self.result.idle_steps += 1
        else:
            rows = [(self._running[rid], n) for rid, n in sched]
            x = torch.cat([live.inputs[live.num_computed : live.num_computed + n] for live, n in rows])
            try:
                out, l_in, l_out = self.forward(x, plan)
            except Exception:
                # the step's layers may have written part of its tokens: its requests drop their caches (recomputed
                # when readmitted), the plan is cancelled, and the error goes up with nothing leaked
                for rid, _ in sched:
                    self._preempt(self._running[rid], swap=False)
                self.manager.cancel(plan)
                raise
            self.manager.commit(plan)
            self._track_peaks()
            off = 0
            for rid, n in sched:
                live = self._running[rid]
                live.layer_in[live.num_computed : live.num_computed + n] = l_in[off : off + n]
                live.layer_out[live.num_computed : live.num_computed + n] = l_out[off : off + n]
                self._record(live, out[off : off + n])
                off += n
                if live.num_computed == live.req.prompt_len and live.req.samples > 1 and not live.forked:
                    self._fork_samples(live)
                if live.num_computed == live.n_inputs:
                    self._generate(live)
                if live.generated == live.req.max_new_tokens:
                    self.manager.free(rid)
                    del self._running[rid]
                    live.finished_step = self.step_no
                    self._finished[rid] = live
                    finished.append(rid)
            self.result.finished = self.num_finished
        if self.check:
            self.manager.check_invariants()
        st = self.manager.stats()
        used = {m: p.pages_used for m, p in st.pools.items()}
        r = self.result
        dt = time.perf_counter() - t0
        r.wall_s += dt
        r.steps += 1
        info = StepInfo(
            step=self.step_no,
            schedule=tuple(sched) if plan is not None else (),
            admitted=tuple(admitted),
            preempted=tuple(preempted),
            finished=tuple(finished),
            running=len(self._running),
            waiting=len(self._waiting) + len(self._future),
            finished_total=self.num_finished,
            pages_used=used,
            pages_total={m: p.pages_total for m, p in st.pools.items()},
            seconds=dt,
        )
        self.step_no += 1
        return info

    def _track_peaks(self) -> None:
        """Record the high-water marks (after a commit, before finished requests are freed)."""
        r, st = self.result, self.manager.stats()
        for m, p in st.pools.items():
            r.peak_pages_used[m] = max(r.peak_pages_used.get(m, 0), p.pages_used)
        for k, v in memory_by_layer_kind(self.manager, st).items():
            r.peak_bytes_used_by_kind[k] = max(r.peak_bytes_used_by_kind.get(k, 0), v["bytes_used"])
        r.peak_running = max(r.peak_running, len(self._running))

    def _record(self, live: _Live, out: torch.Tensor) -> None:
        n = out.shape[0]
        a, b = live.num_computed, live.num_computed + n
        redo = min(b, live.max_computed) - a  # tokens computed before a preemption
        if redo > 0:
            d = (out[:redo] - live.outputs[a : a + redo]).abs().max().item()
            live.recompute_max_diff = max(live.recompute_max_diff, d)
            live.recomputed_tokens += redo
            self.result.recomputed_tokens += redo
        first = max(a, live.max_computed)  # tokens [first, b) are computed for the first time
        p = live.req.prompt_len
        self.result.prefill_tokens += max(0, min(b, p) - first)
        self.result.decode_tokens += max(0, b - max(first, p))
        live.outputs[a:b] = out
        live.num_computed = b
        live.max_computed = max(live.max_computed, b)

    def _generate(self, live: _Live) -> None:
        live.generated += 1
        if live.generated < live.req.max_new_tokens:
            last = live.outputs[live.n_inputs - 1]
            nxt = F.rms_norm(last, None, self.cfg.norm_eps)
            if live.sample:  # a sample's own continuation: the next input plus its own seeded noise
                gen = torch.Generator().manual_seed(
                    zlib.crc32(f"{self.seed}/sample/{live.req.id!r}/{live.generated}".encode())
                )
                nxt = nxt + 0.5 * torch.randn(nxt.shape, generator=gen).to(nxt.device)
            live.inputs[live.n_inputs] = nxt.to(torch.bfloat16)
            live.n_inputs += 1

    def _fork_samples(self, live: _Live) -> None:
        """The prompt of ``live`` is cached: give each of its samples the cache by ``KVCacheManager.fork`` (filled
        pages shared) and its recorded prompt rows; a sample that does not fit now waits as a request of its own
        and computes the prompt itself."""
        live.forked = True
        for k in range(1, live.req.samples):
            req = dataclasses.replace(live.req, id=(live.req.id, k), samples=1)
            p = req.prompt_len
            child = _Live(
                req=req,
                inputs=live.inputs.clone(),
                outputs=live.outputs.clone(),
                layer_in=live.layer_in.clone(),
                layer_out=live.layer_out.clone(),
                n_inputs=p,
                sample=k,
                forked=True,
            )
            if not self.manager.fork(live.req.id, req.id):
                self._waiting.append(child)
                continue
            child.num_computed = child.max_computed = p
            child.order, child.admitted_step = self._admissions, self.step_no
            self._admissions += 1
            self.result.forked_tokens += p
            self._generate(child)
            if child.generated == req.max_new_tokens:  # one new token: the prompt's output was all it needed
                self.manager.free(req.id)
                child.finished_step = self.step_no
                self._finished[req.id] = child
            else:
                self._running[req.id] = child

    # ------------------------------------------------------------------ whole runs
    def run(
        self,
        requests: Iterable[Request] = (),
        *,
        on_step: Callable[[StepInfo, EngineRunner], None] | None = None,
        max_steps: int = 100_000,
    ) -> RunResult:
        """Submit ``requests`` and step until every request has finished."""
        self.submit(requests)
        while not self.done:
            if self.step_no >= max_steps:
                raise RuntimeError(f"run: not done after {max_steps} steps")
            if not self._running and not self._waiting and self._future:
                self.step_no = max(self.step_no, self._future[0].arrival_step)  # nothing to do until then
            info = self.step()
            if on_step is not None:
                on_step(info, self)
        return self.result

    def dense_stack(self, x: torch.Tensor) -> torch.Tensor:
        """The dense reference of the stack: x [T, dim] bf16 (positions 0..T-1) -> final hidden [T, dim] fp32."""
        h = x.float()[None]
        for i in self.layers:
            a = F.rms_norm(h, None, self.cfg.norm_eps).to(torch.bfloat16)
            h = h + dense_attention(self.cfg, i, self.weights[i], a).float()
        return h[0]

    def verify(self, tolerance: Tolerance | None = None) -> list[RequestResult]:
        """Dense check of every finished request (see module docstring); stored in ``result.requests``."""
        tol = tolerance or self.result.tolerance
        t0 = time.perf_counter()
        out = []
        for live in self._finished.values():
            n = live.n_inputs
            x = live.inputs[:n]
            ref = self.dense_stack(x)
            d = (live.outputs[:n] - ref).abs()
            mx, mean = d.max().item(), d.mean().item()
            l_max = l_mean = 0.0
            for j, i in enumerate(self.layers):  # each layer on the engine's own recorded layer input
                y = dense_attention(self.cfg, i, self.weights[i], live.layer_in[None, :n, j])[0]
                dl = (live.layer_out[:n, j].float() - y.float()).abs()
                l_max, l_mean = max(l_max, dl.max().item()), max(l_mean, dl.mean().item())
            passed = mx <= tol.max_abs and mean <= tol.mean_abs
            passed = passed and l_max <= tol.layer_max_abs and l_mean <= tol.layer_mean_abs
            out.append(
                RequestResult(
                    id=live.req.id,
                    prompt_len=live.req.prompt_len,
                    max_new_tokens=live.req.max_new_tokens,
                    tokens=n,
                    preemptions=live.preemptions,
                    recomputed_tokens=live.recomputed_tokens,
                    recompute_max_diff=live.recompute_max_diff,
                    max_abs=mx,
                    mean_abs=mean,
                    ref_scale=(ref - x.float()).abs().mean().item(),
                    layer_max_abs=l_max,
                    layer_mean_abs=l_mean,
                    passed=passed,
                )
            )
        self.result.tolerance = tol
        self.result.requests = out
        self.result.verify_s = time.perf_counter() - t0
        return out
