"""Sparse attention over FP8 cache entries: the read path of every DeepSeek-V4 attention layer (spec §2 step 4).

For each query row ``t`` and head ``h`` the keys are the entries named by the index rows of one or more
caches (typically the window ring and the compressed pool).  K = V = the dequantised 512-d entry (one
latent shared by all heads: MQA).  With ``s_j = (q_th . k_j) * scale`` in fp32 over the valid entries
``j`` of *all* caches together, and the per-head sink logit ``sink_h`` (denominator only)::

    M      = max(max_j s_j, sink_h)
    denom  = sum_j exp(s_j - M) + exp(sink_h - M)
    out    = sum_j exp(s_j - M) * v_j / denom                (bf16)
    lse    = M + log(denom) = log(sum_j exp(s_j) + exp(sink_h))   (fp32, natural log, sink included)

A row with no valid entry gives ``out = 0`` and ``lse = sink_h`` (``-inf`` if the sink is ``-inf``,
e.g. a padded head).  An index is valid iff ``0 <= slot < pages.num_slots``; ``-1`` (and any other
out-of-range value) is skipped and never read.  Duplicated slots are attended as often as they occur.

Numerics.  The reference is a plain fp32 softmax over exactly dequantised entries.  The Triton kernel
keeps an fp32 online softmax (running max and sum in fp32, sum over the unrounded probabilities) and
rounds the probabilities to bf16 for the P.V product, as the official kernel does (spec §12); the two
agree to bf16 level.

Kernel design (sm90; ``_triton_sparse_attention.py``)
-----------------------------------------------------
- Grid ``(T, cdiv(H, BLOCK_H), splits)``.  A program owns one query row and BLOCK_H heads, keeps
  ``q`` [BLOCK_H, 512] bf16 and ``acc`` [BLOCK_H, 512] fp32, and walks key blocks of BLOCK_N entries.
  Each block is gathered ONCE for all heads of the program: the nope part is loaded as
  [BLOCK_N, 8, 64] (7 FP8 tiles + the slot of the rope tile), converted e4m3 -> fp32 and multiplied by
  its per-tile UE8M0 scale (``2**(b-127)`` built from exponent bits), the bf16 rope part fills the 8th
  tile, and the result (exact in bf16) is reshaped to [BLOCK_N, 512].  QK^T is one ``tl.dot`` of
  [BLOCK_H, 512] x [512, BLOCK_N] and P.V one ``tl.dot`` of [BLOCK_H, BLOCK_N] x [BLOCK_N, 512]; the
  same register tile serves as K and V, so an entry's bytes are read once per (row, head block).
- FP8 is passed to Triton as ``float8_e4m3fn`` (``tl.float8e4nv`` on sm90; the interpreter of
  triton >= 3.9 loads it too and its fp8 -> fp32 conversion is exact on both).  Two interpreter
  defects are worked around behind the constexpr ``INTERPRETER`` (set for CPU tensors): its ``tl.dot``
  multiplies the raw bits of bf16 operands (so the operands are upcast to fp32 there) and its
  fp32 -> bf16 cast truncates (so P and the output are rounded to nearest-even on the bits first).
  The GPU path uses the bf16 MMA and the hardware cast.
- Up to two caches go into one launch: the key blocks of cache A, then those of cache B, form one
  sequence of blocks; a split takes a contiguous range of it.  More than two caches are launched in
  pairs, always through the split workspace.
- Flash-decoding: when ``T * head_blocks`` programs cannot fill the GPU and the key lists are long
  (HCA with up to 8192 entries), the block sequence is split across programs.  The split count is
  chosen on the host from the *static* index shapes (no device sync; see ``choose_num_splits``); each
  split writes (max, sum, acc) in fp32 to a workspace, and ``_sparse_attn_combine`` merges them and
  adds the sink.
- Register budget (the likely limiter at the defaults): BLOCK_H=64 with 8 warps holds acc 64x512 fp32
  (128 regs/thread), q 64x512 bf16 (64, unless the compiler keeps it in shared memory) and the 64x512
  dequantised tile (64 as bf16) -> spills.  Selectable variants (``sparse_attention_triton`` keywords,
  defaults unchanged; ``benchmarks/sweep_attention.py`` times them): ``num_warps=16`` (halves the
  per-thread accumulator), ``qk_tiles`` (QK^T in D-chunks with q re-loaded from L1/L2 and K dequantised
  per chunk; P.V then re-gathers its tile), ``d_split`` (output dims split over programs: acc shrinks by
  ``d_split``; QK^T and the gather are repeated, so the total MMA work is ``(d_split + 1) / 2`` times the
  unsplit QK+PV work: 1.5x at 2, 2.5x at 4).  The default path builds ONE
  [BLOCK_N, 512] tile and feeds it as ``tl.trans(k)`` to QK^T and as ``k`` to P.V.
- Gathered path (``path="gathered"``, ``_triton_gathered_attention.py``; the default off sm_90, ``DEFAULT_PATH``):
  launch 1 dequantises every indexed entry of every row into a dense bf16
  workspace [T, cols, 512] (+ an fp32 bias row: 0 valid, -inf skipped/padding), launch 2 is a plain
  flash-decoding kernel over contiguous tiles that Triton software-pipelines (cp.async, ``num_stages``
  2), launch 3 the combine when keys are split.  It moves more bytes (the workspace is written and read
  back) but turns the serial gather -> dequantise -> MMA chain of the fused kernel into a memory-bound
  copy plus a pipelined MMA loop.  H200, 2026-12-02 (``2026-12-02_h200_attention_gathered.jsonl``, CUDA
  graph): V4-Pro B = 64 110.6 us vs 161.7 fused (gather 34 us + dense 76 us), V4-Flash B = 64 64.9 vs 88.2,
  V4-Pro HCA 8192 B = 8 193 vs 384, V4-Pro B = 8 33.2 vs 58.1, V4-Flash B = 1 17.5 vs 23.5.
- Gluon dense kernel (``_gluon_dense_attention.py``, sm_90): the gathered path's second launch written in Gluon
  with two warp-specialised warpgroups that split the head dim (each owns a [64, 256] accumulator, the partial
  logits are swapped through shared memory) and asynchronous wgmma; same numerics bound as the Triton kernel.
  ``dense="auto"`` uses it where each program attends long lists (``GLUON_MIN_KEYS``); H200 2026-12-04 device
  time at V4-Pro B = 64: 58.8 us vs 76.1 for ``_dense_attn_fwd`` (whole call 94.2 vs 112.0 us graph).
- Fused Gluon kernel (``path="gluon_fused"``, ``_gluon_fused_attention.py``, sm_90; the default there): the dense
  kernel's two warpgroups fed by two producer warpgroups that ``cp.async`` the indexed FP8 entries straight from
  the caches and dequantise them into shared memory: no workspace, no gather launch, one launch (+ the combine
  when keys are split).  ``path=None`` with no Triton tuning knobs picks it wherever it can run
  (``selected_path``); if it fails to build, the first call warns and the device falls back to the gathered path.
  H200 2026-12-04 graph time: V4-Pro B = 64 73.8 us (262 TFLOP/s) vs 94.3 gathered + Gluon dense; V4-Flash B = 64
  34.8 vs 52.7; HCA-8192 B = 8 60.8 vs 78.2; V4-Pro B = 8 27.2 vs 30.7 (Triton dense); B = 1 19.2 vs 19.3.
- Prefill is the same kernels with T = chunk tokens: every row carries its own index rows (the gathered
  path runs row slices whose workspace fits ``GATHERED_MAX_BYTES``).
- Kernel preconditions: the entry geometry has ``n_tiles + 1`` a power of two and ``rope_dim == tile``
  (true for the V4 format: 7 FP8 tiles of 64 + 64 rope dims); otherwise ``backend="auto"`` runs the
  reference.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence

import torch
import triton

from dsv4.errors import check_tensor
from dsv4.formats.fp8_entry import FP8_DTYPE, ROPE_DTYPE, EntryPages, FP8EntryFormat
from dsv4.kernels.dispatch import DEFAULT_NUM_SMS, interpreter_enabled, num_sms, pdl_launch, sm_major, use_triton

__all__ = [
    "MIN_KEYS_PER_SPLIT",
    "choose_num_splits",
    "sparse_attention",
    "sparse_attention_reference",
    "sparse_attention_triton",
]

Cache = tuple[EntryPages, torch.Tensor]

# Defaults from the H200 sweep of 2026-12-02 (benchmarks/results/2026-12-02_h200_attention_sweep.jsonl): 64 heads x
# 64 entries per tile was the fastest config at B = 64 for both V4-Flash and V4-Pro (each entry dequantised once per
# 64 heads); block_h is capped at the number of heads.
DEFAULT_BLOCK_H = 64
DEFAULT_BLOCK_N = 64
DEFAULT_NUM_WARPS = 8
DEFAULT_NUM_STAGES = 1
MIN_KEYS_PER_SPLIT = 128  # below this a split's fixed cost (q load, partial write) dominates
# Gathered path (decode): keys per dense block, entries per gather program, software-pipeline depth, and the
# largest bf16 workspace it may allocate per call (bytes; bigger steps, i.e. prefill chunks, run fused).
GATHERED_BLOCK_N = 64
GATHER_BLOCK = 32
GATHERED_NUM_STAGES = 2
GATHERED_MAX_BYTES = 256 << 20  # workspace per slice of rows (prefill chunks run as several slices)
# H200 2026-12-02 (2026-12-02_h200_attention_v4.jsonl, CUDA graph): the gathered path was faster at every decode
# shape but one (V4-Flash HCA-8192 B = 1: 79 vs 66 us) and for prefill chunks (V4-Pro 1,024 rows: 1.68 vs 2.26 ms;
# V4-Flash 2,048 rows: 1.29 vs 1.31 ms), so it is the default everywhere.
DEFAULT_PATH = "gathered"
GATHERED_FILL = 0.5  # dense kernel: key splits up to ~num_sms / 2 programs (one [64, 512] fp32 acc fills an SM)
# The gathered path's dense launch: "triton" (``_dense_attn_fwd``), "gluon" (``_gluon_dense_attention``: two
# warpgroups split by head dim, asynchronous wgmma; sm_90 and head dim 512 only) or "auto" (the default): gluon where
# it can run and each program attends at least GLUON_MIN_KEYS keys (after the key split the Triton path would use),
# else triton.  H200 2026-12-04 (2026-12-04_h200_attention_s9.jsonl, CUDA graph, whole call): gluon ahead with long
# lists per program (V4-Pro B = 64 105.3 vs 112.0 us, V4-Flash B = 64 54.3 vs 56.3, HCA-8192 B = 8 V4-Pro 123.9 vs
# 133.7), behind on short split lists (B = 1: 20.3 vs 19.6 V4-Pro, 19.0 vs 17.8 V4-Flash).
# Gluon kernel geometry: keys per block, ring stages per warpgroup, worker-partition registers.
DENSE_KERNELS = ("auto", "triton", "gluon")
GLUON_MIN_KEYS = 256
GLUON_BLOCK_N = 32
GLUON_STAGES = 4
GLUON_WORKER_REGS = 232


# ---------------------------------------------------------------------------- validation
def _entry_format(pages: EntryPages) -> FP8EntryFormat:
    """The entry format these pages were made with (derived from the view shapes)."""
    nope_dim, rope_dim, n_tiles = pages.nope.shape[-1], pages.rope.shape[-1], pages.scale.shape[-1]
    if n_tiles <= 0 or nope_dim % n_tiles:
        raise ValueError(f"pages.scale: expected a divisor of nope dim {nope_dim} tiles, got {n_tiles}")
    return FP8EntryFormat(head_dim=nope_dim + rope_dim, rope_dim=rope_dim, tile=nope_dim // n_tiles)


def _validate(
    q: torch.Tensor, caches: Sequence[Cache], sink: torch.Tensor, scale: float, out: torch.Tensor | None
) -> list[FP8EntryFormat]:
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    T, H, D = q.shape
    check_tensor("sink", sink, dtype=torch.float32, shape=[H], device=q.device)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"scale: expected a Python float, got {type(scale).__name__}")
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, shape=[T, H, D], device=q.device)
    if len(caches) == 0:
        raise ValueError("caches: expected at least one (pages, idx) pair, got none")
    fmts = []
    for i, cache in enumerate(caches):
        if not (isinstance(cache, (tuple, list)) and len(cache) == 2):
            raise ValueError(f"caches[{i}]: expected a (EntryPages, idx) pair, got {type(cache).__name__}")
        pages, idx = cache
        if not isinstance(pages, EntryPages):
            raise ValueError(f"caches[{i}][0]: expected EntryPages, got {type(pages).__name__}")
        check_tensor(f"caches[{i}].nope", pages.nope, dtype=FP8_DTYPE, ndim=3, device=q.device)
        P, bs = pages.nope.shape[:2]
        check_tensor(f"caches[{i}].rope", pages.rope, dtype=ROPE_DTYPE, shape=[P, bs, None], device=q.device)
        check_tensor(f"caches[{i}].scale", pages.scale, dtype=torch.uint8, shape=[P, bs, None], device=q.device)
        check_tensor(f"caches[{i}].idx", idx, dtype=torch.int32, shape=[T, None], device=q.device)
        fmt = _entry_format(pages)
        if fmt.head_dim != D:
            raise ValueError(f"caches[{i}]: expected entries of head dim {D} (q's last dim), got {fmt.head_dim}")
        fmts.append(fmt)
    return fmts


def _kernel_supports(fmt: FP8EntryFormat) -> bool:
    n = fmt.n_tiles + 1
    return fmt.rope_dim == fmt.tile and n & (n - 1) == 0 and fmt.tile & (fmt.tile - 1) == 0


# ---------------------------------------------------------------------------- public op
def sparse_attention(
    q: torch.Tensor,
    caches: Sequence[Cache],
    sink: torch.Tensor,
    scale: float,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax with sink over the entries of several FP8 caches, for every query row and head.

    Args:
        q: [T, H, D] bf16 queries (T rows: decode requests, verify tokens or prefill-chunk tokens).
        caches: sequence of ``(pages, idx)``; ``pages`` is an ``EntryPages`` (MODEL1 FP8 layout, entries
            of D = 512 dims), ``idx`` [T, K_c] int32 physical slots (``page * bs + row``) per query row,
            ``-1`` (or any slot outside ``[0, pages.num_slots)``) = skip.  K_c may be 0.
        sink: [H] fp32 per-head sink logit (denominator only).
        scale: softmax scale applied to q.k (DeepSeek-V4: ``head_dim ** -0.5``).
        backend: ``"auto" | "torch" | "triton"`` (see ``dsv4.kernels.dispatch``).
        out: optional [T, H, D] bf16 tensor to write the output into (returned).

    Returns:
        ``(out [T, H, D] bf16, lse [T, H] fp32)`` with ``lse = log(sum_j exp(s_j) + exp(sink_h))``
        (natural log, sink included).  Rows without a valid entry give out = 0, lse = sink.
    Only metadata is validated (no host sync).
    """
    fmts = _validate(q, caches, sink, scale, out)
    tensors = [q, sink] + [t for pages, idx in caches for t in (*pages, idx)]
    has_kernel = all(_kernel_supports(f) for f in fmts)
    if use_triton(backend, *tensors, has_kernel=has_kernel):
        return sparse_attention_triton(q, caches, sink, scale, out=out)
    return sparse_attention_reference(q, caches, sink, scale, out=out)


