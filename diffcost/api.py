"""Python entry points: load a config, predict, and batch predictions.

This is the edge of the library: it reads files and converts specs to arrays; the numerical
core (``diffcost.simulate``) stays pure.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax
import numpy as np

from diffcost import population, profiles, smooth
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays
from diffcost.params import Params
from diffcost.simulate import Breakdown, simulate
from diffcost.specs import Experiment


@functools.partial(jax.jit, static_argnames=("temperature",))
def simulate_jit(model, plan, cluster, params, temperature=smooth.DEFAULT_TEMPERATURE):
    """``simulate`` compiled once per input structure (shapes and dtypes)."""
    return simulate(model, plan, cluster, params, temperature)


def experiment_arrays(exp: Experiment, dtype=None):
    """(model, plan, cluster) array pytrees of an experiment."""
    return (
        model_arrays(exp.model, dtype),
        plan_arrays(exp.plan, dtype),
        cluster_arrays(exp.cluster, dtype, exp.plan.n_gpus),
    )


def load(config: str | os.PathLike | Experiment, overrides: Sequence[str] = ()) -> Experiment:
    """An ``Experiment`` from a path (validated), or the experiment itself."""
    if isinstance(config, Experiment):
        return config
    from diffcost import config as config_mod

    return config_mod.load_experiment(str(config), list(overrides))


def params_for(exp: Experiment, profile=None) -> tuple[Params, str]:
    """The calibrated Params for the experiment's cluster and a note on which layers were used.

    ``profile``: None for the cluster's default calibrated profile (device and cluster layers
    shipped with the package), ``"none"`` for datasheet defaults, or a profile file.
    """
    return profiles.params_for(exp.cluster, profile, stack=exp.stack)


def predict(
    config: str | os.PathLike | Experiment,
    overrides: Sequence[str] = (),
    params: Params | None = None,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
    profile=None,
) -> Breakdown:
    """Predict one experiment; returns a ``Breakdown`` of numpy scalars/arrays.

    ``params`` overrides ``profile`` (see ``params_for``). A cluster without a profile of its
    own is predicted with each member of the population (``diffcost.population``: the mean
    of their log times), where ``params_for`` gives the population's mean constants.
    ``diffcost.predict_interval`` returns the same prediction with its 80% interval and
    extrapolation warnings.
    """
    exp = load(config, overrides)
    members = []
    if params is None:
        members = profiles.population_members(exp.cluster, profile, stack=exp.stack)
    if members:
        out = population.simulate_members(
            *experiment_arrays(exp), population.stack_members(members), temperature=temperature
        )
    else:
        params = params_for(exp, profile)[0] if params is None else params
        out = simulate_jit(*experiment_arrays(exp), params, temperature=temperature)
    return jax.tree_util.tree_map(np.asarray, out)
