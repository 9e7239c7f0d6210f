"""FLOP counts, the paper's figure of merit, as plain numbers (no TensorFlow needed).

Counted as the paper does: 2 FLOPs per multiply-add of convolutions and dense layers, forward and
backward. The backward pass of a layer costs one forward for the weight gradient plus one for the
input gradient, except the first layer, whose input needs no gradient. Element-wise work (bias,
ReLU, pooling, dropout, the optimizer) is left out: under 1 % of the networks here. The layers
(`hpcdl.engine.nn`) and the planner's networks without TensorFlow count with these functions.
"""

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


def _layer(multiply_adds: int, needs_input_grad: bool) -> FlopCount:
    forward = 2 * multiply_adds
    return FlopCount(forward, forward * (2 if needs_input_grad else 1))


def conv(out_h: int, out_w: int, kernel: int, c_in: int, c_out: int, needs_input_grad: bool = True) -> FlopCount:
    """A k×k convolution producing out_h × out_w pixels (a transposed one: its input pixels)."""
    return _layer(out_h * out_w * kernel * kernel * c_in * c_out, needs_input_grad)


def dense(n_in: int, n_out: int, needs_input_grad: bool = True) -> FlopCount:
    return _layer(n_in * n_out, needs_input_grad)
