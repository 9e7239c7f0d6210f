"""Predictions per group count, the recommendation of a group count and of H, the paper check.

For each candidate group count G (P = N/G nodes per group) :func:`evaluate` draws the group
steps (:mod:`hpcdl.perf.model`), runs the exchange simulation (:mod:`hpcdl.perf.simulate`) and
reports:

* sustained FLOP/s = Σ_groups steps·P·b·F / (time of the group's last step): stragglers,
  allreduce and exchange included;
* peak FLOP/s = N·b·F / (10th percentile of the group step time without exchange): the rate of
  the fast steps, as a "peak" measured over the best iterations is;
* the applier's load: updates/s offered (u, from the simulation) times its time per update c
  (read, apply, share of a weights publish: :attr:`PlanInputs.applier_seconds_per_update`), i.e.
  u / capacity; ``saturated`` when ≥ 1. Saturated, a non-waiting applier's queue grows: staleness
  grows until updates are dropped by the staleness or the backlog bound; with K ≥ 1 (closed loop)
  every group slows down to the applier's pace instead;
* the staleness distribution (of updates published after the first fifth of the rounds) and the
  bytes/s through the exchange medium.

The group-count rule: among candidates with applier utilisation < 1, mean staleness ≤
`staleness_bound` (default 8) and at most 1 % of updates dropped, take the highest sustained
FLOP/s; fewer groups within 1 % of it are preferred (less staleness for the same speed). The
bound of 8 is a convergence judgement, not a performance one: staleness ≈ G − 1 (K = 1) or ≈ G
(K = 0) when every group adopts the newest weights; the paper's runs at scale used about 8–9
groups, and staler updates are known to cost asynchronous SGD progress per update; hpcdl's
default ``exchange.max_staleness`` of 16 drops updates at twice that.

The H rule: a group publishes every H steps, so with a step of t seconds without exchange and
an exchange costing x seconds on the group's critical path, the applier sees G/(H·t + x)
updates/s and is busy G·c/(H·t + x) of the time, and the exchange takes x/(H·t + x) of a group's
time. Both fall as H grows; what H costs is convergence: an update covers H steps and is
computed from weights up to G−1 updates (H·(G−1) group steps) old, which is why the smallest H
meeting both bounds is recommended (an applier at most half busy keeps its queue, and so the
staleness, near the unloaded figure; the exchange at most 5 % of the time keeps it off the
critical path). The closed form gives a first H (each candidate's ``min_every``, from its own
simulated t and x at the inputs' H; with K ≥ 1 that x includes queueing, which a larger H
shrinks, so it errs high); the simulation then confirms it, and the smallest H it confirms for
the recommended count is the advice. A saturated closed loop (K ≥ 1) holds K·G updates, so its
staleness is K·G − 1: raising K buys nothing once the applier is the limit.

The table and both rules describe the job as configured (its H); :func:`better_at_own_every`
answers "and if H may change?" by running every count whose H min exceeds the inputs' H at that
H min, and naming the best that beats the recommendation by more than the 1 % tie.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hpcdl.perf.inputs import PlanInputs
from hpcdl.perf.model import allreduce_seconds, sample_group_slowest, slow_nodes_per_group
from hpcdl.perf.simulate import simulate_exchange

# The paper's reported figures for HEP at ~9600 nodes (README, Figures: the paper check).
PAPER_HEP_SUSTAINED_FLOPS = 11.41e15
PAPER_HEP_PEAK_FLOPS = 11.73e15
PAPER_HEP_WORKERS = 9594
PAPER_HEP_GROUPS = 9

TARGET_UPDATES = 2000  # updates simulated per candidate (more rounds for fewer groups)
MIN_ROUNDS = 30  # exchanges per group, at least
PEAK_QUANTILE = 0.10
MAX_DROPPED_FRACTION = 0.01
TIE_FRACTION = 0.01
MAX_APPLIER_UTILISATION = 0.5  # the H rule's bounds (see the module docstring)
MAX_EXCHANGE_SHARE = 0.05
MAX_EVERY = 1024  # the largest H the advice tries


@dataclass(frozen=True)
class GroupPlan:
    """Predictions for one group count."""

    groups: int
    nodes_per_group: int
    compute_s: float  # t_c, one node, no stragglers
    straggler_s: float  # mean wait for the group's slowest node
    allreduce_s: float
    exchange_s: float  # mean exchange cost per step on the group's critical path
    step_s: float  # mean group step, everything included
    sustained_flops: float
    peak_flops: float
    updates_per_s: float  # offered to the applier
    applier_capacity: float  # updates/s
    applier_utilisation: float
    exchange_bytes_per_s: float
    staleness_mean: float
    staleness_p50: float
    staleness_p95: float
    staleness_max: int
    dropped_fraction: float
    feasible: bool
    reason: str
    every: int = 1  # H, steps per update
    update_bytes: float = 0.0
    min_every: int = 1  # the closed form's smallest H under the H rule's bounds

    @property
    def saturated(self) -> bool:
        return self.applier_utilisation >= 1.0

    @property
    def exchange_share(self) -> float:
        """The share of a group's time spent in the exchange."""
        return self.exchange_s / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["saturated"] = self.saturated
        out["exchange_share"] = self.exchange_share
        return out


