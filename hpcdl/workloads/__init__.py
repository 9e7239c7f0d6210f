"""Science workloads: each one is its data, its model and its metrics, together.

The engine and the schedulers know a workload only through `hpcdl.workloads.base.Workload`. A
workload is found by name through the ``hpcdl.workloads`` entry-point group -- hpcdl's own
(hep, climate, keras) register there exactly as a user's installed package does -- or, in a job
file, by a ``"package.module:object"`` reference to code that is not packaged.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcdl.workloads.base import Workload

ENTRY_POINT_GROUP = "hpcdl.workloads"

# hpcdl's own entry points (pyproject.toml), for a source tree used without being installed.
# Imported lazily: naming a workload must not pay for TensorFlow's import.
BUILTIN = {
    "hep": "hpcdl.workloads.hep.workload:WORKLOAD",
    "climate": "hpcdl.workloads.climate.workload:WORKLOAD",
    "keras": "hpcdl.workloads.keras.workload:WORKLOAD",
}


@dataclass(frozen=True)
class Provider:
    """Where a workload name comes from: its ``module:object`` and the distribution that declares it."""

    name: str
    reference: str
    source: str  # "hpcdl 0.1.0 (built-in)", "my-hpcdl-workload 1.0", or "job file reference"


def providers() -> dict[str, Provider]:
    """Every installed workload by name: the entry points of the group, hpcdl's own built-ins
    whether or not hpcdl is installed. A name two distributions declare is the first one's."""
    found: dict[str, Provider] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        label = f"{dist.name} {dist.version}" if dist is not None else "an entry point"
        if ep.name in BUILTIN and ep.value == BUILTIN[ep.name]:
            label += " (built-in)"
        found.setdefault(ep.name, Provider(ep.name, ep.value, label))
    for name, reference in BUILTIN.items():
        found.setdefault(name, Provider(name, reference, "hpcdl (built-in)"))
    return dict(sorted(found.items()))


def names() -> list[str]:
    return list(providers())


def is_reference(name: str) -> bool:
    """A job's `workload` that names code (``package.module:object``), not an installed name."""
    return ":" in name


def get_workload(name: str) -> "Workload":
    """The workload a job names; a name nobody provides, an entry point that fails to load, or
    an object that is not a Workload: a JobError of one line."""
    from hpcdl.errors import JobError
    from hpcdl.registry import load_object
    from hpcdl.workloads.base import Workload

    if is_reference(name):
        what, reference = "workload", name
    else:
        known = providers()
        if name not in known:
            raise JobError(f"unknown workload {name!r} (installed: {', '.join(known)}; or give "
                           f"'package.module:object')")
        what, reference = f"workload {name!r} (entry point of {known[name].source})", known[name].reference
    obj = load_object(reference, what)
    if isinstance(obj, type) and issubclass(obj, Workload):
        obj = obj()
    if not isinstance(obj, Workload):
        raise JobError(f"{what} {reference!r} is a {type(obj).__name__}, not an hpcdl.workloads.base.Workload")
    return obj


def describe() -> list[dict]:
    """Each installed workload: name, source, reference, and its `[data]` and `[model]` fields,
    or why it cannot be loaded (one line), for `hpcdl workloads`."""
    import dataclasses

    from hpcdl.errors import JobError

    rows = []
    for name, provider in providers().items():
        row = {"name": name, "source": provider.source, "reference": provider.reference}
        try:
            workload = get_workload(name)
        except JobError as exc:
            row["error"] = str(exc)
        else:
            row["data"] = [f.name for f in dataclasses.fields(workload.DataConfig)]
            row["model"] = [f.name for f in dataclasses.fields(workload.ModelConfig)]
        rows.append(row)
    return rows
