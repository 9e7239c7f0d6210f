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
