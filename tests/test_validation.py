"""Validation while training (train.validate_every): metrics, status, plot, and TensorBoard serving it."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hpcdl.fs.files import read_jsonl
from tests.conftest import HPCDL, set_args, tiny_overrides


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_run_validates_and_tensorboard_serves_training_and_validation_scalars(hep_files, tmp_path):
    runs = tmp_path / "runs"
    out = subprocess.run([HPCDL, "submit", "hep", "--nodes", "1", "--json",
                          *set_args(tiny_overrides(hep_files, runs, steps=20) + ["train.validate_every=10",
                                                                                 "train.validate_events=256"])],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = Path(json.loads(out.stdout)["run_dir"])
    lines = read_jsonl(run_dir / "groups/0/metrics.jsonl")
    assert [m.get("val_step") for m in lines] == [None, 10, 10, 20]
    last = lines[-1]
    assert 0.0 < last["val_loss"] < 5.0 and 0.5 < last["val_auc"] <= 1.0 and "val_tpr_at_selection_fpr" in last
    assert 0.0 <= last["val_auc_unweighted"] <= 1.0
    # A window's step time is the training steps' alone: the validation's own time is apart.
    for before, line in zip(lines, lines[1:]):
        validated = line["val_time_s"] if line.get("val_step") == line["step"] else 0.0
        wall = line["time"] - before["time"]
        assert abs(wall - (line["step"] - before["step"]) * line["step_time_s"] - validated) < 0.25, (before, line)
    assert last["val_time_s"] > 0

    status = json.loads(subprocess.run([HPCDL, "status", str(run_dir), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    assert status["groups"][0]["validation"]["auc"] == last["val_auc"]
    assert status["totals"]["images_per_s"] is not None  # a finished run shows what it last did
    screen = subprocess.run([HPCDL, "status", str(run_dir)], capture_output=True, text=True, check=True).stdout
    assert f"AUC {last['val_auc']:.3f} @20" in screen

    port = free_port()
    tb = subprocess.Popen([str(Path(sys.executable).with_name("tensorboard")), "--logdir", str(run_dir / "tensorboard"),
                           "--host", "127.0.0.1", "--port", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, tags = time.monotonic() + 120, {}
        while time.monotonic() < deadline:
            assert tb.poll() is None, tb.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                    tags = json.loads(r.read())
            except OSError:
                tags = {}
            if tags.get("0") and "validation/auc" in tags["0"]:
                break
            time.sleep(1)
        assert {"loss", "validation/loss", "validation/auc"} <= set(tags.get("0", {})), tags
        query = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=0&tag=validation/auc"
        with urllib.request.urlopen(query, timeout=10) as r:
            points = json.loads(r.read())
        assert [p[1] for p in points] == [10, 20] and abs(points[-1][2] - last["val_auc"]) < 1e-5
    finally:
        tb.terminate()
        tb.wait(timeout=30)
