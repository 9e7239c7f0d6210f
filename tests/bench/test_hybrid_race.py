"""The race's arithmetic: which rate the sweep keeps, the ratios to the tuned synchronous run with
their interval over seeds, the AUC at fixed times, and the picture beside the JSON."""

from __future__ import annotations

import pytest

from bench import hybrid_race as race, race_common as common, race_summary
from bench.race_common import Result


def run(config: str, seed: int, times: dict, curve, phase: str = "race", rate: float = 1e-3) -> Result:
    r = Result("a", config, seed, rate, phase, dict(times), curve=curve)
    r.best_auc = max(a for _t, _n, a in curve)
    r.held_auc = common.held(curve)
    return r


def rising(until: float, top: float) -> list:
    return [(t, 0, round(0.8 + (top - 0.8) * t / until, 4)) for t in range(2, int(until) + 1, 2)]


def test_the_sweep_keeps_the_rate_with_the_best_auc_over_the_window_not_the_first_lucky_jump():
    steady = run("x", 100, {"0.92": 40.0}, rising(46, 0.94), "sweep", 1e-3)
    lucky = run("x", 100, {"0.92": 2.0}, [(2, 0, 0.921)] + [(t, 0, 0.75) for t in range(4, 47, 2)],
                "sweep", 2e-3)
    faster = run("x", 100, {"0.92": 30.0}, rising(46, 0.96), "sweep", 4e-3)
    diverged = run("x", 100, {"0.92": None}, [(t, 0, 0.5) for t in range(2, 47, 2)], "sweep", 8e-3)
    ranked = sorted([lucky, steady, diverged, faster], key=race.sweep_key)
    assert [r.rate for r in ranked] == [4e-3, 1e-3, 2e-3, 8e-3]


def test_ratios_are_per_seed_against_the_tuned_sync_with_an_interval_over_seeds():
    results = []
    for seed, (sync_t, hyb_t) in enumerate([(20.0, 10.0), (30.0, 12.0), (25.0, 20.0)]):
        results.append(run("1x8 sync", seed, {"0.9": sync_t, "0.93": None, "sync best": sync_t},
                           rising(60, 0.92)))
        results.append(run("8x1 job defaults", seed, {"0.9": hyb_t, "0.93": None, "sync best": hyb_t},
                           rising(50, 0.93)))
    configs = [common.SYNC, common.job_defaults(8)]
    summary = race_summary.summarise(results, configs, ["a"], {"a": {c.name: c.rate for c in configs}}, {})
    hybrid = summary["a"]["configs"]["8x1 job defaults"]["targets"]
    assert hybrid["0.9"]["ratio_per_seed"] == [0.5, 0.4, 0.8]
    assert hybrid["0.9"]["ratio_to_sync"] == 0.5
    lo, hi = hybrid["0.9"]["ratio_ci95"]
    assert 0.4 <= lo <= 0.5 <= hi <= 0.8
    assert hybrid["0.93"]["time_s"] is None and hybrid["0.93"]["ratio_to_sync"] is None
    sync = summary["a"]["configs"]["1x8 sync"]
    assert sync["targets"]["0.9"]["ratio_to_sync"] == 1.0
    assert sync["auc_at_s"]["30"] == race_summary.auc_at(results[0].curve, 30.0)
    assert summary["a"]["configs"]["8x1 job defaults"]["auc_at_s"]["45"] > sync["auc_at_s"]["45"]


def test_a_run_that_stopped_has_no_auc_at_a_later_time():
    curve = rising(20, 0.9)
    assert race_summary.auc_at(curve, 10.0) == curve[4][2]
    assert race_summary.auc_at(curve, 45.0) is None


def test_the_picture_is_a_png_beside_the_result(tmp_path):
    results = [run("1x8 sync", s, {"0.9": 20.0}, rising(60, 0.92)) for s in range(2)]
    results += [run("8x1 job defaults", s, {"0.9": 10.0}, rising(50, 0.94)) for s in range(2)]
    configs = [common.SYNC, common.job_defaults(8)]
    summary = race_summary.summarise(results, configs, ["a"], {"a": {c.name: c.rate for c in configs}}, {})
    path = race_summary.picture(tmp_path / "race-a.png", "a", summary["a"], results, 60.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Scorer:
    """The eval probe's answer for a run whose AUC is already high while its loss falls slowly."""

    def __init__(self, losses):
        self.losses = iter(losses)

    def ask(self, **_cmd):
        return {"results": [{"auc_unweighted": 0.95, "loss": next(self.losses)}]}


class _Watched:
    class run:
        root = "run"

    @staticmethod
    def snapshot(_keep):
        return "ckpt-5", 5


def test_a_run_goes_on_until_its_loss_targets_too_are_reached(monkeypatch):
    clock = iter(range(100, 200, 2))
    monkeypatch.setattr(race.time, "time", lambda: float(next(clock)))
    rule = common.StopRule(common.named([0.9]), 60.0, run_until=0.0, losses=(0.5, 0.4))
    res = Result("a", common.SYNC.name, 0, 1e-3, "race", {k: None for k in rule.names})
    scorer = _Scorer([0.6, 0.45, 0.38])
    for _ in range(3):
        race._score(res, _Watched, scorer, {}, "val", None, 100.0, common.SYNC, rule)
        if res.stopped:
            break
    assert res.times_to_target == {"0.9": 0.0, "loss 0.5": 2.0, "loss 0.4": 4.0}
    assert [row[2] for row in res.loss_curve] == [0.6, 0.45, 0.38]
    assert res.loss_curve[0][1] == common.SYNC.samples(5)
    assert res.stopped == "every target reached"


def test_fixed_rates_go_to_the_configurations_by_their_group_count():
    configs = [common.SYNC, common.job_defaults(8)]
    assert race._fixed_rates("1:2e-3,8:3.5e-4", configs) == {"1x8 sync": 2e-3, "8x1 job defaults": 3.5e-4}
    assert race._fixed_rates("", configs) == {}
    with pytest.raises(SystemExit, match="8x1 job defaults"):
        race._fixed_rates("1:2e-3", configs)
    with pytest.raises(SystemExit, match="share a G"):
        race._fixed_rates("1:2e-3,8:1e-3", [*configs, common.delta(8, 4)])
