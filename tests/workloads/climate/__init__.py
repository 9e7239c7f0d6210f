"""Climate workload tests. `write_ew` writes small files in the published ExtremeWeather layout
directly with h5py (not with the generator), so the reader is tested against the layout itself."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

N_CHANNELS = 16


def channel_values(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """(n, 16, h, w) float32 with a different mean and scale per channel (like PSL vs PRECT)."""
    rng = np.random.default_rng(seed)
    means = np.array([1e-8, 9.6e4, 1.01e5, 5e-3, 219, 250, 20, 274, 275, 3, 2, 0, 0, 100, 1.17e4, 60])
    scales = np.array([5e-8, 9e3, 900, 5e-3, 3, 13, 20, 18, 18, 8, 6, 14, 9, 70, 480, 4])
    x = means[None, :, None, None] + scales[None, :, None, None] * rng.standard_normal((n, N_CHANNELS, h, w))
    return x.astype(np.float32)


def write_ew(path: Path, boxes_per_image, h: int = 16, w: int = 24, labelled=None, seed: int = 0,
             max_boxes: int = 15, images=None, box_dtype=np.int32) -> Path:
    """An ExtremeWeather-layout file: `boxes_per_image` is a list (one entry per image) of lists of
    [ymin, xmin, ymax, xmax, class]; rows are padded with −1 to `max_boxes`."""
    n = len(boxes_per_image)
    boxes = np.full((n, max_boxes, 5), -1, box_dtype)
    for i, bs in enumerate(boxes_per_image):
        for k, b in enumerate(bs):
            boxes[i, k] = b
    with h5py.File(path, "w") as f:
        f["images"] = channel_values(n, h, w, seed) if images is None else images
        f["boxes"] = boxes
        if labelled is not None:
            f["labelled"] = np.asarray(labelled, bool)
    return path
