"""The operators of one transformer layer under a plan's sharding: the builder ``LayerWork`` sums.

One layer's forward is eleven operators, in order (``OPS``): the attention block's norm, QKV
projection, attention core, output projection and dropout + residual; the MLP block's norm, MoE
router, FC1 (gate and up for SwiGLU), activation function, FC2 and dropout + residual. Each maps
to one kernel class (``KERNEL_CLASS``): a GEMM, the attention core, or memory-bound. For every
operator the builder gives, per GPU and per microbatch, its GEMM shape ``(m, n, k)`` (zero off
GEMMs), FLOPs, forward HBM bytes (attention and memory-bound operators; a GEMM's traffic follows
from its shape in the GEMM model), the activation bytes it keeps for backward under each
recompute mode, and the parameters of its weights (unsharded; ``local_params`` shards them).
The collectives the layer's sharding implies are given by their message sizes (``MESSAGES``).

Every numeric field is an array stacked over the operators (a struct of arrays), computed from
``ModelArrays`` and ``PlanArrays`` with jax.numpy, so the plan's degrees may be traced and
relaxed: the builder runs inside the jitted, vmapped and differentiated model. The operator
names and kernel classes are static. ``workload.layer_work`` sums the operators per kernel
class into the ``LayerWork`` the time and memory models read.

Shapes follow Megatron-LM's sharding: tensor parallel (``tp``) splits heads and MLP
columns/rows; sequence parallel (``sp``) splits the tokens of norms, dropout and residuals
inside the tp group; context parallel (``cp``) splits the sequence, attention exchanging K/V;
expert parallel (``ep``) splits the experts.

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

KERNEL_CLASS = {
    "norm_attn": "memory",
    "qkv": "gemm",
    "attention": "attention",
    "attn_out": "gemm",
    "residual_attn": "memory",
    "norm_mlp": "memory",
    "router": "gemm",
    "fc1": "gemm",
    "activation": "memory",
    "fc2": "gemm",
    "residual_mlp": "memory",
}
OPS = tuple(KERNEL_CLASS)
KERNEL_CLASSES = ("gemm", "attention", "memory")
# The GEMMs in ``LayerWork.gemms`` order; the first four carry FP8/FP4 casts and LoRA adapters
# (the router stays in 16 bits and is never adapted).
GEMM_OPS = ("qkv", "attn_out", "fc1", "fc2", "router")
# Collectives of one layer, by message: the tensor-parallel all-reduce (or all-gather /
# reduce-scatter under SP) of tokens x hidden, the context-parallel K/V all-gather, the expert
# all-to-all of routed tokens, the activation send between pipeline stages.
MESSAGES = ("tp", "kv", "ep", "p2p")
RECOMPUTE_MODES = ("none", "selective", "full")

# Korthikanti et al.: every token keeps, split by SP, the inputs of the two norms and of the QKV
# and FC1 GEMMs (2 B each) and, with dropout, the two 1-byte dropout masks (PyTorch keeps no mask
# at p = 0).
_DROPOUT_MASK_BYTES = 1.0
# Score-matrix activations per (head, query, key) without fused attention: softmax output (2 B),
# and with dropout its mask (1 B) and output (2 B).
_SCORE_ACT_BYTES = 2.0
_SCORE_DROPOUT_BYTES = 3.0
# HBM passes over the s x s scores in unfused attention (write scores, softmax read/write,
# dropout read/write, read for the value product).
_SCORE_PASSES = 6.0
# Forward HBM passes over tokens x hidden: a norm reads and writes; dropout + residual reads
# two, writes one and the mask.
_NORM_PASSES = 2.0
_RESIDUAL_PASSES = 4.0
LOW_PRECISIONS = ("fp8", "fp4")  # GEMM operand types narrower than 16 bits
_LOW = tuple(PRECISIONS.index(p) for p in LOW_PRECISIONS)
# Bytes per element of a GEMM input that Transformer Engine saves for the backward in its
# quantized form (the input of a low-precision Linear, or the norm output of a LayerNormLinear):
# FP8 1 byte (MXFP8 adds one 1-byte scale per 32 elements, left out); NVFP4 half a byte plus
# one FP8 scale per 16 elements. transformer_engine/pytorch/module/linear.py (``saved_inputmat``)
# and layernorm_linear.py (``ln_out``) keep the quantized tensor, with only the usage the wgrad
# GEMM needs; the bf16 tensors the layer saves besides stay 2 bytes.
_QUANTIZED_INPUT_BYTES = {"fp8": 1.0, "fp4": 0.5 + 1.0 / 16.0}


@struct.dataclass
class LayerOps:
    """The operators of one transformer layer on one GPU for one microbatch (``OPS`` order).

    ``[n_ops]`` arrays unless a shape is given, the operators on the last axis (and a leading
    batch axis under vmap); token counts in tokens, sizes in bytes, work in FLOPs.
    """

    m: jax.Array  # GEMM rows (tokens or routed token-expert pairs); 0 off GEMMs
    n: jax.Array  # GEMM columns (local output features); 0 off GEMMs
    k: jax.Array  # GEMM reduction (local input features); 0 off GEMMs
    flops: jax.Array  # forward FLOPs: 2 m n k, the full attention square; 0 memory-bound
    hbm_bytes: jax.Array  # forward HBM traffic of attention and memory-bound operators
    saved_bytes: jax.Array  # [3, n_ops] kept for backward, recompute none / selective / full
    params: jax.Array  # parameters of the operator's weights, unsharded (FC1, FC2: one expert's)
    messages: jax.Array  # [4] bytes of one collective of each of ``MESSAGES``
    tokens: jax.Array  # tokens of the microbatch on one GPU before tp splitting (b s / cp)
    sp_tokens: jax.Array  # tokens seen by norms, dropout and residuals (split by tp under SP)
    routed_tokens: jax.Array  # token-expert pairs through one GPU's MLP (dense: the tokens)
    low_precision: jax.Array  # 1 when the layer GEMMs run in FP8/FP4
    attention_shape: jax.Array  # [4] octaves of the attention kernel's shape

    def of(self, field: str, names) -> jax.Array:
        """``field`` (``[n_ops]``) of the operators ``names`` (``OPS`` entries), stacked. Like
        ``total``, for the operators of one configuration (no batch axis)."""
        values = getattr(self, field)
        return jnp.stack([values[OPS.index(x)] for x in names])

    def total(self, field: str, kernel_class: str | None = None) -> jax.Array:
        """Sum of ``field`` over the operators of ``kernel_class`` (None: all), added in
        ``OPS`` order."""
        if kernel_class is not None and kernel_class not in KERNEL_CLASSES:
            raise ValueError(f"LayerOps.total: class {kernel_class!r}; valid: {KERNEL_CLASSES}")
        picked = [i for i, x in enumerate(OPS) if kernel_class in (None, KERNEL_CLASS[x])]

        def added(values):  # row by row, so that XLA folds every slice into its operand
            if values.ndim > 1:
                return jnp.stack([added(row) for row in values])
            out = values[picked[0]]
            for i in picked[1:]:
                out = out + values[i]
            return out

        return added(getattr(self, field))

    @property
    def forward_flops(self):
        """All forward FLOPs of the layer (GEMMs + attention core, model convention)."""
        return self.total("flops")


def tokens(model: ModelArrays, plan: PlanArrays):
    """Tokens of one microbatch on one GPU before tensor-parallel splitting (``b * s / cp``)."""
    return plan.microbatch * model.seq_len / plan.cp


def head_dim(model: ModelArrays):
    """Width of one attention head."""
    return model.hidden / model.heads


def low_precision(model: ModelArrays):
    """1 when the layer GEMMs run in FP8/FP4 (0 in 16 or 32 bits, in between when relaxed)."""
    return sum(model.precision[i] for i in _LOW)


def quantized_input_bytes(model: ModelArrays):
    """Bytes per element of a low-precision GEMM's saved input (``_QUANTIZED_INPUT_BYTES``
    weighted by the precision; 0 in 16 or 32 bits)."""
    table = _QUANTIZED_INPUT_BYTES.items()
    return sum(model.precision[PRECISIONS.index(p)] * b for p, b in table)


def attention_shape(seq_len, head_dim, parallel_heads, group):
    """Octaves of an attention kernel's shape from ``params.ATTN_SHAPE_REF``, in the order of
    ``params.ATTN_SHAPE_LEAVES`` (arrays broadcast; the result stacked on the last axis):
    sequence length per GPU, head dim, heads per GPU times the sequences of one kernel call,
    query heads per KV head. ``Params.attention_eff`` reads its efficiency from them."""
    values = jnp.broadcast_arrays(seq_len, head_dim, parallel_heads, group)
    refs = ATTN_SHAPE_REF.values()
    return jnp.stack([jnp.log2(v / ref) for v, ref in zip(values, refs)], axis=-1)


def token_counts(model: ModelArrays, plan: PlanArrays):
    """(tokens, sp tokens, routed tokens) of one microbatch on one GPU (see ``LayerOps``).

    Sequence parallelism splits the norm, dropout and residual tokens by tp; an MoE MLP
    processes ``top_k * capacity_factor`` token-expert pairs per token.
    """
    t = tokens(model, plan)
    sp_t = t * (1.0 - plan.sp) + t / plan.tp * plan.sp
    routing = jnp.where(model.experts > 1.0, model.top_k * model.capacity_factor, 1.0)
    return t, sp_t, t * routing


def _gemm_shapes(model: ModelArrays, plan: PlanArrays, t, routed) -> dict:
    """(m, n, k) of QKV, attention output, MoE router, FC1 (gate+up for SwiGLU) and FC2."""
    h, f, tp = model.hidden, model.ffn_hidden, plan.tp
    qkv_n = h * (1.0 + 2.0 * model.kv_heads / model.heads) / tp
    router_n = jnp.where(model.experts > 1.0, model.experts, 0.0)
    return {
        "qkv": (t, qkv_n, h),
        "attn_out": (t, h, h / tp),
        "router": (t, router_n, h),
        "fc1": (routed, f * (1.0 + model.swiglu) / tp, h),
        "fc2": (routed, h, f / tp),
    }


def _attention_flops(model: ModelArrays, plan: PlanArrays, t):
    """Forward FLOPs of ``softmax(QK^T)V`` on one GPU, counting the full (non-causal) square.

    This is the model-FLOP convention (Narayanan et al.); fused causal kernels execute about
    half of it, which the kernel model accounts for.
    """
    heads_local = model.heads / plan.tp
    per_key = 4.0 * plan.microbatch * heads_local * (t / plan.microbatch)
    return per_key * model.seq_len * head_dim(model)


def _hbm_bytes(model: ModelArrays, plan: PlanArrays, t, sp_t, routed) -> dict:
    """Forward HBM traffic of the attention core (Q, K, V, O, plus the scores when unfused) and
    of the memory-bound operators."""
    heads_local = model.heads / plan.tp
    qkvo = ACT_BYTES * t * head_dim(model) * (2.0 * heads_local + 2.0 * model.kv_heads / plan.tp)
    scores = _SCORE_PASSES * ACT_BYTES * heads_local * t * model.seq_len
    norm = ACT_BYTES * _NORM_PASSES * sp_t * model.hidden
    residual = ACT_BYTES * _RESIDUAL_PASSES * sp_t * model.hidden
    return {
        "norm_attn": norm,
        "attention": qkvo + (1.0 - model.flash) * scores,
        "residual_attn": residual,
        "norm_mlp": norm,
        "activation": ACT_BYTES * (2.0 + model.swiglu) * routed * model.ffn_hidden / plan.tp,
        "residual_mlp": residual,
    }


def _saved_bytes(model: ModelArrays, plan: PlanArrays, t, sp_t, routed) -> dict:
    """Activation bytes each operator keeps for backward: (none, selective, full) recompute.

    Korthikanti et al. Table 2 generalized to GQA, SwiGLU and MoE: the inputs of both norms and
    of the QKV and FC1 GEMMs and the dropout masks split by SP; Q, K, V, the attention output
    and the MLP's inner activations split by tp; the routed copies of the MLP input; the scores
    (softmax output, with dropout its mask and output) without fused attention and only without
    recompute. Full recompute keeps only each layer's input (the first norm's). For GPT (``f =
    4 h``, ``kv = heads``, dropout) the sum is the paper's ``s b h (34 + 5 a s / h) / t`` with
    SP, ``34 s b h / t`` selective, ``2 s b h / t`` full.

    With FP8/FP4 GEMMs (Transformer Engine) the inputs of QKV, FC1 and FC2 are kept quantized
    (``quantized_input_bytes`` per element instead of 2), and the attention output is kept
    twice: in 16 bits by the fused attention (its ``out``) and quantized by the output
    projection. The norm inputs, Q/K/V and the activation function's input (Megatron-Core's
    SwiGLU saves it in 16 bits) stay 16-bit. Llama 3 70B at tp 1 in FP8: ``11.5 h + 5 f``
    bytes per token instead of ``12.5 h + 6 f``.
    """
    h, f, tp = model.hidden, model.ffn_hidden, plan.tp
    kv = model.kv_heads / model.heads
    quantized = quantized_input_bytes(model)
    gemm_in = ACT_BYTES * (1.0 - low_precision(model)) + quantized  # bytes per saved element
    x = ACT_BYTES * sp_t * h  # a 16-bit tokens x hidden input under SP
    mask = _DROPOUT_MASK_BYTES * model.dropout * sp_t * h
    score_b = _SCORE_ACT_BYTES + _SCORE_DROPOUT_BYTES * model.dropout
    scores = score_b * model.heads / tp * t * model.seq_len * (1.0 - model.flash)
    qkv_out = t * ACT_BYTES * h * (1.0 + 2.0 * kv) / tp
    fc1_in = x + (routed - t) * ACT_BYTES * h / tp
    kept = lambda v: (v, v, 0.0)  # noqa: E731  kept without recompute and under selective
    attn_out = t * h / tp  # elements; selective recompute regenerates the 16-bit copy
    as_gemm_input = gemm_in / ACT_BYTES
    return {
        "norm_attn": (x, x, x),
        "qkv": kept(x * as_gemm_input),
        "attention": (qkv_out + scores, qkv_out, 0.0),
        "attn_out": (attn_out * (ACT_BYTES + quantized), attn_out * gemm_in, 0.0),
        "residual_attn": kept(mask),
        "norm_mlp": kept(x),
        "fc1": kept(fc1_in * as_gemm_input),
        "activation": kept(routed * ACT_BYTES * f * (1.0 + model.swiglu) / tp),
        "fc2": kept(routed * gemm_in * f / tp),
        "residual_mlp": kept(mask),
    }


def _params(model: ModelArrays) -> dict:
    """Parameters of each operator's weights (and biases), unsharded; FC1 and FC2 of an MoE
    layer: one expert's; the router ``hidden x experts`` (none in a dense layer)."""
    h, f = model.hidden, model.ffn_hidden
    projection = h * h + model.bias * h
    norm = h * (1.0 + model.bias)
    return {
        "norm_attn": norm,
        "qkv": projection * (1.0 + 2.0 * model.kv_heads / model.heads),
        "attn_out": projection,
        "norm_mlp": norm,
        "router": h * jnp.where(model.experts > 1.0, model.experts, 0.0),
        "fc1": (1.0 + model.swiglu) * h * f + model.bias * f,
        "fc2": h * f + model.bias * h,
    }


