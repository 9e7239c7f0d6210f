"""The applier's loop: list pending updates, apply a batch, commit it, publish (the package
docstring is the design: versions, staleness, exactly-once across kill -9, full disks)."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from hpcdl.applier.checks import invalid_initial, invalid_update
from hpcdl.applier.config import ApplierConfig
from hpcdl.applier.rules import make_rule
from hpcdl.applier.state import DurableState, StateLost, new_stats
from hpcdl.exchange import ALIGN, MAX_HEADER_BYTES, PREFIX_SIZE, Channel, CorruptFile, UpdateRef
from hpcdl.fs.files import append_jsonl, atomic_write_bytes, read_jsonl
from hpcdl.fs.storage import StorageReport, is_storage_full

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("hpcdl.applier")

CLEAN_INTERVAL_S = 10.0  # how often temporaries older than temp_max_age_s are removed


class AlreadyRunning(RuntimeError):
    """Another applier holds the lock of this exchange directory."""


class _Batch:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.delete: list[str] = []  # paths relative to the channel root
        self.reject: list[str] = []
        self.applied = 0
        self.handled = 0
        self.read = 0  # update files read (not vanished, not a duplicate)


class Applier:
    """The parameter server. See the package docstring for the protocol and crash analysis.

    Construction takes the lock and recovers from the durable state; then call :meth:`run`
    (or :meth:`step` for one batch). Use as a context manager or call :meth:`close`.
    """

    def __init__(self, channel: Channel, config: ApplierConfig = ApplierConfig(), *,
                 initial: Mapping[str, np.ndarray] | None = None, lock: bool = True,
                 crash: Callable[[str], None] = lambda point: None):
        """``initial``: version 0's weights when there is no state and no published version.
        ``crash(point)`` is called at each point of the commit where a kill -9 is analysed in
        the package docstring (tests kill the process there)."""
        self.ch = channel
        self.config = config
        self.rule = make_rule(config.optimizer, config.rule_params)
        self.state = DurableState()
        self._initial = dict(initial) if initial is not None else None
        self._stop = False
        self.cpu_seconds, self.cpu_updates = 0.0, 0  # this process's, since it started
        self._listed: set[str] | None = None  # the update files the last step listed
        self._crash = crash
        self._last_status = 0.0
        self._lock_fd = self._acquire_lock() if lock else None
        self.storage = StorageReport(self.ch.storage_path, self.ch.access)
        self._healthy = False  # True once the durable state is loaded and consistent
        self._failure: str | None = None  # why no durable state can be used (StateLost)
        try:
            self._recover()
        except BaseException:
            self.close()
            raise

    # -- public --------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Finish the update in progress, commit, and leave :meth:`run` (signal-safe)."""
        self._stop = True

    def close(self) -> None:
        if getattr(self, "storage", None) is not None:
            self.storage.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "Applier":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def healthy(self) -> bool:
        """False while the durable state is to be reloaded (after an I/O error: a full disk)."""
        return self._healthy

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.state.counters)

    @property
    def version(self) -> int | None:
        return self.state.version

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return self.state.weights

    @property
    def ledger(self):
        return self.state.ledger

    def step(self) -> int:
        """Process one batch of pending files (or adopt initial weights); returns files handled."""
        if self.state.version is None:
            return self._try_init()
        cpu = time.process_time()
        refs = self.ch.pending_updates()
        self._listed = {r.name for r in refs}  # status.json's backlog, without a second listing
        if not refs:
            return 0
        batch = _Batch()
        for ref in refs[: self.config.max_batch]:
            if self._stop:
                break
            self._process(ref, batch)
        if batch.handled:
            self._commit(batch)
            # what one update read costs this process: the listing, the weights' publish and
            # the commit included
            self.cpu_seconds += time.process_time() - cpu
            self.cpu_updates += batch.read
        return batch.handled

    def run(
        self,
        poll_interval: float = 0.05,
        stop: Callable[[], bool] | None = None,
        idle_exit_after: float | None = None,
    ) -> int:
        """Main loop until ``stop()`` is true, :meth:`request_stop`, or idle for ``idle_exit_after`` s.

        Returns the number of files handled.
        """
        handled = 0
        now = time.monotonic()
        last_activity = last_clean = now
        backoff = poll_interval
        try:
            while not self._stop and not (stop is not None and stop()):
                n = self._step_or_back_off(backoff)
                if n is None:
                    backoff = min(max(backoff, 0.05) * 2, 10.0)
                    continue
                if n:
                    self.storage.succeeded("applier commit")
                backoff = poll_interval
                now = time.monotonic()
                # Busy or idle: a killed writer's temporary must not outlive the bound for long.
                if now - last_clean >= CLEAN_INTERVAL_S:
                    self.ch.clean_stale_temporaries(self.config.temp_max_age_s)
                    last_clean = now
                if n:
                    handled += n
                    last_activity = now
                    continue
                if idle_exit_after is not None and now - last_activity >= idle_exit_after:
                    break
                if time.time() - self._last_status >= self.config.status_interval:
                    self._idle_status()
                time.sleep(poll_interval)
        finally:
            try:
                self.ch.clean_stale_temporaries(self.config.temp_max_age_s)  # leave no dead writer's
                self._write_status(phase="failed" if self._failure else "stopped")
            except OSError:
                log.exception("could not write the final status")
        return handled

    def _step_or_back_off(self, backoff: float) -> int | None:
        """One step (after reloading the durable state if the last step failed): the files it
        handled, or None after an I/O error and `backoff` seconds of waiting."""
        try:
            if not self._healthy:
                self._recover()
                self.storage.succeeded("applier commit")
            return self.step()
        except OSError as e:
            # Nothing is processed on a state that did not reload completely: a failed reload
            # leaves _healthy False and is retried first, next time round.
            self._healthy = False
            if is_storage_full(e):
                self.storage.failed("applier commit", e, path=self.ch.root,
                                    detail="nothing lost: the updates stay pending; retrying")
            else:
                log.exception("I/O error; reloading the durable state, retrying in %.1fs", backoff)
            time.sleep(backoff)
            return None

    def _idle_status(self) -> None:
        """The status file while idle; a full disk is recorded, not raised."""
        try:
            self._write_status()
            self.storage.succeeded("applier status")
        except OSError as e:
            if not is_storage_full(e):
                raise
            self.storage.failed("applier status", e, path=self.ch.status_path)
            self._last_status = time.time()

    # -- processing ----------------------------------------------------------------------------

    def _event(self, batch: _Batch | None, event: str, **fields: Any) -> dict[str, Any]:
        self.state.event_id += 1
        ev = {"event_id": self.state.event_id, "time": time.time(), "event": event, **fields}
        if batch is not None:
            batch.events.append(ev)
        return ev

    def _process(self, ref: UpdateRef, batch: _Batch) -> None:
        rel = self.ch.relative(ref.path)
        key = (ref.group, ref.seq)
        batch.handled += 1
        if self.state.ledger.seen(*key):
            self.state.counters["duplicates"] += 1
            batch.delete.append(rel)
            self._event(batch, "duplicate", group=ref.group, seq=ref.seq, file=ref.name)
            log.info("update group %d seq %d already processed: deleting", *key)
            return
        try:
            upd = self.ch.read_update(ref, max_bytes=self._max_update_bytes)
        except FileNotFoundError:
            self.state.counters["vanished"] += 1
            self._event(batch, "vanished", group=ref.group, seq=ref.seq, file=ref.name)
            return
        except (CorruptFile, IsADirectoryError, PermissionError) as e:
            # Permanent: retrying cannot help. (Other OSErrors, e.g. EIO, may be transient: they
            # propagate and run() retries after reloading the durable state.)
            reason = str(e) if isinstance(e, CorruptFile) else f"unreadable: {type(e).__name__}"
            self.state.counters["rejected_corrupt"] += 1
            batch.reject.append(rel)
            self._event(batch, "rejected", file=ref.name, reason=reason)
            log.warning("rejected %s: %s", ref.name, reason)
            return
        batch.read += 1
        reason = invalid_update(upd.tensors, self.state.weights)
        if reason:
            self.state.counters["rejected_invalid"] += 1
            self.state.ledger.add(*key)
            batch.reject.append(rel)
            self._event(batch, "rejected", group=upd.group, seq=upd.seq, file=ref.name,
                        reason=reason)
            log.warning("rejected %s: %s", ref.name, reason)
            return
        staleness = self._staleness(upd)
        scale = 1.0 / max(1, staleness) if self.config.staleness_scaling else 1.0
        if self.config.max_staleness is not None and staleness > self.config.max_staleness:
            if self.config.stale_policy == "drop":
                self.state.counters["dropped_stale"] += 1
                self.state.ledger.add(*key)
                batch.delete.append(rel)
                self._event(batch, "dropped", group=upd.group, seq=upd.seq,
                            base_version=upd.base_version, staleness=staleness,
                            version=self.state.version, reason="stale")
                log.info("dropped update group %d seq %d: staleness %d > %d", upd.group,
                         upd.seq, staleness, self.config.max_staleness)
                return
            scale = min(scale, 1.0 / (1.0 + staleness))
            self.state.counters["downweighted"] += 1
        self._apply(upd.tensors, scale)
        self.state.version += 1
        self.state.counters["applied"] += 1
        self.state.ledger.add(*key)
        self.state.last_apply_time = time.time()
        batch.delete.append(rel)
        batch.applied += 1
        self._event(batch, "applied", group=upd.group, seq=upd.seq,
                    base_version=upd.base_version, staleness=staleness, version=self.state.version,
                    scale=scale)

    def _staleness(self, upd) -> int:
        """How many versions the master moved past the update's base, counted in the run's and
        the group's staleness statistics."""
        assert self.state.version is not None
        staleness = self.state.version - upd.base_version
        if staleness < 0:
            log.warning("update group %d seq %d has base_version %d ahead of master %d",
                        upd.group, upd.seq, upd.base_version, self.state.version)
            staleness = 0
        for st in (self.state.staleness, self.state.group_staleness.setdefault(str(upd.group), new_stats())):
            st["count"] += 1
            st["sum"] += staleness
            st["max"] = max(st["max"], staleness)
        return staleness

    def _apply(self, update: Mapping[str, np.ndarray], scale: float) -> None:
        self.state.t += 1
        self.rule.apply(self.state.weights, self.state.slots, update, scale, self.state.t)

    # -- initial weights -----------------------------------------------------------------------

    @property
    def _max_update_bytes(self) -> int:
        """The largest update file that can fit the master: 8-byte elements, aligned, max header."""
        return PREFIX_SIZE + MAX_HEADER_BYTES + sum(
            w.size * 8 + ALIGN for w in self.state.weights.values())

    def _try_init(self) -> int:
        batch = _Batch()
        proposals = self.ch.pending_proposals()
        for path in proposals:
            try:
                group, tensors = self.ch.read_proposal(path)
                reason = invalid_initial(tensors)
            except FileNotFoundError:
                continue
            except (CorruptFile, IsADirectoryError, PermissionError) as e:
                group, reason = None, str(e) or type(e).__name__
            if reason:
                self.state.counters["rejected_proposals"] += 1
                self.ch.quarantine(path)  # no state to commit yet: move aside at once
                self._append_events([self._event(None, "rejected", group=group,
                                                 file=path.name, reason=reason)])
                log.warning("rejected initial proposal %s: %s", path.name, reason)
                continue
            self.state.adopt(tensors, 0, self.rule.slots)
            self._event(batch, "init", group=group, version=0, file=path.name)
            batch.delete.extend(self.ch.relative(p) for p in proposals)
            batch.handled = batch.applied = 1
            log.info("adopted the initial weights proposed by group %d as version 0", group)
            self._commit(batch)
            return 1
        return 0

    # -- commit, state, recovery ---------------------------------------------------------------

    def _commit(self, batch: _Batch, publish: bool | None = None) -> None:
        self.state.last_batch = {"events": batch.events, "delete": batch.delete,
                           "reject": batch.reject}
        self._crash("before_state")
        self._save_state()
        self._crash("after_state")
        if batch.applied if publish is None else publish:
            assert self.state.version is not None
            self.ch.publish_weights(self.state.version, self.state.weights)
            self._crash("after_weights")
            self.ch.prune_weights(self.config.keep_versions)
        self._finish_batch()

    def _finish_batch(self) -> None:
        """Post-commit work of ``last_batch``; idempotent, redone on recovery."""
        self._append_events(self.state.last_batch["events"])
        self._crash("after_events")
        self._write_status()
        self._crash("after_status")
        for rel in self.state.last_batch["delete"]:
            try:
                os.unlink(self.ch.root / rel)
            except FileNotFoundError:
                pass
            self._crash("mid_delete")
        for rel in self.state.last_batch["reject"]:
            self.ch.quarantine(self.ch.root / rel)

    def _save_state(self) -> None:
        self.state.save(self.ch, self.config.optimizer)

    def _recover(self) -> None:
        """Load the durable state and finish whatever the last run left half done."""
        self._healthy = False
        try:
            self._recover_state()
        except StateLost as e:
            self._failure = str(e)
            try:
                self._write_status(phase="failed")
            except OSError:
                pass  # the error still reaches the log and the exit code
            raise
        self._healthy = True

    def _recover_state(self) -> None:
        self.state = DurableState()
        # We hold the lock and only the applier writes applier/ and weights/, so every
        # temporary there is a dead applier's.
        self.ch.clean_stale_temporaries(0.0, dirs=[self.ch.applier_dir, self.ch.weights_dir])
        self.ch.clean_stale_temporaries(self.config.temp_max_age_s)
        self._logged_event_id = self._last_logged_event_id()
        if self.ch.state_path.exists() or self.ch.previous_state_path.exists():
            self.state = self._load_newest_good_state()
            assert self.state.version is not None
            # Events logged before any state existed (rejected proposals) keep their ids.
            self.state.event_id = max(self.state.event_id, self._logged_event_id)
            latest = self.ch.latest_weights_version()
            if latest is None or latest < self.state.version:
                log.info("republishing weights version %d", self.state.version)
                self.ch.publish_weights(self.state.version, self.state.weights)
                self.ch.prune_weights(self.config.keep_versions)
            self._finish_batch()
            for path in self.ch.pending_proposals():  # a master exists: proposals are moot
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            log.info("recovered state: version %d, %d updates processed", self.state.version,
                     len(self.state.ledger))
            return
        self.state.event_id = self._logged_event_id
        latest = self.ch.read_latest_weights()
        batch = _Batch()
        if latest is not None:
            log.warning("no applier state but weights version %d exist: adopting them with "
                        "fresh optimizer slots", latest[0])
            self.state.adopt(latest[1], latest[0], self.rule.slots)
            self._event(batch, "adopted", version=latest[0], reason="no state; newest weights")
            self._commit(batch, publish=False)
        elif self._initial is not None:
            reason = invalid_initial(self._initial)
            if reason:
                raise ValueError(f"initial weights: {reason}")
            self.state.adopt(self._initial, 0, self.rule.slots)
            self._event(batch, "init", version=0, reason="given to the applier")
            batch.delete.extend(self.ch.relative(p) for p in self.ch.pending_proposals())
            self._commit(batch, publish=True)
        else:
            self._write_status()

    def _load_newest_good_state(self) -> DurableState:
        """The newest generation that reads back whole; an older one is brought forward with
        the events logged after it (which the ledger, the counters and the version follow) and
        the weights those events published, then committed at once. StateLost if none can be."""
        damaged = []
        for path in (self.ch.state_path, self.ch.previous_state_path):
            try:
                state = DurableState.load(self.ch, self.config.optimizer, self.rule.slots, path)
            except FileNotFoundError:
                damaged.append(f"{path.name} is missing")
                continue
            except CorruptFile as e:
                damaged.append(f"{path.name} is damaged ({e})")
                continue
            if path == self.ch.state_path:
                return state
            older = state.version
            replayed = self._replay_events(state, "; ".join(damaged))
            if self.ch.state_path.exists():
                self.ch.quarantine(self.ch.state_path)  # kept for inspection, not rotated over the good one
            elif not replayed:
                return state  # killed between the two renames of a commit: nothing was lost
            state.recovered = (f"{'; '.join(damaged)}: recovered from {path.name} (version {older}) "
                               f"and the {replayed} events logged after it: version {state.version}, "
                               f"{len(state.ledger)} updates processed")
            log.warning("applier state: %s", state.recovered)
            self.state = state
            self._save_state()
            return state
        raise StateLost(f"no usable applier state in {self.ch.applier_dir}: {'; '.join(damaged)}; "
                        "the master cannot go on without applying updates twice")

    def _replay_events(self, state: DurableState, why: str) -> int:
        """Bring an older generation forward by the events logged after it: the events of the
        batches committed since (their weights are published before their events are logged).
        The rule's slots stay the older generation's. Returns how many events were replayed."""
        replayed = applied = 0
        for ev in self._logged_events(state.event_id):
            if ev["event_id"] != state.event_id + 1:
                raise StateLost(f"{why}; the events log misses events {state.event_id + 1} to "
                                f"{ev['event_id'] - 1}: the older state cannot be brought forward")
            state.event_id = ev["event_id"]
            replayed += 1
            kind, group, seq = ev.get("event"), ev.get("group"), ev.get("seq")
            if kind in ("applied", "dropped"):
                staleness = int(ev.get("staleness") or 0)
                for st in (state.staleness, state.group_staleness.setdefault(str(group), new_stats())):
                    st["count"] += 1
                    st["sum"] += staleness
                    st["max"] = max(st["max"], staleness)
                state.ledger.add(group, seq)
                if kind == "dropped":
                    state.counters["dropped_stale"] += 1
                    continue
                state.counters["applied"] += 1
                applied += 1
                if self.config.max_staleness is not None and staleness > self.config.max_staleness:
                    state.counters["downweighted"] += 1
                state.t += 1
                state.version = ev["version"]
                state.last_apply_time = ev["time"]
            elif kind == "rejected":
                if group is not None and seq is not None:
                    state.counters["rejected_invalid"] += 1
                    state.ledger.add(group, seq)
                else:
                    state.counters["rejected_corrupt"] += 1
                if ev.get("file"):  # the post-commit move may not have happened
                    state.last_batch["reject"].append(self.ch.relative(self.ch.updates_dir / ev["file"]))
            elif kind in ("duplicate", "vanished"):
                state.counters["duplicates" if kind == "duplicate" else "vanished"] += 1
            else:
                raise StateLost(f"{why}; the events log holds a {kind!r} event after the older "
                                "state: it cannot be brought forward")
        if applied:
            try:
                _, tensors = self.ch.read_weights(state.version)
            except (OSError, CorruptFile) as e:
                raise StateLost(f"{why}; the weights of version {state.version}, which the events "
                                f"log reaches, cannot be read ({e})") from None
            if set(tensors) != set(state.weights):
                raise StateLost(f"{why}; the weights of version {state.version} are not the master's")
            state.weights = {k: np.array(tensors[k], copy=True, order="C") for k in state.weights}
        return replayed

    def _logged_events(self, after: int):
        """The events logged with an id above ``after``, oldest first (rotated file first; the
        newest lines of each, which hold them: the caller checks that none is missing)."""
        for path in (self._rotated_events_path, self.ch.events_path):
            for ev in read_jsonl(path):
                if type(ev.get("event_id")) is int and ev["event_id"] > after:
                    yield ev

    # -- events, status, lock ------------------------------------------------------------------

    @property
    def _rotated_events_path(self) -> Path:
        return self.ch.events_path.with_name(self.ch.events_path.name + ".1")

    def _last_logged_event_id(self) -> int:
        """The id of the last complete event line (looking into the rotated log if needed)."""
        for path in (self.ch.events_path, self._rotated_events_path):
            for ev in reversed(read_jsonl(path, max_bytes=1 << 20)):
                if type(ev.get("event_id")) is int:
                    return ev["event_id"]
        return 0

    def _append_events(self, events: list[dict[str, Any]]) -> None:
        new = [ev for ev in events if ev["event_id"] > self._logged_event_id]
        if not new:
            return
        # we are the only writer (we hold the lock): a failed append leaves no event half logged
        size = append_jsonl(self.ch.events_path, *new, access=self.ch.access, fsync=self.ch.fsync)
        self._logged_event_id = new[-1]["event_id"]
        if size > self.config.events_max_bytes:  # keep one rotated file: disk use stays bounded
            os.replace(self.ch.events_path, self._rotated_events_path)

    def status(self, phase: str | None = None) -> dict[str, Any]:
        pending = self._listed if self._listed is not None else {r.name for r in self.ch.pending_updates()}
        done = {Path(rel).name for rel in self.state.last_batch["delete"] + self.state.last_batch["reject"]}
        st = self.state.staleness
        if phase is None:
            phase = "waiting_for_initial_weights" if self.state.version is None else "running"
        return {
            "run_id": self.ch.run_id, "phase": phase, "master_version": self.state.version,
            "optimizer": self.config.optimizer, "lr": self.config.lr, "counts": dict(self.state.counters),
            "backlog": len(pending - done),
            "staleness": {"count": st["count"], "max": st["max"],
                          "mean": st["sum"] / st["count"] if st["count"] else None},
            "last_apply_time": self.state.last_apply_time,
            "last_seq": {str(g): s for g, s in sorted(self.state.ledger.last_seq().items())},
            "groups": {g: {"updates": gs["count"], "staleness_max": gs["max"],
                           "staleness_mean": gs["sum"] / gs["count"] if gs["count"] else None}
                       for g, gs in sorted(self.state.group_staleness.items(), key=lambda kv: int(kv[0]))},
            "processed": len(self.state.ledger), "pid": os.getpid(), "host": socket.gethostname(),
            "error": self._failure, "recovered": self.state.recovered,
            "cpu_per_update_s": self.cpu_seconds / self.cpu_updates if self.cpu_updates else None,
            "updated": time.time(),
        }

    def _write_status(self, phase: str | None = None) -> None:
        data = json.dumps(self.status(phase), indent=1, allow_nan=False).encode() + b"\n"
        # advisory and rewritten every batch: atomic, not durable (see the protocol's "Publishing")
        atomic_write_bytes(self.ch.status_path, data, fsync=False, access=self.ch.access)
        self._last_status = time.time()

    def _acquire_lock(self) -> int | None:
        fd = os.open(self.ch.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     self.ch.access.file_mode)
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(f"another applier holds {self.ch.lock_path}") from None
        except OSError as e:
            log.warning("flock on %s unsupported (%s): make sure only one applier runs",
                        self.ch.lock_path, e)
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        return fd
