"""The climate reader, normalisation, preprocessing and box codec, on files written here in the
published ExtremeWeather layout (not by the generator)."""

from __future__ import annotations

import json
import threading

import h5py
import numpy as np
import pytest

from hpcdl.workloads.climate import data as cd
from hpcdl.workloads.climate.data import (
    DataError,
    Preprocess,
    Stats,
    compute_stats,
    iter_eval,
    iter_train_batches,
    open_climate,
)
from hpcdl.workloads.climate.boxes import decode_grid, encode_boxes
from tests.workloads.climate import channel_values, write_ew

BOXES = [
    [[2, 3, 8, 11, 1], [10, 14, 16, 24, 3]],  # a TC and an AR
    [],  # nothing
    [[0, 0, 4, 4, 0]],  # a TD in the corner
    [[5, 5, 12, 20, 2]],  # an ETC
]


@pytest.fixture
def ew(tmp_path):
    return write_ew(tmp_path / "1979.h5", BOXES)


def test_reads_the_published_layout(ew):
    cf = open_climate(ew)
    assert (cf.n_images, cf.height, cf.width) == (4, 16, 24)
    # without a `labelled` dataset an image is labelled iff it has a box
    assert cf.labelled.tolist() == [True, False, True, True] and cf.n_labelled == 3
    with h5py.File(ew) as f:
        raw = f["images"][2]
    with cd.ClimateReader(cf) as r:
        assert r.shape == (16, 24, 16)
        x = r.read_raw(2)
        assert x.dtype == np.float32 and x.shape == (16, 24, 16)
        np.testing.assert_array_equal(x, np.transpose(raw, (1, 2, 0)))  # channels last, in order
        np.testing.assert_array_equal(r.read_boxes(0), np.array(BOXES[0], np.float32))
        with pytest.raises(IndexError):
            r.read_raw(4)


def test_minus_one_padding_rows_are_not_boxes(ew):
    cf = open_climate(ew)
    assert cf.boxes.shape == (4, 15, 5)
    assert [len(cf.valid_boxes(i)) for i in range(4)] == [2, 0, 1, 1]
    assert cf.valid_boxes(1).shape == (0, 5)
    assert (cf.boxes[0, 2:] == -1).all()


def test_labelled_flag_tells_unlabelled_from_empty(tmp_path):
    path = write_ew(tmp_path / "semi.h5", [[[1, 1, 5, 5, 1]], [], [], [[2, 2, 6, 9, 2]]],
                    labelled=[True, True, False, False])
    with pytest.raises(DataError, match="image 3 is marked unlabelled but has boxes"):
        open_climate(path)
    path = write_ew(tmp_path / "semi.h5", [[[1, 1, 5, 5, 1]], [], [], []], labelled=[True, True, False, False])
    cf = open_climate(path)
    assert cf.labelled.tolist() == [True, True, False, False]  # image 1: labelled, no event


def test_float_boxes_are_accepted(tmp_path):
    path = write_ew(tmp_path / "f.h5", [[[1.5, 2.25, 5.5, 9.0, 3]]], box_dtype=np.float32)
    assert open_climate(path).valid_boxes(0).tolist() == [[1.5, 2.25, 5.5, 9.0, 3.0]]


