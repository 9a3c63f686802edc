"""The cost model's network path: link loads, tables, pricing on the graph, sharing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost import api
from diffcost.arrays import cluster_arrays
from diffcost.network import generators as gen
from diffcost.network import model as netmodel
from diffcost.network.attach import job_topology
from diffcost.network.graph import LinkSpec
from diffcost.network.load import load_topology
from diffcost.network.loads import link_loads
from diffcost.network.routing import route
from diffcost.network.tables import SLOTS, build_tables, groups_of
from diffcost.simulate import simulate
from diffcost.spec_values import ConfigError

EXAMPLE = "configs/examples/gpt3-175b.yaml"


@pytest.mark.parametrize(
    "name", ["dgx1-cube-mesh", "tpu-torus-4x4x4", "tree-4x2", "leaf-spine-2to1"]
)
def test_link_loads_equal_routes(name):
    topology = load_topology(name)
    n = len(topology.endpoints)
    rng = np.random.default_rng(1)
    src, dst = rng.integers(0, n, 60), rng.integers(0, n, 60)
    weight = rng.uniform(0.1, 2.0, 60)
    load, latency = link_loads(topology, src, dst, weight)
    routes = route(topology, src, dst)
    np.testing.assert_allclose(load, weight @ routes.incidence, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(latency, routes.path_latency_s, rtol=1e-12, atol=1e-20)


def test_groups_follow_the_stride():
    assert groups_of(8, 2, 4).tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups_of(8, 4, 1).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _dgx(nodes):
    exp = api.load(EXAMPLE)
    return gen.from_cluster(exp.cluster, nodes)


def test_ring_loads_in_one_switch_domain():
    """8 GPUs behind one switch: the rotations load every GPU link (n - 1) / n per buffer
    byte; the pipeline send of 8 stages loads one link by a whole buffer."""
    tables = build_tables(_dgx(1), 8)
    grid = np.exp(np.asarray(tables.log_grid)).round().astype(int).tolist()
    row = grid.index(8) * len(grid) + grid.index(1)
    nvlink = list(tables.tiers).index("nvlink")
    load = np.asarray(tables.load)[row]
    assert load[SLOTS.index("ring"), nvlink] == pytest.approx(7 / 8, rel=1e-12)
    assert load[SLOTS.index("send"), nvlink] == pytest.approx(1.0, rel=1e-12)
    assert not np.asarray(tables.load)[: len(grid)].any()  # groups of one rank move nothing


def _arrays(topology="cluster", contention=True):
    exp = api.load(EXAMPLE)
    exp = dataclasses.replace(exp, cluster=dataclasses.replace(exp.cluster, topology=topology))
    model, plan, cluster = api.experiment_arrays(exp)
    network = cluster.network.replace(contention=contention)
    return model, plan, cluster.replace(network=network), api.params_for(exp)[0]


def test_without_topology_nothing_is_attached():
    exp = api.load(EXAMPLE)
    assert api.experiment_arrays(exp)[2].network is None
    assert cluster_arrays(exp.cluster, n_gpus=exp.plan.n_gpus).network is None


def test_graph_path_reproduces_comm_on_the_cluster_graph():
    """On the graph the cluster describes, the network path prices the example within 0.1% of
    the existing one (the same ring shares and constants); contention only adds time."""
    model, plan, cluster, params = _arrays(contention=False)
    graph = float(simulate(model, plan, cluster, params).iteration_s)
    base = float(simulate(model, plan, cluster.replace(network=None), params).iteration_s)
    shared = cluster.replace(network=cluster.network.replace(contention=True))
    contended = float(simulate(model, plan, shared, params).iteration_s)
    assert graph == pytest.approx(base, rel=1e-3)
    assert contended >= graph


def test_a_sync_after_the_backward_shares_links_with_nothing():
    """Without ``overlap_dp`` a ZeRO-0/1 gradient sync runs after the backward, not beside the
    tensor-parallel collectives and the pipeline send: contention adds nothing to it, while
    with ``overlap_dp`` it does (the example's dp ring meets tp and pp traffic on its links)."""
    model, plan, cluster, params = _arrays(contention=False)
    shared = cluster.replace(network=cluster.network.replace(contention=True))
    for overlap, adds in ((1.0, True), (0.0, False)):
        p = plan.replace(overlap_dp=jnp.asarray(overlap))
        alone = float(simulate(model, p, cluster, params).iteration_s)
        contended = float(simulate(model, p, shared, params).iteration_s)
        assert (contended > alone * (1 + 1e-6)) is adds, (overlap, alone, contended)
        if not adds:
            assert contended == pytest.approx(alone, rel=1e-9)


def test_gradients_reach_the_tier_capacities():
    model, plan, cluster, params = _arrays()

    def time_s(capacity):
        c = cluster.replace(network=cluster.network.with_capacities(capacity))
        return simulate(model, plan, c, params).iteration_s

    capacity = jnp.asarray(cluster.network.tier_capacity_Bps)
    grad = np.asarray(jax.grad(time_s)(capacity))
    assert np.all(np.isfinite(grad)) and np.all(grad <= 0) and grad.min() < 0
    for i in range(len(capacity)):
        step = 1e-4 * capacity[i]
        up, down = capacity.at[i].add(step), capacity.at[i].add(-step)
        fd = (float(time_s(up)) - float(time_s(down))) / (2 * float(step))
        assert grad[i] == pytest.approx(fd, rel=2e-2, abs=1e-16)


def test_shared_delays():
    capacity = jnp.array([100.0, 10.0])
    # flows on different tiers do not slow each other
    apart = netmodel.shared_delays_s([jnp.array([50.0, 0.0]), jnp.array([0.0, 5.0])], capacity)
    np.testing.assert_allclose(apart, 0.0, atol=1e-6)
    # two equal flows on one tier: each finishes when both would have, one alone time later
    same = netmodel.shared_delays_s([jnp.array([50.0, 0.0]), jnp.array([50.0, 0.0])], capacity)
    np.testing.assert_allclose(same, 0.5, rtol=1e-3)


# (bucket, tensor-parallel, send) bytes on the (nvlink, nic, leaf_spine) tiers' busiest links
TIERS_BPS = [1.5e11, 2.5e10, 1.25e10]
SHARED_ROWS = {
    "three_tied": [[4e8, 0.0, 0.0]] * 3,
    "bucket_ties_tp": [[4e8, 1e8, 0.0], [4e8, 0.0, 0.0], [0.0, 2e7, 1e7]],
    "no_tp": [[3e8, 2e8, 5e7], [0.0, 0.0, 0.0], [0.0, 2e7, 1e7]],
    "apart": [[3e8, 0.0, 0.0], [0.0, 2e8, 0.0], [0.0, 0.0, 1e7]],
    "send_finishes_first": [[2e8, 3e8, 1e8], [6e8, 0.0, 0.0], [0.0, 1e6, 1e6]],
}
SHARED_GRAD_RTOL = 1e-4  # analytic against central differences (steps 1e-6 of a capacity)
FLOAT32_GRAD_RTOL = 1e-2  # float32 gradients against float64 ones


def _delays_fn(rows):
    weights = jnp.arange(1.0, 4.0, dtype=rows.dtype)  # one weight per flow
    return lambda c: weights @ netmodel.shared_delays_s(list(rows), c)


def _alone_grad_scale(rows, capacity):
    """The largest ``|d (bytes / capacity) / d capacity|``: the scale of the gradients, for the
    absolute tolerance where a delay's gradient is 0 (flows that do not meet)."""
    return float(np.max(np.asarray(rows, float) / np.asarray(capacity, float) ** 2))


@pytest.mark.parametrize("case", sorted(SHARED_ROWS))
def test_shared_delay_gradients_finite_in_float32(case):
    rows = jnp.asarray(SHARED_ROWS[case], jnp.float32)
    capacity = jnp.asarray(TIERS_BPS, jnp.float32)
    grad = jax.grad(_delays_fn(rows))(capacity)
    assert grad.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(grad)))
    exact = np.asarray(jax.grad(_delays_fn(rows.astype(float)))(capacity.astype(float)))
    scale = _alone_grad_scale(rows, capacity)
    np.testing.assert_allclose(grad, exact, rtol=FLOAT32_GRAD_RTOL, atol=FLOAT32_GRAD_RTOL * scale)
    by_rows = jax.grad(lambda r: _delays_fn(r)(capacity))(rows)
    assert np.all(np.isfinite(np.asarray(by_rows)))


