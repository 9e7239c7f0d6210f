"""`hpcdl doctor`: what this installation is, and the thread plan a rank would get."""

from __future__ import annotations

import json
import os
import subprocess

from hpcdl.commands.doctor import RankSetup, report
from tests.conftest import HPCDL


def test_doctor_reports_the_installation_and_a_ranks_plan():
    proc = subprocess.run([HPCDL, "doctor", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    import horovod
    import tensorflow as tf

    assert info["tensorflow"] == tf.__version__ and info["horovod"] == horovod.__version__
    assert info["horovod_tensorflow"] is True and info["horovod_gloo"] is True
    # every controller is either runnable here or said why not
    controllers = info["controllers"].split(", ")
    assert "gloo" in controllers and info["controller_auto"] == "gloo"
    for name in ("mpi", "mpi4py"):
        assert (name in controllers) != bool(info.get(f"controller_{name}_why_not")), name
    setup = RankSetup.here()
    assert info["usable_cores"] == setup.usable
    assert info["intra_op_threads"] == setup.plan.intra_op and info["inter_op_threads"] == setup.plan.inter_op
    # the process ran with the plan's environment, as a worker does
    assert info["OMP_NUM_THREADS"] == setup.plan.environment().get("OMP_NUM_THREADS")
    for field in ("intra_op", "inter_op", "onednn", "precision"):
        assert info[f"{field}_why"], field


def test_doctor_says_why_mpi4py_cannot_run_without_mpi(tmp_path):
    """mpi4py's probe in a Python whose mpi4py cannot load a library: the line says so."""
    from hpcdl.process.launch import mpi4py_problem

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'RuntimeError: cannot load MPI library' >&2\nexit 1\n")
    fake.chmod(0o755)
    assert mpi4py_problem(str(fake)) == "RuntimeError: cannot load MPI library"
    assert mpi4py_problem(str(tmp_path / "missing")).startswith(f"{tmp_path / 'missing'} did not answer")


def test_report_leaves_the_environment_alone():
    before = dict(os.environ)
    info = report(RankSetup.here(ranks_on_host=2))
    assert dict(os.environ) == before
    assert info["ranks_on_host"] == 2
