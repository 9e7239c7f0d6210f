"""The worked example end to end, as its tutorial runs it: two hybrid groups and the applier on
this machine (two appliers sharing the model's variables), then `hpcdl evaluate` scores the
master weights."""

from __future__ import annotations

import json
import math
import subprocess

from tests.conftest import HPCDL, set_args

# Two appliers: the byte-balanced partition over the user's model's variables, as for HEP's.
SHORT = ["train.steps=60", "train.validate_every=30", "train.checkpoint_every=30", "train.log_every=10",
         "exchange.shards=2"]


def test_the_example_trains_as_two_hybrid_groups_and_evaluate_scores_it(peaks_data, tmp_path):
    job = peaks_data.parent / "job.toml"
    runs = tmp_path / "runs"
    proc = subprocess.run([HPCDL, "submit", str(job), "--backend", "local", "--json",
                           *set_args([*SHORT, f'run.runs_dir="{runs}"'])],
                          capture_output=True, text=True, timeout=400, cwd=peaks_data.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = runs / json.loads(proc.stdout)["run_id"]
    for group in (0, 1):
        state = json.loads((run_dir / f"groups/{group}/state.json").read_text())
        assert state["state"] == "finished" and state["step"] == 60
    # it learns: R² on the validation subset, far better than predicting the mean (0)
    assert json.loads((run_dir / "groups/0/state.json").read_text())["val_r2"] > 0.3
    for shard in (0, 1):
        applier = json.loads((run_dir / f"exchange/shard-{shard}/applier/status.json").read_text())
        assert applier["counts"]["applied"] > 0
    out = subprocess.run([HPCDL, "evaluate", str(run_dir), "--json"], capture_output=True, text=True,
                         timeout=300, cwd=peaks_data.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["model"].startswith("master weights v")
    assert result["examples"] == 150
    assert all(math.isfinite(result[k]) for k in ("mse", "mae", "r2")) and result["mse"] == result["loss"]
    assert (run_dir / "eval" / "predicted_vs_true.png").stat().st_size > 0
