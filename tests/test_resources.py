"""Job definitions and sbatch templates reach users who install a wheel, not only a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from hpcdl.resources import SOURCE_ROOT, shipped_dir
from tests.conftest import HPCDL, REPO


def test_a_checkout_uses_its_own_files():
    assert SOURCE_ROOT == REPO
    assert shipped_dir("jobs") == REPO / "jobs"
    assert shipped_dir("slurm_templates") == REPO / "slurm_templates"


def test_an_installed_wheel_finds_jobs_and_templates(tmp_path):
    # Build from a copy holding only what the package declares, so nothing of the checkout leaks in.
    src = tmp_path / "src"
    for name in ("hpcdl", "jobs", "slurm_templates"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp_path / "dist")],
                   check=True, cwd=tmp_path)
    prefix = tmp_path / "prefix"
    (wheel,) = (tmp_path / "dist").glob("hpcdl-*.whl")
    # --ignore-installed: without it pip uninstalls the checkout's editable hpcdl from this venv.
    subprocess.run([*pip, "install", "--ignore-installed", "--no-deps", "--no-index", "--prefix", str(prefix),
                    str(wheel)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))
    assert (prefix / "share/hpcdl/jobs/hep.toml").is_file()

    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", "import hpcdl, sys; from hpcdl.cli import main; print(hpcdl.__file__); main()",
         "submit", "hep", "--backend", "slurm", "--nodes", "4", "--group-size", "2", "--dry-run",
         "--no-check-data"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    module_file, _, script = out.stdout.partition("\n")
    assert Path(module_file).is_relative_to(site)  # the installed copy, not the checkout
    assert "#SBATCH --nodes=2" in script and "sbatch --parsable --array=0-1 " in script
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    assert Path(HPCDL).is_file()  # the venv's own hpcdl is still installed
