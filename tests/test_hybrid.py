"""Hybrid training on the local backend: real Horovod groups, a real applier, real kill -9."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from hpcdl.exchange import Channel
from hpcdl.exchange.group import ExchangeSync
from hpcdl.fs.files import read_jsonl
from tests.conftest import HPCDL, set_args, tiny_overrides, wait_for


def start_run(hep_files, tmp_path, steps, *extra):
    runs = tmp_path / "runs"
    overrides = tiny_overrides(hep_files, runs, steps=steps) + [
        "exchange.max_pending_per_group=1000", "exchange.max_staleness=1000", *extra]
    proc = subprocess.Popen([HPCDL, "submit", "hep", "--nodes", "4", "--group-size", "2", "--json",
                             *set_args(overrides)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = [p for p in runs.glob("*") if not p.name.startswith(".")] if runs.exists() else []
        if found:
            return proc, found[0]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the run directory did not appear")


def state(run_dir: Path, group: int) -> dict:
    try:
        return json.loads((run_dir / "groups" / str(group) / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def local_view(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "scheduler" / "local.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    return json.loads(out)


def applied_exactly_once(run_dir: Path) -> dict:
    """Every update each group published was applied (or dropped) once and only once."""
    exchange = run_dir / "exchange" / "applier"
    events = [e for e in read_jsonl(exchange / "events.jsonl") if e["event"] in ("applied", "dropped")]
    pairs = [(e["group"], e["seq"]) for e in events]
    assert len(pairs) == len(set(pairs)), "an update was applied twice"
    status = json.loads((exchange / "status.json").read_text())
    for group, last in status["last_seq"].items():
        assert {s for g, s in pairs if g == int(group)} == set(range(last + 1)), f"group {group} lost updates"
    assert status["backlog"] == 0
    return status


def test_two_groups_of_two_train_through_the_applier(hep_files, tmp_path):
    proc, run_dir = start_run(hep_files, tmp_path, 40, "train.validate_every=20", "train.validate_events=128")
    finish(proc)
    # group 0's root scores the master weights it adopted; group 1 does not score them again
    validated = [m for m in read_jsonl(run_dir / "groups/0/metrics.jsonl") if "val_auc" in m]
    assert validated and validated[-1]["val_step"] == 40
    assert any(m.get("val_master_version", 0) > 0 for m in validated)  # scored after an adoption
    assert not [m for m in read_jsonl(run_dir / "groups/1/metrics.jsonl") if "val_auc" in m]
    status = applied_exactly_once(run_dir)
    assert set(status["last_seq"]) == {"0", "1"}  # both groups' updates reached the master
    assert status["counts"]["applied"] >= 70 and status["master_version"] >= 70

    shown = json.loads(subprocess.run([HPCDL, "status", str(run_dir), "--json"], capture_output=True,
                                      text=True, check=True).stdout)
    assert shown["state"] == "finished" and shown["applier"]["applied"] == status["counts"]["applied"]
    for g in shown["groups"]:
        assert g["step"] == 40 and g["published"] == 40 and g["staleness_max"] is not None
    png = tmp_path / "curves.png"
    subprocess.run([HPCDL, "status", str(run_dir), "--plot", str(png)], capture_output=True, check=True)
    assert png.read_bytes().startswith(b"\x89PNG")
    result = json.loads(subprocess.run([HPCDL, "evaluate", str(run_dir), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    assert result["model"].startswith("master weights v")
    assert result["auc_weighted"] > 0.9

    # taken home: the master weights as a SavedModel, normalisation inside, predicting without
    # hpcdl the scores evaluate gave each event
    from hpcdl.workloads.hep.data import iter_batches
    from tests.helpers.exported import predict_without_hpcdl

    scored = tmp_path / "scores.npz"
    subprocess.run([HPCDL, "evaluate", str(run_dir), "--scores-out", str(scored)], capture_output=True, check=True)
    subprocess.run([HPCDL, "export", str(run_dir), str(tmp_path / "hep-model")], capture_output=True, check=True)
    with iter_batches(hep_files["test"], 10_000, shuffle=False, epochs=1, drop_remainder=False) as batches:
        images = np.concatenate([b[0] for b in batches])  # as stored, channels last, not normalised
    scores = np.load(scored)
    predicted = predict_without_hpcdl(tmp_path / "hep-model", images[scores["index"]], tmp_path)
    np.testing.assert_allclose(predicted, scores["score"], rtol=1e-4, atol=1e-5)


def test_kill_a_rank_of_group_one(hep_files, tmp_path):
    proc, run_dir = start_run(hep_files, tmp_path, steps=200)
    wait_for(lambda: state(run_dir, 1).get("step", 0) >= 30, what="group 1 at step 30")
    victim = local_view(run_dir)["groups"]["1"]["pids"][1]
    os.kill(victim, signal.SIGKILL)
    step0_at_kill = state(run_dir, 0).get("step", 0)
    killed_at = state(run_dir, 1)["step"]

    wait_for(lambda: local_view(run_dir)["groups"]["1"]["restarts"] == 1, what="group 1 restarted")
    # Group 1 is back once it reports again; meanwhile group 0 went on training.
    lines = wait_for(lambda: [m for m in read_jsonl(run_dir / "groups/1/metrics.jsonl")
                              if m["time"] > time.time() - 60 and m.get("exchange_published_here", 0) <= 5
                              and m["step"] > 5], what="group 1 reporting after its restart")
    assert state(run_dir, 0)["step"] > step0_at_kill
    resumed = lines[0]
    assert resumed["step"] <= killed_at + 10 and resumed["step"] >= 10  # from its checkpoint, not step 0
    assert resumed["exchange_version"] > 0  # and from the master weights
    finish(proc)
    assert local_view(run_dir)["groups"]["1"]["restarts"] == 1
    applied_exactly_once(run_dir)


def test_kill_the_applier(hep_files, tmp_path):
    proc, run_dir = start_run(hep_files, tmp_path, steps=150)
    wait_for(lambda: state(run_dir, 0).get("step", 0) >= 20, what="step 20")
    applier = local_view(run_dir)["applier"]["pid"]
    os.kill(applier, signal.SIGKILL)
    steps_at_kill = [state(run_dir, g).get("step", 0) for g in (0, 1)]
    wait_for(lambda: local_view(run_dir)["applier"]["restarts"] >= 1, what="the applier restarted")
    wait_for(lambda: all(state(run_dir, g).get("step", 0) > s for g, s in zip((0, 1), steps_at_kill)),
             what="both groups going on")
    finish(proc)
    status = applied_exactly_once(run_dir)
    assert status["counts"]["applied"] > 0 and set(status["last_seq"]) == {"0", "1"}


def test_bad_files_in_the_exchange_are_rejected_and_the_run_goes_on(hep_files, tmp_path):
    proc, run_dir = start_run(hep_files, tmp_path, steps=200)  # long enough for a cleaning round
    updates = run_dir / "exchange" / "updates"
    wait_for(lambda: state(run_dir, 0).get("step", 0) >= 10, what="step 10")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import pickle

    (updates / "u-g000099-s000000000000.hx").write_bytes(pickle.dumps(Evil()))
    torn = updates / ".tmp-deadbeef-u-g000098-s000000000000.hx"
    torn.write_bytes(b"HPCDLX\r\n partial")
    os.utime(torn, (time.time() - 3600, time.time() - 3600))
    # a real update of a fictitious group with one flipped payload byte
    channel = Channel(run_dir / "exchange", run_dir.name)
    good = channel.publish_update(97, 0, 0, {"x": np.ones(16, np.float32)})
    data = bytearray(good.read_bytes())
    data[-1] ^= 0xFF
    good.write_bytes(bytes(data))
    finish(proc)
    status = json.loads((run_dir / "exchange/applier/status.json").read_text())
    assert status["counts"]["rejected_corrupt"] >= 2
    assert not marker.exists()
    assert not torn.exists()
    rejected = [e for e in read_jsonl(run_dir / "exchange/applier/events.jsonl") if e["event"] == "rejected"]
    assert {e.get("group") for e in rejected} >= {99, 97} or len(rejected) >= 2


def test_a_group_never_waits_for_a_missing_applier(tmp_path):
    channel = Channel(tmp_path / "x", "run", max_pending_per_group=3)
    sync = ExchangeSync(channel, group=0, every=1, initial_wait_s=0.5)
    mine = {"w": np.zeros(4, np.float32)}
    start = time.monotonic()
    assert sync.initial_weights(mine) is mine  # no applier: train on our own weights
    for step in range(1, 21):
        assert sync.after_step(step, lambda: {"w": np.full(4, step, np.float32)}) is None
    assert time.monotonic() - start < 10
    assert channel.backlog(0) == 3  # bounded, newest kept
    assert sync.stats()["exchange_published"] == 20 and sync.version == -1
    channel.publish_weights(5, {"w": np.ones(4, np.float32)})
    adopted = sync.after_step(21, lambda: {"w": np.zeros(4, np.float32)})
    assert adopted is not None and np.array_equal(adopted["w"], np.ones(4)) and sync.version == 5


DELTA = ['exchange.kind="delta"', "exchange.every=5", 'exchange.optimizer="nesterov"',
         "exchange.learning_rate=0.7", "exchange.max_outstanding=1"]


def test_delta_groups_train_through_the_applier_across_its_kill(hep_files, tmp_path):
    emulated = ["emulate.enabled=true", "emulate.step_seconds=0.05", "emulate.sigma=0.5", "emulate.seed=3"]
    proc, run_dir = start_run(hep_files, tmp_path, 150, *DELTA, *emulated)
    wait_for(lambda: state(run_dir, 0).get("step", 0) >= 40, what="step 40")
    os.kill(local_view(run_dir)["applier"]["pid"], signal.SIGKILL)
    wait_for(lambda: local_view(run_dir)["applier"]["restarts"] >= 1, what="the applier restarted")
    finish(proc)
    status = applied_exactly_once(run_dir)
    # one update per group every 5 steps, each applied once: 2 × 150 / 5
    assert status["counts"]["applied"] + status["counts"]["dropped_stale"] == 60
    metrics = read_jsonl(run_dir / "groups/0/metrics.jsonl")
    assert metrics[-1]["exchange_kind"] == "delta" and metrics[-1]["exchange_published"] == 30
    assert metrics[-1]["emulated"]["sigma"] == 0.5
    shown = json.loads(subprocess.run([HPCDL, "status", str(run_dir), "--json"], capture_output=True,
                                      text=True, check=True).stdout)
    assert shown["emulated"]["sigma"] == 0.5 and shown["exchange"]["kind"] == "delta"
    screen = subprocess.run([HPCDL, "status", str(run_dir)], capture_output=True, text=True, check=True,
                            env={**os.environ, "COLUMNS": "200"}).stdout
    assert "EMULATED" in screen
    result = json.loads(subprocess.run([HPCDL, "evaluate", str(run_dir), "--json"], capture_output=True,
                                       text=True, check=True).stdout)
    assert result["model"].startswith("master weights v") and result["auc_weighted"] > 0.9


def test_a_healthy_run_with_the_default_bounds_loses_no_update(hep_files, tmp_path):
    runs = tmp_path / "runs"
    proc = subprocess.Popen([HPCDL, "submit", "hep", "--nodes", "4", "--group-size", "2", "--json",
                             *set_args(tiny_overrides(hep_files, runs, steps=60))],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finish(proc)
    (run_dir,) = [p for p in runs.iterdir() if not p.name.startswith(".")]
    status = applied_exactly_once(run_dir)
    assert status["counts"]["applied"] == 120  # every step's gradient of both groups
    for g in (0, 1):
        assert read_jsonl(run_dir / f"groups/{g}/metrics.jsonl")[-1]["exchange_backlog_dropped"] == 0
