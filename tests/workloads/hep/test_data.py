"""Tests of the HEP reader on small HDF5 files written here (not by the generator), both layouts."""

from __future__ import annotations

import gc
import json
import threading
import time

import h5py
import numpy as np
import pytest

from hpcdl.jobfile import load_job
from hpcdl.workloads import get_workload
from hpcdl.workloads.hep.data import (
    DataError,
    batches_per_epoch,
    iter_batches,
    open_hep,
    read_events,
    shard_range,
)
from hpcdl.workloads.hep.normalization import Normalization, channel_max, class_weight_means
from tests.conftest import tiny_overrides


def _arrays(n, h=6, w=5, seed=0):
    rng = np.random.default_rng(seed)
    hist = rng.exponential(10.0, size=(n, h, w)).astype(np.float32)
    em = (hist * rng.uniform(0, 1, size=(n, h, w))).astype(np.float32)
    trk = rng.poisson(1.5, size=(n, h, w)).astype(np.float32)
    y = (rng.uniform(size=n) < 0.4).astype(np.float32)
    wt = rng.lognormal(0, 2, size=n).astype(np.float32)
    sr = rng.uniform(size=n) < 0.2
    return hist, em, trk, y, wt, sr


def write_nersc(path, n=50, h=6, w=5, seed=0, weight=True, pass_sr=True, chunks=None):
    hist, em, trk, y, wt, sr = _arrays(n, h, w, seed)
    with h5py.File(path, "w") as f:
        g = f.create_group("all_events")
        for key, arr in (("hist", hist), ("histEM", em), ("histtrack", trk)):
            g.create_dataset(key, data=arr, chunks=chunks)
        g.create_dataset("y", data=y)
        if weight:
            g.create_dataset("weight", data=wt)
        if pass_sr:
            g.create_dataset("passSR", data=sr)
    return {"x": np.stack([hist, em, trk], axis=-1), "y": y.astype(np.int32), "w": wt, "sr": sr}


def write_benchmark(path, n=40, h=4, w=7, seed=1, onehot=False):
    hist, em, trk, y, wt, sr = _arrays(n, h, w, seed)
    data = np.stack([hist, em, trk], axis=1)  # (N, 3, H, W)
    yi = y.astype(np.int32)
    with h5py.File(path, "w") as f:
        f["data"] = data
        f["label"] = np.eye(2, dtype=np.float32)[yi] if onehot else yi
        f["normweight"] = wt / wt.max()
        f["weight"] = wt
        f["psr"] = sr.astype(np.int32)
    return {"x": np.stack([hist, em, trk], axis=-1), "y": yi, "w": wt, "sr": sr}


# --------------------------------------------------------------------------------------------------
# layout detection


def test_nersc_layout_detected(tmp_path):
    p = tmp_path / "n.h5"
    ref = write_nersc(p, n=50, h=6, w=5)
    hep = open_hep(p)
    assert hep.layout == "nersc"
    assert hep.n_events == 50 and hep.image_shape == (6, 5, 3)
    assert hep.has_weight and hep.has_pass_sr
    b = read_events(hep, 0, 50)
    assert b.x.dtype == np.float32 and b.x.shape == (50, 6, 5, 3)
    np.testing.assert_array_equal(b.x, ref["x"])
    np.testing.assert_array_equal(b.y, ref["y"])
    assert b.y.dtype == np.int32 and b.w.dtype == np.float32 and b.index.dtype == np.int64
    np.testing.assert_array_equal(b.w, ref["w"])
    np.testing.assert_array_equal(b.pass_sr, ref["sr"])


def test_nersc_optional_weight_and_selection(tmp_path):
    p = tmp_path / "n.h5"
    write_nersc(p, n=12, weight=False, pass_sr=False)
    hep = open_hep(p)
    assert not hep.has_weight and not hep.has_pass_sr
    b = read_events(hep, 2, 9)
    np.testing.assert_array_equal(b.w, np.ones(7, np.float32))
    assert b.pass_sr is None
    np.testing.assert_array_equal(class_weight_means(p), [1.0, 1.0])


