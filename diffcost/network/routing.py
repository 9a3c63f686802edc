"""Shortest-path routing with ECMP: flows between endpoints as a ``(flows, links)`` incidence.

A flow from endpoint ``s`` to endpoint ``t`` follows the shortest paths in hops; among paths
of equal hops, the one with the wider links (``link_cost``). Where several links lead on
equal-cost paths to ``t`` (equal-cost multipath), a node splits what it forwards evenly over
them, as hash-based ECMP does on average; ``incidence[f, l]`` is the share of flow
``f``'s bytes that crosses directed link ``l``. Every path of a flow therefore carries a total
of 1 out of its source and into its destination, and ``incidence @ latency_s`` is the flow's
mean latency over its paths.

This is the contract with the contention model: a set of concurrent flows enters the jitted
program as ``incidence`` (flows, links), ``capacity_Bps`` (links: bandwidth per direction
times the link count) and ``latency_s`` (links), fixed in shape for a (topology, placement),
so a sweep over plans reuses them. Routes are cached per topology fingerprint.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

from diffcost.network.graph import Topology

WIDTH_TIE_BREAK = 1e-4  # most a link's width adds to its cost of one hop
TIE_TOLERANCE = 1e-9  # path costs closer than this are equal (ECMP)


class LRU:
    """A small least-recently-used cache: ``get(key, make)`` calls ``make()`` on a miss."""

    def __init__(self, size: int):
        self.size = size
        self.items: OrderedDict = OrderedDict()

    def get(self, key, make):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = make()
        self.items[key] = value
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


_DISTANCES = LRU(16)
_ROUTES = LRU(256)


@dataclasses.dataclass(frozen=True, eq=False)
class Routes:
    """Flows routed on a topology (read-only arrays).

    Attributes:
        incidence: ``[flows, links]`` share of each flow's bytes on each directed link.
        capacity_Bps: ``[links]`` per-direction bandwidth times link count (B/s).
        latency_s: ``[links]`` latency of one hop (s).
        src, dst: ``[flows]`` endpoint indices (positions in ``topology.endpoints``).
    """

    incidence: np.ndarray
    capacity_Bps: np.ndarray
    latency_s: np.ndarray
    src: np.ndarray
    dst: np.ndarray

    def __post_init__(self):
        for array in (self.incidence, self.capacity_Bps, self.latency_s, self.src, self.dst):
            array.setflags(write=False)

    @property
    def path_latency_s(self) -> np.ndarray:
        """``[flows]`` latency of each flow, averaged over its ECMP paths (s)."""
        return self.incidence @ self.latency_s

    def padded(self, n_flows: int) -> tuple[np.ndarray, np.ndarray]:
        """``incidence`` with zero rows up to ``n_flows``, and the ``[n_flows]`` mask of real
        flows: flow sets of different sizes stacked to one shape (a padded flow crosses no
        link, so it adds nothing to any load)."""
        if n_flows < len(self.src):
            raise ValueError(f"n_flows={n_flows}: fewer than the {len(self.src)} flows")
        pad = n_flows - len(self.src)
        incidence = np.concatenate([self.incidence, np.zeros((pad, self.incidence.shape[1]))])
        return incidence, np.arange(n_flows) < len(self.src)

    @property
    def load(self) -> np.ndarray:
        """``[links]`` flows crossing each link when every flow moves one byte."""
        return self.incidence.sum(axis=0)


def _out_links(topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """Links sorted by source node, and where each node's run starts (``[nodes + 1]``)."""
    order = np.argsort(topology.src, kind="stable")
    starts = np.searchsorted(topology.src[order], np.arange(topology.n_nodes + 1))
    return order, starts


def link_cost(topology: Topology) -> np.ndarray:
    """``[links]`` routing cost: one per hop, plus at most ``WIDTH_TIE_BREAK`` for a narrow
    link, so that among paths of equal hops the wider one wins (NVLink before a shared NIC's
    PCIe hairpin); paths of equal hops and equal links tie exactly and split by ECMP."""
    return 1.0 + WIDTH_TIE_BREAK * topology.bandwidth_Bps.min() / topology.bandwidth_Bps


