"""The group root's side of the asynchronous exchange (the engine's `GroupSync`).

Every `exchange.every` = H synchronous steps the root publishes one update, tagged with the master
version its weights came from, and then checks -- with a directory listing -- whether the applier
has published a newer master version; if so it reads it and the engine broadcasts it inside the
group. What an update holds depends on `exchange.kind` (the exchange protocol's docstring,
:mod:`hpcdl.exchange`, has the rules): `gradient`, the mean of the group-averaged gradients of
the last H steps; `delta`, the parameter delta `θ_base − θ_local` of the H local steps, where
`θ_base` is what those steps started from. An adoption replaces the weights only: the engine's
inner optimizer keeps its slots.

A root waits for the applier only with `exchange.max_outstanding = K ≥ 1`: it goes on training
once fewer than K of its published updates are unanswered (K = 1: each update's answer, the
newest master including it, is awaited, as the paper's parameter server did), for at most
`exchange.reply_timeout_s`; after a timeout it stops waiting until the applier answers again, so
a group keeps training when the applier is slow or down, and the channel's backlog bound keeps
the directory from growing. On start and on restart the root takes the newest master weights (or
proposes its own, so that all groups start from the same version 0).

Every channel of a run is keyed by the run's secret (`run.key`, see hpcdl.runkey): files written
without it are rejected by the applier and by the groups.

A publish that fails because the disk or the quota is full (ENOSPC, EDQUOT) leaves nothing behind
(the channel removes its temporary) and does not stop training: the update is kept in memory and
published, with the next sequence number, at the next exchange -- so sequence numbers stay
contiguous and the applier's exactly-once ledger sees no gap. At most `max_pending_per_group`
updates are kept (the oldest are dropped and counted, as the channel's backlog bound does on
disk). The problem is recorded in the group's storage report (`hpcdl status` shows it) and
cleared by the next successful publish.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

import numpy as np

from hpcdl.exchange import Channel
from hpcdl.runs import RunDir
from hpcdl.storage import StorageReport, is_storage_full, storage_report

log = logging.getLogger("hpcdl.hybrid")

INITIAL_WAIT_S = 60.0
DEFAULT_UNPUBLISHED = 4  # updates kept in memory while publishing fails, without a channel bound


def run_channel(run: RunDir, job, *, create: bool = True, **kwargs: Any) -> Channel:
    """The run's exchange channel: the run's key, the run's access policy."""
    return Channel(run.exchange_dir(job), run.run_id, create=create, signer=run.signer(),
                   access=run.access(job), **kwargs)


Arrays = dict[str, np.ndarray]
REPLY_POLL_S = 0.02


