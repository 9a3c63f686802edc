"""What several commands share: common arguments, rich tables, JSON output.

Every command module (``diffcost.cli.predict``, ``validate``, ...) and every command contributed
through the ``diffcost.commands`` entry points adds its subparser with these helpers, so the
same flag reads the same everywhere.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Collection, Iterable, Mapping, Sequence

from rich.console import Console
from rich.table import Table

from diffcost.config import ConfigError

PROFILE_HELP = "calibrated profile file, or 'none' for datasheet defaults"
JSON_HELP = "print one JSON object"


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--profile`` (a calibrated profile file, or ``none``).

    Args:
        parser: the command's parser.
    """
    parser.add_argument("--profile", help=PROFILE_HELP)


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--json`` (print one JSON object instead of tables).

    Args:
        parser: the command's parser.
    """
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


def add_experiment_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Add the positional experiment YAML and its ``key=value`` overrides.

    Args:
        parser: the command's parser.
        required: whether the YAML must be given (``predict`` reads Megatron flags instead).
    """
    nargs = {} if required else {"nargs": "?"}
    parser.add_argument("config", **nargs, help="experiment YAML (configs/examples/...)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. plan.tp=4")


def add_space_arguments(parser: argparse.ArgumentParser, batch_required: bool = True) -> None:
    """Add the arguments fixing a plan space: model, ``--cluster``, ``--gpus``, batch, sequence.

    Args:
        parser: the command's parser (``search`` and ``sweep``).
        batch_required: whether argparse requires ``--global-batch`` (``search`` checks it
            itself: its graph and embedding searches have default batches).
    """
    parser.add_argument("model", metavar="MODEL", help="model preset (gpt3-175b) or YAML path")
    parser.add_argument("--cluster", required=True, help="cluster preset or YAML path")
    parser.add_argument("--gpus", type=int, required=True, help="GPU count")
    parser.add_argument(
        "--global-batch", type=int, required=batch_required, help="sequences per iteration"
    )
    parser.add_argument("--seq", type=int, help="sequence length (overrides the model's)")
    parser.add_argument(
        "--param-gather",
        choices=("step", "layer"),
        default="step",
        help="ZeRO-2's parameter gather: after the optimizer step (DeepSpeed, the default) or "
        "per layer before its forward (PyTorch FSDP SHARD_GRAD_OP)",
    )


def check_at_least(flag: str, value: int, least: int) -> None:
    """Refuse a count below ``least``.

    Args:
        flag: the option as the user typed it (``--top``).
        value: its value.
        least: the smallest value allowed.

    Raises:
        ConfigError: ``value < least``.
    """
    if value < least:
        raise ConfigError(f"{flag} {value}: must be at least {least}")


def print_json(data: Mapping) -> None:
    """Print one JSON object, indented by two spaces (the ``--json`` output of every command).

    Args:
        data: plain Python values.
    """
    print(json.dumps(data, indent=2))


def make_table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    right: Collection[str] | None = None,
    options: Mapping[str, dict] | None = None,
) -> Table:
    """A rich table with one header row.

    Args:
        title: printed above the table (rich markup allowed).
        columns: column headers, left to right.
        rows: cells as text, one sequence per row.
        right: the right-justified columns; None for every column but the first.
        options: further ``Table.add_column`` keywords per column header.

    Returns:
        The table, for ``Console.print``.
    """
    right = columns[1:] if right is None else right
    options = options or {}
    table = Table(title=title)
    for col in columns:
        justify = "right" if col in right else "left"
        table.add_column(col, **{"justify": justify, **options.get(col, {})})
    for row in rows:
        table.add_row(*row)
    return table


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], **kw) -> None:
    """Print ``make_table(title, columns, rows, **kw)`` on standard output.

    Args:
        title, columns, rows, **kw: as ``make_table``.
    """
    Console().print(make_table(title, columns, rows, **kw))
