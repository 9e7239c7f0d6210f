"""The generic workload: a supervised `tf.keras.Model` the user's builder function returns, trained on
arrays in HDF5 files with no hpcdl-specific code in the model.

Loss and metrics follow `data.task`: classification is (weighted) cross-entropy, scored by
accuracy, a confusion matrix and, for two classes, ROC AUC; regression is mean squared error,
scored by MSE, MAE and R². The model ends in `data.classes` logits or probabilities (or one for
two classes: a sigmoid's), or in the regression targets' number of values.

What scoring needs besides the model travels in the stats stored with every checkpoint: the
dataset names, the task, and the per-channel normalisation (`data.normalize`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from hpcdl.errors import JobError
from hpcdl.workloads.base import Workload
from hpcdl.workloads.keras.config import KerasDataConfig, KerasModelConfig
from hpcdl.workloads.keras.data import (ArrayFile, DataError, check_all_labels, channel_stats, iter_batches,
                                        target_stats)

PROBABILITY_ACTIVATIONS = ("softmax", "sigmoid")
FLOPS_TRACE_BATCH = 4


class _DataFromStats:
    """The fields of KerasDataConfig that reading a file needs, from a checkpoint's stats."""

    def __init__(self, stats: dict[str, Any]):
        self.inputs, self.labels, self.weights = stats["inputs"], stats["labels"], stats["weights"]
        self.task, self.classes = stats["task"], stats["classes"]


