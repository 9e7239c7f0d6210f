"""The Workload glue in-process: job → stats → model → batches → loss → evaluate, with a crop and
downsampling, on a hand-written ExtremeWeather file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

from hpcdl.errors import JobError
from hpcdl.jobfile import load_job
from hpcdl.workloads import get_workload
from hpcdl.workloads.climate.data import DataError
from tests.workloads.climate import write_ew


@pytest.fixture
def files(tmp_path):
    boxes = [[[4, 4, 12, 14, i % 4]] if i % 2 == 0 else [] for i in range(12)]
    labelled = [i % 2 == 0 or i == 1 for i in range(12)]
    train = write_ew(tmp_path / "train.h5", boxes, h=20, w=30, labelled=labelled, seed=1)
    test = write_ew(tmp_path / "test.h5", boxes[:6], h=20, w=30, seed=2)
    return train, test


def _job(files, *extra):
    train, test = files
    return load_job("climate", [f'data.train="{train}"', f'data.test="{test}"', f'data.val="{test}"', "data.crop=[2, 2, 16, 24]",
                                "data.downsample=2", "model.filters=[4, 8]", "model.grid_convs=1",
                                "train.batch_per_rank=4", "data.prefetch=0", *extra])


def test_job_to_evaluation(files, tmp_path):
    wl = get_workload("climate")
    job = _job(files)
    wl.check_data(job)
    stats = json.loads(json.dumps(wl.compute_stats(job)))  # as stored in the manifest
    assert stats["crop"] == [2, 2, 16, 24] and stats["downsample"] == 2 and stats["images"] == 12
    shape = wl.input_shape(job)
    assert shape == (8, 12, 16)
    model = wl.build_model(job.model, shape, seed=0)
    batch = next(wl.train_batches(job, stats, shard=1, shards=2, seed=0))
    x, target, labelled = batch
    assert x.shape == (4, 8, 12, 16) and target.shape == (4, 2, 3, 6) and labelled.sum() == 2
    loss = wl.loss(model, tuple(tf.constant(b) for b in batch), training=True)
    assert np.isfinite(float(loss))
    scores = tmp_path / "det.npz"
    result = wl.evaluate(model, stats, files[1], tmp_path, scores_out=scores)
    assert result["n_images"] == 3 and result["n_unlabelled_skipped"] == 3
    assert set(result) >= {"map_50", "map_10", "ap50_TD", "ap10_AR", "pngs", "detections_file"}
    assert len(result["pngs"]) == 3 and scores.is_file()
    json.dumps(result)  # JSON-able


def test_supervised_only_reads_labelled_images_only(files):
    wl = get_workload("climate")
    job = _job(files, "model.reconstruction_weight=0")
    stats = wl.compute_stats(job)
    for _, batch in zip(range(3), wl.train_batches(job, stats, 0, 1, seed=0)):
        assert (batch[2] == 1).all()


def test_check_data_and_shape_mismatch(files, tmp_path):
    wl = get_workload("climate")
    with pytest.raises(JobError, match="data.train: .*does not fit"):
        wl.check_data(_job(files, "data.crop=[10, 10, 16, 24]"))
    with pytest.raises(JobError, match="fewer than one per rank"):
        wl.check_data(_job(files, "run.nodes=8"))
    job = _job(files)
    stats = wl.compute_stats(job)
    model = wl.build_model(job.model, (10, 15, 16), seed=0)
    with pytest.raises(DataError, match="the model was trained on"):
        wl.evaluate(model, stats, files[1], tmp_path)
