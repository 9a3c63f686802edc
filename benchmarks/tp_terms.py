"""Could a cost that grows with the tensor-parallel size close a held-out source's tp gap?

    python benchmarks/tp_terms.py [--rows CSV] [--source NAME] [--data DIR] [--json]

Held out of the fit (``transfer.py``, leave one source out), vTrain's tp = 8 runs come out about
25% too fast and its tp 1-4 runs within 1%. This reads the zero-shot rows (``--rows``, default
``benchmarks/results/transfer_rows.csv``, group ``source: NAME``) and the measured data, and
reports three things:

1. ``floor``: the measured time per layer and microbatch on the critical path,
   ``t / ((n + pp - 1) L / pp)`` (``n`` microbatches), median per (hidden, tp) over the
   single-stage runs at microbatch 1, where the layers are host-bound (the zero-shot fit's GPU
   stream is a third of it or less).
2. ``same_work``: tp 8 against tp 4 at the same work per GPU (twice the microbatch at tp 8):
   the measured difference of that time, beside the difference of six all-reduces per layer
   and microbatch (forward, recompute, backward; no sequence parallelism) of the activation
   (``microbatch x seq x hidden`` 16-bit values) as the source's own 8- and 4-GPU all-reduce
   tables time them (``collectives.csv``, ``vtrain_allreduce_lut``), were they fully exposed.
3. ``terms``: each candidate cost ``k f(tp)`` per layer and microbatch slot added to the
   zero-shot prediction, ``k`` chosen to minimise the held-out source's own MAPE: an in-sample
   upper bound on what the same term could do when learned from other sources. ``f``: the
   expected maximum of ``tp`` standard normals (stragglers at each collective), ``log2 tp``
   (a tree's latency steps), ``tp - 1`` (a ring's), and for scale two knobs no other source
   could pin: a step at tp 8, and that step over the microbatch.
4. ``oracle``: the MAPE left after removing each group's median log error, grouped by tp, by
   (tp, microbatch) and by the per-GPU layer shape (tp, hidden, microbatch; the layer grid's
   cells): the most any correction by tp alone, or by shape, could do, and so a floor for a
   few-shot refit of scalar constants.

Pure data analysis of committed files, no fit: runs in about a second.
"""

from __future__ import annotations

import collections
import csv
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_rows  # noqa: E402  (a sibling script module, found however this one is loaded)

ROWS = Path(__file__).resolve().parent / "results" / "transfer_rows.csv"
DEFAULT_SOURCE = "vtrain_ground_truth_single"
TP_ALL_REDUCES_PER_LAYER = 6  # 2 forward + 2 recompute + 2 backward (sp = 0, full recompute)
LUT_SOURCE = "vtrain_allreduce_lut"


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1), by quadrature."""
    x = np.linspace(-8.0, 8.0, 16001)
    pdf = np.exp(-0.5 * x**2) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    return float(np.sum(x * n * pdf * cdf ** (n - 1)) * (x[1] - x[0]))


TERMS = {
    "stragglers_expected_max": expected_max_normal,
    "log2_tp": lambda tp: math.log2(tp),
    "tp_minus_1": lambda tp: tp - 1.0,
    "step_at_tp8": lambda tp: float(tp == 8),
}


def joined(rows, held_rows) -> list[dict]:
    """The e2e rows with a zero-shot prediction, with the numbers this needs."""
    pred = {r["row"]: float(r["predicted_s"]) for r in held_rows}
    out = []
    for r in rows:
        if r["row"] not in pred:
            continue
        tp, pp, dp, mb = (int(r[k]) for k in ("tp", "pp", "dp", "microbatch"))
        layers, n = int(r["n_layers"]), int(r["global_batch"]) / (int(r["microbatch"]) * dp)
        out.append({"tp": tp, "pp": pp, "dp": dp, "mb": mb, "hidden": int(r["hidden"]),
                    "seq": int(r["seq_len"]), "meas": float(r["measured_iter_s"]),
                    "pred": pred[r["row"]], "slots": (n + pp - 1) * layers / pp})  # fmt: skip
    return out


def _per_slot_ms(runs, **match) -> float | None:
    v = [1e3 * r["meas"] / r["slots"] for r in runs if all(r[k] == x for k, x in match.items())]
    return float(np.median(v)) if v else None


def all_reduce_lut(data: Path) -> dict:
    """{(GPUs, MiB): seconds} of the source's all-reduce table."""
    with open(data / "collectives" / "collectives.csv", newline="", encoding="utf-8") as fh:
        return {
            (int(r["n_gpus"]), int(r["size_bytes"]) / 2**20): float(r["time_us"]) * 1e-6
            for r in csv.DictReader(fh)
            if r["source"] == LUT_SOURCE and r["cluster"] == "vtrain-a100"
        }


