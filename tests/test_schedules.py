"""Every registered pipeline schedule through the same checks (a conformance suite)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost import schedules
from diffcost.specs import SCHEDULES

NAMES = tuple(schedules.REGISTRY)


def _pipe(p=4.0, m=8.0, v=2.0, fwd=(1.0, 1.2, 1.5), bwd=(2.0, 2.4, 3.0)):
    fwd, bwd = jnp.array(fwd), jnp.array(bwd)
    w = fwd + bwd
    return schedules.Pipeline(
        p=jnp.asarray(p), m=jnp.asarray(m), v=jnp.asarray(v), multi=jnp.asarray(1.0),
        middle=jnp.asarray(1.0), fwd_s=fwd, bwd_s=bwd, w_s=w,
        sum_w_s=w[0] + w[2] + (p - 2.0) * w[1], w_max_s=jnp.max(w), send_s=jnp.asarray(0.1),
    )  # fmt: skip


def test_registry_follows_the_plan_vocabulary():
    assert NAMES == SCHEDULES


@pytest.mark.parametrize("name", NAMES)
def test_makespan_is_finite_differentiable_and_at_least_the_bottleneck(name):
    sched = schedules.REGISTRY[name]
    pipe = _pipe()
    makespan = float(sched.makespan_fn(pipe, 1e-3))
    # every microbatch passes the bottleneck stage: m W_max of its work at least (1/v each chunk)
    assert np.isfinite(makespan) and makespan >= float(pipe.m * pipe.w_max_s) * (1 - 1e-3)
    grad = jax.grad(lambda f: sched.makespan_fn(_pipe(fwd=f), 1e-3))(jnp.array([1.0, 1.2, 1.5]))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad) >= 0)
    assert np.isfinite(float(sched.sends_fn(pipe))) and float(sched.sends_fn(pipe)) >= 0


@pytest.mark.parametrize("name", NAMES)
def test_in_flight_microbatches_are_between_one_and_m(name):
    first, last = schedules.REGISTRY[name].in_flight_fn(4.0, 8.0, 2.0, 1e-6)
    assert 1.0 - 1e-6 <= float(last) <= float(first) + 1e-6 <= 8.0 + 1e-3


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 4), (4, 4), (4, 8)])
def test_order_runs_every_task_once_and_backwards_after_forwards(name, p, m):
    sched = schedules.REGISTRY[name]
    v = 2 if sched.interleaved else 1
    for s in range(p):
        order = sched.order_fn(s, p, m, v)
        want = {(k, i, c) for k, i, c in itertools.product("FB", range(m), range(v))}
        assert sorted(order) == sorted(want)
        position = {task: n for n, task in enumerate(order)}
        assert all(position[("F", i, c)] < position[("B", i, c)] for _, i, c in want)
