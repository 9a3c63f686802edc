"""Collective communication cost: alpha-beta per link level, placed on the topology.

A collective runs over a group of ``n`` ranks of which ``k`` share a node (an NVLink/NVSwitch
domain) and ``n / k`` nodes are joined by NICs through the fabric. Every algorithm is written
with latency (alpha) and bandwidth (beta) terms per level; NCCL picks the fastest algorithm, so
the model takes a smooth minimum over the variants NCCL has for the collective: ring, tree and
hierarchical for all-reduce, the ring alone for all-gather and reduce-scatter (whose ``n - 1``
steps each wait for the slowest hop, which across nodes is a NIC hop). Algorithms are pure
functions in the ``ALGORITHMS`` registry; ``COLLECTIVES`` says which of them each collective
chooses from, so adding one touches this module only.

Bandwidth curve: a link moving ``M`` bytes reaches ``B * M / (M + M_half)``, i.e. the time is
``(M + M_half) / B``: a smooth small-message penalty that vanishes for large messages.

Sharing: all groups of one parallel dimension communicate at the same time. With one NIC share
per GPU (``nic_Bps`` is the node's NIC bandwidth divided by its GPUs) each rank's inter-node
traffic uses its own share, so concurrent groups of the same dimension do not slow each other
beyond that share; different dimensions overlapping on the same link are handled by the caller.

References:
    Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
    MPICH" (2005) for ring/tree costs; NCCL's tuning model (hierarchical ring, tree); the
    nccl-tests bus-bandwidth factors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from diffcost import smooth
from diffcost.arrays import ClusterArrays
from diffcost.params import Params

_ZERO_BYTES = 1.0  # a message below ~1 byte is treated as absent (smooth gate)
_TREE_BW_PENALTY = 1.5
_TINY = 1e-9


@struct.dataclass
class Placement:
    """Where one group of a parallel dimension sits: ``size`` ranks, ``per_node`` per node.

    ``intra_share`` and ``inter_share`` are ``(per_node - 1) / (size - 1)`` and
    ``(nodes - 1) / (size - 1)``: how each rank added to the group splits between a node's
    NVLink domain and new nodes. At ``size == 1`` they take their limits as the group grows,
    so that costs written as ``(size - 1) * rate`` have the right derivative at one rank.
    """

    size: object
    per_node: object
    intra_share: object
    inter_share: object

    @property
    def nodes(self):
        return self.size / self.per_node


def place(degree, stride, gpus_per_node) -> Placement:
    """Placement of a group of ``degree`` ranks spaced ``stride`` apart in the rank order.

    Ranks are numbered node by node; a group whose ranks are ``stride`` apart has
    ``gpus_per_node / stride`` of them in one node, at least 1 and at most ``degree``.
    The clip is piecewise linear (``smooth.clip_exact``): a group of one rank, or one that fits
    in a node, must have exactly no inter-node traffic, which a smooth clip would blur at the
    boundaries where discrete plans sit.
    """
    fit = gpus_per_node / stride
    per_node = smooth.clip_exact(fit, 1.0, degree)
    grown = degree - 1.0
    ok = grown > _TINY
    den = jnp.where(ok, grown, 1.0)
    limit_intra = jnp.where(fit > 1.0, 1.0, 0.0)  # a second rank lands in the same node?
    intra = jnp.where(ok, (per_node - 1.0) / den, limit_intra)
    inter = jnp.where(ok, (degree / per_node - 1.0) / den, 1.0 - limit_intra)
    return Placement(size=degree, per_node=per_node, intra_share=intra, inter_share=inter)


@struct.dataclass
class GroupLinks:
    """The links one group's collectives run over, at their effective rates.

    NVLink and NIC bandwidths (per direction) and latencies as calibrated, and the flat ring
    through the group: every ring step is limited by its slowest hop, and across nodes the
    inter-node hops get ``per_node`` NIC shares.
    """

    group: Placement
    nvlink_Bps: jax.Array
    nic_Bps: jax.Array
    nvlink_latency_s: jax.Array
    nic_latency_s: jax.Array
    ring_Bps: jax.Array
    ring_latency_s: jax.Array


def _link_rates(cluster: ClusterArrays, params: Params, per_node=None):
    """Effective per-direction bandwidths and latencies of the two link levels.

    A ring over ``per_node`` GPUs of a node uses ``cluster.ring_share`` of the GPU's NVLink
    bandwidth (1 behind a switch, less on a point-to-point mesh: ``diffcost.topology``),
    interpolated piecewise linearly in ``per_node``.
    """
    nvl_Bps = cluster.nvlink_Bps * params.nvlink_eff
    if per_node is not None:
        sizes = jnp.arange(cluster.ring_share.shape[-1], dtype=cluster.ring_share.dtype)
        nvl_Bps = nvl_Bps * jnp.interp(per_node, sizes, cluster.ring_share)
    nic_Bps = cluster.nic_Bps * params.nic_eff / cluster.oversubscription
    nvl_lat = cluster.nvlink_latency_s * params.nvlink_latency_scale
    nic_lat = cluster.nic_latency_s * params.nic_latency_scale
    return nvl_Bps, nic_Bps, nvl_lat, nic_lat


def group_links(group: Placement, cluster: ClusterArrays, params: Params, temperature):
    """``GroupLinks`` of ``group`` (its fields may be arrays: one group per element)."""
    nvl_Bps, nic_Bps, nvl_lat, nic_lat = _link_rates(cluster, params, group.per_node)
    nodes = group.nodes
    inter_frac = (nodes - 1.0) / nodes
    crosses = jnp.minimum(2.0 * inter_frac, 1.0)  # 0 in one node, 1 across nodes
    nic_hop_Bps = smooth.smin2(nvl_Bps, group.per_node * nic_Bps, temperature)
    return GroupLinks(
        group=group,
        nvlink_Bps=nvl_Bps,
        nic_Bps=nic_Bps,
        nvlink_latency_s=nvl_lat,
        nic_latency_s=nic_lat,
        ring_Bps=1.0 / ((1.0 - crosses) / nvl_Bps + crosses / nic_hop_Bps),
        ring_latency_s=nvl_lat + (nic_lat - nvl_lat) * crosses,
    )


def _present(msg_bytes):
    """Smooth gate: 0 for an empty message, 1 for any real one."""
    return msg_bytes / (msg_bytes + _ZERO_BYTES)


def _transfer(msg_bytes, Bps, params: Params):
    """Time to push ``msg_bytes`` through a link of ``Bps`` with the small-message curve."""
    return (msg_bytes + params.half_bw_bytes * _present(msg_bytes)) / Bps


def _log2_ratio(n):
    """``log2(n) / (n - 1)``, equal to ``1 / ln 2`` at ``n = 1`` (double ``where``)."""
    d = n - 1.0
    ok = jnp.abs(d) > 1e-6
    safe = jnp.where(ok, d, 1.0)
    return jnp.where(ok, jnp.log2(jnp.where(ok, n, 2.0)) / safe, (1.0 - 0.5 * d) / jnp.log(2.0))


# --- algorithms ---------------------------------------------------------------------------------
# An algorithm is a pure function ``(msg_bytes, links: GroupLinks, params) -> seconds``: the time
# of one of the ``n - 1`` steps of a collective that moves the buffer once (all-gather or
# reduce-scatter traffic); ``collective_s`` scales it by the collective's traffic and by
# ``n - 1``. Adding an algorithm is a function and an entry in ``ALGORITHMS``.

AlgorithmFn = Callable[[jax.Array, GroupLinks, Params], jax.Array]


def ring_step_s(msg_bytes, links: GroupLinks, params: Params):
    """Flat ring over all ranks: ``1 / n`` of the buffer per step at the ring's bandwidth.

    References:
        Thakur, Rabenseifner & Gropp (2005), ring all-gather and reduce-scatter.
    """
    n = links.group.size
    return _transfer(msg_bytes, links.ring_Bps, params) / n + (
        _present(msg_bytes) * links.ring_latency_s
    )


def hierarchical_step_s(msg_bytes, links: GroupLinks, params: Params):
    """Reduce-scatter / all-gather inside the node, ring across nodes on ``1 / k`` of the data
    through every local rank's NIC share (NCCL's hierarchical all-reduce)."""
    g = links.group
    k, nodes = g.per_node, g.nodes
    return (
        g.intra_share / k * _transfer(msg_bytes, links.nvlink_Bps, params)
        + g.inter_share / nodes * _transfer(msg_bytes / k, links.nic_Bps, params)
        + _present(msg_bytes)
        * (g.intra_share * links.nvlink_latency_s + g.inter_share * links.nic_latency_s)
    )


def tree_step_s(msg_bytes, links: GroupLinks, params: Params):
    """Double binary tree: ``2 log2 n`` latency; pipelined trees reach about 2/3 of the ring's
    bandwidth (NCCL's tree all-reduce)."""
    n = links.group.size
    return _transfer(msg_bytes, links.ring_Bps, params) * _TREE_BW_PENALTY / n + (
        _present(msg_bytes) * _log2_ratio(n) * links.ring_latency_s
    )


ALGORITHMS: dict[str, AlgorithmFn] = {
    "hierarchical": hierarchical_step_s,
    "ring": ring_step_s,
    "tree": tree_step_s,
}


@dataclasses.dataclass(frozen=True)
class Collective:
    """How a collective is costed.

    Attributes:
        traffic: buffer passes over the links per rank: 2 for an all-reduce (a reduce-scatter
            then an all-gather), 1 otherwise.
        algorithms: keys of ``ALGORITHMS`` that NCCL chooses from for it.
        reduces: whether the GPU also passes over the buffer to reduce it.
    """

    traffic: float
    algorithms: tuple[str, ...]
    reduces: bool


# NCCL has the hierarchical split and trees for all-reduce only; all-gather and reduce-scatter
# run on the ring, whose ``n - 1`` steps each wait for the slowest hop.
COLLECTIVES: dict[str, Collective] = {
    "all_reduce": Collective(
        traffic=2.0, algorithms=("hierarchical", "ring", "tree"), reduces=True
    ),
    "reduce_scatter": Collective(1.0, algorithms=("ring",), reduces=True),
    "all_gather": Collective(1.0, algorithms=("ring",), reduces=False),
}


def collective_s(name: str, msg_bytes, group: Placement, cluster, params, temperature):
    """Time of the collective ``name`` (a key of ``COLLECTIVES``) on a ``msg_bytes`` buffer.

    Every algorithm costs ``(n - 1) * step``; NCCL's choice is a smooth minimum of the steps.
    Factoring out ``n - 1`` makes a one-rank group cost exactly zero and gives the gradient at
    ``n = 1`` as the derivative from the feasible side (``n >= 1``).

    A reducing collective also pays ``traffic / 2 * msg_bytes / reduce_Bps``: the GPU's pass
    over the whole buffer to reduce and copy it, whatever the group size. Without it bus
    bandwidth would not depend on the group size; measured, it grows with it (A100 NVSwitch:
    193 GB/s on 2 GPUs, 229 on 8, as ``1 / busbw = 1 / B + n / (2 (n - 1)) / reduce_Bps``).

    Args:
        name: the collective, e.g. ``"all_reduce"``.
        msg_bytes: buffer size in bytes (array; broadcasts with the group's fields, so one call
            costs many collectives).
        group: the ranks' ``Placement``.
        cluster, params: hardware and calibrated constants.
        temperature: softness of the smooth minimum over algorithms (static).

    Returns:
        Seconds, shaped like ``msg_bytes`` broadcast with the group.
    """
    links = group_links(group, cluster, params, temperature)
    return collective_links_s(name, msg_bytes, links, params, temperature)


def collective_links_s(name: str, msg_bytes, links: GroupLinks, params, temperature):
    """``collective_s`` over a group whose ``GroupLinks`` are already known (a caller costing
    several collectives on one group computes them once)."""
    spec = COLLECTIVES[name]
    group = links.group
    steps = [spec.traffic * ALGORITHMS[a](msg_bytes, links, params) for a in spec.algorithms]
    step = steps[0]
    if len(steps) > 1:
        step = smooth.smooth_min(jnp.stack(steps, axis=-1), axis=-1, temperature=temperature)
    n = group.size
    best = (n - 1.0) * step
    if spec.reduces:
        best = best + jnp.minimum(n - 1.0, 1.0) * spec.traffic / 2.0 * msg_bytes / params.reduce_Bps
    return best + _call_overhead(msg_bytes, n, params)


def all_reduce_s(msg_bytes, group: Placement, cluster, params, temperature):
    """All-reduce of a ``msg_bytes`` buffer over ``group`` (seconds): hierarchical, ring or tree,
    whichever is fastest (see ``collective_s``)."""
    return collective_s("all_reduce", msg_bytes, group, cluster, params, temperature)


def reduce_scatter_s(msg_bytes, group: Placement, cluster, params, temperature):
    """Reduce-scatter of a ``msg_bytes`` buffer: half an all-reduce's traffic and reduction, on
    a ring over all ranks."""
    return collective_s("reduce_scatter", msg_bytes, group, cluster, params, temperature)


def all_gather_s(msg_bytes, group: Placement, cluster, params, temperature):
    """All-gather into a ``msg_bytes`` buffer: a reduce-scatter's ring, nothing to reduce."""
    return collective_s("all_gather", msg_bytes, group, cluster, params, temperature)


def collectives_s(requests, params, temperature) -> list:
    """Times of many collectives: ``(name, msg_bytes, links)`` each, ``links`` the group's
    ``GroupLinks`` (see ``collective_links_s``); a list in the requests' order.

    Each is costed on its own scalars: stacking them on a small trailing axis would save
    operations in one prediction but slows a batched sweep, which vectorizes over the batch.
    """
    return [collective_links_s(n, msg, links, params, temperature) for n, msg, links in requests]


def _call_overhead(msg_bytes, n, params):
    """Fixed cost of one collective call; none for a one-rank group or an empty message
    (``min(n - 1, 1)``: exact at n = 1, derivative from the feasible side)."""
    return params.collective_overhead_s * _present(msg_bytes) * jnp.minimum(n - 1.0, 1.0)


def all_to_all_s(msg_bytes, group: Placement, cluster, params, temperature):
    """All-to-all where every rank holds ``msg_bytes`` and keeps ``1/n`` of it."""
    links = group_links(group, cluster, params, temperature)
    return all_to_all_links_s(msg_bytes, links, params)


def all_to_all_links_s(msg_bytes, links: GroupLinks, params):
    """``all_to_all_s`` over a group whose ``GroupLinks`` are already known: the ``k - 1``
    ranks of the node over NVLink, the ``n - k`` others over the NIC share."""
    n, k = links.group.size, links.group.per_node
    present = _present(msg_bytes)
    intra = (k - 1.0) / n * msg_bytes
    inter = (n - k) / n * msg_bytes
    return (
        _transfer(intra, links.nvlink_Bps, params)
        + _transfer(inter, links.nic_Bps, params)
        + present * ((k - 1.0) * links.nvlink_latency_s + (n - k) / k * links.nic_latency_s)
        + _call_overhead(msg_bytes, n, params)
    )


def send_recv_s(msg_bytes, inter_node, cluster, params):
    """Point-to-point send of ``msg_bytes``; ``inter_node`` in [0, 1] is the share crossing NICs."""
    nvl_Bps, nic_Bps, nvl_lat, nic_lat = _link_rates(cluster, params)
    present = _present(msg_bytes)
    intra_t = _transfer(msg_bytes, nvl_Bps, params) + present * nvl_lat
    inter_t = _transfer(msg_bytes, nic_Bps, params) + present * nic_lat
    return (
        (1.0 - inter_node) * intra_t + inter_node * inter_t + _call_overhead(msg_bytes, 2.0, params)
    )
