"""Resume a run in its own directory: every group from its newest checkpoint, the applier from its
durable state (so its exactly-once ledger goes on), after a dead supervisor, a cancel, exhausted
restarts, or to train a finished run for longer (`--set train.steps=N`).

All checks run before anything is written: the run must have ended, and the changes must keep its
checkpoints and exchange state usable (the fields in :data:`FIXED` cannot change). Then the job is
saved again, the marks the last run left (cancelled, stop, requeue) are cleared, each group's state
says it is pending again, and the backend starts the run as `submit` would.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

from hpcdl.config import Job
from hpcdl.errors import JobError
from hpcdl.jobfile import job_with
from hpcdl.process.lifecycle import begin_new_submission
from hpcdl.rundir.runs import RunDir, State, read_json_file
from hpcdl.fs.files import atomic_write_bytes, atomic_write_json
from hpcdl.schedulers import get_scheduler
from hpcdl.commands.submit import Prepared, prepare_launch, write_rendered

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


def _flat(job: Job) -> dict[str, Any]:
    out: dict[str, Any] = {"workload": job.workload}
    for section, values in job.to_dict().items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
    return out


def prepare_resume(run: RunDir, overrides: list[str] = (), settings: dict[str, Any] | None = None,
                   python: str = sys.executable, on_note: Callable[[str], None] | None = None,
                   progress=None) -> Prepared:
    """Validate and render the resumed run as submit does (hpcdl.commands.submit.prepare_launch), after
    what only a resume checks; writes nothing."""
    old = run.load_job()
    info = run.info()
    active = get_scheduler(info.get("backend", old.run.backend)).is_active(run)
    if active is None:  # e.g. SLURM's controller does not answer: a second copy must not start
        raise JobError(f"cannot tell whether run {run.run_id} is still active (is its scheduler "
                       "reachable?): not resuming")
    if active:
        raise JobError(f"run {run.run_id} is still active: `hpcdl cancel {run.run_id}` first, or watch it "
                       "with `hpcdl status`")
    job = job_with(old, overrides, settings)
    before, after = _flat(old), _flat(job)
    for key, why in FIXED.items():
        changed = [k for k in after if (k == key or k.startswith(key + ".")) and before.get(k) != after[k]]
        if changed:
            raise JobError(f"resume cannot change {changed[0]} ({why}); start a new run instead")
    reached = [_group_step(run, g) for g in range(job.run.groups)]
    if all(step >= job.train.steps for step in reached):
        raise JobError(f"every group of {run.run_id} has reached train.steps = {job.train.steps}: "
                       "resume with --set train.steps=N (more) to train longer")
    return prepare_launch(job, run, python, None, on_note, progress)


def _group_step(run: RunDir, group: int) -> int:
    try:
        state = read_json_file(run.group_state_file(group))
    except Exception:  # a missing or garbled state: the checkpoint decides, at start
        return 0
    return state.get("step", 0) if isinstance(state, dict) and isinstance(state.get("step"), int) else 0


def resume_run(prepared: Prepared, **schedule_options: Any) -> dict[str, Any]:
    run, job = prepared.run, prepared.job
    atomic_write_bytes(run.job_file, job.to_toml().encode())
    write_rendered(run.root, prepared.dryrun.files)
    begin_new_submission(run, job.run.groups)
    for g in range(job.run.groups):
        path = run.group_state_file(g)
        try:
            state = read_json_file(path)
        except Exception:
            state = {}
        # "finished" would let the applier end at once; the ranks report again from their start
        atomic_write_json(path, {**(state if isinstance(state, dict) else {}), "state": State.PENDING})
    resumed = list(run.info().get("resumed", []))
    resumed.append(time.time())
    run.update_info(backend=job.run.backend, resumed=resumed)
    ids = prepared.scheduler.schedule(prepared.dryrun, **schedule_options)
    run.update_info(**{k: v for k, v in ids.items() if k != "ok"})
    return {"run_id": run.run_id, "run_dir": str(run.root), **ids}
