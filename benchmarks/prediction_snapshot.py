"""Snapshot every prediction the shipped profiles make, and compare two snapshots.

Predicts every row of ``calibration.csv`` (iteration time and peak memory per GPU, each row
on its cluster's shipped profile) and every example config, and writes them to JSON. With
``--compare OLD.json`` it reports the largest relative difference from an older snapshot and
exits non-zero above ``--rtol`` (default 1e-9): a restructuring that should not change any
prediction is checked this way.

    python benchmarks/prediction_snapshot.py --data ../shared/data --out /tmp/now.json \
        --compare benchmarks/results/predictions_snapshot.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

from diffcost import api  # noqa: E402
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays, stack  # noqa: E402
from diffcost.simulate import simulate  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e_rows  # noqa: E402  (a sibling script module, found however this one is loaded)

FIELDS = ("iteration_s", "memory_peak_bytes")
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "configs" / "examples"
DATA = ROOT.parent / "shared" / "data"


def _prediction(out, j=None) -> dict:
    pick = (lambda a: a) if j is None else (lambda a: a[j])
    return {f: float(np.asarray(pick(getattr(out, f)))) for f in FIELDS}


def snapshot(data: Path) -> dict:
    """{"rows": {row number: prediction}, "examples": {file name: prediction}}."""
    rows: dict[str, dict] = {}
    batch = []
    for i, _, model, plan, cluster, params in e2e_rows.predictable(
        data / "e2e" / "calibration.csv"
    ):
        batch.append((i, model_arrays(model), plan_arrays(plan), cluster_arrays(cluster), params))
    out = jax.jit(jax.vmap(simulate))(*(stack([b[k] for b in batch]) for k in range(1, 5)))
    for j, b in enumerate(batch):
        rows[str(b[0])] = _prediction(out, j)
    examples = {p.name: _prediction(api.predict(p)) for p in sorted(EXAMPLES.glob("*.yaml"))}
    return {"rows": rows, "examples": examples}


def compare(new: dict, old: dict) -> tuple[float, list[str]]:
    """Largest relative difference over the predictions both hold, and what only one holds."""
    worst = 0.0
    missing = []
    for part in ("rows", "examples"):
        keys = set(new[part]) | set(old[part])
        for k in sorted(keys):
            if k not in new[part] or k not in old[part]:
                missing.append(f"{part} {k}")
                continue
            for f in FIELDS:
                a, b = new[part][k][f], old[part][k][f]
                worst = max(worst, abs(a - b) / max(abs(b), 1e-300))
    return worst, missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA, help="default: %(default)s")
    ap.add_argument("--out", type=Path, help="write the snapshot here")
    ap.add_argument("--compare", type=Path, help="an older snapshot to compare with")
    ap.add_argument("--rtol", type=float, default=1e-9)
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = ap.parse_args(argv)
    snap = snapshot(args.data)
    if args.out:
        args.out.write_text(json.dumps(snap, indent=1, sort_keys=True) + "\n")
    n = len(snap["rows"]) + len(snap["examples"])
    if not args.compare:
        print(f"{len(snap['rows'])} rows and {len(snap['examples'])} examples predicted")
        return 0
    worst, missing = compare(snap, json.loads(args.compare.read_text()))
    ok = worst <= args.rtol and not missing
    if args.json:
        print(json.dumps({"predictions": n, "max_rel_diff": worst, "missing": missing}))
    else:
        print(f"{n} predictions, largest relative difference {worst:.3g} (rtol {args.rtol:g})")
        for m in missing:
            print(f"  only in one snapshot: {m}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
