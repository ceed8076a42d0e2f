"""The warp-specialised Gluon indexer-scores kernel (``_gluon_scores``; impl="auto"'s choice on sm_90).

CPU: the query preparation is exact where it says so, a torch model of the kernel's arithmetic (e4m3 re-encoding of
the e2m1 codes, four exact block dots, the block-scale combine, ReLU, weighted head sum, the scale words' 0 sentinel)
matches the reference, and the kernel compiles for sm_90 without spills or a serialised wgmma chain.  GPU (sm_90):
the kernel against the reference (partly visible rows, pages outside the pool, 64 / 128 / 256-entry pages, programs
whose rings wrap, queries on the scale-a-block path), also as ``indexer_scores``' default.  The fold variant
(``fold=True``, ``impl="gluon_fold"``): its word conversion's PTX (modelled bit for bit) and a torch model of its
arithmetic on the CPU; on sm_90 against the reference within the FP8 accumulation's bound.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
import triton
from test_indexer_scores import assert_scores_close, make_keys, make_query  # same folder

from dsv4.formats import MXFP4KeyFormat, e2m1_decode
from dsv4.kernels.indexer import indexer_scores_reference
from dsv4.kernels.indexer import scores as scores_mod
from dsv4.kernels.indexer._gluon_scores import CODE_SCALE_LOG2, HAVE_GLUON, QBLOCK, _prep_query

FMT = MXFP4KeyFormat()
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
on_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _problem(T, H, bs, pages, n, gen, nv=None):
    kp = make_keys(pages, bs, random_bytes=True, gen=gen)
    q, w = make_query(T, H, gen)
    per_row = -(-n // bs)
    bt = torch.stack([torch.randperm(pages, generator=gen)[:per_row] for _ in range(T)]).int()
    tr = torch.arange(T, dtype=torch.int32)
    nv = torch.full((T,), n, dtype=torch.int32) if nv is None else nv
    return kp, q, w, bt, tr, nv


def _model(q, w, kp, bt, tr, nv, n):
    """The kernel's arithmetic in torch (fp32; every product of two e4m3 values is exact, as on the tensor core)."""
    q8, wq, exact = _prep_query(q, w)
    assert bool(exact.all())
    bs = kp.entries_per_page
    T = q.shape[0]
    out = torch.full((T, n), float("-inf"))
    j = torch.arange(n)
    for t in range(T):
        page = bt[int(tr[t])].long()[j // bs]
        ok = (j < int(nv[t])) & (page >= 0) & (page < kp.data.shape[0])
        pg = torch.where(ok, page, 0)
        packed = kp.data[pg, j % bs].int()  # [n, 64]
        lo = ((packed & 7) << 2) | ((packed & 8) << 4)
        hi = ((packed >> 2) & 0x1C) | (packed & 0x80)
        k8 = torch.stack([lo, hi], -1).reshape(n, 128).to(torch.uint8).view(torch.float8_e4m3fn).float()
        s = kp.scale[pg, j % bs].int()  # [n, 4]
        s0 = s.amax(-1)
        rel = torch.where(s - s0[:, None] + 127 >= 1, torch.exp2((s - s0[:, None]).float()), 0.0)
        acc = sum(
            (k8[:, b * QBLOCK : (b + 1) * QBLOCK] @ q8[t, :, b * QBLOCK : (b + 1) * QBLOCK].float().T) * rel[:, b, None]
            for b in range(4)
        )
        val = (torch.relu(acc) * wq[t][None, :]).sum(-1) * torch.exp2((s0 - 127).float())
        out[t] = torch.where(ok, val, float("-inf"))
    return out


def _ptx_words(w: int) -> tuple[int, int]:
    """``_e2m1_words_to_e4m3``'s PTX on one 32-bit word, in Python integers."""
    m = 0xFFFFFFFF
    zl, zh = (w << 2) & 0x3C3C3C3C, (w >> 2) & 0x3C3C3C3C
    src = [(zl >> 8 * i) & 0xFF for i in range(4)] + [(zh >> 8 * i) & 0xFF for i in range(4)]
    a = sum(src[(0x5140 >> 4 * i) & 15] << 8 * i for i in range(4))  # prmt.b32 a, zl, zh, 0x5140
    b = sum(src[(0x7362 >> 4 * i) & 15] << 8 * i for i in range(4))
    return ((a & 0x20202020) * 3 + a) & m, ((b & 0x20202020) * 3 + b) & m


def test_word_conversion_ptx_gives_e4m3_in_element_order():
    """Every byte value in every position of a word: the two output words are the e4m3 bytes (e2m1 value * 2**-6)
    of elements 8c .. 8c + 7 in order (low nibble first), as the Triton fp8mma kernel's re-encoding."""
    words = [v << (8 * i) | 0x5A5A5A5A & ~(0xFF << (8 * i)) for v in range(256) for i in range(4)]
    for w in words:
        codes = [(w >> (4 * k)) & 15 for k in range(8)]  # element k = nibble k (byte k // 2, low nibble first)
        e4 = [((c & 7) << 2) | ((c & 8) << 4) for c in codes]
        w0, w1 = _ptx_words(w)
        assert [(w0 >> 8 * i) & 0xFF for i in range(4)] + [(w1 >> 8 * i) & 0xFF for i in range(4)] == e4, hex(w)
    v = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.uint8) << 2  # codes 0-7 -> e4m3 bytes: value * 2**-6
    torch.testing.assert_close(
        v.view(torch.float8_e4m3fn).float() * 64, torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6]), rtol=0, atol=0
    )


