"""Collectives priced on each cluster's graph against the measured tables.

    python benchmarks/topology_collectives.py [--json] [--quick] [--cases] [--clusters a,b]

Every row of ``shared/data/collectives/collectives.csv`` with a message of at least 1 MiB and a
collective the graph path prices (all-reduce, all-gather, reduce-scatter, all-to-all) is
priced twice with the cluster's shipped calibrated profile (``diffcost.profiles.params_for``):
on the cluster's graph (``diffcost.network.generators.from_cluster`` over the row's nodes,
``diffcost.network.cost``) and by the shipped model (``diffcost.comm``), placed as the
calibration places it. The graph offers NVLink SHARP (``nvls``) on clusters whose switches
reduce (on the NVLS channels NCCL runs on the cluster's GPUs, ``nvls.nvls_channels``) and
prices the rows of XLA's table as XLA runs them (``cost.collective_pricing(..., xla=True)``),
with NCCL's LL128 protocol beside Simple (``protocols=True``). The graph path's
own constants, which ``comm`` and so the shipped profiles do not have
(``calibration.network_fit.GRAPH_CONSTANTS``), are fitted per GPU family, and each
cluster's ``nvlink_eff`` and NVLS constants (``GRAPH_CLUSTER_DEVICE_CONSTANTS``) per cluster
(and, where its tables are XLA's, its Simple curve's ``half_bw_bytes``, NVLink latency
scale and cost per call: ``PROTOCOL_CLUSTER_CONSTANTS``), by ``calibration.network_fit`` on these
same tables (all other constants stay at the profiles). Prints the MAPE per cluster: the graph
with those fitted constants (in sample), with the graph constants at their datasheet defaults and
``nvlink_eff`` at the profile ("prior"), with all of them fitted on the other half
of the sizes ("held-out": two folds by the parity of ``floor(log2(size))``), and ``comm``.
``--quick`` keeps every 16th size of the vTrain tables (1,024 sizes per group size);
``--clusters a,b`` prices only those clusters' tables (the fit is per GPU family, so a
cluster's figures equal the full run's only where its family's other clusters are named too);
``--cases`` also prints the held-out MAPE and mean signed error of every table (cluster,
collective, group size, concurrent groups), which the JSON always carries under ``"cases"``;
``--rows`` also the held-out signed error of every row (size in MiB: error %), which the JSON then
carries in each case (``size_bytes``, ``error_pct``).
Send/recv rows (4) and XLA permutes are not priced.
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
from calibration.network_fit import (  # noqa: E402
    GRAPH_CLUSTER_CONSTANTS,
    GRAPH_CLUSTER_DEVICE_CONSTANTS,
    GRAPH_CONSTANTS,
    PROTOCOL_CLUSTER_CONSTANTS,
    TRANSPORT_CONSTANTS,
    PricedTable,
    SwitchFit,
)
from calibration.readers import read_collectives_csv  # noqa: E402
from diffcost import comm, profiles  # noqa: E402
from diffcost.arrays import cluster_arrays  # noqa: E402
from diffcost.config import load_cluster  # noqa: E402
from diffcost.gpus import gpu_family  # noqa: E402
from diffcost.network import cost, nvls  # noqa: E402
from diffcost.network.generators import from_cluster  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "collectives" / "collectives.csv"
MIN_BYTES = 2**20
PRICED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
XLA_SOURCE = "xla_collective_perf_table"  # priced as XLA times it (``cost.CollectivePricing.xla``)
TEMPERATURE = 1e-3


def _comm_s(op, sizes, rec, cluster, params):
    arrays = cluster_arrays(cluster)
    gpn = cluster.gpus_per_node
    group = comm.place(rec.group_size, gpn / rec.per_node, gpn)
    if op == "all_to_all":
        return comm.all_to_all_s(sizes, group, arrays, params, TEMPERATURE)
    return comm.collective_s(op, sizes, group, arrays, params, TEMPERATURE)


def _graph_price(op, rec, cluster):
    """``(params, sizes) -> seconds`` on the cluster's graph, and whether ``nvls`` is offered."""
    nodes = rec.n_nodes * rec.n_groups if rec.n_nodes > 1 else 1
    topology = from_cluster(cluster, nodes)
    pricing = cost.collective_pricing(
        topology,
        op,
        rec.group_size,
        rec.n_groups,
        xla=rec.source_name == XLA_SOURCE,
        transport=cluster.transport,
        protocols=rec.source_name == XLA_SOURCE,
        nvls_channels=nvls.nvls_channels(gpu_family(cluster.gpu.name)),
    )
    capacity = jnp.asarray(topology.capacity_Bps)
    one = lambda p, m: cost.collective_time_s(pricing, m, capacity, p, TEMPERATURE)  # noqa: E731
    return jax.jit(jax.vmap(one, in_axes=(None, 0))), "nvls" in pricing.names


