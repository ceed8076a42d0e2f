"""Tests of dsv4.model.weights: containers, random init, state-dict round trips, FP8 dequant, errors."""

import pytest
import torch

from dsv4.config import get_preset
from dsv4.model.weights import (
    AttentionWeights,
    attention_param_specs,
    attention_weights_from_safetensors,
    attention_weights_from_state_dict,
    checkpoint_prefix,
    dequantize_fp8_weight,
    random_attention_weights,
)

TINY = get_preset("tiny")  # layers: 0 SWA, 1 CSA, 2 HCA, 3 CSA, 4 SWA (MTP)


def assert_same(a: AttentionWeights, b: AttentionWeights):
    sa, sb = a.to_state_dict(), b.to_state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        if sa[k].dtype == torch.float8_e4m3fn:  # (no torch.equal for fp8 on the CPU: compare the bytes)
            assert torch.equal(sa[k].view(torch.uint8), sb[k].view(torch.uint8)), k
        else:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("layer_id", [0, 1, 2, 4])
def test_random_weights_structure_and_determinism(layer_id):
    w = random_attention_weights(TINY, layer_id, seed=3)
    w.check(TINY, layer_id)
    kind = TINY.layer_kind(layer_id).value
    assert (w.compressor is None) == (kind == "swa")
    assert (w.indexer is None) == (kind != "csa")
    sd = w.to_state_dict()
    assert set(sd) == set(attention_param_specs(TINY, layer_id))
    assert sd["wq_a.weight"].dtype == torch.bfloat16 and sd["attn_sink"].dtype == torch.float32
    assert sd["q_norm.weight"].dtype == torch.float32
    if w.compressor is not None:
        assert w.compressor.wkv.dtype == torch.float32 and w.compressor.ape.dtype == torch.float32
        c = 2 if kind == "csa" else 1
        assert w.compressor.ape.shape == (TINY.ratio(layer_id), c * TINY.head_dim)
    if w.indexer is not None:
        assert w.indexer.compressor.wkv.shape == (2 * TINY.index_head_dim, TINY.dim)
        assert w.indexer.weights_proj.dtype == torch.bfloat16
    assert_same(w, random_attention_weights(TINY, layer_id, seed=3))
    assert not torch.equal(w.wq_a, random_attention_weights(TINY, layer_id, seed=4).wq_a)
    # scaled init: unit-RMS inputs give O(1) projections
    x = torch.randn(64, TINY.dim)
    rms = (x @ w.wq_a.float().T).square().mean().sqrt().item()
    assert 0.5 < rms < 2.0


@pytest.mark.parametrize("layer_id", [0, 1, 2])
def test_state_dict_round_trip(layer_id):
    w = random_attention_weights(TINY, layer_id, seed=1)
    w2 = attention_weights_from_state_dict(TINY, layer_id, w.to_state_dict())
    assert_same(w, w2)
    # with a prefix, keys outside it are ignored
    pre = checkpoint_prefix(TINY, layer_id)
    full = {pre + k: v for k, v in w.to_state_dict().items()}
    full["layers.99.attn.wq_a.weight"] = torch.zeros(1)
    full["embed.weight"] = torch.zeros(1)
    assert_same(w, attention_weights_from_state_dict(TINY, layer_id, full, prefix=pre))
    # .to() keeps dtypes
    assert_same(w, w.to("cpu"))


def test_checkpoint_prefix_main_and_mtp():
    assert checkpoint_prefix(TINY, 2) == "layers.2.attn."
    assert checkpoint_prefix(TINY, 4) == "mtp.0.attn."


