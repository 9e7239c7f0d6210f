"""Streaming reader for HEP calorimeter-image files (HDF5), for training and evaluation.

The files' layouts, and how a file is checked before anything is read, are
:mod:`hpcdl.workloads.hep.layout`.

Memory stays bounded: everything here reads with h5py slices of at most ``chunk_events`` events;
no function ever loads a whole dataset. :func:`iter_batches` reads only the caller's shard
(:func:`shard_range`), chunk by chunk, in a background thread feeding a bounded queue, so at most
about ``(prefetch + 2) × chunk_events`` events are in memory at once (``prefetch`` queued chunks,
one being read, one being consumed).

Normalisation (per-channel scales, class weights) is :mod:`hpcdl.workloads.hep.normalization`.
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional, Tuple

import h5py
import numpy as np

from hpcdl.workloads import common
from hpcdl.workloads.hep.layout import (
    CHANNELS, DEFAULT_CHUNK, LAYOUT_BENCHMARK, LAYOUT_NERSC, NERSC_GROUP, DataError, HepFile, as_hep, h5_errors,
    open_hep,
)

if TYPE_CHECKING:
    from hpcdl.workloads.hep.normalization import Normalization

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


def event_chunks(start: int, stop: int, chunk: int) -> Iterator[Tuple[int, int]]:
    for lo in range(start, stop, chunk):
        yield lo, min(lo + chunk, stop)


def check_chunk(chunk: int, name: str = "chunk") -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"{name} must be a positive integer, got {chunk!r}")
    return int(chunk)


# --------------------------------------------------------------------------------------------------
# sharding


def shard_range(n_events: int, rank: int, size: int) -> Tuple[int, int]:
    """The contiguous slice ``[start, stop)`` of ``n_events`` owned by ``rank`` of ``size``.

    Shards are balanced (their sizes differ by at most one; the first ``n_events % size`` ranks get
    one extra event) and together cover every event exactly once. With more ranks than events some
    shards are empty.
    """
    for name, v in (("n_events", n_events), ("rank", rank), ("size", size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {v!r}")
    if n_events < 0:
        raise ValueError(f"n_events must be >= 0, got {n_events}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    base, extra = divmod(int(n_events), int(size))
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


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


def _chunk_stream(
    hep: HepFile,
    start: int,
    stop: int,
    norm: Optional[Normalization],
    shuffle: bool,
    seed: int,
    rank: int,
    epochs: Optional[int],
    chunk_events: int,
    halt: threading.Event,
) -> Iterator[Tuple[int, Optional[Batch]]]:
    """Yield ``(epoch, chunk)`` for each chunk of the shard and ``(epoch, None)`` at epoch ends."""
    bounds = list(event_chunks(start, stop, chunk_events))
    with HepReader(hep) as reader:
        epoch = 0
        while epochs is None or epoch < epochs:
            order = np.arange(len(bounds))
            rng = np.random.default_rng([seed, rank, epoch]) if shuffle else None
            if rng is not None:
                rng.shuffle(order)
            for i in order:
                if halt.is_set():
                    return
                lo, hi = bounds[i]
                b = reader.read(lo, hi)
                x = b.x if norm is None else norm.apply(b.x, inplace=True)
                if rng is not None:
                    perm = rng.permutation(hi - lo)
                    b = Batch(
                        x[perm], b.y[perm], b.w[perm],
                        None if b.pass_sr is None else b.pass_sr[perm], b.index[perm],
                    )
                else:
                    b = b._replace(x=x)
                yield epoch, b
            yield epoch, None
            epoch += 1


def _concat(parts: list) -> Batch:
    if len(parts) == 1:
        return parts[0]
    sr = None if parts[0].pass_sr is None else np.concatenate([p.pass_sr for p in parts])
    return Batch(
        np.concatenate([p.x for p in parts]),
        np.concatenate([p.y for p in parts]),
        np.concatenate([p.w for p in parts]),
        sr,
        np.concatenate([p.index for p in parts]),
    )


def _slice(b: Batch, lo: int, hi: int) -> Batch:
    return Batch(
        b.x[lo:hi], b.y[lo:hi], b.w[lo:hi], None if b.pass_sr is None else b.pass_sr[lo:hi],
        b.index[lo:hi],
    )


class BatchIterator:
    """Iterator of :class:`Batch` es over one rank's shard; see :func:`iter_batches`.

    With ``prefetch > 0`` a daemon thread reads chunks ahead into a queue of ``prefetch`` chunks.
    The thread holds no reference to this object, so dropping the iterator (or calling
    :meth:`close`, or leaving a ``with`` block) stops it.
    """

    def __init__(
        self,
        hep: HepFile,
        batch_size: int,
        start: int,
        stop: int,
        *,
        norm: Optional[Normalization],
        shuffle: bool,
        seed: int,
        rank: int,
        epochs: Optional[int],
        chunk_events: int,
        prefetch: int,
        drop_remainder: bool,
    ):
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder
        self.shard = (start, stop)
        self._halt = threading.Event()
        self._pending: list = []  # parts of the next batch, all of the current epoch
        self._pending_n = 0
        self._current: Optional[Batch] = None  # the chunk being cut into batches
        self._pos = 0
        self._epoch = 0
        self._finished = False
        stream = _chunk_stream(
            hep, start, stop, norm, shuffle, seed, rank, epochs, chunk_events, self._halt
        )
        if prefetch > 0:
            self._queue: Optional[queue.Queue] = queue.Queue(maxsize=prefetch)
            self._stream = None
            self._thread: Optional[threading.Thread] = threading.Thread(
                target=common.feed_queue,
                args=(stream, self._queue, self._halt),
                name=f"hep-prefetch-{hep.path.name}-r{rank}",
                daemon=True,
            )
            self._thread.start()
        else:
            self._queue = None
            self._thread = None
            self._stream = stream

    def _next_chunk(self):
        if self._queue is None:
            return next(self._stream, common.END)
        while True:
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("HEP prefetch thread died without finishing") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        bs = self.batch_size
        while True:
            cur = self._current
            if cur is not None and self._pos < len(cur.y):
                take = min(bs - self._pending_n, len(cur.y) - self._pos)
                self._pending.append(_slice(cur, self._pos, self._pos + take))
                self._pending_n += take
                self._pos += take
                if self._pending_n == bs:
                    return self._flush()
                continue
            try:
                item = self._next_chunk()
            except BaseException:
                self.close()
                raise
            if item is common.END:
                self.close()
                raise StopIteration
            epoch, chunk = item
            self._current, self._pos = chunk, 0
            if chunk is None:  # end of an epoch: the remainder is dropped or yielded short
                if self._pending_n and not self.drop_remainder:
                    return self._flush()
                self._pending, self._pending_n = [], 0

    def _flush(self) -> Batch:
        batch = _concat(self._pending)
        self._pending, self._pending_n = [], 0
        return batch

    def close(self) -> None:
        """Stop the prefetch thread and release the file. Idempotent."""
        self._finished = True
        self._halt.set()
        self._current = None
        self._pending = []
        if self._queue is not None:
            common.drain_queue(self._queue)  # unblocks a producer waiting on a full queue
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self._stream is not None:
            self._stream.close()

    def __enter__(self) -> "BatchIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def iter_batches(
    path,
    batch_size: int,
    rank: int = 0,
    size: int = 1,
    norm: Optional[Normalization] = None,
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
    batch_size = check_chunk(batch_size, "batch_size")
    chunk_events = check_chunk(chunk_events, "chunk_events")
    if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1
    ):
        raise ValueError(f"epochs must be None (forever) or a positive integer, got {epochs!r}")
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
