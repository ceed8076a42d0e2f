"""The online compressor state (``state_pos`` given: HCA's running softmax instead of its last m rows), both
backends.

The oracle pools each entry from a request's whole history in one softmax (as ``test_compressor.py``); stepping
through it in chunks of any length, prefill or decode, with either backend, must give the same entries to fp32
rounding (the exp-weighted sums are summed in another order: atol 1e-5 on O(1) data) and leave in the state the
running softmax of the request's last chunk before its newest row (the max bit-equal: a max is exact), that row
raw (bit-equal: a copy) and its position.
"""

import pytest
import torch
from test_compressor import check_entries, drive

import dsv4.kernels.cache.compressor as compressor_module
from dsv4.formats import FP8EntryFormat
from dsv4.kernels.cache.compressor import (
    compress_decode,
    compressor_step,
    emit_entries,
    online_combine,
    online_state,
)

BACKENDS = ["torch", "triton"]


def _running(kv, sc):
    if kv.shape[0] == 0:
        return torch.full((kv.shape[1],), float("-inf")), torch.zeros(kv.shape[1]), torch.zeros(kv.shape[1])
    mx = sc.max(0).values
    e = torch.exp(sc - mx)
    return mx, e.sum(0), (e * kv).sum(0)


def run_online(chunks, ratio, d, backend, device, slot_map, decode_steps=(), **kw):
    """chunks: steps, each a list of (request, n_tokens); step indices in ``decode_steps`` use decode=True (one
    token per request).  Returns pooled per (request, entry), the histories and the state (CPU)."""
    kv_state, sc_state, spos = online_state(max(slot_map) + 1, d, device)
    if kw.get("counters") is True:  # the state slots' arrival counters: positions written by the state write
        kw = {**kw, "counters": torch.zeros(kv_state.shape[0], dtype=torch.int32, device=device)}

    def run_step(si, kv, sc, pos, slot):
        dec = si in decode_steps
        return compressor_step(kv, sc, pos, slot, kv_state, sc_state, ratio, False, decode=dec, backend=backend,
                               state_pos=spos, **({} if dec else kw))  # fmt: skip

    got, hist = drive(chunks, ratio, d, slot_map, 3, run_step, device)
    if "counters" in kw:
        assert not kw["counters"].any()  # 0 again after every launch
    return got, hist, (kv_state.cpu(), sc_state.cpu(), spos.cpu())


