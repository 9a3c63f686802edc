"""One microbatch on each pipeline stage: the repeated units of an iteration's execution graph.

``stage_times`` composes, for one configuration (every max a smooth max, ``diffcost.smooth``):

1. **Layer** (per microbatch, one GPU, ``layer_parts_s``): GEMMs, attention, memory-bound
   kernels (FP8 input casts included) and launch overheads on the compute stream
   (``kernels.kernel_times``); tensor-parallel collectives in series with them or overlapped
   when ``overlap_tp`` (``tp_comm_s``); the context-parallel K/V exchange overlapped with
   attention; expert all-to-alls in series; ZeRO-3 parameter gathers prefetched under compute
   (``zero3_comm_s``). Overlapped pairs slow each other by the interference factor over the
   overlapping time.
2. **Stage** (per microbatch, ``stage_s``): ``layers / pp`` layers, plus the embedding on the
   first stage and the LM head and loss on the last. Three stage kinds: first, middle, last.
3. **Data-parallel sync** (``dp_sync_s``): one bucket per layer, and what waits for the end of
   the backward (ZeRO-1/2 parameter gathers, embedding gradients).
4. **Optimizer step** (``optimizer_step_s``), memory-bound over the local optimizer shard.

Every collective of the iteration is listed and costed in one place (``comm_times``), on the
groups the plan's rank order places (``place_groups``). ``diffcost.simulate`` schedules the result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from diffcost import comm, kernels, offload, smooth, workload
from diffcost.arrays import ACT_BYTES, ClusterArrays, PlanArrays
from diffcost.network import link_sharing
from diffcost.network import model as netmodel
from diffcost.params import HEAD_GRID_LOG2_LO, Params
from diffcost.specs import pipeline_places
from diffcost.workload import LayerWork

GRAD_BYTES = 4.0  # fp32 gradient accumulation and reduction (Megatron with bf16)
GRAD_BYTES_16 = 2.0  # 16-bit gradients (``grad_reduce_fp32`` off: DeepSpeed, Megatron fp16)
FSDP_GRAD_BYTES = 2.0  # FSDP reduce-scatters 16-bit gradients per microbatch
WEIGHT_BYTES = 2.0
LOSS_COMM_BYTES_PER_TOKEN = 4.0  # vocab-parallel cross entropy: fp32 max and sum per token
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


def grad_bytes(plan: PlanArrays):
    """Bytes per gradient element held and reduced outside ZeRO-3: fp32 or 16-bit."""
    return GRAD_BYTES_16 + (GRAD_BYTES - GRAD_BYTES_16) * plan.grad_reduce_fp32


def _overlap(compute_s, comm_s, kappa, temperature):
    """Two streams running together: each slows by ``kappa`` over the overlapping time."""
    both = smooth.smin2(compute_s, comm_s, temperature)
    return smooth.smax2(compute_s + kappa * both, comm_s + kappa * both, temperature)


def multi_stage(pp):
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


# --- communication groups and what they carry -------------------------------------------------


@struct.dataclass
class Groups:
    """Placement and links of one group of each parallel dimension (``comm.GroupLinks``)."""

    tp: comm.GroupLinks
    cp: comm.GroupLinks
    dp: comm.GroupLinks
    pp: comm.GroupLinks
    ep: comm.GroupLinks  # expert parallel: inside the data-parallel group
    edp: comm.GroupLinks  # expert data parallel: replicas of one expert shard


def place_groups(plan: PlanArrays, cluster: ClusterArrays, params: Params, temperature) -> Groups:
    """Where each parallel dimension's groups sit, from the plan's rank order, and the links
    they use: one ``comm.place`` and one ``comm.group_links`` for all six."""
    tp_stride, cp_stride, dp_stride, pp_stride = _strides(plan)
    degrees = jnp.stack([plan.tp, plan.cp, plan.dp, plan.pp, plan.ep, plan.dp / plan.ep])
    strides = jnp.stack(
        [tp_stride, cp_stride, dp_stride, pp_stride, dp_stride, dp_stride * plan.ep]
    )
    placed = comm.place(degrees, strides, cluster.gpus_per_node)
    links = comm.group_links(placed, cluster, params, temperature)
    # fields that do not depend on the group (the NIC's rate and latency) stay scalars
    pick = lambda i: jax.tree_util.tree_map(lambda f: f[i] if jnp.ndim(f) else f, links)  # noqa: E731
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


def _requests(work: LayerWork, model, plan) -> list:
    """``(collective, msg_bytes, dimension)`` of every collective ``CommTimes`` lists, in
    ``_comm_times``' order (the all-to-all and the pipeline send apart)."""
    dense, experts = work.dense_params, work.expert_params
    # gradients and updated parameters exist only for trained weights (all but under LoRA)
    g_dense, g_experts = work.trained_params, work.trained_expert_params
    embedding = work.trained_embedding_params
    grads = grad_bytes(plan)
    stage_params = model.n_layers / plan.pp * (g_dense + g_experts)
    requests = [
        ("all_gather", work.tp_msg_bytes, "tp"),
        ("reduce_scatter", work.tp_msg_bytes, "tp"),
        ("all_reduce", work.tp_msg_bytes, "tp"),
        ("all_reduce", work.head_tokens * LOSS_COMM_BYTES_PER_TOKEN, "tp"),
        ("all_gather", work.kv_msg_bytes, "cp"),
        ("all_gather", dense * WEIGHT_BYTES, "dp"),
        ("all_gather", experts * WEIGHT_BYTES, "edp"),
        ("reduce_scatter", g_dense * FSDP_GRAD_BYTES, "dp"),
        ("reduce_scatter", g_experts * FSDP_GRAD_BYTES, "edp"),
        ("all_gather", stage_params * WEIGHT_BYTES, "dp"),
    ]
    for name in ("all_reduce", "reduce_scatter"):  # gradient sync
        requests += [
            (name, g_dense * grads, "dp"),
            (name, g_experts * grads, "edp"),
            (name, embedding * grads, "dp"),
        ]
    return requests


