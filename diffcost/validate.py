"""Validate predictions against measured runs (CSV in the schema of shared/data/README.md).

Blank cells mean "the source did not say". They are filled with the defaults a practitioner
would assume for that framework (``diffcost.runs.row_to_specs`` and its
``FRAMEWORK_DEFAULTS``), and every filled value is reported per row. Rows that still cannot be
represented, and rows with neither a positive measured time nor a measured peak memory, are
listed with the reason, never dropped silently or counted in the errors.

Each error figure counts the rows that have its measurement: the time figures the rows with a
positive ``measured_iter_s``, the memory figures the rows with ``measured_peak_mem_gib`` (peak
memory allocated per GPU, ``torch.cuda.max_memory_allocated``, GiB), which is compared with
``Breakdown.memory_allocated_bytes``. A row with a memory measurement and no usable time is
predicted for memory only.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import jax
import numpy as np

from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays, stack
from diffcost.params import Params
from diffcost.profiles import ProfileMismatch, params_for
from diffcost.runs import RowSkipped, read_rows, row_to_specs
from diffcost.simulate import simulate

GIB = 2.0**30


@dataclasses.dataclass
class RowResult:
    row: int  # 1-based data row
    source: str
    model: str
    cluster: str
    measured_iter_s: float | None
    predicted_iter_s: float | None = None
    ape_pct: float | None = None
    status: str | None = None
    skipped: str | None = None
    defaults: list[str] = dataclasses.field(default_factory=list)
    measured_peak_mem_gib: float | None = None
    predicted_peak_mem_gib: float | None = None
    mem_ape_pct: float | None = None


@jax.jit
def _simulate_batch(models, plans, clusters, params):
    return jax.vmap(simulate)(models, plans, clusters, params)


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Kendall's tau-b between two sequences (None with fewer than two pairs)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2:
        return None
    dx = np.sign(x[:, None] - x[None, :])
    dy = np.sign(y[:, None] - y[None, :])
    iu = np.triu_indices(len(x), 1)
    dx, dy = dx[iu], dy[iu]
    concordant = np.sum(dx * dy)
    denom = math.sqrt(np.sum(dx != 0) * np.sum(dy != 0))
    return float(concordant / denom) if denom else None


def _summary(results: list[RowResult]) -> dict:
    done = [r for r in results if r.ape_pct is not None]
    apes = [r.ape_pct for r in done]
    mem_apes = [r.mem_ape_pct for r in results if r.mem_ape_pct is not None]
    predicted = sum(r.skipped is None for r in results)
    return {
        "rows": len(results),
        "predicted": predicted,
        "skipped": len(results) - predicted,
        "mape_pct": float(np.mean(apes)) if apes else None,
        "max_ape_pct": float(np.max(apes)) if apes else None,
        "kendall_tau": kendall_tau(
            [r.measured_iter_s for r in done], [r.predicted_iter_s for r in done]
        ),
        "time_rows": len(apes),
        "mem_rows": len(mem_apes),
        "mem_mape_pct": float(np.mean(mem_apes)) if mem_apes else None,
        "mem_max_ape_pct": float(np.max(mem_apes)) if mem_apes else None,
    }


def _ape_pct(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured * 100.0


def _no_time(r: RowResult, cell: str) -> str | None:
    """Why the row's time counts in no error figure, or None for a positive time."""
    if r.measured_iter_s is None:
        return "measured_iter_s blank"
    if r.measured_iter_s <= 0:
        return f"measured_iter_s {cell} is not a positive time"
    return None


def _cluster_params(cluster, params: Params | None, profile):
    """(cluster arrays, Params, note) for a cluster's rows; (None, None, reason) when the
    profile file given was fitted on another GPU family, whose rows are then skipped."""
    if params is not None:
        return cluster_arrays(cluster), params, "parameters given by the caller"
    try:
        cparams, note = params_for(cluster, profile)
    except ProfileMismatch as e:
        return None, None, f"not predicted: {e.reason}"
    return cluster_arrays(cluster), cparams, note