@pytest.mark.parametrize("onehot", [False, True])
def test_benchmark_layout_detected(tmp_path, onehot):
    p = tmp_path / "b.h5"
    ref = write_benchmark(p, n=40, h=4, w=7, onehot=onehot)
    hep = open_hep(p)
    assert hep.layout == "benchmark"
    assert hep.n_events == 40 and hep.image_shape == (4, 7, 3)
    b = read_events(hep, 5, 30)
    np.testing.assert_array_equal(b.x, ref["x"][5:30])  # channels first on disk, NHWC out
    assert b.x.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(b.y, ref["y"][5:30])
    np.testing.assert_array_equal(b.w, ref["w"][5:30])
    np.testing.assert_array_equal(b.pass_sr, ref["sr"][5:30])


# --------------------------------------------------------------------------------------------------
# bad inputs


def _nersc_with(path, mutate):
    write_nersc(path, n=10)
    with h5py.File(path, "a") as f:
        mutate(f)


BAD_CASES = {
    "missing hist": (lambda f: f["all_events"].__delitem__("hist"), "'hist'"),
    "missing y": (lambda f: f["all_events"].__delitem__("y"), "'y'"),
    "hist wrong ndim": (
        lambda f: (f["all_events"].__delitem__("hist"), f["all_events"].create_dataset("hist", data=np.zeros((10, 6)))),
        "expected (N, H, W)",
    ),
    "histEM other size": (
        lambda f: (f["all_events"].__delitem__("histEM"), f["all_events"].create_dataset("histEM", data=np.zeros((10, 6, 4)))),
        "histEM has shape (10, 6, 4)",
    ),
    "histtrack other N": (
        lambda f: (f["all_events"].__delitem__("histtrack"), f["all_events"].create_dataset("histtrack", data=np.zeros((9, 6, 5)))),
        "histtrack has shape (9, 6, 5)",
    ),
    "y other N": (
        lambda f: (f["all_events"].__delitem__("y"), f["all_events"].create_dataset("y", data=np.zeros(11))),
        "y has shape (11,)",
    ),
    "weight 2-D": (
        lambda f: (f["all_events"].__delitem__("weight"), f["all_events"].create_dataset("weight", data=np.zeros((10, 2)))),
        "weight has shape (10, 2)",
    ),
    "passSR other N": (
        lambda f: (f["all_events"].__delitem__("passSR"), f["all_events"].create_dataset("passSR", data=np.zeros(3, bool))),
        "passSR has shape (3,)",
    ),
    "hist is a group": (
        lambda f: (f["all_events"].__delitem__("hist"), f["all_events"].create_group("hist")),
        "is a group",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_nersc_files(tmp_path, case):
    mutate, needle = BAD_CASES[case]
    p = tmp_path / "bad.h5"
    _nersc_with(p, mutate)
    with pytest.raises(DataError) as ei:
        open_hep(p)
    msg = str(ei.value)
    assert str(p) in msg and needle in msg, msg
    assert "\n" not in msg


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        open_hep(tmp_path / "nope.h5")


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(DataError, match="not a regular file"):
        open_hep(tmp_path)


def test_not_hdf5(tmp_path):
    p = tmp_path / "text.h5"
    p.write_text("hello, I am not HDF5\n")
    with pytest.raises(DataError, match="not a readable HDF5 file") as ei:
        open_hep(p)
    assert str(p) in str(ei.value)


def test_unknown_layout(tmp_path):
    p = tmp_path / "other.h5"
    with h5py.File(p, "w") as f:
        f["images"] = np.zeros((3, 2, 2))
    with pytest.raises(DataError, match="unrecognised layout.*found: images"):
        open_hep(p)


def test_zero_events(tmp_path):
    p = tmp_path / "empty.h5"
    write_nersc(p, n=0)
    with pytest.raises(DataError, match="zero events"):
        open_hep(p)
    p2 = tmp_path / "empty_b.h5"
    with h5py.File(p2, "w") as f:
        f["data"] = np.zeros((0, 3, 4, 4), np.float32)
        f["label"] = np.zeros(0, np.int32)
    with pytest.raises(DataError, match="zero events"):
        open_hep(p2)


def test_bad_benchmark_files(tmp_path):
    cases = [
        ({"data": np.zeros((5, 4, 4))}, "expected (N, 3, H, W)"),
        ({"data": np.zeros((5, 2, 4, 4))}, "expected (N, 3, H, W)"),
        ({"data": np.zeros((5, 3, 4, 4))}, "missing dataset 'label'"),
        ({"data": np.zeros((5, 3, 4, 4)), "label": np.zeros(4)}, "label has shape (4,)"),
        ({"data": np.zeros((5, 3, 4, 4)), "label": np.zeros((5, 3))}, "label has shape (5, 3)"),
        ({"data": np.zeros((5, 3, 4, 4)), "label": np.zeros(5), "weight": np.ones(6)}, "weight has shape (6,)"),
        ({"data": np.zeros((5, 3, 4, 4)), "label": np.zeros(5), "psr": np.ones(2)}, "psr has shape (2,)"),
    ]
    for i, (content, needle) in enumerate(cases):
        p = tmp_path / f"b{i}.h5"
        with h5py.File(p, "w") as f:
            for k, v in content.items():
                f[k] = v
        with pytest.raises(DataError) as ei:
            open_hep(p)
        assert needle in str(ei.value) and str(p) in str(ei.value), (needle, str(ei.value))


def test_bad_label_values_raise_when_read(tmp_path):
    p = tmp_path / "b.h5"
    with h5py.File(p, "w") as f:
        f["data"] = np.zeros((4, 3, 2, 2), np.float32)
        f["label"] = np.array([0, 1, 2, 0])
    hep = open_hep(p)
    with pytest.raises(DataError, match="labels must be 0 or 1"):
        read_events(hep, 0, 4)
    p2 = tmp_path / "oh.h5"
    with h5py.File(p2, "w") as f:
        f["data"] = np.zeros((2, 3, 2, 2), np.float32)
        f["label"] = np.array([[1, 1], [0, 1]])
    with pytest.raises(DataError, match="not one-hot"):
        read_events(open_hep(p2), 0, 2)


def test_data_error_is_value_error():
    assert issubclass(DataError, ValueError)


# --------------------------------------------------------------------------------------------------
# sharding


def test_shard_range_covers_everything_balanced():
    for n in list(range(0, 40)) + [97, 1000, 1001, 123457]:
        for size in (1, 2, 3, 4, 5, 7, 8, 16, 33, 64):
            shards = [shard_range(n, r, size) for r in range(size)]
            assert shards[0][0] == 0 and shards[-1][1] == n
            for (a0, a1), (b0, _) in zip(shards, shards[1:]):
                assert a1 == b0  # contiguous, no gap, no overlap
            lens = [b - a for a, b in shards]
            assert min(lens) >= 0 and max(lens) - min(lens) <= 1
            assert sum(lens) == n


def test_shard_range_rejects_bad_arguments():
    for args in [(10, 2, 2), (10, -1, 2), (10, 0, 0), (-1, 0, 1), (10.0, 0, 1), (10, True, 2)]:
        with pytest.raises(ValueError):
            shard_range(*args)


def test_batches_per_epoch():
    assert batches_per_epoch(1001, 167, rank=0, size=2) == 3  # 501 events
    assert batches_per_epoch(1001, 167, rank=1, size=2) == 2  # 500 events
    assert batches_per_epoch(1001, 167, rank=1, size=2, drop_remainder=False) == 3


# --------------------------------------------------------------------------------------------------
# iteration


@pytest.fixture
def nersc_file(tmp_path):
    p = tmp_path / "train.h5"
    ref = write_nersc(p, n=103, h=4, w=3, seed=3)
    return p, ref


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_evaluation_mode_yields_shard_once_in_order(nersc_file, size, prefetch):
    p, ref = nersc_file
    seen = []
    for rank in range(size):
        lo, hi = shard_range(103, rank, size)
        with iter_batches(p, 8, rank, size, shuffle=False, epochs=1, drop_remainder=False,
                          chunk_events=10, prefetch=prefetch) as it:
            batches = list(it)
        idx = np.concatenate([b.index for b in batches])
        np.testing.assert_array_equal(idx, np.arange(lo, hi))
        assert all(len(b.y) == 8 for b in batches[:-1]) and 0 < len(batches[-1].y) <= 8
        x = np.concatenate([b.x for b in batches])
        np.testing.assert_array_equal(x, ref["x"][lo:hi])
        np.testing.assert_array_equal(np.concatenate([b.y for b in batches]), ref["y"][lo:hi])
        np.testing.assert_array_equal(np.concatenate([b.pass_sr for b in batches]), ref["sr"][lo:hi])
        seen.append(idx)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(103))


def test_training_mode_reads_only_the_shard_and_matches_data(nersc_file):
    p, ref = nersc_file
    rank, size = 1, 3
    lo, hi = shard_range(103, rank, size)  # [35, 69)
    with iter_batches(p, 5, rank, size, seed=7, epochs=3, chunk_events=8) as it:
        batches = list(it)
    assert len(batches) == 3 * ((hi - lo) // 5)
    for b in batches:
        assert b.x.shape == (5, 4, 3, 3) and b.y.shape == (5,)
        assert np.all((b.index >= lo) & (b.index < hi))
        np.testing.assert_array_equal(b.x, ref["x"][b.index])  # rows stay aligned after shuffling
        np.testing.assert_array_equal(b.y, ref["y"][b.index])
        np.testing.assert_array_equal(b.w, ref["w"][b.index])
        np.testing.assert_array_equal(b.pass_sr, ref["sr"][b.index])
    per_epoch = len(batches) // 3
    for e in range(3):
        idx = np.concatenate([b.index for b in batches[e * per_epoch:(e + 1) * per_epoch]])
        assert len(np.unique(idx)) == len(idx)  # no event twice within an epoch


def test_shuffle_is_seeded_and_varies_by_epoch(nersc_file):
    p, _ = nersc_file

    def order(seed):
        with iter_batches(p, 10, seed=seed, epochs=2, chunk_events=16) as it:
            return [b.index.copy() for b in it]

    a, b, c = order(1), order(1), order(2)
    assert all(np.array_equal(u, v) for u, v in zip(a, b)) and len(a) == len(b) == 20
    assert not all(np.array_equal(u, v) for u, v in zip(a, c))
    epoch0, epoch1 = np.concatenate(a[:10]), np.concatenate(a[10:])
    assert not np.array_equal(epoch0, epoch1)
    assert not np.array_equal(epoch0, np.sort(epoch0))  # actually shuffled


def test_shuffled_without_drop_covers_every_event_each_epoch(nersc_file):
    p, _ = nersc_file
    with iter_batches(p, 16, seed=3, epochs=2, chunk_events=7, drop_remainder=False) as it:
        idx = np.concatenate([b.index for b in it])
    assert len(idx) == 206
    np.testing.assert_array_equal(np.sort(idx[:103]), np.arange(103))
    np.testing.assert_array_equal(np.sort(idx[103:]), np.arange(103))


def test_infinite_epochs_and_normalisation(nersc_file):
    p, ref = nersc_file
    norm = Normalization.from_file(p)
    it = iter_batches(p, 32, norm=norm, chunk_events=50)
    batches = [next(it) for _ in range(25)]  # 103 events / 32 → 3 per epoch, so > 8 epochs
    it.close()
    for b in batches:
        np.testing.assert_allclose(b.x, ref["x"][b.index] / np.asarray(norm.scale, np.float32), rtol=1e-6)
        assert b.x.max() <= 1.0
    with pytest.raises(StopIteration):
        next(it)  # closed


def test_iter_batches_rejects_bad_arguments(nersc_file):
    p, _ = nersc_file
    for kwargs in [dict(batch_size=0), dict(batch_size=4, chunk_events=0), dict(batch_size=4, prefetch=-1),
                   dict(batch_size=4, epochs=0), dict(batch_size=4, rank=3, size=3)]:
        with pytest.raises(ValueError):
            iter_batches(p, **kwargs)
    with pytest.raises(ValueError, match="fewer than batch_size"):
        iter_batches(p, 200)  # infinite loop that would never yield
    with pytest.raises(DataError):
        iter_batches(p.parent / "missing.h5", 4)


def test_iter_batches_benchmark_layout(tmp_path):
    p = tmp_path / "b.h5"
    ref = write_benchmark(p, n=30, onehot=True)
    with iter_batches(p, 7, shuffle=False, epochs=1, drop_remainder=False, chunk_events=4) as it:
        batches = list(it)
    np.testing.assert_array_equal(np.concatenate([b.x for b in batches]), ref["x"])
    np.testing.assert_array_equal(np.concatenate([b.y for b in batches]), ref["y"])


def test_reader_errors_surface_in_consumer(tmp_path):
    p = tmp_path / "b.h5"
    with h5py.File(p, "w") as f:
        f["data"] = np.zeros((20, 3, 2, 2), np.float32)
        f["label"] = np.array([0, 1] * 9 + [5, 0])
    with pytest.raises(DataError, match="labels must be 0 or 1"):
        list(iter_batches(p, 4, shuffle=False, epochs=1, chunk_events=6))


# --------------------------------------------------------------------------------------------------
# the prefetch thread


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("hep-prefetch-")]


def test_close_stops_thread(nersc_file):
    p, _ = nersc_file
    it = iter_batches(p, 4, chunk_events=8, prefetch=2)
    next(it)
    thread = it._thread
    assert thread.is_alive()
    it.close()
    assert not thread.is_alive()
    it.close()  # idempotent


def test_garbage_collection_stops_thread(nersc_file):
    p, _ = nersc_file
    it = iter_batches(p, 4, chunk_events=8, prefetch=1)
    next(it)
    thread = it._thread
    del it
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_the_workloads_training_batches_end_their_thread_when_closed(hep_files, tmp_path):
    # the engine closes them before its rank exits: a thread inside HDF5 then would hang it
    job = load_job("hep", tiny_overrides(hep_files, tmp_path / "runs"))
    workload = get_workload("hep")
    batches = workload.train_batches(job, workload.compute_stats(job), shard=0, shards=1, seed=0)
    next(batches)
    assert _prefetch_threads()
    batches.close()
    assert not _prefetch_threads()


def test_thread_ends_after_finite_epochs(nersc_file):
    p, _ = nersc_file
    before = len(_prefetch_threads())
    it = iter_batches(p, 4, epochs=1, chunk_events=8)
    list(it)
    assert not it._thread.is_alive()
    assert len(_prefetch_threads()) == before


# --------------------------------------------------------------------------------------------------
# memory bound: every dataset read is a slice of at most chunk_events events


class _ReadSpy:
    """Records the number of events of every h5py dataset read (through Dataset.__getitem__)."""

    def __init__(self, monkeypatch):
        self.calls = []  # (dataset name, events requested)
        self.ranges = []  # (first, stop) event of every slice read
        original = h5py.Dataset.__getitem__
        spy = self

        def getitem(ds, key, *args, **kwargs):
            spy.calls.append((ds.name, spy._events(ds, key)))
            first = key[0] if isinstance(key, tuple) and key else key
            if isinstance(first, slice):
                spy.ranges.append(first.indices(ds.shape[0])[:2])
            return original(ds, key, *args, **kwargs)

        monkeypatch.setattr(h5py.Dataset, "__getitem__", getitem)

    @staticmethod
    def _events(ds, key):
        first = key[0] if isinstance(key, tuple) and key else key
        if isinstance(first, slice):
            return len(range(*first.indices(ds.shape[0])))
        if isinstance(first, (int, np.integer)):
            return 1
        return ds.shape[0] if ds.shape else 1  # Ellipsis, (), fancy index: count it as everything

    def largest(self, suffix=""):
        return max(n for name, n in self.calls if name.endswith(suffix))


def test_reads_are_bounded_by_chunk_events(tmp_path, monkeypatch):
    p = tmp_path / "big.h5"
    ref = write_nersc(p, n=400, h=4, w=4, chunks=(16, 4, 4))  # 400 > chunk_events × prefetch
    spy = _ReadSpy(monkeypatch)
    assert channel_max(p, chunk=32).shape == (3,)
    class_weight_means(p, chunk=32)
    assert spy.largest() == 32
    spy.calls.clear()
    spy.ranges.clear()
    with iter_batches(p, 10, rank=1, size=2, epochs=2, chunk_events=24, prefetch=2) as it:
        n = sum(len(b.y) for b in it)
    assert n == 2 * 200
    assert spy.largest() == 24
    assert len(spy.ranges) == len(spy.calls)  # every read was a slice...
    assert min(lo for lo, _ in spy.ranges) == 200 and max(hi for _, hi in spy.ranges) == 400  # ...of the shard
    names = {name for name, _ in spy.calls}
    assert names == {"/all_events/" + k for k in ("hist", "histEM", "histtrack", "y", "weight", "passSR")}
    # the spy is honest: a whole-dataset read is seen as such
    with h5py.File(p, "r") as f:
        f["all_events/y"][...]
    assert spy.largest() == 400
    assert ref["x"].shape[0] == 400


def test_prefetch_queue_is_bounded(tmp_path, monkeypatch):
    p = tmp_path / "big.h5"
    write_nersc(p, n=400, h=4, w=4)
    spy = _ReadSpy(monkeypatch)
    it = iter_batches(p, 10, shuffle=False, epochs=1, chunk_events=20, prefetch=2)
    next(it)  # consumer holds the first chunk
    time.sleep(0.5)  # give the producer every chance to run ahead
    hist_reads = sum(1 for name, _ in spy.calls if name.endswith("/hist"))
    it.close()
    # 1 chunk being consumed + 2 queued + 1 read and waiting to be queued
    assert hist_reads <= 4, hist_reads


# --------------------------------------------------------------------------------------------------
# normalisation and class balance


def test_channel_max_matches_numpy(nersc_file, tmp_path):
    p, ref = nersc_file
    for chunk in (1, 7, 4096):
        np.testing.assert_array_equal(channel_max(p, chunk=chunk), ref["x"].max(axis=(0, 1, 2)))
    pb = tmp_path / "b.h5"
    refb = write_benchmark(pb)
    np.testing.assert_array_equal(channel_max(pb, chunk=9), refb["x"].max(axis=(0, 1, 2)))


def test_class_weight_means(nersc_file):
    p, ref = nersc_file
    means = class_weight_means(p, chunk=10)
    y, w = ref["y"], ref["w"].astype(np.float64)
    np.testing.assert_allclose(means, [w[y == 0].mean(), w[y == 1].mean()], rtol=1e-6)
    norm = Normalization((1, 1, 1), tuple(means))
    bal = norm.event_weights(y, ref["w"])
    assert bal.dtype == np.float32
    np.testing.assert_allclose([bal[y == 0].mean(), bal[y == 1].mean()], [1.0, 1.0], rtol=1e-5)


def test_normalization_round_trip_and_apply(nersc_file):
    p, ref = nersc_file
    norm = Normalization.from_file(p, chunk=20)
    d = json.loads(json.dumps(norm.to_dict()))
    assert Normalization.from_dict(d) == norm
    x = norm.apply(ref["x"])
    assert x.dtype == np.float32
    np.testing.assert_allclose(x.max(axis=(0, 1, 2)), [1, 1, 1], rtol=1e-6)
    z = Normalization((2.0, 0.0, 4.0))  # an all-empty channel: left unchanged, no division by zero
    imgs = np.ones((2, 3, 3, 3), np.float32)
    out = z.apply(imgs)
    np.testing.assert_array_equal(out[..., 0], 0.5)
    np.testing.assert_array_equal(out[..., 1], 1.0)
    np.testing.assert_array_equal(out[..., 2], 0.25)
    assert np.all(imgs == 1)  # not modified
    z.apply(imgs, inplace=True)
    np.testing.assert_array_equal(imgs, out)
    assert Normalization.from_dict({"scale": [1, 2, 3]}).class_weight_mean == (1.0, 1.0)


@pytest.mark.parametrize(
    "bad",
    [
        {"scale": [1, 2]},
        {"scale": [1, 2, float("nan")]},
        {"scale": "abc"},
        {"scale": [1, 2, 3], "class_weight_mean": [1, 0]},
        {"scale": [1, 2, 3], "extra": 1},
        {"class_weight_mean": [1, 1]},
        [1, 2, 3],
    ],
)
def test_normalization_from_dict_rejects(bad):
    with pytest.raises(ValueError):
        Normalization.from_dict(bad)


def test_apply_checks_channels():
    with pytest.raises(ValueError, match="3 channels"):
        Normalization((1, 1, 1)).apply(np.ones((2, 4, 4)))
