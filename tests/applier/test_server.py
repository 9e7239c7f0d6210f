"""Tests of the applier (parameter server): exactly-once across kill -9, staleness, rejection."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hpcdl import exchange as ex
from hpcdl.applier import AlreadyRunning, Applier, Ledger
from hpcdl.exchange import Channel, Signer
from tests.conftest import REPO
from tests.helpers import APPLIER_PROCESS, applier_for

RUN = "run-applier-test"
W0 = {"a": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.float64(10.0),
      "c": np.zeros(0)}


def env_with_root(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def grad(group: int, seq: int) -> dict[str, np.ndarray]:
    """Integer-valued float64 gradients: SGD with lr=1 sums them exactly."""
    k = float(group * 1000 + seq + 1)
    return {"a": np.full((2, 3), k), "b": np.float64(-k), "c": np.zeros(0)}


def expected_sgd(pairs, lr: float = 1.0) -> dict[str, np.ndarray]:
    w = {k: np.array(v, dtype=np.float64) for k, v in W0.items()}
    for g, s in pairs:
        for k, v in grad(g, s).items():
            w[k] = w[k] - lr * v
    return w


def assert_weights_equal(got, want) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def events(ch: Channel) -> list[dict]:
    out = []
    for line in ch.events_path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line torn by a crash
    return out


def drain(app: Applier) -> None:
    while app.step():
        pass


@pytest.fixture
def ch(tmp_path: Path) -> Channel:
    return Channel(tmp_path / "xch", RUN)


def sgd_applier(ch: Channel, **kw) -> Applier:
    kw.setdefault("initial", W0)
    return applier_for(ch, "sgd", 1.0, **kw)


# ----------------------------------------------------------------------------------------------
# optimizers
# ----------------------------------------------------------------------------------------------


def test_sgd_exact_and_versions(ch: Channel) -> None:
    with sgd_applier(ch, max_batch=2) as app:
        assert app.version == 0 and ch.latest_weights_version() == 0
        pairs = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1)]
        for g, s in pairs:
            ch.publish_update(g, s, 0, grad(g, s))
        assert app.step() == 2 and app.version == 2
        drain(app)
        assert app.version == 5 and app.counts["applied"] == 5
        assert_weights_equal(app.weights, expected_sgd(pairs))
        assert ch.latest_weights_version() == 5
        assert_weights_equal(ch.read_latest_weights()[1], expected_sgd(pairs))
        assert ch.backlog() == 0
        assert sorted(app.ledger.pairs()) == sorted(pairs)
        applied = [e for e in events(ch) if e["event"] == "applied"]
        assert [(e["group"], e["seq"]) for e in applied] == pairs  # arrival order
        assert [e["staleness"] for e in applied] == [0, 1, 2, 3, 4]


def reference(optimizer: str, grads, lr, mu=0.9, b1=0.9, b2=0.999, eps=1e-8):
    w = {k: np.array(v, dtype=np.float64) for k, v in W0.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v2 = {k: np.zeros_like(v) for k, v in w.items()}
    for t, g in enumerate(grads, start=1):
        for k in w:
            if optimizer == "momentum":
                m[k] = mu * m[k] + g[k]
                w[k] = w[k] - lr * m[k]
            else:
                m[k] = b1 * m[k] + (1 - b1) * g[k]
                v2[k] = b2 * v2[k] + (1 - b2) * g[k] ** 2
                mh, vh = m[k] / (1 - b1 ** t), v2[k] / (1 - b2 ** t)
                w[k] = w[k] - lr * mh / (np.sqrt(vh) + eps)
    return w


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_momentum_and_adam_match_reference_across_restart(ch: Channel, optimizer: str) -> None:
    rng = np.random.default_rng(1)
    grads = [{"a": rng.standard_normal((2, 3)), "b": np.float64(rng.standard_normal()),
              "c": np.zeros(0)} for _ in range(6)]
    app = applier_for(ch, optimizer, 0.01, initial=W0)
    for s, g in enumerate(grads[:3]):
        ch.publish_update(0, s, 0, g)
    drain(app)
    app.close()
    app = applier_for(ch, optimizer, 0.01)  # slots and step survive the restart
    for s, g in enumerate(grads[3:], start=3):
        ch.publish_update(0, s, 0, g)
    drain(app)
    want = reference(optimizer, grads, 0.01)
    for k in want:
        np.testing.assert_allclose(app.weights[k], want[k], rtol=1e-12, atol=1e-12)
    app.close()
    with pytest.raises(ValueError, match="optimizer"):
        applier_for(ch, "sgd", 0.01)


def test_ledger_intervals() -> None:
    led = Ledger()
    for s in [5, 3, 4, 9, 7, 8, 0, 4]:
        led.add(1, s)
    led.add(2, 0)
    assert led.to_array().tolist() == [[1, 0, 0], [1, 3, 5], [1, 7, 9], [2, 0, 0]]
    assert (1, 6) not in led and (1, 8) in led and (3, 0) not in led
    assert len(led) == 8 and led.last_seq() == {1: 9, 2: 0}
    led.add(1, 6)
    assert Ledger.from_array(led.to_array()).to_array().tolist() == [[1, 0, 0], [1, 3, 9],
                                                                     [2, 0, 0]]


# ----------------------------------------------------------------------------------------------
# staleness
# ----------------------------------------------------------------------------------------------


def stale_run(ch: Channel, policy: str) -> Applier:
    app = sgd_applier(ch, max_staleness=1, stale_policy=policy)
    g = {"a": np.full((2, 3), 12.0), "b": np.float64(12.0), "c": np.zeros(0)}
    for group in range(4):  # all computed from version 0
        ch.publish_update(group, 0, 0, g)
        app.step()
    return app


def test_staleness_drop(ch: Channel) -> None:
    app = stale_run(ch, "drop")
    # staleness 0 and 1 applied; the next two see version 2 -> staleness 2 > 1 -> dropped
    assert app.version == 2
    assert app.counts["applied"] == 2 and app.counts["dropped_stale"] == 2
    assert app.weights["b"] == 10.0 - 24.0
    assert ch.backlog() == 0 and len(app.ledger) == 4
    dropped = [e for e in events(ch) if e["event"] == "dropped"]
    assert [e["staleness"] for e in dropped] == [2, 2]
    status = ch.read_status()
    assert status["staleness"] == {"count": 4, "max": 2, "mean": 1.25}
    assert status["counts"]["dropped_stale"] == 2
    app.close()


def test_staleness_downweight(ch: Channel) -> None:
    app = stale_run(ch, "downweight")
    # lr / (1 + staleness) beyond max_staleness: 12 + 12 + 12/3 + 12/4
    assert app.version == 4 and app.counts["downweighted"] == 2
    assert app.weights["b"] == 10.0 - (12 + 12 + 4 + 3)
    scales = [e["scale"] for e in events(ch) if e["event"] == "applied"]
    assert scales == [1.0, 1.0, 1 / 3, 1 / 4]
    app.close()


def test_keep_last_k_weight_versions(ch: Channel) -> None:
    with sgd_applier(ch, keep_versions=2, max_batch=1) as app:
        for s in range(5):
            ch.publish_update(0, s, app.version, grad(0, s))
            app.step()
        assert ch.weight_versions() == [4, 5]


# ----------------------------------------------------------------------------------------------
# bad input never stops the applier
# ----------------------------------------------------------------------------------------------


def test_corrupt_and_invalid_updates_are_rejected_and_counted(ch: Channel, tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    app = sgd_applier(ch)
    good = [(0, 0), (0, 3), (0, 6)]
    ch.publish_update(0, 0, 0, grad(0, 0))
    flipped = ch.publish_update(0, 1, 0, grad(0, 1))
    raw = bytearray(flipped.read_bytes())
    raw[-3] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    (ch.updates_dir / ex.update_name(0, 2)).write_bytes(pickle.dumps(Evil()))
    ch.publish_update(0, 3, 0, grad(0, 3))
    ch.publish_update(0, 4, 0, {**grad(0, 4), "a": np.ones((3, 2))})  # wrong shape
    ch.publish_update(0, 5, 0, {**grad(0, 5), "b": np.float64(np.nan)})  # non-finite
    ch.publish_update(0, 6, 0, grad(0, 6))
    Channel(ch.root, "other-run").publish_update(0, 7, 0, grad(0, 7))
    ch.publish_update(0, 8, 0, {"a": np.ones((2, 3))})  # missing tensors
    drain(app)
    assert not marker.exists()
    c = app.counts
    assert (c["applied"], c["rejected_corrupt"], c["rejected_invalid"]) == (3, 3, 3)
    assert_weights_equal(app.weights, expected_sgd(good))
    assert ch.backlog() == 0
    assert len(list(ch.rejected_dir.iterdir())) == 6
    reasons = [e["reason"] for e in events(ch) if e["event"] == "rejected"]
    assert len(reasons) == 6 and all("\n" not in r for r in reasons)
    assert any("checksum" in r for r in reasons) and any("run id" in r for r in reasons)
    assert ch.read_status()["counts"]["rejected_corrupt"] == 3
    app.close()


def test_duplicate_pair_is_not_applied_twice(ch: Channel) -> None:
    with sgd_applier(ch) as app:
        ch.publish_update(1, 0, 0, grad(1, 0))
        drain(app)
        ch.publish_update(1, 0, 0, grad(1, 0))  # republished (e.g. a retried publish)
        drain(app)
        assert app.counts["applied"] == 1 and app.counts["duplicates"] == 1
        assert_weights_equal(app.weights, expected_sgd([(1, 0)]))
        assert ch.next_seq(1) == 1


# ----------------------------------------------------------------------------------------------
# initial weights, lock, status
# ----------------------------------------------------------------------------------------------


def test_first_proposal_becomes_version_0(ch: Channel) -> None:
    app = applier_for(ch, "sgd", 1.0)
    assert app.version is None and app.step() == 0
    assert ch.read_status()["phase"] == "waiting_for_initial_weights"
    (ch.init_dir / ex.init_name(9)).write_bytes(b"garbage")
    p1 = ch.propose_initial(1, {"w": np.ones(3)})
    p2 = ch.propose_initial(2, {"w": np.full(3, 2.0)})
    base = time.time_ns()
    os.utime(p2, ns=(base, base))
    os.utime(p1, ns=(base + 1000, base + 1000))
    assert app.step() == 1 and app.version == 0
    assert app.counts["rejected_proposals"] == 1
    assert ch.read_latest_weights()[1]["w"].tolist() == [2.0] * 3
    assert ch.pending_proposals() == []
    assert ch.propose_initial(3, {"w": np.ones(3)}) is None
    assert ch.initial_weights(1, {"w": np.ones(3)})[1]["w"].tolist() == [2.0] * 3
    ids = [e["event_id"] for e in events(ch)]
    assert ids == sorted(set(ids))
    app.close()


def test_state_lost_adopts_newest_weights(ch: Channel) -> None:
    ch.publish_weights(7, W0)
    with applier_for(ch, "sgd", 1.0) as app:
        assert app.version == 7
        ch.publish_update(0, 0, 7, grad(0, 0))
        drain(app)
        assert app.version == 8 and ch.latest_weights_version() == 8


def test_single_applier_per_directory(ch: Channel) -> None:
    app = sgd_applier(ch)
    with pytest.raises(AlreadyRunning):
        applier_for(ch, "sgd", 1.0)
    proc = subprocess.run([sys.executable, APPLIER_PROCESS, "--exchange", str(ch.root),
                           "--run-id", RUN, "--optimizer", "sgd"], env=env_with_root(),
                          capture_output=True, timeout=60)
    assert proc.returncode == 3
    app.close()
    applier_for(ch, "sgd", 1.0).close()


def test_an_applier_process_stops_on_sigterm_and_its_status_parses(ch: Channel) -> None:
    sgd_applier(ch).close()
    proc = subprocess.Popen([sys.executable, APPLIER_PROCESS, "--exchange", str(ch.root),
                             "--run-id", RUN, "--optimizer", "sgd", "--lr", "1",
                             "--status-interval", "0.1"], env=env_with_root())
    try:
        ch.publish_update(0, 0, 0, grad(0, 0))
        deadline = time.monotonic() + 30
        while (ch.read_status() or {}).get("counts", {}).get("applied") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    status = json.loads(ch.status_path.read_text())
    assert status["phase"] == "stopped" and status["master_version"] == 1
    assert status["last_seq"] == {"0": 0} and status["backlog"] == 0
    assert {"counts", "staleness", "last_apply_time", "updated", "run_id"} <= set(status)
    assert [e["event"] for e in events(ch)] == ["init", "applied"]


def test_run_loop_idle_exit_and_stop_callable(ch: Channel) -> None:
    with sgd_applier(ch) as app:
        ch.publish_update(0, 0, 0, grad(0, 0))
        t0 = time.monotonic()
        assert app.run(poll_interval=0.01, idle_exit_after=0.2) == 1
        assert time.monotonic() - t0 < 5
        assert app.run(poll_interval=0.01, stop=lambda: True) == 0


# ----------------------------------------------------------------------------------------------
# exactly-once with concurrent publishers, and across kill -9
# ----------------------------------------------------------------------------------------------


def test_exactly_once_with_publisher_threads_and_processes(ch: Channel) -> None:
    app = sgd_applier(ch, max_batch=4)
    stop = threading.Event()
    runner = threading.Thread(target=app.run, kwargs=dict(poll_interval=0.005,
                                                          stop=stop.is_set))
    runner.start()

    def publish(group: int) -> None:
        mine = Channel(ch.root, RUN)
        for s in range(25):
            mine.publish_update(group, s, app.version or 0, grad(group, s))

    threads = [threading.Thread(target=publish, args=(g,)) for g in range(4)]
    script = textwrap.dedent(f"""
        import sys
        from tests.applier.test_server import grad
        from hpcdl.exchange import Channel
        g = int(sys.argv[1]); ch = Channel({str(ch.root)!r}, {RUN!r})
        for s in range(25):
            ch.publish_update(g, s, 0, grad(g, s))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(g)], env=env_with_root())
             for g in (4, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    deadline = time.monotonic() + 60
    while ch.backlog() and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    runner.join()
    pairs = [(g, s) for g in range(6) for s in range(25)]
    assert sorted(app.ledger.pairs()) == pairs
    assert app.counts["applied"] == 150 and app.version == 150
    assert_weights_equal(app.weights, expected_sgd(pairs))
    applied = [(e["group"], e["seq"]) for e in events(ch) if e["event"] == "applied"]
    assert sorted(applied) == pairs
    for g in range(6):  # each group's updates in seq order
        assert [s for gg, s in applied if gg == g] == list(range(25))
    app.close()


def start_applier(root: Path, *extra: str, crash: str | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, APPLIER_PROCESS, "--exchange", str(root), "--run-id", RUN,
         "--optimizer", "sgd", "--lr", "1", "--keep-versions", "2", "--poll-interval", "0.01",
         "--log-level", "WARNING", *(["--crash", crash] if crash else []), *extra],
        env=env_with_root())


