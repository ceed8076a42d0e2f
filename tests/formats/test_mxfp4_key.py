import pytest
import torch

from dsv4.formats import MXFP4KeyFormat, e2m1_decode, e2m1_encode

K = MXFP4KeyFormat()


def test_geometry():
    assert (K.data_bytes, K.n_blocks, K.entry_bytes) == (64, 4, 68)
    assert K.page_bytes(64) == 64 * 68 and K.scale_offset(64) == 4096


def test_e2m1_rounding_ties_to_even_code():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, 6.0, -0.75, -0.1, 0.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0, -1.0, 0.0, 0.0]
    got = e2m1_decode(e2m1_encode(v))
    assert got.tolist() == want
    assert e2m1_encode(torch.tensor([-0.1]))[0] == 0  # negative zero is stored as +0


def test_quantize_scale_rule_and_packing():
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 6.0, -3.0  # block 0: amax 6 -> scale 2**0
    x[0, 32] = 7.0  # block 1: 7/6 -> scale 2**1, 7/2 = 3.5 -> 4 (tie to even code) -> 8.0
    packed, scale = K.quantize(x)
    assert scale[0, :2].tolist() == [127, 128]
    assert packed[0, 0] == (0b0111 | (0b1101 << 4))  # 6.0 low nibble, -3.0 high nibble
    y = K.dequantize(packed, scale)
    assert y[0, 0] == 6.0 and y[0, 1] == -3.0 and y[0, 32] == 8.0
    # An all-zero block uses the amax floor 6*2**-126 -> scale 2**-126 -> byte 1.
    assert scale[0, 2:].tolist() == [1, 1]


def test_roundtrip_bound_and_requantise_exact():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 128, generator=g) * torch.logspace(-4, 4, 32)[:, None]
    y = K.roundtrip(x, dtype=torch.float32)
    xb, yb = x.unflatten(-1, (4, 32)), y.unflatten(-1, (4, 32))
    amax = xb.abs().amax(-1, keepdim=True)
    # e2m1 grid spacing is at most 2 (between 4 and 6) on values scaled to <= 6: |err| <= amax/6 * 1 * 2
    assert ((xb - yb).abs() <= amax / 3).all()
    p1, s1 = K.quantize(y)
    assert torch.equal(K.dequantize(p1, s1), y)
    assert torch.equal(K.roundtrip(y, dtype=torch.bfloat16).float(), y)  # exact in bf16 too


def test_page_views():
    buf = torch.zeros(2 * K.page_bytes(4), dtype=torch.uint8)
    kp = K.key_pages(buf, 2, 4)
    kp.data[1, 2, 3] = 7
    kp.scale[1, 2, 1] = 9
    assert buf[K.page_bytes(4) + 2 * 64 + 3] == 7 and buf[K.page_bytes(4) + 4 * 64 + 2 * 4 + 1] == 9


def test_bad_input():
    with pytest.raises(ValueError, match="last dim 128"):
        K.quantize(torch.zeros(1, 64))
    with pytest.raises(ValueError, match="multiple of block"):
        MXFP4KeyFormat(dim=100)
