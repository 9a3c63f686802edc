"""Fit Params to measurements by gradient descent (optax), all levels jointly.

Levels: GEMM kernels (time per shape and precision), fused attention kernels (time per shape,
forward and backward), memory-bound transfers, collectives (time per size, group and
placement), end-to-end iterations. The loss is a robust penalty on ``log(predicted / measured)``
per level, averaged per level and weighted, plus a Gaussian prior pulling every raw (log /
logit) constant toward its datasheet default, with a width per constant (``PRIOR_SD``). The
penalty starts as Huber's and turns into Cauchy's (``FitConfig.redescend``), whose pull fades
for rows far off the fit, so a few grossly wrong measurements do not bias it.

Parameters are layered (``calibration.profiles``): device constants are one row per GPU family,
cluster constants one row per cluster; each measurement gathers its rows, so a fit on several
clusters with the same GPU shares the device constants.

References:
    Huber, "Robust Estimation of a Location Parameter" (1964); Holland and Welsch, "Robust
    regression using iteratively reweighted least-squares" (1977) for the Cauchy penalty;
    optax's ``adam`` and schedules.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from calibration import graph_path, kernel_levels
from calibration.kernel_levels import KERNEL_LEVELS
from calibration.records import COLLECTIVES, Measurements, fitted_records
from diffcost import comm, descent, kernels
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays, stack
from diffcost.cache import FAST_CPU_COMPILE, STEADY_CPU_COMPILE, fast_compile_jit
from diffcost.config import load_cluster
from diffcost.gpus import FAMILY_CLUSTER, cluster_family, gpu_family, relative_rows
from diffcost.params import CONSTANTS, GEMM_GRID_CLASSES, Params, default_params
from diffcost.profiles import (
    CLUSTER_FIELDS,
    CLUSTER_LAYER_FIELD,
    DEVICE_FIELDS,
    FIELDS,
    GRID_FIELD,
    HEAD_FIELD,
    LAYER_FIELD,
    to_values,
)
from diffcost.simulate import simulate
from diffcost.specs import PRECISIONS
from diffcost.stacks import STACK_EFFECTS, STACK_NAMES
from diffcost.workload import LOW_PRECISIONS

# Width of the prior around each datasheet default, in raw units (``Constant.prior_sd``).
PRIOR_SD = {c.name: c.prior_sd for c in CONSTANTS}
PRIOR_SD_LEAF = {FIELDS[f][0]: sd for f, sd in PRIOR_SD.items()}
# Software stack offsets (``diffcost.stacks``) ride in the cluster table under these keys, one
# entry per stack of ``STACK_NAMES``; an e2e row of an unknown stack reads offset 0.
STACK_KEYS = {f"stack/{e.leaf}": e for e in STACK_EFFECTS}
PRIOR_SD_LEAF.update({key: e.prior_sd for key, e in STACK_KEYS.items()})


@dataclasses.dataclass(frozen=True)
class FitConfig:
    steps: int = 1200
    learning_rate: float = 0.1
    huber_delta: float = 0.2  # in log space: ~20% errors are quadratic, larger ones linear
    # Huber's pull is capped but never fades: 10% of rows 3x too slow (the robustness check of
    # benchmarks/calibration_cv.py) still shift every shared constant. Between these fractions
    # of ``steps`` the penalty turns linearly into Cauchy's with the same scale,
    # ``delta^2 / 2 log(1 + (r / delta)^2)``: quadratic near 0, its pull r / (1 + (r / delta)^2)
    # falls as 1 / r beyond delta (a 3x row pulls 0.035 instead of Huber's 0.2). Starting from
    # Huber keeps the early steps, far from the fit, convex.
    redescend: tuple[float, float] = (0.3, 0.6)
    prior_weight: float = 1e-5  # per constant: squared distance from the default / PRIOR_SD^2
    weights: tuple[float, float, float] = (1.0, 1.0, 1.0)  # e2e, collectives, gemm
    attention_weight: float = 1.0  # the attention kernel level
    memory_weight: float = 1.0  # the memory-bound transfer level
    tol: float = 1e-7  # stop when the loss improves less than this over `patience` steps
    patience: int = 100
    temperature: float = 1e-3
    # A level's error is averaged over its rows, so without this 5 measured iterations would
    # pull as hard against the prior as 1,790: below ``full_rows`` rows a level's weight
    # shrinks in proportion, and a handful of rows refine the starting profile instead of
    # overwriting it. Every level of the shared data has more rows (so do the CV folds), so
    # the shipped profiles and the CV figures do not depend on it. 100 was picked from 300
    # and 100 by benchmarks/small_data.py (random vTrain subsets): 300 protected 5-row fits
    # about as well and cost 30-row fits 0.2-0.4 points of held-out MAPE.
    full_rows: int = 100
    # A cluster's own layer and LM head shape grids (on top of its GPU's) are fitted only for
    # clusters with at least this many e2e rows; with fewer they stay at their start.
    cluster_grid_rows: int = 300
    # Whether the device layer shape grid (one per GPU family, shared by every cluster and
    # software stack with that GPU) is fitted; when False it stays at factor 1 and only the
    # clusters' own layer grids describe per-shape offsets. Off: nodes fitted to one source's
    # layers moved other stacks' predictions on the same GPU. Leaving one source out
    # (benchmarks/transfer.py --sources-only --no-few-shot, 2026-11-25) gave a mean MAPE of
    # 10.0% without it against 11.4% with it, and a largest bias of -10.0% against -16.2%
    # (chosen on the data the benchmark reports).
    device_layer_grid: bool = False
    # Whether per-stack offsets (diffcost.stacks) are fitted; when False they stay 0.
    stacks: bool = True
    # Whether a family's device prior is centred on its relative's fitted constants
    # (``family_parents``) rather than on the datasheet defaults.
    family_parents: bool = True


@dataclasses.dataclass
class FitResult:
    device_values: dict[str, dict]  # family -> constrained device constants
    cluster_values: dict[str, dict]  # cluster -> constrained cluster constants
    params_by_cluster: dict[str, Params]
    losses: list[float]
    steps: int
    seconds: float
    converged: bool
    residuals: dict[str, np.ndarray]  # level -> log(pred / meas) at the end
    initial_residuals: dict[str, np.ndarray]  # the same at the starting constants
    # stack -> {constant name: raw offset} of the stacks some weighted e2e row runs
    stack_values: dict[str, dict] = dataclasses.field(default_factory=dict)
    tables: tuple | None = None  # the final raw (device, cluster) tables, problem order


def _leaves(fields):
    return [FIELDS[f][0] for f in fields]


DEVICE_LEAVES = _leaves(DEVICE_FIELDS)
CLUSTER_LEAVES = _leaves(CLUSTER_FIELDS)


def assemble(dev_tab: dict, clu_tab: dict, d_idx, c_idx, s_idx=None) -> Params:
    """Per-row Params: device leaves from row ``d_idx`` of ``dev_tab``, cluster leaves from
    ``c_idx`` of ``clu_tab`` (index arrays give a batched Params), plus the offsets of stack
    ``s_idx`` where given (-1: an unknown stack, no offset)."""
    kw = {leaf: dev_tab[leaf][d_idx] for leaf in DEVICE_LEAVES}
    kw.update({leaf: clu_tab[leaf][c_idx] for leaf in CLUSTER_LEAVES})
    if s_idx is not None and STACK_KEYS.keys() <= clu_tab.keys():
        known = s_idx >= 0
        for key, effect in STACK_KEYS.items():
            off = jnp.where(known, clu_tab[key][jnp.maximum(s_idx, 0)], 0.0)
            base = kw[effect.leaf]
            kw[effect.leaf] = base + off.reshape(off.shape + (1,) * (base.ndim - off.ndim))
    return Params(**kw)


def _collective_time(kind, size, group_size, per_node, cluster, params, temperature):
    stride = cluster.gpus_per_node / per_node
    group = comm.place(group_size, stride, cluster.gpus_per_node)
    inter = jnp.where(per_node < group_size, 1.0, 0.0)  # send/recv crosses nodes?
    times = jnp.stack(
        [
            comm.all_reduce_s(size, group, cluster, params, temperature),
            comm.all_gather_s(size, group, cluster, params, temperature),
            comm.reduce_scatter_s(size, group, cluster, params, temperature),
            comm.all_to_all_s(size, group, cluster, params, temperature),
            comm.send_recv_s(size, inter, cluster, params),
        ]
    )
    return jnp.sum(kind * times)


@dataclasses.dataclass
class Problem:
    """Measurements as arrays plus the index of every device and cluster row."""

    families: list[str]
    clusters: list[str]
    data: dict  # level -> dict of arrays (pytrees)
    counts: dict  # level -> rows


def _octave_weights(colls) -> np.ndarray:
    """Equal total weight per (cluster, collective, group, size octave): tables sampled every
    1 MiB up to 1 GiB would otherwise drown the small messages that layers actually send."""
    keys = [
        (r.cluster, r.collective, r.group_size, int(np.log2(max(r.size_bytes, 1.0)))) for r in colls
    ]
    counts: dict = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    return np.array([1.0 / counts[k] for k in keys])


def build_problem(meas: Measurements, dtype=None) -> Problem:
    """Arrays of every measurement that maps to a known cluster (or GPU family).

    ``dtype``: JAX's default float unless given (float32, or float64 under x64). Kernel rows
    of a GPU family without a preset to time them on are left out with a ``UserWarning``
    naming them (``records.placed_kernels`` lists them in ``skipped`` instead).
    """
    dtype = jnp.result_type(float) if dtype is None else dtype
    meas = fitted_records(meas, warn=True)
    families: list[str] = []
    clusters: list[str] = []
    cluster_cache: dict = {}

    def cl(name):
        if name not in cluster_cache:
            spec = load_cluster(name)
            cluster_cache[name] = (spec, cluster_arrays(spec, dtype))
        return cluster_cache[name]

    def idx(lst, key):
        if key not in lst:
            lst.append(key)
        return lst.index(key)

    data, counts = {}, {}
    if meas.e2e:
        rows = meas.e2e
        per_source = collections.Counter(r.source_name for r in rows)
        data["e2e"] = {
            "model": stack([model_arrays(r.model, dtype) for r in rows]),
            "plan": stack([plan_arrays(r.plan, dtype) for r in rows]),
            "cluster": stack([cluster_arrays(r.cluster, dtype) for r in rows]),
            "d": np.array([idx(families, gpu_family(r.cluster.gpu.name)) for r in rows]),
            "c": np.array([idx(clusters, r.cluster.name) for r in rows]),
            "s": np.array([STACK_NAMES.index(r.stack) if r.stack else -1 for r in rows]),
            "log_meas": np.log(np.array([r.measured_iter_s for r in rows], dtype=float)),
            # every source weighs the same: 1,440 vTrain rows would otherwise decide alone
            "weight": np.array([1.0 / per_source[r.source_name] for r in rows]),
        }
    colls = meas.collectives
    if colls:
        specs = [cl(r.cluster) for r in colls]
        data["coll"] = {
            "kind": np.eye(len(COLLECTIVES))[[COLLECTIVES.index(r.collective) for r in colls]],
            "size": np.array([r.size_bytes for r in colls], dtype=float),
            "n": np.array([r.group_size for r in colls], dtype=float),
            "per_node": np.array([r.per_node for r in colls], dtype=float),
            "cluster": stack([s[1] for s in specs]),
            "d": np.array([idx(families, gpu_family(s[0].gpu.name)) for s in specs]),
            "c": np.array([idx(clusters, r.cluster) for r in colls]),
            "log_meas": np.log(np.array([r.time_s for r in colls], dtype=float)),
            "weight": _octave_weights(colls),
        }
    gemms = meas.gemms
    if gemms:
        specs = [cl(FAMILY_CLUSTER[g.gpu]) for g in gemms]
        data["gemm"] = {
            "m": np.array([g.batch * g.m for g in gemms], dtype=float),
            "n": np.array([g.n for g in gemms], dtype=float),
            "k": np.array([g.k for g in gemms], dtype=float),
            "precision": np.eye(len(PRECISIONS))[[PRECISIONS.index(g.precision) for g in gemms]],
            "sustained": np.array([g.sustained for g in gemms], dtype=float),
            "cluster": stack([s[1] for s in specs]),
            "d": np.array([idx(families, g.gpu) for g in gemms]),
            "c": np.array([idx(clusters, FAMILY_CLUSTER[g.gpu]) for g in gemms]),
            # the shape grid each row reads: its family's, of its precision class
            "grid": np.array(
                [
                    idx(families, g.gpu) * len(GEMM_GRID_CLASSES)
                    + GEMM_GRID_CLASSES.index("low" if g.precision in LOW_PRECISIONS else "high")
                    for g in gemms
                ]
            ),
            "log_meas": np.log(np.array([g.time_s for g in gemms], dtype=float)),
        }
    data.update(kernel_levels.build(meas, families, clusters, cl, idx))
    cast = lambda x: jnp.asarray(x, dtype) if np.asarray(x).dtype.kind == "f" else jnp.asarray(x)  # noqa: E731
    data = jax.tree_util.tree_map(cast, data)
    counts = {k: int(v["log_meas"].shape[0]) for k, v in data.items()}
    return Problem(families=families, clusters=clusters, data=data, counts=counts)


GRID_LEAF = FIELDS[GRID_FIELD][0]  # the GEMM shape grid's raw leaf
LAYER_LEAF = FIELDS[LAYER_FIELD][0]  # the layer shape grid's raw leaf
CLUSTER_LAYER_LEAF = FIELDS[CLUSTER_LAYER_FIELD][0]  # the cluster's own layer grid
HEAD_LEAF = FIELDS[HEAD_FIELD][0]  # the LM head shape grid's raw leaf


def _shared_grid(dev_tab, clu_tab, d):
    """The shape grids of every family as one table ``[families * classes, G, G, G]`` (row
    ``family * classes + class``), and the rows' Params without a grid of their own: each row
    reads its grid in place. A copy of the grid per row (thousands of rows) and the scatter of
    its gradient back tripled the step time."""
    table = dev_tab[GRID_LEAF]  # [families, classes, G, G, G]
    unread = jnp.zeros((table.shape[0], 1))
    params = assemble({**dev_tab, GRID_LEAF: unread}, clu_tab, d["d"], d["c"], d.get("s"))
    return table.reshape((-1,) + table.shape[2:]), params


def predict_log(dev_tab, clu_tab, data, temperature):
    """log of predicted times per level (dict level -> array)."""
    out = {}
    if "e2e" in data:
        d = data["e2e"]
        flat, params = _shared_grid(dev_tab, clu_tab, d)
        base = d["d"] * len(GEMM_GRID_CLASSES)  # the row of the family's first class
        run = jax.vmap(
            lambda m, p, c, pr, b: simulate(m, p, c, pr, temperature, (flat, b)).iteration_s
        )
        if isinstance(d["cluster"], tuple):  # rows on graphs of several table shapes
            out["e2e"] = graph_path.bucketed_log(run, d, params, base)
        else:
            out["e2e"] = jnp.log(run(d["model"], d["plan"], d["cluster"], params, base))
    if "coll" in data:
        d = data["coll"]
        params = assemble(dev_tab, clu_tab, d["d"], d["c"])
        run = jax.vmap(lambda *a: _collective_time(*a, temperature))
        out["coll"] = jnp.log(
            run(d["kind"], d["size"], d["n"], d["per_node"], d["cluster"], params)
        )
    if "gemm" in data:
        d = data["gemm"]
        flat, params = _shared_grid(dev_tab, clu_tab, d)
        log_eff = kernels.shape_log_eff(flat, d["m"], d["n"], d["k"], row=d["grid"])
        run = jax.vmap(lambda *a: kernel_levels.gemm_time(*a, temperature))
        args = (d["m"], d["n"], d["k"], d["precision"], d["sustained"], d["cluster"])
        out["gemm"] = jnp.log(run(*args, params, log_eff))
    for level in KERNEL_LEVELS:
        if level in data:
            d = data[level]
            params = assemble(dev_tab, clu_tab, d["d"], d["c"])
            out[level] = kernel_levels.predict_log(level, d, params, temperature)
    return out


def initial_tables(problem: Problem, dtype=None, start: dict[str, Params] | None = None):
    """Every device and cluster row at its starting constants: the datasheet defaults (a
    family's device row with its ``FAMILY_DEFAULTS``), or ``start[cluster]`` (e.g. the
    cluster's calibrated profile) for the clusters it names; a family's device row starts from
    its first such cluster."""
    p0 = default_params(dtype)
    start = start or {}
    by_cluster = [start.get(name, p0) for name in problem.clusters]
    by_family = []
    for fam in problem.families:
        same = [
            start[name]
            for name in problem.clusters
            if name in start and cluster_family(name) == fam
        ]
        by_family.append(same[0] if same else default_params(dtype, fam))

    def rows(params_list, leaves):
        params_list = params_list or [p0]
        return {
            leaf: jnp.stack(
                [jnp.asarray(getattr(p, leaf), p0.gemm_eff_logit.dtype) for p in params_list]
            )
            for leaf in leaves
        }

    clu = rows(by_cluster, CLUSTER_LEAVES)
    dtype = clu[CLUSTER_LEAVES[0]].dtype
    clu.update({key: jnp.zeros(len(STACK_NAMES), dtype) for key in STACK_KEYS})
    return rows(by_family, DEVICE_LEAVES), clu


def _freeze_small_cluster_grids(clu: dict, e2e: dict, min_rows: int) -> dict:
    """``clu`` with the cluster layer and head grids of clusters with fewer than ``min_rows``
    e2e rows (of positive weight) held fixed (no gradient)."""
    w = e2e.get("weight", jnp.ones_like(e2e["log_meas"]))
    n = jnp.zeros(clu[CLUSTER_LAYER_LEAF].shape[0]).at[e2e["c"]].add((w > 0).astype(float))
    free = (n >= min_rows)[:, None, None, None]
    held = lambda x: jnp.where(free, x, jax.lax.stop_gradient(x))  # noqa: E731
    return {**clu, **{k: held(clu[k]) for k in (CLUSTER_LAYER_LEAF, HEAD_LEAF)}}


def robust_penalty(resid, delta: float, redescend):
    """Huber's penalty (``redescend`` 0) blended into Cauchy's (1), both with scale ``delta``."""
    huber = optax.huber_loss(resid, delta=delta)
    cauchy = 0.5 * delta**2 * jnp.log1p(jnp.square(resid / delta))
    return (1.0 - redescend) * huber + redescend * cauchy


def redescend_at(cfg: FitConfig, step: int) -> float:
    """The Huber-to-Cauchy blend of ``step``: 0 before ``cfg.redescend[0]``, 1 after [1]."""
    lo, hi = (f * cfg.steps for f in cfg.redescend)
    return float(np.clip((step - lo) / max(hi - lo, 1e-9), 0.0, 1.0))


def family_parents(families, start=None, enabled=True) -> tuple[np.ndarray, np.ndarray]:
    """(``gpus.relative_rows`` of ``families``, whether each has a relative there). The device
    prior of a family with one is centred on the relative's fitted constants (held fixed in
    that term) rather than on the datasheet defaults: Adam's steps do not scale with the
    gradient, so the weak prior moves a constant no data inform to the relative's. Not for a
    fit that starts from profiles (``diffcost calibrate``: its prior stays on them), nor when
    not ``enabled`` (``FitConfig.family_parents``)."""
    rows = np.arange(len(families)) if start or not enabled else relative_rows(families)
    return rows, rows != np.arange(len(families))


def make_loss(
    problem: Problem,
    cfg: FitConfig,
    dtype=None,
    with_logs: bool = False,
    start: dict[str, Params] | None = None,
) -> Callable:
    """``loss(tables, data, redescend=1.0)``: the weighted robust penalty of every level
    (``robust_penalty``; by default the final, Cauchy one) plus the prior (centred on the
    starting constants, ``initial_tables``); with ``with_logs`` it returns
    ``(loss, {level: log predicted time})``."""
    dev0, clu0 = initial_tables(problem, dtype, start)
    level_w = dict(zip(("e2e", "coll", "gemm"), cfg.weights))
    level_w.update(attn=cfg.attention_weight, mem=cfg.memory_weight)
    parent, has_parent = family_parents(problem.families, start, cfg.family_parents)
    measured = np.zeros(len(problem.families), dtype=bool)
    if "attn" in problem.data:
        measured[np.unique(np.asarray(problem.data["attn"]["d"]))] = True

    def loss_fn(tables, data, redescend=1.0):
        dev, clu = tables
        dev = kernel_levels.freeze_unmeasured_attention(dev, measured)
        if "e2e" in data:
            clu = _freeze_small_cluster_grids(clu, data["e2e"], cfg.cluster_grid_rows)
        if not cfg.device_layer_grid:
            dev = {**dev, LAYER_LEAF: jax.lax.stop_gradient(dev[LAYER_LEAF])}
        if not cfg.stacks:
            clu = {k: jax.lax.stop_gradient(v) if k in STACK_KEYS else v for k, v in clu.items()}
        logs = predict_log(dev, clu, data, cfg.temperature)
        total = 0.0
        for level, lp in logs.items():
            resid = lp - data[level]["log_meas"]
            w = data[level].get("weight", jnp.ones_like(resid))
            # a level with few rows weighs less against the prior (see FitConfig.full_rows)
            share = jnp.minimum(1.0, jnp.sum(w > 0) / cfg.full_rows)
            total = total + level_w[level] * share * jnp.sum(
                w * robust_penalty(resid, cfg.huber_delta, redescend)
            ) / jnp.sum(w)
        centre = {k: jnp.where(has_parent.reshape((-1,) + (1,) * (v.ndim - 1)),
                               jax.lax.stop_gradient(dev[k][parent]), v)
                  for k, v in dev0.items()}  # fmt: skip
        prior = sum(
            jnp.sum(jnp.square((tab[k] - tab0[k]) / PRIOR_SD_LEAF[k]))
            for tab, tab0 in ((dev, centre), (clu, clu0))
            for k in tab
        )
        loss = total + cfg.prior_weight * prior
        return (loss, logs) if with_logs else loss

    return loss_fn


def prior_curvature(problem: Problem, cfg: FitConfig, dtype=None):
    """The prior's Hessian, which is diagonal: tables shaped like ``initial_tables`` holding
    ``2 prior_weight / PRIOR_SD^2`` per raw constant."""
    dev0, clu0 = initial_tables(problem, dtype)
    return tuple(
        {k: jnp.full_like(v, 2.0 * cfg.prior_weight / PRIOR_SD_LEAF[k] ** 2) for k, v in t.items()}
        for t in (dev0, clu0)
    )


# Steps x e2e rows from which ``STEADY_CPU_COMPILE`` pays: ~25 s more compiling, ~0.2 ms saved
# per row and step (0.49 -> 0.12 s a step at 1,790 rows); a 1,200-step fit of them: 2.15 million.
STEADY_ROW_STEPS = 120_000


def make_step(problem: Problem, cfg: FitConfig, start: dict[str, Params] | None = None):
    """(step, optimizer): one jit-compiled Adam step ``(tables, state, data, redescend=1.0) ->
    (tables, state, loss, logs)`` on ``problem``'s loss, where ``logs`` are the log predicted
    times per level at the tables passed in and ``redescend`` the Huber-to-Cauchy blend
    (``redescend_at``; a traced scalar, so changing it does not recompile). On the CPU, with
    ``STEADY_CPU_COMPILE`` from ``STEADY_ROW_STEPS`` on, else ``FAST_CPU_COMPILE``."""
    loss_fn = make_loss(problem, cfg, with_logs=True, start=start)
    opt = descent.adam(cfg.learning_rate, cfg.steps)
    row_steps = cfg.steps * problem.counts.get("e2e", 0)
    options = STEADY_CPU_COMPILE if row_steps >= STEADY_ROW_STEPS else FAST_CPU_COMPILE
    jitted = fast_compile_jit(descent.make_step(loss_fn, opt, has_aux=True), options)

    def call(tables, state, data, redescend=1.0):
        return jitted(tables, state, data, np.float32(redescend))

    call.fast, call.plain = jitted.fast, jitted.plain
    return call, opt


def fit(
    meas: Measurements,
    cfg: FitConfig = FitConfig(),
    progress: bool = True,
    problem: Problem | None = None,
    start: dict[str, Params] | None = None,
    init: tuple[dict, dict] | None = None,
) -> FitResult:
    """Fit device and cluster constants to ``meas``; returns the fitted values and residuals.

    ``start``: cluster name -> the Params its rows start from and its prior is centred on
    (default: the datasheet defaults), so a fit on data about one level refines a calibrated
    profile instead of resetting what the data do not cover. ``init``: raw (device, cluster)
    tables in ``problem``'s order to start the descent from instead (a warm start that leaves
    the prior where ``start`` puts it).
    """
    # optax's schedules mix integer step counts and floats: standard promotion while fitting
    with jax.numpy_dtype_promotion("standard"):
        return _fit(meas, cfg, progress, problem, start, init)


def _fit(meas, cfg, progress, problem, start, init) -> FitResult:
    problem = build_problem(meas) if problem is None else problem
    if not problem.data:
        raise ValueError("no usable measurements: nothing maps to a known cluster or GPU family")
    tables = initial_tables(problem, start=start) if init is None else init
    step, opt = make_step(problem, cfg, start)
    state = opt.init(tables)
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = _progress(cfg.steps) if progress else None
    converged = False
    initial_logs = None
    final_blend = redescend_at(cfg, cfg.steps)
    for i in range(cfg.steps):
        tables, state, loss, logs = step(tables, state, problem.data, redescend_at(cfg, i))
        if initial_logs is None:
            initial_logs = logs
        losses.append(float(loss))
        if bar is not None and (i % 10 == 0 or i == cfg.steps - 1):
            bar.update(i + 1, losses[-1])
        # the loss changes meaning while the penalty turns: no convergence before it is done
        settled = i >= cfg.patience and redescend_at(cfg, i - cfg.patience) == final_blend
        if settled and losses[i - cfg.patience] - losses[i] < cfg.tol:
            converged = True
            break
    if bar is not None:
        bar.close()
    # One more call of the compiled step gives the predictions at the final tables (its update
    # is dropped): an eager ``predict_log`` would dispatch the vmapped simulator op by op.
    _, _, _, logs = step(tables, state, problem.data)
    seconds = time.perf_counter() - t0
    initial = initial_logs if initial_logs is not None else logs
    return result_from_tables(problem, tables, logs, initial, losses, seconds, converged)


def result_from_tables(problem, tables, logs, initial_logs, losses, seconds, converged):
    """The ``FitResult`` of raw ``tables`` (problem order) whose log predictions per level are
    ``logs`` (``initial_logs`` at the start)."""
    dev, clu = tables

    def resid(level_logs):
        return {k: np.asarray(v - problem.data[k]["log_meas"]) for k, v in level_logs.items()}

    p0 = default_params()
    device_values, cluster_values, by_cluster = {}, {}, {}
    for i, fam in enumerate(problem.families):
        pr = p0.replace(**{leaf: dev[leaf][i] for leaf in DEVICE_LEAVES})
        device_values[fam] = to_values(pr, DEVICE_FIELDS)
    for j, name in enumerate(problem.clusters):
        fam = cluster_family(name)
        i = problem.families.index(fam) if fam in problem.families else 0
        by_cluster[name] = assemble(dev, clu, i, j)
        cluster_values[name] = to_values(by_cluster[name], CLUSTER_FIELDS)
    return FitResult(device_values, cluster_values, by_cluster, losses, len(losses), seconds,
                     converged, resid(logs), resid(initial_logs), _stack_values(clu, problem),
                     tables)  # fmt: skip


def _stack_values(clu: dict, problem: Problem) -> dict:
    """{stack: {constant: raw offset}} of the stacks some e2e row of ``problem`` runs."""
    e2e = problem.data.get("e2e", {})
    used = sorted({int(s) for s in np.asarray(e2e.get("s", [])) if s >= 0})
    return {
        STACK_NAMES[i]: {e.name: float(clu[key][i]) for key, e in STACK_KEYS.items()} for i in used
    }


class _progress:
    """A small rich progress bar (steps and loss); silent when not on a terminal."""

    def __init__(self, total):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._p = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[loss]}"),
            TimeElapsedColumn(),
            transient=True,
        )
        # the first step compiles the whole fit (tens of seconds) before any loss exists
        self._task = self._p.add_task("compiling the fit step", total=total, loss="")
        self._p.start()

    def update(self, done, loss):
        self._p.update(
            self._task, completed=done, loss=f"loss {loss:.4g}", description="calibrating"
        )

    def close(self):
        self._p.stop()
