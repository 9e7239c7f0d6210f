"""The group root's side of the asynchronous exchange (the engine's `GroupSync`).

After every `exchange.every` synchronous steps the root publishes the group-averaged gradient,
tagged with the master version its weights came from, and then checks — with a directory listing,
no wait — whether the applier has published a newer master version; if so it reads it and the
engine broadcasts it inside the group. A group never waits for the applier: if the applier is slow
or down, the group keeps training on its own weights, and the channel's backlog bound keeps the
directory from growing. On start and on restart the root takes the newest master weights (or
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


class ExchangeSync:
    def __init__(self, channel: Channel, group: int, every: int, initial_wait_s: float = INITIAL_WAIT_S,
                 report: StorageReport | None = None):
        self.channel = channel
        self.group = group
        self.every = every
        self.initial_wait_s = initial_wait_s
        self.report = report
        self.version = -1  # master version our weights derive from; -1: our own weights
        self.seq = channel.next_seq(group)
        self.published = 0
        self.adopted = 0
        self.seconds = 0.0
        self.last_exchange: float | None = None
        # (base_version, tensors) computed but not yet published (the disk or quota was full)
        self.unpublished: collections.deque[tuple[int, dict[str, np.ndarray]]] = collections.deque()
        self.publish_failures = 0
        self.unpublished_dropped = 0

    @classmethod
    def for_run(cls, run: RunDir, job, group: int) -> "ExchangeSync":
        channel = run_channel(run, job, max_pending_per_group=job.exchange.max_pending_per_group)
        return cls(channel, group, job.exchange.every, report=storage_report(run.storage_file(group)))

    def initial_weights(self, names_and_values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        latest = self.channel.read_latest_weights()
        if latest is None:
            latest = self.channel.initial_weights(self.group, names_and_values, timeout=self.initial_wait_s)
        self.seconds += time.perf_counter() - start
        if latest is None:
            return names_and_values  # no applier yet: train on our own weights
        self.version, weights = latest
        self.adopted += 1
        self.last_exchange = time.time()
        return weights

    def after_step(self, step: int, grads: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray] | None:
        if step % self.every:
            return None
        start = time.perf_counter()
        self.unpublished.append((self.version, grads()))
        self.publish_pending()
        adopted = None
        newest = self.channel.latest_weights_version()
        if newest is not None and newest > self.version:
            latest = self.channel.read_latest_weights()
            if latest is not None and latest[0] > self.version:
                self.version, adopted = latest
                self.adopted += 1
        self.last_exchange = time.time()
        self.seconds += time.perf_counter() - start
        return adopted

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
            "exchange_version": self.version,
            "exchange_published": self.published,
            "exchange_adopted": self.adopted,
            "exchange_seconds": self.seconds,
            "exchange_last_s": self.last_exchange,
            "exchange_backlog_dropped": self.channel.dropped_backlog,
            "exchange_publish_failures": self.publish_failures,
            "exchange_unpublished": len(self.unpublished),
            "exchange_unpublished_dropped": self.unpublished_dropped,
        }


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
