"""The worked example (examples/peaks) on the real local SLURM cluster: its two groups as an array
and the applier beside them, then `hpcdl evaluate` scores the master weights."""

import json
import math
from pathlib import Path

import pytest

from tests.conftest import hpcdl, set_args
from tests.examples.conftest import peaks_data, peaks_installed  # noqa: F401
from tests.slurm.test_hpcdl_slurm import LOCAL_CLUSTER, no_jobs_left, wait_status  # noqa: F401

pytestmark = pytest.mark.slurm


def test_the_example_trains_as_a_slurm_array_and_evaluate_scores_it(slurm_cluster, peaks_data, tmp_path):
    job = peaks_data.parent / "job.toml"
    overrides = [*LOCAL_CLUSTER, "train.steps=30", "train.validate_every=30", "train.checkpoint_every=30",
                 f'run.runs_dir="{tmp_path / "runs"}"']
    sub = json.loads(hpcdl("submit", str(job), "--json", *set_args(overrides), cwd=peaks_data.parent).stdout)
    assert sub["slurm_array_job_id"] and sub["slurm_applier_job_id"]
    run_dir = Path(sub["run_dir"])
    if not run_dir.is_absolute():
        run_dir = peaks_data.parent / run_dir
    done = wait_status(run_dir, peaks_data.parent, lambda s: s["state"] == "finished" and all(
        g["backend"].get("state") == "completed" for g in s["groups"]), what="the end")
    assert [g["step"] for g in done["groups"]] == [30, 30] and done["applier"]["applied"] > 0
    result = json.loads(hpcdl("evaluate", str(run_dir), "--json", cwd=peaks_data.parent).stdout)
    assert result["model"].startswith("master weights") and math.isfinite(result["r2"])
    assert (run_dir / "eval" / "predicted_vs_true.png").is_file()
