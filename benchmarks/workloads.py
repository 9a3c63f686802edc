"""Beyond transformers (issue 26): every workloads figure in one run.

    python benchmarks/workloads.py [--json] [--quick] [--out benchmarks/results/workloads.json]

One section per benchmark script, each its own ``measure(quick)``:

* ``from_jax`` (``workloads_from_jax.py``): FLOPs of ``diffcost.from_jax``'s operator graph
  of each zoo model's training step against XLA's cost analysis;
* ``sbp`` (``workloads_sbp.py``): per-operator sharding search on random small graphs against
  the exact optimum and coordinate descent;
* ``dlrm_sharding`` (``workloads_dlrm.py``): DLRM embedding-table sharding search against
  exhaustive search and a greedy planner;
* ``mlperf`` (``workloads_mlperf.py``): MLPerf Training v4.0 rows the model represents,
  zero-shot and calibrated on the other half of each benchmark's submitters.

The JSON is the union of the sections' dictionaries. Writes ``--out`` (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import workloads_dlrm  # noqa: E402
import workloads_from_jax  # noqa: E402
import workloads_mlperf  # noqa: E402
import workloads_sbp  # noqa: E402

SECTIONS = {
    "from_jax": workloads_from_jax.measure,
    "sbp": workloads_sbp.measure,
    "dlrm_sharding": lambda quick: {"dlrm_sharding": workloads_dlrm.measure(quick)},
    "mlperf": workloads_mlperf.measure,
}


def measure(quick: bool, only=None) -> dict:
    out, seconds = {}, {}
    for name, fn in SECTIONS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        out.update(fn(quick))
        seconds[name] = round(time.perf_counter() - t0, 1)
        print(f"[workloads] {name}: {seconds[name]} s", file=sys.stderr, flush=True)
    out["seconds"] = seconds
    return out


def summary_lines(r: dict) -> list[str]:
    lines = []
    for model, f in r.get("from_jax", {}).items():
        lines.append(f"from_jax {model:22s} FLOPs error {f['flops_err_pct']:+.2f}%")
    if "sbp" in r:
        s = r["sbp"]
        lines.append(f"sbp: {s['cases']} cases, max gap {s['max_gap_pct']:.2f}%, "
                     f"worse than coordinate descent {s['worse_than_cd']}")  # fmt: skip
    if "dlrm_sharding" in r:
        s = r["dlrm_sharding"]
        lines.append(f"dlrm_sharding: {s['cases']} cases, max gap {s['max_gap_pct']:.2f}%, "
                     f"worse than greedy {s['worse_than_greedy']}")  # fmt: skip
    for bench, f in r.get("mlperf", {}).items():
        zs, cal = f.get("mape_pct_zero_shot"), f.get("mape_pct_calibrated")
        mape = f"  MAPE zero-shot {zs:.1f}%  calibrated {cal:.1f}%" if zs is not None else ""
        lines.append(f"mlperf {bench:24s} rows {f['rows']:4d} predicted {f['predicted']:4d}{mape}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--quick", action="store_true", help="each section's quick variant")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "workloads.json")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        ap.error(f"--only: unknown section(s) {', '.join(unknown)}; valid: {', '.join(SECTIONS)}")
    r = measure(args.quick, only)
    if not args.quick:
        args.out.write_text(json.dumps(r, indent=1, default=float) + "\n")
    if args.json:
        print(json.dumps(r, default=float))
    else:
        print("\n".join(summary_lines(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
