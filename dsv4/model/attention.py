"""AttentionSubBlock: one DeepSeek-V4 attention layer that reads and writes its cache only through a
``LayerCacheHandle`` (spec §2–4, §6.1), for every layer kind, any batch and any chunking.

Order of one step (per layer)::

    q path (wq_a -> q_norm -> wq_b -> per-head norm -> RoPE)            projections.query
    [prefill] gather the ring's history rows into a workspace        <- before the ring is written
    window KV: wkv -> kv_norm -> RoPE -> FP8 -> ring                    handle.write_window
      [decode] and the queries' window index (ring slots), in the same launch
    [prefill] the chunk's own KV -> FP8 into the workspace
    CSA/HCA: compressor projections -> state -> pooled -> entries       handle.compress
    CSA: indexer compressor -> MXFP4 keys; indexer query; scores + top-k   kernels.indexer (row chunks)
    sparse attention: window + (top-k | all visible) entries + sink     kernels.attention.sparse_attention
      [HCA prefill, PREFILL_BANDS] in row bands, each index as wide as its rows see (``visible_bands``)
    inverse RoPE, grouped output projection                            projections.output_projection

Window keys.  Decode (every request advances one token): the query at t reads ring rows of positions
t-127..t directly (its own row was written first).  A step in which some request advances by more
than one token (prefill chunk, mixed batch) first copies each request's last ``min(ctx, 127)`` ring
rows into an FP8 workspace in the same MODEL1 format, then appends the chunk's own keys: inside a
chunk longer than the window the ring would already hold newer tokens than an early query may see
(the read-before-write hazard of design §2).  Both paths give the same FP8 values.

Every operation dispatches through its own ``backend`` ("auto" | "torch" | "triton"); the sub-block
passes its ``backend`` to all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import numpy as np
import torch

from dsv4.cache.handle import LayerCacheHandle
from dsv4.cache.plan import StepPlan, int32_to_device
from dsv4.config import LayerKind, ModelConfig
from dsv4.errors import check_tensor
from dsv4.formats import EntryPages
from dsv4.formats.fp8_weight import WEIGHT_BLOCK, FP8Weight, stack_rows
from dsv4.kernels import dispatch
from dsv4.kernels.attention import sparse_attention
from dsv4.kernels.dispatch import pdl_scope, use_triton
from dsv4.kernels.fp8_linear import fp8_linear, fp8_linear_mixed
from dsv4.kernels.indexer import indexer_topk, to_physical, visible_physical
from dsv4.kernels.linear import bf16_exact, linear_counters, linear_fp32_group, linear_fp32_pair
from dsv4.model import functional as F
from dsv4.model.projections import (
    dense,
    fuse_derotate,
    indexer_query,
    output_projection,
    query,
    query_heads,
    query_latent,
)
from dsv4.model.weights import AttentionWeights, CompressorWeights

# An HCA prefill attends in row bands, each with an entry index as wide as its rows see (``visible_bands``), instead of
# one index of ``max_entries`` columns for every row: a 65,536-token prefill from position 0 has rows seeing 0 .. 512
# entries, ~45 % of the one index's columns -1 (each still a key block of the attention loop).  Off until timed on
# the H200 (``run_h200.sh validate_s20``: the HCA layer profile with and without).
PREFILL_BANDS = False
# compressor_gemm "tf32x3" with compressor weights exact in bf16 (dequantised from an FP8 or bf16 checkpoint; checked
# once, at construction): the Triton path keeps bf16 copies of them (half the bytes for a decode step's GEMV to stream;
# +50 % of the compressor weights' memory) and the GEMM takes ``precision="bf16w"`` on a bf16 x, one bf16 MMA with
# exact products instead of two tf32 ones.  Off until timed on the H200 (``run_h200.sh tf32x2_s21``).
BF16_EXACT_COMPRESSOR = False
# On the Triton path the projections of one input run as one GEMM launch of the weights stacked by rows
# (``ProjectionStack``; ``fp8_linear`` for FP8 weights, cuBLAS for bf16): x's ``wq_a`` + ``wkv``, and qr's ``wq_b`` +
# (CSA) ``indexer.wq_b`` (computed every step, also one whose indexer does not run: a context within top-k).  Two
# launches fewer a layer step, the small ``wkv`` GEMV no longer a launch of its own.  The default of
# ``AttentionSubBlock(stack_projections=)``.  The layer holds views of the stacks, not the weights it was given: a
# caller that keeps its own ``AttentionWeights`` keeps a second copy of those weights (use the layer's ``w`` instead,
# as ``EngineRunner`` does).  On: it wins in every case timed.  H100, 2026-12-05, V4-Flash at 128K, decode step graph
# time, B = 1 / 64 (``benchmarks/results/2026-12-05_h100_decode_*_s25b.jsonl``): CSA bf16 220.5 / 344.2 -> 205.3 /
# 327.2 µs, HCA bf16 158.4 / 202.3 -> 152.1 / 196.7, CSA FP8 182.6 / 403.7 -> 164.9 / 375.7, HCA FP8 129.0 / 268.8
# -> 121.5 / 258.8 (FP8 with the rotation fused then; STACK_COMPRESSORS on).
STACK_PROJECTIONS = True
# With STACK_PROJECTIONS and FP8 weights throughout (``keep_fp8``), the layer's FP8 compressor weights (wkv, wgate of
# the main and, CSA, the indexer's compressor) join the x stack too, first: ``fp8_linear_mixed`` gives their fp32
# projections and the stack's bf16 ones in one launch (one launch fewer a compressed layer's step).  The A/B:
# ``run_h200.sh step_s23``.
STACK_COMPRESSORS = True
BAND_ALIGN = 64  # a band's index width is rounded up to this many entries (the attention kernels' key blocks)
BAND_MIN_ROWS = 1024  # rows a band has at least (but the last): each band costs two launches


def visible_bands(
    n_visible: np.ndarray, max_entries: int, align: int = BAND_ALIGN, min_rows: int = BAND_MIN_ROWS
) -> list[tuple[int, int, int]]:
    """Row bands ``(start, stop, width)`` covering rows [0, T) in order: a band's width is its rows' largest visible
    count rounded up to ``align`` (at most ``max_entries``); a band closes when the next row would widen it and it
    holds ``min_rows`` rows.  ``n_visible``: int [T] host counts (``StepPlan.host_n_visible``)."""
    nv = np.asarray(n_visible, dtype=np.int64)
    t = int(nv.shape[0])
    if t == 0:
        return []
    widths = np.minimum(-(-nv // align) * align, max_entries)
    bands, start, width = [], 0, int(widths[0])
    for i in range(1, t):
        w = int(widths[i])
        if w > width:
            if i - start >= min_rows:
                bands.append((start, i, width))
                start = i
            width = w
    bands.append((start, t, width))
    return bands


class AttentionSubBlock:
    """One attention layer of ``cfg`` with weights ``w`` (see module docstring).

    Args:
        cfg: the model config; ``layer_id`` picks the layer kind and RoPE table.
        w: the layer's weights (``dsv4.model.weights``), on the device the cache lives on; linear weights bf16, or
            the checkpoint's ``FP8Weight`` (loaded with ``keep_fp8=True``): the projections then run
            ``kernels.fp8_linear`` on the Triton path (half the weight bytes; same products for UE8M0 scales); FP8
            compressor weights are kept in one buffer (``self.w`` holds views of it) and projected by one launch with
            fp32 outputs (a quarter of the fp32 weights' bytes).
        backend: "auto" (Triton on CUDA, PyTorch on the CPU), "torch" or "triton".
        compressor_gemm: the compressor projections' fp32 GEMMs on the Triton path: "tf32x3" (default;
            ``kernels.linear.linear_fp32_group``, every compressor projection of the layer in one tensor-core GEMM,
            error <= ~1e-5 of sum |x||w|, see its docstring), "bf16x3" (the same GEMM on bf16 MMAs with the weights
            split exactly into three bf16 pieces: exact products; for a bf16 x, else tf32x3) or "fp32"
            (``F.compressor_project``: cuBLAS fp32).
        stack_projections: the projections of one input as one GEMM launch of their stacked weights (the module's
            ``STACK_PROJECTIONS`` where None).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        w: AttentionWeights,
        backend: str = "auto",
        compressor_gemm: str = "tf32x3",
        stack_projections: bool | None = None,
    ) -> None:
        w.check(cfg, layer_id)
        if compressor_gemm not in ("tf32x3", "bf16x3", "fp32"):
            raise ValueError(f"compressor_gemm: expected 'tf32x3', 'bf16x3' or 'fp32', got {compressor_gemm!r}")
        self.compressor_gemm = compressor_gemm
        # zeroed int32 counters (left zero) of the in-launch split sums of the GEMMs and of top-k's A + B launch (their
        # calls on one stream, one after another)
        self._linear_counters = linear_counters(w.device)
        # the projections of one input in one launch (self.w then holds views of the stacks)
        on = STACK_PROJECTIONS if stack_projections is None else bool(stack_projections)
        w, self._x_stack, self._qr_stack = _stack_projections(w, STACK_COMPRESSORS) if on else (w, None, None)
        # FP8 compressor weights: one buffer for all of the layer's (one fp8_linear launch projects them all), or the
        # x stack's first rows where they joined it
        xs = self._x_stack
        if xs is not None and xs.n_fp32:
            self._comp8, self._comp8_widths = xs.weight.rows(0, sum(xs.widths[: xs.n_fp32])), xs.widths[: xs.n_fp32]
        else:
            w, self._comp8, self._comp8_widths = _gather_fp8_compressors(w)
        self.cfg, self.layer_id, self.w, self.backend = cfg, layer_id, w, backend
        comp = w.compressors
        self._bf16w = (
            BF16_EXACT_COMPRESSOR and compressor_gemm == "tf32x3" and bool(comp)
            and not any(isinstance(t, FP8Weight) for c in comp for t in (c.wkv, c.wgate))
            and bf16_exact(*(t for c in comp for t in (c.wkv, c.wgate)))
        )  # fmt: skip
        # ... and then the Triton path reads them as bf16 copies (half the bytes: a decode step's GEMV streams them)
        self._w16 = {id(c): (c.wkv.bfloat16(), c.wgate.bfloat16()) for c in comp} if self._bf16w else {}
        self.kind = cfg.layer_kind(layer_id)
        self.ratio = cfg.ratio(layer_id)
        self.inv_freq = F.rope_inv_freq(cfg, layer_id, w.device)
        self.scale = cfg.head_dim**-0.5

    def __call__(self, x: torch.Tensor, handle: LayerCacheHandle) -> torch.Tensor:
        return self.forward(x, handle)

    def forward(self, x: torch.Tensor, handle: LayerCacheHandle) -> torch.Tensor:
        """x [T, dim] bf16, the step's tokens in plan order (after attn_norm) -> y [T, dim] bf16.  A decode step's
        kernels are launched with programmatic dependent launch where ``dispatch.PDL_DECODE`` (Hopper; see there)."""
        with pdl_scope(True) if handle.plan.is_decode and dispatch.PDL_DECODE else contextlib.nullcontext():
            return self._forward(x, handle)

    def _forward(self, x: torch.Tensor, handle: LayerCacheHandle) -> torch.Tensor:
        cfg, w, be = self.cfg, self.w, self.backend
        plan = handle.plan
        check_tensor("x", x, dtype=torch.bfloat16, shape=(plan.num_tokens, cfg.dim), device=w.device)
        if handle.layer_id != self.layer_id:
            raise ValueError(f"handle: expected layer {self.layer_id}, got a handle of layer {handle.layer_id}")
        pos = plan.positions
        cnt = self._linear_counters
        ip = self.input_projections(x, pos)
        q, qr, kv_raw = ip.q, ip.qr, ip.kv_raw
        if plan.is_decode:  # (the window store writes the queries' window index in its launch)
            win = self.decode_window_index(handle)
            handle.write_window(kv_raw, w.kv_norm, self.inv_freq, backend=be, window_index=win)
            window = (handle.read_swa_view().pages, win)
        else:
            ws, ws_index, chunk_slots = self._window_workspace(handle)
            # the chunk's own keys go to the ring and, in the same launch, to the workspace
            handle.write_window(kv_raw, w.kv_norm, self.inv_freq, backend=be, copy_to=(chunk_slots, ws), rows=False)
            window = (ws, ws_index)
        caches = [window]

        if self.ratio:
            comps = [(w.compressor, "main")]
            if self.kind is LayerKind.CSA:
                comps.append((w.indexer.compressor, "indexer"))
            projections = self.compressor_projections_all(x, [cw for cw, _ in comps], handle.positions, ip)
            # (ape is added inside the compress kernels; a CSA decode step: both compressors in one launch)
            steps = [(kv, g, cw.norm, which, cw.ape) for (cw, which), (kv, g) in zip(comps, projections, strict=True)]
            handle.compress_all(steps, self.inv_freq, backend=be)
            comp = handle.paged.entries
            rp = handle.ratio_plan
            if rp.max_entries > 0:
                if self.kind is LayerKind.CSA and rp.max_entries > cfg.index_topk:
                    logical = self._indexer_topk(x, qr, handle, ip)
                    phys = to_physical(logical, rp.block_table, plan.request_ids, rp.entries_per_page, backend=be)
                else:
                    # HCA; or CSA while no request has more entries than top-k: each row attends all it sees, in an
                    # index as wide as the top-k path's (one layout whichever path a step takes, so a padded graph
                    # step and an eager one agree bit for bit)
                    if self.kind is LayerKind.HCA and not plan.is_decode and PREFILL_BANDS:
                        o = self._banded_hca_attention(q, window, comp, handle)
                        return output_projection(
                            cfg, w, o, pos[:, None], self.inv_freq, be, consume_o=True, counters=cnt,
                            cos_sin=ip.cos_sin,
                        )  # fmt: skip
                    # (the same index in every layer of this ratio and width: one launch a pass, plan.forward_memo)
                    width = cfg.index_topk if self.kind is LayerKind.CSA else rp.max_entries
                    phys = plan.forward_memo(
                        ("visible_physical", self.ratio, width, be),
                        lambda: visible_physical(
                            rp.n_visible, width, rp.block_table, plan.request_ids, rp.entries_per_page, backend=be
                        ),
                    )
                caches.append((comp, phys))

        o, _ = sparse_attention(q, caches, w.attn_sink, self.scale, backend=be)
        return output_projection(
            cfg, w, o, pos[:, None], self.inv_freq, be, consume_o=True, counters=cnt, cos_sin=ip.cos_sin
        )

    def _banded_hca_attention(
        self, q: torch.Tensor, window: tuple[EntryPages, torch.Tensor], comp: EntryPages, handle: LayerCacheHandle
    ) -> torch.Tensor:
        """An HCA prefill's attention in row bands (``visible_bands``), each over an entry index only as wide as its
        rows see; o [T, H, D] bf16, the values of the one call over ``max_entries`` columns (the extra columns are
        -1: they add exact zeros)."""
        plan, rp = handle.plan, handle.ratio_plan
        nv_host = plan.memo(("n_visible", self.ratio), lambda: plan.host_n_visible(self.ratio))
        bands = plan.memo(("hca_bands", self.ratio), lambda: visible_bands(nv_host, rp.max_entries))
        o = torch.empty_like(q)
        ws, ws_index = window
        for a, b, width in bands:
            caches = [(ws, ws_index[a:b])]
            if width:
                phys = plan.forward_memo(
                    ("visible_physical", self.ratio, width, self.backend, a, b),
                    lambda a=a, b=b, width=width: visible_physical(
                        rp.n_visible[a:b], width, rp.block_table, plan.request_ids[a:b], rp.entries_per_page,
                        backend=self.backend,
                    ),
                )  # fmt: skip
                caches.append((comp, phys))
            sparse_attention(q[a:b], caches, self.w.attn_sink, self.scale, backend=self.backend, out=o[a:b])
        return o

    @property
    def stacked_indexer_weights(self) -> list:
        """The indexer's weights that the stacks project with the layer's own (``STACK_PROJECTIONS``): ``wq_b`` with
        ``wq_b`` (the qr stack), ``weights_proj`` with ``wq_a`` + ``wkv`` (the x stack, where it joined)."""
        out = []
        if self._qr_stack is not None:
            out.append(self.w.indexer.wq_b)
        if self._x_stack is not None and len(self._x_stack.widths) - self._x_stack.n_fp32 == 3:
            out.append(self.w.indexer.weights_proj)
        return out

    # ------------------------------------------------------------------ pieces
    def input_projections(self, x: torch.Tensor, positions: torch.Tensor) -> InputProjections:
        """The projections of the step's input x [T, dim] bf16 at positions [T] (``InputProjections``).  With the
        stacks (``STACK_PROJECTIONS``) on the Triton path two GEMM launches give all of them (row-strided views)."""
        cfg, w, be, cnt = self.cfg, self.w, self.backend, self._linear_counters
        hp = positions[:, None]
        cs = None  # the query rotation's (cos, sin), where wo_a de-rotates o in its launch
        if fuse_derotate(w, x.shape[0], be, x):
            cs = torch.empty(x.shape[0], self.inv_freq.shape[0], 2, dtype=torch.float32, device=x.device)
        if self._x_stack is None or not use_triton(be, x, self._x_stack.tensor):
            q, qr = query(cfg, w, x, hp, self.inv_freq, be, counters=cnt, cos_sin_out=cs)
            return InputProjections(q, qr, dense(x, w.wkv, be, counters=cnt), cos_sin=cs)
        outs = self._x_stack.project(x, be, cnt)
        nc = self._x_stack.n_fp32  # (the compressors' projections first, where they joined the stack)
        comp = [(outs[i], outs[i + 1]) for i in range(0, nc, 2)] if nc else None
        latent, kv_raw, *index_w = outs[nc:]
        qr = query_latent(cfg, w, latent, hp, be)
        index_q = None
        if self._qr_stack is not None:
            q_lin, index_q = self._qr_stack.project(qr, be, cnt)
        else:
            q_lin = dense(qr, w.wq_b, be, counters=cnt)
        q = query_heads(cfg, q_lin, hp, self.inv_freq, be, cos_sin_out=cs)
        return InputProjections(q, qr, kv_raw, index_q, index_w[0] if index_w else None, cs, comp)

    def compressor_projections_all(
        self, x: torch.Tensor, cws: list, positions: torch.Tensor, ip: InputProjections | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``compressor_projections`` of several compressors (a CSA layer's main and indexer ones) for one x: on the
        Triton tf32x3 path one GEMM launch for all their weights (``linear_fp32_group``); FP8 weights (all of the
        layer's compressors, ``self._comp8``) one ``fp8_linear`` launch with fp32 outputs, or none where the x stack
        computed them (``STACK_COMPRESSORS``: ``ip.comp``, x's ``input_projections``)."""
        if ip is not None and ip.comp is not None and [id(c) for c in cws] == [id(c) for c in self.w.compressors]:
            return ip.comp
        comp8 = self._comp8
        if comp8 is not None and self.compressor_gemm != "fp32" and use_triton(self.backend, x, comp8.data):
            if [id(c) for c in cws] == [id(c) for c in self.w.compressors]:
                y = fp8_linear(x, comp8, self.backend, counters=self._linear_counters, out_dtype=torch.float32)
                ys = torch.split(y, self._comp8_widths, dim=1)
                return [(ys[2 * i], ys[2 * i + 1]) for i in range(len(cws))]
        if any(isinstance(wt, FP8Weight) for cw in cws for wt in (cw.wkv, cw.wgate)):
            return [self.compressor_projections(x, cw, positions) for cw in cws]
        weights = [wt for cw in cws for wt in self._w16.get(id(cw), (cw.wkv, cw.wgate))]
        if self.compressor_gemm != "fp32" and use_triton(self.backend, x, *weights):
            ys = linear_fp32_group(
                x, weights, backend=self.backend, counters=self._linear_counters, precision=self._gemm_precision(x)
            )
            return [(ys[2 * i], ys[2 * i + 1]) for i in range(len(cws))]
        return [self.compressor_projections(x, cw, positions) for cw in cws]

    def compressor_projections(self, x: torch.Tensor, cw, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv, score without ape) fp32 [T, c*d] of one compressor (weights ``cw``) for x [T, dim] (bf16: the fp32
        projections of its exact fp32 value, widened inside the GEMM; FP8 weights: ``fp8_linear`` with fp32 outputs
        on the Triton path)."""
        fp8 = [isinstance(t, FP8Weight) for t in (cw.wkv, cw.wgate)]
        if any(fp8):
            if all(fp8) and self.compressor_gemm != "fp32" and use_triton(self.backend, x, cw.wkv.data):
                kw = dict(counters=self._linear_counters, out_dtype=torch.float32)
                return fp8_linear(x, cw.wkv, self.backend, **kw), fp8_linear(x, cw.wgate, self.backend, **kw)
            return F.compressor_project(x, cw.wkv, cw.wgate, None, positions, self.ratio)
        if self.compressor_gemm != "fp32" and use_triton(self.backend, x, cw.wkv, cw.wgate):
            return linear_fp32_pair(
                x, *self._w16.get(id(cw), (cw.wkv, cw.wgate)), backend=self.backend, counters=self._linear_counters,
                precision=self._gemm_precision(x),
            )  # fmt: skip
        return F.compressor_project(x, cw.wkv, cw.wgate, None, positions, self.ratio)

    def _gemm_precision(self, x: torch.Tensor) -> str:
        """``linear_fp32_group``'s precision for ``compressor_gemm`` and this x (bf16x3 and bf16w need a bf16 x;
        bf16w weights exact in bf16, ``BF16_EXACT_COMPRESSOR``)."""
        if x.dtype != torch.bfloat16:
            return "tf32x3"
        return "bf16x3" if self.compressor_gemm == "bf16x3" else "bf16w" if self._bf16w else "tf32x3"

    def _indexer_topk(
        self, x: torch.Tensor, qr: torch.Tensor, handle: LayerCacheHandle, ip: InputProjections | None = None
    ) -> torch.Tensor:
        """Logical top-k entry index [T, index_topk] of the step's rows (``ip``: the indexer's GEMM outputs the stacks
        computed, if any)."""
        cfg, plan, rp = self.cfg, handle.plan, handle.ratio_plan
        q_idx, wts = indexer_query(
            cfg, self.w, x, qr, plan.positions[:, None], self.inv_freq, self.backend, counters=self._linear_counters,
            q_lin=None if ip is None else ip.index_q, w_lin=None if ip is None else ip.index_w,
        )  # fmt: skip
        iv = handle.read_indexer_view()
        # a prefill scores and selects in row chunks of bounded memory, each only as wide as its rows can see;
        # a decode step (maybe graph-captured: its host fields go stale) uses static widths only
        nv_host = tr_host = None
        if not plan.is_decode:
            nv_host = plan.memo(("n_visible", self.ratio), lambda: plan.host_n_visible(self.ratio))
            tr_host = plan.memo("request_ids", plan.host_request_ids)
        return indexer_topk(
            q_idx, wts.float(), iv.pages, rp.block_table, plan.request_ids, rp.n_visible, rp.max_entries,
            cfg.index_topk, self.backend, n_visible_host=nv_host, token_row_host=tr_host,
            counters=self._linear_counters,
        )  # fmt: skip

    @staticmethod
    def decode_window_index(handle: LayerCacheHandle) -> torch.Tensor:
        """Decode: the buffer [T, ring_size] int32 of the queries' window index, which ``handle.write_window``
        fills (``window_index=``) with the physical ring slots of positions t-ring_size+1 .. t (-1 before position 0
        and on a padded row)."""
        plan = handle.plan
        return torch.empty(plan.num_tokens, handle.schema.ring_size, dtype=torch.int32, device=plan.device)

    def _window_workspace(self, handle: LayerCacheHandle) -> tuple[EntryPages, torch.Tensor, torch.Tensor]:
        """Prefill/mixed: an FP8 workspace holding each request's window history (copied from the ring
        before this step writes it) followed by its new tokens.

        Returns (workspace pages [1 page of W rows], window index [T, window] into it, the workspace row
        of every token of the step [T]).  The indices come from the plan's host fields (a prefill step is not
        graph-captured), built once per plan for all its layers (``window_workspace_index``).
        """
        plan, schema = handle.plan, handle.schema
        ix = plan.memo(("window_workspace", schema.ring_size), lambda: window_workspace_index(plan, schema.ring_size))
        fmt = schema.entry_fmt
        buf = torch.zeros(fmt.page_bytes(ix.rows), dtype=torch.uint8, device=plan.device)
        ws = fmt.entry_pages(buf, 1, ix.rows)
        if ix.dst.numel():  # history rows ring[slot, p % ring] -> ws[base + p - (ctx - hist)]
            sv = handle.read_swa_view()
            ws.nope[0, ix.dst] = sv.fp8[ix.src_slot, ix.src_row]
            ws.rope[0, ix.dst] = sv.rope[ix.src_slot, ix.src_row]
            ws.scale[0, ix.dst] = sv.inv_scale[ix.src_slot, ix.src_row]
        return ws, ix.index, ix.chunk_rows


class WindowWorkspaceIndex(NamedTuple):
    """Where a prefill step's window keys go in its workspace (``window_workspace_index``); device tensors (the
    history gather's int64, as indexing takes them, once a step; the kernels' int32)."""

    rows: int  # workspace rows in all (host int)
    dst: torch.Tensor  # [H] int64 workspace row of each history row copied from the ring
    src_slot: torch.Tensor  # [H] int64 its request's state slot
    src_row: torch.Tensor  # [H] int64 its ring row (position mod ring)
    index: torch.Tensor  # [T, ring] int32 workspace rows a query attends (positions t - ring + 1 .. t), -1 before 0
    chunk_rows: torch.Tensor  # [T] int32 workspace row of each token of the step


def _fp8_compressor_weights(w: AttentionWeights) -> list[FP8Weight]:
    """The layer's compressor weights (wkv, wgate of the main, then of the indexer's compressor) where every one is an
    ``FP8Weight`` of whole 128-row scale blocks (so they stack by rows, ``stack_rows``); else (or none) []."""
    ws = [t for c in w.compressors for t in (c.wkv, c.wgate)]
    return ws if all(isinstance(t, FP8Weight) and t.shape[0] % WEIGHT_BLOCK == 0 for t in ws) else []


def _gather_fp8_compressors(w: AttentionWeights) -> tuple[AttentionWeights, FP8Weight | None, list[int]]:
    """Where every compressor weight of the layer (wkv, wgate of the main and, CSA, the indexer's compressor) is an
    ``FP8Weight`` whose rows are whole 128-row scale blocks: one FP8Weight of all of them stacked by rows (so one
    ``fp8_linear`` launch projects them all), and ``w`` with its compressor weights replaced by row views of it (no
    second copy is kept).  Else (w, None, [])."""
    ws = _fp8_compressor_weights(w)
    stacked = stack_rows(ws)
    if stacked is None:
        return w, None, []
    cat, views = stacked
    return _with_compressor_views(w, iter(views)), cat, [t.shape[0] for t in ws]


class InputProjections(NamedTuple):
    """``AttentionSubBlock.input_projections``: what the layer computes from its input x [T, dim] before the caches."""

    q: torch.Tensor  # [T, H, D] bf16, per-head normed and RoPE'd
    qr: torch.Tensor  # [T, q_lora_rank] bf16, the normed query latent
    kv_raw: torch.Tensor  # [T, head_dim] bf16, ``wkv``'s output
    index_q: torch.Tensor | None = None  # [T, Hi·Di] bf16, ``indexer.wq_b``'s output where the qr stack computed it
    index_w: torch.Tensor | None = None  # [T, Hi] bf16, ``indexer.weights_proj``'s where the x stack computed it
    cos_sin: torch.Tensor | None = None  # [T, rd/2, 2] fp32, q's rotation, where wo_a de-rotates (``fuse_derotate``)
    comp: list | None = None  # (kv, score) fp32 [T, c·d] a compressor (w.compressors' order), where x's stack gave them


class ProjectionStack(NamedTuple):
    """Linear weights of one input stacked by rows (``stack_weights``): one GEMM launch gives all their outputs,
    ``widths`` consecutive column ranges of it (row-strided views); the first ``n_fp32`` of them (FP8 compressor
    weights, ``STACK_COMPRESSORS``) in fp32, by ``fp8_linear_mixed``."""

    weight: torch.Tensor | FP8Weight
    widths: list[int]
    n_fp32: int = 0

    @property
    def tensor(self) -> torch.Tensor:
        """The stacked weight's (FP8: data) tensor, for dispatch checks."""
        return self.weight.data if isinstance(self.weight, FP8Weight) else self.weight

    def project(self, x: torch.Tensor, backend: str, counters: torch.Tensor | None) -> list[torch.Tensor]:
        """x [T, in] bf16 -> one view [T, width] bf16 a stacked weight (row stride the stack's rows), by ``dense``
        (``fp8_linear`` for FP8 weights, cuBLAS for bf16 ones); the first ``n_fp32`` fp32 (``fp8_linear_mixed``)."""
        if not self.n_fp32:
            return list(torch.split(dense(x, self.weight, backend, counters=counters), self.widths, dim=1))
        lo = self.widths[: self.n_fp32]
        y32, y16 = fp8_linear_mixed(x, self.weight, sum(lo), backend, counters=counters)
        return [*torch.split(y32, lo, dim=1), *torch.split(y16, self.widths[self.n_fp32 :], dim=1)]


def stack_weights(weights: list) -> tuple[torch.Tensor | FP8Weight, list] | None:
    """Linear weights [out_i, in] of one input stacked by rows, and each one's row view of the stack (same values, no
    second copy): ``FP8Weight``s by ``stack_rows``; plain 2-D tensors of one dtype, device and input width by
    concatenation.  None where they do not stack (a mix, other widths, FP8 rows off the scale blocks)."""
    if all(isinstance(t, FP8Weight) for t in weights):
        return stack_rows(weights)
    if len(weights) < 2 or not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in weights):
        return None
    t0 = weights[0]
    if any(t.dtype != t0.dtype or t.device != t0.device or t.shape[1] != t0.shape[1] for t in weights):
        return None
    cat = torch.cat(weights)
    return cat, list(torch.split(cat, [t.shape[0] for t in weights]))


