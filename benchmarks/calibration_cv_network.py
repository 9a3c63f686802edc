"""Grouped cross-validation priced on the network graph: ``calibration_cv.py``'s folds, each
fitted on the existing path and its held-out rows priced on the graph.

    python benchmarks/calibration_cv_network.py [--json] [--quick] [--folds 0,1] [--rows CSV]
        [--data DIR] [--fit-path comm|graph]

``benchmarks/calibration_cv.py`` (its section 1, ``by_source`` and ``h100``) splits the e2e rows
into five folds grouped by model shape and stratified by source (``calibration.cv.grouped_folds``),
fits the constants on the other folds' runs plus every collective and GEMM row
(``calibration.fit``, the existing path: ``diffcost.comm``'s NVLink ring-share table and the
fabric's oversubscription) and predicts the fold's runs. This script runs the same fold fits
(``calibration_cv.Study`` and ``calibration_cv.fold_fit``: the same data, problem, fit settings
and held-out predictor) and prices every held-out row three ways with the fold's constants
(``network_pricing``):

* ``comm``: the existing path. Each row is checked against ``calibration_cv.py``'s own held-out
  prediction (``heldout.Predictor``): ``max_rel_diff_vs_cv``, and a group whose rows do not
  reproduce it within ``network_pricing.CHECK_RTOL`` is flagged (``reproduces_cv``) and makes
  the exit status 1.
* ``graph``: the network path on the graph the row's cluster describes (``topology: cluster``),
  without contention between concurrent collectives;
* ``graph_contention``: the same graph with contention.

The fits run on the existing path unless ``--fit-path graph``: then every fold fit prices its
e2e rows on their clusters' graphs with contention (``calibration.graph_path``), so that the
constants adapt to the graph, and ``max_rel_diff_vs_fit`` (per fold) checks that
``graph_contention`` prices the held-out rows as the fit's own final prediction does (the
existing path is still checked against ``calibration_cv.py``'s predictor, which prices the
graph fit's constants on it). The network path's own constants that profiles do not carry
stay at their defaults (as in ``topology_e2e.py`` and ``transfer_network.py``).
Per group (each source, the H100 runs as ``calibration_cv.py``'s ``h100``, and all rows) and
path: rows, MAPE, ``bias_pct`` (mean of pred / meas - 1, %), ``mean_log_err_pct``; ``shift``:
per graph path, the mean and the largest |pred / pred_comm - 1| in %, and the change of MAPE
and bias from the existing path in points; ``graph_contention_rows``: of the rows whose price
moved between the existing path and the graph with contention, how many came closer to the
measurement. ``--quick``: ``calibration_cv.py --quick``'s fits (40 steps) of folds 0 and 1, a
smoke run. ``--rows PATH`` writes every held-out row's predictions. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibration_cv as CV  # noqa: E402  (the sibling benchmark: its data, folds and fits)
import network_pricing as NP  # noqa: E402  (the graph pricing shared with transfer_network)

H100 = "h100"  # the group of every run on an H100 (``calibration_cv.py``'s ``h100``)


def study(args) -> CV.Study:
    """``calibration_cv.py``'s data, fit configuration, full problem, folds and predictor, with
    its default fit settings (``--quick``: its quick ones); with ``--fit-path graph`` the
    problem's e2e rows on their clusters' graphs with contention (``graph_path``)."""
    knobs = dict(steps=None, prior_weight=None, huber_delta=None, learning_rate=None, folds=None)
    st = CV.Study(argparse.Namespace(json=True, quick=args.quick, data=args.data, **knobs))
    st.full_problem()
    if args.fit_path != "comm":
        t0 = time.perf_counter()
        st.P = NP.fit_on(st.P, st.e2e, args.fit_path)
        st.say(f"e2e rows on their graphs in {time.perf_counter() - t0:.0f} s")
    return st


def price_fold(st: CV.Study, pricer: NP.GraphPricer, f: int, fit_path: str = "comm") -> dict:
    """CV fold ``f``: ``calibration_cv.fold_fit`` (fit and held-out prediction), then its
    held-out rows on each path with the fold's tables, mapped as ``calibration_cv.py`` maps
    them (trained families and clusters; defaults for the rest). ``max_rel_diff_vs_fit``:
    how far the path the fit ran on (``NP.FIT_PATHS[fit_path]``) prices the held-out rows from
    the fit's own final prediction of them."""
    res, tables, wall, _, fams, clus, held, pred_cv = CV.fold_fit(st, f)
    t0 = time.perf_counter()
    preds = pricer([st.e2e[i] for i in held], st.P, tables, fams, clus)
    in_fit = res.residuals["e2e"][held] + st.log_meas[held]
    return {
        "held": held,
        "cv": pred_cv,
        **preds,
        "info": {
            "fold": f,
            "heldout_rows": int(held.size),
            "steps": res.steps,
            "converged": res.converged,
            "final_loss": res.losses[-1],
            "fit_wall_s": wall,
            "price_wall_s": time.perf_counter() - t0,
            "max_rel_diff_vs_cv": NP.max_rel_diff(preds["comm"], pred_cv),
            "max_rel_diff_vs_fit": NP.max_rel_diff(preds[NP.FIT_PATHS[fit_path]], in_fit),
        },
    }


