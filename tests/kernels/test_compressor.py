"""Compressor state ring + pooling + emit (dsv4/kernels/cache/compressor.py), both backends.

The oracle pools each entry from a request's whole history in one pass (no state logic); stepping
through the same history in chunks of any length must reproduce it.  Pooled values are fp32 softmax
sums: the kernel's exp/sum order differs from torch, so they agree to ~1e-6 relative (atol 1e-5 on
O(1) data), while the state rows are copies and must be bit-equal.
"""

import pytest
import torch

import dsv4.kernels.cache.compressor as compressor_module
from dsv4.engine.graphs import capture_graph
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat
from dsv4.kernels.cache.compressor import (
    compress_decode,
    compressor_step,
    emit_entries,
    entry_positions,
    online_state,
)
from dsv4.kernels.cache.compressor_prefill import compress_prefill

BACKENDS = ["torch", "triton"]
CONFIGS = {"csa": (4, True), "hca": (128, False)}


def oracle_pooled(kv_hist, sc_hist, ratio, overlap):
    """Entries of one request from its whole history [L, c*d]: entry i pools positions as in spec §3."""
    d = kv_hist.shape[1] // (2 if overlap else 1)
    out = []
    for i in range(kv_hist.shape[0] // ratio):
        b = slice(i * ratio, (i + 1) * ratio)
        kv, sc = kv_hist[b, d:] if overlap else kv_hist[b, :d], sc_hist[b, d:] if overlap else sc_hist[b, :d]
        if overlap and i > 0:
            a = slice((i - 1) * ratio, i * ratio)
            kv = torch.cat([kv_hist[a, :d], kv])
            sc = torch.cat([sc_hist[a, :d], sc])
        out.append((kv * sc.softmax(0)).sum(0))
    return torch.stack(out) if out else torch.zeros(0, d)


def fresh_state(n_slots, ratio, overlap, d, device, garbage=False):
    c = 2 if overlap else 1
    shape = (n_slots, c * ratio, c * d)
    if garbage:  # a reused slot that was never reset: finite junk everywhere
        return torch.randn(shape, device=device) * 5, torch.randn(shape, device=device)
    return torch.zeros(shape, device=device), torch.full(shape, float("-inf"), device=device)


def next_step(step, hist, slot_map, width, g):
    """One step of (request, n_tokens): its positions (each request continues its history), state slots, requests
    and random kv / score rows [T, width], which are appended to ``hist`` {request: ([kv...], [score...])}."""
    pos, slot, req = [], [], []
    for r, n in step:
        start = sum(x.shape[0] for x in hist[r][0])
        pos += list(range(start, start + n))
        slot += [slot_map[r]] * n
        req += [r] * n
    kv = torch.randn(len(pos), width, generator=g)
    sc = torch.randn(len(pos), width, generator=g) * 2
    off = 0
    for r, n in step:
        hist[r][0].append(kv[off : off + n])
        hist[r][1].append(sc[off : off + n])
        off += n
    return pos, slot, req, kv, sc


def drive(chunks, ratio, width, slot_map, seed, run_step, device):
    """chunks: list of steps, each a list of (request, n_tokens); ``run_step(step index, kv, score, positions,
    slots)`` (tensors on ``device``) runs one step and returns (pooled, emits).  Checks the emits; returns the pooled
    rows per (request, entry) and each request's history (kv, score) [L, width] on the CPU."""
    n_req = 1 + max(r for step in chunks for r, _ in step)
    g = torch.Generator().manual_seed(seed)
    hist = {r: ([], []) for r in range(n_req)}
    got = {}
    for si, step in enumerate(chunks):
        pos, slot, req, kv, sc = next_step(step, hist, slot_map, width, g)
        pos_t = torch.tensor(pos, dtype=torch.int32, device=device)
        slot_t = torch.tensor(slot, dtype=torch.int32, device=device)
        pooled, emits = run_step(si, kv.to(device), sc.to(device), pos_t, slot_t)
        assert torch.equal(emits.cpu(), (torch.tensor(pos) + 1) % ratio == 0)
        for i in emits.cpu().nonzero().squeeze(1).tolist():
            got[(req[i], pos[i] // ratio)] = pooled[i].cpu()
    return got, {r: (torch.cat(k), torch.cat(s)) for r, (k, s) in hist.items()}


def check_entries(got, r, kv_h, sc_h, ratio, overlap):
    """Request r's pooled rows in ``got`` are exactly its entries, each equal to the oracle's."""
    want = oracle_pooled(kv_h, sc_h, ratio, overlap)
    assert sorted(i for rr, i in got if rr == r) == list(range(want.shape[0]))
    for i in range(want.shape[0]):
        torch.testing.assert_close(got[(r, i)], want[i], atol=1e-5, rtol=1e-5)


def run_steps(chunks, ratio, overlap, d, backend, device, garbage=False, slot_map=None):
    """chunks: list of steps, each a list of (request, n_tokens).  Returns pooled per (request, entry), state."""
    c = 2 if overlap else 1
    n_req = 1 + max(r for step in chunks for r, _ in step)
    slot_map = slot_map or list(range(n_req))
    kv_state, sc_state = fresh_state(max(slot_map) + 1, ratio, overlap, d, device, garbage)

    def run_step(si, kv, sc, pos, slot):
        return compressor_step(kv, sc, pos, slot, kv_state, sc_state, ratio, overlap, backend=backend)

    got, hist = drive(chunks, ratio, c * d, slot_map, 7, run_step, device)
    return got, hist, kv_state.cpu(), sc_state.cpu(), slot_map


def check_against_oracle(got, hist, kv_state, sc_state, slot_map, ratio, overlap):
    cm = (2 if overlap else 1) * ratio
    for r, (kv_h, sc_h) in hist.items():
        check_entries(got, r, kv_h, sc_h, ratio, overlap)
        # the state ring holds the last cm positions of the request, at row pos mod cm
        L = kv_h.shape[0]
        for p in range(max(0, L - cm), L):
            assert torch.equal(kv_state[slot_map[r], p % cm], kv_h[p])
            assert torch.equal(sc_state[slot_map[r], p % cm], sc_h[p])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_chunked_steps_equal_one_pass(device, backend, kind):
    ratio, overlap = CONFIGS[kind]
    d = 16
    chunks = [
        [(0, 5), (1, 1), (2, 3)],
        [(0, 1), (1, 130), (2, 3)],
        [(2, 1), (0, 3)],  # request order changes between steps
        [(0, 1), (1, 1), (2, 1)],  # decode-like
        [(1, 7), (0, 130)],
        [(2, 126), (0, 2)],
    ]
    got, hist, kv_s, sc_s, slot_map = run_steps(chunks, ratio, overlap, d, backend, device, slot_map=[3, 0, 2])
    check_against_oracle(got, hist, kv_s, sc_s, slot_map, ratio, overlap)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_kv_and_score_with_different_row_strides(device, kind, decode):
    """kv and score as the layer hands them over: kv a column view of the compressor GEMM's wider output buffer,
    score a tensor of its own (wgate(x) + ape, added outside on a prefill step).  The kernels take each one's row
    stride: same pooled rows and state as with contiguous copies, bit for bit."""
    ratio, overlap = CONFIGS[kind]
    cd = (2 if overlap else 1) * 16
    g = torch.Generator().manual_seed(5)
    if decode:  # three requests, one token each (two complete an entry)
        pos, slot = [ratio - 1, 2 * ratio - 1, 5], [0, 1, 2]
    else:  # one request's prefill chunk from position 0
        pos, slot = list(range(2 * ratio + 3)), [0] * (2 * ratio + 3)
    t = len(pos)
    wide = torch.randn(t, cd + 24, generator=g).to(device)
    kv, sc = wide[:, 8 : 8 + cd], torch.randn(t, cd, generator=g).to(device)
    assert kv.stride(0) != sc.stride(0)
    pos_t, slot_t = (torch.tensor(v, dtype=torch.int32, device=device) for v in (pos, slot))
    results = []
    for k_in in (kv, kv.contiguous()):
        ks = torch.randn(3, (2 if overlap else 1) * ratio, cd, generator=torch.Generator().manual_seed(6)).to(device)
        ss = torch.randn(ks.shape, generator=torch.Generator().manual_seed(7)).to(device)
        pooled, emits = compressor_step(
            k_in, sc, pos_t, slot_t, ks, ss, ratio, overlap, decode=decode, backend="triton"
        )
        results.append((pooled[emits], ks, ss))
    assert results[0][0].shape[0] == 2  # two entries complete in either case
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_csa_entry0_ignores_previous_chunk_of_reused_slot(device, backend):
    """A reused slot with finite junk in every row: entry 0 must pool only positions 0..3 (B half)."""
    got, hist, kv_s, sc_s, slot_map = run_steps([[(0, 2)], [(0, 6)]], 4, True, 8, backend, device, garbage=True)
    check_against_oracle(got, hist, kv_s, sc_s, slot_map, 4, True)


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_decode_fused_launch(device, kind):
    """decode=True (one fused launch) == two-launch path == reference, for one token per request."""
    ratio, overlap = CONFIGS[kind]
    c, d, b = (2 if overlap else 1), 16, 5
    outs = []
    variants = (("torch", False, {}), ("triton", True, {}), ("triton", False, {}))
    variants += (("triton", True, {"block_d": 16, "num_warps": 2}),)  # a decode tuning: same results
    for backend, decode, kw in variants:
        g = torch.Generator().manual_seed(11)
        kv_state = torch.randn(b + 1, c * ratio, c * d, generator=g).to(device)
        sc_state = torch.randn(b + 1, c * ratio, c * d, generator=g).to(device)
        pos = torch.tensor([ratio - 1, 2 * ratio - 1, 2 * ratio, 5 * ratio + 2, 7 * ratio - 1], dtype=torch.int32)
        kv = torch.randn(b, c * d, generator=g)
        sc = torch.randn(b, c * d, generator=g)
        slot = torch.tensor([4, 0, 1, 5, -1], dtype=torch.int32)  # the last token's slot is "none"
        pooled, emits = compressor_step(
            kv.to(device), sc.to(device), pos.to(device), slot.to(device), kv_state, sc_state, ratio, overlap,
            decode=decode, backend=backend, **kw,
        )  # fmt: skip
        outs.append((pooled.cpu(), emits.cpu(), kv_state.cpu(), sc_state.cpu()))
    (p0, e0, k0, s0) = outs[0]
    valid = e0.clone()
    valid[-1] = False  # slot -1: nothing pooled
    for p, e, k, s in outs[1:]:
        assert torch.equal(e, e0)
        torch.testing.assert_close(p[valid], p0[valid], atol=1e-5, rtol=1e-5)
        assert torch.equal(k, k0) and torch.equal(s, s0)
    assert int(valid.sum()) == 2  # positions m-1 and 2m-1 emit; 7m-1 emits but has no slot


FUSED_KINDS = {"csa_main": (4, True, "main"), "csa_indexer": (4, True, "indexer"), "hca": (128, False, "main")}


def _decode_setup(kind, device, d_small=None):
    """A decode batch of 7 tokens (one per request): emitting ones with a state slot and an entry slot, one
    with entry slot -1, one with an out-of-range entry slot, one with state slot -1, and non-emitting ones;
    junk state (finite) and junk pages."""
    ratio, overlap, ekind = FUSED_KINDS[kind]
    fmt = FP8EntryFormat() if ekind == "main" else MXFP4KeyFormat()
    d = fmt.head_dim if ekind == "main" else fmt.dim
    c, b = (2 if overlap else 1), 7
    g = torch.Generator().manual_seed(21)
    pos = torch.tensor(
        [ratio - 1, 3 * ratio - 1, 2 * ratio, 9 * ratio - 1, 5 * ratio - 1, 4 * ratio + 1, 2 * ratio - 1]
    )
    tslot = torch.tensor([0, 3, 1, 6, -1, 2, 5], dtype=torch.int32)
    eslot = torch.tensor([1, 6, 3, -1, 0, 2, 40], dtype=torch.int32)  # token 3: entry slot -1, token 6: out of range
    kv = torch.randn(b, c * d, generator=g)
    sc = torch.randn(b, c * d, generator=g)
    st = (torch.randn(2, 7, c * ratio, c * d, generator=g) * torch.tensor([3.0, 1.0])[:, None, None, None]).contiguous()
    w = torch.rand(d, generator=g) + 0.5
    inv = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))
    flat = torch.randint(0, 256, (fmt.page_bytes(4) * 3,), generator=g, dtype=torch.uint8)
    tensors = [x.to(device) for x in (kv, sc, pos.to(torch.int32), tslot, st, w, inv, eslot, flat)]
    return tensors, fmt, ratio, overlap, ekind


def _pages(fmt, ekind, flat):
    return fmt.entry_pages(flat, 3, 4) if ekind == "main" else fmt.key_pages(flat, 3, 4)


@pytest.mark.parametrize("with_ape", [False, True])
@pytest.mark.parametrize("tuning", [{}, {"block_d": 16, "num_warps": 2}])
@pytest.mark.parametrize("kind", list(FUSED_KINDS))
def test_compress_decode_one_launch_equals_two_launches(device, kind, tuning, with_ape):
    """compress_decode (Triton: pool + state row + emit in one launch, the last channel block of each entry
    emitting) writes the same state and the same entry / key bytes as compressor_step(decode=True) +
    emit_entries (same pooling and emit code: bit-equal), and leaves the counters at 0.  The torch backend
    (the two references) agrees to the pooled values' fp32 rounding.  ``with_ape``: compress_decode gets
    wgate(x) and ape and adds ape[pos mod m] itself (one fp32 add, the same sum)."""
    (kv, sc, pos, tslot, st, w, inv, eslot, flat), fmt, ratio, overlap, ekind = _decode_setup(kind, device)
    counters = torch.zeros(st.shape[1], dtype=torch.int32, device=device)
    fused_kw = {}
    if with_ape:
        ape = torch.randn(ratio, sc.shape[1], generator=torch.Generator().manual_seed(4)).to(device)
        fused_kw = {"ape": ape}
        gate, sc = sc, sc + ape[pos.long() % ratio]  # the two-launch path gets score = gate + ape
    f1, k1, s1 = flat.clone(), st[0].clone(), st[1].clone()
    pooled, emits = compressor_step(kv, sc, pos, tslot, k1, s1, ratio, overlap, decode=True, backend="triton")
    emits &= tslot >= 0  # (pooled rows of tokens without a state slot are unspecified; compress_decode skips them)
    emit_entries(pooled, emits, pos, w, 1e-6, inv, eslot, _pages(fmt, ekind, f1), fmt, ratio, ekind, backend="triton")
    outs = []
    for backend in ("triton", "torch"):
        f2, k2, s2 = flat.clone(), st[0].clone(), st[1].clone()
        for _ in range(2 if backend == "triton" else 1):  # twice: the counters must be back at 0 in between
            compress_decode(
                kv, gate if with_ape else sc, pos, tslot, k2, s2, counters, ratio, overlap, w, 1e-6, inv, eslot,
                _pages(fmt, ekind, f2), fmt, ekind, backend=backend, **(tuning if backend == "triton" else {}),
                **fused_kw,
            )  # fmt: skip
        outs.append((f2, k2, s2))
        assert not counters.any()
    (f2, k2, s2), (f3, k3, s3) = outs
    assert torch.equal(k2, k1) and torch.equal(s2, s1) and torch.equal(f2, f1)
    assert torch.equal(k3, k1) and torch.equal(s3, s1)
    # the reference's pooled sums round differently in fp32; after bf16 (+ e4m3 / e2m1) nearly every byte agrees
    assert (f3 == f1).float().mean() > 0.99
    # exactly the entries of emitting tokens with both slots valid changed
    changed = set()
    new, old = fmt.page_views(f2, 3, 4), fmt.page_views(flat, 3, 4)
    for name in new:
        diff = (new[name].view(torch.uint8) != old[name].view(torch.uint8)).flatten(2).any(-1)
        changed |= {p * 4 + r for p, r in diff.nonzero().tolist()}
    emitting = ((pos + 1) % ratio == 0) & (tslot >= 0) & (eslot >= 0) & (eslot < 12)
    assert sorted(changed) == sorted(eslot[emitting].tolist()) and len(changed) == 2


@pytest.mark.parametrize("with_ape", [False, True])
@pytest.mark.parametrize("tuning", [{}, {"block_d": 16, "num_warps": 2}])
def test_compress_decode_csa_one_launch_equals_two(device, monkeypatch, tuning, with_ape):
    """compress_decode_csa (a CSA layer's main and indexer compressors: ONE launch on the Triton path, the grids side
    by side) writes the same states, entry bytes and key bytes as the two compress_decode calls, and leaves both
    counters at 0; on the torch backend it is the two references.  A bad indexer argument is refused before the main
    compressor's state or pages change."""
    from dsv4.kernels.cache import compressor as comp_mod

    (kvm, scm, pos, tslot, stm, wm, inv, eslot, flatm), fmtm, ratio, overlap, _ = _decode_setup("csa_main", device)
    (kvi, sci, _, _, sti, wi, _, _, flati), fmti, *_ = _decode_setup("csa_indexer", device)
    g = torch.Generator().manual_seed(5)
    apes = [torch.randn(ratio, t.shape[1], generator=g).to(device) if with_ape else None for t in (scm, sci)]
    cm = torch.zeros(stm.shape[1], dtype=torch.int32, device=device)
    ci = torch.zeros(sti.shape[1], dtype=torch.int32, device=device)

    def calls(fm, fi, km, sm, ki, si, tune):
        main = dict(kv=kvm, score=scm, positions=pos, token_slot=tslot, kv_state=km, score_state=sm, counters=cm,
                    ratio=ratio, overlap=overlap, norm_weight=wm, eps=1e-6, inv_freq=inv, slots=eslot,
                    pages=_pages(fmtm, "main", fm), fmt=fmtm, ape=apes[0], **tune)  # fmt: skip
        idx = dict(main, kv=kvi, score=sci, kv_state=ki, score_state=si, counters=ci, norm_weight=wi,
                   pages=_pages(fmti, "indexer", fi), fmt=fmti, ape=apes[1])  # fmt: skip
        return main, idx

    for backend in ("triton", "torch"):
        tune = tuning if backend == "triton" else {}
        want = [t.clone() for t in (flatm, flati, stm[0], stm[1], sti[0], sti[1])]
        main, idx = calls(*want, tune)
        compress_decode(**main, kind="main", backend=backend)
        compress_decode(**idx, kind="indexer", backend=backend)
        got = [t.clone() for t in (flatm, flati, stm[0], stm[1], sti[0], sti[1])]
        main, idx = calls(*got, tune)
        with monkeypatch.context() as mp:
            if backend == "triton":  # (the one launch: neither single-compressor launch runs)
                mp.setattr(comp_mod, "_run_decode", None)
            for _ in range(2 if backend == "triton" else 1):  # twice: the counters must be back at 0 in between
                comp_mod.compress_decode_csa(main, idx, backend=backend)
        assert not cm.any() and not ci.any()
        if backend == "triton":  # (the second call folded the step in again: compare with two more launches)
            main, idx = calls(*want, tune)
            compress_decode(**main, kind="main", backend=backend)
            compress_decode(**idx, kind="indexer", backend=backend)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), backend
        assert not torch.equal(got[0], flatm) and not torch.equal(got[1], flati)
    # a bad indexer format: refused, nothing written
    before = [t.clone() for t in (flatm, stm)]
    main, idx = calls(flatm, flati, stm[0], stm[1], sti[0], sti[1], {})
    with pytest.raises(ValueError, match="fmt"):
        comp_mod.compress_decode_csa(main, dict(idx, fmt=fmtm), backend="triton")
    with pytest.raises(ValueError, match="unknown"):
        comp_mod.compress_decode_csa(main, dict(idx, kind="indexer"), backend="triton")
    assert torch.equal(flatm, before[0]) and torch.equal(stm, before[1])


