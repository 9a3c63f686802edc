"""Time of one collective on a graph, in JAX: link loads of each algorithm's phases, priced.

``collective_pricing`` (numpy, outside jit) turns a collective over groups of ranks on a
``Topology`` into fixed-shape arrays per algorithm: per phase, the ``(flows, links)`` incidence
of its routed flows, each flow's share of the buffer per step, the phase's steps and its
latency steps. ``collective_time_s`` (JAX, jit- and vmap-able, differentiable with respect to
the link capacities and the calibrated ``Params``) prices them:

* a flow of a step moves ``frac * (msg_bytes + half_bw_bytes)`` bytes (the small-message curve
  of ``diffcost.comm``); a phase step takes ``link_time(incidence, capacity, flow_bytes)``,
  by default the most loaded link: ``max_l (sum_f bytes_f * incidence[f, l]) / capacity_l``,
  each link's capacity times ``nvlink_eff`` (links between GPUs and NVSwitches) or ``nic_eff``
  (links touching a NIC or a fabric switch). A max-min fair sharing function with the same
  signature can replace it;
* each latency step adds the largest path latency of the phase's flows, the links' latencies
  scaled by ``nvlink_latency_scale`` or ``nic_latency_scale`` as their class;
* NCCL's choice is a smooth minimum over the algorithms (``diffcost.smooth``); a reducing
  collective adds the GPU's pass over the buffer (``reduce_Bps``) to every algorithm that
  reduces on the GPUs, and every call ``collective_overhead_s``, as
  ``diffcost.comm.collective_s`` does; a pricing built with ``xla`` (XLA's collective table)
  also adds a pass over each rank's chunk, ``msg_bytes / n`` at ``chunk_pass_Bps`` (or
  ``chunk_reduce_Bps`` for a reducing collective), to the algorithms that run on the GPUs,
  gives all-to-all's grouped sends and receives their own small-message curve,
  ``sendrecv_half_bw_bytes``, runs them on fewer channels when each peer's share is small and
  then sends to several peers at once, their latencies overlapping (``diffcost.network.sendrecv``);
* ``nvls`` (NVLink SHARP), offered where the GPUs hang on switches the topology declares
  reducing (``Topology.reducing``), reduces in the switch: each GPU sends its buffer up and
  receives the result (``nvls_phases``), over its NVLink links at ``nvls_ratio * nvlink_eff``
  instead of ``nvlink_eff``, without the GPU's reduction pass and with ``nvls_latency_s`` per call,
  its bandwidth scaled by ``nvls.chunk_efficiency`` (NCCL's chunks shrink for small messages), in
  place of the small-message curve ``half_bw_bytes`` (the Simple protocol's buffers, which NVLS
  does not use); all-gather and reduce-scatter are offered it over at most
  ``nvls.NVLS_MAX_ARITY`` ranks;
* a pricing built with ``tcp`` (a cluster whose ``transport`` is ``tcp``: GPUDirect-TCPX/TCPXO)
  runs the ring on ``tcp_ring_share`` of its network links' capacity and adds ``tcp_fill_s`` per
  call to every other algorithm that crosses the network (``TCP_RING_ALGORITHMS``);
* a pricing built with ``protocols`` prices NCCL's choice of protocol by size: each algorithm
  that runs on the GPUs (``LL128_ALGORITHMS``) is the smooth minimum of its Simple-protocol
  curve above and an LL128 curve, on ``ll128_bw_share`` of the links' capacity, with the
  small-message curve ``ll128_half_bw_bytes`` in place of ``half_bw_bytes`` and NCCL's LL128
  per-step latency (``LL128_STEP_LATENCY_RATIO`` of Simple's).

Rings run as NCCL's channels do (``ring_channels``): behind a switch or on a full mesh the
``n - 1`` rotations (every pair once), on direct GPU links of one bandwidth a packing of
Hamiltonian cycles in both directions, across domains one ring per local rank, each leaving its
domain through a different GPU (and so a different NIC, as rails).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import smooth
from diffcost.network import collectives as netcoll
from diffcost.network import nvls, sendrecv
from diffcost.network.graph import Topology, without_transit
from diffcost.network.routing import distances, route
from diffcost.params import Params
from diffcost.specs import TRANSPORTS, PlanSpec

NVLINK_KINDS = ("gpu", "nvswitch")  # a link between two of these is NVLink; others network
TRAFFIC = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "all_to_all": 1.0}
REDUCES = ("all_reduce", "reduce_scatter")
SWITCH_ALGORITHMS = ("nvls",)  # reduce in the switches, not on the GPUs
# NCCL's pipelined trees reach about 2/3 of the bandwidth their link loads allow, the factor
# ``diffcost.comm`` applies to its tree (its chunks wait on the reduction up the tree).
TREE_BW_PENALTY = 1.5
# Collectives whose XLA-measured times carry a pass over each rank's chunk (``xla``).
CHUNK_PASS_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
SENDRECV_ALGORITHMS = ("pairwise",)  # XLA runs all-to-all as grouped sends and receives
# Over a TCP transport these run on a share of the NICs' bandwidth without a fixed cost; the
# other algorithms that cross the network use every NIC after ``tcp_fill_s``.
TCP_RING_ALGORITHMS = ("ring",)
# NCCL prices each algorithm under each protocol and runs the fastest (src/graph/tuning.cc).
# LL128 runs ring and tree (and the rings and trees these compose), not NVLS nor send/recv;
# its per-step NVLink latency in that model is 1.9 us against Simple's 3.4 us (ring).
LL128_ALGORITHMS = ("ring", "tree", "hierarchical", "torus")
LL128_STEP_LATENCY_RATIO = 1.9 / 3.4
MAX_CYCLE_SEARCH = 8  # groups up to this size search Hamiltonian cycle packings
_ZERO_BYTES = 1.0


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of an algorithm (numpy): concurrent flows, each moving ``frac`` of the buffer
    in each of ``steps`` steps, and ``latency_steps`` path latencies paid in the phase."""

    incidence: np.ndarray
    frac: np.ndarray
    steps: float
    latency_steps: float


