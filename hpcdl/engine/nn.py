"""Layers as plain `tf.Module`s that also know their FLOP count.

The paper's figure of merit is FLOP/s, so each layer counts its own multiply-adds analytically
from the shapes it sees, by the convention of `hpcdl.engine.flops`.
Layers use plain variables (no Keras), so Horovod sees ordinary `tf.Variable`s. Each layer
computes in the dtype of its input, its float32 variables cast to it (Keras' autocasting): under
`tuning.precision = "mixed_bfloat16"` the model feeds bfloat16 activations and the weights stay
float32 master copies; in float32 the casts are no-ops.

How a convolution's weight gradient is computed is a process-wide choice, like TensorFlow's
thread pools: `hpcdl.engine.tuning` decides it per CPU and `configure_tensorflow` sets it here.
"""

from __future__ import annotations

import math
import tensorflow as tf

from hpcdl.config import ConvWeightGrad, choices
from hpcdl.engine import flops as count
from hpcdl.engine.flops import FlopCount


def _as(var: tf.Variable, x: tf.Tensor) -> tf.Tensor:
    """The variable in x's compute dtype (its gradient flows back to the float32 variable)."""
    return tf.cast(var, x.dtype)


#: "tensorflow" (Conv2DBackpropFilter: oneDNN's kernel) or "gemm" (conv_weight_grad_gemm, on the
#: layers where it was faster); set by hpcdl.engine.tuning.configure_tensorflow.
_CONV_WEIGHT_GRAD = "tensorflow"

#: The layers "gemm" takes over: on the AVX2 path the matmuls beat oneDNN on the HEP network's
#: 112² layer only, not at 56² and below nor on its 3-channel first layer (README Figures).
GEMM_MIN_PIXELS = 112 * 112
GEMM_MIN_IN_CHANNELS = 64


def set_conv_weight_grad(choice: str) -> None:
    global _CONV_WEIGHT_GRAD
    if choice == "auto" or choice not in choices(ConvWeightGrad):  # "auto" is resolved by tuning
        raise ValueError(f"conv weight gradient: 'tensorflow' or 'gemm', got {choice!r}")
    _CONV_WEIGHT_GRAD = choice


def conv_weight_grad_gemm(x: tf.Tensor, dy: tf.Tensor, kernel: int) -> tf.Tensor:
    """The weight gradient of a stride-1 'SAME' k×k convolution (k odd) as k² matmuls.

    Output pixel (b, h, w) reads input pixel (b, h + i, w + j) of the input padded by p = k // 2.
    With both the padded input and the output gradient padded to the same (h + 2p) × (w + 2p)
    grid and flattened to rows of channels, that is the fixed row offset i·(w + 2p) + j, and the
    output gradient's padding rows are zero: so tap (i, j) is one matmul of two views of those
    flat tensors, with no im2col copy. Static height, width and channels are required.
    """
    p = kernel // 2
    _, h, w, c_in = x.shape
    c_out = dy.shape[-1]
    wp = w + 2 * p
    flat_x = tf.reshape(tf.pad(x, [[0, 0], [p, p], [p, p], [0, 0]]), [-1, c_in])
    flat_dy = tf.reshape(tf.pad(dy, [[0, 0], [0, 2 * p], [0, 2 * p], [0, 0]]), [-1, c_out])
    # The last offset's worth of rows of flat_dy is padding (zero): leaving it out keeps every
    # view of flat_x inside it.
    rows = tf.shape(flat_dy)[0] - (2 * p * wp + 2 * p)
    dy_rows = flat_dy[:rows]
    taps = [tf.matmul(flat_x[i * wp + j:i * wp + j + rows], dy_rows, transpose_a=True)
            for i in range(kernel) for j in range(kernel)]
    return tf.reshape(tf.stack(taps), [kernel, kernel, c_in, c_out])


def _gemm_applies(x: tf.Tensor, kernel: int, stride: int) -> bool:
    _, h, w, c_in = x.shape
    return (stride == 1 and kernel % 2 == 1 and x.dtype == tf.float32 and None not in (h, w, c_in)
            and c_in >= GEMM_MIN_IN_CHANNELS and h * w >= GEMM_MIN_PIXELS)


def _conv_with_gemm_weight_grad(x: tf.Tensor, w: tf.Tensor, b: tf.Tensor, kernel: int, name: str) -> tf.Tensor:
    """conv2d(x, w) + b, its weight gradient by conv_weight_grad_gemm. The bias is inside so that
    grappler still fuses the convolution with it. A custom gradient runs outside the layer's name
    scope, so its ops carry the layer's name (bench/profile_step.py classes ops by it)."""

    @tf.custom_gradient
    def conv(x, w, b):
        def grad(dz):
            dx = tf.raw_ops.Conv2DBackpropInput(input_sizes=tf.shape(x), filter=w, out_backprop=dz,
                                                strides=[1, 1, 1, 1], padding="SAME", name=f"{name}_input_grad")
            with tf.name_scope(f"{name}_gemm_weight_grad"):
                dw = conv_weight_grad_gemm(x, dz, kernel)
            return dx, dw, bias_grad(dz)

        return tf.nn.conv2d(x, w, 1, "SAME") + b, grad

    return conv(x, w, b)


def bias_grad(dy: tf.Tensor) -> tf.Tensor:
    """The gradient of a bias broadcast over all axes but the last: a row of ones times dy's rows.
    A matmul, because TensorFlow's Sum over the leading axes is several times slower on large
    activation gradients (README Figures, "Cutting what is not compute")."""
    with tf.name_scope("bias_grad"):  # bench/profile_step.py classes its ops by this name
        rows = tf.reshape(dy, [-1, dy.shape[-1]])
        return tf.reshape(tf.matmul(tf.ones([1, tf.shape(rows)[0]], dy.dtype), rows), [-1])


@tf.custom_gradient
def add_bias(z: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """z + b (b along the last axis), its bias gradient by bias_grad. Grappler still fuses a
    convolution, this add and a ReLU into one oneDNN primitive."""
    return z + b, lambda dy: (dy, bias_grad(dy))


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
        # A broadcast add with a matmul for its gradient, not tf.nn.bias_add: grappler fuses
        # conv + add + ReLU into one oneDNN primitive either way, and this bias gradient was the
        # fastest (README Figures).
        with self.name_scope:  # op names carry the layer (conv0/...): the profile table's rows
            if _CONV_WEIGHT_GRAD == "gemm" and _gemm_applies(x, self.kernel, self.stride):
                return _conv_with_gemm_weight_grad(x, _as(self.w, x), _as(self.b, x), self.kernel, self.name)
            return add_bias(tf.nn.conv2d(x, _as(self.w, x), self.stride, "SAME"), _as(self.b, x))

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
        return add_bias(tf.nn.conv2d_transpose(x, _as(self.w, x), out, self.stride, "SAME"), _as(self.b, x))

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
