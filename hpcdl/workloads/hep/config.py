"""The HEP job's `[data]` and `[model]` sections."""

from __future__ import annotations

from dataclasses import dataclass

from hpcdl.errors import JobError
from hpcdl.engine import flops as count
from hpcdl.engine.flops import FlopCount


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

    def cost(self, input_shape) -> tuple[FlopCount, int]:
        """FLOPs per example and parameter count of this network at `input_shape` (H, W, C),
        without TensorFlow: `HepCNN.flops()` and the planner both count with it.

        'Same' convolutions of stride 1, pooling after every convolution but the last, then a
        global average pool and a dense layer to 2 logits.
        """
        h, w, c = (int(x) for x in input_shape)
        channels = [c] + [self.filters] * self.conv_layers
        total, params = count.ZERO, 0
        for i in range(self.conv_layers):
            total = total + count.conv(h, w, self.kernel, channels[i], channels[i + 1], needs_input_grad=i > 0)
            params += self.kernel * self.kernel * channels[i] * channels[i + 1] + channels[i + 1]
            if i < self.conv_layers - 1:
                h, w = h // self.pool, w // self.pool
        return total + count.dense(self.filters, 2), params + self.filters * 2 + 2
