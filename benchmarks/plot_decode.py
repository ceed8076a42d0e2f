"""Plot of ``dsv4 bench`` results: decode-step time per layer kind against context length.

    python benchmarks/plot_decode.py benchmarks/results/2026-12-02_h200_decode.jsonl [--out FILE.png]

One panel per (model, layer kind); x = context (tokens, log), y = time of one layer's decode step (log).
For every batch size (one colour): dsv4 (CUDA graph when measured, else eager; solid), plain PyTorch
eager (dashed) and the roofline (dotted).  The default output is
``benchmarks/results/<date>_<gpu>_decode.png`` next to the input, ``<date>`` from the rows.
matplotlib is imported lazily (it is not a dependency of dsv4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def load_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_series(rows: list[dict]) -> dict[tuple[str, str], dict[int, dict[str, list[tuple[int, float]]]]]:
    """{(model, kind): {batch: {"dsv4" | "plain" | "roofline": [(context, seconds), ...]}}} of the step rows."""
    out: dict = {}
    for r in rows:
        if not r["name"].endswith("/step"):
            continue
        sh = r["shape"]
        s = out.setdefault((sh["model"], sh["kind"]), {}).setdefault(
            sh["batch"], {"dsv4": [], "plain": [], "roofline": []}
        )
        s["dsv4"].append((sh["context"], r["time_s"]))
        if r.get("baseline_time_s") is not None:
            s["plain"].append((sh["context"], r["baseline_time_s"]))
        s["roofline"].append((sh["context"], r["roofline_s"]))
    for per_b in out.values():
        for s in per_b.values():
            for k in s:
                s[k].sort()
    return out


def default_out(path: str, rows: list[dict]) -> str:
    date = (rows[0].get("date") or "undated")[:10] if rows else "undated"
    gpu = (rows[0].get("gpu") or "gpu").lower() if rows else "gpu"
    tag = "h200" if "h200" in gpu else gpu.replace(" ", "_")
    return os.path.join(os.path.dirname(os.path.abspath(path)), f"{date}_{tag}_decode.png")


def plot(rows: list[dict], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = step_series(rows)
    if not series:
        raise ValueError("no decode/<kind>/step rows to plot")
    models = sorted({m for m, _ in series})
    kinds = [k for k in ("swa", "csa", "hca") if any(k == kk for _, kk in series)]
    fig, axes = plt.subplots(len(models), len(kinds), figsize=(4.6 * len(kinds), 3.8 * len(models)), squeeze=False)
    batches = sorted({b for per_b in series.values() for b in per_b})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    graph = any(r.get("graph_time_s") is not None for r in rows)
    for i, model in enumerate(models):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            for n, b in enumerate(batches):
                s = series.get((model, kind), {}).get(b)
                if not s:
                    continue
                c = colours[n % len(colours)]
                for key, style, label in (
                    ("dsv4", "-o", f"dsv4 {'graph' if graph else 'eager'}"),
                    ("plain", "--s", "plain PyTorch"),
                    ("roofline", ":", "roofline"),
                ):
                    if s[key]:
                        x, y = zip(*s[key], strict=True)
                        ax.plot(x, [v * 1e6 for v in y], style, color=c, markersize=3, label=f"B={b} {label}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{model} {kind.upper()} layer")
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode step of one layer (µs)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    gpu = rows[0].get("gpu", "")
    fig.suptitle(f"DeepSeek-V4 attention decode step: dsv4 vs plain PyTorch vs roofline ({gpu})")
    fig.tight_layout()
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jsonl", help="JSON lines written by `dsv4 bench --out`")
    p.add_argument("--out", default=None, help="PNG path (default: <date>_<gpu>_decode.png next to the input)")
    args = p.parse_args(argv)
    rows = load_rows(args.jsonl)
    out = plot(rows, args.out or default_out(args.jsonl, rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
