"""Tables and plots of the calibration benchmarks' results (``calibration_cv.py``,
``transfer.py``): what they print and draw, kept apart from what they measure."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import numpy as np

from calibration.heldout import ape_pct

MiB = 2**20


def clean_json(x):
    """``x`` with numpy scalars as Python numbers and non-finite floats as None (JSON-safe)."""
    if isinstance(x, dict):
        return {str(k): clean_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean_json(v) for v in x]
    if isinstance(x, np.floating | float):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def finish(result: dict, out: Path, as_json: bool, print_tables) -> int:
    """Write ``result`` as JSON to ``out``, print it (JSON or ``print_tables``) and return the
    exit status: 1 when a target in ``result["targets"]`` is missed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print_tables(result)
        print(f"wrote {out}")
    return 0 if all(v["ok"] for v in result["targets"].values()) else 1


def fmt(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# --------------------------------------------------------------------------------------------
# plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> str:
    """Lay out, write (110 dpi) and close a figure; its path."""
    plt = _pyplot()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def pred_meas_axes(ax, measured: np.ndarray, predicted: np.ndarray, labels=None) -> None:
    """Predicted against measured seconds per iteration on log axes, with y = x and a ±10%
    band; points coloured by ``labels`` when given."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    x, y = np.asarray(measured), np.asarray(predicted)
    lo, hi = min(x.min(), y.min()) / 1.3, max(x.max(), y.max()) * 1.3
    g = np.geomspace(lo, hi, 50)
    ax.fill_between(g, g * 0.9, g * 1.1, color="tab:green", alpha=0.15, label="±10%")
    ax.plot(g, g, "k-", lw=0.8, label="y = x")
    if labels is None:
        ax.scatter(x, y, s=6, alpha=0.6)
    else:
        for name in sorted(set(labels)):
            m = np.asarray(labels) == name
            ax.scatter(x[m], y[m], s=10, alpha=0.7, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    for axis in (ax.xaxis, ax.yaxis):
        if hi / lo < 100:  # under two decades: label 2x and 5x ticks too
            axis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
            axis.set_minor_formatter(FormatStrFormatter("%g"))
        else:
            axis.set_minor_formatter(NullFormatter())


def grouped_pred_meas(path: Path, groups, meas, pred, title: str, ylabel: str) -> str:
    """One predicted-vs-measured panel per group (``groups[i]`` names row i's group)."""
    plt = _pyplot()
    groups = np.asarray(groups)
    ok = np.isfinite(pred)
    names = sorted(set(groups[ok]))
    ncol = 4
    nrow = max(1, math.ceil(len(names) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 4.0 * nrow), squeeze=False)
    for ax, s in zip(axes.ravel(), names):
        m = ok & (groups == s)
        pred_meas_axes(ax, meas[m], pred[m])
        mape = float(np.mean(ape_pct(np.log(pred[m]), np.log(meas[m]))))
        ax.set_title(f"{s}\n{m.sum()} rows, MAPE {mape:.1f}%", fontsize=8)
        ax.set_xlabel("measured s/iter", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.legend(fontsize=6, loc="upper left")
    for ax in axes.ravel()[len(names) :]:
        ax.axis("off")
    fig.suptitle(title)
    return save(fig, path)


def _cv_residuals(path: Path, cv: dict) -> str:
    plt = _pyplot()
    src = cv["source"]
    ok = np.isfinite(cv["log_pred"])
    sources = sorted(set(src[ok]))
    resid = cv["log_pred"] - cv["log_meas"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    rng = np.random.default_rng(0)
    colors = {s: plt.cm.tab10(i % 10) for i, s in enumerate(sources)}
    for ax, key, label in zip(axes, ("n_gpus", "tp", "pp"), ("GPU count", "tp", "pp")):
        xv = np.asarray(cv[key], float)
        for s in sources:
            m = ok & (src == s)
            jit = np.exp(rng.uniform(-0.08, 0.08, m.sum()))
            ax.scatter(xv[m] * jit, resid[m], s=5, alpha=0.5, color=colors[s], label=s)
        ax.axhline(0, color="k", lw=0.8)
        for b in (np.log(1.1), np.log(0.9)):
            ax.axhline(b, color="tab:green", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("log(predicted / measured), CV")
    axes[0].legend(fontsize=6, markerscale=2)
    fig.suptitle("CV residuals (dashed: ±10%)")
    return save(fig, path)


def _allreduce(path: Path, ar: dict) -> str:
    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    size, n, meas_t, pred_t = ar["size"], ar["n"], ar["meas"], ar["pred"]
    for i, g in enumerate(sorted(set(n.tolist()))):
        m = n == g
        o = np.argsort(size[m])
        c = plt.cm.viridis(i / 7)
        sz = size[m][o]
        sel = o[np.unique(np.searchsorted(sz, np.geomspace(sz[0], sz[-1], 40)).clip(0, len(o) - 1))]
        ax.scatter(size[m][sel] / MiB, meas_t[m][sel] * 1e3, s=8, color=c)
        ax.plot(size[m][o] / MiB, pred_t[m][o] * 1e3, color=c, lw=1.2, label=f"{int(g)} GPUs")
        ax2.plot(size[m][o] / MiB, (pred_t[m][o] / meas_t[m][o] - 1) * 100, color=c, lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("all-reduce time (ms)")
    ax.set_title("vtrain-a100 all-reduce: measured (points), fitted (lines)")
    ax.legend(fontsize=7)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("message size (MiB)")
    ax2.set_ylabel("fit error (predicted / measured - 1), %")
    ax2.set_title("relative error per group size")
    return save(fig, path)


def _cross_source(path: Path, cross: dict) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    x, y = np.exp(cross["log_meas"]), np.exp(cross["log_pred"])
    pred_meas_axes(ax, x, y, labels=cross["cluster"])
    ax.set_xlabel("measured s/iter")
    ax.set_ylabel("predicted s/iter")
    ax.set_title(
        "cross-source: fit on vTrain + A100 all-reduce,\npredict MosaicML A100", fontsize=9
    )
    ax.legend(fontsize=7)
    return save(fig, path)


def make_plots(outdir: Path, cv: dict, ar: dict, cross: dict) -> list[str]:
    """calibration_cv's figures: CV predicted vs measured per source, CV residuals, the
    all-reduce fit of vtrain-a100, the cross-source scatter; their paths."""
    outdir.mkdir(parents=True, exist_ok=True)
    written = [
        grouped_pred_meas(
            outdir / "cv_pred_vs_measured.png",
            cv["source"],
            np.exp(cv["log_meas"]),
            np.exp(cv["log_pred"]),
            "Grouped 5-fold CV (by model shape): held-out predicted vs measured",
            "predicted s/iter (CV)",
        ),
        _cv_residuals(outdir / "cv_residuals.png", cv),
    ]
    if ar.get("size") is not None and len(ar["size"]):
        written.append(_allreduce(outdir / "allreduce_vtrain_a100.png", ar))
    if cross.get("log_meas") is not None and len(cross["log_meas"]):
        written.append(_cross_source(outdir / "cross_source_mosaic_a100.png", cross))
    return written


# --------------------------------------------------------------------------------------------
# tables

HEADER = f"{'':34s} {'rows':>5s} {'MAPE%':>7s} {'p90%':>7s} {'max%':>7s} {'tau':>6s}"


def metrics_row(name: str, m: dict) -> None:
    """One line of ``calibration.heldout.metrics`` figures under ``HEADER``."""
    print(
        f"{name:34s} {m['rows']:5d} {fmt(m['mape_pct']):>7s} {fmt(m['p90_ape_pct']):>7s} "
        f"{fmt(m['max_ape_pct']):>7s} {fmt(m['kendall_tau'], 3):>6s}"
    )


def _print_cv(r: dict) -> None:
    d = r["details"]
    cv = d["cv"]
    print(f"\n== grouped {cv['folds']}-fold CV by model shape ({cv['folds_run']} folds run, "
          f"fold rows {cv['fold_rows']}) ==")  # fmt: skip
    print(HEADER)
    for name, m in r["by_source"].items():
        metrics_row(name, m)
    metrics_row("h100 (all H100 clusters)", r["h100"])
    for name, m in cv["h100_by_cluster"].items():
        metrics_row(f"  {name}", m)
    print(f"mapping check (held-out predict vs weighted-problem residual): "
          f"{cv['mapping_check_max_abs_log_diff']:.2e} max |log diff|")  # fmt: skip
    for fi in cv["fold_fits"]:
        print(
            f"  fold {fi['fold']}: {fi['heldout_rows']} rows / {fi['heldout_shapes']} shapes held "
            f"out, {fi['steps']} steps ({'converged' if fi['converged'] else 'step limit'}), "
            f"{fi['fit_wall_s']:.1f} s, held-out MAPE {fi['heldout_mape_pct']:.1f}%"
        )
    if d["defaults_by_source"]:
        print("\n== datasheet defaults, no fit (reference) ==")
        print(HEADER)
        for name, m in d["defaults_by_source"].items():
            metrics_row(name, m)
    print("\n== vTrain CV residual by (tp, pp, dp) ==")
    for k, v in cv["vtrain_by_tp_pp_dp"].items():
        print(f"  {k:16s} rows {v['rows']:4d}  mean log(pred/meas) {v['mean_log_ratio']:+.3f}  "
              f"MAPE {v['mape_pct']:.1f}%")  # fmt: skip
    vs = cv["vtrain_structure"]
    print(
        f"\n== vTrain full-fit MAPE {vs['full_fit_mape_pct']:.2f}%; after removing the mean "
        "log residual per cell =="
    )
    for k, v in vs.items():
        if isinstance(v, dict):
            pct = v["mape_after_removing_cell_means_pct"]
            print(f"  {k:46s} {v['cells']:4d} cells  {pct:.2f}%")
    print("\n== worst CV rows ==")
    for w in cv["worst_rows"]:
        print(
            f"  {w['source'][:22]:22s} {w['model'][:20]:20s} {w['cluster']:18s} "
            f"gpus {w['n_gpus']:4d} tp {w['tp']} pp {w['pp']} dp {w['dp']:3d} "
            f"meas {w['measured_s']:.3g} pred {w['predicted_s']:.3g} APE {w['ape_pct']:.0f}%"
        )


def _print_cross_and_allreduce(r: dict) -> None:
    d = r["details"]
    print("\n== cross-source: fit vTrain + A100 all-reduce, predict MosaicML A100 ==")
    print(HEADER)
    metrics_row("mosaic A100 (40g + 80g)", r["cross_source"])
    for name, m in d["cross_source_by_cluster"].items():
        metrics_row(f"  {name}", m)
    for seq, m in d["cross_source_by_seq_len"].items():
        metrics_row(f"  seq {seq} (mean log ratio {m['mean_log_ratio']:+.2f})", m)
    a = r["allreduce_fit"]
    print(f"\n== all-reduce fit (full fit, size >= 1 MiB, group 2-8; {d['allreduce_rows']} rows):"
          f" MAPE {a['mape_pct']:.2f}%, max {a['max_ape_pct']:.1f}% ==")  # fmt: skip
    print(f"  {'bucket (MiB)':16s} {'rows':>6s} {'MAPE%':>7s} {'max%':>7s} {'mean log':>9s}")
    for b in d["allreduce_buckets"]:
        label = f"[{b['from_MiB']:g}, {b['to_MiB']:g}{']' if b['to_MiB'] == 1024 else ')'}"
        print(
            f"  {label:16s} {b['rows']:6d} {fmt(b['mape_pct']):>7s} {fmt(b['max_ape_pct']):>7s} "
            f"{fmt(b['mean_log_ratio'], 3):>9s}"
        )
    for name, m in d["allreduce_by_cluster"].items():
        mape, mx = m["mape_pct"], m["max_ape_pct"]
        print(f"  {name:20s} rows {m['rows']:6d}  MAPE {mape:.2f}%  max {mx:.1f}%")


def _print_fits(r: dict) -> None:
    d = r["details"]
    ff = d["full_fit"]
    ins = ", ".join(f"{k} {v:.1f}%" for k, v in ff["in_sample_mape_pct"].items())
    print(f"\n== full fit: {ff['steps']} steps, loss {ff['final_loss']:.5f}, in-sample {ins} ==")
    t = d["fit_timing"]
    print(
        f"\n== fit_s (A100 set {t['rows']}): {t['fit_s']:.1f} s = "
        f"build {t['build_problem_s']:.1f} s + fit {t['fit_call_s']:.1f} s; "
        f"{t['steps']} steps x {t['ms_per_step']:.1f} ms = "
        f"{t['steps_s_est']:.1f} s; compile (trace+lower+XLA) {t['compile_s']:.1f} s; "
        f"other {t['other_s_est']:.1f} s =="
    )
    print(
        "   compile parts: " + ", ".join(f"{k} {v:.1f} s" for k, v in t["compile_parts_s"].items())
    )
    rb = r["robustness"]
    print(
        f"\n== robustness (fold {rb['fold']}, {rb['corrupted_rows']} training e2e rows x3): "
        f"vTrain held-out MAPE {rb['clean_mape_pct']:.2f}% clean -> "
        f"{rb['corrupted_mape_pct']:.2f}% corrupted (ratio {fmt(rb['ratio'], 2)}) =="
    )


def _leaves_by_kind(names) -> dict:
    """{"kind:leaf": [device or cluster keys]} of flattened parameter names."""
    by_leaf = collections.defaultdict(list)
    for n in names:
        kind, key, leaf = n.split(":", 2)
        by_leaf[f"{kind}:{leaf}"].append(key)
    return by_leaf


def _print_identifiability(fd: dict) -> None:
    print(
        f"\n== identifiability: {fd['n_params']} raw constants, data-Hessian lambda_max "
        f"{fd['lambda_max_data']:.3g}; {fd['n_flat']} eigenvalues < {fd['threshold_rel']:g} x max; "
        f"{fd['n_untouched']} constants no row depends on =="
    )
    print("  constants inside the flat subspace (projection >= 0.5), by constant:")
    for k, v in sorted(_leaves_by_kind(fd["parameters"]).items()):
        print(f"  {k:44s} {', '.join(sorted(set(v)))}")
    print(
        f"  {fd['n_below_prior_curvature']} data eigenvalues are below the prior's curvature; "
        f"{len(fd['prior_dominated'])} constants are prior-dominated; share of "
        "rows with |log error| < huber_delta (the quadratic region): "
        + ", ".join(f"{k} {v:.0%}" for k, v in fd["rows_in_quadratic_huber_region"].items())
    )
    print("  prior-dominated constants (data curvature < the prior's):")
    for k, v in sorted(_leaves_by_kind(fd["prior_dominated"]).items()):
        print(f"    {k:42s} {', '.join(sorted(set(v)))}")
    if fd["directions"]:
        print("  flat combinations among constants that some row depends on:")
        for dd in fd["directions"][:25]:
            comp = ", ".join(f"{p['component']:+.2f} {p['name']}" for p in dd["params"])
            print(f"    {dd['relative']:.1e}: {comp}")
    for key, what in (
        ("gemm_shape_grid", "GEMM"),
        ("layer_shape_grid", "layer"),
        ("cluster_layer_grid", "cluster layer"),
        ("head_shape_grid", "LM head"),
    ):
        grid = fd.get(key, {})
        if grid:
            print(
                f"  {what} shape grid (held at its fit above; nodes some row depends on / "
                "moved >= 1%): "
                + ", ".join(
                    f"{k} {v['touched']}/{v['moved_1pct']} of {v['nodes']}" for k, v in grid.items()
                )
            )


def print_tables(r: dict) -> None:
    """calibration_cv's report as text tables."""
    d = r["details"]
    _print_cv(r)
    _print_cross_and_allreduce(r)
    _print_fits(r)
    _print_identifiability(r["flat_directions"])
    print("\n== targets ==")
    for k, v in r["targets"].items():
        ok = "ok" if v["ok"] else "MISSED"
        print(f"  {k:24s} {fmt(v['value'], 2):>8s}  limit {v['limit']:g}  {ok}")
    print(f"\nplots: {', '.join(d['plots'])}")
    print(f"total {d['timings']['total_s']:.0f} s")
