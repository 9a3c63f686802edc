"""The closed-form ``LayerWork`` as it was before the layer became operators (``layer_ops``).

Kept verbatim (less the helpers that did not change, imported from ``workload``) as the
reference ``tests/test_layer_ops.py`` checks the builder against: every field of
``workload.layer_work`` must equal ``closed_form_layer_work`` to 1e-12.
"""

from __future__ import annotations

import jax.numpy as jnp

from diffcost.arrays import ACT_BYTES, ModelArrays, PlanArrays
from diffcost.specs import PRECISIONS
from diffcost.workload import (
    Gemms,
    LayerWork,
    attention_shape,
    head_dim,
    lora_work,
    low_precision,
    param_counts,
    tokens,
)

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
# Bytes per element of a quantized GEMM input kept for backward: FP8 1, NVFP4 0.5 + a 1-byte
# scale per 16 elements.
_SAVED_FP8_BYTES = 1.0
_SAVED_FP4_BYTES = 0.5625


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


def closed_form_layer_work(model: ModelArrays, plan: PlanArrays) -> LayerWork:
    """The work of one layer on one GPU for one microbatch, every quantity computed once.

    Args:
        model, plan: array pytrees of one configuration (``diffcost.arrays``).

    Returns:
        A ``LayerWork``.
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


def layer_params_local(model: ModelArrays, plan: PlanArrays):
    """(dense, expert) parameters of one layer held by one GPU (tp- and ep-sharded)."""
    c = param_counts(model)
    dense = (c.attention + c.mlp_dense) / plan.tp + c.norms
    experts = c.mlp_experts / (plan.tp * plan.ep)
    return dense, experts


def _activation_bytes(model: ModelArrays, plan: PlanArrays, t, sp_t, routed):
    """Activation bytes one layer keeps for backward, per microbatch: [none, selective, full].

    Korthikanti et al. Table 2 generalized to GQA, SwiGLU and MoE: ``10 h`` per token split by
    SP (``8 h`` without dropout), attention ``2 h (1 + 2 kv/heads) + 2 h`` and MLP inner
    activations split by tp, scores ``5 a s`` per token split by tp (``2 a s`` without
    dropout; absent with fused attention, and under selective recompute). Full recompute keeps
    only each layer's input. For GPT (``f = 4 h``, ``kv = heads``, dropout) this is the paper's
    ``s b h (34 + 5 a s / h) / t`` with SP, ``34 s b h / t`` selective, ``2 s b h / t`` full.
    In FP8/FP4 the inputs of QKV, the attention projection, FC1 and FC2 are kept quantized
    (``g`` bytes), and without recompute the attention also keeps its 16-bit output.
    """
    h, f = model.hidden, model.ffn_hidden
    kv = model.kv_heads / model.heads
    fp8, fp4 = (model.precision[PRECISIONS.index(p)] for p in ("fp8", "fp4"))
    low = fp8 + fp4
    g = ACT_BYTES * (1.0 - low) + _SAVED_FP8_BYTES * fp8 + _SAVED_FP4_BYTES * fp4
    norms = (_SP_SPLIT_ACT_PER_H / 2.0) * sp_t * h  # the two 16-bit norm inputs
    split_sp = norms + 2.0 * g * sp_t * h + _DROPOUT_MASKS_PER_H * model.dropout * sp_t * h
    attn = t * (2.0 * h * (1.0 + 2.0 * kv) + g * h) / plan.tp
    mlp = routed * (ACT_BYTES * f * (1.0 + model.swiglu) + g * f) / plan.tp
    mlp = mlp + (routed - t) * g * h / plan.tp  # routed copies of the MLP input
    score_b = _SCORE_ACT_BYTES + _SCORE_DROPOUT_BYTES * model.dropout
    scores = score_b * model.heads / plan.tp * t * model.seq_len * (1.0 - model.flash)
    selective = split_sp + attn + mlp
    none = selective + scores + ACT_BYTES * low * t * h / plan.tp  # 16-bit attention output
    full = ACT_BYTES * sp_t * h
    return jnp.stack([none, selective, full])
