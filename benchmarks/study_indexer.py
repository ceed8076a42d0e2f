"""Where the time of the indexer's fp8mma scores kernel goes: a lesion study on the H200.

    python benchmarks/study_indexer.py --out benchmarks/results/study_indexer.jsonl     # H200, ~1-2 min
    python benchmarks/study_indexer.py --smoke                                          # CPU, interpreter

The study kernel repeats the fast loop of ``scores._mxfp4_scores_kernel`` (impl "fp8mma": per tile of
BLOCK_N keys, four K=32 FP8 MMAs of the re-encoded e2m1 bytes against the query, each block's product times
its relative UE8M0 scale, then ReLU x head weights summed over heads) with parts switched off one at a time
by constexpr flags, at the benchmark shape (1M-token context = 262,144 keys a request, B = 4, 64 heads):

- ``LOAD=0``: the packed key bytes are made from the entry index instead of loaded (block table and scale
  words are still loaded);
- ``CONVERT=0``: the bytes go to the MMA as they are (no e2m1 -> e4m3 re-encoding; the even/odd
  interleave of the tile is kept);
- ``SCALE=0``: the four block products are added without their scales;
- ``EPI=0``: the output is the plain sum of the logits over heads (no ReLU, no head weights);
- ``ONE_DOT=1``: one K=128 MMA of the whole key instead of four K=32 (the block scales ignored): the
  bound for any exact one-MMA encoding (``impl="fold"``);
- ``PAIR=1`` (full math): two tiles an iteration, both tiles' MMAs issued before either epilogue, so that
  the chains of consecutive tiles can overlap (session 7 found the per-tile chain to be the limit); try it
  with 64-entry tiles (``--launches 64,4,2,32``: 128 entries an iteration, as the default).

Only ``full`` and ``pair`` compute the real scores (checked against the reference); the others time an incomplete
computation on purpose.  Time = CUDA-graph GPU time per call after an L2 flush (``GraphTimer``).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_indexer import env_info, make_problem  # noqa: E402
from benchmarks.sweep_indexer import GraphTimer  # noqa: E402
from dsv4.engine.bench import write_jsonl  # noqa: E402
from dsv4.formats import MXFP4KeyFormat  # noqa: E402
from dsv4.kernels.indexer import indexer_scores_reference  # noqa: E402
from dsv4.kernels.indexer import scores as S  # noqa: E402

FMT = MXFP4KeyFormat()
# name -> (LOAD, CONVERT, SCALE, EPI, ONE_DOT, PAIR)
VARIANTS = {
    "full": (1, 1, 1, 1, 0, 0),
    "noscale": (1, 1, 0, 1, 0, 0),
    "noepi": (1, 1, 1, 0, 0, 0),
    "noscale_noepi": (1, 1, 0, 0, 0, 0),
    "noconvert": (1, 0, 1, 1, 0, 0),
    "noload": (0, 1, 1, 1, 0, 0),
    "skeleton": (0, 0, 0, 0, 0, 0),
    "onedot": (1, 1, 0, 1, 1, 0),
    "onedot_skeleton": (0, 0, 0, 0, 1, 0),
    "pair": (1, 1, 1, 1, 0, 1),
    "pair_noload": (0, 1, 1, 1, 0, 1),
}
FLAG_NAMES = ("LOAD", "CONVERT", "SCALE", "EPI", "ONE_DOT", "PAIR")


@triton.jit
def _study_block_dot(kptr, offs_n, ok, q8, c: tl.constexpr, QB: tl.constexpr, LOAD: tl.constexpr,
                     CONVERT: tl.constexpr, FP32_DOT: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    offs_b = c * (QB // 2) + tl.arange(0, QB // 2)
    if LOAD:
        pc = tl.load(kptr[:, None] + offs_b[None, :], mask=ok[:, None], other=0)
    else:
        pc = ((offs_n[:, None] * 13 + offs_b[None, :]) & 0x77).to(tl.uint8)
    if CONVERT:
        if ASM:
            lo, hi = S._e2m1_bytes_to_e4m3_asm(pc)
        else:
            lo = ((pc & 7) << 2) | ((pc & 8) << 4)
            hi = ((pc >> 2) & 0x1C) | (pc & 0x80)
    else:
        lo = pc
        hi = pc
    k8 = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (lo.shape[0], QB))
    k8 = k8.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return S._dot(k8, q8, tl.zeros((lo.shape[0], q8.shape[1]), tl.float32), FP32_DOT)


@triton.jit
def _study_logits(
    offs_n, left, nv, row, bt_ptr, stride_bt, MAX_BLOCKS, NUM_PAGES, BS, data_ptr, stride_dp, stride_dr, scale_ptr,
    stride_sp, stride_sr, q8_0, q8_1, q8_2, q8_3, q8_a, QB: tl.constexpr, FP32_DOT: tl.constexpr, ASM: tl.constexpr,
    LOAD: tl.constexpr, CONVERT: tl.constexpr, SCALE: tl.constexpr, ONE_DOT: tl.constexpr,
):  # fmt: skip
    """One tile's [BLOCK_N, HP] logits (block products, scaled relative to the key's largest block when SCALE),
    its valid mask (only if ``left``, the program's live tiles from this one on, is > 0) and the keys' largest
    scale bytes."""
    ok, kptr, s4 = S._tile_keys(
        offs_n, nv, row, bt_ptr, stride_bt, MAX_BLOCKS, NUM_PAGES, BS, data_ptr, stride_dp, stride_dr, scale_ptr,
        stride_sp, stride_sr,
    )  # fmt: skip
    ok = ok & ((offs_n * 0 + left) > 0)
    s0 = tl.maximum(tl.maximum(S._sbyte(s4, 0), S._sbyte(s4, 1)), tl.maximum(S._sbyte(s4, 2), S._sbyte(s4, 3)))
    if ONE_DOT:
        acc = _study_block_dot(kptr, offs_n, ok, q8_a, 0, 4 * QB, LOAD, CONVERT, FP32_DOT, ASM)
    elif SCALE:
        acc = (
            _study_block_dot(kptr, offs_n, ok, q8_0, 0, QB, LOAD, CONVERT, FP32_DOT, ASM)
            * S._rel_scale(S._sbyte(s4, 0), s0)[:, None]
        )
        acc += (
            _study_block_dot(kptr, offs_n, ok, q8_1, 1, QB, LOAD, CONVERT, FP32_DOT, ASM)
            * S._rel_scale(S._sbyte(s4, 1), s0)[:, None]
        )
        acc += (
            _study_block_dot(kptr, offs_n, ok, q8_2, 2, QB, LOAD, CONVERT, FP32_DOT, ASM)
            * S._rel_scale(S._sbyte(s4, 2), s0)[:, None]
        )
        acc += (
            _study_block_dot(kptr, offs_n, ok, q8_3, 3, QB, LOAD, CONVERT, FP32_DOT, ASM)
            * S._rel_scale(S._sbyte(s4, 3), s0)[:, None]
        )
    else:
        acc = _study_block_dot(kptr, offs_n, ok, q8_0, 0, QB, LOAD, CONVERT, FP32_DOT, ASM)
        acc += _study_block_dot(kptr, offs_n, ok, q8_1, 1, QB, LOAD, CONVERT, FP32_DOT, ASM)
        acc += _study_block_dot(kptr, offs_n, ok, q8_2, 2, QB, LOAD, CONVERT, FP32_DOT, ASM)
        acc += _study_block_dot(kptr, offs_n, ok, q8_3, 3, QB, LOAD, CONVERT, FP32_DOT, ASM)
    return acc, ok, s0


@triton.jit
def _study_finish(acc, ok, s0, offs_n, left, wq, out_row, N, EPI: tl.constexpr):
    """Epilogue of one tile: ReLU x head weights summed over heads (EPI; else the plain sum), stored if left > 0."""
    if EPI:
        s = tl.sum(tl.maximum(acc, 0.0) * wq[None, :], axis=1) * S._pow2(s0)
    else:
        s = tl.sum(acc, axis=1)
    tl.store(out_row + offs_n, tl.where(ok, s, float("-inf")), mask=(offs_n < N) & ((offs_n * 0 + left) > 0))


@triton.jit(do_not_specialize=["tiles"])
def _study_kernel(
    q_ptr, w_ptr, data_ptr, scale_ptr, bt_ptr, row_ptr, nv_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_dp, stride_dr, stride_sp, stride_sr, stride_bt, stride_ot,
    H, N, MAX_BLOCKS, NUM_PAGES, tiles,
    BS: tl.constexpr, HP: tl.constexpr, QB: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
    ASM: tl.constexpr, LOAD: tl.constexpr, CONVERT: tl.constexpr, SCALE: tl.constexpr, EPI: tl.constexpr,
    ONE_DOT: tl.constexpr, PAIR: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(row_ptr + t).to(tl.int64)
    nv = tl.load(nv_ptr + t)
    offs_h = tl.arange(0, HP)
    h_ok = offs_h < H
    q_base = q_ptr + t.to(tl.int64) * stride_qt + offs_h[None, :] * stride_qh
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=h_ok, other=0.0) * 64.0  # 2**6: e4m3 codes
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    first = chunk * tiles
    n_live = tl.minimum(tl.maximum((nv - first * BLOCK_N + BLOCK_N - 1) // BLOCK_N, 0), tiles)
    tile0 = first * BLOCK_N + tl.arange(0, BLOCK_N)
    qc0, be0 = S._q_block(q_base, 0, h_ok, QB)
    qc1, be1 = S._q_block(q_base, 1, h_ok, QB)
    qc2, be2 = S._q_block(q_base, 2, h_ok, QB)
    qc3, be3 = S._q_block(q_base, 3, h_ok, QB)
    bmax = tl.maximum(tl.maximum(be0, be1), tl.maximum(be2, be3))
    bmax = tl.where(bmax == 0, 127, bmax)
    q8_0, _ = S._to_fp8(qc0, bmax)
    q8_1, _ = S._to_fp8(qc1, bmax)
    q8_2, _ = S._to_fp8(qc2, bmax)
    q8_3, _ = S._to_fp8(qc3, bmax)
    qa, ba = S._q_block(q_base, 0, h_ok, 4 * QB)  # the whole query, even elements then odd (ONE_DOT)
    q8_a, _ = S._to_fp8(qa, tl.where(ba == 0, 127, ba))
    wq = w * S._pow2(bmax)
    if PAIR:
        # two tiles an iteration, both tiles' MMAs issued before either epilogue (independent chains the
        # scheduler can overlap); the second tile of an odd count is masked off (it may be the next chunk's)
        for i in range(0, n_live, 2):
            offs_a = tile0 + i * BLOCK_N
            offs_b = offs_a + BLOCK_N
            acc_a, ok_a, s0_a = _study_logits(
                offs_a, n_live - i, nv, row, bt_ptr, stride_bt, MAX_BLOCKS, NUM_PAGES, BS, data_ptr, stride_dp,
                stride_dr, scale_ptr, stride_sp, stride_sr, q8_0, q8_1, q8_2, q8_3, q8_a, QB, FP32_DOT, ASM, LOAD,
                CONVERT, SCALE, ONE_DOT,
            )  # fmt: skip
            acc_b, ok_b, s0_b = _study_logits(
                offs_b, n_live - i - 1, nv, row, bt_ptr, stride_bt, MAX_BLOCKS, NUM_PAGES, BS, data_ptr,
                stride_dp, stride_dr, scale_ptr, stride_sp, stride_sr, q8_0, q8_1, q8_2, q8_3, q8_a, QB, FP32_DOT,
                ASM, LOAD, CONVERT, SCALE, ONE_DOT,
            )  # fmt: skip
            _study_finish(acc_a, ok_a, s0_a, offs_a, n_live - i, wq, out_row, N, EPI)
            _study_finish(acc_b, ok_b, s0_b, offs_b, n_live - i - 1, wq, out_row, N, EPI)
    else:
        for i in range(0, n_live):
            offs_n = tile0 + i * BLOCK_N
            acc, ok, s0 = _study_logits(
                offs_n, n_live - i, nv, row, bt_ptr, stride_bt, MAX_BLOCKS, NUM_PAGES, BS, data_ptr, stride_dp,
                stride_dr, scale_ptr, stride_sp, stride_sr, q8_0, q8_1, q8_2, q8_3, q8_a, QB, FP32_DOT, ASM, LOAD,
                CONVERT, SCALE, ONE_DOT,
            )  # fmt: skip
            _study_finish(acc, ok, s0, offs_n, n_live - i, wq, out_row, N, EPI)
    for i in range(n_live, tiles):
        offs_n = tile0 + i * BLOCK_N
        tl.store(out_row + offs_n, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=offs_n < N)


def study_fn(flags, q, w, keys, bt, tr, nv, n, cfg, out):
    """A no-argument callable launching the study kernel with ``flags`` (see FLAG_NAMES)."""
    load, convert, scale, epi, one_dot, pair = flags
    scale32 = S._scale_words(keys.scale)
    interp = S.interpreter_enabled()

    def run():
        _study_kernel[cfg.grid](
            q, w, keys.data, scale32, bt, tr, nv, out,
            q.stride(0), q.stride(1), w.stride(0), keys.data.stride(0), keys.data.stride(1),
            scale32.stride(0), scale32.stride(1), bt.stride(0), out.stride(0),
            q.shape[1], n, bt.shape[1], keys.data.shape[0], cfg.tiles,
            BS=keys.entries_per_page, HP=cfg.hp, QB=FMT.block, BLOCK_N=cfg.block_n, FP32_DOT=interp,
            ASM=not interp, LOAD=load, CONVERT=convert, SCALE=scale, EPI=epi, ONE_DOT=one_dot, PAIR=pair,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[4])
    ap.add_argument("--entries", type=int, default=262144)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--launches", nargs="+", default=["default"], help="block_n,warps,stages,tiles each, or 'default'")
    ap.add_argument("--smoke", action="store_true", help="tiny shape under the interpreter (CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    entries, heads, page = (256, 8, 64) if args.smoke else (args.entries, 64, 64)
    info = env_info(dev)
    rows = []
    for B in args.batches:
        gen = torch.Generator(device=dev).manual_seed(B)
        keys, bt, q, w, tr, nv = make_problem(B, entries, heads, page, dev, gen)
        want = indexer_scores_reference(q, w, keys, bt, tr, nv, entries)
        prod = partial(S.indexer_scores, q, w, keys, bt, tr, nv, entries, "triton")
        timer = None if args.smoke else GraphTimer(n=20, flush=True)
        cases = [("production", prod, S.launch_config(B, heads, entries, dev))]
        for launch in args.launches:
            if launch == "default":
                cfg = S.launch_config(B, heads, entries, dev)
            else:
                bn, nw, ns, tiles = (int(x) for x in launch.split(","))
                cfg = S.launch_config(B, heads, entries, dev, bn, tiles, nw, ns)
            for name in args.variants:
                out = torch.empty((B, entries), dtype=torch.float32, device=dev)
                cases.append((name, study_fn(VARIANTS[name], q, w, keys, bt, tr, nv, entries, cfg, out), cfg))
        for name, fn, cfg in cases:
            got = fn()
            if name in ("production", "full", "pair"):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            t = None if timer is None else timer(fn)
            flags = dict(zip(FLAG_NAMES, VARIANTS.get(name, (1, 1, 1, 1, 0, 0)), strict=True))
            row = {"name": f"indexer_study_{name}", **info, "shape": {"B": B, "entries": entries, "heads": heads},
                   "flags": flags, "time_s": t, "launch": cfg._asdict()}  # fmt: skip
            rows.append(row)
            la = f"{cfg.block_n},{cfg.num_warps},{cfg.num_stages},{cfg.tiles}"
            print(f"B={B} {la:12s} {name:18s} {'-' if t is None else f'{t * 1e6:8.1f} us'}", flush=True)
    if args.out:
        write_jsonl(rows, args.out, append=True)


if __name__ == "__main__":
    main()