def _comm_times(t: list, ep_all_to_all_s, p2p_s) -> CommTimes:
    return CommTimes(
        tp_all_gather_s=t[0],
        tp_reduce_scatter_s=t[1],
        tp_all_reduce_s=t[2],
        loss_all_reduce_s=t[3],
        cp_all_gather_s=t[4],
        ep_all_to_all_s=ep_all_to_all_s,
        zero3_gather_s=t[5] + t[6],
        zero3_scatter_s=t[7] + t[8],
        stage_gather_s=t[9],
        all_reduce_s=jnp.stack(t[10:13]),
        reduce_scatter_s=jnp.stack(t[13:16]),
        p2p_s=p2p_s,
    )


def comm_times(
    work: LayerWork, model, plan, groups, cluster, params, temperature, shared_delay_s=None
):
    """``CommTimes`` of one iteration: each collective on its group's shared ``GroupLinks``,
    or on the cluster's topology graph when it has one (``network_comm_times``).

    Args:
        work: ``workload.layer_work(model, plan)``.
        model, plan, cluster, params: array pytrees of one configuration.
        groups: ``place_groups(plan, cluster, params, temperature)`` (None with a topology).
        temperature: relative softness (static).
        shared_delay_s: as ``network_comm_times``'s.

    Returns:
        A ``CommTimes``.
    """
    requests = _requests(work, model, plan)
    if cluster.network is not None:
        return network_comm_times(
            requests, work, plan, cluster.network, params, temperature, shared_delay_s
        )
    t = comm.collectives_s(
        [(name, msg, getattr(groups, dim)) for name, msg, dim in requests], params, temperature
    )
    # share of stage boundaries that cross nodes: (nodes - 1) of the (pp - 1) boundaries
    inter_node = smooth.safe_div(groups.pp.group.nodes - 1.0, plan.pp - 1.0)
    return _comm_times(
        t,
        comm.all_to_all_links_s(work.ep_msg_bytes, groups.ep, params),
        comm.send_recv_s(work.p2p_msg_bytes, inter_node, cluster, params),
    )


