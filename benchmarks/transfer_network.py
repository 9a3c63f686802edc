"""Zero-shot transfer priced on the network graph: ``transfer.py``'s held-out groups, each
fitted on the existing path and its held-out rows priced on the graph.

    python benchmarks/transfer_network.py [--json] [--quick] [--groups A,B] [--fits DIR]
        [--rows CSV] [--data DIR] [--fit-path comm|graph] [--unseen mixture|population]

``benchmarks/transfer.py`` leaves one source or one cluster out, fits the constants on every
other run (``calibration.fit``, the existing path: ``diffcost.comm``'s NVLink ring-share table
and the fabric's oversubscription) and predicts the held-out group. This script takes the same
fold fits (``transfer.zero_shot``; with ``--fits`` the same cache files, ``calibration.fit_cache``,
as ``transfer.py --fits``) and prices every held-out row three ways with the fold's constants:

* ``comm``: the existing path, as ``transfer.py`` prices it (the fold's device, cluster and
  software-stack constants; a row on a cluster or GPU family without end-to-end training runs
  is the median over the population's members, ``--unseen mixture``, or with ``--unseen
  population`` the prediction at their mean constants). Each row is checked against
  ``transfer.py``'s own prediction (``Predictor``): ``max_rel_diff_vs_transfer``.
* ``graph``: the network path on the graph the row's cluster describes (``topology: cluster``,
  the job's ``NetworkTables`` for its GPU count, as ``benchmarks/topology_e2e.py`` builds them),
  without contention between concurrent collectives;
* ``graph_contention``: the same graph with contention.

The constants are fitted on the existing path and the held-out rows priced on the graph, unless
``--fit-path graph``: then the fits price their e2e rows on their clusters' graphs with
contention (``calibration.graph_path``; not with ``--fits``, whose cache does not tell the
paths apart). The network path's own constants that profiles do not
carry (``diffcost.network``'s module constants) stay at their defaults, as in ``topology_e2e``.
Per group and path: rows, MAPE, ``bias_pct`` (mean of pred / meas - 1, %, as ``transfer.py``)
and ``mean_log_err_pct`` (100 x mean log(pred / meas)). ``--quick``: the source groups only,
fits of 60 steps (``transfer.py --quick``'s fits), a smoke run. ``graph_contention_rows``: of
the rows whose price moved between the existing path and the graph with contention, how many
came closer to the measurement. ``--rows PATH`` writes every held-out row's predictions. A
progress line per group goes to stderr. Exits 1 when a group's existing path does not
reproduce ``transfer.py``'s prediction.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import transfer as T  # noqa: E402  (the sibling benchmark: its folds, fits and metrics)
from cv_report import fmt  # noqa: E402
from network_pricing import (  # noqa: E402
    CHECK_RTOL,
    FIT_NOTES,
    MOVED_RTOL,
    PATHS,
    GraphPricer,
    fit_on,
    max_rel_diff,
    path_figures,
    progress_cells,
    report,
    row_columns,
    table_cells,
    table_header,
    write_rows,
)

from calibration.heldout import trained_keys  # noqa: E402


def group_result(t: T.Transfer, pricer: GraphPricer, kind: str, name: str, held) -> dict:
    """One held-out group: its fold fit (``transfer.zero_shot``, cached), its rows on each
    path (``network_pricing``), and the check that the existing path reproduces
    ``transfer.py``'s predictions."""
    _, pred_transfer = T.zero_shot(t, kind, name, held)
    _, tables, w = t.zero_shot_fits[held.tobytes()]
    idx = np.flatnonzero(held)
    fams, clus = trained_keys(t.P, w)
    rows = [t.e2e[i] for i in idx]
    preds = pricer(rows, t.P, tables, fams, clus, t.unseen_row(tables, w))
    members = t.members.get(held.tobytes())
    new = np.flatnonzero(unseen_rows(t, idx, w)) if members else []
    if len(new):  # the members differ only where a cluster or family has no e2e runs
        median = pricer.median([rows[k] for k in new], t.P, members, fams, clus)
        for p, x in median.items():
            preds[p][new] = x
    meas = t.log_meas[idx]
    rel = max_rel_diff(preds["comm"], pred_transfer)
    return {
        "kind": kind,
        "name": name,
        "rows": int(idx.size),
        "max_rel_diff_vs_transfer": rel,
        "reproduces_transfer": bool(rel <= CHECK_RTOL),
        **path_figures(preds, meas),
        "row_predictions": {"row": [t.e2e[i].row for i in idx], **row_columns(meas, preds)},
    }


