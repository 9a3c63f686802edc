"""Ranks placed on a topology, and collectives as step flows routed on it.

Placement follows the plan's dimension order, as ``diffcost.comm.place`` and
``diffcost.stages`` assume: ``plan.order`` lists the placed dimensions (tp, cp, dp, pp)
innermost first, rank ``r`` has index ``(r // stride_d) % degree_d`` along dimension ``d``
(the stride is the product of the degrees inside it), expert parallelism is the innermost
part of data parallelism (``dp = ep_index + ep * edp_index``), and rank ``r`` runs on endpoint
``r`` of the topology (its GPUs node by node) unless an explicit placement says otherwise.

A collective over a dimension runs in all of its groups at once. Its algorithm is a sequence
of phases; in every step of a phase each flow of the phase moves ``msg_frac`` of the buffer:

* ``ring``: rank ``i`` to its successor; ``n - 1`` steps of ``1 / n`` (twice for all-reduce).
* ``tree`` (all-reduce): NCCL's double binary tree, pipelined: every edge of both trees in
  both directions at once, each tree carrying half the buffer.
* ``hierarchical``: reduce-scatter on a ring inside each domain (``k`` ranks), all-reduce on
  rings across domains (one per local rank, ``1 / k`` of the buffer), all-gather inside.
* ``torus``: one ring per torus dimension of the group: reduce-scatter along each dimension
  in turn on a shrinking share, then all-gather back.

References:
    Thakur, Rabenseifner & Gropp (2005) for rings; Sanders, Speck & Träff, "Two-tree
    algorithms for full bandwidth broadcast, reduction and scan" (2009) and NCCL for the
    double binary tree; NCCL's hierarchical (NVLS/tree) and TPU torus all-reduce.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diffcost.network.graph import Topology, without_transit
from diffcost.network.routing import LRU, Routes, distances, route
from diffcost.specs import PLACED_DIMS, PlanSpec
from diffcost.topology import ring_links

# Group dimensions: the placed ones, expert parallel and expert data parallel (inside dp).
GROUP_DIMS = ("tp", "cp", "dp", "pp", "ep", "edp")
# Columns of ``RankLayout.index`` that change inside one group of each dimension; the other
# columns are the same for all of a group's ranks and tell the groups apart.
_VARYING = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("dp", "ep", "edp"),
    "ep": ("dp", "ep"),
    "edp": ("dp", "edp"),
}
COLLECTIVE_STEPS = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}
ALGORITHMS = ("ring", "tree", "hierarchical", "torus")
_FLOWS = LRU(256)


@dataclasses.dataclass(frozen=True, eq=False)
class RankLayout:
    """Where every rank of a plan runs.

    Attributes:
        degrees: ``{dim: degree}`` for ``GROUP_DIMS``.
        order: the placed dimensions innermost first.
        index: ``[ranks, len(GROUP_DIMS)]`` each rank's index along each group dimension.
        endpoint: ``[ranks]`` the topology endpoint each rank runs on.
    """

    degrees: dict
    order: tuple[str, ...]
    index: np.ndarray
    endpoint: np.ndarray

    @property
    def key(self) -> tuple:
        """Identifies the layout in caches."""
        return (tuple(sorted(self.degrees.items())), self.order, self.endpoint.tobytes())

    def groups(self, dim: str) -> np.ndarray:
        """``[groups, degree]`` ranks of every group of ``dim``, by index along ``dim``."""
        if dim not in GROUP_DIMS:
            raise ValueError(f"dim={dim!r}: expected one of {', '.join(GROUP_DIMS)}")
        fixed = [i for i, d in enumerate(GROUP_DIMS) if d not in _VARYING[dim]]
        keys = self.index[:, fixed]
        along = self.index[:, GROUP_DIMS.index(dim)]
        ranks = np.lexsort((along, *keys.T[::-1]))
        return ranks.reshape(-1, self.degrees[dim])


def place_ranks(topology: Topology, plan: PlanSpec, placement=None) -> RankLayout:
    """Place the ranks of ``plan`` on ``topology``'s endpoints by the plan's order.

    Args:
        topology: the graph; it needs at least ``plan.n_gpus`` endpoints.
        plan: degrees (tp, cp, dp, pp, ep) and ``order``.
        placement: optional ``[ranks]`` endpoint index of each rank (distinct); default rank
            ``r`` on endpoint ``r``.

    Returns:
        The :class:`RankLayout`.

    Raises:
        ValueError: too few endpoints, ``ep`` not dividing ``dp``, an order that is not a
            permutation of the placed dimensions, or a bad explicit placement.
    """
    n = plan.n_gpus
    if n > len(topology.endpoints):
        raise ValueError(
            f"plan has {n} ranks; {topology.name} has only {len(topology.endpoints)} endpoints"
        )
    if sorted(plan.order) != sorted(PLACED_DIMS):
        raise ValueError(f"order={plan.order!r}: expected a permutation of {PLACED_DIMS}")
    if plan.dp % plan.ep:
        raise ValueError(f"ep={plan.ep} must divide dp={plan.dp}")
    degrees = {d: getattr(plan, d) for d in PLACED_DIMS}
    degrees |= {"ep": plan.ep, "edp": plan.dp // plan.ep}
    ranks = np.arange(n)
    index = np.zeros((n, len(GROUP_DIMS)), dtype=int)
    stride = 1
    for d in plan.order:
        index[:, GROUP_DIMS.index(d)] = (ranks // stride) % degrees[d]
        stride *= degrees[d]
    dp = index[:, GROUP_DIMS.index("dp")]
    index[:, GROUP_DIMS.index("ep")] = dp % plan.ep
    index[:, GROUP_DIMS.index("edp")] = dp // plan.ep
    endpoint = ranks if placement is None else _checked_placement(placement, n, topology)
    return RankLayout(degrees, tuple(plan.order), index, np.array(endpoint, dtype=int))


def _checked_placement(placement, n: int, topology: Topology) -> np.ndarray:
    placement = np.asarray(placement)
    if placement.shape != (n,) or not np.issubdtype(placement.dtype, np.integer):
        raise ValueError(f"placement: expected {n} integer endpoint indices, one per rank")
    if placement.min() < 0 or placement.max() >= len(topology.endpoints):
        raise ValueError(f"placement: endpoint indices must be in 0..{len(topology.endpoints) - 1}")
    if len(np.unique(placement)) != n:
        raise ValueError("placement: two ranks on one endpoint")
    return placement


@dataclasses.dataclass(frozen=True, eq=False)
class CollectiveFlows:
    """The step flows of one collective in every group of a dimension, routed.

    Attributes:
        routes: the flows' :class:`~diffcost.network.routing.Routes` (incidence etc.).
        src_rank, dst_rank: ``[flows]`` ranks at the two ends.
        phase: ``[flows]`` the phase each flow belongs to; phases run one after another.
        msg_frac: ``[flows]`` share of the buffer a flow moves in one step of its phase.
        steps: ``[phases]`` steps of each phase; the flows of a phase run concurrently.
    """

    routes: Routes
    src_rank: np.ndarray
    dst_rank: np.ndarray
    phase: np.ndarray
    msg_frac: np.ndarray
    steps: np.ndarray


def _ring(ranks) -> tuple[np.ndarray, np.ndarray]:
    ranks = np.asarray(ranks)
    return ranks, np.roll(ranks, -1)


def _ring_phases(group, collective, layout, topology):
    n = len(group)
    src, dst = _ring(group)
    return [(src, dst, 1.0 / n, COLLECTIVE_STEPS[collective] * (n - 1))]


def binary_tree(n: int) -> np.ndarray:
    """``[n]`` parent of each position in an in-order balanced binary tree (root: -1)."""
    parent = np.full(n, -1)

    def build(lo, hi, up):
        if lo >= hi:
            return
        mid = (lo + hi) // 2
        parent[mid] = up
        build(lo, mid, mid)
        build(mid + 1, hi, mid)

    build(0, n, -1)
    return parent


def _tree_phases(group, collective, layout, topology):
    if collective != "all_reduce":
        raise ValueError(f"tree: NCCL's trees run all_reduce only, not {collective}")
    n = len(group)
    parent = binary_tree(n)
    child = np.flatnonzero(parent >= 0)
    src, dst = [], []
    for shift in (0, 1):  # the second tree: the first on ranks shifted by one
        ranks = np.roll(np.asarray(group), -shift)
        src += [ranks[child], ranks[parent[child]]]
        dst += [ranks[parent[child]], ranks[child]]
    return [(np.concatenate(src), np.concatenate(dst), 0.5, 1)]


def _split(collective: str, inner: list, outer: list) -> list:
    """Phases of a two-level collective: reduce-scatter inner then outer, gather back."""
    if collective == "reduce_scatter":
        return inner[:1] + outer[:1]
    if collective == "all_gather":
        return outer[1:] + inner[1:]
    return inner[:1] + outer + inner[1:]


def _hierarchical_phases(group, collective, layout, topology):
    domains = topology.domain[layout.endpoint[group]]
    labels, counts = np.unique(domains, return_counts=True)
    if len(set(counts)) > 1:
        raise ValueError(
            f"hierarchical: the group's ranks spread unevenly over domains ({counts.tolist()})"
        )
    k, m = int(counts[0]), len(labels)
    local = np.stack([np.asarray(group)[domains == d] for d in labels])  # [m, k]
    intra = [_ring(row) for row in local]
    inter = [_ring(col) for col in local.T]
    cat = lambda rings: tuple(np.concatenate(x) for x in zip(*rings))  # noqa: E731
    intra_phase = (*cat(intra), 1.0 / k, k - 1)
    inter_rs = (*cat(inter), 1.0 / (k * m), m - 1)
    return _split(collective, [intra_phase, intra_phase], [inter_rs, inter_rs])


def _torus_phases(group, collective, layout, topology):
    if topology.coords is None:
        raise ValueError(f"torus: {topology.name} has no torus coordinates")
    coords = topology.coords[layout.endpoint[group]]
    axes = [a for a in range(coords.shape[1]) if len(np.unique(coords[:, a])) > 1]
    sizes = [len(np.unique(coords[:, a])) for a in axes]
    if int(np.prod(sizes)) != len(group):
        raise ValueError(f"torus: the group's {len(group)} ranks do not fill a sub-grid {sizes}")
    group = np.asarray(group)
    phases, share = [], 1.0
    for a, size in zip(axes, sizes):
        share /= size
        rest = np.delete(coords, a, axis=1)
        order = np.lexsort((coords[:, a], *rest.T[::-1]))
        rings = [_ring(row) for row in group[order].reshape(-1, size)]
        src, dst = (np.concatenate(x) for x in zip(*rings))
        phases.append((src, dst, share, size - 1))
    if collective == "reduce_scatter":
        return phases
    if collective == "all_gather":
        return phases[::-1]
    return phases + phases[::-1]


_PHASES = {
    "ring": _ring_phases,
    "tree": _tree_phases,
    "hierarchical": _hierarchical_phases,
    "torus": _torus_phases,
}


def collective_flows(
    topology: Topology, layout: RankLayout, dim: str, collective: str, algorithm: str = "ring"
) -> CollectiveFlows:
    """Step flows of ``collective`` in every group of ``dim``, routed on ``topology``.

    Args:
        topology: the graph the layout places ranks on.
        layout: ``place_ranks(topology, plan)``.
        dim: one of ``GROUP_DIMS``.
        collective: ``"all_reduce"``, ``"reduce_scatter"`` or ``"all_gather"``.
        algorithm: one of ``ALGORITHMS``.

    Returns:
        :class:`CollectiveFlows`, cached per (topology, layout, dim, collective, algorithm).
        A group of one rank has no flows (``incidence`` of shape ``(0, links)``).

    Raises:
        ValueError: an unknown name, or an algorithm the group's placement cannot run.
    """
    if collective not in COLLECTIVE_STEPS:
        raise ValueError(
            f"collective={collective!r}: expected one of {', '.join(COLLECTIVE_STEPS)}"
        )
    if algorithm not in _PHASES:
        raise ValueError(f"algorithm={algorithm!r}: expected one of {', '.join(ALGORITHMS)}")
    key = (topology.fingerprint, layout.key, dim, collective, algorithm)
    make = lambda: _build_flows(topology, layout, dim, collective, algorithm)  # noqa: E731
    return _FLOWS.get(key, make)


def _build_flows(topology, layout, dim, collective, algorithm) -> CollectiveFlows:
    groups = layout.groups(dim)
    per_group = (
        []
        if groups.shape[1] < 2
        else [_PHASES[algorithm](g, collective, layout, topology) for g in groups]
    )
    rows = [
        (src, dst, p, frac, steps)
        for phases in per_group
        for p, (src, dst, frac, steps) in enumerate(phases)
    ]
    return _flows(topology, layout, rows, n_phases=len(per_group[0]) if per_group else 0)


def _flows(topology, layout, rows, n_phases: int) -> CollectiveFlows:
    """Route ``(src ranks, dst ranks, phase, msg_frac, steps)`` rows into one flow set."""
    steps = np.zeros(n_phases, dtype=int)
    for _, _, p, _, s in rows:
        steps[p] = s
    cat = lambda i, dtype: np.concatenate(  # noqa: E731
        [np.broadcast_to(np.asarray(r[i], dtype=dtype), np.shape(r[0])) for r in rows]
        or [np.zeros(0, dtype)]
    )
    src, dst = cat(0, int), cat(1, int)
    routes = route(topology, layout.endpoint[src], layout.endpoint[dst])
    return CollectiveFlows(routes, src, dst, cat(2, int), cat(3, float), steps)


def pipeline_flows(topology: Topology, layout: RankLayout) -> CollectiveFlows:
    """The activation sends between neighbouring pipeline stages, all at once: rank of stage
    ``i`` to the rank of stage ``i + 1`` in every pipeline; one phase of one step."""
    key = (topology.fingerprint, layout.key, "pp", "send_recv")
    groups = layout.groups("pp")
    rows = (
        [(groups[:, :-1].ravel(), groups[:, 1:].ravel(), 0, 1.0, 1)] if groups.shape[1] > 1 else []
    )
    return _FLOWS.get(key, lambda: _flows(topology, layout, rows, n_phases=len(rows)))


def ring_bandwidth_Bps(topology: Topology, endpoints) -> float:
    """Per-GPU bandwidth (B/s) that rings over ``endpoints`` reach together, as NCCL's
    channels do: the best of two ring sets, each routed (ECMP) at the largest common rate its
    links carry (the smallest ``capacity / load`` over loaded links), times its ring count.
    Rings use the group's own links (and switches, NICs), not other GPUs as relays:

    * where every pair of the group is equally many hops apart (behind a switch, on a full
      mesh), the ``n - 1`` rotations ``i -> i + s (mod n)``: every pair once in each
      direction, every link the group has (a complete graph splits into Hamiltonian rings);
    * on direct GPU links of one bandwidth, twice the most edge-disjoint Hamiltonian cycles
      the link counts carry (one ring per direction), relaying through a GPU where there is
      none (``diffcost.topology.ring_links``, the DGX-1 cube-mesh table).
    """
    endpoints = np.asarray(endpoints, dtype=int)
    n = len(endpoints)
    if n < 2:
        return 0.0
    others = np.setdiff1d(topology.endpoints, topology.endpoints[endpoints])
    topology = without_transit(topology, others)
    best = 0.0
    hops = np.round(distances(topology)[np.ix_(endpoints, topology.endpoints[endpoints])])
    if len(np.unique(hops[~np.eye(n, dtype=bool)])) == 1:  # every pair equally far
        src = np.concatenate([endpoints] * (n - 1))
        dst = np.concatenate([np.roll(endpoints, -s) for s in range(1, n)])
        load = route(topology, src, dst).load
        used = load > 1e-12
        best = (n - 1) * float(np.min(topology.capacity_Bps[used] / load[used]))
    nodes = topology.endpoints[endpoints]
    direct = np.isin(topology.src, nodes) & np.isin(topology.dst, nodes)
    bandwidths = np.unique(topology.bandwidth_Bps[direct])
    if len(bandwidths) == 1:
        links = topology.link_matrix(nodes)
        if best < links.sum(axis=1).min() * bandwidths[0]:  # else no ring set does better
            best = max(best, float(ring_links(links)[n] * bandwidths[0]))
    return best
