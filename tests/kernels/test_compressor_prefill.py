"""A prefill step of one compressor (dsv4/kernels/cache/compressor_prefill.py): ``compress_prefill`` in order (pool,
state write, emit; the state write optionally on a side stream) and with the fused emit (the pool program emits),
against ``compressor_step`` + ``emit_entries``.

Both Triton paths run the same emit helpers on the same fp32 pooled rows, so under the interpreter (numpy sums of the
same shapes) the bytes are equal; on the GPU the RMSNorm / Hadamard sums of the fused kernel run on another number
of warps than the emit kernel's, so a bf16 rounding of a normalised value may differ, rarely, as between any two
launch geometries of ``emit_entries``: there the test allows one differing page byte in 10,000 (at least 4) and takes
the state exactly.
"""

import pytest
import torch
import triton
import triton.language as tl

import dsv4.kernels.cache.compressor as compressor_module
import dsv4.kernels.cache.compressor_prefill as prefill_module
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat
from dsv4.kernels.cache.compressor import (
    _check_step,
    compressor_step,
    emit_entries,
    online_state,
    state_unread_by_step,
)
from dsv4.kernels.cache.compressor_prefill import _entry_row_split, _fusable, compress_prefill
from dsv4.kernels.cache.store import _fp8_row_offsets
from dsv4.kernels.dispatch import interpreter_enabled

INV = 1.0 / (160000.0 ** (torch.arange(0, 64, 2).float() / 64))


def _geometry(kind):
    """(ratio, overlap, format, d, emit kind) of a compressor kind."""
    ratio, overlap = (4, True) if kind.startswith("csa") else (128, False)
    fmt = MXFP4KeyFormat() if kind == "csa_indexer" else FP8EntryFormat()
    d = fmt.dim if kind == "csa_indexer" else fmt.head_dim
    return ratio, overlap, fmt, d, "indexer" if kind == "csa_indexer" else "main"


def _skip_cpu_without_interpreter(device):
    if device.type == "cpu" and not interpreter_enabled():
        pytest.skip("the Triton path on the CPU needs TRITON_INTERPRET=1")


