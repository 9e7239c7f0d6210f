"""The climate model: shapes, FLOP count by hand, the loss, and the job sections."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

from hpcdl.errors import JobError
from hpcdl.jobfile import load_job
from hpcdl.workloads.climate.config import ClimateModelConfig
from hpcdl.workloads.climate.boxes import encode_boxes
from hpcdl.workloads.climate.model import ClimateNet, detection_loss

SMALL = ClimateModelConfig(filters=(4, 8), kernel=3, grid_convs=1)


def test_shapes():
    net = ClimateNet(SMALL, (20, 28, 16), seed=1)
    assert net.cell == 4 and net.grid == (5, 7)
    x = tf.random.normal((2, 20, 28, 16))
    out, recon = net(x, reconstruct=True)
    assert out.shape == (2, 5, 7, 9)  # objectness, ty, tx, th, tw, 4 classes
    assert recon.shape == (2, 20, 28, 16)  # decoded to 20×28 (from 24×28 before the crop)
    assert net(x).shape == (2, 5, 7, 9)
    # the objectness prior: P(object) = 1 % at the start
    assert float(tf.reduce_mean(tf.sigmoid(net(tf.zeros((1, 20, 28, 16)))[..., 0]))) == pytest.approx(0.01, rel=1e-3)
    with pytest.raises(ValueError, match="16 channels"):
        ClimateNet(SMALL, (20, 28, 3))


def test_flops_by_hand():
    net = ClimateNet(SMALL, (16, 24, 16))
    # forward multiply-adds × 2, per layer (output size × k² × c_in × c_out; transposed: input size)
    enc0 = 2 * (8 * 12) * 9 * 16 * 4  # stride 2: 16×24 → 8×12
    enc1 = 2 * (4 * 6) * 9 * 4 * 8  # → 4×6
    grid0 = 2 * (4 * 6) * 9 * 8 * 8
    head = 2 * (4 * 6) * 1 * 8 * 9
    dec0 = 2 * (4 * 6) * 9 * 8 * 4  # 4×6 → 8×12
    dec1 = 2 * (8 * 12) * 9 * 4 * 16  # 8×12 → 16×24
    assert (enc0, enc1, grid0, head, dec0, dec1) == (110592, 13824, 27648, 3456, 13824, 110592)
    f = net.flops()
    assert f.forward == enc0 + enc1 + grid0 + head + dec0 + dec1 == 279936
    # backward: weight + input gradient (2× forward), but the first layer needs no input gradient
    assert f.backward == enc0 + 2 * (enc1 + grid0 + head + dec0 + dec1) == 449280
    # supervised only: the decoder is not run, so not counted
    sup = ClimateNet(ClimateModelConfig(filters=(4, 8), grid_convs=1, reconstruction_weight=0.0), (16, 24, 16))
    assert sup.flops().forward == enc0 + enc1 + grid0 + head
    assert sup.flops().backward == enc0 + 2 * (enc1 + grid0 + head)


@pytest.mark.parametrize("config, shape", [(SMALL, (16, 24, 16)), (SMALL, (21, 30, 16)),
                                           (ClimateModelConfig(reconstruction_weight=0.0), (33, 47, 16))])
def test_the_configs_count_is_the_built_networks(config, shape):
    _, params = config.cost(shape)  # what submit and the planner use, without TensorFlow
    net = ClimateNet(config, shape)
    assert params == sum(int(v.shape.num_elements()) for _, v in net.named_variables())


def test_named_variables_are_stable():
    names = [n for n, _ in ClimateNet(SMALL, (16, 24, 16)).named_variables()]
    assert names == sorted(names) and len(names) == len(set(names)) == 2 * (2 + 1 + 1 + 2)
    assert {"encoder0/w", "grid_convs0/b", "head/w", "decoder1/w"} <= set(names)
    assert names == [n for n, _ in ClimateNet(SMALL, (16, 24, 16), seed=3).named_variables()]


def _sigmoid(v):
    return 1 / (1 + math.exp(-v))


def _softplus(v):
    return math.log1p(math.exp(v))


def test_detection_loss_by_hand():
    target = encode_boxes(np.array([[0, 0, 4, 6, 2]], np.float32), (1, 2), 4)[None]  # one ETC, cell (0, 0)
    np.testing.assert_allclose(target[0, 0, 0], [1, 0.5, 0.75, 0, math.log(1.5), 2], rtol=1e-6)
    out = np.zeros((1, 1, 2, 9), np.float32)
    out[0, 0, 0] = [2.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0]
    out[0, 0, 1] = [-1.0, 0, 0, 0, 0, 0, 0, 0, 0]
    coord = (0.5 - 0.5) ** 2 + (_sigmoid(1.0) - 0.75) ** 2 + 0.5**2 + math.log(1.5) ** 2
    bce_obj = _softplus(-2.0)  # −log σ(2)
    cls = -(1.0 - math.log(3 + math.e))  # softmax CE for logits (0, 0, 1, 0), class 2
    bce_noobj = _softplus(-1.0)  # −log(1 − σ(−1))
    expected = 5 * coord + bce_obj + cls + 0.5 * bce_noobj
    got = detection_loss(tf.constant(out), tf.constant(target), tf.constant([1.0]))
    assert float(got) == pytest.approx(expected, rel=1e-5)
    # an unlabelled image contributes nothing; mean over labelled images
    two = detection_loss(tf.constant(np.concatenate([out, out])), tf.constant(np.concatenate([target, target])),
                         tf.constant([1.0, 0.0]))
    assert float(two) == pytest.approx(expected, rel=1e-5)
    assert float(detection_loss(tf.constant(out), tf.constant(target), tf.constant([0.0]))) == 0.0


@pytest.mark.parametrize("weight", [0.0, 0.7])
def test_loss_and_gradients(weight):
    cfg = ClimateModelConfig(filters=(4, 8), grid_convs=1, reconstruction_weight=weight)
    net = ClimateNet(cfg, (16, 24, 16))
    x = tf.random.stateless_normal((3, 16, 24, 16), seed=(1, 2))
    target = np.stack([encode_boxes(np.array([[2, 2, 9, 12, 1]], np.float32), net.grid, net.cell)] * 3)
    labelled = tf.constant([1.0, 0.0, 0.0])
    variables = [v for _, v in net.named_variables()]
    with tf.GradientTape() as tape:
        loss = net.loss(x, tf.constant(target), labelled)
    grads = tape.gradient(loss, variables)
    assert np.isfinite(float(loss))
    assert all(g is not None for g in grads)  # the engine allreduces every variable's gradient
    out, recon = net(x, reconstruct=True)
    det = detection_loss(out, tf.constant(target), labelled)
    rec = tf.reduce_mean(tf.square(recon - x))
    assert float(loss) == pytest.approx(float(det) + weight * float(rec), rel=1e-5)
    dec = {n: g for (n, _), g in zip(net.named_variables(), grads) if n.startswith("decoder")}
    assert all((float(tf.reduce_max(tf.abs(g))) == 0.0) == (weight == 0) for g in dec.values())


def test_job_sections():
    job = load_job("climate")
    assert job.workload == "climate" and job.model.filters == (32, 64, 128) and job.data.crop == ()
    job = load_job("climate", ["data.crop=[0, 0, 48, 72]", "data.downsample=2", "model.filters=[8, 16]",
                               "model.reconstruction_weight=0"])
    assert job.data.crop == (0, 0, 48, 72) and job.model.filters == (8, 16)
    for bad, message in [("data.crop=[1, 2]", "data.crop"), ("data.downsample=0", "data.downsample"),
                         ("data.labelled_share=1.5", "labelled_share"), ("model.filters=[]", "model.filters"),
                         ("model.reconstruction_weight=-1", "reconstruction_weight"),
                         ("model.nms_iou=0", "nms_iou"), ("data.plots=3", "unknown field data.plots")]:
        with pytest.raises(JobError, match=message):
            load_job("climate", [bad])
