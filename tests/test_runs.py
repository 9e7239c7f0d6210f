import json
import os
import time

import pytest
from click.testing import CliRunner

from hpcdl.cli import main
from hpcdl.fs.files import append_jsonl, read_jsonl
from hpcdl.jobfile import load_job
from hpcdl.rundir.runs import RunError, RunIdTaken, create_run, find_run, list_runs
from hpcdl.fs.files import atomic_write_json
from tests.conftest import BINARY, TRUNCATED, one_error_line


def test_run_appears_only_when_complete(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"', "run.nodes=4", "run.group_size=2"])
    with create_run(job, "local") as (staged, final):
        assert not final.root.exists()
        assert staged.job_file.is_file()
    assert final.root.is_dir() and final.load_job() == job
    assert final.groups() == [0, 1]
    assert [p.name for p in tmp_path.iterdir()] == [final.run_id]


def test_failed_creation_leaves_nothing(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"'])
    with pytest.raises(RuntimeError):
        with create_run(job, "local"):
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_find_run_newest_and_by_id(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"'])
    with create_run(job, "local") as (_, first):
        pass
    with create_run(job, "local") as (_, second):
        pass
    os.utime(first.root, (1, 1))
    assert find_run(None, tmp_path).root == second.root
    assert find_run(first.run_id, tmp_path).root == first.root
    with pytest.raises(RunError, match="no run"):
        find_run("nope", tmp_path)
    with pytest.raises(RunError, match="no runs"):
        find_run(None, tmp_path / "empty")


def test_newest_run_is_the_newest_created_not_the_newest_touched(tmp_path):
    """Evaluating an old run writes into it; it must not become "the newest run"."""
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"'])
    with create_run(job, "local") as (_, old):
        pass
    with create_run(job, "local") as (_, new):
        pass
    (old.root / "eval").mkdir()
    (old.root / "eval" / "roc.png").write_bytes(b"png")
    future = time.time() + 3600
    for path in (old.root, old.info_file, old.job_file):
        os.utime(path, (future, future))
    os.utime(new.root, (1, 1))
    assert old.created() < new.created()
    assert [r.root for r in list_runs(tmp_path)] == [new.root, old.root]
    assert find_run(None, tmp_path).root == new.root


def test_creation_time_from_the_run_id_when_run_json_lacks_it(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"'])
    with create_run(job, "local", run_id="hep-20260101-000000-abcd") as (_, older):
        pass
    with create_run(job, "local", run_id="hep-20260102-000000-abcd") as (_, newer):
        pass
    for run in (older, newer):
        info = json.loads(run.info_file.read_text())
        del info["created"]
        atomic_write_json(run.info_file, info)
    os.utime(older.info_file, (time.time() + 3600,) * 2)
    assert find_run(None, tmp_path).root == newer.root


@pytest.mark.parametrize("content", [b'{"run_id": "x", "backe', b"\x00\xff\xfe garbage \x80", b"[1, 2]"])
def test_corrupt_run_json_is_one_error_naming_the_file(tmp_path, content):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"'])
    with create_run(job, "local") as (_, run):
        pass
    run.info_file.write_bytes(content)
    with pytest.raises(RunError) as caught:
        run.info()
    message = str(caught.value)
    assert str(run.info_file) in message and "corrupt" in message and "\n" not in message


@pytest.mark.parametrize("content", [b'name = "hep"\nworkload = ', b"\x89PNG\r\n\x1a\n\x00\x00",
                                     b'workload = "hep"\n[train]\nsteps = "many"\n'])
def test_corrupt_job_toml_is_one_error_naming_the_file(tmp_path, content):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"'])
    with create_run(job, "local") as (_, run):
        pass
    run.job_file.write_bytes(content)
    with pytest.raises(RunError) as caught:
        run.load_job()
    assert str(run.job_file) in str(caught.value) and "\n" not in str(caught.value)


def test_jsonl_skips_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    append_jsonl(path, {"step": 1})
    append_jsonl(path, {"step": 2})
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_atomic_json_leaves_no_temporary(tmp_path):
    atomic_write_json(tmp_path / "s.json", {"a": 1})
    atomic_write_json(tmp_path / "s.json", {"a": 2})
    assert json.loads((tmp_path / "s.json").read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


READERS = [("status", "run.json"), ("status", "job.toml"), ("status", "scheduler/local.json"),
           ("cancel", "run.json"), ("cancel", "scheduler/local.json"), ("evaluate", "run.json"),
           ("evaluate", "job.toml"), ("logs", "run.json")]


@pytest.mark.parametrize("command, name", READERS)
@pytest.mark.parametrize("content", [TRUNCATED, BINARY, b""])
def test_a_malformed_run_file_is_one_line_naming_it(local_run, command, name, content):
    (local_run.root / name).write_bytes(content)
    if command == "evaluate":  # it reads the run's files once there is a checkpoint
        local_run.checkpoint_dir(0).mkdir(parents=True)
        (local_run.checkpoint_dir(0) / "manifest.json").write_text(
            json.dumps({"job": {}, "workload": "hep", "input_shape": [8, 8, 3]}))
    result = CliRunner().invoke(main, [command, str(local_run.root)], catch_exceptions=False)
    one_error_line(result, str(local_run.root / name))


def test_create_run_refuses_an_existing_run_id(local_run):
    job = local_run.load_job()
    before = sorted(p.name for p in local_run.root.parent.iterdir())
    with pytest.raises(RunIdTaken):
        with create_run(job, "local", run_id=local_run.run_id):
            pass
    assert sorted(p.name for p in local_run.root.parent.iterdir()) == before  # no staging left behind
    assert json.loads(local_run.info_file.read_text())["run_id"] == local_run.run_id