def check(got, hist, state, slot_map, ratio):
    kv_state, sc_state, spos = state
    for r, (kv_h, sc_h) in hist.items():
        check_entries(got, r, kv_h, sc_h, ratio, False)
        n = kv_h.shape[0]
        c0 = (n - 1) // ratio * ratio  # the last chunk's first position (a complete chunk stays until the next)
        mx, den, acc = _running(kv_h[c0 : n - 1], sc_h[c0 : n - 1])
        s = slot_map[r]
        assert int(spos[s]) == n - 1
        assert torch.equal(kv_state[s, 2], kv_h[n - 1]) and torch.equal(sc_state[s, 1], sc_h[n - 1])
        assert torch.equal(sc_state[s, 0], mx)
        torch.testing.assert_close(kv_state[s, 1], den, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv_state[s, 0], acc, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio", [8, 128])
@pytest.mark.parametrize(
    "tuning",
    [
        {}, {"pool_fast_rows": 1, "pool_fast_exp": 1}, {"pool_online_rows_in_step": 1, "pool_maxnreg": 128},
        {"counters": True}, {"counters": True, "block_d": 8},
    ],
)  # fmt: skip
def test_online_chunked_steps_equal_one_pass(device, backend, ratio, tuning):
    """Any chunking, prefill or decode, gives the one-pass oracle's entries and state; for the Triton path also with
    the pool's fast-row and fast-exp forms, with whole-chunk entries pooled by the fast loads alone, and with the
    positions written by the state write (``counters``; two channel blocks a request arriving on one counter)."""
    chunks = [
        [(0, 5), (1, 1), (2, 3)],
        [(0, 1), (1, 130), (2, 3)],
        [(2, 1), (0, 3)],  # request order changes between steps
        [(0, 1), (1, 1), (2, 1)],  # decode (decode=True)
        [(1, 7), (0, 130)],
        [(2, 126), (0, 2)],
        [(0, 1), (2, 1), (1, 1)],  # decode (decode=True)
        [(1, 2 * ratio - 3), (2, ratio), (0, 3)],
    ]
    slot_map = [3, 0, 2]
    kw = tuning if backend == "triton" else {}
    got, hist, state = run_online(chunks, ratio, 16, backend, device, slot_map, decode_steps=(3, 6), **kw)
    check(got, hist, state, slot_map, ratio)


@pytest.mark.parametrize("backend", BACKENDS)
def test_online_decode_only_from_position_zero(device, backend):
    """A request decoded token by token from position 0 through two chunks and a bit: the running softmax folds one
    row a step and starts afresh at each chunk (the fresh slot's state is never combined)."""
    ratio = 8
    chunks = [[(0, 1), (1, 1)] for _ in range(2 * ratio + 3)]
    got, hist, state = run_online(chunks, ratio, 16, backend, device, [1, 0], decode_steps=range(len(chunks)))
    check(got, hist, state, [1, 0], ratio)


@pytest.mark.parametrize("sigma", [1.0, 16.0])
def test_online_fold_is_as_accurate_as_the_reference_formula(sigma):
    """A chunk folded one row at a time (128 decode steps) against the fp64 softmax pooling: its fp32 error is that of
    the reference's own fp32 formula (softmax, then the weighted sum), ~1e-6 of a row's largest value."""
    g = torch.Generator().manual_seed(0)
    kv, sc = torch.randn(16, 128, 512, generator=g), torch.randn(16, 128, 512, generator=g) * sigma
    truth = (kv.double() * sc.double().softmax(1)).sum(1)
    ref = (kv * sc.softmax(1)).sum(1)
    one = torch.ones(16, 512)
    run = (sc[:, 0], one, kv[:, 0])
    for r in range(1, 128):
        run = online_combine(run, (sc[:, r], one, kv[:, r]))
    scale = truth.abs().amax(-1, keepdim=True)
    e_ref = ((ref.double() - truth).abs() / scale).max().item()
    e_online = ((run[2] / run[1]).double() - truth).abs().div(scale).max().item()
    assert e_online < 2e-6 and e_online < 2 * e_ref, (e_online, e_ref)


def test_online_combine_is_the_union():
    g = torch.Generator().manual_seed(1)
    kv, sc = torch.randn(10, 6, generator=g), torch.randn(10, 6, generator=g) * 3
    whole = _running(kv, sc)
    parts = online_combine(_running(kv[:4], sc[:4]), _running(kv[4:], sc[4:]))
    empty = (torch.full((6,), float("-inf")), torch.zeros(6), torch.zeros(6))
    assert torch.equal(online_combine(empty, whole)[0], whole[0])
    for a, b in zip(parts, whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _decode_batch(device, d, ratio=128):
    """7 tokens, one a request: emitting ones, a chunk's first position (the state is another chunk's: ignored), a
    token without a state slot, one with entry slot -1, one re-running its slot's newest position (state_pos = t:
    the raw row is replaced, not folded); a running state of finite junk (den > 0)."""
    g = torch.Generator().manual_seed(9)
    pos = torch.tensor([ratio - 1, 3 * ratio - 1, 2 * ratio, 9 * ratio - 1, 5 * ratio - 1, 4 * ratio + 1])
    pos = torch.cat([pos, torch.tensor([2 * ratio - 1])])
    tslot = torch.tensor([0, 3, 1, 6, -1, 2, 5], dtype=torch.int32)
    eslot = torch.tensor([1, 6, 3, -1, 0, 2, 7], dtype=torch.int32)
    kv, sc = torch.randn(7, d, generator=g), torch.randn(7, d, generator=g)
    kv_state, sc_state, spos = online_state(7, d)
    sc_state.copy_(torch.randn(7, 2, d, generator=g))
    kv_state[:, 0] = torch.randn(7, d, generator=g)
    kv_state[:, 1] = torch.rand(7, d, generator=g) * 5 + 1
    kv_state[:, 2] = torch.randn(7, d, generator=g)
    by_slot = {int(s_): int(p) for s_, p in zip(tslot, pos, strict=True) if s_ >= 0}
    for s_, p in by_slot.items():
        spos[s_] = p - 1
    spos[0] = ratio - 1  # token 0 re-runs its position
    return [x.to(device) for x in (kv, sc, pos.to(torch.int32), tslot, eslot)], (kv_state, sc_state, spos)


def _state_copy(st, device):
    buf = torch.cat([st[0], st[1]], 1).to(device).contiguous()
    return buf[:, 0:3], buf[:, 3:5], st[2].to(device).clone()


@pytest.mark.parametrize("with_ape", [False, True])
def test_online_compress_decode_equals_the_step_paths(device, with_ape):
    """compress_decode(online) == compressor_step(decode=True, online) + emit_entries, bit for bit (the same pooling
    code), == the non-decode kernels and the torch reference to fp32 rounding; nothing else changes."""
    fmt = FP8EntryFormat()
    d, ratio = fmt.head_dim, 128
    (kv, sc, pos, tslot, eslot), st = _decode_batch(device, d)
    g = torch.Generator().manual_seed(2)
    w = (torch.rand(d, generator=g) + 0.5).to(device)
    inv = (1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))).to(device)
    flat = torch.randint(0, 256, (fmt.page_bytes(4) * 2,), generator=g, dtype=torch.uint8).to(device)
    ape = torch.randn(ratio, d, generator=g).to(device) if with_ape else None
    full = sc + ape[pos.long() % ratio] if with_ape else sc
    results = {}
    for name, backend, decode in (("step", "triton", True), ("prefill", "triton", False), ("ref", "torch", True)):
        k1, s1, p1 = _state_copy(st, device)
        f1 = flat.clone()
        pooled, emits = compressor_step(kv, full, pos, tslot, k1, s1, ratio, False, decode, backend, state_pos=p1)
        emits &= tslot >= 0
        emit_entries(pooled, emits, pos, w, 1e-6, inv, eslot, fmt.entry_pages(f1, 2, 4), fmt, ratio, backend=backend)
        results[name] = (f1, k1, s1, p1)
    counters = torch.zeros(7, dtype=torch.int32, device=device)
    for backend in ("triton", "torch"):
        k2, s2, p2 = _state_copy(st, device)
        f2 = flat.clone()
        compress_decode(
            kv, sc if with_ape else full, pos, tslot, k2, s2, counters, ratio, False, w, 1e-6, inv, eslot,
            fmt.entry_pages(f2, 2, 4), fmt, backend=backend, ape=ape, state_pos=p2,
        )  # fmt: skip
        results["fused_" + backend] = (f2, k2, s2, p2)
    f1, k1, s1, p1 = results["step"]
    want_pos = st[2].clone()
    want_pos[tslot[tslot >= 0].long().cpu()] = pos[tslot >= 0].cpu()
    assert torch.equal(p1.cpu(), want_pos)
    for name in ("fused_triton",):
        f, k, s, p = results[name]
        assert torch.equal(f, f1) and torch.equal(k, k1) and torch.equal(s, s1) and torch.equal(p, p1), name
    for name in ("prefill", "ref", "fused_torch"):
        f, k, s, p = results[name]
        assert torch.equal(s, s1) and torch.equal(p, p1), name
        torch.testing.assert_close(k, k1, atol=1e-5, rtol=1e-5)
        assert (f == f1).float().mean() > 0.99, name  # pooled sums round differently; bf16 / e4m3 nearly always agree
    assert not counters.any()
    # the state of the token without a slot (index 4) is untouched, and only entries of emitting tokens changed
    emitting = ((pos + 1) % ratio == 0) & (tslot >= 0) & (eslot >= 0)
    changed = set()
    new, old = fmt.page_views(f1, 2, 4), fmt.page_views(flat, 2, 4)
    for name in new:
        diff = (new[name].view(torch.uint8) != old[name].view(torch.uint8)).flatten(2).any(-1)
        changed |= {p * 4 + r for p, r in diff.nonzero().tolist()}
    assert sorted(changed) == sorted(eslot[emitting].tolist()) and len(changed) == 3
    untouched = torch.ones(7, dtype=torch.bool)
    untouched[tslot[tslot >= 0].long().cpu()] = False
    for i in untouched.nonzero().flatten().tolist():
        assert torch.equal(k1[i].cpu(), st[0][i]) and torch.equal(s1[i].cpu(), st[1][i])


