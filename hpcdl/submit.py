"""From a job name to a running job: resolve, validate, render, write the run directory, schedule.

All checks run before anything is written. The run directory is staged and renamed into place
only when complete; if scheduling then fails, the backend has already undone what it started and
the directory is removed, so a failed submission leaves nothing behind.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcdl.config import Job, load_job
from hpcdl.runs import RunDir, create_run, new_run_id
from hpcdl.schedulers import Scheduler, SubmitRequest, get_scheduler
from hpcdl.schedulers.base import DryRun
from hpcdl.workloads import get_workload


@dataclass(frozen=True)
class Prepared:
    job: Job
    scheduler: Scheduler
    dryrun: DryRun


def prepare(job_ref: str, overrides: list[str], python: str = sys.executable,
            cluster: dict[str, Any] | None = None) -> Prepared:
    """Validate and render; no side effects. `cluster` holds facts about the target (SLURM)."""
    job = load_job(job_ref, overrides)
    scheduler = get_scheduler(job.run.backend)
    if job.run.backend == "local":
        get_workload(job.workload).check_data(job)
    if cluster is None:
        cluster = scheduler.cluster_facts()
    run = RunDir(Path(job.run.runs_dir) / new_run_id(job))
    return Prepared(job, scheduler, scheduler.submit_dryrun(SubmitRequest(job, run, python, cluster)))


def submit_run(prepared: Prepared, **schedule_options: Any) -> dict[str, Any]:
    job, dry = prepared.job, prepared.dryrun
    with create_run(job, prepared.scheduler.name, run_id=dry.request.run.run_id) as (staged, final):
        for name, text in dry.files.items():
            target = staged.root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            if text.startswith("#!"):
                target.chmod(0o755)
    try:
        ids = prepared.scheduler.schedule(dry, **schedule_options)
    except BaseException:
        # A local run that failed while training keeps its directory: its logs say why.
        if prepared.scheduler.name != "local":
            shutil.rmtree(final.root, ignore_errors=True)
        raise
    final.update_info(**{k: v for k, v in ids.items() if k != "ok"})
    return {"run_id": final.run_id, "run_dir": str(final.root), **ids}
