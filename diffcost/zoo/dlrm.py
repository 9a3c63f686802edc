"""DLRM in flax.linen: bottom MLP, embedding bags, feature interaction, top MLP.

``MLPERF_DLRM_DCNV2`` holds the dimensions of MLPerf Training's DLRM-DCNv2 reference
(mlcommons/training ``recommendation_v2/torchrec_dlrm``: 13 dense features, bottom MLP
512-256-128, 26 embedding tables of dimension 128 with the listed rows, multi-hot lookups with
the listed pooling factors summed per table, a low-rank DCNv2 cross network of 3 layers with
rank 512 over the concatenated features, top MLP 1024-1024-512-256-1). ``interaction="dot"``
is the original DLRM's pairwise dot products (Naumov et al. 2019).

Under ``jax.vjp`` an embedding table's gradient is a dense array of the table's shape (a
scatter-add of the looked-up rows into zeros), which is what JAX executes; frameworks with
sparse embedding gradients (TorchRec's fused optimizer) do less.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax.numpy as jnp

MLPERF_DLRM_DCNV2 = {
    "dense_features": 13,
    "bottom": (512, 256, 128),
    "top": (1024, 1024, 512, 256, 1),
    "embedding_dim": 128,
    "rows": (
        40000000,
        39060,
        17295,
        7424,
        20265,
        3,
        7122,
        1543,
        63,
        40000000,
        3067956,
        405282,
        10,
        2209,
        11938,
        155,
        4,
        976,
        14,
        40000000,
        40000000,
        40000000,
        590152,
        12973,
        108,
        36,
    ),  # fmt: skip
    "pooling": (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1),
    "dcn_layers": 3,
    "dcn_rank": 512,
}


class EmbeddingBag(nn.Module):
    """Sum of the looked-up rows per sample: ``[batch, pooling]`` ids to ``[batch, dim]``."""

    rows: int
    dim: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, ids):
        init = nn.initializers.normal(0.01)
        table = self.param("table", init, (self.rows, self.dim), self.dtype)
        return jnp.sum(jnp.take(table, ids, axis=0), axis=1)


class LowRankCross(nn.Module):
    """DCNv2 cross layers ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l`` with rank-``rank``
    factors (Wang et al. 2021)."""

    layers: int
    rank: int

    @nn.compact
    def __call__(self, x0):
        x = x0
        for _ in range(self.layers):
            x = x0 * nn.Dense(x0.shape[-1])(nn.Dense(self.rank, use_bias=False)(x)) + x
        return x


class DLRM(nn.Module):
    bottom: Sequence[int]
    top: Sequence[int]
    rows: Sequence[int]
    embedding_dim: int
    interaction: str = "dcn"
    dcn_layers: int = 3
    dcn_rank: int = 512

    @nn.compact
    def __call__(self, dense, sparse):
        x = dense
        for f in self.bottom:
            x = nn.relu(nn.Dense(f)(x))
        bags = [EmbeddingBag(r, self.embedding_dim)(ids) for r, ids in zip(self.rows, sparse)]
        if self.interaction == "dot":
            z = jnp.stack([x, *bags], axis=1)  # [batch, features, dim]
            pairs = jnp.einsum("bfd,bgd->bfg", z, z)
            i, j = jnp.triu_indices(z.shape[1], k=1)
            y = jnp.concatenate([x, pairs[:, i, j]], axis=1)
        else:
            y = LowRankCross(self.dcn_layers, self.dcn_rank)(jnp.concatenate([x, *bags], axis=1))
        for f in self.top[:-1]:
            y = nn.relu(nn.Dense(f)(y))
        return nn.Dense(self.top[-1])(y)
