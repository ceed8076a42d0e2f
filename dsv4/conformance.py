"""Conformance harness: run one official attention layer through dsv4 exactly as an engine would.

``replay`` is the tool a user runs to check dsv4 against DeepSeek's official reference on their own
weights and inputs: feed the same ``model_args``, layer state dict and ``x`` to the official
``Attention`` module (prefill of ``x[:, :prefill_len]`` from position 0, then one decode step per later
position) and to ``replay``, and compare the outputs (spec §12: bf16-level tolerances — max |Δ| of a
few hundredths, mean |Δ| of a few thousandths; the indexer may pick a different entry on a near-tie).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from dsv4.cache.manager import KVCacheManager
from dsv4.cache.schema import DEFAULT_BLOCK_TOKENS
from dsv4.config import ModelConfig
from dsv4.errors import check_tensor
from dsv4.model.attention import AttentionSubBlock
from dsv4.model.weights import attention_weights_from_state_dict

__all__ = ["replay"]


def replay(
    model_args: dict,
    state_dict: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    prefill_len: int,
    *,
    layer_id: int = 0,
    prefill_chunk: int | None = None,
    backend: str = "auto",
    keep_fp8: bool = False,
) -> torch.Tensor:
    """Run layer ``layer_id`` over ``x`` through ``KVCacheManager`` -> ``acquire`` -> ``AttentionSubBlock``.

    Args:
        model_args: official ModelArgs fields (``inference/config.json``); the layer's kind is
            ``compress_ratios[layer_id]``.
        state_dict: that layer's attention parameters under the official names of spec §11, without the
            ``layers.{i}.attn.`` prefix (FP8 weights with their block scales are dequantised).
        x: [B, T, dim] layer input (after attn_norm); cast to bf16.
        prefill_len: tokens ``x[:, :prefill_len]`` are prefilled (in chunks of ``prefill_chunk`` tokens
            if given, else in one step); every later position is one decode step.  All B sequences
            start at position 0 and run in one batch.
        backend: "auto" | "torch" | "triton" for every operation.
        keep_fp8: FP8 linear weights stay FP8 (``attention_weights_from_state_dict``'s; the projections then run
            ``kernels.fp8_linear``: the same products for UE8M0 scales).

    Returns:
        y [B, T, dim] bf16.
    """
    cfg = ModelConfig.from_official(model_args)
    check_tensor("x", x, ndim=3)
    bsz, t_len, dim = x.shape
    if dim != cfg.dim:
        raise ValueError(f"x: expected last dim {cfg.dim} (model_args dim), got {list(x.shape)}")
    if not isinstance(prefill_len, int) or not 0 <= prefill_len <= t_len:
        raise ValueError(f"prefill_len: expected an int in [0, {t_len}], got {prefill_len!r}")
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk: expected a positive int or None, got {prefill_chunk!r}")
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, t_len))
    w = attention_weights_from_state_dict(cfg, layer_id, state_dict, device=x.device, keep_fp8=keep_fp8)
    block = math.lcm(DEFAULT_BLOCK_TOKENS, *cfg.ratio_classes)
    pages = bsz * (-(-t_len // block) + 1)
    mgr = KVCacheManager(cfg, max_requests=bsz, num_pages=pages, block_tokens=block, device=x.device)
    for b in range(bsz):
        mgr.add(b)
    block_fn = AttentionSubBlock(cfg, layer_id, w, backend=backend)
    xb = x.to(torch.bfloat16)
    y = torch.empty(bsz, t_len, cfg.dim, dtype=torch.bfloat16, device=x.device)

    steps: list[tuple[int, int]] = []
    chunk = prefill_chunk or max(prefill_len, 1)
    steps += [(s, min(chunk, prefill_len - s)) for s in range(0, prefill_len, chunk)]
    steps += [(s, 1) for s in range(prefill_len, t_len)]
    for start, n in steps:
        plan = mgr.plan({b: n for b in range(bsz)})
        if plan is None:  # cannot happen: the pools were sized for the whole sequence
            raise RuntimeError("replay: cache pages exhausted")
        out = block_fn(xb[:, start : start + n].reshape(bsz * n, cfg.dim), mgr.acquire(layer_id, plan))
        y[:, start : start + n] = out.view(bsz, n, cfg.dim)
        mgr.commit(plan)
    return y
