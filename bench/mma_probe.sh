#!/usr/bin/env bash
# bench/mma_probe.cu in one device call: every argument is one build's nvcc flags (e.g.
# "-DPROBE_NT=16" "-DPROBE_NT=16 -DMMA_MT=1"); all builds compile in parallel, then each runs
# alone on the GPU. PROBE_LAYERS: layers per run (default 12); PROBE_GREP: an egrep filter on
# the printed rows (default: all).
set -u
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- ""
i=0
for flags in "$@"; do
  i=$((i + 1))
  nvcc -O3 -gencode arch=compute_90a,code=sm_90a $flags -o "/tmp/mma_probe_$i" bench/mma_probe.cu &
done
wait
i=0
for flags in "$@"; do
  i=$((i + 1))
  echo "== build $i: ${flags:-default}"
  timeout 120 "/tmp/mma_probe_$i" "${PROBE_LAYERS:-12}" | grep -E "${PROBE_GREP:-.}"
done
