"""Named implementations, loaded only when used.

A registry maps a name to a ``"module:attribute"`` reference, so that the names a job field may
take are known (to its validation, to the CLI's choices) without importing what implements them
-- TensorFlow, Horovod, a cluster's client. A leaf: it imports nothing of hpcdl but the error.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

from hpcdl.errors import JobError


def load_object(reference: str, what: str) -> Any:
    """The object a ``"package.module:attribute"`` reference names; a reference that does not
    resolve is a JobError of one line (the import error's own last line)."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise JobError(f"{what} {reference!r}: expected 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure of a module's own import code: say its last line
        raise JobError(f"{what} {reference!r}: cannot import {module_name}: "
                       f"{type(exc).__name__}: {str(exc).splitlines()[-1] if str(exc) else ''}") from None
    try:
        obj = module
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise JobError(f"{what} {reference!r}: {module_name} has no {attribute}") from None
    return obj


def load_registered(registry: Mapping[str, str], name: str, what: str) -> Any:
    """The implementation registered under ``name``; an unknown name lists the known ones."""
    if name not in registry:
        raise JobError(f"{what} must be one of {', '.join(registry)}, got {name!r}")
    return load_object(registry[name], what)
