#!/usr/bin/env bash
# One device call: megakernel correctness tests, then compute-sanitizer on tiny.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=. TPMK_CACHE=${OUT:-/tmp}/mkcache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -q -x -s tests/test_megakernel.py ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -40
for tool in ${SAN_TOOLS-memcheck racecheck}; do
  echo "== compute-sanitizer $tool"
  timeout 120 compute-sanitizer --tool $tool --report-api-errors no python3 bench/mk_smoke.py 2>&1 | grep -v "Host Frame" | head -20
done
if [ -n "${BENCH:-}" ]; then
  echo "== bench"
  timeout ${BENCH_TIMEOUT:-200} python3 bench/decode.py $BENCH --out ${OUT:-/tmp}/results 2>&1 | tail -20
fi
