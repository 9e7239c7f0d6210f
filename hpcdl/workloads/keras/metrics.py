"""The generic workload's figures of merit, from predictions and targets (numpy only).

Classification: weighted cross-entropy, accuracy, the confusion matrix, and for two classes the
weighted ROC AUC (:mod:`hpcdl.workloads.hep.metrics`' curve). Regression: mean squared error,
mean absolute error and R² (1 - SSE / SST, over all target values), weighted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.workloads import common


def classification(probabilities: np.ndarray, y: np.ndarray, w: np.ndarray, classes: int) -> dict[str, Any]:
    """`probabilities` (n, classes); `y` class numbers; `w` weights."""
    from hpcdl.workloads.hep import metrics as roc

    p = np.clip(probabilities.astype(np.float64), 1e-12, 1.0)
    w = w.astype(np.float64)
    predicted = np.argmax(p, axis=1)
    out: dict[str, Any] = {
        "examples": int(len(y)),
        "loss": float(-np.sum(w * np.log(p[np.arange(len(y)), y])) / np.sum(w)),
        "accuracy": float(np.sum(w * (predicted == y)) / np.sum(w)),
    }
    if classes == 2 and len(np.unique(y)) == 2:
        out["auc"] = roc.roc_auc(p[:, 1], y, w)
    confusion = np.zeros((classes, classes), np.int64)
    np.add.at(confusion, (y, predicted), 1)
    out["confusion_matrix"] = confusion.tolist()  # rows: true class, columns: predicted
    return out


def regression(predicted: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, Any]:
    """`predicted` and `y` (n, k) or (n,); `w` weights (n,)."""
    p = predicted.reshape(len(y), -1).astype(np.float64)
    t = y.reshape(len(y), -1).astype(np.float64)
    w = w.astype(np.float64)[:, None] * np.ones_like(t)
    err = p - t
    mean = np.sum(w * t) / np.sum(w)
    sst = np.sum(w * (t - mean) ** 2)
    return {
        "examples": int(len(y)),
        "loss": float(np.sum(w * err ** 2) / np.sum(w)),
        "mse": float(np.sum(w * err ** 2) / np.sum(w)),
        "mae": float(np.sum(w * np.abs(err)) / np.sum(w)),
        "r2": float(1.0 - np.sum(w * err ** 2) / sst) if sst > 0 else float("nan"),
    }


def plot_confusion(path: Path, confusion: list, title: str) -> Path:
    fig, ax = common.new_figure((4.8, 4.2), 120)
    m = np.asarray(confusion)
    ax.imshow(m, cmap="Blues")
    for (i, j), v in np.ndenumerate(m):
        ax.text(j, i, str(v), ha="center", va="center", fontsize=8,
                color="white" if v > m.max() / 2 else "black")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_xticks(range(len(m)))
    ax.set_yticks(range(len(m)))
    ax.set_title(title, fontsize=9)
    return common.save_png(fig, path)


def plot_predicted_vs_true(path: Path, predicted: np.ndarray, y: np.ndarray, title: str) -> Path:
    fig, ax = common.new_figure((4.8, 4.2), 120)
    p, t = predicted.reshape(-1), y.reshape(-1)
    ax.scatter(t, p, s=4, alpha=0.4)
    lo, hi = float(min(t.min(), p.min())), float(max(t.max(), p.max()))
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
    ax.set_xlabel("true")
    ax.set_ylabel("predicted")
    ax.set_title(title, fontsize=9)
    return common.save_png(fig, path)


def write_predictions(path: Path, index: np.ndarray, predicted: np.ndarray, y: np.ndarray) -> Path:
    """Per-example predictions (`.npz`: index, prediction, label; no object arrays, so np.load needs
    no pickle), written atomically."""
    from hpcdl.files import atomic_path

    if common.table_format(path, "scores") != "npz":
        raise ValueError(f"scores file of the keras workload must end in .npz, got {path.name!r}")
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, index=index.astype(np.int64), prediction=predicted, label=y)
    return path
