"""A network as a graph: typed nodes and directed links with a per-direction bandwidth.

A :class:`Topology` is static data (numpy arrays, computed outside jit): nodes with a kind
(``NODE_KINDS``), directed links with a bandwidth per direction, a latency per hop and a count
of parallel physical links, and the ``endpoints``: the nodes ranks are placed on, in rank
order. A physical cable is two directed links, one per direction, each carrying its full
bandwidth. Generators (``diffcost.network.generators``) write topologies with a
:class:`GraphBuilder`; routing (``diffcost.network.routing``) turns them into incidence arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import numpy as np

NODE_KINDS = ("gpu", "nvswitch", "nic", "leaf", "spine", "core", "host")


@dataclasses.dataclass(frozen=True)
class LinkSpec:
    """One physical link: bandwidth per direction (B/s) and latency of one hop (s)."""

    bandwidth_Bps: float
    latency_s: float = 0.0

    def __post_init__(self):
        if not (np.isfinite(self.bandwidth_Bps) and self.bandwidth_Bps > 0):
            raise ValueError(f"bandwidth_Bps={self.bandwidth_Bps!r}: expected a number > 0")
        if not (np.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"latency_s={self.latency_s!r}: expected a number >= 0")

    def scaled(self, factor: float) -> LinkSpec:
        """The same link with ``factor`` times the bandwidth."""
        return LinkSpec(self.bandwidth_Bps * factor, self.latency_s)


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """A network graph.

    Attributes:
        name: what it is called in messages.
        kinds: ``[nodes]`` kind of each node, one of ``NODE_KINDS``.
        src, dst: ``[links]`` node ids of each directed link.
        bandwidth_Bps: ``[links]`` bandwidth of one physical link in this direction (B/s).
        latency_s: ``[links]`` latency of one hop over the link (s).
        count: ``[links]`` parallel physical links (a DGX-1 GPU pair with two NVLinks: 2).
        endpoints: ``[endpoints]`` node ids ranks are placed on, in rank order.
        domain: ``[endpoints]`` the fast domain (NVLink node, NVL72 rack) of each endpoint;
            the hierarchical collective reduces inside a domain first.
        coords: ``[endpoints, dims]`` torus coordinates of each endpoint, or None.
        reducing: ``[nodes]`` True for a switch that reduces in the network (NVLink SHARP
            in an NVSwitch), or None where no node does.

    Arrays are read-only; ``fingerprint`` identifies the graph for caches.
    """

    name: str
    kinds: tuple[str, ...]
    src: np.ndarray
    dst: np.ndarray
    bandwidth_Bps: np.ndarray
    latency_s: np.ndarray
    count: np.ndarray
    endpoints: np.ndarray
    domain: np.ndarray
    coords: np.ndarray | None = None
    reducing: np.ndarray | None = None

    def __post_init__(self):
        for field in ("src", "dst", "bandwidth_Bps", "latency_s", "count", "endpoints", "domain"):
            getattr(self, field).setflags(write=False)
        for field in ("coords", "reducing"):
            if getattr(self, field) is not None:
                getattr(self, field).setflags(write=False)

    @property
    def n_nodes(self) -> int:
        return len(self.kinds)

    @property
    def n_links(self) -> int:
        return len(self.src)

    @property
    def capacity_Bps(self) -> np.ndarray:
        """``[links]`` bandwidth of each directed link times its count (B/s)."""
        return self.bandwidth_Bps * self.count

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of the graph: equal graphs (whatever their names) share cached routes."""
        digest = hashlib.sha1("|".join(self.kinds).encode())
        for array in (self.src, self.dst, self.bandwidth_Bps, self.latency_s, self.count):
            digest.update(np.ascontiguousarray(array).tobytes())
        for array in (self.endpoints, self.domain):
            digest.update(np.ascontiguousarray(array).tobytes())
        if self.coords is not None:
            digest.update(np.ascontiguousarray(self.coords).tobytes())
        if self.reducing is not None and self.reducing.any():
            digest.update(b"reducing" + np.ascontiguousarray(self.reducing).tobytes())
        return digest.hexdigest()

    def reducing_nodes(self) -> np.ndarray:
        """Ids of the switches that reduce in the network (empty where none do)."""
        if self.reducing is None:
            return np.zeros(0, dtype=int)
        return np.flatnonzero(self.reducing)

    def nodes_of(self, kind: str) -> np.ndarray:
        """Ids of the nodes of one kind."""
        if kind not in NODE_KINDS:
            raise ValueError(f"kind={kind!r}: expected one of {', '.join(NODE_KINDS)}")
        return np.array([i for i, k in enumerate(self.kinds) if k == kind], dtype=int)

    def degree(self) -> np.ndarray:
        """``[nodes]`` physical links leaving each node (counts added)."""
        return np.bincount(self.src, weights=self.count, minlength=self.n_nodes).astype(int)

    def neighbours(self) -> np.ndarray:
        """``[nodes]`` distinct nodes each node has a link to."""
        pairs = np.unique(np.stack([self.src, self.dst], axis=1), axis=0)
        return np.bincount(pairs[:, 0], minlength=self.n_nodes)

    def out_Bps(self) -> np.ndarray:
        """``[nodes]`` total bandwidth leaving each node (B/s)."""
        return np.bincount(self.src, weights=self.capacity_Bps, minlength=self.n_nodes)

    def link_matrix(self, nodes) -> np.ndarray:
        """``[n, n]`` physical links from ``nodes[i]`` directly to ``nodes[j]`` (counts)."""
        nodes = np.asarray(nodes)
        index = np.full(self.n_nodes, -1)
        index[nodes] = np.arange(len(nodes))
        out = np.zeros((len(nodes), len(nodes)), dtype=int)
        a, b = index[self.src], index[self.dst]
        keep = (a >= 0) & (b >= 0)
        np.add.at(out, (a[keep], b[keep]), self.count[keep])
        return out


