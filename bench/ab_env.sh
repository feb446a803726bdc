#!/usr/bin/env bash
# One device call of A/Bs that differ in environment variables rather than -D macros
# (bench/tune_sweep.sh): every argument is one variant, a space-separated list of
# NAME=VALUE settings ("" = the default). The default bf16 build is compiled once, then
# bench/decode.py times each variant on the GPU alone.
#   SWEEP_BENCH: bench/decode.py arguments (default: batch 1, ctx 1024, no baseline)
# Example (the knobs of 356dbd9, re-applied with `git revert 3da79e0`):
#   SWEEP_BENCH="--batch 1 --ctx 1024 4096 --no-baseline --iters 8" \
#     bench/ab_env.sh "TPMK_SMEM_FULL=1" "" "TPMK_ATTN_CHUNK=32" "TPMK_SMEM_FULL=1"
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=. TPMK_CACHE=/tmp/mkcache NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mk_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch; from tpmk.kernels.megakernel import compile_megakernel as c; c(torch.bfloat16)"
i=0
for v in "$@"; do
  i=$((i + 1))
  echo "== variant $i: ${v:-default}"
  env $v timeout ${BENCH_TIMEOUT:-150} python3 bench/decode.py \
    ${SWEEP_BENCH:---batch 1 --ctx 1024 --no-baseline --iters 5} --out "$OUT/ab$i" 2>&1 | grep -v "^\s*$" | tail -n 6
done
