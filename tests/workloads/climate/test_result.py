"""The climate result of the issue, as a test: a short local run localises the generated events."""

import json
import subprocess

import pytest

from tests.conftest import HPCDL

pytestmark = pytest.mark.slow


def test_short_run_reaches_map50_of_one_half(tmp_path):
    data = tmp_path / "data"
    subprocess.run([HPCDL, "data", "generate", "climate", "--out", str(data), "--images", "2500",
                    "--height", "96", "--width", "144", "--labelled-fraction", "0.2", "--seed", "5"],
                   check=True, capture_output=True, timeout=1800)
    submitted = subprocess.run(
        [HPCDL, "submit", "climate", "--backend", "local", "--nodes", "2", "--json",
         "--set", f'data.train="{data}/train.h5"', "--set", f'data.test="{data}/test.h5"',
         "--set", f'data.val="{data}/val.h5"', "--set", f'run.runs_dir="{tmp_path}/runs"'],
        capture_output=True, text=True, timeout=2400, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    run_dir = json.loads(submitted.stdout)["run_dir"]
    result = json.loads(subprocess.run([HPCDL, "evaluate", run_dir, "--json"], capture_output=True,
                                       text=True, check=True, timeout=600).stdout)
    assert result["map_50"] >= 0.5, result
    assert result["map_10"] >= result["map_50"]