@struct.dataclass
class AlgorithmArrays:
    """An algorithm's phases padded to one shape: ``incidence [P, F, L]`` on the pricing's
    links, ``frac [P, F]`` (0 on padding), ``steps`` and ``latency_steps`` ``[P]``;
    ``in_switch`` 1.0 for an algorithm that reduces in the switches (``SWITCH_ALGORITHMS``),
    else 0.0; ``network`` 1.0 for one whose flows cross a network link, else 0.0."""

    incidence: jax.Array
    frac: jax.Array
    steps: jax.Array
    latency_steps: jax.Array
    in_switch: jax.Array
    network: jax.Array = 0.0


@struct.dataclass
class CollectivePricing:
    """Everything shape-related about one collective on a topology, fixed outside jit.

    Attributes:
        links: ``[L]`` ids of the topology's links some algorithm uses.
        nvlink: ``[L]`` 1.0 for an NVLink link, 0.0 for a network one.
        latency_s: ``[L]`` the links' latencies as the topology gives them.
        group_size: ranks per group.
        algorithms: one ``AlgorithmArrays`` per name in ``names``.
        xla: 1.0 for a collective as XLA's table times it, else 0.0: every algorithm of a
            collective in ``CHUNK_PASS_COLLECTIVES`` that runs on the GPUs also pays a pass
            over each rank's chunk, ``msg / group_size`` at ``chunk_pass_Bps`` (all-gather)
            or ``chunk_reduce_Bps`` (reduce-scatter, all-reduce), and the
            grouped sends and receives (``SENDRECV_ALGORITHMS``) reach half their bandwidth
            at ``sendrecv_half_bw_bytes`` (not the collectives' ``half_bw_bytes``), at
            ``sendrecv.peer_share`` of the links' bandwidth.
        tcp: 1.0 for a network transport over TCP (``ClusterSpec.transport``): the ring
            (``TCP_RING_ALGORITHMS``) runs its network links at ``tcp_ring_share`` of their
            capacity, and every other algorithm whose flows cross the network pays
            ``tcp_fill_s`` per call; else 0.0.
        protocols: static; True: every algorithm in ``LL128_ALGORITHMS`` is the smooth
            minimum of its Simple and LL128 curves (NCCL's protocol choice by size).
        nvls_ops: NVLS's concurrent operations, its channels times ``group_size``: its chunk
            size by message size (``nvls.chunk_efficiency``).
        sendrecv_busy: ``[J]`` the share of NCCL's p2p channels the grouped sends keep busy
            as each send takes ``2**j`` channels (``sendrecv.busy_levels``); all-to-all only.
        names, collective: static.
    """

    links: jax.Array
    nvlink: jax.Array
    latency_s: jax.Array
    group_size: float
    algorithms: tuple
    xla: float = 0.0
    tcp: float = 0.0
    protocols: bool = struct.field(pytree_node=False, default=False)
    nvls_ops: float = nvls.DEFAULT_NVLS_CHANNELS * 2.0
    sendrecv_busy: jax.Array | None = None
    names: tuple = struct.field(pytree_node=False, default=())
    collective: str = struct.field(pytree_node=False, default="all_reduce")


