"""The training step: the one every caller runs, so the planner's measurement and the benches time
the engine itself, not a copy of it.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from hpcdl.engine.collective import Collective


def make_train_step(loss: Callable[[Any], tf.Tensor], variables: list[tf.Variable], optimizer,
                    comm: Collective | None = None) -> Callable[[Any], tuple[tf.Tensor, list[tf.Tensor], tf.Tensor, tf.Tensor]]:
    """A traced step ``batch -> (loss, gradients, finite, own seconds)`` that applies the
    gradients to `variables` when the loss and every gradient are finite, and leaves the weights
    (and the optimizer's state) as they were otherwise: one NaN applied would make every weight
    NaN. `finite` holds one flag for the loss, then one per gradient, so the caller can say which.

    With `comm` (the group's Collective) the gradients are averaged over the group
    before they are applied and the loss returned is the group's mean; the gradients returned
    are the averaged ones, which the exchange publishes, so every rank of the group sees the same
    flags and takes the same decision. Without it (one process measuring the step) the
    gradients are this process's own. The own seconds run from the step's start to the moment
    this process's last gradient is computed: the allreduce's wait for the other ranks is not in
    them, which is what tells a straggler from the ranks that wait for it.
    """

    @tf.function(reduce_retracing=True)
    def train_step(batch):
        began = tf.timestamp()
        with tf.control_dependencies([began]), tf.GradientTape() as tape:
            value = loss(batch)
        grads = tape.gradient(value, variables)
        with tf.control_dependencies([g for g in grads if g is not None]):
            own_seconds = tf.timestamp() - began
        if comm is not None:  # after the clock above; the loss travels with the gradients
            averaged = iter(comm.average([*(g for g in grads if g is not None), value]))
            grads = [None if g is None else next(averaged) for g in grads]
            value = next(averaged)
        finite = tf.stack([tf.constant(True) if t is None else tf.reduce_all(tf.math.is_finite(t)) for t in [value, *grads]])

        def apply():
            optimizer.apply(grads, variables)
            return tf.constant(True)

        tf.cond(tf.reduce_all(finite), apply, lambda: tf.constant(False))
        return value, grads, finite, own_seconds

    return train_step
