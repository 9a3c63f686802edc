"""Zero-shot transfer priced on the network graph: ``transfer.py``'s held-out groups, each
fitted on the existing path and its held-out rows priced on the graph.

    python benchmarks/transfer_network.py [--json] [--quick] [--groups A,B] [--fits DIR]
        [--rows CSV] [--data DIR]

``benchmarks/transfer.py`` leaves one source or one cluster out, fits the constants on every
other run (``calibration.fit``, the existing path: ``diffcost.comm``'s NVLink ring-share table
and the fabric's oversubscription) and predicts the held-out group. This script takes the same
fold fits (``transfer.zero_shot``; with ``--fits`` the same cache files, ``calibration.fit_cache``,
as ``transfer.py --fits``) and prices every held-out row three ways with the fold's constants:

* ``comm``: the existing path, as ``transfer.py`` prices it (the fold's device, cluster and
  software-stack constants, population constants for a cluster no training run names). Each row
  is checked against ``transfer.py``'s own prediction (``Predictor``): ``max_rel_diff_vs_transfer``.
* ``graph``: the network path on the graph the row's cluster describes (``topology: cluster``,
  the job's ``NetworkTables`` for its GPU count, as ``benchmarks/topology_e2e.py`` builds them),
  without contention between concurrent collectives;
* ``graph_contention``: the same graph with contention.

The fits are not redone on the graph path: the constants are fitted on the existing path and
the held-out rows priced on the graph. The network path's own constants that profiles do not
carry (``diffcost.network``'s module constants) stay at their defaults, as in ``topology_e2e``.
Per group and path: rows, MAPE, ``bias_pct`` (mean of pred / meas - 1, %, as ``transfer.py``)
and ``mean_log_err_pct`` (100 x mean log(pred / meas)). ``--quick``: the source groups only,
fits of 60 steps (``transfer.py --quick``'s fits), a smoke run. ``graph_contention_rows``: of
the rows whose price moved between the existing path and the graph with contention, how many
came closer to the measurement. ``--rows PATH`` writes every held-out row's predictions. A
progress line per group goes to stderr.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import transfer as T  # noqa: E402  (the sibling benchmark: its folds, fits and metrics)
from cv_report import clean_json, fmt  # noqa: E402

from calibration import fit as F  # noqa: E402
from calibration.heldout import fresh_compilation_cache, target_tables, trained_keys  # noqa: E402
from diffcost.arrays import cluster_arrays  # noqa: E402
from diffcost.cache import fast_compile_jit  # noqa: E402

PATHS = ("comm", "graph", "graph_contention")
# The existing path priced row by row against transfer.py's batched prediction (float32): a
# larger relative difference on a row means the rows did not read the fold's constants as
# transfer.py does, and the group is flagged (``reproduces_transfer``)
CHECK_RTOL = 1e-5
MOVED_RTOL = 1e-4  # a row whose price moved by more than this between the paths counts as moved
NOTE = ("fitted on the existing path, held-out rows priced on the graph; the network path's "
        "own constants at their defaults")  # fmt: skip


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
        self._graphs: dict = {}  # (repr of the cluster, GPUs) -> graph ClusterArrays

    def graph(self, record, contention: bool):
        """The row's cluster on its own graph (``topology: cluster``) for its GPU count."""
        key = (repr(record.cluster), int(record.plan.n_gpus))
        if key not in self._graphs:
            spec = dataclasses.replace(record.cluster, topology="cluster")
            self._graphs[key] = cluster_arrays(spec, None, record.plan.n_gpus)
        arrays = self._graphs[key]
        return arrays.replace(network=arrays.network.replace(contention=contention))

    def __call__(self, rows, src: F.Problem, tables, fams, clus, unseen=None) -> dict:
        """{path: [rows] log predicted seconds} of the e2e records ``rows``, with ``tables``
        trained on ``src`` mapped as ``transfer.py`` maps them (``heldout.target_tables``)."""
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


def _batched(tree):
    return jax.tree_util.tree_map(lambda x: x[None], tree)


def path_metrics(log_pred: np.ndarray, log_meas: np.ndarray) -> dict:
    """rows, MAPE, bias (``transfer.group_metrics``) and the mean log error in %."""
    m = T.group_metrics(log_pred, log_meas)
    return {
        "rows": m["rows"],
        "mape_pct": m["mape_pct"],
        "bias_pct": m["bias_pct"],
        "mean_log_err_pct": 100 * m["mean_log_ratio"],
        "max_ape_pct": m["max_ape_pct"],
    }


