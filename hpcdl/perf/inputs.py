"""What the planner assumes: every input, its unit, its meaning and where its value came from.

The inputs are one table (:data:`FIELDS`), the presets are tables of (value, source)
(:data:`PAPER_CORI_HEP`, :data:`HPCDL_DEFAULTS`), and :class:`PlanInputs` holds one set of
values with their sources, so a plan can print what it rests on beside every figure. The
paper's inputs are discussed, figure by figure, in README's Figures section.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

from hpcdl.config import DeltaDtype, ExchangeKind, choices
from hpcdl.fs.files import read_regular
from hpcdl.workloads import get_workload


class InputField(NamedTuple):
    name: str
    unit: str
    meaning: str


FIELDS: tuple[InputField, ...] = (
    InputField("node_flops", "FLOP/s", "sustained training rate of one node (R)"),
    InputField("flops_per_example", "FLOP", "training FLOPs per example (F)"),
    InputField("batch_per_node", "examples", "examples per node per step (b)"),
    InputField("model_bytes", "bytes", "fp32 weights (and gradient) size (n)"),
    InputField("allreduce_latency", "s", "network latency per tree round (α)"),
    InputField("allreduce_bandwidth", "bytes/s", "network point-to-point bandwidth (B)"),
    InputField("straggler_sigma", "", "lognormal σ of one node's step time, E[X]=1"),
    InputField("stall_probability", "", "chance a node's step stalls"),
    InputField("stall_factor", "×", "a stalled step's time over an ordinary one"),
    InputField("slow_node_fraction", "", "share of nodes persistently slow"),
    InputField("slow_factor", "×", "a slow node's step time over the others'"),
    InputField("exchange_kind", "", "update a group publishes: gradient or delta"),
    InputField("exchange_every", "steps", "steps between a group's updates (H)"),
    InputField("delta_dtype", "", "dtype of a delta on the wire (kind delta)"),
    InputField("max_outstanding", "updates (0: never wait)", "unanswered updates a group may have (K)"),
    InputField("exchange_latency", "s", "exchange medium latency per operation (λ)"),
    InputField("exchange_bandwidth", "bytes/s", "exchange medium bandwidth per client (W)"),
    InputField("applier_bytes_per_s", "bytes/s", "applier's optimizer throughput (A)"),
    InputField("applier_max_batch", "updates", "updates applied per weights publish"),
    InputField("exchange_shards", "appliers", "appliers the tensors are partitioned over (S)"),
    InputField("max_pending_per_group", "updates (0: no bound)", "backlog bound per group"),
    InputField("max_staleness", "versions (-1: none)", "updates staler than this are dropped"),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Inputs files written before `max_outstanding` said `exchange_blocking = true/false`.
LEGACY_BLOCKING = "exchange_blocking"


class Assumption(NamedTuple):
    """One printed row: an input, its value and unit, what it means, where it came from."""

    name: str
    value: Any
    unit: str
    meaning: str
    source: str


def shape_text(shape: Sequence[int]) -> str:
    """An input shape as the CLI's --input-shape takes it: 224x224x3."""
    return "x".join(str(int(x)) for x in shape)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner assumes; FIELDS says what each means, `sources` where it is from."""

    node_flops: float
    flops_per_example: float
    batch_per_node: int
    model_bytes: float
    allreduce_latency: float
    allreduce_bandwidth: float
    straggler_sigma: float
    stall_probability: float = 0.0
    stall_factor: float = 1.0
    slow_node_fraction: float = 0.0
    slow_factor: float = 1.0
    exchange_kind: str = "gradient"
    exchange_every: int = 1
    delta_dtype: str = "float32"
    max_outstanding: int = 0
    exchange_latency: float = 5e-3
    exchange_bandwidth: float = 1e9
    applier_bytes_per_s: float = 1e9
    applier_max_batch: int = 32
    exchange_shards: int = 1
    max_pending_per_group: int = 4
    max_staleness: int = 16
    label: str = "custom"
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("node_flops", "flops_per_example", "model_bytes", "allreduce_bandwidth",
                     "exchange_bandwidth", "applier_bytes_per_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("allreduce_latency", "exchange_latency", "straggler_sigma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("stall_probability", "slow_node_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be between 0 and 1, got {getattr(self, name)!r}")
        for name in ("stall_factor", "slow_factor"):
            value = getattr(self, name)
            if not (value >= 1 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 1, got {value!r}")
        for name in ("batch_per_node", "exchange_every", "applier_max_batch", "exchange_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name, allowed in (("exchange_kind", choices(ExchangeKind)), ("delta_dtype", choices(DeltaDtype))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; "
                                 f"got {getattr(self, name)!r}")
        if self.delta_dtype != "float32" and self.exchange_kind != "delta":
            raise ValueError('delta_dtype applies to exchange_kind = "delta" only')
        if self.max_outstanding < 0:
            raise ValueError("max_outstanding must be >= 0 (0: a group never waits)")
        if self.max_pending_per_group < 0:
            raise ValueError("max_pending_per_group must be >= 0 (0: no bound)")
        if self.max_staleness < -1:
            raise ValueError("max_staleness must be >= -1 (-1: none)")

    # -- presets ------------------------------------------------------------------------------

    @classmethod
    def paper_cori_hep(cls) -> "PlanInputs":
        """The paper's HEP run on Cori Phase II (Xeon Phi 7250 + Aries); sources as printed."""
        return cls.from_preset(PAPER_CORI_HEP, label="paper: Kurth et al. SC17, HEP on Cori Phase II")

    @classmethod
    def measured_here(cls, node_flops: float, *, batch_per_node: int = 128,
                      input_shape: Sequence[int] = (224, 224, 3), model: Any = None, network: str = "hep",
                      source: str = "measured on this machine", **overrides: Any) -> "PlanInputs":
        """hpcdl's own scheme (:data:`HPCDL_DEFAULTS`) with a node rate measured here.

        `model` is the ModelConfig of the workload named `network` (its `cost(input_shape)` counts
        the network's FLOPs and size), by default that of hpcdl's default job, hep, at the paper's
        images. Every other field keeps its default unless given in `overrides`, whose source is
        `source`.
        """
        model = model if model is not None else default_model()
        flops, params = model.cost(tuple(input_shape))
        described = f"the {network} network at {shape_text(input_shape)}"
        preset = dict(HPCDL_DEFAULTS)
        preset.update(
            node_flops=(float(node_flops), source),
            flops_per_example=(float(flops.training), f"{described}, its ModelConfig.cost"),
            batch_per_node=(int(batch_per_node), "hpcdl's HEP job (jobs/hep.toml)"
                            if batch_per_node == 128 else source),
            model_bytes=(float(params * 4), f"{params:,} fp32 parameters of {described}"),
        )
        base = cls.from_preset(preset, label=f"hpcdl, node rate: {source.split(':')[0]}")
        return base.with_values(source, **overrides) if overrides else base

    @classmethod
    def from_preset(cls, preset: Mapping[str, tuple[Any, str]], label: str) -> "PlanInputs":
        """Inputs from a table of name → (value, source) covering every field."""
        missing = [name for name in FIELD_NAMES if name not in preset]
        if missing:
            raise ValueError(f"preset {label!r} lacks {', '.join(missing)}")
        return cls(label=label, sources=tuple((k, preset[k][1]) for k in FIELD_NAMES),
                   **{k: preset[k][0] for k in FIELD_NAMES})

    @classmethod
    def load(cls, spec: str | Path) -> "PlanInputs":
        """``"paper"`` or a JSON/TOML file of fields.

        A file's fields override a base preset: ``base = "paper"``, or ``base = "hpcdl"`` (the
        default), which is :meth:`measured_here` and then needs ``node_flops`` in the file.
        Unknown fields are an error that names them.
        """
        if str(spec) == "paper":
            return cls.paper_cori_hep()
        path = Path(spec)
        raw = _read_table(path)
        base_name = raw.pop("base", "hpcdl")
        source = f"given in {path.name}"
        if base_name == "paper":
            base = cls.paper_cori_hep()
        elif base_name == "hpcdl":
            if "node_flops" not in raw:
                raise ValueError(f"{path}: node_flops is required (or base = \"paper\")")
            base = cls.measured_here(raw.pop("node_flops"), source=source)
        else:
            raise ValueError(f"{path}: base must be \"paper\" or \"hpcdl\", got {base_name!r}")
        return base.with_values(source, **raw)

    # -- changing and showing -----------------------------------------------------------------

    def with_values(self, source: str, **values: Any) -> "PlanInputs":
        """A copy with `values` changed, their source recorded; unknown or mistyped: error."""
        return self.with_sourced({k: (v, source) for k, v in _translate_legacy(values).items()})

    def with_sourced(self, values: Mapping[str, tuple[Any, str]]) -> "PlanInputs":
        """A copy with name → (value, source) changed at once; unknown or mistyped: error."""
        unknown = set(values) - set(FIELD_NAMES) - {"label"}
        if unknown:
            raise ValueError(f"unknown planner input(s): {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(FIELD_NAMES)})")
        types = {f.name: f.type for f in dataclasses.fields(self)}
        clean = {name: _checked(name, types[name], value) for name, (value, _) in values.items()}
        src = dict(self.sources)
        src.update({k: source for k, (_, source) in values.items() if k != "label"})
        return dataclasses.replace(self, sources=tuple(src.items()), **clean)

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "given")

    def assumptions(self) -> list[Assumption]:
        """Every input with its value, unit, meaning and source: what the plan rests on."""
        return [Assumption(f.name, getattr(self, f.name), f.unit, f.meaning, self.source(f.name))
                for f in FIELDS]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in FIELD_NAMES}
        out["label"] = self.label
        out["sources"] = {name: self.source(name) for name in FIELD_NAMES}
        return out

    # -- derived ------------------------------------------------------------------------------

    @property
    def compute_seconds(self) -> float:
        """t_c = b·F / R: one node's compute for one step, no stragglers."""
        return self.batch_per_node * self.flops_per_example / self.node_flops

    @property
    def waits_for_replies(self) -> bool:
        """K ≥ 1: a group root may wait for the applier (K = 1: the paper's parameter server)."""
        return self.max_outstanding > 0

    @property
    def update_bytes(self) -> float:
        """Bytes of one update: a fp32 gradient, or a delta in `delta_dtype` (same shapes)."""
        if self.exchange_kind == "delta":
            return self.model_bytes * DTYPE_BYTES[self.delta_dtype] / 4
        return self.model_bytes

    @property
    def transfer_seconds(self) -> float:
        """S·λ + n/W: a group root reads the (fp32) master weights, one file per shard."""
        return self.exchange_shards * self.exchange_latency + self.model_bytes / self.exchange_bandwidth

    @property
    def update_transfer_seconds(self) -> float:
        """S·λ + u/W: a group root publishes an update (u = update_bytes), one file per shard."""
        return self.exchange_shards * self.exchange_latency + self.update_bytes / self.exchange_bandwidth

    @property
    def apply_seconds(self) -> float:
        """n/(S·A): one shard's optimizer over its parameters, whatever the wire dtype."""
        return self.model_bytes / self.exchange_shards / self.applier_bytes_per_s

    def applier_batch_seconds(self, updates: int, applied: int | None = None) -> float:
        """One shard's busy time for one batch: read each, apply those not dropped, publish once
        (every shard sees every update, each 1/S of it).

        A waiting group (K ≥ 1) needs an answer even when its update was dropped, so the new
        weights are published then too.
        """
        applied = updates if applied is None else applied
        shard = self.exchange_shards
        read = self.exchange_latency + self.update_bytes / shard / self.exchange_bandwidth
        publish = (self.exchange_latency + self.model_bytes / shard / self.exchange_bandwidth
                   if (applied > 0 or self.waits_for_replies) else 0.0)
        return updates * read + applied * self.apply_seconds + publish

    @property
    def applier_seconds_per_update(self) -> float:
        """The applier's time per update in full batches (read, apply, share of the publish)."""
        m = self.applier_max_batch
        return self.applier_batch_seconds(m) / m

    @property
    def applier_capacity(self) -> float:
        """Updates/s the applier can apply at most (full batches of `applier_max_batch`)."""
        return 1.0 / self.applier_seconds_per_update


