"""Link-load tables: the collectives of every plan on a graph, routed once, outside jit.

The cost model places a dimension's groups by their size ``n`` and stride ``s`` in the rank
order (``diffcost.stages``: a group's ranks are ``s`` apart). For a topology and a job of
``N`` ranks (rank ``r`` on endpoint ``r``), ``build_tables`` routes, for every ``(n, s)`` with
``n * s`` dividing ``N``, the flows of all ``N / n`` groups at once (they run concurrently:
the tensor-parallel groups of every pipeline stage and replica, every data-parallel group)
for each algorithm slot of ``SLOTS``:

* ``ring``: NCCL's ring channels (``cost.ring_channels``), one pass over the buffer (an
  all-gather or a reduce-scatter; an all-reduce is two);
* ``tree``: the double binary tree of an all-reduce, pipelined, ``TREE_BW_PENALTY`` times its
  share (as ``diffcost.network.cost``);
* ``hierarchical``: all-reduce as a ring inside each domain, rings across domains on ``1/k``
  of the buffer, a ring inside again; left out (``INVALID_LATENCY_S``) where the group spreads
  unevenly over domains;
* ``pairwise``: all-to-all, every ordered pair ``1/n`` of the buffer; groups above
  ``PAIRWISE_MAX`` ranks take the ring's one pass (what each rank sends is the same,
  ``(n - 1)/n`` of the buffer; the table would need ``N (n - 1)`` routes);
* ``send``: the sends between neighbouring members of each group (pipeline stages).

Each algorithm's flows are summed into a load per directed link per byte of buffer, steps
included (the phases stream, as ``cost.collective_time_s(pipelined=True)``). The links are
then reduced to **tiers** (``TIERS``: NVLink, NIC, leaf-spine, spine-core, other): per tier
the most loaded link, its load scaled to the tier's reference capacity (its widest link), so
that ``load[c] * bytes / capacity[c]`` is the time of the tier's busiest link and the tier
capacities, one number per class, are what the jitted model differentiates. The latency of an
algorithm is its latency steps times the path latency (NVLink and network parts kept apart,
as their calibrated scales differ) of its slowest flow.

All of this is numpy, cached per (topology, ``N``); ``NetworkTables`` is a pytree with
fixed shapes, so a ``jax.vmap`` over plans looks groups up (``diffcost.network.model``) and
reuses one table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost.network.collectives import binary_tree
from diffcost.network.cost import TREE_BW_PENALTY, link_classes, ring_channels
from diffcost.network.graph import Topology, without_transit
from diffcost.network.loads import link_loads
from diffcost.network.routing import LRU

TIERS = ("nvlink", "nic", "leaf_spine", "spine_core", "other")
SLOTS = ("ring", "tree", "hierarchical", "pairwise", "send")
PAIRWISE_MAX = 64
INVALID_LATENCY_S = 1.0  # an algorithm the placement cannot run: never the smooth minimum
STREAM_CLASSES = ("nvlink", "network")  # per-link tables: a slot's streams by their links
_TABLES = LRU(16)


@struct.dataclass
class NetworkTables:
    """Per-(group size, stride) link loads of every algorithm slot on one topology.

    Attributes:
        log_grid: ``[G]`` log of the divisors of ``n_gpus``: the grid of group sizes and of
            strides (two points at least).
        load: ``[G * G, len(SLOTS), len(tiers)]`` bytes on the busiest link of each tier per
            byte of buffer, at the tier's reference capacity; row ``i * G + j`` is size
            ``grid[i]``, stride ``grid[j]``.
        latency_s: ``[G * G, len(SLOTS), 2]`` latency of each slot: NVLink and network part.
        tier_capacity_Bps: ``[len(tiers)]`` reference capacity (the widest link) of each tier.
        tier_nvlink: ``[len(tiers)]`` 1 for the NVLink tier (its efficiency and latency scale
            are ``nvlink_eff``, ``nvlink_latency_scale``), 0 for the network tiers.
        tiers: the names (``TIERS``) of the tiers the topology has links in (static).
        contention: whether concurrent collectives share links (``diffcost.network.model``;
            static). The static fields are few, so that a jitted prediction compiles once per
            table shape, whatever the topology.
        link_load: ``[G * G, len(SLOTS), len(STREAM_CLASSES), links]`` bytes on every loaded
            link per byte of buffer, per stream class (``build_tables(links=True)``; None: the
            concurrent collectives share the tiers' busiest links).
            ``diffcost.network.link_sharing`` shares these rows.
        link_stream: ``[G * G, len(SLOTS), len(STREAM_CLASSES), 2]`` the sum and the sum of
            squares, over the class's streams (the slot's flows merged per source and
            destination), of the bytes each moves per byte of buffer.
        link_tier: ``[links, len(tiers)]`` one-hot tier of each loaded link.
        link_scale: ``[links]`` each loaded link's capacity over its tier's reference.
    """

    log_grid: jax.Array
    load: jax.Array
    latency_s: jax.Array
    tier_capacity_Bps: jax.Array
    tier_nvlink: jax.Array
    link_load: jax.Array | None = None
    link_stream: jax.Array | None = None
    link_tier: jax.Array | None = None
    link_scale: jax.Array | None = None
    contention: bool = struct.field(pytree_node=False, default=True)
    tiers: tuple = struct.field(pytree_node=False, default=TIERS)

    def with_capacities(self, tier_capacity_Bps) -> NetworkTables:
        """The same tables with other tier capacities (a what-if, or a traced value)."""
        return self.replace(tier_capacity_Bps=tier_capacity_Bps)


def link_tiers(topology: Topology) -> np.ndarray:
    """``[links]`` index in ``TIERS`` of each directed link: NVLink between GPUs and NVSwitches,
    NIC where a NIC is an end, leaf-spine, spine-core, and other (hosts, tree switches)."""
    kinds = np.array(topology.kinds)
    a, b = kinds[topology.src], kinds[topology.dst]
    pair = lambda x, y: ((a == x) & (b == y)) | ((a == y) & (b == x))  # noqa: E731
    tiers = np.full(topology.n_links, TIERS.index("other"))
    tiers[pair("leaf", "spine")] = TIERS.index("leaf_spine")
    tiers[pair("spine", "core")] = TIERS.index("spine_core")
    tiers[(a == "nic") | (b == "nic")] = TIERS.index("nic")
    tiers[link_classes(topology) > 0] = TIERS.index("nvlink")
    return tiers


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def groups_of(n_gpus: int, size: int, stride: int) -> np.ndarray:
    """``[n_gpus / size, size]`` ranks of every group of ``size`` ranks ``stride`` apart."""
    ranks = np.arange(n_gpus)
    base = ranks[(ranks // stride) % size == 0]
    return base[:, None] + stride * np.arange(size)[None, :]


# --- each slot's flows: phases of (src, dst, bytes per buffer byte, latency steps) ----------


def _ring_phases(topology, groups):
    n = groups.shape[1]
    chans = [c for g in groups for c in ring_channels(topology, g)]
    src = np.concatenate([c[0] for c in chans])
    dst = np.concatenate([c[1] for c in chans])
    weight = np.concatenate([np.full(len(c[0]), c[2] * (n - 1) / n) for c in chans])
    return [(src, dst, weight, n - 1)]


def _tree_phases(topology, groups):
    n = groups.shape[1]
    parent = binary_tree(n)
    child = np.flatnonzero(parent >= 0)
    src, dst = [], []
    for g in groups:
        for shift in (0, 1):  # the second tree: the first on ranks shifted by one
            ranks = np.roll(g, -shift)
            src += [ranks[child], ranks[parent[child]]]
            dst += [ranks[parent[child]], ranks[child]]
    src, dst = np.concatenate(src), np.concatenate(dst)
    return [(src, dst, np.full(len(src), 0.5 * TREE_BW_PENALTY), 2.0 * np.log2(n))]


def _hierarchical_phases(topology, groups):
    intra, inter = [], []
    for g in groups:
        domains = topology.domain[g]
        labels, counts = np.unique(domains, return_counts=True)
        if len(set(counts)) > 1:
            return None
        local = np.stack([g[domains == d] for d in labels])  # [m, k]
        intra += [(row, np.roll(row, -1)) for row in local]
        inter += [(col, np.roll(col, -1)) for col in local.T]
    m, k = local.shape
    cat = lambda rings: [np.concatenate(x) for x in zip(*rings)]  # noqa: E731
    src_i, dst_i = cat(intra)
    src_o, dst_o = cat(inter)
    return [
        (src_i, dst_i, np.full(len(src_i), 2.0 * (k - 1) / k), 2 * (k - 1)),
        (src_o, dst_o, np.full(len(src_o), 2.0 * (m - 1) / (k * m)), 2 * (m - 1)),
    ]


def _pairwise_phases(topology, groups):
    n = groups.shape[1]
    if n > PAIRWISE_MAX:
        return _ring_phases(topology, groups)
    i, j = np.nonzero(~np.eye(n, dtype=bool))
    src, dst = groups[:, i].ravel(), groups[:, j].ravel()
    return [(src, dst, np.full(len(src), 1.0 / n), n - 1)]


def _send_phases(topology, groups):
    src, dst = groups[:, :-1].ravel(), groups[:, 1:].ravel()
    return [(src, dst, np.ones(len(src)), 1)]


_PHASES = {
    "ring": _ring_phases,
    "tree": _tree_phases,
    "hierarchical": _hierarchical_phases,
    "pairwise": _pairwise_phases,
    "send": _send_phases,
}


def slot_flows(topology: Topology, groups: np.ndarray, slot: str):
    """``(src, dst, bytes per buffer byte)`` of every flow of algorithm ``slot`` (a name in
    ``SLOTS``) over ``groups`` (``[groups, size]`` ranks), its phases together (they stream);
    None where the placement cannot run it. The flows whose loads the tables sum."""
    phases = _PHASES[slot](topology, groups)
    if phases is None:
        return None
    return tuple(np.concatenate(x) for x in zip(*[p[:3] for p in phases]))


def job_graph(topology: Topology, n_gpus: int) -> Topology:
    """The graph the tables route a job of ``n_gpus`` ranks on: endpoints beyond the job
    relay nothing."""
    return without_transit(topology, topology.endpoints[n_gpus:])


def _stream_classes(topology, phases, nvlink) -> tuple[np.ndarray, np.ndarray]:
    """The phases' streams (their flows merged per source and destination, as
    ``reference_network`` merges them) in ``STREAM_CLASSES``: those that stay on NVLink links
    (``nvlink``: 1 for an NVLink link) and those that cross a network link.

    Returns:
        ``([classes, links] load, [classes, 2] streams)``: per class the bytes on each link
        and the sum and sum of squares of its streams' bytes, per byte of buffer.
    """
    src, dst, weight = (np.concatenate(x) for x in zip(*[p[:3] for p in phases]))
    network = link_loads(topology, src, dst, 1.0, 1.0 - nvlink)[1] > 0
    loads, streams = [], []
    for on in (~network, network):
        _, pair = np.unique(src[on] * topology.n_nodes + dst[on], return_inverse=True)
        merged = np.bincount(pair.ravel(), weights=weight[on])
        load = link_loads(topology, src[on], dst[on], weight[on])[0] if on.any() else 0.0
        loads.append(np.zeros(topology.n_links) + load)
        streams.append([merged.sum(), (merged**2).sum()])
    return np.stack(loads), np.array(streams)


def _slot(topology, tiers, reference, nvlink, groups, name, links):
    """``([tiers] load, [2] latency, [classes, links] load, [classes, 2] streams)`` of one
    slot over ``groups`` (the last two per stream class, ``_stream_classes``, only for
    per-link tables, ``links``; zeros and ``INVALID_LATENCY_S`` where it cannot run)."""
    phases = _PHASES[name](topology, groups)
    load = np.zeros(topology.n_links)
    classes = np.zeros((len(STREAM_CLASSES), topology.n_links))
    streams = np.zeros((len(STREAM_CLASSES), 2))
    if phases is None:
        return np.zeros(len(TIERS)), np.array([INVALID_LATENCY_S, 0.0]), classes, streams
    latency = np.zeros(2)
    parts = np.stack([topology.latency_s * nvlink, topology.latency_s * (1.0 - nvlink)])
    for src, dst, weight, latency_steps in phases:
        phase_load, paths = link_loads(topology, src, dst, weight, parts)
        load += phase_load
        if len(paths):
            latency += latency_steps * paths[np.argmax(paths.sum(axis=1))]
    scaled = load * reference[tiers] / topology.capacity_Bps
    per_tier = np.zeros(len(TIERS))
    np.maximum.at(per_tier, tiers, scaled)
    if links:
        classes, streams = _stream_classes(topology, phases, nvlink)
    return per_tier, latency, classes, streams


def _build(topology: Topology, n_gpus: int, links: bool) -> NetworkTables:
    graph = job_graph(topology, n_gpus)
    tiers = link_tiers(graph)
    reference = np.ones(len(TIERS))
    np.maximum.at(reference, tiers, graph.capacity_Bps)
    nvlink = link_classes(graph)
    grid = divisors(n_gpus) if n_gpus > 1 else [1, 2]
    g = len(grid)
    load = np.zeros((g * g, len(SLOTS), len(TIERS)))
    latency = np.zeros((g * g, len(SLOTS), 2))
    shape = (g * g, len(SLOTS), len(STREAM_CLASSES))
    link_load = np.zeros((*shape, graph.n_links)) if links else None
    stream = np.zeros((*shape, 2))
    for i, size in enumerate(grid):
        for j, stride in enumerate(grid):
            if size < 2 or n_gpus % (size * stride):
                continue
            groups = groups_of(n_gpus, size, stride)
            for a, name in enumerate(SLOTS):
                k = i * g + j
                load[k, a], latency[k, a], per_link, stream[k, a] = _slot(
                    graph, tiers, reference, nvlink, groups, name, links
                )
                if links:
                    link_load[k, a] = per_link
    present = np.flatnonzero(np.bincount(tiers, minlength=len(TIERS)) > 0)  # tiers with links
    return NetworkTables(
        log_grid=jnp.asarray(np.log(np.asarray(grid, dtype=float))),
        load=jnp.asarray(load[:, :, present]),
        latency_s=jnp.asarray(latency),
        tier_capacity_Bps=jnp.asarray(reference[present]),
        tier_nvlink=jnp.asarray((present == TIERS.index("nvlink")).astype(float)),
        tiers=tuple(TIERS[i] for i in present),
        **(_link_fields(graph, tiers, reference, present, link_load, stream) if links else {}),
    )


def _link_fields(graph, tiers, reference, present, link_load, stream) -> dict:
    """``NetworkTables``' per-link fields, on the links some slot loads."""
    used = np.flatnonzero(link_load.max(axis=(0, 1, 2)) > 0)
    onehot = (tiers[used][:, None] == present[None, :]).astype(float)
    return {
        "link_load": jnp.asarray(link_load[..., used]),
        "link_stream": jnp.asarray(stream),
        "link_tier": jnp.asarray(onehot),
        "link_scale": jnp.asarray(graph.capacity_Bps[used] / reference[tiers[used]]),
    }


def build_tables(
    topology: Topology, n_gpus: int, contention: bool = True, links: bool = False
) -> NetworkTables:
    """``NetworkTables`` of a job of ``n_gpus`` ranks on ``topology`` (rank ``r`` on endpoint
    ``r``; endpoints beyond the job relay nothing), cached per (topology, ``n_gpus``,
    ``links``). ``links``: keep every link's loads, so that concurrent collectives share the
    links they cross (``diffcost.network.link_sharing``), not each tier's busiest link.

    Raises:
        ValueError: the topology has fewer endpoints than ``n_gpus``.
    """
    if n_gpus > len(topology.endpoints):
        raise ValueError(
            f"topology {topology.name!r} has {len(topology.endpoints)} endpoints: too few for "
            f"{n_gpus} GPUs"
        )
    key = (topology.fingerprint, int(n_gpus), bool(links))
    tables = _TABLES.get(key, lambda: _build(topology, int(n_gpus), bool(links)))
    return tables.replace(contention=bool(contention))
