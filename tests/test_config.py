import pytest

from dsv4.config import PRESETS, LayerKind, ModelConfig, get_preset


def test_flash_layer_kinds_match_release():
    c = get_preset("v4-flash")
    r = c.compress_ratios
    assert len(r) == 44 and c.n_layers == 43 and c.n_mtp_layers == 1
    assert r[:4] == (0, 0, 4, 128) and r[-2:] == (4, 0)
    kinds = c.layer_kinds
    assert kinds.count(LayerKind.CSA) == 21 and kinds.count(LayerKind.HCA) == 20 and kinds.count(LayerKind.SWA) == 3
    assert c.is_mtp(43) and not c.is_mtp(42) and c.layer_kind(43) is LayerKind.SWA
    assert (c.dim, c.n_heads, c.q_lora_rank, c.o_groups, c.index_topk) == (4096, 64, 1024, 8, 512)


def test_pro_layer_kinds_match_release():
    c = get_preset("v4-pro")
    r = c.compress_ratios
    assert len(r) == 62 and r[:3] == (128, 128, 4) and r[-1] == 0
    kinds = c.layer_kinds[: c.n_layers]
    assert kinds.count(LayerKind.CSA) == 30 and kinds.count(LayerKind.HCA) == 31 and LayerKind.SWA not in kinds
    assert (c.dim, c.n_heads, c.q_lora_rank, c.o_groups, c.index_topk) == (7168, 128, 1536, 16, 1024)


def test_shared_constants_and_rope_params():
    for c in PRESETS.values():
        assert (c.head_dim, c.rope_head_dim, c.window_size, c.index_head_dim) == (512, 64, 128, 128)
        assert c.ratio_classes == (4, 128)
    c = get_preset("v4-flash")
    assert c.rope_params(0) == (10000.0, False) and c.rope_params(2) == (160000.0, True)
    assert (c.original_seq_len, c.rope_factor, c.beta_fast, c.beta_slow) == (65536, 16.0, 32, 1)


def test_from_official_roundtrip_and_hf_aliases():
    c = get_preset("v4-pro")
    assert ModelConfig.from_official(c.to_official(), name="v4-pro") == c
    hf = {
        "hidden_size": 4096,
        "num_hidden_layers": 3,
        "num_attention_heads": 64,
        "compress_ratios": [0, 4, 128, 0],
        "vocab_size": 129280,
        "moe_inter_dim": 2048,
    }
    d = ModelConfig.from_official(hf)
    assert d.dim == 4096 and d.n_layers == 3 and d.n_mtp_layers == 1 and d.layer_kind(2) is LayerKind.HCA


@pytest.mark.parametrize(
    "change, field",
    [
        ({"n_heads": 0}, "n_heads"),
        ({"compress_ratios": (0, 4)}, "compress_ratios"),
        ({"rope_head_dim": 63}, "rope_head_dim"),
        ({"o_groups": 3}, "o_groups"),
        ({"compress_ratios": (0, -4, 128, 4, 0)}, "compress_ratios[1]"),
        ({"compress_ratios": (0, 1, 128, 4, 0)}, "compress_ratios[1]"),  # vLLM's "1 = window only" is not V4's
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_invalid_values_name_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        get_preset("tiny").replace(**change)


def test_errors_for_bad_lookups():
    with pytest.raises(ValueError, match="preset"):
        get_preset("v5")
    with pytest.raises(ValueError, match="layer_id"):
        get_preset("tiny").layer_kind(5)
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig.from_official({"dim": 8})
