"""The job's schema: validated frozen dataclasses, and every choice a field takes.

A job names a workload and holds its sections. Common sections (`run`, `train`, `exchange`,
`tuning`, `slurm`, `emulate`) are declared here; `data` and `model` are declared by the workload,
so the engine and the schedulers never see workload-specific fields. Every value a user can set is
a typed dataclass field, a choice a `Literal`: `--set section.key=value` is parsed as a TOML value
and checked against the field's type, and an unknown key is an error that names it. Reading a job
file is hpcdl.jobfile's; this module is the bottom of the import graph and imports only the errors.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import tomli_w

from hpcdl.errors import JobError

# Every choice a job field takes, declared once: validation, the CLI's options and the generated
# reference read them from the field's type, and each registry's test checks that its table
# implements every name (tests/test_choices.py).
Backend = Literal["auto", "local", "slurm"]  # auto: SLURM where it answers, else this machine
# how a group's ranks talk (hpcdl.process.launch, hpcdl.engine.collective)
Controller = Literal["auto", "gloo", "mpi", "mpi4py"]
TrainOptimizer = Literal["adam", "sgd"]  # hpcdl.engine.TRAIN_OPTIMIZERS
UpdateRuleName = Literal["sgd", "momentum", "adam", "nesterov"]  # hpcdl.applier.rules.UPDATE_RULES
StalePolicy = Literal["drop", "downweight"]
ExchangeKind = Literal["gradient", "delta"]  # what an update holds (hpcdl.exchange)
ExchangeEnabled = Literal["auto", "on", "off"]
DeltaDtype = Literal["float32", "float16"]
Precision = Literal["float32", "bfloat16", "mixed_bfloat16"]
ConvWeightGrad = Literal["auto", "tensorflow", "gemm"]  # auto: hpcdl.engine.tuning's rule per CPU
SlurmSignal = Literal["USR1", "USR2", "TERM", "INT", "HUP"]


def choices(literal: Any) -> tuple[str, ...]:
    """The names a Literal field type allows, in their declared order."""
    return typing.get_args(literal)


MAX_SHARDS = 256  # appliers of one run; far beyond where one file per shard per exchange pays


def check_plain_text(name: str, value: str) -> None:
    """Names and paths that end up in run ids, file names and #SBATCH lines: no newlines, tabs or
    other control characters."""
    bad = sorted({repr(c) for c in value if ord(c) < 32 or ord(c) == 127})
    if bad:
        raise JobError(f"{name} {value!r} contains control characters ({', '.join(bad)}): not allowed")


RUNS_DIR = "runs"  # the default home of run directories, relative to where hpcdl runs

@dataclass(frozen=True)
class RunConfig:
    """How many nodes, in which groups, on which backend."""

    nodes: int = 1  # nodes in all (--nodes)
    group_size: int = 0  # 0: all nodes form one synchronous group
    ranks_per_node: int = 1  # Horovod ranks per node, sharing its cores
    backend: Backend = "auto"  # auto: slurm where sbatch is on PATH and the controller answers, else local
    runs_dir: str = RUNS_DIR  # where run directories are made; on a cluster, a file system every node sees
    max_restarts: int = 3  # per group, before the run gives that group up (local and SLURM)
    check_data: bool = True  # false: the data files exist only where the ranks run (compute nodes)
    check_finite: bool = True  # false: skip the NaN/Inf scan of data.train and data.val (it reads every value once)
    unix_group: str = ""  # empty: the run is owner-only; a group name: group-only (hpcdl.fs.access)
    controller: Controller = "auto"  # how a group's ranks talk: Horovod over gloo or mpi, or mpi4py (hpcdl.engine.collective); auto: gloo where Horovod loads, else mpi4py

    @property
    def mpi_launched(self) -> bool:
        """Whether an MPI launcher (mpirun, srun --mpi) starts a group's ranks: Horovod over MPI
        and mpi4py both take their world from it; Gloo has hpcdl's own rendezvous."""
        return self.controller in ("mpi", "mpi4py")

    def validate(self) -> None:
        check_plain_text("run.runs_dir", self.runs_dir)
        if self.unix_group and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", self.unix_group):
            raise JobError(f"run.unix_group {self.unix_group!r} is not a unix group name")
        _positive("run.nodes", self.nodes)
        _positive("run.ranks_per_node", self.ranks_per_node)
        if self.group_size < 0:
            raise JobError(f"run.group_size must be >= 0, got {self.group_size}")
        if self.max_restarts < 0:
            raise JobError(f"run.max_restarts must be >= 0, got {self.max_restarts}")
        if self.nodes % self.nodes_per_group:
            raise JobError(
                f"run.group_size {self.group_size} does not divide run.nodes {self.nodes}"
            )

    @property
    def nodes_per_group(self) -> int:
        return self.group_size or self.nodes

    @property
    def groups(self) -> int:
        return self.nodes // self.nodes_per_group

    @property
    def ranks_per_group(self) -> int:
        return self.nodes_per_group * self.ranks_per_node