@pytest.mark.parametrize("mutate, message", [
    (lambda f: (f.__delitem__("images"), f.__setitem__("images", np.zeros((4, 3, 16, 24), np.float32))),
     "images has 3 channels"),
    (lambda f: (f.__delitem__("images"), f.__setitem__("images", np.zeros((4, 16, 16), np.float32))),
     r"images has shape \(4, 16, 16\), expected \(N, 16, H, W\)"),
    (lambda f: (f.__delitem__("boxes"), f.__setitem__("boxes", -np.ones((4, 15, 4), np.int32))),
     r"boxes has shape \(4, 15, 4\), expected \(4, 15, 5\)"),
    (lambda f: (f.__delitem__("boxes"), f.__setitem__("boxes", -np.ones((3, 15, 5), np.int32))),
     r"boxes has shape \(3, 15, 5\)"),
    (lambda f: f["boxes"].__setitem__((2, 0, 4), 4), r"boxes\[2, 0\] has class 4, expected 0..3"),
    (lambda f: f["boxes"].__setitem__((2, 0, 4), -2), r"boxes\[2, 0\] has class -2"),
    (lambda f: f["boxes"].__setitem__((0, 1, 3), 30), r"boxes\[0, 1\] = .* outside the 16×24 image"),
    (lambda f: f["boxes"].__setitem__((0, 0, 2), 2), r"boxes\[0, 0\] = .* is empty"),
    (lambda f: f["boxes"].__setitem__((1, 0, 0), 3), r"boxes\[1, 0\] has class −1 but is not a padding row"),
    (lambda f: f.__delitem__("boxes"), "missing dataset 'boxes'"),
    (lambda f: f.__delitem__("images"), "missing dataset 'images'"),
    (lambda f: f.__setitem__("labelled", np.ones(5, bool)), r"labelled has shape \(5,\), expected \(4,\)"),
])
def test_bad_inputs_get_one_clear_line(ew, mutate, message):
    with h5py.File(ew, "a") as f:
        mutate(f)
    with pytest.raises(DataError, match=message) as info:
        open_climate(ew)
    assert str(ew) in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_and_non_hdf5_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        open_climate(tmp_path / "nope.h5")
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(DataError, match="not a readable HDF5 file"):
        open_climate(tmp_path / "text.h5")
    with h5py.File(tmp_path / "empty.h5", "w") as f:
        f["images"] = np.zeros((0, 16, 4, 4), np.float32)
        f["boxes"] = np.zeros((0, 15, 5), np.int32)
    with pytest.raises(DataError, match="zero images"):
        open_climate(tmp_path / "empty.h5")


# --------------------------------------------------------------------------------------------------
# preprocessing and normalisation


def test_crop_and_downsample_images_and_boxes(ew):
    prep = Preprocess(crop=(2, 4, 12, 18), downsample=2)  # 12×18 → 6×9
    cf = open_climate(ew)
    with h5py.File(ew) as f:
        raw = f["images"][0]
    with cd.ClimateReader(cf, prep) as r:
        assert r.shape == (6, 9, 16)
        x = r.read_raw(0)
        expected = raw[:, 2:14, 4:22].reshape(16, 6, 2, 9, 2).mean(axis=(2, 4))
        np.testing.assert_allclose(x, np.transpose(expected, (1, 2, 0)), rtol=1e-5)
        # TC [2,3,8,11] → shifted [0,-1,6,7] → clipped [0,0,6,7] (6·7 of 6·8 inside: kept) → /2
        # AR [10,14,16,24] → [8,10,14,20] clipped [8,10,12,18]: 4·8 of 6·10 inside: kept
        np.testing.assert_allclose(r.read_boxes(0), [[0, 0, 3, 3.5, 1], [4, 5, 6, 9, 3]])
        # TD [0,0,4,4] → [-2,-4,2,0]: nothing inside → dropped
        assert r.read_boxes(2).shape == (0, 5)
    assert prep.output_hw(16, 24) == (6, 9)
    with pytest.raises(DataError, match="does not fit"):
        Preprocess(crop=(10, 0, 12, 24)).region(16, 24, ew)
    with pytest.raises(ValueError):
        Preprocess(downsample=0)