# --- flows of each algorithm (numpy) ------------------------------------------------------------


def _ring(order) -> tuple[np.ndarray, np.ndarray]:
    order = np.asarray(order)
    return order, np.roll(order, -1)


def _equidistant(topology: Topology, group: np.ndarray) -> bool:
    hops = np.round(distances(topology)[np.ix_(group, topology.endpoints[group])], 6)
    return len(np.unique(hops[~np.eye(len(group), dtype=bool)])) == 1


def _cycle_packing(links: np.ndarray) -> list[tuple]:
    """Most Hamiltonian cycles (vertex orders, repeats allowed) that fit the link counts
    together, each using one link of a pair in both directions (exhaustive search)."""
    n = len(links)
    cycles = []
    for rest in itertools.permutations(range(1, n)):
        order = (0, *rest)
        edges = [(order[i], order[(i + 1) % n]) for i in range(n)]
        if rest[0] < rest[-1] and all(links[a, b] > 0 for a, b in edges):
            cycles.append((order, edges))
    left, best, chosen = links.copy(), [], []

    def grow(start):
        nonlocal best
        if len(chosen) > len(best):
            best = list(chosen)
        for j in range(start, len(cycles)):
            order, edges = cycles[j]
            if all(left[a, b] > 0 for a, b in edges):
                for a, b in edges:
                    left[a, b] -= 1
                    left[b, a] -= 1
                chosen.append(order)
                grow(j)
                chosen.pop()
                for a, b in edges:
                    left[a, b] += 1
                    left[b, a] += 1

    grow(0)
    return best


def ring_channels(topology: Topology, group) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """``(src, dst, weight)`` of the rings NCCL runs over ``group`` (endpoint indices); the
    weights sum to 1 (each ring carries that share of every step).

    * across domains: ``k`` rings, ``k`` the fewest ranks a domain holds, ring ``c`` visiting
      each domain's ranks rotated by ``c`` so that it leaves every domain through a different
      GPU (as NCCL's channels use the NICs; equal domains: ``k`` their ranks);
    * in one domain, of these the one that loads its busiest link least (as
      ``collectives.ring_bandwidth_Bps`` chooses): where every pair is equally far (behind a
      switch, a full mesh) the ``n - 1`` rotations ``i -> i + s`` (every pair once, routed
      with ECMP); on direct GPU links the most Hamiltonian cycles the link counts carry, each
      in both directions; the rotations where neither applies;
    """
    group = np.asarray(group, dtype=int)
    n = len(group)
    domains = topology.domain[group]
    labels, counts = np.unique(domains, return_counts=True)
    if len(labels) > 1:
        local = [group[domains == d] for d in labels]
        k = int(counts.min())
        rings = [_ring(np.concatenate([np.roll(row, -c) for row in local])) for c in range(k)]
        return [(s, d, 1.0 / k) for s, d in rings]
    rotations = [(group, np.roll(group, -s), 1.0 / (n - 1)) for s in range(1, n)]
    candidates = [rotations] if n < 3 or _equidistant(topology, group) else []
    links = topology.link_matrix(topology.endpoints[group])
    uniform = len(np.unique(links[~np.eye(n, dtype=bool)])) == 1  # rotations use all equally
    if 3 <= n <= MAX_CYCLE_SEARCH and not _switched(topology) and not uniform:
        cycles = _cycle_packing(links)
        packed = []
        for order in cycles:
            src, dst = _ring(group[list(order)])
            packed += [(src, dst, 0.5 / len(cycles)), (dst, src, 0.5 / len(cycles))]
        candidates += [packed] if packed else []
    if not candidates:
        return rotations
    return min(candidates, key=lambda c: _busiest(topology, c))


def _switched(topology: Topology) -> bool:
    """Whether the GPUs reach each other through switches only (no direct GPU links)."""
    gpu = np.array([k == "gpu" for k in topology.kinds])
    return not (gpu[topology.src] & gpu[topology.dst]).any()


