"""``diffcost calibrate``, contributed to the ``diffcost`` command line as a plugin command.

``pyproject.toml`` declares ``register`` under the entry-point group ``diffcost.commands``;
``diffcost.cli`` calls it with its subparsers. The fit and the report are
``calibration.command.run``, imported only when the command runs.
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    """Add ``calibrate`` to the ``diffcost`` subcommands.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    c = subparsers.add_parser("calibrate", help="fit a cluster's constants to measurements")
    c.add_argument("data", nargs="+", help="measurement files or folders (CSV, nccl-tests logs)")
    c.add_argument(
        "--cluster",
        action="append",
        required=True,
        help="cluster preset to calibrate (repeat for a joint fit)",
    )
    c.add_argument(
        "--out",
        metavar="FILE|DIR/",
        help="profile file to write (one cluster), or a folder for <cluster>-profile.yaml "
        "files (default: <cluster>-profile.yaml here; the shipped profiles are rebuilt by "
        "python -m calibration.make_profiles)",
    )
    c.add_argument(
        "--from",
        dest="start",
        metavar="PROFILE",
        help="constants to start from and stay near where the data say nothing: a profile "
        "file, or 'none' for datasheet defaults (default: the cluster's calibrated profile)",
    )
    c.add_argument(
        "--steps",
        type=int,
        default=None,
        help="maximum optimizer steps (default: FitConfig.steps, 1200)",
    )
    c.add_argument("--json", action="store_true", help="print one JSON summary")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Fit, write the profiles and report (``calibration.command.run``).

    Args:
        args: the parsed ``calibrate`` arguments.

    Returns:
        0.
    """
    from calibration import command  # the fit's modules load only when the command runs

    return command.run(args)
