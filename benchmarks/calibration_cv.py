"""How well the calibrated cost model predicts runs it was not fitted on, measured in one run.

    python benchmarks/calibration_cv.py [--json] [--quick] [--plots DIR] [--data DIR]

Figures (all from ``calibration.fit.fit`` on the shared data set, ``shared/data``):

1. ``by_source`` / ``h100``: grouped 5-fold cross-validation on the end-to-end rows
   (``calibration.cv.grouped_folds``). Folds are grouped by model shape (n_layers, hidden,
   ffn_hidden, heads, kv_heads, seq_len), so a held-out shape is never seen in training on any
   cluster, and stratified by source (each source's shapes spread over the five folds). A fold's
   training set is the other folds' e2e rows of every cluster plus every collective and GEMM row
   (kernel-level data are always available). Held-out rows are predicted with
   ``calibration.fit.predict_log`` on a problem built from the held-out rows alone, with the
   trained device/cluster tables mapped to that problem's family/cluster order (families and
   clusters without a training row get the datasheet defaults). Per source: rows, MAPE, p90 APE,
   max APE, Kendall tau.
2. ``cross_source``: fit on vTrain single-node e2e rows + the A100 all-reduce tables only;
   predict the MosaicML A100 rows (``mosaic-a100-40g``, ``mosaic-a100-80g``) without refitting.
   The A100 device constants come from the fit; the Mosaic clusters' own constants stay at
   their defaults (no training row names them).
3. ``allreduce_fit``: residuals of the all-reduce rows with size >= 1 MiB and group size 2-8
   after one fit on all data; MAPE, max APE and a table per size bucket (powers of 4, 1 MiB to
   1 GiB).
4. ``fit_s``: wall time of one fit (problem build + ``fit``) on the shared A100 set (all vTrain
   e2e rows + all A100 and V100 all-reduce tables), first compile of that shape in this run;
   split into compile (``jax.monitoring`` trace/lowering/compile events) and steps.
5. ``robustness``: 10% of one fold's training e2e rows have their measured time multiplied by
   3 (fixed seed); held-out MAPE of that fold's vTrain rows, clean vs corrupted.
6. ``flat_directions``: eigen-decomposition of the Hessian of ``calibration.fit.make_loss`` at
   the full fit's optimum with respect to the flattened scalar constants (the GEMM, layer,
   cluster layer and LM head shape grids are held at their fit; ``gemm_shape_grid`` gives, per
   GPU family and precision class, the nodes some row depends on and the nodes the fit moved by
   1% or more, ``layer_shape_grid`` the same per GPU family, ``cluster_layer_grid`` and
   ``head_shape_grid`` per cluster). The prior adds exactly the
   diagonal ``calibration.fit.prior_curvature`` (``2 prior_weight / PRIOR_SD^2``); the data
   part ``H`` minus that diagonal is what the measurements pin down.
   Its eigenvalues below 1e-6 x the largest are flat; the constants dominating them are listed.
   The Hessian is taken by central differences of the exact gradient (``jax.grad``) in float64
   (an exact ``jax.hessian`` / HVP compiles for minutes on this model).
7. Plots (PNG): CV predicted vs measured per source, CV residuals vs GPU count / tp / pp,
   all-reduce fit vs measured curves for ``vtrain-a100``, cross-source scatter.

Compilation is reused across fits: every CV fold, the full fit and the robustness fit share one
problem holding every row, with a per-row ``weight`` (0 for held-out rows; ``make_loss`` reads
it); a fresh persistent XLA cache (temporary directory) lets each ``fit`` call reuse the step
compiled by the first one. Parameters of families/clusters with no weighted row get exactly zero
gradient and stay at the defaults, so the full-problem residuals of held-out rows equal the
mapped held-out predictions (checked, ``cv.mapping_check_max_abs_log_diff``).

Targets (exit status 1 when one is missed, after printing everything): vTrain CV MAPE <= 3% and
worst row <= 10%; H100 CV MAPE <= 5%; all-reduce MAPE <= 5%; fit_s < 60 s; robustness: the
corrupted held-out MAPE at most 1.5x the clean one.

Sections 2 to 6 are measured in ``cv_sections.py``, the tables and plots drawn in ``cv_report.py``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from cv_report import clean_json, finish, make_plots, print_tables  # noqa: E402
from cv_sections import (  # noqa: E402  (sections 2 to 6)
    cross_source,
    defaults_by_source,
    fit_timing,
    full_fit,
    identifiability,
    robustness,
)

from calibration import fit as F  # noqa: E402
from calibration.cv import grouped_folds, shape_key  # noqa: E402
from calibration.heldout import (  # noqa: E402
    Predictor,
    ape_pct,
    by_group,
    fresh_compilation_cache,
    load_data,
    metrics,
    run_fit,
    subset,
    trained_keys,
)
from diffcost.gpus import gpu_family, preset_family  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
RESULTS = Path(__file__).resolve().parent / "results"
VTRAIN = "vtrain_ground_truth_single"
MOSAIC = "mosaicml_llmfoundry_benchmarks"
MOSAIC_A100 = ("mosaic-a100-40g", "mosaic-a100-80g")
TARGETS = {
    "vtrain_cv_mape_pct": 3.0,
    "vtrain_cv_max_ape_pct": 10.0,
    "h100_cv_mape_pct": 5.0,
    "allreduce_mape_pct": 5.0,
    "fit_s": 60.0,
    "robustness_ratio": 1.5,  # held-out vTrain MAPE with 10% of training rows x3 over clean
}


def _plan_fields(plan) -> dict:
    """The plan columns of a reported row."""
    names = ("n_gpus", "tp", "pp", "dp", "microbatch", "global_batch")
    return {k: getattr(plan, k) for k in names}


def log(msg: str, quiet: bool):
    print(msg, file=sys.stderr if quiet else sys.stdout, flush=True)


class Study:
    """What the sections of one benchmark run share: the data, its per-row labels, the fit
    configuration, the problems, the fits done so far and their timings."""

    def __init__(self, args):
        self.t_start = time.perf_counter()
        self.quiet = args.json
        self.quick = bool(args.quick)
        steps = args.steps or (40 if args.quick else F.FitConfig().steps)
        knobs = {
            k: v
            for k, v in (
                ("prior_weight", args.prior_weight),
                ("huber_delta", args.huber_delta),
                ("learning_rate", args.learning_rate),
            )
            if v is not None
        }
        self.cfg = F.FitConfig(steps=steps, **knobs)
        self.n_folds = 5
        self.run_folds = args.folds or (2 if args.quick else self.n_folds)
        self.timings = {}
        t0 = time.perf_counter()
        self.meas = meas = load_data(Path(args.data))
        self.e2e = e2e = meas.e2e
        self.src = np.array([r.source_name for r in e2e])
        self.e2e_cluster = np.array([r.cluster.name for r in e2e])
        self.e2e_family = np.array([gpu_family(r.cluster.gpu.name) for r in e2e])
        colls = meas.collectives
        self.coll_fam = np.array([preset_family(r.cluster) for r in colls])
        self.coll_kind = np.array([r.collective for r in colls])
        self.coll_cluster = np.array([r.cluster for r in colls])
        self.coll_size = np.array([r.size_bytes for r in colls], float)
        self.coll_n = np.array([r.group_size for r in colls], float)
        self.coll_src = np.array([r.source_name for r in colls])
        self.is_vtrain = self.src == VTRAIN
        self.timings["load_s"] = time.perf_counter() - t0
        self.say(f"loaded {len(e2e)} e2e, {len(colls)} collective, {len(meas.gemms)} GEMM rows")

    def say(self, msg: str) -> None:
        log(f"[{time.perf_counter() - self.t_start:7.1f}s] {msg}", self.quiet)

    def full_problem(self) -> None:
        """The problem of every row, which serves all fits but the A100-set ones with one
        compiled step, the grouped folds and the held-out predictor."""
        t0 = time.perf_counter()
        self.P = P = F.build_problem(self.meas)
        self.timings["build_full_problem_s"] = time.perf_counter() - t0
        self.log_meas = np.asarray(P.data["e2e"]["log_meas"], float)
        kept = (P.counts["e2e"], P.counts["coll"], P.counts.get("gemm", 0))
        if kept != (len(self.e2e), len(self.meas.collectives), len(self.meas.gemms)):
            raise RuntimeError(f"build_problem kept {P.counts}; load_data selects differently")
        self.folds = grouped_folds(self.e2e, self.n_folds)
        self.fold_rows = [int((self.folds == f).sum()) for f in range(self.n_folds)]
        self.is_mosaic_a100 = (self.src == MOSAIC) & np.isin(self.e2e_cluster, MOSAIC_A100)
        # pad the held-out chunks to the largest set predicted (folds, cross-source)
        chunk = int(max(max(self.fold_rows), self.is_mosaic_a100.sum()))
        n_fam, n_clu = len(P.families), len(P.clusters)
        self.predictor = Predictor(chunk, n_fam, n_clu, self.cfg.temperature)
        self.ones = {lvl: np.ones(P.counts[lvl]) for lvl in P.data}

    def predict(self, idx, src_problem, tables, fams, clus) -> np.ndarray:
        return self.predictor([self.e2e[i] for i in idx], src_problem, tables, fams, clus)


def fold_fit(st: Study, f: int) -> tuple:
    """CV fold ``f``: the fit on the other folds' e2e rows and every collective and GEMM row,
    and the prediction of the fold's rows; (result, tables, wall s, weights, trained families,
    trained clusters, held-out row indices, their log predicted seconds)."""
    train = st.folds != f
    w = {**st.ones, "e2e": train.astype(float)}
    res, tabs_f, wall = run_fit(st.P, subset(st.meas, e2e=train), w, st.cfg)
    fams, clus = trained_keys(st.P, w)
    held = np.flatnonzero(~train)
    return res, tabs_f, wall, w, fams, clus, held, st.predict(held, st.P, tabs_f, fams, clus)


def grouped_cv(st: Study) -> dict:
    """1. Grouped k-fold CV of the e2e rows; every fold keeps every collective and GEMM row."""
    st.cv_pred = np.full(len(st.e2e), np.nan)
    checks, fold_info, st.fold_fits = [], [], {}
    for f in range(st.run_folds):
        res, tabs_f, wall, w, fams, clus, held, pred = fold_fit(st, f)
        st.cv_pred[held] = pred
        in_problem = res.residuals["e2e"][held] + st.log_meas[held]
        checks.append(float(np.max(np.abs(in_problem - pred))))
        st.fold_fits[f] = (res, tabs_f, w, fams, clus)
        m = metrics(pred, st.log_meas[held])
        fold_info.append(
            {
                "fold": f,
                "heldout_rows": int(held.size),
                "heldout_shapes": len({shape_key(st.e2e[i]) for i in held}),
                "steps": res.steps,
                "converged": res.converged,
                "final_loss": res.losses[-1],
                "fit_wall_s": wall,
                "heldout_mape_pct": m["mape_pct"],
            }
        )
        st.say(f"CV fold {f}: {held.size} held-out rows, {res.steps} steps in {wall:.1f} s, "
               f"held-out MAPE {m['mape_pct']:.1f}%")  # fmt: skip
    st.done = done = np.isfinite(st.cv_pred)
    h100 = done & (st.e2e_family == "h100")
    return {
        "by_source": by_group(st.src, st.cv_pred, st.log_meas, done),
        "h100": metrics(st.cv_pred[h100], st.log_meas[h100]),
        "h100_by_cluster": by_group(st.e2e_cluster, st.cv_pred, st.log_meas, h100),
        "fold_fits": fold_info,
        "mapping_check_max_abs_log_diff": max(checks) if checks else None,
    }


def cv_row_table(st: Study) -> tuple[list, list, dict]:
    """Every e2e row with its CV and full-fit predictions; the 15 worst CV rows; the 5 worst
    of each source."""
    ape_cv = ape_pct(st.cv_pred, st.log_meas)
    full = st.log_meas + np.asarray(st.res_full.residuals["e2e"])
    cv_rows = [
        {
            "row": r.row,
            "source": r.source_name,
            "cluster": r.cluster.name,
            "model": r.model.name,
            "n_layers": r.model.n_layers,
            "hidden": r.model.hidden,
            "seq_len": r.model.seq_len,
            "precision": r.model.precision,
            **_plan_fields(r.plan),
            "recompute": r.plan.recompute,
            "zero": r.plan.zero,
            "fold": int(st.folds[i]),
            "measured_s": float(np.exp(st.log_meas[i])),
            "cv_predicted_s": float(np.exp(st.cv_pred[i])) if st.done[i] else None,
            "cv_ape_pct": float(ape_cv[i]) if st.done[i] else None,
            "full_fit_predicted_s": float(np.exp(full[i])),
        }
        for i, r in enumerate(st.e2e)
    ]
    worst = []
    for i in np.argsort(-np.where(st.done, ape_cv, -1))[:15]:
        r = st.e2e[i]
        worst.append(
            {
                "row": r.row,
                "source": r.source_name,
                "model": r.model.name,
                "cluster": r.cluster.name,
                **_plan_fields(r.plan),
                "measured_s": float(np.exp(st.log_meas[i])),
                "predicted_s": float(np.exp(st.cv_pred[i])),
                "ape_pct": float(ape_cv[i]),
            }
        )
    worst_by_source = {}
    for s_name in sorted(set(st.src[st.done])):
        idx = np.flatnonzero(st.done & (st.src == s_name))
        worst_by_source[s_name] = [cv_rows[i] for i in idx[np.argsort(-ape_cv[idx])[:5]]]
    return cv_rows, worst, worst_by_source


def vtrain_structure(st: Study) -> tuple[dict, dict]:
    """vTrain's CV residuals by layout (tp, pp, dp), and how much of its full-fit error is
    structure a smooth model would need per-cell terms for: the MAPE after removing the mean
    log residual within each cell."""
    e2e, done = st.e2e, st.done
    pattern = {}
    for key in sorted({(r.plan.tp, r.plan.pp, r.plan.dp) for r in e2e if r.source_name == VTRAIN}):
        m = done & st.is_vtrain & np.array([(r.plan.tp, r.plan.pp, r.plan.dp) == key for r in e2e])
        if m.any():
            pattern[f"tp{key[0]}-pp{key[1]}-dp{key[2]}"] = {
                "rows": int(m.sum()),
                "mean_log_ratio": float((st.cv_pred[m] - st.log_meas[m]).mean()),
                "mape_pct": float(ape_pct(st.cv_pred[m], st.log_meas[m]).mean()),
            }
    vt_full = np.asarray(st.res_full.residuals["e2e"])[st.is_vtrain]
    vt_rows = [r for r in e2e if r.source_name == VTRAIN]
    cells = {
        "layout (tp, pp, dp)": lambda r: (r.plan.tp, r.plan.pp, r.plan.dp),
        "per-GPU layer shape (tp, hidden, microbatch)": lambda r: (
            r.plan.tp,
            r.model.hidden,
            r.plan.microbatch,
        ),
        "both": lambda r: (r.plan.tp, r.plan.pp, r.plan.dp, r.model.hidden, r.plan.microbatch),
    }
    structure = {"full_fit_mape_pct": float(np.mean(np.abs(np.expm1(vt_full))) * 100)}
    for name, key in cells.items():
        keys = [key(r) for r in vt_rows]
        centred = vt_full.copy()
        for k in set(keys):
            m = np.array([x == k for x in keys])
            centred[m] -= vt_full[m].mean()
        structure[name] = {
            "cells": len(set(keys)),
            "mape_after_removing_cell_means_pct": float(np.mean(np.abs(np.expm1(centred))) * 100),
        }
    return pattern, structure


def check_targets(cv: dict, full: dict, fit_s: float, robust: dict) -> dict:
    vt = cv["by_source"].get(VTRAIN, {})
    targets = {
        "vtrain_cv_mape_pct": vt.get("mape_pct"),
        "vtrain_cv_max_ape_pct": vt.get("max_ape_pct"),
        "h100_cv_mape_pct": cv["h100"]["mape_pct"],
        "allreduce_mape_pct": full["allreduce"]["mape_pct"],
        "fit_s": fit_s,
        "robustness_ratio": robust["ratio"],
    }
    return {
        k: {
            "value": v,
            "limit": TARGETS[k],
            "ok": v is not None and (v < TARGETS[k] if k == "fit_s" else v <= TARGETS[k]),
        }
        for k, v in targets.items()
    }


def measure(args) -> tuple[list, dict]:
    st = Study(args)
    fit_info = fit_timing(st)
    st.full_problem()
    cross = cross_source(st)
    defaults = defaults_by_source(st)
    cv = grouped_cv(st)
    full = full_fit(st)
    robust = robustness(st)
    flat = identifiability(st)
    cv_plot = {
        "source": st.src,
        "log_meas": st.log_meas,
        "log_pred": st.cv_pred,
        "n_gpus": np.array([r.plan.n_gpus for r in st.e2e]),
        "tp": np.array([r.plan.tp for r in st.e2e]),
        "pp": np.array([r.plan.pp for r in st.e2e]),
    }
    cross_plot = {
        "log_meas": st.log_meas[st.idx_cs],
        "log_pred": st.cs_pred,
        "cluster": st.e2e_cluster[st.idx_cs],
    }
    plots = make_plots(Path(args.plots), cv_plot, st.ar_plot, cross_plot)
    cv_rows, worst, worst_by_source = cv_row_table(st)
    vt_pattern, vt_structure = vtrain_structure(st)
    st.timings["total_s"] = time.perf_counter() - st.t_start
    cfg = st.cfg
    fit_config = ("steps", "learning_rate", "huber_delta", "prior_weight", "tol", "patience")
    return cv_rows, {
        "by_source": cv["by_source"],
        "h100": cv["h100"],
        "cross_source": cross["metrics"],
        "allreduce_fit": {k: full["allreduce"][k] for k in ("mape_pct", "max_ape_pct")},
        "fit_s": fit_info["fit_s"],
        "robustness": robust,
        "flat_directions": flat,
        "targets": check_targets(cv, full, fit_info["fit_s"], robust),
        "details": {
            "quick": st.quick,
            "fit_config": {k: getattr(cfg, k) for k in fit_config},
            "cv": {
                "folds": st.n_folds,
                "folds_run": st.run_folds,
                "fold_rows": st.fold_rows,
                "fold_fits": cv["fold_fits"],
                "mapping_check_max_abs_log_diff": cv["mapping_check_max_abs_log_diff"],
                "h100_by_cluster": cv["h100_by_cluster"],
                "vtrain_by_tp_pp_dp": vt_pattern,
                "vtrain_structure": vt_structure,
                "worst_rows": worst,
                "worst_rows_by_source": worst_by_source,
            },
            "cross_source_by_cluster": cross["by_cluster"],
            "cross_source_by_seq_len": cross["by_seq_len"],
            "cross_source_fit": cross["fit"],
            "defaults_by_source": defaults,
            "allreduce_rows": full["allreduce"]["rows"],
            "allreduce_buckets": full["buckets"],
            "allreduce_by_cluster": full["by_cluster"],
            "full_fit": full["full_fit"],
            "fit_timing": fit_info,
            "timings": st.timings,
            "plots": plots,
        },
    }


# --------------------------------------------------------------------------------------------
# output


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--quick", action="store_true", help="smoke run: 40 steps, 2 of 5 folds")
    ap.add_argument("--plots", default=str(RESULTS), help="directory for the PNG plots")
    ap.add_argument("--data", default=str(DATA), help="shared data directory")
    steps_help = f"FitConfig.steps (default {F.FitConfig().steps})"
    ap.add_argument("--steps", type=int, default=None, help=steps_help)
    ap.add_argument("--folds", type=int, default=None, help="CV folds to run (of 5)")
    ap.add_argument("--out", default=str(RESULTS / "calibration_cv.json"), help="results JSON")
    ap.add_argument("--prior-weight", type=float, default=None, help="FitConfig.prior_weight")
    ap.add_argument("--huber-delta", type=float, default=None, help="FitConfig.huber_delta")
    ap.add_argument("--learning-rate", type=float, default=None, help="FitConfig.learning_rate")
    args = ap.parse_args(argv)
    with fresh_compilation_cache("calibration-cv-xla-"):
        cv_rows, result = measure(args)
    result = clean_json(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_csv = out.with_name(out.stem + "_rows.csv")
    with open(rows_csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(cv_rows[0]))
        writer.writeheader()
        writer.writerows(cv_rows)
    result["details"]["rows_csv"] = str(rows_csv)
    return finish(result, out, args.json, print_tables)


if __name__ == "__main__":
    sys.exit(main())
