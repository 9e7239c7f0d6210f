"""Tests of the synthetic RPV-SUSY / QCD generator: layout, determinism, physics sanity, arguments."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from hpcdl.workloads.hep import events, generate as gen
from hpcdl.workloads.hep.data import open_hep
from hpcdl.workloads.hep.generate import GeneratorConfig, generate

IMAGE_KEYS = ("hist", "histEM", "histtrack")
FLAG_KEYS = ("passSR", "passSR4J", "passSR5J")


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    """1500 events at 16×16: big enough for rates, small enough to take a few seconds."""
    out = tmp_path_factory.mktemp("hep")
    calls = []
    paths = generate(out, 1500, image_size=16, seed=3, fractions=(0.8, 0.1, 0.1), progress=calls.append)
    return out, paths, calls


def _read(path):
    with h5py.File(path, "r") as f:
        return {k: f["all_events"][k][...] for k in f["all_events"]}, {k: f["truth"][k][...] for k in f["truth"]}


def test_files_layout(sample):
    out, paths, calls = sample
    assert set(paths) == {"train", "val", "test"}
    assert sorted(p.name for p in out.iterdir()) == ["test.h5", "train.h5", "val.h5"]  # no temporaries left
    sizes = {"train": 1200, "val": 150, "test": 150}
    assert sum(calls) == 1500 and max(calls) <= gen.CHUNK_EVENTS
    for name, path in paths.items():
        n = sizes[name]
        with h5py.File(path, "r") as f:
            g = f["all_events"]
            for k in IMAGE_KEYS:
                assert g[k].shape == (n, 16, 16) and g[k].dtype == np.float32
                assert g[k].chunks is not None and g[k].compression is not None
            assert g["y"].shape == (n,) and g["y"].dtype == np.float32
            assert g["weight"].shape == (n,) and g["weight"].dtype == np.float32
            for k in FLAG_KEYS:
                assert g[k].shape == (n,) and g[k].dtype == bool
            assert f.attrs["split"] == name and f.attrs["seed"] == 3 and f.attrs["image_size"] == 16
            assert GeneratorConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in
                                      __import__("json").loads(f.attrs["config"]).items()}) == GeneratorConfig()
        hep = open_hep(path)  # the reader accepts it
        assert hep.layout == "nersc" and hep.n_events == n and hep.image_shape == (16, 16, 3)
        assert hep.has_weight and hep.has_pass_sr


def test_signal_fraction_exact_per_split(sample):
    _, paths, _ = sample
    for path in paths.values():
        ev, _ = _read(path)
        y = ev["y"]
        assert set(np.unique(y)) == {0.0, 1.0}
        assert y.sum() == round(0.5 * len(y))


def test_images_are_physical(sample):
    _, paths, _ = sample
    ev, _ = _read(paths["train"])
    hist, em, trk = ev["hist"], ev["histEM"], ev["histtrack"]
    assert np.all(hist >= 0) and np.all(em >= 0) and np.all(trk >= 0)
    assert np.all(em <= hist * (1 + 1e-5) + 1e-5)  # EM energy is part of the total
    np.testing.assert_array_equal(trk, np.round(trk))  # track counts
    frac = em.sum() / hist.sum()
    assert 0.2 < frac < 0.8
    # channels have very different scales (the reason readers normalise)
    assert hist.max() > 100 * 1.0 and trk.max() < 100
    # signal events carry more energy and more tracks than background on average
    y = ev["y"] == 1
    assert hist[y].sum(axis=(1, 2)).mean() > hist[~y].sum(axis=(1, 2)).mean()
    assert trk[y].sum(axis=(1, 2)).mean() > trk[~y].sum(axis=(1, 2)).mean()
    # pileup/noise: most events have many low-energy hits
    assert np.median((hist > 0).sum(axis=(1, 2))) > 30


def test_truth_physics(sample):
    _, paths, _ = sample
    ev, truth = _read(paths["train"])
    y = ev["y"] == 1
    # signal: many jets; QCD: mostly 2-5
    assert np.median(truth["n_jet"][y]) >= 6
    assert np.median(truth["n_jet"][~y]) <= 5
    assert np.all(truth["m_gluino"][y] >= 1000) and np.all(truth["m_gluino"][~y] == 0)
    assert np.all(truth["pthat_slice"][y] == -1) and np.all(truth["pthat_slice"][~y] >= 0)
    lo = np.asarray(GeneratorConfig().pthat_slices)[truth["pthat_slice"][~y]]
    hi = np.asarray(GeneratorConfig().pthat_slices)[truth["pthat_slice"][~y] + 1]
    assert np.all((truth["pthat"][~y] >= lo * 0.999) & (truth["pthat"][~y] <= hi * 1.001))


def test_weights(sample):
    _, paths, _ = sample
    cfg = GeneratorConfig()
    ev, truth = _read(paths["train"])
    y, w = ev["y"] == 1, ev["weight"].astype(np.float64)
    assert np.all(w > 0)
    # background weights span orders of magnitude (pT-hat slices) and dwarf the signal's
    assert w[~y].max() / w[~y].min() > 100
    assert w[~y].mean() > 100 * w[y].mean()
    # weights are expected yields: they add up to σ × L per class
    np.testing.assert_allclose(w[y].sum(), np.sum(cfg.gluino_xsec_fb) * cfg.lumi_fb, rtol=1e-5)
    np.testing.assert_allclose(w[~y].sum(), cfg.qcd_xsec_above_fb * (1 - (cfg.pthat_slices[-1] / cfg.pthat_slices[0])
                                                                     ** (1 - cfg.qcd_power)) * cfg.lumi_fb, rtol=1e-5)


def test_selection_good_but_imperfect(sample):
    _, paths, _ = sample
    ev, truth = _read(paths["train"])
    y, w = ev["y"] == 1, ev["weight"].astype(np.float64)
    sr = ev["passSR"]
    np.testing.assert_array_equal(sr, ev["passSR4J"] | ev["passSR5J"])
    tpr = sr[y].mean()
    fpr = sr[~y].mean()
    assert 0.25 < tpr < 0.75, tpr  # meaningful but far from perfect
    assert fpr < 0.05 and fpr < tpr / 10, fpr
    wfpr = w[~y & sr].sum() / w[~y].sum()
    assert wfpr < 1e-2  # weighted: only the rare high-pT-hat QCD passes
    # the flags follow from the stored truth features
    cfg = GeneratorConfig()
    flags = events.selection({k: truth[k].astype(np.float64) for k in events.TRUTH_FEATURES}, cfg)
    agree = (flags["passSR"] == sr).mean()
    assert agree > 0.99  # float32 storage may flip an event sitting on a threshold


def test_deterministic_for_a_seed(tmp_path):
    a = generate(tmp_path / "a", 40, image_size=8, seed=11)
    b = generate(tmp_path / "b", 40, image_size=8, seed=11)
    c = generate(tmp_path / "c", 40, image_size=8, seed=12)
    for name in ("train", "val", "test"):
        ea, ta = _read(a[name])
        eb, tb = _read(b[name])
        for k in ea:
            np.testing.assert_array_equal(ea[k], eb[k], err_msg=k)
        for k in ta:
            np.testing.assert_array_equal(ta[k], tb[k], err_msg=k)
    assert not np.array_equal(_read(a["train"])[0]["hist"], _read(c["train"])[0]["hist"])


def test_signal_fraction_follows_request(tmp_path):
    paths = generate(tmp_path, 60, image_size=8, seed=5, fractions=(0.5, 0.25, 0.25), signal_fraction=0.3)
    for name, n in (("train", 30), ("val", 15), ("test", 15)):
        ev, _ = _read(paths[name])
        assert len(ev["y"]) == n and ev["y"].sum() == round(0.3 * n)


def test_overwrites_atomically_and_cleans_up_on_failure(tmp_path):
    paths = generate(tmp_path, 20, image_size=8, seed=1)
    before = paths["train"].read_bytes()

    def boom(n):
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        generate(tmp_path, 20, image_size=8, seed=2, progress=boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.h5", "train.h5", "val.h5"]
    assert paths["train"].read_bytes() == before  # the complete old file was not touched


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(events=9), "events"),
        (dict(events=10.0), "events"),
        (dict(events=100, image_size=4), "image_size"),
        (dict(events=100, image_size=4096), "image_size"),
        (dict(events=100, image_size=32.0), "image_size"),
        (dict(events=100, seed=-1), "seed"),
        (dict(events=100, fractions=(0.5, 0.5)), "fractions"),
        (dict(events=100, fractions=(0.8, 0.3, -0.1)), "fractions"),
        (dict(events=100, fractions=(0.8, 0.1, 0.2)), "fractions"),
        (dict(events=10, fractions=(0.96, 0.02, 0.02)), "empty"),
        (dict(events=100, signal_fraction=0.0), "signal_fraction"),
        (dict(events=100, signal_fraction=1.0), "signal_fraction"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        generate(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()  # nothing written
