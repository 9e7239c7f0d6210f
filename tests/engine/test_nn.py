import tensorflow as tf

from hpcdl.workloads.hep.config import HepModelConfig
from hpcdl.workloads.hep.model import HepCNN


def test_hep_model_shapes():
    model = HepCNN(HepModelConfig(filters=8), (64, 64, 3))
    assert model(tf.zeros([3, 64, 64, 3])).shape == (3, 2)
    assert model(tf.zeros([1, 224, 224, 3]), training=True).shape == (1, 2)
    names = [n for n, _ in model.named_variables()]
    assert names == sorted(names) and len(names) == 12 and "head/w" in names
    assert model.named_variables()[names.index("head/w")][1].shape == (8, 2)


def test_paper_model_flops_against_hand_count():
    """64×64×3 input, 5 convs of 3×3×128, pooling 2 after the first four, dense 128→2."""
    f = HepCNN(HepModelConfig(), (64, 64, 3)).flops()
    # Forward multiply-adds × 2, layer by layer (output H·W · 3·3 · C_in · C_out · 2):
    conv0 = 64 * 64 * 9 * 3 * 128 * 2       # 28,311,552
    conv1 = 32 * 32 * 9 * 128 * 128 * 2     # 301,989,888
    conv2 = 16 * 16 * 9 * 128 * 128 * 2     # 75,497,472
    conv3 = 8 * 8 * 9 * 128 * 128 * 2       # 18,874,368
    conv4 = 4 * 4 * 9 * 128 * 128 * 2       # 4,718,592
    dense = 128 * 2 * 2
    forward = conv0 + conv1 + conv2 + conv3 + conv4 + dense
    assert forward == 429_392_384
    assert f.forward == forward
    # Backward: weight gradient (one forward's worth) everywhere, input gradient too except
    # for the first layer, whose input is data.
    assert f.backward == conv0 + 2 * (conv1 + conv2 + conv3 + conv4 + dense)
    assert f.training == f.forward + f.backward


def test_forward_flops_match_tensorflow_profiler():
    """An independent count: TensorFlow's own graph profiler on the forward pass."""
    from tensorflow.python.profiler import model_analyzer, option_builder

    model = HepCNN(HepModelConfig(filters=16, conv_layers=3), (32, 32, 3))
    fn = tf.function(lambda x: model(x)).get_concrete_function(tf.TensorSpec([1, 32, 32, 3]))
    opts = option_builder.ProfileOptionBuilder.float_operation()
    opts["output"] = "none"
    profiled = model_analyzer.profile(fn.graph, options=opts).total_float_ops
    mine = model.flops().forward
    # The profiler also counts bias adds, ReLU and pooling, which we leave out (under 1 %).
    assert mine <= profiled <= mine * 1.02


# -- the weight gradient as matmuls (tuning.conv_weight_grad = "gemm") ------------------------

import numpy as np
import pytest

from hpcdl.engine import nn


@pytest.fixture
def gemm_weight_grad():
    nn.set_conv_weight_grad("gemm")
    yield
    nn.set_conv_weight_grad("tensorflow")


@pytest.mark.parametrize("h, w, c_in, c_out, k", [(12, 9, 8, 5, 3), (7, 11, 3, 4, 5), (1, 1, 2, 3, 3)])
def test_conv_weight_grad_gemm_is_conv2d_backprop_filter(h, w, c_in, c_out, k):
    rng = np.random.default_rng(k * h)
    x = tf.constant(rng.standard_normal((2, h, w, c_in)), tf.float32)
    dy = tf.constant(rng.standard_normal((2, h, w, c_out)), tf.float32)
    ref = tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=[k, k, c_in, c_out], out_backprop=dy,
                                          strides=[1, 1, 1, 1], padding="SAME")
    got = nn.conv_weight_grad_gemm(x, dy, k)
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-4, atol=1e-4)


