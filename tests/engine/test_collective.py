"""The two in-group collectives train the same group to the same weights: Horovod (over Gloo, as
hpcdl starts it) and mpi4py (under mpirun); and a rank killed mid-step ends an mpi4py group in
bounded time, as the restart from checkpoint needs."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO, mpi_test_env, tiny_overrides
from tests.engine.test_train import train_gloo_pair

pytestmark = pytest.mark.mpi

# Both average with one sum and one scaling by 1/size; the order of the sums may differ between
# Horovod's fused buffer and MPI's reduction, a last-bit difference that 15 Adam steps can grow.
RTOL, ATOL = 1e-4, 1e-6


def mpirun_pair(launcher: str, out, overrides, **env) -> subprocess.CompletedProcess:
    command = [launcher, "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
               str(REPO / "tests/helpers/sync_rank.py"), str(out), json.dumps(overrides)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env=mpi_test_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HPCDL_TEST_CONTROLLER="mpi4py", **env))


def test_mpi4py_trains_the_weights_horovod_trains(mpi4py_mpi, hep_files, tmp_path):
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=15)
    train_gloo_pair(tmp_path / "horovod", overrides)
    proc = mpirun_pair(mpi4py_mpi, tmp_path / "mpi4py", overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hvd, mpi = (np.load(tmp_path / kind / "rank0.npz") for kind in ("horovod", "mpi4py"))
    mpi1 = np.load(tmp_path / "mpi4py" / "rank1.npz")
    finals = [k for k in hvd.files if k.startswith("final/")]
    assert finals and sorted(finals) == sorted(k for k in mpi.files if k.startswith("final/"))
    for key in finals:
        assert np.array_equal(mpi[key], mpi1[key]), key  # mpi4py's replicas: the same to the bit
        assert not np.allclose(mpi[key], mpi["initial/" + key.split("/", 1)[1]]), key  # and they trained
        np.testing.assert_allclose(mpi[key], hvd[key], rtol=RTOL, atol=ATOL, err_msg=key)
    state = json.loads((tmp_path / "mpi4py" / "state.json").read_text())
    assert state["replicas_identical"] is True and state["step"] == 15


@pytest.mark.parametrize("fault", ["HPCDL_TEST_KILL_AT", "HPCDL_TEST_RAISE_AT"])
def test_a_rank_that_dies_or_fails_alone_ends_the_mpi4py_group_in_bounded_time(mpi4py_mpi, hep_files, tmp_path, fault):
    """Killed (SIGKILL), or leaving on an exception the other rank does not share: without the
    abort, that rank would wait in MPI_Finalize and the other in its allreduce, for ever."""
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=10000)
    began = time.monotonic()
    proc = mpirun_pair(mpi4py_mpi, tmp_path, overrides, **{fault: "12"})
    assert proc.returncode != 0
    assert time.monotonic() - began < 120
    # rank 0 had checkpointed (every 10 steps) before its partner died: a restart resumes there
    assert (tmp_path / "ckpt" / "ckpt-10.index").is_file()
