"""Smoke tests against the real local SLURM daemons started by tests/slurm/cluster.sh."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

NODES = {"n1", "n2", "n3", "n4"}


def run(*cmd: str, timeout: float = 30) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout).stdout


def poll(what: str, fn, timeout: float = 30, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        ok, last = fn()
        if ok:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


def node_states() -> dict[str, str]:
    out = run("sinfo", "--noheader", "-N", "-o", "%N %t")
    return dict(line.split() for line in out.splitlines() if line.strip())


def test_sinfo_shows_four_idle_nodes(slurm_cluster):
    assert slurm_cluster.slurm_conf.is_file()
    states = poll(
        "4 idle nodes",
        lambda: ((s := node_states()) == {n: "idle" for n in NODES}, s),
        timeout=30,
    )
    assert states == {n: "idle" for n in NODES}


def test_array_job_runs_srun_on_two_nodes_and_is_accounted(slurm_cluster, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "srun bash -c 'echo \"$SLURM_ARRAY_TASK_ID $SLURM_PROCID $SLURMD_NODENAME\""
        f" > {tmp_path}/task-$SLURM_ARRAY_TASK_ID-$SLURM_PROCID.txt'\n"
    )
    job_id = run(
        "sbatch", "--parsable", "--array=0-1", "-N2", "--ntasks-per-node=1",
        "--time=2", f"--output={tmp_path}/slurm-%A_%a.out", str(script),
    ).strip().split(";")[0]
    assert job_id.isdigit(), job_id

    poll("the array job to leave the queue",
         lambda: ((q := run("squeue", "--noheader", "-j", job_id).strip()) == "", q),
         timeout=40)

    for task in (0, 1):
        nodes = set()
        for proc in (0, 1):
            f = tmp_path / f"task-{task}-{proc}.txt"
            assert f.is_file(), f"missing {f.name}; outputs: {sorted(p.name for p in tmp_path.iterdir())}"
            array_id, procid, node = f.read_text().split()
            assert (array_id, procid) == (str(task), str(proc))
            assert node in NODES
            nodes.add(node)
        assert len(nodes) == 2, f"array task {task} ran both ranks on {nodes}"

    def states():
        out = run("sacct", "-j", job_id, "--parsable2", "--noheader", "-o", "JobID,State")
        got = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
        elems = {k: v for k, v in got.items() if k in (f"{job_id}_0", f"{job_id}_1")}
        return elems == {f"{job_id}_0": "COMPLETED", f"{job_id}_1": "COMPLETED"}, got

    poll("sacct to show both array elements COMPLETED", states, timeout=30)


def test_config_has_max_array_size(slurm_cluster):
    config = run("scontrol", "show", "config")
    m = re.search(r"^MaxArraySize\s*=\s*(\d+)", config, re.M)
    assert m, "MaxArraySize missing from scontrol show config"
    assert int(m.group(1)) >= 1001


def _kill_cluster_uncleanly(state_dir, marker: str) -> None:
    """SIGKILL every daemon and job process of the cluster, as a machine reset would."""
    import os
    import signal

    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
            comm = (proc / "comm").read_text().strip()
        except OSError:
            continue
        if f"HPCDL_SLURM_DAEMON={state_dir}".encode() in environ or comm == "slurmstepd" or marker.encode() in cmdline:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_cluster_killed_with_jobs_running_starts_again_with_idle_nodes(slurm_cluster, tmp_path):
    # A CI machine restored from a snapshot taken mid-suite keeps slurmctld's saved jobs (an array
    # task running, its siblings pending) and stale pid files; a start must clear them, not wait
    # for nodes those jobs hold.
    marker = "6061.5"
    array_id = run("sbatch", "--parsable", "-N4", "--array=0-2%1", f"--output={tmp_path}/%A_%a.out",
                   "--wrap", f"srun sleep {marker}").strip()
    single_id = run("sbatch", "--parsable", "-N1", f"--output={tmp_path}/%j.out",
                    "--wrap", f"sleep {marker}").strip()
    poll("both jobs to run",
         lambda: ((q := run("squeue", "-h", "-t", "R", "-o", "%i")).count("\n") == 2, q), timeout=30)
    # slurmctld saves its job state a few seconds after a change: a change now, and its save,
    # make sure the running jobs are in what a restart recovers.
    job_state, asked = slurm_cluster.state_dir / "state" / "slurmctld" / "job_state", time.time()
    run("scontrol", "update", f"jobid={single_id}", "comment=saved")
    poll("slurmctld to save its job state", lambda: (job_state.stat().st_mtime > asked, job_state.stat().st_mtime))

    _kill_cluster_uncleanly(slurm_cluster.state_dir, marker)
    start = subprocess.run([str(slurm_cluster.script), "start"], capture_output=True, text=True, timeout=300)
    assert start.returncode == 0, start.stderr[-3000:]
    assert "cancelling jobs left over" in start.stderr, start.stderr[-3000:]

    assert run("squeue", "-h", "-o", "%i").strip() == ""
    assert node_states() == {n: "idle" for n in NODES}
    after = run("sbatch", "--parsable", "--wait", "-N4", f"--output={tmp_path}/%j.out", "--wrap", "srun true",
                timeout=60).strip()
    sacct = run("sacct", "-X", "-n", "-P", "-j", after, "-o", "State")
    assert sacct.split() == ["COMPLETED"], (array_id, single_id, sacct)
