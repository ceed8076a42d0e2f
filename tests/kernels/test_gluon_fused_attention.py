"""The fused Gluon attention kernel (``path="gluon_fused"``, ``_gluon_fused_attention``), the default on sm_90.

On a CPU machine (Gluon kernels do not run under ``TRITON_INTERPRET``): the option is refused where it cannot run,
the default-path rule (``selected_path`` / ``path=None``) picks it only where it can run and no Triton knob is
given, a failed build falls back to the gathered path with a warning, the cache views it cannot copy are refused,
its int64 view of the scale bytes holds the right bytes, the PyTorch model of the integer dequantisation matches
the format for every code and scale byte, and the kernel compiles for sm_90 (ptxas, through
``benchmarks/sass_report.py``) with its wgmma chain not serialised.  On an sm_90 GPU it is compared with the
reference (the sparse-attention tolerance: outputs within a couple of bf16 ulps, lse 1e-4) for full lists, key
splits, masked heads, -1 and short lists, empty lists, one cache, an 8,192-entry HCA list and a prefill chunk (odd
block counts: the pad block of the consumers' pairs); every e4m3 code is read back exactly through each
dequantisation form; and the whole path is taken by default.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

import pytest
import torch
import triton
from test_gluon_dense_attention import _caches  # same folder (pytest prepends it)
from test_sparse_attention import FMT, SCALE, assert_close_bf16, make_pages, make_q

from dsv4.formats.fp8_entry import EntryPages
from dsv4.formats.ue8m0 import byte_to_scale
from dsv4.kernels.attention import sparse_attention_reference, sparse_attention_triton
from dsv4.kernels.attention._gluon_dense_attention import HAVE_GLUON
from dsv4.kernels.attention._gluon_fused_attention import e4m3_to_bf16_bits
from dsv4.kernels.attention.sparse_attention import DEFAULT_PATH, selected_path

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
SA = sys.modules["dsv4.kernels.attention.sparse_attention"]


def _shifted(pages: EntryPages) -> EntryPages:
    """The same pages' views 8 bytes further into a copy of their buffer: the V4 geometry, rows not 16-byte aligned."""
    bs = pages.nope.shape[1]
    flat = torch.zeros(pages.nope.shape[0] * FMT.page_bytes(bs) + 16, dtype=torch.uint8)
    return FMT.entry_pages(flat[8:], pages.nope.shape[0], bs)


def test_gluon_fused_refused_where_it_cannot_run():
    gen = torch.Generator().manual_seed(3)
    q = make_q(2, 16, gen)
    caches = _caches(2, 64, gen, "cpu", pool_pages=4)
    with pytest.raises(ValueError, match="sm_90"):
        sparse_attention_triton(q, caches, torch.zeros(16), SCALE, path="gluon_fused")
    assert selected_path(q, caches) == DEFAULT_PATH


def test_default_path_rule(monkeypatch):
    """``path=None``: the fused Gluon kernel where it can run (pretended here), not with > 2 caches, not over views
    it cannot copy, not after a failed build on the device."""
    monkeypatch.setattr(SA, "gluon_dense_supported", lambda q, head_dim: True)
    monkeypatch.setattr(SA, "_GLUON_FUSED_BUILDS", {})
    gen = torch.Generator().manual_seed(4)
    q = make_q(2, 16, gen)
    caches = _caches(2, 64, gen, "cpu", pool_pages=4)
    assert selected_path(q, caches) == "gluon_fused"
    assert selected_path(q, caches[1:]) == "gluon_fused"
    assert selected_path(q, caches + caches[1:]) == DEFAULT_PATH  # three caches
    win, idx = caches[0]
    assert selected_path(q, [(_shifted(win), idx)]) == DEFAULT_PATH  # rows off their 16-byte alignment
    narrow = EntryPages(win.nope[:, :, 64:], win.rope, win.scale[:, :, 1:])  # 6 FP8 tiles: not the V4 geometry
    assert selected_path(q, [(narrow, idx)]) == DEFAULT_PATH
    SA._GLUON_FUSED_BUILDS[q.device.index] = False
    assert selected_path(q, caches) == DEFAULT_PATH


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton paths on CPU tensors (the interpreter)")
def test_triton_knobs_and_failed_build_take_the_triton_paths(monkeypatch):
    """A Triton knob (block_n, ...) keeps ``path=None`` on the Triton paths; a first build failure warns once and
    the call (and the next ones) run the gathered path, with the reference's result."""
    monkeypatch.setattr(SA, "gluon_dense_supported", lambda q, head_dim: True)
    monkeypatch.setattr(SA, "_GLUON_FUSED_BUILDS", {})
    monkeypatch.setattr(SA, "_GLUON_BUILDS", {None: False})  # keep the gathered path's dense launch on Triton
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no Gluon here")

    monkeypatch.setattr(SA, "_fused_gluon", broken)
    gen = torch.Generator().manual_seed(5)
    q = make_q(2, 8, gen)
    caches = _caches(2, 32, gen, "cpu", pool_pages=2)
    sink = torch.randn(8, generator=gen)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    out, _ = sparse_attention_triton(q, caches, sink, SCALE, block_n=32)
    assert not calls  # a Triton knob: the fused Gluon kernel is not tried
    assert_close_bf16(out, o_ref)
    with pytest.warns(UserWarning, match="fused Gluon attention kernel unavailable"):
        out, lse = sparse_attention_triton(q, caches, sink, SCALE)
    assert calls == [1] and SA._GLUON_FUSED_BUILDS[q.device.index] is False
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sparse_attention_triton(q, caches, sink, SCALE)  # no second warning, no second attempt
    assert calls == [1]


