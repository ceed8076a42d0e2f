"""The 584-byte FP8 KV entry and FlashMLA's "MODEL1" page layout (spec §5, §13).

One entry is one 512-d K=V latent (window KV or a compressed entry):

    bytes [0, 448)    dims 0..447 as float8_e4m3fn, 7 tiles of 64, each with its own scale
    bytes [448, 576)  dims 448..511 (the RoPE part) as bf16, never quantised
    scale bytes       7 UE8M0 bytes (scale = 2**(b-127)) + 1 zero pad byte

A page of ``bs`` entries stores all data rows first, then all scale rows (not interleaved):

    [0, bs*576)                 row r at r*576: 448 fp8 bytes then 64 bf16
    [bs*576, bs*576 + bs*8)     row r at bs*576 + r*8: 7 scale bytes + 1 pad byte
    page stride                 rounded up to a multiple of 576 bytes

so that a page is byte-compatible with FlashMLA's sparse FP8 decode (``MODEL1_FP8Sparse``).  Every
number above is derived from ``FP8EntryFormat`` (head_dim, rope_dim, tile); nothing else in dsv4
spells them as literals.

Quantisation (spec §13): per tile, amax floored at 1e-4, ``s = 2**ceil(log2(amax/448))``, stored
``e4m3(rne(clamp(x/s, ±448)))``; dequantised ``fp32(e4m3) * s`` then bf16.  The result is an e4m3
value times a power of two, so re-quantising a dequantised entry reproduces the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dsv4.errors import check_tensor
from dsv4.formats.layout import byte_view
from dsv4.formats.ue8m0 import byte_to_scale, ceil_log2_ratio, exponent_to_byte

FP8_DTYPE = torch.float8_e4m3fn
ROPE_DTYPE = torch.bfloat16


class EntryPages(NamedTuple):
    """Typed views of FP8 entries in MODEL1 pages: what kernels read and write.

    ``nope`` [pages, bs, 448] float8_e4m3fn, ``rope`` [pages, bs, 64] bf16, ``scale`` [pages, bs, 7]
    uint8 (UE8M0).  An entry's *physical slot* is ``page * bs + row``; slot -1 means "none".
    The window ring of one layer is the same type with one page of ``ring_size`` rows per request slot.
    """

    nope: torch.Tensor
    rope: torch.Tensor
    scale: torch.Tensor

    @property
    def entries_per_page(self) -> int:
        return self.nope.shape[1]

    @property
    def num_pages(self) -> int:
        return self.nope.shape[0]

    @property
    def num_slots(self) -> int:
        """Total physical slots (pages * bs)."""
        return self.nope.shape[0] * self.nope.shape[1]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class FP8EntryFormat:
    """Byte geometry and reference (de)quantisation of one FP8 KV entry."""

    head_dim: int = 512
    rope_dim: int = 64
    tile: int = 64
    fp8_max: float = 448.0  # largest finite e4m3fn value
    amax_floor: float = 1e-4
    scale_align: int = 8  # scale bytes per row incl. padding are rounded up to this

    def __post_init__(self) -> None:
        if self.nope_dim <= 0 or self.nope_dim % self.tile:
            raise ValueError(
                f"FP8EntryFormat: head_dim - rope_dim = {self.nope_dim} must be a positive multiple of tile={self.tile}"
            )

    @property
    def nope_dim(self) -> int:
        """Channels stored as e4m3 (448)."""
        return self.head_dim - self.rope_dim

    @property
    def n_tiles(self) -> int:
        """Scale bytes with meaning per entry (7)."""
        return self.nope_dim // self.tile

    @property
    def rope_bytes(self) -> int:
        return self.rope_dim * torch.finfo(ROPE_DTYPE).bits // 8

    @property
    def data_bytes(self) -> int:
        """fp8 + bf16 bytes of one entry (576); also the page-stride alignment."""
        return self.nope_dim + self.rope_bytes

    @property
    def scale_stride(self) -> int:
        """Scale bytes per entry including padding (8)."""
        return _round_up(self.n_tiles + 1, self.scale_align)

    @property
    def entry_bytes(self) -> int:
        """Bytes per entry, the format minimum (584)."""
        return self.data_bytes + self.scale_stride

    def page_bytes(self, entries_per_page: int) -> int:
        """Page stride in bytes for ``entries_per_page`` entries, padded to a multiple of 576."""
        if entries_per_page <= 0:
            raise ValueError(f"entries_per_page: expected > 0, got {entries_per_page}")
        return _round_up(entries_per_page * self.entry_bytes, self.data_bytes)

    def scale_offset(self, entries_per_page: int) -> int:
        """Byte offset of the scale rows inside a page."""
        return entries_per_page * self.data_bytes

    # ------------------------------------------------------------------ views
    def page_views(self, flat: torch.Tensor, num_pages: int, entries_per_page: int) -> dict[str, torch.Tensor]:
        """Typed views over ``num_pages`` consecutive pages at the start of ``flat`` (uint8, 1-D).

        Returns ``nope`` [pages, bs, 448] e4m3, ``rope`` [pages, bs, 64] bf16, ``scale``
        [pages, bs, 7] uint8 (UE8M0 bytes), ``pad`` [pages, bs, scale_stride-7] uint8 and ``data``
        [pages, bs, 576] uint8.  All alias ``flat``.
        """
        ps, bs = self.page_bytes(entries_per_page), entries_per_page
        if flat.numel() < num_pages * ps:
            raise ValueError(f"flat: expected >= {num_pages * ps} bytes, got {flat.numel()}")
        so = self.scale_offset(bs)
        return {
            "nope": byte_view(flat, FP8_DTYPE, (num_pages, bs, self.nope_dim), (ps, self.data_bytes, 1)),
            "rope": byte_view(
                flat, ROPE_DTYPE, (num_pages, bs, self.rope_dim), (ps, self.data_bytes, 2), self.nope_dim
            ),
            "scale": byte_view(flat, torch.uint8, (num_pages, bs, self.n_tiles), (ps, self.scale_stride, 1), so),
            "pad": byte_view(
                flat,
                torch.uint8,
                (num_pages, bs, self.scale_stride - self.n_tiles),
                (ps, self.scale_stride, 1),
                so + self.n_tiles,
            ),
            "data": byte_view(flat, torch.uint8, (num_pages, bs, self.data_bytes), (ps, self.data_bytes, 1)),
        }

    def entry_pages(self, flat: torch.Tensor, num_pages: int, entries_per_page: int) -> EntryPages:
        v = self.page_views(flat, num_pages, entries_per_page)
        return EntryPages(v["nope"], v["rope"], v["scale"])

    # ------------------------------------------------------------------ numerics
    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reference quantisation of entries ``x`` [..., head_dim] (any float dtype).

        Returns (nope e4m3 [..., 448], rope bf16 [..., 64], scale uint8 [..., 7]).  The rope part is
        ``x[..., 448:]`` rounded to bf16.
        """
        check_tensor("x", x, dtype=(torch.bfloat16, torch.float16, torch.float32))
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x: expected last dim {self.head_dim}, got {list(x.shape)}")
        nope = x[..., : self.nope_dim].float().unflatten(-1, (self.n_tiles, self.tile))
        e = ceil_log2_ratio(nope.abs().amax(-1), self.fp8_max, self.amax_floor)
        q = torch.ldexp(nope, -e.unsqueeze(-1)).clamp(-self.fp8_max, self.fp8_max).to(FP8_DTYPE)
        return q.flatten(-2), x[..., self.nope_dim :].to(ROPE_DTYPE), exponent_to_byte(e)

    def dequantize(self, nope: torch.Tensor, rope: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Inverse of ``quantize``: bf16 [..., head_dim] (fp32(e4m3) * 2**(b-127), then bf16)."""
        check_tensor("nope", nope, dtype=FP8_DTYPE)
        check_tensor("rope", rope, dtype=ROPE_DTYPE)
        check_tensor("scale", scale, dtype=torch.uint8)
        s = byte_to_scale(scale).unsqueeze(-1)
        v = (nope.float().unflatten(-1, (self.n_tiles, self.tile)) * s).flatten(-2)
        return torch.cat([v.to(torch.bfloat16), rope.to(torch.bfloat16)], dim=-1)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``dequantize(quantize(x))``: the value the cache gives back for ``x`` (bf16)."""
        return self.dequantize(*self.quantize(x))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The logical 584 bytes of each entry: fp8 | bf16 rope | scales | zero pad (uint8 [..., 584])."""
        nope, rope, scale = self.quantize(x)
        pad = torch.zeros(*scale.shape[:-1], self.scale_stride - self.n_tiles, dtype=torch.uint8, device=x.device)
        return torch.cat([nope.view(torch.uint8), rope.contiguous().view(torch.uint8), scale, pad], dim=-1)
