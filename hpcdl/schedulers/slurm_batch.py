"""The batch steps of a SLURM run: `python -m hpcdl.schedulers.slurm_batch group|applier RUN_DIR`,
the launch line of the rendered scripts (hpcdl.schedulers.slurm). Each runs the life of
hpcdl.process.lifecycle under SLURM: a group's ranks as one srun, requeued (exactly its array element) to
go on after the warning signal or a crash; the appliers of every shard, requeued after a commit.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hpcdl.config import Job
from hpcdl.process.launch import expand_nodelist, slurm_group_plan, start_rendezvous
from hpcdl.process.lifecycle import (
    EXIT_FAILED, EXIT_USER_ERROR, ApplierLife, GroupLife, Popened, applier_command,
)
from hpcdl.rundir.runs import RunDir
from hpcdl.schedulers.slurm import parse_preempt_time, ranks_environment, srun_command


def _environ(job: Job) -> dict[str, str]:
    return {**os.environ, **ranks_environment(job), "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class SrunLaunch:
    """Starts a group's ranks as one srun from its batch step; with Gloo, the group's rendezvous
    runs in the batch step (one per group, so groups never share a collective). A stop is asked
    through the group's stop mark alone: the ranks look for it at every step, and a rank still
    loading TensorFlow cannot be killed by it."""

    run: RunDir
    job: Job
    group: int
    python: str

    def __call__(self) -> Popened:
        env = _environ(self.job)
        stop_rendezvous = None
        if not self.job.run.mpi_launched:
            s = self.job.slurm
            plan = slurm_group_plan(expand_nodelist(os.environ["SLURM_JOB_NODELIST"]), self.job.run.ranks_per_node,
                                    self.group)
            server, port = start_rendezvous(plan)
            stop_rendezvous = server.stop
            env.update(HPCDL_RENDEZVOUS=f"{s.rendezvous_host or socket.gethostname()}:{port}",
                       HPCDL_GLOO_IFACE=s.gloo_iface)
        command = srun_command(self.job, self.python, self.run)
        print(f"hpcdl: group {self.group}: {shlex.join(command)}", flush=True)
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
        return Popened([proc], stop_signal=None, on_close=stop_rendezvous)


def _requeue(job_id: str, what: str) -> Callable[[str], None]:
    def requeue(why: str) -> None:
        # SLURM's own log line for it, "*** JOB ... CANCELLED ... DUE TO JOB REQUEUE ***", follows.
        print(f"hpcdl: {what} {why}; requeueing {job_id} (SLURM logs that as CANCELLED DUE TO JOB REQUEUE; "
              "the job runs again)", flush=True)
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"hpcdl: error: scontrol requeue {job_id}: {done.stderr.strip()}", file=sys.stderr, flush=True)

    return requeue


def _preempted(job_id: str) -> Callable[[], bool]:
    """Whether SLURM chose this job for preemption: it sets the job's PreemptTime then, signals
    the job's steps (SIGTERM) and, GraceTime later, its batch step, before it kills and requeues
    the job. A job that ends within GraceTime is not requeued by SLURM: the group requeues itself."""
    def preempted() -> bool:
        try:
            done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                                  timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0 and parse_preempt_time(done.stdout) is not None

    return preempted


def _stop_on_signals(job: Job, request_stop: Callable[..., None]) -> None:
    """The time limit's warning (slurm.signal) stops to go on; a plain SIGTERM or SIGINT (scancel,
    the end of a preemption's GraceTime) stops for good (SLURM requeues a preempted job itself)."""
    warning = getattr(signal, f"SIG{job.slurm.signal}")
    for other in (signal.SIGTERM, signal.SIGINT):
        if other != warning:
            signal.signal(other, lambda signum, _: request_stop(by=signal.Signals(signum).name))
    signal.signal(warning, lambda *_: request_stop(requeue=True))


def _log(text: str) -> None:
    print(f"hpcdl: {text}", file=sys.stderr, flush=True)


def run_group_step(run: RunDir, environ: dict[str, str]) -> int:
    """A group array element's batch step: its group's life, requeued (exactly this element) to
    go on after the warning signal or a crash; SLURM's restart count says how often it ran."""
    job = run.load_job()
    task = environ.get("SLURM_ARRAY_TASK_ID")
    if task is None or not task.isdigit():
        _log("error: the group script runs as an element of a job array (no SLURM_ARRAY_TASK_ID)")
        return EXIT_FAILED
    group = int(task)
    count = int(environ.get("SLURM_RESTART_COUNT") or 0)
    element = f"{environ.get('SLURM_ARRAY_JOB_ID') or environ.get('SLURM_JOB_ID')}_{group}"
    life = GroupLife(run, group, job.run.max_restarts, SrunLaunch(run, job, group, sys.executable),
                     requeue=_requeue(element, f"group {group}"), restart_count=count,
                     preempted=_preempted(environ.get("SLURM_JOB_ID", element)), stop_grace_s=None, log=_log)
    _stop_on_signals(job, life.request_stop)
    while life.poll():
        time.sleep(0.5)
    return life.exit_code


def run_applier_step(run: RunDir, environ: dict[str, str]) -> int:
    """The applier job's batch step: one applier per shard, each ending once SLURM holds no
    element of the group array and its backlog is applied."""
    job = run.load_job()

    def start(shard: int) -> Popened:
        command = applier_command(sys.executable, run, shard, slurm_array=True)
        # SIGUSR1: commit, then exit with EXIT_REQUEUE
        return Popened([subprocess.Popen(command, env=_environ(job), stdin=subprocess.DEVNULL)],
                       stop_signal=signal.SIGUSR1)

    life = ApplierLife(run, job.exchange.shard_count, job.run.max_restarts, start,
                       requeue=_requeue(environ.get("SLURM_JOB_ID", ""), "applier state"), log=_log)
    _stop_on_signals(job, life.request_stop)
    life.begin()
    while life.poll():
        time.sleep(0.5)
    return life.finish()


def main(argv: list[str] | None = None) -> int:
    """`python -m hpcdl.schedulers.slurm_batch group|applier RUN_DIR`: the launch line of a batch script."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("group", "applier"):
        _log("usage: python -m hpcdl.schedulers.slurm_batch group|applier RUN_DIR")
        return EXIT_USER_ERROR
    step = run_group_step if args[0] == "group" else run_applier_step
    return step(RunDir(Path(args[1])), dict(os.environ))


if __name__ == "__main__":
    sys.exit(main())
