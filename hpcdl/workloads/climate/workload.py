"""Climate: semi-supervised detection of extreme weather in 16-channel climate-model fields.

Data: ExtremeWeather HDF5 files (images, boxes, optional labelled flags), read one image at a time,
optionally cropped and downsampled, normalised per channel; see `data` (and `generate` for the
synthetic set). Model: a strided convolutional encoder shared by a YOLO-style detection head and
a reconstructing decoder; see `model`. Metric: mean average precision at IoU 0.5 and 0.1 with
per-class AP, after non-maximum suppression; see `metrics`.

Evaluation scores the labelled images of the file (unlabelled ones are skipped and counted),
writes `climate_<image>.png` for the first PLOTS of them (TMQ with true and predicted boxes), and,
given `scores_out` (.npz or .csv), the detections of every scored image after NMS (see
`metrics.write_detections`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from hpcdl.errors import JobError
from hpcdl.workloads.base import GeneratorOption, Workload
from hpcdl.workloads.common import traced_forward
from hpcdl.workloads.climate import data as cdata
from hpcdl.workloads.climate.boxes import decode_grid
from hpcdl.workloads.climate.config import ClimateDataConfig, ClimateModelConfig

PLOTS = 4
EVAL_BATCH = 16
NARROWEST_FILTERS = 4  # of a layer, in the narrowest copy plan races in the job's stead


class ClimateWorkload(Workload):
    name = "climate"
    DataConfig = ClimateDataConfig
    ModelConfig = ClimateModelConfig
    generator_module = "hpcdl.workloads.climate.generate"
    generate_count = GeneratorOption("images", "images in total", low=10)
    generate_options = (
        GeneratorOption("height", "grid rows (latitude; the real set: 768)", default=96, low=16),
        GeneratorOption("width", "grid columns (longitude; the real set: 1152)", default=144, low=16),
        GeneratorOption("labelled_fraction", "share of training images that keep their boxes (val and test are "
                        "fully labelled)", default=0.2, low=0.0, high=1.0, kind=float),
    )

    def check_data(self, job) -> None:
        prep = cdata.Preprocess.from_config(job.data)
        try:
            cf = cdata.open_climate(job.data.train)
            prep.output_hw(cf.height, cf.width, cf.path)
        except cdata.DataError as exc:
            raise JobError(f"data.train: {exc}") from None
        ranks = job.run.nodes * job.run.ranks_per_node
        if cf.n_labelled < ranks:
            raise JobError(f"data.train has {cf.n_labelled} labelled images, fewer than one per rank ({ranks})")
        if job.model.reconstruction_weight > 0 and cf.n_images < ranks:
            raise JobError(f"data.train has {cf.n_images} images, fewer than one per rank ({ranks})")
        if job.train.validate_every and job.data.val:
            try:
                val = cdata.open_climate(job.data.val)
                val_hw = prep.output_hw(val.height, val.width, val.path)
            except cdata.DataError as exc:
                raise JobError(f"data.val: {exc} (train.validate_every = 0 trains without it)") from None
            train_hw = prep.output_hw(cf.height, cf.width, cf.path)
            if val_hw != train_hw:
                raise JobError(f"data.val: its images give {val_hw}, data.train's {train_hw}")

    def finite_datasets(self, data_config) -> list[str]:
        return ["images", "boxes"]

    def compute_stats(self, job) -> dict[str, Any]:
        prep = cdata.Preprocess.from_config(job.data)
        return cdata.compute_stats(job.data.train, prep, job.data.stats_images).to_dict()

    def input_shape(self, job) -> tuple[int, int, int]:
        cf = cdata.open_climate(job.data.train)
        h, w = cdata.Preprocess.from_config(job.data).output_hw(cf.height, cf.width, cf.path)
        return h, w, len(cdata.CHANNELS)

    def build_model(self, model_config, input_shape, seed: int, compute_dtype: str = "float32"):
        from hpcdl.workloads.climate.model import ClimateNet

        if compute_dtype not in self.compute_dtypes:  # submit refuses first (hpcdl.commands.submit)
            raise ValueError(f"the climate network computes in float32 only, not {compute_dtype}")
        return ClimateNet(model_config, tuple(input_shape), seed=seed)

    def train_batches(self, job, stats, shard: int, shards: int, seed: int) -> Iterator[tuple]:
        return cdata.iter_train_batches(
            job.data.train, job.train.batch_per_rank, cdata.Stats.from_dict(stats), 2 ** len(job.model.filters),
            shard=shard, shards=shards, seed=seed, labelled_share=job.data.labelled_share,
            labelled_only=job.model.reconstruction_weight == 0, prefetch=job.data.prefetch,
        )

    def example_batch(self, job, model, size: int, seed: int) -> tuple:
        x = np.random.default_rng(seed).standard_normal((size, *model.image_shape)).astype(np.float32)
        target = np.zeros((size, *model.grid, 6), np.float32)  # labelled images without a box
        return x, target, np.ones(size, np.float32)

    def narrower_model(self, model_config: ClimateModelConfig) -> tuple[ClimateModelConfig, str] | None:
        halves = tuple(f // 2 for f in model_config.filters)
        if min(halves) < NARROWEST_FILTERS:
            return None
        return dataclasses.replace(model_config, filters=halves), f"model.filters={list(halves)}"

    def loss(self, model, batch, training: bool):
        x, target, labelled = batch
        return model.loss(x, target, labelled)

    def detect(self, model, stats, data: Path, progress=None, limit: int | None = None):
        """Detections (after NMS) and true boxes of every labelled image of `data` (the first
        `limit`), in file order.

        Returns (indices, detections [(k, 6)], truths [(t, 5)], first images' raw TMQ fields)."""
        import tensorflow as tf

        from hpcdl.workloads.climate.metrics import nms

        st = cdata.Stats.from_dict(stats)
        cf = cdata.open_climate(data)
        found = (*st.prep.output_hw(cf.height, cf.width, cf.path), len(cdata.CHANNELS))
        if found != tuple(model.image_shape):
            raise cdata.DataError(f"{data}: images are {found} after preprocessing "
                                  f"{st.prep.to_dict()}, the model was trained on {tuple(model.image_shape)}")
        if cf.n_labelled == 0:
            raise cdata.DataError(f"{data}: holds no labelled image to score")
        predict = traced_forward(model, "grid", lambda m, x: m(x))
        cfg = model.config
        h, w, _ = model.image_shape
        indices, dets, truths, fields = [], [], [], []
        for idx, x, boxes in cdata.iter_eval(cf, st, EVAL_BATCH):
            out = predict(tf.constant(x)).numpy()
            for k, i in enumerate(idx):
                cand = decode_grid(out[k], model.cell, cfg.score_threshold, (h, w))
                dets.append(nms(cand, cfg.nms_iou, cfg.max_detections))
                truths.append(boxes[k])
                indices.append(int(i))
                if len(fields) < PLOTS:
                    fields.append(st.denormalize(x[k])[..., cdata.TMQ])
            if progress:
                progress(len(idx))
            if limit is not None and len(indices) >= limit:
                break
        return indices[:limit], dets[:limit], truths[:limit], fields

    def serving(self, model, stats):
        import tensorflow as tf

        mean, std = (tf.constant(a) for a in cdata.Stats.from_dict(stats).arrays())

        def head(images):  # (n, h, w, 16) after the crop and downsampling, channels last
            return model((images - mean) / std)  # the raw grid: decoding and NMS stay the user's

        return head

    def validate(self, model, stats, data: Path, limit: int) -> dict[str, float]:
        """mAP at IoU 0.5 on the first `limit` labelled images."""
        from hpcdl.workloads.climate import metrics

        _, dets, truths, _ = self.detect(model, stats, Path(data), limit=limit)
        m = metrics.detection_metrics(dets, truths, thresholds=(0.5,)).get("map_50")
        return {} if m is None else {"map50": m}

    def examples(self, data: Path, stats: dict[str, Any] | None = None) -> int | None:
        return cdata.open_climate(data).n_labelled  # detect scores the labelled images

    def evaluate(self, model, stats, data: Path, out_dir: Path, scores_out: Path | None = None,
                 progress=None) -> dict[str, Any]:
        from hpcdl.workloads.climate import metrics

        data = Path(data)
        cf = cdata.open_climate(data)
        indices, dets, truths, fields = self.detect(model, stats, data, progress=progress)
        result = metrics.detection_metrics(dets, truths, thresholds=(0.5, 0.1))
        result["n_unlabelled_skipped"] = cf.n_images - cf.n_labelled
        pngs = []
        for i, field, det, truth in zip(indices, fields, dets, truths):
            png = Path(out_dir) / f"climate_{i:05d}.png"
            metrics.plot_detections(png, field, truth, det,
                                    title=f"{data.name} image {i}: TMQ, true boxes (solid), predicted (dashed)")
            pngs.append(str(png))
        result["pngs"] = pngs
        if scores_out is not None:
            metrics.write_detections(scores_out, indices, dets)
            result["detections_file"] = str(scores_out)
        return result


WORKLOAD = ClimateWorkload()
