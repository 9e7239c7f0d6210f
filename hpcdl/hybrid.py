"""The group root's side of the asynchronous exchange (the engine's `GroupSync`).

After every `exchange.every` synchronous steps the root publishes the group-averaged gradient,
tagged with the master version its weights came from, and then checks — with a directory listing,
no wait — whether the applier has published a newer master version; if so it reads it and the
engine broadcasts it inside the group. A group never waits for the applier: if the applier is slow
or down, the group keeps training on its own weights, and the channel's backlog bound keeps the
directory from growing. On start and on restart the root takes the newest master weights (or
proposes its own, so that all groups start from the same version 0).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from hpcdl.exchange import Channel
from hpcdl.runs import RunDir

INITIAL_WAIT_S = 60.0


class ExchangeSync:
    def __init__(self, channel: Channel, group: int, every: int, initial_wait_s: float = INITIAL_WAIT_S):
        self.channel = channel
        self.group = group
        self.every = every
        self.initial_wait_s = initial_wait_s
        self.version = -1  # master version our weights derive from; -1: our own weights
        self.seq = channel.next_seq(group)
        self.published = 0
        self.adopted = 0
        self.seconds = 0.0
        self.last_exchange: float | None = None

    @classmethod
    def for_run(cls, run: RunDir, job, group: int) -> "ExchangeSync":
        channel = Channel(run.exchange_dir(job), run.run_id,
                          max_pending_per_group=job.exchange.max_pending_per_group)
        return cls(channel, group, job.exchange.every)

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
        self.channel.publish_update(self.group, self.seq, self.version, grads())
        self.seq += 1
        self.published += 1
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

    def stats(self) -> dict[str, Any]:
        return {
            "exchange_version": self.version,
            "exchange_published": self.published,
            "exchange_adopted": self.adopted,
            "exchange_seconds": self.seconds,
            "exchange_last_s": self.last_exchange,
            "exchange_backlog_dropped": self.channel.dropped_backlog,
        }


def adopt_master_weights(run: RunDir, job, model) -> int | None:
    """Load the run's newest master weights into `model`; returns the version, None if none."""
    try:
        channel = Channel(run.exchange_dir(job), run.run_id, create=False)
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
