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
from diffcost.workload import LayerWork

STATUS_OK, STATUS_OOM, STATUS_INVALID = 0, 1, 2
STATUS_NAMES = ("ok", "oom", "invalid")

GRAD_BYTES = 4.0  # fp32 gradient accumulation and reduction (Megatron with bf16)
GRAD_BYTES_16 = 2.0  # 16-bit gradients (``grad_reduce_fp32`` off: DeepSpeed, Megatron fp16)
FSDP_GRAD_BYTES = 2.0  # FSDP reduce-scatters 16-bit gradients per microbatch
WEIGHT_BYTES = 2.0
OPTIMIZER_STATE_BYTES = 12.0  # fp32 master weights + Adam m and v
LOGIT_BYTES = 4.0  # fp32 logits and their gradient on the last stage
LOSS_COMM_BYTES_PER_TOKEN = 4.0  # vocab-parallel cross entropy: fp32 max and sum per token
RUNTIME_RESERVE_BYTES = 1.0 * 2**30  # CUDA context, allocator fragmentation, workspaces
DP_BUCKET_BYTES = 40e6  # gradient bucket buffers (two in flight)
_DIVISIBILITY_TOL = 1e-6
# Multiples of forward per direction ([2]: forward, backward): the backward runs the layer's
# host ops twice, and its K/V exchange moves the keys and values and their gradients.
_FWD_BWD_TWICE = (1.0, 2.0)


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


def _overlap(compute_s, comm_s, kappa, temperature):
    """Two streams running together: each slows by ``kappa`` over the overlapping time."""
    both = smooth.smin2(compute_s, comm_s, temperature)
    return smooth.smax2(compute_s + kappa * both, comm_s + kappa * both, temperature)


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


# --- communication groups and what they carry -------------------------------------------------


@struct.dataclass
class Groups:
    """Placement of one group of each parallel dimension (``comm.Placement``, scalar fields)."""

    tp: comm.Placement
    cp: comm.Placement
    dp: comm.Placement
    pp: comm.Placement
    ep: comm.Placement  # expert parallel: inside the data-parallel group
    edp: comm.Placement  # expert data parallel: replicas of one expert shard


def place_groups(plan: PlanArrays, cluster: ClusterArrays) -> Groups:
    """Where each parallel dimension's groups sit, from the plan's rank order (one ``place``)."""
    tp_stride, cp_stride, dp_stride, pp_stride = _strides(plan)
    degrees = jnp.stack([plan.tp, plan.cp, plan.dp, plan.pp, plan.ep, plan.dp / plan.ep])
    strides = jnp.stack(
        [tp_stride, cp_stride, dp_stride, pp_stride, dp_stride, dp_stride * plan.ep]
    )
    placed = comm.place(degrees, strides, cluster.gpus_per_node)
    pick = lambda i: jax.tree_util.tree_map(lambda field: field[i], placed)  # noqa: E731
    return Groups(*(pick(i) for i in range(6)))


@struct.dataclass
class CommTimes:
    """One call of every collective an iteration runs, on one GPU (seconds)."""

    tp_all_gather_s: jax.Array  # sequence parallel: a layer input's tokens gathered
    tp_reduce_scatter_s: jax.Array  # sequence parallel: a block's output reduced and split
    tp_all_reduce_s: jax.Array  # without sequence parallel: a block's output reduced
    loss_all_reduce_s: jax.Array  # vocab-parallel cross entropy: max and sum per token
    cp_all_gather_s: jax.Array  # context parallel: K and V of the whole sequence
    ep_all_to_all_s: jax.Array  # expert parallel: tokens to their experts (or back)
    zero3_gather_s: jax.Array  # ZeRO-3: one layer's 16-bit parameters (dense + experts)
    zero3_scatter_s: jax.Array  # ZeRO-3: one layer's 16-bit gradients (dense + experts)
    all_reduce_s: jax.Array  # [3] gradients of a layer's dense, expert and embedding params
    reduce_scatter_s: jax.Array  # [3] the same, reduce-scattered (ZeRO-1/2)
    stage_gather_s: jax.Array  # ZeRO-1/2: the stage's updated 16-bit parameters
    p2p_s: jax.Array  # one activation send between adjacent stages


