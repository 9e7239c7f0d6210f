"""The scale planner fed this run's measured node rate and exchange bandwidth."""

from __future__ import annotations

from bench.harness import Bench, best


def run(b: Bench) -> None:
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

