"""run.backend = "auto" and the local backend's size check: `hpcdl submit hep
--nodes 9600`, exactly as the design card writes it, goes to SLURM where sbatch is on PATH and the
controller answers, and is refused with one line on a machine that cannot hold 9600 ranks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpcdl.errors import JobError
from hpcdl.jobfile import load_job
from hpcdl.schedulers.select import choose_backend
from hpcdl.schedulers.local import check_capacity
from tests.conftest import HPCDL

SCONTROL = """#!/bin/bash
case "$1" in
  ping) [ -e "$FAKE_SLURM/down" ] && { echo "Slurmctld(primary) at ctl is DOWN"; exit 1; }
        echo "Slurmctld(primary) at ctl is UP" ;;
  show) echo "MaxArraySize            = 1001"; echo "SLURM_VERSION           = 23.02.6" ;;
esac
"""


def path_with(tmp_path: Path, sbatch: bool) -> dict[str, str]:
    """PATH with stand-ins for sbatch and scontrol (real processes), or with neither."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if sbatch:
        (bin_dir / "sbatch").write_text("#!/bin/bash\necho \"$@\" >> \"$FAKE_SLURM/calls\"; echo '77;c'\n")
        (bin_dir / "scontrol").write_text(SCONTROL)
        for name in ("sbatch", "scontrol"):
            (bin_dir / name).chmod(0o755)
    # python, and nothing of a real SLURM installation
    system = [d for d in ("/usr/local/bin", "/usr/bin", "/bin") if not (Path(d) / "sbatch").exists()]
    return {**os.environ, "PATH": ":".join([str(bin_dir), str(Path(HPCDL).parent), *system]),
            "FAKE_SLURM": str(bin_dir)}


