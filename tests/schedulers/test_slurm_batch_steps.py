"""The rendered batch scripts run by real bash and their batch steps by real Python
(hpcdl.process.lifecycle under SLURM), with stand-ins for srun and scontrol: the warning signal
(slurm.signal) leaves the stop mark, a checkpointed group requeues exactly its element, not after
`hpcdl cancel` left its mark, a crash requeues while run.max_restarts allows. No cluster needed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcdl.errors import JobError
from hpcdl.jobfile import load_job
from hpcdl.process.lifecycle import RestartTally
from hpcdl.rundir.runs import RunDir, create_run
from hpcdl.schedulers.base import SubmitRequest
from hpcdl.schedulers.slurm import SlurmScheduler

# A group's ranks: train until the stop mark appears, then checkpoint, leave the requeue mark and
# exit 0 -- what hpcdl.process.worker does (or finish at once with FINISH=1, crash with CRASH=1).
FAKE_SRUN = """#!/bin/bash
dir="$RUN_DIR/groups/$SLURM_ARRAY_TASK_ID"
echo "$@" > "$dir/srun.args"
env > "$dir/srun.env"
echo started >> "$dir/ranks-started"
[ "${FINISH:-0}" = 1 ] && exit 0
[ "${CRASH:-0}" = 1 ] && exit 1
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
    job = load_job("hep", [f'run.runs_dir="{tmp_path / "runs"}"', "run.backend=slurm", "run.nodes=2",
                           "run.group_size=1", *overrides])
    with create_run(job, "slurm") as (_, run):
        pass
    run.group_dir(0).mkdir(parents=True, exist_ok=True)
    run.group_dir(1).mkdir(parents=True, exist_ok=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    dry = SlurmScheduler().submit_dryrun(SubmitRequest(job, run, sys.executable, {}))
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RUN_DIR": str(run.root), "SLURM_JOB_ID": "41",
           "SLURM_ARRAY_JOB_ID": "41", "SLURM_ARRAY_TASK_ID": "0", "SLURM_JOB_NODELIST": "localhost",
           "HOME": os.environ.get("HOME", "/root")}
    scripts = {}
    for name, text in dry.files.items():
        path = tmp_path / Path(name).name
        path.write_text(text)
        scripts[Path(name).stem] = str(path)
    return run, scripts, env


