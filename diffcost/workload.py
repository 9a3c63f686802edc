"""The work of one transformer layer under a plan's sharding: FLOPs, bytes, activations.

Everything is per GPU and per microbatch unless a name says otherwise, and written for one
configuration (vmap at the call site). ``layer_work`` computes all of it once per (model, plan)
as a ``LayerWork`` pytree, which the time and memory models share: it builds the layer's
operators (``diffcost.layer_ops``: GEMMs, attention core, memory-bound operators, each with its
shape, FLOPs, bytes, saved activations and parameters) and sums them per kernel class. Shapes
follow Megatron-LM's sharding:

* tensor parallel (``tp``) splits attention heads and MLP columns/rows;
* sequence parallel (``sp``, inside the tp group) splits the sequence for norms, dropout and
  residuals;
* context parallel (``cp``) splits the sequence for everything, attention exchanging K/V;
* expert parallel (``ep``) splits the experts of an MoE feed-forward.

References:
    Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM" (SC'21), FLOP count (their eq. 3); Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models" (MLSys'23), activation memory (their Table 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from diffcost import layer_ops
from diffcost.arrays import ModelArrays, PlanArrays
from diffcost.layer_ops import (  # noqa: F401  (re-exported: the workload's shape helpers)
    LOW_PRECISIONS,
    LayerOps,
    attention_shape,
    head_dim,
    low_precision,
    tokens,
)

# FP8/FP4 GEMMs (Transformer Engine) first cast each 16-bit input to the low precision and keep a
# transposed copy for the other backward GEMM: read 2 B, write the cast and its transpose, per
# element of the forward inputs and, in backward, of the output gradients. Weights are cast once
# per iteration (cached across microbatches) and are left out.
_CAST_BYTES_PER_ELEMENT = 2.0 + 1.0 + 1.0
# Kernels launched by one layer's forward (norms, GEMMs, attention, activation, residuals).
KERNELS_PER_LAYER_FWD = 12.0
# Framework ops the host dispatches for one layer's forward in eager PyTorch (Megatron's GPT
# layer: norms, linears, bias adds, views and copies, softmax, dropout and its RNG tracker,
# residual adds). Backward dispatches about twice as many.
HOST_OPS_PER_LAYER_FWD = 50.0


@struct.dataclass
class Gemms:
    """GEMMs of one layer's forward on one GPU: arrays of shape [n_gemms] (M x K) @ (K x N)."""

    m: jax.Array
    n: jax.Array
    k: jax.Array

    @property
    def flops(self):
        return 2.0 * self.m * self.n * self.k


@struct.dataclass
class LayerWork:
    """What one transformer layer does on one GPU for one microbatch under a plan's sharding.

    Computed once per (model, plan) by ``layer_work`` and shared by the time model
    (``diffcost.simulate``) and the memory model. Scalars unless a shape is given; token counts
    in tokens, sizes in bytes, work in FLOPs.
    """

    tokens: jax.Array  # tokens of the microbatch on one GPU before tp splitting (b s / cp)
    sp_tokens: jax.Array  # tokens seen by norms, dropout and residuals (split by tp under SP)
    head_tokens: jax.Array  # tokens the LM head and loss run on (``ModelSpec.head_tokens``)
    routed_tokens: jax.Array  # token-expert pairs through one GPU's MLP (dense: the tokens)
    vocab_local: jax.Array  # LM head columns on one GPU (vocab-parallel over tp)
    low_precision: jax.Array  # 1 when the layer GEMMs run in FP8/FP4 (``low_precision``)
    gemms: Gemms  # [5] QKV, attention output, FC1 (gate+up for SwiGLU), FC2, MoE router
    attention_flops: jax.Array  # forward of softmax(QK^T)V, the full square (model FLOPs)
    attention_bytes: jax.Array  # forward HBM traffic of the attention core
    attention_shape: jax.Array  # [4] octaves of the attention kernel's shape (attention_shape)
    elementwise_bytes: jax.Array  # forward HBM traffic of norms, activation, dropout, residuals
    cast_fwd_bytes: jax.Array  # FP8/FP4 input casts in forward; 0 in 16 bits
    cast_bwd_bytes: jax.Array  # FP8/FP4 output-gradient casts in backward; 0 in 16 bits
    dense_params: jax.Array  # parameters held by one GPU, tp-sharded
    expert_params: jax.Array  # expert parameters held by one GPU, tp- and ep-sharded
    embedding_params: jax.Array  # embedding (or untied LM head) parameters on one GPU
    activation_bytes: jax.Array  # [3] kept for backward, recompute none / selective / full
    tp_msg_bytes: jax.Array  # one tensor-parallel collective: tokens x hidden, 16-bit
    kv_msg_bytes: jax.Array  # K and V of every cp rank's tokens, gathered over cp
    ep_msg_bytes: jax.Array  # one expert all-to-all: routed tokens x hidden, 16-bit
    p2p_msg_bytes: jax.Array  # one activation send between pipeline stages
    # LoRA fine-tuning (``lora_work``): 0 and the plain counts without it
    lora: jax.Array  # 1 when the base weights are frozen: their weight-gradient GEMMs are skipped
    adapter_gemms: Gemms  # [8] adapters' down (x A) and up (x B) GEMMs, zero-size off target
    adapter_ranks: jax.Array  # [4] adapter rank on QKV, attention output, FC1, FC2 (0: none)
    trained_params: jax.Array  # dense parameters of one layer with gradients, on one GPU
    trained_expert_params: jax.Array  # expert parameters with gradients, on one GPU
    trained_embedding_params: jax.Array  # embedding (or untied head) parameters with gradients

    @property
    def forward_flops(self):
        """All forward FLOPs of the layer (GEMMs + attention core, model convention)."""
        return jnp.sum(self.gemms.flops) + self.attention_flops


