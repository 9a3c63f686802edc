"""How sure a prediction is: the calibration posterior propagated to the iteration time.

A calibrated profile carries an ``uncertainty`` block (written by ``calibration.make_profiles``,
read by ``diffcost.profiles.uncertainty_for``): the Laplace posterior of the scalar constants it
was fitted on (their raw, log / logit leaves: names, standard deviations, correlations), the
residual spread of the model (log-space error the constants do not explain), the spread of
software stacks (how far a stack the fit has not seen is plausibly off), and the coverage of
the end-to-end runs it was fitted on (``Coverage``). The predictive spread of ``log T`` is

    sigma^2 = J Sigma J^T + residual_sd^2 (+ stack_sd^2 when the stack is unseen),

with ``J = d log T / d raw`` over ``diffcost.params.SCALAR_NAMES`` (one reverse pass,
``log_time_jacobian``; ``log_time_jacobians`` for a batch) and ``Sigma`` their posterior
covariance. The 80% interval is ``T exp(+- 1.2816 sigma)``. Shape grids are held at their fit.
Every spread is a field of ``Uncertainty``: callers may replace them (``.replace``) with
spreads measured elsewhere, e.g. by held-out benchmarks.

References:
    MacKay, "A practical Bayesian framework for backpropagation networks" (1992) for the
    Laplace approximation and its propagation by the Jacobian.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import smooth
from diffcost.cache import fast_compile_jit
from diffcost.params import SCALAR_ENTRIES, SCALAR_NAMES, Params
from diffcost.simulate import simulate

Z80 = 1.2815515655446004  # standard normal quantile 0.9: the 80% two-sided interval
# A constant whose posterior sd is at least this share of its prior sd was not informed by
# the data: it is still at its datasheet default as far as the fit can tell.
NOT_INFORMED = 0.9
# Tolerance on a stored correlation matrix: symmetric to within, and no eigenvalue below
# minus, this (stored values are rounded to 6 decimals).
CORRELATION_TOL = 1e-4
PRIOR_SD = np.array([c.prior_sd for _, c, _ in SCALAR_ENTRIES])


class UncertaintyError(ValueError):
    """A profile's ``uncertainty`` block is malformed; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Coverage:
    """The end-to-end runs a profile was fitted on (of its GPU family or its cluster).

    Attributes:
        rows: how many.
        stacks: their software stacks (``diffcost.stacks`` names).
        ranges: ``{"n_gpus" | "model_params" | "seq_len": (lowest, highest)}``; empty without
            rows.
    """

    rows: int
    stacks: tuple[str, ...] = ()
    ranges: dict = dataclasses.field(default_factory=dict)


COVERAGE_RANGES = ("n_gpus", "model_params", "seq_len")


@dataclasses.dataclass(frozen=True)
class Uncertainty:
    """What a prediction's interval is made of (see the module docstring).

    Attributes:
        cov: ``[n, n]`` posterior covariance of the raw scalar constants, in
            ``SCALAR_NAMES`` order (raw units: natural log or logit).
        residual_sd: log-space spread of the model's error at known constants.
        stack_sd: log-space spread added for a software stack the fit has not seen.
        device: runs of the cluster's GPU family in the fit (None: no profile says).
        cluster: runs of the cluster itself in the fit (None: no profile says).
        note: where it came from.
    """

    cov: np.ndarray
    residual_sd: float = 0.0
    stack_sd: float = 0.0
    device: Coverage | None = None
    cluster: Coverage | None = None
    note: str = "prior widths (no calibrated posterior)"

    @property
    def sd(self) -> np.ndarray:
        return np.sqrt(np.clip(np.diag(self.cov), 0.0, None))

    def replace(self, **changes) -> Uncertainty:
        return dataclasses.replace(self, **changes)

    def fitted(self) -> Coverage | None:
        """The runs that stand for this cluster: its own, else its GPU family's."""
        if self.cluster is not None and self.cluster.rows:
            return self.cluster
        return self.device

    def stack_seen(self, stack: str | None) -> bool:
        """Whether ``stack`` has end-to-end runs in the fit on this cluster. ``None`` (not
        said) means the fitted runs' stack, which is seen when there are such runs. A cluster
        profile without runs of its own (the population, or one fitted on collectives alone)
        sees no stack: a new cluster is as far from the fit as a new source, which is what the
        stack spread measures. Without a cluster layer, its GPU family's runs stand for it."""
        if self.cluster is not None and not self.cluster.rows:
            return False
        runs = self.fitted()
        if runs is None or not runs.rows:
            return False
        return stack is None or stack in runs.stacks

    def not_informed(self) -> tuple[str, ...]:
        """Entries of ``SCALAR_NAMES`` whose posterior sd is at least ``NOT_INFORMED`` times
        their prior sd: still at their datasheet default."""
        return tuple(n for n, s, p in zip(SCALAR_NAMES, self.sd, PRIOR_SD) if s >= NOT_INFORMED * p)