def _prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32`` (default mode): byte i = byte (c >> 4 i) & 7 of {b, a}, or its sign bit replicated when
    selector bit 3 is set."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> 4 * i) & 15
        byte = src[sel & 7]
        out |= ((0xFF if byte & 0x80 else 0) if sel & 8 else byte) << 8 * i
    return out


def _fold_ptx_words(w: int, lo: int, hi: int) -> tuple[int, int]:
    """``_fold_words``' PTX on one word, in Python integers (lop3 0xF8 = a | (b & c))."""
    y = (w << 4) & 0xFFFFFFFF
    out = []
    for x, sign_sel in ((w, 0x9D8C), (w >> 16, 0xBFAE)):
        m = _prmt(lo, hi, x & 0x7777)
        out.append(m | (_prmt(w, y, sign_sel) & 0x80808080))
    return out[0], out[1]


def _fold_tables(d: int) -> tuple[int, int]:
    """The producer's tables for a block d binades below its key's largest (0 past ``_FOLD_MAX_D``: flushed)."""
    if d > scores_mod._FOLD_MAX_D:
        return 0, 0
    b = scores_mod._FOLD_B0 - (d << 3)
    return scores_mod._FOLD_LO_OFF + b * 0x01010100, scores_mod._FOLD_HI_OFF + b * 0x01010101


def test_fold_word_conversion_ptx_gives_scaled_e4m3_in_element_order():
    """Every byte value in every position of a word, every shift d: the output words are the e4m3 bytes of e2m1
    value * 2**(6 - d) of elements 8c .. 8c + 7 in order (exact up to d = 11); past that every magnitude is 0."""
    words = [v << (8 * i) | 0x5A5A5A5A & ~(0xFF << (8 * i)) for v in range(256) for i in range(4)]
    for d in range(scores_mod._FOLD_MAX_D + 3):
        lo, hi = _fold_tables(d)
        for w in words[::7] if d else words:
            codes = torch.tensor([(w >> (4 * k)) & 15 for k in range(8)], dtype=torch.uint8)
            val = e2m1_decode(codes) * 2.0 ** (6 - d) if d <= scores_mod._FOLD_MAX_D else e2m1_decode(codes) * 0.0
            w0, w1 = _fold_ptx_words(w, lo, hi)
            got = torch.tensor([(x >> 8 * i) & 0xFF for x in (w0, w1) for i in range(4)], dtype=torch.uint8)
            torch.testing.assert_close(got.view(torch.float8_e4m3fn).float(), val, rtol=0, atol=0)


