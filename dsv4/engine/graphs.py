"""CUDA-graph capture of a decode step of a stack of attention sub-blocks (design §2, performance §graphs).

A decode step (every request advances by one token) has shapes that depend on the batch size only once
the plan is padded to a fixed batch (``pad_batch_to``) and its block tables to a fixed width
(``max_blocks``, hence a static ``max_entries``).  ``DecodeGraphRunner`` captures one graph per
batch-size bucket::

    capture():  for each bucket (largest first, one memory pool for all):
        plan a dummy request padded to the bucket -> the bucket's *static plan* (its device tensors are
        the graph's static buffers; every row is then overwritten as a padded row, so warm-up and
        capture write nothing); acquire every layer's handle on it (they reference the static plan's
        tensors); warm up eagerly (Triton compiles, lazy tables such as the Hadamard matrix are built);
        capture ``decode_stack(layers, handles, static_x)``; cancel the plan, free the dummy request.
    step(schedule, x):  host: plan the real step padded to the smallest bucket >= B (pages are allocated
        here, and the plan carries the write slots of the compressed entries it emits);
        ``static_plan.load_(plan)`` (device-to-device copies), copy x into the static input, replay;
        return rows [:B].  The caller commits (``manager.commit(manager.outstanding_plan)``).

What must be equal between capture and replay: every tensor the captured code reads is either a
static plan tensor (reloaded each step), the static input, a weight, or the cache itself; host fields the
forward reads (``num_tokens``, ``is_decode``, ``max_entries``, ``batch_size``) are fixed by the bucket and
``max_blocks``.  Inside the graph nothing syncs with the host; tensors the forward allocates come from
the graph's private pool at capture time (no allocation at replay).

``capture=False`` runs the same machinery without a graph: ``step`` calls ``decode_stack`` eagerly on
the static plan and handles.  It needs no CUDA, so the CPU test-suite checks the bucket, padding and
static-buffer logic with it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from dsv4.cache.handle import LayerCacheHandle
from dsv4.cache.manager import KVCacheManager
from dsv4.cache.plan import StepPlan
from dsv4.errors import check_same_device
from dsv4.model import functional as F
from dsv4.model.attention import AttentionSubBlock

__all__ = ["DecodeGraphRunner", "capture_graph", "decode_stack", "pick_bucket"]


def capture_graph(fn: Callable[[], object], *, warmup: int = 1, calls: int = 1, pool=None):
    """Capture ``calls`` back-to-back calls of ``fn`` in a CUDA graph after ``warmup`` eager calls on a side
    stream (torch.cuda.graphs' recipe: Triton compiles and caches warm up outside the capture).

    Returns ``(graph, result of the last captured call)``; the result's tensors are the graph's static outputs.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(g, pool=pool):
        for _ in range(calls):
            out = fn()
    return g, out


def decode_stack(
    layers: Sequence[AttentionSubBlock], handles: Sequence[LayerCacheHandle], x: torch.Tensor
) -> torch.Tensor:
    """The residual attention stack of ``dsv4.engine.runner`` over one step, as a plain function (eager
    or under capture): ``h = x; h += layer(rms_norm(h) as bf16)`` per layer.

    x [T, dim] bf16 (plan order) -> final hidden [T, dim] fp32.  ``handles[i]`` is layer i's handle.
    """
    if handles:
        handles[0].plan.begin_forward()  # what the layers share is computed once in this pass (in the graph)
    h = x.float()
    for blk, handle in zip(layers, handles, strict=True):
        a = F.rms_norm(h, None, blk.cfg.norm_eps).to(torch.bfloat16)
        h = h + blk(a, handle).float()
    return h


def pick_bucket(buckets: Sequence[int], batch: int) -> int:
    """The smallest bucket >= ``batch`` (``buckets`` ascending); ValueError when none fits."""
    if batch < 1:
        raise ValueError(f"batch: expected >= 1 requests, got {batch}")
    for b in buckets:
        if b >= batch:
            return b
    raise ValueError(f"batch: {batch} requests exceed the largest CUDA-graph bucket {buckets[-1]}")


class _CaptureKey:
    """The request id of the dummy request a capture plans (never equal to a caller's id)."""

    def __repr__(self) -> str:
        return "<DecodeGraphRunner capture>"


@dataclass
class _Bucket:
    size: int
    plan: StepPlan  # static plan: its device tensors are the graph's input buffers
    handles: list[LayerCacheHandle]
    x: torch.Tensor  # static input [size, dim] bf16
    y: torch.Tensor | None = None  # static output [size, dim] fp32 (graph mode)
    graph: torch.cuda.CUDAGraph | None = None


def _neutralise(plan: StepPlan) -> None:
    """Make every row of ``plan`` a padded row (slot -1, position 0, nothing visible, nothing written)."""
    plan.request_slots.fill_(-1)
    plan.token_slots.fill_(-1)
    plan.swa_slots.fill_(-1)
    plan.positions.zero_()
    plan.seq_lens.fill_(1)
    for rp in plan.ratios.values():
        rp.block_table.fill_(-1)
        rp.block_lens.zero_()
        rp.num_entries.zero_()
        rp.n_visible.zero_()
        rp.emit_slots.fill_(-1)


class DecodeGraphRunner:
    """Decode steps of ``layers`` (a residual stack, see ``decode_stack``) through ``manager``, one CUDA
    graph per batch-size bucket (see module docstring).

    Args:
        manager: the cache; its device must be CUDA when ``capture=True``.
        layers: the stack's sub-blocks (their weights on the manager's device).
        buckets: batch sizes to capture (a step of B requests runs in the smallest bucket >= B).
        max_blocks: block-table width of every ratio class (int, or ``{ratio: blocks}``): the most pages
            a request may hold; fixes ``max_entries = max_blocks * entries_per_page``.  Ignored (may be
            None) for a stack of window-only layers in a model without ratio classes.
        capture: False = run the static-buffer path eagerly (no graph; works on the CPU).
        warmup: eager calls per bucket before capture.
        forward: ``f(layers, handles, x) -> y``, the function captured (default ``decode_stack``); it
            must read only its arguments' tensors (and the cache through the handles).
    """

    def __init__(
        self,
        manager: KVCacheManager,
        layers: Sequence[AttentionSubBlock],
        buckets: Iterable[int] = (1, 8, 64),
        max_blocks: int | Mapping[int, int] | None = None,
        *,
        capture: bool = True,
        warmup: int = 2,
        forward: Callable[[Sequence[AttentionSubBlock], Sequence[LayerCacheHandle], torch.Tensor], torch.Tensor]
        | None = None,
    ) -> None:
        bs = sorted(set(buckets))
        if not bs or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in bs):
            raise ValueError(f"buckets: expected positive ints, got {list(buckets)!r}")
        if not layers:
            raise ValueError("layers: expected at least one AttentionSubBlock")
        if capture and manager.device.type != "cuda":
            raise ValueError(f"capture=True needs a CUDA manager, got device {manager.device}")
        if max_blocks is None and manager.pools:
            raise ValueError(f"max_blocks: required for ratio classes {sorted(manager.pools)}")
        self.manager = manager
        self.layers = list(layers)
        self.buckets = tuple(bs)
        self.max_blocks = dict(max_blocks) if isinstance(max_blocks, Mapping) else max_blocks
        self.use_graphs = capture
        self.warmup = warmup
        self.forward = forward or decode_stack
        self._buckets: dict[int, _Bucket] = {}
        self.pool = None

    # ------------------------------------------------------------------ capture
    @property
    def captured(self) -> bool:
        return len(self._buckets) == len(self.buckets)

    def bucket_for(self, batch: int) -> int:
        """The bucket a step of ``batch`` requests runs in."""
        return pick_bucket(self.buckets, batch)

    def capture(self) -> None:
        """Build every bucket's static plan, handles and input (and graph, when capturing).

        Needs one free request slot (a dummy request at position 0 is planned — it needs no page — then
        cancelled and freed) and no outstanding plan.  Writes nothing to the cache.
        """
        m = self.manager
        if m.outstanding_plan is not None:
            raise RuntimeError("capture: a plan is outstanding; commit() or cancel() it first")
        if self.use_graphs and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.buckets, reverse=True):  # largest first: smaller ones reuse its memory
            if size not in self._buckets:
                self._buckets[size] = self._capture_bucket(size)

    def _capture_bucket(self, size: int) -> _Bucket:
        m = self.manager
        key = _CaptureKey()
        if not m.add(key):
            raise RuntimeError("capture: the manager needs one free request slot to capture a bucket")
        plan = None
        try:
            plan = m.plan({key: 1}, pad_batch_to=size, max_blocks=self.max_blocks)
            assert plan is not None  # one token at position 0 needs no page
            _neutralise(plan)
            handles = [m.acquire(blk.layer_id, plan) for blk in self.layers]
            dim = self.layers[0].cfg.dim
            x = torch.zeros(size, dim, dtype=torch.bfloat16, device=m.device)
            b = _Bucket(size=size, plan=plan, handles=handles, x=x)
            if self.use_graphs:
                self._record(b)
            return b
        finally:
            if plan is not None:
                m.cancel(plan)
            m.free(key)

    def _record(self, b: _Bucket) -> None:
        b.graph, b.y = capture_graph(
            lambda: self.forward(self.layers, b.handles, b.x), warmup=self.warmup, pool=self.pool
        )

    # ------------------------------------------------------------------ steps
    def prepare(self, schedule: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]]) -> tuple[StepPlan, int] | None:
        """Host part of a step: plan ``schedule`` (every request 1 token) padded to its bucket and load it
        into the bucket's static plan.  Returns (the manager's outstanding plan, bucket), or None when the
        manager is short of pages ("not now", nothing changed)."""
        if not self.captured:
            raise RuntimeError("step: call capture() first")
        items = list(schedule.items()) if isinstance(schedule, Mapping) else list(schedule)
        if any(n != 1 for _, n in items):
            raise ValueError("schedule: a captured decode step advances every request by exactly one token")
        size = self.bucket_for(len(items))
        plan = self.manager.plan(items, pad_batch_to=size, max_blocks=self.max_blocks)
        if plan is None:
            return None
        try:
            self._buckets[size].plan.load_(plan)
        except Exception:
            self.manager.cancel(plan)
            raise
        return plan, size

    def static_input(self, bucket: int) -> torch.Tensor:
        """The bucket's static input [bucket, dim] bf16 (what ``replay`` reads as x)."""
        return self._buckets[bucket].x

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the bucket's step on what its static buffers hold now -> static output [bucket, dim] fp32
        (graph mode: the graph's output buffer, overwritten by the next replay)."""
        b = self._buckets[bucket]
        if b.graph is None:
            return self.forward(self.layers, b.handles, b.x)
        b.graph.replay()
        return b.y

    def step(
        self, schedule: Mapping[Hashable, int] | Iterable[tuple[Hashable, int]], x: torch.Tensor
    ) -> torch.Tensor | None:
        """One decode step: ``x`` [B, dim] bf16 (schedule order) -> final hidden [B, dim] fp32 (a view
        of the static output in graph mode: copy it before the next step).  None = pages short (nothing
        changed).  The caller commits (or cancels) ``manager.outstanding_plan``."""
        items = list(schedule.items()) if isinstance(schedule, Mapping) else list(schedule)
        n, dim = len(items), self.layers[0].cfg.dim
        if not isinstance(x, torch.Tensor) or x.shape != (n, dim) or x.dtype != torch.bfloat16:
            got = f"{list(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected [{n}, {dim}] torch.bfloat16 (one row per request), got {got}")
        check_same_device(self.manager.device, x=x)
        got = self.prepare(items)
        if got is None:
            return None
        _, size = got
        b = self._buckets[size]
        b.x[:n].copy_(x)
        b.x[n:].zero_()
        return self.replay(size)[:n]
