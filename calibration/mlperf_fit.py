"""Held-out calibration on MLPerf rows: a benchmark's implementation as a software stack.

Every MLPerf benchmark is run by one tuned implementation (NVIDIA's PyTorch BERT with CUDA
graphs and fused kernels; NeMo for Llama-2 70B LoRA) on every system. What sets it apart from
the stacks the shipped profiles were fitted on is what a ``diffcost.stacks`` offset describes:
kernel efficiencies, host work per op and microbatch, how much of it hides, per-iteration
overhead. ``fit_offsets`` fits those offsets (``FITTED_EFFECTS``: ``STACK_EFFECTS`` and the
per-kernel time, one raw offset each, on top of each row's shipped profile and stack), plus
per GPU family one offset on the GEMM efficiency and one on the training step's compute rate
(``FAMILY_EFFECTS``, the device level: the shipped profiles have none for L40S; the H200, the
H100's die, shares the H100's offsets as it shares its device profile), to the rows of one
half; the other half is predicted with them. A row set is ``Rows`` (the transformer core's
``simulate``) or one of ``calibration.mlperf_rows``' (operator-graph and DLRM rows): anything
with ``log_times(raw, temperature)``, ``n_offsets`` and ``log_meas``.

The halves (``submitter_halves``) split a benchmark's rows by submitter, so that a system's
rows, and a submitter's other systems, are never on both sides. Each half is fitted once and
predicts the other, so every row gets one held-out prediction.

The fit is a maximum a posteriori estimate: Huber's penalty on the log residuals (width
``HUBER_DELTA``) scaled by the noise ``NOISE_LOG``, and each offset's Gaussian prior of width
``StackEffect.prior_sd``, by Adam.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from calibration.fit import FitConfig, robust_penalty
from calibration.records import E2ERecord
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays, stack
from diffcost.gpus import FAMILY_PARENT, gpu_family
from diffcost.params import CONSTANT
from diffcost.profiles import params_for
from diffcost.simulate import simulate
from diffcost.stacks import STACK_EFFECTS, StackEffect, apply_stack

# Spread of log(measured / predicted) the likelihood allows: about 10% (assumed; the runs of
# one row spread by 0.1-2%, the model's own error is the larger part)
NOISE_LOG = 0.1
# Huber's penalty on the log residuals, quadratic up to this (``calibration.fit``'s default):
# one row the model misses by a factor (BERT on 3,472 GPUs) pulls no harder than a 20% one
HUBER_DELTA = FitConfig.huber_delta
# The stack offsets, plus the time of one kernel on the GPU (``kernel_overhead_s``, a device
# constant of the shipped profiles measured on eagerly launched kernels): an implementation
# that replays CUDA graphs and fuses operators moves it, as it moves the host time per op. Its
# width is the stack effects' for host costs.
FITTED_EFFECTS = (*STACK_EFFECTS, StackEffect("kernel_overhead_log_s", 0.7))
LEAVES = tuple(e.leaf for e in FITTED_EFFECTS)
PRIOR_SD = np.array([e.prior_sd for e in FITTED_EFFECTS])
# Per GPU family, offsets on two device constants of the shipped profiles (``FAMILY_EFFECTS``;
# a family without training rows keeps 0):
# * the GEMM efficiency: how far the benchmark's kernels on that GPU sit from the profile or
#   datasheet, with the width of the stack's GEMM offset;
# * the share of the kernel tables' GEMM and attention rate a training step keeps
#   (``step_compute``, fitted on the LLM stacks' runs only), with its device prior width. On
#   the same H100 systems the MLPerf BERT rows run faster than the LLM stacks' value allows and
#   the Llama-2 LoRA rows slower (zero-shot +18% to +35% and -7% to -19%), so the benchmark's
#   implementation on the GPU sets it, not the device alone; and the GEMM-efficiency offsets,
#   on fractions, cannot lift a rate above ``step_compute`` times the peak. Graph and DLRM rows
#   do not read it (their offset stays 0).
FAMILY_EFFECTS = (
    StackEffect(
        "gemm_eff_logit", next(e.prior_sd for e in STACK_EFFECTS if e.leaf == "gemm_eff_logit")
    ),
    StackEffect("step_compute_log", CONSTANT["step_compute"].prior_sd),
)


@dataclasses.dataclass(frozen=True)
class FitSettings:
    steps: int = 400
    learning_rate: float = 0.05
    temperature: float = 1e-3


class FamilyOffsets:
    """Row sets with a ``families`` tuple: the raw offset vector is ``LEAVES``, then one per
    GPU family."""

    @property
    def n_offsets(self) -> int:
        return len(LEAVES) + len(FAMILY_EFFECTS) * len(self.families)


@struct.dataclass
class Rows(FamilyOffsets):
    """Training runs as stacked arrays, each on its shipped profile and stack."""

    model: object
    plan: object
    cluster: object
    params: object  # batched Params: device + cluster profile + stack offsets of each row
    log_meas: np.ndarray
    family: np.ndarray  # index of each row's GPU family in ``families``
    families: tuple = struct.field(pytree_node=False)

    @classmethod
    def of(cls, records: list[E2ERecord]) -> Rows:
        family, families = families_of(records)
        return cls(
            family=family,
            families=families,
            model=stack([model_arrays(r.model) for r in records]),
            plan=stack([plan_arrays(r.plan) for r in records]),
            cluster=stack([cluster_arrays(r.cluster) for r in records]),
            params=stack([params_for(r.cluster, stack=r.stack)[0] for r in records]),
            log_meas=np.log([r.measured_iter_s for r in records]),
        )

    def log_times(self, raw, temperature):
        """log seconds per step of every row under the offsets ``raw``."""

        def one(m, p, c, params, family):
            params = apply_stack(params, offsets_of(raw, family))
            return simulate(m, p, c, params, temperature).iteration_s

        return jnp.log(jax.vmap(one)(self.model, self.plan, self.cluster, self.params, self.family))


def families_of(records) -> tuple[np.ndarray, tuple[str, ...]]:
    """(index of each record's GPU family in the sorted families, the families).

    A family with a parent of the same compute die (``FAMILY_PARENT``: the H200 is the H100's
    die with HBM3e) shares its parent's offset, as it shares its device profile."""
    fams = [gpu_family(r.cluster.gpu.name) for r in records]
    fams = [FAMILY_PARENT.get(f, f) for f in fams]
    families = tuple(sorted(set(fams)))
    return np.array([families.index(f) for f in fams]), families


def offsets_of(raw, family) -> dict:
    """The offsets of ``raw`` (``LEAVES``, then per ``FAMILY_EFFECTS`` entry one per family)
    with the row's family offsets added to their leaves."""
    out = {leaf: raw[i] for i, leaf in enumerate(LEAVES)}
    n_families = (raw.shape[0] - len(LEAVES)) // len(FAMILY_EFFECTS)
    for j, e in enumerate(FAMILY_EFFECTS):
        extra = raw[len(LEAVES) + j * n_families + family]
        out[e.leaf] = out[e.leaf] + extra if e.leaf in out else extra
    return out


def predict_log(rows, raw, temperature: float = 1e-3):
    """log of the predicted iteration time of every row of ``rows`` (``Rows``, or
    ``mlperf_rows.GraphRows`` / ``DlrmRows``) with the offsets ``raw`` (``[n_offsets]``; zeros:
    the shipped profiles as they are)."""
    return rows.log_times(jnp.asarray(raw), temperature)


def prior_sd(rows) -> np.ndarray:
    """Prior width of every raw offset: the stack effects', then each ``FAMILY_EFFECTS``
    entry's per family."""
    per_family = [np.full(len(rows.families), e.prior_sd) for e in FAMILY_EFFECTS]
    return np.concatenate([PRIOR_SD, *per_family])


def _loss(raw, rows: Rows, weight, temperature):
    resid = predict_log(rows, raw, temperature) - rows.log_meas
    data = jnp.sum(weight * robust_penalty(resid, HUBER_DELTA, 0.0)) / NOISE_LOG**2
    return data + 0.5 * jnp.sum((raw / prior_sd(rows)) ** 2)


def fit_offsets(rows: Rows, weight, settings: FitSettings = FitSettings(), step=None):
    """The offsets (``[rows.n_offsets]`` raw) that fit the rows of positive ``weight``.

    ``step``: a compiled step from ``make_step`` to reuse (the shapes of ``rows`` fixed)."""
    step = step or make_step(settings)
    opt = optax.adam(settings.learning_rate)
    raw = jnp.zeros(rows.n_offsets)
    state = opt.init(raw)
    w = jnp.asarray(weight, dtype=raw.dtype)
    # optax's step counts are integers mixed with floats: standard promotion (as calibration.fit)
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(settings.steps):
            raw, state = step(raw, state, rows, w)
    return np.asarray(raw)


def make_step(settings: FitSettings = FitSettings()):
    """One jitted Adam step of ``_loss``."""
    opt = optax.adam(settings.learning_rate)
    grad = jax.grad(_loss)

    @jax.jit
    def step(raw, state, rows, weight):
        g = grad(raw, rows, weight, settings.temperature)
        updates, state = opt.update(g, state)
        return optax.apply_updates(raw, updates), state

    return step


def submitter_halves(submitters: list[str], seed: int = 0) -> np.ndarray:
    """Half (0 or 1) of every row: whole submitters, in a seeded random order, each to the
    half with fewer rows so far (ties to half 0)."""
    names = sorted(set(submitters))
    order = np.random.default_rng(seed).permutation(len(names))
    counts = {n: submitters.count(n) for n in names}
    sizes, half = [0, 0], {}
    for i in order:
        name = names[i]
        h = int(sizes[1] < sizes[0])
        half[name] = h
        sizes[h] += counts[name]
    return np.array([half[s] for s in submitters])


def heldout_log_pred(rows: Rows, halves: np.ndarray, settings: FitSettings = FitSettings()):
    """(log predictions, offsets per half): each half's rows predicted with the offsets
    fitted on the other half."""
    step = make_step(settings)
    out = np.zeros(len(halves))
    fitted = []
    for h in (0, 1):
        raw = fit_offsets(rows, (halves != h).astype(float), settings, step)
        fitted.append(raw)
        pred = np.asarray(predict_log(rows, jnp.asarray(raw), settings.temperature))
        out[halves == h] = pred[halves == h]
    return out, fitted
