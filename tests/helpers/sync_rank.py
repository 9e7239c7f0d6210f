"""One rank of a test group: train with the real engine, then dump the weights and first batch.
HPCDL_TEST_KILL_AT=N: rank 1 kills itself (SIGKILL) at step N, in the middle of training;
HPCDL_TEST_RAISE_AT=N: rank 1 alone raises there, as a rank that meets an error the others do not."""

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

from hpcdl.engine.collective import join_group
from hpcdl.jobfile import load_job
from hpcdl.engine.train import GroupRoot, train_group
from hpcdl.rundir.group_files import GroupRecorder
from hpcdl.fs.storage import StorageReport
from hpcdl.process.worker import group_task
from hpcdl.workloads import get_workload

out, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
# the collective under test: Horovod's by default (Gloo or MPI, as launched), or mpi4py's
comm = join_group(os.environ.get("HPCDL_TEST_CONTROLLER", "gloo"))
job = load_job("hep", overrides)
workload = get_workload("hep")
stats = workload.compute_stats(job)
first_batch = next(workload.train_batches(job, stats, comm.rank(), comm.size(), seed=job.train.seed))
initial = {n: v.numpy() for n, v in workload.build_model(job.model, workload.input_shape(job), seed=0).named_variables()}
root = GroupRoot(GroupRecorder(job, stats, StorageReport(out / "storage.json"), checkpoints=out / "ckpt",
                               metrics=out / "metrics.jsonl", state=out / "state.json", tensorboard=out / "tb"))
kill_at = int(os.environ.get("HPCDL_TEST_KILL_AT", "0"))
raise_at = int(os.environ.get("HPCDL_TEST_RAISE_AT", "0"))


def pace(step, started):
    if comm.rank() == 1 and step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if comm.rank() == 1 and step == raise_at:
        raise RuntimeError(f"rank 1 fails alone at step {step}")


result = train_group(group_task(job, workload, stats), comm, out / "ckpt", group=0, groups=1, root=root if comm.rank() == 0 else None,
                     pace=pace)
final = {n: v.numpy() for n, v in result.model.named_variables()}
np.savez(out / f"rank{comm.rank()}.npz", first_x=first_batch[0],
         **{f"final/{n}": v for n, v in final.items()}, **{f"initial/{n}": v for n, v in initial.items()})
comm.shutdown()
