"""What the engine needs from a science workload, and nothing more: hpcdl's extension point.

A workload owns its data (readers, normalisation), its model (a `tf.Module` -- a Keras model
wrapped as :class:`hpcdl.workloads.keras.model.KerasModel` is one -- with FLOP counts) and its
metrics (evaluation). The engine only ever calls these methods, so it contains no workload
code, and the schedulers contain neither.

A workload of one's own is a subclass with a module-level instance, found by hpcdl through the
``hpcdl.workloads`` entry-point group (``[project.entry-points."hpcdl.workloads"] myname =
"my_package.workload:WORKLOAD"``, then ``workload = "myname"`` in a job file) or by a
``workload = "my_package.workload:WORKLOAD"`` reference; `hpcdl workloads` lists what is
installed. When each method is called, and where:

* at job load (every process): `DataConfig` and `ModelConfig` are built from `[data]` and
  `[model]` and their `validate()` called; a `resolved(job_dir)` method, if a section has one,
  makes paths relative to the job file absolute;
* at submit and resume (the login node): `check_job` (which calls `check_data`), the NaN/Inf
  scan of the datasets `finite_datasets` names in data.train and data.val
  (:mod:`hpcdl.workloads.finite`), then `network_cost` for `exchange.shards = "auto"`;
* in each training rank: `compute_stats` (once per group, its root), `input_shape`,
  `build_model`, `train_batches`, `loss` (traced inside the step), and on the group's root
  `validate` every `train.validate_every` steps;
* in `hpcdl plan` (the login node): `network_cost`, and, to time this machine's step, `input_shape`,
  `build_model` and `example_batch`;
* in `hpcdl export`: `build_model` from the checkpoint's manifest, then `serving`;
* in `hpcdl evaluate`: the NaN/Inf scan of the file scored, `build_model` from the checkpoint's
  manifest (job, stats, input shape), then `evaluate`.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from hpcdl.engine.flops import FlopCount


class Model(ABC):
    """The interface a workload's `tf.Module` model offers the engine. A `keras.Model` becomes one
    wrapped in :class:`hpcdl.workloads.keras.model.KerasModel` (stable variable names, FLOPs by
    TensorFlow's cost analysis unless it counts its own)."""

    @abstractmethod
    def flops(self) -> FlopCount:
        """FLOPs per training example (forward + backward), from the model's own shapes."""

    @abstractmethod
    def named_variables(self) -> list:
        """[(stable name, tf.Variable)] in a fixed order: the keys of checkpoints and exchange."""


@dataclass(frozen=True)
class GeneratorOption:
    """One option of a workload's synthetic-data generator, as `hpcdl data generate <workload>`
    offers it: ``--image-size`` for ``name = "image_size"``, a number of `kind` within
    [`low`, `high`] (either bound may be None), required when it has no default. The generator's
    `generate()` receives it as the keyword argument `name`."""

    name: str
    help: str
    default: int | float | None = None
    low: int | float | None = None
    high: int | float | None = None
    kind: type = int


class Workload(ABC):
    """One science case: data + model + loss + metrics."""

    name: str
    DataConfig: type
    ModelConfig: type  # with cost(input_shape) -> (FlopCount per example, parameters), no TensorFlow
    # The input shape `hpcdl plan` counts and times the network at when the job's data is not
    # readable where it plans (None: planning needs the data).
    default_input_shape: tuple[int, ...] | None = None
    # Compute dtypes build_model accepts (Keras policy compute_dtype; the variables stay float32).
    compute_dtypes: tuple[str, ...] = ("float32",)
    # `hpcdl data generate <name>`: the module of the workload's synthetic-data generator ("":
    # none), with its `generate(out_dir, count, seed=, progress=, **options)`; what it counts
    # (required, passed as `count`) and its other options.
    generator_module: str = ""
    generate_count: GeneratorOption | None = None
    generate_options: tuple[GeneratorOption, ...] = ()

    def generate(self, out_dir: Path, count: int, *, seed: int, progress=None, **options) -> dict[str, Path]:
        """Write a synthetic data set (train, val, test) in the workload's published layout.

        `progress(n)`, if given, hears each time n more examples are written. The generator
        writes into a new directory inside `out_dir`; the files it returns are moved into
        `out_dir` together when it returns, so a generator that fails leaves the older set whole
        and nothing of its own behind."""
        from hpcdl.fs.files import fsync_dir

        generator = importlib.import_module(self.generator_module)  # numpy and h5py only, when asked
        out_dir = Path(out_dir)
        made = not out_dir.exists()
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".generating-", dir=out_dir))
        except OSError as exc:  # /proc/x, a read-only or foreign directory: one line, nothing written
            raise ValueError(f"cannot write into {out_dir}: {exc.strerror or exc}") from None
        try:
            files = {name: Path(path) for name, path in
                     generator.generate(staging, count, seed=seed, progress=progress, **options).items()}
            outside = [str(path) for path in files.values() if path.parent != staging]
            if outside:
                raise ValueError(f"the {self.name} generator wrote {outside[0]} outside the directory it was given")
            for path in files.values():
                os.replace(path, out_dir / path.name)
            fsync_dir(out_dir)
            return {name: out_dir / path.name for name, path in files.items()}
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            if made and not any(out_dir.iterdir()):
                out_dir.rmdir()

    @abstractmethod
    def check_data(self, job) -> None:
        """Raise a one-line error (JobError or a DataFileError) if the job's data files are missing
        or of the wrong layout."""

    def check_job(self, job, data: bool) -> None:
        """Everything submit can check before anything is written (`data`: the data files are
        readable here, run.check_data); a one-line JobError for what is wrong."""
        if data:
            self.check_data(job)

    def finite_datasets(self, data_config) -> Sequence[str] | None:
        """The datasets of a split file (HDF5 names) that must hold only finite numbers, scanned
        before a run and before `evaluate`; None (the default): every floating-point dataset in
        the file."""
        return None

    @abstractmethod
    def compute_stats(self, job) -> dict[str, Any]:
        """Normalisation constants from the training set (and whatever else scoring needs),
        JSON-able; stored with every checkpoint and given back to `train_batches`, `validate`
        and `evaluate`."""

    @abstractmethod
    def input_shape(self, job) -> tuple[int, ...]:
        """Shape of one example as the model sees it (e.g. (H, W, C)); stored in the manifest."""

    @abstractmethod
    def build_model(self, model_config, input_shape: tuple[int, ...], seed: int, compute_dtype: str = "float32"):
        """A fresh model (see `Model`: a `tf.Module` with `flops()` and `named_variables()`)
        computing in `compute_dtype` (one of `compute_dtypes`); the same `model_config` and
        `input_shape` must give the same variable names every time."""

    def example_batch(self, job, model, size: int, seed: int) -> tuple | None:
        """`size` made-up examples for `model`, shaped as `train_batches` yields them, whose loss
        is finite: what `hpcdl plan` times a training step on where the data is not read (their
        values do not change the step's work). None (the default): this workload cannot make
        one, and the planner asks for the node's rate instead."""
        return None

    def narrower_model(self, model_config) -> tuple[Any, str] | None:
        """A copy of `model_config` at about half its cost or less (e.g. half the filters) and
        the job override that makes it (`model.filters=64`); None (the default) where the workload
        has none or the model is at its narrowest. `hpcdl plan --target` races such a copy when
        the job's own race would not fit --race-budget here."""
        return None

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

    def group_loss(self, model, batch: tuple, ranks: int, training: bool):
        """The mean of `ranks` ranks' own losses, over a batch that holds their equal batches side by
        side: the loss whose gradient is a synchronous group's (Horovod averages the ranks'
        gradients). This default calls `loss` once per rank, right for any model; a workload whose
        model treats every example on its own (no batch statistics) may do it in one call."""
        import tensorflow as tf

        if ranks == 1:
            return self.loss(model, batch, training)
        pieces = [tf.split(t, ranks) for t in tf.nest.flatten(batch)]
        per_rank = [tf.nest.pack_sequence_as(batch, [p[r] for p in pieces]) for r in range(ranks)]
        return tf.add_n([self.loss(model, b, training) for b in per_rank]) / ranks

    @abstractmethod
    def validate(self, model, stats: dict[str, Any], data: Path, limit: int) -> dict[str, float]:
        """The workload's figures of merit on the first `limit` examples of `data` (a fixed
        subset), while training: small, quick, names without a prefix ("loss", "auc", ...)."""

    def examples(self, data: Path, stats: dict[str, Any] | None = None) -> int | None:
        """How many examples `evaluate` scores in `data` (its progress bar's total; `stats` are the
        checkpoint's); None: unknown."""
        return None

    def serving(self, model, stats: dict[str, Any]):
        """For `hpcdl export`: a function of TensorFlow ops from a float32 batch of examples as the
        workload's reader yields them before normalisation (the manifest's input shape) to the
        predictions `evaluate` scores, so the exported model needs nothing of hpcdl. None: this
        workload cannot be exported."""
        return None

    @abstractmethod
    def evaluate(self, model, stats: dict[str, Any], data: Path, out_dir: Path,
                 scores_out: Path | None = None, progress=None) -> dict[str, Any]:
        """Score `data`, write plots into out_dir, and return the metrics as a JSON-able dict;
        `progress(n)`, if given, hears each time n more examples are scored."""