@pytest.mark.parametrize("case", sorted(SHARED_ROWS))
def test_shared_delay_gradients_match_central_differences(case):
    rows = jnp.asarray(SHARED_ROWS[case])
    capacity = jnp.asarray(TIERS_BPS)
    fn = _delays_fn(rows)
    grad = np.asarray(jax.grad(fn)(capacity))
    for i in range(len(TIERS_BPS)):
        step = 1e-6 * TIERS_BPS[i]
        fd = (float(fn(capacity.at[i].add(step))) - float(fn(capacity.at[i].add(-step)))) / (
            2 * step
        )
        scale = _alone_grad_scale(rows, capacity)
        assert grad[i] == pytest.approx(fd, rel=SHARED_GRAD_RTOL, abs=SHARED_GRAD_RTOL * scale)


def _capacity_grad(arrays, transform=lambda fn: fn):
    def time_s(capacity, model, plan, cluster, params):
        c = cluster.replace(network=cluster.network.with_capacities(capacity))
        return simulate(model, plan, c, params).iteration_s

    capacity = arrays[2].network.tier_capacity_Bps
    return np.asarray(transform(jax.grad(time_s))(capacity, *arrays))


def test_iteration_time_gradients_finite_in_float32():
    """The sweeps run in float32 (``speed.py``): the iteration time with contention on the
    cluster's graph keeps finite gradients with respect to every tier's capacity, close to
    the float64 ones (which ``test_gradients_reach_the_tier_capacities`` checks against
    central differences). The float32 gradient is compiled, as the sweeps compile it: run
    eagerly it compiled every float32 primitive one by one, which took minutes."""
    arrays = _arrays()
    to32 = lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
    with jax.numpy_dtype_promotion("standard"):
        grad = _capacity_grad(jax.tree_util.tree_map(to32, arrays), jax.jit)
    assert grad.dtype == np.float32 and np.all(np.isfinite(grad)) and grad.min() < 0
    exact = _capacity_grad(arrays)
    scale = float(np.abs(exact).max())
    np.testing.assert_allclose(grad, exact, rtol=FLOAT32_GRAD_RTOL, atol=FLOAT32_GRAD_RTOL * scale)


