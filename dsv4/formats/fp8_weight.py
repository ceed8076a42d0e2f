"""The checkpoint's block-scaled FP8 linear weight, kept as it is stored: ``FP8Weight``.

DeepSeek-V4's released checkpoints store every dense linear weight ``[out, in]`` as ``float8_e4m3fn`` with one
scale per ``WEIGHT_BLOCK x WEIGHT_BLOCK`` block (``scale_fmt = "ue8m0"``: the scale is a power of two, stored as
``float8_e8m0fnu``; Hugging Face conversions may carry fp32 ``weight_scale_inv``).  The weight's value is
``w[o, i] = fp32(data[o, i]) · scale[o // 128, i // 128]``.

With a power-of-two scale every such value is exact in bf16 (e4m3 has 4 significant bits), so a GEMM that
multiplies bf16 activations by ``data`` and scales each 128-wide K block's partial sum by its scale computes the
same products as a bf16 GEMM on the dequantised weight, from half the bytes (``kernels.fp8_linear``).

Bytes: ``out·in`` (data) + ``4·ceil(out/128)·ceil(in/128)`` (the scale, kept as fp32 here) against ``2·out·in`` for
the dequantised bf16 weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.formats.ue8m0 import UE8M0_BIAS, ceil_log2_ratio

WEIGHT_BLOCK = 128  # rows and columns of a weight block that share one scale
E4M3_MAX = 448.0

__all__ = ["E4M3_MAX", "WEIGHT_BLOCK", "FP8Weight", "expand_scale", "scale_shape", "scale_to_fp32", "stack_rows"]


def scale_shape(out_features: int, in_features: int, block: int = WEIGHT_BLOCK) -> tuple[int, int]:
    """Shape of the block scale of an ``[out_features, in_features]`` weight: ``(ceil(out/b), ceil(in/b))``."""
    return (-(-out_features // block), -(-in_features // block))


def scale_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    """A block scale as fp32: ``float8_e8m0fnu`` byte b -> ``2**(b - 127)``; fp32 unchanged."""
    if scale.dtype == torch.float8_e8m0fnu:
        e = scale.view(torch.uint8).to(torch.int32) - UE8M0_BIAS
        return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    if scale.dtype == torch.float32:
        return scale
    raise ValueError(f"scale: expected dtype float8_e8m0fnu or float32, got {scale.dtype}")


def expand_scale(scale: torch.Tensor, out_features: int, in_features: int, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """A block scale [ceil(out/b), ceil(in/b)] repeated to one value an element, [out_features, in_features]."""
    return scale.repeat_interleave(block, dim=0)[:out_features].repeat_interleave(block, dim=1)[:, :in_features]


@dataclass(frozen=True)
class FP8Weight:
    """A linear weight ``[out, in]`` as the checkpoint stores it.

    ``data``: float8_e4m3fn [out, in], contiguous.  ``scale``: float32 [ceil(out/128), ceil(in/128)], contiguous,
    every value finite and > 0 (a UE8M0 scale converted: a power of two).  Build with ``from_checkpoint`` (checks
    everything) or ``quantize``; the constructor checks shapes, dtypes and devices only.
    """

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        d, s = self.data, self.scale
        if not isinstance(d, torch.Tensor) or d.dtype != torch.float8_e4m3fn or d.dim() != 2:
            got = f"{d.dtype} {list(d.shape)}" if isinstance(d, torch.Tensor) else type(d).__name__
            raise ValueError(f"data: expected a 2-D float8_e4m3fn tensor, got {got}")
        if not d.is_contiguous():
            raise ValueError("data: expected a contiguous tensor")
        want = scale_shape(*d.shape)
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != want:
            got = f"{s.dtype} {list(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"scale: expected a float32 tensor of shape {list(want)}, got {got}")
        if not s.is_contiguous():
            raise ValueError("scale: expected a contiguous tensor")
        if s.device != d.device:
            raise ValueError(f"scale: expected device {d.device} (data's), got {s.device}")

    @classmethod
    def from_checkpoint(cls, data: torch.Tensor, scale: torch.Tensor) -> FP8Weight:
        """From a checkpoint's e4m3 weight and its block scale (float8_e8m0fnu or fp32 > 0; moved to data's
        device).  Reads the scale back to check it (a load-time call)."""
        if not isinstance(scale, torch.Tensor):
            raise ValueError(f"scale: expected a tensor, got {type(scale).__name__}")
        s = scale_to_fp32(scale).to(device=data.device if isinstance(data, torch.Tensor) else None).contiguous()
        if s.numel() and not bool(((s > 0) & torch.isfinite(s)).all()):
            raise ValueError("scale: expected every block scale finite and > 0")
        return cls(data.contiguous() if isinstance(data, torch.Tensor) else data, s)

    @classmethod
    def quantize(cls, w: torch.Tensor, block: int = WEIGHT_BLOCK) -> FP8Weight:
        """Quantise a float weight [out, in] as DeepSeek's checkpoints are: per block the UE8M0 scale
        ``2**ceil(log2(amax / 448))`` (amax floored at 1e-4), then ``e4m3(w / scale)`` (round to nearest)."""
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 2:
            got = f"{w.dtype} {list(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"w: expected a 2-D floating-point tensor, got {got}")
        o, i = w.shape
        so, si = scale_shape(o, i, block)
        pad = torch.zeros(so * block, si * block, dtype=torch.float32, device=w.device)
        pad[:o, :i] = w.float()
        amax = pad.view(so, block, si, block).abs().amax(dim=(1, 3))
        e = ceil_log2_ratio(amax, E4M3_MAX, 1e-4)
        scale = torch.ldexp(torch.ones_like(amax), e).contiguous()
        data = (w.float() / expand_scale(scale, o, i, block)).to(torch.float8_e4m3fn).contiguous()
        return cls(data, scale)

    @classmethod
    def quantize_lossless(cls, w: torch.Tensor) -> FP8Weight | None:
        """``quantize(w)`` if it gives back exactly w's values (w already e4m3 values times a power of two per block,
        e.g. a weight a convert script stored dequantised), else None.  Reads back (a load-time call)."""
        q = cls.quantize(w)
        return q if torch.equal(q.dequantize(), w.float()) else None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held (data + fp32 scale)."""
        return self.data.numel() + 4 * self.scale.numel()

    def numel(self) -> int:
        """Weight elements (out x in)."""
        return self.data.numel()

    def to(self, device: torch.device | str) -> FP8Weight:
        """A copy on ``device``."""
        return FP8Weight(self.data.to(device), self.scale.to(device))

    def rows(self, start: int, stop: int) -> FP8Weight:
        """Rows [start, stop) as a view (no copy): ``start`` on a scale block (a multiple of ``WEIGHT_BLOCK``) and
        ``stop`` on one too or at the last row, so the view's scale rows are its own blocks of ``scale``."""
        n = self.data.shape[0]
        if not (0 <= start < stop <= n and start % WEIGHT_BLOCK == 0 and (stop % WEIGHT_BLOCK == 0 or stop == n)):
            raise ValueError(
                f"rows: expected 0 <= start < stop <= {n}, start a multiple of {WEIGHT_BLOCK} and stop one or {n}, "
                f"got [{start}, {stop})"
            )
        return FP8Weight(self.data[start:stop], self.scale[start // WEIGHT_BLOCK : -(-stop // WEIGHT_BLOCK)])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``fp32(data) · scale`` per block, in ``dtype`` (exact in bf16 for power-of-two scales)."""
        o, i = self.data.shape
        return (self.data.float() * expand_scale(self.scale, o, i)).to(dtype)

    def pow2_scales(self) -> bool:
        """Every block scale is a power of two (then the dequantised values are exact in bf16).  Reads back."""
        m, _ = torch.frexp(self.scale)
        return bool((m == 0.5).all())


def stack_rows(weights: list[FP8Weight]) -> tuple[FP8Weight, list[FP8Weight]] | None:
    """Weights with the same input width, each of whole ``WEIGHT_BLOCK``-row scale blocks (but the last, which may
    end on a partial one), stacked by rows into one ``FP8Weight`` (a single GEMM launch computes all their outputs
    as consecutive column ranges), and each input's row view of it (same values; no second copy).  None if they do
    not stack so (fewer than two, not all FP8Weight, different input widths or devices, a row count mid-list that is
    not a multiple of 128)."""
    if len(weights) < 2 or not all(isinstance(w, FP8Weight) for w in weights):
        return None
    k, dev = weights[0].shape[1], weights[0].device
    if any(w.shape[1] != k or w.device != dev for w in weights):
        return None
    if any(w.shape[0] % WEIGHT_BLOCK for w in weights[:-1]):
        return None
    cat = FP8Weight(torch.cat([w.data for w in weights]), torch.cat([w.scale for w in weights]))
    # (every weight but the last is whole scale blocks, so each one's scale rows are its own block rows of the stack)
    data = torch.split(cat.data, [w.shape[0] for w in weights])
    scale = torch.split(cat.scale, [w.scale.shape[0] for w in weights])
    return cat, [FP8Weight(d, sc) for d, sc in zip(data, scale, strict=True)]
