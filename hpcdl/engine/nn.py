"""Layers as plain `tf.Module`s that also know their FLOP count.

The paper's figure of merit is FLOP/s, so each layer counts its own multiply-adds analytically
from the shapes it sees, by the convention of `hpcdl.engine.flops`.
Layers use plain variables (no Keras), so Horovod sees ordinary `tf.Variable`s. Each layer
computes in the dtype of its input, its float32 variables cast to it (Keras' autocasting): under
`tuning.precision = "mixed_bfloat16"` the model feeds bfloat16 activations and the weights stay
float32 master copies; in float32 the casts are no-ops.
"""

from __future__ import annotations

import math
import tensorflow as tf

from hpcdl.engine import flops as count
from hpcdl.engine.flops import FlopCount


def _as(var: tf.Variable, x: tf.Tensor) -> tf.Tensor:
    """The variable in x's compute dtype (its gradient flows back to the float32 variable)."""
    return tf.cast(var, x.dtype)


def _glorot(rng: tf.random.Generator, shape: tuple[int, ...], fan_in: int, fan_out: int) -> tf.Tensor:
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(shape, -limit, limit, dtype=tf.float32)


class Conv2D(tf.Module):
    """k×k convolution, NHWC, 'same' padding."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, rng: tf.random.Generator, name: str):
        super().__init__(name=name)
        self.kernel, self.stride, self.c_in, self.c_out = kernel, stride, c_in, c_out
        fan_in, fan_out = kernel * kernel * c_in, kernel * kernel * c_out
        self.w = tf.Variable(_glorot(rng, (kernel, kernel, c_in, c_out), fan_in, fan_out), name="w")
        self.b = tf.Variable(tf.zeros([c_out]), name="b")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        # A broadcast add, not tf.nn.bias_add: grappler fuses conv + add + ReLU into one oneDNN
        # primitive either way, and bias_add's BiasAddGrad made the step slower (README Figures).
        with self.name_scope:  # op names carry the layer (conv0/...): the profile table's rows
            return tf.nn.conv2d(x, _as(self.w, x), self.stride, "SAME") + _as(self.b, x)

    def output_hw(self, h: int, w: int) -> tuple[int, int]:
        return math.ceil(h / self.stride), math.ceil(w / self.stride)

    def flops(self, h: int, w: int, needs_input_grad: bool = True) -> FlopCount:
        return count.conv(*self.output_hw(h, w), self.kernel, self.c_in, self.c_out, needs_input_grad)


class Conv2DTranspose(tf.Module):
    """k×k transposed convolution (upsampling by `stride`), NHWC, 'same' padding."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, rng: tf.random.Generator, name: str):
        super().__init__(name=name)
        self.kernel, self.stride, self.c_in, self.c_out = kernel, stride, c_in, c_out
        fan_in, fan_out = kernel * kernel * c_in, kernel * kernel * c_out
        self.w = tf.Variable(_glorot(rng, (kernel, kernel, c_out, c_in), fan_in, fan_out), name="w")
        self.b = tf.Variable(tf.zeros([c_out]), name="b")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        shape = tf.shape(x)
        out = tf.stack([shape[0], shape[1] * self.stride, shape[2] * self.stride, self.c_out])
        return tf.nn.conv2d_transpose(x, _as(self.w, x), out, self.stride, "SAME") + _as(self.b, x)

    def flops(self, h: int, w: int, needs_input_grad: bool = True) -> FlopCount:
        # Every input pixel scatters a k×k×c_out patch: the same multiply-adds as the convolution
        # it is the gradient of.
        return count.conv(h, w, self.kernel, self.c_in, self.c_out, needs_input_grad)


class Dense(tf.Module):
    def __init__(self, n_in: int, n_out: int, rng: tf.random.Generator, name: str):
        super().__init__(name=name)
        self.n_in, self.n_out = n_in, n_out
        self.w = tf.Variable(_glorot(rng, (n_in, n_out), n_in, n_out), name="w")
        self.b = tf.Variable(tf.zeros([n_out]), name="b")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        with self.name_scope:
            return tf.matmul(x, _as(self.w, x)) + _as(self.b, x)

    def flops(self, needs_input_grad: bool = True) -> FlopCount:
        return count.dense(self.n_in, self.n_out, needs_input_grad)


def named_variables(module: tf.Module) -> list[tuple[str, tf.Variable]]:
    """Variables with stable, readable names (`conv0/w`), in a fixed order.

    These names key the tensors of checkpoints' manifests and of the exchange files, so they must
    not depend on TensorFlow's global name uniquification.
    """
    out = []
    for path, var in _walk(module, ""):
        out.append((path, var))
    return sorted(out, key=lambda item: item[0])


def _walk(obj, prefix: str):
    for attr, value in sorted(vars(obj).items()):
        if attr.startswith("_"):
            continue
        name = f"{prefix}{attr}"
        if isinstance(value, tf.Variable):
            if value.trainable:
                yield name, value
        elif isinstance(value, tf.Module):
            yield from _walk(value, name + "/")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, tf.Module):
                    yield from _walk(item, f"{name}{i}/")
