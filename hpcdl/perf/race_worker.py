"""The TensorFlow side of the emulated race (hpcdl.perf.race): real steps and real scores of any
workload, through the Workload interface only.

One model, one optimizer (:func:`hpcdl.engine.optim.make_optimizer`) and one traced step
(:func:`hpcdl.engine.step.make_train_step`, no Horovod) serve every group: a group's weights and
optimizer state are numpy arrays, loaded into the variables before its step and read back after
it, so G groups cost one trace, not G. Loading float32 arrays is exact, so a group's steps are
the engine's steps.

A group's batch holds its ranks' batches, and its loss is the mean of each rank's own loss
(`Workload.group_loss`), as Horovod averages the ranks' gradients: a weighted loss normalised per
batch (HEP's) is not the loss of the whole batch, and the race measured that difference
(docs/results.md).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hpcdl.applier.rules import applier_learning_rate
from hpcdl.perf.race import EmulatedRace, RaceClock, RaceResult

Arrays = dict[str, np.ndarray]


@dataclasses.dataclass
class Replica:
    """One group's copy of the model: weights by name, and its optimizer's variables in order."""

    weights: Arrays
    optimizer: list


class TfTrainer:
    """The job's model, optimizer and train step, shared by the groups (see the module)."""

    def __init__(self, workload, job, input_shape: tuple[int, ...], seed: int):
        import tensorflow as tf

        from hpcdl.engine.optim import make_optimizer
        from hpcdl.engine.step import make_train_step

        self.model = workload.build_model(job.model, input_shape, seed=seed)
        named = self.model.named_variables()
        self.names = [n for n, _ in named]
        self.variables = [v for _, v in named]
        self.optimizer = make_optimizer(job.train.optimizer, self.variables, job.train.learning_rate)
        self.optimizer_variables = list(self.optimizer.variables)
        ranks = job.run.ranks_per_group
        self.train_step = make_train_step(lambda batch: workload.group_loss(self.model, batch, ranks, training=True),
                                          self.variables, self.optimizer)
        state = self.variables + self.optimizer_variables
        # one traced call each way, not one eager op per variable: a swap then costs little beside a step
        self._load = tf.function(lambda values: [v.assign(x) for v, x in zip(state, values)] and None)
        self._read = tf.function(lambda: [tf.identity(v) for v in state])
        self.initial_state = self._replica(self._read())
        self.loaded: Replica | None = None  # whose state the variables hold now

    def _replica(self, values) -> Replica:
        values = [v.numpy() for v in values]
        return Replica(dict(zip(self.names, values)), values[len(self.names):])

    def initial(self) -> Replica:
        s = self.initial_state
        return Replica({n: w.copy() for n, w in s.weights.items()}, [np.copy(o) for o in s.optimizer])

    def step(self, replica: Replica, batch) -> Arrays | None:
        """One step of the group's optimizer on `replica`; its gradient, or None if not finite."""
        if self.loaded is not replica:
            self._load([*replica.weights.values(), *replica.optimizer])
            self.loaded = replica
        _loss, grads, finite, _own = self.train_step(batch)
        if not bool(np.all(finite.numpy())):
            return None
        fresh = self._replica(self._read())
        replica.weights, replica.optimizer = fresh.weights, fresh.optimizer
        return {n: g.numpy() for n, g in zip(self.names, grads)}

    def weights(self, replica: Replica) -> Arrays:
        return {n: w.copy() for n, w in replica.weights.items()}

    def adopt(self, replica: Replica, weights: Arrays) -> None:
        """The master's weights replace the group's; its optimizer keeps its state."""
        replica.weights = {n: np.array(weights[n], copy=True) for n in self.names}
        if self.loaded is replica:
            self.loaded = None


def make_scorer(workload, job, stats: dict[str, Any], input_shape: tuple[int, ...], data: Path,
                limit: int, metric: str) -> Callable[[Arrays], float]:
    """`workload.validate` of given weights on the first `limit` examples of `data`: `metric`,
    NaN when the workload gives none (non-finite weights, one class in the subset)."""
    model = workload.build_model(job.model, input_shape, seed=0)
    variables = dict(model.named_variables())
    offered = workload.validate(model, stats, data, limit)
    if metric not in offered:
        raise ValueError(f"{job.workload}'s validation on {data} gives {', '.join(sorted(offered))}, "
                         f"not {metric!r}")

    def score(weights: Arrays) -> float:
        if not all(np.isfinite(w).all() for w in weights.values()):
            return float("nan")
        for name, var in variables.items():
            var.assign(weights[name])
        return float(workload.validate(model, stats, data, limit).get(metric, float("nan")))

    return score


