"""The applier's update rules against hand-computed steps, and the applier's staleness scaling."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import applier_for
from hpcdl.applier.rules import UPDATE_RULES, RuleParams, applier_learning_rate, make_rule
from hpcdl.exchange import Channel


def run_rule(name: str, grads: list[float], scales: list[float] | None = None, w0: float = 1.0,
             **params) -> list[float]:
    """Apply scalar updates one by one; returns the weight after each."""
    rule = make_rule(name, RuleParams(**params))
    weights = {"w": np.array([w0])}
    slots = {s: {"w": np.zeros(1)} for s in rule.slots}
    out = []
    for t, g in enumerate(grads, start=1):
        rule.apply(weights, slots, {"w": np.array([g])}, (scales or [1.0] * len(grads))[t - 1], t)
        out.append(float(weights["w"][0]))
    return out


def test_sgd_and_heavy_ball_momentum():
    assert run_rule("sgd", [0.5, 1.0], lr=0.1) == pytest.approx([0.95, 0.85])
    # m = 1 then 1.9; w = 1 - 0.1 = 0.9, then 0.9 - 0.19 = 0.71
    assert run_rule("momentum", [1.0, 1.0], lr=0.1, momentum=0.9) == pytest.approx([0.9, 0.71])


def test_nesterov_is_pytorchs_nesterov_sgd_without_delay():
    # PyTorch SGD(nesterov=True): m = 0.9 m + g; w -= lr (g + 0.9 m)
    # step 1: m = 1,   w = 1 - 0.1 * 1.9 = 0.81; step 2: m = 1.9, w = 0.81 - 0.1 * 2.71 = 0.539
    assert run_rule("nesterov", [1.0, 1.0], lr=0.1, momentum=0.9, delay=1) == pytest.approx([0.81, 0.539])


def test_delayed_nesterov_over_n_arrivals_is_one_synchronous_outer_step():
    # arrivals 1 and 3 with N = 2: w = 1 - 0.05 = 0.95, then 0.95 - 0.15 = 0.8, and the momentum
    # step with m = (1 + 3) / 2 = 2: 0.8 - 0.1 * 0.9 * 2 = 0.62 -- the same as one Nesterov step
    # on the mean 2 (1 - 0.1 * (2 + 0.9 * 2) = 0.62), as synchronous DiLoCo over 2 workers takes.
    got = run_rule("nesterov", [1.0, 3.0], lr=0.1, momentum=0.9, delay=2)
    assert got == pytest.approx([0.95, 0.62])
    sync = run_rule("nesterov", [2.0], lr=0.1, momentum=0.9, delay=1)
    assert got[-1] == pytest.approx(sync[-1])
    # the third arrival starts a new round: plain lr/N, the momentum waits for the fourth
    assert run_rule("nesterov", [1.0, 3.0, 2.0], lr=0.1, momentum=0.9, delay=2)[-1] == pytest.approx(0.62 - 0.1)


def test_adam_first_steps_match_the_formula():
    # t = 1: m = 0.2, v = 0.004, m_hat = 2, v_hat = 4: w -= 0.1 * 2 / (2 + eps)
    got = run_rule("adam", [2.0, -1.0], lr=0.1, eps=1e-8)
    m, v, w = 0.0, 0.0, 1.0
    for t, g in enumerate([2.0, -1.0], start=1):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w -= 0.1 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    assert got[0] == pytest.approx(0.9)
    assert got[-1] == pytest.approx(w)


def test_scale_multiplies_the_update():
    assert run_rule("sgd", [1.0], scales=[0.25], lr=1.0) == pytest.approx([0.75])
    assert run_rule("nesterov", [1.0], scales=[0.5], lr=0.1, momentum=0.0) == pytest.approx([0.95])


def test_a_scaled_adam_update_takes_a_scaled_step():
    """Adam's step is blind to a gradient's scale: a downweighted or warming-up update must
    scale the learning rate instead (1 - 0.1 * 0.5 * 2/(2 + eps) = 0.95)."""
    assert run_rule("adam", [2.0], scales=[0.5], lr=0.1) == pytest.approx([0.95])
    assert run_rule("adam", [2.0, 2.0], scales=[1.0, 0.5], lr=0.1) == pytest.approx([0.9, 0.85])


def test_rules_keep_zero_dimensional_tensors_arrays():
    for name, cls in UPDATE_RULES.items():
        rule = cls(RuleParams(lr=0.1))
        weights = {"s": np.array(1.0), "v": np.ones(3)}
        slots = {s: {k: np.zeros_like(w) for k, w in weights.items()} for s in rule.slots}
        rule.apply(weights, slots, {"s": np.array(1.0), "v": np.ones(3)}, 1.0, 1)
        assert isinstance(weights["s"], np.ndarray) and weights["s"] < 1.0, name


def reference_step(name: str, p: RuleParams, w, slot: dict, g, scale: float, t: int) -> None:
    """Each rule's formula from the module docstring, in float64 numpy, written out plainly."""
    if name == "sgd":
        w -= p.lr * scale * g
    elif name == "momentum":
        slot["m"][...] = p.momentum * slot["m"] + scale * g
        w -= p.lr * slot["m"]
    elif name == "adam":
        slot["m"][...] = p.beta1 * slot["m"] + (1 - p.beta1) * g
        slot["v"][...] = p.beta2 * slot["v"] + (1 - p.beta2) * g ** 2
        m_hat, v_hat = slot["m"] / (1 - p.beta1 ** t), slot["v"] / (1 - p.beta2 ** t)
        w -= p.lr * scale * m_hat / (np.sqrt(v_hat) + p.eps)
    else:
        n = p.delay
        w -= p.lr * scale / n * g
        slot["b"] += scale * g
        if t % n == 0:
            slot["m"][...] = p.momentum * slot["m"] + slot["b"] / n
            w -= p.lr * p.momentum * slot["m"]
            slot["b"][...] = 0


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 2e-5), (np.float16, 2e-2)])
@pytest.mark.parametrize("name", sorted(UPDATE_RULES))
def test_compiled_rules_take_the_formulas_steps_on_every_float_dtype(name, dtype, rtol):
    rng = np.random.default_rng(7)
    p = RuleParams(lr=0.05, delay=2)
    shapes = {"conv": (3, 3, 2, 4), "bias": (4,), "scalar": (), "empty": (0, 3)}
    w0 = {k: rng.standard_normal(s) for k, s in shapes.items()}
    rule = make_rule(name, p)
    weights = {k: a.astype(dtype) for k, a in w0.items()}
    slots = {s: {k: np.zeros_like(a) for k, a in weights.items()} for s in rule.slots}
    ref = {k: a.astype(dtype).astype(np.float64) for k, a in w0.items()}
    ref_slots = {k: {s: np.zeros(shapes[k]) for s in rule.slots} for k in shapes}
    for t in range(1, 6):
        # tiny gradients too, where ε matters (not in float16, whose v would underflow to 0)
        low = 0 if dtype == np.float16 else -6
        g = {k: rng.standard_normal(s) * 10.0 ** rng.integers(low, 1) for k, s in shapes.items()}
        scale = 1.0 if t % 2 else 0.5
        rule.apply(weights, slots, {k: a.astype(dtype) for k, a in g.items()}, scale, t)
        for k in shapes:
            reference_step(name, p, ref[k], ref_slots[k], g[k].astype(dtype).astype(np.float64), scale, t)
    for k in shapes:
        assert weights[k].dtype == dtype and weights[k].shape == shapes[k]
        np.testing.assert_allclose(weights[k], ref[k], rtol=rtol, atol=rtol * 1e-2, err_msg=k)
        for s in rule.slots:
            assert slots[s][k].dtype == dtype


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="unknown update rule"):
        make_rule("adagrad", RuleParams())


