"""``dsv4 bench``: the decode step of one attention layer of each kind, dsv4 vs plain PyTorch vs roofline.

For every model (V4-Flash / V4-Pro widths, random weights), layer kind (SWA / CSA / HCA), context C and
batch B: one layer (a one-layer config with the preset's widths, ``max_seq_len`` raised to the largest
context) and a ``KVCacheManager`` holding max(B) requests of C - 1 cached tokens each, so the decode
token sits at position C - 1, where both CSA (m = 4) and HCA (m = 128) emit a compressed entry (the
step's worst case; C is a multiple of 128).

Synthetic cache fill (no prefill through the model: too slow at 1M): the context lengths are planned and
committed without running the layer, then every page of the pools is written with
``store_fp8_entries`` / ``store_mxfp4_keys`` of random N(0, 1) bf16 rows (random bytes would create NaN
e4m3 codes), the compressor states with random fp32 rows, the window rings with random entries and the
positions of the last ``ring_size`` tokens.

Timings (GPU: ``triton.testing.do_bench`` medians; CPU: wall clock of one call):
- ``step`` eager: ``AttentionSubBlock`` on the bucket's static plan (``DecodeGraphRunner(capture=False)``);
  ``step`` graph: the same captured in a CUDA graph (``DecodeGraphRunner``), replay only (the host-side
  plan is not timed).  Both give the same output bit for bit (checked: ``graph_equal``).
- parts, each on the step's own intermediate tensors, eager and inside a CUDA graph of
  ``GRAPH_CALLS`` back-to-back calls: ``window_store`` (handle.write_window), ``compressor``
  (the layer's compressor projections -- one tf32x3 GEMM a compressor on the GPU -- + handle.compress,
  main and CSA indexer compressors),
  ``indexer`` (indexer_query + indexer_scores), ``topk`` (topk_indices), ``attention``
  (sparse_attention over window + compressed entries), ``projections`` (query, wkv, output projection).
  ``cache_path`` = window_store + compressor + indexer + topk + attention.
- ``baseline``: the same step written in plain, vectorised PyTorch (``plain_decode_step``: gather the
  FP8 entries, dequantise, einsum, softmax with the sink column, ``torch.topk``) -- eager (and with
  ``--compile``, torch.compile'd too).  Its output is compared with dsv4's on the same inputs and cache:
  pass iff max |Δ| <= 0.05 and mean |Δ| <= 3e-3 (the per-layer bounds of ``engine.runner.Tolerance``:
  both round identically up to fp32 summation order, one bf16 ulp), per output row; a row that fails
  while its indexer scores have an exact tie at the top-k boundary is excused and counted in
  ``tie_rows`` (dsv4 breaks ties by index, ``torch.topk`` arbitrarily; with the tiny config's 4 index
  heads ReLU makes many scores exactly 0).  A CSA row that fails is checked once more with the plain
  indexer query computed from dsv4's ``q_norm`` latent: when the two latents differ (by one bf16 ulp in
  a value: the fp32 sum orders of the two RMSNorms, ``kernels.norm``) and the row then passes, it is
  excused and counted in ``qr_rows``.  The MXFP4 query makes the selection discontinuous in the latent:
  on the H200 at 1M tokens one ulp in 1 of 1,024 latent values changed 8-18 e2m1 query values, the
  scores by up to 1.9 % of the row's largest and 10-14 of the 512 selected entries (2 of 69 rows,
  ``benchmarks/study_decode_check.py``).  A CSA row that still fails is checked with the plain step attending dsv4's
  own selection (``index_sel``): FP8 weights and stacked GEMMs change the projections' last bits beyond the latent
  (the indexer query too), which moves entries across the top-k boundary in many rows (H200, 2026-12-05: B = 64 at
  128K, stacked bf16 and FP8 steps, max |Δ| 0.047-0.065).  A row that then passes is excused and counted in
  ``selection_rows``; ``selection_max_rel_gap`` is the most that the plain scores of dsv4's selected entries fall
  below the plain k-th score (relative to it), over those rows: the selection is the top-k up to that gap.

Size and run time of the default sweep (2 models x 3 kinds x 4K/128K/1M x B 1/8/64 = 54 configurations):
the cache of one CSA layer at 1M tokens is 262,144 entries x (584 + 68) B = 171 MB per request, 10.9 GB
for 64 requests (HCA: 8,192 x 584 B = 4.8 MB per request), so B = 64 fits at 1M; the plain baseline
dequantises indexer keys 2^23 (request, entry) pairs at a time (~20 GB peak).  Planning the contexts
costs ~0.2 s of host time per 1M-token request (~13 s per compressed kind and model at 1M); every
configuration takes ~2-3 s of timing.  Expected total: ~4-5 minutes (split with ``--models`` if needed).

Roofline (H200: 4.17e12 B/s HBM, 776e12 bf16 FLOP/s): per part, max(bytes / BW, flops / PEAK) with the
bytes the part must move at least (weights it reads, cache entries / keys / state it reads, what it
writes; small vectors ignored) and its matmul FLOPs; the step's roofline is the sum of the parts'.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from dsv4.cache.manager import KVCacheManager
from dsv4.cache.schema import CacheSchema
from dsv4.config import ModelConfig, get_preset
from dsv4.engine.graphs import DecodeGraphRunner, capture_graph
from dsv4.formats.fp8_weight import FP8Weight
from dsv4.kernels.attention import sparse_attention
from dsv4.kernels.cache.store import store_fp8_entries, store_mxfp4_keys
from dsv4.kernels.indexer import indexer_scores, to_physical, topk_indices, visible_physical
from dsv4.model import attention as attention_mod
from dsv4.model import functional as F
from dsv4.model.attention import AttentionSubBlock
from dsv4.model.projections import indexer_query, output_projection, query
from dsv4.model.weights import AttentionWeights, random_attention_weights

__all__ = ["BenchSettings", "plain_decode_step", "run_bench", "format_table"]

PEAK_HBM_BYTES = 4.17e12
PEAK_BF16_FLOPS = 776e12
GRAPH_CALLS = 10
KIND_RATIO = {"swa": 0, "csa": 4, "hca": 128}
PARTS = ("window_store", "compressor", "indexer", "topk", "attention", "projections")
CACHE_PARTS = PARTS[:-1]
MATCH_MAX_ABS, MATCH_MEAN_ABS = 0.05, 3e-3
_FILL_CHUNK = 1 << 20  # rows per store call of the synthetic fill


@dataclass(frozen=True)
class BenchSettings:
    models: tuple[str, ...] = ("v4-flash", "v4-pro")
    contexts: tuple[int, ...] = (4096, 131072, 1048576)
    batches: tuple[int, ...] = (1, 8, 64)
    kinds: tuple[str, ...] = ("swa", "csa", "hca")
    graph: bool = True
    compile: bool = False
    device: str = "auto"
    backend: str = "auto"
    smoke: bool = False
    seed: int = 0
    # block tables sized for this many tokens (an engine's static max length under CUDA graphs); None: the context
    table_context: int | None = None
    # the layer's linear weights kept FP8 (``random_attention_weights(fp8=True)``: kernels.fp8_linear); the plain
    # PyTorch step gets them dequantised to bf16 once, as a user would load them
    fp8_weights: bool = False
    # the layer's projections of one input as one GEMM launch (``AttentionSubBlock(stack_projections=)``; None: the
    # layer's default, ``attention.STACK_PROJECTIONS``)
    stack_projections: bool | None = None

    @property
    def stacked(self) -> bool:
        """Whether the benchmarked layer stacks its projections (``stack_projections`` or the layer's default)."""
        return attention_mod.STACK_PROJECTIONS if self.stack_projections is None else bool(self.stack_projections)


SMOKE = BenchSettings(models=("tiny",), contexts=(256, 512), batches=(1, 3), graph=False, device="cpu", smoke=True)


# ---------------------------------------------------------------------------------------------- timing
def _time(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds per call: do_bench median (CUDA events) on a GPU, wall clock of one call after one warm-up
    call on the CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _graph_time(fn: Callable[[], object], device: torch.device) -> float | None:
    """Seconds per call of ``fn`` replayed from a CUDA graph of GRAPH_CALLS back-to-back calls."""
    if device.type != "cuda":
        return None
    import triton.testing

    g, _ = capture_graph(fn, warmup=2, calls=GRAPH_CALLS)
    t = triton.testing.do_bench(g.replay, warmup=5, rep=40, return_mode="median") * 1e-3
    del g
    return t / GRAPH_CALLS


def _roofline(nbytes: float, flops: float) -> float:
    return max(nbytes / PEAK_HBM_BYTES, flops / PEAK_BF16_FLOPS)


def _nbytes(*ts: torch.Tensor | FP8Weight) -> int:
    return sum(t.nbytes if isinstance(t, FP8Weight) else t.numel() * t.element_size() for t in ts)


# ---------------------------------------------------------------------------------------------- setup
def bench_config(model: str, kind: str, max_context: int) -> ModelConfig:
    """A one-layer config (layer 0 of ``kind``) at ``model``'s widths holding ``max_context`` tokens."""
    base = get_preset(model)
    return base.replace(
        name=base.name,
        n_layers=1,
        n_mtp_layers=0,
        compress_ratios=(KIND_RATIO[kind],),
        max_seq_len=max(base.max_seq_len, max_context),
    )


def fill_cache(m: KVCacheManager, n_requests: int, context: int, gen: torch.Generator, backend: str) -> None:
    """Admit ``n_requests`` requests of ``context - 1`` cached tokens and fill layer 0's cache with random
    but valid content (see module docstring)."""
    dev, schema = m.device, m.schema
    cached = context - 1
    for r in range(n_requests):
        if not m.add(r):
            raise RuntimeError("fill_cache: no free slot")
        plan = m.plan({r: cached})
        if plan is None:
            raise RuntimeError(f"fill_cache: the pools cannot hold {n_requests} x {context} tokens")
        m.commit(plan)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32).to(dtype)

    def fill_rows(num: int, width: int, store) -> None:
        for a in range(0, num, _FILL_CHUNK):
            n = min(_FILL_CHUNK, num - a)
            store(randn(n, width), torch.arange(a, a + n, device=dev, dtype=torch.int32))

    efmt, kfmt = schema.entry_fmt, schema.key_fmt
    for pool in m.pools.values():
        entries, keys = pool.layer(0).entries, pool.layer(0).keys
        fill_rows(entries.num_slots, efmt.head_dim, partial(_store_e, pages=entries, fmt=efmt, backend=backend))
        if keys is not None:
            n_keys = keys.data.shape[0] * keys.entries_per_page
            fill_rows(n_keys, kfmt.dim, partial(_store_k, pages=keys, fmt=kfmt, backend=backend))
    st = m.state.layer(0)
    for comp in (st.compressor, st.indexer_compressor):
        if comp is not None:
            comp.kv.copy_(randn(*comp.kv.shape, dtype=torch.float32))
            comp.score.copy_(randn(*comp.score.shape, dtype=torch.float32))
            if comp.positions is not None:  # online: a denominator >= 1, the raw row is the newest cached token's
                comp.kv[:, 1].abs_().add_(1.0)
                comp.positions.fill_(cached - 1)
    ring = schema.ring_size
    fill_rows(st.ring.num_slots, efmt.head_dim, partial(_store_e, pages=st.ring, fmt=efmt, backend=backend))
    last = cached - 1  # position of the newest cached token
    j = torch.arange(ring, device=dev)
    p = last - torch.remainder(last - j, ring)
    st.ring_positions.copy_(torch.where(p >= 0, p, -1).to(torch.int32).expand_as(st.ring_positions))
    st.ring_head.fill_(cached % ring)


def _store_e(x, slots, *, pages, fmt, backend):
    store_fp8_entries(x, slots, pages, fmt, backend=backend)


def _store_k(x, slots, *, pages, fmt, backend):
    store_mxfp4_keys(x, slots, pages, fmt, backend=backend)


# ---------------------------------------------------------------------------------------------- plain PyTorch
def plain_decode_step(blk: AttentionSubBlock, m: KVCacheManager, slots: torch.Tensor, positions: torch.Tensor,
                      block_table: torch.Tensor | None, x: torch.Tensor, index_chunk: int = 1 << 23,
                      aux: dict | None = None, index_qr: torch.Tensor | None = None,
                      w: AttentionWeights | None = None,
                      index_sel: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The decode step of ``blk``'s layer written in plain PyTorch, as a user would (eager, vectorised).

    ``slots`` [B] int64 state slot per request, ``positions`` [B] int64 decode position (= cached tokens),
    ``block_table`` [B, max_blocks] int64 pages of the layer's ratio class (None for SWA), x [B, dim]
    bf16.  Writes the window row, the compressor state rows and the emitted entries into ``m``'s cache
    like the dsv4 step; returns y [B, dim] bf16.  The indexer is computed over ``index_chunk`` (request
    x entry) pairs at a time (dequantised keys of 1M-token contexts x 64 requests do not fit otherwise).
    ``aux`` (a dict, for checks only): receives ``kth_tie`` [B] bool, rows whose k-th and (k+1)-th
    indexer scores are equal (an exact tie at the top-k boundary: which one is picked is arbitrary), and
    (CSA) ``scores`` [B, N] fp32, ``topk`` [B, k] int64, ``q_idx``, ``weights`` and ``qr``: the plain
    indexer scores, selection and query side.  ``index_qr`` (checks only): [B, q_lora_rank] bf16, a query
    latent (after ``q_norm``) for the indexer query in place of the step's own (the attention query keeps
    its own): isolates a one-ulp ``q_norm`` rounding difference, which the MXFP4 query amplifies.  ``w``: the weights
    (default ``blk.w``; the bench passes FP8 ones dequantised to bf16).  ``index_sel`` (checks only, CSA): [B, k]
    logical entries (-1: none) to attend in place of the plain selection (dsv4's own, to tell a selection that moved
    at the top-k boundary from an attention that is wrong); the plain scores are still computed (``aux``).
    """
    cfg, inv, ratio = blk.cfg, blk.inv_freq, blk.ratio
    w = blk.w if w is None else w
    schema = m.schema
    efmt, kfmt, ring, eps = schema.entry_fmt, schema.key_fmt, schema.ring_size, cfg.norm_eps
    st = m.state.layer(blk.layer_id)
    bsz, dev = x.shape[0], x.device
    pos = positions
    q, qr = query(cfg, w, x, pos[:, None], inv)

    # window: kv -> norm -> RoPE -> FP8 -> ring row pos % ring; then read the last `ring` rows
    kv = F.apply_rope(F.rms_norm(F.linear(x, w.wkv), w.kv_norm, eps), pos, inv)
    nope, rope, scale = efmt.quantize(kv)
    rrow = pos % ring
    st.ring.nope.view(torch.uint8)[slots, rrow] = nope.view(torch.uint8)
    st.ring.rope[slots, rrow] = rope
    st.ring.scale[slots, rrow] = scale
    st.ring_positions[slots, rrow] = pos.to(torch.int32)
    kpos = pos[:, None] - (ring - 1) + torch.arange(ring, device=dev)
    r_slot, r_row = slots[:, None].expand(-1, ring), kpos % ring
    keys = [_dequant(st.ring, r_slot, r_row, efmt)]
    valid = [kpos >= 0]

    if ratio:
        paged = m.pools[ratio].layer(blk.layer_id)
        bs = paged.entries_per_page
        _plain_compress(cfg, w.compressor, st.compressor, pos, slots, x, ratio, inv, block_table, bs,
                        lambda y, pg, rw: _store_entries(paged.entries, efmt, y, pg, rw))  # fmt: skip
        n_vis = (pos + 1) // ratio  # [B] entries visible after the step
        n_max = block_table.shape[1] * bs
        j = torch.arange(n_max, device=dev)
        if blk.kind.value == "csa":
            store_keys = partial(_store_keys, paged.keys, kfmt, hadamard=True)
            ic = w.indexer.compressor
            _plain_compress(cfg, ic, st.indexer_compressor, pos, slots, x, ratio, inv, block_table, bs, store_keys)
            q_idx, wts = indexer_query(cfg, w, x, qr if index_qr is None else index_qr, pos[:, None], inv)
            scores = torch.empty(bsz, n_max, dtype=torch.float32, device=dev)
            step = max(1, index_chunk // max(1, n_max))
            for a in range(0, bsz, step):  # requests per chunk
                b = slice(a, min(bsz, a + step))
                pg = block_table[b][:, j // bs].clamp(min=0)
                kd = kfmt.dequantize(paged.keys.data[pg, j % bs], paged.keys.scale[pg, j % bs])  # [b, N, Di] fp32
                logits = torch.einsum("bhd,bnd->bhn", q_idx[b].float(), kd)
                scores[b] = (logits.relu() * wts[b].float()[:, :, None]).sum(1)
            scores = scores.masked_fill(j[None, :] >= n_vis[:, None], float("-inf"))
            k = min(cfg.index_topk, n_max)
            top = torch.topk(scores, k, dim=1)
            idx, ok = top.indices, top.values > float("-inf")
            if index_sel is not None:
                idx, ok = index_sel.long().clamp(min=0), (index_sel >= 0) & (index_sel < n_vis[:, None])
            if aux is not None:
                v = torch.sort(scores, dim=1, descending=True).values
                kk = min(k, n_max - 1)
                aux["kth_tie"] = (v[:, kk - 1] == v[:, kk]) & (v[:, kk] > float("-inf"))
                aux.update(scores=scores, topk=idx, q_idx=q_idx, weights=wts, qr=qr)
        else:
            idx = j[None, :].expand(bsz, -1)
            ok = idx < n_vis[:, None]
        pg = block_table.gather(1, idx // bs)
        ok = ok & (pg >= 0)
        keys.append(_dequant(paged.entries, pg.clamp(min=0), idx % bs, efmt))
        valid.append(ok)

    kv_all = torch.cat(keys, 1).float()  # [B, K, D]
    ok_all = torch.cat(valid, 1)
    s = torch.einsum("bhd,bkd->bhk", q.float(), kv_all) * blk.scale
    s = s.masked_fill(~ok_all[:, None, :], float("-inf"))
    sink = w.attn_sink.float()[None, :, None].expand(bsz, -1, 1)
    p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    o = torch.einsum("bhk,bkd->bhd", p, kv_all).to(torch.bfloat16)
    return output_projection(cfg, w, o, pos[:, None], inv)


def _dequant(pages, page: torch.Tensor, row: torch.Tensor, fmt) -> torch.Tensor:
    from dsv4.formats.fp8_entry import FP8_DTYPE

    nope = pages.nope.view(torch.uint8)[page, row].view(FP8_DTYPE)
    return fmt.dequantize(nope, pages.rope[page, row], pages.scale[page, row])


def _store_entries(pages, fmt, y, pg, rw) -> None:
    nope, rope, scale = fmt.quantize(y)
    pages.nope.view(torch.uint8)[pg, rw] = nope.view(torch.uint8)
    pages.rope[pg, rw] = rope
    pages.scale[pg, rw] = scale


def _store_keys(keys, fmt, y, pg, rw, hadamard: bool = False) -> None:
    packed, scale = fmt.quantize(F.hadamard(y) if hadamard else y)
    keys.data[pg, rw] = packed
    keys.scale[pg, rw] = scale


def _plain_compress(cfg, cw, state, pos, slots, x, ratio, inv, block_table, bs, store) -> None:
    """Compressor decode: state row pos % (c*m) <- this token; pool the last c*m rows where an entry
    completes; norm, RoPE at the entry position, store into the entry's page.  An online state
    (``state.positions``): prefix + raw row -> new prefix, this token -> raw row, pooled = prefix + token."""
    overlap = cfg.overlap(ratio)
    c = 2 if overlap else 1
    cm = c * ratio
    kv, score = F.compressor_project(x, cw.wkv, cw.wgate, cw.ape, pos, ratio)
    if state.positions is not None:
        pooled = _plain_online(state, kv, score, pos, slots, ratio)
        _plain_emit(cfg, cw, pooled, pos, ratio, inv, block_table, bs, store)
        return
    state.kv[slots, pos % cm] = kv
    state.score[slots, pos % cm] = score
    rows = pos[:, None] - cm + 1 + torch.arange(cm, device=x.device)  # [B, cm] positions, oldest first
    gk = state.kv[slots[:, None], rows % cm]
    gs = state.score[slots[:, None], rows % cm].masked_fill((rows < 0)[..., None], float("-inf"))
    gk = gk.masked_fill((rows < 0)[..., None], 0.0)
    if overlap:
        d = kv.shape[1] // 2
        gk = torch.cat([gk[:, :ratio, :d], gk[:, ratio:, d:]], 1)
        gs = torch.cat([gs[:, :ratio, :d], gs[:, ratio:, d:]], 1)
    pooled = (gk * gs.softmax(1)).sum(1)
    _plain_emit(cfg, cw, pooled, pos, ratio, inv, block_table, bs, store)


def _plain_emit(cfg, cw, pooled, pos, ratio, inv, block_table, bs, store) -> None:
    sel = ((pos + 1) % ratio == 0).nonzero().squeeze(1)  # requests whose entry completes (a host sync)
    e = pos[sel] // ratio
    y = F.apply_rope(F.rms_norm(pooled[sel].to(torch.bfloat16), cw.norm, cfg.norm_eps), e * ratio, inv)
    store(y, block_table[sel, e // bs], e % bs)


def _plain_online(state, kv, score, pos, slots, ratio) -> torch.Tensor:
    """One decode token a request into an online state (max, den, acc of the chunk before the newest row; that row
    raw; its position): returns the pooled rows [B, d] (meaningful where the token completes an entry)."""
    inf = float("-inf")
    tag = state.positions[slots].long()[:, None]
    p = pos[:, None]
    use = p % ratio != 0  # the chunk began before this token
    raw = use & (tag < p) & (tag >= p - p % ratio)  # the raw row is an older token's (not a re-run of this one)
    mx = state.score[slots, 0].masked_fill(~use, inf)
    den = state.kv[slots, 1].masked_fill(~use, 0.0)
    acc = state.kv[slots, 0].masked_fill(~use, 0.0)
    r_sc = state.score[slots, 1].masked_fill(~raw, inf)
    r_kv = state.kv[slots, 2].masked_fill(~raw, 0.0)

    def fold(mx, den, acc, s, one, v):
        m = torch.maximum(mx, s)
        ref = m.masked_fill(m == inf, 0.0)
        fa, fb = torch.exp(mx - ref), torch.exp(s - ref)
        return m, den * fa + one * fb, acc * fa + v * fb

    mx, den, acc = fold(mx, den, acc, r_sc, raw.float(), r_kv)
    state.score[slots, 0], state.kv[slots, 1], state.kv[slots, 0] = mx, den, acc
    state.score[slots, 1], state.kv[slots, 2] = score, kv
    state.positions[slots] = pos.to(torch.int32)
    _, den, acc = fold(mx, den, acc, score, torch.ones_like(score), kv)
    return acc / den


# ---------------------------------------------------------------------------------------------- dsv4 parts
def _parts(blk: AttentionSubBlock, handle, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each part of the dsv4 decode step as a closure over the step's own intermediates."""
    cfg, w, be, inv = blk.cfg, blk.w, blk.backend, blk.inv_freq
    plan, rp = handle.plan, handle.ratio_plan
    hp = plan.positions[:, None]
    cnt = blk._linear_counters  # noqa: SLF001 - the layer's own (its projections take them)
    ip = blk.input_projections(x, plan.positions)
    q, qr, kv_raw = ip.q, ip.qr, ip.kv_raw
    out: dict[str, Callable[[], object]] = {}

    win = blk.decode_window_index(handle)  # (the layer's decode step: the store writes the window index)
    out["window_store"] = lambda: handle.write_window(kv_raw, w.kv_norm, inv, backend=be, window_index=win)
    out["window_store"]()

    def compress():
        comps = [(w.compressor, "main")] + ([(w.indexer.compressor, "indexer")] if blk.kind.value == "csa" else [])
        # as the layer: where the x stack computes the compressors' projections (STACK_COMPRESSORS), they are part of
        # "projections" and this part is the compress launch alone
        projections = blk.compressor_projections_all(x, [cw for cw, _ in comps], plan.positions, ip)
        steps = [(kv, gate, cw.norm, which, cw.ape) for (cw, which), (kv, gate) in zip(comps, projections, strict=True)]
        handle.compress_all(steps, inv, backend=be)

    caches = [(handle.read_swa_view().pages, win)]
    if blk.ratio:
        out["compressor"] = compress
    if blk.ratio and blk.kind.value == "csa":
        iv = handle.read_indexer_view()

        def index():
            q_idx, wts = indexer_query(cfg, w, x, qr, hp, inv, be, counters=cnt, q_lin=ip.index_q, w_lin=ip.index_w)
            return indexer_scores(q_idx, wts.float(), iv.pages, rp.block_table, plan.request_ids, rp.n_visible,
                                  rp.max_entries, backend=be)  # fmt: skip

        scores = index()
        out["indexer"] = index
        out["topk"] = lambda: topk_indices(scores, cfg.index_topk, rp.n_visible, backend=be, counters=cnt)
        logical = out["topk"]()
        phys = to_physical(logical, rp.block_table, plan.request_ids, rp.entries_per_page, backend=be)
        caches.append((handle.paged.entries, phys))
    elif blk.ratio:
        phys = visible_physical(rp.n_visible, rp.max_entries, rp.block_table, plan.request_ids, rp.entries_per_page,
                                backend=be)  # fmt: skip
        caches.append((handle.paged.entries, phys))
    out["attention"] = lambda: sparse_attention(q, caches, w.attn_sink, blk.scale, backend=be)
    o = out["attention"]()[0]

    def projections():
        ipp = blk.input_projections(x, plan.positions)  # (with the FP8 stacks: the indexer's wq_b too)
        # as the layer runs it (o rotated in place, or in wo_a's load at the query's (cos, sin) where that applies: each
        # timed call rotates it again; the time does not depend on it)
        return output_projection(cfg, w, o, hp, inv, be, consume_o=True, counters=cnt, cos_sin=ipp.cos_sin)

    out["projections"] = projections
    return out


def _part_cost(part: str, blk: AttentionSubBlock, m: KVCacheManager, bsz: int, context: int) -> tuple[float, float]:
    """(bytes, flops) the part must move / compute at least (module docstring)."""
    cfg, w, schema = blk.cfg, blk.w, m.schema
    efmt, kfmt = schema.entry_fmt, schema.key_fmt
    entry_b = efmt.data_bytes + efmt.n_tiles  # nope + rope + tile scales
    key_b = kfmt.data_bytes + kfmt.n_blocks
    d = cfg.head_dim
    ratio = blk.ratio
    n_vis = context // ratio if ratio else 0
    # the indexer's weights that the stacks project with the layer's own: in the projections part, not the indexer's
    stacked = blk.stacked_indexer_weights
    if part == "projections":
        ws = [w.wq_a, w.wq_b, w.wkv, w.wo_a, w.wo_b] + stacked
        return _nbytes(*ws) + bsz * cfg.dim * 2 * 2, 2.0 * bsz * sum(t.numel() for t in ws)
    if part == "window_store":  # (+ the queries' window index: ring_size int32 slots a row)
        return bsz * (2 * d * 2 + entry_b + schema.ring_size * 4), 0.0
    if part == "compressor":
        nb, fl = 0.0, 0.0
        comps = [(w.compressor, d, entry_b)]
        if blk.kind.value == "csa":
            comps.append((w.indexer.compressor, cfg.index_head_dim, key_b))
        c = 2 if cfg.overlap(ratio) else 1
        for cw, dd, out_b in comps:
            nb += _nbytes(cw.wkv, cw.wgate)
            fl += 2.0 * bsz * (cw.wkv.numel() + cw.wgate.numel())
            nb += bsz * (c * ratio * c * dd * 4 * 2 + out_b)  # pooled window of the state (kv + score), entry
        return nb, fl
    if part == "indexer":
        iw = w.indexer
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        iws = [t for t in (iw.wq_b, iw.weights_proj) if not any(t is u for u in stacked)]
        nb = _nbytes(*iws) + bsz * n_vis * (key_b + 4)
        return nb, 2.0 * sum(t.numel() for t in iws) * bsz + 2.0 * bsz * n_vis * hi * di
    if part == "topk":
        return bsz * (n_vis * 4 + cfg.index_topk * 4), 0.0
    if part == "attention":
        k = min(context, cfg.window_size)
        if blk.kind.value == "csa":
            k += min(cfg.index_topk, n_vis)
        elif ratio:
            k += n_vis
        return bsz * (k * entry_b + 2 * cfg.n_heads * d * 2), 4.0 * bsz * cfg.n_heads * k * d
    raise ValueError(part)


# ---------------------------------------------------------------------------------------------- the run
def _env(device: torch.device) -> dict:
    import triton

    from dsv4.kernels.dispatch import pdl_launch

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "pdl": pdl_launch(device)["PDL"]}


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def run_bench(s: BenchSettings, log: Callable[[str], None] = print) -> list[dict]:
    """Run the sweep of ``s``; returns the JSON rows (one per step, part, cache path and config)."""
    for c in s.contexts:
        if c < 128 or c % 128:
            raise ValueError(f"--contexts: expected multiples of 128 (the decode token then emits), got {c}")
    for k in s.kinds:
        if k not in KIND_RATIO:
            raise ValueError(f"--kinds: expected some of {sorted(KIND_RATIO)}, got {k!r}")
    if any(b < 1 for b in s.batches):
        raise ValueError(f"--batches: expected positive batch sizes, got {s.batches}")
    device = _resolve_device(s.device)
    graph = s.graph and device.type == "cuda"
    env = _env(device)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows: list[dict] = []
    b_max = max(s.batches)
    for model in s.models:
        for kind in s.kinds:
            for context in s.contexts:
                t0 = time.perf_counter()
                cfg = bench_config(model, kind, max(*s.contexts, s.table_context or 0))
                new = _bench_context(cfg, kind, context, s, device, graph, b_max)
                for r in new:
                    r.update(env, date=date)
                    r["shape"] = dict(model=model, kind=kind, context=context, batch=r.pop("_batch"))
                    if s.table_context:
                        r["shape"]["table_context"] = max(s.table_context, context)
                    r["weights"] = ("fp8" if s.fp8_weights else "bf16") + ("_stacked" if s.stacked else "")
                rows += new
                log(f"  {model} {kind} ctx {context}: {time.perf_counter() - t0:.1f}s")
                if device.type == "cuda":
                    gc.collect()
                    torch.cuda.empty_cache()
    return rows


