"""What the sections that train need: generated HEP sets (cached under --work), `hpcdl submit`
in the foreground, the CPU its processes got, and a group's metrics."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

from bench.harness import HPCDL, Bench, generation_seconds, hep_data


def generated(b: Bench, events: int, size: int) -> dict[str, Path]:
    """A generated HEP set under --work (bench.harness.hep_data), what generating it took recorded."""
    files = hep_data(b.work, events, size)
    b.data.setdefault("generated", {}).update(generation_seconds)
    return files


def data_sets(files: dict[str, Path]) -> list[str]:
    return [f'data.{k}="{v}"' for k, v in files.items()]


def submit(b: Bench, name: str, overrides: list[str], nodes: int = 1, group_size: int = 0,
           env: dict[str, str] | None = None, watch=None) -> tuple[Path | None, float, subprocess.CompletedProcess]:
    """Run `hpcdl submit` in the foreground; returns (run dir, start time, process)."""
    runs = b.work / "runs" / name
    runs.mkdir(parents=True, exist_ok=True)
    before = set(runs.iterdir())
    cmd = [HPCDL, "submit", "hep", "--backend", "local", "--nodes", str(nodes), "--group-size",
           str(group_size), "--json", "--runs-dir", str(runs)]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.time()
    errfile = b.logdir / f"submit-{name}.err"
    with open(errfile, "w") as err:
        proc = subprocess.Popen(cmd, cwd=b.work, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, **(env or {})})
    run_dir = None
    out_chunks: list[str] = []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        if run_dir is None:
            new = [p for p in runs.iterdir() if p not in before and not p.name.startswith(".")]
            run_dir = new[0] if new else None
        if run_dir is not None and watch is not None:
            watch(run_dir)
        time.sleep(0.25)
    reader.join(timeout=10)
    stderr = errfile.read_text(errors="replace")
    if run_dir is None:
        new = [p for p in runs.iterdir() if p not in before and not p.name.startswith(".")]
        run_dir = new[0] if new else None
    return run_dir, t0, subprocess.CompletedProcess(cmd, proc.returncode, "".join(out_chunks), stderr)


class CpuTracker:
    """CPU seconds used by a run's processes (those whose command line names the run directory),
    sampled from /proc while the run goes: how much of the machine the run actually got."""

    def __init__(self):
        self.seen: dict[int, float] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def __call__(self, run_dir: Path) -> None:
        needle = str(run_dir).encode()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if needle not in Path(entry.path, "cmdline").read_bytes():
                    continue
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime
            except (OSError, IndexError, ValueError):
                continue
            pid = int(entry.name)
            self.seen[pid] = max(self.seen.get(pid, 0.0), cpu)

    @property
    def seconds(self) -> float:
        return sum(self.seen.values())


def metrics(run_dir: Path, group: int = 0) -> list[dict]:
    """A group's metrics lines ([] before its first)."""
    from hpcdl.rundir.runs import RunDir
    from hpcdl.fs.files import read_jsonl

    return read_jsonl(RunDir(run_dir).metrics_file(group))

