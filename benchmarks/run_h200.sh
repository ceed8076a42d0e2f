#!/usr/bin/env bash
# One H200 session: environment, GPU tests, then the kernel benchmarks. Results go to $OUT (or ./out).
# Usage (on the device machine, repo root): bash benchmarks/run_h200.sh [tests|bench|all|pending|ncu|attention|attention_ncu|indexer_gluon|indexer_live|indexer_fold|pending_s12|topk_rows|indexer_default|indexer_p2|indexer_ablate|flush_topk|skeleton|topk_short|fold_auto|hca_online|write_s15|emit_s15|emit2_s15|main_s15|write2_s15|final_s15|gemv_s15|online_regs|write_s16|final_s16|ncu_pool|div_s16|lean_s17|fast_s17|emit_s17|emit2_s17|warps_s17|ipool_s17|final_s17|sweep_s18|overlap_s18|fuse_s19|pdl_s19|pdl_decode_s19|writes_s19|layer_s19|select_s19|grid_s20|tails_s20|linear_s20|layer_s20|topk_s20|validate_s20|prefill_idx_s21|tf32x2_s21|topk_s21|iquery_s21|fp8_linear_s22|fp8_step_s22|hsum_s22|check_s23|step_s23|fp8lin_s23|s25|s25b|s26a|s26b|s27a|s27b|s27c|s27d|s28a|s28b|s28c|s28d|s29a|s29b|s29c|s29d|s29e|s29f|s29g]
# "pending": the norm and top-k GPU tests (~4 min, most of it compiling the top-k kernels), launch D's rank
# threshold on/off, top-k with both flush kinds, the decode step; about 8 minutes.  "ncu": Nsight Compute
# sections of the indexer scores, dense attention and gather kernels (benchmarks/ncu_cases.py).  "attention": the
# attention GPU tests (Triton and Gluon kernels, model cached-vs-dense), per-kernel device times and the benchmark;
# about 3 minutes.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
what=${1:-all}
stamp=$(date -u +%Y-%m-%d)
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  # the whole GPU suite takes ~4-5 min on the H200 (2026-12-02: 230 s covered 56 of 72 tests)
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -k "cuda" tests/kernels tests/cache 2>&1 | tee "$OUT/cuda_param_tests.txt" | tail -15
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in write attention indexer; do
    timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_$b.py --out "$OUT/${stamp}_h200_$b.jsonl" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_$b.txt" | tail -40
  done
  timeout 80 python3 benchmarks/profile_write.py 2>&1 | tee "$OUT/profile_write.txt" | tail -30
fi
if [ "$what" = ncu ]; then
  # Nsight Compute on one call of each heavy read-path kernel (benchmarks/ncu_cases.py)
  secs="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis"
  for c in "indexer:_mxfp4_scores" "attention:_dense_attn_fwd" "attention:_gather_dequant"; do
    timeout 150 ncu -k "regex:${c#*:}" --launch-skip 2 --launch-count 1 $secs python3 benchmarks/ncu_cases.py "${c%%:*}" \
      2>&1 | grep -v "^==PROF==" | tee "$OUT/${stamp}_h200_ncu_${c#*:}.txt" | grep -E "Duration|Throughput|Occupancy|Registers|Stall|Issued" | head -20
  done
