"""The training loop of one synchronous group. It knows nothing of SLURM, of run directories or of
how it was started.

Inside a group every rank computes gradients on its own shard; the group's `Collective`
(hpcdl.engine.collective: Horovod over Gloo or MPI, or mpi4py) averages them (allreduce) and every
rank applies the same update, so the ranks' weights stay identical -- checked at the end, to the
bit, whichever formed the group. Across groups, an
optional `GroupSync` (the asynchronous exchange) lets the group's root publish its averaged
gradient and adopt newer master weights; the adoption is decided by the root and broadcast, so
all ranks of the group switch weights at the same step.

Rank 0 of the group records metrics, validation, checkpoints and the manifest that says how to
rebuild the model through the `Recorder` its caller gives (hpcdl.rundir.group_files); checkpoints are
TensorFlow checkpoints, in the directory the caller names.
"""

from __future__ import annotations

import gc
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import tensorflow as tf

from hpcdl.config import TrainConfig
from hpcdl.engine.collective import Collective
from hpcdl.engine.optim import make_optimizer
from hpcdl.engine.step import make_train_step
from hpcdl.engine.tuning import precision_policy
from hpcdl.errors import FinalSaveFailed, NonFiniteLoss

FINAL_SAVE_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)  # between tries of the last checkpoint and state



@dataclass(frozen=True)
class GroupTask:
    """What a group trains, bound by its caller to a job and a workload: the engine reads
    `train` and calls the rest, and knows nothing else of either."""

    train: TrainConfig
    precision: str  # tuning.precision: the compute dtype's policy
    input_shape: tuple[int, ...]
    build_model: Callable[..., Any]  # (seed=, compute_dtype=) -> the workload's Model
    batches: Callable[[int, int, int], Iterator]  # (shard, shards, seed) -> training batches
    loss: Callable[[Any, Any], Any]  # (model, batch) -> the scalar loss, traced inside the step


@dataclass(frozen=True)
class TrainResult:
    model: Any
    last_metrics: dict[str, Any]  # rank 0's last metrics line ({} on other ranks)
    steps_run: int  # steps taken by this process (after any resume)
    stopped: bool = False  # True: stopped early on request, after a checkpoint


