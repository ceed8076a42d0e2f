"""RequestSnapshot: every byte of one request's cache, to take out of a manager and put back (swap, migration).

A request's cache lives in regions of three kinds, all enumerated here (``REGIONS``) so that a save / load round
trip cannot miss one (the prefix-cache bugs of other engines: a region -- the window ring -- left out of a restore):

- ``window``: per layer (MTP included) its ring page (``ring_page_bytes``), ring positions (int32 [ring]) and head;
- ``compressor``: per CSA / HCA layer and role ("main", CSA "indexer") its compressor state rows (fp32 kv / score of
  the layout the schema chose: 128 rows, or the online state's 5 rows and its int32 position);
- ``pages``: per ratio class and layer, the request's pages in block-table order (FP8 entry pages, then for CSA the
  MXFP4 key pages: whole pages, padding included), so entry j of the request stays entry j.

Page ids and the state slot are not part of a snapshot: ``KVCacheManager.load`` gives the request fresh ones.  The
arrival counters of the fused compressor launch are 0 between steps and are not saved.  Units: ``num_tokens``
tokens; every tensor is uint8 bytes or the region's own dtype; ``nbytes`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.paged_cache import PagedKVPool
from dsv4.cache.schema import CacheSchema
from dsv4.cache.state_cache import StateCachePool

__all__ = ["REGIONS", "RequestSnapshot", "check_snapshot", "load_request", "move", "pack", "save_request", "unpack"]

REGIONS = ("window", "compressor", "pages")


@dataclass(frozen=True)
class RequestSnapshot:
    """One request's cache bytes (module docstring).  ``window[layer]`` = (ring page uint8 [ring_page_bytes],
    positions int32 [ring], head int32 []); ``compressor[(layer, role)]`` = (kv, score[, positions]) of the slot;
    ``pages[ratio][layer]`` = (entry pages uint8 [n, entry_page_bytes], key pages uint8 [n, key_page_bytes] or
    None); ``fingerprint``: what a manager must match to load it (model config, block size, state layout)."""

    num_tokens: int
    fingerprint: tuple
    window: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    compressor: dict[tuple[int, str], tuple[torch.Tensor, ...]]
    pages: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor | None]]]

    @property
    def nbytes(self) -> int:
        ts = [t for v in self.window.values() for t in v] + [t for v in self.compressor.values() for t in v]
        ts += [t for per in self.pages.values() for v in per.values() for t in v if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)


def fingerprint(schema: CacheSchema) -> tuple:
    """What two managers must share for a snapshot of one to load into the other."""
    return (schema.config, schema.block_tokens, schema.online_state)


def _compressors(state: StateCachePool, layer_id: int):
    ls = state.layer(layer_id)
    return [(role, c) for role, c in (("main", ls.compressor), ("indexer", ls.indexer_compressor)) if c is not None]


def _slot_views(state: StateCachePool, slot: int) -> tuple[dict, dict]:
    """The ``window`` and ``compressor`` regions of ``slot`` as views of the state buffers, in a snapshot's layout:
    window[layer] = (ring page, positions, head), compressor[(layer, role)] = (kv, score[, positions])."""
    page = state.schema.ring_page_bytes
    window, comp = {}, {}
    for i, ls in enumerate(state.layers):
        ring = state._ring_buf[i].view(state.num_slots, page)[slot]  # noqa: SLF001 - one package
        window[i] = (ring, ls.ring_positions[slot], ls.ring_head[slot])
        for role, c in _compressors(state, i):
            comp[(i, role)] = (c.kv[slot], c.score[slot]) + ((c.positions[slot],) if c.positions is not None else ())
    return window, comp


def _page_rows(pool: PagedKVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer buffer as [num_pages, entry_page_bytes] entry rows and [num_pages, key_page_bytes] key rows."""
    rc, n = pool.ratio_class, pool.num_pages
    buf = pool.layer(layer_id).buffer
    ent = buf[: n * rc.entry_page_bytes].view(n, rc.entry_page_bytes)
    keys = buf[n * rc.entry_page_bytes :].view(n, rc.key_page_bytes) if rc.key_page_bytes else None
    return ent, keys


_ALIGN = 16  # bytes: each tensor of a packed transfer starts at a multiple of this (any dtype's view)


