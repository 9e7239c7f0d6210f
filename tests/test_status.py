"""hpcdl.commands.status on recorded run files: a group's state in hpcdl's words with SLURM's beside it,
the run's state from every group's, why a group did not finish, restarts by kind, and the table."""

from __future__ import annotations

import io
import itertools
import json
import time

import pytest
from click.testing import CliRunner
from rich.console import Console

from hpcdl.cli import main
from hpcdl.commands.display import status_view
from hpcdl.fs.files import append_jsonl
from hpcdl.jobfile import load_job
from hpcdl.process.lifecycle import RestartTally
from hpcdl.rundir.runs import RunDir, State, create_run
from hpcdl.fs.files import atomic_write_json
from hpcdl.schedulers.slurm import parse_sacct
from hpcdl.commands.status import collect, group_state_of, run_state
from tests.conftest import BINARY, one_error_line

# The run's state for a pair of group states, the most telling first (run_state's docstring).
PRECEDENCE = [
    ({State.FAILED, State.LOST, State.TIMEOUT}, State.FAILED),
    ({State.PENDING, State.RUNNING, State.REQUEUED, State.SUSPENDED, State.PREEMPTED}, State.RUNNING),
    ({State.CANCELLED}, State.CANCELLED),
    ({State.STOPPED}, State.STOPPED),
    ({State.COMPLETED}, State.COMPLETED),
    ({State.UNKNOWN}, State.UNKNOWN),
]


def expected_run_state(pair: tuple[State, State]) -> State:
    for states, run in PRECEDENCE:
        if states & set(pair):
            return run
    raise AssertionError(f"no rule for {pair}")


@pytest.mark.parametrize("pair", list(itertools.combinations([s for s in State if s != State.ENDING], 2)),
                         ids=lambda p: "+".join(p))
def test_a_run_whose_groups_disagree_takes_the_most_telling_state_never_finished(pair):
    for states in (list(pair), list(reversed(pair))):  # whichever group comes first
        assert run_state(states) == expected_run_state(pair)
        assert run_state(states) != State.FINISHED


def test_finished_only_when_every_group_finished_and_pending_only_when_none_started():
    assert run_state([State.FINISHED] * 3) == State.FINISHED
    assert run_state([State.PENDING, State.PENDING]) == State.PENDING
    assert run_state([State.FINISHED, State.FINISHED, State.CANCELLED]) == State.CANCELLED
    assert run_state([]) == State.UNKNOWN


@pytest.mark.parametrize("training, life, backend, expected", [
    ("finished", "running", "running", State.FINISHED),  # the final checkpoint is written: its ranks end
    ("stopped", "cancelled", "completed", State.CANCELLED),  # SLURM saw exit 0: hpcdl knows it was a cancel
    ("stopped", "requeued", "pending", State.REQUEUED),
    ("running", "running", "timeout", State.TIMEOUT),  # the life's record is stale: SLURM ended it
    ("running", "running", "lost", State.LOST),  # the local supervisor died
    ("running", "finished", None, State.COMPLETED),  # its ranks ended well, the training never said finished
    ("running", "failed", "failed", State.FAILED),
    ("stopped", None, None, State.STOPPED),  # no life's record (a run from before it)
    (None, None, "running", State.RUNNING),  # nothing of hpcdl's yet: SLURM's word
    (None, None, None, State.PENDING),
])
def test_a_groups_state_is_hpcdls_own_word(training, life, backend, expected):
    assert group_state_of(training, life, backend) == expected


@pytest.fixture
def run(tmp_path) -> RunDir:
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"', "run.nodes=3", "run.group_size=1",
                           "exchange.enabled=off", "train.steps=100"])
    with create_run(job, "slurm") as (_, run):
        pass
    return run


def record_group(run: RunDir, group: int, training: str, step: int, life: dict, tally: RestartTally | None = None):
    atomic_write_json(run.group_state_file(group), {"state": training, "step": step})
    atomic_write_json(run.life_file(group), {"restarts": 0, "exit_codes": [0], "pids": [], "reason": "", **life})
    if tally is not None:
        tally.write(run.restarts_file(group))


# sacct of the run after a cancel: every element ended with exit 0 (the ranks checkpointed)
SACCT = """JobID|State|NodeList|Elapsed
41_0|COMPLETED|n1|00:05:00
41_1|COMPLETED|n2|00:03:10
41_2|FAILED|n3|00:01:00
"""


def slurm_view(sacct: str) -> dict:
    jobs = parse_sacct(sacct)
    return {"groups": {str(g): jobs[f"41_{g}"] for g in range(3)}, "applier": None}


def shown(status: dict, width: int = 160) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(status_view(status))
    return console.export_text()


