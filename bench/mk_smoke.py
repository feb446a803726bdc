"""Tiny megakernel run for compute-sanitizer (memcheck / racecheck): tp=2, 3 steps of batch 2
(CUDA-core matvec), 2 of batch 6 (tensor-core matvec),
then the reduce-scatter + all-gather schedule at batch 2 and 6, then 300-token contexts
(3 attention chunks) at batch 2 and 70 (a 16-n-tile tensor-core pass), then gate_up split over
K in 4 slices (the MK_GU_SPLIT build, ACT) at batch 2 and 6."""
import sys

import torch

sys.path.insert(0, "tests")
from _mk_helpers import empty_caches, shards_for  # noqa: E402
from tpmk.config import ModelConfig  # noqa: E402
from tpmk.kernels.megakernel import Megakernel  # noqa: E402
from tpmk.kernels.schedule import build_schedule  # noqa: E402

cfg = ModelConfig.from_name("tiny-gqa").replace(dtype="bfloat16")
tp = 2
_, shards = shards_for(cfg, tp, dtype=torch.bfloat16)
sched = build_schedule(cfg, tp, 8, 4)
kc, vc = empty_caches(cfg, tp, 16, 16, dtype=torch.bfloat16)
mk = Megakernel(cfg, sched, [s.to("cuda") for s in shards], [k.cuda() for k in kc],
                [v.cuda() for v in vc], timeout_s=60.0)
for pos, toks in enumerate([[5, 6], [7, 8], [9, 10]]):
    out = mk.step(toks, [pos, pos], [[0, 1], [2, 3]])
for pos in range(2):
    out = mk.step(list(range(20, 26)), [pos] * 6, [[2 * b + 4, 2 * b + 5] for b in range(6)])
# Reduce-scatter + all-gather schedule on the same caches: batch 2, then batch 6.
rs = Megakernel(cfg, build_schedule(cfg, tp, 8, 4, reduce="rsag"), [s.to("cuda") for s in shards],
                [k.cuda() for k in kc], [v.cuda() for v in vc], timeout_s=60.0)
rs.step([5, 6], [0, 0], [[0, 1], [2, 3]])
rs_out = rs.step(list(range(20, 26)), [0] * 6, [[2 * b + 4, 2 * b + 5] for b in range(6)])
# Long contexts: 19 pages of 16 tokens per sequence, each sequence its own pages.
kc, vc = empty_caches(cfg, tp, 72 * 19, 16, dtype=torch.bfloat16)
long = Megakernel(cfg, build_schedule(cfg, tp, 72, 4), [s.to("cuda") for s in shards],
                  [k.cuda() for k in kc], [v.cuda() for v in vc], timeout_s=60.0)
pages = [list(range(19 * b, 19 * (b + 1))) for b in range(72)]
long.step([5, 6], [299, 299], pages[:2])
long_out = long.step(list(range(30, 100)), [299] * 70, pages[:70])
# gate_up in 4 K slices: partials after act, ACT summing them (its own build, MK_GU_SPLIT).
kc, vc = empty_caches(cfg, tp, 16, 16, dtype=torch.bfloat16)
split = Megakernel(cfg, build_schedule(cfg, tp, 8, 4, gu_splits=4), [s.to("cuda") for s in shards],
                   [k.cuda() for k in kc], [v.cuda() for v in vc], timeout_s=60.0)
split.step([5, 6], [0, 0], [[0, 1], [2, 3]])
split_out = split.step(list(range(20, 26)), [1] * 6, [[2 * b + 4, 2 * b + 5] for b in range(6)])
print("smoke ok", out.tolist(), "rsag", rs_out.tolist(), "long", long_out[:4].tolist(),
      "gate_up split", split_out.tolist())
