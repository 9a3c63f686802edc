"""Collective communication cost: alpha-beta per link level, placed on the topology.

A collective runs over a group of ``n`` ranks of which ``k`` share a node (an NVLink/NVSwitch
domain) and ``n / k`` nodes are joined by NICs through the fabric. Every algorithm is written
with latency (alpha) and bandwidth (beta) terms per level; NCCL picks the fastest algorithm, so
the model takes a smooth minimum over ring, tree and hierarchical variants.

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


@struct.dataclass
class Placement:
    """Where one group of a parallel dimension sits: ``size`` ranks, ``per_node`` per node."""

    size: object
    per_node: object

    @property
    def nodes(self):
        return self.size / self.per_node


def place(degree, stride, gpus_per_node, temperature: float) -> Placement:
    """Placement of a group of ``degree`` ranks spaced ``stride`` apart in the rank order.

    Ranks are numbered node by node; a group whose ranks are ``stride`` apart has
    ``gpus_per_node / stride`` of them in one node, at least 1 and at most ``degree``.
    """
    per_node = smooth.smooth_clip(gpus_per_node / stride, 1.0, degree, temperature)
    return Placement(size=degree, per_node=per_node)


def _links(cluster: ClusterArrays, params: Params):
    """Effective per-direction bandwidths and latencies of the two link levels."""
    nvl_Bps = cluster.nvlink_Bps * params.nvlink_eff
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
    return _collective_s(msg_bytes, group, cluster, params, temperature, factor=2.0)


def reduce_scatter_s(msg_bytes, group, cluster, params, temperature):
    """Reduce-scatter (or all-gather) of a ``msg_bytes`` buffer: half an all-reduce's traffic."""
    return _collective_s(msg_bytes, group, cluster, params, temperature, factor=1.0)


all_gather_s = reduce_scatter_s


def _collective_s(msg_bytes, group: Placement, cluster, params, temperature, factor):
    nvl_Bps, nic_Bps, nvl_lat, nic_lat = _links(cluster, params)
    n, k = group.size, group.per_node
    nodes = group.nodes
    intra_frac = (k - 1.0) / k  # (k-1)/k of the buffer moves inside a node
    inter_frac = (nodes - 1.0) / nodes  # (N-1)/N of the per-rank share crosses nodes
    present = _present(msg_bytes)
    # Hierarchical: intra-node RS/AG + inter-node ring on 1/k of the data per NIC share.
    hier = factor * (
        intra_frac * _transfer(msg_bytes, nvl_Bps, params)
        + inter_frac * _transfer(msg_bytes / k, nic_Bps, params)
    ) + factor * present * ((k - 1.0) * nvl_lat + (nodes - 1.0) * nic_lat)
    # Flat ring: every step limited by the slowest hop; inter-node hops get k NIC shares.
    crosses = smooth.smin2(1.0, 2.0 * inter_frac, temperature)  # 0 in one node, 1 across nodes
    ring_Bps = 1.0 / ((1.0 - crosses) / nvl_Bps + crosses / smooth.smin2(nvl_Bps, k * nic_Bps,
                                                                          temperature))
    lat = nvl_lat + (nic_lat - nvl_lat) * crosses
    ring = factor * (n - 1.0) / n * _transfer(msg_bytes, ring_Bps, params) + factor * present * (
        n - 1.0
    ) * lat
    # Tree: log-depth latency; pipelined trees reach about 2/3 of the ring's bandwidth.
    depth = jnp.log2(n)
    tree = factor * (n - 1.0) / n * _transfer(msg_bytes, ring_Bps, params) * _TREE_BW_PENALTY + (
        factor * present * depth * lat
    )
    algos = jnp.stack([hier, ring, tree], axis=-1)
    return smooth.smooth_min(algos, axis=-1, temperature=temperature)


def all_to_all_s(msg_bytes, group: Placement, cluster, params, temperature):
    """All-to-all where every rank holds ``msg_bytes`` and keeps ``1/n`` of it."""
    nvl_Bps, nic_Bps, nvl_lat, nic_lat = _links(cluster, params)
    n, k = group.size, group.per_node
    present = _present(msg_bytes)
    intra = (k - 1.0) / n * msg_bytes
    inter = (n - k) / n * msg_bytes
    return (
        _transfer(intra, nvl_Bps, params)
        + _transfer(inter, nic_Bps, params)
        + present * ((k - 1.0) * nvl_lat + (n - k) / k * nic_lat)
    )


def send_recv_s(msg_bytes, inter_node, cluster, params):
    """Point-to-point send of ``msg_bytes``; ``inter_node`` in [0, 1] is the share crossing NICs."""
    nvl_Bps, nic_Bps, nvl_lat, nic_lat = _links(cluster, params)
    present = _present(msg_bytes)
    intra_t = _transfer(msg_bytes, nvl_Bps, params) + present * nvl_lat
    inter_t = _transfer(msg_bytes, nic_Bps, params) + present * nic_lat
    return (1.0 - inter_node) * intra_t + inter_node * inter_t
