"""``diffcost design``: the bandwidth per link class a job's time is worth, under a cost model.

``diffcost.network.design_config.run_design`` optimizes the design file's per-class
multipliers; this module prints the built network and the best design side by side, per
class, and which tier the next dollar should buy at each.
"""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console

from diffcost.cli import common
from diffcost.network import design_config, design_search

COLUMNS = (
    "class",
    "built $",
    "multiplier",
    "elasticity (built)",
    "µs saved / $1k (built)",
    "elasticity (best)",
    "µs saved / $1k (best)",
)


def register(subparsers) -> None:
    """Add ``design`` to the ``diffcost`` subcommands.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    d = subparsers.add_parser(
        "design", help="optimize per-tier network bandwidth for a job under a cost model"
    )
    d.add_argument("config", help="design YAML (configs/designs/...)")
    d.add_argument("--steps", type=int, help="descent steps (default: the file's)")
    d.add_argument(
        "--search-rounds",
        type=int,
        default=0,
        metavar="N",
        help="then alternate N rounds of plan search and design (best plan of each design)",
    )
    common.add_json_argument(d)
    d.set_defaults(func=run)


def _per_kusd(x) -> str:
    """Seconds saved per dollar as µs per thousand dollars, or '-' for an unpriced class."""
    return "-" if x is None else f"{x * 1e9:.3g}"


def next_dollar(point: dict, classes, optimized) -> str:
    """The optimized class that saves the most time per dollar at ``point``."""
    saved = {c: s for c, s in zip(classes, point["s_saved_per_usd"]) if c in optimized}
    best = max(saved, key=lambda c: saved[c])
    return f"{best} ({_per_kusd(saved[best])} µs per iteration per $1k)"


def print_report(r: dict) -> None:
    """Print ``run_design``'s result: a table per class and the answer at both points."""
    start, best = r["start"], r["best"]
    rows = []
    for i, name in enumerate(r["classes"]):
        if r["spend_usd"][i] == 0 and start["elasticity"][i] == 0:
            continue
        rows.append(
            (
                name + ("" if name in r["optimized"] else " (kept)"),
                f"{r['spend_usd'][i]:,.0f}",
                f"{best['scale'][i]:.3f}",
                f"{start['elasticity'][i]:+.4f}",
                _per_kusd(start["s_saved_per_usd"][i]),
                f"{best['elasticity'][i]:+.4f}",
                _per_kusd(best["s_saved_per_usd"][i]),
            )
        )
    limit = (
        f"budget {r['budget_usd']:,.0f} $"
        if r["objective"] == "time"
        else f"minimize (network + {r['fixed_usd']:,.0f} $) x time"
    )
    title = f"{r['design']}: {r['topology']}, {limit}"
    console = Console()
    console.print(common.make_table(title, COLUMNS, rows))
    for label, p in (("built", start), ("best", best)):
        taper = ", ".join(f"{k} {v:.2f}:1" for k, v in p["oversubscription"].items())
        console.print(
            f"{label:5s}: iteration {p['time_s']:.4f} s, links {p['cost_usd']:,.0f} $"
            + (f", oversubscription {taper}" if taper else "")
            + f"; the next dollar buys {next_dollar(p, r['classes'], r['optimized'])}"
        )
    console.print(
        f"[dim]diffcost predict (the model's own communication): "
        f"{r['predict_iteration_s']:.4f} s; {r['steps']} Adam steps[/]"
    )


def _plan_text(p: dict) -> str:
    text = f"tp {p['tp']} cp {p['cp']} pp {p['pp']} dp {p['dp']}"
    text += f" ep {p['ep']}" if p["ep"] > 1 else ""
    text += f", zero {p['zero']}, {p['recompute']}, mb {p['microbatch']}, {p['schedule']}"
    return text + (f" v{p['chunks']}" if p["chunks"] > 1 else "") + ", " + ",".join(p["order"])


def print_rounds(rounds: list[dict], classes) -> None:
    """Print ``design_search.alternate``'s rounds."""
    columns = ("round", "plan", "built s", "best s", "links $", "objective", *classes)
    rows = [
        (
            str(i),
            _plan_text(r["plan"]),
            f"{r['start_time_s']:.4f}",
            f"{r['best_time_s']:.4f}",
            f"{r['best_cost_usd']:,.0f}",
            f"{r['best_objective']:.4g}",
            *(f"{x:.2f}" for x in r["best_scale"]),
        )
        for i, r in enumerate(rounds)
    ]
    title = "plan search alternated with design (round 0: the file's plan)"
    Console().print(common.make_table(title, columns, rows))


def run(args: argparse.Namespace) -> int:
    """Run one design file.

    Returns:
        0.

    Raises:
        ConfigError: a bad design file (or ``--steps`` below 1).
    """
    spec = design_config.load_design(args.config)
    if args.steps is not None:
        common.check_at_least("--steps", args.steps, 1)
        spec = dataclasses.replace(spec, steps=args.steps)
    report = design_config.run_design(spec)
    if args.search_rounds:
        common.check_at_least("--search-rounds", args.search_rounds, 0)
        report["rounds"] = design_search.alternate(spec, args.search_rounds)
    if args.json:
        common.print_json(report)
    else:
        print_report(report)
        if args.search_rounds:
            print_rounds(report["rounds"], report["classes"])
    return 0