def _fold_model(q, w, kp, bt, tr, nv, n):
    """The fold kernel's arithmetic in torch: keys v * 2**(6 - d_b) (0 past d = 11), one exact dot a key (the GPU's
    FP8 accumulation rounds it), ReLU, weights * 2**(e - 127 - 6), head sum, times 2**(s_max - 127)."""
    q8, wq, _ = _prep_query(q, w)
    wq = wq * 2.0 ** (-CODE_SCALE_LOG2 - scores_mod._FOLD_C)
    bs = kp.entries_per_page
    out = torch.full((q.shape[0], n), float("-inf"))
    j = torch.arange(n)
    for t in range(q.shape[0]):
        page = bt[int(tr[t])].long()[j // bs]
        ok = (j < int(nv[t])) & (page >= 0) & (page < kp.data.shape[0])
        pg = torch.where(ok, page, 0)
        packed = kp.data[pg, j % bs]  # [n, 64]
        codes = torch.stack([packed & 15, packed >> 4], -1).reshape(n, 128)
        s = kp.scale[pg, j % bs].int()  # [n, 4]
        s0 = s.amax(-1)
        d = (s0[:, None] - s).repeat_interleave(QBLOCK, -1)
        k = torch.where(d <= scores_mod._FOLD_MAX_D, e2m1_decode(codes).double() * torch.exp2(6.0 - d), 0.0)
        acc = (k @ q8[t].double().T).float()
        val = (torch.relu(acc) * wq[t][None, :]).sum(-1) * torch.exp2((s0 - 127).float())
        out[t] = torch.where(ok & (s0 > 0), val, float("-inf"))
    return out


def test_fold_model_matches_reference_and_flushes_far_blocks():
    """Quantised keys (blocks a few binades apart): the fold arithmetic is the reference's.  A key whose block 1
    sits 14 binades below its largest: scored as if that block were zero."""
    gen = torch.Generator().manual_seed(12)
    kp = make_keys(8, 64, gen=gen)  # quantised keys (random scale bytes would flush many blocks)
    q, w = make_query(2, 64, gen)
    bt = torch.stack([torch.randperm(8, generator=gen)[:4] for _ in range(2)]).int()
    tr, nv = torch.arange(2, dtype=torch.int32), torch.tensor([256, 100], dtype=torch.int32)
    ref = indexer_scores_reference(q, w, kp, bt, tr, nv, 256)
    assert_scores_close(_fold_model(q, w, kp, bt, tr, nv, 256), ref)
    page, row = int(bt[0, 0]), 3
    kp.scale[page, row] = torch.tensor([130, 116, 129, 128], dtype=torch.uint8)
    got = _fold_model(q, w, kp, bt, tr, nv, 256)
    kp.data[page, row, 16:32] = 0  # block 1 (elements 32..63 = bytes 16..31) zeroed
    assert_scores_close(got, indexer_scores_reference(q, w, kp, bt, tr, nv, 256))


def test_prep_query_is_exact_and_scaled():
    gen = torch.Generator().manual_seed(1)
    q, w = make_query(3, 64, gen)
    q8, wq, exact = _prep_query(q, w)
    assert bool(exact.all())
    e = (q.float().abs().amax(-1).view(torch.int32) >> 23) & 255
    torch.testing.assert_close(q8.float() * torch.exp2((e - 127).float())[..., None], q.float(), rtol=0, atol=0)
    torch.testing.assert_close(wq, w * torch.exp2((e - 127).float() + CODE_SCALE_LOG2), rtol=0, atol=0)
    q[1, 5, 0] = 2.0**-20  # 2**-20 next to O(1) values of the same head: below e4m3's range at that scale
    assert not bool(_prep_query(q, w)[2][1])


@pytest.mark.parametrize("bs,n,nv", [(64, 256, None), (16, 200, [200, 37]), (64, 130, [0, 129])])
def test_kernel_model_matches_reference(bs, n, nv):
    gen = torch.Generator().manual_seed(2)
    T = 2
    nv_t = None if nv is None else torch.tensor(nv, dtype=torch.int32)
    kp, q, w, bt, tr, nv_t = _problem(T, 64, bs, 16, n, gen, nv_t)
    bt[0, 1] = -1  # a page outside the table: -inf
    ref = indexer_scores_reference(q, w, kp, bt, tr, nv_t, n)
    assert_scores_close(_model(q, w, kp, bt, tr, nv_t, n), ref)


def test_gluon_entry_point_refuses_bad_arguments():
    """indexer_scores_gluon: indexer_scores' argument checks, its own knobs, then the device rule (CPU here)."""
    from dsv4.kernels.indexer._gluon_scores import indexer_scores_gluon

    kp, q, w, bt, tr, nv = _problem(2, 64, 64, 8, 256, torch.Generator().manual_seed(5), None)
    with pytest.raises(ValueError, match="weights"):
        indexer_scores_gluon(q, w.bfloat16(), kp, bt, tr, nv, 256)
    with pytest.raises(ValueError, match="keys.scale"):
        indexer_scores_gluon(q, w, type(kp)(kp.data, kp.scale[..., :2]), bt, tr, nv, 256)
    with pytest.raises(ValueError, match="stages: expected a power of two, got 3"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, stages=3)
    with pytest.raises(ValueError, match="tiles: expected an int >= 1, got 0"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, tiles=0)
    with pytest.raises(ValueError, match="fold: expected a bool, got 'yes'"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, fold="yes")
    with pytest.raises(ValueError, match="hsum: expected a bool, True only with fold=True"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, hsum=True)
    with pytest.raises(ValueError, match="hsum: no ablations"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, fold=True, hsum=True, ablate=2)
    with pytest.raises(ValueError, match=r"ablate: expected bits of ABLATE_\* \(0-7\), got 8"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, ablate=8)
    with pytest.raises(ValueError, match="producers: expected 1 or 2, got 3"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, producers=3)
    with pytest.raises(ValueError, match="two producers need stages and raw >= 2, got 1, None"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, stages=1, raw=None, producers=2)
    with pytest.raises(ValueError, match=r"regs: expected \(consumer, producer\) multiples of 8"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, regs=(176, 50))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256)
    with pytest.raises(ValueError, match="needs a CUDA device"):  # None: the default depths
        indexer_scores_gluon(q, w, kp, bt, tr, nv, 256, stages=None, raw=None, producers=2)


