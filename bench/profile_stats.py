"""Summarise a megakernel Chrome trace (`--profile`): where a decode step's time goes.

For each op (qkv, attention, ...) over all layers of rank 0: instructions per layer,
mean / max instruction time, and the mean critical-path share: the time from the
previous stage's last instruction end to this stage's last end (what the stage adds
to the step when stages run back to back). Also the mean gap before an instruction
on its SM (instruction fetch + counter wait). --starts: per op, the medians over its
stages' instructions of start and end, in us after the previous stage's last end (with a
-DMK_PROF_MARK=N build, "start" is probe point N). --detail OP: OP's instructions of a stage
ranked by end, each rank's median start and end over the stages (where the stragglers are).
--against B: per op, the critical-path us per stage of this trace and of trace B and B minus
this (an A/B of two builds, e.g. bench/tune_sweep.sh's SWEEP_PROFILE traces).

  python bench/profile_stats.py trace.json [--top N] [--starts] [--detail OP] [--against B]
"""
from __future__ import annotations

import argparse
import gzip
import json
import signal
from collections import defaultdict


def stats(events: list[dict], pid: int = 0) -> list[dict]:
    ev = [e for e in events if e.get("pid", 0) == pid]
    stages: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for e in ev:   # key: (op, stage number in program order)
        stages[(e["name"].split()[0], e["args"]["stage"])].append(e)
    order = sorted(stages, key=lambda k: k[1])
    per_op: dict[str, dict] = {}
    prev_end = min(e["ts"] for e in ev)
    for key in order:
        es = stages[key]
        end = max(e["ts"] + e["dur"] for e in es)
        s = per_op.setdefault(key[0], dict(op=key[0], stages=0, n=0, dur=0.0, dmax=0.0, crit=0.0))
        s["stages"] += 1
        s["n"] += len(es)
        s["dur"] += sum(e["dur"] for e in es)
        s["dmax"] = max(s["dmax"], max(e["dur"] for e in es))
        s["crit"] += end - prev_end
        prev_end = end
    by_sm: dict[int, list[dict]] = defaultdict(list)
    for e in ev:
        by_sm[e["tid"]].append(e)
    gaps: dict[str, list[float]] = defaultdict(list)
    for q in by_sm.values():
        q.sort(key=lambda e: e["ts"])
        for a, b in zip(q, q[1:]):
            gaps[b["name"].split()[0]].append(b["ts"] - a["ts"] - a["dur"])
    total = prev_end - min(e["ts"] for e in ev)
    rows = []
    for s in per_op.values():
        g = gaps.get(s["op"], [0.0])
        rows.append(dict(op=s["op"], per_stage=s["n"] / s["stages"], mean_us=s["dur"] / s["n"],
                         max_us=s["dmax"], crit_us_per_stage=s["crit"] / s["stages"],
                         crit_total_us=s["crit"], crit_frac=s["crit"] / total,
                         mean_gap_us=sum(g) / len(g)))
    rows.sort(key=lambda r: -r["crit_total_us"])
    return rows, total


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def _after_previous_stage(events: list[dict], pid: int):
    """Rank `pid`'s stages in program order after the first: (the stage's op, its instructions'
    (start, end) in us after the previous stage's last end)."""
    stages: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("pid", 0) == pid:
            stages[e["args"]["stage"]].append(e)
    prev_end = None
    for k in sorted(stages):
        es = stages[k]
        if prev_end is not None:
            yield es[0]["name"].split()[0], [(e["ts"] - prev_end, e["ts"] + e["dur"] - prev_end) for e in es]
        prev_end = max(e["ts"] + e["dur"] for e in es)


def starts(events: list[dict], pid: int = 0) -> list[dict]:
    per_op: dict[str, dict] = {}
    for op, se in _after_previous_stage(events, pid):
        s = per_op.setdefault(op, dict(start=[], end=[]))
        s["start"] += [st for st, _ in se]
        s["end"] += [en for _, en in se]
    return [dict(op=op, n=len(s["start"]), start_us=_median(s["start"]), end_us=_median(s["end"]),
                 last_end_us=max(s["end"])) for op, s in per_op.items()]


