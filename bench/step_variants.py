"""Changes to the HEP step that are not compute, measured side by side in one process.

Each variant is the engine's step (loss, gradient tape, Adam) on the same model variables with
one implementation choice changed; the variants' steps alternate round by round (the order
rotating), so a shared machine's load hits them alike, and each round gives a paired ratio of
step times (variant / reference). Choices:

* dropout "tf": tf.nn.dropout (a float32 uniform number per element, compared with the rate);
  "bits16": 16 random bits per element (one 32-bit Philox word serves two elements), kept where
  bits >= round(rate·2¹⁶), scaled by the mask's exact 1/keep — still independent Bernoulli
  dropout, with the rate rounded to 1/65536.
* bias "matmul_grad": hpcdl.engine.nn.add_bias, a broadcast add whose gradient is a matmul of a
  row of ones by the output gradient's rows; "sum_grad": the plain broadcast add (its gradient
  is TensorFlow's Sum); "bias_add": tf.nn.bias_add (its gradient is BiasAddGrad).
* adam "loop": hpcdl.engine.optim.Adam's element-wise ops per variable; "fused": one ResourceApplyAdam
  per variable (the same formula).
* wgrad "tensorflow": Conv2DBackpropFilter (oneDNN's backward-weights kernel); "gemm":
  `tuning.conv_weight_grad = "gemm"`, hpcdl.engine.nn.conv_weight_grad_gemm on the layers it
  takes. That is the choice for AVX2 CPUs, where this oneDNN has no brgemm backward-weights
  kernel; `ONEDNN_MAX_CPU_ISA=AVX2` runs that code path on a newer CPU.
* order "relu_pool": conv + bias + ReLU (fused), then max-pooling; "pool_relu": max-pooling,
  then ReLU. The same function (the ReLU is monotone, so it commutes with the max) and the same
  gradient, with the ReLU and its gradient on a quarter of the elements.
* pool "max_pool2d": tf.nn.max_pool2d and its MaxPoolGrad (oneDNN); "pairwise": the 2×2 window
  as two element-wise maxima over free reshapes of NHWC (rows, then the column pair side by side
  in the channel axis), its gradient by the same comparisons (ties go to the first row, then
  the first column: measure-zero after the ReLU, whose gradient is zero at a tie of zeros).

Threads (inter-op / intra-op) are fixed when TensorFlow loads, so they are `make bench`'s tuning
section (one process per setting), not a variant here.

    .venv/bin/python -m bench.step_variants --rounds 4 --json bench/results/variants/<date>-<machine>.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

REFERENCE = {"dropout": "tf", "bias": "matmul_grad", "adam": "loop", "wgrad": "tensorflow", "order": "relu_pool",
             "pool": "max_pool2d"}
VARIANTS = {  # name: what it changes from the reference
    "reference": {},
    "dropout_bits16": {"dropout": "bits16"},
    "bias_add": {"bias": "bias_add"},
    "bias_grad_sum": {"bias": "sum_grad"},
    "fused_adam": {"adam": "fused"},
    "gemm_wgrad": {"wgrad": "gemm"},
    "pool_then_relu": {"order": "pool_relu"},
    "pairwise_pool": {"pool": "pairwise"},
    "gemm_wgrad_pairwise_pool": {"wgrad": "gemm", "pool": "pairwise"},
}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def build(args):
    from hpcdl.config import TuningConfig
    from hpcdl.engine.tuning import cores_per_rank, plan_threads, read_cpuinfo, usable_cores

    cores, why = cores_per_rank(None, usable_cores(), 1)
    plan = plan_threads(TuningConfig(), cores, why, cpu=read_cpuinfo())
    os.environ.update(plan.environment())
    import numpy as np

    from hpcdl.engine import nn
    from hpcdl.engine.optim import Adam
    from hpcdl.engine.step import make_train_step
    from hpcdl.engine.tuning import configure_tensorflow
    from hpcdl.workloads.hep.config import HepModelConfig
    from hpcdl.workloads.hep.model import HepCNN
    from hpcdl.workloads.hep.workload import WORKLOAD

    configure_tensorflow(plan)
    model = HepCNN(HepModelConfig(filters=args.filters), (args.image, args.image, 3), seed=0)
    variables = [v for _, v in model.named_variables()]
    optimizer = Adam(variables, 1e-3)
    parts = _variant_parts(model)

    def variant(dropout, bias, adam, wgrad, order, pool):
        m = copy.copy(model)
        if order == "pool_relu":
            m.__class__ = parts["PoolThenReluCNN"]
        if pool == "pairwise":
            m.__class__ = parts["PairwisePoolCNN"]
        if dropout == "bits16":
            m._dropout = parts["bits16"]
        if bias != "matmul_grad":
            m.convs = []
            for conv in model.convs:
                c = copy.copy(conv)
                c.__class__ = parts["BiasAddConv2D"] if bias == "bias_add" else parts["SumBiasGradConv2D"]
                m.convs.append(c)
        o = optimizer
        if adam == "fused":
            o = copy.copy(optimizer)
            o.__class__ = parts["FusedAdam"]

        step = make_train_step(lambda batch: WORKLOAD.loss(m, batch, training=True), variables, o)

        def run(batch):
            nn.set_conv_weight_grad(wgrad)  # read when the step is traced (its first call)
            return step(batch)[0]
        return run

    rng = np.random.default_rng(0)
    batch = (rng.random((args.batch, args.image, args.image, 3), dtype=np.float32),
             (np.arange(args.batch) % 2).astype(np.int32), np.ones(args.batch, np.float32))
    steps = {name: variant(**{**REFERENCE, **change}) for name, change in VARIANTS.items() if name in args.variants}
    return plan, model, steps, batch


def _variant_parts(model) -> dict:
    """The variants' pieces (after TensorFlow is configured): a 16-bit dropout mask, two bias
    forms, a fused Adam, and two orders of pooling and ReLU."""
    import tensorflow as tf

    from hpcdl.engine.nn import Conv2D
    from hpcdl.engine.optim import Adam
    from hpcdl.workloads.hep.model import HepCNN

    rate = model.config.dropout
    gen = tf.random.Generator.from_non_deterministic_state()
    threshold = round(rate * 65536)
    keep = 1.0 - threshold / 65536

    def bits16(x):
        n = tf.size(x)
        words = gen.uniform_full_int([(n + 1) // 2], dtype=tf.uint32)
        bits = tf.reshape(tf.bitcast(words, tf.uint16), [-1])[:n]
        return tf.where(tf.reshape(bits >= threshold, tf.shape(x)), x * (1.0 / keep), tf.zeros_like(x))

    class BiasAddConv2D(Conv2D):
        def __call__(self, x):
            with self.name_scope:
                return tf.nn.bias_add(tf.nn.conv2d(x, self.w, self.stride, "SAME"), self.b)

    class SumBiasGradConv2D(Conv2D):
        def __call__(self, x):
            with self.name_scope:
                return tf.nn.conv2d(x, self.w, self.stride, "SAME") + self.b

    class FusedAdam(Adam):
        def _apply(self, grads, variables):
            self.iterations.assign_add(1)
            t = tf.cast(self.iterations, tf.float32)
            for g, var, m, v in zip(grads, variables, self.m, self.v):
                tf.raw_ops.ResourceApplyAdam(var=var.handle, m=m.handle, v=v.handle, beta1_power=self.beta1 ** t,
                                             beta2_power=self.beta2 ** t, lr=self.learning_rate, beta1=self.beta1,
                                             beta2=self.beta2, epsilon=self.epsilon, grad=g)

    class PoolThenReluCNN(HepCNN):
        def __call__(self, x, training=False):
            pool = self.config.pool
            for conv in self.convs[:-1]:
                x = tf.nn.relu(tf.nn.max_pool2d(conv(x), pool, pool, "VALID"), name=f"{conv.name}_relu")
                if training and self.config.dropout > 0:
                    x = self._dropout(x)
            x = tf.nn.relu(self.convs[-1](x), name=f"{self.convs[-1].name}_relu")
            return self.head(tf.reduce_mean(x, axis=[1, 2]))

    @tf.custom_gradient
    def pairwise_max_pool(x):
        n, h, w, c = x.shape
        rows = tf.reshape(x, [n, h // 2, 2, w // 2, 2 * c])  # a window's two rows, its two columns side by side
        top, bottom = rows[:, :, 0], rows[:, :, 1]
        columns = tf.maximum(top, bottom)
        left, right = columns[..., :c], columns[..., c:]

        def grad(dy):
            to_left = left >= right
            zero = tf.zeros_like(dy)
            d_columns = tf.concat([tf.where(to_left, dy, zero), tf.where(to_left, zero, dy)], axis=-1)
            to_top = top >= bottom
            zero = tf.zeros_like(d_columns)
            return tf.reshape(tf.stack([tf.where(to_top, d_columns, zero), tf.where(to_top, zero, d_columns)], axis=2),
                              x.shape)
        return tf.maximum(left, right), grad

    class PairwisePoolCNN(HepCNN):
        def __call__(self, x, training=False):
            for conv in self.convs[:-1]:
                x = pairwise_max_pool(tf.nn.relu(conv(x), name=f"{conv.name}_relu"))
                if training and self.config.dropout > 0:
                    x = self._dropout(x)
            x = tf.nn.relu(self.convs[-1](x), name=f"{self.convs[-1].name}_relu")
            return self.head(tf.reduce_mean(x, axis=[1, 2]))

    return {"bits16": bits16, "BiasAddConv2D": BiasAddConv2D, "SumBiasGradConv2D": SumBiasGradConv2D,
            "FusedAdam": FusedAdam, "PoolThenReluCNN": PoolThenReluCNN, "PairwisePoolCNN": PairwisePoolCNN}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--filters", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or "reference" not in args.variants:
        ap.error(f"variants: known {', '.join(VARIANTS)} (reference is needed), got {args.variants}")
    from hpcdl.engine.tuning import read_cpuinfo, usable_cores

    cpu = read_cpuinfo()
    load_start = os.getloadavg()[0]
    plan, model, steps, batch = build(args)
    for fn in steps.values():  # tracing and oneDNN's primitive creation, twice
        fn(batch).numpy()
        fn(batch).numpy()
    times = {name: [] for name in steps}
    cpu_times = {name: [] for name in steps}
    names = list(steps)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            c, t = cpu_seconds(), time.perf_counter()
            steps[name](batch).numpy()
            times[name].append(time.perf_counter() - t)
            cpu_times[name].append(cpu_seconds() - c)
        print(f"[variants] round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names)
              + f" (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    flops = model.flops().training * args.batch
    ref = times["reference"]
    out = {"cpu": cpu.model, "isa": cpu.vector_isa, "bf16_unit": cpu.bf16_unit, "flags": " ".join(sorted(cpu.flags)),
           "cores": usable_cores(), "plan": plan.describe(), "image": args.image, "batch": args.batch,
           "filters": args.filters, "rounds": args.rounds, "load_start": load_start,
           "load_end": os.getloadavg()[0], "started": time.strftime("%Y-%m-%d %H:%M"), "variants": {}}
    lines = [f"HEP step {args.image}² batch {args.batch}: {cpu.model} ({cpu.vector_isa}), {usable_cores()} cores, "
             f"load {load_start:.1f} → {out['load_end']:.1f}; ratios to the reference, paired per round, of wall "
             "time and of this process's CPU time (the steadier one when other work shares the cores)",
             f"{'variant':<16} {'median s':>9} {'GFLOP/s':>8} {'wall ratio [min–max]':>24} {'CPU ratio [min–max]':>24}"]
    for name in names:
        ratios = [a / b for a, b in zip(times[name], ref)]
        cpu_ratios = [a / b for a, b in zip(cpu_times[name], cpu_times["reference"])]
        med = statistics.median(times[name])
        out["variants"][name] = {"choice": {**REFERENCE, **VARIANTS[name]},
                                 "seconds": times[name], "cpu_seconds": cpu_times[name], "ratios": ratios,
                                 "ratio_median": statistics.median(ratios), "cpu_ratios": cpu_ratios,
                                 "cpu_ratio_median": statistics.median(cpu_ratios),
                                 "gflops_best": flops / min(times[name]) / 1e9}
        lines.append(f"{name:<16} {med:9.2f} {flops / min(times[name]) / 1e9:8.1f} "
                     f"{statistics.median(ratios):9.3f} [{min(ratios):.3f}–{max(ratios):.3f}] "
                     f"{statistics.median(cpu_ratios):9.3f} [{min(cpu_ratios):.3f}–{max(cpu_ratios):.3f}]")
    out["table"] = "\n".join(lines)
    print(out["table"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
