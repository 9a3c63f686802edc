"""Topologies as graphs: presets are what they claim, max-flow, routing, placement, collectives."""

import itertools

import numpy as np
import pytest

from diffcost import comm
from diffcost.config import available_presets, load_cluster
from diffcost.network import collectives, flow, routing
from diffcost.network import generators as gen
from diffcost.network.graph import LinkSpec
from diffcost.network.load import available_topologies, load_topology
from diffcost.specs import PlanSpec
from diffcost.topology import RING_TABLE, ring_share

REL = 1e-9  # float tolerance on bandwidth sums
GBPS = 1e9  # GB/s in B/s
GBITPS = 1e9 / 8  # Gb/s in B/s


def _degrees(t, kind):
    """Set of physical link counts leaving the nodes of one kind."""
    return set(t.degree()[t.nodes_of(kind)].tolist())


def _min_bisection_links(t):
    """Brute force: the fewest links across any split of a direct network into halves."""
    m = t.link_matrix(t.endpoints)
    n = len(m)
    best = None
    for rest in itertools.combinations(range(1, n), n // 2 - 1):
        side = np.zeros(n, bool)
        side[[0, *rest]] = True
        cut = m[side][:, ~side].sum()
        if best is None or cut < best[0]:
            best = (cut, np.flatnonzero(side))
    return best


# --- presets: degrees and bisection ---------------------------------------------------------


def test_dgx_h100_superpod():
    t = load_topology("dgx-h100-superpod")
    counts = {k: len(t.nodes_of(k)) for k in ("gpu", "nvswitch", "nic", "leaf", "spine", "core")}
    assert counts == {
        "gpu": 1024,
        "nvswitch": 4 * 128,
        "nic": 1024,
        "leaf": 4 * 8,  # one per scalable unit and rail
        "spine": 8 * 4,
        "core": 16,
    }
    assert _degrees(t, "gpu") == {4 + 1}  # four NVSwitch chips and its own NIC
    assert _degrees(t, "nvswitch") == {8}
    assert _degrees(t, "nic") == {2}
    for tier in ("leaf", "spine", "core"):
        assert _degrees(t, tier) == {64}, tier  # 64-port switches, all ports used
    # rail-optimized: every leaf holds NICs of one rail only (GPU j of each node)
    nic_of = {int(s): int(d) for s, d in zip(t.src, t.dst) if t.kinds[d] == "nic"}
    rail = {nic_of[int(gpu)]: j % 8 for j, gpu in enumerate(t.endpoints)}
    for leaf in t.nodes_of("leaf"):
        rails = {rail[int(s)] for s in t.src[t.dst == leaf] if t.kinds[s] == "nic"}
        assert len(rails) == 1
    closed = 128 / 2 * 8 * 400 * GBITPS  # non-blocking: half the nodes' NICs at full rate
    assert flow.bisection_Bps(t) == pytest.approx(closed, rel=REL)


def test_leaf_spine_tapered_2_to_1():
    t = load_topology("leaf-spine-2to1")
    assert len(t.nodes_of("leaf")) == 128 // 32 and len(t.nodes_of("spine")) == 16
    assert _degrees(t, "leaf") == {32 + 16}  # 48 ports: 32 down, 16 up
    assert _degrees(t, "spine") == {4}
    closed = 128 / 2 * 400 * GBITPS / 2  # half the NICs at half their rate
    assert flow.bisection_Bps(t) == pytest.approx(closed, rel=REL)


def test_tpu_torus():
    t = load_topology("tpu-torus-4x4x4")
    assert len(t.endpoints) == 64 and _degrees(t, "gpu") == {6}
    assert t.neighbours().tolist() == [6] * 64
    closed = 2 * 64 / 4 * 50 * GBPS  # cut the x ring in half: two links per x ring
    assert flow.bisection_Bps(t) == pytest.approx(closed, rel=REL)


def test_gb200_nvl72_racks():
    t = load_topology("gb200-nvl72-racks")
    assert len(t.endpoints) == 288 and len(t.nodes_of("nvswitch")) == 4 * 18
    assert _degrees(t, "gpu") == {18 + 1}
    assert _degrees(t, "nvswitch") == {72}
    assert _degrees(t, "leaf") == {64}
    assert set(t.domain.tolist()) == {0, 1, 2, 3}
    closed = 288 / 2 * 400 * GBITPS  # two racks to the other two through the fabric
    assert flow.bisection_Bps(t) == pytest.approx(closed, rel=REL)
    # inside a rack the NVLink switches carry 36 GPUs to the other 36 at 900 GB/s
    rack = np.arange(72)
    assert flow.cut_flow_Bps(t, rack[:36], rack[36:]) == pytest.approx(
        36 * 900 * GBPS + 36 * 400 * GBITPS,
        rel=REL,  # plus a detour through the NICs
    )


def test_dgx1_cube_mesh():
    t = load_topology("dgx1-cube-mesh")
    assert _degrees(t, "gpu") == {6} and t.neighbours().tolist() == [4] * 8
    links, side = _min_bisection_links(t)
    assert links == 6 and side.tolist() == [0, 1, 2, 3]  # the two quads
    assert flow.bisection_Bps(t, side) == pytest.approx(6 * 25 * GBPS, rel=REL)


def test_perftop_exponential_16():
    t = load_topology("perftop-exponential-16")
    assert t.neighbours().tolist() == [7] * 16  # +-1, +-2, +-4 and 8
    assert {j for j in t.dst[t.src == 0].tolist()} == {1, 2, 4, 8, 15, 14, 12}
    links, side = _min_bisection_links(t)
    assert links == 16 and side.tolist() == list(range(0, 16, 2))  # even / odd: the +-1 links
    assert flow.bisection_Bps(t, side) == pytest.approx(16 * 100 * GBITPS, rel=REL)
    # contiguous halves cut 2 + 4 + 8 + 8 links (offsets 1, 2, 4, 8)
    assert flow.bisection_Bps(t) == pytest.approx(22 * 100 * GBITPS, rel=REL)


def test_tree():
    t = load_topology("tree-4x2")
    assert _degrees(t, "host") == {1} and _degrees(t, "leaf") == {5} and _degrees(t, "spine") == {4}
    assert flow.bisection_Bps(t) == pytest.approx(2 * 100 * GBITPS, rel=REL)


def test_every_preset_loads_and_is_connected():
    for name in available_topologies():
        t = load_topology(name)
        assert t.name == name
        assert np.isfinite(routing.distances(t)[:, t.endpoints]).all(), name


@pytest.mark.parametrize(
    "levels,radix,over", [(1, 6, 1.0), (2, 6, 2.0), (2, 8, 1.0), (3, 4, 1.0), (3, 8, 3.0)]
)
def test_fat_tree_bisection(levels, radix, over):
    t = gen.fat_tree(levels, radix, LinkSpec(1.0), over)
    hosts = len(t.endpoints)
    expected = {1: radix, 2: radix * radix * over / (1 + over)}
    expected[3] = radix * radix / 2 * radix * over / (1 + over)
    assert hosts == expected[levels]
    assert flow.bisection_Bps(t) == pytest.approx(hosts / 2 / (over if levels > 1 else 1))


# --- max-flow ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_max_flow_equals_min_cut(seed):
    rng = np.random.default_rng(seed)
    n = 7
    pairs = [(a, b) for a in range(n) for b in range(n) if a != b and rng.random() < 0.4]
    src, dst = np.array(pairs).T
    cap = rng.uniform(0.5, 3.0, len(pairs))
    cuts = []
    for r in range(n - 1):
        for inside in itertools.combinations(range(1, n - 1), r):
            side = np.isin(np.arange(n), (0, *inside))
            cuts.append(cap[side[src] & ~side[dst]].sum())
    assert flow.max_flow(n, src, dst, cap, 0, n - 1) == pytest.approx(min(cuts))


# --- routing -----------------------------------------------------------------------------------

SMALL = {
    "fat_tree": gen.fat_tree(3, 4, LinkSpec(1.0)),
    "torus": gen.torus((3, 4), LinkSpec(1.0)),
    "cube_mesh": gen.cube_mesh(LinkSpec(1.0)),
    "cluster": gen.from_cluster(load_cluster("dgx-h100"), 3),
    "rail": gen.hierarchical(
        gen.switch_domain(4, LinkSpec(4.0)), 4, gen.rail_optimized(4, 2, 2, LinkSpec(1.0), 2, 2)
    ),
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_routes_conserve_flow_on_shortest_paths(name):
    t = SMALL[name]
    n = len(t.endpoints)
    src, dst = np.divmod(np.arange(n * n), n)
    r = routing.route(t, src, dst)
    dist = routing.distances(t)
    for f, (s, d) in enumerate(zip(src, dst)):
        net = np.bincount(t.dst, r.incidence[f], t.n_nodes) - np.bincount(
            t.src, r.incidence[f], t.n_nodes
        )
        expected = np.zeros(t.n_nodes)
        if s != d:
            expected[t.endpoints[s]], expected[t.endpoints[d]] = -1.0, 1.0
        np.testing.assert_allclose(net, expected, atol=1e-12)
        assert r.incidence[f].sum() == pytest.approx(np.round(dist[d, t.endpoints[s]]))  # hops
    assert (r.incidence >= 0).all() and (r.incidence <= 1 + 1e-12).all()


@pytest.mark.parametrize("seed", range(4))
def test_route_hops_match_breadth_first_search(seed):
    rng = np.random.default_rng(seed)
    n = 12
    cables = [(i, i + 1) for i in range(n - 1)]  # a path keeps it connected
    cables += [(a, b) for a in range(n) for b in range(a + 2, n) if rng.random() < 0.2]
    t = gen.explicit(["gpu"] * n, [(a, b, LinkSpec(1.0), 1) for a, b in cables])
    neighbours = {i: set() for i in range(n)}
    for a, b in cables:
        neighbours[a].add(b)
        neighbours[b].add(a)
    src, dst = np.divmod(np.arange(n * n), n)
    r = routing.route(t, src, dst)
    for s in range(n):
        hops, frontier = {s: 0}, [s]
        while frontier:
            frontier = [v for u in frontier for v in neighbours[u] if v not in hops]
            hops.update({v: hops[[u for u in neighbours[v] if u in hops][0]] + 1 for v in frontier})
        for d in range(n):
            assert r.incidence[s * n + d].sum() == pytest.approx(hops[d])
    incidence, mask = r.padded(n * n + 3)
    assert incidence.shape == (n * n + 3, t.n_links) and mask.sum() == n * n
    assert (incidence[~mask] == 0).all()


def test_ecmp_splits_evenly_over_equal_paths():
    t = gen.fat_tree(3, 4, LinkSpec(1.0))  # host 0 to host 15 (another pod): 4 core paths
    r = routing.route(t, [0], [15])
    shares = sorted(r.incidence[0][r.incidence[0] > 0].tolist())
    assert shares == [0.25] * 8 + [0.5] * 4 + [1.0] * 2
    assert r.path_latency_s[0] == 0.0


def test_routes_are_cached_and_read_only():
    t = SMALL["torus"]
    a = routing.route(t, [0, 1], [5, 6])
    assert routing.route(gen.torus((3, 4), LinkSpec(1.0)), [0, 1], [5, 6]) is a
    with pytest.raises(ValueError):
        a.incidence[0, 0] = 1.0
    with pytest.raises(ValueError, match="endpoint indices"):
        routing.route(t, [0], [12])


# --- every cluster preset as a graph, and its ring share ------------------------------------


def _ring_share_cases():
    """Every cluster preset; those whose GPUs reach a NIC faster than each other (PCIe nodes)
    are expected to fail: ``from_cluster`` attaches NICs to the GPUs at the NIC's bandwidth, so
    intra-node routes take the wider hairpin through a NIC, which NCCL does not use."""
    for name in available_presets("clusters"):
        c = load_cluster(name)
        if c.nvlink_GBps * GBPS / 2 < c.nic_Gbps * GBITPS:
            reason = "PCIe node: intra-node routes hairpin through a NIC (docs/network.md)"
            yield pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason))
        else:
            yield name


