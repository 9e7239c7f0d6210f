"""The straggler fit recovers the emulator's own settings; the step-time files survive a kill;
the planner takes stalls and slow nodes; `plan --from-run` refuses a run without times."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from hpcdl.cli import main
from hpcdl.config import EmulateConfig
from hpcdl.jobfile import load_job
from hpcdl.process.emulate import Emulator
from hpcdl.perf.inputs import PlanInputs
from hpcdl.perf.model import sample_slowest, slow_nodes_per_group
from hpcdl.perf.recommend import evaluate
from hpcdl.perf.stragglers import TooFewSteps, fit_stragglers
from hpcdl.rundir.runs import create_run
from hpcdl.rundir.steptimes import RECORD, StepTimeLog, read_step_times


def emulated_times(ranks: int, steps: int, **settings) -> list[list[float]]:
    """Each rank's step times as the emulator would pad them (its own factor function)."""
    config = EmulateConfig(enabled=True, step_seconds=0.05, **settings)
    return [[0.05 * Emulator(config, r, Path("/nonexistent")).factor(s) for s in range(1, steps + 1)]
            for r in range(ranks)]


@pytest.mark.parametrize("sigma", [0.1, 0.3])
@pytest.mark.parametrize("seed", [0, 1])
def test_sigma_is_recovered_within_20_percent(sigma, seed):
    fit = fit_stragglers(emulated_times(4, 200, sigma=sigma, seed=seed))
    assert fit.sigma == pytest.approx(sigma, rel=0.2)
    assert (fit.stall_probability, fit.slow_ranks, fit.ranks) == (0.0, (), 4)
    assert fit.steps == 4 * (200 - 3)


@pytest.mark.parametrize("sigma,probability,factor", [(0.1, 0.02, 3.0), (0.3, 0.05, 4.0)])
def test_stalls_are_found_roughly(sigma, probability, factor):
    fit = fit_stragglers(emulated_times(8, 250, sigma=sigma, stall_probability=probability,
                                        stall_factor=factor, seed=5))
    assert fit.sigma == pytest.approx(sigma, rel=0.2)
    assert fit.stall_probability == pytest.approx(probability, rel=0.5)
    assert fit.stall_factor == pytest.approx(factor, rel=0.2)


def test_a_slow_rank_is_named_and_does_not_count_as_spread():
    fit = fit_stragglers(emulated_times(4, 200, sigma=0.2, slow_shard=2, slow_factor=1.5, seed=1))
    assert [name for name, _ in fit.slow_ranks] == ["2"]
    assert fit.slow_ranks[0][1] == pytest.approx(1.5, rel=0.1)
    assert (fit.slow_node_fraction, fit.slow_factor) == (0.25, fit.slow_ranks[0][1])
    assert fit.sigma == pytest.approx(0.2, rel=0.2)


def test_too_few_steps_is_an_error_that_says_how_many():
    with pytest.raises(TooFewSteps, match="the most: 17"):
        fit_stragglers(emulated_times(2, 20, sigma=0.1))


def test_step_times_survive_a_torn_record_and_a_repeated_step(tmp_path):
    path = tmp_path / "rank0.bin"
    log = StepTimeLog(path, every=4)
    for step in range(1, 7):
        log.record(step, 0.1 * step)
    assert path.stat().st_size == 4 * RECORD.itemsize  # flushed at 4, the rest buffered
    with open(path, "ab") as f:
        f.write(b"\x05\x00\x00")  # a record torn by kill -9
    steps, seconds = read_step_times(path)
    assert steps.tolist() == [1, 2, 3, 4]
    log.record(4, 9.0)  # a restarted rank repeats step 4: its last record counts
    log.flush()
    steps, seconds = read_step_times(path)
    assert steps.tolist() == [1, 2, 3, 4, 5, 6]
    assert seconds[3] == pytest.approx(9.0) and seconds[5] == pytest.approx(0.6)
    assert path.stat().st_size == 7 * RECORD.itemsize  # the torn record was cut off


