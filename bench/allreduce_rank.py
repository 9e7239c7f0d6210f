"""One rank of `make bench`'s allreduce section: Horovod's allreduce of the HEP gradient.

Started as a group of ranks (`python -m bench.allreduce_rank`) by bench.sections.allreduce, either
with Gloo's variables and a rendezvous (run.controller = "gloo") or under mpirun
(run.controller = "mpi"), like hpcdl starts a group.
Each rank allreduces tensors shaped like the HEP network's variables (594,178 float32, 2.38 MB)
inside a tf.function, as the engine's DistributedGradientTape does (one allreduce per tensor,
fused by Horovod), `--warmup` times, then `--reps` timed times; rank 0 checks the average
against numpy's and prints one JSON line: {"controller", "size", "bytes", "seconds": [...]}.
One thread per TensorFlow pool: the ranks share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import horovod.tensorflow as hvd

    from bench.sections.exchange import hep_gradient

    hvd.init()
    grads = hep_gradient(params_seed=hvd.rank())
    tensors = [tf.constant(v) for v in grads.values()]

    @tf.function
    def reduce(ts):
        return [hvd.allreduce(t, op=hvd.Average) for t in ts]

    for _ in range(args.warmup):
        out = reduce(tensors)
    # the sum is right: every rank's gradient is known to every rank (seeded by rank)
    want = np.mean([list(hep_gradient(params_seed=r).values())[0] for r in range(hvd.size())], axis=0)
    if not np.allclose(out[0].numpy(), want, rtol=1e-5, atol=1e-5):
        raise SystemExit(f"rank {hvd.rank()}: the allreduced average is wrong")
    seconds = []
    for _ in range(args.reps):
        t = time.perf_counter()
        [o.numpy() for o in reduce(tensors)]
        seconds.append(time.perf_counter() - t)
    if hvd.rank() == 0:
        print("@@ " + json.dumps({"controller": os.environ.get("HOROVOD_CONTROLLER", "?"), "size": hvd.size(),
                                  "bytes": int(sum(v.nbytes for v in grads.values())), "seconds": seconds}),
              flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
