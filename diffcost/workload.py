"""The work of one transformer layer under a plan's sharding: FLOPs, bytes, activations.

Everything is per GPU and per microbatch unless a name says otherwise, and written for one
configuration (vmap at the call site). ``layer_work`` computes all of it once per (model, plan)
as a ``LayerWork`` pytree, which the time and memory models share. Shapes follow Megatron-LM's
sharding:

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

from diffcost.arrays import ACT_BYTES, ModelArrays, PlanArrays
from diffcost.params import ATTN_SHAPE_REF
from diffcost.specs import PRECISIONS

# Korthikanti et al.: bytes per token of activations that SP splits, in units of hidden: two
# norm inputs and the inputs of the QKV and FC1 GEMMs (2 B each), and the two 1-byte dropout
# masks, which exist only with dropout (PyTorch keeps no mask at p = 0).
_SP_SPLIT_ACT_PER_H = 8.0
_DROPOUT_MASKS_PER_H = 2.0
# Score-matrix activations per (head, query, key) without fused attention: softmax output (2 B),
# and with dropout its mask (1 B) and output (2 B).
_SCORE_ACT_BYTES = 2.0
_SCORE_DROPOUT_BYTES = 3.0
# HBM passes over the s x s scores in unfused attention (write scores, softmax read/write,
# dropout read/write, read for the value product).
_SCORE_PASSES = 6.0
# Elementwise HBM traffic per layer, forward, in tokens x hidden x bytes: two norms (read +
# write), two dropout+residual blocks (read two, write one, mask).
_ELEMENTWISE_PASSES_H = 2 * 2.0 + 2 * 4.0
# FP8/FP4 GEMMs (Transformer Engine) first cast each 16-bit input to the low precision and keep a
# transposed copy for the other backward GEMM: read 2 B, write the cast and its transpose, per
# element of the forward inputs and, in backward, of the output gradients. Weights are cast once
# per iteration (cached across microbatches) and are left out.
_CAST_BYTES_PER_ELEMENT = 2.0 + 1.0 + 1.0
LOW_PRECISIONS = ("fp8", "fp4")  # GEMM operand types narrower than 16 bits
_LOW = tuple(PRECISIONS.index(p) for p in LOW_PRECISIONS)
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
    trained_params: jax.Array  # dense parameters of one layer with gradients, on one GPU
    trained_expert_params: jax.Array  # expert parameters with gradients, on one GPU
    trained_embedding_params: jax.Array  # embedding (or untied head) parameters with gradients

    @property
    def forward_flops(self):
        """All forward FLOPs of the layer (GEMMs + attention core, model convention)."""
        return jnp.sum(self.gemms.flops) + self.attention_flops


def tokens(model: ModelArrays, plan: PlanArrays):
    """Tokens of one microbatch on one GPU before tensor-parallel splitting (``b * s / cp``)."""
    return plan.microbatch * model.seq_len / plan.cp


def head_dim(model: ModelArrays):
    """Width of one attention head."""
    return model.hidden / model.heads


def low_precision(model: ModelArrays):
    """1 when the layer GEMMs run in FP8/FP4 (0 in 16 or 32 bits, in between when relaxed)."""
    return sum(model.precision[i] for i in _LOW)


def _token_counts(model: ModelArrays, plan: PlanArrays):
    """(tokens, sp tokens, routed tokens) of one microbatch on one GPU (see ``LayerWork``).

    Sequence parallelism splits the norm, dropout and residual tokens by tp; an MoE MLP
    processes ``top_k * capacity_factor`` token-expert pairs per token.
    """
    t = tokens(model, plan)
    sp_t = t * (1.0 - plan.sp) + t / plan.tp * plan.sp
    routing = jnp.where(model.experts > 1.0, model.top_k * model.capacity_factor, 1.0)
    return t, sp_t, t * routing


def _gemms(model: ModelArrays, plan: PlanArrays, t, routed) -> Gemms:
    """QKV, attention output, FC1 (gate+up for SwiGLU), FC2 and the MoE router."""
    h, f, tp = model.hidden, model.ffn_hidden, plan.tp
    qkv_n = h * (1.0 + 2.0 * model.kv_heads / model.heads) / tp
    router_n = jnp.where(model.experts > 1.0, model.experts, 0.0)
    m = jnp.stack([t, t, routed, routed, t])
    n = jnp.stack([qkv_n, h, f * (1.0 + model.swiglu) / tp, h, router_n])
    k = jnp.stack([h, h / tp, h, f / tp, h])
    return Gemms(m=m, n=n, k=k)


def _attention_flops(model: ModelArrays, plan: PlanArrays, t):
    """Forward FLOPs of ``softmax(QK^T)V`` on one GPU, counting the full (non-causal) square.

    This is the model-FLOP convention (Narayanan et al.); fused causal kernels execute about
    half of it, which the kernel model accounts for.
    """
    heads_local = model.heads / plan.tp
    per_key = 4.0 * plan.microbatch * heads_local * (t / plan.microbatch)
    return per_key * model.seq_len * head_dim(model)


def attention_shape(seq_len, head_dim, parallel_heads, group):
    """Octaves of an attention kernel's shape from ``params.ATTN_SHAPE_REF``, in the order of
    ``params.ATTN_SHAPE_LEAVES`` (arrays broadcast; the result stacked on the last axis):
    sequence length per GPU, head dim, heads per GPU times the sequences of one kernel call,
    query heads per KV head. ``Params.attention_eff`` reads its efficiency from them."""
    values = jnp.broadcast_arrays(seq_len, head_dim, parallel_heads, group)
    refs = ATTN_SHAPE_REF.values()
    return jnp.stack([jnp.log2(v / ref) for v, ref in zip(values, refs)], axis=-1)


def _attention_bytes(model: ModelArrays, plan: PlanArrays, t):
    """HBM traffic of the attention core, forward: Q, K, V, O, plus the scores when unfused."""
    heads_local = model.heads / plan.tp
    qkvo = ACT_BYTES * t * head_dim(model) * (2.0 * heads_local + 2.0 * model.kv_heads / plan.tp)
    scores = _SCORE_PASSES * ACT_BYTES * heads_local * t * model.seq_len
    return qkvo + (1.0 - model.flash) * scores


def _elementwise_bytes(model: ModelArrays, plan: PlanArrays, sp_t, routed):
    """HBM traffic of norms, activation function, dropout and residuals in one layer forward."""
    act = (2.0 + model.swiglu) * routed * model.ffn_hidden / plan.tp
    return ACT_BYTES * (_ELEMENTWISE_PASSES_H * sp_t * model.hidden + act)


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
    t, sp_t, routed = _token_counts(model, plan)
    low = low_precision(model)
    gemms = _gemms(model, plan, t, routed)
    cast_fwd, cast_bwd = _cast_bytes(low, gemms)
    dense, experts = layer_params_local(model, plan)
    embedding = model.vocab * model.hidden / plan.tp
    return LayerWork(
        tokens=t,
        sp_tokens=sp_t,
        head_tokens=t * model.head_tokens,
        routed_tokens=routed,
        vocab_local=model.vocab / plan.tp,
        low_precision=low,
        gemms=gemms,
        attention_flops=_attention_flops(model, plan, t),
        attention_bytes=_attention_bytes(model, plan, t),
        attention_shape=attention_shape(
            model.seq_len / plan.cp,
            head_dim(model),
            plan.microbatch * model.heads / plan.tp,
            model.heads / model.kv_heads,
        ),
        elementwise_bytes=_elementwise_bytes(model, plan, sp_t, routed),
        cast_fwd_bytes=cast_fwd,
        cast_bwd_bytes=cast_bwd,
        dense_params=dense,
        expert_params=experts,
        embedding_params=embedding,
        activation_bytes=_activation_bytes(model, plan, t, sp_t, routed),
        tp_msg_bytes=t * model.hidden * ACT_BYTES,
        kv_msg_bytes=2.0 * t * plan.cp * model.kv_heads * head_dim(model) / plan.tp * ACT_BYTES,
        ep_msg_bytes=routed * model.hidden * ACT_BYTES,
        p2p_msg_bytes=sp_t * model.hidden * ACT_BYTES,
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
        "trained_params": dense * (1.0 - on) + adapter_params * on,
        "trained_expert_params": experts * (1.0 - on),
        "trained_embedding_params": embedding * (1.0 - on),
    }


def layer_forward_flops(model: ModelArrays, plan: PlanArrays):
    """All forward FLOPs of one layer on one GPU (GEMMs + attention core, model convention)."""
    t, _, routed = _token_counts(model, plan)
    gemms = _gemms(model, plan, t, routed)
    return jnp.sum(gemms.flops) + _attention_flops(model, plan, t)


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
    c = param_counts(model)
    dense = (c.attention + c.mlp_dense) / plan.tp + c.norms
    experts = c.mlp_experts / (plan.tp * plan.ep)
    return dense, experts


# --- activations ------------------------------------------------------------------------------


def layer_activation_bytes(model: ModelArrays, plan: PlanArrays):
    """Activation bytes one layer keeps for backward, per microbatch: [none, selective, full].

    ``layer_work(model, plan).activation_bytes``, for callers that need nothing else.
    """
    return _activation_bytes(model, plan, *_token_counts(model, plan))


def _activation_bytes(model: ModelArrays, plan: PlanArrays, t, sp_t, routed):
    """Activation bytes one layer keeps for backward, per microbatch: [none, selective, full].

    Korthikanti et al. Table 2 generalized to GQA, SwiGLU and MoE: ``10 h`` per token split by
    SP (``8 h`` without dropout), attention ``2 h (1 + 2 kv/heads) + 2 h`` and MLP inner
    activations split by tp, scores ``5 a s`` per token split by tp (``2 a s`` without
    dropout; absent with fused attention, and under selective recompute). Full recompute keeps
    only each layer's input. For GPT (``f = 4 h``, ``kv = heads``, dropout) this is the paper's
    ``s b h (34 + 5 a s / h) / t`` with SP, ``34 s b h / t`` selective, ``2 s b h / t`` full.
    """
    h, f = model.hidden, model.ffn_hidden
    kv = model.kv_heads / model.heads
    split_sp = (_SP_SPLIT_ACT_PER_H + _DROPOUT_MASKS_PER_H * model.dropout) * sp_t * h
    attn = t * (2.0 * h * (1.0 + 2.0 * kv) + 2.0 * h) / plan.tp
    mlp = routed * (ACT_BYTES * f * (1.0 + model.swiglu) + ACT_BYTES * f) / plan.tp
    mlp = mlp + (routed - t) * ACT_BYTES * h / plan.tp  # routed copies of the MLP input
    score_b = _SCORE_ACT_BYTES + _SCORE_DROPOUT_BYTES * model.dropout
    scores = score_b * model.heads / plan.tp * t * model.seq_len * (1.0 - model.flash)
    selective = split_sp + attn + mlp
    none = selective + scores
    full = ACT_BYTES * sp_t * h
    return jnp.stack([none, selective, full])
