"""PagedKVPool: compressed entries (and CSA indexer keys) of one ratio class in fixed-size pages.

One pool per ratio class (4 = CSA, 128 = HCA).  Each layer of the class owns one contiguous uint8
buffer laid out as

    [num_pages * entry_page_bytes]   FP8 entries, FlashMLA MODEL1 pages (byte-compatible)
    [num_pages * key_page_bytes]     MXFP4 indexer keys, data-then-scales pages (CSA only)

and the typed tensors of the seed are strided views into it.  Page ``p`` of every layer of the class
belongs to the same block id ``p``: allocating one block id gives a request one page in each layer.

The pool owns the free list of its page ids; *which request* owns a page is the manager's business
(``KVCacheManager`` keeps block tables and checks conservation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.schema import RatioClass
from dsv4.formats import EntryPages, KeyPages


@dataclass(frozen=True)
class PagedLayerCache:
    """One layer's views into its pool buffer.  ``keys`` is None for HCA layers."""

    layer_id: int
    ratio: int
    buffer: torch.Tensor  # uint8 [num_pages * layer_page_bytes]
    entries: EntryPages
    keys: KeyPages | None

    # The seed's names for the same views.
    @property
    def entries_fp8(self) -> torch.Tensor:
        return self.entries.nope

    @property
    def entries_rope(self) -> torch.Tensor:
        return self.entries.rope

    @property
    def inv_scale(self) -> torch.Tensor:
        """UE8M0 bytes [pages, bs, n_tiles]; dequantised value = fp8 * 2**(byte - 127)."""
        return self.entries.scale

    @property
    def indexer_keys_fp4(self) -> torch.Tensor | None:
        return self.keys.data if self.keys is not None else None

    @property
    def indexer_scale(self) -> torch.Tensor | None:
        return self.keys.scale if self.keys is not None else None

    @property
    def indexer_global_scale(self) -> None:
        """Always None: V4's MXFP4 keys have no global scale (spec §4, §10); kept for the seed's API."""
        return None

    @property
    def entries_per_page(self) -> int:
        return self.entries.entries_per_page


class PagedKVPool:
    """Pages of one ratio class across all its layers, with a free list of page ids.

    Args:
        ratio_class: geometry from ``CacheSchema.ratio_classes[m]``.
        num_pages: physical pages per layer (= block ids available to all requests together).
        device: where the buffers live.
    """

    def __init__(self, ratio_class: RatioClass, num_pages: int, device: torch.device | str = "cpu") -> None:
        if not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages: expected an int >= 0, got {num_pages!r}")
        self.ratio_class = ratio_class
        self.ratio = ratio_class.ratio
        self.num_pages = num_pages
        self.device = torch.device(device)
        rc = ratio_class
        self.layers: dict[int, PagedLayerCache] = {}
        for layer_id in rc.layers:
            buf = torch.zeros(num_pages * rc.layer_page_bytes, dtype=torch.uint8, device=self.device)
            entries = rc.entry_fmt.entry_pages(buf[: num_pages * rc.entry_page_bytes], num_pages, rc.entries_per_page)
            keys = None
            if rc.key_fmt is not None:
                keys = rc.key_fmt.key_pages(buf[num_pages * rc.entry_page_bytes :], num_pages, rc.entries_per_page)
            self.layers[layer_id] = PagedLayerCache(layer_id, self.ratio, buf, entries, keys)
        # Free list as a stack: the lowest ids are handed out first (deterministic, easy to test).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def entries_per_page(self) -> int:
        return self.ratio_class.entries_per_page

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def total_bytes(self) -> int:
        return sum(layer.buffer.numel() for layer in self.layers.values())

    def layer(self, layer_id: int) -> PagedLayerCache:
        try:
            return self.layers[layer_id]
        except KeyError:
            raise ValueError(
                f"layer_id: expected a layer of ratio {self.ratio} {sorted(self.layers)}, got {layer_id!r}"
            ) from None

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` page ids, or return None (and take nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"n: expected >= 0, got {n}")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def release(self, pages: list[int]) -> None:
        """Return page ids to the free list.  ValueError (nothing returned) for an id out of [0, num_pages), one
        given twice or one already free: a double free would hand one page to two requests later."""
        seen = set()
        for p in pages:
            if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < self.num_pages:
                raise ValueError(f"release: expected page ids in [0, {self.num_pages}), got {p!r}")
            if p in seen or self._is_free[p]:
                raise ValueError(f"release: page {p} of ratio {self.ratio} is already free (a double free)")
            seen.add(p)
        for p in pages:
            self._is_free[p] = True
        self._free.extend(reversed(pages))

    def free_page_ids(self) -> list[int]:
        return list(self._free)
