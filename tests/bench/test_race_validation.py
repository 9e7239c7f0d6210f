"""bench.race_validation: the emulated race beside the wall-clock race, on curves written here."""

from __future__ import annotations

import pytest

from bench.race_validation import compare, median_or_none, same_order


def climb(rate_per_s: float, samples_per_s: float, every: float = 2.0, until: float = 60.0):
    """An AUC curve rising from 0.5 by `rate_per_s`: (t, samples, AUC) rows, one per score."""
    rows, t = [], 0.0
    while t <= until:
        rows.append((t, int(t * samples_per_s), min(0.99, 0.5 + rate_per_s * t)))
        t += every
    return rows


def wall_run(config: str, seed: int, curve) -> dict:
    return {"phase": "race", "scenario": "a", "config": config, "seed": seed, "rate": 1e-3, "curve": curve}


def emulated_run(groups: int, seed: int, curve) -> dict:
    return {"phase": "race", "scenario": "none", "ranks": 8, "groups": groups, "seed": seed, "rate": 1e-3,
            "curve": [(t, n, 0, auc) for t, n, auc in curve]}


def test_a_seed_that_never_reached_counts_as_late_and_half_missing_is_no_median():
    assert median_or_none([10.0, None, 20.0]) == 20.0
    assert median_or_none([10.0, None, None]) is None
    assert median_or_none([]) is None


def test_times_and_samples_side_by_side_with_the_tolerance_and_the_order():
    # sync: 0.9 held from 20 s in both races; 8x1: 0.9 from 30 s wall-clock but 40 s emulated
    wall = {"runs": [wall_run("1x8 sync", s, climb(0.02, 300)) for s in range(3)]
            + [wall_run("8x1 job defaults", s, climb(0.4 / 30, 300)) for s in range(3)]}
    emulated = [{"runs": [emulated_run(1, s, climb(0.02, 300)) for s in range(3)]
                 + [emulated_run(8, s, climb(0.01, 300)) for s in range(3)]}]
    rows = compare(wall, emulated, (0.9,))
    sync, hybrid = rows
    assert sync["wall"]["median_s"] == sync["emulated"]["median_s"] == 20.0 and sync["within"]
    assert sync["wall"]["median_samples"] == 6000
    assert hybrid["wall"]["median_s"] == 30.0 and hybrid["emulated"]["median_s"] == 40.0
    assert hybrid["ratio"] == pytest.approx(4 / 3) and not hybrid["within"]
    assert same_order(rows) == {"a 0.9": "yes"}


def test_an_order_is_contradicted_only_where_both_races_see_the_difference():
    def row(config, wall_s, emulated_s):
        return {"scenario": "a", "target": 0.5, "config": config, "ratio": wall_s and emulated_s / wall_s,
                "wall": {"median_s": wall_s}, "emulated": {"median_s": emulated_s}}

    # 0.2 s apart on the wall clock, scored every 2 s: a tie there, whatever the emulated order
    assert same_order([row("1x8 sync", 17.5, 14.0), row("8x1", 17.3, 20.0)]) == {"a 0.5": "tie"}
    assert same_order([row("1x8 sync", 24.0, 14.0), row("8x1", 17.3, 20.0)]) == {"a 0.5": "no"}
    assert same_order([row("1x8 sync", 24.0, 14.0), row("8x1", None, 20.0)])["a 0.5"] is None


def test_the_loss_is_compared_on_the_wall_clock_runs_loss_curve_and_emulated_races_that_scored_it():
    def falling(per_s):
        return [(t, n, round(0.7 - (auc - 0.5) * per_s, 4)) for t, n, auc in climb(0.01, 300)]

    wall = {"runs": [{**wall_run("1x8 sync", s, climb(0.02, 300)), "loss_curve": falling(1.0)} for s in range(3)]}
    by_loss = {"metric": "loss", "runs": [emulated_run(1, s, falling(1.0)) for s in range(3)]}
    by_auc = {"metric": "auc_unweighted", "runs": [emulated_run(1, s, climb(0.001, 300)) for s in range(3)]}
    (row,) = compare(wall, [by_auc, by_loss], (0.5,), "loss")
    # loss 0.7 - 0.01 t is at or below 0.5 from t = 20 s on both sides
    assert row["wall"]["median_s"] == row["emulated"]["median_s"] == 20.0 and row["within"]
    assert compare(wall, [by_auc], (0.5,), "loss") == []
