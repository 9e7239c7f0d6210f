#!/usr/bin/env python
"""Many groups against one applier: a load test of the asynchronous exchange on this machine.

G simulated group roots (light processes: numpy and hpcdl.exchange only, no TensorFlow) run the
real group-root code (:class:`hpcdl.hybrid.ExchangeSync`: publish the update, adopt the newest
master weights when there is a newer one) at the paper's cadence, against one real applier
(:class:`hpcdl.applier.Applier`, Adam) in its own process, for a fixed time; then the publishers
stop and the applier drains what is pending (bounded by --drain). Everything goes through real
files in one exchange directory, authenticated with a per-run HMAC key as a run's channels are.

Cadence (the paper's HEP run, Kurth et al. SC17, as hpcdl.perf.planner recalls it): every group
step publishes one update; a step computes 8 examples x 15.43 GFLOP at 1.90 TFLOP/s = 65 ms, so a
group publishes ~15 updates/s. The update is the HEP network's gradient: 594,178 float32
parameters (2.38 MB) in its 12 tensors (5 convolutions 3x3x128, the first from 3 channels, and
the dense 128->2 layer); --sizes adds smaller models (same layout, fewer filters' worth of
parameters), by default 16,384 parameters.

The applier stands for a node of its own: it is pinned to one core and the group roots to the
others (``--no-pin`` lets them share). On a small machine the group roots cannot keep the paper's
cadence (they are 64 processes writing and hashing megabytes on the remaining cores): the offered
rate is printed beside the target, and the applier's CPU time per update -- which does not depend
on how the machine is shared -- gives its capacity on one dedicated core.

Printed per size: updates offered (published) and applied per second, the applier's CPU time per
applied update (user + sys, from getrusage in its process) and its CPU share, the backlog (pending
update files, sampled every 0.25 s: max, mean, at the end of the load, and how long the drain
took), publishers' own publish time, staleness (from the applier's status), and the exactly-once
ledger check: every (group, seq) a publisher published is applied exactly once, or deleted unread
by that publisher's backlog bound (``--max-pending``, the job's ``exchange.max_pending_per_group``),
or still pending when --drain ran out; nothing applied twice, nothing lost.

Usage:

    python bench/exchange_load.py [--groups 64] [--seconds 60] [--sizes 594178,16384]
                                  [--interval 0.065] [--max-pending 4] [--dir DIR] [--no-fsync]
                                  [--json FILE]

Exit status: 0 when the ledger check holds for every size, 1 otherwise.
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hpcdl.exchange import Channel, Signer, parse_update_name  # noqa: E402

RUN_ID = "exchange-load"
HEP_PARAMS = 594_178
PAPER_STEP_S = 8 * 15.43e9 / 1.90e12  # batch 8 x GFLOP per example / node FLOP/s = 0.065 s


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


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------


def publisher(group: int, root: str, key: bytes, shapes: dict, interval: float, start: float,
              stop: float, max_pending: int | None, fsync: bool, nice: int, pin: set[int] | None,
              out: str) -> None:
    from hpcdl.hybrid import ExchangeSync

    if nice:
        os.nice(nice)
    _pin(pin, "publishers")
    ch = Channel(root, RUN_ID, create=False, signer=Signer(key), fsync=fsync,
                 max_pending_per_group=max_pending)
    sync = ExchangeSync(ch, group, every=1, initial_wait_s=0.0)
    rng = np.random.default_rng(group)
    grads = {k: (rng.standard_normal(s) * 1e-3).astype(np.float32) for k, s in shapes.items()}
    own = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    dropped: list[int] = []
    while time.time() < start:
        time.sleep(0.005)
    sync.initial_weights(own)
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
        sync.after_step(step, lambda: grads)
        dropped.extend(r.seq for r in ch.last_dropped)
        next_t = max(next_t + interval, time.monotonic())  # behind: go on at once, no catch-up burst
    Path(out).write_text(json.dumps({
        "group": group, "published": sync.published, "next_seq": sync.seq, "dropped": dropped,
        "publish_s": sync.seconds, "adopted": sync.adopted, "version": sync.version,
        "failures": sync.publish_failures,
    }))


def _pin(cpus: set[int] | None, who: str) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            print(f"could not pin the {who} to {sorted(cpus)}: {e}", file=sys.stderr)


def applier(root: str, key: bytes, shapes: dict, fsync: bool, stop_file: str, drain_s: float,
            max_batch: int, pin: set[int] | None, out: str) -> None:
    from hpcdl.applier import Applier

    _pin(pin, "applier")
    ch = Channel(root, RUN_ID, create=False, signer=Signer(key), fsync=fsync)
    initial = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    app = Applier(ch, "adam", 1e-3, initial=initial, max_batch=max_batch, keep_versions=3,
                  status_interval=1.0)
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
    }))


# ------------------------------------------------------------------------------------------------
# one size
# ------------------------------------------------------------------------------------------------


def read_events(root: Path) -> list[dict]:
    events = []
    for name in ("events.jsonl.1", "events.jsonl"):
        path = root / "applier" / name
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass
    return events


def ledger_check(root: Path, pubs: list[dict]) -> dict:
    """Exactly once: published = applied (once) + dropped by the publisher's bound + pending."""
    events = read_events(root)
    taken = [(e["group"], e["seq"]) for e in events if e["event"] in ("applied", "dropped")]
    applied = set(taken)
    twice = len(taken) - len(applied)
    pending = {parse_update_name(n) for n in os.listdir(root / "updates")} - {None}
    lost, dropped_total, published_total, raced = [], 0, 0, 0
    for p in pubs:
        g = p["group"]
        dropped = set(p["dropped"])
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
    return {"published": published_total, "applied_or_stale": len(applied), "applied_twice": twice,
            "dropped_by_bound": dropped_total, "applied_while_dropped": raced,
            "pending_at_end": len(pending), "lost": lost[:10], "n_lost": len(lost),
            "foreign": foreign[:10], "ok": twice == 0 and not lost and not foreign}


