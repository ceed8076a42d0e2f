"""The cache: schema (geometry and bytes), pools, the manager and the per-layer handle."""

from dsv4.cache.handle import ClassicalView, CompressorStateView, IndexerView, LayerCacheHandle, SWAView
from dsv4.cache.manager import CacheStats, InvariantError, KVCacheManager, PoolStats
from dsv4.cache.paged_cache import PagedKVPool, PagedLayerCache
from dsv4.cache.plan import RatioPlan, StepPlan
from dsv4.cache.schema import DEFAULT_BLOCK_TOKENS, ONLINE_STATE, CacheSchema
from dsv4.cache.snapshot import REGIONS, RequestSnapshot
from dsv4.cache.state_cache import LayerState, StateCachePool

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "ONLINE_STATE",
    "REGIONS",
    "CacheSchema",
    "CacheStats",
    "ClassicalView",
    "CompressorStateView",
    "IndexerView",
    "InvariantError",
    "KVCacheManager",
    "LayerCacheHandle",
    "LayerState",
    "PagedKVPool",
    "PagedLayerCache",
    "PoolStats",
    "RatioPlan",
    "RequestSnapshot",
    "SWAView",
    "StateCachePool",
    "StepPlan",
]
