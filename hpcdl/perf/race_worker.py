"""The TensorFlow side of the emulated race (hpcdl.perf.race): real steps and real scores of any
workload, through the Workload interface only.

One model, one optimizer (:func:`hpcdl.engine.optim.make_optimizer`) and one traced step
(:func:`hpcdl.engine.step.make_train_step`, no Horovod) serve every group: a group's weights and
optimizer state are numpy arrays, loaded into the variables before its step and read back after
it, so G groups cost one trace, not G. Loading float32 arrays is exact, so a group's steps are
the engine's steps.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np

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
        self.train_step = make_train_step(lambda batch: workload.loss(self.model, batch, training=True),
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

    def score(weights: Arrays) -> float:
        if not all(np.isfinite(w).all() for w in weights.values()):
            return float("nan")
        for name, var in variables.items():
            var.assign(weights[name])
        return float(workload.validate(model, stats, data, limit).get(metric, float("nan")))

    return score


def group_batches(workload, job, stats: dict[str, Any], seed: int) -> list:
    """Each group's stream: ONE batch of the group's size (ranks × batch per rank), shard g of G."""
    groups, size = job.run.groups, job.run.ranks_per_group
    train = dataclasses.replace(job.train, batch_per_rank=size * job.train.batch_per_rank)
    group_job = dataclasses.replace(job, train=train)
    return [workload.train_batches(group_job, stats, g, groups, seed=seed) for g in range(groups)]


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
