"""LayerWork, the collective registry and the named parts of stage_times."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CLUSTER, GPT, LLAMA, MOE, PLANS, arrays

from diffcost import comm, default_params, kernels, stages, workload
from diffcost.simulate import memory, simulate, stage_times

REL = 1e-12  # float64 agreement of two computations of the same quantity
TEMPERATURE = 1e-3
CASES = [(GPT, "tp4pp2"), (GPT, "fsdp"), (LLAMA, "cp2"), (MOE, "dp8")]
IDS = [f"{m.name}-{p}" for m, p in CASES]


def _arrays(model, plan_name):
    plan = PLANS[plan_name]
    if model is MOE:
        plan = dataclasses.replace(plan, ep=8)
    return arrays(model, plan)


@pytest.mark.parametrize("model,plan_name", CASES, ids=IDS)
def test_layer_work_matches_the_per_quantity_functions(model, plan_name):
    m, p, _ = _arrays(model, plan_name)
    work = workload.layer_work(m, p)
    t = float(p.microbatch * m.seq_len / p.cp)
    assert float(work.tokens) == pytest.approx(t, rel=REL)
    sp = float(p.sp)
    assert float(work.sp_tokens) == pytest.approx(t * (1 - sp) + t / float(p.tp) * sp, rel=REL)
    assert float(work.forward_flops) == pytest.approx(
        float(workload.layer_forward_flops(m, p)), rel=REL
    )
    np.testing.assert_allclose(work.activation_bytes, workload.layer_activation_bytes(m, p))
    dense, experts = workload.layer_params_local(m, p)
    assert float(work.dense_params) == float(dense)
    assert float(work.expert_params) == float(experts)
    assert float(work.p2p_msg_bytes) == pytest.approx(float(work.sp_tokens * m.hidden * 2), rel=REL)


@pytest.mark.parametrize("model,plan_name", CASES, ids=IDS)
def test_given_work_is_what_time_and_memory_compute_themselves(model, plan_name):
    m, p, c = _arrays(model, plan_name)
    params = default_params(jnp.float64)
    work = workload.layer_work(m, p)
    for a, b in zip(
        jax.tree_util.tree_leaves(stage_times(m, p, c, params, TEMPERATURE)),
        jax.tree_util.tree_leaves(stage_times(m, p, c, params, TEMPERATURE, None, work)),
    ):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(memory(m, p, c, TEMPERATURE), memory(m, p, c, TEMPERATURE, work)):
        np.testing.assert_array_equal(a, b)


def test_layer_work_is_one_pytree_under_vmap():
    plans = [arrays(GPT, PLANS[name])[1] for name in ("single", "tp4pp2", "cp2")]
    m = arrays(GPT)[0]
    batched = jax.vmap(workload.layer_work, in_axes=(None, 0))(
        m, jax.tree_util.tree_map(lambda *x: jnp.stack(x), *plans)
    )
    for i, p in enumerate(plans):
        one = workload.layer_work(m, p)
        for a, b in zip(jax.tree_util.tree_leaves(batched), jax.tree_util.tree_leaves(one)):
            np.testing.assert_allclose(a[i], b, rtol=REL)


@pytest.fixture
def env():
    from diffcost.arrays import cluster_arrays

    return cluster_arrays(CLUSTER, jnp.float64), default_params(jnp.float64)


@pytest.mark.parametrize("name", sorted(comm.COLLECTIVES))
@pytest.mark.parametrize("degree,stride", [(1.0, 1.0), (4.0, 1.0), (8.0, 4.0), (16.0, 1.0)])
def test_every_collective_is_finite_differentiable_and_zero_on_one_rank(env, name, degree, stride):
    c, params = env

    def cost(msg, n):
        group = comm.place(n, stride, c.gpus_per_node)
        return comm.collective_s(name, msg, group, c, params, TEMPERATURE)

    value = float(cost(1e7, degree))
    assert np.isfinite(value) and value >= 0.0
    assert (value == 0.0) == (degree == 1.0)
    grads = jax.grad(cost, argnums=(0, 1))(1e7, degree)
    assert all(np.isfinite(float(g)) for g in grads)
    # more bytes never take less time
    assert float(cost(2e7, degree)) >= value


@pytest.mark.parametrize("name", sorted(comm.COLLECTIVES))
def test_every_algorithm_of_a_collective_is_registered_and_the_choice_is_a_soft_minimum(env, name):
    c, params = env
    spec = comm.COLLECTIVES[name]
    assert spec.algorithms and all(a in comm.ALGORITHMS for a in spec.algorithms)
    group = comm.place(16.0, 1.0, c.gpus_per_node)
    links = comm.group_links(group, c, params, TEMPERATURE)
    msg = 1e8
    steps = [spec.traffic * float(comm.ALGORITHMS[a](msg, links, params)) for a in spec.algorithms]
    exact = comm.collective_links_s(name, msg, links, params, 0.0)
    reduce = spec.reduces * spec.traffic / 2.0 * msg / float(params.reduce_Bps)
    overhead = float(params.collective_overhead_s) * msg / (msg + 1.0)
    assert float(exact) == pytest.approx(15.0 * min(steps) + reduce + overhead, rel=REL)
    soft = float(comm.collective_links_s(name, msg, links, params, TEMPERATURE))
    assert soft <= float(exact) * (1.0 + 1e-12)


def test_collectives_on_shared_links_equal_the_one_call_functions(env):
    c, params = env
    group = comm.place(16.0, 2.0, c.gpus_per_node)
    links = comm.group_links(group, c, params, TEMPERATURE)
    requests = [(name, 3e6, links) for name in comm.COLLECTIVES]
    for (name, msg, _), got in zip(requests, comm.collectives_s(requests, params, TEMPERATURE)):
        want = comm.collective_s(name, msg, group, c, params, TEMPERATURE)
        assert float(got) == pytest.approx(float(want), rel=REL)
    assert float(comm.all_to_all_links_s(3e6, links, params)) == pytest.approx(
        float(comm.all_to_all_s(3e6, group, c, params, TEMPERATURE)), rel=REL
    )


def test_without_tensor_parallelism_the_layer_has_no_tp_time():
    m, p, c = arrays(GPT, PLANS["dp8"])
    params = default_params(jnp.float64)
    work = workload.layer_work(m, p)
    groups = stages.place_groups(p, c, params, TEMPERATURE)
    comms = stages.comm_times(work, m, p, groups, c, params, TEMPERATURE)
    kernel = kernels.kernel_times(work, m, c, params, TEMPERATURE)
    parts = stages.layer_parts_s(work, kernel, comms, m, p, c, params, TEMPERATURE)
    assert parts.shape == (2, 5)
    np.testing.assert_array_equal(parts[:, 1:4], 0.0)  # tp, cp and ep
    assert float(stages.tp_comm_s(kernel.layer_s, comms, p, 0.5, TEMPERATURE)[0]) == 0.0


def test_stage_parts_sum_to_the_stage_times():
    m, p, c = arrays(GPT, PLANS["tp4pp2"])
    params = default_params(jnp.float64)
    st = stage_times(m, p, c, params, TEMPERATURE)
    host = float(params.microbatch_overhead_s)
    total = np.asarray(st.fwd_s + st.bwd_s) - host
    np.testing.assert_allclose(np.sum(np.asarray(st.parts), axis=1), total, rtol=1e-9)
    assert float(simulate(m, p, c, params, TEMPERATURE).optimizer_s) == float(st.optimizer_s)
