"""Detection metrics for the climate workload: IoU, non-maximum suppression, average precision,
box plots and detection files.

Boxes are rows ``[ymin, xmin, ymax, xmax]`` in pixel edges (area ``(ymax − ymin)(xmax − xmin)``);
detections add ``class`` and ``score`` columns. Average precision is PASCAL VOC's (2010+) all-point
interpolated area under the precision-recall curve: per class, detections over all images are
ranked by score, each is a true positive if it overlaps a not yet matched true box of its class in
its image with IoU ≥ the threshold (greedy, best IoU first), the precision envelope is made
monotone and integrated over recall. Racah et al. report mAP at IoU 0.5 and at 0.1 (a lenient
overlap, since the labels' extents are themselves heuristic); both are computed here. A class
with no true box in the evaluated images has no AP (None) and is left out of the mean.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from hpcdl.workloads.climate.data import CLASSES, NUM_CLASSES
from hpcdl.fs.files import atomic_path
from hpcdl.workloads.common import csv_lines, new_figure, save_png, table_format

__all__ = ["iou", "nms", "average_precision", "detection_metrics", "plot_detections",
           "write_detections", "read_detections"]


def iou(a, b) -> np.ndarray:
    """Pairwise IoU of boxes ``a`` (n, ≥4) and ``b`` (m, ≥4): an (n, m) float64 array."""
    a = np.atleast_2d(np.asarray(a, np.float64))[:, :4]
    b = np.atleast_2d(np.asarray(b, np.float64))[:, :4]
    y0 = np.maximum(a[:, None, 0], b[None, :, 0])
    x0 = np.maximum(a[:, None, 1], b[None, :, 1])
    y1 = np.minimum(a[:, None, 2], b[None, :, 2])
    x1 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(y1 - y0, 0, None) * np.clip(x1 - x0, 0, None)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def nms(detections: np.ndarray, iou_threshold: float = 0.3, max_detections: Optional[int] = None) -> np.ndarray:
    """Per-class greedy non-maximum suppression of rows [ymin, xmin, ymax, xmax, class, score]:
    the highest-scoring box is kept and boxes of its class overlapping it by more than
    ``iou_threshold`` are dropped, repeatedly. Returns the kept rows by decreasing score (at most
    ``max_detections``)."""
    d = np.asarray(detections, np.float32).reshape(-1, 6)
    keep = []
    for c in np.unique(d[:, 4]):
        rows = d[d[:, 4] == c]
        rows = rows[np.argsort(-rows[:, 5], kind="stable")]
        while len(rows):
            keep.append(rows[0])
            if len(rows) == 1:
                break
            rest = rows[1:]
            rows = rest[iou(rows[:1], rest)[0] <= iou_threshold]
    out = np.asarray(keep, np.float32).reshape(-1, 6)
    out = out[np.argsort(-out[:, 5], kind="stable")]
    return out if max_detections is None else out[:max_detections]


def average_precision(detections: Sequence[np.ndarray], truths: Sequence[np.ndarray], cls: int,
                      iou_threshold: float = 0.5) -> Optional[float]:
    """AP of class ``cls`` over images: ``detections[i]`` (k, 6) and ``truths[i]`` (t, 5) of image i.

    None if no image has a true box of the class; 0 if it has some but nothing was detected.
    """
    if len(detections) != len(truths):
        raise ValueError(f"{len(detections)} detection arrays for {len(truths)} images")
    n_true = 0
    ranked = []  # (score, image, box)
    gts = []
    for i, (det, gt) in enumerate(zip(detections, truths)):
        gt = np.asarray(gt, np.float64).reshape(-1, 5)
        gt = gt[gt[:, 4] == cls]
        gts.append(gt)
        n_true += len(gt)
        det = np.asarray(det, np.float64).reshape(-1, 6)
        for row in det[det[:, 4] == cls]:
            ranked.append((row[5], i, row[:4]))
    if n_true == 0:
        return None
    if not ranked:
        return 0.0
    ranked.sort(key=lambda r: -r[0])
    matched = [np.zeros(len(g), bool) for g in gts]
    tp = np.zeros(len(ranked))
    for k, (_score, i, box) in enumerate(ranked):
        if not len(gts[i]):
            continue
        overlaps = iou(box[None], gts[i])[0]
        overlaps[matched[i]] = -1.0
        j = int(np.argmax(overlaps))
        if overlaps[j] >= iou_threshold:
            matched[i][j] = True
            tp[k] = 1.0
    ctp = np.cumsum(tp)
    recall = ctp / n_true
    precision = ctp / np.arange(1, len(ranked) + 1)
    r = np.concatenate([[0.0], recall, [1.0]])
    p = np.concatenate([[0.0], precision, [0.0]])
    p = np.maximum.accumulate(p[::-1])[::-1]
    steps = np.flatnonzero(r[1:] != r[:-1]) + 1
    return float(np.sum((r[steps] - r[steps - 1]) * p[steps]))


def detection_metrics(detections: Sequence[np.ndarray], truths: Sequence[np.ndarray],
                      thresholds: Sequence[float] = (0.5, 0.1)) -> dict:
    """mAP and per-class AP at each IoU threshold, plus counts: a flat JSON-able dict.

    Keys: ``map_50``, ``ap50_TD`` … (``map_10``, ``ap10_TD`` … for 0.1), ``n_images``,
    ``n_true_boxes``, ``n_detections``, ``true_TD`` … (true boxes per class).
    """
    out: dict = {"n_images": len(truths)}
    for t in thresholds:
        tag = f"{round(t * 100):02d}"
        aps = {}
        for c, name in enumerate(CLASSES):
            aps[name] = average_precision(detections, truths, c, t)
            out[f"ap{tag}_{name}"] = aps[name]
        present = [v for v in aps.values() if v is not None]
        out[f"map_{tag}"] = float(np.mean(present)) if present else None
    allt = np.concatenate([np.asarray(g, np.float32).reshape(-1, 5) for g in truths]) if truths else np.zeros((0, 5))
    out["n_true_boxes"] = int(len(allt))
    out["n_detections"] = int(sum(len(d) for d in detections))
    for c, name in enumerate(CLASSES):
        out[f"true_{name}"] = int((allt[:, 4] == c).sum())
    return out


# --------------------------------------------------------------------------------------------------
# files


_COLOURS = ("#00e5ff", "#ff3030", "#ff40ff", "#ffa000")  # TD, TC, ETC, AR


def plot_detections(path, field: np.ndarray, truth: np.ndarray, detections: np.ndarray,
                    title: str = "", min_score: float = 0.3, label: str = "TMQ (kg m$^{-2}$)") -> Path:
    """Write a PNG of ``field`` (h, w) — row 0 at the bottom (south) — with true boxes (solid) and
    detections with score ≥ ``min_score`` (dashed, labelled with class and score). Atomic write."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    path = Path(path)
    h, w = field.shape
    fig, ax = new_figure((8.0, 8.0 * h / w + 1.2), 110)
    im = ax.imshow(field, origin="lower", cmap="viridis", extent=(0, w, 0, h), interpolation="nearest")
    fig.colorbar(im, ax=ax, label=label, fraction=0.03, pad=0.02)
    for y0, x0, y1, x1, c in np.asarray(truth, np.float64).reshape(-1, 5):
        ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, lw=1.8, ec=_COLOURS[int(c)]))
    for y0, x0, y1, x1, c, s in np.asarray(detections, np.float64).reshape(-1, 6):
        if s < min_score:
            continue
        ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, lw=1.2, ls="--", ec=_COLOURS[int(c)]))
        ax.text(x0, min(y1, h) + 0.5, f"{CLASSES[int(c)]} {s:.2f}", color=_COLOURS[int(c)], fontsize=7,
                va="bottom", clip_on=True)
    handles = [Line2D([], [], color=_COLOURS[c], lw=2, label=CLASSES[c]) for c in range(NUM_CLASSES)]
    handles += [Line2D([], [], color="0.3", lw=1.8, label="true"),
                Line2D([], [], color="0.3", lw=1.2, ls="--", label=f"predicted (score ≥ {min_score:g})")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=6, fontsize=7, frameon=False)
    ax.set_xlim(0, w)
    ax.set_ylim(0, h)
    ax.set_xlabel("x (longitude pixels)")
    ax.set_ylabel("y (latitude pixels)")
    if title:
        ax.set_title(title, fontsize=9)
    return save_png(fig, path, bbox_inches="tight")


