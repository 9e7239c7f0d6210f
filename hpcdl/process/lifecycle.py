"""The life of a run's processes, written once for every backend.

A group's life: start its ranks; on a stop request (the time limit's warning signal, a cancel,
Ctrl-C) leave the group's stop mark and let the ranks checkpoint at the next step; when they end,
decide from their exit codes and the marks what happened: finished, stopped (and, where the
backend can, requeued to go on), or crashed -- then restarted from the newest checkpoint while
``run.max_restarts`` allows, or failed with the reason. The appliers' life is the same over their
shards: a crashed shard is started again from its durable state; a stop request makes each commit
and exit with ``EXIT_REQUEUE``. The run ends for its appliers when its groups are over
(``groups_over``): then they apply what is pending and end by themselves (``ApplierLife.drain``
on the local backend; under SLURM, once the group array has left the queue).

The backends differ only in how they start processes and how they go on after a stop or a crash,
which they pass in: the local backend restarts a crashed group in place and has no requeue; a SLURM
element requeues itself (exactly itself: ``<array id>_<task id>``) for both, and SLURM starts it
again. Both count a group's restarts the same way and by kind (``RestartTally``): a crash restart
(after its ranks failed, or SLURM ran it again after a node failure) counts against
``run.max_restarts``; a planned requeue (at the time limit's warning signal, or after a
preemption) is how a long run goes on and does not.

Each life publishes its record (state, restarts, exit codes, the reason of a failure) to the run
directory (``RunDir.life_file``), so `hpcdl status` shows the same facts on both backends.

Both lives are polled (``poll()`` once a round, by the local supervisor for all of a run's groups,
by a SLURM batch step for its one), so one process can watch many without threads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from hpcdl.fs.files import atomic_write_bytes, atomic_write_json, read_regular
from hpcdl.rundir.runs import RunDir, State

# Exit codes of the processes a life watches, and of the life itself.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2  # a rank refused its input (a missing file, a precision the CPU lacks), or an
# applier its durable state (damaged, no good generation left): no retry helps
EXIT_LOCKED = 3  # another applier holds the shard's lock: this one is not needed
EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped on request after a commit, to be continued

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)  # between a crash and the restart in place
STOP_GRACE_S = 60.0  # asked to stop, a group's ranks finish their step and checkpoint first
APPLIER_STOP_GRACE_S = 30.0  # an applier commits the update in progress, then exits
APPLIER_DRAIN_S = 600.0  # after the last group, the appliers apply what is pending and end
FULL_DISK_GRACE_S = 30.0  # after the last group, how long a full disk may hold the appliers back


def worker_command(python: str, run: RunDir) -> list[str]:
    """A rank's process (hpcdl.process.worker), on either backend."""
    return [python, "-m", "hpcdl.process.worker", str(run.root)]


def applier_command(python: str, run: RunDir, shard: int = 0, *, slurm_array: bool = False) -> list[str]:
    """Shard `shard`'s applier; `slurm_array`: it also ends once SLURM holds no element of the
    run's group array (the SLURM backend's applier job)."""
    return [*worker_command(python, run), "--applier", *(["--shard", str(shard)] if shard else []),
            *(["--slurm-array"] if slurm_array else [])]


def groups_over(run: RunDir, groups: int, array_gone: Callable[[], bool] | None = None) -> bool:
    """Whether the run's groups are over, for its appliers, on either backend: every group
    finished, the local supervisor marked them ended (ApplierLife.drain), or SLURM holds no
    element of the group array any more (`array_gone`, the SLURM backend's applier job)."""
    return (groups_finished(run, groups) or run.groups_ended_mark.exists()
            or (array_gone is not None and array_gone()))


def groups_finished(run: RunDir, groups: int) -> bool:
    """Every group of the run says it finished (a missing, torn or binary state: not)."""
    for g in range(groups):
        try:
            state = json.loads(run.group_state_file(g).read_bytes())
        except (OSError, ValueError):  # a rank rewrites it
            return False
        if not isinstance(state, dict) or state.get("state") != State.FINISHED:
            return False
    return True