def pack(parts: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``parts`` (tensors of one device, any dtypes and shapes) as one uint8 tensor on that device, each
    part at a multiple of ``_ALIGN`` bytes in list order (one ``torch.cat``; zero padding between them)."""
    pieces, pad = [], None
    for p in parts:
        b = p.contiguous().reshape(-1).view(torch.uint8)
        pieces.append(b)
        gap = -b.numel() % _ALIGN
        if gap:
            pad = torch.zeros(_ALIGN, dtype=torch.uint8, device=b.device) if pad is None else pad
            pieces.append(pad[:gap])
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def unpack(flat: torch.Tensor, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of ``pack``: views of ``flat`` (uint8) with the dtypes and shapes of ``likes``, in order."""
    out, off = [], 0
    for like in likes:
        n = like.numel() * like.element_size()
        out.append(flat[off : off + n].view(like.dtype).view(like.shape))
        off += n + (-n % _ALIGN)
    return out


def move(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """New copies of ``parts`` on ``device``.  Between the host and a GPU in one transfer: packed on the source
    (``pack``), one copy through pinned host memory, split into views (``unpack``) of the one buffer -- one
    synchronisation for a device -> host save instead of one a tensor (a request has hundreds); else one copy a
    tensor (device-side copies, no host wait)."""
    src = {p.device for p in parts}
    if len(src) != 1 or (next(iter(src)).type == "cuda") == (device.type == "cuda"):
        return [p.to(device, copy=True) for p in parts]
    flat = pack(parts)
    if device.type == "cpu":  # GPU -> host: pinned buffer, one wait for the copy
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(flat.device).synchronize()
        return unpack(host, parts)
    # host -> GPU: staged in pinned memory (the caching host allocator keeps it until the copy has run)
    return unpack(flat.pin_memory().to(device, non_blocking=True), parts)


def save_request(
    schema: CacheSchema,
    state: StateCachePool,
    pools: dict[int, PagedKVPool],
    slot: int,
    blocks: dict[int, list[int]],
    num_tokens: int,
    device: torch.device | str,
) -> RequestSnapshot:
    """Copy the regions of the request at ``slot`` with pages ``blocks`` (ratio -> page ids) to ``device`` (``move``:
    one transfer to or from the host)."""
    dev = torch.device(device)
    win_v, comp_v = _slot_views(state, slot)
    parts = [t for v in win_v.values() for t in v] + [t for v in comp_v.values() for t in v]
    page_keys = []
    for m, pool in pools.items():
        idx = torch.tensor(blocks[m], dtype=torch.long, device=pool.device)
        for layer_id in pool.layers:
            ent, keys = _page_rows(pool, layer_id)
            page_keys.append((m, layer_id, keys is not None))
            parts += [ent[idx]] + ([keys[idx]] if keys is not None else [])
    moved = iter(move(parts, dev))
    window = {k: tuple(next(moved) for _ in v) for k, v in win_v.items()}
    comp = {k: tuple(next(moved) for _ in v) for k, v in comp_v.items()}
    pages: dict[int, dict] = {m: {} for m in pools}
    for m, layer_id, has_keys in page_keys:
        pages[m][layer_id] = (next(moved), next(moved) if has_keys else None)
    return RequestSnapshot(num_tokens, fingerprint(schema), window, comp, pages)


def _check_part(name: str, got: object, like: torch.Tensor | None, shape: tuple[int, ...] | None = None) -> None:
    """``got`` must be a tensor of ``like``'s dtype and shape (``shape`` if given), or None where ``like`` is."""
    if like is None:
        if got is not None:
            raise ValueError(f"snapshot: {name}: expected None (this layer has no such region), got a tensor")
        return
    want = tuple(like.shape) if shape is None else shape
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != want or got.dtype != like.dtype:
        what = f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"snapshot: {name}: expected {like.dtype} {list(want)}, got {what}")
    if got.device.type == "meta":
        raise ValueError(f"snapshot: {name}: expected a tensor with data, got one on the meta device")


def check_snapshot(
    schema: CacheSchema, state: StateCachePool, pools: dict[int, PagedKVPool], snap: RequestSnapshot
) -> None:
    """Raise ValueError unless ``snap`` fits this schema (same fingerprint, every region present, page counts
    matching its length, every tensor of its region's dtype and shape): a snapshot that passes loads without error."""
    if not isinstance(snap, RequestSnapshot):
        raise ValueError(f"snapshot: expected a RequestSnapshot, got {type(snap).__name__}")
    n_max = schema.config.max_seq_len
    if not isinstance(snap.num_tokens, int) or isinstance(snap.num_tokens, bool) or not 0 <= snap.num_tokens <= n_max:
        raise ValueError(f"snapshot: num_tokens: expected an int in [0, {n_max}], got {snap.num_tokens!r}")
    if snap.fingerprint != fingerprint(schema):
        raise ValueError(
            "snapshot: taken from a cache of another model, block size or state layout "
            f"(block_tokens {snap.fingerprint[1]} vs {schema.block_tokens}, online_state {snap.fingerprint[2]} vs "
            f"{schema.online_state}, same config: {snap.fingerprint[0] == schema.config})"
        )
    n_layers = schema.config.num_cache_layers
    if sorted(snap.window) != list(range(n_layers)):
        raise ValueError(f"snapshot: expected the window rings of layers 0..{n_layers - 1}, got {sorted(snap.window)}")
    want = {(ls.layer_id, r) for ls in schema.layers for r, c in (("main", ls.compressor), ("indexer",
            ls.indexer_compressor)) if c is not None}  # fmt: skip
    if set(snap.compressor) != want:
        raise ValueError(f"snapshot: expected compressor states {sorted(want)}, got {sorted(snap.compressor)}")
    for m, pool in pools.items():
        n = pool.ratio_class.pages_for_tokens(snap.num_tokens)
        got = snap.pages.get(m, {})
        if set(got) != set(pool.layers):
            raise ValueError(f"snapshot: expected pages of ratio-{m} layers {sorted(pool.layers)}, got {sorted(got)}")
        for layer_id, parts in got.items():
            ent, keys = _page_rows(pool, layer_id)
            if not isinstance(parts, tuple) or len(parts) != 2:
                raise ValueError(f"snapshot: pages[{m}][{layer_id}]: expected (entry pages, key pages or None)")
            _check_part(f"pages[{m}][{layer_id}] entries", parts[0], ent, (n, ent.shape[1]))
            _check_part(f"pages[{m}][{layer_id}] keys", parts[1], keys, None if keys is None else (n, keys.shape[1]))
    window, comp = _slot_views(state, 0)  # (any slot: the shapes and dtypes a region's tensors must have)
    for i, parts in snap.window.items():
        if not isinstance(parts, tuple) or len(parts) != 3:
            raise ValueError(f"snapshot: window[{i}]: expected (ring page, positions, head)")
        for name, got, like in zip(("page", "positions", "head"), parts, window[i], strict=True):
            _check_part(f"window[{i}] {name}", got, like)
    for (i, role), parts in snap.compressor.items():
        likes = comp[(i, role)]
        if not isinstance(parts, tuple) or len(parts) != len(likes):
            raise ValueError(f"snapshot: compressor[{i}, {role!r}]: expected {len(likes)} tensors")
        for name, got, like in zip(("kv", "score", "positions")[: len(likes)], parts, likes, strict=True):
            _check_part(f"compressor[{i}, {role!r}] {name}", got, like)


def load_request(
    state: StateCachePool, pools: dict[int, PagedKVPool], slot: int, blocks: dict[int, list[int]], snap: RequestSnapshot
) -> None:
    """Copy ``snap`` (checked by ``check_snapshot``) into ``slot`` and the pages ``blocks`` (the snapshot's tensors
    moved to the cache's device first, in one transfer from the host: ``move``)."""
    window, comp = _slot_views(state, slot)
    dsts, srcs = [], []
    for views, region in ((window, snap.window), (comp, snap.compressor)):
        for key, parts in region.items():
            dsts += list(views[key])
            srcs += list(parts)
    n_state = len(srcs)
    page_dsts = []
    for m, pool in pools.items():
        idx = torch.tensor(blocks[m], dtype=torch.long, device=pool.device)
        for layer_id, (ent_b, key_b) in snap.pages[m].items():
            ent, keys = _page_rows(pool, layer_id)
            page_dsts.append((ent, idx))
            srcs.append(ent_b)
            if keys is not None:
                page_dsts.append((keys, idx))
                srcs.append(key_b)
    dev = state.device
    on_device = all(t.device.type == dev.type and dev.index in (None, t.device.index) for t in srcs)  # (a fork's)
    moved = srcs if on_device else move(srcs, dev)
    for dst, src in zip(dsts, moved[:n_state], strict=True):
        dst.copy_(src)
    for (rows, idx), src in zip(page_dsts, moved[n_state:], strict=True):
        rows[idx] = src
