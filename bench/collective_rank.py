"""One rank of bench.collectives: the group's collective (hpcdl.engine.collective) under test,
timed doing what the engine asks of it.

Started under mpirun (`python -m bench.collective_rank CONTROLLER KIND`) by bench.collectives,
as the local backend starts an MPI-launched group. CONTROLLER is "mpi" (Horovod over MPI) or
"mpi4py". KIND:

- "allreduce:<MB>": `Collective.average` of float32 tensors shaped like the HEP network's
  variables scaled to <MB> megabytes, traced as the engine's step traces it; rank 0 checks the
  mean against numpy's.
- "step:<network>": the engine's training step (hpcdl.engine.step, gradients averaged through
  the collective) on the HEP network "hep" (as `make run` trains it) or "race" (bench.hybrid_race's).

After `--warmup` untimed repetitions, `--reps` timed ones; rank 0 prints one JSON line,
``@@ {"seconds": [...], ...}``. One thread per TensorFlow pool: the ranks share the cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

# network -> (image side, HepModelConfig fields, batch per rank)
NETWORKS = {
    "hep": (64, {"filters": 32}, 32),  # `make run`'s job: the paper's network at 32 filters
    "race": (32, {"filters": 16, "conv_layers": 4, "dropout": 0.0}, 8),  # bench.race_common
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("controller", choices=["mpi", "mpi4py"])
    ap.add_argument("kind")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from hpcdl.engine.collective import join_group

    comm = join_group(args.controller)
    what, _, arg = args.kind.partition(":")
    run, facts = (allreduce if what == "allreduce" else train_step)(comm, arg, np, tf)
    for _ in range(args.warmup):
        run()
    seconds = []
    for _ in range(args.reps):
        began = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - began)
    if comm.rank() == 0:
        print("@@ " + json.dumps({"controller": args.controller, "kind": args.kind, "size": comm.size(),
                                  "seconds": seconds, **facts}), flush=True)
    comm.shutdown()
    return 0


def allreduce(comm, megabytes: str, np, tf):
    from bench.sections.exchange import hep_gradient

    shapes = [v.shape for v in hep_gradient(params_seed=0).values()]
    scale = float(megabytes) * 1e6 / (4 * sum(int(np.prod(s)) for s in shapes))
    rng = np.random.default_rng(comm.rank())
    arrays = [rng.standard_normal(max(1, int(np.prod(s) * scale)), dtype=np.float32) for s in shapes]
    tensors = [tf.constant(a) for a in arrays]

    @tf.function
    def reduce(ts):
        return comm.average(ts)

    out = reduce(tensors)
    want = np.mean([np.random.default_rng(r).standard_normal(arrays[0].size, dtype=np.float32)
                    for r in range(comm.size())], axis=0)
    if not np.allclose(out[0].numpy(), want, rtol=1e-5, atol=1e-6):
        raise SystemExit(f"rank {comm.rank()}: the averaged tensor is wrong")
    nbytes = int(sum(a.nbytes for a in arrays))
    return (lambda: [o.numpy() for o in reduce(tensors)]), {"bytes": nbytes}


def train_step(comm, network: str, np, tf):
    from hpcdl.engine.optim import make_optimizer
    from hpcdl.engine.step import make_train_step
    from hpcdl.workloads.hep.config import HepModelConfig
    from hpcdl.workloads.hep.model import HepCNN
    from hpcdl.workloads.hep.workload import WORKLOAD

    image, fields, batch = NETWORKS[network]
    model = HepCNN(HepModelConfig(**fields), (image, image, 3), seed=0)
    variables = [v for _, v in model.named_variables()]
    step = make_train_step(lambda b: WORKLOAD.loss(model, b, training=True), variables,
                           make_optimizer("adam", variables, 1e-4), comm)
    rng = np.random.default_rng(comm.rank())
    data = (rng.random((batch, image, image, 3), dtype=np.float32), (np.arange(batch) % 2).astype(np.int32),
            np.ones(batch, np.float32))
    comm.broadcast_variables(variables)
    return (lambda: step(data)[0].numpy()), {"image": image, "batch_per_rank": batch, **fields,
                                             "parameters": int(sum(int(np.prod(v.shape)) for v in variables))}


if __name__ == "__main__":
    sys.exit(main())
