"""Shared fixtures: tiny HEP files written by the tests themselves, and a job that trains in seconds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parent.parent
HPCDL = str(Path(sys.executable).with_name("hpcdl"))


def write_nersc(path: Path, n: int, size: int = 16, seed: int = 0) -> Path:
    """A learnable toy in the NERSC layout: signal events carry more energy in the centre."""
    rng = np.random.default_rng(seed)
    y = (np.arange(n) % 2).astype(np.float32)
    base = rng.random((n, size, size), dtype=np.float32)
    centre = np.zeros((size, size), np.float32)
    centre[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = 1.0
    hist = base + 2.0 * y[:, None, None] * centre
    with h5py.File(path, "w") as f:
        g = f.create_group("all_events")
        g["hist"] = hist * 100.0
        g["histEM"] = hist * 40.0
        g["histtrack"] = np.round(hist * 3.0)
        g["y"] = y
        g["weight"] = np.where(y == 1, 0.01, 5.0).astype(np.float32)
        g["passSR"] = (hist[:, size // 2, size // 2] > 1.5) & (rng.random(n) < 0.8)
    return path


@pytest.fixture(scope="session")
def hep_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hep")
    return {"train": write_nersc(d / "train.h5", 2048, seed=1), "test": write_nersc(d / "test.h5", 512, seed=2)}


def tiny_overrides(files: dict[str, Path], runs_dir: Path, steps: int = 20) -> list[str]:
    """--set arguments for a job that trains a 2-conv, 8-filter model in seconds."""
    return [
        f'data.train="{files["train"]}"', f'data.test="{files["test"]}"', f'data.val="{files["test"]}"',
        f"train.steps={steps}", "train.batch_per_rank=16", "train.log_every=5", "train.checkpoint_every=10",
        "model.filters=8", "model.conv_layers=2", "model.dropout=0.0", "data.chunk_events=256",
        f'run.runs_dir="{runs_dir}"', "run.backend=local",  # not auto: a test cluster may answer
    ]


def wait_for(predicate, timeout=180.0, what="condition", poll=0.2):
    """predicate()'s first true value within `timeout` seconds; else fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def run_hpcdl(args: list[str], *, runs_dir: Path, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`hpcdl ARGS`, text output captured. A run that outlives `timeout` fails the test with what
    its processes were doing: each still alive is asked for its stacks (SIGUSR2) before the tails
    of every log under `runs_dir` are shown."""
    try:
        return subprocess.run([HPCDL, *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        pass
    pids = []
    for state in runs_dir.glob("*/scheduler/local.json"):
        record = json.loads(state.read_text())
        pids += [pid for g in record.get("groups", {}).values() for pid in g.get("pids", [])]
        pids += [s["pid"] for s in (record.get("applier") or {}).get("shards", [])]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass
    time.sleep(2.0)
    for pid in pids:  # nothing hung is left to slow the tests after this one
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    tails = [f"--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
             for log in sorted(runs_dir.rglob("*.log"))]
    pytest.fail(f"hpcdl {args[0]} did not end in {timeout:.0f} s; its logs:\n" + "\n".join(tails), pytrace=False)


def hpcdl(*args: str, cwd, check: bool = True, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
    """`hpcdl ARGS` run in ``cwd`` (its runs under ``cwd/runs`` when a hang is diagnosed); a
    non-zero exit fails the test unless ``check`` is false."""
    proc = run_hpcdl(list(args), runs_dir=Path(cwd) / "runs", timeout=timeout, cwd=cwd, env=env)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def set_args(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="session")
def mpi_horovod() -> None:
    """The MPI controller's tests run where Horovod has MPI and mpirun is on PATH (`make install
    MPI=1`; .ci/run installs both); elsewhere they are skipped with the reason, or fail with
    HPCDL_REQUIRE_MPI=1 (CI), so a broken MPI install cannot pass as skipped tests."""
    probe = subprocess.run([sys.executable, "-c", "import horovod.tensorflow as h; print(h.mpi_built())"],
                           capture_output=True, text=True, timeout=300)
    missing = []
    if probe.stdout.strip().splitlines()[-1:] != ["True"]:
        missing.append("Horovod is built without MPI (make install MPI=1)")
    if not shutil.which("mpirun"):
        missing.append("no mpirun on PATH (apt-get install openmpi-bin)")
    _skip_or_fail(missing)


@pytest.fixture(scope="session")
def mpi4py_mpi() -> str:
    """The mpi4py collective's tests run where mpi4py loads an MPI and a launcher is found (the
    mpirun the local backend would use, returned); skipped otherwise, or failed under
    HPCDL_REQUIRE_MPI=1 as above."""
    from hpcdl.process.launch import find_mpi_launcher, mpi4py_problem

    missing = []
    if problem := mpi4py_problem(sys.executable):
        missing.append(f"mpi4py cannot load MPI: {problem}")
    launcher = find_mpi_launcher()
    if launcher is None:
        missing.append("no mpirun or mpiexec")
    _skip_or_fail(missing)
    return launcher.path


def _skip_or_fail(missing: list[str]) -> None:
    if missing:
        reason = "; ".join(missing)
        if os.environ.get("HPCDL_REQUIRE_MPI") == "1":
            pytest.fail(f"MPI tests cannot run (HPCDL_REQUIRE_MPI=1): {reason}", pytrace=False)
        pytest.skip(reason)


def mpi_test_env(**extra: str) -> dict[str, str]:
    """The environment of a test that runs Open MPI's mpirun: as root (a CI container) it needs
    Open MPI's consent, given here and never in what hpcdl renders."""
    env = {**os.environ, **extra}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


@pytest.fixture
def tiny_fs(tmp_path):
    """A factory of tiny tmpfs mounts, unmounted at the end; skips when mounting is impossible."""
    mounted = []

    def make(name: str, size_kib: int) -> Path:
        from tests.helpers.full_disk import small_fs

        p = small_fs(tmp_path / name, size_kib)
        if p is None:
            pytest.skip("cannot mount a tmpfs here (not root, or no permission): injected-error tests cover this")
        mounted.append(p)
        return p

    yield make
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


# Damaged files: a write cut short, and bytes that are no text at all.
TRUNCATED = b'{"run_id": "hep-1", "backend": "lo'
BINARY = b"\x00\x9c\xff\xfeELF\x01\x02\x80garbage"


def one_error_line(result, fragment):
    """A CLI result that refused its input as hpcdl must: exit 2, one `Error:` line naming
    `fragment`, no traceback. Returns that line."""
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert "Traceback" not in result.output
    return errors[0]


@pytest.fixture
def local_run(tmp_path):
    """A run of the shipped hep job on the local backend, created and never started."""
    from hpcdl.jobfile import load_job
    from hpcdl.rundir.runs import create_run

    job = load_job("hep", [f'run.runs_dir="{tmp_path / "runs"}"'])
    with create_run(job, "local") as (_, final):
        pass
    return final
