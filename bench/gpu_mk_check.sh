#!/usr/bin/env bash
# One device call: build the megakernel, then the GPU tests and compute-sanitizer (in
# parallel: they are mostly CPU-bound), then the decode bench alone on the GPU.
#   PYTEST_K: pytest -k filter; PYTEST_TESTS: test names of tests/test_megakernel.py, in run order;
#   SAN_TOOLS: sanitizer tools ("" = none); BENCH, BENCH2, BENCH3, BENCH4: bench/decode.py arguments ("" = skip).
#   EXTRA_TESTS: more GPU test files/ids, run after the megakernel tests (e.g. tests/test_launcher.py).
#   TEST_SHARDS: pytest processes sharing the selected tests round-robin (default 4: the tests'
#   time is mostly the CPU interpreter, and the device machine has 16 cores).
#   TPMK_MK_DEFINES: kernel macros (NAME=VALUE ...) for every build here, tests, sanitizer and
#   bench alike: the whole check on a tuning variant (compile_megakernel reads it).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mk_out}; mkdir -p "$OUT"
export PYTHONPATH=. TPMK_CACHE=/tmp/mkcache NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
for dt in bfloat16 float32; do   # both builds the tests load, in parallel (disk cache)
  python3 -c "import torch; from tpmk.kernels.megakernel import compile_megakernel as c; c(torch.$dt)" &
done
wait
echo "== built in $(( $(date +%s) - t0 )) s"
TESTS=tests/test_megakernel.py
[ -n "${PYTEST_TESTS:-}" ] && TESTS=$(for t in $PYTEST_TESTS; do printf "tests/test_megakernel.py::%s " $t; done)
mapfile -t IDS < <(python3 -m pytest -q --collect-only -m gpu $TESTS ${PYTEST_K:+-k "$PYTEST_K"} 2>/dev/null | grep "::")
SHARDS=${TEST_SHARDS:-4}
echo "== ${#IDS[@]} GPU tests in $SHARDS processes"
for ((s = 0; s < SHARDS; s++)); do
  ids=(); for ((i = s; i < ${#IDS[@]}; i += SHARDS)); do ids+=("${IDS[$i]}"); done
  [ ${#ids[@]} -gt 0 ] && OMP_NUM_THREADS=$(( 16 / SHARDS > 1 ? 16 / SHARDS : 1 )) timeout ${TEST_TIMEOUT:-150} \
    python3 -m pytest -q -s -p no:cacheprovider --durations=5 "${ids[@]}" > "$OUT/pytest$s.log" 2>&1 &
done
for tool in ${SAN_TOOLS-memcheck racecheck}; do
  timeout ${TEST_TIMEOUT:-150} compute-sanitizer --tool $tool --report-api-errors no \
    python3 bench/mk_smoke.py 2>&1 | grep -v "Host Frame" | head -20 > "$OUT/san_$tool.log" &
done
wait
cat "$OUT"/pytest[0-9]*.log > "$OUT/pytest.log" 2>/dev/null
echo "== pytest"; grep -E "passed|failed|Error|error|assert|near-tie|rel (logit|err)|FAILED" "$OUT/pytest.log" | tail -40
for f in "$OUT"/pytest[0-9]*.log; do   # every shard's last line, whatever the tail above cut
  echo "== $(basename "$f"): $(tail -n 1 "$f")"
done
for tool in ${SAN_TOOLS-memcheck racecheck}; do echo "== compute-sanitizer $tool"; cat "$OUT/san_$tool.log"; done
if [ -n "${EXTRA_TESTS:-}" ]; then
  OMP_NUM_THREADS=8 timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -x -s -m gpu $EXTRA_TESTS > "$OUT/pytest_extra.log" 2>&1
  echo "== extra tests"; grep -E "passed|failed|Error|error|assert" "$OUT/pytest_extra.log" | tail -15
fi
echo "== tests done at $(( $(date +%s) - t0 )) s"
i=1
for args in "${BENCH:-}" "${BENCH2:-}" "${BENCH3:-}" "${BENCH4:-}"; do   # results: $OUT/bench1 ...
  [ -n "$args" ] && timeout ${BENCH_TIMEOUT:-200} python3 bench/decode.py $args --out "$OUT/bench$i" 2>&1 | tail -20
  i=$((i + 1))
done
for t in "$OUT"/trace*.json; do   # bench/decode.py --profile "$OUT/trace_<name>.json"
  [ -f "$t" ] && echo "== $(basename "$t")" && python3 bench/profile_stats.py "$t"
done
echo "== all done at $(( $(date +%s) - t0 )) s"
