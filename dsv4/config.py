"""Model configuration: every constant of DeepSeek-V4 attention that the cache depends on.

Field names are the official ``ModelArgs`` / ``inference/config.json`` names (spec §1).  The
presets hold the released values; ``tiny`` is a small model that keeps the real per-token
widths (head_dim 512, rope 64, window 128, ratios 4 and 128, index head 128) so that the real
byte formats are exercised in fast CPU tests.

Layer kinds (spec §1.1): ``compress_ratios`` has ``n_layers + n_mtp_layers`` entries; ratio 0 is a
sliding-window-only layer, 4 is CSA (compressor with overlap + lightning indexer), 128 is HCA
(compressor only).  The last ``n_mtp_layers`` entries are the MTP layers.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["LayerKind", "ModelConfig", "PRESETS", "get_preset"]

CSA_RATIO = 4  # the ratio whose compressor uses the two-half overlap and owns an indexer (spec §3)
HCA_RATIO = 128  # heavily compressed attention
SUPPORTED_RATIOS = (0, CSA_RATIO, HCA_RATIO)  # 0 = window only; the only values DeepSeek-V4 defines (spec §1.1)


class LayerKind(enum.Enum):
    """What a layer caches (spec §6): every kind has the window ring."""

    SWA = "swa"  # window only
    CSA = "csa"  # window + compressed entries (m=4, overlap) + MXFP4 indexer keys
    HCA = "hca"  # window + compressed entries (m=128), attended densely


@dataclass(frozen=True)
class ModelConfig:
    """Frozen DeepSeek-V4 attention configuration (official field names, spec §1).

    Units: ``dim``/``*_rank``/``*_dim`` are channels; ``window_size`` and ``max_seq_len`` are tokens;
    ``compress_ratios[i]`` is tokens per compressed entry of layer ``i`` (0 = none).
    """

    name: str = "custom"
    dim: int = 4096
    n_layers: int = 43
    n_mtp_layers: int = 1
    n_heads: int = 64
    q_lora_rank: int = 1024
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-6
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = ()
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: int = 32
    beta_slow: int = 1
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    max_seq_len: int = 1048576
    # Not used by the cache; kept so that a preset is the whole released attention config.
    dtype: str = "fp8"
    scale_fmt: str | None = "ue8m0"
    n_routed_experts: int = 256
    n_activated_experts: int = 6
    hc_mult: int = 4

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        positive = (
            "dim n_layers n_heads q_lora_rank head_dim rope_head_dim o_groups o_lora_rank "
            "window_size index_n_heads index_head_dim max_seq_len"
        ).split()
        for f in positive:
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{f}: expected a positive int, got {v!r}")
        if not isinstance(self.n_mtp_layers, int) or self.n_mtp_layers < 0:
            raise ValueError(f"ModelConfig.n_mtp_layers: expected an int >= 0, got {self.n_mtp_layers!r}")
        if not isinstance(self.index_topk, int) or self.index_topk <= 0:
            raise ValueError(f"ModelConfig.index_topk: expected a positive int, got {self.index_topk!r}")
        n = self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) != n:
            raise ValueError(
                f"ModelConfig.compress_ratios: expected n_layers + n_mtp_layers = {n} entries, "
                f"got {len(self.compress_ratios)}"
            )
        for i, r in enumerate(self.compress_ratios):
            if r not in SUPPORTED_RATIOS:
                raise ValueError(f"ModelConfig.compress_ratios[{i}]: expected one of {SUPPORTED_RATIOS}, got {r}")
        if self.rope_head_dim % 2 or self.rope_head_dim >= self.head_dim:
            raise ValueError(
                f"ModelConfig.rope_head_dim: expected an even number < head_dim={self.head_dim}, "
                f"got {self.rope_head_dim}"
            )
        if self.index_head_dim <= self.rope_head_dim:
            raise ValueError(
                f"ModelConfig.index_head_dim: expected > rope_head_dim={self.rope_head_dim}, got {self.index_head_dim}"
            )
        if self.n_heads % self.o_groups:
            raise ValueError(f"ModelConfig.o_groups: expected a divisor of n_heads={self.n_heads}, got {self.o_groups}")
        if not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps: expected > 0, got {self.norm_eps}")

    # ------------------------------------------------------------------ derived
    @property
    def nope_head_dim(self) -> int:
        """Channels of an entry stored as FP8 (head_dim - rope_head_dim)."""
        return self.head_dim - self.rope_head_dim

    @property
    def num_cache_layers(self) -> int:
        """Main layers plus MTP layers: every one of them has a window ring."""
        return self.n_layers + self.n_mtp_layers

    def layer_kind(self, layer_id: int) -> LayerKind:
        """The cache kind of layer ``layer_id`` (0-based; MTP layers follow the main ones)."""
        r = self.ratio(layer_id)
        if r == 0:
            return LayerKind.SWA
        return LayerKind.CSA if r == CSA_RATIO else LayerKind.HCA

    def ratio(self, layer_id: int) -> int:
        """Tokens per compressed entry of ``layer_id`` (0 for window-only layers)."""
        if not isinstance(layer_id, int) or not 0 <= layer_id < self.num_cache_layers:
            raise ValueError(f"layer_id: expected an int in [0, {self.num_cache_layers}), got {layer_id!r}")
        return self.compress_ratios[layer_id]

    def is_mtp(self, layer_id: int) -> bool:
        self.ratio(layer_id)
        return layer_id >= self.n_layers

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_cache_layers))

    @property
    def ratio_classes(self) -> tuple[int, ...]:
        """Distinct positive compression ratios, ascending (one block table per class)."""
        return tuple(sorted({r for r in self.compress_ratios if r > 0}))

    def layers_of_ratio(self, ratio: int) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == ratio)

    def overlap(self, ratio: int) -> bool:
        """Whether the compressor of this ratio pools two chunks (CSA's two-half overlap)."""
        return ratio == CSA_RATIO

    def rope_params(self, layer_id: int) -> tuple[float, bool]:
        """(theta, use_yarn) for a layer: compressed layers use compress_rope_theta + YaRN."""
        return (self.compress_rope_theta, True) if self.ratio(layer_id) else (self.rope_theta, False)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_official(cls, args: Mapping[str, Any], name: str = "official") -> ModelConfig:
        """Build from the official ``inference/config.json`` (ModelArgs) fields.

        Hugging Face names (``hidden_size``, ``num_hidden_layers``, ...) are accepted as aliases.
        Keys this project does not use are ignored; a missing key takes the ModelArgs default
        (as the official code does) except ``compress_ratios``, which must be given.
        """
        if not isinstance(args, Mapping):
            raise ValueError(f"model_args: expected a mapping, got {type(args).__name__}")
        known = {f.name for f in fields(cls)}
        kw: dict[str, Any] = {}
        for key, value in args.items():
            key = _HF_ALIASES.get(key, key)
            if key in known and key != "name":
                kw[key] = value
        if "compress_ratios" not in kw:
            raise ValueError("model_args: missing required field 'compress_ratios'")
        for k, default in _MODELARGS_DEFAULTS.items():
            kw.setdefault(k, default)
        if "n_mtp_layers" not in kw:
            kw["n_mtp_layers"] = len(kw["compress_ratios"]) - kw["n_layers"]
        return cls(name=name, **kw)

    def to_official(self) -> dict[str, Any]:
        """The ModelArgs fields of this config (inverse of ``from_official``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name"}
        d["compress_ratios"] = list(self.compress_ratios)
        return d

    def replace(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)


_HF_ALIASES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "sliding_window": "window_size",
    "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps",
}

# Defaults of the official ModelArgs dataclass for fields a config.json may omit.
_MODELARGS_DEFAULTS: dict[str, Any] = {
    "dim": 4096,
    "n_layers": 7,
    "n_heads": 64,
    "q_lora_rank": 1024,
    "head_dim": 512,
    "rope_head_dim": 64,
    "norm_eps": 1e-6,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "window_size": 128,
    "compress_rope_theta": 40000.0,
    "original_seq_len": 0,
    "rope_theta": 10000.0,
    "rope_factor": 40.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "max_seq_len": 4096,
}


def _alternating(n_layers: int, head: tuple[int, ...], mtp: tuple[int, ...]) -> tuple[int, ...]:
    body = tuple(4 if i % 2 == 0 else 128 for i in range(len(head), n_layers))
    return head + body + mtp


V4_FLASH = ModelConfig(
    name="v4-flash",
    dim=4096,
    n_layers=43,
    n_mtp_layers=1,
    n_heads=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    index_topk=512,
    compress_ratios=_alternating(43, (0, 0), (0,)),
    n_routed_experts=256,
    n_activated_experts=6,
)
V4_PRO = ModelConfig(
    name="v4-pro",
    dim=7168,
    n_layers=61,
    n_mtp_layers=1,
    n_heads=128,
    q_lora_rank=1536,
    o_groups=16,
    o_lora_rank=1024,
    index_topk=1024,
    compress_ratios=_alternating(61, (128, 128), (0,)),
    n_routed_experts=384,
    n_activated_experts=6,
)
TINY = ModelConfig(
    name="tiny",
    dim=256,
    n_layers=4,
    n_mtp_layers=1,
    n_heads=8,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=128,
    index_n_heads=4,
    index_topk=16,
    max_seq_len=65536,
    compress_ratios=(0, 4, 128, 4, 0),
    n_routed_experts=0,
    n_activated_experts=0,
)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (V4_FLASH, V4_PRO, TINY)}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"model preset: expected one of {sorted(PRESETS)}, got {name!r}") from None
