"""The Keras job's `[data]` and `[model]` sections."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from hpcdl.errors import JobError

Task = Literal["classification", "regression"]
Output = Literal["auto", "logits", "probabilities"]


@dataclass(frozen=True)
class KerasDataConfig:
    train: str = ""  # HDF5 file of the training examples
    val: str = ""  # validation file (train.validate_every); empty: no validation
    test: str = ""  # what `hpcdl evaluate` scores by default
    inputs: str = "x"  # dataset of the examples, shape (N, ...): any shape per example
    labels: str = "y"  # dataset of the targets: (N,) class numbers, or (N,) / (N, k) regression targets
    weights: str = ""  # dataset of per-example weights (N,); empty: every example weighs 1
    task: Task = "classification"  # classification (labels 0 .. classes-1) or regression
    classes: int = 2  # classification: the number of classes
    normalize: bool = False  # inputs standardised per channel (last axis) with the training file's mean and std
    standardize_targets: bool = False  # regression: each target trained as (y - mean) / std of the training file; predictions are given back in the targets' own units
    chunk: int = 4096  # examples read at a time (memory: about (prefetch + 2) chunks)
    prefetch: int = 2  # chunks read ahead by a background thread

    def validate(self) -> None:
        if not self.train:
            raise JobError("data.train must name the training file")
        if not self.inputs or not self.labels:
            raise JobError("data.inputs and data.labels must name datasets of the files")
        if self.task == "classification" and self.classes < 2:
            raise JobError(f"data.classes must be >= 2 for classification, got {self.classes}")
        if self.standardize_targets and self.task != "regression":
            raise JobError("data.standardize_targets is for data.task = \"regression\"")
        if self.chunk < 1 or self.prefetch < 0:
            raise JobError("data.chunk must be >= 1 and data.prefetch >= 0")


@dataclass(frozen=True)
class KerasModelConfig:
    builder: str = ""  # "my_model.py:build" (relative to the job file) or "package.module:function"
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the builder ([model.args])
    output: Output = "auto"  # classification: the model ends in logits or probabilities (auto: from its last layer)

    def validate(self) -> None:
        if not self.builder:
            raise JobError("model.builder must name the function that builds the model, e.g. "
                           "\"my_model.py:build\" or \"package.module:build\"")
        if ":" not in self.builder:
            raise JobError(f"model.builder {self.builder!r}: expected 'file.py:function' or 'package.module:function'")

    def resolved(self, base: Path) -> "KerasModelConfig":
        """A builder file named relative to the job file, made absolute (job.toml keeps it so)."""
        path, sep, function = self.builder.rpartition(":")
        if sep and is_file_reference(path) and not Path(path).is_absolute():
            return replace(self, builder=f"{(base / path).resolve()}:{function}")
        return self


def is_file_reference(module_or_path: str) -> bool:
    return module_or_path.endswith(".py") or "/" in module_or_path