def test_a_full_disk_drops_the_times_not_the_training(tmp_path, capsys):
    log = StepTimeLog(tmp_path / "missing" / "rank0.bin", every=1)
    log.record(1, 0.1)
    log.record(2, 0.1)
    assert "step times not recorded" in capsys.readouterr().err


def test_stalls_and_slow_nodes_slow_the_planned_step():
    rng = np.random.default_rng(0)
    plain = sample_slowest(rng, 0.1, 16, 20000)
    stalled = sample_slowest(rng, 0.1, 16, 20000, stall_probability=0.05, stall_factor=3.0)
    # P(some node of 16 stalls) = 1 − 0.95¹⁶ ≈ 0.56: over half the steps wait for a stall
    assert np.mean(stalled > 2.5) == pytest.approx(1 - 0.95 ** 16, abs=0.02)
    assert np.mean(plain > 2.5) == 0
    assert slow_nodes_per_group(16, 4, 0.25).tolist() == [1, 1, 1, 1]
    assert slow_nodes_per_group(16, 4, 1 / 16).tolist() == [1, 0, 0, 0]
    base = PlanInputs.measured_here(1e12)
    slow = base.with_values("test", slow_node_fraction=1 / 16, slow_factor=1.5)
    # one group of 16 waits for its slow node every step; with 16 groups only one group does
    assert evaluate(slow, 16, 1).step_s > 1.3 * evaluate(base, 16, 1).step_s
    assert evaluate(slow, 16, 16).sustained_flops > 0.9 * evaluate(base, 16, 16).sustained_flops


def test_default_inputs_draw_as_before():
    """No stalls, no slow nodes: the planner's draws (and so its golden figures) are unchanged."""
    a = sample_slowest(np.random.default_rng(3), 0.2, 8, (2, 5))
    u = np.maximum(np.random.default_rng(3).random((2, 5)), np.finfo(float).tiny)
    from hpcdl.perf.model import norm_ppf
    lu = np.log(u) / 8
    assert np.allclose(a, np.exp(0.2 * norm_ppf(np.exp(lu), -np.expm1(lu)) - 0.02))


@pytest.mark.parametrize("bad", [{"stall_probability": 1.5}, {"stall_factor": 0.5}, {"slow_factor": float("inf")}])
def test_straggler_inputs_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PlanInputs.measured_here(1e12).with_values("test", **bad)


def test_plan_from_a_run_without_step_times_is_one_line_and_exit_2(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"'])
    with create_run(job, "local") as (_, run):
        pass
    result = CliRunner().invoke(main, ["plan", "hep", "--nodes", "8", "--node-flops", "1e12",
                                       "--from-run", str(run.root)])
    assert result.exit_code == 2, result.output
    assert "has no recorded step times" in result.output and len(result.output.strip().splitlines()) == 1


def test_plan_from_a_run_uses_the_fitted_stragglers(tmp_path):
    job = load_job("hep", [f'run.runs_dir="{tmp_path}"', "run.nodes=4", "run.group_size=4"])
    with create_run(job, "local") as (_, run):
        pass
    for rank, times in enumerate(emulated_times(4, 120, sigma=0.25, slow_shard=1, slow_factor=1.6)):
        log = StepTimeLog(run.step_times_file(0, rank))
        for step, seconds in enumerate(times, start=1):
            log.record(step, seconds)
        log.flush()
    result = CliRunner().invoke(main, ["plan", "hep", "--nodes", "8", "--node-flops", "1e12",
                                       "--from-run", run.run_id, "--runs-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["stragglers"]["slow_ranks"][0]["rank"] == "g0r1"
    assert out["inputs"]["straggler_sigma"] == pytest.approx(0.25, rel=0.2)
    assert out["inputs"]["slow_node_fraction"] == 0.25
    assert out["inputs"]["sources"]["straggler_sigma"].startswith(f"fitted to run {run.run_id}: 468 steps of 4 ranks")
    short = CliRunner().invoke(main, ["plan", "hep", "--nodes", "8", "--node-flops", "1e12",
                                      "--from-run", str(run.root)])
    assert short.exit_code == 0 and "Stragglers measured: σ 0." in short.output