class GroupSync(Protocol):
    """The asynchronous exchange as the engine sees it (implemented in hpcdl.exchange.group)."""

    def initial_weights(self, names_and_values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Root only: the weights every group starts from (proposing ours if none exist)."""

    def after_step(self, step: int, grads: Callable[[], dict[str, np.ndarray]],
                   weights: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray] | None:
        """Root only: publish when due (from this step's gradients or the group's weights);
        return newer master weights to adopt, or None."""

    def stats(self) -> dict[str, Any]:
        """Root only: counters for the metrics line (publishes, adoptions, version, seconds)."""

    def flush(self) -> bool:
        """Root only: publish the updates held back (a full disk); False while they cannot be."""


class Recorder(Protocol):
    """Rank 0's record of its group (implemented in hpcdl.rundir.group_files, over the run directory)."""

    def manifest(self, input_shape, variable_names: list[str]) -> None:
        """How to rebuild the model, beside its checkpoints."""

    def metrics(self, step: int, line: dict[str, Any]) -> None:
        """A metrics line (it also says the group is running)."""

    def validation(self, step: int, validation: dict[str, Any]) -> None:
        """The newest validation scores."""

    def checkpoint(self, manager: tf.train.CheckpointManager, step: int) -> None:
        """Save a checkpoint; a failure is recorded, not raised."""

    def has_checkpoint(self, step: int) -> bool:
        """Whether step's checkpoint is the newest saved."""

    def end(self, final: dict[str, Any], *, stopped: bool) -> bool:
        """The group's last word (finished, or stopped on request); False if not written."""

    def close(self) -> None:
        """Flush what is buffered."""


class StepLog(Protocol):
    """Each rank's own time of every step (hpcdl.rundir.steptimes)."""

    def record(self, step: int, seconds: float) -> None: ...

    def flush(self) -> None: ...


@dataclass(frozen=True)
class GroupRoot:
    """What rank 0 of a group alone is given: its recorder, its link to the other groups (with an
    exchange) and the workload's validation, if any (`validate(model)`: the workload's figures on
    a fixed validation subset)."""

    recorder: Recorder
    sync: GroupSync | None = None
    validate: Callable[[Any], dict[str, float]] | None = None


class _GroupModel:
    """The group's model, optimizer and step counter, restored from its newest checkpoint if any."""

    def __init__(self, task: GroupTask, checkpoints: Path):
        self.input_shape = task.input_shape
        # mixed_bfloat16: the model computes in bfloat16; variables, optimizer slots, gradients as
        # applied, checkpoints and exchange files stay float32 (the policy's variable dtype).
        policy = precision_policy(task.precision)
        self.model = task.build_model(seed=task.train.seed, compute_dtype=policy.compute_dtype)
        self.names = [n for n, _ in self.model.named_variables()]
        self.variables = [v for _, v in self.model.named_variables()]
        self.optimizer = make_optimizer(task.train.optimizer, self.variables, task.train.learning_rate)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False)
        checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step)
        self.manager = tf.train.CheckpointManager(checkpoint, str(checkpoints), task.train.keep_checkpoints)
        self.restored = self.manager.latest_checkpoint is not None
        if self.restored:
            checkpoint.restore(self.manager.latest_checkpoint).expect_partial()
        self.resumed_from = int(self.step.numpy())

    def values(self, tensors: list | None = None) -> dict[str, np.ndarray]:
        """The variables' (or the matching gradients') values by name."""
        return {n: t.numpy() for n, t in zip(self.names, self.variables if tensors is None else tensors)}

    def assign(self, values: dict[str, np.ndarray]) -> None:
        _assign(self.variables, self.names, values)


class _Rates:
    """The metrics line's rates: over the steps since the previous line, and sustained since this
    process began training."""

    def __init__(self, examples_per_rank_step: int, flops_per_example: int, ranks: int):
        self.examples, self.flops, self.ranks = examples_per_rank_step, flops_per_example, ranks
        self.window_start = self.run_start = time.perf_counter()
        self.window_steps = self.steps = 0

    def stepped(self) -> None:
        self.window_steps += 1
        self.steps += 1

    def leave_out(self, seconds: float) -> None:
        """Work of rank 0's own (validation) that is not the training steps'."""
        self.window_start += seconds

    def line(self) -> dict[str, float]:
        now = time.perf_counter()
        elapsed = now - self.window_start
        per_rank_examples = self.window_steps * self.examples / elapsed
        rates = {
            "step_time_s": elapsed / self.window_steps,
            "images_per_s": per_rank_examples * self.ranks,
            "flops_per_s_rank": per_rank_examples * self.flops,
            "flops_per_s_group": per_rank_examples * self.flops * self.ranks,
            "sustained_flops_per_s_group": self.steps * self.examples * self.flops * self.ranks / (now - self.run_start),
        }
        self.window_start, self.window_steps = time.perf_counter(), 0
        return rates