def detail(events: list[dict], op: str, pid: int = 0) -> list[tuple[float, float]]:
    """(median start, median end) of the k-th instruction of OP's stages ranked by end."""
    ranked = [sorted(se, key=lambda x: x[1]) for o, se in _after_previous_stage(events, pid) if o == op]
    n = min((len(r) for r in ranked), default=0)
    return [(_median([r[i][0] for r in ranked]), _median([r[i][1] for r in ranked])) for i in range(n)]


def compare(events_a: list[dict], events_b: list[dict], pid: int = 0) -> list[dict]:
    """Per op of either trace: critical-path us per stage in A and in B, and B - A (an op
    missing from one trace counts 0 there), largest change first; plus a row "step" for
    the two step spans."""
    (ra, ta), (rb, tb) = stats(events_a, pid), stats(events_b, pid)
    a = {r["op"]: r["crit_us_per_stage"] for r in ra}
    b = {r["op"]: r["crit_us_per_stage"] for r in rb}
    rows = [dict(op=op, a_us=a.get(op, 0.0), b_us=b.get(op, 0.0), delta_us=b.get(op, 0.0) - a.get(op, 0.0))
            for op in {*a, *b}]
    rows.sort(key=lambda r: (-abs(r["delta_us"]), r["op"]))
    return [dict(op="step", a_us=ta, b_us=tb, delta_us=tb - ta), *rows]


def _load(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)["traceEvents"]


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)   # `| head` ends the listing quietly
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", help="Chrome trace from --profile (.json, or .json.gz)")
    ap.add_argument("--top", type=int, default=0, help="print only the N ops longest on the critical path")
    ap.add_argument("--starts", action="store_true",
                    help="also: median start / end per op after the previous stage's last end")
    ap.add_argument("--detail", metavar="OP", help="also: OP's instructions ranked by end (medians over stages)")
    ap.add_argument("--against", metavar="B", help="also: per op, critical-path us per stage here and in trace B")
    args = ap.parse_args()
    events = _load(args.trace)
    rows, total = stats(events)
    rows = rows[:args.top] if args.top > 0 else rows
    print(f"step span {total:.1f} us (rank 0)")
    print(f"{'op':>10} {'tiles':>6} {'mean us':>8} {'max us':>7} {'crit us/stage':>13} {'crit %':>6} {'gap us':>7}")
    for r in rows:
        print(f"{r['op']:>10} {r['per_stage']:6.0f} {r['mean_us']:8.2f} {r['max_us']:7.2f} "
              f"{r['crit_us_per_stage']:13.2f} {100 * r['crit_frac']:6.1f} {r['mean_gap_us']:7.2f}")
    if args.starts:
        print(f"{'op':>10} {'n':>6} {'start us':>8} {'end us':>7} {'last end':>8}   (medians after the previous stage's last end)")
        for r in starts(events):
            print(f"{r['op']:>10} {r['n']:6d} {r['start_us']:8.2f} {r['end_us']:7.2f} {r['last_end_us']:8.2f}")
    if args.detail:
        print(f"{args.detail}: rank by end, median start / end us after the previous stage's last end")
        for i, (st, en) in enumerate(detail(events, args.detail)):
            print(f"{i:>4} {st:8.2f} {en:8.2f}")
    if args.against:
        print(f"{'op':>10} {'A us':>8} {'B us':>8} {'B - A':>8}   (critical path per stage; step: the spans; B = {args.against})")
        for r in compare(events, _load(args.against)):
            print(f"{r['op']:>10} {r['a_us']:8.2f} {r['b_us']:8.2f} {r['delta_us']:+8.2f}")


if __name__ == "__main__":
    main()
