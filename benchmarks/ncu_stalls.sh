#!/usr/bin/env bash
# Nsight Compute on the H200: launch statistics, occupancy, issue rate and the per-reason warp stall ratios
# (cycles a warp spends stalled on each reason per instruction issued) of three kernels: the indexer scores
# (1M, B = 4), the CSA indexer emit (prefill 65,536) and the fused HCA decode step (B = 64).  Full reports go to
# $OUT/ncu_<kernel>.txt; the headline lines and the largest stall reasons are printed.
# Usage (device machine, repo root): OUT=out bash benchmarks/ncu_stalls.sh      (~1 min)
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
secs="--section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats"
met="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
for c in "indexer:fp8l2|_mxfp4_scores|2" "write:csa_indexer:prefill:65536|_emit_indexer_dot|1" "write:hca:decode:64|_compressor_decode_emit_main|1"; do
  IFS='|' read -r case kern skip <<< "$c"
  f="$OUT/ncu_${kern}.txt"
  timeout 170 /usr/local/cuda/bin/ncu -k "regex:$kern" --launch-skip $skip --launch-count 1 $secs $met python3 benchmarks/ncu_cases.py "$case" > "$f" 2>&1
  echo "=== $case"; grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Warp Per|Warp Cycles Per Issued|Eligible Warps|Waves Per SM" "$f" | head -12
  grep -E "stalled_" "$f" | awk '{print $1, $NF}' | sort -k2 -g -r | head -9
done
