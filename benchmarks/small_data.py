"""Calibrating on a handful of runs: does the fit help or hurt the runs it did not see?

    python benchmarks/small_data.py [--json] [--sizes 5 30 200] [--draws 3] [--seed 0]

Draws random subsets of the vTrain single-node runs (``--draws`` per size), calibrates
``vtrain-a100`` on each as ``diffcost calibrate`` does (from the shipped profile with the
offsets of the runs' stack, and from the datasheet defaults as for a cluster without one),
once with the small-data prior (``FitConfig.full_rows``, the default) and once without it
(``full_rows=1``: every level weighs the same against the prior whatever its row count), and
reports the MAPE on the vTrain runs the subset left out, next to that of the starting
constants: the mean over the subsets and the worst subset. ``calibrate`` is the command's
own path (``calibration.refit.fit_with_runs``): below ``FitConfig.full_rows`` runs the few-shot
refit of the starting profile, its noise the profile's residual spread, instead of the descent
of the other columns. Writes ``benchmarks/results/small_data.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from calibration import command, refit  # noqa: E402
from calibration import fit as fit_mod  # noqa: E402
from calibration.readers import load  # noqa: E402
from diffcost import profiles as prof  # noqa: E402
from diffcost.cache import enable_compilation_cache  # noqa: E402
from diffcost.config import load_cluster  # noqa: E402
from diffcost.validate import validate  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "e2e" / "calibration.csv"
CLUSTER = "vtrain-a100"
SOURCE = "vtrain_ground_truth_single"


def _write(path: Path, header: list[str], rows: list[dict]) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, header)
        w.writeheader()
        w.writerows(rows)
    return path


def _fit_rows(train: Path, held: Path, profile, cfgs: dict) -> dict:
    """Held-out figures at the start and after each fit config, for one training subset."""
    meas = command.select(load([train]), [CLUSTER])
    problem = fit_mod.build_problem(meas)
    # as calibrate starts: with the shipped offsets of the runs' stack (Megatron-DeepSpeed)
    stacks = command.runs_stacks(meas)
    start = {
        c: prof.params_for(load_cluster(c), profile, stack=stacks.get(c))[0]
        for c in problem.clusters
    }
    out = {"start": validate(held, params=start[CLUSTER])["summary"]["mape_pct"]}
    for label, cfg in cfgs.items():
        res = fit_mod.fit(meas, cfg, False, problem, start)
        summary = validate(held, params=res.params_by_cluster[CLUSTER])["summary"]
        out[label] = summary["mape_pct"]
        out[f"{label}_max"] = summary["max_ape_pct"]
    # ``diffcost calibrate`` itself: below ``full_rows`` runs the few-shot refit
    noise = prof.uncertainty_for(load_cluster(CLUSTER), profile).residual_sd
    res, _ = refit.fit_with_runs(meas, fit_mod.FitConfig(), False, problem, start, noise)
    summary = validate(held, params=res.params_by_cluster[CLUSTER])["summary"]
    out["calibrate"], out["calibrate_max"] = summary["mape_pct"], summary["max_ape_pct"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[5, 30, 200])
    parser.add_argument("--draws", type=int, default=3, help="random subsets per size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the JSON summary")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "small_data.json"))
    args = parser.parse_args(argv)
    enable_compilation_cache()  # draws of one size share their compiled fit step
    with open(DATA, newline="") as fh:
        reader = csv.DictReader(fh)
        header = list(reader.fieldnames or [])
        runs = [r for r in reader if r["source"] == SOURCE]
    rng = random.Random(args.seed)
    cfgs = {"prior": fit_mod.FitConfig(), "no_prior_scaling": fit_mod.FitConfig(full_rows=1)}
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for n in args.sizes:
            draws = {"shipped profile": [], "datasheet": []}
            for d in range(args.draws):
                picked = set(rng.sample(range(len(runs)), n))
                train = _write(tmp / "train.csv", header, [runs[i] for i in sorted(picked)])
                rest = [r for i, r in enumerate(runs) if i not in picked]
                held = _write(tmp / "held.csv", header, rest)
                for start_name, profile in (("shipped profile", None), ("datasheet", "none")):
                    draws[start_name].append(_fit_rows(train, held, profile, cfgs))
                    print(f"{n} rows, draw {d + 1}, from the {start_name}: ", file=sys.stderr)
                    print(f"  {draws[start_name][-1]}", file=sys.stderr, flush=True)
            for start_name, figs in draws.items():
                row = {"rows": n, "start": start_name, "draws": len(figs)}
                for key in ("start", *cfgs, "calibrate"):
                    vals = [f[key] for f in figs]
                    row[f"{key}_mape_pct_mean"] = sum(vals) / len(vals)
                    row[f"{key}_mape_pct_worst"] = max(vals)
                for key in (*cfgs, "calibrate"):
                    row[f"{key}_max_ape_pct_worst"] = max(f[f"{key}_max"] for f in figs)
                results.append(row)
    print(
        f"held-out MAPE on the vTrain runs each subset left out ({args.draws} random subsets "
        f"per size; mean / worst subset), {time.perf_counter() - t0:.0f} s:"
    )
    print(f"{'rows':>5s}  {'start':16s} {'at start':>14s} {'calibrated':>14s} {'no scaling':>14s} "
          f"{'calibrate':>14s}")  # fmt: skip
    for r in results:
        cells = [
            f"{r[f'{k}_mape_pct_mean']:5.2f} / {r[f'{k}_mape_pct_worst']:5.2f}"
            for k in ("start", *cfgs, "calibrate")
        ]
        print(f"{r['rows']:5d}  {r['start']:16s} " + " ".join(f"{c:>14s}" for c in cells))
    out = {"cluster": CLUSTER, "source": SOURCE, "seed": args.seed, "draws": args.draws}
    out.update(full_rows=cfgs["prior"].full_rows, results=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
