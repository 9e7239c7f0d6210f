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
the directory from growing. For its first `exchange.warmup_steps` steps a root waits as with
K = 1 whatever K is: a cold start needs each update answered before the next (two in flight
could kill the start), while afterwards a second update in flight hides the applier's answer
behind the next step instead of waiting for it. On start and on restart the root takes the newest master weights (or
proposes its own, so that all groups start from the same version 0).

Every channel of a run is keyed by the run's secret (`run.key`, see hpcdl.rundir.runkey): files written
without it are rejected by the applier and by the groups (hpcdl.rundir.run_exchange binds a run's
directory, key and access policy to its channels).

A publish that fails because the disk or the quota is full (ENOSPC, EDQUOT) leaves nothing behind
(the channel removes its temporary) and does not stop training: the update is kept in memory and
published, with the next sequence number, at the next exchange -- so sequence numbers stay
contiguous and the applier's exactly-once ledger sees no gap. The problem is recorded in the group's storage report (`hpcdl status` shows it) and
cleared by the next successful publish. At most `max_pending_per_group` updates are held: once
that many are, the root waits for space (retrying with back-off; training pauses, nothing is
lost); with `exchange.drop_held_updates` it drops the oldest instead and trains on.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

import numpy as np

from hpcdl.exchange import Channel
from hpcdl.exchange.shards import Partition
from hpcdl.fs.storage import StorageReport, is_storage_full

log = logging.getLogger("hpcdl.exchange.group")

INITIAL_WAIT_S = 60.0
DEFAULT_UNPUBLISHED = 4  # updates kept in memory while publishing fails, without a channel bound


Arrays = dict[str, np.ndarray]
REPLY_POLL_S = 0.02