def _cases(quick: bool, clusters=None) -> dict:
    """``{(cluster, op, group_size, n_groups, per_node, source): [records]}`` of the rows
    priced (of ``clusters`` only, when given).

    Raises:
        ValueError: a name in ``clusters`` that has no priced row.
    """
    rows = read_collectives_csv(DATA).collectives
    cases = collections.defaultdict(list)
    for r in rows:
        if r.size_bytes < MIN_BYTES or r.collective not in PRICED or r.group_size < 2:
            continue
        if clusters and r.cluster not in clusters:
            continue
        cases[
            (r.cluster, r.collective, r.group_size, r.n_groups, r.per_node, r.source_name)
        ].append(r)
    missing = sorted(set(clusters or ()) - {k[0] for k in cases})
    if missing:
        known = sorted({r.cluster for r in rows if r.size_bytes >= MIN_BYTES})
        raise ValueError(f"--clusters {','.join(missing)}: no priced rows; expected of {known}")
    if quick:
        cases = {k: v if len(v) < 100 else v[::16] for k, v in cases.items()}
    return cases


def _tables(quick: bool, clusters=None) -> list[dict]:
    """Every case priced: its ``PricedTable``, whether NVLS is offered, ``comm``'s times, and
    the case's key ``(cluster, collective, group_size, n_groups, per_node, source)``."""
    out, params_of = [], {}
    for key, recs in sorted(_cases(quick, clusters).items()):
        name, op = key[:2]
        cluster = load_cluster(name)
        if name not in params_of:
            params_of[name] = profiles.params_for(cluster)[0]
        params = params_of[name]
        sizes = np.array([r.size_bytes for r in recs], dtype=float)
        price, switch = _graph_price(op, recs[0], cluster)
        table = PricedTable(
            name,
            gpu_family(cluster.gpu.name),
            price,
            sizes,
            np.array([r.time_s for r in recs]),
            params,
        )
        comm_s = np.asarray(_comm_s(op, jnp.asarray(sizes), recs[0], cluster, params))
        out.append({"table": table, "switch": switch, "comm_s": comm_s, "key": key})
    return out


def _odd(table: PricedTable) -> np.ndarray:
    return np.floor(np.log2(table.sizes)).astype(int) % 2 == 1


def _heldout_s(t: PricedTable, folds: dict) -> np.ndarray:
    """Each row of ``t`` predicted with the graph constants fitted on the rows of the other
    size-octave parity (two folds, ``folds[parity]``: even and odd ``floor(log2(size))``).
    Every size is priced in both folds and the fold's rows kept: one shape, so one compiled
    program per table, the one ``measure`` prices the whole table with."""
    times = np.zeros(len(t.sizes))
    for parity in (False, True):
        rows = _odd(t) == parity
        params = profiles.apply_values(t.params, folds[parity][t.cluster])
        times[rows] = np.asarray(t.price(params, jnp.asarray(t.sizes)))[rows]
    return times


def _case(e: dict, held: np.ndarray, rows: bool = False) -> dict:
    """One table's held-out MAPE and mean signed error (%, predicted over measured); ``rows``:
    also each row's held-out signed error, ``{"size_bytes": [...], "error_pct": [...]}``."""
    err = held / e["table"].measured_s - 1.0
    cluster, op, group, groups = e["key"][:4]
    per_row = {}
    if rows:
        errors = [round(100.0 * float(x), 1) for x in err]
        per_row = {"size_bytes": [int(x) for x in e["table"].sizes], "error_pct": errors}
    return per_row | {
        "cluster": cluster,
        "collective": op,
        "group_size": group,
        "n_groups": groups,
        "rows": len(err),
        "mape_pct_heldout": round(100.0 * float(np.mean(np.abs(err))), 2),
        "bias_pct_heldout": round(100.0 * float(np.mean(err)), 2),
    }


def _cluster_extra(entries: list[dict]) -> dict[str, tuple[str, ...]]:
    """Each cluster's own constants beyond ``GRAPH_CLUSTER_CONSTANTS``: its transport's, and
    ``PROTOCOL_CLUSTER_CONSTANTS`` where its tables are priced with ``protocols`` (XLA's)."""
    out = {}
    for e in entries:
        name = e["table"].cluster
        own = TRANSPORT_CONSTANTS[load_cluster(name).transport]
        if e["key"][-1] == XLA_SOURCE:
            own += tuple(n for n in PROTOCOL_CLUSTER_CONSTANTS if n not in own)
        out[name] = tuple(dict.fromkeys(out.get(name, ()) + own))
    return out


