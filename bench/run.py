#!/usr/bin/env python
"""hpcdl's benchmark suite: `make bench` prints one table of figures measured in the same run.

Sections (each skippable: `--only sgemm,step`; `--skip hybrid`):

sgemm      the machine's float32 matrix-multiply peak: numpy (OpenBLAS) on 4096² matrices, best of
           several samples of ≥ 2 s each (the time scale of a training step), interleaved with the
           step below; TensorFlow's own matmul (oneDNN) beside it. The denominator of every ratio
           is the best of either seen anywhere in this run.
step       the HEP network of the paper (5 convolutions of 128 3×3 filters) at 224×224, batch 32,
           one rank set up exactly as hpcdl's tuning would set it up: FLOP/s of one training step
           (the engine's step minus Horovod), best and median of interleaved rounds; its ratio to
           the sgemm peak (goal ≥ 0.7). Also tuning.precision = mixed_bfloat16's step (its
           speed-up reported only where the CPU has a bfloat16 unit).
profile    where one HEP step's time goes (bench/profile_step.py, TensorFlow's profiler and oneDNN's
           own timings): per op class — convolution forward / backward by layer, pooling, ReLU and
           bias, dropout's random numbers and mask, Adam, Horovod — its share of op time beside
           its share of FLOPs; layout reorders from oneDNN.
tuning     oneDNN on/off, inter-op 1 vs 2, intra-op 1 vs all cores, batch 16 vs 32: each variant
           in its own process (oneDNN and the pools are fixed when TensorFlow loads), its steps
           interleaved with the default configuration's, reported as a ratio to it.
layout     ranks per node × threads per rank on this node's CPUs: one rank on all of them, two on
           halves, one per NUMA domain (where there are several); each rank a process pinned to
           its CPUs and planned by hpcdl's tuning for them, the node's batch shared by its ranks,
           their steps run at once; images/s of the node, rounds alternating, as a ratio to one
           rank (the allreduce between them is left out: milliseconds against seconds of step).
sustained  a real `hpcdl submit hep --backend local --nodes 1` on a generated 224×224 set: the
           engine's own sustained FLOP/s (data loading, Horovod, logging, first-step tracing
           included) over a short run, and its ratio to the peak (goal ≥ 0.6).
reader     the HDF5 reader's images/s (the job's chunking and prefetch) beside what training
           consumes (goal ≥ 10×).
exchange   update files (the HEP gradient, HMAC-signed, fsynced) written and read, MB/s, beside
           `dd` on the same disk; the time a group spends publishing/adopting as a share of its
           wall time, from hybrid runs' metrics (exchange_seconds); that cost against the 224×224
           step; bench/exchange_load.py's applier figures if that script is present.
hybrid     bench/hybrid_race.py --quick on scenarios a and b (8 ranks as 1×8 synchronous and as
           hybrid groups, emulated stragglers, time to validation AUC 0.90): its table's rows.
allreduce  Horovod's allreduce of the HEP gradient (2.38 MB) inside a 4-rank group on this machine,
           Gloo beside MPI (Open MPI over TCP loopback, like Gloo, and over its default shared
           memory), each round a fresh group per controller, rounds alternating (bench/allreduce.py).
           Loopback: this compares the controllers' software overheads, not networks.
plan       the scale planner fed this run's measured node rate and exchange bandwidth.

The machine is shared and noisy: measurements that are compared are taken side by side, in
alternating rounds; best and median are printed, with the load average. Results go to
bench/results/<date>.json (`--compare FILE|latest` adds the figures of an earlier run).
Generated data sets are cached under --work (default /tmp/hpcdl-bench).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
BENCH = REPO / "bench"
PROBE = BENCH / "probe.py"
RESULTS = BENCH / "results"
HPCDL = str(Path(sys.executable).with_name("hpcdl"))

SECTIONS = ("sgemm", "step", "profile", "tuning", "layout", "sustained", "reader", "exchange", "hybrid", "allreduce", "plan")
GOALS = {"step": 0.7, "sustained": 0.6, "reader": 10.0}


class BenchError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def best(xs):
    return max(xs) if xs else None


def median(xs):
    return statistics.median(xs) if xs else None


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def mem_available_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024 ** 2
    except OSError:
        pass
    return float("inf")


def gf(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.1f} GFLOP/s"


# -- a measuring process ----------------------------------------------------------------------


class Probe:
    """bench/probe.py in its own process, answering JSON commands."""

    def __init__(self, name: str, args: list[str], logdir: Path, timeout: float = 900.0):
        self.name = name
        self.timeout = timeout
        self.stderr = open(logdir / f"probe-{name}.log", "w")
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self.proc = subprocess.Popen([sys.executable, str(PROBE), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(f"probe {self.name}: no answer in {self.timeout:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 5.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise BenchError(f"probe {self.name} died (exit {self.proc.returncode}); see {self.stderr.name}")
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise BenchError(f"probe {self.name} died (exit {self.proc.wait()}); see {self.stderr.name}")
            if line.startswith("@@ "):
                out = json.loads(line[3:])
                if out.get("ok") is False:
                    raise BenchError(f"probe {self.name}: {out['error']}\n{out.get('trace', '')}")
                return out

    def send(self, **cmd) -> None:
        """A command without waiting for its answer (receive() reads it): several probes at once."""
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        return self._read()

    def ask(self, **cmd) -> dict:
        self.send(**cmd)
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


# -- the results ------------------------------------------------------------------------------


@dataclass
class Row:
    key: str  # stable across runs, for --compare
    section: str
    what: str
    value: str
    ratio: str = ""
    note: str = ""
    number: float | None = None  # the figure compared across runs


@dataclass
class Bench:
    args: argparse.Namespace
    work: Path
    logdir: Path
    rows: list[Row] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    sgemm: list[float] = field(default_factory=list)  # every numpy sgemm FLOP/s measured
    tf_mm: list[float] = field(default_factory=list)  # every TensorFlow float32 matmul FLOP/s
    tf_default: Probe | None = None
    numpy: Probe | None = None

    def row(self, key, section, what, value, ratio="", note="", number=None) -> None:
        self.rows.append(Row(key, section, what, value, ratio, note, number))
        log(f"{section}: {what}: {value} {ratio} {note}".rstrip())

    @property
    def peak(self) -> float | None:
        """The better of numpy's sgemm and TensorFlow's float32 matmul: the stricter denominator."""
        return best(self.sgemm + self.tf_mm)

    def peak_ratio(self, flops: float | None) -> str:
        if flops is None or not self.peak:
            return ""
        return f"{flops / self.peak:.2f} of peak"

    # -- probes -----------------------------------------------------------------------------

    def numpy_probe(self) -> Probe:
        if self.numpy is None:
            self.numpy = Probe("numpy", ["--role", "numpy"], self.logdir)
            self.data["numpy"] = self.numpy.info
        return self.numpy

    def sgemm_sample(self, reps: int = 2) -> float:
        out = self.numpy_probe().ask(op="sgemm", n=self.args.sgemm_n, reps=reps,
                                     min_seconds=self.args.peak_seconds)
        rates = [out["flops"] / s for s in out["seconds"]]
        self.sgemm.extend(rates)
        return max(rates)

    def tf_probe(self) -> Probe:
        if self.tf_default is None:
            self.tf_default = Probe("tf-default", ["--role", "tf", "--image", "224"], self.logdir)
            self.data["tf_default"] = self.tf_default.info
        return self.tf_default

    def close_tf(self) -> None:
        if self.tf_default is not None:
            self.tf_default.close()
            self.tf_default = None

    def close(self) -> None:
        self.close_tf()
        if self.numpy is not None:
            self.numpy.close()
            self.numpy = None


# -- sections ---------------------------------------------------------------------------------


def section_sgemm_step(b: Bench, do_sgemm: bool, do_step: bool) -> None:
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
          f"goal ≥ {GOALS['step']}{' met' if ratio >= GOALS['step'] else ' NOT met'}; median "
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


def section_profile(b: Bench) -> None:
    """bench/profile_step.py in its own process (the profiler and ONEDNN_VERBOSE are per process)."""
    b.close_tf()  # memory, and no other TensorFlow process of ours competes with the profile
    out = b.work / "profile.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(BENCH / "profile_step.py"), "--batch", str(b.args.batch), "--json", str(out)]
    if b.args.quick:
        cmd += ["--image", "64", "--warmup", "1", "--steps", "1"]
    with open(b.logdir / "profile_step.log", "w") as log_file:
        proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0 or not out.is_file():
        raise BenchError(f"profile_step.py failed ({proc.returncode}); see {b.logdir / 'profile_step.log'}")
    result = json.loads(out.read_text())
    b.data["profile"] = result
    p = result["profile"]
    wall = min(p["step_seconds_unprofiled"])
    for r in p["rows"]:
        if r["layer"] or (r["seconds"] == 0 and not r["flop_share"]):
            continue
        rate = f"; {r['gflops']:.1f} GFLOP/s" if r["gflops"] else ""
        b.row(f"profile.{r['class'].replace(' ', '_')}", "profile", f"{r['class']} (share of op time)",
              f"{100 * r['time_share']:.1f} %", f"{100 * r['flop_share']:.1f} % of FLOPs",
              f"{1e3 * r['seconds']:.0f} ms/step{rate}", number=r["time_share"])
    reorder = result.get("onednn", {}).get("kinds", {}).get("reorder")
    if reorder:
        b.row("profile.reorder", "profile", "oneDNN layout reorders (share of oneDNN time)",
              f"{100 * reorder['share']:.1f} %", "", f"{reorder['ms']:.0f} ms/step, {reorder['calls']:.0f} calls",
              number=reorder["share"])
    b.row("profile.step", "profile", f"the profiled step ({result['image']}², batch {result['batch']})",
          f"{wall:.2f} s", "", f"op time {p['op_time_over_wall']:.2f}× wall (ops overlap on 2 inter-op "
          f"threads); conv+bias+ReLU fused: {'yes' if p['fused_conv'] else 'no'}", number=wall)


TUNING_VARIANTS = (
    ("onednn_off", "oneDNN off (Eigen)", ["--onednn", "0"]),
    ("inter1", "inter-op 1", ["--inter", "1"]),
    ("intra1", "intra-op 1", ["--intra", "1"]),
)


def weight_grad_variant() -> tuple[str, str, list[str]]:
    """The convolutions' weight gradient that tuning.conv_weight_grad = "auto" does not take here."""
    from hpcdl.config import TuningConfig
    from hpcdl.engine.tuning import plan_conv_weight_grad, read_cpuinfo

    mine, _ = plan_conv_weight_grad(TuningConfig(), read_cpuinfo())
    other = "tensorflow" if mine == "gemm" else "gemm"
    return "weight_grad", f"conv weight gradient {other} (auto: {mine})", ["--conv-weight-grad", other]


