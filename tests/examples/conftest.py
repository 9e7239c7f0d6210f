"""The worked example (examples/peaks), installed into the test venv as a user would install it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

EXAMPLE = REPO / "examples" / "peaks"


def copy_and_install_example(directory: Path) -> Path:
    """examples/peaks copied to directory/peaks and installed from there (so the source tree
    stays clean) unless its package already is; returns the copy, which holds its job file."""
    copy = directory / "peaks"
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("data", "runs", "build", "*.egg-info"))
    if importlib.util.find_spec("peaks") is None:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                               "--no-build-isolation", str(copy)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return copy


@pytest.fixture(scope="session")
def peaks_installed(tmp_path_factory) -> Path:
    return copy_and_install_example(tmp_path_factory.mktemp("example"))


@pytest.fixture(scope="session")
def peaks_data(peaks_installed) -> Path:
    """The example's data set, written by its own script (small)."""
    out = peaks_installed / "data"
    proc = subprocess.run([sys.executable, "-m", "peaks.make_data", "--out", str(out), "--examples", "1500"],
                          capture_output=True, text=True, timeout=120, cwd=peaks_installed)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out