def comm_times(work: LayerWork, model, plan, groups: Groups, cluster, params, temperature):
    """``CommTimes`` of one iteration: its collectives costed together (``comm.collectives_s``).

    Args:
        work: ``workload.layer_work(model, plan)``.
        model, plan, cluster, params: array pytrees of one configuration.
        groups: ``place_groups(plan, cluster)``.
        temperature: relative softness (static).

    Returns:
        A ``CommTimes``.
    """
    dense, experts, embedding = work.dense_params, work.expert_params, work.embedding_params
    grads = grad_bytes(plan)
    stage_params = model.n_layers / plan.pp * (dense + experts)
    requests = [
        ("all_gather", work.tp_msg_bytes, groups.tp),
        ("reduce_scatter", work.tp_msg_bytes, groups.tp),
        ("all_reduce", work.tp_msg_bytes, groups.tp),
        ("all_reduce", work.tokens * LOSS_COMM_BYTES_PER_TOKEN, groups.tp),
        ("all_gather", work.kv_msg_bytes, groups.cp),
        ("all_gather", dense * WEIGHT_BYTES, groups.dp),
        ("all_gather", experts * WEIGHT_BYTES, groups.edp),
        ("reduce_scatter", dense * FSDP_GRAD_BYTES, groups.dp),
        ("reduce_scatter", experts * FSDP_GRAD_BYTES, groups.edp),
        ("all_gather", stage_params * WEIGHT_BYTES, groups.dp),
    ]
    for name in ("all_reduce", "reduce_scatter"):  # gradient sync
        requests += [
            (name, dense * grads, groups.dp),
            (name, experts * grads, groups.edp),
            (name, embedding * grads, groups.dp),
        ]
    t = comm.collectives_s(requests, cluster, params, temperature)
    # share of stage boundaries that cross nodes: (nodes - 1) of the (pp - 1) boundaries
    inter_node = smooth.safe_div(groups.pp.nodes - 1.0, plan.pp - 1.0)
    return CommTimes(
        tp_all_gather_s=t[0],
        tp_reduce_scatter_s=t[1],
        tp_all_reduce_s=t[2],
        loss_all_reduce_s=t[3],
        cp_all_gather_s=t[4],
        ep_all_to_all_s=comm.all_to_all_s(
            work.ep_msg_bytes, groups.ep, cluster, params, temperature
        ),
        zero3_gather_s=t[5] + t[6],
        zero3_scatter_s=t[7] + t[8],
        stage_gather_s=t[9],
        all_reduce_s=jnp.stack(t[10:13]),
        reduce_scatter_s=jnp.stack(t[13:16]),
        p2p_s=comm.send_recv_s(work.p2p_msg_bytes, inter_node, cluster, params),
    )


# --- one layer ----------------------------------------------------------------------------------


def tp_comm_s(compute_s, comms: CommTimes, plan: PlanArrays, kappa, temperature):
    """Exposed tensor-parallel communication of one layer ([2] like ``compute_s``).

    Megatron's layer runs two collectives per block and direction: with sequence parallelism an
    all-gather and a reduce-scatter, without it an all-reduce. They run in series with the
    kernels, or overlapped with them (``overlap_tp``; both slow by the interference factor).
    """
    with_sp = 2.0 * (comms.tp_all_gather_s + comms.tp_reduce_scatter_s)
    without_sp = 2.0 * comms.tp_all_reduce_s
    tp_s = plan.sp * with_sp + (1.0 - plan.sp) * without_sp
    serial = compute_s + tp_s
    overlapped = _overlap(compute_s, tp_s, kappa, temperature)
    return (1.0 - plan.overlap_tp) * serial + plan.overlap_tp * overlapped - compute_s


def _host_hidden(stream_s, host_s, params: Params, temperature):
    """A layer's time when the host dispatches ops ahead of the GPU stream.

    A fraction ``host_overlap`` of the shorter of host and GPU time is hidden (1: the layer
    takes the longer of the two; 0: their sum, as when synchronizations stall the host). Host
    time not hidden counts as compute.
    """
    hidden = params.host_overlap * smooth.smin2(stream_s, host_s, temperature)
    return stream_s + host_s - hidden


