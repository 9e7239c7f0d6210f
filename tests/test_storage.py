"""Full disk and quota: a storage report, a metrics/state write or a checkpoint that fails with
ENOSPC/EDQUOT leaves no partial file, keeps the previous good version, shows in `hpcdl status`,
and training goes on.

Where the sandbox allows it (root, tmpfs), the disk is really full: a tiny tmpfs is mounted for
the test. Otherwise, and in addition, the error is injected (an OSError / TensorFlow error raised
from inside the write)."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcdl.jobfile import load_job
from hpcdl.exchange import Channel
from hpcdl.rundir.runs import create_run
from hpcdl.fs.files import atomic_write_json
from hpcdl.fs.files import append_jsonl, read_jsonl
from hpcdl.fs.storage import (
    REPORT_FILE, REPORT_SIZE, StorageReport, attempt, is_storage_full, read_report, save_checkpoint,
)
from tests.conftest import REPO, tiny_overrides

from tests.helpers.full_disk import ENOSPC, fill, problems, temporaries


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------


def test_is_storage_full_recognises_errno_and_tensorflow_messages():
    assert is_storage_full(OSError(errno.ENOSPC, "x"))
    assert is_storage_full(OSError(errno.EDQUOT, "x"))
    assert not is_storage_full(OSError(errno.EIO, "x"))
    assert is_storage_full(RuntimeError("SaveV2 ... /c/ckpt-2_temp/part: No space left on device"))
    assert is_storage_full(RuntimeError("Disk quota exceeded"))
    try:
        try:
            raise ENOSPC
        except OSError as e:
            raise ValueError("wrapped") from e
    except ValueError as e:
        assert is_storage_full(e)
    assert not is_storage_full(ValueError("bad value"))


def test_report_is_fixed_size_and_rewritten_in_place(tmp_path):
    report = StorageReport(tmp_path / REPORT_FILE)
    assert (tmp_path / REPORT_FILE).stat().st_size == REPORT_SIZE
    ino = (tmp_path / REPORT_FILE).stat().st_ino
    for i in range(200):  # many problems with long messages: still one block, still JSON
        report.failed(f"thing {i}", OSError(errno.ENOSPC, "No space left on device " + "x" * 300))
    assert (tmp_path / REPORT_FILE).stat().st_size == REPORT_SIZE
    assert (tmp_path / REPORT_FILE).stat().st_ino == ino
    doc = read_report(tmp_path / REPORT_FILE)
    assert doc["problems"] and "thing 199" in doc["problems"]
    report.succeeded("thing 199")
    doc = read_report(tmp_path / REPORT_FILE)
    assert "thing 199" not in doc["problems"]


def test_report_can_be_written_on_a_full_disk(tiny_fs):
    fs = tiny_fs("full", 256)
    report = StorageReport(fs / REPORT_FILE)  # reserved while there is space
    fill(fs)
    with pytest.raises(OSError) as info:
        (fs / "more").write_bytes(b"x" * 8192)
    assert info.value.errno == errno.ENOSPC
    report.failed("metrics", info.value)
    assert problems(fs / REPORT_FILE)["metrics"]["errno"] == errno.ENOSPC


def test_attempt_records_storage_errors_and_raises_others(tmp_path):
    report = StorageReport(tmp_path / REPORT_FILE)

    def boom(exc):
        raise exc

    assert attempt(report, "metrics", boom, ENOSPC) is False
    assert problems(tmp_path / REPORT_FILE)["metrics"]["count"] == 1
    with pytest.raises(OSError):
        attempt(report, "metrics", boom, OSError(errno.EIO, "io"))
    with pytest.raises(KeyError):
        attempt(report, "metrics", boom, KeyError("bug"))
    assert attempt(report, "metrics", lambda: None) is True
    assert problems(tmp_path / REPORT_FILE) == {}
    assert read_report(tmp_path / REPORT_FILE)["recovered"]["metrics"]["count"] == 1


def test_metrics_and_state_writes_on_a_full_disk(tiny_fs):
    fs = tiny_fs("grp", 64)
    atomic_write_json(fs / "state.json", {"step": 1})
    append_jsonl(fs / "metrics.jsonl", {"step": 1})
    filler = fill(fs, leave=0)
    big = {"step": 2, "pad": "x" * 20000}
    with pytest.raises(OSError) as info:
        append_jsonl(fs / "metrics.jsonl", big)
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        atomic_write_json(fs / "state.json", big)
    assert json.loads((fs / "state.json").read_text()) == {"step": 1}  # the previous version
    assert read_jsonl(fs / "metrics.jsonl") == [{"step": 1}]
    assert (fs / "metrics.jsonl").read_bytes().endswith(b"\n")  # no torn line left behind
    assert temporaries(fs) == []
    filler.unlink()
    append_jsonl(fs / "metrics.jsonl", {"step": 3})
    assert read_jsonl(fs / "metrics.jsonl") == [{"step": 1}, {"step": 3}]


def test_metrics_append_cut_back_after_an_injected_short_write(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1})
    real_write = os.write

    def short(fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            return real_write(fd, data)
        return real_write(fd, bytes(data)[:7])  # a partial line, then the disk is full

    monkeypatch.setattr("hpcdl.rundir.runs.os.write", short)
    with pytest.raises(OSError) as info:
        append_jsonl(path, {"step": 2})
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    append_jsonl(path, {"step": 3})
    assert read_jsonl(path) == [{"step": 1}, {"step": 3}]


# ----------------------------------------------------------------------------------------------
# checkpoints (real TensorFlow checkpoints)
# ----------------------------------------------------------------------------------------------


def tf_manager(directory: Path, keep: int = 1):
    import tensorflow as tf

    v = tf.Variable(np.arange(64 << 10, dtype=np.float32))  # 256 KiB
    ckpt = tf.train.Checkpoint(v=v)
    return v, ckpt, tf.train.CheckpointManager(ckpt, str(directory), keep)


def check_restorable(directory: Path, number: int, value: float) -> None:
    import tensorflow as tf

    v = tf.Variable(np.zeros(64 << 10, np.float32))
    tf.train.Checkpoint(v=v).restore(str(directory / f"ckpt-{number}")).assert_consumed()
    assert float(v.numpy()[1]) == value


def test_checkpoint_on_a_full_tmpfs(tiny_fs, tmp_path):
    fs = tiny_fs("ckpt", 1024)
    directory = fs / "c"
    v, ckpt, manager = tf_manager(directory)
    report = StorageReport(tmp_path / REPORT_FILE)
    assert save_checkpoint(report, lambda: manager.save(checkpoint_number=10), directory, 10)
    before = sorted(os.listdir(directory))
    filler = fill(fs, leave=64 << 10)
    v.assign_add(np.ones(64 << 10, np.float32))
    assert not save_checkpoint(report, lambda: manager.save(checkpoint_number=20), directory, 20)
    assert sorted(os.listdir(directory)) == before  # no ckpt-20 leftovers (TF leaves a _temp dir)
    check_restorable(directory, 10, 1.0)
    p = problems(tmp_path / REPORT_FILE)["checkpoint"]
    assert "No space left" in p["error"] and "kept ckpt-10" in p["detail"]
    filler.unlink()
    assert save_checkpoint(report, lambda: manager.save(checkpoint_number=30), directory, 30)
    check_restorable(directory, 30, 2.0)
    assert problems(tmp_path / REPORT_FILE) == {}


def test_checkpoint_with_an_injected_failure_after_partial_files(tmp_path):
    import tensorflow as tf

    directory = tmp_path / "c"
    v, ckpt, manager = tf_manager(directory, keep=2)
    report = StorageReport(tmp_path / REPORT_FILE)
    assert save_checkpoint(report, lambda: manager.save(checkpoint_number=10), directory, 10)
    before = sorted(os.listdir(directory))

    def partial_then_full():
        (directory / "ckpt-20_temp").mkdir()
        (directory / "ckpt-20_temp" / "part-00000-of-00001.data-00000-of-00001.tempstate1").write_bytes(b"x")
        (directory / "ckpt-20.index").write_bytes(b"half")
        (directory / "checkpoint.tmp0123").write_bytes(b"model_checkpoint_path")
        raise tf.errors.ResourceExhaustedError(None, None, "ckpt-20: Disk quota exceeded")

    assert not save_checkpoint(report, partial_then_full, directory, 20)
    assert sorted(os.listdir(directory)) == before
    check_restorable(directory, 10, 1.0)
    with pytest.raises(tf.errors.InvalidArgumentError):  # anything else still raises
        save_checkpoint(report, lambda: (_ for _ in ()).throw(tf.errors.InvalidArgumentError(None, None, "bug")),
                        directory, 30)
    # the recorded checkpoint is never overwritten in place
    v.assign_add(np.ones(64 << 10, np.float32))
    assert not save_checkpoint(report, lambda: manager.save(checkpoint_number=10), directory, 10)
    check_restorable(directory, 10, 1.0)


TRAIN_SCRIPT = r"""
import json, os, sys
from pathlib import Path
import tensorflow as tf
from hpcdl.engine.collective import join_group
from hpcdl.jobfile import load_job
from hpcdl.engine.train import GroupRoot, train_group
from hpcdl.rundir.group_files import GroupRecorder
from hpcdl.fs.storage import REPORT_FILE, StorageReport
from hpcdl.process.worker import group_task
from hpcdl.workloads import get_workload

