"""Where one full update's CPU goes: the parts of one HEP-size update timed as the applier does
them, in one process on one core (bench.exchange_load --breakdown), and what they say of the
shards an applier needs."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import shutil
import time
from pathlib import Path

import numpy as np

from hpcdl.exchange import Channel, Signer, update_name

from bench.exchange_procs import HEP_PARAMS, RUN_ID, hep_layout, machine, partition_of, pin_to


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
    per_shard = {1: dict(whole, params=HEP_PARAMS),
                 **{k: _largest_shard_batches(base, key, fsync, shapes, grads, k, batch, slow)
                    for k in shard_counts if k > 1}}
    out = {name: {"cpu": _quartiles(cpu, per), "wall": _quartiles(wall, per)}
           for name, (cpu, wall, per) in parts.items()}
    total = sum(v["cpu"]["median_ms"] for v in out.values())
    return {"params": HEP_PARAMS, "update_bytes": HEP_PARAMS * 4, "batch": batch, "fsync": fsync,
            "tag": ch.signer.alg, "parts": out, "sum_of_medians_cpu_ms": total,
            "applier_step_per_update": whole, "shard_step_per_update": per_shard}


def _largest_shard_batches(base: Path, key: bytes, fsync: bool, shapes: dict, grads: dict, shards: int,
                           batch: int, reps: int) -> dict:
    """The whole batches of one shard of `shards`: the largest piece of the partition, on an
    applier of its own."""
    from hpcdl.applier import Applier, ApplierConfig

    pieces = partition_of(shapes, shards).split(grads)
    piece = max(pieces, key=lambda t: sum(a.nbytes for a in t.values()))
    channel = Channel(base / f"shard-of-{shards}", RUN_ID, signer=Signer(key), fsync=fsync)
    initial = {name: np.zeros_like(a) for name, a in piece.items()}
    with Applier(channel, ApplierConfig("adam", 1e-3, max_batch=batch, keep_versions=3), initial=initial) as app:
        return dict(_whole_batches(app, channel, piece, batch, reps), params=sum(a.size for a in piece.values()))


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
    pin_to(pin, "breakdown")
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
