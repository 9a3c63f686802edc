"""Graph models on the command line: ``diffcost predict --graph`` and ``diffcost search --sbp``.

A graph model is a zoo name (``resnet50``) or ``module:function`` (a factory returning a JAX
function and example arguments; ``diffcost.opgraph.models``). Its plan is a 1-D mesh of
``--mesh`` GPUs of ``--cluster`` and a sharding: ``data`` (data parallel), ``replicated``,
``search`` (``sbp_search.gradient_search``, started from data parallel too), or a JSON file
with ``{"layouts": {node: signature}}`` as ``search --sbp --json`` prints it. The step time and
its parts come from ``diffcost.opgraph.step``. On a cluster without a profile of its own they
are the median over the population's members (``population.median_breakdown``), and the
search's pairwise costs are the members' weighted so that their sum is that median to first
order about the data-parallel plan (``population.tangent_weights``); the note says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from collections import Counter

import jax
import jax.numpy as jnp

from diffcost import config, population, trace
from diffcost.arrays import cluster_arrays
from diffcost.cli import common
from diffcost.opgraph import sbp, sbp_search, step
from diffcost.opgraph.ir import GEMM_KINDS
from diffcost.opgraph.models import GraphModel, load_graph_model

SHARDINGS = ("data", "replicated", "search")
MAX_ROWS = 60  # per-node layout rows printed by search --sbp
PART_LABELS = {
    "compute_s": "compute (forward + backward)",
    "relayout_s": "re-layout comm (activations, parameter gathers)",
    "exposed_grad_sync_s": "gradient sync not hidden by the backward",
    "optimizer_s": "optimizer step",
    "overhead_s": "host steps (microbatch, iteration)",
}


def add_graph_arguments(p: argparse.ArgumentParser) -> None:
    """``--graph``, ``--mesh``, ``--batch``, ``--sharding`` (``--cluster`` is ``predict``'s)."""
    p.add_argument(
        "--graph",
        metavar="MODEL",
        help="predict a graph model: a zoo name (resnet50, vgg16, vit_b16, dlrm_dcnv2, ...) or "
        "module:function (a factory returning (fn, example_args[, argnums]))",
    )
    p.add_argument("--mesh", type=int, metavar="N", help="GPUs of the 1-D mesh (with --graph)")
    p.add_argument("--batch", type=int, help="global batch of the graph model (with --graph)")
    p.add_argument(
        "--sharding",
        default="data",
        metavar="S",
        help="with --graph: data (batch split, weights replicated; default), replicated, "
        "search (per-operator SBP search), or a JSON plan from 'search --sbp --json'",
    )


def graph_config(path: str | None) -> dict | None:
    """The graph request of an experiment YAML whose ``model`` names a graph model
    (``model: {graph: resnet50, batch: 256}``, ``cluster: NAME``, ``plan: {mesh: 8,
    sharding: data}``), or None for any other file."""
    if not path or not str(path).endswith((".yaml", ".yml")):
        return None
    try:
        file = config.locate_experiment(path)
    except config.ConfigError:
        return None  # the experiment loader reports it
    doc, where = config.read_yaml(file)
    model = doc.get("model")
    if not isinstance(model, dict) or "graph" not in model:
        return None
    plan = doc.get("plan") or {}
    known = {"mesh", "sharding"}
    if not isinstance(plan, dict) or set(plan) - known:
        raise config.ConfigError(
            f"{where}: plan of a graph model: {plan!r}; valid keys: {sorted(known)}"
        )
    if "cluster" not in doc:
        raise config.ConfigError(f"{where}: a graph model needs 'cluster' (a preset or YAML)")
    return {
        "graph": str(model["graph"]),
        "batch": model.get("batch"),
        "cluster": doc["cluster"],
        "mesh": plan.get("mesh"),
        "sharding": str(plan.get("sharding", "data")),
    }


class GraphRun:
    """A traced graph model on a mesh of a cluster: its SBP problem and costs by part."""

    def __init__(self, model: str, cluster: str, mesh: int | None, batch, profile):
        if mesh is None:
            raise config.ConfigError("--mesh N (the GPUs of the mesh) is required with a graph")
        common.check_at_least("--mesh", mesh, 1)
        self.cluster = config.load_cluster(cluster)
        # members: the population's (leading axis) on a cluster without a profile, else None
        self.params, self.members, self.note = population.constants_for(self.cluster, profile)
        self.model: GraphModel = load_graph_model(model, batch)
        self.problem = sbp.sbp_problem(self.model.graph, mesh)
        self.arrays = cluster_arrays(self.cluster)
        price = functools.partial(sbp.sbp_parts, self.problem, self.arrays)
        self.parts = price(self.params) if self.members is None else jax.vmap(price)(self.members)
        self.names = dict(zip(self.model.graph.inputs, self.model.input_names))

    @functools.cached_property
    def costs(self) -> sbp.SbpCosts:
        """The search's pairwise costs: the parts summed; for the population's members, their
        costs weighted by ``population.tangent_weights`` at the data-parallel plan."""
        costs = self.parts.costs()
        if self.members is None:
            return costs
        dp = self.data_parallel()
        each = [
            sbp_search.assignment_cost_s(
                self.problem, jax.tree_util.tree_map(lambda x: x[m], costs), dp
            )
            for m in range(costs.node_s.shape[0])
        ]
        weights = jnp.asarray(population.tangent_weights(each))
        return jax.tree_util.tree_map(lambda x: jnp.tensordot(weights, x, 1), costs)

    def data_parallel(self):
        return step.data_parallel_choice(self.problem, self.model.batch_inputs)

    def choice(self, sharding: str, steps: int = 400, seed: int = 0):
        """The assignment of ``sharding`` and a label saying how it was obtained."""
        if sharding == "data":
            return self.data_parallel(), "data parallel"
        if sharding == "replicated":
            return step.replicated_choice(self.problem), "replicated"
        if sharding == "search":
            sol = self.search(steps, seed)
            return sol.choice, f"searched ({sol.method})"
        try:
            with open(sharding) as fh:
                plan = json.load(fh)
        except FileNotFoundError as e:
            raise config.ConfigError(
                f"--sharding {sharding!r}: not one of {', '.join(SHARDINGS)} and no such file"
            ) from e
        except json.JSONDecodeError as e:
            raise config.ConfigError(f"--sharding {sharding}: not JSON ({e})") from e
        if not isinstance(plan, dict) or not isinstance(plan.get("layouts"), dict):
            raise config.ConfigError(
                f"--sharding {sharding}: needs a 'layouts' object (node -> signature)"
            )
        return step.choice_from_layouts(self.problem, plan["layouts"], sharding), sharding

    def step_time(self, choice) -> step.StepTime:
        """The step time of ``choice``; the members' median where there are members."""
        time_fn = functools.partial(
            step.step_time, self.problem, choice=choice, cluster=self.arrays
        )
        if self.members is None:
            return time_fn(self.parts, params=self.params)
        return population.median_breakdown(jax.vmap(time_fn)(self.parts, params=self.members))

    def search(self, steps: int = 400, seed: int = 0):
        """The searched plan; the data-parallel one when its step time (overlapped, bucketed) is
        no longer than the searched plan's (the search minimizes the serial pairwise cost)."""
        cfg = sbp_search.GradientConfig(steps=steps, seed=seed)
        dp = self.data_parallel()
        sol = sbp_search.gradient_search(self.problem, self.costs, cfg, [dp])
        if float(self.step_time(dp).iteration_s) <= float(self.step_time(sol.choice).iteration_s):
            serial = sbp_search.assignment_cost_s(self.problem, self.costs, dp)
            method = f"{sol.method}; data parallel kept"
            sol = dataclasses.replace(sol, choice=dp, cost_s=serial, method=method)
        return sol

    def result(self, choice, label: str) -> dict:
        """The JSON object of one plan: request, iteration time and parts."""
        st = self.step_time(choice)
        graph = self.model.graph
        iteration = float(st.iteration_s)
        return {
            "model": self.model.name,
            "operators": len(graph.operators),
            "batch": self.model.batch,
            "cluster": self.cluster.name,
            "mesh": self.problem.mesh_size,
            "sharding": label,
            "iteration_s": iteration,
            "samples_per_s": (self.model.batch or 0) / iteration,
            "breakdown": {k: float(getattr(st, k)) for k in step.PARTS},
            "grad_sync_s": float(st.grad_sync_s),
            "profile": self.note,
        }

    def write_trace(self, path: str, choice, meta: dict) -> None:
        """The step's timeline at ``params`` (on a cluster without a profile, the population's
        mean constants, as ``predict --trace`` draws a transformer's)."""
        parts = (
            self.parts
            if self.members is None
            else sbp.sbp_parts(self.problem, self.arrays, self.params)
        )
        args = (self.problem, parts, choice, self.arrays, self.params, self.names)
        events = step.step_events(*args)
        trace.write_trace(path, events, meta)


def print_result(d: dict) -> None:
    """The headline and the table of parts."""
    print(
        f"{d['model']} ({d['operators']} operators), batch {d['batch']}, on a mesh of "
        f"{d['mesh']} GPUs of {d['cluster']}; sharding: {d['sharding']}"
    )
    print(f"iteration {d['iteration_s'] * 1e3:.4g} ms   samples/s {d['samples_per_s']:.4g}")
    rows = [
        (PART_LABELS[k], f"{v * 1e3:.4g}", f"{100 * v / d['iteration_s']:.1f}%")
        for k, v in d["breakdown"].items()
    ]
    common.print_table("time per iteration", ("part", "ms", "share"), rows)
    print(f"constants: {d['profile']}")


def run_predict(args: argparse.Namespace) -> int:
    """``diffcost predict --graph``."""
    req = graph_config(args.config) or {}
    graph, cluster = args.graph or req.get("graph"), args.cluster or req.get("cluster")
    if cluster is None:
        raise config.ConfigError("--graph needs --cluster NAME (a preset or YAML path)")
    mesh = next((m for m in (args.mesh, args.gpus, req.get("mesh")) if m is not None), None)
    batch = args.batch if args.batch is not None else req.get("batch")
    run = GraphRun(graph, cluster, mesh, batch, args.profile)
    sharding = args.sharding if args.sharding != "data" else req.get("sharding", "data")
    choice, label = run.choice(sharding)
    d = run.result(choice, label)
    if args.trace:
        run.write_trace(args.trace, choice, {k: d[k] for k in ("model", "mesh", "sharding")})
        d["trace"] = args.trace
    if args.json:
        common.print_json(d)
        return 0
    print_result(d)
    if args.trace:
        print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    return 0


def layout_rows(run: GraphRun, choice) -> list[tuple[str, str, str]]:
    """Compact layouts: each trained parameter, and each matrix product or convolution."""
    rows = []
    for node, s in zip(run.problem.nodes, choice):
        sig = node.signatures[s].name
        if node.op < 0 and node.trained:
            rows.append(("parameter", run.names.get(node.tensor, node.name), sig))
        elif node.op >= 0:
            op = run.model.graph.operators[node.op]
            if op.kind in GEMM_KINDS:
                rows.append((op.primitive, op.scope or node.name, sig))
    return rows


def run_search(args: argparse.Namespace) -> int:
    """``diffcost search --sbp``: the searched plan against data parallel."""
    if args.model is None:
        raise config.ConfigError("search --sbp needs MODEL (a zoo name or module:function)")
    run = GraphRun(args.model, args.cluster, args.gpus, args.global_batch, args.profile)
    t0 = time.perf_counter()
    sol = run.search(args.steps or 400, args.seed)
    seconds = time.perf_counter() - t0
    found = run.result(sol.choice, f"searched ({sol.method})")
    if run.members is not None:
        found["profile"] += "; the search minimizes their median to first order about data parallel"
    dp = run.result(run.data_parallel(), "data parallel")
    out = {
        **found,
        "search_seconds": seconds,
        "rounded_s": sol.rounded_s,
        "data_parallel": {k: dp[k] for k in ("iteration_s", "breakdown")},
        "speedup_vs_data_parallel": dp["iteration_s"] / found["iteration_s"],
        "layouts": step.layouts(run.problem, sol.choice),
    }
    if args.trace:
        run.write_trace(args.trace, sol.choice, {"model": found["model"], "mesh": found["mesh"]})
        out["trace"] = args.trace
    if args.json:
        common.print_json(out)
        return 0
    print_result(found)
    print(
        f"data parallel: {dp['iteration_s'] * 1e3:.4g} ms; the searched plan is "
        f"{out['speedup_vs_data_parallel']:.3f}x as fast ({seconds:.1f} s of search)"
    )
    rows = layout_rows(run, sol.choice)
    counted = Counter((kind, sig) for kind, _, sig in rows)
    summary = [(k, sig, str(n)) for (k, sig), n in sorted(counted.items())]
    common.print_table("layouts chosen", ("node", "signature", "count"), summary)
    if len(rows) <= MAX_ROWS:
        common.print_table("per node", ("node", "where", "signature"), rows, right=())
    else:
        print(f"{len(rows)} nodes: --json lists every node's layout")
    if args.trace:
        print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    return 0
