"""Held-out evaluation of fits: weighted fits on one shared problem, predictions of rows the fit
did not see, and the error figures the benchmarks report.

Every fit of a study (cross-validation folds, leave-one-source-out, few-shot refits) runs on one
``Problem`` holding every row, with a per-row ``weight`` (0 for held-out rows; ``fit.make_loss``
reads it), so the fit's step compiles once. Parameters of families and clusters with no weighted
row get exactly zero gradient and stay where they started. Held-out rows are predicted by
:class:`Predictor` on a problem built from them alone, with the trained tables mapped to its
family and cluster order (``map_tables``).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from calibration import fit as F
from calibration.readers import Measurements, load, shared_files
from calibration.records import fitted_records
from diffcost.gpus import preset_family
from diffcost.params import default_params
from diffcost.validate import kendall_tau

LEVELS = ("e2e", "coll", "gemm")
# Device constants that only end-to-end runs read (no kernel or collective table does): a GPU
# family without runs can learn them from no measurement of its own, so it takes the mean of
# the families with runs (``fill_uninformed``), as a cluster without runs takes the population.
E2E_ONLY_DEVICE_LEAVES = ("step_compute_log",)


@contextlib.contextmanager
def fresh_compilation_cache(prefix: str):
    """A new, empty persistent XLA cache for the duration (set before anything compiles): every
    fit of a study after the first reuses the step the first compiled, and the first still
    compiles from cold. The folder is removed afterwards."""
    cache_dir = tempfile.mkdtemp(prefix=prefix)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    try:
        yield cache_dir
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)


def load_data(data_dir: Path) -> Measurements:
    """Every record ``build_problem`` can use, in the order its arrays will have."""
    return fitted_records(load(shared_files(data_dir)))


def subset(meas: Measurements, e2e=None, coll=None, gemm=None) -> Measurements:
    """E2E, collective and GEMM records selected by boolean masks (None: all); attention and
    memory records are left out."""
    pick = lambda xs, m: list(xs) if m is None else [x for x, k in zip(xs, m) if k]  # noqa: E731
    return Measurements(
        e2e=pick(meas.e2e, e2e),
        collectives=pick(meas.collectives, coll),
        gemms=pick(meas.gemms, gemm),
    )


def weighted(problem: F.Problem, weights: dict, e2e_log_meas=None) -> F.Problem:
    """``problem`` with a per-row ``weight`` on every level (and optionally new e2e targets);
    a weight ``build_problem`` already set (e.g. per size octave) is multiplied in."""
    data = {lvl: dict(d) for lvl, d in problem.data.items()}
    for lvl in data:
        w = jnp.asarray(weights[lvl], jnp.float32)
        base = problem.data[lvl].get("weight")
        data[lvl]["weight"] = w if base is None else w * jnp.asarray(base, jnp.float32)
    if e2e_log_meas is not None:
        data["e2e"]["log_meas"] = jnp.asarray(e2e_log_meas, jnp.float32)
    return F.Problem(problem.families, problem.clusters, data, dict(problem.counts))


def trained_keys(problem: F.Problem, weights: dict) -> tuple[set, set]:
    """Families and clusters named by at least one row of positive weight."""
    fams, clus = set(), set()
    for lvl, d in problem.data.items():
        keep = np.asarray(weights[lvl]) > 0
        fams |= {problem.families[i] for i in np.unique(np.asarray(d["d"])[keep])}
        clus |= {problem.clusters[j] for j in np.unique(np.asarray(d["c"])[keep])}
    return fams, clus


def tables_from_result(res: F.FitResult, problem: F.Problem):
    """Raw (dev, clu) tables in ``problem``'s order, rebuilt from ``res.params_by_cluster``
    (each cluster's Params holds its family's device row and its own cluster row)."""
    dev = {leaf: [] for leaf in F.DEVICE_LEAVES}
    for fam in problem.families:
        rep = next((c for c in problem.clusters if preset_family(c) == fam), None)
        src = res.params_by_cluster[rep] if rep is not None else default_params(family=fam)
        for leaf in F.DEVICE_LEAVES:
            dev[leaf].append(jnp.asarray(getattr(src, leaf)))
    clu = {
        leaf: [jnp.asarray(getattr(res.params_by_cluster[c], leaf)) for c in problem.clusters]
        for leaf in F.CLUSTER_LEAVES
    }
    clu.update(
        {
            key: [res.stack_values.get(s, {}).get(e.name, 0.0) for s in F.STACK_NAMES]
            for key, e in F.STACK_KEYS.items()
        }
    )
    return (
        {k: jnp.stack(v) for k, v in dev.items()},
        {k: jnp.asarray(v) for k, v in clu.items()},
    )


def population_members(problem: F.Problem, tables, clusters) -> list[dict]:
    """The raw cluster constants of each of ``clusters`` (sorted), the members of the
    population a cluster no fit has seen is drawn from; the cluster's own shape grids stay at
    factor 1 (they describe one cluster's shapes, not a population's)."""
    clu_t = tables[1]
    rows = [problem.clusters.index(c) for c in sorted(clusters)]
    if not rows:
        raise ValueError("a population needs at least one fitted cluster")
    grids = (F.CLUSTER_LAYER_LEAF, F.HEAD_LEAF)
    return [
        {
            leaf: jnp.zeros_like(clu_t[leaf][0]) if leaf in grids else jnp.asarray(clu_t[leaf][j])
            for leaf in F.CLUSTER_LEAVES
        }
        for j in rows
    ]


def population_row(problem: F.Problem, tables, clusters) -> dict:
    """The mean raw cluster constants of ``clusters`` (``population_members``, each counts
    once), for a cluster no fit has seen."""
    members = population_members(problem, tables, clusters)
    return {leaf: jnp.mean(jnp.stack([m[leaf] for m in members]), 0) for leaf in members[0]}


def uninformed(problem: F.Problem, tables, weights: dict, temperature: float) -> dict:
    """Per cluster leaf, ``[clusters]`` booleans: whether no weighted row of ``problem``'s
    levels other than e2e reads the cluster's constant (the weighted sum of those rows' log
    times has zero gradient there). Collectives read a cluster's network constants, never its
    host dispatch, overlap or overheads. Without rows of another level nothing reads any."""
    data = {lvl: d for lvl, d in weighted(problem, weights).data.items() if lvl != "e2e"}
    if not data:
        return {leaf: np.ones(len(problem.clusters), dtype=bool) for leaf in F.CLUSTER_LEAVES}

    def total(clu):
        logs = F.predict_log(tables[0], clu, data, temperature)
        return sum(jnp.sum(data[lvl]["weight"].astype(lp.dtype) * lp) for lvl, lp in logs.items())

    grad = jax.jit(jax.grad(total))({k: jnp.asarray(v) for k, v in tables[1].items()})
    return {
        leaf: np.all(np.asarray(grad[leaf]).reshape(len(problem.clusters), -1) == 0, axis=1)
        for leaf in F.CLUSTER_LEAVES
    }


def fill_uninformed(problem: F.Problem, tables, weights: dict, population: dict, temperature,
                    device: dict | None = None, free: dict | None = None):  # fmt: skip
    """``tables`` with ``population``'s value (``population_row``) in every constant of a
    cluster without weighted e2e rows that no weighted row of the other levels reads
    (``uninformed``, or ``free`` when given): such a cluster (one with collective measurements
    only) takes its network from its collectives and the rest from the clusters with runs, as
    a cluster without any measurement does, not from the datasheet defaults. Likewise a GPU
    family without weighted e2e rows takes ``device`` ({leaf: value}; default the mean of the
    families with them) for ``E2E_ONLY_DEVICE_LEAVES``."""
    with_runs = np.asarray(weights["e2e"]) > 0
    e2e_clusters = np.unique(np.asarray(problem.data["e2e"]["c"])[with_runs])
    no_runs = ~np.isin(np.arange(len(problem.clusters)), e2e_clusters)
    clu = dict(tables[1])
    free = uninformed(problem, tables, weights, temperature) if free is None else free
    for leaf, unread in free.items():
        take = jnp.asarray(unread & no_runs).reshape((-1,) + (1,) * (clu[leaf].ndim - 1))
        clu[leaf] = jnp.where(take, jnp.asarray(population[leaf]), clu[leaf])
    dev = dict(tables[0])
    fams = np.unique(np.asarray(problem.data["e2e"]["d"])[with_runs])
    lone = jnp.asarray(~np.isin(np.arange(len(problem.families)), fams))
    for leaf in E2E_ONLY_DEVICE_LEAVES if fams.size else ():
        value = jnp.mean(dev[leaf][fams]) if device is None else device[leaf]
        dev[leaf] = jnp.where(lone, value, dev[leaf])
    return dev, clu


def population_mixture(problem: F.Problem, tables, weights: dict, temperature) -> list:
    """The members of the population a cluster (or GPU family) without weighted e2e rows is
    drawn from, as ``[(tables, unseen cluster row)]``: once per fitted cluster
    (``population_members``) and, when some family has no e2e rows, per fitted family for
    ``E2E_ONLY_DEVICE_LEAVES``, each member standing in where ``fill_uninformed`` puts the
    mean. The mean of the members' log predictions (``Predictor.mean_log``) is the predictive
    median over the population; the plug-in of the mean constants is faster than it, since an
    iteration's time is convex in them (1 / efficiency, smooth maxima)."""
    with_runs = np.asarray(weights["e2e"]) > 0
    clusters = {problem.clusters[j] for j in np.asarray(problem.data["e2e"]["c"])[with_runs]}
    fams = np.unique(np.asarray(problem.data["e2e"]["d"])[with_runs])
    lone = len(fams) < len(problem.families)
    devices = [None]
    if lone and fams.size:
        devices = [{leaf: tables[0][leaf][i] for leaf in E2E_ONLY_DEVICE_LEAVES} for i in fams]
    free = uninformed(problem, tables, weights, temperature)
    return [
        (fill_uninformed(problem, tables, weights, m, temperature, device, free), m)
        for m in population_members(problem, tables, clusters)
        for device in devices
    ]


