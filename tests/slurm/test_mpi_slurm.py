"""run.controller = "mpi" (and "mpi4py") on the real local SLURM cluster: each group one MPI job
started by `srun --mpi=pmix` over 2 virtual nodes, 2 groups and the applier."""

import json
from pathlib import Path

import pytest

from tests.conftest import set_args, tiny_overrides
from tests.slurm.test_hpcdl_slurm import LOCAL_CLUSTER, hpcdl, no_jobs_left, submit, wait_status  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.mpi]

# The test cluster's slurmd all run on one host under one hostname: Open MPI's shared-memory
# transport can break between its "nodes" there, so the ranks talk TCP (a site's setting, not
# hpcdl's: on a real cluster Open MPI picks the fast transport itself).
MPI = ['run.controller="mpi"', 'slurm.mpi="pmix"', 'slurm.setup=["export OMPI_MCA_btl=self,tcp"]']


def element_logs(run_dir: Path, group: int) -> str:
    return "\n".join(p.read_text() for p in (run_dir / "groups" / str(group)).glob("slurm-*.out"))


@pytest.mark.parametrize("controller, needs", [pytest.param("mpi", "mpi_horovod", id="horovod-mpi"),
                                                pytest.param("mpi4py", "mpi4py_mpi", id="mpi4py")])
def test_mpi_groups_and_the_applier_train_to_the_end(slurm_cluster, controller, needs, request, hep_files, tmp_path):
    request.getfixturevalue(needs)
    sub = submit(hep_files, tmp_path, 40, *MPI, f'run.controller="{controller}"')
    run_dir = Path(sub["run_dir"])
    done = wait_status(run_dir, tmp_path, lambda s: s["state"] == "finished" and all(
        g["backend"].get("state") == "completed" for g in s["groups"]), what="the end")
    assert [g["step"] for g in done["groups"]] == [40, 40]
    assert all(g["backend"].get("nodes") for g in done["groups"]), done["groups"]
    assert done["applier"]["applied"] > 0
    for g in (0, 1):
        last = json.loads((run_dir / f"groups/{g}/metrics.jsonl").read_text().splitlines()[-1])
        assert last["ranks"] == 2  # one MPI world of two ranks, not two worlds of one
        # the two ranks, on different virtual nodes and shards, hold the same weights to the bit
        assert json.loads((run_dir / f"groups/{g}/state.json").read_text())["replicas_identical"] is True
        assert not list((run_dir / f"groups/{g}").glob("rendezvous.*"))
        assert "srun --kill-on-bad-exit=1 --mpi=pmix --ntasks-per-node=1" in element_logs(run_dir, g)


def test_an_mpi_group_checkpoints_and_requeues_at_the_signal(slurm_cluster, mpi_horovod, hep_files, tmp_path):
    sub = submit(hep_files, tmp_path, 1_000_000, *MPI, "slurm.time=1", "slurm.signal_seconds=58",
                 "exchange.enabled=off", nodes=2, group_size=2)
    run_dir = Path(sub["run_dir"])
    done = wait_status(run_dir, tmp_path, lambda s: s["groups"][0]["planned_requeues"] >= 1 and s["groups"][0]["step"] > 0,
                       timeout=300, what="a requeue after the signal")
    assert "checkpointed; requeueing" in element_logs(run_dir, 0)
    assert list((run_dir / "checkpoints/0").glob("ckpt-*.index"))
    hpcdl("cancel", str(run_dir), cwd=tmp_path)
    assert done["groups"][0]["planned_requeues"] >= 1 and done["groups"][0]["crash_restarts"] == 0


def test_an_srun_mpi_plugin_the_cluster_lacks_is_refused(slurm_cluster, mpi_horovod, hep_files, tmp_path):
    overrides = tiny_overrides(hep_files, tmp_path / "runs", steps=5) + LOCAL_CLUSTER + [
        'run.controller="mpi"', 'slurm.mpi="pmix_v9"']
    proc = hpcdl("submit", "hep", "--nodes", "2", "--group-size", "2", *set_args(overrides), cwd=tmp_path,
                 check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [l for l in proc.stderr.splitlines() if l.startswith("Error:")]
    assert "slurm.mpi = 'pmix_v9' is not an MPI plugin of this cluster's srun (srun --mpi=list: pmix," in line
    assert not (tmp_path / "runs").exists()
