"""dsv4 — the KV cache and attention data path of DeepSeek-V4 hybrid attention."""

from dsv4.config import PRESETS, LayerKind, ModelConfig, get_preset

__all__ = ["PRESETS", "LayerKind", "ModelConfig", "get_preset"]
__version__ = "0.1.0"