def test_scale_words_hold_the_scale_bytes_and_refuse_unaligned_views():
    gen = torch.Generator().manual_seed(6)
    pages, _ = make_pages(3, 16, gen)
    words = SA._scale_words(pages)
    assert words.dtype == torch.int64 and words.shape == (3, 16, 1)
    for t in range(FMT.n_tiles):
        assert torch.equal(((words[..., 0] >> (8 * t)) & 0xFF).to(torch.uint8), pages.scale[..., t])
    with pytest.raises(ValueError, match="16-byte aligned"):
        SA._scale_words(_shifted(pages))


def test_integer_dequantisation_model_matches_the_format():
    """The integer dequantisation (``DEQ=2``; ``e4m3_to_bf16_bits`` models its bit moves and bf16 multiplies) gives
    the format's ``dequantize`` bytes for every e4m3 code and every UE8M0 byte (subnormal results, byte 0's 2**-127
    and the overflow of byte 255 included), except the two NaN codes (read as +-480 times the scale)."""
    codes = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 256)
    sbytes = torch.arange(256, dtype=torch.uint8)[None, :].expand(256, 256)
    got = e4m3_to_bf16_bits(codes, sbytes)
    ref = (codes.view(torch.float8_e4m3fn).float() * byte_to_scale(sbytes)).to(torch.bfloat16)
    nan_code = (codes & 0x7F) == 0x7F
    same = got.view(torch.int16) == ref.view(torch.int16)
    assert same[~nan_code].all(), codes[~same & ~nan_code][:8]
    assert torch.equal(got[nan_code & (sbytes == 127)].float().abs(), torch.full((2,), 480.0))
    # the format's own dequantisation (the reference attention reads through it) agrees on an entry's tiles
    nope = torch.arange(448, dtype=torch.int32).remainder(256).to(torch.uint8)
    nope = torch.where((nope & 0x7F) == 0x7F, 0, nope)
    sc = torch.tensor([0, 1, 60, 127, 134, 200, 246], dtype=torch.uint8)
    whole = FMT.dequantize(nope.view(torch.float8_e4m3fn), torch.zeros(64, dtype=torch.bfloat16), sc)
    model = e4m3_to_bf16_bits(nope.view(7, 64), sc[:, None]).flatten()
    assert torch.equal(whole[:448].view(torch.int16), model.view(torch.int16))