def shift(preds: dict, figures: dict) -> dict:
    """Per graph path: how far its prices are from the existing path's (mean and largest
    |pred / pred_comm - 1|, %) and the change of MAPE and bias from it (points)."""
    out = {}
    for p in NP.PATHS[1:]:
        rel = np.expm1(preds[p] - preds["comm"]) * 100
        out[p] = {
            "mean_pct": float(rel.mean()),
            "max_abs_pct": float(np.abs(rel).max()),
            "mape_change_pts": figures[p]["mape_pct"] - figures["comm"]["mape_pct"],
            "bias_change_pts": figures[p]["bias_pct"] - figures["comm"]["bias_pct"],
        }
    return out


def group_result(name: str, mask: np.ndarray, rows: dict, log_meas: np.ndarray) -> dict:
    """The figures of the held-out rows in ``mask``: ``rows`` holds, per e2e row, the log
    predicted seconds of each path and ``cv`` (``calibration_cv.py``'s prediction)."""
    preds = {p: rows[p][mask] for p in (*NP.PATHS, "cv")}
    meas = log_meas[mask]
    rel = NP.max_rel_diff(preds["comm"], preds["cv"])
    figures = NP.path_figures(preds, meas)
    return {
        "name": name,
        "rows": int(mask.sum()),
        "max_rel_diff_vs_cv": rel,
        "reproduces_cv": bool(rel <= NP.CHECK_RTOL),
        **figures,
        "shift": shift(preds, figures),
    }


def groups(st: CV.Study, rows: dict) -> list:
    """Each source's held-out rows, the H100 runs' and all of them."""
    done = np.isfinite(rows["cv"])
    masks = [(f"source: {s}", done & (st.src == s)) for s in sorted(set(st.src[done]))]
    masks += [(H100, done & (st.e2e_family == H100)), ("all", done)]
    return [group_result(name, m, rows, st.log_meas) for name, m in masks if m.any()]


def csv_rows(st: CV.Study, rows: dict) -> list[dict]:
    """Every held-out row: its fold, source, cluster, measured seconds and the predicted
    seconds of ``calibration_cv.py`` and of each path."""
    out = []
    for i in np.flatnonzero(np.isfinite(rows["cv"])):
        r = st.e2e[i]
        out.append({
            "fold": int(st.folds[i]), "row": r.row, "source": r.source_name,
            "cluster": r.cluster.name, "measured_s": float(np.exp(st.log_meas[i])),
            **{f"{p}_s": float(np.exp(rows[p][i])) for p in ("cv", *NP.PATHS)},
        })  # fmt: skip
    return out