class _RootDuties:
    """Rank 0's periodic actions after a step, in this order: validate, write the metrics line,
    checkpoint. None of them is a collective, so the other ranks go on to the next step."""

    def __init__(self, train: TrainConfig, root: GroupRoot, group_model: _GroupModel, *,
                 group: int, ranks: int, exchange: bool, report: dict[str, Any]):
        self.train, self.group, self.ranks = train, group, ranks
        self.sync = root.sync if exchange else None
        self.validate = root.validate if train.validate_every else None
        self.report, self.manager = report, group_model.manager
        self.recorder = root.recorder
        self.rates = _Rates(train.batch_per_rank, group_model.model.flops().training, ranks)
        self.train_start = time.time()
        self.validation: dict[str, Any] = {}  # the newest, repeated in every metrics line after it
        self.validation_due = False
        self.last: dict[str, Any] = {}

    def after_step(self, step: int, loss, model, *, adopted: bool, stopping: bool) -> None:
        self.rates.stepped()
        last_step = step == self.train.steps
        if self.validate is not None:
            self._validate(step, model, adopted=adopted, last_step=last_step)
        if step % self.train.log_every == 0 or last_step or stopping:
            self.last = {"time": time.time(), "train_start": self.train_start, "group": self.group, "step": step,
                         "loss": float(loss.numpy()), "ranks": self.ranks, **self.rates.line(), **self.report,
                         **(self.sync.stats() if self.sync is not None else {}), **self.validation}
            self.recorder.metrics(step, self.last)
        if step % self.train.checkpoint_every == 0 or last_step or stopping:
            self.recorder.checkpoint(self.manager, step)

    def _validate(self, step: int, model, *, adopted: bool, last_step: bool) -> None:
        # Every train.validate_every steps; with an exchange, at the first adoption from then on,
        # so that the master weights are scored; and at the last step (maybe the group's own).
        self.validation_due = self.validation_due or step % self.train.validate_every == 0
        scores_master = self.sync is None or adopted
        if not ((self.validation_due and scores_master) or last_step):
            return
        began = time.perf_counter()
        self.validation = {"val_step": step, **{f"val_{k}": v for k, v in self.validate(model).items()}}
        # The window's rates are the training steps': scoring is reported as its own time (the
        # run's sustained rate still pays it).
        self.validation["val_time_s"] = time.perf_counter() - began
        self.rates.leave_out(self.validation["val_time_s"])
        if self.sync is not None and scores_master:
            self.validation["val_master_version"] = self.sync.stats().get("exchange_version")
        self.validation_due = False
        self.recorder.validation(step, self.validation)


def _adopt_or_stop(comm: Collective, g: _GroupModel, sync: GroupSync | None, step: int, grads,
                   stop_requested: Callable[[], bool] | None) -> tuple[bool, bool]:
    """Collective: whether the group adopts the newer master weights rank 0's exchange returned,
    and whether it stops; on adoption, rank 0's weights are broadcast."""
    adopted = sync.after_step(step, lambda: g.values(grads), g.values) if sync is not None else None
    adopt, stop = _agree(comm, adopted is not None, bool(stop_requested and stop_requested()))
    if adopt:
        if comm.rank() == 0:
            g.assign(adopted)
        comm.broadcast_variables(g.variables, root_rank=0)
    return adopt, stop


def _agree(comm: Collective, adopted: bool, stop: bool) -> tuple[bool, bool]:
    """One small collective decides, for all ranks at the same step, whether to adopt the master
    weights the root read (only the root touches the shared directory) and whether to stop
    (signals reach ranks at different moments)."""
    adopt, stop = (bool(v) for v in comm.agree([int(adopted), int(stop)], "max"))
    return adopt, stop


def _start_weights(comm: Collective, g: _GroupModel, sync: GroupSync | None, group: int) -> None:
    """Fresh or restarted, a group starts from the newest master weights when there are any, else
    from its checkpoint or its seed: rank 0's, broadcast (a collective)."""
    if sync is not None:
        g.assign(sync.initial_weights(g.values()))
    comm.broadcast_variables(g.variables, root_rank=0)
    if comm.rank() == 0 and g.restored:
        version = sync.stats().get("exchange_version") if sync is not None else None
        print(f"hpcdl group {group}: resumed from checkpoint {g.resumed_from}" + (
            "" if version is None else f", master version {version}" if version >= 0
            else ", no master version yet (its own weights)"), flush=True)


