"""Tests of hpcdl.workloads.hep.metrics against independent computations.

The reference AUCs here are computed without any ROC curve: the O(n^2) weighted Mann-Whitney sum
over all (signal, background) pairs, and the textbook rank-sum formula with average ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from hpcdl.workloads.hep import metrics as m

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover
    HAVE_HYPOTHESIS = False


# ------------------------------------------------------------------------------------------------
# independent references


def brute_force_auc(scores, labels, weights=None):
    """Weighted Mann-Whitney: sum over all signal/background pairs, ties counted half."""
    s = np.asarray(scores, float)
    y = np.asarray(labels).astype(bool)
    w = np.ones(s.size) if weights is None else np.asarray(weights, float)
    num = 0.0
    for i in np.flatnonzero(y):
        for j in np.flatnonzero(~y):
            if s[i] > s[j]:
                num += w[i] * w[j]
            elif s[i] == s[j]:
                num += 0.5 * w[i] * w[j]
    return num / (w[y].sum() * w[~y].sum())


def rank_auc(scores, labels):
    """Unweighted AUC from the rank-sum (Mann-Whitney U) formula with average ranks for ties."""
    s = np.asarray(scores, float)
    y = np.asarray(labels).astype(bool)
    ranks = np.array([(s < v).sum() + ((s == v).sum() + 1) / 2.0 for v in s])
    n1, n0 = y.sum(), (~y).sum()
    return (ranks[y].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0)


def random_case(rng, n, n_levels=None):
    """Scores with many ties when n_levels is small; both classes guaranteed present."""
    if n_levels:
        s = rng.integers(0, n_levels, n) / n_levels
    else:
        s = rng.random(n)
    y = rng.random(n) < 0.4
    y[0], y[1] = True, False
    w = rng.exponential(1.0, n)
    return s, y, w


# hand case: scores, labels, weights; total signal weight 4, background weight 4
HS = np.array([0.9, 0.8, 0.8, 0.3, 0.1])
HY = np.array([1, 1, 0, 0, 1])
HW = np.array([1.0, 2.0, 1.0, 3.0, 1.0])


# ------------------------------------------------------------------------------------------------
# roc_curve


def test_roc_curve_hand_case_weighted():
    fpr, tpr, thr = m.roc_curve(HS, HY, HW)
    # the tied pair at 0.8 (signal w=2, background w=1) enters as one point
    np.testing.assert_array_equal(thr, [np.inf, 0.9, 0.8, 0.3, 0.1])
    np.testing.assert_array_equal(fpr, [0.0, 0.0, 0.25, 1.0, 1.0])
    np.testing.assert_array_equal(tpr, [0.0, 0.25, 0.75, 0.75, 1.0])


def test_roc_curve_hand_case_unweighted():
    fpr, tpr, thr = m.roc_curve(HS, HY)
    np.testing.assert_array_equal(thr, [np.inf, 0.9, 0.8, 0.3, 0.1])
    np.testing.assert_allclose(fpr, [0, 0, 1 / 2, 1, 1])
    np.testing.assert_allclose(tpr, [0, 1 / 3, 2 / 3, 2 / 3, 1])


def test_roc_curve_order_of_input_does_not_matter():
    perm = np.array([3, 0, 4, 2, 1])
    for got, want in zip(m.roc_curve(HS[perm], HY[perm], HW[perm]), m.roc_curve(HS, HY, HW)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(5))
def test_roc_curve_invariants(seed):
    s, y, w = random_case(np.random.default_rng(seed), 200, n_levels=15)
    fpr, tpr, thr = m.roc_curve(s, y, w)
    assert (fpr[0], tpr[0], thr[0]) == (0.0, 0.0, np.inf)
    assert (fpr[-1], tpr[-1]) == (1.0, 1.0)  # exactly
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    assert np.all(np.diff(thr) < 0)
    assert thr.size == np.unique(s).size + 1  # one point per distinct score
    # every point is the selection score >= threshold, computed directly
    for f, t, c in zip(fpr[1:], tpr[1:], thr[1:]):
        sel = s >= c
        assert f == pytest.approx(w[sel & ~y].sum() / w[~y].sum(), abs=1e-12)
        assert t == pytest.approx(w[sel & y].sum() / w[y].sum(), abs=1e-12)


# ------------------------------------------------------------------------------------------------
# roc_auc


def test_auc_hand_case():
    # pairs (signal, background): 0.9 beats both (1*1 + 1*3), 0.8 ties 0.8 (2*1/2) and beats 0.3 (2*3)
    assert m.roc_auc(HS, HY, HW) == pytest.approx(11 / 16, abs=1e-15)
    assert m.roc_auc(HS, HY) == pytest.approx(brute_force_auc(HS, HY), abs=1e-15)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("n_levels", [None, 3, 10])
def test_auc_equals_brute_force_weighted_mann_whitney(seed, n_levels):
    rng = np.random.default_rng(seed)
    s, y, w = random_case(rng, int(rng.integers(2, 60)), n_levels)
    assert m.roc_auc(s, y, w) == pytest.approx(brute_force_auc(s, y, w), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("n_levels", [None, 4])
def test_auc_unweighted_equals_rank_formula(seed, n_levels):
    rng = np.random.default_rng(100 + seed)
    s, y, _ = random_case(rng, int(rng.integers(2, 80)), n_levels)
    assert m.roc_auc(s, y) == pytest.approx(rank_auc(s, y), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("c", [1.0, 0.37, 1e-3, 250.0])
def test_equal_weights_equal_unweighted(c):
    s, y, _ = random_case(np.random.default_rng(7), 300, n_levels=20)
    w = np.full(s.size, c)
    assert m.roc_auc(s, y, w) == pytest.approx(m.roc_auc(s, y), rel=1e-12)
    assert m.roc_auc(s, y, None) == pytest.approx(rank_auc(s, y), rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_integer_weights_equal_repeated_events(seed):
    rng = np.random.default_rng(seed)
    s, y, _ = random_case(rng, 100, n_levels=12)
    k = rng.integers(0, 5, s.size)
    k[0] = k[1] = 1  # keep both classes
    fpr_w, tpr_w, thr_w = m.roc_curve(s, y, k.astype(float))
    fpr_r, tpr_r, thr_r = m.roc_curve(np.repeat(s, k), np.repeat(y, k))
    assert m.roc_auc(s, y, k) == pytest.approx(m.roc_auc(np.repeat(s, k), np.repeat(y, k)), rel=1e-12)
    # same curve, except that zero-weight events add points the repeated sample does not have
    keep = np.isin(thr_w, thr_r)
    np.testing.assert_array_equal(thr_w[keep], thr_r)
    np.testing.assert_allclose(fpr_w[keep], fpr_r, rtol=1e-12)
    np.testing.assert_allclose(tpr_w[keep], tpr_r, rtol=1e-12)


def test_auc_extremes():
    y = np.array([0, 0, 1, 1])
    assert m.roc_auc([0.1, 0.2, 0.3, 0.4], y) == 1.0
    assert m.roc_auc([0.4, 0.3, 0.2, 0.1], y) == 0.0
    assert m.roc_auc([0.5, 0.5, 0.5, 0.5], y) == 0.5  # all tied: one diagonal segment


def test_zero_weight_events_do_not_count():
    s, y, w = random_case(np.random.default_rng(3), 80, n_levels=9)
    w2 = np.concatenate([w, np.zeros(20)])
    s2 = np.concatenate([s, np.random.default_rng(4).random(20)])
    y2 = np.concatenate([y, np.arange(20) % 2 == 0])
    assert m.roc_auc(s2, y2, w2) == pytest.approx(m.roc_auc(s, y, w), rel=1e-12)


# ------------------------------------------------------------------------------------------------
# tpr_at_fpr and selection_point


@pytest.mark.parametrize(
    "target, tpr, thr",
    [
        (0.0, 0.25, 0.9),  # the 0.9 signal event costs no background
        (0.2499, 0.25, 0.9),  # just below the step at 0.25
        (0.25, 0.75, 0.8),  # exactly at the step: <= includes it
        (0.5, 0.75, 0.8),  # between steps: the lower point, no interpolation
        (0.9999, 0.75, 0.8),
        (1.0, 1.0, 0.1),
    ],
)
def test_tpr_at_fpr_hand_case(target, tpr, thr):
    assert m.tpr_at_fpr(HS, HY, HW, target) == (tpr, thr)


def test_tpr_at_fpr_unweighted_steps_exact():
    # 4 background events: FPR steps of exactly 1/4; 3 signal events
    s = np.array([7, 6, 5, 4, 3, 2, 1], float)
    y = np.array([1, 0, 1, 0, 0, 1, 0])
    assert m.tpr_at_fpr(s, y, None, 0.25) == (pytest.approx(2 / 3), 5.0)
    assert m.tpr_at_fpr(s, y, None, 0.24) == (pytest.approx(1 / 3), 7.0)
    assert m.tpr_at_fpr(s, y, None, 0.5) == (pytest.approx(2 / 3), 4.0)  # loosest cut with FPR 1/2
    assert m.tpr_at_fpr(s, y, None, 0.75) == (1.0, 2.0)


def test_tpr_at_fpr_infinite_threshold_when_top_event_is_background():
    tpr, thr = m.tpr_at_fpr([0.9, 0.5, 0.1], [0, 1, 0], None, 0.0)
    assert tpr == 0.0 and thr == math.inf


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "x", None])
def test_tpr_at_fpr_rejects_bad_target(bad):
    with pytest.raises(ValueError, match="target_fpr"):
        m.tpr_at_fpr(HS, HY, HW, bad)


def test_selection_point_hand_case():
    passed = np.array([True, False, True, False, True])
    # signal passed: weights 1 (0.9) + 1 (0.1) of 4; background passed: weight 1 (0.8) of 4
    assert m.selection_point(passed, HY, HW) == (0.25, 0.5)
    fpr, tpr = m.selection_point(passed, HY)
    assert (fpr, tpr) == (0.5, pytest.approx(2 / 3))
    assert m.selection_point(passed.astype(int), HY, HW) == (0.25, 0.5)


def test_selection_point_matches_roc_for_a_score_cut():
    s, y, w = random_case(np.random.default_rng(11), 150, n_levels=10)
    fpr, tpr, thr = m.roc_curve(s, y, w)
    for i in range(1, thr.size):
        f, t = m.selection_point(s >= thr[i], y, w)
        assert f == pytest.approx(fpr[i], abs=1e-12) and t == pytest.approx(tpr[i], abs=1e-12)


# ------------------------------------------------------------------------------------------------
# evaluate_scores


def test_evaluate_scores_hand_case():
    passed = np.array([True, False, True, False, True])
    r = m.evaluate_scores(HS, HY, HW, passed_sr=passed)
    assert (r.n_events, r.n_signal, r.n_background) == (5, 3, 2)
    assert r.auc_weighted == pytest.approx(11 / 16)
    assert r.auc_unweighted == pytest.approx(brute_force_auc(HS, HY))
    assert (r.selection_fpr, r.selection_tpr) == (0.25, 0.5)
    # at FPR <= 0.25 the CNN cuts at 0.8 and keeps 3/4 of the signal weight, vs 1/2 for the selection
    assert (r.cnn_tpr_at_selection_fpr, r.cnn_fpr_at_threshold, r.threshold) == (0.75, 0.25, 0.8)
    d = r.to_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert d["threshold"] == 0.8 and d["n_events"] == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.n_events = 3


def test_evaluate_scores_without_selection_and_weights():
    r = m.evaluate_scores(HS, HY)
    assert r.auc_weighted == r.auc_unweighted == pytest.approx(brute_force_auc(HS, HY))
    assert r.selection_fpr is r.selection_tpr is r.cnn_tpr_at_selection_fpr is r.threshold is None
    assert r.cnn_fpr_at_threshold is None


def test_evaluate_scores_infinite_threshold_is_json_null():
    r = m.evaluate_scores([0.9, 0.5, 0.1], [0, 1, 0], None, passed_sr=[False, True, False])
    assert r.threshold == math.inf and r.cnn_tpr_at_selection_fpr == 0.0
    assert r.to_dict()["threshold"] is None
    json.dumps(r.to_dict(), allow_nan=False)


# ------------------------------------------------------------------------------------------------
# bad inputs


@pytest.mark.parametrize(
    "args, match",
    [
        (([0.1, 0.2, 0.3], [0, 1], None), "length mismatch"),
        (([0.1, 0.2], [0, 1], [1.0]), "length mismatch"),
        (([], [], None), "empty"),
        (([0.1, 0.2], [1, 1], None), "both classes"),
        (([0.1, 0.2], [0, 0], None), "both classes"),
        (([0.1, 0.2], [0, 1], [1.0, -0.5]), "non-negative"),
        (([0.1, 0.2], [0, 1], [0.0, 1.0]), "total background weight is zero"),
        (([0.1, float("nan")], [0, 1], None), "finite"),
        (([0.1, 0.2], [0, 1], [1.0, float("inf")]), "finite"),
        (([0.1, 0.2], [0, 2], None), "only 0 and 1"),
        (([[0.1], [0.2]], [0, 1], None), "1-D"),
        ((["a", "b"], [0, 1], None), "numeric"),
    ],
)
def test_bad_inputs_raise(args, match):
    for fn in (m.roc_curve, m.roc_auc, m.evaluate_scores):
        with pytest.raises(ValueError, match=match):
            fn(*args)
    with pytest.raises(ValueError, match=match):
        m.tpr_at_fpr(*args, 0.1)


def test_selection_point_bad_inputs():
    with pytest.raises(ValueError, match="length mismatch"):
        m.selection_point([True, False], [0, 1, 1])
    with pytest.raises(ValueError, match="passed"):
        m.selection_point([0.5, 1.0], [0, 1])
    with pytest.raises(ValueError, match="both classes"):
        m.selection_point([True, False], [1, 1])
    with pytest.raises(ValueError, match="passed_sr"):
        m.evaluate_scores(HS, HY, HW, passed_sr=[True, False])


# ------------------------------------------------------------------------------------------------
# files

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_plot_roc_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(0)
    n = 5000
    y = rng.random(n) < 0.3
    s = 1 / (1 + np.exp(-(rng.normal(0, 1, n) + 2.5 * y)))
    w = np.where(y, 0.01, rng.lognormal(0, 1, n))
    passed = (s > 0.75) & (rng.random(n) < 0.6)
    sel = m.selection_point(passed, y, w)
    out = m.plot_roc(tmp_path / "roc.png", s, y, w, selection=sel, title="test ROC")
    assert out == tmp_path / "roc.png"
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 20_000
    assert [p.name for p in tmp_path.iterdir()] == ["roc.png"]  # no temporary left behind

    import matplotlib.image

    img = matplotlib.image.imread(out)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 300
    assert img[..., :3].std() > 0.05  # not blank

    m.plot_roc(tmp_path / "plain.png", s, y, w)  # without a selection
    assert (tmp_path / "plain.png").read_bytes()[:8] == PNG_SIGNATURE


def test_plot_roc_failure_leaves_no_file(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError):
        m.plot_roc(tmp_path / "roc.png", HS, HY, HW, selection=(2.0, 0.5))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".npz", ".csv", ".CSV"])
def test_write_scores_round_trip(tmp_path, suffix):
    rng = np.random.default_rng(5)
    n = 257
    index = rng.permutation(10_000)[:n]
    s = rng.random(n).astype(np.float32) * 0.9 + np.float32(1e-7)
    y = rng.random(n) < 0.5
    w = rng.lognormal(0, 3, n)
    path = m.write_scores(tmp_path / f"scores{suffix}", index, s, y.astype(int), w)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    idx2, s2, y2, w2 = m.read_scores(path)
    np.testing.assert_array_equal(idx2, index)
    np.testing.assert_array_equal(s2, s.astype(np.float64))  # exact, 17 significant digits in CSV
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(w2, w)
    assert m.roc_auc(s2, y2, w2) == m.roc_auc(s, y, w)


def test_write_scores_npz_format_is_plain(tmp_path):
    path = m.write_scores(tmp_path / "s.npz", np.arange(5), HS, HY, HW)
    with np.load(path, allow_pickle=False) as d:
        assert sorted(d.files) == ["index", "label", "score", "weight"]
        assert all(d[k].dtype != object for k in d.files)
        np.testing.assert_array_equal(d["label"], HY)


def test_write_scores_csv_format(tmp_path):
    path = m.write_scores(tmp_path / "s.csv", np.arange(5), HS, HY, None)
    lines = path.read_text().splitlines()
    assert lines[0] == "index,score,label,weight"
    assert lines[1] == "0,0.90000000000000002,1,1"
    assert len(lines) == 6


def test_write_scores_single_class_is_fine(tmp_path):
    m.write_scores(tmp_path / "s.npz", np.arange(3), [0.1, 0.2, 0.3], [1, 1, 1])
    assert list(np.load(tmp_path / "s.npz")["label"]) == [1, 1, 1]


@pytest.mark.parametrize("name", ["s.txt", "s.npy", "s", "s.npz.bak"])
def test_write_scores_rejects_unknown_suffix(tmp_path, name):
    with pytest.raises(ValueError, match=r"\.npz or \.csv"):
        m.write_scores(tmp_path / name, np.arange(5), HS, HY, HW)
    assert list(tmp_path.iterdir()) == []


def test_write_scores_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="length mismatch"):
        m.write_scores(tmp_path / "s.npz", np.arange(4), HS, HY, HW)
    with pytest.raises(ValueError, match="index must be an integer"):
        m.write_scores(tmp_path / "s.npz", np.arange(5.0), HS, HY, HW)
    with pytest.raises(ValueError, match="empty"):
        m.write_scores(tmp_path / "s.csv", [], [], [], [])
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------
# properties

if HAVE_HYPOTHESIS:
    grid_floats = st.integers(0, 6).map(lambda k: k / 6)  # few values: many ties
    any_floats = st.floats(-1e6, 1e6, allow_nan=False)

    @st.composite
    def cases(draw, score_strategy=any_floats):
        n = draw(st.integers(2, 40))
        s = draw(st.lists(score_strategy, min_size=n, max_size=n))
        y = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        y[0], y[1] = True, False
        w = draw(st.lists(st.floats(0.01, 100.0), min_size=n, max_size=n))
        return np.array(s, float), np.array(y), np.array(w)

    @settings(max_examples=200, deadline=None)
    @given(cases(st.one_of(grid_floats, any_floats)))
    def test_property_auc_in_unit_interval_and_matches_brute_force(case):
        s, y, w = case
        auc = m.roc_auc(s, y, w)
        assert 0.0 <= auc <= 1.0
        assert auc == pytest.approx(brute_force_auc(s, y, w), rel=1e-9, abs=1e-12)

    @settings(max_examples=200, deadline=None)
    @given(st.data())
    def test_property_negated_scores_give_one_minus_auc(data):
        n = data.draw(st.integers(2, 40))
        s = np.array(data.draw(st.lists(any_floats, min_size=n, max_size=n, unique=True)))  # no ties
        y = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
        y[0], y[1] = True, False
        w = np.array(data.draw(st.lists(st.floats(0.01, 100.0), min_size=n, max_size=n)))
        assert m.roc_auc(-s, y, w) == pytest.approx(1.0 - m.roc_auc(s, y, w), abs=1e-12)
        assert m.roc_auc(-s, y) == pytest.approx(1.0 - m.roc_auc(s, y), abs=1e-12)

    @settings(max_examples=200, deadline=None)
    @given(cases(grid_floats))
    def test_property_negation_with_ties_and_label_swap(case):
        # ties count half, so the symmetry holds with ties too
        s, y, w = case
        auc = m.roc_auc(s, y, w)
        assert m.roc_auc(-s, y, w) == pytest.approx(1.0 - auc, abs=1e-12)
        assert m.roc_auc(s, ~y, w) == pytest.approx(1.0 - auc, abs=1e-12)

    @settings(max_examples=100, deadline=None)
    @given(cases(), st.floats(0.0, 1.0))
    def test_property_tpr_at_fpr_is_best_cut(case, target):
        s, y, w = case
        tpr, thr = m.tpr_at_fpr(s, y, w, target)
        sel = s >= thr
        fpr_here = w[sel & ~y].sum() / w[~y].sum()
        assert fpr_here <= target + 1e-12
        # any looser cut (the next lower distinct score) exceeds the target
        lower = s[s < thr]
        if lower.size:
            looser = s >= lower.max()
            assert w[looser & ~y].sum() / w[~y].sum() > target - 1e-12
