"""``dsv4 demo``: a tiny workload through the real command line."""

import json

from dsv4.cli import build_parser, main

TINY = ["--requests", "3", "--min-prompt", "20", "--max-prompt", "140", "--max-new", "4", "--device", "cpu"]
TINY += ["--backend", "torch", "--pages", "2", "--max-requests", "3", "--progress-every", "2"]


def test_demo_runs_and_verifies(capsys):
    assert main(["demo", *TINY]) == 0
    out = capsys.readouterr().out
    assert "step    0 |" in out and "tok/s" in out  # progress lines
    assert "cache memory by region" in out and "compressor_state" in out
    assert "cache memory by layer kind" in out and "csa" in out and "hca" in out and "swa" in out
    assert "tokens/s" in out
    assert "verified 3/3 requests: PASS" in out
    assert "FAIL" not in out


def test_demo_json(capsys):
    assert main(["demo", *TINY, "--json", "--seed", "1"]) == 0
    out = capsys.readouterr().out.strip()
    summary = json.loads(out)  # one object, nothing else on stdout
    r = summary["result"]
    assert r["all_passed"] is True and len(r["requests"]) == 3 and r["finished"] == 3
    assert r["tokens"] == r["prefill_tokens"] + r["decode_tokens"] + r["recomputed_tokens"] > 0
    assert set(summary["memory_by_layer_kind"]) == {"swa", "csa", "hca"}
    assert summary["memory_bytes_by_region"]["window_ring"] > 0
    assert summary["setup"]["device"] == "cpu"


def test_demo_swap(capsys):
    """--swap: the same tiny workload; preempted requests come back from the host instead of being recomputed."""
    assert main(["demo", *TINY, "--json", "--swap", "--pages", "1"]) == 0
    r = json.loads(capsys.readouterr().out.strip())["result"]
    assert r["all_passed"] is True and r["preemptions"] >= 1 and r["swapped_bytes"] > 0
    assert r["recomputed_tokens"] == 0


def test_demo_samples(capsys):
    """--samples 2: each prompt's second continuation is forked from its cache; all six requests verify."""
    assert main(["demo", *TINY, "--json", "--samples", "2", "--pages", "6", "--max-requests", "6"]) == 0
    r = json.loads(capsys.readouterr().out.strip())["result"]
    assert r["all_passed"] is True and r["finished"] == 6 and r["forked_tokens"] > 0
    assert main(["demo", *TINY, "--samples", "0"]) == 2


def test_demo_fails_when_a_request_does_not_verify(capsys, monkeypatch):
    from dsv4.engine.runner import EngineRunner, Tolerance

    verify = EngineRunner.verify
    monkeypatch.setattr(EngineRunner, "verify", lambda self, tolerance=None: verify(self, Tolerance(0.0, 0.0)))
    assert main(["demo", *TINY]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_demo_defaults_and_bad_arguments(capsys):
    args = build_parser().parse_args(["demo"])
    assert args.backend == "auto" and args.device == "auto" and args.requests >= 8
    assert main(["demo", "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err
    assert main(["demo", "--requests", "1", "--min-prompt", "300", "--pages", "1", "--backend", "torch"]) == 2
    assert "could never run" in capsys.readouterr().err
