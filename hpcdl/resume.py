"""Resume a run in its own directory: every group from its newest checkpoint, the applier from its
durable state (so its exactly-once ledger goes on), after a dead supervisor, a cancel, exhausted
restarts, or to train a finished run for longer (`--set train.steps=N`).

All checks run before anything is written: the run must have ended, and the changes must keep its
checkpoints and exchange state usable (the fields in :data:`FIXED` cannot change). Then the job is
saved again, the marks the last run left (cancelled, stop, requeue) are cleared, each group's state
says it is pending again, and the backend starts the run as `submit` would.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from hpcdl.config import Job, load_job
from hpcdl.errors import JobError
from hpcdl.runs import RunDir, State, read_json_file, write_bytes_atomic, write_json_atomic
from hpcdl.lifecycle import begin_new_submission
from hpcdl.schedulers import get_scheduler
from hpcdl.schedulers.base import Scheduler, SubmitRequest
from hpcdl.schedulers.select import choose_backend
from hpcdl.schedulers.base import DryRun

# What the checkpoints, the shards and the applier's state were made with.
FIXED = {
    "workload": "the checkpoints hold another workload's model",
    "model": "the checkpoints hold the model's old shapes",
    "run.nodes": "each group's checkpoints and data shards belong to the old layout",
    "run.group_size": "each group's checkpoints and data shards belong to the old layout",
    "run.ranks_per_node": "each group's checkpoints and data shards belong to the old layout",
    "run.runs_dir": "the run stays where it is",
    "train.optimizer": "the checkpoints hold the old optimizer's slots",
    "exchange.enabled": "the applier's state and the groups' master versions belong together",
    "exchange.directory": "the applier's state is in the old exchange directory",
    "exchange.kind": "the applier's state was built for the old kind of update",
    "exchange.optimizer": "the applier's state holds the old rule's slots",
    "exchange.shards": "each shard's applier state holds its own part of the old partition",
}


@dataclass(frozen=True)
class PreparedResume:
    run: RunDir
    job: Job
    scheduler: Scheduler
    dryrun: DryRun
    note: str = ""


def _flat(job: Job) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": job.workload}
    for section, values in job.to_dict().items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
    return out


def prepare_resume(run: RunDir, overrides: list[str], python: str = sys.executable,
                   on_note: Callable[[str], None] | None = None, progress=None) -> PreparedResume:
    """Validate and render the resumed run; writes nothing."""
    old = run.load_job()
    info = run.info()
    active = get_scheduler(info.get("backend", old.run.backend)).is_active(run)
    if active is None:  # e.g. SLURM's controller does not answer: a second copy must not start
        raise JobError(f"cannot tell whether run {run.run_id} is still active (is its scheduler "
                       "reachable?): not resuming")
    if active:
        raise JobError(f"run {run.run_id} is still active: `hpcdl cancel {run.run_id}` first, or watch it "
                       "with `hpcdl status`")
    job = load_job(str(run.job_file), overrides)
    before, after = _flat(old), _flat(job)
    for key, why in FIXED.items():
        changed = [k for k in after if (k == key or k.startswith(key + ".")) and before.get(k) != after[k]]
        if changed:
            raise JobError(f"resume cannot change {changed[0]} ({why}); start a new run instead")
    note = ""
    if job.run.backend == "auto":
        backend, why = choose_backend()
        job = job.replace(run=dataclasses.replace(job.run, backend=backend))
        note = f"backend: {backend} ({why}; --backend chooses)"
        if on_note:
            on_note(note)
    reached = [_group_step(run, g) for g in range(job.run.groups)]
    if all(step >= job.train.steps for step in reached):
        raise JobError(f"every group of {run.run_id} has reached train.steps = {job.train.steps}: "
                       "resume with --set train.steps=N (more) to train longer")
    scheduler = get_scheduler(job.run.backend)
    dryrun = scheduler.submit_dryrun(SubmitRequest(job, run, python, scheduler.cluster_facts(job)))
    if job.run.check_data:
        from hpcdl.workloads import get_workload
        from hpcdl.workloads.finite import check_job_data

        get_workload(job.workload).check_data(job)
        check_job_data(get_workload(job.workload), job, progress)
    return PreparedResume(run, job, scheduler, dryrun, note)


def _group_step(run: RunDir, group: int) -> int:
    try:
        state = read_json_file(run.group_state_file(group))
    except Exception:  # a missing or garbled state: the checkpoint decides, at start
        return 0
    return state.get("step", 0) if isinstance(state, dict) and isinstance(state.get("step"), int) else 0


def resume_run(prepared: PreparedResume, **schedule_options: Any) -> dict[str, Any]:
    run, job = prepared.run, prepared.job
    write_bytes_atomic(run.job_file, job.to_toml().encode())
    for name, text in prepared.dryrun.files.items():
        target = run.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(target, text.encode())
        if text.startswith("#!"):
            target.chmod(0o755)
    begin_new_submission(run, job.run.groups)
    for g in range(job.run.groups):
        path = run.group_state_file(g)
        try:
            state = read_json_file(path)
        except Exception:
            state = {}
        # "finished" would let the applier end at once; the ranks report again from their start
        write_json_atomic(path, {**(state if isinstance(state, dict) else {}), "state": State.PENDING})
    resumed = list(run.info().get("resumed", []))
    resumed.append(time.time())
    run.update_info(backend=job.run.backend, resumed=resumed)
    ids = prepared.scheduler.schedule(prepared.dryrun, **schedule_options)
    run.update_info(**{k: v for k, v in ids.items() if k != "ok"})
    return {"run_id": run.run_id, "run_dir": str(run.root), **ids}
