"""CacheSchema: what each layer caches, in which shapes, and how many bytes that costs.

Derived from a ``ModelConfig`` and the two byte formats, never from literals.  Units are explicit in
every name: ``*_tokens`` (raw tokens), ``*_entries`` (compressed entries, one per ``ratio`` tokens),
``*_pages`` (physical pages), ``*_bytes``.

Paging (design §1): a *logical block* covers ``block_tokens`` raw tokens (default 256).  For ratio
class ``m`` one block is one page of ``block_tokens // m`` entries in **every** layer of that class, so
one block id and one block table per (request, ratio class) serve all those layers.  A CSA page holds
the FP8 entries (MODEL1 page, padded to a multiple of 576 bytes) and, in a separate region of the
same layer buffer, the MXFP4 indexer keys of the same entries.

Per request, independent of length (``StateCachePool``): the window ring of every layer (one MODEL1
page of ``window_size`` entries, plus int32 positions and a head), and the fp32 compressor state of
every CSA/HCA layer: ``[c*m, c*d]`` kv and score rows (c = 2 with CSA's overlap), and for CSA the
same for the indexer's d = ``index_head_dim`` compressor (spec §3.1).  With ``online_state`` (the default,
``ONLINE_STATE``) a compressor without overlap (HCA) keeps instead the running softmax of its open chunk
before the newest row (max, denominator, weighted sum) and that row (kv, score) raw, 5 x d fp32 + an int32
position (10 KiB at d = 512 instead of the reference layout's 512 KiB; ``dsv4.kernels.cache.compressor``,
"online state").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from dsv4.config import LayerKind, ModelConfig
from dsv4.formats import FP8EntryFormat, MXFP4KeyFormat, entry_format, key_format

DEFAULT_BLOCK_TOKENS = 256
# non-overlapping compressors (HCA) keep the running softmax of the open chunk, not its rows (module docstring)
ONLINE_STATE = True
_INT32_BYTES = 4
_FP32_BYTES = 4


@dataclass(frozen=True)
class CompressorShape:
    """One compressor's state geometry: rows = c*m (ring indexed by position mod rows), width = c*d; ``online``
    (no overlap only): kv rows (acc, den, raw kv) and score rows (max, raw score) of width d, and an int32
    position, instead (``dsv4.kernels.cache.compressor``, "online state")."""

    ratio: int
    head_dim: int
    overlap: bool
    online: bool = False

    def __post_init__(self) -> None:
        if self.online and self.overlap:
            raise ValueError("online: expected a compressor without overlap (HCA)")

    @property
    def kv_rows(self) -> int:
        """Rows of the kv state: c*m ring rows, or 3 (acc, den, raw kv) online."""
        return 3 if self.online else self.rows

    @property
    def score_rows(self) -> int:
        """Rows of the score state: c*m ring rows, or 2 (max, raw score) online."""
        return 2 if self.online else self.rows

    @property
    def coff(self) -> int:
        return 2 if self.overlap else 1

    @property
    def rows(self) -> int:
        return self.coff * self.ratio

    @property
    def width(self) -> int:
        return self.coff * self.head_dim

    @property
    def state_bytes(self) -> int:
        """kv + score, fp32 (+ the int32 position online)."""
        return (self.kv_rows + self.score_rows) * self.width * _FP32_BYTES + (_INT32_BYTES if self.online else 0)


@dataclass(frozen=True)
class RatioClass:
    """Paging of one compression ratio: all layers of that ratio share block ids and block tables."""

    ratio: int
    layers: tuple[int, ...]
    block_tokens: int
    entry_fmt: FP8EntryFormat
    key_fmt: MXFP4KeyFormat | None  # CSA only

    @property
    def entries_per_page(self) -> int:
        return self.block_tokens // self.ratio

    @property
    def entry_page_bytes(self) -> int:
        """FP8 entries of one page in one layer (padded MODEL1 page stride)."""
        return self.entry_fmt.page_bytes(self.entries_per_page)

    @property
    def key_page_bytes(self) -> int:
        """MXFP4 indexer keys of one page in one layer (0 without an indexer)."""
        return self.key_fmt.page_bytes(self.entries_per_page) if self.key_fmt else 0

    @property
    def layer_page_bytes(self) -> int:
        return self.entry_page_bytes + self.key_page_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes one block id occupies across all layers of the class."""
        return self.layer_page_bytes * len(self.layers)

    def entries_for_tokens(self, num_tokens: int) -> int:
        """Completed entries of a request of ``num_tokens`` tokens (partial chunks are not entries)."""
        return num_tokens // self.ratio

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages (= block ids) a request of ``num_tokens`` tokens holds in this class."""
        return -(-self.entries_for_tokens(num_tokens) // self.entries_per_page)

    def min_bytes_per_token(self) -> float:
        """Format-minimum bytes per raw token over the class's layers (no page padding)."""
        per_entry = self.entry_fmt.entry_bytes + (self.key_fmt.entry_bytes if self.key_fmt else 0)
        return per_entry * len(self.layers) / self.ratio


