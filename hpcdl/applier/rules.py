"""The applier's update rules: how one update moves the master weights.

Each rule is a small class registered under its name in :data:`UPDATE_RULES`; the job field
``exchange.optimizer`` names one, and its validation, the applier and the planner read this
table. A rule updates the master weights and its own slots in place (numpy, no temporaries the
size of a tensor beyond one scratch buffer), for one update ``g`` at a time, scaled by ``s`` (1, or
the staleness scaling's factor). ``t`` counts the updates applied so far, this one included.

For ``exchange.kind = "gradient"`` ``g`` is a group's averaged gradient; for ``"delta"`` it is a
group's pseudo-gradient ``θ_base − θ_local`` after H local steps (DiLoCo), and the rule is the
*outer* optimizer.

* ``sgd``:       w ← w − lr·s·g
* ``momentum``:  m ← μ·m + s·g;  w ← w − lr·m                                  (heavy ball)
* ``adam``:      m ← β1·m + (1−β1)·s·g;  v ← β2·v + (1−β2)·(s·g)²;
                 w ← w − lr·(m / (1−β1^t)) / (√(v / (1−β2^t)) + ε)              (Kingma & Ba)
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

from hpcdl.config import ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON

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

    def apply(self, weights: Arrays, slots: Mapping[str, Arrays], update: Mapping[str, np.ndarray],
              scale: float, t: int) -> None:
        for name, w in weights.items():
            g = np.asarray(update[name], dtype=w.dtype)
            self.apply_tensor(w, {s: slots[s][name] for s in self.slots}, g, scale, t)

    def apply_tensor(self, w: np.ndarray, slot: dict[str, np.ndarray], g: np.ndarray,
                     scale: float, t: int) -> None:
        raise NotImplementedError


class Sgd(UpdateRule):
    name = "sgd"

    def apply_tensor(self, w, slot, g, scale, t):
        w -= (self.p.lr * scale) * g


class Momentum(UpdateRule):
    name = "momentum"
    slots = ("m",)

    def apply_tensor(self, w, slot, g, scale, t):
        m = slot["m"]
        m *= self.p.momentum
        m += scale * g if scale != 1.0 else g
        w -= self.p.lr * m


class Adam(UpdateRule):
    name = "adam"
    slots = ("m", "v")

    def __init__(self, params: RuleParams):
        super().__init__(params)
        self._scratch: dict[tuple[int, str], np.ndarray] = {}

    def scratch(self, like: np.ndarray) -> np.ndarray:
        """One buffer per size, kept: a fresh one per update would page-fault megabytes each time."""
        key = (like.size, like.dtype.str)
        if key not in self._scratch:
            self._scratch[key] = np.empty(like.size, like.dtype)
        return self._scratch[key].reshape(like.shape)

    def apply_tensor(self, w, slot, g, scale, t):
        # The textbook step, with its scalars folded so that each array is passed over as few
        # times as numpy allows (the cost is memory traffic): lr·m̂/(√v̂ + ε) =
        # (lr·√c2/c1)·m/(√v + ε·√c2), and s·g enters m and v through their coefficients.
        p = self.p
        m, v = slot["m"], slot["v"]
        c1, c2 = 1.0 - p.beta1 ** t, 1.0 - p.beta2 ** t
        tmp = self.scratch(w)
        if p.beta1:
            m *= p.beta1
            np.multiply(g, (1.0 - p.beta1) * scale, out=tmp)
            m += tmp
        else:
            np.multiply(g, scale, out=m)
        np.multiply(g, g, out=tmp)
        tmp *= (1.0 - p.beta2) * scale * scale
        v *= p.beta2
        v += tmp
        np.sqrt(v, out=tmp)
        tmp += p.eps * c2 ** 0.5
        np.divide(m, tmp, out=tmp)
        tmp *= p.lr * c2 ** 0.5 / c1
        w -= tmp


class Nesterov(UpdateRule):
    name = "nesterov"
    slots = ("m", "b")

    def apply_tensor(self, w, slot, g, scale, t):
        p = self.p
        n = max(1, p.delay)
        m, b = slot["m"], slot["b"]
        w -= (p.lr * scale / n) * g
        b += scale * g if scale != 1.0 else g
        if t % n == 0:
            m *= p.momentum
            m += b / n if n > 1 else b
            w -= (p.lr * p.momentum) * m
            b.fill(0)


UPDATE_RULES: dict[str, type[UpdateRule]] = {r.name: r for r in (Sgd, Momentum, Adam, Nesterov)}


def make_rule(name: str, params: RuleParams) -> UpdateRule:
    try:
        return UPDATE_RULES[name](params)
    except KeyError:
        raise ValueError(f"unknown update rule {name!r} (known: {', '.join(UPDATE_RULES)})") from None
