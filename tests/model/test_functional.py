"""Tests of dsv4.model.functional: RoPE/YaRN, Hadamard, quantisation simulation, compressor pooling,
sparse attention, indexer scores and top-k."""

import math

import pytest
import torch

from dsv4.config import get_preset
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat
from dsv4.formats.mxfp4_key import E2M1_VALUES
from dsv4.model import functional as F

TINY = get_preset("tiny")
FLASH = get_preset("v4-flash")


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- RMSNorm
def test_rms_norm_fp32_math_and_dtype():
    x = torch.randn(3, 64, generator=gen()).bfloat16() * 5
    wt = torch.rand(64, generator=gen(1)) + 0.5
    y = F.rms_norm(x, wt, 1e-6)
    assert y.dtype == torch.bfloat16
    xf = x.double()
    ref = (xf / torch.sqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * wt.double()).bfloat16()
    assert (y.float() - ref.float()).abs().max() <= 2**-7 * ref.float().abs().max()
    y0 = F.rms_norm(x.float(), None, 1e-6)
    torch.testing.assert_close(y0.square().mean(-1), torch.ones(3), rtol=1e-5, atol=1e-5)


def test_head_rms_norm_is_bf16_per_head():
    q = torch.randn(5, 4, 512, generator=gen()).bfloat16() * 3
    y = F.head_rms_norm(q, 1e-6)
    assert y.dtype == torch.bfloat16 and y.shape == q.shape
    rms = y.float().square().mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(5, 4), atol=1e-2, rtol=0)
    # computed in bf16 exactly as the reference sequence of ops
    assert torch.equal(y, q * torch.rsqrt(q.square().mean(-1, keepdim=True) + 1e-6))


# ---------------------------------------------------------------------------------------------- RoPE
def _yarn_by_hand(k, base=160000.0, rd=64, orig=65536, factor=16.0, bf=32, bs=1):
    low = math.floor(rd * math.log(orig / (bf * 2 * math.pi)) / (2 * math.log(base)))
    high = math.ceil(rd * math.log(orig / (bs * 2 * math.pi)) / (2 * math.log(base)))
    low, high = max(low, 0), min(high, rd - 1)
    r = min(max((k - low) / (high - low), 0.0), 1.0)
    th = base ** (-2 * k / rd)
    return th * (1 - r) + th * r / factor, low, high


@pytest.mark.parametrize("cfg,layer_id", [(TINY, 1), (TINY, 2), (FLASH, 2), (FLASH, 3)])
def test_yarn_table_matches_hand_computation(cfg, layer_id):
    f = F.rope_inv_freq(cfg, layer_id)
    assert f.dtype == torch.float32 and f.shape == (32,)
    _, low, high = _yarn_by_hand(0)
    assert (low, high) == (15, 25)  # pinned for θ = 160000, L = 65536, β = 32 / 1
    for k in (0, 7, 15, 16, 20, 24, 25, 31):
        want, _, _ = _yarn_by_hand(k)
        assert f[k].item() == pytest.approx(want, rel=2e-6), k
    # outside the ramp: unchanged below low, divided by the factor above high
    assert f[10].item() == pytest.approx(160000.0 ** (-20 / 64), rel=2e-6)
    assert f[30].item() == pytest.approx(160000.0 ** (-60 / 64) / 16, rel=2e-6)


@pytest.mark.parametrize("cfg,layer_id", [(TINY, 0), (TINY, 4), (FLASH, 0), (FLASH, 43)])
def test_swa_layers_use_plain_theta(cfg, layer_id):
    f = F.rope_inv_freq(cfg, layer_id)
    want = torch.tensor([10000.0 ** (-2 * k / 64) for k in range(32)], dtype=torch.float64)
    torch.testing.assert_close(f.double(), want, rtol=2e-6, atol=0)


def test_rope_interleaved_pairs_on_last_dims():
    inv = torch.tensor([1.0, 0.5], dtype=torch.float32)  # rd = 4
    x = torch.zeros(1, 10)
    x[0, 6] = 1.0  # first rope pair (6, 7) = 1 + 0i
    x[0, 8] = 2.0  # second pair (8, 9) = 2 + 0i
    x[0, :6] = torch.arange(6.0)
    y = F.apply_rope(x, torch.tensor([3]), inv)
    assert torch.equal(y[0, :6], torch.arange(6.0))
    torch.testing.assert_close(y[0, 6:8], torch.tensor([math.cos(3.0), math.sin(3.0)]))
    torch.testing.assert_close(y[0, 8:10], 2 * torch.tensor([math.cos(1.5), math.sin(1.5)]))


