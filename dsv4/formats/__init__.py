"""Byte formats of the cache: each is defined once here and everything else derives from it."""

from dsv4.formats.fp8_entry import FP8_DTYPE, ROPE_DTYPE, EntryPages, FP8EntryFormat
from dsv4.formats.mxfp4_key import KeyPages, MXFP4KeyFormat, e2m1_decode, e2m1_encode

__all__ = [
    "FP8_DTYPE",
    "ROPE_DTYPE",
    "EntryPages",
    "FP8EntryFormat",
    "KeyPages",
    "MXFP4KeyFormat",
    "e2m1_decode",
    "e2m1_encode",
]
