"""The run directory: the state store of a run, and the one place that knows every path in it.

    runs/<run-id>/
      job.toml              the resolved job (what every process reads)
      run.json              run id, backend, created, scheduler job ids
      run.key               the run's secret: the key of its exchange's tags (see hpcdl.rundir.runkey)
      stats.json            workload normalisation constants (written once, atomically)
      groups/<g>/metrics.jsonl   one line per logged step of group g (its rank 0 writes)
      groups/<g>/state.json      the group's last known state (published atomically)
      groups/<g>/rank<r>.log     each rank's stdout/stderr
      groups/<g>/step-times/rank<r>.bin  each rank's own time of every step (hpcdl.rundir.steptimes)
      groups/<g>/mpirun.log      the local MPI launcher's own output (run.controller = "mpi")
      groups/<g>/storage.json    the group's storage problems (full disk, quota; hpcdl.fs.storage)
      groups/<g>/life.json       the group's life: state, restarts, exit codes, reason (hpcdl.process.lifecycle)
      groups/<g>/restarts.json   its crash restarts and planned requeues, kept across resumes
      checkpoints/<g>/      TensorFlow checkpoints of group g + manifest.json
      tensorboard/<g>/      TensorBoard event files
      exchange/             the asynchronous channel (unless the job names another directory)
      scheduler/            what the backend keeps: rendered scripts, pids, job ids

`hpcdl status` works from a fresh shell because everything is a file here. A run directory is
built under a hidden temporary name and renamed into place only when complete, so a failed
submission leaves nothing behind.

Permissions: the run directory and everything `create_run` puts in it are owner-only (0700 / 0600)
or group-only (2770 / 0660 with `run.unix_group`), whatever the umask; files written later through
this module get the mode of the directory's policy too (see hpcdl.fs.access).
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterator

from hpcdl.config import RUNS_DIR, Job
from hpcdl.jobfile import job_from_dict
from hpcdl.errors import HpcdlError, JobError
from hpcdl.fs.files import atomic_write_bytes, atomic_write_json, read_regular
from hpcdl.fs.access import Access, AccessError, access_for_job
from hpcdl.rundir.runkey import KEY_FILE, RunKeyError, create_key, run_signer
from hpcdl.fs.storage import REPORT_FILE, StorageReport

import tomllib


MANIFEST = "manifest.json"  # beside a group's checkpoints: how to rebuild the model (hpcdl.rundir.group_files)


class State(StrEnum):
    """What a group (or a whole run) is doing, in the few words a user needs: each backend maps
    its own states onto these, and the training reports ``finished`` or ``stopped`` itself."""

    PENDING = "pending"
    RUNNING = "running"
    REQUEUED = "requeued"
    SUSPENDED = "suspended"
    PREEMPTED = "preempted"
    STOPPED = "stopped"  # checkpointed on request (a signal, cancel), to be requeued or resumed
    FINISHED = "finished"  # trained to train.steps: the training's own word
    COMPLETED = "completed"  # the scheduler saw it end well; the training did not say finished
    CANCELLED = "cancelled"
    FAILED = "failed"
    TIMEOUT = "timeout"
    LOST = "lost"  # its supervisor died while it was queued or running
    UNKNOWN = "unknown"
    # A run's, never a group's: its groups ended, its appliers still apply what is pending (it is
    # still active: `resume` waits for the state the groups' words give once they are done).
    ENDING = "ending"


ENDED = frozenset({State.FINISHED, State.CANCELLED, State.FAILED, State.LOST, State.TIMEOUT, State.COMPLETED})
FAILED = frozenset({State.FAILED, State.LOST, State.TIMEOUT})


class RunError(HpcdlError, ValueError):
    """No such run, or a directory that is not a run."""


class RunIdTaken(RunError):
    """The run id is already a directory under runs_dir (two submissions in the same second)."""


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory."""

    root: Path

    @property
    def run_id(self) -> str:
        return self.root.name

    @staticmethod
    def holds_run(path: Path) -> bool:
        """Whether `path` is a run directory (its job and its info exist)."""
        run = RunDir(path)
        return run.job_file.is_file() and run.info_file.is_file()

    @property
    def job_file(self) -> Path:
        return self.root / "job.toml"

    @property
    def eval_dir(self) -> Path:
        """Where `hpcdl evaluate` of the run writes its plots."""
        return self.root / "eval"

    @property
    def info_file(self) -> Path:
        return self.root / "run.json"

    @property
    def stats_file(self) -> Path:
        return self.root / "stats.json"

    @property
    def key_file(self) -> Path:
        return self.root / KEY_FILE

    def signer(self):
        """The keyed signer of this run's exchange (raises RunKeyError without a sound key)."""
        try:
            return run_signer(self.root)
        except RunKeyError as exc:
            raise RunError(str(exc)) from None

    def access(self, job: Job | None = None) -> Access:
        return access_for_job(job or self.load_job(workload_code=False))

    def storage_file(self, group: int) -> Path:
        return self.group_dir(group) / REPORT_FILE

    @property
    def scheduler_dir(self) -> Path:
        return self.root / "scheduler"

    def script_file(self, name: str) -> Path:
        """A rendered batch script (``group.sbatch``, ``applier.sbatch``)."""
        return self.scheduler_dir / name

    @property
    def local_state_file(self) -> Path:
        """The local supervisor's record of its processes."""
        return self.scheduler_dir / "local.json"

    @property
    def local_plan_file(self) -> Path:
        """The processes the local supervisor starts, as the dry run listed them."""
        return self.scheduler_dir / "local-plan.json"

    @property
    def slurm_jobs_file(self) -> Path:
        """The SLURM job ids of the run."""
        return self.scheduler_dir / "slurm.json"

    @property
    def applier_log(self) -> Path:
        """The applier's output on the local backend (shard 0's, with several shards)."""
        return self.root / "applier.log"

    def shard_applier_log(self, shard: int) -> Path:
        return self.applier_log if shard == 0 else self.root / f"applier.{shard}.log"

    @property
    def supervisor_log(self) -> Path:
        """The detached local supervisor's output."""
        return self.scheduler_dir / "supervisor.log"

    @property
    def slurm_group_output(self) -> str:
        """sbatch's --output pattern of the group array (one file per element: its ranks and
        its batch script)."""
        return str(self.group_dir(0).parent / "%a" / "slurm-%A_%a.out")

    @property
    def slurm_applier_output(self) -> str:
        """sbatch's --output pattern of the applier's job."""
        return str(self.root / "applier-%j.out")

    def group_logs(self, group: int) -> list[Path]:
        """The log files of a group that exist: each rank's and the local MPI launcher's (local
        backend), then SLURM's output of its array element(s)."""
        d = self.group_dir(group)
        ranks = sorted(d.glob("rank*.log"), key=lambda p: (len(p.name), p.name))
        launcher = [self.mpi_launcher_log(group)] if self.mpi_launcher_log(group).is_file() else []
        return ranks + launcher + sorted(d.glob("slurm-*.out"))

    def applier_logs(self) -> list[Path]:
        """The applier's log files that exist (local backend, then SLURM's output)."""
        local = [self.applier_log] if self.applier_log.is_file() else []
        shards = sorted(self.root.glob("applier.*.log"), key=lambda p: (len(p.name), p.name))
        return local + shards + sorted(self.root.glob("applier-*.out"))

    @property
    def cancel_mark(self) -> Path:
        """Left by `hpcdl cancel` (SLURM): a group or applier stopped by the cancel's signal must not
        requeue itself (the batch scripts look for it; with slurm.signal = "TERM" a cancel looks
        like the warning signal)."""
        return self.scheduler_dir / "cancelled"

    @property
    def supervisor_storage_file(self) -> Path:
        """The local supervisor's storage problems (it could not write scheduler/local.json)."""
        return self.scheduler_dir / REPORT_FILE

    def group_dir(self, group: int) -> Path:
        return self.groups_dir / str(group)

    def metrics_file(self, group: int) -> Path:
        return self.group_dir(group) / "metrics.jsonl"

    def group_state_file(self, group: int) -> Path:
        return self.group_dir(group) / "state.json"

    @property
    def groups_dir(self) -> Path:
        return self.root / "groups"

    def stop_mark(self, group: int) -> Path:
        """Left by the group's life (hpcdl.process.lifecycle) on a stop request: the group checkpoints and stops."""
        return self.group_dir(group) / "stop"

    def requeue_mark(self, group: int) -> Path:
        """Left by a group's rank 0 that stopped on request after a checkpoint: requeue it."""
        return self.group_dir(group) / "requeue"

    def input_error_file(self, group: int) -> Path:
        """Left by a rank that refused its input (one line: what to fix); no restart can mend it."""
        return self.group_dir(group) / "input-error"

    def life_file(self, group: int) -> Path:
        """The group's life as hpcdl.process.lifecycle last published it: state, restarts, the reason."""
        return self.group_dir(group) / "life.json"

    @property
    def groups_ended_mark(self) -> Path:
        """Left by the local supervisor once every group has ended, however: the applier then
        applies its backlog and ends (a group that could not write its final state never says
        "finished")."""
        return self.scheduler_dir / "groups-ended"

    def restarts_file(self, group: int) -> Path:
        """The group's crash restarts and planned requeues over the run's life (hpcdl.process.lifecycle's
        RestartTally)."""
        return self.group_dir(group) / "restarts.json"

    def emulated_kill_mark(self, group: int) -> Path:
        """Exists once the straggler emulator's planned kill happened in this group."""
        return self.group_dir(group) / "emulated-kill"

    def rank_log(self, group: int, rank: int) -> Path:
        return self.group_dir(group) / f"rank{rank}.log"

    def step_times_dir(self, group: int) -> Path:
        return self.group_dir(group) / "step-times"

    def step_times_file(self, group: int, rank: int) -> Path:
        """Rank `rank` of group `group`: its own time of every step (hpcdl.rundir.steptimes)."""
        return self.step_times_dir(group) / f"rank{rank}.bin"

    def step_times_files(self) -> dict[tuple[int, int], Path]:
        """(group, rank) → the rank's step-time file, for every rank that recorded any."""
        found = {}
        for group in self.groups():
            for path in self.step_times_dir(group).glob("rank*.bin"):
                rank = path.stem.removeprefix("rank")
                if rank.isdigit():
                    found[group, int(rank)] = path
        return dict(sorted(found.items()))

    def mpi_launcher_log(self, group: int) -> Path:
        """The output of the local mpirun of a group (its ranks write their own rank logs)."""
        return self.group_dir(group) / "mpirun.log"

    @property
    def checkpoints_root(self) -> Path:
        """Every group's checkpoint directory."""
        return self.root / "checkpoints"

    def checkpoint_dir(self, group: int) -> Path:
        return self.checkpoints_root / str(group)

    def tensorboard_dir(self, group: int) -> Path:
        return self.root / "tensorboard" / str(group)

    def exchange_dir(self, job: Job) -> Path:
        return Path(job.exchange.directory) if job.exchange.directory else self.root / "exchange"

    def shard_dir(self, job: Job, shard: int) -> Path:
        """Shard k's channel; one applier (exchange.shards = 1) has the exchange directory itself."""
        root = self.exchange_dir(job)
        return root if job.exchange.shard_count == 1 else root / f"shard-{shard}"

    def shard_dirs(self, job: Job) -> list[Path]:
        return [self.shard_dir(job, k) for k in range(job.exchange.shard_count)]

    def partition_file(self, job: Job) -> Path:
        """Which tensor rows each shard owns, written by the first group root (exchange.shards > 1)."""
        return self.exchange_dir(job) / "partition.json"

    def groups(self) -> list[int]:
        base = self.root / "groups"
        if not base.is_dir():
            return []
        return sorted(int(p.name) for p in base.iterdir() if p.name.isdigit())

    def load_job(self, *, workload_code: bool = True) -> Job:
        """The run's job (see config.job_from_dict for `workload_code`)."""
        if not self.job_file.is_file():
            raise RunError(f"{self.root} is not a run directory (no job.toml)")
        try:
            return job_from_dict(read_toml_file(self.job_file), workload_code=workload_code)
        except JobError as exc:
            raise RunError(f"{self.job_file}: {exc}") from None

    def info(self) -> dict[str, Any]:
        if not self.info_file.is_file():
            raise RunError(f"{self.root} is not a run directory (no run.json)")
        info = read_json_file(self.info_file)
        if not isinstance(info, dict) or not isinstance(info.get("backend"), str):
            raise RunError(f"{self.info_file} is corrupt: not a run's record (no backend)")
        return info

    def created(self) -> float:
        """When the run was submitted: run.json's `created`, else the time in its id (a run's
        directory and files change as it goes, so their mtimes say nothing about its age)."""
        try:
            created = json.loads(self.info_file.read_text()).get("created")
            if isinstance(created, (int, float)):
                return float(created)
        except (OSError, ValueError, AttributeError):
            pass
        match = _ID_TIME.search(self.run_id)
        if match:
            try:
                return time.mktime(time.strptime(match.group(1), "%Y%m%d-%H%M%S"))
            except (ValueError, OverflowError):
                pass
        try:
            return self.job_file.stat().st_mtime  # written once, at submit
        except OSError:
            return 0.0

    def update_info(self, **fields: Any) -> None:
        info = self.info()
        info.update(fields)
        atomic_write_json(self.info_file, info)