def test_a_partial_run_says_each_groups_state_and_why_with_slurms_word_beside(run):
    record_group(run, 0, "finished", 100, {"state": "finished"})
    record_group(run, 1, "stopped", 40, {"state": "cancelled"})
    reason = ("group 2's ranks exited with status 1, after 1 restarts: run.max_restarts = 1 allows no more "
              "-- and a long tail so the reason is far wider than any column of the table could hold " * 2)
    record_group(run, 2, "running", 7, {"state": "failed", "reason": reason, "exit_codes": [1]},
                 RestartTally(crash_restarts=1, submission_crash_restarts=1))
    status = collect(run, backend_view=slurm_view(SACCT))
    assert status["state"] == State.FAILED and not status["underway"]
    finished, cancelled, failed = status["groups"]
    assert (finished["state"], finished["scheduler_state"], finished["why"]) == ("finished", None, "")
    assert (cancelled["state"], cancelled["scheduler_state"]) == ("cancelled", "COMPLETED")
    assert cancelled["why"] == "cancelled at step 40 of 100 (`hpcdl cancel`, Ctrl-C or a signal), checkpointed"
    assert (failed["state"], failed["scheduler_state"], failed["why"]) == ("failed", None, reason)
    assert json.loads(json.dumps(status))["groups"][1]["scheduler_state"] == "COMPLETED"

    text = shown(status)
    assert "cancelled (SLURM: COMPLETED; n2)" in text and "finished (n1)" in text
    # the long reason goes below the table; every column keeps its width
    header = next(line for line in text.splitlines() if "grp" in line)
    assert "…" not in text.split("group 1 cancelled")[0], text
    for column in ("state", "step", "loss", "img/s", "sustained", "restarts", "requeues"):
        assert column in header, header
    assert "group 1 cancelled: cancelled at step 40 of 100" in text
    assert "group 2 failed" in text and "run.max_restarts = 1 allows no more" in text


def test_restarts_are_counted_by_kind_in_status_and_table(run):
    record_group(run, 0, "running", 50, {"state": "running", "restarts": 0},
                 RestartTally(crash_restarts=1, planned_requeues=3, submission_planned_requeues=1))
    record_group(run, 1, "running", 50, {"state": "running", "restarts": 2})  # a run from before the tally
    record_group(run, 2, "running", 50, {"state": "running"})
    running = "JobID|State|NodeList|Elapsed\n41_0|RUNNING|n1|1:00\n41_1|RUNNING|n2|1:00\n41_2|RUNNING|n3|1:00\n"
    status = collect(run, backend_view=slurm_view(running))
    assert status["state"] == State.RUNNING and status["underway"]
    counts = [(g["crash_restarts"], g["planned_requeues"]) for g in status["groups"]]
    assert counts == [(1, 3), (2, 0), (0, 0)]
    row = next(line for line in shown(status).splitlines() if line.strip("│ ").startswith("0 "))
    assert [cell.strip() for cell in row.split("│")[-3:-1]] == ["1", "3"], row


def test_a_failed_group_makes_the_run_failed_while_another_still_trains(run):
    record_group(run, 0, "running", 50, {"state": "running"})
    record_group(run, 1, "running", 7, {"state": "failed", "reason": "no restart can mend it"})
    record_group(run, 2, "finished", 100, {"state": "finished"})
    status = collect(run, backend_view={"groups": {}, "applier": None})
    assert status["state"] == State.FAILED and status["underway"]  # `status --watch` goes on
    assert [g["why"] for g in status["groups"]] == ["", "no restart can mend it", ""]


@pytest.mark.parametrize("backend_applier, expected", [
    ({"running": True}, State.ENDING), ({"running": False}, State.CANCELLED),
    ({"state": State.RUNNING}, State.ENDING), ({"state": State.COMPLETED}, State.CANCELLED), (None, State.CANCELLED)])
def test_a_run_whose_groups_ended_is_ending_while_its_appliers_still_run(tmp_path, backend_applier, expected):
    """A cancelled run is not over (resume refuses it) until its appliers have drained."""
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"', "run.nodes=2", "run.group_size=1", "train.steps=100"])
    with create_run(job, "local") as (_, run):
        pass
    for g in (0, 1):
        record_group(run, g, "stopped", 40, {"state": "cancelled"})
    status = collect(run, backend_view={"groups": {}, "applier": backend_applier})
    assert status["state"] == expected and not status["underway"]


def test_a_long_failure_reason_in_the_local_supervisors_record_stays_out_of_the_table(run):
    """The local backend's view of a group is its life's record, reason included."""
    reason = "group 0's ranks exited with status 1, after 2 restarts: " + "a reason that goes on " * 12
    record_group(run, 0, "running", 7, {"state": "failed", "reason": reason, "restarts": 2})
    view = {"groups": {"0": {"state": "failed", "reason": reason, "restarts": 2, "pids": []}}, "applier": None}
    text = shown(collect(run, backend_view=view), width=120)
    table = text.split("group 0 failed")[0]
    assert "…" not in table and "a reason that goes on" not in table, text
    assert "│ failed " in table and "a reason that goes on" in text


