"""One attention layer's parameters under the official names (spec §11), and how to load them.

``AttentionWeights`` is a frozen, module-free container: plain tensors in the dtypes the official
reference computes with (dequantised linear weights in bf16; ``attn_sink``, RMSNorm weights and the
whole compressor — ``wkv``, ``wgate``, ``ape``, ``norm`` — in fp32).  Its state-dict keys are the
official ones, without the ``layers.{i}.attn.`` prefix:

    attn_sink                          [n_heads]                         fp32
    wq_a.weight                        [q_lora_rank, dim]                bf16
    q_norm.weight                      [q_lora_rank]                     fp32
    wq_b.weight                        [n_heads·head_dim, q_lora_rank]   bf16
    wkv.weight                         [head_dim, dim]                   bf16
    kv_norm.weight                     [head_dim]                        fp32
    wo_a.weight                        [o_groups·o_lora_rank, (n_heads/o_groups)·head_dim]  bf16
    wo_b.weight                        [dim, o_groups·o_lora_rank]       bf16
    compressor.{wkv,wgate}.weight      [c·head_dim, dim]                 fp32   (CSA and HCA layers)
    compressor.ape                     [ratio, c·head_dim]               fp32
    compressor.norm.weight             [head_dim]                        fp32
    indexer.wq_b.weight                [index_n_heads·index_head_dim, q_lora_rank]  bf16  (CSA only)
    indexer.weights_proj.weight        [index_n_heads, dim]              bf16
    indexer.compressor.{wkv,wgate}.weight  [2·index_head_dim, dim]       fp32
    indexer.compressor.ape             [ratio, 2·index_head_dim]         fp32
    indexer.compressor.norm.weight     [index_head_dim]                  fp32

(c = 2 for the overlapping CSA compressor, 1 for HCA.)  Released checkpoints store linear weights as
``float8_e4m3fn`` with a companion block scale ``<module>.scale`` (float8_e8m0fnu or fp32; Hugging Face
files call it ``<module>.weight_scale_inv``), one scale per 128×128 block: the loader dequantises
them once (``w_fp32 = fp8 · scale``, exact in bf16 for power-of-two scales).  The official reference
also FP8-quantises the *activation* of each FP8 GEMM (blocks of 128); the dense layers here use plain
bf16 matmuls on the dequantised weights instead (a deviation of bf16-rounding size).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from dsv4.config import LayerKind, ModelConfig
from dsv4.formats.fp8_weight import WEIGHT_BLOCK, FP8Weight, expand_scale, scale_shape, scale_to_fp32

__all__ = [
    "WEIGHT_BLOCK",
    "AttentionWeights",
    "CompressorWeights",
    "FP8Weight",
    "IndexerWeights",
    "ParamSpec",
    "attention_param_specs",
    "attention_weight_bytes",
    "checkpoint_prefix",
    "dequantize_fp8_weight",
    "random_attention_weights",
    "attention_weights_from_state_dict",
    "attention_weights_from_safetensors",
]

_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")  # official convert-script name, Hugging Face name


class ParamSpec(NamedTuple):
    """Shape and storage class of one parameter.

    ``kind``: ``"linear"`` (a linear weight; may be FP8 in a checkpoint; kept in the model dtype),
    ``"linear_fp32"`` (a compressor linear weight; may be FP8; kept in fp32), ``"fp32"`` (sink, norms,
    ape: never FP8; kept in fp32).
    """

    shape: tuple[int, ...]
    kind: str


# ---------------------------------------------------------------------------------------------- containers
@dataclass(frozen=True)
class CompressorWeights:
    """Parameters of one compressor (spec §3): wkv, wgate [c·d, dim] fp32 (or ``FP8Weight``: ``keep_fp8``), ape
    [m, c·d] fp32, norm [d] fp32."""

    wkv: torch.Tensor | FP8Weight
    wgate: torch.Tensor | FP8Weight
    ape: torch.Tensor
    norm: torch.Tensor


@dataclass(frozen=True)
class IndexerWeights:
    """Parameters of the lightning indexer (spec §4): wq_b [Hi·Di, q_lora_rank], weights_proj [Hi, dim]
    (bf16, or ``FP8Weight``) and its own d = index_head_dim compressor."""

    wq_b: torch.Tensor | FP8Weight
    weights_proj: torch.Tensor | FP8Weight
    compressor: CompressorWeights


@dataclass(frozen=True)
class AttentionWeights:
    """One attention layer's parameters (spec §11), field names = official module names.

    ``compressor`` is None for SWA-only layers; ``indexer`` is None unless the layer is CSA.  Linear
    weights are ``[out, in]`` (``y = x·Wᵀ``): bf16 tensors, or, loaded with ``keep_fp8=True`` (built with
    ``fp8=True``), the checkpoint's ``FP8Weight`` (e4m3 + block scales: half the bytes; the layer then runs
    ``kernels.fp8_linear`` on them; ``dequantized`` gives the bf16 copy).  The compressors' weights are fp32, or
    likewise ``FP8Weight`` (a quarter of the bytes; their projections then run ``fp8_linear`` with fp32 outputs).
    Build with ``random_attention_weights``, ``attention_weights_from_state_dict`` or
    ``attention_weights_from_safetensors``; validate against a config with ``check``.
    """

    attn_sink: torch.Tensor
    wq_a: torch.Tensor | FP8Weight
    q_norm: torch.Tensor
    wq_b: torch.Tensor | FP8Weight
    wkv: torch.Tensor | FP8Weight
    kv_norm: torch.Tensor
    wo_a: torch.Tensor | FP8Weight
    wo_b: torch.Tensor | FP8Weight
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None

    def to_state_dict(self) -> dict[str, torch.Tensor]:
        """Official keys (no ``layers.{i}.attn.`` prefix) → the tensors held (not copies); an ``FP8Weight`` as its
        e4m3 ``<module>.weight`` and fp32 ``<module>.scale``, as a checkpoint holds it."""
        sd: dict[str, torch.Tensor] = {"attn_sink": self.attn_sink}
        _put_linear(sd, "wq_a", self.wq_a)
        sd["q_norm.weight"] = self.q_norm
        _put_linear(sd, "wq_b", self.wq_b)
        _put_linear(sd, "wkv", self.wkv)
        sd["kv_norm.weight"] = self.kv_norm
        _put_linear(sd, "wo_a", self.wo_a)
        _put_linear(sd, "wo_b", self.wo_b)
        if self.compressor is not None:
            sd.update(_compressor_sd(self.compressor, "compressor."))
        if self.indexer is not None:
            _put_linear(sd, "indexer.wq_b", self.indexer.wq_b)
            _put_linear(sd, "indexer.weights_proj", self.indexer.weights_proj)
            sd.update(_compressor_sd(self.indexer.compressor, "indexer.compressor."))
        return sd

    def check(self, cfg: ModelConfig, layer_id: int) -> None:
        """Raise ``ValueError`` naming every missing/unexpected parameter or wrong shape for this layer."""
        _validate(attention_param_specs(cfg, layer_id), self.to_state_dict(), prefix="", layer_id=layer_id)

    def to(self, device: torch.device | str) -> AttentionWeights:
        """A copy with every tensor moved to ``device`` (dtypes unchanged; ``FP8Weight`` stays FP8)."""
        return _map_weights(self, lambda t, kind: t.to(device))

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> AttentionWeights:
        """A copy whose ``FP8Weight`` weights are dequantised (what a checkpoint loaded without ``keep_fp8`` holds):
        linear weights to ``dtype``, the compressors' to fp32; every other tensor is shared."""

        def deq(t, kind: str):
            if not isinstance(t, FP8Weight):
                return t
            return t.dequantize(dtype if kind == "linear" else torch.float32)

        return _map_weights(self, deq)

    @property
    def compressors(self) -> list[CompressorWeights]:
        """The layer's compressors: the main one, then (CSA) the indexer's; [] for an SWA layer."""
        return [c for c in (self.compressor, self.indexer.compressor if self.indexer else None) if c is not None]

    @property
    def has_fp8(self) -> bool:
        """Some linear weight (a compressor's included) is an ``FP8Weight``."""
        return any(isinstance(v, FP8Weight) for v in _linear_fields(self))

    @property
    def device(self) -> torch.device:
        return self.wq_a.device


