"""The work of one transformer layer under a plan's sharding: FLOPs, bytes, activations.

Everything is per GPU and per microbatch unless a name says otherwise, and written for one
configuration (vmap at the call site). Shapes follow Megatron-LM's sharding:

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

import jax.numpy as jnp
from flax import struct

from diffcost.arrays import ACT_BYTES, ModelArrays, PlanArrays
from diffcost.specs import PRECISIONS

# Korthikanti et al.: bytes per token of activations that SP splits (two norm inputs, two
# dropout masks, the inputs of the QKV and FC1 GEMMs), in units of hidden.
_SP_SPLIT_ACT_PER_H = 10.0
# Score-matrix activations per (head, query, key) without fused attention: softmax output (2 B),
# dropout mask (1 B), dropout output (2 B).
_SCORE_ACT_BYTES = 5.0
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

    m: object
    n: object
    k: object

    @property
    def flops(self):
        return 2.0 * self.m * self.n * self.k


def tokens(model: ModelArrays, plan: PlanArrays):
    """Tokens of one microbatch on one GPU before tensor-parallel splitting (``b * s / cp``)."""
    return plan.microbatch * model.seq_len / plan.cp


def sp_tokens(model, plan):
    """Tokens seen by norms, dropout and residuals: further split by tp when SP is on."""
    t = tokens(model, plan)
    return t * (1.0 - plan.sp) + t / plan.tp * plan.sp


def head_dim(model):
    return model.hidden / model.heads


def routed_tokens(model, plan):
    """Token-expert pairs processed by one GPU's MLP (dense: the tokens themselves)."""
    moe = model.experts > 1.0
    factor = jnp.where(moe, model.top_k * model.capacity_factor, 1.0)
    return tokens(model, plan) * factor


def layer_gemms(model: ModelArrays, plan: PlanArrays) -> Gemms:
    """QKV, attention output, FC1 (gate+up for SwiGLU), FC2 and the MoE router."""
    t = tokens(model, plan)
    tr = routed_tokens(model, plan)
    h, f, tp = model.hidden, model.ffn_hidden, plan.tp
    qkv_n = h * (1.0 + 2.0 * model.kv_heads / model.heads) / tp
    router_n = jnp.where(model.experts > 1.0, model.experts, 0.0)
    m = jnp.stack([t, t, tr, tr, t])
    n = jnp.stack([qkv_n, h, f * (1.0 + model.swiglu) / tp, h, router_n])
    k = jnp.stack([h, h / tp, h, f / tp, h])
    return Gemms(m=m, n=n, k=k)


def attention_flops(model: ModelArrays, plan: PlanArrays):
    """Forward FLOPs of ``softmax(QK^T)V`` on one GPU, counting the full (non-causal) square.

    This is the model-FLOP convention (Narayanan et al.); fused causal kernels execute about
    half of it, which the kernel model accounts for.
    """
    heads_local = model.heads / plan.tp
    q = tokens(model, plan)
    return (
        4.0
        * plan.microbatch
        * heads_local
        * (q / plan.microbatch)
        * model.seq_len
        * (head_dim(model))
    )


def attention_bytes(model: ModelArrays, plan: PlanArrays):
    """HBM traffic of the attention core, forward: Q, K, V, O, plus the scores when unfused."""
    heads_local = model.heads / plan.tp
    q = tokens(model, plan)
    qkvo = ACT_BYTES * q * head_dim(model) * (2.0 * heads_local + 2.0 * model.kv_heads / plan.tp)
    scores = _SCORE_PASSES * ACT_BYTES * heads_local * q * model.seq_len
    return qkvo + (1.0 - model.flash) * scores


def elementwise_bytes(model: ModelArrays, plan: PlanArrays):
    """HBM traffic of norms, activation function, dropout and residuals in one layer forward."""
    ts = sp_tokens(model, plan)
    tr = routed_tokens(model, plan)
    act = (2.0 + model.swiglu) * tr * model.ffn_hidden / plan.tp
    return ACT_BYTES * (_ELEMENTWISE_PASSES_H * ts * model.hidden + act)


def low_precision(model: ModelArrays):
    """1 when the layer GEMMs run in FP8/FP4 (0 in 16 or 32 bits, in between when relaxed)."""
    return sum(model.precision[i] for i in _LOW)


def cast_bytes(model: ModelArrays, g: Gemms):
    """HBM traffic of FP8/FP4 input casts in one layer: (forward, backward); 0 in 16 bits.

    ``g`` is ``layer_gemms(model, plan)``. Covers the QKV, attention output, FC1 and FC2 GEMMs;
    the MoE router (the last GEMM) stays in 16 bits.
    """
    low = low_precision(model)
    fwd = jnp.sum(g.m[:4] * g.k[:4])  # inputs (m x k)
    bwd = jnp.sum(g.m[:4] * g.n[:4])  # output gradients (m x n)
    return low * _CAST_BYTES_PER_ELEMENT * fwd, low * _CAST_BYTES_PER_ELEMENT * bwd


def layer_forward_flops(model: ModelArrays, plan: PlanArrays):
    """All forward FLOPs of one layer on one GPU (GEMMs + attention core, model convention)."""
    return jnp.sum(layer_gemms(model, plan).flops) + attention_flops(model, plan)


def head_forward_flops(model: ModelArrays, plan: PlanArrays):
    """LM head (vocab-parallel over tp) forward FLOPs on one GPU."""
    return 2.0 * tokens(model, plan) * model.hidden * model.vocab / plan.tp


def model_flops_per_iteration(model: ModelArrays, plan: PlanArrays):
    """Model FLOPs of one iteration over all GPUs: 3x forward (no recompute), full attention."""
    full = plan.replace(tp=1.0, cp=1.0, microbatch=1.0, sp=0.0)
    per_sample = model.n_layers * layer_forward_flops(model, full) + head_forward_flops(model, full)
    return 3.0 * per_sample * plan.global_batch


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

    Korthikanti et al. Table 2 generalized to GQA, SwiGLU and MoE: ``10 h`` per token split by
    SP, attention ``2 h (1 + 2 kv/heads) + 2 h`` and MLP inner activations split by tp, scores
    ``5 a s`` per token split by tp (absent with fused attention, and under selective
    recompute). Full recompute keeps only each layer's input.
    """
    t = tokens(model, plan)
    ts = sp_tokens(model, plan)
    tr = routed_tokens(model, plan)
    h, f = model.hidden, model.ffn_hidden
    kv = model.kv_heads / model.heads
    split_sp = _SP_SPLIT_ACT_PER_H * ts * h
    attn = t * (2.0 * h * (1.0 + 2.0 * kv) + 2.0 * h) / plan.tp
    mlp = tr * (ACT_BYTES * f * (1.0 + model.swiglu) + ACT_BYTES * f) / plan.tp
    mlp = mlp + (tr - t) * ACT_BYTES * h / plan.tp  # routed copies of the MLP input
    scores = _SCORE_ACT_BYTES * model.heads / plan.tp * t * model.seq_len * (1.0 - model.flash)
    selective = split_sp + attn + mlp
    none = selective + scores
    full = ACT_BYTES * ts * h
    return jnp.stack([none, selective, full])