def measure(args) -> dict:
    t0 = time.perf_counter()
    st = study(args)
    folds = [int(f) for f in args.folds.split(",")] if args.folds else list(range(st.n_folds))
    if args.quick and not args.folds:
        folds = [0, 1]
    bad = [f for f in folds if not 0 <= f < st.n_folds]
    if bad:
        raise SystemExit(f"--folds: {bad} not in 0..{st.n_folds - 1}")
    pricer = NP.GraphPricer(st.predictor.n_fam, st.predictor.n_clu, st.cfg.temperature)
    rows = {p: np.full(len(st.e2e), np.nan) for p in (*NP.PATHS, "cv")}
    fold_info = []
    for f in folds:
        fold = price_fold(st, pricer, f, args.fit_path)
        for p in (*NP.PATHS, "cv"):
            rows[p][fold["held"]] = fold[p]
        fold_info.append(fold["info"])
        g = group_result(f"fold {f}", np.isin(np.arange(len(st.e2e)), fold["held"]), rows,
                         st.log_meas)  # fmt: skip
        st.say(f"fold {f}: {g['rows']} rows, {fold['info']['steps']} steps in "
               f"{fold['info']['fit_wall_s']:.0f} s, priced in {fold['info']['price_wall_s']:.0f}"
               f" s; MAPE (bias) {NP.progress_cells(g)}; existing path vs calibration_cv "
               f"{g['max_rel_diff_vs_cv']:.1e}, {NP.FIT_PATHS[args.fit_path]} vs the fit "
               f"{fold['info']['max_rel_diff_vs_fit']:.1e}"
               + ("" if g["reproduces_cv"] else " DOES NOT REPRODUCE calibration_cv"))  # fmt: skip
    rows_csv = NP.write_rows(csv_rows(st, rows), Path(args.rows)) if args.rows else None
    cfg = st.cfg
    return {
        "groups": groups(st, rows),
        "folds": fold_info,
        "details": {
            "note": NP.FIT_NOTES[args.fit_path],
            "fit_path": args.fit_path,
            "rows_csv": rows_csv,
            "check_rtol": NP.CHECK_RTOL,
            "moved_rtol": NP.MOVED_RTOL,
            "quick": st.quick,
            "folds_run": folds,
            "fold_rows": st.fold_rows,
            "fit_config": {k: getattr(cfg, k) for k in ("steps", "learning_rate", "huber_delta",
                                                        "prior_weight", "tol", "patience")},
            "seconds": time.perf_counter() - t0,
        },
    }  # fmt: skip


def print_tables(r: dict) -> None:
    print(f"Grouped CV folds {r['details']['folds_run']}, {r['details']['note']}.")
    print(NP.table_header("group", 44) + "  moved (closer/further)")
    for g in r["groups"]:
        m = g["graph_contention_rows"]
        print(f"{g['name']:44s} {g['rows']:5d}  {NP.table_cells(g)}  "
              f"{m['moved']} ({m['closer']}/{m['further']})"
              + ("" if g["reproduces_cv"] else "  DOES NOT REPRODUCE calibration_cv"))  # fmt: skip
    print(f"total {r['details']['seconds']:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    quick_help = "calibration_cv.py --quick's 40-step fits, folds 0 and 1 (a smoke run)"
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--folds", default="", help="only these comma-separated folds (of 0-4)")
    ap.add_argument("--data", default=str(CV.DATA), help="shared data directory")
    ap.add_argument("--rows", default="", help="CSV of every held-out row's predictions")
    ap.add_argument("--fit-path", choices=tuple(NP.FIT_PATHS), default="comm",
                    help="fit the folds on the existing path (comm) or with their e2e rows on "
                         "the graph with contention (graph)")  # fmt: skip
    args = ap.parse_args(argv)
    result = NP.report(measure, print_tables, args, "calibration-cv-network-xla-")
    return 0 if all(g["reproduces_cv"] for g in result["groups"]) else 1


if __name__ == "__main__":
    sys.exit(main())
