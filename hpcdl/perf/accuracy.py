"""Time to accuracy: which split of the nodes into groups reaches a target first.

Omnivore's question (Hadjis et al.): a group count costs time per step (hardware efficiency:
stragglers, allreduce, exchange) and steps to converge (statistical efficiency: staleness, a
smaller batch per update). The emulated race (:mod:`hpcdl.perf.race`) measures both at once: the
job's real model learns on a clock that charges what the planner's model charges.

A comparison is fair only if every configuration's rate is tuned alike. Each group count's rate
is swept on a factor-2 grid around its centre on the tuning seed, the grid extended past an edge
until the best rate is interior (or `extend` points were added: the edge is then reported).
The sweep's key is the time to target (reached first wins), then the mean score over the
horizon (what training adds). The race seeds then run at the chosen rates.

A run reaches the target at the first score from which it holds over two consecutive scores (an
untrained model's lucky first score does not count), and never if its step was not finite.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Callable, Sequence

# Metrics where less is better; every other metric is better higher.
LOWER_IS_BETTER = re.compile(r"^(loss|mse|mae)(_\d+)?$")
_TARGET = re.compile(r"^\s*([A-Za-z_][\w]*)\s*(>=|<=|=)\s*([-+0-9.eE]+)\s*$")

Curve = Sequence[tuple]  # (emulated s, samples, master version, score)


@dataclass(frozen=True)
class Target:
    """A validation metric and the value to reach: `auc=0.95`, `r2>=0.9`, `loss<=0.3`."""

    metric: str
    value: float
    higher: bool

    @classmethod
    def parse(cls, text: str) -> "Target":
        m = _TARGET.match(text)
        if not m:
            raise ValueError(f"a target is METRIC=VALUE, METRIC>=VALUE or METRIC<=VALUE (e.g. auc=0.95), got {text!r}")
        metric, op, value = m.group(1), m.group(2), float(m.group(3))
        if not math.isfinite(value):
            raise ValueError(f"a target's value must be finite, got {text!r}")
        higher = op == ">=" or (op == "=" and not LOWER_IS_BETTER.match(metric))
        return cls(metric, value, higher)

    def met(self, score: float) -> bool:
        return score >= self.value if self.higher else score <= self.value  # NaN meets nothing

    def __str__(self) -> str:
        return f"{self.metric} {'≥' if self.higher else '≤'} {self.value:g}"


@dataclass(frozen=True)
class Run:
    """One race's scores (what :func:`hpcdl.perf.race_worker.emulated_race` returns, reduced)."""

    curve: Curve
    diverged: bool

    def reached_at(self, target: Target) -> float | None:
        """The first emulated time from which `target` holds over two consecutive scores."""
        if self.diverged:
            return None
        for now, after in zip(self.curve, self.curve[1:]):
            if target.met(now[-1]) and target.met(after[-1]):
                return now[0]
        return None

    def mean_score(self, target: Target, horizon: float) -> float:
        """The mean score after the untrained one over the horizon, signed so that more is
        better; a run stopped early counts its last score to the horizon; -inf if diverged."""
        scores = [s for *_x, s in self.curve[1:]]
        if self.diverged or not scores or not all(math.isfinite(s) for s in scores):
            return -math.inf
        every = self.curve[1][0] - self.curve[0][0]
        scores += [scores[-1]] * max(0, round(horizon / every) - len(scores))
        mean = statistics.fmean(scores)
        return mean if target.higher else -mean


def sweep_rate(key: Callable[[float], tuple], centre: float, extend: int) -> tuple[float, str, dict]:
    """The best rate on a factor-2 grid around `centre` by `key` (higher is better), the grid
    moved past an edge at most `extend` times; returns it, "interior" or the edge it stayed at,
    and every rate tried with its key."""
    tried: dict[float, tuple] = {}

    def cached(rate: float) -> tuple:
        if rate not in tried:
            tried[rate] = key(rate)
        return tried[rate]

    grid = [centre / 2, centre, centre * 2]
    for _ in range(extend + 1):
        best = max(grid, key=cached)
        if grid[0] < best < grid[-1]:
            return best, "interior", tried
        grid = [best / 2, best, best * 2]
    best = max(tried, key=tried.__getitem__)
    where = "bottom" if best == min(tried) else "top" if best == max(tried) else "interior"
    return best, where, tried


def sweep_key(runs: Sequence[Run], target: Target, horizon: float) -> tuple:
    """Reached on more tuning seeds, then sooner (mean time), then the higher mean score."""
    times = [r.reached_at(target) for r in runs]
    reached = [t for t in times if t is not None]
    return (len(reached), -statistics.fmean(reached) if reached else -math.inf,
            statistics.fmean(r.mean_score(target, horizon) for r in runs))


@dataclass
class Outcome:
    """One group count's tuned rate and its race seeds' times to target."""

    groups: int
    rate: float
    sweep: str  # interior, or the grid edge the best rate stayed at
    tried: dict = field(default_factory=dict)  # rate -> sweep key
    times: list = field(default_factory=list)  # per race seed: emulated s, or None
    diverged: int = 0

    @property
    def all_reached(self) -> bool:
        return bool(self.times) and all(t is not None for t in self.times)

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.all_reached else None

    @property
    def interval(self) -> tuple[float, float] | None:
        """The range over the race seeds (with three seeds, what an interval can honestly be)."""
        return (min(self.times), max(self.times)) if self.all_reached else None

    def to_dict(self) -> dict:
        return {"groups": self.groups, "rate": self.rate, "sweep": self.sweep, "times_s": self.times,
                "reached": sum(t is not None for t in self.times), "diverged": self.diverged,
                "median_s": self.median, "range_s": self.interval,
                "tried": {f"{r:.6g}": list(k) for r, k in sorted(self.tried.items())}}


def recommend(outcomes: Sequence[Outcome]) -> Outcome | None:
    """The group count with the lowest median time among those that reached the target on every
    race seed; fewer groups when the medians tie. None when none did."""
    done = [o for o in outcomes if o.all_reached]
    return min(done, key=lambda o: (o.median, o.groups)) if done else None


def race_groups(outcome_of: Callable[[int, float, int], Run], groups: Sequence[int],
                centres: dict[int, float], target: Target, *, horizon: float, tuning_seeds: Sequence[int],
                race_seeds: Sequence[int], extend: int) -> list[Outcome]:
    """Tune and race each group count: `outcome_of(groups, rate, seed)` runs one race."""
    outcomes = []
    for g in groups:
        def key(rate: float, g: int = g) -> tuple:
            return sweep_key([outcome_of(g, rate, s) for s in tuning_seeds], target, horizon)

        rate, where, tried = sweep_rate(key, centres[g], extend)
        runs = [outcome_of(g, rate, s) for s in race_seeds]
        outcomes.append(Outcome(g, rate, where, tried, [r.reached_at(target) for r in runs],
                                sum(r.diverged for r in runs)))
    return outcomes