def section_tuning(b: Bench) -> None:
    batch = b.args.tuning_batch
    rounds = b.args.rounds
    tf = b.tf_probe()
    res = b.data.setdefault("tuning", {"batch": batch})
    tf.ask(op="setup", batches=[batch], precisions=["float32"])
    # batch 16 vs 32 in the default process
    if b.data.get("step", {}).get("step_flops"):
        small = []
        for _ in range(rounds):
            st = tf.ask(op="step", batch=batch, precision="float32", n=1)
            small.extend(st["flops"] / s for s in st["seconds"])
            big = tf.ask(op="step", batch=b.args.batch, precision="float32", n=1)
            b.data["step"]["step_flops"].extend(big["flops"] / s for s in big["seconds"])
        res["batch_small"] = small
        ref = best(b.data["step"]["step_flops"])
        b.row(f"tuning.batch{batch}", "tuning", f"batch {batch} instead of {b.args.batch}", gf(best(small)),
              f"{best(small) / ref:.2f}x default", f"median {gf(median(small))}", number=best(small) / ref)
    for key, label, extra in TUNING_VARIANTS + (weight_grad_variant(),):
        if mem_available_gb() < 3.0:
            b.row(f"tuning.{key}", "tuning", label, "skipped", "", f"only {mem_available_gb():.1f} GB free")
            continue
        log(f"tuning: {label}: starting its process")
        try:
            probe = Probe(f"tf-{key}", ["--role", "tf", "--image", "224", *extra], b.logdir)
        except BenchError as exc:
            b.row(f"tuning.{key}", "tuning", label, "failed", "", str(exc)[:80])
            continue
        try:
            probe.ask(op="setup", batches=[batch], precisions=["float32"])
            mine, ref, share_mine, share_ref = [], [], [], []
            for r in range(rounds):
                pair = [(probe, mine, share_mine), (tf, ref, share_ref)]
                for p, into, shares in (pair if r % 2 == 0 else pair[::-1]):
                    st = p.ask(op="step", batch=batch, precision="float32", n=1)
                    into.extend(st["flops"] / s for s in st["seconds"])
                    shares.extend(st["cpu_share"])
            res[key] = {"variant": mine, "default": ref, "info": probe.info,
                        "cpu_share_variant": share_mine, "cpu_share_default": share_ref}
            b.row(f"tuning.{key}", "tuning", f"{label} (intra {probe.info['intra_op']}, inter "
                  f"{probe.info['inter_op']}), batch {batch}", gf(best(mine)),
                  f"{best(mine) / best(ref):.2f}x default",
                  f"default {gf(best(ref))} alongside; median ratio {median(mine) / median(ref):.2f}; "
                  f"CPU share {median(share_mine):.0%} vs {median(share_ref):.0%}",
                  number=best(mine) / best(ref))
        finally:
            probe.close()


