"""Cache write kernels (dsv4/kernels/cache/store.py): Triton (interpreter on CPU) vs the PyTorch references.

The FP8 / MXFP4 quantisation in the kernels is integer arithmetic on fp32 bits, so bytes must be
*equal* to ``fmt.quantize`` on every backend (no tolerance).  ``store_window`` adds RMSNorm, whose
fp32 sum order differs between tl.sum and torch: its bf16 rows may differ by one bf16 ulp on rare
rows; its stored bytes must still equal ``fmt.quantize`` of the kernel's own bf16 rows.
"""

import pytest
import torch
import triton
import triton.language as tl

from dsv4.engine.graphs import capture_graph
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat
from dsv4.kernels.cache._triton_quant import rope_cos_sin_at
from dsv4.kernels.cache.compressor import entry_positions
from dsv4.kernels.cache.store import (
    rope_cos_sin,
    store_fp8_entries,
    store_mxfp4_keys,
    store_window,
)
from dsv4.kernels.dispatch import interpreter_enabled

FMT = FP8EntryFormat()
KFMT = MXFP4KeyFormat()
BS, PAGES = 4, 5  # 20 slots


def _fp8_buffer(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, 256, (FMT.page_bytes(BS) * PAGES,), generator=g, dtype=torch.uint8).to(device)
    return flat, FMT.entry_pages(flat, PAGES, BS)


def _key_buffer(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, 256, (KFMT.page_bytes(BS) * PAGES,), generator=g, dtype=torch.uint8).to(device)
    return flat, KFMT.key_pages(flat, PAGES, BS)


def _slots(device):
    # 16 distinct in-range slots (4 untouched), plus -1, -7 and two out-of-range ones
    perm = torch.randperm(PAGES * BS, generator=torch.Generator().manual_seed(1))[:16]
    return torch.cat([perm, torch.tensor([-1, PAGES * BS, -7, 10_000])]).to(device)


def _fp8_rows(n, dtype, device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, FMT.head_dim, generator=g) * torch.logspace(-9, 4, n).unsqueeze(1)
    x[0, :64] = 0.0  # zero tile: amax floor
    x[1, 64:128] = -3e-5  # below the floor
    x[2, 128:192] = 448.0 * 2.0**-5  # amax exactly qmax * 2^k
    x[3, 192:256] = torch.linspace(-1, 1, 64) * 448.0 * (1 + 2**-20)  # just above a power-of-two boundary
    return x.to(dtype).to(device)


