"""Where the time of one HEP training step goes: TensorFlow's profiler, per op class, beside FLOPs.

The engine's step (the workload's loss, gradient tape, Horovod's DistributedGradientTape and
allreduce of one rank, hpcdl.engine.optim's Adam) on the paper's network at --image², set up as
hpcdl.engine.tuning would set up a rank, is traced with `tf.profiler.experimental` after warm-up steps.
The trace (XPlane) is read back and every TensorFlow op ("name:type" events of the executor's
threads) is put in a class: convolution forward / backward-input / backward-filter by layer,
pooling, ReLU and bias, dropout's random numbers and its mask, Adam's update, Horovod, the rest.
Each class's op time is shown as a share of all op time (with 2 inter-op threads, ops overlap:
the sum of op time can exceed the step's wall time) beside its share of the step's FLOPs, and
the convolutions' achieved GFLOP/s.

oneDNN reorders layouts inside its primitives (TensorFlow's native-format mode), so they are not
TensorFlow ops: `--onednn-verbose` runs the step again with ONEDNN_VERBOSE=1 and sums oneDNN's
own timings per primitive kind (convolution, reorder, pooling, eltwise, ...). That timing slows
the step a little; it is for the shares, not the speed.

Prints the table; `--json FILE` writes it with the CPU (model, ISA, flags) and the load average.
`make bench`'s profile section (bench.sections.profile) runs this module and puts its rows in the bench table.

    .venv/bin/python -m bench.profile_step --image 224 --batch 32
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

CLASSES = ("conv forward", "conv backward input", "conv backward filter", "pooling", "ReLU and bias",
           "dropout random numbers", "dropout mask", "Adam update", "Horovod", "loss and head", "other")


def classify(name: str, op_type: str) -> tuple[str, str]:
    """(class, layer) of one TensorFlow op from its name and type; layer is "" when it has none."""
    # grappler names a fused conv + bias + ReLU after its ReLU: HepCNN names those conv<i>_relu
    m = re.search(r"(?<![A-Za-z])(conv\d+|head)(?![0-9])", name)
    layer = m.group(1) if m else ""
    t = op_type
    if "Horovod" in t or "horovod" in name.lower() or "DistributedGradientTape" in name:
        return "Horovod", ""
    if name.startswith("adam/") or "/adam/" in name:
        return "Adam update", ""
    if "dropout" in name:
        if t.startswith("Random") or "Stateless" in t or "RngRead" in t or "Philox" in t:
            return "dropout random numbers", ""
        return "dropout mask", ""
    if "bias_grad" in name:  # hpcdl.engine.nn.bias_grad's matmul
        return "ReLU and bias", ""
    if "Conv2DBackpropInput" in t or ("Conv2D" in t and "BackpropInput" in name):
        return "conv backward input", layer
    if "Conv2DBackpropFilter" in t or "gemm_weight_grad" in name:  # or tuning.conv_weight_grad's matmuls
        return "conv backward filter", layer
    if "Conv2D" in t:  # Conv2D, _FusedConv2D, _MklNativeConv2D, _MklNativeFusedConv2D...
        return "conv forward", layer
    if "MaxPool" in t or "AvgPool" in t:
        return "pooling", ""
    if layer.startswith("conv") or "Relu" in t or "BiasAdd" in t:
        return "ReLU and bias", ""  # the bias add, its gradient (a Sum) and the ReLUs
    if layer == "head" or "softmax" in name.lower() or "Softmax" in t or "Mean" in t or "Sum" in t:
        return "loss and head", ""
    return "other", ""


def parse_xplane(path: str) -> list[tuple[str, str, float]]:
    """(op name, op type, seconds) of every TensorFlow op the executor ran, from one .xplane.pb."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(Path(path).read_bytes())
    ops = []
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            if line.name == "python":  # the eager side: function calls, not ops
                continue
            for event in line.events:
                label = plane.event_metadata[event.metadata_id].name
                name, sep, op_type = label.rpartition(":")
                if not sep or not name or "::" in label or op_type.endswith("PartitionedCall"):
                    continue  # executor bookkeeping (ExecutorState::Process, ParallelFor), or a call
                ops.append((name, op_type, event.duration_ps * 1e-12))
    return ops


