"""The planner's model of the exchange kinds: updates every H steps, the update's bytes, the
applier's load, K outstanding updates, and the recommendation of H — on hand-computed cases."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpcdl.perf.planner import (
    PlanInputs,
    applier_utilisation,
    evaluate,
    exchange_share,
    plan,
    recommend_every,
    simulate_exchange,
    smallest_every,
)

from .test_planner import INF_BW, simple, slow_applier


def free_network(**kw) -> PlanInputs:
    """5 ms steps (5 · 1e9 / 1e12), no allreduce cost; an applier at 10 ms per update."""
    base = dict(node_flops=1e12, batch_per_node=5, allreduce_latency=0.0,
                allreduce_bandwidth=INF_BW)
    base.update(kw)
    return slow_applier(**base)


# -- the closed form ---------------------------------------------------------------------------


def test_applier_utilisation_by_hand():
    # 8 groups, H = 4 steps of 100 ms, exchange 10 ms, 20 ms of applier per update:
    # 8 updates per 0.41 s, each 20 ms of applier time: 0.16 / 0.41 busy.
    assert applier_utilisation(8, 4, 0.1, 0.01, 0.02) == pytest.approx(0.16 / 0.41)
    # H divides the load: H = 1 → 4 is four times less when the exchange is free
    assert applier_utilisation(8, 1, 0.1, 0.0, 0.02) == pytest.approx(
        4 * applier_utilisation(8, 4, 0.1, 0.0, 0.02))
    assert exchange_share(4, 0.1, 0.01) == pytest.approx(0.01 / 0.41)
    assert exchange_share(4, 0.1, 0.0) == 0.0


def test_smallest_every_by_hand():
    # load: (8 · 0.01 / 0.5 − 0.01) / 0.1 = 1.5; share: 0.01 · 0.95 / (0.05 · 0.1) = 1.9 → 2
    assert smallest_every(8, 0.1, 0.01, 0.01) == 2
    # a slower applier: (8 · 0.05 / 0.5 − 0.01) / 0.1 = 7.9 → 8 (the load binds)
    assert smallest_every(8, 0.1, 0.01, 0.05) == 8
    # an exact bound is met, not exceeded: 4 · 0.025 / 0.5 / 0.1 = 2.0 → 2
    assert smallest_every(4, 0.1, 0.0, 0.025) == 2
    assert smallest_every(1, 0.1, 0.5, 1.0) == 1  # one group: no exchange
    assert smallest_every(8, 1.0, 0.0, 1e-4) == 1  # nothing binds


# -- the simulation against the closed form -------------------------------------------------------


@pytest.mark.parametrize("every, expected", [(10, 0.8), (20, 0.4), (40, 0.2)])
def test_simulated_load_falls_with_h_as_computed(every, expected):
    # 4 groups, one update per H · 5 ms, 10 ms of applier each: 4 / (H · 5 ms) · 10 ms
    c = evaluate(free_network(exchange_every=every), 4, 4, rounds=100)
    assert c.every == every
    assert c.updates_per_s == pytest.approx(4 / (every * 5e-3), rel=1e-6)
    assert c.applier_utilisation == pytest.approx(expected, rel=1e-6)
    assert c.applier_utilisation == pytest.approx(applier_utilisation(4, every, 5e-3, 0.0, 10e-3))
    assert c.step_s == pytest.approx(5e-3) and c.exchange_share == pytest.approx(0.0, abs=1e-9)


def test_gradient_and_fp32_delta_cost_the_same():
    """The simulation counts versions: a fp32 delta is a gradient's bytes, applied alike."""
    grad = evaluate(simple(exchange_every=4), 64, 8, seed=3)
    delta = evaluate(simple(exchange_every=4, exchange_kind="delta"), 64, 8, seed=3)
    assert dataclasses.asdict(grad) == dataclasses.asdict(delta)


