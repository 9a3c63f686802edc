"""``diffcost calibrate``: fit a cluster's profile to measurement files and write it.

    diffcost calibrate --cluster vtrain-a100 ../shared/data/e2e/calibration.csv \
        ../shared/data/collectives/collectives.csv [--out profile.yaml]

Without ``--out`` the fit writes two layers under ``calibration/profiles/``: the GPU family's
device constants (``device-<family>.yaml``, used by every cluster with that GPU) and the
cluster's own constants (``<cluster>.yaml``). With ``--out`` one file holds both.
"""

from __future__ import annotations

import numpy as np

from calibration import fit as fit_mod
from calibration import profile as prof
from calibration.readers import Measurements, load
from diffcost.config import load_cluster


def select(meas: Measurements, clusters: list[str]) -> Measurements:
    """The measurements of ``clusters`` (e2e and collectives) and of their GPU families (GEMMs)."""
    families = {prof.gpu_family(load_cluster(c).gpu.name) for c in clusters}
    return Measurements(
        e2e=[r for r in meas.e2e if r.cluster.name in clusters],
        collectives=[r for r in meas.collectives if r.cluster in clusters],
        gemms=[g for g in meas.gemms if g.gpu in families],
        skipped=list(meas.skipped),
    )


def _mape(resid: np.ndarray) -> float:
    return float(np.mean(np.abs(np.expm1(resid))) * 100) if resid.size else float("nan")


def write_result(result: fit_mod.FitResult, clusters: list[str], sources: list[str], out=None):
    """Write the fitted layers; returns the paths written."""
    meta = {"fitted_on": sources, "command": "diffcost calibrate"}
    written = []
    if out is not None:
        name = clusters[0]
        fam = prof.gpu_family(load_cluster(name).gpu.name)
        values = {**result.device_values.get(fam, {}), **result.cluster_values[name]}
        written.append(
            prof.write_profile(
                prof.Path(out), values, {"layer": "cluster+device", "key": name, **meta}
            )
        )
        return written
    for fam, values in result.device_values.items():
        written.append(
            prof.write_profile(
                prof.device_path(fam), values, {"layer": "device", "key": fam, **meta}
            )
        )
    for name in clusters:
        if name in result.cluster_values:
            written.append(
                prof.write_profile(
                    prof.cluster_path(name),
                    result.cluster_values[name],
                    {"layer": "cluster", "key": name, **meta},
                )
            )
    return written


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=args.json)
    meas = select(load(args.data, cluster=args.cluster), args.cluster)
    counts = {"e2e": len(meas.e2e), "collectives": len(meas.collectives), "gemm": len(meas.gemms)}
    if not any(counts.values()):
        console.print(f"no measurements for {', '.join(args.cluster)} in the given files")
        return 2
    cfg = fit_mod.FitConfig(steps=args.steps)
    problem = fit_mod.build_problem(meas)
    result = fit_mod.fit(meas, cfg, progress=not args.json, problem=problem)
    paths = write_result(result, args.cluster, [str(p) for p in args.data], args.out)
    rows = {}
    for level, resid in result.residuals.items():
        pre = result.initial_residuals[level]
        rows[level] = {
            "rows": int(resid.size),
            "mape_before_pct": _mape(pre),
            "mape_after_pct": _mape(resid),
        }
    summary = {
        "clusters": args.cluster,
        "rows": rows,
        "steps": result.steps,
        "seconds": result.seconds,
        "converged": result.converged,
        "written": [str(p) for p in paths],
        "device": result.device_values,
        "cluster": result.cluster_values,
    }
    if args.json:
        import json

        print(json.dumps(summary, indent=2))
        return 0
    t = Table(
        title=f"calibration of {', '.join(args.cluster)} ({result.steps} steps, "
        f"{result.seconds:.1f} s, {'converged' if result.converged else 'step limit'})"
    )
    for col in ("level", "rows", "MAPE before %", "MAPE after %"):
        t.add_column(col, justify="right" if col != "level" else "left")
    for level, r in rows.items():
        t.add_row(
            level, str(r["rows"]), f"{r['mape_before_pct']:.1f}", f"{r['mape_after_pct']:.1f}"
        )
    console.print(t)
    for p in paths:
        console.print(f"wrote {p}")
    return 0