def test_compress_decode_validation(device):
    (kv, sc, pos, tslot, st, w, inv, eslot, flat), fmt, ratio, overlap, ekind = _decode_setup("csa_main", device)
    pages = _pages(fmt, ekind, flat)
    ok = torch.zeros(st.shape[1], dtype=torch.int32, device=device)
    k, s = st[0].clone(), st[1].clone()
    with pytest.raises(ValueError, match="counters"):
        compress_decode(kv, sc, pos, tslot, k, s, ok[:-1], ratio, overlap, w, 1e-6, inv, eslot, pages, fmt)
    with pytest.raises(ValueError, match="counters"):
        compress_decode(kv, sc, pos, tslot, k, s, ok.long(), ratio, overlap, w, 1e-6, inv, eslot, pages, fmt)
    with pytest.raises(ValueError, match="fmt"):
        compress_decode(kv, sc, pos, tslot, k, s, ok, ratio, overlap, w, 1e-6, inv, eslot, pages, fmt, "indexer")
    with pytest.raises(ValueError, match="ape"):
        compress_decode(kv, sc, pos, tslot, k, s, ok, ratio, overlap, w, 1e-6, inv, eslot, pages, fmt, ape=sc[:2])
    assert torch.equal(k, st[0]) and torch.equal(s, st[1]) and not ok.any()  # a failed call changes nothing


