"""Topology generators: compact descriptions of the networks training runs on.

Direct networks (the GPUs are linked to each other): ``mesh``, ``cube_mesh``, ``torus``,
``exponential``. Switched domains: ``switch_domain`` (NVSwitch, NVL72). Fabrics between hosts:
``tree``, ``fat_tree``, ``leaf_spine``, ``rail_optimized``. ``hierarchical`` puts a domain of
GPUs on every group of a fabric's hosts (which become the domains' NICs); ``explicit`` takes a
link list; ``from_cluster`` builds the graph a ``ClusterSpec`` describes.

Every ``link`` is one physical link (``LinkSpec``: bandwidth per direction, latency per hop);
where a generator splits a node's bandwidth across links, its docstring says so. Bisection
bandwidths quoted below are one direction across the cut.

References:
    Al-Fares, Loukissas & Vahdat, "A Scalable, Commodity Data Center Network Architecture"
    (SIGCOMM 2008), the k-ary fat-tree; NVIDIA DGX SuperPOD reference architectures
    (rail-optimized fabric); Ying et al., "Exponential Graph is Provably Efficient for
    Decentralized Deep Training" (NeurIPS 2021) and PerfTop (Yan et al., JPDC 2024) for the
    exponential graph; NVIDIA DGX-1 white paper (hybrid cube-mesh).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from diffcost.gpus import gpu_family
from diffcost.network.graph import GraphBuilder, LinkSpec, Topology
from diffcost.specs import ClusterSpec
from diffcost.topology import DGX1_LINKS

# GPU families whose NVSwitches reduce in the network (NVLink SHARP, "NVLS" in NCCL): the
# third-generation NVSwitch of HGX/DGX H100-class systems "incorporates hardware acceleration
# for collective operations with multicast and NVIDIA SHARP in-network reductions" (NVIDIA,
# "Upgrading Multi-GPU Interconnectivity with the Third-Generation NVIDIA NVSwitch", 2022),
# and the fourth-generation NVLink Switch of HGX B200 and GB200/GB300 NVL72 keeps it; NCCL uses
# it over NVLink only ("NVLink SHARP is an AllReduce offload system over NVLink only",
# NVIDIA/nccl#1031). A100 (second-generation NVSwitch) and V100 have none.
SWITCH_REDUCTION_FAMILIES = (
    "h100",
    "h200",
    "h800",
    "h20",
    "gh200",
    "b200",
    "b300",
    "gb200",
    "gb300",
)


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer")
    return int(value)


def _whole(name: str, value: float, why: str) -> int:
    """``value`` as an integer >= 1, or an error saying which ``why`` did not divide."""
    if value < 1 or abs(value - round(value)) > 1e-9:
        raise ValueError(f"{name}={value:g} is not a whole number >= 1: {why}")
    return int(round(value))


def switch_domain(
    gpus: int, link: LinkSpec, switches: int = 1, switch_reduction: bool = False
) -> Topology:
    """``gpus`` GPUs behind NVSwitches (a DGX/HGX node, an NVL72 rack).

    Each GPU has ``link.bandwidth_Bps`` in total, split evenly over ``switches`` switch planes
    (one logical switch by default). Bisection: ``gpus / 2 * link.bandwidth_Bps``.
    ``switch_reduction``: the switches reduce in the network (NVLink SHARP, third-generation
    NVSwitch and later: ``SWITCH_REDUCTION_FAMILIES``), which offers the ``nvls`` collectives.
    """
    gpus, switches = _positive("gpus", gpus), _positive("switches", switches)
    if not isinstance(switch_reduction, (bool, np.bool_)):
        raise ValueError(f"switch_reduction={switch_reduction!r}: expected true or false")
    b = GraphBuilder()
    gpu_ids = b.nodes("gpu", gpus)
    for switch in b.nodes("nvswitch", switches):
        for g in gpu_ids:
            b.cable(g, switch, link.scaled(1.0 / switches))
        if switch_reduction:
            b.reducing.add(switch)
    return b.build(f"switch_domain({gpus})", gpu_ids)


def mesh(gpus: int, link: LinkSpec) -> Topology:
    """A full point-to-point mesh: one ``link`` between every pair of GPUs (AMD Infinity
    Fabric). Bisection: ``(gpus / 2) ** 2 * link.bandwidth_Bps`` for an even count."""
    gpus = _positive("gpus", gpus)
    b = GraphBuilder()
    ids = b.nodes("gpu", gpus)
    for i, j in itertools.combinations(ids, 2):
        b.cable(i, j, link)
    return b.build(f"mesh({gpus})", ids)


def cube_mesh(link: LinkSpec) -> Topology:
    """NVIDIA DGX-1's hybrid cube-mesh of 8 GPUs, ``link`` per NVLink, the link counts of
    ``diffcost.topology.DGX1_LINKS`` (6 NVLinks per GPU)."""
    return explicit_matrix("cube_mesh", DGX1_LINKS, link)


def explicit_matrix(name: str, counts, link: LinkSpec) -> Topology:
    """GPUs linked by a symmetric ``[n, n]`` matrix of link counts."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1] or (counts != counts.T).any():
        raise ValueError(f"{name}: expected a symmetric square matrix of link counts")
    b = GraphBuilder()
    ids = b.nodes("gpu", len(counts))
    for i, j in itertools.combinations(range(len(counts)), 2):
        if counts[i, j] > 0:
            b.cable(ids[i], ids[j], link, count=int(counts[i, j]))
    return b.build(name, ids)


