"""The group root's side of the exchange for each kind: what is published, when it waits, what it adopts."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from hpcdl.exchange import Channel
from hpcdl.exchange.group import ExchangeSync


def weights(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, value, np.float32), "b": np.array(value, np.float32)}


def published(channel: Channel) -> list:
    return [channel.read_update(r) for r in channel.pending_updates()]


def test_delta_publishes_base_minus_local_every_h_steps(tmp_path):
    channel = Channel(tmp_path / "x", "run", fsync=False)
    sync = ExchangeSync(channel, group=0, every=3, initial_wait_s=0.1, kind="delta")
    sync.initial_weights(weights(1.0))  # no applier: our own weights are the base
    current = {"value": 1.0}
    for step in (1, 2):
        current["value"] -= 0.1
        assert sync.after_step(step, lambda: {}, lambda: weights(current["value"])) is None
    assert published(channel) == []  # nothing before step H
    current["value"] = 0.7
    sync.after_step(3, lambda: {}, lambda: weights(0.7))
    (update,) = published(channel)
    np.testing.assert_allclose(update.tensors["w"], 0.3, rtol=1e-6)  # θ_base − θ_local
    assert update.base_version == -1 and update.tensors["w"].dtype == np.float32
    # no master yet: the next H steps start from where the group is
    sync.after_step(6, lambda: {}, lambda: weights(0.5))
    np.testing.assert_allclose(published(channel)[-1].tensors["w"], 0.2, rtol=1e-6)


def test_delta_adopts_the_master_and_takes_it_as_the_new_base(tmp_path):
    channel = Channel(tmp_path / "x", "run", fsync=False)
    channel.publish_weights(0, weights(1.0))
    sync = ExchangeSync(channel, group=0, every=2, kind="delta", delta_dtype="float16")
    assert sync.initial_weights(weights(5.0))["w"][0] == 1.0 and sync.version == 0
    channel.publish_weights(4, weights(0.9))
    adopted = sync.after_step(2, lambda: {}, lambda: weights(0.8))
    assert adopted is not None and adopted["w"][0] == pytest.approx(0.9) and sync.version == 4
    update = published(channel)[0]
    assert update.tensors["w"].dtype == np.float16 and update.base_version == 0
    np.testing.assert_allclose(update.tensors["w"], 0.2, rtol=1e-3)
    sync.after_step(4, lambda: {}, lambda: weights(0.85))
    last = published(channel)[-1]
    assert last.base_version == 4
    np.testing.assert_allclose(last.tensors["w"], 0.05, rtol=1e-2)  # from the adopted 0.9


def test_gradient_every_h_publishes_the_mean_of_the_h_gradients(tmp_path):
    channel = Channel(tmp_path / "x", "run", fsync=False)
    sync = ExchangeSync(channel, group=0, every=2, initial_wait_s=0.1)
    sync.initial_weights(weights(0.0))
    sync.after_step(1, lambda: weights(1.0))
    sync.after_step(2, lambda: weights(3.0))
    sync.after_step(3, lambda: weights(10.0))
    sync.after_step(4, lambda: weights(20.0))
    assert [float(u.tensors["w"][0]) for u in published(channel)] == [2.0, 15.0]


def answer(channel: Channel, group: int, seq: int) -> None:
    channel.status_path.write_text(json.dumps({"last_seq": {str(group): seq}}))


def test_max_outstanding_waits_for_the_answer_then_stops_waiting_for_a_silent_applier(tmp_path):
    channel = Channel(tmp_path / "x", "run", fsync=False)
    sync = ExchangeSync(channel, group=0, every=1, initial_wait_s=0.1, max_outstanding=1,
                        reply_timeout_s=0.5)
    sync.initial_weights(weights(0.0))
    start = time.monotonic()
    sync.after_step(1, lambda: weights(1.0))  # nobody answers: waits out the timeout once
    assert 0.45 <= time.monotonic() - start < 3 and sync.reply_timeouts == 1
    start = time.monotonic()
    for step in range(2, 6):
        sync.after_step(step, lambda: weights(1.0))  # the applier is silent: no more waiting
    assert time.monotonic() - start < 0.4 and sync.reply_timeouts == 1
    answer(channel, 0, 4)  # the applier is back and has answered up to seq 4
    assert sync.unanswered() == 0
    start = time.monotonic()
    sync.after_step(6, lambda: weights(1.0))  # seq 5 unanswered: waits again
    assert time.monotonic() - start >= 0.45 and sync.reply_timeouts == 2
    assert sync.stats()["exchange_wait_seconds"] >= 0.9


def test_max_outstanding_two_lets_one_update_stay_unanswered(tmp_path):
    channel = Channel(tmp_path / "x", "run", fsync=False)
    sync = ExchangeSync(channel, group=0, every=1, initial_wait_s=0.1, max_outstanding=2,
                        reply_timeout_s=5.0)
    sync.initial_weights(weights(0.0))
    start = time.monotonic()
    sync.after_step(1, lambda: weights(1.0))
    assert time.monotonic() - start < 1.0 and sync.unanswered() == 1
    answer(channel, 0, 0)
    sync.after_step(2, lambda: weights(1.0))
    assert time.monotonic() - start < 2.0 and sync.reply_timeouts == 0


def test_the_warm_up_waits_for_every_answer_then_lets_max_outstanding_stay_unanswered(tmp_path):
    channel = Channel(tmp_path / "x", "run", fsync=False)
    sync = ExchangeSync(channel, group=0, every=1, initial_wait_s=0.1, max_outstanding=2,
                        warmup_steps=2, reply_timeout_s=0.5)
    sync.initial_weights(weights(0.0))
    assert [sync.outstanding_limit(s) for s in (1, 2, 3, 600)] == [1, 1, 2, 2]
    for step in (1, 2):  # the cold start: each update's answer is awaited, even with one unanswered
        start = time.monotonic()
        sync.after_step(step, lambda: weights(1.0))
        assert time.monotonic() - start >= 0.45 and sync.reply_timeouts == step
        answer(channel, 0, sync.seq - 2)  # every update but the newest answered
        assert sync.unanswered() == 1
        answer(channel, 0, sync.seq - 1)
    start = time.monotonic()
    sync.after_step(3, lambda: weights(1.0))  # past the warm-up: one update may stay unanswered
    assert time.monotonic() - start < 0.4 and sync.unanswered() == 1 and sync.reply_timeouts == 2
    sync.after_step(4, lambda: weights(1.0))  # two unanswered: waits
    assert sync.reply_timeouts == 3 and sync.unanswered() == 2


def test_a_stop_request_ends_the_wait_for_an_answer(tmp_path):
    channel = Channel(tmp_path / "x", "run", fsync=False)
    sync = ExchangeSync(channel, group=0, every=1, initial_wait_s=0.1, max_outstanding=1,
                        reply_timeout_s=30.0)
    sync.initial_weights(weights(0.0))
    sync.interrupt = lambda: True  # e.g. SLURM's warning signal arrived
    start = time.monotonic()
    sync.after_step(1, lambda: weights(1.0))
    assert time.monotonic() - start < 1.0 and sync.reply_timeouts == 0


def test_gradient_every_h_after_a_restart_divides_by_the_steps_it_summed(tmp_path):
    channel = Channel(tmp_path / "x", "run", fsync=False)
    sync = ExchangeSync(channel, group=0, every=4, initial_wait_s=0.1)
    sync.initial_weights(weights(0.0))
    sync.after_step(7, lambda: weights(2.0))  # resumed at step 6: steps 7 and 8 before the publish
    sync.after_step(8, lambda: weights(4.0))
    assert [float(u.tensors["w"][0]) for u in published(channel)] == [3.0]
