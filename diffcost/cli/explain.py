"""``diffcost explain``: the elasticity of iteration time to every knob, as a table or JSON.

``diffcost.explain.explain`` computes the elasticities; this module reads them out: each
row's value in its unit, the elasticity, and what a 10% larger knob does to the time.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from diffcost import config as config_mod
from diffcost import explain as explain_mod
from diffcost.arrays import GiB
from diffcost.cli import common
from diffcost.specs import Experiment

HARDWARE_GROUP = "hardware"  # ``group`` of a cluster knob in ``explain``'s rows
COLUMNS = ("parameter", "value", "elasticity", "reading")


def register(subparsers) -> None:
    """Add ``explain`` to the ``diffcost`` subcommands.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    e = subparsers.add_parser("explain", help="elasticity of iteration time to every hardware knob")
    common.add_experiment_arguments(e)
    common.add_json_argument(e)
    e.add_argument("--top", type=int, metavar="N", help="only the N largest magnitudes")
    common.add_profile_argument(e)
    e.add_argument(
        "--topology",
        metavar="TOPOLOGY",
        help="also the elasticity to each link class of this topology (a preset, a file, or "
        "'cluster' for the cluster's own graph)",
    )
    e.set_defaults(func=run)


def format_value(value: float, unit: str) -> str:
    """A knob's value with its unit.

    Args:
        value: in ``unit``.
        unit: ``TFLOP/s``, ``%``, ``x``, ... or empty.

    Returns:
        ``312 TFLOP/s``, ``80%``, ``1x``.
    """
    text = f"{value:.4g}"
    if unit in ("%", "x"):
        return text + unit
    return f"{text} {unit}" if unit else text


def format_elasticity(e: float) -> str:
    """An elasticity with its sign and two decimals: ``-0.62``, ``+0.15``, ``0.00``.

    Args:
        e: ``d ln T / d ln x``.

    Returns:
        The text, ``0.00`` (unsigned) for anything that rounds to zero.
    """
    text = f"{e:+.2f}"
    return "0.00" if text in ("+0.00", "-0.00") else text


def reading(e: float, value: float | None = None, unit: str | None = None) -> str:
    """What a 10% larger knob does to the iteration time (exact for a power law).

    A percentage within 10% of 100 (an efficiency of 95%) cannot grow by a tenth: it reads
    ``+1 pt -> ...``, one percentage point more.

    Args:
        e: ``d ln T / d ln x``.
        value: the knob's value in ``unit`` (needed for the percentage-point reading).
        unit: the knob's unit.

    Returns:
        ``+10% → -6.0% time`` or ``+1 pt → -0.1% time``.
    """
    if unit == "%" and value is not None and 100.0 / 1.1 < value < 100.0:
        return f"+1 pt → {((1.0 + 1.0 / value) ** e - 1.0) * 100.0:+.1f}% time"
    return f"+10% → {(1.1**e - 1.0) * 100.0:+.1f}% time"


def _title(exp: Experiment, d: dict) -> str:
    """The table's title: the experiment, its iteration time and a verdict unless it fits."""
    title = (
        f"d ln T / d ln x: {exp.model.name} on {exp.cluster.name}, {exp.plan.n_gpus} GPUs, "
        f"iteration {d['iteration_s']:.4g} s"
    )
    if d["status"] == "oom":
        title += (
            f" [red]OUT OF MEMORY: peak {d['memory_peak_bytes'] / GiB:.1f} GiB of "
            f"{d['memory_capacity_bytes'] / GiB:.0f} GiB ({-d['memory_headroom_bytes'] / GiB:.1f}"
            " GiB over)[/]"
        )
    elif d["status"] == "invalid":
        title += " [red]INVALID PLAN[/]"
    return title


def print_table(exp: Experiment, d: dict) -> None:
    """Print ``explain``'s result as a table; calibrated constants are dimmed.

    Args:
        exp: the experiment explained.
        d: ``diffcost.explain.explain``'s result.
    """
    rows = [
        (
            r["name"] if r["group"] == HARDWARE_GROUP else f"[dim]{r['name']}[/]",
            format_value(r["value"], r["unit"]),
            format_elasticity(r["elasticity"]),
            reading(r["elasticity"], r["value"], r["unit"]),
        )
        for r in d["elasticities"]
    ]
    console = Console()
    console.print(common.make_table(_title(exp, d), COLUMNS, rows, right=COLUMNS[1:3]))
    console.print(f"[dim]dim rows: calibrated constants; {d['constants']}[/]")


def load_topology(name: str, exp: Experiment):
    """The topology ``--topology`` names: a preset or file, or ``cluster`` for the graph of
    the experiment's cluster (as many nodes as the plan needs).

    Raises:
        ConfigError: an unknown preset or a bad file.
    """
    from diffcost.network import generators, load

    if name == "cluster":
        nodes = -(-exp.plan.n_gpus // exp.cluster.gpus_per_node)
        return generators.from_cluster(exp.cluster, nodes)
    return load.load_topology(name)


def print_link_classes(d: dict) -> None:
    """Print the link-class elasticities of ``explain(..., topology=...)``."""
    rows = [
        (
            r["name"],
            f"{r['links']:,}",
            f"{r['capacity_GBps']:,.0f} GB/s",
            format_elasticity(r["elasticity"]),
            reading(r["elasticity"]),
        )
        for r in d["link_classes"]
    ]
    title = (
        f"d ln T / d ln capacity per link class (collectives priced on the graph: iteration "
        f"{d['graph_iteration_s']:.4g} s)"
    )
    columns = ("link class", "links", "capacity", "elasticity", "reading")
    Console().print(common.make_table(title, columns, rows))


def run(args: argparse.Namespace) -> int:
    """Explain one experiment: the table, or the JSON object with ``--json``.

    Args:
        args: the parsed ``explain`` arguments.

    Returns:
        0.

    Raises:
        ConfigError: a bad config or override, or ``--top`` below 1.
    """
    if args.top is not None:
        common.check_at_least("--top", args.top, 1)
    exp = config_mod.load_experiment(args.config, args.overrides)
    topology = None if args.topology is None else load_topology(args.topology, exp)
    d = explain_mod.explain(exp, profile=args.profile, topology=topology)
    d["elasticities"] = d["elasticities"][: args.top]
    if args.json:
        common.print_json(d)
    else:
        print_table(exp, d)
        if topology is not None:
            print_link_classes(d)
    return 0
