"""The ``dsv4`` command: ``plan`` (memory planner), ``demo`` (the engine runner), ``bench``."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence

from dsv4.config import PRESETS, ModelConfig, get_preset

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '1.5e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()] if m else math.nan
    except (KeyError, ValueError):
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a size like 80GiB or 1e9, got {text!r}")
    return int(value)


def _load_model(args: argparse.Namespace) -> ModelConfig:
    if args.config:
        with open(args.config) as f:
            return ModelConfig.from_official(json.load(f), name=args.config)
    return get_preset(args.model)


def _cmd_plan(args: argparse.Namespace) -> int:
    from dsv4.cache.planner import format_bytes, format_plan, plan_memory
    from dsv4.model.weights import attention_weight_bytes

    cfg = _load_model(args)
    plan = plan_memory(
        cfg,
        args.context,
        concurrency=args.concurrency,
        budget_bytes=args.budget,
        block_tokens=args.block_tokens,
        online_state=args.state == "online",
    )
    # the attention layers' own weights (not in the budget, which is the cache's): bf16, and kept FP8 (keep_fp8)
    weights = {
        "bf16": attention_weight_bytes(cfg),
        "fp8": attention_weight_bytes(cfg, fp8=True),
        "fp8_with_compressors": attention_weight_bytes(cfg, fp8=True, fp8_compressors=True),
    }
    if args.json:
        print(json.dumps({**plan.to_dict(), "attention_weight_bytes": weights}, indent=None if args.compact else 2))
    else:
        print(format_plan(plan))
        bf16, fp8, fp8c = (format_bytes(weights[k]) for k in ("bf16", "fp8", "fp8_with_compressors"))
        print(f"attention weights, all layers, one copy (not in the budget): bf16 {bf16}, kept FP8 {fp8}, "
              f"FP8 compressors too {fp8c}")  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="memory plan of the cache for a model, a context and a concurrency or budget")
    src = plan.add_mutually_exclusive_group()
    src.add_argument("--model", default="v4-flash", choices=sorted(PRESETS), help="preset (default v4-flash)")
    src.add_argument("--config", help="an official inference/config.json (ModelArgs fields)")
    plan.add_argument("--context", type=int, default=1048576, help="tokens per request (default 1048576)")
    how = plan.add_mutually_exclusive_group()
    how.add_argument("--concurrency", type=int, help="requests at once (default 1)")
    how.add_argument("--budget", type=parse_bytes, help="memory budget, e.g. 80GiB: how many requests fit")
    plan.add_argument("--block-tokens", type=int, default=256, help="raw tokens per page (default 256)")
    plan.add_argument(
        "--state",
        choices=("online", "reference"),
        default="online",
        help="HCA compressor state: a running softmax (default) or the reference layout's 128 rows",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--compact", action="store_true", help="with --json: on one line")
    plan.set_defaults(func=_cmd_plan)

    try:
        from dsv4.engine.cli import add_subcommands
    except ImportError:  # the engine is optional at this layer
        add_subcommands = None
    if add_subcommands is not None:
        add_subcommands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"dsv4 {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
