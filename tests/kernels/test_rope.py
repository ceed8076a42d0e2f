"""Query-side RoPE kernels (dsv4/kernels/rope.py): Triton (interpreter on CPU) vs the PyTorch references.

Tolerance (``_assert_matches``), from what can differ (see the module docstring of dsv4/kernels/rope.py):

- rotated (rope) channels: the kernel's cos/sin are numpy's under the interpreter (one fp32 ulp away from
  torch's CPU values in ~15 % of angles) and libdevice's on a GPU (expected equal to torch's CUDA values);
  one fp32 ulp in cos/sin rarely moves a bf16 rounding, so a rotated value may differ by one bf16 step,
  in a small counted fraction of values (< 1 % under the interpreter, < 0.1 % on a GPU);
- ``q_norm_rope``'s per-head mean is an fp32 sum in another order than torch's; a (token, head) row whose
  two sums round to different bf16 means is "moved": <= 2 bf16 steps on its unrotated channels, <= 2^-4 of
  the row's largest value on its rotated ones.  Under the interpreter the seeded data has no such row (0 of
  20,000 random rows of 512 moved when measured), so unrotated channels must be exact; on a GPU at most
  1 % of the rows may move (expected: none or a handful);
- everything else (``rope_inverse``'s copied channels, the rounding steps of the norm) is bit-exact.

On the CPU the reference is computed on inputs padded to a multiple of 64 rows (``_padded_reference``):
torch's scalar CPU tail rounds bf16 ``rsqrt`` twice, so on tiny tensors the unpadded reference moves rows
that its vectorised path, its CUDA kernel and the Triton kernel agree on (3 of 48 rows measured).
"""

import math

import pytest
import torch

from dsv4.engine.graphs import capture_graph
from dsv4.kernels.dispatch import interpreter_enabled
from dsv4.kernels.rope import q_norm_rope, q_norm_rope_reference, rope_inverse, rope_inverse_reference

RD = 64
EPS = 1e-6
# (max fraction of moved rows, max fraction of rotated values one bf16 step off) per device type
_BOUNDS = {"cpu": (0.0, 1e-2), "cuda": (1e-2, 1e-3)}


def _need_triton(device: torch.device) -> None:
    if device.type == "cpu" and not interpreter_enabled():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")


def _inv_freq(device, rd: int = RD) -> torch.Tensor:
    return (1.0 / (160000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))).to(device)


