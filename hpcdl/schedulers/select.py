"""Which scheduler: the one `run.backend = "auto"` picks here, the one a run was submitted to,
and the newest run that still has something queued or running (a bare `hpcdl cancel`); and the
collective `run.controller = "auto"` picks."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from hpcdl.config import RUNS_DIR
from hpcdl.errors import JobError
from hpcdl.rundir.runs import RunDir, RunError, find_run, list_runs
from hpcdl.schedulers import get_scheduler
from hpcdl.schedulers.base import Scheduler, SchedulerError


def choose_backend() -> tuple[str, str]:
    """run.backend = "auto": (backend, why). SLURM where `sbatch` is on PATH and the controller
    answers `scontrol ping`; this machine otherwise."""
    if shutil.which("sbatch") is None:
        return "local", "run.backend = auto and there is no sbatch on PATH"
    from hpcdl.schedulers.slurm import SlurmScheduler

    answers, detail = SlurmScheduler().controller_answers()
    if answers:
        return "slurm", "run.backend = auto: sbatch is on PATH and the SLURM controller answers"
    return "local", f"run.backend = auto: sbatch is on PATH but the SLURM controller does not answer ({detail})"


def choose_controller(python: str = sys.executable) -> tuple[str, str]:
    """run.controller = "auto": (controller, why). Horovod over Gloo where it loads (it needs no
    MPI launcher), else mpi4py where it loads an MPI; neither: a JobError saying what to install."""
    from hpcdl.process.launch import horovod_built, mpi4py_problem

    if horovod_built("gloo"):
        return "gloo", "run.controller = auto: Horovod with Gloo loads here"
    problem = mpi4py_problem(python)
    if not problem:
        return "mpi4py", "run.controller = auto: Horovod does not load here, mpi4py does"
    raise JobError(f"run.controller = auto: neither Horovod with Gloo nor mpi4py loads here (mpi4py: {problem}); "
                   "reinstall with `make install` (`hpcdl doctor` shows what is missing)")


def scheduler_of(run: RunDir) -> Scheduler:
    return get_scheduler(run.info()["backend"])


def newest_active_run(runs_dir: str | Path = RUNS_DIR) -> tuple[RunDir | None, list[RunDir]]:
    """The newest run (by creation) under runs_dir that still has something queued or running,
    and the runs whose state could not be told (a controller that did not answer); a run that
    finished, failed or was cancelled is never picked."""
    runs = list_runs(runs_dir)
    if not runs:
        raise RunError(f"no runs under {Path(runs_dir)}/ (start one with `hpcdl submit`)")
    unknown = []
    unreachable: set[str] = set()  # a backend that could not tell once is not asked again
    for run in runs:
        try:
            scheduler = scheduler_of(run)
            active = None if scheduler.name in unreachable else scheduler.is_active(run)
            if active is None and scheduler.name == "slurm":
                unreachable.add(scheduler.name)
        except (RunError, SchedulerError):
            active = None
        if active:
            return run, unknown
        if active is None:
            unknown.append(run)
    return None, unknown


def cancel_run(ref: str | None, runs_dir: str | Path = RUNS_DIR) -> str:
    """`hpcdl cancel [RUN]`: the named run, or (None) the newest run that is still active."""
    if ref:
        run = find_run(ref, runs_dir)
        return f"{run.run_id}: {scheduler_of(run).cancel(run)}"
    run, unknown = newest_active_run(runs_dir)
    if run is None:
        text = f"nothing to cancel: no run under {Path(runs_dir)}/ is still queued or running"
        if unknown:
            text += (f" (could not tell for {', '.join(r.run_id for r in unknown[:3])}"
                     f"{' …' if len(unknown) > 3 else ''}: name the run to cancel it anyway)")
        return text
    return f"the newest active run is {run.run_id}: {scheduler_of(run).cancel(run)}"
