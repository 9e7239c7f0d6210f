"""The climate workload end to end through the real `hpcdl` command: data from `generate()`,
`hpcdl submit climate` on the local backend with two ranks, `hpcdl evaluate --json`."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from hpcdl.workloads.climate.generate import generate
from hpcdl.workloads.climate.metrics import read_detections
from tests.conftest import hpcdl, set_args




@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("climate-data"), 100, height=32, width=48,
                    labelled_fraction=0.5, seed=1)


def overrides(files, runs, steps):
    return [f'data.train="{files["train"]}"', f'data.val="{files["val"]}"', f'data.test="{files["test"]}"',
            f"train.steps={steps}", "train.batch_per_rank=8", "train.log_every=5", "train.checkpoint_every=20",
            "model.filters=[8, 16]", "model.grid_convs=1", "model.score_threshold=0.001",
            f'run.runs_dir="{runs}"']


def test_submit_train_and_evaluate_two_ranks(files, tmp_path):
    runs = tmp_path / "runs"
    out = hpcdl("submit", "climate", "--backend", "local", "--nodes", "2", "--json",
                *set_args(overrides(files, runs, 40)), cwd=tmp_path)
    run_dir = runs / json.loads(out.stdout)["run_id"]
    assert sorted(p.name for p in (run_dir / "groups" / "0").glob("rank*.log")) == ["rank0.log", "rank1.log"]
    stats = json.loads((run_dir / "stats.json").read_text())
    assert stats["channels"][6] == "TMQ" and len(stats["mean"]) == 16 and stats["images"] == 80

    status = json.loads(hpcdl("status", "--runs-dir", str(runs), "--json", cwd=tmp_path).stdout)
    assert status["state"] == "finished"
    (group,) = status["groups"]
    assert group["step"] == 40 and group["flops_per_s"] > 0

    det = tmp_path / "det.csv"
    result = json.loads(hpcdl("evaluate", str(run_dir), "--json", "--scores-out", str(det), cwd=tmp_path).stdout)
    assert result["n_images"] == 10 and result["n_true_boxes"] > 0
    for key in ("map_50", "map_10", "ap50_TC", "ap10_AR"):
        assert key in result
    assert 0.0 <= result["map_50"] <= result["map_10"] <= 1.0
    assert len(result["pngs"]) == 4
    for png in result["pngs"]:
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    image, rows = read_detections(det)
    assert len(image) == result["n_detections"] > 0 and rows.shape[1] == 6
    assert set(np.unique(image)) <= set(range(10))

    # taken home: the network's grid output from images as preprocessed (crop, downsampling),
    # normalisation inside, the same without hpcdl as the checkpoint's model gives
    hpcdl("export", str(run_dir), str(tmp_path / "climate-model"), cwd=tmp_path)
    from hpcdl.commands.evaluate import load_trained
    from hpcdl.workloads.climate.data import Stats, iter_eval
    from tests.helpers.exported import predict_without_hpcdl

    trained = load_trained(run_dir)
    st = Stats.from_dict(trained.manifest["stats"])
    _, normalised, _ = next(iter_eval(files["test"], st, batch=4))
    expected = trained.model(normalised).numpy()
    predicted = predict_without_hpcdl(tmp_path / "climate-model", st.denormalize(normalised), tmp_path)
    np.testing.assert_allclose(predicted, expected, rtol=1e-4, atol=1e-4)


def test_bad_data_is_a_one_line_usage_error(files, tmp_path):
    bad = tmp_path / "bad.h5"

    with h5py.File(bad, "w") as f:
        f["images"] = np.zeros((4, 3, 8, 8), np.float32)
        f["boxes"] = -np.ones((4, 15, 5), np.int32)
    args = overrides(files, tmp_path / "runs", 5) + [f'data.train="{bad}"']
    proc = hpcdl("submit", "climate", *set_args(args), cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "images has 3 channels" in proc.stderr and "Traceback" not in proc.stderr
