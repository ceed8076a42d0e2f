"""Attention read path: one softmax with sink over FP8 window and compressed entries."""

from dsv4.kernels.attention.sparse_attention import (
    MIN_KEYS_PER_SPLIT,
    choose_num_splits,
    sparse_attention,
    sparse_attention_reference,
    sparse_attention_triton,
)

__all__ = [
    "MIN_KEYS_PER_SPLIT",
    "choose_num_splits",
    "sparse_attention",
    "sparse_attention_reference",
    "sparse_attention_triton",
]