def unseen_rows(t: T.Transfer, idx, w) -> np.ndarray:
    """Per row of ``idx``: whether its cluster or its GPU family has no end-to-end training
    run in the fold (``w``), i.e. takes the population's members (the family and cluster
    indices ``heldout.population_mixture`` reads)."""
    runs = np.asarray(w["e2e"]) > 0
    d, c = (np.asarray(t.P.data["e2e"][k]) for k in ("d", "c"))
    return ~np.isin(c[idx], c[runs]) | ~np.isin(d[idx], d[runs])


def csv_rows(groups: list) -> list[dict]:
    """Every held-out row's measured and predicted seconds on each path, one CSV row per group
    and row (a row is in its source's group and its cluster's)."""
    out = []
    for g in groups:
        rp = g["row_predictions"]
        for i, row in enumerate(rp["row"]):
            cells = {k: rp[k][i] for k in ("measured_s", *(f"{p}_s" for p in PATHS))}
            out.append({"group": f"{g['kind']}: {g['name']}", "row": row, **cells})
    return out


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
        json=False, quick=args.quick, unseen=args.unseen, device_layer_grid=False,
        no_stacks=False, no_family_parents=False, few_shot="own", design="runs",
        data=args.data, fits=args.fits,
    )  # fmt: skip
    t = T.Transfer(targs)
    if args.fit_path != "comm" and args.fits:  # the cache's key does not say the fit's path
        raise SystemExit("--fits holds fits on the existing path: not with --fit-path graph")
    t.P = fit_on(t.P, t.e2e, args.fit_path)
    pricer = GraphPricer(t.predictor.n_fam, t.predictor.n_clu, t.cfg.temperature)
    names = [n for n in args.groups.split(",") if n] if args.groups else None
    groups = []
    for kind, name, held in T._groups(t, t.quick, names):
        g = group_result(t, pricer, kind, name, held)
        groups.append(g)
        rel = g["max_rel_diff_vs_transfer"]
        print(f"[{time.perf_counter() - t0:7.1f}s] {kind} {name}: {g['rows']} rows, MAPE (bias) "
              f"{progress_cells(g)}; existing path vs transfer.py {rel:.1e}"
              + ("" if g["reproduces_transfer"] else " DOES NOT REPRODUCE transfer.py"),
              file=sys.stderr, flush=True)  # fmt: skip
    rows_csv = write_rows(csv_rows(groups), Path(args.rows)) if args.rows else None
    for g in groups:
        del g["row_predictions"]
    return {
        "groups": groups,
        "summary": summary(groups),
        "details": {
            "note": FIT_NOTES[args.fit_path],
            "fit_path": args.fit_path,
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
    print(table_header("group", 44))
    for g in r["groups"]:
        print(f"{g['kind'] + ': ' + g['name']:44s} {g['rows']:5d}  {table_cells(g)}")
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
    ap.add_argument("--unseen", choices=("mixture", "population"), default="mixture",
                    help="a cluster without training runs: the median over the population's "
                         "members, or its mean constants (transfer.py --unseen)")  # fmt: skip
    ap.add_argument("--fit-path", choices=tuple(FIT_NOTES), default="comm",
                    help="fit on the existing path (comm) or with the e2e rows on the graph "
                         "with contention (graph)")  # fmt: skip
    args = ap.parse_args(argv)
    result = report(measure, print_tables, args, "transfer-network-xla-")
    return 0 if all(g["reproduces_transfer"] for g in result["groups"]) else 1


if __name__ == "__main__":
    sys.exit(main())
