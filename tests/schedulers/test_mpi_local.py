"""run.controller = "mpi" on the local backend: one real mpirun per group, through `hpcdl`."""

import json
import os
import time

import pytest

from hpcdl.errors import JobError
from hpcdl.jobfile import load_job
from hpcdl.rundir.runs import RunDir
from hpcdl.schedulers.base import SubmitRequest
from hpcdl.schedulers.local import LocalScheduler, check_local_mpi
from tests.conftest import mpi_test_env, set_args, tiny_overrides
from tests.conftest import hpcdl as run_checked

MPI = ['run.controller="mpi"']


def hpcdl(*args, env=None, **kwargs):
    return run_checked(*args, env=env or mpi_test_env(), **kwargs)


def status(run_dir, cwd):
    return json.loads(hpcdl("status", str(run_dir), "--json", cwd=cwd).stdout)


# each MPI-launched controller, with the fixture that says whether this machine has it
MPI_CONTROLLERS = [pytest.param("mpi", "mpi_horovod", id="horovod-mpi"), pytest.param("mpi4py", "mpi4py_mpi", id="mpi4py")]


@pytest.mark.mpi
@pytest.mark.parametrize("controller, needs", MPI_CONTROLLERS)
def test_two_groups_under_mpirun_and_the_applier_train_to_the_end(controller, needs, request, hep_files, tmp_path):
    request.getfixturevalue(needs)
    runs = tmp_path / "runs"
    out = hpcdl("submit", "hep", "--nodes", "4", "--group-size", "2", "--json",
                *set_args(tiny_overrides(hep_files, runs, steps=20) + [f'run.controller="{controller}"']), cwd=tmp_path)
    submitted = json.loads(out.stdout)
    run_dir = runs / submitted["run_id"]
    assert submitted["ok"] is True, [p.read_text()[-2000:] for p in run_dir.glob("groups/*/*.log")]
    done = status(run_dir, tmp_path)
    assert done["state"] == "finished" and [g["step"] for g in done["groups"]] == [20, 20]
    assert done["applier"]["applied"] > 0
    for g in (0, 1):
        group = run_dir / "groups" / str(g)
        # Every rank's weights the same to the bit after steps on different shards (hpcdl.engine.train).
        assert json.loads((group / "state.json").read_text())["replicas_identical"] is True
        # each rank wrote its own log; mpirun's own output is beside them
        assert sorted(p.name for p in group.glob("rank*.log")) == ["rank0.log", "rank1.log"]
        assert all(f"hpcdl rank {r}:" in (group / f"rank{r}.log").read_text() for r in (0, 1))
        assert (group / "mpirun.log").is_file()
    assert not list(run_dir.glob("groups/*/rendezvous*"))


