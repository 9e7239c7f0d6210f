"""Faults met while operating runs: malformed files, control characters,
run-id collisions, unwritable output directories, ended groups in status. Each bad input is one
line naming the problem and exit 2, with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcdl.cli import main
from hpcdl.jobfile import JOBS_DIR, load_job
from hpcdl.errors import JobError
from hpcdl.runs import RunDir, RunIdTaken, create_run, write_json_atomic
from hpcdl.files import append_jsonl
from hpcdl.schedulers.base import DryRun, Scheduler
from hpcdl.status import collect
from hpcdl.submit import Prepared, prepare, submit_run
from tests.conftest import hpcdl, set_args, tiny_overrides, wait_for

TRUNCATED = b'{"run_id": "hep-1", "backend": "lo'
BINARY = b"\x00\x9c\xff\xfeELF\x01\x02\x80garbage"


def one_error_line(result, fragment):
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert "Traceback" not in result.output
    return errors[0]


@pytest.fixture
def run(tmp_path) -> RunDir:
    job = load_job("hep", [f'run.runs_dir="{tmp_path / "runs"}"'])
    with create_run(job, "local") as (_, final):
        pass
    return final


READERS = [("status", "run.json"), ("status", "job.toml"), ("status", "scheduler/local.json"),
           ("cancel", "run.json"), ("cancel", "scheduler/local.json"), ("evaluate", "run.json"),
           ("evaluate", "job.toml"), ("logs", "run.json")]


@pytest.mark.parametrize("command, name", READERS)
@pytest.mark.parametrize("content", [TRUNCATED, BINARY, b""])
def test_a_malformed_run_file_is_one_line_naming_it(run, command, name, content):
    (run.root / name).write_bytes(content)
    if command == "evaluate":  # it reads the run's files once there is a checkpoint
        run.checkpoint_dir(0).mkdir(parents=True)
        (run.checkpoint_dir(0) / "manifest.json").write_text(
            json.dumps({"job": {}, "workload": "hep", "input_shape": [8, 8, 3]}))
    result = CliRunner().invoke(main, [command, str(run.root)], catch_exceptions=False)
    one_error_line(result, str(run.root / name))


def test_status_of_run_files_that_are_dev_zero(run):
    """A file read whole that never ends (a symlink to /dev/zero) is refused, not read into memory."""
    for path in (run.group_state_file(0), run.metrics_file(0)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        path.symlink_to("/dev/zero")
    status = collect(run, backend_view={})
    assert status["groups"][0].get("step") in (None, 0)
    run.info_file.unlink()
    run.info_file.symlink_to("/dev/zero")
    result = CliRunner().invoke(main, ["status", str(run.root)], catch_exceptions=False)
    one_error_line(result, "run.json")  # not a run: its run.json is no file


def test_a_damaged_stats_file_is_computed_again(hep_files, tmp_path):
    from hpcdl.workloads import get_workload
    from hpcdl.worker import ensure_stats

    job = load_job("hep", tiny_overrides(hep_files, tmp_path / "runs"))
    with create_run(job, "local") as (_, final):
        pass
    workload = get_workload("hep")
    final.stats_file.write_bytes(BINARY)
    stats = ensure_stats(final, workload, job, is_root=True)
    assert stats == json.loads(json.dumps(workload.compute_stats(job)))
    assert json.loads(final.stats_file.read_text()) == stats


def test_submit_refuses_a_validation_file_it_cannot_use(hep_files, tmp_path):
    runs = tmp_path / "runs"
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(BINARY)
    small = tmp_path / "small.h5"
    from tests.conftest import write_nersc

    write_nersc(small, 32, size=8)
    for val, fragment in ((tmp_path / "none.h5", "no such file"), (garbage, "garbage.h5"),
                          (small, "images are (8, 8, 3), data.train's (16, 16, 3)")):
        result = CliRunner().invoke(main, ["submit", "hep", *set_args(tiny_overrides(hep_files, runs)),
                                           "--set", f'data.val="{val}"', "--dry-run"], catch_exceptions=False)
        assert "data.val" in one_error_line(result, fragment)
    result = CliRunner().invoke(main, ["submit", "hep", *set_args(tiny_overrides(hep_files, runs)), "--set",
                                       f'data.val="{tmp_path / "none.h5"}"', "--set", "train.validate_every=0",
                                       "--dry-run"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert not runs.exists()


def test_submit_refuses_an_exchange_directory_that_is_a_file(hep_files, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    result = CliRunner().invoke(main, ["submit", "hep", *set_args(tiny_overrides(hep_files, tmp_path / "runs")),
                                       "--nodes", "2", "--group-size", "1", "--set",
                                       f'exchange.directory="{notes}"', "--dry-run"], catch_exceptions=False)
    one_error_line(result, "is not a directory")
    assert notes.read_text() == "mine"


def test_a_malformed_run_json_under_a_bare_status(run):
    run.info_file.write_bytes(BINARY)
    result = CliRunner().invoke(main, ["status", "--runs-dir", str(run.root.parent)], catch_exceptions=False)
    assert "run.json" in one_error_line(result, str(run.info_file))


def test_garbled_state_and_metrics_do_not_break_status(run):
    """Files the ranks keep rewriting: a garbled one reads as missing, the next version will do."""
    run.group_state_file(0).write_bytes(BINARY)
    append_jsonl(run.metrics_file(0), {"step": 5, "loss": 0.5, "time": time.time()})
    with open(run.metrics_file(0), "ab") as f:
        f.write(BINARY + b"\n[1, 2]\n")
    status = collect(run, backend_view={})
    assert status["groups"][0]["step"] == 5 and status["groups"][0]["loss"] == 0.5


@pytest.mark.parametrize("content", [TRUNCATED, BINARY])
def test_a_malformed_checkpoint_manifest_is_one_line(tmp_path, content):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_bytes(content)
    (ckpt / "ckpt-10.index").write_bytes(b"")
    for target in (ckpt, ckpt / "ckpt-10"):
        result = CliRunner().invoke(main, ["evaluate", str(target)], catch_exceptions=False)
        one_error_line(result, str(ckpt / "manifest.json"))


@pytest.mark.parametrize("content", [b'name = "x"\nworkload = ', BINARY])
def test_a_malformed_job_file_is_one_line(tmp_path, content):
    job = tmp_path / "broken.toml"
    job.write_bytes(content)
    result = CliRunner().invoke(main, ["submit", str(job), "--runs-dir", str(tmp_path / "runs")],
                                catch_exceptions=False)
    one_error_line(result, str(job))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("content", [b'{"node_flops": 1e12'])
def test_malformed_planner_inputs_are_one_line(tmp_path, content):
    inputs = tmp_path / "inputs.json"
    inputs.write_bytes(content)
    result = CliRunner().invoke(main, ["plan", "hep", "--nodes", "8", "--inputs", str(inputs)],
                                catch_exceptions=False)
    assert str(inputs) in one_error_line(result, str(inputs))


@pytest.mark.parametrize("override, field", [
    ('run.runs_dir="runs\\nx"', "run.runs_dir"),
    ('run.runs_dir="runs\\u001b[2Jx"', "run.runs_dir"),
    ('exchange.directory="/scratch/x\\ny"', "exchange.directory"),
    ('exchange.directory="/scratch/x\\ty"', "exchange.directory"),
])
def test_control_characters_in_paths_are_refused(tmp_path, override, field):
    with pytest.raises(JobError, match=f"{field} .* contains control characters"):
        load_job("hep", [override])
    result = CliRunner().invoke(main, ["submit", "hep", "--backend", "slurm", "--dry-run", "--set", override],
                                catch_exceptions=False, env={"PATH": "/nonexistent"})
    one_error_line(result, field)


def test_control_characters_in_the_job_name_are_refused(tmp_path, hep_files):
    job = tmp_path / "bad\nname.toml"
    shutil.copy(JOBS_DIR / "hep.toml", job)
    runs = tmp_path / "runs"
    result = CliRunner().invoke(main, ["submit", str(job), *set_args(tiny_overrides(hep_files, runs)),
                                       "--backend", "slurm", "--dry-run"], catch_exceptions=False)
    one_error_line(result, "contains control characters")
    named = tmp_path / "named.toml"
    named.write_text((JOBS_DIR / "hep.toml").read_text().replace('workload = "hep"', 'workload = "hep"\nname = "a\\rb"'))
    result = CliRunner().invoke(main, ["submit", str(named), *set_args(tiny_overrides(hep_files, runs))],
                                catch_exceptions=False)
    one_error_line(result, "contains control characters")
    assert not runs.exists()


@pytest.mark.parametrize("out", ["/proc/x", "/proc/self/nonexistent/deeper"])
def test_data_generate_into_a_directory_that_cannot_be_made(out):
    result = CliRunner().invoke(main, ["data", "generate", "hep", "--out", out, "--events", "10"],
                                catch_exceptions=False)
    assert out in one_error_line(result, out)


def test_data_generate_into_a_read_only_directory(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    result = CliRunner().invoke(main, ["data", "generate", "hep", "--out", str(ro), "--events", "10"],
                                catch_exceptions=False)
    one_error_line(result, str(ro))
    assert list(ro.iterdir()) == []


def test_data_generate_keeps_a_set_unless_forced(tmp_path):
    out = tmp_path / "hep"
    args = ["data", "generate", "hep", "--out", str(out), "--events", "20", "--image-size", "8"]
    assert CliRunner().invoke(main, args, catch_exceptions=False).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    one_error_line(CliRunner().invoke(main, args + ["--seed", "1"], catch_exceptions=False), "--force")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert CliRunner().invoke(main, args + ["--seed", "1", "--force"], catch_exceptions=False).exit_code == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} != before


def test_data_generate_on_a_full_disk_is_one_line_and_keeps_the_old_set(tiny_fs):
    fs = tiny_fs("full", 2048)
    out = fs / "hep"
    small = ["data", "generate", "hep", "--out", str(out), "--events", "20", "--image-size", "8"]
    assert CliRunner().invoke(main, small, catch_exceptions=False).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # 400 events of 64² do not fit in 2 MiB: HDF5 fails its writes, and its process crashes
    result = CliRunner().invoke(main, ["data", "generate", "hep", "--out", str(out), "--events", "400",
                                       "--image-size", "64", "--force"], catch_exceptions=False)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], result.output
    assert "Traceback" not in result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # whole, and no temporary


# -- run ids ---------------------------------------------------------------------------------------
def test_create_run_refuses_an_existing_run_id(run):
    job = run.load_job()
    before = sorted(p.name for p in run.root.parent.iterdir())
    with pytest.raises(RunIdTaken):
        with create_run(job, "local", run_id=run.run_id):
            pass
    assert sorted(p.name for p in run.root.parent.iterdir()) == before  # no staging left behind
    assert json.loads(run.info_file.read_text())["run_id"] == run.run_id


class Recording(Scheduler):
    """Renders one file naming the run's directory; schedule records what it was given."""

    name = "recording"

    def __init__(self):
        self.scheduled = []

    def submit_dryrun(self, request):
        return DryRun(self.name, {"scheduler/where": f"{request.run.root}\n"}, [], request)

    def schedule(self, dryrun, **_):
        self.scheduled.append(dryrun)
        return {}

    def describe(self, run):
        return {}

    def cancel(self, run):
        return ""

    def is_active(self, run):
        return False