def test_staleness_scaling_divides_by_staleness(tmp_path):
    ch = Channel(tmp_path / "x", "run", fsync=False)
    with applier_for(ch, "sgd", 1.0, initial={"w": np.zeros(1)}, staleness_scaling=True, lock=False) as app:
        for seq in range(3):  # all computed from version 0: staleness 0, 1, 2
            ch.publish_update(0, seq, 0, {"w": np.ones(1)})
        while app.step():
            pass
        # scales 1 (staleness 0 counts as 1), 1, 1/2
        assert app.weights["w"][0] == pytest.approx(-2.5)


def test_a_replay_below_the_newest_processed_seq_is_never_applied(tmp_path):
    ch = Channel(tmp_path / "x", "run", fsync=False)
    with applier_for(ch, "sgd", 1.0, initial={"w": np.zeros(1)}, lock=False) as app:
        for seq in (1, 2):  # seq 0 was deleted by the backlog bound before the applier saw it
            ch.publish_update(0, seq, 0, {"w": np.ones(1)})
        while app.step():
            pass
        ch.publish_update(0, 0, 0, {"w": np.ones(1)})  # a replay of it
        while app.step():
            pass
        assert app.weights["w"][0] == pytest.approx(-2.0)
        assert app.counts["duplicates"] == 1 and app.counts["applied"] == 2


def test_the_default_applier_rate_follows_the_groups():
    from hpcdl.config import ExchangeConfig

    assert applier_learning_rate(ExchangeConfig(learning_rate=5e-4), 1e-3, 8) == 5e-4  # the job's
    assert applier_learning_rate(ExchangeConfig(), 1e-3, 4) == pytest.approx(5e-4)  # 1e-3 / √4
    assert applier_learning_rate(ExchangeConfig(kind="delta", optimizer="sgd"), 1e-3, 8) == 0.25
    assert applier_learning_rate(ExchangeConfig(kind="delta", optimizer="nesterov"), 1e-3, 8) == 0.7


def test_an_adaptive_outer_rule_for_deltas_defaults_to_the_groups_rate_and_a_negative_seed_is_refused():
    from hpcdl.config import EmulateConfig, ExchangeConfig
    from hpcdl.errors import JobError

    assert applier_learning_rate(ExchangeConfig(kind="delta", optimizer="adam"), 1e-3, 2) == 1e-3
    with pytest.raises(JobError, match="emulate.seed"):
        EmulateConfig(enabled=True, seed=-1).validate()

