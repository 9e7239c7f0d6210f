"""The climate job's `[data]` and `[model]` sections."""

from __future__ import annotations

from dataclasses import dataclass

from hpcdl.errors import JobError
from hpcdl.engine import flops as count
from hpcdl.engine.flops import FlopCount
from hpcdl.workloads.climate.data import NUM_CLASSES

#: Detection head channels per cell: objectness, centre (y, x), log size (h, w), class logits.
HEAD_CHANNELS = 5 + NUM_CLASSES


@dataclass(frozen=True)
class ClimateDataConfig:
    train: str = "data/climate/train.h5"
    val: str = "data/climate/val.h5"
    test: str = "data/climate/test.h5"
    # Preprocessing, applied as each image is read (and recorded in the normalisation statistics,
    # so evaluation applies the same): crop = [y0, x0, height, width] in file pixels (empty: the
    # whole image), then average-pool by `downsample` (1: none). Boxes follow.
    crop: tuple[int, ...] = ()
    downsample: int = 1
    stats_images: int = 0  # images of data.train read for the mean/std (0: all; else evenly spaced)
    # Semi-supervised batches: this share of every training batch is drawn from the labelled
    # images and the rest from the unlabelled ones (0: draw uniformly from the whole file). With
    # model.reconstruction_weight = 0 (supervised only) batches hold labelled images alone.
    labelled_share: float = 0.5
    prefetch: int = 2  # batches read ahead by a background thread

    def validate(self) -> None:
        if not self.train:
            raise JobError("data.train must name the training file")
        if self.crop and (len(self.crop) != 4 or min(self.crop[:2]) < 0 or min(self.crop[2:]) < 1):
            raise JobError(f"data.crop must be [] or [y0, x0, height, width] with height, width >= 1, got {list(self.crop)}")
        if self.downsample < 1:
            raise JobError(f"data.downsample must be >= 1, got {self.downsample}")
        if self.stats_images < 0 or self.prefetch < 0:
            raise JobError("data.stats_images and data.prefetch must be >= 0")
        if not 0.0 <= self.labelled_share <= 1.0:
            raise JobError(f"data.labelled_share must be in [0, 1], got {self.labelled_share}")


@dataclass(frozen=True)
class ClimateModelConfig:
    # Encoder: one stride-2 k×k convolution per entry (its filters); the detection grid's cell is
    # 2^len(filters) pixels. Then `grid_convs` stride-1 convolutions at grid resolution.
    filters: tuple[int, ...] = (32, 64, 128)
    kernel: int = 3
    grid_convs: int = 2
    # Loss = detection (labelled images) + reconstruction_weight × reconstruction (all images).
    reconstruction_weight: float = 1.0
    coord_weight: float = 5.0  # YOLO λ_coord (Racah et al.'s reference code)
    noobj_weight: float = 0.5  # YOLO λ_noobj
    # Decoding of detections (evaluation)
    score_threshold: float = 0.01
    nms_iou: float = 0.3
    max_detections: int = 15

    def validate(self) -> None:
        if not self.filters or min(self.filters) < 1:
            raise JobError(f"model.filters must be a non-empty list of positive integers, got {list(self.filters)}")
        if self.kernel < 1 or self.grid_convs < 0:
            raise JobError("model.kernel must be >= 1 and model.grid_convs >= 0")
        for name in ("reconstruction_weight", "coord_weight", "noobj_weight"):
            if not getattr(self, name) >= 0:
                raise JobError(f"model.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.score_threshold < 1.0:
            raise JobError(f"model.score_threshold must be in [0, 1), got {self.score_threshold}")
        if not 0.0 < self.nms_iou <= 1.0:
            raise JobError(f"model.nms_iou must be in (0, 1], got {self.nms_iou}")
        if self.max_detections < 1:
            raise JobError(f"model.max_detections must be >= 1, got {self.max_detections}")

    def cost(self, input_shape) -> tuple[FlopCount, int]:
        """FLOPs per example and parameter count of the network at `input_shape` (H, W, C),
        without TensorFlow: `ClimateNet.flops()` and the planner both count with it.

        Stride-2 'same' encoder convolutions, stride-1 grid convolutions and the 1×1 head at the
        grid's resolution; the decoder's transposed convolutions only when it is run
        (reconstruction_weight > 0), though its parameters always exist.
        """
        h, w, c = (int(x) for x in input_shape)
        chans, k = [c, *self.filters], self.kernel
        total, params = count.ZERO, 0
        for i in range(len(self.filters)):
            h, w = -(-h // 2), -(-w // 2)
            total = total + count.conv(h, w, k, chans[i], chans[i + 1], needs_input_grad=i > 0)
            params += 2 * (k * k * chans[i] * chans[i + 1]) + chans[i + 1] + chans[i]  # and its decoder mirror
        top = chans[-1]
        for _ in range(self.grid_convs):
            total = total + count.conv(h, w, k, top, top)
            params += k * k * top * top + top
        total = total + count.conv(h, w, 1, top, HEAD_CHANNELS)
        params += top * HEAD_CHANNELS + HEAD_CHANNELS
        if self.reconstruction_weight > 0:
            for i in reversed(range(len(self.filters))):
                total = total + count.conv(h, w, k, chans[i + 1], chans[i])
                h, w = 2 * h, 2 * w
        return total, params
