"""Many groups: 64 simulated group roots against one applier, through
bench.exchange_load (light processes, numpy only), with the exactly-once ledger check."""

from __future__ import annotations

import json
import subprocess
import sys

from hpcdl.applier.config import ApplierConfig
from tests.conftest import REPO


def run_bench(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "-m", "bench.exchange_load", "--dir", str(tmp_path), "--json", str(out),
                           "--shards", "1", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ledger     OK" in proc.stdout and "updates/s" in proc.stdout and "backlog" in proc.stdout
    return json.loads(out.read_text())


def test_64_groups_exactly_once_nothing_lost(tmp_path):
    """No backlog bound: every update any group published is applied, and only once."""
    [r] = run_bench(tmp_path, "--groups", "64", "--seconds", "8", "--sizes", "4096", "--interval", "0.5",
                    "--max-pending", "0", "--no-fsync", "--drain", "120")
    led = r["ledger"]
    assert r["process_failures"] == [] and led["ok"]
    assert led["applied_twice"] == 0 and led["n_lost"] == 0 and led["foreign"] == []
    assert led["dropped_by_bound"] == 0 and led["pending_at_end"] == 0
    assert r["published"] > 64 and led["published"] == r["published"] == r["applied"] == led["applied_or_stale"]
    assert r["counts"]["rejected_corrupt"] == 0 and r["counts"]["duplicates"] == 0
    # the backlog is measured and reported, and the CPU cost per update
    assert isinstance(r["backlog_max"], int) and isinstance(r["backlog_at_load_end"], int)
    assert r["backlog_max"] >= 1 and r["applier_cpu_ms_per_update"] > 0
    assert isinstance(r["keeps_up"], bool) and r["drain_s"] is not None
    assert r["staleness"]["count"] == r["applied"]


def test_64_groups_at_the_papers_cadence_with_the_backlog_bound(tmp_path):
    """The paper's cadence (one update per 65 ms step and group) is more than this machine's
    applier can take: the groups' backlog bound deletes their oldest pending updates, and the
    ledger still balances: each published update applied once or dropped by the bound, none lost."""
    [r] = run_bench(tmp_path, "--groups", "64", "--seconds", "6", "--sizes", "4096", "--max-pending", "2",
                    "--no-fsync", "--drain", "60")
    led = r["ledger"]
    assert r["process_failures"] == [] and led["ok"] and led["n_lost"] == 0 and led["applied_twice"] == 0
    assert led["published"] == led["applied_or_stale"] + led["dropped_by_bound"] + led["pending_at_end"]
    # Bounded: the bound per group, plus each group's newest file before it enforces the bound,
    # plus the applier's batch: applied, but listed until its commit deletes them.
    assert r["backlog_max"] <= 64 * (2 + 1) + ApplierConfig().max_batch
