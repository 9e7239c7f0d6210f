"""Scale planner: how to split N nodes into groups, predicted before an allocation is spent.

Pure Python + numpy (no TensorFlow), deterministic for a seed. For each candidate group count G
(N/G nodes per group, P) it predicts the step time of a group, the sustained and peak FLOP/s of
the whole machine, the applier's load and the staleness of the updates it applies, and it
recommends a group count. Every input is a field of :class:`PlanInputs` and is printed with its
source (:meth:`PlanInputs.assumptions`).

The model
=========
One synchronous step of a group of P nodes (b examples per node, F training FLOPs per example,
R sustained training FLOP/s of one node):

* compute, one node:  t_c = b·F / R
* stragglers: node i of the group takes t_c·X_i this step, X_i iid lognormal with E[X] = 1:
  X = exp(σZ − σ²/2), Z standard normal. The group waits for its slowest node, so its compute
  time is t_c·max(X_1..X_P). The max of P iid draws is sampled exactly by inversion
  (max = F⁻¹(U^(1/P)), U uniform), one draw per group and step, so 9600 nodes cost no more than
  one. The straggler wait is E[max] − t_c.
* allreduce (and the broadcast of adopted weights), recursive doubling / binomial tree:
  T(P, n) = ⌈log₂ P⌉ · (α + n/B) for P > 1, 0 for P = 1, with n the gradient's bytes, α the
  network's latency and B its point-to-point bandwidth. (Each of the ⌈log₂ P⌉ rounds moves the
  whole buffer; for large messages this is an upper bound: a Rabenseifner allreduce needs
  ≈ 2n/B + 2⌈log₂ P⌉α.)
* group step = t_c·max(X) + T(P, n), plus the exchange's cost on the group's critical path every
  `exchange_every` steps (from the simulation below).

The exchange and the applier (a small discrete-event simulation, per candidate)
------------------------------------------------------------------------------
Groups run their steps (times drawn as above); every `exchange_every` steps a group's root
publishes its update (n bytes; a transfer costs λ + n/W, λ the exchange medium's latency per
operation, W its bandwidth per client). The applier serves updates in arrival order, one server,
up to `applier_max_batch` at a time: each update costs a read (λ + n/W) and an apply
(n / applier_bytes_per_s), and each batch ends with one publish of the new master weights
(λ + n/W). The master version counts applied updates; an update's staleness is
``master version at apply − version its group's weights came from`` (hpcdl.applier's definition);
an update staler than `max_staleness` is dropped unapplied (if max_staleness ≥ 0), and a group
whose pending updates exceed `max_pending_per_group` deletes its oldest (hpcdl.exchange.Channel's
backlog bound). Two ways a group meets the applier:

* non-blocking (hpcdl, ``exchange_blocking=False``): the root publishes (λ + n/W), lists the
  directory (λ) and, if a newer master version is published, reads it (λ + n/W) and broadcasts
  it in the group (T(P, n)); it never waits for the applier.
* blocking (the paper's parameter server, ``exchange_blocking=True``): the root sends its update
  and waits until the applier has applied it and sent back the new weights, then broadcasts them
  (λ + T(P, n) after the applier's batch ends).

Same-time events are handled in the order they were scheduled, the applier's completions first.
Results:

* staleness distribution: of updates published after the first fifth of the rounds (warm-up);
* sustained FLOP/s = Σ_groups steps·P·b·F / (time of the group's last step): stragglers,
  allreduce and exchange included;
* peak FLOP/s = N·b·F / (10th percentile of the group step time without exchange): the rate of
  the fast steps, as a "peak" measured over the best iterations is;
* applier load: updates/s offered (u, from the simulation), the applier's capacity with full
  batches of m = `applier_max_batch`, m / (m·(λ + n/W + n/A) + λ + n/W) updates/s (A: the
  applier's optimizer throughput in gradient bytes/s), and its utilisation u / capacity;
  ``saturated`` when ≥ 1. Saturated, a non-blocking applier's queue grows: staleness grows until
  updates are dropped by the staleness or the backlog bound (the simulation counts them); a
  blocking one (closed loop) slows every group down to the applier's pace instead. Also the
  bytes/s through the exchange medium: group writes, applier reads, weight publishes and the
  groups' reads of adopted weights.

With one group there is no exchange (as hpcdl's ``exchange.enabled = "auto"``): staleness 0.

Recommendation rule
-------------------
Among candidates with applier utilisation < 1, mean staleness ≤ `staleness_bound` (default 8)
and at most 1 % of updates dropped, take the highest predicted sustained FLOP/s; a candidate with
fewer groups within 1 % of that figure is preferred (less staleness for the same speed). The
bound of 8 is a convergence judgement, not a performance one: staleness ≈ G − 1 (blocking) or
≈ G (non-blocking) when every group adopts the newest weights; the paper's runs at scale used
about 8–9 groups (as recalled, see below), and staler updates are known to cost asynchronous SGD
progress per update; hpcdl's default ``exchange.max_staleness`` of 16 drops updates at twice
that. Pass another bound to :func:`plan` for a model known to tolerate more.

The paper check (Kurth et al., "Deep Learning at 15PF", SC17, arXiv:1708.05256)
==============================================================================
:meth:`PlanInputs.paper_cori_hep` gives the paper's own inputs; :func:`paper_check` runs them at
the paper's HEP configuration and compares with the paper's figures. What the paper reports, from
memory of the paper (no copy of it was at hand while this was written; treat the configuration
details as uncertain):

* abstract: ~2 TFLOP/s on one Cori Phase-II Xeon Phi node; on ~9600 nodes, peak 11.73–15.07 and
  sustained 11.41–13.27 PFLOP/s. HEP is the lower figure of each range: peak 11.73, sustained
  11.41 PFLOP/s; climate 15.07 / 13.27. (Abstract figures: certain. HEP ↔ lower end: very likely,
  climate's single-node rate being the higher one.)
* single node: HEP 1.90 TFLOP/s, climate 2.09 TFLOP/s (Intel Caffe + MKL 2017 on a Xeon Phi 7250,
  68 cores at 1.4 GHz, ~6 TFLOP/s single-precision peak). Likely.
* HEP at full scale: 9594 worker nodes in 9 synchronous groups of 1066, plus one parameter-server
  node per parameterised layer (6 for HEP: 9600 in all; climate 9608 workers in 8 groups + 14 =
  9622). Uncertain; the prediction barely depends on it (the groups are ~1000 nodes either way).
* per-node batch 8 at scale (weak scaling). Uncertain; it sets the ratio of compute to
  communication, which is small either way for this 2.4 MB model (see below).

Aries (Cray XC40 dragonfly), from NERSC's Cori configuration page: MPI latency 0.25–3.7 µs, MPI
bandwidth ~8 GB/s. The planner takes α = 3.7 µs (the top of the range: Xeon Phi's slow cores add
software overhead, and a 1000-node tree crosses the dragonfly's global links) and B = 8 GB/s.

The HEP model's size and cost are computed here from hpcdl's HEP network (the paper's published
benchmark network: 5 convolutions 3×3×128, the first 3→128, 2×2 max-pool after the first four,
dense 128→2) at 224×224×3, with the FLOP formulas of hpcdl.nn (2·H_out·W_out·k²·C_in·C_out
forward, backward 1× forward for the first layer, 2× for the others): 594,178 parameters
(2,376,712 bytes, fp32) and 15.43 GFLOP per training example.

The straggler spread σ is the least known input and the one the prediction depends on most:
with the figures above a step computes for 65 ms and communicates for ~8 ms (allreduce 3.3 ms,
parameter-server round trip and broadcast 4.9 ms), so most of the gap between 18.2 PFLOP/s
(9594 × 1.90 TFLOP/s) and the paper's 11.41 must be waiting for the slowest of ~1000 nodes.
That such variability exists on Cori's KNL nodes is documented (NERSC's "KNL cache mode
performance" page: MCDRAM used as a direct-mapped cache thrashes, with run-to-run and node-to-node
differences; a CUG survey of non-I/O variability on Cori adds clock-frequency scaling and network
congestion), and the paper motivates its hybrid scheme by stragglers (as recalled); but no source
at hand gives its size for a DL step. The planner takes σ = 0.10 (a 10 % coefficient of
variation of one node's step time): a round figure, not a measurement, and not fitted to the
paper's number (σ = 0.12 would hit it exactly); it is named and printed as an assumption. With it
the planner predicts 12.1 PFLOP/s sustained (+6 %) and 13.3 PFLOP/s peak (+13 % on 11.73) for 9
groups of 1066. How much the agreement rests on the uncertain inputs (tests pin the σ band):

* σ: within ±15 % for about 0.073 ≤ σ ≤ 0.175; σ = 0.05 gives +23 %, σ = 0 (no stragglers) +42 %;
* per-node batch: within ±15 % for 3 ≤ b ≤ ~100 (b = 1: −33 %, b = 128: +15.1 %);
* group count: 1 to 18 groups of the 9594 nodes all land within +1 % … +9 %.

So the check confirms the shape of the model (compute-bound steps slowed by their slowest node,
little communication) more than it confirms σ; where a machine is at hand, measure σ (per-node
step times of a synchronous run) rather than trusting 0.10.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from hpcdl.flops import FlopCount

# The paper's reported figures for HEP at ~9600 nodes (see the module docstring).
PAPER_HEP_SUSTAINED_FLOPS = 11.41e15
PAPER_HEP_PEAK_FLOPS = 11.73e15
PAPER_HEP_WORKERS = 9594
PAPER_HEP_GROUPS = 9

TARGET_UPDATES = 2000  # updates simulated per candidate (more rounds for fewer groups)
MIN_ROUNDS = 30  # exchanges per group, at least
PEAK_QUANTILE = 0.10
MAX_DROPPED_FRACTION = 0.01
TIE_FRACTION = 0.01


# -- the HEP network, analytically -----------------------------------------------------------


def hep_network(image: Sequence[int] = (224, 224, 3), filters: int = 128, conv_layers: int = 5,
                kernel: int = 3, pool: int = 2) -> tuple[FlopCount, int]:
    """FLOPs per example and parameter count of hpcdl's HEP network, without TensorFlow.

    The same formulas as ``HepCNN.flops()`` (hpcdl.nn): 'same' convolutions of stride 1, pooling
    `pool` after every convolution but the last, then global average pool and dense to 2 logits.
    """
    h, w, c = (int(x) for x in image)
    channels = [c] + [filters] * conv_layers
    forward = backward = params = 0
    for i in range(conv_layers):
        fwd = 2 * h * w * kernel * kernel * channels[i] * channels[i + 1]
        forward += fwd
        backward += fwd * (2 if i > 0 else 1)
        params += kernel * kernel * channels[i] * channels[i + 1] + channels[i + 1]
        if i < conv_layers - 1:
            h, w = h // pool, w // pool
    dense = 2 * filters * 2
    forward += dense
    backward += 2 * dense
    params += filters * 2 + 2
    return FlopCount(forward, backward), params


# -- inputs ----------------------------------------------------------------------------------

_UNITS = {
    "node_flops": "FLOP/s",
    "flops_per_example": "FLOP",
    "batch_per_node": "examples",
    "model_bytes": "bytes",
    "allreduce_latency": "s",
    "allreduce_bandwidth": "bytes/s",
    "straggler_sigma": "",
    "exchange_every": "steps",
    "exchange_blocking": "",
    "exchange_latency": "s",
    "exchange_bandwidth": "bytes/s",
    "applier_bytes_per_s": "bytes/s",
    "applier_max_batch": "updates",
    "max_pending_per_group": "updates (0: no bound)",
    "max_staleness": "versions (-1: none)",
}

_MEANING = {
    "node_flops": "sustained training rate of one node (R)",
    "flops_per_example": "training FLOPs per example (F)",
    "batch_per_node": "examples per node per step (b)",
    "model_bytes": "gradient / weights size exchanged (n)",
    "allreduce_latency": "network latency per tree round (α)",
    "allreduce_bandwidth": "network point-to-point bandwidth (B)",
    "straggler_sigma": "lognormal σ of one node's step time, E[X]=1",
    "exchange_every": "steps between a group's updates",
    "exchange_blocking": "group waits for the applier's reply",
    "exchange_latency": "exchange medium latency per operation (λ)",
    "exchange_bandwidth": "exchange medium bandwidth per client (W)",
    "applier_bytes_per_s": "applier's optimizer throughput (A)",
    "applier_max_batch": "updates applied per weights publish",
    "max_pending_per_group": "backlog bound per group",
    "max_staleness": "updates staler than this are dropped",
}


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner assumes; see the module docstring for the model that uses it."""

    node_flops: float
    flops_per_example: float
    batch_per_node: int
    model_bytes: float
    allreduce_latency: float
    allreduce_bandwidth: float
    straggler_sigma: float
    exchange_every: int = 1
    exchange_blocking: bool = False
    exchange_latency: float = 5e-3
    exchange_bandwidth: float = 1e9
    applier_bytes_per_s: float = 1e9
    applier_max_batch: int = 8
    max_pending_per_group: int = 4
    max_staleness: int = 16
    label: str = "custom"
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("node_flops", "flops_per_example", "model_bytes", "allreduce_bandwidth",
                     "exchange_bandwidth", "applier_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("allreduce_latency", "exchange_latency", "straggler_sigma"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("batch_per_node", "exchange_every", "applier_max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_pending_per_group < 0:
            raise ValueError("max_pending_per_group must be >= 0 (0: no bound)")
        if self.max_staleness < -1:
            raise ValueError("max_staleness must be >= -1 (-1: none)")

    # -- presets ------------------------------------------------------------------------------

    @classmethod
    def paper_cori_hep(cls) -> "PlanInputs":
        """The paper's HEP run on Cori Phase II (Xeon Phi 7250 + Aries); sources as printed."""
        flops, params = hep_network()
        src = {
            "node_flops": "paper: HEP single-node rate on a Xeon Phi 7250 (Intel Caffe)",
            "flops_per_example": "hpcdl HEP network at 224x224x3, hpcdl.nn formulas",
            "batch_per_node": "paper's per-node batch at scale (recalled; uncertain)",
            "model_bytes": f"{params:,} fp32 parameters of the HEP network",
            "allreduce_latency": "NERSC Cori page: Aries MPI latency 0.25-3.7 us (top)",
            "allreduce_bandwidth": "NERSC Cori page: Aries MPI bandwidth ~8 GB/s",
            "straggler_sigma": "ASSUMED (round, not measured or fitted): 10% spread",
            "exchange_every": "paper: every group step goes to the parameter server",
            "exchange_blocking": "paper (as recalled): groups wait for the PS's weights",
            "exchange_latency": "parameter server over Aries: MPI latency",
            "exchange_bandwidth": "parameter server over Aries: MPI bandwidth",
            "applier_bytes_per_s": "ASSUMED: SGD update on one KNL node (memory-bound)",
            "applier_max_batch": "a parameter server replies to each group",
            "max_pending_per_group": "one outstanding update per group (blocking)",
            "max_staleness": "paper: no staleness bound",
        }
        return cls(
            node_flops=1.90e12,
            flops_per_example=float(flops.training),
            batch_per_node=8,
            model_bytes=float(params * 4),
            allreduce_latency=3.7e-6,
            allreduce_bandwidth=8e9,
            straggler_sigma=0.10,
            exchange_every=1,
            exchange_blocking=True,
            exchange_latency=3.7e-6,
            exchange_bandwidth=8e9,
            applier_bytes_per_s=4e9,
            applier_max_batch=1,
            max_pending_per_group=0,
            max_staleness=-1,
            label="paper: Kurth et al. SC17, HEP on Cori Phase II",
            sources=tuple(src.items()),
        )

    @classmethod
    def measured_here(cls, node_flops: float, *, batch_per_node: int = 128,
                      image: Sequence[int] = (224, 224, 3), model: Any = None,
                      source: str = "measured on this machine", **overrides: Any) -> "PlanInputs":
        """hpcdl's own scheme with a node rate measured here (e.g. by the bench suite).

        `model` is a HepModelConfig (or anything with filters, conv_layers, kernel, pool); the
        HEP network's FLOPs and size follow from it and `image`. Every other field keeps the
        default printed below (marked ASSUMED) unless given in `overrides`, whose source is
        `source`. The defaults describe hpcdl on a generic cluster: a non-blocking exchange
        through a Lustre directory (a few ms per file operation, ~1 GB/s per client), a numpy
        Adam applier (~1 GB/s of gradient) and a 100 Gb/s-class network (2 µs, 10 GB/s).
        """
        m = dict(filters=128, conv_layers=5, kernel=3, pool=2)
        if model is not None:
            m = {k: getattr(model, k) for k in m}
        flops, params = hep_network(image, **m)
        values: dict[str, Any] = dict(
            node_flops=float(node_flops),
            flops_per_example=float(flops.training),
            batch_per_node=int(batch_per_node),
            model_bytes=float(params * 4),
            allreduce_latency=2e-6,
            allreduce_bandwidth=10e9,
            straggler_sigma=0.05,
            exchange_every=1,
            exchange_blocking=False,
            exchange_latency=5e-3,
            exchange_bandwidth=1e9,
            applier_bytes_per_s=1e9,
            applier_max_batch=8,
            max_pending_per_group=4,
            max_staleness=16,
        )
        src = {k: "ASSUMED: generic cluster default; override" for k in values}
        src["node_flops"] = source
        src["batch_per_node"] = "hpcdl's HEP job (jobs/hep.toml)" if batch_per_node == 128 else source
        shape = "x".join(str(int(x)) for x in image)
        src["flops_per_example"] = f"HEP network at {shape}, hpcdl.nn formulas"
        src["model_bytes"] = f"{params:,} fp32 parameters of the HEP network"
        src["straggler_sigma"] = "ASSUMED: 5% per-node step-time spread; override"
        for k in ("exchange_every", "max_pending_per_group", "max_staleness", "applier_max_batch"):
            src[k] = "hpcdl defaults (jobs/hep.toml, hpcdl.applier)"
        src["exchange_blocking"] = "hpcdl: groups never wait for the applier"
        base = cls(label="hpcdl, node rate measured here", sources=tuple(src.items()), **values)
        return base.with_values(source, **overrides) if overrides else base

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
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read planner inputs {path}: {exc}") from None
        try:
            raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"cannot parse planner inputs {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a table of fields")
        raw = dict(raw)
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
        known = {f.name: f for f in dataclasses.fields(self)}
        unknown = set(values) - set(_UNITS) - {"label"}
        if unknown:
            raise ValueError(f"unknown planner input(s): {', '.join(sorted(unknown))} "
                             f"(known: {', '.join(_UNITS)})")
        clean: dict[str, Any] = {}
        for name, value in values.items():
            kind = known[name].type
            if kind == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be true or false, got {value!r}")
            elif kind == "int":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{name} must be an integer, got {value!r}")
            elif kind == "float":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{name} must be a number, got {value!r}")
                value = float(value)
            elif kind == "str" and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r}")
            clean[name] = value
        src = dict(self.sources)
        src.update({k: source for k in clean if k != "label"})
        return dataclasses.replace(self, sources=tuple(src.items()), **clean)

    def source(self, name: str) -> str:
        return dict(self.sources).get(name, "given")

    def assumptions(self) -> list[tuple[str, str, str, str]]:
        """(field, value, meaning, source) for every input: what the plan rests on."""
        rows = []
        for name in _UNITS:
            rows.append((name, _fmt_value(getattr(self, name), _UNITS[name]), _MEANING[name],
                         self.source(name)))
        return rows

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in _UNITS}
        out["label"] = self.label
        out["sources"] = {name: self.source(name) for name in _UNITS}
        return out

    # -- derived ------------------------------------------------------------------------------

    @property
    def compute_seconds(self) -> float:
        """t_c = b·F / R: one node's compute for one step, no stragglers."""
        return self.batch_per_node * self.flops_per_example / self.node_flops

    @property
    def transfer_seconds(self) -> float:
        """λ + n/W: one exchange transfer of the model."""
        return self.exchange_latency + self.model_bytes / self.exchange_bandwidth

    @property
    def apply_seconds(self) -> float:
        return self.model_bytes / self.applier_bytes_per_s

    def applier_batch_seconds(self, updates: int, applied: int | None = None) -> float:
        """Applier busy time for one batch: read each, apply those not dropped, publish once."""
        applied = updates if applied is None else applied
        publish = self.transfer_seconds if (applied > 0 or self.exchange_blocking) else 0.0
        return updates * self.transfer_seconds + applied * self.apply_seconds + publish

    @property
    def applier_capacity(self) -> float:
        """Updates/s the applier can apply at most (full batches of `applier_max_batch`)."""
        m = self.applier_max_batch
        return m / self.applier_batch_seconds(m)