class Processes(Protocol):
    """One start of a group's ranks (or of one applier), as a backend launched it."""

    pids: list[int]

    def poll(self) -> list[int | None]:
        """Each process's exit code, None while it runs."""

    def ask_to_stop(self) -> None:
        """Ask for a clean stop (a checkpoint or commit first)."""

    def kill(self) -> None:
        """End every process now."""

    def close(self) -> None:
        """Release what the start held beside the processes (a rendezvous server)."""


@dataclass
class Popened:
    """Processes started with subprocess.Popen; `stop_signal` asks them to stop cleanly."""

    procs: list[subprocess.Popen]
    stop_signal: int | None = signal.SIGTERM  # None: the stop mark alone asks them
    on_close: Callable[[], None] | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def ask_to_stop(self) -> None:
        for p in self.procs:
            if p.poll() is None and self.stop_signal is not None:
                try:
                    p.send_signal(self.stop_signal)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:  # a launcher that leads a session of its own (mpirun): its ranks go with it
                    if os.getpgid(p.pid) == p.pid:
                        os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.kill()
            p.wait()

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close()
            self.on_close = None


@dataclass
class RestartTally:
    """A group's starts after its first, by kind, over the run's life (kept in
    ``RunDir.restarts_file``, across requeues and `hpcdl resume`):

    - crash restarts: its ranks failed (or SLURM ran the element again after a node failure) and
      it started again from its newest checkpoint; ``run.max_restarts`` bounds those of one
      submission (``submission_crash_restarts``), so a resume may try again;
    - planned requeues: the run meant it to go on -- the group requeued itself at the time
      limit's warning signal, or SLURM requeued it after a preemption. Never bounded.
    """

    crash_restarts: int = 0
    planned_requeues: int = 0
    submission_crash_restarts: int = 0
    submission_planned_requeues: int = 0
    # Asked to stop for good by a signal that was not `hpcdl cancel`'s: if SLURM runs the element
    # again, that was a preemption, not a crash.
    stopped_by_signal: bool = False

    @classmethod
    def read(cls, path: Path) -> "RestartTally":
        """The tally at `path`; missing or garbled, none yet."""
        try:
            data = json.loads(read_regular(path))
        except (OSError, ValueError):
            return cls()
        if not isinstance(data, dict):
            return cls()
        counts = {name: data[name] for name in cls.__dataclass_fields__ if name != "stopped_by_signal"
                  and isinstance(data.get(name), int) and not isinstance(data[name], bool) and data[name] >= 0}
        return cls(**counts, stopped_by_signal=data.get("stopped_by_signal") is True)

    def write(self, path: Path) -> None:
        """Publish the tally; a full disk keeps the previous one (the count is then too low)."""
        try:
            atomic_write_json(path, asdict(self))
        except OSError:
            pass

    def count_crash_restart(self) -> None:
        self.crash_restarts += 1
        self.submission_crash_restarts += 1

    def count_planned_requeue(self) -> None:
        self.planned_requeues += 1
        self.submission_planned_requeues += 1

    def account_slurm_starts(self, restart_count: int) -> None:
        """SLURM's restart count of the element in this submission, against the starts the
        group's life asked for and counted: the rest SLURM made by itself -- after a preemption
        (the element had been stopped by a signal not hpcdl's) a planned requeue, otherwise (a
        node failure, a kill) a crash restart."""
        unaccounted = restart_count - self.submission_crash_restarts - self.submission_planned_requeues
        if unaccounted > 0 and self.stopped_by_signal:
            self.count_planned_requeue()
            unaccounted -= 1
        for _ in range(max(0, unaccounted)):
            self.count_crash_restart()
        self.stopped_by_signal = False

    def new_submission(self) -> None:
        """`hpcdl resume` submits the run again: SLURM's restart count and run.max_restarts
        start over; the run's totals stay."""
        self.submission_crash_restarts = self.submission_planned_requeues = 0
        self.stopped_by_signal = False