@pytest.mark.mpi
def test_a_cancel_reaches_the_ranks_through_mpirun_and_they_checkpoint(mpi_horovod, hep_files, tmp_path):
    """mpirun kills its ranks a few seconds after a SIGTERM; the supervisor sends SIGUSR1, which
    mpirun passes on, so the group agrees on a step and checkpoints there."""
    runs = tmp_path / "runs"
    out = json.loads(hpcdl("submit", "hep", "--detach", "--json", "--nodes", "2",
                           *set_args(tiny_overrides(hep_files, runs, steps=100000) + MPI), cwd=tmp_path).stdout)
    run_dir = runs / out["run_id"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (run_dir / "groups/0/state.json").is_file():
        time.sleep(1)
    assert status(run_dir, tmp_path)["groups"][0]["step"] > 0
    assert "SIGTERM" in hpcdl("cancel", str(run_dir), cwd=tmp_path).stdout
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and status(run_dir, tmp_path)["state"] == "running":
        time.sleep(1)
    final = status(run_dir, tmp_path)
    assert final["groups"][0]["state"] == "cancelled", final
    state = json.loads((run_dir / "groups/0/state.json").read_text())
    assert state["state"] == "stopped" and state["replicas_identical"] is True
    assert (run_dir / f"checkpoints/0/ckpt-{state['step']}.index").is_file()  # checkpointed at the stop


def one_error_line(stderr: str) -> str:
    (line,) = [l for l in stderr.splitlines() if l.startswith("Error:")]
    return line


@pytest.mark.mpi
def test_no_mpi_launcher_is_refused_with_one_line(mpi_horovod, hep_files, tmp_path):
    env = {**mpi_test_env(), "PATH": str(tmp_path)}  # neither mpirun nor mpiexec
    proc = hpcdl("submit", "hep", "--nodes", "2", *set_args(tiny_overrides(hep_files, tmp_path / "runs") + MPI),
                 cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'run.controller = "mpi" on the local backend needs mpirun or mpiexec on PATH' in one_error_line(proc.stderr)
    assert not (tmp_path / "runs").exists()


@pytest.mark.mpi
@pytest.mark.skipif(os.geteuid() != 0, reason="Open MPI's refusal of root: run as root to see it")
def test_open_mpi_as_root_without_its_consent_is_refused_with_one_line(mpi_horovod, hep_files, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    proc = hpcdl("submit", "hep", "--nodes", "2", *set_args(tiny_overrides(hep_files, tmp_path / "runs") + MPI),
                 cwd=tmp_path, env=env, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Open MPI's mpirun refuses to run as root" in one_error_line(proc.stderr)


@pytest.mark.parametrize("controller, facts, message", [
    ("mpi", {"horovod_mpi": False, "mpi_launcher": "/usr/bin/mpirun", "open_mpi": True}, "needs Horovod built with MPI"),
    ("mpi", {"mpi_launcher": None}, 'controller = "mpi" on the local backend needs mpirun or mpiexec on PATH'),
    ("mpi4py", {"mpi_launcher": None}, 'controller = "mpi4py" on the local backend needs mpirun or mpiexec on PATH'),
    ("mpi", {"mpi_launcher": "/usr/bin/mpirun", "open_mpi": True, "root": True, "open_mpi_root_allowed": False},
     "refuses to run as root"),
    ("mpi4py", {"mpi4py_problem": "RuntimeError: cannot load MPI library", "mpi_launcher": "/usr/bin/mpirun"},
     'controller = "mpi4py" cannot load MPI here: RuntimeError: cannot load MPI library'),
])
def test_local_mpi_refusals(tmp_path, controller, facts, message):
    job = load_job("hep", ["run.backend=local", "run.nodes=2", f'run.controller="{controller}"'])
    with pytest.raises(JobError, match=message):
        LocalScheduler().submit_dryrun(SubmitRequest(job, RunDir(tmp_path / "r"), "python", facts))


def test_the_local_dry_run_shows_one_mpirun_per_group(tmp_path):
    job = load_job("hep", ["run.backend=local", "run.nodes=4", "run.group_size=2", *MPI])
    facts = {"mpi_launcher": "/usr/bin/mpirun", "open_mpi": True, "root": False, "horovod_mpi": True}
    dry = LocalScheduler().submit_dryrun(SubmitRequest(job, RunDir(tmp_path / "r"), "python", facts))
    groups = [c for c in dry.commands if "/usr/bin/mpirun" in c]
    assert len(groups) == 2
    assert groups[1] == ["env", "HOROVOD_CONTROLLER=mpi", "HOROVOD_CPU_OPERATIONS=mpi", "HPCDL_GROUP=1",
                         "/usr/bin/mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
                         "python", "-m", "hpcdl.process.worker", str(tmp_path / "r"), "--mpi"]
    assert not any("ALLOW_RUN_AS_ROOT" in " ".join(c) for c in dry.commands)
    check_local_mpi(load_job("hep", ["run.nodes=2"]), {"mpi_launcher": None})  # gloo: no launcher needed
