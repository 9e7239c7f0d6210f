"""`hpcdl plan --target`: the time to accuracy of each group count by the emulated race, on a
user's own (keras) job, and the group count it recommends."""

from __future__ import annotations

import json
import math

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from hpcdl.cli import main
from tests.workloads.conftest import BUILDER, JOB


def blobs(path, n: int, seed: int):
    """Three overlapping classes: a small network needs tens of steps to reach 70 % accuracy."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(size=(n, 6)).astype(np.float32) + 50.0
    x[np.arange(n), y] += 1.5
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, y
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan-accuracy")
    (d / "my_model.py").write_text(BUILDER)
    text = JOB.format(train=blobs(d / "train.h5", 4096, 1), val=blobs(d / "val.h5", 512, 2), runs=d / "runs")
    (d / "job.toml").write_text(text.replace("learning_rate = 0.01", "learning_rate = 0.002"))
    # a node's step of 32 examples of this network at 70 kFLOP/s: about 0.2 s
    (d / "quiet.toml").write_text("node_flops = 7e4\nstraggler_sigma = 0.0\n")
    (d / "stalls.toml").write_text("node_flops = 7e4\nstraggler_sigma = 0.1\nstall_probability = 0.1\n"
                                   "stall_factor = 20.0\n")
    return d


def plan(job, inputs: str, *args: str) -> dict:
    result = CliRunner().invoke(main, ["plan", str(job / "job.toml"), "--nodes", "8", "--inputs",
                                       str(job / inputs), "--target", "accuracy=0.7", "--race-steps", "100",
                                       "--groups", "1,8", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["accuracy"]


def medians(accuracy: dict) -> dict:
    return {o["groups"]: o["median_s"] for o in accuracy["outcomes"]}


def test_heavy_stalls_recommend_groups(job):
    # one step of a synchronous group of 8 stalls with probability 1 − 0.9⁸ = 0.57; a group of one 0.1
    acc = plan(job, "stalls.toml")
    m = medians(acc)
    assert acc["recommended_groups"] == 8 and m[8] < 0.5 * m[1], acc
    best = next(o for o in acc["outcomes"] if o["groups"] == 8)
    assert acc["recommended_rate"] == best["rate"] and best["reached"] == 3
    assert any("stalls 0.1 × 20" in line for line in acc["basis"])


def test_without_stragglers_the_recommendation_is_the_races_fastest(job):
    acc = plan(job, "quiet.toml")
    m = medians(acc)
    assert None not in m.values(), acc
    assert acc["recommended_groups"] == min(m, key=lambda g: (m[g], g))
    assert acc["recommended_groups"] == 1, acc  # on this job and seeds: one tuned group is faster
    for o in acc["outcomes"]:  # every rate was swept until the best was interior, or says where it stopped
        assert o["sweep"] in ("interior", "top", "bottom") and len(o["tried"]) >= 3
        assert len(o["times_s"]) == 3


def test_text_names_the_recommendation_and_what_it_rests_on(job):
    result = CliRunner().invoke(main, ["plan", str(job / "job.toml"), "--nodes", "8", "--inputs",
                                       str(job / "stalls.toml"), "--target", "accuracy>=0.7", "--groups", "1,8",
                                       "--race-steps", "100", "--race-seeds", "1"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for piece in ("Time to accuracy ≥ 0.7 at 8 nodes", "Recommended: G = 8 groups of 1 nodes",
                  "exchange.learning_rate", "It rests on:", "tuning seed 100", "the untrained model scored accuracy"):
        assert piece in text, piece


def test_a_smaller_copy_of_the_job_learns_while_the_time_stays_the_planned_networks(job):
    result = CliRunner().invoke(main, ["plan", str(job / "job.toml"), "--nodes", "8", "--inputs", str(job / "quiet.toml"),
                                       "--target", "accuracy=0.7", "--groups", "1", "--race-steps", "30",
                                       "--race-seeds", "1", "--race-set", "train.batch_per_rank=8", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["inputs"]["batch_per_node"] == 32  # the job's, as the time is planned
    learning = out["accuracy"]["basis"][0]
    assert learning.startswith("learning: a copy of the job (train.batch_per_rank=8) on its data, 8 emulated ranks "
                               "of 8 examples"), learning


@pytest.mark.parametrize("args, match", [
    (("--target", "accuracy"), "METRIC=VALUE"),
    (("--target", "auc=0.9", "--groups", "1"), "gives accuracy, loss, not 'auc'"),
    (("--target", "accuracy=0.7", "--race-ranks", "3", "--groups", "2"), "divides both"),
    (("--target", "loss<=1000", "--groups", "1"), "the untrained model already scores loss"),
])
def test_bad_targets_are_one_line(job, args, match):
    result = CliRunner().invoke(main, ["plan", str(job / "job.toml"), "--nodes", "8", "--inputs",
                                       str(job / "quiet.toml"), *args])
    assert result.exit_code == 2 and match in result.output, result.output


def test_a_malformed_target_fails_before_this_machine_is_measured(job):
    result = CliRunner().invoke(main, ["plan", str(job / "job.toml"), "--nodes", "8", "--target", "loss=abc"])
    assert result.exit_code == 2 and "METRIC=VALUE" in result.output, result.output
    assert "measuring" not in result.output, result.output


def shipped_job(d, name: str, data: dict, **fields) -> str:
    """jobs/NAME.toml with its data in `data` and `fields` (`key = value` lines of the file) changed."""
    from hpcdl.jobfile import resolve_job_path

    lines = []
    for line in resolve_job_path(name).read_text().splitlines():
        key = line.split("=")[0].strip()
        if key in data:
            line = f'{key} = "{data[key]}"'
        elif key in fields:
            line = f"{key} = {fields[key]}"
        lines.append(line)
    path = d / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def race(job_file: str, inputs, target: str, steps: int, reach: bool = True) -> dict:
    result = CliRunner().invoke(main, ["plan", job_file, "--nodes", "8", "--inputs", str(inputs), "--target", target,
                                       "--race-ranks", "2", "--groups", "1,2", "--race-steps", str(steps),
                                       "--race-seeds", "1", "--json"])
    assert result.exit_code == 0, result.output
    acc = json.loads(result.stdout)["accuracy"]
    assert [o["groups"] for o in acc["outcomes"]] == [1, 2]
    assert all(len(o["tried"]) >= 3 for o in acc["outcomes"])
    if reach:
        assert acc["recommended_groups"] in (1, 2) and acc["recommended_rate"] > 0, acc
    return acc


@pytest.mark.slow
def test_the_shipped_hep_job_races_its_own_network_on_its_data(job, tmp_path):
    from tests.conftest import write_nersc

    data = {"train": write_nersc(tmp_path / "train.h5", 2048, seed=1), "val": write_nersc(tmp_path / "val.h5", 512, seed=2)}
    data["test"] = data["val"]
    hep = shipped_job(tmp_path, "hep", data, filters=4, conv_layers=2, dropout=0.0, batch_per_rank=16,
                      chunk_events=256)
    acc = race(hep, job / "quiet.toml", "loss=0.5", 60)
    assert "loss ≤ 0.5" in acc["target"] and any("2 emulated ranks of 16 examples" in b for b in acc["basis"])
    # a plan this machine cannot race within the budget stops before it starts, saying what to lower
    result = CliRunner().invoke(main, ["plan", hep, "--nodes", "8", "--inputs", str(job / "quiet.toml"), "--target",
                                       "loss=0.5", "--race-ranks", "2", "--race-budget", "0.001"])
    assert result.exit_code == 2 and "over the budget of 0.001 min" in result.output, result.output
    # its filters (4) are below the narrowest copy, so the copies it tried halved the batch
    assert "so would its smallest copy (train.batch_per_rank=8): lower --race-steps" in result.output, result.output


@pytest.mark.slow
def test_the_shipped_climate_job_races_to_a_detection_map(job, tmp_path):
    from hpcdl.workloads.climate.generate import generate

    data = generate(tmp_path / "data", 200, height=32, width=48, labelled_fraction=0.5, seed=1)
    climate = shipped_job(tmp_path, "climate", data, filters="[8, 16]", grid_convs=1, batch_per_rank=8,
                          score_threshold=0.001, validate_events=8)
    # a race short enough for the suite: the detector need not reach the target, only be scored
    acc = race(climate, job / "quiet.toml", "map50=0.1", 20, reach=False)
    assert "map50 ≥ 0.1" in acc["target"]
    assert any("the untrained model scored map50 0" in b for b in acc["basis"]), acc["basis"]
    means = [key[-1] for o in acc["outcomes"] for key in o["tried"].values()]  # each rate's mean map50
    assert all(math.isfinite(m) and 0.0 <= m <= 1.0 for m in means), acc["outcomes"]


def test_the_race_bar_appears_once_the_races_begin_after_the_budget_is_checked(monkeypatch):
    """While plan times a step and a score against --race-budget, it says so; no bar sits at 0."""
    import hpcdl.perf.race_worker as race_worker
    from hpcdl.perf.command import PlanRequest, make_plan

    events = []

    def races(workload, job, inputs, nodes, aim, *, groups, race_seeds, budget_s, progress, **_):
        events.append(f"budget {budget_s:g} s")
        for g in groups:
            for _seed in range(3 + race_seeds):
                progress(f"G={g}")

    monkeypatch.setattr(race_worker, "plan_accuracy", races)
    make_plan(PlanRequest(job="hep", nodes=8, node_flops=1e11, target="loss=0.3", group_counts=(1, 2), race_seeds=1),
              note=lambda text: events.append("note: " + text.split(":")[0]),
              race_progress=lambda n: events.append(f"bar of {n}") or (lambda what: events.append(what)))
    assert events == ["note: timing a step and a score of the job here", "budget 900 s", "bar of 8",
                      *["G=1"] * 4, *["G=2"] * 4]


def test_a_race_over_the_budget_runs_on_the_first_smaller_copy_that_fits(job, monkeypatch):
    """The job's own races would take too long here; plan races the cheapest copy it needs instead
    and says so. This machine's timing is replaced by one proportional to a race's examples."""
    import hpcdl.perf.race_worker as race_worker

    timed = []

    def seconds(workload, job, stats, score, steps, scores, groups=1):
        timed.append((job.train.batch_per_rank, groups))
        return groups * job.train.batch_per_rank * 4.0, 0.1

    monkeypatch.setattr(race_worker, "race_wall_seconds", seconds)
    # per group count 5 races (3 rates, one extension, 1 seed): at batch 32 the 8 groups' alone
    # 5 × 1024 s = 85 min, over 30, so G = 1 is not timed; at 16 (by FLOPs) 43 min; at 8 24 min
    acc = plan(job, "quiet.toml", "--race-seeds", "1", "--race-budget", "30")
    assert timed == [(32, 8), (8, 8), (8, 1)], timed  # the costliest count first; the copy its FLOPs said would fit
    assert any("a copy of the job (train.batch_per_rank=8, chosen to fit --race-budget: the job's own races "
               "would take at least 85 min here)" in b for b in acc["basis"]), acc["basis"]
    assert any("emulated ranks of 8 examples" in b for b in acc["basis"]), acc["basis"]


def test_the_copies_narrow_the_model_first_then_halve_the_batch():
    from hpcdl.jobfile import load_job
    from hpcdl.perf.race_worker import smaller_copies
    from hpcdl.workloads import get_workload

    hep = load_job("hep", ["model.filters=32", "train.batch_per_rank=32"])
    made = [overrides for _job, overrides in smaller_copies(get_workload("hep"), hep)]
    assert made == [("model.filters=16",), ("model.filters=8",), ("model.filters=8", "train.batch_per_rank=16"),
                    ("model.filters=8", "train.batch_per_rank=8")]
    climate = load_job("climate", ["model.filters=[32, 64, 128]", "train.batch_per_rank=8"])
    copies = list(smaller_copies(get_workload("climate"), climate))
    assert [c.model.filters for c, _ in copies] == [(16, 32, 64), (8, 16, 32), (4, 8, 16)]
    assert copies[-1][1] == ("model.filters=[4, 8, 16]",)
