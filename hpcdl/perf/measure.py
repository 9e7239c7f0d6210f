"""This machine's HEP training rate, for the planner: `python -m hpcdl.perf.measure [--json]`.

A process of its own, because CPU tuning must be in the environment before TensorFlow loads: one
rank that owns the whole machine, tuned as hpcdl tunes a rank; the engine's step minus Horovod
(alone, a rank has nothing to average); the paper's network at the given image size; the first
step (tracing, oneDNN's primitive creation) untimed; the best of the timed steps. `make bench`
measures the same step more carefully, side by side with the machine's matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

MEASURE_TIMEOUT_S = 600.0


def measure(steps: int = 2, batch: int = 32, image: int = 224) -> dict[str, Any]:
    from hpcdl.config import TuningConfig
    from hpcdl.engine.tuning import configure_tensorflow, plan_for_this_process

    plan = plan_for_this_process(TuningConfig(), ranks_on_host=1)
    os.environ.update(plan.environment())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    from hpcdl.engine.optim import make_optimizer
    from hpcdl.engine.step import make_train_step
    from hpcdl.workloads.hep.config import HepModelConfig
    from hpcdl.workloads.hep.model import HepCNN
    from hpcdl.workloads.hep.workload import WORKLOAD

    configure_tensorflow(plan)
    model = HepCNN(HepModelConfig(), (image, image, 3))
    variables = [v for _, v in model.named_variables()]
    optimizer = make_optimizer("adam", variables, 1e-3)
    rng = np.random.default_rng(0)
    data = (tf.constant(rng.random((batch, image, image, 3), dtype=np.float32)),
            tf.constant(np.arange(batch) % 2, tf.int32), tf.ones([batch]))

    step = make_train_step(lambda batch: WORKLOAD.loss(model, batch, training=True), variables, optimizer)
    step(data)[0].numpy()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step(data)[0].numpy()
        seconds.append(time.perf_counter() - start)
    flops = model.flops().training * batch
    return {"node_flops": flops / min(seconds), "step_s": min(seconds), "steps": steps, "batch": batch,
            "image": image, "threads": f"intra-op {plan.intra_op}, inter-op {plan.inter_op}, "
                       f"oneDNN {'on' if plan.onednn else 'off'}, {plan.precision}"}


def measure_in_subprocess(**kwargs: Any) -> dict[str, Any]:
    """`measure` in a fresh Python; RuntimeError with the child's last words if it fails."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items()]
    proc = subprocess.run([sys.executable, "-m", "hpcdl.perf.measure", "--json", *args],
                          capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"measuring this machine failed: {last}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcdl.perf.measure", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.steps, args.batch, args.image)
    print(json.dumps(result) if args.json else
          f"{result['node_flops'] / 1e9:.1f} GFLOP/s ({result['step_s']:.2f} s per step of "
          f"{args.batch} at {args.image}²; {result['threads']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