@pytest.mark.skipif(not (HAVE_GLUON and os.path.exists(PTXAS)), reason="triton without Gluon's Hopper module / ptxas")
def test_gluon_fused_compiles_for_sm90(sass_report):
    """A fresh process compiles the fused Gluon kernel for sm_90 (no GPU needed): 16 warps, at most a few spilled
    words (a 64-byte stack: triton 3.6 leaves 8 B, 3.9 40 B, in partition prologues and the W = 0 consumer, whose
    208 registers are tight), and ptxas kept the wgmma groups asynchronous."""
    out = sass_report("attention:v4-flash:2", "--tune", "attention:path=gluon_fused")
    m = re.search(r"_sparse_attn_ws_kernel\s+regs\s+(\d+)\s+stack\s+(\d+) B.*local\s+(\d+) B\s+warps (\d+)", out)
    assert m, out
    assert int(m[2]) <= 64 and int(m[3]) == 0 and int(m[4]) == 16, out
    w = re.search(r"_sparse_attn_ws_kernel.*\n.*wgmma (\d+), waits (\d+)", out)
    assert w, out
    assert int(w[1]) >= 36 and int(w[2]) * 4 < int(w[1]), out


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not (on_sm90 and HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize(
    "T,H,k_pool,splits,one_cache",
    [
        (4, 64, 512, None, False),  # V4-Flash top-k
        (2, 128, 1024, None, False),  # V4-Pro top-k, two head blocks
        (1, 128, 1024, None, False),  # one row: the host splits the keys (partial states + combine)
        (3, 16, 200, 1, False),  # fewer heads than a block (masked rows); lists not a multiple of the block
        (2, 128, 8192, 4, False),  # an HCA-length list, forced split
        (2, 64, 0, None, False),  # no pool entries: the window only
        (2, 64, 300, None, True),  # one cache
        (96, 64, 512, None, False),  # a prefill chunk: every row its own lists
    ],
)
@pytest.mark.parametrize("lazy", [0, 8])  # the consumers' frame moved in every pair / only on growth past 2**8
def test_gluon_fused_matches_reference_gpu(T, H, k_pool, splits, one_cache, lazy, monkeypatch):
    monkeypatch.setattr(SA, "GLUON_FUSED_LAZY", lazy)
    gen = torch.Generator().manual_seed(23)
    caches = _caches(T, k_pool, gen, "cuda", pool_pages=160)
    if one_cache:
        caches = caches[1:]
    sink = torch.randn(H, generator=gen).cuda()
    q = make_q(T, H, gen, "cuda")
    out, lse = sparse_attention_triton(q, caches, sink, SCALE, num_splits=splits, path="gluon_fused")
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not (on_sm90 and HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("deq", [0, 2])
def test_gluon_fused_dequantises_every_code_exactly_gpu(deq, monkeypatch):
    """Each row attends one entry with a zero query and no sink weight, so its output is the entry's bf16 value as
    the producers wrote it to shared memory: every e4m3 code but the NaNs under every UE8M0 byte that cannot
    overflow (0-246), compared exactly with the format's ``dequantize``."""
    monkeypatch.setattr(SA, "GLUON_FUSED_DEQUANT", deq)
    n_tiles, tile = FMT.n_tiles, FMT.tile
    E = -(-247 * 4 // n_tiles)  # tiles cycle through 4 code quarters x 247 scale bytes
    tid = torch.arange(E * n_tiles).view(E, n_tiles)
    codes = ((tid % 4)[..., None] * tile + torch.arange(tile)).remainder(256).to(torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN codes
    sbytes = (tid // 4).remainder(247).to(torch.uint8)
    gen = torch.Generator().manual_seed(25)
    pages, _ = make_pages(-(-E // 64), 64, gen, "cuda")
    page, row = torch.arange(E).cuda() // 64, torch.arange(E).cuda() % 64
    pages.nope.view(torch.uint8)[page, row] = codes.flatten(1).cuda()
    pages.scale[page, row] = sbytes.cuda()
    ref = FMT.dequantize(pages.nope[page, row].cpu(), pages.rope[page, row].cpu(), sbytes)
    idx = torch.full((E, 64), -1, dtype=torch.int32)
    idx[:, 0] = torch.arange(E)
    q = torch.zeros(E, 64, FMT.head_dim, dtype=torch.bfloat16, device="cuda")
    sink = torch.full((64,), -1e30, device="cuda")
    out, _ = sparse_attention_triton(q, [(pages, idx.cuda())], sink, SCALE, path="gluon_fused")
    got = out.cpu()
    assert torch.equal(got, got[:, :1].expand_as(got)), "heads differ"
    same = got[:, 0] == ref  # values (the accumulator turns -0 into +0), subnormals included
    assert same.all(), f"{int((~same).sum())} values differ, first at (entry, dim) {(~same).nonzero()[0].tolist()}"


@pytest.mark.gpu
@pytest.mark.skipif(not (on_sm90 and HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")
def test_default_path_is_gluon_fused_gpu():
    """With no knobs the call takes the fused Gluon kernel on sm_90 (one launch, no gather), all -1 lists included."""
    gen = torch.Generator().manual_seed(24)
    caches = _caches(4, 512, gen, "cuda", pool_pages=64)
    sink = torch.randn(64, generator=gen).cuda()
    q = make_q(4, 64, gen, "cuda")
    assert selected_path(q, caches) == "gluon_fused"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse = sparse_attention_triton(q, caches, sink, SCALE)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert any("_sparse_attn_ws_kernel" in n for n in names) and not any("_gather_dequant" in n for n in names)
    o_ref, l_ref = sparse_attention_reference(q, caches, sink, SCALE)
    assert_close_bf16(out, o_ref)
    torch.testing.assert_close(lse, l_ref, atol=1e-4, rtol=1e-5)
    empty = [(p, torch.full_like(idx, -1)) for p, idx in caches]
    out, lse = sparse_attention_triton(q, empty, sink, SCALE)
    assert torch.count_nonzero(out) == 0
    torch.testing.assert_close(lse, sink[None, :].expand(4, 64), atol=1e-6, rtol=0)
