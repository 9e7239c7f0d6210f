"""The processes of a run, as the schedulers start them: `python -m hpcdl.process.worker RUN_DIR MODE`.

* a rank (default): read where this rank sits (Horovod variables set by the local backend,
  SLURM's with --slurm, a local mpirun's with --mpi), tune the CPU before TensorFlow loads, join
  the group's Horovod world (Gloo, or MPI with run.controller = "mpi"), and hand over to
  `hpcdl.engine.train`. SIGUSR1 asks the group to checkpoint and stop at the next step.
  SIGUSR2, to any of these processes, writes its threads' stacks to its log.
* `--applier`: the applier of the run's exchange, configured from the job; it ends once every
  group has finished (or the local supervisor saw every group end) and nothing is left to apply,
  or on SIGTERM/SIGUSR1 after a commit (exit codes: hpcdl.process.lifecycle); with no usable durable
  state (hpcdl.applier.state.StateLost) it says why in one line and exits EXIT_USER_ERROR. With
  `--slurm-array` it also ends, after the backlog, once SLURM holds no element of the group array
  (a cancelled or failed group never reports "finished").

This is the glue between a scheduler and the engine; neither knows the other. The processes'
life (stop, restart, requeue) is hpcdl.process.lifecycle's.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from hpcdl.engine.tuning import plan_for_this_process, precision_refusal, read_cpuinfo
from hpcdl.fs.files import atomic_write_bytes, atomic_write_json, read_regular
from hpcdl.errors import FinalSaveFailed, JobError, NonFiniteLoss
from hpcdl.process.launch import LaunchError, RankEnv, follow_supervisor, slurm_cpus_per_task
from hpcdl.process.lifecycle import EXIT_FAILED, EXIT_LOCKED, EXIT_OK, EXIT_REQUEUE, EXIT_USER_ERROR, groups_over
from hpcdl.rundir.runs import RunDir
from hpcdl.workloads.common import DataFileError

STATS_WAIT_S = 3600.0
ENDED_FULL_DISK_GRACE_S = 30.0  # every group ended: how long the applier retries a full disk


def ensure_stats(run: RunDir, workload, job, is_root: bool) -> dict:
    """Normalisation constants, computed once per run by a group root and shared as a file.

    Several group roots may compute them at once; they compute the same values and the atomic
    rename makes the last one win harmlessly. Other ranks wait for the file.
    """
    stats = _read_stats(run.stats_file)
    if stats is not None:
        return stats
    if is_root:  # none yet, or a damaged one: the data give the same values again
        stats = workload.compute_stats(job)
        atomic_write_json(run.stats_file, stats)
        return stats
    deadline = time.monotonic() + STATS_WAIT_S
    while (stats := _read_stats(run.stats_file)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no readable {run.stats_file} after {STATS_WAIT_S:.0f} s")
        time.sleep(0.5)
    return stats


def _read_stats(path: Path) -> dict | None:
    try:
        stats = json.loads(read_regular(path).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return stats if isinstance(stats, dict) else None


def _slurm_array_gone(run: RunDir) -> Callable[[], bool]:
    from hpcdl.schedulers.slurm import SlurmArrayGone

    return SlurmArrayGone(run)


def serve_applier(run: RunDir, job, array_gone: Callable[[], bool] | None = None,
                  early_signal: Callable[[], int | None] = lambda: None, shard: int = 0) -> int:
    """Shard ``shard``'s applier until the run's groups are done; ``early_signal()`` is a stop
    signal that came while this process was still starting (the supervisor may die, or SLURM
    warn, at any time)."""
    import logging

    from hpcdl.applier import AlreadyRunning, Applier, ApplierConfig, StateLost
    from hpcdl.rundir.run_exchange import run_channel

    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    x = job.exchange
    try:
        if not 0 <= shard < x.shard_count:
            raise ValueError(f"shard {shard}: this run has exchange.shards = {x.shard_count}")
        channel = run_channel(run, job, shard=shard)  # the run's key and access policy
    except ValueError as exc:  # RunError: no sound run.key
        print(f"hpcdl applier: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        applier = Applier(channel, ApplierConfig.for_job(job))
    except AlreadyRunning as exc:
        print(f"hpcdl applier: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    except ValueError as exc:  # StateLost, a state of another update rule: no restart mends it
        print(f"hpcdl applier: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    requeue = {"asked": False}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: applier.request_stop())
    signal.signal(signal.SIGUSR1, lambda *_: (requeue.update(asked=True), applier.request_stop()))
    if early_signal() is not None:
        requeue["asked"] = early_signal() == signal.SIGUSR1
        applier.request_stop()

    failing_since: float | None = None  # every group ended, and commits failing since then

    def done() -> bool:
        nonlocal failing_since
        over = groups_over(run, job.run.groups, array_gone)
        if not over or channel.backlog() == 0:
            return over
        # Every group has ended: what a full disk keeps from being committed for longer than
        # the grace stays pending (a resume applies it); the run does not wait for space.
        if applier.healthy:
            failing_since = None
            return False
        if failing_since is None:
            failing_since = time.monotonic()
        return time.monotonic() - failing_since > ENDED_FULL_DISK_GRACE_S

    with applier:
        try:
            applier.run(stop=done)
        except StateLost as exc:  # lost while reloading after an I/O error
            print(f"hpcdl applier: error: {exc}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
    return EXIT_REQUEUE if requeue["asked"] else EXIT_OK


def log_to(path: Path, access) -> None:
    """A rank under a local mpirun writes its own log, as the local backend's Gloo ranks do
    (mpirun would interleave every rank's output in one stream)."""
    fd = access.open_append(path)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except LaunchError as exc:  # where a rank sits: one line that says what to fix
        print(f"hpcdl rank: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except (JobError, DataFileError, NonFiniteLoss, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        # The user's input (a data file missing on the compute nodes with --no-check-data): one
        # line, as submit says it, and no restart is tried for it (srun may report another code
        # than ours once it killed the group's other ranks: the mark says it).
        print(f"hpcdl rank: error: {exc}", file=sys.stderr, flush=True)
        _mark_input_error(argv, str(exc))
        return EXIT_USER_ERROR
    except FinalSaveFailed as exc:  # a full disk at the end: a restart resumes from the newest checkpoint
        print(f"hpcdl rank: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_FAILED


def _mark_input_error(argv: list[str] | None, text: str) -> None:
    try:
        run = RunDir(_parser().parse_args(argv).run_dir)
        group = int(os.environ.get("HPCDL_GROUP") or os.environ.get("SLURM_ARRAY_TASK_ID") or 0)
        atomic_write_bytes(run.input_error_file(group), (text.splitlines() or [""])[0].encode() + b"\n")
    except (OSError, ValueError, SystemExit):
        pass  # the exit code still says it where the launcher passes it on


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpcdl.process.worker")
    parser.add_argument("run_dir", type=Path)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--slurm", action="store_true", help="a rank; read its place from SLURM's variables")
    mode.add_argument("--mpi", action="store_true", help="a rank under a local mpirun; read its place from MPI's")
    mode.add_argument("--applier", action="store_true", help="run the exchange's applier")
    parser.add_argument("--shard", type=int, default=0, help="with --applier: which shard (exchange.shards)")
    parser.add_argument("--slurm-array", action="store_true",
                        help="with --applier: also stop once SLURM holds no element of the group array")
    return parser


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    # Installed first: SLURM's warning signal may come while TensorFlow is still loading.
    # SIGINT (Ctrl-C) and SIGTERM (a cancel, the supervisor's stop) ask for the same as USR1: the
    # group agrees on a step, checkpoints there and stops -- no KeyboardInterrupt traceback.
    stop = {"requested": False, "signal": None}
    for stop_signal in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda signum, _: stop.update(requested=True, signal=signum))
    # A hung rank or applier shows where it waits: `kill -USR2 PID` writes every thread's Python
    # stack to its log, even while the main thread is blocked inside a collective.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    follow_supervisor(os.environ)
    run = RunDir(args.run_dir)
    job = run.load_job()
    os.umask(run.access(job).umask)  # files TensorFlow & co. create: owner-only (or group-only)
    if args.applier:
        return serve_applier(run, job, _slurm_array_gone(run) if args.slurm_array else None,
                             early_signal=lambda: stop["signal"], shard=args.shard)
    return serve_rank(run, job, args, stop)


def _place(args: argparse.Namespace, run: RunDir, job, mpi: bool) -> tuple[RankEnv, dict]:
    """Where this rank sits, with Horovod's (or MPI's) variables set for it, and the fields it adds
    to every metrics line."""
    if args.slurm:
        rank_env = RankEnv.from_slurm(os.environ)
        if mpi:  # srun --mpi=<slurm.mpi> made the group one MPI job
            os.environ.update(rank_env.to_mpi_env())
        else:
            host, _, port = os.environ["HPCDL_RENDEZVOUS"].rpartition(":")
            os.environ.update(rank_env.to_horovod_env(host, int(port), os.environ.get("HPCDL_GLOO_IFACE", "")))
        return rank_env, {"slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                          "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)}
    if args.mpi:
        rank_env = RankEnv.from_mpi(os.environ, socket.gethostname())
        log_to(run.rank_log(rank_env.group, rank_env.rank), run.access(job))
        os.environ.update(rank_env.to_mpi_env())
        return rank_env, {}
    return RankEnv.from_horovod(os.environ), {}


def serve_rank(run: RunDir, job, args: argparse.Namespace, stop: dict) -> int:
    """One rank of a group: tune the CPU before TensorFlow loads, join the group, train."""
    mpi = job.run.mpi_launched
    rank_env, report = _place(args, run, job, mpi)
    plan = _thread_plan(job, args, rank_env)
    if plan is None:
        return EXIT_USER_ERROR
    os.environ.update(plan.environment())
    print(f"hpcdl rank {rank_env.rank}: {plan.describe()}", flush=True)

    from hpcdl.engine.collective import join_group
    from hpcdl.engine.train import train_group
    from hpcdl.engine.tuning import configure_tensorflow
    from hpcdl.rundir.steptimes import StepTimeLog
    from hpcdl.workloads import get_workload

    comm = join_group(job.run.controller)  # after the environment: oneDNN reads it once, at load
    configure_tensorflow(plan)
    if mpi:
        rank_env.check_mpi_world(comm.rank(), comm.size())
    group, root = rank_env.group, comm.rank() == 0
    workload = get_workload(job.workload)
    stats = ensure_stats(run, workload, job, is_root=root)
    exchange = job.exchange.active(job.run.groups)
    stop_mark = run.stop_mark(group)

    def stop_requested() -> bool:
        # Rank 0's view is enough: the engine spreads it to the group with a collective.
        return stop["requested"] or (root and stop_mark.exists())

    pace = None
    if job.emulate.enabled:
        from hpcdl.process.emulate import Emulator

        emulator = Emulator(job.emulate, group * comm.size() + comm.rank(), run.emulated_kill_mark(group))
        pace = emulator.pace
        report["emulated"] = emulator.describe()
    task = group_task(job, workload, stats)
    result = train_group(task, comm, run.checkpoint_dir(group), group=group, groups=job.run.groups,
                         root=_group_root(run, job, workload, stats, exchange, group, stop_requested) if root else None,
                         exchange=exchange, stop_requested=stop_requested, report=report, pace=pace,
                         step_times=StepTimeLog(run.step_times_file(group, comm.rank())))
    if result.stopped and root:
        # Every rank exits 0 (srun --kill-on-bad-exit would take any other code for a crash);
        # the mark tells the group's life (hpcdl.process.lifecycle) it stopped at a checkpoint.
        run.requeue_mark(group).touch()
    comm.shutdown()
    return EXIT_OK


def _thread_plan(job, args: argparse.Namespace, rank_env: RankEnv):
    """The rank's CPU tuning, before TensorFlow loads; None (said on stderr) for a precision this
    node cannot run: mixed_bfloat16 without a bfloat16 unit would run every convolution emulated
    (submit checked only the local backend's CPU)."""
    refusal = precision_refusal(job.tuning, read_cpuinfo())
    if refusal:
        print(f"hpcdl rank {rank_env.rank}: {refusal}", file=sys.stderr, flush=True)
        return None
    # The local backend runs every rank of every group on this host (under mpirun too); under
    # SLURM a node holds its group's ranks_per_node, and srun may give each task its own CPUs (on
    # the local backend an enclosing allocation's SLURM_CPUS_PER_TASK is the whole supervisor's).
    on_host = rank_env.local_size if args.slurm else job.run.nodes * job.run.ranks_per_node
    return plan_for_this_process(job.tuning, on_host, os.environ,
                                 cpus_per_task=slurm_cpus_per_task(os.environ) if args.slurm else None)


def group_task(job, workload, stats: dict):
    """The job and its workload as the engine sees them (hpcdl.engine.train.GroupTask)."""
    from hpcdl.engine.train import GroupTask

    return GroupTask(
        train=job.train, precision=job.tuning.precision, input_shape=tuple(workload.input_shape(job)),
        build_model=functools.partial(workload.build_model, job.model, workload.input_shape(job)),
        batches=lambda shard, shards, seed: workload.train_batches(job, stats, shard, shards, seed=seed),
        loss=lambda model, batch: workload.loss(model, batch, training=True))


def _group_root(run: RunDir, job, workload, stats: dict, exchange: bool, group: int, stop_requested):
    """What rank 0 alone is given: its recorder, its exchange (which a stop request interrupts)
    and its validation -- with an exchange the master weights are scored once, by group 0's root."""
    from hpcdl.engine.train import GroupRoot
    from hpcdl.rundir.group_files import GroupRecorder
    from hpcdl.fs.storage import StorageReport

    storage = StorageReport(run.storage_file(group))
    recorder = GroupRecorder(job, stats, storage, checkpoints=run.checkpoint_dir(group), metrics=run.metrics_file(group),
                             state=run.group_state_file(group), tensorboard=run.tensorboard_dir(group))
    sync = None
    if exchange:
        from hpcdl.rundir.run_exchange import group_exchange

        sync = group_exchange(run, job, group, storage)
        sync.interrupt = stop_requested
    validate = None
    val = Path(getattr(job.data, "val", "") or "")
    if job.train.validate_every and val.is_file() and (group == 0 or not exchange):
        validate = functools.partial(workload.validate, stats=stats, data=val, limit=job.train.validate_events)
    return GroupRoot(recorder, sync, validate)


if __name__ == "__main__":
    sys.exit(main())