def test_stats_stream_matches_numpy_and_round_trips(ew, tmp_path):
    with h5py.File(ew) as f:
        allx = f["images"][...].astype(np.float64)
    st = compute_stats(ew)
    np.testing.assert_allclose(st.mean, allx.mean(axis=(0, 2, 3)), rtol=1e-9)
    np.testing.assert_allclose(st.std, allx.std(axis=(0, 2, 3)), rtol=1e-7)
    assert st.images == 4
    # JSON round trip (the engine stores the dict in the checkpoint manifest)
    again = Stats.from_dict(json.loads(json.dumps(st.to_dict())))
    assert again == st
    # normalise → denormalise is the identity; normalised data are standard
    with cd.ClimateReader(open_climate(ew)) as r:
        x = np.stack([r.read_raw(i) for i in range(4)])
    z = st.normalize(x)
    np.testing.assert_allclose(z.reshape(-1, 16).mean(axis=0), 0, atol=1e-4)
    np.testing.assert_allclose(z.reshape(-1, 16).std(axis=0), 1, atol=1e-4)
    err = (st.denormalize(z) - x) / np.asarray(st.std, np.float32)  # float32 round-off, per channel scale
    assert np.abs(err).max() < 1e-5
    with pytest.raises(ValueError, match="16 channels last"):
        st.normalize(x[..., :3])


def test_stats_record_preprocessing_and_subsample(ew):
    prep = Preprocess(crop=(0, 0, 8, 8), downsample=2)
    st = compute_stats(ew, prep, max_images=2)
    assert st.images == 2 and st.prep == prep
    d = st.to_dict()
    assert d["crop"] == [0, 0, 8, 8] and d["downsample"] == 2 and d["channels"][6] == "TMQ"
    assert Stats.from_dict(d).prep == prep
    with pytest.raises(ValueError, match="channels"):
        Stats.from_dict({**d, "channels": ["a"] * 16})


# --------------------------------------------------------------------------------------------------
# box codec


def _perfect_logits(target: np.ndarray) -> np.ndarray:
    """The head output that encodes `target` exactly (large logits)."""
    eps = 1e-7
    out = np.zeros((*target.shape[:2], 9))
    out[..., 0] = np.where(target[..., 0] > 0, 30.0, -30.0)
    for k in (1, 2):
        p = np.clip(target[..., k], eps, 1 - eps)
        out[..., k] = np.log(p / (1 - p))
    out[..., 3:5] = target[..., 3:5]
    cls = target[..., 5].astype(int)
    out[..., 5:] = -30.0
    np.put_along_axis(out[..., 5:], cls[..., None], 30.0, axis=-1)
    return out


def test_encode_decode_round_trip():
    boxes = np.array([[2, 3, 8, 11, 1], [10, 14, 16, 24, 3], [0.5, 0.25, 3.75, 4, 0], [4, 16, 13.5, 23, 2]], np.float32)
    t = encode_boxes(boxes, (4, 6), 4)
    assert t.shape == (4, 6, 6) and t[..., 0].sum() == 4
    # the TC's centre (5, 7) lies in cell (1, 1) at offsets (0.25, 0.75), size 6×8 = 1.5 × 2 cells
    np.testing.assert_allclose(t[1, 1], [1, 0.25, 0.75, np.log(1.5), np.log(2.0), 1], rtol=1e-6)
    dec = decode_grid(_perfect_logits(t), 4, score_threshold=0.5)
    assert dec.shape == (4, 6)
    order = np.lexsort((dec[:, 1], dec[:, 0]))
    exp = boxes[np.lexsort((boxes[:, 1], boxes[:, 0]))]
    np.testing.assert_allclose(dec[order, :5], exp, atol=1e-4)
    np.testing.assert_allclose(dec[:, 5], 1.0, atol=1e-6)


def test_encode_one_object_per_cell_the_larger_wins_and_empty():
    t = encode_boxes(np.array([[0, 0, 2, 2, 0], [0, 0, 3, 3, 2]], np.float32), (2, 2), 4)
    assert t[..., 0].sum() == 1 and t[0, 0, 5] == 2
    assert not encode_boxes(np.zeros((0, 5), np.float32), (2, 2), 4).any()


def test_decode_scores_and_clipping():
    out = np.full((2, 2, 9), -20.0)
    out[1, 1] = [0.0, 0.0, 0.0, np.log(4.0), np.log(4.0), 5.0, 5.0, -20, -20]  # P(obj) .5, two classes tie
    dec = decode_grid(out, 4, score_threshold=0.2, image_hw=(8, 8))
    # centre (6, 6), 16×16 → clipped to the 8×8 image; score .5 × .5 for classes 0 and 1
    np.testing.assert_allclose(dec[:, :4], [[0, 0, 8, 8]] * 2)
    np.testing.assert_allclose(sorted(dec[:, 4]), [0, 1])
    np.testing.assert_allclose(dec[:, 5], 0.25, atol=1e-6)
    assert decode_grid(out, 4, score_threshold=0.3).shape == (0, 6)