def test_float16_delta_halves_the_update_bytes_but_not_the_weights():
    x = simple(exchange_kind="delta", delta_dtype="float16", exchange_latency=1e-3,
               exchange_bandwidth=1e9, applier_bytes_per_s=5e8)
    assert x.update_bytes == 0.5e6 and x.model_bytes == 1e6
    assert x.update_transfer_seconds == pytest.approx(1.5e-3)  # λ + (n/2)/W
    assert x.transfer_seconds == pytest.approx(2e-3)  # master weights stay fp32
    # one update: read 1.5 ms + apply (over every parameter) 2 ms + publish 2 ms
    assert x.applier_batch_seconds(1) == pytest.approx(5.5e-3)
    assert x.applier_seconds_per_update == pytest.approx(5.5e-3)
    assert x.applier_capacity == pytest.approx(1 / 5.5e-3)
    with pytest.raises(ValueError, match="delta_dtype"):
        simple(delta_dtype="float16")  # kind gradient sends fp32 gradients


def test_bytes_through_the_exchange_by_hand():
    x = simple(exchange_kind="delta", delta_dtype="float16")
    sim = simulate_exchange(x, 1, np.full((3, 20), 6e-3))
    assert sim.applied == sim.published == 60
    # each update written and read (u each), each batch of one publishes weights (n), each
    # adoption reads them (n)
    u, n = 0.5e6, 1e6
    assert sim.bytes_moved == pytest.approx(60 * (2 * u + n) + sim.adoptions * n)


# -- K outstanding updates ---------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_saturated_closed_loop_staleness_is_k_g_minus_1(k):
    """4 groups of 20 ms steps offer 200 updates/s to a 100/s applier. With K outstanding each,
    the loop holds K·G updates: every group slows to one update per 40 ms, and an update waits
    behind the other K·G − 1."""
    c = evaluate(slow_applier(max_outstanding=k, node_flops=1e12, batch_per_node=20,
                              allreduce_latency=0.0, allreduce_bandwidth=INF_BW), 4, 4, rounds=400)
    assert c.step_s == pytest.approx(40e-3, rel=0.01)
    assert c.updates_per_s == pytest.approx(100, rel=0.01)
    assert c.staleness_mean == pytest.approx(k * 4 - 1)
    assert c.dropped_fraction == 0.0


def test_k_never_reached_is_the_same_as_never_waiting():
    never = simulate_exchange(simple(), 4, np.full((3, 40), 6e-3))
    k2 = simulate_exchange(simple(max_outstanding=2), 4, np.full((3, 40), 6e-3))
    assert (never.staleness == k2.staleness).all() and (never.finish == k2.finish).all()
    assert never.adoptions == k2.adoptions and never.bytes_moved == k2.bytes_moved


def test_backlog_deletions_answer_a_waiting_group():
    """K = 3 above a backlog bound of 1: deleted updates count as answered, so no group waits
    for an answer that never comes; every round is published."""
    sim = simulate_exchange(slow_applier(max_outstanding=3, max_pending_per_group=1), 1,
                            np.full((4, 100), 5e-3))
    assert sim.published == 400
    assert sim.applied + sim.dropped_backlog == 400 and sim.dropped_backlog > 0


def test_legacy_exchange_blocking_means_k_1(tmp_path):
    f = tmp_path / "old.toml"
    f.write_text('base = "paper"\nexchange_blocking = false\n')
    assert PlanInputs.load(f).max_outstanding == 0
    f.write_text('base = "paper"\nexchange_blocking = true\nmax_outstanding = 2\n')
    with pytest.raises(ValueError, match="not both"):
        PlanInputs.load(f)
    assert PlanInputs.paper_cori_hep().max_outstanding == 1 and \
        PlanInputs.paper_cori_hep().waits_for_replies


# -- the recommendation of H -------------------------------------------------------------------


def test_recommended_h_when_the_applier_binds():
    # 4 groups of 5 ms steps, 10 ms per update: busy 8/H ≤ 0.45 → H ≥ 17.8 → 18
    a = recommend_every(free_network(), 4, 4, max_utilisation=0.45)
    assert a.every == 18 and a.met
    assert a.applier_utilisation == pytest.approx(8 / 18, rel=1e-6)
    assert "applier's load sets it" in a.reason and "mean of H steps" in a.reason
    below = evaluate(free_network(exchange_every=17), 4, 4)
    assert below.applier_utilisation > 0.45  # 17 would not do