def _fmt_value(value: Any, unit: str) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,} {unit}".strip()
    if isinstance(value, float):
        return f"{_si(value)}{unit}" if unit else f"{value:g}"
    return str(value)


def _si(x: float) -> str:
    if x == 0:
        return "0 "
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"),
                           (1.0, ""), (1e-3, "m"), (1e-6, "u"), (1e-9, "n")):
        if abs(x) >= factor:
            return f"{x / factor:.4g} {prefix}"
    return f"{x:.3g} "


# -- the cost model ----------------------------------------------------------------------------


def tree_rounds(nodes: int) -> int:
    """⌈log₂ nodes⌉ (0 for one node)."""
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    return (nodes - 1).bit_length()


def tree_collective_seconds(nodes: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """Allreduce (recursive doubling) or broadcast (binomial tree): ⌈log₂ P⌉·(α + n/B)."""
    return tree_rounds(nodes) * (latency + nbytes / bandwidth)


def allreduce_seconds(inputs: PlanInputs, nodes: int) -> float:
    return tree_collective_seconds(nodes, inputs.model_bytes, inputs.allreduce_latency,
                                   inputs.allreduce_bandwidth)


_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
      1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
      6.680131188771972e+01, -1.328068155288572e+01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
      -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
      3.754408661907416e+00)


