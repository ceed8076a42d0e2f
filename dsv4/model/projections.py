"""The cache-independent parts of the attention layer, shared by the cached sub-block and the dense
reference so that both round identically (spec §12: one ulp in the query norm moves outputs ~0.005).

Shapes use ``...`` for leading token dims ([T] in the cached layer, [B, T] in the dense reference);
``head_positions`` are absolute positions broadcastable to ``[..., heads]`` (e.g. ``positions[:, None]``).
"""

from __future__ import annotations

import torch

from dsv4.config import ModelConfig
from dsv4.formats.fp8_weight import FP8Weight
from dsv4.kernels.dispatch import use_triton
from dsv4.kernels.fp8_linear import DECODE_MAX_M, fp8_linear, grouped_linear
from dsv4.kernels.indexer.query import indexer_query_tail
from dsv4.kernels.norm import rms_norm
from dsv4.kernels.rope import q_norm_rope, rope_inverse
from dsv4.model import functional as F
from dsv4.model.weights import AttentionWeights

# FP8 ``wo_a`` on the kernel path (up to DECODE_MAX_M tokens): the inverse RoPE inside ``fp8_linear``'s load of o
# (``derotate``, at the (cos, sin) the query's RoPE launch wrote: ``q_norm_rope(cos_sin_out=)``) instead of
# ``rope_inverse``'s launch before it; the same bf16 values.  Off: it loses.  H100, 2026-12-05
# (``benchmarks/profile_projections.py``, V4-Flash, FP8 stacked): wo_a with the rotation in its load 26.6 µs at 1 token
# and 120.4 µs at 64, against 16.6 + 1.5 (the rope launch) and 23.3 + 2.5 without; the decode step (CSA, 128K)
# 164.9 -> 163.6 µs at B = 1 and 375.7 -> 277.9 µs at B = 64.
FUSE_DEROTATE = False


def fuse_derotate(w: AttentionWeights, o_rows: int, backend: str, *tensors: torch.Tensor) -> bool:
    """Whether ``output_projection`` of ``o_rows`` tokens de-rotates inside ``wo_a``'s launch (``FUSE_DEROTATE``, an
    FP8 ``wo_a``, the kernel path of ``fp8_linear``): the layer then asks the query's RoPE for its (cos, sin)."""
    return (
        FUSE_DEROTATE and isinstance(w.wo_a, FP8Weight) and 0 < o_rows <= DECODE_MAX_M
        and use_triton(backend, w.wo_a.data, *tensors)
    )  # fmt: skip