@dataclass(frozen=True)
class EveryAdvice:
    """The recommended H for one group count, with the simulated figures that support it."""

    groups: int
    every: int
    kind: str
    applier_utilisation: float
    exchange_share: float
    staleness_mean: float
    updates_per_s: float
    update_bytes: float
    met: bool  # False: no H up to MAX_EVERY meets the bounds
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


RULE = ("highest sustained FLOP/s among group counts with applier utilisation < 1, mean "
        "staleness <= {bound:g} and <= 1% of updates dropped; fewer groups preferred within 1%")
EVERY_BOUNDS = "the applier at most {util:.0%} busy and the exchange at most {share:.0%} of a group's time"
EVERY_RULE = "smallest H with " + EVERY_BOUNDS


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    nodes: int
    seed: int
    staleness_bound: float
    candidates: tuple[GroupPlan, ...]
    recommended: int | None  # group count, None if no candidate is feasible
    every_advice: EveryAdvice | None = None  # for the recommended group count (> 1)
    alternative: GroupPlan | None = None  # another group count at its own H that does better
    max_utilisation: float = MAX_APPLIER_UTILISATION
    max_exchange_share: float = MAX_EXCHANGE_SHARE
    shard_advice: "ShardAdvice | None" = None  # appliers for the recommended count at its H

    @property
    def rule(self) -> str:
        return RULE.format(bound=self.staleness_bound)

    @property
    def every_rule(self) -> str:
        return EVERY_RULE.format(util=self.max_utilisation, share=self.max_exchange_share)

    def candidate(self, groups: int) -> GroupPlan:
        for c in self.candidates:
            if c.groups == groups:
                return c
        raise KeyError(groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "seed": self.seed,
            "inputs": self.inputs.to_dict(),
            "rule": self.rule,
            "staleness_bound": self.staleness_bound,
            "recommended_groups": self.recommended,
            "every_rule": self.every_rule,
            "every_advice": self.every_advice.to_dict() if self.every_advice else None,
            "alternative": self.alternative.to_dict() if self.alternative else None,
            "shard_advice": self.shard_advice.to_dict() if self.shard_advice else None,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def flops_unit(self) -> tuple[float, str]:
        """(divisor, prefix) for FLOP/s figures of this plan: P, T, G or M."""
        top = max((c.peak_flops for c in self.candidates), default=0.0)
        for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G")):
            if top >= factor:
                return factor, prefix
        return 1e6, "M"


# -- the H model, closed form --------------------------------------------------------------------


def applier_utilisation(groups: int, every: int, step_s: float, exchange_s: float,
                        seconds_per_update: float) -> float:
    """G groups, one update per H steps of t seconds plus an exchange of x: G·c / (H·t + x)."""
    return groups * seconds_per_update / (every * step_s + exchange_s)


def exchange_share(every: int, step_s: float, exchange_s: float) -> float:
    """The exchange's share of a group's time: x / (H·t + x)."""
    return exchange_s / (every * step_s + exchange_s) if exchange_s > 0 else 0.0


def smallest_every(groups: int, step_s: float, exchange_s: float, seconds_per_update: float,
                   max_utilisation: float = MAX_APPLIER_UTILISATION,
                   max_share: float = MAX_EXCHANGE_SHARE) -> int:
    """The smallest H ≥ 1 with G·c/(H·t + x) ≤ U and x/(H·t + x) ≤ s (closed form)."""
    if groups <= 1:
        return 1
    by_load = (groups * seconds_per_update / max_utilisation - exchange_s) / step_s
    by_share = exchange_s * (1 - max_share) / (max_share * step_s)
    return max(1, math.ceil(max(by_load, by_share) - 1e-9))


# -- one candidate ----------------------------------------------------------------------------


def default_candidates(nodes: int, max_groups: int = 128) -> list[int]:
    """Group counts that divide `nodes` evenly (hpcdl's groups are equal), up to `max_groups`."""
    return [g for g in range(1, min(nodes, max_groups) + 1) if nodes % g == 0]


def evaluate(inputs: PlanInputs, nodes: int, groups: int, *, seed: int = 0,
             staleness_bound: float = 8.0, rounds: int | None = None,
             max_utilisation: float = MAX_APPLIER_UTILISATION,
             max_exchange_share: float = MAX_EXCHANGE_SHARE) -> GroupPlan:
    """Predict one group count (its own random stream: independent of the other candidates)."""
    if nodes < 1 or groups < 1 or nodes % groups:
        raise ValueError(f"{groups} groups do not divide {nodes} nodes evenly")
    p = nodes // groups
    k = inputs.exchange_every
    rng = np.random.default_rng([seed, groups, nodes])
    r = rounds or max(MIN_ROUNDS, math.ceil(TARGET_UPDATES / groups))
    t_c = inputs.compute_seconds
    t_ar = allreduce_seconds(inputs, p)
    slow = slow_nodes_per_group(nodes, groups, inputs.slow_node_fraction)
    slowest = sample_group_slowest(rng, inputs, p, slow, (groups, r, k))
    straggler = t_c * (float(slowest.mean()) - 1.0)
    steps = t_c * slowest + t_ar
    step_flops = p * inputs.batch_per_node * inputs.flops_per_example  # one group step
    peak = nodes * inputs.batch_per_node * inputs.flops_per_example / float(
        np.quantile(steps, PEAK_QUANTILE))
    common = dict(groups=groups, nodes_per_group=p, compute_s=t_c, straggler_s=straggler,
                  allreduce_s=t_ar, peak_flops=peak, applier_capacity=inputs.applier_capacity,
                  every=k, update_bytes=inputs.update_bytes)
    if groups == 1:  # no exchange: hpcdl's exchange.enabled = "auto"
        per_step = float(steps.mean())
        return GroupPlan(**common, exchange_s=0.0, step_s=per_step,
                         sustained_flops=step_flops / per_step, updates_per_s=0.0,
                         applier_utilisation=0.0, exchange_bytes_per_s=0.0, staleness_mean=0.0,
                         staleness_p50=0.0, staleness_p95=0.0, staleness_max=0,
                         dropped_fraction=0.0, feasible=True, reason="")
    sim = simulate_exchange(inputs, p, steps.sum(axis=2))
    step_time = sim.finish / (r * k)  # per group, exchange included
    updates_per_s = float(np.sum(r / sim.finish))
    utilisation = updates_per_s / inputs.applier_capacity
    st = sim.staleness if sim.staleness.size else np.zeros(1, dtype=np.int64)
    mean_step = float(step_time.mean())
    exchange = mean_step - float(steps.mean())
    figures = dict(
        exchange_s=exchange, step_s=mean_step, sustained_flops=float(np.sum(step_flops / step_time)),
        updates_per_s=updates_per_s, applier_utilisation=utilisation,
        exchange_bytes_per_s=sim.bytes_moved / float(sim.finish.max()),
        staleness_mean=float(st.mean()), staleness_p50=float(np.quantile(st, 0.5)),
        staleness_p95=float(np.quantile(st, 0.95)), staleness_max=int(st.max()),
        dropped_fraction=sim.dropped_fraction,
        min_every=smallest_every(groups, float(steps.mean()), exchange * k,
                                 inputs.applier_seconds_per_update, max_utilisation,
                                 max_exchange_share),
    )
    reasons = []
    if utilisation >= 1:
        reasons.append("applier saturated")
    if figures["staleness_mean"] > staleness_bound:
        reasons.append("too stale")
    if sim.dropped_fraction > MAX_DROPPED_FRACTION:
        reasons.append("drops updates")
    return GroupPlan(**common, **figures, feasible=not reasons, reason=", ".join(reasons))


# -- the recommendations ----------------------------------------------------------------------


def recommend(candidates: Sequence[GroupPlan]) -> int | None:
    """The rule (see RULE): best sustained among the feasible; fewer groups within 1 %."""
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return None
    best = max(c.sustained_flops for c in feasible)
    return min(c.groups for c in feasible if c.sustained_flops >= (1 - TIE_FRACTION) * best)


def recommend_every(inputs: PlanInputs, nodes: int, groups: int, *, seed: int = 0,
                    staleness_bound: float = 8.0,
                    max_utilisation: float = MAX_APPLIER_UTILISATION,
                    max_exchange_share: float = MAX_EXCHANGE_SHARE,
                    known: GroupPlan | None = None) -> EveryAdvice:
    """The smallest H whose simulation meets the H rule for `groups` (see the module docstring).

    The closed form's H (from the candidate at the inputs' own H; `known`, if already
    evaluated) is simulated; a search then finds the smallest H the simulation confirms,
    assuming that load and share fall with H.
    """
    tried: dict[int, GroupPlan] = {known.every: known} if known is not None else {}

    def at(h: int) -> GroupPlan:
        if h not in tried:
            tried[h] = evaluate(dataclasses.replace(inputs, exchange_every=h), nodes, groups,
                                seed=seed, staleness_bound=staleness_bound,
                                max_utilisation=max_utilisation,
                                max_exchange_share=max_exchange_share)
        return tried[h]

    def meets(h: int) -> bool:
        c = at(h)
        return c.applier_utilisation <= max_utilisation and c.exchange_share <= max_exchange_share

    hi = min(MAX_EVERY, max(1, at(inputs.exchange_every).min_every))
    lo = 0  # the largest H known to fail (0: none)
    while not meets(hi) and hi < MAX_EVERY:
        lo, hi = hi, min(MAX_EVERY, 2 * hi)
    met = meets(hi)
    if met:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(mid):
                hi = mid
            else:
                lo = mid
    return _advice(inputs, groups, hi, at(hi), met, max_utilisation, max_exchange_share)


def _advice(inputs: PlanInputs, groups: int, h: int, c: GroupPlan, met: bool,
            max_utilisation: float, max_share: float) -> EveryAdvice:
    rule = EVERY_RULE.format(util=max_utilisation, share=max_share)
    if not met:
        bounds = EVERY_BOUNDS.format(util=max_utilisation, share=max_share)
        why = f"no H up to {MAX_EVERY} keeps {bounds}"
    elif h == 1:
        why = f"H = 1 already meets both bounds ({rule})"
    else:
        load = c.applier_utilisation / max_utilisation >= c.exchange_share / max_share
        binding = "applier's load" if load else "exchange's share"
        why = f"{rule}; the {binding} sets it"
    if h > 1 and inputs.exchange_kind == "gradient":
        why += "; with kind gradient an update is the mean of H steps' gradients"
    return EveryAdvice(groups, h, inputs.exchange_kind, c.applier_utilisation, c.exchange_share,
                       c.staleness_mean, c.updates_per_s, c.update_bytes, met, why)


def better_at_own_every(inputs: PlanInputs, nodes: int, candidates: Sequence[GroupPlan],
                        chosen: int | None, *, seed: int = 0, staleness_bound: float = 8.0,
                        max_utilisation: float = MAX_APPLIER_UTILISATION,
                        max_exchange_share: float = MAX_EXCHANGE_SHARE) -> GroupPlan | None:
    """A group count that, run at its own H min instead of the inputs' H, meets both rules and
    sustains more than the recommended one (by more than the 1 % tie), or None.

    The table and the group-count rule describe the job as configured; this is the answer to
    "and if I may change H?" without a second table. Only counts whose H min exceeds the
    inputs' H are tried (the others are in the table already).
    """
    bounds = dict(max_utilisation=max_utilisation, max_exchange_share=max_exchange_share)
    options = []
    for c in candidates:
        if c.groups > 1 and c.min_every > inputs.exchange_every:
            alt = evaluate(dataclasses.replace(inputs, exchange_every=min(MAX_EVERY, c.min_every)),
                           nodes, c.groups, seed=seed, staleness_bound=staleness_bound, **bounds)
            if (alt.feasible and alt.applier_utilisation <= max_utilisation
                    and alt.exchange_share <= max_exchange_share):
                options.append(alt)
    if not options:
        return None
    best = max(options, key=lambda c: (c.sustained_flops, -c.groups))
    floor = 0.0
    if chosen is not None:
        floor = next(c for c in candidates if c.groups == chosen).sustained_flops
    return best if best.sustained_flops > (1 + TIE_FRACTION) * floor else None


def plan(inputs: PlanInputs, nodes: int, candidates: Sequence[int] | None = None, *,
         seed: int = 0, staleness_bound: float = 8.0,
         max_utilisation: float = MAX_APPLIER_UTILISATION,
         max_exchange_share: float = MAX_EXCHANGE_SHARE) -> Plan:
    """Predict every candidate group count (default: divisors of `nodes` up to 128), pick one,
    advise H for it, and name a group count that would do better at another H."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    for name, bound in (("max_utilisation", max_utilisation),
                        ("max_exchange_share", max_exchange_share)):
        if not 0 < bound < 1:
            raise ValueError(f"{name} must be in (0, 1), got {bound}")
    groups = sorted(set(candidates)) if candidates else default_candidates(nodes)
    bad = [g for g in groups if g < 1 or nodes % g]
    if bad:
        raise ValueError(f"group counts {bad} do not divide {nodes} nodes evenly "
                         f"(candidates: {default_candidates(nodes)})")
    kw = dict(seed=seed, staleness_bound=staleness_bound, max_utilisation=max_utilisation,
              max_exchange_share=max_exchange_share)
    results = tuple(evaluate(inputs, nodes, g, **kw) for g in groups)
    chosen = recommend(results)
    advice = None
    if chosen is not None and chosen > 1:
        advice = recommend_every(inputs, nodes, chosen, **kw,
                                 known=next(c for c in results if c.groups == chosen))
    alternative = better_at_own_every(inputs, nodes, results, chosen, **kw)
    shards = None
    if chosen is not None and chosen > 1:
        at_every = dataclasses.replace(inputs, exchange_every=advice.every) if advice and advice.met else inputs
        shards = recommend_shards(at_every, nodes, chosen, seed=seed, max_utilisation=max_utilisation,
                                  max_exchange_share=max_exchange_share)
    return Plan(inputs, nodes, seed, staleness_bound, results, chosen, advice, alternative,
                max_utilisation, max_exchange_share, shards)


@dataclass(frozen=True)
class ShardAdvice:
    """The fewest appliers (exchange.shards) that keep each one at most `max_utilisation` busy."""

    groups: int
    every: int
    shards: int
    applier_utilisation: float  # of each shard, at `shards`
    one_applier_utilisation: float  # of a single applier, for comparison
    shard_bytes: float  # of one update, per shard
    exchange_share: float  # of a group's step spent on its exchange files, at `shards`
    met: bool  # False: the appliers stay busier than the bound, or the groups' exchange share is too large

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MAX_SHARDS = 64  # the largest exchange.shards the advice tries
# Past this share of a group's step in exchange files, a shard more costs every group more than
# raising exchange.every would: the advice stops adding shards there.
MAX_SHARDED_EXCHANGE_SHARE = 0.25


def recommend_shards(inputs: PlanInputs, nodes: int, groups: int, *, seed: int = 0,
                     max_utilisation: float = MAX_APPLIER_UTILISATION,
                     max_exchange_share: float = MAX_EXCHANGE_SHARE) -> ShardAdvice:
    """Simulate S = 1, 2, ... appliers (each sees every update, 1/S of its bytes) and take the
    fewest whose utilisation is at most `max_utilisation` (the H rule's bound, for the same
    reason: an applier busier than that drops updates to its backlog bound as load varies).

    Every shard costs each group root one file operation more per exchange. An overloaded
    applier loses updates, which costs the groups more than a few file operations, so shards are
    added while that lasts, up to MAX_SHARDED_EXCHANGE_SHARE of a group's step; where the per-file
    costs keep every S above the bound, the advice is the least busy S tried, not met. Roots that
    wait for their answers (max_outstanding) wait less as shards relieve the applier, so a share
    above that bound ends the search only while it grows. It is met
    when the utilisation bound holds and the exchange's share of a group's step is at most
    max(`max_exchange_share`, its share at one applier)."""
    first_share = best = previous_share = None
    for count in range(1, MAX_SHARDS + 1):
        c = evaluate(dataclasses.replace(inputs, exchange_shards=count), nodes, groups, seed=seed)
        share = c.exchange_s / c.step_s if c.step_s > 0 else 0.0
        if first_share is None:
            first_share, one = share, c
        elif share > MAX_SHARDED_EXCHANGE_SHARE:
            if share >= previous_share:
                break
            previous_share = share  # roots that wait for an overloaded applier wait less with more
            continue
        previous_share = share
        if best is None or c.applier_utilisation < best[1].applier_utilisation:
            best = (count, c, share)
        if c.applier_utilisation <= max_utilisation:
            break
    count, c, share = best
    met = c.applier_utilisation <= max_utilisation and share <= max(max_exchange_share, first_share)
    return ShardAdvice(groups, inputs.exchange_every, count, c.applier_utilisation,
                       one.applier_utilisation, inputs.update_bytes / count, share, met)


def paper_check(seed: int = 0, inputs: PlanInputs | None = None) -> dict[str, Any]:
    """The paper's inputs at the paper's HEP configuration, beside the paper's figures."""
    inputs = inputs or PlanInputs.paper_cori_hep()
    c = evaluate(inputs, PAPER_HEP_WORKERS, PAPER_HEP_GROUPS, seed=seed)
    return {
        "nodes": PAPER_HEP_WORKERS,
        "groups": PAPER_HEP_GROUPS,
        "predicted_sustained_flops": c.sustained_flops,
        "paper_sustained_flops": PAPER_HEP_SUSTAINED_FLOPS,
        "sustained_ratio": c.sustained_flops / PAPER_HEP_SUSTAINED_FLOPS,
        "predicted_peak_flops": c.peak_flops,
        "paper_peak_flops": PAPER_HEP_PEAK_FLOPS,
        "peak_ratio": c.peak_flops / PAPER_HEP_PEAK_FLOPS,
        "candidate": c.to_dict(),
    }
