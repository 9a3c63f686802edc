"""Collective communication cost: alpha-beta per link level, placed on the topology.

A collective runs over a group of ``n`` ranks of which ``k`` share a node (an NVLink/NVSwitch
domain) and ``n / k`` nodes are joined by NICs through the fabric. Every algorithm is written
with latency (alpha) and bandwidth (beta) terms per level; NCCL picks the fastest algorithm, so
the model takes a smooth minimum over the variants NCCL has for the collective: ring, tree and
hierarchical for all-reduce, the ring alone for all-gather and reduce-scatter (whose ``n - 1``
steps each wait for the slowest hop, which across nodes is a NIC hop).

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


def _links(cluster: ClusterArrays, params: Params, per_node=None):
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


def _present(msg_bytes):
    """Smooth gate: 0 for an empty message, 1 for any real one."""
    return msg_bytes / (msg_bytes + _ZERO_BYTES)


def _transfer(msg_bytes, Bps, params: Params):
    """Time to push ``msg_bytes`` through a link of ``Bps`` with the small-message curve."""
    return (msg_bytes + params.half_bw_bytes * _present(msg_bytes)) / Bps


def all_reduce_s(msg_bytes, group: Placement, cluster, params, temperature):
    """All-reduce of a ``msg_bytes`` buffer over ``group`` (seconds).

    Hierarchical: reduce-scatter inside the node, all-reduce of ``1/k`` across nodes on every
    local rank's NIC share, all-gather inside the node. Ring: one ring over all ranks whose
    inter-node hops share ``k`` NIC shares. Tree: double binary tree, ``2 log2 n`` latency.
    """
    return _collective_s(
        msg_bytes, group, cluster, params, temperature, factor=2.0, all_reduce=True, reduce=True
    )


def reduce_scatter_s(msg_bytes, group, cluster, params, temperature):
    """Reduce-scatter of a ``msg_bytes`` buffer: half an all-reduce's traffic and reduction, on
    a ring over all ranks."""
    return _collective_s(msg_bytes, group, cluster, params, temperature, 1.0, reduce=True)


def all_gather_s(msg_bytes, group, cluster, params, temperature):
    """All-gather into a ``msg_bytes`` buffer: a reduce-scatter's ring, nothing to reduce."""
    return _collective_s(msg_bytes, group, cluster, params, temperature, 1.0)


def _log2_ratio(n):
    """``log2(n) / (n - 1)``, equal to ``1 / ln 2`` at ``n = 1`` (double ``where``)."""
    d = n - 1.0
    ok = jnp.abs(d) > 1e-6
    safe = jnp.where(ok, d, 1.0)
    return jnp.where(ok, jnp.log2(jnp.where(ok, n, 2.0)) / safe, (1.0 - 0.5 * d) / jnp.log(2.0))


def _collective_s(
    msg_bytes,
    group: Placement,
    cluster,
    params,
    temperature,
    factor,
    all_reduce=False,
    reduce=False,
):
    """Every algorithm costs ``(n - 1) * rate``; NCCL's choice is a smooth min of the rates.

    Factoring out ``n - 1`` makes a one-rank group cost exactly zero and gives the gradient at
    ``n = 1`` as the derivative from the feasible side (``n >= 1``).

    A reducing collective also pays ``factor / 2 * msg_bytes / reduce_Bps``: the GPU's pass
    over the whole buffer to reduce and copy it, whatever the group size. Without it bus
    bandwidth would not depend on the group size; measured, it grows with it (A100 NVSwitch:
    193 GB/s on 2 GPUs, 229 on 8, as ``1 / busbw = 1 / B + n / (2 (n - 1)) / reduce_Bps``).
    """
    nvl_Bps, nic_Bps, nvl_lat, nic_lat = _links(cluster, params, group.per_node)
    n, k = group.size, group.per_node
    nodes = group.nodes
    present = _present(msg_bytes)
    # Flat ring: every step limited by the slowest hop; inter-node hops get k NIC shares.
    inter_frac = (nodes - 1.0) / nodes
    crosses = jnp.minimum(2.0 * inter_frac, 1.0)  # 0 in one node, 1 across nodes
    ring_Bps = 1.0 / (
        (1.0 - crosses) / nvl_Bps + crosses / smooth.smin2(nvl_Bps, k * nic_Bps, temperature)
    )
    lat = nvl_lat + (nic_lat - nvl_lat) * crosses
    ring = factor * (_transfer(msg_bytes, ring_Bps, params) / n + present * lat)
    algorithms = [ring]
    if all_reduce:  # NCCL has the hierarchical split and trees for all-reduce only
        # Hierarchical: intra-node RS/AG + inter-node ring on 1/k of the data per NIC share.
        hier = factor * (
            group.intra_share / k * _transfer(msg_bytes, nvl_Bps, params)
            + group.inter_share / nodes * _transfer(msg_bytes / k, nic_Bps, params)
            + present * (group.intra_share * nvl_lat + group.inter_share * nic_lat)
        )
        # log-depth latency; pipelined trees reach about 2/3 of the ring's bandwidth
        tree = factor * (
            _transfer(msg_bytes, ring_Bps, params) * _TREE_BW_PENALTY / n
            + present * _log2_ratio(n) * lat
        )
        algorithms = [hier, ring, tree]
    rates = jnp.stack(algorithms, axis=-1)
    best = (n - 1.0) * smooth.smooth_min(rates, axis=-1, temperature=temperature)
    if reduce:
        best = best + jnp.minimum(n - 1.0, 1.0) * factor / 2.0 * msg_bytes / params.reduce_Bps
    return best + _call_overhead(msg_bytes, n, params)


def _call_overhead(msg_bytes, n, params):
    """Fixed cost of one collective call; none for a one-rank group or an empty message
    (``min(n - 1, 1)``: exact at n = 1, derivative from the feasible side)."""
    return params.collective_overhead_s * _present(msg_bytes) * jnp.minimum(n - 1.0, 1.0)


def all_to_all_s(msg_bytes, group: Placement, cluster, params, temperature):
    """All-to-all where every rank holds ``msg_bytes`` and keeps ``1/n`` of it."""
    nvl_Bps, nic_Bps, nvl_lat, nic_lat = _links(cluster, params, group.per_node)
    n, k = group.size, group.per_node
    present = _present(msg_bytes)
    intra = (k - 1.0) / n * msg_bytes
    inter = (n - k) / n * msg_bytes
    return (
        _transfer(intra, nvl_Bps, params)
        + _transfer(inter, nic_Bps, params)
        + present * ((k - 1.0) * nvl_lat + (n - k) / k * nic_lat)
        + _call_overhead(msg_bytes, n, params)
    )


def send_recv_s(msg_bytes, inter_node, cluster, params):
    """Point-to-point send of ``msg_bytes``; ``inter_node`` in [0, 1] is the share crossing NICs."""
    nvl_Bps, nic_Bps, nvl_lat, nic_lat = _links(cluster, params)
    present = _present(msg_bytes)
    intra_t = _transfer(msg_bytes, nvl_Bps, params) + present * nvl_lat
    inter_t = _transfer(msg_bytes, nic_Bps, params) + present * nic_lat
    return (
        (1.0 - inter_node) * intra_t + inter_node * inter_t + _call_overhead(msg_bytes, 2.0, params)
    )