class KerasWorkload(Workload):
    name = "keras"
    DataConfig = KerasDataConfig
    ModelConfig = KerasModelConfig
    compute_dtypes = ("float32", "bfloat16")

    # -- checks at submit ----------------------------------------------------------------------

    def check_data(self, job) -> None:
        data = job.data
        train = self._open("data.train", data.train, data)
        ranks = job.run.nodes * job.run.ranks_per_node
        if train.n < job.train.batch_per_rank * ranks:
            raise JobError(f"data.train has {train.n} examples, fewer than one batch per rank "
                           f"({job.train.batch_per_rank} × {ranks} ranks)")
        files = [("data.train", train)]
        if job.train.validate_every and data.val:
            val = self._open("data.val", data.val, data, " (train.validate_every = 0 trains without it)")
            files.append(("data.val", val))
        for field, arrays in files[1:]:
            if arrays.input_shape != train.input_shape or arrays.label_shape != train.label_shape:
                raise JobError(f"{field}: examples are {arrays.input_shape} with labels {arrays.label_shape}, "
                               f"data.train's {train.input_shape} with {train.label_shape}")
        if data.task == "classification":
            for field, arrays in files:
                try:
                    check_all_labels(arrays, data.classes, data.chunk)
                except DataError as exc:
                    raise JobError(f"{field}: {exc}") from None

    def finite_datasets(self, data_config) -> list[str]:
        return [name for name in (data_config.inputs, data_config.labels, data_config.weights) if name]

    def check_job(self, job, data: bool) -> None:
        """The data (when `data`), then the model built once: the builder imports and returns a
        Keras model whose input takes the examples and whose output fits the task."""
        if data:
            self.check_data(job)
        try:
            arrays = ArrayFile.open(job.data.train, job.data)
        except DataError:
            if data:
                raise
            from hpcdl.workloads.keras.builder import load_builder

            load_builder(job.model.builder)  # the data is not here: at least the code imports
            return
        model = self.build_model(job.model, arrays.input_shape, seed=job.train.seed)
        check_output(model, job.model.builder, job.data, arrays)

    @staticmethod
    def _open(field: str, path: str, data, hint: str = "") -> ArrayFile:
        try:
            return ArrayFile.open(path, data)
        except DataError as exc:
            raise JobError(f"{field}: {exc}{hint}") from None

    # -- what the engine calls -----------------------------------------------------------------

    def compute_stats(self, job) -> dict[str, Any]:
        data = job.data
        stats: dict[str, Any] = {"task": data.task, "classes": data.classes if data.task == "classification" else 0,
                                 "inputs": data.inputs, "labels": data.labels, "weights": data.weights}
        if data.normalize:
            stats.update(channel_stats(ArrayFile.open(data.train, data), data.chunk))
        if data.task == "regression" and data.standardize_targets:
            stats.update(target_stats(ArrayFile.open(data.train, data), data.chunk))
        return stats

    def input_shape(self, job) -> tuple[int, ...]:
        return ArrayFile.open(job.data.train, job.data).input_shape

    def build_model(self, model_config, input_shape, seed: int, compute_dtype: str = "float32"):
        import keras

        from hpcdl.workloads.keras.builder import call_builder
        from hpcdl.workloads.keras.model import KerasModel

        keras.utils.set_random_seed(seed)
        policy = keras.config.dtype_policy()
        if compute_dtype == "bfloat16":
            keras.config.set_dtype_policy("mixed_bfloat16")
        try:
            built = call_builder(model_config.builder, model_config.args, tuple(input_shape))
        finally:
            keras.config.set_dtype_policy(policy)
        if not isinstance(built, keras.Model):
            raise JobError(f"model.builder {model_config.builder!r} returned a {type(built).__name__}, "
                           "not a keras.Model")
        check_input(built, model_config.builder, tuple(input_shape))
        model = KerasModel(built, tuple(input_shape), lambda m: self._count_flops(m))
        model.probabilities = ends_in_probabilities(built, model_config.output)
        return model

    def network_cost(self, job) -> tuple[float, int]:
        """(training FLOPs per example, parameters): the model built (TensorFlow) and counted."""
        flops, _source, params = self.network_cost_and_source(job)
        return flops, params

    def network_cost_and_source(self, job) -> tuple[float, str, int]:
        model = self.build_model(job.model, self.input_shape(job), seed=job.train.seed)
        flops, source = model.flops_and_source()
        params = sum(int(np.prod(v.shape)) for _, v in model.named_variables())
        return float(flops.training), source, params

    def _count_flops(self, model):
        import tensorflow as tf

        from hpcdl.workloads.keras.model import own_flops, traced_flops

        counted = own_flops(model.keras)
        if counted is not None:
            return counted, "the model's own flops()"
        logger, level = tf.get_logger(), tf.get_logger().level
        logger.setLevel("ERROR")  # the v1 profiler's deprecation notices
        try:
            flops = traced_flops(model, lambda m, b: self.loss(m, b, training=True),
                                 self.example_batch(None, model, FLOPS_TRACE_BATCH, seed=0),
                                 [v for _, v in model.named_variables()])
        finally:
            logger.setLevel(level)
        return flops, "TensorFlow's cost analysis of the traced training step"

    def example_batch(self, job, model, size: int, seed: int) -> tuple:
        """Zeros: the loss's kind does not change the work that matters (the layers'); cross-entropy
        needs integer labels, a regression float targets."""
        outputs = int(model.keras.outputs[0].shape[-1]) if model.keras.outputs else 1
        y = np.zeros(size, np.int32) if outputs > 1 or model.probabilities else np.zeros((size, outputs), np.float32)
        return np.zeros((size, *model.image_shape), np.float32), y, np.ones(size, np.float32)

    def train_batches(self, job, stats, shard: int, shards: int, seed: int) -> Iterator[tuple]:
        arrays = ArrayFile.open(job.data.train, job.data)
        batches = iter_batches(arrays, job.train.batch_per_rank, stats=stats, classes=stats["classes"], rank=shard,
                               size=shards, shuffle=True, seed=seed, chunk=job.data.chunk,
                               prefetch=job.data.prefetch)
        with batches:  # closing this generator stops the prefetch thread and waits for it
            for b in batches:
                yield b.x, b.y, b.w

    def loss(self, model, batch, training: bool):
        """Weighted mean of the per-example loss: cross-entropy for integer labels (from logits or
        probabilities; one output is a binary logit or sigmoid), squared error for float targets."""
        import tensorflow as tf

        x, y, w = batch
        out = model(x, training=training)
        if tf.as_dtype(y.dtype).is_integer:
            per_example = cross_entropy(out, y, model.probabilities)
        else:
            target = tf.reshape(tf.cast(y, tf.float32), [tf.shape(out)[0], -1])
            per_example = tf.reduce_mean(tf.square(tf.reshape(out, tf.shape(target)) - target), axis=1)
        w = tf.cast(w, tf.float32)
        return tf.reduce_sum(per_example * w) / tf.reduce_sum(w)

    # -- scoring -------------------------------------------------------------------------------

    def predict(self, model, stats, data: Path, batch_size: int = 512, limit: int | None = None, progress=None):
        """(outputs as probabilities or values, labels, weights, index) of `data`'s first `limit`
        examples, in file order."""
        import tensorflow as tf

        arrays = ArrayFile.open(data, _DataFromStats(stats))
        if arrays.input_shape != tuple(model.image_shape):
            raise DataError.at(data, f"examples are {arrays.input_shape}, the model was trained on "
                                     f"{tuple(model.image_shape)}")
        finish = _as_scored(model, stats)

        def forward(x):
            return finish(model(x, training=False))

        forward = tf.function(forward, reduce_retracing=True)
        window = {} if limit is None else {"chunk": max(batch_size, limit), "prefetch": 0}
        parts: dict[str, list] = {"p": [], "y": [], "w": [], "index": []}
        seen = 0
        inputs_only = {k: v for k, v in stats.items() if k not in ("target_mean", "target_std")}  # labels as stored
        for b in iter_batches(arrays, batch_size, stats=inputs_only, classes=stats["classes"], shuffle=False, epochs=1,
                              drop_remainder=False, **window):
            parts["p"].append(forward(b.x).numpy())
            parts["y"].append(b.y)
            parts["w"].append(b.w)
            parts["index"].append(b.index)
            seen += len(b.y)
            if progress:
                progress(len(b.y))
            if limit is not None and seen >= limit:
                break
        return {k: np.concatenate(v)[:limit] for k, v in parts.items()}

    def _scores(self, stats, s) -> dict[str, Any]:
        from hpcdl.workloads.keras import metrics

        if stats["task"] == "classification":
            return metrics.classification(s["p"], s["y"], s["w"], stats["classes"])
        return metrics.regression(s["p"], s["y"], s["w"])

    def serving(self, model, stats):
        import tensorflow as tf

        mean = tf.constant(stats["mean"], tf.float32) if stats.get("mean") else None
        std = tf.constant(stats["std"], tf.float32) if stats.get("mean") else None
        finish = _as_scored(model, stats)

        def predict(x):
            return finish(model((x - mean) / std if mean is not None else x, training=False))

        return predict

    def keras_model(self, model, stats):
        """The trained model as one plain Keras model for Keras' own `.keras` file: the input
        normalisation as a `Normalization` layer before it, and for a classifier that ends in
        logits, a softmax after it (a sigmoid, P(class 1), for a one-output binary model)."""
        import keras

        inputs = keras.Input(tuple(model.image_shape), name="examples")
        x = inputs
        if stats.get("mean"):
            std = np.asarray(stats["std"], np.float32)
            x = keras.layers.Normalization(mean=stats["mean"], variance=(std ** 2).tolist(), name="hpcdl_normalize")(x)
        out = model.keras(x)
        if stats.get("target_mean"):
            std = np.asarray(stats["target_std"], np.float32)
            out = keras.layers.Normalization(mean=stats["target_mean"], variance=(std ** 2).tolist(), invert=True,
                                             name="hpcdl_target_units")(out)
        if stats["task"] == "classification" and not model.probabilities:
            out = keras.layers.Activation("sigmoid" if out.shape[-1] == 1 else "softmax", name="hpcdl_probabilities")(out)
        return keras.Model(inputs, out, name="hpcdl_export")

    def examples(self, data: Path, stats: dict[str, Any] | None = None) -> int | None:
        if stats is None:
            return None
        return ArrayFile.open(data, _DataFromStats(stats)).n

    def validate(self, model, stats, data: Path, limit: int) -> dict[str, float]:
        s = self.predict(model, stats, data, batch_size=min(512, limit), limit=limit)
        return {k: v for k, v in self._scores(stats, s).items() if isinstance(v, float)}

    def evaluate(self, model, stats, data: Path, out_dir: Path, scores_out: Path | None = None,
                 progress=None) -> dict[str, Any]:
        from hpcdl.workloads.keras import metrics

        if scores_out is not None and scores_out.suffix.lower() != ".npz":
            raise JobError("--scores-out: the keras workload writes its predictions as .npz (a prediction may "
                           "be several values)")
        s = self.predict(model, stats, data, progress=progress)
        result = self._scores(stats, s)
        title = f"{Path(data).name}: {result['examples']} examples"
        if stats["task"] == "classification":
            result["confusion_png"] = str(metrics.plot_confusion(out_dir / "confusion.png", result["confusion_matrix"],
                                                                 title))
            if "auc" in result:
                from hpcdl.workloads.hep.metrics import plot_roc

                result["roc_png"] = str(plot_roc(out_dir / "roc.png", s["p"][:, 1], s["y"], s["w"], title=title))
        else:
            result["predicted_vs_true_png"] = str(metrics.plot_predicted_vs_true(
                out_dir / "predicted_vs_true.png", s["p"], s["y"], title))
        if scores_out is not None:
            result["scores_file"] = str(metrics.write_predictions(scores_out, s["index"], s["p"], s["y"]))
        return result