def map_tables(
    src: F.Problem,
    tables,
    fams: set,
    clus: set,
    target: F.Problem,
    n_fam,
    n_clu,
    unseen_cluster: dict | None = None,
):
    """Trained tables in ``target``'s family/cluster order; rows of families/clusters not in
    ``fams``/``clus`` (not trained) and padding rows up to ``n_fam``/``n_clu`` are defaults,
    or for clusters ``unseen_cluster`` (raw leaves, e.g. ``population_row``) when given."""
    dev_t, clu_t = tables
    p0 = default_params()
    fallback = unseen_cluster or {}

    def rows(names, src_names, trained, tab, leaves, n, starts):
        out = {}
        for leaf in leaves:
            d = [jnp.asarray(fallback.get(leaf, getattr(p, leaf))) for p in starts]
            r = [tab[leaf][src_names.index(x)] if x in trained else dx for x, dx in zip(names, d)]
            r += [jnp.asarray(fallback.get(leaf, getattr(p0, leaf)))] * (n - len(r))
            out[leaf] = jnp.stack(r)
        return out

    clu_starts = [p0] * len(target.clusters)
    clu = rows(target.clusters, src.clusters, clus, clu_t, F.CLUSTER_LEAVES, n_clu, clu_starts)
    clu.update({key: clu_t[key] for key in F.STACK_KEYS if key in clu_t})  # one row per stack
    fam_starts = [default_params(family=f) for f in target.families]  # FAMILY_DEFAULTS
    return rows(target.families, src.families, fams, dev_t, F.DEVICE_LEAVES, n_fam, fam_starts), clu