def _written(slots, num):
    s = slots.long().cpu()
    return s[(s >= 0) & (s < num)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_fp8_entries_bytes_equal_reference(device, dtype, slot_dtype):
    slots = _slots(device).to(slot_dtype)
    x = _fp8_rows(slots.numel(), dtype, device)
    flat_k, pages_k = _fp8_buffer(device)
    flat_r, pages_r = _fp8_buffer(device)
    before = flat_k.clone()
    store_fp8_entries(x, slots, pages_k, FMT, backend="triton")
    store_fp8_entries(x, slots, pages_r, FMT, backend="torch")
    assert torch.equal(flat_k, flat_r)
    # independently: each written slot holds fmt.quantize(row); everything else is unchanged
    expect = before.clone()
    views = FMT.page_views(expect, PAGES, BS)
    for i, s in enumerate(slots.long().cpu().tolist()):
        if 0 <= s < PAGES * BS:
            nope, rope, scale = FMT.quantize(x[i : i + 1])
            views["nope"][s // BS, s % BS] = nope[0]
            views["rope"][s // BS, s % BS] = rope[0]
            views["scale"][s // BS, s % BS] = scale[0]
    assert torch.equal(flat_k, expect)
    assert torch.equal(FMT.page_views(flat_k, PAGES, BS)["pad"], FMT.page_views(before, PAGES, BS)["pad"])


def test_e4m3_rounding_every_code_and_tie(device):
    """Every finite e4m3 value, every midpoint (ties to even) and its neighbours, both signs."""
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (vals[1:] + vals[:-1]) / 2
    cand = torch.cat([vals, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    cand = torch.cat([cand, -cand, torch.tensor([-0.0, 2.0**-12, -(2.0**-10)])])
    free = torch.ones(FMT.nope_dim, dtype=torch.bool)
    free[:: FMT.tile] = False  # the first value of every tile is 448: amax 448, scale 2^0 (byte 127)
    per_row = int(free.sum())
    rows = []
    for start in range(0, cand.numel(), per_row):
        chunk = cand[start : start + per_row]
        r = torch.zeros(FMT.head_dim)
        r[: FMT.nope_dim : FMT.tile] = 448.0
        r[torch.nonzero(free).squeeze(1)[: chunk.numel()]] = chunk
        rows.append(r)
    x = torch.stack(rows).to(device)
    slots = torch.arange(x.shape[0], device=device)
    flat, pages = _fp8_buffer(device)
    assert x.shape[0] <= PAGES * BS
    store_fp8_entries(x, slots, pages, FMT, backend="triton")
    got = pages.nope.reshape(-1, FMT.nope_dim)[: x.shape[0]].view(torch.uint8)
    want = x[:, : FMT.nope_dim].float().to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(pages.scale.reshape(-1, FMT.n_tiles)[: x.shape[0]], torch.full_like(got[:, : FMT.n_tiles], 127))
    assert torch.equal(got, want)


def test_store_mxfp4_keys_bytes_equal_reference(device):
    slots = _slots(device)
    n = slots.numel()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, KFMT.dim, generator=g) * torch.logspace(-36, 6, n).unsqueeze(1)
    grid = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 3.0, 0.26, 0.24, 4.9, 5.1])
    x[0, :32] = torch.cat([grid, -grid])  # block amax 6: scale 1, every tie of the e2m1 grid
    x[1, 32:64] = 0.0
    x = x.to(device)
    flat_k, pages_k = _key_buffer(device)
    flat_r, pages_r = _key_buffer(device)
    before = flat_k.clone()
    store_mxfp4_keys(x, slots, pages_k, KFMT, backend="triton")
    store_mxfp4_keys(x, slots, pages_r, KFMT, backend="torch")
    assert torch.equal(flat_k, flat_r)
    expect = before.clone()
    views = KFMT.page_views(expect, PAGES, BS)
    for i, s in enumerate(slots.long().cpu().tolist()):
        if 0 <= s < PAGES * BS:
            packed, scale = KFMT.quantize(x[i : i + 1])
            views["data"][s // BS, s % BS] = packed[0]
            views["scale"][s // BS, s % BS] = scale[0]
    assert torch.equal(flat_k, expect)


def _rope_inputs(t, device, seed=4):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(t, FMT.head_dim, generator=g) * 3).bfloat16().to(device)
    w = (torch.rand(FMT.head_dim, generator=g) + 0.5).to(device)
    pos = torch.randint(0, 1 << 20, (t,), generator=g, dtype=torch.int32).to(device)
    inv_freq = (1.0 / (160000.0 ** (torch.arange(0, FMT.rope_dim, 2).float() / FMT.rope_dim))).to(device)
    return kv, w, pos, inv_freq


def test_store_window_matches_reference(device):
    slots = _slots(device)
    t = slots.numel()
    kv, w, pos, inv_freq = _rope_inputs(t, device)
    flat_k, pages_k = _fp8_buffer(device)
    flat_r, pages_r = _fp8_buffer(device)
    before = flat_k.clone()
    out_k = torch.zeros(t, FMT.head_dim, dtype=torch.bfloat16, device=device)
    out_r = out_k.clone()
    store_window(kv, w, 1e-6, pos, inv_freq, slots, pages_k, FMT, out=out_k, backend="triton")
    store_window(kv, w, 1e-6, pos, inv_freq, slots, pages_r, FMT, out=out_r, backend="torch")
    # bf16 rows: equal up to one bf16 ulp (RMSNorm's fp32 sum order); almost always bit-equal
    rel = ((out_k.float() - out_r.float()).abs() / out_r.float().abs().clamp_min(1e-30)).max()
    assert rel <= 2.0**-7
    assert (out_k != out_r).float().mean() < 0.01
    # bytes: exactly fmt.quantize of the kernel's own rows, at the right slots, nothing else touched
    expect = before.clone()
    store_fp8_entries(out_k, slots, FMT.entry_pages(expect, PAGES, BS), FMT, backend="torch")
    assert torch.equal(flat_k, expect)
    if torch.equal(out_k, out_r):
        assert torch.equal(flat_k, flat_r)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("geometry", [{}, {"block_t": 4, "num_warps": 2, "iters": 2}])
def test_store_window_copy_to_writes_the_same_entries_at_second_slots(device, backend, geometry):
    """``copy_to`` = (slots2, pages2): every row's entry also at slots2 of another pool (another page size), the
    bytes ``store_fp8_entries`` writes from the rows ``out`` returns (what a prefill used to do in a second launch);
    -1 / out-of-range second slots skipped, nothing else of either pool touched."""
    if backend == "triton" and device.type == "cpu" and not interpreter_enabled():
        pytest.skip("the Triton path on the CPU needs TRITON_INTERPRET=1")
    slots = _slots(device)
    t = slots.numel()
    kv, w, pos, inv_freq = _rope_inputs(t, device)
    kw = geometry if backend == "triton" else {}
    bs2, n2 = 8, 4
    g = torch.Generator().manual_seed(7)
    slots2 = torch.randperm(bs2 * n2, generator=g)[:t].to(device)
    slots2[3], slots2[9], slots2[12] = -1, bs2 * n2, -5
    flat2_before = torch.randint(0, 256, (FMT.page_bytes(bs2) * n2,), generator=g, dtype=torch.uint8).to(device)
    flat, pages = _fp8_buffer(device)
    flat2 = flat2_before.clone()
    out = torch.zeros(t, FMT.head_dim, dtype=torch.bfloat16, device=device)
    store_window(
        kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, out=out, backend=backend,
        copy_to=(slots2, FMT.entry_pages(flat2, n2, bs2)), **kw,
    )  # fmt: skip
    expect = flat2_before.clone()
    store_fp8_entries(out, slots2, FMT.entry_pages(expect, n2, bs2), FMT, backend="torch")
    assert torch.equal(flat2, expect) and not torch.equal(flat2, flat2_before)
    flat_alone, pages_alone = _fp8_buffer(device)  # the ring's bytes are those of a call without copy_to
    store_window(kv, w, 1e-6, pos, inv_freq, slots, pages_alone, FMT, backend=backend, **kw)
    assert torch.equal(flat, flat_alone)


def test_store_window_copy_to_is_checked_before_anything_changes(device):
    slots = _slots(device)
    t = slots.numel()
    kv, w, pos, inv_freq = _rope_inputs(t, device)
    flat, pages = _fp8_buffer(device)
    before = flat.clone()
    flat2 = torch.zeros(FMT.page_bytes(4) * 8, dtype=torch.uint8, device=device)
    good = FMT.entry_pages(flat2, 8, 4)
    s2 = torch.arange(t, dtype=torch.int32, device=device)
    for copy_to, what in (
        ((s2[:-1], good), "slots"),
        ((s2.float(), good), "dtype"),
        ((s2, FP8EntryFormat(256, 64).entry_pages(flat2, 8, 4)), "pages"),
        (s2, "copy_to"),
    ):
        with pytest.raises(ValueError, match=what):
            store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, backend="torch", copy_to=copy_to)
    assert torch.equal(flat, before) and not flat2.any()


@pytest.mark.parametrize("geometry", [{}, {"block_t": 4, "num_warps": 2, "iters": 2}])
def test_store_window_records_ring_positions(device, geometry):
    """``ring_positions``: the store launch also writes each stored row's position at its slot (the window
    ring's table), exactly where the reference scatter writes; skipped rows (-1, out of range) write nothing
    but the reference's scratch element.  record_ring_positions (append_swa's one launch) does the same."""
    from dsv4.kernels.cache.ring import record_ring_positions, record_ring_positions_reference

    slots = _slots(device)
    t = slots.numel()
    kv, w, pos, inv_freq = _rope_inputs(t, device)
    pos = pos + 1000  # positions distinct from the table's initial values
    table0 = torch.arange(PAGES * BS + 1, dtype=torch.int32, device=device) - 50
    want = table0.clone()
    record_ring_positions_reference(slots, pos, want)
    for backend in ("torch", "triton"):
        table = table0.clone()
        _, pages = _fp8_buffer(device)
        kw = geometry if backend == "triton" else {}
        store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, backend=backend, ring_positions=table, **kw)
        assert torch.equal(table[:-1], want[:-1])
        table = table0.clone()
        record_ring_positions(slots, pos, table, backend=backend)
        assert torch.equal(table[:-1], want[:-1])
    assert not torch.equal(want[:-1], table0[:-1])
    with pytest.raises(ValueError, match="ring_positions"):
        store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, ring_positions=table0[:-1])


@pytest.mark.parametrize("geometry", [{}, {"block_t": 4, "num_warps": 2, "iters": 2}])
def test_store_window_sets_ring_heads(device, geometry):
    """``ring_head``: each request's last row of the step sets its ring page's head to (position + 1) mod ring in
    the store launch: the table ``advance_ring_head`` makes from the step's sequence lengths (its one launch, which
    the layer no longer makes).  Requests of 1 token (decode), of 3, and of ring + 2 (its first two rows -1: older
    than the ring, as a plan gives them), a padded row (-1) in between and at the end; pages not in the step keep
    their heads."""
    from dsv4.kernels.cache.ring import advance_ring_head_reference, record_ring_heads_reference

    reqs = [(3, 40, 1), (0, 17, 3), (4, 9, BS + 2), (1, 0, 1)]  # (request slot = ring page, first position, tokens)
    slots, pos, seq_lens = [], [], []
    for i, (page, p0, n) in enumerate(reqs):
        for p in range(p0, p0 + n):
            slots.append(page * BS + p % BS if p >= p0 + n - BS else -1)
            pos.append(p)
        seq_lens.append(p0 + n)
        if i == 1:
            slots.append(-1)  # a padded row
            pos.append(0)
    slots, pos = slots + [-1], pos + [0]
    slots = torch.tensor(slots, dtype=torch.int32, device=device)
    pos = torch.tensor(pos, dtype=torch.int32, device=device)
    t = slots.numel()
    kv, w, _, inv_freq = _rope_inputs(t, device)
    head0 = torch.arange(PAGES + 1, dtype=torch.int32, device=device) + 100
    want = head0.clone()
    advance_ring_head_reference(
        torch.tensor(seq_lens, device=device), torch.tensor([r[0] for r in reqs], device=device), want, BS
    )
    assert want[2] == head0[2] and not torch.equal(want, head0)
    ref = head0.clone()
    record_ring_heads_reference(slots, pos, ref, BS)
    assert torch.equal(ref, want)
    for backend in ("torch", "triton"):
        head = head0.clone()
        _, pages = _fp8_buffer(device)
        kw = geometry if backend == "triton" else {}
        store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, backend=backend, ring_head=head, **kw)
        assert torch.equal(head, want), backend
    with pytest.raises(ValueError, match="ring_head"):
        store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, ring_head=head0[:-1])


