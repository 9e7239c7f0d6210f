"""`hpcdl evaluate` on a checkpoint that is damaged, edited or another model's: one line, exit 2,
nothing written; an intact one still evaluates."""

from __future__ import annotations

import json
import shutil

import pytest
import tensorflow as tf
from click.testing import CliRunner

from hpcdl.cli import main
from hpcdl.rundir.group_files import GroupRecorder
from hpcdl.jobfile import load_job
from hpcdl.fs.storage import StorageReport
from hpcdl.workloads import get_workload
from tests.conftest import BINARY, TRUNCATED, one_error_line, tiny_overrides, write_nersc


@pytest.fixture(scope="module")
def checkpoint(hep_files, tmp_path_factory):
    """A real checkpoint of the tiny HEP model: TensorFlow's files and the manifest."""
    directory = tmp_path_factory.mktemp("ckpt")
    job = load_job("hep", tiny_overrides(hep_files, directory / "runs"))
    workload = get_workload("hep")
    shape = workload.input_shape(job)
    model = workload.build_model(job.model, shape, seed=0)
    tf.train.CheckpointManager(tf.train.Checkpoint(model=model), str(directory), max_to_keep=1).save(4)
    recorder = GroupRecorder(job, workload.compute_stats(job), StorageReport(directory.parent / "storage.json"),
                             checkpoints=directory, metrics=directory.parent / "metrics.jsonl",
                             state=directory.parent / "state.json", tensorboard=directory.parent / "tb")
    recorder.manifest(shape, [name for name, _ in model.named_variables()])
    return directory


def evaluate(target, data, out):
    return CliRunner().invoke(main, ["evaluate", str(target), "--data", str(data), "--out", str(out)],
                              catch_exceptions=False)


def assert_refused(result, fragment, out):
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert "Traceback" not in result.output and "WARNING" not in result.output
    assert not out.exists()  # refused before anything is written


def data_file(ckpt):
    return next(ckpt.glob("*.data-*"))


def truncate(ckpt):
    path = data_file(ckpt)
    path.write_bytes(path.read_bytes()[:300])


def garble(ckpt):
    path = data_file(ckpt)
    path.write_bytes(bytes(b ^ 0x5A for b in path.read_bytes()))


def empty_index(ckpt):
    (ckpt / "ckpt-4.index").write_bytes(b"\0" * 64)


def remove_data(ckpt):
    data_file(ckpt).unlink()


def edit_manifest(**change):
    def edit(ckpt):
        manifest = json.loads((ckpt / "manifest.json").read_text())
        for key, value in change.items():
            if key == "filters":
                manifest["job"]["model"]["filters"] = value
            else:
                manifest[key] = value
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return edit


@pytest.mark.parametrize("damage, fragment", [
    (truncate, "the checkpoint is damaged or not this manifest's model"),
    (garble, "the checkpoint is damaged or not this manifest's model"),
    (empty_index, "the checkpoint is damaged or not this manifest's model"),
    (remove_data, "the checkpoint is damaged or not this manifest's model"),
    (edit_manifest(filters=16), "the checkpoint is damaged or not this manifest's model"),
    (edit_manifest(workload="climate"), "workload 'climate' but a hep job"),
    (edit_manifest(job="x"), "not an hpcdl checkpoint manifest"),
    (edit_manifest(input_shape=[0, 8, 3]), "not an hpcdl checkpoint manifest"),
])
def test_a_damaged_checkpoint_is_one_line(checkpoint, hep_files, tmp_path, damage, fragment):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    damage(ckpt)
    assert_refused(evaluate(ckpt, hep_files["test"], tmp_path / "out"), fragment, tmp_path / "out")


def test_the_intact_checkpoint_evaluates(checkpoint, hep_files, tmp_path):
    result = evaluate(checkpoint, hep_files["test"], tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "roc.png").is_file()
    assert "512/512" in result.output  # the progress bar knows its total: every test event


def test_evaluate_refuses_data_of_another_shape_without_leaving_its_directory(checkpoint, tmp_path):
    other = write_nersc(tmp_path / "other.h5", 64, size=12, seed=3)
    result = evaluate(checkpoint, other, tmp_path / "out")
    assert_refused(result, "the model was trained on", tmp_path / "out")


def test_a_runs_evaluation_takes_the_runs_access_mode_and_leaves_others_alone(checkpoint, hep_files, tmp_path):
    import os

    from hpcdl.rundir.runs import create_run

    job = load_job("hep", tiny_overrides(hep_files, tmp_path / "runs"))
    with create_run(job, "local") as (_, run):
        pass
    shutil.copytree(checkpoint, run.checkpoint_dir(0))
    old_umask = os.umask(0o022)
    try:
        result = CliRunner().invoke(main, ["evaluate", str(run.root), "--data", str(hep_files["test"])],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert os.stat(run.eval_dir).st_mode & 0o777 == 0o700
        assert {os.stat(p).st_mode & 0o777 for p in run.eval_dir.iterdir()} == {0o600}
        mine = tmp_path / "mine"
        mine.mkdir(mode=0o755)
        os.chmod(mine, 0o755)
        result = evaluate(run.root, hep_files["test"], mine)
        assert result.exit_code == 0, result.output
        assert os.stat(mine).st_mode & 0o777 == 0o755  # a directory of the user's, not the run's
    finally:
        os.umask(old_umask)


@pytest.mark.parametrize("content", [TRUNCATED, BINARY])
def test_a_malformed_checkpoint_manifest_is_one_line(tmp_path, content):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_bytes(content)
    (ckpt / "ckpt-10.index").write_bytes(b"")
    for target in (ckpt, ckpt / "ckpt-10"):
        result = CliRunner().invoke(main, ["evaluate", str(target)], catch_exceptions=False)
        one_error_line(result, str(ckpt / "manifest.json"))
