"""``benchmarks/bench_fp8_linear.py``'s rows on the CPU (the interpreter, the ``tiny`` preset's widths, a stand-in
timer): every projection, the seven together and the stacked compressors come out with their bytes, rooflines and
an error within the test bound, so the H200 run cannot fail on the script itself."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import bench_fp8_linear as bfl  # noqa: E402


def test_rows_of_the_tiny_model():
    calls = []

    def timer(fn):
        fn()
        calls.append(1)
        return 1e-6

    meta = {"gpu": "cpu", "sms": 132, "torch": "-", "triton": "-", "date": "-"}
    rows = bfl.run_model("tiny", 3, timer, meta, device="cpu")
    names = [r["name"] for r in rows]
    assert names == [f"fp8_linear_{n}" for n in bfl.projection_shapes("tiny")] + [
        "fp8_linear_all",
        "fp8_linear_compressors_csa",
    ]
    assert len(calls) == 2 * len(rows)  # dsv4 and its baseline, each row
    for r in rows:
        assert r["bytes"] < r["baseline_bytes"] and r["roofline_s"] > 0 and r["time_s"] == 1e-6
        if "max_err_bound" in r:
            assert r["max_err_bound"] <= 1.0 and r["baseline_max_err_bound"] <= 1.0, r
