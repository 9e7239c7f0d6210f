"""Workload.group_loss: a synchronous group's loss is the mean of its ranks' own losses."""

from __future__ import annotations

import numpy as np
import pytest

from hpcdl.jobfile import load_job
from hpcdl.workloads import get_workload
from hpcdl.workloads.base import Workload


def per_rank_mean(workload, model, batch, ranks: int) -> float:
    size = len(batch[0]) // ranks
    return float(np.mean([workload.loss(model, tuple(t[r * size:(r + 1) * size] for t in batch), True)
                          for r in range(ranks)]))


@pytest.mark.parametrize("ranks", [1, 4])
def test_hep_does_in_one_call_what_the_default_does_per_rank(ranks):
    workload = get_workload("hep")
    job = load_job("hep", ["model.filters=4", "model.conv_layers=2", "model.dropout=0.0"])
    model = workload.build_model(job.model, (16, 16, 3), seed=0)
    rng = np.random.default_rng(0)
    # weights of 0.1 to 10, so each rank's normalisation differs from the whole batch's
    batch = (rng.normal(size=(8 * ranks, 16, 16, 3)).astype(np.float32), rng.integers(0, 2, 8 * ranks).astype(np.int32),
             np.exp(rng.uniform(np.log(0.1), np.log(10.0), 8 * ranks)).astype(np.float32))
    one_call = float(workload.group_loss(model, batch, ranks, True))
    default = float(Workload.group_loss(workload, model, batch, ranks, True))
    assert one_call == pytest.approx(per_rank_mean(workload, model, batch, ranks), rel=1e-5)
    assert default == pytest.approx(one_call, rel=1e-5)
    if ranks > 1:
        assert abs(float(workload.loss(model, batch, True)) - one_call) > 1e-4  # the union's loss is another
