"""Pure functions for the maths of one DeepSeek-V4 attention layer (spec §1.2, §2–4, §12, §13).

Every function here is stateless, works on any device, and states its shapes and dtypes.  They are
the building blocks of the dense reference layer (``dsv4.reference.dense``) and of the cached layer:
both must call the *same* functions for the parts that do not depend on the cache (projections,
norms, RoPE, quantisation simulation, pooling), so that the two paths can only differ where the cache
is involved.

Numerics follow spec §13 (the official reference's rules) unless a docstring says otherwise:

- RMSNorm in fp32, result in the input dtype; the per-head q norm in bf16 (``head_rms_norm``).
- RoPE: interleaved pairs (2k, 2k+1) on the *last* ``rope_dim`` channels, angles ``pos * inv_freq``
  in fp32, rotation in fp32, result in the input dtype.
- Compressor in fp32; pooled entries go through bf16 before their RMSNorm.
- FP8 / MXFP4 "simulation" = the cache format's own quantise→dequantise (``dsv4.formats``), so the
  values the dense reference uses are exactly the values a real FP8 / MXFP4 cache gives back.
- Attention: plain fp32 softmax (not the reference kernel's blocked running softmax with bf16
  probabilities; spec §12 allows either, they differ by ≲0.03 absolute on O(1) outputs).
- Indexer scores in fp32 (the official reference rounds them to bf16, which produces exact ties;
  see ``indexer_scores_reference``).

Unit conventions: ``T`` query tokens, ``N`` key slots per query, ``E`` compressed entries, ``H`` query
heads, ``Hi`` indexer heads, ``D`` = head_dim (512), ``Di`` = index_head_dim (128), ``d`` = the width of
one compressor output (D for the main compressor, Di for the indexer's), ``c`` = 2 for the overlapping
CSA compressor else 1, ``m`` = compression ratio (tokens per entry).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from dsv4.config import ModelConfig
from dsv4.errors import check_tensor
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat, entry_format, key_format  # noqa: F401 (re-exported)
from dsv4.formats.fp8_weight import FP8Weight

__all__ = [
    "entry_format",
    "key_format",
    "linear",
    "rms_norm",
    "head_rms_norm",
    "rope_inv_freq",
    "apply_rope",
    "hadamard",
    "fp8_simulate",
    "mxfp4_simulate",
    "ape_rows",
    "compressor_project",
    "pool_entry",
    "compress_history",
    "finalize_entries",
    "indexer_head_weights",
    "indexer_weight_scale",
    "sparse_attention_reference",
    "indexer_scores_reference",
    "topk_visible",
    "window_key_positions",
]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INTS = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------- basics
def linear(x: torch.Tensor, weight: torch.Tensor | FP8Weight) -> torch.Tensor:
    """``y = x @ weight.T`` in ``x``'s dtype (weight cast to it): x [..., in], weight [out, in] -> [..., out].

    The dense bf16 layers of the reference are plain ``F.linear`` on bf16 (weights dequantised once at
    load time); the compressor passes fp32 ``x`` and fp32 weights.  An ``FP8Weight`` is dequantised to x's dtype
    first (exact in bf16: the same values a checkpoint loaded without ``keep_fp8`` holds).
    """
    return torch.nn.functional.linear(x, weight_as(weight, x.dtype))


def weight_as(weight: torch.Tensor | FP8Weight, dtype: torch.dtype) -> torch.Tensor:
    """A linear weight as a ``dtype`` tensor (an ``FP8Weight`` dequantised)."""
    if isinstance(weight, FP8Weight):
        return weight.dequantize(dtype)
    return weight.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x²) + eps) * weight``, fp32 math, result in x's dtype.

    x [..., n] (any float dtype); weight [n] (any float dtype, applied in fp32) or None (no weight).
    """
    check_tensor("x", x, dtype=_FLOATS)
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        check_tensor("weight", weight, shape=(x.shape[-1],))
        y = weight.float() * y
    return y.to(x.dtype)


