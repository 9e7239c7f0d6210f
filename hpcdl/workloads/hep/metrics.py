"""Metrics for the HEP workload: event-weighted ROC, AUC and the comparison with the cut-based selection.

The HEP workload (after Kurth et al., SC17) classifies calorimeter images as signal (RPV SUSY) or
background (QCD). Physics cares about the *weighted* performance: each simulated event carries a
cross-section weight, so an event from a high-cross-section QCD slice counts for more than one from
a low one. The figure of merit of the paper is the classifier's true-positive rate (signal
efficiency) at the false-positive rate (background efficiency) of the standard cut-based analysis
("passSR", the signal-region selection): the CNN beats the physics selection if it keeps more signal
for the same amount of background.

This module is pure numpy (matplotlib only inside :func:`plot_roc`, imported lazily), so it can run
on evaluation nodes without TensorFlow and be tested without a model.

Conventions, shared by every function here:

* ``labels``: 1 / True = signal, 0 / False = background (bool, integer or float arrays holding only
  0 and 1).
* ``scores``: a higher score means "more signal-like"; an event is *selected* by threshold ``t``
  when ``score >= t``. Scores must be finite (a NaN would sort arbitrarily and silently corrupt the
  curve).
* ``weights``: ``None`` means every event has weight 1. Weights must be finite and **non-negative**.
  Negative weights (NLO generators) are rejected on purpose: with them the cumulative background and
  signal sums are no longer monotone, so "FPR" and "TPR" stop being fractions in [0, 1], the ROC is
  not a curve any more and "the largest TPR with FPR <= x" has no meaning. The RPV-SUSY/QCD samples
  of this workload are leading-order Pythia samples with non-negative cross-section weights; a
  sample with negative weights needs an explicit physics decision (e.g. dropping or reweighting
  them) before it comes here, not a silent convention. Zero weights are allowed (the event then
  contributes nothing), but each class must have a positive total weight.
* Every bad input raises :class:`ValueError` with a message naming the argument.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from hpcdl.fs.files import atomic_path
from hpcdl.workloads.common import csv_lines, new_figure, save_png, table_format

__all__ = [
    "HepMetrics",
    "evaluate_scores",
    "plot_roc",
    "read_scores",
    "roc_auc",
    "roc_curve",
    "selection_point",
    "tpr_at_fpr",
    "write_scores",
]


# --------------------------------------------------------------------------------------------------
# input validation


def _as_1d(name: str, values, n: Optional[int]) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(
            f"{name} must be a 1-D array, got shape {arr.shape}"
            + (" (for a model output of shape (N, 1) pass out[:, 0])" if arr.ndim == 2 else "")
        )
    if arr.size == 0:
        raise ValueError(f"{name} is empty: need at least one event")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"length mismatch: {name} has {arr.shape[0]} entries, scores has {n}")
    return arr


def _as_float(name: str, values, n: Optional[int]) -> np.ndarray:
    arr = _as_1d(name, values, n)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise ValueError(f"{name} must be a real numeric array, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    bad = ~np.isfinite(arr)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name} must be finite: {int(bad.sum())} non-finite value(s), first at index {i} ({arr[i]})")
    return arr


def _as_bool(name: str, values, n: Optional[int]) -> np.ndarray:
    """Accept bool arrays, or numeric arrays holding only 0 and 1, as a bool array."""
    arr = _as_1d(name, values, n)
    if arr.dtype == bool:
        return arr
    if not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
        raise ValueError(f"{name} must be bool or 0/1 numeric, got dtype {arr.dtype}")
    is_one = arr == 1
    bad = ~(is_one | (arr == 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name} must hold only 0 and 1 (or bool): found {arr[i].item()!r} at index {i}")
    return is_one


def _as_weights(weights, n: int) -> np.ndarray:
    if weights is None:
        return np.ones(n, dtype=np.float64)
    w = _as_float("weights", weights, n)
    neg = w < 0
    if neg.any():
        i = int(np.flatnonzero(neg)[0])
        raise ValueError(
            f"weights must be non-negative: {int(neg.sum())} negative weight(s), first at index {i} ({w[i]}); "
            "negative (NLO) weights make the ROC non-monotone and are not supported (see module docstring)"
        )
    return w


def _validate(scores, labels, weights, *, need_both_classes: bool = True):
    s = _as_float("scores", scores, None)
    y = _as_bool("labels", labels, s.shape[0])
    w = _as_weights(weights, s.shape[0])
    if need_both_classes:
        _check_both_classes(y, w)
    return s, y, w


def _check_both_classes(y: np.ndarray, w: np.ndarray) -> None:
    n_sig = int(y.sum())
    n_bkg = int(y.size - n_sig)
    if n_sig == 0 or n_bkg == 0:
        raise ValueError(
            f"need both classes for a ROC/AUC: {n_sig} signal and {n_bkg} background event(s); "
            "the true- or false-positive rate is undefined"
        )
    for name, mask in (("signal", y), ("background", ~y)):
        if not w[mask].sum() > 0:
            raise ValueError(f"the total {name} weight is zero: its rate is undefined")


# --------------------------------------------------------------------------------------------------
# ROC


def _roc(s: np.ndarray, y: np.ndarray, w: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ROC of validated arrays; see :func:`roc_curve`."""
    order = np.argsort(s, kind="stable")[::-1]
    s_sorted = s[order]
    cum_sig = np.cumsum(np.where(y, w, 0.0)[order])
    cum_bkg = np.cumsum(np.where(y, 0.0, w)[order])
    # The last position of each run of equal scores: one ROC point per distinct score, so tied events
    # enter together (a threshold cannot separate them).
    ends = np.append(np.flatnonzero(np.diff(s_sorted) != 0), s_sorted.size - 1)
    # Divide by the last cumulative sum (not by a separately computed total) so that the curve ends at
    # exactly (1, 1); the sums of non-negative terms are non-decreasing, so the rates are too.
    tpr = np.concatenate(([0.0], cum_sig[ends] / cum_sig[-1]))
    fpr = np.concatenate(([0.0], cum_bkg[ends] / cum_bkg[-1]))
    thresholds = np.concatenate(([np.inf], s_sorted[ends]))
    return fpr, tpr, thresholds


