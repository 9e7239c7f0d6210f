"""A group's files in its run directory, written for the engine (which knows no layout):
rank 0's metrics lines, TensorBoard scalars, state file, checkpoints and the manifest beside them
(`GroupRecorder`), and the model rebuilt from a checkpoint and that manifest (`load_model`). A
full disk or quota is recorded in the group's storage report (`hpcdl status` shows it) and
training goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from hpcdl.config import Job
from hpcdl.fs.files import append_jsonl, atomic_write_json
from hpcdl.jobfile import job_from_dict
from hpcdl.rundir.runs import MANIFEST, State
from hpcdl.fs.storage import StorageReport, attempt, recorded_checkpoint, save_checkpoint


class GroupRecorder:
    """Rank 0's files of one group: hpcdl.engine.train's `Recorder`."""

    def __init__(self, job: Job, stats: dict[str, Any], storage: StorageReport, *, checkpoints: Path,
                 metrics: Path, state: Path, tensorboard: Path):
        import tensorflow as tf

        self.job, self.stats, self.storage = job, stats, storage
        self.checkpoints, self.metrics_path, self.state_path = checkpoints, metrics, state
        self.writer = tf.summary.create_file_writer(str(tensorboard))

    def manifest(self, input_shape, variable_names: list[str]) -> None:
        """How to rebuild the model from the checkpoints beside it (load_model)."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.checkpoints / MANIFEST, {
            "workload": self.job.workload,
            "job": self.job.to_dict(),
            "stats": self.stats,
            "input_shape": list(input_shape),
            "variables": variable_names,
        })

    def _scalars(self, step: int, values: dict[str, float]) -> None:
        import tensorflow as tf

        def write():
            with self.writer.as_default(step=step):
                for key, value in values.items():
                    tf.summary.scalar(key, value)

        attempt(self.storage, "tensorboard", write)

    def validation(self, step: int, validation: dict[str, Any]) -> None:
        self._scalars(step, {k.replace("val_", "validation/", 1): v for k, v in validation.items()
                             if k not in ("val_step", "val_master_version")})

    def metrics(self, step: int, line: dict[str, Any]) -> None:
        attempt(self.storage, "metrics", append_jsonl, self.metrics_path, line)
        self._scalars(step, {k: line[k] for k in ("loss", "images_per_s", "flops_per_s_group")})
        self._state({"state": State.RUNNING, **line})

    def end(self, final: dict[str, Any], *, stopped: bool) -> bool:
        """The group's last word: finished, or stopped at a checkpoint on request."""
        return self._state({**final, "state": State.STOPPED if stopped else State.FINISHED})

    def _state(self, doc: dict[str, Any]) -> bool:
        return attempt(self.storage, "state", atomic_write_json, self.state_path, doc)

    def checkpoint(self, manager, step: int) -> None:
        # On ENOSPC/EDQUOT: partial files removed, the previous checkpoint kept, reported.
        save_checkpoint(self.storage, lambda: manager.save(checkpoint_number=step), self.checkpoints, step)

    def has_checkpoint(self, step: int) -> bool:
        return recorded_checkpoint(self.checkpoints) == f"ckpt-{step}"

    def close(self) -> None:
        attempt(self.storage, "tensorboard", self.writer.flush)


class CheckpointUnreadable(ValueError):
    """A checkpoint TensorFlow cannot restore into the model its manifest describes."""


def load_model(checkpoint: Path, workload_for: Callable[[str], Any]):
    """Rebuild a model from a checkpoint directory or prefix and its manifest.

    Returns (model, manifest). Only TensorFlow's checkpoint format and JSON are read.
    """
    import tensorflow as tf

    from hpcdl.engine.train import restore_model

    directory = checkpoint if checkpoint.is_dir() else checkpoint.parent
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not an hpcdl checkpoint (no {MANIFEST} beside it)")
    manifest = json.loads(manifest_path.read_text())
    prefix = tf.train.latest_checkpoint(str(directory)) if checkpoint.is_dir() else str(checkpoint)
    if prefix is None or not Path(prefix + ".index").is_file():
        raise FileNotFoundError(f"{checkpoint} holds no checkpoint yet")
    job = job_from_dict(manifest["job"])
    workload = workload_for(manifest["workload"])
    try:
        model = workload.build_model(job.model, tuple(manifest["input_shape"]), seed=0)
    except ValueError as exc:
        raise CheckpointUnreadable(f"{manifest_path}: its model cannot be built ({exc})") from None
    reason = restore_model(model, prefix)
    if reason:
        raise CheckpointUnreadable(f"{prefix}: the checkpoint is damaged or not this manifest's model ({reason})")
    manifest["checkpoint"] = prefix
    return model, manifest
