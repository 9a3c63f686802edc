"""Few-shot refit: fitted constants updated by a handful of end-to-end runs.

A handful of runs cannot pin down the dozens of constants they touch. A descent that frees them
all (Adam moves every constant with a gradient by about its learning rate per step, whatever
the gradient's size) fits the runs and moves constants they say nothing about, so the runs it
did not see can end up worse than before. Here the update is the maximum a posteriori estimate
whose prior is the starting fit:

    minimise  sum_i (log meas_i - log pred_i(theta))^2 / alpha
              + sum_j (theta_j - theta0_j)^2 / sd_j^2

``theta``: the raw scalar constants (``calibration.posterior``'s flat layout: device constants
of the runs' GPU families, cluster constants of their clusters; shape grids and stack offsets
stay where they are); ``theta0`` the starting fit; ``sd_j`` the constants' prior widths
(``Constant.prior_sd``); ``alpha`` the ratio of the runs' noise variance to the prior's scale.
Linearised at the start (``J = d log pred / d theta``, ``r = log meas - log pred``) this is a
kernel ridge regression, ``theta - theta0 = D J^T (J D J^T + alpha I)^-1 r`` with ``D =
diag(sd^2)``: only combinations of constants the runs tell apart move, each as far as its width
allows.

``alpha`` is chosen by leave-one-out over the runs themselves, in closed form for the linear
model: run ``i`` predicted from the others is off by ``[K^-1 r]_i / [K^-1]_ii`` with ``K = J D
J^T + alpha I`` (Rasmussen and Williams, "Gaussian Processes for Machine Learning", 2006,
section 5.4.2). The candidates are ``STRENGTHS`` and no update at all (the starting fit's own
errors), so the refit keeps the start where the runs do not predict each other better than it
does. Gauss-Newton steps then solve the nonlinear problem at that ``alpha`` (each step's
objective checked, halved until it does not grow). Only the runs given are used.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from calibration import fit as F
from calibration import posterior

# Candidate noise-to-prior variance ratios, log-spaced over six decades: at 1e-4 the runs are
# matched almost exactly, at 1e2 the update is a small fraction of the start's error.
STRENGTHS = tuple(float(a) for a in np.logspace(-4, 2, 13))
# With the model's residual spread known: prior scales (fractions of the registry widths)
PRIOR_SCALES = tuple(float(c) for c in np.logspace(-2, 0, 9))
# Leave-one-out errors are scored by their mean |e|^LOO_POWER: the mean absolute log error
# (what MAPE measures), less swayed than the squared error by one run the model cannot fit.
# Picked over 2 on the transfer benchmark's few-shot draws of vTrain and MosaicML (the rows
# it reports): 7.7% against 8.4% (vTrain, 3 runs), 7.0% against 7.4% (MosaicML, 10 runs),
# 8.5% against 8.3% (vTrain, 10 runs).
LOO_POWER = 1.0
GN_STEPS = 4  # Gauss-Newton steps at the chosen strength
HALVINGS = 6  # step halvings before a Gauss-Newton step is given up


@dataclasses.dataclass
class Refit:
    """What ``refit`` did: the tables after it (a list for members), the strength
    leave-one-out chose (None: no update), the leave-one-out score of every candidate (mean
    ``|log error|^LOO_POWER``; ``inf``: no update), and the runs' log residuals (predicted -
    measured) before and after."""

    tables: tuple
    strength: float | None
    loo_mse: dict[float, float]
    initial_residuals: np.ndarray
    residuals: np.ndarray


def runs_problem(problem: F.Problem, rows=None) -> F.Problem:
    """``problem``'s e2e level alone, its rows ``rows`` (indices; default: those of positive
    weight, or all), with the same family and cluster order."""
    e2e = problem.data["e2e"]
    if rows is None:
        w = np.asarray(e2e.get("weight", np.ones(problem.counts["e2e"])), float)
        rows = np.flatnonzero(w > 0)
    rows = np.asarray(rows, dtype=int)
    data = {"e2e": jax.tree_util.tree_map(lambda x: x[rows], e2e)}
    return F.Problem(problem.families, problem.clusters, data, {"e2e": int(rows.size)})


def add_flat(tables, delta: np.ndarray):
    """``tables`` with the flat raw scalar constants ``delta`` (``posterior.flat_scalars``'
    order and length) added."""
    dev, clu = tables
    n_fam = len(next(iter(dev.values())))
    nd, ncl = len(posterior.DEV_ENTRIES), len(posterior.CLU_ENTRIES)
    steps = (delta[: n_fam * nd].reshape(n_fam, nd), delta[n_fam * nd :].reshape(-1, ncl))
    out = [dict(dev), dict(clu)]
    for side, entries in ((0, posterior.DEV_ENTRIES), (1, posterior.CLU_ENTRIES)):
        tab = out[side]
        for e, (_, _, leaf, index) in enumerate(entries):
            x = tab[leaf]
            add = jnp.asarray(steps[side][:, e], x.dtype)
            tab[leaf] = x + add if index is None else x.at[:, index].add(add)
    return out[0], out[1]


def _members_of(tables) -> list:
    """``tables`` as a list of members: a list of (device, cluster) tables stays (the members
    of a population, each run's prediction their mean log time), one pair becomes one."""
    return tables if isinstance(tables, list) else [tables]


def _like(tables, members: list):
    """``members`` in the form ``tables`` came in (a list, or one pair)."""
    return members if isinstance(tables, list) else members[0]


def _shifted(tables, delta: np.ndarray):
    """``add_flat`` of ``delta`` to every member of ``tables``."""
    return _like(tables, [add_flat(m, delta) for m in _members_of(tables)])


def _linearise(runs: F.Problem, tables, temperature: float):
    """(log residuals measured - predicted ``[runs]``, design ``[runs, flat constants]``); for
    members, of their mean log time, whose design is the mean of theirs (a shift applied to
    every member alike)."""
    d = runs.data["e2e"]
    designs = []
    for m in _members_of(tables):
        jd, jc = posterior.row_jacobians(runs, m, temperature)["e2e"]
        designs.append(posterior.flat_design(runs, d["d"], d["c"], jd, jc))
    return -_residuals(runs, tables, temperature), np.mean(designs, axis=0)


def _residuals(runs: F.Problem, tables, temperature: float) -> np.ndarray:
    """Log residuals predicted - measured of the runs (for members, of their mean log time),
    in float64."""
    with jax.enable_x64(True):
        data = jax.tree_util.tree_map(posterior._float64, runs.data)
        logs = []
        for m in _members_of(tables):
            tabs = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), m)
            logs.append(np.asarray(posterior.predict_log(*tabs, data, temperature)["e2e"]))
        return np.mean(logs, axis=0) - np.asarray(data["e2e"]["log_meas"], dtype=float)


