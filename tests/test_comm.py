"""Collective cost model against its closed forms in the limits where they are known."""

import jax.numpy as jnp
import pytest
from helpers import CLUSTER

from diffcost import comm, topology
from diffcost.arrays import cluster_arrays
from diffcost.config import load_cluster
from diffcost.params import default_params

BIG = 2.0**30  # large enough that latency and the small-message term are negligible
REL = 0.02


@pytest.fixture
def env():
    return cluster_arrays(CLUSTER, jnp.float64), default_params(jnp.float64)


def test_placement_follows_the_dimension_order(env):
    c, _ = env
    inner = comm.place(8.0, 1.0, c.gpus_per_node)  # 8 adjacent ranks: one node
    assert float(inner.per_node) == 8.0 and float(inner.nodes) == 1.0
    outer = comm.place(4.0, 8.0, c.gpus_per_node)  # stride of a node: one rank per node
    assert float(outer.per_node) == 1.0 and float(outer.nodes) == 4.0
    mixed = comm.place(16.0, 2.0, c.gpus_per_node)  # 4 per node, 4 nodes
    assert float(mixed.per_node) == 4.0 and float(mixed.nodes) == 4.0


def test_all_reduce_in_one_node_is_the_ring_bound(env):
    c, params = env
    group = comm.place(8.0, 1.0, c.gpus_per_node)
    bw = float(c.nvlink_Bps * params.nvlink_eff)
    reduce = BIG / float(params.reduce_Bps)  # the GPU's pass over the whole buffer
    got = float(comm.all_reduce_s(BIG, group, c, params, 1e-3))
    assert got == pytest.approx(2 * 7 / 8 * BIG / bw + reduce, rel=REL)
    # reduce-scatter moves and reduces half as much; all-gather moves as much, reduces nothing
    assert float(comm.reduce_scatter_s(BIG, group, c, params, 1e-3)) == pytest.approx(
        got / 2, rel=REL
    )
    assert float(comm.all_gather_s(BIG, group, c, params, 1e-3)) == pytest.approx(
        7 / 8 * BIG / bw, rel=REL
    )


def test_bus_bandwidth_grows_with_the_group_behind_a_switch(env):
    """The reduction pass does not shrink with the group, so bus bandwidth (nccl-tests'
    ``2 (n - 1) / n * size / time``) grows with n as ``1 / (1 / B + n / (2 (n - 1)) / R)``."""
    c, params = env
    bw, rate = float(c.nvlink_Bps * params.nvlink_eff), float(params.reduce_Bps)
    for n in (2.0, 4.0, 8.0):
        t = float(comm.all_reduce_s(BIG, comm.place(n, 1.0, c.gpus_per_node), c, params, 1e-3))
        busbw = 2 * (n - 1) / n * BIG / t
        assert busbw == pytest.approx(1 / (1 / bw + n / (2 * (n - 1)) / rate), rel=REL)


def test_all_reduce_across_nodes_is_bounded_by_nic_shares(env):
    c, params = env
    group = comm.place(4.0, 8.0, c.gpus_per_node)  # one rank per node on 4 nodes
    nic = float(c.nic_Bps * params.nic_eff)
    expected = 2 * 3 / 4 * BIG / nic + BIG / float(params.reduce_Bps)
    assert float(comm.all_reduce_s(BIG, group, c, params, 1e-3)) == pytest.approx(expected, rel=REL)


def test_cube_mesh_rings_follow_the_dgx1_links():
    """DGX-1's hybrid cube-mesh: directed rings over its first n GPUs, in links. GPUs 0-4 have
    no Hamiltonian cycle (GPU 4 reaches only GPU 0), so n = 5 takes the weakest GPU's links."""
    links = topology.ring_links(topology.DGX1_LINKS)
    assert list(links[2:]) == [1, 2, 4, 2, 2, 4, 6]
    assert topology.DGX1_LINKS.sum(axis=0).tolist() == [6] * 8  # 6 NVLinks per V100
    share = topology.ring_share("cube-mesh", 8)
    assert share[8] == 1.0 and share[2] == pytest.approx(1 / 6)
    mesh = topology.ring_share("mesh", 8)  # one link per peer
    assert mesh[2:9] == pytest.approx([k / 7 for k in range(1, 8)])
    assert list(topology.ring_share("switch", 72)) == [1.0] * topology.RING_TABLE


