"""Does tuning.precision = "mixed_bfloat16" learn as well as float32? The HEP network trained
twice from the same initial weights on the same batches, once per precision, then both scored on
the same validation file: the issue's criterion is a weighted validation AUC within 0.005.

Only meaningful on a CPU with a bfloat16 unit (AVX512_BF16 or AMX): elsewhere TensorFlow emulates
bfloat16 and the job option is refused, so the script refuses too (--emulated runs it anyway, as
a smoke test whose figure is not a parity result). Both models are scored in float32, as
`hpcdl evaluate` scores a checkpoint (its weights are float32 either way); the mixed model's own
bfloat16 forward pass is scored too. Results: bench/results/precision/<date>-<machine>.json.

    .venv/bin/python -m bench.precision_parity --steps 300 --image 64 --filters 64
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

from bench.harness import hep_data, machine, result_path, write_result

SUITE = "precision"
TOLERANCE = 0.005


def parity(data: dict[str, Path], steps: int, filters: int, batch: int, seed: int = 0,
           log=lambda msg: None) -> dict:
    """AUCs after `steps` Adam steps in float32 and in mixed_bfloat16 (same start, same batches)."""
    import numpy as np
    import tensorflow as tf

    from hpcdl.jobfile import load_job
    from hpcdl.engine.optim import make_optimizer
    from hpcdl.engine.step import make_train_step
    from hpcdl.workloads.hep import metrics
    from hpcdl.workloads.hep.normalization import Normalization
    from hpcdl.workloads.hep.workload import WORKLOAD

    job = load_job("hep", [f'data.train="{data["train"]}"', f'data.val="{data["val"]}"',
                           f'data.test="{data["test"]}"', f"model.filters={filters}",
                           f"train.batch_per_rank={batch}", "data.chunk_events=1024"])
    stats = Normalization.from_file(job.data.train, chunk=job.data.chunk_events).to_dict()
    shape = WORKLOAD.input_shape(job)
    out = {"steps": steps, "filters": filters, "batch": batch, "image": list(shape), "runs": {}}
    for precision, dtype in (("float32", "float32"), ("mixed_bfloat16", "bfloat16")):
        model = WORKLOAD.build_model(job.model, shape, seed=seed, compute_dtype=dtype)
        variables = [v for _, v in model.named_variables()]
        optimizer = make_optimizer("adam", variables, job.train.learning_rate)
        tf.random.set_seed(seed)  # the same dropout masks' seed for both

        step = make_train_step(lambda b, model=model: WORKLOAD.loss(model, b, training=True), variables, optimizer)

        batches = WORKLOAD.train_batches(job, stats, 0, 1, seed=seed)
        t, losses = time.perf_counter(), []
        for i in range(steps):
            losses.append(float(step(next(batches))[0]))
            if (i + 1) % 50 == 0:
                log(f"{precision}: step {i + 1}/{steps}, loss {np.mean(losses[-50:]):.4f}")
        seconds = time.perf_counter() - t
        scored = {}
        as_float32 = copy.copy(model)
        as_float32.compute_dtype = tf.float32
        for name, m in (("float32_forward", as_float32), ("own_forward", model)):
            s = WORKLOAD.scores(m, stats, job.data.val, batch_size=256)
            scored[name] = metrics.evaluate_scores(s["score"], s["y"], s["w"]).auc_weighted
        out["runs"][precision] = {"auc_weighted": scored, "train_seconds": seconds,
                                  "final_loss_mean50": float(np.mean(losses[-50:]))}
        log(f"{precision}: AUC {scored} in {seconds:.0f} s")
    a32 = out["runs"]["float32"]["auc_weighted"]["float32_forward"]
    abf = out["runs"]["mixed_bfloat16"]["auc_weighted"]["float32_forward"]
    out["auc_difference"] = abf - a32
    out["within_tolerance"] = abs(abf - a32) <= TOLERANCE
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--filters", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--events", type=int, default=12000)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcdl-bench"))
    ap.add_argument("--emulated", action="store_true", help="run on a CPU without bfloat16 (smoke test only)")
    args = ap.parse_args(argv)
    from hpcdl.engine.tuning import read_cpuinfo

    cpu = read_cpuinfo()
    if not cpu.bf16 and not args.emulated:
        print(f"precision_parity: {cpu.model} ({cpu.vector_isa}) has no bfloat16 unit; mixed_bfloat16 is refused "
              "here and a parity figure would mean nothing (--emulated runs it as a smoke test)", file=sys.stderr)
        return 2
    data = hep_data(args.work, args.events, args.image)
    result = parity(data, args.steps, args.filters, args.batch,
                    log=lambda m: print(f"[parity {time.strftime('%H:%M:%S')}] {m}", file=sys.stderr, flush=True))
    result.update(cpu=cpu.model, isa=cpu.vector_isa, bf16_unit=cpu.bf16_unit, flags=" ".join(sorted(cpu.flags)),
                  emulated=not cpu.bf16, tolerance=TOLERANCE)
    result["machine"] = machine()
    path = write_result(result_path(SUITE, result["machine"]), result)
    print(json.dumps({k: result[k] for k in ("auc_difference", "within_tolerance", "emulated")}))
    print(f"results: {path}")
    return 0 if result["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
