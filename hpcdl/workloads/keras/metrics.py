"""The generic workload's figures of merit, from predictions and targets (numpy only).

Classification: weighted cross-entropy, accuracy, the confusion matrix, and for two classes the
weighted ROC AUC (:mod:`hpcdl.workloads.hep.metrics`' curve). Regression: mean squared error,
mean absolute error and R² of each output, weighted, and their plain mean over the outputs. An
output's R² compares its errors with its own weighted mean (scikit-learn's `r2_score` with
`multioutput="uniform_average"` for the mean): one mean over all outputs would count the gaps
between the outputs' means as explained variance.
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
    """`predicted` and `y` (n, k) or (n,); `w` weights (n,). `mse`, `mae` and `r2` are the means over
    the k outputs; with k > 1, `mse_i`, `mae_i` and `r2_i` are output i's own (flat floats, so the
    validation line and `status` carry them too), and `outputs` lists them."""
    p = predicted.reshape(len(y), -1).astype(np.float64)
    t = y.reshape(len(y), -1).astype(np.float64)
    w = w.astype(np.float64)[:, None]
    total = np.sum(w)
    err = p - t
    mse = np.sum(w * err ** 2, axis=0) / total
    mae = np.sum(w * np.abs(err), axis=0) / total
    mean = np.sum(w * t, axis=0) / total
    sst = np.sum(w * (t - mean) ** 2, axis=0)
    sse = np.sum(w * err ** 2, axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        # a constant target has no variance to explain: 1 when it is matched, else 0 (scikit-learn's
        # force_finite), so one constant output does not make the mean undefined
        r2 = np.where(sst > 0, 1.0 - sse / np.where(sst > 0, sst, 1.0), np.where(sse == 0, 1.0, 0.0))
    out: dict[str, Any] = {
        "examples": int(len(y)),
        "loss": float(np.mean(mse)),
        "mse": float(np.mean(mse)),
        "mae": float(np.mean(mae)),
        "r2": float(np.mean(r2)),
    }
    if t.shape[1] > 1:
        for i in range(t.shape[1]):
            out[f"mse_{i}"], out[f"mae_{i}"], out[f"r2_{i}"] = float(mse[i]), float(mae[i]), float(r2[i])
        out["outputs"] = [{"mse": float(a), "mae": float(b), "r2": float(c)} for a, b, c in zip(mse, mae, r2)]
    return out


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
    """One panel per output, each with its own axes and its R² in the panel's title."""
    p = predicted.reshape(len(y), -1)
    t = y.reshape(len(y), -1)
    k = t.shape[1]
    columns = min(k, 3)
    rows = -(-k // columns)
    fig, axes = common.new_figure((4.2 * columns, 3.8 * rows), 120, nrows=rows, ncols=columns)
    axes = np.atleast_1d(axes).reshape(-1)
    r2 = regression(p, t, np.ones(len(t)))
    for i, ax in enumerate(axes):
        if i >= k:
            ax.set_visible(False)
            continue
        ax.scatter(t[:, i], p[:, i], s=4, alpha=0.4)
        lo, hi = float(min(t[:, i].min(), p[:, i].min())), float(max(t[:, i].max(), p[:, i].max()))
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        name = f"output {i}" if k > 1 else "output"
        ax.set_xlabel(f"true ({name})")
        ax.set_ylabel(f"predicted ({name})")
        ax.set_title(f"{name}: R² {r2[f'r2_{i}'] if k > 1 else r2['r2']:.3f}", fontsize=9)
    fig.suptitle(title, fontsize=9)
    return common.save_png(fig, path)


def write_predictions(path: Path, index: np.ndarray, predicted: np.ndarray, y: np.ndarray) -> Path:
    """Per-example predictions (`.npz`: index, prediction, label; no object arrays, so np.load needs
    no pickle), written atomically."""
    from hpcdl.fs.files import atomic_path

    if common.table_format(path, "scores") != "npz":
        raise ValueError(f"scores file of the keras workload must end in .npz, got {path.name!r}")
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, index=index.astype(np.int64), prediction=predicted, label=y)
    return path
