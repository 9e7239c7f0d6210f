"""The HEP job's `[data]` and `[model]` sections."""

from __future__ import annotations

from dataclasses import dataclass

from hpcdl.config import JobError


@dataclass(frozen=True)
class HepDataConfig:
    train: str = "data/hep/train.h5"
    val: str = "data/hep/val.h5"
    test: str = "data/hep/test.h5"
    chunk_events: int = 4096
    prefetch: int = 2

    def validate(self) -> None:
        if not self.train:
            raise JobError("data.train must name the training file")
        if self.chunk_events < 1 or self.prefetch < 0:
            raise JobError("data.chunk_events must be >= 1 and data.prefetch >= 0")


@dataclass(frozen=True)
class HepModelConfig:
    filters: int = 128
    conv_layers: int = 5
    kernel: int = 3
    pool: int = 2
    dropout: float = 0.2

    def validate(self) -> None:
        for name in ("filters", "conv_layers", "kernel", "pool"):
            if getattr(self, name) < 1:
                raise JobError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise JobError(f"model.dropout must be in [0, 1), got {self.dropout}")