def _stack_projections(
    w: AttentionWeights, compressors: bool = False
) -> tuple[AttentionWeights, ProjectionStack | None, ProjectionStack | None]:
    """(w with the stacked weights replaced by views of the stacks, the x stack ``wq_a`` + ``wkv`` (+ the indexer's
    ``weights_proj`` where it stacks with them; ``compressors``: after the compressors' wkv, wgate, where they are FP8
    of whole scale blocks and stack with them), the qr stack ``wq_b`` + (CSA) ``indexer.wq_b``); a stack is None
    where its weights do not stack (``stack_weights``)."""
    cws = _fp8_compressor_weights(w) if compressors else []
    # (the indexer's weights_proj, 64 rows, last: bf16 in V4's checkpoints, so it joins bf16 stacks only)
    tails = ([[w.wq_a, w.wkv, w.indexer.weights_proj]] if w.indexer is not None else []) + [[w.wq_a, w.wkv]]
    heads = [cws, []] if cws else [[]]  # (with the compressors where they stack, else without)
    tried = ((stack_weights(h + t), len(h)) for h in heads for t in tails)
    xs, nc = next(((st, n) for st, n in tried if st is not None), (None, 0))
    if nc:
        w = _with_compressor_views(w, iter(xs[1]))
    if xs is not None and len(xs[1]) - nc == 3:
        w = dataclasses.replace(w, indexer=dataclasses.replace(w.indexer, weights_proj=xs[1][nc + 2]))
    if xs is not None:
        w = dataclasses.replace(w, wq_a=xs[1][nc], wkv=xs[1][nc + 1])
    qs = stack_weights([w.wq_b, w.indexer.wq_b]) if w.indexer is not None else None
    if qs is not None:
        w = dataclasses.replace(w, wq_b=qs[1][0], indexer=dataclasses.replace(w.indexer, wq_b=qs[1][1]))
    return (
        w,
        None if xs is None else ProjectionStack(xs[0], [t.shape[0] for t in xs[1]], nc),
        None if qs is None else ProjectionStack(qs[0], [t.shape[0] for t in qs[1]]),
    )