def _read_table(path: Path) -> dict[str, Any]:
    try:
        text = read_regular(path, 1 << 20).decode("utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read planner inputs {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"cannot parse planner inputs {path}: not UTF-8 text") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot parse planner inputs {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a table of fields")
    return dict(raw)


def _translate_legacy(values: dict[str, Any]) -> dict[str, Any]:
    if LEGACY_BLOCKING not in values:
        return values
    values = dict(values)
    blocking = values.pop(LEGACY_BLOCKING)
    if not isinstance(blocking, bool):
        raise ValueError(f"{LEGACY_BLOCKING} must be true or false, got {blocking!r}")
    if "max_outstanding" in values:
        raise ValueError(f"give max_outstanding or {LEGACY_BLOCKING}, not both")
    values["max_outstanding"] = 1 if blocking else 0
    return values


def _checked(name: str, kind: str, value: Any) -> Any:
    """`value` if it has the field's type (ints accepted as floats); else a ValueError naming it."""
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        value = float(value)
    elif kind == "str" and not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value


# -- presets: name -> (value, source) -------------------------------------------------------------

def default_model():
    """The network of hpcdl's default job (hep), through the workload registry."""
    return get_workload("hep").ModelConfig()


_PAPER_FLOPS, _PAPER_PARAMS = default_model().cost((224, 224, 3))

