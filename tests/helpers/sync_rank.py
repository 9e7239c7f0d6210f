"""One rank of a test group: train with the real engine, then dump the weights and first batch."""

import json
import sys
from pathlib import Path

import horovod.tensorflow as hvd
import numpy as np

from hpcdl.jobfile import load_job
from hpcdl.engine.train import GroupRoot, train_group
from hpcdl.group_files import GroupRecorder
from hpcdl.storage import StorageReport
from hpcdl.workloads import get_workload

out, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
hvd.init()
job = load_job("hep", overrides)
workload = get_workload("hep")
stats = workload.compute_stats(job)
first_batch = next(workload.train_batches(job, stats, hvd.rank(), hvd.size(), seed=job.train.seed))
initial = {n: v.numpy() for n, v in workload.build_model(job.model, workload.input_shape(job), seed=0).named_variables()}
root = GroupRoot(GroupRecorder(job, stats, StorageReport(out / "storage.json"), checkpoints=out / "ckpt",
                               metrics=out / "metrics.jsonl", state=out / "state.json", tensorboard=out / "tb"))
result = train_group(job, workload, hvd, out / "ckpt", stats, group=0, groups=1, root=root if hvd.rank() == 0 else None)
final = {n: v.numpy() for n, v in result.model.named_variables()}
np.savez(out / f"rank{hvd.rank()}.npz", first_x=first_batch[0],
         **{f"final/{n}": v for n, v in final.items()}, **{f"initial/{n}": v for n, v in initial.items()})
hvd.shutdown()
