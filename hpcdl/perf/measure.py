"""This machine's training rate on a job's network, for the planner:
`python -m hpcdl.perf.measure [--job REF] [--input-shape HxWxC] [--json]`.

A process of its own, because CPU tuning must be in the environment before TensorFlow loads: one
rank that owns the whole machine, tuned as hpcdl tunes a rank; the engine's step minus the
collectives (alone, a rank has nothing to average); the job's network built by its workload at
the given input shape, on the workload's `example_batch` (no data read); the first step (tracing,
oneDNN's primitive creation) untimed; the best of the timed steps. `make bench` measures the HEP
step more carefully, side by side with the machine's matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Sequence

from hpcdl.perf.inputs import shape_text

MEASURE_TIMEOUT_S = 600.0
CANNOT_MEASURE = 2  # the child's exit status for CannotMeasure


class CannotMeasure(Exception):
    """The job's workload cannot make a batch to time: the planner needs the node's rate given."""


def measure(job: str = "hep", input_shape: Sequence[int] = (224, 224, 3), steps: int = 2, batch: int = 32,
            overrides: Sequence[str] = ()) -> dict[str, Any]:
    from hpcdl.config import TuningConfig
    from hpcdl.engine.tuning import configure_tensorflow, plan_for_this_process

    plan = plan_for_this_process(TuningConfig(), ranks_on_host=1)
    os.environ.update(plan.environment())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    from hpcdl.engine.optim import make_optimizer
    from hpcdl.engine.step import make_train_step
    from hpcdl.jobfile import load_job
    from hpcdl.workloads import get_workload

    configure_tensorflow(plan)
    spec = load_job(job, list(overrides))
    workload = get_workload(spec.workload)
    model = workload.build_model(spec.model, tuple(input_shape), seed=0)
    example = workload.example_batch(spec, model, batch, seed=0)
    if example is None:
        raise CannotMeasure(f"the {spec.workload} workload makes no example batch to time a step on: "
                            f"give the node's rate (--node-flops or --inputs)")
    variables = [v for _, v in model.named_variables()]
    step = make_train_step(lambda b: workload.loss(model, b, training=True), variables,
                           make_optimizer("adam", variables, 1e-3))
    data = tuple(tf.constant(t) for t in example)
    step(data)[0].numpy()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step(data)[0].numpy()
        seconds.append(time.perf_counter() - start)
    flops = model.flops().training * batch
    return {"node_flops": flops / min(seconds), "step_s": min(seconds), "steps": steps, "batch": batch,
            "network": f"{spec.workload} at {shape_text(input_shape)}",
            "threads": f"intra-op {plan.intra_op}, inter-op {plan.inter_op}, "
                       f"oneDNN {'on' if plan.onednn else 'off'}, {plan.precision}"}


def measure_in_subprocess(job: str = "hep", input_shape: Sequence[int] = (224, 224, 3),
                          overrides: Sequence[str] = (), **kwargs: Any) -> dict[str, Any]:
    """`measure` in a fresh Python; CannotMeasure if the workload makes no example batch,
    RuntimeError with the child's last words if it fails otherwise."""
    args = [f"--job={job}", f"--input-shape={shape_text(input_shape)}",
            *(f"--set={o}" for o in overrides), *(f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items())]
    proc = subprocess.run([sys.executable, "-m", "hpcdl.perf.measure", "--json", *args],
                          capture_output=True, text=True, timeout=MEASURE_TIMEOUT_S)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        if proc.returncode == CANNOT_MEASURE:
            raise CannotMeasure(last)
        raise RuntimeError(f"measuring this machine failed: {last}")
    return json.loads(proc.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcdl.perf.measure", description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="hep", help="a shipped job's name or a job file")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a job field")
    parser.add_argument("--input-shape", default="224x224x3", help="one example's shape, e.g. 64x64x3")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shape = tuple(int(x) for x in args.input_shape.split("x"))
    try:
        result = measure(args.job, shape, args.steps, args.batch, args.set)
    except CannotMeasure as exc:
        print(exc, file=sys.stderr)
        return CANNOT_MEASURE
    print(json.dumps(result) if args.json else
          f"{result['node_flops'] / 1e9:.1f} GFLOP/s ({result['step_s']:.2f} s per step of "
          f"{args.batch} of {result['network']}; {result['threads']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
