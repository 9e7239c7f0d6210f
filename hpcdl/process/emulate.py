"""Emulated stragglers and failures (the job's `[emulate]` section), for experiments only.

Real clusters have slow nodes, noisy neighbours, stalls and failures; a 2-core test machine has
none, and the hybrid scheme exists for exactly those. With `emulate.enabled`, every rank pads
each of its steps with a sleep to `step_seconds × X`: X is lognormal with mean 1 and spread
`sigma`, times `stall_factor` with probability `stall_probability`, times `slow_factor` on the
rank whose data shard is `slow_shard`. Because the padding is a sleep, many ranks of a tiny
model share two cores and the emulated time, not the CPU, sets the pace. The rank of shard
`kill_shard` SIGKILLs itself `kill_after_s` into its run, once per run (a mark in the group's
directory remembers it), so the backend's restart from the checkpoint is part of the race.

Draws depend only on (seed, shard, step): a run is reproducible, and a restarted rank that
repeats steps repeats their factors. Emulated runs say so in their metrics and in `hpcdl status`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

from hpcdl.config import EmulateConfig


def step_factor(config: EmulateConfig, shard: int, step: int) -> float:
    """How many times `step_seconds` the rank of data shard `shard` takes for its `step`: the
    draw of a real emulated run and of the emulated race (hpcdl.perf.race) alike."""
    c = config
    rng = np.random.default_rng([c.seed, shard, step])
    x = rng.lognormal(mean=-c.sigma ** 2 / 2, sigma=c.sigma) if c.sigma else 1.0
    if rng.random() < c.stall_probability:
        x *= c.stall_factor
    if shard == c.slow_shard:
        x *= c.slow_factor
    return float(x)


class Emulator:
    """The pace of one rank (its data shard), and its planned failure."""

    def __init__(self, config: EmulateConfig, shard: int, kill_mark: Path):
        self.config = config
        self.shard = shard
        self.kill_mark = kill_mark
        self.started = time.monotonic()

    def factor(self, step: int) -> float:
        """How many times `step_seconds` this rank's `step` takes."""
        return step_factor(self.config, self.shard, step)

    def pace(self, step: int, step_started: float) -> float:
        """Sleep until the step has lasted its emulated time (perf_counter clock), which is
        returned; maybe die."""
        self.maybe_kill()
        emulated = self.config.step_seconds * self.factor(step)
        remaining = step_started + emulated - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return emulated

    def maybe_kill(self) -> None:
        c = self.config
        if self.shard != c.kill_shard or time.monotonic() - self.started < c.kill_after_s:
            return
        try:
            fd = os.open(self.kill_mark, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return  # killed once already in this run
        os.close(fd)
        print(f"hpcdl emulate: shard {self.shard} kills itself (SIGKILL) as planned", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def describe(self) -> dict:
        """What the metrics and `hpcdl status` show of the emulation."""
        c = self.config
        return {"step_seconds": c.step_seconds, "sigma": c.sigma,
                "stall_probability": c.stall_probability, "stall_factor": c.stall_factor,
                "slow_shard": c.slow_shard, "slow_factor": c.slow_factor,
                "kill_shard": c.kill_shard, "kill_after_s": c.kill_after_s, "seed": c.seed}

