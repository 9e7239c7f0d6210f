"""Rendering and parsing of the SLURM backend: pure functions, no cluster needed."""

import subprocess
from pathlib import Path

import pytest

from hpcdl.errors import JobError
from hpcdl.jobfile import load_job
from hpcdl.rundir.runs import RunDir
from hpcdl.schedulers.base import SubmitRequest
from hpcdl.schedulers.slurm import (
    SlurmScheduler, map_state, parse_mpi_list, parse_preempt_time, parse_sacct, parse_scontrol_config, parse_squeue,
    ranks_environment,
    render_group_script, sbatch_commands, srun_command,
)

GOLDEN = Path(__file__).parent / "golden"


def request(overrides=(), run_dir="/scratch/runs/hep-1", cluster=None):
    job = load_job("hep", ["run.backend=slurm", "run.nodes=8", "run.group_size=4", "run.ranks_per_node=2",
                           "slurm.partition=regular", "slurm.account=m1234", "slurm.cpus_per_task=34",
                           'slurm.setup=["module load python/3.11"]', *overrides])
    return SubmitRequest(job, RunDir(Path(run_dir)), "/opt/hpcdl/bin/python", cluster or {})


def test_rendered_scripts_match_the_golden_files():
    dry = SlurmScheduler().submit_dryrun(request())
    for name in ("group.sbatch", "applier.sbatch"):
        assert dry.files[f"scheduler/{name}"] == (GOLDEN / name).read_text(), name
    assert dry.commands == [
        ["sbatch", "--parsable", "--output=/scratch/runs/hep-1/applier-%j.out",
         "/scratch/runs/hep-1/scheduler/applier.sbatch"],
        ["sbatch", "--parsable", "--array=0-1", "--output=/scratch/runs/hep-1/groups/%a/slurm-%A_%a.out",
         "/scratch/runs/hep-1/scheduler/group.sbatch"],
    ]


def test_9600_nodes_render_a_100_element_array():
    req = request(["run.nodes=9600", "run.group_size=96", "run.ranks_per_node=1"], cluster={"max_array_size": 1001})
    dry = SlurmScheduler().submit_dryrun(req)
    assert "--array=0-99" in dry.commands[-1]
    assert "#SBATCH --nodes=96" in dry.files["scheduler/group.sbatch"]


def test_more_groups_than_max_array_size():
    with pytest.raises(JobError, match="MaxArraySize is 1001"):
        SlurmScheduler().submit_dryrun(request(["run.nodes=9600", "run.group_size=8"], cluster={"max_array_size": 1001}))


@pytest.mark.parametrize("override", [
    'slurm.partition="debug; rm -rf ~"', 'slurm.account="$(id)"', 'slurm.qos="a b"',
    'slurm.time="1:00:00\\n#SBATCH --uid=0"', 'slurm.extra_sbatch=["--mail-user=$(id)"]',
    'slurm.extra_sbatch=["not an option"]', 'slurm.constraint="knl`id`"',
])
def test_values_that_could_inject_are_refused(override):
    with pytest.raises(JobError, match="slurm\\."):
        render_group_script(request([override]))


