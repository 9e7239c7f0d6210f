"""`hpcdl logs` and the failed group's reason in `hpcdl status`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpcdl.jobfile import load_job
from hpcdl.commands.logs import last_error, select
from hpcdl.rundir.runs import RunError, create_run
from tests.conftest import HPCDL, hpcdl, set_args, tiny_overrides

TRACEBACK = """hpcdl rank 0: intra-op 1, inter-op 1
Traceback (most recent call last):
  File "/x/hpcdl/process/worker.py", line 190, in main
    stats = ensure_stats(run, workload, job, is_root=hvd.rank() == 0)
  File "/x/h5py/_hl/files.py", line 234, in make_fid
FileNotFoundError: [Errno 2] Unable to synchronously open file (unable to open file: name = '/data/train.h5')
"""


@pytest.fixture
def run(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path / "runs"}"', "run.nodes=4", "run.group_size=2"])
    with create_run(job, "local") as (_, final):
        pass
    for g in (0, 1):
        for r in (0, 1):
            final.rank_log(g, r).write_text(f"group {g} rank {r}\n")
    final.applier_log.write_text("applier\n")
    final.supervisor_log.write_text("supervisor\n")
    return final


def test_select(run):
    everything, _ = select(run)
    assert everything == [run.supervisor_log, run.applier_log] + [run.rank_log(g, r) for g in (0, 1) for r in (0, 1)]
    assert select(run, group=1)[0] == [run.rank_log(1, 0), run.rank_log(1, 1)]
    assert select(run, group=1, rank=1)[0] == [run.rank_log(1, 1)]
    assert select(run, applier=True)[0] == [run.applier_log]
    assert select(run, group=0, applier=True)[0] == [run.applier_log, run.rank_log(0, 0), run.rank_log(0, 1)]
    with pytest.raises(RunError, match="no group 2"):
        select(run, group=2)
    with pytest.raises(RunError, match="ranks 0-1, not 2"):
        select(run, group=0, rank=2)
    with pytest.raises(RunError, match="--rank needs --group"):
        select(run, rank=0)


def test_select_slurm_outputs(run):
    for g in (0, 1):
        for p in run.group_logs(g):
            p.unlink()
        (run.group_dir(g) / f"slurm-41_{g}.out").write_text(f"element {g}\n")
    (run.root / "applier-40.out").write_text("applier job\n")
    run.applier_log.unlink()
    assert select(run, group=1)[0] == [run.group_dir(1) / "slurm-41_1.out"]
    files, note = select(run, group=1, rank=1)
    assert files == [run.group_dir(1) / "slurm-41_1.out"] and "share" in note
    assert select(run, applier=True)[0] == [run.root / "applier-40.out"]


def test_last_error_is_the_traceback_s_last_line(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text(TRACEBACK + "\n\n")
    assert last_error([log]).startswith("FileNotFoundError: [Errno 2] Unable to synchronously open file")
    quiet = tmp_path / "quiet.log"
    quiet.write_text("step 10\nstep 20\n")
    assert last_error([quiet]) is None
    slurm = tmp_path / "slurm-41_0.out"
    slurm.write_text("srun: error: n1: task 0: Exited with exit code 1\n")
    assert last_error([slurm]) == "srun: error: n1: task 0: Exited with exit code 1"
    # a rank's exception in SLURM's output says more than srun's summary after it
    slurm.write_text(TRACEBACK + "srun: error: n1: task 0: Exited with exit code 1\n")
    assert last_error([slurm]).startswith("FileNotFoundError: [Errno 2]")
    # and hpcdl's own words say most
    slurm.write_text(TRACEBACK + "hpcdl: error: group 0 checkpointed, not requeueing: run.max_restarts = 1\n"
                     "srun: error: n1: task 0: Exited with exit code 1\n")
    assert last_error([slurm]).startswith("hpcdl: error: group 0 checkpointed, not requeueing")




@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_logs_prints_and_follows(run, tmp_path, stop):
    out = hpcdl("logs", str(run.root), "--group", "1", cwd=tmp_path).stdout
    assert out == (f"==> {run.rank_log(1, 0)} <==\ngroup 1 rank 0\n\n"
                   f"==> {run.rank_log(1, 1)} <==\ngroup 1 rank 1\n")
    assert hpcdl("logs", str(run.root), "--group", "1", "--rank", "0", cwd=tmp_path).stdout == "group 1 rank 0\n"
    bad = hpcdl("logs", str(run.root), "--group", "7", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "no group 7" in bad.stderr

    follower = subprocess.Popen([HPCDL, "logs", str(run.root), "--group", "0", "--rank", "1", "-f"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        os.set_blocking(follower.stdout.fileno(), False)
        seen = b""

        def read_until(text: bytes, timeout=60.0):
            nonlocal seen
            deadline = time.monotonic() + timeout
            while text not in seen:
                assert time.monotonic() < deadline, seen
                seen += follower.stdout.read() or b""
                time.sleep(0.1)

        read_until(b"group 0 rank 1\n")
        with open(run.rank_log(0, 1), "ab") as f:
            f.write(b"step 10 \xff\n")  # not UTF-8: passed through as it is
        read_until(b"step 10 \xff\n")
        follower.send_signal(stop)
        _, err = follower.communicate(timeout=30)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0 and b"Traceback" not in err, err


def test_status_of_a_failed_group_names_its_logs_and_the_reason(hep_files, tmp_path):
    """The data file disappears after submit: the rank fails; status says where and why."""
    data = tmp_path / "data"
    data.mkdir()
    train = Path(shutil.copy(hep_files["train"], data / "train.h5"))
    files = {**hep_files, "train": train}
    runs = tmp_path / "runs"
    out = json.loads(hpcdl("submit", "hep", "--detach", "--json",
                           *set_args(tiny_overrides(files, runs, steps=50) + ["run.max_restarts=0"]),
                           cwd=tmp_path).stdout)
    train.unlink()  # the ranks are still importing TensorFlow
    run_dir = runs / out["run_id"]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        status = json.loads(hpcdl("status", str(run_dir), "--json", cwd=tmp_path).stdout)
        if status["state"] not in ("running", "pending"):
            break
        time.sleep(1)
    (group,) = status["groups"]
    assert group["state"] == "failed", status
    assert group["logs"] == [str(run_dir / "groups/0/rank0.log")]
    # a user error: one line naming the file, no traceback
    assert group["last_error"].startswith("hpcdl rank: error: ") and "train.h5" in group["last_error"], group["last_error"]
    assert "Traceback" not in (run_dir / "groups/0/rank0.log").read_text()
    text = hpcdl("status", str(run_dir), cwd=tmp_path).stdout
    assert "group 0 failed" in text and "rank0.log" in text and "train.h5" in text
    rank_log = hpcdl("logs", str(run_dir), "--group", "0", "--rank", "0", cwd=tmp_path).stdout
    assert group["last_error"] in rank_log


FAKE_SBATCH = """#!/bin/bash
n=$(cat "$FAKE_SLURM/next" 2>/dev/null || echo 500)
echo $((n + 1)) > "$FAKE_SLURM/next"
echo "$@" >> "$FAKE_SLURM/sbatch.calls"
echo "$n;cluster"
"""


def fake_slurm(tmp_path: Path) -> dict[str, str]:
    """sbatch that hands out job ids and scontrol that answers: real processes, no cluster."""
    bin_dir = tmp_path / "fake-slurm"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 'MaxArraySize = 1001'\necho 'SLURM_VERSION = 23.02.6'\n")
    for name in ("sbatch", "scontrol"):
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SLURM": str(bin_dir)}


def test_submit_prints_the_slurm_job_ids(hep_files, tmp_path):
    env = fake_slurm(tmp_path)
    proc = subprocess.run([HPCDL, "submit", "hep", "--backend", "slurm", "--nodes", "4", "--group-size", "2",
                           *set_args(tiny_overrides(hep_files, tmp_path / "runs"))],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SLURM jobs: group array 501 (elements 0-1), applier 500" in proc.stdout


def test_logs_help_says_when_there_is_a_header():
    """As tail: a header per file when there are several (test above), none for a single one."""
    from click.testing import CliRunner

    from hpcdl.cli import main

    text = " ".join(CliRunner().invoke(main, ["logs", "--help"]).output.split())
    assert "==> path <== header when there are several (or with --follow), a single file as it is" in text
