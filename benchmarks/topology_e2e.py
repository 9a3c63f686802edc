"""End-to-end runs on topology graphs: the network path of the cost model against the existing one.

    python benchmarks/topology_e2e.py [--json] [--quick] [--data ../shared/data]

Predicts every row of ``e2e/calibration.csv`` that ``runs.row_to_specs`` reads, with its
cluster's shipped profile, three ways: the existing path (``diffcost.comm``: the NVLink
ring-share table and the fabric's oversubscription), and the network path on the graph the
cluster describes (``topology: cluster``, ``generators.from_cluster``, whose ring shares
equal the presets') with and without contention between concurrent collectives. Prints the
MAPE of each per cluster and overall. ``--quick``: every 8th row.

``measure(quick, data)`` returns ``{"clusters": {cluster: {"rows", "mape_pct_comm",
"mape_pct_graph", "mape_pct_graph_contention"}}, "all": {...}, "build_s"}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import e2e_rows  # noqa: E402  (a sibling script module, found however this one is loaded)

from diffcost import api  # noqa: E402
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
PATHS = ("comm", "graph", "graph_contention")


def _predictions(model, plan, cluster, params) -> tuple[dict, float]:
    """Iteration seconds of the three paths, and the seconds spent building tables."""
    m, p = model_arrays(model), plan_arrays(plan)
    base = cluster_arrays(cluster)
    t0 = time.perf_counter()
    graph = cluster_arrays(dataclasses.replace(cluster, topology="cluster"), None, plan.n_gpus)
    build_s = time.perf_counter() - t0
    clusters = {
        "comm": base,
        "graph": graph.replace(network=graph.network.replace(contention=False)),
        "graph_contention": graph,
    }
    out = {k: float(api.simulate_jit(m, p, c, params).iteration_s) for k, c in clusters.items()}
    return out, build_s


def measure(quick: bool = False, data: Path = DATA) -> dict:
    errors: dict = defaultdict(lambda: defaultdict(list))
    build_s = 0.0
    for i, row, model, plan, cluster, params in e2e_rows.predictable(
        Path(data) / "e2e" / "calibration.csv"
    ):
        if quick and (i - 1) % 8:
            continue
        measured = float(row["measured_iter_s"])
        pred, spent = _predictions(model, plan, cluster, params)
        build_s += spent
        for path in PATHS:
            errors[cluster.name][path].append(abs(pred[path] / measured - 1.0))
            errors["all"][path].append(abs(pred[path] / measured - 1.0))
    summary = {
        name: {
            "rows": len(e["comm"]),
            **{f"mape_pct_{k}": 100 * float(np.mean(e[k])) for k in PATHS},
        }
        for name, e in sorted(errors.items())
    }
    return {"clusters": {k: v for k, v in summary.items() if k != "all"}, "all": summary["all"],
            "build_s": build_s}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="every 8th row")
    ap.add_argument("--data", type=Path, default=DATA)
    args = ap.parse_args(argv)
    out = measure(args.quick, args.data)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        "MAPE % per cluster: comm path / graph / graph with contention "
        f"({out['build_s']:.0f} s building tables)"
    )
    for name, f in {**out["clusters"], "all": out["all"]}.items():
        print(
            f"  {name:20s} {f['rows']:5d} rows  {f['mape_pct_comm']:6.2f}  "
            f"{f['mape_pct_graph']:6.2f}  {f['mape_pct_graph_contention']:6.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
