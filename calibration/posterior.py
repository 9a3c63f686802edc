"""How sure the fit is: the Laplace posterior of the scalar constants and the model's spreads.

``laplace`` turns a ``calibration.fit`` result into the ``uncertainty`` block of every profile
(``diffcost.uncertainty``):

* **Posterior.** The fit's loss is a weighted mean of robust penalties plus a weak prior; as a
  negative log-likelihood, each measured row is one observation of ``log(pred / meas)`` with
  the residual variance ``sigma_l^2`` of its level (``level_variances``), weighted by the
  Cauchy penalty's IRLS weight ``1 / (1 + (r / delta)^2)`` at the optimum (a row far off the
  fit informs the constants as little as it pulls on them), and every raw constant has a
  Gaussian prior of width ``prior_sd`` around its default. Its Hessian in the Gauss-Newton
  form, ``H = sum_l sum_i u_i J_i J_i^T / sigma_l^2 + diag(1 / prior_sd^2)``, is positive
  definite; ``J_i`` is the row's ``d log pred / d raw`` over the scalar constants of its GPU
  family and cluster (central differences of the float64 forward model; a row reads one row of
  each table, so one difference per constant serves every family and cluster at once). Shape
  grids are held at their fit. ``Sigma = H^-1``; a constant no row touches keeps its prior
  width.
* **Residual spread**: the within-source spread of the end-to-end log residuals, pooled over
  (source, cluster) groups with every group weighing the same (``residual_sd``); per cluster
  from its own groups, else its GPU family's, else all.
* **Stack spread**: the root mean square of the (source, cluster) groups' mean log residuals
  with their source held out (``held_out_residuals``: one Gauss-Newton step of the negative
  log-likelihood without the source's rows), the between-source spread: how far a set of runs
  the constants were not fitted to is off as a whole. The residual spread is in sample; both
  are lower bounds of what a new stack sees (the shape grids keep what the source taught them).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from calibration import fit as F
from calibration.records import Measurements
from diffcost.extrapolation import model_parameters
from diffcost.gpus import cluster_family
from diffcost.params import SCALAR_ENTRIES
from diffcost.profiles import DEVICE_FIELDS
from diffcost.uncertainty import COVERAGE_RANGES, to_block

# (position in SCALAR_ENTRIES, name, leaf, index) of the device and of the other entries
_ENTRIES = [
    (k, n, c.leaf, i, c.name in DEVICE_FIELDS) for k, (n, c, i) in enumerate(SCALAR_ENTRIES)
]
DEV_ENTRIES = [e[:4] for e in _ENTRIES if e[4]]
CLU_ENTRIES = [e[:4] for e in _ENTRIES if not e[4]]
POPULATION_SD_FLOOR = 0.01  # raw units: a constant every fitted cluster shares is not exact
MIN_GROUP_ROWS = 3  # a group's mean residual enters the stack spread from this many rows
FD_STEP = 1e-4  # central-difference step in raw units (float64)


def _shift(tab: dict, leaf: str, index, delta: float) -> dict:
    """``tab`` with ``delta`` added to entry ``index`` (None: the scalar) of every row."""
    x = tab[leaf]
    return {**tab, leaf: x + delta if index is None else x.at[:, index].add(delta)}


def _float64(x):
    return jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x


# ``F.predict_log`` compiled once per shape and temperature (not once per call)
predict_log = jax.jit(F.predict_log, static_argnums=3)


def row_jacobians(problem: F.Problem, tables, temperature: float) -> dict:
    """Per level, ``(J_dev [rows, device entries], J_clu [rows, cluster entries])``: the
    derivative of each row's log prediction w.r.t. the scalar constants of its own family and
    cluster rows, by central differences of the float64 forward model."""
    with jax.enable_x64(True):
        data = jax.tree_util.tree_map(_float64, problem.data)
        dev, clu = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), tables)
        out = {level: ([], []) for level in data}
        for side, entries in ((0, DEV_ENTRIES), (1, CLU_ENTRIES)):
            for _, _, leaf, index in entries:
                pair = [dev, clu]
                pair[side] = _shift(pair[side], leaf, index, FD_STEP)
                plus = predict_log(*pair, data, temperature)
                pair[side] = _shift(pair[side], leaf, index, -2 * FD_STEP)
                minus = predict_log(*pair, data, temperature)
                for level in data:
                    diff = np.asarray(plus[level] - minus[level], dtype=float)
                    out[level][side].append(diff / (2 * FD_STEP))
    return {level: tuple(np.stack(j, axis=1) for j in js) for level, js in out.items()}


def groups(meas: Measurements, by_cluster: bool = True) -> dict:
    """(source, cluster) (or, without ``by_cluster``, source) -> indices of its end-to-end rows
    (in ``meas.e2e`` order)."""
    out = collections.defaultdict(list)
    for i, rec in enumerate(meas.e2e):
        out[(rec.source_name, rec.cluster.name) if by_cluster else rec.source_name].append(i)
    return {key: np.array(rows) for key, rows in out.items()}


def group_stats(resid: np.ndarray, rows_of: dict) -> dict:
    """(source, cluster) -> (rows, mean log residual, within-group variance or None)."""
    out = {}
    for key, rows in rows_of.items():
        rs = resid[rows]
        var = float(np.var(rs, ddof=1)) if rs.size > 1 else None
        out[key] = (rs.size, float(rs.mean()), var)
    return out


def residual_sd(stats: dict, keep=lambda key: True) -> float | None:
    """Within-group spread pooled over the groups ``keep`` accepts (each weighing the same);
    None when none of them has two rows."""
    v = [var for key, (_, _, var) in stats.items() if keep(key) and var is not None]
    return float(np.sqrt(np.mean(v))) if v else None


def stack_sd(stats: dict) -> float:
    """Root mean square of the mean log residuals of groups with ``MIN_GROUP_ROWS`` rows."""
    m = [mean for n, mean, _ in stats.values() if n >= MIN_GROUP_ROWS]
    return float(np.sqrt(np.mean(np.square(m)))) if m else 0.0


def level_variances(result: F.FitResult, problem: F.Problem, stats: dict) -> dict:
    """Residual variance per level: e2e, the within-group plus between-group variance (in
    sample); collectives and GEMMs, the mean squared log residual (collectives with the fit's
    octave weights)."""
    out = {}
    for level, r in result.residuals.items():
        if level == "e2e":
            out[level] = (residual_sd(stats) or 0.0) ** 2 + stack_sd(stats) ** 2
        else:
            w = np.asarray(problem.data[level].get("weight", np.ones_like(r)), dtype=float)
            out[level] = float(np.sum(w * r**2) / np.sum(w))
        out[level] = max(out[level], 1e-8)
    return out


def prior_widths(problem: F.Problem) -> np.ndarray:
    """The prior sd of every raw constant in ``information``'s order."""
    dev = [SCALAR_ENTRIES[k][1].prior_sd for k, *_ in DEV_ENTRIES] * len(problem.families)
    clu = [SCALAR_ENTRIES[k][1].prior_sd for k, *_ in CLU_ENTRIES] * len(problem.clusters)
    return np.array(dev + clu)