def test_cube_mesh_all_reduce_uses_the_group_rings():
    v100 = cluster_arrays(load_cluster("generic-v100"), jnp.float64)
    params = default_params(jnp.float64)
    bw = float(v100.nvlink_Bps * params.nvlink_eff)
    rate = float(params.reduce_Bps)
    for n, rings in ((2, 1), (3, 2), (4, 4), (6, 2), (8, 6)):
        group = comm.place(float(n), 1.0, v100.gpus_per_node)
        t = float(comm.all_reduce_s(BIG, group, v100, params, 1e-3))
        ring = 2 * (n - 1) / n * BIG / (bw * rings / 6)
        assert t == pytest.approx(ring + BIG / rate, rel=REL), n


def test_spanning_nodes_takes_the_faster_algorithm(env):
    """8 nodes x 8 GPUs: a flat ring whose node crossings use all 8 NIC shares (NCCL's
    multi-channel ring) beats the two-level scheme, whose phases do not overlap."""
    c, params = env
    group = comm.place(64.0, 1.0, c.gpus_per_node)
    t = float(comm.all_reduce_s(BIG, group, c, params, 1e-3))
    nvl = float(c.nvlink_Bps * params.nvlink_eff)
    nic = float(c.nic_Bps * params.nic_eff)
    ring = 2 * 63 / 64 * BIG / min(nvl, 8 * nic) + 2 * 63 * float(c.nic_latency_s)
    hier = 2 * 7 / 8 * BIG / nvl + 2 * 7 / 8 * (BIG / 8) / nic
    assert ring < hier
    assert t == pytest.approx(ring + BIG / float(params.reduce_Bps), rel=REL)


def test_gather_and_scatter_across_nodes_pay_a_ring_of_nic_hops(env):
    """NCCL runs all-gather and reduce-scatter on a ring only: a small message over 8 nodes of
    8 GPUs takes 63 steps, each waiting for a NIC hop, while all-reduce may use its tree."""
    c, params = env
    group = comm.place(64.0, 1.0, c.gpus_per_node)
    nic_lat = float(c.nic_latency_s * params.nic_latency_scale)
    call = float(params.collective_overhead_s)
    ring_bps = min(float(c.nvlink_Bps * params.nvlink_eff), 8 * float(c.nic_Bps * params.nic_eff))
    small = 1e3  # bytes: latency-bound
    t_ag = float(comm.all_gather_s(small, group, c, params, 1e-3))
    curve = 63 / 64 * (small + float(params.half_bw_bytes)) / ring_bps  # small-message term
    assert t_ag == pytest.approx(63 * nic_lat + curve + call, rel=0.01)
    t_rs = float(comm.reduce_scatter_s(small, group, c, params, 1e-3))
    assert t_rs == pytest.approx(t_ag, rel=0.05)
    # the two-level scheme would need only 7 NVLink and 7 NIC steps
    assert t_ag > 2 * (7 * float(c.nvlink_latency_s) + 7 * nic_lat)
    assert float(comm.all_reduce_s(small, group, c, params, 1e-3)) < 2 * t_ag


def test_small_messages_are_latency_bound_and_monotone(env):
    c, params = env
    group = comm.place(8.0, 1.0, c.gpus_per_node)
    sizes = [0.0, 1.0, 1e3, 1e6, 1e9]
    times = [float(comm.all_reduce_s(s, group, c, params, 1e-3)) for s in sizes]
    assert times[0] == pytest.approx(0.0, abs=1e-15)
    assert all(a < b for a, b in zip(times[1:], times[2:]))
    assert times[1] >= float(c.nvlink_latency_s)  # at least one hop of latency


def test_all_to_all_and_send(env):
    c, params = env
    group = comm.place(8.0, 1.0, c.gpus_per_node)
    nvl = float(c.nvlink_Bps * params.nvlink_eff)
    assert float(comm.all_to_all_s(BIG, group, c, params, 1e-3)) == pytest.approx(
        7 / 8 * BIG / nvl, rel=REL
    )
    nic = float(c.nic_Bps * params.nic_eff)
    assert float(comm.send_recv_s(BIG, 1.0, c, params)) == pytest.approx(BIG / nic, rel=REL)
    assert float(comm.send_recv_s(BIG, 0.0, c, params)) == pytest.approx(BIG / nvl, rel=REL)
