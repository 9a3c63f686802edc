"""What ``transfer.py`` writes besides its JSON: the held-out rows as CSV, the plot of every
zero-shot group, and the text tables."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from cv_report import fmt, grouped_pred_meas

if TYPE_CHECKING:
    from transfer import Transfer


def write_rows(t: Transfer, preds: dict, path: Path) -> str:
    """Every held-out prediction of the zero-shot groups, one CSV row each."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["group", "row", "source", "cluster", "stack", "model", "seq_len", "n_gpus",
                    "tp", "pp", "dp", "microbatch", "measured_s", "predicted_s"])  # fmt: skip
        for (kind, name), (idx, pred, *_) in preds.items():
            for i, p in zip(idx, pred):
                r = t.e2e[i]
                w.writerow([f"{kind}: {name}", r.row, r.source_name, r.cluster.name, r.stack,
                            r.model.name, r.model.seq_len, r.plan.n_gpus, r.plan.tp, r.plan.pp,
                            r.plan.dp, r.plan.microbatch, f"{np.exp(t.log_meas[i]):.6g}",
                            f"{np.exp(p):.6g}"])  # fmt: skip
    return str(path)


def plot_zero_shot(t: Transfer, preds: dict, outdir: Path) -> str:
    labels, meas, pred = [], [], []
    for (kind, name), (idx, p, *_) in preds.items():
        labels += [f"{kind}: {name}"] * len(idx)
        meas.append(np.exp(t.log_meas[idx]))
        pred.append(np.exp(p))
    outdir.mkdir(parents=True, exist_ok=True)
    return grouped_pred_meas(
        outdir / "transfer_zero_shot.png",
        labels,
        np.concatenate(meas),
        np.concatenate(pred),
        "Zero-shot transfer: each group predicted by a fit that never saw it",
        "predicted s/iter (held out)",
    )


def print_tables(r: dict) -> None:
    print(f"{'group':44s} {'rows':>5s} {'MAPE%':>7s} {'bias%':>7s} {'max%':>7s} {'tau':>6s} "
          f"{'cover%':>7s} {'width%':>7s}")  # fmt: skip
    for g in r["groups"]:
        print(
            f"{g['kind'] + ': ' + g['name']:44s} {g['rows']:5d} {fmt(g['mape_pct']):>7s} "
            f"{fmt(g['bias_pct']):>7s} {fmt(g['max_ape_pct']):>7s} {fmt(g['kendall_tau'], 3):>6s} "
            f"{fmt(g['coverage_pct']):>7s} {fmt(g['median_width_pct']):>7s}"
        )
    if r["few_shot"]:
        print(f"\n{'few-shot (refit with k runs of the source)':44s} {'k':>3s} "
              f"{'MAPE% mean':>11s} {'worst draw':>11s}")  # fmt: skip
        for f in r["few_shot"]:
            print(f"{f['name']:44s} {f['k']:3d} {f['mape_pct_mean']:11.1f} "
                  f"{f['mape_pct_worst']:11.1f}")  # fmt: skip
    if r["suggested_vs_random"]:
        print(f"\n{'3 runs refitted: suggested vs random':44s} {'zero-shot':>10s} "
              f"{'suggested':>10s} {'random':>10s} {'worst':>7s}")  # fmt: skip
        for f in r["suggested_vs_random"]:
            cells = (f["zero_shot_mape_pct"], f["suggested_mape_pct"], f["random_mape_pct_mean"])
            print(f"{f['name']:44s} " + " ".join(f"{c:10.1f}" for c in cells)
                  + f" {f['random_mape_pct_worst']:7.1f}")  # fmt: skip
    print("\nsummary: " + ", ".join(f"{k} {fmt(v)}" for k, v in r["summary"].items()))
    for k, v in r["targets"].items():
        print(f"  {k:26s} {fmt(v['value'], 2):>8s}  limit {v['limit']}  "
              f"{'ok' if v['ok'] else 'MISSED'}")  # fmt: skip
    print(f"total {r['details']['seconds']:.0f} s")
