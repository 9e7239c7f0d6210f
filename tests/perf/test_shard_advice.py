"""The planner's model of exchange.shards: each applier sees every update, 1/S of its bytes."""

import dataclasses

import pytest

from hpcdl.perf.planner import PlanInputs, plan, recommend_shards


@pytest.fixture
def inputs():
    return PlanInputs.measured_here(1.9e12)  # hpcdl's HEP job: 128 examples per node per step


def test_a_shards_time_per_update_falls_with_its_share_of_the_bytes(inputs):
    one = inputs.applier_seconds_per_update
    slow = dataclasses.replace(inputs, exchange_latency=0.0)
    assert dataclasses.replace(slow, exchange_shards=4).applier_seconds_per_update == pytest.approx(
        slow.applier_seconds_per_update / 4)
    # the per-file latency does not shrink: four shards are less than four times faster
    assert dataclasses.replace(inputs, exchange_shards=4).applier_seconds_per_update > one / 4
    # and every group root pays one file operation per shard
    assert dataclasses.replace(inputs, exchange_shards=4).update_transfer_seconds == pytest.approx(
        inputs.update_transfer_seconds + 3 * inputs.exchange_latency)


def test_one_applier_is_enough_for_a_few_groups_and_more_are_advised_for_many(inputs):
    light = recommend_shards(inputs, 9600, 8)
    assert light.shards == 1 and light.met
    heavy_inputs = dataclasses.replace(inputs, applier_bytes_per_s=0.2e9, exchange_latency=1e-3)
    heavy = recommend_shards(heavy_inputs, 9600, 64)
    assert heavy.met and heavy.shards > 1
    assert heavy.one_applier_utilisation > 0.5 >= heavy.applier_utilisation
    fewer = recommend_shards(dataclasses.replace(heavy_inputs, exchange_shards=1), 9600, 64)
    assert fewer == heavy  # the advice does not depend on the shards the inputs say


def test_the_plan_carries_the_shard_advice_for_its_recommended_groups(inputs):
    p = plan(dataclasses.replace(inputs, max_outstanding=1), 9600, [4, 8])
    assert p.shard_advice is not None and p.shard_advice.groups == p.recommended
    assert p.to_dict()["shard_advice"]["shards"] == p.shard_advice.shards


def fast_steps(**values):
    """The paper's cadence (8 examples per node, a 65 ms step) with per-file costs as this
    machine's load bench measured them; roots that never wait, so an overloaded applier drops
    updates instead of slowing the groups."""
    base = PlanInputs.measured_here(1.9e12, batch_per_node=8, exchange_every=1)
    return base.with_values("test", **{**dict(exchange_latency=0.4e-3, exchange_bandwidth=2.6e9,
                                               applier_bytes_per_s=1.9e9, applier_max_batch=32,
                                               max_pending_per_group=4, max_staleness=-1,
                                               max_outstanding=0), **values})


def test_roots_that_wait_for_an_overloaded_applier_get_the_shards_that_end_the_wait():
    from hpcdl.perf.recommend import MAX_SHARDED_EXCHANGE_SHARE

    waiting = fast_steps(max_outstanding=2)
    advice = recommend_shards(waiting, 64, 64)
    # one applier makes the roots wait more than a quarter of a step, two still do: the search
    # goes on past them, since each shard shortens the wait more than its file operation costs
    assert recommend_shards(dataclasses.replace(waiting, exchange_shards=1), 64, 64) == advice
    assert advice.shards > 2 and advice.applier_utilisation <= 0.5 and advice.met
    assert advice.exchange_share <= MAX_SHARDED_EXCHANGE_SHARE


def test_an_overloaded_applier_gets_shards_even_when_they_cost_the_groups_file_operations():
    advice = recommend_shards(fast_steps(), 64, 64)
    assert advice.one_applier_utilisation > 1.0  # one applier would drop most updates
    assert advice.shards > 1 and advice.applier_utilisation <= 0.5
    assert advice.exchange_share > 0.05 and not advice.met  # the groups pay for it: said so


def test_shards_stop_where_the_exchange_files_would_take_a_quarter_of_a_step():
    from hpcdl.perf.recommend import MAX_SHARDED_EXCHANGE_SHARE

    advice = recommend_shards(fast_steps(exchange_latency=3e-3), 64, 64)  # a slow metadata server
    assert advice.exchange_share <= MAX_SHARDED_EXCHANGE_SHARE and not advice.met
    assert advice.applier_utilisation < advice.one_applier_utilisation
