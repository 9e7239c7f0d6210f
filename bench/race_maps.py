#!/usr/bin/env python
"""Heat maps of the emulated race over N × G, one per straggler model: each cell the median over
the race seeds of the configuration's time to a target relative to the tuned synchronous group
(below 1: the hybrid pays), and how many seeds reached it. Read from bench.emulated_race results.

    .venv/bin/python -m bench.race_maps bench/results/emulated-race/A.json B.json --target 0.4

A PNG per scenario beside the first file, named <its stem>-map-<scenario>-<target>.png.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from bench.emulated_race import SCENARIOS
from bench.harness import log, publish_png


def cells(paths: list[Path], target: str) -> dict[str, dict[tuple[int, int], dict]]:
    """scenario -> (N, G) -> {"ratio": median over the seeds of the time to `target` relative to the
    synchronous group's on the same seed, "reached": seeds that reached it, "seeds"}. A run that
    did not reach the target took longer than any that did: its ratio is 0 when only the
    synchronous group missed, ∞ when only this configuration did (median_low keeps them whole)."""
    out: dict[str, dict] = {}
    for path in paths:
        for key, s in json.loads(path.read_text())["summary"].items():
            scenario, ranks = key.split("/N")
            configs = {int(g): e["targets"][target]["per_seed_s"] for g, e in s["configs"].items()
                       if target in e["targets"]}
            sync = configs.get(1, {})
            for groups, times in configs.items():
                ratios = [ratio(t, sync.get(seed)) for seed, t in times.items()]
                ratios = [r for r in ratios if r is not None]
                out.setdefault(scenario, {})[(int(ranks), groups)] = {
                    "ratio": statistics.median_low(ratios) if ratios else None, "seeds": len(times),
                    "reached": sum(t is not None for t in times.values())}
    return out


def ratio(time: float | None, sync: float | None) -> float | None:
    if time is None and sync is None:
        return None
    return math.inf if time is None else 0.0 if sync is None else time / sync


def label(cell: dict, groups: int) -> str:
    reached = f"{cell['reached']}/{cell['seeds']}"
    r = cell["ratio"]
    if groups == 1:
        return f"sync\n{reached}"
    text = "—" if r is None else "sync ✗" if r == 0 else "✗" if math.isinf(r) else f"{r:.2f}×"
    return f"{text}\n{reached}"


def draw(path: Path, scenario: str, target: str, grid: dict[tuple[int, int], dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ranks = sorted({n for n, _ in grid})
    groups = sorted({g for _, g in grid})
    values = np.full((len(ranks), len(groups)), np.nan)
    for (n, g), cell in grid.items():
        if g > 1 and cell["ratio"] is not None:
            values[ranks.index(n), groups.index(g)] = min(2.0, max(-2.0, math.log2(max(cell["ratio"], 1e-9))))
    fig, ax = plt.subplots(figsize=(1.3 * len(groups) + 2.2, 0.9 * len(ranks) + 1.6), dpi=110)
    image = ax.imshow(values, cmap="RdBu_r", vmin=-2, vmax=2, aspect="auto")
    for (n, g), cell in grid.items():
        ax.text(groups.index(g), ranks.index(n), label(cell, g), ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])
    ax.set_yticks(range(len(ranks)), [str(n) for n in ranks])
    ax.set_xlabel("groups G (1: one synchronous group)")
    ax.set_ylabel("ranks N")
    ax.set_title(f"{SCENARIOS[scenario][0]}: time to validation loss {target}\n"
                 "relative to the tuned synchronous group: median over seeds, seeds that reached it\n"
                 "(✗: this configuration missed it on most seeds; sync ✗: the synchronous group did)", fontsize=9)
    bar = fig.colorbar(image, ax=ax, ticks=[-2, -1, 0, 1, 2])
    bar.ax.set_yticklabels(["¼×", "½×", "1×", "2×", "4×"])
    return publish_png(path, fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="+", help="bench.emulated_race result files")
    ap.add_argument("--target", default="0.4", help="a target level the results report")
    args = ap.parse_args(argv)
    for scenario, grid in cells(args.results, args.target).items():
        png = args.results[0].with_name(f"{args.results[0].stem}-map-{scenario}-{args.target}.png")
        log(f"{draw(png, scenario, args.target, grid)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