# The paper's HEP run at ~9600 nodes. README's Figures section says which of these are certain,
# which recalled, and how much the paper check depends on each.
PAPER_CORI_HEP: dict[str, tuple[Any, str]] = {
    "node_flops": (1.90e12, "paper: HEP single-node rate on a Xeon Phi 7250 (Intel Caffe)"),
    "flops_per_example": (float(_PAPER_FLOPS.training),
                          "hpcdl's hep network at 224x224x3, its ModelConfig.cost"),
    "batch_per_node": (8, "paper's per-node batch at scale (recalled; uncertain)"),
    "model_bytes": (float(_PAPER_PARAMS * 4), f"{_PAPER_PARAMS:,} fp32 parameters of the HEP network"),
    "allreduce_latency": (3.7e-6, "NERSC Cori page: Aries MPI latency 0.25-3.7 us (top)"),
    "allreduce_bandwidth": (8e9, "NERSC Cori page: Aries MPI bandwidth ~8 GB/s"),
    "straggler_sigma": (0.10, "ASSUMED (round, not measured or fitted): 10% spread"),
    "stall_probability": (0.0, "not modelled (the paper's figures are of stragglers' spread)"),
    "stall_factor": (1.0, "not modelled"),
    "slow_node_fraction": (0.0, "not modelled"),
    "slow_factor": (1.0, "not modelled"),
    "exchange_kind": ("gradient", "paper: groups send gradients to the parameter server"),
    "exchange_every": (1, "paper: every group step goes to the parameter server"),
    "delta_dtype": ("float32", "not used by kind gradient"),
    "max_outstanding": (1, "paper (as recalled): groups wait for the PS's weights"),
    "exchange_latency": (3.7e-6, "parameter server over Aries: MPI latency"),
    "exchange_bandwidth": (8e9, "parameter server over Aries: MPI bandwidth"),
    "applier_bytes_per_s": (4e9, "ASSUMED: SGD update on one KNL node (memory-bound)"),
    "applier_max_batch": (1, "a parameter server replies to each group"),
    "exchange_shards": (1, "ASSUMED: the paper does not give its server-rank count; one here"),
    "max_pending_per_group": (0, "one outstanding update per group (blocking)"),
    "max_staleness": (-1, "paper: no staleness bound"),
}

