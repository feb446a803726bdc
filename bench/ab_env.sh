#!/usr/bin/env bash
# usage: ab.sh "ENV=.. ENV2=.." "..." ; SWEEP_BENCH args
export PYTHONPATH=. TPMK_CACHE=/tmp/mkcache NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/o}; mkdir -p $OUT
python3 -c "import torch; from tpmk.kernels.megakernel import compile_megakernel as c; c(torch.bfloat16)"
i=0
for v in "$@"; do i=$((i+1)); echo "== $i: ${v:-default}"
  env $v timeout 150 python3 bench/decode.py ${SWEEP_BENCH:---batch 1 --ctx 1024 --no-baseline --iters 5} --out $OUT/ab$i 2>&1 | grep -v "^\s*$" | tail -n 6
done
