"""Relaxed descent: the Adam loop shared by calibration, plan search and partition search.

Every optimisation in diffcost is Adam on a smooth objective with a cosine-decayed learning
rate, usually from several starts at once, with some weight annealed over the steps (a
temperature, a penalty weight, a robust-loss blend). The pieces here are that loop, written
once:

* :func:`adam` builds the optimizer (optax's ``adam`` over ``cosine_decay_schedule``);
* :func:`make_step` turns ``loss_fn(x, *schedule_values) -> loss`` (or ``(loss, aux)``) into one
  pure Adam step, for a Python loop that reports progress and stops early (calibration);
* :func:`descend` runs ``steps`` of them under one ``jax.lax.scan``, the per-step values of the
  annealed quantities as the scanned inputs; ``jax.vmap`` over it gives multi-start descent
  (plan and partition search);
* :func:`geometric` and :func:`ramp` are the annealing paths used with it.

References:
    Kingma and Ba, "Adam: A Method for Stochastic Optimization" (2015); optax's ``adam`` and
    ``cosine_decay_schedule``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

# The learning rate decays to this fraction of its initial value over the steps.
FINAL_LR_FRACTION = 0.05


def adam(learning_rate: float, steps: int, b2: float = 0.999) -> optax.GradientTransformation:
    """Adam with a cosine-decayed learning rate over ``steps`` steps."""
    schedule = optax.cosine_decay_schedule(learning_rate, steps, alpha=FINAL_LR_FRACTION)
    return optax.adam(schedule, b2=b2)


def _finite(grads):
    """Non-finite gradient entries replaced by zero (a step never turns parameters into nan)."""
    return jax.tree_util.tree_map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grads)


def make_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    has_aux: bool = False,
    finite_only: bool = False,
):
    """One pure Adam step on ``loss_fn``.

    Args:
        loss_fn: ``loss_fn(x, *args)``: a scalar, or ``(scalar, aux)`` with ``has_aux``.
        optimizer: from :func:`adam` (or any optax transformation).
        has_aux: whether ``loss_fn`` returns auxiliary values.
        finite_only: replace non-finite gradient entries by zero before the update.

    Returns:
        ``step(x, state, *args) -> (x, state, loss, aux)`` (``aux`` None without ``has_aux``):
        the loss (and aux) at the ``x`` passed in, and the updated ``x`` and state.
    """
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def step(x, state, *args):
        value, grads = value_and_grad(x, *args)
        loss, aux = value if has_aux else (value, None)
        if finite_only:
            grads = _finite(grads)
        # optax mixes its integer step count with floats: standard promotion for it only
        with jax.numpy_dtype_promotion("standard"):
            updates, state = optimizer.update(grads, state, x)
        return optax.apply_updates(x, updates), state, loss, aux

    return step


def init(optimizer: optax.GradientTransformation, x):
    """The optimizer state for parameters ``x``."""
    with jax.numpy_dtype_promotion("standard"):
        return optimizer.init(x)


def descend(
    loss_fn: Callable,
    x0,
    optimizer: optax.GradientTransformation,
    schedule_values,
    finite_only: bool = False,
):
    """Adam steps on ``loss_fn`` under one ``jax.lax.scan``.

    Args:
        loss_fn: ``loss_fn(x, *values_of_this_step) -> scalar``.
        x0: the starting parameters (a pytree).
        optimizer: from :func:`adam`.
        schedule_values: a tuple of arrays with a leading axis of length ``steps``: the values
            of the annealed quantities at each step (the scan's inputs).
        finite_only: see :func:`make_step`.

    Returns:
        (final parameters, losses [steps], each at the parameters its step started from).
    """
    step = make_step(loss_fn, optimizer, finite_only=finite_only)

    def body(carry, values):
        x, state, loss, _ = step(*carry, *values)
        return (x, state), loss

    (x, _), losses = jax.lax.scan(body, (x0, init(optimizer, x0)), schedule_values)
    return x, losses


def geometric(start, end, steps: int, dtype=None) -> jax.Array:
    """``steps`` values from ``start`` to ``end`` at a constant ratio."""
    return start * (end / start) ** ramp(steps, dtype)


def ramp(steps: int, dtype=None) -> jax.Array:
    """``steps`` values from 0 to 1, evenly spaced."""
    return jnp.linspace(0.0, 1.0, steps, dtype=dtype)
