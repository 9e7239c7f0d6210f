"""The local backend end to end, through the real `hpcdl` command: train, status, evaluate."""

import json
import os
import time

import numpy as np

from tests.conftest import hpcdl, set_args, tiny_overrides, wait_for




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
    assert group["step"] == 40 and group["state"] == "finished" and group["crash_restarts"] == 0
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

    # The checkpoint prefix evaluate printed as its model (not itself a file), and a bare run id.
    prefix = result["model"]
    assert prefix.endswith("/checkpoints/0/ckpt-40") and not os.path.exists(prefix)
    again = json.loads(hpcdl("evaluate", prefix, "--json", cwd=tmp_path).stdout)
    assert again["model"] == prefix and again["auc_weighted"] == result["auc_weighted"]
    by_id = json.loads(hpcdl("evaluate", submitted["run_id"], "--runs-dir", str(runs), "--json",
                             cwd=tmp_path).stdout)
    assert by_id["model"] == prefix and by_id["n_events"] == 512
    missing = hpcdl("evaluate", prefix.replace("ckpt-40", "ckpt-41"), cwd=tmp_path, check=False)
    assert missing.returncode == 2 and "ckpt-41" in missing.stderr
    assert len([l for l in missing.stderr.splitlines() if l.startswith("Error:")]) == 1


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
    assert "nothing to cancel" in again


def test_bare_cancel_after_evaluating_an_older_run_stops_the_live_run(hep_files, tmp_path):
    """Evaluating an old run writes eval/ into it (its mtime is then the newest); a bare cancel
    must still stop the run that is live, say which it picked, and leave the old one alone."""
    runs = tmp_path / "runs"
    old = json.loads(hpcdl("submit", "hep", "--json", *set_args(tiny_overrides(hep_files, runs, steps=5)),
                           cwd=tmp_path).stdout)
    live = json.loads(hpcdl("submit", "hep", "--detach", "--json",
                            *set_args(tiny_overrides(hep_files, runs, steps=100000)), cwd=tmp_path).stdout)
    live_dir = runs / live["run_id"]
    wait_for(lambda: (live_dir / "scheduler/local.json").is_file(), 120, "the supervisor's first report")
    hpcdl("evaluate", old["run_id"], "--runs-dir", str(runs), "--json", cwd=tmp_path)
    assert (runs / old["run_id"] / "eval" / "roc.png").is_file()
    # evaluate made the old run the newest by mtime; the live run's own writes (its first
    # checkpoint) may come later, so make sure of it: mtimes must not matter.
    future = time.time() + 3600
    os.utime(runs / old["run_id"], (future, future))

    newest = json.loads(hpcdl("status", "--runs-dir", str(runs), "--json", cwd=tmp_path).stdout)
    assert newest["run_id"] == live["run_id"]
    said = hpcdl("cancel", "--runs-dir", str(runs), cwd=tmp_path).stdout
    assert live["run_id"] in said and "SIGTERM" in said and old["run_id"] not in said
    wait_for(lambda: json.loads(hpcdl("status", str(live_dir), "--json", cwd=tmp_path).stdout)["state"]
             == "cancelled", 90, "the live run to be cancelled")
    assert json.loads(hpcdl("status", old["run_id"], "--runs-dir", str(runs), "--json",
                            cwd=tmp_path).stdout)["state"] == "finished"
    # Nothing is active any more: a bare cancel says so and picks nothing.
    said = hpcdl("cancel", "--runs-dir", str(runs), cwd=tmp_path).stdout
    assert "nothing to cancel" in said and "SIGTERM" not in said
    said = hpcdl("cancel", old["run_id"], "--runs-dir", str(runs), cwd=tmp_path).stdout
    assert said.startswith(old["run_id"]) and "nothing to cancel" in said
