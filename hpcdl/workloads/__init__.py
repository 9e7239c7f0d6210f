"""Science workloads: each one is its data, its model and its metrics, together.

The engine and the schedulers know a workload only through `hpcdl.workloads.base.Workload`;
adding one means a subpackage with a `WORKLOAD` object and a line in `_REGISTRY`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcdl.workloads.base import Workload

# Imported lazily: naming a workload must not pay for TensorFlow's import.
_REGISTRY = {
    "hep": "hpcdl.workloads.hep.workload",
    "climate": "hpcdl.workloads.climate.workload",
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def get_workload(name: str) -> "Workload":
    from hpcdl.errors import JobError

    if name not in _REGISTRY:
        raise JobError(f"unknown workload {name!r} (known: {', '.join(names())})")
    return importlib.import_module(_REGISTRY[name]).WORKLOAD
