"""How close any smooth curve in the message size comes to each measured collective table.

    python benchmarks/collective_floor.py [--json] [--data DIR]

The network model prices a collective by a handful of constants per GPU family and cluster
(``benchmarks/topology_collectives.py``). This benchmark asks what a far freer model would
reach: every table (cluster, collective, group size, concurrent groups) of
``shared/data/collectives/collectives.csv`` gets curves of its own, fitted to its rows of at
least 1 MiB (the sizes the issue's target covers) with the relative error as the loss:

* ``affine``: latency plus size over bandwidth, ``a + b x`` (2 parameters per table);
* ``two_regime``: the same with two bandwidths joined by a logistic step half an octave wide
  in ``log2 x``, its centre the best of every octave boundary inside the table (4 parameters:
  a protocol or algorithm switch at a size of the table's choosing);
* ``loglog_cubic``: a cubic polynomial in ``log2 x`` for ``log t`` (4 parameters).

Each is scored in sample (MAPE per cluster over the rows) and held out as
``topology_collectives.py`` holds out: fitted on the sizes of even ``floor(log2 x)`` and scored
on the odd ones, and the other way round. The network model's own figures are in
``benchmarks/results/topology.json`` (``collectives``), printed beside these for comparison.
Tables of fewer than 4 sizes in a fold are left out of that fold.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MIN_BYTES = 2**20
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
STEP_WIDTH_OCTAVES = 0.5


def _affine(x, t, basis=None):
    """Weighted least squares of ``t`` on ``[1, x * basis]`` (relative error): the
    coefficients."""
    cols = [np.ones_like(x)] + ([x] if basis is None else [x * b for b in basis])
    a = np.stack(cols, 1) / t[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return coef


def _step(lx, centre):
    s = 1.0 / (1.0 + np.exp((lx - centre) / STEP_WIDTH_OCTAVES))
    return [s, 1.0 - s]


def fit_curve(kind: str, x: np.ndarray, t: np.ndarray):
    """A function ``size -> time`` of the given ``kind`` fitted to one table's rows."""
    lx = np.log2(x)
    if kind == "affine":
        c = _affine(x, t)
        return lambda s: c[0] + c[1] * s
    if kind == "loglog_cubic":
        c = np.polyfit(lx, np.log(t), min(3, len(x) - 1))
        return lambda s: np.exp(np.polyval(c, np.log2(s)))
    best = None
    for centre in np.arange(np.floor(lx.min()) + 1.0, np.ceil(lx.max())):
        basis = _step(lx, centre)
        c = _affine(x, t, basis)
        err = np.mean(np.abs((c[0] + x * (c[1:] @ np.stack(basis))) / t - 1.0))
        if best is None or err < best[0]:
            best = (err, c, centre)
    if best is None:  # a table within one octave: one bandwidth
        return fit_curve("affine", x, t)
    _, c, centre = best
    return lambda s: c[0] + s * (c[1:] @ np.stack(_step(np.log2(s), centre)))


KINDS = ("affine", "two_regime", "loglog_cubic")


def read_tables(path: Path) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """(cluster, collective, group size, groups) -> (sizes, times) of rows >= 1 MiB."""
    tables = collections.defaultdict(list)
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            size = float(r["size_bytes"])
            if r["collective"] in COLLECTIVES and size >= MIN_BYTES:
                key = (r["cluster"], r["collective"], int(r["group_size"]), int(r["n_groups"]))
                tables[key].append((size, float(r["time_us"])))
    out = {}
    for key, rows in tables.items():
        rows.sort()
        out[key] = (np.array([s for s, _ in rows]), np.array([t for _, t in rows]))
    return out


def table_errors(kind: str, x: np.ndarray, t: np.ndarray):
    """(in-sample |relative errors|, held-out ones or None) of one table."""
    inside = np.abs(fit_curve(kind, x, t)(x) / t - 1.0)
    odd = np.floor(np.log2(x)).astype(int) % 2 == 1
    held = []
    for train in (odd, ~odd):
        if train.sum() < 4 or (~train).sum() == 0:
            return inside, None
        f = fit_curve(kind, x[train], t[train])
        held.append(np.abs(f(x[~train]) / t[~train] - 1.0))
    return inside, np.concatenate(held)


def measure(data: Path) -> dict:
    tables = read_tables(data / "collectives" / "collectives.csv")
    errs = {k: collections.defaultdict(lambda: ([], [])) for k in KINDS}
    rows = collections.Counter()
    for (cluster, *_), (x, t) in tables.items():
        rows[cluster] += len(x)
        for kind in KINDS:
            inside, held = table_errors(kind, x, t)
            errs[kind][cluster][0].extend(inside)
            if held is not None:
                errs[kind][cluster][1].extend(held)
    model_path = HERE / "results" / "topology.json"
    model = json.loads(model_path.read_text())["collectives"] if model_path.exists() else {}
    out = {}
    for cluster in sorted(rows):
        entry = {"rows": rows[cluster], "tables": sum(k[0] == cluster for k in tables)}
        for kind in KINDS:
            inside, held = errs[kind][cluster]
            entry[f"{kind}_pct"] = round(100.0 * float(np.mean(inside)), 2)
            entry[f"{kind}_heldout_pct"] = round(100.0 * float(np.mean(held)), 2) if held else None
        if cluster in model:
            entry["model_pct"] = model[cluster]["mape_pct"]
            entry["model_heldout_pct"] = model[cluster]["mape_pct_heldout"]
        out[cluster] = entry
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON only")
    ap.add_argument("--data", default=str(HERE.parent.parent / "shared" / "data"))
    args = ap.parse_args(argv)
    out = measure(Path(args.data))
    if args.json:
        print(json.dumps(out, indent=1))
        return
    cols = [*KINDS, "model"]
    print(f"{'cluster':22s} {'rows':>5s} " + " ".join(f"{c:>18s}" for c in cols))
    print(f"{'':22s} {'':5s} " + " ".join(f"{'in / held-out %':>18s}" for _ in cols))
    for cluster, e in out.items():
        cells = []
        for c in cols:
            a, b = e.get(f"{c}_pct"), e.get(f"{c}_heldout_pct")
            cells.append(f"{'-' if a is None else a:>8} / {'-' if b is None else b:<7}")
        print(f"{cluster:22s} {e['rows']:5d} " + " ".join(f"{c:>18s}" for c in cells))


if __name__ == "__main__":
    main()
