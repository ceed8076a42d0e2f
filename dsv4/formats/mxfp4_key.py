"""The 68-byte MXFP4 indexer key (spec §4, §9.3, §13) in a data-then-scales page layout.

One key is 128 values after the Hadamard rotation, stored as e2m1 (FP4) two per byte and one UE8M0
scale per 32 values:

    bytes [0, 64)   packed e2m1 codes; value 2j in the low nibble, value 2j+1 in the high nibble
    bytes [64, 68)  4 UE8M0 scale bytes (scale = 2**(b-127))

A page of ``bs`` keys keeps all data rows first (row r at r*64), then all scale rows (row r at
bs*64 + r*4), as DeepGEMM's paged indexer cache does.

Quantisation (spec §13): per block of 32, amax floored at 6*2**-126, ``s = 2**ceil(log2(amax/6))``,
``x/s`` rounded to the e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} to nearest with ties to the even code.
An e2m1 code is sign<<3 | magnitude index; a value that rounds to zero is stored as +0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dsv4.errors import check_tensor
from dsv4.formats.layout import byte_view
from dsv4.formats.ue8m0 import byte_to_scale, ceil_log2_ratio, exponent_to_byte

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision points between neighbouring codes, and whether a tie there rounds up (to the even code).
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


class KeyPages(NamedTuple):
    """Typed views of MXFP4 keys in pages: ``data`` [pages, bs, 64] uint8 (packed e2m1),
    ``scale`` [pages, bs, 4] uint8 (UE8M0).  Physical slot = page * bs + row."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def entries_per_page(self) -> int:
        return self.data.shape[1]


@dataclass(frozen=True)
class MXFP4KeyFormat:
    """Byte geometry and reference (de)quantisation of one MXFP4 indexer key."""

    dim: int = 128
    block: int = 32
    fp4_max: float = 6.0
    amax_floor: float = 6.0 * 2.0**-126

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % self.block or self.dim % 2:
            raise ValueError(f"MXFP4KeyFormat: dim={self.dim} must be a positive multiple of block={self.block}")

    @property
    def n_blocks(self) -> int:
        return self.dim // self.block

    @property
    def data_bytes(self) -> int:
        """Packed e2m1 bytes per key (64)."""
        return self.dim // 2

    @property
    def entry_bytes(self) -> int:
        """Bytes per key, the format minimum (68)."""
        return self.data_bytes + self.n_blocks

    def page_bytes(self, entries_per_page: int) -> int:
        if entries_per_page <= 0:
            raise ValueError(f"entries_per_page: expected > 0, got {entries_per_page}")
        return entries_per_page * self.entry_bytes

    def scale_offset(self, entries_per_page: int) -> int:
        return entries_per_page * self.data_bytes

    def page_views(self, flat: torch.Tensor, num_pages: int, entries_per_page: int) -> dict[str, torch.Tensor]:
        """``data`` [pages, bs, 64] uint8 and ``scale`` [pages, bs, 4] uint8 views aliasing ``flat``."""
        ps, bs = self.page_bytes(entries_per_page), entries_per_page
        if flat.numel() < num_pages * ps:
            raise ValueError(f"flat: expected >= {num_pages * ps} bytes, got {flat.numel()}")
        return {
            "data": byte_view(flat, torch.uint8, (num_pages, bs, self.data_bytes), (ps, self.data_bytes, 1)),
            "scale": byte_view(
                flat, torch.uint8, (num_pages, bs, self.n_blocks), (ps, self.n_blocks, 1), self.scale_offset(bs)
            ),
        }

    def key_pages(self, flat: torch.Tensor, num_pages: int, entries_per_page: int) -> KeyPages:
        v = self.page_views(flat, num_pages, entries_per_page)
        return KeyPages(v["data"], v["scale"])

    # ------------------------------------------------------------------ numerics
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference MXFP4 quantisation of ``x`` [..., dim].

        Returns (packed uint8 [..., dim/2], scale uint8 [..., dim/32]).
        """
        check_tensor("x", x, dtype=(torch.bfloat16, torch.float16, torch.float32))
        if x.shape[-1] != self.dim:
            raise ValueError(f"x: expected last dim {self.dim}, got {list(x.shape)}")
        xb = x.float().unflatten(-1, (self.n_blocks, self.block))
        e = ceil_log2_ratio(xb.abs().amax(-1), self.fp4_max, self.amax_floor)
        v = torch.ldexp(xb, -e.unsqueeze(-1)).flatten(-2)
        codes = e2m1_encode(v)
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        return packed, exponent_to_byte(e)

    def dequantize(self, packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inverse of ``quantize``: [..., dim] in ``dtype`` (exact in fp32 and bf16)."""
        check_tensor("packed", packed, dtype=torch.uint8)
        check_tensor("scale", scale, dtype=torch.uint8)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
        v = e2m1_decode(codes).unflatten(-1, (self.n_blocks, self.block))
        return (v * byte_to_scale(scale).unsqueeze(-1)).flatten(-2).to(dtype)

    def roundtrip(self, x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.dequantize(*self.quantize(x), dtype=dtype)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``v`` (|v| <= 6 expected; larger saturates) to e2m1 codes (uint8 in [0, 16))."""
    a = v.abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for t, tie_up in _E2M1_THRESHOLDS:
        mag += (a >= t if tie_up else a > t).to(torch.uint8)
    sign = ((v < 0) & (mag > 0)).to(torch.uint8) << 3
    return sign | mag


@functools.lru_cache(maxsize=8)
def _e2m1_table(device: torch.device) -> torch.Tensor:
    # Cached per device: a host->device copy inside a captured CUDA graph is not allowed (the first call,
    # outside capture, creates it).
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, low nibble used) -> fp32 values."""
    table = _e2m1_table(codes.device)
    c = codes.to(torch.int64)
    mag = table[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)