def train_group(task: GroupTask, comm: Collective, checkpoints: Path, *,
                group: int, groups: int, root: GroupRoot | None = None, exchange: bool = False,
                stop_requested: Callable[[], bool] | None = None, report: dict[str, Any] | None = None,
                pace: Callable[[int, float], None] | None = None, step_times: StepLog | None = None) -> TrainResult:
    """Train until `task.train.steps`, resuming from the group's newest checkpoint if any.

    `comm` is the group's `Collective`, passed in so the caller decides how the group was formed; `root` is given to rank 0 only. `exchange` must be the same on every rank of
    the group (it adds collective steps). `stop_requested` (a signal flag, e.g. SLURM's warning
    before the time limit) is agreed on by all ranks at each step: the group checkpoints and
    returns early with `stopped=True`. `report` adds fixed fields to every metrics record.
    `pace(step, started)`, called after each step with the step's start (perf_counter), may stretch
    it (the straggler emulator, hpcdl.process.emulate) and returns the seconds it stretches it to. Each
    rank records its own time of every step in `step_times`: its forward and backward, or the
    emulated time if longer. Every rank restores from and rank 0 saves to `checkpoints`.
    Validation runs every `train.validate_every` steps and at the end; with an exchange, at the
    first adoption from then on, so it scores the master weights.

    The loop below is the order of the group's collectives, identical on every rank.
    """
    rank, size = comm.rank(), comm.size()
    if rank == 0 and (root is None or (exchange and root.sync is None)):
        raise ValueError("rank 0 of a group needs its GroupRoot, with a GroupSync for an exchange")
    sync = root.sync if rank == 0 and exchange else None
    g = _GroupModel(task, checkpoints)
    _start_weights(comm, g, sync, group)
    duties = None
    if rank == 0:
        root.recorder.manifest(g.input_shape, [name for name, _ in g.model.named_variables()])
        duties = _RootDuties(task.train, root, g, group=group, ranks=size, exchange=exchange, report=report or {})
    batches = task.batches(group * size + rank, groups * size, task.train.seed + g.resumed_from)
    train_step = make_train_step(lambda batch: task.loss(g.model, batch), g.variables, g.optimizer, comm)
    coordinate = exchange or stop_requested is not None
    own_times = step_times
    stopped = False
    try:
        for current in range(g.resumed_from + 1, task.train.steps + 1):
            started = time.perf_counter()
            loss, grads, finite, own_seconds = train_step(next(batches))  # collective: the gradients' allreduce
            if not finite.numpy().all():  # the same verdict on every rank: the averages are the group's
                raise NonFiniteLoss(_non_finite_reason(current, finite.numpy(), g.names, g.resumed_from))
            paced = pace(current, started) if pace is not None else None
            if own_times is not None:
                own = float(own_seconds)
                own_times.record(current, own if paced is None else max(own, paced))
            g.step.assign(current)
            adopt, stopped = (_adopt_or_stop(comm, g, sync, current, grads, stop_requested) if coordinate
                              else (False, False))
            if duties is not None:
                duties.after_step(current, loss, g.model, adopted=adopt, stopping=stopped)
            if stopped:
                break
    finally:
        if own_times is not None:
            own_times.flush()
        # No reader thread may be inside HDF5 when the interpreter exits: a daemon thread frozen
        # there holds h5py's lock, its finalisers wait for it, and the rank never ends.
        batches.close()

    return _finish(comm, g, duties, report, stopped, task.train.final_save_retry_s, sync)


def _finish(comm: Collective, g: _GroupModel, duties: _RootDuties | None, report: dict[str, Any] | None, stopped: bool,
            retry_s: float, sync: GroupSync | None) -> TrainResult:
    """The group's end, in collectives every rank takes: whether the replicas are identical, then
    the rounds that agree the end was saved."""
    # data parallelism's invariant, asked of the ranks themselves (an 8-byte digest each)
    digests = comm.gather(weights_digest(g.variables))
    last = duties.last if duties is not None else {}
    if duties is not None:
        duties.recorder.close()
    final = {**(last or report or {}), "step": int(g.step.numpy()),
             "replicas_identical": bool((digests == digests[0]).all())}
    _save_the_end(comm, duties.recorder if duties is not None else None, g.manager, final, stopped, retry_s, sync)
    return TrainResult(model=g.model, last_metrics=last, steps_run=int(g.step.numpy()) - g.resumed_from,
                       stopped=stopped)


