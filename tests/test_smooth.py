"""Every surrogate approaches its exact counterpart as temperature -> 0 and has finite grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from diffcost import smooth

TEMPERATURES = (1e-1, 1e-2, 1e-3, 1e-4)
GRAD_TOL = 1e-5

# no subnormals: XLA on the CPU flushes them to zero in some operations and not in others, so
# two formulas of one value can differ there by the whole (subnormal) value
values = st.lists(
    st.floats(0.0, 1e3, allow_nan=False, allow_subnormal=False), min_size=1, max_size=8
)


@given(values)
@settings(max_examples=50, deadline=None)
def test_smooth_max_bounds_and_converges(xs):
    x = jnp.asarray(xs)
    exact = float(jnp.max(x))
    errors = []
    for t in TEMPERATURES:
        s = float(smooth.smooth_max(x, temperature=t))
        bound = t * float(jnp.mean(jnp.abs(x))) * np.log(len(xs)) + 1e-9
        assert exact - 1e-9 <= s <= exact + bound + 1e-9
        errors.append(s - exact)
    assert errors == sorted(errors, reverse=True)
    assert float(smooth.smooth_max(x, temperature=0)) == exact


@given(values)
@settings(max_examples=50, deadline=None)
def test_smooth_min_converges(xs):
    x = jnp.asarray(xs)
    exact = float(jnp.min(x))
    errs = [abs(float(smooth.smooth_min(x, temperature=t)) - exact) for t in TEMPERATURES]
    bound = TEMPERATURES[-1] * float(jnp.mean(jnp.abs(x))) * np.log(len(xs)) + 1e-9
    assert errs[-1] <= bound
    assert errs == sorted(errs, reverse=True)


def test_smooth_max_is_scale_equivariant():
    x = jnp.array([1.0, 2.0, 2.0, 0.5])
    for scale in (1e-6, 1.0, 1e6):
        assert float(smooth.smooth_max(scale * x)) == pytest.approx(
            scale * float(smooth.smooth_max(x)), rel=1e-12
        )


@pytest.mark.parametrize(
    "x", [jnp.array([1.0, 1.0]), jnp.array([0.0, 0.0]), jnp.array([3.0, 1e-9])]
)
def test_smooth_max_grads_finite_at_ties_and_zero(x):
    g = jax.grad(lambda v: smooth.smooth_max(v))(x)
    assert np.all(np.isfinite(g))
    # homogeneous of degree one: Euler's identity x . grad = f
    assert float(jnp.dot(x, g)) == pytest.approx(float(smooth.smooth_max(x)), abs=1e-9)


def test_grads_finite_where_the_softness_squared_underflows():
    """float32: a smooth minimum of 0 and 1.6e-17 s (a graph-path DP tail) has a softness of
    8e-21, whose square, in the gradient through the inputs' scale, underflows to 0; the exact
    value is taken there and every surrogate's gradient stays finite."""
    pair = jnp.array([0.0, 1.5701862e-17], jnp.float32)
    fns = (
        lambda x: smooth.smin2(x[0], x[1], 1e-3),
        lambda x: smooth.smax2(-x[0], -x[1], 1e-3),
        lambda x: smooth.smooth_max(-x, temperature=1e-3),
        lambda x: smooth.smooth_max_of([-x[0], -x[1]], 1e-3),
        lambda x: smooth.smooth_min_of([x[0], x[1]], 1e-3)[0],
    )
    for fn in fns:
        assert np.all(np.isfinite(np.asarray(jax.grad(fn)(pair))))
    assert float(smooth.smin2(pair[0], pair[1], 1e-3)) == 0.0


def test_check_grads_of_surrogates():
    x = jnp.array([0.3, 0.7, 0.5])
    check_grads(
        lambda v: smooth.smooth_max(v), (x,), order=2, modes=["rev"], atol=GRAD_TOL, rtol=GRAD_TOL
    )
    check_grads(
        lambda v: smooth.smooth_min(v), (x,), order=2, modes=["rev"], atol=GRAD_TOL, rtol=GRAD_TOL
    )
    check_grads(lambda a: smooth.smax2(a, 0.6), (jnp.array(0.55),), order=1, modes=["rev"])
    check_grads(
        lambda a: smooth.smooth_relu(a, 1.0, 0.1), (jnp.array(0.05),), order=1, modes=["rev"]
    )
    check_grads(lambda a: smooth.smooth_ceil(a, 0.1), (jnp.array(2.25),), order=1, modes=["rev"])


@pytest.mark.parametrize("x", [-2.0, -0.01, 0.0, 0.01, 2.0])
def test_relu_step_converge(x):
    exact_relu = max(x, 0.0)
    exact_step = 1.0 if x > 0 else (0.0 if x < 0 else 0.5)
    for t in (1e-3, 1e-5):
        assert float(smooth.smooth_relu(x, 1.0, t)) == pytest.approx(exact_relu, abs=10 * t)
    assert float(smooth.smooth_step(x, 1.0, 1e-5)) == pytest.approx(exact_step, abs=1e-3)
    assert float(smooth.smooth_relu(x, 1.0, 0)) == exact_relu


