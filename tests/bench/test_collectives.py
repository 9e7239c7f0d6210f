"""bench.collectives: one real group per collective gives the figures the table is made of."""

from __future__ import annotations

import pytest

from bench.collectives import bus_bandwidth, one_group, render_row


def test_bus_bandwidth_is_nccl_tests_convention():
    # 2 (n - 1) / n of the bytes cross each rank's link: 1 GB in 1 s at 4 ranks is 1.5 GB/s
    assert bus_bandwidth(10**9, 4, 1.0) == pytest.approx(1.5e9)
    assert bus_bandwidth(10**9, 2, 0.5) == pytest.approx(2e9)


@pytest.mark.mpi
@pytest.mark.parametrize("controller, needs", [("mpi", "mpi_horovod"), ("mpi4py", "mpi4py_mpi")])
def test_one_group_of_each_collective_times_its_allreduce(controller, needs, request, tmp_path):
    request.getfixturevalue(needs)
    got = one_group(controller, "allreduce:0.5", 2, reps=3, log_path=tmp_path / "log")
    assert got["controller"] == controller and got["size"] == 2 and len(got["seconds"]) == 3
    assert got["bytes"] == pytest.approx(0.5e6, rel=0.01) and all(s > 0 for s in got["seconds"])


def test_a_row_says_both_times_the_ratio_and_its_range():
    row = {"ranks": 2, "kind": "allreduce:0.5", "round_medians_s": {"mpi": [0.002], "mpi4py": [0.001]},
           "ratio_median": 2.0, "ratio_min": 2.0, "ratio_max": 2.0, "bus_gb_s": {"mpi": 0.25, "mpi4py": 0.5}}
    assert render_row(row) == ("allreduce:0.5   2 ranks  Horovod (MPI)    2.00 ms  mpi4py    1.00 ms  "
                               "mpi4py 2.00x Horovod's speed (2.00-2.00)  bus 0.25 / 0.50 GB/s")
