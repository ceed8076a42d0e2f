"""The fused indexer query tail (dsv4/kernels/indexer/query.py) against its PyTorch reference.

Tolerance.  The head weights must be equal (one fp32 multiplication rounded to bf16 on both sides).  q_idx
values are e2m1 x 2^k: the kernel sums the Hadamard in another fp32 order (exact for these data) and, on the
GPU, may fuse the RoPE rotation's multiply and add; either can move a bf16 value across an e2m1 rounding
boundary.  So: at least 99.9 % of the values equal, and any other value within one quantisation step of its
block (<= 2/3 of the block's amax: a step is at most 2 scale units and the scale at most amax / 3), and the
whole row equal in at least 99 % of rows.
"""

import pytest
import torch

from dsv4.config import get_preset
from dsv4.formats import MXFP4KeyFormat
from dsv4.kernels.indexer.query import indexer_query_tail, indexer_query_tail_reference
from dsv4.model import functional as F
from dsv4.model.projections import indexer_query
from dsv4.model.weights import random_attention_weights

FMT = MXFP4KeyFormat()


def _inputs(t, hi, device, seed=0, sigma=2.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, hi * FMT.dim, generator=g) * sigma).bfloat16().to(device)
    w = torch.randn(t, hi, generator=g).bfloat16().to(device)
    pos = torch.randint(0, 1 << 20, (t,), generator=g).to(device)
    return q, w, pos


def _inv_freq(device):
    cfg = get_preset("v4-flash")
    return F.rope_inv_freq(cfg, 2, device)  # a CSA layer: compress_rope_theta with YaRN


def _assert_close_mxfp4(got, want):
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.float(), want.float()
    eq = g == w
    assert eq.float().mean().item() >= 0.999, f"{(~eq).sum().item()} of {eq.numel()} values differ"
    blocks = w.unflatten(-1, (FMT.n_blocks, FMT.block))
    bound = (blocks.abs().amax(-1, keepdim=True) * (2 / 3)).expand_as(blocks).flatten(-2)
    assert bool(((g - w).abs() <= bound).all())
    assert eq.flatten(0, -2).all(-1).float().mean().item() >= 0.99


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("t,hi", [(1, 4), (3, 4), (17, 4), (2, 64)])
def test_matches_reference(device, backend, t, hi):
    q, w, pos = _inputs(t, hi, device)
    pos[0] = 0
    inv = _inv_freq(device)
    got_q, got_w = indexer_query_tail(q, w, pos, inv, FMT, backend=backend)
    want_q, want_w = indexer_query_tail_reference(q, w, pos, inv, FMT)
    assert got_w.dtype == torch.float32 and torch.equal(got_w, want_w)
    _assert_close_mxfp4(got_q, want_q)
    # the outputs are quantised: every value is an e2m1 code times its block's power of two
    packed, scale = FMT.quantize(got_q)
    assert torch.equal(FMT.dequantize(packed, scale, torch.bfloat16), got_q)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_special_rows(device, backend):
    """A head of zeros (amax floored), tiny and huge magnitudes, a block of zeros next to large values."""
    q, w, pos = _inputs(4, 4, device, seed=1)
    q = q.view(4, 4, FMT.dim)
    q[0, 0] = 0
    q[1, 1] *= 1e-30
    q[2, 2] *= 1e30
    q[3, 3, :32] = 0
    q[3, 3, 32:] *= 1e4
    q = q.flatten(1)
    inv = _inv_freq(device)
    got_q, got_w = indexer_query_tail(q, w, pos, inv, FMT, backend=backend)
    want_q, want_w = indexer_query_tail_reference(q, w, pos, inv, FMT)
    assert torch.equal(got_w, want_w)
    assert torch.equal(got_q[0, 0], torch.zeros_like(got_q[0, 0]))
    _assert_close_mxfp4(got_q, want_q)


