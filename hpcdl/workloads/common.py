"""The chores the HEP and climate workloads both do, written once.

This module owns, for :mod:`hpcdl.workloads.hep` and :mod:`hpcdl.workloads.climate` alike:

* **data-file errors and HDF5 checks**: :class:`DataFileError`, the base of each workload's
  ``DataError`` (one line, ``"<path>: <problem>"``); :func:`open_h5` (an existing, readable HDF5
  file) and :func:`h5_dataset` (a numeric dataset that must be there);
* **prefetch plumbing**: a producer thread feeding a bounded queue that stops when a ``halt``
  event is set (:func:`feed_queue`, :func:`put_unless_halted`, :func:`drain_queue`, :data:`END`);
* **the synthetic generators' arguments and files**: :func:`is_int`, :func:`check_seed`,
  :func:`check_splits` (train/val/test fractions and the split sizes they give) and
  :func:`write_splits` (``train.h5``, ``val.h5``, ``test.h5``, replaced together, written in a
  child process);
* **atomic output files**: :func:`hpcdl.fs.files.atomic_path`; PNG figures (:func:`new_figure`,
  :func:`save_png`); ``.npz``/``.csv`` result tables (:func:`table_format`, :func:`csv_lines`).

What a workload means by its data (layouts, shapes, physics, metrics) stays in the workload; the
messages here name what the caller passes in. h5py and matplotlib are imported only inside the
functions that use them, so importing a workload's metrics needs neither.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import threading
import uuid
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Generator, Sequence, Tuple

import numpy as np

from hpcdl.fs.files import atomic_path, atomic_paths
from hpcdl.errors import HpcdlError

if TYPE_CHECKING:
    import h5py

# --------------------------------------------------------------------------------------------------
# data files


class DataFileError(HpcdlError, ValueError):
    """A data file is missing, unreadable or not in the layout its reader expects.

    Each workload subclasses it as its ``DataError``; the message is one line naming the file.
    """

    @classmethod
    def at(cls, path, problem: str) -> "DataFileError":
        """The error ``"<path>: <problem>"`` (to be raised by the caller)."""
        return cls(f"{path}: {problem}")


def open_h5(error: type[DataFileError], path: Path) -> "h5py.File":
    """``path`` open for reading; ``error`` if it is missing, not a regular file or not HDF5."""
    import h5py

    if not path.exists():
        raise error.at(path, "no such file")
    if not path.is_file():
        raise error.at(path, "not a regular file")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        detail = " ".join(str(exc).split())  # h5py messages can span lines; keep ours to one
        raise error.at(path, f"not a readable HDF5 file ({exc.__class__.__name__}: {detail})") from None


def h5_dataset(error: type[DataFileError], path: Path, group: "h5py.Group", key: str, where: str = "",
               missing_hint: str = "") -> "h5py.Dataset":
    """The numeric dataset ``group[key]``, else ``error``; ``where`` prefixes the key in messages
    (e.g. ``"all_events/"``), ``missing_hint`` is appended when it is absent."""
    import h5py

    if key not in group:
        present = ", ".join(sorted(group.keys())) or "nothing"
        raise error.at(path, f"missing dataset {where}{key!r} (found: {present}){missing_hint}")
    obj = group[key]
    if not isinstance(obj, h5py.Dataset):
        raise error.at(path, f"{where}{key!r} is a group, expected a dataset")
    if obj.dtype.kind not in "biuf":
        raise error.at(path, f"{where}{key!r} has non-numeric dtype {obj.dtype}")
    return obj


# --------------------------------------------------------------------------------------------------
# prefetching

#: Put by :func:`feed_queue` after the last item of a stream that ended.
END = object()


_TRACED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def traced_forward(model, name: str, fn: Callable):
    """`tf.function` of `fn(model, x)`, traced once per model and `name` rather than at every call:
    validation scores one model many times (the engine every train.validate_every steps, the
    emulated race at every score), and a trace costs more than scoring a small subset. The
    function holds the model weakly, so the cache does not keep it alive."""
    per_model = _TRACED.setdefault(model, {})
    if name not in per_model:
        import tensorflow as tf

        ref = weakref.ref(model)
        per_model[name] = tf.function(lambda x: fn(ref(), x), reduce_retracing=True)
    return per_model[name]


def put_unless_halted(q: "queue.Queue", item, halt: threading.Event) -> bool:
    """Put into the bounded queue unless ``halt`` is set first; False when halted."""
    while not halt.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def feed_queue(stream: Generator, q: "queue.Queue", halt: threading.Event) -> None:
    """A prefetch thread's body: the items of the generator ``stream`` into ``q``, then
    :data:`END`; an exception the stream raises is put instead, for the consumer to re-raise.
    Stops early on ``halt``, and closes ``stream`` in any case."""
    try:
        for item in stream:
            if not put_unless_halted(q, item, halt):
                return
        put_unless_halted(q, END, halt)
    except BaseException as exc:  # handed to the consumer, re-raised there
        put_unless_halted(q, exc, halt)
    finally:
        stream.close()


def drain_queue(q: "queue.Queue") -> None:
    """Empty ``q`` without blocking (unblocks a producer waiting on a full queue)."""
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            break


# --------------------------------------------------------------------------------------------------
# generator arguments and split files

SPLITS = ("train", "val", "test")


def absolute_split_paths(data, base: Path):
    """A `[data]` section with its split files (its `SPLITS` fields given as relative paths) made
    absolute from `base`, the directory the job is submitted from: the run's job.toml then names
    the same files from any shell and node (status, evaluate, resume)."""
    changes = {}
    for name in SPLITS:
        value = getattr(data, name, None)
        if isinstance(value, str) and value and not os.path.isabs(value):
            changes[name] = os.path.normpath(os.path.join(base, value))
    return dataclasses.replace(data, **changes) if changes else data


def split_paths(out_dir) -> Dict[str, Path]:
    """Where a generated set keeps each split: ``<out_dir>/<split>.h5``."""
    return {name: Path(out_dir) / f"{name}.h5" for name in SPLITS}


def is_int(v) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_seed(seed) -> None:
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")


def split_sizes(total: int, fractions: Sequence[float]) -> Tuple[int, int, int]:
    """``total`` items split (train, val, test) by ``fractions``; the test split takes the rest."""
    n_train = int(round(total * fractions[0]))
    n_val = int(round(total * fractions[1]))
    return n_train, n_val, total - n_train - n_val


def check_splits(total: int, fractions, noun: str) -> Tuple[Tuple[float, ...], Tuple[int, int, int]]:
    """Validated ``fractions`` (three non-negative numbers summing to 1) and the split sizes of
    ``total`` ``noun`` (e.g. "events") they give, none of them empty; ValueError otherwise."""
    try:
        fr = tuple(float(f) for f in fractions)
    except (TypeError, ValueError):
        raise ValueError(f"fractions must be three numbers (train, val, test), got {fractions!r}") from None
    if len(fr) != 3 or not all(math.isfinite(f) and f >= 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6:
        raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {fractions!r}")
    sizes = split_sizes(total, fr)
    if min(sizes) < 1:
        raise ValueError(f"fractions {fr} of {total} {noun} leave a split empty (train/val/test = {sizes})")
    return fr, sizes


def write_splits(out_dir, sizes: Sequence[int], write_split: Callable[..., None],
                 progress: Callable[[int], None] | None = None) -> Dict[str, Path]:
    """Write ``<out_dir>/<split>.h5`` for each of :data:`SPLITS`; returns ``{split: path}``.

    ``write_split(tmp, name, index, n, progress)`` writes split ``name`` (number ``index``, ``n``
    items) to the temporary ``tmp``, calling ``progress(k)`` as it goes. The three are written in a
    child process -- HDF5 can crash the process that saw a write fail (a full disk: SIGSEGV in
    h5py's cleanup) -- and renamed into place only when all three are complete, so a failure
    leaves the older set whole and no temporary behind. Creates ``out_dir`` if needed (and removes
    it again after a failure). A failed write raises OSError (one line, naming ``out_dir``), a
    crash of the writer OSError ENOSPC when the disk is full and RuntimeError otherwise; other
    exceptions keep their type where it is a builtin one.
    """
    out_dir = Path(out_dir)
    made = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".probe.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as exc:  # /proc/x, a read-only or foreign directory: one line, nothing written
        raise ValueError(f"cannot write into {out_dir}: {exc.strerror or exc}") from None
    finals = split_paths(out_dir)
    try:
        with atomic_paths(list(finals.values())) as temps:

            def write_all(report: Callable[[int], None]) -> None:
                for i, (tmp, name, n) in enumerate(zip(temps, SPLITS, sizes)):
                    write_split(tmp, name, i, n, report)

            _in_child(write_all, progress, out_dir)
    except BaseException:
        if made and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise
    return finals


def _in_child(work: Callable[[Callable[[int], None]], None], progress: Callable[[int], None] | None,
              out_dir: Path) -> None:
    """``work(report)`` in a forked child; ``report(k)`` reaches ``progress`` here."""
    import faulthandler
    import multiprocessing

    ctx = multiprocessing.get_context("fork")  # the writer's closures are not picklable
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        receive.close()
        # the parent reports a failure here in one line; HDF5's own tracebacks after a failed
        # write (a dozen, from its objects' cleanup) are not for the user's screen
        faulthandler.disable()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        try:
            work(lambda k: send.send(("progress", k)))
            send.send(("done",))
        except BaseException as exc:
            send.send(("error", type(exc).__name__, getattr(exc, "errno", None), str(exc)))
        finally:
            send.close()

    writer = ctx.Process(target=child, name="hpcdl-data-writer")
    writer.start()
    send.close()
    outcome: tuple = ()
    try:
        while True:
            try:
                message = receive.recv()
            except EOFError:
                break
            if message[0] == "progress":
                if progress is not None:
                    progress(message[1])
            else:
                outcome = message
    finally:
        if outcome == () and writer.is_alive():  # interrupted here: the writer goes too
            writer.terminate()
        writer.join()
        receive.close()
    if outcome == ("done",) and writer.exitcode == 0:
        return
    raise _writer_failure(outcome, writer.exitcode, out_dir)


def _writer_failure(outcome: tuple, exitcode: int | None, out_dir: Path) -> Exception:
    """The data writer's failure as the parent raises it: a disk error by its errno, an exception
    of Python's own by its kind, otherwise a RuntimeError that says what the child said."""
    import builtins
    import errno

    _, kind, code, message = outcome if outcome and outcome[0] == "error" else (None, None, None, None)
    if not isinstance(code, int) or code <= 0:
        # after a failed write HDF5 raises what it likes (RuntimeError: "Can't decrement id ref
        # count") or crashes: the disk, with the temporaries still on it, tells
        st = os.statvfs(out_dir)
        if st.f_bavail * st.f_frsize < 1 << 20:
            code = errno.ENOSPC
    if isinstance(code, int) and code > 0:  # h5py's messages run over lines: the errno is enough
        return OSError(code, os.strerror(code), str(out_dir))
    if kind is None:
        return RuntimeError(f"the data writer died (exit status {exitcode})")
    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RuntimeError(f"{kind}: {message}")


# --------------------------------------------------------------------------------------------------
# atomic output files


def new_figure(figsize: Tuple[float, float], dpi: int, nrows: int = 1, ncols: int = 1) -> Tuple[Any, Any]:
    """``(figure, axes)`` on the Agg canvas (no display needed, and pyplot's global backend is left
    alone): one subplot, or an array of ``nrows`` × ``ncols``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    if nrows == ncols == 1:
        return fig, fig.add_subplot(1, 1, 1)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def save_png(fig, path: Path, **savefig_kw) -> Path:
    """Lay ``fig`` out and write it to ``path`` as PNG, atomically; returns ``path``."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", **savefig_kw)
    return path


def table_format(path: Path, what: str) -> str:
    """``"npz"`` or ``"csv"`` from ``path``'s suffix (any case); ValueError naming ``what`` else."""
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".csv"):
        raise ValueError(f"{what} file must end in .npz or .csv, got {path.name!r}")
    return suffix[1:]


def csv_lines(path: Path, header: str) -> list:
    """The non-blank data lines of the CSV file ``path``, after checking its first line is ``header``."""
    with open(path) as f:
        first = f.readline().strip()
        lines = [line for line in f if line.strip()]
    if first != header:
        raise ValueError(f"{path}: expected the header {header!r}, got {first!r}")
    return lines