class ExchangeSync:
    """A group root's exchange with the run's appliers: one channel per shard (exchange.shards),
    each its own master version; an update is split by the partition, an adoption joins every
    shard's newest part."""

    def __init__(self, channels: Channel | list[Channel], group: int, every: int,
                 initial_wait_s: float = INITIAL_WAIT_S, report: StorageReport | None = None, *,
                 kind: str = "gradient", max_outstanding: int = 0, reply_timeout_s: float = 60.0,
                 warmup_steps: int = 0, delta_dtype: str = "float32", drop_held: bool = False,
                 on_partition: Callable[[Partition], Partition] | None = None):
        self.channels = [channels] if isinstance(channels, Channel) else list(channels)
        self.group = group
        self.every = every
        self.kind = kind
        self.max_outstanding = max_outstanding
        self.warmup_steps = warmup_steps
        self.reply_timeout_s = reply_timeout_s
        self.delta_dtype = np.dtype(delta_dtype)
        self.initial_wait_s = initial_wait_s
        self.report = report
        self.on_partition = on_partition  # several shards: records this partition, or returns the run's
        self.partition: Partition | None = None  # made from the model at initial_weights()
        shards = len(self.channels)
        self.versions = [-1] * shards  # each shard's master version our part derives from; -1: ours
        self.master: list[Arrays | None] = [None] * shards  # each shard's newest part we read
        self.seq = max(ch.next_seq(group) for ch in self.channels)
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
        self.answered = -1  # the newest seq of ours every shard reports processed
        self._silent_at = None  # after a timeout: `answered` then; no waiting until it moves
        # (per-shard base versions, update, shards already holding it) not yet fully published
        self.unpublished: collections.deque[tuple[list[int], Arrays, set[int]]] = collections.deque()
        self.publish_failures = 0
        self.unpublished_dropped = 0
        self.drop_held = drop_held  # the held updates' bound reached: drop the oldest, not wait

    @property
    def channel(self) -> Channel:
        """Shard 0's channel (the only one with exchange.shards = 1)."""
        return self.channels[0]

    @property
    def version(self) -> int:
        """The oldest shard's master version our weights derive from (-1: some part is our own)."""
        return min(self.versions)

    def initial_weights(self, names_and_values: Arrays) -> Arrays:
        start = time.perf_counter()
        self.partition = Partition.balanced(names_and_values, len(self.channels))
        if self.on_partition is not None:
            self.partition = self.on_partition(self.partition)
        own = self.partition.split(names_and_values)
        for k, ch in enumerate(self.channels):
            latest = ch.read_latest_weights()
            if latest is None:
                ch.propose_initial(self.group, own[k])
            else:
                self.versions[k], self.master[k] = latest
        deadline = time.monotonic() + self.initial_wait_s
        waiting = [k for k in range(len(self.channels)) if self.master[k] is None]
        while waiting:
            for k in list(waiting):
                latest = self.channels[k].read_latest_weights()
                if latest is not None:
                    self.versions[k], self.master[k] = latest
                    waiting.remove(k)
            if not waiting or time.monotonic() >= deadline:
                break  # a shard's applier is not up: that part trains on our own weights
            time.sleep(0.2)
        self.seconds += time.perf_counter() - start
        if all(part is None for part in self.master):
            weights = names_and_values  # no applier yet: train on our own weights
        else:
            weights = self._joined(own)
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
        self.unpublished.append((list(self.versions), update, set()))
        self._publish_or_wait_for_space()
        limit = self.outstanding_limit(step)
        if limit:
            self._await_replies(limit)
        adopted = None
        newer = False
        for k, ch in enumerate(self.channels):
            newest = ch.latest_weights_version()
            if newest is not None and newest > self.versions[k]:
                latest = ch.read_latest_weights()
                if latest is not None and latest[0] > self.versions[k]:
                    self.versions[k], self.master[k] = latest
                    newer = True
        if newer:
            own = None
            if any(p is None for p in self.master):  # a shard without a version: our own part
                own = self._split(local if local is not None else weights()) if (
                    local is not None or weights is not None) else None
            if own is not None or all(p is not None for p in self.master):
                adopted = self._joined(own)
                self.adopted += 1
        if self.kind == "delta":
            self.base = _copy(adopted) if adopted is not None else local
        self.last_exchange = time.time()
        self.seconds += time.perf_counter() - start
        return adopted

    def _split(self, tensors: Arrays) -> list[Arrays]:
        return self.partition.split(tensors) if self.partition is not None else [tensors]

    def _joined(self, own: list[Arrays] | None) -> Arrays:
        """Every shard's newest master part; our own part for a shard that has none yet."""
        parts = [m if m is not None else own[k] for k, m in enumerate(self.master)]
        if self.partition is None:
            return parts[0]
        try:
            return self.partition.join(parts)
        except KeyError as exc:
            raise ValueError(f"master weights lack the piece {exc}: not this model's") from None

    def unanswered(self) -> int:
        """Published updates of this group that some shard has not processed yet."""
        self.answered = min(ch.answered_seq(self.group) for ch in self.channels)
        return max(0, min(self.published, self.seq - 1 - self.answered))

    def outstanding_limit(self, step: int) -> int:
        """K at group step `step`: 1 during the warm-up, then exchange.max_outstanding (0: no waiting)."""
        return 1 if step <= self.warmup_steps else self.max_outstanding

    def _await_replies(self, limit: int) -> None:
        start = time.monotonic()
        deadline = start + self.reply_timeout_s
        while self.unanswered() >= limit:
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
        """Publish the updates kept in memory, oldest first, to every shard; False if the
        disk/quota is full.

        Sequence numbers are given at publish time, so a failed publish leaves no gap; a shard
        that already holds an update is not sent it again.
        """
        while self.unpublished:
            base_versions, tensors, done = self.unpublished[0]
            parts = self._split(tensors)
            for k, ch in enumerate(self.channels):
                if k in done:
                    continue
                try:
                    ch.publish_update(self.group, self.seq, base_versions[k], parts[k])
                except OSError as exc:
                    if not is_storage_full(exc):
                        raise
                    self._publish_failed(ch, exc)
                    return False
                done.add(k)
            self.unpublished.popleft()
            self.seq += 1
            self.published += 1
        if self.report is not None:
            self.report.succeeded("exchange publish")
        return True

    def flush(self) -> bool:
        """The engine's last call: publish what is held (False while the disk refuses)."""
        return self.publish_pending()

    def _publish_or_wait_for_space(self) -> None:
        """Publish what is held; while the held updates fill their bound, wait for space (a
        stop request ends the wait: the checkpoint comes first)."""
        delay, start = 0.1, time.monotonic()
        while not self.publish_pending() and not self.drop_held and len(self.unpublished) >= self._held_bound:
            if self.interrupt is not None and self.interrupt():
                break
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
        self.wait_seconds += time.monotonic() - start

    @property
    def _held_bound(self) -> int:
        return min(ch.max_pending_per_group or DEFAULT_UNPUBLISHED for ch in self.channels)

    def _publish_failed(self, ch: Channel, exc: OSError) -> None:
        self.publish_failures += 1
        bound = self._held_bound
        while self.drop_held and len(self.unpublished) > bound:
            self.unpublished.popleft()
            self.unpublished_dropped += 1
        if self.report is not None:
            self.report.failed("exchange publish", exc, path=ch.updates_dir,
                               detail=f"{len(self.unpublished)} updates held in memory, "
                                      f"{self.unpublished_dropped} dropped"
                                      + ("" if self.drop_held or len(self.unpublished) < bound
                                         else "; waiting for space"))
        else:
            log.warning("publish failed (%s); %d updates held", exc, len(self.unpublished))

    def stats(self) -> dict[str, Any]:
        return {
            "exchange_kind": self.kind,
            "exchange_version": self.version,
            **({"exchange_shard_versions": list(self.versions)} if len(self.channels) > 1 else {}),
            # over the run's life: sequence numbers run on across restarts and resumes
            "exchange_published": self.seq,
            "exchange_published_here": self.published,  # by this process, since the rank started
            "exchange_adopted": self.adopted,
            "exchange_seconds": self.seconds,
            "exchange_last_s": self.last_exchange,
            "exchange_backlog_dropped": sum(ch.dropped_backlog for ch in self.channels),
            "exchange_publish_failures": self.publish_failures,
            "exchange_unpublished": len(self.unpublished),
            "exchange_unpublished_dropped": self.unpublished_dropped,
            "exchange_wait_seconds": self.wait_seconds,
            "exchange_reply_timeouts": self.reply_timeouts,
        }


def _copy(tensors: Arrays) -> Arrays:
    return {n: np.array(v, copy=True) for n, v in tensors.items()}
