"""The synthetic generator: layout, labelled fraction, determinism, atomic files, physics signs."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from hpcdl.workloads.climate.data import CHANNELS, open_climate
from hpcdl.workloads.climate.generate import GeneratorConfig, generate, orography, simulate_image


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("climate")
    seen = []
    paths = generate(d, 30, height=32, width=48, labelled_fraction=0.25, seed=3, progress=seen.append)
    return d, paths, seen


def test_files_validate_in_the_published_layout(small):
    d, paths, seen = small
    assert sorted(paths) == ["test", "train", "val"] and sum(seen) == 30
    assert sorted(p.name for p in d.iterdir()) == ["test.h5", "train.h5", "val.h5"]  # no temp files left
    train = open_climate(paths["train"])
    assert (train.n_images, train.height, train.width) == (24, 32, 48)
    assert train.n_labelled == 6  # exactly round(0.25 × 24)
    for split in ("val", "test"):
        cf = open_climate(paths[split])
        assert cf.n_images == 3 and cf.n_labelled == 3  # evaluation files are fully labelled
    with h5py.File(paths["train"]) as f:
        assert f["images"].dtype == np.float32 and f["images"].shape == (24, 16, 32, 48)
        assert f["boxes"].shape == (24, 15, 5)
        assert [c.decode() for c in f["images"].attrs["channels"]] == list(CHANNELS)
        lab = f["labelled"][...]
        boxes, truth = f["boxes"][...], f["truth/boxes"][...]
    assert (boxes[~lab] == -1).all()  # unlabelled: boxes all −1
    assert (boxes[lab] == truth[lab]).all()
    assert (truth[:, :, 4] >= 0).sum() > 24  # events in (nearly) every image


def test_deterministic_for_a_seed(small, tmp_path):
    _, paths, _ = small
    again = generate(tmp_path, 30, height=32, width=48, labelled_fraction=0.25, seed=3)
    with h5py.File(paths["train"]) as a, h5py.File(again["train"]) as b:
        for key in ("images", "boxes", "labelled"):
            np.testing.assert_array_equal(a[key][...], b[key][...])
    other = generate(tmp_path / "other", 30, height=32, width=48, labelled_fraction=0.25, seed=4)
    with h5py.File(paths["train"]) as a, h5py.File(other["train"]) as b:
        assert not np.array_equal(a["images"][0], b["images"][0])


@pytest.mark.parametrize("kwargs, message", [
    (dict(images=5), "images must be"), (dict(height=8), "height must be"),
    (dict(labelled_fraction=1.5), "labelled_fraction"), (dict(seed=-1), "seed"),
    (dict(fractions=(0.5, 0.5, 0.5)), "fractions"),
])
def test_bad_arguments(tmp_path, kwargs, message):
    args = dict(images=20, height=32, width=48)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate(tmp_path, **args)
    assert not list(tmp_path.glob("*.h5*"))


def test_fields_are_plausible_and_events_have_the_right_signs():
    rng = np.random.default_rng(0)
    h, w = 96, 144
    cfg = GeneratorConfig(mean_counts=(0.0, 3.0, 0.0, 1.0))  # tropical cyclones and rivers only
    x, boxes = simulate_image(rng, h, w, orography(0, h, w), cfg)
    f = dict(zip(CHANNELS, x))
    assert 9.0e4 < f["PSL"].mean() < 1.03e5 and 240 < f["TS"].min() and f["TS"].max() < 310
    assert (f["PRECT"] >= 0).all() and f["PRECT"].max() < 1e-5 and (f["QREFHT"] > 0).all()
    assert (f["PS"] <= f["PSL"] + 1).all()  # surface pressure never above sea level pressure
    assert 10000 < f["Z200"].mean() < 13000 and 40 < f["ZBOT"].mean() < 80
    tmq = f["TMQ"]
    assert tmq[h // 2 - 5:h // 2 + 5].mean() > 3 * tmq[:10].mean()  # moist tropics, dry poles
    assert {int(c) for c in boxes[:, 4]} <= {1, 3} and len(boxes)
    for y0, x0, y1, x1, c in boxes:
        inside = (slice(y0, y1), slice(x0, x1))
        if c == 1:  # a TC: a pressure minimum and a moist core inside its box
            cy, cx = np.unravel_index(np.argmin(f["PSL"][inside]), (y1 - y0, x1 - x0))
            assert abs(y0 + cy - (y0 + y1) / 2) <= 2 and abs(x0 + cx - (x0 + x1) / 2) <= 2
            ring = f["PSL"][max(y0 - 3, 0):y1 + 3, max(x0 - 3, 0):x1 + 3].mean()
            assert f["PSL"][inside].min() < ring - 1000
            assert f["TMQ"][inside].max() > f["TMQ"][max(y0 - 3, 0):y1 + 3, max(x0 - 3, 0):x1 + 3].mean()
            # cyclonic: relative vorticity ∂v/∂x − ∂u/∂y has the sign of the latitude
            v, u = f["V850"][inside], f["U850"][inside]
            vort = np.gradient(v, axis=1) - np.gradient(u, axis=0)
            north = (y0 + y1) / 2 > h / 2
            assert np.sign(vort.mean()) == (1 if north else -1)