def _layer_shape_factor(work: LayerWork, model, plan, params: Params):
    """The calibrated time factor of the layer's shape on one GPU (1 until calibration moves
    it): tokens per microbatch, width per GPU and tp on ``params.layer_shape_log_time``."""
    table = params.layer_shape_log_time + params.cluster_layer_log_time
    return jnp.exp(kernels.layer_log_time(table, work.tokens, model.hidden / plan.tp, plan.tp))


def layer_parts_s(
    work: LayerWork, kernel: kernels.KernelTimes, comms: CommTimes, model, plan, params, temperature
):
    """One layer for one microbatch on one GPU, split into compute, tp, cp, ep and ZeRO time.

    The GPU stream runs the kernels, then the exposed tensor-parallel communication, the
    context-parallel K/V exchange overlapped with attention and the expert all-to-alls (one to
    the experts and one back) in series; the host dispatches alongside; the shape factor scales
    it all. Recompute adds the attention core (selective) or the whole forward (full) to the
    backward; ZeRO-3 gathers and scatters overlap with the layer.

    Returns:
        [2, 5] seconds: rows forward, backward; columns compute, tp, cp, ep, zero.
    """
    kappa = params.interference
    twice = jnp.asarray(_FWD_BWD_TWICE, dtype=kernel.layer_s.dtype)
    attention_s = kernel.attention_s
    tp_s = tp_comm_s(kernel.layer_s, comms, plan, kappa, temperature)
    cp_s = _overlap(attention_s, twice * comms.cp_all_gather_s, kappa, temperature) - attention_s
    ep_s = 2.0 * comms.ep_all_to_all_s
    stream_s = kernel.layer_s + tp_s + cp_s + ep_s
    host_s = workload.HOST_OPS_PER_LAYER_FWD * params.host_op_s * twice
    shape = _layer_shape_factor(work, model, plan, params)
    layer_s = _host_hidden(stream_s, host_s, params, temperature) * shape
    full = plan.recompute[2]
    recompute_s = plan.recompute[1] * attention_s[0] + full * layer_s[0]
    zero_s = zero3_comm_s(layer_s, recompute_s, comms, plan, kappa, temperature)
    tp_s, cp_s, ep_s = shape * tp_s, shape * cp_s, shape * ep_s
    comm_s = tp_s + cp_s + ep_s
    fwd = jnp.stack([layer_s[0] - comm_s[0], tp_s[0], cp_s[0], ep_s, zero_s[0]])
    bwd = jnp.stack(
        [
            layer_s[1] - comm_s[1] + recompute_s - full * comm_s[0],
            tp_s[1] + full * tp_s[0],
            cp_s[1] + full * cp_s[0],
            ep_s * (1.0 + full),
            zero_s[1],
        ]
    )
    return jnp.stack([fwd, bwd])


def zero3_comm_s(layer_s, recompute_s, comms: CommTimes, plan, kappa, temperature):
    """Exposed ZeRO-3 communication of one layer ([2]): its parameters are gathered before the
    forward and the backward, prefetched under the layer's compute, and its gradients
    reduce-scattered during the backward (which includes the recompute)."""
    zeros = jnp.zeros_like(recompute_s)
    core_s = layer_s + jnp.stack([zeros, recompute_s])
    comm_s = comms.zero3_gather_s + jnp.stack([zeros, comms.zero3_scatter_s])
    return plan.zero[3] * (_overlap(core_s, comm_s, kappa, temperature) - core_s)


# --- one stage ----------------------------------------------------------------------------------


def _head_s(kernel: kernels.KernelTimes, comms: CommTimes, work, model, plan, params):
    """LM head and loss of one microbatch, forward and backward ([2] each) and the loss's
    all-reduces, scaled by the calibrated factor of the head's shape (1 until calibration
    moves it)."""
    table = params.head_shape_log_time
    log_f = kernels.layer_log_time(table, work.tokens, model.hidden, plan.tp, HEAD_GRID_LOG2_LO)
    factor = jnp.exp(log_f)
    return factor * kernel.head_s, factor * kernel.loss_s, factor * (2.0 * comms.loss_all_reduce_s)