def section_layout(b: Bench) -> None:
    from hpcdl.engine.tuning import numa_domains, rank_layouts

    cpus = sorted(os.sched_getaffinity(0))
    layouts = rank_layouts(cpus, numa_domains())
    node_batch, rounds = b.args.batch, b.args.rounds
    res = b.data.setdefault("layout", {"node_batch": node_batch, "cpus": cpus, "layouts": {}})
    running: dict[str, list[Probe]] = {}
    try:
        for name, cpu_sets in layouts.items():
            if mem_available_gb() < 3.0 * len(cpu_sets):
                b.row(f"layout.{name}", "layout", f"{name} ranks × threads", "skipped", "",
                      f"only {mem_available_gb():.1f} GB free")
                continue
            log(f"layout: {name}: starting {len(cpu_sets)} rank process(es)")
            batch = max(1, node_batch // len(cpu_sets))
            ranks = [Probe(f"tf-layout-{len(cpu_sets)}r{i}", ["--role", "tf", "--image", "224",
                                                                 "--cpus", ",".join(map(str, c))], b.logdir)
                     for i, c in enumerate(cpu_sets)]
            running[name] = ranks
            for rank in ranks:
                rank.send(op="setup", batches=[batch], precisions=["float32"])
            for rank in ranks:
                rank.receive()
            res["layouts"][name] = {"cpus": cpu_sets, "batch_per_rank": batch, "images_per_s": [],
                                    "plans": [r.info["plan"] for r in ranks]}
        names = list(running)
        if not names:
            return
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                ranks, entry = running[name], res["layouts"][name]
                t = time.perf_counter()
                for rank in ranks:
                    rank.send(op="step", batch=entry["batch_per_rank"], precision="float32", n=1)
                for rank in ranks:
                    rank.receive()
                entry["images_per_s"].append(entry["batch_per_rank"] * len(ranks) / (time.perf_counter() - t))
            log(f"layout: round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {res['layouts'][n]['images_per_s'][-1]:.1f} img/s" for n in names))
    finally:
        for ranks in running.values():
            for rank in ranks:
                rank.close()
    one = res["layouts"][names[0]]["images_per_s"]
    for name in names:
        entry = res["layouts"][name]
        rates = entry["images_per_s"]
        paired = [a / c for a, c in zip(rates, one)]
        b.row(f"layout.{name.split()[0]}", "layout",
              f"{name} ranks × threads, batch {entry['batch_per_rank']} per rank", f"{best(rates):.1f} img/s",
              f"{median(paired):.2f}x one rank" if name != names[0] else "reference",
              f"median {median(rates):.1f} img/s; paired ratios {min(paired):.2f}–{max(paired):.2f}; "
              f"CPUs {' | '.join(','.join(map(str, c)) for c in entry['cpus'])}", number=median(paired))


def generated(b: Bench, events: int, size: int) -> dict[str, Path]:
    """A generated HEP set, cached under --work (the generator is deterministic)."""
    from hpcdl.workloads.hep.generate import GENERATOR_VERSION, generate

    out = b.work / "data" / f"hep-v{GENERATOR_VERSION}-e{events}-s{size}"
    files = {k: out / f"{k}.h5" for k in ("train", "val", "test")}
    if all(p.is_file() for p in files.values()):
        return files
    log(f"generating {events} HEP events at {size}x{size} into {out} (cached for later runs)")
    t = time.perf_counter()
    generate(out, events, image_size=size, seed=0)
    b.data.setdefault("generated", {})[out.name] = time.perf_counter() - t
    return files


