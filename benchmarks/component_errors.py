"""Which part of a composed iteration time does the cross-validated model get wrong?

    python benchmarks/component_errors.py [--cv-rows CSV] [--cells] [--source NAME] [--data DIR]
        [--json]

``layer_composition.py`` shows that within a cell (rows that differ only in layer count ``L``
and global batch) the measured times follow ``t = a + b L + n (c + d L)`` exactly (``n``
microbatches): ``d`` per layer and microbatch, ``c`` per microbatch (LM head, loss, host step),
``b`` per layer and iteration, ``a`` per iteration. diffcost's prediction has the same form. This
fits the four to the measured and to the held-out predicted times of every cell (predictions
from ``calibration_cv.py``'s rows file, or with ``--cv-rows benchmarks/results/transfer_rows.csv``
the zero-shot ones of the ``transfer.py`` group that leaves the source out) and reports the
source's error when the predicted components are replaced by the measured ones, one group at a
time:

* ``none`` (the held-out error as predicted), ``d``, ``c``, ``a+b``, ``c+d`` and ``all``: how
  much of the error each component carries (errors of different components can cancel, so
  fixing one alone can make the total worse);
* ``smooth_c_d``: the best a smooth correction of ``c`` and ``d`` could do without seeing the
  cell: per per-GPU layer shape (tp, hidden, microbatch) the log ratio measured / predicted of
  ``c`` and of ``d`` (mean over its pipeline and data-parallel layouts) is fitted, leaving that
  shape out, by a polynomial of degree 1 or 2 in log2 tp, log2 hidden and log2 microbatch, and
  the prediction is corrected by it. No better than no correction means the per-shape errors
  are not a smooth function of the shape: a physical term would have to follow them cell by
  cell.

``--cells`` also prints the mean log(predicted / measured) per tensor-parallel size (as
predicted, with the measured ``d``, with the measured ``c``) and ``c`` and ``d``, measured and
predicted, per per-GPU layer shape (mean over its single-stage layouts, whose ``d`` is the whole
model's per layer).

Pure data analysis of committed files, no fit: runs in about a second.
"""

from __future__ import annotations

import collections
import csv
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_rows  # noqa: E402  (sibling script modules, found however this one is loaded)
import layer_composition  # noqa: E402

CV_ROWS = Path(__file__).resolve().parent / "results" / "calibration_cv_rows.csv"
DEFAULT_SOURCE = "vtrain_ground_truth_single"
VARIANTS = {"none": (), "d": (3,), "c": (2,), "a+b": (0, 1), "c+d": (2, 3), "all": (0, 1, 2, 3)}
SHAPE = ("tp", "hidden", "microbatch")


def _stats(ape) -> dict:
    a = 100.0 * np.asarray(ape)
    return {
        "mape_pct": float(a.mean()),
        "p90_ape_pct": float(np.percentile(a, 90)),
        "max_ape_pct": float(a.max()),
    }


def cells_with_predictions(rows, cv_rows) -> dict:
    """{cell key: ([(layers, microbatches, measured)], [(layers, microbatches, predicted)],
    layer shape, pp)} of the e2e rows (numbered, ``e2e_rows.rows(..., numbered=True)``) that
    have a held-out prediction (``cv_rows`` name their data row)."""
    pred = {r["row"]: float(r.get("cv_predicted_s") or r["predicted_s"]) for r in cv_rows}
    index = {k: i for i, k in enumerate(layer_composition.CELL_KEY)}
    out = collections.defaultdict(lambda: ([], []))
    for r in rows:
        if r["row"] not in pred:
            continue
        for key, points in layer_composition.cells([r]).items():
            ((layers, n, t),) = points
            out[key][0].append((layers, n, t))
            out[key][1].append((layers, n, pred[r["row"]]))
    return {
        k: (meas, pred, tuple(int(k[index[s]]) for s in SHAPE), k[index["pp"]])
        for k, (meas, pred) in out.items()
    }


def _features(shape, degree: int) -> list[float]:
    x = np.log2(np.asarray(shape, dtype=float))
    f = [1.0]
    for d in range(1, degree + 1):
        for comb in itertools.combinations_with_replacement(range(len(x)), d):
            f.append(float(np.prod(x[list(comb)])))
    return f


