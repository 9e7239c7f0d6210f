"""A real one-rank `hpcdl submit` run's sustained FLOP/s against the peak.

A real `hpcdl submit hep --backend local --nodes 1` on a generated 224×224 set: the engine's own
sustained FLOP/s (data loading, Horovod, logging, first-step tracing included) over a short run,
and its ratio to the peak (goal ≥ 0.6); once per tuning.precision (bfloat16 where the CPU has it).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from bench.harness import Bench, BenchError, best, gf, loadavg, log, median
from bench.local_runs import CpuTracker, data_sets, generated, metrics, submit
from hpcdl.rundir.runs import RunDir

GOAL = 0.6  # the sustained FLOP/s' share of the peak


def run(b: Bench) -> None:
    files = generated(b, b.args.sustained_events, 224)
    b.close_tf()  # memory, and nothing else of ours competes with the run
    b.data["sustained_sgemm_before"] = b.sgemm_sample(reps=3)
    from hpcdl.engine.tuning import read_cpuinfo

    for precision in (p.strip() for p in b.args.sustained_precisions.split(",") if p.strip()):
        if precision == "bfloat16" and not read_cpuinfo().bf16:
            b.row("sustained_bfloat16.run", "sustained", "tuning.precision=bfloat16", "skipped", "",
                  "this CPU has no AVX512_BF16/AMX-BF16 (the plan would fall back to float32)")
            continue
        sustained_run(b, files, precision)
    b.data["sustained_sgemm_after"] = b.sgemm_sample(reps=3)


def sustained_run(b: Bench, files: dict[str, Path], precision: str) -> None:
    steps, batch, log_every = b.args.sustained_steps, b.args.batch, b.args.sustained_log_every
    key = "sustained" if precision == "float32" else f"sustained_{precision}"
    load = loadavg()
    log(f"sustained: hpcdl submit hep, 1 rank, 224x224, batch {batch}, {steps} steps, {precision} (load {load:.1f})")
    cpu = CpuTracker()
    run_dir, t0, proc = submit(b, key, [
        *data_sets(files), f"train.steps={steps}", f"train.batch_per_rank={batch}",
        f"train.log_every={log_every}", f"train.checkpoint_every={steps}", "data.chunk_events=256",
        f'tuning.precision="{precision}"',
        # training's rate: one validation is much of a 16-step run, little of a real one
        "train.validate_every=0",
    ], watch=cpu)
    wall = time.time() - t0
    cores = b.data.get("tf_default", {}).get("intra_op") or os.cpu_count() or 1
    share = cpu.seconds / (wall * cores)
    if proc.returncode != 0 or run_dir is None:
        raise BenchError(f"sustained run ({precision}) failed ({proc.returncode}): {proc.stderr[-2000:]}")
    lines = metrics(run_dir)
    last = lines[-1]
    windows = [m["flops_per_s_group"] for m in lines[1:]]  # the first window holds the tracing
    rank_log = RunDir(run_dir).rank_log(0, 0).read_text(errors="replace")
    plan_line = next((l for l in rank_log.splitlines() if "threads:" in l), "")
    b.data[key] = {"metrics": lines, "wall_s": wall, "load_start": load, "plan": plan_line,
                   "cpu_seconds": cpu.seconds, "cpu_share": share,
                   "images_per_s_best": max(m["images_per_s"] for m in lines)}
    sustained = last["sustained_flops_per_s_group"]
    if precision == "float32":
        ok = b.peak and sustained / b.peak >= GOAL
        what = (f"hpcdl submit, 1 rank, {steps} steps × {batch} at 224², data + Horovod, "
                "first-step tracing included")
        note = (f"goal ≥ {GOAL}{' met' if ok else ' NOT met' if b.peak else ''} "
                f"({sustained / median(b.sgemm + b.tf_mm):.2f} of the median sgemm); ")
        ratio = b.peak_ratio(sustained)
    else:
        what = f"same, --set tuning.precision={precision}"
        ref = b.data.get("sustained", {}).get("metrics")
        note = (f"{sustained / ref[-1]['sustained_flops_per_s_group']:.2f}x the float32 run; " if ref else "")
        ratio = b.peak_ratio(sustained).replace("of peak", "of fp32 peak")
    b.row(f"{key}.run", "sustained", what, gf(sustained), ratio,
          note + f"{last['images_per_s']:.2f} img/s; run wall {wall:.0f} s, its processes got {share:.0%} "
          f"of {cores} cores (load {load:.1f})", number=sustained)
    if windows and precision == "float32":
        b.row(f"{key}.windows", "sustained", f"same run, steady {log_every}-step windows (after the first)",
              gf(best(windows)), b.peak_ratio(best(windows)), f"median {gf(median(windows))}",
              number=best(windows))
    if not b.args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)

