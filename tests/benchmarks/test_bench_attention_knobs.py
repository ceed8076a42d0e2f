"""``bench_attention.fused_knobs``: the ``KEY=VAL[+KEY=VAL]`` runs that ``profile_attention.py --fused`` and
``ncu_cases.py`` (``DSV4_FUSED_KNOBS``) set on the fused Gluon kernel's module knobs."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.bench_attention import fused_knobs  # noqa: E402


def test_knobs_map_to_the_module_names():
    assert fused_knobs("DEQUANT=2+ABLATE=3") == {"GLUON_FUSED_DEQUANT": 2, "GLUON_FUSED_ABLATE": 3}
    assert fused_knobs("") == {}  # no knobs: the defaults


def test_a_knob_the_module_lacks_is_refused():
    """A removed or misspelt knob (here the session-28 schedule switch) stops the run instead of timing the default."""
    with pytest.raises(SystemExit, match="SEESAW=1: expected knobs among .*GLUON_FUSED_DEQUANT"):
        fused_knobs("SEESAW=1")