def stage_s(layer_parts, kernel, comms: CommTimes, work, model, plan, cluster, params):
    """Forward, backward and work split of one microbatch on each stage kind.

    Every stage runs ``layers / pp`` layers; the first adds the embedding, the last the LM
    head and loss (a single stage has both). Every stage runs the schedule's host step (batch
    fetch, loss bookkeeping, Python) once per microbatch, whatever its layers and model chunks.

    Args:
        layer_parts: ``layer_parts_s``, [2, 5].
        kernel, comms: ``kernels.kernel_times`` and ``comm_times`` of the configuration.
        work, model, plan, cluster, params: as in ``stage_times``.

    Returns:
        (forward [3], backward [3], parts [3, 5]) seconds per stage kind (first, middle, last).
    """
    layers = model.n_layers / plan.pp
    emb_bytes = 2.0 * work.tokens * model.hidden * jnp.stack([ACT_BYTES, grad_bytes(plan)])
    emb_fwd, emb_bwd = kernels.memory_bound_s(emb_bytes, cluster, params)
    (head_fwd, head_bwd), (loss_fwd, loss_bwd), loss_comm = _head_s(
        kernel, comms, work, model, plan, params
    )
    head_total = head_fwd + head_bwd + loss_fwd + loss_bwd + loss_comm
    single = 1.0 - _multi_stage(plan.pp)
    mid_fwd, mid_bwd = layers * jnp.sum(layer_parts, axis=1)
    first_fwd = mid_fwd + emb_fwd + single * (head_fwd + loss_fwd)
    fwd = jnp.stack([first_fwd, mid_fwd, mid_fwd + head_fwd + loss_fwd])
    fwd = fwd + params.microbatch_overhead_s
    first_bwd = mid_bwd + emb_bwd + single * (head_bwd + loss_bwd + loss_comm)
    bwd = jnp.stack([first_bwd, mid_bwd, mid_bwd + head_bwd + loss_bwd + loss_comm])
    extras = jnp.stack([emb_fwd + emb_bwd + single * head_total, 0.0 * head_total, head_total])
    parts = jnp.broadcast_to(layers * jnp.sum(layer_parts, axis=0), (3, 5)).at[:, 0].add(extras)
    return fwd, bwd, parts


# --- data-parallel sync and optimizer -----------------------------------------------------------


def dp_sync_s(comms: CommTimes, plan: PlanArrays):
    """Gradient sync: one layer's bucket, and what waits for the end of the backward ([3]).

    ZeRO-0 all-reduces gradients, ZeRO-1/2 reduce-scatter them and all-gather the updated
    16-bit parameters afterwards (overlapped with the next iteration's forward when
    ``overlap_dp``); ZeRO-3 syncs inside the layer (``zero3_comm_s``). The embedding's
    gradients sync after the backward on the first and last stage.
    """
    zero = plan.zero
    sharded = zero[1] + zero[2]
    sync = zero[0] * comms.all_reduce_s + sharded * comms.reduce_scatter_s  # dense, expert, emb
    gather_after = sharded * (1.0 - plan.overlap_dp) * comms.stage_gather_s
    after = jnp.stack([gather_after + sync[2], gather_after, gather_after + sync[2]])
    return sync[0] + sync[1], after


def optimizer_step_s(work: LayerWork, model, plan, cluster, params: Params):
    """Optimizer step of the first stage (it holds the most parameters): memory-bound over the
    local optimizer shard (ZeRO >= 1 shards it over dp, experts over the expert replicas)."""
    shard = 1.0 - plan.zero[0]
    dense_shards = 1.0 + shard * (plan.dp - 1.0)
    expert_shards = 1.0 + shard * (plan.dp / plan.ep - 1.0)
    layers = model.n_layers / plan.pp
    local_params = layers * (work.dense_params / dense_shards + work.expert_params / expert_shards)
    local_params = local_params + work.embedding_params / dense_shards
    return kernels.memory_bound_s(local_params * params.optimizer_bytes_per_param, cluster, params)