def test_a_foreground_submit_whose_run_ended_partial_exits_1_saying_why(tmp_path, capsys):
    """Whatever the backend reported, `submit` and `resume` exit by the run's state as status
    decides it: one group cancelled is no finished run."""
    from hpcdl.cli import _start_and_report

    job = load_job("hep", [f'run.runs_dir="{tmp_path}"', "run.nodes=2", "run.group_size=1", "train.steps=100"])
    with create_run(job, "local") as (_, run):
        pass
    record_group(run, 0, "finished", 100, {"state": "finished"})
    record_group(run, 1, "stopped", 30, {"state": "cancelled"})
    ended = {"run_id": run.run_id, "run_dir": str(run.root), "supervisor_pid": 0, "ok": True}
    with pytest.raises(SystemExit) as exited:
        _start_and_report(job, lambda **_: dict(ended), detach=False, as_json=True)
    assert exited.value.code == 1
    said = json.loads(capsys.readouterr().out)
    assert said["ok"] is False and said["state"] == "cancelled"
    assert said["not_finished"] == [{"group": 1, "state": "cancelled",
                                     "why": "cancelled at step 30 of 100 (`hpcdl cancel`, Ctrl-C or a signal), checkpointed"}]
    record_group(run, 1, "finished", 100, {"state": "finished"})
    _start_and_report(job, lambda **_: dict(ended), detach=False, as_json=True)  # no exit: finished
    assert json.loads(capsys.readouterr().out)["state"] == "finished"


def test_status_of_run_files_that_are_dev_zero(local_run):
    """A file read whole that never ends (a symlink to /dev/zero) is refused, not read into memory."""
    for path in (local_run.group_state_file(0), local_run.metrics_file(0)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        path.symlink_to("/dev/zero")
    status = collect(local_run, backend_view={})
    assert status["groups"][0].get("step") in (None, 0)
    local_run.info_file.unlink()
    local_run.info_file.symlink_to("/dev/zero")
    result = CliRunner().invoke(main, ["status", str(local_run.root)], catch_exceptions=False)
    one_error_line(result, "run.json")  # not a run: its run.json is no file


def test_a_malformed_run_json_under_a_bare_status(local_run):
    local_run.info_file.write_bytes(BINARY)
    result = CliRunner().invoke(main, ["status", "--runs-dir", str(local_run.root.parent)], catch_exceptions=False)
    assert "run.json" in one_error_line(result, str(local_run.info_file))


def test_garbled_state_and_metrics_do_not_break_status(local_run):
    """Files the ranks keep rewriting: a garbled one reads as missing, the next version will do."""
    local_run.group_state_file(0).write_bytes(BINARY)
    append_jsonl(local_run.metrics_file(0), {"step": 5, "loss": 0.5, "time": time.time()})
    with open(local_run.metrics_file(0), "ab") as f:
        f.write(BINARY + b"\n[1, 2]\n")
    status = collect(local_run, backend_view={})
    assert status["groups"][0]["step"] == 5 and status["groups"][0]["loss"] == 0.5


@pytest.mark.parametrize("state, frozen", [("finished", True), ("cancelled", True), ("failed", True),
                                           ("running", False)])
def test_exchange_age_stops_at_the_end_of_a_group(local_run, state, frozen):
    now = time.time()
    append_jsonl(local_run.metrics_file(0), {"step": 10, "time": now - 100, "exchange_last_s": now - 130})
    atomic_write_json(local_run.group_state_file(0), {"state": "finished" if state == "finished" else "running"})
    view = {"groups": {"0": {"state": state}}}
    first = collect(local_run, backend_view=view)["groups"][0]["exchange_age_s"]
    time.sleep(1.1)
    second = collect(local_run, backend_view=view)["groups"][0]["exchange_age_s"]
    if frozen:
        assert first == pytest.approx(30, abs=0.01) and second == pytest.approx(30, abs=0.01)
    else:
        assert first >= 130 and second >= first + 1


def test_a_run_is_watched_and_cancelled_where_its_workload_is_not_installed(local_run):
    """status and cancel read the run's files only; evaluate, which runs the model, says what is missing."""
    local_run.job_file.write_text(local_run.job_file.read_text().replace('workload = "hep"', 'workload = "gone"'))
    for command in ("status", "cancel"):
        result = CliRunner().invoke(main, [command, str(local_run.root)], catch_exceptions=False)
        assert result.exit_code == 0, (command, result.output)
    assert "gone" in CliRunner().invoke(main, ["status", str(local_run.root), "--json"]).output
    one_error_line(CliRunner().invoke(main, ["evaluate", str(local_run.root)], catch_exceptions=False),
                   "unknown workload 'gone'")
