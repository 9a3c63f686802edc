"""Fits whose end-to-end rows are priced on their cluster's network graph.

``calibration.fit.build_problem`` prices every e2e row on the existing path (``diffcost.comm``'s
NVLink ring-share table and the fabric's oversubscription: the row's ``ClusterArrays`` carry no
``network``). ``graph_problem`` gives each e2e row of a built problem instead the arrays of the
graph its cluster describes (``topology: cluster``, the job's ``NetworkTables`` for its GPU
count, as ``benchmarks/network_pricing.GraphPricer`` prices a held-out row), with or without
contention, so that ``fit.fit``, ``fit.make_loss`` and ``fit.predict_log`` run unchanged on it:
the constants adapt to the graph. The other levels (collectives, kernels) stay as built.

A job's tables have a grid of the divisors of its GPU count (``G`` points, ``[G * G, ...]``
rows), so rows of different GPU counts have tables of different shapes. A padded table costs its
full size in every row's step, and the gradient of the lookups (a scatter into each row's table
per lookup) is what grows: padding all 1,790 rows of the shared data to the largest grid (11
points) made the e2e gradient 11 s, against 0.59 s for the 1,609 rows of at most 4 points padded
to 4 and 0.45 s for the other 181 padded to 11 (XLA:CPU, quick compile, 2026-11-28). So the rows
are split into buckets by grid size (``GRID_BUCKETS``), each stacked with its tables padded to
its largest grid (``pad_network``) and simulated by its own ``jax.vmap``
(``bucketed_log``; one compile of the simulator per bucket). The grid goes on past a job's GPU
count in steps of ``PAD_LOG_STEP`` and the tables repeat their last row and column; a job only
looks up group sizes and strides up to its GPU count, where the bilinear lookup
(``diffcost.network.model``) reads the same corners with the same weights, so the padding changes
nothing but rounding where a size's log falls an ulp past the grid's end.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from diffcost.arrays import ClusterArrays, cluster_arrays, stack
from diffcost.network.attach import FROM_CLUSTER
from diffcost.network.tables import NetworkTables

# A row whose grid has at most this many points is padded to it, with the rows of its bucket;
# the rest to the largest grid. Chosen for the step time (the module's docstring), not accuracy
GRID_BUCKETS = (4, 8)
PAD_LOG_STEP = 1.0  # log units between padded grid points past a job's GPU count
_GRID_TABLES = ("load", "latency_s")  # the [G * G, ...] tables padding extends


def graph_key(record) -> tuple[str, int]:
    """What an e2e record's graph tables (``graph_arrays``) depend on besides contention and
    dtype: its cluster (``repr``) and GPU count; records with one key share one routing."""
    return repr(record.cluster), int(record.plan.n_gpus)


def graph_arrays(record, contention: bool = True, dtype=None) -> ClusterArrays:
    """The ``ClusterArrays`` of an e2e record's cluster on its own graph (``topology:
    cluster``) for the record's GPU count, with or without ``contention``."""
    spec = dataclasses.replace(record.cluster, topology=FROM_CLUSTER)
    arrays = cluster_arrays(spec, dtype, record.plan.n_gpus)
    return arrays.replace(network=arrays.network.replace(contention=contention))


def pad_network(tables: NetworkTables, points: int) -> NetworkTables:
    """``tables`` on a grid of ``points`` points (at least its own): the grid extended past its
    last point by ``PAD_LOG_STEP`` each, the per-cell tables repeating their last row and
    column; lookups up to the job's GPU count read what they read before.

    Raises:
        ValueError: ``points`` below the tables' grid, or per-link tables (not padded).
    """
    g = int(tables.log_grid.shape[0])
    if points < g:
        raise ValueError(f"pad_network: points={points} is below the tables' grid of {g}")
    if tables.link_load is not None:
        raise ValueError("pad_network: per-link tables (build_tables(links=True)) are not padded")
    if points == g:
        return tables
    grid = np.asarray(tables.log_grid)
    extra = grid[-1] + PAD_LOG_STEP * np.arange(1, points - g + 1)
    padded = {"log_grid": jnp.asarray(np.concatenate([grid, extra.astype(grid.dtype)]))}
    for name in _GRID_TABLES:
        t = np.asarray(getattr(tables, name))
        cells = t.reshape((g, g) + t.shape[1:])
        width = [(0, points - g), (0, points - g)] + [(0, 0)] * (t.ndim - 1)
        padded[name] = jnp.asarray(np.pad(cells, width, mode="edge").reshape((-1,) + t.shape[1:]))
    return tables.replace(**padded)