class GraphBuilder:
    """Collects nodes and cables, then freezes them into a :class:`Topology`.

    Examples:
        >>> b = GraphBuilder()
        >>> gpus = [b.node("gpu") for _ in range(2)]
        >>> b.cable(gpus[0], gpus[1], LinkSpec(25e9, 1e-6), count=2)
        >>> b.build("pair", endpoints=gpus).capacity_Bps.tolist()
        [50000000000.0, 50000000000.0]
    """

    def __init__(self):
        self.kinds: list[str] = []
        self.links: list[tuple[int, int, float, float, int]] = []
        self.reducing: set[int] = set()

    def node(self, kind: str) -> int:
        """Add a node of ``kind``; returns its id."""
        if kind not in NODE_KINDS:
            raise ValueError(f"node kind {kind!r}: expected one of {', '.join(NODE_KINDS)}")
        self.kinds.append(kind)
        return len(self.kinds) - 1

    def nodes(self, kind: str, n: int) -> list[int]:
        """Add ``n`` nodes of ``kind``; returns their ids."""
        return [self.node(kind) for _ in range(n)]

    def cable(self, a: int, b: int, link: LinkSpec, count: int = 1) -> None:
        """``count`` physical links between ``a`` and ``b``: one directed link each way."""
        if a == b:
            raise ValueError(f"a link from node {a} to itself")
        if count < 1:
            raise ValueError(f"count={count!r}: expected a positive integer")
        self.links.append((a, b, link.bandwidth_Bps, link.latency_s, int(count)))
        self.links.append((b, a, link.bandwidth_Bps, link.latency_s, int(count)))

    def directed(self, a: int, b: int, link: LinkSpec, count: int = 1) -> None:
        """A link from ``a`` to ``b`` only."""
        if a == b or count < 1:
            raise ValueError(f"directed link {a} -> {b} with count {count}: invalid")
        self.links.append((a, b, link.bandwidth_Bps, link.latency_s, int(count)))

    def embed(self, topology: Topology) -> int:
        """Copy ``topology``'s nodes and links in; returns the id its node 0 now has."""
        offset = len(self.kinds)
        self.kinds.extend(topology.kinds)
        self.reducing.update(int(i) + offset for i in topology.reducing_nodes())
        for i in range(topology.n_links):
            self.links.append(
                (
                    int(topology.src[i]) + offset,
                    int(topology.dst[i]) + offset,
                    float(topology.bandwidth_Bps[i]),
                    float(topology.latency_s[i]),
                    int(topology.count[i]),
                )
            )
        return offset

    def build(self, name: str, endpoints, domain=None, coords=None) -> Topology:
        """Freeze: parallel links of one kind between the same nodes merge into one count.

        Args:
            name: the topology's name.
            endpoints: node ids ranks are placed on, in rank order.
            domain: ``[endpoints]`` domain ids (default: all in one domain).
            coords: ``[endpoints, dims]`` torus coordinates, or None.

        The nodes in ``self.reducing`` (switches that reduce in the network) become the
        topology's ``reducing``.
        """
        merged: dict[tuple, int] = {}
        for a, b, bw, lat, count in self.links:
            merged[(a, b, bw, lat)] = merged.get((a, b, bw, lat), 0) + count
        keys = sorted(merged)
        column = lambda i, dtype: np.array([k[i] for k in keys], dtype=dtype)  # noqa: E731
        endpoints = np.asarray(endpoints, dtype=int)
        domain = np.zeros(len(endpoints), int) if domain is None else np.asarray(domain, int)
        return Topology(
            name=name,
            kinds=tuple(self.kinds),
            src=column(0, int),
            dst=column(1, int),
            bandwidth_Bps=column(2, float),
            latency_s=column(3, float),
            count=np.array([merged[k] for k in keys], dtype=int),
            endpoints=endpoints,
            domain=domain,
            coords=None if coords is None else np.asarray(coords, dtype=int),
            reducing=np.isin(np.arange(len(self.kinds)), sorted(self.reducing)),
        )


def without_transit(topology: Topology, nodes) -> Topology:
    """``topology`` without the links of ``nodes`` (their ids and the endpoints stay)."""
    keep = ~(np.isin(topology.src, nodes) | np.isin(topology.dst, nodes))
    return dataclasses.replace(
        topology,
        src=topology.src[keep],
        dst=topology.dst[keep],
        bandwidth_Bps=topology.bandwidth_Bps[keep],
        latency_s=topology.latency_s[keep],
        count=topology.count[keep],
    )
