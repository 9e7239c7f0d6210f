"""The applier on a full disk or quota: nothing durable changes while a commit fails, and every
update is applied exactly once after room is made."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from hpcdl.applier import Applier
from hpcdl.exchange import Channel
from hpcdl.fs.storage import REPORT_FILE, read_report
from tests.helpers import applier_for
from tests.helpers.full_disk import fill, problems, temporaries


# ----------------------------------------------------------------------------------------------
# the applier
# ----------------------------------------------------------------------------------------------


def grad(seq):
    return {"w": np.full(8, float(seq + 1))}


def run_applier_through_full_disk(ch: Channel, break_disk, make_room, frozen: bool = True) -> Applier:
    app = applier_for(ch, "sgd", 1.0, initial={"w": np.zeros(8)}, max_batch=4)
    for s in range(4):
        ch.publish_update(0, s, 0, grad(s))
    assert app.step() == 4  # one good commit: version 4
    for s in range(4, 12):
        ch.publish_update(0, s, 0, grad(s))
    break_disk()
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        if calls["n"] == 6:
            doc = read_report(ch.applier_dir / REPORT_FILE)
            assert "applier commit" in doc["problems"] or "applier commit" in doc["recovered"]
            if frozen:  # nothing durable changed while the disk was full
                assert app.ch.read_latest_weights()[0] == 4
            assert temporaries(ch.root) == []
            make_room()
        return calls["n"] > 6 and ch.backlog() == 0

    app.run(poll_interval=0.01, stop=stop)
    return app


def check_applier_after(ch: Channel, app: Applier) -> None:
    assert app.version == 12 and app.counts["applied"] == 12
    np.testing.assert_array_equal(app.weights["w"], -np.full(8, sum(range(1, 13)), float))
    evs = [json.loads(l) for l in ch.events_path.read_text().splitlines()]
    applied = [(e["group"], e["seq"]) for e in evs if e["event"] == "applied"]
    assert sorted(applied) == [(0, s) for s in range(12)]  # each once: none lost, none twice
    ids = [e["event_id"] for e in evs]
    assert ids == sorted(set(ids))
    assert problems(ch.applier_dir / REPORT_FILE) == {}
    app.close()


def test_applier_on_a_full_tmpfs(tiny_fs):
    fs = tiny_fs("app", 1024)
    ch = Channel(fs / "x", "run", fsync=False)
    state = {}
    app = run_applier_through_full_disk(ch, break_disk=lambda: state.update(f=fill(fs)),
                                        make_room=lambda: state["f"].unlink())
    check_applier_after(ch, app)


def test_applier_with_injected_enospc_in_events_and_state(tmp_path, monkeypatch):
    ch = Channel(tmp_path / "x", "run", fsync=False)
    import hpcdl.exchange.channel as ex  # the module that writes the durable state
    import hpcdl.fs.files as ap  # the module that appends the events

    real_write = ap.os.write
    real_write_file = ex.write_file

    def half_write(fd, data):  # events.jsonl: part of the batch's lines, then full
        real_write(fd, bytes(data)[: max(1, len(data) // 2)])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def no_state(*a, kind, **k):
        if kind == "state":
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
        return real_write_file(*a, kind=kind, **k)

    flip = {"n": 0}

    def broken_write(fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").endswith("events.jsonl"):
            return real_write(fd, data)
        flip["n"] += 1
        return half_write(fd, data) if flip["n"] % 2 else real_write(fd, data)

    def breaking():
        monkeypatch.setattr(ap.os, "write", broken_write)

    def healing():
        monkeypatch.setattr(ap.os, "write", real_write)
        monkeypatch.setattr(ex, "write_file", real_write_file)

    app = run_applier_through_full_disk(ch, break_disk=breaking, make_room=healing, frozen=False)
    check_applier_after(ch, app)
    # and a state write that fails: the old state stays, nothing is applied twice
    monkeypatch.setattr(ex, "write_file", no_state)
    app = applier_for(ch, "sgd", 1.0)
    ch.publish_update(0, 12, 0, grad(12))
    with pytest.raises(OSError):
        app.step()
    monkeypatch.setattr(ex, "write_file", real_write_file)
    app.close()
    app = applier_for(ch, "sgd", 1.0)
    assert app.version == 12
    while app.step():
        pass
    assert app.version == 13 and app.counts["applied"] == 13
    app.close()
