"""Who may touch a run's files: the access policy of a run directory and its exchange.

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
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class AccessError(ValueError):
    """A run's access policy that cannot be had here (no such group, not a member of it)."""


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
            raise AccessError(f"run.unix_group: no unix group named {name!r}") from None
        if os.geteuid() != 0 and gid not in os.getgroups() and gid != os.getegid():
            raise AccessError(f"run.unix_group: you are not a member of group {name!r}")
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
