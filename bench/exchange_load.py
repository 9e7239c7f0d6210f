"""Many groups against K appliers: a load test of the asynchronous exchange on this machine.

G simulated group roots (light processes: numpy and hpcdl.exchange only, no TensorFlow) run the
real group-root code (:class:`hpcdl.exchange.group.ExchangeSync`: publish the update, adopt the newest
master weights when there is a newer one) at the paper's cadence, against K real appliers
(:class:`hpcdl.applier.Applier`, Adam), each in its own process on its own shard's channel
(``exchange.shards = K``: the tensors partitioned by bytes, :class:`hpcdl.exchange.shards.Partition`;
each applier starts from its shard's part of the initial weights), for a fixed time; then the
publishers stop and the appliers drain what is pending (bounded by --drain). Everything goes
through real files in one exchange directory per shard, tagged under a per-run key (Poly1305) as a
run's channels are. ``--shards 1,2,4`` (the default) repeats the run for each K.

Cadence (the paper's HEP run, Kurth et al. SC17, as hpcdl.perf.planner recalls it): every group
step publishes one update; a step computes 8 examples x 15.43 GFLOP at 1.90 TFLOP/s = 65 ms, so a
group publishes ~15 updates/s. The update is the HEP network's gradient: 594,178 float32
parameters (2.38 MB) in its 12 tensors (5 convolutions 3x3x128, the first from 3 channels, and
the dense 128->2 layer); --sizes adds smaller models (same layout, fewer filters' worth of
parameters), by default 16,384 parameters.

The appliers stand for nodes of their own: they are pinned to the first core (the K of them
share it) and the group roots to the others (``--no-pin`` lets them all share). On a small machine
the group roots cannot keep the paper's cadence (they are 64 processes writing and hashing
megabytes on the remaining cores): the offered rate is printed beside the target, and each
applier's CPU time per update -- which does not depend on how the machine is shared -- gives its
capacity on one dedicated core.

Printed per size and K: updates offered (published) and applied per second, each shard's CPU
time per update it read (user + sys, from getrusage in its process, over the updates it read: a
file its publisher's bound deleted between the listing and the read is not counted) and their sum
(the CPU of one full update), the backlog of each shard (pending update files, sampled every 0.25 s: max, mean, at the
end of the load, and how long the drain took), publishers' own publish time, staleness per shard
(from each applier's status), and the exactly-once ledger check of each shard: every (group, seq)
a publisher published is applied exactly once in that shard, or deleted unread by that
publisher's backlog bound on that shard's channel (``--max-pending``, the job's
``exchange.max_pending_per_group``), or still pending when --drain ran out; nothing applied
twice, nothing lost. An update applied in some shards and dropped in others is counted as
*partial* (each shard's bound acts alone).

``--breakdown`` first times, in this process on one core, the parts of one full HEP-size update
as the applier does them (read and verify, the finite check, Adam, the state save and the weights
publish amortised over a batch of --max-batch, unlink), and a whole applier batch for comparison:
medians and quartiles of CPU time over --reps repetitions. ``--breakdown-only`` skips the load.

Every result records the CPU model (/proc/cpuinfo), its avx2/avx512f flags and the load average.

Usage:

    python -m bench.exchange_load [--groups 64] [--seconds 60] [--sizes 594178,16384]
                                  [--shards 1,2,4] [--interval 0.065] [--max-pending 4]
                                  [--dir DIR] [--no-fsync] [--no-pin] [--breakdown]
                                  [--json FILE]

--json writes a list, one entry per size: the entry's own fields are those of the first K of
--shards (K = 1 by default: the single applier's figures), and ``shard_runs`` holds every K's.
With --breakdown (or --breakdown-only) it writes {"machine", "breakdown", "load": that list}.

Exit status: 0 when the ledger check holds for every size, K and shard, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hpcdl.applier.config import ApplierConfig
from hpcdl.engine.tuning import read_cpuinfo
from hpcdl.exchange import Channel, Signer, update_name
from hpcdl.exchange.group import ExchangeSync  # imported before the forks: shared
from hpcdl.exchange.shards import Partition
from hpcdl.files import read_jsonl

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
    _pin(pin, "publishers")
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


def _pin(cpus: set[int] | None, who: str) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            print(f"could not pin the {who} to {sorted(cpus)}: {e}", file=sys.stderr)


def applier(root: str, key: bytes, shapes: dict, fsync: bool, stop_file: str, drain_s: float,
            max_batch: int, pin: set[int] | None, out: str) -> None:
    """One shard's applier; `shapes` are its part's pieces (the whole model with one shard)."""
    from hpcdl.applier import Applier, ApplierConfig

    _pin(pin, "applier")
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


# ------------------------------------------------------------------------------------------------
# one size, one K
# ------------------------------------------------------------------------------------------------


def run_shards(params: int, shards: int, args, base: Path) -> dict:
    """G publishers against `shards` appliers for args.seconds; the figures of the run."""
    shapes = hep_layout(params)
    n_params = int(sum(np.prod(s) for s in shapes.values()))
    partition = partition_of(shapes, shards)
    parts = [{piece: tuple(a.shape) for piece, a in part.items()}
             for part in partition.split({k: np.empty(s, np.float32) for k, s in shapes.items()})]
    roots = [base / f"x-{n_params}-k{shards}" / f"shard-{k}" for k in range(shards)]
    results = base / f"r-{n_params}-k{shards}"
    results.mkdir(parents=True)
    key = secrets.token_bytes(32)
    channels = [Channel(r, RUN_ID, signer=Signer(key)) for r in roots]  # the layout, made once
    ctx = mp.get_context("fork")
    stop_file = str(results / "stop")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    # The appliers stand for nodes of their own: they get a core the group roots do not use
    # (one core for the K of them: their CPU per update is what is measured, not their rate).
    app_cpus, pub_cpus = ({cpus[0]}, set(cpus[1:])) if args.pin and len(cpus) >= 2 else (None, None)
    load_before = machine()["load_average"]
    apps = [ctx.Process(target=applier, args=(str(roots[k]), key, parts[k], args.fsync, stop_file,
                                              args.drain, args.max_batch, app_cpus,
                                              str(results / f"applier-{k}.json")))
            for k in range(shards)]
    for a in apps:
        a.start()
    clock = StartClock(ctx, args.groups)
    pubs = [ctx.Process(target=publisher, args=(g, [str(r) for r in roots], key, shapes, args.interval,
                                                clock, args.max_pending, args.fsync, args.nice,
                                                pub_cpus, str(results / f"g{g}.json")))
            for g in range(args.groups)]
    forked = time.monotonic()
    for p in pubs:
        p.start()
    start, stop, ready = clock.start(args.seconds, timeout=300)
    setup_s = time.monotonic() - forked
    samples: list[list[int]] = [[] for _ in range(shards)]
    while time.time() < stop:
        time.sleep(0.25)
        if time.time() >= start:
            for k, ch in enumerate(channels):
                try:
                    samples[k].append(ch.backlog())
                except OSError:
                    pass
    for p in pubs:
        p.join(timeout=120)
    load_end = time.time()
    at_end = [ch.backlog() for ch in channels]
    Path(stop_file).touch()
    for a in apps:
        a.join(timeout=args.drain + 120)
        if a.is_alive():
            a.kill()
    bad = ([p.exitcode for p in pubs if p.exitcode != 0]
           + [a.exitcode for a in apps if a.exitcode])
    pub = [json.loads((results / f"g{g}.json").read_text()) for g in range(args.groups)
           if (results / f"g{g}.json").exists()]
    aps = [json.loads((results / f"applier-{k}.json").read_text())
           if (results / f"applier-{k}.json").exists() else {} for k in range(shards)]
    checks = [ledger_check(channels[k], pub, k) for k in range(shards)]
    ledger = combine_ledgers(checks, pub)
    published = sum(p["published"] for p in pub)
    load_s = load_end - start
    per_shard = []
    for k, (ap, ch) in enumerate(zip(aps, channels)):
        in_load = sum(1 for e in read_events(ch)
                      if e["event"] == "applied" and start <= e["time"] <= load_end)
        handled = ap.get("handled", 0)
        # The updates this shard read: a file listed and then deleted by its publisher's backlog
        # bound before the read ("vanished") or a replay ("duplicates") costs a listing entry,
        # not an update; dividing by them would make a shard that loses the race look cheaper.
        counts_k = ap.get("counts", {})
        read = handled - counts_k.get("vanished", 0) - counts_k.get("duplicates", 0)
        st = ap.get("staleness") or {}
        per_shard.append({
            "shard": k, "params": int(sum(np.prod(s) for s in parts[k].values())),
            "bytes": partition.shard_bytes()[k], "pieces": list(parts[k]),
            "applied": ap.get("counts", {}).get("applied", 0),
            "applied_per_s": in_load / load_s if load_s > 0 else None,
            "cpu_s": ap.get("cpu_s"), "wall_s": ap.get("wall_s"), "handled": handled, "read": read,
            "cpu_ms_per_update": 1e3 * ap["cpu_s"] / read if ap and read > 0 else None,
            # without the idle polling between batches (what a busy applier pays per update)
            "busy_cpu_ms_per_update": (1e3 * ap["busy_cpu_s"] / read if ap.get("busy_updates") and read > 0
                                       else None),
            "cpu_share": ap["cpu_s"] / ap["wall_s"] if ap.get("wall_s") else None,
            "drain_s": ap.get("drain_s"),
            # the backlog left at the end over the time it took to drain: the shard's rate once
            # the publishers have stopped competing for the machine
            "drain_per_s": (at_end[k] / ap["drain_s"] if ap.get("drain_s") and at_end[k] >= 8 else None),
            "backlog_max": max(samples[k], default=0),
            "backlog_mean": float(np.mean(samples[k])) if samples[k] else 0.0,
            "backlog_at_load_end": at_end[k],
            "staleness": st or None, "counts": ap.get("counts"),
        })
    cpu = [s["cpu_ms_per_update"] for s in per_shard]
    counts: dict[str, int] = {}
    for s in per_shard:
        for name, v in (s["counts"] or {}).items():
            counts[name] = counts.get(name, 0) + v
    st_count = sum((s["staleness"] or {}).get("count", 0) for s in per_shard)
    st_sum = sum((s["staleness"] or {}).get("count", 0) * ((s["staleness"] or {}).get("mean") or 0)
                 for s in per_shard)
    wall = max((s["wall_s"] or 0) for s in per_shard)
    applied = sum(s["applied"] for s in per_shard)
    rates = [s["applied_per_s"] for s in per_shard if s["applied_per_s"] is not None]
    out = {
        "params": n_params, "update_bytes": n_params * 4, "shards": shards,
        "partition": partition.describe(), "groups": args.groups,
        "interval_s": args.interval, "seconds": args.seconds, "fsync": args.fsync, "nice": args.nice,
        "applier_cpus": sorted(app_cpus) if app_cpus else None,
        "publisher_cpus": sorted(pub_cpus) if pub_cpus else None,
        "machine": machine(), "load_average_before": load_before, "cpu_note": SHARING_NOTE,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "max_pending_per_group": args.max_pending, "process_failures": bad,
        "setup_s": setup_s, "publishers_ready": ready,
        "offered_per_s": published / load_s if load_s > 0 else None,
        "offered_target_per_s": args.groups / args.interval,
        "published": published,
        # in files (one per shard per update); with one shard, updates
        "applied": applied,
        "applied_updates_whole": ledger["updates_applied_whole"],
        # full updates/s during the load: the slowest shard's rate
        "applied_per_s": min(rates) if len(rates) == shards else None,
        "applied_per_s_overall": applied / shards / wall if wall else None,
        "applier_cpu_s": sum((s["cpu_s"] or 0) for s in per_shard), "applier_wall_s": wall,
        # the CPU of one full update: every shard's share of it
        "applier_cpu_ms_per_update": sum(cpu) if all(c is not None for c in cpu) else None,
        "shard_cpu_ms_per_update": cpu,
        "applier_cpu_share": (sum((s["cpu_s"] or 0) for s in per_shard) / wall) if wall else None,
        "drain_s": max((s["drain_s"] for s in per_shard if s["drain_s"] is not None), default=None),
        "backlog_max": max(s["backlog_max"] for s in per_shard),
        "backlog_mean": float(sum(s["backlog_mean"] for s in per_shard)),
        "backlog_at_load_end": sum(at_end),
        "keeps_up": all(bool(samples[k]) and at_end[k] <= max(2 * args.groups, 8)
                        and (per_shard[k]["drain_s"] if per_shard[k]["drain_s"] is not None else 1e9) < 5.0
                        for k in range(shards)),
        "publish_ms_mean": 1e3 * sum(p["publish_s"] - p["initial_s"] for p in pub) / max(1, published),
        "publisher_steps": {"min": min((p["steps"] for p in pub), default=0),
                            "max": max((p["steps"] for p in pub), default=0)},
        "publisher_late_s_max": max((p["late_s"] for p in pub), default=None),
        "publisher_initial_s_max": max((p["initial_s"] for p in pub), default=None),
        "adopted": sum(p["adopted"] for p in pub),
        "staleness": {"count": st_count, "mean": st_sum / st_count if st_count else None,
                      "max": max(((s["staleness"] or {}).get("max", 0) for s in per_shard), default=0)},
        "counts": counts, "ledger": ledger, "per_shard": per_shard,
    }
    if not args.keep:
        shutil.rmtree(roots[0].parent, ignore_errors=True)
    return out


def show(r: dict) -> None:
    f = lambda v, spec="{:.1f}": "-" if v is None else spec.format(v)  # noqa: E731
    led = r["ledger"]
    m = r["machine"]
    k = r["shards"]
    print(f"\n== K = {k} shard{'s' if k > 1 else ''}: {r['groups']} groups x {r['params']:,} params "
          f"({r['update_bytes'] / 1e6:.2f} MB/update), one update every {r['interval_s'] * 1e3:.0f} ms "
          f"per group, {r['seconds']:.0f} s, fsync {'on' if r['fsync'] else 'off'}, backlog bound "
          f"{r['max_pending_per_group']} per group and shard")
    print(f"  machine    {m['cpu_model']} (avx2 {'yes' if m['avx2'] else 'no'}, avx512f "
          f"{'yes' if m['avx512f'] else 'no'}), {m['cores']} cores; appliers on CPUs "
          f"{r['applier_cpus'] or 'shared'}, publishers on {r['publisher_cpus'] or 'shared'}; load average "
          f"{' '.join(f'{x:.1f}' for x in r['load_average_before'] or [])} before, "
          f"{' '.join(f'{x:.1f}' for x in m['load_average'] or [])} after")
    print(f"  offered    {f(r['offered_per_s'])} updates/s published (target {f(r['offered_target_per_s'])}); "
          f"publish+adopt {f(r['publish_ms_mean'], '{:.2f}')} ms wall each (all {k} shard files); steps per "
          f"group {r['publisher_steps']['min']}-{r['publisher_steps']['max']}; the last group started "
          f"{f(r['publisher_late_s_max'], '{:.1f}')} s late; setup (fork, initial weights: up to "
          f"{f(r['publisher_initial_s_max'], '{:.1f}')} s) took {r['setup_s']:.0f} s, "
          f"{r['publishers_ready']} of {r['groups']} ready")
    print(f"  applied    {f(r['applied_per_s'])} full updates/s during the load (slowest shard); "
          f"{r['applied_updates_whole']} of {r['published']} published applied in every shard, "
          f"drain included")
    cpu = r["applier_cpu_ms_per_update"]
    print(f"  CPU        {f(cpu, '{:.2f}')} ms per full update (sum over shards; one core: "
          f"~{f(1e3 / cpu if cpu else None, '{:.0f}')} updates/s); per shard "
          + ", ".join(f(c, '{:.2f}') for c in r["shard_cpu_ms_per_update"]) + " ms")
    print(f"             ({SHARING_NOTE})")
    for s in r["per_shard"]:
        st = s["staleness"] or {}
        print(f"  shard {s['shard']}    {s['params']:,} params: {f(s['cpu_ms_per_update'], '{:.2f}')} ms CPU/update "
              f"({f(s['busy_cpu_ms_per_update'], '{:.2f}')} in batches only), "
              f"{f(100 * s['cpu_share'] if s['cpu_share'] is not None else None, '{:.0f}')} % of a core; "
              f"applied {f(s['applied_per_s'])}/s; backlog max {s['backlog_max']}, mean "
              f"{s['backlog_mean']:.1f}, at end {s['backlog_at_load_end']}, drained in {f(s['drain_s'])} s "
              f"({f(s['drain_per_s'], '{:.0f}')}/s); "
              f"staleness mean {f(st.get('mean'))}, max {st.get('max', '-')}")
    print(f"  backlog    {'keeps up' if r['keeps_up'] else 'DOES NOT keep up (backlog reported above)'}; "
          f"groups adopted {r['adopted']} master versions")
    for s in led["per_shard"]:
        print(f"  ledger {s['shard']}   {'OK' if s['ok'] else 'FAILED'}: {s['published']} published = "
              f"{s['applied_or_stale']} applied once + {s['dropped_by_bound']} dropped by the backlog bound + "
              f"{s['pending_at_end']} pending; applied twice {s['applied_twice']}, lost {s['n_lost']}")
    print(f"  ledger     {'OK' if led['ok'] else 'FAILED'}"
          + (f" in all {k} shards; {led['updates_applied_whole']} updates applied whole, "
             f"{led['updates_applied_in_part']} only in part" if k > 1 else "")
          + (f"; process failures {r['process_failures']}" if r["process_failures"] else ""))


# ------------------------------------------------------------------------------------------------
# where one full update's CPU goes
# ------------------------------------------------------------------------------------------------


def _quartiles(samples_ns: list[int], per: int = 1) -> dict:
    ms = np.asarray(samples_ns, dtype=np.float64) / 1e6 / per
    q1, med, q3 = np.percentile(ms, [25, 50, 75])
    return {"median_ms": float(med), "q1_ms": float(q1), "q3_ms": float(q3), "n": len(samples_ns),
            "amortised_over": per}


def _timed(fn, reps: int) -> tuple[list[int], list[int]]:
    """CPU (process time) and wall nanoseconds of `reps` calls of fn."""
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        fn()
        cpu.append(time.process_time_ns() - c0)
        wall.append(time.perf_counter_ns() - w0)
    return cpu, wall


def breakdown_parts(base: Path, reps: int, batch: int, fsync: bool, shard_counts: list[int]) -> dict:
    """Time the parts of one full HEP update as the applier does them, in this process.

    The parts: read + verify (Channel.read_update: open, read, the keyed tag, header checks), the
    finite check, Adam (hpcdl.applier.rules.Adam.apply: the compiled kernel on weights and two
    slots), the state save and the weights publish (once per batch of `batch`: amortised), the
    unlink of the update file;
    then whole applier batches (Applier.step on `batch` pending updates, events and status
    included) for comparison with the sum of the parts, and the same for one shard of each K in
    `shard_counts` (its largest piece of the partition).
    """
    from hpcdl.applier import Applier, ApplierConfig
    from hpcdl.applier.rules import Adam, RuleParams

    shapes = hep_layout(HEP_PARAMS)
    key = secrets.token_bytes(32)
    ch = Channel(base / "parts", RUN_ID, signer=Signer(key), fsync=fsync)
    rng = np.random.default_rng(0)
    grads = {k: (rng.standard_normal(s) * 1e-3).astype(np.float32) for k, s in shapes.items()}
    path = ch.publish_update(0, 0, 0, grads)
    upd = ch.read_update(path)
    weights = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    slots = {"m": {k: np.zeros_like(w) for k, w in weights.items()},
             "v": {k: np.zeros_like(w) for k, w in weights.items()}}
    rule = Adam(RuleParams(lr=1e-3))
    t = [0]

    def adam() -> None:
        t[0] += 1
        rule.apply(weights, slots, upd.tensors, 1.0, t[0])

    def finite() -> None:
        for g in upd.tensors.values():
            if not np.isfinite(g).all():
                raise AssertionError("non-finite")

    parts: dict[str, tuple[list[int], list[int], int]] = {}
    for name, fn, n in (("read+verify", lambda: ch.read_update(path), reps),
                        ("isfinite", finite, reps), ("adam", adam, reps)):
        fn()  # warm: first-touch page faults are not what a running applier pays
        cpu, wall = _timed(fn, n)
        parts[name] = (cpu, wall, 1)

    # The state save and the weights publish, as the applier's own code does them.
    app_ch = Channel(base / "applier", RUN_ID, signer=Signer(key), fsync=fsync)
    app = Applier(app_ch, ApplierConfig("adam", 1e-3, max_batch=batch, keep_versions=3), initial=weights)
    with app:
        slow = max(10, reps // 4)
        parts["state save"] = (*_timed(app._save_state, slow), batch)
        version = [app.version]

        def publish() -> None:
            version[0] += 1
            app_ch.publish_weights(version[0], app.weights)
            app_ch.prune_weights(3)

        parts["weights publish"] = (*_timed(publish, slow), batch)

        copies = []
        for i in range(reps):
            dest = ch.updates_dir / update_name(1, i)
            shutil.copyfile(path, dest)
            copies.append(dest)
        it = iter(copies)
        parts["unlink"] = (*_timed(lambda: os.unlink(next(it)), reps), 1)

        whole = _whole_batches(app, app_ch, grads, batch, slow)
    # The same whole batches for one shard of K: the largest piece of the partition, its own applier.
    per_shard = {1: dict(whole, params=HEP_PARAMS)}
    for k in (k for k in shard_counts if k > 1):
        pieces = partition_of(shapes, k).split(grads)
        piece = max(pieces, key=lambda t: sum(a.nbytes for a in t.values()))
        shard_ch = Channel(base / f"shard-of-{k}", RUN_ID, signer=Signer(key), fsync=fsync)
        initial = {name: np.zeros_like(a) for name, a in piece.items()}
        with Applier(shard_ch, ApplierConfig("adam", 1e-3, max_batch=batch, keep_versions=3),
                     initial=initial) as shard_app:
            per_shard[k] = dict(_whole_batches(shard_app, shard_ch, piece, batch, slow),
                                params=sum(a.size for a in piece.values()))
    out = {name: {"cpu": _quartiles(cpu, per), "wall": _quartiles(wall, per)}
           for name, (cpu, wall, per) in parts.items()}
    total = sum(v["cpu"]["median_ms"] for v in out.values())
    return {"params": HEP_PARAMS, "update_bytes": HEP_PARAMS * 4, "batch": batch, "fsync": fsync,
            "tag": ch.signer.alg, "parts": out, "sum_of_medians_cpu_ms": total,
            "applier_step_per_update": whole, "shard_step_per_update": per_shard}


def _whole_batches(app, channel: Channel, grads: dict, batch: int, reps: int) -> dict:
    """CPU and wall per update of `reps` full batches through the real applier loop (listing,
    events and status included)."""
    cpu, wall, seq = [], [], 0
    for _ in range(reps):
        for _ in range(batch):
            channel.publish_update(2, seq, app.version, grads)
            seq += 1
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        applied = app.counts["applied"]
        app.step()
        applied = max(1, app.counts["applied"] - applied)
        cpu.append((time.process_time_ns() - c0) // applied)
        wall.append((time.perf_counter_ns() - w0) // applied)
    return {"cpu": _quartiles(cpu), "wall": _quartiles(wall)}


def shard_fit(bd: dict) -> dict:
    """CPU per update of one shard of K, fitted as a + b/K (least squares over the measured K):
    a is paid per file in every shard, b is the full update's per-byte work, shared out."""
    ks = sorted(int(k) for k in bd["shard_step_per_update"])  # JSON keys
    cpu = [bd["shard_step_per_update"][str(k)]["cpu"]["median_ms"] for k in ks]
    a, b = (np.linalg.lstsq(np.array([[1.0, 1.0 / k] for k in ks]), np.array(cpu), rcond=None)[0]
            if len(ks) > 1 else (0.0, cpu[0]))
    return {"K": ks, "cpu_ms": cpu, "ratio_to_k1": [c / cpu[0] for c in cpu],
            "fixed_ms": float(a), "shared_ms": float(b)}


