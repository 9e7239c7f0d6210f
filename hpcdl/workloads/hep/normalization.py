"""The HEP images' normalisation, as the paper's code does it: each channel divided by its maximum
over the training file (:func:`channel_max`), and per-class mean event weights
(:func:`class_weight_means`) to balance the classes in training. :class:`Normalization` carries
both and round-trips through JSON (:meth:`Normalization.to_dict` / :meth:`Normalization.from_dict`),
so the numbers travel with the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Tuple

import numpy as np

from hpcdl.workloads.hep.data import HepReader, event_chunks
from hpcdl.workloads.stream import check_chunk
from hpcdl.workloads.hep.layout import DEFAULT_CHUNK, DataError, as_hep

def channel_max(path, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Each channel's maximum over the whole file, as float64 ``(3,)``, streaming ``chunk`` events."""
    chunk = check_chunk(chunk)
    hep = as_hep(path)
    out = np.full(3, -np.inf)
    with HepReader(hep) as reader:
        for lo, hi in event_chunks(0, hep.n_events, chunk):
            x = reader.read_images(lo, hi)
            np.maximum(out, x.max(axis=(0, 1, 2)), out=out)
    return out


def class_weight_means(path, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """Mean event weight per class, float64 ``(2,)`` indexed by label: ``[background, signal]``.

    A trainer balances the classes with ``w / means[y]``: each class then has mean weight 1, so
    both contribute equally however different their cross-sections. A class absent from the file
    gets 1.0 (no event will use it). Reads labels and weights only, ``chunk`` events at a time.
    """
    chunk = check_chunk(chunk)
    hep = as_hep(path)
    sums = np.zeros(2)
    counts = np.zeros(2)
    with HepReader(hep) as reader:
        for lo, hi in event_chunks(0, hep.n_events, chunk):
            y = reader.read_labels(lo, hi)
            w = reader.read_weights(lo, hi).astype(np.float64)
            sums += np.bincount(y, weights=w, minlength=2)
            counts += np.bincount(y, minlength=2)
    means = np.ones(2)
    present = counts > 0
    means[present] = sums[present] / counts[present]
    if np.any(means[present] <= 0) or not np.all(np.isfinite(means)):
        raise DataError.at(hep.path, f"class mean weights must be positive and finite, got {means.tolist()}")
    return means


def _positive_finite(name: str, values, n: int) -> Tuple[float, ...]:
    try:
        vals = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {n} numbers, got {values!r}") from None
    if len(vals) != n:
        raise ValueError(f"{name} must have {n} entries, got {len(vals)}")
    if not all(math.isfinite(v) for v in vals):
        raise ValueError(f"{name} must be finite, got {vals}")
    return vals


@dataclass(frozen=True)
class Normalization:
    """Per-channel input scales and per-class mean weights, stored with a trained model.

    ``scale``: each channel's training-set maximum (images are divided by it; a scale of zero or
    less, i.e. an all-empty channel, leaves that channel unchanged). ``class_weight_mean``: mean
    event weight of ``[background, signal]`` (see :func:`class_weight_means`).
    """

    scale: Tuple[float, float, float]
    class_weight_mean: Tuple[float, float] = (1.0, 1.0)

    def __post_init__(self):
        object.__setattr__(self, "scale", _positive_finite("scale", self.scale, 3))
        cwm = _positive_finite("class_weight_mean", self.class_weight_mean, 2)
        if min(cwm) <= 0:
            raise ValueError(f"class_weight_mean must be positive, got {cwm}")
        object.__setattr__(self, "class_weight_mean", cwm)

    @classmethod
    def from_file(cls, path, chunk: int = DEFAULT_CHUNK) -> "Normalization":
        """Scales and class means of a (training) file."""
        hep = as_hep(path)
        return cls(
            tuple(channel_max(hep, chunk).tolist()), tuple(class_weight_means(hep, chunk).tolist())
        )

    def divisor(self) -> np.ndarray:
        s = np.asarray(self.scale, dtype=np.float32)
        return np.where(s > 0, s, np.float32(1.0))

    def apply(self, images: np.ndarray, inplace: bool = False) -> np.ndarray:
        """``images`` (``(..., 3)``, channels last) divided by the channel scales, float32."""
        images = np.asarray(images)
        if images.ndim < 1 or images.shape[-1] != 3:
            raise ValueError(f"images must have 3 channels last, got shape {images.shape}")
        if inplace:
            if images.dtype != np.float32:
                raise ValueError(f"inplace normalisation needs float32 images, got {images.dtype}")
            images /= self.divisor()
            return images
        return np.divide(images, self.divisor(), dtype=np.float32)

    def event_weights(self, y, w) -> np.ndarray:
        """Class-balanced training weights ``w / class_weight_mean[y]`` (float32)."""
        y = np.asarray(y).astype(np.int64)
        return (np.asarray(w, dtype=np.float64) / np.asarray(self.class_weight_mean)[y]).astype(
            np.float32
        )

    def to_dict(self) -> dict:
        return {"scale": list(self.scale), "class_weight_mean": list(self.class_weight_mean)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Normalization":
        if not isinstance(d, Mapping) or "scale" not in d:
            raise ValueError(f"normalisation must be a mapping with a 'scale' entry, got {d!r}")
        unknown = set(d) - {"scale", "class_weight_mean"}
        if unknown:
            raise ValueError(f"unknown normalisation entries: {sorted(unknown)}")
        return cls(tuple(d["scale"]), tuple(d.get("class_weight_mean", (1.0, 1.0))))


