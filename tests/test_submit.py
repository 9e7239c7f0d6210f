"""hpcdl.commands.submit: one launch pipeline for a new run and a resumed one (prepare_launch), the job file
read once, the CLI's options reaching the job as typed values."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import hpcdl.jobfile as jobfile
from hpcdl.cli import main
from hpcdl.errors import JobError
from hpcdl.jobfile import JOBS_DIR, load_job
from hpcdl.commands.resume import prepare_resume
from hpcdl.rundir.runs import create_run
from hpcdl.schedulers.base import DryRun, Scheduler
from hpcdl.commands.submit import Prepared, prepare, submit_run
from tests.conftest import BINARY, one_error_line, set_args, tiny_overrides


def test_submit_reads_the_job_file_once(hep_files, tmp_path, monkeypatch):
    job_file = tmp_path / "mine.toml"
    job_file.write_text('workload = "hep"\n[train]\nsteps = 7\n')
    reads = []
    original = jobfile.read_regular
    monkeypatch.setattr(jobfile, "read_regular", lambda path: reads.append(path) or original(path))
    prepared = prepare(str(job_file), tiny_overrides(hep_files, tmp_path / "runs"), cluster={"cores": 2})
    assert reads == [job_file] and prepared.job.name == "mine"
    assert prepared.dryrun.request.run == prepared.run and prepared.run.root.parent == tmp_path / "runs"


def test_options_reach_the_job_as_typed_values_and_a_wrong_type_names_the_field(tmp_path):
    odd = tmp_path / 'a "quoted" dir'
    job = load_job("hep", settings={"run.runs_dir": str(odd), "run.nodes": 4, "run.check_data": False})
    assert (job.run.runs_dir, job.run.nodes, job.run.check_data) == (str(odd), 4, False)
    with pytest.raises(JobError, match=r"^run.nodes must be an integer, got '4'$"):
        load_job("hep", settings={"run.nodes": "4"})
    with pytest.raises(JobError, match=r"^run.backend must be one of auto, local, slurm; got 'k8s'$"):
        load_job("hep", settings={"run.backend": "k8s"})


def test_resume_runs_the_checks_submit_runs(tmp_path):
    """A precision the workload cannot compute in is refused on resume as on submit."""
    job = load_job("climate", ["run.check_data=false", "run.backend=local", f'run.runs_dir="{tmp_path}"'])
    with create_run(job, "local") as (_, run):
        pass
    with pytest.raises(JobError, match="the climate workload computes in float32 only"):
        prepare_resume(run, ['tuning.precision="mixed_bfloat16"'])
    with pytest.raises(JobError, match="the climate workload computes in float32 only"):
        prepare("climate", ["run.check_data=false", "run.backend=local", f'run.runs_dir="{tmp_path}"',
                            'tuning.precision="mixed_bfloat16"'], cluster={"cores": 2})
    resumed = prepare_resume(run, ["train.steps=2"], {"run.backend": "local"})
    assert resumed.run == run and resumed.job.train.steps == 2 and resumed.dryrun.request.run == run


def test_submit_refuses_a_validation_file_it_cannot_use(hep_files, tmp_path):
    runs = tmp_path / "runs"
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(BINARY)
    small = tmp_path / "small.h5"
    from tests.conftest import write_nersc

    write_nersc(small, 32, size=8)
    for val, fragment in ((tmp_path / "none.h5", "no such file"), (garbage, "garbage.h5"),
                          (small, "images are (8, 8, 3), data.train's (16, 16, 3)")):
        result = CliRunner().invoke(main, ["submit", "hep", *set_args(tiny_overrides(hep_files, runs)),
                                           "--set", f'data.val="{val}"', "--dry-run"], catch_exceptions=False)
        assert "data.val" in one_error_line(result, fragment)
    result = CliRunner().invoke(main, ["submit", "hep", *set_args(tiny_overrides(hep_files, runs)), "--set",
                                       f'data.val="{tmp_path / "none.h5"}"', "--set", "train.validate_every=0",
                                       "--dry-run"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert not runs.exists()


def test_submit_refuses_an_exchange_directory_that_is_a_file(hep_files, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    result = CliRunner().invoke(main, ["submit", "hep", *set_args(tiny_overrides(hep_files, tmp_path / "runs")),
                                       "--nodes", "2", "--group-size", "1", "--set",
                                       f'exchange.directory="{notes}"', "--dry-run"], catch_exceptions=False)
    one_error_line(result, "is not a directory")
    assert notes.read_text() == "mine"


@pytest.mark.parametrize("content", [b'name = "x"\nworkload = ', BINARY])
def test_a_malformed_job_file_is_one_line(tmp_path, content):
    job = tmp_path / "broken.toml"
    job.write_bytes(content)
    result = CliRunner().invoke(main, ["submit", str(job), "--runs-dir", str(tmp_path / "runs")],
                                catch_exceptions=False)
    one_error_line(result, str(job))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("override, field", [
    ('run.runs_dir="runs\\nx"', "run.runs_dir"),
    ('run.runs_dir="runs\\u001b[2Jx"', "run.runs_dir"),
    ('exchange.directory="/scratch/x\\ny"', "exchange.directory"),
    ('exchange.directory="/scratch/x\\ty"', "exchange.directory"),
])
def test_control_characters_in_paths_are_refused(tmp_path, override, field):
    with pytest.raises(JobError, match=f"{field} .* contains control characters"):
        load_job("hep", [override])
    result = CliRunner().invoke(main, ["submit", "hep", "--backend", "slurm", "--dry-run", "--set", override],
                                catch_exceptions=False, env={"PATH": "/nonexistent"})
    one_error_line(result, field)


def test_control_characters_in_the_job_name_are_refused(tmp_path, hep_files):
    job = tmp_path / "bad\nname.toml"
    shutil.copy(JOBS_DIR / "hep.toml", job)
    runs = tmp_path / "runs"
    result = CliRunner().invoke(main, ["submit", str(job), *set_args(tiny_overrides(hep_files, runs)),
                                       "--backend", "slurm", "--dry-run"], catch_exceptions=False)
    one_error_line(result, "contains control characters")
    named = tmp_path / "named.toml"
    named.write_text((JOBS_DIR / "hep.toml").read_text().replace('workload = "hep"', 'workload = "hep"\nname = "a\\rb"'))
    result = CliRunner().invoke(main, ["submit", str(named), *set_args(tiny_overrides(hep_files, runs))],
                                catch_exceptions=False)
    one_error_line(result, "contains control characters")
    assert not runs.exists()


class Recording(Scheduler):
    """Renders one file naming the run's directory; schedule records what it was given."""

    name = "recording"

    def __init__(self):
        self.scheduled = []

    def submit_dryrun(self, request):
        return DryRun(self.name, {"scheduler/where": f"{request.run.root}\n"}, [], request)

    def schedule(self, dryrun, **_):
        self.scheduled.append(dryrun)
        return {}

    def describe(self, run):
        return {}

    def cancel(self, run):
        return ""

    def is_active(self, run):
        return False


def test_a_run_id_collision_is_retried_with_a_new_id(tmp_path, hep_files, monkeypatch):
    import hpcdl.commands.submit as submit

    runs = tmp_path / "runs"
    prepared = prepare("hep", tiny_overrides(hep_files, runs), cluster={})
    scheduler = Recording()
    taken = prepared.dryrun.request.run
    first = Prepared(prepared.job, prepared.run, scheduler, scheduler.submit_dryrun(prepared.dryrun.request))
    taken.root.mkdir(parents=True)
    (taken.root / "someone-else's").write_text("x")
    ids = iter([taken.run_id, "hep-20260101-000000-0001"])  # the first retry collides again
    monkeypatch.setattr(submit, "new_run_id", lambda job: next(ids))
    result = submit_run(first)
    assert result["run_id"] == "hep-20260101-000000-0001"
    final = Path(result["run_dir"])
    assert (final / "scheduler/where").read_text() == f"{final}\n"  # rendered for the new id
    assert json.loads((final / "run.json").read_text())["run_id"] == final.name
    assert scheduler.scheduled[-1].request.run.root == final
    assert sorted(p.name for p in runs.iterdir()) == sorted([taken.run_id, final.name])
    assert (taken.root / "someone-else's").read_text() == "x"