def _with_compressor_views(w: AttentionWeights, views) -> AttentionWeights:
    """``w`` with the wkv and wgate of its compressors (main, then the indexer's) the next of ``views`` (an iterator
    over a stack's row views, in that order)."""

    def comp(c: CompressorWeights) -> CompressorWeights:
        return dataclasses.replace(c, wkv=next(views), wgate=next(views))

    w = dataclasses.replace(w, compressor=comp(w.compressor))
    if w.indexer is not None:
        w = dataclasses.replace(w, indexer=dataclasses.replace(w.indexer, compressor=comp(w.indexer.compressor)))
    return w


def window_workspace_index(plan: StepPlan, ring: int) -> WindowWorkspaceIndex:
    """The workspace layout of a non-decode step from the plan's host fields: each request's last
    ``min(ctx, ring - 1)`` cached positions (copied from its ring) and then its new tokens, requests one after
    another.  The [T] / [H] arrays go to the device in one copy (``int32_to_device``); the [T, ring] window index is
    built there from the tokens' positions and workspace offsets (on the host it was ring times the bytes and, at
    65,536 tokens, most of a step's host time)."""
    ctx = np.asarray(plan.context_lens, dtype=np.int64)
    new = np.asarray(plan.num_new_tokens, dtype=np.int64)
    hist = np.minimum(ctx, ring - 1)
    base = np.concatenate([[0], np.cumsum(hist + new)])[:-1]
    b_of = np.repeat(np.arange(len(ctx)), hist)
    p_hist = np.concatenate([np.arange(c - h, c) for c, h in zip(ctx, hist, strict=True)] + [np.zeros(0, np.int64)])
    dst = base[b_of] + p_hist - (ctx - hist)[b_of]
    src_slot = np.asarray(plan.slot_ids, dtype=np.int64)[b_of]

    row = np.repeat(np.arange(len(ctx)), new)
    offset = base[row] - (ctx - hist)[row]  # workspace row of a token's request's position 0
    gather = int32_to_device([dst, src_slot, p_hist % ring, plan.host_positions()[: len(row)], offset], plan.device)
    pos_t, off_t = gather[3:]
    key_pos = pos_t[:, None] - (ring - 1) + torch.arange(ring, dtype=torch.int32, device=pos_t.device)[None, :]
    index = torch.where(key_pos >= 0, off_t[:, None] + key_pos, -1).to(torch.int32)
    return WindowWorkspaceIndex(int((hist + new).sum()), *(g.long() for g in gather[:3]), index, off_t + pos_t)
