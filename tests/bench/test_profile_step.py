"""bench.profile_step's parsing: op names as TensorFlow's profiler records them, oneDNN's verbose lines."""

from __future__ import annotations

import pytest

from bench.profile_step import classify, parse_onednn_verbose


@pytest.mark.parametrize("name, op_type, expected", [
    ("conv1_relu", "_MklNativeFusedConv2D", ("conv forward", "conv1")),  # grappler's fused conv+bias+ReLU
    ("conv0/Conv2D", "Conv2D", ("conv forward", "conv0")),
    ("gradient_tape/conv3/Conv2DBackpropInput", "_MklNativeConv2DBackpropInput", ("conv backward input", "conv3")),
    ("gradient_tape/conv12/Conv2DBackpropFilter", "_MklNativeConv2DBackpropFilter", ("conv backward filter", "conv12")),
    ("gradient_tape/conv1/add/Sum", "Sum", ("ReLU and bias", "")),
    ("gradient_tape/conv1_relu/ReluGrad", "ReluGrad", ("ReLU and bias", "")),
    ("MaxPool_2", "_MklNativeMaxPool", ("pooling", "")),
    # tuning.conv_weight_grad = "gemm": the layer's custom gradient names its ops
    ("conv1_gemm_weight_grad/MatMul_4", "_MklMatMul", ("conv backward filter", "conv1")),
    ("conv1_gemm_weight_grad/Pad_1", "Pad", ("conv backward filter", "conv1")),
    ("conv1_input_grad", "_MklNativeConv2DBackpropInput", ("conv backward input", "conv1")),
    ("bias_grad/MatMul", "_MklMatMul", ("ReLU and bias", "")),
    ("dropout_2/random_uniform/RandomUniform", "RandomUniform", ("dropout random numbers", "")),
    ("gradient_tape/dropout/SelectV2", "SelectV2", ("dropout mask", "")),
    ("adam/mul_3", "Mul", ("Adam update", "")),
    ("DistributedGradientTape_Allreduce/cond/HorovodAllreduce_grads_0", "HorovodAllreduce", ("Horovod", "")),
    ("head/MatMul", "_MklMatMul", ("loss and head", "")),
])
def test_ops_are_classified_by_name_and_type(name, op_type, expected):
    assert classify(name, op_type) == expected


VERBOSE = """onednn_verbose,info,cpu,isa:Intel AVX2
onednn_verbose,primitive,exec,cpu,reorder,jit:uni,undef,src_f32::blocked:cdba::f0 dst_f32::blocked:Acdb16a::f0,,,128x3x3x3,0.04
onednn_verbose,primitive,exec,cpu,convolution,brgconv:avx2,forward_training,src_f32::blocked:acdb::f0,attr-post-ops:eltwise_relu ,alg:convolution_direct,mb4_ic3oc128,12.5
onednn_verbose,primitive,exec,cpu,convolution,jit:avx2,backward_weights,src_f32::blocked:acdb::f0,,alg:convolution_direct,mb4_ic128oc128,220.0
onednn_verbose,primitive,exec,cpu,convolution,jit:avx2,backward_weights,src_f32::blocked:acdb::f0,,alg:convolution_direct,mb4_ic128oc128,30.0
onednn_verbose,primitive,create:cache_hit,cpu,reorder,jit:uni,undef,src_f32,,,128x3x3x3,0.01
hpcdl rank 0: something else on stdout
"""


def test_onednn_verbose_is_summed_per_kind():
    kinds = parse_onednn_verbose(VERBOSE)
    assert kinds == {"reorder": {"ms": 0.04, "calls": 1}, "convolution/forward_training": {"ms": 12.5, "calls": 1},
                     "convolution/backward_weights": {"ms": 250.0, "calls": 2}}
