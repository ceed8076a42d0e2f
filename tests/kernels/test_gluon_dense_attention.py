"""The opt-in Gluon dense kernel of the gathered attention path (``dense="gluon"``, ``_gluon_dense_attention``).

Gluon kernels do not run under ``TRITON_INTERPRET``, so on a CPU machine this file checks what can be checked
there: the option is refused with a clear error where the kernel cannot run, and the kernel compiles for sm_90
(ptxas, through ``benchmarks/sass_report.py``) without spills and without its wgmma chain serialised.  On an
sm_90 GPU it is compared with the reference (the sparse-attention tolerance: outputs within a couple of bf16
ulps, lse 1e-4) and with the Triton dense kernel, for full lists, key splits, masked heads, -1 and short lists,
empty lists and an 8,192-entry HCA list.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import triton
from test_sparse_attention import SCALE, assert_close_bf16, make_pages, make_q  # same folder (pytest prepends it)

from dsv4.kernels.attention import sparse_attention_reference, sparse_attention_triton
from dsv4.kernels.attention._gluon_dense_attention import HAVE_GLUON
from dsv4.kernels.attention.sparse_attention import gluon_dense_supported

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _caches(T: int, k_pool: int, gen: torch.Generator, device, pool_pages: int = 64):
    win, _ = make_pages(T, 128, gen, device)
    pool, _ = make_pages(pool_pages, 64, gen, device)
    widx = torch.arange(T * 128, dtype=torch.int32).view(T, 128).to(device)
    widx[0, 100:] = -1  # a partly filled ring
    pidx = torch.randint(0, pool.num_slots, (T, k_pool), generator=gen).int().to(device)
    if T > 1:
        pidx[-1, k_pool // 3 :] = -1  # fewer visible entries than k
    return [(win, widx), (pool, pidx)]


def test_gluon_dense_refused_where_it_cannot_run():
    gen = torch.Generator().manual_seed(3)
    q = make_q(2, 16, gen)
    caches = _caches(2, 64, gen, "cpu", pool_pages=4)
    sink = torch.zeros(16)
    assert not gluon_dense_supported(q, q.shape[-1])
    with pytest.raises(ValueError, match="sm_90"):
        sparse_attention_triton(q, caches, sink, SCALE, path="gathered", dense="gluon")
    with pytest.raises(ValueError, match="dense"):
        sparse_attention_triton(q, caches, sink, SCALE, dense="cutlass")


def test_auto_rule_picks_gluon_only_for_long_lists(monkeypatch):
    """``dense="auto"``: the Gluon kernel where it runs and each program attends >= GLUON_MIN_KEYS keys after the
    Triton launch's key split (132 SMs assumed off CUDA), never over a partial 32-key block or after a failed build."""
    sa = sys.modules["dsv4.kernels.attention.sparse_attention"]
    monkeypatch.setattr(sa, "gluon_dense_supported", lambda q, head_dim: True)
    monkeypatch.setattr(sa, "_GLUON_BUILDS", {})
    q64, q1 = torch.empty(64, 128, 512), torch.empty(1, 128, 512)
    assert sa._auto_gluon(q64, 512, 1152, 2, 64)  # 128 programs: no split, 1,152 keys each
    assert not sa._auto_gluon(q1, 512, 1152, 2, 64)  # 2 programs: split into lists of ~128 keys
    assert not sa._auto_gluon(q64, 512, 1168, 2, 16)  # columns padded to 16: a partial 32-key block
    sa._GLUON_BUILDS[q64.device.index] = False
    assert not sa._auto_gluon(q64, 512, 1152, 2, 64)  # the kernel did not build on this device


@pytest.mark.skipif(not (HAVE_GLUON and os.path.exists(PTXAS)), reason="triton without Gluon's Hopper module / ptxas")
def test_gluon_dense_compiles_for_sm90(sass_report):
    """A fresh process compiles the gathered path with the Gluon dense kernel for sm_90 (no GPU needed): no
    spills, and ptxas kept the wgmma groups asynchronous (a serialised chain puts one wait after every HGMMA)."""
    out = sass_report("attention:v4-flash:2", "--tune", "attention:dense=gluon")
    m = re.search(r"_dense_attn_ws_kernel\s+regs\s+(\d+)\s+stack\s+(\d+) B.*local\s+(\d+) B", out)
    assert m, out
    assert int(m[2]) == 0 and int(m[3]) == 0, out  # no stack frame, no spills
    w = re.search(r"_dense_attn_ws_kernel.*\n.*wgmma (\d+), waits (\d+)", out)
    assert w, out
    assert int(w[1]) >= 34 and int(w[2]) * 4 < int(w[1]), out


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not (on_sm90 and HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize(
    "T,H,k_pool,splits",
    [
        (4, 64, 512, None),  # V4-Flash top-k
        (2, 128, 1024, None),  # V4-Pro top-k, two head blocks
        (1, 128, 1024, None),  # one row: the host splits the keys (partial states + combine)
        (3, 16, 200, 1),  # fewer heads than a block (masked rows); lists not a multiple of the block
        (2, 128, 8192, 4),  # an HCA-length list, forced split
        (2, 64, 0, None),  # no pool entries: the window only
    ],
)
def test_gluon_dense_matches_reference_gpu(T, H, k_pool, splits):
    gen = torch.Generator().manual_seed(21)
    caches = _caches(T, k_pool, gen, "cuda", pool_pages=160)
    sink = torch.randn(H, generator=gen).cuda()
    q = make_q(T, H, gen, "cuda")
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, num_splits=splits, path="gathered", dense="gluon")
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)
    o_tri, l_tri = sparse_attention_triton(q, caches, sink, SCALE, num_splits=splits, path="gathered")
    assert_close_bf16(out, o_tri)
    torch.testing.assert_close(lse, l_tri, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not (on_sm90 and HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")
def test_gluon_dense_sink_only_and_empty_lists_gpu():
    """Every index -1: the output is 0 and the lse is the sink (for every head), as in the reference."""
    gen = torch.Generator().manual_seed(22)
    caches = _caches(2, 64, gen, "cuda")
    caches = [(p, torch.full_like(idx, -1)) for p, idx in caches]
    sink = torch.randn(64, generator=gen).cuda()
    q = make_q(2, 64, gen, "cuda")
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, path="gathered", dense="gluon")
    assert torch.count_nonzero(out) == 0
    torch.testing.assert_close(lse, sink[None, :].expand(2, 64), atol=1e-6, rtol=0)