@pytest.mark.parametrize("geometry", [{}, {"block_t": 4, "num_warps": 2, "iters": 2}])
def test_store_window_writes_the_decode_window_index(device, geometry):
    """``window_index``: every row of the store launch writes its decode window, the ring slots of positions
    p - ring + 1 .. p in its ring page (-1 before position 0): on a stored row the index ``ring_window_slots`` builds
    from the step's positions and request slots (its one launch, which the layer's decode step no longer makes); the
    whole row -1 on a padded row (slot -1) and on an out-of-range slot.  Every row is written whole (the buffer starts
    as garbage); a wrong-shaped buffer is refused before anything is written."""
    from dsv4.kernels.cache.ring import ring_window_from_slots_reference, ring_window_slots_reference

    reqs = [(3, 40), (0, 2), (4, BS - 1), (1, 0), (2, 9)]  # (request slot = ring page, position): one token each
    slots = [page * BS + p % BS for page, p in reqs] + [-1, PAGES * BS]  # a padded row, an out-of-range slot
    pos = [p for _, p in reqs] + [0, 5]
    slots = torch.tensor(slots, dtype=torch.int32, device=device)
    pos = torch.tensor(pos, dtype=torch.int32, device=device)
    t = slots.numel()
    kv, w, _, inv_freq = _rope_inputs(t, device)
    want = ring_window_from_slots_reference(slots, pos, BS, PAGES * BS)
    pages_of = torch.tensor([page for page, _ in reqs], device=device)
    n = len(reqs)
    assert torch.equal(want[:n], ring_window_slots_reference(pos[:n], pages_of, BS))
    assert (want[n:] == -1).all() and (want[:n] == -1).any() and (want[:n] >= 0).any()
    for backend in ("torch", "triton"):
        win = torch.full((t, BS), 12345, dtype=torch.int32, device=device)
        flat, pages = _fp8_buffer(device)
        kw = geometry if backend == "triton" else {}
        store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, backend=backend, window_index=win, **kw)
        assert torch.equal(win, want), backend
        flat0 = flat.clone()
        with pytest.raises(ValueError, match="window_index"):
            store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, backend=backend, window_index=win[:-1])
        assert torch.equal(flat, flat0)


