"""Does the generic path cost anything? The paper's HEP network written as a plain Keras builder
(`build_hep` below) and trained through the generic `keras` workload (its model wrapper and its
loss), beside the built-in HEP network (`hpcdl.workloads.hep.model.HepCNN` and its loss), both
in the engine's own training step.

step   FLOP/s of one training step of each, at --step-image² and --batch on random input,
       alternating in rounds in one process; both counted with the same FLOPs per example
       (HepModelConfig.cost: the network is the same), so the ratio is the ratio of step times.
       The issue's criterion: the Keras step reaches >= 0.9 of the built-in one.
auc    each trained --steps Adam steps per seed on the same batches of a generated HEP set
       (HEP's reader and normalisation feed both, with its class-balanced weights), then scored
       on the validation file as `hpcdl evaluate` scores HEP (weighted ROC AUC): the difference
       beside the spread over seeds (the criterion: the same AUC within seed noise).

    .venv/bin/python -m bench.keras_parity --steps 300 --seeds 2

Results: bench/results/keras/<date>_<time>-<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.harness import hep_data, machine, result_path, write_result

SUITE = "keras"
GOAL = 0.9


def build_hep(input_shape, filters=128, conv_layers=5, kernel=3, pool=2, dropout=0.2):
    """The HEP network of hpcdl.workloads.hep.model as a Keras builder: [conv → ReLU → max-pool →
    dropout] × (conv_layers - 1), conv → ReLU, global average pool, dense to 2 logits."""
    import keras

    inputs = keras.Input(input_shape)
    x = inputs
    for _ in range(conv_layers - 1):
        x = keras.layers.Conv2D(filters, kernel, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D(pool)(x)
        if dropout:
            x = keras.layers.Dropout(dropout)(x)
    x = keras.layers.Conv2D(filters, kernel, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def models(filters: int, shape: tuple[int, ...], seed: int):
    """(name, model, loss) of the built-in HEP network and of the same network through the keras
    workload."""
    from hpcdl.workloads.hep.config import HepModelConfig
    from hpcdl.workloads.hep.workload import WORKLOAD as HEP
    from hpcdl.workloads.keras.config import KerasModelConfig
    from hpcdl.workloads.keras.workload import WORKLOAD as KERAS

    hep = HEP.build_model(HepModelConfig(filters=filters), shape, seed=seed)
    keras_model = KERAS.build_model(KerasModelConfig(builder="bench.keras_parity:build_hep",
                                                     args={"filters": filters}), shape, seed=seed)
    return [("hep", hep, lambda b: HEP.loss(hep, b, training=True)),
            ("keras", keras_model, lambda b: KERAS.loss(keras_model, b, training=True))]


def step_rates(filters: int, image: int, batch: int, rounds: int, steps: int, log) -> dict:
    import numpy as np
    import tensorflow as tf

    from hpcdl.engine.optim import make_optimizer
    from hpcdl.engine.step import make_train_step
    from hpcdl.workloads.hep.config import HepModelConfig

    shape = (image, image, 3)
    flops = HepModelConfig(filters=filters).cost(shape)[0].training * batch
    rng = np.random.default_rng(0)
    data = (tf.constant(rng.random((batch, *shape), dtype=np.float32)),
            tf.constant(np.arange(batch) % 2, tf.int32), tf.ones([batch]))
    steps_of = {}
    for name, model, loss in models(filters, shape, seed=0):
        variables = [v for _, v in model.named_variables()]
        step = make_train_step(loss, variables, make_optimizer("adam", variables, 1e-3))
        step(data)[0].numpy()  # tracing and oneDNN's primitives, untimed
        steps_of[name] = step
    seconds: dict[str, list[float]] = {name: [] for name in steps_of}
    for r in range(rounds):
        for name, step in steps_of.items():
            for _ in range(steps):
                t = time.perf_counter()
                step(data)[0].numpy()
                seconds[name].append(time.perf_counter() - t)
        log(f"step: round {r + 1}/{rounds}: " + ", ".join(f"{n} {min(s) * 1e3:.0f} ms" for n, s in seconds.items()))
    rate = {name: flops / min(s) for name, s in seconds.items()}
    median = {name: flops / sorted(s)[len(s) // 2] for name, s in seconds.items()}
    return {"image": image, "batch": batch, "filters": filters, "flops_per_step": flops, "seconds": seconds,
            "best_flops_per_s": rate, "median_flops_per_s": median,
            "ratio_best": rate["keras"] / rate["hep"], "ratio_median": median["keras"] / median["hep"]}


def aucs(data: dict[str, Path], filters: int, batch: int, steps: int, seeds: int, log) -> dict:
    import numpy as np
    import tensorflow as tf

    from hpcdl.jobfile import load_job
    from hpcdl.engine.optim import make_optimizer
    from hpcdl.engine.step import make_train_step
    from hpcdl.workloads.hep import metrics
    from hpcdl.workloads.hep.normalization import Normalization
    from hpcdl.workloads.hep.workload import WORKLOAD as HEP

    job = load_job("hep", [f'data.train="{data["train"]}"', f'data.val="{data["val"]}"',
                           f'data.test="{data["test"]}"', f"model.filters={filters}",
                           f"train.batch_per_rank={batch}", "data.chunk_events=1024"])
    stats = Normalization.from_file(job.data.train, chunk=job.data.chunk_events).to_dict()
    shape = HEP.input_shape(job)
    out: dict = {"steps": steps, "image": list(shape), "runs": []}
    for seed in range(seeds):
        for name, model, loss in models(filters, shape, seed=seed):
            variables = [v for _, v in model.named_variables()]
            step = make_train_step(loss, variables, make_optimizer("adam", variables, job.train.learning_rate))
            tf.random.set_seed(seed)
            batches = HEP.train_batches(job, stats, 0, 1, seed=seed)  # the same batches for both
            t = time.perf_counter()
            try:
                losses = [float(step(next(batches))[0]) for _ in range(steps)]
            finally:
                batches.close()
            s = HEP.scores(model, stats, job.data.val, batch_size=256)
            auc = metrics.evaluate_scores(s["score"], s["y"], s["w"]).auc_weighted
            out["runs"].append({"seed": seed, "network": name, "auc_weighted": auc,
                                "train_seconds": time.perf_counter() - t,
                                "final_loss_mean50": float(np.mean(losses[-50:]))})
            log(f"auc: seed {seed} {name}: {auc:.4f} after {steps} steps")
    by = {n: [r["auc_weighted"] for r in out["runs"] if r["network"] == n] for n in ("hep", "keras")}
    out["mean_auc"] = {n: float(np.mean(v)) for n, v in by.items()}
    out["difference"] = out["mean_auc"]["keras"] - out["mean_auc"]["hep"]
    # seed noise: the spread of the built-in network's own AUC over seeds (both, when one seed)
    spread = [max(v) - min(v) for v in by.values() if len(v) > 1]
    out["seed_spread"] = float(max(spread)) if spread else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--image", type=int, default=32, help="the generated set's image side (auc)")
    ap.add_argument("--events", type=int, default=8000)
    ap.add_argument("--filters", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--step-image", type=int, default=64)
    ap.add_argument("--step-filters", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--round-steps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcdl-bench"))
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(f"[keras {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    import os

    from hpcdl.config import TuningConfig
    from hpcdl.engine.tuning import configure_tensorflow, plan_for_this_process

    # one rank owning the machine, tuned as hpcdl tunes a rank (before TensorFlow loads)
    plan = plan_for_this_process(TuningConfig(), ranks_on_host=1)
    os.environ.update(plan.environment())
    configure_tensorflow(plan)
    data = hep_data(args.work, args.events, args.image)
    result = {"step": step_rates(args.step_filters, args.step_image, args.batch, args.rounds, args.round_steps, log),
              "auc": aucs(data, args.filters, args.batch, args.steps, args.seeds, log),
              "goal_flops_ratio": GOAL, "command": "python -m bench.keras_parity " + " ".join(argv or sys.argv[1:])}
    result["machine"] = machine()
    path = write_result(result_path(SUITE, result["machine"]), result)
    print(json.dumps({"flops_ratio_best": result["step"]["ratio_best"],
                      "flops_ratio_median": result["step"]["ratio_median"],
                      "auc_difference": result["auc"]["difference"], "seed_spread": result["auc"]["seed_spread"]}))
    print(f"results: {path}")
    return 0 if result["step"]["ratio_best"] >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
