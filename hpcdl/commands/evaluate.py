"""Score a trained model: from a checkpoint, a checkpoint directory, or a whole run.

For a run directory the model is the run's best estimate of the result: the applier's newest
master weights when the run had an exchange, else group 0's newest checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcdl.fs.access import Access
from hpcdl.config import RUNS_DIR
from hpcdl.errors import HpcdlError
from hpcdl.rundir.runs import MANIFEST, RunDir, apply_access, find_run, read_json_file


class EvaluateError(HpcdlError, ValueError):
    """The path is not something that holds a trained model."""


def locate(ref: str | None, runs_dir: str | Path = RUNS_DIR) -> Path:
    """What `hpcdl evaluate` was given, as a path: None is the newest run under runs_dir (by
    creation); a run or checkpoint directory or a checkpoint prefix (`.../ckpt-400`, which is not
    itself a file) is taken as it is; otherwise a run id under runs_dir."""
    if ref is None:
        return find_run(None, runs_dir).root
    path = Path(ref)
    if path.exists() or Path(f"{path}.index").is_file():
        return path
    candidate = Path(runs_dir) / ref
    if RunDir.holds_run(candidate):
        return candidate
    raise EvaluateError(
        f"{ref} is neither a path nor a run id under {runs_dir}/ (expected a run directory or id, "
        "a checkpoint directory with manifest.json, or a checkpoint prefix such as .../ckpt-600)"
    )


def resolve_checkpoint(path: Path) -> tuple[Path, RunDir | None]:
    """(checkpoint directory or prefix, the run it belongs to if `path` is a run)."""
    if RunDir.holds_run(path):
        run = RunDir(path)
        run.info(), run.load_job()  # a torn run.json or job.toml: one line naming it, up front
        ckpt = run.checkpoint_dir(0)
        if not (ckpt / MANIFEST).is_file():
            raise EvaluateError(f"run {path} has no checkpoint yet")
        _check_manifest(ckpt / MANIFEST)
        return ckpt, run
    if path.is_dir() and (path / MANIFEST).is_file():
        _check_manifest(path / MANIFEST)
        return path, None
    if Path(str(path) + ".index").is_file() and (path.parent / MANIFEST).is_file():
        _check_manifest(path.parent / MANIFEST)
        return path, None
    raise EvaluateError(
        f"{path} is not a checkpoint (expected a run directory, a checkpoint directory with "
        "manifest.json, or a checkpoint prefix such as .../ckpt-600)"
    )


def _check_manifest(path: Path) -> None:
    """A torn, edited or foreign manifest is one line naming it, before TensorFlow loads anything."""
    from hpcdl.errors import JobError
    from hpcdl.jobfile import job_from_dict

    manifest = read_json_file(path)
    shape = manifest.get("input_shape") if isinstance(manifest, dict) else None
    if (not isinstance(manifest, dict) or not isinstance(manifest.get("job"), dict)
            or not isinstance(manifest.get("workload"), str) or not isinstance(manifest.get("stats"), dict)
            or not (isinstance(shape, list) and len(shape) >= 1
                    and all(type(d) is int and d > 0 for d in shape))):
        raise EvaluateError(f"{path} is corrupt: not an hpcdl checkpoint manifest")
    try:
        job = job_from_dict(manifest["job"])
    except JobError as exc:
        raise EvaluateError(f"{path} is corrupt: its job does not validate ({exc})") from None
    if job.workload != manifest["workload"]:
        raise EvaluateError(f"{path} is corrupt: workload {manifest['workload']!r} but a "
                            f"{job.workload} job")


@dataclass(frozen=True)
class Trained:
    """A model as `evaluate` and `export` take it: rebuilt from its checkpoint's manifest, with the
    run's newest master weights when `path` is a run that had an exchange (and `master`)."""

    model: Any
    manifest: dict[str, Any]
    source: str  # what the weights are, for the user: a checkpoint prefix or a master version
    run: RunDir | None
    checkpoint: Path


