"""simulate: one plan on one cluster -> iteration time, its breakdown, memory and a status.

The execution model, in the order it is composed (every max is a smooth max, see
``diffcost.smooth``; at temperature 0 this is exactly the graph that ``diffcost.reference``
simulates event by event):

1. **Layer** and 2. **Stage** (per microbatch, ``diffcost.stages.stage_times``): a layer's
   kernels and its tensor-, context- and expert-parallel and ZeRO-3 communication on one GPU;
   ``layers / pp`` layers per stage, plus the embedding on the first stage and the LM head and
   loss on the last. Three stage kinds: first, middle, last. ``diffcost.workload.layer_work``
   computes the layer's shapes once for both time and memory.
3. **Pipeline**: closed forms per schedule (``pipeline_time``) over the three stage kinds,
   ``W_s`` being forward + backward of stage ``s`` for one microbatch; activation sends add
   their fill and drain cost.
4. **Data-parallel sync**: one bucket per layer, ready as the last microbatch's backward
   passes it; buckets go FIFO on the comm stream (``dp_tail``), and the drain's sends share
   the NIC with them.
5. **Optimizer step** (memory-bound over the local optimizer shard), the ZeRO-1/2 parameter
   all-gather, and a fixed per-iteration overhead.

Memory per stage (``memory``): 16-bit weights, fp32 gradients, fp32 master weights and two Adam
moments, each divided by ``dp * cp`` from the ZeRO stage that shards it; activations of the
microbatches in flight; the logits on the last stage; communication buffers; a fixed runtime
reserve. ``tests/test_memory_reference.py`` checks it against an independent calculation of
what Megatron-Core allocates.

Categorical choices (ZeRO stage, recompute, schedule) are probability vectors: every variant is
computed and the result is their mixture, so a one-hot plan gives exactly that variant and a
relaxed plan a smooth blend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import constraints, offload, schedules, smooth, workload
from diffcost.arrays import ClusterArrays, ModelArrays, PlanArrays
from diffcost.params import Params
from diffcost.stages import WEIGHT_BYTES, StageTimes, grad_bytes, multi_stage, stage_times

__all__ = [
    "STATUS_INVALID",
    "STATUS_NAMES",
    "STATUS_OK",
    "STATUS_OOM",
    "Breakdown",
    "StageTimes",
    "dp_tail",
    "grad_bytes",
    "memory",
    "pipeline_time",
    "plan_is_valid",
    "simulate",
    "stage_times",
    "time_part",
]

STATUS_OK, STATUS_OOM, STATUS_INVALID = 0, 1, 2
STATUS_NAMES = ("ok", "oom", "invalid")

# Bytes per parameter of optimizer state: fp32 master weights and Adam's two moments (ZeRO,
# Rajbhandari et al. 2020, sec. 3.1: 2 + 2 + 12).
OPTIMIZER_STATE_BYTES = 12.0
# Last stage: the 16-bit logits and the fp32 copy Megatron-Core's vocab-parallel cross entropy
# makes of them (``VocabParallelCrossEntropy.calculate_logits_max``), both alive at the loss; in
# backward the fp32 gradient (written over that copy) and its 16-bit cast.
LOGIT_BYTES = 2.0 + 4.0
RUNTIME_RESERVE_BYTES = 1.0 * 2**30  # CUDA context, NCCL buffers, allocator fragmentation
DP_BUCKET_BYTES = 40e6  # gradient bucket buffers (two in flight)


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
    zero_comm_s: jax.Array  # exposed per-layer ZeRO gathers / scatters (ZeRO-3, FSDP's ZeRO-2)
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
    memory_peak_bytes: jax.Array  # allocated peak + RUNTIME_RESERVE_BYTES, against capacity
    memory_capacity_bytes: jax.Array
    memory_excess_bytes: jax.Array  # smooth max(peak - capacity, 0): the OOM penalty
    model_flops: jax.Array  # model FLOPs of one iteration, all GPUs
    status: jax.Array  # int32: 0 ok, 1 out of memory, 2 invalid plan
    # peak the PyTorch caching allocator hands out (``torch.cuda.max_memory_allocated``): the
    # largest stage total without the runtime reserve, which the allocator does not see
    memory_allocated_bytes: jax.Array

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


def plan_is_valid(model: ModelArrays, plan: PlanArrays, cluster: ClusterArrays):
    """True where the plan satisfies every rule of ``diffcost.constraints`` (a traced boolean)."""
    return constraints.is_valid(model, plan, cluster)


def _stage_kinds(p):
    """Which stage kinds exist: first always, a middle one from pp = 3, a last from pp = 2."""
    return jnp.stack([jnp.ones_like(p), smooth.clip_exact(p - 2.0, 0.0, 1.0), multi_stage(p)])


def dp_tail(st: StageTimes, temperature):
    """Exposed gradient sync after the last backward task of each stage kind: [3].

    ``lq`` buckets become ready at the layer cadence ``b`` from the start of the stage's last
    backward task (length ``B``); FIFO on the DP stream, the last one finishes
    ``max(lq b + c, b + lq c)`` after that start, i.e. ``max(0, that - B)`` after compute ends.
    With interleaving and overlap only the final chunk's ``L / v`` buckets remain
    (``B = bwd / v``); without overlap every bucket waits for the end. Then ``dp_after_s``.
    """
    tau = temperature
    per_chunk = schedules.interleaved_weight(st.schedule) * st.overlap_dp * multi_stage(st.n_stages)
    v_eff = 1.0 + per_chunk * (st.chunks - 1.0)
    lq, last_b = st.dp_layers / v_eff, st.bwd_s / v_eff
    c, b = st.dp_bucket_s, st.layer_bwd_s
    finish = smooth.smax2(lq * b + c, b + lq * c, tau)
    overlapped = smooth.smooth_relu(finish - last_b, last_b, tau)
    serial = st.dp_layers * c
    return st.overlap_dp * overlapped + (1.0 - st.overlap_dp) * serial, st.dp_after_s


def pipeline_time(st: StageTimes, temperature):
    """Pipeline makespan (with the DP tail), the bottleneck's soft weights, and send costs.

    Each schedule's closed form and critical-path sends come from its entry in
    ``diffcost.schedules`` (exact against ``diffcost.reference`` at temperature 0 where stated
    in ``tests/test_reference.py``), mixed by the plan's schedule weights; ``W = F + B`` per
    stage kind (first, middle, last). The drain's backward sends share the NIC with DP buckets
    still queued on the sender: ``min(s, queued)`` per hop.

    Returns:
        (pipeline + exposed DP time, weights [3] of the bottleneck kind, send time, DP time)
    """
    tau = temperature
    pipe, work = _pipeline(st, tau)
    if tau == 0:
        weights = jax.nn.one_hot(jnp.argmax(work), 3, dtype=work.dtype)
    else:
        weights = jax.nn.softmax((work - pipe.w_max_s) / (tau * jnp.mean(work)))
    registry = schedules.REGISTRY.values()
    makespan = schedules.mix(st.schedule, [s.makespan_fn(pipe, tau) for s in registry])
    sends = schedules.mix(st.schedule, [s.sends_fn(pipe) for s in registry])
    tail, after = dp_tail(st, tau)
    # drain hops: the last microbatch's backward leaves stages p-1 .. 1 while their DP sync runs
    p, s, multi = pipe.p, pipe.send_s, pipe.multi
    delay = lambda queued: smooth.smin2(s, queued, tau)  # noqa: E731
    nic = multi * ((p - 2.0) * delay(tail[1] + after[1]) + delay(tail[2] + after[2]))
    chunks_left = schedules.interleaved_weight(st.schedule) * st.overlap_dp * (pipe.v - 1.0)
    nic = nic + multi * chunks_left * (delay(tail[0]) + (p - 2.0) * delay(tail[1]) + delay(tail[2]))
    sends = sends + nic
    dp = tail[0] + after[0]
    return makespan + sends + dp, weights, sends, dp


def _pipeline(st: StageTimes, tau) -> tuple[schedules.Pipeline, jax.Array]:
    """The pipeline's per-kind work as ``schedules.Pipeline``, and the work of existing kinds."""
    p = st.n_stages
    multi = multi_stage(p)
    exists = _stage_kinds(p)
    fwd, bwd = st.fwd_s * exists, st.bwd_s * exists
    work = fwd + bwd
    w = st.fwd_s + st.bwd_s
    pipe = schedules.Pipeline(
        p=p,
        m=st.n_microbatches,
        v=st.chunks,
        multi=multi,
        middle=exists[1],
        fwd_s=fwd,
        bwd_s=bwd,
        w_s=w,
        sum_w_s=w[0] + multi * (w[2] + (p - 2.0) * w[1]),
        w_max_s=smooth.smooth_max(work, temperature=tau),
        send_s=st.p2p_s,
    )
    return pipe, work