def _put_linear(sd: dict[str, torch.Tensor], module: str, w: torch.Tensor | FP8Weight) -> None:
    if isinstance(w, FP8Weight):
        sd[module + ".weight"] = w.data
        sd[module + ".scale"] = w.scale
    else:
        sd[module + ".weight"] = w


def _linear_fields(w: AttentionWeights) -> list[torch.Tensor | FP8Weight]:
    out = [w.wq_a, w.wq_b, w.wkv, w.wo_a, w.wo_b]
    if w.indexer is not None:
        out += [w.indexer.wq_b, w.indexer.weights_proj]
    return out + [t for c in w.compressors for t in (c.wkv, c.wgate)]


def _map_weights(w: AttentionWeights, fn) -> AttentionWeights:
    """A copy of ``w`` with ``fn(value, kind)`` applied to every tensor and ``FP8Weight`` (compressors and indexer
    included); ``kind`` is the ``ParamSpec`` kind: "linear", "linear_fp32" (a compressor's wkv / wgate) or "fp32"."""

    def lin(t):
        return fn(t, "linear")

    def par(t):
        return fn(t, "fp32")

    def comp(c: CompressorWeights | None) -> CompressorWeights | None:
        if c is None:
            return None
        return CompressorWeights(fn(c.wkv, "linear_fp32"), fn(c.wgate, "linear_fp32"), par(c.ape), par(c.norm))

    ix = w.indexer
    return AttentionWeights(
        attn_sink=par(w.attn_sink), wq_a=lin(w.wq_a), q_norm=par(w.q_norm), wq_b=lin(w.wq_b), wkv=lin(w.wkv),
        kv_norm=par(w.kv_norm), wo_a=lin(w.wo_a), wo_b=lin(w.wo_b), compressor=comp(w.compressor),
        indexer=None if ix is None else IndexerWeights(lin(ix.wq_b), lin(ix.weights_proj), comp(ix.compressor)),
    )  # fmt: skip


