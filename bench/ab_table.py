"""Compare bench/decode.py runs: the mean step time per variant over repeated passes.

Reads every decode_*.json under the given folders (bench/tune_sweep.sh's sweepN, or the
passes of one device call, each to its own --out), groups the runs by what they built and
scheduled (the tensor-core threshold, the macros, --splits, --qkv-pairs, --gu-splits), and
prints one line per (batch, ctx): each variant's mean ms over its passes, with the range in
brackets, and its change against the first variant met (the baseline: pass it first). Runs on
different cards are refused: their times do not compare.

  python bench/ab_table.py OUT/m5_1 OUT/m2_1 OUT/m5_2 OUT/m2_2
  python bench/ab_table.py --tag "@a1b2c3d" OUT/sweep1   # name what a run cannot record itself

A tag (bench/tune_sweep.sh writes one for an @REV tree or a SWEEP_ENV environment, which a
run's JSON does not hold) leads its runs' label.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def label(run: dict) -> str:
    """What a run varied, in a stable order; the defaults print as "default"."""
    parts = [run["tag"]] if run.get("tag") else []
    if "mma_min_batch" in run:
        parts.append(f"MMA_MIN_BATCH={run['mma_min_batch']}")
    parts += list(run.get("defines") or [])
    for key, flag in (("splits", "--splits"), ("qkv_pairs", "--qkv-pairs")):
        if run.get(key):
            parts.append(f"{flag} {run[key]}")
    if run.get("gu_splits", 1) != 1:
        parts.append(f"--gu-splits {run['gu_splits']}")
    if run.get("bucket"):
        parts.append(f"--bucket {run['bucket']}")
    return " ".join(parts) or "default"


def run_files(folder: Path) -> list[Path]:
    """The decode_*.json under a folder (sorted), the file itself, or none if it is missing."""
    return sorted(folder.rglob("decode_*.json")) if folder.is_dir() else [folder] if folder.is_file() else []


def load(folders: list[Path]) -> list[dict]:
    """The runs, in argument order (each folder's files sorted); folders without any are left
    out with a note, and none at all is an error."""
    runs = []
    for folder in folders:   # a pass that timed out leaves its folder empty: the rest still count
        files = run_files(folder)
        if not files:
            print(f"(no decode_*.json under {folder}: left out)", file=sys.stderr)
        runs += [json.loads(f.read_text()) for f in files]
    if not runs:
        raise SystemExit("no decode_*.json in any of the folders: pass the --out folders of bench/decode.py")
    devices = {r["device"] for r in runs}
    if len(devices) > 1:
        raise SystemExit(f"runs from different cards {sorted(devices)}: compare runs of one card only")
    # page_size: runs before 2026-12-08 did not record it and ran decode.py's default, 16
    shapes = {(r.get("model"), r.get("tp"), r.get("layers"), r.get("page_size", 16)) for r in runs}
    if len(shapes) > 1:
        raise SystemExit(f"runs of different shapes (model, tp, layers, page size) {sorted(shapes, key=str)}: "
                         f"compare runs of one shape only")
    return runs


def tag(folders: list[Path], text: str) -> None:
    """Set "tag" in every run under the folders (a missing folder: a timed-out pass)."""
    for folder in folders:
        for f in run_files(folder):
            res = json.loads(f.read_text())
            res["tag"] = text
            f.write_text(json.dumps(res))


def table(runs: list[dict]) -> tuple[list[str], dict[tuple[int, int], dict[str, list[float]]]]:
    """Variant labels in first-met order, and per (batch, ctx) each variant's step times."""
    labels: list[str] = []
    times: dict[tuple[int, int], dict[str, list[float]]] = {}
    for run in runs:
        name = label(run)
        if name not in labels:
            labels.append(name)
        for row in run["rows"]:
            times.setdefault((row["batch"], row["ctx"]), {}).setdefault(name, []).append(row["mk_ms"])
    return labels, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="bench/decode.py --out folders (or JSON files)")
    ap.add_argument("--tag", help="write this tag into every run under the folders, print nothing")
    args = ap.parse_args()
    if args.tag is not None:
        tag(args.folders, args.tag)
        return
    runs = load(args.folders)
    labels, times = table(runs)
    print(f"== {runs[0]['device']}: {len(runs)} runs, mean ms [min-max] and change against v1")
    for i, name in enumerate(labels, 1):
        print(f"   v{i}: {name}")
    for (batch, ctx) in sorted(times):
        by = times[(batch, ctx)]
        base = statistics.mean(by[labels[0]]) if labels[0] in by else None
        cells = []
        for i, name in enumerate(labels, 1):
            if name not in by:
                continue
            t = by[name]
            m = statistics.mean(t)
            cell = f"v{i} {m:7.3f} [{min(t):.2f}-{max(t):.2f}]"
            if base is not None and i > 1:
                cell += f" {100 * (m / base - 1):+5.1f}%"
            cells.append(cell)
        print(f"{batch:>5} {ctx:>5} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
