"""The HEP result that `make run` shows, as a test: on generated data the CNN beats the cuts."""

import json
import subprocess

import pytest

from tests.conftest import HPCDL, run_hpcdl

pytestmark = pytest.mark.slow


def test_cnn_beats_the_physics_selection_on_generated_data(tmp_path):
    data = tmp_path / "data"
    subprocess.run([HPCDL, "data", "generate", "hep", "--out", str(data), "--events", "25000",
                    "--image-size", "64", "--seed", "3"], check=True, capture_output=True, timeout=1200)
    submitted = run_hpcdl(
        ["submit", "hep", "--backend", "local", "--nodes", "2", "--group-size", "1", "--json",
         "--set", f'data.train="{data}/train.h5"', "--set", f'data.test="{data}/test.h5"',
         "--set", f'data.val="{data}/val.h5"', "--set", "train.steps=600", "--set", "model.filters=32",
         "--set", f'run.runs_dir="{tmp_path}/runs"'],
        runs_dir=tmp_path / "runs", timeout=2400, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    run_dir = json.loads(submitted.stdout)["run_dir"]
    result = json.loads(subprocess.run([HPCDL, "evaluate", run_dir, "--json"], capture_output=True,
                                       text=True, check=True, timeout=600).stdout)
    assert result["model"].startswith("master weights")  # two groups and the applier, as `make run`
    assert result["n_events"] == 2500
    assert result["auc_weighted"] >= 0.90 and result["auc_unweighted"] >= 0.90
    # the selection is good but imperfect, and the CNN does better at the same background rate
    assert 0.0 < result["selection_fpr"] < 0.05 and 0.2 < result["selection_tpr"] < 0.9
    assert result["cnn_fpr_at_threshold"] <= result["selection_fpr"]
    assert result["cnn_tpr_at_selection_fpr"] > result["selection_tpr"]