def head_rms_norm(q: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMS normalisation of the query without a weight, done in q's own dtype (bf16).

    q [..., H, D] -> same shape/dtype: ``q * rsqrt(mean(q²) + eps)`` over the last dim, with every
    intermediate (square, mean, rsqrt, product) rounded to q's dtype as the reference does (spec §13).
    One ulp of difference here moves outputs by ~0.005 (spec §12): both paths must call this.
    """
    check_tensor("q", q, dtype=_FLOATS)
    return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig, layer_id: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-layer RoPE inverse frequencies, fp32 [rope_head_dim / 2] (spec §1.2, §13).

    CSA/HCA layers: θ = ``compress_rope_theta`` with YaRN (when ``original_seq_len > 0``); SWA-only
    layers (ratio 0, incl. MTP): θ = ``rope_theta`` plain.  Base frequencies ``θ^(-2k/rd)``; YaRN blends
    ``f_k·(1-r_k) + f_k/factor·r_k`` with the linear ramp ``r_k = clamp((k-low)/(high-low), 0, 1)``,
    ``low = floor(rd·ln(L/(β_fast·2π)) / (2 ln θ))`` and ``high = ceil(rd·ln(L/(β_slow·2π)) / (2 ln θ))``,
    both clamped to [0, rd-1], L = ``original_seq_len``.  No attention-temperature factor.
    Every fp32 operation is done in the reference's order, so the table is bit-identical to it.
    """
    theta, use_yarn = cfg.rope_params(layer_id)
    rd = cfg.rope_head_dim
    freqs = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    if use_yarn and cfg.original_seq_len > 0:

        def corr_dim(n_rot: float) -> float:
            return rd * math.log(cfg.original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(corr_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(corr_dim(cfg.beta_slow)), rd - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(rd // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs if device is None else freqs.to(device)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``rd = 2·len(inv_freq)`` channels of ``x`` by interleaved-pair RoPE (out of place).

    x [..., C] (any float dtype, C >= rd); channels ``[C-rd, C)`` are viewed as rd/2 pairs (2k, 2k+1) =
    complex numbers and multiplied by ``exp(±i·pos·inv_freq[k])``; channels ``[0, C-rd)`` are unchanged.

    **Position broadcasting:** ``positions`` (int32/int64, absolute token positions) must broadcast to
    ``x.shape[:-1]`` under the usual right-aligned rules, so every leading index of x gets one position.
    Examples: window KV ``x [T, D]`` → ``positions [T]``; queries ``x [B, T, H, D]`` →
    ``positions [T, 1]`` (same for every batch row and head) or ``[B, T, 1]`` (per-row positions);
    compressed entries ``x [E, D]`` → ``positions = arange(E) * m``.

    Angles are ``fp32(pos) * inv_freq`` in fp32, the rotation is fp32, the result is in x's dtype.
    ``inverse=True`` rotates by the conjugate (undoes a forward rotation up to rounding).
    """
    check_tensor("x", x, dtype=_FLOATS)
    check_tensor("positions", positions, dtype=_INTS)
    check_tensor("inv_freq", inv_freq, dtype=torch.float32, ndim=1)
    rd = 2 * inv_freq.shape[0]
    if x.shape[-1] < rd:
        raise ValueError(f"x: expected last dim >= rope dims {rd}, got {list(x.shape)}")
    lead = tuple(x.shape[:-1])
    try:
        ok = tuple(torch.broadcast_shapes(tuple(positions.shape), lead)) == lead
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"positions: expected a shape broadcastable to x.shape[:-1]={list(lead)}, got {list(positions.shape)}"
        )
    ang = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(x.device)  # [*P, rd/2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    return rotate_pairs(x, cos, -sin if inverse else sin)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope``'s rotation by given angles: x [..., C] with its last rd = 2·cos.shape[-1] channels, as pairs
    (2k, 2k+1), rotated by (cos, sin) fp32 [..., rd/2] (broadcast against x's leading dims): ``a·cos - b·sin``,
    ``a·sin + b·cos`` in fp32 (each product rounded on its own), in x's dtype; channels ``[0, C-rd)`` unchanged.  New
    tensor."""
    rd = 2 * cos.shape[-1]
    pairs = x[..., x.shape[-1] - rd :].float().unflatten(-1, (rd // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., : x.shape[-1] - rd], rot], dim=-1)


# ---------------------------------------------------------------------------------------------- rotation & quantisation
@lru_cache(maxsize=16)
def _sylvester(n: int, device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh–Hadamard rotation over the last dim: ``(x @ H_n) · n^-½`` in fp32, result bf16 (spec §13).

    x [..., n] (any float dtype), n a power of two.  H_n is the Sylvester (natural-order) matrix
    (H_1 = [1], H_2k = [[H, H], [H, -H]]); it is symmetric, and ``H_n·n^-½`` is orthogonal and its own
    inverse, so ``hadamard(hadamard(x)) ≈ x`` and dot products are preserved.
    """
    check_tensor("x", x, dtype=_FLOATS)
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"x: expected a power-of-two last dim, got {list(x.shape)}")
    h = _sylvester(n, x.device)
    return (torch.matmul(x.float(), h) * n**-0.5).to(torch.bfloat16)


def fp8_simulate(x: torch.Tensor, fmt: FP8EntryFormat | None = None) -> torch.Tensor:
    """FP8 QAT simulation of a KV entry: ``fmt.roundtrip(x)`` -> bf16 [..., head_dim] (spec §2, §13).

    The nope dims ``[0, head_dim - rope_dim)`` become e4m3 × power-of-two-per-64 values; the rope dims
    are only rounded to bf16 (unchanged for bf16 input).  Exactly what the FP8 cache gives back.
    ``fmt`` defaults to the released format (512 = 448 + 64, tiles of 64).
    """
    return (fmt or FP8EntryFormat()).roundtrip(x)


def mxfp4_simulate(x: torch.Tensor, fmt: MXFP4KeyFormat | None = None) -> torch.Tensor:
    """MXFP4 QAT simulation of an indexer query head or key: ``fmt.roundtrip(x)`` -> bf16 [..., dim].

    e2m1 values × power-of-two scale per 32 (all dims, spec §4, §13); exact in bf16.
    """
    return (fmt or MXFP4KeyFormat()).roundtrip(x)


# ---------------------------------------------------------------------------------------------- compressor
def compressor_project(
    x: torch.Tensor,
    wkv: torch.Tensor | FP8Weight,
    wgate: torch.Tensor | FP8Weight,
    ape: torch.Tensor | None,
    positions: torch.Tensor,
    ratio: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token compressor projections in fp32 (spec §3): ``kv = x·wkvᵀ``, ``score = x·wgateᵀ + ape[pos mod m]``.

    x [..., dim] (cast to fp32); wkv, wgate [c·d, dim] (cast to fp32; an ``FP8Weight`` dequantised); ape [m, c·d]
    fp32, or None to leave
    it out (``score = x·wgateᵀ``: for a consumer that adds it itself, as ``LayerCacheHandle.compress``);
    positions (int) broadcastable to ``x.shape[:-1]`` (absolute positions).  Returns
    (kv, score), both fp32 [..., c·d].  These are the rows the compressor state keeps (§3.1).
    """
    check_tensor("x", x, dtype=_FLOATS)
    wkv, wgate = weight_as(wkv, torch.float32), weight_as(wgate, torch.float32)
    check_tensor("wkv", wkv, ndim=2)
    check_tensor("wgate", wgate, shape=tuple(wkv.shape))
    if ape is not None:
        check_tensor("ape", ape, shape=(ratio, wkv.shape[0]))
    check_tensor("positions", positions, dtype=_INTS)
    xf = x.float()
    kv = torch.nn.functional.linear(xf, wkv.float())
    score = torch.nn.functional.linear(xf, wgate.float())
    if ape is not None:
        score = score + ape_rows(ape, positions, ratio)
    return kv, score


def ape_rows(ape: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """The compressor's positional bias for each position: ``ape[pos mod m]`` fp32 [..., c·d] (ape [m, c·d])."""
    return ape.float()[torch.remainder(positions, ratio).long()]


def pool_entry(kv_rows: torch.Tensor, score_rows: torch.Tensor) -> torch.Tensor:
    """Gated pooling of one (or many) entries: per-channel softmax over rows (spec §3).

    kv_rows, score_rows fp32 [..., R, C] -> fp32 [..., C] = Σ_r softmax_r(score)[r, ch] · kv[r, ch].
    Rows with score -inf get weight 0 (CSA entry 0's missing previous chunk; kv there should be 0).
    Precondition: every channel has at least one finite score (else NaN).
    """
    check_tensor("kv_rows", kv_rows, dtype=torch.float32)
    check_tensor("score_rows", score_rows, dtype=torch.float32, shape=tuple(kv_rows.shape))
    return (kv_rows * score_rows.softmax(dim=-2)).sum(dim=-2)


def compress_history(kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Pool every *complete* chunk of a full history (positions 0..T-1) into entries, fp32.

    kv, score fp32 [..., T, c·d] from ``compressor_project`` for positions 0..T-1; returns
    fp32 [..., E, d] with E = T // ratio (a trailing partial chunk is ignored).

    - ``overlap=False`` (HCA, c = 1): entry i pools the ``ratio`` rows of chunk i.
    - ``overlap=True`` (CSA, c = 2): entry i pools 2·ratio rows: chunk i-1's rows restricted to the
      A-half channels ``[0, d)``, then chunk i's rows restricted to the B-half ``[d, 2d)``.  Entry 0's
      missing previous chunk is kv 0 / score -inf (zero weight).
    """
    check_tensor("kv", kv, dtype=torch.float32)
    check_tensor("score", score, dtype=torch.float32, shape=tuple(kv.shape))
    c = 2 if overlap else 1
    if kv.shape[-1] % c:
        raise ValueError(f"kv: expected last dim divisible by {c}, got {list(kv.shape)}")
    d = kv.shape[-1] // c
    e = kv.shape[-2] // ratio
    kv_c = kv[..., : e * ratio, :].unflatten(-2, (e, ratio))  # [..., E, m, c·d]
    sc_c = score[..., : e * ratio, :].unflatten(-2, (e, ratio))
    if not overlap:
        return pool_entry(kv_c, sc_c)
    # previous chunk's A-half, shifted by one entry; entry 0 gets (0, -inf)
    prev_kv = torch.zeros_like(kv_c[..., :d])
    prev_sc = torch.full_like(sc_c[..., :d], float("-inf"))
    prev_kv[..., 1:, :, :] = kv_c[..., :-1, :, :d]
    prev_sc[..., 1:, :, :] = sc_c[..., :-1, :, :d]
    rows_kv = torch.cat([prev_kv, kv_c[..., d:]], dim=-2)  # [..., E, 2m, d]
    rows_sc = torch.cat([prev_sc, sc_c[..., d:]], dim=-2)
    return pool_entry(rows_kv, rows_sc)


def finalize_entries(
    pooled: torch.Tensor,
    norm_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    *,
    indexer: bool,
) -> torch.Tensor:
    """Turn pooled compressor outputs into the stored (dequantised) entry values, bf16 [..., d].

    pooled fp32 [..., d] → bf16 → RMSNorm(``norm_weight``) → RoPE at ``positions`` (the first token of
    the entry's own chunk, ``i·m``; broadcastable to ``pooled.shape[:-1]``) on the last rope dims →
    - main compressor (``indexer=False``, d = head_dim): FP8 simulation of the nope dims;
    - indexer compressor (``indexer=True``, d = index_head_dim): Hadamard over all d dims, then MXFP4.
    """
    check_tensor("pooled", pooled, dtype=torch.float32)
    d = pooled.shape[-1]
    y = rms_norm(pooled.to(torch.bfloat16), norm_weight, eps)
    y = apply_rope(y, positions, inv_freq)
    if indexer:
        return mxfp4_simulate(hadamard(y), MXFP4KeyFormat(dim=d))
    return fp8_simulate(y, FP8EntryFormat(head_dim=d, rope_dim=2 * inv_freq.shape[0]))


def indexer_head_weights(
    x: torch.Tensor, weights_proj: torch.Tensor, index_n_heads: int, index_head_dim: int
) -> torch.Tensor:
    """Indexer head weights ``w = weights_proj(x) · (Di^-½ · Hi^-½)`` in x's dtype (bf16), [..., Hi] (spec §4)."""
    return linear(x, weights_proj) * indexer_weight_scale(index_n_heads, index_head_dim)


def indexer_weight_scale(index_n_heads: int, index_head_dim: int) -> float:
    """The constant of the indexer head weights, ``Di^-1/2 · Hi^-1/2`` (spec §4)."""
    return index_head_dim**-0.5 * index_n_heads**-0.5


# ---------------------------------------------------------------------------------------------- attention & indexer
def sparse_attention_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    valid: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sparse MQA with an attention sink: one softmax per (token, head) (spec §2 step 4).

    q [..., T, H, D] bf16; sink [H] fp32; valid [..., T, N] bool; kv (K = V, already dequantised) in
    one of two forms:

    - **gathered**, [..., T, N, D] (``kv.dim() == q.dim()``): the N key slots of each query.  Slots with
      ``valid`` False (index -1) are ignored entirely: their contents may be garbage (even NaN).
    - **shared**, [..., N, D] (``kv.dim() == q.dim() - 1``): one key pool for all T queries, ``valid``
      says which keys each query sees (a dense masked layout; cheaper when many queries share keys).
      Every key must be finite.

    Returns o [..., T, H, D] bf16:

        o_h = Σ_j exp(s_hj − M)·v_j / (Σ_j exp(s_hj − M) + exp(sink_h − M)),  s_hj = (q_h·k_j)·scale

    **Softmax variant:** plain fp32 (logits, max, exponentials, sums and P·V all fp32, one rounding to
    bf16 at the end), with M = max(max_j s_hj, sink_h).  The official kernel instead keeps a blocked
    running max/sum and rounds probabilities to bf16 before P·V; the two differ by ≲0.03 absolute on
    O(1) outputs (spec §12).  A query with no valid key returns 0 (the sink absorbs all mass).
    """
    check_tensor("q", q, dtype=_FLOATS)
    check_tensor("kv", kv, dtype=_FLOATS)
    check_tensor("sink", sink, shape=(q.shape[-2],))
    gathered = kv.dim() == q.dim()
    lead = tuple(q.shape[:-2]) if gathered else tuple(q.shape[:-3])
    if kv.dim() not in (q.dim(), q.dim() - 1) or tuple(kv.shape[:-2]) != lead or kv.shape[-1] != q.shape[-1]:
        want = ", ".join(map(str, lead))
        raise ValueError(f"kv: expected shape [{want}, N, {q.shape[-1]}], got {list(kv.shape)}")
    check_tensor("valid", valid, dtype=torch.bool, shape=(*q.shape[:-2], kv.shape[-2]))
    if kv.shape[-2] == 0:
        return torch.zeros_like(q, dtype=torch.bfloat16)
    if gathered:
        kvf = torch.where(valid.unsqueeze(-1), kv, 0).float()
        logits = torch.einsum("...thd,...tnd->...thn", q.float(), kvf)
    else:
        kvf = kv.float()
        logits = torch.einsum("...thd,...nd->...thn", q.float(), kvf)
    logits = (logits * scale).masked_fill(~valid.unsqueeze(-2), float("-inf"))
    sinkf = sink.float().to(q.device)
    m = torch.maximum(logits.amax(-1), sinkf)  # [..., T, H], finite
    p = torch.exp(logits - m.unsqueeze(-1))
    denom = p.sum(-1) + torch.exp(sinkf - m)
    if gathered:
        o = torch.einsum("...thn,...tnd->...thd", p, kvf)
    else:
        o = torch.einsum("...thn,...nd->...thd", p, kvf)
    return (o / denom.unsqueeze(-1)).to(torch.bfloat16)


def indexer_scores_reference(q_idx: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores ``I[t, j] = Σ_h w[t, h] · ReLU(q_idx[t, h] · k_j)`` in fp32 (spec §4).

    q_idx [..., T, Hi, Di] (after RoPE, Hadamard, MXFP4); w [..., T, Hi]; keys either shared by all
    queries, [..., N, Di] (``keys.dim() == q_idx.dim() - 1``), or gathered per query, [..., T, N, Di]
    (``keys.dim() == q_idx.dim()``).  Returns fp32 [..., T, N].  No other scaling, no softmax, no
    visibility mask (see ``topk_visible``).

    Deviation from the official reference: it computes this in bf16, which creates exact ties at the
    top-k boundary in a few percent of queries; fp32 makes ties rare, and the selected *sets* agree
    except at near-ties (spec §12).  MXFP4 inputs make each q·k product exact in fp32 up to summation order.
    """
    check_tensor("q_idx", q_idx, dtype=_FLOATS)
    check_tensor("w", w, dtype=_FLOATS, shape=tuple(q_idx.shape[:-1]))
    check_tensor("keys", keys, dtype=_FLOATS)
    if keys.shape[-1] != q_idx.shape[-1]:
        raise ValueError(f"keys: expected last dim {q_idx.shape[-1]}, got {list(keys.shape)}")
    if keys.dim() == q_idx.dim() - 1:
        dots = torch.einsum("...thd,...nd->...thn", q_idx.float(), keys.float())
    elif keys.dim() == q_idx.dim():
        dots = torch.einsum("...thd,...tnd->...thn", q_idx.float(), keys.float())
    else:
        raise ValueError(f"keys: expected {q_idx.dim() - 1} or {q_idx.dim()} dims, got {list(keys.shape)}")
    return (dots.relu() * w.float().unsqueeze(-1)).sum(-2)


def topk_visible(scores: torch.Tensor, n_visible: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``min(k, n_visible)`` visible entries per query, as logical entry ids padded with -1.

    scores fp32 [..., T, N] (entry j's score in column j); n_visible int [..., T] (entries 0..n-1 are
    visible, e.g. ``(t+1) // m``; values > N are treated as N).  Returns int32 [..., T, k]: the selected
    ids in descending score order, ties broken by the lower entry id first (deterministic), then -1.
    """
    check_tensor("scores", scores, dtype=_FLOATS)
    check_tensor("n_visible", n_visible, dtype=_INTS, shape=tuple(scores.shape[:-1]))
    if not isinstance(k, int) or k <= 0:
        raise ValueError(f"k: expected a positive int, got {k!r}")
    n = scores.shape[-1]
    ids = torch.arange(n, device=scores.device)
    visible = ids < n_visible.unsqueeze(-1)
    masked = torch.where(visible, scores.float(), float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
    if order.shape[-1] < k:
        pad = order.new_full((*order.shape[:-1], k - order.shape[-1]), -1)
        order = torch.cat([order, pad], dim=-1)
    count = torch.clamp(n_visible, max=min(k, n)).unsqueeze(-1)
    keep = torch.arange(k, device=scores.device) < count
    return torch.where(keep, order, -1).to(torch.int32)


def window_key_positions(positions: torch.Tensor, window_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw-token positions a query at ``t`` sees through the window: ``t-window+1 .. t`` (spec §2.1).

    positions int [...] -> (key_pos int64 [..., window], valid bool [..., window]), oldest first;
    slots with key_pos < 0 are invalid (and hold 0).
    """
    check_tensor("positions", positions, dtype=_INTS)
    kp = positions.long().unsqueeze(-1) - (window_size - 1) + torch.arange(window_size, device=positions.device)
    valid = kp >= 0
    return kp.clamp(min=0), valid
