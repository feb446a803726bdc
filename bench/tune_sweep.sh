#!/usr/bin/env bash
# One device call of megakernel tuning: every argument is one variant, a space-separated
# list of NAME=VALUE macros ("" = the default build). All variants compile in parallel
# first (NVRTC, disk cache), then bench/decode.py times each on the GPU alone.
#   SWEEP_BENCH: bench/decode.py arguments (default: batch 1, ctx 1024, no baseline)
#   SWEEP_PROFILE=1: a per-instruction trace of each variant, summarized by bench/profile_stats.py
#     (and each variant's critical path per op against variant 1's: --against)
#   SWEEP_ENV=1: each argument is environment settings (NAME=VALUE ...) instead of macros, one
#     default build for all (for knobs the host code reads)
#   SWEEP_ARGS=1: each argument is more bench/decode.py arguments (the schedule's knobs:
#     "--splits 8", "--qkv-pairs 16"), one default build for all
#   A variant "@REV" times another tree's default build in the same call (a baseline): before
#   the device call, `git archive REV tpmk bench -o ab_REV.tar` at the repository root
#   (untracked, so it travels with the working tree; delete it afterwards). "@REV NAME=VALUE ..."
#   times that tree with macros.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mk_out}; mkdir -p "$OUT"
export PYTHONPATH=. TPMK_CACHE=/tmp/mkcache NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
t0=$(date +%s)
BUILD="import sys, torch; from tpmk.kernels.megakernel import compile_megakernel as c
c(torch.bfloat16, defines=tuple(sys.argv[1:]))"
tree() { echo "/tmp/ab_${1#@}"; }   # where variant @REV's tree is unpacked
builds=()
shared=${SWEEP_ENV:-}${SWEEP_ARGS:-}   # non-empty: every variant runs the one default build
rev() { local r=${1%% *}; echo "${r#@}"; }   # "@REV NAME=VALUE ..." -> REV
revmacros() { [[ $1 == *" "* ]] && echo "${1#* }"; }   # ... -> its macros
for v in "$@"; do
  if [[ $v == @* ]]; then   # another tree: unpacked, built there with its own cache
    r=$(rev "$v"); d=$(tree "$r")
    [ -f "ab_$r.tar" ] || { echo "missing ab_$r.tar: git archive $r tpmk bench -o ab_$r.tar"; exit 2; }
    [ -d "$d" ] || { mkdir -p "$d" && tar -xf "ab_$r.tar" -C "$d"; }
    (cd "$d" && PYTHONPATH=. TPMK_CACHE=$d/cache python3 -c "$BUILD" $(revmacros "$v")) &
  elif [ -z "$shared" ]; then builds+=("$v")
  fi
done
[ -n "$shared" ] && builds=("")
for v in "${builds[@]}"; do python3 -c "$BUILD" $v & done
wait
echo "== ${#builds[@]} builds for ${#@} variants in $(( $(date +%s) - t0 )) s"
i=0
for v in "$@"; do
  i=$((i + 1))
  echo "== variant $i: ${v:-default}"
  macros=$v; envs=""; args=""; dir=.
  [ -n "${SWEEP_ENV:-}" ] && macros="" envs=$v
  [ -n "${SWEEP_ARGS:-}" ] && macros="" args=$v
  [[ $v == @* ]] && dir=$(tree "$(rev "$v")") && macros=$(revmacros "$v") envs="TPMK_CACHE=$dir/cache" args=""
  (cd "$dir" && env PYTHONPATH=. $envs timeout ${BENCH_TIMEOUT:-120} python3 bench/decode.py \
    ${SWEEP_BENCH:---batch 1 --ctx 1024 --no-baseline --iters 5} \
    $args ${macros:+--define $macros} ${SWEEP_PROFILE:+--profile "$OUT/trace_v$i.json"} --out "$OUT/sweep$i" 2>&1 | tail -n +3)
  # what the run's JSON cannot hold: the other tree (its label then also shows its macros), or
  # the environment
  if [[ $v == @* ]]; then python3 bench/ab_table.py --tag "${v%% *}" "$OUT/sweep$i"
  elif [ -n "${SWEEP_ENV:-}" ]; then python3 bench/ab_table.py --tag "${v:-default env}" "$OUT/sweep$i"
  fi
done
# every variant's mean over its passes against variant 1's
python3 bench/ab_table.py $(for ((j = 1; j <= i; j++)); do echo "$OUT/sweep$j"; done)
for t in "$OUT"/trace*.json; do
  [ -f "$t" ] && echo "== $(basename "$t")" && python3 bench/profile_stats.py "$t" --starts | sed -n 1,24p
done
for t in "$OUT"/trace_v[2-9]*.json; do   # every other variant against variant 1, op by op
  [ -f "$t" ] && echo "== $(basename "$t") against trace_v1.json" &&
    python3 bench/profile_stats.py "$OUT/trace_v1.json" --against "$t" | sed -n '/B - A/,$p'
done
echo "== all done at $(( $(date +%s) - t0 )) s"
