"""FLOP counts, the paper's figure of merit, as plain numbers (no TensorFlow needed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FlopCount:
    """FLOPs per example."""

    forward: int
    backward: int

    @property
    def training(self) -> int:
        return self.forward + self.backward

    def __add__(self, other: "FlopCount") -> "FlopCount":
        return FlopCount(self.forward + other.forward, self.backward + other.backward)


ZERO = FlopCount(0, 0)