def _op_types(fn, spec) -> set[str]:
    graph = fn.get_concrete_function(spec).graph
    types = {op.type for op in graph.get_operations()}
    for f in graph.as_graph_def().library.function:  # the gradient's ops live in functions
        types |= {node.op for node in f.node_def}
    return types


def test_gemm_weight_grad_layer_matches_tensorflow_and_replaces_its_kernel(gemm_weight_grad):
    # the smallest layer "gemm" takes: 112² pixels, 64 input channels; batch left open
    layer = nn.Conv2D(64, 4, 3, 1, tf.random.Generator.from_seed(0), name="conv1")
    x = tf.constant(np.random.default_rng(1).standard_normal((2, 112, 112, 64)), tf.float32)

    @tf.function
    def grads(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.nn.relu(layer(x)) ** 2)
        return tape.gradient(loss, [x, layer.w, layer.b])

    spec = tf.TensorSpec([None, 112, 112, 64], tf.float32)
    assert "Conv2DBackpropFilter" not in _op_types(grads, spec)
    got = grads(x)
    nn.set_conv_weight_grad("tensorflow")
    reference = tf.function(grads.python_function)
    assert "Conv2DBackpropFilter" in _op_types(reference, spec)
    for g, r in zip(got, reference(x)):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=2e-4, atol=2e-3 * float(tf.reduce_max(tf.abs(r))))


@pytest.mark.parametrize("shape, stride", [((56, 56, 64), 1), ((112, 112, 3), 1), ((112, 112, 64), 2)])
def test_gemm_weight_grad_leaves_the_layers_where_it_was_slower(gemm_weight_grad, shape, stride):
    layer = nn.Conv2D(shape[-1], 4, 3, stride, tf.random.Generator.from_seed(0), name="c")

    @tf.function
    def grads(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(layer(x))
        return tape.gradient(loss, layer.w)

    assert "Conv2DBackpropFilter" in _op_types(grads, tf.TensorSpec([None, *shape], tf.float32))


def test_set_conv_weight_grad_refuses_other_values():
    with pytest.raises(ValueError, match="'tensorflow' or 'gemm'"):
        nn.set_conv_weight_grad("auto")


def test_hep_network_gradients_are_the_same_with_gemm_weight_grad(gemm_weight_grad):
    # at 224² the second convolution (112², 64 channels here) is a layer "gemm" takes
    model = HepCNN(HepModelConfig(filters=64), (224, 224, 3), seed=3)
    x = tf.constant(np.random.default_rng(2).random((1, 224, 224, 3)), tf.float32)
    variables = [v for _, v in model.named_variables()]

    def grads():
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x) * [1.0, -1.0])
            return tape.gradient(loss, variables)
        return step(x)

    got = grads()
    nn.set_conv_weight_grad("tensorflow")
    for (name, _), g, r in zip(model.named_variables(), got, grads()):
        scale = float(tf.reduce_max(tf.abs(r))) or 1.0
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-3, atol=1e-4 * scale, err_msg=name)


@pytest.mark.parametrize("shape", [(2, 5, 7, 3), (4, 6), (3, 2, 2, 2, 5)])
def test_add_bias_gradient_is_the_sum_over_all_but_the_last_axis(shape):
    rng = np.random.default_rng(len(shape))
    z = tf.constant(rng.standard_normal(shape), tf.float32)
    b = tf.constant(rng.standard_normal(shape[-1:]), tf.float32)
    dy = tf.constant(rng.standard_normal(shape), tf.float32)

    @tf.function
    def grads(z, b):
        with tf.GradientTape() as tape:
            tape.watch([z, b])
            y = nn.add_bias(z, b)
        return y, tape.gradient(y, [z, b], output_gradients=dy)

    y, (dz, db) = grads(z, b)
    np.testing.assert_allclose(y.numpy(), (z + b).numpy())
    np.testing.assert_allclose(dz.numpy(), dy.numpy())
    np.testing.assert_allclose(db.numpy(), dy.numpy().reshape(-1, shape[-1]).sum(0), rtol=1e-5, atol=1e-5)
