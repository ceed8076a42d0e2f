"""Lightning indexer read path: the query tail (RoPE, Hadamard, MXFP4), scores over paged FP4 (or FP8) keys (a
prefill's rows of one request: over its keys folded once), top-k selection, logical -> physical."""

from dsv4.kernels.indexer.prefill import (
    FoldedKeys,
    fold_keys,
    fold_keys_reference,
    prefill_scores,
    prefill_scores_reference,
)
from dsv4.kernels.indexer.query import indexer_query_tail, indexer_query_tail_reference
from dsv4.kernels.indexer.scores import (
    FP8KeyPages,
    fp8_key_pages,
    fp8_key_pages_from_mxfp4,
    indexer_scores,
    indexer_scores_fp8keys,
    indexer_scores_fp8keys_reference,
    indexer_scores_reference,
)
from dsv4.kernels.indexer.select import indexer_topk, row_chunks
from dsv4.kernels.indexer.topk import (
    to_physical,
    topk_indices,
    topk_indices_reference,
    visible_logical,
    visible_physical,
)

__all__ = [
    "FP8KeyPages",
    "FoldedKeys",
    "fold_keys",
    "fold_keys_reference",
    "prefill_scores",
    "prefill_scores_reference",
    "fp8_key_pages",
    "fp8_key_pages_from_mxfp4",
    "indexer_scores",
    "indexer_scores_fp8keys",
    "indexer_scores_fp8keys_reference",
    "indexer_scores_reference",
    "indexer_topk",
    "indexer_query_tail",
    "indexer_query_tail_reference",
    "row_chunks",
    "to_physical",
    "topk_indices",
    "topk_indices_reference",
    "visible_logical",
    "visible_physical",
]
