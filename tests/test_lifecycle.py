"""hpcdl.process.lifecycle on stand-in processes and a stand-in clock: what a group's and the appliers'
life decide from exit codes and marks, the same for every backend."""

from __future__ import annotations

import json

import pytest

from hpcdl.jobfile import load_job
from hpcdl.process.lifecycle import (
    EXIT_LOCKED, EXIT_REQUEUE, EXIT_USER_ERROR, RESTART_BACKOFF_S, ApplierLife, GroupLife, RestartTally,
    begin_new_submission,
)
from hpcdl.rundir.runs import RunDir, State, create_run


class FakeProcs:
    """A start's processes: they end with `codes` once `end()` is called (or at once)."""

    def __init__(self, n=2, codes=None, on_stop=None):
        self.n, self.final, self.on_stop = n, codes, on_stop
        self.codes = [None] * n if codes is None else list(codes)
        self.asked = self.killed = self.closed = False

    @property
    def pids(self):
        return [100 + i for i, c in enumerate(self.codes) if c is None]

    def poll(self):
        return list(self.codes)

    def end(self, *codes):
        self.codes = list(codes)

    def ask_to_stop(self):
        self.asked = True
        if self.on_stop:
            self.on_stop(self)

    def kill(self):
        self.killed = True
        self.codes = [-9 if c is None else c for c in self.codes]

    def close(self):
        self.closed = True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def run(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"', "run.nodes=2", "run.group_size=1"])
    with create_run(job, "local") as (_, run):
        pass
    run.group_dir(0).mkdir(parents=True, exist_ok=True)
    return run


def life_of(run, starts, **options):
    clock = Clock()
    started = []

    def start():
        started.append(starts.pop(0))
        return started[-1]

    life = GroupLife(run, 0, options.pop("max_restarts", 2), start, clock=clock, **options)
    return life, clock, started


def record(run: RunDir) -> dict:
    return json.loads(run.life_file(0).read_text())


def test_a_crashed_group_restarts_after_a_back_off_then_fails_with_the_reason(run):
    procs = [FakeProcs(codes=[0, 1]), FakeProcs(codes=[1, 1]), FakeProcs(codes=[137, 0])]
    life, clock, started = life_of(run, procs)
    assert life.poll() and life.state == State.RUNNING and len(started) == 1
    assert life.poll() and life.state == State.PENDING and life.restarts == 1
    assert life.poll() and len(started) == 1  # the back-off
    clock.now += RESTART_BACKOFF_S[0]
    life.poll()
    assert len(started) == 2 and life.state == State.RUNNING
    life.poll()
    clock.now += RESTART_BACKOFF_S[1]
    life.poll()
    assert len(started) == 3 and life.restarts == 2
    assert not life.poll()
    assert life.state == State.FAILED and life.exit_code == 137
    assert "after 2 restarts: run.max_restarts = 2 allows no more" in life.reason
    assert record(run)["state"] == "failed" and record(run)["restarts"] == 2


def test_one_dead_rank_stops_its_group_whole(run):
    procs = FakeProcs(codes=[None, 1])
    life, _, _ = life_of(run, [procs, FakeProcs(codes=[0, 0])])
    life.poll()
    life.poll()
    assert procs.killed and procs.closed and life.state == State.PENDING


def test_an_input_error_is_not_retried(run):
    life, _, started = life_of(run, [FakeProcs(codes=[EXIT_USER_ERROR, EXIT_USER_ERROR])])
    life.poll()
    assert not life.poll() and life.state == State.FAILED and len(started) == 1
    assert "no restart can mend" in life.reason


def checkpoint_at_stop(procs):
    """What the ranks do at the stop mark: checkpoint, leave the requeue mark, exit 0."""
    procs.run.requeue_mark(0).touch()
    procs.end(0, 0)


def stopping_procs(run):
    procs = FakeProcs(on_stop=checkpoint_at_stop)
    procs.run = run
    return procs


def test_a_stop_checkpoints_and_ends_stopped_without_a_requeue(run):
    life, _, _ = life_of(run, [stopping_procs(run)])
    life.poll()
    life.request_stop(requeue=True)  # the warning signal, on a backend that cannot requeue
    assert not life.poll() and life.state == State.CANCELLED and life.exit_code == 0
    assert not run.stop_mark(0).exists() and not run.requeue_mark(0).exists()


@pytest.mark.parametrize("cancelled", [False, True])
def test_the_warning_signal_requeues_unless_cancelled(run, cancelled):
    requeued = []
    life, _, _ = life_of(run, [stopping_procs(run)], requeue=requeued.append)
    life.poll()
    if cancelled:
        run.cancel_mark.touch()
    life.request_stop(requeue=True)
    assert run.stop_mark(0).exists() or life.ended  # the mark the ranks look for
    life.poll()
    assert requeued == ([] if cancelled else ["checkpointed"])
    assert life.state == (State.CANCELLED if cancelled else State.REQUEUED)
    tally = RestartTally.read(run.restarts_file(0))
    assert tally.planned_requeues == (0 if cancelled else 1) and tally.crash_restarts == 0


@pytest.mark.parametrize("preempted", [False, True])
def test_ranks_stopped_by_a_signal_requeue_only_when_preempted(run, preempted):
    requeued = []
    life, _, _ = life_of(run, [FakeProcs()], requeue=requeued.append, preempted=lambda: preempted)
    life.poll()
    run.requeue_mark(0).touch()
    life.procs.end(0, 0)
    assert not life.poll()
    tally = RestartTally.read(run.restarts_file(0))
    if preempted:  # a planned requeue: SLURM does not requeue a job that ends within GraceTime
        assert requeued == ["was preempted (SLURM), checkpointed"] and life.state == State.REQUEUED
        assert tally.planned_requeues == 1 and tally.crash_restarts == 0 and "preempted" in record(run)["reason"]
    else:  # a user's signal: stopped for good, and says so
        assert requeued == [] and life.state == State.CANCELLED and tally.planned_requeues == 0
        assert "signalled to stop" in record(run)["reason"]


def test_a_stop_by_a_signal_that_is_not_hpcdls_says_which(run):
    life, _, _ = life_of(run, [stopping_procs(run)], requeue=lambda why: None)
    life.poll()
    life.request_stop(by="SIGTERM")
    life.poll()
    assert life.state == State.CANCELLED and "stopped by SIGTERM" in record(run)["reason"]
    assert RestartTally.read(run.restarts_file(0)).stopped_by_signal  # should SLURM run it again


def test_a_crash_requeues_where_the_backend_can(run):
    requeued = []
    life, _, started = life_of(run, [FakeProcs(codes=[1, 0])], requeue=requeued.append, max_restarts=1)
    life.poll()
    assert not life.poll() and requeued == ["crashed"] and life.state == State.REQUEUED
    tally = RestartTally.read(run.restarts_file(0))
    assert life.restarts == 1 and tally.crash_restarts == 1 and tally.planned_requeues == 0


def test_ranks_that_do_not_stop_are_killed_after_the_grace(run):
    procs = FakeProcs()
    life, clock, _ = life_of(run, [procs], stop_grace_s=10.0)
    life.poll()
    life.request_stop()
    life.poll()
    assert procs.asked and not procs.killed
    clock.now += 11
    assert not life.poll() and procs.killed and life.state == State.CANCELLED


def test_a_group_beyond_its_restarts_does_not_start(run):
    RestartTally(crash_restarts=3, submission_crash_restarts=3).write(run.restarts_file(0))
    life, _, started = life_of(run, [FakeProcs()], max_restarts=2)
    assert not life.poll() and started == [] and life.state == State.FAILED
    assert "more than run.max_restarts = 2" in life.reason


def test_slurms_own_starts_are_crashes_unless_a_signal_stopped_the_group_first():
    """SLURM's restart count, less the starts the life asked for: a preemption (a stop by a
    signal not hpcdl's, then SLURM's requeue) is planned; anything else (a node failure) a crash."""
    tally = RestartTally(planned_requeues=5, submission_planned_requeues=5)
    tally.account_slurm_starts(6)
    assert (tally.crash_restarts, tally.planned_requeues) == (1, 5)
    tally.stopped_by_signal = True
    tally.account_slurm_starts(7)
    assert (tally.crash_restarts, tally.planned_requeues, tally.stopped_by_signal) == (1, 6, False)
    tally.account_slurm_starts(7)  # the same start seen again: nothing new
    assert (tally.crash_restarts, tally.planned_requeues) == (1, 6)


def test_restarts_by_kind_outlive_a_resume_and_max_restarts_counts_again(run):
    requeued = []
    life, _, _ = life_of(run, [FakeProcs(codes=[1, 0])], requeue=requeued.append, max_restarts=1)
    life.poll()
    life.poll()
    life, _, _ = life_of(run, [stopping_procs(run)], requeue=requeued.append, restart_count=1, max_restarts=1)
    life.poll()
    life.request_stop(requeue=True)  # the time limit's warning
    life.poll()
    assert requeued == ["crashed", "checkpointed"] and life.restarts == 1
    begin_new_submission(run, 1)  # hpcdl resume
    assert record(run)["state"] == "pending"
    life, _, _ = life_of(run, [FakeProcs(codes=[1, 1])], requeue=requeued.append, restart_count=0, max_restarts=1)
    life.poll()
    assert not life.poll() and life.state == State.REQUEUED and life.restarts == 1  # allowed again
    assert (record(run)["crash_restarts"], record(run)["planned_requeues"]) == (2, 1)


def test_appliers_restart_only_the_crashed_shard_and_requeue_once(run):
    started = {0: [], 1: [], 2: []}

    def start(shard):
        started[shard].append(FakeProcs(n=1))
        return started[shard][-1]

    requeued = []
    life = ApplierLife(run, 3, 2, start, requeue=requeued.append)
    life.begin()
    started[1][0].end(1)
    assert life.poll() and [len(s) for s in started.values()] == [1, 2, 1]
    started[2][0].end(EXIT_LOCKED)  # another applier holds shard 2: not restarted
    life.poll()
    assert len(started[2]) == 1
    life.request_stop(requeue=True)
    for shard in (0, 1):
        started[shard][-1].end(EXIT_REQUEUE)
    assert not life.poll() and life.finish() == 0 and requeued == ["committed"]
    assert life.record()["restarts"] == 1


def test_appliers_are_not_restarted_once_the_groups_ended(run):
    procs = FakeProcs(n=1)
    life = ApplierLife(run, 1, 2, lambda shard: procs)
    life.begin()
    procs.end(1)
    assert not life.poll(groups_active=False) and life.finish() == 1


def test_an_input_error_mark_stops_retries_whatever_the_launcher_reported(run):
    """srun reports 137 once it killed the group's other ranks; the rank's mark says why."""
    procs = FakeProcs(codes=[None])
    life, _, started = life_of(run, [procs, FakeProcs(codes=[0])])
    life.poll()
    run.input_error_file(0).write_text("[Errno 2] No such file or directory: 'none.h5'\n")
    procs.end(137)
    assert not life.poll() and life.state == State.FAILED and len(started) == 1
    assert "none.h5" in life.reason


def test_a_group_that_cannot_start_fails_with_one_line(run):
    def start():
        raise FileNotFoundError(2, "No such file or directory", "srun")

    life = GroupLife(run, 0, 2, start)
    assert not life.poll() and life.state == State.FAILED and "could not start" in life.reason


def test_the_applier_takes_a_garbled_group_state_for_not_finished(tmp_path):
    from hpcdl.rundir.runs import RunDir
    from hpcdl.process.lifecycle import groups_finished

    run = RunDir(tmp_path)
    for g, content in enumerate([b'{"state": "finished"}', b"\xff\xfe\x00binary", b"[1, 2]"]):
        run.group_state_file(g).parent.mkdir(parents=True)
        run.group_state_file(g).write_bytes(content)
    assert groups_finished(run, 1)
    assert not groups_finished(run, 2) and not groups_finished(run, 3)