def planner_advice(fit: dict, bd: dict, groups: int, max_pending: int | None) -> dict:
    """hpcdl plan's shard advice for `groups` groups at the paper's cadence, with the applier's
    costs as measured here: a per file (the planner's per-file latency λ, paid (1 + 1/batch)
    times per update) and b per full update split into the read (at read + verify's measured
    rate W, once per update and once per batch for the publish) and the apply (A)."""
    from hpcdl.perf.planner import PlanInputs, recommend_shards

    m, n = bd["batch"], float(bd["update_bytes"])
    read_ms = bd["parts"]["read+verify"]["cpu"]["median_ms"]
    bandwidth = n / (read_ms * 1e-3)
    apply_s = max(fit["shared_ms"] * 1e-3 - n * (1 + 1 / m) / bandwidth, 1e-6)  # > 0 if noise says not
    # two K fitted under load can put the per-file part below zero: it is none, not negative
    latency = max(fit["fixed_ms"] * 1e-3 / (1 + 1 / m), 0.0)
    values = dict(exchange_latency=latency, exchange_bandwidth=bandwidth,
                  applier_bytes_per_s=n / apply_s,
                  applier_max_batch=m, max_pending_per_group=max_pending or 0, max_staleness=-1)
    inputs = PlanInputs.measured_here(1.90e12, batch_per_node=8, exchange_every=1).with_values(
        "python -m bench.exchange_load --breakdown on this machine", **values)
    advice = recommend_shards(inputs, nodes=groups, groups=groups)
    return {"inputs": values, "advice": advice.to_dict()}


