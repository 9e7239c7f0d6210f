"""The machine's float32 matmul peak (sgemm) and the HEP step's share of it (step).

sgemm      the machine's float32 matrix-multiply peak: numpy (OpenBLAS) on 4096² matrices, best of
           several samples of ≥ 2 s each (the time scale of a training step), interleaved with the
           step below; TensorFlow's own matmul (oneDNN) beside it. The denominator of every ratio
           is the best of either seen anywhere in this run.
step       the HEP network of the paper (5 convolutions of 128 3×3 filters) at 224×224, batch 32,
           one rank set up exactly as hpcdl's tuning would set it up: FLOP/s of one training step
           (the engine's step minus Horovod), best and median of interleaved rounds; its ratio to
           the sgemm peak (goal ≥ 0.7). Also tuning.precision = mixed_bfloat16's step (its
           speed-up reported only where the CPU has a bfloat16 unit).
"""

from __future__ import annotations

import os
from typing import Any

from bench.harness import Bench, Probe, best, gf, loadavg, log, median, mem_available_gb

GOAL = 0.7  # the step's share of the peak


def run(b: Bench) -> None:
    do_step = "step" in b.args.sections  # sgemm's samples come along either way
    rounds = b.args.rounds
    batch = b.args.batch
    res = b.data.setdefault("step", {"batch": batch, "rounds": []})
    tf = b.tf_probe()
    bf = None
    from hpcdl.engine.tuning import onednn_isa_cap, read_cpuinfo

    # mixed_bfloat16 only where it is native: emulated it runs at ~0.1x float32 (bench/results,
    # AVX2 EPYC) and the job option is refused there, so its step would only cost the bench time.
    mixed = ["mixed_bfloat16"] if read_cpuinfo().bf16 else []
    # Under ONEDNN_MAX_CPU_ISA TensorFlow still dispatches bfloat16 by the CPU's own flags and
    # oneDNN refuses the primitive: the process dies (SIGILL), so no bfloat16 matmul then.
    capped = bool(onednn_isa_cap(os.environ))
    if do_step:
        log(f"step: tracing the HEP step at 224x224, batch {batch} (float32{', mixed_bfloat16' if mixed else ''})")
        res["first_step"] = tf.ask(op="setup", batches=[batch], precisions=["float32", *mixed])
        if not mixed:  # its plan falls back to float32: a second float32 process, no figure
            log("step: no bfloat16 unit on this CPU: no bfloat16 (fpmath) process")
        elif mem_available_gb() >= 5.0:
            log("step: a second process with tuning.precision = bfloat16 (oneDNN fpmath mode)")
            bf = Probe("tf-bf16", ["--role", "tf", "--image", "224", "--precision", "bfloat16"], b.logdir)
            b.data["tf_bf16"] = bf.info
            res["first_step_fpmath"] = bf.ask(op="setup", batches=[batch], precisions=["float32"])
        else:
            log(f"step: only {mem_available_gb():.1f} GB available: no bfloat16 (fpmath) process")
    mm_bf16, steps, fpmath, explicit, shares = [], [], [], [], []

    def rates(out):
        return [out["flops"] / s for s in out["seconds"]]

    try:
        for r in range(rounds):
            log(f"sgemm/step: round {r + 1}/{rounds} (load {loadavg():.1f})")
            entry: dict[str, Any] = {"load": loadavg()}
            entry["sgemm"] = b.sgemm_sample()
            mm = rates(tf.ask(op="matmul", dtype="float32", n=b.args.sgemm_n, reps=2, min_seconds=b.args.peak_seconds))
            b.tf_mm.extend(mm)
            entry["tf_matmul"] = max(mm)
            if do_step:
                st = tf.ask(op="step", batch=batch, precision="float32", n=b.args.step_n)
                steps.extend(rates(st))
                shares.extend(st["cpu_share"])
                if bf is not None:
                    fm = bf.ask(op="step", batch=batch, precision="float32", n=b.args.step_n)
                    fpmath.extend(rates(fm))
                    entry["step_fpmath"] = fm
                entry.update(step=st)
                if mixed:
                    ex = tf.ask(op="step", batch=batch, precision="mixed_bfloat16", n=1)
                    explicit.extend(rates(ex))
                    entry.update(step_explicit_bf16=ex)
            if not capped:
                mm_bf16.extend(rates(tf.ask(op="matmul", dtype="bfloat16", n=b.args.sgemm_n, reps=2,
                                            min_seconds=b.args.peak_seconds)))
            res["rounds"].append(entry)
    finally:
        if bf is not None:
            bf.close()
    res.update(sgemm=list(b.sgemm), tf_matmul=list(b.tf_mm), tf_matmul_bf16=mm_bf16, step_flops=steps,
               step_fpmath_flops=fpmath, step_explicit_bf16_flops=explicit, cpu_share=shares)
    _rows(b, res, capped)


