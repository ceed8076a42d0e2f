"""``dsv4 bench --smoke``: tiny config on the CPU; rows carry the required fields and the checks pass."""

import importlib.util
import json
import pathlib

import pytest
import torch

from dsv4.cli import main
from dsv4.engine.bench import (
    MATCH_MEAN_ABS,
    PARTS,
    SMOKE,
    _part_cost,
    bench_config,
    fill_cache,
    plain_decode_step,
    run_bench,
)

REQUIRED = ("name", "gpu", "torch", "triton", "shape", "time_s", "bytes", "flops", "roofline_s", "baseline",
            "baseline_time_s", "date")  # fmt: skip


def _plot_module():
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "plot_decode.py"
    spec = importlib.util.spec_from_file_location("plot_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_smoke_cli_writes_rows_with_required_fields(tmp_path, capsys):
    out = tmp_path / "decode.jsonl"
    assert main(["bench", "--smoke", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cache us" in printed and "tiny" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert (tmp_path / "decode.txt").read_text().startswith("model")
    for r in rows:
        for k in REQUIRED:
            assert k in r, (r["name"], k)
        assert set(r["shape"]) == {"model", "kind", "context", "batch"}
        assert r["time_s"] > 0 and r["roofline_s"] > 0 and r["bytes"] > 0
    steps = [r for r in rows if r["name"].endswith("/step")]
    n_cfg = len(SMOKE.kinds) * len(SMOKE.contexts) * len(SMOKE.batches)
    assert len(steps) == n_cfg
    for r in steps:
        assert r["match"], r
        assert r["baseline"].startswith("plain PyTorch") and r["baseline_time_s"] > 0
        assert r["graph_time_s"] is None  # no graph on the CPU
    names = {r["name"] for r in rows}
    for part in PARTS:
        assert f"decode/csa/{part}" in names
    assert "decode/hca/indexer" not in names and "decode/swa/compressor" not in names
    assert {"decode/swa/cache_path", "decode/csa/cache_path", "decode/hca/cache_path"} <= names
    series = _plot_module().step_series(rows)
    assert set(series) == {("tiny", k) for k in SMOKE.kinds}
    assert [c for c, _ in series[("tiny", "csa")][3]["dsv4"]] == list(SMOKE.contexts)


def test_wider_block_tables_keep_the_checks(tmp_path):
    """--table-context: block tables sized for more tokens than the requests hold (-1 past their pages, as under
    an engine's static max length); the step still matches the plain baseline and the rows say the table size."""
    from dataclasses import replace

    rows = run_bench(
        replace(SMOKE, kinds=("csa",), contexts=(256,), batches=(2,), table_context=1024), log=lambda _: None
    )
    steps = [r for r in rows if r["name"].endswith("/step")]
    assert len(steps) == 1 and steps[0]["match"], steps
    assert all(r["shape"]["table_context"] == 1024 for r in rows)


def test_plain_baseline_detects_a_wrong_cache():
    """The check can fail: corrupting the compressed entries changes the plain step's output."""
    cfg = bench_config("tiny", "hca", 512)
    gen = torch.Generator().manual_seed(1)
    from dsv4.cache.manager import KVCacheManager
    from dsv4.model.attention import AttentionSubBlock
    from dsv4.model.weights import random_attention_weights

    blk = AttentionSubBlock(cfg, 0, random_attention_weights(cfg, 0, seed=1), backend="torch")
    m = KVCacheManager(cfg, max_requests=2, num_pages=8)
    fill_cache(m, 1, 512, gen, "torch")
    assert m.num_tokens(0) == 511
    x = torch.randn(1, cfg.dim, generator=gen).to(torch.bfloat16)
    slots, pos = torch.tensor([m.slot_of(0)]), torch.tensor([511])
    bt = torch.tensor([m.block_ids(0, 128)])
    plan = m.plan({0: 1}, max_blocks={128: bt.shape[1]})
    ref = blk(x, m.acquire(0, plan))
    y1 = plain_decode_step(blk, m, slots, pos, bt, x)
    d = (y1.float() - ref.float()).abs()
    assert d.max() <= 0.05 and d.mean() <= 3e-3
    m.pools[128].layer(0).entries.rope.mul_(-1)  # flip the rope half of every compressed entry
    y2 = plain_decode_step(blk, m, slots, pos, bt, x)
    assert (y2.float() - ref.float()).abs().mean() > 2 * MATCH_MEAN_ABS  # fails the bench's check, by a margin


def _csa_step(seed: int):
    """A tiny CSA layer (torch backend) with one request of 511 cached tokens and its decode step's inputs: (cfg, the
    layer, the manager, x [1, dim], slots, positions, the CSA block table)."""
    from dsv4.cache.manager import KVCacheManager
    from dsv4.model.attention import AttentionSubBlock
    from dsv4.model.weights import random_attention_weights

    cfg = bench_config("tiny", "csa", 512)
    gen = torch.Generator().manual_seed(seed)
    blk = AttentionSubBlock(cfg, 0, random_attention_weights(cfg, 0, seed=seed), backend="torch")
    m = KVCacheManager(cfg, max_requests=2, num_pages=8)
    fill_cache(m, 1, 512, gen, "torch")
    x = torch.randn(1, cfg.dim, generator=gen).to(torch.bfloat16)
    return cfg, blk, m, x, torch.tensor([m.slot_of(0)]), torch.tensor([511]), torch.tensor([m.block_ids(0, 4)])


def test_plain_step_index_qr_feeds_the_indexer_only():
    """``index_qr`` (the second check of a failing CSA row): the step's own latent gives the same output, and
    another latent moves the indexer's selection while the attention query keeps its own."""
    cfg, blk, m, x, slots, pos, bt = _csa_step(2)
    aux: dict = {}
    y = plain_decode_step(blk, m, slots, pos, bt, x, aux=aux)
    assert aux["qr"].shape == (1, cfg.q_lora_rank) and aux["topk"].shape == (1, min(cfg.index_topk, 128))
    assert torch.equal(plain_decode_step(blk, m, slots, pos, bt, x, index_qr=aux["qr"].clone()), y)
    aux2: dict = {}
    y2 = plain_decode_step(blk, m, slots, pos, bt, x, aux=aux2, index_qr=aux["qr"].flip(-1).contiguous())
    assert torch.equal(aux2["qr"], aux["qr"])  # the attention query's latent is the step's own
    assert not torch.equal(aux2["q_idx"], aux["q_idx"]) and not torch.equal(aux2["topk"], aux["topk"])
    assert not torch.equal(y2, y)


def test_plain_step_index_sel_attends_the_given_selection():
    """``index_sel`` (the third check of a failing CSA row): the plain step's own selection gives its output bit for
    bit, another one (half of it dropped) another output; the layer's own selection (``_layer_selection``) ranks
    within the plain scores' top-k (same layer, same numerics here: the same set)."""
    from dsv4.engine.bench import _layer_selection

    _, blk, m, x, slots, pos, bt = _csa_step(3)
    aux: dict = {}
    y = plain_decode_step(blk, m, slots, pos, bt, x, aux=aux)
    assert torch.equal(plain_decode_step(blk, m, slots, pos, bt, x, index_sel=aux["topk"].int()), y)
    half = aux["topk"].int().clone()
    half[:, ::2] = -1
    assert not torch.equal(plain_decode_step(blk, m, slots, pos, bt, x, index_sel=half), y)
    plan = m.plan({0: 1}, max_blocks={4: bt.shape[1]})
    sel = _layer_selection(blk, m.acquire(0, plan), x)
    m.cancel(plan)
    assert sel.shape == aux["topk"].shape
    assert set(sel[0].tolist()) == set(aux["topk"][0].tolist())


def test_stack_projections_setting_follows_the_layer_default(monkeypatch):
    """``BenchSettings.stack_projections`` None (``dsv4 bench`` without ``--[no-]stack-projections``) is the layer's
    default, ``attention.STACK_PROJECTIONS``; True / False override it."""
    import dataclasses

    from dsv4.model import attention as attention_mod

    for default in (True, False):
        monkeypatch.setattr(attention_mod, "STACK_PROJECTIONS", default)
        assert SMOKE.stack_projections is None and SMOKE.stacked is default
        for v in (True, False):
            assert dataclasses.replace(SMOKE, stack_projections=v).stacked is v


def test_roofline_costs_and_bad_settings():
    cfg = bench_config("v4-flash", "csa", 1 << 20)
    assert cfg.max_seq_len == 1 << 20 and cfg.n_layers == 1 and cfg.compress_ratios == (4,)

    class _Blk:  # only what _part_cost reads
        pass

    from dsv4.cache.manager import KVCacheManager
    from dsv4.model.weights import random_attention_weights

    b = _Blk()
    b.cfg, b.w, b.ratio = cfg, random_attention_weights(cfg, 0, device="meta"), 4
    b.kind, b.stacked_indexer_weights = cfg.layer_kind(0), []
    m = KVCacheManager(cfg, max_requests=1, num_pages=1, device="meta")
    nb, fl = _part_cost("attention", b, m, 64, 131072)
    assert nb == 64 * (128 + 512) * 583 + 64 * 2 * 64 * 512 * 2  # window + top-512 entries; q and out
    assert fl == 4.0 * 64 * 64 * 640 * 512
    nb, fl = _part_cost("indexer", b, m, 64, 131072)
    assert nb > 64 * 32768 * 68 and fl > 2.0 * 64 * 32768 * 64 * 128
    with pytest.raises(ValueError, match="multiples of 128"):
        run_bench(SMOKE.__class__(models=("tiny",), contexts=(100,), device="cpu"))
    with pytest.raises(ValueError, match="kinds"):
        run_bench(SMOKE.__class__(models=("tiny",), contexts=(256,), kinds=("mla",), device="cpu"))