def _emit_setup(kind, device, t=12):
    g = torch.Generator().manual_seed(5)
    pos = torch.arange(1000, 1000 + t, dtype=torch.int32)
    ratio = 4
    emits = (pos + 1) % ratio == 0
    slots = torch.tensor([0, 5, -1, 3, 7, 2, 100, 1, 8, 4, 6, 9], dtype=torch.int32)[:t]
    slots[2 + 4 * 0 + 1] = -1  # an emitting token with slot -1 (index 3) ...
    slots[7] = 50  # ... and one with an out-of-range slot (index 7)
    if kind == "main":
        fmt = FP8EntryFormat()
        d = fmt.head_dim
    else:
        fmt = MXFP4KeyFormat()
        d = fmt.dim
    pooled = torch.randn(t, d, generator=g)
    pooled[~emits] = float("nan")  # never read
    w = torch.rand(d, generator=g) + 0.5
    inv = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))
    return [x.to(device) for x in (pooled, emits, pos, w, inv, slots)], fmt, ratio


@pytest.mark.parametrize("kind", ["main", "indexer", "indexer_dot"])
def test_emit_entries_triton_equals_reference(device, kind):
    """(``indexer_dot``: the indexer's MMA kernel, 16 tokens per program.)"""
    kw = {"dot": 1, "block_t": 16} if kind == "indexer_dot" else {}
    kind = kind.removesuffix("_dot")
    (pooled, emits, pos, w, inv, slots), fmt, ratio = _emit_setup(kind, device)
    pages, bufs = [], []
    for seed in (0, 0):
        gen = torch.Generator().manual_seed(seed)
        flat = torch.randint(0, 256, (fmt.page_bytes(4) * 3,), generator=gen, dtype=torch.uint8).to(device)
        bufs.append(flat)
        pages.append(fmt.entry_pages(flat, 3, 4) if kind == "main" else fmt.key_pages(flat, 3, 4))
    before = bufs[0].clone()
    emit_entries(pooled, emits, pos, w, 1e-6, inv, slots, pages[0], fmt, ratio, kind, backend="triton", **kw)
    emit_entries(pooled, emits, pos, w, 1e-6, inv, slots, pages[1], fmt, ratio, kind, backend="torch")
    # RMSNorm / Hadamard sum orders differ (fp32) but on these rows the bf16 results coincide: bytes equal
    assert torch.equal(bufs[0], bufs[1])
    # exactly the emitting, in-range slots changed (2 of the 3 emitting tokens: slots 7 and 8... see setup)
    per = fmt.entry_bytes
    changed_entries = set()
    views = fmt.page_views(bufs[0], 3, 4)
    views_b = fmt.page_views(before, 3, 4)
    for name in ("nope", "scale") if kind == "main" else ("data", "scale"):
        diff = (views[name].view(torch.uint8) != views_b[name].view(torch.uint8)).flatten(2).any(-1)
        changed_entries |= {int(p) * 4 + int(r) for p, r in diff.nonzero().tolist()}
    allowed = {int(s) for s, e in zip(slots.tolist(), emits.tolist(), strict=True) if e and 0 <= s < 12}
    assert changed_entries <= allowed and len(allowed) == 1 and per > 0
    if kind == "main":
        assert torch.equal(views["pad"], views_b["pad"])