def torus(dims: Sequence[int], link: LinkSpec) -> Topology:
    """A torus of ``prod(dims)`` chips (TPU-style): each chip linked to its neighbours along
    every dimension, with wrap-around.

    A dimension of size 1 has no links, one of size 2 a single link between its two chips
    (the two directions of the ring reach the same neighbour), larger ones a ring. Chips are
    numbered with the first dimension fastest; ``coords`` holds each chip's position.
    Bisection (largest dimension ``k`` even, ``k >= 4``): ``2 * prod(dims) / k`` links.
    """
    dims = tuple(_positive("dims[]", d) for d in dims)
    if not dims:
        raise ValueError("dims=(): expected at least one dimension")
    coords = np.array([c[::-1] for c in itertools.product(*(range(d) for d in dims[::-1]))])
    strides = np.cumprod((1,) + dims[:-1])
    b = GraphBuilder()
    ids = b.nodes("gpu", len(coords))
    for i, c in enumerate(coords):
        for axis, size in enumerate(dims):
            if size == 1 or (size == 2 and c[axis] == 1):
                continue
            nxt = c.copy()
            nxt[axis] = (c[axis] + 1) % size
            b.cable(ids[i], ids[int(nxt @ strides)], link)
    return b.build(f"torus({'x'.join(map(str, dims))})", ids, coords=coords)


def exponential(n: int, link: LinkSpec) -> Topology:
    """PerfTop's exponential graph: node ``i`` linked to ``i +- 2**k (mod n)`` for every
    ``2**k < n`` (one link per distinct neighbour pair)."""
    n = _positive("n", n)
    pairs = set()
    for i in range(n):
        for k in range(max(n - 1, 1).bit_length()):
            j = (i + 2**k) % n
            if j != i:
                pairs.add((min(i, j), max(i, j)))
    b = GraphBuilder()
    ids = b.nodes("gpu", n)
    for i, j in sorted(pairs):
        b.cable(ids[i], ids[j], link)
    return b.build(f"exponential({n})", ids)


def _switch_kind(level: int) -> str:
    """Kind of a switch ``level`` levels above the hosts (1: leaf, 2: spine, 3+: core)."""
    return ("leaf", "spine")[level - 1] if level <= 2 else "core"