def target_tables(rows, src: F.Problem, tables, fams: set, clus: set, unseen_cluster=None,
                  n_fam: int | None = None, n_clu: int | None = None):  # fmt: skip
    """(problem of the e2e ``rows``, its device table, its cluster table): ``tables`` trained
    on ``src`` mapped to the rows' families and clusters (``map_tables``), padded to
    ``n_fam`` x ``n_clu`` rows when given."""
    target = F.build_problem(Measurements(e2e=list(rows)))
    n_fam = len(target.families) if n_fam is None else n_fam
    n_clu = len(target.clusters) if n_clu is None else n_clu
    dev, clu = map_tables(src, tables, fams, clus, target, n_fam, n_clu, unseen_cluster)
    return target, dev, clu


class Predictor:
    """log predicted iteration time of e2e records from mapped tables; one compile: rows are
    padded to ``chunk`` (repeating the first) and tables to ``n_fam`` x ``n_clu``."""

    def __init__(self, chunk: int, n_fam: int, n_clu: int, temperature: float):
        self.chunk, self.n_fam, self.n_clu = chunk, n_fam, n_clu
        self._fn = jax.jit(lambda dev, clu, data: F.predict_log(dev, clu, data, temperature)["e2e"])

    def __call__(
        self, rows, src: F.Problem, tables, fams: set, clus: set, unseen_cluster=None
    ) -> np.ndarray:
        return self.mean_log(rows, src, [(tables, unseen_cluster)], fams, clus)

    def mean_log(self, rows, src: F.Problem, members, fams: set, clus: set) -> np.ndarray:
        """The mean over ``members`` (``[(tables, unseen cluster row)]``, e.g.
        ``population_mixture``) of each member's log prediction of ``rows``."""
        out = []
        for s in range(0, len(rows), self.chunk):
            part = list(rows[s : s + self.chunk])
            n = len(part)
            part += [part[0]] * (self.chunk - n)
            target = F.build_problem(Measurements(e2e=part))
            logs = [
                self._fn(
                    *map_tables(src, tab, fams, clus, target, self.n_fam, self.n_clu, row),
                    target.data,
                )  # fmt: skip
                for tab, row in members
            ]
            out.append(np.mean([np.asarray(x, float) for x in logs], axis=0)[:n])
        return np.concatenate(out) if out else np.zeros(0)


