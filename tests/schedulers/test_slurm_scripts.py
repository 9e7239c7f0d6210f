"""The rendered batch scripts run by real bash, with stand-ins for srun, scontrol and the ranks:
the stop signal (slurm.signal) leaves the stop mark, a checkpointed group requeues itself, and
not after `hpcdl cancel` left its mark. No cluster needed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpcdl.config import JobError, load_job
from hpcdl.runs import RunDir
from hpcdl.schedulers.base import SubmitRequest
from hpcdl.schedulers.slurm import SlurmScheduler

FAKE_PYTHON = """#!/bin/bash
# stands in for `python -m hpcdl.worker ...`
echo "$*" >> "$RUN_DIR/python.calls"
case " $* " in
  *" --rendezvous "*)
    while [ $# -gt 0 ]; do [ "$1" = --port-file ] && { echo 29500 > "$2"; }; shift; done
    exec sleep 60 ;;
  *" --applier "*)
    shard=; prev=; for arg in "$@"; do [ "$prev" = --shard ] && shard=$arg; prev=$arg; done
    echo "$shard" >> "$RUN_DIR/appliers.started"
    # a crash of this shard's applier, once (the mark says which)
    [ -e "$RUN_DIR/crash-shard-$shard" ] && { rm "$RUN_DIR/crash-shard-$shard"; exit 1; }
    trap 'exit 75' USR1
    for _ in $(seq 600); do sleep 0.1; done ;;
esac
"""

# A group's ranks: train until the stop mark appears, then checkpoint, leave the requeue mark and
# exit 0 -- what hpcdl.worker does (or finish at once with FINISH=1).
FAKE_SRUN = """#!/bin/bash
dir="$RUN_DIR/groups/$SLURM_ARRAY_TASK_ID"
echo "$@" > "$dir/srun.args"
echo started > "$dir/ranks-started"
[ "${FINISH:-0}" = 1 ] && exit 0
for _ in $(seq 600); do
  if [ -e "$dir/stop" ]; then touch "$dir/requeue"; exit 0; fi
  sleep 0.1
