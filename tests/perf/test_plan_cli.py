"""`hpcdl plan`: the job's exchange (kind, H, delta dtype, K) reaches the planner, --set
overrides it, the screen shows the H advice, and wrong input is one line with exit 2."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from hpcdl.cli import main


def run(*args: str):
    return CliRunner().invoke(main, ["plan", "hep", *args])


def plan_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_jobs_exchange_section_is_read_without_inputs():
    out = plan_json("--nodes", "64", "--node-flops", "1e12")
    sources = out["inputs"]["sources"]
    for name in ("exchange_kind", "exchange_every", "delta_dtype", "max_outstanding",
                 "max_staleness", "max_pending_per_group"):
        assert sources[name].startswith("job hep.toml: exchange."), (name, sources[name])
    assert sources["node_flops"] == "--node-flops"


def test_set_models_a_delta_exchange_every_h_steps():
    out = plan_json("--nodes", "64", "--node-flops", "1e12", "--set", "exchange.kind=delta",
                    "--set", "exchange.every=4", "--set", "exchange.delta_dtype=float16",
                    "--set", "exchange.max_outstanding=2")
    x = out["inputs"]
    assert (x["exchange_kind"], x["exchange_every"], x["delta_dtype"], x["max_outstanding"]) == \
        ("delta", 4, "float16", 2)
    assert x["sources"]["exchange_kind"] == "--set exchange.kind"
    assert x["sources"]["exchange_every"] == "--set exchange.every"
    for c in out["candidates"]:
        assert c["every"] == 4 and c["update_bytes"] == x["model_bytes"] / 2
    assert "every_advice" in out and "alternative" in out


def test_downweighted_staleness_drops_nothing():
    out = plan_json("--nodes", "8", "--node-flops", "1e12", "--set", "exchange.stale_policy=downweight")
    assert out["inputs"]["max_staleness"] == -1
    assert out["inputs"]["sources"]["max_staleness"] == "--set exchange.stale_policy"


def test_paper_inputs_ignore_the_job_but_take_set():
    out = plan_json("--nodes", "9600", "--inputs", "paper")
    assert out["inputs"]["max_outstanding"] == 1 and out["inputs"]["exchange_kind"] == "gradient"
    assert out["inputs"]["sources"]["exchange_kind"].startswith("paper:")
    assert out["every_advice"]["every"] == 1 and out["recommended_groups"] == 6
    changed = plan_json("--nodes", "9600", "--inputs", "paper", "--groups", "6",
                        "--set", "exchange.kind=delta")
    assert changed["inputs"]["exchange_kind"] == "delta"
    assert changed["inputs"]["max_outstanding"] == 1  # the rest stays the paper's


def test_text_shows_the_inputs_the_table_the_advice_and_the_paper_check():
    result = run("--nodes", "9600", "--inputs", "paper")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # rich wraps long lines at the console's width
    for piece in ("Scale plan for 9600 nodes", "max_outstanding", "recommended: 6 groups of 1600",
                  "exchange.every = 1 for 6 groups", "H = 1 already meets both bounds",
                  "Paper check", "11.41"):
        assert piece in text, piece


@pytest.mark.parametrize("args, match", [
    (("--set", "train.steps=5"), "exchange.KEY=VALUE"),
    (("--set", "exchange.kind=bogus"), "exchange.kind"),
    (("--set", "exchange.every=0"), "exchange.every"),
    (("--inputs", "paper", "--set", "exchange.delta_dtype=float16"), "delta_dtype"),
    (("--max-applier-util", "1.5"), "max-applier-util"),
    (("--staleness-bound", "nan"), "not a finite number"),
])
def test_wrong_input_is_one_line_and_exit_2(args, match):
    extra = () if "--inputs" in args else ("--node-flops", "1e12")
    result = run("--nodes", "64", *extra, *args)
    assert result.exit_code == 2, result.output
    assert match in result.output and "Traceback" not in result.output


def test_a_shipped_job_other_than_hep_is_planned_by_name_with_its_own_network(tmp_path, monkeypatch):
    from hpcdl.workloads.climate.generate import generate

    monkeypatch.chdir(tmp_path)  # the job's data/climate/, as `hpcdl data generate climate` writes it
    generate(tmp_path / "data" / "climate", 20, height=32, width=48, labelled_fraction=0.5, seed=1)
    result = CliRunner().invoke(main, ["plan", "climate", "--nodes", "64", "--node-flops", "1e12", "--json"])
    assert result.exit_code == 0, result.output
    sources = json.loads(result.stdout)["inputs"]["sources"]
    assert sources["flops_per_example"].startswith("job climate.toml: the climate network"), sources
    result = CliRunner().invoke(main, ["plan", "nosuchjob", "--nodes", "64", "--node-flops", "1e12"])
    assert result.exit_code == 2 and "unknown job 'nosuchjob'" in result.output, result.output


@pytest.mark.parametrize("flops", ["inf", "nan"])
def test_node_flops_must_be_finite(flops):
    result = run("--nodes", "64", "--node-flops", flops)
    assert result.exit_code == 2 and "not a finite number" in result.output, result.output


@pytest.mark.parametrize("make", ["dev_zero", "fifo", "large"])
def test_inputs_that_are_not_a_small_regular_file_are_one_line(tmp_path, make):
    path = tmp_path / "inputs.json"
    if make == "dev_zero":
        path.symlink_to("/dev/zero")  # read whole, it would fill the memory
    elif make == "fifo":
        os.mkfifo(path)  # opened plainly, it would wait for a writer
    else:
        path.write_text("{" + " " * (2 << 20) + "}")
    result = run("--nodes", "64", "--inputs", str(path))
    assert result.exit_code == 2, result.output
    assert "cannot read planner inputs" in result.output and "Traceback" not in result.output
