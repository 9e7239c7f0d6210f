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

from bench.harness import publish_png
from bench.race_common import LOSS_TARGETS, SCORE_EVERY_S, TARGETS
from hpcdl.perf.accuracy import Run, Target

SCENARIOS = {"a": "none", "b": "b"}  # hybrid_race's scenario -> emulated_race's
CONFIGS = {"1x8 sync": 1, "8x1 job defaults": 8}  # hybrid_race's configuration -> groups
TOLERANCE = 0.25  # issue 31: the emulated time within ±25 % of the wall-clock race's median


# the metric -> the wall-clock run's curve holding it, and the default targets
METRICS = {"auc_unweighted": ("curve", TARGETS), "loss": ("loss_curve", LOSS_TARGETS)}


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


def same_order(rows: list[dict], resolution: float = SCORE_EVERY_S) -> dict[str, str | None]:
    """Per scenario and target: do both races put the configurations in the same order? "yes",
    "no" (a pair ordered one way by one race and the other way by the other), "tie" (no pair
    contradicts, but one race's medians of a pair lie within `resolution`, the interval at which
    both races score: a difference it cannot see), None where a median is missing."""
    out: dict[str, str | None] = {}
    for key in sorted({(r["scenario"], r["target"]) for r in rows}):
        group = [r for r in rows if (r["scenario"], r["target"]) == key]
        name = f"{key[0]} {key[1]:g}"
        if any(r["ratio"] is None for r in group) or len(group) < 2:
            out[name] = None
            continue
        verdicts = set()
        for i, x in enumerate(group):
            for y in group[i + 1:]:
                dw = x["wall"]["median_s"] - y["wall"]["median_s"]
                de = x["emulated"]["median_s"] - y["emulated"]["median_s"]
                verdicts.add("tie" if min(abs(dw), abs(de)) < resolution else "yes" if dw * de > 0 else "no")
        out[name] = "no" if "no" in verdicts else "tie" if "tie" in verdicts else "yes"
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


def picture(path: Path, wall: dict, emulated: list[dict], metric: str) -> Path:
    """Per scenario, each configuration's median curve over seeds: wall-clock solid, emulated dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = METRICS[metric][0]
    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(11, 4.2), dpi=110, sharey=True)
    for ax, (scenario, emulated_scenario) in zip(axes, SCENARIOS.items()):
        for colour, (config, groups) in zip(("C0", "C1"), CONFIGS.items()):
            w = [r[curve] for r in wall["runs"] if r["phase"] == "race" and r["scenario"] == scenario
                 and r["config"] == config]
            e = [r["curve"] for doc in emulated for r in doc["runs"] if r["phase"] == "race"
                 and r["scenario"] == emulated_scenario and r["groups"] == groups and r["ranks"] == 8]
            for curves, style, side in ((w, "-", "wall-clock"), (e, "--", "emulated")):
                ts, med = _median_curve(curves, wall["budget_s"])
                ax.plot(ts, med, style, color=colour, label=f"{config}, {side} ({len(curves)} seeds)")
        ax.set_title(f"({scenario}) {wall['summary'][scenario]['scenario']}", fontsize=10)
        ax.set_xlabel("seconds since the first training step")
    axes[0].set_ylabel(f"validation {metric}")
    axes[-1].legend(fontsize=8)
    return publish_png(path, fig)


def _median_curve(curves: list, until: float) -> tuple[list[float], list[float]]:
    """The median over `curves` of their last score at or before each second, while every curve has one."""
    ts, med = [], []
    for t in range(int(until) + 1):
        values = [next((row[-1] for row in reversed(c) if row[0] <= t), None) for c in curves]
        if not curves or None in values or any(c[-1][0] < t for c in curves):
            continue
        ts.append(t)
        med.append(statistics.median(values))
    return ts, med


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wall", type=Path)
    ap.add_argument("emulated", type=Path, nargs="+")
    ap.add_argument("--metric", default="auc_unweighted", choices=sorted(METRICS),
                    help="loss needs a wall-clock result that recorded it (loss_curve) and emulated races run with it")
    ap.add_argument("--targets", default="", help="comma-separated levels (default: the metric's)")
    ap.add_argument("--png", type=Path, help="also draw both races' median curves here")
    args = ap.parse_args(argv)
    wall = json.loads(args.wall.read_text())
    emulated = [json.loads(p.read_text()) for p in args.emulated]
    levels = tuple(float(t) for t in args.targets.split(",")) if args.targets else METRICS[args.metric][1]
    rows = compare(wall, emulated, levels, args.metric)
    if not rows:
        print(f"no configuration is in both results with the {args.metric} scored", file=sys.stderr)
        return 1
    print(table(rows))
    print("\nsame order of configurations (scenario target: yes/no/tie/— where a median is missing): "
          + ", ".join(f"{k}: {v or '—'}" for k, v in same_order(rows).items())
          + f"\n(tie: a pair's medians within one scoring interval, {SCORE_EVERY_S:g} s, in one of the races)")
    if args.png:
        print(f"picture: {picture(args.png, wall, emulated, args.metric)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
