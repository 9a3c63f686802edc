"""The command line shared by the data analyses of the end-to-end CSV (no fit):
``--source``, ``--data`` and ``--json``, and the rows they select, with clear errors."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def parse(doc: str, argv=None, more=None) -> argparse.Namespace:
    """``--source``, ``--data``, ``--json`` and what ``more(parser)`` adds, parsed."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--source", default=None, help="one e2e source (default: every source)")
    ap.add_argument("--data", default=str(DATA), help="shared data directory")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    if more is not None:
        more(ap)
    return ap.parse_args(argv)


def rows(args: argparse.Namespace, numbered: bool = False) -> list[dict] | None:
    """The rows of ``DATA/e2e/calibration.csv`` (of ``args.source`` only, if given), or None
    after printing why there are none to stderr. ``numbered`` adds ``row``: the 1-based data row
    in the whole file (the numbering of ``calibration_cv.py``'s rows file)."""
    path = Path(args.data) / "e2e" / "calibration.csv"
    if not path.is_file():
        print(f"error: --data {args.data!r}: no e2e/calibration.csv there", file=sys.stderr)
        return None
    with open(path, newline="", encoding="utf-8") as fh:
        out = list(csv.DictReader(fh))
    if numbered:
        out = [{**r, "row": str(i)} for i, r in enumerate(out, start=1)]
    if args.source is None:
        return out
    known = sorted({r["source"] for r in out})
    if args.source not in known:
        print(f"error: --source {args.source!r}: not in {path}; sources: {known}", file=sys.stderr)
        return None
    return [r for r in out if r["source"] == args.source]


def predictable(path: Path):
    """Every row of the end-to-end CSV ``path`` the model represents, as ``(i, row, model,
    plan, cluster, params)``: ``i`` the 1-based data row, the specs of ``diffcost.runs``
    (rows it skips are left out) and the shipped constants of the row's cluster and software
    stack (its ``framework``, ``diffcost.stacks``), as ``diffcost validate`` uses them (read
    once per cluster and stack)."""
    from diffcost.profiles import params_for
    from diffcost.runs import RowSkipped, read_rows, row_to_specs
    from diffcost.stacks import stack_of

    specs_cache: dict = {}
    params_cache: dict = {}
    for i, row in enumerate(read_rows(path), start=1):
        try:
            model, plan, cluster, _ = row_to_specs(row, specs_cache)
        except RowSkipped:
            continue
        key = (cluster.name, stack_of(row.get("framework")))
        if key not in params_cache:
            params_cache[key] = params_for(cluster, stack=key[1])[0]
        yield i, row, model, plan, cluster, params_cache[key]
