"""Collectives priced on each cluster's graph against the measured tables.

    python benchmarks/topology_collectives.py [--json] [--quick]

Every row of ``shared/data/collectives/collectives.csv`` with a message of at least 1 MiB and a
collective the graph path prices (all-reduce, all-gather, reduce-scatter, all-to-all) is
priced twice with the cluster's shipped calibrated profile (``diffcost.profiles.params_for``):
on the cluster's graph (``diffcost.network.generators.from_cluster`` over the row's nodes,
``diffcost.network.cost``) and by the shipped model (``diffcost.comm``), placed as the
calibration places it. Prints the MAPE per cluster of both. ``--quick`` keeps every 16th size
of the vTrain tables (1,024 sizes per group size). Send/recv rows (4) and XLA permutes are not
priced.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from calibration.readers import read_collectives_csv  # noqa: E402
from diffcost import comm, profiles  # noqa: E402
from diffcost.arrays import cluster_arrays  # noqa: E402
from diffcost.config import load_cluster  # noqa: E402
from diffcost.network import cost  # noqa: E402
from diffcost.network.generators import from_cluster  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "collectives" / "collectives.csv"
MIN_BYTES = 2**20
PRICED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
TEMPERATURE = 1e-3


def _comm_s(op, sizes, rec, cluster, params):
    arrays = cluster_arrays(cluster)
    gpn = cluster.gpus_per_node
    group = comm.place(rec.group_size, gpn / rec.per_node, gpn)
    if op == "all_to_all":
        return comm.all_to_all_s(sizes, group, arrays, params, TEMPERATURE)
    return comm.collective_s(op, sizes, group, arrays, params, TEMPERATURE)


def _graph_s(op, sizes, rec, cluster, params):
    nodes = rec.n_nodes * rec.n_groups if rec.n_nodes > 1 else 1
    topology = from_cluster(cluster, nodes)
    pricing = cost.collective_pricing(topology, op, rec.group_size, rec.n_groups)
    capacity = jnp.asarray(topology.capacity_Bps)
    price = jax.jit(
        jax.vmap(lambda m: cost.collective_time_s(pricing, m, capacity, params, TEMPERATURE))
    )
    return price(sizes)


def _cases(quick: bool) -> dict:
    """``{(cluster, op, group_size, n_groups): [records]}`` of the rows priced."""
    rows = read_collectives_csv(DATA).collectives
    cases = collections.defaultdict(list)
    for r in rows:
        if r.size_bytes < MIN_BYTES or r.collective not in PRICED or r.group_size < 2:
            continue
        cases[(r.cluster, r.collective, r.group_size, r.n_groups, r.per_node)].append(r)
    if quick:
        cases = {k: v if len(v) < 100 else v[::16] for k, v in cases.items()}
    return cases


def measure(quick: bool = False) -> dict:
    """``{"collectives": {cluster: {"rows", "mape_pct", "mape_pct_comm"}}}``."""
    errors = collections.defaultdict(lambda: ([], []))
    params_of = {}
    for (name, op, *_), recs in sorted(_cases(quick).items()):
        cluster = load_cluster(name)
        if name not in params_of:
            params_of[name] = profiles.params_for(cluster)[0]
        params = params_of[name]
        sizes = jnp.asarray([r.size_bytes for r in recs], dtype=float)
        measured = np.array([r.time_s for r in recs])
        graph = np.asarray(_graph_s(op, sizes, recs[0], cluster, params))
        old = np.asarray(_comm_s(op, sizes, recs[0], cluster, params))
        errors[name][0].extend(np.abs(graph / measured - 1.0))
        errors[name][1].extend(np.abs(old / measured - 1.0))
    out = {
        name: {
            "rows": len(g),
            "mape_pct": round(100.0 * float(np.mean(g)), 2),
            "mape_pct_comm": round(100.0 * float(np.mean(o)), 2),
        }
        for name, (g, o) in sorted(errors.items())
    }
    return {"collectives": out}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--quick", action="store_true", help="every 16th vTrain size")
    args = parser.parse_args(argv)
    result = measure(args.quick)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'cluster':24} {'rows':>6} {'graph MAPE %':>13} {'comm MAPE %':>12}")
    for name, r in result["collectives"].items():
        print(f"{name:24} {r['rows']:6d} {r['mape_pct']:13.2f} {r['mape_pct_comm']:12.2f}")


if __name__ == "__main__":
    main()
