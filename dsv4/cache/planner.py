"""Memory planner: what a DeepSeek-V4 cache costs for a context length and a concurrency or budget.

All figures come from ``CacheSchema`` (so from the config and the formats).  Two per-token figures:

- ``bytes_per_token``: the format minimum, FP8 main entries (584 B / m) + MXFP4 indexer keys
  (68 B / 4) summed over layers — the number the model card's "KV cache" claims use (spec §7.3);
- ``bytes_per_token_paged``: what the paged pools really allocate per token in steady state (MODEL1
  page stride padded to a multiple of 576 bytes; a 2-entry HCA page costs 1,728 B for 1,168 B of data).

Per request there are fixed bytes too (window rings of every layer, compressor state).  For comparison
the same model depth is costed as a V3.2-style cache (every layer stores a 656-byte FP8 MLA entry and a
132-byte FP8 indexer key per token) and as V4 with every entry in BF16 (1,024 B main, 256 B indexer).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dsv4.cache.schema import DEFAULT_BLOCK_TOKENS, ONLINE_STATE, CacheSchema
from dsv4.config import LayerKind, ModelConfig

# V3.2's per-token cache formats (FlashMLA's V3.2 FP8 layout and the FP8 indexer key), for comparison only.
V32_MLA_FP8_BYTES = 656
V32_INDEXER_FP8_BYTES = 132
_BF16 = 2


@dataclass(frozen=True)
class MemoryPlan:
    """A plan's figures (bytes unless the name says otherwise).  ``to_dict`` gives the JSON form."""

    model: str
    context_tokens: int
    block_tokens: int
    online_state: bool
    concurrency: int
    budget_bytes: int | None
    max_requests_in_budget: int | None
    bytes_per_token: float
    bytes_per_token_paged: float
    per_request_fixed_bytes: int
    per_request_bytes: int
    total_bytes: int
    per_request_by_region: dict[str, int]
    per_request_by_layer_kind: dict[str, int]
    layer_counts: dict[str, int]
    comparison_bytes_per_token: dict[str, float]
    comparison_per_request_bytes: dict[str, int]

    def to_dict(self) -> dict:
        return asdict(self)


def _comparison(cfg: ModelConfig, schema: CacheSchema, ctx: int) -> tuple[dict[str, float], dict[str, int]]:
    d, di = cfg.head_dim, cfg.index_head_dim
    bf16 = 0.0
    for m, rc in schema.ratio_classes.items():
        per_entry = d * _BF16 + (di * _BF16 if rc.key_fmt else 0)
        bf16 += per_entry * len(rc.layers) / m
    v32 = cfg.n_layers * (V32_MLA_FP8_BYTES + V32_INDEXER_FP8_BYTES)
    per_tok = {"dsv4_fp8_mxfp4": schema.min_bytes_per_token(), "v4_bf16": bf16, "v3.2_fp8": float(v32)}
    per_req = {k: math.ceil(v * ctx) for k, v in per_tok.items()}
    return per_tok, per_req