def conv_flops(model, batch: int) -> dict[tuple[str, str], float]:
    """FLOPs of one step per (class, layer), by hpcdl.engine.nn's formulas (the bench's FLOP count)."""
    h, w, _ = model.image_shape
    out = {}
    for i, conv in enumerate(model.convs):
        fwd = conv.flops(h, w, needs_input_grad=False).forward * batch
        out[("conv forward", f"conv{i}")] = fwd
        out[("conv backward filter", f"conv{i}")] = fwd
        if i > 0:  # the first layer's input needs no gradient
            out[("conv backward input", f"conv{i}")] = fwd
        if i < len(model.convs) - 1:
            h, w = h // model.config.pool, w // model.config.pool
    out[("loss and head", "")] = model.head.flops().training * batch
    return out


ONEDNN_KINDS = ("convolution", "deconvolution", "reorder", "pooling", "eltwise", "binary", "matmul",
                "inner_product", "sum", "reduction", "batch_normalization", "softmax", "concat", "shuffle")


def parse_onednn_verbose(text: str) -> dict[str, dict[str, float]]:
    """oneDNN's `exec` lines summed per primitive kind and propagation: {kind/prop: {ms, calls}}."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
    for line in text.splitlines():
        if not line.startswith("onednn_verbose") or ",exec," not in line:
            continue
        fields = line.split(",")
        kind = next((f for f in fields if f in ONEDNN_KINDS), None)
        if kind is None:
            continue
        i = fields.index(kind)
        prop = fields[i + 2] if i + 2 < len(fields) else ""
        prop = prop if prop in ("forward_training", "forward_inference", "backward_data", "backward_weights",
                                "backward", "undef") else ""
        try:
            ms = float(fields[-1])
        except ValueError:
            continue
        key = f"{kind}/{prop}" if prop and prop != "undef" else kind
        out[key]["ms"] += ms
        out[key]["calls"] += 1
    return dict(out)


class Step:
    """The engine's training step in this process, TensorFlow set up like a rank's."""

    def __init__(self, args):
        from hpcdl.config import TuningConfig
        from hpcdl.engine.tuning import cores_per_rank, plan_threads, read_cpuinfo, usable_cores

        tuning = TuningConfig(intra_op_threads=args.intra, inter_op_threads=args.inter,
                              precision=args.precision)
        cores, why = cores_per_rank(None, usable_cores(), 1)
        # KEY=VALUE for an experiment, before TensorFlow loads and before the plan: an
        # ONEDNN_MAX_CPU_ISA changes the CPU the plan is made for
        experiment = dict(item.partition("=")[::2] for item in args.env)
        os.environ.update(experiment)
        self.plan = plan_threads(tuning, cores, why, cpu=read_cpuinfo())
        os.environ.update(self.plan.environment())
        os.environ.update(experiment)
        import numpy as np
        import tensorflow as tf

        from hpcdl.engine.optim import make_optimizer
        from hpcdl.engine.step import make_train_step
        from hpcdl.engine.tuning import compute_dtype, configure_tensorflow
        from hpcdl.workloads.hep.config import HepModelConfig
        from hpcdl.workloads.hep.model import HepCNN
        from hpcdl.workloads.hep.workload import WORKLOAD

        configure_tensorflow(self.plan)
        self.tf = tf
        comm = None
        if args.horovod:
            from hpcdl.engine.collective import join_group

            comm = join_group("gloo")  # one rank: its allreduce is a copy, but the ops and their cost are the engine's
        self.model = HepCNN(HepModelConfig(filters=args.filters), (args.image, args.image, 3), seed=0,
                            compute_dtype=compute_dtype(args.precision))
        model = self.model
        variables = [v for _, v in model.named_variables()]
        optimizer = make_optimizer("adam", variables, 1e-3)

        self.fn = make_train_step(lambda batch: WORKLOAD.loss(model, batch, training=True),
                                  variables, optimizer, comm)
        rng = np.random.default_rng(0)
        self.batch = (rng.random((args.batch, args.image, args.image, 3), dtype=np.float32),
                      (np.arange(args.batch) % 2).astype(np.int32), np.ones(args.batch, np.float32))

    def run(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            self.fn(self.batch)[0].numpy()
            out.append(time.perf_counter() - t)
        return out


def profile(args) -> dict:
    step = Step(args)
    tf = step.tf
    warm = step.run(args.warmup)
    logdir = tempfile.mkdtemp(prefix="hpcdl-profile-")
    tf.profiler.experimental.start(logdir)
    walls = step.run(args.steps)
    tf.profiler.experimental.stop()
    files = sorted(glob.glob(f"{logdir}/plugins/profile/*/*.xplane.pb"))
    if not files:
        raise RuntimeError(f"the profiler wrote no trace under {logdir}")
    ops = parse_xplane(files[-1])
    shutil.rmtree(logdir, ignore_errors=True)  # tens of MB per run; the table keeps what it says
    after = step.run(args.steps)  # the same steps unprofiled: the profiler's own cost
    per_class: dict[str, dict[str, float]] = {c: {"seconds": 0.0, "ops": 0} for c in CLASSES}
    by_layer: dict[tuple[str, str], float] = defaultdict(float)
    by_type: dict[str, float] = defaultdict(float)
    for name, op_type, seconds in ops:
        cls, layer = classify(name, op_type)
        per_class[cls]["seconds"] += seconds / args.steps
        per_class[cls]["ops"] += 1 / args.steps
        if cls.startswith("conv"):
            by_layer[(cls, layer)] += seconds / args.steps
        by_type[op_type] += seconds / args.steps
    flops = conv_flops(step.model, args.batch)
    total_flops = sum(flops.values())
    class_flops = defaultdict(float)
    for (cls, _layer), f in flops.items():
        class_flops[cls] += f
    op_total = sum(c["seconds"] for c in per_class.values())
    rows = []
    for cls in CLASSES:
        s = per_class[cls]["seconds"]
        rows.append({"class": cls, "layer": "", "seconds": s, "time_share": s / op_total,
                     "flop_share": class_flops.get(cls, 0.0) / total_flops,
                     "gflops": class_flops[cls] / s / 1e9 if class_flops.get(cls) and s else None})
        if cls.startswith("conv"):
            for (c, layer), ls in sorted(by_layer.items()):
                if c == cls:
                    f = flops.get((cls, layer), 0.0)
                    rows.append({"class": cls, "layer": layer, "seconds": ls, "time_share": ls / op_total,
                                 "flop_share": f / total_flops, "gflops": f / ls / 1e9 if f and ls else None})
    wall = min(walls)
    return {"rows": rows, "op_seconds_per_step": op_total, "step_seconds_profiled": walls,
            "step_seconds_unprofiled": after, "warmup_seconds": warm, "flops_per_step": total_flops,
            "op_types": dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
            "fused_conv": any("Fused" in t and "Conv" in t for t in by_type),
            "op_time_over_wall": op_total / wall, "plan": step.plan.describe(),
            "precision": args.precision, "env": args.env}


def onednn_verbose(args) -> dict:
    """The step under ONEDNN_VERBOSE=1: oneDNN's own primitive timings, reorders included."""
    os.environ["ONEDNN_VERBOSE"] = "1"
    step = Step(args)
    step.run(args.warmup)
    sys.stdout.flush()
    with tempfile.TemporaryFile("w+") as capture:
        saved = os.dup(1)
        os.dup2(capture.fileno(), 1)  # oneDNN prints from C to the process's stdout
        try:
            walls = step.run(args.steps)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        capture.seek(0)
        kinds = parse_onednn_verbose(capture.read())
    total = sum(k["ms"] for k in kinds.values())
    for k in kinds.values():
        k["ms"] /= args.steps
        k["calls"] /= args.steps
        k["share"] = k["ms"] * args.steps / total if total else 0.0
    return {"kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])),
            "onednn_ms_per_step": total / args.steps, "step_seconds": walls}


