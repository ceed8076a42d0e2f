import json

import pytest

from dsv4.cache.planner import format_plan, plan_memory
from dsv4.cli import main
from dsv4.config import get_preset


def test_1m_figures_match_spec():
    pro = plan_memory(get_preset("v4-pro"), 1048576)
    flash = plan_memory(get_preset("v4-flash"), 1048576)
    assert pro.bytes_per_token == 5031.4375 and flash.bytes_per_token == 3514.25
    assert pro.comparison_bytes_per_token["v4_bf16"] == 9848 and flash.comparison_bytes_per_token["v4_bf16"] == 6880
    assert pro.comparison_bytes_per_token["v3.2_fp8"] == 48068
    # Paged figure includes page padding and is therefore larger; fixed bytes are the rings + state.
    assert pro.bytes_per_token_paged > pro.bytes_per_token
    assert pro.per_request_bytes == pro.per_request_fixed_bytes + sum(
        pro.per_request_by_region[k] for k in ("compressed_entries", "indexer_keys")
    )
    assert sum(pro.per_request_by_layer_kind.values()) == pro.per_request_bytes


def test_budget_and_concurrency():
    one = plan_memory(get_preset("v4-flash"), 131072)
    b = plan_memory(get_preset("v4-flash"), 131072, budget_bytes=10 * one.per_request_bytes + 5)
    assert b.max_requests_in_budget == 10 and b.total_bytes == 10 * one.per_request_bytes
    c = plan_memory(get_preset("v4-flash"), 131072, concurrency=3)
    assert c.total_bytes == 3 * one.per_request_bytes
    with pytest.raises(ValueError, match="not both"):
        plan_memory(get_preset("tiny"), 10, concurrency=1, budget_bytes=10)
    with pytest.raises(ValueError, match="context_tokens"):
        plan_memory(get_preset("tiny"), -1)
    assert "requests of this length fit" in format_plan(b)


def test_cli_plan_json(capsys):
    assert main(["plan", "--model", "v4-pro", "--context", "1048576", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bytes_per_token"] == 5031.4375
    for k in ("bytes_per_token_paged", "per_request_fixed_bytes", "total_bytes"):
        assert isinstance(d[k], (int, float)) and d[k] > 0
    assert d["online_state"] is True
    assert main(["plan", "--model", "v4-pro", "--context", "1048576", "--json", "--state", "reference"]) == 0
    r = json.loads(capsys.readouterr().out)
    # HCA state: 31 layers x (128 x 512 x 2 fp32 rows = 512 KiB) vs x (5 x 512 fp32 + 4 B)
    assert r["online_state"] is False
    saved = r["per_request_fixed_bytes"] - d["per_request_fixed_bytes"]
    assert saved == 31 * (524288 - 10244) and r["per_request_bytes"] - d["per_request_bytes"] == saved


def test_cli_plan_official_config_and_errors(tmp_path, capsys):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(get_preset("v4-flash").to_official()))
    assert main(["plan", "--config", str(p), "--context", "1048576", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 3514.25
    assert main(["plan", "--context", "-5"]) == 2
    assert "context_tokens" in capsys.readouterr().err
    assert main(["plan", "--config", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--budget", "1e400"])  # not finite: argparse rejects it
    assert "expected a size" in capsys.readouterr().err
    assert main(["plan", "--budget", "80GiB", "--context", "4096"]) == 0
    assert "fit" in capsys.readouterr().out


def test_attention_weight_bytes_and_the_plan_line(capsys):
    """``attention_weight_bytes`` equals the bytes of every layer's weights as built (bf16; FP8 linear weights with fp32
    block scales, compressors fp32; everything FP8 as ``random_attention_weights(fp8=True)`` builds it), and ``dsv4
    plan`` prints / returns the three figures (not part of the cache budget)."""
    from dsv4.model.weights import attention_weight_bytes, random_attention_weights

    cfg = get_preset("tiny")

    def held(fp8: bool, compressors: bool) -> int:
        total = 0
        for layer in range(cfg.num_cache_layers):
            w = random_attention_weights(cfg, layer, fp8=fp8)
            total += sum(t.numel() * t.element_size() for t in w.to_state_dict().values())  # FP8: data + scale
            if fp8 and not compressors:  # the compressors' weights as fp32 instead
                total += sum(4 * t.numel() - t.nbytes for c in w.compressors for t in (c.wkv, c.wgate))
        return total

    assert attention_weight_bytes(cfg) == held(False, False)
    assert attention_weight_bytes(cfg, fp8=True, fp8_compressors=True) == held(True, True)
    assert attention_weight_bytes(cfg, fp8=True) == held(True, False)
    assert main(["plan", "--model", "v4-flash", "--context", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["attention_weight_bytes"]
    assert d["bf16"] > d["fp8"] > d["fp8_with_compressors"] > 0
    assert main(["plan", "--model", "v4-flash", "--context", "4096"]) == 0
    assert "attention weights, all layers, one copy (not in the budget): bf16" in capsys.readouterr().out
