"""Byte formats of the cache: each is defined once here and everything else derives from it."""

from dsv4.config import ModelConfig
from dsv4.formats.fp8_entry import FP8_DTYPE, ROPE_DTYPE, EntryPages, FP8EntryFormat
from dsv4.formats.mxfp4_key import KeyPages, MXFP4KeyFormat, e2m1_decode, e2m1_encode


def entry_format(cfg: ModelConfig) -> FP8EntryFormat:
    """The FP8 entry format of a config's window KV and compressed entries (head_dim, rope_head_dim)."""
    return FP8EntryFormat(head_dim=cfg.head_dim, rope_dim=cfg.rope_head_dim)


def key_format(cfg: ModelConfig) -> MXFP4KeyFormat:
    """The MXFP4 format of a config's indexer keys and indexer queries (index_head_dim)."""
    return MXFP4KeyFormat(dim=cfg.index_head_dim)


__all__ = [
    "FP8_DTYPE",
    "ROPE_DTYPE",
    "EntryPages",
    "FP8EntryFormat",
    "KeyPages",
    "MXFP4KeyFormat",
    "e2m1_decode",
    "entry_format",
    "key_format",
    "e2m1_encode",
]