def test_rope_preserves_pair_norms_and_inverse_undoes():
    inv = F.rope_inv_freq(TINY, 1)
    x = torch.randn(7, 3, 512, generator=gen())
    pos = torch.tensor([0, 1, 5, 127, 4096, 65535, 1000003])[:, None]
    y = F.apply_rope(x, pos, inv)
    assert torch.equal(y[..., :448], x[..., :448])
    n_x = x[..., 448:].unflatten(-1, (32, 2)).norm(dim=-1)
    n_y = y[..., 448:].unflatten(-1, (32, 2)).norm(dim=-1)
    torch.testing.assert_close(n_y, n_x, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y[1:], x[1:])
    back = F.apply_rope(y, pos, inv, inverse=True)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
    # bf16 in -> bf16 out
    yb = F.apply_rope(x.bfloat16(), pos, inv)
    assert yb.dtype == torch.bfloat16


def test_rope_position_broadcasting_is_explicit():
    inv = F.rope_inv_freq(TINY, 1)
    q = torch.randn(2, 5, 3, 512, generator=gen())
    pos = torch.arange(5) * 7
    y = F.apply_rope(q, pos[:, None], inv)
    for t in range(5):
        torch.testing.assert_close(y[:, t], F.apply_rope(q[:, t], pos[t].expand(2, 3), inv), rtol=0, atol=0)
    per_row = torch.stack([pos, pos + 1])[:, :, None]  # [B, T, 1]
    y2 = F.apply_rope(q, per_row, inv)
    torch.testing.assert_close(y2[1], F.apply_rope(q[1], (pos + 1)[:, None], inv), rtol=0, atol=0)
    with pytest.raises(ValueError, match="positions"):
        F.apply_rope(q, pos, inv)  # [T] does not broadcast to [B, T, H]
    with pytest.raises(ValueError, match="positions"):
        F.apply_rope(q, pos.float()[:, None], inv)


# ---------------------------------------------------------------------------------------------- Hadamard
def test_hadamard_sylvester_order_pinned_at_dim4():
    h = F.hadamard(torch.eye(4)).float() * 2
    want = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float32)
    assert torch.equal(h, want)


