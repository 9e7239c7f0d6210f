"""The semi-supervised extreme-weather detector (after Racah et al., NIPS 2017, and Kurth et al., SC17).

Input H×W×16 (NHWC, normalised). Three parts share one encoder:

* **Encoder**: one k×k convolution of stride 2 per entry of `filters` (leaky ReLU 0.1), then
  `grid_convs` k×k stride-1 convolutions at the final resolution: the features of a grid of
  ⌈H/cell⌉ × ⌈W/cell⌉ cells, cell = 2^len(filters) pixels.
* **Detection head** (YOLO-style, one box per cell): a 1×1 convolution to 5 + 4 channels per cell:
  objectness logit, centre-offset logits (y, x) in the cell, log(h / cell), log(w / cell), and 4
  class logits (TD, TC, ETC, AR). The objectness bias starts at log(0.01/0.99) (an object prior
  of 1 %, so the many empty cells do not swamp the first steps).
* **Decoder**: the encoder mirrored with k×k transposed convolutions of stride 2 (leaky ReLU, the
  last one linear to 16 channels), cropped to H×W: it reconstructs the input.

Loss (`ClimateNet.loss`): detection loss on the labelled images of a batch + reconstruction_weight
× the reconstruction loss (mean squared error over pixels and channels) on every image. The
detection loss per image sums over cells, as YOLO does:

    coord_weight · Σ_obj [(σ(t_y) − y)² + (σ(t_x) − x)² + (t_h − log h/c)² + (t_w − log w/c)²]
  + Σ_obj BCE(t_o, 1) + noobj_weight · Σ_noobj BCE(t_o, 0)
  + Σ_obj cross-entropy(class logits, class)

with coord_weight 5 and noobj_weight 0.5 (the reference code's values; objectness and class use
logistic / softmax cross-entropy rather than YOLO v1's squared errors), averaged over the labelled
images. With reconstruction_weight 0 (supervised only) the decoder is not run.
"""

from __future__ import annotations

import math

import tensorflow as tf

from hpcdl.engine.flops import FlopCount
from hpcdl.engine.nn import Conv2D, Conv2DTranspose, named_variables
from hpcdl.workloads.base import Model
from hpcdl.workloads.climate.config import HEAD_CHANNELS, ClimateModelConfig
from hpcdl.workloads.climate.data import CHANNELS

OBJECT_PRIOR = 0.01


def _act(x: tf.Tensor) -> tf.Tensor:
    return tf.nn.leaky_relu(x, alpha=0.1)


class ClimateNet(tf.Module, Model):
    def __init__(self, config: ClimateModelConfig, input_shape: tuple[int, int, int], seed: int = 0):
        super().__init__(name="climate_net")
        h, w, c = (int(v) for v in input_shape)
        if c != len(CHANNELS):
            raise ValueError(f"the climate model takes {len(CHANNELS)} channels, got input shape {tuple(input_shape)}")
        self.config = config
        self.image_shape = (h, w, c)
        self.cell = 2 ** len(config.filters)
        self.grid = (math.ceil(h / self.cell), math.ceil(w / self.cell))
        rng = tf.random.Generator.from_seed(seed)
        chans = [c, *config.filters]
        k = config.kernel
        self.encoder = [Conv2D(chans[i], chans[i + 1], k, 2, rng, name=f"enc{i}") for i in range(len(config.filters))]
        top = chans[-1]
        self.grid_convs = [Conv2D(top, top, k, 1, rng, name=f"grid{i}") for i in range(config.grid_convs)]
        self.head = Conv2D(top, HEAD_CHANNELS, 1, 1, rng, name="head")
        self.head.b.assign(tf.constant([math.log(OBJECT_PRIOR / (1 - OBJECT_PRIOR))] + [0.0] * (HEAD_CHANNELS - 1)))
        self.decoder = [Conv2DTranspose(chans[i + 1], chans[i], k, 2, rng, name=f"dec{i}")
                        for i in reversed(range(len(config.filters)))]

    @property
    def reconstructs(self) -> bool:
        return self.config.reconstruction_weight > 0

    def encode(self, x: tf.Tensor) -> tf.Tensor:
        for conv in self.encoder:
            x = _act(conv(x))
        for conv in self.grid_convs:
            x = _act(conv(x))
        return x

    def decode(self, z: tf.Tensor) -> tf.Tensor:
        for i, deconv in enumerate(self.decoder):
            z = deconv(z)
            if i < len(self.decoder) - 1:
                z = _act(z)
        h, w, _ = self.image_shape
        return z[:, :h, :w, :]

    def __call__(self, x: tf.Tensor, reconstruct: bool = False):
        """Raw head output (B, gh, gw, 9); with `reconstruct`, also the reconstruction (B, H, W, 16)."""
        z = self.encode(x)
        out = self.head(z)
        return (out, self.decode(z)) if reconstruct else out

    def loss(self, x: tf.Tensor, target: tf.Tensor, labelled: tf.Tensor) -> tf.Tensor:
        cfg = self.config
        if self.reconstructs:
            out, recon = self(x, reconstruct=True)
            rec = tf.reduce_mean(tf.square(recon - x))
        else:
            out = self(x)
            # The decoder is not run; this keeps its gradients defined (zero), so every
            # configuration hands the engine and the allreduce the same list of tensors.
            rec = 0.0 * tf.add_n([tf.reduce_sum(v) for v in self._decoder_variables()])
        det = detection_loss(out, target, labelled, cfg.coord_weight, cfg.noobj_weight)
        return det + cfg.reconstruction_weight * rec

    def _decoder_variables(self):
        return [v for d in self.decoder for v in (d.w, d.b)]

    def flops(self) -> FlopCount:
        return self.config.cost(self.image_shape)[0]

    def named_variables(self) -> list[tuple[str, tf.Variable]]:
        return named_variables(self)


def detection_loss(out: tf.Tensor, target: tf.Tensor, labelled: tf.Tensor,
                   coord_weight: float = 5.0, noobj_weight: float = 0.5) -> tf.Tensor:
    """YOLO-style loss (see the module docstring), averaged over the labelled images (0 if none).

    out (B, gh, gw, 5 + C) raw; target (B, gh, gw, 6) from `boxes.encode_boxes`; labelled (B,) 1/0.
    """
    obj = target[..., 0]
    noobj = 1.0 - obj
    coords = (tf.square(tf.sigmoid(out[..., 1]) - target[..., 1])
              + tf.square(tf.sigmoid(out[..., 2]) - target[..., 2])
              + tf.square(out[..., 3] - target[..., 3])
              + tf.square(out[..., 4] - target[..., 4]))
    bce_obj = tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.ones_like(obj), logits=out[..., 0])
    bce_noobj = tf.nn.sigmoid_cross_entropy_with_logits(labels=tf.zeros_like(obj), logits=out[..., 0])
    cls = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.cast(target[..., 5], tf.int32),
                                                         logits=out[..., 5:])
    per_cell = obj * (coord_weight * coords + bce_obj + cls) + noobj_weight * noobj * bce_noobj
    per_image = tf.reduce_sum(per_cell, axis=[1, 2])
    labelled = tf.cast(labelled, per_image.dtype)
    return tf.reduce_sum(per_image * labelled) / tf.maximum(tf.reduce_sum(labelled), 1.0)