def _dims(plan: PlanArrays) -> dict:
    """``{dimension: (size, stride)}`` of one group of each dimension in the rank order."""
    tp_stride, cp_stride, dp_stride, pp_stride = _strides(plan)
    return {
        "tp": (plan.tp, tp_stride),
        "cp": (plan.cp, cp_stride),
        "dp": (plan.dp, dp_stride),
        "pp": (plan.pp, pp_stride),
        "ep": (plan.ep, dp_stride),
        "edp": (plan.dp / plan.ep, dp_stride * plan.ep),
    }


def shared_traffic(work: LayerWork, plan: PlanArrays) -> dict:
    """The collectives that run at the same time under a layer's backward, and share links:
    ``{"bucket" | "tp" | "send": [(dimension, items)]}``, items ``(collective, msg_bytes,
    count)`` as ``network.model.traffic_row`` takes them. The bucket is a layer's gradient sync
    (ZeRO-0/1/2) or its ZeRO-3 gathers and scatters, dense and expert; "tp" the next layer's
    tensor-parallel collectives; "send" a pipeline send. A ZeRO-0/1/2 sync joins only with
    ``overlap_dp`` (without, it runs after the backward: ``dp_sync_s``)."""
    zero, sp, per_layer = plan.zero, plan.sp, layer_sharded(plan)
    per_step = (zero[1] + zero[2] - per_layer) * plan.overlap_dp

    def sync(trained, weights):
        return [
            ("all_reduce", trained * grad_bytes(plan), zero[0] * plan.overlap_dp),
            ("reduce_scatter", trained * grad_bytes(plan), per_step),
            ("all_gather", weights * WEIGHT_BYTES, zero[3]),
            ("reduce_scatter", trained * FSDP_GRAD_BYTES, zero[3] + per_layer),
        ]

    tp = [
        ("all_gather", work.tp_msg_bytes, 2.0 * sp),
        ("reduce_scatter", work.tp_msg_bytes, 2.0 * sp),
        ("all_reduce", work.tp_msg_bytes, 2.0 * (1.0 - sp)),
    ]
    return {
        "bucket": [
            ("dp", sync(work.trained_params, work.dense_params)),
            ("edp", sync(work.trained_expert_params, work.expert_params)),
        ],
        "tp": [("tp", tp)],
        "send": [("pp", [("send", work.p2p_msg_bytes, 1.0)])],
    }


