"""A training iteration with its collectives priced on a topology graph: the job-time seam.

``diffcost design`` and ``diffcost explain --topology`` ask how the iteration time of one job
(model, discrete plan, cluster) changes with the capacity of every link of a ``Topology``.
They read it through one function, ``JobTimeFn = (capacity_Bps [links], job, params,
temperature) -> seconds``, so that any graph-aware prediction path can serve them. The default,
``graph_iteration_s``, is the cost model's own iteration with its communication priced on the
graph:

* every collective ``diffcost.stages.comm_times`` costs is listed by ``comm_requests`` with
  its message size (from ``workload.layer_work`` and the constants of ``stages``) and the
  parallel dimension it runs over; ``tests/test_network_design.py`` checks that costing this
  list with ``diffcost.comm`` gives ``stages.comm_times`` field by field;
* each is priced with ``diffcost.network.cost.collective_time_s`` on the groups the plan's
  rank order places (``collectives.place_ranks``), all groups of a dimension at once; the
  pipeline sends are one phase of concurrent flows (every stage boundary of every pipeline);
* the layer, stage, pipeline, data-parallel and optimizer composition is the model's own
  (``stages.layer_parts_s``, ``stage_s``, ``dp_sync_s``, ``simulate.pipeline_time``), so
  compute, overlap and the bubble are exactly what ``diffcost predict`` computes.

Concurrent collectives of different dimensions do not share links here (each is priced as if
alone); contention between them is the graph-aware prediction path's business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import kernels, smooth, stages, workload
from diffcost.api import experiment_arrays
from diffcost.arrays import ClusterArrays, ModelArrays, PlanArrays
from diffcost.gpus import gpu_family
from diffcost.network import collectives as netcoll
from diffcost.network import cost, nvls
from diffcost.network.graph import Topology, without_transit
from diffcost.network.routing import route
from diffcost.params import Params
from diffcost.simulate import pipeline_time
from diffcost.specs import PlanSpec

SEND = "send"  # the pipeline's point-to-point activation send, beside cost.TRAFFIC's collectives
STACKED = ("all_reduce_s", "reduce_scatter_s")  # CommTimes fields of 3 entries: dense, expert, emb


def comm_requests(work: workload.LayerWork, model, plan) -> tuple:
    """Every collective of one iteration as ``stages.comm_times`` costs it.

    Returns:
        ``(CommTimes field, collective, dimension, msg_bytes)`` per call: fields listed twice
        add (ZeRO-3 gathers of dense and expert weights), ``STACKED`` fields stack their three
        entries (dense, expert, embedding gradients); ``collective`` is a key of
        ``cost.TRAFFIC`` or ``SEND``, ``dimension`` one of ``collectives.GROUP_DIMS``.
    """
    dense, experts = work.dense_params, work.expert_params
    g_dense, g_experts = work.trained_params, work.trained_expert_params
    embedding = work.trained_embedding_params
    grads = stages.grad_bytes(plan)
    stage_params = model.n_layers / plan.pp * (g_dense + g_experts)
    loss_bytes = work.head_tokens * stages.LOSS_COMM_BYTES_PER_TOKEN
    requests = [
        ("tp_all_gather_s", "all_gather", "tp", work.tp_msg_bytes),
        ("tp_reduce_scatter_s", "reduce_scatter", "tp", work.tp_msg_bytes),
        ("tp_all_reduce_s", "all_reduce", "tp", work.tp_msg_bytes),
        ("loss_all_reduce_s", "all_reduce", "tp", loss_bytes),
        ("cp_all_gather_s", "all_gather", "cp", work.kv_msg_bytes),
        ("ep_all_to_all_s", "all_to_all", "ep", work.ep_msg_bytes),
        ("zero3_gather_s", "all_gather", "dp", dense * stages.WEIGHT_BYTES),
        ("zero3_gather_s", "all_gather", "edp", experts * stages.WEIGHT_BYTES),
        ("zero3_scatter_s", "reduce_scatter", "dp", g_dense * stages.FSDP_GRAD_BYTES),
        ("zero3_scatter_s", "reduce_scatter", "edp", g_experts * stages.FSDP_GRAD_BYTES),
        ("stage_gather_s", "all_gather", "dp", stage_params * stages.WEIGHT_BYTES),
        ("p2p_s", SEND, "pp", work.p2p_msg_bytes),
    ]
    for name in STACKED:
        collective = name.removesuffix("_s")
        requests += [
            (name, collective, "dp", g_dense * grads),
            (name, collective, "edp", g_experts * grads),
            (name, collective, "dp", embedding * grads),
        ]
    return tuple(requests)


def assemble_comm_times(requests, times) -> stages.CommTimes:
    """``stages.CommTimes`` from the seconds of each of ``comm_requests`` (in its order)."""
    parts: dict[str, list] = {}
    for (field, *_), t in zip(requests, times):
        parts.setdefault(field, []).append(t)
    return stages.CommTimes(
        **{f: jnp.stack(v) if f in STACKED else sum(v[1:], v[0]) for f, v in parts.items()}
    )


# --- the job and its pricings (numpy, outside jit) ----------------------------------------------


@struct.dataclass
class GraphJob:
    """One job on one topology, everything shape-related fixed outside jit.

    Attributes:
        model, plan, cluster: array pytrees of the configuration (``api.experiment_arrays``).
        pricings: ``{"collective:dim": cost.CollectivePricing}`` of every collective the
            iteration runs over a dimension of two or more ranks (absent: one rank, no time).
        capacity_Bps: ``[links]`` the topology's link capacities as built.
        link_class: ``[links]`` class index of each link (``CLASSES``).
        extra: whatever another ``JobTimeFn`` precomputes outside jit (its routes, say);
            ``graph_iteration_s`` does not read it.
    """

    model: ModelArrays
    plan: PlanArrays
    cluster: ClusterArrays
    pricings: dict
    capacity_Bps: jnp.ndarray
    link_class: jnp.ndarray
    extra: object = None


# Link classes, by the higher tier of a link's two ends: NVLink between GPUs and NVSwitches
# (and direct GPU links: tori, meshes), NIC (GPU-NIC, NIC-leaf, host-leaf), leaf-spine,
# spine-core.
CLASSES = ("nvlink", "nic", "leaf_spine", "spine_core")
KIND_TIER = {"gpu": 0, "nvswitch": 0, "nic": 1, "host": 1, "leaf": 1, "spine": 2, "core": 3}


def link_classes(topology: Topology) -> np.ndarray:
    """``[links]`` index into ``CLASSES`` of each link: the higher tier of its ends' kinds."""
    tier = np.array([KIND_TIER[k] for k in topology.kinds], dtype=int)
    return np.maximum(tier[topology.src], tier[topology.dst])


