"""The helpers both workloads share (hpcdl.workloads.common)."""

from __future__ import annotations

import errno
import os
import queue
import signal
import threading

import h5py
import numpy as np
import pytest

from hpcdl.workloads import common
from hpcdl.workloads.climate.data import DataError as ClimateDataError
from hpcdl.workloads.hep.data import DataError as HepDataError


def test_each_workload_keeps_its_own_data_error():
    for cls in (HepDataError, ClimateDataError):
        assert issubclass(cls, common.DataFileError) and issubclass(cls, ValueError)
        err = cls.at("/x/f.h5", "holds zero events")
        assert type(err) is cls and str(err) == "/x/f.h5: holds zero events"
    assert not issubclass(HepDataError, ClimateDataError)


def test_h5_checks(tmp_path):
    with pytest.raises(HepDataError, match="no such file"):
        common.open_h5(HepDataError, tmp_path / "none.h5")
    (tmp_path / "text.h5").write_text("not hdf5\n")
    with pytest.raises(HepDataError, match="not a readable HDF5 file") as info:
        common.open_h5(HepDataError, tmp_path / "text.h5")
    assert "\n" not in str(info.value)
    path = tmp_path / "f.h5"
    with h5py.File(path, "w") as f:
        f["g/x"] = np.zeros(3)
        f["s"] = np.array([b"a"])
    with common.open_h5(HepDataError, path) as f:
        assert common.h5_dataset(HepDataError, path, f["g"], "x", "g/").shape == (3,)
        with pytest.raises(HepDataError, match=r"missing dataset g/'y' \(found: x\); hint$"):
            common.h5_dataset(HepDataError, path, f["g"], "y", "g/", missing_hint="; hint")
        with pytest.raises(HepDataError, match="'g' is a group"):
            common.h5_dataset(HepDataError, path, f, "g")
        with pytest.raises(HepDataError, match="'s' has non-numeric dtype"):
            common.h5_dataset(HepDataError, path, f, "s")


@pytest.mark.parametrize("fractions, message", [
    ((0.5, 0.5), "three non-negative numbers"),
    ("abc", "three numbers"),
    ((0.8, 0.3, -0.1), "three non-negative numbers"),
    ((0.96, 0.02, 0.02), r"of 10 images leave a split empty \(train/val/test = \(10, 0, 0\)\)"),
])
def test_check_splits_rejects(fractions, message):
    with pytest.raises(ValueError, match=message):
        common.check_splits(10, fractions, "images")


def test_check_splits_and_seed():
    assert common.check_splits(10, (0.8, 0.1, 0.1), "events") == ((0.8, 0.1, 0.1), (8, 1, 1))
    assert common.split_sizes(7, (0.5, 0.25, 0.25)) == (4, 2, 1)
    assert common.is_int(np.int32(3)) and not common.is_int(True) and not common.is_int(3.0)
    common.check_seed(0)
    for bad in (-1, 1.0, False):
        with pytest.raises(ValueError, match="seed must be a non-negative integer"):
            common.check_seed(bad)


def test_write_splits_replaces_the_set_whole(tmp_path):
    def write(tmp, name, i, n, report):
        tmp.write_text(f"{name} {i} {n}")
        report(n)

    seen = []
    paths = common.write_splits(tmp_path / "out", (3, 2, 1), write, progress=seen.append)
    assert {k: p.read_text() for k, p in paths.items()} == {
        "train": "train 0 3", "val": "val 1 2", "test": "test 2 1"}
    assert seen == [3, 2, 1]  # the writer's progress, from its process to this one

    def fail_on_val(tmp, name, i, n, report):
        tmp.write_text("new")
        if name == "val":
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        common.write_splits(tmp_path / "out", (3, 2, 1), fail_on_val)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["test.h5", "train.h5", "val.h5"]
    # the old set, whole: not a new train.h5 beside the old val.h5 and test.h5
    assert {k: p.read_text() for k, p in paths.items()} == {
        "train": "train 0 3", "val": "val 1 2", "test": "test 2 1"}


def test_write_splits_survives_a_writer_that_crashes(tmp_path):
    # what HDF5 does after a write failed on a full disk: SIGSEGV in the writing process
    def crash_on_test(tmp, name, i, n, report):
        tmp.write_text("new")
        if name == "test":
            os.kill(os.getpid(), signal.SIGSEGV)

    with pytest.raises(RuntimeError, match="the data writer died"):
        common.write_splits(tmp_path / "out", (3, 2, 1), crash_on_test)
    assert not (tmp_path / "out").exists()  # no temporary left, nor the directory it made


def test_write_splits_reports_a_failed_write_in_one_line(tmp_path):
    def full(tmp, name, i, n, report):
        raise OSError(errno.ENOSPC, "Write through metadata accumulator failed (file write failed:\n...")

    with pytest.raises(OSError) as info:
        common.write_splits(tmp_path / "out", (3, 2, 1), full)
    assert info.value.errno == errno.ENOSPC and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_table_files(tmp_path):
    assert common.table_format(tmp_path / "a.CSV", "scores") == "csv"
    with pytest.raises(ValueError, match=r"detections file must end in .npz or .csv, got 'a.txt'"):
        common.table_format(tmp_path / "a.txt", "detections")
    (tmp_path / "a.csv").write_text("a,b\n1,2\n\n3,4\n")
    assert common.csv_lines(tmp_path / "a.csv", "a,b") == ["1,2\n", "3,4\n"]
    with pytest.raises(ValueError, match="expected the header 'x,y', got 'a,b'"):
        common.csv_lines(tmp_path / "a.csv", "x,y")


def test_feed_queue_hands_over_items_end_and_errors():
    q: queue.Queue = queue.Queue(maxsize=4)
    common.feed_queue((i for i in (1, 2)), q, threading.Event())
    assert [q.get_nowait() for _ in range(3)] == [1, 2, common.END]

    def broken():
        yield 1
        raise OSError("disk")

    common.feed_queue(broken(), q, threading.Event())
    assert q.get_nowait() == 1 and isinstance(q.get_nowait(), OSError)
    halt = threading.Event()
    halt.set()
    assert not common.put_unless_halted(q, 1, halt)
    q.put(1)
    common.drain_queue(q)
    assert q.empty()