@dataclass(frozen=True)
class LayerSchema:
    layer_id: int
    kind: LayerKind
    ratio: int
    is_mtp: bool
    compressor: CompressorShape | None
    indexer_compressor: CompressorShape | None


class CacheSchema:
    """Per-layer cache geometry of a model (see module docstring)."""

    def __init__(
        self, config: ModelConfig, block_tokens: int = DEFAULT_BLOCK_TOKENS, online_state: bool = ONLINE_STATE
    ) -> None:
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config: expected a ModelConfig, got {type(config).__name__}")
        if not isinstance(block_tokens, int) or block_tokens <= 0:
            raise ValueError(f"block_tokens: expected a positive int, got {block_tokens!r}")
        for m in config.ratio_classes:
            if block_tokens % m:
                raise ValueError(
                    f"block_tokens: expected a multiple of every compression ratio, {block_tokens} % {m} != 0"
                )
        self.config = config
        self.block_tokens = block_tokens
        self.online_state = bool(online_state)
        self.entry_fmt = entry_format(config)
        self.key_fmt = key_format(config)

    # ------------------------------------------------------------------ geometry
    @property
    def ring_size(self) -> int:
        """Window ring entries per layer per request (= window_size tokens)."""
        return self.config.window_size

    @property
    def rope_dim(self) -> int:
        return self.config.rope_head_dim

    @cached_property
    def layers(self) -> tuple[LayerSchema, ...]:
        cfg = self.config
        out = []
        for i in range(cfg.num_cache_layers):
            m, kind = cfg.ratio(i), cfg.layer_kind(i)
            ov = cfg.overlap(m)
            comp = CompressorShape(m, cfg.head_dim, ov, self.online_state and not ov) if m else None
            idx = CompressorShape(m, cfg.index_head_dim, cfg.overlap(m)) if kind is LayerKind.CSA else None
            out.append(LayerSchema(i, kind, m, cfg.is_mtp(i), comp, idx))
        return tuple(out)

    def layer(self, layer_id: int) -> LayerSchema:
        self.config.ratio(layer_id)  # validates the id
        return self.layers[layer_id]

    @cached_property
    def ratio_classes(self) -> dict[int, RatioClass]:
        cfg = self.config
        return {
            m: RatioClass(
                m,
                cfg.layers_of_ratio(m),
                self.block_tokens,
                self.entry_fmt,
                self.key_fmt if cfg.layer_kind(cfg.layers_of_ratio(m)[0]) is LayerKind.CSA else None,
            )
            for m in cfg.ratio_classes
        }

    # ------------------------------------------------------------------ bytes
    @property
    def ring_page_bytes(self) -> int:
        """One layer's window ring of one request (a padded MODEL1 page of ring_size entries)."""
        return self.entry_fmt.page_bytes(self.ring_size)

    @property
    def ring_meta_bytes(self) -> int:
        """Positions (int32 per ring entry) + head (int32) of one layer's ring of one request."""
        return (self.ring_size + 1) * _INT32_BYTES

    def compressor_state_bytes(self, layer_id: int) -> int:
        ls = self.layer(layer_id)
        return sum(c.state_bytes for c in (ls.compressor, ls.indexer_compressor) if c is not None)

    def per_request_fixed_bytes_by_region(self) -> dict[str, int]:
        n = self.config.num_cache_layers
        return {
            "window_ring": n * self.ring_page_bytes,
            "window_meta": n * self.ring_meta_bytes,
            "compressor_state": sum(self.compressor_state_bytes(i) for i in range(n)),
        }

    def per_request_fixed_bytes(self) -> int:
        return sum(self.per_request_fixed_bytes_by_region().values())

    def min_bytes_per_token(self) -> float:
        """Format minimum: FP8 main entries + MXFP4 indexer keys, no page padding (spec §7.3)."""
        return sum(rc.min_bytes_per_token() for rc in self.ratio_classes.values())

    def paged_bytes_per_token(self) -> float:
        """What paging really allocates per raw token in steady state (page padding included)."""
        return sum(rc.block_bytes / self.block_tokens for rc in self.ratio_classes.values())

    def paged_bytes_for_tokens(self, num_tokens: int) -> int:
        """Paged bytes of one request of ``num_tokens`` tokens (whole pages)."""
        return sum(rc.pages_for_tokens(num_tokens) * rc.block_bytes for rc in self.ratio_classes.values())
