"""The straggler and failure emulator: reproducible from its seed, the shape of its draws, its kill,
and the planner measuring it from a run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcdl.config import EmulateConfig
from hpcdl.process.emulate import Emulator
from tests.conftest import hpcdl, set_args, tiny_overrides


def test_factors_are_reproducible_per_seed_shard_and_step(tmp_path):
    c = EmulateConfig(enabled=True, sigma=0.5, stall_probability=0.02, seed=7)
    a = [Emulator(c, 3, tmp_path / "k").factor(s) for s in range(200)]
    b = [Emulator(c, 3, tmp_path / "k").factor(s) for s in range(200)]
    assert a == b
    assert a != [Emulator(c, 4, tmp_path / "k").factor(s) for s in range(200)]
    assert a != [Emulator(EmulateConfig(enabled=True, sigma=0.5, stall_probability=0.02, seed=8),
                          3, tmp_path / "k").factor(s) for s in range(200)]


def test_lognormal_mean_one_stalls_and_a_slow_shard():
    c = EmulateConfig(enabled=True, sigma=0.5, stall_probability=0.02, stall_factor=4.0, slow_shard=1,
                      slow_factor=2.0)
    fast = np.array([Emulator(c, 0, None).factor(s) for s in range(20000)])
    slow = np.array([Emulator(c, 1, None).factor(s) for s in range(20000)])
    # mean of the lognormal is 1; stalls add 2 % × (4 − 1) = 6 %
    assert abs(fast.mean() - 1.06) < 0.03
    assert abs(np.median(np.log(fast[fast < 3.9])) + 0.125) < 0.03  # mean of log X is −σ²/2
    assert abs(slow.mean() / fast.mean() - 2.0) < 0.1
    assert all(x == 1.0 for x in (Emulator(EmulateConfig(enabled=True), 0, None).factor(s) for s in range(10)))


def test_pace_pads_a_step_to_its_emulated_time(tmp_path):
    c = EmulateConfig(enabled=True, step_seconds=0.2, slow_shard=0, slow_factor=1.5)
    em = Emulator(c, 0, tmp_path / "k")
    start = time.perf_counter()
    em.pace(1, start)
    assert 0.29 <= time.perf_counter() - start < 0.5
    start = time.perf_counter()
    em.pace(2, start - 1.0)  # a step that already took longer is not slowed further
    assert time.perf_counter() - start < 0.05


def test_the_planned_kill_happens_once_per_run(tmp_path):
    mark = tmp_path / "killed"
    code = ("import time; from pathlib import Path; from hpcdl.config import EmulateConfig; "
            "from hpcdl.process.emulate import Emulator; "
            f"e = Emulator(EmulateConfig(enabled=True, kill_shard=2, kill_after_s=0.2, step_seconds=0.05), 2, Path({str(mark)!r})); "
            "[e.pace(s, time.perf_counter()) for s in range(20)]; print('survived')")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert first.returncode == -9 and mark.exists() and "survived" not in first.stdout
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "survived" in again.stdout


def test_plan_from_a_short_synchronous_run_measures_its_emulated_spread(hep_files, tmp_path):
    """One group of two ranks, each step padded to a lognormal time of σ 0.3: the ranks' own
    recorded times give the planner σ back within 20 %, though each step waited for the slower."""
    emulated = ["emulate.enabled=true", "emulate.step_seconds=0.05", "emulate.sigma=0.3", "emulate.seed=7",
                "train.validate_every=0", "train.log_every=50", "train.checkpoint_every=200"]
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=250) + emulated
    hpcdl("submit", "hep", "--nodes", "2", "--group-size", "2", *set_args(overrides), cwd=tmp_path, timeout=300)
    plan = hpcdl("plan", "hep", "--nodes", "8", "--groups", "1,8", "--node-flops", "1e12", "--from-run",
                 str(next((tmp_path / "runs").iterdir())), "--json", cwd=tmp_path, timeout=120)
    fitted = json.loads(plan.stdout)["stragglers"]
    assert fitted["ranks"] == 2 and fitted["steps"] == 2 * (250 - 3)
    assert fitted["sigma"] == pytest.approx(0.3, rel=0.2), fitted
    assert fitted["slow_ranks"] == []
    assert json.loads(plan.stdout)["inputs"]["straggler_sigma"] == fitted["sigma"]