def flat_design(problem: F.Problem, d, c, jd: np.ndarray, jc: np.ndarray) -> np.ndarray:
    """``[rows, constants]``: rows' device Jacobians ``jd`` placed at their family ``d`` and
    cluster Jacobians ``jc`` at their cluster ``c``, in ``information``'s flat order."""
    nf, nd, ncl = len(problem.families), len(DEV_ENTRIES), len(CLU_ENTRIES)
    d, c = np.asarray(d), np.asarray(c)
    full = np.zeros((len(jd), nf * nd + len(problem.clusters) * ncl))
    rows = np.arange(len(jd))[:, None]
    full[rows, d[:, None] * nd + np.arange(nd)] = jd
    full[rows, nf * nd + c[:, None] * ncl + np.arange(ncl)] = jc
    return full


def information(problem, result, jacobians, variances, delta: float):
    """The Gauss-Newton Hessian ``H`` of the negative log-likelihood over the flat (family x
    device entry, then cluster x cluster entry) raw constants, and per level the rows' design
    matrix ``[rows, constants]``, weights ``u_i / sigma_l^2`` and log residuals."""
    H = np.diag(1.0 / np.square(prior_widths(problem)))
    terms = {}
    for level, (jd, jc) in jacobians.items():
        r = result.residuals[level]
        u = 1.0 / (1.0 + np.square(r / delta)) / variances[level]
        full = flat_design(problem, problem.data[level]["d"], problem.data[level]["c"], jd, jc)
        H += full.T @ (u[:, None] * full)
        terms[level] = (full, u, r)
    return 0.5 * (H + H.T), terms


def entry_matrix(tab: dict, entries) -> np.ndarray:
    """``[table rows, entries]``: the raw scalar constants ``entries`` name, per table row."""
    cols = [tab[leaf] if i is None else tab[leaf][:, i] for _, _, leaf, i in entries]
    return np.stack([np.asarray(c, dtype=float) for c in cols], axis=1)


def flat_scalars(tables) -> np.ndarray:
    """The raw scalar constants of (device, cluster) tables in ``information``'s order."""
    dev, clu = tables
    return np.concatenate(
        [entry_matrix(dev, DEV_ENTRIES).ravel(), entry_matrix(clu, CLU_ENTRIES).ravel()]
    )


