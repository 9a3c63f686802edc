"""Where the data end: warnings for a prediction outside what its profile was fitted on.

A prediction extrapolates when (``warnings``):

* its GPU family has no end-to-end runs in the profile's fit (the kernel and layer constants
  were fitted to kernel tables only, or not at all);
* its cluster has none of its own (its cluster constants are the population's, and every
  stack is unseen there);
* its software stack (``--stack``) has none on the cluster;
* its scale (GPUs, model parameters, sequence length) lies more than ``FAR_OUTSIDE`` times
  beyond the range of those runs (``diffcost.uncertainty.Coverage``);
* a constant it is sensitive to (``|d log T / d log c| > ELASTICITY_WARN``, the elasticities of
  ``diffcost.explain``) is still at its datasheet default: its posterior is as wide as its
  prior (``Uncertainty.not_informed``).
"""

from __future__ import annotations

from diffcost.arrays import model_arrays
from diffcost.gpus import gpu_family
from diffcost.specs import Experiment, ModelSpec
from diffcost.uncertainty import Coverage, Uncertainty
from diffcost.workload import param_counts

FAR_OUTSIDE = 2.0  # a scale this many times beyond the fitted runs' range is "far outside"
ELASTICITY_WARN = 0.1  # |d log T / d log c| above which an uninformed constant is flagged
_SCALE_LABELS = {"n_gpus": "GPUs", "model_params": "model parameters", "seq_len": "sequence length"}


def model_parameters(model: ModelSpec) -> float:
    """Parameters of the whole model (unsharded), as ``diffcost.workload.param_counts``."""
    return float(param_counts(model_arrays(model)).total(model.n_layers))


def scale(exp: Experiment) -> dict[str, float]:
    """The scale of an experiment in ``Coverage.ranges``' terms."""
    return {
        "n_gpus": float(exp.plan.n_gpus),
        "model_params": model_parameters(exp.model),
        "seq_len": float(exp.model.seq_len),
    }


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x < 1e6 else f"{x:.2e}"


def scale_warnings(exp: Experiment, runs: Coverage) -> list[str]:
    """One warning per scale more than ``FAR_OUTSIDE`` times outside ``runs``' range."""
    out = []
    for key, value in scale(exp).items():
        if key not in runs.ranges:
            continue
        lo, hi = runs.ranges[key]
        if value > FAR_OUTSIDE * hi or value < lo / FAR_OUTSIDE:
            out.append(
                f"{_SCALE_LABELS[key]} {_fmt(value)} is far outside the fitted runs "
                f"({_fmt(lo)} to {_fmt(hi)}): extrapolated"
            )
    return out


def _entry(key: str, exp: Experiment) -> str:
    """The ``SCALAR_NAMES`` entry an elasticity row of ``diffcost.explain`` moves."""
    if key == "gemm_eff":
        return f"gemm_eff.{exp.model.precision}"
    if key == "gemm_eff_16bit":  # explain's 16-bit knob: bf16 where the GPU has it
        return "gemm_eff.bf16" if exp.cluster.gpu.peak_tflops.get("bf16") else "gemm_eff.fp16"
    return key


def default_warnings(exp: Experiment, unc: Uncertainty, elasticities: list[dict]) -> list[str]:
    """Constants at their datasheet default that the prediction is sensitive to.

    Args:
        elasticities: the rows of ``diffcost.explain.elasticities`` (``key``, ``group``,
            ``name``, ``elasticity``).
    """
    loose = set(unc.not_informed())
    return [
        f"{r['name']} is at its datasheet default (no data informed it) and the prediction is "
        f"sensitive to it (elasticity {r['elasticity']:+.2f})"
        for r in elasticities
        if r["group"] == "calibration"
        and abs(r["elasticity"]) > ELASTICITY_WARN
        and _entry(r["key"], exp) in loose
    ]


def warnings(
    exp: Experiment, unc: Uncertainty, stack: str | None, elasticities: list[dict]
) -> list[str]:
    """Every extrapolation warning of a prediction (see the module docstring); [] when the
    prediction lies within the data its profile was fitted on."""
    family = gpu_family(exp.cluster.gpu.name)
    out = []
    if not any(runs is not None and runs.rows for runs in (unc.device, unc.cluster)):
        out.append(
            f"no end-to-end runs of {family} GPUs in the profile's fit: kernel and layer "
            "constants are not checked against measured iterations"
        )
    runs = unc.fitted()
    if unc.cluster is not None and not unc.cluster.rows:
        out.append(
            f"no end-to-end runs of {exp.cluster.name} in the profile's fit: its cluster "
            "constants are the fitted clusters' mean, and the interval adds the stack spread"
        )
    elif stack is not None and not unc.stack_seen(stack):
        seen = ", ".join(runs.stacks) if runs is not None and runs.stacks else "none"
        out.append(
            f"software stack {stack!r} has no end-to-end runs in the profile's fit (fitted "
            f"stacks: {seen}): the interval adds the stack spread"
        )
    if runs is not None and runs.rows:
        out.extend(scale_warnings(exp, runs))
    out.extend(default_warnings(exp, unc, elasticities))
    return out
