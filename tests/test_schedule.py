"""Static properties of build_schedule that make the megakernel deadlock-free and exact:
counts match producers, waits refer to earlier stages, queues are in stage order."""
from collections import Counter

import pytest

from tpmk.config import ModelConfig
from tpmk.kernels.schedule import build_schedule

CASES = [("tiny", 1, 1, 3), ("tiny", 8, 4, 5), ("tiny-gqa", 4, 3, 7), ("llama-3.2-1b", 1, 8, 132),
         ("llama-3-70b", 8, 1, 132), ("llama-3-70b", 8, 128, 132)]


@pytest.mark.parametrize("reduce", ["oneshot", "rsag"])
@pytest.mark.parametrize("name,tp,bucket,sms", CASES)
def test_counts_match_producers(name, tp, bucket, sms, reduce):
    s = build_schedule(ModelConfig.from_name(name), tp, bucket, sms, reduce=reduce)
    # increments each rank's counters receive per step, from every rank that runs a producer
    arrivals = [Counter() for _ in range(tp)]
    for ins in s.instructions:
        if ins.signal < 0:
            continue
        for q in range(tp):
            if ins.runs_on(q, tp):
                for r in ins.signal_ranks(q, tp):
                    arrivals[r][ins.signal] += 1
    for ins in s.instructions:
        for r in range(tp):
            if not ins.runs_on(r, tp):
                continue
            for c, n in ins.waits:
                assert arrivals[r][c] == n, (f"{ins} on rank {r}: waits for {n} on "
                                             f"{s.counter_names[c]}, which receives "
                                             f"{arrivals[r][c]} per step")


@pytest.mark.parametrize("name,tp,bucket,sms", CASES)
def test_waits_point_backwards_and_queues_are_in_stage_order(name, tp, bucket, sms):
    s = build_schedule(ModelConfig.from_name(name), tp, bucket, sms)
    producer_stage = {}
    for ins in s.instructions:
        if ins.signal >= 0:
            producer_stage.setdefault(ins.signal, set()).add(ins.arg4)
    for ins in s.instructions:
        for c, _ in ins.waits:
            assert max(producer_stage[c]) < ins.arg4, f"{ins} waits on a later stage"
    for sm in range(s.num_sms):
        stages = [i.arg4 for i in s.queue(sm)]
        assert stages == sorted(stages), f"SM {sm} queue is not in stage order"
    assert len(s.stage_names) == 2 + 7 * ModelConfig.from_name(name).num_hidden_layers + 2


def test_queues_are_balanced():
    s = build_schedule(ModelConfig.from_name("llama-3-70b"), 8, 1, 132)
    lens = [len(s.queue(i)) for i in range(s.num_sms)]
    assert max(lens) - min(lens) <= 1