def _positions(t: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """0, 1M, 2^20 - 1 and 1 first, then random positions below 2^20."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.tensor([0, 1_000_000, (1 << 20) - 1, 1]), torch.randint(0, 1 << 20, (t,), generator=g)])
    return pos[:t].to(dtype).to(device)


def _heads(t: int, h: int, d: int, device, seed: int = 0) -> torch.Tensor:
    """bf16 [T, H, D]: head rows at scales 1e-4 .. 1e3 (near 1e-3 the mean of squares is ~eps, where the
    bf16-narrowed eps matters), one all-zero row, a few outliers."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 3, t * h)[torch.randperm(t * h, generator=g)].view(t, h, 1)
    x = torch.randn(t, h, d, generator=g) * scale
    if t * h > 2:
        x[0, -1] = 0.0
        x.view(-1, d)[1, :: d // 8] *= 40.0
    return x.bfloat16().to(device)


def _padded_reference(fn, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``fn(x, pos)`` computed on x padded with zero tokens to a multiple of 64 (token, head) rows, then sliced.

    Rows are independent, so this is the reference on these rows; the padding makes torch's CPU kernels take
    their vectorised path for every row.  Their scalar tail (the last < 64 elements of a tensor) computes a
    bf16 ``rsqrt`` as ``1 / sqrt`` with the square root rounded to bf16 first: a second rounding that the
    vectorised path, torch's CUDA kernel (``rsqrtf``) and the Triton kernel do not have.
    """
    t, h, _ = x.shape
    pad = -t % (64 // math.gcd(64, h))
    xp = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    return fn(xp, torch.cat([pos, pos.new_zeros(pad)]))[:t]


def _want_q(q: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return _padded_reference(lambda x, p: q_norm_rope_reference(x, p, inv, EPS), q, pos)


def _want_o(o: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return _padded_reference(lambda x, p: rope_inverse_reference(x, p, inv), o, pos)


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of bf16 values between a and b (0 = equal, +0 == -0), int32."""

    def key(x: torch.Tensor) -> torch.Tensor:
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (key(a) - key(b)).abs()


def _assert_matches(got: torch.Tensor, want: torch.Tensor, rd: int, device: torch.device) -> None:
    """The tolerance of the module docstring; failures report the counts."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and got.is_contiguous()
    if got.numel() == 0:
        return
    max_moved, max_rope = _BOUNDS[device.type]
    nope = got.shape[-1] - rd
    steps = _bf16_steps(got, want).cpu()
    moved = (steps[..., :nope] > 0).any(-1)  # [T, H]
    rows = moved.numel()
    assert moved.sum() <= max_moved * rows, f"{int(moved.sum())} of {rows} rows moved (norm rounded differently)"
    assert (steps[moved][:, :nope] <= 2).all(), "a moved row's unrotated value is > 2 bf16 steps off"
    diff = (got.float() - want.float()).abs().cpu()[moved][:, nope:]
    scale = want.float().abs().cpu()[moved].amax(-1, keepdim=True)
    assert (diff <= scale * 2.0**-4).all(), "a moved row's rotated value is off by more than 2^-4 of the row"
    rope = steps[~moved][:, nope:]
    off = int((rope > 0).sum())
    worst = int(rope.max()) if rope.numel() else 0
    assert worst <= 1, f"a rotated value is {worst} bf16 steps off"
    assert off <= max_rope * max(rope.numel(), 1), f"{off} of {rope.numel()} rotated values one bf16 step off"


CASES = [(t, h, d, pdt) for t in (0, 1, 3, 17) for h in (1, 4) for d, pdt in ((128, torch.int64), (512, torch.int32))]


@pytest.mark.parametrize("t, h, d, pos_dtype", CASES)
def test_q_norm_rope_matches_reference(device, t, h, d, pos_dtype):
    _need_triton(device)
    q = _heads(t, h, d, device)
    pos = _positions(t, pos_dtype, device)
    inv = _inv_freq(device)
    before = q.clone()
    got = q_norm_rope(q, pos, inv, EPS, backend="triton")
    assert torch.equal(q, before)
    _assert_matches(got, _want_q(q, pos, inv), RD, device)


@pytest.mark.parametrize("t, h, d, pos_dtype", CASES)
def test_rope_inverse_matches_reference(device, t, h, d, pos_dtype):
    _need_triton(device)
    o = _heads(t, h, d, device, seed=1)
    pos = _positions(t, pos_dtype, device, seed=1)
    inv = _inv_freq(device)
    got = rope_inverse(o, pos, inv, backend="triton")
    want = _want_o(o, pos, inv)
    assert torch.equal(got[..., : d - RD], o[..., : d - RD])  # copied
    _assert_matches(got, want, RD, device)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rope_inverse_in_place_equals_the_copy(device, backend):
    """``in_place=True`` returns o itself holding the copy's bytes; on a strided view (heads every other row of a
    wider tensor) nothing outside the view changes, and the nope channels are the input's."""
    if backend == "triton":
        _need_triton(device)
    t, h, d = 5, 3, 128
    wide = _heads(t, 2 * h, d, device, seed=3)
    pos, inv = _positions(t, torch.int32, device, seed=3), _inv_freq(device)
    o = wide[:, ::2]
    want = rope_inverse(o, pos, inv, backend=backend)
    before = wide.clone()
    got = rope_inverse(o, pos, inv, backend=backend, in_place=True)
    assert got is o and torch.equal(o, want)
    assert torch.equal(wide[:, 1::2], before[:, 1::2]) and torch.equal(o[..., : d - RD], before[:, ::2, : d - RD])
    with pytest.raises(ValueError, match="in_place"):
        rope_inverse(o, pos, inv, backend=backend, in_place=1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_q_norm_rope_writes_its_cos_sin(device, backend):
    """``cos_sin_out``: each token's (cos, sin) of its rotation, written by the same launch (from the programs of
    its first head block: every token once, with several head blocks); q unchanged by it.  The values are those the
    rotation used: rotating q's rope lanes back by them (``rotate_pairs`` with -sin) equals ``rope_inverse`` of q, bit
    for bit; against torch's cos / sin within one fp32 ulp (numpy's under the interpreter).  A wrong shape is
    refused."""
    from dsv4.model.functional import rotate_pairs

    if backend == "triton":
        _need_triton(device)
    t, h, d = 6, 4, 128
    q = _heads(t, h, d, device, seed=5)
    pos, inv = _positions(t, torch.int32, device, seed=5), _inv_freq(device)
    cs = torch.full((t, RD // 2, 2), float("nan"), device=device)
    y = q_norm_rope(q, pos, inv, EPS, backend, block_h=2 if backend == "triton" else None, cos_sin_out=cs)
    assert torch.equal(y, q_norm_rope(q, pos, inv, EPS, backend))
    ang = pos.double()[:, None] * inv.double()
    ref = torch.stack([torch.cos(ang.float().double()), torch.sin(ang.float().double())], dim=-1)
    assert torch.allclose(cs.double(), ref, rtol=0, atol=2.0**-23)
    back = rotate_pairs(y, cs[:, None, :, 0], -cs[:, None, :, 1])
    assert torch.equal(back, rope_inverse(y, pos, inv, backend=backend))
    with pytest.raises(ValueError, match="cos_sin_out"):
        q_norm_rope(q, pos, inv, EPS, backend, cos_sin_out=cs[:-1])


def test_strided_inputs_and_launch_geometry(device):
    """Views (heads every other row of a wider tensor, positions a column of packed metadata, inv_freq with a
    stride) are read by element; heads not a multiple of the head block are masked; the result does not
    depend on block_h / num_warps."""
    _need_triton(device)
    t, h, d = 5, 3, 128
    wide = _heads(t, 2 * h, d, device, seed=2)
    q = wide[:, ::2]
    meta = torch.stack([_positions(t, torch.int64, device, seed=2), torch.full((t,), 7, device=device)], dim=1)
    pos = meta[:, 0]
    inv = torch.stack([_inv_freq(device), torch.zeros(RD // 2, device=device)], dim=1)[:, 0]
    assert q.stride(1) == 2 * d and pos.stride(0) == 2 and inv.stride(0) == 2
    for op, ref in (
        (lambda **kw: q_norm_rope(q, pos, inv, EPS, backend="triton", **kw), _want_q(q, pos, inv)),
        (lambda **kw: rope_inverse(q, pos, inv, backend="triton", **kw), _want_o(q, pos, inv)),
    ):
        base = op()
        _assert_matches(base, ref, RD, device)
        for geometry in ({"block_h": 2}, {"block_h": 4, "num_warps": 1}, {"block_h": 1, "num_warps": 4}):
            assert torch.equal(op(**geometry), base), geometry


def test_torch_and_auto_backends(device):
    """backend="torch" is the reference itself; "auto" takes the kernel only on CUDA tensors."""
    q, pos, inv = _heads(3, 2, 128, device), _positions(3, torch.int32, device), _inv_freq(device)
    assert torch.equal(q_norm_rope(q, pos, inv, EPS, backend="torch"), q_norm_rope_reference(q, pos, inv, EPS))
    assert torch.equal(rope_inverse(q, pos, inv, backend="torch"), rope_inverse_reference(q, pos, inv))
    if device.type == "cpu":
        assert torch.equal(q_norm_rope(q, pos, inv, EPS), q_norm_rope_reference(q, pos, inv, EPS))
        assert torch.equal(rope_inverse(q, pos, inv), rope_inverse_reference(q, pos, inv))


def test_shapes_outside_the_kernel(device):
    """rd/2 not a power of two (or, for the norm, D not one): "triton" refuses by name, "auto" uses torch;
    rope_inverse takes any D."""
    _need_triton(device)
    q, pos = _heads(2, 2, 96, device), _positions(2, torch.int32, device)
    inv = _inv_freq(device)
    with pytest.raises(ValueError, match="^q: .*power-of-two head dim"):
        q_norm_rope(q, pos, inv, EPS, backend="triton")
    _assert_matches(rope_inverse(q, pos, inv, backend="triton"), _want_o(q, pos, inv), RD, device)
    inv48 = _inv_freq(device, rd=48)
    q = _heads(2, 2, 128, device)
    for call in (
        lambda: q_norm_rope(q, pos, inv48, EPS, backend="triton"),
        lambda: rope_inverse(q, pos, inv48, "triton"),
    ):
        with pytest.raises(ValueError, match="^inv_freq: .*power-of-two number"):
            call()
    assert torch.equal(q_norm_rope(q, pos, inv48, EPS), q_norm_rope_reference(q, pos, inv48, EPS))


@pytest.mark.parametrize("op", ["q_norm_rope", "rope_inverse"])
def test_bad_arguments_raise_naming_the_argument(device, op):
    name = "q" if op == "q_norm_rope" else "o"

    def call(x, pos, inv, backend="auto", **kw):
        if op == "q_norm_rope":
            return q_norm_rope(x, pos, inv, kw.get("eps", EPS), backend=backend)
        return rope_inverse(x, pos, inv, backend=backend)

    x, pos, inv = _heads(3, 2, 128, device), _positions(3, torch.int32, device), _inv_freq(device)
    bad = [
        (lambda: call(x.float(), pos, inv), f"^{name}: expected dtype torch.bfloat16, got torch.float32"),
        (lambda: call(x[0], pos, inv), f"^{name}: expected 3 dims, got shape \\(2, 128\\)"),
        (lambda: call(x.transpose(1, 2), pos, inv), f"^{name}: expected unit stride in the last dim"),
        (lambda: call(x.tolist(), pos, inv), f"^{name}: expected a torch.Tensor, got list"),
        (lambda: call(x, pos[:2], inv), r"^positions: expected shape \[3\], got \[2\]"),
        (lambda: call(x, pos.float(), inv), "^positions: expected dtype torch.int32 or torch.int64"),
        (lambda: call(x, pos[:, None], inv), r"^positions: expected shape \[3\], got \[3, 1\]"),
        (lambda: call(x, pos, inv.double()), "^inv_freq: expected dtype torch.float32"),
        (lambda: call(x, pos, inv[None]), "^inv_freq: expected 1 dims"),
        (lambda: call(x, pos, _inv_freq(device, rd=256)), r"^inv_freq: expected 1\.\.64 frequencies"),
        (lambda: call(x, pos, inv[:0]), r"^inv_freq: expected 1\.\.64 frequencies .*, got 0"),
        (lambda: call(x, pos, inv, backend="cuda"), "^backend: expected one of"),
    ]
    if device.type == "cpu":
        meta = torch.device("meta")
        bad.append((lambda: call(x, pos.to(meta), inv), "^positions: expected device cpu, got meta"))
        bad.append((lambda: call(x, pos, inv.to(meta)), "^inv_freq: expected device cpu, got meta"))
    if op == "q_norm_rope":
        bad.append((lambda: call(x, pos, inv, eps=-1e-6), "^eps: expected a non-negative float, got -1e-06"))
        bad.append((lambda: call(x, pos, inv, eps=None), "^eps: expected a non-negative float, got None"))
    for fn, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fn()


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("h", [64, 128])
def test_real_shapes_on_gpu(h):
    """V4 widths: T = 64 decode tokens (and a 1,024-token prefill chunk), D = 512, rd = 64, positions up to
    1M, libdevice cos/sin and explicitly rounded products vs torch's CUDA reference: the GPU bounds of
    ``_assert_matches`` (expected: bit-exact but for rare moved rows of q_norm_rope)."""
    dev = torch.device("cuda")
    d = 512
    inv = _inv_freq(dev)
    for t in (64, 1024):
        x = _heads(t, h, d, dev, seed=t)
        pos = _positions(t, torch.int32, dev, seed=t)
        _assert_matches(
            q_norm_rope(x, pos, inv, EPS, backend="triton"), q_norm_rope_reference(x, pos, inv, EPS), RD, dev
        )
        o = rope_inverse(x, pos, inv, backend="triton")
        assert torch.equal(o[..., :-RD], x[..., :-RD])  # copied
        _assert_matches(o, rope_inverse_reference(x, pos, inv), RD, dev)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ops_are_sync_free_and_capturable():
    """The Triton paths never synchronise with the host and replay from a CUDA graph with the same bytes."""
    dev = torch.device("cuda")
    x, pos, inv = _heads(64, 64, 512, dev), _positions(64, torch.int64, dev), _inv_freq(dev)
    for op in (
        lambda: q_norm_rope(x, pos, inv, EPS, backend="triton"),
        lambda: rope_inverse(x, pos, inv, backend="triton"),
    ):
        want = op()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            op()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        g, out = capture_graph(op)  # a host sync cannot be captured
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
