"""Full disks and quotas: writes that must not stop a run, and a report that survives them.

On a shared file system a run meets ENOSPC (the file system is full) and EDQUOT (the user's or the
project's quota is) at any moment. The rules:

* a write that fails leaves no partial file and the previous good version in place (the writers
  publish through a temporary and a rename; :func:`save_checkpoint` removes what a failed
  TensorFlow save left behind and never touches the last recorded checkpoint);
* training goes on: :func:`attempt` turns a storage failure into a recorded problem and returns
  False (any other error still raises: a bug must not be hidden);
* the problem is visible in ``hpcdl status``: each writer keeps a :class:`StorageReport`, a small
  file of fixed size created in advance and rewritten *in place* (``pwrite`` over blocks it already
  owns), so recording "the disk is full" does not itself need a free block. ``hpcdl status``
  reads these files (and checks the free space of the run's file systems itself).

Pure stdlib; nothing here imports TensorFlow (its errors are recognised by their message).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

from hpcdl.fs.access import Access

log = logging.getLogger("hpcdl.fs.storage")

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_MESSAGES = tuple(os.strerror(e) for e in sorted(STORAGE_ERRNOS)) + ("quota exceeded",)
REPORT_FILE = "storage.json"
REPORT_SIZE = 4096
_MAX_ERROR_CHARS = 160


def is_storage_full(exc: BaseException | None) -> bool:
    """True for ENOSPC/EDQUOT: an OSError with that errno, or (TensorFlow, h5py) an error whose
    message says so, anywhere in the exception's cause/context chain."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
            return True
        if not isinstance(exc, OSError) or exc.errno is None:
            text = str(exc).lower()
            if any(m.lower() in text for m in _MESSAGES):
                return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _short(exc: BaseException) -> str:
    """One line; TensorFlow's ``{{function_node ...}}`` prefix dropped; a long message keeps its
    head and its tail (where TensorFlow puts the cause, e.g. "No space left on device")."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = re.sub(r"^\{\{[^}]*\}\}\s*", "", text)
    if len(text) <= _MAX_ERROR_CHARS:
        return text
    head = 50
    return text[:head] + "…" + text[-(_MAX_ERROR_CHARS - head - 1):]


class StorageReport:
    """Storage problems of one writer (a group root, the applier), kept in a fixed-size file.

    ``failed(what, exc)`` records or updates the problem ``what`` ("checkpoint", "metrics",
    "exchange publish", ...); ``succeeded(what)`` clears it (remembering it under ``recovered``).
    The file is created with :data:`REPORT_SIZE` bytes when the report is made, while there is
    space, and afterwards only rewritten in place. If it cannot be created or written, problems
    are still logged and kept in memory (:attr:`problems`).
    """

    def __init__(self, path: str | os.PathLike[str], access: Access | None = None):
        self.path = Path(path)
        self.access = access or Access.of_directory(self.path.parent)
        self.problems: dict[str, dict[str, Any]] = {}
        self.recovered: dict[str, dict[str, Any]] = {}
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
                         | getattr(os, "O_NOFOLLOW", 0), self.access.file_mode)
        except OSError as e:
            log.warning("cannot open the storage report %s: %s", self.path, e)
            return
        try:
            if os.fstat(fd).st_size < REPORT_SIZE:
                os.pwrite(fd, self._encode(), 0)
        except OSError as e:
            log.warning("cannot reserve the storage report %s: %s", self.path, e)
        self._fd = fd

    def _encode(self) -> bytes:
        doc: dict[str, Any] = {"problems": self.problems, "recovered": self.recovered,
                               "host": socket.gethostname(), "pid": os.getpid(),
                               "updated": time.time()}
        data = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        while len(data) > REPORT_SIZE - 1 and (doc["recovered"] or len(doc["problems"]) > 1):
            if doc["recovered"]:  # drop history first, then the oldest problems
                doc["recovered"] = {}
            else:
                oldest = min(doc["problems"], key=lambda k: doc["problems"][k]["last"])
                doc["problems"] = {k: v for k, v in doc["problems"].items() if k != oldest}
            data = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        data = data[:REPORT_SIZE - 1]
        return data + b" " * (REPORT_SIZE - 1 - len(data)) + b"\n"

    def _flush(self) -> None:
        self._open()
        if self._fd is None:
            return
        try:
            os.pwrite(self._fd, self._encode(), 0)
        except OSError as e:
            log.warning("cannot update the storage report %s: %s", self.path, e)

    def failed(self, what: str, exc: BaseException, *, path: str | os.PathLike[str] | None = None,
               detail: str = "") -> None:
        now = time.time()
        with self._lock:
            p = self.problems.setdefault(what, {"first": now, "count": 0})
            p.update(last=now, count=p["count"] + 1, error=_short(exc),
                     errno=getattr(exc, "errno", None),
                     path=str(path if path is not None else getattr(exc, "filename", "") or ""),
                     detail=detail[:_MAX_ERROR_CHARS])
            self.recovered.pop(what, None)
            self._flush()
        log.warning("storage problem (%s, %d×): %s%s", what, p["count"], p["error"],
                    f" — {detail}" if detail else "")

    def succeeded(self, what: str) -> None:
        if what not in self.problems:
            return
        with self._lock:
            p = self.problems.pop(what, None)
            if p is None:
                return
            self.recovered[what] = {"count": p["count"], "error": p["error"], "at": time.time()}
            self._flush()
        log.info("storage problem cleared (%s) after %d failures", what, p["count"])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_report(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A report as written (None when there is none; ``{"unreadable": True}`` when torn)."""
    try:
        with open(path, "rb") as f:
            data = f.read(REPORT_SIZE + 1)
    except OSError:
        return None
    try:
        doc = json.loads(data.decode("utf-8"))
    except ValueError:
        return {"unreadable": True, "problems": {}, "recovered": {}}
    return doc if isinstance(doc, dict) else {"unreadable": True, "problems": {}, "recovered": {}}


