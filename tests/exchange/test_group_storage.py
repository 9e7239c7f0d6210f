"""A group root whose publish fails on a full disk or quota: nothing partial, the updates held in
memory and published in order, with contiguous sequence numbers, once there is room."""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import numpy as np
import pytest

from hpcdl.fs import files
from hpcdl.exchange import Channel
from hpcdl.exchange.group import ExchangeSync
from hpcdl.fs.storage import REPORT_FILE, StorageReport, read_report
from tests.helpers.full_disk import fill, problems, temporaries


W = {"w": np.ones(64 << 10, np.float32)}  # 256 KiB


# ----------------------------------------------------------------------------------------------
# exchange publish
# ----------------------------------------------------------------------------------------------


def check_publish_failure_keeps_everything(ch: Channel, sync: ExchangeSync, report_path: Path,
                                           make_room, break_disk) -> None:
    for step in (1, 2):
        sync.after_step(step, lambda: W)
    assert sync.seq == 2 and ch.backlog(0) == 2
    break_disk()
    for step in (3, 4, 5):
        assert sync.after_step(step, lambda s=step: {"w": np.full(64 << 10, s, np.float32)}) is None
    # nothing partial, the published updates intact, the new ones held in memory
    assert temporaries(ch.root) == []
    assert sorted(r.seq for r in ch.pending_updates()) == [0, 1]
    for ref in ch.pending_updates():
        ch.read_update(ref)
    assert len(sync.unpublished) == 3 and sync.publish_failures == 3
    stats = sync.stats()
    assert stats["exchange_unpublished"] == 3 and stats["exchange_publish_failures"] == 3
    p = problems(report_path)["exchange publish"]
    assert p["count"] == 3 and "3 updates held" in p["detail"]
    make_room()
    sync.after_step(6, lambda: {"w": np.full(64 << 10, 6, np.float32)})
    # published in order with contiguous sequence numbers: the ledger will see no gap
    refs = sorted(ch.pending_updates(), key=lambda r: r.seq)
    assert [r.seq for r in refs] == [0, 1, 2, 3, 4, 5]
    assert [float(ch.read_update(r).tensors["w"][0]) for r in refs[2:]] == [3.0, 4.0, 5.0, 6.0]
    assert not sync.unpublished and problems(report_path) == {}
    assert read_report(report_path)["recovered"]["exchange publish"]["count"] == 3


def test_publish_on_a_full_tmpfs(tiny_fs, tmp_path):
    fs = tiny_fs("xch", 2048)
    ch = Channel(fs / "x", "run", max_pending_per_group=100, fsync=False)
    report_path = tmp_path / REPORT_FILE
    sync = ExchangeSync(ch, 0, every=1, initial_wait_s=0, report=StorageReport(report_path))
    state = {}
    check_publish_failure_keeps_everything(
        ch, sync, report_path, make_room=lambda: state["filler"].unlink(),
        break_disk=lambda: state.update(filler=fill(fs, leave=100 << 10)))


def test_publish_with_an_injected_edquot_at_close(tmp_path, monkeypatch):
    """The late failure: the data were buffered, and the quota was exceeded when the file was
    closed (where NFS and Lustre report write-back errors; update files are not fsynced)."""
    ch = Channel(tmp_path / "x", "run", max_pending_per_group=100)
    report_path = tmp_path / REPORT_FILE
    sync = ExchangeSync(ch, 0, every=1, initial_wait_s=0, report=StorageReport(report_path))

    class FullAtClose:
        def __init__(self, f):
            self._f = f

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    def broken(path, *args, **kwargs):
        f = builtins.open(path, *args, **kwargs)
        return FullAtClose(f) if "/updates/" in str(path) else f

    # files.py opens the temporary by name; a module attribute shadows the builtin there only
    check_publish_failure_keeps_everything(
        ch, sync, report_path, make_room=lambda: monkeypatch.delattr(files, "open", raising=False),
        break_disk=lambda: monkeypatch.setattr(files, "open", broken, raising=False))


def test_held_updates_wait_for_space_at_their_bound(tmp_path, monkeypatch):
    ch = Channel(tmp_path / "x", "run", max_pending_per_group=2)
    sync = ExchangeSync(ch, 0, every=1, initial_wait_s=0)
    real, calls = ch.publish_update, {"n": 0}

    def full_for_five_tries(*a, **k):
        calls["n"] += 1
        if calls["n"] <= 5:
            raise OSError(errno.ENOSPC, "full")
        return real(*a, **k)

    monkeypatch.setattr(ch, "publish_update", full_for_five_tries)
    sync.after_step(1, lambda: W)
    assert len(sync.unpublished) == 1 and calls["n"] == 1  # below the bound: training goes on
    sync.after_step(2, lambda: W)  # at the bound: waits until the disk takes them
    assert calls["n"] == 7 and not sync.unpublished and sync.unpublished_dropped == 0
    assert sync.published == 2 and [r.seq for r in ch.pending_updates()] == [0, 1]


def test_held_updates_past_the_bound_are_dropped_when_asked(tmp_path, monkeypatch):
    ch = Channel(tmp_path / "x", "run", max_pending_per_group=2)
    sync = ExchangeSync(ch, 0, every=1, initial_wait_s=0, drop_held=True)

    def broken(*a, **k):
        raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(ch, "publish_update", broken)
    for step in range(1, 11):
        sync.after_step(step, lambda: W)
    assert len(sync.unpublished) == 2 and sync.unpublished_dropped == 8
    monkeypatch.setattr(ch, "publish_update", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "io")))
    with pytest.raises(OSError):  # anything but a full disk is not hidden
        sync.after_step(11, lambda: W)
