"""What the engine needs from a science workload, and nothing more.

A workload owns its data (readers, normalisation), its model (a `tf.Module` with FLOP counts) and
its metrics (evaluation). The engine only ever calls these methods, so it contains no workload
code, and the schedulers contain neither.
"""

from __future__ import annotations

import importlib

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator

from hpcdl.engine.flops import FlopCount


class Model(ABC):
    """The interface a workload's `tf.Module` model offers the engine."""

    @abstractmethod
    def flops(self) -> FlopCount:
        """FLOPs per training example (forward + backward), from the model's own shapes."""

    @abstractmethod
    def named_variables(self) -> list:
        """[(stable name, tf.Variable)] in a fixed order: the keys of checkpoints and exchange."""


class Workload(ABC):
    """One science case: data + model + loss + metrics."""

    name: str
    DataConfig: type
    ModelConfig: type  # with cost(input_shape) -> (FlopCount per example, parameters), no TensorFlow
    # Compute dtypes build_model accepts (Keras policy compute_dtype; the variables stay float32).
    compute_dtypes: tuple[str, ...] = ("float32",)
    # `hpcdl data generate`: what the generator counts (its CLI option, e.g. --events) and the
    # other CLI options it takes (their option names with underscores).
    generate_count: str
    generate_options: tuple[str, ...] = ()
    generator_module: str  # its `generate(out_dir, count, seed=, progress=, **options)`

    def generate(self, out_dir: Path, count: int, *, seed: int, progress=None, **options) -> dict[str, Path]:
        """Write a synthetic data set (train, val, test) in the workload's published layout."""
        generator = importlib.import_module(self.generator_module)  # numpy and h5py only, when asked
        return generator.generate(out_dir, count, seed=seed, progress=progress, **options)

    @abstractmethod
    def check_data(self, job) -> None:
        """Raise a one-line error if the job's data files are missing or of the wrong layout."""

    @abstractmethod
    def compute_stats(self, job) -> dict[str, Any]:
        """Normalisation constants from the training set, JSON-able; stored with the model."""

    @abstractmethod
    def input_shape(self, job) -> tuple[int, ...]:
        """Shape of one example as the model sees it (H, W, C)."""

    @abstractmethod
    def build_model(self, model_config, input_shape: tuple[int, ...], seed: int, compute_dtype: str = "float32"):
        """A fresh model (see `Model`) computing in `compute_dtype` (one of `compute_dtypes`)."""

    def network_cost(self, job) -> tuple[float, int]:
        """(training FLOPs per example, parameters) of the job's network at its data's input shape,
        for the planner and submit: counted, not built (no TensorFlow). Unreadable data:
        DataFileError/OSError."""
        flops, params = job.model.cost(self.input_shape(job))
        return float(flops.training), params

    @abstractmethod
    def train_batches(self, job, stats: dict[str, Any], shard: int, shards: int, seed: int) -> Iterator[tuple]:
        """Endless training batches of one shard, as tuples of numpy arrays for `loss`: a generator,
        which the engine closes when it stops (a reader thread must be gone before the rank is)."""

    @abstractmethod
    def loss(self, model, batch: tuple, training: bool):
        """Scalar loss of a batch (a TensorFlow tensor; traced inside tf.function)."""

    @abstractmethod
    def validate(self, model, stats: dict[str, Any], data: Path, limit: int) -> dict[str, float]:
        """The workload's figures of merit on the first `limit` examples of `data` (a fixed
        subset), while training: small, quick, names without a prefix ("loss", "auc", ...)."""

    def examples(self, data: Path) -> int | None:
        """How many examples `evaluate` scores in `data` (its progress bar's total); None: unknown."""
        return None

    @abstractmethod
    def evaluate(self, model, stats: dict[str, Any], data: Path, out_dir: Path,
                 scores_out: Path | None = None, progress=None) -> dict[str, Any]:
        """Score `data`, write plots into out_dir, and return the metrics as a JSON-able dict."""
