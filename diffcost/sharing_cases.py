"""sharing_cases: a corpus of networks and concurrent flow sets to check link sharing against.

Each case is what routing hands to ``diffcost.sharing``: an incidence array (flows x directed
links, the fraction of each flow's bytes on each link), link capacities and latencies, flow
sizes and a group per flow (a collective or a send is a group). ``random_case`` draws a random
connected graph and random flows routed on shortest paths with ECMP splits;
``structured_cases`` builds the situations contention matters in (a ring all-reduce step whose
flows share a slow NIC, two collectives crossing one uplink, incast, ECMP over two spines).
``pad`` brings cases to one shape so that they can be stacked and vmapped.

``smooth_batch`` runs ``diffcost.sharing`` over a list of cases at once and
``relative_errors`` compares one case with ``diffcost.sharing_reference``. The graphs here are
small and built for testing, not the cluster topologies.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import sharing, sharing_reference

GBps = 1e9


@dataclasses.dataclass(frozen=True)
class SharingCase:
    """One network and one set of flows that start together.

    Shapes: ``incidence`` (flows, links) in [0, 1]; ``capacity_Bps`` and ``latency_s``
    (links,); ``flow_bytes``, ``group`` and ``start_s`` (flows,), ``group`` in
    ``[0, n_groups)`` or -1.
    """

    name: str
    incidence: np.ndarray
    capacity_Bps: np.ndarray
    latency_s: np.ndarray
    flow_bytes: np.ndarray
    group: np.ndarray
    n_groups: int
    start_s: np.ndarray | None = None  # (flows,) when each flow starts; all at 0 if None


def random_graph(rng: np.random.Generator, n_nodes: int, extra_edges: int) -> list[tuple]:
    """A connected undirected graph: a random spanning tree plus ``extra_edges`` random edges."""
    order = rng.permutation(n_nodes)
    edges = {tuple(sorted((int(order[i]), int(order[rng.integers(i)])))) for i in range(1, n_nodes)}
    for _ in range(extra_edges):
        u, v = rng.choice(n_nodes, 2, replace=False)
        edges.add(tuple(sorted((int(u), int(v)))))
    return sorted(edges)


def ecmp_incidence(n_nodes: int, links: list[tuple], pairs: list[tuple]) -> np.ndarray:
    """Route each (src, dst) on its shortest paths (hops), splitting evenly at every hop.

    Args:
        n_nodes: nodes of the graph.
        links: directed links ``(u, v)``.
        pairs: ``(src, dst)`` per flow, ``src != dst``, connected.

    Returns:
        (flows, links) fraction of each flow crossing each link.
    """
    out_links = [[] for _ in range(n_nodes)]
    for k, (u, v) in enumerate(links):
        out_links[u].append((v, k))
    incidence = np.zeros((len(pairs), len(links)))
    for f, (src, dst) in enumerate(pairs):
        dist = _hops_to(dst, n_nodes, links)
        share = np.zeros(n_nodes)
        share[src] = 1.0
        for u in sorted(range(n_nodes), key=lambda n: -dist[n]):
            if share[u] == 0 or u == dst:
                continue
            nxt = [(v, k) for v, k in out_links[u] if dist[v] == dist[u] - 1]
            for v, k in nxt:
                incidence[f, k] += share[u] / len(nxt)
                share[v] += share[u] / len(nxt)
    return incidence


def _hops_to(dst: int, n_nodes: int, links: list[tuple]) -> np.ndarray:
    """Hop distance of every node to ``dst`` along directed links (BFS on reversed links)."""
    into = [[] for _ in range(n_nodes)]
    for u, v in links:
        into[v].append(u)
    dist = np.full(n_nodes, np.inf)
    dist[dst] = 0
    queue = deque([dst])
    while queue:
        v = queue.popleft()
        for u in into[v]:
            if dist[u] == np.inf:
                dist[u] = dist[v] + 1
                queue.append(u)
    return dist


def random_case(rng: np.random.Generator, name: str = "random") -> SharingCase:
    """A random connected graph (6-14 nodes), capacities 10-400 GB/s per direction (log-
    uniform, each direction drawn apart), latencies 1-10 us, and 4-24 flows between random
    node pairs on ECMP shortest paths, 1 MB - 1 GB each, in 1-4 groups."""
    n_nodes = int(rng.integers(6, 15))
    edges = random_graph(rng, n_nodes, int(rng.integers(0, n_nodes)))
    links = edges + [(v, u) for u, v in edges]
    n_flows = int(rng.integers(4, 25))
    pairs = [tuple(int(x) for x in rng.choice(n_nodes, 2, replace=False)) for _ in range(n_flows)]
    n_groups = int(rng.integers(1, 5))
    return SharingCase(
        name=name,
        incidence=ecmp_incidence(n_nodes, links, pairs),
        capacity_Bps=np.exp(rng.uniform(np.log(10), np.log(400), len(links))) * GBps,
        latency_s=rng.uniform(1e-6, 10e-6, len(links)),
        flow_bytes=np.exp(rng.uniform(np.log(1e6), np.log(1e9), n_flows)),
        group=rng.integers(0, n_groups, n_flows),
        n_groups=n_groups,
    )


def _star(n_hosts: int, up_GBps, down_GBps, latency_s: float = 2e-6):
    """Hosts on one switch: link ``h`` is host h's uplink, ``n + h`` its downlink."""
    up, down = np.broadcast_to(up_GBps, n_hosts), np.broadcast_to(down_GBps, n_hosts)
    capacity = np.concatenate([up, down])
    return capacity * GBps, np.full(2 * n_hosts, latency_s)