def _equal_pages(got, ref, device):
    if device.type == "cpu":
        return torch.equal(got, ref)
    return (got != ref).sum().item() <= max(4, got.numel() // 10_000)  # (module docstring: sums across warp counts)


@pytest.mark.parametrize("overlap_write", [False, True])
@pytest.mark.parametrize("kind", ["csa_indexer", "hca", "hca_online"])
def test_compress_prefill_equals_step_then_emit(device, kind, overlap_write):
    """``compress_prefill`` = ``compressor_step`` then ``emit_entries`` (entry bytes and state equal), with the state
    write in order or on the side stream (CUDA; on the CPU there is none), an online state's positions written by
    its state write (``counters``); a call whose emit arguments are bad raises before touching the state."""
    _skip_cpu_without_interpreter(device)
    ratio, overlap, fmt, d, ekind = _geometry(kind.removesuffix("_online"))
    c = 2 if overlap else 1
    g = torch.Generator().manual_seed(21)
    pos = torch.arange(ratio - 3, 3 * ratio + 2, dtype=torch.int32)  # one request, a partial chunk at each end
    t = pos.numel()
    kv, sc = torch.randn(t, c * d, generator=g), torch.randn(t, c * d, generator=g)
    w = torch.rand(d, generator=g) + 0.5
    eslot = torch.arange(t, dtype=torch.int32)
    tslot = torch.zeros(t, dtype=torch.int32)
    n_pages = -(-t // 4)
    args = [x.to(device) for x in (kv, sc, pos, tslot, w, INV, eslot)]
    kv, sc, pos, tslot, w, inv, eslot = args
    if kind == "hca_online":
        st0 = online_state(1, d, device)
    else:
        st0 = (
            torch.zeros(1, c * ratio, c * d, device=device),
            torch.full((1, c * ratio, c * d), float("-inf"), device=device),
            None,
        )

    def make():
        flat = torch.zeros(fmt.page_bytes(4) * n_pages, dtype=torch.uint8, device=device)
        pages = fmt.entry_pages(flat, n_pages, 4) if ekind == "main" else fmt.key_pages(flat, n_pages, 4)
        if st0[2] is None:
            return flat, pages, st0[0].clone(), st0[1].clone(), None
        buf = torch.cat([st0[0], st0[1]], 1).clone()  # one [S, 5, d] buffer, as online_state
        return flat, pages, buf[:, 0:3], buf[:, 3:5], st0[2].clone()

    f1, p1, k1, s1, sp1 = make()
    pooled, emits = compressor_step(kv, sc, pos, tslot, k1, s1, ratio, overlap, backend="triton", state_pos=sp1)
    emit_entries(pooled, emits, pos, w, 1e-6, inv, eslot, p1, fmt, ratio, ekind, backend="triton")
    f2, p2, k2, s2, sp2 = make()
    cnt = torch.zeros(1, dtype=torch.int32, device=device)  # (online: the positions written by the state write)
    compress_prefill(
        kv, sc, pos, tslot, k2, s2, ratio, overlap, w, 1e-6, inv, eslot, p2, fmt, ekind, "triton", state_pos=sp2,
        counters=cnt if sp2 is not None else None, overlap_write=overlap_write, fuse_emit=False,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert f1.any() and torch.equal(f2, f1) and torch.equal(k2, k1) and torch.equal(s2, s1)
    if sp1 is not None:
        assert torch.equal(sp2, sp1) and int(sp2[0]) == int(pos[-1]) and not cnt.any()
    f3, p3, k3, s3, sp3 = make()
    # a norm weight of the wrong width (every backend); for the indexer a rope half of 31 frequencies, which only
    # the Triton emit rejects (the reference takes any even rope width); a format of another width than the
    # compressor's: all before the state changes
    bad = [{"w": w[:-1], "inv": inv, "match": "norm_weight"}]
    if ekind == "indexer":
        bad.append({"w": w, "inv": inv[:-1], "match": "power of two"})
    for b in bad:
        with pytest.raises(ValueError, match=b["match"]):
            compress_prefill(
                kv, sc, pos, tslot, k3, s3, ratio, overlap, b["w"], 1e-6, b["inv"], eslot, p3, fmt, ekind, "triton",
                state_pos=sp3, overlap_write=overlap_write,
            )  # fmt: skip
    fresh = make()
    assert torch.equal(k3, fresh[2]) and torch.equal(s3, fresh[3]) and not f3.any()


def _batch(kind, device, g, runs, drop_first_entry=False):
    """A prefill batch of requests ``runs`` = [(state slot, first position, tokens)] and 3 padding tokens (state slot
    -1, entry slot -1), random step rows and random state rows in 3 slots; ``drop_first_entry``: the first emitting
    token gets entry slot -1.  Returns (tensors on ``device``, (ratio, overlap, fmt, emit kind, pages))."""
    ratio, overlap, fmt, d, ekind = _geometry(kind)
    c = 2 if overlap else 1
    pos = torch.cat([torch.arange(p0, p0 + n) for _, p0, n in runs] + [torch.zeros(3, dtype=torch.int64)])
    tslot = torch.cat([torch.full((n,), s) for s, _, n in runs] + [torch.full((3,), -1)])
    t = pos.numel()
    emitting = ((pos + 1) % ratio == 0) & (tslot >= 0)
    eslot = torch.where(emitting, torch.cumsum(emitting.long(), 0) - 1, -1)
    if drop_first_entry:
        eslot[int(emitting.nonzero()[0])] = -1  # an emitting token whose entry is not stored
    kv, sc = torch.randn(t, c * d, generator=g), torch.randn(t, c * d, generator=g) * 2
    ks = torch.randn(3, c * ratio, c * d, generator=g)
    ss = torch.randn(3, c * ratio, c * d, generator=g)
    w = torch.rand(d, generator=g) + 0.5
    n_pages = int(emitting.sum()) // 4 + 1
    tensors = [x.to(device) for x in (kv, sc, pos.to(torch.int32), tslot.to(torch.int32), ks, ss, w, INV, eslot)]
    return tensors, (ratio, overlap, fmt, ekind, n_pages)


def _prefill_fresh(step, device, score=None, **kw):
    """``compress_prefill`` (Triton) of a ``_batch`` step into fresh pages and copies of its states (``score`` in place
    of the step's, ``kw`` its options): (page bytes, kv state, score state)."""
    (kv, sc, pos, tslot, ks0, ss0, w, inv, eslot), (ratio, overlap, fmt, ekind, n_pages) = step
    flat = torch.zeros(fmt.page_bytes(4) * n_pages, dtype=torch.uint8, device=device)
    pages = fmt.entry_pages(flat, n_pages, 4) if ekind == "main" else fmt.key_pages(flat, n_pages, 4)
    ks, ss = ks0.clone(), ss0.clone()
    compress_prefill(
        kv, sc if score is None else score, pos, tslot, ks, ss, ratio, overlap, w, 1e-6, inv, eslot, pages, fmt, ekind,
        "triton", **kw,
    )  # fmt: skip
    return flat, ks, ss


def _multi_request_step(kind, device, g):
    """A prefill batch of three requests and padding: request 0 continues from position 13 (its state holds random
    rows of the positions before), one of its emitting tokens has entry slot -1; request 1 starts at 0; request 2
    (another state slot) starts mid-chunk; 3 padding tokens (state slot -1, entry slot -1)."""
    ratio = _geometry(kind)[0]
    runs = [(0, 13, 45), (1, 0, 30), (2, 2 * ratio + 5, 20)] if ratio == 4 else [(0, 13, 300), (1, 0, 140)]
    return _batch(kind, device, g, runs, drop_first_entry=True)


@pytest.mark.parametrize("with_ape", [False, True])
@pytest.mark.parametrize("kind", ["csa_main", "csa_indexer", "hca"])
def test_fused_emit_equals_in_order(device, kind, with_ape, monkeypatch):
    """``fuse_emit=True`` writes the in-order path's entry bytes and state (CSA main and indexer take the fused
    launch; HCA's 128-row tiles cannot, and run in order), over several requests, a request continuing from its
    state, an entry slot of -1, and padding; ``with_ape``: the fused call adds ``ape`` in its kernels, the in-order
    one gets it added to ``score`` first."""
    _skip_cpu_without_interpreter(device)
    calls = []
    real = prefill_module._pool_emit

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(prefill_module, "_pool_emit", spy)
    step = _multi_request_step(kind, device, torch.Generator().manual_seed(5))
    (kv, sc, pos, *_), ratio = step[0], step[1][0]
    ape = (torch.randn(ratio, kv.shape[1], generator=torch.Generator().manual_seed(6)) * 3).to(device)
    out = []
    for fuse in (False, True):
        score = sc + ape[pos.long() % ratio] if with_ape and not fuse else sc
        out.append(_prefill_fresh(step, device, score, fuse_emit=fuse, ape=ape if with_ape and fuse else None))
    assert calls == ([1] if kind != "hca" else [])
    (f1, k1, s1), (f2, k2, s2) = out
    assert f1.any() and _equal_pages(f2, f1, device)
    assert torch.equal(k2, k1) and torch.equal(s2, s1)


@triton.jit
def _split_kernel(x_ptr, xn_ptr, xr_ptr, NT: tl.constexpr, NT_PAD: tl.constexpr, TILE: tl.constexpr, HR: tl.constexpr):
    noff, tin, _, _ = _fp8_row_offsets(NT_PAD * TILE, NT * TILE, NT, NT_PAD, TILE, HR, False)
    xn, xr = _entry_row_split(tl.load(x_ptr + tl.arange(0, NT_PAD * TILE)), tin, NT, NT_PAD, TILE, HR)
    tl.store(xn_ptr + noff, xn)
    tl.store(xr_ptr + 2 * tl.arange(0, HR)[None, :, None] + tl.arange(0, 2)[None, None, :], xr)


def test_entry_row_split_keeps_every_bit(device):
    """The fused main emit's split of a pooled row into nope tiles (rope tile zeroed) and rope pairs copies values
    bit for bit, -0.0 included (a sum over the tiles would turn a -0.0 into +0.0 when it adds a +0.0)."""
    _skip_cpu_without_interpreter(device)
    fmt = FP8EntryFormat()
    nt, tile = fmt.n_tiles, fmt.tile
    x = torch.randn(fmt.head_dim, generator=torch.Generator().manual_seed(1))
    x[fmt.nope_dim : fmt.nope_dim + 4] = torch.tensor([-0.0, 0.0, -0.0, -0.0])
    x[3] = -0.0
    x = x.to(device)
    xn = torch.full((8 * tile,), 7.0, device=device)
    xr = torch.full((fmt.rope_dim,), 7.0, device=device)
    _split_kernel[(1,)](x, xn, xr, NT=nt, NT_PAD=8, TILE=tile, HR=fmt.rope_dim // 2)
    want_n = torch.cat([x[: fmt.nope_dim], torch.zeros(tile, device=device)])
    assert torch.equal(xn.view(torch.int32), want_n.view(torch.int32))
    assert torch.equal(xr.view(torch.int32), x[fmt.nope_dim :].view(torch.int32))


def test_fusable_takes_the_fused_launch_only_where_it_applies():
    """The fused launch needs a row-ring state, the Triton path, no emit tuning and no ``row_loads`` / ``block_d``,
    and a pool tile of at most _FUSE_TILE_MAX values (CSA main [8, 512], indexer [8, 128]; not HCA [128, 512])."""
    if not interpreter_enabled():
        pytest.skip("CPU tensors on the Triton path need TRITON_INTERPRET=1")
    dev = torch.device("cpu")
    g = torch.Generator().manual_seed(0)

    def ok(kind, backend="triton", state_pos=None, step_kw=None, emit_kw=None, fmt=None):
        (kv, sc, pos, tslot, ks, ss, w, inv, eslot), (ratio, overlap, f, ekind, _) = _multi_request_step(kind, dev, g)
        geometry = _check_step(kv, sc, pos, tslot, ks, ss, ratio, overlap)
        return _fusable(
            kv, sc, pos, tslot, ks, ss, geometry, w, inv, eslot, fmt or f, ekind, backend, state_pos, step_kw, emit_kw,
        )  # fmt: skip

    assert ok("csa_main") and ok("csa_indexer") and not ok("hca")
    assert ok("csa_main", step_kw={"pool_block_t": 16, "write_lanes": 2})
    assert not ok("csa_main", backend="torch")
    assert not ok("csa_main", step_kw={"row_loads": 1}) and not ok("csa_main", step_kw={"block_d": 256})
    assert not ok("csa_main", emit_kw={"scan": 1})
    assert not ok("csa_main", state_pos=torch.zeros(3, dtype=torch.int32))
    assert not ok("csa_main", fmt=FP8EntryFormat(512, 128, tile=64))  # a rope of two tiles


def test_compress_prefill_refuses_a_format_of_another_width_before_any_change(monkeypatch):
    """A format whose width is not the compressor's fails before the state or a page byte changes (the in-order path
    used to pool and roll the state, then fail in the emit), fused or not."""
    if not interpreter_enabled():
        pytest.skip("CPU tensors on the Triton path need TRITON_INTERPRET=1")
    dev = torch.device("cpu")
    (kv, sc, pos, tslot, ks, ss, w, inv, eslot), (ratio, overlap, _, ekind, n_pages) = _multi_request_step(
        "csa_main", dev, torch.Generator().manual_seed(2)
    )
    other = FP8EntryFormat(256, 64)
    flat = torch.zeros(other.page_bytes(4) * n_pages, dtype=torch.uint8)
    before = (ks.clone(), ss.clone())
    for fuse in (False, True):
        with pytest.raises(ValueError, match="width 512"):
            compress_prefill(
                kv, sc, pos, tslot, ks, ss, ratio, overlap, w[:256], 1e-6, inv, eslot,
                other.entry_pages(flat, n_pages, 4), other, ekind, "triton", fuse_emit=fuse,
            )  # fmt: skip
    assert torch.equal(ks, before[0]) and torch.equal(ss, before[1]) and not flat.any()


@pytest.mark.parametrize("kind", ["csa_main", "csa_indexer"])
def test_fused_emit_over_chunked_steps_equals_in_order(device, kind):
    """Two requests prefilled together in random chunks (1-13 tokens a step, a request sometimes absent): after every
    step the fused path's state and pages equal the in-order path's, so its pooling reads the state the previous
    steps (fused) left, and its state write leaves what the next step needs."""
    _skip_cpu_without_interpreter(device)
    ratio, overlap, fmt, d, ekind = _geometry(kind)
    c = 2 if overlap else 1
    g = torch.Generator().manual_seed(8)
    lengths = [41, 29]
    hist = [(torch.randn(n, c * d, generator=g), torch.randn(n, c * d, generator=g)) for n in lengths]
    w, inv = (torch.rand(d, generator=g) + 0.5).to(device), INV.to(device)
    n_pages = sum(n // ratio for n in lengths) // 4 + 2
    paths = []
    for _ in range(2):
        flat = torch.zeros(fmt.page_bytes(4) * n_pages, dtype=torch.uint8, device=device)
        pages = fmt.entry_pages(flat, n_pages, 4) if ekind == "main" else fmt.key_pages(flat, n_pages, 4)
        ks = torch.zeros(2, c * ratio, c * d, device=device)
        paths.append((flat, pages, ks, torch.full_like(ks, float("-inf"))))
    done = [0, 0]
    base = [0, lengths[0] // ratio]  # each request's first entry slot
    while done != lengths:
        rows, pos, tslot, eslot = [], [], [], []
        for r in range(2):
            n = min(int(torch.randint(0, 14, (1,), generator=g)), lengths[r] - done[r])
            p = torch.arange(done[r], done[r] + n)
            rows.append((hist[r][0][p], hist[r][1][p]))
            pos.append(p)
            tslot.append(torch.full((n,), r))
            eslot.append(torch.where((p + 1) % ratio == 0, base[r] + p // ratio, -1))
            done[r] += n
        kv = torch.cat([x[0] for x in rows]).to(device)
        sc = torch.cat([x[1] for x in rows]).to(device)
        pos, tslot, eslot = (torch.cat(x).to(torch.int32).to(device) for x in (pos, tslot, eslot))
        for fuse, (_, pages, ks, ss) in zip((False, True), paths, strict=True):
            compress_prefill(
                kv, sc, pos, tslot, ks, ss, ratio, overlap, w, 1e-6, inv, eslot, pages, fmt, ekind, "triton",
                fuse_emit=fuse,
            )  # fmt: skip
        (f1, _, k1, s1), (f2, _, k2, s2) = paths
        assert torch.equal(k2, k1) and torch.equal(s2, s1) and _equal_pages(f2, f1, device)
    assert paths[0][0].any()


def _reads_state(s, n, ratio, overlap):
    """Brute force of ``state_unread_by_step``'s negation for one request: some entry completed in positions
    [s, s + n) pools a row of a position in [0, s) (which the pool takes from the state)."""
    cm = (2 if overlap else 1) * ratio
    return any((t + 1) % ratio == 0 and any(0 <= p < s for p in range(t - cm + 1, t + 1)) for t in range(s, s + n))


def test_state_unread_by_step_matches_brute_force():
    g = torch.Generator().manual_seed(8)
    for ratio, overlap in ((4, True), (4, False), (128, False), (8, True)):
        for _ in range(200):
            b = int(torch.randint(1, 4, (1,), generator=g))
            s = [int(x) for x in torch.randint(0, 3 * ratio, (b,), generator=g)]
            s = [0 if int(torch.randint(0, 3, (1,), generator=g)) == 0 else x for x in s]
            n = [int(x) for x in torch.randint(0, 3 * ratio, (b,), generator=g)]
            want = not any(_reads_state(a, k, ratio, overlap) for a, k in zip(s, n, strict=True))
            assert state_unread_by_step(s, n, ratio, overlap) == want, (ratio, overlap, s, n)
    assert state_unread_by_step([0, 0], [9, 1], 4, True) and not state_unread_by_step([0, 4], [9, 4], 4, True)
    assert state_unread_by_step([256, 5], [300, 2], 128, False) and not state_unread_by_step([250], [9], 128, False)
    with pytest.raises(ValueError, match="equal lengths"):
        state_unread_by_step([0], [1, 2], 4, True)


def _unread_step(kind, device, g):
    """A prefill batch whose poolings read no state row: request 0 from position 0, request 1 from 0 on another
    slot, request 2 completing no entry (CSA: positions 5, 6) or, without overlap, starting at 2m; 3 padding tokens.
    States hold random rows (rows no pooling may read, and rows that must survive where no token writes)."""
    ratio, overlap = _geometry(kind)[:2]
    runs = [(0, 0, 45), (2, 0, 3), (1, 5, 2)] if ratio == 4 else [(0, 0, 300), (1, 2 * ratio, 140), (2, 0, 5)]
    assert state_unread_by_step([p0 for _, p0, _ in runs], [n for _, _, n in runs], ratio, overlap)
    return _batch(kind, device, g, runs)


@pytest.mark.parametrize("with_ape", [False, True])
@pytest.mark.parametrize("kind", ["csa_main", "csa_indexer", "hca"])
def test_state_unread_pool_writes_the_state_in_one_launch(device, kind, with_ape, monkeypatch):
    """``compress_prefill(state_unread=True)`` (the pool launch writes the state, no state-write launch) leaves the
    state and page bytes of the in-order call, over requests from position 0, a request completing no entry or
    starting at a multiple of m, and padding, with and without ``ape`` (added to the stored score rows)."""
    _skip_cpu_without_interpreter(device)
    writes = []
    real = compressor_module._launch_state_write
    monkeypatch.setattr(compressor_module, "_launch_state_write", lambda *a: writes.append(1) or real(*a))
    step = _unread_step(kind, device, torch.Generator().manual_seed(9))
    kv, ks0, ratio = step[0][0], step[0][4], step[1][0]
    ape = (torch.randn(ratio, kv.shape[1], generator=torch.Generator().manual_seed(10)) * 3).to(device)
    kw = {"fuse_emit": False, "ape": ape if with_ape else None}
    out = [_prefill_fresh(step, device, state_unread=unread, **kw) for unread in (False, True)]
    assert writes == [1]  # the in-order call's state write only
    (f1, k1, s1), (f2, k2, s2) = out
    assert f1.any() and torch.equal(f2, f1)
    assert not torch.equal(k1, ks0) and torch.equal(k2, k1) and torch.equal(s2, s1)
    # past _STATE_IN_POOL_MAX_T tokens the promise changes nothing: the state-write launch runs
    monkeypatch.setattr(compressor_module, "_STATE_IN_POOL_MAX_T", kv.shape[0] - 1)
    f3, k3, s3 = _prefill_fresh(step, device, state_unread=True, **kw)
    assert writes == [1, 1] and torch.equal(f3, f1) and torch.equal(k3, k1) and torch.equal(s3, s1)


def test_state_unread_online_write_in_the_pool_launch(device, monkeypatch):
    """An online HCA state with ``counters`` and ``_ONLINE_STATE_IN_POOL``: ``state_unread=True`` writes each request's
    state (prefix, raw row) and position in the pool launch, as the in-order call's online write does (the same
    ``_online_write_block``): state, positions and page bytes equal, counters back at 0, no state-write launch."""
    _skip_cpu_without_interpreter(device)
    monkeypatch.setattr(compressor_module, "_ONLINE_STATE_IN_POOL", True)
    writes = []
    real = compressor_module._launch_state_write
    monkeypatch.setattr(compressor_module, "_launch_state_write", lambda *a: writes.append(1) or real(*a))
    (kv, sc, pos, tslot, _, _, w, inv, eslot), (ratio, overlap, fmt, ekind, n_pages) = _unread_step(
        "hca", device, torch.Generator().manual_seed(12)
    )
    d = kv.shape[1]
    k0, s0, sp0 = online_state(3, d, device)
    g = torch.Generator().manual_seed(13)
    k0.copy_(torch.randn(k0.shape, generator=g).to(device))  # (stale rows of earlier requests: all overwritten)
    s0.copy_(torch.randn(s0.shape, generator=g).to(device))
    sp0.copy_(torch.tensor([5, 200, 7], dtype=torch.int32, device=device))
    out = []
    for unread in (False, True):
        flat = torch.zeros(fmt.page_bytes(4) * n_pages, dtype=torch.uint8, device=device)
        pages = fmt.entry_pages(flat, n_pages, 4)
        buf = torch.cat([k0, s0], 1).clone()
        ks, ss, sp = buf[:, 0:3], buf[:, 3:5], sp0.clone()
        cnt = torch.zeros(3, dtype=torch.int32, device=device)
        compress_prefill(
            kv, sc, pos, tslot, ks, ss, ratio, overlap, w, 1e-6, inv, eslot, pages, fmt, ekind, "triton",
            state_pos=sp, counters=cnt, fuse_emit=False, state_unread=unread,
        )  # fmt: skip
        assert not cnt.any()
        out.append((flat, buf, sp))
    assert writes == [1]
    (f1, b1, p1), (f2, b2, p2) = out
    assert f1.any() and torch.equal(f2, f1) and torch.equal(b2, b1) and torch.equal(p2, p1)
    assert p1.tolist() == [299, 395, 4]  # each request's last position
