"""The emulated race: N ranks in G groups train a workload's real model on its real data, in one
process, on a discrete-event clock (no sleeps, blind to the machine's load).

Time. A group's step k lasts ``step_seconds`` times its slowest node's factor, plus the
planner's allreduce T(P, n) (:func:`hpcdl.perf.model.allreduce_seconds`). The factor is either
the straggler emulator's own draw, ``max_r X(seed, shard_r, k)`` over the group's emulated ranks
(:func:`hpcdl.process.emulate.step_factor`, shard = group × size + rank, as a real run numbers its
ranks), or the planner's (:class:`PlannedStragglers`: :func:`hpcdl.perf.model.sample_group_slowest`
over the P = `group_nodes` nodes of a group at the planned scale, which may exceed the emulated
ranks: the race then learns at its own size on the time of the planned one).
With planner inputs (:class:`hpcdl.perf.inputs.PlanInputs`) the exchange costs what
:mod:`hpcdl.perf.simulate` charges: a publish λ + u/W, a listing λ, an adoption λ + n/W and its
broadcast T(P, n), and an applier batch :meth:`PlanInputs.applier_batch_seconds` (or
`applier_seconds` per update when given). Without inputs the network and exchange are free.

Learning. A group's step is ONE batch of the group's size (ranks × batch per rank), so hundreds
of ranks cost what their groups' batches cost; the `trainer` (:mod:`hpcdl.perf.race_worker` for
TensorFlow) applies the job's optimizer to the group's own weights and returns the gradient, as
a real group's step does. With one group there is no exchange: plain synchronous SGD. With
several, each group's root acts as :class:`hpcdl.exchange.group.ExchangeSync`: every
`exchange.every` steps it publishes the mean gradient, or the delta ``θ_base − θ_local``, tagged
with the master version its weights came from; with K = `max_outstanding` (1 during the first
`warmup_steps`) it waits while K of its updates are unanswered; then, if the applier published
a newer version, it adopts those weights (its optimizer keeps its slots). The applier
(:class:`hpcdl.applier.server.Applier`) serves updates in arrival order, `max_batch` at a time:
staleness = master version − base version; staler than `max_staleness`: dropped, or applied at
lr / (1 + staleness) (`stale_policy`); `staleness_scaling`: lr / max(1, staleness); the job's
update rule (:func:`hpcdl.applier.rules.make_rule`) moves the master; each batch ends with one
published version, which answers its updates. A group's backlog beyond `max_pending_per_group`
loses its oldest update (the channel's bound). Not modelled: reply timeouts, failures. Scores:
`score(weights)` of the newest published master (one group: its weights) every `score_every`
emulated seconds from 0, the untrained model first.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from hpcdl.applier.config import ApplierConfig
from hpcdl.applier.rules import make_rule
from hpcdl.config import EmulateConfig
from hpcdl.process.emulate import step_factor
from hpcdl.perf.inputs import PlanInputs
from hpcdl.perf.model import allreduce_seconds, sample_group_slowest, slow_nodes_per_group, tree_collective_seconds

Arrays = dict[str, np.ndarray]  # tensors by name
_APPLIER, _GROUP, _SCORE = 0, 1, 2  # same-time events: the applier's answers first, scores last


@dataclass(frozen=True)
class PlannedStragglers:
    """The planner's straggler model (σ, stalls, slow nodes of `inputs`) for `groups` groups of
    `group_nodes` nodes: the slowest node's factor of a group's step, seeded by (seed, group, step)."""

    inputs: PlanInputs
    group_nodes: int
    groups: int
    seed: int = 0

    def slowest(self, group: int, step: int) -> float:
        slow = slow_nodes_per_group(self.group_nodes * self.groups, self.groups, self.inputs.slow_node_fraction)
        rng = np.random.default_rng([self.seed, group, step])
        return float(sample_group_slowest(rng, self.inputs, self.group_nodes, slow[group:group + 1], (1,))[0])


@dataclass(frozen=True)
class RaceClock:
    """What the emulated events cost: the step, its stragglers, the network and the applier."""

    step_seconds: float = 0.2
    stragglers: EmulateConfig | PlannedStragglers = EmulateConfig()
    inputs: PlanInputs | None = None  # α, B, n, the exchange medium and the applier; None: free
    applier_seconds: float | None = None  # per update; None: the planner's model (0 without inputs)

    @classmethod
    def planned(cls, inputs: PlanInputs, nodes: int, groups: int, seed: int) -> "RaceClock":
        """The planner's clock for `nodes` in `groups` groups: its compute time b·F/R, stragglers,
        allreduce, exchange and applier (one model for throughput and time to accuracy)."""
        return cls(inputs.compute_seconds, PlannedStragglers(inputs, nodes // groups, groups, seed), inputs)

    def nodes(self, size: int) -> int:
        """A group's nodes in time: the planned scale's, else the emulated ranks'."""
        return self.stragglers.group_nodes if isinstance(self.stragglers, PlannedStragglers) else size

    def group_step(self, group: int, size: int, step: int) -> float:
        if isinstance(self.stragglers, PlannedStragglers):
            slowest = self.stragglers.slowest(group, step)
        else:
            slowest = max(step_factor(self.stragglers, group * size + r, step) for r in range(size))
        network = allreduce_seconds(self.inputs, self.nodes(size)) if self.inputs else 0.0
        return self.step_seconds * slowest + network

    def publish(self) -> float:
        return self.inputs.update_transfer_seconds if self.inputs else 0.0

    def listing(self) -> float:
        return self.inputs.exchange_shards * self.inputs.exchange_latency if self.inputs else 0.0

    def adoption(self, size: int) -> float:
        i = self.inputs
        if i is None:
            return 0.0
        return i.transfer_seconds + tree_collective_seconds(self.nodes(size), i.model_bytes, i.allreduce_latency,
                                                            i.allreduce_bandwidth)

    def applier_batch(self, updates: int, applied: int) -> float:
        if self.applier_seconds is not None:
            return updates * self.applier_seconds
        return self.inputs.applier_batch_seconds(updates, applied) if self.inputs else 0.0


