"""The per-run secret of a run (its files' access policy is hpcdl.fs.access).

``<run>/run.key``: 32 random bytes (hex, one line), created at submit time by
:func:`hpcdl.rundir.runs.create_run` with ``O_EXCL`` in the owner-only (or group-only) mode. Every
:class:`hpcdl.exchange.Channel` of the run uses it as the key of its tags (:func:`run_signer`), so
an exchange file written by anybody without the key (another user, another run, a stale process of
an older run) fails its tag check and is rejected like a corrupt one. :func:`load_key` refuses a
key file that is not a regular file, is a symlink, is larger than a key, or that anyone outside
the owner (and, in group mode, the group) could read or change.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from hpcdl.fs.access import Access
from hpcdl.exchange.format import Signer

KEY_FILE = "run.key"
KEY_BYTES = 32
_MAX_KEY_FILE = 1024


class RunKeyError(ValueError):
    """The run's key is missing, malformed or not protected well enough to be trusted."""


# ------------------------------------------------------------------------------------------------
# the key
# ------------------------------------------------------------------------------------------------


def key_path(run_root: str | os.PathLike[str]) -> Path:
    return Path(run_root) / KEY_FILE


def create_key(run_root: str | os.PathLike[str], access: Access | None = None) -> Path:
    """Create the run's secret (fails if one exists: a key is never replaced)."""
    access = access or Access()
    path = key_path(run_root)
    data = (secrets.token_bytes(KEY_BYTES).hex() + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                 | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
        if access.gid is not None:
            os.fchown(fd, -1, access.gid)
        os.fchmod(fd, access.key_mode)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def load_key_file(path: str | os.PathLike[str]) -> bytes:
    """Read and check a key file (see the module docstring); raises RunKeyError."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise RunKeyError(f"{path}: no run key (a run created before per-run keys, or a "
                          "damaged run directory); the exchange refuses to run without it") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunKeyError(f"{path}: is a symbolic link; refusing it as a key") from None
        raise RunKeyError(f"{path}: cannot read the run key ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunKeyError(f"{path}: not a regular file")
        if st.st_mode & 0o037:
            raise RunKeyError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o} lets others read or "
                              "change the key; expected 0400 (or 0440 for a group)")
        if st.st_size > _MAX_KEY_FILE:
            raise RunKeyError(f"{path}: {st.st_size} bytes, too large for a key")
        raw = os.read(fd, _MAX_KEY_FILE + 1)
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise RunKeyError(f"{path}: not a hex key") from None
    if len(key) < 16:
        raise RunKeyError(f"{path}: a key of {len(key)} bytes is too short")
    return key


def load_key(run_root: str | os.PathLike[str]) -> bytes:
    return load_key_file(key_path(run_root))


def run_signer(run_root: str | os.PathLike[str]) -> Signer:
    """The :class:`hpcdl.exchange.Signer` of a run: keyed tags (Poly1305) under the run's key."""
    return Signer(load_key(run_root))
