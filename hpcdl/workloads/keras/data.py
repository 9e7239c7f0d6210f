"""Arrays in HDF5 files, as the generic workload reads them: one dataset of inputs (N, ...), one of
labels (N,) or (N, k), optionally one of per-example weights (N,), at names the job gives.

Reading is the shared streaming reader (:mod:`hpcdl.workloads.stream`: the rank's shard only,
chunk by chunk, prefetched), so no file is ever loaded whole.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import h5py
import numpy as np

from hpcdl.workloads import common
from hpcdl.workloads.stream import ChunkedBatches, check_stream_args, example_chunks, shard_range


class DataError(common.DataFileError):
    """A Keras job's data file is missing, unreadable, or does not hold what `[data]` names."""


class Examples(NamedTuple):
    x: np.ndarray  # (n, ...) float32 inputs
    y: np.ndarray  # (n,) int32 classes, or (n,) / (n, k) float32 targets
    w: np.ndarray  # (n,) float32 weights (1 without a weights dataset)
    index: np.ndarray  # (n,) int64 example numbers in the file


@dataclass(frozen=True)
class ArrayFile:
    """What a data file holds at the job's dataset names, checked on opening (no arrays read)."""

    path: Path
    inputs: str
    labels: str
    weights: str
    n: int
    input_shape: tuple[int, ...]
    label_shape: tuple[int, ...]

    @classmethod
    def open(cls, path, data) -> "ArrayFile":
        """The file at ``path`` with `data`'s (KerasDataConfig) dataset names; DataError else."""
        path = Path(path)
        with common.open_h5(DataError, path) as f:
            x = common.h5_dataset(DataError, path, f, data.inputs, missing_hint=" (data.inputs)")
            y = common.h5_dataset(DataError, path, f, data.labels, missing_hint=" (data.labels)")
            if x.ndim < 2:
                raise DataError.at(path, f"{data.inputs!r} is {x.shape}: expected (examples, ...) with "
                                         "at least one value per example")
            n = x.shape[0]
            if y.shape[:1] != (n,):
                raise DataError.at(path, f"{data.labels!r} has {y.shape[0] if y.ndim else 0} entries, "
                                         f"{data.inputs!r} {n}")
            if data.task == "classification" and y.ndim != 1:
                raise DataError.at(path, f"{data.labels!r} is {y.shape}: classification expects class "
                                         "numbers (N,)")
            if data.task == "regression" and y.ndim > 2:
                raise DataError.at(path, f"{data.labels!r} is {y.shape}: regression expects (N,) or (N, k)")
            if data.weights:
                w = common.h5_dataset(DataError, path, f, data.weights, missing_hint=" (data.weights)")
                if w.shape != (n,):
                    raise DataError.at(path, f"{data.weights!r} is {w.shape}: expected ({n},)")
            return cls(path, data.inputs, data.labels, data.weights, int(n), tuple(int(d) for d in x.shape[1:]),
                       tuple(int(d) for d in y.shape[1:]))

    @property
    def targets(self) -> int:
        """Regression: values per example (1 for labels of shape (N,))."""
        return int(np.prod(self.label_shape)) if self.label_shape else 1


class ArrayReader:
    """An open data file reading example ranges ``[start, stop)``."""

    def __init__(self, arrays: ArrayFile, classes: int = 0):
        self.arrays, self.classes = arrays, classes
        self._f = h5py.File(arrays.path, "r")
        self._x, self._y = self._f[arrays.inputs], self._f[arrays.labels]
        self._w = self._f[arrays.weights] if arrays.weights else None

    def __enter__(self) -> "ArrayReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def read(self, start: int, stop: int) -> Examples:
        try:
            x = np.asarray(self._x[start:stop], dtype=np.float32)
            y = self._y[start:stop]
            w = np.ones(stop - start, np.float32) if self._w is None else np.asarray(self._w[start:stop], np.float32)
        except OSError as exc:  # a corrupted chunk
            raise DataError.at(self.arrays.path, f"cannot read examples [{start}, {stop}): {exc}") from None
        if self.classes:
            check_classes(self.arrays.path, y, self.classes, start)
            y = y.astype(np.int32)
        else:
            y = np.asarray(y, np.float32)
        return Examples(x, y, w, np.arange(start, stop, dtype=np.int64))


