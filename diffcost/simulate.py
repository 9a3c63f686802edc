"""simulate: one plan on one cluster -> iteration time, its breakdown, memory and a status.

The execution model, in the order it is composed (every max is a smooth max, see
``diffcost.smooth``; at temperature 0 this is exactly the graph that ``diffcost.reference``
simulates event by event):

1. **Layer** (per microbatch, one GPU): GEMMs, attention, memory-bound kernels (FP8 input
   casts included) and launch overheads on the compute stream; tensor-parallel collectives in
   series with them (or overlapped when ``overlap_tp``); context-parallel K/V exchange
   overlapped with attention; expert all-to-alls in series; ZeRO-3 parameter gathers
   prefetched under compute. Overlapped pairs slow each other by the interference factor over
   the overlapping time.
2. **Stage** (per microbatch): ``layers / pp`` layers, plus the embedding on the first stage and
   the LM head and loss on the last. Three stage kinds: first, middle, last.
3. **Pipeline**: closed forms per schedule (``pipeline_time``) over the three stage kinds,
   ``W_s`` being forward + backward of stage ``s`` for one microbatch; activation sends add
   their fill and drain cost.
4. **Data-parallel sync**: one bucket per layer, ready as the last microbatch's backward
   passes it; buckets go FIFO on the comm stream (``dp_tail``), and the drain's sends share
   the NIC with them.
5. **Optimizer step** (memory-bound over the local optimizer shard), the ZeRO-1/2 parameter
   all-gather, and a fixed per-iteration overhead.

Memory per stage: 16-bit weights, fp32 gradients, fp32 master weights and two Adam moments,
each divided by ``dp`` from the ZeRO stage that shards it; activations of the microbatches in
flight; communication buffers; a fixed runtime reserve.

Categorical choices (ZeRO stage, recompute, schedule) are probability vectors: every variant is
computed and the result is their mixture, so a one-hot plan gives exactly that variant and a
relaxed plan a smooth blend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import comm, kernels, smooth, workload
from diffcost.arrays import ACT_BYTES, ClusterArrays, ModelArrays, PlanArrays
from diffcost.params import HEAD_GRID_LOG2_LO, Params

STATUS_OK, STATUS_OOM, STATUS_INVALID = 0, 1, 2
STATUS_NAMES = ("ok", "oom", "invalid")

GRAD_BYTES = 4.0  # fp32 gradient accumulation and reduction (Megatron with bf16)
GRAD_BYTES_16 = 2.0  # 16-bit gradients (``grad_reduce_fp32`` off: DeepSpeed, Megatron fp16)
FSDP_GRAD_BYTES = 2.0  # FSDP reduce-scatters 16-bit gradients per microbatch
WEIGHT_BYTES = 2.0
OPTIMIZER_STATE_BYTES = 12.0  # fp32 master weights + Adam m and v
LOGIT_BYTES = 4.0  # fp32 logits and their gradient on the last stage
# HBM bytes per logit of Megatron's vocab-parallel cross entropy (memory-bound passes over the
# [tokens, vocab / tp] logits). Forward: cast the 16-bit logits to fp32 (2 + 4), max (4),
# subtract it (4 + 4), exp (4 + 4), sum (4), softmax kept for backward (4 + 4). Backward:
# softmax minus the one-hot target (4 + 4), times the loss gradient (4 + 4), cast to 16 bits
# for the head's backward GEMMs (4 + 2).
LOSS_FWD_BYTES_PER_LOGIT = 34.0
LOSS_BWD_BYTES_PER_LOGIT = 22.0
RUNTIME_RESERVE_BYTES = 1.0 * 2**30  # CUDA context, allocator fragmentation, workspaces
DP_BUCKET_BYTES = 40e6  # gradient bucket buffers (two in flight)
ATTN_BWD_FACTOR_FLASH = 2.5  # fused backward recomputes the scores
ATTN_BWD_FACTOR = 2.0
CAUSAL_FRACTION_FLASH = 0.5  # fused causal kernels skip the masked half
_DIVISIBILITY_TOL = 1e-6


@struct.dataclass
class StageTimes:
    """The static-shape execution graph of one iteration, reduced to its repeated units.

    Arrays of shape [3] are per stage kind (first, middle, last). This is what
    ``diffcost.reference`` unrolls event by event.
    """

    fwd_s: jax.Array  # [3] forward of one microbatch on one stage (all chunks)
    bwd_s: jax.Array  # [3] backward (with recompute) of one microbatch on one stage
    parts: jax.Array  # [3, 5] per-microbatch work split: compute, tp, cp, ep, zero
    p2p_s: jax.Array  # one activation send between adjacent stages (per chunk boundary)
    dp_bucket_s: jax.Array  # [3] gradient sync of one layer's bucket
    dp_layers: jax.Array  # buckets (layers) per stage
    layer_bwd_s: jax.Array  # [3] backward of one layer of the last microbatch (bucket cadence)
    dp_after_s: jax.Array  # [3] sync that cannot overlap (ZeRO-1/2 gathers, embedding grads)
    n_microbatches: jax.Array
    n_stages: jax.Array
    chunks: jax.Array
    overlap_dp: jax.Array
    schedule: jax.Array  # [3] probabilities gpipe / 1f1b / interleaved
    optimizer_s: jax.Array
    overhead_s: jax.Array
    microbatch_overhead_s: jax.Array  # host step of one microbatch, part of every fwd_s


@struct.dataclass
class Breakdown:
    """One prediction. A batched sweep returns the same dataclass with a leading axis."""

    iteration_s: jax.Array
    tokens_per_s: jax.Array
    mfu: jax.Array
    compute_s: jax.Array
    tp_comm_s: jax.Array  # exposed tensor-parallel communication
    cp_comm_s: jax.Array
    ep_comm_s: jax.Array
    zero_comm_s: jax.Array  # exposed ZeRO-3 parameter gathers / gradient scatters
    pp_comm_s: jax.Array  # pipeline sends in the fill and drain
    dp_comm_s: jax.Array  # exposed gradient sync and ZeRO-1/2 parameter gathers
    bubble_s: jax.Array
    optimizer_s: jax.Array
    overhead_s: jax.Array  # per iteration, plus the bottleneck stage's per-microbatch host steps
    weights_bytes: jax.Array  # [2] first and last stage
    grads_bytes: jax.Array
    optimizer_bytes: jax.Array
    activations_bytes: jax.Array
    buffers_bytes: jax.Array
    memory_stage_bytes: jax.Array  # [2] total per stage, first and last
    memory_peak_bytes: jax.Array
    memory_capacity_bytes: jax.Array
    memory_excess_bytes: jax.Array  # smooth max(peak - capacity, 0): the OOM penalty
    model_flops: jax.Array  # model FLOPs of one iteration, all GPUs
    status: jax.Array  # int32: 0 ok, 1 out of memory, 2 invalid plan

    TIME_PARTS = (
        "compute_s",
        "tp_comm_s",
        "cp_comm_s",
        "ep_comm_s",
        "zero_comm_s",
        "pp_comm_s",
        "dp_comm_s",
        "bubble_s",
        "optimizer_s",
        "overhead_s",
    )


def time_part(b: Breakdown, name: str) -> np.ndarray:
    """A part of ``Breakdown.TIME_PARTS`` as numpy, with float noise set to exactly 0.

    Some parts are differences of larger sums (the bubble is the pipeline time minus its
    steady-state work): where they are zero in exact arithmetic they come out as a few ulp of
    the iteration time, of either sign depending on how XLA compiled the program (dtype,
    device count, batch size). Values within 64 ulp of ``iteration_s`` are reported as 0.
    """
    x = np.asarray(getattr(b, name))
    total = np.abs(np.asarray(b.iteration_s))
    return np.where(np.abs(x) <= 64.0 * np.finfo(x.dtype).eps * total, 0.0, x).astype(x.dtype)


def grad_bytes(plan: PlanArrays):
    """Bytes per gradient element held and reduced outside ZeRO-3: fp32 or 16-bit."""
    return GRAD_BYTES_16 + (GRAD_BYTES - GRAD_BYTES_16) * plan.grad_reduce_fp32


def _overlap(compute, comm_s, kappa, temperature):
    """Two streams running together: each slows by ``kappa`` over the overlapping time."""
    both = smooth.smin2(compute, comm_s, temperature)
    return smooth.smax2(compute + kappa * both, comm_s + kappa * both, temperature)


def _multi_stage(pp):
    """0 with one pipeline stage, 1 with two or more (linear in between; pp >= 1).

    Only the upper clip: at pp = 1 the gradient is the derivative towards more stages.
    """
    return jnp.minimum(pp - 1.0, 1.0)


def _strides(plan: PlanArrays):
    """Stride of each placed dimension (tp, cp, dp, pp) in the rank numbering.

    ``inner[i, j]`` is 1 when dimension j is inside dimension i (rank of j below rank of i).
    Ranks of a discrete plan are distinct integers, where the piecewise-linear comparison below
    is exact; a relaxed plan mixes the rank vectors of several orders, and two dimensions whose
    mixed ranks are within one of each other are partly inside each other.
    """
    degrees = jnp.stack([plan.tp, plan.cp, plan.dp, plan.pp])
    gap = plan.order[:, None] - plan.order[None, :]
    inner = smooth.clip_exact(gap + 0.5, 0.0, 1.0) * (1.0 - jnp.eye(4, dtype=gap.dtype))
    return jnp.exp(jnp.sum(inner * jnp.log(degrees)[None, :], axis=1))


def _divides(a, b):
    q = a / b
    return jnp.abs(q - jnp.round(q)) < _DIVISIBILITY_TOL * jnp.maximum(1.0, q)


def plan_is_valid(model: ModelArrays, plan: PlanArrays, cluster: ClusterArrays):
    """True where the plan satisfies the structural checks (as a traced boolean)."""
    layers_per_chunk = plan.pp * plan.chunks
    checks = [
        _divides(model.heads, plan.tp),
        _divides(model.kv_heads, plan.tp),
        _divides(model.n_layers, layers_per_chunk),
        _divides(plan.global_batch, plan.dp * plan.microbatch),
        _divides(model.experts, plan.ep),
        _divides(plan.dp, plan.ep),
        _divides(model.seq_len, plan.cp),
        jnp.sum(model.precision * cluster.peak_flops) > 0.0,
    ]
    return functools.reduce(jnp.logical_and, checks)


def stage_times(model, plan, cluster, params, temperature, grid=None) -> StageTimes:
    """Per-stage, per-microbatch times and the units of the pipeline and DP schedule."""
    tau = temperature
    kappa = params.interference
    gpn = cluster.gpus_per_node
    tp_stride, cp_stride, dp_stride, pp_stride = _strides(plan)
    tp_group = comm.place(plan.tp, tp_stride, gpn)
    cp_group = comm.place(plan.cp, cp_stride, gpn)
    dp_group = comm.place(plan.dp, dp_stride, gpn)
    ep_group = comm.place(plan.ep, dp_stride, gpn)
    edp_group = comm.place(plan.dp / plan.ep, dp_stride * plan.ep, gpn)
    pp_group = comm.place(plan.pp, pp_stride, gpn)

    # --- one layer, one microbatch -----------------------------------------------------------
    rate = jnp.maximum(kernels.gemm_peak_flops(model, cluster, params), 1.0)
    rate16 = jnp.maximum(kernels.half_peak_flops(model, cluster, params), 1.0)
    g = workload.layer_gemms(model, plan)
    t = workload.tokens(model, plan)
    vocab_local = model.vocab / plan.tp
    low = workload.low_precision(model)
    table, base = (params.gemm_shape_log_eff, None) if grid is None else grid
    fwd_le, dgrad_le, wgrad_le = kernels.layer_and_head_log_effs(
        table, low, g.m, g.n, g.k, (t, vocab_local, model.hidden), base
    )
    gemm_fwd = jnp.sum(kernels.gemm_s(g.m, g.n, g.k, rate, cluster, params, tau, fwd_le[:-1]))
    # dgrad (m x n) @ (n x k) and wgrad (k x m) @ (m x n): same FLOPs, transposed shapes.
    gemm_bwd = jnp.sum(
        kernels.gemm_s(g.m, g.k, g.n, rate, cluster, params, tau, dgrad_le[:-1])
        + kernels.gemm_s(g.k, g.n, g.m, rate, cluster, params, tau, wgrad_le[:-1])
    )
    attn_flops = workload.attention_flops(model, plan)
    attn_bytes = workload.attention_bytes(model, plan)
    causal = model.flash * CAUSAL_FRACTION_FLASH + (1.0 - model.flash)
    attn_eff = params.attention_eff(model.flash2)
    attn_rate = rate16 * (model.flash * attn_eff + (1.0 - model.flash))
    attn_fwd = smooth.smax2(
        attn_flops * causal / attn_rate,
        kernels.memory_bound_s(attn_bytes * model.flash, cluster, params),
        tau,
    ) + kernels.memory_bound_s(attn_bytes * (1.0 - model.flash), cluster, params)
    attn_bwd = attn_fwd * (
        model.flash * ATTN_BWD_FACTOR_FLASH + (1 - model.flash) * ATTN_BWD_FACTOR
    )
    elem_fwd = kernels.memory_bound_s(workload.elementwise_bytes(model, plan), cluster, params)
    cast_fwd, cast_bwd = (
        kernels.memory_bound_s(b, cluster, params) for b in workload.cast_bytes(model, g)
    )
    launch = workload.KERNELS_PER_LAYER_FWD * params.kernel_overhead_s
    gpu_fwd = gemm_fwd + attn_fwd + elem_fwd + cast_fwd + launch
    gpu_bwd = gemm_bwd + attn_bwd + 2.0 * elem_fwd + cast_bwd + 2.0 * launch

    act_msg = workload.tokens(model, plan) * model.hidden * ACT_BYTES
    tp_sp = 2.0 * (
        comm.all_gather_s(act_msg, tp_group, cluster, params, tau)
        + comm.reduce_scatter_s(act_msg, tp_group, cluster, params, tau)
    )
    tp_ar = 2.0 * comm.all_reduce_s(act_msg, tp_group, cluster, params, tau)
    tp_x = plan.sp * tp_sp + (1.0 - plan.sp) * tp_ar  # the same again in backward

    kv_msg = (
        2.0
        * workload.tokens(model, plan)
        * plan.cp
        * model.kv_heads
        * (model.hidden / model.heads)
        / plan.tp
        * ACT_BYTES
    )
    cp_x = comm.all_gather_s(kv_msg, cp_group, cluster, params, tau)
    cp_fwd = _overlap(attn_fwd, cp_x, kappa, tau) - attn_fwd  # exposed K/V exchange
    cp_bwd = _overlap(attn_bwd, 2.0 * cp_x, kappa, tau) - attn_bwd

    ep_msg = workload.routed_tokens(model, plan) * model.hidden * ACT_BYTES
    ep_x = 2.0 * comm.all_to_all_s(ep_msg, ep_group, cluster, params, tau)

    def with_tp(comp, x):
        serial = comp + x
        return (1.0 - plan.overlap_tp) * serial + plan.overlap_tp * _overlap(comp, x, kappa, tau)

    # GPU stream of one layer: kernels, then exposed TP, CP and EP communication on it.
    tp_fwd = with_tp(gpu_fwd, tp_x) - gpu_fwd
    tp_bwd = with_tp(gpu_bwd, tp_x) - gpu_bwd
    stream_fwd = gpu_fwd + tp_fwd + cp_fwd + ep_x
    stream_bwd = gpu_bwd + tp_bwd + cp_bwd + ep_x
    # The host dispatches ops ahead of the GPU: a fraction ``host_overlap`` of the shorter of
    # host and GPU time is hidden (1: the layer takes the longer of the two; 0: their sum, as
    # when synchronizations stall the host). Host time not hidden counts as compute.
    host = workload.HOST_OPS_PER_LAYER_FWD * params.host_op_s
    hidden = params.host_overlap

    def with_host(stream, host_s):
        return stream + host_s - hidden * smooth.smin2(stream, host_s, tau)

    # The calibrated factor of the layer's shape on one GPU (1 until calibration moves it)
    # scales the whole layer, its communication included.
    shape_f = jnp.exp(
        kernels.layer_log_time(
            params.layer_shape_log_time + params.cluster_layer_log_time,
            t,
            model.hidden / plan.tp,
            plan.tp,
        )
    )
    lay_fwd = with_host(stream_fwd, host) * shape_f
    lay_bwd = with_host(stream_bwd, 2.0 * host) * shape_f
    # recompute extra per mode: none, selective (attention core), full (whole forward)
    full = plan.recompute[2]
    rec = plan.recompute[1] * attn_fwd + full * lay_fwd

    # ZeRO-3: gather each layer's parameters (16-bit) forward and backward, scatter gradients.
    dense_p, expert_p = workload.layer_params_local(model, plan)
    ag_s = comm.all_gather_s(dense_p * WEIGHT_BYTES, dp_group, cluster, params, tau) + (
        comm.all_gather_s(expert_p * WEIGHT_BYTES, edp_group, cluster, params, tau)
    )
    rs_s = comm.reduce_scatter_s(dense_p * FSDP_GRAD_BYTES, dp_group, cluster, params, tau) + (
        comm.reduce_scatter_s(expert_p * FSDP_GRAD_BYTES, edp_group, cluster, params, tau)
    )
    bwd_core = lay_bwd + rec
    z3 = plan.zero[3]
    zero_fwd = z3 * (_overlap(lay_fwd, ag_s, kappa, tau) - lay_fwd)
    zero_bwd = z3 * (_overlap(bwd_core, ag_s + rs_s, kappa, tau) - bwd_core)

    tp_fwd, tp_bwd, cp_fwd, cp_bwd, ep_x = (
        shape_f * x for x in (tp_fwd, tp_bwd, cp_fwd, cp_bwd, ep_x)
    )
    comm_fwd = tp_fwd + cp_fwd + ep_x
    comm_bwd = tp_bwd + cp_bwd + ep_x
    layer_parts_fwd = jnp.stack([lay_fwd - comm_fwd, tp_fwd, cp_fwd, ep_x, zero_fwd])
    layer_parts_bwd = jnp.stack(
        [
            lay_bwd - comm_bwd + rec - full * comm_fwd,
            tp_bwd + full * tp_fwd,
            cp_bwd + full * cp_fwd,
            ep_x * (1.0 + full),
            zero_bwd,
        ]
    )

    # --- stages ------------------------------------------------------------------------------
    layers = model.n_layers / plan.pp
    emb_fwd = kernels.memory_bound_s(2.0 * t * model.hidden * ACT_BYTES, cluster, params)
    grad_b = grad_bytes(plan)
    emb_bwd = kernels.memory_bound_s(2.0 * t * model.hidden * grad_b, cluster, params)
    # The LM head is not an FP8/FP4 layer (Megatron-Core's output layer, llm-foundry's tied
    # head and torchtitan's float8 conversion all keep it in 16 bits).
    head_rate = low * rate16 + (1.0 - low) * rate
    h = model.hidden
    head_fwd = kernels.gemm_s(t, vocab_local, h, head_rate, cluster, params, tau, fwd_le[-1])
    head_bwd = kernels.gemm_s(t, h, vocab_local, head_rate, cluster, params, tau, dgrad_le[-1]) + (
        kernels.gemm_s(h, vocab_local, t, head_rate, cluster, params, tau, wgrad_le[-1])
    )
    logits = t * vocab_local
    loss_fwd = kernels.memory_bound_s(LOSS_FWD_BYTES_PER_LOGIT * logits, cluster, params)
    loss_bwd = kernels.memory_bound_s(LOSS_BWD_BYTES_PER_LOGIT * logits, cluster, params)
    # vocab-parallel cross entropy: all-reduce of max and sum per token (small)
    loss_comm = 2.0 * comm.all_reduce_s(t * 4.0, tp_group, cluster, params, tau)
    # The calibrated factor of the head's shape on one GPU (1 until calibration moves it).
    head_f = jnp.exp(
        kernels.layer_log_time(params.head_shape_log_time, t, h, plan.tp, HEAD_GRID_LOG2_LO)
    )
    head_fwd, head_bwd, loss_fwd, loss_bwd, loss_comm = (
        head_f * x for x in (head_fwd, head_bwd, loss_fwd, loss_bwd, loss_comm)
    )
    head_total = head_fwd + head_bwd + loss_fwd + loss_bwd + loss_comm
    emb_total = emb_fwd + emb_bwd

    multi = _multi_stage(plan.pp)
    # Every stage runs the schedule's host step (batch fetch, loss bookkeeping, Python) once
    # per microbatch, whatever its layers and model chunks (the first chunk fetches the batch,
    # the last computes the loss; charged per chunk, the H100 CV error rose 4.66 -> 4.85%).
    host_step = params.microbatch_overhead_s
    extra_first = emb_total + (1.0 - multi) * head_total
    extra_last = head_total
    mid_fwd = layers * jnp.sum(layer_parts_fwd)
    mid_bwd = layers * jnp.sum(layer_parts_bwd)
    fwd = (
        jnp.stack(
            [
                mid_fwd + emb_fwd + (1 - multi) * (head_fwd + loss_fwd),
                mid_fwd,
                mid_fwd + head_fwd + loss_fwd,
            ]
        )
        + host_step
    )
    bwd = jnp.stack([mid_bwd + emb_bwd, mid_bwd, mid_bwd + head_bwd + loss_bwd + loss_comm]) + (
        jnp.stack([(1 - multi) * (head_bwd + loss_bwd + loss_comm), 0.0 * mid_bwd, 0.0 * mid_bwd])
    )
    layer_parts = layers * (layer_parts_fwd + layer_parts_bwd)
    extras = jnp.stack([extra_first, 0.0 * extra_first, extra_last])
    parts = layer_parts[None, :].repeat(3, axis=0).at[:, 0].add(extras)

    # --- pipeline sends ----------------------------------------------------------------------
    p2p_msg = workload.sp_tokens(model, plan) * model.hidden * ACT_BYTES
    # share of stage boundaries that cross nodes: (nodes - 1) of the (pp - 1) boundaries
    inter = smooth.safe_div(pp_group.nodes - 1.0, plan.pp - 1.0)
    p2p = comm.send_recv_s(p2p_msg, inter, cluster, params)

    # --- data-parallel gradient sync -----------------------------------------------------------
    zero = plan.zero
    grad_sync = lambda p, grp: (  # noqa: E731
        zero[0] * comm.all_reduce_s(p * grad_b, grp, cluster, params, tau)
        + (zero[1] + zero[2]) * comm.reduce_scatter_s(p * grad_b, grp, cluster, params, tau)
    )
    bucket = grad_sync(dense_p, dp_group) + grad_sync(expert_p, edp_group)
    emb_params = model.vocab * model.hidden / plan.tp
    emb_sync = grad_sync(emb_params, dp_group)
    param_gather = (zero[1] + zero[2]) * (1.0 - plan.overlap_dp)
    stage_params = layers * (dense_p + expert_p)
    gather_after = param_gather * comm.all_gather_s(
        stage_params * WEIGHT_BYTES, dp_group, cluster, params, tau
    )
    dp_after = jnp.stack([gather_after + emb_sync, gather_after, gather_after + emb_sync])
    layer_bwd_last = jnp.sum(layer_parts_bwd)

    # --- optimizer (the first stage holds the most parameters) --------------------------------
    shard = 1.0 - zero[0]  # ZeRO >= 1 shards optimizer states
    local_opt_params = layers * (
        dense_p / (1.0 + shard * (plan.dp - 1.0))
        + expert_p / (1.0 + shard * (plan.dp / plan.ep - 1.0))
    ) + emb_params / (1.0 + shard * (plan.dp - 1.0))
    optimizer = kernels.memory_bound_s(
        local_opt_params * params.optimizer_bytes_per_param, cluster, params
    )
    return StageTimes(
        fwd_s=fwd,
        bwd_s=bwd,
        parts=parts,
        p2p_s=p2p,
        dp_bucket_s=jnp.stack([bucket, bucket, bucket]),
        dp_layers=layers,
        layer_bwd_s=jnp.stack([layer_bwd_last] * 3),
        dp_after_s=dp_after,
        n_microbatches=plan.n_microbatches,
        n_stages=plan.pp,
        chunks=plan.chunks,
        overlap_dp=plan.overlap_dp,
        schedule=plan.schedule,
        optimizer_s=optimizer,
        overhead_s=params.iteration_overhead_s,
        microbatch_overhead_s=host_step,
    )


def _stage_kinds(p):
    """Which stage kinds exist: first always, a middle one from pp = 3, a last from pp = 2."""
    return jnp.stack([jnp.ones_like(p), smooth.clip_exact(p - 2.0, 0.0, 1.0), _multi_stage(p)])


def dp_tail(st: StageTimes, temperature):
    """Exposed gradient sync after the last backward task of each stage kind: [3].

    ``lq`` buckets become ready at the layer cadence ``b`` from the start of the stage's last
    backward task (length ``B``); FIFO on the DP stream, the last one finishes
    ``max(lq b + c, b + lq c)`` after that start, i.e. ``max(0, that - B)`` after compute ends.
    With interleaving and overlap only the final chunk's ``L / v`` buckets remain
    (``B = bwd / v``); without overlap every bucket waits for the end. Then ``dp_after_s``.
    """
    tau = temperature
    per_chunk = st.schedule[2] * st.overlap_dp * _multi_stage(st.n_stages)
    v_eff = 1.0 + per_chunk * (st.chunks - 1.0)
    lq, last_b = st.dp_layers / v_eff, st.bwd_s / v_eff
    c, b = st.dp_bucket_s, st.layer_bwd_s
    finish = smooth.smax2(lq * b + c, b + lq * c, tau)
    overlapped = smooth.smooth_relu(finish - last_b, last_b, tau)
    serial = st.dp_layers * c
    return st.overlap_dp * overlapped + (1.0 - st.overlap_dp) * serial, st.dp_after_s


def pipeline_time(st: StageTimes, temperature):
    """Pipeline makespan (with the DP tail), the bottleneck's soft weights, and send costs.

    Closed forms (exact against ``diffcost.reference`` at temperature 0 where stated in
    ``tests/test_reference.py``), with ``W = F + B`` per stage kind (first, middle, last):

    * GPipe: ``sum W + (m - 1) (max F + max B) + 2 (p - 1) s``;
    * 1F1B (``m >= p``): the slowest of three critical paths (bottleneck last, first, or in the
      middle, idling while round trips cross the stages after it), plus
      ``(m - 1) max(0, (sum W + 2 (p - 1) s) / p - max W)`` for the round trip through the
      pipeline when warmup leaves no slack, plus ``2 (p - 1) s``;
    * interleaved (``v`` chunks): ``m max W + (sum W - max W) / v + 2 (p v - 1) s``;
    * the drain's backward sends share the NIC with DP buckets still queued on the sender:
      ``min(s, queued)`` per hop.

    Returns:
        (pipeline + exposed DP time, weights [3] of the bottleneck kind, send time, DP time)
    """
    tau = temperature
    p, m, v = st.n_stages, st.n_microbatches, st.chunks
    multi = _multi_stage(p)
    exists = _stage_kinds(p)
    fwd, bwd = st.fwd_s * exists, st.bwd_s * exists
    work = fwd + bwd
    w_max = smooth.smooth_max(work, temperature=tau)
    if tau == 0:
        weights = jax.nn.one_hot(jnp.argmax(work), 3, dtype=work.dtype)
    else:
        weights = jax.nn.softmax((work - w_max) / (tau * jnp.mean(work)))
    w0, w1, w2 = st.fwd_s + st.bwd_s
    sum_w = w0 + multi * (w2 + (p - 2.0) * w1)
    s = st.p2p_s
    sends_flat = 2.0 * (p - 1.0) * s

    gpipe = sum_w + (m - 1.0) * (
        smooth.smooth_max(fwd, temperature=tau) + smooth.smooth_max(bwd, temperature=tau)
    )
    simple = sum_w + (m - 1.0) * w_max
    paths = jnp.stack(
        [
            sum_w + (m - 1.0) * w2,
            m * w0 + smooth.smooth_relu(2.0 * (w2 + (p - 2.0) * w1) - (p - 1.0) * w0, w0, tau),
            exists[1] * (w0 + 2.0 * w2 + (m + p - 4.0) * w1),
        ]
    )
    steady = multi * smooth.clip_exact(m - p + 1.0, 0.0, 1.0)  # 1F1B with m >= p >= 2
    one_f_one_b = steady * smooth.smooth_max(paths, temperature=tau) + (1.0 - steady) * simple
    round_trip = (sum_w + sends_flat) / p
    round_trip_wait = multi * smooth.smooth_relu(round_trip - w_max, w_max, tau)  # none if p = 1
    one_f_one_b = one_f_one_b + (m - 1.0) * round_trip_wait
    sends_interleaved = 2.0 * (p * v - 1.0) * s * multi
    interleaved = m * w_max + (sum_w - w_max) / v

    tail, after = dp_tail(st, tau)
    # drain hops: the last microbatch's backward leaves stages p-1 .. 1 while their DP sync runs
    delay = lambda queued: smooth.smin2(s, queued, tau)  # noqa: E731
    nic = multi * ((p - 2.0) * delay(tail[1] + after[1]) + delay(tail[2] + after[2]))
    chunks_left = st.schedule[2] * st.overlap_dp * (v - 1.0)
    nic = nic + multi * chunks_left * (delay(tail[0]) + (p - 2.0) * delay(tail[1]) + delay(tail[2]))

    sched = st.schedule
    pipe = sched[0] * gpipe + sched[1] * one_f_one_b + sched[2] * interleaved
    sends = (sched[0] + sched[1]) * sends_flat + sched[2] * sends_interleaved + nic
    dp = tail[0] + after[0]
    return pipe + sends + dp, weights, sends, dp


def memory(model, plan, cluster, temperature):
    """Memory per stage kind (first, last): weights, grads, optimizer, activations, buffers."""
    layers = model.n_layers / plan.pp
    dense_p, expert_p = workload.layer_params_local(model, plan)
    emb = model.vocab * model.hidden / plan.tp
    multi = _multi_stage(plan.pp)
    # The last stage holds the LM head: its own matrix, or Megatron's copy of a tied embedding.
    head_last = multi * emb
    head_first = (1.0 - multi) * (1.0 - model.tied) * emb
    dense_stage = layers * dense_p + jnp.stack([emb + head_first, head_last])
    expert_stage = layers * expert_p * jnp.ones(2)
    z = plan.zero
    edp = plan.dp / plan.ep

    def sharded(stage_from):  # divide by dp from ZeRO stage `stage_from` on
        on = jnp.sum(z[stage_from:])
        return dense_stage / (1.0 + on * (plan.dp - 1.0)) + expert_stage / (1.0 + on * (edp - 1.0))

    weights = WEIGHT_BYTES * sharded(3)
    grad_b = grad_bytes(plan)
    grads = grad_b * sharded(2)
    opt = OPTIMIZER_STATE_BYTES * sharded(1)
    # ZeRO-3 holds two gathered layers (current + prefetched)
    weights = weights + z[3] * 2.0 * WEIGHT_BYTES * (dense_p + expert_p)

    act_by_mode = workload.layer_activation_bytes(model, plan)  # [none, selective, full]
    act_layer = jnp.sum(plan.recompute * act_by_mode)
    act_full = act_by_mode[0]
    p, m, v = plan.pp, plan.n_microbatches, plan.chunks
    in_flight_first = jnp.stack(
        [
            m,
            smooth.smin2(p, m, temperature),
            smooth.smin2(p * (1.0 + (p - 1.0) / (p * v)), m, temperature),
        ]
    )
    in_flight_last = jnp.stack(
        [m, jnp.ones_like(m), smooth.smin2(1.0 + (p - 1.0) / v, m, temperature)]
    )
    in_flight = jnp.stack(
        [jnp.sum(plan.schedule * in_flight_first), jnp.sum(plan.schedule * in_flight_last)]
    )
    t = workload.tokens(model, plan)
    logits = LOGIT_BYTES * 2.0 * t * model.vocab / plan.tp
    act = layers * act_layer * in_flight + plan.recompute[2] * act_full
    act = act + jnp.stack([(1.0 - multi) * logits, logits])
    p2p_msg = workload.sp_tokens(model, plan) * model.hidden * ACT_BYTES
    buffers = 4.0 * p2p_msg + 2.0 * smooth.smin2(
        grad_b * layers * dense_p, DP_BUCKET_BYTES, temperature
    )
    buffers = buffers * jnp.ones(2) + RUNTIME_RESERVE_BYTES
    return weights, grads, opt, act, buffers


def simulate(
    model: ModelArrays,
    plan: PlanArrays,
    cluster: ClusterArrays,
    params: Params,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
    grid=None,
) -> Breakdown:
    """Predict one training iteration.

    Args:
        model, plan, cluster: array pytrees (``diffcost.arrays``); batch with ``jax.vmap``.
        params: calibratable constants.
        temperature: relative softness of every max/min (static); 0 gives the exact model.
        grid: ``(table, base)`` to read the GEMM shape grids from rows ``base + class`` of a
            shared ``table`` ``[rows, G, G, G]`` instead of ``params.gemm_shape_log_eff`` (the
            calibration's batch of thousands of rows reads its families' grids in place this
            way, rather than carrying a copy per row).

    Returns:
        A ``Breakdown``. Invalid plans get ``status = 2`` and finite numbers.

    Examples:
        >>> from diffcost import api
        >>> b = api.predict("configs/examples/gpt-1b-vtrain.yaml")
        >>> bool(b.iteration_s > 0)
        True
    """
    st = stage_times(model, plan, cluster, params, temperature, grid)
    pipe_dp, weights, sends, dp_exposed = pipeline_time(st, temperature)
    iteration = pipe_dp + st.optimizer_s + st.overhead_s

    m = st.n_microbatches
    per_mb = weights @ st.parts  # bottleneck stage's per-microbatch composition
    steady = m * per_mb
    host_steps = m * st.microbatch_overhead_s
    bubble = pipe_dp - dp_exposed - jnp.sum(steady) - host_steps - sends

    w, g, o, a, buf = memory(model, plan, cluster, temperature)
    per_stage = w + g + o + a + buf
    has_last = _multi_stage(plan.pp)
    peak = smooth.smooth_max(per_stage * jnp.stack([1.0, has_last]), temperature=temperature)
    cap = cluster.memory_bytes
    excess = smooth.smooth_relu(peak - cap, cap, temperature)
    valid = plan_is_valid(model, plan, cluster)
    status = jnp.where(valid, jnp.where(peak > cap, STATUS_OOM, STATUS_OK), STATUS_INVALID)

    flops = workload.model_flops_per_iteration(model, plan)
    n_gpus = plan.n_gpus
    peak_flops = jnp.sum(model.precision * cluster.peak_flops)
    mfu = smooth.safe_div(flops, iteration * n_gpus * peak_flops)
    return Breakdown(
        iteration_s=iteration,
        tokens_per_s=plan.global_batch * model.seq_len / iteration,
        mfu=mfu,
        compute_s=steady[0],
        tp_comm_s=steady[1],
        cp_comm_s=steady[2],
        ep_comm_s=steady[3],
        zero_comm_s=steady[4],
        pp_comm_s=sends,
        dp_comm_s=dp_exposed,
        bubble_s=bubble,
        optimizer_s=st.optimizer_s,
        overhead_s=st.overhead_s + host_steps,
        weights_bytes=w,
        grads_bytes=g,
        optimizer_bytes=o,
        activations_bytes=a,
        buffers_bytes=buf,
        memory_stage_bytes=per_stage,
        memory_peak_bytes=peak,
        memory_capacity_bytes=cap,
        memory_excess_bytes=excess,
        model_flops=flops,
        status=status.astype(jnp.int32),
    )