out, ckdir, overrides, fail_at = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]), set(json.loads(sys.argv[4]))
real_save = tf.train.CheckpointManager.save
def fill(fs):
    st = os.statvfs(fs)
    if st.f_blocks * st.f_frsize > 64 << 20:  # never fill a real file system
        raise SystemExit(f"refusing to fill {fs}: not a tiny test file system")
    with open(fs / "filler", "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
def save(self, checkpoint_number=None, **kw):
    if checkpoint_number in fail_at:  # the quota runs out in the middle of this checkpoint
        (Path(self.directory) / f"ckpt-{checkpoint_number}_temp").mkdir()
        (Path(self.directory) / f"ckpt-{checkpoint_number}.index").write_bytes(b"partial")
        raise tf.errors.ResourceExhaustedError(None, None, "Disk quota exceeded")
    path = real_save(self, checkpoint_number=checkpoint_number, **kw)
    if checkpoint_number == 10:
        fill(out)  # and from now on, the group's file system is full
    return path
tf.train.CheckpointManager.save = save
comm = join_group("gloo")
job = load_job("hep", overrides)
workload = get_workload("hep")
stats = workload.compute_stats(job)
recorder = GroupRecorder(job, stats, StorageReport(out / REPORT_FILE), checkpoints=ckdir, metrics=out / "metrics.jsonl",
                         state=out / "state.json", tensorboard=out / "tb")
result = train_group(group_task(job, workload, stats), comm, ckdir, group=0, groups=1, root=GroupRoot(recorder))
print("STEPS", result.steps_run)
"""


def test_training_goes_on_through_failed_writes(hep_files, tmp_path, tiny_fs):
    """A real (one-rank) group: its metrics, state and TensorBoard files sit on a tmpfs that fills
    up after step 10, and checkpoint 20 fails half-way (injected quota error). Training runs all
    steps, the other checkpoints are fine, and the group's storage report says what failed; as the
    final state cannot be written while the disk stays full, the group does not end as finished
    but fails with the reason once train.final_save_retry_s is spent."""
    group_dir = tiny_fs("group", 64)
    StorageReport(group_dir / REPORT_FILE).close()  # as create_run reserves it
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=30) + ["train.final_save_retry_s=2"]
    proc = subprocess.run(
        [sys.executable, "-c", TRAIN_SCRIPT, str(group_dir), str(tmp_path / "ckpt"), json.dumps(overrides),
         json.dumps([20])],
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "STEPS" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FinalSaveFailed: the checkpoint, held updates and state of step 30 could not be written" in proc.stderr
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert "ckpt-10.index" in names and "ckpt-30.index" in names
    assert not any(n.startswith("ckpt-20") for n in names)
    doc = read_report(group_dir / REPORT_FILE)
    # state.json is a new file each time: it cannot be written any more. (metrics.jsonl and the
    # TensorBoard file grow into the slack of their last page first: they fail later, if at all.)
    assert "state" in doc["problems"]
    assert set(doc["problems"]) <= {"state", "metrics", "tensorboard"}
    assert doc["recovered"]["checkpoint"]["count"] == 1, [l for l in proc.stderr.splitlines() if "storage" in l]
    assert temporaries(group_dir) == []
    steps = [m["step"] for m in read_jsonl(group_dir / "metrics.jsonl")]
    assert steps == [5, 10, 15, 20, 25, 30][:len(steps)] and len(steps) >= 2
    assert (group_dir / "metrics.jsonl").read_bytes().endswith(b"\n")  # whole lines only
    assert ("metrics" in doc["problems"]) == (len(steps) < 6)
    assert json.loads((group_dir / "state.json").read_text())["step"] == 10


# ----------------------------------------------------------------------------------------------
# hpcdl status shows it
# ----------------------------------------------------------------------------------------------


def test_status_shows_storage_problems(tmp_path):
    from rich.console import Console

    from hpcdl.commands.display import status_view
    from hpcdl.commands.status import collect

    job = load_job("hep", [f'run.runs_dir="{tmp_path / "runs"}"', "run.nodes=2", "run.group_size=1"])
    with create_run(job, "local") as (_, run):
        pass
    quiet = collect(run, backend_view={})
    assert [w for w in quiet["storage"] if w["where"] != "file system"] == []
    StorageReport(run.storage_file(1)).failed(
        "checkpoint", OSError(errno.EDQUOT, "Disk quota exceeded [bad markup]"),
        detail="step 20 not saved; kept ckpt-10")
    ch = Channel(run.exchange_dir(job), run.run_id)
    StorageReport(ch.applier_dir / REPORT_FILE).failed("applier commit", ENOSPC)
    status = collect(run, backend_view={})
    found = {(w["where"], w["what"]) for w in status["storage"]}
    assert {("group 1", "checkpoint"), ("applier", "applier commit")} <= found
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(status_view(status))
    text = console.export_text()
    assert "storage problems" in text and "Disk quota exceeded [bad markup]" in text
    assert "kept ckpt-10" in text and "No space left on device" in text