@dataclass(frozen=True)
class TrainConfig:
    """The synchronous loop inside one group."""

    steps: int = 300  # training steps of each group
    batch_per_rank: int = 128  # examples per rank and step; a group's batch is this times its ranks
    optimizer: TrainOptimizer = "adam"  # the groups' own (inner) optimizer (hpcdl.engine.optim)
    learning_rate: float = 1e-3  # the inner optimizer's; the applier's default derives from it
    seed: int = 0  # the weights' initialisation and the order of the training data
    log_every: int = 10  # steps between metrics lines (groups/<g>/metrics.jsonl) and state updates
    checkpoint_every: int = 100  # steps between checkpoints (a stop checkpoints as well)
    keep_checkpoints: int = 3  # newest checkpoints kept per group
    final_save_retry_s: float = 600.0  # a full disk at the end: the last checkpoint and state retried this long
    validate_every: int = 100  # steps between validations on data.val (0: none); hybrid: the master
    validate_events: int = 1024  # the fixed subset: the first N examples of data.val

    def validate(self) -> None:
        for name in ("steps", "batch_per_rank", "log_every", "checkpoint_every", "keep_checkpoints",
                     "validate_events"):
            _positive(f"train.{name}", getattr(self, name))
        if self.validate_every < 0:
            raise JobError(f"train.validate_every must be >= 0 (0: no validation), got {self.validate_every}")
        if not self.final_save_retry_s >= 0:
            raise JobError(f"train.final_save_retry_s must be >= 0, got {self.final_save_retry_s}")
        if not self.learning_rate > 0:
            raise JobError(f"train.learning_rate must be > 0, got {self.learning_rate}")




