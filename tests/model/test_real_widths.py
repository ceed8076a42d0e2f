"""The cached layer at the released models' real widths (V4-Flash, V4-Pro) against the dense reference, on the CPU.

``test_attention`` runs the tiny config; what only the real configs have is checked here: 64 / 128 heads of 512,
the grouped output projection's 8 / 16 groups, YaRN RoPE on the compressed layers and plain RoPE on the SWA layer,
the indexer's 64 heads with top-512, and (V4-Flash, 2,100 tokens) more visible CSA entries (525) than the indexer
selects, so the top-k really chooses.  PyTorch path (the Triton kernels meet these widths on the GPU tests).

Observed on this CPU (chunks of 1,000 and 1,000 tokens, then single tokens): max |d| 0.0039 (V4-Pro CSA 0.0078),
mean |d| 1.0-1.6e-5 (CSA, HCA), against the bounds of ``test_attention`` (max 0.03, mean 1.5e-3).  ~1 minute, ~5 GB.
"""

import pytest
import torch

from dsv4.cache import KVCacheManager
from dsv4.config import LayerKind, get_preset
from dsv4.model.attention import AttentionSubBlock
from dsv4.model.weights import random_attention_weights
from dsv4.reference.dense import dense_attention
from tests.model.test_attention import assert_close

CASES = {
    # (model, layer kind): (tokens, chunk sizes of one request)
    ("v4-flash", LayerKind.CSA): (2100, [1000, 1000, 96, 1, 1, 1, 1]),
    ("v4-flash", LayerKind.HCA): (2100, [1000, 1000, 96, 1, 1, 1, 1]),
    ("v4-flash", LayerKind.SWA): (300, [150, 129, 1, 1, 19]),
    ("v4-pro", LayerKind.CSA): (400, [200, 190, 7, 1, 1, 1]),
    ("v4-pro", LayerKind.HCA): (400, [200, 190, 7, 1, 1, 1]),
}


def first_layer(cfg, kind: LayerKind) -> int:
    return next(i for i in range(cfg.n_layers) if cfg.layer_kind(i) is kind)


@pytest.mark.parametrize("model, kind", list(CASES), ids=[f"{m}-{k.value}" for m, k in CASES])
def test_real_width_layer_matches_dense(model, kind):
    cfg = get_preset(model)
    layer = first_layer(cfg, kind)
    n, chunks = CASES[(model, kind)]
    assert sum(chunks) == n
    w = random_attention_weights(cfg, layer, seed=1)
    x = torch.randn(n, cfg.dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref = dense_attention(cfg, layer, w, x[None])[0]
    m = KVCacheManager(cfg, max_requests=1, num_pages=-(-n // 256), debug=True)
    blk = AttentionSubBlock(cfg, layer, w, backend="torch")
    assert m.add("r")
    out, done = [], 0
    for c in chunks:
        plan = m.plan({"r": c})
        out.append(blk(x[done : done + c], m.acquire(layer, plan)))
        m.commit(plan)
        done += c
    if kind is LayerKind.CSA and model == "v4-flash":  # the selection is real: more visible entries than top-k
        assert n // cfg.ratio(layer) > cfg.index_topk
    assert_close(torch.cat(out), ref)
    m.free("r")
    m.check_invariants()
