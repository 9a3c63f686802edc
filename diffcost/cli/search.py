"""``diffcost search``: the fastest plans that fit, found by gradient descent and a polish.

``diffcost.search.search`` finds the plans; this module loads the space, predicts each plan
found in full as ``predict`` does (``diffcost.api.predict``: on a cluster timed as the median
over the population's members, that median, which can reorder the plans; ``ranked``) and
reports them: the best one as ``predict`` prints it, then a table of the top K, or one JSON
object. Exit code 1 when no plan fits.

``--sbp`` searches the per-operator sharding of a graph model instead (``diffcost.cli.graph``)
and ``--embedding-sharding`` a DLRM's embedding-table sharding (``diffcost.cli.dlrm``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np
import yaml

from diffcost import api, population, profiles
from diffcost import search as search_mod
from diffcost.arrays import GiB
from diffcost.cli import common, dlrm, graph
from diffcost.cli.predict import breakdown_dict, print_prediction
from diffcost.config import ConfigError
from diffcost.profiles import params_for
from diffcost.simulate import STATUS_NAMES
from diffcost.space import Choice, Space, load_space
from diffcost.specs import Experiment, PlanSpec

COLUMNS = ("#", "plan", "iteration", "vs best", "compute", "comm", "bubble", "other", "MFU %")


def register(subparsers) -> None:
    """Add ``search`` to the ``diffcost`` subcommands.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    s = subparsers.add_parser(
        "search", help="find a fast plan that fits (gradient descent + polish)"
    )
    common.add_space_arguments(s, batch_required=False)
    common.add_profile_argument(s)
    common.add_json_argument(s)
    s.add_argument("--top", type=int, default=5, metavar="K", help="print the K best plans")
    s.add_argument(
        "--starts", type=int, default=32, help="relaxed starts descending at once (not --sbp: 64)"
    )
    s.add_argument(
        "--steps",
        type=int,
        help="optimizer steps per start (default 150; --sbp 400, --embedding-sharding 200)",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of the random starts")
    kind = s.add_mutually_exclusive_group()
    kind.add_argument(
        "--sbp",
        action="store_true",
        help="search the per-operator sharding of a graph model (MODEL: a zoo name or "
        "module:function) on a 1-D mesh of --gpus GPUs; --global-batch: its batch",
    )
    kind.add_argument(
        "--embedding-sharding",
        action="store_true",
        help="shard a DLRM's embedding tables (as 'diffcost shard-embeddings')",
    )
    s.add_argument("--trace", metavar="FILE.json", help="with --sbp: write the step's timeline")
    s.add_argument(
        "--save-plans",
        metavar="DIR",
        help="write each plan found as an experiment YAML, DIR/plan-1.yaml best first, for "
        "predict, explain or suggest",
    )
    s.set_defaults(func=run)


def _plan_experiment(space: Space, choice: Choice) -> Experiment:
    """The experiment of one plan of the space."""
    return Experiment(
        model=space.model,
        cluster=space.cluster,
        plan=space.plan_spec(choice),
        source=f"search {space.model.name} on {space.n_gpus} GPUs of {space.cluster.name}",
    )


def _reference(name_or_path: str) -> str:
    """A preset name as it is; a file as its absolute path (the YAML may be written elsewhere)."""
    path = Path(name_or_path)
    return str(path.resolve()) if path.is_file() else name_or_path


def plan_config(space: Space, choice: Choice, model: str, cluster: str, seq=None) -> dict:
    """One plan of ``space`` as an experiment YAML mapping (``diffcost.config.load_experiment``
    reads it back to the same experiment).

    Args:
        space: the space searched.
        choice: the plan.
        model, cluster: the model and cluster as the search was given them (preset names or
            YAML paths).
        seq: the sequence length the search set, if any.

    Returns:
        ``{"description", "gpus", "model", "cluster", "plan"}``; the plan lists tp, pp, dp,
        microbatch and global_batch and every other field that is not ``PlanSpec``'s default.
    """
    always = ("tp", "pp", "dp", "microbatch", "global_batch")
    changed = space.plan_spec(choice).fields_from(PlanSpec(), always)
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in changed.items()}
    model_ref = _reference(model)
    return {
        "description": f"{choice.label(space)}: found by diffcost search",
        "gpus": space.n_gpus,
        "model": {"base": model_ref, "seq_len": seq} if seq else model_ref,
        "cluster": _reference(cluster),
        "plan": fields,
    }


