"""hpcdl's benchmark suite: `make bench` prints one table of figures measured in the same run.

Each section is a module of bench.sections (its docstring says what it measures); each is
skippable: `--only sgemm,step`, `--skip hybrid`. The machine is shared and noisy: measurements
that are compared are taken side by side, in alternating rounds; best and median are printed,
with the load average. Results go to bench/results/bench/<date>-<machine>.json (`--compare
FILE|latest` adds the figures of an earlier run). Generated data sets are cached under --work
(default /tmp/hpcdl-bench).

    python -m bench                       # = python -m bench.run, `make bench`
    python -m bench --quick --only sgemm  # a smoke test, not figures
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from bench.harness import Bench, loadavg, log, machine, previous_results, render, result_path, write_result
from bench.sections import allreduce, exchange, hybrid, layout, peak, plan, profile, reader, sustained, tuning

SUITE = "bench"
# the sections a user names, and the module of each (sgemm and step are one: the step's ratios
# need the peak's samples, taken between its rounds)
SECTIONS = {"sgemm": peak, "step": peak, "profile": profile, "tuning": tuning, "layout": layout,
            "sustained": sustained, "reader": reader, "exchange": exchange, "hybrid": hybrid,
            "allreduce": allreduce, "plan": plan}
# what runs, in this order: (name of its failure and its time, the sections choosing it, the code);
# the first ones share the run's TensorFlow probe, closed before the others start their processes
WITH_TF_PROBE = (("step", {"sgemm", "step"}, peak.run), ("profile", {"profile"}, profile.run),
                 ("tuning", {"tuning"}, tuning.run))
AFTER = (("layout", {"layout"}, layout.run), ("sustained", {"sustained"}, sustained.run),
         ("reader", {"reader"}, reader.run), ("hybrid", {"hybrid"}, hybrid.run),
         ("exchange", {"exchange"}, exchange.files), ("exchange-overhead", {"exchange"}, exchange.overhead),
         ("exchange-load", {"exchange"}, exchange.load), ("allreduce", {"allreduce"}, allreduce.run),
         ("plan", {"plan"}, plan.run))


def sections_help() -> str:
    names: dict = {}
    for name, module in SECTIONS.items():
        names.setdefault(module, []).append(name)
    return "sections (each module's docstring says more):\n" + "\n".join(
        f"  {', '.join(group):13} {module.__doc__.splitlines()[0]}" for module, group in names.items())


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
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

    def run(name, fn):
        t = time.time()
        try:
            fn(b)
        except Exception as exc:  # one section failing leaves the others' figures
            failures[name] = f"{type(exc).__name__}: {exc}"
            b.row(f"{name}.failed", name, "section failed", "-", "", str(exc).splitlines()[0][:100])
        b.data.setdefault("section_seconds", {})[name] = round(time.time() - t, 1)

    try:
        for name, sections, fn in WITH_TF_PROBE:
            if sections & set(chosen):
                run(name, fn)
        b.close_tf()
        for name, sections, fn in AFTER:
            if sections & set(chosen):
                run(name, fn)
    except KeyboardInterrupt:
        failures["interrupted"] = "Ctrl-C"
    finally:
        b.close()
    if not args.keep:
        shutil.rmtree(args.work / "runs", ignore_errors=True)
        shutil.rmtree(args.work / "snapshots", ignore_errors=True)
    b.data.update(load_end=loadavg(), elapsed_s=time.time() - t_start, failures=failures)
    previous = previous_results(args.compare, SUITE)
    text = render(b, m, previous)
    print(text)
    out = write_result(args.json or result_path(SUITE, m), {
        "machine": m, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rows": [r.__dict__ for r in b.rows], "data": b.data, "table": text})
    print(f"\nresults: {out}")
    return 1 if failures else 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=sections_help(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help=f"comma-separated sections ({','.join(SECTIONS)})")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcdl-bench"), help="data cache and scratch runs")
    ap.add_argument("--json", type=Path, help="results file (default bench/results/bench/<date>-<machine>.json)")
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
    ap.add_argument("--no-exchange-load", action="store_true", help="do not run bench.exchange_load")
    ap.add_argument("--hybrid-events", type=int, default=6000, help="the exchange section's short run")
    ap.add_argument("--keep", action="store_true", help="keep the scratch runs under --work")
    return ap


if __name__ == "__main__":
    sys.exit(main())