def render(result: dict) -> str:
    p = result["profile"]
    wall = min(p["step_seconds_unprofiled"])
    lines = [f"HEP step {result['image']}² batch {result['batch']}, {result['filters']} filters, "
             f"{result['precision']}: {wall:.2f} s unprofiled ({p['flops_per_step'] / wall / 1e9:.1f} GFLOP/s), "
             f"{min(p['step_seconds_profiled']):.2f} s profiled; op time {p['op_seconds_per_step']:.2f} s "
             f"= {p['op_time_over_wall']:.2f}× wall (2 inter-op threads overlap)",
             f"{result['cpu']} ({result['isa']}, bfloat16: {result['bf16_unit']}), {result['cores']} cores, "
             f"load {result['load_start']:.1f} → {result['load_end']:.1f}", "",
             f"{'op class':<24} {'layer':<6} {'ms/step':>8} {'time':>6} {'FLOPs':>6} {'GFLOP/s':>8}"]
    for r in p["rows"]:
        g = f"{r['gflops']:.1f}" if r["gflops"] else ""
        indent = "  " if r["layer"] else ""
        if r["seconds"] == 0 and not r["flop_share"]:
            continue
        lines.append(f"{indent + r['class']:<24} {r['layer']:<6} {1e3 * r['seconds']:8.1f} "
                     f"{100 * r['time_share']:5.1f}% {100 * r['flop_share']:5.1f}% {g:>8}")
    v = result.get("onednn")
    if v:
        lines += ["", f"oneDNN primitives (ONEDNN_VERBOSE, {v['onednn_ms_per_step']:.0f} ms/step of "
                      f"{1e3 * min(v['step_seconds']):.0f} ms wall):"]
        for kind, k in v["kinds"].items():
            lines.append(f"  {kind:<32} {k['ms']:8.1f} ms {100 * k['share']:5.1f}%  {k['calls']:.0f} calls")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--filters", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (averaged)")
    ap.add_argument("--intra", type=int, default=0)
    ap.add_argument("--inter", type=int, default=0)
    ap.add_argument("--precision", default="float32")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE set before TensorFlow loads")
    ap.add_argument("--no-horovod", dest="horovod", action="store_false")
    ap.add_argument("--onednn-verbose", action="store_true", help="(internal) the oneDNN-timings run")
    ap.add_argument("--no-onednn", dest="onednn", action="store_false", help="skip the oneDNN-timings run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.onednn_verbose:  # a child: print its JSON on the real stdout
        print("@@ " + json.dumps(onednn_verbose(args)))
        return 0
    from hpcdl.engine.tuning import read_cpuinfo, usable_cores

    cpu = read_cpuinfo()
    result = {"cpu": cpu.model, "isa": cpu.vector_isa, "bf16_unit": cpu.bf16_unit,
              "flags": " ".join(sorted(cpu.flags)), "cores": usable_cores(), "image": args.image,
              "batch": args.batch, "filters": args.filters, "precision": args.precision,
              "load_start": os.getloadavg()[0], "started": time.strftime("%Y-%m-%d %H:%M")}
    if args.onednn:  # first, in its own process: ONEDNN_VERBOSE is read once per process
        import subprocess

        cmd = [sys.executable, __file__, "--onednn-verbose", *sys.argv[1:]] if argv is None else \
              [sys.executable, __file__, "--onednn-verbose", *argv]
        cmd = [c for c in cmd if not c.startswith("--json")]
        if args.json:
            cmd = [c for c in cmd if c != str(args.json)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        found = [line[3:] for line in out.stdout.splitlines() if line.startswith("@@ ")]
        result["onednn"] = json.loads(found[-1]) if found else {"error": out.stderr[-500:]}
        if not found:
            result.pop("onednn")
            print(f"profile_step: the oneDNN-timings run failed: {out.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)
    result["profile"] = profile(args)
    result["load_end"] = os.getloadavg()[0]
    result["table"] = render(result)
    print(result["table"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