def validate(path: str | os.PathLike, params: Params | None = None, profile=None) -> dict:
    """Predict every row of a measurement CSV; per-row and per-source errors.

    Returns:
        ``{"summary": {...}, "by_source": {name: {...}}, "rows": [...]}`` with the keys
        documented in the README (``rows``, ``predicted``, ``skipped``, ``mape_pct``,
        ``max_ape_pct``, ``kendall_tau`` over the ``time_rows`` with a positive measured time;
        ``mem_mape_pct``, ``mem_max_ape_pct`` over the ``mem_rows`` with a measured peak
        memory), and ``profiles``: cluster -> which calibrated layers were used. ``params``
        (one set for every row) overrides ``profile``; ``profile`` is None for each cluster's
        default calibrated profile, ``"none"`` for datasheet defaults, or a profile file. Rows
        with neither a positive ``measured_iter_s`` nor a ``measured_peak_mem_gib`` are skipped
        (their ``skipped`` says why) and count in no error figure, and so are rows on a cluster
        of another GPU family than a given profile file's. Every predicted row has
        ``predicted_peak_mem_gib``; rows with a measured peak have ``mem_ape_pct``.

    Raises:
        ValueError: the file is not a readable end-to-end CSV (see :func:`read_rows`).
    """
    rows = read_rows(path)
    results: list[RowResult] = []
    batch = []
    cache: dict = {}
    cluster_cache: dict = {}
    for i, row in enumerate(rows, start=1):
        measured, mem = row["measured_iter_s"], row.get("measured_peak_mem_gib", "")
        r = RowResult(
            row=i,
            source=row["source"],
            model=row["model"],
            cluster=row["cluster"],
            measured_iter_s=float(measured) if measured else None,
            measured_peak_mem_gib=float(mem) if mem else None,
        )
        results.append(r)
        if (why := _no_time(r, measured)) and r.measured_peak_mem_gib is None:
            r.skipped = why
            continue
        try:
            model, plan, cluster, used = row_to_specs(row, cache)
        except RowSkipped as e:
            r.skipped = str(e)
            continue
        r.defaults = used
        if cluster.name not in cluster_cache:
            cluster_cache[cluster.name] = _cluster_params(cluster, params, profile)
        carr, cparams, note = cluster_cache[cluster.name]
        if carr is None:  # the profile file is another GPU's
            r.skipped = note
            continue
        batch.append((r, model_arrays(model), plan_arrays(plan), carr, cparams))
    if batch:
        models = stack([b[1] for b in batch])
        plans = stack([b[2] for b in batch])
        clusters = stack([b[3] for b in batch])
        row_params = stack([b[4] for b in batch])
        out = jax.tree_util.tree_map(
            np.asarray, _simulate_batch(models, plans, clusters, row_params)
        )
        from diffcost.simulate import STATUS_NAMES

        for j, (r, *_rest) in enumerate(batch):
            r.predicted_iter_s = float(out.iteration_s[j])
            r.status = STATUS_NAMES[int(out.status[j])]
            if _no_time(r, "") is None:
                r.ape_pct = _ape_pct(r.predicted_iter_s, r.measured_iter_s)
            r.predicted_peak_mem_gib = float(out.memory_allocated_bytes[j]) / GIB
            if r.measured_peak_mem_gib is not None:
                r.mem_ape_pct = _ape_pct(r.predicted_peak_mem_gib, r.measured_peak_mem_gib)
    by_source: dict[str, list[RowResult]] = {}
    for r in results:
        by_source.setdefault(r.source, []).append(r)
    return {
        "summary": _summary(results),
        "by_source": {k: _summary(v) for k, v in by_source.items()},
        "rows": [dataclasses.asdict(r) for r in results],
        "profiles": {name: v[2] for name, v in cluster_cache.items() if v[0] is not None},
    }
