"""The engine's optimizers against the textbook formulas, and the engine's Adam against the
applier's: one Adam on both sides of the exchange."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from hpcdl.applier.rules import Adam as ApplierAdam, RuleParams  # noqa: E402
from hpcdl.adam import ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON  # noqa: E402
from hpcdl.engine.optim import make_optimizer  # noqa: E402


def textbook_adam(w, grads, lr, b1=ADAM_BETA1, b2=ADAM_BETA2, eps=ADAM_EPSILON):
    """Kingma & Ba, Algorithm 1, in float64."""
    w, m, v = np.array(w, np.float64), 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return w


def engine_steps(name, w0, grads, lr):
    var = tf.Variable(np.array(w0, np.float32))
    opt = make_optimizer(name, [var], lr)
    for g in grads:
        opt.apply([tf.constant(np.array(g, np.float32))], [var])
    return var.numpy()


GRADS = [np.array(g) for g in ([0.5, -2.0, 1e-6, 0.0], [0.4, -1.0, 3e-6, 0.0], [-0.3, 2.5, -1e-6, 0.0],
                              [0.1, 0.0, 2e-6, 1e-9], [0.2, -0.5, 0.0, -1e-9])]
W0 = np.array([1.0, -1.0, 0.5, 2.0])


def test_engine_adam_is_the_textbook_adam():
    got = engine_steps("adam", W0, GRADS, 1e-2)
    np.testing.assert_allclose(got, textbook_adam(W0, GRADS, 1e-2), rtol=1e-5, atol=1e-7)


def test_engine_and_applier_take_the_same_adam_steps():
    """Tiny gradients (where ε matters) included: the same constants, ε in the same place."""
    weights = {"w": W0.astype(np.float32)}
    rule = ApplierAdam(RuleParams(lr=1e-2))
    slots = {s: {"w": np.zeros_like(weights["w"])} for s in rule.slots}
    for t, g in enumerate(GRADS, start=1):
        rule.apply(weights, slots, {"w": g.astype(np.float32)}, 1.0, t)
    np.testing.assert_allclose(engine_steps("adam", W0, GRADS, 1e-2), weights["w"], rtol=1e-5, atol=1e-7)


def test_engine_sgd_is_plain_gradient_descent():
    got = engine_steps("sgd", W0, GRADS, 0.1)
    np.testing.assert_allclose(got, W0 - 0.1 * np.sum(GRADS, axis=0), rtol=1e-6, atol=1e-7)


def test_adam_slots_and_step_survive_a_checkpoint(tmp_path):
    var = tf.Variable(W0.astype(np.float32))
    opt = make_optimizer("adam", [var], 1e-2)
    for g in GRADS[:3]:
        opt.apply([tf.constant(g.astype(np.float32))], [var])
    tf.train.Checkpoint(v=var, opt=opt).write(str(tmp_path / "c"))
    var2 = tf.Variable(np.zeros(4, np.float32))
    opt2 = make_optimizer("adam", [var2], 1e-2)
    tf.train.Checkpoint(v=var2, opt=opt2).read(str(tmp_path / "c")).assert_consumed()
    for g in GRADS[3:]:
        opt2.apply([tf.constant(g.astype(np.float32))], [var2])
    np.testing.assert_allclose(var2.numpy(), textbook_adam(W0, GRADS, 1e-2), rtol=1e-5, atol=1e-7)


def test_every_optimizer_a_job_may_name_exists():
    from hpcdl.jobfile import load_job
    from hpcdl.engine import TRAIN_OPTIMIZERS
    from hpcdl.engine.optim import make_optimizer

    var = tf.Variable(np.zeros(3, np.float32))
    for name in TRAIN_OPTIMIZERS:  # the names a job may give are the ones the engine builds
        assert load_job("hep", [f"train.optimizer={name}"]).train.optimizer == name
        assert isinstance(make_optimizer(name, [var], 1e-3), tf.Module)