def test_recommended_h_when_the_exchange_binds():
    # 2 groups of 5 ms steps; the exchange costs publish λ + listing λ + reading the weights λ
    # = 3 ms: share 3/(5H + 3) ≤ 5 % → H ≥ 11.4 → 12
    x = simple(exchange_latency=1e-3, node_flops=1e12, batch_per_node=5, allreduce_latency=0.0,
               allreduce_bandwidth=INF_BW, exchange_kind="delta")
    at_1 = evaluate(x, 2, 2)
    assert at_1.exchange_s == pytest.approx(3e-3, rel=0.01) and at_1.min_every == 12
    a = recommend_every(x, 2, 2)
    assert a.every == 12 and a.kind == "delta"
    assert a.exchange_share == pytest.approx(3 / 63, rel=0.01)
    assert "exchange's share sets it" in a.reason and "gradient" not in a.reason
    assert evaluate(dataclasses.replace(x, exchange_every=11), 2, 2).exchange_share > 0.05


def test_recommended_h_is_1_when_nothing_binds_and_says_so():
    a = recommend_every(simple(allreduce_latency=0.0, allreduce_bandwidth=INF_BW), 64, 4)
    assert a.every == 1 and a.met and a.reason.startswith("H = 1 already meets both bounds")


def test_no_h_meets_an_applier_slower_than_the_groups_can_wait_for():
    # a 100 s applier: even H = 1024 leaves it saturated
    a = recommend_every(simple(applier_bytes_per_s=1e6 / 100.0), 4, 4)
    assert not a.met and a.every == 1024 and "no H up to 1024" in a.reason


def test_plan_carries_the_h_advice_and_the_paper_keeps_h_1():
    p = plan(PlanInputs.paper_cori_hep(), 9600)
    assert p.recommended == 6 and p.every_advice.groups == 6 and p.every_advice.every == 1
    assert p.to_dict()["every_advice"]["every"] == 1
    one = plan(simple(), 64, [1])
    assert one.recommended == 1 and one.every_advice is None


def test_plan_names_a_group_count_that_wins_at_its_own_h():
    # at H = 1 the 10 ms applier saturates with any 4+ groups of 5 ms steps; at its own H a
    # larger count meets both rules, and with stragglers (σ) more groups sustain more
    x = free_network(straggler_sigma=0.2)
    p = plan(x, 64, [1, 2, 4, 8], staleness_bound=16)
    assert p.recommended == 1
    alt = p.alternative
    assert alt is not None and alt.groups > 1 and alt.every > 1
    assert alt.sustained_flops > 1.01 * p.candidate(1).sustained_flops
    assert alt.applier_utilisation <= 0.5 and alt.exchange_share <= 0.05


# -- the inputs as data ------------------------------------------------------------------------


def test_one_table_of_inputs_and_presets_that_cover_it():
    from hpcdl.perf.planner import FIELDS, HPCDL_DEFAULTS, PAPER_CORI_HEP

    names = [f.name for f in dataclasses.fields(PlanInputs) if f.name not in ("label", "sources")]
    assert names == [f.name for f in FIELDS]
    assert list(PAPER_CORI_HEP) == names  # every input, with its source
    measured = {"node_flops", "flops_per_example", "batch_per_node", "model_bytes"}
    assert set(HPCDL_DEFAULTS) | measured == set(names) and not set(HPCDL_DEFAULTS) & measured
    assert all(source for _, source in PAPER_CORI_HEP.values())
    with pytest.raises(ValueError, match="lacks node_flops"):
        PlanInputs.from_preset({k: v for k, v in PAPER_CORI_HEP.items() if k != "node_flops"}, "x")
    row = PlanInputs.paper_cori_hep().assumptions()[0]
    assert (row.name, row.value, row.unit) == ("node_flops", 1.9e12, "FLOP/s")