def _in_flight(plan: PlanArrays, temperature):
    """Microbatches whose activations the first and the last stage hold at once: [2], mixed
    over the schedules' ``in_flight_fn`` by the plan's schedule weights."""
    p, m, v = plan.pp, plan.n_microbatches, plan.chunks
    held = [s.in_flight_fn(p, m, v, temperature) for s in schedules.REGISTRY.values()]
    first = schedules.mix(plan.schedule, [h[0] for h in held])
    last = schedules.mix(plan.schedule, [h[1] for h in held])
    return jnp.stack([first, last])


def _stage_params(model, plan, dense_p, expert_p, emb):
    """(dense, expert) parameters of the first and last stage ([2] each) from one layer's
    dense and expert parameters and the embedding's, all on one GPU. The last stage holds the
    LM head: its own matrix, or Megatron's copy of a tied embedding."""
    layers = model.n_layers / plan.pp
    multi = multi_stage(plan.pp)
    head_last = multi * emb
    head_first = (1.0 - multi) * (1.0 - model.tied) * emb
    dense_stage = layers * dense_p + jnp.stack([emb + head_first, head_last])
    return dense_stage, layers * expert_p * jnp.ones(2)


def memory(model, plan, cluster, temperature, work=None):
    """Memory per stage kind (first, last): weights, grads, optimizer, activations, buffers.

    What Megatron-Core allocates, part by part:

    * weights: 16-bit parameters, 2 B each; the last stage holds the LM head (its own matrix, or
      the copy Megatron keeps of a tied embedding);
    * grads: the main-gradient buffer, 4 B (fp32) or 2 B per parameter (``grad_bytes``), of
      the trained parameters (under LoRA the adapters only; so for the optimizer state);
    * optimizer: fp32 master weights and Adam's moments, 12 B per parameter (Rajbhandari et al.,
      "ZeRO", SC'20, sec. 3.1). Megatron-Core's distributed optimizer (ZeRO stage 1) shards
      this part over ``dp`` and neither of the others (its documented 6 + 12/d bytes per
      parameter with bf16 weights and fp32 gradients, 18 without it); ZeRO-2 also shards the
      gradients and ZeRO-3 (FSDP) the weights, keeping two gathered layers (the current one
      and the prefetched one). Context-parallel ranks hold the same parameters, so the shards
      span ``dp * cp`` ranks (Megatron-Core's data-parallel group with context parallelism,
      FSDP2's flattened ``dp_shard_cp`` mesh); expert parameters span ``dp / ep * cp``. With
      16-bit main gradients Megatron's optimizer copies them to fp32 for the step (its table's
      20 and 4 + 16/d bytes): that copy lives after the activations are freed and is left
      out. FSDP's sharded fp32 parameters double as master weights, so that path over-counts
      by its 16-bit shard, ``2 / dp`` per parameter;
    * activations: ``workload.layer_work(...).activation_bytes`` per layer and microbatch
      (Korthikanti et al. 2022, Table 2) times the layers of a stage and the microbatches the
      schedule keeps in flight at the stage's peak (``schedules``: ``min(p, m)`` on the first
      1F1B stage and 1 on the last; ``p (1 + (p - 1) / (p v))`` and ``p - (p - 1) / v`` under
      interleaving). Full recompute keeps each layer's input and, while one layer is
      recomputed, that layer's full activations. Layers offloaded to host memory
      (``PlanSpec.offload_fraction``) keep none but one layer's staging buffer
      (``offload.resident_activation_bytes``). The last stage adds ``LOGIT_BYTES`` per token
      and local vocabulary entry;
    * buffers: pipeline send/receive buffers, two gradient buckets (Megatron-Core's buckets are
      views of the gradient buffer, so for it these 80 MB are an over-count) and
      ``RUNTIME_RESERVE_BYTES``, which ``Breakdown.memory_allocated_bytes`` leaves out.

    Args:
        model, plan, cluster: array pytrees of one configuration.
        temperature: relative softness of the smooth minima (static).
        work: ``workload.layer_work(model, plan)``, computed here when not given.

    Returns:
        (weights, grads, optimizer, activations, buffers), bytes per GPU, each [2].
    """
    work = workload.layer_work(model, plan) if work is None else work
    layers = model.n_layers / plan.pp
    dense_p, expert_p = work.dense_params, work.expert_params
    # LoRA adapters are weights too (``trained_params`` are the adapters when ``lora`` = 1)
    held = _stage_params(
        model, plan, dense_p + work.lora * work.trained_params, expert_p, work.embedding_params
    )
    trained = _stage_params(
        model,
        plan,
        work.trained_params,
        work.trained_expert_params,
        work.trained_embedding_params,
    )
    z = plan.zero
    # the data-parallel ranks of every cp rank hold replicas: ZeRO shards over dp * cp
    dp_cp, edp_cp = plan.dp * plan.cp, plan.dp / plan.ep * plan.cp

    def sharded(stage_from, stage):  # divide by dp * cp from ZeRO stage `stage_from` on
        on = jnp.sum(z[stage_from:])
        dense = stage[0] / (1.0 + on * (dp_cp - 1.0))
        return dense + stage[1] / (1.0 + on * (edp_cp - 1.0))

    weights = WEIGHT_BYTES * sharded(3, held)
    grad_b = grad_bytes(plan)
    # gradients and optimizer state of the trained parameters only
    grads = grad_b * sharded(2, trained)
    opt = OPTIMIZER_STATE_BYTES * sharded(1, trained)
    # ZeRO-3 holds two gathered layers (current + prefetched)
    weights = weights + z[3] * 2.0 * WEIGHT_BYTES * (dense_p + expert_p)

    act_layer = offload.saved_bytes(work, plan)  # under the recompute mix
    act_full = work.activation_bytes[0]
    logits = LOGIT_BYTES * work.head_tokens * model.vocab / plan.tp
    act = offload.resident_activation_bytes(act_layer, layers, _in_flight(plan, temperature), plan)
    act = act + plan.recompute[2] * act_full
    multi = multi_stage(plan.pp)
    act = act + jnp.stack([(1.0 - multi) * logits, logits])
    buckets = smooth.smin2(grad_b * layers * work.trained_params, DP_BUCKET_BYTES, temperature)
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
    has_last = multi_stage(plan.pp)
    allocated = per_stage - RUNTIME_RESERVE_BYTES
    allocated = smooth.smooth_max(allocated * jnp.stack([1.0, has_last]), temperature=temperature)
    peak = allocated + RUNTIME_RESERVE_BYTES
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
        memory_allocated_bytes=allocated,
    )