done
exit 1
"""

FAKE_SCONTROL = """#!/bin/bash
echo "$@" >> "$RUN_DIR/scontrol.calls"
"""


def render(tmp_path: Path, *overrides: str) -> tuple[RunDir, dict[str, str], dict[str, str]]:
    run = RunDir(tmp_path / "runs" / "hep-1")
    (run.group_dir(0)).mkdir(parents=True)
    run.scheduler_dir.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job = load_job("hep", ["run.backend=slurm", "run.nodes=2", "run.group_size=1", *overrides])
    dry = SlurmScheduler().submit_dryrun(SubmitRequest(job, run, str(bin_dir / "python"), {}))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RUN_DIR": str(run.root), "SLURM_JOB_ID": "41",
           "SLURM_ARRAY_JOB_ID": "41", "SLURM_ARRAY_TASK_ID": "0"}
    scripts = {}
    for name, text in dry.files.items():
        path = tmp_path / Path(name).name
        path.write_text(text)
        scripts[Path(name).stem] = str(path)
    return run, scripts, env


def start(script: str, env: dict[str, str], **extra: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", script], env={**env, **extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)


def scontrol_calls(run: RunDir) -> list[str]:
    path = run.root / "scontrol.calls"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_the_configured_signal_checkpoints_and_requeues(tmp_path, sig):
    run, scripts, env = render(tmp_path, f"slurm.signal={sig}")
    assert f"#SBATCH --signal=B:{sig}@120" in Path(scripts["group"]).read_text()
    proc = start(scripts["group"], env)
    wait_for(run.group_dir(0) / "ranks-started")
    proc.send_signal(getattr(signal, f"SIG{sig}"))
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "checkpointed; requeueing 41_0" in out
    assert scontrol_calls(run) == ["requeue 41_0"]


def test_the_mpi_controller_s_script_starts_no_rendezvous_and_still_requeues(tmp_path):
    run, scripts, env = render(tmp_path, "run.controller=mpi")
    proc = start(scripts["group"], env)
    wait_for(run.group_dir(0) / "ranks-started")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "checkpointed; requeueing 41_0" in out, out
    assert scontrol_calls(run) == ["requeue 41_0"]
    assert (run.group_dir(0) / "srun.args").read_text().split()[:3] == [
        "--kill-on-bad-exit=1", "--mpi=pmix", "--ntasks-per-node=1"]
    assert not (run.root / "python.calls").exists()  # no rendezvous beside the ranks


def test_a_later_element_requeues_itself_not_the_array(tmp_path):
    """For element 0, $SLURM_JOB_ID is the array's own id, and requeueing that id requeues every
    element: the script names the element as <array id>_<task id> whichever it is."""
    for task, job_id in (("0", "41"), ("1", "43")):
        run, scripts, env = render(tmp_path / task)
        run.group_dir(int(task)).mkdir(parents=True, exist_ok=True)
        proc = start(scripts["group"], env, SLURM_ARRAY_TASK_ID=task, SLURM_JOB_ID=job_id)
        wait_for(run.group_dir(int(task)) / "ranks-started")
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and scontrol_calls(run) == [f"requeue 41_{task}"], out


def test_no_requeue_after_hpcdl_cancel(tmp_path):
    run, scripts, env = render(tmp_path, "slurm.signal=TERM")
    proc = start(scripts["group"], env)
    wait_for(run.group_dir(0) / "ranks-started")
    run.cancel_mark.touch()  # what SlurmScheduler.cancel leaves before scancel
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "the run was cancelled, not requeueing" in out, out
    assert scontrol_calls(run) == []


def test_a_group_that_finishes_does_not_requeue(tmp_path):
    run, scripts, env = render(tmp_path)
    proc = start(scripts["group"], env, FINISH="1")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert scontrol_calls(run) == [] and "requeueing" not in out


@pytest.mark.parametrize("cancelled", [False, True])
def test_the_applier_requeues_on_the_configured_signal_unless_cancelled(tmp_path, cancelled):
    run, scripts, env = render(tmp_path, "slurm.signal=TERM")
    assert "#SBATCH --signal=B:TERM@120" in Path(scripts["applier"]).read_text()
    proc = start(scripts["applier"], {k: v for k, v in env.items() if k != "SLURM_ARRAY_TASK_ID"})
    time.sleep(1.0)  # the applier stand-in is running
    if cancelled:
        run.cancel_mark.touch()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert scontrol_calls(run) == ([] if cancelled else ["requeue 41"]), out


@pytest.mark.parametrize("value", ["KILL", "SIGTERM", "usr1", "USR1;touch x", ""])
def test_a_signal_that_cannot_stop_a_job_cleanly_is_refused(value):
    with pytest.raises(JobError, match="slurm.signal must be one of"):
        load_job("hep", [f"slurm.signal={value}"])


def test_cancel_leaves_the_mark_before_scancel(monkeypatch, tmp_path):
    import hpcdl.schedulers.slurm as slurm

    run = RunDir(tmp_path)
    run.scheduler_dir.mkdir()
    (run.scheduler_dir / "slurm.json").write_text('{"slurm_array_job_id": "41", "slurm_applier_job_id": null}')
    seen = []

    def fake(cmd, timeout=30.0):
        seen.append((cmd[0], run.cancel_mark.exists()))
        return subprocess.CompletedProcess(cmd, 0, "41_0\n" if cmd[0] == "squeue" else "", "")

    monkeypatch.setattr(slurm, "_run", fake)
    assert SlurmScheduler().cancel(run) == "cancelled SLURM jobs 41"
    assert seen == [("squeue", False), ("scancel", True)]


def test_the_groups_own_requeues_at_the_signal_are_not_bounded(tmp_path):
    """A long run requeues itself at every time limit: run.max_restarts bounds failures only."""
    run, scripts, env = render(tmp_path, "run.max_restarts=2")
    (run.group_dir(0) / "planned-requeues").write_text("5\n")
    proc = start(scripts["group"], env, SLURM_RESTART_COUNT="6")  # 5 planned, 1 after a failure
    wait_for(run.group_dir(0) / "ranks-started")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and scontrol_calls(run) == ["requeue 41_0"], out
    assert (run.group_dir(0) / "planned-requeues").read_text().strip() == "6"


def test_below_run_max_restarts_the_group_requeues(tmp_path):
    run, scripts, env = render(tmp_path, "run.max_restarts=2")
    proc = start(scripts["group"], env, SLURM_RESTART_COUNT="1")
    wait_for(run.group_dir(0) / "ranks-started")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and scontrol_calls(run) == ["requeue 41_0"], out


def test_an_element_requeued_beyond_run_max_restarts_does_not_run(tmp_path):
    """SLURM itself requeues after a node failure or preemption (--requeue): bounded too."""
    run, scripts, env = render(tmp_path, "run.max_restarts=2")
    proc = start(scripts["group"], env, SLURM_RESTART_COUNT="3")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "more than run.max_restarts = 2" in out, out
    assert not (run.group_dir(0) / "ranks-started").exists()


def test_a_failed_scancel_takes_its_cancel_mark_back(monkeypatch, tmp_path):
    """Otherwise every later warning-signal requeue of the still running job would be skipped."""
    import pytest

    import hpcdl.schedulers.slurm as slurm
    from hpcdl.schedulers.base import SchedulerError

    run = RunDir(tmp_path)
    run.scheduler_dir.mkdir()
    (run.scheduler_dir / "slurm.json").write_text('{"slurm_array_job_id": "41", "slurm_applier_job_id": null}')

    def fake(cmd, timeout=30.0):
        if cmd[0] == "squeue":
            return subprocess.CompletedProcess(cmd, 0, "41_0\n", "")
        return subprocess.CompletedProcess(cmd, 1, "", "scancel: error: Unable to contact slurm controller")

    monkeypatch.setattr(slurm, "_run", fake)
    with pytest.raises(SchedulerError, match="scancel failed"):
        SlurmScheduler().cancel(run)
    assert not run.cancel_mark.exists()


def test_each_shard_has_its_applier_and_a_crash_restarts_only_that_shard(tmp_path):
    run, scripts, env = render(tmp_path, "exchange.shards=3", "slurm.signal=TERM")
    text = Path(scripts["applier"]).read_text()
    assert "#SBATCH --ntasks-per-node=3" in text and "shards=3" in text
    (run.root / "crash-shard-1").touch()
    proc = start(scripts["applier"], {k: v for k, v in env.items() if k != "SLURM_ARRAY_TASK_ID"})
    started = run.root / "appliers.started"
    deadline = time.monotonic() + 30
    while not (started.exists() and len(started.read_text().split()) >= 4):
        assert time.monotonic() < deadline, "the shards' appliers did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # the time limit's warning: every shard commits, one requeue
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert sorted(started.read_text().split()) == ["0", "1", "1", "2"], out
    assert "shard 1's applier exited with status 1; starting it again" in out
    assert scontrol_calls(run) == ["requeue 41"], out