def _emit_with_both_backends(kind, fmt, pooled, emits, pos, w, inv, slots, ratio, n_pages, bs, triton_kw):
    """``emit_entries`` with the Triton backend (``triton_kw``) and the reference, each into its own copy of the
    same random pool of ``n_pages`` pages of ``bs`` entries; returns the two pools' bytes (triton, torch)."""
    bufs = []
    for backend in ("triton", "torch"):
        flat = torch.randint(0, 256, (fmt.page_bytes(bs) * n_pages,), generator=torch.Generator().manual_seed(3))
        flat = flat.to(torch.uint8).to(pooled.device)
        pages = fmt.entry_pages(flat, n_pages, bs) if kind == "main" else fmt.key_pages(flat, n_pages, bs)
        kw = triton_kw if backend == "triton" else {}
        emit_entries(pooled, emits, pos, w, 1e-6, inv, slots, pages, fmt, ratio, kind, backend=backend, **kw)
        bufs.append(flat)
    return bufs


TUNE_EMIT = [
    {},
    {"block_t": 1},
    {"block_t": 16, "num_warps": 2},
    {"iters": 4},
    {"block_t": 2, "iters": 3},
    {"scan": 8},
    {"scan": 32},
    {"dot": 1, "block_t": 16},
    {"dot": 1, "block_t": 32, "num_warps": 1},
    {"dot": 1, "block_t": 64, "rows": 16},
    {"dot": 1, "block_t": 32, "rows": 32},
    {"dot": 1, "block_t": 32, "stages": 1},
]


