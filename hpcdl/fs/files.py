"""The one place hpcdl publishes a file or appends a line to one.

* :func:`atomic_write` (with :func:`atomic_write_bytes` and :func:`atomic_write_json`, which give
  a file its directory's access policy; :func:`atomic_path` for writers that need a file name,
  such as h5py; :func:`atomic_paths` for several files published together): the whole file
  under ``.tmp-<uuid>-<name>`` in the destination directory, flushed and fsynced, renamed onto
  the name, the directory fsynced. Readers see the old file or the new one, never a part; a
  failure (a full disk, a quota) removes the temporary and raises, and the old file stays.
  ``fsync=False`` keeps the atomicity and skips the two fsyncs, for files nothing depends on
  after a crash of the node (the exchange protocol says which).
* :func:`append_lines`: whole lines at the end of a file opened with ``O_APPEND``; a line torn by
  an earlier crash is terminated first, and a write that fails is cut off again, so the file
  stays a sequence of whole lines.
* :func:`append_records`: fixed-width binary records at the end of a file of one writer; a record
  torn by an earlier crash is cut off first, so the file stays a sequence of whole records.
* :func:`append_jsonl` and :func:`read_jsonl`: JSON lines (metrics, the applier's events) on top
  of those two: one object a line, a torn or garbled line skipped when read.
* :func:`read_regular`: the bytes of a file hpcdl reads whole (job files, JSON records, planner
  inputs), refused unless it is a regular file of bounded size: a symlink to ``/dev/zero`` or a
  FIFO must not fill the memory or hang a command.

Files get the mode of an :class:`hpcdl.fs.access.Access` policy (owner-only by default), whatever
the umask; :func:`atomic_path` without one follows the umask, like ``open(path, "w")``.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from hpcdl.fs.access import Access

TMP_PREFIX = ".tmp-"

# Larger than any record hpcdl writes (a job file, run.json, a state or stats file, a manifest).
MAX_RECORD_BYTES = 16 << 20


def temporary_for(path: Path) -> Path:
    return path.parent / f"{TMP_PREFIX}{uuid.uuid4().hex}-{path.name}"


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename in it is durable (ignored where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None], *, fsync: bool = True,
                 access: Access | None = None) -> Path:
    """Publish ``path`` with what ``write(file)`` writes (see the module docstring)."""
    with atomic_path(path, access=access or Access(), fsync=fsync) as tmp:
        with open(tmp, "r+b") as f:
            write(f)
    return Path(path)


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True,
                       access: Access | None = None) -> Path:
    """Publish ``data`` at ``path``. Without ``access`` the file takes the policy of the directory
    it lands in (owner-only, or group-only in a group-only run's directory); a missing directory
    is made with its nearest existing ancestor's policy."""
    path = Path(path)
    if not path.parent.is_dir():
        Access.of_directory(_existing_ancestor(path.parent)).make_dir(path.parent)
    return atomic_write(path, lambda f: f.write(data), fsync=fsync,
                        access=access or Access.of_directory(path.parent))


def atomic_write_json(path: Path, data: Any, *, fsync: bool = True) -> Path:
    """:func:`atomic_write_bytes` of ``data`` as indented JSON with sorted keys."""
    return atomic_write_bytes(path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(), fsync=fsync)


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


@contextmanager
def atomic_path(path: Path, *, access: Access | None = None, fsync: bool = True) -> Iterator[Path]:
    """A temporary path next to ``path`` to write by name; published onto ``path`` on success."""
    with atomic_paths([path], access=access, fsync=fsync) as (tmp,):
        yield tmp


@contextmanager
def atomic_paths(paths: list[Path], *, access: Access | None = None, fsync: bool = True) -> Iterator[list[Path]]:
    """Temporaries beside several files, published together once the block ends well: each is
    renamed onto its file only after every one is written (and flushed to disk), so a failure
    leaves all the old files and no temporary. (A crash between two renames can still leave a mix;
    readers that need a consistent set check it, e.g. by a shared id.)"""
    paths = [Path(p) for p in paths]
    temporaries: list[Path] = []
    try:
        for path in paths:
            tmp = temporary_for(path)
            os.close(access.open_new(tmp) if access else os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            temporaries.append(tmp)
        yield temporaries
        if fsync:
            for tmp in temporaries:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        for tmp, path in zip(temporaries, paths):
            os.replace(tmp, path)
    except BaseException:
        for tmp in temporaries:
            tmp.unlink(missing_ok=True)
        raise
    if fsync:
        for directory in dict.fromkeys(path.parent for path in paths):
            fsync_dir(directory)


def append_lines(path: Path, data: bytes, *, access: Access, fsync: bool = False) -> int:
    """Append ``data`` (whole lines, each ending in a newline) to ``path`` (module docstring);
    returns the file's size after it.

    Exact for a single writer; concurrent writers of small records keep whole lines (O_APPEND)."""

    def mend(fd: int, start: int) -> tuple[int, bytes]:
        if start > 0 and os.pread(fd, 1, start - 1) != b"\n":
            return start, b"\n" + data  # terminate a line torn by a crash
        return start, data

    return _append(path, mend, access=access, fsync=fsync)


def append_records(path: Path, data: bytes, record_size: int, *, access: Access) -> int:
    """Append whole fixed-width records to ``path``, which only this process writes (module
    docstring); returns the file's size after it."""
    if len(data) % record_size:
        raise ValueError(f"{len(data)} bytes are not whole records of {record_size}")

    def mend(fd: int, end: int) -> tuple[int, bytes]:
        start = end - end % record_size
        if start != end:  # a record torn by a kill: the next ones must start on a boundary
            os.ftruncate(fd, start)
        return start, data

    return _append(path, mend, access=access, fsync=False)


def _append(path: Path, mend: Callable[[int, int], tuple[int, bytes]], *, access: Access,
            fsync: bool) -> int:
    """One write at the end of ``path``, after ``mend(fd, size)`` repaired what a crash tore and
    said where the write starts and what it writes; returns the file's size after it."""
    fd = access.open_append(path)
    try:
        start, data = mend(fd, os.lseek(fd, 0, os.SEEK_END))
        try:
            # one write, so that concurrent appenders' lines do not interleave; a short write to
            # a regular file means the disk or the quota is full
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            if fsync:
                os.fsync(fd)
        except OSError:
            # A full disk may have let part of the data in: cut it off again, so that a retry
            # cannot write a line twice.
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise
        return start + len(data)
    finally:
        os.close(fd)


def read_regular(path: str | os.PathLike[str], max_bytes: int = MAX_RECORD_BYTES, *,
                 tail: bool = False) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them.

    OSError (with ``strerror``) for a missing or unreadable file, for anything but a regular file
    and for a larger one; with ``tail`` a larger file gives its last ``max_bytes`` instead (a log
    read for its newest lines).
    """
    # O_NONBLOCK: opening a FIFO must not wait for a writer
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > max_bytes:
            if not tail:
                raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
            os.lseek(fd, info.st_size - max_bytes, os.SEEK_SET)
        chunks, left = [], max_bytes + 1  # one more: a file that grew past the bound is caught
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        if not tail:
            raise OSError(errno.EFBIG, f"larger than {max_bytes} bytes", str(path))
        data = data[-max_bytes:]
    return data


def append_jsonl(path: str | os.PathLike[str], *records: dict[str, Any], access: Access | None = None,
                 fsync: bool = False) -> int:
    """Append ``records``, one JSON object a line, in one :func:`append_lines` (created with
    ``access``, by default its directory's policy); returns the file's size after it."""
    path = Path(path)
    data = b"".join(json.dumps(r, sort_keys=True, separators=(",", ":")).encode() + b"\n" for r in records)
    return append_lines(path, data, access=access or Access.of_directory(path.parent), fsync=fsync)


# metrics.jsonl of a run of days is a few MB; beyond this its newest lines are read
MAX_JSONL_BYTES = 64 << 20


def read_jsonl(path: str | os.PathLike[str], max_bytes: int = MAX_JSONL_BYTES) -> list[dict[str, Any]]:
    """Every complete object line of the newest ``max_bytes``; a torn last line (a writer killed
    mid-write), a first line cut by that bound or a garbled one is skipped; a missing file, a
    directory or anything but a regular file has none."""
    try:
        text = read_regular(path, max_bytes, tail=True).decode("utf-8", errors="replace")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
