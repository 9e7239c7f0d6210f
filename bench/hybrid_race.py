#!/usr/bin/env python
"""The hybrid race: the same 8 ranks as one synchronous group and as hybrid groups, time to accuracy.

Figures, not a test. Every configuration trains the HEP network (small: 16 filters, 32×32
images, batch 8 per rank) on the same generated set with `hpcdl submit --backend local`, paced
by the straggler emulator (`[emulate]`, hpcdl.emulate): each rank-step lasts `--step-seconds`
× X, so the emulated time, not the 2 cores, sets the pace. Scenarios:

  a  no variance                         X = 1
  b  noisy                               X lognormal σ = 0.5, and a 2 % chance of a 4× stall
  c  one slow node                       shard 3 is 2× slow throughout
  d  one rank killed                     shard 5 SIGKILLs itself 25 s in; its group restarts
                                         from its checkpoint (every 5 steps), the others go on

Clocks start when the first group has logged its first 5 steps (start-up and first-step tracing,
the same for all, are left out). The model is scored while it trains, on the whole validation file (fixed), every ~2 s: the
synchronous group's newest checkpoint, or the applier's newest master weights. A run stops once
it has reached the AUC target *and* (hybrid runs) the number of samples the synchronous run of the
same scenario and seed needed, or at the budget. Reported per scenario and configuration, over
seeds: wall time from the first training step to the target (median, range), its ratio to the
synchronous run's, the AUC at the synchronous run's sample count, and the applier's updates/s
and staleness (mean, p95). Results: bench/results/race-<date>.json.

    .venv/bin/python bench/hybrid_race.py            # 3 seeds, every scenario (~25 min)
    .venv/bin/python bench/hybrid_race.py --quick    # 1 seed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import RESULTS, Probe, log, machine, result_path

HPCDL = str(Path(sys.executable).with_name("hpcdl"))
RANKS = 8
BATCH = 8
IMAGE = 32
MODEL = {"filters": 16, "conv_layers": 4, "dropout": 0.0}
SCORE_EVERY_S = 2.0

SCENARIOS = {
    "a": ("no variance", []),
    "b": ("σ 0.5, 2 % stalls of 4×", ["emulate.sigma=0.5", "emulate.stall_probability=0.02",
                                      "emulate.stall_factor=4.0"]),
    "c": ("shard 3 2× slow", ["emulate.slow_shard=3", "emulate.slow_factor=2.0"]),
    "d": ("shard 5 killed at 25 s", ["emulate.kill_shard=5", "emulate.kill_after_s=25"]),
}


@dataclass(frozen=True)
class Config:
    name: str
    groups: int
    exchange: tuple[str, ...] = ()
    update_steps: int = 1  # group steps behind one master version

    @property
    def group_size(self) -> int:
        return RANKS // self.groups

    def samples(self, version_or_step: int) -> int:
        """Training samples behind a sync checkpoint's step or a master version."""
        if self.groups == 1:
            return version_or_step * RANKS * BATCH
        return version_or_step * self.update_steps * self.group_size * BATCH


# the bounds the tuned configurations were raced with (the job files' are 64 and 16)
RACED = ("exchange.max_staleness=64", "exchange.max_pending_per_group=64")


def delta(groups: int, h: int, lr: float = 0.25) -> Config:
    """Async local SGD: H local steps, the delta averaged in by outer SGD (lr 2/G: see README)."""
    return Config(f"{groups}x{RANKS // groups} delta H={h}", groups,
                  ('exchange.kind="delta"', f"exchange.every={h}", 'exchange.optimizer="sgd"',
                   f"exchange.learning_rate={lr:g}", "exchange.max_outstanding=1", *RACED),
                  update_steps=h)


def gradient(groups: int, lr: float, outstanding: int, beta1: float) -> Config:
    """The paper's: each group gradient one Adam step of the applier's."""
    return Config(f"{groups}x{RANKS // groups} gradient", groups,
                  ('exchange.kind="gradient"', 'exchange.optimizer="adam"', f"exchange.learning_rate={lr:g}",
                   f"exchange.max_outstanding={outstanding}", f"exchange.momentum={beta1:g}", *RACED))