def check_exactly_once(ch: Channel, pairs) -> None:
    """Final state: every pair applied once, master exact, events logged once each."""
    with applier_for(ch, "sgd", 1.0) as app:
        assert ch.backlog() == 0
        assert sorted(app.ledger.pairs()) == sorted(pairs)
        assert app.counts["applied"] == len(pairs) and app.version == len(pairs)
        assert app.counts["duplicates"] == 0
        assert_weights_equal(app.weights, expected_sgd(pairs))
    assert ch.latest_weights_version() == len(pairs)
    assert len(ch.weight_versions()) <= 3
    assert_weights_equal(ch.read_latest_weights()[1], expected_sgd(pairs))
    evs = events(ch)
    ids = [e["event_id"] for e in evs]
    assert ids == list(range(1, len(ids) + 1)), "each event logged exactly once, in order"
    applied = sorted((e["group"], e["seq"]) for e in evs if e["event"] == "applied")
    assert applied == sorted(pairs)
    assert [e["version"] for e in evs if e["event"] == "applied"] == list(
        range(1, len(pairs) + 1))
    leftovers = [p for d in (ch.updates_dir, ch.weights_dir, ch.applier_dir)
                 for p in d.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []
    status = ch.read_status()
    assert status["counts"]["applied"] == len(pairs) and status["backlog"] == 0


CRASH_POINTS = ["before_state", "after_state", "after_weights", "after_events", "after_status",
                "mid_delete"]


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_at_each_point_then_restart(ch: Channel, point: str) -> None:
    sgd_applier(ch).close()
    pairs = [(g, s) for s in range(4) for g in range(3)]
    for g, s in pairs:
        ch.publish_update(g, s, 0, grad(g, s))
    for hit in (1, 3):  # die at the 1st, then the 3rd time the point is reached
        proc = start_applier(ch.root, "--max-batch", "3", crash=f"{point}:{hit}")
        assert proc.wait(timeout=60) == -signal.SIGKILL
    proc = start_applier(ch.root, "--max-batch", "3", "--idle-exit-after", "0.3")
    assert proc.wait(timeout=60) == 0
    check_exactly_once(ch, pairs)


def test_kill9_at_random_points_while_publishing(ch: Channel) -> None:
    sgd_applier(ch).close()
    rng = random.Random(1234)
    pairs = [(g, s) for s in range(60) for g in range(3)]
    first, rest = pairs[:90], pairs[90:]
    for g, s in first:
        ch.publish_update(g, s, 0, grad(g, s))

    def publisher() -> None:
        mine = Channel(ch.root, RUN)
        for g, s in rest:
            mine.publish_update(g, s, mine.latest_weights_version() or 0, grad(g, s))
            time.sleep(0.003)

    pub = threading.Thread(target=publisher)
    pub.start()
    kills = 0
    def logged() -> int:
        return ch.events_path.stat().st_size if ch.events_path.exists() else 0

    for _ in range(8):
        before = logged()
        proc = start_applier(ch.root, "--max-batch", str(rng.choice([1, 2, 5])))
        # killed at a random point once it works (start-up takes ~0.2 s, far longer when loaded)
        deadline = time.monotonic() + 60
        while logged() == before and ch.backlog() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=30)
        kills += rc == -signal.SIGKILL
    pub.join()
    assert kills >= 6
    assert ch.backlog() < len(pairs), "the killed appliers made progress"
    proc = start_applier(ch.root, "--idle-exit-after", "0.3")
    assert proc.wait(timeout=120) == 0
    check_exactly_once(ch, pairs)


