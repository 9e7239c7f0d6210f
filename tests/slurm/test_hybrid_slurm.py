"""Hybrid algorithms on the real local SLURM cluster: a delta run, and the applier killed -9."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.slurm.test_hpcdl_slurm import hpcdl, no_jobs_left, submit, wait_status  # noqa: F401
from tests.test_hybrid import DELTA, applied_exactly_once

pytestmark = pytest.mark.slurm


def applier_pid(run_dir: Path) -> int | None:
    try:
        return json.loads((run_dir / "exchange/applier/status.json").read_text()).get("pid")
    except (OSError, ValueError):
        return None


def test_delta_groups_train_to_the_end_across_a_kill_of_the_applier(slurm_cluster, hep_files, tmp_path):
    sub = submit(hep_files, tmp_path, 150, *DELTA, "exchange.max_pending_per_group=1000",
                 "exchange.max_staleness=1000")
    run_dir = Path(sub["run_dir"])
    wait_status(run_dir, tmp_path, lambda s: min(g["step"] for g in s["groups"]) >= 30, what="step 30")
    victim = applier_pid(run_dir)
    assert victim
    os.kill(victim, signal.SIGKILL)  # the batch script starts it again from its durable state
    deadline = time.monotonic() + 120
    while applier_pid(run_dir) in (None, victim) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert applier_pid(run_dir) not in (None, victim), "the applier was not started again"
    done = wait_status(run_dir, tmp_path, lambda s: s["state"] == "finished" and all(
        g["backend"].get("state") == "completed" for g in s["groups"]), what="the end")
    assert [g["step"] for g in done["groups"]] == [150, 150]
    status = applied_exactly_once(run_dir)
    assert status["counts"]["applied"] + status["counts"]["dropped_stale"] == 60  # 2 groups × 150 / 5
    assert "starting it again" in (run_dir / f"applier-{sub['slurm_applier_job_id']}.out").read_text()
    result = json.loads(hpcdl("evaluate", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert result["model"].startswith("master weights v") and result["auc_weighted"] > 0.9


def shard_applier_pid(run_dir: Path, shard: int) -> int | None:
    try:
        return json.loads((run_dir / f"exchange/shard-{shard}/applier/status.json").read_text()).get("pid")
    except (OSError, ValueError):
        return None


def test_two_shards_in_one_applier_job_across_a_kill_of_one(slurm_cluster, hep_files, tmp_path):
    from tests.exchange.test_shards import applied_exactly_once as shard_exactly_once

    sub = submit(hep_files, tmp_path, 100, "exchange.shards=2", "exchange.max_pending_per_group=1000",
                 "exchange.max_staleness=1000", nodes=2, group_size=1)
    run_dir = Path(sub["run_dir"])
    assert "#SBATCH --ntasks-per-node=2" in (run_dir / "scheduler/applier.sbatch").read_text()
    wait_status(run_dir, tmp_path, lambda s: min(g["step"] for g in s["groups"]) >= 25, what="step 25")
    victim = shard_applier_pid(run_dir, 1)
    untouched = shard_applier_pid(run_dir, 0)
    assert victim and untouched
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while shard_applier_pid(run_dir, 1) in (None, victim) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert shard_applier_pid(run_dir, 1) not in (None, victim), "shard 1's applier was not started again"
    done = wait_status(run_dir, tmp_path, lambda s: s["state"] == "finished" and all(
        g["backend"].get("state") == "completed" for g in s["groups"]), what="the end")
    assert [g["step"] for g in done["groups"]] == [100, 100]
    assert [row["shard"] for row in done["applier"]["shards"]] == [0, 1]
    assert shard_applier_pid(run_dir, 0) == untouched  # the other shard ran on undisturbed
    for k in range(2):
        status = shard_exactly_once(run_dir / f"exchange/shard-{k}")
        assert status["counts"]["applied"] > 0 and set(status["last_seq"]) == {"0", "1"}
    out = (run_dir / f"applier-{sub['slurm_applier_job_id']}.out").read_text()
    assert "shard 1's applier exited with status" in out and "starting it again" in out
    result = json.loads(hpcdl("evaluate", str(run_dir), "--json", cwd=tmp_path).stdout)
    assert result["model"].startswith("master weights v") and result["auc_weighted"] > 0.9
