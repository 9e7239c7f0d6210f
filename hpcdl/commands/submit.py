"""From a job name to a running job: resolve, validate, render, write the run directory, schedule.

All checks run before anything is written. The run directory is staged and renamed into place
only when complete; if scheduling then fails, the backend has already undone what it started and
the directory is removed, so a failed submission leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcdl.config import Job, check_plain_text
from hpcdl.errors import JobError
from hpcdl.jobfile import load_job
from hpcdl.rundir.runs import RunDir, RunIdTaken, create_run, new_run_id
from hpcdl.fs.files import atomic_write_bytes
from hpcdl.schedulers import get_scheduler
from hpcdl.schedulers.base import DryRun, Scheduler, SubmitRequest
from hpcdl.schedulers.select import choose_backend, choose_controller
from hpcdl.engine.tuning import compute_dtype, precision_refusal, read_cpuinfo
from hpcdl.workloads import get_workload
from hpcdl.workloads.common import absolute_split_paths
from hpcdl.workloads.finite import ProgressFactory, check_job_data


@dataclass(frozen=True)
class Prepared:
    """A run rendered and checked, nothing written: what `submit` and `resume` start."""

    job: Job
    run: RunDir  # where it runs (submit: the new directory's final path)
    scheduler: Scheduler
    dryrun: DryRun
    note: str = ""  # for the user: which backend and controller "auto" chose, and why


def prepare(job_ref: str, overrides: list[str] = (), settings: dict[str, Any] | None = None,
            python: str = sys.executable, cluster: dict[str, Any] | None = None,
            on_note: Callable[[str], None] | None = None, progress: ProgressFactory | None = None) -> Prepared:
    """A new run of the job: `overrides` as typed after --set, `settings` typed values (the
    CLI's options). Validates and renders; no side effects. `cluster` holds facts about the target
    (SLURM's MaxArraySize, this machine's cores, whether Horovod has MPI). `on_note` hears at once
    what was chosen for the job (the backend "auto" picks, the shards), so the user knows it even
    when a check then refuses the job; `progress` shows the data's NaN/Inf scan."""
    job = load_job(job_ref, overrides, settings)
    check_plain_text("the job's name", job.name)  # it starts the run id, a directory name
    notes = []
    if job.exchange.shards == "auto":
        job, shards_note = resolve_shards(job)
        notes.append(shards_note)
        if on_note:
            on_note(shards_note)
    run = RunDir(Path(job.run.runs_dir).absolute() / new_run_id(job))  # both backends print and use one spelling
    return prepare_launch(job, run, python, cluster, on_note, progress, notes)


def prepare_launch(job: Job, run: RunDir, python: str = sys.executable, cluster: dict[str, Any] | None = None,
                   on_note: Callable[[str], None] | None = None, progress: ProgressFactory | None = None,
                   notes: list[str] = ()) -> Prepared:
    """What a new run and a resumed one share: data paths made absolute (from where one
    submits), the backend ("auto" chosen here), its render of the run, and every check of the job
    against the installation and its data. Writes nothing."""
    job = job.replace(data=absolute_split_paths(job.data, Path.cwd()))
    notes = list(notes)
    if job.run.backend == "auto":
        backend, why = choose_backend()
        job = job.replace(run=dataclasses.replace(job.run, backend=backend))  # job.toml says which
        notes.insert(0, f"backend: {backend} ({why}; --backend chooses)")
        if on_note:
            on_note(notes[0])
    if job.run.controller == "auto":
        controller, why = choose_controller(python)
        job = job.replace(run=dataclasses.replace(job.run, controller=controller))  # job.toml says which
        notes.append(f"controller: {controller} ({why})")
    scheduler = get_scheduler(job.run.backend)
    if cluster is None:
        cluster = scheduler.cluster_facts(job)
    dryrun = scheduler.submit_dryrun(SubmitRequest(job, run, python, cluster))  # checks the size
    check_precision(job)
    exchange = Path(job.exchange.directory) if job.exchange.directory else None
    if exchange is not None and job.exchange.active(job.run.groups) and (
            os.path.lexists(exchange) and not exchange.is_dir()):
        raise JobError(f"exchange.directory: {exchange} exists and is not a directory")
    # on both backends: a missing file would fail every SLURM element; a workload that builds
    # the user's model checks it here, once, even when the data is only on the compute nodes
    workload = get_workload(job.workload)
    try:
        workload.check_job(job, data=job.run.check_data)
        check_job_data(workload, job, progress)
    except OSError as exc:  # a plugin's own reader (h5py says neither field nor file): say whose check
        raise JobError(f"the {job.workload} workload's check of the job's data failed: "
                       f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")) from None
    return Prepared(job, run, scheduler, dryrun, "; ".join(notes))


def write_rendered(root: Path, files: dict[str, str]) -> None:
    """A render's files in a run directory, each published atomically; scripts executable."""
    for name, text in files.items():
        target = root / name
        atomic_write_bytes(target, text.encode())
        if text.startswith("#!"):
            target.chmod(0o755)


# exchange.shards = "auto" at submit: the planner's rule without a measurement (`hpcdl plan`
# measures this machine); the node rate is the paper's Xeon Phi figure, said in the note.
AUTO_SHARDS_NODE_FLOPS = 1.9e12


def resolve_shards(job: Job) -> tuple[Job, str]:
    """exchange.shards = "auto": the planner's recommendation for this job's groups and H."""
    shards, why = _auto_shards(job) if job.exchange.active(job.run.groups) else (1, "no exchange")
    job = job.replace(exchange=dataclasses.replace(job.exchange, shards=shards))
    return job, f"exchange.shards: {shards} ({why})"


def _auto_shards(job: Job) -> tuple[int, str]:
    from hpcdl.perf.command import JobNetwork, PlanInputError
    from hpcdl.perf.planner import MAX_APPLIER_UTILISATION, PlanInputs, job_exchange_values, recommend_shards

    try:
        network = JobNetwork.of_job(job, job.name)
    except PlanInputError as exc:
        return 1, f"{exc}; give exchange.shards a number"
    inputs = PlanInputs.measured_here(
        AUTO_SHARDS_NODE_FLOPS, batch_per_node=network.batch_per_node,
        source="exchange.shards = \"auto\"").with_values("the job", **job_exchange_values(job.exchange))
    inputs = inputs.with_values(network.name, flops_per_example=network.flops, model_bytes=float(network.params * 4))
    advice = recommend_shards(inputs, job.run.nodes, job.run.groups)
    why = (f"each applier {advice.applier_utilisation:.0%} busy by hpcdl plan's model for {network.name}, "
           f"{network.params:,} parameters, at an assumed {AUTO_SHARDS_NODE_FLOPS / 1e12:g} TFLOP/s per node; "
           f"`hpcdl plan` measures")
    if network.shape_is_default:
        why += "; data.train is not readable here, so at the workload's default input shape"
    if advice.applier_utilisation > MAX_APPLIER_UTILISATION:
        why += (f"; above the {MAX_APPLIER_UTILISATION:.0%} bound: more shards cost each group a file per "
                f"exchange and do not bring it under; a larger exchange.every lightens the appliers")
    return advice.shards, why


RUN_ID_ATTEMPTS = 8


def submit_run(prepared: Prepared, **schedule_options: Any) -> dict[str, Any]:
    job = prepared.job
    for attempt in range(RUN_ID_ATTEMPTS):
        dry = prepared.dryrun
        try:
            with create_run(job, prepared.scheduler.name, run_id=prepared.run.run_id) as (staged, final):
                write_rendered(staged.root, dry.files)
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
        # Nothing was started (a backend undoes its part): nothing of the run is left. A run
        # that started and then failed returns (ok is False) and keeps its logs.
        shutil.rmtree(final.root, ignore_errors=True)
        raise
    final.update_info(**{k: v for k, v in ids.items() if k != "ok"})
    return {"run_id": final.run_id, "run_dir": str(final.root), **ids}


def renamed(prepared: Prepared) -> Prepared:
    """The same submission rendered for a new run id."""
    request = prepared.dryrun.request
    run = RunDir(prepared.run.root.parent / new_run_id(prepared.job))
    fresh = SubmitRequest(request.job, run, request.python, request.cluster)
    return dataclasses.replace(prepared, run=run, dryrun=prepared.scheduler.submit_dryrun(fresh))


def check_precision(job: Job, cpu=None) -> None:
    """One line if the job's tuning.precision cannot run: a workload without that compute dtype,
    or (local backend: the ranks run on this CPU) no native bfloat16 for mixed_bfloat16. Under
    SLURM the compute nodes' CPU is not known here; each rank checks its own (hpcdl.process.worker)."""
    dtype = compute_dtype(job.tuning.precision)
    workload = get_workload(job.workload)
    if dtype not in workload.compute_dtypes:
        raise JobError(f"tuning.precision = {job.tuning.precision}: the {job.workload} workload computes in "
                       f"{', '.join(workload.compute_dtypes)} only")
    if job.run.backend == "local":
        refusal = precision_refusal(job.tuning, cpu or read_cpuinfo())
        if refusal:
            raise JobError(refusal)
