"""The user's model builder: found from its reference, called with the job's arguments.

The builder is the user's own code, imported in every rank that builds the model (and again
by `resume` and `evaluate`): a job file names code to run (docs/design/security.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from hpcdl.errors import JobError
from hpcdl.registry import load_object
from hpcdl.workloads.keras.config import is_file_reference

# Filled in by hpcdl when the builder takes it and [model.args] does not give it: the shape of
# one example of data.inputs.
PROVIDED_ARGS = ("input_shape",)


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}".rstrip(": ")


def load_builder(reference: str) -> Callable[..., Any]:
    """The function ``"path/to/file.py:function"`` or ``"package.module:function"`` names; a
    missing file, an import that fails (its error's last line) or a missing function: JobError."""
    what = f"model.builder {reference!r}"
    module_part, sep, function = reference.rpartition(":")
    if not sep or not module_part or not function:
        raise JobError(f"{what}: expected 'file.py:function' or 'package.module:function'")
    if not is_file_reference(module_part):
        builder = load_object(reference, "model.builder")
    else:
        path = Path(module_part)
        if not path.is_file():
            raise JobError(f"{what}: no such file {path}")
        # One module per file, under a name of its own: two jobs' my_model.py do not collide.
        name = "hpcdl_builder_" + hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # the user's module failed to import: say its last line
                raise JobError(f"{what}: cannot import {path}: {_last_line(exc)}") from None
            sys.modules[name] = module
        builder = getattr(module, function, None)
        if builder is None:
            raise JobError(f"{what}: {path} has no {function}")
    if not callable(builder):
        raise JobError(f"{what} is a {type(builder).__name__}, not a function")
    return builder


def call_builder(reference: str, args: dict[str, Any], input_shape: tuple[int, ...]):
    """What the builder returns for the job's `[model.args]`, plus `input_shape` when its
    signature takes it; its own exception is one line naming it."""
    builder = load_builder(reference)
    kwargs = dict(args)
    try:
        parameters = inspect.signature(builder).parameters
    except (TypeError, ValueError):
        parameters = {}
    provided = {"input_shape": tuple(input_shape)}
    for name in PROVIDED_ARGS:
        if name in parameters and name not in kwargs:
            kwargs[name] = provided[name]
    try:
        return builder(**kwargs)
    except Exception as exc:  # the user's code: its own last line, not our traceback
        raise JobError(f"model.builder {reference!r} failed: {_last_line(exc)}") from None
