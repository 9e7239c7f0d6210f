import json
import os

import pytest

from hpcdl.config import load_job
from hpcdl.runs import RunError, append_jsonl, create_run, find_run, read_jsonl, write_json_atomic


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


def test_jsonl_skips_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    append_jsonl(path, {"step": 1})
    append_jsonl(path, {"step": 2})
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_atomic_json_leaves_no_temporary(tmp_path):
    write_json_atomic(tmp_path / "s.json", {"a": 1})
    write_json_atomic(tmp_path / "s.json", {"a": 2})
    assert json.loads((tmp_path / "s.json").read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]
