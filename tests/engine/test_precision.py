"""tuning.precision = "mixed_bfloat16": Keras' policy wired into the model, and where it is refused."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from hpcdl.errors import JobError
from hpcdl.jobfile import load_job
from hpcdl.commands.doctor import bf16_label
from hpcdl.engine.optim import make_optimizer
from hpcdl.commands.submit import check_precision
from hpcdl.engine.tuning import CpuInfo, compute_dtype, parse_cpuinfo, precision_policy, read_cpuinfo
from hpcdl.workloads.hep.config import HepModelConfig
from hpcdl.workloads.hep.workload import WORKLOAD
from tests.engine.test_tuning import CPUINFO, EPYC_AVX2

SPR = parse_cpuinfo(CPUINFO)


@pytest.mark.parametrize("precision, compute", [("float32", "float32"), ("bfloat16", "float32"),
                                                ("mixed_bfloat16", "bfloat16")])
def test_policy_is_keras_mixed_precision(precision, compute):
    policy = precision_policy(precision)
    assert (policy.compute_dtype, policy.variable_dtype) == (compute, "float32")
    assert compute_dtype(precision) == compute  # the Keras-free twin submit uses


def tiny_batch(n=8, size=16):
    rng = np.random.default_rng(0)
    return (rng.random((n, size, size, 3), dtype=np.float32), (np.arange(n) % 2).astype(np.int32),
            np.ones(n, np.float32))


def test_mixed_bfloat16_model_computes_in_bfloat16_from_float32_weights():
    config = HepModelConfig(filters=8, conv_layers=2, dropout=0.0)
    mixed = WORKLOAD.build_model(config, (16, 16, 3), seed=0, compute_dtype="bfloat16")
    plain = WORKLOAD.build_model(config, (16, 16, 3), seed=0)
    variables = [v for _, v in mixed.named_variables()]
    assert all(v.dtype == tf.float32 for v in variables)  # master weights
    batch = tiny_batch()
    conv_out = mixed.convs[0](tf.cast(batch[0], tf.bfloat16))
    assert conv_out.dtype == tf.bfloat16  # the layer computes in its input's dtype
    assert mixed(batch[0]).dtype == tf.float32  # logits back in float32
    with tf.GradientTape() as tape:
        loss = WORKLOAD.loss(mixed, batch, training=True)
    assert loss.dtype == tf.float32
    grads = tape.gradient(loss, variables)
    assert all(g is not None and g.dtype == tf.float32 for g in grads)
    # same weights, same loss up to bfloat16's 8-bit mantissa
    ref = float(WORKLOAD.loss(plain, batch, training=True))
    assert float(loss) == pytest.approx(ref, rel=2e-2) and float(loss) != ref
    before = [v.numpy().copy() for v in variables]
    make_optimizer("adam", variables, 1e-2).apply(grads, variables)
    assert all(v.dtype == tf.float32 for v in variables)
    assert all(not np.array_equal(b, v.numpy()) for b, v in zip(before, variables))


def test_check_precision_at_submit():
    job = load_job("hep", ["run.backend=local", "tuning.precision=mixed_bfloat16"])
    with pytest.raises(JobError, match="^tuning.precision = mixed_bfloat16 needs native bfloat16"):
        check_precision(job, EPYC_AVX2)
    check_precision(job, SPR)  # a bfloat16 unit: accepted
    # under SLURM the compute nodes' CPU is unknown at submit: each rank checks its own
    check_precision(job.replace(run=dataclasses.replace(job.run, backend="slurm")), EPYC_AVX2)
    climate = load_job("climate", ["run.backend=local", "tuning.precision=mixed_bfloat16"])
    with pytest.raises(JobError, match="the climate workload computes in float32 only"):
        check_precision(climate, SPR)


@pytest.mark.skipif(read_cpuinfo().bf16, reason="this CPU has a bfloat16 unit: the rank would train")
def test_a_rank_refuses_mixed_bfloat16_before_tensorflow_loads(hep_files, tmp_path):
    # under SLURM submit cannot see the compute nodes' CPU: the rank is the one that refuses
    from hpcdl.process.launch import RankEnv
    from hpcdl.rundir.runs import create_run, new_run_id
    from tests.conftest import tiny_overrides

    job = load_job("hep", tiny_overrides(hep_files, tmp_path / "runs") + ["tuning.precision=mixed_bfloat16"])
    with create_run(job, "local", run_id=new_run_id(job)) as (_staged, final):
        pass
    rank = RankEnv(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1, hostname="localhost",
                   group=0)
    env = {**os.environ, **rank.to_horovod_env("127.0.0.1", 1, "")}
    out = subprocess.run([sys.executable, "-m", "hpcdl.process.worker", str(final.root)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"hpcdl rank 0: tuning.precision = mixed_bfloat16 needs native bfloat16 (AVX512_BF16 or AMX), and this "
        f"CPU ({read_cpuinfo().model}, {read_cpuinfo().vector_isa}) has neither: use float32"]


def test_doctor_names_the_bfloat16_unit():
    assert bf16_label(SPR) == "AMX (avx512_bf16, amx_bf16)"
    assert bf16_label(CpuInfo("zen4", frozenset({"avx512f", "avx512_bf16"}))) == "AVX512_BF16 (avx512_bf16)"
    assert bf16_label(EPYC_AVX2).startswith("none (no avx512_bf16 / amx_bf16 in /proc/cpuinfo")


@pytest.mark.slow
@pytest.mark.skipif(not read_cpuinfo().bf16, reason="no bfloat16 unit (AVX512_BF16/AMX) on this CPU: "
                    "mixed_bfloat16 is refused here, so its accuracy cannot be measured")
def test_mixed_bfloat16_auc_within_0005_of_float32(hep_files):
    from bench.precision_parity import TOLERANCE, parity

    result = parity({"train": hep_files["train"], "val": hep_files["test"], "test": hep_files["test"]},
                    steps=200, filters=16, batch=32)
    assert abs(result["auc_difference"]) <= TOLERANCE, result
