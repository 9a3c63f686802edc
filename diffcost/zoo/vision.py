"""Vision models of the zoo, in flax.linen: ResNet-50, VGG-16, ViT-B/16 and a small CNN.

Shapes follow the reference definitions: ResNet-50 v1.5 (He et al. 2016, the stride-2 3x3
convolution in each stage's first bottleneck, as MLPerf's image classification reference and
torchvision use), VGG-16 configuration D (Simonyan & Zisserman 2015), ViT-B/16 (Dosovitskiy et
al. 2021: patch 16, width 768, 12 layers, 12 heads, MLP 3072). Batch normalization runs in
training mode (batch statistics); the running averages are not updated (they are state, not
part of the gradient step).
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffcost.zoo.dense import EncoderBlock

RESNET50_STAGES = (3, 4, 6, 3)
VGG16_CONVS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M")
VGG16_CONVS += (512, 512, 512, "M")


def _bn():
    return nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here), 1x1 expand x4; projection shortcut when shapes change."""

    width: int
    stride: int = 1

    @nn.compact
    def __call__(self, x):
        out = nn.relu(_bn()(nn.Conv(self.width, (1, 1), use_bias=False)(x)))
        conv = nn.Conv(self.width, (3, 3), (self.stride,) * 2, padding=1, use_bias=False)
        out = nn.relu(_bn()(conv(out)))
        out = _bn()(nn.Conv(4 * self.width, (1, 1), use_bias=False)(out))
        if x.shape[-1] != 4 * self.width or self.stride != 1:
            proj = nn.Conv(4 * self.width, (1, 1), (self.stride,) * 2, use_bias=False)
            x = _bn()(proj(x))
        return nn.relu(out + x)


class ResNet50(nn.Module):
    classes: int = 1000
    stages: Sequence[int] = RESNET50_STAGES

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(64, (7, 7), (2, 2), padding=3, use_bias=False)(x)
        x = nn.relu(_bn()(x))
        x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
        for stage, blocks in enumerate(self.stages):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                x = Bottleneck(64 * 2**stage, stride)(x)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


class VGG16(nn.Module):
    classes: int = 1000

    @nn.compact
    def __call__(self, x):
        for c in VGG16_CONVS:
            if c == "M":
                x = nn.max_pool(x, (2, 2), (2, 2))
            else:
                x = nn.relu(nn.Conv(c, (3, 3), padding=1)(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(4096)(x))
        x = nn.relu(nn.Dense(4096)(x))
        return nn.Dense(self.classes)(x)


class ViT(nn.Module):
    """Vision transformer: patch embedding, class token, learned positions, pre-norm blocks."""

    patch: int = 16
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp: int = 3072
    classes: int = 1000

    @nn.compact
    def __call__(self, x):
        p = self.patch
        x = nn.Conv(self.width, (p, p), (p, p), padding="VALID")(x)
        x = x.reshape(x.shape[0], -1, self.width)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, self.width), x.dtype)
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, self.width)), x], axis=1)
        pos = self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], self.width), x.dtype)
        x = x + pos
        for _ in range(self.depth):
            x = EncoderBlock(self.heads, self.mlp)(x)
        return nn.Dense(self.classes)(nn.LayerNorm()(x[:, 0]))


UNET3D_FILTERS = (32, 64, 128, 256, 320)


def _conv3(features, stride=1):
    """3x3x3 convolution, instance norm, ReLU (the reference's ``conv_block_factory``)."""

    def block(x):
        x = nn.Conv(features, (3, 3, 3), (stride,) * 3, padding=1, use_bias=False)(x)
        return nn.relu(nn.InstanceNorm()(x))

    return block


class UNet3D(nn.Module):
    """MLPerf's 3D U-Net for KiTS19 (mlcommons/training image_segmentation/pytorch
    model/unet3d.py): an input block of two 3x3x3 convolutions at 32 channels, four
    downsampling blocks (a stride-2 convolution, then a convolution) to 64, 128, 256 and 320
    channels, a stride-2 bottleneck at 320, five upsampling blocks (a 2x2x2 stride-2 transposed
    convolution, concatenation with the skip, two convolutions) back to 32 channels, and a
    1x1x1 convolution to the classes. Instance norm and ReLU after every 3x3x3 convolution."""

    classes: int = 3
    filters: Sequence[int] = UNET3D_FILTERS

    @nn.compact
    def __call__(self, x):
        x = _conv3(self.filters[0])(_conv3(self.filters[0])(x))
        skips = [x]
        for f in (*self.filters[1:], self.filters[-1]):
            x = _conv3(f)(_conv3(f, 2)(x))
            skips.append(x)
        skips.pop()
        for f in (self.filters[-1], *reversed(self.filters[:-1])):
            x = nn.ConvTranspose(f, (2, 2, 2), (2, 2, 2), use_bias=False)(x)
            x = jnp.concatenate([x, skips.pop()], axis=-1)
            x = _conv3(f)(_conv3(f)(x))
        return nn.Conv(self.classes, (1, 1, 1))(x)


class SmallCNN(nn.Module):
    """Two 3x3 convolutions with pooling, then a dense classifier (tests)."""

    classes: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        # average pooling as a window sum (flax's avg_pool mixes int and float under strict
        # dtype promotion)
        x = nn.pooling.pool(x, np.zeros((), x.dtype), jax.lax.add, (2, 2), (2, 2), "VALID") / 4.0
        x = nn.max_pool(nn.relu(nn.Conv(64, (3, 3), (1, 1))(x)), (2, 2), (2, 2))
        return nn.Dense(self.classes)(x.reshape(x.shape[0], -1))
