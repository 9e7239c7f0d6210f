"""What the exchange between groups costs: update files, a group's share, the applier.

Update files (the HEP gradient, signed, fsynced) written and read, MB/s, beside `dd` on the same
disk; the time a group spends publishing/adopting as a share of its wall time, from a short
hybrid run's metrics (exchange_seconds); that cost against the 224×224 step; bench.exchange_load's
applier figures.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import time

from bench.harness import REPO, Bench, BenchError, best, log, median, module_argv
from bench.local_runs import data_sets, generated, metrics, submit


def hep_gradient(params_seed: int = 0) -> dict:
    """Tensors shaped like the HEP network's variables (594,178 float32, 2.38 MB)."""
    import numpy as np

    from hpcdl.workloads.hep.config import HepModelConfig

    c = HepModelConfig()
    rng = np.random.default_rng(params_seed)
    chans = [3] + [c.filters] * c.conv_layers
    out = {}
    for i in range(c.conv_layers):
        out[f"convs{i}/w"] = rng.standard_normal((c.kernel, c.kernel, chans[i], chans[i + 1]), dtype=np.float32)
        out[f"convs{i}/b"] = rng.standard_normal(chans[i + 1], dtype=np.float32)
    out["head/w"] = rng.standard_normal((c.filters, 2), dtype=np.float32)
    out["head/b"] = rng.standard_normal(2, dtype=np.float32)
    return out


def dd(args: list[str]) -> float:
    """Bytes/s that dd reports."""
    p = subprocess.run(["dd", *args], capture_output=True, text=True)
    m = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", p.stderr)
    if p.returncode != 0 or not m:
        raise BenchError(f"dd {' '.join(args)} failed: {p.stderr.strip()[-300:]}")
    return int(m.group(1)) / float(m.group(2))


def files(b: Bench) -> None:
    import secrets as _secrets

    from hpcdl.exchange import Channel, Signer

    root = b.work / "exchange-bw"
    shutil.rmtree(root, ignore_errors=True)
    grads = hep_gradient()
    nbytes = sum(v.nbytes for v in grads.values())
    channel = Channel(root / "x", "bench", signer=Signer(_secrets.token_bytes(32)))
    n = b.args.exchange_files
    t = time.perf_counter()
    for seq in range(n):
        channel.publish_update(0, seq, -1, grads)
    write = n * nbytes / (time.perf_counter() - t)
    refs = channel.pending_updates()
    t = time.perf_counter()
    for ref in refs:
        channel.read_update(ref)
    read = len(refs) * nbytes / (time.perf_counter() - t)
    size_mb = max(64, int(2 * n * nbytes / 2 ** 20))
    target = root / "dd.tmp"
    dd_write = dd(["if=/dev/zero", f"of={target}", "bs=1M", f"count={size_mb}", "conv=fsync"])
    dd_read = dd([f"if={target}", "of=/dev/null", "bs=1M"])
    try:
        dd_direct = dd([f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])
    except BenchError:
        dd_direct = None
    shutil.rmtree(root, ignore_errors=True)
    b.data["exchange_files"] = {"update_bytes": nbytes, "files": n, "write_Bps": write, "read_Bps": read,
                                "dd_write_Bps": dd_write, "dd_read_cached_Bps": dd_read,
                                "dd_read_direct_Bps": dd_direct, "dir": str(root)}
    mb = lambda x: f"{x / 1e6:.0f} MB/s"  # noqa: E731
    b.row("exchange.write", "exchange", f"update files written ({nbytes / 1e6:.2f} MB, HMAC, fsync) ×{n}",
          mb(write), f"{write / dd_write:.2f}x dd", f"dd write (fsync) {mb(dd_write)}, same disk",
          number=write)
    b.row("exchange.read", "exchange", "update files read and verified", mb(read),
          f"{read / dd_read:.2f}x dd", f"dd read {mb(dd_read)} (page cache, like the updates)"
          + (f"; {mb(dd_direct)} O_DIRECT" if dd_direct else ""), number=read)


