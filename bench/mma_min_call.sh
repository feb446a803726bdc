#!/usr/bin/env bash
# One device call: the tensor-core threshold (isa.MMA_MIN_BATCH) at 2 against today's 5, and
# the attention trials (MK_ATTN_EARLY + MK_ATTN_SPREAD with --qkv-pairs 8) on top, then the
# GPU tests, memcheck and racecheck on that candidate default. Why (README, next experiments):
# batch 4 on the CUDA cores took 11.2-11.5 ms where batch 8 on the tensor cores took 9.9-10.2
# (H100, 2026-12-07). Then the qkv tile height at batch 1 with the attention trials, then the
# tests. ~420 s of run. Delete this script once the threshold is settled.
#   MM_TESTS=0: timings only (~210 s).
# The candidate tree is a copy with isa.MMA_MIN_BATCH edited and isa_generated.cuh
# regenerated (/tmp/m2); the host (shared memory, attention chunk) and the interpreter (the
# tests' bf16 rounding) follow the constant. "5" runs this tree as it is.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/mk_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
M=${MM_MIN:-2}
d=/tmp/m$M; rm -rf $d; mkdir -p $d; cp -r tpmk bench tests pyproject.toml $d/
sed -i "s/^MMA_MIN_BATCH = 5 /MMA_MIN_BATCH = $M /" $d/tpmk/kernels/isa.py
(cd $d && PYTHONPATH=. python3 -m tpmk.kernels.isa >/dev/null &&
  grep -q "MMA_MIN_BATCH = $M;" tpmk/kernels/csrc/isa_generated.cuh) || { echo "MMA_MIN_BATCH edit failed"; exit 2; }
ln -sfn "$PWD" /tmp/m5
ES="MK_ATTN_EARLY=1 MK_ATTN_SPREAD=1"
BUILD="import sys, torch; from tpmk.kernels.megakernel import compile_megakernel as c; c(torch.bfloat16, defines=tuple(sys.argv[1:]))"
for m in 5 $M; do for defs in "" "$ES"; do   # the timed builds, in parallel (disk caches)
  (cd /tmp/m$m && PYTHONPATH=. TPMK_CACHE=/tmp/c$m python3 -c "$BUILD" $defs) &
done; done
(cd $d && PYTHONPATH=. TPMK_CACHE=/tmp/mkcache TPMK_MK_DEFINES="$ES" python3 -c "
import torch; from tpmk.kernels.megakernel import compile_megakernel as c; c(torch.bfloat16); c(torch.float32)") &
wait; echo "== built at $(( $(date +%s) - t0 )) s"
for pass in 1 2; do for v in "5" "$M" "$M es"; do
  m=${v%% *}; a=""; [[ $v == *es ]] && a="--qkv-pairs 8 --define $ES"
  echo "== MMA_MIN_BATCH=$m ${a:+with the attention trials, 8 qkv pairs} (pass $pass)"
  (cd /tmp/m$m && PYTHONPATH=. TPMK_CACHE=/tmp/c$m timeout 100 python3 bench/decode.py --batch 1 2 3 4 8 32 128 \
     --ctx 1024 --no-baseline --iters 20 $a --out "$OUT/m${m}${a:+es}_$pass" 2>&1 | tail -n +3 | grep -v "^\s*$")
done; done
echo "== timed at $(( $(date +%s) - t0 )) s"
python3 bench/ab_table.py "$OUT"/m5_1 "$OUT"/m${M}_1 "$OUT"/m${M}es_1 "$OUT"/m5_2 "$OUT"/m${M}_2 "$OUT"/m${M}es_2
# qkv tile height at batch 1 with the attention trials (how the schedule should choose it:
# 70B rank, 10 heads of 64 rotary pairs, 32 splits; pairs P give 10 * ceil(64 / P) qkv tiles)
E="--define $ES"
SWEEP_ARGS=1 SWEEP_BENCH="--batch 1 --ctx 1024 --no-baseline --iters 20" OUT=$OUT/qkv bash bench/tune_sweep.sh \
  "" "$E" "--qkv-pairs 6 $E" "--qkv-pairs 8 $E" "--qkv-pairs 11 $E" "--qkv-pairs 16 $E" \
  "" "$E" "--qkv-pairs 6 $E" "--qkv-pairs 8 $E" "--qkv-pairs 11 $E" "--qkv-pairs 16 $E" 2>&1 | sed -n '/^== NVIDIA\|^== .*runs/,$p'
echo "== swept at $(( $(date +%s) - t0 )) s"
[ "${MM_TESTS:-1}" = 1 ] || exit 0
(cd $d && OUT=$OUT/tests TPMK_MK_DEFINES="$ES" TEST_SHARDS=8 \
  PYTEST_K="tiny_matches_interpreter or batched_tensor_core or engine_vs_reference or topk_matches or attention_long" \
  bash bench/gpu_mk_check.sh 2>&1 | grep -v "^\s*$" | tail -24)
echo "== all done at $(( $(date +%s) - t0 )) s"