_GENERIC = "ASSUMED: generic cluster default; override"
_HPCDL = "hpcdl defaults (jobs/hep.toml, hpcdl.applier)"
_NOT_MODELLED = "ASSUMED: none; measure them (plan --from-run)"

# hpcdl on a generic cluster: a non-blocking exchange through a Lustre directory (a few ms per
# file operation, ~1 GB/s per client), the compiled Adam applier (~4 GB/s of gradient) and a
# 100 Gb/s-class network (2 µs, 10 GB/s). The node rate, the network's FLOPs and size and the
# batch are filled in by PlanInputs.measured_here.
HPCDL_DEFAULTS: dict[str, tuple[Any, str]] = {
    "allreduce_latency": (2e-6, _GENERIC),
    "allreduce_bandwidth": (10e9, _GENERIC),
    "straggler_sigma": (0.05, "ASSUMED: 5% per-node step-time spread; override or measure "
                              "(plan --from-run)"),
    "stall_probability": (0.0, _NOT_MODELLED),
    "stall_factor": (1.0, _NOT_MODELLED),
    "slow_node_fraction": (0.0, _NOT_MODELLED),
    "slow_factor": (1.0, _NOT_MODELLED),
    "exchange_kind": ("gradient", _HPCDL),
    "exchange_every": (1, _HPCDL),
    "delta_dtype": ("float32", _HPCDL),
    "max_outstanding": (2, "hpcdl defaults (exchange.max_outstanding; its warm-up is not modelled)"),
    "exchange_latency": (5e-3, _GENERIC),
    "exchange_bandwidth": (1e9, _GENERIC),
    "applier_bytes_per_s": (4e9, "measured: Adam + finite check of a 2.38 MB update in 0.6 ms "
                                 "on one AVX2 core (python -m bench.exchange_load --breakdown)"),
    "applier_max_batch": (32, _HPCDL),
    "exchange_shards": (1, _HPCDL),
    "max_pending_per_group": (4, _HPCDL),
    "max_staleness": (16, _HPCDL),
}

