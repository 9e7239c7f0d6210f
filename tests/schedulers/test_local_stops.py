"""Clean stops on the local backend: Ctrl-C and SIGTERM make the ranks
checkpoint at the step where they stop, like SLURM's warning signal; at the end of a run the
applier applies what is pending before it stops."""

from __future__ import annotations

import json
import os
import sys
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpcdl.jobfile import load_job
from hpcdl.rundir.runs import create_run
from hpcdl.fs.files import read_jsonl
from hpcdl.schedulers.local import Supervisor
from tests.conftest import HPCDL, set_args, tiny_overrides, wait_for


def checkpoints(run_dir: Path) -> list[int]:
    return sorted(int(p.name[len("ckpt-"):-len(".index")]) for p in (run_dir / "checkpoints/0").glob("ckpt-*.index"))


def assert_stopped_at_a_checkpoint(run_dir: Path):
    state = json.loads((run_dir / "groups/0/state.json").read_text())
    assert state["state"] == "stopped", state
    # checkpoint_every is 10: a checkpoint at a step that is not a multiple of it was the stop's
    assert checkpoints(run_dir)[-1] == state["step"], (checkpoints(run_dir), state["step"])
    for log in (run_dir / "groups/0").glob("rank*.log"):
        text = log.read_text()
        assert "KeyboardInterrupt" not in text and "Traceback" not in text, text[-3000:]


