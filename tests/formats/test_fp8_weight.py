"""The checkpoint's block-scaled FP8 linear weight (dsv4/formats/fp8_weight.py)."""

import pytest
import torch

from dsv4.formats.fp8_weight import (
    E4M3_MAX,
    WEIGHT_BLOCK,
    FP8Weight,
    expand_scale,
    scale_shape,
    scale_to_fp32,
    stack_rows,
)
from dsv4.model.weights import dequantize_fp8_weight


def _random(o, i, seed=0, spread=8.0):
    g = torch.Generator().manual_seed(seed)
    # blocks of very different magnitudes, so the per-block scales differ
    mag = torch.exp2(torch.randint(-int(spread), int(spread) + 1, scale_shape(o, i), generator=g).float())
    mag = mag.repeat_interleave(WEIGHT_BLOCK, 0)[:o].repeat_interleave(WEIGHT_BLOCK, 1)[:, :i]
    return torch.randn(o, i, generator=g) * mag


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (64, 1000), (1, 1)])
def test_quantize_blocks_scales_and_values(shape):
    w = _random(*shape)
    q = FP8Weight.quantize(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == shape
    assert q.scale.dtype == torch.float32 and tuple(q.scale.shape) == scale_shape(*shape)
    assert q.pow2_scales()
    # every block's largest |value| / scale fits e4m3, and the scale is the smallest power of two doing so
    deq = q.dequantize()
    o, i = shape
    ratio = (w.abs() / expand_scale(q.scale, o, i)).amax()
    assert ratio <= E4M3_MAX
    # e4m3 keeps 4 significant bits: each value within half an e4m3 ulp (2^-4 relative) or a subnormal step
    err = (deq - w).abs()
    bound = 2.0**-4 * w.abs() + expand_scale(q.scale, o, i) * 2.0**-10
    assert bool((err <= bound).all())
    # dequantised values are exact in bf16 (power-of-two scales)
    assert torch.equal(q.dequantize(torch.bfloat16).float(), deq)
    # the loader's function agrees
    assert torch.equal(dequantize_fp8_weight(q.data, q.scale), deq)


def test_quantize_all_zero_block_uses_the_floor():
    w = torch.zeros(130, 128)
    w[128:, :] = 1.0
    q = FP8Weight.quantize(w)
    assert q.scale[0, 0] > 0 and torch.isfinite(q.scale).all()
    assert torch.equal(q.dequantize(), w)


def test_from_checkpoint_e8m0_and_fp32_scales():
    q = FP8Weight.quantize(_random(256, 384, seed=1))
    e8 = (torch.log2(q.scale).to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    a = FP8Weight.from_checkpoint(q.data, e8)
    b = FP8Weight.from_checkpoint(q.data, q.scale)
    assert torch.equal(a.scale, q.scale) and torch.equal(b.scale, q.scale)
    assert torch.equal(scale_to_fp32(e8), q.scale)
    nonpow2 = FP8Weight.from_checkpoint(q.data, q.scale * 1.5)
    assert not nonpow2.pow2_scales()
    assert a.nbytes == 256 * 384 + 4 * 2 * 3 and a.numel() == 256 * 384


@pytest.mark.parametrize(
    "data, scale, match",
    [
        (torch.zeros(4, 4), torch.ones(1, 1), "float8_e4m3fn"),
        (torch.zeros(4, dtype=torch.float8_e4m3fn), torch.ones(1, 1), "2-D"),
        (torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(2, 1), r"shape \[1, 1\]"),
        (torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.float64), "float32"),
        (torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.zeros(1, 1), "finite and > 0"),
        (torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.full((1, 1), float("inf")), "finite and > 0"),
        (torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.int32), "float8_e8m0fnu or"),
    ],
)
def test_from_checkpoint_refuses(data, scale, match):
    with pytest.raises(ValueError, match=match):
        FP8Weight.from_checkpoint(data, scale)


def test_constructor_refuses_non_contiguous_and_wrong_types():
    d = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="contiguous"):
        FP8Weight(d.t(), torch.ones(2, 2))
    with pytest.raises(ValueError, match="data"):
        FP8Weight("w", torch.ones(2, 2))
    with pytest.raises(ValueError, match="scale"):
        FP8Weight(d, None)
    with pytest.raises(ValueError, match="2-D floating"):
        FP8Weight.quantize(torch.zeros(3, 3, dtype=torch.int32))


def test_stack_rows_views_and_values():
    """``stack_rows``: one weight of the inputs' rows in order (the last may end on a partial scale block), each
    input's view of it holds its values and points into the stack (no copy)."""
    g = torch.Generator().manual_seed(3)
    ws = [FP8Weight.quantize(torch.randn(n, 200, generator=g)) for n in (256, 128, 64)]
    cat, views = stack_rows(ws)
    assert cat.shape == (448, 200) and cat.scale.shape == scale_shape(448, 200)
    assert torch.equal(cat.dequantize(), torch.cat([w.dequantize() for w in ws]))
    row = 0
    for w, v in zip(ws, views, strict=True):
        assert torch.equal(v.dequantize(), w.dequantize())
        assert v.data.data_ptr() == cat.data.data_ptr() + row * 200
        row += w.shape[0]


def test_stack_rows_refuses_what_does_not_stack():
    """None (the caller keeps the weights apart): one weight, a tensor among them, different input widths, a row count
    mid-list off the 128-row scale blocks."""
    g = torch.Generator().manual_seed(4)
    a, b = FP8Weight.quantize(torch.randn(128, 64, generator=g)), FP8Weight.quantize(torch.randn(64, 64, generator=g))
    assert stack_rows([a]) is None
    assert stack_rows([a, torch.randn(128, 64)]) is None
    assert stack_rows([a, FP8Weight.quantize(torch.randn(128, 32, generator=g))]) is None
    assert stack_rows([b, a]) is None
    assert stack_rows([a, b]) is not None