def _bench_context(cfg, kind, context, s: BenchSettings, device, graph: bool, b_max: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(s.seed)
    backend = "torch" if s.smoke and s.backend == "auto" else s.backend
    w = random_attention_weights(cfg, 0, seed=s.seed, device=device, fp8=s.fp8_weights)
    blk = AttentionSubBlock(cfg, 0, w, backend=backend, stack_projections=s.stack_projections)
    schema = CacheSchema(cfg)
    per_req = {m_: rc.pages_for_tokens(context) for m_, rc in schema.ratio_classes.items()}
    pages = {m_: (n + 1) * b_max + 4 for m_, n in per_req.items()}  # + slack: captures, a page a step
    m = KVCacheManager(cfg, max_requests=b_max + 2, num_pages=pages or 1, device=device)
    fill_cache(m, b_max, context, gen, backend)
    table = max(s.table_context or context, context)  # a wider block table: -1 past each request's pages
    max_blocks = {m_: rc.pages_for_tokens(table) for m_, rc in schema.ratio_classes.items()} or None
    rows = []
    for bsz in sorted(s.batches):
        rows += _bench_batch(blk, m, kind, context, bsz, max_blocks, s, device, graph, gen)
    return rows


def _bench_batch(blk, m, kind, context, bsz, max_blocks, s: BenchSettings, device, graph: bool, gen) -> list[dict]:
    """The rows of one (layer, context, batch): step (eager, graph, plain), parts, cache path."""
    cfg = blk.cfg
    x = torch.randn(bsz, cfg.dim, generator=gen, device=device).to(torch.bfloat16)
    sched = {r: 1 for r in range(bsz)}
    eager = DecodeGraphRunner(m, [blk], buckets=(bsz,), max_blocks=max_blocks, capture=False, forward=_single_layer)
    eager.capture()
    plan, _ = eager.prepare(sched)
    m.cancel(plan)
    eager.static_input(bsz).copy_(x)
    y = eager.replay(bsz).clone()
    t_eager = _time(lambda: eager.replay(bsz), device)
    t_graph, graph_equal = None, None
    if graph:
        runner = DecodeGraphRunner(m, [blk], buckets=(bsz,), max_blocks=max_blocks, forward=_single_layer)
        runner.capture()
        plan, _ = runner.prepare(sched)
        m.cancel(plan)
        runner.static_input(bsz).copy_(x)
        graph_equal = bool(torch.equal(runner.replay(bsz), y))
        t_graph = _time(lambda: runner.replay(bsz), device)
        del runner
    # plain PyTorch on the same inputs and cache
    sp = eager._buckets[bsz].plan  # noqa: SLF001 - the static plan holds this step's tensors
    slots, pos = sp.request_slots.long(), sp.positions.long()
    bt = sp.ratios[blk.ratio].block_table.long() if blk.ratio else None
    aux: dict = {}
    wp = blk.w.dequantized() if blk.w.has_fp8 else None  # the plain step's bf16 weights (loaded once)
    yb = plain_decode_step(blk, m, slots, pos, bt, x, aux=aux, w=wp)
    d = (yb.float() - y.float()).abs()
    max_abs, mean_abs = d.max().item(), d.mean().item()
    row_ok = (d.amax(1) <= MATCH_MAX_ABS) & (d.mean(1) <= MATCH_MEAN_ABS)
    tie = aux.get("kth_tie", torch.zeros_like(row_ok))
    tie_rows = int((~row_ok & tie).sum())
    qr_rows = 0
    if blk.kind.value == "csa" and not bool((row_ok | tie).all()):
        # rows whose indexer selection moved because the two q_norm latents differ by an ulp: they match
        # when the plain indexer query starts from dsv4's latent (everything after it stays the plain's)
        _, qr_dsv4 = query(cfg, blk.w, x, sp.positions[:, None], blk.inv_freq, blk.backend)
        qr_diff = (qr_dsv4 != aux["qr"]).any(1)
        d2 = (plain_decode_step(blk, m, slots, pos, bt, x, index_qr=qr_dsv4, w=wp).float() - y.float()).abs()
        row_ok2 = (d2.amax(1) <= MATCH_MAX_ABS) & (d2.mean(1) <= MATCH_MEAN_ABS)
        qr_ok = ~row_ok & ~tie & qr_diff & row_ok2
        qr_rows = int(qr_ok.sum())
        row_ok = row_ok | qr_ok
    sel_rows, sel_gap = 0, None
    if blk.kind.value == "csa" and not bool((row_ok | tie).all()):
        # rows whose selection moved at the top-k boundary (the projections' last bits differ from the plain ones, e.g.
        # FP8 weights or stacked GEMMs, and the MXFP4 query amplifies them): they match when the plain step attends
        # dsv4's own selection, whose entries the plain scores rank within sel_gap (relative) of the plain k-th score
        sel = _layer_selection(blk, eager._buckets[bsz].handles[0], x)  # noqa: SLF001
        d3 = (plain_decode_step(blk, m, slots, pos, bt, x, w=wp, index_sel=sel).float() - y.float()).abs()
        row_ok3 = (d3.amax(1) <= MATCH_MAX_ABS) & (d3.mean(1) <= MATCH_MEAN_ABS)
        sel_ok = ~row_ok & ~tie & row_ok3
        sel_rows = int(sel_ok.sum())
        if sel_rows:
            sc = aux["scores"]
            kth = torch.topk(sc, sel.shape[1], dim=1).values[:, -1]
            picked = sc.gather(1, sel.long().clamp(min=0)).masked_fill(sel < 0, float("inf")).amin(1)
            gap = ((kth - picked) / kth.abs().clamp_min(1e-30)).clamp_min(0)
            sel_gap = float(gap[sel_ok].max())
        row_ok = row_ok | sel_ok
    match = bool((row_ok | tie).all())
    t_plain = _time(lambda: plain_decode_step(blk, m, slots, pos, bt, x, w=wp), device)
    t_compiled = None
    if s.compile:
        try:
            cplain = torch.compile(plain_decode_step, dynamic=False)
            cplain(blk, m, slots, pos, bt, x, w=wp)
            t_compiled = _time(lambda: cplain(blk, m, slots, pos, bt, x, w=wp), device)
        except Exception as e:  # noqa: BLE001 - an optional baseline; report and go on
            t_compiled = f"failed: {type(e).__name__}"
    # parts
    handle = eager._buckets[bsz].handles[0]  # noqa: SLF001
    part_rows = []
    for name, fn in _parts(blk, handle, eager.static_input(bsz)).items():
        nb, fl = _part_cost(name, blk, m, bsz, context)
        te = _time(fn, device)
        tg = _graph_time(fn, device) if graph else None
        part_rows.append(_row(f"decode/{kind}/{name}", bsz, tg if tg is not None else te, te, tg, nb, fl))
    cache = [r for r in part_rows if r["name"].rsplit("/", 1)[1] in CACHE_PARTS]
    t_cache = sum(r["time_s"] for r in cache)
    roof_cache = sum(r["roofline_s"] for r in cache)
    rows_cache = _row(f"decode/{kind}/cache_path", bsz, t_cache, sum(r["eager_time_s"] for r in cache), None,
                      sum(r["bytes"] for r in cache), sum(r["flops"] for r in cache))  # fmt: skip
    rows_cache["roofline_s"] = roof_cache
    rows_cache["pct_of_roofline"] = roof_cache / t_cache if t_cache else None
    nb = sum(r["bytes"] for r in part_rows)
    fl = sum(r["flops"] for r in part_rows)
    t_step = t_graph if t_graph is not None else t_eager
    step = _row(f"decode/{kind}/step", bsz, t_step, t_eager, t_graph, nb, fl)
    step["roofline_s"] = sum(r["roofline_s"] for r in part_rows)
    step["pct_of_roofline"] = step["roofline_s"] / t_step
    step.update(
        baseline="plain PyTorch (vectorised gather + dequantise + einsum + softmax with sink + torch.topk), eager",
        baseline_time_s=t_plain,
        baseline_compiled_time_s=t_compiled,
        speedup=t_plain / t_step,
        graph_equal=graph_equal,
        max_abs_diff=max_abs,
        mean_abs_diff=mean_abs,
        match=match,
        tie_rows=tie_rows,
        qr_rows=qr_rows,
        selection_rows=sel_rows,
        selection_max_rel_gap=sel_gap,
        tolerance={"max_abs": MATCH_MAX_ABS, "mean_abs": MATCH_MEAN_ABS, "per": "row", "ties": "excused"},
    )
    return [step, *part_rows, rows_cache]


def _layer_selection(blk: AttentionSubBlock, handle, x: torch.Tensor) -> torch.Tensor:
    """The logical top-k [B, k] int (-1: none) that ``blk``'s step selected for x over ``handle``'s cache (after the
    step: the indexer reads what the step wrote, as the step did)."""
    ip = blk.input_projections(x, handle.plan.positions)
    return blk._indexer_topk(x, ip.qr, handle, ip)  # noqa: SLF001 - the layer's own selection, for the check


def _single_layer(layers, handles, x):
    return layers[0](x, handles[0])


def _row(name: str, bsz: int, t: float, te: float, tg: float | None, nb: float, fl: float) -> dict:
    roof = _roofline(nb, fl)
    return dict(
        name=name,
        _batch=bsz,
        time_s=t,
        eager_time_s=te,
        graph_time_s=tg,
        bytes=int(nb),
        flops=int(fl),
        roofline_s=roof,
        pct_of_roofline=roof / t if t else None,
        baseline=None,
        baseline_time_s=None,
    )


# ---------------------------------------------------------------------------------------------- output
def _us(t) -> str:
    return f"{t * 1e6:9.1f}" if isinstance(t, (int, float)) else f"{'-':>9s}"


def format_table(rows: Sequence[dict]) -> str:
    """One line per (model, kind, context, batch): the step's times, speed-up, rooflines and check."""
    head = (
        f"{'model':9s} {'kind':4s} {'context':>8s} {'B':>3s} | {'eager us':>9s} {'graph us':>9s} {'plain us':>9s} "
        f"{'x plain':>7s} {'roof us':>9s} | {'cache us':>9s} {'c.roof us':>9s} {'c/roof':>6s} | "
        + " ".join(f"{p[:8]:>9s}" for p in PARTS)
        + " | check"
    )
    lines = [head, "-" * len(head)]
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        sh = r["shape"]
        key = (sh["model"], sh["kind"], sh["context"], sh["batch"])
        by_key.setdefault(key, {})[r["name"].rsplit("/", 1)[1]] = r
    for (model, kind, ctx, bsz), g in by_key.items():
        st, cp = g["step"], g["cache_path"]
        ratio = cp["time_s"] / cp["roofline_s"] if cp["roofline_s"] else math.nan
        check = (
            (
                "ok"
                + (f" ({st['tie_rows']} tie rows)" if st.get("tie_rows") else "")
                + (f" ({st['qr_rows']} q_norm-ulp rows)" if st.get("qr_rows") else "")
                + (
                    f" ({st['selection_rows']} boundary-selection rows, gap {st['selection_max_rel_gap']:.2g})"
                    if st.get("selection_rows")
                    else ""
                )
            )
            if st["match"]
            else f"DIFF max {st['max_abs_diff']:.3g} mean {st['mean_abs_diff']:.2g}"
        )
        if st.get("graph_equal") is False:
            check += " graph!=eager"
        lines.append(
            f"{model:9s} {kind:4s} {ctx:8d} {bsz:3d} | {_us(st['eager_time_s'])} {_us(st['graph_time_s'])} "
            f"{_us(st['baseline_time_s'])} {st['speedup']:7.1f} {_us(st['roofline_s'])} | {_us(cp['time_s'])} "
            f"{_us(cp['roofline_s'])} {ratio:6.1f} | "
            + " ".join(_us(g[p]["time_s"]) if p in g else f"{'-':>9s}" for p in PARTS)
            + f" | {check}"
        )
    return "\n".join(lines)


def write_jsonl(rows: Sequence[dict], path: str, append: bool = False) -> None:
    """One JSON object a line at ``path`` (its folder made if missing); ``append``: after what the file holds (the
    benchmark scripts' ``--out``, which several runs add to)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