def tree(fanout: int, depth: int, link: LinkSpec) -> Topology:
    """A tree of switches ``depth`` levels deep, ``fanout`` children each, ``fanout**depth``
    hosts at the bottom (PerfTop's tree). Bisection (``fanout`` even): ``fanout / 2`` links
    of the root."""
    fanout, depth = _positive("fanout", fanout), _positive("depth", depth)
    b = GraphBuilder()
    hosts = b.nodes("host", fanout**depth)
    below = hosts
    for level in range(1, depth + 1):
        above = b.nodes(_switch_kind(level), len(below) // fanout)
        for i, child in enumerate(below):
            b.cable(child, above[i // fanout], link)
        below = above
    return b.build(f"tree({fanout},{depth})", hosts, domain=np.arange(len(hosts)))


def _taper(radix: int, oversubscription: float) -> tuple[int, int]:
    """Down and up ports of a leaf of ``radix`` ports tapered ``oversubscription : 1``."""
    down = _whole(
        "radix * oversubscription / (1 + oversubscription)",
        radix * oversubscription / (1.0 + oversubscription),
        f"radix={radix} cannot be split {oversubscription:g}:1 into host and uplink ports",
    )
    if down >= radix:
        raise ValueError(f"radix={radix}: no port left for uplinks")
    return down, radix - down


def fat_tree(
    levels: int,
    radix: int,
    link: LinkSpec,
    oversubscription: float = 1.0,
    hosts: int | None = None,
) -> Topology:
    """A folded-Clos fat-tree of switches with ``radix`` ports, tapered at the leaves.

    ``levels=1``: one switch, ``radix`` hosts. ``levels=2``: ``radix`` leaves, each with
    ``down`` hosts and one link to each of ``up`` spines (``down / up == oversubscription``,
    ``down + up == radix``). ``levels=3``: the k-ary fat-tree of Al-Fares et al.: ``radix``
    pods of ``radix / 2`` leaves and ``up`` aggregation switches, ``up * radix / 2`` cores.
    ``hosts`` keeps only the first hosts (and drops the leaves and pods left empty).
    Bisection of the full tree: ``hosts / 2 * link.bandwidth_Bps / oversubscription``.
    """
    levels, radix = _positive("levels", levels), _positive("radix", radix)
    if levels > 3:
        raise ValueError(f"levels={levels}: expected 1, 2 or 3")
    if levels == 1:
        down, up, leaves = radix, 0, 1
    else:
        down, up = _taper(radix, oversubscription)
        leaves = radix if levels == 2 else radix * (radix // 2)
    budget = leaves * down if hosts is None else _positive("hosts", hosts)
    if budget > leaves * down:
        raise ValueError(f"hosts={hosts}: the tree has only {leaves * down} host ports")
    b = GraphBuilder()
    host_ids = b.nodes("host", budget)
    leaf_ids = b.nodes("leaf", -(-budget // down))
    for h, host in enumerate(host_ids):
        b.cable(host, leaf_ids[h // down], link)
    if levels == 2:
        for spine in b.nodes("spine", up):
            for leaf in leaf_ids:
                b.cable(leaf, spine, link)
    elif levels == 3:
        half = radix // 2
        cores = b.nodes("core", up * half)
        for pod in range(-(-len(leaf_ids) // half)):
            aggs = b.nodes("spine", up)
            for leaf in leaf_ids[pod * half : (pod + 1) * half]:
                for agg in aggs:
                    b.cable(leaf, agg, link)
            for j, agg in enumerate(aggs):
                for core in cores[j * half : (j + 1) * half]:
                    b.cable(agg, core, link)
    name = f"fat_tree({levels},{radix},{oversubscription:g})"
    return b.build(name, host_ids, domain=np.arange(budget))


def leaf_spine(
    leaves: int,
    hosts_per_leaf: int,
    link: LinkSpec,
    oversubscription: float = 1.0,
    spines: int = 1,
) -> Topology:
    """Two tiers: ``leaves`` leaves of ``hosts_per_leaf`` hosts; each leaf's uplink capacity,
    ``hosts_per_leaf * link.bandwidth_Bps / oversubscription``, is split evenly over
    ``spines`` links (one per spine). Bisection (even ``leaves``):
    ``leaves * hosts_per_leaf / 2 * link.bandwidth_Bps / oversubscription``."""
    leaves = _positive("leaves", leaves)
    hosts_per_leaf = _positive("hosts_per_leaf", hosts_per_leaf)
    spines = _positive("spines", spines)
    if not oversubscription > 0:
        raise ValueError(f"oversubscription={oversubscription!r}: expected a number > 0")
    b = GraphBuilder()
    host_ids = b.nodes("host", leaves * hosts_per_leaf)
    leaf_ids = b.nodes("leaf", leaves)
    spine_ids = b.nodes("spine", spines)
    uplink = link.scaled(hosts_per_leaf / oversubscription / spines)
    for h, host in enumerate(host_ids):
        b.cable(host, leaf_ids[h // hosts_per_leaf], link)
    for leaf in leaf_ids:
        for spine in spine_ids:
            b.cable(leaf, spine, uplink)
    name = f"leaf_spine({leaves}x{hosts_per_leaf},{oversubscription:g})"
    return b.build(name, host_ids, domain=np.arange(len(host_ids)))


def rail_optimized(
    rails: int,
    units: int,
    hosts_per_unit: int,
    link: LinkSpec,
    spines_per_rail: int = 1,
    cores: int = 0,
    oversubscription: float = 1.0,
) -> Topology:
    """A rail-optimized fabric (NVIDIA DGX SuperPOD): NIC ``r`` of every node is on rail ``r``.

    Hosts are the NICs of ``units * hosts_per_unit`` nodes, numbered node by node
    (``node * rails + rail``, the order ``hierarchical`` attaches NICs in). Tier 1: one leaf
    per (scalable unit, rail) with the ``hosts_per_unit`` NICs of that rail. Tier 2: per rail,
    ``spines_per_rail`` spines, each leaf of the rail linked to each of them
    ``hosts_per_unit / (oversubscription * spines_per_rail)`` times. Tier 3 (``cores > 0``):
    every spine linked to every core equally, non-blocking; without it, traffic between rails
    crosses inside the nodes (NVLink). Bisection (even node count, full tree):
    ``nodes / 2 * rails * link.bandwidth_Bps / oversubscription``.
    """
    rails, units = _positive("rails", rails), _positive("units", units)
    hosts_per_unit = _positive("hosts_per_unit", hosts_per_unit)
    spines_per_rail = _positive("spines_per_rail", spines_per_rail)
    up = _whole(
        "hosts_per_unit / (oversubscription * spines_per_rail)",
        hosts_per_unit / (oversubscription * spines_per_rail),
        "each leaf needs the same whole number of links to every spine of its rail",
    )
    nodes = units * hosts_per_unit
    b = GraphBuilder()
    hosts = np.array(b.nodes("host", nodes * rails)).reshape(units, hosts_per_unit, rails)
    spines = np.array(b.nodes("spine", rails * spines_per_rail)).reshape(rails, spines_per_rail)
    for u, r in itertools.product(range(units), range(rails)):
        leaf = b.node("leaf")
        for host in hosts[u, :, r]:
            b.cable(int(host), leaf, link)
        for spine in spines[r]:
            b.cable(leaf, int(spine), link, count=up)
    if cores:
        per_core = _whole(
            "units * leaf-to-spine links / cores",
            units * up / _positive("cores", cores),
            "every spine needs the same whole number of links to every core",
        )
        for core in b.nodes("core", cores):
            for spine in spines.ravel():
                b.cable(int(spine), core, link, count=per_core)
    name = f"rail_optimized({rails} rails,{nodes} nodes,{3 if cores else 2} tiers)"
    return b.build(name, hosts.ravel(), domain=np.repeat(np.arange(nodes), rails))


def hierarchical(
    domain: Topology,
    domains: int,
    fabric: Topology,
    nic_link: LinkSpec | None = None,
) -> Topology:
    """``domains`` copies of ``domain`` (GPUs and their switches) joined by ``fabric``.

    The fabric's hosts become NICs, ``len(fabric.endpoints) / domains`` per domain, taken in
    order; a domain's GPUs share its NICs evenly (GPU ``j`` of ``g`` attaches to NIC
    ``j * nics // g`` when there are fewer NICs than GPUs, to ``nics / g`` NICs otherwise),
    over ``nic_link`` (default: the NIC's own fabric bandwidth, no latency).
    """
    domains = _positive("domains", domains)
    nics = _whole(
        "fabric hosts / domains",
        len(fabric.endpoints) / domains,
        f"the fabric has {len(fabric.endpoints)} hosts for {domains} domains",
    )
    g = len(domain.endpoints)
    if max(nics, g) % min(nics, g):
        raise ValueError(f"{nics} NICs cannot be shared evenly by {g} GPUs of a domain")
    b = GraphBuilder()
    offset = b.embed(fabric)
    nic_ids = (fabric.endpoints + offset).reshape(domains, nics)
    for nic in nic_ids.ravel():
        b.kinds[nic] = "nic"
    nic_Bps = fabric.out_Bps()
    gpus = []
    for d in range(domains):
        ids = domain.endpoints + b.embed(domain)
        for j, gpu in enumerate(ids):
            mine = range(j * nics // g, (j + 1) * nics // g) if nics >= g else [j * nics // g]
            for i in mine:
                nic = int(nic_ids[d, i])
                attach = nic_link or LinkSpec(float(nic_Bps[nic - offset]))
                b.cable(int(gpu), nic, attach)
        gpus.extend(int(i) for i in ids)
    return b.build(
        f"{domains} x {domain.name} over {fabric.name}",
        gpus,
        domain=np.repeat(np.arange(domains), g),
    )


def explicit(
    kinds: Sequence[str],
    links: Sequence[tuple[int, int, LinkSpec, int]],
    endpoints: Sequence[int] | None = None,
    name: str = "explicit",
) -> Topology:
    """Any graph: node kinds, cables ``(a, b, link, count)``; endpoints default to the GPUs."""
    b = GraphBuilder()
    for kind in kinds:
        b.node(kind)
    for a, c, link, count in links:
        for end in (a, c):
            if not 0 <= end < len(kinds):
                raise ValueError(f"link ({a}, {c}): node {end} is not in 0..{len(kinds) - 1}")
        b.cable(a, c, link, count)
    if endpoints is None:
        endpoints = [i for i, k in enumerate(kinds) if k == "gpu"]
    return b.build(name, endpoints)


def switch_reduction_of(cluster: ClusterSpec) -> bool:
    """Whether ``cluster``'s NVSwitches reduce in the network: a switch node of a GPU family
    in ``SWITCH_REDUCTION_FAMILIES``."""
    family = gpu_family(cluster.gpu.name)
    return cluster.intra_node == "switch" and family in SWITCH_REDUCTION_FAMILIES


def node_domain(cluster: ClusterSpec, switch_reduction: bool | None = None) -> Topology:
    """The NVLink domain of one node of ``cluster``: its ``intra_node`` kind, the GPU's
    ``nvlink_GBps`` (both directions added) split per link, ``nvlink_latency_us`` per GPU to
    GPU transfer (half on each hop through a switch). A switch reduces in the network where
    ``switch_reduction`` says so (default: ``switch_reduction_of(cluster)``)."""
    g = cluster.gpus_per_node
    per_gpu_Bps = cluster.nvlink_GBps * 1e9 / 2.0
    latency_s = cluster.nvlink_latency_us * 1e-6
    if switch_reduction is None:
        switch_reduction = switch_reduction_of(cluster)
    if cluster.intra_node == "switch":
        return switch_domain(g, LinkSpec(per_gpu_Bps, latency_s / 2.0), 1, switch_reduction)
    if cluster.intra_node == "mesh":
        return mesh(g, LinkSpec(per_gpu_Bps / max(g - 1, 1), latency_s))
    if cluster.intra_node == "cube-mesh":
        return cube_mesh(LinkSpec(per_gpu_Bps / DGX1_LINKS.sum(axis=1).max(), latency_s))
    raise ValueError(f"intra_node={cluster.intra_node!r}: no graph generator for it")


def from_cluster(
    cluster: ClusterSpec, nodes: int, switch_reduction: bool | None = None
) -> Topology:
    """The graph a ``ClusterSpec`` describes, for ``nodes`` nodes.

    Each node is ``node_domain(cluster)`` with ``nics_per_node`` NICs of ``nic_Gbps``; the
    NICs of a node share a leaf whose uplink to one spine carries their bandwidth divided by
    ``oversubscription`` (the cost model divides every inter-node transfer by it). The NIC
    latency is split over the four fabric hops of an inter-node path (NIC, leaf, spine, leaf,
    NIC), so that the path sums to ``nic_latency_us``. ``switch_reduction`` as
    ``node_domain``.
    """
    nodes = _positive("nodes", nodes)
    nic = LinkSpec(cluster.nic_Gbps * 1e9 / 8.0, cluster.nic_latency_us * 1e-6 / 4.0)
    fabric = leaf_spine(nodes, cluster.nics_per_node, nic, cluster.oversubscription)
    graph = hierarchical(
        node_domain(cluster, switch_reduction), nodes, fabric, LinkSpec(nic.bandwidth_Bps)
    )
    return renamed(graph, f"{cluster.name} x {nodes}")


def renamed(topology: Topology, name: str) -> Topology:
    """``topology`` under another name (same graph, same fingerprint)."""
    return dataclasses.replace(topology, name=name)