def _breakdown_child(base: str, reps: int, batch: int, fsync: bool, shard_counts: list[int],
                     pin: set[int] | None, out: str) -> None:
    _pin(pin, "breakdown")
    result = breakdown_parts(Path(base), reps, batch, fsync, shard_counts)
    Path(out).write_text(json.dumps(result))


def run_breakdown(args, base: Path) -> dict:
    """breakdown_parts in a child process, pinned to one core (unless --no-pin)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = {cpus[0]} if args.pin and cpus else None
    where = base / "breakdown"
    where.mkdir(parents=True)
    out = where / "result.json"
    before = machine()
    proc = mp.get_context("fork").Process(target=_breakdown_child,
                                          args=(str(where), args.reps, args.max_batch, args.fsync,
                                                sorted(set(args.shards) | {1}), pin, str(out)))
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not out.exists():
        raise RuntimeError(f"the breakdown failed (exit {proc.exitcode})")
    result = json.loads(out.read_text())
    result.update(cpus=sorted(pin) if pin else None, machine=machine(),
                  load_average_before=before["load_average"])
    result["shard_fit"] = fit = shard_fit(result)
    result["planner"] = planner_advice(fit, result, args.groups, args.max_pending)
    return result


def show_breakdown(b: dict) -> None:
    m = b["machine"]
    print(f"\n== one full HEP update ({b['params']:,} params, {b['update_bytes'] / 1e6:.2f} MB, "
          f"{b['tag']}, fsync {'on' if b['fsync'] else 'off'}), one process on CPU {b['cpus'] or 'any'}: "
          f"CPU ms, median [quartiles]")
    print(f"  machine    {m['cpu_model']} (avx2 {'yes' if m['avx2'] else 'no'}, avx512f "
          f"{'yes' if m['avx512f'] else 'no'}); load average "
          f"{' '.join(f'{x:.1f}' for x in b['load_average_before'] or [])} before, "
          f"{' '.join(f'{x:.1f}' for x in m['load_average'] or [])} after")
    for name, v in b["parts"].items():
        c = v["cpu"]
        amort = f" (÷{c['amortised_over']}: once per batch)" if c["amortised_over"] > 1 else ""
        print(f"  {name:16s} {c['median_ms']:6.2f} [{c['q1_ms']:.2f}-{c['q3_ms']:.2f}]  "
              f"wall {v['wall']['median_ms']:.2f}{amort}, n={c['n']}")
    s = b["applier_step_per_update"]["cpu"]
    print(f"  {'sum of parts':16s} {b['sum_of_medians_cpu_ms']:6.2f}")
    print(f"  {'Applier.step':16s} {s['median_ms']:6.2f} [{s['q1_ms']:.2f}-{s['q3_ms']:.2f}] per update, "
          f"whole batches of {b['batch']} (events, status, listing included), n={s['n']}")
    print(f"  {'step - parts':16s} {s['median_ms'] - b['sum_of_medians_cpu_ms']:6.2f}  (the listing, "
          f"events.jsonl, status.json, ledger and bookkeeping of a batch, per update)")
    fit = b["shard_fit"]
    for k, cpu, ratio in zip(fit["K"], fit["cpu_ms"], fit["ratio_to_k1"]):
        params = b["shard_step_per_update"][str(k)]["params"]
        print(f"  one shard of K = {k}: {cpu:.2f} ms per update ({ratio:.2f} of K = 1, 1/K = {1 / k:.2f}), "
              f"its largest piece {params:,} params, whole batches of {b['batch']}")
    print(f"  fit        {fit['fixed_ms']:.2f} ms per file in every shard + {fit['shared_ms']:.2f} ms / K")
    adv = b["planner"]["advice"]
    print(f"  planner    {adv['groups']} groups at the paper's cadence, these costs: K = {adv['shards']} "
          f"(each shard {100 * adv['applier_utilisation']:.0f} % busy; one applier "
          f"{100 * adv['one_applier_utilisation']:.0f} %), bound {'met' if adv['met'] else 'NOT met'}")


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--sizes", type=_int_list, default=[HEP_PARAMS, 16384],
                   help="comma-separated parameter counts (HEP layout, scaled)")
    p.add_argument("--shards", type=_int_list, default=[1, 2, 4],
                   help="comma-separated exchange.shards values to run (default 1,2,4)")
    p.add_argument("--interval", type=float, default=PAPER_STEP_S,
                   help=f"seconds between a group's updates (default: the paper's step, {PAPER_STEP_S:.3f})")
    p.add_argument("--max-pending", type=int, default=4,
                   help="exchange.max_pending_per_group (0: no bound)")
    p.add_argument("--max-batch", type=int, default=ApplierConfig.max_batch, help="the applier's batch")
    p.add_argument("--drain", type=float, default=60.0, help="seconds the appliers may drain after the load")
    p.add_argument("--dir", type=Path, default=None, help="where the exchange lives (default: a temp dir)")
    p.add_argument("--no-fsync", dest="fsync", action="store_false")
    p.add_argument("--nice", type=int, default=0, help="niceness of the publishers")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not give the appliers a core of their own (the publishers get the others)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the parts of one full HEP update (one process, one core)")
    p.add_argument("--breakdown-only", action="store_true", help="only the breakdown, no load")
    p.add_argument("--reps", type=int, default=200, help="repetitions of each part in the breakdown")
    p.add_argument("--keep", action="store_true", help="keep the exchange directories")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.max_pending = args.max_pending or None
    if args.dir and not Path(args.dir).is_dir():
        p.error(f"--dir {args.dir}: not a directory")
    base = Path(tempfile.mkdtemp(prefix="hpcdl-xload-", dir=args.dir))
    m = machine()
    print(f"exchange load test: {args.groups} group roots + K = {','.join(map(str, args.shards))} "
          f"appliers on {os.cpu_count()} cores ({m['cpu_model']}), in {base}")
    results, ok = [], True
    bd = None
    try:
        if args.breakdown or args.breakdown_only:
            bd = run_breakdown(args, base)
            show_breakdown(bd)
        for size in [] if args.breakdown_only else args.sizes:
            runs = []
            for k in args.shards:
                r = run_shards(size, k, args, base)
                show(r)
                runs.append(r)
                ok &= r["ledger"]["ok"] and not r["process_failures"]
            results.append(dict(runs[0], shard_runs=runs))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        doc = results if bd is None else {"machine": m, "breakdown": bd, "load": results}
        args.json.write_text(json.dumps(doc, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
