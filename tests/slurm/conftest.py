"""Fixture for tests that need the real local SLURM cluster (tests/slurm/cluster.sh).

Usage::

    pytestmark = pytest.mark.slurm

    def test_something(slurm_cluster):
        subprocess.run(["sbatch", ...])   # SLURM_CONF is already in os.environ

Environment:
    HPCDL_REQUIRE_SLURM=1  a cluster that cannot be started FAILS the tests (CI);
                           otherwise they are skipped with the reason.
    HPCDL_SLURM_KEEP=1     leave a cluster that this session started running afterwards
                           (a cluster that was already running is never stopped).
    HPCDL_SLURM_DIR        state directory, passed through to cluster.sh.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

CLUSTER_SH = Path(__file__).resolve().with_name("cluster.sh")
START_TIMEOUT = 1200  # a first start on a fresh machine installs Debian packages


@dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    slurm_conf: Path
    script: Path
    env: dict[str, str]  # the variables exported into os.environ ("cluster.sh env")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLUSTER_SH), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _parse_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, value = words[1].split("=", 1)
            env[key] = value
    return env


@pytest.fixture(scope="session")
def slurm_cluster():
    require = os.environ.get("HPCDL_REQUIRE_SLURM") == "1"

    def unavailable(reason: str):
        if require:
            pytest.fail(f"local SLURM cluster unavailable (HPCDL_REQUIRE_SLURM=1): {reason}", pytrace=False)
        pytest.skip(f"local SLURM cluster unavailable: {reason}")

    try:
        was_running = _run("status", timeout=60).returncode == 0
        start = _run("start", timeout=START_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        unavailable(f"{CLUSTER_SH} start: {exc}")
    if start.returncode != 0:
        out = (start.stdout + start.stderr).strip().splitlines()
        unavailable(f"{CLUSTER_SH} start exited {start.returncode}:\n" + "\n".join(out[-40:]))

    env = _parse_env(_run("env", timeout=60).stdout)
    if "SLURM_CONF" not in env:
        unavailable(f"{CLUSTER_SH} env printed no SLURM_CONF")
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)

    state_dir = Path(env.get("HPCDL_SLURM_DIR", Path(env["SLURM_CONF"]).parent.parent))
    try:
        yield SlurmCluster(
            state_dir=state_dir,
            slurm_conf=Path(env["SLURM_CONF"]),
            script=CLUSTER_SH,
            env=env,
        )
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if not was_running and os.environ.get("HPCDL_SLURM_KEEP") != "1":
            _run("stop", timeout=120)