def test_a_run_id_collision_is_retried_with_a_new_id(tmp_path, hep_files, monkeypatch):
    import hpcdl.submit as submit

    runs = tmp_path / "runs"
    prepared = prepare("hep", tiny_overrides(hep_files, runs), cluster={})
    scheduler = Recording()
    taken = prepared.dryrun.request.run
    first = Prepared(prepared.job, prepared.run, scheduler, scheduler.submit_dryrun(prepared.dryrun.request))
    taken.root.mkdir(parents=True)
    (taken.root / "someone-else's").write_text("x")
    ids = iter([taken.run_id, "hep-20260101-000000-0001"])  # the first retry collides again
    monkeypatch.setattr(submit, "new_run_id", lambda job: next(ids))
    result = submit_run(first)
    assert result["run_id"] == "hep-20260101-000000-0001"
    final = Path(result["run_dir"])
    assert (final / "scheduler/where").read_text() == f"{final}\n"  # rendered for the new id
    assert json.loads((final / "run.json").read_text())["run_id"] == final.name
    assert scheduler.scheduled[-1].request.run.root == final
    assert sorted(p.name for p in runs.iterdir()) == sorted([taken.run_id, final.name])
    assert (taken.root / "someone-else's").read_text() == "x"


# -- status of ended groups ------------------------------------------------------------------------
@pytest.mark.parametrize("state, frozen", [("finished", True), ("cancelled", True), ("failed", True),
                                           ("running", False)])
