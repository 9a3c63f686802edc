"""Held-out rows priced on the network graph: what ``transfer_network.py`` and
``calibration_cv_network.py`` share.

A fold's fitted constants price each held-out e2e row three ways (``PATHS``), one row at a time
through ``calibration.fit.predict_log`` with only the row's cluster arrays changed:

* ``comm``: the existing path (``diffcost.comm``'s NVLink ring-share table and the fabric's
  oversubscription), as the benchmark that made the fit prices it;
* ``graph``: the network path on the graph the row's cluster describes (``topology: cluster``,
  the job's ``NetworkTables`` for its GPU count, as ``benchmarks/topology_e2e.py`` builds them),
  without contention between concurrent collectives;
* ``graph_contention``: the same graph with contention.

The figures of a group of rows: per path ``path_metrics``, the rows that moved between the
existing path and the graph with contention (``moved_rows``), and how far the existing path is
from the benchmark's own prediction (``max_rel_diff``, flagged above ``CHECK_RTOL``).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import jax
import numpy as np
from cv_report import clean_json, fmt
from transfer import group_metrics

from calibration import fit as F
from calibration import graph_path
from calibration.graph_path import graph_problem
from calibration.heldout import fresh_compilation_cache, target_tables
from diffcost.cache import fast_compile_jit

PATHS = ("comm", "graph", "graph_contention")
# The existing path priced row by row against the benchmark's batched prediction (float32): a
# larger relative difference on a row means the rows did not read the fold's constants as the
# benchmark does, and the group is flagged
CHECK_RTOL = 1e-5
MOVED_RTOL = 1e-4  # a row whose price moved by more than this between the paths counts as moved
NOTE = ("fitted on the existing path, held-out rows priced on the graph; the network path's "
        "own constants at their defaults")  # fmt: skip
# --fit-path: the path a benchmark's fold fits price their e2e rows on (graph: with contention,
# ``calibration.graph_path``) -> the path of ``PATHS`` that prices as the fit did, and the note
FIT_PATHS = {"comm": "comm", "graph": "graph_contention"}
FIT_NOTES = {
    "comm": NOTE,
    "graph": "fitted on the graph with contention (calibration.graph_path), held-out rows "
    "priced on every path; the network path's own constants at their defaults",
}


def fit_on(problem: F.Problem, records, fit_path: str) -> F.Problem:
    """``problem`` as the fits of ``--fit-path fit_path`` see it: itself (``comm``), or with
    its e2e rows (``records``, in its order) on their clusters' graphs with contention."""
    return problem if fit_path == "comm" else graph_problem(problem, records, contention=True)


class GraphPricer:
    """Iteration log times of e2e rows, one row per call, with the cluster arrays of a path.

    The row goes through ``calibration.fit.predict_log`` (what ``heldout.Predictor`` runs) with
    its model, plan, family, cluster and stack indices as the fold's target problem has them;
    only the row's ``ClusterArrays`` change with the path. Tables are padded to ``n_fam`` x
    ``n_clu`` rows, so one compile serves every group per cluster-array shape."""

    def __init__(self, n_fam: int, n_clu: int, temperature: float, paths=PATHS):
        self.n_fam, self.n_clu, self.paths = n_fam, n_clu, tuple(paths)
        # XLA:CPU's quick pipeline (``diffcost.cache``): one compile per cluster-array shape
        # (the graph's size grid follows the GPU count), dozens in a run
        self._fn = fast_compile_jit(
            lambda dev, clu, data: F.predict_log(dev, clu, data, temperature)["e2e"]
        )
        self._graphs: dict = {}  # graph_path.graph_key -> graph ClusterArrays

    def graph(self, record, contention: bool):
        """The row's cluster on its own graph (``topology: cluster``) for its GPU count."""
        key = graph_path.graph_key(record)
        if key not in self._graphs:
            self._graphs[key] = graph_path.graph_arrays(record, contention=False)
        arrays = self._graphs[key]
        return arrays.replace(network=arrays.network.replace(contention=contention))

    def __call__(self, rows, src: F.Problem, tables, fams, clus, unseen=None) -> dict:
        """{path: [rows] log predicted seconds} of the e2e records ``rows``, with ``tables``
        trained on ``src`` mapped as the held-out predictor maps them
        (``heldout.target_tables``; ``unseen``: the constants of a cluster no fit has seen)."""
        target, dev, clu = target_tables(
            rows, src, tables, fams, clus, unseen, self.n_fam, self.n_clu
        )
        e2e = target.data["e2e"]
        out = {p: np.zeros(len(rows)) for p in self.paths}
        for i, record in enumerate(rows):
            one = {k: jax.tree_util.tree_map(lambda x: x[i : i + 1], e2e[k])
                   for k in ("model", "plan", "cluster", "d", "c", "s")}  # fmt: skip
            for path in self.paths:
                arrays = one["cluster"]
                if path != "comm":
                    arrays = _batched(self.graph(record, path == "graph_contention"))
                out[path][i] = float(self._fn(dev, clu, {"e2e": {**one, "cluster": arrays}})[0])
        return out

    def median(self, rows, src: F.Problem, members, fams, clus) -> dict:
        """{path: [rows]} the mean over ``members`` (``heldout.population_mixture``:
        ``[(tables, unseen cluster row)]``) of each member's log predictions: the population's
        predictive median, as ``heldout.Predictor.mean_log`` takes it."""
        outs = [self(rows, src, tab, fams, clus, row) for tab, row in members]
        return {p: np.mean([o[p] for o in outs], axis=0) for p in self.paths}