def check_classes(path: Path, y: np.ndarray, classes: int, start: int = 0) -> None:
    """Labels must be whole numbers 0 .. classes-1; the first one that is not, named."""
    bad = ~np.isfinite(y) | (y < 0) | (y >= classes) | (y != np.floor(y)) if y.dtype.kind == "f" else (
        (y < 0) | (y >= classes))
    if np.any(bad):
        i = int(np.argmax(bad))
        raise DataError.at(path, f"label {y[i].item()!r} of example {start + i} is not a class 0 .. {classes - 1} "
                                 f"(data.classes = {classes})")


def check_all_labels(arrays: ArrayFile, classes: int, chunk: int) -> None:
    """Every label of the file in range (reads the labels only, `chunk` at a time)."""
    with h5py.File(arrays.path, "r") as f:
        labels = f[arrays.labels]
        for lo, hi in example_chunks(0, arrays.n, chunk):
            check_classes(arrays.path, labels[lo:hi], classes, lo)


def channel_stats(arrays: ArrayFile, chunk: int) -> dict[str, list[float]]:
    """Mean and standard deviation of each input channel (the last axis) over the file, streamed."""
    mean, std = _streamed_moments(arrays, arrays.inputs, arrays.input_shape[-1], chunk)
    return {"mean": mean, "std": std}


def target_stats(arrays: ArrayFile, chunk: int) -> dict[str, list[float]]:
    """Mean and standard deviation of each regression target over the file, streamed."""
    mean, std = _streamed_moments(arrays, arrays.labels, arrays.targets, chunk)
    return {"target_mean": mean, "target_std": std}


def _streamed_moments(arrays: ArrayFile, dataset: str, width: int, chunk: int) -> tuple[list[float], list[float]]:
    """Per-column mean and std of `dataset` seen as (-1, width); a constant column's std is 1."""
    total, sq, count = np.zeros(width), np.zeros(width), 0
    with h5py.File(arrays.path, "r") as f:
        x = f[dataset]
        for lo, hi in example_chunks(0, arrays.n, chunk):
            part = np.asarray(x[lo:hi], np.float64).reshape(-1, width)
            total += part.sum(axis=0)
            sq += np.square(part).sum(axis=0)
            count += part.shape[0]
    mean = total / max(count, 1)
    std = np.sqrt(np.maximum(sq / max(count, 1) - mean ** 2, 0.0))
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std))):
        raise DataError.at(arrays.path, f"{dataset!r} holds values that are not finite")
    return mean.tolist(), np.where(std > 0, std, 1.0).tolist()


def normalizer(stats: dict):
    """The chunk transform of the job's normalisation of inputs and targets (None without any)."""
    mean = np.asarray(stats["mean"], np.float32) if stats.get("mean") else None
    std = np.asarray(stats["std"], np.float32) if stats.get("mean") else None
    target_mean = np.asarray(stats["target_mean"], np.float32) if stats.get("target_mean") else None
    target_std = np.asarray(stats["target_std"], np.float32) if stats.get("target_mean") else None
    if mean is None and target_mean is None:
        return None

    def apply(b: Examples) -> Examples:
        if mean is not None:
            b = b._replace(x=(b.x - mean) / std)
        if target_mean is not None:
            y = (b.y.reshape(len(b.y), -1) - target_mean) / target_std
            b = b._replace(y=y.reshape(b.y.shape).astype(np.float32))
        return b

    return apply


def iter_batches(arrays: ArrayFile, batch_size: int, *, stats: dict, classes: int, rank: int = 0, size: int = 1,
                 shuffle: bool = True, seed: int = 0, epochs: Optional[int] = None, chunk: int = 4096,
                 prefetch: int = 2, drop_remainder: bool = True) -> ChunkedBatches:
    """Batches of :class:`Examples` of this rank's shard (see :class:`ChunkedBatches`)."""
    batch_size, chunk = check_stream_args(batch_size, chunk, prefetch, epochs)
    start, stop = shard_range(arrays.n, rank, size)
    if epochs is None and (stop - start == 0 or (drop_remainder and stop - start < batch_size)):
        raise ValueError(f"rank {rank}/{size} owns {stop - start} examples of {arrays.path}, fewer than "
                         f"batch_size={batch_size}: an endless epoch loop would never yield a batch")
    return ChunkedBatches(
        functools.partial(ArrayReader, arrays, classes), batch_size, start, stop, transform=normalizer(stats),
        shuffle=shuffle, seed=seed, rank=rank, epochs=epochs, chunk=chunk, prefetch=prefetch,
        drop_remainder=drop_remainder, thread_name=f"keras-prefetch-{arrays.path.name}-r{rank}",
    )
