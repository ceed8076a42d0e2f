"""StepPlan: everything one step needs from the cache, built on the host before the step.

The step contract (design §2): the manager allocates every page the step's compressed entries will
land in *before* the step and hands the device a ``StepPlan`` of tensors.  During the step nothing
allocates, syncs or changes shape with the data, so a decode step can be captured in a CUDA graph.

Token layout: the step's ``T`` tokens are grouped by request in batch order (request ``b`` owns tokens
``query_start[b] : query_start[b+1]``, consecutive positions).  Example with two requests, one
prefilling positions 4..6 and one decoding position 9 (window 8, ratio 4, 2 entries per page)::

    token            0   1   2   3
    request_ids      0   0   0   1        (batch row of each token)
    positions        4   5   6   9
    emit (m=4)       .   .   .   .        (a token t emits entry t//4 iff (t+1) % 4 == 0)
    n_visible (m=4)  1   1   1   2        ((t+1)//4 entries visible to its query)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_ALIGN_INT32 = 4  # packed transfers start every array on a 16-byte boundary (the kernels' vector loads)


def int32_to_device(
    arrays: Sequence[np.ndarray], device: torch.device | str, packed: bool | None = None
) -> list[torch.Tensor]:
    """Host integer arrays -> int32 tensors of the same shapes on ``device``.

    On CUDA all of them go in one copy that does not block the host: packed into one pinned host buffer (each array
    starting 16-byte aligned), copied with ``non_blocking=True`` (PyTorch keeps the pinned block until the copy has
    run), and returned as views of the one device buffer.  A pageable copy (``torch.as_tensor(a, device=...)``) would
    wait for the stream to drain, i.e. for every kernel queued before it, each time.  Elsewhere one tensor each,
    unless ``packed`` (default: on CUDA only) asks for the packed form there too.  Values must fit int32 (not
    checked)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if not (cuda if packed is None else packed):
        return [torch.as_tensor(np.asarray(a, dtype=np.int32), device=device) for a in arrays]
    arrays = [np.asarray(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.size // _ALIGN_INT32) * _ALIGN_INT32
    host = torch.empty(max(total, 1), dtype=torch.int32, pin_memory=cuda)
    flat = host.numpy()
    for a, o in zip(arrays, offsets, strict=True):
        flat[o : o + a.size] = a.reshape(-1)
    dev = host.to(device, non_blocking=cuda)
    return [dev[o : o + a.size].view(a.shape) for a, o in zip(arrays, offsets, strict=True)]


@dataclass(frozen=True)
class RatioPlan:
    """The part of a plan for one ratio class (shared by every layer of that ratio).

    Attributes:
        ratio: tokens per entry (m).
        entries_per_page: entries per page (P = block_tokens / m).
        block_table: int32 [B, max_blocks] page ids per logical block, -1 padded.
        block_lens: int32 [B] pages the request holds (valid prefix of its block_table row).
        num_entries: int32 [B] completed entries of the request after the step.
        n_visible: int32 [T] entries visible to each token's query, (pos + 1) // m.
        emit_slots: int32 [T] physical slot (page * P + row) of the entry the token emits, else -1.
    """

    ratio: int
    entries_per_page: int
    block_table: torch.Tensor
    block_lens: torch.Tensor
    num_entries: torch.Tensor
    n_visible: torch.Tensor
    emit_slots: torch.Tensor
    max_entries: int  # host int, static column count for scores: max num_entries of the batch, or
    # max_blocks * entries_per_page when the plan was built with a fixed block-table width


_PASS = object()  # StepPlan._forward's key while a pass is open (begin_forward)
_LOADED = object()  # StepPlan._memo's key once load_ has run


@dataclass(frozen=True)
class StepPlan:
    """One step's cache plan (see module docstring).  Build it with ``KVCacheManager.plan``.

    Host fields: ``request_keys`` (the caller's ids, batch order), ``slot_ids`` (their state slots),
    ``num_new_tokens`` and ``context_lens`` (tokens cached before the step) per request, ``epoch``
    (plans are single-use), ``num_padded``: rows appended after the real requests so that a decode
    step has a fixed batch size (CUDA-graph buckets).  A padded row has one token at position 0 and
    state slot -1: every write slot of it is -1 (nothing is written), it sees no window or compressed
    entry, and its output row is garbage to be ignored.

    Device fields (int32): ``request_slots`` [B] state slot of each request; ``positions`` [T];
    ``request_ids`` [T] batch row of each token (the seed's name); ``query_start`` [B+1];
    ``seq_lens`` [B] tokens after the step; ``token_slots`` [T] state slot of each token's request;
    ``swa_slots`` [T] physical ring slot
    (slot * ring_size + pos mod ring_size) the token's window KV goes to, -1 for tokens that are not
    among their request's last ring_size tokens of this step (so no two writes hit one row).
    """

    epoch: int
    request_keys: tuple[Hashable, ...]
    slot_ids: tuple[int, ...]
    num_new_tokens: tuple[int, ...]
    context_lens: tuple[int, ...]
    request_slots: torch.Tensor
    positions: torch.Tensor
    request_ids: torch.Tensor
    query_start: torch.Tensor
    seq_lens: torch.Tensor
    token_slots: torch.Tensor
    swa_slots: torch.Tensor
    ratios: dict[int, RatioPlan]
    num_padded: int = 0
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _forward: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # _PASS: a pass is open

    def memo(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per plan and ``key``: what every layer of the step derives alike from the plan
        (e.g. a prefill's window-workspace index), built and sent to the device once instead of once a layer.
        Values derived from host fields describe the plan as built (not a captured plan reloaded by ``load_``).  Not for
        a step that is graph-captured: device work done by a ``make`` before the capture (e.g. in warm-up runs) would
        not be recorded in the graph, and its replays would read the stale result."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def begin_forward(self) -> None:
        """Start a pass of the layers over this plan's step: from here until the next ``begin_forward``, a device value
        that every layer derives alike (``forward_memo``) is computed by the first layer that asks and shared by the
        rest.  Call it once at the start of each pass; a graph-captured pass calls it inside the capture (then the
        first layer's kernel is in the graph and every replay recomputes it; without it the capture would reuse an
        earlier pass's tensor and never record the kernel that makes it).  ``decode_stack`` and
        ``EngineRunner.forward`` call it."""
        self._forward.clear()
        self._forward[_PASS] = True

    def forward_memo(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per pass opened by ``begin_forward`` and ``key`` (e.g. the HCA layers' visible
        entry index: one launch a step instead of one a layer).  Without ``begin_forward`` every call runs ``make``.
        The value is shared: its users must not write to it."""
        if _PASS not in self._forward:
            return make()
        if key not in self._forward:
            self._forward[key] = make()
        return self._forward[key]

    @property
    def batch_size(self) -> int:
        """Rows of the batch, padded rows included."""
        return len(self.request_keys) + self.num_padded

    @property
    def num_tokens(self) -> int:
        """Tokens of the step (rows of the layer input), padded rows included."""
        return sum(self.num_new_tokens) + self.num_padded

    def device_tensors(self) -> dict[str, torch.Tensor]:
        """Every device tensor of the plan by a stable name (``ratio<m>.<field>`` for ratio plans)."""
        out = {
            k: getattr(self, k)
            for k in (
                "request_slots", "positions", "request_ids", "query_start", "seq_lens", "token_slots", "swa_slots",
            )
        }  # fmt: skip
        for m, rp in self.ratios.items():
            for k in ("block_table", "block_lens", "num_entries", "n_visible", "emit_slots"):
                out[f"ratio{m}.{k}"] = getattr(rp, k)
        return out

    def load_(self, other: StepPlan) -> None:
        """Copy ``other``'s device tensors into this plan's tensors (the static buffers of a captured
        CUDA graph).  Shapes and host-side statics (``max_entries``) must match: build ``other`` with the
        same ``pad_batch_to`` and ``max_blocks``.  Host fields of ``self`` are not changed."""
        mine, theirs = self.device_tensors(), other.device_tensors()
        for k, t in mine.items():
            if t.shape != theirs[k].shape:
                raise ValueError(f"plan.{k}: expected shape {list(t.shape)}, got {list(theirs[k].shape)}")
        for m, rp in self.ratios.items():
            if rp.max_entries != other.ratios[m].max_entries:
                raise ValueError(
                    f"plan.ratio{m}.max_entries: expected {rp.max_entries}, got {other.ratios[m].max_entries}"
                )
        for k, t in mine.items():
            t.copy_(theirs[k], non_blocking=True)
        self._memo[_LOADED] = True

    @property
    def loaded(self) -> bool:
        """Whether ``load_`` has copied another plan's device tensors in (the host fields then describe the plan as
        built, not the tensors)."""
        return self._memo.get(_LOADED, False)

    def host_positions(self) -> np.ndarray:
        """int64 [T] position of every token, from the host fields (padded rows: 0); equal to ``positions``
        of the plan as built (not of a captured plan reloaded by ``load_``, whose host fields are stale)."""
        runs = [np.arange(c, c + n) for c, n in zip(self.context_lens, self.num_new_tokens, strict=True)]
        return np.concatenate([*runs, np.zeros(self.num_padded, dtype=np.int64)]).astype(np.int64)

    def host_request_ids(self) -> np.ndarray:
        """int64 [T] batch row of every token (padded rows: their own rows after the real ones), from the host fields:
        ``request_ids`` of the plan as built."""
        counts = np.array([*self.num_new_tokens, *([1] * self.num_padded)], dtype=np.int64)
        return np.repeat(np.arange(len(counts), dtype=np.int64), counts)

    def host_n_visible(self, ratio: int) -> np.ndarray:
        """int64 [T] entries of ratio ``ratio`` visible to each token's query, ``(pos + 1) // ratio`` (padded rows:
        0), from the host fields: ``ratios[ratio].n_visible`` of the plan as built."""
        if ratio not in self.ratios:
            raise ValueError(f"ratio: expected one of {sorted(self.ratios)}, got {ratio!r}")
        nv = (self.host_positions() + 1) // ratio
        nv[self.num_tokens - self.num_padded :] = 0
        return nv

    @property
    def is_decode(self) -> bool:
        """Every request advances by exactly one token."""
        return all(n == 1 for n in self.num_new_tokens)

    @property
    def device(self) -> torch.device:
        return self.positions.device
