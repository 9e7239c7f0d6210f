"""bench.exchange_load with exchange.shards = K: K applier processes, the
group roots split each update over them, and the exactly-once ledger holds in every shard."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_two_shards_every_update_applied_whole_once_in_each_shard(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.exchange_load", "--dir", str(tmp_path), "--json", str(out),
         "--groups", "6", "--seconds", "3", "--sizes", "4096", "--shards", "1,2", "--interval", "0.2",
         "--max-pending", "0", "--no-fsync", "--drain", "60"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ledger 1   OK" in proc.stdout and "per shard" in proc.stdout
    [entry] = json.loads(out.read_text())
    one, two = entry["shard_runs"]
    assert entry["shards"] == one["shards"] == 1 and two["shards"] == 2
    assert entry["applier_cpu_ms_per_update"] == one["applier_cpu_ms_per_update"]  # the K = 1 figures
    assert two["partition"]["shards"] == 2 and sum(two["partition"]["bytes"]) == two["update_bytes"]
    for r in (one, two):
        led = r["ledger"]
        assert r["process_failures"] == [] and led["ok"] and len(led["per_shard"]) == r["shards"]
        assert r["published"] > 6
        for shard in led["per_shard"]:
            # no bound: each shard applied every update once, nothing dropped, lost or pending
            assert shard["published"] == r["published"] == shard["applied_or_stale"]
            assert shard["applied_twice"] == shard["n_lost"] == shard["dropped_by_bound"] == 0
            assert shard["pending_at_end"] == 0
        assert led["updates_applied_whole"] == r["published"] and led["updates_applied_in_part"] == 0
        assert len(r["shard_cpu_ms_per_update"]) == r["shards"] and all(c > 0 for c in r["shard_cpu_ms_per_update"])
        assert r["applier_cpu_ms_per_update"] == sum(r["shard_cpu_ms_per_update"])
        assert r["machine"]["cpu_model"] is not None and len(r["machine"]["load_average"]) == 3
    # the two shards' pieces are the whole model, each tensor once or in row blocks
    assert sum(s["params"] for s in two["per_shard"]) == two["params"]


def test_the_breakdown_measures_one_shard_of_each_k_and_the_planner_advises_from_the_fit(tmp_path):
    out = tmp_path / "bd.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.exchange_load", "--dir", str(tmp_path), "--json", str(out),
         "--breakdown-only", "--reps", "4", "--max-batch", "4", "--shards", "2", "--no-pin", "--groups", "64"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    bd = json.loads(out.read_text())["breakdown"]
    shards = bd["shard_step_per_update"]
    assert sorted(shards) == ["1", "2"]  # K = 1 always, for the ratios
    assert shards["2"]["params"] < shards["1"]["params"] == 594_178
    fit = bd["shard_fit"]
    assert fit["K"] == [1, 2] and fit["ratio_to_k1"][0] == 1.0
    # two points: the fit passes through both
    for k, cpu in zip(fit["K"], fit["cpu_ms"]):
        assert abs(fit["fixed_ms"] + fit["shared_ms"] / k - cpu) < 1e-6
    advice = bd["planner"]["advice"]
    assert advice["groups"] == 64 and advice["shards"] >= 1
    assert "one shard of K = 2" in proc.stdout and "planner    64 groups" in proc.stdout
