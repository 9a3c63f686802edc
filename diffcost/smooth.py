"""Smooth surrogates for every non-smooth operation in the model.

Each surrogate takes a ``temperature`` that is *relative*: the softness scales with the size of
the inputs, so the same temperature works for microseconds and for minutes. Every surrogate
approaches its exact counterpart as ``temperature -> 0`` (tested in ``tests/test_smooth.py``)
and has finite gradients everywhere, including at ties and at zero.

References:
    jax-md ``safe_mask`` and optax's numerics for the double-``where`` pattern.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_TEMPERATURE = 1e-3


def _softness(temperature, scale, dtype):
    """(whether to take the smooth branch, the softness ``tau = temperature * scale``).

    Where ``tau`` is below the square root of the smallest normal float the exact value is
    taken (``tau`` then 1, unused): the gradient of ``x / tau`` through a ``scale`` made of the
    inputs divides by ``tau ** 2``, which underflows to 0 there, and ``0 * inf`` made it NaN
    (float32: a smooth minimum of 0 and 1.6e-17 s, a graph-path DP tail of a pure data-parallel
    run, 2026-11-28). Values change only where the smooth and the exact value differ by less
    than ``tau``: below 1e-19 in float32."""
    ok = temperature * scale > float(jnp.finfo(dtype).tiny) ** 0.5
    return ok, temperature * jnp.where(ok, scale, 1.0)


def _fallback_max(x, ok, axis):
    """The exact max along ``axis``, for the branch taken where ``ok`` (keepdims) is False.

    ``jnp.max``'s gradient divides by the number of entries equal to the max; where the compiler
    rounds the max and the comparison differently (seen on XLA CPU at -O0, vmapped) that count
    is 0, and the unused branch's 0/0 poisons the gradient through ``jnp.where``. The input is
    therefore zeroed where the smooth branch is taken (all ties: the count is the axis length)."""
    return jnp.max(jnp.where(ok, 0.0, x), axis=axis)


def smooth_max(x: jax.Array, axis: int = -1, temperature: float = DEFAULT_TEMPERATURE):
    """Smooth maximum of ``x`` along ``axis``: ``tau * logsumexp(x / tau)``.

    ``tau = temperature * mean|x|`` so the result is scale-equivariant. It is never below the
    exact maximum and exceeds it by at most ``tau * log(n)``; where every input is zero it is
    exactly zero (double ``where``, finite gradients).

    Args:
        x: values, any shape.
        axis: reduction axis.
        temperature: relative softness; 0 gives the exact maximum.

    Returns:
        ``x`` reduced along ``axis``.
    """
    x = jnp.asarray(x)
    if temperature == 0:
        return jnp.max(x, axis=axis)
    scale = jnp.mean(jnp.abs(x), axis=axis, keepdims=True)
    ok, tau = _softness(temperature, scale, x.dtype)
    m = jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    out = m + tau * jnp.log(jnp.sum(jnp.exp((x - m) / tau), axis=axis, keepdims=True))
    return jnp.where(
        jnp.squeeze(ok, axis=axis), jnp.squeeze(out, axis=axis), _fallback_max(x, ok, axis)
    )


def smooth_min(x: jax.Array, axis: int = -1, temperature: float = DEFAULT_TEMPERATURE):
    """Smooth minimum: ``-smooth_max(-x)``."""
    return -smooth_max(-jnp.asarray(x), axis=axis, temperature=temperature)


def smax2(a, b, temperature: float = DEFAULT_TEMPERATURE):
    """Elementwise smooth maximum of two broadcastable arrays.

    The same value as ``smooth_max`` over a stacked last axis of two, written element by
    element: a batched sweep fuses it into the surrounding arithmetic instead of building and
    reducing a trailing axis of size two.
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a), jnp.asarray(b))
    exact = jnp.maximum(a, b)
    if temperature == 0:
        return exact
    scale = (jnp.abs(a) + jnp.abs(b)) / 2.0
    ok, tau = _softness(temperature, scale, exact.dtype)
    m = jax.lax.stop_gradient(exact)
    out = m + tau * jnp.log(jnp.exp((a - m) / tau) + jnp.exp((b - m) / tau))
    return jnp.where(ok, out, exact)


def smin2(a, b, temperature: float = DEFAULT_TEMPERATURE):
    """Elementwise smooth minimum of two broadcastable arrays: ``-smax2(-a, -b)``."""
    return -smax2(-jnp.asarray(a), -jnp.asarray(b), temperature)


def smooth_relu(x, scale, temperature: float = DEFAULT_TEMPERATURE):
    """Softplus ``max(x, 0)`` with softness ``temperature * scale`` (``scale`` > 0, x's units)."""
    tau = temperature * scale
    if temperature == 0:
        return jnp.maximum(x, 0.0)
    return tau * jax.nn.softplus(x / tau)


def smooth_clip(x, lo, hi, temperature: float = DEFAULT_TEMPERATURE):
    """Smooth ``clip(x, lo, hi)`` built from ``smax2`` and ``smin2``."""
    return smin2(smax2(x, lo, temperature), hi, temperature)