def norm_ppf(p: np.ndarray, q: np.ndarray | None = None) -> np.ndarray:
    """Standard normal quantile of p (q = 1 − p, given separately for precision near 1).

    Acklam's rational approximation (relative error < 1.2e-9), vectorised.
    """
    p = np.asarray(p, dtype=float)
    q = 1.0 - p if q is None else np.asarray(q, dtype=float)
    out = np.empty_like(p)
    low, high = p < 0.02425, q < 0.02425
    mid = ~(low | high)

    def tail(x: np.ndarray) -> np.ndarray:
        t = np.sqrt(-2.0 * np.log(x))
        num = ((((_C[0] * t + _C[1]) * t + _C[2]) * t + _C[3]) * t + _C[4]) * t + _C[5]
        den = (((_D[0] * t + _D[1]) * t + _D[2]) * t + _D[3]) * t + 1.0
        return num / den

    out[low] = tail(p[low])
    out[high] = -tail(q[high])
    r = p[mid] - 0.5
    s = r * r
    num = (((((_A[0] * s + _A[1]) * s + _A[2]) * s + _A[3]) * s + _A[4]) * s + _A[5]) * r
    den = ((((_B[0] * s + _B[1]) * s + _B[2]) * s + _B[3]) * s + _B[4]) * s + 1.0
    out[mid] = num / den
    return out


