"""The applier: the parameter-server role of the hybrid scheme (Kurth et al., SC17).

A process of its own (``python -m hpcdl.applier --exchange DIR --run-id ID``), pure numpy +
stdlib. It keeps the master weights and its own optimizer, applies each group's update (the
group-averaged gradient published by the group root through :class:`hpcdl.exchange.Channel`) in
arrival order, and publishes new master weight versions. Groups never wait for it.

Versions and staleness
======================
The master version is the number of updates applied since version 0 (the adopted initial
weights). A batch of updates is applied one by one (each increments the version) and then
committed once; the weights of the batch's last version are published, so published versions may
skip numbers. The staleness of an update is ``master version at apply time - base_version``, where
``base_version`` is the master version the group's weights came from (-1: the group trains on its
own weights). It is recorded for every update (events.jsonl, status.json). With
``max_staleness=S``, an update with staleness > S is dropped (``stale_policy="drop"``: counted,
logged, deleted unapplied) or applied with learning rate ``lr / (1 + staleness)``
(``stale_policy="downweight"``). Updates of any staleness are applied when ``max_staleness`` is
None.

Update rules
============
``optimizer`` names one of :data:`hpcdl.applier.rules.UPDATE_RULES` (sgd, momentum, adam,
nesterov; their formulas are in that module). With ``staleness_scaling`` every update is applied
at ``lr / max(1, staleness)`` (Zhang et al., "Staleness-aware Async-SGD"), before and
independently of the ``max_staleness`` policy.

Slots have the master's dtype. An update must carry exactly the master's tensor names and shapes
and finite values, otherwise it is rejected (``rejected_invalid``).

Durable state and exactly-once
==============================
Everything the applier knows lives in ONE file, ``applier/state.hx`` (exchange format, kind
"state"), published atomically (temporary, fsync, rename, fsync dir): master weights, optimizer
slots and step, version, the ledger of processed (group, seq) pairs (per-group intervals), the
counters (applied, dropped_stale, downweighted, rejected_corrupt, rejected_invalid, duplicates,
vanished, rejected_proposals), staleness statistics, the event counter, and ``last_batch``: the
events of the last committed batch and the files it must delete or move aside.

One batch: (1) list pending updates, (2) read/validate/apply up to ``max_batch`` of them in
memory, (3) COMMIT: write state.hx, (4) publish weights of the new version and prune old
versions, (5) append the batch's events to events.jsonl, (6) write status.json, (7) delete the
applied/dropped/duplicate update files, move rejected files to ``applier/rejected/``.

Crash points (kill -9 anywhere; on restart the newest state.hx is loaded first):
* before or during (3): the old state.hx is intact (a half-written temporary is removed on
  restart); no update file was deleted, so the whole batch is applied again from the old state:
  none lost, none applied twice.
* after (3), before or during (4): restart sees the newest published version < state version and
  republishes the weights; stale versions are pruned at the next publish.
* after (4), before or during (5): restart reads the last event id in events.jsonl and appends
  the events of ``last_batch`` that are missing (a torn last line is terminated first and skipped
  by readers), so every event is logged once.
* after (5), before or during (7): restart redoes (6) and (7) from ``last_batch`` (deleting or
  moving a file twice is harmless). Independently, any pending update whose (group, seq) is in the
  ledger is deleted without being applied (counted as ``duplicates``; this also covers a publisher
  that republished a pair).
Only one applier may run per exchange directory: it holds an exclusive ``flock`` on
``applier/lock`` (released by the kernel on kill -9). Where the file system has no flock (Lustre
mounted without ``-o flock``), a warning is logged and single-instance is the operator's job.

Bad input never stops the applier: a corrupt file (CorruptFile: bad checksum, truncated, lying
header, not our format, wrong run id, ...) or an entry it cannot read at all (a directory, no
permission) is counted as ``rejected_corrupt``, logged and moved aside; a well-formed update that does not fit the master is ``rejected_invalid``. An update file
deleted by its publisher before it was read (backlog bound) is counted as ``vanished``. I/O errors
on the exchange directory itself (OSError) make :meth:`Applier.run` reload the durable state and
retry with backoff; it does not process anything until that reload has succeeded.

Authentication: the applier reads and writes with its channel's signer. A run's applier
(``python -m hpcdl.worker RUN --applier``) uses the run's key, so an update, proposal or state
written without it (missing tag, plain SHA-256 tag, or an HMAC under another key) is rejected as
``rejected_corrupt`` with a reason that says so, logged and moved aside like any corrupt file.
An update file larger than the master's tensors can need (every element as 8 bytes, plus the
largest header) is refused before it is read, so a huge file cannot make the applier allocate
its size.

Full disk and quota: a commit that fails (ENOSPC/EDQUOT while writing the state, the weights, the
events or the status) changes nothing durable: the state and the weights are published through
temporaries, a partly appended events line is cut off again, and the update files stay pending.
The applier records the problem in ``applier/storage.json`` (a fixed-size file rewritten in
place; ``hpcdl status`` shows it), reloads its state and retries with backoff; groups keep
training. The next successful commit clears the problem.

Initial weights
===============
Order of precedence at start: state.hx; else the newest published weights (state lost: adopted
with fresh optimizer slots, a warning); else ``initial`` passed to the constructor (version 0);
else the applier waits for proposals in ``init/`` and adopts the first valid one (arrival order)
as version 0, deleting the others.

Status for humans and tools
===========================
``applier/storage.json``: storage problems (see :mod:`hpcdl.storage`).
``applier/events.jsonl``: one JSON object a line (rotated to ``events.jsonl.1`` past
``events_max_bytes``; readers skip a line that does not parse, e.g. one torn by a crash): ``event_id``, ``time``, ``event`` (applied |
dropped | rejected | duplicate | vanished | init | adopted), ``group``, ``seq``, ``base_version``,
``staleness``, ``version``, ``scale``, ``reason``, ``file`` (those that apply).
``applier/status.json`` (replaced atomically at each commit and every ``status_interval`` s when
idle): ``phase``, ``master_version``, ``counts``, ``backlog``, ``staleness`` {count, mean, max}, ``groups`` {group: {updates, staleness_mean, staleness_max}},
``last_apply_time``, ``last_seq`` per group, ``pid``, ``host``, ``updated``.

Signals: SIGTERM, SIGINT and SIGUSR1 make the process finish the update in progress, commit,
and exit 0.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from hpcdl.applier.rules import UPDATE_RULES, RuleParams, make_rule
from hpcdl.config import STALE_POLICIES
from hpcdl.exchange import (
    ALIGN, MAX_HEADER_BYTES, PREFIX_SIZE, Channel, CorruptFile, Signer, UpdateRef,
    atomic_write_bytes, read_file, write_file,
)
from hpcdl.files import append_lines
from hpcdl.storage import REPORT_FILE, StorageReport, is_storage_full

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("hpcdl.applier")

COUNTERS = ("applied", "dropped_stale", "downweighted", "rejected_corrupt", "rejected_invalid",
            "duplicates", "vanished", "rejected_proposals")
CLEAN_INTERVAL_S = 10.0  # how often temporaries older than temp_max_age_s are removed
CRASH_ENV = "HPCDL_APPLIER_CRASH"  # testing only: "point[:n]" -> SIGKILL itself at the nth hit


def _new_stats() -> dict[str, int]:
    return {"count": 0, "sum": 0, "max": 0}


class AlreadyRunning(RuntimeError):
    """Another applier holds the lock of this exchange directory."""


class Ledger:
    """Processed (group, seq) pairs, kept per group as sorted disjoint inclusive intervals."""

    def __init__(self) -> None:
        self._iv: dict[int, list[list[int]]] = {}

    def __contains__(self, key: tuple[int, int]) -> bool:
        group, seq = key
        ivs = self._iv.get(group, [])
        i = bisect.bisect_right(ivs, seq, key=lambda iv: iv[0])
        return i > 0 and ivs[i - 1][1] >= seq

    def add(self, group: int, seq: int) -> None:
        ivs = self._iv.setdefault(group, [])
        i = bisect.bisect_right(ivs, seq, key=lambda iv: iv[0])
        if i > 0 and ivs[i - 1][1] >= seq:
            return
        left = i > 0 and ivs[i - 1][1] == seq - 1
        right = i < len(ivs) and ivs[i][0] == seq + 1
        if left and right:
            ivs[i - 1][1] = ivs[i][1]
            del ivs[i]
        elif left:
            ivs[i - 1][1] = seq
        elif right:
            ivs[i][0] = seq
        else:
            ivs.insert(i, [seq, seq])

    def seen(self, group: int, seq: int) -> bool:
        """True for a processed pair and for any seq below the group's newest processed one.

        A group's updates are processed in seq order, so a lower seq arriving later is a replay
        (of a processed update, or of one the backlog bound deleted): never applied as new.
        """
        ivs = self._iv.get(group)
        return bool(ivs) and seq <= ivs[-1][1]

    def __len__(self) -> int:
        return sum(b - a + 1 for ivs in self._iv.values() for a, b in ivs)

    def last_seq(self) -> dict[int, int]:
        return {g: ivs[-1][1] for g, ivs in self._iv.items() if ivs}

    def pairs(self) -> list[tuple[int, int]]:
        return [(g, s) for g in sorted(self._iv) for a, b in self._iv[g] for s in range(a, b + 1)]

    def to_array(self) -> np.ndarray:
        rows = [(g, a, b) for g in sorted(self._iv) for a, b in self._iv[g]]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    @classmethod
    def from_array(cls, arr: np.ndarray) -> "Ledger":
        ledger = cls()
        for g, a, b in np.asarray(arr, dtype=np.int64).reshape(-1, 3).tolist():
            ledger._iv.setdefault(g, []).append([a, b])
        for ivs in ledger._iv.values():
            ivs.sort()
        return ledger


class _Batch:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.delete: list[str] = []  # paths relative to the channel root
        self.reject: list[str] = []
        self.applied = 0
        self.handled = 0
        self.read = 0  # update files read (not vanished, not a duplicate)


class Applier:
    """The parameter server. See the module docstring for the protocol and crash analysis.

    Construction takes the lock and recovers from the durable state; then call :meth:`run`
    (or :meth:`step` for one batch). Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        channel: Channel,
        optimizer: str = "adam",
        lr: float = 1e-3,
        *,
        max_staleness: int | None = None,
        stale_policy: str = "drop",
        keep_versions: int = 3,
        max_batch: int = 8,
        momentum: float = 0.9,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        momentum_delay: int = 1,
        staleness_scaling: bool = False,
        initial: Mapping[str, np.ndarray] | None = None,
        temp_max_age_s: float = 600.0,
        status_interval: float = 5.0,
        events_max_bytes: int = 64 << 20,
        lock: bool = True,
    ):
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"stale_policy must be one of {STALE_POLICIES}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 or None")
        if keep_versions < 1 or max_batch < 1:
            raise ValueError("keep_versions and max_batch must be >= 1")
        self.ch = channel
        self.optimizer = optimizer
        self.lr = float(lr)
        self.rule = make_rule(optimizer, RuleParams(lr=self.lr, momentum=momentum, beta1=beta1,
                                                    beta2=beta2, eps=eps, delay=momentum_delay))
        self.staleness_scaling = staleness_scaling
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.keep_versions = keep_versions
        self.max_batch = max_batch
        self.temp_max_age_s = temp_max_age_s
        self.events_max_bytes = events_max_bytes
        self.status_interval = status_interval
        self._initial = dict(initial) if initial is not None else None
        self._stop = False
        self.cpu_seconds, self.cpu_updates = 0.0, 0  # this process's, since it started
        self._listed: set[str] | None = None  # the update files the last step listed
        self._crash = _parse_crash_spec(os.environ.get(CRASH_ENV))
        self._crash_hits = 0
        self._last_status = 0.0
        self._lock_fd = self._acquire_lock() if lock else None
        self.storage = StorageReport(self.ch.applier_dir / REPORT_FILE, self.ch.access)
        self._healthy = False  # True once the durable state is loaded and consistent
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
    def counts(self) -> dict[str, int]:
        return dict(self.counters)

    def step(self) -> int:
        """Process one batch of pending files (or adopt initial weights); returns files handled."""
        if self.version is None:
            return self._try_init()
        cpu = time.process_time()
        refs = self.ch.pending_updates()
        self._listed = {r.name for r in refs}  # status.json's backlog, without a second listing
        if not refs:
            return 0
        batch = _Batch()
        for ref in refs[: self.max_batch]:
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
                try:
                    if not self._healthy:
                        self._recover()
                        self.storage.succeeded("applier commit")
                    n = self.step()
                except OSError as e:
                    # Nothing is processed on a state that did not reload completely: a failed
                    # reload leaves _healthy False and is retried first, next time round.
                    self._healthy = False
                    if is_storage_full(e):
                        self.storage.failed("applier commit", e, path=self.ch.root,
                                            detail="nothing lost: the updates stay pending; "
                                                   "retrying")
                    else:
                        log.exception("I/O error; reloading the durable state, retrying in %.1fs",
                                      backoff)
                    time.sleep(backoff)
                    backoff = min(max(backoff, 0.05) * 2, 10.0)
                    continue
                if n:
                    self.storage.succeeded("applier commit")
                backoff = poll_interval
                now = time.monotonic()
                # Busy or idle: a killed writer's temporary must not outlive the bound for long.
                if now - last_clean >= CLEAN_INTERVAL_S:
                    self.ch.clean_stale_temporaries(self.temp_max_age_s)
                    last_clean = now
                if n:
                    handled += n
                    last_activity = now
                    continue
                if idle_exit_after is not None and now - last_activity >= idle_exit_after:
                    break
                if time.time() - self._last_status >= self.status_interval:
                    try:
                        self._write_status()
                        self.storage.succeeded("applier status")
                    except OSError as e:
                        if not is_storage_full(e):
                            raise
                        self.storage.failed("applier status", e, path=self.ch.status_path)
                        self._last_status = time.time()
                time.sleep(poll_interval)
        finally:
            try:
                self.ch.clean_stale_temporaries(self.temp_max_age_s)  # leave no dead writer's
                self._write_status(phase="stopped")
            except OSError:
                log.exception("could not write the final status")
        return handled

    # -- processing ----------------------------------------------------------------------------

    def _event(self, batch: _Batch | None, event: str, **fields: Any) -> dict[str, Any]:
        self.event_id += 1
        ev = {"event_id": self.event_id, "time": time.time(), "event": event, **fields}
        if batch is not None:
            batch.events.append(ev)
        return ev

    def _process(self, ref: UpdateRef, batch: _Batch) -> None:
        rel = f"updates/{ref.name}"
        key = (ref.group, ref.seq)
        batch.handled += 1
        if self.ledger.seen(*key):
            self.counters["duplicates"] += 1
            batch.delete.append(rel)
            self._event(batch, "duplicate", group=ref.group, seq=ref.seq, file=ref.name)
            log.info("update group %d seq %d already processed: deleting", *key)
            return
        try:
            upd = self.ch.read_update(ref, max_bytes=self._max_update_bytes)
        except FileNotFoundError:
            self.counters["vanished"] += 1
            self._event(batch, "vanished", group=ref.group, seq=ref.seq, file=ref.name)
            return
        except (CorruptFile, IsADirectoryError, PermissionError) as e:
            # Permanent: retrying cannot help. (Other OSErrors, e.g. EIO, may be transient: they
            # propagate and run() retries after reloading the durable state.)
            reason = str(e) if isinstance(e, CorruptFile) else f"unreadable: {type(e).__name__}"
            self.counters["rejected_corrupt"] += 1
            batch.reject.append(rel)
            self._event(batch, "rejected", file=ref.name, reason=reason)
            log.warning("rejected %s: %s", ref.name, reason)
            return
        batch.read += 1
        reason = self._invalid_update(upd.tensors)
        if reason:
            self.counters["rejected_invalid"] += 1
            self.ledger.add(*key)
            batch.reject.append(rel)
            self._event(batch, "rejected", group=upd.group, seq=upd.seq, file=ref.name,
                        reason=reason)
            log.warning("rejected %s: %s", ref.name, reason)
            return
        assert self.version is not None
        staleness = self.version - upd.base_version
        if staleness < 0:
            log.warning("update group %d seq %d has base_version %d ahead of master %d",
                        upd.group, upd.seq, upd.base_version, self.version)
            staleness = 0
        for st in (self.staleness, self.group_staleness.setdefault(str(upd.group), _new_stats())):
            st["count"] += 1
            st["sum"] += staleness
            st["max"] = max(st["max"], staleness)
        scale = 1.0 / max(1, staleness) if self.staleness_scaling else 1.0
        if self.max_staleness is not None and staleness > self.max_staleness:
            if self.stale_policy == "drop":
                self.counters["dropped_stale"] += 1
                self.ledger.add(*key)
                batch.delete.append(rel)
                self._event(batch, "dropped", group=upd.group, seq=upd.seq,
                            base_version=upd.base_version, staleness=staleness,
                            version=self.version, reason="stale")
                log.info("dropped update group %d seq %d: staleness %d > %d", upd.group,
                         upd.seq, staleness, self.max_staleness)
                return
            scale = min(scale, 1.0 / (1.0 + staleness))
            self.counters["downweighted"] += 1
        self._apply(upd.tensors, scale)
        self.version += 1
        self.counters["applied"] += 1
        self.ledger.add(*key)
        self.last_apply_time = time.time()
        batch.delete.append(rel)
        batch.applied += 1
        self._event(batch, "applied", group=upd.group, seq=upd.seq,
                    base_version=upd.base_version, staleness=staleness, version=self.version,
                    scale=scale)

    def _invalid_update(self, tensors: Mapping[str, np.ndarray]) -> str | None:
        if set(tensors) != set(self.weights):
            return "tensor names differ from the master's"
        for name, w in self.weights.items():
            g = tensors[name]
            if g.shape != w.shape:
                return f"tensor {name!r}: shape {g.shape} != master {w.shape}"
            if g.dtype.kind not in "iuf":
                return f"tensor {name!r}: dtype {g.dtype} is not real-valued"
            if g.dtype.kind == "f" and not np.isfinite(g).all():
                return f"tensor {name!r}: non-finite values"
        return None

    def _apply(self, update: Mapping[str, np.ndarray], scale: float) -> None:
        self.t += 1
        self.rule.apply(self.weights, self.slots, update, scale, self.t)

    # -- initial weights -----------------------------------------------------------------------

    @staticmethod
    def _invalid_initial(tensors: Mapping[str, np.ndarray]) -> str | None:
        if not tensors:
            return "no tensors"
        for name, w in tensors.items():
            if np.asarray(w).dtype.kind != "f":
                return f"tensor {name!r}: master weights must be floating point"
            if not np.isfinite(w).all():
                return f"tensor {name!r}: non-finite values"
        return None

    @property
    def _max_update_bytes(self) -> int:
        """The largest update file that can fit the master: 8-byte elements, aligned, max header."""
        return PREFIX_SIZE + MAX_HEADER_BYTES + sum(
            w.size * 8 + ALIGN for w in self.weights.values())

    def _adopt(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        self.weights = {k: np.array(v, copy=True) for k, v in tensors.items()}
        self.slots = {s: {k: np.zeros_like(w) for k, w in self.weights.items()}
                      for s in self.rule.slots}
        self.t = 0
        self.version = version

    def _try_init(self) -> int:
        batch = _Batch()
        proposals = self.ch.pending_proposals()
        for path in proposals:
            try:
                group, tensors = self.ch.read_proposal(path)
                reason = self._invalid_initial(tensors)
            except FileNotFoundError:
                continue
            except (CorruptFile, IsADirectoryError, PermissionError) as e:
                group, reason = None, str(e) or type(e).__name__
            if reason:
                self.counters["rejected_proposals"] += 1
                self.ch.quarantine(path)  # no state to commit yet: move aside at once
                self._append_events([self._event(None, "rejected", group=group,
                                                 file=path.name, reason=reason)])
                log.warning("rejected initial proposal %s: %s", path.name, reason)
                continue
            self._adopt(tensors, 0)
            self._event(batch, "init", group=group, version=0, file=path.name)
            batch.delete.extend(f"init/{p.name}" for p in proposals)
            batch.handled = batch.applied = 1
            log.info("adopted the initial weights proposed by group %d as version 0", group)
            self._commit(batch)
            return 1
        return 0

    # -- commit, state, recovery ---------------------------------------------------------------

    def _commit(self, batch: _Batch, publish: bool | None = None) -> None:
        self.last_batch = {"events": batch.events, "delete": batch.delete,
                           "reject": batch.reject}
        self._crash_point("before_state")
        self._save_state()
        self._crash_point("after_state")
        if batch.applied if publish is None else publish:
            assert self.version is not None
            self.ch.publish_weights(self.version, self.weights)
            self._crash_point("after_weights")
            self.ch.prune_weights(self.keep_versions)
        self._finish_batch()

    def _finish_batch(self) -> None:
        """Post-commit work of ``last_batch``; idempotent, redone on recovery."""
        self._append_events(self.last_batch["events"])
        self._crash_point("after_events")
        self._write_status()
        self._crash_point("after_status")
        for rel in self.last_batch["delete"]:
            try:
                os.unlink(self.ch.root / rel)
            except FileNotFoundError:
                pass
            self._crash_point("mid_delete")
        for rel in self.last_batch["reject"]:
            self.ch.quarantine(self.ch.root / rel)

    def _save_state(self) -> None:
        assert self.version is not None
        tensors: dict[str, np.ndarray] = {f"w/{k}": w for k, w in self.weights.items()}
        for slot, arrays in self.slots.items():
            tensors.update({f"{slot}/{k}": a for k, a in arrays.items()})
        tensors["ledger"] = self.ledger.to_array()
        meta = {
            "optimizer": self.optimizer, "t": self.t, "order": list(self.weights),
            "counters": self.counters, "staleness": self.staleness, "event_id": self.event_id,
            "group_staleness": self.group_staleness,
            "last_batch": self.last_batch, "last_apply_time": self.last_apply_time,
        }
        write_file(self.ch.state_path, run_id=self.ch.run_id, kind="state", tensors=tensors,
                   signer=self.ch.signer, version=self.version, meta=meta, fsync=self.ch.fsync,
                   access=self.ch.access)

    def _reset(self) -> None:
        self.version: int | None = None
        self.weights: dict[str, np.ndarray] = {}
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        self.t = 0
        self.ledger = Ledger()
        self.counters = {k: 0 for k in COUNTERS}
        self.staleness = _new_stats()
        self.group_staleness: dict[str, dict[str, int]] = {}
        self.event_id = 0
        self.last_batch: dict[str, list[Any]] = {"events": [], "delete": [], "reject": []}
        self.last_apply_time: float | None = None

    def _load_state(self) -> None:
        header, tensors = read_file(self.ch.state_path, run_id=self.ch.run_id,
                                    signer=self.ch.signer, kinds=("state",))
        meta = header["meta"]
        if meta["optimizer"] != self.optimizer:
            raise ValueError(f"{self.ch.state_path} was written with optimizer "
                             f"{meta['optimizer']!r}, not {self.optimizer!r}")
        self._reset()
        self.version = header["version"]
        self.weights = {k: tensors[f"w/{k}"] for k in meta["order"]}
        self.slots = {s: {k: tensors[f"{s}/{k}"] for k in meta["order"]}
                      for s in self.rule.slots}
        self.t = meta["t"]
        self.ledger = Ledger.from_array(tensors["ledger"])
        self.counters.update(meta["counters"])
        self.staleness.update(meta["staleness"])
        self.group_staleness = meta.get("group_staleness", {})
        self.event_id = meta["event_id"]
        self.last_batch = meta["last_batch"]
        self.last_apply_time = meta["last_apply_time"]

    def _recover(self) -> None:
        """Load the durable state and finish whatever the last run left half done."""
        self._healthy = False
        self._recover_state()
        self._healthy = True

    def _recover_state(self) -> None:
        self._reset()
        # We hold the lock and only the applier writes applier/ and weights/, so every
        # temporary there is a dead applier's.
        self.ch.clean_stale_temporaries(0.0, dirs=[self.ch.applier_dir, self.ch.weights_dir])
        self.ch.clean_stale_temporaries(self.temp_max_age_s)
        self._logged_event_id = self._last_logged_event_id()
        if self.ch.state_path.exists():
            self._load_state()
            assert self.version is not None
            # Events logged before any state existed (rejected proposals) keep their ids.
            self.event_id = max(self.event_id, self._logged_event_id)
            latest = self.ch.latest_weights_version()
            if latest is None or latest < self.version:
                log.info("republishing weights version %d", self.version)
                self.ch.publish_weights(self.version, self.weights)
                self.ch.prune_weights(self.keep_versions)
            self._finish_batch()
            for path in self.ch.pending_proposals():  # a master exists: proposals are moot
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            log.info("recovered state: version %d, %d updates processed", self.version,
                     len(self.ledger))
            return
        self.event_id = self._logged_event_id
        latest = self.ch.read_latest_weights()
        batch = _Batch()
        if latest is not None:
            log.warning("no applier state but weights version %d exist: adopting them with "
                        "fresh optimizer slots", latest[0])
            self._adopt(latest[1], latest[0])
            self._event(batch, "adopted", version=latest[0], reason="no state; newest weights")
            self._commit(batch, publish=False)
        elif self._initial is not None:
            reason = self._invalid_initial(self._initial)
            if reason:
                raise ValueError(f"initial weights: {reason}")
            self._adopt(self._initial, 0)
            self._event(batch, "init", version=0, reason="given to the applier")
            batch.delete.extend(f"init/{p.name}" for p in self.ch.pending_proposals())
            self._commit(batch, publish=True)
        else:
            self._write_status()

    # -- events, status, lock ------------------------------------------------------------------

    @property
    def _rotated_events_path(self) -> Path:
        return self.ch.events_path.with_name(self.ch.events_path.name + ".1")

    def _last_logged_event_id(self) -> int:
        """The id of the last complete event line (looking into the rotated log if needed)."""
        for path in (self.ch.events_path, self._rotated_events_path):
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    f.seek(max(0, size - (1 << 20)))
                    tail = f.read()
            except FileNotFoundError:
                continue
            for line in reversed(tail.split(b"\n")):
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict) and type(ev.get("event_id")) is int:
                    return ev["event_id"]
        return 0

    def _append_events(self, events: list[dict[str, Any]]) -> None:
        new = [ev for ev in events if ev["event_id"] > self._logged_event_id]
        if not new:
            return
        data = b"".join(json.dumps(ev, separators=(",", ":")).encode() + b"\n" for ev in new)
        # we are the only writer (we hold the lock): a failed append leaves no event half logged
        size = append_lines(self.ch.events_path, data, access=self.ch.access, fsync=self.ch.fsync)
        self._logged_event_id = new[-1]["event_id"]
        if size > self.events_max_bytes:  # keep one rotated file: disk use stays bounded
            os.replace(self.ch.events_path, self._rotated_events_path)

    def status(self, phase: str | None = None) -> dict[str, Any]:
        pending = self._listed if self._listed is not None else {r.name for r in self.ch.pending_updates()}
        done = {Path(rel).name for rel in self.last_batch["delete"] + self.last_batch["reject"]}
        st = self.staleness
        if phase is None:
            phase = "waiting_for_initial_weights" if self.version is None else "running"
        return {
            "run_id": self.ch.run_id, "phase": phase, "master_version": self.version,
            "optimizer": self.optimizer, "lr": self.lr, "counts": dict(self.counters),
            "backlog": len(pending - done),
            "staleness": {"count": st["count"], "max": st["max"],
                          "mean": st["sum"] / st["count"] if st["count"] else None},
            "last_apply_time": self.last_apply_time,
            "last_seq": {str(g): s for g, s in sorted(self.ledger.last_seq().items())},
            "groups": {g: {"updates": gs["count"], "staleness_max": gs["max"],
                           "staleness_mean": gs["sum"] / gs["count"] if gs["count"] else None}
                       for g, gs in sorted(self.group_staleness.items(), key=lambda kv: int(kv[0]))},
            "processed": len(self.ledger), "pid": os.getpid(), "host": socket.gethostname(),
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

    def _crash_point(self, name: str) -> None:
        if self._crash is not None and self._crash[0] == name:
            self._crash_hits += 1
            if self._crash_hits >= self._crash[1]:
                os.kill(os.getpid(), signal.SIGKILL)


def _parse_crash_spec(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, n = spec.partition(":")
    return name, int(n or 1)


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpcdl.applier",
                                description="Run the applier (parameter server) of one run.")
    p.add_argument("--exchange", required=True, type=Path, help="the run's exchange directory")
    p.add_argument("--run-id", required=True)
    p.add_argument("--key-file", type=Path, default=None,
                   help="the run's key (RUN_DIR/run.key): exchange files are authenticated with "
                        "HMAC-SHA256; without it, tags are plain SHA-256 (integrity only)")
    p.add_argument("--optimizer", choices=sorted(UPDATE_RULES), default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--stale-policy", choices=STALE_POLICIES, default="drop")
    p.add_argument("--keep-versions", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--poll-interval", type=float, default=0.05)
    p.add_argument("--idle-exit-after", type=float, default=None,
                   help="exit 0 after this many seconds without work")
    p.add_argument("--status-interval", type=float, default=5.0)
    p.add_argument("--temp-max-age", type=float, default=600.0,
                   help="delete writers' temporaries older than this many seconds")
    p.add_argument("--no-fsync", action="store_true", help="skip fsyncs (local tests only)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signer = Signer()
    if args.key_file is not None:
        from hpcdl.runkey import RunKeyError, load_key_file

        try:
            signer = Signer(load_key_file(args.key_file))
        except RunKeyError as e:
            log.error("cannot start: %s", e)
            return 1
    else:
        log.warning("no --key-file: exchange files are checked for corruption, not authenticated")
    channel = Channel(args.exchange, args.run_id, create=True, fsync=not args.no_fsync,
                      signer=signer)
    try:
        applier = Applier(
            channel, args.optimizer, args.lr, max_staleness=args.max_staleness,
            stale_policy=args.stale_policy, keep_versions=args.keep_versions,
            max_batch=args.max_batch, momentum=args.momentum, beta1=args.beta1,
            beta2=args.beta2, eps=args.eps, status_interval=args.status_interval,
            temp_max_age_s=args.temp_max_age,
        )
    except AlreadyRunning as e:
        log.error("%s", e)
        return 3
    except (CorruptFile, ValueError) as e:  # e.g. a state of another run or optimizer
        log.error("cannot start: %s", e)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, lambda *_: applier.request_stop())
    with applier:
        n = applier.run(poll_interval=args.poll_interval, idle_exit_after=args.idle_exit_after)
    log.info("applier stopped after handling %d files; master version %s", n, applier.version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
