"""LayerCacheHandle — the typed per-layer, per-step view onto one layer's cache (the seed's design).

``KVCacheManager.acquire(layer_id, plan)`` builds one per layer per step.  It holds tensor
references and the plan's indices and allocates nothing.  Attention code reads and writes the cache
only through it, and a handle exposes only the views its layer kind has: an SWA-only layer has no
classical or indexer view, an HCA layer no indexer view (asking raises ``ValueError``).

Differences from the seed, and why:

- ``paged``/``state`` are the *layer's* views (``PagedLayerCache``/``LayerState``), not whole pools:
  the seed's field accesses (``self.state.swa_fp8``) only make sense per layer.
- ``write_swa`` writes the window ring only.  DeepSeek-V4's compressor pools its own fp32 projections
  of the layer input, not the window KV (spec §3), so compressor state is written separately through
  ``compressor_state()``.
- ``flush_compression`` writes into slots the manager assigned when it built the plan (design §2):
  it never allocates, so it can run inside a captured CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.paged_cache import PagedLayerCache
from dsv4.cache.plan import RatioPlan, StepPlan
from dsv4.cache.schema import CacheSchema, LayerSchema
from dsv4.cache.state_cache import CompressorState, LayerState
from dsv4.config import LayerKind
from dsv4.errors import check_tensor
from dsv4.formats import EntryPages, KeyPages


@dataclass(frozen=True)
class SWAView:
    """The window rings of one layer.  ``fp8``/``rope``/``inv_scale`` are [num_slots, ring, *] (request
    slot ``s`` is page ``s``); ``positions`` int32 [num_slots, ring] (-1 = empty); ``head`` int32
    [num_slots]; ``slots`` int32 [B] this step's request slots."""

    fp8: torch.Tensor
    rope: torch.Tensor
    inv_scale: torch.Tensor
    positions: torch.Tensor
    head: torch.Tensor
    slots: torch.Tensor

    @property
    def pages(self) -> EntryPages:
        return EntryPages(self.fp8, self.rope, self.inv_scale)


@dataclass(frozen=True)
class ClassicalView:
    """Compressed entries of one layer (FP8, MODEL1 pages) and this step's block tables.

    ``block_table`` int32 [B, max_blocks] (-1 padded), ``block_lens`` int32 [B], ``num_entries`` int32 [B]
    (after the step), ``n_visible`` int32 [T] (entries visible to each token's query).
    Physical slot of logical entry ``e`` of batch row ``b``: ``block_table[b, e // P] * P + e % P``.
    """

    entries_fp8: torch.Tensor
    entries_rope: torch.Tensor
    inv_scale: torch.Tensor
    block_table: torch.Tensor
    block_lens: torch.Tensor
    num_entries: torch.Tensor
    n_visible: torch.Tensor
    max_entries: int

    @property
    def pages(self) -> EntryPages:
        return EntryPages(self.entries_fp8, self.entries_rope, self.inv_scale)

    @property
    def entries_per_page(self) -> int:
        return self.entries_fp8.shape[1]


@dataclass(frozen=True)
class IndexerView:
    """MXFP4 indexer keys of one CSA layer: ``keys_fp4`` uint8 [pages, P, 64] (packed e2m1, low nibble =
    even index), ``scale`` uint8 [pages, P, 4] (UE8M0).  ``global_scale`` is always None (no global scale
    in V4's MXFP4).  Block tables as in ``ClassicalView`` (the same ones)."""

    keys_fp4: torch.Tensor
    scale: torch.Tensor
    global_scale: None
    block_table: torch.Tensor
    block_lens: torch.Tensor
    n_visible: torch.Tensor
    max_entries: int

    @property
    def pages(self) -> KeyPages:
        return KeyPages(self.keys_fp4, self.scale)


@dataclass(frozen=True)
class CompressorStateView:
    """One layer's compressor state(s): ``main``/``indexer`` are ``CompressorState`` (fp32 kv/score
    [num_slots, c*m, c*d], row = absolute position mod c*m; ``indexer`` is None on HCA layers; an HCA layer's
    ``main`` is online by default, ``main.shape.online``: kv [num_slots, 3, d] = (acc, den, raw kv), score
    [num_slots, 2, d] = (max, raw score), ``main.positions`` int32 [num_slots] the raw row's position);
    ``request_slots`` int32 [B] the step's request slots.  ``update_compressor`` writes the step's rows
    (only each request's last c*m tokens, so no row is written twice in one step; online: each request's
    running softmax, newest row and its position)."""

    ratio: int
    main: CompressorState
    indexer: CompressorState | None
    request_slots: torch.Tensor