def save_plans(args: argparse.Namespace, space: Space, result: search_mod.SearchResult):
    """Write ``plan_config`` of every plan found to ``args.save_plans``; their paths."""
    folder = Path(args.save_plans)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--save-plans {folder}: cannot create the folder ({err})") from None
    paths = []
    for k, c in enumerate(result.best, 1):
        path = folder / f"plan-{k}.yaml"
        tree = plan_config(space, c.choice, args.model, args.cluster, args.seq)
        path.write_text(yaml.safe_dump(tree, sort_keys=False, default_flow_style=None, width=100))
        paths.append(str(path))
    return paths


def ranked(
    space: Space, result: search_mod.SearchResult, params, members=()
) -> tuple[search_mod.SearchResult, list[dict]]:
    """``result`` with its plans in the order of ``predict``'s time, and each plan's entry of
    ``top`` (its ``predict --json`` object). Where ``predict`` takes the median over the
    population's ``members`` (``profiles.population_members``: a cluster without a profile of
    its own, or a profile file with members; ``diffcost.population``) each plan found is timed
    that way, which can reorder plans the search ranked at the members' mean constants;
    otherwise with ``params``."""
    stacked = population.stack_members(list(members)) if members else None
    top = []
    for c in result.best:
        exp = _plan_experiment(space, c.choice)
        if stacked is None:
            out = api.predict(exp, params=params)
        else:
            out = population.simulate_members(*api.experiment_arrays(exp), stacked)
        d = breakdown_dict(exp, jax.tree_util.tree_map(np.asarray, out))
        top.append({"plan": c.choice.describe(space), "label": c.choice.label(space), **d})
    order = sorted(range(len(top)), key=lambda i: top[i]["iteration_s"])
    best = [result.best[i] for i in order]
    return dataclasses.replace(result, best=best), [top[i] for i in order]


def summary(space: Space, result: search_mod.SearchResult, top: list[dict], note: str) -> dict:
    """The JSON object of ``search --json``.

    Args:
        space: the space searched.
        result: ``diffcost.search.search``'s result, its plans in ``ranked``'s order.
        top: ``ranked``'s entries of the plans found.
        note: which constants those are.

    Returns:
        Plain Python values: the request, ``profile``, ``fits``, ``search`` (timings and
        counts), ``top`` (each plan with its ``predict --json`` object) and ``closest`` (the
        plan with the smallest peak memory).
    """
    closest = result.closest
    return {
        "model": space.model.name,
        "cluster": space.cluster.name,
        "n_gpus": space.n_gpus,
        "global_batch": space.global_batch,
        "seq_len": space.model.seq_len,
        "profile": note,
        "fits": bool(top),
        "search": {
            "seconds": result.seconds,
            "descent_s": result.descent_s,
            "rounding_s": result.rounding_s,
            "polish_s": result.polish_s,
            "evaluated": result.evaluated,
            "polish_rounds": result.rounds,
        },
        "top": top,
        "closest": {
            "plan": closest.choice.describe(space),
            "label": closest.choice.label(space),
            "memory_peak_bytes": closest.memory_peak_bytes,
            "memory_capacity_bytes": space.cluster.gpu.memory_GiB * GiB,
            "status": STATUS_NAMES[closest.status],
        },
    }


def _top_rows(top: list[dict]) -> list[tuple[str, ...]]:
    """One table row per plan found: times in seconds, against the best, MFU, peak memory."""
    best_s = top[0]["iteration_s"]
    rows = []
    for i, d in enumerate(top, 1):
        parts = d["breakdown"]
        comm = sum(v for k, v in parts.items() if k.endswith("comm_s"))
        other = parts["optimizer_s"] + parts["overhead_s"]
        rows.append(
            (
                str(i),
                d["label"],
                f"{d['iteration_s']:.4g}",
                f"+{100 * (d['iteration_s'] / best_s - 1):.2f}%",
                f"{parts['compute_s']:.3g}",
                f"{comm:.3g}",
                f"{parts['bubble_s']:.3g}",
                f"{other:.3g}",
                f"{100 * d['mfu']:.1f}",
                f"{d['memory_peak_bytes'] / GiB:.1f}",
            )
        )
    return rows


