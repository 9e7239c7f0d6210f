"""HEP: signal (RPV SUSY) vs background (QCD) from 3-channel calorimeter images.

Data: NERSC RPV-SUSY HDF5 files (or the hep_cnn_benchmark layout), see `data`. Model: the paper's
5-conv CNN, see `model`. Metric: ROC AUC and the true-positive rate at the false-positive rate of
the physics cut-based selection (passSR), see `metrics`.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from hpcdl.errors import JobError
from hpcdl.workloads.base import GeneratorOption, Workload
from hpcdl.workloads.common import traced_forward
from hpcdl.workloads.hep import data as hepdata
from hpcdl.workloads.hep.config import HepDataConfig, HepModelConfig
from hpcdl.workloads.hep.normalization import Normalization

NARROWEST_FILTERS = 8  # the narrowest copy plan races in the job's stead


class HepWorkload(Workload):
    name = "hep"
    DataConfig = HepDataConfig
    ModelConfig = HepModelConfig
    compute_dtypes = ("float32", "bfloat16")
    default_input_shape = (224, 224, 3)  # the paper's images
    generator_module = "hpcdl.workloads.hep.generate"
    generate_count = GeneratorOption("events", "events in total", low=10)
    generate_options = (GeneratorOption("image_size", "calorimeter image side (the paper: 64 or 224)",
                                        default=64, low=8, high=512),)

    def check_data(self, job) -> None:
        try:
            hep = hepdata.open_hep(job.data.train)
        except hepdata.DataError as exc:
            raise JobError(f"data.train: {exc}") from None
        if hep.n_events < job.train.batch_per_rank * job.run.nodes * job.run.ranks_per_node:
            raise JobError(
                f"data.train has {hep.n_events} events, fewer than one batch per rank "
                f"({job.train.batch_per_rank} × {job.run.nodes * job.run.ranks_per_node} ranks)"
            )
        if job.train.validate_every and job.data.val:
            try:
                val = hepdata.open_hep(job.data.val)
            except hepdata.DataError as exc:
                raise JobError(f"data.val: {exc} (train.validate_every = 0 trains without it)") from None
            if tuple(val.image_shape) != tuple(hep.image_shape):
                raise JobError(f"data.val: images are {tuple(val.image_shape)}, data.train's "
                               f"{tuple(hep.image_shape)}")

    def finite_datasets(self, data_config) -> list[str]:
        """What the reader reads, in either layout (a file's truth-level extras may hold Inf)."""
        from hpcdl.workloads.hep.layout import CHANNELS, NERSC_GROUP

        nersc = [f"{NERSC_GROUP}/{name}" for name in (*CHANNELS, "y", "weight")]
        return nersc + ["data", "label", "weight", "normweight"]

    def compute_stats(self, job) -> dict[str, Any]:
        return Normalization.from_file(job.data.train, chunk=job.data.chunk_events).to_dict()

    def input_shape(self, job) -> tuple[int, int, int]:
        return tuple(hepdata.open_hep(job.data.train).image_shape)

    def build_model(self, model_config, input_shape, seed: int, compute_dtype: str = "float32"):
        from hpcdl.workloads.hep.model import HepCNN

        return HepCNN(model_config, tuple(input_shape), seed=seed, compute_dtype=compute_dtype)

    def train_batches(self, job, stats, shard: int, shards: int, seed: int) -> Iterator[tuple]:
        norm = Normalization.from_dict(stats)
        batches = hepdata.iter_batches(
            job.data.train, job.train.batch_per_rank, rank=shard, size=shards, norm=norm,
            shuffle=True, seed=seed, chunk_events=job.data.chunk_events, prefetch=job.data.prefetch,
        )
        with batches:  # closing this generator stops the prefetch thread and waits for it
            for x, y, w, _pass, _index in batches:
                yield x, y, norm.event_weights(y, w)

    def example_batch(self, job, model, size: int, seed: int) -> tuple:
        rng = np.random.default_rng(seed)
        images = rng.standard_normal((size, *model.image_shape)).astype(np.float32)
        return images, (np.arange(size) % 2).astype(np.int32), np.ones(size, np.float32)

    def narrower_model(self, model_config: HepModelConfig) -> tuple[HepModelConfig, str] | None:
        half = model_config.filters // 2
        if half < NARROWEST_FILTERS:
            return None
        return dataclasses.replace(model_config, filters=half), f"model.filters={half}"

    def loss(self, model, batch, training: bool):
        return self.group_loss(model, batch, 1, training)

    def group_loss(self, model, batch, ranks: int, training: bool):
        """In one call of the network, whose examples are independent (no batch statistics)."""
        import tensorflow as tf

        x, y, w = batch
        logits = model(x, training=training)
        per_event = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        # Class-balanced event weights (mean ~1), so the loss scale does not depend on the
        # physics cross-sections; normalised per rank's batch, as each rank does.
        per_event, w = tf.reshape(per_event, [ranks, -1]), tf.reshape(w, [ranks, -1])
        return tf.reduce_mean(tf.reduce_sum(per_event * w, axis=1) / tf.reduce_sum(w, axis=1))

    def scores(self, model, stats, data: Path, batch_size: int = 512, progress=None, limit: int | None = None):
        """Signal probability of every event of `data` (the first `limit`), in file order, with
        labels and weights."""
        import tensorflow as tf

        norm = Normalization.from_dict(stats)
        predict = traced_forward(model, "signal", lambda m, x: tf.nn.softmax(m(x, training=False))[:, 1])
        parts: dict[str, list] = {"score": [], "y": [], "w": [], "pass": [], "index": []}
        has_pass = True
        if limit is not None and _subset_bytes(data, limit) <= DECODED_SUBSET_BYTES:
            st = Path(data).stat()
            batches = _decoded_subset(str(data), (st.st_ino, st.st_size, st.st_mtime_ns), limit, batch_size, norm)
        else:
            batches = _subset_batches(data, limit, batch_size, norm)
        for x, y, w, passed, index in batches:
            parts["score"].append(predict(x).numpy())
            parts["y"].append(y)
            parts["w"].append(w)
            parts["index"].append(index)
            if passed is None:
                has_pass = False
            else:
                parts["pass"].append(passed)
            if progress:
                progress(len(y))
            if limit is not None and sum(len(i) for i in parts["index"]) >= limit:
                break
        out = {k: np.concatenate(v)[:limit] for k, v in parts.items() if v}
        if not has_pass:
            out.pop("pass", None)
        return out

    def serving(self, model, stats):
        import tensorflow as tf

        divisor = tf.constant(Normalization.from_dict(stats).divisor())

        def signal_probability(images):  # (n, H, W, 3) channels last, as the reader yields them
            return tf.nn.softmax(model(images / divisor, training=False))[:, 1]

        return signal_probability

    def validate(self, model, stats, data: Path, limit: int) -> dict[str, float]:
        """Class-balanced cross-entropy, weighted and unweighted AUC, and the TPR at the cut-based
        selection's FPR."""
        from hpcdl.workloads.hep import metrics

        s = self.scores(model, stats, data, batch_size=min(512, limit), limit=limit)
        y = s["y"].astype(np.int64)
        p = np.clip(s["score"].astype(np.float64), 1e-7, 1.0 - 1e-7)
        w = Normalization.from_dict(stats).event_weights(y, s["w"]).astype(np.float64)
        out = {"loss": float(-np.sum(w * np.where(y == 1, np.log(p), np.log1p(-p))) / np.sum(w))}
        try:
            m = metrics.evaluate_scores(s["score"], s["y"], s["w"], s.get("pass"))
        except ValueError:  # the subset holds one class only
            return out
        out["auc"] = m.auc_weighted
        # Training minimises the weighted loss; the unweighted AUC says what that costs the events
        # the weights make rare.
        out["auc_unweighted"] = m.auc_unweighted
        if m.cnn_tpr_at_selection_fpr is not None:
            out["tpr_at_selection_fpr"] = m.cnn_tpr_at_selection_fpr
        return out

    def examples(self, data: Path, stats: dict[str, Any] | None = None) -> int | None:
        from hpcdl.workloads.hep.layout import open_hep

        return open_hep(data).n_events

    def evaluate(self, model, stats, data: Path, out_dir: Path, scores_out: Path | None = None,
                 progress=None) -> dict[str, Any]:
        from hpcdl.workloads.hep import metrics

        expected = tuple(model.image_shape)
        found = tuple(hepdata.open_hep(data).image_shape)
        if found != expected:
            raise hepdata.DataError(f"{data}: images are {found}, the model was trained on {expected}")
        s = self.scores(model, stats, data, progress=progress)
        result = metrics.evaluate_scores(s["score"], s["y"], s["w"], s.get("pass")).to_dict()
        selection = None
        if result.get("selection_fpr") is not None:
            selection = (result["selection_fpr"], result["selection_tpr"])
        roc_png = out_dir / "roc.png"
        metrics.plot_roc(roc_png, s["score"], s["y"], s["w"], selection=selection,
                         title=f"HEP classifier on {Path(data).name}")
        result["roc_png"] = str(roc_png)
        if scores_out is not None:
            metrics.write_scores(scores_out, s["index"], s["score"], s["y"], s["w"])
            result["scores_file"] = str(scores_out)
        return result


WORKLOAD = HepWorkload()


# A validation subset is scored again and again (every train.validate_every steps; 40 times a race
# in plan --target), and decoding its gzip chunks is most of a score: a small one is kept decoded,
# keyed by the file's identity so that a changed file is read again.
DECODED_SUBSET_BYTES = 128 * 2**20


def _subset_bytes(data: Path, limit: int) -> int:
    h, w, c = hepdata.open_hep(data).image_shape
    return limit * h * w * c * 4


def _subset_batches(data, limit: int | None, batch_size: int, norm) -> "hepdata.BatchIterator":
    # a validation subset is read in one small slice, not the job's large chunks
    window = {} if limit is None else {"chunk_events": max(batch_size, limit), "prefetch": 0}
    return hepdata.iter_batches(data, batch_size, norm=norm, shuffle=False, epochs=1, drop_remainder=False, **window)


@functools.lru_cache(maxsize=2)
def _decoded_subset(path: str, identity: tuple, limit: int, batch_size: int, norm) -> tuple:
    batches, events = [], 0
    with _subset_batches(path, limit, batch_size, norm) as reader:
        for batch in reader:
            batches.append(batch)
            events += len(batch[1])
            if events >= limit:
                break
    return tuple(batches)
