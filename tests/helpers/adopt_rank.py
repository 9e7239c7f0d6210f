"""One single-rank group trained twice with the real engine: without an exchange, and with a
GroupSync that adopts "master weights" equal to the group's own every 2 steps. If an adoption kept
the inner optimizer's slots, both runs end on the same weights to the bit."""

import json
import os
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


class EchoSync:
    def __init__(self):
        self.adoptions = 0

    def initial_weights(self, names_and_values):
        return names_and_values

    def after_step(self, step, grads, weights):
        if step % 2:
            return None
        self.adoptions += 1
        return {n: np.array(v, copy=True) for n, v in weights().items()}

    def stats(self):
        return {"exchange_adopted": self.adoptions}

    def flush(self):
        return True


out, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
# the collective under test: Horovod's by default (Gloo or MPI, as launched), or mpi4py's
comm = join_group(os.environ.get("HPCDL_TEST_CONTROLLER", "gloo"))
job = load_job("hep", overrides)
workload = get_workload("hep")
stats = workload.compute_stats(job)
finals = {}
for name, sync in (("plain", None), ("adopting", EchoSync())):
    d = out / name
    recorder = GroupRecorder(job, stats, StorageReport(d / "storage.json"), checkpoints=d / "ckpt",
                             metrics=d / "metrics.jsonl", state=d / "state.json", tensorboard=d / "tb")
    result = train_group(group_task(job, workload, stats), comm, d / "ckpt", group=0, groups=1,
                         root=GroupRoot(recorder, sync), exchange=sync is not None)
    finals[name] = {n: v.numpy() for n, v in result.model.named_variables()}
np.savez(out / "finals.npz", **{f"{k}/{n}": v for k, w in finals.items() for n, v in w.items()})
print(json.dumps({"adoptions": sync.adoptions}))
comm.shutdown()
