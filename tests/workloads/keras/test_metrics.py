"""The generic workload's regression scores against an independent computation."""

import numpy as np
import pytest

from hpcdl.workloads.keras import metrics


def r2_of_one_output(p, t, w):
    """R² as a statistics text defines it, written apart from the code under test."""
    mean = np.average(t, weights=w)
    return 1.0 - np.average((p - t) ** 2, weights=w) / np.average((t - mean) ** 2, weights=w)


@pytest.fixture
def two_outputs():
    """Two targets whose means differ by a hundred: one mean over both would call that explained."""
    rng = np.random.default_rng(3)
    t = np.stack([rng.normal(1.0, 0.5, 400), rng.normal(100.0, 2.0, 400)], axis=1)
    p = t + rng.normal(0.0, [0.2, 1.0], (400, 2))
    w = rng.uniform(0.5, 2.0, 400)
    return p, t, w


def test_each_outputs_r2_is_against_its_own_mean(two_outputs):
    p, t, w = two_outputs
    result = metrics.regression(p, t, w)
    own = [r2_of_one_output(p[:, i], t[:, i], w) for i in range(2)]
    assert result["r2_0"] == pytest.approx(own[0], rel=1e-9)
    assert result["r2_1"] == pytest.approx(own[1], rel=1e-9)
    assert result["r2"] == pytest.approx(np.mean(own), rel=1e-9)
    assert [o["r2"] for o in result["outputs"]] == pytest.approx(own)
    assert result["mse_1"] == pytest.approx(np.average((p[:, 1] - t[:, 1]) ** 2, weights=w))
    assert result["mae_0"] == pytest.approx(np.average(np.abs(p[:, 0] - t[:, 0]), weights=w))
    assert result["mse"] == pytest.approx((result["mse_0"] + result["mse_1"]) / 2)


def test_predicting_each_outputs_mean_scores_zero(two_outputs):
    _, t, w = two_outputs
    mean = np.average(t, axis=0, weights=w)
    result = metrics.regression(np.broadcast_to(mean, t.shape), t, w)
    assert result["r2"] == pytest.approx(0.0, abs=1e-12)
    assert result["r2_0"] == pytest.approx(0.0, abs=1e-12) and result["r2_1"] == pytest.approx(0.0, abs=1e-12)


def test_one_output_has_no_per_output_keys():
    t = np.linspace(0.0, 1.0, 50)
    result = metrics.regression(t + 0.1, t, np.ones(50))
    assert "r2_0" not in result and "outputs" not in result
    assert result["mse"] == pytest.approx(0.01) and result["mae"] == pytest.approx(0.1)
    assert result["r2"] == pytest.approx(r2_of_one_output(t + 0.1, t, np.ones(50)))


def test_a_constant_target_scores_one_when_matched_and_zero_when_not():
    t = np.stack([np.full(20, 3.0), np.arange(20.0)], axis=1)
    assert metrics.regression(t, t, np.ones(20))["r2_0"] == 1.0
    assert metrics.regression(t + [1.0, 0.0], t, np.ones(20))["r2_0"] == 0.0


def test_the_picture_has_a_labelled_panel_per_output(two_outputs, tmp_path):
    p, t, _ = two_outputs
    path = metrics.plot_predicted_vs_true(tmp_path / "pvt.png", p, t, "test")
    from PIL import Image

    width, height = Image.open(path).size
    assert width > 1.8 * height  # two panels side by side
