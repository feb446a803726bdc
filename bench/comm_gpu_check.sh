#!/usr/bin/env bash
# One device call for tpmk.comm: smoke, GPU tests, compute-sanitizer, latency bench.
# Usage (repo root, on the GPU machine): bash bench/comm_gpu_check.sh [tests|bench|all]
# Logs and bench JSON go to $OUT (default /tmp/comm_out).
set -u
cd "$(dirname "$0")/.."
what=${1:-all}
export PYTHONPATH=. TPMK_CACHE=$PWD/.cubin_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/comm_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, cuda.bindings; from tpmk.kernels.build import nvrtc_version; \
print('torch', torch.__version__, 'cuda-bindings', cuda.bindings.__version__, 'nvrtc', nvrtc_version())"
t0=$(date +%s)
stamp() { echo "== $1 at +$(( $(date +%s) - t0 )) s"; }

stamp smoke
timeout 45 python3 bench/comm.py --smoke 2>&1 | tail -20 | tee "$OUT/smoke.txt"
smoke_rc=${PIPESTATUS[0]}

if [[ $what == tests || $what == all ]]; then
  stamp pytest
  xflag=""; [[ $smoke_rc == 0 ]] || xflag="-x"   # smoke broken: first failure is enough
  timeout 150 python3 -m pytest -q -m gpu tests/test_comm.py tests/test_build.py $xflag \
      -p no:cacheprovider --timeout 60 2>&1 | tail -40 | tee "$OUT/pytest.txt"
fi
if [[ ($what == tests || $what == all) && $smoke_rc == 0 ]]; then
  stamp memcheck
  timeout 45 compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/comm.py --smoke \
      > "$OUT/memcheck_full.txt" 2>&1; echo "memcheck rc=$?"
  grep -v "Host Frame" "$OUT/memcheck_full.txt" | sort | uniq -c | sort -rn | head -30 | tee "$OUT/memcheck.txt"
  if [[ ${SYNCCHECK:-0} == 1 ]]; then   # passed 2026-12-03 (0 errors); opt-in to save device time
    stamp synccheck
    timeout 45 compute-sanitizer --tool synccheck --error-exitcode 9 python3 bench/comm.py --smoke \
        2>&1 | tail -15 | tee "$OUT/synccheck.txt"
  fi
fi
if [[ ($what == bench || $what == all) && $smoke_rc == 0 ]]; then
  stamp bench
  timeout 100 python3 bench/comm.py --out "$OUT" 2>&1 | tail -60 | tee "$OUT/bench.txt"
fi
stamp done
