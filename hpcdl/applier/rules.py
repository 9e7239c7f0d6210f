"""The applier's update rules: how one update moves the master weights.

Each rule is a small class registered under its name in :data:`UPDATE_RULES`; the job field
``exchange.optimizer`` names one, and its validation, the applier and the planner read this
table. A rule updates the master weights and its own slots in place, in one compiled pass per
tensor (:mod:`hpcdl.applier.kernels`), for one update ``g`` at a time, scaled by ``s`` (1, or the
staleness scaling's factor). ``t`` counts the updates applied so far, this one included.

For ``exchange.kind = "gradient"`` ``g`` is a group's averaged gradient; for ``"delta"`` it is a
group's pseudo-gradient ``θ_base − θ_local`` after H local steps (DiLoCo), and the rule is the
*outer* optimizer.

* ``sgd``:       w ← w − lr·s·g
* ``momentum``:  m ← μ·m + s·g;  w ← w − lr·m                                  (heavy ball)
* ``adam``:      m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
                 w ← w − lr·s·(m / (1−β1^t)) / (√(v / (1−β2^t)) + ε)            (Kingma & Ba)
                 Adam's step does not change when its gradients are scaled, so here ``s``
                 scales the step (the learning rate), not ``g``.
* ``nesterov``:  with delay N (``exchange.momentum_delay``; 0 means N = the number of groups):
                 w ← w − (lr/N)·s·g;  b ← b + s·g;  and when t is a multiple of N:
                 m ← μ·m + b/N;  w ← w − lr·μ·m;  b ← 0.
                 With N = 1 this is Nesterov momentum SGD exactly as DiLoCo's outer optimizer
                 (PyTorch's ``SGD(nesterov=True)``: m ← μ·m + g, w ← w − lr·(g + μ·m)). With
                 N = G it is the *delayed Nesterov* of asynchronous Local-SGD (Liu et al. 2024):
                 G arrivals move the master by lr times their mean, as one synchronous DiLoCo
                 step over G workers would, and the momentum, which stale arrivals would
                 otherwise amplify (Mitliagkas et al. 2016), advances once per G arrivals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

import numpy as np

from hpcdl.adam import ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON
from hpcdl.config import ExchangeConfig

Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class RuleParams:
    """The hyper-parameters every rule is built from (each uses the ones it names)."""

    lr: float = 1e-3
    momentum: float = 0.9
    beta1: float = ADAM_BETA1
    beta2: float = ADAM_BETA2
    eps: float = ADAM_EPSILON
    delay: int = 1


class UpdateRule:
    """One update rule; ``slots`` names the per-tensor state it keeps beside the weights."""

    name: ClassVar[str]
    slots: ClassVar[tuple[str, ...]] = ()

    def __init__(self, params: RuleParams):
        self.p = params

    @classmethod
    def default_rate(cls, kind: str, train_learning_rate: float, groups: int) -> float:
        """The rate when the job sets none, as the hybrid race found it (docs/results.md): G stale
        small-batch gradients stand for one synchronous step of G times the batch, so gradients go
        in at the groups' rate / √G; deltas at the rule's own outer rate."""
        if kind == "gradient":
            return train_learning_rate / max(1, groups) ** 0.5
        return cls.outer_rate(train_learning_rate, groups)

    @classmethod
    def outer_rate(cls, train_learning_rate: float, groups: int) -> float:
        """An adaptive outer rule (adam) takes the groups' own rate."""
        return train_learning_rate

    def apply(self, weights: Arrays, slots: Mapping[str, Arrays], update: Mapping[str, np.ndarray],
              scale: float, t: int) -> None:
        from hpcdl.applier import kernels  # numba: imported by the applier, not by job validation

        for name, w in weights.items():
            arrays = [w] + [slots[s][name] for s in self.slots]
            if not all(a.flags.c_contiguous for a in arrays):
                raise ValueError(f"tensor {name!r}: master weights and slots must be C-contiguous")
            # float16 masters: the same kernel on float32 copies, rounded back
            native = w.dtype in _COMPILED
            work = w.dtype if native else np.dtype(np.float32)
            flat = [a.reshape(-1) if native else a.reshape(-1).astype(work) for a in arrays]
            g = np.ascontiguousarray(update[name], dtype=work).reshape(-1)
            self.apply_tensor(kernels, work.type, *flat, g=g, scale=scale, t=t)
            if not native:
                for a, f in zip(arrays, flat):
                    a.reshape(-1)[:] = f

    def apply_tensor(self, k, dt, w, *slots, g, scale, t) -> None:
        """One tensor, flat: ``k`` the kernels module, ``dt`` the arithmetic's scalar type."""
        raise NotImplementedError


_COMPILED = (np.dtype(np.float32), np.dtype(np.float64))


class Sgd(UpdateRule):
    name = "sgd"

    @classmethod
    def outer_rate(cls, train_learning_rate: float, groups: int) -> float:
        return 2.0 / max(1, groups)  # the deltas averaged in at twice their mean

    def apply_tensor(self, k, dt, w, *, g, scale, t):
        k.sgd(w, g, dt(self.p.lr * scale))


class Momentum(UpdateRule):
    name = "momentum"
    slots = ("m",)

    def apply_tensor(self, k, dt, w, m, *, g, scale, t):
        k.momentum(w, m, g, dt(self.p.momentum), dt(scale), dt(self.p.lr))


class Adam(UpdateRule):
    name = "adam"
    slots = ("m", "v")

    def apply_tensor(self, k, dt, w, m, v, *, g, scale, t):
        # The textbook step with its scalars folded: lr·s·m̂/(√v̂ + ε) = (lr·s·√c2/c1)·m/(√v + ε·√c2)
        p = self.p
        c1, c2 = 1.0 - p.beta1 ** t, 1.0 - p.beta2 ** t
        k.adam(w, m, v, g, dt(p.beta1), dt(p.beta2), dt(1.0 - p.beta1), dt(1.0 - p.beta2),
               dt(p.lr * scale * c2 ** 0.5 / c1), dt(p.eps * c2 ** 0.5))


class Nesterov(UpdateRule):
    name = "nesterov"

    @classmethod
    def outer_rate(cls, train_learning_rate: float, groups: int) -> float:
        return 0.7  # DiLoCo's outer Nesterov rate
    slots = ("m", "b")

    def apply_tensor(self, k, dt, w, m, b, *, g, scale, t):
        p = self.p
        n = max(1, p.delay)
        k.nesterov_arrival(w, b, g, dt(p.lr * scale / n), dt(scale))
        if t % n == 0:
            # the momentum step on the arrivals' mean b/N (heavy ball's kernel), then a new round
            k.momentum(w, m, b, dt(p.momentum), dt(1.0 / n), dt(p.lr * p.momentum))
            b.fill(0)


UPDATE_RULES: dict[str, type[UpdateRule]] = {r.name: r for r in (Sgd, Momentum, Adam, Nesterov)}


def applier_learning_rate(exchange: ExchangeConfig, train_learning_rate: float, groups: int) -> float:
    """The applier's rate: the job's `exchange.learning_rate`, or its rule's default for the
    exchange's kind and the number of groups."""
    return exchange.learning_rate or UPDATE_RULES[exchange.optimizer].default_rate(
        exchange.kind, train_learning_rate, groups)


def make_rule(name: str, params: RuleParams) -> UpdateRule:
    try:
        return UPDATE_RULES[name](params)
    except KeyError:
        raise ValueError(f"unknown update rule {name!r} (known: {', '.join(UPDATE_RULES)})") from None