def begin_new_submission(run: RunDir, groups: int) -> None:
    """Before `hpcdl resume` submits the run again: no stale mark stops a group, each group's
    restart tally starts a new submission (keeping the run's totals), and each life reads
    pending until its group starts again (not the state the last submission ended in)."""
    for g in range(groups):
        for mark in (run.stop_mark(g), run.requeue_mark(g)):
            mark.unlink(missing_ok=True)
        tally = RestartTally.read(run.restarts_file(g))
        tally.new_submission()
        tally.write(run.restarts_file(g))
        try:
            life = json.loads(read_regular(run.life_file(g)))
        except (OSError, ValueError):
            continue
        if isinstance(life, dict):
            atomic_write_json(run.life_file(g), {**life, "state": State.PENDING, "reason": "", "pids": [],
                                                 "updated": time.time()})
    run.cancel_mark.unlink(missing_ok=True)


def _first_line(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip().splitlines()[0][:500]
    except (OSError, IndexError):
        return ""


@dataclass
class GroupLife:
    """One synchronous group, from its first start to its end.

    ``start()`` launches the group's ranks; ``requeue`` (SLURM) puts the group back in the queue
    after a stop or a crash, and the process that runs this life ends; without it (local) a
    crashed group is started again here after a back-off, and a stopped group stays stopped.
    Every restart and requeue is counted by kind in the group's ``RestartTally`` before it happens.
    """

    run: RunDir
    group: int
    max_restarts: int
    start: Callable[[], Processes]
    requeue: Callable[[str], None] | None = None
    restart_count: int | None = None  # SLURM's own count of this element's starts after the first
    # Whether the scheduler chose the group for preemption (SLURM: the job's PreemptTime). Its
    # ranks were then signalled, not its batch step: the group requeues itself, a planned requeue.
    preempted: Callable[[], bool] = lambda: False
    stop_grace_s: float | None = STOP_GRACE_S  # then the ranks are killed; None: wait (SLURM's limit ends it)
    log: Callable[[str], None] = lambda text: None
    clock: Callable[[], float] = time.monotonic
    state: State = State.PENDING
    exit_codes: list[int | None] = field(default_factory=list)
    reason: str = ""
    procs: Processes | None = None
    next_start: float = 0.0
    stop_asked_at: float | None = None
    requeue_on_stop: bool = False
    stopped_by: str = ""  # the signal that asked for a stop for good, when it was not hpcdl's own
    exit_code: int = EXIT_OK
    tally: RestartTally = field(init=False)

    def __post_init__(self) -> None:
        for mark in (self.run.stop_mark(self.group), self.run.requeue_mark(self.group),
                     self.run.input_error_file(self.group)):
            mark.unlink(missing_ok=True)
        self.tally = RestartTally.read(self.run.restarts_file(self.group))
        if self.restart_count is not None:
            self.tally.account_slurm_starts(self.restart_count)
            self.tally.write(self.run.restarts_file(self.group))
        if self.restarts > self.max_restarts:
            self._end(State.FAILED, EXIT_FAILED,
                      f"group {self.group} was restarted {self.restarts} times after failures, more than "
                      f"run.max_restarts = {self.max_restarts}; not running")
        self.publish()

    @property
    def restarts(self) -> int:
        """Crash restarts in this submission: what ``max_restarts`` bounds."""
        return self.tally.submission_crash_restarts

    @property
    def ended(self) -> bool:
        return self.state not in (State.PENDING, State.RUNNING)

    def request_stop(self, requeue: bool = False, by: str = "") -> None:
        """Checkpoint and stop; with ``requeue`` (the time limit's warning) go on afterwards,
        unless `hpcdl cancel` left its mark. ``by`` names the signal that asked, for the reason
        of a stop that was not hpcdl's. A group not started yet does not start."""
        if self.ended:
            return
        self.requeue_on_stop = self.requeue_on_stop or requeue
        if not requeue and not self.run.cancel_mark.exists():
            self.stopped_by = self.stopped_by or by
            self.tally.stopped_by_signal = True  # a preemption, should SLURM run the element again
            self.tally.write(self.run.restarts_file(self.group))
        if self.procs is None:
            self._end(State.CANCELLED, EXIT_OK, "")
            return
        if self.stop_asked_at is None:
            self.stop_asked_at = self.clock()
            self._touch(self.run.stop_mark(self.group))
            self.procs.ask_to_stop()

    def poll(self) -> bool:
        """One round of watching; True while the group still has to run."""
        if self.ended:
            return False
        if self.procs is None:
            if self.clock() >= self.next_start:
                try:
                    self.procs = self.start()
                except OSError as exc:  # no srun or mpirun here, no port for the rendezvous
                    self._end(State.FAILED, EXIT_FAILED, f"group {self.group} could not start: {exc}")
                    return False
                self.state = State.RUNNING
                self.publish()
            return True
        self.exit_codes = self.procs.poll()
        if (self.stop_asked_at is not None and self.stop_grace_s is not None
                and self.clock() - self.stop_asked_at > self.stop_grace_s):
            self.procs.kill()
            self.exit_codes = self.procs.poll()
        if all(c is not None for c in self.exit_codes):
            self._attempt_ended()
        elif any(c not in (None, 0) for c in self.exit_codes):
            # One rank died: the others would wait in a collective until Gloo's timeout.
            self.procs.kill()
            self.exit_codes = self.procs.poll()
            self._attempt_ended()
        self.publish()
        return not self.ended

    def kill(self) -> None:
        if self.procs is not None:
            self.procs.kill()
            self.procs.close()

    def _attempt_ended(self) -> None:
        self.procs.close()
        self.procs = None
        codes = self.exit_codes
        checkpointed = self.run.requeue_mark(self.group).exists()
        for mark in (self.run.stop_mark(self.group), self.run.requeue_mark(self.group)):
            mark.unlink(missing_ok=True)
        cancelled = self.run.cancel_mark.exists()
        if all(c == 0 for c in codes):
            if not checkpointed and (self.stop_asked_at is None or self._reports_finished()):
                self._end(State.FINISHED, EXIT_OK, "")
            elif self.requeue is not None and not cancelled and (self.requeue_on_stop or self.preempted()):
                # The warning signal, or a preemption: SLURM signals a preempted job's steps (not
                # its batch step) and, should the job end within GraceTime, does not requeue it.
                why = "checkpointed" if self.requeue_on_stop else "was preempted (SLURM), checkpointed"
                self.tally.count_planned_requeue()
                self.tally.write(self.run.restarts_file(self.group))
                self._end(State.REQUEUED, EXIT_OK, "" if self.requeue_on_stop else
                          f"group {self.group} was preempted by SLURM: checkpointed and requeued")
                self.requeue(why)
            else:
                # Stopped at a checkpoint: by a cancel, a signal to the ranks, or Ctrl-C.
                if self.requeue is not None and self.requeue_on_stop:
                    self.log(f"group {self.group} checkpointed; the run was cancelled, not requeueing")
                self._end(State.CANCELLED, EXIT_OK, self._stopped_reason(cancelled))
            return
        failed = [c for c in codes if c not in (0, None)]
        code = failed[0] if failed else EXIT_FAILED
        what = f"group {self.group}'s ranks exited with status {', '.join(str(c) for c in codes)}"
        if self.stop_asked_at is not None or cancelled:
            self._end(State.CANCELLED, code, what + " while stopping")
        elif EXIT_USER_ERROR in codes or self.run.input_error_file(self.group).exists():
            said = _first_line(self.run.input_error_file(self.group))
            self._end(State.FAILED, code, f"{what}: an input error no restart can mend"
                                          + (f": {said}" if said else " (see the rank logs)"))
        elif self.restarts >= self.max_restarts:
            self._end(State.FAILED, code, f"{what}, after {self.restarts} restarts: run.max_restarts = "
                                          f"{self.max_restarts} allows no more")
        else:
            self.tally.count_crash_restart()
            self.tally.write(self.run.restarts_file(self.group))
            self.reason = f"{what}; restart {self.restarts} of {self.max_restarts} from the newest checkpoint"
            self.log(self.reason)
            if self.requeue is not None:
                self._end(State.REQUEUED, EXIT_OK, self.reason)
                self.requeue("crashed")
            else:
                self.state = State.PENDING
                self.next_start = self.clock() + RESTART_BACKOFF_S[min(self.restarts - 1, len(RESTART_BACKOFF_S) - 1)]

    def _stopped_reason(self, cancelled: bool) -> str:
        """Why a group stopped for good at a checkpoint, when it was not `hpcdl cancel` or the
        backend's own stop (those need no reason: the default words say it)."""
        if cancelled:
            return ""
        if self.stop_asked_at is None:
            return (f"group {self.group}'s ranks were signalled to stop (a SIGTERM or SIGINT to them, not "
                    "`hpcdl cancel`: e.g. `scancel --signal=TERM` of its element); checkpointed, not requeued")
        if self.stopped_by:
            return (f"group {self.group} was stopped by {self.stopped_by} (not `hpcdl cancel`, not a preemption: "
                    "e.g. `scancel` of its element); checkpointed, not requeued")
        return ""

    def _end(self, state: State, code: int, reason: str) -> None:
        self.state, self.exit_code, self.reason = state, code, reason
        if state == State.FAILED:
            self.log(f"error: {reason}")
        self.publish()

    def _reports_finished(self) -> bool:
        """The group's own word: a stop asked as its last step ended is no stop."""
        try:
            return json.loads(self.run.group_state_file(self.group).read_bytes()).get("state") == State.FINISHED
        except (OSError, ValueError, AttributeError):
            return False

    def _touch(self, path: Path) -> None:
        try:
            path.touch()
        except OSError:
            pass  # a full disk: the signal to the ranks (local) still stops them

    def record(self) -> dict:
        return {"state": self.state, "restarts": self.restarts, "crash_restarts": self.tally.crash_restarts,
                "planned_requeues": self.tally.planned_requeues, "restart_count": self.restart_count,
                "exit_codes": self.exit_codes, "pids": self.procs.pids if self.procs else [],
                "reason": self.reason}

    def publish(self) -> None:
        """The life's record for `hpcdl status`; a full disk keeps the previous one."""
        try:
            atomic_write_json(self.run.life_file(self.group), {**self.record(), "updated": time.time()})
        except OSError:
            pass


@dataclass
class ShardLife:
    shard: int
    procs: Processes | None = None
    restarts: int = 0
    code: int | None = None
    reason: str = ""


@dataclass
class ApplierLife:
    """The appliers of a run's exchange, one process per shard.

    A shard whose applier crashed is started again from its durable state, at most
    ``max_restarts`` times; ``EXIT_OK`` (done), ``EXIT_REQUEUE`` (asked to stop),
    ``EXIT_LOCKED`` (another applier holds the shard) and ``EXIT_USER_ERROR`` (its durable state
    cannot be used: failed, not restarted) end it. ``request_stop`` makes every shard
    commit and exit; ``requeue`` (SLURM) then continues the appliers, unless the run was cancelled.
    """

    run: RunDir
    shards: int
    max_restarts: int
    start: Callable[[int], Processes]
    requeue: Callable[[str], None] | None = None
    clock: Callable[[], float] = time.monotonic
    lives: list[ShardLife] = field(default_factory=list)
    stop_asked_at: float | None = None
    requeue_on_stop: bool = False
    log: Callable[[str], None] = lambda text: None

    def __post_init__(self) -> None:
        self.lives = [ShardLife(k) for k in range(self.shards)]

    def begin(self) -> None:
        for life in self.lives:
            life.procs = self.start(life.shard)

    @property
    def running(self) -> bool:
        return any(life.code is None and life.procs is not None for life in self.lives)

    def poll(self, groups_active: bool = True) -> bool:
        """One round; a crashed shard restarts only while groups still train. True while any runs."""
        for life in self.lives:
            if life.procs is None or life.code is not None:
                continue
            code = life.procs.poll()[0]
            if code is None:
                if self.stop_asked_at is not None and self.clock() - self.stop_asked_at > APPLIER_STOP_GRACE_S:
                    life.procs.kill()
                continue
            if (code in (EXIT_OK, EXIT_REQUEUE, EXIT_LOCKED) or self.stop_asked_at is not None
                    or self.run.cancel_mark.exists() or not groups_active):
                life.code = code
            elif code == EXIT_USER_ERROR:
                life.code = code
                life.reason = (f"shard {life.shard}'s applier exited with status {code}: its durable state "
                               "cannot be used, no restart can mend that (its log and `hpcdl status` say why)")
                self.log(life.reason)
            elif life.restarts >= self.max_restarts:
                life.code = code
                life.reason = (f"shard {life.shard}'s applier exited with status {code}, {life.restarts + 1} "
                               f"times: more than run.max_restarts = {self.max_restarts}")
                self.log(life.reason)
            else:
                life.restarts += 1
                self.log(f"shard {life.shard}'s applier exited with status {code}; starting it again from its "
                         f"state ({life.restarts} of {self.max_restarts})")
                life.procs = self.start(life.shard)
        return self.running

    def request_stop(self, requeue: bool = False, by: str = "") -> None:
        """Every shard commits and exits; with ``requeue`` (the warning signal) the job goes on.
        ``by`` names a signal that stops for good (SLURM requeues a preempted job itself)."""
        self.requeue_on_stop = self.requeue_on_stop or requeue
        if by and self.stop_asked_at is None:
            self.log(f"{by}: the appliers commit and stop")
        if self.stop_asked_at is None:
            self.stop_asked_at = self.clock()
            for life in self.lives:
                if life.procs is not None and life.code is None:
                    life.procs.ask_to_stop()

    @property
    def failed(self) -> bool:
        return any(life.code not in (EXIT_OK, EXIT_REQUEUE, EXIT_LOCKED, None) for life in self.lives)

    def finish(self) -> int:
        """After every shard ended: requeue if they were asked to stop for that; the exit code."""
        codes = [life.code for life in self.lives]
        failed = next((c for c in codes if c not in (EXIT_OK, EXIT_REQUEUE, EXIT_LOCKED, None)), None)
        if failed is not None:
            return failed
        if EXIT_REQUEUE in codes and self.requeue is not None and self.requeue_on_stop:
            if self.run.cancel_mark.exists():
                self.log("applier state committed; the run was cancelled, not requeueing")
            else:
                self.requeue("committed")
        return EXIT_OK

    def drain(self, stopping: Callable[[], bool], tick: Callable[[], None], interval: float) -> None:
        """Every group has ended: the appliers apply what is pending and end by themselves,
        told by the run's groups-ended mark (groups_over), rather than stop with updates pending
        (one may be waiting out a full disk). Bounded by APPLIER_DRAIN_S and by `stopping()`."""
        start = self.clock()
        marked = False
        while self.poll(groups_active=False) and not stopping() and self.clock() < start + APPLIER_DRAIN_S:
            if not marked:
                try:
                    atomic_write_bytes(self.run.groups_ended_mark, b"")
                    marked = True
                except OSError:
                    # A full disk: the appliers cannot commit either. Past the grace they stop
                    # (what they could not apply stays pending) rather than wait out the drain.
                    if self.clock() - start > FULL_DISK_GRACE_S:
                        self.request_stop()
            tick()
            time.sleep(interval)

    def kill(self) -> None:
        for life in self.lives:
            if life.procs is not None:
                life.procs.kill()

    def record(self) -> dict:
        return {"restarts": sum(life.restarts for life in self.lives),
                "shards": [{"shard": life.shard, "pid": (life.procs.pids or [None])[0] if life.procs else None,
                            "running": life.code is None and life.procs is not None and bool(life.procs.pids),
                            "restarts": life.restarts, "exit_code": life.code, "reason": life.reason}
                           for life in self.lives]}