def _batched(tree):
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def max_rel_diff(log_a: np.ndarray, log_b: np.ndarray) -> float:
    """The largest |a / b - 1| of two arrays of log times (0 when empty)."""
    return float(np.max(np.abs(np.expm1(np.asarray(log_a) - np.asarray(log_b))), initial=0.0))


def path_metrics(log_pred: np.ndarray, log_meas: np.ndarray) -> dict:
    """rows, MAPE, bias (``transfer.group_metrics``) and the mean log error in %."""
    m = group_metrics(log_pred, log_meas)
    return {
        "rows": m["rows"],
        "mape_pct": m["mape_pct"],
        "bias_pct": m["bias_pct"],
        "mean_log_err_pct": None if m["mean_log_ratio"] is None else 100 * m["mean_log_ratio"],
        "max_ape_pct": m["max_ape_pct"],
    }


def moved_rows(before, after, meas) -> dict:
    """Of the rows whose price moved by more than ``MOVED_RTOL``: how many, how many came
    closer to the measurement and how many went further (log arrays)."""
    moved = np.abs(np.expm1(after - before)) > MOVED_RTOL
    closer = np.abs(after - meas) < np.abs(before - meas)
    return {
        "moved": int(moved.sum()),
        "closer": int((moved & closer).sum()),
        "further": int((moved & ~closer).sum()),
    }


def path_figures(preds: dict, log_meas: np.ndarray) -> dict:
    """A group's ``path_metrics`` per path and its ``graph_contention_rows``: the rows that
    moved between the existing path and the graph with contention (``moved_rows``)."""
    return {
        **{p: path_metrics(preds[p], log_meas) for p in PATHS},
        "graph_contention_rows": moved_rows(preds["comm"], preds["graph_contention"], log_meas),
    }


def row_columns(log_meas: np.ndarray, preds: dict) -> dict:
    """Per row, the measured and the predicted seconds of each path (lists)."""
    return {"measured_s": np.exp(log_meas).tolist(),
            **{f"{p}_s": np.exp(preds[p]).tolist() for p in PATHS}}  # fmt: skip


def write_rows(rows: list[dict], path: Path) -> str:
    """A CSV of ``rows`` (columns from the first), floats to 7 significant digits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(list(rows[0]) if rows else [])
        for row in rows:
            w.writerow([f"{v:.7g}" if isinstance(v, float) else v for v in row.values()])
    return str(path)


def progress_cells(g: dict) -> str:
    """MAPE (bias) of each path of a group, for a progress line."""
    return " ".join(f"{p} {g[p]['mape_pct']:.2f}% ({g[p]['bias_pct']:+.2f}%)" for p in PATHS)


def table_header(label: str, width: int) -> str:
    """The header of a table of ``table_cells`` rows, after a ``width``-wide label column."""
    cells = "  ".join(f"{p + ' MAPE/bias %':>27s}" for p in PATHS)
    return f"{label:{width}s} {'rows':>5s}  {cells}"


def table_cells(g: dict) -> str:
    """MAPE and bias of each path of a group, for a table row under ``table_header``."""
    return "  ".join(f"{fmt(g[p]['mape_pct'], 2):>13s} {fmt(g[p]['bias_pct'], 2):>13s}"
                     for p in PATHS)  # fmt: skip


def report(measure_fn, print_tables_fn, args, cache_prefix: str) -> dict:
    """``measure_fn(args)`` in a fresh persistent XLA cache, made JSON-safe and printed: as
    JSON with ``args.json``, else by ``print_tables_fn``."""
    with fresh_compilation_cache(cache_prefix):
        result = clean_json(measure_fn(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_tables_fn(result)
    return result