@pytest.mark.parametrize(
    "geometry",
    [
        {"block_t": 2},
        {"block_t": 8, "num_warps": 8},
        {"iters": 3},  # 19 rows: 7 programs, the last one with 1 row (prefetch of the next one masked off)
        {"block_t": 4, "num_warps": 2, "iters": 2},
    ],
)
def test_store_window_geometries_equal_one_row_per_program(device, geometry):
    """Blocks of rows / several blocks per program (tail partly past T; skipped slots inside blocks) change
    nothing against the default geometry (one row per program, one warp)."""
    slots = _slots(device)[:-1]  # 19 rows: not a multiple of any block
    t = slots.numel()
    kv, w, pos, inv_freq = _rope_inputs(t, device, seed=3)
    outs, flats = [], []
    for kw in ({}, geometry):
        flat, pages = _fp8_buffer(device)
        out = torch.zeros(t, FMT.head_dim, dtype=torch.bfloat16, device=device)
        store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, out=out, backend="triton", **kw)
        outs.append(out)
        flats.append(flat)
    if outs[0].device.type == "cpu":  # interpreter: numpy sums, the same order for any tile shape
        assert torch.equal(outs[0], outs[1]) and torch.equal(flats[0], flats[1])
    else:  # GPU: the RMSNorm sum order may follow the tile layout (rarely one bf16 ulp)
        assert (outs[0] != outs[1]).float().mean() < 0.01
    expect, _ = _fp8_buffer(device)
    store_fp8_entries(outs[1], slots, FMT.entry_pages(expect, PAGES, BS), FMT, backend="torch")
    assert torch.equal(flats[1], expect)


