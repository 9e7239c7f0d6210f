"""The local backend under faults, with real processes: a full runs directory, the supervisor
killed -9, the applier killed with its durable state damaged or lost, a full disk across the end
of training. Nothing is lost or half-written, and status tells what happened."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.conftest import hpcdl, set_args, tiny_overrides, wait_for


def status_json(run_dir, cwd):
    return json.loads(hpcdl("status", str(run_dir), "--json", cwd=cwd).stdout)


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] != "Z"


def stop_leftovers(run_dir):
    import signal

    try:
        state = json.loads((run_dir / "scheduler/local.json").read_text())
    except (OSError, ValueError):
        return
    pids = [state.get("supervisor_pid"), (state.get("applier") or {}).get("pid")]
    pids += [p for g in state["groups"].values() for p in g["pids"]]
    for pid in pids:
        if pid and alive(pid) and str(run_dir.name).encode() in open(f"/proc/{pid}/cmdline", "rb").read():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def tiny_runs_fs(tmp_path):
    from tests.helpers.full_disk import small_fs

    fs = small_fs(tmp_path / "runs", 48 << 10)
    if fs is None:
        pytest.skip("cannot mount a tmpfs here (not root, or no permission)")
    yield fs
    import subprocess

    subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def test_a_full_runs_directory_does_not_end_the_run(hep_files, tmp_path, tiny_runs_fs):
    """The supervisor cannot write scheduler/local.json on a full disk: it records the problem
    in scheduler/storage.json (reserved at submit) and goes on watching; the run goes on."""
    from hpcdl.fs.storage import read_report
    from tests.helpers.full_disk import fill

    runs = tiny_runs_fs
    (runs / "filler").touch()  # its inode exists before the disk fills up
    out = json.loads(hpcdl("submit", "hep", "--detach", "--json",
                           *set_args(tiny_overrides(hep_files, runs, steps=100000)), cwd=tmp_path).stdout)
    run_dir, supervisor = runs / out["run_id"], out["supervisor_pid"]
    report = run_dir / "scheduler" / "storage.json"
    try:
        wait_for(lambda: status_json(run_dir, tmp_path)["groups"][0]["step"] > 0, 180, "training")
        filler = fill(runs)
        problem = wait_for(lambda: (read_report(report) or {}).get("problems", {}).get("supervisor state"),
                           30, "the supervisor to record that it cannot write")
        assert "No space left on device" in problem["error"]
        time.sleep(3)  # several rounds of watching on the full disk
        assert alive(supervisor)
        full = status_json(run_dir, tmp_path)
        assert full["state"] == "running"
        assert ("supervisor", "supervisor state") in {(w["where"], w["what"]) for w in full["storage"]}
        filler.unlink()
        wait_for(lambda: "supervisor state" in (read_report(report) or {}).get("recovered", {}), 30,
                 "the supervisor's next report after space came back")
        step = status_json(run_dir, tmp_path)["groups"][0]["step"]
        wait_for(lambda: status_json(run_dir, tmp_path)["groups"][0]["step"] > step, 120, "training to go on")
        assert alive(supervisor)
        assert "SIGTERM" in hpcdl("cancel", str(run_dir), cwd=tmp_path).stdout
        wait_for(lambda: status_json(run_dir, tmp_path)["state"] == "cancelled", 60, "the cancel")
        assert "Traceback" not in (run_dir / "scheduler" / "supervisor.log").read_text()
    finally:
        stop_leftovers(run_dir)


def test_status_after_the_supervisor_is_killed(hep_files, tmp_path):
    """kill -9 of the supervisor: its last local.json says the applier runs; status asks the
    system, like it does for the groups, and shows the applier stopped."""
    import signal

    runs = tmp_path / "runs"
    out = json.loads(hpcdl("submit", "hep", "--detach", "--json", "--nodes", "2", "--group-size", "1",
                           *set_args(tiny_overrides(hep_files, runs, steps=100000)), cwd=tmp_path).stdout)
    run_dir, supervisor = runs / out["run_id"], out["supervisor_pid"]
    try:
        wait_for(lambda: (s := status_json(run_dir, tmp_path))["state"] == "running"
                 and (s["applier"]["backend"] or {}).get("running"), 120, "the applier to run")
        applier_pid = json.loads((run_dir / "scheduler/local.json").read_text())["applier"]["pid"]
        os.kill(supervisor, signal.SIGKILL)
        wait_for(lambda: not alive(applier_pid), 60, "the applier to stop with its supervisor")
        assert json.loads((run_dir / "scheduler/local.json").read_text())["applier"]["running"] is True  # stale
        status = status_json(run_dir, tmp_path)
        assert [g["state"] for g in status["groups"]] == ["lost", "lost"]
        assert status["applier"]["backend"]["running"] is False
        assert status["state"] == "failed" and "supervisor is gone" in status["note"]
        text = hpcdl("status", str(run_dir), cwd=tmp_path).stdout
        assert "stopped" in text and "running" not in text.replace("lost", "")
        said = hpcdl("cancel", str(run_dir), cwd=tmp_path).stdout
        assert "nothing to cancel" in said
    finally:
        stop_leftovers(run_dir)


def _hold_supervisor_and_kill_applier(run_dir, supervisor, damage):
    """The applier killed -9 while its supervisor is held, its state damaged, the supervisor let
    go: it starts the applier again on what is left."""
    import signal

    applier = json.loads((run_dir / "scheduler/local.json").read_text())["applier"]["pid"]
    os.kill(supervisor, signal.SIGSTOP)
    try:
        os.kill(applier, signal.SIGKILL)
        wait_for(lambda: not alive(applier), 30, "the applier to die")
        damage(run_dir / "exchange" / "applier")
    finally:
        os.kill(supervisor, signal.SIGCONT)


def test_a_damaged_applier_state_is_recovered_then_a_lost_one_fails_the_run(hep_files, tmp_path):
    """First the newest state is damaged: the restarted applier recovers from the one before and
    says so; then both are: it ends failed with one line, status says it, submit exits non-zero."""
    import subprocess

    from tests.applier.test_damaged_state import flip_region, truncate
    from tests.conftest import HPCDL

    runs = tmp_path / "runs"
    submit = subprocess.Popen([HPCDL, "submit", "hep", "--json", "--nodes", "2", "--group-size", "1",
                               *set_args(tiny_overrides(hep_files, runs, steps=400) + ["exchange.reply_timeout_s=2"])],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = None
    try:
        run_dir = wait_for(lambda: next(iter(runs.glob("*/scheduler/local.json")), None), 120, "the run").parent.parent
        applier_dir = run_dir / "exchange" / "applier"
        supervisor = json.loads((run_dir / "scheduler/local.json").read_text())["supervisor_pid"]
        wait_for(lambda: (status_json(run_dir, tmp_path)["applier"]["version"] or 0) > 20
                 and (applier_dir / "state.hx.1").exists(), 120, "two committed applier states")
        _hold_supervisor_and_kill_applier(run_dir, supervisor, lambda d: flip_region(d / "state.hx"))
        recovered = wait_for(lambda: status_json(run_dir, tmp_path)["applier"]["recovered"], 60, "the recovery")
        assert "state.hx is damaged" in recovered and "recovered from state.hx.1" in recovered
        assert "recovered" in hpcdl("status", str(run_dir), cwd=tmp_path).stdout
        version = status_json(run_dir, tmp_path)["applier"]["version"]
        wait_for(lambda: (status_json(run_dir, tmp_path)["applier"]["version"] or 0) > version + 4, 60,
                 "the recovered applier to apply")

        def lose_both(d):
            if (d / "state.hx").exists():  # a kill between the commit's two renames leaves state.hx.1 alone
                truncate(d / "state.hx")
            flip_region(d / "state.hx.1")

        _hold_supervisor_and_kill_applier(run_dir, supervisor, lose_both)
        out, err = submit.communicate(timeout=240)
        assert submit.returncode != 0, out + err
        status = status_json(run_dir, tmp_path)
        assert [g["state"] for g in status["groups"]] == ["finished", "finished"]
        assert status["state"] == "failed" and status["applier"]["phase"] == "failed"
        error = status["applier"]["error"]
        assert "no usable applier state" in error and "\n" not in error
        text = hpcdl("status", str(run_dir), cwd=tmp_path).stdout
        assert "applier failed" in text and "no usable applier state" in text
        log = (run_dir / "applier.log").read_text()
        assert "Traceback" not in log and log.count("hpcdl applier: error: no usable applier state") == 1
        applied = [(e["group"], e["seq"]) for e in map(json.loads, (applier_dir / "events.jsonl").read_text().splitlines())
                   if e["event"] == "applied"]
        assert len(applied) == len(set(applied)), "no update applied twice"
    finally:
        if submit.poll() is None:
            submit.kill()
        if run_dir is not None:
            stop_leftovers(run_dir)


def test_a_full_disk_across_the_end_of_training_loses_nothing(hep_files, tmp_path, tiny_runs_fs):
    """The runs directory fills just before the last step and has room again a few seconds
    later: each group's final checkpoint, held updates and state are written once there is
    room, nothing is dropped, status shows the real steps, and the run ends at once."""
    import subprocess

    from hpcdl.fs.files import read_jsonl
    from hpcdl.fs.storage import recorded_checkpoint
    from tests.conftest import HPCDL
    from tests.helpers.full_disk import fill

    runs, steps = tiny_runs_fs, 300
    (runs / "filler").touch()  # its inode exists before the disk fills up
    submit = subprocess.Popen([HPCDL, "submit", "hep", "--json", "--nodes", "2", "--group-size", "1",
                               *set_args(tiny_overrides(hep_files, runs, steps=steps)
                                         + ["exchange.reply_timeout_s=2", "train.validate_every=0"])],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = None
    try:
        run_dir = wait_for(lambda: next(iter(runs.glob("hep-*/scheduler/local.json")), None), 120, "the run").parent.parent

        def step(g):
            return max((m.get("step", 0) for m in read_jsonl(run_dir / "groups" / str(g) / "metrics.jsonl")), default=0)

        wait_for(lambda: min(step(0), step(1)) >= steps - 15, 180, "the last steps", poll=0.05)
        filler = fill(runs)
        time.sleep(4)
        filler.unlink()
        out, err = submit.communicate(timeout=120)
        ended = time.time()
        assert submit.returncode == 0, out + err
        status = status_json(run_dir, tmp_path)
        assert [(g["state"], g["step"]) for g in status["groups"]] == [("finished", steps)] * 2
        published, last_end = 0, 0.0
        for g in range(2):
            state = run_dir / "groups" / str(g) / "state.json"
            assert recorded_checkpoint(run_dir / "checkpoints" / str(g)) == f"ckpt-{steps}"
            final = json.loads(state.read_text())
            assert final["exchange_unpublished"] == 0 and final["exchange_unpublished_dropped"] == 0
            assert final["exchange_backlog_dropped"] == 0
            published += final["exchange_published"]
            last_end = max(last_end, state.stat().st_mtime)
        assert ended - last_end < 90, "the run ends once its groups have (not after the applier's drain bound)"
        applier = status["applier"]
        assert applier["backlog"] == 0 and applier["applied"] + applier["dropped"] == published
    finally:
        if submit.poll() is None:
            submit.kill()
        if run_dir is not None:
            stop_leftovers(run_dir)