# ---------------------------------------------------------------------------- reference
def gather_entries(pages: EntryPages, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised entries at ``idx`` [T, K] and their validity: (values [T, K, D] bf16, valid [T, K] bool).

    Invalid slots (``-1`` or out of range) read slot 0 of an empty-safe view and are flagged False.
    """
    fmt = _entry_format(pages)
    valid = (idx >= 0) & (idx < pages.num_slots)
    T, K = idx.shape
    if pages.num_slots == 0:
        return torch.zeros(T, K, fmt.head_dim, dtype=torch.bfloat16, device=idx.device), valid
    slot = torch.where(valid, idx, 0).long()
    page, row = slot // pages.entries_per_page, slot % pages.entries_per_page
    nope = pages.nope.view(torch.uint8)[page, row].view(FP8_DTYPE)  # index via uint8: fp8 indexing is patchy
    values = fmt.dequantize(nope, pages.rope[page, row], pages.scale[page, row])
    return values, valid


def sparse_attention_reference(
    q: torch.Tensor,
    caches: Sequence[Cache],
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of ``sparse_attention`` (same arguments and results; any device).

    Gathers and dequantises every indexed entry through the format, then one fp32 softmax with the
    sink over all caches together.
    """
    T, H, D = q.shape
    logits, values = [], []
    for pages, idx in caches:
        v, valid = gather_entries(pages, idx)
        v = v.float()  # [T, K, D]
        s = torch.einsum("thd,tkd->thk", q.float(), v) * scale
        logits.append(s.masked_fill(~valid[:, None, :], float("-inf")))
        values.append(v)
    s = torch.cat(logits, dim=-1)  # [T, H, sum K]
    v = torch.cat(values, dim=1)  # [T, sum K, D]
    sink_col = sink.float()[None, :].expand(T, H)
    m = torch.maximum(s.amax(-1), sink_col) if s.shape[-1] else sink_col
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m[..., None])
    denom = p.sum(-1) + torch.exp(sink_col - m)
    o = torch.einsum("thk,tkd->thd", p, v) / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
    lse = m + torch.log(denom)
    if out is None:
        out = torch.empty_like(q)
    out.copy_(o.to(torch.bfloat16))
    return out, lse