def _as_scored(model, stats: dict[str, Any]):
    """The model's output as `evaluate` scores it: class probabilities, or regression values in the
    targets' own units."""
    if stats["task"] == "classification":
        return lambda out: probabilities(out, model.probabilities)
    return _target_units(stats)


def _target_units(stats: dict[str, Any]):
    """A regression model's outputs back in the targets' own units (data.standardize_targets)."""
    import tensorflow as tf

    if not stats.get("target_mean"):
        return lambda out: out
    mean = tf.constant(stats["target_mean"], tf.float32)
    std = tf.constant(stats["target_std"], tf.float32)
    return lambda out: tf.reshape(tf.reshape(out, [tf.shape(out)[0], -1]) * std + mean, tf.shape(out))


def cross_entropy(out, y, from_probabilities: bool):
    import tensorflow as tf

    y = tf.cast(y, tf.int32)
    if out.shape[-1] == 1:  # binary: one logit (or a sigmoid's probability) of class 1
        z = out[:, 0]
        labels = tf.cast(y, tf.float32)
        if from_probabilities:
            p = tf.clip_by_value(z, 1e-7, 1.0 - 1e-7)
            return -(labels * tf.math.log(p) + (1.0 - labels) * tf.math.log1p(-p))
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=z)
    if from_probabilities:
        p = tf.clip_by_value(tf.gather(out, y, axis=1, batch_dims=1), 1e-7, 1.0)
        return -tf.math.log(p)
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out)