def _print_nothing_fits(space: Space, closest: search_mod.Candidate) -> None:
    """Say that no plan fits, and how close the smallest peak memory came."""
    print(
        f"nothing fits: no plan of {space.model.name} on {space.n_gpus} GPUs of "
        f"{space.cluster.name} with global batch {space.global_batch} fits in "
        f"{space.cluster.gpu.memory_GiB:g} GiB per GPU. The smallest peak memory reached is "
        f"{closest.memory_peak_bytes / GiB:.1f} GiB ({closest.choice.label(space)}); use more "
        "GPUs, a GPU with more memory, or a shorter sequence."
    )


def _print_report(space: Space, result: search_mod.SearchResult, out: dict) -> None:
    """The best plan as ``predict`` prints it, the table of the top plans, the timings."""
    top = out["top"]
    print_prediction(_plan_experiment(space, result.best[0].choice), top[0])
    title = f"top {len(top)} plans found (seconds per iteration)"
    columns = (*COLUMNS, "peak GiB")
    common.print_table(title, columns, _top_rows(top), right=set(columns) - {"plan"})
    print(
        f"search: {result.seconds:.2f} s (descent {result.descent_s:.2f} s, rounding "
        f"{result.rounding_s:.2f} s, polish {result.polish_s:.2f} s), {result.evaluated} "
        f"discrete plans evaluated exactly, {result.rounds} polish rounds (a first run also "
        f"compiles); comm = exposed communication, other = optimizer + overhead; constants: "
        f"{out['profile']}"
    )


def _embedding_args(args: argparse.Namespace) -> argparse.Namespace:
    """``shard-embeddings``' arguments from ``search --embedding-sharding``'s."""
    return argparse.Namespace(
        model=args.model,
        cluster=args.cluster,
        gpus=args.gpus,
        batch=args.global_batch,
        starts=args.starts,
        steps=args.steps or 200,
        seed=args.seed,
        profile=args.profile,
        json=args.json,
    )


def run(args: argparse.Namespace) -> int:
    """Search the space and report the plans found.

    Args:
        args: the parsed ``search`` arguments.

    Returns:
        0, or 1 when no plan fits in memory.

    Raises:
        ConfigError: a bad model, cluster, GPU count or batch, or ``--top`` below 1.
        diffcost.profiles.ProfileError: a bad ``--profile``.
    """
    if args.sbp:
        return graph.run_search(args)
    if args.embedding_sharding:
        return dlrm.run(_embedding_args(args))
    if args.trace:
        raise ConfigError("--trace: only with --sbp (a transformer plan: predict --trace)")
    if args.global_batch is None:
        raise ConfigError("--global-batch N is required (sequences per iteration)")
    space = load_space(
        args.model,
        args.cluster,
        args.gpus,
        args.global_batch,
        args.seq,
        param_gather=args.param_gather,
    )
    common.check_at_least("--top", args.top, 1)
    params, note = params_for(space.cluster, args.profile)
    steps = args.steps or 150
    cfg = search_mod.SearchConfig(starts=args.starts, steps=steps, seed=args.seed)
    if not args.json:
        print(f"constants: {note}", file=sys.stderr)
        print(
            f"searching {args.starts} relaxed starts x {steps} steps "
            "(a first run compiles for a minute or two; later runs reuse the disk cache)...",
            file=sys.stderr,
        )
    result = search_mod.search(space, params, args.top, cfg)
    members = profiles.population_members(space.cluster, args.profile)
    result, top = ranked(space, result, params, members)
    if members:
        note += (
            f"; plans searched at the mean constants, timed and ranked by the median over the "
            f"population's {len(members)} members (as predict)"
        )
    out = summary(space, result, top, note)
    if args.save_plans:
        out["saved"] = save_plans(args, space, result)
    if args.json:
        common.print_json(out)
    elif not out["fits"]:
        _print_nothing_fits(space, result.closest)
    else:
        _print_report(space, result, out)
        if out.get("saved"):
            print(f"saved {len(out['saved'])} plans: {', '.join(out['saved'])}")
    return 0 if out["fits"] else 1