def group_result(t: T.Transfer, pricer: GraphPricer, kind: str, name: str, held) -> dict:
    """One held-out group: its fold fit (``transfer.zero_shot``, cached), its rows on each
    path, and the check that the existing path reproduces ``transfer.py``'s predictions."""
    _, pred_transfer = T.zero_shot(t, kind, name, held)
    _, tables, w = t.zero_shot_fits[held.tobytes()]
    idx = np.flatnonzero(held)
    fams, clus = trained_keys(t.P, w)
    preds = pricer([t.e2e[i] for i in idx], t.P, tables, fams, clus, t.unseen_row(tables, w))
    meas = t.log_meas[idx]
    rel = np.abs(np.expm1(preds["comm"] - pred_transfer))
    return {
        "kind": kind,
        "name": name,
        "rows": int(idx.size),
        "max_rel_diff_vs_transfer": float(rel.max()),
        "reproduces_transfer": bool(rel.max() <= CHECK_RTOL),
        **{p: path_metrics(preds[p], meas) for p in PATHS},
        "graph_contention_rows": moved_rows(preds["comm"], preds["graph_contention"], meas),
        "row_predictions": {
            "row": [t.e2e[i].row for i in idx],
            "measured_s": np.exp(meas).tolist(),
            **{f"{p}_s": np.exp(preds[p]).tolist() for p in PATHS},
        },
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


def write_rows(groups: list, path: Path) -> str:
    """Every held-out row's measured and predicted seconds on each path, one CSV row per group
    and row (a row is in its source's group and its cluster's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["group", "row", "measured_s", *(f"{p}_s" for p in PATHS)])
        for g in groups:
            rp = g["row_predictions"]
            for i, row in enumerate(rp["row"]):
                cells = [rp[k][i] for k in ("measured_s", *(f"{p}_s" for p in PATHS))]
                w.writerow([f"{g['kind']}: {g['name']}", row, *(f"{c:.7g}" for c in cells)])
    return str(path)


def summary(groups: list) -> dict:
    """Per path: mean MAPE over the source groups and over the cluster groups, and the largest
    absolute bias of a source group (``transfer.summary``'s figures)."""
    out = {}
    for p in PATHS:
        src = [g[p] for g in groups if g["kind"] == "source"]
        clu = [g[p] for g in groups if g["kind"] == "cluster"]
        out[p] = {
            "loso_mean_mape_pct": float(np.mean([m["mape_pct"] for m in src])) if src else None,
            "loso_max_abs_bias_pct": max((abs(m["bias_pct"]) for m in src), default=None),
            "loco_mean_mape_pct": float(np.mean([m["mape_pct"] for m in clu])) if clu else None,
        }
    return out


def measure(args) -> dict:
    t0 = time.perf_counter()
    targs = argparse.Namespace(
        json=False, quick=args.quick, unseen="population", device_layer_grid=False,
        no_stacks=False, no_family_parents=False, few_shot="own", design="runs",
        data=args.data, fits=args.fits,
    )  # fmt: skip
    t = T.Transfer(targs)
    pricer = GraphPricer(t.predictor.n_fam, t.predictor.n_clu, t.cfg.temperature)
    names = [n for n in args.groups.split(",") if n] if args.groups else None
    groups = []
    for kind, name, held in T._groups(t, t.quick, names):
        g = group_result(t, pricer, kind, name, held)
        groups.append(g)
        cells = " ".join(f"{p} {g[p]['mape_pct']:.2f}% ({g[p]['bias_pct']:+.2f}%)" for p in PATHS)
        print(f"[{time.perf_counter() - t0:7.1f}s] {kind} {name}: {g['rows']} rows, MAPE (bias) "
              f"{cells}; existing path vs transfer.py {g['max_rel_diff_vs_transfer']:.1e}"
              + ("" if g["reproduces_transfer"] else " DOES NOT REPRODUCE transfer.py"),
              file=sys.stderr, flush=True)  # fmt: skip
    rows_csv = write_rows(groups, Path(args.rows)) if args.rows else None
    for g in groups:
        del g["row_predictions"]
    return {
        "groups": groups,
        "summary": summary(groups),
        "details": {
            "note": NOTE,
            "rows_csv": rows_csv,
            "moved_rtol": MOVED_RTOL,
            "quick": t.quick,
            "fit_steps": t.cfg.steps,
            "unseen_cluster": t.unseen,
            "groups_selected": bool(args.groups),
            "seconds": time.perf_counter() - t0,
        },
    }


def print_tables(r: dict) -> None:
    print(f"Zero-shot groups, {r['details']['note']}.")
    print(f"{'group':44s} {'rows':>5s}  " + "  ".join(f"{p + ' MAPE/bias %':>27s}" for p in PATHS))
    for g in r["groups"]:
        cells = "  ".join(f"{fmt(g[p]['mape_pct'], 2):>13s} {fmt(g[p]['bias_pct'], 2):>13s}"
                          for p in PATHS)  # fmt: skip
        print(f"{g['kind'] + ': ' + g['name']:44s} {g['rows']:5d}  {cells}")
    for p, s in r["summary"].items():
        print(f"{p:17s} " + ", ".join(f"{k} {fmt(v, 2)}" for k, v in s.items()))
    print(f"total {r['details']['seconds']:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--quick", action="store_true",
                    help="source groups only, 60-step fits (a smoke run)")  # fmt: skip
    ap.add_argument("--groups", default="", help="only these comma-separated sources or clusters")
    ap.add_argument("--data", default=str(T.DATA), help="shared data directory")
    ap.add_argument("--fits", default="",
                    help="folder of the zero-shot fits, shared with transfer.py --fits "
                         "(calibration.fit_cache)")  # fmt: skip
    ap.add_argument("--rows", default="", help="CSV of every held-out row's predictions")
    args = ap.parse_args(argv)
    with fresh_compilation_cache("transfer-network-xla-"):
        result = clean_json(measure(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