# --------------------------------------------------------------------------------------------------
# batches


@pytest.fixture
def semi(tmp_path):
    n = 24
    boxes = [[[1, 1, 5, 7, i % 4]] if i % 4 == 0 else [] for i in range(n)]
    labelled = [i % 4 == 0 or i == 1 for i in range(n)]  # 6 with a box + image 1 (labelled, empty)
    return write_ew(tmp_path / "semi.h5", boxes, labelled=labelled, seed=3)


def test_train_batches_mix_labelled_and_unlabelled(semi):
    st = compute_stats(semi)
    cf = open_climate(semi)
    it = iter_train_batches(semi, 8, st, 4, labelled_share=0.5, seed=1, prefetch=0)
    for _ in range(5):
        x, target, lab = next(it)
        assert x.shape == (8, 16, 24, 16) and x.dtype == np.float32
        assert target.shape == (8, 4, 6, 6) and lab.shape == (8,)
        assert lab.sum() == 4
        assert (target[lab == 0] == 0).all()
    # supervised only: unlabelled images are never in a batch
    it = iter_train_batches(semi, 8, st, 4, labelled_only=True, seed=1, prefetch=0)
    x, target, lab = next(it)
    assert (lab == 1).all()
    with cd.ClimateReader(cf) as r:
        labelled_x = {i: st.normalize(r.read_raw(i)) for i in np.flatnonzero(cf.labelled)}
    for xi in x:
        assert any(np.array_equal(xi, v) for v in labelled_x.values())


def test_train_batches_are_deterministic_and_sharded(semi):
    st = compute_stats(semi)
    a = [next(iter_train_batches(semi, 4, st, 4, seed=5, prefetch=0))[0] for _ in range(2)]
    np.testing.assert_array_equal(a[0], a[1])
    cf = open_climate(semi)
    pools = [cd.shard_pools(cf, s, 3) for s in range(3)]
    lab = np.concatenate([p[0] for p in pools])
    unl = np.concatenate([p[1] for p in pools])
    assert sorted(lab.tolist()) == np.flatnonzero(cf.labelled).tolist()
    assert sorted(unl.tolist()) == np.flatnonzero(~cf.labelled).tolist()
    with pytest.raises(DataError, match="no labelled image"):
        next(iter_train_batches(semi, 4, st, 4, shard=7, shards=8, labelled_only=True, prefetch=0))


def test_prefetch_thread_has_ended_when_close_returns(semi):
    # a reader thread left inside HDF5 at interpreter exit hangs the process (h5py's lock)
    st = compute_stats(semi)
    before = threading.active_count()
    it = iter_train_batches(semi, 4, st, 4, prefetch=2)
    next(it)
    assert threading.active_count() == before + 1
    it.close()
    assert threading.active_count() == before


def test_prefetch_thread_hands_errors_to_the_consumer(semi):
    st = Stats.from_dict({**compute_stats(semi).to_dict(), "crop": [0, 0, 40, 40]})
    it = iter_train_batches(semi, 4, st, 4, prefetch=1)
    with pytest.raises(DataError, match="does not fit"):
        next(it)


def test_eval_batches_skip_unlabelled_images(semi):
    st = compute_stats(semi)
    seen = []
    for idx, x, boxes in iter_eval(semi, st, batch=3):
        assert len(idx) == len(x) == len(boxes) <= 3
        seen += idx.tolist()
    assert seen == np.flatnonzero(open_climate(semi).labelled).tolist()


def test_channel_values_helper_is_in_published_order():
    assert cd.CHANNELS[6] == "TMQ" and len(cd.CHANNELS) == 16 and channel_values(1, 2, 2).shape == (1, 16, 2, 2)
