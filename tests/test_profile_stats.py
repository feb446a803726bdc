"""bench/profile_stats.py on a handmade two-SM trace whose figures are worked out by hand."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from profile_stats import compare, detail, starts, stats  # noqa: E402

# SM 0: qkv [0, 10), attention [12, 20); SM 1: qkv [1, 6), attention [7, 10); rank 1's
# events (pid 1) must not count.
EVENTS = [
    dict(name="qkv L0 t0", pid=0, tid=0, ts=0.0, dur=10.0, args=dict(stage=0)),
    dict(name="qkv L0 t1", pid=0, tid=1, ts=1.0, dur=5.0, args=dict(stage=0)),
    dict(name="attention L0 t0", pid=0, tid=0, ts=12.0, dur=8.0, args=dict(stage=1)),
    dict(name="attention L0 t1", pid=0, tid=1, ts=7.0, dur=3.0, args=dict(stage=1)),
    dict(name="attention L0 t0", pid=1, tid=0, ts=50.0, dur=100.0, args=dict(stage=1)),
]


def test_per_op_critical_path_and_gaps():
    rows, total = stats(EVENTS)
    assert total == 20.0                       # first start 0 to last end 20
    by = {r["op"]: r for r in rows}
    q, a = by["qkv"], by["attention"]
    assert (q["per_stage"], q["mean_us"], q["max_us"]) == (2, 7.5, 10.0)
    assert (a["per_stage"], a["mean_us"], a["max_us"]) == (2, 5.5, 8.0)
    assert q["crit_us_per_stage"] == 10.0      # 0 -> qkv's last end 10
    assert a["crit_us_per_stage"] == 10.0      # 10 -> attention's last end 20
    assert a["crit_frac"] == 0.5
    assert a["mean_gap_us"] == 1.5             # SM 0: 12 - 10, SM 1: 7 - 6
    assert q["mean_gap_us"] == 0.0             # nothing before it on either SM


def test_starts_after_previous_stage_end():
    # qkv is the first stage (nothing before it: not listed); attention after qkv's last end
    # 10: starts 12 - 10 = 2 and 7 - 10 = -3 (median of two: the upper, 2), ends 10 and 0.
    (a,) = starts(EVENTS)
    assert (a["op"], a["n"], a["start_us"], a["end_us"], a["last_end_us"]) == ("attention", 2, 2.0, 10.0, 10.0)


def test_detail_ranks_by_end():
    # attention after qkv's last end 10: SM 1's (7 - 10, 10 - 10) ends first, SM 0's (2, 10).
    assert detail(EVENTS, "attention") == [(-3.0, 0.0), (2.0, 10.0)]
    assert detail(EVENTS, "qkv") == []         # the first stage has no previous end


def test_cli_reads_gzip_and_top(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_stats.py"), str(path), "--top", "1"],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[0] == "step span 20.0 us (rank 0)"
    assert len(out) == 3 and out[2].split()[0] in ("qkv", "attention")


def test_compare_two_traces_per_op():
    # B: qkv ends at 6 instead of 10 (crit 6), attention then runs [8, 20) on SM 0 and
    # [7, 9) on SM 1: its crit is 20 - 6 = 14. A's are 10 and 10 (above); spans 20 and 20.
    b = [dict(e, dur=5.0) if e["name"] == "qkv L0 t0" else e for e in EVENTS]
    b = [dict(e, ts=8.0, dur=12.0) if e["name"] == "attention L0 t0" and e["pid"] == 0 else e for e in b]
    b = [dict(e, dur=2.0) if e["name"] == "attention L0 t1" else e for e in b]
    rows = compare(EVENTS, b)
    assert rows[0] == dict(op="step", a_us=20.0, b_us=20.0, delta_us=0.0)
    assert rows[1:] == [dict(op="attention", a_us=10.0, b_us=14.0, delta_us=4.0),
                        dict(op="qkv", a_us=10.0, b_us=6.0, delta_us=-4.0)]
    # an op in one trace only counts 0 in the other
    only = compare(EVENTS, [e for e in EVENTS if e["name"].startswith("qkv")])
    assert dict(op="attention", a_us=10.0, b_us=0.0, delta_us=-10.0) in only


def test_cli_against(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"traceEvents": EVENTS}))
    b.write_text(json.dumps({"traceEvents": [dict(e, dur=5.0) if e["name"] == "qkv L0 t0" else e for e in EVENTS]}))
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_stats.py"), str(a), "--against", str(b)],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line.split()[:3] == ["op", "A", "us"])
    assert out[at + 1].split() == ["step", "20.00", "20.00", "+0.00"]
    assert {tuple(line.split()) for line in out[at + 2:]} == {("qkv", "10.00", "6.00", "-4.00"),
                                                                ("attention", "10.00", "14.00", "+4.00")}
