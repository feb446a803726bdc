#!/usr/bin/env bash
# One device call for the compiled-out trials (README, next experiments): MK_ATTN_EARLY with
# --qkv-pairs 7 / 8, MK_ATTN_SPREAD and MK_NORM_LATE at batch 1 / 8, MMA_SS_LATE at batch
# 32 / 128, then the GPU tests, memcheck and racecheck on MMA_SS_LATE + the attention trials,
# and on MK_NORM_LATE. ~360 s of run. Delete this script once the trials are settled.
#   TRIALS_TESTS=0: timings only.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=. TPMK_CACHE=/tmp/mkcache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mk_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
BUILD="import sys, torch; from tpmk.kernels.megakernel import compile_megakernel as c
c(getattr(torch, sys.argv[1]), defines=tuple(sys.argv[2:]))"
for d in "" MK_ATTN_SPREAD=1 "MK_ATTN_EARLY=1 MK_ATTN_SPREAD=1" MK_NORM_LATE=1 MMA_SS_LATE=1; do
  python3 -c "$BUILD" bfloat16 $d &   # the sweeps' builds, in parallel (disk cache)
done
wait
echo "== built in $(( $(date +%s) - t0 )) s"
ES="--define MK_ATTN_EARLY=1 MK_ATTN_SPREAD=1"
v=("" "--qkv-pairs 8" "--qkv-pairs 8 $ES" "--qkv-pairs 7 $ES" "--define MK_ATTN_SPREAD=1" "--define MK_NORM_LATE=1")
SWEEP_ARGS=1 SWEEP_BENCH="--batch 1 8 --ctx 1024 --no-baseline --iters 10" OUT=$OUT/small \
  bash bench/tune_sweep.sh "${v[@]}" "${v[@]}" 2>&1 | grep -v "^\s*$"
echo "== at $(( $(date +%s) - t0 )) s"
SWEEP_BENCH="--batch 32 128 --ctx 1024 --no-baseline --iters 10" OUT=$OUT/large \
  bash bench/tune_sweep.sh "" MMA_SS_LATE=1 "" MMA_SS_LATE=1 2>&1 | grep -v "^\s*$"
echo "== at $(( $(date +%s) - t0 )) s"
[ "${TRIALS_TESTS:-1}" = 1 ] || { echo "== all done at $(( $(date +%s) - t0 )) s"; exit 0; }
OUT=$OUT/tests TPMK_MK_DEFINES="MMA_SS_LATE=1 MK_ATTN_EARLY=1 MK_ATTN_SPREAD=1" TEST_SHARDS=8 \
  PYTEST_K="batched_tensor_core or attention or tiny_matches_interpreter" bash bench/gpu_mk_check.sh 2>&1 | tail -30
# MK_NORM_LATE rounds the normed inputs to bf16 at batch < MMA_MIN_BATCH too, which the
# interpreter does only at tensor-core batches (CPU: 2.6e-3 to 2.8e-3 of the largest logit, the
# batch-1 tolerance 2e-3): its batch-1 tests may fail on that tolerance; read their errors and
# tokens. The sanitizers check it as they do the others.
OUT=$OUT/norm_late TPMK_MK_DEFINES="MK_NORM_LATE=1" TEST_SHARDS=8 \
  PYTEST_K="tiny_matches_interpreter" bash bench/gpu_mk_check.sh 2>&1 | tail -24
echo "== all done at $(( $(date +%s) - t0 )) s"
