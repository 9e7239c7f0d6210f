import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpcdl.process.launch import (
    SUPERVISOR_PID_ENV, LaunchError, MpiLauncher, RankEnv, expand_nodelist, find_mpi_launcher, is_open_mpi,
    open_mpi_root_allowed, slurm_group_plan,
)
from tests.conftest import wait_for


def slurm_env(**extra):
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_NNODES": "2", "SLURMD_NODENAME": "n2", "SLURM_ARRAY_TASK_ID": "7"}
    env.update(extra)
    return env


def test_rank_from_slurm():
    r = RankEnv.from_slurm(slurm_env())
    assert r == RankEnv(rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2,
                        hostname="n2", group=7)


def test_horovod_env_round_trip():
    r = RankEnv.from_slurm(slurm_env())
    env = r.to_horovod_env("10.0.0.1", 4567, iface="ib0")
    assert env["HOROVOD_RANK"] == "3" and env["HOROVOD_SIZE"] == "4"
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1" and env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4567"
    assert env["HOROVOD_CONTROLLER"] == "gloo" and env["HOROVOD_GLOO_IFACE"] == "ib0"
    assert RankEnv.from_horovod(env) == r


def test_missing_slurm_variable_says_how_to_fix():
    env = slurm_env()
    del env["SLURM_PROCID"]
    with pytest.raises(LaunchError, match="SLURM_PROCID is not set.*HINT"):
        RankEnv.from_slurm(env)


def test_uneven_tasks_per_node_rejected():
    with pytest.raises(LaunchError, match="ntasks-per-node"):
        RankEnv.from_slurm(slurm_env(SLURM_NTASKS="3"))


@pytest.mark.parametrize("text, names", [
    ("n1", ["n1"]),
    ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
    ("c[01-03],gpu1", ["c01", "c02", "c03", "gpu1"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("nid[00098-00101]", ["nid00098", "nid00099", "nid00100", "nid00101"]),
])
def test_expand_nodelist(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("bad", ["n[1-3", "n1]", "n[3-1]", "n[a-b]"])
def test_bad_nodelist(bad):
    with pytest.raises(LaunchError):
        expand_nodelist(bad)


def test_slurm_group_plan_matches_block_distribution():
    plan = slurm_group_plan(["a", "b"], ranks_per_node=2, group=1)
    assert [(p.rank, p.hostname, p.local_rank, p.cross_rank) for p in plan] == [
        (0, "a", 0, 0), (1, "a", 1, 0), (2, "b", 0, 1), (3, "b", 1, 1)]
    assert all(p.size == 4 and p.local_size == 2 and p.cross_size == 2 and p.group == 1 for p in plan)


def test_rank_from_open_mpi_and_from_hydra():
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "HPCDL_GROUP": "1"}
    assert RankEnv.from_mpi(ompi, "here") == RankEnv(rank=3, size=4, local_rank=3, local_size=4, cross_rank=0,
                                                     cross_size=1, hostname="here", group=1)
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert RankEnv.from_mpi(hydra, "here").rank == 1 and RankEnv.from_mpi(hydra, "here").group == 0


def test_not_under_an_mpi_launcher_says_so():
    with pytest.raises(LaunchError, match="PMI_RANK is not set.*mpirun"):
        RankEnv.from_mpi({}, "here")


def test_mpi_env_sets_the_controller_and_no_rendezvous():
    env = RankEnv.from_slurm(slurm_env()).to_mpi_env()
    assert env == {"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi", "HPCDL_GROUP": "7"}


def test_a_rank_alone_in_its_mpi_world_is_refused():
    """srun without an MPI plugin that the MPI speaks: every rank initialises as 0 of 1."""
    r = RankEnv.from_slurm(slurm_env())
    r.check_mpi_world(3, 4)
    with pytest.raises(LaunchError, match="MPI sees this rank as 0 of 1.*3 of 4.*slurm.mpi"):
        r.check_mpi_world(0, 1)


def test_mpi_launcher_commands(tmp_path):
    argv = ["python", "-m", "hpcdl.process.worker", "RUN", "--mpi"]
    assert MpiLauncher("/usr/bin/mpirun", open_mpi=True).command(4, argv) == [
        "/usr/bin/mpirun", "-np", "4", "--oversubscribe", "--bind-to", "none", *argv]
    assert MpiLauncher("/opt/mpich/bin/mpiexec", open_mpi=False).command(2, argv) == [
        "/opt/mpich/bin/mpiexec", "-n", "2", *argv]
    assert is_open_mpi("mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n")
    assert not is_open_mpi("HYDRA build details:\n    Version:                                 4.1.2\n")
    assert find_mpi_launcher(which=lambda name: None, venv_bin=tmp_path) is None


def test_open_mpi_root_needs_both_variables():
    assert not open_mpi_root_allowed({"OMPI_ALLOW_RUN_AS_ROOT": "1"})
    assert open_mpi_root_allowed({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})


FOLLOWER = textwrap.dedent("""
    import os, signal, sys, time
    from hpcdl.process.launch import follow_supervisor
    signal.signal(signal.SIGTERM, lambda signum, _: (open(sys.argv[1], "w").write(f"stopped by {signum}"), sys.exit(0)))
    follow_supervisor(os.environ, poll_s=0.1)
    open(sys.argv[1] + ".ready", "w").close()
    time.sleep(60)
""")


@pytest.mark.parametrize("direct", [True, False], ids=["child", "grandchild"])
def test_a_local_backends_process_stops_when_its_supervisor_is_killed(tmp_path, direct):
    """A kill -9 of the supervisor: its child (through the kernel) and a rank under mpirun (by
    watching) get the clean stop's SIGTERM."""
    mark = tmp_path / "mark"
    # the "supervisor" starts the follower directly, or through an intermediate process (mpirun)
    spawn = (f"subprocess.Popen([sys.executable, '-c', {FOLLOWER!r}, {str(mark)!r}], env=env)" if direct else
             f"subprocess.Popen([sys.executable, '-c', 'import subprocess, sys, os; "
             f"subprocess.Popen([sys.executable, \"-c\", sys.argv[1], sys.argv[2]]).wait()', {FOLLOWER!r}, {str(mark)!r}], env=env)")
    supervisor = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys, time
        env = dict(os.environ, {SUPERVISOR_PID_ENV}=str(os.getpid()))
        {spawn}
        time.sleep(60)
    """)])
    try:
        wait_for(lambda: Path(f"{mark}.ready").exists(), timeout=60, what="the follower started")
        assert not mark.exists()  # alive while its supervisor is
        supervisor.kill()
        supervisor.wait(timeout=10)
        killed_at = time.monotonic()
        wait_for(lambda: mark.exists() and mark.read_text(), timeout=30, what="the follower stopped")
        assert mark.read_text() == f"stopped by {int(signal.SIGTERM)}"  # the clean stop's signal
        assert time.monotonic() - killed_at < 10
    finally:
        supervisor.kill()
