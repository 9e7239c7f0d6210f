"""Time to accuracy (hpcdl.perf.accuracy): targets, when a run reaches one, the rate sweep that
moves until its best is interior, and the recommendation."""

from __future__ import annotations

import math

import pytest

from hpcdl.perf.accuracy import Outcome, Run, Target, recommend, sweep_rate


@pytest.mark.parametrize("text, metric, value, higher", [
    ("auc=0.95", "auc", 0.95, True), ("r2>=0.9", "r2", 0.9, True), ("loss<=0.3", "loss", 0.3, False),
    ("loss=0.3", "loss", 0.3, False), ("mse_1=2e-3", "mse_1", 2e-3, False), ("accuracy = 0.7", "accuracy", 0.7, True),
])
def test_targets_parse_with_the_metrics_direction(text, metric, value, higher):
    assert Target.parse(text) == Target(metric, value, higher)


@pytest.mark.parametrize("text", ["auc", "auc>0.9", "=0.9", "auc=nan", "auc=inf", "auc=x"])
def test_a_malformed_target_is_refused(text):
    with pytest.raises(ValueError, match="target"):
        Target.parse(text)


def curve(*scores, every=2.0):
    return [(i * every, 0, 0, s) for i, s in enumerate(scores)]


def test_a_target_is_reached_where_it_holds_over_two_scores():
    auc = Target.parse("auc=0.9")
    assert Run(curve(0.93, 0.7, 0.91, 0.85, 0.92, 0.95), False).reached_at(auc) == 8.0  # the untrained 0.93 is luck
    assert Run(curve(0.5, 0.95, 0.96), True).reached_at(auc) is None  # diverged later: reaches nothing
    assert Run(curve(0.5, 0.95, math.nan, 0.96, 0.97), False).reached_at(auc) == 6.0
    assert Run(curve(2.0, 0.4, 0.2, 0.1), False).reached_at(Target.parse("loss=0.25")) == 4.0


def test_the_mean_score_counts_an_early_stop_at_its_last_score_and_is_signed():
    early = Run(curve(0.5, 0.8, 0.9), False)  # stopped at 4 s of a 10 s horizon
    assert early.mean_score(Target.parse("auc=0.9"), 10.0) == pytest.approx((0.8 + 0.9 * 4) / 5)
    assert Run(curve(1.0, 0.5), False).mean_score(Target.parse("loss=0.1"), 2.0) == -0.5
    assert Run(curve(0.5, 0.9), True).mean_score(Target.parse("auc=0.9"), 2.0) == -math.inf


def peaked(best: float):
    """A sweep key that peaks at `best` (log scale), as a learning rate's outcome does."""
    return lambda rate: (0, 0.0, -abs(math.log2(rate / best)))


def test_the_sweep_moves_past_an_edge_until_the_best_is_interior():
    rate, where, tried = sweep_rate(peaked(0.016), centre=0.001, extend=5)
    assert (rate, where) == (pytest.approx(0.016), "interior")
    assert sorted(tried) == pytest.approx([0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032])


def test_a_sweep_that_runs_out_of_extensions_reports_its_edge():
    assert sweep_rate(peaked(1.0), centre=0.001, extend=1)[:2] == (pytest.approx(0.004), "top")
    assert sweep_rate(peaked(1e-9), centre=0.001, extend=0)[:2] == (pytest.approx(0.0005), "bottom")
    assert sweep_rate(peaked(0.001), centre=0.001, extend=0)[:2] == (pytest.approx(0.001), "interior")


def test_the_recommendation_is_the_fastest_that_always_reached_and_fewer_groups_on_a_tie():
    sync = Outcome(1, 0.01, "interior", times=[10.0, 12.0, 11.0])
    quick_but_unsure = Outcome(8, 0.001, "interior", times=[2.0, None, 2.0])
    tie = Outcome(4, 0.002, "interior", times=[11.0, 9.0, 13.0])
    assert recommend([sync, quick_but_unsure, tie]) is sync
    assert (sync.median, sync.interval, quick_but_unsure.median) == (11.0, (10.0, 12.0), None)
    assert recommend([quick_but_unsure]) is None
    faster = Outcome(2, 0.003, "interior", times=[6.0, 7.0, 5.0])
    assert recommend([sync, faster, tie]) is faster