_ID_TIME = re.compile(r"-(\d{8}-\d{6})-[0-9a-f]{4}$")


def new_run_id(job: Job) -> str:
    return f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


@contextmanager
def create_run(job: Job, backend: str, run_id: str | None = None) -> Iterator[tuple[RunDir, RunDir]]:
    """Build a run directory under a temporary name; it appears at its final path only if the
    body succeeds, so an error while preparing leaves no half-made run behind.

    Yields (staged, final): write into `staged`; refer to `final` in anything that outlives the
    submission (scripts, commands).

    The run gets its secret (`run.key`) and its access policy (`run.unix_group`): when the body is
    done, every directory and file in the staged tree is given the policy's mode (scripts keep
    their owner's execute bit), whatever the umask was when they were written."""
    try:
        access = access_for_job(job)
    except AccessError as exc:
        raise RunError(str(exc)) from None
    runs_dir = Path(job.run.runs_dir)
    access.make_dir(runs_dir, tighten=False)  # a new runs/ is ours; an existing one is left
    run_id = run_id or new_run_id(job)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{run_id}-", dir=runs_dir))
    final = runs_dir / run_id
    try:
        access.fix_dir(staging)
        staged = RunDir(staging)
        create_key(staging, access)
        atomic_write_bytes(staged.job_file, job.to_toml().encode())
        atomic_write_json(staged.info_file, {
            "run_id": run_id, "workload": job.workload, "backend": backend,
            "created": time.time(), "groups": job.run.groups,
            "ranks_per_group": job.run.ranks_per_group,
        })
        for g in range(job.run.groups):
            access.make_dir(staged.group_dir(g))
            access.make_dir(staged.step_times_dir(g))
            StorageReport(staged.storage_file(g), access).close()  # reserved while there is space
        access.make_dir(staged.scheduler_dir)
        StorageReport(staged.supervisor_storage_file, access).close()
        yield staged, RunDir(final)
        apply_access(staging, access)
        if os.path.lexists(final):
            raise RunIdTaken(f"{final} exists already")
        try:
            os.rename(staging, final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise RunIdTaken(f"{final} exists already") from None
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def apply_access(root: Path, access: Access) -> None:
    """Give every directory and regular file under `root` the policy's mode (not the key's,
    which is stricter; symbolic links are not followed)."""
    access.fix_dir(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = Path(dirpath) / name
            if not path.is_symlink():
                access.fix_dir(path)
        for name in filenames:
            if Path(dirpath) == root and name == KEY_FILE:
                continue
            access.fix_file(Path(dirpath) / name)


def list_runs(runs_dir: str | Path = RUNS_DIR) -> list[RunDir]:
    """The runs under runs_dir, newest first by creation (see RunDir.created)."""
    base = Path(runs_dir)
    if not base.is_dir():
        return []
    runs = [RunDir(p) for p in base.iterdir() if not p.name.startswith(".") and RunDir(p).info_file.is_file()]
    return sorted(runs, key=lambda r: (r.created(), r.run_id), reverse=True)


def find_run(ref: str | None, runs_dir: str | Path = RUNS_DIR) -> RunDir:
    """A run by path, by id under runs_dir, or (None) the newest run there (by creation)."""
    if ref:
        path = Path(ref)
        if not path.is_dir():
            path = Path(runs_dir) / ref
        if not RunDir(path).job_file.is_file():
            raise RunError(f"no run at {ref!r} (give a run directory or a run id under {runs_dir}/)")
        return RunDir(path)
    runs = list_runs(runs_dir)
    if not runs:
        raise RunError(f"no runs under {Path(runs_dir)}/ (start one with `hpcdl submit`)")
    return runs[0]


def read_json_file(path: Path) -> Any:
    """A JSON file a command needs; a missing, unreadable or malformed one is a RunError of one
    line that names the file."""
    try:
        data = read_regular(path)
    except OSError as exc:
        raise RunError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise RunError(f"{path} is corrupt: not UTF-8 text, so not JSON") from None
    except json.JSONDecodeError as exc:
        raise RunError(f"{path} is corrupt: not valid JSON ({exc.msg} at line {exc.lineno}, "
                       f"column {exc.colno})") from None


def read_toml_file(path: Path) -> dict[str, Any]:
    """As read_json_file, for TOML."""
    try:
        data = read_regular(path)
    except OSError as exc:
        raise RunError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise RunError(f"{path} is corrupt: not UTF-8 text, so not TOML") from None
    except tomllib.TOMLDecodeError as exc:
        raise RunError(f"{path} is corrupt: not valid TOML ({' '.join(str(exc).split())})") from None
