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
from diffcost.population import median_breakdown, median_jacobian, median_note
from diffcost.profiles import ProfileMismatch, params_for, population_members, uncertainty_for
from diffcost.runs import RowSkipped, read_rows, row_to_specs
from diffcost.simulate import STATUS_NAMES
from diffcost.stacks import stack_of
from diffcost.uncertainty import log_time_jacobians, spread

GIB = 2.0**30


@dataclasses.dataclass
class RowResult:
    row: int  # 1-based data row
    source: str
    model: str
    cluster: str
    measured_iter_s: float | None
    predicted_iter_s: float | None = None
    predicted_iter_s_low: float | None = None  # the 80% interval (diffcost.uncertainty)
    predicted_iter_s_high: float | None = None
    ape_pct: float | None = None
    status: str | None = None
    skipped: str | None = None
    defaults: list[str] = dataclasses.field(default_factory=list)
    measured_peak_mem_gib: float | None = None
    predicted_peak_mem_gib: float | None = None
    mem_ape_pct: float | None = None


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


def interval_stats(results: list[RowResult]) -> dict:
    """``coverage_pct`` (share of the rows with an interval whose measurement lies inside it)
    and ``median_width_pct`` (median of ``(high - low) / predicted``, %); None without rows."""
    rows = [r for r in results if r.predicted_iter_s_low is not None and r.ape_pct is not None]
    if not rows:
        return {"coverage_pct": None, "median_width_pct": None}
    inside = [r.predicted_iter_s_low <= r.measured_iter_s <= r.predicted_iter_s_high for r in rows]
    widths = [(r.predicted_iter_s_high - r.predicted_iter_s_low) / r.predicted_iter_s for r in rows]
    return {
        "coverage_pct": 100.0 * float(np.mean(inside)),
        "median_width_pct": 100.0 * float(np.median(widths)),
    }


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
        **interval_stats(done),
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


def _cluster_params(cluster, params: Params | None, profile, software: str | None):
    """(cluster arrays, [Params], note, Uncertainty or None) for a cluster's rows of one
    software stack: one Params, or for a cluster without a profile of its own each member of
    the population (``profiles.population_members``); (None, None, reason, None) when the
    profile file given was fitted on another GPU family, whose rows are then skipped. Params
    given by the caller have no posterior: no interval."""
    if params is not None:
        return cluster_arrays(cluster), [params], "parameters given by the caller", None
    try:
        cparams, note = params_for(cluster, profile, stack=software)
    except ProfileMismatch as e:
        return None, None, f"not predicted: {e.reason}", None
    members = population_members(cluster, profile, stack=software)
    if members:
        note += f"; {median_note(len(members))}"
    return cluster_arrays(cluster), members or [cparams], note, uncertainty_for(cluster, profile)


def _predict_batch(batch: list) -> None:
    """Predict ``batch`` ((RowResult, model, plan, cluster arrays, Params, Uncertainty, stack)
    per row and member: a row on a cluster without a profile comes once per member of the
    population) in one vmapped call, filling each row's prediction (its members' median,
    ``diffcost.population``; one member's is its own), interval, peak memory and errors."""
    stacked = [stack([b[k] for b in batch]) for k in range(1, 5)]
    out, jac = jax.tree_util.tree_map(np.asarray, log_time_jacobians(*stacked))
    entries: dict = {}  # id(row) -> its entries' indices in the batch
    for j, b in enumerate(batch):
        entries.setdefault(id(b[0]), []).append(j)
    for js in entries.values():
        r, *_rest, unc, run_stack = batch[js[0]]
        row = jax.tree_util.tree_map(lambda x, js=js: x[js], out)
        row = median_breakdown(row) if len(js) > 1 else jax.tree_util.tree_map(lambda x: x[0], row)
        pred = float(row.iteration_s)
        r.predicted_iter_s = pred
        r.status = STATUS_NAMES[int(row.status)]
        if _no_time(r, "") is None:
            r.ape_pct = _ape_pct(pred, r.measured_iter_s)
        r.predicted_peak_mem_gib = float(row.memory_allocated_bytes) / GIB
        if r.measured_peak_mem_gib is not None:
            r.mem_ape_pct = _ape_pct(r.predicted_peak_mem_gib, r.measured_peak_mem_gib)
        if unc is not None:
            s = spread(median_jacobian(jac[js]), unc, unc.stack_seen(run_stack))
            r.predicted_iter_s_low, r.predicted_iter_s_high = s.interval(pred)


def validate(path: str | os.PathLike, params: Params | None = None, profile=None) -> dict:
    """Predict every row of a measurement CSV; per-row and per-source errors.

    Returns:
        ``{"summary": {...}, "by_source": {name: {...}}, "rows": [...]}`` with the keys
        documented in the README (``rows``, ``predicted``, ``skipped``, ``mape_pct``,
        ``max_ape_pct``, ``kendall_tau`` over the ``time_rows`` with a positive measured time;
        ``coverage_pct`` and ``median_width_pct`` of those rows' 80% intervals,
        ``interval_stats``; ``mem_mape_pct``, ``mem_max_ape_pct`` over the ``mem_rows`` with
        a measured peak memory), and ``profiles``: cluster (and software stack, from the
        row's ``framework``: ``diffcost.stacks``) -> which calibrated layers were used.
        ``params`` (one set for every row) overrides ``profile``; ``profile`` is None for
        each cluster's default calibrated profile, ``"none"`` for datasheet defaults, or a
        profile file. Rows with neither a positive ``measured_iter_s`` nor a
        ``measured_peak_mem_gib`` are skipped (their ``skipped`` says why) and count in no
        error figure, and so are rows on a cluster of another GPU family than a given profile
        file's. Every predicted row has ``predicted_peak_mem_gib`` (rows with a measured peak
        ``mem_ape_pct``) and its 80% interval (``predicted_iter_s_low``,
        ``predicted_iter_s_high``; ``diffcost.uncertainty``, with the stack spread when the
        row's stack has no runs in its profile's fit), except with ``params`` (no posterior:
        None).

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
        run_stack = stack_of(row.get("framework"))
        key = cluster.name if run_stack is None else f"{cluster.name} / {run_stack}"
        if key not in cluster_cache:
            cluster_cache[key] = _cluster_params(cluster, params, profile, run_stack)
        carr, cparams, note, unc = cluster_cache[key]
        if carr is None:  # the profile file is another GPU's
            r.skipped = note
            continue
        marr, parr = model_arrays(model), plan_arrays(plan)
        batch += [(r, marr, parr, carr, p, unc, run_stack) for p in cparams]
    if batch:
        _predict_batch(batch)
    by_source: dict[str, list[RowResult]] = {}
    for r in results:
        by_source.setdefault(r.source, []).append(r)
    return {
        "summary": _summary(results),
        "by_source": {k: _summary(v) for k, v in by_source.items()},
        "rows": [dataclasses.asdict(r) for r in results],
        "profiles": {name: v[2] for name, v in cluster_cache.items() if v[0] is not None},
    }