@dataclass(frozen=True)
class LayerCacheHandle:
    """Read/write interface of one layer's cache for one step (see module docstring)."""

    layer: LayerSchema
    schema: CacheSchema
    plan: StepPlan
    paged: PagedLayerCache | None
    state: LayerState
    ratio_plan: RatioPlan | None

    # ------------------------------------------------------------------ plan fields (seed names)
    @property
    def layer_id(self) -> int:
        return self.layer.layer_id

    @property
    def kind(self) -> LayerKind:
        return self.layer.kind

    @property
    def request_slots(self) -> torch.Tensor:
        return self.plan.request_slots

    @property
    def positions(self) -> torch.Tensor:
        return self.plan.positions

    @property
    def request_ids(self) -> torch.Tensor:
        return self.plan.request_ids

    @property
    def block_table(self) -> torch.Tensor | None:
        return self.ratio_plan.block_table if self.ratio_plan else None

    @property
    def block_lens(self) -> torch.Tensor | None:
        return self.ratio_plan.block_lens if self.ratio_plan else None

    @property
    def emit_slots(self) -> torch.Tensor:
        """int32 [T]: physical slot of the compressed entry each token emits (-1 = none)."""
        return self._need_ratio("emit_slots").emit_slots

    # ------------------------------------------------------------------ writes
    def write_swa(self, kv: torch.Tensor, backend: str = "auto") -> None:
        """FP8-quantise this step's window KV and write it into the ring rows the plan assigned.

        ``kv``: [T, head_dim] bf16, one row per token of the step, already kv_norm'ed and RoPE'd.
        Tokens with ``plan.swa_slots == -1`` (older than their request's last ring_size tokens of this
        step) are skipped.  Updates the ring positions and heads.
        """
        from dsv4.kernels.cache.append_swa import append_swa

        check_tensor(
            "kv", kv, dtype=torch.bfloat16, shape=(self.plan.num_tokens, self.schema.config.head_dim),
            device=self.plan.device,
        )  # fmt: skip
        append_swa(
            kv,
            self.plan.swa_slots,
            self.plan.positions,
            self.state.ring,
            self.state.ring_positions_flat,
            self.schema.entry_fmt,
            backend=backend,
        )
        self._advance_ring_head(backend)

    def write_window(
        self,
        kv_raw: torch.Tensor,
        norm_weight: torch.Tensor,
        inv_freq: torch.Tensor,
        backend: str = "auto",
        *,
        copy_to: tuple[torch.Tensor, EntryPages] | None = None,
        rows: bool = True,
        window_index: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Fused window write from the raw ``wkv`` output ``kv_raw`` [T, head_dim] bf16: kv_norm (weight
        ``norm_weight``, the config's eps) -> RoPE(t) with ``inv_freq`` -> FP8 -> ring rows of the plan.

        Returns the normed + RoPE'd bf16 rows [T, head_dim] (pre-FP8): the chunk's own window keys
        (``rows=False``: None, not written).  ``copy_to`` = (slots [T], EntryPages of the entry format): every
        token's entry is also stored there in the same launch (a prefill chunk's attention workspace).  The ring
        positions and heads are updated in the same launch.  ``window_index`` (int32 [T, ring_size]): every token's
        decode window (the ring slots of its position and the ring_size - 1 before it, -1 before position 0 and for
        a padded token) written in the same launch: the attention's window index of a decode step.
        """
        from dsv4.kernels.cache.append_swa import append_window

        check_tensor(
            "kv_raw", kv_raw, dtype=torch.bfloat16, shape=(self.plan.num_tokens, self.schema.config.head_dim),
            device=self.plan.device,
        )  # fmt: skip
        kv = append_window(
            kv_raw,
            norm_weight,
            self.schema.config.norm_eps,
            inv_freq,
            self.plan.swa_slots,
            self.plan.positions,
            self.state.ring,
            self.state.ring_positions_flat,
            self.schema.entry_fmt,
            backend=backend,
            copy_to=copy_to,
            rows=rows,
            ring_head_flat=self.state.ring_head_flat,  # (the ring heads in the same launch)
            window_index=window_index,
        )
        return kv

    def update_compressor(
        self, kv: torch.Tensor, score: torch.Tensor, which: str = "main", backend: str = "auto"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold this step's compressor projections into the state; pool the entries that complete.

        ``kv``/``score``: fp32 [T, c*d] (``wkv(x)``, ``wgate(x) + ape[pos mod m]``) of the main
        (``which="main"``) or the CSA indexer's (``"indexer"``) compressor.  Returns (pooled fp32 [T, d],
        emits bool [T]); see ``dsv4.kernels.cache.compressor.compressor_step``.
        """
        from dsv4.kernels.cache.compressor import compressor_step

        st = self._compressor(which)
        return compressor_step(
            kv, score, self.plan.positions, self.plan.token_slots, st.kv, st.score,
            st.shape.ratio, st.shape.overlap, decode=self.plan.is_decode, backend=backend, state_pos=st.positions,
        )  # fmt: skip

    def emit_compressed(
        self,
        pooled: torch.Tensor,
        emits: torch.Tensor,
        norm_weight: torch.Tensor,
        inv_freq: torch.Tensor,
        which: str = "main",
        backend: str = "auto",
    ) -> None:
        """Finish (bf16 -> RMSNorm -> RoPE at i*m -> [Hadamard] -> FP8 | MXFP4) and store the pooled entries
        of emitting tokens into the slots the plan assigned (``emit_slots``).  Allocates nothing."""
        from dsv4.kernels.cache.compressor import emit_entries

        rp = self._need_ratio("emit_compressed")
        self._compressor(which)
        pages, fmt = self._emit_target(which)
        emit_entries(
            pooled, emits, self.plan.positions, norm_weight, self.schema.config.norm_eps, inv_freq,
            rp.emit_slots, pages, fmt, rp.ratio, kind=which, backend=backend,
        )  # fmt: skip

    def compress(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        norm_weight: torch.Tensor,
        inv_freq: torch.Tensor,
        which: str = "main",
        backend: str = "auto",
        ape: torch.Tensor | None = None,
    ) -> None:
        """``update_compressor`` then ``emit_compressed`` (same arguments, same effect).  A decode step
        (``plan.is_decode``) runs them as ONE fused launch (``compress_decode``); otherwise as
        ``compress_prefill`` (the pool, then the emit and the state write: 3 launches on the Triton path; 2 where
        its fused emit is on and applies, see ``compressor_prefill``).  With ``ape`` (fp32
        [m, c*d]) ``score`` is ``wgate(x)`` alone and ``ape[pos mod m]`` is added inside the kernels (where they
        read the step's score rows)."""
        if not self.plan.is_decode:
            from dsv4.kernels.cache.compressor_prefill import compress_prefill

            # (compress_prefill checks the emit's arguments before it touches the state)
            rp = self._need_ratio("compress")
            st = self._compressor(which)
            pages, fmt = self._emit_target(which)
            compress_prefill(
                kv, score, self.plan.positions, self.plan.token_slots, st.kv, st.score, st.shape.ratio,
                st.shape.overlap, norm_weight, self.schema.config.norm_eps, inv_freq, rp.emit_slots, pages, fmt,
                kind=which, backend=backend, state_pos=st.positions, counters=st.counters,
                ape=None if ape is None else ape.float().contiguous(), state_unread=self._state_unread(st.shape),
            )  # fmt: skip
            return
        from dsv4.kernels.cache.compressor import compress_decode

        compress_decode(**self._decode_call(kv, score, norm_weight, inv_freq, which, ape), kind=which, backend=backend)

    def _state_unread(self, shape) -> bool:
        """``compress_prefill``'s ``state_unread`` for this plan and a compressor of ``shape``: from the plan's host
        counts (``state_unread_by_step``); never while a CUDA graph is being captured (a replay may run another
        step's plan, loaded into the same tensors, for which the promise would not hold) nor for a plan that
        ``load_`` overwrote (its host counts are stale)."""
        from dsv4.kernels.cache.compressor import state_unread_by_step

        if self.plan.loaded or (self.plan.positions.is_cuda and torch.cuda.is_current_stream_capturing()):
            return False
        plan, m, overlap = self.plan, shape.ratio, shape.overlap

        def unread() -> bool:
            return state_unread_by_step(plan.context_lens, plan.num_new_tokens, m, overlap)

        return plan.memo(("state_unread", m, overlap), unread)  # (once a plan for every layer of the kind)

    def compress_all(
        self,
        steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, str, torch.Tensor | None]],
        inv_freq: torch.Tensor,
        backend: str = "auto",
    ) -> None:
        """``compress`` of each of the layer's compressors, ``steps`` = [(kv, score, norm_weight, which, ape), ...]
        (main first): the same effect as one ``compress`` call each.  A decode step of a CSA layer (``main`` and
        ``indexer``) runs both in ONE launch (``compress_decode_csa``), both checked before anything is written."""
        if not (self.plan.is_decode and [st[3] for st in steps] == ["main", "indexer"]):
            for kv, score, norm_weight, which, ape in steps:
                self.compress(kv, score, norm_weight, inv_freq, which, backend=backend, ape=ape)
            return
        from dsv4.kernels.cache.compressor import compress_decode_csa

        main, indexer = (self._decode_call(kv, sc, nw, inv_freq, which, ape) for kv, sc, nw, which, ape in steps)
        compress_decode_csa(main, indexer, backend=backend)

    def _decode_call(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        norm_weight: torch.Tensor,
        inv_freq: torch.Tensor,
        which: str,
        ape: torch.Tensor | None,
    ) -> dict:
        """``compress_decode``'s arguments (but ``kind`` and ``backend``) for the ``which`` compressor's decode step."""
        rp = self._need_ratio("compress")
        st = self._compressor(which)
        pages, fmt = self._emit_target(which)
        return dict(
            kv=kv, score=score, positions=self.plan.positions, token_slot=self.plan.token_slots, kv_state=st.kv,
            score_state=st.score, counters=st.counters, ratio=st.shape.ratio, overlap=st.shape.overlap,
            norm_weight=norm_weight, eps=self.schema.config.norm_eps, inv_freq=inv_freq, slots=rp.emit_slots,
            pages=pages, fmt=fmt, ape=ape, state_pos=st.positions,
        )  # fmt: skip

    def _emit_target(self, which: str):
        """(pages, format) the ``which`` compressor's entries go to: FP8 entries (main) or MXFP4 keys."""
        if which == "main":
            return self.paged.entries, self.schema.entry_fmt
        return self.paged.keys, self.schema.key_fmt

    def _compressor(self, which: str) -> CompressorState:
        self._need_ratio("compressor")
        if which not in ("main", "indexer"):
            raise ValueError(f"which: expected 'main' or 'indexer', got {which!r}")
        st = self.state.compressor if which == "main" else self.state.indexer_compressor
        if st is None:
            raise ValueError(f"which='indexer': layer {self.layer_id} is {self.kind.value}; only CSA has an indexer")
        return st

    def _advance_ring_head(self, backend: str = "auto") -> None:
        """ring_head[slot] = seq_len mod ring_size for the step's requests (padded rows, slot -1: none; no
        branch, no sync; one launch on a GPU)."""
        from dsv4.kernels.cache.ring import advance_ring_head

        advance_ring_head(
            self.plan.seq_lens, self.plan.request_slots, self.state.ring_head_flat, self.schema.ring_size, backend
        )

    def flush_compression(
        self,
        compressed: torch.Tensor,
        indexer_keys: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        """Quantise emitted compressed entries (and CSA indexer keys) into their pre-assigned slots.

        ``compressed``: [N, head_dim] bf16/fp32, final entries (pooled, RMSNorm'ed, RoPE'd at i*m).
        ``indexer_keys``: [N, index_head_dim], final keys (normed, RoPE'd, Hadamard-rotated); required on
        CSA layers, refused elsewhere.  ``token_index``: [N] int, which step token emitted each row
        (slots come from ``plan.ratios[m].emit_slots[token_index]``); None means N == T, row i is token i
        (rows of tokens that emit nothing are skipped).  An index outside [0, T) is refused with a ValueError
        when ``token_index`` is on the CPU; on an accelerator (where checking it would be a host sync) its row is
        skipped like a token that emits nothing (``_emit_slots_at``), never wrapped or read out of bounds.
        Allocates nothing (a CPU ``token_index`` is copied to the plan's device).
        """
        from dsv4.kernels.cache.flush_compression import flush_compression

        rp = self._need_ratio("flush_compression")
        cfg = self.schema.config
        n = compressed.shape[0] if isinstance(compressed, torch.Tensor) else None
        check_tensor(
            "compressed", compressed, dtype=(torch.bfloat16, torch.float32), shape=(n, cfg.head_dim),
            device=self.plan.device,
        )  # fmt: skip
        if token_index is None:
            if n != self.plan.num_tokens:
                raise ValueError(f"compressed: expected {self.plan.num_tokens} rows (one per token), got {n}")
            slots = rp.emit_slots
        else:
            check_tensor("token_index", token_index, dtype=(torch.int32, torch.int64), shape=(n,))
            slots = _emit_slots_at(rp.emit_slots, token_index)
        keys = None
        if self.paged.keys is not None:
            if indexer_keys is None:
                raise ValueError("indexer_keys: required on CSA layers, got None")
            check_tensor(
                "indexer_keys", indexer_keys, dtype=(torch.bfloat16, torch.float32), shape=(n, cfg.index_head_dim),
                device=self.plan.device,
            )  # fmt: skip
            keys = self.paged.keys
        elif indexer_keys is not None:
            raise ValueError(f"indexer_keys: layer {self.layer_id} ({self.kind.value}) has no indexer, got a tensor")
        flush_compression(
            compressed,
            slots,
            self.paged.entries,
            self.schema.entry_fmt,
            indexer_keys,
            keys,
            self.schema.key_fmt,
            backend=backend,
        )

    # ------------------------------------------------------------------ views
    def read_swa_view(self) -> SWAView:
        ring = self.state.ring
        return SWAView(
            fp8=ring.nope,
            rope=ring.rope,
            inv_scale=ring.scale,
            positions=self.state.ring_positions,
            head=self.state.ring_head,
            slots=self.plan.request_slots,
        )

    def read_classical_view(self) -> ClassicalView:
        rp = self._need_ratio("read_classical_view")
        e = self.paged.entries
        return ClassicalView(
            entries_fp8=e.nope,
            entries_rope=e.rope,
            inv_scale=e.scale,
            block_table=rp.block_table,
            block_lens=rp.block_lens,
            num_entries=rp.num_entries,
            n_visible=rp.n_visible,
            max_entries=rp.max_entries,
        )

    def read_indexer_view(self) -> IndexerView:
        rp = self._need_ratio("read_indexer_view")
        if self.paged.keys is None:
            raise ValueError(f"read_indexer_view: layer {self.layer_id} is {self.kind.value}; only CSA layers have one")
        return IndexerView(
            keys_fp4=self.paged.keys.data,
            scale=self.paged.keys.scale,
            global_scale=None,
            block_table=rp.block_table,
            block_lens=rp.block_lens,
            n_visible=rp.n_visible,
            max_entries=rp.max_entries,
        )

    def compressor_state(self) -> CompressorStateView:
        rp = self._need_ratio("compressor_state")
        return CompressorStateView(
            ratio=rp.ratio,
            main=self.state.compressor,
            indexer=self.state.indexer_compressor,
            request_slots=self.plan.request_slots,
        )

    def _need_ratio(self, what: str) -> RatioPlan:
        if self.ratio_plan is None or self.paged is None:
            raise ValueError(f"{what}: layer {self.layer_id} is SWA-only; it has no compressed cache")
        return self.ratio_plan


def _emit_slots_at(
    emit_slots: torch.Tensor, token_index: torch.Tensor, check_on_host: bool | None = None
) -> torch.Tensor:
    """``emit_slots[token_index]`` for ``flush_compression``: [N] slots on ``emit_slots``' device.

    ``check_on_host`` (default: ``token_index`` is on the CPU): indices are checked against [0, T) here and a bad
    one raises ValueError.  Otherwise (an accelerator, where a check would sync and an out-of-range gather is a
    device-side assert that poisons the whole context) an index outside [0, T), negative ones included (no
    wrap-around), gives slot -1, which the stores skip."""
    t = emit_slots.shape[0]
    ti = token_index.long()
    if ti.device.type != "cpu" and ti.device != emit_slots.device:
        raise ValueError(f"token_index: expected a CPU tensor or one on {emit_slots.device}, got {ti.device}")
    if ti.device.type == "cpu" if check_on_host is None else check_on_host:
        if ti.numel() and (int(ti.min()) < 0 or int(ti.max()) >= t):
            raise ValueError(
                f"token_index: expected indices of step tokens in [0, {t}), got min {int(ti.min())} max {int(ti.max())}"
            )
        return emit_slots[ti.to(emit_slots.device)]
    ti = ti.to(emit_slots.device)
    none = torch.full_like(ti, -1, dtype=emit_slots.dtype)
    if t == 0:
        return none
    return torch.where((ti >= 0) & (ti < t), emit_slots[ti.clamp(0, t - 1)], none)
