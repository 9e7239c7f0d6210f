"""The HEP data files' layouts, and the checks a file passes before anything is read from it.

Two on-disk layouts are recognised (:func:`open_hep` detects which one a file has):

``nersc``
    The published NERSC RPV-SUSY layout (and the one :mod:`hpcdl.workloads.hep.generate` writes):
    a group ``all_events`` holding ``hist``, ``histEM``, ``histtrack`` (each ``(N, H, W)``: total
    calorimeter energy, EM energy, track multiplicity on an η×φ grid), ``y`` (``(N,)``, 1 signal,
    0 background; required), ``weight`` (``(N,)`` cross-section event weight; optional, default 1)
    and ``passSR`` (``(N,)`` the cut-based signal-region flag; optional).

``benchmark``
    The hep_cnn_benchmark layout: top-level ``data`` ``(N, 3, H, W)`` (channels first), ``label``
    ``(N,)`` integers or ``(N, 2)`` one-hot (column 1 = signal), and optionally ``weight``
    ``(N,)``, ``normweight`` ``(N,)`` (validated but not used) and ``psr`` ``(N,)`` (the
    signal-region flag).

Whatever the layout, images come out NHWC float32 with channels (hist, histEM, histtrack) (the
benchmark layout's axis 1, in order), labels int32, weights float32, the selection flag bool (or
``None`` when the file has none) and the global event index int64.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator, Optional, Tuple

import h5py
import numpy as np

from hpcdl.workloads import common

LAYOUT_NERSC = "nersc"
LAYOUT_BENCHMARK = "benchmark"

#: Channel order of the NHWC images the reader returns.
CHANNELS = ("hist", "histEM", "histtrack")

NERSC_GROUP = "all_events"
DEFAULT_CHUNK = 4096


class DataError(common.DataFileError):
    """A HEP data file is missing, unreadable or does not have a layout this module understands."""


_fail = DataError.at
_dataset = partial(common.h5_dataset, DataError)


# --------------------------------------------------------------------------------------------------
# layout detection and validation


@dataclass(frozen=True)
class HepFile:
    """A validated HEP data file: its layout and shape, with no data read yet.

    Read event ranges with :class:`hpcdl.workloads.hep.data.HepReader`.
    """

    path: Path
    layout: str
    n_events: int
    image_shape: Tuple[int, int, int]  # (H, W, 3)
    has_weight: bool
    has_pass_sr: bool


def _check_per_event(path: Path, ds: Optional[h5py.Dataset], name: str, n: int) -> None:
    if ds is None:
        return
    if ds.shape != (n,):
        raise _fail(path, f"{name} has shape {ds.shape}, expected ({n},) (one value per event)")


def open_hep(path) -> HepFile:
    """Detect and validate the layout of the HEP file at ``path``.

    Raises :class:`DataError` (a :class:`ValueError`) naming the file and the problem when the file
    is missing, is not HDF5, lacks a required dataset, has datasets of the wrong rank or with
    disagreeing event counts or image sizes, or holds no events. Reads shapes only, no data.
    """
    path = Path(path)
    with common.open_h5(DataError, path) as f, h5_errors(path):
        if NERSC_GROUP in f:
            return _validate_nersc(path, f)
        if "data" in f:
            return _validate_benchmark(path, f)
        present = ", ".join(sorted(str(k) for k in f.keys())) or "nothing"
        raise _fail(
            path,
            f"unrecognised layout: expected a group '{NERSC_GROUP}' (NERSC RPV-SUSY layout) or a "
            f"dataset 'data' (hep_cnn_benchmark layout); found: {present}",
        )


# Bounds on what a file may declare, checked before anything is read: a corrupted or hostile
# header must not make the reader allocate terabytes (the real sets: ~10^7 events of 224×224).
MAX_EVENTS = 1 << 32
MAX_IMAGE_SIDE = 8192
MAX_CHUNK_BYTES = 256 << 20  # one HDF5 chunk is inflated whole on every read that touches it


@contextmanager
def h5_errors(path: Path) -> Iterator[None]:
    """h5py reports a corrupted file with KeyError, RuntimeError, OSError or TypeError from deep
    inside; the user gets one DataError naming the file instead."""
    try:
        yield
    except DataError:
        raise
    except (KeyError, RuntimeError, OSError, TypeError, ValueError) as exc:
        detail = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise _fail(path, f"corrupted or unreadable HDF5 content ({detail})") from None


def _check_bounds(path: Path, ds: h5py.Dataset, name: str, n: int, side: Tuple[int, ...] = ()) -> None:
    if n > MAX_EVENTS:
        raise _fail(path, f"{name} declares {n} events, more than the {MAX_EVENTS} hpcdl reads")
    if any(s > MAX_IMAGE_SIDE for s in side):
        raise _fail(path, f"{name} declares images of {side}, larger than {MAX_IMAGE_SIDE} a side")
    if ds.chunks is not None:
        chunk_bytes = int(np.prod(ds.chunks, dtype=np.int64)) * ds.dtype.itemsize
        if chunk_bytes > MAX_CHUNK_BYTES:
            raise _fail(path, f"{name} has HDF5 chunks of {chunk_bytes} bytes, more than {MAX_CHUNK_BYTES}")


def _validate_nersc(path: Path, f: h5py.File) -> HepFile:
    g = f[NERSC_GROUP]
    if not isinstance(g, h5py.Group):
        raise _fail(path, f"'{NERSC_GROUP}' is a dataset, expected a group")
    where = f"{NERSC_GROUP}/"
    images = [_dataset(path, g, key, where) for key in CHANNELS]
    for ds, key in zip(images, CHANNELS):
        if ds.ndim != 3:
            raise _fail(path, f"{where}{key} has shape {ds.shape}, expected (N, H, W)")
    shape0 = images[0].shape
    for ds, key in zip(images[1:], CHANNELS[1:]):
        if ds.shape != shape0:
            raise _fail(
                path, f"{where}{key} has shape {ds.shape} but {where}{CHANNELS[0]} has {shape0}"
            )
    n, h, w = shape0
    if n == 0:
        raise _fail(path, "holds zero events")
    if h == 0 or w == 0:
        raise _fail(path, f"images have an empty shape {h}×{w}")
    for ds, key in zip(images, CHANNELS):
        _check_bounds(path, ds, f"{where}{key}", n, (h, w))
    y = _dataset(path, g, "y", where)
    _check_per_event(path, y, f"{where}y", n)
    weight = _dataset(path, g, "weight", where) if "weight" in g else None
    _check_per_event(path, weight, f"{where}weight", n)
    sr = _dataset(path, g, "passSR", where) if "passSR" in g else None
    _check_per_event(path, sr, f"{where}passSR", n)
    return HepFile(path, LAYOUT_NERSC, n, (h, w, 3), weight is not None, sr is not None)


def _validate_benchmark(path: Path, f: h5py.File) -> HepFile:
    data = _dataset(path, f, "data", "")
    if data.ndim != 4 or data.shape[1] != 3:
        raise _fail(path, f"data has shape {data.shape}, expected (N, 3, H, W)")
    n, _, h, w = data.shape
    if n == 0:
        raise _fail(path, "holds zero events")
    if h == 0 or w == 0:
        raise _fail(path, f"images have an empty shape {h}×{w}")
    _check_bounds(path, data, "data", n, (h, w))
    label = _dataset(path, f, "label", "")
    if label.shape not in ((n,), (n, 2)):
        raise _fail(path, f"label has shape {label.shape}, expected ({n},) or ({n}, 2) one-hot")
    weight = _dataset(path, f, "weight", "") if "weight" in f else None
    _check_per_event(path, weight, "weight", n)
    normweight = _dataset(path, f, "normweight", "") if "normweight" in f else None
    _check_per_event(path, normweight, "normweight", n)
    psr = _dataset(path, f, "psr", "") if "psr" in f else None
    _check_per_event(path, psr, "psr", n)
    return HepFile(path, LAYOUT_BENCHMARK, n, (h, w, 3), weight is not None, psr is not None)


def as_hep(path_or_file) -> HepFile:
    return path_or_file if isinstance(path_or_file, HepFile) else open_hep(path_or_file)


