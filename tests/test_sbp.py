"""Per-operator sharding (SBP): signatures, re-layout costs, search against exact optima, and
data parallel, Megatron and FSDP as special cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import diffcost
from diffcost.opgraph import sbp, sbp_cases, sbp_search
from diffcost.opgraph.sbp import B, P, S
from diffcost.zoo.dense import EncoderBlock


@pytest.fixture(scope="module")
def cluster():
    return diffcost.arrays.cluster_arrays(diffcost.config.load_cluster("dgx-h100"))


def _solve(graph, n, cluster):
    problem = sbp.sbp_problem(graph, n)
    costs = sbp.sbp_costs(problem, cluster, diffcost.default_params())
    return problem, costs, sbp_search.gradient_search(problem, costs)


def _chosen(problem, solution, prefix):
    return [
        node.signatures[s]
        for node, s in zip(problem.nodes, solution.choice)
        if node.name.split(" ", 1)[-1].startswith(prefix)
    ]


def test_matmul_signatures_are_oneflows():
    f = jax.ShapeDtypeStruct
    g = diffcost.from_jax(lambda w, x: x @ w, f((64, 32), "float32"), f((16, 64), "float32"))
    problem = sbp.sbp_problem(g, 4)
    (node,) = [n for n in problem.nodes if n.op >= 0]
    # inputs: x then w
    got = {(s.inputs, s.outputs) for s in node.signatures}
    want = {((S(0), B), (S(0),)), ((B, S(1)), (S(1),)), ((S(1), S(0)), (P,)), ((B, B), (B,))}
    assert got == want


def test_relayout_kinds():
    kind = lambda a, b: sbp.RELAYOUTS[sbp.relayout_kind(a, b)]  # noqa: E731
    assert kind(S(0), S(0)) == "none" and kind(B, S(1)) == "none" and kind(S(0), P) == "none"
    assert kind(S(0), B) == "all_gather" and kind(P, B) == "all_reduce"
    assert kind(P, S(1)) == "reduce_scatter" and kind(S(0), S(1)) == "all_to_all"


def test_dynamic_program_matches_brute_force_and_search(cluster):
    case = sbp_cases.ChainCase(64, (256, 512, 256), "none", 2)
    problem = sbp.sbp_problem(case.graph(), case.mesh_size)
    costs = sbp.sbp_costs(problem, cluster, diffcost.default_params())
    brute = sbp_search.brute_force(problem, costs)
    exact = sbp_search.exact_tree(problem, costs)
    assert exact.cost_s == pytest.approx(brute.cost_s, rel=1e-12)
    grad = sbp_search.gradient_search(problem, costs)
    assert grad.cost_s <= exact.cost_s * 1.01
    cd = sbp_search.coordinate_descent(problem, costs)
    assert cd.cost_s >= exact.cost_s * (1 - 1e-12)


def test_costs_are_finite_and_differentiable(cluster):
    case = sbp_cases.ChainCase(512, (1024, 1024, 1024), "tanh", 8)
    problem = sbp.sbp_problem(case.graph(), 8)
    params = diffcost.default_params()

    def total(p):
        c = sbp.sbp_costs(problem, cluster, p)
        return jnp.sum(c.node_s) + jnp.sum(c.edge_s)

    grads = jax.grad(total)(params)
    leaves = jax.tree_util.tree_leaves(grads)
    assert all(np.all(np.isfinite(x)) for x in leaves)
    assert any(np.any(x != 0) for x in leaves)


def test_data_parallel_with_gradient_all_reduce(cluster):
    """Many samples, tiny weights: batch-split products, replicated weights whose gradients
    are all-reduced."""
    case = sbp_cases.ChainCase(16384, (128, 128, 128), "relu", 8)
    problem, costs, sol = _solve(case.graph(), 8, cluster)
    products = _chosen(problem, sol, "dot_general")
    assert all(s.inputs == (S(0), B) for s in products)
    weights = [n for n in problem.nodes if n.trained]
    assert all(n.signatures[sol.choice[problem.nodes.index(n)]].outputs == (B,) for n in weights)
    _, bwd = sbp.relayout_codes(problem)
    all_reduces = [
        u
        for e, u in enumerate(problem.uses)
        if problem.nodes[u.producer].trained
        and bwd[e, sol.choice[u.producer], sol.choice[u.consumer]] == 2
    ]
    assert len(all_reduces) == len(weights)


def test_fsdp_shards_large_weights(cluster):
    """Large weights and many samples: batch-split products reading weights stored sharded
    (all-gathered forward, gradients reduce-scattered): FSDP / ZeRO-3."""
    case = sbp_cases.ChainCase(65536, (4096, 4096, 4096), "none", 8)
    problem, costs, sol = _solve(case.graph(), 8, cluster)
    products = _chosen(problem, sol, "dot_general")
    assert all(s.inputs == (S(0), B) for s in products)
    fwd, bwd = sbp.relayout_codes(problem)
    for e, u in enumerate(problem.uses):
        if problem.nodes[u.producer].trained:
            a, b = sol.choice[u.producer], sol.choice[u.consumer]
            assert problem.nodes[u.producer].signatures[a].split
            assert sbp.RELAYOUTS[fwd[e, a, b]] == "all_gather"
            assert sbp.RELAYOUTS[bwd[e, a, b]] == "reduce_scatter"


def test_megatron_layout_on_a_transformer_block(cluster):
    """A wide encoder block on one 8-GPU tensor-parallel group: the MLP's first product is
    column parallel, its second row parallel, and the MLP all-reduces once in the forward."""
    module = EncoderBlock(heads=32, mlp=16384)
    x = jax.ShapeDtypeStruct((1, 512, 4096), jnp.float32)
    params = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    g = diffcost.from_jax(lambda p, x: module.apply({"params": p}, x), params, x, argnums=(0,))
    problem, costs, sol = _solve(g, 8, cluster)
    shape_of = lambda t: g.tensors[t].shape  # noqa: E731
    dots = {
        shape_of(g.operators[n.op].inputs[1]): (i, n)
        for i, n in enumerate(problem.nodes)
        if n.op >= 0 and g.operators[n.op].primitive == "dot_general"
    }
    (i1, up), (i2, down) = dots[(4096, 16384)], dots[(16384, 4096)]
    assert up.signatures[sol.choice[i1]].inputs == (B, S(1))  # column parallel
    assert down.signatures[sol.choice[i2]].inputs == (S(2), S(0))  # row parallel
    assert down.signatures[sol.choice[i2]].outputs == (P,)
    fwd, _ = sbp.relayout_codes(problem)
    mlp = [
        fwd[e, sol.choice[u.producer], sol.choice[u.consumer]]
        for e, u in enumerate(problem.uses)
        if up.op < problem.nodes[u.consumer].op and problem.nodes[u.producer].op >= up.op
    ]
    assert sorted(k for k in mlp if k) == [sbp.RELAYOUTS.index("all_reduce")]
    cd = sbp_search.coordinate_descent(problem, costs)
    assert sol.cost_s <= cd.cost_s


def test_bad_settings_raise_clear_errors(cluster):
    with pytest.raises(ValueError, match="restarts"):
        sbp_search.GradientConfig(restarts=0)
    with pytest.raises(ValueError, match="mesh_size"):
        sbp.sbp_problem(sbp_cases.ChainCase(8, (16, 16), "none", 2).graph(), 0)
    case = sbp_cases.ChainCase(8, (16, 16), "none", 2)
    problem = sbp.sbp_problem(case.graph(), 2)
    costs = sbp.sbp_costs(problem, cluster, diffcost.default_params())
    with pytest.raises(ValueError, match="valid index"):
        sbp_search.assignment_cost_s(problem, costs, [99] * len(problem.nodes))