def test_programs_per_row_fills_the_sms():
    """The grid's programs a row: one wave where the rows' tiles fit it, and never more tiles a program than the
    modelled cost needs (132 SMs: an H200)."""
    from dsv4.kernels.indexer._gluon_scores import programs_per_row

    assert programs_per_row(4, 2048, 132) == 33  # 132 programs of 62 tiles
    assert programs_per_row(64, 2048, 132) == 2  # 128 programs of 1,024 (2 * 64 = 128 <= 132: one wave)
    assert programs_per_row(1, 16, 132) == 16  # one tile a program
    assert programs_per_row(4096, 4, 132) == 1  # prefill rows: a program a row
    g = programs_per_row(100, 2048, 132)  # 100 rows: one program a row would leave 32 SMs idle
    assert -(-100 * g // 132) * -(-2048 // g) < 2048


@pytest.mark.skipif(not (HAVE_GLUON and os.path.exists(PTXAS)), reason="triton without Gluon's Hopper module / ptxas")
@pytest.mark.parametrize(
    "case",
    ["indexer_gluon", "indexer_gluon_fold", "indexer_gluon_p1", "indexer_gluon_fold_p1", "indexer_gluon_fold_hsum"],
)
def test_gluon_indexer_compiles_for_sm90(sass_report, case):
    out = sass_report(f"{case}:4:65536")  # > 1 tile a program (tiles = 1 would be specialised away)
    m = re.search(r"_mxfp4_scores_ws_kernel\s+regs\s+(\d+)\s+stack\s+(\d+) B.*local\s+(\d+) B\s+warps (\d+)", out)
    assert m, out
    one = case.endswith("_p1")
    warps = 16 if one else 20  # 4 + 4 + 4 (+ 4: the default's second producer) + the loader (padded)
    # two producers: a few more words of stack (triton 3.9 passes partition arguments through local memory; no
    # local loads or stores inside the loops)
    assert int(m[2]) <= (16 if one else 32) and int(m[3]) == 0 and int(m[4]) == warps, out
    w = re.search(r"wgmma (\d+), waits (\d+)", out)  # ptxas serialises the chain on some code shapes (C7514)
    assert w and int(w[2]) < int(w[1]), out


@pytest.mark.gpu
@pytest.mark.skipif(not (on_sm90 and HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize(
    "bs,n,nv,tiles,knobs",
    [
        (64, 4096, None, None, {}),
        (64, 4096, None, 13, {}),
        (64, 1000, [1000, 377, 0], None, {}),
        (128, 513, [513, 500, 1], 2, {}),
        (256, 1100, [1100, 300, 129], 3, {}),
        (64, 16384, [700, 16384, 5], None, {}),
        (128, 8192, [130, 0, 8000], 4, {}),
        (64, 4096, None, 13, {"producers": 1}),
        (64, 1000, [1000, 377, 0], None, {"producers": 1}),
        (128, 8192, [130, 0, 8000], 5, {"producers": 1}),
    ],
)
def test_gluon_indexer_matches_reference_gpu(bs, n, nv, tiles, knobs):
    """tiles = 13: 3 programs a row of 11, 11 and 10 strided tiles (the raw ring and the stages wrap several
    times); bs = 64: two pages a 128-entry tile, 128: one, 256: half a page.  Rows far shorter than max_entries
    (an engine's static block tables): their live tiles are spread over the row's programs, the rest is -inf.
    The default takes two producer warpgroups (alternate tiles: odd and even live-tile counts a program); some
    cases also with one."""
    from dsv4.kernels.indexer._gluon_scores import indexer_scores_gluon

    gen = torch.Generator().manual_seed(3)
    T = 3
    nv_t = None if nv is None else torch.tensor(nv, dtype=torch.int32)
    kp, q, w, bt, tr, nv_t = _problem(T, 64, bs, 200, n, gen, nv_t)
    bt[1, 2] = 1 << 20  # a page outside the pool inside the visible range: -inf, never read
    ref = indexer_scores_reference(q, w, kp, bt, tr, nv_t, n)
    dev = [x.cuda() for x in (q, w, bt, tr, nv_t)]
    kp_d = type(kp)(kp.data.cuda(), kp.scale.cuda())
    out = indexer_scores_gluon(dev[0], dev[1], kp_d, dev[2], dev[3], dev[4], n, tiles=tiles, **knobs)
    assert_scores_close(out.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not (on_sm90 and HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")
def test_gluon_indexer_scale_a_block_query_gpu():
    """A head whose values span more binades than e4m3 holds under one scale (an MXFP4 query: the small value in
    another 32-block): that row takes the kernel's scale-a-block path, the other rows the one-scale path; both
    exact, also through ``indexer_scores(impl="gluon")`` (no fall-back)."""
    from dsv4.kernels.indexer import indexer_scores
    from dsv4.kernels.indexer import scores as scores_mod
    from dsv4.kernels.indexer._gluon_scores import indexer_scores_gluon

    gen = torch.Generator().manual_seed(4)
    kp, q, w, bt, tr, nv_t = _problem(3, 64, 64, 20, 256, gen, None)
    q[1, 5] = 0.0
    q[1, 5, 0] = 2.0**10
    q[1, 5, 32] = 2.0**-10 * 1.5  # 1.5 * 2**-20 under the head's one scale: below e4m3's smallest subnormal
    q[2] *= torch.tensor([2.0**-30, 1.0, 2.0**17, 2.0**-5]).repeat_interleave(32)  # every head of row 2
    assert not bool(_prep_query(q, w)[2][1]) and not bool(_prep_query(q, w)[2][2]) and bool(_prep_query(q, w)[2][0])
    dev = [x.cuda() for x in (q, w, bt, tr, nv_t)]
    kp_d = type(kp)(kp.data.cuda(), kp.scale.cuda())
    ref = indexer_scores_reference(q, w, kp, bt, tr, nv_t, 256)
    assert_scores_close(indexer_scores_gluon(dev[0], dev[1], kp_d, dev[2], dev[3], dev[4], 256).cpu(), ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fall-back
        out = indexer_scores(dev[0], dev[1], kp_d, dev[2], dev[3], dev[4], 256, impl="gluon")
        assert_scores_close(out.cpu(), ref)
        out = indexer_scores(dev[0], dev[1], kp_d, dev[2], dev[3], dev[4], 256)  # auto: built -> fp8mma eagerly
    assert scores_mod._GLUON_STATE[torch.cuda.current_device()] is True
    assert_scores_close(out.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not (on_sm90 and HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize("producers", [1, 2])
@pytest.mark.parametrize(
    "bs,n,nv,tiles", [(64, 4096, None, None), (64, 4096, None, 13), (128, 8192, [130, 0, 8000], 4)]
)
def test_gluon_fold_matches_reference_gpu(bs, n, nv, tiles, producers):
    """The fold variant (quantised keys: no block is flushed), odd and even live-tile counts a program (its
    consumers take tiles in pairs), and a row on the scale-a-block path, against the reference: within 1e-3 of
    the row's largest |score| (Hopper's FP8 wgmma accumulates a K = 128 chain in reduced precision; the
    reference's own scores are bf16, ~4e-3 relative), and against the torch model of the same arithmetic."""
    from dsv4.kernels.indexer import indexer_scores
    from dsv4.kernels.indexer._gluon_scores import indexer_scores_gluon

    gen = torch.Generator().manual_seed(14)
    T = 3
    nv_t = None if nv is None else torch.tensor(nv, dtype=torch.int32)
    pages = 200
    kp = make_keys(pages, bs, gen=gen)
    q, w = make_query(T, 64, gen)
    q[2] *= torch.tensor([2.0**-30, 1.0, 2.0**17, 2.0**-5]).repeat_interleave(32)  # scale-a-block row
    per_row = -(-n // bs)
    bt = torch.stack([torch.randperm(pages, generator=gen)[:per_row] for _ in range(T)]).int()
    tr = torch.arange(T, dtype=torch.int32)
    nv_t = torch.full((T,), n, dtype=torch.int32) if nv_t is None else nv_t
    ref = indexer_scores_reference(q, w, kp, bt, tr, nv_t, n)
    dev = [x.cuda() for x in (q, w, bt, tr, nv_t)]
    kp_d = type(kp)(kp.data.cuda(), kp.scale.cuda())
    out = indexer_scores_gluon(
        dev[0], dev[1], kp_d, dev[2], dev[3], dev[4], n, tiles=tiles, fold=True, producers=producers
    ).cpu()
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    scale = ref.where(fin, 0.0).abs().amax(-1, keepdim=True).expand_as(ref)[fin]
    assert ((out[fin] - ref[fin]).abs() <= 1e-3 * scale + 1e-6).all()
    model = _fold_model(q[:2], w[:2], kp, bt, tr[:2], nv_t[:2], n)  # the one-scale rows
    fin2 = torch.isfinite(model)
    assert ((out[:2][fin2] - model[fin2]).abs() <= 1e-3 * model[fin2].abs().max()).all()
    got = indexer_scores(dev[0], dev[1], kp_d, dev[2], dev[3], dev[4], n, impl="gluon_fold").cpu()
    assert torch.equal(got.isneginf(), out.isneginf())


@pytest.mark.gpu
@pytest.mark.skipif(not (on_sm90 and HAVE_GLUON), reason="needs an sm_90 GPU and Gluon")
@pytest.mark.parametrize(
    "bs,n,nv,tiles", [(64, 4096, None, None), (64, 4096, None, 13), (128, 8192, [130, 0, 8000], 4)]
)
def test_gluon_fold_hsum_matches_reference_gpu(bs, n, nv, tiles):
    """The fold variant with the head sum on the tensor core (``hsum=True``): odd and even live-tile counts a
    program, a row on the scale-a-block path (which keeps the fp32 epilogue), against the reference within fold's
    bound plus the bf16 rounding of each ReLU'd logit, 2**-8 · Σ_h |w_h| ReLU(logit_h) an entry (the weights' hi + lo
    parts hold them to ~16 bits; the MMA's sum is fp32); the largest error relative to that term is printed."""
    from dsv4.kernels.indexer._gluon_scores import indexer_scores_gluon

    gen = torch.Generator().manual_seed(15)
    T, pages = 3, 200
    kp = make_keys(pages, bs, gen=gen)
    q, w = make_query(T, 64, gen)
    q[2] *= torch.tensor([2.0**-30, 1.0, 2.0**17, 2.0**-5]).repeat_interleave(32)  # scale-a-block row
    bt = torch.stack([torch.randperm(pages, generator=gen)[: -(-n // bs)] for _ in range(T)]).int()
    tr = torch.arange(T, dtype=torch.int32)
    nv_t = torch.full((T,), n, dtype=torch.int32) if nv is None else torch.tensor(nv, dtype=torch.int32)
    ref = indexer_scores_reference(q, w, kp, bt, tr, nv_t, n)
    mag = indexer_scores_reference(q, w.abs(), kp, bt, tr, nv_t, n)  # Σ_h |w_h| ReLU(logit_h)
    dev = [x.cuda() for x in (q, w, bt, tr, nv_t)]
    kp_d = type(kp)(kp.data.cuda(), kp.scale.cuda())
    out = indexer_scores_gluon(dev[0], dev[1], kp_d, dev[2], dev[3], dev[4], n, tiles=tiles, fold=True, hsum=True).cpu()
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    scale = ref.where(fin, 0.0).abs().amax(-1, keepdim=True).expand_as(ref)[fin]
    err = (out[fin] - ref[fin]).abs()
    assert (err <= 1e-3 * scale + 2.0**-8 * mag[fin] + 1e-6).all()
    rel_term, rel_row = (err / mag[fin].clamp(min=1e-30)).max(), (err / scale).max()
    print(f"hsum: max error / Σ|w|ReLU {rel_term:.2e}, / row max {rel_row:.2e}")
