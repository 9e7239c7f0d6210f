"""The box grid codec: boxes to and from the YOLO-style per-cell targets of the detection head
(:mod:`hpcdl.workloads.climate.model`)."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

#: Per-cell training target: objectness, centre offset y, x in the cell (0..1), log(h / cell),
#: log(w / cell), class.
TARGET_CHANNELS = 6


def grid_shape(h: int, w: int, cell: int) -> tuple[int, int]:
    return math.ceil(h / cell), math.ceil(w / cell)


def encode_boxes(boxes: np.ndarray, grid: tuple[int, int], cell: int) -> np.ndarray:
    """Boxes (k, 5) → the per-cell target (gh, gw, 6) of one image.

    The cell holding a box's centre is responsible for it: objectness 1, the centre's offset in the
    cell (0 ≤ ty, tx < 1), log(height / cell), log(width / cell) and the class. If two centres
    fall into one cell the larger box wins (at most one object per cell, as in YOLO v1).
    """
    gh, gw = grid
    t = np.zeros((gh, gw, TARGET_CHANNELS), np.float32)
    b = np.asarray(boxes, np.float32).reshape(-1, 5)
    if not len(b):
        return t
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    for k in np.argsort(area, kind="stable"):  # larger boxes written last win
        y0, x0, y1, x1, c = b[k]
        cy, cx = (y0 + y1) / 2 / cell, (x0 + x1) / 2 / cell
        i, j = min(int(cy), gh - 1), min(int(cx), gw - 1)
        t[i, j] = (1.0, min(cy - i, 1.0), min(cx - j, 1.0), math.log((y1 - y0) / cell),
                   math.log((x1 - x0) / cell), c)
    return t


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.clip(x, -60, 60)))


def decode_grid(out: np.ndarray, cell: int, score_threshold: float = 0.0,
                image_hw: Optional[tuple[int, int]] = None) -> np.ndarray:
    """The detection head's raw output (gh, gw, 5 + C) → candidate boxes (m, 6) float32, rows
    [ymin, xmin, ymax, xmax, class, score], before non-maximum suppression.

    Channels: objectness logit, centre-offset logits (y, x), log-size (h, w), class logits.
    Each cell proposes its box once per class with score = P(object) × P(class | object) at least
    ``score_threshold``; boxes are clipped to ``image_hw`` when given.
    """
    out = np.asarray(out, np.float64)
    gh, gw, ch = out.shape
    ii, jj = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    cy = (ii + _sigmoid(out[..., 1])) * cell
    cx = (jj + _sigmoid(out[..., 2])) * cell
    hh = np.exp(np.clip(out[..., 3], -10, 10)) * cell
    ww = np.exp(np.clip(out[..., 4], -10, 10)) * cell
    logits = out[..., 5:]
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    scores = _sigmoid(out[..., 0])[..., None] * p  # (gh, gw, C)
    box = np.stack([cy - hh / 2, cx - ww / 2, cy + hh / 2, cx + ww / 2], axis=-1)
    if image_hw is not None:
        box[..., [0, 2]] = np.clip(box[..., [0, 2]], 0, image_hw[0])
        box[..., [1, 3]] = np.clip(box[..., [1, 3]], 0, image_hw[1])
    i, j, c = np.nonzero(scores >= score_threshold)
    rows = np.concatenate([box[i, j], c[:, None].astype(np.float64), scores[i, j, c][:, None]], axis=1)
    return rows.astype(np.float32)
