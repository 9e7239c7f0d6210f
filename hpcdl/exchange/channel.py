"""The Channel: one run's exchange directory, its layout, publishing and reading.

The directory protocol is specified in :mod:`hpcdl.exchange`'s docstring; this module owns every
path inside an exchange directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcdl.exchange.format import (
    MAX_HEADER_BYTES, CorruptFile, Signer, Tensors, _is_int, read_file, write_file,
)
from hpcdl.fs.files import TMP_PREFIX
from hpcdl.fs.storage import REPORT_FILE
from hpcdl.fs.access import Access

log = logging.getLogger("hpcdl.exchange")

MAX_REJECTED = 100
_UPDATE_RE = re.compile(r"^u-g(\d{1,9})-s(\d{1,18})\.hx$")
_WEIGHTS_RE = re.compile(r"^w-v(\d{1,18})\.hx$")
_INIT_RE = re.compile(r"^i-g(\d{1,9})\.hx$")

@dataclasses.dataclass(frozen=True)
class UpdateRef:
    """A pending update file, as listed (nothing read yet)."""

    group: int
    seq: int
    path: Path
    mtime_ns: int

    @property
    def name(self) -> str:
        return self.path.name


@dataclasses.dataclass
class Update:
    group: int
    seq: int
    base_version: int
    tensors: dict[str, np.ndarray]
    path: Path
    created: float = 0.0


def update_name(group: int, seq: int) -> str:
    return f"u-g{group:06d}-s{seq:012d}.hx"


def weights_name(version: int) -> str:
    return f"w-v{version:012d}.hx"


def init_name(group: int) -> str:
    return f"i-g{group:06d}.hx"


def parse_update_name(name: str) -> tuple[int, int] | None:
    m = _UPDATE_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_nonneg(**kw: int) -> None:
    for k, v in kw.items():
        if not _is_int(v) or v < 0:
            raise ValueError(f"{k} must be an int >= 0, got {v!r}")


# The kinds fsynced before their rename (see "Publishing" in the protocol docstring): an update
# torn by a node crash is rejected by its tag and costs what a dropped update costs.
DURABLE_KINDS = frozenset({"weights", "init", "state"})


def applier_status_file(root: Path) -> Path:
    """The applier's status.json under an exchange directory (read by `hpcdl status`)."""
    return Path(root) / "applier" / "status.json"


def applier_storage_file(root: Path) -> Path:
    """The applier's storage report under an exchange directory (read by `hpcdl status`)."""
    return Path(root) / "applier" / REPORT_FILE