@pytest.mark.parametrize("tuning", TUNE_EMIT)
@pytest.mark.parametrize("kind", ["main", "indexer"])
def test_emit_entries_many_emitters_per_block(device, kind, tuning):
    """A prefill-like step (every token emits: m = 1, and a few skipped slots) for any launch tuning: bytes
    equal the reference's (several emitting tokens per program, a partial last block)."""
    fmt = FP8EntryFormat() if kind == "main" else MXFP4KeyFormat()
    d = fmt.head_dim if kind == "main" else fmt.dim
    t, ratio, n_pages, bs = 21, 1, 6, 4
    g = torch.Generator().manual_seed(21)
    pooled = torch.randn(t, d, generator=g).to(device)
    pos = torch.arange(5000, 5000 + t, dtype=torch.int32, device=device)
    emits = torch.ones(t, dtype=torch.bool, device=device)
    slots = torch.randperm(n_pages * bs, generator=g)[:t].to(torch.int32)
    slots[[2, 9, 20]] = torch.tensor([-1, n_pages * bs, -5], dtype=torch.int32)
    slots = slots.to(device)
    w = (torch.rand(d, generator=g) + 0.5).to(device)
    inv = (1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))).to(device)
    kw = tuning
    if kind == "indexer":  # ``iters`` / ``scan`` are the main kernel's
        kw = {k: v for k, v in kw.items() if k not in ("iters", "scan")}
    elif "dot" in kw:  # the indexer's
        kw = {}
    bufs = _emit_with_both_backends(kind, fmt, pooled, emits, pos, w, inv, slots, ratio, n_pages, bs, kw)
    assert torch.equal(bufs[0], bufs[1])


@pytest.mark.parametrize("scan", [None, 1, 2, 16])
def test_emit_main_scan_sparse_emitters(device, scan):
    """The main emit's flag scan (``scan`` rows per program, the emitting ones stored in turn): sparse and
    irregular emitters (m = 4 positions of two requests, a skipped slot, a partial last program) give the
    reference's bytes; rows of non-emitting tokens (NaN) are never read."""
    fmt, ratio, bs, n_pages = FP8EntryFormat(), 4, 4, 6
    g = torch.Generator().manual_seed(5)
    pos = torch.cat([torch.arange(6, 19), torch.arange(100, 110)]).to(torch.int32)
    t = pos.numel()
    emits = (pos + 1) % ratio == 0
    pooled = torch.randn(t, fmt.head_dim, generator=g)
    pooled[~emits] = float("nan")
    slots = torch.randperm(n_pages * bs, generator=g)[:t].to(torch.int32)
    slots[emits.nonzero()[1, 0]] = -1
    w = torch.rand(fmt.head_dim, generator=g) + 0.5
    inv = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))
    args = [x.to(device) for x in (pooled, emits, pos, w)]
    kw = {} if scan is None else {"scan": scan}
    bufs = _emit_with_both_backends("main", fmt, *args, inv.to(device), slots.to(device), ratio, n_pages, bs, kw)
    assert torch.equal(bufs[0], bufs[1])
    if scan is None:  # and the scan needs emits-only geometry
        with pytest.raises(ValueError, match="scan"):
            emit_entries(
                *args[:4], 1e-6, inv.to(device), slots.to(device), fmt.entry_pages(bufs[0], n_pages, bs), fmt,
                ratio, "main", backend="triton", scan=4, block_t=2,
            )  # fmt: skip


def test_emit_indexer_auto_takes_the_mma_kernel_on_long_prefills():
    """dot=None: the MMA emit with 128 tokens a program from _EMIT_DOT_MIN_PROGRAMS such programs a SM (T = 65,536 on
    132 SMs: 512 programs), with 64 from _EMIT_DOT_MIN_T_64 tokens (T = 8,192), the factored one-warp kernel below."""
    from dsv4.kernels.cache import compressor as comp

    bt = comp._emit_indexer_dot_block_t
    assert (bt(65536, 132), bt(8192, 132), bt(8191, 132), bt(1, 132)) == (128, 64, 0, 0)
    for n_sms in (1, 78, 132):
        edge = comp._EMIT_DOT_MIN_PROGRAMS * n_sms * comp._EMIT_DOT_BLOCK_T
        assert bt(edge, n_sms) == 128 and bt(edge - comp._EMIT_DOT_BLOCK_T, n_sms) in (0, 64)


@pytest.mark.parametrize("block_t, rows", [(16, 16), (64, 16), (32, 32), (128, 16)])
def test_emit_indexer_dot_compacts_sparse_emitters(device, block_t, rows):
    """The indexer's MMA emit numbers a program's emitting tokens and feeds them ``rows`` at a time: sparse,
    irregular emitters (m = 4 positions of three requests, one dense run of m = 1-like emits, skipped slots, a
    partial last program, groups that straddle nothing and groups that are partly empty) give the reference's
    bytes; rows of non-emitting tokens (NaN) are never read.  Bad ``rows`` are refused before any write."""
    fmt, ratio, bs, n_pages = MXFP4KeyFormat(), 4, 4, 32
    g = torch.Generator().manual_seed(8)
    pos = torch.cat([torch.arange(6, 39), torch.arange(100, 110), torch.arange(203, 260)]).to(torch.int32)
    t = pos.numel()
    emits = (pos + 1) % ratio == 0
    emits[60:80] = True  # a run of emitting rows: more than 16 in one program at block_t = 64
    pooled = torch.randn(t, fmt.dim, generator=g)
    pooled[~emits] = float("nan")
    slots = torch.randperm(n_pages * bs, generator=g)[:t].to(torch.int32)
    slots[emits.nonzero()[[1, 7], 0]] = torch.tensor([-1, n_pages * bs], dtype=torch.int32)
    w = torch.rand(fmt.dim, generator=g) + 0.5
    inv = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))
    args = [x.to(device) for x in (pooled, emits, pos, w)]
    kw = {"dot": 1, "block_t": block_t, "rows": rows}
    bufs = _emit_with_both_backends("indexer", fmt, *args, inv.to(device), slots.to(device), ratio, n_pages, bs, kw)
    assert torch.equal(bufs[0], bufs[1])
    before = bufs[0].clone()
    for bad in ({"dot": 1, "block_t": 16, "rows": 32}, {"dot": 1, "rows": 8}, {"dot": 0, "rows": 16}, {"rows": 16}):
        with pytest.raises(ValueError, match="rows"):
            emit_entries(
                *args[:4], 1e-6, inv.to(device), slots.to(device), fmt.key_pages(bufs[0], n_pages, bs), fmt,
                ratio, "indexer", backend="triton", **bad,
            )  # fmt: skip
    for bad in ({"stages": 1}, {"dot": 0, "stages": 2}):  # num_stages: the MMA kernel's only
        with pytest.raises(ValueError, match="stages"):
            emit_entries(
                *args[:4], 1e-6, inv.to(device), slots.to(device), fmt.key_pages(bufs[0], n_pages, bs), fmt,
                ratio, "indexer", backend="triton", **bad,
            )  # fmt: skip
    assert torch.equal(bufs[0], before)


