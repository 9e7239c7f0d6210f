"""Optimizers over plain `tf.Variable`s, checkpointable, with no Keras in the way.

Horovod's Keras wrappers do not average gradients with Keras 3 optimizers (ranks silently drift
apart), so the engine allreduces gradients itself and applies them with these few lines.
"""

from __future__ import annotations

import tensorflow as tf

from hpcdl.adam import ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON
from hpcdl.engine import TRAIN_OPTIMIZERS
from hpcdl.registry import load_registered


class Adam(tf.Module):
    """Adam (Kingma & Ba) with bias correction; slots are created with the first variables seen."""

    def __init__(self, variables: list[tf.Variable], learning_rate: float = 1e-3,
                 beta1: float = ADAM_BETA1, beta2: float = ADAM_BETA2, epsilon: float = ADAM_EPSILON):
        super().__init__(name="adam")
        self.learning_rate = tf.Variable(learning_rate, trainable=False, dtype=tf.float32)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon
        self.iterations = tf.Variable(0, trainable=False, dtype=tf.int64)
        self.m = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
        self.v = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]

    def apply(self, grads: list[tf.Tensor], variables: list[tf.Variable]) -> None:
        with self.name_scope:  # op names say "adam/": bench/profile_step.py's optimizer row
            self._apply(grads, variables)

    def _apply(self, grads: list[tf.Tensor], variables: list[tf.Variable]) -> None:
        # Element-wise ops, not one fused ResourceApplyAdam per variable: the same arithmetic as
        # the applier's numpy kernels, and the fused op was not faster (bench/step_variants.py).
        # The textbook step lr·m̂/(√v̂ + ε) with the bias corrections folded into two scalars, as
        # the applier's Adam (hpcdl.applier.rules) folds them: the same rule on both sides.
        self.iterations.assign_add(1)
        t = tf.cast(self.iterations, tf.float32)
        root_c2 = tf.sqrt(1.0 - self.beta2**t)
        lr = self.learning_rate * root_c2 / (1.0 - self.beta1**t)
        eps = self.epsilon * root_c2
        for g, var, m, v in zip(grads, variables, self.m, self.v):
            m.assign(self.beta1 * m + (1.0 - self.beta1) * g)
            v.assign(self.beta2 * v + (1.0 - self.beta2) * tf.square(g))
            var.assign_sub(lr * m / (tf.sqrt(v) + eps))


class SGD(tf.Module):
    def __init__(self, variables: list[tf.Variable], learning_rate: float = 1e-2):
        super().__init__(name="sgd")
        self.learning_rate = tf.Variable(learning_rate, trainable=False, dtype=tf.float32)
        self.iterations = tf.Variable(0, trainable=False, dtype=tf.int64)

    def apply(self, grads: list[tf.Tensor], variables: list[tf.Variable]) -> None:
        self.iterations.assign_add(1)
        for g, var in zip(grads, variables):
            var.assign_sub(self.learning_rate * g)


def make_optimizer(name: str, variables: list[tf.Variable], learning_rate: float) -> tf.Module:
    """The optimizer registered as ``name`` in hpcdl.engine.TRAIN_OPTIMIZERS."""
    return load_registered(TRAIN_OPTIMIZERS, name, "train.optimizer")(variables, learning_rate=learning_rate)
