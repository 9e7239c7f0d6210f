"""Workload test data: a tiny three-class problem, a builder file next to its job file."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

BUILDER = '''
import keras


def build(input_shape, units=8, classes=3):
    inputs = keras.Input(input_shape)
    x = keras.layers.Dense(units, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(classes)(x))
'''

JOB = '''
workload = "keras"

[data]
train = "{train}"
val = "{val}"
test = "{val}"
task = "classification"
classes = 3
normalize = true
chunk = 256

[model]
builder = "my_model.py:build"

[model.args]
units = 8

[train]
steps = 20
batch_per_rank = 32
log_every = 5
checkpoint_every = 10
validate_every = 10
validate_events = 128
learning_rate = 0.01

[run]
backend = "local"
runs_dir = "{runs}"
'''


def write_classes(path: Path, n: int, seed: int, classes: int = 3, features: int = 6) -> Path:
    """Gaussian blobs: class c lifts feature c, far from the shared offset (normalisation matters)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.normal(size=(n, features)).astype(np.float32) + 50.0
    x[np.arange(n), y] += 4.0
    with h5py.File(path, "w") as f:
        f["x"] = x
        f["y"] = y
    return path


@pytest.fixture(scope="session")
def class_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("keras-data")
    return {"train": write_classes(d / "train.h5", 1024, 1), "val": write_classes(d / "val.h5", 256, 2)}


@pytest.fixture
def keras_job(tmp_path, class_files) -> Path:
    """A job directory: job.toml and the my_model.py it names (relatively)."""
    job_dir = tmp_path / "project"
    job_dir.mkdir()
    (job_dir / "my_model.py").write_text(BUILDER)
    job = job_dir / "job.toml"
    job.write_text(JOB.format(train=class_files["train"], val=class_files["val"], runs=tmp_path / "runs"))
    return job