def group_batches(workload, job, stats: dict[str, Any], seed: int) -> list:
    """Each group's stream: its ranks' batches side by side, rank r of group g reading shard
    g·P + r of N as the engine's ranks do, so the race sees a real run's data in its order.
    Every rank holds its own chunk (data.chunk_events) in memory, as on a node."""
    groups, size = job.run.groups, job.run.ranks_per_group

    def stream(g: int):
        import tensorflow as tf

        ranks = [workload.train_batches(job, stats, g * size + r, groups * size, seed=seed) for r in range(size)]
        try:
            while True:
                parts = [next(it, None) for it in ranks]
                if any(p is None for p in parts):
                    return
                yield tf.nest.map_structure(lambda *xs: np.concatenate(xs), *parts)
        finally:
            for it in ranks:
                it.close()

    return [stream(g) for g in range(groups)]


def emulated_race(workload, job, stats: dict[str, Any], clock: RaceClock, *, score: Callable[[Arrays], float],
                  score_every: float, horizon: float, stop: Callable[[list], bool] | None = None) -> RaceResult:
    """One race of `job` (its run.nodes ranks in run.groups groups, its [exchange], its model and
    optimizer, seeded by train.seed; the stragglers seeded by clock.stragglers.seed)."""
    import tensorflow as tf

    tf.random.set_seed(job.train.seed)  # dropout's masks
    trainer = TfTrainer(workload, job, workload.input_shape(job), seed=job.train.seed)
    batches = group_batches(workload, job, stats, seed=job.train.seed)
    try:
        race = EmulatedRace(job, trainer, batches, clock, score=score, score_every=score_every,
                            horizon=horizon, stop=stop)
        return race.run()
    finally:
        for it in batches:
            it.close()


@dataclasses.dataclass
class AccuracyPlan:
    """`hpcdl plan --target`'s answer: per group count, its tuned rate and time to target."""

    target: Any  # accuracy.Target
    nodes: int
    race_ranks: int
    horizon_s: float
    score_every_s: float
    outcomes: list
    recommended: Any  # accuracy.Outcome or None
    basis: list  # what the recommendation rests on, a line each

    def to_dict(self) -> dict[str, Any]:
        best = self.recommended
        return {"target": str(self.target), "nodes": self.nodes, "race_ranks": self.race_ranks,
                "horizon_s": self.horizon_s, "score_every_s": self.score_every_s,
                "outcomes": [o.to_dict() for o in self.outcomes],
                "recommended_groups": best.groups if best else None,
                "recommended_rate": best.rate if best else None, "basis": self.basis}


def sync_step_seconds(inputs, nodes: int, seed: int, draws: int = 256) -> float:
    """The planner's mean step of one synchronous group of `nodes` (stragglers and allreduce)."""
    from hpcdl.perf.model import allreduce_seconds
    from hpcdl.perf.race import PlannedStragglers

    stragglers = PlannedStragglers(inputs, nodes, 1, seed)
    slowest = np.mean([stragglers.slowest(0, k) for k in range(draws)])
    return inputs.compute_seconds * float(slowest) + allreduce_seconds(inputs, nodes)


def race_wall_seconds(workload, job, stats: dict[str, Any], score: Callable[[Arrays], float], steps: int,
                      scores: int, groups: int = 1) -> tuple[float, float]:
    """(this machine's wall seconds for one race of `groups` groups of `job`'s run.nodes ranks,
    `steps` steps each, and `scores` scores; of which a group's step): the race's start (its
    trainer, its ranks' first data, the step's trace), then a group's step — two groups in turn
    where there are several, as the race swaps their weights in and out — and a score."""
    import time

    size = job.run.nodes // groups
    job = dataclasses.replace(job, run=dataclasses.replace(job.run, group_size=size))
    started = time.perf_counter()
    trainer = TfTrainer(workload, job, workload.input_shape(job), seed=job.train.seed)
    streams = group_batches(workload, job, stats, seed=job.train.seed)
    try:
        replicas = [trainer.initial() for _ in range(min(groups, 2))]
        trainer.step(replicas[0], next(streams[0]))
        start = time.perf_counter() - started
        score(trainer.weights(replicas[0]))
        started = time.perf_counter()
        for replica in replicas:
            trainer.step(replica, next(streams[0]))
        step = (time.perf_counter() - started) / len(replicas)
        started = time.perf_counter()
        score(trainer.weights(replicas[0]))
        return start + groups * steps * step + scores * (time.perf_counter() - started), step
    finally:
        for stream in streams:
            stream.close()


def duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.0f} h"


