"""One interface, several backends.

`submit_dryrun(request)` is pure: it renders everything the backend would write and run (scripts,
commands) from the request alone, probing nothing, so `--dry-run` shows the exact submission and
golden tests need no patching. `schedule(dryrun)` carries it out. `describe` reads the run's
state; `cancel` is safe to repeat.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from hpcdl.config import Job
from hpcdl.errors import HpcdlError, JobError
from hpcdl.rundir.runs import RunDir


class SchedulerError(HpcdlError, RuntimeError):
    """A submission, query or cancellation that failed; the message is for the user."""

    exit_code = 1  # the scheduler failed, not the user's input


@dataclass(frozen=True)
class SubmitRequest:
    """Everything a backend needs to render a submission."""

    job: Job
    run: RunDir  # where the run directory will be (rendered paths point here)
    python: str  # the interpreter that has hpcdl installed
    cluster: dict[str, Any] = field(default_factory=dict)  # facts fetched beforehand (SLURM)


@dataclass(frozen=True)
class DryRun:
    """The exact submission: files to write into the run directory and commands to run."""

    backend: str
    files: dict[str, str]  # path relative to the run directory -> content
    commands: list[list[str]]
    request: SubmitRequest
    roles: list[str] = field(default_factory=list)  # what each command starts ("applier 0", "group 1", "array")

    def render(self) -> str:
        import shlex

        parts = []
        for name, text in self.files.items():
            parts.append(f"# --- {name} ---\n{text}")
        parts.append("# --- commands ---")
        parts.extend(" ".join(shlex.quote(a) for a in cmd) for cmd in self.commands)
        return "\n".join(parts) + "\n"


def controller_facts(job: Job | None) -> dict[str, Any]:
    """What the controller needs of this installation, read before rendering (the ranks run this
    installation's Python, on either backend): for "mpi" whether Horovod was built with MPI, for
    "mpi4py" what keeps mpi4py from loading an MPI library, if anything."""
    if job is None or not job.run.mpi_launched:
        return {}
    from hpcdl.process.launch import horovod_built, mpi4py_problem

    if job.run.controller == "mpi":
        return {"horovod_mpi": horovod_built("mpi")}
    return {"mpi4py_problem": mpi4py_problem(sys.executable)}


def check_controller(request: SubmitRequest) -> None:
    """Refuse a controller this installation lacks (facts fetched beforehand by
    `controller_facts`): every rank would fail as it starts otherwise."""
    if request.job.run.controller == "mpi" and request.cluster.get("horovod_mpi") is False:
        raise JobError('run.controller = "mpi" needs Horovod built with MPI, and the installed one has '
                       "Gloo only: reinstall with `make install MPI=1` (README, Installation; "
                       "`hpcdl doctor` shows the build)")
    problem = request.cluster.get("mpi4py_problem")
    if request.job.run.controller == "mpi4py" and problem:
        raise JobError(f'run.controller = "mpi4py" cannot load MPI here: {problem} (`hpcdl doctor` shows the collectives)')


class Scheduler(ABC):
    name: str

    def cluster_facts(self, job: Job | None = None) -> dict[str, Any]:
        """Facts about the target that rendering `job` needs, read beforehand (SLURM's
        MaxArraySize, srun's MPI plugins, this machine's cores, Horovod's build)."""
        return controller_facts(job)

    @abstractmethod
    def submit_dryrun(self, request: SubmitRequest) -> DryRun:
        """Render the submission; no side effects."""

    @abstractmethod
    def schedule(self, dryrun: DryRun, *, detach: bool = False,
                 watch: Callable[[RunDir, dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Carry out exactly the rendered submission; all or nothing. Returns ids to record in
        run.json, and ``ok`` where it waited for the run's end. A backend whose run stays attached
        to this process (the local one, unless ``detach``) calls ``watch`` with its `describe()`
        view of the run while it waits; a queueing backend returns once submitted."""

    @abstractmethod
    def describe(self, run: RunDir) -> dict[str, Any]:
        """The backend's view of the run: {"groups": {g: {...}}, "applier": {...}, "note": str}."""

    @abstractmethod
    def cancel(self, run: RunDir) -> str:
        """Stop everything of the run that still runs; repeating it is harmless. The answer says
        what was stopped, or that there was nothing to cancel."""

    @abstractmethod
    def is_active(self, run: RunDir) -> bool | None:
        """Whether anything of the run is still queued or running; None when it cannot tell."""
