"""``diffcost suggest``: which short runs to measure to make a target prediction surer.

The ranking is ``diffcost.suggest`` (optimal experimental design on the profile's posterior);
this module reads the arguments and prints a table or one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from rich.console import Console

from diffcost import config as config_mod
from diffcost import profiles
from diffcost.api import params_for
from diffcost.cli import common
from diffcost.config import ConfigError
from diffcost.stacks import STACK_NAMES, canonical
from diffcost.suggest import Design, suggest, width_pct


def register(subparsers) -> None:
    """Add ``suggest`` to the ``diffcost`` subcommands.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    p = subparsers.add_parser(
        "suggest",
        help="which short runs and microbenchmarks to measure to narrow a prediction's interval",
        description="Rank short end-to-end runs of slices of the target's model (fewer layers, "
        "1-2 nodes of its cluster, valid tp/pp/dp layouts) and microbenchmarks of its kernels "
        "and collectives (its layer's GEMMs, fused attention, tensor- and data-parallel "
        "collectives at their message sizes) by how much measuring them would shrink the "
        "target's predictive variance under the profile's calibration posterior (and, for an "
        "unseen stack, the stack's offset, which only runs on that stack measure), and print "
        "the best BUDGET of them, picked greedily (each given the earlier ones).",
    )
    common.add_experiment_arguments(p)
    p.add_argument("--budget", type=int, default=3, help="how many to suggest (default 3)")
    p.add_argument(
        "--runs-only",
        action="store_true",
        help="suggest end-to-end runs only (no GEMM, attention or collective microbenchmarks)",
    )
    p.add_argument(
        "--noise-sd",
        type=float,
        metavar="SD",
        help="log-space noise of a run against the model; default: the profile's end-to-end "
        "residual spread",
    )
    p.add_argument(
        "--micro-noise-sd",
        type=float,
        metavar="SD",
        help="log-space noise of a microbenchmark against the model (e.g. 0.1 for 10%%); "
        "default: the profile's end-to-end residual spread, as for runs",
    )
    common.add_json_argument(p)
    common.add_profile_argument(p)
    p.add_argument(
        "--stack",
        metavar="NAME",
        help="software stack of the target run: " + ", ".join(STACK_NAMES) + ", or a "
        "framework; default: the config's 'stack', else the stack the profile was fitted on",
    )
    p.set_defaults(func=run)


def design_dict(design: Design, config: str, overrides) -> dict:
    """The JSON object printed by ``suggest --json``.

    Args:
        design: what ``diffcost.suggest.suggest`` returned.
        config: the target's experiment YAML, as given.
        overrides: the target's ``key=value`` overrides.

    Returns:
        ``{"target": {...}, "suggestions": [...], "n_candidates"}`` in plain Python values
        (``run`` adds ``noise_sd``, a run's noise);
        a suggestion's ``time_s`` is one iteration of a run or one call of a microbenchmark,
        ``gpu_s`` that times its GPUs.
    """
    exp, s = design.target, design.spread
    target = {
        "config": config,
        "overrides": list(overrides),
        "model": exp.model.name,
        "cluster": exp.cluster.name,
        "n_gpus": exp.plan.n_gpus,
        "iteration_s": design.iteration_s,
        "log_sd": s.log_sd,
        "posterior_sd": s.posterior_sd,
        "residual_sd": s.residual_sd,
        "stack_sd": s.stack_sd,
        "width_pct": width_pct(s.log_sd),
    }
    rows = [
        {
            "rank": k + 1,
            "kind": g.candidate.kind,
            "what": g.candidate.label,
            "overrides": list(g.candidate.overrides),
            "n_gpus": g.candidate.n_gpus,
            "time_s": g.time_s,
            "gpu_s": g.gpu_s,
            "target_width_before_pct": g.width_before_pct,
            "target_width_after_pct": g.width_after_pct,
        }
        for k, g in enumerate(design.suggestions)
    ]
    return {"target": target, "suggestions": rows, "n_candidates": design.n_candidates}


def merged(base, top) -> list[str]:
    """``key=value`` overrides ``base`` then ``top``, without the ``base`` entries whose key
    ``top`` sets again."""
    keys = {o.partition("=")[0] for o in top}
    return [o for o in base if o.partition("=")[0] not in keys] + list(top)


def print_design(d: dict) -> None:
    """Print the target's line, the suggestions table and how the width ends.

    Args:
        d: a ``design_dict``.
    """
    t = d["target"]
    console = Console()
    console.print(
        f"target [bold]{t['model']}[/] on [bold]{t['cluster']}[/], {t['n_gpus']} GPUs: "
        f"{t['iteration_s']:.4g} s, 80% interval {t['width_pct']:.1f}% wide "
        f"({d['n_candidates']} candidates priced)"
    )
    rows = [
        (
            str(s["rank"]),
            s["what"],
            f"{s['time_s']:.3g}",
            f"{s['gpu_s']:.3g}",
            f"{s['target_width_before_pct']:.2f}% -> {s['target_width_after_pct']:.2f}%",
        )
        for s in d["suggestions"]
    ]
    columns = ("#", "what", "seconds", "GPU-seconds", "target width")
    table = common.make_table("what to measure, best first", columns, rows, right=columns[2:])
    console.print(table)
    for s in d["suggestions"]:
        if s["kind"] == "run":
            line = " ".join([t["config"], *merged(t["overrides"], s["overrides"])])
            console.print(f"#{s['rank']}: diffcost predict {line}")
    if not d["noise_sd"]:
        console.print(
            "warning: the profile gives no residual spread, so every measurement counts as "
            "exact; pass --noise-sd (e.g. 0.03 for 3%)"
        )
    if d["suggestions"]:
        floor = width_pct(t["residual_sd"])
        console.print(
            f"the model's residual spread alone gives a {floor:.1f}% wide interval: "
            "no measurement narrows it below that"
        )


def run(args: argparse.Namespace) -> int:
    """Rank the candidate runs and print the table or the JSON object.

    Args:
        args: the parsed ``suggest`` arguments.

    Returns:
        0.

    Raises:
        ConfigError: a bad config, override or budget.
        diffcost.profiles.ProfileError: a bad ``--profile``.
    """
    common.check_at_least("--budget", args.budget, 1)
    for flag, value in (("--noise-sd", args.noise_sd), ("--micro-noise-sd", args.micro_noise_sd)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} {value}: must be a positive number (log space)")
    exp = config_mod.load_experiment(args.config, args.overrides)
    stack = canonical(args.stack) or exp.stack
    if stack in STACK_NAMES:
        exp = dataclasses.replace(exp, stack=stack)
    params, _ = params_for(exp, args.profile)
    unc = profiles.uncertainty_for(exp.cluster, args.profile)
    seen = unc.stack_seen(stack)
    kw = {"noise_sd": args.noise_sd, "micro_noise_sd": args.micro_noise_sd, "stack_seen": seen}
    design = suggest(exp, params, unc, args.budget, microbenchmarks=not args.runs_only, **kw)
    d = design_dict(design, args.config, args.overrides)
    d["noise_sd"] = unc.residual_sd if args.noise_sd is None else args.noise_sd
    if args.json:
        common.print_json(d)
    else:
        print_design(d)
    return 0
