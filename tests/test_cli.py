"""Bad input: one line naming the problem, exit 2 for usage errors, nothing left behind."""

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from hpcdl.cli import main
from hpcdl.engine.tuning import read_cpuinfo
from tests.conftest import one_error_line, set_args, tiny_overrides


@pytest.fixture
def runner():
    return CliRunner()


def run_cli(runner, args):
    result = runner.invoke(main, args, catch_exceptions=False)
    return result.exit_code, result.output


def assert_usage_error(code, output, fragment):
    assert code == 2, output
    assert fragment in output, output
    error_lines = [l for l in output.splitlines() if l.startswith("Error:")]
    assert len(error_lines) == 1, output
    assert "Usage:" not in output and "Try " not in output, output  # the one line, nothing around it


def submit_args(hep_files, runs, *extra, overrides=()):
    return ["submit", "hep", "--backend", "local",
            *set_args(tiny_overrides(hep_files, runs) + list(overrides)), *extra]


@pytest.mark.parametrize("extra, fragment", [
    (["--nodes", "0"], "--nodes"),
    (["--nodes", "-3"], "--nodes"),
    (["--nodes", "two"], "--nodes"),
    (["--nodes", "3", "--group-size", "2"], "does not divide"),
    (["--set", "train.nosuch=1"], "train.nosuch"),
    (["--set", "train.steps=many"], "train.steps must be an integer"),
    (["--set", "oops"], "section.key=value"),
])
def test_submit_rejects_bad_arguments(runner, hep_files, tmp_path, extra, fragment):
    runs = tmp_path / "runs"
    code, output = run_cli(runner, submit_args(hep_files, runs, *extra))
    assert_usage_error(code, output, fragment)
    assert not runs.exists() or list(runs.iterdir()) == []


@pytest.mark.skipif(read_cpuinfo().bf16, reason="this CPU has a bfloat16 unit: mixed_bfloat16 would run")
def test_submit_refuses_mixed_bfloat16_without_a_bfloat16_unit(runner, hep_files, tmp_path):
    runs = tmp_path / "runs"
    code, output = run_cli(runner, submit_args(hep_files, runs, overrides=["tuning.precision=mixed_bfloat16"]))
    assert_usage_error(code, output, "tuning.precision = mixed_bfloat16 needs native bfloat16 (AVX512_BF16 or AMX)")
    assert not runs.exists() or list(runs.iterdir()) == []


def test_a_group_alone_shows_its_help_and_an_unknown_command_is_one_line(runner):
    code, output = run_cli(runner, ["data"])
    assert "Usage: " in output and "generate" in output and "Error:" not in output
    code, output = run_cli(runner, ["nosuch"])
    assert_usage_error(code, output, "No such command 'nosuch'")


def test_unknown_job(runner):
    code, output = run_cli(runner, ["submit", "nosuchjob"])
    assert_usage_error(code, output, "unknown job 'nosuchjob'")


def test_missing_data_file(runner, hep_files, tmp_path):
    runs = tmp_path / "runs"
    code, output = run_cli(runner, submit_args(hep_files, runs, overrides=[f'data.train="{tmp_path}/none.h5"']))
    assert_usage_error(code, output, "none.h5")
    assert not runs.exists() or list(runs.iterdir()) == []


@pytest.mark.parametrize("writer, fragment", [
    (lambda f: f.create_dataset("images", data=np.zeros((4, 8, 8))), "data.train"),
    (lambda f: [f.create_group("all_events"),
                f["all_events"].create_dataset("hist", data=np.zeros((4, 8, 8))),
                f["all_events"].create_dataset("histEM", data=np.zeros((4, 8, 8))),
                f["all_events"].create_dataset("histtrack", data=np.zeros((4, 9, 8))),
                f["all_events"].create_dataset("y", data=np.zeros(4))], "data.train"),
])
def test_hdf5_with_wrong_layout(runner, hep_files, tmp_path, writer, fragment):
    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as f:
        writer(f)
    runs = tmp_path / "runs"
    code, output = run_cli(runner, submit_args(hep_files, runs, overrides=[f'data.train="{bad}"']))
    assert_usage_error(code, output, fragment)
    assert "bad.h5" in output
    assert not runs.exists() or list(runs.iterdir()) == []


def test_not_hdf5(runner, hep_files, tmp_path):
    bad = tmp_path / "text.h5"
    bad.write_text("not hdf5")
    code, output = run_cli(runner, submit_args(hep_files, tmp_path / "runs", overrides=[f'data.train="{bad}"']))
    assert_usage_error(code, output, "text.h5")


def test_evaluate_path_that_is_not_a_checkpoint(runner, tmp_path):
    (tmp_path / "empty").mkdir()
    code, output = run_cli(runner, ["evaluate", str(tmp_path / "empty")])
    assert_usage_error(code, output, "is not a checkpoint")


def test_evaluate_of_something_that_is_neither_a_path_nor_a_run_id(runner, tmp_path):
    (tmp_path / "runs").mkdir()
    code, output = run_cli(runner, ["evaluate", "hep-nosuch", "--runs-dir", str(tmp_path / "runs")])
    assert_usage_error(code, output, "neither a path nor a run id")