class Channel:
    """One run's exchange directory: layout, publishing and reading (see :mod:`hpcdl.exchange`).

    ``max_pending_per_group``: when set, publish_update keeps at most this many pending updates of
    the publishing group, deleting that group's oldest ones. ``signer``: the tag (plain SHA-256 by
    default; a run's channels pass :func:`hpcdl.rundir.runkey.run_signer`). ``access``: modes of the
    directories and files (owner only by default). ``fsync=False`` skips fsyncs (tests, local
    scratch); publishing stays atomic.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        run_id: str,
        create: bool = True,
        *,
        max_pending_per_group: int | None = None,
        signer: Signer | None = None,
        fsync: bool = True,
        stripe: bool = True,
        access: Access | None = None,
    ):
        if not isinstance(run_id, str) or not run_id or len(run_id) > 256:
            raise ValueError("run_id must be a non-empty string of at most 256 characters")
        if max_pending_per_group is not None and max_pending_per_group < 1:
            raise ValueError("max_pending_per_group must be >= 1 or None")
        self.root = Path(root)
        self.run_id = run_id
        self.signer = signer or Signer()
        self.access = access or Access()
        self.fsync = fsync
        self.max_pending_per_group = max_pending_per_group
        self.dropped_backlog = 0  # updates this process deleted to keep the backlog bound
        self.last_dropped: list[UpdateRef] = []  # those the last publish_update deleted
        self.updates_dir = self.root / "updates"
        self.weights_dir = self.root / "weights"
        self.init_dir = self.root / "init"
        self.applier_dir = self.root / "applier"
        self.rejected_dir = self.applier_dir / "rejected"
        self.state_path = self.applier_dir / "state.hx"
        self.previous_state_path = self.applier_dir / "state.hx.1"  # the generation before
        self.status_path = applier_status_file(self.root)
        self.storage_path = applier_storage_file(self.root)
        self.events_path = self.applier_dir / "events.jsonl"
        self.lock_path = self.applier_dir / "lock"
        dirs = (self.updates_dir, self.weights_dir, self.init_dir, self.applier_dir,
                self.rejected_dir)
        if create:
            new_updates = not self.updates_dir.exists()
            if not self.access.make_dir(self.root, tighten=False):
                _warn_if_open(self.root)
            for d in dirs:
                self.access.make_dir(d)
            if new_updates and stripe:
                _stripe_small_files(self.updates_dir)
        elif not all(d.is_dir() for d in dirs):
            raise FileNotFoundError(f"{self.root} is not an exchange directory")

    def relative(self, path: Path) -> str:
        """``path`` as the applier's ledger names it: relative to the exchange root."""
        return Path(path).relative_to(self.root).as_posix()

    # -- internal ------------------------------------------------------------------------------

    def _write(self, path: Path, kind: str, tensors: Tensors, **fields: Any) -> Path:
        return write_file(path, run_id=self.run_id, kind=kind, tensors=tensors, signer=self.signer,
                          fsync=self.fsync and kind in DURABLE_KINDS, access=self.access, **fields)

    def _read(self, path: Path, kind: str, max_bytes: int | None = None
              ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        return read_file(path, run_id=self.run_id, signer=self.signer, kinds=(kind,),
                         max_bytes=max_bytes)

    @staticmethod
    def _listing(directory: Path, pattern: re.Pattern[str]) -> list[tuple[os.DirEntry, re.Match]]:
        out = []
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    m = pattern.match(entry.name)
                    if m:
                        out.append((entry, m))
        except FileNotFoundError:
            pass
        return out

    # -- updates -------------------------------------------------------------------------------

    def publish_update(self, group: int, seq: int, base_version: int, tensors: Tensors) -> Path:
        """Publish one update; then enforce ``max_pending_per_group`` for this group."""
        _check_nonneg(group=group, seq=seq)
        if not _is_int(base_version) or base_version < -1:
            raise ValueError("base_version must be an int >= -1 (-1: not from a master version)")
        path = self._write(self.updates_dir / update_name(group, seq), "update", tensors,
                           group=group, seq=seq, base_version=base_version)
        self.last_dropped = []
        if self.max_pending_per_group is not None:
            # Files the applier has processed are still listed until it deletes them after its
            # commit: they are neither pending nor ours to delete (nor to count as dropped).
            answered = self.answered_seq(group)
            mine = sorted((r for r in self.pending_updates() if r.group == group and r.seq > answered),
                          key=lambda r: r.seq)
            for ref in mine[:max(0, len(mine) - self.max_pending_per_group)]:
                try:
                    os.unlink(ref.path)
                except FileNotFoundError:
                    continue  # the applier got it first
                self.dropped_backlog += 1
                self.last_dropped.append(ref)
                log.info("backlog bound %d: dropped pending update group %d seq %d",
                         self.max_pending_per_group, ref.group, ref.seq)
        return path

    def pending_updates(self) -> list[UpdateRef]:
        """Update files in arrival order ((mtime_ns, name)); each group's own in seq order."""
        refs = []
        for entry, m in self._listing(self.updates_dir, _UPDATE_RE):
            try:
                mtime = entry.stat().st_mtime_ns
            except FileNotFoundError:
                continue
            refs.append(UpdateRef(int(m.group(1)), int(m.group(2)), Path(entry.path), mtime))
        refs.sort(key=lambda r: (r.mtime_ns, r.name))
        # Keep the arrival slots, but give each group's slots to its updates in seq order.
        by_group: dict[int, list[UpdateRef]] = {}
        for r in refs:
            by_group.setdefault(r.group, []).append(r)
        queues = {g: iter(sorted(rs, key=lambda r: r.seq)) for g, rs in by_group.items()}
        return [next(queues[r.group]) for r in refs]

    def backlog(self, group: int | None = None) -> int:
        """Number of pending (unapplied) updates, of all groups or of one."""
        if group is None:
            return len(self._listing(self.updates_dir, _UPDATE_RE))
        return sum(1 for _, m in self._listing(self.updates_dir, _UPDATE_RE)
                   if int(m.group(1)) == group)

    def read_update(self, ref: UpdateRef | Path, max_bytes: int | None = None) -> Update:
        """Read and validate one update; ``max_bytes`` refuses larger files before reading."""
        path = ref.path if isinstance(ref, UpdateRef) else Path(ref)
        header, tensors = self._read(path, "update", max_bytes)
        if parse_update_name(path.name) != (header["group"], header["seq"]):
            raise CorruptFile("file name does not match the header's group/seq")
        return Update(header["group"], header["seq"], header["base_version"], tensors, path,
                      header["created"])

    def answered_seq(self, group: int) -> int:
        """The newest seq of ``group`` that the applier reports processed (-1: none)."""
        last = (self.read_status() or {}).get("last_seq", {})
        seq = last.get(str(group), -1) if isinstance(last, dict) else -1
        return seq if _is_int(seq) else -1

    def next_seq(self, group: int) -> int:
        """One past the highest seq of ``group`` that is pending or reported processed."""
        best = -1
        for _, m in self._listing(self.updates_dir, _UPDATE_RE):
            if int(m.group(1)) == group:
                best = max(best, int(m.group(2)))
        return max(best, self.answered_seq(group)) + 1

    # -- weights -------------------------------------------------------------------------------

    def publish_weights(self, version: int, tensors: Tensors) -> Path:
        _check_nonneg(version=version)
        return self._write(self.weights_dir / weights_name(version), "weights", tensors,
                           version=version)

    def weight_versions(self) -> list[int]:
        return sorted(int(m.group(1)) for _, m in self._listing(self.weights_dir, _WEIGHTS_RE))

    def latest_weights_version(self) -> int | None:
        """Newest published master version, from a directory listing only (no file read)."""
        versions = self.weight_versions()
        return versions[-1] if versions else None

    def read_weights(self, version: int) -> tuple[int, dict[str, np.ndarray]]:
        """Read one version; FileNotFoundError if it was pruned meanwhile."""
        header, tensors = self._read(self.weights_dir / weights_name(version), "weights")
        if header["version"] != version:
            raise CorruptFile("file name does not match the header's version")
        return version, tensors

    def read_latest_weights(self, retries: int = 5) -> tuple[int, dict[str, np.ndarray]] | None:
        """Newest master weights, or None if none exist; retries when a prune wins the race."""
        for _ in range(retries + 1):
            version = self.latest_weights_version()
            if version is None:
                return None
            try:
                return self.read_weights(version)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"weights kept vanishing while reading {self.weights_dir}")

    # -- the applier's state ---------------------------------------------------------------------

    def publish_state(self, version: int, tensors: Tensors, meta: dict[str, Any]) -> Path:
        """Commit the applier's state; the one committed before becomes the previous generation
        (a crash between the two steps leaves only that one, which the applier then recovers)."""
        _check_nonneg(version=version)
        try:
            os.replace(self.state_path, self.previous_state_path)
        except FileNotFoundError:
            pass
        return self._write(self.state_path, "state", tensors, version=version, meta=meta)

    def read_state(self, path: Path | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """A committed generation of the applier's state (by default the newest): header and tensors."""
        return self._read(path or self.state_path, "state")

    def prune_weights(self, keep: int) -> int:
        """Delete all but the newest ``keep`` weight versions; returns how many were deleted."""
        if keep < 1:
            raise ValueError("keep must be >= 1")
        removed = 0
        for version in self.weight_versions()[:-keep]:
            try:
                os.unlink(self.weights_dir / weights_name(version))
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    # -- initial weights -----------------------------------------------------------------------

    def propose_initial(self, group: int, tensors: Tensors) -> Path | None:
        """Propose initial weights unless a master version exists; returns the proposal path."""
        _check_nonneg(group=group)
        if self.latest_weights_version() is not None:
            return None
        return self._write(self.init_dir / init_name(group), "init", tensors, group=group)

    def initial_weights(
        self, group: int, tensors: Tensors, timeout: float = 60.0, poll: float = 0.2
    ) -> tuple[int, dict[str, np.ndarray]] | None:
        """Propose ``tensors`` and wait up to ``timeout`` s for the master's first version.

        Returns (version, master tensors), or None on timeout: the caller keeps its own tensors
        (the applier may be down; groups never stall on it for longer than ``timeout``).
        """
        self.propose_initial(group, tensors)
        deadline = time.monotonic() + timeout
        while True:
            latest = self.read_latest_weights()
            if latest is not None:
                return latest
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll)

    def pending_proposals(self) -> list[Path]:
        """Initial-weight proposals in arrival order."""
        found = []
        for entry, _ in self._listing(self.init_dir, _INIT_RE):
            try:
                found.append((entry.stat().st_mtime_ns, entry.name, Path(entry.path)))
            except FileNotFoundError:
                continue
        return [p for _, _, p in sorted(found)]

    def read_proposal(self, path: Path) -> tuple[int, dict[str, np.ndarray]]:
        header, tensors = self._read(path, "init")
        m = _INIT_RE.match(path.name)
        if not m or int(m.group(1)) != header["group"]:
            raise CorruptFile("file name does not match the header's group")
        return header["group"], tensors

    # -- housekeeping --------------------------------------------------------------------------

    def clean_stale_temporaries(self, older_than_s: float, *, dirs: list[Path] | None = None
                                ) -> int:
        """Delete temporaries (``.tmp-*``) whose mtime is older than ``older_than_s`` seconds."""
        cutoff = time.time() - older_than_s
        removed = 0
        for d in dirs or [self.updates_dir, self.weights_dir, self.init_dir, self.applier_dir]:
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            for entry in entries:
                if not entry.name.startswith(TMP_PREFIX):
                    continue
                try:
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
                        log.info("removed stale temporary %s", entry.path)
                except FileNotFoundError:
                    pass
        return removed

    def quarantine(self, path: Path) -> Path | None:
        """Move a refused file into ``applier/rejected/`` (keeping at most MAX_REJECTED)."""
        dest = self.rejected_dir / f"{time.time_ns()}-{path.name}"
        try:
            os.replace(path, dest)
        except FileNotFoundError:
            return None
        kept = sorted(os.listdir(self.rejected_dir))
        for name in kept[:max(0, len(kept) - MAX_REJECTED)]:
            try:
                os.unlink(self.rejected_dir / name)
            except OSError:
                pass
        return dest

    def read_status(self) -> dict[str, Any] | None:
        """The applier's status.json, or None if absent or unreadable."""
        try:
            with open(self.status_path, "rb") as f:
                data = f.read(MAX_HEADER_BYTES + 1)
            status = json.loads(data.decode("utf-8"))
        except (OSError, ValueError):
            return None
        return status if isinstance(status, dict) else None


def _warn_if_open(root: Path) -> None:
    try:
        mode = os.stat(root).st_mode
    except OSError:
        return
    if mode & 0o007:
        log.warning("exchange directory %s has mode %04o: other users can enter it (the files "
                    "in it are owner-only and authenticated, but consider chmod o-rwx)",
                    root, mode & 0o7777)


def _stripe_small_files(directory: Path) -> None:
    """On Lustre, give the updates directory a stripe count of 1 (many small files)."""
    lfs = shutil.which("lfs")
    if lfs is None:
        return
    try:
        subprocess.run([lfs, "setstripe", "-c", "1", str(directory)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        log.info("lfs setstripe -c 1 %s failed (ignored): %s", directory, e)
