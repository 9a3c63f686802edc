"""The ``diffcost`` command line: predict, validate, explain, search, sweep, suggest,
shard-embeddings, design, plugins.

One module per command (``diffcost.cli.predict``, ``validate``, ``explain``, ``search``,
``sweep``, ``suggest``), each with ``register(subparsers)``, which adds the command's subparser
and sets ``func``, the function that runs it and returns the exit code. Other packages contribute
commands the same way, through the entry-point group ``diffcost.commands``: each entry names a
``register`` function. ``calibration`` provides ``diffcost calibrate`` so; without it installed
that command does not exist.

    [project.entry-points."diffcost.commands"]
    calibrate = "calibration.cli:register"

Exit codes: 0 on success, 1 when ``search`` or ``sweep`` finds no plan that fits, 2 for bad
input (argparse errors and the errors listed in ``USER_ERRORS``, printed as one line).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from diffcost.cache import enable_compilation_cache
from diffcost.cli import design, dlrm, explain, predict, search, suggest, sweep, validate
from diffcost.config import ConfigError

ENTRY_POINT_GROUP = "diffcost.commands"
BUILTIN = (
    predict.register,
    validate.register,
    explain.register,
    search.register,
    sweep.register,
    suggest.register,
    dlrm.register,
    design.register,
)
USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, OSError)

RegisterFn = Callable[[Any], None]  # register(subparsers): adds one command


def plugin_commands() -> list[tuple[str, RegisterFn]]:
    """The ``register`` functions of the installed ``diffcost.commands`` entry points.

    An entry point that cannot be loaded is reported on stderr and left out, so one broken
    plugin does not take the other commands with it.

    Returns:
        ``(entry point name, register)`` pairs, sorted by name.
    """
    found = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        try:
            found.append((ep.name, ep.load()))
        except Exception as e:  # whatever a third-party plugin raises on import
            print(
                f"diffcost: command plugin {ep.name!r} ({ep.value}) not loaded: {e}",
                file=sys.stderr,
            )
    return found


def build_parser(
    plugins: Sequence[tuple[str, RegisterFn]] | None = None,
) -> argparse.ArgumentParser:
    """The ``diffcost`` argument parser: the built-in commands, then the plugin commands.

    Args:
        plugins: ``(name, register)`` pairs; None for ``plugin_commands()``.

    Returns:
        The parser; every subcommand sets ``func``.
    """
    parser = argparse.ArgumentParser(
        prog="diffcost",
        description="Predict the iteration time and memory of distributed LLM training.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in BUILTIN:
        register(subparsers)
    for _name, register in plugin_commands() if plugins is None else plugins:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``diffcost`` command.

    Args:
        argv: the arguments after ``diffcost``; None for ``sys.argv[1:]``.

    Returns:
        The exit code (argparse errors exit with 2 through ``SystemExit``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    enable_compilation_cache()
    if getattr(args, "config", None) and "=" in args.config and args.command == "predict":
        parser.error(f"CONFIG must come first; got override {args.config!r}")
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"diffcost {args.command}: error: {e}", file=sys.stderr)
        return 2
