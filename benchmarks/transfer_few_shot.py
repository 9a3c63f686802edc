"""Few-shot refits of ``transfer.py`` (its docstring, part 2 and ``--suggest``): k runs of a
held-out source refit the constants from its zero-shot fit (``Transfer.refit``), drawn at
random (``few_shot``) or picked by ``diffcost suggest``'s design (``suggested_vs_random``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from calibration.posterior import flat_jacobians, fold_covariance
from diffcost.suggest import greedy_design

if TYPE_CHECKING:
    from transfer import Transfer

DRAWS = 3  # random draws of the k runs per source and k (one with ``--quick``)


def few_shot(t: Transfer, name: str, held: np.ndarray, k: int, draws: int) -> dict:
    """k runs of a held-out source join the training set; the refit predicts the rest."""
    idx = np.flatnonzero(held)
    mapes = []
    for draw in range(draws):
        rng = np.random.default_rng(1000 * k + draw)
        mapes.append(t.refit(held, rng.choice(idx, size=k, replace=False)))
    t.say(f"few-shot {name} k={k}: MAPE {np.mean(mapes):.1f}% (worst draw {max(mapes):.1f}%)")
    return {
        "kind": "source",
        "name": name,
        "k": k,
        "draws": draws,
        "mape_pct_mean": float(np.mean(mapes)),
        "mape_pct_worst": float(max(mapes)),
        "mape_pct_draws": mapes,
    }


def suggested_vs_random(t: Transfer, g: dict, k: int = 3) -> dict:
    """``diffcost suggest``'s design on a held-out source: of its runs, the ``k`` whose
    measurement most shrinks the mean predictive variance of the source's runs
    (``greedy_design`` with every run a target; ``--design mean``: the variance of the
    source's mean log time, the earlier criterion),
    refitted as ``few_shot`` refits random draws; the error on the source's other runs beside
    the random draws' (``few_shot``). The design's model is ``suggest``'s: each run's Jacobian
    at the zero-shot fit, placed at its own family's and cluster's constants; their covariance
    the Laplace posterior of the zero-shot fit (``posterior.fold_covariance``: constants the
    training runs inform are narrow, those of a family or cluster they never reach keep their
    prior width); the stack offset as one more unknown with the other groups' stack spread
    where the source's stack is unseen; the other groups' residual spread as the noise."""
    held = t.src == g["name"]
    _, tables0, w0 = t.zero_shot_fits[held.tobytes()]
    idx = np.flatnonzero(held)
    d = np.asarray(t.P.data["e2e"]["d"])[idx]
    c = np.asarray(t.P.data["e2e"]["c"])[idx]
    full = flat_jacobians(t.P, t.jacobians(idx, tables0, w0), d, c)
    t.say(f"suggest {g['name']}: posterior of the zero-shot fit")
    cov = fold_covariance(t.P, tables0, w0, t.cfg)
    used = np.flatnonzero(np.abs(full).sum(0) > 0)
    spreads = g.get("interval_sd", {})
    stack_var = spreads.get("stack", 0.0) ** 2 if spreads.get("stack_seen_rows", 0) == 0 else 0.0
    jac = np.hstack([full[:, used], np.ones((len(idx), 1))])
    cov = np.block([
        [cov[np.ix_(used, used)], np.zeros((used.size, 1))],
        [np.zeros((1, used.size)), np.full((1, 1), stack_var)],
    ])  # fmt: skip
    noise = spreads.get("residual", 0.05) ** 2
    targets = jac.mean(0) if t.design == "mean" else jac
    picks = [i for i, _ in greedy_design(targets, jac, cov, noise, k)]
    shot = idx[picks]
    mape = t.refit(held, shot)
    random = few_shot(t, g["name"], held, k, 1 if t.quick else DRAWS)
    t.say(f"suggested {g['name']} k={k}: MAPE {mape:.1f}% (random {random['mape_pct_mean']:.1f}%)")
    return {
        "name": g["name"],
        "k": k,
        "zero_shot_mape_pct": g["mape_pct"],
        "suggested_mape_pct": mape,
        "random_mape_pct_mean": random["mape_pct_mean"],
        "random_mape_pct_worst": random["mape_pct_worst"],
        "suggested_rows": [t.e2e[i].row for i in shot],
        "suggested_clusters": sorted({t.cluster[i] for i in shot}),
    }