def start(script: str, env: dict[str, str], **extra: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", script], env={**env, **extra}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)


def scontrol_calls(run: RunDir) -> list[str]:
    path = run.root / "scontrol.calls"
    return path.read_text().splitlines() if path.exists() else []


def life(run: RunDir, group: int = 0) -> dict:
    return json.loads(run.life_file(group).read_text())


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_the_configured_signal_checkpoints_and_requeues(tmp_path, sig):
    run, scripts, env = render(tmp_path, f"slurm.signal={sig}")
    assert f"#SBATCH --signal=B:{sig}@120" in Path(scripts["group"]).read_text()
    proc = start(scripts["group"], env)
    wait_for(run.group_dir(0) / "ranks-started")
    proc.send_signal(getattr(signal, f"SIG{sig}"))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "checkpointed; requeueing 41_0" in out and "CANCELLED DUE TO JOB REQUEUE" in out
    assert scontrol_calls(run) == ["requeue 41_0"]
    assert not run.stop_mark(0).exists() and not run.requeue_mark(0).exists()
    assert life(run)["state"] == "requeued"


def test_a_later_element_requeues_itself_not_the_array(tmp_path):
    """For element 0, $SLURM_JOB_ID is the array's own id, and requeueing that id requeues every
    element: the element is named <array id>_<task id> whichever it is."""
    run, scripts, env = render(tmp_path)
    proc = start(scripts["group"], env, SLURM_ARRAY_TASK_ID="1", SLURM_JOB_ID="43")
    wait_for(run.group_dir(1) / "ranks-started")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and scontrol_calls(run) == ["requeue 41_1"], out


def test_the_gloo_group_gets_its_rendezvous_and_the_mpi_group_none(tmp_path):
    run, scripts, env = render(tmp_path, "slurm.cpus_per_task=4")
    out, _ = start(scripts["group"], env, FINISH="1").communicate(timeout=60)
    ranks_env = (run.group_dir(0) / "srun.env").read_text()
    assert "HPCDL_RENDEZVOUS=" in ranks_env and "OMP_NUM_THREADS=" in ranks_env, out
    assert (run.group_dir(0) / "srun.args").read_text().split()[:3] == [
        "--kill-on-bad-exit=1", "--ntasks-per-node=1", "--cpus-per-task=4"]
    run, scripts, env = render(tmp_path / "mpi", "run.controller=mpi")
    proc = start(scripts["group"], env)
    wait_for(run.group_dir(0) / "ranks-started")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and scontrol_calls(run) == ["requeue 41_0"], out
    assert (run.group_dir(0) / "srun.args").read_text().split()[:3] == [
        "--kill-on-bad-exit=1", "--mpi=pmix", "--ntasks-per-node=1"]
    assert "HPCDL_RENDEZVOUS=" not in (run.group_dir(0) / "srun.env").read_text()


def test_no_requeue_after_hpcdl_cancel(tmp_path):
    run, scripts, env = render(tmp_path, "slurm.signal=TERM")
    proc = start(scripts["group"], env)
    wait_for(run.group_dir(0) / "ranks-started")
    run.cancel_mark.touch()  # what SlurmScheduler.cancel leaves before scancel
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "the run was cancelled, not requeueing" in out, out
    assert scontrol_calls(run) == []
    assert life(run)["state"] == "cancelled"


def test_a_group_that_finishes_does_not_requeue(tmp_path):
    run, scripts, env = render(tmp_path)
    proc = start(scripts["group"], env, FINISH="1")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert scontrol_calls(run) == [] and "requeueing" not in out
    assert life(run)["state"] == "finished"


@pytest.mark.parametrize("cancelled", [False, True])
def test_the_applier_requeues_on_the_configured_signal_unless_cancelled(tmp_path, cancelled):
    run, scripts, env = render(tmp_path, "slurm.signal=TERM")
    assert "#SBATCH --signal=B:TERM@120" in Path(scripts["applier"]).read_text()
    proc = start(scripts["applier"], {k: v for k, v in env.items() if not k.startswith("SLURM_ARRAY")})
    wait_for(run.applier_logs()[0] if run.applier_logs() else run.root / "exchange", 60)
    time.sleep(3.0)  # the applier is running (an earlier signal is honoured too: test_local_stops)
    if cancelled:
        run.cancel_mark.touch()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert scontrol_calls(run) == ([] if cancelled else ["requeue 41"]), out
    assert ("the run was cancelled, not requeueing" in out) == cancelled, out


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
    RestartTally(planned_requeues=5, submission_planned_requeues=5).write(run.restarts_file(0))
    proc = start(scripts["group"], env, SLURM_RESTART_COUNT="6")  # 5 planned, 1 after a failure
    wait_for(run.group_dir(0) / "ranks-started")
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and scontrol_calls(run) == ["requeue 41_0"], out
    assert RestartTally.read(run.restarts_file(0)).planned_requeues == 6
    assert life(run)["restarts"] == 1 and life(run)["restart_count"] == 6
    assert (life(run)["crash_restarts"], life(run)["planned_requeues"]) == (1, 6)


def test_a_crash_requeues_the_element_while_restarts_remain(tmp_path):
    """As the local backend restarts a crashed group, so SLURM runs the element again: the
    restart counts against run.max_restarts (SLURM's restart count, less the planned requeues)."""
    run, scripts, env = render(tmp_path, "run.max_restarts=2")
    out, _ = start(scripts["group"], env, CRASH="1", SLURM_RESTART_COUNT="1").communicate(timeout=60)
    assert scontrol_calls(run) == ["requeue 41_0"], out
    assert life(run)["restarts"] == 2 and "restart 2 of 2" in life(run)["reason"]
    assert RestartTally.read(run.restarts_file(0)).planned_requeues == 0  # a failure, not a planned requeue
    out, _ = (proc := start(scripts["group"], env, CRASH="1", SLURM_RESTART_COUNT="2")).communicate(timeout=60)
    assert proc.returncode == 1 and scontrol_calls(run) == ["requeue 41_0"], out  # no more
    assert life(run)["state"] == "failed" and "run.max_restarts = 2 allows no more" in life(run)["reason"]
    assert "run.max_restarts = 2 allows no more" in out


def test_an_element_requeued_beyond_run_max_restarts_does_not_run(tmp_path):
    """SLURM itself requeues after a node failure (--requeue): a crash restart, bounded too."""
    run, scripts, env = render(tmp_path, "run.max_restarts=2")
    proc = start(scripts["group"], env, SLURM_RESTART_COUNT="3")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "more than run.max_restarts = 2" in out, out
    assert not (run.group_dir(0) / "ranks-started").exists()
    assert life(run)["state"] == "failed"


def test_a_failed_scancel_takes_its_cancel_mark_back(monkeypatch, tmp_path):
    """Otherwise every later warning-signal requeue of the still running job would be skipped."""
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