def test_job_topology_errors():
    exp = api.load(EXAMPLE)
    with pytest.raises(ConfigError, match="unknown topology preset"):
        job_topology(exp.cluster, 8, "no-such-graph")
    with pytest.raises(ConfigError, match="has 8 GPUs"):
        job_topology(exp.cluster, 16, "dgx1-cube-mesh")
    with pytest.raises(ConfigError, match="no topology"):
        job_topology(exp.cluster, 16)


def test_topology_key_in_a_cluster_override():
    exp = api.load(EXAMPLE, ["cluster.topology=cluster"])
    assert exp.cluster.topology == "cluster"
    cluster = api.experiment_arrays(exp)[2]
    assert cluster.network is not None and "leaf_spine" in cluster.network.tiers


def test_two_gpu_groups_on_a_small_fat_tree():
    """Two nodes on a fat-tree: a data-parallel ring across them crosses the NICs."""
    nvlink, nic = LinkSpec(300e9), LinkSpec(25e9)
    fabric = gen.fat_tree(2, 8, nic, hosts=16)
    topology = gen.hierarchical(gen.switch_domain(8, nvlink), 2, fabric)
    tables = build_tables(topology, 16)
    grid = np.exp(np.asarray(tables.log_grid)).round().astype(int).tolist()
    row = grid.index(2) * len(grid) + grid.index(8)  # pairs 8 apart: across the nodes
    load = np.asarray(tables.load)[row, SLOTS.index("ring")]
    assert load[list(tables.tiers).index("nic")] > 0


def test_explain_reports_link_class_elasticities():
    from diffcost.explain import explain

    exp = api.load(EXAMPLE, ["cluster.topology=cluster"])
    rows = {r["key"]: r for r in explain(exp)["elasticities"]}
    tiers = [k for k in rows if k.startswith("link_")]
    assert tiers == [k for k in rows if k in {"link_nvlink", "link_nic", "link_leaf_spine"}]
    assert len(tiers) == 3
    for k in tiers:
        assert -1.0 <= rows[k]["elasticity"] <= 0.0
    assert min(rows[k]["elasticity"] for k in tiers) < 0.0


def _bilinear_reference(table, log_grid, size, stride):
    """Bilinear interpolation of ``table [G * G, ...]`` in ``(log size, log stride)``, the
    cells found by ``np.searchsorted``: what ``netmodel.group``'s one gather computes."""
    g = len(log_grid)

    def hat(x):
        i = int(np.clip(np.searchsorted(log_grid, x, side="right") - 1, 0, g - 2))
        return i, float(np.clip((x - log_grid[i]) / (log_grid[i + 1] - log_grid[i]), 0, 1))

    (i, wi), (j, wj) = hat(np.log(size)), hat(np.log(stride))
    low = (1 - wj) * table[i * g + j] + wj * table[i * g + j + 1]
    high = (1 - wj) * table[(i + 1) * g + j] + wj * table[(i + 1) * g + j + 1]
    return (1 - wi) * low + wi * high


def test_group_lookup_equals_bilinear_interpolation():
    """``group`` (cell corners, one gather, comparisons for the cell) reads the tables as a
    searched bilinear interpolation does, on the grid, between its points and beyond it,
    and the subset of slots it is asked for."""
    tables = build_tables(_dgx(2), 16)
    params = api.params_for(api.load(EXAMPLE))[0]
    prices = netmodel.priced(tables, params, 1e-4)
    log_grid = np.asarray(tables.log_grid)
    points = [(2.0, 1.0), (4.0, 2.0), (16.0, 1.0), (3.0, 1.5), (5.5, 7.0), (0.5, 40.0), (8, 2)]
    tiers = len(tables.tiers)
    for size, stride in points:
        g = netmodel.group(tables, prices, size, stride, slots=(0, 2, 4), loads=(2, 4))
        want = [np.asarray(a) for a in (prices.s_per_byte, prices.latency_s, tables.load)]
        want = [_bilinear_reference(w, log_grid, size, stride) for w in want]
        for slot in (0, 2, 4):
            assert float(g.s_per_byte[slot]) == pytest.approx(want[0][slot], rel=1e-12)
            assert float(g.latency_s[slot]) == pytest.approx(want[1][slot], rel=1e-12)
        for slot in (2, 4):
            np.testing.assert_allclose(g.load[slot], want[2][slot], rtol=1e-12)
            assert g.load[slot].shape == (tiers,)
        load = netmodel.group_load(tables, size, stride)
        np.testing.assert_allclose(load, want[2], rtol=1e-12, atol=0)
