"""Dense models of the zoo, in flax.linen: an MLP and a pre-norm transformer encoder block."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn


class MLP(nn.Module):
    features: Sequence[int] = (1024, 1024, 10)

    @nn.compact
    def __call__(self, x):
        for f in self.features[:-1]:
            x = nn.relu(nn.Dense(f)(x))
        return nn.Dense(self.features[-1])(x)


class EncoderBlock(nn.Module):
    """Pre-norm block: LayerNorm, multi-head self-attention, residual; LayerNorm, GELU MLP,
    residual (ViT, BERT with pre-norm)."""

    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x):
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x))
        x = x + y
        y = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.mlp)(nn.LayerNorm()(x))))
        return x + y