def grouped(topology: Topology, endpoints: np.ndarray) -> Topology:
    """``topology`` with its endpoints reordered: ``endpoints`` (indices) first, in that order,
    then the rest; so that groups laid out in ``endpoints`` are consecutive ranks."""
    rest = np.setdiff1d(np.arange(len(topology.endpoints)), endpoints)
    order = np.concatenate([np.asarray(endpoints, dtype=int), rest])
    coords = None if topology.coords is None else topology.coords[order]
    return dataclasses.replace(
        topology, endpoints=topology.endpoints[order], domain=topology.domain[order], coords=coords
    )


def send_pricing(topology: Topology, groups: np.ndarray) -> cost.CollectivePricing:
    """Pipeline sends: every stage boundary of every pipeline (``groups [pipelines, pp]``,
    endpoint indices) sends at once, one step, one path latency; no reduction."""
    src, dst = groups[:, :-1].ravel(), groups[:, 1:].ravel()
    idle = np.setdiff1d(topology.endpoints, topology.endpoints[groups.ravel()])
    routes = route(without_transit(topology, idle), src, dst)
    links = np.flatnonzero((routes.incidence > 0).any(axis=0))
    arrays = cost.AlgorithmArrays(
        incidence=jnp.asarray(routes.incidence[None][:, :, links]),
        frac=jnp.ones((1, len(src))),
        steps=jnp.ones(1),
        latency_steps=jnp.ones(1),
        in_switch=jnp.asarray(0.0),
    )
    return cost.CollectivePricing(
        links=jnp.asarray(links),
        nvlink=jnp.asarray(cost.link_classes(topology)[links]),
        latency_s=jnp.asarray(topology.latency_s[links]),
        group_size=2.0,
        algorithms=(arrays,),
        names=("p2p",),
        collective="all_gather",
    )


def job_pricings(
    topology: Topology, plan: PlanSpec, requests, nvls_channels: int = nvls.DEFAULT_NVLS_CHANNELS
) -> dict:
    """``GraphJob.pricings`` of a discrete plan on ``topology`` (rank ``r`` on endpoint ``r``).

    Args:
        topology: the graph; at least ``plan.n_gpus`` endpoints.
        plan: the discrete plan (degrees and rank order).
        requests: ``(collective, dim)`` pairs to price.
        nvls_channels: NCCL's NVLS channels on the job's GPUs (``nvls.nvls_channels``).

    Raises:
        ValueError: too few endpoints, or a placement ``collectives.place_ranks`` rejects.
    """
    layout = netcoll.place_ranks(topology, plan)
    out = {}
    for collective, dim in requests:
        size = layout.degrees[dim]
        if size < 2:
            continue
        groups = layout.endpoint[layout.groups(dim)]
        if collective == SEND:
            out[f"{collective}:{dim}"] = send_pricing(topology, groups)
            continue
        placed = grouped(topology, groups.ravel())
        out[f"{collective}:{dim}"] = cost.collective_pricing(
            placed, collective, size, len(groups), nvls_channels=nvls_channels
        )
    return out


