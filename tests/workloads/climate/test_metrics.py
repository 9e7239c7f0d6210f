"""IoU, NMS and average precision against hand-computed cases; plots and detection files."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.workloads.climate.metrics import (
    average_precision,
    detection_metrics,
    iou,
    nms,
    plot_detections,
    read_detections,
    write_detections,
)


def test_iou_hand_cases():
    a = [[0, 0, 2, 2]]
    assert iou(a, a)[0, 0] == 1.0
    assert iou(a, [[2, 2, 4, 4]])[0, 0] == 0.0  # touching corners
    assert iou(a, [[0, 1, 2, 3]])[0, 0] == pytest.approx(2 / 6)  # half shifted: 2 / (4 + 4 - 2)
    assert iou([[0, 0, 4, 4]], [[1, 1, 3, 3]])[0, 0] == pytest.approx(4 / 16)  # contained
    assert iou([[0, 0, 3, 2]], [[1, 1, 4, 5]])[0, 0] == pytest.approx(2 / (6 + 12 - 2))
    m = iou([[0, 0, 2, 2], [0, 0, 4, 4]], [[0, 0, 2, 2], [0, 0, 1, 1], [5, 5, 6, 6]])
    np.testing.assert_allclose(m, [[1, 0.25, 0], [0.25, 1 / 16, 0]])
    # extra columns (class, score) are ignored
    assert iou([[0, 0, 2, 2, 3, 0.9]], [[0, 0, 2, 2, 1]])[0, 0] == 1.0


def test_nms_keeps_the_best_of_overlapping_boxes_per_class():
    d = np.array([
        [0, 0, 10, 10, 1, 0.6],
        [0, 1, 10, 11, 1, 0.9],  # IoU with the first 90/110 > 0.3: keeps this one
        [20, 20, 30, 30, 1, 0.5],  # far away: kept
        [0, 0, 10, 10, 2, 0.4],  # other class: not suppressed
        [0, 5, 10, 15, 1, 0.7],  # IoU with the best (0,1,10,11): 60/140 = .43 > .3: dropped
    ], np.float32)
    kept = nms(d, 0.3)
    np.testing.assert_allclose(kept[:, 5], [0.9, 0.5, 0.4])
    assert kept[0, :5].tolist() == [0, 1, 10, 11, 1]
    assert len(nms(d, 0.5)) == 4  # at 0.5 the 0.43 overlap survives
    assert len(nms(d, 0.3, max_detections=2)) == 2
    assert nms(np.zeros((0, 6)), 0.3).shape == (0, 6)


def test_average_precision_hand_case():
    # class 0: two true boxes in image 0 (A, B) and one in image 1 (C)
    truths = [np.array([[0, 0, 10, 10, 0], [20, 20, 30, 30, 0]]), np.array([[0, 0, 10, 10, 0]])]
    dets = [
        np.array([[0, 0, 10, 10, 0, 0.9],  # matches A: TP
                  [50, 50, 60, 60, 0, 0.8],  # nothing there: FP
                  [0, 1, 10, 11, 0, 0.6]]),  # A again, already matched: FP
        np.array([[0, 0, 10, 9, 0, 0.7]]),  # matches C (IoU .9): TP
    ]
    # ranked: TP, FP, TP, FP → recall 1/3, 1/3, 2/3, 2/3; precision 1, 1/2, 2/3, 1/2
    # all-point envelope: 1 on (0, 1/3], 2/3 on (1/3, 2/3], nothing beyond → AP = 1/3 + 2/9 = 5/9
    assert average_precision(dets, truths, 0, 0.5) == pytest.approx(5 / 9)
    assert average_precision(dets, truths, 1, 0.5) is None  # no true box of class 1
    assert average_precision([np.zeros((0, 6))] * 2, truths, 0, 0.5) == 0.0
    perfect = [t[:, :5].tolist() for t in truths]
    perfect = [np.array([[*b, 1.0] for b in p]) for p in perfect]
    assert average_precision(perfect, truths, 0, 0.5) == 1.0


def test_iou_threshold_matters():
    truths = [np.array([[0, 0, 10, 10, 3]])]
    loose = [np.array([[0, 5, 10, 15, 3, 0.8]])]  # IoU 50/150 = 1/3
    assert average_precision(loose, truths, 3, 0.5) == 0.0
    assert average_precision(loose, truths, 3, 0.1) == 1.0
    wrong_class = [np.array([[0, 0, 10, 10, 2, 0.8]])]
    assert average_precision(wrong_class, truths, 3, 0.1) == 0.0


def test_detection_metrics_report_both_thresholds_and_skip_absent_classes():
    truths = [np.array([[0, 0, 10, 10, 1], [20, 0, 30, 10, 3]]), np.zeros((0, 5))]
    dets = [np.array([[0, 0, 10, 10, 1, 0.9], [20, 5, 30, 15, 3, 0.8]]), np.array([[1, 1, 5, 5, 0, 0.3]])]
    m = detection_metrics(dets, truths)
    assert m["ap50_TC"] == 1.0 and m["ap50_AR"] == 0.0 and m["ap10_AR"] == 1.0
    assert m["ap50_TD"] is None and m["ap50_ETC"] is None  # no true TD or ETC: not in the mean
    assert m["map_50"] == 0.5 and m["map_10"] == 1.0
    assert (m["n_images"], m["n_true_boxes"], m["n_detections"]) == (2, 2, 3)
    assert (m["true_TD"], m["true_TC"], m["true_ETC"], m["true_AR"]) == (0, 1, 0, 1)


@pytest.mark.parametrize("suffix", [".csv", ".npz"])
def test_detection_files_round_trip(tmp_path, suffix):
    dets = [np.array([[1, 2, 5, 9.5, 3, 0.875]], np.float32), np.zeros((0, 6), np.float32),
            np.array([[0, 0, 4, 4, 0, 0.5], [2, 2, 6, 6, 1, 0.25]], np.float32)]
    path = write_detections(tmp_path / f"det{suffix}", [7, 8, 11], dets)
    image, rows = read_detections(path)
    assert image.tolist() == [7, 11, 11]
    np.testing.assert_allclose(rows, np.concatenate(dets), rtol=1e-6)
    assert [p.name for p in tmp_path.iterdir()] == [f"det{suffix}"]
    with pytest.raises(ValueError, match=".npz or .csv"):
        write_detections(tmp_path / "det.txt", [0], dets[:1])


def test_plot_writes_a_png_atomically(tmp_path):
    field = np.random.default_rng(0).random((24, 36)) * 60
    path = plot_detections(tmp_path / "f.png", field, np.array([[2, 3, 8, 11, 1]]),
                           np.array([[2, 4, 8, 12, 1, 0.9], [10, 10, 12, 12, 0, 0.1]]), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["f.png"]


@pytest.mark.parametrize("suffix", [".csv", ".npz"])
def test_empty_detection_files(tmp_path, suffix):
    image, rows = read_detections(write_detections(tmp_path / f"none{suffix}", [0, 1], [np.zeros((0, 6))] * 2))
    assert image.shape == (0,) and rows.shape == (0, 6)
