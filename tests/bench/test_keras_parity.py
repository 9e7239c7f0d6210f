"""The bench's Keras builder is the built-in HEP network: the same layers, shapes and parameters."""

import numpy as np

from bench.keras_parity import models
from hpcdl.workloads.hep.config import HepModelConfig


def test_the_keras_builder_is_the_hep_network():
    (_, hep, _), (_, keras_model, _) = models(filters=8, shape=(16, 16, 3), seed=0)
    shapes = sorted(tuple(v.shape) for _, v in hep.named_variables())
    assert sorted(tuple(v.shape) for _, v in keras_model.named_variables()) == shapes
    params = sum(int(np.prod(s)) for s in shapes)
    assert params == HepModelConfig(filters=8).cost((16, 16, 3))[1]
    x = np.zeros((2, 16, 16, 3), np.float32)
    assert keras_model(x).shape == hep(x).shape == (2, 2)