def measure(quick: bool = False, clusters=None, rows: bool = False) -> dict:
    """``{"collectives": {cluster: {"rows", "mape_pct", "mape_pct_prior", "mape_pct_heldout",
    "mape_pct_comm"}}, "graph_constants": {cluster: {name: value}}, "cases": [...]}``: the
    graph path with its constants fitted on all rows (``mape_pct``), at their defaults and the
    profiles (``_prior``), fitted on the other size-octave parity (``_heldout``), and ``comm``;
    ``cases`` the held-out error of each table (``_case``; ``rows``: and of each of its rows).
    ``clusters``: price only these."""
    entries = _tables(quick, clusters)
    fit = SwitchFit(
        [e["table"] for e in entries],
        GRAPH_CONSTANTS,
        cluster_names=GRAPH_CLUSTER_CONSTANTS,
        cluster_extra=_cluster_extra(entries),
        cluster_device=GRAPH_CLUSTER_DEVICE_CONSTANTS,
    )
    fitted = fit.fit()
    folds = {
        parity: fit.fit({id(t): _odd(t) != parity for t in fit.tables}) for parity in (False, True)
    }
    del fit  # frees its compiled fits (one per GPU family)
    errors = collections.defaultdict(lambda: collections.defaultdict(list))
    heldout = []
    for e in entries:
        t = e["table"]
        sizes = jnp.asarray(t.sizes)
        fit_params = profiles.apply_values(t.params, fitted[t.cluster])
        heldout.append(_heldout_s(t, folds))
        for key, pred in (
            ("mape_pct", t.price(fit_params, sizes)),
            ("mape_pct_prior", t.price(t.params, sizes)),
            ("mape_pct_heldout", heldout[-1]),
            ("mape_pct_comm", e["comm_s"]),
        ):
            errors[t.cluster][key].extend(np.abs(np.asarray(pred) / t.measured_s - 1.0))
        # Each table's program holds its own memory mappings (XLA's CPU JIT maps every kernel
        # apart): kept for all 132 tables they near Linux's default vm.max_map_count (65,530).
        t.price.clear_cache()
    out = {
        name: {"rows": len(errs["mape_pct"])}
        | {key: round(100.0 * float(np.mean(v)), 2) for key, v in errs.items()}
        for name, errs in sorted(errors.items())
    }
    cases = [_case(e, held, rows) for e, held in zip(entries, heldout)]
    return {"collectives": out, "graph_constants": fitted, "cases": cases}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--quick", action="store_true", help="every 16th vTrain size")
    parser.add_argument("--cases", action="store_true", help="print the error of every table")
    parser.add_argument("--rows", action="store_true", help="and of every row (implies --cases)")
    parser.add_argument("--clusters", default="", help="comma-separated cluster names only")
    args = parser.parse_args(argv)
    clusters = [c for c in args.clusters.split(",") if c] or None
    result = measure(args.quick, clusters, args.rows)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'cluster':22} {'rows':>6} {'graph':>7} {'prior':>7} {'held-out':>9} {'comm':>7}")
    for name, r in result["collectives"].items():
        print(
            f"{name:22} {r['rows']:6d} {r['mape_pct']:7.2f} {r['mape_pct_prior']:7.2f} "
            f"{r['mape_pct_heldout']:9.2f} {r['mape_pct_comm']:7.2f}"
        )
    for cluster, values in result["graph_constants"].items():
        print(f"{cluster}: " + ", ".join(f"{k} = {v:.4g}" for k, v in values.items()))
    if args.cases or args.rows:
        print(f"{'cluster':22} {'collective':15} {'group':>5} {'x':>3} {'held-out':>9} {'bias':>7}")
        for c in result["cases"]:
            print(
                f"{c['cluster']:22} {c['collective']:15} {c['group_size']:5d} "
                f"{c['n_groups']:3d} {c['mape_pct_heldout']:9.2f} {c['bias_pct_heldout']:+7.2f}"
            )
            if args.rows:  # held-out signed error (%) by size (MiB), ascending
                pairs = sorted(zip(c["size_bytes"], c["error_pct"]))
                print("    " + " ".join(f"{size / 2**20:g}:{err:+.0f}" for size, err in pairs))


if __name__ == "__main__":
    main()
