"""The training step: the one every caller runs, so the planner's measurement and the benches time
the engine itself, not a copy of it.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf


def make_train_step(loss: Callable[[Any], tf.Tensor], variables: list[tf.Variable], optimizer,
                    hvd=None) -> Callable[[Any], tuple[tf.Tensor, list[tf.Tensor]]]:
    """A traced step ``batch -> (loss, gradients)`` that applies the gradients to `variables`.

    With `hvd` (an initialised ``horovod.tensorflow``) the gradients are averaged over the group
    before they are applied and the loss returned is the group's mean; the gradients returned
    are the averaged ones, which the exchange publishes. Without it (one process measuring the
    step) the gradients are this process's own.
    """

    @tf.function(reduce_retracing=True)
    def train_step(batch):
        with tf.GradientTape() as tape:
            value = loss(batch)
        if hvd is not None:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(value, variables)
        optimizer.apply(grads, variables)
        if hvd is not None:
            value = hvd.allreduce(value, op=hvd.Average)
        return value, grads

    return train_step