def plan_memory(
    config: ModelConfig,
    context_tokens: int,
    *,
    concurrency: int | None = None,
    budget_bytes: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    online_state: bool = ONLINE_STATE,
) -> MemoryPlan:
    """Cost a cache for requests of ``context_tokens`` tokens.

    Give ``concurrency`` (requests at once; default 1) or ``budget_bytes`` (then the plan says how many
    requests of that length fit, and ``total_bytes`` is what they take).  Not both.  ``online_state``: HCA's
    compressor state as a running softmax (``CacheSchema``; False: the reference layout's 128 rows).
    """
    if not isinstance(context_tokens, int) or context_tokens < 0:
        raise ValueError(f"context_tokens: expected an int >= 0, got {context_tokens!r}")
    if concurrency is not None and budget_bytes is not None:
        raise ValueError("plan_memory: give concurrency or budget_bytes, not both")
    if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
        raise ValueError(f"concurrency: expected an int >= 1, got {concurrency!r}")
    if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
        raise ValueError(f"budget_bytes: expected an int >= 0, got {budget_bytes!r}")
    schema = CacheSchema(config, block_tokens, online_state)
    fixed_regions = schema.per_request_fixed_bytes_by_region()
    fixed = sum(fixed_regions.values())

    entries = keys = 0
    by_kind = {k.value: 0 for k in LayerKind}
    for rc in schema.ratio_classes.values():
        pages = rc.pages_for_tokens(context_tokens)
        entries += pages * rc.entry_page_bytes * len(rc.layers)
        keys += pages * rc.key_page_bytes * len(rc.layers)
    for ls in schema.layers:
        b = schema.ring_page_bytes + schema.ring_meta_bytes + schema.compressor_state_bytes(ls.layer_id)
        if ls.ratio:
            rc = schema.ratio_classes[ls.ratio]
            b += rc.pages_for_tokens(context_tokens) * rc.layer_page_bytes
        by_kind[ls.kind.value] += b
    per_request = fixed + entries + keys

    max_requests = None
    if budget_bytes is not None:
        max_requests = budget_bytes // per_request if per_request else 0
        n = max_requests
    else:
        n = concurrency or 1
    per_tok, per_req = _comparison(config, schema, context_tokens)
    counts = {k.value: config.layer_kinds.count(k) for k in LayerKind}
    counts["mtp"] = config.n_mtp_layers
    return MemoryPlan(
        model=config.name,
        context_tokens=context_tokens,
        block_tokens=block_tokens,
        online_state=schema.online_state,
        concurrency=n,
        budget_bytes=budget_bytes,
        max_requests_in_budget=max_requests,
        bytes_per_token=schema.min_bytes_per_token(),
        bytes_per_token_paged=schema.paged_bytes_per_token(),
        per_request_fixed_bytes=fixed,
        per_request_bytes=per_request,
        total_bytes=n * per_request,
        per_request_by_region={"compressed_entries": entries, "indexer_keys": keys, **fixed_regions},
        per_request_by_layer_kind=by_kind,
        layer_counts=counts,
        comparison_bytes_per_token=per_tok,
        comparison_per_request_bytes=per_req,
    )


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units for reports: "512 B", "1.50 KiB", ... "2.00 TiB" (two decimals above bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.2f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    raise AssertionError


def format_plan(p: MemoryPlan) -> str:
    """A readable table of a plan."""
    lines = [
        f"dsv4 memory plan: model {p.model}, context {p.context_tokens:,} tokens, block {p.block_tokens} tokens",
        f"layers: {p.layer_counts}",
        "",
        f"{'bytes per token (format minimum: FP8 + MXFP4)':52s} {p.bytes_per_token:>14,.4f}",
        f"{'bytes per token (paged, with page padding)':52s} {p.bytes_per_token_paged:>14,.4f}",
        f"{'fixed bytes per request (rings, compressor state)':52s} {format_bytes(p.per_request_fixed_bytes):>14s}",
        f"{'HCA compressor state':52s} {'online' if p.online_state else 'reference (128 rows)':>14s}",
        f"{'bytes per request at this context':52s} {format_bytes(p.per_request_bytes):>14s}",
        "",
        "per request, by region:",
        *(f"  {k:30s} {format_bytes(v):>14s}" for k, v in p.per_request_by_region.items()),
        "per request, by layer kind:",
        *(f"  {k:30s} {format_bytes(v):>14s}" for k, v in p.per_request_by_layer_kind.items()),
        "",
        f"{'format':18s} {'B/token':>12s} {'per request':>14s}",
        *(
            f"{k:18s} {p.comparison_bytes_per_token[k]:>12,.2f} {format_bytes(v):>14s}"
            for k, v in p.comparison_per_request_bytes.items()
        ),
        "",
    ]
    if p.budget_bytes is not None:
        lines.append(
            f"budget {format_bytes(p.budget_bytes)}: {p.max_requests_in_budget} requests of this length fit "
            f"({format_bytes(p.total_bytes)} used)"
        )
    else:
        lines.append(f"{p.concurrency} concurrent request(s): {format_bytes(p.total_bytes)} in total")
    return "\n".join(lines)
