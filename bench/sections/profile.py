"""Where one HEP step's time goes, per op class, beside its share of the FLOPs.

bench.profile_step in its own process (TensorFlow's profiler and oneDNN's own timings): per op
class — convolution forward / backward by layer, pooling, ReLU and bias, dropout's random numbers
and mask, Adam, Horovod — its share of op time beside its share of FLOPs; layout reorders from oneDNN.
"""

from __future__ import annotations

import json
import subprocess

from bench.harness import REPO, Bench, BenchError, module_argv


def run(b: Bench) -> None:
    """bench.profile_step in its own process (the profiler and ONEDNN_VERBOSE are per process)."""
    b.close_tf()  # memory, and no other TensorFlow process of ours competes with the profile
    out = b.work / "profile.json"
    out.unlink(missing_ok=True)
    cmd = module_argv("profile_step", "--batch", str(b.args.batch), "--json", str(out))
    if b.args.quick:
        cmd += ["--image", "64", "--warmup", "1", "--steps", "1"]
    with open(b.logdir / "profile_step.log", "w") as log_file:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, timeout=1800)
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