def test_empty_and_fallback(device):
    inv = _inv_freq(device)
    q, w, pos = _inputs(0, 4, device)
    got_q, got_w = indexer_query_tail(q, w, pos, inv, FMT)
    assert got_q.shape == (0, 4, FMT.dim) and got_w.shape == (0, 4)
    # rope dims != Di / 2: the kernel's Hadamard split does not apply, the reference runs
    q, w, pos = _inputs(3, 2, device)
    got_q, got_w = indexer_query_tail(q, w, pos, inv[:16], FMT, backend="triton" if device.type == "cuda" else "auto")
    want_q, want_w = indexer_query_tail_reference(q, w, pos, inv[:16], FMT)
    assert torch.equal(got_q, want_q) and torch.equal(got_w, want_w)


def test_validation(device):
    q, w, pos = _inputs(3, 4, device)
    inv = _inv_freq(device)
    with pytest.raises(ValueError, match="q_lin"):
        indexer_query_tail(q[:, :-1], w, pos, inv, FMT)
    with pytest.raises(ValueError, match="q_lin"):
        indexer_query_tail(q.float(), w, pos, inv, FMT)
    with pytest.raises(ValueError, match="w_lin"):
        indexer_query_tail(q, w[0], pos, inv, FMT)
    with pytest.raises(ValueError, match="positions"):
        indexer_query_tail(q, w, pos[:2], inv, FMT)
    with pytest.raises(ValueError, match="inv_freq"):
        indexer_query_tail(q, w, pos, inv.double(), FMT)
    with pytest.raises(ValueError, match="inv_freq"):
        indexer_query_tail(q, w, pos, torch.ones(64, device=device), FMT)


def test_projections_dispatch(device):
    """``projections.indexer_query`` with a backend gives the reference's result (the dense layer's path)."""
    cfg = get_preset("tiny")
    lid = cfg.compress_ratios.index(4)
    w = random_attention_weights(cfg, lid, seed=0, device=device)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, cfg.dim, generator=g).bfloat16().to(device)
    qr = torch.randn(5, cfg.q_lora_rank, generator=g).bfloat16().to(device)
    pos = torch.tensor([0, 1, 4, 100, 65535], device=device)
    inv = F.rope_inv_freq(cfg, lid, device)
    want_q, want_w = indexer_query(cfg, w, x, qr, pos[:, None], inv)
    got_q, got_w = indexer_query(cfg, w, x, qr, pos[:, None], inv, backend="triton")
    assert torch.equal(got_w.float(), want_w.float())
    _assert_close_mxfp4(got_q, want_q)


@pytest.mark.parametrize("tuning", [{"block_h": 32}, {"block_h": 16, "num_warps": 2}])
def test_tuning_changes_nothing(device, tuning):
    """More heads a program, other warps (13 tokens, 32 heads): the same bytes as the default launch."""
    q, w, pos = _inputs(13, 32, device, seed=4)
    inv = _inv_freq(device)
    base = indexer_query_tail(q, w, pos, inv, FMT, backend="triton")
    got = indexer_query_tail(q, w, pos, inv, FMT, backend="triton", **tuning)
    assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
    with pytest.raises(ValueError, match="block_h"):
        indexer_query_tail(q, w, pos, inv, FMT, backend="triton", block_h=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4096, 65536])
def test_gpu_real_shapes(t):
    """V4 widths (Hi = 64, Di = 128), positions up to 1M, activations of a few scales."""
    dev = torch.device("cuda")
    inv = _inv_freq(dev)
    for seed, sigma in ((0, 1.0), (1, 30.0)):
        q, w, pos = _inputs(t, 64, dev, seed=seed, sigma=sigma)
        got_q, got_w = indexer_query_tail(q, w, pos, inv, FMT, backend="triton")
        want_q, want_w = indexer_query_tail_reference(q, w, pos, inv, FMT)
        assert torch.equal(got_w, want_w)
        _assert_close_mxfp4(got_q, want_q)