def run_fit(problem, meas_train, weights, cfg, e2e_log_meas=None, init=None):
    """``calibration.fit.fit`` on ``problem`` with per-row weights, from ``init`` tables when
    given (a warm start; the prior stays centred on the defaults); (result, tables, wall s)."""
    prob = weighted(problem, weights, e2e_log_meas)
    t0 = time.perf_counter()
    res = F.fit(meas_train, cfg, progress=False, problem=prob, init=init)
    wall = time.perf_counter() - t0
    return res, tables_from_result(res, problem), wall


# --------------------------------------------------------------------------------------------
# metrics


def ape_pct(log_pred, log_meas) -> np.ndarray:
    return np.abs(np.expm1(np.asarray(log_pred, float) - np.asarray(log_meas, float))) * 100


def metrics(log_pred, log_meas) -> dict:
    log_pred, log_meas = np.asarray(log_pred, float), np.asarray(log_meas, float)
    if log_pred.size == 0:
        return {"rows": 0, "mape_pct": None, "p90_ape_pct": None, "max_ape_pct": None,
                "kendall_tau": None}  # fmt: skip
    a = ape_pct(log_pred, log_meas)
    return {
        "rows": int(a.size),
        "mape_pct": float(a.mean()),
        "p90_ape_pct": float(np.percentile(a, 90)),
        "max_ape_pct": float(a.max()),
        "kendall_tau": kendall_tau(np.exp(log_meas), np.exp(log_pred)),
    }


def by_group(keys, log_pred, log_meas, mask=None) -> dict:
    keys = np.asarray(keys)
    mask = np.ones(len(keys), bool) if mask is None else mask
    return {
        k: metrics(log_pred[mask & (keys == k)], log_meas[mask & (keys == k)])
        for k in sorted(set(keys[mask]))
    }
