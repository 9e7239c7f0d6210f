"""From a job name to a running job: resolve, validate, render, write the run directory, schedule.

All checks run before anything is written. The run directory is staged and renamed into place
only when complete; if scheduling then fails, the backend has already undone what it started and
the directory is removed, so a failed submission leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcdl.config import Job, check_plain_text, load_job, resolve_job_path
from hpcdl.runs import RunDir, RunIdTaken, create_run, new_run_id, read_toml_file
from hpcdl.schedulers import Scheduler, SubmitRequest, choose_backend, get_scheduler
from hpcdl.schedulers.base import DryRun
from hpcdl.workloads import get_workload


@dataclass(frozen=True)
class Prepared:
    job: Job
    scheduler: Scheduler
    dryrun: DryRun
    note: str = ""  # for the user: which backend run.backend = "auto" chose, and why


def prepare(job_ref: str, overrides: list[str], python: str = sys.executable,
            cluster: dict[str, Any] | None = None, on_note: Callable[[str], None] | None = None) -> Prepared:
    """Validate and render; no side effects. `cluster` holds facts about the target (SLURM's
    MaxArraySize, this machine's cores, whether Horovod has MPI). `on_note` hears at once which
    backend "auto" chose, so the user knows it even when a check then refuses the job."""
    read_toml_file(resolve_job_path(job_ref))  # a truncated or binary job file: one line naming it
    job = load_job(job_ref, overrides)
    check_plain_text("the job's name", job.name)  # it starts the run id, a directory name
    note = ""
    if job.run.backend == "auto":
        backend, why = choose_backend()
        job = job.replace(run=dataclasses.replace(job.run, backend=backend))  # job.toml says which
        note = f"backend: {backend} ({why}; --backend chooses)"
        if on_note:
            on_note(note)
    scheduler = get_scheduler(job.run.backend)
    if cluster is None:
        cluster = scheduler.cluster_facts(job)
    run = RunDir(Path(job.run.runs_dir) / new_run_id(job))
    dryrun = scheduler.submit_dryrun(SubmitRequest(job, run, python, cluster))  # checks the size
    if job.run.check_data:  # on both backends: a missing file would fail every SLURM element
        get_workload(job.workload).check_data(job)
    return Prepared(job, scheduler, dryrun, note)


RUN_ID_ATTEMPTS = 8


def submit_run(prepared: Prepared, **schedule_options: Any) -> dict[str, Any]:
    job = prepared.job
    for attempt in range(RUN_ID_ATTEMPTS):
        dry = prepared.dryrun
        try:
            with create_run(job, prepared.scheduler.name, run_id=dry.request.run.run_id) as (staged, final):
                for name, text in dry.files.items():
                    target = staged.root / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(text)
                    if text.startswith("#!"):
                        target.chmod(0o755)
            break
        except RunIdTaken:
            # Another submission took the id (same job, same second, same 16 random bits): the
            # scripts name the run's directory, so they are rendered again for a fresh id.
            if attempt == RUN_ID_ATTEMPTS - 1:
                raise
            prepared = renamed(prepared)
    try:
        ids = prepared.scheduler.schedule(dry, **schedule_options)
    except BaseException:
        # A local run that failed while training keeps its directory: its logs say why.
        if prepared.scheduler.name != "local":
            shutil.rmtree(final.root, ignore_errors=True)
        raise
    final.update_info(**{k: v for k, v in ids.items() if k != "ok"})
    return {"run_id": final.run_id, "run_dir": str(final.root), **ids}


def renamed(prepared: Prepared) -> Prepared:
    """The same submission rendered for a new run id."""
    request = prepared.dryrun.request
    run = RunDir(request.run.root.parent / new_run_id(prepared.job))
    fresh = SubmitRequest(request.job, run, request.python, request.cluster)
    return Prepared(prepared.job, prepared.scheduler, prepared.scheduler.submit_dryrun(fresh), prepared.note)
