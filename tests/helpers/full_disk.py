"""Full disks for tests: a tiny tmpfs where the sandbox allows mounting one, and how to fill it."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

from hpcdl.fs.storage import read_report

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def small_fs(path: Path, size_kib: int) -> Path | None:
    """Mount a tmpfs of `size_kib` KiB at `path`; None where that is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return None
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", str(path)],
                       capture_output=True)
    return path if r.returncode == 0 else None


def fill(fs: Path, leave: int = 0) -> Path:
    """Fill the (tiny, test-mounted) file system at `fs` until at most `leave` bytes are free."""
    st = os.statvfs(fs)
    assert st.f_blocks * st.f_frsize <= 64 << 20, f"refusing to fill {fs}: not a tiny test file system"
    filler = fs / "filler"
    with open(filler, "ab") as f:
        while True:
            st = os.statvfs(fs)
            free = st.f_bavail * st.f_frsize
            if free <= leave:
                break
            try:
                f.write(b"\0" * min(free - leave, 1 << 20))
                f.flush()
            except OSError:
                break
    return filler


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".tmp")]


def problems(path: Path) -> dict:
    return (read_report(path) or {}).get("problems", {})