def loo_errors(design: np.ndarray, var: np.ndarray, resid: np.ndarray, alpha: float):
    """Leave-one-out errors of the linear update at strength ``alpha``: each run's residual
    when the other runs alone move the constants (``resid``: measured - predicted at the
    start, ``var``: the prior variances)."""
    K = (design * var) @ design.T + alpha * np.eye(len(resid))
    Kinv = np.linalg.inv(K)
    return Kinv @ resid / np.diag(Kinv)


def strengths_for(noise_sd: float | None) -> tuple[float, ...]:
    """The candidate strengths: ``STRENGTHS``, or with the model's residual spread
    ``noise_sd`` known, ``noise_sd^2 / c^2`` for prior scales ``c`` of ``PRIOR_SCALES`` (the
    runs are matched no closer than the model's own error, and the prior is at most as wide
    as the constants' registry widths)."""
    if not noise_sd:
        return STRENGTHS
    return tuple(float(noise_sd**2 / c**2) for c in PRIOR_SCALES)


def choose_strength(
    design, var, resid, strengths=STRENGTHS, power: float = LOO_POWER
) -> tuple[float | None, dict]:
    """The candidate of ``strengths`` (or None: no update) with the smallest leave-one-out
    mean error (``|e|^power``), and every candidate's; with one run there is nothing to leave
    out and the update matches it at the smallest strength."""
    scores = {np.inf: float(np.mean(np.abs(resid) ** power))}
    if len(resid) < 2:
        return min(strengths), scores
    for a in strengths:
        scores[a] = float(np.mean(np.abs(loo_errors(design, var, resid, a)) ** power))
    best = min(scores, key=scores.get)
    return (None if best == np.inf else best), scores


def _objective(resid, delta, var, alpha) -> float:
    """The MAP objective; a constant of prior variance 0 is held (its ``delta`` is 0)."""
    free = var > 0
    return float(np.sum(resid**2) / alpha + np.sum(delta[free] ** 2 / var[free]))


def refit(
    problem: F.Problem, tables, rows=None, temperature: float = F.FitConfig().temperature,
    strengths=None, steps: int = GN_STEPS, noise_sd: float | None = None,
) -> Refit:  # fmt: skip
    """Update ``tables`` (raw device and cluster tables in ``problem``'s order, the start and
    the prior's centre) with the e2e runs ``rows`` of ``problem`` (indices; default: those of
    positive weight), as the module docstring says. ``tables`` may be a list of members (a
    population, ``calibration.heldout.population_mixture``): each run is then predicted by
    their mean log time, and one update shifts every member alike (``Refit.tables`` is the
    list of shifted members).

    Raises:
        ValueError: ``problem`` has no e2e run to refit with.
    """
    if "e2e" not in problem.data or (rows is not None and len(rows) == 0):
        raise ValueError("a few-shot refit needs at least one end-to-end run")
    strengths = strengths_for(noise_sd) if strengths is None else strengths
    return _refit(problem, tables, rows, temperature, strengths, steps)


