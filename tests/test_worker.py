"""hpcdl.process.worker: what a rank does with the run's files before it trains (the data's statistics)."""

from __future__ import annotations

import json

from hpcdl.jobfile import load_job
from hpcdl.rundir.runs import create_run
from tests.conftest import BINARY, tiny_overrides


def test_a_damaged_stats_file_is_computed_again(hep_files, tmp_path):
    from hpcdl.workloads import get_workload
    from hpcdl.process.worker import ensure_stats

    job = load_job("hep", tiny_overrides(hep_files, tmp_path / "runs"))
    with create_run(job, "local") as (_, final):
        pass
    workload = get_workload("hep")
    final.stats_file.write_bytes(BINARY)
    stats = ensure_stats(final, workload, job, is_root=True)
    assert stats == json.loads(json.dumps(workload.compute_stats(job)))
    assert json.loads(final.stats_file.read_text()) == stats