def stage_times(model, plan, cluster, params, temperature, grid=None, work=None) -> StageTimes:
    """Per-stage, per-microbatch times and the units of the pipeline and DP schedule.

    Args:
        model, plan, cluster, params: array pytrees of one configuration.
        temperature: relative softness of every max/min (static).
        grid: shared GEMM shape grids, as in ``simulate``.
        work: ``workload.layer_work(model, plan)``, computed here when not given.

    Returns:
        A ``StageTimes``.
    """
    work = workload.layer_work(model, plan) if work is None else work
    groups = place_groups(plan, cluster)
    comms = comm_times(work, model, plan, groups, cluster, params, temperature)
    kernel = kernels.kernel_times(work, model, cluster, params, temperature, grid)
    layer_parts = layer_parts_s(work, kernel, comms, model, plan, params, temperature)
    fwd, bwd, parts = stage_s(layer_parts, kernel, comms, work, model, plan, cluster, params)
    bucket, after = dp_sync_s(comms, plan)
    ones = jnp.ones(3, dtype=fwd.dtype)
    return StageTimes(
        fwd_s=fwd,
        bwd_s=bwd,
        parts=parts,
        p2p_s=comms.p2p_s,
        dp_bucket_s=bucket * ones,
        dp_layers=model.n_layers / plan.pp,
        layer_bwd_s=jnp.sum(layer_parts[1]) * ones,
        dp_after_s=after,
        n_microbatches=plan.n_microbatches,
        n_stages=plan.pp,
        chunks=plan.chunks,
        overlap_dp=plan.overlap_dp,
        schedule=plan.schedule,
        optimizer_s=optimizer_step_s(work, model, plan, cluster, params),
        overhead_s=params.iteration_overhead_s,
        microbatch_overhead_s=params.microbatch_overhead_s,
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


def _in_flight(plan: PlanArrays, temperature):
    """Microbatches whose activations the first and the last stage hold at once: [2].

    GPipe holds all ``m``; 1F1B ``min(p, m)`` on the first stage and one on the last;
    interleaving ``min(p (1 + (p - 1) / (p v)), m)`` and ``min(1 + (p - 1) / v, m)``.
    """
    p, m, v = plan.pp, plan.n_microbatches, plan.chunks
    capped = smooth.smin2(
        jnp.stack([p, p * (1.0 + (p - 1.0) / (p * v)), 1.0 + (p - 1.0) / v]), m, temperature
    )
    first = jnp.stack([m, capped[0], capped[1]])
    last = jnp.stack([m, jnp.ones_like(m), capped[2]])
    return jnp.stack([jnp.sum(plan.schedule * first), jnp.sum(plan.schedule * last)])


def memory(model, plan, cluster, temperature, work=None):
    """Memory per stage kind (first, last): weights, grads, optimizer, activations, buffers.

    Args:
        model, plan, cluster: array pytrees of one configuration.
        temperature: relative softness of the smooth minima (static).
        work: ``workload.layer_work(model, plan)``, computed here when not given.

    Returns:
        (weights, grads, optimizer, activations, buffers), bytes per GPU, each [2].
    """
    work = workload.layer_work(model, plan) if work is None else work
    layers = model.n_layers / plan.pp
    dense_p, expert_p, emb = work.dense_params, work.expert_params, work.embedding_params
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

    act_layer = jnp.sum(plan.recompute * work.activation_bytes)  # [none, selective, full]
    act_full = work.activation_bytes[0]
    logits = LOGIT_BYTES * 2.0 * work.tokens * model.vocab / plan.tp
    act = layers * act_layer * _in_flight(plan, temperature) + plan.recompute[2] * act_full
    act = act + jnp.stack([(1.0 - multi) * logits, logits])
    buckets = smooth.smin2(grad_b * layers * dense_p, DP_BUCKET_BYTES, temperature)
    buffers = 4.0 * work.p2p_msg_bytes + 2.0 * buckets
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
    work = workload.layer_work(model, plan)
    st = stage_times(model, plan, cluster, params, temperature, grid, work)
    pipe_dp, weights, sends, dp_exposed = pipeline_time(st, temperature)
    iteration = pipe_dp + st.optimizer_s + st.overhead_s

    m = st.n_microbatches
    per_mb = weights @ st.parts  # bottleneck stage's per-microbatch composition
    steady = m * per_mb
    host_steps = m * st.microbatch_overhead_s
    bubble = pipe_dp - dp_exposed - jnp.sum(steady) - host_steps - sends

    w, g, o, a, buf = memory(model, plan, cluster, temperature, work)
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
