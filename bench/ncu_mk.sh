#!/usr/bin/env bash
# One device call: Nsight Compute profile of one megakernel launch (after two warm-ups):
# speed of light, memory workload, warp states and per-SASS-line source counters.
#   bash bench/ncu_mk.sh NAME [bench/decode.py args]   -> $OUT/NAME_details.txt, $OUT/NAME_src.csv.gz
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mk_out}; mkdir -p "$OUT"
export PYTHONPATH=. TPMK_CACHE=/tmp/mkcache NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
name=$1; shift
timeout ${NCU_TIMEOUT:-300} ncu --kernel-name megakernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section WarpStateStats --section SourceCounters --section LaunchStats -o "$OUT/$name" \
  python3 bench/decode.py --no-baseline --iters 1 --out "$OUT/ncu_bench" "$@" 2>&1 | tail -3
ncu --import "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt"
ncu --import "$OUT/$name.ncu-rep" --page source --csv --print-source sass | gzip > "$OUT/${name}_src.csv.gz"
rm -f "$OUT/$name.ncu-rep"
grep -E "Throughput|Duration|Hit Rate|Busy|Bandwidth|Stall|Warp Cycles|Issued" "$OUT/${name}_details.txt" | head -40
