"""What the data pin down in a fit: the Hessian of the loss at the optimum over the scalar
constants, its flat directions, and which shape grid nodes rows touch.

The Hessian is taken by central differences of the exact gradient (``jax.grad``) in float64: an
exact ``jax.hessian`` (or its HVP) compiles for minutes on this model.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from calibration import fit as F
from calibration.readers import Measurements
from diffcost.params import GEMM_GRID_CLASSES

FLAT_REL = 1e-6  # eigenvalues below this share of the largest are flat


def parameter_names(problem: F.Problem, tables) -> np.ndarray:
    """Names of the flattened (dev, clu) tables, in ``ravel_pytree`` order."""

    def names(prefix, keys, tab):
        out = {}
        for leaf, arr in tab.items():
            arr = np.asarray(arr)
            a = np.empty(arr.shape, dtype=object)
            # stack offsets ride in the cluster table, one entry per stack
            kind, rows = ("stack", F.STACK_NAMES) if leaf in F.STACK_KEYS else (prefix, keys)
            for idx in np.ndindex(arr.shape):
                tail = f"[{','.join(map(str, idx[1:]))}]" if arr.ndim > 1 else ""
                a[idx] = f"{kind}:{rows[idx[0]]}:{leaf}{tail}"
            out[leaf] = a
        return out

    dev, clu = tables
    tree = (names("device", problem.families, dev), names("cluster", problem.clusters, clu))
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, np.ndarray))
    return np.concatenate([np.asarray(x).ravel() for x in leaves])


def hessian_fd(problem_meas: Measurements, tables, cfg: F.FitConfig, cols, h: float = 1e-4):
    """Hessian of ``make_loss`` (all rows, weight 1) by central differences of ``jax.grad`` in
    float64, restricted to the flat entries ``cols`` (the others held at ``tables``); returns
    (H, flat point, seconds for compile, seconds for the differences)."""
    with jax.enable_x64(True):
        prob = F.build_problem(problem_meas, dtype=jnp.float64)
        loss_fn = F.make_loss(prob, cfg, dtype=jnp.float64)
        t64 = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float64), tables)
        flat, unravel = ravel_pytree(t64)
        grad = jax.jit(jax.grad(lambda x, data: loss_fn(unravel(x), data)))
        t0 = time.perf_counter()
        compiled = grad.lower(flat, prob.data).compile()
        t_compile = time.perf_counter() - t0
        n = flat.shape[0]
        H = np.zeros((len(cols), len(cols)))
        t0 = time.perf_counter()
        for c, i in enumerate(cols):
            e = jnp.zeros(n, jnp.float64).at[i].set(h)
            gp = np.asarray(compiled(flat + e, prob.data))
            gm = np.asarray(compiled(flat - e, prob.data))
            H[:, c] = (gp - gm)[cols] / (2 * h)
        t_diff = time.perf_counter() - t0
        return 0.5 * (H + H.T), np.asarray(flat), t_compile, t_diff


def hessian_fd_step(problem_w: F.Problem, tables, cfg: F.FitConfig, cols, h: float = 3e-3):
    """Quick variant: central differences of the float32 gradient read back from the Adam
    first moment of one ``fit`` step from a fresh state (``mu = (1 - b1) g``); reuses the
    executable ``fit`` compiled, so no new compile. Returns (H, seconds)."""
    step, opt = F.make_step(problem_w, cfg)
    tables = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), tables)
    flat, unravel = ravel_pytree(tables)
    st0 = opt.init(tables)

    def grad(x):
        _, st, _, _ = step(unravel(x), st0, problem_w.data)
        return np.asarray(ravel_pytree(st[0].mu)[0], float) / (1.0 - 0.9)

    n = flat.shape[0]
    H = np.zeros((len(cols), len(cols)))
    t0 = time.perf_counter()
    for c, i in enumerate(cols):
        e = jnp.zeros(n, jnp.float32).at[i].set(h)
        H[:, c] = (grad(flat + e) - grad(flat - e))[cols] / (2 * h)
    return 0.5 * (H + H.T), time.perf_counter() - t0


def grid_coverage(problem: F.Problem, tables, leaf: str = F.GRID_LEAF) -> dict:
    """Per GPU family and precision class ("a100 high"; classes no row reads are left out) of
    the GEMM shape grid, per family ("a100 layer") of the layer shape grid, or per cluster
    ("vtrain-a100 cluster layer", "vtrain-a100 head") of the cluster layer and LM head shape
    grids (``leaf``): nodes some row's prediction depends on (touched), and nodes the fit moved
    (factor off 1 by at least 1%). Every prediction moves one way as a node's factor rises
    (faster GEMMs, a slower layer), so the gradient of their sum is nonzero exactly at touched
    nodes."""
    dev, clu = tables
    on_device = leaf in dev

    def total(grid):
        d, c = ({**dev, leaf: grid}, clu) if on_device else (dev, {**clu, leaf: grid})
        logs = F.predict_log(d, c, problem.data, 1e-3)
        return sum(jnp.sum(v) for v in logs.values())

    classes = {
        F.GRID_LEAF: GEMM_GRID_CLASSES,
        F.LAYER_LEAF: ("layer",),
        F.CLUSTER_LAYER_LEAF: ("cluster layer",),
        F.HEAD_LEAF: ("head",),
    }[leaf]
    table = (dev if on_device else clu)[leaf]
    owners = problem.families if on_device else problem.clusters
    per_class = lambda x: np.asarray(x).reshape(x.shape[0], len(classes), -1)  # noqa: E731
    g = np.abs(per_class(jax.grad(total)(table)))
    moved = np.abs(per_class(table)) >= np.log(1.01)
    return {
        f"{owner} {cls}": {
            "nodes": int(g[i, c].size),
            "touched": int((g[i, c] > 0).sum()),
            "moved_1pct": int(moved[i, c].sum()),
        }
        for i, owner in enumerate(owners)
        for c, cls in enumerate(classes)
        if (g[i, c] > 0).any()
    }


def flat_directions(
    H: np.ndarray, names: np.ndarray, prior_diag: np.ndarray, zero_rel=1e-9
) -> dict:
    """``prior_diag``: the prior's Hessian (diagonal, ``calibration.fit.prior_curvature``)."""
    Hd = H - np.diag(prior_diag)
    w_full = np.linalg.eigvalsh(H)
    w, V = np.linalg.eigh(Hd)
    lam_max = float(np.max(np.abs(w)))
    thr = FLAT_REL * lam_max
    # Constants no row is sensitive to (zero row and column of the data Hessian).
    untouched = np.max(np.abs(Hd), axis=1) <= zero_rel * lam_max
    flat = np.abs(w) < thr
    proj = np.sum(V[:, flat] ** 2, axis=1)  # share of e_i inside the flat subspace
    unpinned = [str(n) for n, p in zip(names, proj) if p >= 0.5]
    # Directions whose data curvature is below the prior's: the prior decides them (compared
    # with the prior's curvature along each eigenvector).
    weak = w < np.sum(V**2 * prior_diag[:, None], axis=0)
    proj_w = np.sum(V[:, weak] ** 2, axis=1)
    prior_dominated = [str(n) for n, p in zip(names, proj_w) if p >= 0.5]
    touched = ~untouched
    wt, Vt = np.linalg.eigh(Hd[np.ix_(touched, touched)])
    tnames = names[touched]
    directions = []
    for j in np.argsort(np.abs(wt)):
        if abs(wt[j]) >= thr:
            break
        v = Vt[:, j]
        top = np.argsort(-(v**2))[:6]
        directions.append(
            {
                "eigenvalue": float(wt[j]),
                "relative": float(wt[j] / lam_max),
                "params": [
                    {"name": str(tnames[i]), "component": float(v[i])}
                    for i in top
                    if v[i] ** 2 >= 0.05
                ],
            }
        )
    return {
        "threshold_rel": FLAT_REL,
        "n_params": int(len(H)),
        "lambda_max_data": lam_max,
        "lambda_max_loss": float(w_full.max()),
        "lambda_min_loss": float(w_full.min()),
        "n_flat": int(flat.sum()),
        "n_untouched": int(untouched.sum()),
        "untouched": [str(n) for n in names[untouched]],
        "parameters": unpinned,
        "n_below_prior_curvature": int(weak.sum()),
        "prior_dominated": prior_dominated,
        "directions": directions,
        "data_eigenvalues": [float(x) for x in np.sort(w)[::-1]],
    }
