"""The bit-level Triton helpers of the write kernels against the format module's PyTorch definitions."""

import torch
import triton
import triton.language as tl

from dsv4.formats import e2m1_encode
from dsv4.formats.mxfp4_key import E2M1_VALUES
from dsv4.kernels.cache._triton_quant import e2m1_code, e2m1_round


@triton.jit
def _e2m1_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, e2m1_code(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


@triton.jit
def _e2m1_round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, e2m1_round(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


def _edge_values() -> torch.Tensor:
    """Every e2m1 value and rounding midpoint, each with its fp32 neighbours, both signs; zeros; values past 6
    (saturation) up to the fp32 maximum; a log-uniform spread over [2**-30, 2**30)."""
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    mids = (vals[:-1] + vals[1:]) / 2
    pts = torch.cat([vals, mids, torch.tensor([6.5, 7.0, 8.0, 12.0, 1e10, 3.0e38])])
    near = torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1)])
    g = torch.Generator().manual_seed(0)
    spread = torch.exp2(torch.rand(4096, generator=g) * 60 - 30) * (torch.rand(4096, generator=g) + 0.5)
    grid = torch.linspace(0, 7, 4097)  # dense over the format's range
    x = torch.cat([near, spread, grid, torch.tensor([0.0, -0.0])])
    return torch.cat([x, -x]).float()


def test_e2m1_code_equals_the_formats_encoder(device):
    """Every tie (to the even code), each side of every midpoint, saturation and -0 -> +0 code as ``e2m1_encode``."""
    x = _edge_values().to(device)
    out = torch.empty(x.shape, dtype=torch.int32, device=device)
    _e2m1_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = e2m1_encode(x).to(torch.int32)
    bad = (out != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), out[i].item(), want[i].item()) for i in bad[:8]]


def test_e2m1_round_is_the_value_of_the_code(device):
    """``e2m1_round`` gives the format's value of ``e2m1_encode``'s code at every edge value, bit for bit (-0 and
    values that round to zero give +0, as the code 0 decodes)."""
    x = _edge_values().to(device)
    out = torch.empty_like(x)
    _e2m1_round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    code = e2m1_encode(x.cpu()).long()
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32)[code & 7]
    want = torch.where((code & 8) != 0, -mag, mag)
    got = out.cpu()
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:8]]
