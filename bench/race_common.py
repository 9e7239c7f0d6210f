"""What bench.hybrid_race races and records: its network and data, the straggler scenarios, the
configurations and their rates, a run's result, the stop rule, and what it reads of a run while
it trains (`Watched`)."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import hep_data
from hpcdl.rundir.runs import RunDir

SUITE = "race"
RANKS = 8
BATCH = 8
IMAGE = 32
MODEL = {"filters": 16, "conv_layers": 4, "dropout": 0.0}
SCORE_EVERY_S = 2.0
TARGETS = (0.90, 0.93)  # and the tuned synchronous run's best ("sync best")
LOSS_TARGETS = (0.5, 0.4, 0.3)  # the validation loss, as bench.emulated_race races it
FIXED_TIMES = (15.0, 30.0, 45.0)  # seconds of training: the AUC each configuration has then
GRID = (0.5, 1.0, 2.0)  # the sweep: these multiples of a configuration's centre rate
TRAIN_RATE = 1e-3  # the job's train.learning_rate (jobs/hep.toml)

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
    rate: float  # the sweep's centre
    exchange: tuple[str, ...] = ()
    update_steps: int = 1  # group steps behind one master version

    @property
    def group_size(self) -> int:
        return RANKS // self.groups

    @property
    def rate_field(self) -> str:
        """The rate that matters: the synchronous group's own, a hybrid run's applier's."""
        return "train.learning_rate" if self.groups == 1 else "exchange.learning_rate"

    def samples(self, version_or_step: int) -> int:
        """Training samples behind a sync checkpoint's step or a master version."""
        if self.groups == 1:
            return version_or_step * RANKS * BATCH
        return version_or_step * self.update_steps * self.group_size * BATCH


# the bounds the tuned configurations were raced with (the job files' are 64 and 16)
RACED = ("exchange.max_staleness=64", "exchange.max_pending_per_group=64")


def delta(groups: int, h: int, lr: float = 0.25) -> Config:
    """Async local SGD: H local steps, the delta averaged in by outer SGD (lr 2/G: see README)."""
    return Config(f"{groups}x{RANKS // groups} delta H={h}", groups, lr,
                  ('exchange.kind="delta"', f"exchange.every={h}", 'exchange.optimizer="sgd"',
                   "exchange.max_outstanding=1", *RACED), update_steps=h)


def job_defaults(groups: int) -> Config:
    """jobs/hep.toml's [exchange] as it ships; the sweep is centred on its applier's rate rule."""
    return Config(f"{groups}x{RANKS // groups} job defaults", groups, TRAIN_RATE / groups ** 0.5)


# The synchronous group's grid is centred one factor above the job's rate: a first check found
# 2e-3 twice as fast as the job's 1e-3 and 4e-3 diverging, so the baseline gets its best chance.
SYNC = Config("1x8 sync", 1, 2 * TRAIN_RATE)
CONFIGS = [SYNC, job_defaults(8), job_defaults(2), delta(8, 4)]
DEFAULT_CONFIGS = "1x8 sync,8x1 job defaults"  # the others on request (--configs): each costs 3 + seeds runs a scenario


@dataclass
class Result:
    scenario: str
    config: str
    seed: int
    rate: float
    phase: str  # "sweep" or "race"
    times_to_target: dict = field(default_factory=dict)  # str(target) -> seconds or None
    best_auc: float = 0.0
    held_auc: float = 0.0  # the best AUC held over two consecutive scores
    curve: list = field(default_factory=list)  # (seconds since the first step, samples, auc)
    loss_curve: list = field(default_factory=list)  # (seconds, samples, validation loss) at the same scores
    startup_s: float | None = None  # submit to the first group's first window
    trained_s: float = 0.0
    teardown_s: float = 0.0
    wall_s: float = 0.0
    updates_per_s: float | None = None
    staleness_mean: float | None = None
    staleness_p95: float | None = None
    wait_share: float | None = None  # the roots' exchange wait / their training time (mean)
    restarts: int = 0
    load: tuple = ()  # the machine's load average before and after: other work shows here
    stopped: str = ""  # why the run ended


@dataclass(frozen=True)
class StopRule:
    targets: dict[str, float]  # name -> AUC
    budget: float
    run_until: float = 0.0  # seconds of training a run goes on for at least
    losses: tuple[float, ...] = LOSS_TARGETS  # validation losses a run goes on for until reached

    @property
    def names(self) -> list[str]:
        return [*self.targets, *(loss_key(t) for t in self.losses)]


