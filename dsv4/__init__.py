"""dsv4 — the KV cache and attention data path of DeepSeek-V4 hybrid attention."""

from dsv4.cache.manager import KVCacheManager
from dsv4.cache.planner import plan_memory
from dsv4.config import PRESETS, LayerKind, ModelConfig, get_preset

__all__ = ["PRESETS", "KVCacheManager", "LayerKind", "ModelConfig", "get_preset", "plan_memory"]
__version__ = "0.1.0"