def prior_uncertainty() -> Uncertainty:
    """The prior alone: every constant at its prior width, no residual or stack spread."""
    return Uncertainty(cov=np.diag(PRIOR_SD**2))


# ---- the profile block ----------------------------------------------------------------------

BLOCK_KEYS = ("method", "constants", "sd", "correlation", "residual_sd", "stack_sd", "coverage")


def _number(value, where: str, lo: float = 0.0, strict: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < lo or (strict and value == lo):
        bound = f"above {lo:g}" if strict else f"at least {lo:g}"
        raise UncertaintyError(f"{where}={value!r}: expected a finite number {bound}")
    return float(value)


def _list(value, where: str, n: int | None = None) -> list:
    if not isinstance(value, list) or (n is not None and len(value) != n):
        size = f" of {n} entries" if n is not None else ""
        raise UncertaintyError(f"{where}: expected a list{size}, got {str(value)[:60]}")
    return value


def parse_coverage(value, where: str) -> Coverage:
    """A ``coverage`` mapping (``rows``, ``stacks``, ``[lo, hi]`` per ``COVERAGE_RANGES``)."""
    if not isinstance(value, dict):
        raise UncertaintyError(f"{where}: expected a mapping with rows, stacks and ranges")
    unknown = set(value) - {"rows", "stacks", *COVERAGE_RANGES}
    if unknown:
        known = ", ".join(("rows", "stacks", *COVERAGE_RANGES))
        raise UncertaintyError(f"{where}: unknown keys {sorted(unknown)} (known: {known})")
    rows = value.get("rows")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise UncertaintyError(f"{where}.rows={rows!r}: expected a count (integer >= 0)")
    stacks = _list(value.get("stacks", []), f"{where}.stacks")
    if not all(isinstance(s, str) for s in stacks):
        raise UncertaintyError(f"{where}.stacks: expected stack names (strings)")
    ranges = {}
    for key in COVERAGE_RANGES:
        if key not in value:
            if rows:
                raise UncertaintyError(f"{where}.{key}: missing ([lowest, highest] of the runs)")
            continue
        pair = _list(value[key], f"{where}.{key}", 2)
        lo, hi = (_number(x, f"{where}.{key}", strict=True) for x in pair)
        if lo > hi:
            raise UncertaintyError(f"{where}.{key}=[{lo:g}, {hi:g}]: lowest above highest")
        ranges[key] = (lo, hi)
    return Coverage(rows=rows, stacks=tuple(stacks), ranges=ranges)


def _correlation(value, n: int, where: str) -> np.ndarray:
    rows = _list(value, f"{where}.correlation", n)
    corr = np.array(
        [
            [_number(x, f"{where}.correlation[{i}]", -1.0) for x in _list(r, f"{where}.row", n)]
            for i, r in enumerate(rows)
        ]
    )
    if n and (np.abs(corr).max() > 1.0 or np.abs(np.diag(corr) - 1.0).max() > CORRELATION_TOL):
        raise UncertaintyError(
            f"{where}.correlation: entries must lie in [-1, 1] with 1 on the diagonal"
        )
    if n and np.abs(corr - corr.T).max() > CORRELATION_TOL:
        raise UncertaintyError(f"{where}.correlation: the matrix is not symmetric")
    if n and np.linalg.eigvalsh(0.5 * (corr + corr.T)).min() < -CORRELATION_TOL:
        raise UncertaintyError(f"{where}.correlation: not positive semi-definite")
    return 0.5 * (corr + corr.T)


def parse_block(block, where: str) -> dict:
    """Validate a profile's ``uncertainty`` block.

    Returns:
        ``{"names", "cov", "residual_sd", "stack_sd", "coverage"}`` (``cov`` over ``names``).

    Raises:
        UncertaintyError: naming ``where`` and the field, the value and what is valid.
    """
    where = f"{where}: uncertainty"
    if not isinstance(block, dict):
        raise UncertaintyError(f"{where}: expected a mapping ({', '.join(BLOCK_KEYS)})")
    unknown = set(block) - set(BLOCK_KEYS)
    missing = set(BLOCK_KEYS[1:]) - set(block)
    if unknown or missing:
        what = f"unknown keys {sorted(unknown)}" if unknown else f"missing {sorted(missing)}"
        raise UncertaintyError(f"{where}: {what} (expected: {', '.join(BLOCK_KEYS)})")
    names = _list(block["constants"], f"{where}.constants")
    for name in names:
        if name not in SCALAR_NAMES:
            raise UncertaintyError(
                f"{where}.constants: unknown constant {name!r} (known: {', '.join(SCALAR_NAMES)})"
            )
    if len(set(names)) != len(names):
        raise UncertaintyError(f"{where}.constants: a constant is named twice")
    sd = [_number(x, f"{where}.sd", strict=True) for x in _list(block["sd"], f"{where}.sd")]
    sd = np.array(sd)
    if sd.size != len(names):
        raise UncertaintyError(f"{where}.sd: {sd.size} entries for {len(names)} constants")
    corr = _correlation(block["correlation"], len(names), where)
    return {
        "names": names,
        "cov": corr * np.outer(sd, sd),
        "residual_sd": _number(block["residual_sd"], f"{where}.residual_sd"),
        "stack_sd": _number(block["stack_sd"], f"{where}.stack_sd"),
        "coverage": parse_coverage(block["coverage"], f"{where}.coverage"),
    }


def to_block(names, cov: np.ndarray, residual_sd: float, stack_sd: float, coverage: dict) -> dict:
    """A profile's ``uncertainty`` block (``parse_block`` reads it back): ``cov`` over the
    constants ``names`` as sds and correlations rounded to 6 decimals."""
    sd = np.sqrt(np.diag(cov))
    corr = cov / np.outer(sd, sd)
    return {
        "method": "laplace",
        "constants": list(names),
        "sd": [float(f"{s:.6g}") for s in sd],
        "correlation": [[round(float(x), 6) for x in row] for row in corr],
        "residual_sd": round(float(residual_sd), 6),
        "stack_sd": round(float(stack_sd), 6),
        "coverage": coverage,
    }


def apply_block(unc: Uncertainty, parsed: dict, layer: str, note: str) -> Uncertainty:
    """``unc`` with a parsed block's posterior replacing that of its constants (their
    covariance with every other constant set to 0), its spreads, and its coverage as the
    ``layer`` (``"device"`` or ``"cluster"``) coverage."""
    idx = np.array([SCALAR_NAMES.index(n) for n in parsed["names"]], dtype=int)
    cov = np.array(unc.cov, dtype=float)
    cov[idx, :] = 0.0
    cov[:, idx] = 0.0
    cov[np.ix_(idx, idx)] = parsed["cov"]
    return unc.replace(
        cov=cov,
        residual_sd=parsed["residual_sd"],
        stack_sd=parsed["stack_sd"],
        note=note,
        **{layer: parsed["coverage"]},
    )


def at_prior_unless(unc: Uncertainty, constants) -> Uncertainty:
    """``unc`` with every entry whose constant is not in ``constants`` (names of
    ``diffcost.params.CONSTANTS``: those a profile gave values for) back at its prior width,
    uncorrelated: a posterior says nothing about a constant left at its default."""
    cov = np.array(unc.cov, dtype=float)
    for k, (_, c, _) in enumerate(SCALAR_ENTRIES):
        if c.name not in constants:
            cov[k, :] = 0.0
            cov[:, k] = 0.0
            cov[k, k] = PRIOR_SD[k] ** 2
    return unc.replace(cov=cov)


# ---- propagation ----------------------------------------------------------------------------


def raw_scalars(params: Params) -> jax.Array:
    """The raw values of ``SCALAR_NAMES`` (a vector)."""
    return jnp.stack(
        [
            getattr(params, c.leaf) if i is None else getattr(params, c.leaf)[i]
            for _, c, i in SCALAR_ENTRIES
        ]
    )


def with_raw_scalars(params: Params, raw) -> Params:
    """``params`` with the raw ``SCALAR_NAMES`` values ``raw`` (a vector)."""
    changes: dict = {}
    for k, (_, c, i) in enumerate(SCALAR_ENTRIES):
        if i is None:
            changes[c.leaf] = raw[k]
        else:
            changes[c.leaf] = changes.get(c.leaf, getattr(params, c.leaf)).at[i].set(raw[k])
    return params.replace(**changes)


def _log_time_jacobian(model, plan, cluster, params, temperature):
    def log_time(raw):
        out = simulate(model, plan, cluster, with_raw_scalars(params, raw), temperature)
        return jnp.log(out.iteration_s), out

    (_, out), jac = jax.value_and_grad(log_time, has_aux=True)(raw_scalars(params))
    return out, jac


def _batched(models, plans, clusters, params, temperature):
    run = functools.partial(_log_time_jacobian, temperature=temperature)
    return jax.vmap(run)(models, plans, clusters, params)


def _members(model, plan, cluster, members, temperature):
    run = functools.partial(_log_time_jacobian, model, plan, cluster, temperature=temperature)
    return jax.vmap(run)(members)


# reverse passes of ``simulate``: compiled the fast way (``diffcost.cache``)
_one = fast_compile_jit(_log_time_jacobian, static_argnames=("temperature",))
_many = fast_compile_jit(_batched, static_argnames=("temperature",))
_per_member = fast_compile_jit(_members, static_argnames=("temperature",))


def log_time_jacobian(model, plan, cluster, params, temperature=smooth.DEFAULT_TEMPERATURE):
    """(Breakdown, J) of one configuration (array pytrees): the prediction and ``d log T /
    d raw`` over ``SCALAR_NAMES`` (one forward and one reverse pass, compiled once)."""
    return _one(model, plan, cluster, params, temperature=temperature)


def log_time_jacobians(models, plans, clusters, params, temperature=smooth.DEFAULT_TEMPERATURE):
    """``log_time_jacobian`` of a batch (every argument with a leading axis), vmapped."""
    return _many(models, plans, clusters, params, temperature=temperature)


def member_log_time_jacobians(
    model, plan, cluster, members, temperature=smooth.DEFAULT_TEMPERATURE
):  # fmt: skip
    """``log_time_jacobian`` of one configuration with each of ``members`` (Params with a
    leading member axis, ``diffcost.population.stack_members``): Breakdowns and Jacobians
    with that leading axis."""
    return _per_member(model, plan, cluster, members, temperature=temperature)


@dataclasses.dataclass(frozen=True)
class Spread:
    """The log-space spread of one prediction and its parts (each a standard deviation).

    ``log_sd`` is ``sqrt(posterior_sd^2 + residual_sd^2 + stack_sd^2)``; ``stack_sd`` is 0
    when the stack is seen.
    """

    posterior_sd: float
    residual_sd: float
    stack_sd: float

    @property
    def log_sd(self) -> float:
        return math.sqrt(self.posterior_sd**2 + self.residual_sd**2 + self.stack_sd**2)

    def interval(self, iteration_s: float, z: float = Z80) -> tuple[float, float]:
        """(low, high): ``iteration_s * exp(-+ z log_sd)`` (80% by default)."""
        return iteration_s * math.exp(-z * self.log_sd), iteration_s * math.exp(z * self.log_sd)


def spread(jacobian, unc: Uncertainty, stack_seen: bool = True) -> Spread:
    """The ``Spread`` of a prediction whose ``d log T / d raw`` is ``jacobian``."""
    j = np.asarray(jacobian, dtype=float)
    var = max(float(j @ unc.cov @ j), 0.0)
    return Spread(math.sqrt(var), unc.residual_sd, 0.0 if stack_seen else unc.stack_sd)
