"""Tests of the dense cache-free reference layer (dsv4.reference.dense)."""

import pytest
import torch

from dsv4.config import get_preset
from dsv4.model import functional as F
from dsv4.model.weights import random_attention_weights
from dsv4.reference.dense import dense_attention

TINY = get_preset("tiny")  # layers: 0 SWA, 1 CSA (m=4, top-16), 2 HCA (m=128), 3 CSA, 4 SWA (MTP)
KINDS = {"swa": 0, "csa": 1, "hca": 2}


def inputs(b, t, seed=0):
    return torch.randn(b, t, TINY.dim, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.fixture(scope="module")
def weights():
    return {lid: random_attention_weights(TINY, lid, seed=10 + lid) for lid in range(TINY.num_cache_layers)}


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_shapes_and_aux(weights, kind):
    lid = KINDS[kind]
    b, t = 2, 260
    y, aux = dense_attention(TINY, lid, weights[lid], inputs(b, t), return_aux=True)
    assert y.shape == (b, t, TINY.dim) and y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert aux.q.shape == aux.attn_out.shape == (b, t, TINY.n_heads, TINY.head_dim)
    assert aux.window_kv.shape == (b, t, TINY.head_dim) and aux.window_kv.dtype == torch.bfloat16
    assert torch.equal(F.fp8_simulate(aux.window_kv), aux.window_kv)  # already FP8-representable
    m = TINY.ratio(lid)
    if kind == "swa":
        assert aux.entries is None and aux.topk is None and aux.key_index.shape == (b, t, TINY.window_size)
        return
    e = t // m
    assert aux.entries.shape == (b, e, TINY.head_dim) and aux.entries.dtype == torch.bfloat16
    assert torch.equal(F.fp8_simulate(aux.entries), aux.entries)
    assert aux.compressor_kv.shape == (b, t, (2 if kind == "csa" else 1) * TINY.head_dim)
    if kind == "hca":
        assert aux.topk is None and aux.indexer_keys is None
        assert aux.key_index.shape == (b, t, TINY.window_size + e)
    else:
        assert aux.indexer_keys.shape == (b, e, TINY.index_head_dim)
        assert torch.equal(F.mxfp4_simulate(aux.indexer_keys), aux.indexer_keys)
        assert aux.indexer_q.shape == (b, t, TINY.index_n_heads, TINY.index_head_dim)
        assert aux.index_scores.shape == (b, t, e) and aux.index_scores.dtype == torch.float32
        assert aux.topk.shape == (b, t, TINY.index_topk) and aux.topk.dtype == torch.int32
        assert aux.key_index.shape == (b, t, TINY.window_size + TINY.index_topk)


@pytest.mark.parametrize("kind,t_change", [("swa", 50), ("csa", 37), ("csa", 130), ("hca", 131), ("hca", 256)])
def test_causality_exact(weights, kind, t_change):
    lid = KINDS[kind]
    x = inputs(1, 300)
    y = dense_attention(TINY, lid, weights[lid], x)
    x2 = x.clone()
    x2[:, t_change:] = inputs(1, 300 - t_change, seed=99)
    y2 = dense_attention(TINY, lid, weights[lid], x2)
    assert torch.equal(y[:, :t_change], y2[:, :t_change])
    assert not torch.equal(y[:, t_change], y2[:, t_change])


def test_window_boundary_and_compressed_reach(weights):
    """Token 0 leaves the window of query t = 128 (window 128): only a compressed entry still carries it."""
    x = inputs(1, 180)
    x2 = x.clone()
    x2[:, 0] = inputs(1, 1, seed=5)[:, 0]
    for kind in ("swa", "csa", "hca"):
        lid = KINDS[kind]
        y, y2 = dense_attention(TINY, lid, weights[lid], x), dense_attention(TINY, lid, weights[lid], x2)
        assert not torch.equal(y[:, 127], y2[:, 127])  # token 0 is in query 127's window
        diff = [not torch.equal(y[:, t], y2[:, t]) for t in range(128, 180)]
        if kind == "swa":
            assert not any(diff)
        elif kind == "hca":
            assert all(diff)  # entry 0 (tokens 0..127) is visible from t = 127 on
        else:
            # CSA: entry 0 reaches a query only while the indexer selects it
            _, aux = dense_attention(TINY, lid, weights[lid], x, return_aux=True)
            sel0 = (aux.topk[0, 128:180] == 0).any(-1).tolist()
            assert all(d for d, s in zip(diff, sel0, strict=True) if s)
            assert any(sel0)


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_batch_rows_are_independent(weights, kind):
    lid = KINDS[kind]
    x = inputs(3, 140, seed=1)
    y, aux = dense_attention(TINY, lid, weights[lid], x, return_aux=True)
    for r in range(3):
        yr, auxr = dense_attention(TINY, lid, weights[lid], x[r : r + 1], return_aux=True)
        # bit-equal on this CPU; a BLAS may pick another blocking for another M, hence bf16 tolerance
        # (mixing rows would move outputs by O(0.1), far above it)
        torch.testing.assert_close(y[r : r + 1], yr, rtol=1e-2, atol=2e-3)
        if aux.topk is not None:
            assert torch.equal(aux.topk[r : r + 1], auxr.topk)


def test_csa_topk_is_all_visible_when_few(weights):
    lid, k = KINDS["csa"], TINY.index_topk
    t_len = 200
    _, aux = dense_attention(TINY, lid, weights[lid], inputs(2, t_len, seed=2), return_aux=True)
    for b in range(2):
        for t in range(t_len):
            n_vis = (t + 1) // 4
            ids = aux.topk[b, t]
            sel = ids[ids >= 0].tolist()
            assert len(sel) == min(k, n_vis) and (ids[len(sel) :] == -1).all()
            if n_vis <= k:
                assert sorted(sel) == list(range(n_vis))
            else:  # the selection is the top-k of the visible scores
                s = aux.index_scores[b, t, :n_vis]
                assert s[sel].min() >= s.topk(k).values.min()
                assert max(sel) < n_vis


def test_entries_match_incremental_state_machine(weights):
    """Entries and indexer keys equal a decode-style computation: fp32 state rows, emit at (t+1) % m == 0.  The
    projections are computed for the whole sequence at once, as the reference does (a one-token GEMV sums in another
    order than the batched GEMM on some CPUs' BLAS kernels: an fp32 difference that can move a bf16 entry by one ulp,
    which is not what this test is about), then fed to the state machine one token at a time."""
    x = inputs(1, 48, seed=3)
    lid = KINDS["csa"]
    w = weights[lid]
    _, aux = dense_attention(TINY, lid, w, x, return_aux=True)
    inv = F.rope_inv_freq(TINY, lid)
    for comp, d, got, indexer in (
        (w.compressor, TINY.head_dim, aux.entries, False),
        (w.indexer.compressor, TINY.index_head_dim, aux.indexer_keys, True),
    ):
        m = 4
        kv_state = torch.zeros(2 * m, 2 * d)
        sc_state = torch.full((2 * m, 2 * d), float("-inf"))
        out = []
        kv_all, sc_all = F.compressor_project(x, comp.wkv, comp.wgate, comp.ape, torch.arange(48), m)
        for t in range(48):
            kv_state[m + t % m], sc_state[m + t % m] = kv_all[0, t], sc_all[0, t]
            if (t + 1) % m == 0:
                rows_kv = torch.cat([kv_state[:m, :d], kv_state[m:, d:]])
                rows_sc = torch.cat([sc_state[:m, :d], sc_state[m:, d:]])
                pooled = F.pool_entry(rows_kv, rows_sc)
                out.append(
                    F.finalize_entries(pooled, comp.norm, torch.tensor(t + 1 - m), inv, TINY.norm_eps, indexer=indexer)
                )
                kv_state[:m], sc_state[:m] = kv_state[m:].clone(), sc_state[m:].clone()
        torch.testing.assert_close(torch.stack(out), got[0], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_attention_matches_per_query_loop(weights, kind):
    """The gathered key set is exactly window ∪ visible (selected) entries; output matches a float64 loop."""
    lid = KINDS[kind]
    w = weights[lid]
    t_len = 270
    _, aux = dense_attention(TINY, lid, w, inputs(1, t_len, seed=4), return_aux=True)
    m = TINY.ratio(lid)
    scale = TINY.head_dim**-0.5
    for t in (0, 5, 127, 128, 200, 255, 269):
        keys = [aux.window_kv[0, max(0, t - 127) + j] for j in range(min(t + 1, 128))]
        if m == 128:
            keys += [aux.entries[0, i] for i in range((t + 1) // m)]
        elif m == 4:
            keys += [aux.entries[0, i] for i in aux.topk[0, t].tolist() if i >= 0]
        kmat = torch.stack(keys).double()
        s = aux.q[0, t].double() @ kmat.T * scale  # [H, N]
        mx = torch.maximum(s.amax(-1), w.attn_sink.double())
        p = torch.exp(s - mx[:, None])
        o = p @ kmat / (p.sum(-1) + torch.exp(w.attn_sink.double() - mx))[:, None]
        o = F.apply_rope(o.float(), torch.tensor(t), F.rope_inv_freq(TINY, lid), inverse=True)
        torch.testing.assert_close(aux.attn_out[0, t].float(), o, atol=2e-2, rtol=2e-2)


def test_softmaxes_are_not_degenerate(weights):
    """Random weights give spread-out attention: the largest key weight is far from 1 on average."""
    lid = KINDS["hca"]
    _, aux = dense_attention(TINY, lid, weights[lid], inputs(1, 200, seed=6), return_aux=True)
    t = 150
    kmat = aux.window_kv[0, t - 127 : t + 1].float()
    s = aux.q[0, t].float() @ kmat.T * TINY.head_dim**-0.5
    pmax = s.softmax(-1).amax(-1)
    assert pmax.mean() < 0.5
    assert s.std() > 0.3


def test_long_sequence_all_layers_fast(weights):
    import time

    x = inputs(1, 600, seed=7)
    start = time.perf_counter()
    for lid in KINDS.values():
        y = dense_attention(TINY, lid, weights[lid], x)
        assert torch.isfinite(y.float()).all()
    assert time.perf_counter() - start < 30


def test_input_validation(weights):
    with pytest.raises(ValueError, match="x"):
        dense_attention(TINY, 0, weights[0], inputs(1, 4).float())
    with pytest.raises(ValueError, match="unexpected key"):
        dense_attention(TINY, 2, weights[1], inputs(1, 4))
