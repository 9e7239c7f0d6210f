"""The embedded backend: a run's groups as processes on this machine, watched by a supervisor.

Each group is its own Horovod world. With `run.controller = "gloo"` the supervisor starts one
Horovod HTTP rendezvous per group and the group's ranks as `python -m hpcdl.process.worker RUN` with
Horovod's variables set (no ssh, no horovodrun); with `"mpi"` it starts one `mpirun` per group
(`python -m hpcdl.process.worker RUN --mpi` under it) and no rendezvous. When the exchange is on, the
applier runs as one more process. A group whose rank dies is stopped whole and started again
(bounded retries, growing backoff); it resumes from its newest checkpoint and the newest master
weights. The supervisor publishes its view to `scheduler/local.json`, so `hpcdl status` and
`hpcdl cancel` work from any shell.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcdl.config import Job
from hpcdl.errors import JobError
from hpcdl.process.launch import (
    RENDEZVOUS_PORT_ENV, SUPERVISOR_PID_ENV, MpiLauncher, find_mpi_launcher, local_group, open_mpi_root_allowed, start_rendezvous,
    worker_environ,
)
from hpcdl.process.lifecycle import ApplierLife, GroupLife, Popened, applier_command, worker_command
from hpcdl.fs.access import Access
from hpcdl.rundir.runs import RunDir, RunError, State, read_json_file
from hpcdl.fs.files import atomic_write_json
from hpcdl.schedulers.base import DryRun, Scheduler, SubmitRequest, check_controller, controller_facts
from hpcdl.fs.storage import StorageReport, attempt

# A rank per core is best. A few may share one when they mostly wait (a small hybrid run, a test,
# emulated stragglers that sleep); beyond that every rank slows the others, so a larger local run
# is refused rather than left to crawl.
LOCAL_RANKS_PER_CORE = 5
LOCAL_RANK_MEMORY = 512 << 20  # a TensorFlow rank's resident size, at least


def _open_log(path: Path, access: Access):
    """Logs have the run's access mode, like everything else in a run directory (owner-only, or
    group-only with run.unix_group), whatever the umask."""
    return os.fdopen(access.open_append(path), "ab")


def mpi_group_command(launcher: MpiLauncher, python: str, run: RunDir, ranks: int) -> list[str]:
    """One group as one MPI job: its ranks place themselves from the launcher's variables."""
    return launcher.command(ranks, [*worker_command(python, run), "--mpi"])


