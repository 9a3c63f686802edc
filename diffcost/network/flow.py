"""Maximum flow (Dinic's algorithm) and the bisection bandwidth of a topology.

The bisection bandwidth of a split of the endpoints into two halves is the maximum flow from
one half to the other (one direction), which equals the capacity of the cheapest cut that
separates them, switches falling on either side as they may. Pure Python on the link arrays:
topologies of a few thousand nodes take well under a second.

References:
    Dinic, "Algorithm for solution of a problem of maximum flow in networks with power
    estimation" (1970).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from diffcost.network.graph import Topology

_EPS = 1e-9  # relative: residual capacity below this share of the largest is empty


class _Residual:
    """A residual graph: every arc stored next to its reverse (arc ``i ^ 1``)."""

    def __init__(self, n_nodes: int):
        self.head: list[int] = []
        self.cap: list[float] = []
        self.out: list[list[int]] = [[] for _ in range(n_nodes)]

    def arc(self, a: int, b: int, capacity: float) -> None:
        self.out[a].append(len(self.head))
        self.head.append(b)
        self.cap.append(capacity)
        self.out[b].append(len(self.head))
        self.head.append(a)
        self.cap.append(0.0)

    def levels(self, source: int, sink: int, eps: float) -> list[int] | None:
        level = [-1] * len(self.out)
        level[source] = 0
        queue = deque([source])
        while queue:
            u = queue.popleft()
            for e in self.out[u]:
                v = self.head[e]
                if level[v] < 0 and self.cap[e] > eps:
                    level[v] = level[u] + 1
                    queue.append(v)
        return level if level[sink] >= 0 else None

    def push(self, u: int, sink: int, limit: float, level, nxt, eps: float) -> float:
        """One augmenting path in the level graph, found depth-first without recursion."""
        path: list[int] = []
        while u != sink:
            while nxt[u] < len(self.out[u]):
                e = self.out[u][nxt[u]]
                v = self.head[e]
                if self.cap[e] > eps and level[v] == level[u] + 1:
                    break
                nxt[u] += 1
            else:
                if not path:
                    return 0.0
                level[u] = -1  # dead end: no path to the sink from here
                u = self.head[path.pop() ^ 1]
                nxt[u] += 1
                continue
            path.append(self.out[u][nxt[u]])
            u = self.head[path[-1]]
        sent = min([limit] + [self.cap[e] for e in path])
        for e in path:
            self.cap[e] -= sent
            self.cap[e ^ 1] += sent
        return sent


def max_flow(n_nodes: int, src, dst, capacity, source: int, sink: int) -> float:
    """Maximum flow from ``source`` to ``sink`` over directed arcs ``src[i] -> dst[i]``.

    Args:
        n_nodes: node count.
        src, dst: ``[arcs]`` node ids.
        capacity: ``[arcs]`` capacities (any unit; the flow comes back in it).
        source, sink: node ids.

    Returns:
        The maximum flow.

    Examples:
        >>> max_flow(4, [0, 0, 1, 2], [1, 2, 3, 3], [3.0, 2.0, 1.0, 5.0], 0, 3)
        3.0
    """
    graph = _Residual(n_nodes)
    for a, b, c in zip(src, dst, capacity):
        graph.arc(int(a), int(b), float(c))
    eps = _EPS * max([float(c) for c in capacity] + [1.0])
    total = 0.0
    while (level := graph.levels(source, sink, eps)) is not None:
        nxt = [0] * n_nodes
        while (sent := graph.push(source, sink, float("inf"), level, nxt, eps)) > eps:
            total += sent
    return total


def cut_flow_Bps(topology: Topology, side_a, side_b) -> float:
    """Maximum flow (B/s) from the endpoints ``side_a`` to the endpoints ``side_b``.

    Args:
        topology: the graph.
        side_a, side_b: endpoint indices (positions in ``topology.endpoints``), disjoint.
    """
    side_a, side_b = np.asarray(side_a, int), np.asarray(side_b, int)
    if np.intersect1d(side_a, side_b).size:
        raise ValueError("the two sides of a cut share an endpoint")
    n = topology.n_nodes
    source, sink = n, n + 1
    total = float(topology.capacity_Bps.sum())
    a_nodes, b_nodes = topology.endpoints[side_a], topology.endpoints[side_b]
    src = np.concatenate([topology.src, np.full(len(a_nodes), source), b_nodes])
    dst = np.concatenate([topology.dst, a_nodes, np.full(len(b_nodes), sink)])
    cap = np.concatenate([topology.capacity_Bps, np.full(len(a_nodes) + len(b_nodes), total)])
    return max_flow(n + 2, src, dst, cap, source, sink)


def bisection_Bps(topology: Topology, side_a=None) -> float:
    """Bisection bandwidth (B/s, one direction) of a split of the endpoints into halves.

    Args:
        topology: the graph, with an even number of endpoints.
        side_a: endpoint indices of one half; default the first half in rank order.

    Returns:
        The maximum flow from ``side_a`` to the other endpoints.
    """
    n = len(topology.endpoints)
    if n % 2:
        raise ValueError(f"{topology.name}: {n} endpoints cannot be split in halves")
    side_a = np.arange(n // 2) if side_a is None else np.asarray(side_a, int)
    if len(side_a) != n // 2:
        raise ValueError(f"side_a has {len(side_a)} endpoints; a half is {n // 2}")
    side_b = np.setdiff1d(np.arange(n), side_a)
    return cut_flow_Bps(topology, side_a, side_b)
