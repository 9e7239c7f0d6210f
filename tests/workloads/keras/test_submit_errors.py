"""A user's mistakes with their own model and data: each one line at submit, before anything runs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdl.errors import JobError
from hpcdl.commands.submit import prepare
from tests.conftest import HPCDL

NOT_A_MODEL = "def build(input_shape):\n    return {'layers': 3}\n"
WRONG_INPUT = ("import keras\n"
               "def build():\n"
               "    i = keras.Input((5,))\n"
               "    return keras.Model(i, keras.layers.Dense(3)(i))\n")
WRONG_OUTPUT = ("import keras\n"
                "def build(input_shape):\n"
                "    i = keras.Input(input_shape)\n"
                "    return keras.Model(i, keras.layers.Dense(2)(i))\n")
RAISES = "def build(input_shape):\n    raise RuntimeError('units must be even')\n"


def refusal(job: Path, *overrides: str) -> str:
    with pytest.raises(JobError) as caught:
        prepare(str(job), list(overrides))
    message = str(caught.value)
    assert "\n" not in message
    return message


def with_builder(job: Path, source: str) -> Path:
    (job.parent / "my_model.py").write_text(source)
    return job


def test_the_job_as_written_passes(keras_job):
    assert prepare(str(keras_job), []).job.workload == "keras"


def test_a_builder_file_that_does_not_exist(keras_job):
    assert "no such file" in refusal(keras_job, 'model.builder="nothere.py:build"')


def test_a_builder_that_does_not_import_says_the_import_errors_last_line(keras_job):
    with_builder(keras_job, "import numpy\nimport no_such_module_anywhere\n")
    message = refusal(keras_job)
    assert message.endswith("ModuleNotFoundError: No module named 'no_such_module_anywhere'")
    assert "cannot import" in message and "my_model.py" in message


def test_a_builder_module_that_does_not_import(keras_job):
    message = refusal(keras_job, 'model.builder="no_such_package.models:build"')
    assert "cannot import no_such_package.models" in message


def test_a_builder_file_without_the_function(keras_job):
    assert "has no make" in refusal(keras_job, 'model.builder="my_model.py:make"')


def test_a_builder_that_raises(keras_job):
    with_builder(keras_job, RAISES)
    assert refusal(keras_job, "model.args={}").endswith("failed: RuntimeError: units must be even")


def test_a_builder_that_does_not_return_a_model(keras_job):
    with_builder(keras_job, NOT_A_MODEL)
    assert "returned a dict, not a keras.Model" in refusal(keras_job, "model.args={}")


def test_a_model_whose_input_does_not_take_the_examples(keras_job):
    with_builder(keras_job, WRONG_INPUT)
    assert "the model's input is (5,), but data.inputs examples are (6,)" in refusal(keras_job, "model.args={}")


def test_a_model_whose_output_does_not_fit_the_classes(keras_job):
    with_builder(keras_job, WRONG_OUTPUT)
    message = refusal(keras_job, "model.args={}")
    assert "outputs (2,) per example" in message and "data.classes = 3 needs (3,)" in message


def test_a_model_whose_output_does_not_fit_the_regression_targets(keras_job):
    with_builder(keras_job, WRONG_OUTPUT)
    message = refusal(keras_job, "model.args={}", 'data.task="regression"')
    assert "outputs (2,) per example; data.labels holds 1 target value(s)" in message


def test_a_dataset_missing_from_the_file(keras_job):
    message = refusal(keras_job, 'data.labels="truth"')
    assert "missing dataset 'truth' (found: x, y) (data.labels)" in message and message.startswith("data.train: ")


def test_labels_out_of_range(keras_job):
    message = refusal(keras_job, "data.classes=2")
    assert "is not a class 0 .. 1 (data.classes = 2)" in message


def test_labels_of_the_validation_file_out_of_range(keras_job, tmp_path):
    val = tmp_path / "bad_val.h5"
    with h5py.File(val, "w") as f:
        f["x"] = np.zeros((40, 6), np.float32)
        f["y"] = np.full(40, 7)
    message = refusal(keras_job, f'data.val="{val}"')
    assert message.startswith("data.val: ") and "label 7 of example 0" in message


def test_the_cli_says_it_in_one_line_and_exits_2(keras_job):
    with_builder(keras_job, NOT_A_MODEL)
    proc = subprocess.run([HPCDL, "submit", str(keras_job), "--dry-run", "--set", "model.args={}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "returned a dict, not a keras.Model" in lines[0], proc.stderr
