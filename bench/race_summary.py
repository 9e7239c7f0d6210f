"""bench.hybrid_race's summary: times to the targets and the AUC at fixed times per configuration,
relative to the tuned synchronous group with bootstrap intervals, as text, markdown and a
picture per scenario."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

from bench.harness import publish_png

from bench.race_common import FIXED_TIMES, SCENARIOS, SCORE_EVERY_S, SYNC, TARGETS, Config, Result


def auc_at(curve, t: float) -> float | None:
    """The AUC of the newest score at or before `t` seconds (None if the run stopped before)."""
    if not curve or curve[-1][0] < t - SCORE_EVERY_S:
        return None
    before = [a for s, _n, a in curve if s <= t]
    return before[-1] if before else None


def bootstrap(ratios: list[float], reps: int = 4000, seed: int = 0) -> list[float] | None:
    """A 95 % percentile interval of the geometric mean of the per-seed ratios, seeds resampled."""
    if len(ratios) < 2:
        return None
    rng = random.Random(seed)
    logs = [_log(r) for r in ratios]
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(reps))
    return [round(_exp(means[int(0.025 * reps)]), 3), round(_exp(means[int(0.975 * reps) - 1]), 3)]


def _log(x: float) -> float:
    import math

    return math.log(x)


def _exp(x: float) -> float:
    import math

    return math.exp(x)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(results: list[Result], configs: list[Config], scenarios: list[str], chosen: dict,
              sweeps: dict) -> dict:
    out: dict = {}
    for sc in scenarios:
        race = [r for r in results if r.scenario == sc and r.phase == "race"]
        sync = {r.seed: r for r in race if r.config == SYNC.name}
        sync_best = {s: r.held_auc for s, r in sync.items()}
        out[sc] = {"scenario": SCENARIOS[sc][0], "seeds": sorted(sync),
                   "sync_best_auc": {str(s): v for s, v in sync_best.items()},
                   "targets": [f"{t:g}" for t in TARGETS] + ["sync best"], "fixed_times_s": list(FIXED_TIMES),
                   "configs": {}}
        for c in configs:
            rs = [r for r in race if r.config == c.name]
            if not rs:
                continue
            entry: dict = {"learning_rate": chosen.get(sc, {}).get(c.name), "rate_field": c.rate_field,
                           "learning_rate_sweep": sweeps.get(sc, {}).get(c.name, []),
                           "seeds": len(rs), "targets": {}}
            for key in [f"{t:g}" for t in TARGETS] + ["sync best"]:
                ts = {r.seed: r.times_to_target.get(key) for r in rs}
                reached = [v for v in ts.values() if v is not None]
                ratios = [ts[s] / sync[s].times_to_target[key] for s in ts
                          if s in sync and ts[s] is not None and sync[s].times_to_target.get(key)]
                entry["targets"][key] = {
                    "reached": len(reached),
                    "time_s": statistics.median(reached) if len(reached) == len(rs) else None,
                    "time_range_s": [min(reached), max(reached)] if reached else None,
                    "per_seed_s": {str(s): v for s, v in ts.items()},
                    "ratio_to_sync": round(statistics.median(ratios), 3)
                    if ratios and len(ratios) == len(rs) else None,
                    "ratio_per_seed": [round(x, 3) for x in ratios],
                    "ratio_ci95": bootstrap(ratios) if len(ratios) == len(rs) else None,
                }
            entry["auc_at_s"] = {f"{t:g}": _median([auc_at(r.curve, t) for r in rs]) for t in FIXED_TIMES}
            entry["auc_at_s_range"] = {f"{t:g}": _range([auc_at(r.curve, t) for r in rs]) for t in FIXED_TIMES}
            entry.update({
                "best_auc": max(r.best_auc for r in rs),
                "updates_per_s": _median([r.updates_per_s for r in rs]),
                "staleness_mean": _median([r.staleness_mean for r in rs]),
                "staleness_p95": _median([r.staleness_p95 for r in rs]),
                "wait_share": _median([r.wait_share for r in rs]),
            })
            out[sc]["configs"][c.name] = entry
    return out


def _range(xs):
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def render(summary: dict) -> str:
    lines = ["time from the first step to each validation AUC target (median over seeds [range], "
             "ratio to the tuned 1x8 sync with its bootstrap 95 % interval); AUC at fixed times"]
    for sc, s in summary.items():
        lines.append(f"\n({sc}) {s['scenario']}  seeds {s['seeds']}, sync best "
                     + ", ".join(f"{v:.3f}" for v in s["sync_best_auc"].values()))
        for name, e in s["configs"].items():
            lines.append(f"  {name:18} rate {e['learning_rate']:.3g}"
                         + (f", wait {100 * e['wait_share']:.1f} %" if e["wait_share"] is not None else ""))
            for key, t in e["targets"].items():
                lines.append(f"    AUC {key:9} {_time(t, e['seeds']):28} {_ratio(t)}")
            lines.append("    AUC at " + ", ".join(f"{k} s {v:.3f}" if v is not None else f"{k} s -"
                                                     for k, v in e["auc_at_s"].items()))
    return "\n".join(lines)


def _time(t: dict, seeds: int) -> str:
    if t["time_s"] is not None:
        lo, hi = t["time_range_s"]
        return f"{t['time_s']:.1f} s [{lo:.0f}–{hi:.0f}]"
    return f"reached in {t['reached']}/{seeds}"


def _ratio(t: dict) -> str:
    if t["ratio_to_sync"] is None:
        return "-"
    ci = t["ratio_ci95"]
    return f"{t['ratio_to_sync']:.2f}×" + (f" [{ci[0]:.2f}–{ci[1]:.2f}]" if ci else "")


def markdown(summary: dict) -> str:
    """The summary as the docs' table."""
    keys = next(iter(summary.values()))["targets"] if summary else []
    rows = ["| scenario | configuration | rate | " + " | ".join(f"AUC {k}: time, ratio [95 % CI]" for k in keys)
            + " | AUC at " + ", ".join(f"{t:g}" for t in FIXED_TIMES) + " s |",
            "|---|---|---|" + "---|" * len(keys) + "---|"]
    for sc, s in summary.items():
        for name, e in s["configs"].items():
            cells = [f"{_time(t, e['seeds'])}, {_ratio(t)}" for t in e["targets"].values()]
            fixed = " / ".join(f"{v:.3f}" if v is not None else "-" for v in e["auc_at_s"].values())
            rows.append(f"| ({sc}) {s['scenario']} | {name} | {e['learning_rate']:.3g} | "
                        + " | ".join(cells) + f" | {fixed} |")
    return "\n".join(rows)


