"""A data-parallel step of an operator graph, and CUDA-graph replay in the transformer core."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from helpers import CLUSTER, GPT, PLANS, arrays

from diffcost import default_params, zoo
from diffcost.arrays import cluster_arrays
from diffcost.opgraph import from_jax, graph_arrays, graph_time_s, sbp, step
from diffcost.opgraph.data_parallel import data_parallel_step_s
from diffcost.opgraph.models import load_graph_model
from diffcost.simulate import simulate


def _cnn():
    m = zoo.model("small_cnn", 16)
    g = graph_arrays(from_jax(m.fn, *m.args, argnums=m.argnums))
    n_params = sum(x.size for x in jax.tree.leaves(m.args[0]))
    return g, float(n_params)


def test_one_gpu_is_the_graph_plus_optimizer_and_host_steps():
    g, n = _cnn()
    c, p = cluster_arrays(CLUSTER), default_params()
    step = data_parallel_step_s(g, 1.0, n, 2.0 * n, c, p)
    fwd, bwd = graph_time_s(g, c, p)
    assert float(step.grad_sync_s) == 0.0
    expected = fwd + bwd + step.optimizer_s + p.microbatch_overhead_s + p.iteration_overhead_s
    np.testing.assert_allclose(step.iteration_s, expected, rtol=1e-6)


def test_the_all_reduce_hides_behind_the_backward_until_it_is_longer():
    g, n = _cnn()
    c, p = cluster_arrays(CLUSTER), default_params()
    small = data_parallel_step_s(g, 16.0, n, 2.0 * n, c, p)
    assert 0.0 < float(small.exposed_grad_sync_s) < float(small.grad_sync_s)
    # gradients a thousand times larger: the all-reduce outlasts the backward
    big = data_parallel_step_s(g, 16.0, n, 2e3 * n, c, p)
    assert float(big.grad_sync_s) > float(big.backward_s)
    exposed = big.grad_sync_s - big.backward_s
    assert float(big.exposed_grad_sync_s) >= float(exposed)
    grad = jax.grad(lambda q: data_parallel_step_s(g, 16.0, n, 2e3 * n, c, q).iteration_s)(p)
    assert float(grad.nic_eff_logit) < 0.0  # faster links, shorter step
    assert np.isfinite(float(grad.mem_eff_logit))


def test_both_entry_points_price_a_data_parallel_plan_alike():
    """``step.step_time`` of the SBP data-parallel assignment (weights replicated, batch split,
    only the weight gradients move) equals ``data_parallel_step_s`` given that assignment's
    forward and backward compute, its parameters and their gradient bytes: one overlap model,
    the gradients bucketed into one all-reduce in both. On 16 GPUs (two nodes) the all-reduce
    crosses the network, and a slower interconnect moves both alike."""
    m = load_graph_model("mlp", 512)
    p = default_params()
    for mesh, cluster in ((8, CLUSTER), (16, CLUSTER), (16, _slow(CLUSTER))):
        c = cluster_arrays(cluster)
        problem = sbp.sbp_problem(m.graph, mesh)
        parts = sbp.sbp_parts(problem, c, p)
        st = step.step_time(
            problem, parts, step.data_parallel_choice(problem, m.batch_inputs), c, p
        )
        assert float(st.relayout_s) == 0.0 and float(st.grad_sync_s) > 0.0
        weights = [n for n in problem.nodes if n.op < 0 and n.trained]
        n_params = sum(m.graph.tensors[n.tensor].size for n in weights)
        grad_bytes = sum(m.graph.tensors[n.tensor].bytes for n in weights)
        compute = jnp.stack([st.forward_s, st.backward_s])
        dp = data_parallel_step_s(compute, float(mesh), n_params, grad_bytes, c, p)
        for part in ("iteration_s", "grad_sync_s", "exposed_grad_sync_s", "optimizer_s"):
            np.testing.assert_allclose(getattr(dp, part), getattr(st, part), rtol=1e-12)


def _slow(cluster):
    return dataclasses.replace(cluster, nic_Gbps=cluster.nic_Gbps / 8.0)


def test_cuda_graphs_remove_the_host_time_per_op():
    plan = PLANS["dp8"]
    graphs = dataclasses.replace(plan, cuda_graphs=True)
    p = default_params()
    slow_host = p.replace(host_op_log_s=p.host_op_log_s + jnp.log(50.0))

    def time(plan, params):
        m, pl, c = arrays(GPT, plan)
        return float(simulate(m, pl, c, params, 1e-3).iteration_s)

    assert time(plan, slow_host) > 1.5 * time(plan, p)  # eager: host-bound
    np.testing.assert_allclose(time(graphs, slow_host), time(graphs, p), rtol=1e-12)
    assert time(graphs, p) <= time(plan, p)