def network_comm_times(
    requests, work, plan, tables, params, temperature, shared_delay_s=None
) -> CommTimes:
    """``CommTimes`` priced on a topology's ``NetworkTables`` (``diffcost.network.model``).

    With ``tables.contention``, the collectives the execution graph runs at the same time
    (``shared_traffic``) share the tiers' busiest links, or with per-link tables
    (``build_tables(links=True)``) the links they cross (``network.link_sharing``), max-min
    fairly: a layer's gradient bucket (ZeRO-0/1/2;
    ZeRO-3: the layer's parameter gathers and gradient scatters) runs under the next layer's
    backward, with its tensor-parallel collectives and a pipeline send; its delay is added to
    the bucket (and to the ZeRO-3 gathers). The delays of the tensor-parallel collectives and
    the send, which the bucket slows in one microbatch of many, are not added.
    ``shared_delay_s``, when given, is the bucket's delay in place of the smooth sharing's
    (``diffcost.reference_network`` passes the exact one).
    """
    dims = _dims(plan)
    prices = netmodel.priced(tables, params, temperature)
    traffic = shared_traffic(work, plan) if tables.contention and shared_delay_s is None else {}
    names = {d: ["send"] if d == "pp" else ["all_to_all"] if d == "ep" else [] for d in dims}
    for name, _, d in requests:
        names[d].append(name)
    loads = {d: [] for d in dims}
    for parts in traffic.values():
        for d, items in parts:
            loads[d] += [name for name, _, _ in items]
    groups = {
        d: netmodel.group(
            tables,
            prices,
            *dims[d],
            slots=netmodel.slots_of(names[d] + loads[d]),
            loads=netmodel.slots_of(loads[d]),
        )
        for d in dims
    }
    t = [netmodel.collective_s(n, m, groups[d], params, temperature) for n, m, d in requests]
    p2p_s = netmodel.collective_s("send", work.p2p_msg_bytes, groups["pp"], params, temperature)
    a2a_s = netmodel.collective_s(
        "all_to_all", work.ep_msg_bytes, groups["ep"], params, temperature
    )
    comms = _comm_times(t, a2a_s, p2p_s)
    if not tables.contention:
        return comms
    if shared_delay_s is None and tables.link_load is not None:
        shared_delay_s = link_sharing.bucket_delay_s(
            traffic, dims, tables, groups, params, temperature
        )[0]
    if shared_delay_s is None:

        def row(parts):
            return sum(
                netmodel.traffic_row(items, groups[d], groups[d].load, params, temperature)
                for d, items in parts
            )

        rows = [row(parts) for parts in traffic.values()]
        shared_delay_s = netmodel.shared_delays_s(rows, prices.capacity)[0]
    return comms.replace(
        all_reduce_s=comms.all_reduce_s.at[0].add(shared_delay_s),
        reduce_scatter_s=comms.reduce_scatter_s.at[0].add(shared_delay_s),
        zero3_gather_s=comms.zero3_gather_s + shared_delay_s,
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
    work: LayerWork,
    kernel: kernels.KernelTimes,
    comms: CommTimes,
    model,
    plan,
    cluster: ClusterArrays,
    params,
    temperature,
):
    """One layer for one microbatch on one GPU, split into compute, tp, cp, ep and ZeRO time.

    The GPU stream runs the kernels, then the exposed tensor-parallel communication, the
    context-parallel K/V exchange overlapped with attention and the expert all-to-alls (one to
    the experts and one back) in series; the host dispatches alongside; the shape factor scales
    it all. Recompute adds the attention core (selective) or the whole forward (full) to the
    backward; ZeRO-3 gathers and scatters overlap with the layer; the offloaded layers' copies
    to and from host memory over the cluster's host link (``offload.copy_s``), spread over every
    layer's forward and backward, overlap with them, and what they leave exposed counts as
    compute (``offload.exposed_s``).

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
    eager = 1.0 - plan.cuda_graphs  # replayed CUDA graphs dispatch no op from the host
    host_s = workload.HOST_OPS_PER_LAYER_FWD * params.host_op_s * twice * eager
    shape = _layer_shape_factor(work, model, plan, params)
    layer_s = _host_hidden(stream_s, host_s, params, temperature) * shape
    full = plan.recompute[2]
    recompute_s = plan.recompute[1] * attention_s[0] + full * layer_s[0]
    zero_s = zero3_comm_s(layer_s, recompute_s, comms, plan, kappa, temperature)
    core_s = layer_s + jnp.stack([0.0 * recompute_s, recompute_s])
    host_copy_s = offload.copy_s(work, plan, cluster)
    offload_s = offload.exposed_s(
        core_s, host_copy_s, plan, lambda a, b: _overlap(a, b, kappa, temperature)
    )
    tp_s, cp_s, ep_s = shape * tp_s, shape * cp_s, shape * ep_s
    comm_s = tp_s + cp_s + ep_s
    fwd = jnp.stack([layer_s[0] - comm_s[0] + offload_s[0], tp_s[0], cp_s[0], ep_s, zero_s[0]])
    bwd = jnp.stack(
        [
            layer_s[1] - comm_s[1] + recompute_s - full * comm_s[0] + offload_s[1],
            tp_s[1] + full * tp_s[0],
            cp_s[1] + full * cp_s[0],
            ep_s * (1.0 + full),
            zero_s[1],
        ]
    )
    return jnp.stack([fwd, bwd])


def layer_sharded(plan):
    """The weight of ZeRO-2 with per-layer gathers (``PlanSpec.param_gather`` "layer"): its
    parameters and gradients move per layer, as ZeRO-3's do, instead of once per step."""
    return plan.zero[2] * plan.gather_layer


