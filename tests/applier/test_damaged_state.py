"""A damaged applier state: recovered from the generation before it, or a failure said in one line."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.applier import StateLost
from hpcdl.exchange import Channel
from tests.applier.test_server import assert_weights_equal, drain, events, expected_sgd, grad, sgd_applier


def flip_region(path, size=4096) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(max(0, middle - size // 2), min(len(data), middle + size // 2)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def applied_once(ch: Channel, pairs) -> None:
    applied = [(e["group"], e["seq"]) for e in events(ch) if e["event"] == "applied"]
    assert sorted(applied) == sorted(pairs), "every update applied exactly once, by the events log"


@pytest.mark.parametrize("damage", [flip_region, truncate])
def test_a_damaged_state_is_recovered_from_the_generation_before(tmp_path, damage) -> None:
    ch = Channel(tmp_path / "xch", "run-damaged-state")
    first = [(g, s) for s in range(3) for g in range(2)]
    with sgd_applier(ch, max_batch=2) as app:
        for g, s in first:
            ch.publish_update(g, s, 0, grad(g, s))
        drain(app)  # three commits: state.hx and state.hx.1 are the last two
    assert ch.previous_state_path.is_file()
    damage(ch.state_path)  # while no applier runs
    with sgd_applier(ch, max_batch=2) as app:
        assert app.version == len(first) and sorted(app.ledger.pairs()) == sorted(first)
        assert_weights_equal(app.weights, expected_sgd(first))
        assert app.counts["applied"] == len(first)
        status = ch.read_status()
        assert "state.hx is damaged" in status["recovered"] and "recovered from state.hx.1" in status["recovered"]
        # an update the damaged generation had applied, still pending (its delete was lost): not twice
        ch.publish_update(1, 2, 4, grad(1, 2))
        more = [(0, 3), (1, 3)]
        for g, s in more:
            ch.publish_update(g, s, len(first), grad(g, s))
        drain(app)
        assert app.counts["duplicates"] == 1
        assert_weights_equal(app.weights, expected_sgd(first + more))
    applied_once(ch, first + more)
    assert len(list(ch.rejected_dir.glob("*state.hx"))) == 1  # kept for inspection


def test_no_good_generation_left_is_one_line_and_a_failed_status(tmp_path) -> None:
    ch = Channel(tmp_path / "xch", "run-damaged-state")
    with sgd_applier(ch, max_batch=1) as app:
        for s in range(2):
            ch.publish_update(0, s, 0, grad(0, s))
        drain(app)
    flip_region(ch.state_path)
    truncate(ch.previous_state_path)
    with pytest.raises(StateLost) as lost:
        sgd_applier(ch)
    line = str(lost.value)
    assert "\n" not in line and "state.hx is damaged" in line and "state.hx.1 is damaged" in line
    status = ch.read_status()
    assert status["phase"] == "failed" and status["error"] == line
    assert np.isfinite(ch.read_latest_weights()[1]["a"]).all()  # the published master stays
