"""The exchange load test's parts (bench.exchange_load runs them): the model's tensors, the group
roots and the appliers as processes of their own, and the exactly-once check of what they did."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

from hpcdl.engine.tuning import read_cpuinfo
from hpcdl.exchange import Channel, Signer
from hpcdl.exchange.group import ExchangeSync  # imported before the forks: shared
from hpcdl.exchange.shards import Partition
from hpcdl.fs.files import read_jsonl

RUN_ID = "exchange-load"
HEP_PARAMS = 594_178
PAPER_STEP_S = 8 * 15.43e9 / 1.90e12  # batch 8 x GFLOP per example / node FLOP/s = 0.065 s
SHARING_NOTE = ("CPU per update is getrusage time in each applier's own process: it does not "
                "depend on how the cores are shared, the rates and the backlog do")


def hep_layout(params: int) -> dict[str, tuple[int, ...]]:
    """The HEP network's tensors (5 conv 3x3 + dense), scaled to about `params` parameters."""
    # full size: conv0 3x3x3x128, conv1..4 3x3x128x128, dense 128x2 (+ biases) = 594,178
    f = 128
    if params < HEP_PARAMS:  # fewer filters: 4*9*f^2 + 27f + 5f + 2f + 2 ~= params
        f = max(1, int((params / 36) ** 0.5))
    shapes: dict[str, tuple[int, ...]] = {"conv0/w": (3, 3, 3, f), "conv0/b": (f,)}
    for i in range(1, 5):
        shapes[f"conv{i}/w"] = (3, 3, f, f)
        shapes[f"conv{i}/b"] = (f,)
    shapes["dense/w"], shapes["dense/b"] = (f, 2), (2,)
    return shapes


def partition_of(shapes: dict[str, tuple[int, ...]], shards: int) -> Partition:
    """The partition every group root makes from this model (float32) for exchange.shards."""
    return Partition.balanced({k: (s, "<f4") for k, s in shapes.items()}, shards)


