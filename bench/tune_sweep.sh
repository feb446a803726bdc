#!/usr/bin/env bash
# One device call of megakernel tuning: every argument is one variant, a space-separated
# list of NAME=VALUE macros ("" = the default build). All variants compile in parallel
# first (NVRTC, disk cache), then bench/decode.py times each on the GPU alone.
#   SWEEP_BENCH: bench/decode.py arguments (default: batch 1, ctx 1024, no baseline)
#   SWEEP_PROFILE=1: a per-instruction trace of each variant, summarized by bench/profile_stats.py
#   SWEEP_ENV=1: each argument is environment settings (NAME=VALUE ...) instead of macros, one
#     default build for all (for knobs the host code reads)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mk_out}; mkdir -p "$OUT"
export PYTHONPATH=. TPMK_CACHE=/tmp/mkcache NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
t0=$(date +%s)
builds=("$@"); [ -n "${SWEEP_ENV:-}" ] && builds=("")   # env variants share the default build
for v in "${builds[@]}"; do
  python3 -c "import sys, torch; from tpmk.kernels.megakernel import compile_megakernel as c
c(torch.bfloat16, defines=tuple(sys.argv[1:]))" $v &
done
wait
echo "== ${#builds[@]} builds for ${#@} variants in $(( $(date +%s) - t0 )) s"
i=0
for v in "$@"; do
  i=$((i + 1))
  echo "== variant $i: ${v:-default}"
  macros=$v; [ -n "${SWEEP_ENV:-}" ] && macros=""
  env ${SWEEP_ENV:+$v} timeout ${BENCH_TIMEOUT:-120} python3 bench/decode.py \
    ${SWEEP_BENCH:---batch 1 --ctx 1024 --no-baseline --iters 5} \
    ${macros:+--define $macros} ${SWEEP_PROFILE:+--profile "$OUT/trace_v$i.json"} --out "$OUT/sweep$i" 2>&1 | tail -n +3
done
for t in "$OUT"/trace*.json; do
  [ -f "$t" ] && echo "== $(basename "$t")" && python3 bench/profile_stats.py "$t" --starts | sed -n 1,24p
done
echo "== all done at $(( $(date +%s) - t0 )) s"