def test_bare_cancel_without_runs(runner, tmp_path):
    code, output = run_cli(runner, ["cancel", "--runs-dir", str(tmp_path / "none")])
    assert_usage_error(code, output, "no runs")


def test_evaluate_bad_scores_suffix(runner, tmp_path):
    code, output = run_cli(runner, ["evaluate", str(tmp_path), "--scores-out", str(tmp_path / "s.txt")])
    assert_usage_error(code, output, ".npz or .csv")


def test_status_without_runs(runner, tmp_path):
    code, output = run_cli(runner, ["status", "--runs-dir", str(tmp_path / "none")])
    assert_usage_error(code, output, "no runs")


def test_dry_run_writes_nothing_and_shows_commands(runner, hep_files, tmp_path):
    runs = tmp_path / "runs"
    code, output = run_cli(runner, submit_args(hep_files, runs, "--nodes", "2", "--dry-run"))
    assert code == 0, output
    assert output.count("hpcdl.process.worker") == 2 and "HOROVOD_RANK=1" in output
    assert not runs.exists()


def test_completion_script(runner):
    code, output = run_cli(runner, ["completion", "bash"])
    assert code == 0 and "_HPCDL_COMPLETE" in output


def test_relative_data_paths_are_kept_absolute_from_where_one_submits(hep_files, tmp_path, monkeypatch):
    """A job's data files are named relative to the directory it is submitted from; the run keeps
    them absolute, so status, evaluate and resume find them from any other directory."""
    from hpcdl.commands.submit import prepare

    monkeypatch.chdir(hep_files["train"].parent)
    overrides = tiny_overrides({"train": Path("train.h5"), "test": Path("sub/../test.h5")}, tmp_path / "runs")
    job = prepare("hep", overrides, cluster={"cores": 2}).job
    assert (job.data.train, job.data.val, job.data.test) == (str(hep_files["train"]), str(hep_files["test"]),
                                                              str(hep_files["test"]))


def test_an_os_error_from_a_workloads_data_check_is_one_line_naming_the_workload(runner, hep_files, tmp_path,
                                                                                 monkeypatch):
    """A plugin's own reader may let h5py's OSError out, which names neither field nor file."""
    from hpcdl.workloads.hep.workload import HepWorkload

    def unreadable(self, job):
        raise OSError("Unable to synchronously open file (file signature not found)")

    monkeypatch.setattr(HepWorkload, "check_data", unreadable)
    code, output = run_cli(runner, submit_args(hep_files, tmp_path / "runs", "--dry-run"))
    assert_usage_error(code, output, "the hep workload's check of the job's data failed: Unable to "
                                     "synchronously open file (file signature not found)")


def test_every_error_the_cli_reports_has_one_base_and_its_exit_code():
    from hpcdl.errors import HpcdlError, JobError
    from hpcdl.commands.evaluate import EvaluateError
    from hpcdl.exchange import CorruptFile
    from hpcdl.process.launch import LaunchError
    from hpcdl.rundir.runs import RunError
    from hpcdl.schedulers.base import SchedulerError
    from hpcdl.workloads.common import DataFileError

    for cls in (JobError, RunError, EvaluateError, LaunchError, CorruptFile, DataFileError):
        assert issubclass(cls, HpcdlError) and cls.exit_code == 2, cls
    assert issubclass(SchedulerError, HpcdlError) and SchedulerError.exit_code == 1


@pytest.mark.parametrize("out", ["/proc/x", "/proc/self/nonexistent/deeper"])
def test_data_generate_into_a_directory_that_cannot_be_made(out):
    result = CliRunner().invoke(main, ["data", "generate", "hep", "--out", out, "--events", "10"],
                                catch_exceptions=False)
    assert out in one_error_line(result, out)


def test_data_generate_into_a_read_only_directory(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    result = CliRunner().invoke(main, ["data", "generate", "hep", "--out", str(ro), "--events", "10"],
                                catch_exceptions=False)
    one_error_line(result, str(ro))
    assert list(ro.iterdir()) == []


def test_data_generate_keeps_a_set_unless_forced(tmp_path):
    out = tmp_path / "hep"
    args = ["data", "generate", "hep", "--out", str(out), "--events", "20", "--image-size", "8"]
    assert CliRunner().invoke(main, args, catch_exceptions=False).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    one_error_line(CliRunner().invoke(main, args + ["--seed", "1"], catch_exceptions=False), "--force")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert CliRunner().invoke(main, args + ["--seed", "1", "--force"], catch_exceptions=False).exit_code == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before


def test_data_generate_on_a_full_disk_is_one_line_and_keeps_the_old_set(tiny_fs):
    fs = tiny_fs("full", 2048)
    out = fs / "hep"
    small = ["data", "generate", "hep", "--out", str(out), "--events", "20", "--image-size", "8"]
    assert CliRunner().invoke(main, small, catch_exceptions=False).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # 400 events of 64² do not fit in 2 MiB: HDF5 fails its writes, and its process crashes
    result = CliRunner().invoke(main, ["data", "generate", "hep", "--out", str(out), "--events", "400",
                                       "--image-size", "64", "--force"], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], result.output
    assert "Traceback" not in result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # whole, and no temporary