def machine() -> dict:
    """The CPU model, its vector flags, the core count and the load average, as recorded (lighter
    than bench.harness.machine: no git, lscpu or package versions in the load's processes)."""
    cpu = read_cpuinfo(env={})  # the CPU's own flags: ONEDNN_MAX_CPU_ISA caps oneDNN, not numpy
    return {"cpu_model": cpu.model, "avx2": "avx2" in cpu.flags, "avx512f": "avx512f" in cpu.flags,
            "cores": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------


def publisher(group: int, roots: list[str], key: bytes, shapes: dict, interval: float, clock,
              max_pending: int | None, fsync: bool, nice: int, pin: set[int] | None,
              out: str) -> None:
    """One group root. ``clock``: the run's start barrier (see :class:`StartClock`)."""
    if nice:
        os.nice(nice)
    pin_to(pin, "publishers")
    channels = [Channel(r, RUN_ID, create=False, signer=Signer(key), fsync=fsync,
                        max_pending_per_group=max_pending) for r in roots]
    sync = ExchangeSync(channels, group, every=1, initial_wait_s=30.0)
    rng = np.random.default_rng(group)
    grads = {k: (rng.standard_normal(s) * 1e-3).astype(np.float32) for k, s in shapes.items()}
    own = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    dropped: list[list[int]] = [[] for _ in channels]  # per shard: seqs its bound deleted
    # The initial weights are adopted before the load starts: 64 roots reading them at once on a
    # loaded core take seconds, which is a start-up cost, not the exchange's steady state.
    t0 = time.perf_counter()
    sync.initial_weights(own)
    initial_s = time.perf_counter() - t0
    start, stop = clock.ready_and_wait()
    late_s = time.time() - start  # woken late on a loaded machine
    # Groups start at random phases, as real ones do.
    next_t = time.monotonic() + rng.uniform(0, interval)
    step = 0
    t_end = time.monotonic() + (stop - time.time())
    while True:
        now = time.monotonic()
        if now < next_t:
            time.sleep(next_t - now)
        if time.monotonic() >= t_end:
            break
        step += 1
        for ch in channels:
            ch.last_dropped = []  # a shard published nothing this step: nothing of its dropped
        sync.after_step(step, lambda: grads)
        for k, ch in enumerate(channels):
            dropped[k].extend(r.seq for r in ch.last_dropped)
        next_t = max(next_t + interval, time.monotonic())  # behind: go on at once, no catch-up burst
    Path(out).write_text(json.dumps({
        "group": group, "published": sync.published, "next_seq": sync.seq, "dropped": dropped,
        "publish_s": sync.seconds, "adopted": sync.adopted, "version": sync.version,
        "failures": sync.publish_failures, "steps": step, "late_s": late_s, "initial_s": initial_s,
    }))


class StartClock:
    """Everyone forked, set up and ready before the load's clock starts (forking 64 processes on
    a loaded machine takes tens of seconds: a start time fixed before the forks would be long
    past for the last ones)."""

    def __init__(self, ctx, parties: int):
        self.parties = parties
        self._ready = ctx.Value("i", 0)
        self._times = ctx.Array("d", 2)  # start, stop (time.time())
        self._go = ctx.Event()

    def ready_and_wait(self) -> tuple[float, float]:
        with self._ready.get_lock():
            self._ready.value += 1
        self._go.wait()
        start = self._times[0]
        while time.time() < start:
            time.sleep(min(0.01, max(0.0, start - time.time())))
        return self._times[0], self._times[1]

    def start(self, seconds: float, timeout: float, lead: float = 0.5) -> tuple[float, float, int]:
        """Wait (up to `timeout` s) for every party, then start the clock; returns start, stop
        and how many were ready."""
        deadline = time.monotonic() + timeout
        while self._ready.value < self.parties and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.time() + lead
        self._times[0], self._times[1] = start, start + seconds
        self._go.set()
        return start, start + seconds, self._ready.value


def pin_to(cpus: set[int] | None, who: str) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            print(f"could not pin the {who} to {sorted(cpus)}: {e}", file=sys.stderr)


def applier(root: str, key: bytes, shapes: dict, fsync: bool, stop_file: str, drain_s: float,
            max_batch: int, pin: set[int] | None, out: str) -> None:
    """One shard's applier; `shapes` are its part's pieces (the whole model with one shard)."""
    from hpcdl.applier import Applier, ApplierConfig

    pin_to(pin, "applier")
    ch = Channel(root, RUN_ID, create=False, signer=Signer(key), fsync=fsync)
    initial = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    app = Applier(ch, ApplierConfig("adam", 1e-3, max_batch=max_batch, keep_versions=3, status_interval=1.0),
                  initial=initial)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    state = {"stop_seen": None}

    def done() -> bool:
        if state["stop_seen"] is None:
            if os.path.exists(stop_file):
                state["stop_seen"] = time.monotonic()
            return False
        return ch.backlog() == 0 or time.monotonic() - state["stop_seen"] > drain_s

    with app:
        handled = app.run(poll_interval=0.005, stop=done)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    Path(out).write_text(json.dumps({
        "handled": handled, "counts": app.counts, "version": app.version,
        "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), "wall_s": t1 - t0,
        "drain_s": (t1 - state["stop_seen"]) if state["stop_seen"] else None,
        "staleness": app.status()["staleness"],
        # the applier's own account: process time of the batches that had work only (no polling)
        "busy_cpu_s": app.cpu_seconds, "busy_updates": app.cpu_updates,
    }))


# ------------------------------------------------------------------------------------------------
# the exactly-once check
# ------------------------------------------------------------------------------------------------


def read_events(ch: Channel) -> list[dict]:
    """The applier's events, the rotated file's first (the applier keeps one, named so)."""
    rotated = ch.events_path.with_name(ch.events_path.name + ".1")
    return [event for path in (rotated, ch.events_path) for event in read_jsonl(path)]


def ledger_check(ch: Channel, pubs: list[dict], shard: int = 0) -> dict:
    """Exactly once, in one shard: published = applied (once) + dropped by the publisher's bound
    on this shard's channel + pending. ``pubs``' ``dropped`` holds one list of seqs per shard."""
    events = read_events(ch)
    taken = [(e["group"], e["seq"]) for e in events if e["event"] in ("applied", "dropped")]
    applied = set(taken)
    twice = len(taken) - len(applied)
    pending = {(ref.group, ref.seq) for ref in ch.pending_updates()}
    lost, dropped_total, published_total, raced = [], 0, 0, 0
    for p in pubs:
        g = p["group"]
        dropped = set(p["dropped"][shard])
        published_total += p["next_seq"]
        for s in range(p["next_seq"]):
            if (g, s) in applied:
                # A publisher may delete a file the applier is already reading (harmless: an
                # open file stays readable): it was applied, once.
                raced += s in dropped
            elif s in dropped:
                dropped_total += 1
            elif (g, s) not in pending:
                lost.append((g, s))
    foreign = [k for k in applied if k[0] >= len(pubs)]
    return {"shard": shard, "published": published_total, "applied_or_stale": len(applied),
            "applied_twice": twice, "dropped_by_bound": dropped_total,
            "applied_while_dropped": raced, "pending_at_end": len(pending), "lost": lost[:10],
            "n_lost": len(lost), "foreign": foreign[:10],
            "ok": twice == 0 and not lost and not foreign, "_applied": applied}


def combine_ledgers(shards: list[dict], pubs: list[dict]) -> dict:
    """Every shard's check, their sums (counted in files: one per shard per update), and how many
    updates were applied whole (in every shard) or only in part (some shard's bound dropped it)."""
    complete = partial = 0
    for p in pubs:
        for s in range(p["next_seq"]):
            n = sum((p["group"], s) in led["_applied"] for led in shards)
            complete += n == len(shards)
            partial += 0 < n < len(shards)
    clean = [{k: v for k, v in led.items() if k != "_applied"} for led in shards]
    out = {k: sum(led[k] for led in clean) for k in ("published", "applied_or_stale", "applied_twice",
                                                      "dropped_by_bound", "applied_while_dropped",
                                                      "pending_at_end", "n_lost")}
    out.update(lost=[x for led in clean for x in led["lost"]][:10],
               foreign=[x for led in clean for x in led["foreign"]][:10],
               ok=all(led["ok"] for led in clean), updates_applied_whole=complete,
               updates_applied_in_part=partial, per_shard=clean)
    return out
