"""`hpcdl resume`: a run continues in its own directory, from its checkpoints and the applier's state."""

import json
import os
import re
import signal
import time
from pathlib import Path

from hpcdl.fs.files import read_jsonl
from tests.conftest import hpcdl, set_args, tiny_overrides
from tests.test_hybrid import applied_exactly_once, wait_for




def steps(run_dir: Path, group: int) -> list[int]:
    return [m["step"] for m in read_jsonl(run_dir / "groups" / str(group) / "metrics.jsonl")]


def test_resume_extends_a_finished_run_and_refuses_what_would_break_it(hep_files, tmp_path):
    runs = tmp_path / "runs"
    out = hpcdl("submit", "hep", "--nodes", "1", "--json", *set_args(tiny_overrides(hep_files, runs, steps=20)),
                cwd=tmp_path)
    run_dir = Path(json.loads(out.stdout)["run_dir"])
    refused = hpcdl("resume", str(run_dir), cwd=tmp_path, check=False)
    assert refused.returncode == 2 and "train.steps = 20" in refused.stderr
    changed = hpcdl("resume", str(run_dir), "--set", "train.steps=30", "--set", "model.filters=4",
                    cwd=tmp_path, check=False)
    assert changed.returncode == 2 and "model.filters" in changed.stderr
    layout = hpcdl("resume", run_dir.name, "--runs-dir", str(runs), "--set", "train.steps=30",
                   "--set", "run.nodes=2", cwd=tmp_path, check=False)
    assert layout.returncode == 2 and "run.nodes" in layout.stderr
    assert steps(run_dir, 0) == [5, 10, 15, 20]  # nothing was started or written by the refusals

    result = json.loads(hpcdl("resume", run_dir.name, "--runs-dir", str(runs), "--set", "train.steps=30",
                              "--json", cwd=tmp_path).stdout)
    assert result["ok"] is True and result["run_dir"] == str(run_dir)
    assert steps(run_dir, 0) == [5, 10, 15, 20, 25, 30]  # from the checkpoint at 20, not from 0
    status = json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert status["state"] == "finished" and status["groups"][0]["step"] == 30
    import tomllib

    assert tomllib.loads((run_dir / "job.toml").read_text())["train"]["steps"] == 30
    assert len(json.loads((run_dir / "run.json").read_text())["resumed"]) == 1


def test_resume_after_a_kill_9_of_the_supervisor_finishes_with_an_exact_ledger(hep_files, tmp_path):
    runs = tmp_path / "runs"
    overrides = tiny_overrides(hep_files, runs, steps=120) + ["exchange.max_staleness=1000"]
    out = hpcdl("submit", "hep", "--nodes", "4", "--group-size", "2", "--detach", "--json",
                *set_args(overrides), cwd=tmp_path)
    run_dir = Path(json.loads(out.stdout)["run_dir"])
    supervisor = json.loads(out.stdout)["supervisor_pid"]

    def step(g):
        try:
            return json.loads((run_dir / "groups" / str(g) / "state.json").read_text()).get("step", 0)
        except (OSError, ValueError):
            return 0

    wait_for(lambda: min(step(0), step(1)) >= 15, what="both groups at step 15")
    active = hpcdl("resume", str(run_dir), cwd=tmp_path, check=False)
    assert active.returncode == 2 and "still active" in active.stderr
    os.kill(supervisor, signal.SIGKILL)  # its ranks and applier get SIGTERM (PDEATHSIG) and stop
    wait_for(lambda: json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)["state"]
             != "running", timeout=120, what="the run to end without its supervisor")
    time.sleep(2)
    result = json.loads(hpcdl("resume", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert result["ok"] is True
    for g in (0, 1):
        assert steps(run_dir, g)[-1] == 120
    status = applied_exactly_once(run_dir)
    assert set(status["last_seq"]) == {"0", "1"} and status["counts"]["applied"] > 0
    shown = json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert shown["state"] == "finished"


def test_a_cancel_and_resume_counts_updates_over_the_runs_life_and_says_where_it_resumed(hep_files, tmp_path):
    runs, total = tmp_path / "runs", 80
    out = json.loads(hpcdl("submit", "hep", "--nodes", "2", "--group-size", "1", "--detach", "--json",
                           *set_args(tiny_overrides(hep_files, runs, steps=total)), cwd=tmp_path).stdout)
    run_dir = Path(out["run_dir"])
    wait_for(lambda: min(len(steps(run_dir, 0)), len(steps(run_dir, 1))) >= 4, what="both groups at step 20")
    hpcdl("cancel", str(run_dir), cwd=tmp_path)
    wait_for(lambda: json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)["state"]
             == "cancelled", timeout=120, what="the cancel")
    assert json.loads(hpcdl("resume", str(run_dir), "--json", cwd=tmp_path).stdout)["ok"] is True
    status = json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
    published = [g["published"] for g in status["groups"]]
    applier = status["applier"]
    assert published == [total, total], "one update a step, over both starts"
    assert sum(published) == applier["applied"] + applier["dropped"] + applier["backlog"]
    log = (run_dir / "groups" / "0" / "rank0.log").read_text()
    assert re.search(r"hpcdl group 0: resumed from checkpoint [1-9]\d*, master version [1-9]\d*\n", log), log