def submit(tmp_path, env, *args):
    return subprocess.run([HPCDL, "submit", "hep", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_design_card_command_without_sbatch_is_refused_with_one_line(tmp_path):
    proc = submit(tmp_path, path_with(tmp_path, sbatch=False), "--nodes", "9600")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "9600 ranks" in errors[0] and "--backend slurm" in errors[0], proc.stderr
    assert "backend: local (run.backend = auto and there is no sbatch on PATH" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_the_design_card_command_with_sbatch_goes_to_slurm(tmp_path, hep_files):
    env = path_with(tmp_path, sbatch=True)
    proc = submit(tmp_path, env, "--nodes", "9600", "--group-size", "96", "--dry-run", "--no-check-data")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend: slurm (run.backend = auto: sbatch is on PATH and the SLURM controller answers" in proc.stderr
    assert "--array=0-99" in proc.stdout and "#SBATCH --nodes=96" in proc.stdout
    # and for real: the job file saved in the run names the backend that was chosen
    proc = submit(tmp_path, env, "--nodes", "4", "--group-size", "2", "--json",
                  "--set", f'data.train="{hep_files["train"]}"', "--set", f'data.val="{hep_files["test"]}"',
                  "--set", f'data.test="{hep_files["test"]}"')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = (tmp_path / "runs").iterdir()
    assert 'backend = "slurm"' in (run / "job.toml").read_text()
    assert (tmp_path / "bin" / "calls").read_text().count("--parsable") == 2


def test_a_controller_that_does_not_answer_means_local(tmp_path):
    env = path_with(tmp_path, sbatch=True)
    (tmp_path / "bin" / "down").touch()
    proc = submit(tmp_path, env, "--nodes", "9600")
    assert proc.returncode == 2 and "the SLURM controller does not answer" in proc.stderr, proc.stderr
    assert "DOWN" in proc.stderr


def test_choose_backend_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", path_with(tmp_path, sbatch=False)["PATH"])
    assert choose_backend()[0] == "local"
    env = path_with(tmp_path, sbatch=True)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("FAKE_SLURM", env["FAKE_SLURM"])
    assert choose_backend()[0] == "slurm"


@pytest.mark.parametrize("nodes, ranks_per_node, group_size, facts, refused", [
    (2, 1, 0, {"cores": 2, "memory_available": 16 << 30}, False),      # make run
    (4, 1, 2, {"cores": 2, "memory_available": 16 << 30}, False),      # 4 ranks + the applier
    (8, 1, 4, {"cores": 2, "memory_available": 16 << 30}, False),      # 8 ranks + the applier
    (10, 1, 5, {"cores": 2, "memory_available": 16 << 30}, True),      # 10 ranks + the applier
    (3, 4, 0, {"cores": 2, "memory_available": 16 << 30}, True),
    (4, 1, 0, {"cores": 64, "memory_available": 1 << 30}, True),       # memory, not cores
    (9600, 1, 96, {"cores": 256, "memory_available": 1 << 40}, True),
    (9600, 1, 96, {}, False),                                          # nothing known: no check
])
def test_check_capacity(nodes, ranks_per_node, group_size, facts, refused):
    job = load_job("hep", [f"run.nodes={nodes}", f"run.ranks_per_node={ranks_per_node}",
                           f"run.group_size={group_size}"])
    if refused:
        with pytest.raises(JobError, match="--backend slurm"):
            check_capacity(job, facts)
    else:
        check_capacity(job, facts)


def test_missing_data_is_refused_on_slurm_too_unless_told_not_to_check(tmp_path, hep_files):
    env = path_with(tmp_path, sbatch=True)
    missing = tmp_path / "elsewhere" / "train.h5"
    args = ["--backend", "slurm", "--nodes", "4", "--group-size", "2", "--set", f'data.train="{missing}"',
            "--set", f'run.runs_dir="{tmp_path / "runs"}"']
    proc = submit(tmp_path, env, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and str(missing) in errors[0], proc.stderr
    assert not (tmp_path / "bin" / "calls").exists() and not (tmp_path / "runs").exists()
    # The files exist only on the compute nodes: --no-check-data (run.check_data = false).
    proc = submit(tmp_path, env, *args, "--no-check-data", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "bin" / "calls").read_text().count("--parsable") == 2
    proc = submit(tmp_path, env, *args, "--set", "run.check_data=false", "--dry-run")
    assert proc.returncode == 0, proc.stderr


def test_bare_cancel_asks_an_unreachable_controller_once(tmp_path, monkeypatch):
    """Old SLURM runs under runs/ and a controller that does not answer: one squeue, not one per run."""
    import subprocess as sp

    import hpcdl.schedulers.slurm as slurm
    from hpcdl.rundir.runs import create_run
    from hpcdl.fs.files import atomic_write_json
    from hpcdl.schedulers.select import cancel_run

    job = load_job("hep", [f'run.runs_dir="{tmp_path / "runs"}"', "run.backend=slurm"])
    for n in range(3):
        with create_run(job, "slurm", run_id=f"hep-2026010{n + 1}-000000-abcd") as (staged, _):
            atomic_write_json(staged.root / "scheduler/slurm.json", {"slurm_array_job_id": str(40 + n)})
    calls = []

    def unreachable(cmd, timeout=30.0):
        calls.append(cmd[0])
        return sp.CompletedProcess(cmd, 1, "", "slurm_load_jobs error: Unable to contact slurm controller")

    monkeypatch.setattr(slurm, "_run", unreachable)
    said = cancel_run(None, tmp_path / "runs")
    assert said.startswith("nothing to cancel") and "could not tell" in said and "hep-20260103" in said
    assert calls == ["squeue"]


@pytest.mark.parametrize("horovod_gloo, mpi4py_problem, chosen", [
    (True, "", "gloo"),  # Horovod needs no MPI launcher: it goes first
    (True, "no MPI library", "gloo"),
    (False, "", "mpi4py"),  # an installation without Horovod still trains
])
def test_auto_controller_is_the_collective_this_installation_has(monkeypatch, horovod_gloo, mpi4py_problem, chosen):
    from hpcdl.process import launch
    from hpcdl.schedulers.select import choose_controller

    monkeypatch.setattr(launch, "horovod_built", lambda feature: horovod_gloo and feature == "gloo")
    monkeypatch.setattr(launch, "mpi4py_problem", lambda python: mpi4py_problem)
    controller, why = choose_controller()
    assert controller == chosen and why.startswith("run.controller = auto")


def test_auto_controller_with_neither_collective_is_refused_with_what_to_do(monkeypatch):
    from hpcdl.process import launch
    from hpcdl.schedulers.select import choose_controller

    monkeypatch.setattr(launch, "horovod_built", lambda feature: False)
    monkeypatch.setattr(launch, "mpi4py_problem", lambda python: "RuntimeError: cannot load MPI library")
    with pytest.raises(JobError, match=r"neither Horovod with Gloo nor mpi4py loads here \(mpi4py: RuntimeError: "
                                       r"cannot load MPI library\); reinstall with `make install`"):
        choose_controller()


def test_the_installed_stack_gives_auto_its_default_and_job_toml_records_it(tmp_path):
    """Here Horovod is built with Gloo: a submit's job.toml says "gloo", not "auto"."""
    from hpcdl.rundir.runs import RunDir
    from hpcdl.commands.submit import prepare_launch

    job = load_job("hep", ["run.backend=local", "run.check_data=false"])
    prepared = prepare_launch(job, RunDir(tmp_path / "r"))
    assert prepared.job.run.controller == "gloo"
    assert "controller: gloo (run.controller = auto: Horovod with Gloo loads here)" in prepared.note
