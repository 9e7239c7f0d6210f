"""A trained model taken home: one directory or file that loads without hpcdl.

What is exported is what `hpcdl evaluate` scores (the run's newest master weights when it had an
exchange, else group 0's newest checkpoint, or the checkpoint given), with the workload's input
normalisation inside, so the loaded model takes examples as they are stored and returns the
predictions `evaluate` scores (the workload's `serving`):

* a TensorFlow SavedModel directory, for every workload: ``model = tf.saved_model.load(OUT)``,
  then ``model.serve(x)`` (keep ``model``: its variables live as long as it does);
* Keras' own ``.keras`` file, for keras jobs, when OUT ends in ``.keras``:
  ``keras.models.load_model(OUT)`` (a builder's custom layers must be importable and registered
  with ``keras.saving.register_keras_serializable`` where it is loaded).

The export is written beside OUT under a temporary name and renamed into place when complete:
an export that fails leaves nothing behind, and OUT is never overwritten.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hpcdl.commands.evaluate import EvaluateError, load_trained


def export(path: Path, out: Path, master: bool = True) -> dict[str, Any]:
    """Export the model at `path` (a run, checkpoint directory or prefix) to `out`."""
    from hpcdl.workloads import get_workload

    out = Path(out)
    if os.path.lexists(out):
        raise EvaluateError(f"{out} exists: export writes a new path, never over an old one")
    if not out.parent.is_dir():
        raise EvaluateError(f"{out.parent} is not a directory")
    keras_file = out.suffix == ".keras"
    trained = load_trained(path, master)
    workload = get_workload(trained.manifest["workload"])
    stats = trained.manifest["stats"]
    if keras_file and not hasattr(workload, "keras_model"):
        raise EvaluateError(f"{out}: a .keras file is written for keras jobs; the {workload.name} workload "
                            "exports a SavedModel (a path without .keras)")
    serve = workload.serving(trained.model, stats)
    if serve is None and not keras_file:
        raise EvaluateError(f"the {workload.name} workload does not say how to export its model (Workload.serving)")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if keras_file:
            written = _keras_file(workload.keras_model(trained.model, stats), staging / out.name)
        else:
            written = _saved_model(trained.model, serve, trained.manifest["input_shape"], staging / out.name)
        os.replace(written, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"model": trained.source, "out": str(out), "format": "keras" if keras_file else "saved_model",
            "input_shape": [None, *trained.manifest["input_shape"]], "workload": workload.name}


def _saved_model(model, serve, input_shape, target: Path) -> Path:
    import tensorflow as tf

    module = tf.Module()
    module.model = model  # tracks the variables the traced function reads
    module.serve = tf.function(serve, input_signature=[tf.TensorSpec([None, *input_shape], tf.float32, name="x")])
    tf.saved_model.save(module, str(target), signatures={"serving_default": module.serve})
    return target


def _keras_file(model, target: Path) -> Path:
    try:
        model.save(str(target))
    except (TypeError, ValueError, NotImplementedError) as exc:  # e.g. a subclassed model without get_config
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise EvaluateError(f"Keras cannot save this model as a .keras file ({first}); export a SavedModel "
                            "(a path without .keras) instead") from None
    return target