def local_params(ops: LayerOps, model: ModelArrays, plan: PlanArrays):
    """(dense, expert) parameters of the layer held by one GPU: norms replicated, projections
    and a dense MLP split by tp; an MoE layer's experts (FC1 and FC2 times ``experts``) and
    router split by tp and ep."""
    p = {x: ops.params[i] for i, x in enumerate(OPS)}
    mlp = p["fc1"] + p["fc2"]
    moe = model.experts > 1.0
    dense = (p["qkv"] + p["attn_out"] + jnp.where(moe, 0.0, mlp)) / plan.tp
    dense = dense + (p["norm_attn"] + p["norm_mlp"])
    experts = jnp.where(moe, model.experts * mlp + p["router"], 0.0)
    return dense, experts / (plan.tp * plan.ep)


def layer_ops(model: ModelArrays, plan: PlanArrays) -> LayerOps:
    """The operators of one layer on one GPU for one microbatch.

    Args:
        model, plan: array pytrees of one configuration (``diffcost.arrays``); any leaf may be
            traced (relaxed plans inside jit, vmap at the call site, gradients).

    Returns:
        A ``LayerOps``.

    Examples:
        >>> from diffcost import api
        >>> exp = api.load("configs/examples/gpt3-175b.yaml")
        >>> model, plan, _ = api.experiment_arrays(exp)
        >>> ops = layer_ops(model, plan)
        >>> ops.of("m", ("qkv",)).shape, ops.saved_bytes.shape
        ((1,), (3, 11))
    """
    t, sp_t, routed = token_counts(model, plan)
    gemm = _gemm_shapes(model, plan, t, routed)
    attention = {"attention": _attention_flops(model, plan, t)}
    flops = {name: 2.0 * m * n * k for name, (m, n, k) in gemm.items()} | attention
    saved = _saved_bytes(model, plan, t, sp_t, routed)
    column = lambda d: jnp.stack(jnp.broadcast_arrays(*(d.get(x, 0.0) for x in OPS)))  # noqa: E731
    h = model.hidden
    return LayerOps(
        m=column({x: g[0] for x, g in gemm.items()}),
        n=column({x: g[1] for x, g in gemm.items()}),
        k=column({x: g[2] for x, g in gemm.items()}),
        flops=column(flops),
        hbm_bytes=column(_hbm_bytes(model, plan, t, sp_t, routed)),
        saved_bytes=jnp.stack([column({x: v[r] for x, v in saved.items()}) for r in range(3)]),
        params=column(_params(model)),
        messages=jnp.stack(
            [
                t * h * ACT_BYTES,
                2.0 * t * plan.cp * model.kv_heads * head_dim(model) / plan.tp * ACT_BYTES,
                routed * h * ACT_BYTES,
                sp_t * h * ACT_BYTES,
            ]
        ),
        tokens=t,
        sp_tokens=sp_t,
        routed_tokens=routed,
        low_precision=low_precision(model),
        attention_shape=attention_shape(
            model.seq_len / plan.cp,
            head_dim(model),
            plan.microbatch * model.heads / plan.tp,
            model.heads / model.kv_heads,
        ),
    )