@dataclass(frozen=True)
class ExchangeConfig:
    """The asynchronous channel between groups and the applier that owns the master weights.

    The algorithms (`kind`) and the applier's update rules are written down in
    :mod:`hpcdl.exchange`'s docstring and :mod:`hpcdl.applier.rules`.
    """

    enabled: ExchangeEnabled = "auto"  # auto: on when there is more than one group
    directory: str = ""  # empty: <run>/exchange; a Lustre path on a cluster
    kind: ExchangeKind = "gradient"  # gradient: the paper's; delta: local steps, then the weights' delta
    every: int = 1  # gradient: publish every N-th step's gradient; delta: H local steps per delta
    optimizer: UpdateRuleName = "adam"  # the applier's update rule (hpcdl.applier.rules)
    learning_rate: float = 0.0  # 0: from the number of groups (applier_learning_rate)
    momentum: float = 0.9  # momentum's and nesterov's μ, adam's β1
    momentum_delay: int = 0  # nesterov: momentum once every N arrivals (0: N = the groups)
    staleness_scaling: bool = False  # each update at lr / max(1, staleness) (Zhang et al.)
    max_outstanding: int = 2  # K: at most K unanswered updates a group (after the warm-up); 0: a root never waits
    warmup_steps: int = 200  # a group's first N steps wait as with max_outstanding = 1 (a safe cold start)
    reply_timeout_s: float = 60.0  # the longest a root waits for the applier's answer
    delta_dtype: DeltaDtype = "float32"  # delta: float16 halves the bytes exchanged
    max_staleness: int = 16  # master versions an update may be behind; staler ones meet stale_policy
    stale_policy: StalePolicy = "drop"  # drop: deleted unapplied; downweight: applied at lr / (1 + staleness)
    keep_versions: int = 3  # newest master weights versions kept in the exchange directory
    max_pending_per_group: int = 16  # twice the applier's batch: a keeping-up applier loses none
    drop_held_updates: bool = False  # a full disk: true drops a root's oldest held update past that bound; false waits for space
    shards: int | str = 1  # appliers, each owning a byte-balanced part of the tensors; "auto": hpcdl plan's

    def validate(self) -> None:
        check_plain_text("exchange.directory", self.directory)
        _positive("exchange.every", self.every)
        _positive("exchange.keep_versions", self.keep_versions)
        _positive("exchange.max_pending_per_group", self.max_pending_per_group)
        if self.max_staleness < 0:
            raise JobError(f"exchange.max_staleness must be >= 0, got {self.max_staleness}")
        if self.learning_rate < 0:
            raise JobError(f"exchange.learning_rate must be > 0, or 0 for the default, got {self.learning_rate}")
        if not 0.0 <= self.momentum < 1.0:
            raise JobError(f"exchange.momentum must be in [0, 1), got {self.momentum}")
        for name in ("momentum_delay", "max_outstanding", "warmup_steps"):
            if getattr(self, name) < 0:
                raise JobError(f"exchange.{name} must be >= 0, got {getattr(self, name)}")
        if not self.reply_timeout_s > 0:
            raise JobError(f"exchange.reply_timeout_s must be > 0, got {self.reply_timeout_s}")
        if self.shards != "auto" and (isinstance(self.shards, bool) or not isinstance(self.shards, int)
                                      or not 1 <= self.shards <= MAX_SHARDS):
            raise JobError(f"exchange.shards must be an integer from 1 to {MAX_SHARDS}, or \"auto\"; "
                           f"got {self.shards!r}")
        if self.delta_dtype != "float32" and self.kind != "delta":
            raise JobError("exchange.delta_dtype applies to exchange.kind = \"delta\" only")

    def active(self, groups: int) -> bool:
        return self.enabled == "on" or (self.enabled == "auto" and groups > 1)

    @property
    def shard_count(self) -> int:
        """The appliers of a submitted run (submit resolves "auto")."""
        if not isinstance(self.shards, int):
            raise JobError("exchange.shards = \"auto\" is resolved at submit; this job was not submitted")
        return self.shards

    def momentum_delay_for(self, groups: int) -> int:
        return self.momentum_delay or max(1, groups)