def _fp8_block_weight(out_f, in_f, seed=0):
    """A weight that is exactly e4m3 × a power-of-two scale per 128×128 block, with its parts."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(out_f, in_f, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    nb = ((out_f + 127) // 128, (in_f + 127) // 128)
    exps = torch.randint(-12, 3, nb, generator=g)
    full = (
        q.float()
        * torch.ldexp(torch.ones(nb), exps).repeat_interleave(128, 0)[:out_f].repeat_interleave(128, 1)[:, :in_f]
    )
    e8m0 = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return q, e8m0, torch.ldexp(torch.ones(nb), exps), full


def test_dequantize_fp8_weight_blocks():
    q, e8m0, s32, full = _fp8_block_weight(200, 300)
    assert torch.equal(dequantize_fp8_weight(q, e8m0), full)
    assert torch.equal(dequantize_fp8_weight(q, s32), full)
    # block (1, 2) really uses its own scale
    assert torch.equal(full[130, 260], q[130, 260].float() * s32[1, 2])
    with pytest.raises(ValueError, match="expected shape"):
        dequantize_fp8_weight(q, s32[:1])


@pytest.mark.parametrize("suffix,scale_kind", [(".scale", "e8m0"), (".weight_scale_inv", "fp32")])
def test_loader_dequantises_fp8_weights(suffix, scale_kind):
    layer_id = 1
    w = random_attention_weights(TINY, layer_id, seed=2)
    sd = w.to_state_dict()
    shape = tuple(sd["wq_b.weight"].shape)  # [8*512, 128]
    q, e8m0, s32, full = _fp8_block_weight(*shape, seed=5)
    sd["wq_b.weight"] = q
    sd["wq_b" + suffix] = e8m0 if scale_kind == "e8m0" else s32
    cq, ce, cs, cfull = _fp8_block_weight(*sd["compressor.wkv.weight"].shape, seed=6)
    sd["compressor.wkv.weight"] = cq
    sd["compressor.wkv" + suffix] = ce if scale_kind == "e8m0" else cs
    w2 = attention_weights_from_state_dict(TINY, layer_id, sd)
    assert w2.wq_b.dtype == torch.bfloat16 and torch.equal(w2.wq_b.float(), full)  # exact in bf16
    assert w2.compressor.wkv.dtype == torch.float32 and torch.equal(w2.compressor.wkv, cfull)


def test_loader_errors_name_the_key():
    sd = random_attention_weights(TINY, 2, seed=0).to_state_dict()
    bad = dict(sd)
    del bad["compressor.ape"]
    with pytest.raises(ValueError, match=r"missing key 'compressor\.ape' \(expected shape \[128, 512\]\)"):
        attention_weights_from_state_dict(TINY, 2, bad)
    bad = dict(sd)
    bad["wkv.weight"] = torch.zeros(512, 255)
    with pytest.raises(ValueError, match=r"'wkv\.weight': expected shape \[512, 256\], found shape \[512, 255\]"):
        attention_weights_from_state_dict(TINY, 2, bad)
    bad = dict(sd)
    bad["indexer.wq_b.weight"] = torch.zeros(512, 128)  # HCA layers have no indexer
    with pytest.raises(ValueError, match=r"unexpected key 'indexer\.wq_b\.weight'"):
        attention_weights_from_state_dict(TINY, 2, bad)
    bad = dict(sd)
    bad["wo_b.scale"] = torch.ones(2, 2)  # a scale next to a bf16 weight is unexpected
    with pytest.raises(ValueError, match=r"unexpected key 'wo_b\.scale'"):
        attention_weights_from_state_dict(TINY, 2, bad)
    bad = dict(sd)
    bad["wq_a.weight"] = bad["wq_a.weight"].to(torch.float8_e4m3fn)  # FP8 without its scale
    with pytest.raises(ValueError, match=r"'layers\.2\.attn\.wq_a\.weight' is float8_e4m3fn but its block scale"):
        attention_weights_from_state_dict(TINY, 2, {"layers.2.attn." + k: v for k, v in bad.items()}, "layers.2.attn.")
    bad["wq_a.scale"] = torch.ones(3, 3)
    with pytest.raises(ValueError, match=r"'wq_a\.scale': expected shape \[1, 2\], found shape \[3, 3\]"):
        attention_weights_from_state_dict(TINY, 2, bad)
    # a SWA layer's loader rejects compressor keys; every problem is reported at once
    with pytest.raises(
        ValueError, match=r"unexpected key 'compressor\.ape'.*unexpected key 'compressor\.norm\.weight'"
    ):
        attention_weights_from_state_dict(TINY, 0, sd)


def test_check_rejects_weights_of_another_layer_kind():
    w = random_attention_weights(TINY, 1, seed=0)  # CSA
    w.check(TINY, 3)  # another CSA layer: same shapes
    with pytest.raises(ValueError, match="unexpected key 'indexer"):
        w.check(TINY, 2)


def test_safetensors_reads_only_its_layer(tmp_path):
    from safetensors.torch import save_file

    w1 = random_attention_weights(TINY, 1, seed=7)
    w2 = random_attention_weights(TINY, 2, seed=8)
    sd1 = {checkpoint_prefix(TINY, 1) + k: v.contiguous() for k, v in w1.to_state_dict().items()}
    sd2 = {checkpoint_prefix(TINY, 2) + k: v.contiguous() for k, v in w2.to_state_dict().items()}
    # FP8 weight + e8m0 scale inside a shard
    q, e8m0, _, full = _fp8_block_weight(*w2.wo_b.shape, seed=9)
    sd2["layers.2.attn.wo_b.weight"] = q
    sd2["layers.2.attn.wo_b.scale"] = e8m0
    save_file(sd1, str(tmp_path / "model-00001.safetensors"))
    save_file({**sd2, "embed.weight": torch.zeros(4, 4)}, str(tmp_path / "model-00002.safetensors"))
    assert_same(w1, attention_weights_from_safetensors(tmp_path, TINY, 1))
    got = attention_weights_from_safetensors([tmp_path / "model-00002.safetensors"], TINY, 2)
    assert torch.equal(got.wo_b.float(), full)
    assert torch.equal(got.compressor.ape, w2.compressor.ape)
    with pytest.raises(ValueError, match="missing key 'layers.1.attn.attn_sink'"):
        attention_weights_from_safetensors(tmp_path / "model-00002.safetensors", TINY, 1)


@pytest.mark.parametrize("layer_id", [1, 2])
def test_random_fp8_weights(layer_id):
    """``fp8=True``: the linear weights, the compressors' too, are FP8Weight with power-of-two block scales; the
    container validates, round-trips through its state dict (e4m3 weight + fp32 ``.scale``), moves, and dequantises
    to the exact values (bf16 linear weights, fp32 compressor weights)."""
    from dsv4.formats.fp8_weight import FP8Weight

    w = random_attention_weights(TINY, layer_id, seed=3, fp8=True)
    w.check(TINY, layer_id)
    assert w.has_fp8 and isinstance(w.wq_b, FP8Weight) and isinstance(w.wo_a, FP8Weight)
    assert isinstance(w.compressor.wkv, FP8Weight) and isinstance(w.compressor.wgate, FP8Weight)
    if w.indexer is not None:
        assert isinstance(w.indexer.wq_b, FP8Weight) and isinstance(w.indexer.weights_proj, FP8Weight)
    assert all(v.pow2_scales() for v in (w.wq_a, w.wq_b, w.wkv, w.wo_a, w.wo_b))
    sd = w.to_state_dict()
    assert sd["wq_a.weight"].dtype == torch.float8_e4m3fn and sd["wq_a.scale"].dtype == torch.float32
    kept = attention_weights_from_state_dict(TINY, layer_id, sd, keep_fp8=True)
    assert_same(w, kept)
    assert_same(w, w.to("cpu"))
    d = w.dequantized()
    assert not d.has_fp8 and d.wq_b.dtype == torch.bfloat16
    assert torch.equal(d.wq_b.float(), w.wq_b.dequantize())
    assert d.compressor.wkv.dtype == torch.float32 and torch.equal(d.compressor.wkv, w.compressor.wkv.dequantize())
    assert torch.equal(d.compressor.ape, w.compressor.ape)
    # without keep_fp8 the loader dequantises: the same values as dequantized()
    assert_same(d, attention_weights_from_state_dict(TINY, layer_id, sd))
    # the scaled init survives the quantisation
    assert 0.5 < (torch.randn(64, TINY.dim) @ d.wq_a.float().T).square().mean().sqrt().item() < 2.0


def test_loader_keep_fp8_only_for_fp8_linear_weights():
    """``keep_fp8``: an FP8 linear weight of the checkpoint stays FP8 (its e8m0 scale as fp32), the compressors' too;
    a bf16 one that is an exact FP8 dequantisation (``wo_a`` in the official files) is re-encoded losslessly; other
    bf16 and fp32 linear weights are loaded as without it."""
    from dsv4.formats.fp8_weight import FP8Weight

    w = random_attention_weights(TINY, 1, seed=2)
    sd = w.to_state_dict()
    q, e8m0, s32, full = _fp8_block_weight(*sd["wq_b.weight"].shape, seed=5)
    sd["wq_b.weight"], sd["wq_b.scale"] = q, e8m0
    cq, ce, _, cfull = _fp8_block_weight(*sd["compressor.wkv.weight"].shape, seed=6)
    sd["compressor.wkv.weight"], sd["compressor.wkv.scale"] = cq, ce
    # wo_a as the convert script stores it: an FP8 weight dequantised to bf16 (exact), re-encoded losslessly
    wo_a8 = FP8Weight.quantize(sd["wo_a.weight"].float() * 37.0)
    sd["wo_a.weight"] = wo_a8.dequantize(torch.bfloat16)
    got = attention_weights_from_state_dict(TINY, 1, sd, keep_fp8=True)
    assert isinstance(got.wq_b, FP8Weight) and torch.equal(got.wq_b.data.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.wq_b.scale, s32) and torch.equal(got.wq_b.dequantize(), full)
    assert isinstance(got.wo_a, FP8Weight) and torch.equal(got.wo_a.dequantize(), wo_a8.dequantize())
    # a bf16 weight whose values are not e4m3 x a block scale stays bf16
    assert got.wq_a.dtype == torch.bfloat16 and torch.equal(got.wq_a, w.wq_a)
    assert isinstance(got.compressor.wkv, FP8Weight) and torch.equal(got.compressor.wkv.dequantize(), cfull)
    assert got.compressor.wgate.dtype == torch.float32 and torch.equal(got.compressor.wgate, w.compressor.wgate)
    assert FP8Weight.quantize_lossless(w.wq_a) is None
