"""One rank of one group: `python -m hpcdl.worker RUN_DIR [--slurm]`.

The glue between a scheduler and the engine: read where this rank sits (Horovod variables set by
the local backend, or SLURM's with --slurm), tune the CPU before TensorFlow loads, join the
group's Gloo world, and hand over to `hpcdl.train`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hpcdl.launch import RankEnv
from hpcdl.runs import RunDir, write_json_atomic
from hpcdl.tuning import cores_per_rank, plan_threads, usable_cores

STATS_WAIT_S = 3600.0


def ensure_stats(run: RunDir, workload, job, is_root: bool) -> dict:
    """Normalisation constants, computed once per run by a group root and shared as a file.

    Several group roots may compute them at once; they compute the same values and the atomic
    rename makes the last one win harmlessly. Other ranks wait for the file.
    """
    if run.stats_file.is_file():
        return json.loads(run.stats_file.read_text())
    if is_root:
        stats = workload.compute_stats(job)
        write_json_atomic(run.stats_file, stats)
        return stats
    deadline = time.monotonic() + STATS_WAIT_S
    while not run.stats_file.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {run.stats_file} after {STATS_WAIT_S:.0f} s")
        time.sleep(0.5)
    return json.loads(run.stats_file.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcdl.worker")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--slurm", action="store_true", help="read the rank from SLURM's variables")
    args = parser.parse_args(argv)

    run = RunDir(args.run_dir)
    job = run.load_job()
    if args.slurm:
        rank_env = RankEnv.from_slurm(os.environ)
        host, _, port = os.environ["HPCDL_RENDEZVOUS"].rpartition(":")
        os.environ.update(rank_env.to_horovod_env(host, int(port), os.environ.get("HPCDL_GLOO_IFACE", "")))
    else:
        rank_env = RankEnv.from_horovod(os.environ)

    cores, why = cores_per_rank(os.environ, usable_cores(), rank_env.local_size)
    plan = plan_threads(job.tuning, cores, why)
    os.environ.update(plan.environment(job.tuning))

    import horovod.tensorflow as hvd  # after the environment: oneDNN reads it once, at load

    from hpcdl.tuning import configure_tensorflow
    from hpcdl.train import GroupPaths, train_group
    from hpcdl.workloads import get_workload

    configure_tensorflow(plan)
    hvd.init()
    group = rank_env.group
    workload = get_workload(job.workload)
    stats = ensure_stats(run, workload, job, is_root=hvd.rank() == 0)
    exchange = job.exchange.active(job.run.groups)
    sync = None
    if exchange and hvd.rank() == 0:
        from hpcdl.hybrid import ExchangeSync

        sync = ExchangeSync.for_run(run, job, group)
    paths = GroupPaths(
        checkpoints=run.checkpoint_dir(group),
        metrics=run.metrics_file(group),
        state=run.group_state_file(group),
        tensorboard=run.tensorboard_dir(group),
    )
    train_group(job, workload, hvd, paths, stats, group=group, groups=job.run.groups,
                exchange=exchange, sync=sync)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
