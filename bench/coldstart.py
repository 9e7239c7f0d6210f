"""Does the hybrid mode learn from a cold start? `make run`'s training (HEP 64², 32 filters, two
single-rank groups and the applier) repeated per setting, group 0's loss and the master's
validation AUC by step; and, to see why, the same network in one process with the applier's own
rule and a fixed delay.

* ``real``: `hpcdl submit hep --backend local` RUNS times for each ``--set`` list in SETTINGS (the
  groups and the applier race each other, so runs differ even with one seed).
* ``delay``: two groups take turns; each gradient is one step of the applier's rule on the master
  and the group then trains from the master as it was ``--lag`` versions ago, so every update has
  staleness lag + 1 (``--lag -1``: one synchronous group of twice the batch, the reference). Seeds
  change the initial weights and the batches; the job's ``exchange.staleness_scaling`` divides
  each step by the staleness, as the applier does. A dead start shows as a loss stuck at 0.69 with
  the first convolutions' biases driven negative (their ReLUs then output zeros on sparse images).

    .venv/bin/python -m bench.coldstart real --runs 4 --steps 300
    .venv/bin/python -m bench.coldstart real --runs 4 --setting "warm-up 50=exchange.warmup_steps=50" \
        --setting "warm-up 200=exchange.warmup_steps=200"
    .venv/bin/python -m bench.coldstart delay --lags=-1,0,2 --seeds 0,1,2 --steps 150 \
        --set exchange.staleness_scaling=false

Results: bench/results/coldstart/<date>-<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import HPCDL, machine, result_path, write_result
from bench.local_runs import metrics
from hpcdl.workloads.common import split_paths

SUITE = "coldstart"
MAKE_RUN = ["model.filters=32"]
SETTINGS = {"two updates in flight": ["exchange.max_outstanding=2"], "job defaults": []}


def data_files(work: Path, events: int) -> dict[str, Path]:
    files = split_paths(work)
    if not all(path.is_file() for path in files.values()):
        subprocess.run([HPCDL, "data", "generate", "hep", "--out", str(work), "--events", str(events),
                        "--image-size", "64", "--force"], check=True, capture_output=True)
    return files


def data_sets(data: dict[str, Path]) -> list[str]:
    return [f'data.{split}="{path}"' for split, path in data.items()]


def real_run(data: dict[str, Path], runs: Path, steps: int, extra: list[str]) -> dict:
    sets = [*MAKE_RUN, *data_sets(data), f"train.steps={steps}", f'run.runs_dir="{runs}"', *extra]
    out = subprocess.run([HPCDL, "submit", "hep", "--backend", "local", "--nodes", "2", "--group-size", "1",
                          "--json", *(a for s in sets for a in ("--set", s))],
                         capture_output=True, text=True, check=True)
    run_dir = Path(json.loads(out.stdout)["run_dir"])
    loss, auc = {}, {}
    for record in metrics(run_dir, 0):
        if record["step"] % 50 == 0:
            loss[record["step"]] = round(record["loss"], 3)
        if "val_auc" in record:
            auc[record["val_step"]] = round(record["val_auc"], 3)
    return {"run": run_dir.name, "loss": loss, "val_auc": auc}


def delay_run(data: dict[str, Path], steps: int, lag: int, seed: int, sets: list[str], groups: int = 2) -> dict:
    import numpy as np
    import tensorflow as tf

    from hpcdl.applier.rules import RuleParams, applier_learning_rate, make_rule
    from hpcdl.jobfile import load_job
    from hpcdl.engine.optim import make_optimizer
    from hpcdl.engine.step import make_train_step
    from hpcdl.workloads import get_workload

    tf.random.set_seed(seed)  # dropout's masks
    sync = lag < 0
    count = 1 if sync else groups
    job = load_job("hep", [*MAKE_RUN, *data_sets(data), f"train.seed={seed}",
                           f"train.batch_per_rank={128 * (groups if sync else 1)}", *sets])
    workload = get_workload("hep")
    stats = workload.compute_stats(job)
    models = [workload.build_model(job.model, workload.input_shape(job), seed=seed) for _ in range(count)]
    variables = [[v for _, v in m.named_variables()] for m in models]
    names = [n for n, _ in models[0].named_variables()]
    steps_of = [make_train_step(lambda b, m=m: workload.loss(m, b, training=True), vs,
                                make_optimizer("adam", vs, job.train.learning_rate))
                for m, vs in zip(models, variables)]
    batches = [workload.train_batches(job, stats, g, count, seed=seed) for g in range(count)]
    applier = job.exchange
    rule = make_rule(applier.optimizer, RuleParams(lr=applier_learning_rate(applier, job.train.learning_rate, groups),
                                                   beta1=applier.momentum, momentum=applier.momentum))
    master = {n: v.numpy().copy() for n, v in zip(names, variables[0])}
    slots = {s: {n: np.zeros_like(w) for n, w in master.items()} for s in rule.slots}
    scale = 1.0 / (lag + 1) if applier.staleness_scaling and not sync else 1.0  # as the applier scales
    versions, losses, t = [], [], 0
    for _ in range(steps):
        step_losses = []
        for g in range(count):
            loss, grads, _, _ = steps_of[g](next(batches[g]))
            step_losses.append(float(loss))
            if sync:
                continue
            t += 1
            rule.apply(master, slots, {n: x.numpy() for n, x in zip(names, grads)}, scale, t)
            versions = [*versions, {n: w.copy() for n, w in master.items()}][-(lag + 1):]
            for name, var in zip(names, variables[g]):
                var.assign(versions[0][name])
        losses.append(float(np.mean(step_losses)))
    final = {n: v.numpy() for n, v in zip(names, variables[0])} if sync else master
    return {"lag": lag, "seed": seed, "sets": sets, "scale": scale,
            "loss": {k: round(float(np.mean(losses[k - 10:k])), 3) for k in range(50, steps + 1, 50)},
            "bias_mean": {n: round(float(final[n].mean()), 4) for n in names if n.endswith("/b")}}


def parse_setting(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition("=")
    return name, [s for s in sets.split(";") if s]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("real", "delay"))
    p.add_argument("--work", type=Path, default=Path("/tmp/hpcdl-coldstart"), help="data and runs")
    p.add_argument("--events", type=int, default=25000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--runs", type=int, default=4, help="real: runs per setting")
    p.add_argument("--lags", default="-1,0,2", help="delay: comma-separated (-1: synchronous)")
    p.add_argument("--seeds", default="0,1,2", help="delay: comma-separated")
    p.add_argument("--set", action="append", default=[], help="delay: a job override (repeatable)")
    p.add_argument("--setting", action="append", default=[], metavar="NAME=SET[;SET...]",
                   help="real: a setting to race instead of SETTINGS, e.g. 'one in flight=exchange.max_outstanding=1'")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    data = data_files(args.work / "data", args.events)
    results = {"mode": args.mode, "steps": args.steps, "machine": machine(), "started": time.time(), "runs": []}
    if args.mode == "real":
        settings = dict(parse_setting(s) for s in args.setting) or SETTINGS
        for i in range(args.runs):
            for name, extra in settings.items():  # interleaved: the machine's load hits both alike
                res = {"setting": name, "sets": extra, **real_run(data, args.work / "runs", args.steps, extra)}
                results["runs"].append(res)
                print(json.dumps(res), flush=True)
    else:
        for seed in (int(s) for s in args.seeds.split(",")):
            for lag in (int(x) for x in args.lags.split(",")):
                res = delay_run(data, args.steps, lag, seed, args.set)
                results["runs"].append(res)
                print(json.dumps(res), flush=True)
    path = write_result(args.json or result_path(SUITE, results["machine"]), results)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
