"""A prediction with its 80% interval and its extrapolation warnings (the Python API).

``predict_interval`` is ``diffcost.predict`` plus how sure it is: the calibration posterior of
the cluster's profile propagated by the Jacobian of ``log T`` (``diffcost.uncertainty``), and
the warnings of ``diffcost.extrapolation``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import numpy as np

from diffcost import explain, extrapolation, population, profiles, smooth
from diffcost.api import experiment_arrays, load, params_for
from diffcost.params import Params
from diffcost.simulate import Breakdown
from diffcost.specs import Experiment
from diffcost.stacks import STACK_NAMES, canonical
from diffcost.uncertainty import Spread, Uncertainty, log_time_jacobian, spread


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A prediction and how sure it is.

    Attributes:
        breakdown: the ``Breakdown`` (numpy leaves), as ``diffcost.predict`` returns it.
        iteration_s: the predicted time per iteration.
        low_s, high_s: its 80% interval, ``iteration_s * exp(-+ 1.2816 spread.log_sd)``.
        spread: the log-space spread and its parts (posterior, residual, stack).
        stack: the software stack asked about (None: the one the profile was fitted on).
        stack_seen: whether the profile's fit has end-to-end runs of that stack.
        warnings: where the prediction extrapolates (``diffcost.extrapolation``).
        constants: which profile layers gave the constants and the posterior.
        members: how many members of the population the time is the median over
            (``diffcost.population``; 0: the constants' own prediction).
        params: the constants (for a cluster without a profile, the population's mean).
        profile: which profile layers gave them, and whether the time is the members' median.
    """

    breakdown: Breakdown
    iteration_s: float
    low_s: float
    high_s: float
    spread: Spread
    stack: str | None
    stack_seen: bool
    warnings: tuple[str, ...]
    constants: str
    members: int = 0
    params: Params | None = None
    profile: str = ""


def predict_interval(
    config: str | os.PathLike | Experiment,
    overrides: Sequence[str] = (),
    profile=None,
    stack: str | None = None,
    params: Params | None = None,
    uncertainty: Uncertainty | None = None,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
) -> Prediction:
    """Predict one experiment with its 80% interval and extrapolation warnings.

    Args:
        config: experiment YAML path or ``Experiment`` (``diffcost.load``).
        overrides: ``key=value`` overrides of the YAML.
        profile: as ``diffcost.predict``: None for the cluster's calibrated profile,
            ``"none"`` for datasheet defaults (prior widths), or a profile file.
        stack: the software stack the run uses (a ``diffcost.stacks`` name, or a framework
            such as ``"NeMo"`` or ``"torchtitan"``: ``diffcost.stacks.canonical``); None for
            the experiment's ``stack``, or without one the stack(s) the profile was fitted on.
            A known stack's calibrated offsets apply; a stack without end-to-end runs in the
            fit widens the interval by the profile's stack spread and adds a warning.
        params: constants to use instead of the profile's (the posterior still comes from
            ``profile``).
        uncertainty: an ``Uncertainty`` to use instead of the profile's (e.g. with spreads
            measured by a held-out benchmark).
        temperature: smoothness of the model, as in ``simulate``.

    Returns:
        A ``Prediction``.

    Examples:
        >>> p = predict_interval("configs/examples/gpt-1b-vtrain.yaml")
        >>> p.low_s < p.iteration_s < p.high_s
        True
    """
    exp = load(config, overrides)
    stack = canonical(stack) or exp.stack
    if stack in STACK_NAMES:
        exp = dataclasses.replace(exp, stack=stack)
    note, members = "given Params", []
    if params is None:
        params, note = params_for(exp, profile)
        members = profiles.population_members(exp.cluster, profile, stack=exp.stack)
    unc = profiles.uncertainty_for(exp.cluster, profile) if uncertainty is None else uncertainty
    seen = unc.stack_seen(stack)
    arrays = experiment_arrays(exp)
    if members:  # the population's median (diffcost.population)
        out, jac = population.median_log_time_jacobian(*arrays, members, temperature=temperature)
        note += f"; {population.median_note(len(members))}"
    else:
        out, jac = log_time_jacobian(*arrays, params, temperature=temperature)
        out = jax.tree_util.tree_map(np.asarray, out)
    s = spread(jac, unc, seen)
    t = float(out.iteration_s)
    low, high = s.interval(t)
    rows = explain.elasticities(exp, params, temperature)
    notes = extrapolation.warnings(exp, unc, stack, rows)
    return Prediction(out, t, low, high, s, stack, seen, tuple(notes), f"{note}; {unc.note}",
                      len(members), params, note)  # fmt: skip