# Job fields ([exchange] section) that are planner inputs, and the input each one sets.
JOB_EXCHANGE_FIELDS: dict[str, str] = {
    "kind": "exchange_kind",
    "every": "exchange_every",
    "delta_dtype": "delta_dtype",
    "max_outstanding": "max_outstanding",
    "max_staleness": "max_staleness",
    "stale_policy": "max_staleness",
    "max_pending_per_group": "max_pending_per_group",
    "shards": "exchange_shards",
}


def job_exchange_values(exchange: Any, fields: Sequence[str] | None = None) -> dict[str, Any]:
    """Planner inputs from a job's ExchangeConfig (`fields`: only these job fields).

    ``stale_policy = "downweight"`` applies stale updates at a lower weight instead of dropping
    them, so the planner then drops nothing (max_staleness −1).
    """
    values: dict[str, Any] = {}
    for name in (JOB_EXCHANGE_FIELDS if fields is None else fields):
        if JOB_EXCHANGE_FIELDS[name] == "max_staleness":
            downweight = exchange.stale_policy == "downweight"
            values["max_staleness"] = -1 if downweight else exchange.max_staleness
        elif name == "shards" and exchange.shards == "auto":
            continue  # the planner recommends it (recommend_shards)
        else:
            values[JOB_EXCHANGE_FIELDS[name]] = getattr(exchange, name)
    return values


def with_job_exchange(inputs: PlanInputs, job_name: str, overrides: Sequence[str] = (), *,
                      whole_section: bool) -> PlanInputs:
    """`inputs` with the exchange of job `job_name` (a name in jobs/ or a .toml path).

    `overrides` are ``exchange.KEY=VALUE`` as `hpcdl submit --set` takes them (only the job
    fields in :data:`JOB_EXCHANGE_FIELDS`); with `whole_section` every one of those fields comes
    from the job, else only the overridden ones. The job is loaded and validated as a submit
    would, so a value the job refuses is refused here too.
    """
    given = []
    for item in overrides:
        key = item.partition("=")[0].strip()
        section, _, name = key.partition(".")
        if section != "exchange" or name not in JOB_EXCHANGE_FIELDS:
            raise ValueError(f"plan takes --set exchange.KEY=VALUE for KEY in "
                             f"{', '.join(JOB_EXCHANGE_FIELDS)}; got {key!r}")
        given.append(name)
    if not whole_section and not given:
        return inputs
    from hpcdl.jobfile import load_job, resolve_job_path

    job = load_job(job_name, list(overrides))
    fields = list(JOB_EXCHANGE_FIELDS) if whole_section else given
    origin = f"job {resolve_job_path(job_name).name}"
    sourced: dict[str, tuple[Any, str]] = {}
    for name in fields:
        target = JOB_EXCHANGE_FIELDS[name]
        found = job_exchange_values(job.exchange, [name])
        if target not in found:
            continue  # exchange.shards = "auto": what the plan recommends
        value = found[target]
        overridden = [f for f in given if JOB_EXCHANGE_FIELDS[f] == target]
        source = (f"--set exchange.{overridden[-1]}" if overridden
                  else f"{origin}: exchange.{name}")
        if target not in sourced or overridden:
            sourced[target] = (value, source)
    return inputs.with_sourced(sourced)
