"""The user's Keras model as the engine sees it (`hpcdl.workloads.base.Model`).

The engine trains, checkpoints and exchanges `named_variables()`: the Keras model's trainable
variables under names of their position (``0003_kernel``), which do not depend on Keras' global
layer-name counter, so every build of the same builder -- in another rank, on resume, in
`evaluate` -- has the same names. The checkpoint tracks those and the model's other state
(e.g. batch-norm statistics) by the same names: a TensorFlow checkpoint, never a SavedModel
or a pickle, so restoring it runs no code.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from hpcdl.engine.flops import FlopCount
from hpcdl.workloads.base import Model


class _Held:
    """Keeps the Keras model out of the checkpoint's object graph (its variables are tracked by
    stable names instead)."""

    __slots__ = ("model",)

    def __init__(self, model):
        self.model = model


def _tf_variable(v) -> tf.Variable:
    value = getattr(v, "value", v)  # a Keras 3 variable wraps a tf.Variable
    if not isinstance(value, tf.Variable):
        raise TypeError(f"variable {getattr(v, 'path', v)!r} is not backed by a tf.Variable")
    return value


class KerasModel(tf.Module, Model):
    """A built Keras model with stable variable names and its FLOPs per training example."""

    def __init__(self, keras_model, input_shape: tuple[int, ...], count_flops: Callable[["KerasModel"], tuple]):
        super().__init__(name="keras_model")
        self._held = _Held(keras_model)
        self.image_shape = tuple(input_shape)
        self.trainable = {f"{i:04d}_{v.name}": _tf_variable(v) for i, v in enumerate(keras_model.trainable_variables)}
        self.state = {f"{i:04d}_{v.name}": _tf_variable(v) for i, v in enumerate(keras_model.non_trainable_variables)}
        self._count_flops = count_flops
        self._flops: tuple[FlopCount, str] | None = None

    @property
    def keras(self):
        return self._held.model

    def __call__(self, x, training: bool = False):
        # The loss is computed in float32 whatever the model computes in (mixed_bfloat16).
        return tf.cast(self._held.model(x, training=training), tf.float32)

    def named_variables(self) -> list[tuple[str, tf.Variable]]:
        return sorted(self.trainable.items())

    def flops(self) -> FlopCount:
        return self.flops_and_source()[0]

    def flops_and_source(self) -> tuple[FlopCount, str]:
        """FLOPs per training example and how they were found: the model's own `flops()` when it
        has one, else TensorFlow's cost analysis of the traced training step."""
        if self._flops is None:
            self._flops = self._count_flops(self)
        return self._flops


def own_flops(keras_model) -> FlopCount | None:
    """The model's own count, if it offers `flops()`: a FlopCount, or one number (training FLOPs
    per example, forward taken as a third of it)."""
    method = getattr(keras_model, "flops", None)
    if not callable(method):
        return None
    value = method()
    if isinstance(value, FlopCount):
        return value
    total = int(value)
    return FlopCount(total // 3, total - total // 3)


def traced_flops(model: KerasModel, loss: Callable[[Any, tuple], Any], batch: tuple, variables: list) -> FlopCount:
    """FLOPs per example of the forward pass and of forward + gradients, as TensorFlow's profiler
    counts the ops of the traced graphs (per batch of len(batch[0]), divided by it)."""
    from tensorflow.python.profiler import model_analyzer, option_builder

    specs = tuple(tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)) for a in batch)

    def forward(*b):
        return loss(model, b)

    def gradients(*b):
        with tf.GradientTape() as tape:
            value = loss(model, b)
        return tape.gradient(value, variables)

    options = option_builder.ProfileOptionBuilder(option_builder.ProfileOptionBuilder.float_operation()
                                                  ).with_empty_output().build()
    counts = []
    for fn in (forward, gradients):
        graph = tf.function(fn).get_concrete_function(*specs).graph
        counts.append(model_analyzer.profile(graph, options=options).total_float_ops)
    n = len(batch[0])
    fwd = counts[0] // n
    return FlopCount(fwd, max(counts[1] // n - fwd, 0))
