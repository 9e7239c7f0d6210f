"""The embedded backend: a run's groups as processes on this machine, watched by a supervisor.

Each group is its own Horovod world. With `run.controller = "gloo"` the supervisor starts one
Horovod HTTP rendezvous per group and the group's ranks as `python -m hpcdl.worker RUN` with
Horovod's variables set (no ssh, no horovodrun); with `"mpi"` it starts one `mpirun` per group
(`python -m hpcdl.worker RUN --mpi` under it) and no rendezvous. When the exchange is on, the
applier runs as one more process. A group whose rank dies is stopped whole and started again
(bounded retries, growing backoff); it resumes from its newest checkpoint and the newest master
weights. The supervisor publishes its view to `scheduler/local.json`, so `hpcdl status` and
`hpcdl cancel` work from any shell.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hpcdl.config import Job, JobError
from hpcdl.launch import (
    SUPERVISOR_PID_ENV, MpiLauncher, find_mpi_launcher, local_group, open_mpi_root_allowed, start_rendezvous,
    worker_environ,
)
from hpcdl.runkey import Access
from hpcdl.runs import RunDir, RunError, State, read_json_file, write_json_atomic
from hpcdl.schedulers.base import DryRun, Scheduler, SubmitRequest, check_controller, controller_facts
from hpcdl.storage import StorageReport, attempt

BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
# A rank per core is best; a few may share one: tests, a small hybrid run, and the hybrid race's
# 8 emulated ranks + applier on 2 cores (bench/hybrid_race.py), whose pace is set by sleeps.
LOCAL_RANKS_PER_CORE = 5
LOCAL_RANK_MEMORY = 512 << 20  # a TensorFlow rank's resident size, at least
STOP_GRACE_S = 60.0  # asked to stop, a group's ranks finish their step and checkpoint first
APPLIER_DRAIN_S = 600.0  # after the last group, the applier applies what is pending and ends


def _open_log(path: Path, access: Access):
    """Logs have the run's access mode, like everything else in a run directory (owner-only, or
    group-only with run.unix_group), whatever the umask."""
    return os.fdopen(access.open_append(path), "ab")


def worker_command(python: str, run: RunDir) -> list[str]:
    return [python, "-m", "hpcdl.worker", str(run.root)]


def applier_command(python: str, run: RunDir, shard: int = 0) -> list[str]:
    return [python, "-m", "hpcdl.worker", str(run.root), "--applier"] + (
        ["--shard", str(shard)] if shard else [])


def mpi_group_command(launcher: MpiLauncher, python: str, run: RunDir, ranks: int) -> list[str]:
    """One group as one MPI job: its ranks place themselves from the launcher's variables."""
    return launcher.command(ranks, [*worker_command(python, run), "--mpi"])


@dataclass
class GroupProcs:
    group: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    rendezvous: Any = None
    restarts: int = 0
    state: State = State.PENDING
    next_start: float = 0.0
    exit_codes: list[int | None] = field(default_factory=list)
    # How to ask the processes to checkpoint and stop: the ranks take SIGTERM; mpirun would kill
    # its ranks a few seconds after a SIGTERM (its man page), but passes SIGUSR1 on to them.
    stop_signal: int = signal.SIGTERM