def test_store_window_bad_geometry_is_rejected(device):
    slots = _slots(device)
    kv, w, pos, inv_freq = _rope_inputs(slots.numel(), device)
    _, pages = _fp8_buffer(device)
    with pytest.raises(ValueError, match="block_t"):
        store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, backend="triton", block_t=3)
    with pytest.raises(ValueError, match="iters"):
        store_window(kv, w, 1e-6, pos, inv_freq, slots, pages, FMT, backend="triton", iters=0)


def test_store_window_rope_and_norm_semantics(device):
    """Reference semantics pinned independently: position 0 leaves the rope lanes unrotated."""
    t = 3
    kv, w, _, inv_freq = _rope_inputs(t, device)
    pos = torch.zeros(t, dtype=torch.int32, device=device)
    out = torch.empty(t, FMT.head_dim, dtype=torch.bfloat16, device=device)
    _, pages = _fp8_buffer(device)
    store_window(kv, w, 1e-6, pos, inv_freq, torch.full((t,), -1, device=device), pages, FMT, out=out, backend="triton")
    xf = kv.float()
    normed = (w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6))).bfloat16()
    assert (out.float() - normed.float()).abs().max() <= normed.float().abs().max() * 2**-7


def test_validation_errors(device):
    _, pages = _fp8_buffer(device)
    x = torch.zeros(2, FMT.head_dim, device=device)
    with pytest.raises(ValueError, match="slots"):
        store_fp8_entries(x, torch.zeros(2, dtype=torch.float32, device=device), pages, FMT)
    with pytest.raises(ValueError, match="x"):
        store_fp8_entries(x[:, :64], torch.zeros(2, dtype=torch.int32, device=device), pages, FMT)
    _, kpages = _key_buffer(device)
    with pytest.raises(ValueError, match="x"):
        store_mxfp4_keys(
            torch.zeros(2, 64, device=device), torch.zeros(2, dtype=torch.int32, device=device), kpages, KFMT
        )
    with pytest.raises(ValueError, match="backend"):
        store_fp8_entries(x, torch.zeros(2, dtype=torch.int32, device=device), pages, FMT, backend="cuda")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_slot_map_length_must_match_the_rows(device, backend):
    """Field bug: a slot map padded longer or cut shorter than the rows (a CUDA-graph batch, a prefix hit) writes
    the wrong rows or reads past the map.  Every store op refuses a map of N - 1 or N + 1 slots for N rows
    (ValueError naming ``slots``, nothing written), and an empty step (N = 0, empty map) writes nothing."""
    flat, pages = _fp8_buffer(device)
    kflat, kpages = _key_buffer(device)
    before, kbefore = flat.clone(), kflat.clone()
    n = 6
    kv, w, pos, inv_freq = _rope_inputs(n, device)
    x8 = torch.randn(n, FMT.head_dim, device=device)
    x4 = torch.randn(n, KFMT.dim, device=device)
    ops = {
        "store_fp8_entries": lambda x, sl: store_fp8_entries(x8[: len(x)], sl, pages, FMT, backend=backend),
        "store_mxfp4_keys": lambda x, sl: store_mxfp4_keys(x4[: len(x)], sl, kpages, KFMT, backend=backend),
        "store_window": lambda x, sl: store_window(
            kv[: len(x)], w, 1e-6, pos[: len(x)], inv_freq, sl, pages, FMT, backend=backend
        ),
    }
    for name, op in ops.items():
        for m in (n - 1, n + 1):
            slots = torch.arange(m, dtype=torch.int32, device=device)
            with pytest.raises(ValueError, match="slots"):
                op(range(n), slots)
            assert torch.equal(flat, before) and torch.equal(kflat, kbefore), (name, m)
        op(range(0), torch.zeros(0, dtype=torch.int32, device=device))
        assert torch.equal(flat, before) and torch.equal(kflat, kbefore), (name, 0)