def data_sets(files: dict[str, Path]) -> list[str]:
    return [f'data.{k}="{v}"' for k, v in files.items()]


def submit(b: Bench, name: str, overrides: list[str], nodes: int = 1, group_size: int = 0,
           env: dict[str, str] | None = None, watch=None) -> tuple[Path | None, float, subprocess.CompletedProcess]:
    """Run `hpcdl submit` in the foreground; returns (run dir, start time, process)."""
    runs = b.work / "runs" / name
    runs.mkdir(parents=True, exist_ok=True)
    before = set(runs.iterdir())
    cmd = [HPCDL, "submit", "hep", "--backend", "local", "--nodes", str(nodes), "--group-size",
           str(group_size), "--json", "--runs-dir", str(runs)]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.time()
    errfile = b.logdir / f"submit-{name}.err"
    with open(errfile, "w") as err:
        proc = subprocess.Popen(cmd, cwd=b.work, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, **(env or {})})
    run_dir = None
    out_chunks: list[str] = []
    reader = threading.Thread(target=lambda: out_chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        if run_dir is None:
            new = [p for p in runs.iterdir() if p not in before and not p.name.startswith(".")]
            run_dir = new[0] if new else None
        if run_dir is not None and watch is not None:
            watch(run_dir)
        time.sleep(0.25)
    reader.join(timeout=10)
    stderr = errfile.read_text(errors="replace")
    if run_dir is None:
        new = [p for p in runs.iterdir() if p not in before and not p.name.startswith(".")]
        run_dir = new[0] if new else None
    return run_dir, t0, subprocess.CompletedProcess(cmd, proc.returncode, "".join(out_chunks), stderr)


class CpuTracker:
    """CPU seconds used by a run's processes (those whose command line names the run directory),
    sampled from /proc while the run goes: how much of the machine the run actually got."""

    def __init__(self):
        self.seen: dict[int, float] = {}
        self.tick = os.sysconf("SC_CLK_TCK")

    def __call__(self, run_dir: Path) -> None:
        needle = str(run_dir).encode()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if needle not in Path(entry.path, "cmdline").read_bytes():
                    continue
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime
            except (OSError, IndexError, ValueError):
                continue
            pid = int(entry.name)
            self.seen[pid] = max(self.seen.get(pid, 0.0), cpu)

    @property
    def seconds(self) -> float:
        return sum(self.seen.values())


def metrics(run_dir: Path, group: int = 0) -> list[dict]:
    path = run_dir / "groups" / str(group) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def section_sustained(b: Bench) -> None:
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
    rank_log = (run_dir / "groups" / "0" / "rank0.log").read_text(errors="replace")
    plan_line = next((l for l in rank_log.splitlines() if "threads:" in l), "")
    b.data[key] = {"metrics": lines, "wall_s": wall, "load_start": load, "plan": plan_line,
                   "cpu_seconds": cpu.seconds, "cpu_share": share,
                   "images_per_s_best": max(m["images_per_s"] for m in lines)}
    sustained = last["sustained_flops_per_s_group"]
    if precision == "float32":
        ok = b.peak and sustained / b.peak >= GOALS["sustained"]
        what = (f"hpcdl submit, 1 rank, {steps} steps × {batch} at 224², data + Horovod, "
                "first-step tracing included")
        note = (f"goal ≥ {GOALS['sustained']}{' met' if ok else ' NOT met' if b.peak else ''} "
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


def section_reader(b: Bench) -> None:
    from hpcdl.workloads.hep import data as hepdata
    from hpcdl.workloads.hep.normalization import Normalization

    files = generated(b, b.args.sustained_events, 224)
    norm = Normalization.from_file(files["train"])
    rates = []
    for _ in range(2):
        it = hepdata.iter_batches(files["train"], b.args.batch, norm=norm, shuffle=True, seed=1,
                                  chunk_events=256, prefetch=2)
        next(it)
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < b.args.reader_seconds:
            n += len(next(it).y)
        rates.append(n / (time.perf_counter() - t))
        it.close()
    consumption = [v for v in (b.data.get("sustained", {}).get("images_per_s_best"),
                               b.data.get("sustained_bfloat16", {}).get("images_per_s_best"),
                               b.data.get("step", {}).get("images_per_s_best")) if v]
    need = max(consumption) if consumption else None
    b.data["reader"] = {"images_per_s": rates, "training_images_per_s": need}
    ratio = f"{best(rates) / need:.0f}x training" if need else ""
    note = (f"goal ≥ {GOALS['reader']:.0f}x{' met' if need and best(rates) / need >= GOALS['reader'] else ' NOT met'}; "
            f"training takes {need:.2f} img/s (its best)" if need else "no training figure in this run")
    b.row("reader", "reader", "HDF5 reader 224² (chunk 256, prefetch 2, shuffled, normalised)",
          f"{best(rates):.0f} img/s", ratio, note, number=best(rates))


def hep_gradient(params_seed: int = 0) -> dict:
    """Tensors shaped like the HEP network's variables (594,178 float32, 2.38 MB)."""
    import numpy as np

    from hpcdl.workloads.hep.config import HepModelConfig

    c = HepModelConfig()
    rng = np.random.default_rng(params_seed)
    chans = [3] + [c.filters] * c.conv_layers
    out = {}
    for i in range(c.conv_layers):
        out[f"convs{i}/w"] = rng.standard_normal((c.kernel, c.kernel, chans[i], chans[i + 1]), dtype=np.float32)
        out[f"convs{i}/b"] = rng.standard_normal(chans[i + 1], dtype=np.float32)
    out["head/w"] = rng.standard_normal((c.filters, 2), dtype=np.float32)
    out["head/b"] = rng.standard_normal(2, dtype=np.float32)
    return out


def dd(args: list[str]) -> float:
    """Bytes/s that dd reports."""
    p = subprocess.run(["dd", *args], capture_output=True, text=True)
    m = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", p.stderr)
    if p.returncode != 0 or not m:
        raise BenchError(f"dd {' '.join(args)} failed: {p.stderr.strip()[-300:]}")
    return int(m.group(1)) / float(m.group(2))


def section_exchange_files(b: Bench) -> None:
    import secrets as _secrets

    from hpcdl.exchange import Channel, Signer

    root = b.work / "exchange-bw"
    shutil.rmtree(root, ignore_errors=True)
    grads = hep_gradient()
    nbytes = sum(v.nbytes for v in grads.values())
    channel = Channel(root / "x", "bench", signer=Signer(_secrets.token_bytes(32)))
    n = b.args.exchange_files
    t = time.perf_counter()
    for seq in range(n):
        channel.publish_update(0, seq, -1, grads)
    write = n * nbytes / (time.perf_counter() - t)
    refs = channel.pending_updates()
    t = time.perf_counter()
    for ref in refs:
        channel.read_update(ref)
    read = len(refs) * nbytes / (time.perf_counter() - t)
    size_mb = max(64, int(2 * n * nbytes / 2 ** 20))
    target = root / "dd.tmp"
    dd_write = dd(["if=/dev/zero", f"of={target}", "bs=1M", f"count={size_mb}", "conv=fsync"])
    dd_read = dd([f"if={target}", "of=/dev/null", "bs=1M"])
    try:
        dd_direct = dd([f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])
    except BenchError:
        dd_direct = None
    shutil.rmtree(root, ignore_errors=True)
    b.data["exchange_files"] = {"update_bytes": nbytes, "files": n, "write_Bps": write, "read_Bps": read,
                                "dd_write_Bps": dd_write, "dd_read_cached_Bps": dd_read,
                                "dd_read_direct_Bps": dd_direct, "dir": str(root)}
    mb = lambda x: f"{x / 1e6:.0f} MB/s"  # noqa: E731
    b.row("exchange.write", "exchange", f"update files written ({nbytes / 1e6:.2f} MB, HMAC, fsync) ×{n}",
          mb(write), f"{write / dd_write:.2f}x dd", f"dd write (fsync) {mb(dd_write)}, same disk",
          number=write)
    b.row("exchange.read", "exchange", "update files read and verified", mb(read),
          f"{read / dd_read:.2f}x dd", f"dd read {mb(dd_read)} (page cache, like the updates)"
          + (f"; {mb(dd_direct)} O_DIRECT" if dd_direct else ""), number=read)


def exchange_overhead(lines: list[dict]) -> dict | None:
    """Share of a group's wall time spent in publish/adopt, between its first and last metrics."""
    xs = [m for m in lines if "exchange_seconds" in m]
    if len(xs) < 2:
        return None
    first, last = xs[0], xs[-1]
    dt = last["time"] - first["time"]
    if dt <= 0:
        return None
    published = last.get("exchange_published", 0) - first.get("exchange_published", 0)
    spent = last["exchange_seconds"] - first["exchange_seconds"]
    return {"share": spent / dt, "seconds": spent, "wall": dt, "published": published,
            "per_exchange_s": spent / published if published else None,
            "step_time_s": statistics.median(m["step_time_s"] for m in xs[1:])}


def section_exchange_overhead(b: Bench) -> None:
    # a short 2-group run of its own, not paced by the emulator
    files = generated(b, b.args.hybrid_events, 32)
    run_dir, _t0, proc = submit(b, "exchange", [
        *data_sets(files), f"train.steps={b.args.exchange_steps}", "train.batch_per_rank=8",
        "train.log_every=10", f"train.checkpoint_every={b.args.exchange_steps}", "data.chunk_events=512",
    ], nodes=2, group_size=1)
    if proc.returncode != 0 or run_dir is None:
        raise BenchError(f"exchange run failed: {proc.stderr[-2000:]}")
    per_group = [exchange_overhead(metrics(run_dir, g)) for g in range(2)]
    found = {"2x1": [o for o in per_group if o]}
    shutil.rmtree(run_dir, ignore_errors=True)
    b.data["exchange_overhead"] = found
    step224 = None
    st = b.data.get("step", {}).get("step_flops")
    if st:
        step224 = b.data["tf_default"]["flops_per_example"] * b.args.batch / best(st)
    for name, groups in found.items():
        shares = [g["share"] for g in groups]
        per = [g["per_exchange_s"] for g in groups if g["per_exchange_s"]]
        steps = [g["step_time_s"] for g in groups]
        note = (f"{1e3 * median(per):.0f} ms per publish+adopt, group step {1e3 * median(steps):.0f} ms"
                if per else "")
        if per and step224:
            note += f"; = {100 * median(per) / step224:.2f} % of a 224² batch-{b.args.batch} step"
        b.row(f"exchange.overhead.{name}", "exchange", f"group time in publish/adopt, {name} run (32², HEP net)",
              f"{100 * median(shares):.1f} %", "", note, number=median(shares))


def section_exchange_load(b: Bench) -> None:
    """bench/exchange_load.py (another engineer's load test), if present: its applier figures."""
    script = BENCH / "exchange_load.py"
    if not script.is_file() or b.args.no_exchange_load:
        return
    out = b.work / "exchange_load.json"
    out.unlink(missing_ok=True)
    where = b.work / "exchange-load"
    where.mkdir(parents=True, exist_ok=True)
    groups, seconds = 4, 10
    log(f"exchange: bench/exchange_load.py, {groups} simulated groups for {seconds} s")
    p = subprocess.run([sys.executable, str(script), "--groups", str(groups), "--seconds", str(seconds),
                        "--sizes", "594178", "--shards", "1", "--drain", "20", "--dir", str(where),
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    shutil.rmtree(where, ignore_errors=True)
    if not out.is_file():
        b.row("exchange.load", "exchange", "bench/exchange_load.py", "failed", "",
              (p.stderr.strip().splitlines() or ["?"])[-1][:100])
        return
    result = json.loads(out.read_text())
    entry = result[0] if isinstance(result, list) and result else {}
    b.data["exchange_load"] = result
    cpu_ms = entry.get("applier_cpu_ms_per_update")
    if not cpu_ms:
        b.row("exchange.load", "exchange", "bench/exchange_load.py", "see JSON")
        return
    b.row("exchange.load", "exchange", f"applier on HEP-size updates (bench/exchange_load.py, {groups} groups)",
          f"{cpu_ms:.1f} ms CPU/update", f"≈{1e3 / cpu_ms:.0f} updates/s per core",
          f"offered {entry.get('offered_per_s', 0):.0f}/s, applied {entry.get('applied_per_s', 0):.0f}/s, "
          f"publish {entry.get('publish_ms_mean', 0):.0f} ms, ledger "
          f"{'OK' if entry.get('ledger', {}).get('ok') else 'FAILED'}", number=cpu_ms)


def section_hybrid(b: Bench) -> None:
    """The race (bench/hybrid_race.py), one seed of scenarios a and b, read back from its JSON."""
    before = set(RESULTS.glob("race-*.json"))
    cmd = [sys.executable, str(BENCH / "hybrid_race.py"), "--quick", "--scenarios", "a,b",
           "--work", str(b.work / "race")]
    with open(b.logdir / "hybrid_race.log", "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    new = sorted(set(RESULTS.glob("race-*.json")) - before)
    if proc.returncode != 0 or not new:
        raise BenchError(f"hybrid_race.py failed ({proc.returncode}); see {b.logdir / 'hybrid_race.log'}")
    race = json.loads(new[-1].read_text())
    b.data["hybrid"] = {"race_file": str(new[-1]), "summary": race["summary"]}
    for sc, entry in race["summary"].items():
        for name, e in entry["configs"].items():
            t = e["time_to_target_s"]
            value = f"{t:.0f} s" if t else f"not reached (best {e['best_auc']:.3f})"
            ratio = f"{e['ratio_to_sync']:.2f}× sync" if e["ratio_to_sync"] else ""
            b.row(f"hybrid.{sc}.{name}", "hybrid", f"({sc}) {entry['scenario']}: {name}, time to AUC "
                  f"{race['target_auc']}", value, ratio, "emulated stragglers, 1 seed", number=t)


ALLREDUCE_RANKS = 4
# name -> (controller, extra environment, what the row says)
ALLREDUCE_CONFIGS = {
    "gloo": ("gloo", {}, "Gloo (TCP loopback)"),
    "mpi_tcp": ("mpi", {"OMPI_MCA_btl": "self,tcp"}, "MPI, Open MPI over TCP loopback"),
    "mpi": ("mpi", {}, "MPI, Open MPI's default transport (shared memory)"),
}


def allreduce_round(b: Bench, name: str, reps: int) -> list[float]:
    """One fresh 4-rank group of bench/allreduce.py under one controller: rank 0's timings."""
    from hpcdl.launch import find_mpi_launcher, local_group, start_rendezvous, worker_environ

    controller, extra, _ = ALLREDUCE_CONFIGS[name]
    argv = [sys.executable, str(BENCH / "allreduce.py"), "--reps", str(reps)]
    envs = local_group(0, ALLREDUCE_RANKS)
    base = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1", **extra}
    server = None
    with open(b.logdir / f"allreduce-{name}.log", "a") as err:
        if controller == "gloo":
            server, port = start_rendezvous(envs)
            procs = [subprocess.Popen(argv, env=worker_environ(base, e.to_horovod_env("127.0.0.1", port, iface="lo")),
                                      stdout=subprocess.PIPE, stderr=err, text=True) for e in envs]
        else:
            launcher = find_mpi_launcher()
            if os.geteuid() == 0:  # this bench as root (a container): Open MPI's consent, here only
                base.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            procs = [subprocess.Popen(launcher.command(ALLREDUCE_RANKS, argv),
                                      env=worker_environ(base, envs[0].to_mpi_env()),
                                      stdout=subprocess.PIPE, stderr=err, text=True)]
        try:
            outs = [p.communicate(timeout=600)[0] for p in procs]
        finally:
            if server is not None:
                server.stop()
    if any(p.returncode for p in procs):
        raise BenchError(f"allreduce under {name} failed; see {b.logdir / f'allreduce-{name}.log'}")
    for out in outs:
        for line in out.splitlines():
            if line.startswith("@@ "):
                return json.loads(line[3:])["seconds"]
    raise BenchError(f"allreduce under {name}: rank 0 printed no timings")


def section_allreduce(b: Bench) -> None:
    from hpcdl.launch import find_mpi_launcher

    launcher = find_mpi_launcher()
    probe = subprocess.run([sys.executable, "-c", "import horovod.tensorflow as h; print(h.mpi_built())"],
                           capture_output=True, text=True)
    names = ["gloo"]
    if launcher and launcher.open_mpi and probe.stdout.strip().endswith("True"):
        names += ["mpi_tcp", "mpi"]
    else:
        b.row("allreduce.mpi", "allreduce", "MPI beside Gloo", "not measured", "",
              "needs Horovod built with MPI (make install MPI=1) and Open MPI's mpirun")
    reps = 10 if b.args.quick else 20
    per_round: dict[str, list[float]] = {n: [] for n in names}
    samples: dict[str, list[list[float]]] = {n: [] for n in names}
    for r in range(b.args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):  # alternate who goes first
            seconds = allreduce_round(b, name, reps)
            samples[name].append(seconds)
            per_round[name].append(statistics.median(seconds))
    b.data["allreduce"] = {"ranks": ALLREDUCE_RANKS, "bytes": 2_376_712, "reps": reps, "samples_s": samples,
                           "round_medians_s": per_round, "mpi_launcher": launcher.path if launcher else None}
    gloo = median(per_round["gloo"])
    for name in names:
        rounds = per_round[name]
        ms = lambda x: f"{1e3 * x:.1f}"  # noqa: E731
        ratio = "" if name == "gloo" else f"{gloo / median(rounds):.2f}× Gloo's speed"
        b.row(f"allreduce.{name}", "allreduce",
              f"HEP gradient (2.38 MB) allreduce, {ALLREDUCE_RANKS}-rank group, {ALLREDUCE_CONFIGS[name][2]}",
              f"{ms(median(rounds))} ms", ratio,
              f"median of {len(rounds)} rounds' medians (rounds {ms(min(rounds))}–{ms(max(rounds))} ms, "
              f"{reps} each); loopback: software overheads, not networks", number=median(rounds))


def section_plan(b: Bench) -> None:
    from hpcdl.perf.planner import PlanInputs, plan

    node = b.data.get("sustained", {}).get("metrics")
    if node:
        flops = node[-1]["sustained_flops_per_s_group"]
        source = "bench: sustained FLOP/s of one rank on this machine (hpcdl submit)"
    elif b.data.get("step", {}).get("step_flops"):
        flops = best(b.data["step"]["step_flops"])
        source = "bench: best HEP step FLOP/s on this machine"
    else:
        return
    inputs = PlanInputs.measured_here(flops, batch_per_node=b.args.batch, source=source)
    xf = b.data.get("exchange_files")
    if xf:
        inputs = inputs.with_values("bench: update-file write MB/s on this disk (HMAC, fsync)",
                                    exchange_bandwidth=float(xf["write_Bps"]))
    xl = b.data.get("exchange_load")
    if isinstance(xl, list) and xl and xl[0].get("applier_cpu_ms_per_update"):
        inputs = inputs.with_values("bench: bytes per applier CPU-second (bench/exchange_load.py)",
                                    applier_bytes_per_s=xl[0]["update_bytes"] / (xl[0]["applier_cpu_ms_per_update"] / 1e3))
    p = plan(inputs, 9600)
    b.data["plan"] = p.to_dict()
    if p.recommended:
        c = p.candidate(p.recommended)
        b.row("plan.9600", "plan", "9600 nodes like this one (hpcdl plan, measured inputs)",
              f"{c.sustained_flops / 1e12:.1f} TFLOP/s", f"{p.recommended} groups",
              f"step {c.step_s:.1f} s, staleness {c.staleness_mean:.1f}; other inputs ASSUMED (see JSON)",
              number=c.sustained_flops)


# -- output -----------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    from hpcdl.engine.tuning import onednn_isa_cap, read_cpuinfo, usable_cores

    cpu = read_cpuinfo()  # as oneDNN uses it: capped by ONEDNN_MAX_CPU_ISA, if that is set
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    virt = ""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        m = re.search(r"Hypervisor vendor:\s*(\S+)", lscpu)
        virt = m.group(1) if m else ""
    except OSError:
        pass
    from importlib import metadata

    versions = {}
    for dist in ("tensorflow-cpu", "tensorflow", "horovod", "numpy", "h5py"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu.model, "isa": cpu.vector_isa, "versions": versions, "bf16": cpu.bf16,
            "bf16_unit": cpu.bf16_unit, "flags": " ".join(sorted(cpu.flags)), "usable_cores": usable_cores(),
            "hypervisor": virt, "host": socket.gethostname(), "python": platform.python_version(),
            "commit": commit, "mem_available_gb": round(mem_available_gb(), 1),
            "onednn_isa_cap": onednn_isa_cap(os.environ)}


def render(b: Bench, m: dict, previous: dict | None) -> str:
    head = (f"hpcdl bench — {m['cpu']}{' (' + m['hypervisor'] + ')' if m['hypervisor'] else ''}, "
            f"{m['usable_cores']} cores, {m['isa']}"
            f"{' (ONEDNN_MAX_CPU_ISA=' + m['onednn_isa_cap'] + ')' if m.get('onednn_isa_cap') else ''}, TF "
            f"{m['versions'].get('tensorflow-cpu') or m['versions'].get('tensorflow', '?')}, "
            f"commit {m['commit']}, {b.data['started']}; load avg {b.data['load_start']:.1f} → "
            f"{b.data['load_end']:.1f}; {b.data['elapsed_s'] / 60:.1f} min")
    cols = ["section", "measurement", "value", "ratio", "notes"]
    prev = {}
    if previous:
        prev = {r["key"]: r for r in previous.get("rows", [])}
        cols.insert(4, "previous")
    rows = []
    for r in b.rows:
        cells = [r.section, r.what, r.value, r.ratio, r.note]
        if previous:
            cells.insert(4, prev.get(r.key, {}).get("value", "-"))
        rows.append(cells)
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    widths[-1] = len(cols[-1])
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [head, "", line(cols), line(["-" * w for w in widths[:-1]] + ["-----"])]
    out += [line(r) for r in rows]
    out.append("")
    out.append(f"peak = the best float32 matrix multiply of this run, numpy sgemm or TensorFlow matmul "
               f"({gf(b.peak)}); each figure is the best of its rounds (medians in notes): the machine "
               f"is shared and figures move with its load.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help=f"comma-separated sections ({','.join(SECTIONS)})")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcdl-bench"), help="data cache and scratch runs")
    ap.add_argument("--json", type=Path, help="results file (default bench/results/<date>.json)")
    ap.add_argument("--compare", help="an earlier results JSON, or 'latest'")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and steps: a smoke test, not figures")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="batch per rank of the 224² step and run")
    ap.add_argument("--tuning-batch", type=int, default=16)
    ap.add_argument("--step-n", type=int, default=1, help="timed float32 steps per round")
    ap.add_argument("--sgemm-n", type=int, default=4096)
    ap.add_argument("--peak-seconds", type=float, default=2.0,
                    help="each matmul sample repeats the multiply for this long (a step takes ~3 s)")
    ap.add_argument("--sustained-steps", type=int, default=16)
    ap.add_argument("--sustained-log-every", type=int, default=4)
    ap.add_argument("--sustained-events", type=int, default=600)
    ap.add_argument("--sustained-precisions", default="float32,bfloat16",
                    help="one sustained run per tuning.precision (bfloat16 where the CPU has it)")
    ap.add_argument("--reader-seconds", type=float, default=4.0)
    ap.add_argument("--exchange-files", type=int, default=20)
    ap.add_argument("--exchange-steps", type=int, default=60)
    ap.add_argument("--no-exchange-load", action="store_true", help="do not run bench/exchange_load.py")
    ap.add_argument("--hybrid-events", type=int, default=6000, help="the exchange section's short run")
    ap.add_argument("--keep", action="store_true", help="keep the scratch runs under --work")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.sustained_steps = 1, 4
        args.sustained_log_every, args.exchange_files, args.reader_seconds = 2, 5, 2.0
        args.sgemm_n, args.exchange_steps, args.no_exchange_load = 2048, 20, True
        args.peak_seconds = 0.5
    chosen = args.only.split(",") if args.only else list(SECTIONS)
    chosen = [s.strip() for s in chosen if s.strip() and s.strip() not in args.skip.split(",")]
    bad = [s for s in chosen if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {', '.join(bad)} (known: {', '.join(SECTIONS)})")
    args.sections = chosen
    args.work.mkdir(parents=True, exist_ok=True)
    logdir = args.work / "logs"
    logdir.mkdir(exist_ok=True)
    b = Bench(args=args, work=args.work, logdir=logdir)
    b.data.update(started=time.strftime("%Y-%m-%d %H:%M"), load_start=loadavg(), sections=chosen)
    t_start = time.time()
    m = machine()
    log(f"{m['cpu']}, {m['usable_cores']} cores; sections: {', '.join(chosen)}; load {loadavg():.1f}")
    failures = {}

    def run(name, fn, *a):
        t = time.time()
        try:
            fn(*a)
        except Exception as exc:  # one section failing leaves the others' figures
            failures[name] = f"{type(exc).__name__}: {exc}"
            b.row(f"{name}.failed", name, "section failed", "-", "", str(exc).splitlines()[0][:100])
        b.data.setdefault("section_seconds", {})[name] = round(time.time() - t, 1)

    try:
        if "sgemm" in chosen or "step" in chosen:
            run("step", section_sgemm_step, b, "sgemm" in chosen, "step" in chosen)
        if "profile" in chosen:
            run("profile", section_profile, b)
        if "tuning" in chosen:
            run("tuning", section_tuning, b)
        b.close_tf()
        if "layout" in chosen:
            run("layout", section_layout, b)
        if "sustained" in chosen:
            run("sustained", section_sustained, b)
        if "reader" in chosen:
            run("reader", section_reader, b)
        if "hybrid" in chosen:
            run("hybrid", section_hybrid, b)
        if "exchange" in chosen:
            run("exchange", section_exchange_files, b)
            run("exchange-overhead", section_exchange_overhead, b)
            run("exchange-load", section_exchange_load, b)
        if "allreduce" in chosen:
            run("allreduce", section_allreduce, b)
        if "plan" in chosen:
            run("plan", section_plan, b)
    except KeyboardInterrupt:
        failures["interrupted"] = "Ctrl-C"
    finally:
        b.close()
    if not args.keep:
        shutil.rmtree(args.work / "runs", ignore_errors=True)
        shutil.rmtree(args.work / "snapshots", ignore_errors=True)
    b.data.update(load_end=loadavg(), elapsed_s=time.time() - t_start, failures=failures)
    previous = None
    if args.compare:
        path = Path(args.compare)
        if args.compare == "latest":
            olds = sorted(RESULTS.glob("20*.json"))  # make bench's own, not race-/profile-/variants-
            path = olds[-1] if olds else None
        previous = json.loads(path.read_text()) if path and path.is_file() else None
    text = render(b, m, previous)
    print(text)
    out = args.json or RESULTS / (time.strftime("%Y-%m-%d_%H%M%S") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": m, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                      for k, v in vars(args).items()},
                               "rows": [r.__dict__ for r in b.rows], "data": b.data, "table": text},
                              indent=1, default=str))
    print(f"\nresults: {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
