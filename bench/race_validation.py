#!/usr/bin/env python
"""The emulated race beside the wall-clock race: the same network, data, ranks, straggler model
and learning rates, each side's time and samples to each target, held over two consecutive scores
(hpcdl.perf.accuracy.Run), median over the race seeds.

Time tells whether the two agree; samples tell why they do not: equal samples at unequal times
mean the clocks differ (the wall-clock race's ranks slower than their emulated step on a loaded
machine, its start-up, its scorer's pace), unequal samples mean the learning differs.

    .venv/bin/python -m bench.race_validation WALL.json EMULATED.json [EMULATED.json ...] [--metric loss]

WALL.json is a bench.hybrid_race result, each EMULATED.json a bench.emulated_race result run with
`--rates` set to the wall-clock race's chosen rates (see docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from hpcdl.perf.accuracy import Run, Target

SCENARIOS = {"a": "none", "b": "b"}  # hybrid_race's scenario -> emulated_race's
CONFIGS = {"1x8 sync": 1, "8x1 job defaults": 8}  # hybrid_race's configuration -> groups
TOLERANCE = 0.25  # issue 31: the emulated time within ±25 % of the wall-clock race's median


# the metric -> the wall-clock run's curve holding it, and the default targets
METRICS = {"auc_unweighted": ("curve", "0.9,0.93"), "loss": ("loss_curve", "0.5,0.4,0.3")}


def reached(curve, target: Target) -> tuple[float | None, int | None]:
    """(time, samples) from which `target` holds over two scores; curve rows end in
    (…, samples at index 1, score last)."""
    at = Run(curve, False).reached_at(target)
    if at is None:
        return None, None
    return at, next(row[1] for row in curve if row[0] == at)


def median_or_none(values: list) -> float | None:
    """The median over seeds, a seed that never reached counted as infinitely late: None when
    half or more did not reach."""
    if not values:
        return None
    middle = statistics.median([math.inf if v is None else v for v in values])
    return middle if math.isfinite(middle) else None


def side(runs: list[dict], target: Target, curve: str = "curve") -> dict:
    """One race's times and samples to `target` per seed (on each run's `curve`), and their medians."""
    times, samples = zip(*(reached(r[curve], target) for r in runs)) if runs else ((), ())
    return {"times": list(times), "samples": list(samples), "median_s": median_or_none(list(times)),
            "median_samples": median_or_none(list(samples))}


def compare(wall: dict, emulated: list[dict], targets: tuple[float, ...], metric: str = "auc_unweighted") -> list[dict]:
    rows = []
    emulated = [doc for doc in emulated if doc.get("metric", metric) == metric]
    for scenario, emulated_scenario in SCENARIOS.items():
        for config, groups in CONFIGS.items():
            w = [r for r in wall["runs"] if r["phase"] == "race" and r["scenario"] == scenario
                 and r["config"] == config]
            e = [r for doc in emulated for r in doc["runs"] if r["phase"] == "race"
                 and r["scenario"] == emulated_scenario and r["groups"] == groups and r["ranks"] == 8]
            if not w or not e:
                continue
            for t in targets:
                target = Target.parse(f"{metric}={t}")
                ws, es = side(w, target, METRICS[metric][0]), side(e, target)
                ratio = es["median_s"] / ws["median_s"] if ws["median_s"] and es["median_s"] else None
                rows.append({"scenario": scenario, "config": config, "target": t, "rate_wall": w[0]["rate"],
                             "rate_emulated": e[0]["rate"], "wall": ws, "emulated": es, "ratio": ratio,
                             "within": ratio is not None and abs(ratio - 1) <= TOLERANCE})
    return rows


def same_order(rows: list[dict]) -> dict[str, bool | None]:
    """Per scenario and target: do both races put the configurations in the same order?"""
    out = {}
    for key in sorted({(r["scenario"], r["target"]) for r in rows}):
        group = [r for r in rows if (r["scenario"], r["target"]) == key]
        if any(r["ratio"] is None for r in group) or len(group) < 2:
            out[f"{key[0]} {key[1]:g}"] = None
            continue
        by_wall = sorted(group, key=lambda r: r["wall"]["median_s"])
        by_emulated = sorted(group, key=lambda r: r["emulated"]["median_s"])
        out[f"{key[0]} {key[1]:g}"] = [r["config"] for r in by_wall] == [r["config"] for r in by_emulated]
    return out


def fmt(value, unit="") -> str:
    return "—" if value is None else f"{value:.3g}{unit}"


def table(rows: list[dict]) -> str:
    lines = ["| scenario | configuration (rate) | target | wall-clock: s per seed (median) | emulated: s per seed (median) "
             "| emulated / wall | samples to target, wall / emulated (medians) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        w, e = r["wall"], r["emulated"]
        lines.append(
            f"| {r['scenario']} | {r['config']} ({r['rate_wall']:.3g}) | {r['target']:g} | "
            f"{' / '.join(fmt(x) for x in w['times'])} ({fmt(w['median_s'])}) | "
            f"{' / '.join(fmt(x) for x in e['times'])} ({fmt(e['median_s'])}) | "
            f"{fmt(r['ratio'], '×')}{'' if r['within'] else ' (outside ±25 %)' if r['ratio'] else ''} | "
            f"{fmt(w['median_samples'])} / {fmt(e['median_samples'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wall", type=Path)
    ap.add_argument("emulated", type=Path, nargs="+")
    ap.add_argument("--metric", default="auc_unweighted", choices=sorted(METRICS),
                    help="loss needs a wall-clock result that recorded it (loss_curve) and emulated races run with it")
    ap.add_argument("--targets", default="", help="comma-separated levels (default: the metric's)")
    args = ap.parse_args(argv)
    wall = json.loads(args.wall.read_text())
    emulated = [json.loads(p.read_text()) for p in args.emulated]
    levels = args.targets or METRICS[args.metric][1]
    rows = compare(wall, emulated, tuple(float(t) for t in levels.split(",")), args.metric)
    if not rows:
        print(f"no configuration is in both results with the {args.metric} scored", file=sys.stderr)
        return 1
    print(table(rows))
    print("\nsame order of configurations (scenario target: yes/no/— where a median is missing): "
          + ", ".join(f"{k}: {'—' if v is None else 'yes' if v else 'no'}" for k, v in same_order(rows).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