def held_out_residuals(resid, rows_of: dict, H, terms: dict, prior_grad) -> np.ndarray:
    """Each group's e2e log residuals had the fit not seen that group (``rows_of``: group ->
    its rows; ``laplace`` holds out whole sources, every cluster of one): one Gauss-Newton step
    from the fit on the negative log-likelihood without the group's rows, ``theta' = theta -
    (H - H_g)^-1 (grad - grad_g)``, and ``r_g' = r_g + J_g (theta' - theta)``. ``grad`` is the
    whole gradient at the fit (every level's ``J^T U r`` plus ``prior_grad``), so constants only
    the group informed go back toward their prior; the shape grids keep what the group taught
    them (held fixed), so this is still a lower bound of what an unseen stack sees."""
    grad = prior_grad + sum(full.T @ (u * r) for full, u, r in terms.values())
    full, u, _ = terms["e2e"]
    out = np.array(resid, dtype=float)
    for rows in rows_of.values():
        jg, ug, rg = full[rows], u[rows], resid[rows]
        h_g = jg.T @ (ug[:, None] * jg)
        step = -np.linalg.solve(H - h_g, grad - jg.T @ (ug * rg))
        out[rows] = rg + jg @ step
    return out


def coverage(records) -> dict:
    """A profile's ``coverage`` of end-to-end ``records`` (``diffcost.uncertainty.Coverage``)."""
    out: dict = {"rows": len(records), "stacks": sorted({r.stack for r in records if r.stack})}
    if records:
        values = {
            "n_gpus": [r.plan.n_gpus for r in records],
            "model_params": [model_parameters(r.model) for r in records],
            "seq_len": [r.model.seq_len for r in records],
        }
        for key in COVERAGE_RANGES:
            out[key] = [float(f"{min(values[key]):.6g}"), float(f"{max(values[key]):.6g}")]
    return out


def laplace(
    problem: F.Problem,
    result: F.FitResult,
    meas: Measurements,
    cfg: F.FitConfig,
    start: dict | None = None,
):
    """The ``uncertainty`` block of every profile the fit writes, and a summary. ``start``: the
    fit's starting constants (``calibration.fit.fit``), where its prior is centred; the prior
    keeps its registry widths there (a starting profile's own posterior is not carried over).

    Returns:
        ``({("device", family) | ("cluster", name): block}`` (``to_block``), ``{"residual_sd",
        "stack_sd_in_sample", "stack_sd", "group_means": {(source, cluster): (rows, mean log
        residual in sample, held out)}}``).
    """
    rows_of = groups(meas)
    resid = np.asarray(result.residuals.get("e2e", np.zeros(0)), dtype=float)
    stats = group_stats(resid, rows_of)
    jac = row_jacobians(problem, result.tables, cfg.temperature)
    variances = level_variances(result, problem, stats)
    H, terms = information(problem, result, jac, variances, cfg.huber_delta)
    sigma = np.linalg.inv(H)
    held_stats = {}
    if "e2e" in terms:
        offset = flat_scalars(result.tables) - flat_scalars(F.initial_tables(problem, start=start))
        by_source = groups(meas, by_cluster=False)
        held = held_out_residuals(resid, by_source, H, terms, offset / prior_widths(problem) ** 2)
        held_stats = group_stats(held, rows_of)
    spread = stack_sd(held_stats)
    summary = {
        "residual_sd": residual_sd(stats) or 0.0,
        "stack_sd_in_sample": stack_sd(stats),
        "stack_sd": spread,
        "group_means": {k: (n, stats[k][1], m) for k, (n, m, _) in held_stats.items()},
    }
    return _blocks(problem, meas, sigma, stats, spread), summary


def _blocks(problem, meas, sigma, stats, spread) -> dict:
    """Every profile's block: its constants' marginal of ``sigma``, its residual spread, the
    stack spread and its runs' coverage."""
    nf, nd, ncl = len(problem.families), len(DEV_ENTRIES), len(CLU_ENTRIES)
    dev_names = [n for _, n, *_ in DEV_ENTRIES]
    clu_names = [n for _, n, *_ in CLU_ENTRIES]
    fam_of = {name: cluster_family(name) for name in problem.clusters}
    everywhere = residual_sd(stats) or 0.0
    blocks = {}
    for i, fam in enumerate(problem.families):
        idx = np.arange(i * nd, (i + 1) * nd)
        runs = [r for r in meas.e2e if fam_of.get(r.cluster.name) == fam]
        res = residual_sd(stats, lambda key, fam=fam: fam_of.get(key[1]) == fam)
        blocks[("device", fam)] = to_block(
            dev_names, sigma[np.ix_(idx, idx)], res or everywhere, spread, coverage(runs)
        )
    for j, name in enumerate(problem.clusters):
        fam = fam_of[name]
        i = problem.families.index(fam) if fam in problem.families else None
        own = np.arange(nf * nd + j * ncl, nf * nd + (j + 1) * ncl)
        idx = own if i is None else np.concatenate([np.arange(i * nd, (i + 1) * nd), own])
        names = clu_names if i is None else dev_names + clu_names
        runs = [r for r in meas.e2e if r.cluster.name == name]
        res = residual_sd(stats, lambda key, name=name: key[1] == name)
        res = res or blocks.get(("device", fam), {}).get("residual_sd") or everywhere
        blocks[("cluster", name)] = to_block(
            names, sigma[np.ix_(idx, idx)], res, spread, coverage(runs)
        )
    return blocks