# The hybrid configurations are the best of each kind in the tuning runs (README, Figures): Adam
# at about train.learning_rate / √G with no explicit momentum (asynchrony adds its own) and one
# update in flight; the delta averaged in at twice the mean.
# "job defaults" is jobs/hep.toml's [exchange] as it ships (the applier's rate from the rule).
CONFIGS = [Config("1x8 sync", 1), gradient(8, 3e-4, 2, 0.0), gradient(4, 4e-4, 2, 0.0), delta(8, 4),
           Config("8x1 job defaults", 8)]
@dataclass
class Result:
    scenario: str
    config: str
    seed: int
    time_to_target_s: float | None = None
    samples_at_target: int | None = None
    auc_at_sync_samples: float | None = None
    best_auc: float = 0.0
    curve: list = field(default_factory=list)  # (seconds since the first step, samples, auc)
    wall_s: float = 0.0
    updates_per_s: float | None = None
    staleness_mean: float | None = None
    staleness_p95: float | None = None
    restarts: int = 0
    load: tuple = ()  # the machine's load average before and after: other work shows here
    note: str = ""


def generated(work: Path, events: int) -> dict[str, Path]:
    from hpcdl.workloads.hep.generate import GENERATOR_VERSION, generate

    out = work / "data" / f"hep-v{GENERATOR_VERSION}-e{events}-s{IMAGE}"
    files = {k: out / f"{k}.h5" for k in ("train", "val", "test")}
    if not all(p.is_file() for p in files.values()):
        log(f"generating {events} HEP events at {IMAGE}x{IMAGE} into {out}")
        generate(out, events, image_size=IMAGE, seed=0, fractions=(0.75, 0.15, 0.10))
    return files


def snapshot(run_dir: Path, config: Config, keep: Path) -> tuple[Path, int] | None:
    """The newest model of the run, hard-linked into `keep` (files are pruned as the run goes)."""
    if config.groups == 1:
        indexes = sorted(run_dir.glob("checkpoints/0/ckpt-*.index"),
                         key=lambda p: int(p.name.split("-")[1].split(".")[0]))
        if not indexes:
            return None
        step = int(indexes[-1].name.split("-")[1].split(".")[0])
        prefix = indexes[-1].with_suffix("")
        dest = keep / f"ckpt-{step}"
        try:
            for part in prefix.parent.glob(prefix.name + ".*"):
                os.link(part, keep / part.name.replace(prefix.name, dest.name))
        except FileExistsError:
            pass
        except FileNotFoundError:
            return None
        return dest, step
    weights = sorted((run_dir / "exchange" / "weights").glob("w-v*.hx"))
    if not weights:
        return None
    version = int(weights[-1].name[3:-3])
    dest = keep / weights[-1].name
    try:
        os.link(weights[-1], dest)
    except FileExistsError:
        pass
    except FileNotFoundError:
        return None
    return dest, version


def warmed_up(run_dir: Path, groups: int) -> float | None:
    """When the first group logged its first window (5 steps): start-up, Horovod's and
    TensorFlow's first-step tracing are over. Every configuration's clock starts there."""
    times = []
    for g in range(groups):
        path = run_dir / "groups" / str(g) / "metrics.jsonl"
        try:
            first = path.read_text().split("\n", 1)[0]
            times.append(json.loads(first)["time"])
        except (OSError, ValueError, KeyError):
            continue
    return min(times) if times else None


