"""Who may touch a run: the access policy of its files and its per-run secret.

Access
======
A run directory and its exchange directory sit on a file system shared with every other user of
the machine. Whatever the user's umask:

* **owner only** (the default): directories ``0700``, files ``0600``, the key ``0400``;
* **group only** (the job sets ``run.unix_group = "proj"``): directories ``2770`` (setgid, so
  every file created below inherits the group) owned by that group, files ``0660``, the key
  ``0440``. Members of the group are trusted as much as the owner: they can read the key and so
  write exchange files, cancel, evaluate.

Processes of a run (ranks, the applier) set their umask from the policy (:func:`restrict_umask`),
so files that other libraries create (TensorFlow checkpoints, TensorBoard events) follow it too;
files this package writes get their modes explicitly, never from the umask.

The per-run secret
==================
``<run>/run.key``: 32 random bytes (hex, one line), created at submit time by
:func:`hpcdl.runs.create_run` with ``O_EXCL`` in the owner-only (or group-only) mode. Every
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KEY_FILE = "run.key"
KEY_BYTES = 32
_MAX_KEY_FILE = 1024


class RunKeyError(ValueError):
    """The run's key is missing, malformed or not protected well enough to be trusted."""


@dataclass(frozen=True)
class Access:
    """Modes of a run's files: owner only (``gid=None``) or group only (``gid``: the group)."""

    gid: int | None = None

    @property
    def group(self) -> bool:
        return self.gid is not None

    @property
    def dir_mode(self) -> int:
        return 0o2770 if self.group else 0o700

    @property
    def file_mode(self) -> int:
        return 0o660 if self.group else 0o600

    @property
    def key_mode(self) -> int:
        return 0o440 if self.group else 0o400

    @property
    def umask(self) -> int:
        return 0o007 if self.group else 0o077

    @classmethod
    def for_group_name(cls, name: str) -> "Access":
        """Group-only access for unix group ``name`` ("" or None: owner only)."""
        if not name:
            return cls()
        import grp

        try:
            gid = grp.getgrnam(name).gr_gid
        except KeyError:
            raise RunKeyError(f"run.unix_group: no unix group named {name!r}") from None
        if os.geteuid() != 0 and gid not in os.getgroups() and gid != os.getegid():
            raise RunKeyError(f"run.unix_group: you are not a member of group {name!r}")
        return cls(gid)

    @classmethod
    def of_directory(cls, path: str | os.PathLike[str]) -> "Access":
        """The policy a directory was made with: group only if it is setgid with group access."""
        try:
            st = os.stat(path)
        except OSError:
            return cls()
        if st.st_mode & stat.S_ISGID and st.st_mode & 0o070:
            return cls(st.st_gid)
        return cls()

    # -- applying it ---------------------------------------------------------------------------

    def fix_dir(self, path: str | os.PathLike[str]) -> None:
        """Give an existing directory (of ours) the policy's group and mode."""
        if self.gid is not None:
            os.chown(path, -1, self.gid)
        os.chmod(path, self.dir_mode)

    def make_dir(self, path: str | os.PathLike[str], *, tighten: bool = True) -> bool:
        """Create ``path`` and any missing parents with the policy's mode; True if it was made.

        With ``tighten``, a directory that already exists is tightened to the policy when it is
        ours and looser than the policy (never loosened; someone else's is left alone).
        """
        path = Path(path)
        missing = []
        p = path
        while not p.exists():
            missing.append(p)
            if p.parent == p:
                break
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                continue
            self.fix_dir(d)
        if not missing and tighten:
            self.tighten_dir(path)
        return bool(missing)

    def tighten_dir(self, path: str | os.PathLike[str]) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return
        if st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
            return
        allowed = self.dir_mode & 0o777
        if st.st_mode & 0o777 & ~allowed:
            os.chmod(path, (st.st_mode & 0o7777 & ~0o777) | (st.st_mode & allowed))

    def fix_file(self, path: str | os.PathLike[str], *, keep_exec: bool = True) -> None:
        """Give an existing file the policy's mode (keeping the owner's execute bit if set)."""
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return
        mode = self.file_mode
        if keep_exec and st.st_mode & stat.S_IXUSR:
            mode |= 0o110 if self.group else 0o100
        if self.gid is not None and st.st_gid != self.gid:
            os.chown(path, -1, self.gid)
        if st.st_mode & 0o7777 != mode:
            os.chmod(path, mode)

    def open_new(self, path: str | os.PathLike[str], flags: int = 0) -> int:
        """``open(path, O_CREAT | O_EXCL | O_WRONLY)`` with the policy's mode, whatever the umask."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                     | getattr(os, "O_NOFOLLOW", 0) | flags, self.file_mode)
        if self.group:  # the umask may have removed the group bits; the setgid dir gave the gid
            try:
                os.fchmod(fd, self.file_mode)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def open_append(self, path: str | os.PathLike[str]) -> int:
        """Open ``path`` for appending (and reading its end), creating it with the policy's mode."""
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                     | getattr(os, "O_NOFOLLOW", 0), self.file_mode)
        if self.group:
            try:
                if os.fstat(fd).st_mode & 0o7777 != self.file_mode:
                    os.fchmod(fd, self.file_mode)
            except OSError:
                pass  # someone else's file in a shared directory: keep its mode
        return fd


def access_for_job(job: Any) -> Access:
    """The access policy a job asks for (``run.unix_group``)."""
    return Access.for_group_name(getattr(job.run, "unix_group", "") or "")


def restrict_umask(access: Access) -> int:
    """Set this process's umask to the policy's (files other libraries create); returns the old."""
    return os.umask(access.umask)


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


def run_signer(run_root: str | os.PathLike[str]):
    """The :class:`hpcdl.exchange.Signer` of a run: keyed tags (Poly1305) under the run's key."""
    from hpcdl.exchange import Signer

    return Signer(load_key(run_root))