def make_job(
    topology: Topology, plan: PlanSpec, model, plan_arrays, cluster, extra=None, family=None
) -> GraphJob:
    """A ``GraphJob``: the pricings of ``plan`` on ``topology`` with its arrays (and
    ``extra``, a pytree another ``JobTimeFn`` needs); ``family``: the GPU family, whose NCCL
    NVLS channel count sets NVLS's chunk sizes (``nvls.nvls_channels``; None: Hopper's)."""
    requests = comm_requests(workload.layer_work(model, plan_arrays), model, plan_arrays)
    pairs = sorted({(collective, dim) for _, collective, dim, _ in requests})
    return GraphJob(
        model=model,
        plan=plan_arrays,
        cluster=cluster,
        pricings=job_pricings(topology, plan, pairs, nvls.nvls_channels(family)),
        capacity_Bps=jnp.asarray(topology.capacity_Bps),
        link_class=jnp.asarray(link_classes(topology)),
        extra=extra,
    )


def experiment_job(topology: Topology, exp) -> GraphJob:
    """``make_job`` for an ``Experiment``'s plan on ``topology``, with the NVLS channels of
    its GPU family."""
    family = gpu_family(exp.cluster.gpu.name)
    return make_job(topology, exp.plan, *experiment_arrays(exp), family=family)


# --- the iteration time (JAX) -------------------------------------------------------------------

JobTimeFn = Callable[[jnp.ndarray, GraphJob, Params, float], jnp.ndarray]


def graph_comm_times(work, job: GraphJob, capacity_Bps, params, temperature) -> stages.CommTimes:
    """``stages.CommTimes`` with every collective priced on the graph's ``capacity_Bps``."""
    requests = comm_requests(work, job.model, job.plan)
    times = []
    for _, collective, dim, msg in requests:
        pricing = job.pricings.get(f"{collective}:{dim}")
        if pricing is None:
            times.append(0.0 * msg)
        else:
            times.append(cost.collective_time_s(pricing, msg, capacity_Bps, params, temperature))
    return assemble_comm_times(requests, times)


def graph_iteration_s(
    capacity_Bps, job: GraphJob, params: Params, temperature=smooth.DEFAULT_TEMPERATURE
):
    """Seconds of one iteration with the collectives priced on links of ``capacity_Bps``.

    The model's composition (``stages``, ``simulate.pipeline_time``) around
    ``graph_comm_times``: what ``simulate`` computes, the communication from the graph.

    Args:
        capacity_Bps: ``[links]`` capacity of every link of the job's topology (B/s).
        job: ``make_job(...)``.
        params: calibrated constants.
        temperature: softness of every smooth max/min (static).
    """
    model, plan, cluster = job.model, job.plan, job.cluster
    work = workload.layer_work(model, plan)
    comms = graph_comm_times(work, job, capacity_Bps, params, temperature)
    kernel = kernels.kernel_times(work, model, cluster, params, temperature, None)
    layer = stages.layer_parts_s(work, kernel, comms, model, plan, cluster, params, temperature)
    fwd, bwd, parts = stages.stage_s(layer, kernel, comms, work, model, plan, cluster, params)
    bucket, after = stages.dp_sync_s(comms, plan)
    st = stages.stage_times(model, plan, cluster, params, temperature, None, work)
    ones = jnp.ones(3, dtype=fwd.dtype)
    st = st.replace(
        fwd_s=fwd,
        bwd_s=bwd,
        parts=parts,
        p2p_s=comms.p2p_s,
        dp_bucket_s=bucket * ones,
        layer_bwd_s=jnp.sum(layer[1]) * ones,
        dp_after_s=after,
    )
    pipe_dp = pipeline_time(st, temperature)[0]
    return pipe_dp + st.optimizer_s + st.overhead_s


def default_time_fn() -> JobTimeFn:
    """The ``JobTimeFn`` every caller that passes none uses (``design``, ``explain
    --topology``, the benchmark): the one line to change to point them all at another
    graph-aware prediction path."""
    return graph_iteration_s


def median_time_fn(time_fn: JobTimeFn | None = None) -> JobTimeFn:
    """A ``JobTimeFn`` whose ``params`` are a population's members with a leading member axis
    (``population.stack_members``): the exponential of their mean log time under ``time_fn``
    (None: ``default_time_fn()``), as ``predict`` times a cluster without a profile of its
    own."""
    base = default_time_fn() if time_fn is None else time_fn

    def time_s(capacity_Bps, job, members, temperature):
        each = jax.vmap(lambda p: base(capacity_Bps, job, p, temperature))(members)
        return jnp.exp(jnp.mean(jnp.log(each)))

    return time_s


def scaled_capacity(class_scale, job: GraphJob):
    """``[links]`` capacities with each link's class multiplier ``class_scale [CLASSES]``."""
    return job.capacity_Bps * jnp.take(jnp.asarray(class_scale), job.link_class)


def job_time_s(
    class_scale,
    job: GraphJob,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
    time_fn: JobTimeFn | None = None,
):
    """Iteration seconds of ``job`` with every link of class ``c`` at ``class_scale[c]`` times
    its capacity (``[len(CLASSES)]``). ``time_fn`` is the seam: any ``JobTimeFn``; None for
    ``default_time_fn()``."""
    time_fn = default_time_fn() if time_fn is None else time_fn
    return time_fn(scaled_capacity(class_scale, job), job, params, temperature)