def _busiest(topology: Topology, channels) -> float:
    """Largest load over capacity of a channel set's routed flows (s per byte of a step)."""
    routes = route(topology, *(np.concatenate([c[i] for c in channels]) for i in (0, 1)))
    weights = np.concatenate([np.full(len(c[0]), c[2]) for c in channels])
    return float(np.max(weights @ routes.incidence / routes.capacity_Bps))


def _routed(topology, src, dst, frac, steps, latency_steps) -> Phase:
    incidence = route(topology, np.concatenate(src), np.concatenate(dst)).incidence
    return Phase(incidence, np.concatenate(frac), float(steps), float(latency_steps))


def _ring_phases(topology, groups, collective) -> list[Phase]:
    n = groups.shape[1]
    chans = [c for g in groups for c in ring_channels(topology, g)]
    src, dst = [c[0] for c in chans], [c[1] for c in chans]
    frac = [np.full(len(c[0]), c[2] / n) for c in chans]
    steps = netcoll.COLLECTIVE_STEPS[collective] * (n - 1)
    return [_routed(topology, src, dst, frac, steps, steps)]


def _pairwise_phases(topology, groups, collective) -> list[Phase]:
    """All-to-all: every rank sends ``1 / n`` of its buffer to each other rank at once; the
    ``n - 1`` sends of a rank pay one latency each."""
    n = groups.shape[1]
    pairs = [(g[i], g[j]) for g in groups for i in range(n) for j in range(n) if i != j]
    src, dst = (np.array(x) for x in zip(*pairs))
    return [_routed(topology, [src], [dst], [np.full(len(src), 1.0 / n)], 1, n - 1)]


def _flow_phases(topology, groups, collective, algorithm) -> list[Phase]:
    """Phases of ``diffcost.network.collectives`` (tree, hierarchical, torus); the tree's
    pipelined single step pays ``2 log2 n`` latencies (up and down its depth) and moves
    ``TREE_BW_PENALTY`` times its share."""
    size, n_groups = groups.shape[1], groups.shape[0]
    layout = netcoll.place_ranks(topology, PlanSpec(tp=size, dp=n_groups))
    flows = netcoll.collective_flows(topology, layout, "tp", collective, algorithm)
    out = []
    tree = algorithm == "tree"
    for p, steps in enumerate(flows.steps):
        rows = flows.phase == p
        lat = 2.0 * np.log2(size) if tree else steps
        frac = flows.msg_frac[rows] * (TREE_BW_PENALTY if tree else 1.0)
        out.append(Phase(flows.routes.incidence[rows], frac, float(steps), lat))
    return out


def default_algorithms(topology: Topology, collective: str, group_size: int = 2) -> tuple[str, ...]:
    """What NCCL chooses from: ring, tree and hierarchical for all-reduce, the ring for
    all-gather and reduce-scatter, the torus rings where the topology has coordinates,
    ``nvls`` where it has switches that reduce (all-gather and reduce-scatter over at most
    ``nvls.NVLS_MAX_ARITY`` ranks), and pairwise sends for all-to-all."""
    if collective == "all_to_all":
        return ("pairwise",)
    names = ("ring", "tree", "hierarchical") if collective == "all_reduce" else ("ring",)
    names += ("torus",) if topology.coords is not None else ()
    switch = len(topology.reducing_nodes()) and nvls.offered(collective, group_size)
    return names + (("nvls",) if switch else ())


def link_classes(topology: Topology) -> np.ndarray:
    """``[links]`` 1.0 where both ends are GPUs or NVSwitches (NVLink), else 0.0 (network)."""
    fast = np.array([k in NVLINK_KINDS for k in topology.kinds])
    return (fast[topology.src] & fast[topology.dst]).astype(float)


