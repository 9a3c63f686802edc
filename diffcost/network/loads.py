"""Link loads of many flows at once: ECMP splits propagated hop by hop on sparse arrays.

``routing.route`` walks each flow's equal-cost paths in Python and returns a dense
``(flows, links)`` incidence; summing the loads of every group of a large job that way is slow
and does not fit in memory (a 1,024-GPU fabric has ~10^4 links, a ring set ~10^4 flows).
Here every flow is a set of ``(flow, node, share)`` entries that move one hop per iteration,
all flows at once: a node forwards its share evenly over its links on least-cost paths to the
flow's destination (the same ECMP rule and tie tolerance as ``routing``; the next links of
every (destination, node) are precomputed once per topology). The loads and path latencies
equal ``route(...)``'s ``weight @ incidence`` and ``incidence @ latency`` (tested).
"""

from __future__ import annotations

import numpy as np

from diffcost.network.graph import Topology
from diffcost.network.routing import LRU, TIE_TOLERANCE, distances, link_cost

_NEXT = LRU(8)


def _next_links(topology: Topology):
    """(starts, links, shares, hops): the links on least-cost paths to endpoint ``t`` out of
    node ``u`` are ``links[starts[k]:starts[k + 1]]`` with ``k = t * nodes + u``, each taking
    ``shares`` of what ``u`` forwards; ``hops`` bounds the hops of any path."""

    def make():
        dist = distances(topology)
        cost = link_cost(topology)
        n = topology.n_nodes
        near = dist[:, topology.src]
        with np.errstate(invalid="ignore"):  # inf - inf off the paths: not on a path
            slack = dist[:, topology.dst] + cost[None, :] - near
        on_path = np.isfinite(near) & (near > 0) & (np.abs(slack) <= TIE_TOLERANCE)
        t, link = np.nonzero(on_path)
        keys = t * n + topology.src[link]
        order = np.argsort(keys, kind="stable")
        keys, link = keys[order], link[order]
        starts = np.searchsorted(keys, np.arange(len(topology.endpoints) * n + 1))
        fanout = np.diff(starts)[keys]
        finite = dist[np.isfinite(dist)]
        hops = int(np.ceil(finite.max())) if finite.size else 0
        return starts, link, 1.0 / fanout, hops

    return _NEXT.get(topology.fingerprint, make)


def _hops(topology: Topology, src: np.ndarray, dst: np.ndarray):
    """Yield ``(flow, link, share)`` per hop: the share of each flow that crosses each link on
    its least-cost paths (ECMP splits), all flows at once.

    Raises:
        ValueError: a destination some source cannot reach.
    """
    starts, next_link, next_share, hops = _next_links(topology)
    dist = distances(topology)
    n = topology.n_nodes
    sources = topology.endpoints[src]
    if not np.isfinite(dist[dst, sources]).all():
        bad = int(np.flatnonzero(~np.isfinite(dist[dst, sources]))[0])
        raise ValueError(f"{topology.name}: endpoint {dst[bad]} cannot be reached from {src[bad]}")
    live = src != dst
    flow, node, share = np.flatnonzero(live), sources[live], np.ones(int(live.sum()))
    for _ in range(hops):
        if not len(flow):
            break
        key = dst[flow] * n + node
        count = starts[key + 1] - starts[key]
        entry = np.repeat(np.arange(len(flow)), count)
        offset = np.arange(len(entry)) - np.repeat(np.cumsum(count) - count, count)
        pos = starts[key][entry] + offset
        link, moved, owner = next_link[pos], share[entry] * next_share[pos], flow[entry]
        yield owner, link, moved
        arrived = topology.dst[link] == topology.endpoints[dst[owner]]
        merged, inverse = np.unique(owner[~arrived] * n + topology.dst[link[~arrived]],
                                    return_inverse=True)  # fmt: skip
        share = np.bincount(inverse.ravel(), weights=moved[~arrived], minlength=len(merged))
        flow, node = merged // n, merged % n


def incidence_entries(topology: Topology, src, dst):
    """The sparse incidence of flows: ``(flow, link, fraction)`` arrays, one entry per link a
    flow crosses (``routing.route``'s nonzero entries, on the same ECMP paths).

    Args:
        topology: the graph.
        src, dst: ``[flows]`` endpoint indices; a flow to itself crosses nothing.

    Raises:
        ValueError: a destination some source cannot reach.
    """
    src, dst = np.asarray(src, dtype=int).ravel(), np.asarray(dst, dtype=int).ravel()
    parts = list(_hops(topology, src, dst))
    if not parts:
        return np.zeros(0, int), np.zeros(0, int), np.zeros(0)
    return tuple(np.concatenate(x) for x in zip(*parts))


def link_loads(topology: Topology, src, dst, weight, link_latency_s=None):
    """Summed link loads of weighted flows, and each flow's mean path latency.

    Args:
        topology: the graph.
        src, dst: ``[flows]`` endpoint indices; a flow to itself crosses nothing.
        weight: ``[flows]`` bytes (or shares) each flow moves.
        link_latency_s: ``[links]`` or ``[k, links]`` latencies to sum along paths (several
            rows: e.g. the NVLink and the network part apart); the topology's if None.

    Returns:
        ``([links] load, [flows] or [flows, k] path latency)``: ``load = weight @ incidence``
        and ``incidence @ link_latency_s.T`` of ``routing.route(topology, src, dst)``.

    Raises:
        ValueError: a destination some source cannot reach.
    """
    src, dst = np.asarray(src, dtype=int).ravel(), np.asarray(dst, dtype=int).ravel()
    weight = np.broadcast_to(np.asarray(weight, dtype=float), src.shape)
    latency = topology.latency_s if link_latency_s is None else np.asarray(link_latency_s)
    rows = np.atleast_2d(latency)
    load = np.zeros(topology.n_links)
    paths = np.zeros((len(src), len(rows)))
    for owner, link, moved in _hops(topology, src, dst):
        load += np.bincount(link, weights=moved * weight[owner], minlength=topology.n_links)
        for k, lat in enumerate(rows):
            paths[:, k] += np.bincount(owner, weights=moved * lat[link], minlength=len(src))
    return load, (paths if np.ndim(latency) == 2 else paths[:, 0])
