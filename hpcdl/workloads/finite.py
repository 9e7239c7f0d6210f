"""The scan that refuses data holding NaN or Inf before anything runs.

One NaN in a label or an input makes every gradient NaN from the first batch that holds it, and
a run that trained on it ends with a NaN model; so `submit`, `--dry-run`, `resume` and `evaluate`
read every floating-point value of the files the run will read once, before writing anything.

The scan streams each dataset along its first axis in slices of about `chunk_bytes`, so a file
larger than memory is fine. A file found finite is remembered in the user's cache directory
(``$XDG_CACHE_HOME/hpcdl/finite``, else ``~/.cache/hpcdl/finite``), keyed on the file's identity
(device, inode, size, modification time) and the datasets scanned, so submitting the same data
again costs nothing; a change to the file changes its key. Only "finite" is remembered, as a
small JSON file, and a missing or unreadable cache means scanning again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable, Sequence

import h5py
import numpy as np

from hpcdl.workloads.common import DataFileError

CHUNK_BYTES = 64 << 20

# progress(description, total bytes) -> advance(bytes); None: no progress shown
ProgressFactory = Callable[[str, int], Callable[[int], None]]


class NonFiniteData(DataFileError):
    """A data file holds NaN or Inf where the run reads numbers."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpcdl" / "finite"


def floating_datasets(f: h5py.File) -> list[str]:
    """Every floating-point dataset in the file (a workload that names none is scanned whole)."""
    names: list[str] = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and obj.dtype.kind in "fc":
            names.append(name)

    f.visititems(visit)
    return sorted(names)


def _identity(path: Path, datasets: Sequence[str] | None) -> str:
    st = path.stat()
    key = {"path": str(path.resolve()), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
           "mtime_ns": st.st_mtime_ns, "datasets": None if datasets is None else sorted(datasets)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _remembered(key: str) -> bool:
    try:
        return json.loads((cache_dir() / f"{key}.json").read_text()).get("finite") is True
    except (OSError, ValueError, AttributeError):
        return False


def _remember(key: str, path: Path) -> None:
    from hpcdl.fs.files import atomic_write_bytes

    try:
        cache_dir().mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(cache_dir() / f"{key}.json", json.dumps({"finite": True, "file": str(path)}).encode())
    except OSError:  # a read-only home: the next submit scans again
        pass


def first_non_finite(ds: h5py.Dataset, chunk_bytes: int = CHUNK_BYTES,
                     advance: Callable[[int], None] | None = None) -> tuple[int, float] | None:
    """(example index, value) of the first NaN or Inf along the first axis, else None."""
    if ds.dtype.kind not in "fc" or ds.size == 0:
        return None
    if ds.ndim == 0:
        value = ds[()]
        return None if np.all(np.isfinite(value)) else (0, float(np.ravel(value)[0]))
    row_bytes = max(1, int(np.prod(ds.shape[1:], dtype=np.int64)) * ds.dtype.itemsize)
    rows = max(1, chunk_bytes // row_bytes)
    for lo in range(0, ds.shape[0], rows):
        part = ds[lo:lo + rows]
        finite = np.isfinite(part).reshape(len(part), -1).all(axis=1)
        if not finite.all():
            i = int(np.argmin(finite))
            bad = np.ravel(part[i])
            return lo + i, float(np.real(bad[~np.isfinite(bad)][0]))
        if advance:
            advance(part.nbytes)
    return None


def check_file(path, datasets: Sequence[str] | None, chunk_bytes: int = CHUNK_BYTES,
               progress: ProgressFactory | None = None, use_cache: bool = True) -> None:
    """Raise NonFiniteData naming the file, the dataset and the first bad example, if any of
    `datasets` (None: every floating-point one) holds NaN or Inf."""
    path = Path(path)
    key = _identity(path, datasets) if use_cache else ""
    if key and _remembered(key):
        return
    try:
        with h5py.File(path, "r") as f:
            names = floating_datasets(f) if datasets is None else [d for d in datasets if d]
            present = [f[name] for name in names if name in f]
            total = sum(ds.size * ds.dtype.itemsize for ds in present if ds.dtype.kind in "fc")
            advance = progress(f"checking {path.name} for NaN/Inf", total) if progress and total else None
            for ds in present:
                found = first_non_finite(ds, chunk_bytes, advance)
                if found is not None:
                    index, value = found
                    raise NonFiniteData.at(path, f"{ds.name.lstrip('/')!r} holds {value} at example {index}: "
                                                 "remove or fix it (run.check_finite = false skips this scan)")
    except NonFiniteData:
        raise
    except OSError as exc:
        raise DataFileError.at(path, f"cannot be read for the NaN/Inf check ({exc})") from None
    if key:
        _remember(key, path)


def check_files(files: Iterable[tuple[str, str]], datasets: Sequence[str] | None,
                progress: ProgressFactory | None = None) -> None:
    """`check_file` for each (field, path) of a job's splits; the error names the field."""
    for field, path in files:
        try:
            check_file(path, datasets, progress=progress)
        except DataFileError as exc:
            raise type(exc)(f"{field}: {exc}") from None


def check_job_data(workload, job, progress: ProgressFactory | None = None) -> None:
    """The scan of the files a run of `job` trains and validates on (skipped by run.check_data or
    run.check_finite = false)."""
    if not (job.run.check_data and job.run.check_finite):
        return
    files = [("data.train", job.data.train)]
    if job.train.validate_every and getattr(job.data, "val", ""):
        files.append(("data.val", job.data.val))
    check_files(files, workload.finite_datasets(job.data), progress)