def same_work(runs, lut: dict) -> list[dict]:
    out = []
    for hidden in sorted({r["hidden"] for r in runs}):
        for mb in sorted({r["mb"] for r in runs if r["tp"] == 4}):
            t8 = _per_slot_ms(runs, tp=8, hidden=hidden, mb=2 * mb, pp=1)
            t4 = _per_slot_ms(runs, tp=4, hidden=hidden, mb=mb, pp=1, dp=1)
            seq = runs[0]["seq"]
            mib = {g: m * seq * hidden * 2 / 2**20 for g, m in ((8, 2 * mb), (4, mb))}
            if None in (t8, t4) or (8, mib[8]) not in lut or (4, mib[4]) not in lut:
                continue
            ar = TP_ALL_REDUCES_PER_LAYER * (lut[(8, mib[8])] - lut[(4, mib[4])]) * 1e3
            out.append({"hidden": hidden, "tp4_microbatch": mb, "tp8_microbatch": 2 * mb,
                        "measured_extra_ms": t8 - t4, "all_reduce_extra_ms": ar})  # fmt: skip
    return out


def _errors(pred, meas, tp) -> dict:
    e = pred / meas - 1.0
    return {
        "mape_pct": float(100 * np.abs(e).mean()),
        "bias_pct": float(100 * e.mean()),
        "mean_log_by_tp_pct": {
            int(t): float(100 * np.log(pred / meas)[tp == t].mean()) for t in sorted(set(tp))
        },  # fmt: skip
    }


def terms(runs) -> dict:
    meas, pred = np.array([r["meas"] for r in runs]), np.array([r["pred"] for r in runs])
    tp, mb = np.array([r["tp"] for r in runs]), np.array([r["mb"] for r in runs])
    slots = np.array([r["slots"] for r in runs])
    features = {name: np.array([f(int(t)) for t in tp]) for name, f in TERMS.items()}
    features["step_at_tp8_over_microbatch"] = features["step_at_tp8"] / mb
    out = {"as_predicted": _errors(pred, meas, tp)}
    for name, f in features.items():
        grid = np.linspace(0.0, 5e-3, 1001)  # seconds per unit of f per slot
        mape = [np.abs((pred + k * f * slots) / meas - 1).mean() for k in grid]
        k = float(grid[int(np.argmin(mape))])
        out[name] = {"k_ms": 1e3 * k, **_errors(pred + k * f * slots, meas, tp)}
    return out


ORACLE_GROUPS = {
    "tp": ("tp",),
    "tp_microbatch": ("tp", "mb"),
    "layer_shape": ("tp", "hidden", "mb"),
}


def oracle(runs) -> dict:
    log_err = np.log(np.array([r["pred"] / r["meas"] for r in runs]))
    out = {}
    for name, keys in ORACLE_GROUPS.items():
        groups = collections.defaultdict(list)
        for i, r in enumerate(runs):
            groups[tuple(r[k] for k in keys)].append(i)
        left = log_err.copy()
        for idx in groups.values():
            left[idx] -= np.median(log_err[idx])
        out[name] = {"groups": len(groups), "mape_pct": float(100 * np.abs(np.expm1(left)).mean())}
    return out


def main(argv=None) -> int:
    args = e2e_rows.parse(
        __doc__,
        argv,
        lambda ap: ap.add_argument("--rows", default=str(ROWS), help="transfer.py's rows CSV"),
    )
    args.source = args.source or DEFAULT_SOURCE
    rows_path = Path(args.rows)
    rows = e2e_rows.rows(args, numbered=True)
    if rows is None:
        return 2
    if not rows_path.is_file():
        print(f"error: --rows {args.rows!r}: no such file", file=sys.stderr)
        return 2
    with open(rows_path, newline="", encoding="utf-8") as fh:
        held = [r for r in csv.DictReader(fh) if r["group"] == f"source: {args.source}"]
    runs = joined(rows, held)
    if not runs:
        print(f"error: {rows_path} has no zero-shot rows of {args.source}", file=sys.stderr)
        return 2
    floor = collections.defaultdict(dict)
    for hidden, tp in sorted({(r["hidden"], r["tp"]) for r in runs}):
        floor[hidden][tp] = _per_slot_ms(runs, hidden=hidden, tp=tp, mb=1, pp=1)
    out = {"source": args.source, "rows": len(runs), "floor_ms_microbatch1": dict(floor),
           "same_work": same_work(runs, all_reduce_lut(Path(args.data))),
           "terms": terms(runs), "oracle": oracle(runs)}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.source}: {len(runs)} zero-shot rows from {rows_path}")
    for hidden, by_tp in floor.items():
        cells = "  ".join(f"tp {t}: {v:.2f}" for t, v in by_tp.items() if v is not None)
        print(f"ms per layer and microbatch, microbatch 1, hidden {hidden}: {cells}")
    for s in out["same_work"]:
        print(f"hidden {s['hidden']}, tp 8 mb {s['tp8_microbatch']} vs tp 4 mb "
              f"{s['tp4_microbatch']}: +{s['measured_extra_ms']:.2f} ms measured, "
              f"{s['all_reduce_extra_ms']:+.2f} ms from six exposed all-reduces")  # fmt: skip
    for name, r in out["terms"].items():
        by_tp = " ".join(f"tp{t} {v:+.1f}" for t, v in r["mean_log_by_tp_pct"].items())
        k = f"k {r['k_ms']:.3f} ms" if "k_ms" in r else ""
        print(f"{name:30s} {k:12s} MAPE {r['mape_pct']:5.2f}% bias {r['bias_pct']:+5.1f}% "
              f"| 100 log(pred/meas): {by_tp}")  # fmt: skip
    for name, r in out["oracle"].items():
        print(
            f"each {name} group's median error removed ({r['groups']} groups): "
            f"MAPE {r['mape_pct']:.2f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