@triton.jit
def _rope_probe_kernel(pos_ptr, inv_ptr, ratio, cos_ptr, sin_ptr, HR: tl.constexpr, INTERP: tl.constexpr):
    i = tl.program_id(0)
    j = tl.arange(0, HR)
    c, s = rope_cos_sin_at(pos_ptr + i, ratio, inv_ptr + j, INTERP)
    tl.store(cos_ptr + i * HR + j, c)
    tl.store(sin_ptr + i * HR + j, s)


@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_in_kernel_rope_cos_sin_matches_reference(device, ratio):
    """cos/sin computed in the kernel at the reference's fp32 angle (positions up to 2^20, negatives floor)."""
    if device.type == "cpu" and not interpreter_enabled():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(6)
    pos = torch.cat([torch.randint(0, 1 << 20, (13,), generator=g), torch.tensor([0, 1, 1 << 20, -1, -5, 127, 128])])
    pos = pos.to(torch.int32).to(device)
    _, _, _, inv = _rope_inputs(1, device)
    hr = inv.numel()
    cos = torch.empty(pos.numel(), hr, device=device)
    sin = torch.empty_like(cos)
    _rope_probe_kernel[(pos.numel(),)](pos, inv, ratio, cos, sin, HR=hr, INTERP=interpreter_enabled())
    want_c, want_s = rope_cos_sin(entry_positions(pos, ratio), inv)
    # same fp32 angle; cosf/sinf implementations agree to an ulp or two (libdevice == torch's on the GPU)
    torch.testing.assert_close(cos, want_c, atol=2.5e-7, rtol=0)
    torch.testing.assert_close(sin, want_s, atol=2.5e-7, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_store_ops_are_sync_free_and_capturable():
    """The Triton paths never synchronise with the host and replay from a CUDA graph with the same bytes."""
    dev = torch.device("cuda")
    slots = _slots(dev)
    t = slots.numel()
    kv, w, pos, inv_freq = _rope_inputs(t, dev)
    x = _fp8_rows(t, torch.bfloat16, dev)
    kx = torch.randn(t, KFMT.dim, device=dev)
    ops = [
        (_fp8_buffer, lambda p: store_window(kv, w, 1e-6, pos, inv_freq, slots, p, FMT, backend="triton")),
        (_fp8_buffer, lambda p: store_fp8_entries(x, slots, p, FMT, backend="triton")),
        (_key_buffer, lambda p: store_mxfp4_keys(kx, slots, p, KFMT, backend="triton")),
    ]
    for make, op in ops:
        flat_e, pages_e = make(dev)
        flat_g, pages_g = make(dev)
        op(pages_e)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            op(pages_e)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        g, _ = capture_graph(lambda pages_g=pages_g, op=op: op(pages_g))  # a host sync cannot be captured
        flat_g.copy_(make(dev)[0])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(flat_g, flat_e)


def test_strided_slot_tensors_are_read_by_element_not_by_memory(device):
    """A slot tensor that is a strided view (e.g. a column of an engine's packed metadata) must be read as
    its elements: the kernels index ptr + i, so the wrapper makes it contiguous."""
    if device.type == "cpu" and not interpreter_enabled():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    base = torch.tensor([[1, 9], [5, 9], [6, 9], [11, 9]], dtype=torch.int32, device=device)
    slots = base[:, 0]
    assert slots.stride(0) == 2
    x = _fp8_rows(4, torch.float32, device)
    flat_k, pages_k = _fp8_buffer(device)
    flat_r, pages_r = _fp8_buffer(device)
    store_fp8_entries(x, slots, pages_k, FMT, backend="triton")
    store_fp8_entries(x, slots, pages_r, FMT, backend="torch")
    assert torch.equal(flat_k, flat_r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "geometry",
    [{}, {"iters": 4}, {"block_t": 4}, {"block_t": 8, "num_warps": 8, "iters": 2}, {"block_t": 2, "num_warps": 1}],
)
def test_store_window_real_widths_on_gpu(geometry):
    """V4 widths (head_dim 512, rope 64, 7 tiles), 4,099 tokens over a 64-entry-page ring with skipped
    slots, positions up to 2^20, the hardware bf16 / e4m3 conversions: the bf16 rows match the reference up to
    RMSNorm's sum order and the stored bytes are exactly ``fmt.quantize`` of the kernel's own rows."""
    dev = torch.device("cuda")
    t, bs, pages_n = 4099, 64, 80
    g = torch.Generator().manual_seed(11)
    kv = (torch.randn(t, FMT.head_dim, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)).bfloat16().to(dev)
    kv[5, :64] = 0.0  # a zero tile: amax floor
    w = (torch.rand(FMT.head_dim, generator=g) + 0.5).to(dev)
    pos = torch.randint(0, 1 << 20, (t,), generator=g, dtype=torch.int32).to(dev)
    inv = (1.0 / (160000.0 ** (torch.arange(0, FMT.rope_dim, 2).float() / FMT.rope_dim))).to(dev)
    slots = torch.randperm(pages_n * bs, generator=g)[:t].to(torch.int32)
    slots[::97] = -1
    slots[1::101] = pages_n * bs + 3
    slots = slots.to(dev)

    def buf():
        flat = torch.randint(0, 256, (FMT.page_bytes(bs) * pages_n,), generator=torch.Generator().manual_seed(2))
        flat = flat.to(torch.uint8).to(dev)
        return flat, FMT.entry_pages(flat, pages_n, bs)

    (fk, pk), (fr, pr), (fe, pe) = buf(), buf(), buf()
    ok_, or_ = (torch.zeros(t, FMT.head_dim, dtype=torch.bfloat16, device=dev) for _ in range(2))
    store_window(kv, w, 1e-6, pos, inv, slots, pk, FMT, out=ok_, backend="triton", **geometry)
    store_window(kv, w, 1e-6, pos, inv, slots, pr, FMT, out=or_, backend="torch")
    store_fp8_entries(ok_, slots, pe, FMT, backend="torch")
    torch.cuda.synchronize()
    assert torch.equal(fk, fe)  # bytes == fmt.quantize(kernel rows): the e4m3 / scale / rope bytes are exact
    # bf16 rows: RMSNorm's sum order and, at angles up to 2^20 rad, the last fp32 bit of libdevice's vs torch's
    # sin/cos can move a bf16 rounding by one step; H200 2026-12-02: max relative 0.0084 (one step of a value
    # just above a power of two after RoPE's cancellation), so the bound is two steps (2^-6), and such
    # differences must stay rare (< 0.1 % of the values).
    rel = ((ok_.float() - or_.float()).abs() / or_.float().abs().clamp_min(1e-30)).max()
    assert rel <= 2.0**-6
    assert (ok_ != or_).float().mean() < 1e-3
    assert (fk != fr).float().mean() < 1e-3


def test_store_window_small_format_without_vector_runs(device):
    """A format whose tile (4) is not a multiple of the kernel's 8-value runs takes the plain layout: the same
    semantics (bytes = fmt.quantize of the kernel's rows, rows = the reference's up to RMSNorm's sum order)."""
    fmt = FP8EntryFormat(head_dim=36, rope_dim=8, tile=4)
    t, bs, pages_n = 6, 4, 2
    g = torch.Generator().manual_seed(8)
    kv = (torch.randn(t, fmt.head_dim, generator=g) * 2).bfloat16().to(device)
    w = (torch.rand(fmt.head_dim, generator=g) + 0.5).to(device)
    pos = torch.tensor([0, 1, 7, 1000, 65_535, 1 << 20], dtype=torch.int32, device=device)
    inv = (1.0 / (10000.0 ** (torch.arange(0, fmt.rope_dim, 2).float() / fmt.rope_dim))).to(device)
    slots = torch.tensor([3, -1, 0, 7, 5, 100], dtype=torch.int32, device=device)
    flats, outs = [], []
    for backend in ("triton", "torch"):
        flat = torch.zeros(fmt.page_bytes(bs) * pages_n, dtype=torch.uint8, device=device)
        out = torch.zeros(t, fmt.head_dim, dtype=torch.bfloat16, device=device)
        store_window(kv, w, 1e-6, pos, inv, slots, fmt.entry_pages(flat, pages_n, bs), fmt, out=out, backend=backend)
        flats.append(flat)
        outs.append(out)
    assert ((outs[0].float() - outs[1].float()).abs() <= outs[1].float().abs() * 2**-7).all()
    expect = torch.zeros_like(flats[0])
    store_fp8_entries(outs[0], slots, fmt.entry_pages(expect, pages_n, bs), fmt, backend="torch")
    assert torch.equal(flats[0], expect)
