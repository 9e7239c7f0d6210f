"""What the applier refuses before it touches the master weights: an update that does not fit
them, and initial weights it cannot start from. Each check returns why, in one line, or None."""

from __future__ import annotations

from typing import Mapping

import numpy as np


def invalid_update(tensors: Mapping[str, np.ndarray], master: Mapping[str, np.ndarray]) -> str | None:
    """Why `tensors` cannot be applied to `master`: other names or shapes, not real-valued, or
    not finite."""
    if set(tensors) != set(master):
        return "tensor names differ from the master's"
    for name, w in master.items():
        g = tensors[name]
        if g.shape != w.shape:
            return f"tensor {name!r}: shape {g.shape} != master {w.shape}"
        if g.dtype.kind not in "iuf":
            return f"tensor {name!r}: dtype {g.dtype} is not real-valued"
        if g.dtype.kind == "f" and not np.isfinite(g).all():
            return f"tensor {name!r}: non-finite values"
    return None


def invalid_initial(tensors: Mapping[str, np.ndarray]) -> str | None:
    """Why `tensors` cannot be the master's first weights: none, not floating point, or not finite."""
    if not tensors:
        return "no tensors"
    for name, w in tensors.items():
        if np.asarray(w).dtype.kind != "f":
            return f"tensor {name!r}: master weights must be floating point"
        if not np.isfinite(w).all():
            return f"tensor {name!r}: non-finite values"
    return None
