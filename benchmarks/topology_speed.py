"""Speed of the cost model's network path: the GPT-3 175B sweep on a two-tier fat-tree.

    python benchmarks/topology_speed.py [--json] [--quick]

The GPT-3 175B example (``configs/examples/gpt3-175b.yaml``: Selene, 1,024 A100) with its
cluster's NVLink nodes on a two-tier fat-tree of 48-port switches tapered 2:1 (1,024 NICs of
200 Gb/s, one per GPU: 32 leaves, 16 spines), built with the generators. Figures:

* ``tables_build_s``: routing every group layout into ``NetworkTables`` (numpy, once);
* ``sweep_configs_per_s``: ``jit(vmap(simulate))`` over every plan of the space, as
  ``speed.py`` enumerates it, with contention (median of 5 warm runs), the plan leaves that
  do not vary passed unbatched as ``diffcost sweep`` does (``sweep.batch_axes``);
* ``sweep_configs_per_s_all_batched``: the same with every plan leaf batched;
* ``sweep_configs_per_s_without_contention``: the same, ``contention=False``;
* ``sweep_configs_per_s_comm_path``: the same sweep on the existing path, in the same run
  (the machine is shared: only figures of one run compare);
* ``contention_ratio``: with over without contention;
* ``single_prediction_us``: median warm ``api.simulate_jit`` of the example, with contention.

Targets: sweep with contention >= 200,000 configs/s, one prediction <= 1 ms. Float32, as
``speed.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffcost import api, space, sweep  # noqa: E402
from diffcost.network import generators as gen  # noqa: E402
from diffcost.network.graph import LinkSpec  # noqa: E402
from diffcost.network.tables import build_tables  # noqa: E402
from diffcost.simulate import simulate  # noqa: E402

EXAMPLE = ROOT / "configs" / "examples" / "gpt3-175b.yaml"
TARGETS = {"sweep_configs_per_s": 200_000.0, "single_prediction_us": 1000.0}


def fat_tree_of(cluster, nodes: int):
    """``nodes`` NVLink nodes of ``cluster`` on a 2:1 tapered two-tier fat-tree of 48-port
    switches, one NIC of the cluster's rate per GPU."""
    g = cluster.gpus_per_node
    nvlink = LinkSpec(cluster.nvlink_GBps * 1e9 / 2.0, cluster.nvlink_latency_us * 1e-6 / 2.0)
    nic = LinkSpec(cluster.nic_Gbps * 1e9 / 8.0, cluster.nic_latency_us * 1e-6 / 4.0)
    fabric = gen.fat_tree(2, 48, nic, oversubscription=2, hosts=nodes * g)
    return gen.hierarchical(gen.switch_domain(g, nvlink), nodes, fabric)


def _median_s(fn, repeats: int, inner: int = 1) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            jax.block_until_ready(fn())
        runs.append((time.perf_counter() - t0) / inner)
    return statistics.median(runs)


def measure(quick: bool = False) -> dict:
    exp = api.load(EXAMPLE)
    model, plan, cluster = api.experiment_arrays(exp)
    params = api.params_for(exp)[0]
    nodes = exp.plan.n_gpus // exp.cluster.gpus_per_node
    t0 = time.perf_counter()
    tables = build_tables(fat_tree_of(exp.cluster, nodes), exp.plan.n_gpus)
    build_s = time.perf_counter() - t0
    plans, _ = space.enumerate_plans(
        space.make_space(exp.model, exp.cluster, exp.plan.n_gpus, exp.plan.global_batch)
    )
    n = int(plans.tp.shape[0])
    plans = jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=plan.tp.dtype), plans)
    axes, split = sweep.batch_axes(plans)  # as ``diffcost sweep`` batches them
    split = jax.device_put(split)
    with_contention = cluster.replace(network=tables)
    variants = {
        "sweep_configs_per_s": (with_contention, axes, split),
        "sweep_configs_per_s_without_contention": (
            cluster.replace(network=tables.replace(contention=False)),
            axes,
            split,
        ),
        "sweep_configs_per_s_comm_path": (cluster, axes, split),
        "sweep_configs_per_s_all_batched": (with_contention, 0, jax.device_put(plans)),
    }
    out = {}
    for key, (c, a, p) in variants.items():
        one = lambda p, c=c: simulate(model, p, c, params).iteration_s  # noqa: E731
        fn = jax.jit(jax.vmap(one, in_axes=(a,)))
        jax.block_until_ready(fn(p))
        out[key] = n / _median_s(lambda fn=fn, p=p: fn(p), 3 if quick else 5)
    one = cluster.replace(network=tables)
    jax.block_until_ready(api.simulate_jit(model, plan, one, params))
    single_s = _median_s(
        lambda: api.simulate_jit(model, plan, one, params), 5, 50 if quick else 200
    )
    return {
        **out,
        "single_prediction_us": 1e6 * single_s,
        "contention_ratio": out["sweep_configs_per_s"]
        / out["sweep_configs_per_s_without_contention"],
        "sweep_configs": n,
        "tables_build_s": build_s,
        "tiers": list(tables.tiers),
        "devices": [str(d) for d in jax.devices()],
    }


def missed(s: dict) -> list[str]:
    out = []
    if s["sweep_configs_per_s"] < TARGETS["sweep_configs_per_s"]:
        out.append("speed.sweep_configs_per_s")
    if s["single_prediction_us"] > TARGETS["single_prediction_us"]:
        out.append("speed.single_prediction_us")
    return out


def print_speed(s: dict) -> None:
    print(
        f"speed: GPT-3 175B sweep ({s['sweep_configs']:,} plans, 1,024 GPUs, 2-tier fat-tree 2:1; "
        f"tables built in {s['tables_build_s']:.1f} s)"
    )
    print(f"  with contention       {s['sweep_configs_per_s']:>10,.0f} configs/s (target 200,000)")
    alone = s["sweep_configs_per_s_without_contention"]
    print(f"  without contention    {alone:>10,.0f} configs/s (ratio {s['contention_ratio']:.2f})")
    print(f"  existing path         {s['sweep_configs_per_s_comm_path']:>10,.0f} configs/s")
    every = s["sweep_configs_per_s_all_batched"]
    print(f"  every leaf batched    {every:>10,.0f} configs/s (with contention)")
    print(f"  one prediction        {s['single_prediction_us']:>10.0f} us (target 1,000)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args(argv)
    s = measure(args.quick)
    s["targets_missed"] = missed(s)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        print_speed(s)
        print("targets missed: " + (", ".join(s["targets_missed"]) or "none"))
    return 1 if s["targets_missed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
