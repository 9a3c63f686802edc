"""A cluster without a calibrated profile of its own: the predictive median over the population
of fitted clusters.

Such a cluster takes the population's constants (``diffcost.profiles.population_path``). Its
iteration time is convex in them (``1 / efficiency``, smooth maxima of compute against exposed
communication, of host against GPU time), so the time at the mean constants, ``t(E[theta])``,
is faster than the population's median ``exp(E[log t(theta)])``. When the population file
lists its members (``profiles.population_members``), a prediction runs once with each
member's constants and ``median_breakdown`` combines them: the mean of the log times, the time
parts and throughputs rescaled to it. The sensitivity of that median to the constants (a shift
applied to every member alike) is the mean of the members' ``d log T / d raw``
(``median_jacobian``), which the 80% interval propagates. The same rules decide held-out
clusters in ``benchmarks/transfer.py`` (``calibration.heldout.population_mixture``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import profiles, smooth
from diffcost.params import Params
from diffcost.simulate import simulate
from diffcost.uncertainty import member_log_time_jacobians

# Per-iteration rates: value x iteration time is the same for every member (tokens, FLOPs).
RATES = ("tokens_per_s", "mfu")


def median_note(n_members: int) -> str:
    """What a prediction's note says when its time is the median over ``n_members``."""
    return f"time: the median over the population's {n_members} members"


def stack_members(members: list[Params]) -> Params:
    """The members' Params with a leading member axis."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *members)


def constants_for(
    cluster, profile=None, dtype=None, stack: str | None = None
) -> tuple[Params, Params | None, str]:
    """(Params, members, note) of a command that prices ``cluster`` (with ``stack``'s offsets):
    ``profiles.params_for``'s constants and note, and for a cluster that takes the population's
    median its members with a leading axis (``stack_members``; None otherwise), the note saying
    so (``median_note``)."""
    params, note = profiles.params_for(cluster, profile, dtype, stack=stack)
    members = profiles.population_members(cluster, profile, dtype, stack=stack)
    if not members:
        return params, None, note
    return params, stack_members(members), f"{note}; {median_note(len(members))}"


def tangent_weights(times) -> np.ndarray:
    """Weights ``w [M]`` of the members whose times at a reference point are ``times [M]``
    (seconds): ``w_m = median / (M t_m)``, with ``median = exp(mean log t)``. A cost linear in
    each member's, ``sum_m w_m t_m(x)``, equals the members' median at that point and has its
    gradient there, and lies above it everywhere else (the arithmetic mean of ``t_m(x) /
    t_m(x0)`` against their geometric mean): a search whose costs must stay additive
    (``opgraph.sbp_search``'s pairwise tables) minimizes the median to first order, and a plan
    that lowers the sum below its value at the reference lowers the median too."""
    t = np.asarray(times, dtype=float)
    return np.exp(np.mean(np.log(t))) / (t.size * t)


def median_breakdown(out):
    """One ``Breakdown`` from one per member (leading axis): ``iteration_s`` the exponential of
    the mean log time, each time part the members' mean scaled by the same factor as the time
    (the parts keep their shares), rates at that time, ``status`` the worst, memory and the
    rest the members' mean (they do not depend on the cluster constants). Traced arrays are
    combined with ``jax.numpy``, host arrays with numpy (one row of ``validate``'s batch).
    Any result dataclass with ``iteration_s`` and a ``TIME_PARTS`` tuple combines the same
    way (a graph step's ``opgraph.step.StepTime``, a ``dlrm_cost.DlrmBreakdown``)."""
    xp = jnp if isinstance(out.iteration_s, jax.Array) else np
    t = xp.exp(xp.mean(xp.log(out.iteration_s), 0))
    scale = t / xp.mean(out.iteration_s, 0)
    values = {}
    for f in dataclasses.fields(out):
        x = getattr(out, f.name)
        if f.name == "iteration_s":
            values[f.name] = t
        elif f.name in type(out).TIME_PARTS:
            values[f.name] = xp.mean(x, 0) * scale
        elif f.name in RATES:
            values[f.name] = xp.mean(x * out.iteration_s, 0) / t
        elif f.name == "status":
            values[f.name] = xp.max(x, 0)
        else:
            values[f.name] = xp.mean(x, 0)
    return out.replace(**values)


def median_jacobian(jac):
    """``d log T / d raw`` of the median from the members' (leading axis): their mean."""
    return np.mean(np.asarray(jac, dtype=float), axis=0)


def median_log_time_jacobian(
    model, plan, cluster, members: list[Params], temperature=smooth.DEFAULT_TEMPERATURE
):  # fmt: skip
    """(median ``Breakdown`` with numpy leaves, its ``d log T / d raw``) of one configuration
    over ``members`` (a list of Params): ``uncertainty.log_time_jacobian``'s counterpart for
    a cluster that takes the population."""
    out, jac = member_log_time_jacobians(
        model, plan, cluster, stack_members(members), temperature=temperature
    )
    return median_breakdown(jax.tree_util.tree_map(np.asarray, out)), median_jacobian(jac)


@functools.partial(jax.jit, static_argnames=("temperature",))
def simulate_members(model, plan, cluster, members: Params, temperature=smooth.DEFAULT_TEMPERATURE):
    """``simulate`` of one configuration with each of ``members`` (``stack_members``), combined
    by ``median_breakdown``."""
    run = jax.vmap(lambda p: simulate(model, plan, cluster, p, temperature))
    return median_breakdown(run(members))