def sample_slowest(rng: np.random.Generator, sigma: float, nodes: int, size: Any) -> np.ndarray:
    """Draws of max(X_1..X_nodes), X iid lognormal with E[X] = 1 (σ = 0: exactly 1)."""
    if sigma == 0:
        return np.ones(size)
    u = rng.random(size)
    u = np.maximum(u, np.finfo(float).tiny)
    lu = np.log(u) / nodes  # log of U^(1/P)
    z = norm_ppf(np.exp(lu), -np.expm1(lu))
    return np.exp(sigma * z - 0.5 * sigma * sigma)


# -- the exchange simulation --------------------------------------------------------------------


@dataclass(frozen=True)
class ExchangeSim:
    staleness: np.ndarray  # of processed updates published after the warm-up rounds
    finish: np.ndarray  # per group: time its last interval ended
    published: int
    applied: int
    dropped_stale: int
    dropped_backlog: int
    adoptions: int
    bytes_moved: float
    applier_busy: float  # seconds

    @property
    def dropped_fraction(self) -> float:
        return (self.dropped_stale + self.dropped_backlog) / max(1, self.published)


_DONE, _OTHER = 0, 1  # same-time order: applier completions first, then scheduling order


def simulate_exchange(inputs: PlanInputs, group_nodes: int, intervals: np.ndarray,
                      start_offsets: Sequence[float] | None = None,
                      warmup_rounds: int | None = None) -> ExchangeSim:
    """Discrete-event simulation of G groups and one applier (see the module docstring).

    `intervals[g, r]`: group g's compute + allreduce time before its r-th update (r from 0),
    i.e. the sum of `exchange_every` step times. All groups start from master version 0 at
    time `start_offsets[g]` (default 0).
    """
    intervals = np.asarray(intervals, dtype=float)
    n_groups, rounds = intervals.shape
    offsets = np.zeros(n_groups) if start_offsets is None else np.asarray(start_offsets, float)
    warm = max(1, rounds // 5) if warmup_rounds is None else warmup_rounds
    xfer = inputs.transfer_seconds
    lat = inputs.exchange_latency
    n = inputs.model_bytes
    bcast = tree_collective_seconds(group_nodes, n, inputs.allreduce_latency,
                                    inputs.allreduce_bandwidth)
    blocking = inputs.exchange_blocking
    max_pending = inputs.max_pending_per_group
    max_stale = inputs.max_staleness
    max_batch = inputs.applier_max_batch

    heap: list[tuple] = []
    counter = itertools.count()
    held = [0] * n_groups  # master version each group's weights came from
    rounds_done = [0] * n_groups
    finish = offsets.copy()
    queue: deque[list] = deque()  # records: [group, round, base, alive]
    pending = [deque() for _ in range(n_groups)]
    version = published_version = 0
    busy = False
    busy_time = bytes_moved = 0.0
    published = applied = dropped_stale = dropped_backlog = adoptions = 0
    stale: list[int] = []

    def push(t: float, kind: str, payload: Any, prio: int = _OTHER) -> None:
        heapq.heappush(heap, (t, prio, next(counter), kind, payload))

    def resume(g: int, t: float) -> None:
        r = rounds_done[g]
        if r < rounds:
            push(t + intervals[g, r], "publish", g)

    def start_batch(t: float) -> None:
        nonlocal busy, version, applied, dropped_stale, busy_time, bytes_moved
        batch = []
        while queue and len(batch) < max_batch:
            rec = queue.popleft()
            if rec[3]:
                pending[rec[0]].popleft()
                batch.append(rec)
        if not batch:
            busy = False
            return
        n_applied = 0
        for rec in batch:
            s = version - rec[2]
            if rec[1] >= warm:
                stale.append(s)
            if max_stale >= 0 and s > max_stale:
                dropped_stale += 1
            else:
                version += 1
                n_applied += 1
        applied += n_applied
        service = inputs.applier_batch_seconds(len(batch), n_applied)
        busy, busy_time = True, busy_time + service
        bytes_moved += n * (len(batch) + (1 if (n_applied or blocking) else 0))
        push(t + service, "done", batch, _DONE)

    for g in range(n_groups):
        resume(g, offsets[g])
    while heap:
        t, _, _, kind, payload = heapq.heappop(heap)
        if kind == "publish":
            g = payload
            rec = [g, rounds_done[g], held[g], True]
            rounds_done[g] += 1
            finish[g] = t
            published += 1
            bytes_moved += n
            push(t + xfer, "arrive", rec)
            if not blocking:
                push(t + xfer, "check", g)
        elif kind == "arrive":
            g = payload[0]
            queue.append(payload)
            pending[g].append(payload)
            if max_pending and len(pending[g]) > max_pending:
                oldest = pending[g].popleft()
                oldest[3] = False
                dropped_backlog += 1
            if not busy:
                start_batch(t)
        elif kind == "check":
            g = payload
            cost = lat
            if published_version > held[g]:
                held[g] = published_version
                cost += xfer + bcast
                adoptions += 1
                bytes_moved += n
            resume(g, t + cost)
        else:  # done
            busy = False
            if version > published_version:
                published_version = version
            if blocking:
                for rec in payload:
                    g = rec[0]
                    held[g] = version
                    adoptions += 1
                    resume(g, t + lat + bcast)
            start_batch(t)

    return ExchangeSim(np.asarray(stale, dtype=np.int64), finish - offsets, published, applied,
                       dropped_stale, dropped_backlog, adoptions, bytes_moved, busy_time)


# -- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupPlan:
    """Predictions for one group count."""

    groups: int
    nodes_per_group: int
    compute_s: float  # t_c, one node, no stragglers
    straggler_s: float  # mean wait for the group's slowest node
    allreduce_s: float
    exchange_s: float  # mean exchange cost per step on the group's critical path
    step_s: float  # mean group step, everything included
    sustained_flops: float
    peak_flops: float
    updates_per_s: float  # offered to the applier
    applier_capacity: float  # updates/s
    applier_utilisation: float
    exchange_bytes_per_s: float
    staleness_mean: float
    staleness_p50: float
    staleness_p95: float
    staleness_max: int
    dropped_fraction: float
    feasible: bool
    reason: str

    @property
    def saturated(self) -> bool:
        return self.applier_utilisation >= 1.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["saturated"] = self.saturated
        return out


RULE = ("highest sustained FLOP/s among group counts with applier utilisation < 1, mean "
        "staleness <= {bound:g} and <= 1% of updates dropped; fewer groups preferred within 1%")


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    nodes: int
    seed: int
    staleness_bound: float
    candidates: tuple[GroupPlan, ...]
    recommended: int | None  # group count, None if no candidate is feasible

    @property
    def rule(self) -> str:
        return RULE.format(bound=self.staleness_bound)

    def candidate(self, groups: int) -> GroupPlan:
        for c in self.candidates:
            if c.groups == groups:
                return c
        raise KeyError(groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "seed": self.seed,
            "inputs": self.inputs.to_dict(),
            "rule": self.rule,
            "staleness_bound": self.staleness_bound,
            "recommended_groups": self.recommended,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def flops_unit(self) -> tuple[float, str]:
        """(divisor, prefix) for FLOP/s figures of this plan: P, T, G or M."""
        top = max((c.peak_flops for c in self.candidates), default=0.0)
        for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G")):
            if top >= factor:
                return factor, prefix
        return 1e6, "M"

    def render_rows(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        """(headers, rows) of strings for a table, one row per candidate; ★ marks the pick."""
        unit, prefix = self.flops_unit()
        headers = ("groups", "nodes/group", "step ms", "compute", "straggler", "allreduce",
                   "exchange", f"sustained {prefix}FLOP/s", f"peak {prefix}FLOP/s", "updates/s",
                   "applier util", "exchange MB/s", "staleness mean", "p95", "dropped", "")
        rows = []
        for c in self.candidates:
            mark = "★" if c.groups == self.recommended else ("" if c.feasible else c.reason)
            rows.append((
                str(c.groups), str(c.nodes_per_group), f"{c.step_s * 1e3:.1f}",
                f"{c.compute_s * 1e3:.1f}", f"{c.straggler_s * 1e3:.1f}",
                f"{c.allreduce_s * 1e3:.2f}", f"{c.exchange_s * 1e3:.2f}",
                f"{c.sustained_flops / unit:.2f}", f"{c.peak_flops / unit:.2f}",
                f"{c.updates_per_s:.1f}", f"{c.applier_utilisation:.2f}",
                f"{c.exchange_bytes_per_s / 1e6:.0f}", f"{c.staleness_mean:.1f}",
                f"{c.staleness_p95:.0f}", f"{100 * c.dropped_fraction:.0f}%", mark,
            ))
        return headers, rows

    def render_assumptions(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        return ("input", "value", "meaning", "source"), [tuple(r) for r in self.inputs.assumptions()]

    def recommendation_text(self) -> str:
        if self.recommended is None:
            return f"no group count meets the rule ({self.rule})"
        c = self.candidate(self.recommended)
        unit, prefix = self.flops_unit()
        return (f"recommended: {c.groups} groups of {c.nodes_per_group} nodes — "
                f"{c.sustained_flops / unit:.2f} {prefix}FLOP/s sustained, mean staleness "
                f"{c.staleness_mean:.1f}, applier at {100 * c.applier_utilisation:.0f}% "
                f"(rule: {self.rule})")

    def render_text(self) -> str:
        """Plain-text report: assumptions, the table, the recommendation."""
        parts = [f"Scale plan for {self.nodes} nodes — inputs: {self.inputs.label} "
                 f"(seed {self.seed})", ""]
        parts += _table(*self.render_assumptions())
        parts += ["", *_table(*self.render_rows()), "", self.recommendation_text()]
        return "\n".join(parts)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def default_candidates(nodes: int, max_groups: int = 128) -> list[int]:
    """Group counts that divide `nodes` evenly (hpcdl's groups are equal), up to `max_groups`."""
    return [g for g in range(1, min(nodes, max_groups) + 1) if nodes % g == 0]


def evaluate(inputs: PlanInputs, nodes: int, groups: int, *, seed: int = 0,
             staleness_bound: float = 8.0, rounds: int | None = None) -> GroupPlan:
    """Predict one group count (its own random stream: independent of the other candidates)."""
    if nodes < 1 or groups < 1 or nodes % groups:
        raise ValueError(f"{groups} groups do not divide {nodes} nodes evenly")
    p = nodes // groups
    k = inputs.exchange_every
    rng = np.random.default_rng([seed, groups, nodes])
    r = rounds or max(MIN_ROUNDS, math.ceil(TARGET_UPDATES / groups))
    t_c = inputs.compute_seconds
    t_ar = allreduce_seconds(inputs, p)
    slowest = sample_slowest(rng, inputs.straggler_sigma, p, (groups, r, k))
    compute = t_c * slowest
    straggler = t_c * (float(slowest.mean()) - 1.0)
    steps = compute + t_ar
    step_flops = p * inputs.batch_per_node * inputs.flops_per_example  # one group step
    fast_step = float(np.quantile(steps, PEAK_QUANTILE))
    peak = nodes * inputs.batch_per_node * inputs.flops_per_example / fast_step
    capacity = inputs.applier_capacity
    if groups == 1:  # no exchange: hpcdl's exchange.enabled = "auto"
        per_step = float(steps.mean())
        return GroupPlan(1, p, t_c, straggler, t_ar, 0.0, per_step,
                         step_flops / per_step, peak, 0.0, capacity, 0.0, 0.0,
                         0.0, 0.0, 0.0, 0, 0.0, True, "")
    sim = simulate_exchange(inputs, p, steps.sum(axis=2))
    step_time = sim.finish / (r * k)  # per group, exchange included
    sustained = float(np.sum(step_flops / step_time))
    horizon = float(sim.finish.max())
    updates_per_s = float(np.sum(r / sim.finish))
    utilisation = updates_per_s / capacity
    st = sim.staleness if sim.staleness.size else np.zeros(1, dtype=np.int64)
    mean_step = float(step_time.mean())
    plan = dict(
        groups=groups, nodes_per_group=p, compute_s=t_c,
        straggler_s=straggler, allreduce_s=t_ar,
        exchange_s=mean_step - float(steps.mean()), step_s=mean_step,
        sustained_flops=sustained, peak_flops=peak, updates_per_s=updates_per_s,
        applier_capacity=capacity, applier_utilisation=utilisation,
        exchange_bytes_per_s=sim.bytes_moved / horizon,
        staleness_mean=float(st.mean()), staleness_p50=float(np.quantile(st, 0.5)),
        staleness_p95=float(np.quantile(st, 0.95)), staleness_max=int(st.max()),
        dropped_fraction=sim.dropped_fraction,
    )
    reasons = []
    if utilisation >= 1:
        reasons.append("applier saturated")
    if plan["staleness_mean"] > staleness_bound:
        reasons.append("too stale")
    if sim.dropped_fraction > MAX_DROPPED_FRACTION:
        reasons.append("drops updates")
    return GroupPlan(**plan, feasible=not reasons, reason=", ".join(reasons))


def recommend(candidates: Sequence[GroupPlan]) -> int | None:
    """The rule (see RULE): best sustained among the feasible; fewer groups within 1 %."""
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return None
    best = max(c.sustained_flops for c in feasible)
    return min(c.groups for c in feasible if c.sustained_flops >= (1 - TIE_FRACTION) * best)


def plan(inputs: PlanInputs, nodes: int, candidates: Sequence[int] | None = None, *,
         seed: int = 0, staleness_bound: float = 8.0) -> Plan:
    """Predict every candidate group count (default: divisors of `nodes` up to 128) and pick one."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    groups = sorted(set(candidates)) if candidates else default_candidates(nodes)
    bad = [g for g in groups if g < 1 or nodes % g]
    if bad:
        raise ValueError(f"group counts {bad} do not divide {nodes} nodes evenly "
                         f"(candidates: {default_candidates(nodes)})")
    results = tuple(evaluate(inputs, nodes, g, seed=seed, staleness_bound=staleness_bound)
                    for g in groups)
    return Plan(inputs, nodes, seed, staleness_bound, results, recommend(results))


def paper_check(seed: int = 0, inputs: PlanInputs | None = None) -> dict[str, Any]:
    """The paper's inputs at the paper's HEP configuration, beside the paper's figures."""
    inputs = inputs or PlanInputs.paper_cori_hep()
    c = evaluate(inputs, PAPER_HEP_WORKERS, PAPER_HEP_GROUPS, seed=seed)
    return {
        "nodes": PAPER_HEP_WORKERS,
        "groups": PAPER_HEP_GROUPS,
        "predicted_sustained_flops": c.sustained_flops,
        "paper_sustained_flops": PAPER_HEP_SUSTAINED_FLOPS,
        "sustained_ratio": c.sustained_flops / PAPER_HEP_SUSTAINED_FLOPS,
        "predicted_peak_flops": c.peak_flops,
        "paper_peak_flops": PAPER_HEP_PEAK_FLOPS,
        "peak_ratio": c.peak_flops / PAPER_HEP_PEAK_FLOPS,
        "candidate": c.to_dict(),
    }


def render_paper_check(result: dict[str, Any]) -> str:
    """One paragraph for humans from :func:`paper_check`'s result."""
    c = result["candidate"]
    return (
        f"Paper check (Kurth et al. SC17, HEP, {result['nodes']} nodes in {result['groups']} "
        f"groups): predicted {result['predicted_sustained_flops'] / 1e15:.2f} PFLOP/s sustained "
        f"vs the paper's {result['paper_sustained_flops'] / 1e15:.2f} "
        f"({100 * (result['sustained_ratio'] - 1):+.1f} %; the test allows ±15 %), "
        f"{result['predicted_peak_flops'] / 1e15:.2f} PFLOP/s peak vs "
        f"{result['paper_peak_flops'] / 1e15:.2f} ({100 * (result['peak_ratio'] - 1):+.1f} %); "
        f"step {c['step_s'] * 1e3:.1f} ms = compute {c['compute_s'] * 1e3:.1f} + stragglers "
        f"{c['straggler_s'] * 1e3:.1f} + allreduce {c['allreduce_s'] * 1e3:.1f} + exchange "
        f"{c['exchange_s'] * 1e3:.1f}."
    )
