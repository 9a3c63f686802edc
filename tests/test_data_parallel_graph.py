"""A data-parallel step of an operator graph, and CUDA-graph replay in the transformer core."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from helpers import CLUSTER, GPT, PLANS, arrays

from diffcost import default_params, zoo
from diffcost.arrays import cluster_arrays
from diffcost.opgraph import from_jax, graph_arrays, graph_time_s
from diffcost.opgraph.data_parallel import data_parallel_step_s
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
    assert float(step.all_reduce_s) == 0.0
    expected = fwd + bwd + step.optimizer_s + p.microbatch_overhead_s + p.iteration_overhead_s
    np.testing.assert_allclose(step.iteration_s, expected, rtol=1e-6)


def test_the_all_reduce_hides_behind_the_backward_until_it_is_longer():
    g, n = _cnn()
    c, p = cluster_arrays(CLUSTER), default_params()
    small = data_parallel_step_s(g, 16.0, n, 2.0 * n, c, p)
    assert 0.0 < float(small.exposed_all_reduce_s) < float(small.all_reduce_s)
    # gradients a thousand times larger: the all-reduce outlasts the backward
    big = data_parallel_step_s(g, 16.0, n, 2e3 * n, c, p)
    assert float(big.all_reduce_s) > float(big.backward_s)
    exposed = big.all_reduce_s - big.backward_s
    assert float(big.exposed_all_reduce_s) >= float(exposed)
    grad = jax.grad(lambda q: data_parallel_step_s(g, 16.0, n, 2e3 * n, c, q).iteration_s)(p)
    assert float(grad.nic_eff_logit) < 0.0  # faster links, shorter step
    assert np.isfinite(float(grad.mem_eff_logit))


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
