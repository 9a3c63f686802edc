"""How well diffcost predicts a software stack and machine none of its profiles was fitted on:
JAX training steps measured on one GPU (``benchmarks/results/h100/`` and ``h200/``, written by
``benchmarks/gpu_measure.py``; never part of the shared data or of any shipped profile).

    python benchmarks/gpu_check.py [--set h100|h200] [--json] [--draws 3]

Three paths a user takes, each scored on the measured steps' time (MAPE, signed mean error,
Kendall tau, 80% interval coverage) and peak memory (MAPE):

* ``zero_shot``: the shipped profiles as they are (``diffcost validate``).
* ``kernel_tables``: ``diffcost calibrate`` on the GPU's own kernel table (GEMM, fused
  attention, elementwise bandwidth) only, then ``validate`` with that profile — the path of a
  user who has microbenchmarks of a new machine and no training run on it.
* ``few_shot`` with k = 3 and k = 10 measured steps added to the kernel table (``--draws``
  random draws each, seeded): scored on the steps not drawn.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from diffcost.cli import main as diffcost_main
from diffcost.validate import validate

HERE = Path(__file__).resolve().parent
# set -> (measurements, the cluster their rows name and every calibration uses)
SETS = {"h100": ("h100", "generic-h100"), "h200": ("h200", "dgx-h200")}


def _score(result: dict) -> dict:
    rows = [r for r in result["rows"] if r.get("predicted_iter_s")]
    logs = [np.log(r["predicted_iter_s"] / r["measured_iter_s"]) for r in rows]
    s = result["summary"]
    return {
        "rows": s["time_rows"],
        "mape_pct": s["mape_pct"],
        "bias_pct": 100.0 * float(np.expm1(np.mean(logs))),
        "max_ape_pct": s["max_ape_pct"],
        "kendall_tau": s["kendall_tau"],
        "coverage_pct": s["coverage_pct"],
        "median_width_pct": s["median_width_pct"],
        "mem_mape_pct": s.get("mem_mape_pct"),
    }


def _calibrate(files: list[Path], out: Path, cluster: str) -> None:
    argv = ["calibrate", *map(str, files), "--cluster", cluster, "--out", str(out), "--json"]
    with contextlib.redirect_stdout(io.StringIO()):
        code = diffcost_main(argv)
    if code != 0:
        raise RuntimeError(f"diffcost {' '.join(argv)} exited with {code}")


def _write_rows(path: Path, header: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, header)
        w.writeheader()
        w.writerows(rows)


def run(name: str, draws: int) -> dict:
    folder, cluster = SETS[name]
    data = HERE / "results" / folder
    e2e, kernels = data / "e2e.csv", data / "kernels.csv"
    with open(e2e, newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = list(reader.fieldnames), list(reader)
    out = {"data": str(data.relative_to(HERE.parent)), "cluster": cluster}
    out["zero_shot"] = _score(validate(e2e))
    print(f"zero-shot: {out['zero_shot']['mape_pct']:.1f}%", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _calibrate([kernels], tmp / "kernels.yaml", cluster)
        out["kernel_tables"] = _score(validate(e2e, profile=str(tmp / "kernels.yaml")))
        print(f"kernel tables: {out['kernel_tables']['mape_pct']:.1f}%", file=sys.stderr)
        out["few_shot"] = []
        rng = np.random.default_rng(0)
        for k in (3, 10):
            scores = []
            for d in range(draws):
                pick = set(rng.choice(len(rows), size=k, replace=False).tolist())
                _write_rows(tmp / "train.csv", header, [r for i, r in enumerate(rows) if i in pick])
                _write_rows(
                    tmp / "test.csv", header, [r for i, r in enumerate(rows) if i not in pick]
                )
                _calibrate([kernels, tmp / "train.csv"], tmp / "few.yaml", cluster)
                scores.append(_score(validate(tmp / "test.csv", profile=str(tmp / "few.yaml"))))
                print(f"k={k} draw {d}: {scores[-1]['mape_pct']:.1f}%", file=sys.stderr)
            mapes = [s["mape_pct"] for s in scores]
            out["few_shot"].append(
                {
                    "k": k,
                    "draws": draws,
                    "mape_pct_mean": float(np.mean(mapes)),
                    "mape_pct_worst": float(np.max(mapes)),
                    "bias_pct_mean": float(np.mean([s["bias_pct"] for s in scores])),
                    "mape_pct_draws": mapes,
                }
            )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=tuple(SETS), default="h100", help="which GPU's steps")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--draws", type=int, default=3, help="random draws per few-shot k")
    p.add_argument(
        "--out", default=None, help="results JSON ('' none; default results/SET_check.json)"
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(HERE / "results" / f"{args.set}_check.json")
    res = run(args.set, args.draws)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        for name in ("zero_shot", "kernel_tables"):
            s = res[name]
            print(
                f"{name:14s} MAPE {s['mape_pct']:5.1f}%  bias {s['bias_pct']:+5.1f}%  "
                f"tau {s['kendall_tau']:.2f}  coverage {s['coverage_pct']:.0f}%  "
                f"memory MAPE {s['mem_mape_pct']:.1f}%"
            )
        for f in res["few_shot"]:
            print(
                f"few-shot k={f['k']:<3d} MAPE {f['mape_pct_mean']:5.1f}% "
                f"(worst draw {f['mape_pct_worst']:.1f}%)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