def distances(topology: Topology) -> np.ndarray:
    """``[endpoints, nodes]`` routing cost from every node to each endpoint (inf if none).

    Bellman-Ford for all endpoints at once on arrays: each round, a node's cost becomes the
    least over its links of the link's cost plus the cost from the link's far end.
    """

    def compute():
        order, starts = _out_links(topology)
        dst, cost = topology.dst[order], link_cost(topology)[order]
        has_out = np.flatnonzero(np.diff(starts) > 0)
        n_targets = len(topology.endpoints)
        dist = np.full((n_targets, topology.n_nodes), np.inf)
        dist[np.arange(n_targets), topology.endpoints] = 0.0
        for _ in range(topology.n_nodes):
            via = np.minimum.reduceat(dist[:, dst] + cost, starts[has_out], axis=1)
            new = dist.copy()
            new[:, has_out] = np.minimum(dist[:, has_out], via)
            if (new == dist).all():
                break
            dist = new
        return dist

    return _DISTANCES.get(topology.fingerprint, compute)


def _route_one(topology, dist_to_t, cost, order, starts, source: int, out: np.ndarray) -> None:
    """Add the ECMP split of one unit flow from node ``source`` into ``out`` (``[links]``)."""
    share = {source: 1.0}
    while any(dist_to_t[u] > 0 for u in share):  # equal-cost paths have equal hops
        ahead: dict[int, float] = {}
        for u, amount in share.items():
            ids = order[starts[u] : starts[u + 1]]
            slack = dist_to_t[topology.dst[ids]] + cost[ids] - dist_to_t[u]
            ids = ids[np.abs(slack) <= TIE_TOLERANCE]
            out[ids] += amount / len(ids)
            for v in topology.dst[ids]:
                ahead[int(v)] = ahead.get(int(v), 0.0) + amount / len(ids)
        share = ahead


def route(topology: Topology, src, dst) -> Routes:
    """Route flows from endpoints ``src`` to endpoints ``dst`` on shortest paths with ECMP.

    Args:
        topology: the graph.
        src, dst: ``[flows]`` endpoint indices (positions in ``topology.endpoints``); a flow
            from an endpoint to itself crosses no link.

    Returns:
        :class:`Routes`, cached per (topology, src, dst): the arrays are shared, read-only.

    Raises:
        ValueError: an index outside the endpoints, or a destination the source cannot reach.

    Examples:
        >>> from diffcost.network.generators import switch_domain
        >>> from diffcost.network.graph import LinkSpec
        >>> r = route(switch_domain(4, LinkSpec(1e9)), [0, 1], [1, 2])
        >>> r.incidence.sum(axis=1).tolist()  # two hops each: GPU -> switch -> GPU
        [2.0, 2.0]
    """
    src = np.asarray(src, dtype=int).ravel()
    dst = np.asarray(dst, dtype=int).ravel()
    n = len(topology.endpoints)
    if src.shape != dst.shape:
        raise ValueError(f"src has {len(src)} flows, dst {len(dst)}: expected as many")
    for name, ends in (("src", src), ("dst", dst)):
        if ends.size and (ends.min() < 0 or ends.max() >= n):
            raise ValueError(f"{name}: endpoint indices must be in 0..{n - 1}")
    key = (topology.fingerprint, src.tobytes(), dst.tobytes())
    return _ROUTES.get(key, lambda: _compute_routes(topology, src, dst))


def _compute_routes(topology: Topology, src: np.ndarray, dst: np.ndarray) -> Routes:
    dist = distances(topology)
    cost = link_cost(topology)
    order, starts = _out_links(topology)
    incidence = np.zeros((len(src), topology.n_links))
    for f, (s, t) in enumerate(zip(src, dst)):
        source = int(topology.endpoints[s])
        if not np.isfinite(dist[t, source]):
            raise ValueError(f"{topology.name}: endpoint {t} cannot be reached from endpoint {s}")
        _route_one(topology, dist[t], cost, order, starts, source, incidence[f])
    return Routes(
        incidence=incidence,
        capacity_Bps=np.array(topology.capacity_Bps, dtype=float),
        latency_s=np.array(topology.latency_s, dtype=float),
        src=src.copy(),
        dst=dst.copy(),
    )


def concatenate(routes_list) -> Routes:
    """Flows of several :class:`Routes` on one topology as one set (e.g. the collectives of
    different dimensions that run at the same time), rows in the order given."""
    routes_list = list(routes_list)
    if not routes_list:
        raise ValueError("concatenate: expected at least one Routes")
    first = routes_list[0]
    for other in routes_list[1:]:
        if not np.array_equal(other.capacity_Bps, first.capacity_Bps):
            raise ValueError("concatenate: the routes are on different topologies")
    return Routes(
        incidence=np.concatenate([r.incidence for r in routes_list]),
        capacity_Bps=np.array(first.capacity_Bps),
        latency_s=np.array(first.latency_s),
        src=np.concatenate([r.src for r in routes_list]),
        dst=np.concatenate([r.dst for r in routes_list]),
    )
