"""Streaming reader for HEP calorimeter-image files (HDF5), for training and evaluation.

The files' layouts, and how a file is checked before anything is read, are
:mod:`hpcdl.workloads.hep.layout`.

Memory stays bounded: everything here reads with h5py slices of at most ``chunk_events`` events;
no function ever loads a whole dataset. :func:`iter_batches` is the shared streaming reader
(:mod:`hpcdl.workloads.stream`: the caller's shard only, chunk by chunk, prefetched in a
background thread) over :class:`HepReader`.

Normalisation (per-channel scales, class weights) is :mod:`hpcdl.workloads.hep.normalization`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Protocol

import h5py
import numpy as np

from hpcdl.workloads.hep.layout import (
    CHANNELS, DEFAULT_CHUNK, LAYOUT_BENCHMARK, LAYOUT_NERSC, NERSC_GROUP, DataError, HepFile, as_hep, h5_errors,
    open_hep,
)
from hpcdl.workloads.stream import ChunkedBatches, check_stream_args, example_chunks, shard_range


class Scaling(Protocol):
    """What batches are scaled by (hpcdl.workloads.hep.normalization.Normalization, which reads
    its scales through this module)."""

    def apply(self, images: np.ndarray, inplace: bool = False) -> np.ndarray: ...


__all__ = [
    "LAYOUT_BENCHMARK",
    "LAYOUT_NERSC",
    "Batch",
    "BatchIterator",
    "DataError",
    "HepFile",
    "HepReader",
    "batches_per_epoch",
    "iter_batches",
    "open_hep",
    "read_events",
    "shard_range",
]


# --------------------------------------------------------------------------------------------------
# reading event ranges


class Batch(NamedTuple):
    """Events as numpy arrays; unpacks as ``x, y, w, pass_sr, index``."""

    x: np.ndarray  # (n, H, W, 3) float32
    y: np.ndarray  # (n,) int32, 1 = signal
    w: np.ndarray  # (n,) float32 event weight
    pass_sr: Optional[np.ndarray]  # (n,) bool, or None when the file has no selection flag
    index: np.ndarray  # (n,) int64 global event index in the file


def _corruption_is_data_error(method):
    """A reader method whose h5py errors on a corrupted chunk come out as one DataError."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with h5_errors(self.hep.path):
            return method(self, *args, **kwargs)

    return wrapper


class HepReader:
    """An open HEP file reading event ranges ``[start, stop)`` with h5py slices."""

    def __init__(self, hep: HepFile):
        self.hep = hep
        with h5_errors(hep.path):
            self._f = h5py.File(hep.path, "r")
            if hep.layout == LAYOUT_NERSC:
                g = self._f[NERSC_GROUP]
                self._images = [g[key] for key in CHANNELS]
                self._y = g["y"]
                self._w = g["weight"] if hep.has_weight else None
                self._sr = g["passSR"] if hep.has_pass_sr else None
            else:
                self._images = [self._f["data"]]
                self._y = self._f["label"]
                self._w = self._f["weight"] if hep.has_weight else None
                self._sr = self._f["psr"] if hep.has_pass_sr else None

    def __enter__(self) -> "HepReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def _check_range(self, start: int, stop: int) -> None:
        if not (0 <= start <= stop <= self.hep.n_events):
            raise ValueError(
                f"event range [{start}, {stop}) outside [0, {self.hep.n_events}) of {self.hep.path}"
            )

    @_corruption_is_data_error
    def read_images(self, start: int, stop: int) -> np.ndarray:
        """Images of events ``[start, stop)``, NHWC float32."""
        self._check_range(start, stop)
        h, w, c = self.hep.image_shape
        if self.hep.layout == LAYOUT_NERSC:
            out = np.empty((stop - start, h, w, c), dtype=np.float32)
            for ch, ds in enumerate(self._images):
                out[..., ch] = ds[start:stop]
            return out
        data = self._images[0][start:stop]  # (n, 3, H, W)
        return np.ascontiguousarray(np.transpose(data, (0, 2, 3, 1)), dtype=np.float32)

    @_corruption_is_data_error
    def read_labels(self, start: int, stop: int) -> np.ndarray:
        """Labels of events ``[start, stop)``, int32 (1 = signal); raises DataError if not 0/1."""
        self._check_range(start, stop)
        raw = self._y[start:stop]
        if raw.ndim == 2:  # one-hot (n, 2): the column index is the class
            if not np.all((raw == 0) | (raw == 1)) or np.any(raw.sum(axis=1) != 1):
                raise DataError.at(self.hep.path, "label is (N, 2) but not one-hot")
            return np.argmax(raw, axis=1).astype(np.int32)
        if raw.size and not np.all((raw == 0) | (raw == 1)):
            bad = raw[(raw != 0) & (raw != 1)][0]
            raise DataError.at(self.hep.path, f"labels must be 0 or 1, found {bad!r} in [{start}, {stop})")
        return raw.astype(np.int32)

    @_corruption_is_data_error
    def read_weights(self, start: int, stop: int) -> np.ndarray:
        """Event weights of ``[start, stop)``, float32 (all 1 when the file has none)."""
        self._check_range(start, stop)
        if self._w is None:
            return np.ones(stop - start, dtype=np.float32)
        return self._w[start:stop].astype(np.float32)

    @_corruption_is_data_error
    def read_pass_sr(self, start: int, stop: int) -> Optional[np.ndarray]:
        """Signal-region flags of ``[start, stop)`` as bool, or None when the file has none."""
        self._check_range(start, stop)
        if self._sr is None:
            return None
        return self._sr[start:stop].astype(bool)

    def read(self, start: int, stop: int) -> Batch:
        """All of events ``[start, stop)``."""
        return Batch(
            self.read_images(start, stop),
            self.read_labels(start, stop),
            self.read_weights(start, stop),
            self.read_pass_sr(start, stop),
            np.arange(start, stop, dtype=np.int64),
        )