def _non_finite_reason(step: int, finite: np.ndarray, names: list[str], resumed_from: int) -> str:
    bad = [name for name, ok in zip(["the loss", *names], finite) if not ok]
    what = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    return (f"step {step}: {what} not finite (NaN or Inf); the step was not applied and the group stopped "
            f"(its newest checkpoint holds finite weights). A learning rate too high, or data the scan "
            f"skipped (run.check_finite = false), are the usual causes"
            + ("" if step > resumed_from + 1 else "; it happened at the first step after the start"))


def _save_the_end(comm: Collective, recorder: Recorder | None, manager, final: dict[str, Any], stopped: bool,
                  retry_s: float, sync: GroupSync | None) -> None:
    """No group says it ended before its last checkpoint, its held updates and its final state
    are written: on a full disk rank 0 tries again with back-off for up to ``retry_s``, then every
    rank raises FinalSaveFailed. Rank 0 decides each round and the group agrees on it in one
    collective, so no rank waits in a collective another has left."""
    deadline, tries = time.monotonic() + retry_s, 0
    while True:
        verdict = 1  # 1: written; 0: try again; -1: give up
        if recorder is not None:
            if not recorder.has_checkpoint(final["step"]):
                recorder.checkpoint(manager, final["step"])
            flushed = sync is None or sync.flush()
            if sync is not None:
                final.update(sync.stats())
            written = flushed and recorder.has_checkpoint(final["step"]) and recorder.end(final, stopped=stopped)
            verdict = 1 if written else 0 if time.monotonic() < deadline else -1
        verdict = comm.agree([verdict], "min")[0]
        if verdict == 1:
            return
        if verdict < 0:
            raise FinalSaveFailed(f"the checkpoint, held updates and state of step {final['step']} could not be written "
                                  f"in {retry_s:g} s (train.final_save_retry_s): a full disk or quota; "
                                  "the group resumes from its newest checkpoint")
        time.sleep(FINAL_SAVE_BACKOFF_S[min(tries, len(FINAL_SAVE_BACKOFF_S) - 1)])
        tries += 1


def weights_digest(variables: list[tf.Variable]) -> int:
    """The weights' bytes as one signed 64-bit number: equal on two ranks only if every bit is."""
    h = hashlib.blake2b(digest_size=8)
    for v in variables:
        h.update(v.numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def _assign(variables: list[tf.Variable], names: list[str], values: dict[str, np.ndarray]) -> None:
    missing = [n for n in names if n not in values]
    if missing:
        raise ValueError(f"weights lack tensors {missing[:3]}: not this model's")
    for name, var in zip(names, variables):
        var.assign(values[name])


def restore_model(model, prefix: str) -> str | None:
    """Restore the model's variables from ``prefix``; why not, in one line, if it cannot be."""
    checkpoint = tf.train.Checkpoint(model=model)
    try:
        # partial: the optimizer's slots stay unread; every model variable must be matched
        checkpoint.restore(prefix).expect_partial().assert_existing_objects_matched()
        return None
    except (tf.errors.OpError, ValueError, IndexError, AssertionError) as exc:
        # TensorFlow's reader: a truncated, garbled or missing data file, or another model's tensors
        reason = f"{type(exc).__name__}: " + str(getattr(exc, "message", exc)).strip().splitlines()[0][:200]
    # a failed restore leaves TensorFlow a warning per unread value for when it is collected
    logger, level = tf.get_logger(), tf.get_logger().level
    logger.setLevel("ERROR")
    try:
        del checkpoint
        gc.collect()
    finally:
        logger.setLevel(level)
    return reason