# ---------------------------------------------------------------------------- triton host side
def choose_num_splits(
    rows: int,
    head_blocks: int,
    total_blocks: int,
    block_n: int,
    num_sms: int = DEFAULT_NUM_SMS,
    fill: float = 0.25,
) -> int:
    """Key splits per (row, head block), from static shapes only (no device sync); 1 = no split.

    A split costs a round trip of its fp32 partial state [heads, 512] through a workspace, so it only pays
    when the grid is far too small for the GPU.  H200 sweeps of 2026-12-02 (attention_sweep and
    attention_variants in benchmarks/results): with >= num_sms / 4 programs (B = 64: 64 or 128) no split was
    fastest (V4-Pro 162 us vs 218 us with 3 splits); with fewer, ~num_sms / 4 programs in all was best
    (B = 1: 16 splits of 2 head blocks, 32 of 1; B = 8 V4-Flash: 4).  Each split keeps >= MIN_KEYS_PER_SPLIT keys.
    ``fill``: grids below ``fill * num_sms`` programs are split up to about that many (0.25: the fused kernel's
    measured optimum; the gathered path passes ``GATHERED_FILL``).
    """
    programs = max(1, rows * head_blocks)
    target = max(1, int(num_sms * fill))
    if total_blocks <= 1 or programs >= target:
        return 1
    want = math.ceil(target / programs)
    most = max(1, total_blocks // max(1, math.ceil(MIN_KEYS_PER_SPLIT / block_n)))
    return max(1, min(want, most, total_blocks))


def _cache_args(pages: EntryPages, idx: torch.Tensor, block_n: int) -> list:
    keys = idx.shape[1]
    return [
        pages.nope,
        pages.rope,
        pages.scale,
        idx,
        pages.nope.stride(0),
        pages.nope.stride(1),
        pages.rope.stride(0),
        pages.rope.stride(1),
        pages.scale.stride(0),
        pages.scale.stride(1),
        idx.stride(0),
        keys,
        pages.entries_per_page,
        pages.num_slots,
        -(-keys // block_n),
    ]


def _split_workspace(T: int, H: int, splits: int, D: int, device, placeholder: torch.Tensor):
    """fp32 partial states (m, l [T, H, splits], acc [T, H, splits, D]) for key splits; ``placeholder`` x 3
    when ``splits`` is 0 (no split: the kernels never touch them)."""
    if splits == 0:
        return placeholder, placeholder, placeholder
    ws_m = torch.empty(T, H, splits, dtype=torch.float32, device=device)
    return ws_m, torch.empty_like(ws_m), torch.empty(T, H, splits, D, dtype=torch.float32, device=device)


def _combine(ws, splits: int, sink, out, lse, interp: bool) -> None:
    """``_sparse_attn_combine``: merge the ``splits`` partial states of every (row, head), add the sink."""
    from dsv4.kernels.attention._triton_sparse_attention import _sparse_attn_combine

    T, H, D = out.shape
    _sparse_attn_combine[(T, H)](
        *ws, splits, sink, out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1), H, D=D,
        BLOCK_S=max(1, 1 << (splits - 1).bit_length()), INTERPRETER=interp, num_warps=4, **pdl_launch(out.device),
    )  # fmt: skip


def _padded_widths(caches, block_n: int) -> list[int]:
    """Each index list's length rounded up to whole blocks of ``block_n`` keys (the gathered workspace columns)."""
    return [triton.cdiv(idx.shape[1], block_n) * block_n for _, idx in caches]


def _gathered(q, caches, sink, scale, out, lse, fmt, block_h, block_n, num_splits, num_warps, num_stages, dense):
    """The two-launch path: ``_gather_dequant_kernel`` per pair of caches, then ``_dense_attn_fwd`` (+ combine).

    Rows are processed in slices whose workspace stays under ``GATHERED_MAX_BYTES`` (a prefill chunk of many
    tokens runs as several slices; decode steps are one)."""
    T, H, D = q.shape
    widths = _padded_widths(caches, block_n)
    cols = max(block_n, sum(widths))
    per_slice = max(1, GATHERED_MAX_BYTES // (cols * (2 * D + 4)))
    for r0 in range(0, T, per_slice):
        r1 = min(T, r0 + per_slice)
        sl = [(pages, idx[r0:r1]) for pages, idx in caches]
        _gathered_rows(
            q[r0:r1], sl, widths, sink, scale, out[r0:r1], lse[r0:r1], fmt, block_h, block_n, num_splits, num_warps,
            num_stages, dense,
        )  # fmt: skip
    return out, lse


_GLUON_BUILDS: dict[int, bool] = {}  # device index -> the Gluon dense kernel compiled there ("auto" only)


def _run_gluon(
    builds: dict, q: torch.Tensor, forced: bool, kernel: str, fallback: str, launch, stacklevel: int
) -> bool:
    """Run ``launch()`` (a Gluon kernel; Gluon is experimental) and say whether it ran.  Unless ``forced``, a failure
    on the device's first attempt is recorded in ``builds`` (device index -> built), warned about once
    ("<kernel> unavailable (...); using <fallback>") and answered False: the caller takes its Triton path, then and on
    every later call (its auto rule reads ``builds``).  A forced or later failure is raised.  ``stacklevel``: the
    warning's, counted from the caller."""
    first = q.device.index not in builds
    try:
        launch()
    except Exception as e:  # noqa: BLE001 - a Triton that cannot build the kernel -> the Triton path
        if forced or not first:
            raise
        builds[q.device.index] = False
        warnings.warn(f"{kernel} unavailable ({type(e).__name__}: {e}); using {fallback}", stacklevel=stacklevel + 1)
        return False
    builds[q.device.index] = True
    return True


def _auto_gluon(q: torch.Tensor, head_dim: int, cols: int, head_blocks: int, block_n: int) -> bool:
    """``dense="auto"``: the Gluon kernel runs here and each program would attend >= GLUON_MIN_KEYS keys (with the
    key split the Triton dense launch would use over ``block_n``-column blocks)."""
    if cols % GLUON_BLOCK_N or _GLUON_BUILDS.get(q.device.index) is False or not gluon_dense_supported(q, head_dim):
        return False  # (columns are padded to block_n: a block_n below GLUON_BLOCK_N leaves a partial block)
    ns, _ = _dense_splits(q.shape[0], head_blocks, cols // block_n, block_n, None, q.device)
    return cols >= GLUON_MIN_KEYS * ns


def gluon_dense_supported(q: torch.Tensor, head_dim: int) -> bool:
    """Whether the Gluon dense kernel can run for ``q``: CUDA sm_90, Triton with Gluon's Hopper module, D = 512."""
    from dsv4.kernels.attention._gluon_dense_attention import HALF, HAVE_GLUON

    if not (HAVE_GLUON and q.is_cuda and head_dim == 2 * HALF) or interpreter_enabled():
        return False
    return sm_major(q.device) == 9


def _dense_splits(T: int, head_blocks: int, n_blocks: int, block_n: int, num_splits, device) -> tuple[int, int]:
    """(key splits, blocks per split) of a dense launch over ``n_blocks`` blocks of ``block_n`` workspace columns:
    ``num_splits`` if given, else ``choose_num_splits`` (``GATHERED_FILL``); every split gets at least one block."""
    if num_splits is None:
        num_splits = choose_num_splits(T, head_blocks, n_blocks, block_n, num_sms(device), fill=GATHERED_FILL)
    ns = max(1, min(int(num_splits), n_blocks))
    bps = -(-n_blocks // ns)
    return -(-n_blocks // bps), bps


def _dense_gluon(q, sink, kv, bias, out, lse, scale, n_cols, num_splits, interp) -> None:
    """``_dense_attn_ws_kernel`` over the gathered workspace (+ the combine when keys are split)."""
    from dsv4.kernels.attention._gluon_dense_attention import BLOCK_HEADS, _dense_attn_ws_kernel
    from dsv4.kernels.attention._triton_sparse_attention import LOG2E

    T, H, D = q.shape
    n_blocks = n_cols // GLUON_BLOCK_N
    head_blocks = -(-H // BLOCK_HEADS)
    ns, bps = _dense_splits(T, head_blocks, n_blocks, GLUON_BLOCK_N, num_splits, q.device)
    split = ns > 1
    ws = _split_workspace(T, H, ns if split else 0, D, q.device, lse)
    _dense_attn_ws_kernel[(T, head_blocks, ns)](
        q, q.stride(0), q.stride(1), sink, kv, bias, kv.stride(0), bias.stride(0), n_blocks, bps, out,
        out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1), *ws, ns, H, float(scale) * LOG2E,
        BLOCK_N=GLUON_BLOCK_N, STAGES=GLUON_STAGES, WORKER_REGS=GLUON_WORKER_REGS, num_warps=4,
        **pdl_launch(q.device),
    )  # fmt: skip
    if split:
        _combine(ws, ns, sink, out, lse, interp)


GLUON_FUSED_BLOCK_N = 32  # keys per block of the fused Gluon kernel (its smem holds STAGES x BLOCK_N x 1 KiB of bf16)
GLUON_FUSED_STAGES = 3  # bf16 stages the fused Gluon kernel's producers fill ahead (path="gluon_fused")
GLUON_FUSED_RAW = 2  # each producer's raw (FP8 + rope) cp.async stages
# registers a thread of each producer warpgroup / of consumer W = 1 gets (W = 0 gets the rest of the 64K: 512 - 208 -
# 2 x 48 = 208).  Triton 3.6: at 40 a producer spills in its loop, at 56 W = 0 (192) spills a dozen words; 48 leaves
# a few: the producers' prologues and two of W = 0's loop values (an 8-byte stack).
GLUON_FUSED_PRODUCER_REGS = 48
# (session 29, symmetric consumers, triton 3.6 ``sass_report.py --loops``: at 208 / 208 W = 0's loop has 11 spill
# loads and stores a pair, W = 1's none; at 192 / 224 neither has any and the stack is 0 B.  Timing queued, s29g.)
GLUON_FUSED_WORKER_REGS = 208
# how the fused kernel's producers turn e4m3 bytes into bf16 (``_dequant_half``): 0 through fp32 (two conversions
# and a pack a pair: the conversion pipe), 2 integer ops + ``mul.rn.bf16x2`` (no conversion); both exact.  (1, the
# fp32 form with a ``prmt`` truncation for the pack, measured slower on the H100 in session 28 and was removed.)
GLUON_FUSED_DEQUANT = 0
# timing experiments only (``profile_attention.py --fused ABLATE=n`` does not check results): bits 1 no gather, 2 no
# dequantisation, 4 no MMAs, 8 idle consumers, 16 no index loads (see ``_sparse_attn_ws_kernel``); 0 in every real call
GLUON_FUSED_ABLATE = 0
# the fused kernel's consumers move their softmax frame (and rescale the accumulator) only in pairs where a row's max
# grew by more than this (log2 units; 0: in every pair).  Opt-in and not yet run on a GPU (session 29 had no device
# time left): its GPU test and timing are queued as ``run_h200.sh s29g``; at 8 each consumer's loop carries the 128
# rescale FMULs a pair under a branch (and 52 more uniform-register moves), sm_90 SASS
GLUON_FUSED_LAZY = 0


def _fused_aligned(pages: EntryPages) -> bool:
    """The fused Gluon kernel's geometry (7 FP8 tiles of ``TILE`` + ``TILE`` rope dims) and its copies' alignment:
    16-byte aligned FP8 rows and rope rows and 8-byte scale rows (each entry's 7 UE8M0 bytes + a pad byte, read as
    one int64); the entry format's page views have them (576-byte data rows, 8-byte scale rows, page strides a
    multiple of 576)."""
    from dsv4.kernels.attention._gluon_fused_attention import TILE

    nope, rope, sc = pages.nope, pages.rope, pages.scale
    if (nope.shape[-1], rope.shape[-1], sc.shape[-1]) != (7 * TILE, TILE, 7):
        return False
    return (
        nope.data_ptr() % 16 == 0 and nope.stride(0) % 16 == 0 and nope.stride(1) % 16 == 0
        and rope.data_ptr() % 16 == 0 and rope.stride(0) % 8 == 0 and rope.stride(1) % 8 == 0
        and sc.data_ptr() % 8 == 0 and sc.stride(0) % 8 == 0 and sc.stride(1) == 8 and sc.stride(2) == 1
    )  # fmt: skip


def _scale_words(pages: EntryPages) -> torch.Tensor:
    """The fused Gluon kernel's view of ``pages``' UE8M0 bytes: each entry's 7 scale bytes + its pad byte as one
    int64, [pages, bs, 1].  Views without the alignment of ``_fused_aligned`` are refused."""
    sc = pages.scale
    if not _fused_aligned(pages):
        nope, rope = pages.nope, pages.rope
        raise ValueError(
            "path='gluon_fused': expected the V4 entry geometry with 16-byte aligned FP8 / rope rows and 8-byte "
            f"scale rows (the entry format's page views); got shapes {tuple(nope.shape)}, {tuple(rope.shape)}, "
            f"{tuple(sc.shape)}, strides {nope.stride()}, {rope.stride()}, {sc.stride()}, data pointers mod 16: "
            f"{nope.data_ptr() % 16}, {rope.data_ptr() % 16}, {sc.data_ptr() % 16}"
        )
    words = sc.as_strided((sc.shape[0], sc.shape[1], 8), sc.stride())
    return words.view(torch.int64)


_GLUON_FUSED_BUILDS: dict[int, bool] = {}  # device index -> the fused Gluon kernel compiled there (auto only)


def _auto_gluon_fused(q: torch.Tensor, caches: Sequence[Cache]) -> bool:
    """``path=None``: the fused Gluon kernel runs here (sm_90, Gluon, head dim 512, at most two caches with the
    entry format's alignment) and did not fail to build on this device."""
    return (
        _GLUON_FUSED_BUILDS.get(q.device.index) is not False
        and 0 < len(caches) <= 2
        and gluon_dense_supported(q, q.shape[-1])
        and all(_fused_aligned(pages) for pages, _ in caches)
    )


def selected_path(q: torch.Tensor, caches: Sequence[Cache]) -> str:
    """The path ``sparse_attention_triton`` takes with its defaults: ``"gluon_fused"`` where it can run, else
    ``DEFAULT_PATH`` (for benchmarks and logs; no kernel is launched)."""
    return "gluon_fused" if _auto_gluon_fused(q, caches) else DEFAULT_PATH


def _fused_gluon(q, caches, sink, scale, out, lse, num_splits) -> tuple[torch.Tensor, torch.Tensor]:
    """``_sparse_attn_ws_kernel``: the Gluon kernel that reads the FP8 entries of up to two caches directly (a
    producer warpgroup dequantises into shared memory; + the combine when keys are split)."""
    from dsv4.kernels.attention._gluon_dense_attention import BLOCK_HEADS
    from dsv4.kernels.attention._gluon_fused_attention import _sparse_attn_ws_kernel
    from dsv4.kernels.attention._triton_sparse_attention import LOG2E

    if len(caches) > 2:
        raise ValueError(f"path='gluon_fused': expected at most 2 caches, got {len(caches)}")
    T, H, D = q.shape
    bn = GLUON_FUSED_BLOCK_N
    args = []
    for pages, idx in caches:
        scale64 = _scale_words(pages)
        args += [idx, idx.stride(0), idx.shape[1], pages.entries_per_page, pages.num_slots]
        args += [pages.nope, pages.rope, scale64, pages.nope.stride(0), pages.nope.stride(1)]
        args += [pages.rope.stride(0), pages.rope.stride(1), scale64.stride(0), scale64.stride(1)]
    if len(caches) == 1:  # cache B = cache A with an empty list
        args += args[:2] + [0] + args[3:14]
    a_blocks = -(-caches[0][1].shape[1] // bn)
    n_blocks = max(1, a_blocks + (-(-caches[1][1].shape[1] // bn) if len(caches) == 2 else 0))
    head_blocks = -(-H // BLOCK_HEADS)
    ns, bps = _dense_splits(T, head_blocks, n_blocks, bn, num_splits, q.device)
    split = ns > 1
    ws = _split_workspace(T, H, ns if split else 0, D, q.device, lse)
    _sparse_attn_ws_kernel[(T, head_blocks, ns)](
        q, q.stride(0), q.stride(1), sink, *args, a_blocks, n_blocks, bps, out, out.stride(0), out.stride(1), lse,
        lse.stride(0), lse.stride(1), *ws, ns, H, float(scale) * LOG2E, BLOCK_N=bn, STAGES=GLUON_FUSED_STAGES,
        RAW=GLUON_FUSED_RAW, PRODUCER_REGS=GLUON_FUSED_PRODUCER_REGS,
        WORKER_REGS=GLUON_FUSED_WORKER_REGS, DEQ=GLUON_FUSED_DEQUANT, ABLATE=GLUON_FUSED_ABLATE,
        LAZY=GLUON_FUSED_LAZY, num_warps=4, **pdl_launch(q.device),
    )  # fmt: skip
    if split:
        _combine(ws, ns, sink, out, lse, interpreter_enabled())
    return out, lse


def _gathered_rows(
    q, caches, widths, sink, scale, out, lse, fmt, block_h, block_n, num_splits, num_warps, num_stages, dense
):
    from dsv4.kernels.attention._triton_gathered_attention import _dense_attn_fwd, _gather_dequant_kernel
    from dsv4.kernels.attention._triton_sparse_attention import LOG2E

    T, H, D = q.shape
    interp = interpreter_enabled()
    if sum(widths) == 0:  # no keys at all: one masked block, so the softmax sees only the sink
        cols = block_n
        kv = torch.zeros(T, cols, D, dtype=torch.bfloat16, device=q.device)
        bias = torch.full((T, cols), float("-inf"), dtype=torch.float32, device=q.device)
    else:  # every column is written by the gather (lists padded to block_n with masked keys)
        cols = sum(widths)
        kv = torch.empty(T, cols, D, dtype=torch.bfloat16, device=q.device)
        bias = torch.empty(T, cols, dtype=torch.float32, device=q.device)
    gblk = min(GATHER_BLOCK, block_n)
    gkw = {"BLOCK_G": gblk, "TILE": fmt.tile, "N_TILES": fmt.n_tiles + 1, "NOPE_TILES": fmt.n_tiles}
    col = 0
    for i in range(0, len(caches), 2):
        group = caches[i : i + 2]
        a = _cache_args(*group[0], gblk)
        b = _cache_args(*group[1], gblk) if len(group) == 2 else a[:11] + [0, 1, 0, 0]
        # each list padded to block_n columns: its blocks of gblk entries cover the padding (masked keys)
        a[-1] = widths[i] // gblk
        if len(group) == 2:
            b[-1] = widths[i + 1] // gblk
        n_prog = a[-1] + (b[-1] if len(group) == 2 else 0)
        if n_prog:
            _gather_dequant_kernel[(T, n_prog)](
                kv, bias, kv.stride(0), bias.stride(0), col, *a, *b, HAS_B=len(group) == 2, num_warps=4, **gkw,
                **pdl_launch(kv.device),
            )  # fmt: skip
        col += sum(widths[i : i + 2])
    head_blocks = -(-H // block_h)
    if dense == "gluon" or (dense == "auto" and _auto_gluon(q, D, cols, head_blocks, block_n)):
        launch = functools.partial(_dense_gluon, q, sink, kv, bias, out, lse, scale, cols, num_splits, interp)
        if _run_gluon(_GLUON_BUILDS, q, dense == "gluon", "Gluon dense attention kernel", "Triton's", launch, 3):
            return out, lse
    n_blocks = cols // block_n
    ns, bps = _dense_splits(T, head_blocks, n_blocks, block_n, num_splits, q.device)
    split = ns > 1
    ws = _split_workspace(T, H, ns if split else 0, D, q.device, lse)
    _dense_attn_fwd[(T, head_blocks, ns)](
        q, q.stride(0), q.stride(1), sink, kv, bias, kv.stride(0), bias.stride(0), n_blocks, bps, out,
        out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1), *ws, ns, H,
        float(scale) * LOG2E, BLOCK_H=block_h, BLOCK_N=block_n, D=D, SPLIT=split, INTERPRETER=interp,
        num_warps=num_warps or DEFAULT_NUM_WARPS, num_stages=num_stages or GATHERED_NUM_STAGES, **pdl_launch(q.device),
    )  # fmt: skip
    if split:
        _combine(ws, ns, sink, out, lse, interp)
    return out, lse


def sparse_attention_triton(
    q: torch.Tensor,
    caches: Sequence[Cache],
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    qk_tiles: int | None = None,
    d_split: int = 1,
    path: str | None = None,
    dense: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of ``sparse_attention`` (arguments validated by the caller).

    ``path``: ``"fused"`` (gather + dequantise + attend in one Triton kernel), ``"gathered"`` (dequantise the
    indexed entries into a bf16 workspace, then a pipelined dense flash-decoding kernel; see
    ``_triton_gathered_attention``), ``"gluon_fused"`` (sm_90: the warp-specialised Gluon kernel that reads the FP8
    entries itself; ``ValueError`` elsewhere; ``_gluon_fused_attention``) or None: ``"gluon_fused"`` where it can
    run and no Triton knob below (other than ``num_splits``) is given, else gathered, unless a fused-only variant
    is asked for.
    ``dense``: the gathered path's dense kernel: ``"auto"`` (default; see ``DENSE_KERNELS``), ``"triton"`` or
    ``"gluon"`` (sm_90, head dim 512; ``ValueError`` elsewhere; ``_gluon_dense_attention``).  The knobs
    below apply to the fused path,
    except ``num_splits``, ``block_h``, ``block_n``, ``num_warps`` and ``num_stages``, which both use.

    Tuning knobs (keyword-only): ``num_splits`` key splits per (row, head block) for each launch (None:
    ``choose_num_splits``), ``block_h`` heads per program (>= 16), ``block_n`` keys per block (>= 16),
    ``num_warps``, ``num_stages``.  Kernel variants (see ``_attend_block``):

    - ``qk_tiles``: QK^T in D-chunks of ``qk_tiles`` 64-dim tiles (a power of two dividing the 8 tiles of an
      entry, rope tile included), q chunks re-loaded from global memory instead of a [block_h, 512] q tile
      held in registers; None (default) = one dot over the whole head dim.
    - ``d_split``: programs per (row, head block, key split) that share the output dims (1, 2, 4, 8); each
      computes the full QK^T and the softmax but P.V (and the accumulator) for ``512 / d_split`` dims only.
      QK work and the K gather are repeated ``d_split`` times; the accumulator registers shrink by it.

    Works on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU tensors.
    """
    from dsv4.kernels.attention._triton_sparse_attention import LOG2E, _sparse_attn_fwd

    T, H, D = q.shape
    fmt = _entry_format(caches[0][0])
    requested = (path, block_h, block_n, qk_tiles)  # as given (the recursion below decides again)
    auto_fused = False
    if path is None:  # the Triton-only knobs imply a Triton path; the fused-only variants the fused one
        fused_only = qk_tiles is not None or d_split != 1
        triton_knobs = (
            fused_only or dense != "auto" or any(k is not None for k in (block_h, block_n, num_warps, num_stages))
        )
        auto_fused = not triton_knobs and _auto_gluon_fused(q, caches)
        path = "fused" if fused_only else DEFAULT_PATH
    if path not in ("fused", "gathered", "gluon_fused"):
        raise ValueError(f"path: expected 'fused', 'gathered', 'gluon_fused' or None, got {path!r}")
    if path == "gluon_fused" and not gluon_dense_supported(q, q.shape[-1]):
        raise ValueError(f"path='gluon_fused': needs a CUDA sm_90 device and Gluon; got device {q.device}")
    if dense not in DENSE_KERNELS:
        raise ValueError(f"dense: expected one of {DENSE_KERNELS}, got {dense!r}")
    if dense == "gluon" and not gluon_dense_supported(q, D := q.shape[-1]):
        raise ValueError(
            f"dense='gluon': needs a CUDA sm_90 device, Triton with Gluon's Hopper module and head dim 512; got "
            f"device {q.device}, head dim {D}, interpreter {interpreter_enabled()}"
        )
    block_h = block_h or min(DEFAULT_BLOCK_H, max(16, triton.next_power_of_2(q.shape[1])))
    block_n = block_n or (DEFAULT_BLOCK_N if path == "fused" else GATHERED_BLOCK_N)
    if dense == "gluon" and block_n % GLUON_BLOCK_N:
        raise ValueError(f"dense='gluon': expected block_n a multiple of {GLUON_BLOCK_N} (whole blocks), got {block_n}")
    kw = {"num_warps": num_warps or DEFAULT_NUM_WARPS, "num_stages": num_stages or DEFAULT_NUM_STAGES}
    n_tiles = fmt.n_tiles + 1  # FP8 tiles + the rope tile
    qk_tiles = n_tiles if qk_tiles is None else int(qk_tiles)
    if qk_tiles <= 0 or n_tiles % qk_tiles or qk_tiles & (qk_tiles - 1):
        raise ValueError(f"qk_tiles: expected a power of two dividing {n_tiles}, got {qk_tiles}")
    if d_split <= 0 or n_tiles % d_split or d_split & (d_split - 1):
        raise ValueError(f"d_split: expected a power of two dividing {n_tiles}, got {d_split}")
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out, lse
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out.stride(-1) != 1:
        res, lse = sparse_attention_triton(
            q,
            caches,
            sink,
            scale,
            None,
            num_splits=num_splits,
            block_h=requested[1],
            block_n=requested[2],
            num_warps=num_warps,
            num_stages=num_stages,
            qk_tiles=requested[3],
            d_split=d_split,
            path=requested[0],
            dense=dense,
        )
        out.copy_(res)
        return out, lse
    caches = [(pages, idx if idx.stride(-1) == 1 else idx.contiguous()) for pages, idx in caches]
    sink = sink.contiguous()
    if path == "gluon_fused" or auto_fused:
        launch = functools.partial(_fused_gluon, q, caches, sink, scale, out, lse, num_splits)
        forced = path == "gluon_fused"
        if _run_gluon(_GLUON_FUSED_BUILDS, q, forced, "fused Gluon attention kernel", f"the {path} path", launch, 2):
            return out, lse
    if path == "gathered":
        return _gathered(
            q, caches, sink, scale, out, lse, fmt, block_h, block_n, num_splits, num_warps, num_stages, dense
        )
    head_blocks = -(-H // block_h)
    groups = [caches[i : i + 2] for i in range(0, len(caches), 2)]
    group_blocks = [sum(-(-idx.shape[1] // block_n) for _, idx in g) for g in groups]
    if num_splits is None:
        sms = num_sms(q.device)
        splits = [choose_num_splits(T, head_blocks, nb, block_n, sms) for nb in group_blocks]
    else:
        splits = [max(1, int(num_splits))] * len(groups)
    use_ws = len(groups) > 1 or splits[0] > 1
    ws_splits = sum(splits)
    ws_m, ws_l, ws_acc = _split_workspace(T, H, ws_splits if use_ws else 0, D, q.device, lse)
    qk_scale_log2 = float(scale) * LOG2E
    interp = interpreter_enabled()  # CPU tensors only run under TRITON_INTERPRET=1
    offset = 0
    for group, nb, ns in zip(groups, group_blocks, splits, strict=True):
        a = _cache_args(*group[0], block_n)
        b = _cache_args(*group[1], block_n) if len(group) == 2 else a[:11] + [0, 1, 0, 0]
        bps = max(1, -(-nb // ns))
        _sparse_attn_fwd[(T, head_blocks * d_split, ns)](
            q,
            q.stride(0),
            q.stride(1),
            sink,
            *a,
            *b,
            out,
            out.stride(0),
            out.stride(1),
            lse,
            lse.stride(0),
            lse.stride(1),
            ws_m,
            ws_l,
            ws_acc,
            ws_splits,
            offset,
            bps,
            H,
            qk_scale_log2,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            TILE=fmt.tile,
            N_TILES=fmt.n_tiles + 1,
            NOPE_TILES=fmt.n_tiles,
            HAS_B=len(group) == 2,
            SPLIT=use_ws,
            QK_TILES=qk_tiles,
            D_SPLIT=d_split,
            INTERPRETER=interp,
            **kw,
            **pdl_launch(q.device),
        )
        offset += ns
    if use_ws:
        _combine((ws_m, ws_l, ws_acc), ws_splits, sink, out, lse, interp)
    return out, lse