def clip_exact(x, lo, hi):
    """Piecewise-linear ``clip``: continuous, exact, with finite (sub)gradients everywhere.

    For gates that must be exact at the integer points where discrete plans sit (a group of
    one rank has no traffic; one pipeline stage has no sends). It is not used on the critical
    path of a schedule, where ``smooth_max`` is.
    """
    return jnp.minimum(jnp.maximum(x, lo), hi)


def smooth_step(x, scale, temperature: float = DEFAULT_TEMPERATURE):
    """Sigmoid gate: ~0 for ``x << 0``, ~1 for ``x >> 0``; softness ``temperature * scale``."""
    if temperature == 0:
        return jnp.where(x > 0, 1.0, jnp.where(x < 0, 0.0, 0.5))
    return jax.nn.sigmoid(x / (temperature * scale))


def safe_div(num, den, eps: float = 1e-30):
    """``num / den`` with a finite value and gradient where ``den == 0`` (double ``where``)."""
    den = jnp.asarray(den)
    ok = jnp.abs(den) > eps
    safe_den = jnp.where(ok, den, 1.0)
    return jnp.where(ok, num / safe_den, 0.0)


def safe_log(x, eps: float = 1e-30):
    """``log(x)`` clamped below at ``log(eps)`` with a finite gradient at 0."""
    x = jnp.asarray(x)
    ok = x > eps
    return jnp.where(ok, jnp.log(jnp.where(ok, x, 1.0)), jnp.log(eps))


def smooth_ceil(x, temperature: float = DEFAULT_TEMPERATURE):
    """Smooth ``ceil``: the exact ceil at integers and away from them as temperature -> 0.

    Uses ``floor(x) + sigmoid((frac - sqrt(T)) / T)`` of the fractional part: an integer maps
    to itself up to ``sigmoid(-1/sqrt(T))`` and anything more than ``~sqrt(T)`` above it rounds
    up; the gradient is that of the sigmoid, finite everywhere.
    """
    x = jnp.asarray(x)
    if temperature == 0:
        return jnp.ceil(x)
    base = jax.lax.stop_gradient(jnp.floor(x))
    frac = x - base
    # frac in [0, 1): ceil adds 1 for any frac > 0.
    return base + jax.nn.sigmoid((frac - jnp.sqrt(temperature)) / temperature)


def softmax_mean(x: jax.Array, axis: int = -1, temperature: float = DEFAULT_TEMPERATURE):
    """Smooth maximum that is exact where the largest values tie: ``sum(softmax(x / tau) * x)``
    along ``axis`` with ``tau = temperature * max|x|`` (0: the exact maximum).

    Unlike ``smooth_max`` (``tau * log(n)`` above the maximum when ``n`` values tie) it equals
    the maximum when the top values are equal, as the flows of a symmetric collective are. It is
    never above the exact maximum and below it by at most ``tau / e`` per other value (``g *
    exp(-g / tau)`` for a value ``g`` below the maximum); where every input is zero it is zero.
    """
    x = jnp.asarray(x)
    if temperature == 0:
        return jnp.max(x, axis=axis)
    scale = jax.lax.stop_gradient(jnp.max(jnp.abs(x), axis=axis, keepdims=True))
    ok, tau = _softness(temperature, scale, x.dtype)
    out = jnp.sum(jax.nn.softmax(x / tau, axis=axis) * x, axis=axis)
    return jnp.where(jnp.squeeze(ok, axis=axis), out, _fallback_max(x, ok, axis))


def sum_of(xs):
    """The sum of a list of same-shape arrays, left to right (as a reduction over a stacked
    axis adds them)."""
    return sum(xs[1:], xs[0])


def _max_of(xs):
    out = xs[0]
    for x in xs[1:]:
        out = jnp.maximum(out, x)
    return out


def smooth_max_of(xs, temperature: float = DEFAULT_TEMPERATURE):
    """``smooth_max`` over a list of same-shape arrays, element by element: the same arithmetic
    as stacking ``xs`` on a last axis, without the stack (see ``smooth_min_of``)."""
    xs = [jnp.asarray(x) for x in xs]
    exact = _max_of(xs)
    if temperature == 0:
        return exact
    a = [jnp.abs(x) for x in xs]
    scale = sum_of(a) / len(xs)
    ok, tau = _softness(temperature, scale, exact.dtype)
    m = jax.lax.stop_gradient(exact)
    e = [jnp.exp((x - m) / tau) for x in xs]
    out = m + tau * jnp.log(sum_of(e))
    return jnp.where(ok, out, exact)