@pytest.mark.parametrize("name", list(_ring_share_cases()))
def test_cluster_graph_ring_share_matches_table(name):
    cluster = load_cluster(name)
    g = cluster.gpus_per_node
    t = gen.from_cluster(cluster, 2)
    assert len(t.endpoints) == 2 * g and len(t.nodes_of("nic")) == 2 * cluster.nics_per_node
    per_gpu_Bps = cluster.nvlink_GBps * GBPS / 2
    table = ring_share(cluster.intra_node, g)
    for n in range(2, min(g, RING_TABLE - 1) + 1):
        got = collectives.ring_bandwidth_Bps(t, np.arange(n)) / per_gpu_Bps
        assert got == pytest.approx(table[n], rel=1e-9), (name, n)
    # across nodes a GPU's share of the NICs, divided by the oversubscription
    nic_Bps = cluster.nic_Gbps * GBITPS * cluster.nics_per_node / g / cluster.oversubscription
    ring = np.arange(2 * g).reshape(2, g).T.ravel()  # alternate nodes: every hop crosses
    assert collectives.ring_bandwidth_Bps(t, ring[:2]) <= per_gpu_Bps
    r = routing.route(t, np.arange(g), np.arange(g) + g)  # every GPU to its peer, at once
    rate = np.min(r.capacity_Bps[r.load > 0] / r.load[r.load > 0])
    assert rate == pytest.approx(min(nic_Bps, per_gpu_Bps), rel=1e-9)


