"""SBP on a 2-D mesh: a (1, n) mesh prices exactly as the 1-D problem, and on a (2, 4) mesh
the search finds Megatron's MLP on one axis and a split of the batch on the other."""

import jax
import numpy as np
import pytest

import diffcost
from diffcost.opgraph import sbp, sbp2d, sbp_cases, sbp_search
from diffcost.opgraph.sbp import B, P, S
from diffcost.zoo.dense import EncoderBlock


@pytest.fixture(scope="module")
def cluster():
    return diffcost.arrays.cluster_arrays(diffcost.config.load_cluster("dgx-h100"))


def test_a_mesh_of_one_row_prices_as_the_1d_problem(cluster):
    graph = sbp_cases.ChainCase(256, (512, 1024, 512), "tanh", 4).graph()
    params = diffcost.default_params()
    flat = sbp.sbp_costs(sbp.sbp_problem(graph, 4), cluster, params)
    mesh = sbp2d.mesh_problem(graph, (1, 4))
    costs = sbp2d.mesh_parts(mesh, cluster, params).costs()
    np.testing.assert_allclose(costs.node_s, flat.node_s, rtol=1e-12)
    np.testing.assert_allclose(costs.edge_s, flat.edge_s, rtol=1e-12)


def test_pairs_splitting_one_loop_twice_need_the_whole_mesh_to_divide_it():
    f = jax.ShapeDtypeStruct
    g = diffcost.from_jax(lambda w, x: x @ w, f((8, 6), "float32"), f((4, 8), "float32"))
    mesh = sbp2d.mesh_problem(g, (2, 2))
    (node,) = [n for n in mesh.nodes if n.op >= 0]
    names = {s.name for s in node.signatures}
    assert "S0 B -> S0 | S0 B -> S0" in names  # 4 rows over 4 devices
    assert "B S1 -> S1 | B S1 -> S1" not in names  # 6 columns do not split 4 ways
    assert node.signatures[-1].name == "B | B"
    with pytest.raises(ValueError, match="mesh_shape"):
        sbp2d.mesh_problem(g, (2, 0))


def test_megatron_on_one_axis_and_the_batch_on_the_other(cluster):
    block = EncoderBlock(heads=32, mlp=16384)
    x = jax.ShapeDtypeStruct((16, 512, 4096), "float32")  # 8 samples: 2-D tensor parallel
    weights = jax.eval_shape(block.init, jax.random.key(0), x)
    graph = diffcost.from_jax(lambda p, x: block.apply(p, x), weights, x, argnums=(0,))
    mesh = sbp2d.mesh_problem(graph, (2, 4))
    costs = sbp2d.mesh_parts(mesh, cluster, diffcost.default_params()).costs()
    found = sbp_search.gradient_search(mesh, costs)
    assert found.cost_s <= sbp_search.coordinate_descent(mesh, costs).cost_s
    chosen = {
        graph.operators[node.op].scope.rsplit("/", 1)[-1]: node.signatures[s].axes
        for node, s in zip(mesh.nodes, found.choice)
        if node.op >= 0 and graph.operators[node.op].primitive == "dot_general"
    }
    # flax numbers modules as built: Dense_0 is the output projection, Dense_1 the first
    first, second = chosen["Dense_1"], chosen["Dense_0"]
    tp = [ax for ax in (0, 1) if first[ax].inputs == (B, S(1))]
    assert tp, "no axis with a column-parallel first product"
    (ax,) = tp[:1]
    assert second[ax].inputs == (S(2), S(0)) and second[ax].outputs == (P,)
    other = 1 - ax
    for product in (first, second):
        activation, weight = product[other].inputs
        assert weight == B and activation in (S(0), S(1))  # samples or tokens split
