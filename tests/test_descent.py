"""The shared relaxed-descent loop: Adam under lax.scan, multi-start, annealed inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffcost import descent


def _quadratic(x, weight):
    return weight * jnp.sum((x - 3.0) ** 2)


def test_descend_reaches_the_minimum_from_every_start():
    steps = 300
    weights = descent.geometric(1.0, 4.0, steps)
    starts = jnp.array([[-5.0, 0.0], [10.0, 2.0], [3.0, 3.0]])
    opt = descent.adam(0.3, steps)
    x, losses = jax.vmap(lambda x0: descent.descend(_quadratic, x0, opt, (weights,)))(starts)
    np.testing.assert_allclose(x, 3.0, atol=1e-2)
    assert losses.shape == (3, steps)
    assert np.all(losses[:, -1] <= losses[:, 0])


def test_make_step_with_aux_matches_a_manual_adam_step():
    def loss(x, scale):
        return scale * jnp.sum(x**2), {"norm": jnp.linalg.norm(x)}

    opt = descent.adam(0.1, 10)
    x0 = jnp.array([1.0, -2.0])
    x1, _, value, aux = descent.make_step(loss, opt, has_aux=True)(x0, descent.init(opt, x0), 2.0)
    assert float(value) == pytest.approx(10.0) and float(aux["norm"]) == pytest.approx(5**0.5)
    # Adam's first step moves every coordinate by the learning rate against its gradient's sign
    np.testing.assert_allclose(x1, x0 - 0.1 * jnp.sign(x0), rtol=1e-5)


def test_non_finite_gradients_are_dropped_when_asked():
    def loss(x):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0)) + jnp.sum(x**2)

    opt = descent.adam(0.1, 5)
    x0 = jnp.array([0.0, 1.0])  # sqrt'(0) is inf
    step = descent.make_step(loss, opt, finite_only=True)
    x1 = step(x0, descent.init(opt, x0))[0]
    assert np.all(np.isfinite(x1)) and float(x1[0]) == 0.0


def test_annealing_paths_start_and_end_where_asked():
    g = descent.geometric(0.5, 8.0, 5)
    assert float(g[0]) == pytest.approx(0.5) and float(g[-1]) == pytest.approx(8.0)
    np.testing.assert_allclose(g[1:] / g[:-1], 2.0, rtol=1e-6)
    np.testing.assert_allclose(descent.ramp(3), [0.0, 0.5, 1.0])