def local_plan(job: Job, run: RunDir, python: str, cluster: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(role, command) of every process the supervisor starts: each shard's applier ("applier K"),
    then each group's ranks ("group G"; one mpirun per group with run.controller = "mpi"). The
    rendezvous port of a Gloo group is known only at its start: the supervisor adds it."""
    plan = []
    if job.exchange.active(job.run.groups):
        plan += [(f"applier {k}", applier_command(python, run, k)) for k in range(job.exchange.shard_count)]
    for g in range(job.run.groups):
        if job.run.mpi_launched:
            launcher = MpiLauncher(cluster.get("mpi_launcher") or "mpirun", cluster.get("open_mpi", True))
            env = local_group(g, 1)[0].to_mpi_env()
            plan.append((f"group {g}", ["env", *(f"{k}={v}" for k, v in sorted(env.items())),
                                        *mpi_group_command(launcher, python, run, job.run.ranks_per_group)]))
            continue
        for env in local_group(g, job.run.ranks_per_group):
            hvd = env.to_horovod_env("127.0.0.1", 0, iface="lo")
            plan.append((f"group {g}", ["env", *(f"{k}={v}" for k, v in sorted(hvd.items())
                                                 if k != RENDEZVOUS_PORT_ENV), *worker_command(python, run)]))
    return plan


@dataclass(frozen=True)
class LocalLaunch:
    """Starts the planned processes (`local_plan`): a group's ranks with a rendezvous of their
    own (Gloo) or its one mpirun, a shard's applier. Every child ends with the supervisor
    (hpcdl.process.launch.follow_supervisor)."""

    run: RunDir
    job: Job
    plan: list[tuple[str, list[str]]]
    access: Access

    def _commands(self, role: str) -> list[list[str]]:
        return [command for r, command in self.plan if r == role]

    def _popen(self, command: list[str], log_path: Path, env: dict[str, str], **options) -> subprocess.Popen:
        log = _open_log(log_path, self.access)
        try:
            return subprocess.Popen(command, env=worker_environ(os.environ, {**env, SUPERVISOR_PID_ENV: str(os.getpid())}),
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **options)
        finally:
            log.close()

    def group(self, group: int) -> Popened:
        commands = self._commands(f"group {group}")
        if self.job.run.mpi_launched:
            # The ranks under one mpirun, in a session of its own: a Ctrl-C reaches the supervisor,
            # which asks mpirun to pass SIGUSR1 on (mpirun kills its ranks a few seconds after a
            # SIGINT or SIGTERM, before they can checkpoint). Each rank writes its own log.
            proc = self._popen(commands[0], self.run.mpi_launcher_log(group), {}, start_new_session=True)
            return Popened([proc], stop_signal=signal.SIGUSR1)
        rendezvous, port = start_rendezvous(local_group(group, len(commands)))
        procs = [self._popen(command, self.run.rank_log(group, rank), {RENDEZVOUS_PORT_ENV: str(port)})
                 for rank, command in enumerate(commands)]
        return Popened(procs, on_close=rendezvous.stop)

    def applier(self, shard: int) -> Popened:
        # SIGTERM: the applier commits the update in progress and exits.
        return Popened([self._popen(self._commands(f"applier {shard}")[0], self.run.shard_applier_log(shard), {})])


class Supervisor:
    """Runs a run's group lives and the appliers' life (hpcdl.process.lifecycle) on this machine, in the
    foreground or detached; one per run."""

    def __init__(self, run: RunDir, python: str = sys.executable, plan: list[tuple[str, list[str]]] | None = None):
        """`plan`: the processes to start (`local_plan`), as `schedule` recorded them; planned
        here for this machine when None."""
        self.run = run
        self.job = run.load_job()
        self.stopping = False
        if plan is None:
            if self.job.run.mpi_launched and find_mpi_launcher() is None:
                raise RunError(f'run.controller = "{self.job.run.controller}": no mpirun or mpiexec on PATH')
            plan = local_plan(self.job, run, python, mpi_facts() if self.job.run.mpi_launched else {})
        # A full disk or quota must not end the run: the ranks and the applier ride it out, and
        # so does the supervisor (its report is reserved at submit, rewritten in place).
        self.access = run.access(self.job)
        self.launch = LocalLaunch(run, self.job, plan, self.access)
        self.storage = StorageReport(run.supervisor_storage_file, self.access)
        self.groups = {g: GroupLife(run, g, self.job.run.max_restarts, functools.partial(self.launch.group, g))
                       for g in range(self.job.run.groups)}
        self.appliers: ApplierLife | None = None
        if self.job.exchange.active(self.job.run.groups):
            self.appliers = ApplierLife(run, self.job.exchange.shard_count, self.job.run.max_restarts,
                                        self.launch.applier, log=lambda text: print(f"hpcdl: {text}", flush=True))
        run.groups_ended_mark.unlink(missing_ok=True)

    def poll(self) -> bool:
        """One round of watching; returns True while any group still has to run."""
        active = [life.poll() for life in self.groups.values()]
        if self.appliers is not None:
            self.appliers.poll(groups_active=any(active))
        self.publish()
        return any(active)

    def publish(self) -> None:
        """Write scheduler/local.json; a full disk or quota is recorded, and watching goes on
        (the previous version stays in place)."""
        applier = None
        if self.appliers is not None:
            record = self.appliers.record()
            applier = {**record, "pid": record["shards"][0]["pid"], "running": self.appliers.running}
        attempt(self.storage, "supervisor state", atomic_write_json, self.run.local_state_file, {
            "supervisor_pid": os.getpid(), "updated": time.time(),
            "groups": {str(g): life.record() for g, life in self.groups.items()}, "applier": applier,
        })

    def run_until_done(self, on_tick: Callable[[], None] | None = None, interval: float = 0.5) -> bool:
        """Run everything to the end; True if every group finished and no applier failed."""
        if self.appliers is not None:
            self.appliers.begin()
        try:
            while self.poll() and not self.stopping:
                if on_tick:
                    on_tick()
                time.sleep(interval)
            if not self.stopping and self.appliers is not None:
                self.appliers.drain(lambda: self.stopping, self.publish, interval)
        finally:
            self.shutdown(interval)
        if on_tick:
            on_tick()
        applier_failed = self.appliers is not None and self.appliers.failed
        return all(life.state == State.FINISHED for life in self.groups.values()) and not applier_failed

    def shutdown(self, interval: float = 0.5) -> None:
        """Stop what still runs: every group at once (each checkpoints at its stop, in parallel;
        hpcdl.process.lifecycle bounds the wait), then the appliers, which commit first."""
        for life in self.groups.values():
            life.request_stop()
        while any([life.poll() for life in self.groups.values()]):
            time.sleep(min(interval, 0.2))
        if self.appliers is not None:
            self.appliers.request_stop()
            while self.appliers.poll(groups_active=False):
                time.sleep(min(interval, 0.2))
        self.publish()
        self.storage.close()


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
    """An MPI-launched controller here needs a launcher, and Open MPI's refuses root unless told."""
    if not job.run.mpi_launched or "mpi_launcher" not in facts:
        return
    said = f'run.controller = "{job.run.controller}"'
    if not facts["mpi_launcher"]:
        raise JobError(f"{said} on the local backend needs mpirun or mpiexec on PATH "
                       "(apt-get install openmpi-bin, or load your site's MPI module)")
    if facts.get("open_mpi") and facts.get("root") and not facts.get("open_mpi_root_allowed"):
        raise JobError(f"{said}: Open MPI's mpirun refuses to run as root; run as a user, "
                       "or export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 if you mean it")


class LocalScheduler(Scheduler):
    name = "local"

    def cluster_facts(self, job: Job | None = None) -> dict[str, Any]:
        facts = {**machine_facts(), **controller_facts(job)}
        if job is not None and job.run.mpi_launched:
            facts.update(mpi_facts())
        return facts

    def submit_dryrun(self, request: SubmitRequest) -> DryRun:
        job, run = request.job, request.run
        check_capacity(job, request.cluster)
        check_controller(request)
        check_local_mpi(job, request.cluster)
        plan = local_plan(job, run, request.python, request.cluster)
        return DryRun(backend=self.name, files={}, commands=[c for _, c in plan], request=request,
                      roles=[role for role, _ in plan])

    def schedule(self, dryrun: DryRun, *, detach: bool = False,
                 watch: Callable[[RunDir, dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Start a supervisor process that runs exactly the dry run's processes (recorded in the
        run directory), detached or watched here until the run ends."""
        run = dryrun.request.run
        atomic_write_json(run.local_plan_file, [{"role": r, "command": c} for r, c in zip(dryrun.roles, dryrun.commands)])
        log = _open_log(run.supervisor_log, run.access(dryrun.request.job))
        try:
            # Not detached, the supervisor shares this terminal's process group: a Ctrl-C reaches
            # it and every rank, and each stops at a checkpoint.
            proc = subprocess.Popen([dryrun.request.python, "-m", "hpcdl.schedulers.local", str(run.root)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=detach)
        finally:
            log.close()
        if detach:
            return {"supervisor_pid": proc.pid}
        previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            while proc.poll() is None:
                try:
                    if watch is not None and run.local_state_file.is_file():
                        watch(run, self.describe(run))
                    time.sleep(0.5)
                except KeyboardInterrupt:
                    # A Ctrl-C reached the supervisor too, but a SIGINT sent to this process alone
                    # did not: pass it on (a second one is harmless), and wait for the stop.
                    proc.send_signal(signal.SIGINT)
                except RunError:
                    time.sleep(0.5)  # its record, torn or not yet written: the next round will do
        finally:
            signal.signal(signal.SIGTERM, previous)
        if watch is not None and run.local_state_file.is_file():
            watch(run, self.describe(run))
        return {"supervisor_pid": proc.pid, "ok": proc.returncode == 0}

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
    """`python -m hpcdl.schedulers.local RUN_DIR`: the supervisor of a run, started by `schedule`;
    SIGTERM (`hpcdl cancel`) or SIGINT (Ctrl-C) stops the run at a checkpoint."""
    args = argv if argv is not None else sys.argv[1:]
    run = RunDir(Path(args[0]))
    plan = [(p["role"], p["command"]) for p in read_json_file(run.local_plan_file)]
    supervisor = Supervisor(run, plan=plan)
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, lambda *_: setattr(supervisor, "stopping", True))
    return 0 if supervisor.run_until_done() else 1


if __name__ == "__main__":
    sys.exit(main())
