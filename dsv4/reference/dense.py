"""The dense, cache-free reference of one DeepSeek-V4 attention layer: the oracle for the cached path.

``dense_attention`` recomputes the whole layer (spec §2–4) for a full sequence starting at position 0,
from nothing but the layer input and the weights: no ring, no pages, no compressor state.  Every
quantity a cache would hold (FP8 window KV, compressed entries, MXFP4 indexer keys, compressor
projections) is computed for every position, and the key set of each query is built directly from the
visibility rules of spec §2.1:

    query t sees   window:      raw tokens max(0, t-window+1) .. t              (after FP8 simulation)
                   compressed:  entries i < ⌊(t+1)/m⌋                           (entry i covers i·m .. i·m+m-1)
                                 HCA: all of them; CSA: the indexer's top-min(k, ⌊(t+1)/4⌋)
                   + the per-head sink (denominator only)

Window and compressed keys are not de-duplicated.  The cached path must reproduce ``y`` to bf16-level
tolerance (spec §12) and the aux tensors (``return_aux=True``) exactly where they are
cache-independent (window KV, entries, indexer keys; top-k up to near-ties).

Numerics: every building block is a function of ``dsv4.model.functional`` (see its module docstring
for the softmax variant and the indexer score precision), so the cached layer can share them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.config import LayerKind, ModelConfig
from dsv4.errors import check_tensor
from dsv4.model import functional as F
from dsv4.model import projections as P
from dsv4.model.weights import AttentionWeights

__all__ = ["DenseAux", "dense_attention"]


@dataclass(frozen=True)
class DenseAux:
    """Per-position intermediates of ``dense_attention`` (B batch rows, T tokens, E = ⌊T/m⌋ entries).

    Always present:
      q            [B, T, H, D] bf16  query after per-head norm and RoPE(t)
      window_kv    [B, T, D]    bf16  window KV of each token after RoPE(t) and FP8 simulation (= ring content)
      key_index    [B, T, N]    int64 per query, its key slots into ``cat(window_kv, entries)`` along dim 1
                                      (window first: the raw token t' is slot t'; entry i is slot T + i); -1 = none
      attn_out     [B, T, H, D] bf16  attention output after inverse RoPE(t), before the o-projection
    CSA / HCA layers (None for SWA):
      compressor_kv, compressor_score  [B, T, c·D] fp32  per-token compressor projections (score incl. ape)
      entries      [B, E, D]    bf16  compressed entries (pooled → RMSNorm → RoPE(i·m) → FP8 simulation)
    CSA layers only (None otherwise):
      indexer_q       [B, T, Hi, Di] bf16  indexer query after RoPE, Hadamard, MXFP4
      indexer_weights [B, T, Hi]     bf16  head weights w
      indexer_kv, indexer_score [B, T, 2·Di] fp32  indexer-compressor projections
      indexer_keys    [B, E, Di]     bf16  indexer keys (RMSNorm → RoPE(4i) → Hadamard → MXFP4)
      index_scores    [B, T, E]      fp32  I(t, i) for every entry (invisible ones included, unmasked)
      topk            [B, T, index_topk] int32  selected entry ids, descending score, -1 padded
    """

    q: torch.Tensor
    window_kv: torch.Tensor
    key_index: torch.Tensor
    attn_out: torch.Tensor
    compressor_kv: torch.Tensor | None = None
    compressor_score: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    indexer_q: torch.Tensor | None = None
    indexer_weights: torch.Tensor | None = None
    indexer_kv: torch.Tensor | None = None
    indexer_score: torch.Tensor | None = None
    indexer_keys: torch.Tensor | None = None
    index_scores: torch.Tensor | None = None
    topk: torch.Tensor | None = None


def dense_attention(
    cfg: ModelConfig,
    layer_id: int,
    w: AttentionWeights,
    x: torch.Tensor,
    *,
    return_aux: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, DenseAux]:
    """One attention layer over positions 0..T-1 of each batch row, recomputed densely (spec §2).

    x [B, T, dim] bf16: the layer input (after ``attn_norm``).  Returns y [B, T, dim] bf16, or
    ``(y, DenseAux)`` with ``return_aux=True``.  Batch rows are independent sequences that all start at
    position 0.  Works for every layer kind (SWA, CSA, HCA) of ``cfg``; weights must match
    ``w.check(cfg, layer_id)``.
    """
    check_tensor("x", x, dtype=torch.bfloat16, ndim=3)
    if x.shape[-1] != cfg.dim:
        raise ValueError(f"x: expected shape [B, T, {cfg.dim}], got {list(x.shape)}")
    w.check(cfg, layer_id)
    bsz, t_len, _ = x.shape
    dev = x.device
    kind, m = cfg.layer_kind(layer_id), cfg.ratio(layer_id)
    d, eps = cfg.head_dim, cfg.norm_eps
    inv_freq = F.rope_inv_freq(cfg, layer_id, dev)
    pos = torch.arange(t_len, device=dev)

    # 1. query: wq_a -> q_norm -> wq_b -> per-head norm (bf16) -> RoPE(t)
    q, qr = P.query(cfg, w, x, pos[:, None], inv_freq)  # qr [B, T, q_lora_rank]: the indexer's latent too

    # 2. window KV: wkv -> kv_norm -> RoPE(t) -> FP8 simulation of the nope dims
    kv = F.apply_rope(F.rms_norm(F.linear(x, w.wkv), w.kv_norm, eps), pos, inv_freq)
    window_kv = F.fp8_simulate(kv, F.entry_format(cfg))

    win_pos, win_valid = F.window_key_positions(pos, cfg.window_size)  # [T, W]
    key_index = torch.where(win_valid, win_pos, -1).expand(bsz, -1, -1)
    keys = window_kv
    aux: dict[str, torch.Tensor | None] = {}

    # 3. compressed branch
    if m:
        n_entries = t_len // m
        n_visible = torch.div(pos + 1, m, rounding_mode="floor")  # [T]
        cw = w.compressor
        ckv, csc = F.compressor_project(x, cw.wkv, cw.wgate, cw.ape, pos, m)
        pooled = F.compress_history(ckv, csc, m, cfg.overlap(m))  # [B, E, D] fp32
        entry_pos = torch.arange(n_entries, device=dev) * m
        entries = F.finalize_entries(pooled, cw.norm, entry_pos, inv_freq, eps, indexer=False)
        aux.update(compressor_kv=ckv, compressor_score=csc, entries=entries)

        if kind is LayerKind.CSA:
            comp_ids = _indexer_topk(cfg, m, w, x, qr, pos, n_visible, inv_freq, entry_pos, aux)  # [B, T, k]
        else:  # HCA: every visible entry
            ids = torch.arange(n_entries, device=dev)
            comp_ids = torch.where(ids < n_visible[:, None], ids, -1).expand(bsz, -1, -1)
        comp_ids = comp_ids.long()
        key_index = torch.cat([key_index, torch.where(comp_ids >= 0, comp_ids + t_len, -1)], dim=-1)
        keys = torch.cat([window_kv, entries], dim=1)  # [B, T + E, D]

    # 4. sparse attention over the key slots + sink.  Every query's slots index one shared pool
    #    (``keys``), so attend densely with a per-query mask: same maths as gathering the slots.
    n_pool = keys.shape[1]
    slot = torch.where(key_index >= 0, key_index, n_pool)
    mask = torch.zeros(bsz, t_len, n_pool + 1, dtype=torch.bool, device=dev)
    mask.scatter_(-1, slot, True)
    o = F.sparse_attention_reference(q, keys, mask[..., :n_pool], w.attn_sink, d**-0.5)

    # 5. inverse RoPE at the query position; 6. grouped output projection
    o = P.derotate(o, pos[:, None], inv_freq)
    y = P.project_groups(cfg, w, o)
    if not return_aux:
        return y
    return y, DenseAux(q=q, window_kv=window_kv, key_index=key_index, attn_out=o, **aux)


def _indexer_topk(
    cfg: ModelConfig,
    m: int,
    w: AttentionWeights,
    x: torch.Tensor,
    qr: torch.Tensor,
    pos: torch.Tensor,
    n_visible: torch.Tensor,
    inv_freq: torch.Tensor,
    entry_pos: torch.Tensor,
    aux: dict,
) -> torch.Tensor:
    """CSA lightning indexer (spec §4): top-min(k, ⌊(t+1)/4⌋) visible entries per query, int32 [B, T, k]."""
    # query: wq_b(latent) -> RoPE(t) on the last rope dims of each head -> Hadamard -> MXFP4
    q_idx, wts = P.indexer_query(cfg, w, x, qr, pos[:, None], inv_freq)
    # keys: the indexer's own d = Di overlapping compressor
    ic = w.indexer.compressor
    ikv, isc = F.compressor_project(x, ic.wkv, ic.wgate, ic.ape, pos, m)
    pooled = F.compress_history(ikv, isc, m, overlap=True)
    idx_keys = F.finalize_entries(pooled, ic.norm, entry_pos, inv_freq, cfg.norm_eps, indexer=True)
    scores = F.indexer_scores_reference(q_idx, wts, idx_keys)  # [B, T, E]
    topk = F.topk_visible(scores, n_visible.expand(scores.shape[:-1]), cfg.index_topk)
    aux.update(
        indexer_q=q_idx,
        indexer_weights=wts,
        indexer_kv=ikv,
        indexer_score=isc,
        indexer_keys=idx_keys,
        index_scores=scores,
        topk=topk,
    )
    return topk
