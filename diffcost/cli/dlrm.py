"""``diffcost shard-embeddings``: an embedding-table sharding plan for a DLRM, by gradient search.

Loads a DLRM (``configs/dlrm`` preset or YAML path) and a cluster, runs
``diffcost.dlrm_search.search``, the greedy planner and HugeCTR's planner
(``diffcost.dlrm_hugectr``), and prints the plan found (one row per table), its iteration time
and parts, and the two baselines' times; ``--json`` prints one object.
Exit code 1 when no plan fits in memory. On a cluster without a profile of its own every time
is the median over the population's members (``dlrm_cost.plan_cost``), and the search
minimizes their mean log time; the note (``profile``) says so.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from diffcost import config, population
from diffcost.arrays import GiB
from diffcost.cli import common
from diffcost.dlrm import DlrmSpec, load_dlrm
from diffcost.dlrm_cost import fits, make_problem, one_hot_plan, plan_cost
from diffcost.dlrm_hugectr import plan as hugectr_plan
from diffcost.dlrm_search import DlrmSearchConfig, Scored, greedy, search

PARTS = ("lookup_fwd_s", "comm_s", "dense_s", "lookup_bwd_s", "all_reduce_s")


def register(subparsers) -> None:
    """Add ``shard-embeddings`` to the ``diffcost`` subcommands."""
    s = subparsers.add_parser(
        "shard-embeddings", help="shard a DLRM's embedding tables (gradient search)"
    )
    s.add_argument("model", metavar="MODEL", help="DLRM preset (dlrm-dcnv2) or YAML path")
    s.add_argument("--cluster", required=True, help="cluster preset or YAML path")
    s.add_argument("--gpus", type=int, required=True, help="GPU count")
    s.add_argument("--batch", type=int, help="global batch (overrides the model's)")
    s.add_argument("--starts", type=int, default=32, help="relaxed starts descending at once")
    s.add_argument("--steps", type=int, default=200, help="optimizer steps per start")
    s.add_argument("--seed", type=int, default=0, help="seed of the random starts")
    common.add_profile_argument(s)
    common.add_json_argument(s)
    s.set_defaults(func=run)


def plan_dict(spec: DlrmSpec, problem, found: Scored) -> dict:
    """Plain values of one plan: per-table choices, time parts and memory."""
    out = plan_cost(problem, one_hot_plan(found.choices, problem.layout), 0.0)
    return {
        "iteration_s": found.iteration_s,
        "fits": found.fits,
        "parts": {k: float(getattr(out, k)) for k in PARTS},
        "memory_peak_bytes": found.memory_peak_bytes,
        "memory_capacity_bytes": float(out.memory_capacity_bytes),
        "tables": [
            {"name": t.name, "rows": t.rows, "pooling": t.pooling, "zipf": t.zipf, "plan": str(c)}
            for t, c in zip(spec.tables, found.choices)
        ],
    }


def hugectr_dict(spec: DlrmSpec, cluster, n_gpus: int, params, members=None) -> dict:
    """HugeCTR's planner's plan (``auto`` on one node, ``hier_auto`` on several, NVIDIA's
    defaults): its time, memory and the tables it cuts into shards; ``{"error"}`` when the
    tables exceed the planner's memory cap even split over every GPU or node."""
    try:
        split, choices = hugectr_plan(spec, cluster, n_gpus)
    except ValueError as e:  # its tables do not fit the planner's memory cap
        return {"error": str(e)}
    problem = make_problem(split, cluster, n_gpus, params, members=members)
    out = plan_cost(problem, one_hot_plan(choices, problem.layout), 0.0)
    shards: dict[str, int] = {}
    for t in split.tables:
        base = t.name.split("/")[0]
        shards[base] = shards.get(base, 0) + 1
    return {
        "iteration_s": float(out.iteration_s),
        "fits": bool(fits(out)),
        "memory_peak_bytes": float(out.memory_peak_bytes),
        "shards": {name: k for name, k in shards.items() if k > 1},
    }


def run(args: argparse.Namespace) -> int:
    """Run the command; 0 when the plan found fits, 1 otherwise."""
    common.check_at_least("--gpus", args.gpus, 1)
    spec = load_dlrm(args.model, {"batch_size": args.batch} if args.batch else None)
    cluster = config.load_cluster(args.cluster)
    params, members, note = population.constants_for(cluster, args.profile, jnp.result_type(float))
    problem = make_problem(spec, cluster, args.gpus, params, members=members)
    if members is not None:
        note += " (the search minimizes their mean log time)"
    cfg = DlrmSearchConfig(starts=args.starts, steps=args.steps, seed=args.seed)
    result = search(problem, cfg)
    baseline = result.greedy or greedy(problem)
    out = {
        "model": spec.name,
        "cluster": cluster.name,
        "n_gpus": args.gpus,
        "batch": spec.batch_size,
        "profile": note,
        "search_seconds": result.seconds,
        "evaluated": result.evaluated,
        "started_from": result.started_from,
        "best": plan_dict(spec, problem, result.best),
        "greedy": plan_dict(spec, problem, baseline),
        "hugectr": hugectr_dict(spec, cluster, args.gpus, params, members),
    }
    if args.json:
        common.print_json(out)
    else:
        _print(out)
    return 0 if result.best.fits else 1


def _print(out: dict) -> None:
    best, base = out["best"], out["greedy"]
    rows = [
        (t["name"], f"{t['rows']:,}", f"{t['pooling']:g}", f"{t['zipf']:g}", t["plan"], g["plan"])
        for t, g in zip(best["tables"], base["tables"])
    ]
    common.print_table(
        f"{out['model']} on {out['n_gpus']} GPUs of {out['cluster']}, batch {out['batch']}",
        ("table", "rows", "pooling", "zipf", "plan", "greedy"),
        rows,
        right=("rows", "pooling", "zipf"),
    )
    parts = ", ".join(f"{k[:-2]} {1e3 * v:.3f}" for k, v in best["parts"].items())
    print(
        f"iteration {1e3 * best['iteration_s']:.3f} ms ({parts} ms); greedy "
        f"{1e3 * base['iteration_s']:.3f} ms; peak memory {best['memory_peak_bytes'] / GiB:.1f} "
        f"of {best['memory_capacity_bytes'] / GiB:.0f} GiB"
        + ("" if best["fits"] else " (does NOT fit)")
    )
    hug = out["hugectr"]
    if "error" in hug:
        print(f"HugeCTR's planner: no plan ({hug['error']})")
    else:
        cut = ", ".join(f"{name} in {k}" for name, k in hug["shards"].items()) or "none"
        print(
            f"HugeCTR's planner: {1e3 * hug['iteration_s']:.3f} ms (tables cut into row shards: "
            f"{cut})" + ("" if hug["fits"] else " (does NOT fit)")
        )
    print(
        f"{out['evaluated']} plans evaluated in {out['search_seconds']:.1f} s (best polished from "
        f"the {out['started_from']} start); {out['profile']}"
    )
