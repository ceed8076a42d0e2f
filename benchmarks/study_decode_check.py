"""Why a ``dsv4 bench`` decode-step check fails: the step's parts against the plain step's, row by row.

Rebuilds ``dsv4 bench``'s cache and inputs for one (model, kind, context) exactly as the bench does (same
seed, same batch order), runs the dsv4 step and the plain PyTorch step, and for each row that misses the
check's tolerance reports where the two part ways:

- indexer scores: dsv4's kernel vs the plain fp32 einsum (max |diff| relative to the row's max |score|);
- top-k: how many selected indices differ, and the plain scores of the entries only one side picked,
  next to the plain k-th score (a near-tie at the boundary or a real mis-selection);
- the dsv4 top-k kernel on the plain scores (isolates the top-k from the scores).

Usage (GPU): python3 benchmarks/study_decode_check.py --context 1048576 --batches 1,4,64
"""

from __future__ import annotations

import argparse

import torch

from dsv4.engine import bench as B
from dsv4.engine.graphs import DecodeGraphRunner
from dsv4.kernels.indexer import indexer_scores, topk_indices
from dsv4.model.projections import indexer_query, query


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="v4-flash")
    ap.add_argument("--kind", default="csa")
    ap.add_argument("--context", type=int, default=1048576)
    ap.add_argument("--batches", default="1,4,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    batches = sorted(int(b) for b in a.batches.split(","))
    dev = torch.device(a.device)
    s = B.BenchSettings(models=(a.model,), kinds=(a.kind,), contexts=(a.context,), batches=tuple(batches), seed=a.seed)
    cfg = B.bench_config(a.model, a.kind, a.context)
    gen = torch.Generator(device=dev).manual_seed(s.seed)
    w = B.random_attention_weights(cfg, 0, seed=s.seed, device=dev)
    blk = B.AttentionSubBlock(cfg, 0, w, backend=s.backend)
    schema = B.CacheSchema(cfg)
    b_max = max(batches)
    per_req = {m_: rc.pages_for_tokens(a.context) for m_, rc in schema.ratio_classes.items()}
    pages = {m_: (n + 1) * b_max + 4 for m_, n in per_req.items()}
    m = B.KVCacheManager(cfg, max_requests=b_max + 2, num_pages=pages or 1, device=dev)
    B.fill_cache(m, b_max, a.context, gen, s.backend)
    max_blocks = {m_: rc.pages_for_tokens(a.context) for m_, rc in schema.ratio_classes.items()} or None
    for bsz in batches:
        x = torch.randn(bsz, cfg.dim, generator=gen, device=dev).to(torch.bfloat16)
        sched = {r: 1 for r in range(bsz)}
        eager = DecodeGraphRunner(m, [blk], buckets=(bsz,), max_blocks=max_blocks, capture=False,
                                  forward=B._single_layer)  # fmt: skip
        eager.capture()
        plan, _ = eager.prepare(sched)
        m.cancel(plan)
        eager.static_input(bsz).copy_(x)
        y = eager.replay(bsz).clone()
        sp = eager._buckets[bsz].plan
        slots, pos = sp.request_slots.long(), sp.positions.long()
        bt = sp.ratios[blk.ratio].block_table.long()
        aux: dict = {}
        yb = B.plain_decode_step(blk, m, slots, pos, bt, x, aux=aux)
        d = (yb.float() - y.float()).abs()
        bad = ((d.amax(1) > B.MATCH_MAX_ABS) | (d.mean(1) > B.MATCH_MEAN_ABS)).nonzero().flatten().tolist()
        print(f"B={bsz}: rows failing the check {bad} (max {d.max().item():.3g}, mean {d.mean().item():.3g});"
              f" positions {pos.tolist()[:4]}..., slots {slots.tolist()[:8]}...")  # fmt: skip
        handle = eager._buckets[bsz].handles[0]
        parts = B._parts(blk, handle, eager.static_input(bsz))
        ks = parts["indexer"]().float()
        kidx = parts["topk"]().long()
        ps, pidx = aux["scores"], aux["topk"]
        rp = handle.ratio_plan
        kidx_on_plain = topk_indices(ps.contiguous(), cfg.index_topk, rp.n_visible).long()
        nvis = rp.n_visible.long()
        # the query side: the fused kernel (backend auto) against the composed model functions
        xs, hp, inv = eager.static_input(bsz), sp.positions[:, None], blk.inv_freq
        _, qr = query(cfg, blk.w, xs, hp, inv, blk.backend)
        q_k, w_k = indexer_query(cfg, blk.w, xs, qr, hp, inv, blk.backend)
        q_t, w_t = indexer_query(cfg, blk.w, xs, qr, hp, inv, "torch")
        iv = handle.read_indexer_view()
        s_qt = indexer_scores(q_t, w_t.float(), iv.pages, rp.block_table, sp.request_ids, rp.n_visible,
                              rp.max_entries, backend=blk.backend).float()  # fmt: skip
        s_tk = indexer_scores(q_k, w_k.float(), iv.pages, rp.block_table, sp.request_ids, rp.n_visible,
                              rp.max_entries, backend="torch").float()  # fmt: skip
        for r in sorted(set(bad) | {0, bsz - 1}):
            n = int(nvis[r])
            row_k, row_p = ks[r, :n], ps[r, :n]
            scale = row_p.abs().max().item()
            sd = (row_k - row_p).abs().max().item() / scale
            sk = set(kidx[r][kidx[r] >= 0].tolist())
            sp_ = set(pidx[r].tolist())
            sk2 = set(kidx_on_plain[r][kidx_on_plain[r] >= 0].tolist())
            kth = torch.sort(row_p, descending=True).values[cfg.index_topk - 1 : cfg.index_topk + 1].tolist()
            only_k, only_p = sorted(sk - sp_), sorted(sp_ - sk)
            print(f"  row {r}: n_vis {n}, y max {d[r].max().item():.3g} mean {d[r].mean().item():.3g};"
                  f" scores rel diff {sd:.2e}; |sel| {len(sk)}/{len(sp_)}, only dsv4 {len(only_k)}, only plain"
                  f" {len(only_p)}; dsv4 top-k on plain scores vs torch.topk: {len(sk2 ^ sp_)} differ")  # fmt: skip
            print(f"    plain k-th, (k+1)-th scores {kth}; only-dsv4 plain scores"
                  f" {[round(row_p[i].item(), 6) for i in only_k[:6]]} idx {only_k[:6]};"
                  f" only-plain {[round(row_p[i].item(), 6) for i in only_p[:6]]} idx {only_p[:6]}")  # fmt: skip
            qd = (q_k[r].float() != q_t[r].float()).unflatten(-1, (-1, 32))  # [Hi, Di/32, 32]
            blocks = qd.any(-1).nonzero().tolist()
            print(f"    q_idx kernel vs torch: {int(qd.sum())} values differ in (head, block) {blocks[:8]};"
                  f" weights differ {int((w_k[r].float() != w_t[r].float()).sum())}")  # fmt: skip
            for h, b in blocks[:3]:
                sl = slice(32 * b, 32 * b + 32)
                print(f"      head {h} block {b}: kernel {q_k[r, h, sl].float().tolist()[:8]} torch"
                      f" {q_t[r, h, sl].float().tolist()[:8]} ...")  # fmt: skip
            qp = aux["q_idx"][r].float()
            qpd = (qp != q_t[r].float()).unflatten(-1, (-1, 32))
            print(f"    plain q_idx vs torch-backend q_idx: {int(qpd.sum())} values differ in (head, block)"
                  f" {qpd.any(-1).nonzero().tolist()[:8]}; weights differ"
                  f" {int((aux['weights'][r].float() != w_t[r].float()).sum())}; qr differ"
                  f" {int((aux['qr'][r] != qr[r]).sum())} of {qr[r].numel()}")  # fmt: skip
            j = torch.arange(n, device=dev)
            bs = iv.pages.data.shape[1]
            pg = rp.block_table[sp.request_ids[r].long(), j // bs].long().clamp(min=0)
            kd = m.schema.key_fmt.dequantize(iv.pages.data[pg, j % bs], iv.pages.scale[pg, j % bs])
            s_pf = (torch.einsum("hd,nd->hn", q_t[r].float(), kd).relu() * w_t[r].float()[:, None]).sum(0)
            print(f"    plain's formula on torch q vs plain {((s_pf - row_p).abs().max() / scale).item():.2e},"
                  f" vs kernel {((s_pf - row_k).abs().max() / scale).item():.2e}")  # fmt: skip
            print(
                f"    scores rel diff: kernel on torch q {((s_qt[r, :n] - row_p).abs().max() / scale).item():.2e};"
                f" torch scores on kernel q vs kernel {((s_tk[r, :n] - row_k).abs().max() / scale).item():.2e}"
            )
            if only_k:
                print(f"    dsv4 scores of those: {[round(row_k[i].item(), 6) for i in only_k[:6]]}"
                      f" / {[round(row_k[i].item(), 6) for i in only_p[:6]]}")  # fmt: skip
        del eager


if __name__ == "__main__":
    main()
