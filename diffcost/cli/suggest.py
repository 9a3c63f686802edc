"""``diffcost suggest``: which short runs to measure to make a target prediction surer.

The ranking is ``diffcost.suggest`` (optimal experimental design on the profile's posterior);
this module reads the arguments and prints a table or one JSON object. Several configs (plans
of one model on one cluster, such as those ``diffcost search --save-plans`` writes) are one
design for all of them: the picks minimise their mean predictive variance.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from rich.console import Console
from rich.markup import escape

from diffcost import config as config_mod
from diffcost import profiles
from diffcost.api import params_for
from diffcost.cli import common
from diffcost.config import ConfigError
from diffcost.stacks import STACK_NAMES, canonical
from diffcost.suggest import ONE_DESIGN, Design, mismatch, suggest, width_pct


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
        "the best BUDGET of them, picked greedily (each given the earlier ones). Several "
        "configs (e.g. 'diffcost search --save-plans DIR' then DIR/plan-*.yaml), all of one "
        "model on one cluster, are targets together: the picks minimise their mean predictive "
        "variance, and the key=value overrides apply to each.",
    )
    p.add_argument("config", help="experiment YAML (configs/examples/...)")
    p.add_argument(
        "overrides",
        nargs="*",
        help="key=value overrides, e.g. plan.tp=4; more experiment YAMLs (more targets)",
    )
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


def design_dict(design: Design, config: str | list[str], overrides) -> dict:
    """The JSON object printed by ``suggest --json``.

    Args:
        design: what ``diffcost.suggest.suggest`` returned.
        config: the target's experiment YAML, as given, or every target's, in order.
        overrides: the targets' ``key=value`` overrides.

    Returns:
        ``{"target": {...}, "targets": [{...}, ...], "suggestions": [...], "n_candidates"}``
        in plain Python values (``run`` adds ``noise_sd``, a run's noise); ``target`` is the
        first of ``targets`` (one per config);
        a suggestion's ``time_s`` is one iteration of a run or one call of a microbenchmark,
        ``gpu_s`` that times its GPUs, its ``target_width_*_pct`` the width of the targets' root
        mean square log sd (the target's, for one) and ``targets_width_after_pct`` each
        target's.
    """
    configs = [config] if isinstance(config, str) else list(config)
    targets = [
        {
            "config": name,
            "overrides": list(overrides),
            "model": exp.model.name,
            "cluster": exp.cluster.name,
            "n_gpus": exp.plan.n_gpus,
            "iteration_s": t_s,
            "log_sd": s.log_sd,
            "posterior_sd": s.posterior_sd,
            "residual_sd": s.residual_sd,
            "stack_sd": s.stack_sd,
            "width_pct": width_pct(s.log_sd),
        }
        for name, exp, t_s, s in zip(
            configs, design.targets, design.targets_iteration_s, design.targets_spread
        )
    ]
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
            "targets_width_after_pct": [width_pct(sd) for sd in g.targets_log_sd_after],
        }
        for k, g in enumerate(design.suggestions)
    ]
    return {
        "target": targets[0],
        "targets": targets,
        "suggestions": rows,
        "n_candidates": design.n_candidates,
    }


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
    t, targets = d["target"], d["targets"]
    console = Console()
    for k, u in enumerate(targets):
        after = [s["targets_width_after_pct"][k] for s in d["suggestions"]]
        then = f" -> {after[-1]:.1f}% after all" if after and len(targets) > 1 else ""
        name = f"target {u['config']}" if len(targets) > 1 else "target"
        console.print(
            f"{escape(name)} [bold]{u['model']}[/] on [bold]{u['cluster']}[/], "
            f"{u['n_gpus']} GPUs: {u['iteration_s']:.4g} s, 80% interval {u['width_pct']:.1f}% "
            f"wide{then}",
            soft_wrap=True,
        )
    console.print(f"{d['n_candidates']} candidates priced")
    rows = [
        (
            str(s["rank"]),
            escape(s["what"]),
            f"{s['time_s']:.3g}",
            f"{s['gpu_s']:.3g}",
            f"{s['target_width_before_pct']:.2f}% -> {s['target_width_after_pct']:.2f}%",
        )
        for s in d["suggestions"]
    ]
    width = "target width" if len(targets) == 1 else "targets' mean width"
    columns = ("#", "what", "seconds", "GPU-seconds", width)
    table = common.make_table("what to measure, best first", columns, rows, right=columns[2:])
    console.print(table)
    for s in d["suggestions"]:
        if s["kind"] == "run":
            line = " ".join([t["config"], *merged(t["overrides"], s["overrides"])])
            console.print(f"#{s['rank']}: diffcost predict {escape(line)}", soft_wrap=True)
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


def _check_same(configs: list[str], exps: list) -> None:
    """Refuse targets that are not plans of one model on one cluster and stack."""
    for name, exp in zip(configs[1:], exps[1:]):
        if (what := mismatch(exps[0], exp)) is not None:
            raise ConfigError(f"{name}: its {what} differs from {configs[0]}'s; {ONE_DESIGN}")


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
    configs = [args.config] + [o for o in args.overrides if "=" not in o]
    overrides = [o for o in args.overrides if "=" in o]
    exps = [config_mod.load_experiment(c, overrides) for c in configs]
    stack = canonical(args.stack) or exps[0].stack
    if stack in STACK_NAMES:
        exps = [dataclasses.replace(e, stack=stack) for e in exps]
    _check_same(configs, exps)
    exp = exps[0]
    params, _ = params_for(exp, args.profile)
    unc = profiles.uncertainty_for(exp.cluster, args.profile)
    seen = unc.stack_seen(stack)
    kw = {"noise_sd": args.noise_sd, "micro_noise_sd": args.micro_noise_sd, "stack_seen": seen}
    kw["others"] = exps[1:]
    kw["members"] = profiles.population_members(exp.cluster, args.profile, stack=exp.stack)
    design = suggest(exp, params, unc, args.budget, microbenchmarks=not args.runs_only, **kw)
    d = design_dict(design, configs, overrides)
    d["noise_sd"] = unc.residual_sd if args.noise_sd is None else args.noise_sd
    if args.json:
        common.print_json(d)
    else:
        print_design(d)
    return 0