def run_size(params: int, args, base: Path) -> dict:
    shapes = hep_layout(params)
    n_params = int(sum(np.prod(s) for s in shapes.values()))
    root = base / f"x-{n_params}"
    results = base / f"r-{n_params}"
    results.mkdir(parents=True)
    key = secrets.token_bytes(32)
    Channel(root, RUN_ID, signer=Signer(key))  # create the layout once
    ctx = mp.get_context("fork")
    stop_file = str(results / "stop")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    # The applier stands for its own node: it gets a core the group roots do not use.
    app_cpus, pub_cpus = ({cpus[0]}, set(cpus[1:])) if args.pin and len(cpus) >= 2 else (None, None)
    app = ctx.Process(target=applier, args=(str(root), key, shapes, args.fsync, stop_file,
                                            args.drain, args.max_batch, app_cpus,
                                            str(results / "applier.json")))
    app.start()
    start = time.time() + 1.0 + 0.02 * args.groups  # everyone forked and waiting
    stop = start + args.seconds
    pubs = [ctx.Process(target=publisher, args=(g, str(root), key, shapes, args.interval, start, stop,
                                                args.max_pending, args.fsync, args.nice, pub_cpus,
                                                str(results / f"g{g}.json")))
            for g in range(args.groups)]
    for p in pubs:
        p.start()
    samples = []
    updates = root / "updates"
    while time.time() < stop:
        time.sleep(0.25)
        if time.time() >= start:
            try:
                samples.append(sum(1 for n in os.listdir(updates) if n.startswith("u-")))
            except OSError:
                pass
    for p in pubs:
        p.join(timeout=120)
    load_end = time.time()
    at_end = sum(1 for n in os.listdir(updates) if n.startswith("u-"))
    Path(stop_file).touch()
    app.join(timeout=args.drain + 120)
    if app.is_alive():
        app.kill()
    bad = [p.exitcode for p in pubs if p.exitcode != 0] + ([app.exitcode] if app.exitcode else [])
    pub = [json.loads((results / f"g{g}.json").read_text()) for g in range(args.groups)
           if (results / f"g{g}.json").exists()]
    ap = json.loads((results / "applier.json").read_text()) if (results / "applier.json").exists() else {}
    check = ledger_check(root, pub)
    applied = ap.get("counts", {}).get("applied", 0)
    published = sum(p["published"] for p in pub)
    load_s = load_end - start
    in_load = sum(1 for e in read_events(root)
                  if e["event"] == "applied" and start <= e["time"] <= load_end)
    out = {
        "params": n_params, "update_bytes": n_params * 4, "groups": args.groups,
        "interval_s": args.interval, "seconds": args.seconds, "fsync": args.fsync, "nice": args.nice,
        "applier_cpus": sorted(app_cpus) if app_cpus else None,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "max_pending_per_group": args.max_pending, "process_failures": bad,
        "offered_per_s": published / load_s if load_s > 0 else None,
        "offered_target_per_s": args.groups / args.interval,
        "published": published, "applied": applied,
        "applied_per_s": in_load / load_s if load_s > 0 else None,
        "applied_per_s_overall": applied / ap["wall_s"] if ap.get("wall_s") else None,
        "applier_cpu_s": ap.get("cpu_s"), "applier_wall_s": ap.get("wall_s"),
        "applier_cpu_ms_per_update": 1e3 * ap["cpu_s"] / max(1, ap["handled"]) if ap else None,
        "applier_cpu_share": ap["cpu_s"] / ap["wall_s"] if ap.get("wall_s") else None,
        "drain_s": ap.get("drain_s"),
        "backlog_max": max(samples, default=0), "backlog_mean": float(np.mean(samples)) if samples else 0.0,
        "backlog_at_load_end": at_end,
        "keeps_up": bool(samples) and at_end <= max(2 * args.groups, 8) and ap.get("drain_s", 1e9) < 5.0,
        "publish_ms_mean": 1e3 * sum(p["publish_s"] for p in pub) / max(1, published),
        "adopted": sum(p["adopted"] for p in pub),
        "staleness": ap.get("staleness"), "counts": ap.get("counts"), "ledger": check,
    }
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return out


