"""MLPerf Training v4.0: predicted against measured seconds per optimizer step, per benchmark.

Reads ``e2e/mlperf_training_v4.0.csv`` of the shared data (``calibration.mlperf``: BERT-large,
Llama-2 70B LoRA, ResNet-50, SSD, 3D U-Net and DLRM-DCNv2 are represented, R-GAT and Stable
Diffusion listed with the reason), predicts every represented row

* **zero-shot**: on its cluster's shipped profiles and its implementation's stack
  (``diffcost.profiles.params_for``), nothing fitted to MLPerf;
* **calibrated**: with stack offsets fitted to the rows of the other half of the benchmark's
  submitters (``calibration.mlperf_fit``; each half predicts the other, so every row gets one
  held-out prediction),

and reports the mean absolute percentage error per benchmark and per accelerator.

    python benchmarks/workloads_mlperf.py [--json] [--quick] [--out FILE.json] [--rows FILE.csv]
        [--benchmarks bert,dlrm_dcnv2]

``measure(quick)`` returns the same dictionary for ``benchmarks/workloads.py``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

from calibration import mlperf  # noqa: E402
from calibration import mlperf_fit as fit  # noqa: E402
from calibration.mlperf_models import DlrmRecord, GraphRecord  # noqa: E402
from calibration.mlperf_rows import DlrmRows, GraphRows  # noqa: E402
from calibration.records import ReaderError  # noqa: E402

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
QUICK_STEPS = 100  # Adam steps per fit with --quick (full: FitSettings.steps)


def _mape(pred_s, meas_s) -> float | None:
    if len(meas_s) == 0:
        return None
    return float(np.mean(np.abs(np.asarray(pred_s) / np.asarray(meas_s) - 1.0)) * 100.0)


def _row_set(records):
    """The fit's row set of one benchmark's records (all of one kind)."""
    if isinstance(records[0], GraphRecord):
        return GraphRows.of(records)
    if isinstance(records[0], DlrmRecord):
        return DlrmRows.of(records)
    return fit.Rows.of(records)


def _predict(records, bench: np.ndarray, halves: np.ndarray, settings):
    """(zero-shot, held-out calibrated) seconds of every record, one benchmark at a time."""
    zero, calibrated = np.zeros(len(records)), np.zeros(len(records))
    for b in sorted(set(bench)):
        idx = np.flatnonzero(bench == b)
        rows = _row_set([records[i] for i in idx])
        zero[idx] = np.exp(np.asarray(fit.predict_log(rows, np.zeros(rows.n_offsets))))
        log_pred, _ = fit.heldout_log_pred(rows, halves[idx], settings)
        calibrated[idx] = np.exp(log_pred)
    return zero, calibrated


def _halves(records, csv_rows, bench: np.ndarray) -> np.ndarray:
    halves = np.zeros(len(records), dtype=int)
    for b in set(bench):
        idx = np.flatnonzero(bench == b)
        subs = [csv_rows[records[i].row - 1].submitter for i in idx]
        halves[idx] = fit.submitter_halves(subs)
    return halves


def _summary(keys, measured, zero, calibrated) -> dict:
    out = {}
    for k in sorted(set(keys)):
        sel = np.asarray(keys) == k
        out[k] = {
            "rows": int(sel.sum()),
            "mape_pct_zero_shot": _mape(zero[sel], measured[sel]),
            "mape_pct_calibrated": _mape(calibrated[sel], measured[sel]),
        }
    return out


def measure(quick: bool = False, data: Path = DATA, benchmarks=None) -> dict:
    """Rows, predictions and MAPE per benchmark (``"mlperf"``), per accelerator
    (``"mlperf_by_accelerator"``), the rows not represented with the reason
    (``"mlperf_not_represented"``) and every predicted row (``"mlperf_rows"``); only the
    benchmarks named in ``benchmarks`` when given (the others report no predicted row)."""
    t0 = time.perf_counter()
    csv_rows, meas = mlperf.load(Path(data) / "e2e" / "mlperf_training_v4.0.csv")
    records = meas.e2e
    if benchmarks is not None:
        records = [r for r in records if r.source_name.split("/")[-1] in benchmarks]
    settings = fit.FitSettings(steps=QUICK_STEPS) if quick else fit.FitSettings()
    bench = np.array([r.source_name.split("/")[-1] for r in records])
    halves = _halves(records, csv_rows, bench)
    measured = np.array([r.measured_iter_s for r in records])
    zero, calibrated = _predict(records, bench, halves, settings)
    accel = [csv_rows[r.row - 1].accelerator for r in records]
    per_bench = _summary(bench, measured, zero, calibrated)
    out = {}
    for b in mlperf.BENCHMARKS:
        n_rows = sum(r.benchmark == b for r in csv_rows)
        got = per_bench.get(b, {"rows": 0, "mape_pct_zero_shot": None, "mape_pct_calibrated": None})
        out[b] = {
            "rows": n_rows,
            "predicted": got["rows"],
            "mape_pct_zero_shot": got["mape_pct_zero_shot"],
            "mape_pct_calibrated": got["mape_pct_calibrated"],
        }
    by_line = {r.where.line: r for r in csv_rows}
    skipped = [
        {
            "line": w.line,
            "submitter": by_line[w.line].submitter,
            "system": by_line[w.line].system,
            "benchmark": by_line[w.line].benchmark,
            "reason": why,
        }
        for w, why in meas.skipped
    ]
    per_row = [
        {
            "line": r.where.line,
            "submitter": csv_rows[r.row - 1].submitter,
            "system": csv_rows[r.row - 1].system,
            "benchmark": b,
            "accelerator": a,
            "cluster": r.cluster.name,
            "n_gpus": csv_rows[r.row - 1].n_gpus,
            "half": int(h),
            "measured_s": float(m),
            "zero_shot_s": float(z),
            "calibrated_s": float(c),
            "assumptions": "; ".join(r.defaults),
        }
        for r, b, a, h, m, z, c in zip(records, bench, accel, halves, measured, zero, calibrated)
    ]
    return {
        "mlperf": out,
        "mlperf_by_accelerator": _summary(accel, measured, zero, calibrated),
        "mlperf_not_represented": skipped,
        "mlperf_rows": per_row,
        "mlperf_fit_steps": settings.steps,
        "mlperf_seconds": time.perf_counter() - t0,
    }


def _print(res: dict) -> None:
    def pct(v):
        return "    -" if v is None else f"{v:5.1f}"

    print(f"{'benchmark':<18} rows  predicted  MAPE zero-shot  MAPE calibrated (held-out half)")
    for b, v in res["mlperf"].items():
        zs, cal = pct(v["mape_pct_zero_shot"]), pct(v["mape_pct_calibrated"])
        print(f"{b:<18} {v['rows']:4d}  {v['predicted']:9d}  {zs:>13}%  {cal:>14}%")
    print(f"\n{'accelerator':<26} rows  MAPE zero-shot  MAPE calibrated")
    for a, v in res["mlperf_by_accelerator"].items():
        zs, cal = pct(v["mape_pct_zero_shot"]), pct(v["mape_pct_calibrated"])
        print(f"{a:<26} {v['rows']:4d}  {zs:>13}%  {cal:>14}%")
    reasons: dict[str, int] = {}
    for s in res["mlperf_not_represented"]:
        reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
    print("\nrows not represented:")
    for why, n in reasons.items():
        print(f"  {n:3d}  {why}")
    print(f"\n({res['mlperf_fit_steps']} fit steps, {res['mlperf_seconds']:.0f} s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} fit steps per half")
    ap.add_argument("--data", type=Path, default=DATA, help="shared data directory")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    ap.add_argument("--rows", type=Path, help="write every predicted row to this CSV")
    ap.add_argument(
        "--benchmarks",
        metavar="B,B",
        help=f"only these benchmarks (comma-separated; of {', '.join(mlperf.BENCHMARKS)})",
    )
    args = ap.parse_args(argv)
    subset = None
    if args.benchmarks:
        subset = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
        unknown = sorted(set(subset) - set(mlperf.BENCHMARKS))
        if unknown:
            print(
                f"error: --benchmarks {unknown}: not benchmarks; valid: "
                f"{', '.join(mlperf.BENCHMARKS)}",
                file=sys.stderr,
            )
            return 2
    path = args.data / "e2e" / "mlperf_training_v4.0.csv"
    if not path.is_file():
        print(f"error: --data {str(args.data)!r}: no {path.name} in its e2e/", file=sys.stderr)
        return 2
    try:
        res = measure(args.quick, args.data, subset)
    except ReaderError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.rows:
        with open(args.rows, "w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=list(res["mlperf_rows"][0]))
            w.writeheader()
            w.writerows(res["mlperf_rows"])
    summary = {k: v for k, v in res.items() if k != "mlperf_rows"}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        _print(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