def _auc(fpr: np.ndarray, tpr: np.ndarray) -> float:
    area = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1])) / 2.0)
    return min(1.0, max(0.0, area))  # only rounding can leave [0, 1]


def roc_curve(scores, labels, weights=None) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Event-weighted ROC curve.

    Returns ``(fpr, tpr, thresholds)``, three float arrays of equal length ``k + 1`` for ``k``
    distinct scores. Point ``i`` is the selection ``score >= thresholds[i]``:
    ``tpr[i]`` is the selected fraction of the signal weight, ``fpr[i]`` of the background weight.
    ``thresholds`` is strictly decreasing: ``thresholds[0] = +inf`` (nothing selected, the point
    (0, 0)), then every distinct score from the highest to the lowest (the last selects everything,
    the point (1, 1) exactly). Events with equal scores form a single point, since no threshold can
    separate them; ``fpr`` and ``tpr`` are non-decreasing. No points are dropped, so collinear and
    repeated points (e.g. from zero-weight events) may occur.
    """
    return _roc(*_validate(scores, labels, weights))


def roc_auc(scores, labels, weights=None) -> float:
    """Area under the event-weighted ROC curve (trapezoid rule on :func:`roc_curve`).

    Because tied scores form one point joined by a straight segment, this equals the weighted
    Mann-Whitney statistic: the probability that a signal event outranks a background event,
    each drawn with probability proportional to its weight, with ties counted one half.
    """
    return _auc(*_roc(*_validate(scores, labels, weights))[:2])


def selection_point(passed, labels, weights=None) -> Tuple[float, float]:
    """``(fpr, tpr)`` of a cut-based selection (e.g. the analysis' signal-region flag ``passSR``).

    ``passed`` is a bool (or 0/1) array, one entry per event; the rates are the selected fractions of
    the background and signal weight, comparable with the points of :func:`roc_curve`.
    """
    p = _as_bool("passed", passed, None)
    y = _as_bool("labels", labels, p.shape[0])
    w = _as_weights(weights, p.shape[0])
    _check_both_classes(y, w)
    return _selection_point(p, y, w)


def _selection_point(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> Tuple[float, float]:
    fpr = float(w[p & ~y].sum() / w[~y].sum())
    tpr = float(w[p & y].sum() / w[y].sum())
    return fpr, tpr


def _check_target(target_fpr) -> float:
    try:
        t = float(target_fpr)
    except (TypeError, ValueError):
        raise ValueError(f"target_fpr must be a number in [0, 1], got {target_fpr!r}") from None
    if not 0.0 <= t <= 1.0:  # also rejects NaN
        raise ValueError(f"target_fpr must be in [0, 1], got {target_fpr!r}")
    return t


def _operating_point(fpr, tpr, thresholds, target: float) -> int:
    # fpr is non-decreasing and fpr[0] == 0 <= target, so this is the last point with fpr <= target.
    return int(np.searchsorted(fpr, target, side="right")) - 1


def tpr_at_fpr(scores, labels, weights, target_fpr: float) -> Tuple[float, float]:
    """The classifier's TPR at a background efficiency of at most ``target_fpr``.

    Returns ``(tpr, threshold)`` of the ROC point (see :func:`roc_curve`) with the lowest threshold,
    i.e. the loosest cut ``score >= threshold``, whose FPR satisfies ``fpr <= target_fpr`` exactly
    (a float comparison, no tolerance). Since the FPR grows as the threshold falls, this is the highest
    TPR the classifier reaches without selecting more background than the target. No interpolation:
    between two ROC points the answer is the lower point, so the result is a cut one can actually
    apply. ``threshold`` is one of the scores, or ``+inf`` (TPR 0) when even the highest-scoring
    events would exceed the target (e.g. ``target_fpr=0`` and a background event scores highest).
    ``weights`` may be ``None`` (unweighted).
    """
    target = _check_target(target_fpr)
    fpr, tpr, thr = _roc(*_validate(scores, labels, weights))
    k = _operating_point(fpr, tpr, thr, target)
    return float(tpr[k]), float(thr[k])


# --------------------------------------------------------------------------------------------------
# summary


@dataclasses.dataclass(frozen=True)
class HepMetrics:
    """Summary of a classifier's scores on the HEP test set.

    ``selection_*`` describe the cut-based selection (``passSR``), weighted; ``cnn_*`` and
    ``threshold`` the CNN operating point of :func:`tpr_at_fpr` at the selection's FPR (so
    ``cnn_fpr_at_threshold <= selection_fpr``, usually slightly below it). All five are ``None`` when
    no selection was given. ``threshold`` may be ``+inf``; :meth:`to_dict` writes it as ``None``.
    """

    n_events: int
    n_signal: int
    n_background: int
    auc_weighted: float
    auc_unweighted: float
    selection_fpr: Optional[float] = None
    selection_tpr: Optional[float] = None
    cnn_tpr_at_selection_fpr: Optional[float] = None
    cnn_fpr_at_threshold: Optional[float] = None
    threshold: Optional[float] = None

    def to_dict(self) -> dict:
        """Plain dict for ``json.dumps`` (also with ``allow_nan=False``): non-finite floats become ``None``."""
        out = {}
        for key, value in dataclasses.asdict(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            out[key] = value
        return out


def evaluate_scores(scores, labels, weights=None, passed_sr=None) -> HepMetrics:
    """Compute :class:`HepMetrics`: weighted and unweighted AUC, and, when the selection flag
    ``passed_sr`` is given, the selection's weighted ``(fpr, tpr)`` and the CNN's TPR at that FPR.
    """
    s, y, w = _validate(scores, labels, weights)
    fpr, tpr, thr = _roc(s, y, w)
    ones = np.ones_like(w)
    n_signal = int(y.sum())
    fields = dict(
        n_events=int(s.size),
        n_signal=n_signal,
        n_background=int(s.size - n_signal),
        auc_weighted=_auc(fpr, tpr),
        auc_unweighted=_auc(*_roc(s, y, ones)[:2]) if weights is not None else _auc(fpr, tpr),
    )
    if passed_sr is not None:
        p = _as_bool("passed_sr", passed_sr, s.size)
        sel_fpr, sel_tpr = _selection_point(p, y, w)
        k = _operating_point(fpr, tpr, thr, sel_fpr)
        fields.update(
            selection_fpr=sel_fpr,
            selection_tpr=sel_tpr,
            cnn_tpr_at_selection_fpr=float(tpr[k]),
            cnn_fpr_at_threshold=float(fpr[k]),
            threshold=float(thr[k]),
        )
    return HepMetrics(**fields)


# --------------------------------------------------------------------------------------------------
# files


def plot_roc(
    path,
    scores,
    labels,
    weights=None,
    selection: Optional[Tuple[float, float]] = None,
    title: str = "HEP: RPV SUSY vs QCD, weighted ROC",
) -> Path:
    """Write a PNG of the weighted ROC curve and return its path.

    The FPR (background efficiency) axis is logarithmic, as physicists show it, because the
    interesting operating points have FPRs of 1e-4 to 1e-2; the point (0, 0) cannot be drawn on it
    and is left out. The legend gives the weighted AUC. If ``selection=(fpr, tpr)`` is given (from
    :func:`selection_point`), it is marked, together with the CNN operating point of
    :func:`tpr_at_fpr` at the selection's FPR. The file is written to a temporary name and renamed,
    so no half-written PNG is ever left at ``path``.
    """
    path = Path(path)
    s, y, w = _validate(scores, labels, weights)
    fpr, tpr, thr = _roc(s, y, w)
    auc = _auc(fpr, tpr)

    fig, ax = new_figure((6.4, 5.2), 120)  # matplotlib is imported only there
    pos = fpr > 0
    min_fpr = float(fpr[pos].min())
    # Start at the decade of the smallest non-zero FPR, but not below 1e-6: a few tiny-weight
    # background events would otherwise stretch the axis over decades with nothing to see.
    x_lo = max(10 ** math.floor(math.log10(min_fpr)), 1e-6)
    ax.plot(fpr[pos], tpr[pos], color="C0", lw=1.8, label=f"CNN (weighted AUC = {auc:.4f})")
    diag = np.logspace(math.log10(x_lo), 0, 200)
    ax.plot(diag, diag, color="0.6", lw=1, ls=":", label="random guess")

    if selection is not None:
        x_lo = _mark_selection(ax, fpr, tpr, thr, selection, x_lo)

    ax.set_xscale("log")
    ax.set_xlim(x_lo, 1.0)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("false positive rate (weighted background efficiency)")
    ax.set_ylabel("true positive rate (weighted signal efficiency)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return save_png(fig, path)


def _mark_selection(ax, fpr, tpr, thr, selection: Tuple[float, float], x_lo: float) -> float:
    """Mark the physics selection and the CNN's operating point at its FPR; the axis' new left end."""
    sel_fpr, sel_tpr = (float(v) for v in selection)
    if not (0.0 <= sel_fpr <= 1.0 and 0.0 <= sel_tpr <= 1.0):
        raise ValueError(f"selection must be (fpr, tpr) in [0, 1]^2, got {selection!r}")
    k = _operating_point(fpr, tpr, thr, sel_fpr)
    cnn_fpr, cnn_tpr = float(fpr[k]), float(tpr[k])
    if sel_fpr > 0:
        ax.axvline(sel_fpr, color="0.75", lw=0.8, ls="--", zorder=0)
        ax.plot([sel_fpr], [sel_tpr], "s", color="C3", ms=8,
                label=f"selection (passSR): FPR={sel_fpr:.3g}, TPR={sel_tpr:.3f}")
        ax.annotate("selection", (sel_fpr, sel_tpr), xytext=(8, -14), textcoords="offset points",
                    color="C3", fontsize=9)
    else:
        ax.plot([], [], "s", color="C3", label=f"selection: FPR=0 (off the log axis), TPR={sel_tpr:.3f}")
    if cnn_fpr > 0:
        ax.plot([cnn_fpr], [cnn_tpr], "o", color="C2", ms=8,
                label=f"CNN at FPR \u2264 {sel_fpr:.3g}: TPR={cnn_tpr:.3f}")
        ax.annotate("CNN", (cnn_fpr, cnn_tpr), xytext=(-30, 6), textcoords="offset points",
                    color="C2", fontsize=9)
    else:
        ax.plot([], [], "o", color="C2", label=f"CNN at FPR=0: TPR={cnn_tpr:.3f} (off the log axis)")
    return min(x_lo, 10 ** math.floor(math.log10(sel_fpr))) if sel_fpr > 0 else x_lo


_CSV_HEADER = "index,score,label,weight"


def write_scores(path, index, scores, labels, weights=None) -> Path:
    """Write per-event scores, for later re-evaluation without the model, and return the path.

    The format follows the suffix: ``.npz`` (``np.savez`` with arrays ``index`` int64,
    ``score`` float64, ``label`` int8, ``weight`` float64; no object arrays, so ``np.load`` needs no
    pickle) or ``.csv`` (header ``index,score,label,weight``, floats written with 17 significant
    digits so they round-trip exactly). Any other suffix raises ``ValueError``. ``index`` is the
    integer event index in the source file; ``weights=None`` writes weight 1. One class alone is
    fine here (e.g. one shard of a test set). The write is atomic (temporary file + rename).
    """
    path = Path(path)
    fmt = table_format(path, "scores")
    idx = _as_1d("index", index, None)
    if not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"index must be an integer array, got dtype {idx.dtype}")
    s, y, w = _validate(scores, labels, weights, need_both_classes=False)
    if s.size != idx.size:
        raise ValueError(f"length mismatch: index has {idx.size} entries, scores has {s.size}")
    idx = idx.astype(np.int64)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            if fmt == "npz":
                np.savez(f, index=idx, score=s, label=y.astype(np.int8), weight=w)
            else:
                table = np.empty(s.size, dtype=[("i", np.int64), ("s", np.float64), ("l", np.int8), ("w", np.float64)])
                table["i"], table["s"], table["l"], table["w"] = idx, s, y, w
                np.savetxt(f, table, fmt=["%d", "%.17g", "%d", "%.17g"], delimiter=",",
                           header=_CSV_HEADER, comments="")
    return path


def read_scores(path) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read a file of :func:`write_scores` back as ``(index, scores, labels, weights)``.

    ``labels`` comes back as a bool array (True = signal).
    """
    path = Path(path)
    fmt = table_format(path, "scores")
    if fmt == "npz":
        with np.load(path, allow_pickle=False) as data:
            missing = {"index", "score", "label", "weight"} - set(data.files)
            if missing:
                raise ValueError(f"{path}: not a scores file, missing array(s) {sorted(missing)}")
            idx, s, lab, w = data["index"], data["score"], data["label"], data["weight"]
    else:
        lines = csv_lines(path, _CSV_HEADER)
        kw = dict(delimiter=",", ndmin=1)
        idx = np.loadtxt(lines, usecols=0, dtype=np.int64, **kw)
        lab = np.loadtxt(lines, usecols=2, dtype=np.int64, **kw)
        s = np.loadtxt(lines, usecols=1, dtype=np.float64, **kw)
        w = np.loadtxt(lines, usecols=3, dtype=np.float64, **kw)
    return idx.astype(np.int64), s.astype(np.float64), lab.astype(bool), w.astype(np.float64)
