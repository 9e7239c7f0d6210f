"""The streaming batch reader every HDF5 workload trains from: chunked, sharded by rank, prefetching.

A workload gives a *reader* -- an object with ``read(start, stop)`` returning a NamedTuple of
arrays over examples ``[start, stop)`` (a field may be ``None`` when the file lacks it), usable
as a context manager -- and :class:`ChunkedBatches` does the rest: each rank reads only its
shard (:func:`shard_range`), ``chunk`` examples at a time, in a background thread feeding a
bounded queue, so at most about ``(prefetch + 2) × chunk`` examples are in memory at once
(``prefetch`` queued chunks, one being read, one being consumed). No function here ever loads a
whole dataset. HEP's reader (:mod:`hpcdl.workloads.hep.data`) and the generic Keras workload's
(:mod:`hpcdl.workloads.keras.data`) are both this.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator, Optional, Tuple

import numpy as np

from hpcdl.workloads import common


def example_chunks(start: int, stop: int, chunk: int) -> Iterator[Tuple[int, int]]:
    for lo in range(start, stop, chunk):
        yield lo, min(lo + chunk, stop)


def check_chunk(chunk: int, name: str = "chunk") -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"{name} must be a positive integer, got {chunk!r}")
    return int(chunk)


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


def check_stream_args(batch_size, chunk, prefetch, epochs, chunk_name: str = "chunk") -> tuple[int, int]:
    """``(batch_size, chunk)`` as ints, or ValueError naming the argument that is wrong."""
    batch_size = check_chunk(batch_size, "batch_size")
    chunk = check_chunk(chunk, chunk_name)
    if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) or prefetch < 0:
        raise ValueError(f"prefetch must be an integer >= 0, got {prefetch!r}")
    if epochs is not None and (
        isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1
    ):
        raise ValueError(f"epochs must be None (forever) or a positive integer, got {epochs!r}")
    return batch_size, chunk


def _take(b, index):
    """Every field of the NamedTuple ``b`` indexed the same way (``None`` fields stay None)."""
    return type(b)(*(None if f is None else f[index] for f in b))


def _concat(parts: list):
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return type(first)(*(None if f is None else np.concatenate([p[i] for p in parts])
                         for i, f in enumerate(first)))


def _chunk_stream(open_reader: Callable[[], Any], bounds: list, transform: Optional[Callable[[Any], Any]],
                  shuffle: bool, seed: int, rank: int, epochs: Optional[int],
                  halt: threading.Event) -> Iterator[Tuple[int, Any]]:
    """Yield ``(epoch, chunk)`` for each chunk of the shard and ``(epoch, None)`` at epoch ends."""
    with open_reader() as reader:
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
                if transform is not None:
                    b = transform(b)
                if rng is not None:
                    b = _take(b, rng.permutation(hi - lo))
                yield epoch, b
            yield epoch, None
            epoch += 1


class ChunkedBatches:
    """Iterator of batches (the reader's NamedTuple) over one rank's shard ``[start, stop)``.

    Training mode (``shuffle=True``): each epoch visits the shard's chunks in a seeded random
    order and permutes the examples inside each chunk (a function of ``seed``, ``rank`` and the
    epoch number); batches run across chunk boundaries, and an epoch's last partial batch is
    dropped unless ``drop_remainder=False``. ``epochs=None`` repeats forever. Evaluation mode
    (``shuffle=False, drop_remainder=False, epochs=1``) yields every example of the shard exactly
    once, in file order. ``transform`` (e.g. normalisation) is applied to each chunk as read.

    With ``prefetch > 0`` a daemon thread (named ``thread_name``) reads chunks ahead into a queue
    of ``prefetch`` chunks. The thread holds no reference to this object, so dropping the
    iterator (or calling :meth:`close`, or leaving a ``with`` block) stops it.
    """

    def __init__(self, open_reader: Callable[[], Any], batch_size: int, start: int, stop: int, *,
                 transform: Optional[Callable[[Any], Any]] = None, shuffle: bool, seed: int, rank: int,
                 epochs: Optional[int], chunk: int, prefetch: int, drop_remainder: bool,
                 thread_name: str = "prefetch"):
        self.batch_size = batch_size
        self.drop_remainder = drop_remainder
        self.shard = (start, stop)
        self._halt = threading.Event()
        self._pending: list = []  # parts of the next batch, all of the current epoch
        self._pending_n = 0
        self._current = None  # the chunk being cut into batches
        self._pos = 0
        self._finished = False
        stream = _chunk_stream(open_reader, list(example_chunks(start, stop, chunk)), transform,
                               shuffle, seed, rank, epochs, self._halt)
        if prefetch > 0:
            self._queue: Optional[queue.Queue] = queue.Queue(maxsize=prefetch)
            self._stream = None
            self._thread: Optional[threading.Thread] = threading.Thread(
                target=common.feed_queue, args=(stream, self._queue, self._halt), name=thread_name, daemon=True,
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
                    raise RuntimeError(f"{self._thread.name}: the prefetch thread died without finishing") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def __iter__(self) -> "ChunkedBatches":
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        bs = self.batch_size
        while True:
            cur = self._current
            if cur is not None and self._pos < len(cur[0]):
                take = min(bs - self._pending_n, len(cur[0]) - self._pos)
                self._pending.append(_take(cur, slice(self._pos, self._pos + take)))
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
            _epoch, chunk = item
            self._current, self._pos = chunk, 0
            if chunk is None:  # end of an epoch: the remainder is dropped or yielded short
                if self._pending_n and not self.drop_remainder:
                    return self._flush()
                self._pending, self._pending_n = [], 0

    def _flush(self):
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

    def __enter__(self) -> "ChunkedBatches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