def attempt(report: StorageReport, what: str, fn: Callable[..., Any], *args: Any,
            **kwargs: Any) -> bool:
    """Run ``fn``; a storage failure is recorded under ``what`` and gives False, not an error."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        if not is_storage_full(e):
            raise
        report.failed(what, e)
        return False
    report.succeeded(what)
    return True


# ------------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------------


def recorded_checkpoint(directory: str | os.PathLike[str]) -> str | None:
    """The checkpoint prefix (a file name) that TensorFlow's ``checkpoint`` state file names."""
    try:
        text = (Path(directory) / "checkpoint").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model_checkpoint_path":
            return Path(value.strip().strip('"')).name or None
    return None


def _entries(directory: Path) -> set[str]:
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


def save_checkpoint(report: StorageReport, save: Callable[[], Any],
                    directory: str | os.PathLike[str], number: int, prefix: str = "ckpt") -> bool:
    """Run a checkpoint ``save()`` (e.g. ``CheckpointManager.save``) of checkpoint ``number``.

    On ENOSPC/EDQUOT: everything the failed save left (``<prefix>-<number>.*``, its ``_temp``
    directory, TensorFlow's state-file temporaries) is removed unless the state file already
    names this checkpoint (then it is complete), the last recorded checkpoint is untouched, the
    problem is recorded, and False is returned. Other errors raise.

    A checkpoint is never overwritten in place: TensorFlow replaces a checkpoint's index and data
    files one after the other, so re-saving the number the state file names could leave its only
    recorded copy torn. Such a save is refused (logged, False). (The engine numbers checkpoints by
    step and resumes after the restored one, so this does not happen in a sane run.)
    """
    directory = Path(directory)
    if recorded_checkpoint(directory) == f"{prefix}-{number}":
        log.warning("not saving checkpoint %s-%d over the recorded checkpoint of that number in %s",
                    prefix, number, directory)
        return False
    before = _entries(directory)
    try:
        save()
    except Exception as e:
        if not is_storage_full(e):
            raise
        kept = recorded_checkpoint(directory)
        mine = f"{prefix}-{number}"
        removed = []
        if kept != mine:
            for name in sorted(_entries(directory)):
                ours = (name == mine or name.startswith(mine + ".") or name.startswith(mine + "_temp"))
                if ours or (name.startswith("checkpoint.tmp") and name not in before):
                    target = directory / name
                    try:
                        if target.is_dir() and not target.is_symlink():
                            shutil.rmtree(target)
                        else:
                            target.unlink()
                        removed.append(name)
                    except FileNotFoundError:
                        pass
        report.failed("checkpoint", e, path=directory,
                      detail=f"step {number} not saved; kept {kept or 'no checkpoint yet'}"
                             + (f"; removed {len(removed)} partial files" if removed else ""))
        return False
    report.succeeded("checkpoint")
    return True


# ------------------------------------------------------------------------------------------------
# free space, for `hpcdl status`
# ------------------------------------------------------------------------------------------------

LOW_SPACE_BYTES = 256 << 20
LOW_INODES = 1000


def low_space(path: str | os.PathLike[str]) -> str | None:
    """A one-line warning when the file system of ``path`` is nearly full, else None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if st.f_blocks and free < LOW_SPACE_BYTES:
        return f"{free / 2**20:.1f} MiB free on the file system of {path}"
    if st.f_files and st.f_favail < LOW_INODES:
        return f"{st.f_favail} free inodes on the file system of {path}"
    return None