def test_hadamard_orthogonal_and_involutive():
    m = F.hadamard(torch.eye(128)).float()  # rows = H·128^-½ (bf16-rounded)
    torch.testing.assert_close(m @ m.T, torch.eye(128), atol=2e-2, rtol=0)
    torch.testing.assert_close(m @ m, torch.eye(128), atol=2e-2, rtol=0)  # symmetric: H·H = I
    x = torch.randn(6, 128, generator=gen())
    y = F.hadamard(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(F.hadamard(y).float(), x, atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(y.float().norm(dim=-1), x.norm(dim=-1), rtol=1e-2, atol=0)
    with pytest.raises(ValueError):
        F.hadamard(torch.randn(3, 96))


# ---------------------------------------------------------------------------------------------- quantisation
def test_fp8_simulate_rope_dims_unchanged_and_idempotent():
    x = (torch.randn(9, 512, generator=gen()) * 3).bfloat16()
    y = F.fp8_simulate(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y[:, 448:], x[:, 448:])
    assert not torch.equal(y[:, :448], x[:, :448])
    assert torch.equal(y, FP8EntryFormat().roundtrip(x))
    assert torch.equal(F.fp8_simulate(y), y)
    assert torch.equal(F.fp8_simulate(x, F.entry_format(TINY)), y)


def test_mxfp4_simulate_on_grid():
    x = torch.randn(5, 128, generator=gen()).bfloat16()
    y = F.mxfp4_simulate(x)
    assert torch.equal(y, MXFP4KeyFormat().roundtrip(x))
    blocks = y.float().unflatten(-1, (4, 32))
    scale = 2.0 ** torch.ceil(torch.log2(x.float().unflatten(-1, (4, 32)).abs().amax(-1, keepdim=True) / 6))
    grid = torch.tensor(E2M1_VALUES)
    v = (blocks / scale).abs()
    assert ((v.unsqueeze(-1) - grid).abs().amin(-1) == 0).all()
    assert torch.equal(F.mxfp4_simulate(y), y)


# ---------------------------------------------------------------------------------------------- compressor
def test_compressor_project_adds_ape_by_position_mod_ratio():
    dim, cd, m = 16, 8, 4
    x = torch.randn(6, dim, generator=gen()).bfloat16()
    wkv, wgate = torch.randn(cd, dim, generator=gen(1)), torch.randn(cd, dim, generator=gen(2))
    ape = torch.randn(m, cd, generator=gen(3))
    pos = torch.tensor([0, 1, 2, 3, 4, 9])
    kv, sc = F.compressor_project(x, wkv, wgate, ape, pos, m)
    assert kv.dtype == sc.dtype == torch.float32
    torch.testing.assert_close(kv, x.float() @ wkv.T)
    torch.testing.assert_close(sc, x.float() @ wgate.T + ape[pos % m])


def test_pool_entry_weights_sum_to_one_and_minus_inf_rows_ignored():
    sc = torch.randn(3, 8, 5, generator=gen())
    assert torch.allclose(F.pool_entry(torch.ones(3, 8, 5), sc), torch.ones(3, 5))
    kv = torch.randn(3, 8, 5, generator=gen(1))
    sc2 = sc.clone()
    sc2[:, :3] = float("-inf")
    kv2 = kv.clone()
    kv2[:, :3] = 1e6  # must get exactly zero weight
    got = F.pool_entry(kv2, sc2)
    want = F.pool_entry(kv[:, 3:], sc[:, 3:])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # explicit per-channel softmax
    w = torch.exp(sc - sc.amax(1, keepdim=True))
    torch.testing.assert_close(F.pool_entry(kv, sc), (w * kv).sum(1) / w.sum(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overlap,m", [(True, 4), (False, 8)])
def test_compress_history_matches_explicit_rows(overlap, m):
    d, t = 6, 4 * m + 3
    c = 2 if overlap else 1
    kv = torch.randn(2, t, c * d, generator=gen())
    sc = torch.randn(2, t, c * d, generator=gen(1))
    got = F.compress_history(kv, sc, m, overlap)
    assert got.shape == (2, t // m, d)
    for i in range(t // m):
        cur = slice(i * m, (i + 1) * m)
        if not overlap:
            want = F.pool_entry(kv[:, cur], sc[:, cur])
        elif i == 0:
            want = F.pool_entry(kv[:, cur, d:], sc[:, cur, d:])
        else:
            prev = slice((i - 1) * m, i * m)
            rows_kv = torch.cat([kv[:, prev, :d], kv[:, cur, d:]], 1)
            rows_sc = torch.cat([sc[:, prev, :d], sc[:, cur, d:]], 1)
            want = F.pool_entry(rows_kv, rows_sc)
        torch.testing.assert_close(got[:, i], want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- attention
def _attn_brute(q, kv, valid, sink, scale):
    t_len, h, _ = q.shape
    out = torch.zeros(t_len, h, q.shape[-1], dtype=torch.float64)
    for t in range(t_len):
        keys = kv[t][valid[t]].double()
        for hh in range(h):
            s = keys @ q[t, hh].double() * scale
            e = torch.exp(s - s.max()) if len(s) else s
            den = e.sum() + torch.exp(sink[hh].double() - (s.max() if len(s) else 0))
            out[t, hh] = (e[:, None] * keys).sum(0) / den if len(s) else 0
    return out


def test_sparse_attention_matches_brute_force_with_sink():
    t_len, n, h, d = 4, 7, 3, 64
    q = torch.randn(t_len, h, d, generator=gen()).bfloat16()
    kv = torch.randn(t_len, n, d, generator=gen(1)).bfloat16()
    valid = torch.rand(t_len, n, generator=gen(2)) > 0.3
    valid[3] = False  # lonely query
    sink = torch.randn(h, generator=gen(3))
    kv_garbage = kv.clone()
    kv_garbage[~valid] = float("nan")  # invalid slots are ignored entirely
    o = F.sparse_attention_reference(q, kv_garbage, valid, sink, d**-0.5)
    assert o.dtype == torch.bfloat16 and o.shape == q.shape
    want = _attn_brute(q, kv, valid, sink, d**-0.5)
    torch.testing.assert_close(o.double(), want, atol=1e-2, rtol=1e-2)
    assert torch.equal(o[3], torch.zeros_like(o[3]))
    # sink = -inf gives a plain softmax (weights sum to 1: attending to identical values returns them)
    same = kv[:, :1].expand(-1, n, -1)
    o2 = F.sparse_attention_reference(q, same, valid, torch.full((h,), float("-inf")), d**-0.5)
    torch.testing.assert_close(o2[:3].float(), same[:3, :1].expand(-1, h, -1).float(), atol=1e-2, rtol=0)
    # leading batch dims
    ob = F.sparse_attention_reference(
        q[None].expand(2, -1, -1, -1), kv[None].expand(2, -1, -1, -1), valid[None].expand(2, -1, -1), sink, d**-0.5
    )
    assert torch.equal(ob[1], F.sparse_attention_reference(q, kv, valid, sink, d**-0.5))


def test_indexer_scores_shared_and_gathered_keys():
    t_len, hi, di, n = 3, 4, 128, 5
    q = torch.randn(t_len, hi, di, generator=gen()).bfloat16()
    w = torch.randn(t_len, hi, generator=gen(1)).bfloat16()
    k = torch.randn(n, di, generator=gen(2)).bfloat16()
    s = F.indexer_scores_reference(q, w, k)
    assert s.dtype == torch.float32 and s.shape == (t_len, n)
    want = torch.zeros(t_len, n, dtype=torch.float64)
    for t in range(t_len):
        for j in range(n):
            want[t, j] = sum(w[t, h].double() * torch.relu(q[t, h].double() @ k[j].double()) for h in range(hi))
    torch.testing.assert_close(s.double(), want, rtol=1e-5, atol=1e-4)
    s2 = F.indexer_scores_reference(q, w, k[None].expand(t_len, -1, -1))
    torch.testing.assert_close(s2, s, rtol=1e-6, atol=1e-6)


def test_topk_visible_ties_padding_and_visibility():
    scores = torch.tensor([[1.0, 5.0, 5.0, 2.0, 9.0, 5.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    ids = F.topk_visible(scores, torch.tensor([4, 6]), 3)
    assert ids.dtype == torch.int32
    assert ids.tolist() == [[1, 2, 3], [0, 1, 2]]  # entry 4 (score 9) is invisible; ties -> lower id
    ids = F.topk_visible(scores, torch.tensor([2, 0]), 3)
    assert ids.tolist() == [[1, 0, -1], [-1, -1, -1]]
    ids = F.topk_visible(scores, torch.tensor([6, 6]), 8)  # k > N: padded
    assert ids.tolist() == [[4, 1, 2, 5, 3, 0, -1, -1], [0, 1, 2, 3, 4, 5, -1, -1]]
    ids = F.topk_visible(scores[:, :0], torch.tensor([0, 0]), 2)
    assert ids.tolist() == [[-1, -1], [-1, -1]]


def test_window_key_positions():
    kp, valid = F.window_key_positions(torch.tensor([0, 2, 200]), 4)
    assert kp.tolist() == [[0, 0, 0, 0], [0, 0, 1, 2], [197, 198, 199, 200]]
    assert valid.tolist() == [[False, False, False, True], [False, True, True, True], [True] * 4]


def test_finalize_entries_main_and_indexer():
    inv = F.rope_inv_freq(TINY, 1)
    pooled = torch.randn(3, 512, generator=gen())
    nw = torch.rand(512, generator=gen(1)) + 0.5
    pos = torch.arange(3) * 4
    e = F.finalize_entries(pooled, nw, pos, inv, 1e-6, indexer=False)
    want = F.fp8_simulate(F.apply_rope(F.rms_norm(pooled.bfloat16(), nw, 1e-6), pos, inv))
    assert torch.equal(e, want)
    k = F.finalize_entries(pooled[:, :128], nw[:128], pos, inv, 1e-6, indexer=True)
    want = F.mxfp4_simulate(F.hadamard(F.apply_rope(F.rms_norm(pooled[:, :128].bfloat16(), nw[:128], 1e-6), pos, inv)))
    assert torch.equal(k, want)


def test_sparse_attention_shared_pool_equals_gathered_slots():
    t_len, n_pool, h, d, n = 5, 9, 2, 64, 4
    q = torch.randn(t_len, h, d, generator=gen()).bfloat16()
    pool = torch.randn(n_pool, d, generator=gen(1)).bfloat16()
    idx = torch.stack([torch.randperm(n_pool, generator=gen(10 + t))[:n] for t in range(t_len)])
    idx[1, 2:] = -1
    sink = torch.randn(h, generator=gen(3))
    valid = idx >= 0
    gathered = pool[idx.clamp(min=0)]
    mask = torch.zeros(t_len, n_pool, dtype=torch.bool)
    for t in range(t_len):
        mask[t, idx[t][valid[t]]] = True
    a = F.sparse_attention_reference(q, gathered, valid, sink, d**-0.5)
    b = F.sparse_attention_reference(q, pool, mask, sink, d**-0.5)
    torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="kv"):
        F.sparse_attention_reference(q, pool[:, :32], mask, sink, d**-0.5)