def test_exchange_age_stops_at_the_end_of_a_group(run, state, frozen):
    now = time.time()
    append_jsonl(run.metrics_file(0), {"step": 10, "time": now - 100, "exchange_last_s": now - 130})
    write_json_atomic(run.group_state_file(0), {"state": "finished" if state == "finished" else "running"})
    view = {"groups": {"0": {"state": state}}}
    first = collect(run, backend_view=view)["groups"][0]["exchange_age_s"]
    time.sleep(1.1)
    second = collect(run, backend_view=view)["groups"][0]["exchange_age_s"]
    if frozen:
        assert first == pytest.approx(30, abs=0.01) and second == pytest.approx(30, abs=0.01)
    else:
        assert first >= 130 and second >= first + 1


# -- real processes on the local backend -------------------------------------------------------------


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
    from hpcdl.storage import read_report
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


def test_the_applier_takes_a_garbled_group_state_for_not_finished(tmp_path):
    from hpcdl.runs import RunDir
    from hpcdl.lifecycle import groups_finished

    run = RunDir(tmp_path)
    for g, content in enumerate([b'{"state": "finished"}', b"\xff\xfe\x00binary", b"[1, 2]"]):
        run.group_state_file(g).parent.mkdir(parents=True)
        run.group_state_file(g).write_bytes(content)
    assert groups_finished(run, 1)
    assert not groups_finished(run, 2) and not groups_finished(run, 3)


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

    from hpcdl.files import read_jsonl
    from hpcdl.storage import recorded_checkpoint
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



def test_a_run_is_watched_and_cancelled_where_its_workload_is_not_installed(run):
    """status and cancel read the run's files only; evaluate, which runs the model, says what is missing."""
    run.job_file.write_text(run.job_file.read_text().replace('workload = "hep"', 'workload = "gone"'))
    for command in ("status", "cancel"):
        result = CliRunner().invoke(main, [command, str(run.root)], catch_exceptions=False)
        assert result.exit_code == 0, (command, result.output)
    assert "gone" in CliRunner().invoke(main, ["status", str(run.root), "--json"]).output
    one_error_line(CliRunner().invoke(main, ["evaluate", str(run.root)], catch_exceptions=False),
                   "unknown workload 'gone'")
