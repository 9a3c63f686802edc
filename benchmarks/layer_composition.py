"""Are a source's iteration times composed from per-layer profiles?

    python benchmarks/layer_composition.py [--source NAME] [--data DIR] [--json]

A cell is a set of end-to-end rows that differ only in the layer count ``L`` and the global
batch (same hidden size, heads, sequence, cluster, precision, layout, microbatch, recompute and
ZeRO stage). Within a cell, any schedule of identical layers takes

    t = a + b L + n (c + d L),    n = global_batch / (microbatch * dp) microbatches,

to first order: ``d`` per layer and microbatch, ``c`` per microbatch whatever the layers (LM
head, loss, host step), ``b`` per layer and iteration (optimizer, gradient sync, the pipeline
fill's layer share), ``a`` per iteration. This fits the four by least squares in every cell with
more rows than unknowns and reports the largest relative residual. Independently measured
runs would not follow the form to four digits (run-to-run noise, kernel choices that change
with the shape); residuals of 0.01% suggest times computed from a formula of that form, e.g.
by composing profiled per-layer times.

For sources with pipeline stages it also reports, per cell without ``pp``, ``dp`` (same
per-GPU layer shape: tp, hidden, microbatch), the spread of ``d * pp`` (the per-layer,
per-microbatch time of the whole model on one pipeline) across the ``pp``, ``dp`` layouts: equal
to four digits when each layer's time was profiled once and reused.

Pure data analysis, no fit of the cost model: runs in about a second.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_rows  # noqa: E402  (a sibling script module, found however this one is loaded)

CELL_KEY = (
    "source", "cluster", "hidden", "ffn_hidden", "heads", "kv_heads", "seq_len", "vocab",
    "precision", "framework", "tp", "pp", "dp", "cp", "ep", "sp", "zero", "recompute",
    "interleave_chunks", "microbatch",
)  # fmt: skip
SHAPE_KEY = ("source", "cluster", "hidden", "seq_len", "precision", "tp", "microbatch")


def cells(rows) -> dict:
    """{cell key: [(layers, microbatches, seconds), ...]} over rows with the needed numbers."""
    out = collections.defaultdict(list)
    for r in rows:
        try:
            layers, mb = int(r["n_layers"]), int(r["microbatch"])
            gb, dp, t = int(r["global_batch"]), int(r["dp"]), float(r["measured_iter_s"])
        except ValueError:
            continue
        if min(layers, mb, gb, dp) <= 0 or t <= 0:
            continue
        out[tuple(r[k] for k in CELL_KEY)].append((layers, gb / (mb * dp), t))
    return out


def design(layers, n) -> np.ndarray:
    """Columns 1, L, n, n L of ``a + b L + n (c + d L)``."""
    return np.stack([np.ones_like(layers), layers, n, n * layers], axis=1)


def fit_cell(points) -> tuple[np.ndarray, float] | None:
    """(a, b, c, d) and the largest relative residual, or None when the cell cannot pin the
    four down (fewer rows than five, or a rank-deficient design)."""
    v = np.asarray(points, dtype=float)
    if len(v) < 5:
        return None
    layers, n, t = v[:, 0], v[:, 1], v[:, 2]
    x = design(layers, n)
    if np.linalg.matrix_rank(x) < 4:
        return None
    coef = np.linalg.lstsq(x, t, rcond=None)[0]
    return coef, float(np.max(np.abs(x @ coef - t) / t))


def analyse(rows) -> dict:
    """Per source: cells fitted, rows in them, largest and median relative residual (%), and
    the spread of ``d * pp`` across layouts of one per-GPU layer shape."""
    by_source: dict = collections.defaultdict(lambda: {"cells": 0, "rows": 0, "resid": []})
    shapes = collections.defaultdict(list)
    index = {k: i for i, k in enumerate(CELL_KEY)}
    for key, points in cells(rows).items():
        fit = fit_cell(points)
        if fit is None:
            continue
        coef, resid = fit
        s = by_source[key[index["source"]]]
        s["cells"] += 1
        s["rows"] += len(points)
        s["resid"].append(resid)
        pp = int(key[index["pp"]])
        shapes[tuple(key[index[k]] for k in SHAPE_KEY)].append(coef[3] * pp)
    out = {}
    for name, s in sorted(by_source.items()):
        spreads = [
            (max(v) - min(v)) / np.mean(v) for k, v in shapes.items() if k[0] == name and len(v) > 1
        ]
        out[name] = {
            "cells": s["cells"],
            "rows": s["rows"],
            "max_residual_pct": 100.0 * max(s["resid"]),
            "median_residual_pct": 100.0 * float(np.median(s["resid"])),
            "cells_below_0.01_pct": int(np.sum(np.asarray(s["resid"]) < 1e-4)),
            "layer_shapes_with_several_layouts": len(spreads),
            "max_d_times_pp_spread_pct": 100.0 * max(spreads) if spreads else None,
        }
    return out


def main(argv=None) -> int:
    args = e2e_rows.parse(__doc__, argv)
    rows = e2e_rows.rows(args)
    if rows is None:
        return 2
    result = analyse(rows)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if not result:
        print("no cell has five rows that differ in layers and microbatches")
        return 0
    for name, s in result.items():
        spread = s["max_d_times_pp_spread_pct"]
        layouts = (
            f"; d x pp varies by at most {spread:.2g}% across the layouts of "
            f"{s['layer_shapes_with_several_layouts']} layer shapes"
            if spread is not None
            else ""
        )
        print(
            f"{name}: {s['cells']} cells ({s['rows']} rows) fit a + bL + n(c + dL) to "
            f"{s['max_residual_pct']:.3f}% at worst (median {s['median_residual_pct']:.4f}%, "
            f"{s['cells_below_0.01_pct']} cells below 0.01%){layouts}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
