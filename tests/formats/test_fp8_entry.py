import pytest
import torch

from dsv4.formats import FP8_DTYPE, FP8EntryFormat

F = FP8EntryFormat()


def test_geometry_is_flashmla_model1():
    assert (F.nope_dim, F.n_tiles, F.data_bytes, F.scale_stride, F.entry_bytes) == (448, 7, 576, 8, 584)
    assert F.page_bytes(64) == 37440 and F.page_bytes(2) == 1728 and F.page_bytes(128) == 74880
    assert F.scale_offset(64) == 64 * 576


def test_page_views_alias_the_flashmla_byte_positions():
    pages, bs = 2, 64
    buf = torch.zeros(pages * F.page_bytes(bs), dtype=torch.uint8)
    v = F.page_views(buf, pages, bs)
    v["nope"][1, 3, 5] = 1.0  # e4m3 1.0 = 0x38
    v["rope"][1, 3, 0] = 1.0  # bf16 1.0 = 0x3F80, little endian
    v["scale"][1, 3, 6] = 0xAB
    base = F.page_bytes(bs)
    assert buf[base + 3 * 576 + 5] == 0x38
    assert buf[base + 3 * 576 + 448] == 0x80 and buf[base + 3 * 576 + 449] == 0x3F
    assert buf[base + 64 * 576 + 3 * 8 + 6] == 0xAB
    assert int((buf != 0).sum()) == 4
    assert v["pad"].shape == (2, 64, 1)


def test_quantize_rule_scale_and_rounding():
    x = torch.zeros(1, 512)
    x[0, 0] = 448.0  # amax/448 = 1 -> scale 2**0 -> byte 127
    x[0, 64] = 449.0  # just above -> scale 2**1 -> byte 128; 449/2 = 224.5 -> e4m3 RNE 224
    x[0, 128:192] = 0.0  # amax floored at 1e-4 -> scale 2**ceil(log2(1e-4/448)) = 2**-22
    q, rope, s = F.quantize(x)
    assert s[0, :3].tolist() == [127, 128, 127 - 22]
    assert q[0, 0].float() == 448.0 and q[0, 64].float() == 224.0
    assert rope.dtype == torch.bfloat16 and rope.shape == (1, 64)


def test_roundtrip_error_bound_and_requantise_exact():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 64)[:, None]).to(torch.bfloat16)
    y = F.roundtrip(x)
    xs, ys = x[:, :448].float().unflatten(-1, (7, 64)), y[:, :448].float().unflatten(-1, (7, 64))
    amax = xs.abs().amax(-1, keepdim=True)
    # e4m3 has 3 mantissa bits: relative step 2**-3 at the top of a binade -> |err| <= amax * 2**-4 * 2 (scale
    # rounding up to a power of two can leave amax/s in [224, 448]).
    assert ((xs - ys).abs() <= amax * 2**-3).all()
    assert torch.equal(y[:, 448:], x[:, 448:])
    # Re-quantising a representable entry gives the same bytes.
    assert torch.equal(F.encode(y), F.encode(F.roundtrip(y)))
    assert torch.equal(F.roundtrip(y), y)


def test_encode_layout_and_zero_pad():
    x = torch.randn(3, 512)
    b = F.encode(x)
    q, rope, s = F.quantize(x)
    assert b.shape == (3, 584)
    assert torch.equal(b[:, :448], q.view(torch.uint8))
    assert torch.equal(b[:, 448:576], rope.contiguous().view(torch.uint8))
    assert torch.equal(b[:, 576:583], s) and (b[:, 583] == 0).all()


def test_bad_input():
    with pytest.raises(ValueError, match="last dim 512"):
        F.quantize(torch.zeros(2, 500))
    with pytest.raises(ValueError, match="dtype"):
        F.quantize(torch.zeros(2, 512, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        F.dequantize(
            torch.zeros(2, 448), torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 7, dtype=torch.uint8)
        )
    with pytest.raises(ValueError, match="multiple of tile"):
        FP8EntryFormat(head_dim=500)
    assert F.quantize(torch.zeros(1, 512))[0].dtype == FP8_DTYPE
