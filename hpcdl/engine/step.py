"""The training step: the one every caller runs, so the planner's measurement and the benches time
the engine itself, not a copy of it.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf


def make_train_step(loss: Callable[[Any], tf.Tensor], variables: list[tf.Variable], optimizer,
                    hvd=None) -> Callable[[Any], tuple[tf.Tensor, list[tf.Tensor], tf.Tensor]]:
    """A traced step ``batch -> (loss, gradients, finite)`` that applies the gradients to
    `variables` when the loss and every gradient are finite, and leaves the weights (and the
    optimizer's state) as they were otherwise: one NaN applied would make every weight NaN.
    `finite` holds one flag for the loss, then one per gradient, so the caller can say which.

    With `hvd` (an initialised ``horovod.tensorflow``) the gradients are averaged over the group
    before they are applied and the loss returned is the group's mean; the gradients returned
    are the averaged ones, which the exchange publishes. Every rank of the group then sees the
    same flags and takes the same decision. Without it (one process measuring the step) the
    gradients are this process's own.
    """

    @tf.function(reduce_retracing=True)
    def train_step(batch):
        with tf.GradientTape() as tape:
            value = loss(batch)
        if hvd is not None:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(value, variables)
        if hvd is not None:
            value = hvd.allreduce(value, op=hvd.Average)
        finite = tf.stack([tf.reduce_all(tf.math.is_finite(t)) for t in [value, *grads]])

        def apply():
            optimizer.apply(grads, variables)
            return tf.constant(True)

        tf.cond(tf.reduce_all(finite), apply, lambda: tf.constant(False))
        return value, grads, finite

    return train_step
