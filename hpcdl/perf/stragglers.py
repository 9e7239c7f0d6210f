"""The straggler model fitted to a run's measured step times, for the planner instead of a guess.

Each rank records its own time of every step (hpcdl.rundir.steptimes). The planner's model of a node's
step (:mod:`hpcdl.perf.model`, the emulator's too: hpcdl.process.emulate) is a factor X on an ordinary
step: lognormal with spread σ, times `stall_factor` with probability `stall_probability`, times
`slow_factor` on persistently slow nodes. The fit, per rank r and step s with time t[r, s]:

* slow ranks: a rank's median over the median of all ranks' medians; beyond
  :data:`SLOW_THRESHOLD` the rank is slow, by its median over the others' median. Dividing each
  rank by its own median then leaves the per-step factor alone, so a slow rank does not count as
  spread.
* σ and stalls: the log of t / rank median is normal with spread σ (a lognormal's median is its
  own), and a stall adds log(stall_factor) to it. Stalls only lengthen steps, so σ comes from the
  residuals below their median (their half-width at the 16th percentile, 1σ of a normal), then
  steps beyond :data:`STALL_SIGMAS` σ above the body are stalls (if there are more of them than
  the body's own tail would give); σ is fitted again without them, from the median absolute
  deviation.
  The stall factor is the stalls' median ratio to their rank's median; their share, divided by
  the chance that a stall of that factor clears the threshold, is the stall probability.

The first :data:`WARMUP_STEPS` steps of a rank (its caches, TensorFlow's first runs) are left
out. Pure numpy: it runs where the planner runs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from hpcdl.rundir.runs import RunDir
from hpcdl.rundir.steptimes import read_step_times

SLOW_THRESHOLD = 1.15  # a rank's median over the others': slow beyond this
STALL_SIGMAS = 4.0  # steps further above the body than this many σ are stalls (3e-5 by chance)
MIN_STALLS = 3  # fewer steps beyond the threshold are taken for the body's own tail
WARMUP_STEPS = 3
MIN_STEPS = 30  # per rank, after the warm-up: fewer give no sound spread
_LOWER_SIGMA_QUANTILE = 0.15865525393145707  # Φ(−1)
_MAD_TO_SIGMA = 1.482602218505602  # 1 / Φ⁻¹(3/4)


class TooFewSteps(ValueError):
    """The recorded times are too few to fit the model."""


@dataclass(frozen=True)
class StragglerFit:
    """The planner's straggler inputs as measured, and how many steps and ranks they rest on."""

    sigma: float
    stall_probability: float
    stall_factor: float
    slow_ranks: tuple[tuple[str, float], ...]  # (rank, its median over the others')
    slow_node_fraction: float
    slow_factor: float
    steps: int  # step times used, over all ranks
    ranks: int
    median_step_s: float  # the ordinary ranks' median step time

    def plan_values(self) -> dict[str, float]:
        """PlanInputs fields set by the fit."""
        return {"straggler_sigma": self.sigma, "stall_probability": self.stall_probability,
                "stall_factor": self.stall_factor, "slow_node_fraction": self.slow_node_fraction,
                "slow_factor": self.slow_factor}

    def applied_to(self, inputs: Any, origin: str) -> Any:
        """`inputs` (a PlanInputs) with the fitted fields, their source naming `origin`."""
        source = f"fitted to {origin}: {self.steps} steps of {self.ranks} ranks"
        return inputs.with_values(source, **self.plan_values())

    def describe(self) -> str:
        """One paragraph: the model and what it rests on."""
        stalls = (f"stalls {100 * self.stall_probability:.2g} % of steps, {self.stall_factor:.2f}× long"
                  if self.stall_probability else "no stalls")
        slow = (", ".join(f"rank {name} {factor:.2f}× slow" for name, factor in self.slow_ranks)
                if self.slow_ranks else "no persistently slow rank")
        return (f"Stragglers measured: σ {self.sigma:.3f}, {stalls}, {slow}; from {self.steps} "
                f"step times of {self.ranks} ranks (median step {self.median_step_s * 1e3:.1f} ms).")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["slow_ranks"] = [{"rank": rank, "factor": factor} for rank, factor in self.slow_ranks]
        return out