def dense(
    x: torch.Tensor,
    w: torch.Tensor | FP8Weight,
    backend: str = "torch",
    *,
    groups: int = 1,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """One of the layer's dense projections: x [..., G·in] bf16 -> [..., G·out] (``groups`` G: the weight's rows and
    x's columns in G blocks, block g times block g).  An ``FP8Weight`` with a 2-D x goes to ``kernels.fp8_linear``
    (``backend``; its torch path is the bf16 computation below); otherwise ``grouped_linear`` on the weight in x's
    dtype (an FP8 one dequantised).  ``counters``: ``fp8_linear``'s."""
    if isinstance(w, FP8Weight) and x.dim() == 2:
        return fp8_linear(x, w, backend, groups=groups, counters=counters)
    return grouped_linear(x, F.weight_as(w, x.dtype), groups)


def query(
    cfg: ModelConfig,
    w: AttentionWeights,
    x: torch.Tensor,
    head_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    backend: str = "torch",
    *,
    counters: torch.Tensor | None = None,
    cos_sin_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec §2 step 1.  x [..., dim] bf16 -> (q [..., H, D] bf16 after per-head norm and RoPE(t),
    qr [..., q_lora_rank] bf16: the normed latent the indexer's query also reads).

    ``backend`` "torch" (default; the dense reference) composes the model's functions; "auto" / "triton"
    runs the latent's RMSNorm as one launch (``kernels.norm.rms_norm``) and the per-head norm and RoPE as
    another (``kernels.rope.q_norm_rope``; x [T, dim] and ``head_positions`` [T, 1] there).  FP8 weights: ``dense``
    (``counters`` its).  ``cos_sin_out``: as ``query_heads``."""
    latent = dense(x, w.wq_a, backend, counters=counters)
    qr = query_latent(cfg, w, latent, head_positions, backend)
    q_lin = dense(qr, w.wq_b, backend, counters=counters)
    return query_heads(cfg, q_lin, head_positions, inv_freq, backend, cos_sin_out=cos_sin_out), qr


def query_latent(
    cfg: ModelConfig, w: AttentionWeights, latent: torch.Tensor, head_positions: torch.Tensor, backend: str = "torch"
) -> torch.Tensor:
    """``query``'s latent norm: latent [..., q_lora_rank] bf16 (``wq_a``'s output; any row stride on the one-launch
    path) -> qr, RMSNorm with ``q_norm`` ([..., q_lora_rank] bf16, new)."""
    if _token_positions(latent.shape[:-1], head_positions, backend) is None:
        return F.rms_norm(latent, w.q_norm, cfg.norm_eps)
    return rms_norm(latent, w.q_norm, cfg.norm_eps, backend=backend)


def query_heads(
    cfg: ModelConfig,
    q_lin: torch.Tensor,
    head_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    backend: str = "torch",
    *,
    cos_sin_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``query``'s heads: q_lin [..., H·D] bf16 (``wq_b``'s output; any row stride on the one-launch path) -> q
    [..., H, D] bf16, per-head RMSNorm then RoPE(t) on the rope dims (one launch: ``kernels.rope.q_norm_rope``).
    ``cos_sin_out`` (the one-launch path, fp32 [T, rd/2, 2]): each token's (cos, sin), written by the same launch
    (``q_norm_rope(cos_sin_out=)``; for ``output_projection(cos_sin=)``)."""
    q = q_lin.unflatten(-1, (cfg.n_heads, cfg.head_dim))
    pos = _token_positions(q_lin.shape[:-1], head_positions, backend)
    if pos is not None:
        return q_norm_rope(q, pos, inv_freq, cfg.norm_eps, backend=backend, cos_sin_out=cos_sin_out)
    if cos_sin_out is not None:
        raise ValueError("cos_sin_out: expected the one-launch path ([T] tokens, backend 'auto' or 'triton')")
    return F.apply_rope(F.head_rms_norm(q, cfg.norm_eps), head_positions, inv_freq)


def _token_positions(tokens: torch.Size, head_positions: torch.Tensor, backend: str) -> torch.Tensor | None:
    """[T] positions for the fused kernels (token dims ``tokens`` = [T], head_positions [T, 1]), or None for
    the composed PyTorch path (backend "torch", or batched [B, T] token dims)."""
    if backend == "torch" or len(tokens) != 1 or head_positions.numel() != tokens[0]:
        return None
    return head_positions.reshape(tokens[0])


def indexer_query(
    cfg: ModelConfig,
    w: AttentionWeights,
    x: torch.Tensor,
    qr: torch.Tensor,
    head_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    backend: str = "torch",
    *,
    counters: torch.Tensor | None = None,
    q_lin: torch.Tensor | None = None,
    w_lin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec §4 query side.  Returns (q_idx [..., Hi, Di] bf16 after RoPE, Hadamard and MXFP4 — exact
    e2m1 x 2^k values; w [..., Hi] head weights already scaled by Di^-1/2 * Hi^-1/2: bf16 values).

    ``backend`` "torch" (default; the dense reference) composes the model's functions; "auto" / "triton"
    runs the two GEMMs and then ``kernels.indexer.indexer_query_tail`` (one launch; x, qr [T, ...] and
    ``head_positions`` [T, 1] there), whose head weights come back as fp32 holding the same bf16 values.
    ``q_lin``: ``indexer.wq_b``'s output [..., Hi·Di] if already computed (else projected here from qr); ``w_lin``:
    likewise ``weights_proj``'s [T, Hi] (the one-launch path only; the composition projects x itself)."""
    iw = w.indexer
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    if q_lin is None:
        q_lin = dense(qr, iw.wq_b, backend, counters=counters)
    pos = _token_positions(x.shape[:-1], head_positions, backend)
    if pos is not None:
        if w_lin is None:
            w_lin = dense(x, iw.weights_proj, backend, counters=counters)
        return indexer_query_tail(q_lin, w_lin, pos, inv_freq, F.key_format(cfg), backend=backend)
    q_idx = q_lin.unflatten(-1, (hi, di))
    q_idx = F.mxfp4_simulate(F.hadamard(F.apply_rope(q_idx, head_positions, inv_freq)), F.key_format(cfg))
    return q_idx, F.indexer_head_weights(x, iw.weights_proj, hi, di)


def output_projection(
    cfg: ModelConfig,
    w: AttentionWeights,
    o: torch.Tensor,
    head_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    backend: str = "torch",
    *,
    consume_o: bool = False,
    counters: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Spec §2 steps 5–6.  o [..., H, D] bf16 attention output -> inverse RoPE(t) on the rope dims ->
    grouped ``wo_a`` (o_groups blocks of H/o_groups heads) -> ``wo_b`` -> y [..., dim] bf16.
    ``backend``: as ``query`` (the inverse RoPE in one launch, ``kernels.rope.rope_inverse``).  ``consume_o``: the
    caller has no further use for o, so the kernel may rotate its rope channels in place (``derotate``).  FP8
    weights: ``dense`` (``counters`` its).  ``cos_sin`` (fp32 [T, rd/2, 2], the (cos, sin) of each token's query
    rotation: ``query_heads(cos_sin_out=)``) where ``fuse_derotate`` holds: an FP8 ``wo_a`` de-rotates o as it loads
    it (``fp8_linear(derotate=)``, no launch of its own; the same values)."""
    if cos_sin is not None and o.dim() == 3 and fuse_derotate(w, o.shape[0], backend, o):
        og = fp8_linear(
            o.flatten(-2), w.wo_a, backend, groups=cfg.o_groups, counters=counters, derotate=(cos_sin, o.shape[-1])
        )
        return dense(og, w.wo_b, backend, counters=counters)
    o = derotate(o, head_positions, inv_freq, backend, in_place=consume_o)
    return project_groups(cfg, w, o, backend, counters=counters)


def derotate(
    o: torch.Tensor,
    head_positions: torch.Tensor,
    inv_freq: torch.Tensor,
    backend: str = "torch",
    *,
    in_place: bool = False,
) -> torch.Tensor:
    """Inverse RoPE at the query position on the rope dims of o [..., H, D] (values carry RoPE, spec §2).
    ``in_place`` (the one-launch path only; the torch composition always returns a new tensor): o's rope channels
    are rotated where they are and o is returned (``rope_inverse(in_place=True)``: 1/8 of the bytes at V4 widths)."""
    pos = _token_positions(o.shape[:-2], head_positions, backend)
    if pos is not None:
        return rope_inverse(o, pos, inv_freq, backend=backend, in_place=in_place)
    return F.apply_rope(o, head_positions, inv_freq, inverse=True)


def project_groups(
    cfg: ModelConfig,
    w: AttentionWeights,
    o: torch.Tensor,
    backend: str = "torch",
    *,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped output projection of de-rotated o [..., H, D] -> [..., dim] (``dense`` twice: ``wo_a`` in o_groups
    groups of H/o_groups heads, then ``wo_b``)."""
    og = dense(o.flatten(-2), w.wo_a, backend, groups=cfg.o_groups, counters=counters)
    return dense(og, w.wo_b, backend, counters=counters)