def zero3_comm_s(layer_s, recompute_s, comms: CommTimes, plan, kappa, temperature):
    """Exposed per-layer ZeRO communication of one layer ([2]). ZeRO-3 gathers the layer's
    parameters before the forward and again before the backward, prefetched under the layer's
    compute, and reduce-scatters its gradients during the backward (which includes the
    recompute); ZeRO-2 with per-layer gathers (``layer_sharded``) keeps the forward's gathered
    parameters for the backward, so its backward only reduce-scatters."""
    zeros = jnp.zeros_like(recompute_s)
    core_s = layer_s + jnp.stack([zeros, recompute_s])
    scatter_s = jnp.stack([zeros, comms.zero3_scatter_s])
    regather = comms.zero3_gather_s + scatter_s
    kept = jnp.stack([comms.zero3_gather_s, zeros]) + scatter_s
    exposed_regather = _overlap(core_s, regather, kappa, temperature) - core_s
    exposed_kept = _overlap(core_s, kept, kappa, temperature) - core_s
    return plan.zero[3] * exposed_regather + layer_sharded(plan) * exposed_kept


# --- one stage ----------------------------------------------------------------------------------


def _head_s(kernel: kernels.KernelTimes, comms: CommTimes, work, model, plan, params):
    """LM head and loss of one microbatch, forward and backward ([2] each) and the loss's
    all-reduces, scaled by the calibrated factor of the head's shape (1 until calibration
    moves it)."""
    table = params.head_shape_log_time
    log_f = kernels.layer_log_time(
        table, work.head_tokens, model.hidden, plan.tp, HEAD_GRID_LOG2_LO
    )
    factor = jnp.exp(log_f)
    return factor * kernel.head_s, factor * kernel.loss_s, factor * (2.0 * comms.loss_all_reduce_s)


def stage_s(layer_parts, kernel, comms: CommTimes, work, model, plan, cluster, params):
    """Forward, backward and work split of one microbatch on each stage kind.

    Every stage runs ``layers / pp`` layers (``stage_layers``); the first adds the embedding,
    the last the LM head and loss (a single stage has both). Every stage runs the schedule's
    host step (batch fetch, loss bookkeeping, Python) once per microbatch, whatever its layers
    and model chunks.

    Args:
        layer_parts: ``layer_parts_s``, [2, 5].
        kernel, comms: ``kernels.kernel_times`` and ``comm_times`` of the configuration.
        work, model, plan, cluster, params: as in ``stage_times``.

    Returns:
        (forward [3], backward [3], parts [3, 5]) seconds per stage kind (first, middle, last).
    """
    layers = stage_layers(model, plan)
    emb_grad = grad_bytes(plan) * (1.0 - work.lora)  # a frozen embedding has no gradient
    emb_bytes = 2.0 * work.tokens * model.hidden * jnp.stack([ACT_BYTES, emb_grad])
    emb_fwd, emb_bwd = kernels.memory_bound_s(emb_bytes, cluster, params)
    (head_fwd, head_bwd), (loss_fwd, loss_bwd), loss_comm = _head_s(
        kernel, comms, work, model, plan, params
    )
    head_total = head_fwd + head_bwd + loss_fwd + loss_bwd + loss_comm
    single = 1.0 - multi_stage(plan.pp)
    layer_fwd, layer_bwd = jnp.sum(layer_parts, axis=1)
    head_fwd, head_bwd = head_fwd + loss_fwd, head_bwd + loss_bwd + loss_comm
    none = 0.0 * head_total
    fwd = layers * layer_fwd + jnp.stack([emb_fwd + single * head_fwd, none, head_fwd])
    fwd = fwd + params.microbatch_overhead_s
    bwd = layers * layer_bwd + jnp.stack([emb_bwd + single * head_bwd, none, head_bwd])
    extras = jnp.stack([emb_fwd + emb_bwd + single * head_total, none, head_total])
    parts = (layers[:, None] * jnp.sum(layer_parts, axis=0)).at[:, 0].add(extras)
    return fwd, bwd, parts


