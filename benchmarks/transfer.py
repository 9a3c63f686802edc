"""How well the calibrated model predicts setups its fit has never seen: leave one source out,
leave one cluster out, and few-shot refits.

    python benchmarks/transfer.py [--json] [--quick] [--sources-only] [--groups A,B]
        [--no-few-shot] [--few-shot own|mean|descent|joint] [--suggest] [--design runs|mean]
        [--unseen mixture|population|defaults]
        [--device-layer-grid] [--no-stacks] [--no-family-parents] [--fits DIR]

This is the benchmark that decides between modelling choices: the runs a user asks about are
usually from a cluster, a framework or a scale no measurement covers.

1. **Zero-shot groups.** For every source and every cluster of ``e2e/calibration.csv`` with at
   least ``MIN_ROWS`` runs: fit on every other end-to-end run plus every collective and GEMM
   row (``calibration.fit.fit``, the shipped profiles' settings), then predict the held-out
   group without refitting (``calibration.heldout.Predictor``). A held-out cluster that no
   training run names gets ``--unseen``: the population of the clusters the fit has runs of,
   or the datasheet defaults (``defaults``); a held-out cluster with collective rows only
   keeps the network its collectives fit and takes the population for the rest
   (``heldout.fill_uninformed``). ``mixture`` (the default) predicts such a row once with
   each fitted cluster's constants (``heldout.population_mixture``; a GPU family without
   runs likewise takes each fitted family's ``E2E_ONLY_DEVICE_LEAVES``) and averages the log
   times, the predictive median over the population; ``population`` plugs in the mean
   constants (``heldout.population_row``), which predicts faster than that median (time is
   convex in the constants). Intervals' Jacobians and few-shot starts use the mean. Per
   group: rows, MAPE, bias (mean signed error, %), mean log(pred / meas), worst row, Kendall
   tau; ``coverage_pct`` and ``median_width_pct`` of the 80% intervals (``add_intervals``). A
   group equal to another (the cluster of a one-cluster source) reuses that fit.
2. **Few-shot.** Per source group: k = 3 and k = 10 of its runs (``DRAWS`` random draws each)
   refit the constants, warm-started from that source's zero-shot fit, and the source's other
   runs are predicted; per k the mean and the worst draw's MAPE. ``--few-shot own`` (the
   default) is ``diffcost calibrate``'s path for a handful of runs (``calibration.refit``):
   a maximum a posteriori update of the zero-shot fit's scalar constants by the k runs, the
   zero-shot prediction the prior's centre (where it is the population's median, every member
   shifted alike), its strength chosen by leave-one-out over the k runs (the held-out
   source's other runs are never used). ``--few-shot mean`` starts from the population's mean
   constants instead (calibrate's path before it kept the members). ``--few-shot descent`` is
   the earlier path, kept for comparison: the end-to-end level holds the k runs alone (the
   kernel and collective tables stay) and calibrate's Adam descent runs ``FEW_SHOT_STEPS``
   steps. ``--few-shot joint`` adds the k runs to the zero-shot training runs as one more
   source and continues the whole fit for ``FEW_SHOT_STEPS`` steps at ``FEW_SHOT_LR``
   (``Transfer.refit``).

``--suggest`` replaces 2. by ``suggested_vs_random``: 3 runs of each source picked by
``diffcost suggest``'s design on the zero-shot fit's Laplace posterior (minimising the mean
predictive variance of the source's runs; ``--design mean``: the variance of their mean log
time) against 3 random ones.
``--fits DIR`` keeps every zero-shot fit in ``DIR`` (``calibration.fit_cache``): a later run
with the same code, data and settings, e.g. ``--suggest`` after the few-shot run, reads them.
``--quick`` fits 60 steps, leaves out the cluster groups and runs one few-shot draw per k: a
smoke run, its figures are not the benchmark's. Results go to
``benchmarks/results/transfer.json`` (``--out``), the held-out rows to ``transfer_rows.csv``
beside it, and a plot of every held-out group to ``transfer_zero_shot.png``.

The few-shot refits are in ``transfer_few_shot.py``, the CSV, plot and tables in
``transfer_report.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from cv_report import clean_json, finish  # noqa: E402
from transfer_few_shot import DRAWS, few_shot, suggested_vs_random  # noqa: E402
from transfer_report import plot_zero_shot, print_tables, write_rows  # noqa: E402

from calibration import fit as F  # noqa: E402
from calibration import refit as refit_mod  # noqa: E402
from calibration.fit_cache import FitCache  # noqa: E402
from calibration.heldout import (  # noqa: E402
    Predictor,
    ape_pct,
    fill_uninformed,
    fresh_compilation_cache,
    load_data,
    map_tables,
    metrics,
    population_mixture,
    population_row,
    run_fit,
    subset,
    target_tables,
    trained_keys,
)
from calibration.posterior import group_stats, residual_sd  # noqa: E402
from diffcost.runs import FRAMEWORK_DEFAULTS  # noqa: E402
from diffcost.uncertainty import log_time_jacobians  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
RESULTS = Path(__file__).resolve().parent / "results"
MIN_ROWS = 8
FEW_SHOT_K = (3, 10)
FEW_SHOT_STEPS = 200
FEW_SHOT_LR = 0.03  # a warm start near the optimum: Adam's first steps move every constant ~lr
COVERAGE_TARGET = (70.0, 90.0)  # % of held-out runs inside their 80% interval
TARGETS = {"loso_max_mape_pct": 8.0, "loso_max_abs_bias_pct": 4.0, "loso_mean_mape_pct": 6.0,
           "few_shot_k10_mape_pct": 3.0, "median_width_pct": 30.0}  # fmt: skip


class Transfer:
    """The data, the shared problem and predictor, and the fits made so far."""

    def __init__(self, args):
        self.t0 = time.perf_counter()
        self.quiet = args.json
        self.quick = bool(args.quick)
        self.unseen = args.unseen
        knobs = {
            "device_layer_grid": args.device_layer_grid,
            "stacks": not args.no_stacks,
            "family_parents": not args.no_family_parents,
        }
        self.cfg = F.FitConfig(steps=60 if args.quick else F.FitConfig().steps, **knobs)
        self.few_cfg = F.FitConfig(
            steps=30 if args.quick else FEW_SHOT_STEPS, learning_rate=FEW_SHOT_LR, **knobs
        )
        self.few_shot = args.few_shot
        self.design = args.design
        # ``diffcost calibrate``'s settings (its learning rate, the stack's effect in the
        # cluster's own constants: the offsets the zero-shot fit found stay as they are) for
        # ``FEW_SHOT_STEPS`` steps from the warm start (``calibrate --steps``)
        self.own_cfg = F.FitConfig(
            steps=30 if args.quick else FEW_SHOT_STEPS, **{**knobs, "stacks": False}
        )
        self.refit_cfg = self.few_cfg if self.few_shot == "joint" else self.own_cfg
        self.meas = load_data(Path(args.data))
        self.e2e = self.meas.e2e
        self.src = np.array([r.source_name for r in self.e2e])
        self.cluster = np.array([r.cluster.name for r in self.e2e])
        self.P = F.build_problem(self.meas)
        self.log_meas = np.asarray(self.P.data["e2e"]["log_meas"], float)
        self.ones = {lvl: np.ones(self.P.counts[lvl]) for lvl in self.P.data}
        chunk = max(int((self.src == s).sum()) for s in set(self.src))
        n_fam, n_clu = len(self.P.families), len(self.P.clusters)
        self.predictor = Predictor(min(chunk, 512), n_fam, n_clu, self.cfg.temperature)
        # held-out row mask (bytes) -> (fit steps, tables, weights); on disk with ``--fits``
        self.zero_shot_fits: dict = {}
        self.refits: list = []  # (runs, strength leave-one-out chose) of each few-shot refit
        self.noise: dict = {}  # held-out row mask (bytes) -> the zero-shot fit's residual sd
        self.members: dict = {}  # held-out row mask (bytes) -> population_mixture (--unseen)
        self.cache = FitCache(args.fits, ROOT, Path(args.data))
        self.say(f"{len(self.e2e)} e2e, {self.P.counts['coll']} collective, "
                 f"{self.P.counts.get('gemm', 0)} GEMM rows")  # fmt: skip

    def say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def weights(self, train: np.ndarray) -> dict:
        """Per-level row weights: e2e rows in ``train``, each training source weighing one in
        total (``build_problem``'s rule, recomputed over the rows kept), every other row 1."""
        counts = {s: int((train & (self.src == s)).sum()) for s in set(self.src)}
        share = np.array([1.0 / max(counts[s], 1) for s in self.src])
        base = np.asarray(self.P.data["e2e"]["weight"], float)  # 1 / rows of the row's source
        return {**self.ones, "e2e": np.where(train, share / base, 0.0)}

    def fit(self, train: np.ndarray, cfg=None, init=None):
        w = self.weights(train)
        res, tables, wall = run_fit(
            self.P, subset(self.meas, e2e=train), w, cfg or self.cfg, init=init
        )
        return res, tables, w, wall

    def unseen_row(self, tables, w) -> dict | None:
        """What a cluster without training runs gets (``--unseen``; the mean constants for
        ``mixture`` too, where a single row is needed: intervals' Jacobians, few-shot starts)."""
        if self.unseen == "defaults":
            return None
        return population_row(self.P, tables, set(self.cluster[w["e2e"] > 0]))

    def filled(self, fitted: tuple) -> tuple:
        """A zero-shot fit whose clusters without training runs take the population's value
        for every constant their collectives do not read (``fill_uninformed``; ``--unseen``)."""
        steps, tables, w = fitted
        unseen = self.unseen_row(tables, w)
        if unseen is None:
            return fitted
        return steps, fill_uninformed(self.P, tables, w, unseen, self.cfg.temperature), w

    def predict(self, idx, tables, w, members=None) -> np.ndarray:
        """log predicted times of rows ``idx``; with ``members`` (``population_mixture``) the
        mean of the members' log predictions."""
        fams, clus = trained_keys(self.P, w)
        rows = [self.e2e[i] for i in idx]
        if members is not None:
            return self.predictor.mean_log(rows, self.P, members, fams, clus)
        return self.predictor(rows, self.P, tables, fams, clus, self.unseen_row(tables, w))

    def jacobians(self, idx, tables, w) -> np.ndarray:
        """``[rows, scalar constants]``: d log(predicted time) / d raw constant of each row
        (``diffcost.uncertainty``), with the constants the fit gives it."""
        fams, clus = trained_keys(self.P, w)
        rows = [self.e2e[i] for i in idx]
        unseen = self.unseen_row(tables, w)
        target, dev, clu = target_tables(rows, self.P, tables, fams, clus, unseen)
        d = target.data["e2e"]
        params = F.assemble(dev, clu, d["d"], d["c"], d["s"])
        _, jac = log_time_jacobians(d["model"], d["plan"], d["cluster"], params)
        return np.asarray(jac, dtype=float)

    def refit(self, held: np.ndarray, shot: np.ndarray) -> float:
        """MAPE on the held-out source's other runs after a refit with its runs ``shot``
        (indices), warm-started from the zero-shot fit (``--few-shot``); a cluster the
        zero-shot fit had no row of starts at the population's constants, and one still
        without runs after it is predicted as the zero-shot prediction does (``--unseen``: the
        median over the members of the population, which now counts the clusters of the runs
        ``shot``):

        * ``own`` (default): ``diffcost calibrate``'s path for a handful of runs,
          ``calibration.refit.refit`` of the shot runs from the zero-shot prediction itself:
          where that is the population's median (``--unseen mixture``), the refit starts from
          each member (``member_starts``, as ``calibration.command.member_starts``), predicts
          each run by their mean log time and shifts every member alike, and the other runs
          are predicted by the shifted members' mean log time.
        * ``mean``: calibrate's path before it kept the members: the refit starts from the
          population's mean constants (a plug-in, faster than the median it replaces).
        * ``descent``: the end-to-end level holds the shot runs alone (the collective and GEMM
          tables stay), calibrate's Adam descent for ``FEW_SHOT_STEPS`` steps.
        * ``joint``: the shot runs join the zero-shot training runs as one more source, and a
          short refit (``FEW_SHOT_STEPS`` at ``FEW_SHOT_LR``) continues the whole fit.
        """
        _, tables0, w0 = self.zero_shot_fits[held.tobytes()]
        picked = np.zeros_like(held)
        picked[shot] = True
        if self.few_shot == "joint":
            _, tables, w, _ = self.fit(~held | picked, self.few_cfg, init=tables0)
        else:
            start = self.population_start(tables0, w0)
            if self.few_shot == "descent":
                _, tables, w, _ = self.fit(picked, self.own_cfg, init=start)
            else:
                noise = self.residual_sd(held)
                if self.few_shot == "own" and self.members.get(held.tobytes()):
                    start = self.member_starts(held, w0)
                done = refit_mod.refit(self.P, start, shot, self.cfg.temperature, noise_sd=noise)
                tables, w = done.tables, w0
                self.refits.append((len(shot), done.strength))
            # clusters whose constants the zero-shot fit set still count as fitted
            w = {**w, "e2e": np.where((w0["e2e"] > 0) | picked, 1.0, 0.0)}
        rest = np.setdiff1d(np.flatnonzero(held), shot)
        if isinstance(tables, list):  # shifted members: every cluster's row is in each
            rows = [self.e2e[i] for i in rest]
            every = set(self.P.families), set(self.P.clusters)
            pred = self.predictor.mean_log(rows, self.P, [(m, None) for m in tables], *every)
        else:
            members = None  # a cluster still without runs: as in the zero-shot prediction
            if self.unseen == "mixture":
                members = population_mixture(self.P, tables, w, self.cfg.temperature)
            pred = self.predict(rest, tables, w, members)
        return float(ape_pct(pred, self.log_meas[rest]).mean())

    def member_starts(self, held: np.ndarray, w) -> list:
        """``--few-shot own``: the zero-shot fit's members (``population_mixture``), each
        with every cluster the fit has no runs of set to the member's constants, as
        ``population_start`` sets them to the mean's."""
        fams, clus = trained_keys(self.P, w)
        n_fam, n_clu = len(self.P.families), len(self.P.clusters)
        out = []
        for tables, row in self.members[held.tobytes()]:
            _, clu = map_tables(self.P, tables, fams, clus, self.P, n_fam, n_clu, row)
            out.append((tables[0], clu))
        return out

    def residual_sd(self, held: np.ndarray) -> float | None:
        """The zero-shot fit's residual spread on its own training runs, pooled over (source,
        cluster) groups (``posterior.residual_sd``, what ``diffcost calibrate`` reads from a
        profile's ``uncertainty`` block as the few-shot refit's ``noise_sd``)."""
        key = held.tobytes()
        if key not in self.noise:
            _, tables, w = self.zero_shot_fits[key]
            train = np.flatnonzero(w["e2e"] > 0)
            log_err = self.predict(train, tables, w) - self.log_meas[train]
            names = [(self.src[i], self.cluster[i]) for i in train]
            rows = {g: np.flatnonzero([n == g for n in names]) for g in set(names)}
            self.noise[key] = residual_sd(group_stats(log_err, rows))
        return self.noise[key]

    def population_start(self, tables, w) -> tuple[dict, dict]:
        """``tables`` with the cluster rows of clusters no weighted row of ``w`` names set to
        the population's constants (``unseen_row``), as their zero-shot prediction had them
        (``map_tables`` onto the same problem)."""
        unseen = self.unseen_row(tables, w)
        if unseen is None:
            return tables
        fams, clus = trained_keys(self.P, w)
        n_fam, n_clu = len(self.P.families), len(self.P.clusters)
        _, clu = map_tables(self.P, tables, fams, clus, self.P, n_fam, n_clu, unseen)
        return tables[0], clu


def group_metrics(pred: np.ndarray, meas: np.ndarray) -> dict:
    """``heldout.metrics`` plus the signed error: ``bias_pct`` (mean of pred / meas - 1, %) and
    the mean log ratio."""
    m = metrics(pred, meas)
    ratio = np.asarray(pred, float) - np.asarray(meas, float)
    m["bias_pct"] = float(np.mean(np.expm1(ratio)) * 100) if ratio.size else None
    m["mean_log_ratio"] = float(np.mean(ratio)) if ratio.size else None
    return m


def zero_shot(t: Transfer, kind: str, name: str, held: np.ndarray) -> tuple[dict, np.ndarray]:
    """Fit without the ``held`` rows and predict them; the group's figures and predictions."""
    key = held.tobytes()
    if key not in t.zero_shot_fits:
        fitted = t.cache.get(held, t.cfg)
        if fitted is None:
            res, tables, w, wall = t.fit(~held)
            fitted = (res.steps, tables, w)
            t.cache.put(held, t.cfg, fitted)
            t.say(f"{kind} {name}: fit without {held.sum()} rows, {res.steps} steps, {wall:.0f} s")
        else:
            t.say(f"{kind} {name}: fit without {held.sum()} rows read from {t.cache.folder}")
        t.zero_shot_fits[key] = t.filled(fitted)
        if t.unseen == "mixture":
            t.members[key] = population_mixture(t.P, fitted[1], fitted[2], t.cfg.temperature)
    _, tables, w = t.zero_shot_fits[key]
    idx = np.flatnonzero(held)
    pred = t.predict(idx, tables, w, t.members.get(key))
    m = group_metrics(pred, t.log_meas[idx])
    worst = int(idx[np.argmax(ape_pct(pred, t.log_meas[idx]))])
    r = t.e2e[worst]
    m.update(
        kind=kind,
        name=name,
        coverage_pct=None,
        median_width_pct=None,
        worst_row={
            "row": r.row,
            "model": r.model.name,
            "cluster": r.cluster.name,
            "source": r.source_name,
            "n_gpus": r.plan.n_gpus,
            "tp": r.plan.tp,
            "pp": r.plan.pp,
            "dp": r.plan.dp,
        },  # fmt: skip
    )
    t.say(f"{kind} {name}: MAPE {m['mape_pct']:.1f}%, bias {m['bias_pct']:+.1f}%")
    return m, pred


def stack_seen(t: Transfer, idx: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Per held-out row: whether a training run shares its cluster and software stack (the
    rule ``diffcost.uncertainty`` applies: only then is no stack spread added)."""
    seen = {(t.cluster[i], t.e2e[i].stack) for i in np.flatnonzero(~held)}
    return np.array([(t.cluster[i], t.e2e[i].stack) in seen for i in idx])


def add_intervals(groups: list, preds: dict, t: Transfer) -> None:
    """``coverage_pct`` and ``median_width_pct`` of each group's 80% intervals, built as
    ``diffcost.uncertainty`` builds them (log-normal, ``exp(+-1.2816 sigma)``) with spreads
    measured on the *other* groups of the same kind, so a group never sets its own width:
    the residual spread (pooled within-group sd of their held-out log errors) always, the stack
    spread (root mean square of their mean log errors) where no training run shares the row's
    cluster and stack. The Laplace term of the constants' posterior, small beside these, is
    left out (``details.interval_note``)."""
    for g in groups:
        others = [h for h in groups if h["kind"] == g["kind"] and h["name"] != g["name"]]
        if not others:
            continue
        logs = [preds[(h["kind"], h["name"])][2] for h in others]
        residual = float(np.sqrt(np.mean([np.var(x, ddof=1) for x in logs if x.size > 1])))
        stack = float(np.sqrt(np.mean([np.mean(x) ** 2 for x in logs])))
        idx, pred, log_err, seen = preds[(g["kind"], g["name"])]
        sigma = np.sqrt(residual**2 + np.where(seen, 0.0, stack**2))
        half = 1.2816 * sigma
        inside = np.abs(log_err) <= half
        g["coverage_pct"] = float(100 * inside.mean())
        g["median_width_pct"] = float(100 * np.median(np.exp(half) - np.exp(-half)))
        g["interval_sd"] = {
            "residual": residual,
            "stack": stack,
            "stack_seen_rows": int(seen.sum()),
        }


def _groups(t: Transfer, quick: bool, names=None) -> list[tuple[str, str, np.ndarray]]:
    """(kind, name, held-out mask) of every group with ``MIN_ROWS`` runs; only the sources with
    ``quick``; only those named in ``names`` when given (an unknown name raises ValueError)."""
    groups = [("source", s, t.src == s) for s in sorted(set(t.src))]
    if not quick or names:
        groups += [("cluster", c, t.cluster == c) for c in sorted(set(t.cluster))]
    groups = [g for g in groups if g[2].sum() >= MIN_ROWS]
    if names:
        known = {g[1] for g in groups}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"--groups: {', '.join(unknown)} is not a source or cluster with "
                             f"{MIN_ROWS}+ runs; valid: {', '.join(sorted(known))}")  # fmt: skip
        groups = [g for g in groups if g[1] in names]
    return groups


def summary(groups: list, few: list) -> dict:
    loso = [g for g in groups if g["kind"] == "source"]
    k10 = [f["mape_pct_mean"] for f in few if f["k"] == 10]
    cov = [g["coverage_pct"] for g in loso if g["coverage_pct"] is not None]
    width = [g["median_width_pct"] for g in loso if g["median_width_pct"] is not None]
    return {
        "loso_mean_mape_pct": float(np.mean([g["mape_pct"] for g in loso])) if loso else None,
        "loso_max_mape_pct": max((g["mape_pct"] for g in loso), default=None),
        "loso_max_abs_bias_pct": max((abs(g["bias_pct"]) for g in loso), default=None),
        "loco_mean_mape_pct": float(
            np.mean([g["mape_pct"] for g in groups if g["kind"] == "cluster"] or [np.nan])
        ),  # fmt: skip
        "coverage_pct": float(np.mean(cov)) if cov else None,
        "median_width_pct": float(np.mean(width)) if width else None,
        "few_shot_k10_mape_pct": float(np.mean(k10)) if k10 else None,
    }


def measure(args) -> dict:
    t = Transfer(args)
    groups, preds = [], {}
    names = [n for n in args.groups.split(",") if n] if args.groups else None
    for kind, name, held in _groups(t, t.quick or args.sources_only, names):
        m, pred = zero_shot(t, kind, name, held)
        groups.append(m)
        idx = np.flatnonzero(held)
        preds[(kind, name)] = (idx, pred, pred - t.log_meas[idx], stack_seen(t, idx, held))
    add_intervals(groups, preds, t)
    few, suggested = [], []
    if args.suggest:
        sources = [g for g in groups if g["kind"] == "source"]
        suggested = [suggested_vs_random(t, g) for g in sources if g["rows"] > 5]
    elif not args.no_few_shot:
        for g in (g for g in groups if g["kind"] == "source"):
            held = t.src == g["name"]
            for k in FEW_SHOT_K:
                if held.sum() > k + 2:
                    few.append(few_shot(t, g["name"], held, k, 1 if t.quick else DRAWS))
    plot = plot_zero_shot(t, preds, Path(args.plots)) if args.plots else None
    rows_csv = write_rows(t, preds, Path(args.out).with_name(Path(args.out).stem + "_rows.csv"))
    s = summary(groups, few)
    return {
        "groups": groups,
        "few_shot": few,
        "suggested_vs_random": suggested,
        "summary": s,
        "targets": {
            **{
                k: {"value": s[k], "limit": v, "ok": s[k] is not None and s[k] <= v}
                for k, v in TARGETS.items()
            },
            "coverage_pct": {
                "value": s["coverage_pct"],
                "limit": list(COVERAGE_TARGET),
                "ok": s["coverage_pct"] is not None
                and COVERAGE_TARGET[0] <= s["coverage_pct"] <= COVERAGE_TARGET[1],
            },
        },
        "details": {
            "quick": t.quick,
            "unseen_cluster": t.unseen,
            "fit_steps": t.cfg.steps,
            "device_layer_grid": t.cfg.device_layer_grid,
            "stacks": t.cfg.stacks,
            "family_parents": t.cfg.family_parents,
            "few_shot": t.few_shot,
            "groups_selected": bool(args.groups),
            "few_shot_steps": None if t.few_shot == "own" else t.refit_cfg.steps,
            "few_shot_learning_rate": None if t.few_shot == "own" else t.refit_cfg.learning_rate,
            "few_shot_strengths": [{"runs": k, "strength": a} for k, a in t.refits],
            "frameworks": sorted(FRAMEWORK_DEFAULTS),
            "plot": plot,
            "interval_note": "80% intervals: residual and stack spreads from the other groups "
            "of the same kind; the Laplace term of the posterior is left out",
            "rows_csv": rows_csv,
            "seconds": time.perf_counter() - t.t0,
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--quick", action="store_true", help="smoke run (see the module docstring)")
    ap.add_argument("--no-few-shot", action="store_true", help="zero-shot groups only")
    ap.add_argument("--few-shot", choices=("own", "mean", "descent", "joint"), default="own",
                    help="how a few-shot refit uses the other runs (Transfer.refit)")  # fmt: skip
    ap.add_argument("--sources-only", action="store_true", help="leave out the cluster groups")
    ap.add_argument("--groups", default="",
                    help="only these comma-separated sources or clusters (the summary then "
                         "covers them alone)")  # fmt: skip
    ap.add_argument("--suggest", action="store_true",
                    help="few-shot with 3 suggested runs of each source vs 3 random")  # fmt: skip
    ap.add_argument("--design", choices=("runs", "mean"), default="runs",
                    help="--suggest: minimise the runs' mean variance, or the variance of "
                         "their mean log time")  # fmt: skip
    ap.add_argument("--unseen", choices=("population", "mixture", "defaults"),
                    default="mixture",
                    help="constants of a held-out cluster no training run names")  # fmt: skip
    ap.add_argument("--device-layer-grid", action="store_true",
                    help="fit the device layer shape grid too (FitConfig)")  # fmt: skip
    ap.add_argument("--no-stacks", action="store_true",
                    help="hold the software stack offsets at 0 (FitConfig)")  # fmt: skip
    ap.add_argument("--no-family-parents", action="store_true",
                    help="centre every device prior on the defaults (FitConfig)")  # fmt: skip
    ap.add_argument("--data", default=str(DATA), help="shared data directory")
    ap.add_argument("--fits", default="",
                    help="folder keeping the zero-shot fits: a later run with the same "
                         "code, data and settings reads them (calibration.fit_cache)")  # fmt: skip
    ap.add_argument("--plots", default=str(RESULTS), help="directory for the PNG plot ('' none)")
    ap.add_argument("--out", default=str(RESULTS / "transfer.json"), help="results JSON")
    args = ap.parse_args(argv)
    with fresh_compilation_cache("transfer-xla-"):
        result = clean_json(measure(args))
    return finish(result, Path(args.out), args.json, print_tables)


if __name__ == "__main__":
    sys.exit(main())
