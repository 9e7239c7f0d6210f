"""Workloads from other packages: found by their `hpcdl.workloads` entry point or a module:object
reference, listed by `hpcdl workloads`, and refused in one line when they cannot be loaded."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hpcdl.jobfile import load_job
from hpcdl.errors import JobError
from hpcdl.workloads import get_workload, providers
from tests.conftest import HPCDL

PLUGIN = '''
from hpcdl.workloads.base import GeneratorOption
from hpcdl.workloads.keras.workload import KerasWorkload


class ToyWorkload(KerasWorkload):
    """The generic workload under another name, with a loss and a data generator of its own."""

    name = "toy"
    generator_module = "toy_workload.generate"
    generate_count = GeneratorOption("rows", "rows in total", low=4)
    generate_options = (GeneratorOption("noise", "label noise", default=0.1, low=0.0, kind=float),)

    def loss(self, model, batch, training):
        return 2.0 * super().loss(model, batch, training)


WORKLOAD = ToyWorkload()
'''

GENERATOR = '''
import json


def generate(out_dir, count, *, seed, progress=None, noise):
    (out_dir / "train.h5").write_text(json.dumps({"count": count, "seed": seed, "noise": noise}))
    if noise > 0.9:  # a generator that fails half-way, its first file written in place
        raise ValueError("too noisy to finish")
    (out_dir / "val.h5").write_text("{}")
    return {"train": out_dir / "train.h5", "val": out_dir / "val.h5"}
'''

ENTRY_POINTS = '''[hpcdl.workloads]
toy = toy_workload:WORKLOAD
broken = toy_workload.missing:WORKLOAD
'''


@pytest.fixture
def plugin_site(tmp_path, monkeypatch) -> Path:
    """A third-party package as pip installs it: the module and its dist-info with entry points."""
    site = tmp_path / "site"
    (site / "toy_workload").mkdir(parents=True)
    (site / "toy_workload" / "__init__.py").write_text(PLUGIN)
    (site / "toy_workload" / "generate.py").write_text(GENERATOR)
    dist = site / "toy_hpcdl_workload-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-hpcdl-workload\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    return site


def test_an_installed_plugin_is_found_by_its_entry_point(plugin_site, keras_job):
    found = providers()
    assert found["toy"].source == "toy-hpcdl-workload 0.1"
    assert found["keras"].source.endswith("(built-in)") and found["hep"].source.endswith("(built-in)")
    toy = get_workload("toy")
    assert type(toy).__name__ == "ToyWorkload"
    text = keras_job.read_text().replace('workload = "keras"', 'workload = "toy"')
    keras_job.write_text(text)
    assert load_job(str(keras_job)).workload == "toy"


def test_a_module_object_reference_needs_no_entry_point(plugin_site):
    assert type(get_workload("toy_workload:ToyWorkload")).__name__ == "ToyWorkload"
    with pytest.raises(JobError, match="is a str, not an hpcdl.workloads.base.Workload"):
        get_workload("toy_workload:__name__")


def test_a_plugin_whose_entry_point_fails_to_load_is_one_line(plugin_site):
    with pytest.raises(JobError) as caught:
        get_workload("broken")
    message = str(caught.value)
    assert "\n" not in message and "toy-hpcdl-workload 0.1" in message
    assert "cannot import toy_workload.missing: ModuleNotFoundError" in message


def test_an_unknown_workload_lists_the_installed_ones(plugin_site):
    with pytest.raises(JobError, match=r"unknown workload 'nobody' \(installed: broken, climate, hep, keras, toy;"):
        get_workload("nobody")


def test_hpcdl_workloads_lists_names_sources_and_fields(plugin_site):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_site), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([HPCDL, "workloads", "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert rows["toy"]["source"] == "toy-hpcdl-workload 0.1" and "builder" in rows["toy"]["model"]
    assert rows["hep"]["data"] == ["train", "val", "test", "chunk_events", "prefetch"]
    assert "cannot import toy_workload.missing" in rows["broken"]["error"]
    job = plugin_site / "broken.toml"
    job.write_text('workload = "broken"\n')
    refused = subprocess.run([HPCDL, "submit", str(job), "--dry-run"], capture_output=True, text=True, timeout=120,
                             env=env)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot import toy_workload.missing" in lines[0], refused.stderr


def test_a_plugin_declares_its_generator_options_and_hpcdl_data_generate_offers_them(plugin_site, tmp_path):
    from click.testing import CliRunner

    from hpcdl.cli import main

    runner = CliRunner()
    listing = runner.invoke(main, ["data", "generate", "--help"])
    assert listing.exit_code == 0, listing.output
    assert "toy" in listing.output and "broken" in listing.output and "hep" in listing.output
    help_text = runner.invoke(main, ["data", "generate", "toy", "--help"]).output
    assert "--rows" in help_text and "--noise" in help_text and "--events" not in help_text
    out = tmp_path / "toy-data"
    made = runner.invoke(main, ["data", "generate", "toy", "--out", str(out), "--rows", "12", "--noise", "0.5"])
    assert made.exit_code == 0, made.output
    assert json.loads((out / "train.h5").read_text()) == {"count": 12, "seed": 0, "noise": 0.5}
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    failed = runner.invoke(main, ["data", "generate", "toy", "--out", str(out), "--rows", "20", "--noise", "0.95",
                                  "--force"])
    assert failed.exit_code == 2 and failed.output.strip().splitlines()[-1] == "Error: too noisy to finish", failed.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old set whole, no staging left
    for args, message in [(["toy", "--out", str(out), "--noise", "0.2"], "Missing option '--rows'"),
                          (["toy", "--out", str(out), "--rows", "12", "--events", "9"], "No such option '--events'"),
                          (["keras", "--out", str(out)], "the keras workload has no synthetic data generator"),
                          (["broken", "--out", str(out)], "cannot import toy_workload.missing")]:
        refused = runner.invoke(main, ["data", "generate", *args])
        assert refused.exit_code == 2 and message in refused.output, (args, refused.output)
        assert len(refused.output.strip().splitlines()) == 1, refused.output


def test_a_generator_option_may_not_take_the_name_of_one_hpcdl_gives_every_generator(plugin_site, monkeypatch, tmp_path):
    import dataclasses

    from click.testing import CliRunner

    from hpcdl.cli import main

    toy = type(get_workload("toy"))
    monkeypatch.setattr(toy, "generate_options", (*toy.generate_options, dataclasses.replace(
        toy.generate_options[0], name="seed")))
    refused = CliRunner().invoke(main, ["data", "generate", "toy", "--out", str(tmp_path), "--rows", "12"])
    assert refused.exit_code == 2, refused.output
    assert refused.output.strip() == ("Error: the toy workload's generator declares seed, which "
                                      "`hpcdl data generate` takes itself")