def probabilities(out, from_probabilities: bool):
    """Class probabilities (n, classes) from the model's output."""
    import tensorflow as tf

    if out.shape[-1] == 1:
        p1 = out[:, 0] if from_probabilities else tf.sigmoid(out[:, 0])
        return tf.stack([1.0 - p1, p1], axis=1)
    return out if from_probabilities else tf.nn.softmax(out)


def ends_in_probabilities(model, output: str) -> bool:
    """model.output = "auto": the last layer is a Softmax layer or has a softmax/sigmoid activation."""
    if output != "auto":
        return output == "probabilities"
    last = model.layers[-1] if model.layers else None
    if last is None:
        return False
    if type(last).__name__ == "Softmax":
        return True
    activation = getattr(last, "activation", None)
    return getattr(activation, "__name__", "") in PROBABILITY_ACTIVATIONS


def _shape(shape) -> tuple:
    return tuple(None if d is None else int(d) for d in shape)


def check_input(model, builder: str, input_shape: tuple[int, ...]) -> None:
    """One input taking examples of `input_shape`, and one output."""
    if len(model.inputs or ()) > 1 or len(model.outputs or ()) > 1:
        raise JobError(f"model.builder {builder!r}: the model has {len(model.inputs)} inputs and "
                       f"{len(model.outputs)} outputs; the keras workload trains one of each")
    if model.inputs:
        declared = _shape(model.inputs[0].shape)[1:]
        if len(declared) != len(input_shape) or any(d is not None and d != s for d, s in zip(declared, input_shape)):
            raise JobError(f"model.builder {builder!r}: the model's input is {declared}, but data.inputs "
                           f"examples are {input_shape}")
        return
    try:  # a subclassed model without an Input: built by its first call
        model(np.zeros((1, *input_shape), np.float32))
    except Exception as exc:
        raise JobError(f"model.builder {builder!r}: the model does not take examples of shape {input_shape}: "
                       f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None


def check_output(model, builder: str, data, arrays: ArrayFile) -> None:
    """The output fits the task: classes (or 1 for two classes), or the targets' values."""
    import tensorflow as tf

    out = _shape(model(tf.zeros((1, *arrays.input_shape)), training=False).shape)[1:]
    size = int(np.prod(out)) if out else 1
    builder = f"model.builder {builder!r}: the model"
    if data.task == "classification":
        fits = len(out) == 1 and (size == data.classes or (data.classes == 2 and size == 1))
        want = f"({data.classes},)" + (" or (1,)" if data.classes == 2 else "")
        if not fits:
            raise JobError(f"{builder} outputs {out} per example; data.task = \"classification\" with "
                           f"data.classes = {data.classes} needs {want}")
    elif size != arrays.targets:
        raise JobError(f"{builder} outputs {out} per example; data.labels holds {arrays.targets} "
                       f"target value(s) per example {arrays.label_shape or '(scalar)'}")


WORKLOAD = KerasWorkload()