def interrupt_a_foreground_submit(hep_files, tmp_path, interrupt, *options: str) -> tuple[int, str, Path]:
    """Start `hpcdl submit` in the foreground (a session of its own, as a terminal would hold
    it), let it train a few steps, `interrupt(pid)`, wait for it: its exit status, its stderr,
    the run's directory."""
    runs = tmp_path / "runs"
    overrides = tiny_overrides(hep_files, runs, steps=100000) + ["train.checkpoint_every=1000"]
    # A terminal's foreground process takes SIGINT; a suite started in the background of a shell
    # without job control inherits it ignored, and so would this submit.
    proc = subprocess.Popen([HPCDL, "submit", "hep", *options, *set_args(overrides)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics = lambda: [p for p in runs.glob("*/groups/0/metrics.jsonl")]  # noqa: E731
        wait_for(lambda: metrics() and len(read_jsonl(metrics()[0])) >= 2, 240, "training")
        interrupt(proc.pid)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err, metrics()[0].parent.parent.parent


def status_json(run_dir: Path) -> dict:
    return json.loads(subprocess.run([HPCDL, "status", str(run_dir), "--json"], capture_output=True,
                                     text=True, check=True).stdout)


def test_ctrl_c_on_a_foreground_run_checkpoints_at_the_stop(hep_files, tmp_path):
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the CLI's
    supervisor and every rank."""
    code, err, run_dir = interrupt_a_foreground_submit(hep_files, tmp_path, lambda pid: os.killpg(pid, signal.SIGINT),
                                                       "--nodes", "2", "--json")
    assert code == 1 and "Traceback" not in err, err  # the run did not finish
    assert_stopped_at_a_checkpoint(run_dir)
    assert checkpoints(run_dir)[-1] % 1000 != 0
    status = status_json(run_dir)
    assert status["state"] == "cancelled" and status["groups"][0]["state"] == "cancelled"


def test_sigint_to_the_submit_process_alone_cancels_the_run(hep_files, tmp_path):
    """`kill -INT` of the foreground `hpcdl submit` (not its process group, so neither the
    supervisor nor a rank has it): the run stops at a checkpoint as at Ctrl-C, and submit says
    why and exits 1."""
    code, err, run_dir = interrupt_a_foreground_submit(hep_files, tmp_path, lambda pid: os.kill(pid, signal.SIGINT))
    assert code == 1 and "Traceback" not in err, err
    assert "the run did not finish: cancelled" in err and "group 0 cancelled: cancelled at step" in err, err
    assert_stopped_at_a_checkpoint(run_dir)
    status = status_json(run_dir)
    assert status["state"] == "cancelled" and not status["underway"]


def test_sigterm_to_the_ranks_checkpoints_at_the_stop(hep_files, tmp_path):
    runs = tmp_path / "runs"
    overrides = tiny_overrides(hep_files, runs, steps=100000) + ["train.checkpoint_every=1000"]
    out = json.loads(subprocess.run([HPCDL, "submit", "hep", "--detach", "--json", *set_args(overrides)],
                                    cwd=tmp_path, capture_output=True, text=True, check=True).stdout)
    run_dir = runs / out["run_id"]
    try:
        wait_for(lambda: len(read_jsonl(run_dir / "groups/0/metrics.jsonl")) >= 2, 240, "training")
        pids = json.loads((run_dir / "scheduler/local.json").read_text())["groups"]["0"]["pids"]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        local = lambda: json.loads((run_dir / "scheduler/local.json").read_text())  # noqa: E731
        wait_for(lambda: local()["groups"]["0"]["state"] != "running", 120, "the group to stop")
        assert local()["groups"]["0"]["state"] == "cancelled"  # stopped on a signal, not finished
        assert_stopped_at_a_checkpoint(run_dir)
    finally:
        subprocess.run([HPCDL, "cancel", str(run_dir)], capture_output=True)


# -- the supervisor lets the applier drain ------------------------------------------------------
FAKE_PYTHON = """#!/bin/bash
# stands in for `python -m hpcdl.process.worker RUN [--applier]`
run="$3"
if [ "$4" = --applier ]; then
  trap 'echo terminated > "$run/applier.end"; exit 0' TERM
  for _ in $(seq 30); do sleep 0.1; done   # 3 s of updates still to apply
  echo drained > "$run/applier.end"
  exit 0
fi
trap 'exit 0' TERM
[ -e "$run/ranks-run-long" ] && { for _ in $(seq 600); do sleep 0.1; done; }
exit 0
"""


@pytest.fixture
def hybrid_run(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path / "runs"}"', "run.nodes=2", "run.group_size=1"])
    with create_run(job, "local") as (_, run):
        pass
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return run, str(fake)


def test_at_the_end_of_a_run_the_applier_drains_before_it_stops(hybrid_run):
    run, fake = hybrid_run
    supervisor = Supervisor(run, python=fake)
    assert supervisor.run_until_done(interval=0.1) is True
    assert (run.root / "applier.end").read_text() == "drained\n"
    assert not json.loads((run.root / "scheduler/local.json").read_text())["applier"]["running"]


def test_a_cancelled_run_stops_the_applier_at_once(hybrid_run):
    run, fake = hybrid_run
    (run.root / "ranks-run-long").touch()
    supervisor = Supervisor(run, python=fake)
    threading.Timer(1.5, lambda: setattr(supervisor, "stopping", True)).start()
    started = time.monotonic()
    assert supervisor.run_until_done(interval=0.1) is False
    assert (run.root / "applier.end").read_text() == "terminated\n"
    assert time.monotonic() - started < 30
    groups = json.loads((run.root / "scheduler/local.json").read_text())["groups"]
    assert [g["state"] for g in groups.values()] == ["cancelled", "cancelled"]


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 0), (signal.SIGUSR1, 75)])
def test_a_stop_signal_while_the_applier_starts_is_not_lost(hybrid_run, signum, code):
    """The worker's first handler only records a signal; the applier, once built, must honour it
    (the supervisor killed -9 while its applier was still loading left it running for ever)."""
    run, _ = hybrid_run
    script = ("import sys; from hpcdl.rundir.runs import RunDir; from hpcdl.process.worker import serve_applier; from pathlib import Path; "
              f"run = RunDir(Path(sys.argv[1])); sys.exit(serve_applier(run, run.load_job(), early_signal=lambda: {int(signum)}))")
    done = subprocess.run([sys.executable, "-c", script, str(run.root)], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]


def test_the_applier_ends_once_the_supervisor_saw_every_group_end(hybrid_run):
    """Groups that could not write their final state (a full disk) never say "finished": the
    supervisor's mark that every group has ended lets the applier end once its backlog is empty,
    instead of waiting out the drain bound."""
    run, _ = hybrid_run
    run.groups_ended_mark.parent.mkdir(parents=True, exist_ok=True)
    run.groups_ended_mark.touch()
    script = ("import sys; from hpcdl.rundir.runs import RunDir; from hpcdl.process.worker import serve_applier; from pathlib import Path; "
              "run = RunDir(Path(sys.argv[1])); sys.exit(serve_applier(run, run.load_job()))")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script, str(run.root)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert time.monotonic() - started < 60