def test_online_validation(device):
    fmt = FP8EntryFormat()
    d = fmt.head_dim
    (kv, sc, pos, tslot, eslot), st = _decode_batch(device, d)
    k, s, p = _state_copy(st, device)
    k0, s0, p0 = k.clone(), s.clone(), p.clone()
    with pytest.raises(ValueError, match="overlap"):
        compressor_step(kv, sc, pos, tslot, k, s, 128, True, state_pos=p)
    with pytest.raises(ValueError, match="score_state"):
        compressor_step(kv, sc, pos, tslot, k, k, 128, False, state_pos=p)
    with pytest.raises(ValueError, match="kv_state"):
        compressor_step(kv, sc, pos, tslot, s, s, 128, False, state_pos=p)
    with pytest.raises(ValueError, match="state_pos"):
        compressor_step(kv, sc, pos, tslot, k, s, 128, False, state_pos=p.long())
    with pytest.raises(ValueError, match="block_d"):
        compressor_step(kv, sc, pos, tslot, k, s, 128, False, decode=True, state_pos=p, block_d=64)
    ring = torch.zeros(7, 128, d, device=device)
    with pytest.raises(ValueError, match="kv_state"):
        compressor_step(kv, sc, pos, tslot, ring, ring.clone(), 128, False, state_pos=p)
    counters = torch.zeros(7, dtype=torch.int32, device=device)
    flat = torch.zeros(fmt.page_bytes(4) * 2, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="kind='main'"):  # (the indexer's compressor overlaps)
        compress_decode(kv, sc, pos, tslot, k, s, counters, 128, False, torch.ones(d, device=device), 1e-6,
                        torch.ones(32, device=device), eslot, fmt.entry_pages(flat, 2, 4), fmt, "indexer",
                        state_pos=p)  # fmt: skip
    if device.type == "cuda" or compressor_module.interpreter_enabled():  # (counters are checked on the Triton path)
        n = k.shape[0]
        for bad, what in ((torch.zeros(n, device=device), "dtype"), (counters[: n - 1], "shape")):
            with pytest.raises(ValueError, match=what):
                compressor_step(kv, sc, pos, tslot, k, s, 128, False, state_pos=p, counters=bad, backend="triton")
        with pytest.raises(ValueError, match="contiguous"):
            strided = torch.zeros(2 * n, dtype=torch.int32, device=device)[::2]
            compressor_step(kv, sc, pos, tslot, k, s, 128, False, state_pos=p, counters=strided, backend="triton")
    assert torch.equal(k, k0) and torch.equal(s, s0) and torch.equal(p, p0)  # a failed call changes nothing


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decode", [True, False])
def test_online_rerun_replaces_the_newest_row(device, backend, decode):
    """Re-running a step (a cancelled decode step run again, a replayed graph): the same inputs give the same pooled
    rows and state as one run; other inputs at the same positions give what one run with them gives."""
    ratio, d = 8, 16
    g = torch.Generator().manual_seed(4)
    kv_state, sc_state, spos = online_state(3, d, device)
    hist = torch.randn(2, 2 * ratio - 1, d, generator=g), torch.randn(2, 2 * ratio - 1, d, generator=g)
    pos = torch.arange(2 * ratio - 1, dtype=torch.int32).repeat(2).to(device)
    slots = torch.tensor([0] * (2 * ratio - 1) + [2] * (2 * ratio - 1), dtype=torch.int32, device=device)
    compressor_step(hist[0].flatten(0, 1).to(device), hist[1].flatten(0, 1).to(device), pos, slots, kv_state,
                    sc_state, ratio, False, backend=backend, state_pos=spos)  # fmt: skip
    step_pos = torch.full((2,), 2 * ratio - 1, dtype=torch.int32, device=device)  # both emit
    step_slot = torch.tensor([2, 0], dtype=torch.int32, device=device)
    rows = [(torch.randn(2, d, generator=g).to(device), torch.randn(2, d, generator=g).to(device)) for _ in range(2)]
    base = _state_copy((kv_state, sc_state, spos), device)

    def run(kv, sc, state):
        k, s, p = _state_copy(state, device)
        pooled, _ = compressor_step(kv, sc, step_pos, step_slot, k, s, ratio, False, decode, backend, state_pos=p)
        return pooled, (k, s, p)

    once, st1 = run(*rows[0], base)
    twice, st2 = run(*rows[0], st1)
    assert torch.equal(twice, once) and all(torch.equal(a, b) for a, b in zip(st1, st2, strict=True))
    other, st3 = run(*rows[1], st1)  # re-run with other rows
    want, st4 = run(*rows[1], base)
    assert torch.equal(other, want) and all(torch.equal(a, b) for a, b in zip(st3, st4, strict=True))
    assert not torch.equal(other, once)