def softmax_mean_of(xs, temperature: float = DEFAULT_TEMPERATURE):
    """``softmax_mean`` over a list of same-shape arrays, element by element: the arithmetic
    of stacking ``xs`` on a last axis, without the stack (see ``smooth_min_of``).

    The inputs are multiplied by ``1 / tau``, not divided by ``tau``: XLA's simplifier merges
    a chain of divisions into one by the product of the divisors, and where an input is
    itself a quotient by a small number (a congestion over a nearly saturated link's
    remaining capacity) that product underflows in float32 and the compiled gradient is NaN.
    """
    xs = [jnp.asarray(x) for x in xs]
    exact = _max_of(xs)
    if temperature == 0:
        return exact
    scale = jax.lax.stop_gradient(_max_of([jnp.abs(x) for x in xs]))
    ok, tau = _softness(temperature, scale, exact.dtype)
    inverse = 1.0 / tau
    y = _softmax_of([x * inverse for x in xs])
    w = [yi * x for yi, x in zip(y, xs)]
    out = sum_of(w)
    return jnp.where(ok, out, exact)


@jax.custom_jvp
def _softmax_of(z):
    """``jax.nn.softmax`` over a list of same-shape arrays, element by element, with its
    derivative ``y * (dz - sum(y * dz))``."""
    top = _max_of(z)
    e = [jnp.exp(zi - top) for zi in z]
    total = sum_of(e)
    return [ei / total for ei in e]


@_softmax_of.defjvp
def _softmax_of_jvp(primals, tangents):
    (z,), (dz,) = primals, tangents
    y = _softmax_of(z)
    mean = [yi * di for yi, di in zip(y, dz)]
    mean = sum_of(mean)
    return y, [yi * (di - mean) for yi, di in zip(y, dz)]


def stored(tree):
    """``tree`` (a pytree of same-shape float arrays) unchanged, each leaf computed once.

    XLA fuses a chain of cheap elementwise operations into every consumer that reads it, so
    where many fusions read the end of a long chain (the rounds of an unrolled solver) the
    chain is recomputed in each. A reduction is not fused into its consumers: the leaves go
    through one, ``max(x, -inf)`` over a stacked axis, which returns every value as it is
    (``jax.lax.optimization_barrier`` would say the same, but XLA's CPU compiler drops it
    before fusing).
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    x = jnp.stack(leaves, axis=-1)
    x = jnp.max(jnp.stack([x, jnp.full_like(x, -jnp.inf)], axis=-1), axis=-1)
    return jax.tree_util.tree_unflatten(treedef, [x[..., i] for i in range(len(leaves))])


def softmin_weights(x: jax.Array, axis: int = -1, temperature: float = DEFAULT_TEMPERATURE):
    """Weights of the values near the minimum, summing to 1: ``softmax(-x / tau)`` along
    ``axis`` with ``smooth_max``'s ``tau = temperature * mean|x|`` (0, or all inputs zero:
    one-hot on the first minimum)."""
    x = jnp.asarray(x)
    hard = jax.nn.one_hot(jnp.argmin(x, axis=axis), x.shape[axis], dtype=x.dtype, axis=axis)
    if temperature == 0:
        return hard
    scale = jnp.mean(jnp.abs(x), axis=axis, keepdims=True)
    ok, tau = _softness(temperature, scale, x.dtype)
    return jnp.where(ok, jax.nn.softmax(-x / tau, axis=axis), hard)


def smooth_min_of(xs, temperature: float = DEFAULT_TEMPERATURE):
    """``smooth_min`` and ``softmin_weights`` over a list of same-shape arrays, element by
    element: ``(value, [weight per array])``, the weights summing to 1.

    The same arithmetic as stacking ``xs`` on a last axis and calling both, without the stack:
    a batched sweep fuses a few arrays into the surrounding arithmetic (as ``smax2``), where a
    small trailing axis makes it several times slower; and the value and the weights share
    their exponentials.
    """
    xs = [jnp.asarray(x) for x in xs]
    exact = xs[0]
    for x in xs[1:]:
        exact = jnp.minimum(exact, x)
    taken = jnp.zeros(exact.shape, dtype=bool)
    hard = []
    for x in xs:  # one-hot on the first minimum, as ``jnp.argmin``
        hit = (x == exact) & ~taken
        hard.append(hit.astype(exact.dtype))
        taken = taken | hit
    if temperature == 0:
        return exact, hard
    scale = sum(jnp.abs(-x) for x in xs) / len(xs)  # |-x|: smooth_min's subgradient at 0
    ok, tau = _softness(temperature, scale, exact.dtype)
    m = jax.lax.stop_gradient(exact)
    e = [jnp.exp((m - x) / tau) for x in xs]
    total = sum_of(e)
    # where the temperature vanishes (every value ~0), the exact minimum with its gradient
    # shared equally by the tied arrays, as ``jnp.min`` over a stacked axis shares it
    ties = [(x == exact).astype(exact.dtype) for x in xs]
    count = jnp.where(ok, 1.0, sum_of(ties))  # never 0/0 in the unused branch (_fallback_max)
    at_min = m + sum(t * (x - m) for t, x in zip(ties, xs)) / count
    value = jnp.where(ok, m - tau * jnp.log(total), at_min)
    return value, [jnp.where(ok, ei / total, h) for ei, h in zip(e, hard)]