@dataclass
class Update:
    group: int
    base_version: int
    tensors: Arrays


@dataclass
class _Group:
    index: int
    replica: Any  # the trainer's: weights and optimizer state
    batches: Iterator
    step: int = 0
    version: int = 0  # the master version its weights derive from
    published: int = 0
    answered: int = 0
    waiting: int = 0  # K while the root waits for answers, else 0
    wait_from: float = 0.0
    wait_seconds: float = 0.0
    base: Arrays | None = None  # delta: the weights the local steps began from
    grad_sum: Arrays | None = None
    grad_count: int = 0

    def unanswered(self) -> int:
        return self.published - self.answered


@dataclass
class RaceResult:
    """A race's scores and the exchange's figures."""
    curve: list = field(default_factory=list)  # (emulated s, samples trained, master version, score)
    stopped: str = ""
    group_steps: list = field(default_factory=list)
    staleness: list = field(default_factory=list)  # of every update the applier processed
    counters: dict = field(default_factory=lambda: dict.fromkeys(
        ("applied", "dropped_stale", "downweighted", "dropped_backlog", "adoptions"), 0))
    wait_seconds: list = field(default_factory=list)  # per group: waiting for answers
    applier_busy_s: float = 0.0
    weights: dict = field(default_factory=dict)  # the newest master's (one group: its own) at the end


