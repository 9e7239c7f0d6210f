"""The update rules' arithmetic, one compiled pass over each tensor (numba).

The rules' formulas are in :mod:`hpcdl.applier.rules`; each kernel here is one of them over flat
float32 or float64 arrays, element by element, so that the weights, the slots and the update are
each read and written once, where numpy passes over them about a dozen times (figures: README,
"Appliers and shards"). ``error_model="numpy"`` lets the loops vectorise (no ZeroDivisionError
check); ``fastmath`` stays off, so each element is rounded as the formula reads. Compiled on
first use per dtype, once per process; nothing is cached on disk.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_jit = njit(nogil=True, error_model="numpy", boundscheck=False, cache=False)


@_jit
def sgd(w, g, step):
    for i in range(w.size):
        w[i] -= step * g[i]


@_jit
def momentum(w, m, g, mu, scale, lr):
    for i in range(w.size):
        mi = mu * m[i] + scale * g[i]
        m[i] = mi
        w[i] -= lr * mi


@_jit
def adam(w, m, v, g, beta1, beta2, cm, cv, step, eps):
    # m <- beta1 m + cm g;  v <- beta2 v + cv g^2;  w <- w - step m / (sqrt(v) + eps)
    for i in range(w.size):
        gi = g[i]
        mi = beta1 * m[i] + cm * gi
        vi = beta2 * v[i] + cv * (gi * gi)
        m[i] = mi
        v[i] = vi
        w[i] -= step * mi / (np.sqrt(vi) + eps)


@_jit
def nesterov_arrival(w, b, g, step, scale):
    for i in range(w.size):
        w[i] -= step * g[i]
        b[i] += scale * g[i]

