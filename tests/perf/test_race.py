"""The emulated race (hpcdl.perf.race): its clock and exchange on a numpy toy trainer, its real
steps on a tiny HEP network."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from hpcdl.config import EmulateConfig

from hpcdl.jobfile import load_job
from hpcdl.perf.race import EmulatedRace, RaceClock


def toy_job(nodes: int, groups: int, *sets: str):
    return load_job("hep", [f"run.nodes={nodes}", f"run.group_size={nodes // groups}",
                            "train.batch_per_rank=4", "exchange.warmup_steps=0", *sets])


class ToyTrainer:
    """w ← w − 0.1·g with g = w − 1 + a little noise from the batch: learns, deterministically."""

    def initial(self):
        return {"w": np.zeros(3, np.float32)}

    def step(self, replica, batch):
        g = replica["w"] - 1.0 + np.float32(0.01) * np.sin(batch + np.arange(3, dtype=np.float32))
        replica["w"] = replica["w"] - np.float32(0.1) * g
        return {"w": g.astype(np.float32)}

    def weights(self, replica):
        return {"w": replica["w"].copy()}

    def adopt(self, replica, weights):
        replica["w"] = weights["w"].copy()


def toy_race(job, clock=RaceClock(step_seconds=1.0), horizon=40.0):
    batches = [itertools.count(100 * g) for g in range(job.run.groups)]
    race = EmulatedRace(job, ToyTrainer(), batches, clock, score=lambda w: -float(np.abs(w["w"] - 1).sum()),
                        score_every=5.0, horizon=horizon)
    return race.run()


def test_a_slow_node_delays_its_group_only():
    job = toy_job(4, 2, "exchange.max_outstanding=0")
    quiet = toy_race(job)
    slow = toy_race(job, RaceClock(1.0, EmulateConfig(slow_shard=1, slow_factor=3.0)))
    assert quiet.group_steps == [40, 40]
    assert slow.group_steps == [13, 40]  # shard 1 is rank 1 of group 0


def test_with_stalls_the_hybrid_trains_more_samples_than_sync_in_the_same_time():
    stalls = RaceClock(1.0, EmulateConfig(stall_probability=0.05, stall_factor=10.0, seed=3))
    hybrid_job = toy_job(8, 8, "exchange.max_outstanding=0")
    sync, hybrid = toy_race(toy_job(8, 1), stalls, 200.0), toy_race(hybrid_job, stalls, 200.0)
    quiet_sync = toy_race(toy_job(8, 1), horizon=200.0)
    # a step of 8 ranks stalls with probability 1 − 0.95⁸ = 0.34 (E 4.1 s), one rank's 0.05 (E 1.45 s)
    assert sync.curve[-1][1] < 0.4 * quiet_sync.curve[-1][1]
    assert hybrid.curve[-1][1] > 2 * sync.curve[-1][1]
    assert quiet_sync.curve[-1][1] == toy_race(hybrid_job, horizon=200.0).curve[-1][1]


def test_the_staleness_bound_is_honoured():
    applier = RaceClock(1.0, applier_seconds=0.3)  # a slow applier: 8 groups outrun it
    dropped = toy_race(toy_job(8, 8, "exchange.max_outstanding=0", "exchange.max_staleness=2"), applier)
    st = np.array(dropped.staleness)
    assert st.max() > 2 and dropped.counters["dropped_stale"] == int((st > 2).sum())
    assert dropped.counters["applied"] == int((st <= 2).sum())
    down = toy_race(toy_job(8, 8, "exchange.max_outstanding=0", "exchange.max_staleness=2",
                            'exchange.stale_policy="downweight"'), applier)
    assert down.counters["dropped_stale"] == 0 and down.counters["downweighted"] == int((np.array(down.staleness) > 2).sum())


def test_waiting_for_each_answer_on_equal_steps_gives_the_papers_staleness():
    res = toy_race(toy_job(8, 4, "exchange.max_outstanding=1"), RaceClock(1.0, applier_seconds=0.01))
    assert res.counters["applied"] > 20 and max(res.staleness) == 3  # G − 1
    assert res.group_steps == [39] * 4 and all(w > 0 for w in res.wait_seconds)  # they wait for answers


def test_the_toy_race_is_deterministic_and_learns():
    job = toy_job(8, 4, "exchange.max_outstanding=2")
    clock = RaceClock(1.0, EmulateConfig(sigma=0.3, stall_probability=0.1, seed=5), applier_seconds=0.05)
    a, b = toy_race(job, clock), toy_race(job, clock)
    assert a.curve == b.curve and a.staleness == b.staleness
    assert a.curve[-1][3] > a.curve[0][3]


# -- real steps: a tiny HEP network -----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(hep_files):
    from hpcdl.workloads import get_workload

    files = hep_files
    job = load_job("hep", [f'data.train="{files["train"]}"', f'data.val="{files["test"]}"',
                           f'data.test="{files["test"]}"', "train.batch_per_rank=8", "model.filters=4",
                           "model.conv_layers=2", "model.dropout=0.0", "data.chunk_events=256",
                           "data.prefetch=0", "exchange.warmup_steps=3"])
    workload = get_workload("hep")
    return workload, job, workload.compute_stats(job)


def sized(job, nodes: int, groups: int):
    run = dataclasses.replace(job.run, nodes=nodes, group_size=nodes // groups)
    return dataclasses.replace(job, run=run)


def tf_race(tiny, nodes, groups, horizon=3.0):
    from hpcdl.perf.race_worker import emulated_race

    workload, job, stats = tiny
    clock = RaceClock(0.5, EmulateConfig(sigma=0.3, seed=2))
    score = lambda w: float(sum(float(np.abs(v).sum()) for v in w.values()))  # cheap, exact
    return emulated_race(workload, sized(job, nodes, groups), stats, clock, score=score,
                         score_every=1.0, horizon=horizon)


def test_a_real_race_is_deterministic(tiny):
    a, b = tf_race(tiny, 4, 2), tf_race(tiny, 4, 2)
    assert a.counters["applied"] > 0 and a.curve == b.curve
    assert all(np.array_equal(a.weights[n], b.weights[n]) for n in a.weights)


def test_a_groups_batch_is_its_ranks_batches_as_the_engine_reads_them(tiny):
    from hpcdl.perf.race_worker import group_batches

    workload, job, stats = tiny
    job8 = sized(job, 8, 2)  # two groups of four ranks: group 1's ranks read shards 4-7 of 8
    streams = group_batches(workload, job8, stats, seed=3)
    ranks = [workload.train_batches(job8, stats, r, 8, seed=3) for r in range(4, 8)]
    try:
        for _ in range(3):
            x, y, w = next(streams[1])
            parts = [next(it) for it in ranks]
            np.testing.assert_array_equal(x, np.concatenate([p[0] for p in parts]))
            np.testing.assert_array_equal(y, np.concatenate([p[1] for p in parts]))
            np.testing.assert_array_equal(w, np.concatenate([p[2] for p in parts]))
    finally:
        for it in [*streams, *ranks]:
            it.close()


@pytest.fixture
def weighted(tiny, tmp_path):
    """tiny's job on a copy of its data whose events weigh 0.1 to 10 (the toy's weigh one per class)."""
    import shutil

    import h5py

    workload, job, _stats = tiny
    train = shutil.copy(job.data.train, tmp_path / "weighted.h5")
    with h5py.File(train, "r+") as f:
        w = f["all_events/weight"]
        w[...] = np.exp(np.random.default_rng(0).uniform(np.log(0.1), np.log(10.0), w.shape)).astype(np.float32)
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, train=str(train)))
    return workload, job, workload.compute_stats(job)


def test_one_group_is_synchronous_sgd_on_the_mean_of_its_ranks_gradients(weighted):
    # as Horovod averages them: HEP's loss is weighted and normalised per batch, so the mean of
    # four ranks' gradients is not the gradient of their batches' union
    import tensorflow as tf

    from hpcdl.engine.optim import make_optimizer
    from hpcdl.perf.race_worker import group_batches

    workload, job, stats = weighted
    res = tf_race(weighted, 4, 1, horizon=3.0)
    steps = res.group_steps[0]
    assert steps >= 3 and res.counters["applied"] == 0
    job4 = sized(job, 4, 1)
    model = workload.build_model(job4.model, workload.input_shape(job4), seed=job4.train.seed)
    variables = [v for _, v in model.named_variables()]
    optimizer = make_optimizer(job4.train.optimizer, variables, job4.train.learning_rate)
    (batches,) = group_batches(workload, job4, stats, seed=job4.train.seed)
    union_differs = False
    try:
        for _ in range(steps):
            x, y, w = next(batches)
            grads = []
            for r in range(4):
                with tf.GradientTape() as tape:
                    loss = workload.loss(model, (x[8 * r:8 * r + 8], y[8 * r:8 * r + 8], w[8 * r:8 * r + 8]), True)
                grads.append(tape.gradient(loss, variables))
            mean = [tf.add_n(list(g)) / 4 for g in zip(*grads)]
            with tf.GradientTape() as tape:
                union = tape.gradient(workload.loss(model, (x, y, w), True), variables)
            union_differs |= any(float(tf.reduce_max(tf.abs(a - b))) > 1e-3 * float(tf.reduce_max(tf.abs(b)))
                                 for a, b in zip(mean, union))
            optimizer.apply(mean, variables)
    finally:
        batches.close()
    assert union_differs  # the test tells the two apart
    for name, var in model.named_variables():
        np.testing.assert_allclose(res.weights[name], var.numpy(), rtol=1e-4, atol=1e-5)


def test_the_planned_clock_times_the_planned_scale_not_the_emulated_one():
    from hpcdl.perf.inputs import PlanInputs
    from hpcdl.perf.model import allreduce_seconds

    base = PlanInputs.measured_here(1e12, batch_per_node=8, input_shape=(32, 32, 3))
    quiet = base.with_values("test", straggler_sigma=0.0)
    clock = RaceClock.planned(quiet, nodes=512, groups=4, seed=0)
    step = quiet.compute_seconds + allreduce_seconds(quiet, 128)  # P = 128 nodes, whatever the race's ranks
    assert clock.group_step(0, 2, 1) == pytest.approx(step) and allreduce_seconds(quiet, 128) > allreduce_seconds(quiet, 2)
    one_slow = quiet.with_values("test", slow_node_fraction=1 / 512, slow_factor=3.0)
    clock = RaceClock.planned(one_slow, nodes=512, groups=4, seed=0)
    assert clock.group_step(0, 2, 7) == pytest.approx(step + 2 * quiet.compute_seconds)  # group 0 holds it
    assert clock.group_step(1, 2, 7) == pytest.approx(step)
    noisy = RaceClock.planned(base.with_values("test", straggler_sigma=0.3), nodes=512, groups=4, seed=5)
    assert noisy.group_step(2, 2, 3) == noisy.group_step(2, 2, 3) != noisy.group_step(2, 2, 4)  # seeded by step