def graph_problem(problem, records, contention: bool = True, dtype=None):
    """``problem`` (a ``calibration.fit.Problem``, which this module's ``bucketed_log`` serves)
    with its e2e rows priced on their clusters' graphs: each row's cluster arrays replaced by
    ``graph_arrays`` of its record (``records``: the problem's e2e records in its order, e.g.
    the ``Measurements.e2e`` it was built from). Every other array, level and index is the
    problem's own.

    Where the rows' grids fall in more than one bucket (``GRID_BUCKETS``), the e2e level's
    ``cluster`` is a tuple of stacked arrays, one per bucket, padded to its largest grid
    (``pad_network``), and ``rows`` the tuple of their row indices (``bucketed_log``);
    otherwise one stack, padded to the largest grid.

    ``dtype``: the problem's float type (JAX's default float unless given, as
    ``build_problem``).

    Raises:
        ValueError: ``records`` is not one per e2e row of ``problem``.
    """
    if "e2e" not in problem.data:
        raise ValueError("graph_problem: the problem has no e2e rows")
    n_rows = problem.counts["e2e"]
    if len(records) != n_rows:
        raise ValueError(f"graph_problem: {len(records)} records for {n_rows} e2e rows")
    dtype = jnp.result_type(float) if dtype is None else dtype
    keys = [graph_key(r) for r in records]
    jobs: dict = {}
    for key, r in zip(keys, records):
        if key not in jobs:  # the tables are routed once per cluster and GPU count
            jobs[key] = graph_arrays(r, contention, dtype)
    points = np.array([int(jobs[k].network.log_grid.shape[0]) for k in keys])
    largest = int(points.max())
    bucket = np.array([next((b for b in GRID_BUCKETS if p <= b), largest) for p in points])
    rows, arrays = [], []
    for size in sorted(set(bucket.tolist())):
        idx = np.flatnonzero(bucket == size)
        size = int(points[idx].max())
        padded = [jobs[keys[i]] for i in idx]
        padded = [a.replace(network=pad_network(a.network, size)) for a in padded]
        rows.append(jnp.asarray(idx))
        arrays.append(_as_jax(stack(padded), dtype))
    e2e = dict(problem.data["e2e"])
    if len(arrays) == 1:
        e2e["cluster"] = arrays[0]
    else:
        e2e.update(cluster=tuple(arrays), rows=tuple(rows))
    return dataclasses.replace(problem, data={**problem.data, "e2e": e2e})


def bucketed_log(run_fn, e2e: dict, params, grid_base) -> jax.Array:
    """``[rows]`` log iteration times of e2e rows in buckets (``graph_problem``): ``run_fn``
    (``calibration.fit.predict_log``'s vmapped simulation of ``(model, plan, cluster, params,
    grid_base)``) on each bucket's rows, put back in row order."""
    out = jnp.zeros(e2e["log_meas"].shape, e2e["log_meas"].dtype)
    for idx, arrays in zip(e2e["rows"], e2e["cluster"]):
        model, plan, row_params = (_take(t, idx) for t in (e2e["model"], e2e["plan"], params))
        times = run_fn(model, plan, arrays, row_params, grid_base[idx])
        out = out.at[idx].set(jnp.log(times).astype(out.dtype))
    return out


def _take(tree, idx):
    return jax.tree_util.tree_map(lambda x: x[idx], tree)


def _as_jax(tree, dtype):
    cast = lambda x: jnp.asarray(x, dtype) if np.asarray(x).dtype.kind == "f" else jnp.asarray(x)  # noqa: E731
    return jax.tree_util.tree_map(cast, tree)
