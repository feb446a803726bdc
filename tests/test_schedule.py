"""Static properties of build_schedule that make the megakernel deadlock-free and exact:
counts match producers, waits refer to earlier stages, queues are in stage order."""
from collections import Counter

import pytest

from tpmk.config import ModelConfig
from tpmk.kernels.schedule import build_schedule

CASES = [("tiny", 1, 1, 3), ("tiny", 8, 4, 5), ("tiny-gqa", 4, 3, 7), ("llama-3.2-1b", 1, 8, 132),
         ("llama-3-70b", 8, 1, 132), ("llama-3-70b", 8, 128, 132)]


@pytest.mark.parametrize("name,tp,bucket,sms", CASES)
def test_counts_match_producers(name, tp, bucket, sms):
    s = build_schedule(ModelConfig.from_name(name), tp, bucket, sms)
    # increments one rank's counter receives per step: local signals once, peer signals from every rank
    arrivals = Counter()
    for ins in s.instructions:
        if ins.signal >= 0:
            arrivals[ins.signal] += tp if ins.signal_peers else 1
    for ins in s.instructions:
        for c, n in ins.waits:
            assert arrivals[c] == n, (f"{ins}: waits for {n} on {s.counter_names[c]}, "
                                      f"which receives {arrivals[c]} per step")


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