def collective_pricing(
    topology: Topology,
    collective: str,
    group_size: int,
    n_groups: int = 1,
    algorithms=None,
    xla: bool = False,
    transport: str = "rdma",
    protocols: bool = False,
    nvls_channels: int = nvls.DEFAULT_NVLS_CHANNELS,
) -> CollectivePricing:
    """Fixed-shape arrays for ``collective`` run by ``n_groups`` groups of ``group_size``
    consecutive ranks at once, rank ``r`` on endpoint ``r`` (numpy, outside jit). Endpoints
    without a rank relay nothing (NCCL does not route through GPUs outside the communicator).

    Args:
        topology: the graph.
        collective: a key of ``TRAFFIC``.
        group_size, n_groups: the groups (all run concurrently).
        algorithms: names to choose from; default ``default_algorithms``. With the default,
            an algorithm the placement cannot run (hierarchical over uneven domains) is left out.
        xla: price the collective as XLA's table times it (``CollectivePricing.xla``).
        transport: the cluster's network transport, a name in ``specs.TRANSPORTS``
            (``CollectivePricing.tcp``).
        protocols: offer NCCL's LL128 protocol besides Simple (``CollectivePricing.protocols``).
        nvls_channels: NCCL's NVLS channels on these GPUs (``nvls.nvls_channels(family)``).

    Raises:
        ValueError: an unknown collective, algorithm or transport, too few endpoints, or a
            group of one.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: expected one of {', '.join(TRANSPORTS)}")
    if collective not in TRAFFIC:
        raise ValueError(f"collective={collective!r}: expected one of {', '.join(TRAFFIC)}")
    if group_size < 2 or n_groups < 1:
        raise ValueError(f"group_size={group_size}, n_groups={n_groups}: expected >= 2 and >= 1")
    if group_size * n_groups > len(topology.endpoints):
        raise ValueError(
            f"{group_size} x {n_groups} ranks: {topology.name} has "
            f"{len(topology.endpoints)} endpoints"
        )
    groups = np.arange(group_size * n_groups).reshape(n_groups, group_size)
    idle = topology.endpoints[group_size * n_groups :]
    link_ids = np.flatnonzero(~(np.isin(topology.src, idle) | np.isin(topology.dst, idle)))
    full, topology = topology, without_transit(topology, idle)
    chosen = algorithms or default_algorithms(topology, collective, group_size)
    phases = {}
    for name in chosen:
        try:
            phases[name] = _phases(topology, groups, collective, name)
        except ValueError:
            if algorithms is not None:
                raise
    pricing = _stack(full, link_ids, phases, group_size, collective)
    busy = None
    if any(name in SENDRECV_ALGORITHMS for name in pricing.names):
        busy = jnp.asarray(sendrecv.busy_levels(group_size))
    return pricing.replace(
        xla=float(xla),
        tcp=float(transport == "tcp"),
        protocols=protocols,
        nvls_ops=float(nvls_channels * group_size),
        sendrecv_busy=busy,
    )


def _phases(topology, groups, collective, name) -> list[Phase]:
    if name == "ring":
        return _ring_phases(topology, groups, collective)
    if name == "pairwise":
        return _pairwise_phases(topology, groups, collective)
    if name == "nvls":
        return nvls_phases(topology, groups, collective)
    if name in netcoll.ALGORITHMS:
        return _flow_phases(topology, groups, collective, name)
    raise ValueError(
        f"algorithm={name!r}: expected ring, tree, hierarchical, torus, nvls or pairwise"
    )


def nvls_phases(topology: Topology, groups: np.ndarray, collective: str) -> list[Phase]:
    """NVLink SHARP in one phase of one step (``nvls.switch_flows``).

    Raises:
        ValueError: as ``nvls.switch_flows``.
    """
    incidence, frac, latency_steps = nvls.switch_flows(topology, groups, collective)
    return [Phase(incidence, frac, 1.0, latency_steps)]


def _stack(topology, link_ids, phases: dict, group_size, collective) -> CollectivePricing:
    """Pad and stack the phases; ``link_ids`` maps the routed links to ``topology``'s."""
    used = np.zeros(len(link_ids), dtype=bool)
    for plist in phases.values():
        for ph in plist:
            used |= (ph.incidence > 0).any(axis=0)
    links = np.flatnonzero(used)
    network = 1.0 - link_classes(topology)[link_ids[links]]
    algs = []
    for name, plist in phases.items():
        n_flows = max(len(ph.frac) for ph in plist)
        inc = np.zeros((len(plist), n_flows, len(links)))
        frac = np.zeros((len(plist), n_flows))
        for p, ph in enumerate(plist):
            inc[p, : len(ph.frac)] = ph.incidence[:, links]
            frac[p, : len(ph.frac)] = ph.frac
        steps = np.array([ph.steps for ph in plist], dtype=float)
        lat = np.array([ph.latency_steps for ph in plist], dtype=float)
        in_switch = np.array(1.0 if name in SWITCH_ALGORITHMS else 0.0)
        crosses = np.array(float((inc.sum(axis=(0, 1)) * network).any()))
        arrays = (jnp.asarray(a) for a in (inc, frac, steps, lat, in_switch, crosses))
        algs.append(AlgorithmArrays(*arrays))
    links = link_ids[links]
    return CollectivePricing(
        links=jnp.asarray(links),
        nvlink=jnp.asarray(link_classes(topology)[links]),
        latency_s=jnp.asarray(topology.latency_s[links]),
        group_size=float(group_size),
        algorithms=tuple(algs),
        names=tuple(phases),
        collective=collective,
    )


