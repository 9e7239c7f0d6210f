"""The generic Keras workload: a builder file next to a job file, trained and scored by hpcdl."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from hpcdl.jobfile import load_job
from hpcdl.errors import JobError
from hpcdl.workloads import get_workload
from hpcdl.workloads.keras.data import ArrayFile, iter_batches
from tests.conftest import hpcdl


def built(tmp_path, source: str, input_shape: tuple[int, ...], **options):
    """The keras workload's model from a builder file of `source`."""
    (tmp_path / "builder.py").write_text(source)
    workload = get_workload("keras")
    return workload.build_model(workload.ModelConfig(builder=f"{tmp_path / 'builder.py'}:build"), input_shape,
                                seed=0, **options)


def test_the_builder_file_is_found_beside_the_job_file(keras_job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the job's directory
    job = load_job(str(keras_job))
    assert job.model.builder == f"{keras_job.parent / 'my_model.py'}:build"
    assert job.model.args == {"units": 8}
    assert load_job(str(keras_job), ["model.builder=\"mypkg.models:build\""]).model.builder == "mypkg.models:build"
    # a builder's argument on the command line, as for any other field
    assert load_job(str(keras_job), ["model.args.units=16", 'model.args.name="wide"']).model.args == {
        "units": 16, "name": "wide"}
    with pytest.raises(JobError, match="train.steps is not a table"):
        load_job(str(keras_job), ["train.steps.x=1"])


def test_a_model_of_any_input_shape_builds_with_stable_names_and_counted_flops(tmp_path):
    source = ("import keras\n"
              "def build(input_shape):\n"
              "    i = keras.Input(input_shape)\n"
              "    x = keras.layers.Conv1D(4, 3, activation='relu')(i)\n"
              "    x = keras.layers.BatchNormalization()(x)\n"
              "    return keras.Model(i, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(x)))\n")
    first, second = built(tmp_path, source, (10, 2)), built(tmp_path, source, (10, 2))
    names = [n for n, _ in first.named_variables()]
    assert names == [n for n, _ in second.named_variables()] == [
        "0000_kernel", "0001_bias", "0002_gamma", "0003_beta", "0004_kernel", "0005_bias"]
    flops, source = first.flops_and_source()
    # the convolution's multiply-adds alone: 8 outputs × 3 taps × 2 in × 4 out, twice per FLOP
    assert flops.forward >= 2 * 8 * 3 * 2 * 4 and flops.backward >= flops.forward
    assert "cost analysis" in source
    assert first(np.zeros((2, 10, 2), np.float32)).shape == (2, 1)


def test_a_model_that_counts_itself_is_believed(tmp_path):
    model = built(tmp_path, "import keras\n"
                            "class Counted(keras.Model):\n"
                            "    def flops(self):\n"
                            "        return 3000\n"
                            "def build(input_shape):\n"
                            "    i = keras.Input(input_shape)\n"
                            "    return Counted(i, keras.layers.Dense(2)(i))\n", (4,))
    flops, source = model.flops_and_source()
    assert flops.training == 3000 and source == "the model's own flops()"


def test_the_reader_shards_and_normalises_per_channel(class_files):
    data = get_workload("keras").DataConfig(train=str(class_files["train"]), classes=3, normalize=True)
    arrays = ArrayFile.open(class_files["train"], data)
    assert (arrays.n, arrays.input_shape, arrays.label_shape) == (1024, (6,), ())
    from hpcdl.workloads.keras.data import channel_stats

    stats = channel_stats(arrays, chunk=100)
    seen = []
    for rank in range(2):
        with iter_batches(arrays, 64, stats=stats, classes=3, rank=rank, size=2, shuffle=False, epochs=1,
                          chunk=100, drop_remainder=False) as batches:
            for b in batches:
                seen.append(b)
    index = np.concatenate([b.index for b in seen])
    assert sorted(index.tolist()) == list(range(1024))  # every example once, over both shards
    x = np.concatenate([b.x for b in seen])
    assert np.allclose(x.mean(axis=0), 0.0, atol=1e-4) and np.allclose(x.std(axis=0), 1.0, atol=1e-3)


def test_it_trains_from_the_builder_file_resumes_and_evaluate_scores_it(keras_job, tmp_path):
    runs = tmp_path / "runs"
    proc = hpcdl("submit", str(keras_job), "--json", "--set", "train.steps=10", cwd=tmp_path)
    run_dir = runs / json.loads(proc.stdout)["run_id"]
    # resume imports the builder the job names again: what is at that path now
    builder = keras_job.parent / "my_model.py"
    builder.write_text(builder.read_text() + "\nimport os\nopen(os.environ['IMPORTED_AT'], 'a').write('x')\n")
    env = {**os.environ, "IMPORTED_AT": str(tmp_path / "imported")}
    hpcdl("resume", str(run_dir), "--set", "train.steps=20", cwd=tmp_path, env=env)
    assert (tmp_path / "imported").read_text()
    last = [json.loads(line) for line in (run_dir / "groups/0/metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 20 and last["flops_per_s_group"] > 0
    assert last["val_accuracy"] > 0.6  # three classes: chance is a third
    result = json.loads(hpcdl("evaluate", str(run_dir), "--json", cwd=tmp_path, env=env).stdout)
    assert result["examples"] == 256 and result["accuracy"] > 0.6
    assert np.sum(result["confusion_matrix"]) == 256
    assert (run_dir / "eval" / "confusion.png").stat().st_size > 0
    # the checkpoint is TensorFlow's: an index and data shards beside the manifest, nothing else
    names = {p.name for p in (run_dir / "checkpoints/0").iterdir()}
    assert "manifest.json" in names and any(n.endswith(".index") for n in names)
    assert not any(n.endswith((".keras", ".pb", ".pkl", ".pickle")) for n in names)
    # a test file with a NaN input is refused before anything is scored or written
    with h5py.File(tmp_path / "nan.h5", "w") as f:
        f["x"] = np.where(np.arange(6) == 4, np.nan, 1.0).astype(np.float32)[None].repeat(50, axis=0)
        f["y"] = np.zeros(50, np.int64)
    refused = hpcdl("evaluate", str(run_dir), "--data", str(tmp_path / "nan.h5"), "--out", str(tmp_path / "nan-eval"),
                    cwd=tmp_path, env=env, check=False)
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0
    assert "'x' holds nan at example 0" in refused.stderr and not (tmp_path / "nan-eval").exists()


def test_regression_scores_mse_mae_and_r2(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 3)).astype(np.float32)
    y = np.stack([x @ [1.0, -2.0, 0.5], x[:, 0]], axis=1).astype(np.float32)
    with h5py.File(tmp_path / "r.h5", "w") as f:
        f["inputs"], f["targets"] = x, y
    workload = get_workload("keras")
    model = built(tmp_path, "import keras\n"
                            "def build(input_shape):\n"
                            "    i = keras.Input(input_shape)\n"
                            "    return keras.Model(i, keras.layers.Dense(2, use_bias=False)(i))\n", (3,))
    model.named_variables()[0][1].assign(np.array([[1.0, 1.0], [-2.0, 0.0], [0.5, 0.0]], np.float32))
    stats = {"task": "regression", "classes": 0, "inputs": "inputs", "labels": "targets", "weights": ""}
    (tmp_path / "eval_out").mkdir()  # hpcdl.commands.evaluate makes it
    result = workload.evaluate(model, stats, tmp_path / "r.h5", tmp_path / "eval_out")
    assert result["mse"] < 1e-10 and result["mae"] < 1e-5 and result["r2"] == pytest.approx(1.0)
    assert (tmp_path / "eval_out" / "predicted_vs_true.png").is_file()
    loss = workload.loss(model, (x[:8], y[:8], np.ones(8, np.float32)), training=False)
    assert float(loss) < 1e-10


def test_plan_counts_the_jobs_own_network_and_says_how(keras_job):
    proc = hpcdl("plan", str(keras_job), "--nodes", "4", "--node-flops", "1e11", "--json", cwd=keras_job.parent)
    inputs = json.loads(proc.stdout)["inputs"]
    # 6 -> 8 -> 3 dense: 83 parameters, and at least its multiply-adds forward and backward
    assert inputs["model_bytes"] == 83 * 4 and inputs["flops_per_example"] >= 2 * (6 * 8 + 8 * 3) * 2
    assert "TensorFlow's cost analysis" in inputs["sources"]["flops_per_example"]
    assert inputs["batch_per_node"] == 32


def test_plan_times_this_machines_step_of_the_jobs_own_network(keras_job):
    proc = hpcdl("plan", str(keras_job), "--nodes", "4", "--json", cwd=keras_job.parent)
    inputs = json.loads(proc.stdout)["inputs"]
    assert inputs["node_flops"] > 0
    assert inputs["sources"]["node_flops"].startswith("measured here: best of 2 steps of the keras network at 6")
    job = load_job(str(keras_job))
    workload = get_workload("keras")
    model = workload.build_model(job.model, workload.input_shape(job), seed=0)
    batch = workload.example_batch(job, model, 5, seed=0)  # what it was timed on: the reader's shapes
    assert batch[0].shape == (5, 6) and batch[1].dtype == np.int32
    assert np.isfinite(float(workload.loss(model, batch, training=True)))


def test_mixed_bfloat16_computes_in_bfloat16_with_float32_weights_and_loss(keras_job):
    job = load_job(str(keras_job))
    workload = get_workload("keras")
    model = workload.build_model(job.model, (6,), seed=0, compute_dtype="bfloat16")
    assert model.keras.layers[-1].compute_dtype == "bfloat16"
    assert all(v.dtype == "float32" for _, v in model.named_variables())
    batch = (np.ones((4, 6), np.float32), np.array([0, 1, 2, 0], np.int32), np.ones(4, np.float32))
    loss = workload.loss(model, batch, training=True)
    assert loss.dtype == "float32" and np.isfinite(float(loss))
    # the policy is the model's, not left behind for the next one
    assert workload.build_model(job.model, (6,), seed=0).keras.layers[-1].compute_dtype == "float32"


def test_a_nan_label_stops_the_group_failed_with_its_last_finite_checkpoint(keras_job, tmp_path):
    """With the scan skipped knowingly, the training itself still refuses to apply a NaN step."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1024, 6)).astype(np.float32)
    y = (x[:, :2] * [1.0, -1.0]).astype(np.float32)
    y[rng.choice(1024, 6, replace=False), 0] = np.nan
    with h5py.File(tmp_path / "nan-labels.h5", "w") as f:
        f["x"], f["y"] = x, y
    with h5py.File(tmp_path / "val.h5", "w") as f:
        f["x"], f["y"] = x[:128], np.nan_to_num(y[:128])
    proc = hpcdl("submit", str(keras_job), "--json", "--set", 'data.task="regression"',
                 "--set", f'data.train="{tmp_path / "nan-labels.h5"}"', "--set", f'data.val="{tmp_path / "val.h5"}"',
                 "--set", f'data.test="{tmp_path / "val.h5"}"', "--set", "model.args={units = 8, classes = 2}",
                 "--set", "run.check_finite=false", "--set", "train.steps=200", "--set", "train.checkpoint_every=1",
                 "--set", "train.validate_every=0", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    run_dir = tmp_path / "runs" / json.loads(proc.stdout)["run_id"]
    status = json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert status["state"] == "failed"
    reason = status["groups"][0]["reason"]
    assert "the loss" in reason and "not finite" in reason and "not applied" in reason
    stopped_at = int(reason.split("step ")[1].split(":")[0])
    assert 1 < stopped_at < 200  # the file's order reaches a NaN label within the run, not at once
    result = json.loads(hpcdl("evaluate", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert np.isfinite(result["mse"]) and result["mse"] < 10
    newest = max(int(p.name.split("-")[1].split(".")[0]) for p in (run_dir / "checkpoints/0").glob("ckpt-*.index"))
    assert newest == stopped_at - 1