def fit_stragglers(times: Mapping[str, Sequence[float]] | Sequence[Sequence[float]], *,
                   warmup: int = WARMUP_STEPS, min_steps: int = MIN_STEPS) -> StragglerFit:
    """Fit the straggler model to each rank's step times, in step order (module docstring).

    `times`: rank name → its seconds per step, or a sequence of them (named by position).
    TooFewSteps if no rank has `min_steps` steps after the first `warmup`.
    """
    named = dict(times) if isinstance(times, Mapping) else {str(i): t for i, t in enumerate(times)}
    ranks = {name: np.asarray(t, dtype=float)[warmup:] for name, t in named.items()}
    ranks = {name: t[np.isfinite(t) & (t > 0)] for name, t in ranks.items()}
    ranks = {name: t for name, t in ranks.items() if t.size >= min_steps}
    if not ranks:
        most = max((max(0, len(t) - warmup) for t in named.values()), default=0)
        raise TooFewSteps(f"no rank has {min_steps} recorded steps after the first {warmup} "
                          f"(the most: {most})")
    medians = {name: float(np.median(t)) for name, t in ranks.items()}
    overall = float(np.median(list(medians.values())))
    slow_names = [n for n, m in medians.items() if m / overall > SLOW_THRESHOLD]
    ordinary = [m for n, m in medians.items() if n not in slow_names]
    base = float(np.median(ordinary)) if ordinary else overall
    slow = tuple((n, medians[n] / base) for n in slow_names)

    residuals = np.concatenate([np.log(t / medians[n]) for n, t in ranks.items()])
    sigma = _lower_half_sigma(residuals)
    stalled = np.zeros(residuals.size, dtype=bool)
    for _ in range(3):  # the body's median and σ without the stalls, then the stalls again
        body = residuals[~stalled]
        centre = float(np.median(body))
        sigma = _lower_half_sigma(body - centre)
        if sigma == 0:
            stalled = residuals > centre + 1e-3  # no spread: any longer step is a stall
        else:
            stalled = residuals > centre + STALL_SIGMAS * sigma
    body = residuals[~stalled]
    # the body without its stalls is symmetric: its median absolute deviation is the steadier
    # estimate of the two, which tests/perf/test_stragglers.py holds to its emulated truth
    sigma = float(_MAD_TO_SIGMA * np.median(np.abs(body - np.median(body))))
    stall_probability, stall_factor = 0.0, 1.0
    if stalled.sum() >= max(MIN_STALLS, 10 * _normal_sf(STALL_SIGMAS) * residuals.size):
        stall_factor = float(np.exp(np.median(residuals[stalled]) - centre))
        # stalls near the body are taken for ordinary steps: count the ones that were missed
        shown = 1.0 if sigma == 0 else _normal_sf(STALL_SIGMAS - math.log(stall_factor) / sigma)
        stall_probability = min(1.0, stalled.mean() / max(shown, 0.5))
    return StragglerFit(
        sigma=float(sigma), stall_probability=float(stall_probability),
        stall_factor=max(1.0, stall_factor), slow_ranks=slow,
        slow_node_fraction=len(slow) / len(ranks),
        slow_factor=float(np.median([f for _, f in slow])) if slow else 1.0,
        steps=int(residuals.size), ranks=len(ranks), median_step_s=base)


def fit_run(run: RunDir) -> StragglerFit:
    """The fit of every rank's recorded step times in `run` (ranks named ``g<group>r<rank>``).

    TooFewSteps names the run when it has no recorded times (made before ranks recorded them,
    or no step done yet) or too few."""
    times = {}
    for (group, rank), path in run.step_times_files().items():
        try:
            _, seconds = read_step_times(path)
        except OSError as exc:
            raise TooFewSteps(f"{path}: {exc.strerror or exc}") from None
        times[f"g{group}r{rank}"] = seconds
    if not any(len(t) for t in times.values()):
        raise TooFewSteps(f"run {run.run_id} has no recorded step times (a run made before hpcdl "
                          f"recorded them, or one that has not stepped yet)")
    try:
        return fit_stragglers(times)
    except TooFewSteps as exc:
        raise TooFewSteps(f"run {run.run_id}: {exc}; train it longer") from None


def _lower_half_sigma(residuals: np.ndarray) -> float:
    """σ of a normal from its median and its 16th percentile: stalls, above, do not move it."""
    return float(max(0.0, np.median(residuals) - np.quantile(residuals, _LOWER_SIGMA_QUANTILE)))


def _normal_sf(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))


__all__ = ["MIN_STALLS", "MIN_STEPS", "SLOW_THRESHOLD", "STALL_SIGMAS", "WARMUP_STEPS",
           "StragglerFit", "TooFewSteps", "fit_run", "fit_stragglers"]
