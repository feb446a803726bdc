"""bench/ab_table.py on handmade decode.py results whose means are worked out by hand."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from ab_table import label, load, table  # noqa: E402

CARD = "NVIDIA H100 80GB HBM3"


def run(folder: Path, ms: dict, device: str = CARD, **fields) -> Path:
    """One bench/decode.py --out folder: rows {(batch, ctx): ms}."""
    folder.mkdir(parents=True)
    res = dict(device=device, defines=[], splits=0, qkv_pairs=0, gu_splits=1, mma_min_batch=5,
               rows=[dict(batch=b, ctx=c, mk_ms=t) for (b, c), t in ms.items()])
    res.update(fields)
    (folder / f"decode_{device.replace(' ', '_')}.json").write_text(json.dumps(res))
    return folder


def test_labels_name_what_varied():
    base = dict(defines=[], splits=0, qkv_pairs=0, gu_splits=1)
    assert label(base) == "default"
    assert label(dict(base, mma_min_batch=2)) == "MMA_MIN_BATCH=2"
    assert label(dict(base, defines=["MK_ATTN_EARLY=1", "MK_ATTN_SPREAD=1"], qkv_pairs=8, gu_splits=2)) == \
        "MK_ATTN_EARLY=1 MK_ATTN_SPREAD=1 --qkv-pairs 8 --gu-splits 2"
    assert label(dict(base, splits=64, bucket=128)) == "--splits 64 --bucket 128"


def test_passes_grouped_and_compared_to_the_first_variant(tmp_path):
    # Two passes of the baseline (threshold 5) and of threshold 2; batch 4: 11.0 and 11.4
    # (mean 11.2) against 9.8 and 10.0 (mean 9.9): -11.6 %; batch 1 only in the baseline's
    # first pass and the variant's second: 9.0 against 9.18, +2.0 %.
    folders = [run(tmp_path / "m5_1", {(1, 1024): 9.0, (4, 1024): 11.0}),
               run(tmp_path / "m2_1", {(4, 1024): 9.8}, mma_min_batch=2),
               run(tmp_path / "m5_2", {(4, 1024): 11.4}),
               run(tmp_path / "m2_2", {(1, 1024): 9.18, (4, 1024): 10.0}, mma_min_batch=2)]
    labels, times = table(load(folders))
    assert labels == ["MMA_MIN_BATCH=5", "MMA_MIN_BATCH=2"]
    assert times[(4, 1024)] == {"MMA_MIN_BATCH=5": [11.0, 11.4], "MMA_MIN_BATCH=2": [9.8, 10.0]}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "ab_table.py"), *map(str, folders)],
                         capture_output=True, text=True, check=True).stdout
    lines = {ln.split("|")[0].split()[0]: ln for ln in out.splitlines() if "|" in ln}
    assert "v1  11.200 [11.00-11.40]" in lines["4"] and "v2   9.900 [9.80-10.00] -11.6%" in lines["4"]
    assert "v1   9.000 [9.00-9.00]" in lines["1"] and "v2   9.180 [9.18-9.18]  +2.0%" in lines["1"]
    assert f"== {CARD}: 4 runs" in out


def test_runs_of_two_cards_are_refused(tmp_path):
    a = run(tmp_path / "a", {(1, 1024): 9.0})
    b = run(tmp_path / "b", {(1, 1024): 7.6}, device="NVIDIA H200")
    with pytest.raises(SystemExit, match="different cards"):
        load([a, b])


def test_runs_of_two_shapes_are_refused(tmp_path):
    """Two models (or tp, layers, page sizes) are not two variants of one step: not averaged."""
    a = run(tmp_path / "a", {(1, 1024): 9.0}, model="llama-3-70b", tp=8, layers=80)
    b = run(tmp_path / "b", {(1, 1024): 30.0}, model="llama-3.1-8b", tp=1, layers=32)
    with pytest.raises(SystemExit, match="different shapes"):
        load([a, b])
    c = run(tmp_path / "c", {(1, 1024): 9.2}, model="llama-3-70b", tp=8, layers=80, page_size=16)
    assert len(load([a, c])) == 2   # an older run without page_size ran the default 16
    d = run(tmp_path / "d", {(1, 1024): 9.2}, model="llama-3-70b", tp=8, layers=80, page_size=32)
    with pytest.raises(SystemExit, match="different shapes"):
        load([a, d])


def test_empty_passes_left_out_and_no_runs_refused(tmp_path):
    a = run(tmp_path / "a", {(1, 1024): 9.0})
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no decode_"):
        load([tmp_path / "empty", tmp_path / "does_not_exist"])
    assert [r["rows"][0]["mk_ms"] for r in load([tmp_path / "empty", a])] == [9.0]   # a timed-out pass


def test_tags_name_what_a_run_cannot_record(tmp_path):
    """--tag marks an @REV tree's (or an environment's) runs, so they group apart from the
    same-looking runs of this tree."""
    head = run(tmp_path / "head", {(1, 1024): 9.0}, mma_min_batch=2)
    old = run(tmp_path / "old", {(1, 1024): 9.5}, mma_min_batch=2)
    subprocess.run([sys.executable, str(ROOT / "bench" / "ab_table.py"), "--tag", "@abc1234", str(old),
                    str(tmp_path / "timed_out")], check=True)
    labels, times = table(load([old, head]))
    assert labels == ["@abc1234 MMA_MIN_BATCH=2", "MMA_MIN_BATCH=2"]
    assert times[(1, 1024)] == {"@abc1234 MMA_MIN_BATCH=2": [9.5], "MMA_MIN_BATCH=2": [9.0]}
