"""The HEP network's cost counted without TensorFlow (what the planner plans), against the model
TensorFlow builds, and the example batch `hpcdl plan` times a step on."""

import numpy as np
import pytest

from hpcdl.workloads.hep.config import HepModelConfig


def test_the_network_counted_by_hand_at_224():
    flops, params = HepModelConfig().cost((224, 224, 3))
    conv = [224 * 224 * 9 * 3 * 128 * 2, 112 * 112 * 9 * 128 * 128 * 2,
            56 * 56 * 9 * 128 * 128 * 2, 28 * 28 * 9 * 128 * 128 * 2, 14 * 14 * 9 * 128 * 128 * 2]
    dense = 128 * 2 * 2
    assert flops.forward == sum(conv) + dense == 5_260_050_944
    assert flops.backward == conv[0] + 2 * (sum(conv[1:]) + dense)
    assert flops.training == 15_433_336_320
    # 3·3·3·128 + 128, then 4 × (3·3·128·128 + 128), then 128·2 + 2
    assert params == 3584 + 4 * 147_584 + 258 == 594_178


def test_the_count_matches_the_tensorflow_model():
    pytest.importorskip("tensorflow")
    from hpcdl.workloads.hep.model import HepCNN

    cfg = HepModelConfig(filters=16)
    model = HepCNN(cfg, (64, 64, 3))
    flops, params = cfg.cost((64, 64, 3))
    assert flops == model.flops()
    assert params == sum(int(np.prod(v.shape)) for _, v in model.named_variables())


def test_a_validation_subset_is_decoded_once_and_read_again_when_its_file_changes(hep_files, monkeypatch):
    """plan --target scores a race 40 times and a run every validate_every steps on the same
    first events; a changed file is read anew."""
    import os
    import shutil

    pytest.importorskip("tensorflow")
    from hpcdl.workloads.hep import data as hepdata
    from hpcdl.workloads.hep.config import HepModelConfig as Cfg
    from hpcdl.workloads.hep.model import HepCNN
    from hpcdl.workloads.hep.normalization import Normalization
    from hpcdl.workloads.hep.workload import HepWorkload

    val = hep_files["test"].parent / "decoded-val.h5"
    shutil.copy(hep_files["test"], val)
    reads = []
    real = hepdata.iter_batches
    monkeypatch.setattr(hepdata, "iter_batches", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    workload, stats = HepWorkload(), Normalization.from_file(hep_files["train"]).to_dict()
    model = HepCNN(Cfg(filters=8, conv_layers=2), hepdata.open_hep(val).image_shape)
    first = workload.validate(model, stats, val, 256)
    assert workload.validate(model, stats, val, 256) == first and len(reads) == 1
    os.utime(val, ns=(os.stat(val).st_atime_ns, os.stat(val).st_mtime_ns + 10**9))
    assert workload.validate(model, stats, val, 256) == first and len(reads) == 2
    workload.validate(model, stats, val, 128)  # another subset
    assert len(reads) == 3
