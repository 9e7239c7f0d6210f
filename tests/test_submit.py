"""hpcdl.submit: one launch pipeline for a new run and a resumed one (prepare_launch), the job file
read once, the CLI's options reaching the job as typed values."""

import pytest

import hpcdl.jobfile as jobfile
from hpcdl.errors import JobError
from hpcdl.jobfile import load_job
from hpcdl.resume import prepare_resume
from hpcdl.runs import create_run
from hpcdl.submit import prepare
from tests.conftest import tiny_overrides


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