def analyse(cells: dict) -> dict:
    fits = {}
    single_stage = collections.defaultdict(list)
    for key, (measured, predicted, shape, pp) in cells.items():
        fit_m, fit_p = layer_composition.fit_cell(measured), layer_composition.fit_cell(predicted)
        if fit_m is None or fit_p is None:  # fewer than five rows, or rank-deficient
            continue
        v = np.asarray(measured, dtype=float)
        meas, pred = fit_m[0], fit_p[0]
        fits[key] = (layer_composition.design(v[:, 0], v[:, 1]), v[:, 2], meas, pred, shape)
        if pp == "1":
            single_stage[shape].append(np.concatenate([meas[2:], pred[2:]]))
    if not fits:
        return {}
    out = {"cells": len(fits), "rows": int(sum(len(f[1]) for f in fits.values()))}
    out["mean_log_by_tp"] = {}
    for name, cols in VARIANTS.items():
        ape, by_tp = [], collections.defaultdict(list)
        for x, t, meas, pred, shape in fits.values():
            coef = pred.copy()
            coef[list(cols)] = meas[list(cols)]
            ape.append(np.abs(x @ coef / t - 1))
            by_tp[shape[0]].append(np.log(x @ coef / t))
        out[f"fix_{name}"] = _stats(np.concatenate(ape))
        out["mean_log_by_tp"][name] = {
            tp: float(np.mean(np.concatenate(v))) for tp, v in sorted(by_tp.items())
        }
    # per-shape log ratios of c and d (cells whose c is not positive in both are left out)
    ratios = collections.defaultdict(list)
    for *_, meas, pred, shape in fits.values():
        if min(meas[2], pred[2], meas[3], pred[3]) > 0:
            ratios[shape].append(np.log([meas[2] / pred[2], meas[3] / pred[3]]))
    shapes = sorted(ratios)
    y = np.array([np.mean(ratios[s], axis=0) for s in shapes])
    out["layer_shapes"] = [
        dict(
            zip(SHAPE, shape),
            **dict(zip(("c_ms", "d_ms", "c_pred_ms", "d_pred_ms"), 1e3 * np.mean(v, axis=0))),
        )
        for shape, v in sorted(single_stage.items())
    ]
    for degree in (1, 2):
        feats = np.array([_features(s, degree) for s in shapes])
        if len(shapes) <= feats.shape[1] + 1:
            continue
        corr = {}
        for j, s in enumerate(shapes):
            keep = np.arange(len(shapes)) != j
            w = np.linalg.lstsq(feats[keep], y[keep], rcond=None)[0]
            corr[s] = feats[j] @ w
        ape = []
        for x, t, _, pred, shape in fits.values():
            coef = pred.copy()
            if shape in corr:
                coef[2:] = pred[2:] * np.exp(corr[shape])
            ape.append(np.abs(x @ coef / t - 1))
        out[f"smooth_c_d_degree{degree}"] = {
            "layer_shapes": len(shapes),
            **_stats(np.concatenate(ape)),
        }
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cv_path = CV_ROWS
    if "--cv-rows" in argv:
        i = argv.index("--cv-rows")
        if i + 1 >= len(argv):
            print("error: --cv-rows needs a file", file=sys.stderr)
            return 2
        cv_path = Path(argv[i + 1])
        del argv[i : i + 2]
    cells_table = "--cells" in argv
    if cells_table:
        argv.remove("--cells")
    if "--source" not in argv:
        argv += ["--source", DEFAULT_SOURCE]
    args = e2e_rows.parse(__doc__, argv)
    rows = e2e_rows.rows(args, numbered=True)
    if rows is None:
        return 2
    if not cv_path.is_file():
        print(
            f"error: --cv-rows {str(cv_path)!r}: no such file "
            "(python benchmarks/calibration_cv.py writes it)",
            file=sys.stderr,
        )
        return 2
    with open(cv_path, newline="", encoding="utf-8") as fh:
        held_out = f"source: {args.source}"  # transfer.py's rows file: the source left out
        cv_rows = [
            r
            for r in csv.DictReader(fh)
            if r["source"] == args.source and r.get("group", held_out) == held_out
        ]
    cells = cells_with_predictions(rows, cv_rows)
    result = analyse(cells)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if not result:
        print(f"{args.source}: no cell with five held-out predictions that pin a, b, c, d down")
        return 0
    print(
        f"{args.source}: {result['cells']} cells, {result['rows']} rows; held-out error with the "
        "predicted components replaced by the measured ones:"
    )
    for k, v in result.items():
        if isinstance(v, dict) and "mape_pct" in v:
            print(
                f"  {k:22s} MAPE {v['mape_pct']:5.2f}%  p90 {v['p90_ape_pct']:5.1f}%  "
                f"max {v['max_ape_pct']:5.1f}%"
            )
    if cells_table:
        print("mean log(predicted / measured) by tp, as predicted and with the measured d or c:")
        for name in ("none", "d", "c"):
            by_tp = result["mean_log_by_tp"][name]
            print(f"  {name:4s} " + "  ".join(f"tp {tp}: {v:+.3f}" for tp, v in by_tp.items()))
        print("per layer shape, mean over its pp = 1 layouts: measured / predicted, ms")
        for r in result["layer_shapes"]:
            print(
                f"  tp {r['tp']:2d} hidden {r['hidden']:5d} microbatch {r['microbatch']:2d}: "
                f"c {r['c_ms']:6.2f} / {r['c_pred_ms']:6.2f}   "
                f"d {r['d_ms']:6.3f} / {r['d_pred_ms']:6.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