class Supervisor:
    """Starts, watches and restarts a run's processes; one per run, in the foreground or detached."""

    def __init__(self, run: RunDir, python: str = sys.executable):
        self.run = run
        self.job = run.load_job()
        self.python = python
        self.groups = {g: GroupProcs(g) for g in range(self.job.run.groups)}
        # one applier per shard of the exchange (exchange.shards); none without an exchange
        self.appliers: list[subprocess.Popen | None] = []
        self.applier_restarts: list[int] = []
        self.stopping = False
        self.launcher: MpiLauncher | None = None
        if self.job.run.controller == "mpi":
            self.launcher = find_mpi_launcher()
            if self.launcher is None:
                raise RunError('run.controller = "mpi": no mpirun or mpiexec on PATH')
        # A full disk or quota must not end the run: the ranks and the applier ride it out, and
        # so does the supervisor (its report is reserved at submit, rewritten in place).
        self.access = run.access(self.job)
        self.storage = StorageReport(run.supervisor_storage_file, self.access)

    # -- processes -------------------------------------------------------------------------
    def _child_environ(self, extra: dict[str, str]) -> dict[str, str]:
        """Every child ends with this supervisor (hpcdl.launch.follow_supervisor)."""
        return worker_environ(os.environ, {**extra, SUPERVISOR_PID_ENV: str(os.getpid())})

    def _start_group(self, gp: GroupProcs) -> None:
        ranks = self.job.run.ranks_per_group
        envs = local_group(gp.group, ranks)
        if self.launcher is not None:
            self._start_mpi_group(gp, envs[0].to_mpi_env())
            return
        gp.rendezvous, port = start_rendezvous(envs)
        gp.procs = []
        for env in envs:
            log = _open_log(self.run.rank_log(gp.group, env.rank), self.access)
            child_env = self._child_environ(env.to_horovod_env("127.0.0.1", port, iface="lo"))
            gp.procs.append(subprocess.Popen(
                worker_command(self.python, self.run), env=child_env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            ))
            log.close()
        gp.state = State.RUNNING

    def _start_mpi_group(self, gp: GroupProcs, env: dict[str, str]) -> None:
        """The group's ranks under one mpirun, in a session of its own: a Ctrl-C reaches the
        supervisor, which asks mpirun to pass SIGUSR1 on (mpirun's own SIGINT handling kills
        the ranks before they can checkpoint). Each rank writes its own log (hpcdl.worker)."""
        log = _open_log(self.run.mpi_launcher_log(gp.group), self.access)
        gp.procs = [subprocess.Popen(
            mpi_group_command(self.launcher, self.python, self.run, self.job.run.ranks_per_group),
            env=self._child_environ(env), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )]
        log.close()
        gp.stop_signal = signal.SIGUSR1
        gp.state = State.RUNNING

    def _stop_group(self, gp: GroupProcs) -> None:
        _terminate(gp.procs, stop_signal=gp.stop_signal)
        if gp.rendezvous is not None:
            gp.rendezvous.stop()
            gp.rendezvous = None

    def _start_applier(self, shard: int) -> None:
        log = _open_log(self.run.shard_applier_log(shard), self.access)
        self.appliers[shard] = subprocess.Popen(
            applier_command(self.python, self.run, shard), env=self._child_environ({}), stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        log.close()

    def _running_appliers(self) -> list[subprocess.Popen]:
        return [a for a in self.appliers if a is not None and a.poll() is None]

    # -- the loop --------------------------------------------------------------------------
    def poll(self) -> bool:
        """One round of watching; returns True while anything still has to run."""
        now = time.monotonic()
        for gp in self.groups.values():
            if gp.state == State.PENDING and now >= gp.next_start:
                self._start_group(gp)
            elif gp.state == State.RUNNING:
                codes = [p.poll() for p in gp.procs]
                gp.exit_codes = codes
                if all(c == 0 for c in codes):
                    self._stop_group(gp)
                    requeue = self.run.requeue_mark(gp.group)
                    # A signal to the ranks themselves (Ctrl-C, a SIGTERM) stops them after a
                    # checkpoint, with exit 0 and the requeue mark: stopped, not finished.
                    gp.state = State.CANCELLED if requeue.exists() else State.FINISHED
                    requeue.unlink(missing_ok=True)
                elif any(c not in (None, 0) for c in codes):
                    self._stop_group(gp)
                    if gp.restarts >= self.job.run.max_restarts:
                        gp.state = State.FAILED
                    else:
                        gp.restarts += 1
                        gp.state = State.PENDING
                        gp.next_start = now + BACKOFF_S[min(gp.restarts - 1, len(BACKOFF_S) - 1)]
        active = any(gp.state in (State.PENDING, State.RUNNING) for gp in self.groups.values())
        for shard, applier in enumerate(self.appliers):
            if applier is not None and applier.poll() not in (None, 0) and active:
                if self.applier_restarts[shard] < self.job.run.max_restarts:  # as under SLURM
                    self.applier_restarts[shard] += 1
                    self._start_applier(shard)
        self.publish()
        return active

    def publish(self) -> None:
        """Write scheduler/local.json; a full disk or quota is recorded, and watching goes on
        (the previous version stays in place)."""
        attempt(self.storage, "supervisor state", write_json_atomic, self.run.local_state_file, {
            "supervisor_pid": os.getpid(),
            "updated": time.time(),
            "groups": {
                str(g): {"state": gp.state, "restarts": gp.restarts,
                         "pids": [p.pid for p in gp.procs if p.poll() is None],
                         "exit_codes": gp.exit_codes}
                for g, gp in self.groups.items()
            },
            "applier": None if not self.appliers else {
                "pid": self.appliers[0].pid, "running": bool(self._running_appliers()),
                "restarts": sum(self.applier_restarts),
                "shards": [{"shard": k, "pid": a.pid, "running": a.poll() is None,
                            "restarts": self.applier_restarts[k]} for k, a in enumerate(self.appliers)],
            },
        })

    def run_until_done(self, on_tick: Callable[[], None] | None = None, interval: float = 0.5) -> bool:
        """Run everything to the end; True if every group finished."""
        if self.job.exchange.active(self.job.run.groups):
            shards = self.job.exchange.shard_count
            self.appliers, self.applier_restarts = [None] * shards, [0] * shards
            for shard in range(shards):
                self._start_applier(shard)
        try:
            while self.poll() and not self.stopping:
                if on_tick:
                    on_tick()
                time.sleep(interval)
            if not self.stopping and all(gp.state == State.FINISHED for gp in self.groups.values()):
                self._drain_applier(interval)
        finally:
            self.shutdown()
        if on_tick:
            on_tick()
        return all(gp.state == State.FINISHED for gp in self.groups.values())

    def _drain_applier(self, interval: float) -> None:
        """Every group finished: the applier ends by itself once nothing is left to apply (see
        hpcdl.worker.serve_applier), so let it, rather than stop it with updates pending (it may
        be waiting out a full disk). Bounded by APPLIER_DRAIN_S and by a stop request."""
        deadline = time.monotonic() + APPLIER_DRAIN_S
        while self._running_appliers() and not self.stopping and time.monotonic() < deadline:
            self.publish()
            time.sleep(interval)

    def shutdown(self) -> None:
        stopping = [gp for gp in self.groups.values() if gp.state in (State.RUNNING, State.PENDING)]
        # All groups at once: each checkpoints at its stop (hpcdl.worker), in parallel.
        _terminate([p for gp in stopping for p in gp.procs], grace=STOP_GRACE_S,
                   stop_signal={p.pid: gp.stop_signal for gp in stopping for p in gp.procs})
        for gp in stopping:
            self._stop_group(gp)
            gp.state = State.CANCELLED
        # The appliers commit the update in progress, then exit on SIGTERM.
        _terminate(self._running_appliers(), grace=30.0)
        self.publish()
        self.storage.close()


def _terminate(procs: list[subprocess.Popen], grace: float = 5.0,
               stop_signal: int | dict[int, int] = signal.SIGTERM) -> None:
    """Ask each process to stop (`stop_signal`, or one per pid), kill it after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(stop_signal.get(p.pid, signal.SIGTERM) if isinstance(stop_signal, dict) else stop_signal)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:  # mpirun leads a session of its own: its ranks go with it
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.kill()
            p.wait()


def machine_facts() -> dict[str, Any]:
    """The cores this process may use and the memory available (Linux's MemAvailable)."""
    facts: dict[str, Any] = {}
    try:
        facts["cores"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        facts["cores"] = os.cpu_count() or 1
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                facts["memory_available"] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return facts


def check_capacity(job, facts: dict[str, Any]) -> None:
    """Refuse a local run that this machine cannot hold: more than LOCAL_RANKS_PER_CORE processes
    per core, or LOCAL_RANK_MEMORY each beyond the memory available (`hpcdl submit hep --nodes
    9600` on a login node)."""
    cores, memory = facts.get("cores"), facts.get("memory_available")
    if not cores:
        return
    ranks = job.run.nodes * job.run.ranks_per_node
    processes = ranks + (1 if job.exchange.active(job.run.groups) else 0)
    limit = cores * LOCAL_RANKS_PER_CORE
    if memory:
        limit = min(limit, max(1, int(memory // LOCAL_RANK_MEMORY)))
    if processes > limit:
        held = f"{cores} cores" + (f", {memory / 2**30:.1f} GiB available" if memory else "")
        raise JobError(
            f"{ranks} ranks ({job.run.nodes} nodes x {job.run.ranks_per_node}) are more than this machine "
            f"can run ({held}: at most {limit} processes here); use --backend slurm on a cluster, "
            f"or fewer --nodes"
        )


def mpi_facts() -> dict[str, Any]:
    """The local MPI launcher, and whether Open MPI's would refuse to run as root here."""
    launcher = find_mpi_launcher()
    return {"mpi_launcher": launcher.path if launcher else None,
            "open_mpi": bool(launcher and launcher.open_mpi),
            "root": os.geteuid() == 0, "open_mpi_root_allowed": open_mpi_root_allowed(os.environ)}


def check_local_mpi(job: Job, facts: dict[str, Any]) -> None:
    """`run.controller = "mpi"` here needs a launcher, and Open MPI's refuses root unless told."""
    if job.run.controller != "mpi" or "mpi_launcher" not in facts:
        return
    if not facts["mpi_launcher"]:
        raise JobError('run.controller = "mpi" on the local backend needs mpirun or mpiexec on PATH '
                       "(apt-get install openmpi-bin, or load your site's MPI module)")
    if facts.get("open_mpi") and facts.get("root") and not facts.get("open_mpi_root_allowed"):
        raise JobError('run.controller = "mpi": Open MPI\'s mpirun refuses to run as root; run as a user, '
                       "or export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 if you mean it")


class LocalScheduler(Scheduler):
    name = "local"

    def cluster_facts(self, job: Job | None = None) -> dict[str, Any]:
        facts = {**machine_facts(), **controller_facts(job)}
        if job is not None and job.run.controller == "mpi":
            facts.update(mpi_facts())
        return facts

    def submit_dryrun(self, request: SubmitRequest) -> DryRun:
        job, run = request.job, request.run
        check_capacity(job, request.cluster)
        check_controller(request)
        check_local_mpi(job, request.cluster)
        commands = []
        if job.exchange.active(job.run.groups):
            commands += [applier_command(request.python, run, k) for k in range(job.exchange.shard_count)]
        for g in range(job.run.groups):
            if job.run.controller == "mpi":
                launcher = MpiLauncher(request.cluster.get("mpi_launcher") or "mpirun",
                                       request.cluster.get("open_mpi", True))
                env = local_group(g, 1)[0].to_mpi_env()
                commands.append(["env", *(f"{k}={v}" for k, v in sorted(env.items())),
                                 *mpi_group_command(launcher, request.python, run, job.run.ranks_per_group)])
                continue
            for env in local_group(g, job.run.ranks_per_group):
                hvd = env.to_horovod_env("127.0.0.1", 0, iface="lo")
                commands.append(["env", *(f"{k}={v}" for k, v in sorted(hvd.items()) if k != "HOROVOD_GLOO_RENDEZVOUS_PORT"),
                                 *worker_command(request.python, run)])
        return DryRun(backend=self.name, files={}, commands=commands, request=request)

    def schedule(self, dryrun: DryRun, foreground: bool = True,
                 on_tick: Callable[[Supervisor], None] | None = None) -> dict[str, Any]:
        """Foreground: supervise here until the run ends. Detached: a supervisor process."""
        run = dryrun.request.run
        if foreground:
            supervisor = Supervisor(run, dryrun.request.python)
            previous = signal.signal(signal.SIGTERM, lambda *_: setattr(supervisor, "stopping", True))
            try:
                ok = supervisor.run_until_done(on_tick=(lambda: on_tick(supervisor)) if on_tick else None)
            except KeyboardInterrupt:
                ok = False
            finally:
                signal.signal(signal.SIGTERM, previous)
            return {"supervisor_pid": os.getpid(), "ok": ok}
        log = _open_log(run.supervisor_log, run.access(dryrun.request.job))
        proc = subprocess.Popen(
            [dryrun.request.python, "-m", "hpcdl.schedulers.local", str(run.root)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        return {"supervisor_pid": proc.pid}

    def describe(self, run: RunDir) -> dict[str, Any]:
        path = run.local_state_file
        if not path.is_file():
            return {"groups": {}, "applier": None, "note": "not started yet"}
        state = read_json_file(path)
        if not isinstance(state, dict) or not isinstance(state.get("groups"), dict):
            raise RunError(f"{path} is corrupt: not the local supervisor's record")
        state["note"] = ""
        if not _pid_alive(state.get("supervisor_pid")):
            for info in state["groups"].values():
                if info["state"] in (State.RUNNING, State.PENDING):
                    info["state"] = State.LOST  # the supervisor died without finishing its groups
                    state["note"] = "the supervisor is gone"
        applier = state.get("applier")
        if isinstance(applier, dict) and applier.get("running"):
            # The record may be stale (a supervisor killed -9 writes nothing more): ask the system.
            shards = [s for s in applier.get("shards") or [] if isinstance(s, dict)]
            for shard in shards:
                shard["running"] = bool(shard.get("running")) and _pid_runs(shard.get("pid"), run.run_id)
            applier["running"] = (any(s["running"] for s in shards) if shards
                                  else _pid_runs(applier.get("pid"), run.run_id))
        return state

    def is_active(self, run: RunDir) -> bool:
        """The supervisor is alive and has not yet reported every group ended."""
        path = run.local_state_file
        if not path.is_file():
            return _pid_alive(run.info().get("supervisor_pid"))  # detached, before its first report
        state = self.describe(run)
        if not _pid_alive(state.get("supervisor_pid")):
            return False
        applier = state.get("applier") or {}
        return bool(applier.get("running")) or any(
            g.get("state") in (State.RUNNING, State.PENDING) for g in state["groups"].values())

    def cancel(self, run: RunDir) -> str:
        state = self.describe(run)
        pid = state.get("supervisor_pid") or run.info().get("supervisor_pid")
        if pid and _pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            return f"sent SIGTERM to the supervisor (pid {pid})"
        return "nothing to cancel: the run's supervisor is not running (the run has ended)"


def _pid_alive(pid: int | None) -> bool:
    """The process exists and is not a zombie (an exited child nobody has reaped yet)."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: existence is all we know
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _pid_runs(pid: int | None, run_id: str) -> bool:
    """The process is alive and is one of this run's (its command line names the run), so a pid
    reused by another process after the run's applier died does not count."""
    if not _pid_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: existence is all we know
    return run_id.encode() in cmdline


def main(argv: list[str] | None = None) -> int:
    """`python -m hpcdl.schedulers.local RUN_DIR`: the detached supervisor."""
    args = argv if argv is not None else sys.argv[1:]
    supervisor = Supervisor(RunDir(Path(args[0])))
    signal.signal(signal.SIGTERM, lambda *_: setattr(supervisor, "stopping", True))
    return 0 if supervisor.run_until_done() else 1


if __name__ == "__main__":
    sys.exit(main())