def picture(path: Path, sc: str, s: dict, results: list[Result], budget: float) -> Path:
    """AUC against time per configuration: median over the race seeds, their range as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    grid = [i * 1.0 for i in range(int(budget) + 1)]
    for name, e in s["configs"].items():
        rs = [r for r in results if r.scenario == sc and r.phase == "race" and r.config == name]
        med, lo, hi, ts = [], [], [], []
        for t in grid:
            vals = [v for v in (auc_at(r.curve, t) for r in rs) if v is not None]
            if len(vals) < len(rs) or not vals:
                continue
            ts.append(t)
            med.append(statistics.median(vals))
            lo.append(min(vals))
            hi.append(max(vals))
        if not ts:
            continue
        line, = ax.plot(ts, med, label=f"{name} (rate {e['learning_rate']:.2g})")
        ax.fill_between(ts, lo, hi, color=line.get_color(), alpha=0.2)
    for t in TARGETS:
        ax.axhline(t, color="grey", ls="--", lw=0.8)
        ax.text(1, t + 0.002, f"AUC {t:g}", color="grey", fontsize=8)
    best = list(s["sync_best_auc"].values())
    if best:
        ax.axhline(statistics.median(best), color="black", ls=":", lw=0.8)
        ax.text(1, statistics.median(best) + 0.002, "tuned sync's best (median)", fontsize=8)
    ax.set_ylim(0.70, max([0.96, *best]) + 0.01)
    ax.set_xlim(0, budget)
    ax.set_xlabel("seconds since the first training step (emulated pace)")
    ax.set_ylabel("validation AUC")
    ax.set_title(f"({sc}) {s['scenario']}: median of {len(s['seeds'])} seeds, band = range", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return publish_png(path, fig)
