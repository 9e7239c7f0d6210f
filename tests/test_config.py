import pytest

from hpcdl.errors import JobError
from hpcdl.jobfile import job_from_dict, load_job, resolve_job_path
import tomllib


def test_named_job_loads_with_defaults():
    job = load_job("hep")
    assert job.workload == "hep"
    assert job.model.filters == 128 and job.model.conv_layers == 5
    assert job.train.batch_per_rank == 128 and job.train.learning_rate == pytest.approx(1e-3)


def test_job_by_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('workload = "hep"\n[train]\nsteps = 7\n')
    job = load_job(str(path))
    assert job.name == "mine" and job.train.steps == 7


def test_overrides_are_typed():
    job = load_job("hep", ["train.steps=42", "train.learning_rate=5e-4", "tuning.onednn=false",
                           "run.nodes=4", "run.group_size=2", 'data.train="x.h5"'])
    assert job.train.steps == 42 and job.train.learning_rate == pytest.approx(5e-4)
    assert job.tuning.onednn is False and job.data.train == "x.h5"
    assert job.run.groups == 2 and job.run.ranks_per_group == 2


def test_unquoted_string_override_is_a_string():
    assert load_job("hep", ["data.train=data/x.h5"]).data.train == "data/x.h5"


def test_resolved_job_round_trips_through_toml():
    job = load_job("hep", ["train.steps=3", 'slurm.setup=["module load python"]'])
    again = job_from_dict(tomllib.loads(job.to_toml()))
    assert again == job


@pytest.mark.parametrize("override, fragment", [
    ("train.stepz=3", "train.stepz"),
    ("nosuch.key=1", "nosuch"),
    ("train.steps=abc", "train.steps must be an integer"),
    ("train.steps=1.5", "train.steps must be an integer"),
    ("tuning.onednn=3", "tuning.onednn must be true or false"),
    ("run.nodes=0", "run.nodes must be >= 1"),
    ("run.nodes=-2", "run.nodes must be >= 1"),
    ("train.learning_rate=-1", "train.learning_rate"),
    ("model.dropout=1.5", "model.dropout"),
    ("steps=3", "section.key"),
    ("run.controller=nccl", "run.controller must be one of auto, gloo, mpi, mpi4py; got 'nccl'"),
    ('slurm.mpi="pmix; id"', "slurm.mpi must name an srun MPI plugin"),
    ("exchange.learning_rate=nan", "exchange.learning_rate must be a finite number"),
    ("exchange.warmup_steps=-1", "exchange.warmup_steps must be >= 0"),
    ("train.learning_rate=inf", "train.learning_rate must be a finite number"),
    ("train.learning_rate=1e999", "train.learning_rate must be a finite number"),
    ("exchange.reply_timeout_s=inf", "exchange.reply_timeout_s must be a finite number"),
    ("emulate.sigma=-inf", "emulate.sigma must be a finite number"),
])
def test_bad_overrides_name_the_field(override, fragment):
    with pytest.raises(JobError, match=None) as info:
        load_job("hep", [override])
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_group_size_must_divide_nodes():
    with pytest.raises(JobError, match="does not divide"):
        load_job("hep", ["run.nodes=6", "run.group_size=4"])


def test_unknown_job_name_lists_known_jobs():
    with pytest.raises(JobError, match="unknown job 'nope'.*hep"):
        resolve_job_path("nope")


def test_missing_job_file():
    with pytest.raises(JobError, match="not found"):
        resolve_job_path("missing/dir/job.toml")


def test_unknown_workload(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text('workload = "astro"\n')
    with pytest.raises(JobError, match="unknown workload 'astro'"):
        load_job(str(path))


def test_string_fields_keep_the_text_typed():
    job = load_job("hep", ["slurm.time=00:10:00", "slurm.partition=debug", 'slurm.account="a b"'])
    assert job.slurm.time == "00:10:00" and job.slurm.partition == "debug" and job.slurm.account == "a b"


def test_the_controller_and_srun_s_mpi_plugin():
    job = load_job("hep")
    assert job.run.controller == "auto" and job.slurm.mpi == "pmix"
    job = load_job("hep", ["run.controller=mpi", "slurm.mpi=pmi2"])
    assert job.run.controller == "mpi" and job.slurm.mpi == "pmi2"
