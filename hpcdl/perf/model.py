"""The planner's cost model of one synchronous group step: compute, stragglers, collectives.

One step of a group of P nodes (b examples per node, F training FLOPs per example, R sustained
training FLOP/s of one node):

* compute, one node: t_c = b·F / R.
* stragglers: node i takes t_c·X_i this step, X_i iid lognormal with E[X] = 1,
  X = exp(σZ − σ²/2), Z standard normal. The group waits for its slowest node, so its compute
  time is t_c·max(X_1..X_P). The max of P iid draws is sampled exactly by inversion
  (max = F⁻¹(U^(1/P)), U uniform), one draw per group and step, so 9600 nodes cost no more than
  one. The straggler wait is E[max] − t_c.
* stalls and slow nodes (both 0 unless measured, hpcdl.perf.stragglers): a node's step stalls
  with probability p, taking `stall_factor` times as long; the number of stalled nodes of a
  step is binomial, and the slowest is the larger of the two maxima, stalled and not. A share
  of the nodes is persistently `slow_factor` times slower; they are dealt to the groups in turn
  (as a scheduler spreads them when it does not know them), so a group with one waits for it
  every step.
* allreduce (and the broadcast of adopted weights), recursive doubling / binomial tree:
  T(P, n) = ⌈log₂ P⌉ · (α + n/B) for P > 1, 0 for P = 1, with n the gradient's bytes, α the
  network's latency and B its point-to-point bandwidth. Each of the ⌈log₂ P⌉ rounds moves the
  whole buffer, so for large messages this is an upper bound (a Rabenseifner allreduce needs
  ≈ 2n/B + 2⌈log₂ P⌉α); the models at hand are small enough that latency rounds dominate.

Pure Python + numpy: the planner must run on a login node without TensorFlow.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def tree_rounds(nodes: int) -> int:
    """⌈log₂ nodes⌉ (0 for one node)."""
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    return (nodes - 1).bit_length()


def tree_collective_seconds(nodes: int, nbytes: float, latency: float, bandwidth: float) -> float:
    """Allreduce (recursive doubling) or broadcast (binomial tree): ⌈log₂ P⌉·(α + n/B)."""
    return tree_rounds(nodes) * (latency + nbytes / bandwidth)


def allreduce_seconds(inputs: Any, nodes: int) -> float:
    """The gradient allreduce of a group of `nodes` under `inputs` (a PlanInputs)."""
    return tree_collective_seconds(nodes, inputs.model_bytes, inputs.allreduce_latency,
                                   inputs.allreduce_bandwidth)


# Acklam's coefficients for the normal quantile.
_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
      1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
      6.680131188771972e+01, -1.328068155288572e+01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
      -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
      3.754408661907416e+00)


def norm_ppf(p: np.ndarray, q: np.ndarray | None = None) -> np.ndarray:
    """Standard normal quantile of p (q = 1 − p, given separately for precision near 1).

    Acklam's rational approximation (relative error < 1.2e-9), vectorised: the slowest of 9600
    nodes lives at p = U^(1/9600), far closer to 1 than 1 − p can resolve, hence `q`.
    """
    p = np.asarray(p, dtype=float)
    q = 1.0 - p if q is None else np.asarray(q, dtype=float)
    out = np.empty_like(p)
    low, high = p < 0.02425, q < 0.02425
    mid = ~(low | high)

    def tail(x: np.ndarray) -> np.ndarray:
        t = np.sqrt(-2.0 * np.log(x))
        num = ((((_C[0] * t + _C[1]) * t + _C[2]) * t + _C[3]) * t + _C[4]) * t + _C[5]
        den = (((_D[0] * t + _D[1]) * t + _D[2]) * t + _D[3]) * t + 1.0
        return num / den

    out[low] = tail(p[low])
    out[high] = -tail(q[high])
    r = p[mid] - 0.5
    s = r * r
    num = (((((_A[0] * s + _A[1]) * s + _A[2]) * s + _A[3]) * s + _A[4]) * s + _A[5]) * r
    den = ((((_B[0] * s + _B[1]) * s + _B[2]) * s + _B[3]) * s + _B[4]) * s + 1.0
    out[mid] = num / den
    return out


def sample_slowest(rng: np.random.Generator, sigma: float, nodes: Any, size: Any, *,
                   stall_probability: float = 0.0, stall_factor: float = 1.0) -> np.ndarray:
    """Draws of max(X_1..X_nodes), X iid lognormal with E[X] = 1 (σ = 0: exactly 1), each X
    times `stall_factor` with probability `stall_probability`. `nodes` may be an array that
    broadcasts to `size`; a max over no nodes is 0."""
    nodes = np.broadcast_to(np.asarray(nodes), size)
    if stall_probability <= 0 or stall_factor == 1:
        return _lognormal_max(rng, sigma, nodes, size)
    stalled = rng.binomial(nodes, stall_probability)
    return np.maximum(_lognormal_max(rng, sigma, nodes - stalled, size),
                      stall_factor * _lognormal_max(rng, sigma, stalled, size))


def _lognormal_max(rng: np.random.Generator, sigma: float, nodes: np.ndarray, size: Any) -> np.ndarray:
    if sigma == 0:
        return np.where(nodes > 0, 1.0, 0.0) * np.ones(size)
    u = rng.random(size)
    u = np.maximum(u, np.finfo(float).tiny)
    with np.errstate(divide="ignore"):
        lu = np.log(u) / np.maximum(nodes, 1)  # log of U^(1/P)
    z = norm_ppf(np.exp(lu), -np.expm1(lu))
    return np.where(nodes > 0, np.exp(sigma * z - 0.5 * sigma * sigma), 0.0)


def slow_nodes_per_group(nodes: int, groups: int, fraction: float) -> np.ndarray:
    """How many of the round(fraction × nodes) slow nodes each group holds, dealt in turn."""
    slow = round(fraction * nodes)
    return np.array([slow // groups + (g < slow % groups) for g in range(groups)])


def sample_group_slowest(rng: np.random.Generator, inputs: Any, nodes_per_group: int,
                         slow_per_group: np.ndarray, size: Any) -> np.ndarray:
    """Draws of the slowest node's factor per group (axis 0 of `size`) and step, stragglers,
    stalls and the group's slow nodes included (`inputs`: a PlanInputs)."""
    stalls = dict(stall_probability=inputs.stall_probability, stall_factor=inputs.stall_factor)
    sigma = inputs.straggler_sigma
    slow = np.asarray(slow_per_group).reshape((-1,) + (1,) * (len(size) - 1))
    if inputs.slow_factor == 1 or not slow.any():
        return sample_slowest(rng, sigma, nodes_per_group, size, **stalls)
    ordinary = sample_slowest(rng, sigma, nodes_per_group - slow, size, **stalls)
    return np.maximum(ordinary, inputs.slow_factor * sample_slowest(rng, sigma, slow, size, **stalls))