@dataclass(frozen=True)
class EmulateConfig:
    """Emulated stragglers and failures, for experiments only (off by default).

    Each rank-step is padded with a sleep to `step_seconds` × X, X drawn from a lognormal of
    spread `sigma` and mean 1, times `stall_factor` with probability `stall_probability`; the
    rank whose data shard is `slow_shard` is `slow_factor` times slower throughout; the rank of
    shard `kill_shard` kills itself (SIGKILL) `kill_after_s` seconds into the run, once. Draws
    are seeded by (seed, shard, step), so a run, restarts included, is reproducible.
    """

    enabled: bool = False  # pad every rank-step with an emulated straggler's sleep (experiments only)
    step_seconds: float = 0.25  # the step time the sleeps pad to, before the factor X
    sigma: float = 0.0  # spread of X, lognormal with mean 1
    stall_probability: float = 0.0  # chance that a step stalls
    stall_factor: float = 4.0  # a stalled step is this many times longer
    slow_shard: int = -1  # -1: none
    slow_factor: float = 2.0  # slow_shard's steps are this many times longer throughout
    kill_shard: int = -1  # -1: none
    kill_after_s: float = 30.0  # seconds into the run at which kill_shard kills itself
    seed: int = 0  # the draws are seeded by (seed, shard, step)

    def validate(self) -> None:
        if not self.step_seconds > 0:
            raise JobError(f"emulate.step_seconds must be > 0, got {self.step_seconds}")
        if self.sigma < 0:
            raise JobError(f"emulate.sigma must be >= 0, got {self.sigma}")
        if not 0.0 <= self.stall_probability <= 1.0:
            raise JobError(f"emulate.stall_probability must be in [0, 1], got {self.stall_probability}")
        for name in ("stall_factor", "slow_factor"):
            if getattr(self, name) < 1.0:
                raise JobError(f"emulate.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("slow_shard", "kill_shard"):
            if getattr(self, name) < -1:
                raise JobError(f"emulate.{name} must be a shard number or -1, got {getattr(self, name)}")
        if self.kill_after_s < 0:
            raise JobError(f"emulate.kill_after_s must be >= 0, got {self.kill_after_s}")
        if self.seed < 0:
            raise JobError(f"emulate.seed must be >= 0, got {self.seed}")


@dataclass(frozen=True)
class TuningConfig:
    """CPU settings applied before TensorFlow starts; 0 means derive from the cores a rank owns."""

    intra_op_threads: int = 0  # 0: the cores a rank owns
    inter_op_threads: int = 0  # 0: 2 when a rank owns >= 2 cores, else 1 (hpcdl.engine.tuning)
    onednn: bool = True  # oneDNN's kernels (TF_ENABLE_ONEDNN_OPTS)
    kmp_blocktime: int = 0  # KMP_BLOCKTIME, for OpenMP-linked libraries
    kmp_affinity: str = "granularity=fine,compact,1,0"  # KMP_AFFINITY, for OpenMP-linked libraries
    # "bfloat16": oneDNN's BF16 math mode on the float32 model (float32 where the CPU has no
    # bfloat16 unit); "mixed_bfloat16": bfloat16 activations with float32 weights and loss, for a
    # workload that computes in bfloat16 (hep, keras), refused where the CPU has no bfloat16 unit
    precision: Precision = "float32"
    # "tensorflow" (oneDNN's kernel) or "gemm" (matmuls) for a convolution's weight gradient in
    # hpcdl's own layers; "auto": hpcdl.engine.tuning's rule for the CPU
    conv_weight_grad: ConvWeightGrad = "auto"

    def validate(self) -> None:
        for name in ("intra_op_threads", "inter_op_threads", "kmp_blocktime"):
            if getattr(self, name) < 0:
                raise JobError(f"tuning.{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SlurmConfig:
    """What a site sets for its cluster; every value is quoted when rendered."""

    partition: str = ""  # #SBATCH --partition (empty: the site's default)
    applier_partition: str = ""  # empty: the same as `partition`; often a shared or service queue
    account: str = ""  # #SBATCH --account (empty: none)
    qos: str = ""  # #SBATCH --qos (empty: none)
    constraint: str = ""  # #SBATCH --constraint (empty: none)
    time: str = "01:00:00"  # #SBATCH --time of each job; a group near it checkpoints and requeues
    cpus_per_task: int = 0  # #SBATCH --cpus-per-task (0: the site's default)
    signal_seconds: int = 120  # how long before the time limit `signal` arrives
    signal: SlurmSignal = "USR1"  # what SLURM sends (named without SIG) the batch shell signal_seconds before the limit
    extra_sbatch: list[str] = field(default_factory=list)  # further #SBATCH lines, e.g. "--exclusive"
    setup: list[str] = field(default_factory=list)  # shell lines before the ranks, e.g. "module load python"
    template_dir: str = ""  # a site's copy of slurm_templates/ (empty: the shipped ones)
    rendezvous_host: str = ""  # empty: the batch host's name; the ranks must reach it
    gloo_iface: str = ""  # network interface for Gloo (e.g. ib0); empty: Gloo's choice
    mpi: str = "pmix"  # run.controller = "mpi": srun --mpi=<this> (pmix, pmi2, pmix_v4: srun --mpi=list)

    def validate(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", self.mpi):
            raise JobError(f"slurm.mpi must name an srun MPI plugin (e.g. pmix, pmi2; srun --mpi=list), "
                           f"got {self.mpi!r}")
        if self.cpus_per_task < 0:
            raise JobError(f"slurm.cpus_per_task must be >= 0, got {self.cpus_per_task}")
        if self.signal_seconds < 0:
            raise JobError(f"slurm.signal_seconds must be >= 0, got {self.signal_seconds}")


COMMON_SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "train": TrainConfig,
    "exchange": ExchangeConfig,
    "tuning": TuningConfig,
    "slurm": SlurmConfig,
    "emulate": EmulateConfig,
}


@dataclass(frozen=True)
class Job:
    """A resolved, validated job: what a run directory stores and every process reads."""

    name: str
    workload: str
    data: Any
    model: Any
    run: RunConfig
    train: TrainConfig
    exchange: ExchangeConfig
    tuning: TuningConfig
    slurm: SlurmConfig
    emulate: EmulateConfig = EmulateConfig()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "workload": self.workload}
        for section in ("data", "model", *COMMON_SECTIONS):
            out[section] = dataclasses.asdict(getattr(self, section))
        return out

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def replace(self, **sections: Any) -> "Job":
        return dataclasses.replace(self, **sections)


def build_job(raw: Mapping[str, Any], data_config: type | None = None, model_config: type | None = None) -> Job:
    """The job a parsed job file describes, `[data]` and `[model]` built as the workload's classes
    (hpcdl.jobfile finds them), or kept the plain tables they are when a class is None."""
    raw = dict(raw)
    workload_name = raw.pop("workload", None)
    if not isinstance(workload_name, str):
        raise JobError("the job file must name its workload, e.g. workload = \"hep\"")
    name = str(raw.pop("name", workload_name))
    sections: dict[str, Any] = {"data": data_config, "model": model_config, **COMMON_SECTIONS}
    unknown = set(raw) - set(sections)
    if unknown:
        raise JobError(f"unknown section(s) in job: {', '.join(sorted(unknown))}")
    built = {key: _build_section(key, cls, raw.get(key, {})) if cls is not None else _table(key, raw.get(key, {}))
             for key, cls in sections.items()}
    job = Job(name=name, workload=workload_name, **built)
    for value in built.values():
        if hasattr(value, "validate"):
            value.validate()
    return job


@dataclass(frozen=True)
class CommandLineValue:
    """An override as typed: parsed as TOML for typed fields (`3`, `1e-3`, `true`, `["a"]`), kept
    as the text for string fields, so `slurm.time=00:10:00` stays a string, not a TOML time."""

    text: str

    def for_type(self, hint: Any) -> Any:
        try:
            value = tomllib.loads(f"v = {self.text}")["v"]
        except tomllib.TOMLDecodeError:
            return self.text
        if (hint is str or typing.get_origin(hint) is Literal) and not isinstance(value, str):
            return self.text
        return value


def _table(section: str, values: Any) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise JobError(f"[{section}] must be a table")
    return dict(values)


def _build_section(section: str, cls: type, values: Any) -> Any:
    values = _table(section, values)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = set(values) - set(fields)
    if unknown:
        names = ", ".join(f"{section}.{k}" for k in sorted(unknown))
        raise JobError(f"unknown field {names} (known: {', '.join(sorted(fields))})")
    converted = {}
    for key, value in values.items():
        if isinstance(value, CommandLineValue):
            value = value.for_type(hints[key])
        elif isinstance(value, dict) and any(isinstance(v, CommandLineValue) for v in value.values()):
            if typing.get_origin(hints[key]) is not dict:
                raise JobError(f"{section}.{key} is not a table: --set {section}.{key}=VALUE sets it")
            value = {k: v.for_type(Any) if isinstance(v, CommandLineValue) else v for k, v in value.items()}
        converted[key] = _coerce(f"{section}.{key}", hints[key], value)
    return cls(**converted)


def _coerce(name: str, hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        if not isinstance(value, str) or value not in choices(hint):
            raise JobError(f"{name} must be one of {', '.join(choices(hint))}; got {value!r}")
        return value
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise JobError(f"{name} must be a list, got {value!r}")
        return [_coerce(name, item_type, v) for v in value]
    if origin is tuple:
        item_type = typing.get_args(hint)[0]
        if not isinstance(value, list):
            raise JobError(f"{name} must be a list, got {value!r}")
        return tuple(_coerce(name, item_type, v) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise JobError(f"{name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise JobError(f"{name} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise JobError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):  # no setting means anything at nan or inf; JSON cannot hold them
            raise JobError(f"{name} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise JobError(f"{name} must be a string, got {value!r}")
        return value
    return value


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise JobError(f"{name} must be >= 1, got {value}")
