"""DLRM embedding-table sharding: gradient search against exhaustive search and a greedy planner.

Random table sets (``dlrm_search.random_spec``: rows 1e3-4e7, pooling 1-100, Zipf exponent
0-1.2, MLPerf DLRM-DCNv2's dense part and global batch 65536) on 8-64 GPUs of a DGX H100
cluster. Small cases (3-4 tables on 8 or 16 GPUs) are also solved exhaustively. For each case
the gradient search (``dlrm_search.search``) is compared, on the exact model, with

* the exhaustive optimum (``gap_pct``: how much slower the search's plan is, small cases);
* the greedy planner (``dlrm_search.greedy``, TorchRec-planner-like): a case counts in
  ``worse_than_greedy`` when the search's plan is slower or does not fit where greedy's does.
  The search polishes the greedy plan as one of its starts (``greedy_start``), so
  ``gradient_worse_than_greedy`` counts the same for the best plan polished from the relaxed
  descent's rounded starts alone, and ``best_from_greedy_start`` the cases whose best plan
  came from the greedy start.

Thresholds (issue 26): ``max_gap_pct`` <= 2 and ``worse_than_greedy`` == 0; the script exits
non-zero when they are missed. ``measure(quick)`` returns the ``dlrm_sharding`` dict;
``--quick`` runs 6 of the 20 cases.

Usage: ``python benchmarks/workloads_dlrm.py [--quick] [--cases 18,19] [--json]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

from diffcost import config  # noqa: E402
from diffcost.dlrm import load_dlrm  # noqa: E402
from diffcost.dlrm_cost import make_problem  # noqa: E402
from diffcost.dlrm_search import exhaustive, random_spec, search  # noqa: E402
from diffcost.profiles import params_for  # noqa: E402

CLUSTER = "dgx-h100"
BATCH = 65536
MAX_GAP_PCT = 2.0
# (tables, GPUs, exhaustive?): 8 small cases solved exhaustively, 12 larger ones.
CASES = (
    [(3, 8, True)] * 3
    + [(4, 8, True)] * 2
    + [(3, 16, True)] * 3
    + [(16, 8, False), (26, 8, False), (26, 16, False), (40, 16, False)]
    + [(16, 32, False), (26, 32, False), (40, 32, False), (26, 32, False)]
    + [(16, 64, False), (26, 64, False), (40, 64, False), (26, 64, False)]
)
QUICK = (0, 3, 5, 8, 12, 16)


def run_case(index: int, n_tables: int, n_gpus: int, small: bool, base, cluster, params):
    spec = random_spec(np.random.default_rng(index), n_tables, BATCH, base)
    problem = make_problem(spec, cluster, n_gpus, params)
    t0 = time.perf_counter()
    found = search(problem)
    t1 = time.perf_counter()
    baseline = found.greedy
    row = {
        "case": index,
        "tables": n_tables,
        "gpus": n_gpus,
        "search_ms": found.best.iteration_s * 1e3,
        "rounded_ms": found.rounded.iteration_s * 1e3,
        "greedy_ms": baseline.iteration_s * 1e3,
        "gradient_ms": found.gradient.iteration_s * 1e3,
        "started_from": found.started_from,
        "search_fits": found.best.fits,
        "greedy_fits": baseline.fits,
        "search_s": t1 - t0,
    }
    if small:
        best = exhaustive(problem)
        row["exhaustive_ms"] = best.iteration_s * 1e3
        row["gap_pct"] = 100.0 * (found.best.iteration_s / best.iteration_s - 1.0)
    row["worse_than_greedy"] = _worse(found.best, baseline)
    row["gradient_worse_than_greedy"] = _worse(found.gradient, baseline)
    return row


def _worse(plan, baseline) -> bool:
    """Slower than the greedy plan, or not fitting where it fits."""
    return bool(
        (baseline.fits and not plan.fits)
        or (plan.fits == baseline.fits and plan.iteration_s > baseline.iteration_s * (1 + 1e-9))
    )


def measure(quick: bool = False, rows: list | None = None, cases=None) -> dict:
    """The ``dlrm_sharding`` figures: cases, max gap to exhaustive (%), cases worse than greedy
    (``cases``: the indices to run, default all or ``QUICK``)."""
    base = load_dlrm("dlrm-dcnv2")
    cluster = config.load_cluster(CLUSTER)
    params = params_for(cluster)[0]
    picked = [i for i in range(len(CASES)) if not quick or i in QUICK]
    picked = picked if cases is None else list(cases)
    out = [] if rows is None else rows
    for i in picked:
        out.append(run_case(i, *CASES[i], base, cluster, params))
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)  # progress, one row per case
    gaps = [r["gap_pct"] for r in out if "gap_pct" in r]
    return {
        "cases": len(out),
        "exhaustive_cases": len(gaps),
        "max_gap_pct": round(max(gaps), 3) if gaps else None,
        "worse_than_greedy": sum(r["worse_than_greedy"] for r in out),
        "gradient_worse_than_greedy": sum(r["gradient_worse_than_greedy"] for r in out),
        "best_from_greedy_start": sum(r["started_from"] == "greedy" for r in out),
        "mean_gain_vs_greedy_pct": round(
            float(np.mean([100 * (1 - r["search_ms"] / r["greedy_ms"]) for r in out])), 3
        ),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 of the 20 cases")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cases", help="comma-separated case indices (0-19) to run only those")
    args = parser.parse_args(argv)
    cases = None
    if args.cases:
        cases = [int(c) for c in args.cases.split(",")]
        bad = [c for c in cases if not 0 <= c < len(CASES)]
        if bad:
            parser.error(f"--cases {args.cases}: {bad} not in 0-{len(CASES) - 1}")
    rows: list = []
    t0 = time.perf_counter()
    result = measure(args.quick, rows, cases)
    if args.json:
        print(json.dumps({"dlrm_sharding": result}))
    else:
        print(
            f"{'case':>4} {'T':>3} {'GPUs':>4} {'search ms':>9} {'rounded':>8} {'gradient':>8} "
            f"{'greedy':>8} {'exhaust':>8} {'gap %':>6} {'from':>8} {'time s':>6}"
        )
        for r in rows:
            ex = f"{r['exhaustive_ms']:8.4f}" if "exhaustive_ms" in r else f"{'-':>8}"
            gap = f"{r['gap_pct']:6.2f}" if "gap_pct" in r else f"{'-':>6}"
            print(
                f"{r['case']:4d} {r['tables']:3d} {r['gpus']:4d} {r['search_ms']:9.4f} "
                f"{r['rounded_ms']:8.4f} {r['gradient_ms']:8.4f} {r['greedy_ms']:8.4f} {ex} {gap} "
                f"{r['started_from']:>8} {r['search_s']:6.1f}"
            )
        print(json.dumps({"dlrm_sharding": result}))
        print(f"total {time.perf_counter() - t0:.0f} s")
    ok = (result["max_gap_pct"] is None or result["max_gap_pct"] <= MAX_GAP_PCT) and (
        result["worse_than_greedy"] == 0
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