def population_block(result: F.FitResult, problem: F.Problem, clusters, spreads: dict) -> dict:
    """The ``uncertainty`` block of the population profile (``diffcost.profiles``): the cluster
    constants of a cluster no run names are drawn around the mean of ``clusters`` with their
    spread between those clusters (raw units; a constant they all share sits at a small floor),
    and no runs of its own (every stack unseen)."""
    rows = [problem.clusters.index(c) for c in sorted(clusters)]
    if len(rows) < 2:
        raise ValueError("a population spread needs at least two clusters with runs")
    raw = entry_matrix(result.tables[1], CLU_ENTRIES)[rows]
    sd = np.maximum(raw.std(axis=0, ddof=1), POPULATION_SD_FLOOR)
    return to_block(
        [n for _, n, *_ in CLU_ENTRIES],
        np.diag(sd**2),
        spreads["residual_sd"],
        spreads["stack_sd"],
        {"rows": 0, "stacks": []},
    )


def _thinned(problem: F.Problem, weights: dict, max_rows: int):
    """A problem of at most ``max_rows`` of each level's kept rows (evenly spaced), and per
    level the factor each stands for (kept rows / rows taken)."""
    data, counts, scale = {}, {}, {}
    for level, d in problem.data.items():
        n = problem.counts[level]
        kept = np.flatnonzero(np.asarray(weights.get(level, np.ones(n)), float) > 0)
        if kept.size == 0:
            continue
        pick = np.linspace(0, kept.size - 1, min(kept.size, max_rows)).round().astype(int)
        take = kept[np.unique(pick)]
        data[level] = jax.tree_util.tree_map(lambda x, take=take: x[take], d)
        counts[level], scale[level] = take.size, kept.size / take.size
    return F.Problem(problem.families, problem.clusters, data, counts), scale


def fold_covariance(
    problem: F.Problem, tables, weights: dict, cfg: F.FitConfig, max_rows: int = 600
) -> np.ndarray:
    """The Laplace covariance of the flat constants (``information``'s order) of a fit on the
    rows ``weights`` keeps (level -> per-row weight; a level it does not name keeps every row),
    at that fit's ``tables``: each kept row is one observation with its level's mean squared
    log residual as the variance and the Cauchy penalty's IRLS weight, as in ``laplace``. A
    family or cluster no kept row reaches keeps its prior width. For speed each level's
    information is estimated from at most ``max_rows`` of its kept rows, evenly spaced, each
    standing for its share of the rest. Used for held-out studies, where the fit's own
    residual statistics are all there is."""
    sub, scale = _thinned(problem, weights, max_rows)
    jac = row_jacobians(sub, tables, cfg.temperature)
    with jax.enable_x64(True):
        data = jax.tree_util.tree_map(_float64, sub.data)
        dev, clu = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), tables)
        logs = F.predict_log(dev, clu, data, cfg.temperature)
    H = np.diag(1.0 / np.square(prior_widths(problem)))
    for level, (jd, jc) in jac.items():
        r = np.asarray(logs[level], float) - np.asarray(sub.data[level]["log_meas"], float)
        var = max(float(np.mean(r**2)), 1e-8)
        u = scale[level] / (1.0 + np.square(r / cfg.huber_delta)) / var
        full = flat_design(problem, sub.data[level]["d"], sub.data[level]["c"], jd, jc)
        H += full.T @ (u[:, None] * full)
    return np.linalg.inv(0.5 * (H + H.T))


def flat_jacobians(problem: F.Problem, jac: np.ndarray, families, clusters) -> np.ndarray:
    """Rows' Jacobians over ``diffcost.params.SCALAR_NAMES`` (``[rows, names]``) placed in
    ``information``'s flat layout: device constants at the row's family (``families``: its
    index in ``problem.families``), the others at its cluster (``clusters``)."""
    dev_k = [k for k, *_ in DEV_ENTRIES]
    clu_k = [k for k, *_ in CLU_ENTRIES]
    return flat_design(problem, families, clusters, jac[:, dev_k], jac[:, clu_k])