def _compressor_sd(c: CompressorWeights, prefix: str) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    _put_linear(sd, prefix + "wkv", c.wkv)
    _put_linear(sd, prefix + "wgate", c.wgate)
    sd[prefix + "ape"] = c.ape
    sd[prefix + "norm.weight"] = c.norm
    return sd


def _build(flat: Mapping[str, torch.Tensor], fn) -> AttentionWeights:
    """AttentionWeights from official keys (already validated), applying ``fn(key, tensor)`` to each."""

    def get(k: str) -> torch.Tensor:
        return fn(k, flat[k])

    def comp(prefix: str) -> CompressorWeights:
        return CompressorWeights(
            wkv=get(prefix + "wkv.weight"),
            wgate=get(prefix + "wgate.weight"),
            ape=get(prefix + "ape"),
            norm=get(prefix + "norm.weight"),
        )

    return AttentionWeights(
        attn_sink=get("attn_sink"),
        wq_a=get("wq_a.weight"),
        q_norm=get("q_norm.weight"),
        wq_b=get("wq_b.weight"),
        wkv=get("wkv.weight"),
        kv_norm=get("kv_norm.weight"),
        wo_a=get("wo_a.weight"),
        wo_b=get("wo_b.weight"),
        compressor=comp("compressor.") if "compressor.ape" in flat else None,
        indexer=IndexerWeights(
            wq_b=get("indexer.wq_b.weight"),
            weights_proj=get("indexer.weights_proj.weight"),
            compressor=comp("indexer.compressor."),
        )
        if "indexer.wq_b.weight" in flat
        else None,
    )


