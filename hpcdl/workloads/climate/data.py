"""Streaming reader for ExtremeWeather climate files (HDF5), normalisation, and the box grid codec.

Layout (Racah et al., "ExtremeWeather", NIPS 2017: one file per year; the generator of
:mod:`hpcdl.workloads.climate.generate` writes ``train.h5``, ``val.h5`` and ``test.h5`` in the same
layout)::

    images    float (N, 16, H, W)   channels in the order of CHANNELS below (768×1152 in the real set)
    boxes     numeric (N, K, 5)     K = 15 in the real set; rows [ymin, xmin, ymax, xmax, class],
                                    y along the first spatial axis, in pixels; rows without a box
                                    are all −1; classes 0 TD, 1 TC, 2 ETC, 3 AR
    labelled  bool (N,)             optional: True when the image's boxes are its labels (possibly
                                    none: a labelled image with no event), False for the unlabelled
                                    part of a semi-supervised set (its boxes must be all −1).
                                    Without it, an image is labelled iff it has at least one box
                                    (the published files hold labelled images only).

Box coordinates are pixel edges: a box covers rows ``ymin <= y < ymax`` (so its height is
``ymax - ymin``) and columns ``xmin <= x < xmax``; :func:`open_climate` checks ``0 <= ymin < ymax
<= H`` and likewise for x. Anything else is a :class:`DataError` (a ``ValueError``) naming the file
and the problem in one line.

Memory stays bounded: images are read one at a time with h5py slices (a real image is 56 MB); only
the small ``boxes`` and ``labelled`` datasets are read whole, when a file is opened. Optional
preprocessing (:class:`Preprocess`: a crop, then block-average downsampling) is applied as an
image is read, and its boxes follow. Images come out channels-last (H, W, 16) float32.

Normalisation: per-channel mean and standard deviation over the (preprocessed) training images,
computed in one streaming pass (:func:`compute_stats`, Chan et al.'s pairwise combination in
float64); :class:`Stats` also records the preprocessing, and round-trips through JSON so the
numbers travel with the model and evaluation reads test files exactly as training read its data.

Training batches carry each image's boxes as the detection head's per-cell targets
(:mod:`hpcdl.workloads.climate.boxes`).
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import h5py
import numpy as np

from hpcdl.workloads import common
from hpcdl.workloads.climate.boxes import TARGET_CHANNELS, encode_boxes, grid_shape

__all__ = [
    "CHANNELS", "CLASSES", "NUM_CLASSES", "MAX_BOXES", "DataError", "ClimateFile", "ClimateReader",
    "Preprocess", "Stats", "open_climate", "compute_stats", "iter_train_batches", "iter_eval",
]

CHANNELS = ("PRECT", "PS", "PSL", "QREFHT", "T200", "T500", "TMQ", "TREFHT", "TS", "U850", "UBOT",
            "V850", "VBOT", "Z1000", "Z200", "ZBOT")
CLASSES = ("TD", "TC", "ETC", "AR")  # tropical depression, tropical cyclone, extratropical cyclone, atmospheric river
NUM_CLASSES = len(CLASSES)
MAX_BOXES = 15
TMQ = CHANNELS.index("TMQ")


class DataError(common.DataFileError):
    """A climate data file is missing, unreadable or not in the ExtremeWeather layout."""


_fail = DataError.at
_dataset = partial(common.h5_dataset, DataError, missing_hint="; expected the ExtremeWeather layout")


# --------------------------------------------------------------------------------------------------
# layout validation


@dataclass(frozen=True, eq=False)
class ClimateFile:
    """A validated climate file: shapes, and its (small) box and labelled arrays."""

    path: Path
    n_images: int
    height: int
    width: int
    boxes: np.ndarray = field(repr=False)  # (N, K, 5) float32, −1 rows for no box
    labelled: np.ndarray = field(repr=False)  # (N,) bool

    @property
    def n_labelled(self) -> int:
        return int(self.labelled.sum())

    def valid_boxes(self, i: int) -> np.ndarray:
        """The boxes of image ``i`` (rows that are not padding), (k, 5) float32 in file pixels."""
        b = self.boxes[i]
        return b[b[:, 4] >= 0]


def open_climate(path) -> ClimateFile:
    """Validate the ExtremeWeather layout of ``path``; reads shapes, boxes and labels, no images.

    Raises :class:`DataError` for a missing or non-HDF5 file, missing datasets, images that are
    not (N, 16, H, W), boxes that are not (N, K, 5), classes outside 0..3, box coordinates outside
    the image or empty, non-padding rows after padding ones mixed with −1, unlabelled images with
    boxes, or an empty file.
    """
    path = Path(path)
    with common.open_h5(DataError, path) as f:
        images = _dataset(path, f, "images")
        if images.ndim != 4:
            raise _fail(path, f"images has shape {images.shape}, expected (N, {len(CHANNELS)}, H, W)")
        n, c, h, w = images.shape
        if c != len(CHANNELS):
            raise _fail(path, f"images has {c} channels (shape {images.shape}), expected {len(CHANNELS)}: "
                              f"{', '.join(CHANNELS)}")
        if n == 0:
            raise _fail(path, "holds zero images")
        if h == 0 or w == 0:
            raise _fail(path, f"images have an empty shape {h}×{w}")
        ds = _dataset(path, f, "boxes")
        if ds.ndim != 3 or ds.shape[0] != n or ds.shape[2] != 5 or ds.shape[1] < 1:
            raise _fail(path, f"boxes has shape {ds.shape}, expected ({n}, {MAX_BOXES}, 5) "
                              "rows [ymin, xmin, ymax, xmax, class]")
        boxes = ds[...].astype(np.float32)
        if "labelled" in f:
            lab = _dataset(path, f, "labelled")
            if lab.shape != (n,):
                raise _fail(path, f"labelled has shape {lab.shape}, expected ({n},)")
            labelled = lab[...].astype(bool)
        else:
            labelled = None
    _check_boxes(path, boxes, h, w)
    has_box = (boxes[:, :, 4] >= 0).any(axis=1)
    if labelled is None:
        labelled = has_box
    else:
        bad = np.flatnonzero(~labelled & has_box)
        if bad.size:
            raise _fail(path, f"image {bad[0]} is marked unlabelled but has boxes")
    return ClimateFile(path, n, h, w, boxes, labelled)


def _check_boxes(path: Path, boxes: np.ndarray, h: int, w: int) -> None:
    if not np.isfinite(boxes).all():
        raise _fail(path, "boxes holds NaN or infinite values")
    cls = boxes[:, :, 4]
    pad = cls == -1
    rows_pad = (boxes == -1).all(axis=2)
    bad = np.argwhere(pad & ~rows_pad)
    if bad.size:
        i, k = bad[0]
        raise _fail(path, f"boxes[{i}, {k}] has class −1 but is not a padding row of −1: {boxes[i, k].tolist()}")
    real = ~pad
    bad = np.argwhere(real & ((cls < 0) | (cls >= NUM_CLASSES) | (cls != np.round(cls))))
    if bad.size:
        i, k = bad[0]
        raise _fail(path, f"boxes[{i}, {k}] has class {boxes[i, k, 4]:g}, expected 0..{NUM_CLASSES - 1} "
                          f"({', '.join(CLASSES)}) or −1 for no box")
    y0, x0, y1, x1 = (boxes[:, :, j] for j in range(4))
    ok = (0 <= y0) & (y0 < y1) & (y1 <= h) & (0 <= x0) & (x0 < x1) & (x1 <= w)
    bad = np.argwhere(real & ~ok)
    if bad.size:
        i, k = bad[0]
        raise _fail(path, f"boxes[{i}, {k}] = {boxes[i, k, :4].tolist()} is empty or outside the "
                          f"{h}×{w} image (expected 0 <= ymin < ymax <= {h}, 0 <= xmin < xmax <= {w})")


# --------------------------------------------------------------------------------------------------
# preprocessing


@dataclass(frozen=True)
class Preprocess:
    """A crop ``(y0, x0, height, width)`` in file pixels (or None), then ``downsample``-fold
    block averaging (trailing rows/columns that do not fill a block are dropped)."""

    crop: Optional[tuple[int, int, int, int]] = None
    downsample: int = 1

    def __post_init__(self):
        if self.crop is not None:
            crop = tuple(int(v) for v in self.crop)
            if len(crop) != 4 or min(crop[:2]) < 0 or min(crop[2:]) < 1:
                raise ValueError(f"crop must be (y0, x0, height, width), got {self.crop!r}")
            object.__setattr__(self, "crop", crop)
        if int(self.downsample) < 1:
            raise ValueError(f"downsample must be >= 1, got {self.downsample!r}")
        object.__setattr__(self, "downsample", int(self.downsample))

    @classmethod
    def from_config(cls, data_config) -> "Preprocess":
        return cls(tuple(data_config.crop) or None, data_config.downsample)

    def region(self, h: int, w: int, path: Path | str = "") -> tuple[int, int, int, int]:
        """(y0, y1, x0, x1) read from an h×w file image; DataError if the crop does not fit."""
        if self.crop is None:
            y0, x0, ch, cw = 0, 0, h, w
        else:
            y0, x0, ch, cw = self.crop
            if y0 + ch > h or x0 + cw > w:
                raise DataError(f"{path}: crop {list(self.crop)} does not fit the {h}×{w} images")
        k = self.downsample
        ch, cw = (ch // k) * k, (cw // k) * k
        if ch == 0 or cw == 0:
            raise DataError(f"{path}: downsampling by {k} leaves no pixels of the {h}×{w} images")
        return y0, y0 + ch, x0, x0 + cw

    def output_hw(self, h: int, w: int, path: Path | str = "") -> tuple[int, int]:
        y0, y1, x0, x1 = self.region(h, w, path)
        return (y1 - y0) // self.downsample, (x1 - x0) // self.downsample

    def image(self, chw: np.ndarray) -> np.ndarray:
        """A (16, h, w) region as read from the file → (h/k, w/k, 16) float32, channels last."""
        x = np.asarray(chw, dtype=np.float32)
        k = self.downsample
        if k > 1:
            c, h, w = x.shape
            x = x.reshape(c, h // k, k, w // k, k).mean(axis=(2, 4), dtype=np.float64).astype(np.float32)
        return np.ascontiguousarray(np.transpose(x, (1, 2, 0)))

    def boxes(self, boxes: np.ndarray, h: int, w: int) -> np.ndarray:
        """File boxes (k, 5) → boxes of the preprocessed image (float32).

        Boxes are shifted by the crop and clipped to it; a box keeps its label only if at least half
        of its area lies inside the crop. Coordinates are then divided by the downsampling factor.
        """
        b = np.asarray(boxes, dtype=np.float32).reshape(-1, 5).copy()
        y0, y1, x0, x1 = self.region(h, w)
        area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
        b[:, [0, 2]] = np.clip(b[:, [0, 2]] - y0, 0, y1 - y0)
        b[:, [1, 3]] = np.clip(b[:, [1, 3]] - x0, 0, x1 - x0)
        inside = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
        b = b[inside >= 0.5 * area - 1e-6]
        b[:, :4] /= self.downsample
        return b

    def to_dict(self) -> dict:
        return {"crop": list(self.crop) if self.crop else [], "downsample": self.downsample}


# --------------------------------------------------------------------------------------------------
# reading


class ClimateReader:
    """An open climate file reading single (preprocessed) images with h5py slices."""

    def __init__(self, cf: ClimateFile, prep: Preprocess = Preprocess()):
        self.file, self.prep = cf, prep
        self.region = prep.region(cf.height, cf.width, cf.path)
        self.shape = (*prep.output_hw(cf.height, cf.width, cf.path), len(CHANNELS))
        self._f = h5py.File(cf.path, "r")
        self._images = self._f["images"]

    def __enter__(self) -> "ClimateReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def read_raw(self, i: int) -> np.ndarray:
        """Image ``i`` preprocessed, not normalised: (h, w, 16) float32."""
        if not 0 <= i < self.file.n_images:
            raise IndexError(f"image {i} outside [0, {self.file.n_images}) of {self.file.path}")
        y0, y1, x0, x1 = self.region
        return self.prep.image(self._images[i, :, y0:y1, x0:x1])

    def read_boxes(self, i: int) -> np.ndarray:
        """Boxes of image ``i`` in preprocessed pixels, (k, 5) float32 (k may be 0)."""
        return self.prep.boxes(self.file.valid_boxes(i), self.file.height, self.file.width)


# --------------------------------------------------------------------------------------------------
# normalisation


@dataclass(frozen=True)
class Stats:
    """Per-channel mean and std of the training images, with the preprocessing they were taken after."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    prep: Preprocess = Preprocess()
    images: int = 0  # how many images the numbers come from

    def __post_init__(self):
        for name in ("mean", "std"):
            vals = tuple(float(v) for v in getattr(self, name))
            if len(vals) != len(CHANNELS) or not all(math.isfinite(v) for v in vals):
                raise ValueError(f"stats {name} must be {len(CHANNELS)} finite numbers, got {vals}")
            object.__setattr__(self, name, vals)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        std = np.asarray(self.std, np.float32)
        return np.asarray(self.mean, np.float32), np.where(std > 0, std, np.float32(1.0))

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """(…, 16) channels-last raw values → zero-mean unit-variance float32 (a constant channel
        is only centred)."""
        x = np.asarray(x)
        if x.shape[-1:] != (len(CHANNELS),):
            raise ValueError(f"images must have {len(CHANNELS)} channels last, got shape {x.shape}")
        mean, std = self.arrays()
        return ((x - mean) / std).astype(np.float32)

    def denormalize(self, z: np.ndarray) -> np.ndarray:
        mean, std = self.arrays()
        return (np.asarray(z, np.float32) * std + mean).astype(np.float32)

    def to_dict(self) -> dict:
        return {"channels": list(CHANNELS), "mean": list(self.mean), "std": list(self.std),
                "images": self.images, **self.prep.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Stats":
        if not isinstance(d, Mapping) or not {"mean", "std"} <= set(d):
            raise ValueError(f"climate statistics must be a mapping with 'mean' and 'std', got {d!r}")
        if list(d.get("channels", CHANNELS)) != list(CHANNELS):
            raise ValueError(f"statistics are for channels {d['channels']}, expected {list(CHANNELS)}")
        prep = Preprocess(tuple(d.get("crop") or ()) or None, d.get("downsample", 1))
        return cls(tuple(d["mean"]), tuple(d["std"]), prep, int(d.get("images", 0)))


def compute_stats(path, prep: Preprocess = Preprocess(), max_images: int = 0, progress=None) -> Stats:
    """Mean and std per channel over the images of ``path`` (all, or ``max_images`` evenly spaced),
    read one at a time; per-image moments are merged pairwise in float64 (no cancellation)."""
    cf = path if isinstance(path, ClimateFile) else open_climate(path)
    n = cf.n_images
    idx = np.arange(n) if not max_images or max_images >= n else np.linspace(0, n - 1, max_images).round().astype(int)
    count, mean, m2 = 0, np.zeros(len(CHANNELS)), np.zeros(len(CHANNELS))
    with ClimateReader(cf, prep) as reader:
        for i in idx:
            x = reader.read_raw(int(i)).reshape(-1, len(CHANNELS)).astype(np.float64)
            nb = x.shape[0]
            mb = x.mean(axis=0)
            m2b = ((x - mb) ** 2).sum(axis=0)
            delta = mb - mean
            tot = count + nb
            mean = mean + delta * nb / tot
            m2 = m2 + m2b + delta**2 * count * nb / tot
            count = tot
            if progress:
                progress(1)
    std = np.sqrt(m2 / count)
    return Stats(tuple(mean.tolist()), tuple(std.tolist()), prep, len(idx))


# --------------------------------------------------------------------------------------------------
# training batches


def shard_pools(cf: ClimateFile, shard: int, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(labelled, unlabelled) image indices of one shard: every ``shards``-th of each pool, so
    every shard gets its share of the (few) labelled images."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} outside [0, {shards})")
    lab = np.flatnonzero(cf.labelled)[shard::shards]
    unl = np.flatnonzero(~cf.labelled)[shard::shards]
    return lab, unl


class _Cycle:
    """Endless shuffled passes over a pool of indices."""

    def __init__(self, pool: np.ndarray, rng: np.random.Generator):
        self.pool, self.rng, self.order, self.pos = pool, rng, pool[:0], 0

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= len(self.order):
                self.order, self.pos = self.rng.permutation(self.pool), 0
            n = min(k - len(out), len(self.order) - self.pos)
            out.extend(int(v) for v in self.order[self.pos:self.pos + n])
            self.pos += n
        return out


def _batch_indices(cf: ClimateFile, batch: int, shard: int, shards: int, seed: int,
                   labelled_share: float, labelled_only: bool) -> Iterator[list[int]]:
    lab, unl = shard_pools(cf, shard, shards)
    rng = np.random.default_rng([seed, shard, 17])
    if labelled_only:
        if not len(lab):
            raise DataError(f"{cf.path}: shard {shard} of {shards} holds no labelled image "
                            f"({cf.n_labelled} labelled in the file)")
        pools = [(_Cycle(lab, rng), batch)]
    elif labelled_share > 0 and len(lab) and len(unl):
        n_lab = min(batch, max(1, round(labelled_share * batch)))
        pools = [(_Cycle(lab, rng), n_lab), (_Cycle(unl, rng), batch - n_lab)]
    else:
        pools = [(_Cycle(np.sort(np.concatenate([lab, unl])), rng), batch)]
    while True:
        idx = [i for cycle, k in pools for i in cycle.take(k)]
        yield [idx[k] for k in rng.permutation(len(idx))]


def _train_stream(cf, prep, stats, batch, shard, shards, seed, labelled_share, labelled_only, cell,
                  halt: threading.Event):
    with ClimateReader(cf, prep) as reader:
        h, w, c = reader.shape
        grid = grid_shape(h, w, cell)
        for idx in _batch_indices(cf, batch, shard, shards, seed, labelled_share, labelled_only):
            if halt.is_set():
                return
            x = np.empty((len(idx), h, w, c), np.float32)
            target = np.zeros((len(idx), *grid, TARGET_CHANNELS), np.float32)
            labelled = np.zeros(len(idx), np.float32)
            for k, i in enumerate(idx):
                x[k] = stats.normalize(reader.read_raw(i))
                if cf.labelled[i]:
                    labelled[k] = 1.0
                    target[k] = encode_boxes(reader.read_boxes(i), grid, cell)
            yield x, target, labelled


def iter_train_batches(path, batch: int, stats: Stats, cell: int, *, shard: int = 0, shards: int = 1,
                       seed: int = 0, labelled_share: float = 0.5, labelled_only: bool = False,
                       prefetch: int = 2) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Endless training batches ``(x, target, labelled)`` of one shard, read one image at a time.

    ``x`` (B, h, w, 16) normalised; ``target`` (B, gh, gw, 6) from :func:`encode_boxes` (zeros for
    unlabelled images); ``labelled`` (B,) float32 1/0. With ``labelled_only`` batches hold labelled
    images alone (the unlabelled ones are never read); otherwise a ``labelled_share`` of each batch
    comes from the shard's labelled images and the rest from its unlabelled ones (0, or a shard
    lacking either kind: a uniform draw over the shard). With ``prefetch > 0`` a daemon thread
    reads that many batches ahead; closing the iterator stops it and waits for it.
    """
    cf = path if isinstance(path, ClimateFile) else open_climate(path)
    halt = threading.Event()
    args = (cf, stats.prep, stats, batch, shard, shards, seed, labelled_share, labelled_only, cell)
    if prefetch <= 0:
        yield from _train_stream(*args, halt)
        return
    q: queue.Queue = queue.Queue(maxsize=prefetch)

    thread = threading.Thread(target=common.feed_queue, args=(_train_stream(*args, halt), q, halt),
                              name=f"climate-prefetch-{shard}", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if isinstance(item, BaseException):
                raise item
            if item is common.END:  # not reached: the training stream is endless
                return
            yield item
    finally:
        halt.set()
        common.drain_queue(q)
        thread.join(timeout=5.0)  # out of HDF5 before the caller goes on (it may be exiting)


def iter_eval(path, stats: Stats, batch: int = 16, only_labelled: bool = True):
    """Batches ``(indices, x_normalised, [boxes per image])`` of a file in order, one image read at
    a time; unlabelled images are skipped unless ``only_labelled`` is False."""
    cf = path if isinstance(path, ClimateFile) else open_climate(path)
    with ClimateReader(cf, stats.prep) as reader:
        order = [i for i in range(cf.n_images) if cf.labelled[i] or not only_labelled]
        for lo in range(0, len(order), batch):
            idx = order[lo:lo + batch]
            x = np.stack([stats.normalize(reader.read_raw(i)) for i in idx])
            yield np.asarray(idx), x, [reader.read_boxes(i) for i in idx]
