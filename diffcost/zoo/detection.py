"""MLPerf's single-stage detector, in flax.linen: RetinaNet (Lin et al. 2017) with a ResNeXt-50
(32x4d) backbone and a feature pyramid, as in mlcommons/training ``single_stage_detector/ssd``
(``model/retinanet.py``, ``model/backbone_utils.py``, ``model/feature_pyramid_network.py``).

* **Backbone**: ResNeXt-50 32x4d (Xie et al. 2017; torchvision's ``resnext50_32x4d``): a 7x7
  stride-2 stem convolution and a 3x3 stride-2 max pool, then 3, 4, 6 and 3 bottlenecks whose
  3x3 convolution has 32 groups and ``2 x planes`` channels (128, 256, 512, 1024), stride 2 in
  the 3x3 convolution of each later stage's first block. Every batch norm is frozen
  (torchvision's ``FrozenBatchNorm2d``: a per-channel scale and shift that are not trained).
  With the reference's ``trainable_backbone_layers`` = 3 (its default), the stem and the first
  stage (``layer1``) are not trained either: ``FROZEN_STAGES`` names them.
* **Feature pyramid**: 1x1 lateral convolutions of the last three stages (512, 1024, 2048
  channels) to 256, a top-down path with nearest 2x upsampling, 3x3 output convolutions (P3 to
  P5), and P6 and P7 by 3x3 stride-2 convolutions of P5 and of ReLU(P6) (the reference's
  ``LastLevelP6P7(256, 256)``). All with biases.
* **Heads**, shared by the five levels: four 3x3 convolutions of 256 channels with ReLU, then a
  3x3 convolution to ``anchors x classes`` logits (classification) or ``anchors x 4`` box
  offsets (regression); 9 anchors per position, 264 classes (OpenImages-MLPerf).

The output is the pair (class logits ``[batch, anchors, classes]``, box offsets ``[batch,
anchors, 4]``) over the 120,087 anchors of an 800x800 image; the focal and L1 losses are not
part of the module (the zoo's other models stop at their logits too).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

RESNEXT50_STAGES = (3, 4, 6, 3)
RESNEXT_GROUPS = 32
RESNEXT_WIDTH_PER_GROUP = 4
FPN_CHANNELS = 256
HEAD_CONVS = 4
ANCHORS = 9  # 3 sizes x 3 aspect ratios per position
OPENIMAGES_MLPERF_CLASSES = 264
IMAGE_SIZE = 800
# the modules ``trainable_backbone_layers=3`` leaves frozen: the stem and the first stage
FROZEN_STAGES = ("stem", "layer1")


class FrozenBatchNorm(nn.Module):
    """A frozen batch norm: ``x * scale + shift`` per channel, both in the ``frozen_bn``
    collection (constants, not parameters)."""

    @nn.compact
    def __call__(self, x):
        c = x.shape[-1]
        scale = self.variable("frozen_bn", "scale", lambda: jnp.ones((c,), x.dtype)).value
        shift = self.variable("frozen_bn", "shift", lambda: jnp.zeros((c,), x.dtype)).value
        return x * scale + shift


class XBottleneck(nn.Module):
    """ResNeXt bottleneck: 1x1 reduce to ``width``, grouped 3x3 (stride here), 1x1 expand to
    ``out``; a projection shortcut when the shape changes."""

    width: int
    out: int
    stride: int = 1

    @nn.compact
    def __call__(self, x):
        s = (self.stride, self.stride)
        y = nn.relu(FrozenBatchNorm()(nn.Conv(self.width, (1, 1), use_bias=False)(x)))
        grouped = nn.Conv(
            self.width, (3, 3), s, padding=1, feature_group_count=RESNEXT_GROUPS, use_bias=False
        )
        y = nn.relu(FrozenBatchNorm()(grouped(y)))
        y = FrozenBatchNorm()(nn.Conv(self.out, (1, 1), use_bias=False)(y))
        if x.shape[-1] != self.out or self.stride != 1:
            x = FrozenBatchNorm()(nn.Conv(self.out, (1, 1), s, use_bias=False)(x))
        return nn.relu(y + x)


def _upsample2(x):
    """Nearest-neighbour 2x upsampling of an NHWC tensor. Batch and rows are merged before
    the broadcast: JAX transposes a broadcast of a size-1 axis (a batch of one) with an extra
    operator, and the graph must be the same at every batch size."""
    n, h, w, c = x.shape
    wide = jax.lax.broadcast_in_dim(x.reshape(n * h, w, c), (n * h, 2, w, 2, c), (0, 2, 4))
    return wide.reshape(n, 2 * h, 2 * w, c)


class RetinaHead(nn.Module):
    """One head (classification or regression), applied with the same weights to every level;
    ``outputs`` values per anchor."""

    outputs: int
    anchors: int = ANCHORS
    channels: int = FPN_CHANNELS

    @nn.compact
    def __call__(self, levels):
        convs = [nn.Conv(self.channels, (3, 3), padding=1) for _ in range(HEAD_CONVS)]
        final = nn.Conv(self.anchors * self.outputs, (3, 3), padding=1)
        out = []
        for y in levels:
            for conv in convs:
                y = nn.relu(conv(y))
            y = final(y)
            out.append(y.reshape(y.shape[0], -1, self.outputs))
        return jnp.concatenate(out, axis=1)


class RetinaNet(nn.Module):
    """RetinaNet, ResNeXt-50 32x4d backbone, FPN P3-P7 (see the module docstring). Parameter
    subtrees are named ``stem``, ``layer1_0`` .. ``layer4_2``, ``fpn_*``, ``cls_head`` and
    ``box_head``."""

    classes: int = OPENIMAGES_MLPERF_CLASSES
    stages: Sequence[int] = RESNEXT50_STAGES

    def backbone(self, x):
        x = nn.Conv(64, (7, 7), (2, 2), padding=3, use_bias=False, name="stem")(x)
        x = nn.max_pool(nn.relu(FrozenBatchNorm()(x)), (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        features = []
        for stage, blocks in enumerate(self.stages):
            planes = 64 * 2**stage
            width = planes * RESNEXT_WIDTH_PER_GROUP * RESNEXT_GROUPS // 64
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                name = f"layer{stage + 1}_{block}"
                x = XBottleneck(width, 4 * planes, stride, name=name)(x)
            features.append(x)
        return features[1:]  # C3, C4, C5

    def pyramid(self, c3, c4, c5):
        lateral = [nn.Conv(FPN_CHANNELS, (1, 1), name=f"fpn_inner{i}") for i in range(3)]
        output = [nn.Conv(FPN_CHANNELS, (3, 3), padding=1, name=f"fpn_layer{i}") for i in range(3)]
        inner = lateral[2](c5)
        p5 = output[2](inner)
        inner = lateral[1](c4) + _upsample2(inner)
        p4 = output[1](inner)
        inner = lateral[0](c3) + _upsample2(inner)
        p3 = output[0](inner)
        p6 = nn.Conv(FPN_CHANNELS, (3, 3), (2, 2), padding=1, name="fpn_p6")(p5)
        p7 = nn.Conv(FPN_CHANNELS, (3, 3), (2, 2), padding=1, name="fpn_p7")(nn.relu(p6))
        return p3, p4, p5, p6, p7

    @nn.compact
    def __call__(self, x):
        levels = self.pyramid(*self.backbone(x))
        logits = RetinaHead(self.classes, name="cls_head")(levels)
        boxes = RetinaHead(4, name="box_head")(levels)
        return logits, boxes


def frozen_subtrees(params) -> tuple[str, ...]:
    """The parameter subtrees of a ``RetinaNet`` that the reference does not train
    (``FROZEN_STAGES``)."""
    return tuple(k for k in params if k == "stem" or k.split("_")[0] in FROZEN_STAGES)