def _refit(problem, tables, rows, temperature, strengths, steps) -> Refit:
    runs = runs_problem(problem, rows)
    if runs.counts["e2e"] == 0:
        raise ValueError("a few-shot refit needs at least one end-to-end run")
    var = np.square(posterior.prior_widths(problem))
    resid0, design = _linearise(runs, tables, temperature)
    alpha, scores = choose_strength(design, var, resid0, strengths)
    if alpha is None:
        return Refit(tables, None, scores, -resid0, -resid0)
    delta, resid, current = np.zeros_like(var), resid0, tables
    for i in range(steps):
        if i:
            resid, design = _linearise(runs, current, temperature)
        target = resid + design @ delta
        K = (design * var) @ design.T + alpha * np.eye(len(target))
        proposal = var * (design.T @ np.linalg.solve(K, target))
        before = _objective(resid, delta, var, alpha)
        for _ in range(HALVINGS):
            trial = _shifted(tables, proposal)
            trial_resid = -_residuals(runs, trial, temperature)
            if _objective(trial_resid, proposal, var, alpha) <= before:
                break
            proposal = 0.5 * (proposal + delta)
        else:
            break
        delta, current, resid = proposal, trial, trial_resid
    return Refit(current, alpha, scores, -resid0, -resid)


def fit_with_runs(
    meas, cfg: F.FitConfig, progress: bool, problem: F.Problem, start: dict | None = None,
    noise_sd: float | None = None, member_starts: list[dict] | None = None,
) -> tuple[F.FitResult, Refit | None]:  # fmt: skip
    """``diffcost calibrate``'s fit, and the ``Refit`` when there was one. With fewer than
    ``cfg.full_rows`` end-to-end runs (a level that would weigh less than in full against the
    prior, ``FitConfig.full_rows``) and a start whose residual spread ``noise_sd`` is known (a
    fitted profile's ``uncertainty`` block), the other levels (collectives, kernel tables) are
    fitted by ``F.fit`` from ``start`` without the runs, and the runs then update that fit by
    ``refit`` (``noise_sd``: ``strengths_for``). Otherwise (datasheet defaults, which no fit
    made, or 100 runs and more, or none) ``F.fit`` on everything: on random vTrain subsets
    (``benchmarks/small_data.py``) the refit beat the descent from the shipped profile and lost
    to it from the datasheet defaults.

    ``member_starts`` (one ``start`` per member of the population, ``start`` their mean) makes
    the update that of the members (``refit`` of a list): the other levels' fit moves every
    member as it moves the mean, the runs are predicted by the members' mean log time, and
    ``Refit.tables`` is the list of shifted members; the ``FitResult`` holds their mean raw
    constants and the median's residuals. Without the few-shot update the members are unused.
    """
    runs = problem.counts.get("e2e", 0)
    if not noise_sd or not 0 < runs < cfg.full_rows:
        return F.fit(meas, cfg, progress, problem, start), None
    others = {k: v for k, v in problem.data.items() if k != "e2e"}
    losses, seconds, converged = [], 0.0, True
    initial = F.initial_tables(problem, start=start)
    tables = initial
    if others:
        counts = {k: problem.counts[k] for k in others}
        kernels = F.Problem(problem.families, problem.clusters, others, counts)
        first = F.fit(meas, cfg, progress, kernels, start)
        tables, losses = first.tables, first.losses
        seconds, converged = first.seconds, first.converged
    if member_starts:
        moved = jax.tree_util.tree_map(jnp.subtract, tables, initial)
        starts = [F.initial_tables(problem, start=m) for m in member_starts]
        initial = starts
        tables = [jax.tree_util.tree_map(jnp.add, m, moved) for m in starts]
    done = refit(problem, tables, temperature=cfg.temperature, noise_sd=noise_sd)
    result = F.result_from_tables(
        problem, mean_tables(done.tables), _log_predictions(problem, done.tables, cfg),
        _log_predictions(problem, initial, cfg), losses, seconds, converged,
    )  # fmt: skip
    return result, done


def mean_tables(tables):
    """The raw tables themselves, or for members their mean raw constants."""
    members = _members_of(tables)
    return jax.tree_util.tree_map(lambda *xs: jnp.mean(jnp.stack(xs), 0), *members)


def _log_predictions(problem: F.Problem, tables, cfg: F.FitConfig) -> dict:
    """Log predictions of every level of ``problem`` (for members, their mean log time)."""
    logs = [posterior.predict_log(*m, problem.data, cfg.temperature) for m in _members_of(tables)]
    return jax.tree_util.tree_map(lambda *xs: jnp.mean(jnp.stack(xs), 0), *logs)