def race_one(args, files, scorer, scenario: str, config: Config, seed: int,
             sync_samples: int | None) -> Result:
    res = Result(scenario, config.name, seed)
    runs = args.work / "runs" / f"{scenario}-{config.name.replace(' ', '_')}-s{seed}"
    shutil.rmtree(runs, ignore_errors=True)
    keep = runs / "snapshots"
    keep.mkdir(parents=True)
    overrides = [
        *(f'data.{k}="{v}"' for k, v in files.items()), "train.steps=100000",
        f"train.batch_per_rank={BATCH}", "train.log_every=5", "train.checkpoint_every=5",
        "train.keep_checkpoints=3", f"train.seed={seed}", "data.chunk_events=512",
        "train.validate_every=0",  # the race scores every model itself, from outside the run
        *(f"model.{k}={v}" for k, v in MODEL.items()),
        "emulate.enabled=true", f"emulate.step_seconds={args.step_seconds}", f"emulate.seed={seed}",
        *SCENARIOS[scenario][1], *config.exchange,
    ]
    cmd = [HPCDL, "submit", "hep", "--backend", "local", "--nodes", str(RANKS), "--group-size",
           str(config.group_size), "--runs-dir", str(runs), "--json"]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.time()
    load_before = os.getloadavg()[0]
    with open(runs / "submit.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=args.work, stdout=out, stderr=subprocess.STDOUT)
    run_dir, start, last_score, done = None, None, 0.0, False
    stats = None
    while proc.poll() is None:
        time.sleep(0.25)
        if run_dir is None:
            found = [p for p in runs.iterdir() if p.name.startswith("hep-")]
            run_dir = found[0] if found else None
            continue
        if start is None:
            start = warmed_up(run_dir, config.groups)
        if stats is None and (run_dir / "stats.json").is_file():
            stats = json.loads((run_dir / "stats.json").read_text())
        now = time.time()
        if start is not None and now - start > args.budget:
            res.note = f"budget {args.budget:.0f} s"
            done = True
        elif start is not None and stats is not None and now - last_score >= SCORE_EVERY_S:
            snap = snapshot(run_dir, config, keep)
            if snap is not None:
                seen = time.time()
                last_score = seen
                auc = scorer.ask(op="auc", snapshots=[str(snap[0])], stats=stats, model=MODEL,
                                 input_shape=[IMAGE, IMAGE, 3], data=[str(files["val"])],
                                 run_dir=str(run_dir))["results"][0]["auc_unweighted"]
                samples = config.samples(snap[1])
                res.curve.append((round(seen - start, 2), samples, round(auc, 4)))
                res.best_auc = max(res.best_auc, auc)
                if auc >= args.target and res.time_to_target_s is None:
                    res.time_to_target_s, res.samples_at_target = seen - start, samples
                if sync_samples is not None and res.auc_at_sync_samples is None and samples >= sync_samples:
                    res.auc_at_sync_samples = auc
                if res.time_to_target_s is not None and (sync_samples is None or samples >= sync_samples):
                    done = True
        if done:
            subprocess.run([HPCDL, "cancel", str(run_dir)], capture_output=True, cwd=args.work)
            break
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
    res.wall_s = time.time() - t0
    res.load = (round(load_before, 1), round(os.getloadavg()[0], 1))
    if config.groups == 1:
        res.auc_at_sync_samples = res.auc_at_sync_samples or _auc_at(res.curve, res.samples_at_target)
    if run_dir is not None:
        applier_figures(run_dir, res, start)
        local = run_dir / "scheduler" / "local.json"
        if local.is_file():
            view = json.loads(local.read_text())
            res.restarts = sum(g.get("restarts", 0) for g in view.get("groups", {}).values())
    if run_dir is not None and not args.keep_runs:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(keep, ignore_errors=True)
    log(f"  {scenario} {config.name} seed {seed}: "
        + (f"AUC {args.target} at {res.time_to_target_s:.1f} s ({res.samples_at_target} samples)"
           if res.time_to_target_s is not None else f"target not reached (best {res.best_auc:.3f})")
        + (f", AUC at sync's samples {res.auc_at_sync_samples:.4f}" if res.auc_at_sync_samples else "")
        + (f", staleness {res.staleness_mean:.1f}/{res.staleness_p95:.0f}" if res.staleness_mean is not None else "")
        + (f", restarts {res.restarts}" if res.restarts else "") + (f" [{res.note}]" if res.note else ""))
    return res


def _auc_at(curve, samples):
    if samples is None:
        return None
    for _t, n, auc in curve:
        if n >= samples:
            return auc
    return None


def applier_figures(run_dir: Path, res: Result, start: float | None) -> None:
    events_path = run_dir / "exchange" / "applier" / "events.jsonl"
    if not events_path.is_file():
        return
    applied = []
    for line in events_path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "applied":
            applied.append(ev)
    if len(applied) < 2:
        return
    span = applied[-1]["time"] - applied[0]["time"]
    res.updates_per_s = (len(applied) - 1) / span if span > 0 else None
    st = sorted(ev["staleness"] for ev in applied)
    res.staleness_mean = statistics.fmean(st)
    res.staleness_p95 = st[min(len(st) - 1, int(0.95 * len(st)))]


def summarise(results: list[Result], configs: list[Config], scenarios: list[str]) -> dict:
    out: dict = {}
    for sc in scenarios:
        sync = [r for r in results if r.scenario == sc and r.config == configs[0].name]
        sync_t = [r.time_to_target_s for r in sync if r.time_to_target_s is not None]
        sync_med = statistics.median(sync_t) if sync_t else None
        sync_auc = [r.auc_at_sync_samples for r in sync if r.auc_at_sync_samples is not None]
        out[sc] = {"scenario": SCENARIOS[sc][0], "configs": {}}
        for c in configs:
            rs = [r for r in results if r.scenario == sc and r.config == c.name]
            if not rs:
                continue
            ts = [r.time_to_target_s for r in rs if r.time_to_target_s is not None]
            aucs = [r.auc_at_sync_samples for r in rs if r.auc_at_sync_samples is not None]
            med = statistics.median(ts) if len(ts) == len(rs) else None
            entry = {
                "seeds": len(rs), "reached": len(ts),
                "time_to_target_s": med,
                "time_to_target_range_s": [min(ts), max(ts)] if ts else None,
                "ratio_to_sync": med / sync_med if (med and sync_med) else None,
                "auc_at_sync_samples": statistics.median(aucs) if aucs else None,
                "auc_gap_to_sync": (statistics.median(aucs) - statistics.median(sync_auc))
                if (aucs and sync_auc) else None,
                "updates_per_s": _median([r.updates_per_s for r in rs]),
                "staleness_mean": _median([r.staleness_mean for r in rs]),
                "staleness_p95": _median([r.staleness_p95 for r in rs]),
                "best_auc": max(r.best_auc for r in rs),
            }
            out[sc]["configs"][c.name] = entry
    return out


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def render(summary: dict, target: float) -> str:
    lines = [f"time from the first step to validation AUC {target} (median over seeds [range]); "
             "ratio to 1x8 sync; AUC at sync's sample count; applier updates/s; staleness mean/p95"]
    for sc, s in summary.items():
        lines.append(f"\n({sc}) {s['scenario']}")
        for name, e in s["configs"].items():
            t = (f"{e['time_to_target_s']:6.1f} s [{e['time_to_target_range_s'][0]:.0f}–"
                 f"{e['time_to_target_range_s'][1]:.0f}]") if e["time_to_target_s"] else \
                f"{'not reached':>9} ({e['reached']}/{e['seeds']}, best {e['best_auc']:.3f})"
            ratio = f"{e['ratio_to_sync']:.2f}×" if e["ratio_to_sync"] else "-"
            auc = f"{e['auc_at_sync_samples']:.4f}" if e["auc_at_sync_samples"] else "-"
            ups = f"{e['updates_per_s']:.1f}/s" if e["updates_per_s"] else "-"
            st = (f"{e['staleness_mean']:.1f}/{e['staleness_p95']:.0f}"
                  if e["staleness_mean"] is not None else "-")
            lines.append(f"  {name:18} {t:24} {ratio:>6}  AUC {auc:7}  {ups:>8}  stale {st}")
    return "\n".join(lines)


def markdown(summary: dict, target: float) -> str:
    """The summary as README's table."""
    rows = [f"| scenario | configuration | time to AUC {target} (median [range]) | ratio to sync | "
            "AUC at sync's samples | updates/s | staleness mean / p95 |", "|---|---|---|---|---|---|---|"]
    for sc, s in summary.items():
        for name, e in s["configs"].items():
            if e["time_to_target_s"]:
                lo, hi = e["time_to_target_range_s"]
                t = f"{e['time_to_target_s']:.1f} s" + (f" [{lo:.0f}–{hi:.0f}]" if e["seeds"] > 1 else "")
            else:
                t = f"reached in {e['reached']} of {e['seeds']} seeds (best {e['best_auc']:.3f})"
            ratio = f"{e['ratio_to_sync']:.2f}×" if e["ratio_to_sync"] else "-"
            auc = f"{e['auc_at_sync_samples']:.3f}" if e["auc_at_sync_samples"] else "-"
            ups = f"{e['updates_per_s']:.0f}" if e["updates_per_s"] else "-"
            st = f"{e['staleness_mean']:.1f} / {e['staleness_p95']:.0f}" if e["staleness_mean"] is not None else "-"
            rows.append(f"| ({sc}) {s['scenario']} ({e['seeds']} seed{'s' if e['seeds'] > 1 else ''}) | {name} | "
                        f"{t} | {ratio} | {auc} | {ups} | {st} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--one-seed", default="c,d", help="scenarios run with seed 0 only")
    ap.add_argument("--scenarios", default="a,b,c,d")
    ap.add_argument("--configs", default="", help="comma-separated names (default: all)")
    ap.add_argument("--target", type=float, default=0.90)
    ap.add_argument("--step-seconds", type=float, default=0.2)
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of training at most per run")
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hpcdl-race"))
    ap.add_argument("--keep-runs", action="store_true")
    ap.add_argument("--table", type=Path, help="print a results file's summary as a Markdown table; run nothing")
    args = ap.parse_args(argv)
    if args.table:
        data = json.loads(args.table.read_text())
        print(markdown(data["summary"], data["target_auc"]))
        return 0
    seeds = 1 if args.quick else args.seeds
    scenarios = args.scenarios.split(",")
    configs = [c for c in CONFIGS if not args.configs or c.name in args.configs.split(",")]
    if configs[0].groups != 1:
        configs.insert(0, CONFIGS[0])  # the synchronous run is every ratio's denominator
    args.work.mkdir(parents=True, exist_ok=True)
    files = generated(args.work, args.events)
    logdir = args.work / "logs"
    logdir.mkdir(exist_ok=True)
    env_machine = machine()
    log(f"race on {env_machine['cpu']} ({env_machine['isa']}), {seeds} seed(s), scenarios {scenarios}")
    scorer = Probe("race-eval", ["--role", "eval", "--image", str(IMAGE)], logdir)
    results: list[Result] = []
    started = time.time()
    try:
        for seed in range(seeds):
            for sc in scenarios:
                if seed and sc in args.one_seed.split(","):
                    continue
                sync = race_one(args, files, scorer, sc, configs[0], seed, None)
                results.append(sync)
                for c in configs[1:]:
                    results.append(race_one(args, files, scorer, sc, c, seed, sync.samples_at_target))
    finally:
        scorer.close()
    summary = summarise(results, configs, scenarios)
    text = render(summary, args.target)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    path = result_path("race", env_machine)
    path.write_text(json.dumps({
        "machine": env_machine, "seeds": seeds, "target_auc": args.target, "ranks": RANKS,
        "batch_per_rank": BATCH, "image": IMAGE, "model": MODEL, "step_seconds": args.step_seconds,
        "budget_s": args.budget, "events": args.events, "minutes": (time.time() - started) / 60,
        "summary": summary, "runs": [r.__dict__ for r in results],
    }, indent=1))
    log(f"results: {path} ({(time.time() - started) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
