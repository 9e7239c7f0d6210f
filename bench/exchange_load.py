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
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcdl.applier.config import ApplierConfig
from hpcdl.exchange import Channel, Signer

from bench.exchange_breakdown import run_breakdown, show_breakdown
from bench.exchange_procs import (
    HEP_PARAMS, PAPER_STEP_S, RUN_ID, SHARING_NOTE, StartClock, applier, combine_ledgers, hep_layout, ledger_check,
    machine, partition_of, publisher, read_events,
)


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
    load = _run_load(args, shapes, parts, roots, results)
    pub = [json.loads((results / f"g{g}.json").read_text()) for g in range(args.groups)
           if (results / f"g{g}.json").exists()]
    aps = [json.loads((results / f"applier-{k}.json").read_text())
           if (results / f"applier-{k}.json").exists() else {} for k in range(shards)]
    ledger = combine_ledgers([ledger_check(load.channels[k], pub, k) for k in range(shards)], pub)
    per_shard = [_shard_figures(k, aps[k], load, parts[k], partition.shard_bytes()[k]) for k in range(shards)]
    out = _run_figures(args, load, n_params, partition, pub, ledger, per_shard)
    if not args.keep:
        shutil.rmtree(roots[0].parent, ignore_errors=True)
    return out


@dataclass
class _Load:
    """What happened in one load: its channels, when it started and ended, each shard's backlog
    samples and what was left at the end, the processes that failed."""

    channels: list
    app_cpus: set[int] | None
    pub_cpus: set[int] | None
    load_before: list | None
    setup_s: float = 0.0
    ready: int = 0
    start: float = 0.0
    end: float = 0.0
    samples: list[list[int]] = field(default_factory=list)
    at_end: list[int] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)


def _run_load(args, shapes: dict, parts: list[dict], roots: list[Path], results: Path) -> _Load:
    """Start the appliers and the publishers, sample each shard's backlog until the load ends,
    then let the appliers drain (bounded by --drain)."""
    key = secrets.token_bytes(32)
    ctx = mp.get_context("fork")
    stop_file = str(results / "stop")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    # The appliers stand for nodes of their own: they get a core the group roots do not use
    # (one core for the K of them: their CPU per update is what is measured, not their rate).
    app_cpus, pub_cpus = ({cpus[0]}, set(cpus[1:])) if args.pin and len(cpus) >= 2 else (None, None)
    load = _Load([Channel(r, RUN_ID, signer=Signer(key)) for r in roots],  # the layout, made once
                 app_cpus, pub_cpus, machine()["load_average"], samples=[[] for _ in roots])
    apps = [ctx.Process(target=applier, args=(str(roots[k]), key, parts[k], args.fsync, stop_file,
                                              args.drain, args.max_batch, app_cpus,
                                              str(results / f"applier-{k}.json")))
            for k in range(len(roots))]
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
    load.start, stop, load.ready = clock.start(args.seconds, timeout=300)
    load.setup_s = time.monotonic() - forked
    while time.time() < stop:
        time.sleep(0.25)
        if time.time() >= load.start:
            for k, ch in enumerate(load.channels):
                try:
                    load.samples[k].append(ch.backlog())
                except OSError:
                    pass
    for p in pubs:
        p.join(timeout=120)
    load.end = time.time()
    load.at_end = [ch.backlog() for ch in load.channels]
    Path(stop_file).touch()
    for a in apps:
        a.join(timeout=args.drain + 120)
        if a.is_alive():
            a.kill()
    load.failures = [p.exitcode for p in pubs if p.exitcode != 0] + [a.exitcode for a in apps if a.exitcode]
    return load


def _shard_figures(k: int, ap: dict, load: _Load, part: dict, shard_bytes: int) -> dict:
    """Shard k's figures from its applier's report, its event log and the backlog samples."""
    load_s = load.end - load.start
    in_load = sum(1 for e in read_events(load.channels[k])
                  if e["event"] == "applied" and load.start <= e["time"] <= load.end)
    handled = ap.get("handled", 0)
    # The updates this shard read: a file listed and then deleted by its publisher's backlog
    # bound before the read ("vanished") or a replay ("duplicates") costs a listing entry,
    # not an update; dividing by them would make a shard that loses the race look cheaper.
    counts = ap.get("counts", {})
    read = handled - counts.get("vanished", 0) - counts.get("duplicates", 0)
    samples, at_end = load.samples[k], load.at_end[k]
    return {
        "shard": k, "params": int(sum(np.prod(s) for s in part.values())),
        "bytes": shard_bytes, "pieces": list(part),
        "applied": counts.get("applied", 0),
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
        "drain_per_s": (at_end / ap["drain_s"] if ap.get("drain_s") and at_end >= 8 else None),
        "backlog_max": max(samples, default=0),
        "backlog_mean": float(np.mean(samples)) if samples else 0.0,
        "backlog_at_load_end": at_end,
        "staleness": ap.get("staleness") or None, "counts": ap.get("counts"),
    }


def _run_figures(args, load: _Load, n_params: int, partition, pub: list[dict], ledger: dict,
                 per_shard: list[dict]) -> dict:
    """The run's figures: the offered and applied rates, the appliers' CPU, the backlog, the
    publishers' times, staleness, counts and the ledger, with every shard's beside them."""
    shards = len(per_shard)
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
    published = sum(p["published"] for p in pub)
    load_s = load.end - load.start
    return {
        "params": n_params, "update_bytes": n_params * 4, "shards": shards,
        "partition": partition.describe(), "groups": args.groups,
        "interval_s": args.interval, "seconds": args.seconds, "fsync": args.fsync, "nice": args.nice,
        "applier_cpus": sorted(load.app_cpus) if load.app_cpus else None,
        "publisher_cpus": sorted(load.pub_cpus) if load.pub_cpus else None,
        "machine": machine(), "load_average_before": load.load_before, "cpu_note": SHARING_NOTE,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "max_pending_per_group": args.max_pending, "process_failures": load.failures,
        "setup_s": load.setup_s, "publishers_ready": load.ready,
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
        "backlog_at_load_end": sum(load.at_end),
        "keeps_up": all(bool(load.samples[k]) and load.at_end[k] <= max(2 * args.groups, 8)
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