def stage_layers(model, plan):
    """Transformer layers of one stage of each kind ([3]: first, middle, last): ``n_layers /
    pp``; with ``split_edges`` (Megatron-Core's ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split``) every stage has ``(n_layers + 2) / pp`` places and
    the embedding takes one of the first stage's, the loss one of the last's. One stage keeps
    every layer."""
    edges = plan.split_edges * multi_stage(plan.pp)
    places = pipeline_places(model.n_layers, edges) / plan.pp
    return places - jnp.stack([edges, 0.0 * edges, edges])


# --- data-parallel sync and optimizer -----------------------------------------------------------


def dp_sync_s(comms: CommTimes, plan: PlanArrays):
    """Gradient sync: one layer's bucket, and what waits for the end of the backward ([3]).

    ZeRO-0 all-reduces gradients, ZeRO-1/2 reduce-scatter them and all-gather the updated
    16-bit parameters afterwards (overlapped with the next iteration's forward when
    ``overlap_dp``); ZeRO-3 and ZeRO-2 with per-layer gathers sync inside the layer
    (``zero3_comm_s``). The embedding's gradients sync after the backward on the first and
    last stage (reduce-scattered with ZeRO >= 1).
    """
    zero = plan.zero
    sharded = zero[1] + zero[2]
    per_step = sharded - layer_sharded(plan)
    scattered = jnp.stack([per_step, per_step, sharded])  # dense, expert, embedding
    sync = zero[0] * comms.all_reduce_s + scattered * comms.reduce_scatter_s
    gather_after = per_step * (1.0 - plan.overlap_dp) * comms.stage_gather_s
    after = jnp.stack([gather_after + sync[2], gather_after, gather_after + sync[2]])
    return sync[0] + sync[1], after


def optimizer_step_s(work: LayerWork, model, plan, cluster, params: Params):
    """Optimizer step of the first stage (it holds the most parameters): memory-bound over the
    local optimizer shard of the trained parameters (ZeRO >= 1 shards it over dp, experts over
    the expert replicas)."""
    shard = 1.0 - plan.zero[0]
    dense_shards = 1.0 + shard * (plan.dp - 1.0)
    expert_shards = 1.0 + shard * (plan.dp / plan.ep - 1.0)
    layers = model.n_layers / plan.pp
    dense, experts = work.trained_params, work.trained_expert_params
    local_params = layers * (dense / dense_shards + experts / expert_shards)
    local_params = local_params + work.trained_embedding_params / dense_shards
    return kernels.memory_bound_s(local_params * params.optimizer_bytes_per_param, cluster, params)


def stage_times(
    model, plan, cluster, params, temperature, grid=None, work=None, shared_delay_s=None
) -> StageTimes:
    """Per-stage, per-microbatch times and the units of the pipeline and DP schedule.

    Args:
        model, plan, cluster, params: array pytrees of one configuration.
        temperature: relative softness of every max/min (static).
        grid: shared GEMM shape grids, as in ``simulate``.
        work: ``workload.layer_work(model, plan)``, computed here when not given.
        shared_delay_s: on a topology with contention, the gradient bucket's delay from
            sharing links (``network_comm_times``); the smooth sharing's if None.

    Returns:
        A ``StageTimes``.
    """
    work = workload.layer_work(model, plan) if work is None else work
    network = cluster.network is not None
    groups = None if network else place_groups(plan, cluster, params, temperature)
    comms = comm_times(work, model, plan, groups, cluster, params, temperature, shared_delay_s)
    kernel = kernels.kernel_times(work, model, cluster, params, temperature, grid)
    layer_parts = layer_parts_s(work, kernel, comms, model, plan, cluster, params, temperature)
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
