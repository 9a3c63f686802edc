"""Do the runs ``diffcost suggest`` picks beat random ones, in a world where the model holds?

    python benchmarks/suggest_synthetic.py [CONFIG ...] [--trials N] [--budget K] [--json]

A check of the design under its own assumptions, not of the model against measurements (the
transfer benchmark does that). Per trial: the true raw constants are drawn from the profile's
posterior (and, for an unseen stack, the stack's offset from ``N(0, stack_sd^2)``); a
"measured" run is the model's log time at the true constants (the full nonlinear model) plus
the offset plus noise ``N(0, residual_sd^2)``. The K runs ``suggest`` picks (fixed before any
draw) and K runs drawn at random from the same candidates are each "measured", the constants
updated by one linear-Gaussian Bayes step at the profile's values, and the target predicted.
Reported per target: the RMS log error of the target's prediction (against its noiseless true
log time) with no run, the K suggested runs, and K random runs, over the trials; with no run
also what the linearization expects (``J`` times the draw) and the mean log error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diffcost import profiles  # noqa: E402
from diffcost import suggest as sg  # noqa: E402
from diffcost.api import experiment_arrays, load, params_for  # noqa: E402
from diffcost.uncertainty import log_time_jacobian, raw_scalars, with_raw_scalars  # noqa: E402

EXAMPLES = ("llama3-70b-h100", "gpt3-175b", "llama3-70b-slice-simumax-b200")


def _log_time(exp, params):
    out, jac = log_time_jacobian(*experiment_arrays(exp), params)
    return float(np.log(out.iteration_s)), np.asarray(jac, dtype=float)


def _sqrt_psd(cov):
    w, v = np.linalg.eigh(0.5 * (cov + cov.T))
    return v * np.sqrt(np.clip(w, 0.0, None))


def check(config: str, trials: int, budget: int, seed: int = 0) -> dict:
    """One target's RMS log errors: none, suggested, random (see the module docstring)."""
    exp = load(config)
    params, _ = params_for(exp)
    unc = profiles.uncertainty_for(exp.cluster)
    stack_sd = 0.0 if unc.stack_seen(exp.stack) else unc.stack_sd
    design = sg.suggest(exp, params, unc, budget=budget, microbenchmarks=False)
    fitting, jacs, times = sg.price(sg.candidate_runs(exp), params)
    picked = [fitting.index(s.candidate) for s in design.suggestions]
    base_t, jac_t = _log_time(exp, params)
    base = np.log(times)
    n = jacs.shape[1]
    cov = np.zeros((n + 1, n + 1))
    cov[:n, :n], cov[n, n] = unc.cov, stack_sd**2
    h = np.hstack([jacs, np.ones((len(fitting), 1))])
    j_t = np.append(jac_t, 1.0)
    noise = unc.residual_sd**2
    root, raw0 = _sqrt_psd(unc.cov), np.asarray(raw_scalars(params))
    rng = np.random.default_rng(seed)
    errs = {"none": [], "none_linear": [], "suggested": [], "random": []}
    for _ in range(trials):
        step = root @ rng.normal(size=n)
        raw = raw0 + step
        offset = stack_sd * rng.normal()
        truth = with_raw_scalars(params, raw)
        true_t = _log_time(exp, truth)[0] + offset
        errs["none"].append(base_t - true_t)
        errs["none_linear"].append(-(jac_t @ step + offset))
        chosen = {"suggested": picked, "random": list(rng.choice(len(fitting), budget, False))}
        for name, idx in chosen.items():
            y = np.array([_log_time(fitting[i].experiment, truth)[0] for i in idx]) + offset
            y += np.sqrt(noise) * rng.normal(size=len(idx))
            hs = h[idx]
            gain = cov @ hs.T @ np.linalg.inv(hs @ cov @ hs.T + noise * np.eye(len(idx)))
            errs[name].append(base_t + j_t @ gain @ (y - base[idx]) - true_t)
    rms = {k: float(np.sqrt(np.mean(np.square(v)))) for k, v in errs.items()}
    return {
        "config": config,
        "candidates": len(fitting),
        "trials": trials,
        "budget": budget,
        "picked": [fitting[i].label for i in picked],
        **{f"rms_log_error_{k}": v for k, v in rms.items()},
        "mean_log_slower_none": -float(np.mean(errs["none"])),  # truth above the prediction
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help="experiment YAMLs (default: three examples)")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--budget", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    configs = args.configs or [f"configs/examples/{e}.yaml" for e in EXAMPLES]
    rows = [check(c, args.trials, args.budget) for c in configs]
    if args.json:
        print(json.dumps({"targets": rows}, indent=2))
        return 0
    for r in rows:
        print(
            f"{r['config']}: RMS log error none {r['rms_log_error_none']:.4f} "
            f"(linearized {r['rms_log_error_none_linear']:.4f}, truth slower by "
            f"{r['mean_log_slower_none']:+.4f} on average), "
            f"{r['budget']} suggested {r['rms_log_error_suggested']:.4f}, "
            f"{r['budget']} random {r['rms_log_error_random']:.4f} "
            f"({r['trials']} trials, {r['candidates']} candidates)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