def _cast_bytes(low, g: Gemms):
    """HBM traffic of FP8/FP4 input casts in one layer: (forward, backward); 0 in 16 bits.

    Covers the QKV, attention output, FC1 and FC2 GEMMs; the MoE router (the last GEMM) stays
    in 16 bits.
    """
    fwd = jnp.sum(g.m[:4] * g.k[:4])  # inputs (m x k)
    bwd = jnp.sum(g.m[:4] * g.n[:4])  # output gradients (m x n)
    return low * _CAST_BYTES_PER_ELEMENT * fwd, low * _CAST_BYTES_PER_ELEMENT * bwd


def layer_work(model: ModelArrays, plan: PlanArrays) -> LayerWork:
    """The work of one layer on one GPU for one microbatch, every quantity computed once.

    Builds the layer's operators (``layer_ops.layer_ops``) and sums them per kernel class:
    the GEMM shapes, the attention core, the memory-bound traffic, the activations kept per
    recompute mode and the parameters held.

    Args:
        model, plan: array pytrees of one configuration (``diffcost.arrays``).

    Returns:
        A ``LayerWork``.

    Examples:
        >>> from diffcost import api
        >>> exp = api.load("configs/examples/gpt3-175b.yaml")
        >>> model, plan, _ = api.experiment_arrays(exp)
        >>> work = layer_work(model, plan)
        >>> float(work.tokens) == float(plan.microbatch * model.seq_len / plan.cp)
        True
    """
    return work_of(layer_ops.layer_ops(model, plan), model, plan)


def work_of(ops: LayerOps, model: ModelArrays, plan: PlanArrays) -> LayerWork:
    """The ``LayerWork`` of a layer's operators (of one configuration: no batch axis)."""
    gemms = Gemms(*(ops.of(f, layer_ops.GEMM_OPS) for f in ("m", "n", "k")))
    cast_fwd, cast_bwd = _cast_bytes(ops.low_precision, gemms)
    dense, experts = layer_ops.local_params(ops, model, plan)
    embedding = model.vocab * model.hidden / plan.tp
    tp_msg, kv_msg, ep_msg, p2p_msg = (ops.messages[i] for i in range(len(layer_ops.MESSAGES)))
    return LayerWork(
        tokens=ops.tokens,
        sp_tokens=ops.sp_tokens,
        head_tokens=ops.tokens * model.head_tokens,
        routed_tokens=ops.routed_tokens,
        vocab_local=model.vocab / plan.tp,
        low_precision=ops.low_precision,
        gemms=gemms,
        attention_flops=ops.total("flops", "attention"),
        attention_bytes=ops.total("hbm_bytes", "attention"),
        attention_shape=ops.attention_shape,
        elementwise_bytes=ops.total("hbm_bytes", "memory"),
        cast_fwd_bytes=cast_fwd,
        cast_bwd_bytes=cast_bwd,
        dense_params=dense,
        expert_params=experts,
        embedding_params=embedding,
        activation_bytes=ops.total("saved_bytes"),
        tp_msg_bytes=tp_msg,
        kv_msg_bytes=kv_msg,
        ep_msg_bytes=ep_msg,
        p2p_msg_bytes=p2p_msg,
        **lora_work(plan, gemms, dense, experts, embedding),
    )