@pytest.mark.parametrize("x", [0.0, 0.3, 1.0, 1.5, 2.0, 2.999, 3.0])
def test_smooth_ceil_converges(x):
    exact = float(np.ceil(x))
    assert float(smooth.smooth_ceil(x, 1e-4)) == pytest.approx(exact, abs=1e-3)
    if x != int(x) and x - int(x) > 0.01:
        assert float(smooth.smooth_ceil(x, 1e-4)) == pytest.approx(exact, abs=1e-9)
    assert float(smooth.smooth_ceil(x, 0)) == exact


def test_safe_div_and_log_are_finite_at_zero():
    assert float(smooth.safe_div(1.0, 0.0)) == 0.0
    g = jax.grad(lambda d: smooth.safe_div(2.0, d))(0.0)
    assert np.isfinite(g)
    g = jax.grad(smooth.safe_log)(0.0)
    assert np.isfinite(g)


def test_clip_exact_is_exact_and_differentiable():
    assert float(smooth.clip_exact(8.0, 1.0, 1.0)) == 1.0
    assert float(smooth.clip_exact(0.5, 1.0, 4.0)) == 1.0
    g = jax.grad(lambda hi: smooth.clip_exact(8.0, 1.0, hi))(1.0)
    assert float(g) == 1.0


@given(values)
@settings(max_examples=50, deadline=None)
def test_softmax_mean_bounds_converges_and_is_exact_at_ties(xs):
    x = jnp.asarray(xs)
    exact = float(jnp.max(x))
    for t in TEMPERATURES:
        s = float(smooth.softmax_mean(x, temperature=t))
        bound = t * float(jnp.max(jnp.abs(x))) / np.e * (len(xs) - 1) + 1e-9
        assert exact - bound <= s <= exact + 1e-9
    tied = jnp.full((5,), exact)
    assert float(smooth.softmax_mean(tied, temperature=1e-2)) == pytest.approx(exact, rel=1e-12)
    assert float(smooth.softmax_mean(x, temperature=0)) == exact
    grad = jax.grad(lambda v: smooth.softmax_mean(v, temperature=1e-3))(jnp.zeros(4))
    assert np.all(np.isfinite(grad))


@given(values, st.sampled_from((0.0, *TEMPERATURES)))
@settings(max_examples=50, deadline=None)
def test_smooth_min_of_equals_the_stacked_surrogates(xs, t):
    """The list form gives ``smooth_min`` and ``softmin_weights`` of the stacked values, and
    the same gradients."""
    x = jnp.asarray(xs)
    value, weights = smooth.smooth_min_of(list(x), temperature=t)
    np.testing.assert_allclose(value, smooth.smooth_min(x, temperature=t), rtol=1e-12)
    np.testing.assert_allclose(
        jnp.stack(weights), smooth.softmin_weights(x, temperature=t), rtol=1e-9, atol=1e-15
    )
    if t > 0:
        stacked = jax.grad(lambda v: smooth.smooth_min(v, temperature=t))(x)
        listed = jax.grad(lambda v: smooth.smooth_min_of(list(v), temperature=t)[0])(x)
        np.testing.assert_allclose(listed, stacked, rtol=1e-9, atol=1e-15)


@given(values, st.sampled_from((0.0, *TEMPERATURES)))
@settings(max_examples=50, deadline=None)
def test_softmax_mean_of_and_smooth_max_of_equal_the_stacked_surrogates(xs, t):
    """The list forms give ``softmax_mean`` and ``smooth_max`` of the stacked values, and the
    same gradients (finite at ties and at zero)."""
    x = jnp.asarray(xs)
    pairs = (
        (smooth.softmax_mean_of, smooth.softmax_mean),
        (smooth.smooth_max_of, smooth.smooth_max),
    )
    for listed_fn, stacked_fn in pairs:
        value = listed_fn(list(x), temperature=t)
        np.testing.assert_allclose(value, stacked_fn(x, temperature=t), rtol=1e-12)
        if t > 0:
            stacked = jax.grad(lambda v, f=stacked_fn: f(v, temperature=t))(x)
            listed = jax.grad(lambda v, f=listed_fn: f(list(v), temperature=t))(x)
            np.testing.assert_allclose(listed, stacked, rtol=1e-9, atol=1e-12)
    for v in (jnp.zeros(4), jnp.ones(4)):
        grad = jax.grad(lambda v: smooth.softmax_mean_of(list(v), temperature=1e-3))(v)
        assert np.all(np.isfinite(grad))