def plan_accuracy(workload, job, inputs, nodes: int, target, *, race_ranks: int, groups: list[int],
                  steps: int, race_seeds: int, tuning_seed: int, extend: int = 4, scores: int = 40,
                  budget_s: float = 0.0, copy: tuple[str, ...] = (),
                  progress: Callable[[str], None] | None = None,
                  note: Callable[[str], None] = lambda _: None) -> AccuracyPlan:
    """Race `job`'s model on its data for each group count of `nodes` (emulated at `race_ranks`
    ranks, timed at `nodes` by the planner's model under `inputs`), for `steps` steps of the
    synchronous group's mean time; tune each count's rate, race `race_seeds` seeds, recommend.
    With `budget_s`, races this machine would take longer than that for are run on a smaller copy
    of the job that fits (:func:`fit_budget`), or refused before they start (ValueError). `copy`:
    the overrides that made `job` a smaller copy of the planned one, said in what the plan rests on."""
    import tensorflow as tf

    from hpcdl.perf.accuracy import Run, race_groups, recommend
    from hpcdl.perf.race import RaceClock

    val = Path(getattr(job.data, "val", "") or "")
    if not val.is_file():
        raise ValueError(f"plan --target scores the job's data.val, which is not a file: {str(val)!r}")
    # Every race builds its groups' steps and scorer anew, so TensorFlow's retracing warnings
    # would only say what is by design.
    tf.get_logger().setLevel("ERROR")
    stats = workload.compute_stats(job)
    horizon = steps * sync_step_seconds(inputs, nodes, job.train.seed)
    every = horizon / scores

    def race_job(job, g: int, rate: float, seed: int):
        lr = {"learning_rate": rate} if g == 1 else {}
        run = dataclasses.replace(job.run, nodes=race_ranks, group_size=race_ranks // g)
        train = dataclasses.replace(job.train, seed=seed, **lr)
        exchange = job.exchange if g == 1 else dataclasses.replace(job.exchange, learning_rate=rate)
        return dataclasses.replace(job, run=run, train=train, exchange=exchange)

    fitted = ""
    if budget_s:
        # a group of fewer nodes steps faster, so G groups make more steps each in the horizon
        group_steps = {g: math.ceil(horizon / sync_step_seconds(inputs, nodes // g, job.train.seed)) for g in groups}
        raced, copy, fitted = fit_budget(
            workload, race_job(job, 1, job.train.learning_rate, tuning_seed), stats, target.metric, val, group_steps,
            scores, budgeted_races(1, race_seeds), budget_s, copy)
        job = dataclasses.replace(job, model=raced.model, train=dataclasses.replace(
            job.train, batch_per_rank=raced.train.batch_per_rank))
        if fitted:
            note(f"{fitted}; racing a smaller copy ({', '.join(copy)})")
    scorer = make_scorer(workload, job, stats, workload.input_shape(job), val, job.train.validate_events,
                         target.metric)
    untrained: list[float] = []

    def outcome_of(g: int, rate: float, seed: int) -> Run:
        if progress:
            progress(f"G={g} rate {rate:.3g} seed {seed}")
        result = emulated_race(workload, race_job(job, g, rate, seed), stats,
                               RaceClock.planned(inputs, nodes, g, seed), score=scorer, score_every=every,
                               horizon=horizon, stop=lambda curve: Run(curve, False).reached_at(target) is not None)
        first = result.curve[0][-1]  # the untrained model's score
        if target.met(first):
            raise ValueError(f"the untrained model already scores {target.metric} {first:.4g} (seed {seed}), "
                             f"so {target} measures no training: choose a target it does not meet")
        untrained.append(first)
        return Run(result.curve, result.stopped.startswith("not finite"))

    centres = {g: job.train.learning_rate if g == 1 else
               applier_learning_rate(job.exchange, job.train.learning_rate, g) for g in groups}
    outcomes = race_groups(outcome_of, groups, centres, target, horizon=horizon, tuning_seeds=[tuning_seed],
                           race_seeds=list(range(race_seeds)), extend=extend)
    basis = _basis(job, inputs, nodes, target, race_ranks, tuning_seed, extend, race_seeds, horizon, steps, every,
                   untrained, copy, fitted)
    return AccuracyPlan(target, nodes, race_ranks, horizon, every, outcomes, recommend(outcomes), basis)


def budgeted_races(groups: int, race_seeds: int) -> int:
    """The races a plan is budgeted for: per group count a sweep's three rates, one extension of
    its grid (a sweep whose best sits at an edge races one more rate, or several), the race seeds."""
    return groups * (3 + 1 + race_seeds)


# Below this per-rank batch a loss normalised per batch (HEP's weighted one) is mostly noise.
MIN_RACE_BATCH = 8


def smaller_copies(workload, job):
    """Ever cheaper copies of `job`, each with the overrides that made it: the workload's
    narrower model while it has one (a step's samples stay the job's), then half the per-rank
    batch, down to MIN_RACE_BATCH."""
    made: dict[str, str] = {}
    while True:
        narrower = workload.narrower_model(job.model)
        if narrower is not None:
            model, override = narrower
            job = dataclasses.replace(job, model=model)
        elif job.train.batch_per_rank >= 2 * MIN_RACE_BATCH:
            batch = job.train.batch_per_rank // 2
            job = dataclasses.replace(job, train=dataclasses.replace(job.train, batch_per_rank=batch))
            override = f"train.batch_per_rank={batch}"
        else:
            return
        made[override.split("=")[0]] = override
        yield job, tuple(made.values())


def fit_budget(workload, job, stats, metric: str, val: Path, group_steps: dict[int, int], scores: int,
               races_per_count: int, budget_s: float, copy: tuple[str, ...]) -> tuple[Any, tuple[str, ...], str]:
    """(the job to race, the overrides that made it, why a copy) for `races_per_count` races of
    each group count G in `group_steps` (G groups of that many steps each; `job` is the synchronous
    one) within `budget_s` here, less the time the fitting itself takes: `job` where its timed
    race says it fits, else the first of :func:`smaller_copies` that does (its estimate scaled from
    the last one timed by its FLOPs per step, then timed before it is chosen), unless `copy` says
    the user chose the copy already. ValueError where none fits."""
    import time

    began = time.monotonic()

    def left() -> float:
        return budget_s - (time.monotonic() - began)

    def timed(j) -> tuple[float, bool]:
        """(the plan's races of `j` here, whether all were timed): the costliest group count first,
        and no more once the sum is over what is left (it cannot fit then)."""
        scorer = make_scorer(workload, j, stats, workload.input_shape(j), val, j.train.validate_events, metric)
        total = 0.0
        for g, n in sorted(group_steps.items(), key=lambda item: -item[0] * item[1]):
            total += races_per_count * race_wall_seconds(workload, j, stats, scorer, n, scores, g)[0]
            if total > left():
                return total, False
        return total, True

    def about(seconds: float, complete: bool) -> str:
        return f"{'about' if complete else 'at least'} {duration(seconds)}"

    def flops_per_step(j) -> float | None:
        try:
            return workload.network_cost(j)[0] * j.train.batch_per_rank
        except (ValueError, OSError):
            return None

    own, complete = timed(job)
    if complete:
        return job, copy, ""
    smallest = None
    if not copy:
        last_s, last_flops = own, flops_per_step(job)
        for smaller, made in smaller_copies(workload, job):
            smallest = made
            flops = flops_per_step(smaller)
            if last_flops and flops and last_s * flops / last_flops > left():
                continue
            measured, fits = timed(smaller)
            if fits:
                return smaller, made, f"the job's own races would take {about(own, complete)} here"
            last_s, last_flops = measured, flops
    raise ValueError(
        f"racing {races_per_count * len(group_steps)} times {min(group_steps.values())} or more steps of "
        f"{job.run.nodes} ranks × {job.train.batch_per_rank} examples would take {about(own, complete)} here, "
        f"over the budget of {budget_s / 60:g} min"
        + (f", and so would its smallest copy ({', '.join(smallest)})" if smallest else "")
        + ": lower --race-steps or --race-ranks, race fewer --groups"
        + ("" if smallest else ", or race a smaller copy of the job (--race-set model.…, "
                               "--race-set train.batch_per_rank=…)")
        + "; --race-budget 0 races anyway")


def _basis(job, inputs, nodes: int, target, race_ranks: int, tuning_seed: int, extend: int, race_seeds: int,
           horizon: float, steps: int, every: float, untrained: list[float], copy: tuple[str, ...],
           fitted: str) -> list[str]:
    """What the recommendation rests on: a line each for the learning, the time and the rates."""
    model = "the job's model and data"
    if copy:
        why = f", chosen to fit --race-budget: {fitted}" if fitted else ""
        model = f"a copy of the job ({', '.join(copy)}{why}) on its data"
    return [
        f"learning: {model}, {race_ranks} emulated ranks of {job.train.batch_per_rank} "
        f"examples in G groups (a group's step averages its ranks' gradients); steps to {target} are assumed "
        f"not to change between {race_ranks} and {nodes} nodes",
        f"time: the planner's model at {nodes} nodes ({inputs.label}): a node's step "
        f"{inputs.compute_seconds:.3g} s, stragglers σ {inputs.straggler_sigma:g}, stalls "
        f"{inputs.stall_probability:g} × {inputs.stall_factor:g}, slow nodes {inputs.slow_node_fraction:g} × "
        f"{inputs.slow_factor:g}, allreduce and exchange as `hpcdl plan` models them",
        f"rates: a factor-2 sweep per G on tuning seed {tuning_seed}, extended until interior "
        f"(at most {extend} times); times over race seeds 0–{race_seeds - 1}; "
        f"horizon {horizon:.3g} s ({steps} synchronous steps), scored every {every:.3g} s; "
        f"the untrained model scored {target.metric} {min(untrained):.3g}–{max(untrained):.3g}",
    ]
