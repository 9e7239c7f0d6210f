"""`python -m hpcdl.perf.measure`: this machine's training step of a job's network, timed on the
workload's example batch (no data read), as `hpcdl plan` measures a node."""

import json
import subprocess
import sys

import numpy as np
import pytest

from hpcdl.jobfile import load_job
from hpcdl.workloads import get_workload
from hpcdl.workloads.hep.config import HepModelConfig


def test_it_times_the_jobs_network_at_the_shape_given():
    out = subprocess.run([sys.executable, "-m", "hpcdl.perf.measure", "--json", "--job=hep", "--input-shape=32x32x3",
                          "--set=model.filters=16", "--batch=4", "--steps=2"],
                         capture_output=True, text=True, timeout=300, check=True)
    here = json.loads(out.stdout)
    flops, _ = HepModelConfig(filters=16).cost((32, 32, 3))
    assert here["step_s"] > 0 and here["steps"] == 2 and "intra-op" in here["threads"]
    assert here["network"] == "hep at 32x32x3"
    assert here["node_flops"] * here["step_s"] == pytest.approx(flops.training * 4)


@pytest.mark.parametrize("workload, shape, overrides", [
    ("hep", (16, 16, 3), ["model.filters=4", "model.conv_layers=2"]),
    ("climate", (32, 32, 16), []),
])
def test_each_shipped_workload_makes_an_example_batch_with_a_finite_loss(workload, shape, overrides):
    job = load_job(workload, overrides)
    wl = get_workload(job.workload)
    model = wl.build_model(job.model, shape, seed=0)
    batch = wl.example_batch(job, model, 3, seed=0)
    assert all(len(t) == 3 for t in batch)
    assert np.isfinite(float(wl.loss(model, batch, training=True)))


def test_a_workload_without_an_example_batch_is_refused_in_one_line():
    code = ("import sys; from hpcdl.workloads import get_workload; from hpcdl.workloads.base import Workload; "
            "type(get_workload('hep')).example_batch = Workload.example_batch; "
            "from hpcdl.perf.measure import main; "
            "sys.exit(main(['--job=hep', '--input-shape=16x16x3', '--set=model.filters=4', '--steps=1', '--batch=2']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines()[-1] == (
        "the hep workload makes no example batch to time a step on: give the node's rate (--node-flops or --inputs)")
