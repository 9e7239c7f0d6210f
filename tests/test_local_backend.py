"""The local backend end to end, through the real `hpcdl` command: train, status, evaluate."""

import json
import os
import subprocess

import numpy as np

from tests.conftest import HPCDL, set_args, tiny_overrides


def hpcdl(*args, cwd, check=True, timeout=600):
    proc = subprocess.run([HPCDL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_one_group_of_two_ranks_trains_and_evaluates(hep_files, tmp_path):
    runs = tmp_path / "runs"
    out = hpcdl("submit", "hep", "--backend", "local", "--nodes", "2", "--json",
                *set_args(tiny_overrides(hep_files, runs, steps=40)), cwd=tmp_path)
    submitted = json.loads(out.stdout)
    run_dir = runs / submitted["run_id"]
    assert submitted["ok"] is True and run_dir.is_dir()
    assert sorted(p.name for p in (run_dir / "groups" / "0").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    assert list((run_dir / "tensorboard" / "0").glob("events.out.tfevents.*"))
    assert (run_dir / "stats.json").is_file()

    status = json.loads(hpcdl("status", "--runs-dir", str(runs), "--json", cwd=tmp_path).stdout)
    assert status["state"] == "finished"
    (group,) = status["groups"]
    assert group["step"] == 40 and group["state"] == "finished" and group["restarts"] == 0
    assert group["flops_per_s"] > 0 and status["totals"]["sustained_flops_per_s"] > 0

    scores = tmp_path / "scores.csv"
    result = json.loads(hpcdl("evaluate", str(run_dir), "--json", "--scores-out", str(scores), cwd=tmp_path).stdout)
    assert result["n_events"] == 512
    assert result["auc_weighted"] > 0.9  # the toy data are easy; this checks the pipeline learns
    assert (run_dir / "eval" / "roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = np.genfromtxt(scores, delimiter=",", names=True)
    assert len(table) == 512 and set(table.dtype.names) == {"index", "score", "label", "weight"}

    text = hpcdl("status", str(run_dir), cwd=tmp_path).stdout
    assert "finished" in text and "40/40" in text


def test_submit_resumes_nothing_from_another_run(hep_files, tmp_path):
    """Two runs of the same job are independent directories."""
    runs = tmp_path / "runs"
    for _ in range(2):
        hpcdl("submit", "hep", "--json", *set_args(tiny_overrides(hep_files, runs, steps=5)), cwd=tmp_path)
    dirs = sorted(runs.iterdir())
    assert len(dirs) == 2
    for d in dirs:
        assert [json.loads(l)["step"] for l in (d / "groups/0/metrics.jsonl").read_text().splitlines()] == [5]


def test_detached_run_can_be_watched_and_cancelled(hep_files, tmp_path):
    import time

    runs = tmp_path / "runs"
    out = json.loads(hpcdl("submit", "hep", "--detach", "--json", "--nodes", "2",
                           *set_args(tiny_overrides(hep_files, runs, steps=100000)), cwd=tmp_path).stdout)
    run_dir = runs / out["run_id"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        status = json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
        if status["groups"][0]["step"] > 0:
            break
        time.sleep(1)
    assert status["state"] == "running" and status["groups"][0]["step"] > 0
    pids = json.loads((run_dir / "scheduler/local.json").read_text())["groups"]["0"]["pids"]
    assert len(pids) == 2
    assert "SIGTERM" in hpcdl("cancel", str(run_dir), cwd=tmp_path).stdout
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)["state"] == "running":
        time.sleep(1)
    status = json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert status["groups"][0]["state"] == "cancelled" and status["state"] == "cancelled"
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    again = hpcdl("cancel", str(run_dir), cwd=tmp_path).stdout  # repeating is harmless
    assert "nothing running" in again or "SIGTERM" in again