def test_compressor_then_emit_main_matches_oracle_entries(device):
    """End to end on the main CSA compressor: chunked steps + emit == one-pass pooled, normed, roped, FP8."""
    fmt = FP8EntryFormat()
    ratio, d = 4, fmt.head_dim
    g = torch.Generator().manual_seed(9)
    L = 13
    kv_h = torch.randn(L, 2 * d, generator=g)
    sc_h = torch.randn(L, 2 * d, generator=g)
    w = (torch.rand(d, generator=g) + 0.5).to(device)
    inv = (1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))).to(device)
    kv_state, sc_state = fresh_state(1, ratio, True, d, device)
    flat = torch.zeros(fmt.page_bytes(4) * 1, dtype=torch.uint8, device=device)
    pages = fmt.entry_pages(flat, 1, 4)
    start = 0
    for n in (6, 1, 6):
        pos = torch.arange(start, start + n, dtype=torch.int32, device=device)
        pooled, emits = compressor_step(
            kv_h[start : start + n].to(device), sc_h[start : start + n].to(device), pos,
            torch.zeros(n, dtype=torch.int32, device=device), kv_state, sc_state, ratio, True, backend="triton",
        )  # fmt: skip
        slots = (pos // ratio).to(torch.int32)
        emit_entries(pooled, emits, pos, w, 1e-6, inv, slots, pages, fmt, ratio, "main", backend="triton")
        start += n
    want = oracle_pooled(kv_h, sc_h, ratio, True)  # [3, d]
    ref_flat = torch.zeros_like(flat)
    e_pos = torch.arange(want.shape[0], dtype=torch.int32) * ratio + ratio - 1
    emit_entries(
        want.to(device), torch.ones(3, dtype=torch.bool, device=device), e_pos.to(device), w.to(device), 1e-6,
        inv.to(device), torch.arange(3, dtype=torch.int32, device=device), fmt.entry_pages(ref_flat, 1, 4), fmt,
        ratio, "main", backend="torch",
    )  # fmt: skip
    got = fmt.dequantize(pages.nope[0, :3], pages.rope[0, :3], pages.scale[0, :3]).float()
    ref = fmt.dequantize(*[v[0, :3] for v in fmt.entry_pages(ref_flat, 1, 4)]).float()
    # pooled differs by fp32 rounding only; after bf16 + e4m3 at most one e4m3 step (2^-3 relative) apart
    assert ((got - ref).abs() <= ref.abs() * 2**-3 + 1e-6).all()
    assert (got == ref).float().mean() > 0.99
    assert entry_positions(e_pos, ratio).tolist() == [0, 4, 8]


def test_validation_errors(device):
    kv_state, sc_state = fresh_state(2, 4, True, 8, device)
    kv = torch.zeros(3, 16, device=device)
    pos = torch.arange(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="kv_state"):
        compressor_step(kv, kv, pos, pos, kv_state[:, :4], sc_state[:, :4], 4, True)
    with pytest.raises(ValueError, match="score"):
        compressor_step(kv, kv.double(), pos, pos, kv_state, sc_state, 4, True)
    with pytest.raises(ValueError, match="ratio"):
        compressor_step(kv, kv, pos, pos, kv_state, sc_state, 0, True)
    before = kv_state.clone(), sc_state.clone()
    for bad in (16, 300, 128.0):  # a register cap ptxas would not take: refused before any launch
        with pytest.raises(ValueError, match="pool_maxnreg"):
            compressor_step(kv, kv, pos, pos, kv_state, sc_state, 4, True, backend="triton", pool_maxnreg=bad)
    assert torch.equal(kv_state, before[0]) and torch.equal(sc_state, before[1])


TUNINGS = [
    {},
    {"pool_block_t": 1, "block_d": 16, "num_warps": 4},
    {"pool_block_t": 32, "num_warps": 2},
    {"row_loads": 1},
    {"row_loads": 1, "pool_block_t": 1, "block_d": 16, "write_block_t": 4, "write_warps": 2},
    {"row_loads": 0, "write_block_t": 128, "write_warps": 4},
    {"write_lanes": 16},  # the lanes state-write kernel, default superblock
    {"write_lanes": 3, "write_block_t": 16, "write_warps": 2},
    {"pool_div_after": 1},  # both forms of the pool's division, whatever the kind's default
    {"pool_div_after": 0},
    {"pool_fast_rows": 1, "pool_fast_exp": 1},  # entries wholly in the step loaded without the state select
    {"pool_fast_rows": 1, "pool_block_t": 4, "pool_div_after": 0},
]


@pytest.mark.parametrize("tuning", TUNINGS)
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_step_path_many_emitters_per_token_block(device, kind, tuning, d=16):
    """Non-decode launch (token-blocked pool pass + tiled state write): a step mixing one-token requests that
    all emit (several per pool block, partial last block), a long chunk and a token without a state slot;
    for any tuning of the Triton launch (tokens per pool program, channel block, warps)."""
    ratio, overlap = CONFIGS[kind]
    c = 2 if overlap else 1
    g = torch.Generator().manual_seed(12)
    n_single = 21
    starts = [(3 * k + 1) * ratio - 1 for k in range(n_single)]  # emitting positions
    long_start = 2 * ratio + 1
    long_n = c * ratio + 37  # more than c*m tokens: the first ones are superseded within the step
    pos = torch.tensor(starts + list(range(long_start, long_start + long_n)) + [ratio - 1], dtype=torch.int32)
    slot = torch.tensor(list(range(n_single)) + [n_single] * long_n + [-1], dtype=torch.int32)
    t = pos.numel()
    kv = torch.randn(t, c * d, generator=g)
    sc = torch.randn(t, c * d, generator=g)
    st = (
        torch.randn(n_single + 1, c * ratio, c * d, generator=g),
        torch.randn(n_single + 1, c * ratio, c * d, generator=g),
    )
    outs = []
    for backend in ("torch", "triton"):
        ks, ss = st[0].clone().to(device), st[1].clone().to(device)
        kw = tuning if backend == "triton" else {}
        pooled, emits = compressor_step(
            kv.to(device), sc.to(device), pos.to(device), slot.to(device), ks, ss, ratio, overlap, backend=backend, **kw
        )
        outs.append((pooled.cpu(), emits.cpu(), ks.cpu(), ss.cpu()))
    (p0, e0, k0, s0), (p1, e1, k1, s1) = outs
    assert torch.equal(e0, e1) and torch.equal(e0, (pos + 1) % ratio == 0)
    valid = e0 & (slot >= 0)
    assert int(valid.sum()) >= n_single + 1
    torch.testing.assert_close(p1[valid], p0[valid], atol=1e-5, rtol=1e-5)
    assert torch.equal(k1, k0) and torch.equal(s1, s0)


@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_write_lanes_with_many_writing_sub_blocks(device, kind, lanes, monkeypatch):
    """The lanes state-write kernel where a superblock has more writing sub-blocks than lanes (the tile patched to
    64 values: sub-blocks of 2 (CSA) / 4 (HCA) tokens, superblocks of 16): each lane copies every LANES-th of them."""
    monkeypatch.setattr(compressor_module, "_WRITE_LANE_TILE", 64)
    test_step_path_many_emitters_per_token_block(device, kind, {"write_lanes": lanes, "write_block_t": 16})


def test_small_tile_pool_splits_channels_on_long_steps(device, monkeypatch):
    """CSA pools on small tiles (d < 512: the indexer's) take half the channels a program from
    _POOL_SPLIT_D_MIN_BLOCKS token blocks (patched to 1 here, so a short step takes that path): same values."""
    grids = []
    kernel = compressor_module._compressor_pool_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(compressor_module, "_POOL_SPLIT_D_MIN_BLOCKS", 1)
    monkeypatch.setattr(compressor_module, "_compressor_pool_kernel", Spy())
    test_step_path_many_emitters_per_token_block(device, "csa", {}, d=64)
    if device.type == "cpu" and not compressor_module.interpreter_enabled():
        return  # the torch path on a CPU without the interpreter: no launch to look at
    assert grids and all(g[1] == 2 for g in grids), grids  # 64 channels -> 2 programs of 32


def test_emit_entries_rope_at_entry_position_far_out(device):
    """Entries far out (positions near 2^20, HCA ratio): the kernel's in-kernel RoPE angle is the reference's."""
    (pooled, emits, pos, w, inv, slots), fmt, _ = _emit_setup("main", device)
    ratio = 128
    pos = (torch.arange(12, dtype=torch.int32) * ratio + (1 << 20) - 1).to(device)  # all emit (pos+1 % m == 0)
    emits = torch.ones(12, dtype=torch.bool, device=device)
    pooled = torch.randn(12, fmt.head_dim, generator=torch.Generator().manual_seed(3)).to(device)
    slots = torch.arange(12, dtype=torch.int32, device=device)
    bufs = []
    for backend in ("triton", "torch"):
        flat = torch.zeros(fmt.page_bytes(4) * 3, dtype=torch.uint8, device=device)
        emit_entries(
            pooled, emits, pos, w, 1e-6, inv, slots, fmt.entry_pages(flat, 3, 4), fmt, ratio, "main", backend=backend
        )
        bufs.append(flat)
    got = fmt.entry_pages(bufs[0], 3, 4).rope.float()
    ref = fmt.entry_pages(bufs[1], 3, 4).rope.float()
    # rope lanes: bf16 of the same fp32 rotation (cos/sin may differ by an ulp): at most one bf16 ulp apart
    assert ((got - ref).abs() <= ref.abs() * 2**-7 + 1e-30).all()
    assert (got == ref).float().mean() > 0.98


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode", [True, False, "fused", "overlap", "fuse_emit"])
@pytest.mark.parametrize("kind", ["csa_main", "csa_indexer", "hca"])
def test_compress_emit_sync_free_and_capturable(kind, decode):
    """compressor_step + emit_entries (Triton) never sync with the host and replay from a CUDA graph; so does
    the fused decode launch (``compress_decode``), whose results equal the two-launch path's, and a prefill with
    the state write on the side stream (``compress_prefill(overlap_write=True)``: two branches in the graph), and
    one whose pool emits (``fuse_emit=True``; HCA runs in order), whose results equal the in-order path's."""
    overlapped, fuse_emit = decode == "overlap", decode == "fuse_emit"
    decode = False if overlapped or fuse_emit else decode
    dev = torch.device("cuda")
    ratio, overlap = (4, True) if kind.startswith("csa") else (128, False)
    fmt = MXFP4KeyFormat() if kind == "csa_indexer" else FP8EntryFormat()
    d = fmt.dim if kind == "csa_indexer" else fmt.head_dim
    ekind = "indexer" if kind == "csa_indexer" else "main"
    c, b = (2 if overlap else 1), 6
    g = torch.Generator().manual_seed(13)
    pos = (torch.arange(b, dtype=torch.int32) * 3 + 5) * ratio - 1
    if not decode:
        pos = torch.arange(3 * ratio, dtype=torch.int32)
    t = pos.numel()
    tslot = torch.arange(t, dtype=torch.int32) if decode else torch.zeros(t, dtype=torch.int32)
    kv, sc = torch.randn(t, c * d, generator=g).to(dev), torch.randn(t, c * d, generator=g).to(dev)
    st = torch.randn(2, t, c * ratio, c * d, generator=g).to(dev)
    w = (torch.rand(d, generator=g) + 0.5).to(dev)
    inv = (1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))).to(dev)
    eslot = torch.arange(t, dtype=torch.int32, device=dev)
    pos, tslot = pos.to(dev), tslot.to(dev)
    n_pages = -(-t // 4)

    def make():
        flat = torch.zeros(fmt.page_bytes(4) * n_pages, dtype=torch.uint8, device=dev)
        pages = fmt.entry_pages(flat, n_pages, 4) if ekind == "main" else fmt.key_pages(flat, n_pages, 4)
        return flat, pages, st[0].clone(), st[1].clone()

    fused = decode == "fused"
    counters = torch.zeros(t, dtype=torch.int32, device=dev)

    def op(pages, ks, ss):
        if fused:
            compress_decode(
                kv, sc, pos, tslot, ks, ss, counters, ratio, overlap, w, 1e-6, inv, eslot, pages, fmt, ekind,
                backend="triton",
            )  # fmt: skip
            return
        if overlapped or fuse_emit:
            compress_prefill(
                kv, sc, pos, tslot, ks, ss, ratio, overlap, w, 1e-6, inv, eslot, pages, fmt, ekind, backend="triton",
                overlap_write=overlapped, fuse_emit=fuse_emit,
            )  # fmt: skip
            return
        pooled, emits = compressor_step(
            kv, sc, pos, tslot, ks, ss, ratio, overlap, decode=bool(decode), backend="triton"
        )
        emit_entries(pooled, emits, pos, w, 1e-6, inv, eslot, pages, fmt, ratio, ekind, backend="triton")

    fe, pe, kse, sse = make()
    op(*make()[1:])  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        op(pe, kse, sse)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fg, pg, ksg, ssg = make()
    graph, _ = capture_graph(lambda: op(pg, ksg, ssg))  # a host sync cannot be captured
    fresh = make()
    fg.copy_(fresh[0]), ksg.copy_(fresh[2]), ssg.copy_(fresh[3])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(fg, fe) and torch.equal(ksg, kse) and torch.equal(ssg, sse)
    if fused or overlapped or fuse_emit:  # the one-launch / two-stream / fused-emit path writes what the in-order
        assert not counters.any()  # two-launch one writes (the fused emit's sums on other warps: rarely a bf16 ulp)
        f2, p2, ks2, ss2 = make()
        pooled, emits = compressor_step(kv, sc, pos, tslot, ks2, ss2, ratio, overlap, decode=fused, backend="triton")
        emit_entries(pooled, emits, pos, w, 1e-6, inv, eslot, p2, fmt, ratio, ekind, backend="triton")
        same = torch.equal(f2, fe) if not fuse_emit else (f2 != fe).sum().item() <= 4
        assert same and torch.equal(ks2, kse) and torch.equal(ss2, sse)


APE_TUNINGS = [
    {},
    {"pool_fast_rows": 1, "pool_fast_exp": 1},
    {"pool_fast_rows": 0, "row_loads": 1},
    {"write_lanes": 0},
    {"write_lanes": 3, "write_block_t": 16},
    {"pool_online_rows_in_step": 1},
    {"counters": True},
]


@pytest.mark.parametrize("tuning", APE_TUNINGS)
@pytest.mark.parametrize("kind", ["csa", "hca", "hca_online"])
def test_ape_added_in_the_kernels_equals_ape_added_first(device, kind, tuning, d=16):
    """``compressor_step(ape=)`` (the kernels add ``ape[pos mod m]`` to the step's score rows where they read them:
    pooling, state writes, the online prefix) gives the bits of adding it to ``score`` first, over chunked prefill and
    decode steps of three requests: state (and state positions) after every step and every emitted pooled row."""
    if device.type == "cpu" and not compressor_module.interpreter_enabled():
        pytest.skip("the Triton path on the CPU needs TRITON_INTERPRET=1")
    online = kind == "hca_online"
    ratio, overlap = (4, True) if kind == "csa" else (8, False)
    if "pool_online_rows_in_step" in tuning and not online or "counters" in tuning and not online:
        pytest.skip("an online-state tuning")
    c = 2 if overlap else 1
    g = torch.Generator().manual_seed(31)
    ape = (torch.randn(ratio, c * d, generator=g) * 3).to(device)
    steps = [[(0, 5), (1, 13), (2, 2)], [(0, 1), (1, 1), (2, 1)], [(2, 17), (0, 3)], [(1, 9), (0, 1), (2, 6)]]
    decode = {1}
    slot_map = [2, 0, 1]
    states = []
    for added_first in (True, False):
        if online:
            ks, ss, sp = online_state(3, d, device)
        else:
            (ks, ss), sp = fresh_state(3, ratio, overlap, d, device), None
        kw = dict(tuning)
        if kw.pop("counters", None):
            kw["counters"] = torch.zeros(3, dtype=torch.int32, device=device)
        hist = {r: ([], []) for r in range(3)}
        gs = torch.Generator().manual_seed(5)
        out = []
        for si, step in enumerate(steps):
            pos, slot, _, kv, sc = next_step(step, hist, slot_map, c * d, gs)
            pos_t = torch.tensor(pos, dtype=torch.int32, device=device)
            slot_t = torch.tensor(slot, dtype=torch.int32, device=device)
            kv, sc = kv.to(device), sc.to(device)
            step_kw = {} if si in decode else kw
            if added_first:
                sc = sc + ape[pos_t.long() % ratio]
            pooled, emits = compressor_step(
                kv, sc, pos_t, slot_t, ks, ss, ratio, overlap, decode=si in decode, backend="triton", state_pos=sp,
                ape=None if added_first else ape, **step_kw,
            )  # fmt: skip
            out.append((pooled[emits].clone(), ks.clone(), ss.clone(), None if sp is None else sp.clone()))
        states.append(out)
        if "counters" in kw:
            assert not kw["counters"].any()
    for (p1, k1, s1, q1), (p2, k2, s2, q2) in zip(*states, strict=True):
        assert p1.numel() == 0 or torch.equal(p2, p1)
        assert torch.equal(k2, k1) and torch.equal(s2, s1) and (q1 is None or torch.equal(q2, q1))
    assert any(p.numel() for p, *_ in states[0])  # some entries completed


def test_ape_is_checked_before_anything_changes(device):
    """A wrong ``ape`` (shape, dtype, layout) fails before the state moves."""
    if device.type == "cpu" and not compressor_module.interpreter_enabled():
        pytest.skip("the Triton path on the CPU needs TRITON_INTERPRET=1")
    ks, ss = fresh_state(1, 4, True, 16, device)
    k0, s0 = ks.clone(), ss.clone()
    kv = torch.randn(9, 32, device=device)
    pos = torch.arange(9, dtype=torch.int32, device=device)
    slot = torch.zeros(9, dtype=torch.int32, device=device)
    for bad, what in (
        (torch.zeros(4, 16, device=device), "shape"),
        (torch.zeros(4, 32, device=device, dtype=torch.float64), "dtype"),
        (torch.zeros(32, 4, device=device).t(), "contiguous"),
    ):
        with pytest.raises(ValueError, match=what):
            compressor_step(kv, kv, pos, slot, ks, ss, 4, True, backend="triton", ape=bad)
    assert torch.equal(ks, k0) and torch.equal(ss, s0)