# --- pricing (JAX) ------------------------------------------------------------------------------

LinkTimeFn = Callable[[jax.Array, jax.Array, jax.Array, float], jax.Array]


def most_loaded_link_s(incidence, capacity_Bps, flow_bytes, temperature):
    """Seconds of one step: the bytes on the most loaded link over its capacity (smooth max).

    Args:
        incidence: ``[F, L]`` share of each flow's bytes on each link.
        capacity_Bps: ``[L]`` effective capacities.
        flow_bytes: ``[F]`` bytes each flow moves in the step.
        temperature: softness of the maximum over links.
    """
    return smooth.smooth_max((flow_bytes @ incidence) / capacity_Bps, temperature=temperature)


def _present(msg_bytes):
    return msg_bytes / (msg_bytes + _ZERO_BYTES)


def _algorithm_s(
    alg: AlgorithmArrays,
    msg_bytes,
    capacity,
    latency,
    params,
    temperature,
    fn,
    pipelined,
    late_bytes=0.0,
):
    step_bytes = msg_bytes + (params.half_bw_bytes + late_bytes) * _present(msg_bytes)

    def phase(incidence, frac, steps, latency_steps):
        t = fn(incidence, capacity, frac * step_bytes, temperature)
        path = jnp.where(frac > 0, incidence @ latency, 0.0)
        hop = smooth.smooth_max(path, temperature=temperature)
        return steps * t, latency_steps * hop * _present(msg_bytes)

    band, lat = jax.vmap(phase)(alg.incidence, alg.frac, alg.steps, alg.latency_steps)
    if pipelined and alg.incidence.shape[0] > 1:
        # chunks stream through the phases: each link carries its bytes of all phases
        n_phases, n_flows, n_links = alg.incidence.shape
        flow_bytes = (alg.steps[:, None] * alg.frac * step_bytes).reshape(-1)
        incidence = alg.incidence.reshape(n_phases * n_flows, n_links)
        return fn(incidence, capacity, flow_bytes, temperature) + jnp.sum(lat)
    return jnp.sum(band) + jnp.sum(lat)


def _effective_links(
    pricing: CollectivePricing, capacity_Bps, params: Params, name: str, alg: AlgorithmArrays
):
    """Capacities times their class's efficiency and latencies times its scale, on the
    pricing's links, for algorithm ``name`` (``alg``): NVLink links run at ``nvls_ratio *
    nvlink_eff`` for an algorithm ``in_switch``, network links at ``tcp_ring_share * nic_eff``
    for the ring over a TCP transport (``TCP_RING_ALGORITHMS``)."""
    fast = pricing.nvlink
    tcp_ring = pricing.tcp if name in TCP_RING_ALGORITHMS else 0.0
    nvlink_eff = params.nvlink_eff * (1.0 + alg.in_switch * (params.nvls_ratio - 1.0))
    nic_eff = params.nic_eff * (1.0 + tcp_ring * (params.tcp_ring_share - 1.0))
    eff = fast * nvlink_eff + (1.0 - fast) * nic_eff
    capacity = jnp.take(jnp.asarray(capacity_Bps), pricing.links) * eff
    scale = fast * params.nvlink_latency_scale + (1.0 - fast) * params.nic_latency_scale
    return capacity, pricing.latency_s * scale


