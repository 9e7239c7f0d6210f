"""`hpcdl status --plot`: the curves of a run as one PNG."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from hpcdl.cli import main
from hpcdl.commands.progress_plot import aggregate_flops, plot_run
from hpcdl.rundir.runs import RunDir


def fake_run(tmp_path, rates_by_group, hybrid=True):
    """Groups logging every 10 s from t=100: step, loss, FLOP/s (and a master version)."""
    for g, rates in rates_by_group.items():
        d = tmp_path / "groups" / str(g)
        d.mkdir(parents=True)
        lines = [{"time": 100.0 + 10 * (i + 1), "step": 10 * (i + 1), "loss": 1.0 / (i + 1),
                  "flops_per_s_group": rate, **({"exchange_version": 3 * i} if hybrid else {})}
                 for i, rate in enumerate(rates)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"torn')
    return RunDir(tmp_path)


def test_aggregate_sums_the_groups_on_a_common_grid():
    series = {0: [{"time": 10.0, "flops_per_s_group": 1.0}, {"time": 20.0, "flops_per_s_group": 3.0}],
              1: [{"time": 10.0, "flops_per_s_group": 5.0}]}
    grid, total = aggregate_flops(series, t0=0.0)
    assert grid[0] == 0.0 and grid[-1] == 20.0
    # up to t=10 both groups' first windows; then group 0's second window alone; group 1 has ended
    assert total[grid <= 10.0] == pytest.approx(6.0)
    assert np.all(total[grid > 10.0] == 3.0)


def test_plot_of_a_hybrid_run(tmp_path):
    run = fake_run(tmp_path, {0: [1e9, 2e9, 2e9], 1: [1e9, 1e9]})
    png = plot_run(run, tmp_path / "curves.png")
    from matplotlib.image import imread

    height, width, _ = imread(png).shape
    assert height > width  # three panels stacked
    assert not list(tmp_path.glob(".curves.png*"))  # no temporary left behind


def test_nothing_logged_is_a_clear_error(tmp_path):
    (tmp_path / "groups" / "0").mkdir(parents=True)
    with pytest.raises(ValueError, match="no group has logged a step yet"):
        plot_run(RunDir(tmp_path), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plot_and_watch_do_not_mix(tmp_path):
    result = CliRunner().invoke(main, ["status", str(tmp_path), "--plot", str(tmp_path / "x.png"), "--watch"])
    assert result.exit_code == 2 and "without --watch" in result.output


def test_unwritable_plot_path_is_one_line(tmp_path):
    run = fake_run(tmp_path / "run", {0: [1e9]})
    (run.root / "job.toml").write_text("")  # what makes a directory a run for `find_run`
    result = CliRunner().invoke(main, ["status", str(run.root), "--plot", str(tmp_path / "no/such/dir/x.png")])
    assert result.exit_code == 1 and "cannot write" in result.output and "No such file" in result.output