def test_weird_run_directory_is_quoted(tmp_path):
    weird = tmp_path / "my runs $(touch pwned) 'quoted' \"double\"" / "hep-1"
    script = render_group_script(request(run_dir=str(weird)))
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    line = next(l for l in script.splitlines() if l.startswith("exec "))
    out = subprocess.run(["bash", "-c", "last() { printf %s \"${@: -1}\"; }; " + line.replace("exec ", "last ", 1)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout == str(weird) and not (tmp_path / "pwned").exists()
    # paths that sbatch sees travel as arguments, never through a shell or a directive
    commands = sbatch_commands(request(run_dir=str(weird)))
    assert commands["array"][-1] == f"{weird}/scheduler/group.sbatch"


def test_template_dir_override(tmp_path):
    (tmp_path / "group.sbatch").write_text("#!/bin/bash\n{{ sbatch_directives }}\necho site {{ run_dir }}\nexec {{ launch }}\n")
    script = render_group_script(request([f'slurm.template_dir="{tmp_path}"']))
    assert "\necho site /scratch/runs/hep-1\nexec " in script
    (tmp_path / "group.sbatch").write_text("{{ nonsense }}\n")
    with pytest.raises(JobError, match="unknown placeholder"):
        render_group_script(request([f'slurm.template_dir="{tmp_path}"']))


# -- parsers on recorded output (Slurm 22.05) -------------------------------------------------
SQUEUE = """\
41_0|RUNNING|n[1-2]|0:17
41_1|PENDING||0:00
40|RUNNING|n1|0:18
"""

SACCT = """\
JobID|State|NodeList|Elapsed
40|COMPLETED|n1|00:00:34
41_0|COMPLETED|n[1-2]|00:00:35
41_1|CANCELLED by 0|n[3-4]|00:00:12
42_[2-3]|PENDING|None assigned|00:00:00
"""

SCONTROL = """\
Configuration data as of 2026-11-29T19:14:03
AccountingStorageType   = accounting_storage/slurmdbd
MaxArraySize            = 1001
SLURM_VERSION           = 22.05.8
"""


def test_parse_squeue():
    jobs = parse_squeue(SQUEUE)
    assert jobs["41_0"] == {"state": "running", "slurm_state": "RUNNING", "nodes": "n[1-2]", "elapsed": "0:17"}
    assert jobs["41_1"]["state"] == "pending" and jobs["40"]["nodes"] == "n1"


def test_parse_squeue_with_the_pending_reason():
    jobs = parse_squeue("41_0|RUNNING|n[1-2]|0:17|None\n41_1|PENDING||0:00|Resources\n40|PENDING||0:00|None\n")
    assert "reason" not in jobs["41_0"] and jobs["41_1"]["reason"] == "Resources"
    assert "reason" not in jobs["40"] and jobs["41_0"]["nodes"] == "n[1-2]"


def test_status_shows_the_pending_reason_and_the_applier_s_node(tmp_path):
    import io

    from rich.console import Console

    from hpcdl.jobfile import load_job
    from hpcdl.commands.display import status_view
    from hpcdl.rundir.runs import create_run
    from hpcdl.commands.status import collect

    job = load_job("hep", [f'run.runs_dir="{tmp_path}"', "run.nodes=4", "run.group_size=2"])
    with create_run(job, "slurm") as (_, run):
        pass
    view = parse_squeue("41_0|RUNNING|n[1-2]|0:17|None\n41_1|PENDING||0:00|Priority\n40|RUNNING|n4|0:18|None\n")
    status = collect(run, backend_view={"groups": {"0": view["41_0"], "1": view["41_1"]}, "applier": view["40"]})
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(status_view(status))
    text = console.export_text()
    assert "running (n[1-2])" in text and "pending (Priority)" in text and "running (n4)" in text


def test_parse_sacct_with_array_ranges():
    jobs = parse_sacct(SACCT)
    assert jobs["41_0"]["state"] == "completed" and jobs["41_0"]["elapsed"] == "00:00:35"
    assert jobs["41_1"]["state"] == "cancelled"
    assert jobs["42_2"]["state"] == jobs["42_3"]["state"] == "pending"


# `scontrol show job -o 3` (Slurm 22.05, tests/slurm/cluster.sh) during a preemption's GraceTime,
# shortened: the job still runs, its EndTime moved to PreemptTime + GraceTime.
SHOW_JOB_PREEMPTED = ("JobId=3 JobName=low2.sh UserId=root(0) JobState=RUNNING Reason=None Dependency=(null) "
                      "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 StartTime=2026-12-04T17:44:33 "
                      "EndTime=2026-12-04T17:45:06 Deadline=N/A PreemptEligibleTime=2026-12-04T17:44:33 "
                      "PreemptTime=2026-12-04T17:44:36 SuspendTime=None SecsPreSuspend=0 Partition=debug\n")


def test_parse_preempt_time():
    assert parse_preempt_time(SHOW_JOB_PREEMPTED) == "2026-12-04T17:44:36"
    assert parse_preempt_time(SHOW_JOB_PREEMPTED.replace("PreemptTime=2026-12-04T17:44:36", "PreemptTime=None")) is None
    assert parse_preempt_time("") is None


def test_parse_scontrol_config():
    assert parse_scontrol_config(SCONTROL) == {"max_array_size": 1001, "slurm_version": "22.05.8"}


@pytest.mark.parametrize("raw, state", [
    ("RUNNING", "running"), ("CANCELLED by 1000", "cancelled"), ("REQUEUED", "requeued"),
    ("TIMEOUT", "timeout"), ("COMPLETED+", "completed"), ("SOMETHING_NEW", "unknown"), ("", "unknown"),
])
def test_state_mapping(raw, state):
    assert map_state(raw) == state


def fake_squeue(monkeypatch, answers):
    """squeue answers in turn: (returncode, stdout, stderr); records each command."""
    import hpcdl.schedulers.slurm as slurm

    calls = []

    def run(cmd, timeout=30.0):
        calls.append(cmd)
        code, out, err = answers.pop(0)
        return subprocess.CompletedProcess(cmd, code, out, err)

    monkeypatch.setattr(slurm, "_run", run)
    return calls


def submitted_run(tmp_path):
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler/slurm.json").write_text('{"slurm_array_job_id": "41", "slurm_applier_job_id": "40"}')
    return RunDir(tmp_path)


@pytest.mark.parametrize("answer, active", [
    ((0, "41_0\n41_1\n", ""), True),                                    # running or pending
    ((0, "", ""), False),                                               # known, but all ended
    ((1, "", "slurm_load_jobs error: Invalid job id specified"), False),  # ended and forgotten
    ((1, "", "slurm_load_jobs error: Unable to contact slurm controller"), None),
])
def test_groups_active(monkeypatch, tmp_path, answer, active):
    calls = fake_squeue(monkeypatch, [answer])
    assert SlurmScheduler().groups_active(submitted_run(tmp_path)) is active
    assert calls == [["squeue", "-h", "-r", "-j", "41", "-o", "%i"]]


def test_groups_active_before_the_array_is_submitted(tmp_path):
    assert SlurmScheduler().groups_active(RunDir(tmp_path)) is None


def test_the_applier_stops_waiting_after_two_sightings_of_an_empty_array(monkeypatch, tmp_path):
    from hpcdl.schedulers.slurm import SlurmArrayGone

    fake_squeue(monkeypatch, [(0, "", ""), (0, "41_1\n", ""), (0, "", ""),
                              (1, "", "Unable to contact slurm controller"), (0, "", ""), (0, "", "")])
    gone = SlurmArrayGone(submitted_run(tmp_path), poll_s=0.0)
    # empty, then requeued (seen again), empty, unreachable (unknown: not gone), empty, empty
    assert [gone() for _ in range(6)] == [False, False, False, False, False, True]


def test_the_applier_polls_squeue_at_most_every_poll_interval(monkeypatch, tmp_path):
    from hpcdl.schedulers.slurm import SlurmArrayGone

    calls = fake_squeue(monkeypatch, [(0, "", "")])
    gone = SlurmArrayGone(submitted_run(tmp_path), poll_s=3600.0)
    assert [gone() for _ in range(50)] == [False] * 50 and len(calls) == 1


def test_cancel_of_a_run_whose_jobs_have_ended_cancels_nothing(monkeypatch, tmp_path):
    calls = fake_squeue(monkeypatch, [(1, "", "slurm_load_jobs error: Invalid job id specified")])
    said = SlurmScheduler().cancel(submitted_run(tmp_path))
    assert said == "nothing to cancel: SLURM jobs 41, 40 have ended"
    assert [c[0] for c in calls] == ["squeue"]


def test_cancel_of_a_queued_run_calls_scancel(monkeypatch, tmp_path):
    calls = fake_squeue(monkeypatch, [(0, "41_0\n40\n", ""), (0, "", "")])
    said = SlurmScheduler().cancel(submitted_run(tmp_path))
    assert said == "cancelled SLURM jobs 41, 40"
    assert calls[0] == ["squeue", "-h", "-r", "-j", "41,40", "-o", "%i"] and calls[1] == ["scancel", "41", "40"]


@pytest.mark.parametrize("content", ['{"slurm_array_job_id": 4', "\x00\x01binary", '{"other": 1}'])
def test_corrupt_job_ids_are_one_error_naming_the_file(tmp_path, content):
    from hpcdl.rundir.runs import RunError

    run = submitted_run(tmp_path)
    (tmp_path / "scheduler/slurm.json").write_text(content)
    with pytest.raises(RunError, match="slurm.json is corrupt"):
        SlurmScheduler().is_active(run)


@pytest.mark.parametrize("time_limit, signal_seconds, refused", [
    ("1", 60, True), ("1", 58, False), ("2:00", 120, True), ("00:10:00", 120, False),
    ("00:01:00", 120, True), ("1-0", 86399, False), ("1-0", 86400, True), ("1", 0, False),
])
def test_signal_seconds_must_be_less_than_the_time_limit(time_limit, signal_seconds, refused):
    req = request([f"slurm.time={time_limit}", f"slurm.signal_seconds={signal_seconds}"])
    if refused:
        with pytest.raises(JobError, match="slurm.signal_seconds .* is not less than slurm.time"):
            SlurmScheduler().submit_dryrun(req)
    else:
        SlurmScheduler().submit_dryrun(req)



# -- run.controller = "mpi" -------------------------------------------------------------------
# `srun --mpi=list` of Debian's Slurm 22.05.8 (the test cluster's)
MPI_LIST = """\
MPI plugin types are...
	pmix
	none
	cray_shasta
	pmi2
specific pmix plugin versions available: pmix_v4
"""
PLUGINS = {"mpi_plugins": ["pmix", "none", "cray_shasta", "pmi2", "pmix_v4"]}


def test_mpi_group_script_matches_its_golden_file():
    """The script asks only for resources: the controller changes how the batch step starts the
    ranks (srun's MPI plugin, no rendezvous), not the script."""
    req = request(["run.controller=mpi"], cluster={**PLUGINS, "horovod_mpi": True})
    dry = SlurmScheduler().submit_dryrun(req)
    assert dry.files["scheduler/group.sbatch"] == (GOLDEN / "group.sbatch").read_text()
    assert srun_command(req.job, "/opt/hpcdl/bin/python", req.run) == [
        "srun", "--kill-on-bad-exit=1", "--mpi=pmix", "--ntasks-per-node=2", "--cpus-per-task=34",
        "/opt/hpcdl/bin/python", "-m", "hpcdl.process.worker", "/scratch/runs/hep-1", "--slurm"]
    gloo = request()
    assert "--mpi=pmix" not in srun_command(gloo.job, "python", gloo.run)
    assert dry.files["scheduler/applier.sbatch"] == (GOLDEN / "applier.sbatch").read_text()


def test_the_ranks_openmp_settings_come_from_the_thread_plan():
    env = ranks_environment(request().job)
    assert env["OMP_NUM_THREADS"].isdigit() and set(env) == {"OMP_NUM_THREADS", "KMP_BLOCKTIME", "KMP_AFFINITY"}
    assert ranks_environment(request(["slurm.cpus_per_task=0"]).job) == {}


def test_rendered_scripts_never_let_open_mpi_run_as_root():
    """OMPI_ALLOW_RUN_AS_ROOT belongs in the tests' environment, never in a production script."""
    for controller in ("gloo", "mpi"):
        dry = SlurmScheduler().submit_dryrun(request([f"run.controller={controller}"], cluster=PLUGINS))
        assert not any("ALLOW_RUN_AS_ROOT" in text or "allow-run-as-root" in text for text in dry.files.values())


def test_parse_srun_mpi_list():
    assert parse_mpi_list(MPI_LIST) == PLUGINS["mpi_plugins"]


@pytest.mark.parametrize("override, cluster, message", [
    ("slurm.mpi=pmix_v5", PLUGINS, r"slurm.mpi = 'pmix_v5' is not an MPI plugin of this cluster's srun "
                                   r"\(srun --mpi=list: pmix, none, cray_shasta, pmi2, pmix_v4\)"),
    ("slurm.mpi=none", {}, 'slurm.mpi = "none" starts each rank as an MPI world of its own'),
    ("slurm.mpi=pmix", {"horovod_mpi": False}, 'run.controller = "mpi" needs Horovod built with MPI.*make install MPI=1'),
])
def test_mpi_submissions_refused_with_one_line(override, cluster, message):
    with pytest.raises(JobError, match=message) as err:
        SlurmScheduler().submit_dryrun(request(["run.controller=mpi", override], cluster=cluster))
    assert "\n" not in str(err.value)


def test_slurm_mpi_is_checked_only_where_srun_answered():
    SlurmScheduler().submit_dryrun(request(["run.controller=mpi", "slurm.mpi=pmix_v5"], cluster={}))


def test_a_site_template_must_launch_the_group_s_life(tmp_path):
    (tmp_path / "group.sbatch").write_text("#!/bin/bash\n{{ sbatch_directives }}\nsrun python -m hpcdl.process.worker\n")
    with pytest.raises(JobError, match=r"has no \{\{ launch \}\}"):
        render_group_script(request([f'slurm.template_dir="{tmp_path}"']))
    (tmp_path / "group.sbatch").write_text("#!/bin/bash\n{{ sbatch_directives }}\nmodule load x\nexec {{ launch }}\n")
    assert render_group_script(request([f'slurm.template_dir="{tmp_path}"'])).endswith(
        "exec /opt/hpcdl/bin/python -u -m hpcdl.schedulers.slurm_batch group /scratch/runs/hep-1\n")
