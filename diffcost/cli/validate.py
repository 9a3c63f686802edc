"""``diffcost validate``: predictions against measured runs, per source and per row."""

from __future__ import annotations

import argparse

from rich.console import Console

from diffcost.cli import common
from diffcost.validate import validate

SUMMARY_COLUMNS = (
    "source",
    "rows",
    "predicted",
    "skipped",
    "MAPE %",
    "max APE %",
    "Kendall tau",
    "in 80% %",
    "width %",
)
ROW_COLUMNS = (
    "row",
    "source",
    "model",
    "measured s",
    "predicted s",
    "80% interval",
    "APE %",
    "defaults",
)
# shown when some row has a measured peak memory: (header, key, format) per column
MEM_SUMMARY = (
    ("mem rows", "mem_rows", "d"),
    ("mem MAPE %", "mem_mape_pct", ".1f"),
    ("mem max APE %", "mem_max_ape_pct", ".1f"),
)
MEM_ROW = (
    ("measured GiB", "measured_peak_mem_gib", ".2f"),
    ("predicted GiB", "predicted_peak_mem_gib", ".2f"),
    ("mem APE %", "mem_ape_pct", ".1f"),
)


def register(subparsers) -> None:
    """Add ``validate`` to the ``diffcost`` subcommands.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    v = subparsers.add_parser(
        "validate",
        help="compare predictions with measured runs (CSV)",
        description="Predict every row of a measured-runs CSV with its 80% interval (the "
        "profile's calibration posterior, residual spread and, for a framework without runs "
        "in the profile's fit, stack spread); report MAPE, Kendall tau, the share of rows "
        "inside their interval (coverage) and the median interval width per source.",
    )
    v.add_argument("csv", help="CSV in the schema of shared/data/README.md")
    common.add_json_argument(v)
    v.add_argument("--rows", action="store_true", help="print every row")
    common.add_profile_argument(v)
    v.set_defaults(func=run)


def _fmt(value, spec: str) -> str:
    """``value`` formatted by ``spec``, or ``-`` for None."""
    return "-" if value is None else format(value, spec)


def _has_memory(out: dict) -> bool:
    """Whether some row has a measured peak memory (the tables then show memory columns)."""
    return out["summary"].get("mem_rows", 0) > 0


def _mem_cells(d: dict, columns, show: bool) -> tuple[str, ...]:
    """The memory cells of a summary or row ``d`` (none unless ``show``)."""
    return tuple(_fmt(d[key], spec) for _, key, spec in columns) if show else ()


def _summary_rows(out: dict) -> list[tuple[str, ...]]:
    """One row per source and one for all of them."""
    mem = _has_memory(out)
    return [
        (
            name,
            str(s["rows"]),
            str(s["predicted"]),
            str(s["skipped"]),
            _fmt(s["mape_pct"], ".1f"),
            _fmt(s["max_ape_pct"], ".1f"),
            _fmt(s["kendall_tau"], ".3f"),
            _fmt(s["coverage_pct"], ".0f"),
            _fmt(s["median_width_pct"], ".1f"),
            *_mem_cells(s, MEM_SUMMARY, mem),
        )
        for name, s in [*out["by_source"].items(), ("all", out["summary"])]
    ]


def _interval(row: dict) -> str:
    """``low–high`` of a row's 80% interval, or ``-`` without one."""
    if row["predicted_iter_s_low"] is None:
        return "-"
    return f"{row['predicted_iter_s_low']:.4g}–{row['predicted_iter_s_high']:.4g}"


def _predicted_rows(out: dict) -> list[tuple[str, ...]]:
    """One row per predicted (not skipped) measurement."""
    mem = _has_memory(out)
    return [
        (
            str(r["row"]),
            r["source"],
            r["model"],
            _fmt(r["measured_iter_s"], ".4g"),
            _fmt(r["predicted_iter_s"], ".4g"),
            _interval(r),
            _fmt(r["ape_pct"], ".1f"),
            *_mem_cells(r, MEM_ROW, mem),
            "; ".join(r["defaults"]),
        )
        for r in out["rows"]
        if not r["skipped"]
    ]


def run(args: argparse.Namespace) -> int:
    """Validate the CSV and print the per-source table (and the rows with ``--rows``).

    Args:
        args: the parsed ``validate`` arguments.

    Returns:
        0.

    Raises:
        ValueError: a malformed CSV.
        FileNotFoundError: no such CSV.
    """
    out = validate(args.csv, profile=args.profile)
    if args.json:
        common.print_json(out)
        return 0
    console = Console()
    # source names are long: wrapped on a narrow terminal, never cut
    fold = {"source": {"overflow": "fold", "min_width": 12}}
    title = f"validation against {args.csv}"
    mem = [c[0] for c in MEM_SUMMARY] if _has_memory(out) else []
    summary = common.make_table(title, (*SUMMARY_COLUMNS, *mem), _summary_rows(out), options=fold)
    console.print(summary)
    for cluster, note in out.get("profiles", {}).items():
        console.print(f"constants for {cluster}: {note}")
    skipped = [r for r in out["rows"] if r["skipped"]]
    if skipped:
        console.print(f"[bold]{len(skipped)} rows skipped:[/]")
        for r in skipped:
            console.print(f"  row {r['row']} ({r['source']}, {r['model']}): {r['skipped']}")
    if args.rows:
        columns = ROW_COLUMNS
        if _has_memory(out):
            columns = (*ROW_COLUMNS[:-1], *(c[0] for c in MEM_ROW), ROW_COLUMNS[-1])
        console.print(common.make_table("rows", columns, _predicted_rows(out), right=()))
    else:
        console.print("per-row results and the defaults used: --rows or --json")
    return 0