_CSV_HEADER = "image,ymin,xmin,ymax,xmax,class,score"


def write_detections(path, images: Sequence[int], detections: Sequence[np.ndarray]) -> Path:
    """Write detections (after NMS) for re-analysis without the model; atomic.

    ``.npz``: arrays ``image`` int64 (file index of the image), ``box`` float32 (n, 4)
    [ymin, xmin, ymax, xmax] in the evaluated (preprocessed) pixels, ``class`` int8, ``score``
    float32. ``.csv``: header ``image,ymin,xmin,ymax,xmax,class,score``, one detection per line.
    """
    path = Path(path)
    fmt = table_format(path, "detections")
    if len(images) != len(detections):
        raise ValueError(f"{len(images)} image indices for {len(detections)} detection arrays")
    rows = [np.asarray(d, np.float32).reshape(-1, 6) for d in detections]
    image = np.concatenate([np.full(len(r), int(i), np.int64) for i, r in zip(images, rows)]) if rows else np.zeros(0, np.int64)
    table = np.concatenate(rows) if rows else np.zeros((0, 6), np.float32)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            if fmt == "npz":
                np.savez(f, image=image, box=table[:, :4], **{"class": table[:, 4].astype(np.int8)},
                         score=table[:, 5])
            else:
                f.write((_CSV_HEADER + "\n").encode())
                for i, r in zip(image, table):
                    f.write(f"{i},{r[0]:.6g},{r[1]:.6g},{r[2]:.6g},{r[3]:.6g},{int(r[4])},{r[5]:.9g}\n".encode())
    return path


def read_detections(path) -> tuple[np.ndarray, np.ndarray]:
    """Read a :func:`write_detections` file back as ``(image (n,), rows (n, 6))``."""
    path = Path(path)
    if table_format(path, "detections") == "npz":
        with np.load(path, allow_pickle=False) as d:
            rows = np.concatenate([d["box"], d["class"][:, None].astype(np.float32), d["score"][:, None]], axis=1)
            return d["image"].astype(np.int64), rows.astype(np.float32)
    lines = csv_lines(path, _CSV_HEADER)
    table = np.loadtxt(lines, delimiter=",", ndmin=2, dtype=np.float64).reshape(-1, 7) if lines else np.zeros((0, 7))
    return table[:, 0].astype(np.int64), table[:, 1:].astype(np.float32)