def load_trained(path: Path, master: bool = True) -> Trained:
    from hpcdl.rundir.group_files import CheckpointUnreadable, load_model
    from hpcdl.workloads import get_workload

    checkpoint, run = resolve_checkpoint(path)
    try:
        model, manifest = load_model(checkpoint, get_workload)
    except (FileNotFoundError, CheckpointUnreadable) as exc:
        raise EvaluateError(str(exc)) from None
    source = manifest["checkpoint"]
    if run is not None and master:
        job = run.load_job()
        if job.exchange.active(job.run.groups):
            from hpcdl.rundir.run_exchange import adopt_master_weights

            version = adopt_master_weights(run, job, model)
            if version is not None:
                source = f"master weights v{version} ({run.exchange_dir(job)})"
    return Trained(model, manifest, source, run, checkpoint)


def evaluate(path: Path, data: Path | None, out_dir: Path | None = None,
             scores_out: Path | None = None, progress=None,
             total: Callable[[int | None], None] | None = None, check_finite: bool = True,
             scan_progress=None) -> dict[str, Any]:
    """Score a checkpoint (or the run's master weights) on `data`; `progress(n)` is told of each
    n examples scored, `total(count)` once, of how many there are. `data` is first scanned for
    NaN/Inf (hpcdl.workloads.finite; `scan_progress` shows it) unless not `check_finite`."""
    from hpcdl.workloads import get_workload

    trained = load_trained(path)
    model, manifest, source, run, checkpoint = (trained.model, trained.manifest, trained.source, trained.run,
                                                trained.checkpoint)
    workload = get_workload(manifest["workload"])
    if data is None:
        data = Path(manifest["job"]["data"]["test"])
    if not data.is_file():
        raise EvaluateError(f"data file not found: {data}" if not data.is_dir()
                            else f"data: {data} is a directory, not a data file")
    if check_finite:
        from hpcdl.jobfile import job_from_dict
        from hpcdl.workloads.finite import check_file

        check_file(data, workload.finite_datasets(job_from_dict(manifest["job"]).data), progress=scan_progress)
    out_dir = out_dir or (run.eval_dir if run else Path(checkpoint if checkpoint.is_dir() else checkpoint.parent))
    for where in (out_dir, scores_out.parent if scores_out else None):
        _check_writable(where)
    # inside a run, its access policy (owner or unix group only); elsewhere, the user's umask
    inside = run is not None and out_dir.resolve().is_relative_to(run.root.resolve())
    access = Access.of_directory(run.root) if inside else None
    made = not out_dir.exists()
    if access:
        access.make_dir(out_dir)
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
    try:
        if total is not None:
            total(_examples(workload, data, manifest["stats"]))
        result = workload.evaluate(model, manifest["stats"], data, out_dir, scores_out=scores_out, progress=progress)
    except BaseException:
        if made and not any(out_dir.iterdir()):
            out_dir.rmdir()  # a refused evaluation leaves no empty directory behind
        raise
    if access:
        apply_access(out_dir, access)  # the figures, whatever the workload writes
    return {"model": source, "data": str(data), **result}


def _examples(workload, data: Path, stats: dict[str, Any]) -> int | None:
    """The workload's count of `data`'s examples, with the checkpoint's stats where its `examples`
    takes them (a plugin written before they were offered takes the path alone)."""
    import inspect

    if len(inspect.signature(workload.examples).parameters) >= 2:
        return workload.examples(data, stats)
    return workload.examples(data)


def _check_writable(directory: Path | None) -> None:
    """The nearest existing directory of ``directory`` must take new files (a read-only file
    system fails here, before minutes of scoring)."""
    if directory is None:
        return
    existing = Path(directory)
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise EvaluateError(f"cannot write into {directory}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise EvaluateError(f"cannot write into {directory}: {existing} is not writable")