def read_events(hep: HepFile, start: int, stop: int) -> Batch:
    """Events ``[start, stop)`` of ``hep`` (opens and closes the file; for repeated reads use a reader)."""
    with HepReader(hep) as reader:
        return reader.read(start, stop)


# Sharding and chunking are the shared streaming reader's (hpcdl.workloads.stream).
event_chunks = example_chunks


def batches_per_epoch(
    n_events: int, batch_size: int, rank: int = 0, size: int = 1, drop_remainder: bool = True
) -> int:
    """How many batches :func:`iter_batches` yields per epoch for this rank.

    Shards differ by up to one event, so with ``drop_remainder`` ranks can differ by one batch; a
    synchronous data-parallel trainer should step ``min`` over ranks, i.e. this function with
    ``rank=size - 1`` (the smallest shard).
    """
    start, stop = shard_range(n_events, rank, size)
    n = stop - start
    return n // batch_size if drop_remainder else -(-n // batch_size)


# --------------------------------------------------------------------------------------------------
# batch iteration


class BatchIterator(ChunkedBatches):
    """Iterator of :class:`Batch` es over one rank's shard; see :func:`iter_batches`."""

    def __init__(
        self,
        hep: HepFile,
        batch_size: int,
        start: int,
        stop: int,
        *,
        norm: Optional[Scaling],
        shuffle: bool,
        seed: int,
        rank: int,
        epochs: Optional[int],
        chunk_events: int,
        prefetch: int,
        drop_remainder: bool,
    ):
        transform = None if norm is None else (lambda b: b._replace(x=norm.apply(b.x, inplace=True)))
        super().__init__(
            functools.partial(HepReader, hep), batch_size, start, stop, transform=transform, shuffle=shuffle,
            seed=seed, rank=rank, epochs=epochs, chunk=chunk_events, prefetch=prefetch,
            drop_remainder=drop_remainder, thread_name=f"hep-prefetch-{hep.path.name}-r{rank}",
        )


def iter_batches(
    path,
    batch_size: int,
    rank: int = 0,
    size: int = 1,
    norm: Optional[Scaling] = None,
    shuffle: bool = True,
    seed: int = 0,
    epochs: Optional[int] = None,
    chunk_events: int = DEFAULT_CHUNK,
    prefetch: int = 2,
    drop_remainder: bool = True,
) -> BatchIterator:
    """Batches ``(x, y, w, pass_sr, index)`` of this rank's shard of the file at ``path``.

    ``x`` is NHWC float32 (divided by ``norm``'s scales when given), ``y`` int32, ``w`` float32
    event weights (raw; class-balance them with :meth:`Normalization.event_weights`), ``pass_sr``
    bool or ``None``, ``index`` the int64 event numbers in the file.

    Only events :func:`shard_range` gives ``rank`` are read, ``chunk_events`` at a time. Training
    mode (``shuffle=True``): each epoch visits the shard's chunks in a seeded random order and
    permutes the events inside each chunk (a function of ``seed``, ``rank`` and the epoch number);
    batches run across chunk boundaries, and an epoch's last partial batch is dropped unless
    ``drop_remainder=False``. ``epochs=None`` repeats forever. Evaluation mode
    (``shuffle=False, drop_remainder=False, epochs=1``) yields every event of the shard exactly
    once, in file order.

    ``prefetch`` chunks are read ahead by a background thread (0 reads in the caller's thread).
    Close the returned iterator (or use it as a context manager) when stopping early; dropping it
    also stops the thread.
    """
    hep = as_hep(path)
    batch_size, chunk_events = check_stream_args(batch_size, chunk_events, prefetch, epochs, "chunk_events")
    start, stop = shard_range(hep.n_events, rank, size)
    n = stop - start
    if epochs is None and (n == 0 or (drop_remainder and n < batch_size)):
        raise ValueError(
            f"rank {rank}/{size} owns {n} events of {hep.path}, fewer than batch_size={batch_size}: "
            "an endless epoch loop would never yield a batch"
        )
    return BatchIterator(
        hep, batch_size, start, stop,
        norm=norm, shuffle=bool(shuffle), seed=int(seed), rank=int(rank), epochs=epochs,
        chunk_events=chunk_events, prefetch=int(prefetch), drop_remainder=bool(drop_remainder),
    )