def collective_time_s(
    pricing: CollectivePricing,
    msg_bytes,
    capacity_Bps,
    params: Params,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
    link_time: LinkTimeFn = most_loaded_link_s,
    pipelined: bool = True,
):
    """Seconds of one collective of a ``msg_bytes`` buffer (scalar; ``jax.vmap`` for many).

    Args:
        pricing: ``collective_pricing(...)`` of the topology and groups.
        msg_bytes: buffer size (bytes), the nccl-tests ``size``.
        capacity_Bps: ``[links]`` capacity of every link of the topology (its
            ``capacity_Bps``, or a what-if); gradients flow to it.
        params: calibrated constants (efficiencies, latency scales, ``half_bw_bytes``,
            ``reduce_Bps``, ``collective_overhead_s``).
        temperature: softness of the smooth maxima and of the minimum over algorithms.
        link_time: ``(incidence [F, L], capacity [L], flow_bytes [F], temperature) -> s``
            of one step; the default is the most loaded link.
        pipelined: phases stream chunk by chunk (NCCL's pipelined algorithms), so an
            algorithm's bandwidth time is ``link_time`` of the bytes of all its phases at once
            (a link used by two phases carries both; links of different phases overlap);
            False: the phases' times add.
    """
    # the GPUs' own passes: the reduction, and XLA's pass over each rank's chunk
    gpu_s = 0.0
    if pricing.collective in CHUNK_PASS_COLLECTIVES:
        rate = params.chunk_reduce_Bps if pricing.collective in REDUCES else params.chunk_pass_Bps
        gpu_s = pricing.xla * msg_bytes / (pricing.group_size * rate)
    if pricing.collective in REDUCES:
        gpu_s = gpu_s + TRAFFIC[pricing.collective] / 2.0 * msg_bytes / params.reduce_Bps
    times = []
    for name, alg in zip(pricing.names, pricing.algorithms):
        capacity, latency = _effective_links(pricing, capacity_Bps, params, name, alg)
        late = 0.0
        if name in SWITCH_ALGORITHMS:  # NVLS's own curve: its chunks shrink for small messages
            capacity = capacity * nvls.chunk_efficiency(params, msg_bytes, pricing.nvls_ops)
            late = -params.half_bw_bytes  # not the Simple protocol's buffers
        if name in SENDRECV_ALGORITHMS:  # XLA's: own curve, channels by size, concurrent peers
            late = pricing.xla * (params.sendrecv_half_bw_bytes - params.half_bw_bytes)
            busy = pricing.sendrecv_busy
            share = sendrecv.peer_share(params, msg_bytes, pricing.group_size, temperature, busy)
            capacity = capacity * (1.0 + pricing.xla * (share - 1.0))
            flight = sendrecv.peers_in_flight(params, msg_bytes, pricing.group_size)
            latency = latency * (1.0 + pricing.xla * (1.0 / flight - 1.0))
        args = (alg, msg_bytes, capacity, latency, params, temperature, link_time, pipelined)
        t = _algorithm_s(*args, late)
        if pricing.protocols and name in LL128_ALGORITHMS:
            t = smooth.smin2(t, _ll128_s(*args), temperature)
        # an in-switch reduction skips the GPU's passes and pays the switch's setup per call
        switch_s = params.nvls_latency_s * _present(msg_bytes)
        t = t + (1.0 - alg.in_switch) * gpu_s + alg.in_switch * switch_s
        # over TCP, an algorithm on every NIC pays its fixed cost per call
        fill = 0.0 if name in TCP_RING_ALGORITHMS else pricing.tcp * alg.network
        times.append(t + fill * params.tcp_fill_s * _present(msg_bytes))
    best = times[0]
    if len(times) > 1:
        best = smooth.smooth_min(jnp.stack(times), axis=0, temperature=temperature)
    return best + params.collective_overhead_s * _present(msg_bytes)


def _ll128_s(alg, msg_bytes, capacity, latency, params, temperature, fn, pipelined):
    """An algorithm's time under NCCL's LL128 protocol (``_algorithm_s``'s arguments): the
    links at ``ll128_bw_share`` of their capacity, its own small-message curve and per-step
    latency."""
    capacity = capacity * params.ll128_bw_share
    latency = latency * LL128_STEP_LATENCY_RATIO
    late = params.ll128_half_bw_bytes - params.half_bw_bytes
    return _algorithm_s(alg, msg_bytes, capacity, latency, params, temperature, fn, pipelined, late)


def algorithm_times_s(pricing, msg_bytes, capacity_Bps, params, temperature=0.0):
    """``{name: seconds}`` of each algorithm alone (bandwidth and latency terms only)."""
    out = {}
    for name, alg in zip(pricing.names, pricing.algorithms):
        capacity, latency = _effective_links(pricing, capacity_Bps, params, name, alg)
        out[name] = _algorithm_s(
            alg, msg_bytes, capacity, latency, params, temperature, most_loaded_link_s, True
        )
    return out