class EmulatedRace:
    """One race: `trainer` offers initial(), step(replica, batch) -> gradient or None (not
    finite), weights(replica) and adopt(replica, weights); `batches[g]` are group g's batches."""

    def __init__(self, job, trainer, batches: Sequence[Iterator], clock: RaceClock, *,
                 score: Callable[[Arrays], float], score_every: float, horizon: float,
                 stop: Callable[[list], bool] | None = None):
        self.job, self.trainer, self.clock = job, trainer, clock
        self.x = job.exchange
        self.size = job.run.ranks_per_group
        self.group_batch = self.size * job.train.batch_per_rank
        self.groups = [_Group(g, trainer.initial(), it) for g, it in enumerate(batches)]
        if len(self.groups) != job.run.groups:
            raise ValueError(f"{len(self.groups)} batch streams for {job.run.groups} groups")
        self.exchange = self.x.active(len(self.groups))
        self.applier = ApplierConfig.for_job(job)
        self.rule = make_rule(self.applier.optimizer, self.applier.rule_params)
        self.master = trainer.weights(self.groups[0].replica)
        self.slots = {s: {n: np.zeros_like(w) for n, w in self.master.items()} for s in self.rule.slots}
        self.version, self.t_rule = 0, 0
        self.published = (0, _copy(self.master))
        self.queue: deque[Update] = deque()
        self.busy = False
        self.score, self.score_every, self.horizon, self.stop = score, score_every, horizon, stop
        self.events: list = []
        self.counter = itertools.count()
        self.result = RaceResult()

    def push(self, t: float, prio: int, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (t, prio, next(self.counter), kind, payload))

    def run(self) -> RaceResult:
        for g in self.groups:
            if self.x.kind == "delta":
                g.base = self.trainer.weights(g.replica)
            self.start(g, 0.0)
        self.push(0.0, _SCORE, "score", 0)
        handlers = {"step": self.on_step, "check": self.on_check, "arrive": self.on_arrive,
                    "answer": self.on_answer, "score": self.on_score}
        while self.events and not self.result.stopped:
            t, _prio, _n, kind, payload = heapq.heappop(self.events)
            if t > self.horizon:
                self.result.stopped = "horizon"
                break
            handlers[kind](t, payload)
        r = self.result
        r.stopped = r.stopped or "no events"
        r.group_steps = [g.step for g in self.groups]
        r.wait_seconds = [round(g.wait_seconds, 6) for g in self.groups]
        r.weights = self.published[1] if self.exchange else self.trainer.weights(self.groups[0].replica)
        return r

    # -- the groups ----------------------------------------------------------------------------

    def start(self, g: _Group, t: float) -> None:
        self.push(t + self.clock.group_step(g.index, self.size, g.step + 1), _GROUP, "step", g)

    def on_step(self, t: float, g: _Group) -> None:
        g.step += 1
        grads = self.trainer.step(g.replica, next(g.batches))
        if grads is None:
            self.result.stopped = f"not finite: group {g.index} step {g.step}"
            return
        if not self.exchange:
            return self.start(g, t)
        x = self.x
        if x.kind == "gradient" and x.every > 1:
            g.grad_sum = grads if g.grad_sum is None else {n: g.grad_sum[n] + v for n, v in grads.items()}
            g.grad_count += 1
        if g.step % x.every:
            return self.start(g, t)
        if x.kind == "delta":
            local = self.trainer.weights(g.replica)
            update = {n: (g.base[n] - v).astype(x.delta_dtype) for n, v in local.items()}
            g.base = local
        elif x.every > 1:
            update = {n: s / g.grad_count for n, s in g.grad_sum.items()}
            g.grad_sum, g.grad_count = None, 0
        else:
            update = grads
        t += self.clock.publish()
        g.published += 1
        self.push(t, _APPLIER, "arrive", Update(g.index, g.version, update))
        limit = 1 if g.step <= x.warmup_steps else x.max_outstanding
        if limit and g.unanswered() >= limit:
            g.waiting, g.wait_from = limit, t
            return
        self.push(t + self.clock.listing(), _GROUP, "check", g)

    def on_check(self, t: float, g: _Group) -> None:
        """The root lists the directory; a newer published version is read and broadcast."""
        version, weights = self.published
        if version > g.version:
            self.trainer.adopt(g.replica, weights)
            g.version = version
            if self.x.kind == "delta":
                g.base = _copy(weights)
            self.result.counters["adoptions"] += 1
            t += self.clock.adoption(self.size)
        self.start(g, t)

    # -- the applier ---------------------------------------------------------------------------

    def on_arrive(self, t: float, update: Update) -> None:
        mine = [u for u in self.queue if u.group == update.group]
        bound = self.x.max_pending_per_group
        for old in mine[:max(0, len(mine) + 1 - bound)]:
            self.queue.remove(old)  # the channel's backlog bound: the oldest goes unapplied
            self.result.counters["dropped_backlog"] += 1
            self.answer(self.groups[old.group], t)
        self.queue.append(update)
        if not self.busy:
            self.start_batch(t)

    def start_batch(self, t: float) -> None:
        """Apply up to max_batch queued updates (the master moves now; it is published, and the
        updates answered, when the batch's emulated time has passed)."""
        batch = [self.queue.popleft() for _ in range(min(len(self.queue), self.applier.max_batch))]
        applied = sum(self.process(u) for u in batch)
        seconds = self.clock.applier_batch(len(batch), applied)
        self.busy = True
        self.result.applier_busy_s += seconds
        published = (self.version, _copy(self.master)) if applied else None
        self.push(t + seconds, _APPLIER, "answer", (published, [u.group for u in batch]))

    def process(self, u: Update) -> bool:
        a, counters = self.applier, self.result.counters
        staleness = max(0, self.version - u.base_version)
        self.result.staleness.append(staleness)
        scale = 1.0 / max(1, staleness) if a.staleness_scaling else 1.0
        if a.max_staleness is not None and staleness > a.max_staleness:
            if a.stale_policy == "drop":
                counters["dropped_stale"] += 1
                return False
            scale = min(scale, 1.0 / (1.0 + staleness))
            counters["downweighted"] += 1
        self.t_rule += 1
        self.rule.apply(self.master, self.slots, u.tensors, scale, self.t_rule)
        self.version += 1
        counters["applied"] += 1
        return True

    def on_answer(self, t: float, payload) -> None:
        published, groups = payload
        if published is not None:
            self.published = published
        for index in groups:
            self.answer(self.groups[index], t)
        self.busy = False
        if self.queue:
            self.start_batch(t)

    def answer(self, g: _Group, t: float) -> None:
        g.answered += 1
        if g.waiting and g.unanswered() < g.waiting:
            g.waiting = 0
            g.wait_seconds += t - g.wait_from
            self.push(t + self.clock.listing(), _GROUP, "check", g)

    # -- scores --------------------------------------------------------------------------------

    def on_score(self, t: float, k: int) -> None:
        if self.exchange:
            version, weights = self.published
        else:
            version, weights = self.groups[0].step, self.trainer.weights(self.groups[0].replica)
        samples = sum(g.step for g in self.groups) * self.group_batch
        self.result.curve.append((round(t, 6), samples, version, float(self.score(weights))))
        if self.stop is not None and self.stop(self.result.curve):
            self.result.stopped = "stop rule"
            return
        self.push((k + 1) * self.score_every, _SCORE, "score", k + 1)


def _copy(tensors: Arrays) -> Arrays:
    return {n: np.array(v, copy=True) for n, v in tensors.items()}