def test_oversubscribed_fabric_divides_the_nic_share():
    cluster = load_cluster("dgx-h100", {"oversubscription": 2.0})
    t = gen.from_cluster(cluster, 2)
    r = routing.route(t, np.arange(8), np.arange(8) + 8)
    rate = np.min(r.capacity_Bps[r.load > 0] / r.load[r.load > 0])
    assert rate == pytest.approx(400 * GBITPS / 2)
    one = routing.route(t, [0], [8])  # alone, a flow has its NIC to itself
    assert np.min(one.capacity_Bps[one.load > 0] / one.load[one.load > 0]) == 400 * GBITPS


# --- placement ---------------------------------------------------------------------------------

PLANS = [
    PlanSpec(tp=4, dp=4, pp=2),
    PlanSpec(tp=2, cp=2, dp=4, pp=2, ep=2, order=("tp", "cp", "dp", "pp")),
    PlanSpec(tp=2, dp=8, pp=2, ep=4, order=("dp", "tp", "pp", "cp")),
    PlanSpec(tp=8, dp=2, pp=2, order=("pp", "dp", "cp", "tp")),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.order}")
def test_placement_agrees_with_comm_place(plan):
    t = gen.from_cluster(load_cluster("dgx-h100"), 4)
    layout = collectives.place_ranks(t, plan)
    degree = {d: getattr(plan, d) for d in ("tp", "cp", "dp", "pp")}
    stride = {
        d: int(np.prod([degree[o] for o in plan.order[: plan.order.index(d)]])) for d in degree
    }
    stride |= {"ep": stride["dp"], "edp": stride["dp"] * plan.ep}
    degree |= {"ep": plan.ep, "edp": plan.dp // plan.ep}
    for dim in collectives.GROUP_DIMS:
        groups = layout.groups(dim)
        assert groups.shape == (plan.n_gpus // degree[dim], degree[dim])
        assert sorted(groups.ravel().tolist()) == list(range(plan.n_gpus))
        assert (np.diff(groups, axis=1) == stride[dim]).all(), dim
        placed = comm.place(float(degree[dim]), float(stride[dim]), 8.0)
        per_node = [len(np.unique(t.domain[row], return_counts=True)[1]) for row in groups]
        assert degree[dim] / np.mean(per_node) == pytest.approx(float(placed.per_node)), dim


def test_explicit_placement_and_errors():
    t = gen.from_cluster(load_cluster("dgx-h100"), 2)
    plan = PlanSpec(tp=2, dp=2)
    layout = collectives.place_ranks(t, plan, placement=[0, 8, 1, 9])
    assert layout.groups("tp").tolist() == [[0, 1], [2, 3]]
    assert t.domain[layout.endpoint[layout.groups("tp")]].tolist() == [[0, 1], [0, 1]]
    with pytest.raises(ValueError, match="two ranks on one endpoint"):
        collectives.place_ranks(t, plan, placement=[0, 0, 1, 2])
    with pytest.raises(ValueError, match="only 16 endpoints"):
        collectives.place_ranks(t, PlanSpec(tp=8, dp=4))


# --- collectives -------------------------------------------------------------------------------


def _sent_per_rank(f, n_ranks):
    """Share of the buffer each rank sends over a whole collective."""
    return np.bincount(f.src_rank, f.msg_frac * f.steps[f.phase], n_ranks)


@pytest.mark.parametrize("algorithm", ["ring", "hierarchical"])
@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_collective_traffic_per_rank(algorithm, collective):
    t = gen.from_cluster(load_cluster("dgx-h100"), 4)
    plan = PlanSpec(tp=2, dp=16)
    layout = collectives.place_ranks(t, plan)
    f = collectives.collective_flows(t, layout, "dp", collective, algorithm)
    n = 16
    passes = collectives.COLLECTIVE_STEPS[collective]
    np.testing.assert_allclose(_sent_per_rank(f, 32), passes * (n - 1) / n)
    assert f.routes.incidence.shape == (len(f.src_rank), t.n_links)
    assert collectives.collective_flows(t, layout, "dp", collective, algorithm) is f


def test_hierarchical_crosses_nics_only_between_domains():
    t = gen.from_cluster(load_cluster("dgx-h100"), 4)
    layout = collectives.place_ranks(t, PlanSpec(tp=2, dp=16))  # 4 ranks of a group per node
    f = collectives.collective_flows(t, layout, "dp", "all_reduce", "hierarchical")
    assert f.steps.tolist() == [3, 3, 3, 3]  # k - 1 inside, m - 1 twice across, k - 1 inside
    nic_links = np.isin(t.src, t.nodes_of("nic")) | np.isin(t.dst, t.nodes_of("nic"))
    on_nics = f.routes.incidence[:, nic_links].sum(axis=1)
    assert (on_nics[np.isin(f.phase, [0, 3])] == 0).all()
    assert (on_nics[np.isin(f.phase, [1, 2])] == 4).all()  # GPU-NIC-leaf and back down


def test_torus_rings_per_dimension():
    t = load_topology("tpu-torus-4x4x4")
    layout = collectives.place_ranks(t, PlanSpec(tp=4, dp=16))
    f = collectives.collective_flows(t, layout, "dp", "all_reduce", "torus")
    assert f.steps.tolist() == [3, 3, 3, 3]  # y and z rings, reduce-scatter then all-gather
    np.testing.assert_allclose(_sent_per_rank(f, 64), 2 * 15 / 16)
    assert (f.routes.incidence.sum(axis=1) == 1).all()  # every ring hop is one torus link
    g = collectives.collective_flows(t, layout, "tp", "all_gather", "ring")
    assert (g.routes.incidence.sum(axis=1) == 1).all()  # tp rings run along x


def test_double_binary_tree():
    parent = collectives.binary_tree(7)
    assert (parent == -1).sum() == 1 and parent.tolist() == [1, 3, 1, -1, 5, 3, 5]
    t = gen.switch_domain(8, LinkSpec(1.0))
    layout = collectives.place_ranks(t, PlanSpec(dp=8))
    f = collectives.collective_flows(t, layout, "dp", "all_reduce", "tree")
    assert len(f.src_rank) == 4 * 7 and f.steps.tolist() == [1]
    with pytest.raises(ValueError, match="all_reduce only"):
        collectives.collective_flows(t, layout, "dp", "all_gather", "tree")


def test_concurrent_dimensions_share_links():
    t = gen.from_cluster(load_cluster("dgx-h100"), 2)
    layout = collectives.place_ranks(t, PlanSpec(tp=8, pp=2))
    tp = collectives.collective_flows(t, layout, "tp", "all_gather").routes
    pp = collectives.pipeline_flows(t, layout).routes
    both = routing.concatenate([tp, pp])
    assert both.incidence.shape == (16 + 8, t.n_links)
    np.testing.assert_allclose(both.load, tp.load + pp.load)
    with pytest.raises(ValueError, match="different topologies"):
        routing.concatenate([tp, routing.route(gen.mesh(2, LinkSpec(1.0)), [0], [1])])


def test_pipeline_sends_and_empty_groups():
    t = gen.from_cluster(load_cluster("dgx-h100"), 2)
    layout = collectives.place_ranks(t, PlanSpec(tp=8, pp=2))
    f = collectives.pipeline_flows(t, layout)
    assert f.src_rank.tolist() == list(range(8)) and f.dst_rank.tolist() == list(range(8, 16))
    empty = collectives.collective_flows(t, layout, "dp", "all_reduce")
    assert empty.routes.incidence.shape == (0, t.n_links) and empty.steps.size == 0


def test_hierarchical_needs_even_domains():
    t = gen.from_cluster(load_cluster("dgx-h100"), 2)
    layout = collectives.place_ranks(t, PlanSpec(dp=3), placement=[0, 1, 8])
    with pytest.raises(ValueError, match="unevenly"):
        collectives.collective_flows(t, layout, "dp", "all_reduce", "hierarchical")
