"""FLOP counting: the layer formulas by hand, and the HEP network's count and parameter count
(the planner's, without TensorFlow) against the TensorFlow model it describes."""

from __future__ import annotations

import pytest

from hpcdl.engine import flops
from hpcdl.workloads.hep.config import HepModelConfig


def test_conv_and_dense_by_hand():
    # 4×4 output, 3×3 kernel, 2 → 5 channels: 4·4·9·2·5 = 1440 multiply-adds, 2 FLOPs each
    c = flops.conv(4, 4, 3, 2, 5)
    assert (c.forward, c.backward) == (2880, 5760)
    first = flops.conv(4, 4, 3, 2, 5, needs_input_grad=False)  # no input gradient: weights only
    assert (first.forward, first.backward) == (2880, 2880)
    d = flops.dense(7, 3)
    assert (d.forward, d.backward, d.training) == (42, 84, 126)
    assert (c + d).training == c.training + d.training


def test_hep_cost_by_hand_at_32_pixels():
    cfg = HepModelConfig(filters=4, conv_layers=2, kernel=3, pool=2)
    count, params = cfg.cost((32, 32, 3))
    conv0 = 2 * 32 * 32 * 9 * 3 * 4  # no input gradient
    conv1 = 2 * 16 * 16 * 9 * 4 * 4
    dense = 2 * 4 * 2
    assert count.forward == conv0 + conv1 + dense
    assert count.backward == conv0 + 2 * conv1 + 2 * dense
    assert params == (9 * 3 * 4 + 4) + (9 * 4 * 4 + 4) + (4 * 2 + 2)


def test_hep_cost_is_the_tensorflow_models():
    pytest.importorskip("tensorflow")
    from hpcdl.workloads.hep.model import HepCNN

    cfg = HepModelConfig(filters=8, conv_layers=3)
    model = HepCNN(cfg, (24, 24, 3))
    count, params = cfg.cost((24, 24, 3))
    assert model.flops() == count
    assert sum(int(v.shape.num_elements()) for _, v in model.named_variables()) == params