def show(r: dict) -> None:
    f = lambda v, spec="{:.1f}": "-" if v is None else spec.format(v)  # noqa: E731
    st = r["staleness"] or {}
    led = r["ledger"]
    print(f"\n== {r['groups']} groups x {r['params']:,} params ({r['update_bytes'] / 1e6:.2f} MB/update), "
          f"one update every {r['interval_s'] * 1e3:.0f} ms per group, {r['seconds']:.0f} s, "
          f"fsync {'on' if r['fsync'] else 'off'}, backlog bound {r['max_pending_per_group']}, "
          f"applier on CPUs {r['applier_cpus'] or 'shared'}, load average {f(r['load_average'])}")
    print(f"  offered    {f(r['offered_per_s'])} updates/s published (target {f(r['offered_target_per_s'])}); "
          f"publish {f(r['publish_ms_mean'], '{:.2f}')} ms each")
    print(f"  applied    {f(r['applied_per_s'])} updates/s during the load "
          f"({r['applied']} applied of {r['published']} published, drain included)")
    cpu = r["applier_cpu_ms_per_update"]
    print(f"  applier    {f(cpu, '{:.2f}')} ms CPU per update (capacity on one dedicated core: "
          f"~{f(1e3 / cpu if cpu else None, '{:.0f}')} updates/s); it got "
          f"{f(100 * r['applier_cpu_share'] if r['applier_cpu_share'] is not None else None, '{:.0f}')} % of a core over its life")
    print(f"  backlog    max {r['backlog_max']}, mean {r['backlog_mean']:.1f}, at the end of the load "
          f"{r['backlog_at_load_end']}; drained in {f(r['drain_s'])} s -> "
          f"{'keeps up' if r['keeps_up'] else 'DOES NOT keep up (backlog reported above)'}")
    print(f"  staleness  mean {f(st.get('mean'))}, max {st.get('max', '-')}; groups adopted "
          f"{r['adopted']} master versions")
    print(f"  ledger     {'OK' if led['ok'] else 'FAILED'}: {led['published']} published = "
          f"{led['applied_or_stale']} applied once + {led['dropped_by_bound']} dropped by the backlog bound + "
          f"{led['pending_at_end']} pending; applied twice {led['applied_twice']}, "
          f"lost {led['n_lost']}" + (f"; process failures {r['process_failures']}"
                                               if r["process_failures"] else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--sizes", default=f"{HEP_PARAMS},16384",
                   help="comma-separated parameter counts (HEP layout, scaled)")
    p.add_argument("--interval", type=float, default=PAPER_STEP_S,
                   help=f"seconds between a group's updates (default: the paper's step, {PAPER_STEP_S:.3f})")
    p.add_argument("--max-pending", type=int, default=4,
                   help="exchange.max_pending_per_group (0: no bound)")
    p.add_argument("--max-batch", type=int, default=8, help="the applier's batch")
    p.add_argument("--drain", type=float, default=60.0, help="seconds the applier may drain after the load")
    p.add_argument("--dir", type=Path, default=None, help="where the exchange lives (default: a temp dir)")
    p.add_argument("--no-fsync", dest="fsync", action="store_false")
    p.add_argument("--nice", type=int, default=0, help="niceness of the publishers")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not give the applier a core of its own (the publishers get the others)")
    p.add_argument("--keep", action="store_true", help="keep the exchange directories")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    args.max_pending = args.max_pending or None
    base = Path(tempfile.mkdtemp(prefix="hpcdl-xload-", dir=args.dir))
    print(f"exchange load test: {args.groups} group roots + 1 applier on {os.cpu_count()} cores, in {base}")
    results = []
    try:
        for size in (int(s) for s in args.sizes.split(",") if s.strip()):
            r = run_size(size, args, base)
            show(r)
            results.append(r)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["ledger"]["ok"] and not r["process_failures"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
