"""Network design by gradient: the bandwidth of each link class that a job's time is worth.

A design scales the capacity of every link of a class (``job.CLASSES``: NVLink, NIC,
leaf-spine, spine-core) by a multiplier ``s_c``. Links are priced linearly: class ``c`` costs
``spend_c * s_c`` dollars, ``spend_c`` being what its links cost as built (``Prices``). The
objective (``Objective``) is either

* ``time``: the iteration time under a budget for the priced links. The multipliers are
  ``s = exp(z + lambda)`` with ``lambda`` the closed form that spends the budget exactly,
  so every iterate is feasible (more bandwidth never slows an iteration, so the optimum
  spends it all); or
* ``cost_time``: price times performance, ``(fixed_usd + network cost) * iteration time``
  (the dollars of the cluster per iteration, amortised alike), over free ``z = log s``.

``optimize`` runs Adam (``diffcost.descent``: optax, cosine-decayed rate) on ``z`` through
``job.job_time_s`` (the seam: any graph-aware iteration time) and returns the best design it
evaluated, the start included, so the result is never worse than the start. ``marginals``
answers "which tier should the next dollar buy?": per class, the iteration time saved per
dollar spent on it, ``-(dT / d ln s_c) / (spend_c s_c)``. At a budget optimum the classes
being bought save the same per dollar (the budget's Lagrange multiplier); under ``cost_time``
each saves ``T / C`` per dollar.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import descent, smooth
from diffcost.network import job as netjob
from diffcost.network.graph import Topology

OBJECTIVES = ("time", "cost_time")
BUDGET_RTOL = 1e-5  # a design within this of the budget keeps it (float32 rounding)


@dataclasses.dataclass(frozen=True)
class Prices:
    """Link prices per class: ``usd_per_Bps [links]`` what one B/s of each directed link's
    capacity costs (a cable is two directed links, each paying half its price)."""

    usd_per_Bps: np.ndarray

    @classmethod
    def per_class(cls, topology: Topology, usd_per_GBps=None, usd_per_link=None) -> Prices:
        """Prices from ``{class: usd per GB/s of a cable's bandwidth one way}`` and
        ``{class: usd per physical cable as built}`` (a class in at most one of them;
        classes in neither cost nothing)."""
        usd_per_GBps, usd_per_link = usd_per_GBps or {}, usd_per_link or {}
        classes = netjob.link_classes(topology)
        price = np.zeros(topology.n_links)
        for name, usd in usd_per_GBps.items():
            price[classes == netjob.CLASSES.index(name)] = 0.5 * usd * 1e-9
        for name, usd in usd_per_link.items():
            on = classes == netjob.CLASSES.index(name)
            price[on] = 0.5 * usd / topology.bandwidth_Bps[on]
        return cls(price)

    def class_spend(self, topology: Topology) -> np.ndarray:
        """``[CLASSES]`` dollars each class's links cost as built."""
        spend = self.usd_per_Bps * topology.capacity_Bps
        classes = netjob.link_classes(topology)
        return np.bincount(classes, weights=spend, minlength=len(netjob.CLASSES))


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a design minimizes.

    Attributes:
        kind: ``"time"`` (iteration time, network cost at most ``budget_usd``) or
            ``"cost_time"`` (``(fixed_usd + network cost) * iteration time``).
        budget_usd: the budget of the priced links (``time``).
        fixed_usd: what the rest of the cluster costs (``cost_time``).
        optimize: ``[CLASSES]`` 1.0 for the classes whose bandwidth moves.
    """

    kind: str
    optimize: tuple
    budget_usd: float = 0.0
    fixed_usd: float = 0.0


@dataclasses.dataclass(frozen=True)
class Design:
    """One design: ``scale [CLASSES]``, its iteration time, network cost and objective."""

    scale: np.ndarray
    time_s: float
    cost_usd: float
    objective: float


def scales(z, spend, objective: Objective):
    """``[CLASSES]`` multipliers from the free variables ``z`` (one per class): ``exp(z)``
    on the optimized classes, 1 elsewhere; under ``time`` rescaled to spend the budget."""
    mask = jnp.asarray(objective.optimize)
    s = jnp.exp(z * mask)
    if objective.kind == "time":
        fixed = jnp.sum(spend * (1.0 - mask))
        moved = jnp.sum(spend * mask * s)
        s = jnp.where(mask > 0, s * (objective.budget_usd - fixed) / moved, 1.0)
    return s


def objective_value(time_s, cost_usd, objective: Objective):
    """The objective of a design (seconds, or dollar-seconds for ``cost_time``)."""
    if objective.kind == "time":
        return time_s
    return (objective.fixed_usd + cost_usd) * time_s


def evaluate(scale, job, params, spend, objective, time_fn, temperature) -> Design:
    """The ``Design`` at ``scale``; its objective is inf where it breaks the budget."""
    scale = np.asarray(scale, dtype=float)
    t = float(_time_and_grad(jnp.log(scale), job, params, time_fn, temperature)[0])
    c = float(np.dot(spend, scale))
    value = float(objective_value(t, c, objective))
    if objective.kind == "time" and c > objective.budget_usd * (1.0 + BUDGET_RTOL):
        value = float("inf")
    return Design(scale, t, c, value)


def marginals(scale, job, params, spend, time_fn=None, temperature=None):
    """Per class: elasticity ``d ln T / d ln s_c`` and seconds saved per dollar.

    Returns:
        ``{"time_s", "elasticity": [CLASSES], "s_saved_per_usd": [CLASSES]}`` (numpy); the last is
        ``-(dT / d ln s_c) / (spend_c * s_c)``, nan for a class that costs nothing.
    """
    tau = smooth.DEFAULT_TEMPERATURE if temperature is None else temperature
    log_s = jnp.log(jnp.asarray(scale, dtype=float))
    t, grad = _time_and_grad(log_s, job, params, time_fn, tau)
    grad = np.asarray(grad)
    cost = np.asarray(spend) * np.asarray(scale)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_usd = np.where(cost > 0, -grad / np.where(cost > 0, cost, 1.0), np.nan)
    return {"time_s": float(t), "elasticity": grad / float(t), "s_saved_per_usd": per_usd}


@functools.partial(jax.jit, static_argnames=("time_fn", "temperature"))
def _time_and_grad(log_s, job, params, time_fn, temperature):
    """Iteration time at multipliers ``exp(log_s)`` and its gradient with respect to
    ``log_s``, compiled once per job structure."""

    def time_s(u):
        return netjob.job_time_s(jnp.exp(u), job, params, temperature, time_fn)

    return jax.value_and_grad(time_s)(log_s)


def _loss_fn(job, params, spend, objective, time_fn, temperature):
    """``z -> log objective`` (differentiable)."""

    def loss(z):
        s = scales(z, spend, objective)
        t = netjob.job_time_s(s, job, params, temperature, time_fn)
        if objective.kind == "time":
            return jnp.log(t)
        return jnp.log(objective.fixed_usd + jnp.dot(spend, s)) + jnp.log(t)

    return loss


def optimize(
    job,
    params,
    spend,
    objective: Objective,
    steps: int = 200,
    learning_rate: float = 0.05,
    time_fn=None,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
) -> tuple[Design, Design, list[float]]:
    """Adam (``descent.adam``) on the log multipliers from the built network (``z = 0``).

    Args:
        job: ``job.make_job(...)``.
        params: calibrated constants.
        spend: ``[CLASSES]`` ``Prices.class_spend`` of the topology.
        objective: what to minimize.
        steps, learning_rate: the descent.
        time_fn: the job-time seam (a ``job.JobTimeFn``; None: ``job.default_time_fn()``).
        temperature: softness of the model.

    Returns:
        (start, best, history): the built network (all multipliers 1), the best design
        evaluated (never worse than the start), and the objective after each step.
    """
    spend = jnp.asarray(spend, dtype=float)
    args = (job, params, np.asarray(spend), objective, time_fn, temperature)
    start = evaluate(np.ones(len(netjob.CLASSES)), *args)
    loss = _loss_fn(job, params, spend, objective, time_fn, temperature)
    opt = descent.adam(learning_rate, steps)
    step = jax.jit(descent.make_step(loss, opt, finite_only=True))
    z = jnp.zeros(len(netjob.CLASSES), dtype=spend.dtype)
    state = descent.init(opt, z)
    best_z, best_value, history = None, np.inf, []
    for _ in range(steps + 1):
        z_new, new_state, value, _ = step(z, state)
        value = float(value)
        history.append(value)
        if np.isfinite(value) and value < best_value:
            best_z, best_value = z, value
        z, state = z_new, new_state
    best = start
    if best_z is not None:
        candidate = evaluate(np.asarray(scales(best_z, spend, objective)), *args)
        if candidate.objective < start.objective:
            best = candidate
    return start, best, history