class ExchangeSync:
    def __init__(self, channel: Channel, group: int, every: int, initial_wait_s: float = INITIAL_WAIT_S,
                 report: StorageReport | None = None, *, kind: str = "gradient",
                 max_outstanding: int = 0, reply_timeout_s: float = 60.0,
                 delta_dtype: str = "float32"):
        self.channel = channel
        self.group = group
        self.every = every
        self.kind = kind
        self.max_outstanding = max_outstanding
        self.reply_timeout_s = reply_timeout_s
        self.delta_dtype = np.dtype(delta_dtype)
        self.initial_wait_s = initial_wait_s
        self.report = report
        self.version = -1  # master version our weights derive from; -1: our own weights
        self.seq = channel.next_seq(group)
        self.published = 0
        self.adopted = 0
        self.seconds = 0.0
        self.wait_seconds = 0.0
        self.reply_timeouts = 0
        self.last_exchange: float | None = None
        self.base: Arrays | None = None  # delta: the weights the current local steps began from
        self.grad_sum: Arrays | None = None  # gradient, every > 1: the sum since the last publish
        self.grad_count = 0  # how many gradients grad_sum holds (fewer than H after a restart)
        self.interrupt: Callable[[], bool] | None = None  # a stop request ends a wait at once
        self.answered = -1  # the newest seq of ours the applier reports processed
        self._silent_at = None  # after a timeout: `answered` then; no waiting until it moves
        # (base_version, tensors) computed but not yet published (the disk or quota was full)
        self.unpublished: collections.deque[tuple[int, Arrays]] = collections.deque()
        self.publish_failures = 0
        self.unpublished_dropped = 0

    @classmethod
    def for_run(cls, run: RunDir, job, group: int) -> "ExchangeSync":
        x = job.exchange
        channel = run_channel(run, job, max_pending_per_group=x.max_pending_per_group)
        return cls(channel, group, x.every, report=storage_report(run.storage_file(group)),
                   kind=x.kind, max_outstanding=x.max_outstanding,
                   reply_timeout_s=x.reply_timeout_s, delta_dtype=x.delta_dtype)

    def initial_weights(self, names_and_values: Arrays) -> Arrays:
        start = time.perf_counter()
        latest = self.channel.read_latest_weights()
        if latest is None:
            latest = self.channel.initial_weights(self.group, names_and_values, timeout=self.initial_wait_s)
        self.seconds += time.perf_counter() - start
        if latest is None:
            weights = names_and_values  # no applier yet: train on our own weights
        else:
            self.version, weights = latest
            self.adopted += 1
            self.last_exchange = time.time()
        self.base = _copy(weights)
        return weights

    def after_step(self, step: int, grads: Callable[[], Arrays],
                   weights: Callable[[], Arrays] | None = None) -> Arrays | None:
        """Publish when due (the update this kind calls for); return newer master weights or None."""
        if self.kind == "gradient" and self.every > 1:
            self._accumulate(grads())
        if step % self.every:
            return None
        start = time.perf_counter()
        local = None
        if self.kind == "delta":
            assert weights is not None and self.base is not None, "delta: weights, after initial_weights()"
            local = weights()
            update = {n: (self.base[n] - v).astype(self.delta_dtype) for n, v in local.items()}
        elif self.every > 1:
            update = {n: g / self.grad_count for n, g in self.grad_sum.items()}
            self.grad_sum, self.grad_count = None, 0
        else:
            update = grads()
        self.unpublished.append((self.version, update))
        self.publish_pending()
        if self.max_outstanding:
            self._await_replies()
        adopted = None
        newest = self.channel.latest_weights_version()
        if newest is not None and newest > self.version:
            latest = self.channel.read_latest_weights()
            if latest is not None and latest[0] > self.version:
                self.version, adopted = latest
                self.adopted += 1
        if self.kind == "delta":
            self.base = _copy(adopted) if adopted is not None else local
        self.last_exchange = time.time()
        self.seconds += time.perf_counter() - start
        return adopted

    def unanswered(self) -> int:
        """Published updates of this group that the applier has not processed yet."""
        self.answered = self.channel.answered_seq(self.group)
        return max(0, min(self.published, self.seq - 1 - self.answered))

    def _await_replies(self) -> None:
        start = time.monotonic()
        deadline = start + self.reply_timeout_s
        while self.unanswered() >= self.max_outstanding:
            if self._silent_at is not None and self.answered <= self._silent_at:
                break  # still silent since the last timeout: do not wait again
            self._silent_at = None
            if self.interrupt is not None and self.interrupt():
                break  # SLURM's warning signal: checkpoint first, answers can wait
            if time.monotonic() >= deadline:
                self.reply_timeouts += 1
                self._silent_at = self.answered
                log.warning("no answer from the applier for %g s: training on without waiting "
                            "until it answers", self.reply_timeout_s)
                break
            time.sleep(REPLY_POLL_S)
        self.wait_seconds += time.monotonic() - start

    def _accumulate(self, grads: Arrays) -> None:
        self.grad_count += 1
        if self.grad_sum is None:
            self.grad_sum = {n: np.array(g, dtype=np.float64 if g.dtype == np.float64 else np.float32)
                             for n, g in grads.items()}
        else:
            for n, g in grads.items():
                self.grad_sum[n] += g

    def publish_pending(self) -> bool:
        """Publish the updates kept in memory, oldest first; False if the disk/quota is full.

        Sequence numbers are given at publish time, so a failed publish leaves no gap.
        """
        while self.unpublished:
            base_version, tensors = self.unpublished[0]
            try:
                self.channel.publish_update(self.group, self.seq, base_version, tensors)
            except OSError as exc:
                if not is_storage_full(exc):
                    raise
                self.publish_failures += 1
                bound = self.channel.max_pending_per_group or DEFAULT_UNPUBLISHED
                while len(self.unpublished) > bound:
                    self.unpublished.popleft()
                    self.unpublished_dropped += 1
                if self.report is not None:
                    self.report.failed("exchange publish", exc, path=self.channel.updates_dir,
                                       detail=f"{len(self.unpublished)} updates held in memory, "
                                              f"{self.unpublished_dropped} dropped")
                else:
                    log.warning("publish failed (%s); %d updates held", exc, len(self.unpublished))
                return False
            self.unpublished.popleft()
            self.seq += 1
            self.published += 1
        if self.report is not None:
            self.report.succeeded("exchange publish")
        return True

    def stats(self) -> dict[str, Any]:
        return {
            "exchange_kind": self.kind,
            "exchange_version": self.version,
            "exchange_published": self.published,
            "exchange_adopted": self.adopted,
            "exchange_seconds": self.seconds,
            "exchange_last_s": self.last_exchange,
            "exchange_backlog_dropped": self.channel.dropped_backlog,
            "exchange_publish_failures": self.publish_failures,
            "exchange_unpublished": len(self.unpublished),
            "exchange_unpublished_dropped": self.unpublished_dropped,
            "exchange_wait_seconds": self.wait_seconds,
            "exchange_reply_timeouts": self.reply_timeouts,
        }


def _copy(tensors: Arrays) -> Arrays:
    return {n: np.array(v, copy=True) for n, v in tensors.items()}


def adopt_master_weights(run: RunDir, job, model) -> int | None:
    """Load the run's newest master weights into `model`; returns the version, None if none."""
    try:
        channel = run_channel(run, job, create=False)
    except FileNotFoundError:
        return None
    latest = channel.read_latest_weights()
    if latest is None:
        return None
    version, tensors = latest
    for name, var in model.named_variables():
        if name not in tensors or tuple(tensors[name].shape) != tuple(var.shape):
            raise ValueError(f"master weights v{version} do not fit this model ({name})")
        var.assign(tensors[name])
    return version