def test_torn_event_line_is_terminated(ch: Channel) -> None:
    with sgd_applier(ch) as app:
        with open(ch.events_path, "ab") as f:
            f.write(b'{"event_id": 99, "tor')
        ch.publish_update(0, 0, 0, grad(0, 0))
        drain(app)
    lines = ch.events_path.read_text().splitlines()
    assert lines[-2].endswith('"tor')
    assert json.loads(lines[-1])["event"] == "applied"


def test_hmac_channel_end_to_end(tmp_path: Path) -> None:
    key = Signer(b"s" * 32)
    ch = Channel(tmp_path / "x", RUN, signer=key)
    with applier_for(ch, "sgd", 1.0, initial=W0) as app:
        ch.publish_update(0, 0, 0, grad(0, 0))
        Channel(tmp_path / "x", RUN).publish_update(0, 1, 0, grad(0, 1))  # unkeyed: refused
        drain(app)
        assert app.counts["applied"] == 1 and app.counts["rejected_corrupt"] == 1
    with pytest.raises(ex.CorruptFile):  # the state itself is keyed too
        applier_for(Channel(tmp_path / "x", RUN), "sgd", 1.0)


def test_unreadable_entry_is_rejected_not_retried_forever(ch: Channel) -> None:
    with sgd_applier(ch) as app:
        (ch.updates_dir / ex.update_name(0, 0)).mkdir()
        ch.publish_update(0, 1, 0, grad(0, 1))
        drain(app)
        assert app.counts["rejected_corrupt"] == 1 and app.counts["applied"] == 1
        assert ch.backlog() == 0


def test_event_log_rotation_keeps_ids_unique_across_restart(ch: Channel) -> None:
    app = sgd_applier(ch, events_max_bytes=600, max_batch=1)
    for s in range(12):
        ch.publish_update(0, s, 0, grad(0, s))
        app.step()
    app.close()
    rotated = ch.events_path.with_name("events.jsonl.1")
    assert rotated.exists() and rotated.stat().st_size < 2000
    with sgd_applier(ch, events_max_bytes=600) as app:  # restart: nothing re-logged
        ch.publish_update(0, 12, 0, grad(0, 12))
        drain(app)
        assert app.state.event_id == 14  # init + 13 applied
    ids = []
    for path in (rotated, ch.events_path):
        if path.exists():
            ids += [json.loads(line)["event_id"] for line in path.read_text().splitlines()]
    assert ids == sorted(set(ids)) and ids[-1] == 14


def test_an_applier_refuses_a_state_of_another_run(ch: Channel) -> None:
    sgd_applier(ch).close()
    proc = subprocess.run([sys.executable, APPLIER_PROCESS, "--exchange", str(ch.root),
                           "--run-id", "not-" + RUN, "--optimizer", "sgd"],
                          env=env_with_root(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "run id" in proc.stderr