def lora_work(plan: PlanArrays, gemms: Gemms, dense, experts, embedding) -> dict:
    """The ``LayerWork`` fields of LoRA fine-tuning (Hu et al., "LoRA", ICLR 2022).

    Each targeted GEMM ``(m x k) @ (k x n)`` (QKV, attention output, FC1, FC2; local shapes
    under tp) gains an adapter ``x A B`` with ``A`` of ``k x r`` and ``B`` of ``r x n``: two
    GEMMs ``(m, r, k)`` and ``(m, n, r)`` and ``r (k + n)`` trained parameters on the GPU. The
    base weights, norms, embedding and head are frozen: no gradients or optimizer state. Off
    (``plan.lora`` = 0) the trained counts are the parameter counts themselves.
    """
    on, r, mask = plan.lora, plan.lora_rank, plan.lora_targets
    m, n, k = gemms.m[:4] * mask, gemms.n[:4], gemms.k[:4]
    rank = r * mask
    adapters = Gemms(
        m=jnp.concatenate([m, m]),
        n=jnp.concatenate([rank, n * mask]),
        k=jnp.concatenate([k * mask, rank]),
    )
    adapter_params = jnp.sum(rank * (k + n))
    return {
        "lora": on,
        "adapter_gemms": adapters,
        "adapter_ranks": rank,
        "trained_params": dense * (1.0 - on) + adapter_params * on,
        "trained_expert_params": experts * (1.0 - on),
        "trained_embedding_params": embedding * (1.0 - on),
    }


def layer_forward_flops(model: ModelArrays, plan: PlanArrays):
    """All forward FLOPs of one layer on one GPU (GEMMs + attention core, model convention)."""
    return layer_ops.layer_ops(model, plan).forward_flops


def head_forward_flops(model: ModelArrays, plan: PlanArrays):
    """LM head (vocab-parallel over tp) forward FLOPs on one GPU, over the tokens it runs on
    (``ModelSpec.head_tokens``)."""
    return 2.0 * tokens(model, plan) * model.hidden * model.vocab / plan.tp * model.head_tokens


def model_flops_per_iteration(model: ModelArrays, plan: PlanArrays):
    """Model FLOPs of one iteration over all GPUs: 3x forward (no recompute), full attention;
    2x forward under LoRA (frozen weights have no weight gradients; the adapters' FLOPs, under
    1% at rank 16, are left out)."""
    full = plan.replace(tp=1.0, cp=1.0, microbatch=1.0, sp=0.0)
    per_sample = model.n_layers * layer_forward_flops(model, full) + head_forward_flops(model, full)
    return (2.0 + (1.0 - plan.lora)) * per_sample * plan.global_batch


# --- parameters -------------------------------------------------------------------------------


@struct.dataclass
class ParamCounts:
    """Parameters of the whole model by kind (not sharded)."""

    attention: object  # per layer
    mlp_dense: object  # per layer; 0 for MoE models
    mlp_experts: object  # per layer, all experts; 0 for dense models
    norms: object  # per layer
    embedding: object
    head: object  # 0 when tied (shares the embedding)

    @property
    def per_layer(self):
        return self.attention + self.mlp_dense + self.mlp_experts + self.norms

    def total(self, n_layers):
        return n_layers * self.per_layer + self.embedding + self.head


def param_counts(model: ModelArrays) -> ParamCounts:
    """Parameters of the whole model by kind: attention, MLP (dense or experts), norms, embeddings.

    Args:
        model: array pytree of one model.

    Returns:
        A ``ParamCounts`` of unsharded counts.
    """
    h, f = model.hidden, model.ffn_hidden
    kv = model.kv_heads / model.heads
    attention = h * h * (2.0 + 2.0 * kv) + model.bias * h * (2.0 + 2.0 * kv)
    one_mlp = (2.0 + model.swiglu) * h * f + model.bias * (f + h)
    moe = model.experts > 1.0
    return ParamCounts(
        attention=attention,
        mlp_dense=jnp.where(moe, 0.0, one_mlp),
        mlp_experts=jnp.where(moe, model.experts * one_mlp + h * model.experts, 0.0),
        norms=2.0 * h * (1.0 + model.bias),
        embedding=model.vocab * h,
        head=(1.0 - model.tied) * model.vocab * h,
    )


def layer_params_local(model: ModelArrays, plan: PlanArrays):
    """(dense, expert) parameters of one layer held by one GPU (tp- and ep-sharded)."""
    return layer_ops.local_params(layer_ops.layer_ops(model, plan), model, plan)


# --- activations ------------------------------------------------------------------------------


def layer_activation_bytes(model: ModelArrays, plan: PlanArrays):
    """Activation bytes one layer keeps for backward, per microbatch: [none, selective, full]
    (``layer_ops.LayerOps.saved_bytes`` summed over the operators)."""
    return layer_ops.layer_ops(model, plan).total("saved_bytes")