fi
if [ "$what" = pending ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests/kernels/test_norm.py tests/kernels/test_topk.py \
    2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_pending.txt" | tail -5
  { python3 benchmarks/profile_topk.py --rows 4 --methods filter --rank-slots 0 64
    python3 benchmarks/profile_topk.py --rows 64 --n 32768 --k 512 --methods filter --rank-slots 0 64; } \
    2>&1 | grep -v -i "usdt\|warn" | tee "$OUT/${stamp}_h200_profile_topk_rank.txt"
  timeout 150 python3 benchmarks/bench_indexer.py --only topk --no-compile --out "$OUT/${stamp}_h200_topk.jsonl" \
    2>&1 | tee "$OUT/${stamp}_h200_topk.txt" | tail -30
  timeout 200 python3 -m dsv4.cli bench --models v4-flash --kinds csa,hca --contexts 131072 --batches 1,8,64 \
    --out "$OUT/${stamp}_h200_decode.jsonl" 2>&1 | tail -20
fi
if [ "$what" = attention_ncu ]; then  # where the fused Gluon attention kernel's warps wait (~1 min)
  timeout 200 /usr/local/cuda/bin/ncu -k regex:_sparse_attn_ws_kernel --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --import-source no --page source --print-source sass --csv \
    python3 benchmarks/ncu_cases.py attention:gluon_fused > "$OUT/ncu_source_gluon_fused.csv" 2> "$OUT/ncu_err.txt"
  python3 benchmarks/ncu_source_summary.py "$OUT/ncu_source_gluon_fused.csv" --top 40 \
    | tee "$OUT/${stamp}_h200_ncu_source_gluon_fused.txt" | head -30
  gzip -f "$OUT/ncu_source_gluon_fused.csv"
fi
if [ "$what" = indexer_gluon ]; then  # the Gluon scores kernel: GPU tests, sweep vs fp8mma, Nsight source counters
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gluon_indexer_scores.py 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_gluon_indexer.txt" | tail -15
  timeout 240 python3 benchmarks/sweep_indexer.py --batches 4 64 --entries 262144 --variants fp4_fp8mma gluon_ws \
    --launches 128,4,2 --tiles 8 16 32 --out "$OUT/${stamp}_h200_sweep_indexer_gluon.jsonl" 2>&1 | tail -20
  timeout 200 /usr/local/cuda/bin/ncu -k regex:_mxfp4_scores_ws_kernel --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight --import-source no --page source \
    --print-source sass --csv python3 benchmarks/ncu_cases.py indexer:gluon_ws > "$OUT/ncu_source_gluon_indexer.csv" \
    2> "$OUT/ncu_err.txt"
  python3 benchmarks/ncu_source_summary.py "$OUT/ncu_source_gluon_indexer.csv" --top 40 \
    | tee "$OUT/${stamp}_h200_ncu_source_gluon_indexer.txt" | head -30
  gzip -f "$OUT/ncu_source_gluon_indexer.csv"
fi
if [ "$what" = indexer_live ]; then  # Gluon kernel skipping tiles past n_visible: tests, study at full / 1/8 rows, CSA decode step with wide block tables, GLUON_AUTO off / on (~7 min)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gluon_indexer_scores.py 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_gluon_indexer.txt" | tail -4
  for v in 1 8; do
    timeout 90 python3 benchmarks/study_gluon_indexer.py --quick --visible $v --batches 1 4 8 64 \
      --out "$OUT/${stamp}_h200_study_gluon_indexer_visible$v.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_study_gluon_indexer_visible$v.txt"
  done
  for auto in False True; do
    timeout 100 python3 -c "import sys, dsv4.kernels.indexer.scores as s; s.GLUON_AUTO = $auto; from dsv4.cli import main; sys.exit(main(sys.argv[1:]))" \
      bench --models v4-flash --kinds csa --contexts 131072 --batches 1,8,64 --table-context 1048576 \
      --out "$OUT/${stamp}_h200_decode_table1M_gluon$auto.jsonl" 2>&1 | tail -5
  done
  timeout 100 python3 -c "import sys, dsv4.kernels.indexer.scores as s; s.GLUON_AUTO = True; from dsv4.cli import main; sys.exit(main(sys.argv[1:]))" \
    bench --models v4-flash --kinds csa --contexts 131072 --batches 1,8,64 --out "$OUT/${stamp}_h200_decode_gluonTrue.jsonl" 2>&1 | tail -5
fi
if [ "$what" = indexer_fold ]; then  # the Gluon indexer's fold variant (not yet run): GPU tests, study at full / 1/8 rows (~4 min)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gluon_indexer_scores.py 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_gluon_fold.txt" | tail -4
  for v in 1 8; do
    timeout 120 python3 benchmarks/study_gluon_indexer.py --quick --fold --visible $v --batches 1 4 8 64 \
      --out "$OUT/${stamp}_h200_study_gluon_fold_visible$v.jsonl" 2>&1 | tail -12
  done
fi
if [ "$what" = indexer_p2 ]; then  # two producer warpgroups (alternate tiles): Gluon GPU tests, study exact / fold x 1 / 2 (~4 min)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_gluon_indexer_scores.py 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_gluon_p2.txt" | tail -4
  for v in 1 8; do
    timeout 150 python3 benchmarks/study_gluon_indexer.py --quick --fold --producers 1 2 --visible $v --batches 1 4 8 64 \
      --out "$OUT/${stamp}_h200_study_gluon_p2_visible$v.jsonl" 2>&1 | tail -20
  done
fi
if [ "$what" = indexer_ablate ]; then  # GPU tests (indexer, model, engine); which partition bounds the Gluon kernel (ablations); decode step (~6 min)
  timeout 270 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_indexer_scores.py \
    tests/kernels/test_gluon_indexer_scores.py tests/model tests/engine 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_indexer.txt" | tail -4
  timeout 200 python3 benchmarks/study_gluon_indexer.py --quick --fold --producers 2 --ablate 0 1 2 4 6 7 \
    --batches 4 64 --out "$OUT/${stamp}_h200_study_gluon_ablate.jsonl" 2>&1 | tail -30
  for t in 131072 1048576; do
    timeout 100 python3 -m dsv4.cli bench --models v4-flash --kinds csa --contexts 131072 --batches 1,8,64 \
      --table-context $t --out "$OUT/${stamp}_h200_decode_table$t.jsonl" 2>&1 | tail -4
  done
fi
if [ "$what" = flush_topk ]; then  # the Gluon indexer under each L2 flush kind; top-k GPU tests (many rows); decode step (~6 min)
  for fl in write read none; do
    timeout 150 python3 benchmarks/study_gluon_indexer.py --quick --fold --ablate 0 7 --flush $fl --batches 1 4 8 64 \
      --out "$OUT/${stamp}_h200_study_gluon_flush_$fl.jsonl" 2>&1 | grep -v "ablate=7" | tail -12
  done
  for t in 131072 1048576; do
    timeout 100 python3 -m dsv4.cli bench --models v4-flash --kinds csa --contexts 131072 --batches 1,8,64 \
      --table-context $t --out "$OUT/${stamp}_h200_decode_table$t.jsonl" 2>&1 | tail -4
  done
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_topk.py -k "filter_real_shapes or many_rows" \
    2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_topk_many_rows.txt" | tail -3
fi
if [ "$what" = skeleton ]; then  # the Gluon indexer's load-and-handoff skeleton (ablate = 7, fold): raw ring depth x tiles a program, B = 4, clean L2 (~3 min)
  timeout 280 python3 benchmarks/study_gluon_indexer.py --quick --fold --ablate 0 7 --flush read --configs 4,4 4,8 4,16 \
    --batches 4 --entries 65536 131072 262144 524288 --out "$OUT/${stamp}_h200_study_gluon_skeleton.jsonl" 2>&1 | grep "fold=1" | tail -40
fi
if [ "$what" = topk_short ]; then  # top-k GPU tests (filter shapes, many rows); decode step with 1M-token tables (~5 min)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_topk.py -k "filter_real_shapes or many_rows" \
    2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_topk_short.txt" | tail -3
  timeout 100 python3 -m dsv4.cli bench --models v4-flash --kinds csa --contexts 131072 --batches 1,8,64 \
    --table-context 1048576 --out "$OUT/${stamp}_h200_decode_table1048576_short.jsonl" 2>&1 | tail -4
fi
if [ "$what" = fold_auto ]; then  # the decode step (real shapes, with its check) with auto taking the fold variant, then as shipped (~3 min)
  for fold in True False; do
    timeout 120 python3 -c "import sys; import dsv4.kernels.indexer.scores as s; s.GLUON_AUTO_FOLD = $fold; \
from dsv4.cli import main; sys.exit(main(sys.argv[1:]))" bench --models v4-flash --kinds csa --contexts 131072,1048576 \
      --batches 1,4,64 --out "$OUT/${stamp}_h200_decode_fold$fold.jsonl" 2>&1 | tail -7
  done
fi
if [ "$what" = hca_online ]; then  # what session 14 left unrun: compressor GPU tests after the online-state helper refactor
  # and save / load on CUDA,
  # the online HCA prefill (its split_pool variant was measured here, then removed), the HCA decode step (~4 min)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor_online.py tests/kernels/test_compressor.py \
    tests/model/test_attention.py tests/cache/test_snapshot.py -k "cuda or gpu or cancelled" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_compressor.txt" | tail -3
  timeout 150 python3 benchmarks/bench_write.py --ops hca,hca_online --models v4-flash --modes prefill \
    --out "$OUT/${stamp}_h200_write_hca_split.jsonl" 2>&1 \
    | tee "$OUT/${stamp}_h200_write_hca_split.txt" | grep hca | cut -c1-220
  timeout 120 python3 -m dsv4.cli bench --models v4-flash --kinds hca --contexts 131072 --batches 1,8,64 \
    --out "$OUT/${stamp}_h200_decode_hca.jsonl" 2>&1 | tail -4
fi
if [ "$what" = write_s15 ]; then  # every write op, both models, decode and prefill (the V4-Pro rows were last measured in
  # session 1); then where the CSA indexer's emit kernel spends its time (Nsight source counters) (~8 min)
  timeout 330 python3 benchmarks/bench_write.py --out "$OUT/${stamp}_h200_write_s15.jsonl" 2>&1 \
    | tee "$OUT/${stamp}_h200_write_s15.txt" | grep -E "decode|prefill" | cut -c1-200
  timeout 100 python3 benchmarks/profile_write.py --ops csa_indexer,hca_online 2>&1 | grep -v -i warn \
    | tee "$OUT/${stamp}_h200_profile_write_s15.txt" | tail -24
  timeout 150 /usr/local/cuda/bin/ncu -k regex:_emit_indexer_dot_kernel --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight --section Occupancy --import-source no \
    --page source --print-source sass --csv python3 benchmarks/ncu_cases.py write:csa_indexer:prefill:65536 \
    > "$OUT/ncu_source_emit.csv" 2> "$OUT/ncu_err.txt"
  python3 benchmarks/ncu_source_summary.py "$OUT/ncu_source_emit.csv" --top 40 \
    | tee "$OUT/${stamp}_h200_ncu_source_emit_s15.txt" | head -45
  gzip -f "$OUT/ncu_source_emit.csv"
fi
if [ "$what" = emit_s15 ]; then  # the cheaper e2m1 code and the int32 compaction of the MMA emit: GPU tests of the
  # kernels that quantise to e2m1, CSA indexer prefill with emit geometries, per-kernel times, CSA decode step (~6 min)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_quant.py tests/kernels/test_compressor.py \
    tests/kernels/test_store.py tests/kernels/test_indexer_query.py -k "cuda or gpu" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_emit_s15.txt" | tail -3
  timeout 200 python3 benchmarks/bench_write.py --ops csa_indexer --models v4-flash --modes prefill --tune csa_indexer: \
    --tune csa_indexer:emit_block_t=64 --tune csa_indexer:emit_block_t=256 --tune csa_indexer:emit_rows=32 \
    --tune csa_indexer:emit_dot=1,emit_block_t=32 --tune csa_indexer:emit_dot=1,emit_block_t=64 \
    --tune csa_indexer:write_block_t=128 --out "$OUT/${stamp}_h200_write_emit_s15.jsonl" 2>&1 \
    | tee "$OUT/${stamp}_h200_write_emit_s15.txt" | grep prefill | cut -c1-250
  timeout 100 python3 benchmarks/profile_write.py --ops csa_indexer 2>&1 | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_write_emit_s15.txt" | tail -16
  timeout 150 python3 -m dsv4.cli bench --models v4-flash --kinds csa --contexts 131072 --batches 1,8,64 \
    --out "$OUT/${stamp}_h200_decode_csa_s15.jsonl" 2>&1 | tail -4
fi
if [ "$what" = emit2_s15 ]; then  # the MMA emit with its compaction through a scratch scatter (80 registers): GPU
  # tests, CSA indexer prefill with emit geometries (both models), per-kernel times (~5 min)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_quant.py tests/kernels/test_compressor.py \
    tests/kernels/test_compressor_online.py tests/kernels/test_indexer_query.py -k "cuda or gpu" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_emit_s15.txt" | tail -3
  timeout 240 python3 benchmarks/bench_write.py --ops csa_indexer --modes prefill --tune csa_indexer: \
    --tune csa_indexer:emit_dot=1,emit_rows=32 --tune csa_indexer:emit_dot=1,emit_block_t=256 \
    --tune csa_indexer:emit_dot=1,emit_block_t=64 --tune csa_indexer:emit_dot=1,emit_block_t=32 \
    --tune csa_indexer:emit_dot=1,emit_block_t=16 --tune csa_indexer:write_block_t=128 \
    --out "$OUT/${stamp}_h200_write_emit_s15.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_emit_s15.txt" | grep prefill | cut -c1-250
  timeout 100 python3 benchmarks/profile_write.py --ops csa_indexer 2>&1 | grep -v -i warn \
    | tee "$OUT/${stamp}_h200_profile_write_emit_s15.txt" | tail -10
fi
if [ "$what" = main_s15 ]; then  # CSA main prefill (195 us in write_s15, 177 in session 3): per kernel, pool geometries;
  # the CSA indexer's auto emit at 8,192 tokens (~3 min)
  timeout 120 python3 benchmarks/profile_write.py --ops csa_main,csa_indexer 2>&1 | grep -v -i warn \
    | tee "$OUT/${stamp}_h200_profile_write_main_s15.txt" | tail -12
  timeout 200 python3 benchmarks/bench_write.py --ops csa_main,csa_indexer --models v4-flash --modes prefill --tune csa_main: \
    --tune csa_main:pool_block_t=8 --tune csa_main:num_warps=2 --tune csa_main:write_block_t=64 --tune csa_indexer: \
    --out "$OUT/${stamp}_h200_write_main_s15.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_main_s15.txt" | grep prefill | cut -c1-250
fi
if [ "$what" = write2_s15 ]; then  # CSA pools at 2 warps, the state write with four loads in flight: GPU tests, every
  # prefill write op (V4-Flash; V4-Pro's widths give the same figures), per-kernel times (~4 min)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py tests/kernels/test_compressor_online.py \
    -k "cuda or gpu" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_write2_s15.txt" | tail -3
  timeout 200 python3 benchmarks/bench_write.py --models v4-flash --modes prefill --tune store_window: --tune csa_main: \
    --tune csa_main:pool_block_t=8 --tune csa_indexer: --tune hca: --tune hca_online: \
    --out "$OUT/${stamp}_h200_write_prefill_s15.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_prefill_s15.txt" | grep prefill | cut -c1-250
  timeout 120 python3 benchmarks/profile_write.py --ops csa_main,csa_indexer,hca,hca_online 2>&1 | grep -v -i warn \
    | tee "$OUT/${stamp}_h200_profile_write_prefill_s15.txt" | tail -22
fi
if [ "$what" = final_s15 ]; then  # CSA main's pool at 8 tokens a program by default; the CSA indexer's pool at 8; the
  # backend tests of the model sub-block on CUDA (~3 min)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py tests/model/test_attention.py \
    -k "cuda or gpu or padded or cancelled" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_final_s15.txt" | tail -3
  timeout 150 python3 benchmarks/bench_write.py --models v4-flash,v4-pro --ops csa_main,csa_indexer --modes prefill \
    --tune csa_main: --tune csa_indexer: --tune csa_indexer:pool_block_t=8 \
    --out "$OUT/${stamp}_h200_write_final_s15.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_final_s15.txt" | grep prefill | cut -c1-250
fi
if [ "$what" = gemv_s15 ]; then  # the few-token compressor projection kernel: GPU tests, bench_linear at 1 and 4
  # tokens (with the tensor-core kernel in the same rows), the decode step at B = 1 (~3.5 min)
  timeout 70 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_linear.py -k "gemv or fused_split_sum" \
    2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_gemv_s15.txt" | tail -3
  timeout 60 python3 benchmarks/bench_linear.py --tokens 1,4 --out "$OUT/${stamp}_h200_linear_gemv_s15.jsonl" 2>&1 \
    | tee "$OUT/${stamp}_h200_linear_gemv_s15.txt" | grep linear | cut -c1-160
  timeout 80 python3 -m dsv4.cli bench --models v4-flash --kinds csa,hca --contexts 131072 --batches 1 \
    --out "$OUT/${stamp}_h200_decode_gemv_s15.jsonl" 2>&1 | tail -3
fi
if [ "$what" = online_regs ]; then  # left unrun in session 15 (no device time): the online HCA pool / state-write
  # kernels at 128 registers (were 154 / 168): online compressor GPU tests, HCA prefill both layouts, per kernel (~3 min)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor_online.py tests/kernels/test_compressor.py \
    tests/model/test_attention.py -k "cuda or gpu or cancelled or padded" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_online_regs.txt" | tail -3
  timeout 150 python3 benchmarks/bench_write.py --ops hca,hca_online --models v4-flash --out "$OUT/${stamp}_h200_write_online_regs.jsonl" \
    2>&1 | tee "$OUT/${stamp}_h200_write_online_regs.txt" | grep hca | cut -c1-220
  timeout 80 python3 benchmarks/profile_write.py --ops hca_online 2>&1 | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_online_regs.txt" | tail -8
fi
if [ "$what" = write_s16 ]; then  # the lanes state-write kernel (write_lanes=16 / 32) vs the one-program-a-block kernel,
  # and the online state write with the run start from registers: per-kernel device time at 65,536 tokens, prefill
  # rows (graph time), compressor GPU tests (~6 min)
  tn=""; for op in hca csa_main csa_indexer; do tn="$tn --tune $op: --tune $op:write_lanes=16 --tune $op:write_lanes=32"; done
  timeout 150 python3 benchmarks/profile_write.py --modes prefill --ops hca,hca_online,csa_main,csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_write_s16.txt" | grep -E "==|write"
  tn=""; for op in hca csa_main csa_indexer; do tn="$tn --tune $op: --tune $op:write_lanes=16"; done
  timeout 200 python3 benchmarks/bench_write.py --modes prefill --ops csa_main,csa_indexer,hca,hca_online --models v4-flash \
    $tn --out "$OUT/${stamp}_h200_write_s16.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_s16.txt" | grep prefill | cut -c1-200
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor_online.py tests/kernels/test_compressor.py \
    -k "cuda or gpu" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_write_s16.txt" | tail -3
fi
if [ "$what" = final_s16 ]; then  # the lanes state write as the default (c*d >= 512): compressor / online / model
  # GPU tests, the prefill write rows of the changed ops (~6 min)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py tests/kernels/test_compressor_online.py \
    -k "cuda or gpu" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_final_s16.txt" | tail -2
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/model -k "cuda or gpu or padded or cancelled" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_model_final_s16.txt" | tail -2
  timeout 120 python3 benchmarks/bench_write.py --models v4-flash --ops csa_main,hca,hca_online --modes prefill \
    --out "$OUT/${stamp}_h200_write_final_s16.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_final_s16.txt" | grep prefill | cut -c1-200
fi
if [ "$what" = ncu_pool ]; then  # Nsight Compute on the HCA pool kernel (prefill 65,536, reference layout): why 78 % (~2 min)
  secs="--section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats"
  timeout 200 ncu -k regex:_compressor_pool_kernel --launch-skip 2 --launch-count 1 $secs python3 benchmarks/ncu_cases.py \
    write:hca:prefill:65536 2>&1 | grep -v "^==PROF==" | tee "$OUT/${stamp}_h200_ncu_hca_pool_s16.txt" \
    | grep -E "Duration|Throughput|Occupancy|Registers|Stall|Issued|Busy|Hit|Achieved|Block Limit|Waves" | head -40
fi
if [ "$what" = div_s16 ]; then  # the pool's division once a channel vs once a row (pool_div_after): per-kernel device
  # time of the compressor prefills at 65,536 tokens, then the compressor GPU tests (~3 min)
  tn=""; for op in hca hca_online csa_main csa_indexer; do tn="$tn --tune $op:pool_div_after=0 --tune $op:pool_div_after=1"; done
  timeout 90 python3 benchmarks/profile_write.py --modes prefill --ops hca,hca_online,csa_main,csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_div_s16.txt" | grep -E "==|pool"
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py -k "cuda or gpu" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_div_s16.txt" | tail -2
fi
if [ "$what" = lean_s17 ]; then  # left for session 17 (no device time): the pool's FAST_ROWS / FAST_EXP instruction cuts
  # (off by default), per-kernel device time at 65,536 tokens, the prefill rows' graph time with the session-16 defaults
  # (the division once a channel was measured in device time only), compressor GPU tests (~6 min)
  tn=""; for op in hca hca_online csa_main csa_indexer; do
    tn="$tn --tune $op: --tune $op:pool_fast_rows=1 --tune $op:pool_fast_exp=1 --tune $op:pool_fast_rows=1,pool_fast_exp=1"; done
  # the online state write (7.9 us, one latency-bound program a channel block): more warps, bigger token blocks
  tn="$tn --tune hca_online:write_warps=8 --tune hca_online:write_warps=8,write_block_t=2048"
  timeout 150 python3 benchmarks/profile_write.py --modes prefill --ops hca,hca_online,csa_main,csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_lean_s17.txt" | grep -E "==|pool"
  timeout 150 python3 benchmarks/bench_write.py --models v4-flash --ops csa_main,csa_indexer,hca,hca_online --modes prefill \
    --out "$OUT/${stamp}_h200_write_lean_s17.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_lean_s17.txt" | grep prefill | cut -c1-200
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py tests/kernels/test_compressor_online.py \
    -k "cuda or gpu" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_lean_s17.txt" | tail -2
  # the decode step after session 16's changes to the shared pool / online-state code (the decode kernels use them)
  timeout 120 python3 -m dsv4.cli bench --models v4-flash --kinds csa,hca --contexts 131072 --batches 1,64 \
    --out "$OUT/${stamp}_h200_decode_s17.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_decode_s17.txt" | tail -6
  # where 8,192-token prefills lose (25-60 % of roofline): per-kernel device times at that size
  timeout 60 python3 benchmarks/profile_write.py --modes prefill --tokens 8192 --ops store_window,csa_main,csa_indexer,hca,hca_online 2>&1 | grep -v -i warn \
    | tee "$OUT/${stamp}_h200_profile_8192_s17.txt" | tail -24
fi
if [ "$what" = pending_s12 ]; then  # what session 12 left unrun: the top-k GPU tests under the many-rows rule, then indexer_fold (~8 min)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_topk.py -k "filter_real_shapes or many_rows" \
    2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_topk_many_rows.txt" | tail -3
  bash "$0" indexer_fold
fi
if [ "$what" = topk_rows ]; then  # top-k GPU tests and bench_indexer's top-k (with rows seeing 1/8 of the columns) (~6 min)
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_topk.py 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_topk.txt" | tail -3
  timeout 240 python3 benchmarks/bench_indexer.py --only topk --no-compile --out "$OUT/${stamp}_h200_topk.jsonl" \
    2>&1 | tee "$OUT/${stamp}_h200_topk.txt" | grep -E "graph" | tail -40
fi
if [ "$what" = indexer_default ]; then  # indexer GPU tests (model, engine too), CSA decode step (block tables for the context and for 1M tokens), bench_indexer scores (~6 min)
  timeout 270 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_indexer_scores.py \
    tests/kernels/test_gluon_indexer_scores.py tests/model tests/engine 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_indexer.txt" | tail -4
  timeout 100 python3 -m dsv4.cli bench --models v4-flash --kinds csa --contexts 131072 --batches 1,8,64 \
    --out "$OUT/${stamp}_h200_decode.jsonl" 2>&1 | tail -4
  timeout 100 python3 -m dsv4.cli bench --models v4-flash --kinds csa --contexts 131072 --batches 1,8,64 \
    --table-context 1048576 --out "$OUT/${stamp}_h200_decode_table1M.jsonl" 2>&1 | tail -4
  timeout 120 python3 benchmarks/bench_indexer.py --only scores --no-compile --out "$OUT/${stamp}_h200_indexer.jsonl" \
    2>&1 | tee "$OUT/${stamp}_h200_indexer.txt" | grep -E "ctx=1048576|B=4|indexer" | tail -24
fi
if [ "$what" = attention ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_sparse_attention.py \
    tests/kernels/test_gluon_dense_attention.py tests/kernels/test_gluon_fused_attention.py tests/model 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_attention.txt" | tail -3
  for m in v4-pro v4-flash; do timeout 100 python3 benchmarks/profile_attention.py --model $m; done \
    2>&1 | grep -v -i "usdt\|warn" | tee "$OUT/${stamp}_h200_profile_attention.txt"
  timeout 200 python3 benchmarks/bench_attention.py --no-compile --out "$OUT/${stamp}_h200_attention.jsonl" \
    > "$OUT/${stamp}_h200_attention.txt" 2>&1; tail -14 "$OUT/${stamp}_h200_attention.txt"
fi
if [ "$what" = fast_s17 ]; then  # the pool's FAST_ROWS / FAST_EXP defaults (_pool_fast_defaults): per-kernel device time
  # and graph time of the compressor prefills, the compressor GPU tests, then Nsight on the indexer emit (~5 min)
  timeout 90 python3 benchmarks/profile_write.py --modes prefill --ops hca,hca_online,csa_main,csa_indexer 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_fast_s17.txt" | grep -E "==|pool"
  timeout 150 python3 benchmarks/bench_write.py --models v4-flash --ops csa_main,csa_indexer,hca,hca_online --modes prefill \
    --out "$OUT/${stamp}_h200_write_fast_s17.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_fast_s17.txt" | grep prefill | cut -c1-200
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py tests/kernels/test_compressor_online.py \
    -k "cuda or gpu" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_fast_s17.txt" | tail -2
  secs="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section SourceCounters --section MemoryWorkloadAnalysis"
  timeout 200 ncu -k regex:_emit_indexer_dot_kernel --launch-skip 2 --launch-count 1 $secs python3 benchmarks/ncu_cases.py \
    write:csa_indexer:prefill:65536 2>&1 | grep -v "^==PROF==" | tee "$OUT/${stamp}_h200_ncu_emit_s17.txt" \
    | grep -E "Duration|Throughput|Occupancy|Registers|Stall|Issued|Executed|Block Limit|Waves" | head -40
fi
if [ "$what" = emit_s17 ]; then  # the indexer emit's MMAs on bf16 operands (were tf32: fp32 B loads, 63 % excess shared
  # wavefronts in ncu): emit device time at 65,536 / 8,192 by (block_t, rows), graph time, GPU tests, ncu (~4 min)
  tn="--tune csa_indexer: --tune csa_indexer:emit_rows=32 --tune csa_indexer:emit_block_t=256"
  timeout 90 python3 benchmarks/profile_write.py --modes prefill --ops csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_emit_s17.txt" | grep -E "==|emit"
  tn="--tune csa_indexer: --tune csa_indexer:emit_block_t=32 --tune csa_indexer:emit_block_t=128"
  timeout 60 python3 benchmarks/profile_write.py --modes prefill --tokens 8192 --ops csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_emit8k_s17.txt" | grep -E "==|emit"
  timeout 100 python3 benchmarks/bench_write.py --models v4-flash --ops csa_indexer --modes prefill \
    --out "$OUT/${stamp}_h200_write_emit_s17.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_emit_s17.txt" | grep prefill | cut -c1-200
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py -k "cuda or gpu" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_emit_s17.txt" | tail -2
  secs="--section SpeedOfLight --section Occupancy --section WarpStateStats --section InstructionStats --section SourceCounters"
  timeout 120 ncu -k regex:_emit_indexer_dot_kernel --launch-skip 2 --launch-count 1 $secs python3 benchmarks/ncu_cases.py \
    write:csa_indexer:prefill:65536 2>&1 | grep -v "^==PROF==" | tee "$OUT/${stamp}_h200_ncu_emit_bf16_s17.txt" \
    | grep -E "Duration|Throughput|Issued|Executed Instructions|wavefronts|sectors" | head -20
fi
if [ "$what" = emit2_s17 ]; then  # the MMA emit with row-major rope loads (a contiguous [rows, 64] load split in
  # registers; Triton had put 16 lanes down the rows: 16-way shared conflicts), by num_stages / rows (~3 min)
  d="csa_indexer:emit_dot=1,emit_block_t=128"
  tn="--tune csa_indexer: --tune $d,emit_stages=1 --tune $d,emit_rows=32 --tune $d,emit_stages=1,emit_rows=32"
  timeout 90 python3 benchmarks/profile_write.py --modes prefill --ops csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_emit2_s17.txt" | grep -E "==|emit"
  tn="--tune csa_indexer: --tune csa_indexer:emit_dot=1,emit_block_t=64,emit_stages=1"
  timeout 60 python3 benchmarks/profile_write.py --modes prefill --tokens 8192 --ops csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_emit2_8k_s17.txt" | grep -E "==|emit"
  timeout 100 python3 benchmarks/bench_write.py --models v4-flash --ops csa_indexer --modes prefill \
    --out "$OUT/${stamp}_h200_write_emit2_s17.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_emit2_s17.txt" | grep prefill | cut -c1-200
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py -k "cuda or gpu" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_emit2_s17.txt" | tail -2
  secs="--section SpeedOfLight --section WarpStateStats --section InstructionStats --section SourceCounters"
  timeout 120 ncu -k regex:_emit_indexer_dot_kernel --launch-skip 2 --launch-count 1 $secs python3 benchmarks/ncu_cases.py \
    write:csa_indexer:prefill:65536 2>&1 | grep -v "^==PROF==" | tee "$OUT/${stamp}_h200_ncu_emit2_s17.txt" \
    | grep -E "Duration|Throughput|Issued|Executed Instructions|wavefronts|sectors" | head -20
fi
if [ "$what" = warps_s17 ]; then  # the MMA emit's warps (one latency-bound group a program at 8,192 tokens), then Nsight
  # on the CSA indexer's pool (73 % of its bytes' roofline at 65,536) (~2.5 min)
  d="csa_indexer:emit_dot=1,emit_block_t=64"
  tn="--tune csa_indexer: --tune $d,emit_num_warps=8 --tune $d,emit_num_warps=2"
  timeout 60 python3 benchmarks/profile_write.py --modes prefill --tokens 8192 --ops csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_emit_warps8k_s17.txt" | grep -E "==|emit"
  d="csa_indexer:emit_dot=1,emit_block_t=128"
  tn="--tune csa_indexer: --tune $d,emit_num_warps=8 --tune $d,emit_num_warps=8,emit_rows=32"
  timeout 60 python3 benchmarks/profile_write.py --modes prefill --ops csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_emit_warps_s17.txt" | grep -E "==|emit"
  secs="--section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section LaunchStats"
  timeout 150 ncu -k regex:_compressor_pool_kernel --launch-skip 2 --launch-count 1 $secs python3 benchmarks/ncu_cases.py \
    write:csa_indexer:prefill:65536 2>&1 | grep -v "^==PROF==" | tee "$OUT/${stamp}_h200_ncu_indexer_pool_s17.txt" \
    | grep -E "Duration|Throughput|Occupancy|Registers|Issued|Eligible|Block Limit|Waves|Hit" | head -40
fi
if [ "$what" = ipool_s17 ]; then  # the CSA indexer pool on one warp ([8, 128] tiles: two warps split the 8 rows, so
  # every softmax reduction crossed warps through shared memory; ncu: 35 % of stalls on MIO) (~1.5 min)
  tn="--tune csa_indexer: --tune csa_indexer:num_warps=1 --tune csa_indexer:num_warps=1,block_d=64"
  for n in 65536 8192; do timeout 60 python3 benchmarks/profile_write.py --modes prefill --tokens $n --ops csa_indexer $tn 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_ipool_${n}_s17.txt" | grep -E "==|pool"; done
fi
if [ "$what" = final_s17 ]; then  # session 17's defaults (indexer pool on one warp, MMA emit warps): the CSA indexer's
  # per-kernel and graph times, then the compressor GPU tests (~2.5 min)
  for n in 65536 8192; do timeout 60 python3 benchmarks/profile_write.py --modes prefill --tokens $n --ops csa_indexer 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_final_${n}_s17.txt" | grep -E "==|_"; done
  timeout 100 python3 benchmarks/bench_write.py --models v4-flash --ops csa_indexer --modes prefill \
    --out "$OUT/${stamp}_h200_write_final_s17.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_final_s17.txt" | grep prefill | cut -c1-200
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py tests/kernels/test_compressor_online.py \
    -k "cuda or gpu" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_final_s17.txt" | tail -2
fi
if [ "$what" = sweep_s18 ]; then  # left for session 18 (~5 min): pool and emit variants prepared on the CPU (sm_90
  # registers / static instructions from sass_report), per-kernel device time at 65,536 and 8,192 tokens, then the
  # prefill rows' graph time of every write op with the defaults.
  # - HCA pools with fewer warps a tile, so the 128-row softmax reductions stay inside a warp (the CSA indexer's pool
  #   gained 22 % from one warp, session 17); 128 registers each;
  # - the online pool's whole-chunk entries by the fast loads alone, capped at 128 registers (2,160 static
  #   instructions instead of 2,384, no spills), and uncapped (165 registers);
  # - CSA main: [8, 256] tiles on 1 / 2 warps with the full tile's division / fast rows forced on (the 8,192-token
  #   grid's tail: 1.3 waves), and its [8, 512] tile capped at 168 registers (223 now; 16 B of stack): 6 programs an
  #   SM instead of 4;
  # - the indexer's MMA emit with 256 tokens (4 groups) a program, on 4 / 8 warps (one program's sign matrix and
  #   compaction for twice the rows).
  tn=""; for op in hca hca_online; do
    tn="$tn --tune $op: --tune $op:num_warps=1,block_d=8 --tune $op:num_warps=2,block_d=16"; done
  tn="$tn --tune hca_online:pool_online_rows_in_step=1,pool_maxnreg=128 --tune hca_online:pool_online_rows_in_step=1"
  f="pool_div_after=1,pool_fast_rows=1"
  tn="$tn --tune csa_main: --tune csa_main:block_d=256,$f --tune csa_main:block_d=256,num_warps=2,$f"
  tn="$tn --tune csa_main:pool_maxnreg=168"
  e="csa_indexer:emit_dot=1,emit_block_t=256"
  tn="$tn --tune csa_indexer: --tune $e --tune $e,emit_num_warps=8"
  for n in 65536 8192; do timeout 150 python3 benchmarks/profile_write.py --modes prefill --tokens $n \
    --ops hca,hca_online,csa_main,csa_indexer $tn 2>&1 | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_sweep_${n}_s18.txt" \
    | grep -E "==|pool|emit"; done
  timeout 200 python3 benchmarks/bench_write.py --models v4-flash --modes prefill \
    --out "$OUT/${stamp}_h200_write_prefill_s18.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_prefill_s18.txt" | grep prefill | cut -c1-200
fi
if [ "$what" = overlap_s18 ]; then  # left for session 18: compress_prefill's state write on a side stream, concurrent
  # with the emit (overlap_write, off until measured): the compressor GPU tests (their capture test covers the two
  # branches), then the prefill rows' graph time in order vs overlapped (~4 min)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py tests/kernels/test_compressor_prefill.py \
    -k "cuda or gpu" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_overlap_s18.txt" | tail -2
  tn=""; for op in csa_main csa_indexer hca hca_online; do tn="$tn --tune $op: --tune $op:overlap_write=1"; done
  timeout 240 python3 benchmarks/bench_write.py --models v4-flash --modes prefill --ops csa_main,csa_indexer,hca,hca_online \
    $tn --out "$OUT/${stamp}_h200_write_overlap_s18.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_overlap_s18.txt" \
    | grep prefill | cut -c1-220
fi
if [ "$what" = fuse_s19 ]; then  # left for session 19 (~4 min): compress_prefill's fused emit (the pool program emits;
  # CSA main keeps the pooled row in registers, 233 registers / 3,704 static instructions on sm_90 vs 223 / 1,704 +
  # the emit's 72 / 872; the CSA indexer reads it back after a CTA barrier, 248 registers on its one warp): GPU tests
  # (fused vs in order, capture), then per-kernel and graph times with and without it
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor_prefill.py tests/kernels/test_compressor.py \
    tests/cache/test_handle.py -k "cuda or gpu" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_fuse_s19.txt" | tail -2
  tn="--tune csa_main: --tune csa_main:fuse_emit=1 --tune csa_indexer: --tune csa_indexer:fuse_emit=1"
  tn="$tn --tune csa_indexer:fuse_emit=1,pool_maxnreg=128"
  for n in 65536 8192; do timeout 100 python3 benchmarks/profile_write.py --modes prefill --tokens $n --ops csa_main,csa_indexer \
    $tn 2>&1 | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_fuse_${n}_s19.txt" | grep -E "==|_"; done
  tn="--tune csa_main: --tune csa_main:fuse_emit=1 --tune csa_indexer: --tune csa_indexer:fuse_emit=1"
  timeout 150 python3 benchmarks/bench_write.py --models v4-flash --modes prefill --ops csa_main,csa_indexer $tn \
    --out "$OUT/${stamp}_h200_write_fuse_s19.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_fuse_s19.txt" | grep prefill | cut -c1-220
fi
if [ "$what" = pdl_s19 ]; then  # left for session 19 (~6 min): programmatic dependent launch of dsv4's Triton kernels
  # (dispatch.PDL, off until measured; DSV4_PDL=1 turns it on; in a prefill the state write then loads before it waits
  # and the emit runs beside it): the write-path, model and engine GPU tests with it on (test_pdl: eager and
  # graph-replayed bytes equal PDL off), then the compressor prefill rows with it off and on; first study_pdl.py:
  # the time a kernel of a 32-kernel chain in a graph, plain / PDL / PDL with the work before the wait
  timeout 60 python3 benchmarks/study_pdl.py --out "$OUT/${stamp}_h200_study_pdl_s19.jsonl" 2>&1 \
    | tee "$OUT/${stamp}_h200_study_pdl_s19.txt" | tail -12
  DSV4_PDL=1 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_pdl.py tests/kernels/test_store.py \
    tests/kernels/test_compressor.py tests/kernels/test_compressor_prefill.py tests/kernels/test_compressor_online.py \
    tests/model tests/engine -k "cuda or gpu" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_pdl_s19.txt" | tail -2
  for p in 0 1; do DSV4_PDL=$p timeout 100 python3 benchmarks/bench_write.py --models v4-flash --modes prefill \
    --ops csa_main,csa_indexer,hca,hca_online \
    --out "$OUT/${stamp}_h200_write_pdl${p}_s19.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_pdl${p}_s19.txt" | grep -E "prefill|decode" \
    | cut -c1-150; done
fi
if [ "$what" = pdl_decode_s19 ]; then  # left for session 19 (~4 min): the decode step and the decode-size writes with PDL
  # off and on (the step's check compares it with the plain step, so it covers the read-path kernels too)
  for p in 0 1; do DSV4_PDL=$p timeout 100 python3 -m dsv4.cli bench --models v4-flash --kinds csa,hca --contexts 131072 \
    --batches 1,64 --out "$OUT/${stamp}_h200_decode_pdl${p}_s19.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_decode_pdl${p}_s19.txt" | tail -6; done
  for p in 0 1; do DSV4_PDL=$p timeout 60 python3 benchmarks/bench_write.py --models v4-flash --modes decode \
    --out "$OUT/${stamp}_h200_write_decode_pdl${p}_s19.jsonl" 2>&1 | grep decode | cut -c1-150; done
fi
if [ "$what" = writes_s19 ]; then  # overlap_s18 and fuse_s19 in one call (~8 min): the compressor, prefill, online and
  # handle GPU tests once (side-stream write, fused emit, online positions in the state write, ape in the kernels,
  # their captures), then the prefill rows in order / side-stream / fused / with ape (what a layer now passes: the
  # score rows without ape, added by the kernels), and the fused kernels' device times
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py tests/kernels/test_compressor_prefill.py \
    tests/kernels/test_compressor_online.py tests/kernels/test_store.py tests/cache/test_handle.py -k "cuda or gpu" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_writes_s19.txt" | tail -2
  tn=""; for op in csa_main csa_indexer; do tn="$tn --tune $op: --tune $op:overlap_write=1 --tune $op:fuse_emit=1"; done
  for op in hca hca_online; do tn="$tn --tune $op: --tune $op:overlap_write=1"; done
  for op in csa_main csa_indexer hca hca_online; do tn="$tn --tune $op:ape=1"; done  # ape added in the kernels
  tn="$tn --tune store_window: --tune store_window:copy=1"  # the window store with the workspace copy (no bf16 rows)
  timeout 240 python3 benchmarks/bench_write.py --models v4-flash --modes prefill \
    --ops store_window,csa_main,csa_indexer,hca,hca_online $tn --out "$OUT/${stamp}_h200_write_writes_s19.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_writes_s19.txt" \
    | grep prefill | cut -c1-220
  tn="--tune csa_main: --tune csa_main:fuse_emit=1 --tune csa_indexer: --tune csa_indexer:fuse_emit=1"
  for n in 65536 8192; do timeout 60 python3 benchmarks/profile_write.py --modes prefill --tokens $n --ops csa_main,csa_indexer \
    $tn 2>&1 | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_fuse_${n}_s19.txt" | grep -E "==|_"; done
fi
if [ "$what" = layer_s19 ]; then  # left for session 19 (~3 min): where one layer's prefill step goes, PyTorch glue
  # included (profile_prefill.py: V4-Flash CSA / HCA, 8,192 and 65,536 tokens from position 0, and 8,192 after 4,096)
  for kind in csa hca; do for tk in "8192 0" "65536 0" "8192 4096"; do set -- $tk
    timeout 60 python3 benchmarks/profile_prefill.py --kind $kind --tokens $1 --start $2 2>&1 | grep -v -i warn \
      | tee "$OUT/${stamp}_h200_profile_prefill_${kind}_${1}_${2}_s19.txt" | tail -4; done; done
fi
if [ "$what" = select_s19 ]; then  # left for session 20 (~6 min): a prefill's indexer selection in row chunks (bounded
  # scratch, each chunk as wide as its rows see) vs the one call it replaces: the GPU tests, then time and peak memory;
  # steps that never wait for the GPU (plan fields in one pinned copy, the window index once a plan) vs the old transfers
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_indexer_select.py tests/model/test_attention.py \
    tests/cache/test_plan.py -k "cuda or gpu or row_chunks or packed" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_select_s19.txt" | tail -2
  timeout 150 python3 benchmarks/bench_step_sync.py --out "$OUT/${stamp}_h200_step_sync_s19.jsonl" 2>&1 \
    | tee "$OUT/${stamp}_h200_step_sync_s19.txt" | tail -3
  timeout 200 python3 benchmarks/bench_indexer.py --only prefill --out "$OUT/${stamp}_h200_indexer_select_s19.jsonl" 2>&1 \
    | tee "$OUT/${stamp}_h200_indexer_select_s19.txt" | tail -8
fi
if [ "$what" = grid_s20 ]; then  # left for session 20 (~5 min): the pool kernel's CHANNELS_FAST grid order (a token
  # block's channel blocks consecutive programs, so HCA's 2 KB rows are read whole by programs resident together, not
  # 128 B of each row a wave): the pool GPU tests, then per-kernel device times and the prefill rows' graph times
  # (ran once in session 20: slower, and the knob was removed after it; this mode no longer runs)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor.py tests/kernels/test_compressor_online.py \
    -k "(cuda or gpu) and (many_emitters or chunked_steps or ape_added)" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_grid_s20.txt" | tail -2
  tn=""; for op in hca hca_online csa_indexer; do tn="$tn --tune $op: --tune $op:pool_channels_fast=1"; done
  tn="$tn --tune hca:pool_channels_fast=1,overlap_write=1 --tune hca_online:pool_channels_fast=1,overlap_write=1"
  for n in 65536 8192; do timeout 100 python3 benchmarks/profile_write.py --modes prefill --tokens $n --ops hca,hca_online,csa_indexer \
    $tn 2>&1 | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_grid_${n}_s20.txt" | grep -E "==|pool"; done
  timeout 200 python3 benchmarks/bench_write.py --models v4-flash --modes prefill --ops hca,hca_online,csa_indexer $tn \
    --out "$OUT/${stamp}_h200_write_grid_s20.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_write_grid_s20.txt" | grep prefill | cut -c1-220
fi
if [ "$what" = tails_s20 ]; then  # left for session 20 (~3 min): the indexer query tail with several tokens a program
  # (3.3 ms of a 65,536-token CSA prefill layer, one program a token before) and the output's inverse RoPE in place
  # (2.5 ms for the copy there): GPU tests, then graph times against the references, the query at each block_t
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_rope.py tests/kernels/test_indexer_query.py \
    -k "gpu or cuda" 2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_tails_s20.txt" | tail -2
  timeout 120 python3 benchmarks/bench_rope.py --ops rope_inverse,rope_inverse_inplace,indexer_query --tokens 64,8192,65536 \
    --out "$OUT/${stamp}_h200_rope_tails_s20.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_rope_tails_s20.txt" | cut -c1-150
  # (the query tail's --block-t, tokens a program, was removed after this run: no gain)
  for bt in 1 2 4 16; do timeout 60 python3 benchmarks/bench_rope.py --ops indexer_query --tokens 8192,65536 --block-t $bt \
    --out "$OUT/${stamp}_h200_rope_tails_s20.jsonl" 2>&1 | tee -a "$OUT/${stamp}_h200_rope_tails_s20.txt" | cut -c1-150; done
  # where a prefill chunk's top-k goes (14 ms of the 65,536-token CSA layer): 2,048 rows x 16,384, k = 512
  # (filter with one split: launch D reads its region in place, ONE_REGION, vs the copy to the dense list)
  for o in 1 0; do timeout 100 python3 benchmarks/profile_topk.py --rows 2048 --n 16384 --k 512 --methods filter,radix --splits 1 \
    --reps 3 --one-region $o 2>&1 | grep -v -i warn | tee -a "$OUT/${stamp}_h200_profile_topk_prefill_s20.txt" | tail -14; done
fi
if [ "$what" = linear_s20 ]; then  # left for session 20 (~3 min): the compressor projections' prefill tiles, never swept
  # (16.9 ms of the 65,536-token CSA layer, 128 x 128 x 32 on 8 warps, 3 stages): the CSA main pair at 65,536 tokens
  g="block_m=128,256;block_n=128,256;block_k=32,64;num_warps=8;num_stages=3;split_k=1;swap_ab=0"
  timeout 280 python3 benchmarks/bench_linear.py --sweep --sweep-m 65536 --ops csa_main --sweep-grid "$g" \
    --out "$OUT/${stamp}_h200_linear_sweep_prefill_s20.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_linear_sweep_prefill_s20.txt" | tail -12
fi
if [ "$what" = layer_s20 ]; then  # left for session 20 (~2 min): one layer's prefill step after this session's changes
  # (the output's inverse RoPE in place, the query tail's tokens a program, the one-split top-k without its copy)
  # (session 20's run: the CSA profile passed its 60 s limit and wrote nothing; 150 s, and tail, not head, after tee)
  for kind in csa hca; do timeout 150 python3 benchmarks/profile_prefill.py --kind $kind --tokens 65536 --start 0 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_prefill_${kind}_65536_0_s20.txt" | tail -3; done
fi
if [ "$what" = topk_s20 ]; then  # left for session 20 (~4 min): a prefill chunk's top-k (2,048 rows x 16,384, k = 512,
  # one split) with fewer warps in launches A / C and B / D and smaller tiles (all tuned on the decode step's few rows)
  for v in "--warps-ac 4" "--warps-ac 2 --tile 2048" "--warps-ac 4 --warps-bd 4"; do
    timeout 80 python3 benchmarks/profile_topk.py --rows 2048 --n 16384 --k 512 --methods filter --splits 1 --reps 3 $v \
      2>&1 | grep -v -i warn | tee -a "$OUT/${stamp}_h200_profile_topk_prefill_tune_s20.txt" | tail -5; done
  # a prefill's first chunk (rows that see <= 4,096 entries): the single-program kernel (auto's choice there) vs filter
  timeout 80 python3 benchmarks/profile_topk.py --rows 8192 --n 4096 --k 512 --methods filter,radix --splits 1 --reps 3 \
    2>&1 | grep -v -i warn | tee -a "$OUT/${stamp}_h200_profile_topk_prefill_tune_s20.txt" | grep "=="
fi
if [ "$what" = validate_s20 ]; then  # left for session 21 (~8 min): session 20's defaults set from measurements of the
  # same kernels but never run as defaults (GEMM BLOCK_K 64 for prefill; top-k: filter path for >= 256 rows at any N,
  # launches B / D on 4 warps there): their GPU tests, the top-k at the two prefill shapes with the defaults, then the
  # CSA and HCA layers' prefill profiles (the CSA one was lost to a timeout in session 20)
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_topk.py tests/kernels/test_indexer_select.py \
    tests/kernels/test_linear.py tests/model/test_attention.py -k "cuda or gpu or bands_change_nothing" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_validate_s20.txt" | tail -2
  for rn in "2048 16384" "8192 4096"; do set -- $rn; timeout 60 python3 benchmarks/profile_topk.py --rows $1 --n $2 --k 512 \
    --methods auto --reps 3 2>&1 | grep -v -i warn | tee -a "$OUT/${stamp}_h200_profile_topk_defaults_s20.txt" | grep "=="; done
  # launch C (138 of 312 us there) on 16 warps; 4 groups a k (a quarter fewer groups read by C, twice the maxima for B)
  for v in "--warps-ac 16" "--groups-per-k 4"; do timeout 60 python3 benchmarks/profile_topk.py --rows 2048 --n 16384 \
    --k 512 --methods filter --splits 1 --reps 3 $v 2>&1 | grep -v -i warn | tee -a "$OUT/${stamp}_h200_profile_topk_defaults_s20.txt" \
    | tail -5; done
  timeout 60 python3 benchmarks/study_out_proj.py 2>&1 | tee "$OUT/${stamp}_h200_study_out_proj_s20.txt" | tail -6
  # the query tail with e2m1_round (2,568 static instructions a program, 2,744 before: 3,094 us at 65,536 then)
  timeout 60 python3 benchmarks/bench_rope.py --ops indexer_query --tokens 8192,65536 \
    --out "$OUT/${stamp}_h200_rope_validate_s20.jsonl" 2>&1 | cut -c1-150
  OUT=$OUT bash "$0" layer_s20
  # the HCA prefill's attention in row bands (model.attention.PREFILL_BANDS, off until this), same layer profile
  timeout 150 python3 benchmarks/profile_prefill.py --kind hca --tokens 65536 --start 0 --bands 1 2>&1 | grep -v -i warn \
    | tee "$OUT/${stamp}_h200_profile_prefill_hca_65536_0_bands_s20.txt" | tail -3
fi
if [ "$what" = prefill_idx_s21 ]; then  # left for session 22 (~7 min, after validate_s20): a prefill's indexer scores over
  # keys folded once a request (kernels/indexer/prefill.py; select.PREFILL_SHARED_KEYS off until this): GPU tests, the
  # scores of 2,048 / 4,096 rows at P = 8,192 / 65,536 against indexer_scores (gluon_fold) over launch geometries
  # (rows,block_n,warps,stages), indexer_topk of whole prefills on / off, then the CSA layer's profile with it on
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_indexer_prefill.py \
    tests/kernels/test_indexer_select.py tests/model/test_attention.py -k "gpu or shared_keys" -s 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_prefill_idx_s21.txt" | tail -4
  timeout 200 python3 benchmarks/bench_prefill_indexer.py --launches 4,128,8,3 2,128,8,3 2,64,4,3 4,64,4,3 2,64,4,4 \
    1,128,4,3 2,128,4,3 --select 8192 65536 --out "$OUT/${stamp}_h200_prefill_idx_s21.jsonl" 2>&1 | grep -v -i warn \
    | tee "$OUT/${stamp}_h200_prefill_idx_s21.txt" | cut -c1-260
  timeout 150 python3 benchmarks/profile_prefill.py --kind csa --tokens 65536 --start 0 --shared-keys 1 2>&1 \
    | grep -v -i warn | tee "$OUT/${stamp}_h200_profile_prefill_csa_65536_0_shared_s21.txt" | tail -3
fi
if [ "$what" = tf32x2_s21 ]; then  # left for session 22 (~6 min): the compressor GEMM on bf16 x with two tf32 products a
  # K block (linear.TF32X2, on: same bits as tf32x3, 24 -> 16 wgmma a loop in static SASS) against tf32x3's three, and
  # precision="bf16x3" (opt-in: three bf16 products of exact weight pieces, 12 wgmma) and "bf16w" (weights exact in
  # bf16, as an FP8 checkpoint's: one bf16 product, 4 wgmma; model.attention.BF16_EXACT_COMPRESSOR off): GPU tests
  # (bit equality, error bounds), then bench_linear's layer call all four ways at every width, decode and 65,536
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py -k "gpu or cuda" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_tf32x2_s21.txt" | tail -3
  timeout 330 python3 benchmarks/bench_linear.py --tokens 64,4096,65536 --out "$OUT/${stamp}_h200_linear_tf32x2_s21.jsonl" \
    2>&1 | tee "$OUT/${stamp}_h200_linear_tf32x2_s21.txt" | cut -c1-230
fi
if [ "$what" = topk_s21 ]; then  # left for session 22 (~3 min): launch D of a prefill chunk's top-k in two parts
  # (topk._SPLIT_D, off: the SB1 rows in a 168-register build, 3 programs a SM, then the rest) against one launch
  # (255 registers + 312 B of stack, 2 a SM), at the two prefill shapes; the top-k GPU tests with it on
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_topk.py -k "gpu and (filter or many_rows)" \
    2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_topk_s21.txt" | tail -2
  # (and the snapshots' one-transfer save / load on the GPU: its test, a migrated request decoding on)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/cache/test_snapshot.py -k "gpu or cuda" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_snapshot_s21.txt" | tail -2
  # (D on 8 warps: PART 1 105 registers, 2 programs a SM of 8 warps; the one launch 255 + 0 stack)
  for rn in "2048 16384" "8192 4096"; do for v in "0 4" "1 4" "0 8" "1 8"; do set -- $rn $v; timeout 60 python3 \
    benchmarks/profile_topk.py --rows $1 --n $2 --k 512 --methods filter --splits 1 --reps 3 --split-d $3 \
    --warps-bd-many $4 2>&1 | grep -v -i warn | tee -a "$OUT/${stamp}_h200_profile_topk_split_d_s21.txt" | tail -6
  done; done
fi
if [ "$what" = iquery_s21 ]; then  # left for session 22 (~3 min): the indexer query tail with more heads a program (never
  # timed; 16 heads / 4 warps is the default): sm_90 SASS (triton 3.6) 2,576 static instructions for 16 heads x 128
  # values on 4 warps (161 a value a thread; half of them libdevice cos / sin, computed once a program), 2,760 for 64
  # heads on 8 warps (86; wgmma, 74 registers), 3,320 for 32 heads on 4 warps
  for g in "16 4" "32 4" "64 8" "64 4"; do set -- $g; timeout 60 python3 benchmarks/bench_rope.py --ops indexer_query \
    --tokens 64,8192,65536 --block-h $1 --num-warps $2 --out "$OUT/${stamp}_h200_rope_iquery_s21.jsonl" 2>&1 \
    | cut -c1-150; done
fi
if [ "$what" = fp8_linear_s22 ]; then  # left for session 23 (~5 min): the layer's projections on FP8 weights
  # (kernels/fp8_linear.py; opt-in: keep_fp8 / random_attention_weights(fp8=True)): GPU tests (every projection width
  # of V4-Flash / V4-Pro against fp64 and cuBLAS, every e4m3 code through both conversions, a CUDA graph, the layer
  # vs the dense reference), then bench_fp8_linear against cuBLAS bf16 on the dequantised weights, both conversions
  timeout 240 python3 -m pytest -q -p no:cacheprovider -s tests/kernels/test_fp8_linear.py -m gpu 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_fp8_linear_s22.txt" | grep -v "differ from" | tail -4
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/model/test_attention.py -k "fp8" 2>&1 \
    | tee -a "$OUT/${stamp}_h200_gpu_tests_fp8_linear_s22.txt" | tail -2
  for c in 1 0; do
    timeout 150 python3 benchmarks/bench_fp8_linear.py --cvt-asm $c --out "$OUT/${stamp}_h200_fp8_linear_s22.jsonl" 2>&1 \
      | tee -a "$OUT/${stamp}_h200_fp8_linear_s22.txt" | cut -c1-200
  done
fi
if [ "$what" = fp8_step_s22 ]; then  # left for session 23 (~6 min): one CSA layer's decode step (V4-Flash and V4-Pro,
  # 128K context, B = 1 / 64) with its linear weights kept FP8 against bf16, same run: the "projecti" column
  for f in "" "--fp8-weights"; do
    timeout 270 python3 -m dsv4.cli bench --models v4-flash,v4-pro --kinds csa --contexts 131072 --batches 1,64 $f \
      --out "$OUT/${stamp}_h200_decode_fp8${f:+_on}_s22.jsonl" 2>&1 | tail -6
  done
fi
if [ "$what" = hsum_s22 ]; then  # left for session 23 (~3 min): the Gluon FP4 indexer's fold variant with the head sum
  # on the tensor core (hsum=True, opt-in: bf16 logits; static sm_90 pair loop 125 -> 98 instructions a consumer warp a
  # tile): its GPU tests, then 1M-entry rows at B = 4 / 64, fold with and without hsum, clean L2
  timeout 200 python3 -m pytest -q -p no:cacheprovider -s tests/kernels/test_gluon_indexer_scores.py -k "fold and gpu" \
    2>&1 | tee "$OUT/${stamp}_h200_gpu_tests_hsum_s22.txt" | grep -E "hsum:|passed|failed" | tail -6
  timeout 240 python3 benchmarks/study_gluon_indexer.py --batches 4 64 --quick --fold --hsum --flush read \
    --out "$OUT/${stamp}_h200_study_gluon_hsum_s22.jsonl" 2>&1 | tee "$OUT/${stamp}_h200_study_gluon_hsum_s22.txt" | tail -12
fi
if [ "$what" = check_s23 ]; then  # session 23 (~6 min): GPU tests of what sessions 20-23 set or added without a GPU:
  # fp8_linear (every projection width, every e4m3 code, graph, layer), the stacked FP8 projections
  # (attention.STACK_PROJECTIONS), the compressor GEMM's tf32x2 (on by default: bit equality with tf32x3), session 20's
  # top-k / GEMM defaults
  timeout 200 python3 -m pytest -q -p no:cacheprovider -s tests/kernels/test_fp8_linear.py -m gpu 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_fp8_linear_s22.txt" | grep -v "differ from" | tail -6
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/model/test_attention.py tests/kernels/test_fp8_linear.py \
    -k "fp8_weights or stacked or gpu_triton or (grouped and cuda)" 2>&1 | tee -a "$OUT/${stamp}_h200_gpu_tests_fp8_linear_s22.txt" | tail -3
  # grouped_linear's bf16 path (V4-Flash wo_a: 8 groups of 4,096 -> 1,024, B = 64): kernels a call (one GEMM, no copy)
  python3 -c "
import torch; from torch.profiler import profile, ProfilerActivity; from dsv4.kernels.fp8_linear import grouped_linear
x = torch.randn(64, 8 * 4096, device='cuda').bfloat16(); w = torch.randn(8 * 1024, 4096, device='cuda').bfloat16()
grouped_linear(x, w, 8); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as p: grouped_linear(x, w, 8); torch.cuda.synchronize()
print('grouped_linear kernels:', [e.name[:60] for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA])
" 2>&1 | tail -1 | tee -a "$OUT/${stamp}_h200_gpu_tests_fp8_linear_s22.txt"
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py -k "gpu or cuda" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_tf32x2_s21.txt" | tail -3
  # the window store setting the ring heads (session 23) and the decode window index (session 24) in its launch;
  # wo_a's fp8_linear de-rotating o in its load at q_norm_rope's (cos, sin) (session 24)
  # and (session 24) a CSA layer's two compressors' decode step in one launch, top-k's launches A + B as one
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_store.py tests/kernels/test_fp8_linear.py \
    tests/kernels/test_rope.py tests/kernels/test_compressor.py tests/kernels/test_topk.py \
    -k "(cuda and (window or derotate or cos_sin or csa_one)) or gpu_real_shape" \
    2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_ring_heads_s23.txt" | tail -2
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_topk.py tests/kernels/test_indexer_select.py \
    tests/model/test_attention.py -k "(cuda or gpu or bands_change_nothing) and not fp8" 2>&1 \
    | tee "$OUT/${stamp}_h200_gpu_tests_validate_s20.txt" | tail -3
fi
if [ "$what" = step_s23 ]; then  # session 23 (~8 min): one CSA layer's decode step (128K, B = 1 / 64) with bf16
  # weights, then stacked (STACK_PROJECTIONS: x's wq_a + wkv and qr's wq_b + indexer wq_b, one GEMM each), FP8 weights
  # (fp8_linear), FP8 stacked, FP8 with the inverse RoPE in its own launch (session 24); fp8_linear alone: fp8lin_s23
  m=${MODELS:-v4-flash}
  for f in "" "--stack-projections" "--fp8-weights" "--fp8-weights --stack-projections"; do
    tag=$(echo "$f" | sed 's/--//g; s/ /_/g; s/-projections//; s/-weights//')
    timeout 110 python3 -m dsv4.cli bench --models $m --kinds csa --contexts 131072 --batches 1,64 $f \
      --out "$OUT/${stamp}_h200_decode_${m}_${tag:-bf16}_s23.jsonl" 2>&1 | grep -v -i warn | tail -4
  done
  # FP8 weights with the inverse RoPE as its own launch again (projections.FUSE_DEROTATE off; session 24)
  timeout 110 python3 -c "import sys, dsv4.model.projections as p; p.FUSE_DEROTATE = False; from dsv4.cli import main; \
sys.exit(main(sys.argv[1:]))" bench --models $m --kinds csa --contexts 131072 --batches 1,64 --fp8-weights \
    --out "$OUT/${stamp}_h200_decode_${m}_fp8_nofuse_s24.jsonl" 2>&1 | grep -v -i warn | tail -4
fi
if [ "$what" = fp8lin_s23 ]; then  # fp8_linear alone against cuBLAS bf16 at every projection width (~2 min)
  timeout 90 python3 benchmarks/bench_fp8_linear.py --cvt-asm ${CVT:-1} --out "$OUT/${stamp}_h200_fp8_linear_s23.jsonl" \
    2>&1 | tee -a "$OUT/${stamp}_h200_fp8_linear_s23.txt" | cut -c1-200
fi
if [ "$what" = s25 ]; then  # session 25 (~8 min): the test fixes after check_s23's first GPU run, the decode step's
  # stacked / FP8 variants, fp8_linear's launch sweep (its M = 64 time) and its per-projection benchmark
  timeout 120 python3 -m pytest -q -p no:cacheprovider -s tests/kernels/test_fp8_linear.py -k "gpu or (mixed and cuda)" \
    2>&1 | tee "$OUT/${stamp}_gpu_tests_fp8_linear_s25.txt" | grep -E "differ from|passed|failed|^FAILED" | tail -40
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py -k "gpu or cuda" 2>&1 \
    | tee "$OUT/${stamp}_gpu_tests_linear_s25.txt" | grep -E "passed|failed|^FAILED|^E " | tail -12
  m=v4-flash
  for f in "--stack-projections" "--fp8-weights --stack-projections"; do
    tag=$(echo "$f" | sed 's/--//g; s/ /_/g; s/-projections//; s/-weights//')
    timeout 90 python3 -m dsv4.cli bench --models $m --kinds csa,hca --contexts 131072 --batches 1,64 $f \
      --out "$OUT/${stamp}_decode_${m}_${tag}_s25.jsonl" 2>&1 | grep -v -i warn | tail -5
  done
  timeout 90 python3 -c "import sys, dsv4.model.attention as a; a.STACK_COMPRESSORS = False; from dsv4.cli import main; \
sys.exit(main(sys.argv[1:]))" bench --models $m --kinds csa,hca --contexts 131072 --batches 1,64 --fp8-weights \
    --stack-projections --out "$OUT/${stamp}_decode_${m}_fp8_stack_nocomp_s25.jsonl" 2>&1 | grep -v -i warn | tail -5
  timeout 120 python3 benchmarks/bench_fp8_linear.py --sweep --models $m --tokens 1,64 \
    --out "$OUT/${stamp}_fp8_linear_sweep_s25.jsonl" 2>&1 | tee "$OUT/${stamp}_fp8_linear_sweep_s25.txt" | cut -c1-150
  timeout 90 python3 benchmarks/bench_fp8_linear.py --models $m --out "$OUT/${stamp}_fp8_linear_s25.jsonl" 2>&1 \
    | tee "$OUT/${stamp}_fp8_linear_s25.txt" | cut -c1-170
fi
if [ "$what" = s25b ]; then  # session 25 (~5 min): the CSA / HCA decode step (V4-Flash 128K, B = 1 / 64) with bf16 /
  # stacked / FP8 / FP8 stacked weights in one run (the new bench check and fp8_linear's K splits), fp8_linear at 64 /
  # 128 tokens, the graph replay test (plan.begin_forward: the HCA index once a pass)
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/engine/test_graphs.py tests/model/test_launch_budget.py \
    -m gpu 2>&1 | tee "$OUT/${stamp}_gpu_tests_graphs_s25.txt" | grep -E "passed|failed|^FAILED|^E " | tail -6
  m=v4-flash
  for f in "" "--stack-projections" "--fp8-weights" "--fp8-weights --stack-projections"; do
    tag=$(echo "$f" | sed 's/--//g; s/ /_/g; s/-projections//; s/-weights//')
    timeout 70 python3 -m dsv4.cli bench --models $m --kinds csa,hca --contexts 131072 --batches 1,64 $f \
      --out "$OUT/${stamp}_decode_${m}_${tag:-bf16}_s25b.jsonl" 2>&1 | grep -v -i warn | tail -5
  done
  timeout 80 python3 benchmarks/bench_fp8_linear.py --models $m --tokens 64,128 --out "$OUT/${stamp}_fp8_linear_s25b.jsonl" \
    2>&1 | cut -c1-170
fi
if [ "$what" = s26a ]; then  # session 26 (~6 min): prefill_idx_s21's tests the 200 s cut (with PREFILL_SHARED_KEYS on
  # and the random-batch test on CUDA tensors), then topk_s21 and iquery_s21
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_indexer_select.py tests/model/test_attention.py \
    -k "shared_keys or (gpu and (csa or hca or never_wait))" 2>&1 | tee "$OUT/${stamp}_gpu_tests_prefill_idx_s26.txt" \
    | grep -E "passed|failed|^FAILED|^E " | tail -12
  OUT=$OUT bash "$0" topk_s21 | tail -40
  OUT=$OUT bash "$0" iquery_s21 | tail -20
fi
if [ "$what" = s26b ]; then  # session 26 (~7 min): the pool launch writing the state where no pooling reads it
  # (compress_prefill(state_unread=True), what the handle passes for requests from position 0): GPU tests, the CSA /
  # HCA prefill writes with it and without (state_unread=0) in one run, the per-kernel profile; top-k's GPU tests
  # with launch D in two parts (_SPLIT_D, on since topk_s21)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_compressor_prefill.py tests/cache/test_handle.py \
    -k "cuda" 2>&1 | tee "$OUT/${stamp}_gpu_tests_unread_s26.txt" | grep -E "passed|failed|^FAILED|^E " | tail -8
  timeout 140 python3 benchmarks/bench_write.py --models v4-flash --modes prefill --ops csa_main,csa_indexer,hca \
    --tune csa_main: --tune csa_main:state_unread=0 --tune csa_indexer: --tune csa_indexer:state_unread=0 \
    --tune hca: --tune hca:state_unread=0 --out "$OUT/${stamp}_write_unread_s26.jsonl" 2>&1 | grep -v -i warn \
    | tee "$OUT/${stamp}_write_unread_s26.txt" | cut -c1-200
  timeout 50 python3 benchmarks/profile_write.py --ops csa_indexer,hca --modes prefill --tokens 65536 \
    --tune csa_indexer: --tune csa_indexer:state_unread=0 2>&1 | grep -v -i warn \
    | tee "$OUT/${stamp}_profile_write_unread_s26.txt" | tail -16
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_topk.py -k "gpu_many_rows or gpu_real_shape" \
    2>&1 | tee "$OUT/${stamp}_gpu_tests_topk_split_d_s26.txt" | grep -E "passed|failed|^FAILED|^E " | tail -6
fi
if [ "$what" = s27a ]; then  # left for session 27 (~10 min): the pool launch writing the state (state_unread) with the
  # writer check issued before the pooling, against the state-write launch, at 8,192 / 16,384 / 32,768 / 65,536 tokens
  # (compressor._STATE_IN_POOL_MAX_T is 8,192 from session 26's run; the tune forces the pool write at every size)
  for t in 8192 16384 32768 65536; do
    timeout 100 python3 -c "import sys; sys.argv[0] = 'bench_write'; sys.path.insert(0, 'benchmarks'); \
import dsv4.kernels.cache.compressor as c; c._STATE_IN_POOL_MAX_T = 1 << 30; import bench_write as b; b.main()" \
      --models v4-flash --modes prefill --ops csa_main,csa_indexer,hca --prefill-tokens $t \
      --tune csa_main: --tune csa_main:state_unread=0 --tune csa_indexer: --tune csa_indexer:state_unread=0 \
      --tune hca: --tune hca:state_unread=0 --out "$OUT/${stamp}_write_unread_s27.jsonl" 2>&1 | grep -v -i warn | cut -c1-200
  done
  # the online HCA state written by the pool launch (compressor._ONLINE_STATE_IN_POOL, off: 158 registers at 8,192
  # tokens against 128) against its own write launch, and capped at 128 registers
  for t in 8192 16384; do
    timeout 60 python3 -c "import sys; sys.argv[0] = 'bench_write'; sys.path.insert(0, 'benchmarks'); \
import dsv4.kernels.cache.compressor as c; c._ONLINE_STATE_IN_POOL = True; c._STATE_IN_POOL_MAX_T = 1 << 30; \
import bench_write as b; b.main()" --models v4-flash --modes prefill --ops hca_online --prefill-tokens $t \
      --tune hca_online: --tune hca_online:state_unread=0 --tune hca_online:pool_maxnreg=128 \
      --out "$OUT/${stamp}_write_unread_online_s27.jsonl" 2>&1 | grep -v -i warn | cut -c1-200
  done
  # fp8_linear's GEMV form (gemv=True, opt-in: fp8_linear.GEMV_MAX_M = 0) against the MMA form at 1 / 2 / 4 tokens,
  # every projection of both models, in the launch sweep; then its GPU tests (real widths at 1 token, the graph)
  timeout 200 python3 benchmarks/bench_fp8_linear.py --sweep --models v4-flash,v4-pro --tokens 1,2,4 \
    --out "$OUT/${stamp}_fp8_linear_gemv_s27.jsonl" 2>&1 | tee "$OUT/${stamp}_fp8_linear_gemv_s27.txt" | cut -c1-170
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_linear.py -k "gemv or (real_widths and 1-)" \
    2>&1 | tee "$OUT/${stamp}_gpu_tests_gemv_s27.txt" | grep -E "passed|failed|^FAILED|^E " | tail -6
fi
if [ "$what" = s27b ]; then  # programmatic dependent launch (dispatch.PDL, off; DSV4_PDL=1 turns it on), ~9 min: the
  # decode step (its check compares it with the plain step) and the write rows with it off and on, then the model,
  # engine, PDL and prefill-compressor GPU tests with it on (session 19's PDL test run was cut before its summary)
  for p in 0 1; do DSV4_PDL=$p timeout 110 python3 -m dsv4.cli bench --models v4-flash --kinds csa,hca --contexts 131072 \
    --batches 1,64 --out "$OUT/${stamp}_decode_pdl${p}_s27.jsonl" 2>&1 | tee "$OUT/${stamp}_decode_pdl${p}_s27.txt" | tail -6; done
  DSV4_PDL=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model tests/engine tests/kernels/test_pdl.py \
    tests/kernels/test_compressor_prefill.py 2>&1 | tee "$OUT/${stamp}_gpu_tests_pdl_s27.txt" | grep -E "passed|failed|^FAILED|^E " | tail -8
fi
if [ "$what" = s27c ]; then  # the write rows (decode B = 1 / 8 / 64, prefill 8,192 / 65,536) with PDL off and on (~5 min)
  for p in 0 1; do DSV4_PDL=$p timeout 140 python3 benchmarks/bench_write.py --models v4-flash --modes decode,prefill \
    --out "$OUT/${stamp}_write_pdl${p}_s27.jsonl" 2>&1 | grep -v -i warn | tee "$OUT/${stamp}_write_pdl${p}_s27.txt" | cut -c1-150; done
fi
if [ "$what" = s27d ]; then  # the defaults after session 27's PDL decision (a layer's decode step in pdl_scope(True),
  # dispatch.PDL_DECODE; prefills without): the decode step with DSV4_PDL unset, then the PDL GPU tests (~3 min)
  timeout 240 python3 -m dsv4.cli bench --models v4-flash --kinds csa,hca --contexts 131072 --batches 1,64 \
    --out "$OUT/${stamp}_decode_pdl_decode_s27.jsonl" 2>&1 | tee "$OUT/${stamp}_decode_pdl_decode_s27.txt" | tail -6
  # the baseline on the same machine: PDL off on every kernel
  DSV4_PDL=0 timeout 200 python3 -m dsv4.cli bench --models v4-flash --kinds csa,hca --contexts 131072 --batches 1,64 \
    --out "$OUT/${stamp}_decode_pdl0_s27.jsonl" 2>&1 | tee "$OUT/${stamp}_decode_pdl0_s27.txt" | tail -6
  timeout 70 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_pdl.py 2>&1 \
    | tee "$OUT/${stamp}_gpu_tests_pdl_decode_s27.txt" | grep -E "passed|failed|^FAILED|^E " | tail -6
fi
if [ "$what" = s28a ]; then  # session 28 (~6 min): the fused attention kernel's dequantisation through fp32
  # (GLUON_FUSED_DEQUANT 0), with a prmt pack (1), with integer ops + bf16 multiplies (2): its GPU tests (every code
  # and scale byte exact, each form), then the decode shapes, graph + device time of each form
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_fused_attention.py 2>&1 \
    | tee "$OUT/${stamp}_gpu_tests_dequant_s28.txt" | grep -E "passed|failed|^FAILED|^E " | tail -8
  for c in "v4-pro 64" "v4-flash 64" "v4-pro 8"; do set -- $c
    timeout 100 python3 benchmarks/profile_attention.py --model $1 --batch $2 --variants gluon_fused \
      --fused DEQUANT=0,DEQUANT=1,DEQUANT=2 \
      2>&1 | tee -a "$OUT/${stamp}_profile_attention_dequant_s28.txt" | grep "^=="
  done
  timeout 100 python3 benchmarks/profile_attention.py --model v4-flash --batch 8 --context 8192 --hca \
    --variants gluon_fused --fused DEQUANT=0,DEQUANT=1,DEQUANT=2 2>&1 \
    | tee -a "$OUT/${stamp}_profile_attention_dequant_s28.txt" | grep "^=="
fi
if [ "$what" = s28b ]; then  # session 28 (~4 min): the fused kernel's seesaw consumers (GLUON_FUSED_SEESAW) against
  # the lockstep ones: the GPU tests (both schedules), then the decode shapes, graph + device time
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_fused_attention.py 2>&1 \
    | tee "$OUT/${stamp}_gpu_tests_seesaw_s28.txt" | grep -E "passed|failed|^FAILED|^E " | tail -12
  for c in "v4-pro 64" "v4-flash 64"; do set -- $c
    timeout 100 python3 benchmarks/profile_attention.py --model $1 --batch $2 --variants gluon_fused \
      --fused SEESAW=0,SEESAW=1,SEESAW=1+DEQUANT=2 2>&1 | tee -a "$OUT/${stamp}_profile_attention_seesaw_s28.txt" | grep "^=="
  done
  timeout 100 python3 benchmarks/profile_attention.py --model v4-flash --batch 8 --context 8192 --hca \
    --variants gluon_fused --fused SEESAW=0,SEESAW=1,SEESAW=1+DEQUANT=2 2>&1 \
    | tee -a "$OUT/${stamp}_profile_attention_seesaw_s28.txt" | grep "^=="
fi
if [ "$what" = s28c ]; then  # session 28 (~5 min): the seesaw consumers as the default: the model (cached vs dense),
  # engine and fused-kernel GPU tests, then the decode step
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model tests/engine \
    tests/kernels/test_gluon_fused_attention.py 2>&1 | tee "$OUT/${stamp}_gpu_tests_seesaw_default_s28.txt" \
    | grep -E "passed|failed|^FAILED|^E " | tail -8
  timeout 200 python3 -m dsv4.cli bench --models v4-flash --kinds csa,hca --contexts 131072 --batches 1,64 \
    --out "$OUT/${stamp}_decode_seesaw_s28.jsonl" 2>&1 | tee "$OUT/${stamp}_decode_seesaw_s28.txt" | tail -5
fi
if [ "$what" = s28d ]; then  # left for session 29 (~4 min): the pipelined seesaw (GLUON_FUSED_SEESAW=2: W = 0 issues
  # the next pair's QK under its wait for W = 1's probabilities; W = 1 at 192 registers, W = 0 at 224: 64-byte stack)
  # against the seesaw default: the fused-kernel GPU tests (all three schedules), then the decode shapes
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_fused_attention.py -k "reference" \
    2>&1 | tee "$OUT/${stamp}_gpu_tests_seesaw2_s28.txt" | grep -E "passed|failed|^FAILED|^E " | tail -12
  for c in "v4-pro 64" "v4-flash 64"; do set -- $c
    timeout 100 python3 benchmarks/profile_attention.py --model $1 --batch $2 --variants gluon_fused \
      --fused SEESAW=1,SEESAW=2,SEESAW=2+DEQUANT=2 2>&1 | tee -a "$OUT/${stamp}_profile_attention_seesaw2_s28.txt" \
      | grep "^=="
  done
  timeout 100 python3 benchmarks/profile_attention.py --model v4-flash --batch 8 --context 8192 --hca \
    --variants gluon_fused --fused SEESAW=1,SEESAW=2 2>&1 | tee -a "$OUT/${stamp}_profile_attention_seesaw2_s28.txt" \
    | grep "^=="
fi
if [ "$what" = s29a ]; then  # session 29 (~4 min): what bounds the fused attention kernel -- ablations (results not
  # checked): 1 no gather, 2 no dequantisation, 3 neither (consumers alone), 4 no MMAs (producers alone), 7 only the
  # barriers; the consumers alone at 64-key blocks (two stages; the raw rings are unused there)
  A=SEESAW=1,SEESAW=2,ABLATE=1,ABLATE=2,ABLATE=3,ABLATE=4,ABLATE=5,ABLATE=6,ABLATE=7
  A=$A,ABLATE=3+PRODUCER_REGS=24+WORKER_REGS=232,ABLATE=3+BLOCK_N=64+STAGES=2+PRODUCER_REGS=24+WORKER_REGS=232
  A=$A,ABLATE=7+BLOCK_N=64+STAGES=2
  timeout 280 python3 benchmarks/profile_attention.py --model v4-pro --batch 64 --variants gluon_fused --fused $A \
    2>&1 | tee -a "$OUT/${stamp}_profile_attention_ablate_s29.txt" | grep "^== .*graph"
  timeout 150 python3 benchmarks/profile_attention.py --model v4-flash --batch 64 --variants gluon_fused \
    --fused SEESAW=1,ABLATE=3,ABLATE=4,ABLATE=3+BLOCK_N=64+STAGES=2+PRODUCER_REGS=24+WORKER_REGS=232 2>&1 \
    | tee -a "$OUT/${stamp}_profile_attention_ablate_s29.txt" | grep "^== .*graph"
fi
if [ "$what" = s29b ]; then  # session 29 (~2 min): more ablations of the fused attention kernel: 8 idle consumers
  # (each stage freed once ready), 16 no index loads (keys 0, 1, ...): producers alone (12), their skeleton (15, 31),
  # the consumers' softmax + handoffs without index loads (23), at 32- and 64-key blocks
  A=SEESAW=1,ABLATE=12,ABLATE=28,ABLATE=15,ABLATE=31,ABLATE=7,ABLATE=23,ABLATE=23+BLOCK_N=64+STAGES=2
  timeout 200 python3 benchmarks/profile_attention.py --model v4-pro --batch 64 --variants gluon_fused --fused $A \
    2>&1 | tee -a "$OUT/${stamp}_profile_attention_ablate2_s29.txt" | grep "^== .*graph"
fi
if [ "$what" = s29c ]; then  # session 29 (~4 min): symmetric pairs (SEESAW=3: the two consumers exchange their
  # blocks' row maxima and compute their softmaxes at once, one rescale a pair; 4: W = 0 issues its next QK early)
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_fused_attention.py -k "reference" \
    2>&1 | tee "$OUT/${stamp}_gpu_tests_symmetric_s29.txt" | grep -E "passed|failed|^FAILED|^E " | tail -12
  for c in "v4-pro 64" "v4-flash 64" "v4-pro 8"; do set -- $c
    timeout 100 python3 benchmarks/profile_attention.py --model $1 --batch $2 --variants gluon_fused \
      --fused SEESAW=1,SEESAW=2,SEESAW=3,SEESAW=4 2>&1 | tee -a "$OUT/${stamp}_profile_attention_symmetric_s29.txt" \
      | grep "^== .*graph"
  done
  timeout 100 python3 benchmarks/profile_attention.py --model v4-flash --batch 8 --context 8192 --hca \
    --variants gluon_fused --fused SEESAW=1,SEESAW=3,SEESAW=4 2>&1 \
    | tee -a "$OUT/${stamp}_profile_attention_symmetric_s29.txt" | grep "^== .*graph"
fi
if [ "$what" = s29d ]; then  # session 29 (~4 min): where the seesaw (1) and symmetric (3) consumers wait: Nsight
  # Compute's per-instruction stall samples of the fused kernel, and the consumers alone (ablation 19: the producers
  # load and dequantise nothing) for both schedules
  for sch in 1 3; do
    DSV4_FUSED_KNOBS="SEESAW=$sch" timeout 200 /usr/local/cuda/bin/ncu -k regex:_sparse_attn_ws_kernel --launch-skip 1 \
      --launch-count 1 --section WarpStateStats --section SourceCounters --import-source no --page source \
      --print-source sass --csv python3 benchmarks/ncu_cases.py attention:gluon_fused \
      > "$OUT/ncu_source_fused_seesaw$sch.csv" 2> "$OUT/ncu_err$sch.txt"
    python3 benchmarks/ncu_source_summary.py "$OUT/ncu_source_fused_seesaw$sch.csv" --top 30 \
      | tee "$OUT/${stamp}_ncu_source_fused_seesaw${sch}_s29.txt" | head -12
    gzip -f "$OUT/ncu_source_fused_seesaw$sch.csv"
  done
  timeout 150 python3 benchmarks/profile_attention.py --model v4-pro --batch 64 --variants gluon_fused \
    --fused SEESAW=1,SEESAW=3,ABLATE=19,SEESAW=3+ABLATE=19 2>&1 \
    | tee -a "$OUT/${stamp}_profile_attention_symmetric2_s29.txt" | grep "^== .*graph"
fi
if [ "$what" = s29e ]; then  # session 29 (~5 min): the producers loading into registers (LOAD=1: no raw stages, room
  # for a fourth bf16 stage, which lets both symmetric consumers issue their next QK early: SEESAW=4 + STAGES=4):
  # the fused-kernel GPU tests over the schedules, then the decode shapes
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_fused_attention.py \
    -k "reference or every_code" 2>&1 | tee "$OUT/${stamp}_gpu_tests_load_s29.txt" | grep -E "passed|failed|^FAILED|^E " | tail -12
  F=SEESAW=1,SEESAW=3,LOAD=1+SEESAW=1,LOAD=1+SEESAW=3,LOAD=1+SEESAW=3+STAGES=4,LOAD=1+SEESAW=4+STAGES=4
  F=$F,LOAD=1+SEESAW=2+STAGES=4
  for c in "v4-pro 64" "v4-flash 64"; do set -- $c
    timeout 150 python3 benchmarks/profile_attention.py --model $1 --batch $2 --variants gluon_fused --fused $F 2>&1 \
      | tee -a "$OUT/${stamp}_profile_attention_load_s29.txt" | grep "^== .*graph"
  done
  timeout 100 python3 benchmarks/profile_attention.py --model v4-flash --batch 8 --context 8192 --hca \
    --variants gluon_fused --fused SEESAW=1,LOAD=1+SEESAW=3+STAGES=4,LOAD=1+SEESAW=4+STAGES=4 2>&1 \
    | tee -a "$OUT/${stamp}_profile_attention_load_s29.txt" | grep "^== .*graph"
fi
if [ "$what" = s29f ]; then  # session 29 (~3 min): symmetric pairs as the only consumer schedule (the seesaw, its
  # early-issue variants and the register-loading producers removed): the model (cached vs dense), engine and
  # fused-kernel GPU tests, then the decode shapes
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/model tests/engine \
    tests/kernels/test_gluon_fused_attention.py 2>&1 | tee "$OUT/${stamp}_gpu_tests_symmetric_default_s29.txt" \
    | grep -E "passed|failed|^FAILED|^E " | tail -8
  for c in "v4-pro 64" "v4-flash 64" "v4-pro 8"; do set -- $c
    timeout 60 python3 benchmarks/profile_attention.py --model $1 --batch $2 --variants gluon_fused 2>&1 \
      | tee -a "$OUT/${stamp}_profile_attention_symmetric_default_s29.txt" | grep "^== .*graph"
  done
  timeout 60 python3 benchmarks/profile_attention.py --model v4-flash --batch 8 --context 8192 --hca \
    --variants gluon_fused 2>&1 | tee -a "$OUT/${stamp}_profile_attention_symmetric_default_s29.txt" | grep "^== .*graph"
fi
if [ "$what" = s29g ]; then  # session 29 (~2 min): lazy rescaling (GLUON_FUSED_LAZY=8: the consumers move their
  # frame, and rescale, only in pairs where a row's max grew by more than 8 in log2 units): the fused-kernel GPU tests
  # (the default and LAZY=8), then the decode shapes; also W = 1 at 192 registers (W = 0 at 224: no spills in either
  # symmetric consumer's loop, sass_report --loops; the default 208 / 208 leaves W = 0 11 words a pair)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gluon_fused_attention.py -m gpu \
    2>&1 | tee "$OUT/${stamp}_gpu_tests_lazy_s29.txt" | grep -E "passed|failed|^FAILED|^E " | tail -8
  for c in "v4-pro 64" "v4-flash 64" "v4-pro 8"; do set -- $c
    timeout 60 python3 benchmarks/profile_attention.py --model $1 --batch $2 --variants gluon_fused \
      --fused LAZY=0,WORKER_REGS=192,LAZY=8 2>&1 | tee -a "$OUT/${stamp}_profile_attention_lazy_s29.txt" \
      | grep "^== .*graph"
  done
  timeout 60 python3 benchmarks/profile_attention.py --model v4-flash --batch 8 --context 8192 --hca \
    --variants gluon_fused --fused LAZY=0,LAZY=8 2>&1 | tee -a "$OUT/${stamp}_profile_attention_lazy_s29.txt" \
    | grep "^== .*graph"
fi
