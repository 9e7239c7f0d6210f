"""The HEP classifier of the paper's published TensorFlow benchmark (hep_cnn_benchmark).

Input H×W×3 (NHWC). `conv_layers - 1` units of [3×3 conv, `filters` filters, stride 1, same
padding → ReLU → 2×2 max-pool → dropout], then one more 3×3 conv → ReLU → global average pool →
dense to 2 logits (background, signal). `compute_dtype` "bfloat16" (tuning.precision =
"mixed_bfloat16") casts the input to bfloat16 and the logits back to float32, so the loss and
the variables stay float32.
"""

from __future__ import annotations

import tensorflow as tf

from hpcdl.engine.flops import FlopCount
from hpcdl.engine.nn import Conv2D, Dense, named_variables
from hpcdl.workloads.hep.config import HepModelConfig
from hpcdl.workloads.base import Model


class HepCNN(tf.Module, Model):
    def __init__(self, config: HepModelConfig, input_shape: tuple[int, int, int], seed: int = 0,
                 compute_dtype: str = "float32"):
        super().__init__(name="hep_cnn")
        self.config = config
        self.compute_dtype = tf.as_dtype(compute_dtype)
        self.image_shape = tuple(input_shape)
        rng = tf.random.Generator.from_seed(seed)
        channels = [input_shape[2]] + [config.filters] * config.conv_layers
        self.convs = [
            Conv2D(channels[i], channels[i + 1], config.kernel, 1, rng, name=f"conv{i}")
            for i in range(config.conv_layers)
        ]
        self.head = Dense(config.filters, 2, rng, name="head")

    def __call__(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        pool = self.config.pool
        x = tf.cast(x, self.compute_dtype)
        for conv in self.convs[:-1]:
            # named per layer: grappler's fused conv + bias + ReLU op takes the ReLU's name
            x = tf.nn.max_pool2d(tf.nn.relu(conv(x), name=f"{conv.name}_relu"), pool, pool, "VALID")
            if training and self.config.dropout > 0:
                x = self._dropout(x)
        x = tf.nn.relu(self.convs[-1](x), name=f"{self.convs[-1].name}_relu")
        # the global mean and the logits in float32: the loss is computed in float32
        return self.head(tf.reduce_mean(tf.cast(x, tf.float32), axis=[1, 2]))

    def _dropout(self, x: tf.Tensor) -> tf.Tensor:
        # tf.nn.dropout's float32 uniform per element stays: a mask from 16 random bits per
        # element (half the Philox words, no float conversion) did not make the step cheaper
        # (bench/step_variants.py, README Figures).
        return tf.nn.dropout(x, rate=self.config.dropout)

    def flops(self) -> FlopCount:
        return self.config.cost(self.image_shape)[0]

    def named_variables(self) -> list[tuple[str, tf.Variable]]:
        return named_variables(self)