def _rows(b: Bench, res: dict, capped: bool) -> None:
    """The table's rows of the matmul peaks and the step, from what run() measured into `res`."""
    from hpcdl.engine.tuning import read_cpuinfo

    batch, mm_bf16, steps = res["batch"], res["tf_matmul_bf16"], res["step_flops"]
    fpmath, explicit, shares = res["step_fpmath_flops"], res["step_explicit_bf16_flops"], res["cpu_share"]
    core = b.data["numpy"].get("openblas_core")
    b.row("sgemm.numpy", "peak", f"sgemm numpy float32 {b.args.sgemm_n}² (OpenBLAS, {core} kernels)",
          gf(best(b.sgemm)), f"{best(b.sgemm) / b.peak:.2f} of peak",
          f"median {gf(median(b.sgemm))}, {len(b.sgemm)} runs", number=best(b.sgemm))
    b.row("sgemm.tf", "peak", f"TensorFlow matmul float32 {b.args.sgemm_n}² (oneDNN)", gf(best(b.tf_mm)),
          f"{best(b.tf_mm) / b.peak:.2f} of peak", f"median {gf(median(b.tf_mm))}", number=best(b.tf_mm))
    cpu = read_cpuinfo()
    # Named from the flags, not from the vector ISA: an AVX2 CPU has no bfloat16 unit at all.
    bf16_unit = cpu.bf16_unit if cpu.bf16 else "emulated: no bfloat16 unit"
    if capped:
        b.row("sgemm.tf_bf16", "peak", f"TensorFlow matmul bfloat16 {b.args.sgemm_n}²", "not run", "",
              "ONEDNN_MAX_CPU_ISA is set")
    else:
        b.row("sgemm.tf_bf16", "peak", f"TensorFlow matmul bfloat16 {b.args.sgemm_n}² ({bf16_unit})",
              gf(best(mm_bf16)), f"{best(mm_bf16) / b.peak:.2f}x fp32 peak", f"median {gf(median(mm_bf16))}",
              number=best(mm_bf16))
    if not steps:
        return
    fpe = b.data["tf_default"]["flops_per_example"]
    info = b.data["tf_default"]
    ratio = best(steps) / b.peak
    b.row("step.fp32", "step", f"HEP step 224² batch {batch} float32 (intra {info['intra_op']}, "
          f"inter {info['inter_op']}, oneDNN)", gf(best(steps)), f"{ratio:.2f} of peak",
          f"goal ≥ {GOAL}{' met' if ratio >= GOAL else ' NOT met'}; median "
          f"{gf(median(steps))} (median/median {median(steps) / median(b.sgemm + b.tf_mm):.2f}); "
          f"{len(steps)} steps of {fpe * batch / 1e9:.0f} GFLOP; CPU share {median(shares):.0%}",
          number=best(steps))
    res["images_per_s_best"] = best(steps) / fpe
    if fpmath:
        b.row("step.bf16_fpmath", "step", f"same, tuning.precision = bfloat16 (oneDNN BF16 fpmath, {bf16_unit})",
              gf(best(fpmath)), f"{best(fpmath) / b.peak:.2f} of fp32 peak",
              f"{best(fpmath) / best(steps):.2f}x float32 step; median {gf(median(fpmath))}",
              number=best(fpmath))
        res["images_per_s_best"] = max(res["images_per_s_best"], best(fpmath) / fpe)
    if explicit:
        b.row("step.bf16_explicit", "step", f"same, tuning.precision = mixed_bfloat16 ({bf16_unit})",
              gf(best(explicit)), f"{best(explicit) / b.peak:.2f} of fp32 peak",
              f"{best(explicit) / best(steps):.2f}x float32 step, {best(explicit) / best(mm_bf16):.2f} "
              f"of bf16 matmul; median {gf(median(explicit))}", number=best(explicit))
    elif not cpu.bf16:
        b.row("step.bf16_explicit", "step", "same, tuning.precision = mixed_bfloat16", "not run", "",
              "no bfloat16 unit on this CPU: the job option is refused here (emulated bfloat16)")