def exchange_overhead(lines: list[dict]) -> dict | None:
    """Share of a group's wall time spent in publish/adopt, between its first and last metrics."""
    xs = [m for m in lines if "exchange_seconds" in m]
    if len(xs) < 2:
        return None
    first, last = xs[0], xs[-1]
    dt = last["time"] - first["time"]
    if dt <= 0:
        return None
    published = last.get("exchange_published", 0) - first.get("exchange_published", 0)
    spent = last["exchange_seconds"] - first["exchange_seconds"]
    return {"share": spent / dt, "seconds": spent, "wall": dt, "published": published,
            "per_exchange_s": spent / published if published else None,
            "step_time_s": statistics.median(m["step_time_s"] for m in xs[1:])}


def overhead(b: Bench) -> None:
    # a short 2-group run of its own, not paced by the emulator
    files = generated(b, b.args.hybrid_events, 32)
    run_dir, _t0, proc = submit(b, "exchange", [
        *data_sets(files), f"train.steps={b.args.exchange_steps}", "train.batch_per_rank=8",
        "train.log_every=10", f"train.checkpoint_every={b.args.exchange_steps}", "data.chunk_events=512",
    ], nodes=2, group_size=1)
    if proc.returncode != 0 or run_dir is None:
        raise BenchError(f"exchange run failed: {proc.stderr[-2000:]}")
    per_group = [exchange_overhead(metrics(run_dir, g)) for g in range(2)]
    found = {"2x1": [o for o in per_group if o]}
    shutil.rmtree(run_dir, ignore_errors=True)
    b.data["exchange_overhead"] = found
    step224 = None
    st = b.data.get("step", {}).get("step_flops")
    if st:
        step224 = b.data["tf_default"]["flops_per_example"] * b.args.batch / best(st)
    for name, groups in found.items():
        shares = [g["share"] for g in groups]
        per = [g["per_exchange_s"] for g in groups if g["per_exchange_s"]]
        steps = [g["step_time_s"] for g in groups]
        note = (f"{1e3 * median(per):.0f} ms per publish+adopt, group step {1e3 * median(steps):.0f} ms"
                if per else "")
        if per and step224:
            note += f"; = {100 * median(per) / step224:.2f} % of a 224² batch-{b.args.batch} step"
        b.row(f"exchange.overhead.{name}", "exchange", f"group time in publish/adopt, {name} run (32², HEP net)",
              f"{100 * median(shares):.1f} %", "", note, number=median(shares))


def load(b: Bench) -> None:
    """bench.exchange_load's applier figures (a short run of that load test)."""
    if b.args.no_exchange_load:
        return
    out = b.work / "exchange_load.json"
    out.unlink(missing_ok=True)
    where = b.work / "exchange-load"
    where.mkdir(parents=True, exist_ok=True)
    groups, seconds = 4, 10
    log(f"exchange: bench/exchange_load.py, {groups} simulated groups for {seconds} s")
    p = subprocess.run(module_argv("exchange_load", "--groups", str(groups), "--seconds", str(seconds),
                                   "--sizes", "594178", "--shards", "1", "--drain", "20", "--dir", str(where),
                                   "--json", str(out)),
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    shutil.rmtree(where, ignore_errors=True)
    if not out.is_file():
        b.row("exchange.load", "exchange", "bench/exchange_load.py", "failed", "",
              (p.stderr.strip().splitlines() or ["?"])[-1][:100])
        return
    result = json.loads(out.read_text())
    entry = result[0] if isinstance(result, list) and result else {}
    b.data["exchange_load"] = result
    cpu_ms = entry.get("applier_cpu_ms_per_update")
    if not cpu_ms:
        b.row("exchange.load", "exchange", "bench/exchange_load.py", "see JSON")
        return
    b.row("exchange.load", "exchange", f"applier on HEP-size updates (bench/exchange_load.py, {groups} groups)",
          f"{cpu_ms:.1f} ms CPU/update", f"≈{1e3 / cpu_ms:.0f} updates/s per core",
          f"offered {entry.get('offered_per_s', 0):.0f}/s, applied {entry.get('applied_per_s', 0):.0f}/s, "
          f"publish {entry.get('publish_ms_mean', 0):.0f} ms, ledger "
          f"{'OK' if entry.get('ledger', {}).get('ok') else 'FAILED'}", number=cpu_ms)

