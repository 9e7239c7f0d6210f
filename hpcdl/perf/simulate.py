"""The exchange between groups and the applier: a small discrete-event simulation per candidate.

Groups run their steps (times drawn by :mod:`hpcdl.perf.model`); every `exchange_every` = H
steps a group's root publishes one update of u bytes (a fp32 gradient, or a delta of the H
local steps in `delta_dtype`); a transfer costs λ + u/W, λ the exchange medium's latency per
operation and W its bandwidth per client. The applier serves updates in arrival order, one
server, up to `applier_max_batch` at a time: each update costs a read (λ + u/W) and an apply
(n / applier_bytes_per_s: the optimizer runs over every parameter whatever the wire dtype), and
each batch ends with one publish of the new master weights (λ + n/W). The master version counts
applied updates; an update's staleness is ``master version at apply − version its group's
weights came from`` (hpcdl.applier's definition); an update staler than `max_staleness` is
dropped unapplied (if max_staleness ≥ 0), and a group whose pending updates exceed
`max_pending_per_group` deletes its oldest (hpcdl.exchange.Channel's backlog bound).

How a group meets the applier depends on `max_outstanding` = K (hpcdl.exchange.group's ExchangeSync):

* K = 0 (never wait): the root publishes (λ + u/W), lists the directory (λ) and, if a newer master
  version is published, reads it (λ + n/W) and broadcasts it in the group (T(P, n)).
* K ≥ 1: after publishing, a root with K unanswered updates waits for an answer (its update
  applied or dropped by the applier, or deleted by the backlog bound). An answer from the
  applier brings the weights of the batch that processed the update (λ + T(P, n) after the
  batch ends); that is the paper's blocking parameter server for K = 1, where every group is
  G − 1 versions stale. A root under its bound goes on as with K = 0.

The simulation counts versions, not algorithms: a gradient and a delta cost the applier the
same (its CPU per update is the same figure), so `exchange_kind` enters only through the bytes
and through H. Same-time events are handled in the order they were scheduled, the applier's
completions first. With one group there is no exchange (as hpcdl's ``exchange.enabled =
"auto"``); that case never reaches this module.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from hpcdl.perf.inputs import PlanInputs
from hpcdl.perf.model import tree_collective_seconds


@dataclass(frozen=True)
class ExchangeSim:
    staleness: np.ndarray  # of processed updates published after the warm-up rounds
    finish: np.ndarray  # per group: time its last interval ended
    published: int
    applied: int
    dropped_stale: int
    dropped_backlog: int
    adoptions: int
    bytes_moved: float
    applier_busy: float  # seconds

    @property
    def dropped_fraction(self) -> float:
        return (self.dropped_stale + self.dropped_backlog) / max(1, self.published)


@dataclass
class Update:
    """One published update on its way to the applier."""

    group: int
    round: int
    base: int  # the master version the group's weights came from
    alive: bool = True  # False once the backlog bound deleted it


_DONE, _OTHER = 0, 1  # same-time order: applier completions first, then scheduling order


def simulate_exchange(inputs: PlanInputs, group_nodes: int, intervals: np.ndarray,
                      start_offsets: Sequence[float] | None = None,
                      warmup_rounds: int | None = None) -> ExchangeSim:
    """Discrete-event simulation of G groups and one applier (see the module docstring).

    `intervals[g, r]`: group g's compute + allreduce time before its r-th update (r from 0),
    i.e. the sum of `exchange_every` step times. All groups start from master version 0 at
    time `start_offsets[g]` (default 0). Staleness is collected from round `warmup_rounds`
    (default: a fifth of the rounds, at least 1) on.
    """
    return _Simulation(inputs, group_nodes, intervals, start_offsets, warmup_rounds).run()


class _Simulation:
    """The state of one simulation; one method per kind of event."""

    def __init__(self, inputs: PlanInputs, group_nodes: int, intervals: np.ndarray,
                 start_offsets: Sequence[float] | None, warmup_rounds: int | None) -> None:
        self.x = inputs
        self.intervals = np.asarray(intervals, dtype=float)
        n_groups, self.rounds = self.intervals.shape
        self.offsets = (np.zeros(n_groups) if start_offsets is None
                        else np.asarray(start_offsets, float))
        self.warm = max(1, self.rounds // 5) if warmup_rounds is None else warmup_rounds
        # the inputs' derived figures, once (the handlers run thousands of times)
        self.lat, self.k = inputs.exchange_latency, inputs.max_outstanding
        self.u, self.n = inputs.update_bytes, inputs.model_bytes
        self.xfer_u, self.xfer_n = inputs.update_transfer_seconds, inputs.transfer_seconds
        self.bcast = tree_collective_seconds(group_nodes, inputs.model_bytes,
                                             inputs.allreduce_latency, inputs.allreduce_bandwidth)
        self.heap: list[tuple] = []
        self.counter = itertools.count()
        self.held = [0] * n_groups  # master version each group's weights came from
        self.rounds_done = [0] * n_groups
        self.unanswered = [0] * n_groups
        self.waiting = [False] * n_groups
        self.finish = self.offsets.copy()
        self.queue: deque[Update] = deque()
        self.pending: list[deque[Update]] = [deque() for _ in range(n_groups)]
        self.version = self.published_version = 0
        self.busy = False
        self.busy_time = self.bytes_moved = 0.0
        self.published = self.applied = self.dropped_stale = self.dropped_backlog = 0
        self.adoptions = 0
        self.stale: list[int] = []
        self.handlers: dict[str, Callable[[float, Any], None]] = {
            "publish": self.on_publish, "arrive": self.on_arrive, "check": self.on_check,
            "done": self.on_done}

    def run(self) -> ExchangeSim:
        for g in range(len(self.held)):
            self.resume(g, self.offsets[g])
        while self.heap:
            t, _, _, kind, payload = heapq.heappop(self.heap)
            self.handlers[kind](t, payload)
        return ExchangeSim(np.asarray(self.stale, dtype=np.int64), self.finish - self.offsets,
                           self.published, self.applied, self.dropped_stale,
                           self.dropped_backlog, self.adoptions, self.bytes_moved, self.busy_time)

    def push(self, t: float, kind: str, payload: Any, prio: int = _OTHER) -> None:
        heapq.heappush(self.heap, (t, prio, next(self.counter), kind, payload))

    def resume(self, g: int, t: float) -> None:
        """Group g goes on computing; it publishes when its next interval ends."""
        r = self.rounds_done[g]
        if r < self.rounds:
            self.push(t + self.intervals[g, r], "publish", g)

    # -- a group's side -----------------------------------------------------------------------

    def on_publish(self, t: float, g: int) -> None:
        update = Update(g, self.rounds_done[g], self.held[g])
        self.rounds_done[g] += 1
        self.finish[g] = t
        self.published += 1
        self.bytes_moved += self.u
        done = t + self.xfer_u
        self.push(done, "arrive", update)
        if self.k:
            self.unanswered[g] += 1
            if self.unanswered[g] >= self.k:
                self.waiting[g] = True
                return
        self.push(done, "check", g)

    def on_check(self, t: float, g: int) -> None:
        """A listing; newer master weights are read and broadcast in the group."""
        cost = self.lat
        if self.published_version > self.held[g]:
            self.held[g] = self.published_version
            cost += self.xfer_n + self.bcast
            self.adoptions += 1
            self.bytes_moved += self.n
        self.resume(g, t + cost)

    def answer(self, g: int, t: float, from_applier: bool) -> None:
        """One of group g's updates is answered; a waiting group under its bound goes on."""
        if not self.k:
            return
        self.unanswered[g] -= 1
        if not self.waiting[g] or self.unanswered[g] >= self.k:
            return
        self.waiting[g] = False
        if from_applier:  # the answer brings the weights this batch published
            self.held[g] = self.version
            self.adoptions += 1
            self.resume(g, t + self.lat + self.bcast)
        else:  # deleted by the backlog bound: the root sees it is gone at its next listing
            self.push(t, "check", g)

    # -- the applier's side -------------------------------------------------------------------

    def on_arrive(self, t: float, update: Update) -> None:
        g = update.group
        self.queue.append(update)
        self.pending[g].append(update)
        bound = self.x.max_pending_per_group
        if bound and len(self.pending[g]) > bound:
            self.pending[g].popleft().alive = False
            self.dropped_backlog += 1
            self.answer(g, t, from_applier=False)
        if not self.busy:
            self.start_batch(t)

    def start_batch(self, t: float) -> None:
        batch: list[Update] = []
        while self.queue and len(batch) < self.x.applier_max_batch:
            update = self.queue.popleft()
            if update.alive:
                self.pending[update.group].popleft()
                batch.append(update)
        if not batch:
            self.busy = False
            return
        n_applied = 0
        max_stale = self.x.max_staleness
        for update in batch:
            s = self.version - update.base
            if update.round >= self.warm:
                self.stale.append(s)
            if max_stale >= 0 and s > max_stale:
                self.dropped_stale += 1
            else:
                self.version += 1
                n_applied += 1
        self.applied += n_applied
        service = self.x.applier_batch_seconds(len(batch), n_applied)
        self.busy, self.busy_time = True, self.busy_time + service
        self.bytes_moved += self.u * len(batch)
        if n_applied or self.k:
            self.bytes_moved += self.n
        self.push(t + service, "done", batch, _DONE)

    def on_done(self, t: float, batch: list[Update]) -> None:
        self.busy = False
        self.published_version = max(self.published_version, self.version)
        for update in batch:
            self.answer(update.group, t, from_applier=True)
        self.start_batch(t)