# ---------------------------------------------------------------------------------------------- specs
def attention_param_specs(cfg: ModelConfig, layer_id: int) -> dict[str, ParamSpec]:
    """Every parameter of layer ``layer_id`` (official key, no prefix) with its shape and storage class."""
    h, d, dim, ql = cfg.n_heads, cfg.head_dim, cfg.dim, cfg.q_lora_rank
    g, r = cfg.o_groups, cfg.o_lora_rank
    specs = {
        "attn_sink": ParamSpec((h,), "fp32"),
        "wq_a.weight": ParamSpec((ql, dim), "linear"),
        "q_norm.weight": ParamSpec((ql,), "fp32"),
        "wq_b.weight": ParamSpec((h * d, ql), "linear"),
        "wkv.weight": ParamSpec((d, dim), "linear"),
        "kv_norm.weight": ParamSpec((d,), "fp32"),
        "wo_a.weight": ParamSpec((g * r, (h // g) * d), "linear"),
        "wo_b.weight": ParamSpec((dim, g * r), "linear"),
    }
    m = cfg.ratio(layer_id)
    if m:
        specs.update(_compressor_specs("compressor.", dim, d, m, cfg.overlap(m)))
    if cfg.layer_kind(layer_id) is LayerKind.CSA:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        specs["indexer.wq_b.weight"] = ParamSpec((hi * di, ql), "linear")
        specs["indexer.weights_proj.weight"] = ParamSpec((hi, dim), "linear")
        specs.update(_compressor_specs("indexer.compressor.", dim, di, m, True))
    return specs


def attention_weight_bytes(cfg: ModelConfig, fp8: bool = False, fp8_compressors: bool = False) -> int:
    """Bytes of every cache layer's attention parameters (main and MTP layers; one copy, unsharded): linear weights
    bf16, or (``fp8``) e4m3 with an fp32 scale per 128 x 128 block as ``keep_fp8`` holds them (``wo_a`` included:
    re-encoded losslessly); the compressors' weights fp32, or (``fp8_compressors``: where the checkpoint holds them
    FP8) likewise; sink, norms and ape fp32."""
    total = 0
    for layer in range(cfg.num_cache_layers):
        for spec in attention_param_specs(cfg, layer).values():
            n = math.prod(spec.shape)
            if (spec.kind == "linear" and fp8) or (spec.kind == "linear_fp32" and fp8_compressors):
                total += n + 4 * math.prod(scale_shape(*spec.shape))
            else:
                total += n * (2 if spec.kind == "linear" else 4)
    return total


def _compressor_specs(prefix: str, dim: int, d: int, m: int, overlap: bool) -> dict[str, ParamSpec]:
    cd = (2 if overlap else 1) * d
    return {
        prefix + "wkv.weight": ParamSpec((cd, dim), "linear_fp32"),
        prefix + "wgate.weight": ParamSpec((cd, dim), "linear_fp32"),
        prefix + "ape": ParamSpec((m, cd), "fp32"),
        prefix + "norm.weight": ParamSpec((d,), "fp32"),
    }


def checkpoint_prefix(cfg: ModelConfig, layer_id: int) -> str:
    """Key prefix of a layer's attention in a full official checkpoint.

    Main layers: ``layers.{i}.attn.``; MTP layers (ids ``n_layers ..``): ``mtp.{i - n_layers}.attn.``.
    """
    if cfg.is_mtp(layer_id):
        return f"mtp.{layer_id - cfg.n_layers}.attn."
    return f"layers.{layer_id}.attn."


# ---------------------------------------------------------------------------------------------- FP8 weights
def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """Dequantise a block-scaled FP8 weight: fp32 ``[out, in] = fp32(weight) · scale[⌊o/b⌋, ⌊i/b⌋]``.

    weight float8_e4m3fn [out, in]; scale float8_e8m0fnu (2**(byte-127)) or fp32,
    [ceil(out/block), ceil(in/block)].
    """
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D float8_e4m3fn tensor, got {weight.dtype} {list(weight.shape)}")
    out_f, in_f = weight.shape
    want = scale_shape(out_f, in_f, block)
    if tuple(scale.shape) != want:
        raise ValueError(f"scale: expected shape {list(want)}, got {list(scale.shape)}")
    return weight.float() * expand_scale(scale_to_fp32(scale), out_f, in_f, block)


# ---------------------------------------------------------------------------------------------- loading
def _validate(
    specs: Mapping[str, ParamSpec], local: Mapping[str, torch.Tensor], prefix: str, layer_id: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Check ``local`` (keys without prefix) against ``specs``; return key -> (tensor, fp8 scale or None).

    Collects every problem and raises one ``ValueError`` naming each key with expected vs found.
    """
    problems: list[str] = []
    consumed: set[str] = set()
    out: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for key, spec in specs.items():
        name = prefix + key
        if key not in local:
            problems.append(f"missing key {name!r} (expected shape {list(spec.shape)})")
            continue
        t = local[key]
        consumed.add(key)
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name!r}: expected a tensor, found {type(t).__name__}")
            continue
        if tuple(t.shape) != spec.shape:
            problems.append(f"{name!r}: expected shape {list(spec.shape)}, found shape {list(t.shape)}")
            continue
        scale = None
        if t.dtype == torch.float8_e4m3fn:
            if spec.kind == "fp32":
                problems.append(f"{name!r}: expected a floating-point tensor, found float8_e4m3fn")
                continue
            module = key[: -len(".weight")]
            found = [module + s for s in _SCALE_SUFFIXES if module + s in local]
            if len(found) != 1:
                what = "missing" if not found else f"ambiguous ({', '.join(prefix + f for f in found)})"
                problems.append(
                    f"{name!r} is float8_e4m3fn but its block scale is {what}: expected one of "
                    f"{[prefix + module + s for s in _SCALE_SUFFIXES]}"
                )
                consumed.update(found)
                continue
            consumed.add(found[0])
            scale = local[found[0]]
            want = list(scale_shape(*spec.shape))
            if list(scale.shape) != want:
                problems.append(f"{prefix + found[0]!r}: expected shape {want}, found shape {list(scale.shape)}")
                continue
            if scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
                problems.append(f"{prefix + found[0]!r}: expected dtype float8_e8m0fnu or float32, found {scale.dtype}")
                continue
        elif not t.is_floating_point():
            problems.append(f"{name!r}: expected a floating-point tensor, found {t.dtype}")
            continue
        out[key] = (t, scale)
    for key in sorted(set(local) - consumed):
        problems.append(f"unexpected key {prefix + key!r} (not a parameter of layer {layer_id})")
    if problems:
        raise ValueError(f"attention weights of layer {layer_id}: " + "; ".join(problems))
    return out


def attention_weights_from_state_dict(
    cfg: ModelConfig,
    layer_id: int,
    sd: Mapping[str, torch.Tensor],
    prefix: str = "",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    keep_fp8: bool = False,
) -> AttentionWeights:
    """Build a layer's weights from a state dict with official keys (spec §11).

    Only keys starting with ``prefix`` are considered (e.g. ``checkpoint_prefix(cfg, i)`` for a full
    checkpoint; ``""`` for a bare attention state dict, where *every* key must be a parameter).  Every
    required key must be present with its exact shape, and no other key may appear under the prefix
    (a block-scale companion is allowed only next to an FP8 weight); all problems are reported in one
    ``ValueError``.  FP8 weights are dequantised; linear weights become ``dtype``; sink, norms and the
    compressors become fp32.  ``keep_fp8``: the FP8 linear weights (the compressors' too) stay FP8, as
    ``FP8Weight`` (half the memory, a quarter for the fp32 compressor weights; the layer runs ``kernels.fp8_linear``
    on them), and a non-FP8 linear weight whose
    values are exactly e4m3 times a power-of-two block scale (``wo_a``, which the official convert script stores
    dequantised to bf16) is re-encoded so, losslessly (``FP8Weight.quantize_lossless``: checked value by value; a
    weight that is not stays as it is).  Tensors land on ``device`` (default: where they are).
    """
    if not isinstance(sd, Mapping):
        raise ValueError(f"sd: expected a mapping of str -> Tensor, got {type(sd).__name__}")
    specs = attention_param_specs(cfg, layer_id)
    local = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
    checked = _validate(specs, local, prefix, layer_id)

    def convert(key: str, item: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor | FP8Weight:
        t, scale = item
        if device is not None:
            t = t.to(device)
            scale = None if scale is None else scale.to(device)
        if keep_fp8 and specs[key].kind in ("linear", "linear_fp32"):
            if scale is not None:
                return FP8Weight.from_checkpoint(t, scale)
            lossless = FP8Weight.quantize_lossless(t)
            if lossless is not None:
                return lossless
        if scale is not None:
            t = dequantize_fp8_weight(t, scale)
        target = dtype if specs[key].kind == "linear" else torch.float32
        return t.to(target).contiguous()

    return _build(checked, convert)


def attention_weights_from_safetensors(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    cfg: ModelConfig,
    layer_id: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    keep_fp8: bool = False,
) -> AttentionWeights:
    """Load one layer's attention weights from official-format ``.safetensors`` shards.

    ``paths``: one file, a directory (all ``*.safetensors`` in it), or several of either.  Only the
    tensors under ``checkpoint_prefix(cfg, layer_id)`` (``layers.{i}.attn.`` / ``mtp.{j}.attn.``) are
    read; then as ``attention_weights_from_state_dict``.
    """
    from safetensors import safe_open  # lazy: only needed for checkpoint loading

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        files.extend(sorted(p.glob("*.safetensors")) if p.is_dir() else [p])
    if not files:
        raise ValueError(f"paths: expected at least one .safetensors file, got {paths!r}")
    prefix = checkpoint_prefix(cfg, layer_id)
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                if key.startswith(prefix):
                    sd[key] = fh.get_tensor(key)
    return attention_weights_from_state_dict(cfg, layer_id, sd, prefix, device=device, dtype=dtype, keep_fp8=keep_fp8)


# ---------------------------------------------------------------------------------------------- random
def random_attention_weights(
    cfg: ModelConfig,
    layer_id: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
) -> AttentionWeights:
    """Seeded random weights for tests and demos, scaled so every activation is O(1).

    Linear weights ~ N(0, 1/fan_in) (so projections of unit-RMS inputs stay unit-RMS, q·k·D^-½ has
    unit spread and no softmax is degenerate); RMSNorm weights ~ 1 + N(0, 0.1²); ``attn_sink`` ~ N(0, 1);
    ``ape`` ~ N(0, 0.1²).  Deterministic for a given (cfg, layer_id, seed) on every device (drawn on
    the CPU, then moved).  ``fp8``: the linear weights (the compressors' too) are quantised as a checkpoint
    stores them and kept as ``FP8Weight`` (e4m3, UE8M0 scale per 128 x 128 block; ``dequantized()`` gives their
    exact values).
    """
    gen = torch.Generator().manual_seed(seed)
    specs = attention_param_specs(cfg, layer_id)
    flat: dict[str, torch.Tensor] = {}
    for key, spec in specs.items():
        z = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
        if spec.kind in ("linear", "linear_fp32"):
            v = z / spec.shape[1] ** 0.5
        elif key == "attn_sink":
            v = z
        elif key.endswith("ape"):
            v = 0.1 * z
        else:  # norm weights
            v = 1.0 + 0.1 * z
        flat[key] = v.to(dtype if spec.kind == "linear" else torch.float32)

    def place(key: str, t: torch.Tensor) -> torch.Tensor | FP8Weight:
        if fp8 and specs[key].kind in ("linear", "linear_fp32"):
            return FP8Weight.quantize(t).to(device)
        return t.to(device)

    return _build(flat, place)
