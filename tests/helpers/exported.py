"""Predictions of an exported model, computed in a fresh Python where hpcdl cannot be imported:
what a user who takes the model home has."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

SCRIPT = r'''
import sys
sys.modules["hpcdl"] = None  # any import of hpcdl fails: the export must stand alone
import numpy as np
model_path, inputs, out = sys.argv[1:4]
x = np.load(inputs)["x"]
if model_path.endswith(".keras"):
    import keras
    predictions = keras.models.load_model(model_path).predict(x, verbose=0)
else:
    import tensorflow as tf
    loaded = tf.saved_model.load(model_path)  # kept: its variables live as long as it does
    predictions = loaded.serve(tf.constant(x)).numpy()
np.savez(out, predictions=predictions)
'''


def predict_without_hpcdl(model: Path, x: np.ndarray, tmp: Path) -> np.ndarray:
    np.savez(tmp / "inputs.npz", x=x.astype(np.float32))
    subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(tmp / "inputs.npz"), str(tmp / "out.npz")],
                   check=True, capture_output=True, text=True, cwd=tmp)
    return np.load(tmp / "out.npz")["predictions"]
