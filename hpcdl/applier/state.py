"""The applier's durable state: everything it knows, in one file (``applier/state.hx``).

Saved once per committed batch (exchange format, kind "state", published atomically) and loaded
first on every start; the package docstring says why that makes every update apply exactly once.
The generation committed before it is kept beside it (``state.hx.1``), each tagged alike: a
state damaged after its commit (a disk, a careless hand) leaves one to recover from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from hpcdl.applier.ledger import Ledger
from hpcdl.exchange import Channel, CorruptFile

COUNTERS = ("applied", "dropped_stale", "downweighted", "rejected_corrupt", "rejected_invalid",
            "duplicates", "vanished", "rejected_proposals")


class StateLost(CorruptFile):
    """No committed generation of the applier state can be used: one line that says why."""


def new_stats() -> dict[str, int]:
    return {"count": 0, "sum": 0, "max": 0}


def _empty_batch() -> dict[str, list[Any]]:
    return {"events": [], "delete": [], "reject": []}


@dataclass
class DurableState:
    """Master weights, the rule's slots and step, version, ledger, counters, staleness
    statistics, the event counter, and ``last_batch``: the events of the last committed batch
    and the files it must delete or move aside (redone on recovery)."""

    version: int | None = None  # None: no master weights yet
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    slots: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    t: int = 0  # updates applied by the rule since the weights were adopted
    ledger: Ledger = field(default_factory=Ledger)
    counters: dict[str, int] = field(default_factory=lambda: {k: 0 for k in COUNTERS})
    staleness: dict[str, int] = field(default_factory=new_stats)
    group_staleness: dict[str, dict[str, int]] = field(default_factory=dict)
    event_id: int = 0
    last_batch: dict[str, list[Any]] = field(default_factory=_empty_batch)
    last_apply_time: float | None = None
    recovered: str | None = None  # how this state was recovered from a damaged one, if it was

    def adopt(self, tensors: Mapping[str, np.ndarray], version: int, slot_names: tuple[str, ...]) -> None:
        """New master weights (copied) with fresh slots."""
        self.weights = {k: np.array(v, copy=True, order="C") for k, v in tensors.items()}
        self.slots = {s: {k: np.zeros_like(w) for k, w in self.weights.items()} for s in slot_names}
        self.t = 0
        self.version = version

    def save(self, channel: Channel, optimizer: str) -> None:
        assert self.version is not None
        tensors: dict[str, np.ndarray] = {f"w/{k}": w for k, w in self.weights.items()}
        for slot, arrays in self.slots.items():
            tensors.update({f"{slot}/{k}": a for k, a in arrays.items()})
        tensors["ledger"] = self.ledger.to_array()
        meta = {
            "optimizer": optimizer, "t": self.t, "order": list(self.weights),
            "counters": self.counters, "staleness": self.staleness, "event_id": self.event_id,
            "group_staleness": self.group_staleness,
            "last_batch": self.last_batch, "last_apply_time": self.last_apply_time,
            "recovered": self.recovered,
        }
        channel.publish_state(self.version, tensors, meta)

    @classmethod
    def load(cls, channel: Channel, optimizer: str, slot_names: tuple[str, ...],
             path: Path | None = None) -> "DurableState":
        """The saved state (``path``: one generation, by default the newest); CorruptFile if it
        is damaged, ValueError if another update rule wrote it (its slots would not fit)."""
        header, tensors = channel.read_state(path)
        meta = header["meta"]
        if meta["optimizer"] != optimizer:
            raise ValueError(f"{channel.state_path} was written with optimizer "
                             f"{meta['optimizer']!r}, not {optimizer!r}")
        order = meta["order"]
        state = cls(
            version=header["version"],
            weights={k: tensors[f"w/{k}"] for k in order},
            slots={s: {k: tensors[f"{s}/{k}"] for k in order} for s in slot_names},
            t=meta["t"], ledger=Ledger.from_array(tensors["ledger"]),
            group_staleness=meta.get("group_staleness", {}), event_id=meta["event_id"],
            last_batch=meta["last_batch"], last_apply_time=meta["last_apply_time"],
            recovered=meta.get("recovered"),
        )
        state.counters.update(meta["counters"])
        state.staleness.update(meta["staleness"])
        return state