def _star_flows(n_hosts: int, pairs: list[tuple]) -> np.ndarray:
    incidence = np.zeros((len(pairs), 2 * n_hosts))
    for f, (src, dst) in enumerate(pairs):
        incidence[f, src] = incidence[f, n_hosts + dst] = 1.0
    return incidence


def _leaf_spine(n_leaves: int, hosts_per_leaf: int, n_spines: int, host_GBps, uplink_GBps):
    """Hosts on leaves on spines; directed links and capacities (GB/s) in one list."""
    n_hosts = n_leaves * hosts_per_leaf
    leaf = lambda i: n_hosts + i  # noqa: E731
    spine = lambda s: n_hosts + n_leaves + s  # noqa: E731
    links, capacity = [], []
    for h in range(n_hosts):
        links += [(h, leaf(h // hosts_per_leaf)), (leaf(h // hosts_per_leaf), h)]
        capacity += [host_GBps, host_GBps]
    for i in range(n_leaves):
        for s in range(n_spines):
            links += [(leaf(i), spine(s)), (spine(s), leaf(i))]
            capacity += [uplink_GBps[i][s]] * 2
    return n_hosts + n_leaves + n_spines, links, np.array(capacity) * GBps


def structured_cases() -> list[SharingCase]:
    """Cases built by hand: the situations where links are shared.

    * ``ring_step_slow_nic``: one step of a ring all-reduce over 8 hosts on a switch (host i
      sends to i + 1), equal chunks; host 3's NIC runs at 25 GB/s, the others at 50;
    * ``two_collectives_one_uplink``: two leaves of 4 hosts under one spine at 2:1 tapering; two
      rings (hosts 0,1,4,5 and 2,3,6,7) whose cross-leaf steps share the leaf uplinks, with
      different chunk sizes;
    * ``incast``: 7 hosts send different sizes to host 0 on one switch;
    * ``ecmp_two_spines``: 4 hosts of leaf 0 send to the 4 hosts of leaf 1 over two spines,
      split evenly by ECMP; one spine's uplinks are half as fast; a second group sends back.
    """
    cases = []
    n = 8
    cap, lat = _star(n, [50, 50, 50, 25, 50, 50, 50, 50], 50)
    cases.append(
        SharingCase(
            "ring_step_slow_nic",
            _star_flows(n, [(i, (i + 1) % n) for i in range(n)]),
            cap,
            lat,
            np.full(n, 64e6),
            np.zeros(n, int),
            1,
        )
    )
    n_nodes, links, cap = _leaf_spine(2, 4, 1, 50, [[100], [100]])
    rings = [[0, 1, 4, 5], [2, 3, 6, 7]]
    pairs = [(r[i], r[(i + 1) % 4]) for r in rings for i in range(4)]
    cases.append(
        SharingCase(
            "two_collectives_one_uplink",
            ecmp_incidence(n_nodes, links, pairs),
            cap,
            np.full(len(links), 2e-6),
            np.array([32e6] * 4 + [96e6] * 4),
            np.array([0] * 4 + [1] * 4),
            2,
        )
    )
    cap, lat = _star(n, 50, 50)
    pairs = [(i, 0) for i in range(1, n)]
    cases.append(
        SharingCase(
            "incast",
            _star_flows(n, pairs),
            cap,
            lat,
            np.array([8e6, 16e6, 32e6, 64e6, 64e6, 128e6, 256e6]),
            np.arange(7),
            7,
        )
    )
    n_nodes, links, cap = _leaf_spine(2, 4, 2, 100, [[200, 100], [200, 100]])
    pairs = [(h, 4 + h) for h in range(4)] + [(4 + h, (h + 1) % 4) for h in range(4)]
    cases.append(
        SharingCase(
            "ecmp_two_spines",
            ecmp_incidence(n_nodes, links, pairs),
            cap,
            np.full(len(links), 2e-6),
            np.array([256e6] * 4 + [64e6] * 4),
            np.array([0] * 4 + [1] * 4),
            2,
        )
    )
    return cases


def corpus(n_random: int = 50, seed: int = 0) -> list[SharingCase]:
    """``n_random`` random cases (seeded) followed by the structured ones."""
    rng = np.random.default_rng(seed)
    return [random_case(rng, f"random_{i}") for i in range(n_random)] + structured_cases()


def staggered(cases: list[SharingCase], seed: int = 0) -> list[SharingCase]:
    """The same cases with start times: each flow starts at 0 with probability 1/2, otherwise
    uniformly within the case's exact makespan when all start together."""
    rng = np.random.default_rng(seed)
    out = []
    for case in cases:
        span = sharing_reference.completion_times_s(
            case.incidence, case.capacity_Bps, case.latency_s, case.flow_bytes
        ).max()
        n = len(case.flow_bytes)
        start = np.where(rng.random(n) < 0.5, 0.0, rng.uniform(0.0, span, n))
        out.append(dataclasses.replace(case, name=f"{case.name}_staggered", start_s=start))
    return out


def _starts(case: SharingCase) -> np.ndarray:
    return np.zeros(len(case.flow_bytes)) if case.start_s is None else case.start_s


def pad(case: SharingCase, n_flows: int, n_links: int) -> SharingCase:
    """The same case with padding flows (no bytes, no links, group -1) and padding links
    (capacity 1 B/s, no latency, no flows) up to the given shape."""
    f, k = case.incidence.shape
    if n_flows < f or n_links < k:
        raise ValueError(f"pad: case {case.name!r} is {f} x {k}, larger than {n_flows} x {n_links}")
    return dataclasses.replace(
        case,
        incidence=np.pad(case.incidence, ((0, n_flows - f), (0, n_links - k))),
        capacity_Bps=np.pad(case.capacity_Bps, (0, n_links - k), constant_values=1.0),
        latency_s=np.pad(case.latency_s, (0, n_links - k)),
        flow_bytes=np.pad(case.flow_bytes, (0, n_flows - f)),
        group=np.pad(case.group, (0, n_flows - f), constant_values=-1),
        start_s=np.pad(_starts(case), (0, n_flows - f)),
    )


def stack(cases: list[SharingCase]) -> dict[str, np.ndarray]:
    """Pad every case to the largest shape and stack the arrays (leading axis: case)."""
    n_flows = max(c.incidence.shape[0] for c in cases)
    n_links = max(c.incidence.shape[1] for c in cases)
    padded = [pad(c, n_flows, n_links) for c in cases]
    fields = ("incidence", "capacity_Bps", "latency_s", "flow_bytes", "group", "start_s")
    return {name: np.stack([getattr(c, name) for c in padded]) for name in fields}


def smooth_batch(cases: list[SharingCase], dtype=None, temperature: float | None = None):
    """``diffcost.sharing`` on every case at once: pad, stack, ``jit(vmap)``.

    Args:
        cases: the cases.
        dtype: float dtype of the inputs (the default float dtype if None).
        temperature: ``diffcost.sharing.DEFAULT_TEMPERATURE`` if None.

    Returns:
        ``(fn, args, unpad)``: ``fn(*args)`` gives (completion_s, makespan_s) stacked over the
        padded cases; ``unpad(result)`` splits it into per-case numpy arrays
        ``[(completion_s (flows,), makespan_s (groups,)), ...]``.
    """
    temperature = sharing.DEFAULT_TEMPERATURE if temperature is None else temperature
    n_groups = max(c.n_groups for c in cases)
    arrays = stack(cases)
    dtype = jnp.zeros(()).dtype if dtype is None else dtype
    args = tuple(
        jnp.asarray(arrays[k], dtype=dtype)
        for k in ("incidence", "capacity_Bps", "latency_s", "flow_bytes", "start_s")
    ) + (jnp.asarray(arrays["group"]),)
    any_start = any(c.start_s is not None for c in cases)

    def one(incidence, capacity_Bps, latency_s, flow_bytes, start_s, group):
        done = sharing.completion_times_s(
            incidence,
            capacity_Bps,
            latency_s,
            flow_bytes,
            start_s=start_s if any_start else None,
            temperature=temperature,
        )
        return done, sharing.group_makespan_s(done, group, n_groups, temperature)

    def unpad(result):
        done, span = (np.asarray(x, dtype=float) for x in result)
        return [
            (done[i, : c.incidence.shape[0]], span[i, : c.n_groups]) for i, c in enumerate(cases)
        ]

    return jax.jit(jax.vmap(one)), args, unpad


def relative_errors(case: SharingCase, completion_s, makespan_s) -> np.ndarray:
    """|smooth / exact - 1| of every flow's completion and every non-empty group's makespan,
    the exact values from ``diffcost.sharing_reference``."""
    exact = sharing_reference.completion_times_s(
        case.incidence, case.capacity_Bps, case.latency_s, case.flow_bytes, start_s=case.start_s
    )
    span = sharing_reference.group_makespan_s(exact, case.group, case.n_groups)
    has = span > 0
    got_span = np.asarray(makespan_s, dtype=float)
    flows = np.abs(np.asarray(completion_s, dtype=float) - exact) / np.where(exact > 0, exact, 1.0)
    return np.concatenate([flows, np.abs(got_span[has] - span[has]) / span[has]])


def few_flow_sets(n_random: int = 300, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sets of three flows of one unit on three tiers, as ``network.model.shared_delays_s``
    shares them (a gradient bucket, a tensor-parallel collective and a pipeline send): the
    bytes each unit puts on each tier's busiest link, log-uniform in [1e5, 1e9] and present
    with probability 0.6, on tiers of 150, 25 and 12.5 GB/s; one set in ten without the
    tensor-parallel flow and one in ten with the send equal to the bucket (a tie); then a few
    structured sets (three equal flows, flows on disjoint tiers, one flow alone).

    Returns:
        ``(incidence, capacity_Bps)``: (sets, 3, 3) bytes and (sets, 3) bytes/s.
    """
    rng = np.random.default_rng(seed)
    rows = 10.0 ** rng.uniform(5.0, 9.0, (n_random, 3, 3))
    rows *= rng.random((n_random, 3, 3)) < 0.6
    rows[: n_random // 10, 1] = 0.0
    rows[n_random // 10 : n_random // 5, 2] = rows[n_random // 10 : n_random // 5, 0]
    structured = np.array(
        [
            [[4e8, 0, 0]] * 3,
            [[3e8, 0, 0], [0, 2e8, 0], [0, 0, 1e7]],
            [[3e8, 2e8, 5e7], [0, 0, 0], [0, 0, 0]],
            [[4e8, 1e8, 0], [4e8, 0, 0], [0, 2e7, 1e7]],
        ]
    )
    rows = np.concatenate([rows, structured])
    return rows, np.tile([150 * GBps, 25 * GBps, 12.5 * GBps], (len(rows), 1))


def few_flow_errors(completion_s, incidence, capacity_Bps) -> np.ndarray:
    """``(sets,)`` the largest |smooth / exact - 1| over the flows of each set of
    ``few_flow_sets`` (units: one per flow), the exact times from ``sharing_reference``
    (which takes fractions: every set is divided by its largest entry, the flows' size)."""
    out = np.zeros(len(incidence))
    for i, (rows, capacity) in enumerate(zip(incidence, capacity_Bps)):
        size = rows.max()
        if size == 0:
            continue
        exact = sharing_reference.completion_times_s(
            rows / size, capacity, np.zeros(len(capacity)), np.full(len(rows), size)
        )
        live = exact > 0
        out[i] = np.max(np.abs(np.asarray(completion_s[i])[live] / exact[live] - 1.0))
    return out
