"""`hpcdl logs`: a run's log files -- each rank's, the applier's, the local supervisor's and
SLURM's output of every array element and of the applier's job -- found through RunDir, printed
or followed; and the last error line of a group, for `hpcdl status`.

Selection: no option is every log of the run; `--group G` that group's (`--rank R` one rank's
on the local backend; under SLURM a group's ranks share their element's output file);
`--applier` the applier's. Options add up.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import BinaryIO, Callable

from hpcdl.rundir.runs import RunDir, RunError

TAIL_BYTES = 64 << 10  # how far back from the end the last error line is looked for
# Python's last traceback line ("FileNotFoundError: ..."), TensorFlow/Horovod/SLURM errors.
# In order of preference: hpcdl's own words, a Python exception (a traceback's last line), then
# anything else that reads like an error (srun, slurmstepd, TensorFlow). Indented lines are a
# traceback's source lines and context, never the reason itself.
_OURS = re.compile(r"^hpcdl[^:]*: error: ")
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b(: |$)")
_ERROR = re.compile(r"(^[\w.]*(Error|Exception|Interrupt)\b|\berror\b|\bFATAL\b|\bKilled\b|"
                    r"DUE TO TIME LIMIT|CANCELLED AT|Out Of Memory|oom-kill)", re.IGNORECASE)
_NOT_ERRORS = re.compile(r"^(\s|Traceback \(most recent call last\))")


def select(run: RunDir, group: int | None = None, rank: int | None = None,
           applier: bool = False) -> tuple[list[Path], str]:
    """(the log files that exist, a note for the user or ""). Bad --group/--rank: RunError."""
    groups = run.groups()
    note = ""
    if rank is not None and group is None:
        if len(groups) != 1:
            raise RunError(f"--rank needs --group: run {run.run_id} has {len(groups)} groups")
        group = groups[0]
    if group is not None and group not in groups:
        raise RunError(f"run {run.run_id} has no group {group} (groups 0-{len(groups) - 1})")
    files: list[Path] = []
    if group is None and not applier:
        files += [run.supervisor_log] if run.supervisor_log.is_file() else []
        files += run.applier_logs()
        for g in groups:
            files += run.group_logs(g)
        return files, note
    if applier:
        files += run.applier_logs()
    if group is not None:
        logs = run.group_logs(group)
        if rank is not None:
            size = run.info().get("ranks_per_group")
            if isinstance(size, int) and not 0 <= rank < size:
                raise RunError(f"group {group} of run {run.run_id} has ranks 0-{size - 1}, not {rank}")
            mine = [p for p in logs if p == run.rank_log(group, rank)]
            shared = [p for p in logs if p.name.startswith("slurm-")]
            if shared and not mine:
                note = f"under SLURM the ranks of group {group} share their element's output"
            logs = mine or shared
        files += logs
    return files, note


def last_error(paths: list[Path]) -> str | None:
    """The most telling error line in the ends of these files (newest file first): the last of
    hpcdl's own error lines, else the last Python exception line, else the last line that reads
    like an error -- so a rank's `DataError: ... no such file` wins over srun's `task 0: Exited`."""
    for path in sorted(paths, key=_mtime, reverse=True):
        try:
            with open(path, "rb") as f:
                f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            continue
        found: dict[int, str] = {}
        for line in lines:
            text = line.rstrip()
            if not text or _NOT_ERRORS.match(text):
                continue
            for rank, pattern in enumerate((_OURS, _EXCEPTION, _ERROR)):
                if pattern.search(text):
                    found[rank] = text[:300]
                    break
        if found:
            return found[min(found)]
    return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def until_signalled() -> Callable[[], bool]:
    """A ``keep_going`` for :func:`stream` that turns false once SIGINT or SIGTERM arrives: a flag
    read between polls, so the signal never interrupts a write half done (as KeyboardInterrupt
    would, anywhere) and the loop ends at its next poll."""
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    return lambda: not received


def stream(find: Callable[[], list[Path]], out: BinaryIO, follow: bool = False, interval: float = 0.5,
           keep_going: Callable[[], bool] = lambda: True) -> int:
    """Write the files `find()` names to `out`, each under a `==> path <==` header when there is
    more than one; with `follow`, keep writing what is appended and files that appear (as
    `tail -F`) until `keep_going()` is false or the caller interrupts. Returns the files seen."""
    offsets: dict[Path, int] = {}
    current: Path | None = None
    headers = False
    while True:
        paths = find()
        headers = headers or len(paths) > 1 or follow
        for path in paths:
            try:
                with open(path, "rb") as f:
                    size = f.seek(0, 2)
                    start = offsets.get(path, 0)
                    if size < start:  # truncated or replaced: from the start again
                        start = 0
                    if size == start and path in offsets:
                        continue
                    f.seek(start)
                    data = f.read(size - start)
            except OSError:
                continue
            offsets[path] = start + len(data)
            if headers and current != path and (data or start == 0):
                out.write(f"{chr(10) if current is not None else ''}==> {path} <==\n".encode())
                current = path
            out.write(data)
        out.flush()
        if not follow or not keep_going():
            return len(offsets)
        time.sleep(interval)