def loss_key(level: float) -> str:
    return f"loss {level:g}"


def parse_rates(text: str) -> dict[int, float]:
    """`--rates G:RATE,...` (both races' option) as {G: rate}; a malformed item ends the run in one line."""
    try:
        return {int(g): float(r) for g, r in (item.split(":") for item in text.split(",") if item)}
    except ValueError:
        raise SystemExit(f"--rates takes G:RATE,... (e.g. 1:2e-3,8:3.5e-4), got {text!r}") from None


def named(targets) -> dict[str, float]:
    return {f"{t:g}": t for t in targets}


def generated(work: Path, events: int) -> dict[str, Path]:
    return hep_data(work, events, IMAGE, fractions=(0.75, 0.15, 0.10))


def held(curve) -> float:
    """The best AUC held over two consecutive scores (one lucky score is not a level reached)."""
    aucs = [a for _t, _n, a in curve]
    if len(aucs) < 2:
        return aucs[0] if aucs else 0.0
    return max(min(x, y) for x, y in zip(aucs, aucs[1:]))


class Watched:
    """What the race reads of one run while it trains, through the run's own path owners."""

    def __init__(self, root: Path, config: Config):
        self.run = RunDir(root)
        self.config = config
        self.job = self.run.load_job()
        self._channel = None

    @property
    def channel(self):
        from hpcdl.exchange import Channel

        if self._channel is None:
            self._channel = Channel(self.run.exchange_dir(self.job), self.run.run_id, create=False)
        return self._channel

    def snapshot(self, keep: Path) -> tuple[Path, int] | None:
        """The newest model of the run, hard-linked into `keep` (files are pruned as the run goes)."""
        if self.config.groups == 1:
            steps = sorted(int(p.name[5:-6]) for p in self.run.checkpoint_dir(0).glob("ckpt-*.index"))
            if not steps:
                return None
            prefix = self.run.checkpoint_dir(0) / f"ckpt-{steps[-1]}"
            try:
                for part in prefix.parent.glob(prefix.name + ".*"):
                    os.link(part, keep / part.name)
            except FileExistsError:
                pass
            except FileNotFoundError:
                return None
            return keep / prefix.name, steps[-1]
        from hpcdl.exchange.channel import weights_name

        try:
            versions = self.channel.weight_versions()
        except FileNotFoundError:
            return None
        if not versions:
            return None
        name = weights_name(versions[-1])
        try:
            os.link(self.channel.weights_dir / name, keep / name)
        except FileExistsError:
            pass
        except FileNotFoundError:
            return None
        return keep / name, versions[-1]

    def last_lines(self) -> list[dict]:
        out = []
        for g in range(self.config.groups):
            try:
                lines = self.run.metrics_file(g).read_text().splitlines()
                out.append(json.loads(lines[-1]))
            except (OSError, ValueError, IndexError):
                continue
        return out

    def warmed_up(self) -> float | None:
        """When the first group logged its first window (5 steps): start-up, Horovod's and
        TensorFlow's first-step tracing are over. Every configuration's clock starts there."""
        times = []
        for g in range(self.config.groups):
            try:
                first = self.run.metrics_file(g).read_text().split("\n", 1)[0]
                times.append(json.loads(first)["time"])
            except (OSError, ValueError, KeyError):
                continue
        return min(times) if times else None

    def figures(self, res: Result) -> None:
        """The applier's rate and staleness, the roots' waiting and the restarts, after the run."""
        if self.config.groups > 1:
            try:
                lines = self.channel.events_path.read_text().splitlines()
            except (OSError, FileNotFoundError):
                lines = []
            applied = []
            for line in lines:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("event") == "applied":
                    applied.append(ev)
            if len(applied) >= 2:
                span = applied[-1]["time"] - applied[0]["time"]
                res.updates_per_s = (len(applied) - 1) / span if span > 0 else None
                st = sorted(ev["staleness"] for ev in applied)
                res.staleness_mean = statistics.fmean(st)
                res.staleness_p95 = st[min(len(st) - 1, int(0.95 * len(st)))]
            shares = [ln["exchange_wait_seconds"] / (ln["time"] - ln["train_start"])
                      for ln in self.last_lines()
                      if "exchange_wait_seconds" in ln and ln["time"] > ln.get("train_start", ln["time"])]
            res.wait_share = statistics.fmean(shares) if shares else None
        if self.run.local_state_file.is_file():
            view = json.loads(self.run.local_state_file.read_text())
            res.restarts = sum(g.get("restarts", 0) for g in view.get("groups", {}).values())
