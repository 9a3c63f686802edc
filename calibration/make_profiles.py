"""Rebuild every calibrated profile under diffcost/configs/profiles/ from the shared data.

    python -m calibration.make_profiles [--data ../shared/data] [--steps 1200]

One joint fit over every end-to-end run, collective table, GEMM table and SimuMax node
description (kernel table and collective fit, ``calibration.simumax``) that maps to a cluster
preset: device constants per GPU family (shared by every cluster with that GPU), cluster
constants per cluster (a cluster with collective tables but no end-to-end runs takes the
population's value for the constants its tables do not read, ``command.with_population``).
Writes ``device-<family>.yaml`` and ``<cluster>.yaml`` files, each with
its ``uncertainty`` block (``calibration.posterior.laplace``: the Laplace posterior of its scalar
constants, the residual and stack spreads, the runs it was fitted on); ``population.yaml``, the
cluster constants averaged over the clusters with end-to-end runs, which a cluster without a
profile of its own gets, with each of those clusters' constants (``members``: such a cluster's
prediction is the mean of their log times, ``diffcost.population``); and
``stack-<name>.yaml``, the offsets of each software stack with runs (``diffcost.stacks``).
Prints the before/after error per level.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from calibration import command, posterior
from calibration import fit as fit_mod
from calibration.readers import load, shared_files
from diffcost import profiles as prof
from diffcost.cache import enable_compilation_cache

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default=str(DEFAULT_DATA), help="folder with e2e/, collectives/, kernels/"
    )
    parser.add_argument("--steps", type=int, default=fit_mod.FitConfig().steps)
    args = parser.parse_args(argv)
    enable_compilation_cache()
    data = Path(args.data)
    files = shared_files(data)
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        print(f"missing data files: {', '.join(missing)}", file=sys.stderr)
        return 2
    meas = load(files)
    cfg = fit_mod.FitConfig(steps=args.steps)
    problem = fit_mod.build_problem(meas)
    result = fit_mod.fit(meas, cfg, progress=sys.stderr.isatty(), problem=problem)
    for level, resid in result.residuals.items():
        pre = result.initial_residuals[level]
        print(
            f"{level:5s} rows {resid.size:6d}  MAPE before {command._mape(pre):6.1f}%  "
            f"after {command._mape(resid):6.1f}%"
        )
    if "attn" in result.residuals:
        backward = np.asarray(problem.data["attn"]["stage"]) == 1
        for name, rows in (("fwd", ~backward), ("bwd", backward)):
            resid = result.residuals["attn"][rows]
            print(f"  attention {name}: rows {resid.size}  MAPE after {command._mape(resid):.1f}%")
    print(f"{result.steps} steps in {result.seconds:.1f} s")
    meta = {
        "fitted_on": [str(f) for f in files],
        "command": f"python -m calibration.make_profiles --steps {args.steps}",
    }
    t0 = time.perf_counter()
    blocks, spreads = posterior.laplace(problem, result, meas, cfg)
    print(
        f"Laplace posterior and spreads in {time.perf_counter() - t0:.1f} s: e2e residual sd "
        f"{spreads['residual_sd']:.4f}, stack sd {spreads['stack_sd']:.4f} (groups held out; "
        f"in sample {spreads['stack_sd_in_sample']:.4f})"
    )
    for (source, cluster), (rows, fitted, held) in spreads["group_means"].items():
        print(
            f"  {source} on {cluster}: {rows} runs, mean log residual {fitted:+.4f}, "
            f"held out {held:+.4f}"
        )
    with_runs = sorted({problem.clusters[int(c)] for c in problem.data["e2e"]["c"]})
    result = command.with_population(result, problem, with_runs, cfg.temperature)
    paths = command.write_layers(result, problem.clusters, meta, blocks)
    for name, offsets in result.stack_values.items():
        meta_s = {"layer": "stack", "key": name, **meta}
        paths.append(command.write_stack(prof.stack_path(name), offsets, meta_s))
    paths.append(
        prof.write_profile(
            prof.population_path(),
            command.population_values(result, problem, with_runs),
            {
                "layer": "population",
                "key": prof.POPULATION,
                "mean_of": with_runs,
                **meta,
                "members": command.population_member_values(result, problem, with_runs),
            },  # fmt: skip
            posterior.population_block(result, problem, with_runs, spreads),
        )
    )
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
