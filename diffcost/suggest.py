"""Which runs to measure: rank candidate measurements by how much they would shrink the
predictive variance of a target prediction (optimal experimental design on the Laplace
posterior of ``diffcost.uncertainty``).

A target's log iteration time has predictive variance

    v = J Sigma J^T + residual_sd^2 (+ stack_sd^2 when its stack is unseen),

with ``J`` its Jacobian ``d log T / d raw`` over ``diffcost.params.SCALAR_NAMES`` and ``Sigma``
their posterior covariance. Measuring a candidate with Jacobian ``j`` is one more observation
of ``log T_c`` with noise variance ``s^2`` (the profile's ``residual_sd^2`` unless the caller
says otherwise, for runs and microbenchmarks apart). Bayes' rule for a
linear-Gaussian observation updates the covariance by a rank-one term,

    Sigma' = Sigma - (Sigma j^T)(j Sigma) / (j Sigma j^T + s^2),

so the target's posterior variance falls by ``(J Sigma j^T)^2 / (j Sigma j^T + s^2)``
(``variance_after``). The residual term is not a constant of the model: no measurement moves
it. The stack term is: when the target's stack is unseen, its offset ``b ~ N(0, stack_sd^2)``
is one more unknown, appended to the constants with Jacobian 1 for the target and for every
candidate run (same cluster, same stack) and 0 for a microbenchmark, whose kernel or
collective no stack changes. ``greedy_design`` picks ``budget`` candidates one at a time, each
the one that leaves the target the smallest variance given those already picked (ties go to
the cheaper run), updating ``Sigma`` after each pick. With several targets (a group of runs
the user cares about) it minimises the mean of their variances (an I-optimal design) rather
than the variance of one summary of them: the variance of a group's mean log time is cut most
by the runs that move every target together, often the group's extremes, where the model is
least right. Greedy selection is not guaranteed to
find the best set: a single target's variance reduction is submodular only without
"suppressor" observations (Das & Kempe, "Algorithms for subset selection in linear
regression", STOC 2008); its guarantee degrades with their submodularity ratio.

The candidates: ``candidate_runs``, short end-to-end runs of slices of the target's model on
one or two nodes of its cluster: fewer layers (``LAYERS_PER_STAGE`` per pipeline stage), every
tensor/pipeline/data layout that fills the nodes with at most ``MAX_STAGES`` stages, the
target's microbatch, sequence length, context parallelism, ZeRO stage and recompute, and every
plan rule of ``diffcost.constraints`` satisfied (one that would not fit in memory is dropped
once predicted); and ``candidate_microbenchmarks``, the target layer's GEMMs, fused attention
and collectives (``diffcost.microbench``). Each is priced by its predicted time (an iteration
or a call) times its GPUs. ``suggest`` takes one target or several plans of one model on one
cluster and stack (the plans a search found, say): their candidates are pooled, and the picks
minimise the targets' mean variance. docs/calibration.md, "Which runs to measure", has the
figures.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from diffcost import smooth
from diffcost.api import experiment_arrays
from diffcost.constraints import divisors, problems
from diffcost.microbench import (
    Attention,
    Collective,
    Gemm,
    attention_log_time_jacobian,
    collective_log_time_jacobian,
    gemm_log_time_jacobian,
    target_attention,
    target_collectives,
    target_gemms,
)
from diffcost.params import SCALAR_NAMES, Params
from diffcost.population import median_jacobian, median_log_time_jacobian
from diffcost.simulate import STATUS_NAMES
from diffcost.specs import Experiment, PlanSpec
from diffcost.uncertainty import Z80, Spread, Uncertainty, log_time_jacobian, spread

LAYERS_PER_STAGE = (2, 4, 8)  # layers per pipeline stage of a slice
NODES = (1, 2)  # nodes a candidate run uses
MAX_STAGES = 4  # pipeline stages of a slice, at most
MICROBATCHES_PER_STAGE = 4  # microbatches per iteration of a slice, per pipeline stage
TIE_TOL = 1e-9  # relative: variances this close count as equal (the cheaper run wins)
ONE_DESIGN = "several targets must be plans of one model on one cluster and stack"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One measurement that could be made: a short run, or a microbenchmark (``bench``).

    Attributes:
        label: a short description (``"8 GPUs, 4 layers, tp 2 pp 2 dp 2"``).
        experiment: the run; for a microbenchmark, the target (its GPU, cluster, precision).
        overrides: for a run, the ``key=value`` overrides that turn the target's config into
            it (``diffcost predict CONFIG <target overrides> <these>`` predicts it).
        bench: for a microbenchmark, its ``diffcost.microbench.Gemm`` or ``Collective``.
    """

    label: str
    experiment: Experiment
    overrides: tuple[str, ...] = ()
    bench: Gemm | Attention | Collective | None = None

    @property
    def kind(self) -> str:
        """``"run"``, ``"gemm"``, ``"attention"`` or ``"collective"``."""
        return "run" if self.bench is None else type(self.bench).__name__.lower()

    @property
    def n_gpus(self) -> int:
        """GPUs it occupies."""
        if self.bench is None:
            return self.experiment.plan.n_gpus
        return self.bench.size if isinstance(self.bench, Collective) else 1


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A picked candidate and what measuring it (after the earlier picks) does to the target.

    Attributes:
        candidate: what to run.
        time_s: its predicted time per iteration (a run) or per call (a microbenchmark).
        gpu_s: its predicted cost, ``time_s`` times its GPU count.
        log_sd_before, log_sd_after: the target's predictive log-space sd before and after
            measuring it (after the earlier suggestions); with several targets, the root of
            their mean predictive variance.
        targets_log_sd_after: each target's predictive log-space sd after it (one entry for
            one target).
    """

    candidate: Candidate
    time_s: float
    gpu_s: float
    log_sd_before: float
    log_sd_after: float
    targets_log_sd_after: tuple[float, ...] = ()

    @property
    def width_before_pct(self) -> float:
        return width_pct(self.log_sd_before)

    @property
    def width_after_pct(self) -> float:
        return width_pct(self.log_sd_after)


@dataclasses.dataclass(frozen=True)
class Design:
    """What ``suggest`` returns.

    Attributes:
        target: the experiment asked about (the first, with several).
        iteration_s: its predicted time per iteration.
        spread: its predictive spread now (``diffcost.uncertainty.Spread``).
        suggestions: the picks, best first.
        n_candidates: how many candidates were priced (valid plans that fit in memory).
        targets: every target, ``target`` first.
        targets_iteration_s, targets_spread: theirs, in that order.
    """

    target: Experiment
    iteration_s: float
    spread: Spread
    suggestions: tuple[Suggestion, ...]
    n_candidates: int
    targets: tuple[Experiment, ...] = ()
    targets_iteration_s: tuple[float, ...] = ()
    targets_spread: tuple[Spread, ...] = ()


def width_pct(log_sd: float, z: float = Z80) -> float:
    """Width of the interval ``T exp(-+ z log_sd)`` in % of ``T`` (80% by default)."""
    return 100.0 * (math.exp(z * log_sd) - math.exp(-z * log_sd))


# ---- the design ----------------------------------------------------------------------------


def variance_after(target_j, cand_j, cov, noise_var: float) -> float:
    """``J Sigma J^T`` of the target after observing a candidate's log time with noise
    variance ``noise_var``: ``v - (J Sigma j^T)^2 / (j Sigma j^T + noise_var)``. A candidate
    the posterior cannot tell apart from a known value (denominator 0) leaves it as it is."""
    t = np.asarray(target_j, dtype=float).reshape(1, -1)
    c = np.asarray(cand_j, dtype=float).reshape(1, -1)
    noise = np.asarray([noise_var], dtype=float)
    return float(_mean_variances_after(t, c, np.asarray(cov, dtype=float), noise)[0])


def condition(cov, cand_j, noise_var: float) -> np.ndarray:
    """``Sigma`` after observing a candidate (the rank-one Bayes update of the module
    docstring)."""
    cov = np.asarray(cov, dtype=float)
    c = np.asarray(cand_j, dtype=float)
    denom = float(c @ cov @ c) + noise_var
    if denom <= 0.0:
        return cov
    g = cov @ c
    out = cov - np.outer(g, g) / denom
    return 0.5 * (out + out.T)


def greedy_design(
    target_j, cand_js, cov, noise_var, budget: int, costs: Sequence[float] | None = None
) -> list[tuple[int, float]]:
    """Pick ``budget`` distinct candidates greedily (see the module docstring).

    Args:
        target_j: ``[n]`` the target's Jacobian, or ``[targets, n]`` several targets' (the
            picks then minimise the mean of their variances).
        cand_js: ``[m, n]`` the candidates' Jacobians.
        cov: ``[n, n]`` the posterior covariance.
        noise_var: a measurement's noise variance (log space): one for all, or ``[m]``.
        budget: how many to pick (at most ``m`` are).
        costs: per candidate, what breaks ties (lower first); None: the first candidate.

    Returns:
        ``(index, J Sigma J^T after this pick and the earlier ones)`` per pick, in order (the
        mean over the targets with several).
    """
    if budget < 1:
        raise ValueError(f"budget={budget}: must be at least 1")
    cand_js = np.asarray(cand_js, dtype=float).reshape(len(cand_js), -1)
    targets = np.atleast_2d(np.asarray(target_j, dtype=float))
    costs = np.zeros(len(cand_js)) if costs is None else np.asarray(costs, dtype=float)
    cov = np.asarray(cov, dtype=float)
    noise = np.broadcast_to(np.asarray(noise_var, dtype=float), (len(cand_js),))
    left = list(range(len(cand_js)))
    picks = []
    for _ in range(min(budget, len(left))):
        after = _mean_variances_after(targets, cand_js[left], cov, noise[left])
        best = after.min()
        near = [k for k, a in enumerate(after) if a <= best + TIE_TOL * max(best, 1e-300)]
        k = min(near, key=lambda k: costs[left[k]])
        i = left.pop(k)
        cov = condition(cov, cand_js[i], noise[i])
        picks.append((i, float(after[k])))
    return picks


def _mean_variances_after(targets, cands, cov, noise) -> np.ndarray:
    """Per candidate row of ``cands``: the mean over the rows of ``targets`` of their
    ``J Sigma J^T`` after observing it (``variance_after``), in one pass; a candidate of zero
    denominator changes nothing."""
    g = targets @ cov  # [targets, n]
    before = float(np.mean(np.einsum("tn,tn->t", g, targets)))
    denom = np.einsum("mn,nk,mk->m", cands, cov, cands) + noise
    gain = np.mean(np.square(g @ cands.T), axis=0)  # [m]
    fall = np.where(denom > 0, gain / np.where(denom > 0, denom, 1.0), 0.0)
    return np.maximum(before - fall, 0.0)


# ---- the candidates ------------------------------------------------------------------------


def _slice_plan(plan: PlanSpec, tp: int, pp: int, dp: int) -> PlanSpec:
    """The target's plan laid out as tp x pp x dp (its cp), 1F1B, a few microbatches."""
    ep = math.gcd(plan.ep, dp)
    return dataclasses.replace(
        plan,
        tp=tp,
        pp=pp,
        dp=dp,
        ep=ep,
        sequence_parallel=plan.sequence_parallel and tp > 1,
        schedule="gpipe" if plan.schedule == "gpipe" else "1f1b",
        chunks=1,
        global_batch=dp * plan.microbatch * MICROBATCHES_PER_STAGE * pp,
    )


def _override_value(value) -> str:
    """A plan field's value as ``diffcost.config.parse_overrides`` reads it back."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, tuple):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def _overrides(exp: Experiment, cand: Experiment) -> tuple[str, ...]:
    """The ``key=value`` overrides that turn ``exp`` into ``cand`` (same model but its layer
    count; the plan's tp, pp and dp always, its other fields where they differ)."""
    q = cand.plan
    out = [f"gpus={q.n_gpus}", f"model.n_layers={cand.model.n_layers}"]
    for name, value in q.fields_from(exp.plan, always=("tp", "pp", "dp")).items():
        if name != "global_batch":
            out.append(f"plan.{name}={_override_value(value)}")
    out.append(f"plan.global_batch={q.global_batch}")
    return tuple(out)


def candidate_runs(
    exp: Experiment,
    nodes: Sequence[int] = NODES,
    layers_per_stage: Sequence[int] = LAYERS_PER_STAGE,
    max_stages: int = MAX_STAGES,
) -> list[Candidate]:
    """Short runs of slices of ``exp``'s model on ``nodes`` nodes of its cluster (see the
    module docstring); every one satisfies the plan rules (``diffcost.constraints``)."""
    m, c, p = exp.model, exp.cluster, exp.plan
    out = []
    for k in nodes:
        n = k * c.gpus_per_node
        if n % p.cp:
            continue
        for tp in divisors(c.gpus_per_node):
            for pp in [d for d in divisors(n // (p.cp * tp)) if d <= max_stages]:
                dp = n // (p.cp * tp * pp)
                plan = _slice_plan(p, tp, pp, dp)
                for layers in sorted({s * pp for s in layers_per_stage if s * pp <= m.n_layers}):
                    model = dataclasses.replace(m, n_layers=layers, name=f"{m.name}-L{layers}")
                    if problems(model, c, plan, n_gpus=n):
                        continue
                    run = dataclasses.replace(exp, model=model, plan=plan, source="slice")
                    label = f"{n} GPUs, {layers} layers, tp {tp} pp {pp} dp {dp}"
                    label += f" cp {p.cp}" if p.cp > 1 else ""
                    out.append(Candidate(label, run, _overrides(exp, run)))
    return out


def candidate_microbenchmarks(exp: Experiment) -> list[Candidate]:
    """GEMMs of ``exp``'s layer shapes and its collectives at their message sizes
    (``diffcost.microbench``), on its cluster."""
    out = []
    for g in target_gemms(exp):
        label = f"GEMM {g.name} {g.m} x {g.n} x {g.k} {exp.model.precision}"
        out.append(Candidate(label, exp, bench=g))
    m, p = exp.model, exp.plan
    for a in target_attention(exp):
        seq = f"seq {m.seq_len // p.cp}" + (f" of {m.seq_len} (cp {p.cp})" if p.cp > 1 else "")
        shape = f"batch {p.microbatch}, {seq}, heads {m.heads // p.tp}"
        label = f"fused {a.name}, {shape}, kv heads {max(m.kv_heads // p.tp, 1)}"
        out.append(Candidate(label, exp, bench=a))
    for c in target_collectives(exp):
        nodes = c.size // c.per_node
        where = f"{nodes} node{'s' if nodes > 1 else ''}"
        label = f"{c.op} {c.msg_bytes / 2**20:.4g} MiB over {c.size} GPUs, {where} ({c.name})"
        out.append(Candidate(label, exp, bench=c))
    return out


def _log_time_jacobian(cand: Candidate, params: Params, temperature: float):
    """(seconds, ``d log t / d raw``, fits in memory) of one candidate."""
    if isinstance(cand.bench, Gemm):
        log_t, jac = gemm_log_time_jacobian(cand.experiment, cand.bench, params, temperature)
        return float(np.exp(log_t)), jac, True
    if isinstance(cand.bench, Attention):
        log_t, jac = attention_log_time_jacobian(cand.experiment, cand.bench, params, temperature)
        return float(np.exp(log_t)), jac, True
    if isinstance(cand.bench, Collective):
        log_t, jac = collective_log_time_jacobian(cand.experiment, cand.bench, params, temperature)
        return float(np.exp(log_t)), jac, True
    out, jac = log_time_jacobian(*experiment_arrays(cand.experiment), params, temperature)
    return float(out.iteration_s), jac, STATUS_NAMES[int(out.status)] == "ok"


def _median_log_time_jacobian(cand: Candidate, members: list[Params], temperature: float):
    """``_log_time_jacobian`` of the median over ``members`` (``diffcost.population``): the
    exponential of their mean log time, the mean of their Jacobians; a run fits in memory
    when its median status is ok (memory does not depend on the cluster constants)."""
    if cand.bench is None:
        out, jac = median_log_time_jacobian(
            *experiment_arrays(cand.experiment), members, temperature
        )
        return float(out.iteration_s), jac, STATUS_NAMES[int(out.status)] == "ok"
    each = [_log_time_jacobian(cand, p, temperature) for p in members]
    log_t = np.mean([math.log(t) for t, _, _ in each])
    return float(np.exp(log_t)), median_jacobian([j for _, j, _ in each]), True


def price(
    cands: Sequence[Candidate],
    params: Params,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
    members: Sequence[Params] = (),
):
    """(kept candidates, their Jacobians ``[m, n]`` over ``SCALAR_NAMES``, their times in
    seconds): the candidates that fit in memory, priced at ``params``, or as the median over
    ``members`` when there are any (``diffcost.profiles.population_members``)."""
    kept, jacs, times, members = [], [], [], list(members)
    for cand in cands:
        if members:
            t, jac, fits = _median_log_time_jacobian(cand, members, temperature)
        else:
            t, jac, fits = _log_time_jacobian(cand, params, temperature)
        if fits and math.isfinite(t):
            kept.append(cand)
            jacs.append(np.asarray(jac, dtype=float))
            times.append(t)
    return kept, np.asarray(jacs).reshape(len(kept), len(SCALAR_NAMES)), np.asarray(times)


def mismatch(a: Experiment, b: Experiment) -> str | None:
    """What keeps ``a`` and ``b`` from being targets of one design (``"cluster"``,
    ``"model"`` or ``"stack"``: they must be plans of one model on one cluster and stack), or
    None."""
    for what in ("cluster", "model", "stack"):
        if getattr(a, what) != getattr(b, what):
            return what
    return None


def pooled_candidates(targets: Sequence[Experiment], microbenchmarks: bool = True):
    """Every target's candidates once (``candidate_runs`` and, with ``microbenchmarks``,
    ``candidate_microbenchmarks``), each run's overrides turning the first target into it (a
    later target's run names in its label the plan fields it takes from that target)."""
    out, seen = [], set()
    for t in targets:
        cands = candidate_runs(t) + (candidate_microbenchmarks(t) if microbenchmarks else [])
        for c in cands:
            if c.bench is None and t is not targets[0]:
                overrides = _overrides(targets[0], c.experiment)
                extra = [o.removeprefix("plan.") for o in overrides if o not in c.overrides]
                label = ", ".join([c.label, *(o.replace("=", " ") for o in extra)])
                c = dataclasses.replace(c, label=label, overrides=overrides)
            key = (c.kind, c.label, c.overrides)
            if key not in seen:
                seen.add(key)
                out.append(c)
    return out


def suggest(
    exp: Experiment,
    params: Params,
    unc: Uncertainty,
    budget: int = 3,
    candidates: Sequence[Candidate] | None = None,
    microbenchmarks: bool = True,
    stack_seen: bool | None = None,
    noise_sd: float | None = None,
    micro_noise_sd: float | None = None,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
    others: Sequence[Experiment] = (),
    members: Sequence[Params] = (),
) -> Design:
    """The ``budget`` measurements that shrink ``exp``'s predictive variance most (with
    ``others``, the mean predictive variance of ``exp`` and ``others``).

    Args:
        exp: the target (what the user cares about).
        params: the constants (``diffcost.profiles.params_for``).
        unc: their posterior (``diffcost.profiles.uncertainty_for``).
        budget: how many to suggest (fewer when fewer candidates are valid).
        candidates: what could be measured; None for ``pooled_candidates`` of the targets.
        microbenchmarks: whether the default candidates include microbenchmarks.
        stack_seen: whether the target's stack is seen (adds the stack spread when not);
            None for ``unc.stack_seen(exp.stack)``.
        noise_sd: a run's log-space noise; None for ``unc.residual_sd``.
        micro_noise_sd: a microbenchmark's log-space noise (how far the model's kernel or
            collective time is from a measured one at known constants); None for ``noise_sd``.
        temperature: smoothness of the model, as in ``simulate``.
        others: more targets: other plans of ``exp``'s model on its cluster and stack.
        members: for a cluster that takes the population, its members
            (``diffcost.profiles.population_members``): the targets' times and Jacobians are
            the members' median, as ``predict`` gives them, and so are the candidates'.

    Returns:
        A ``Design``.

    Raises:
        ValueError: ``budget`` below 1, a noise that is negative or not finite, or ``others``
            on another cluster, model or stack.
    """
    if budget < 1:
        raise ValueError(f"budget={budget}: must be at least 1")
    for name, value in (("noise_sd", noise_sd), ("micro_noise_sd", micro_noise_sd)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value}: must be a finite number >= 0 (log space)")
    targets = (exp, *others)
    for t in others:
        if (what := mismatch(exp, t)) is not None:
            raise ValueError(f"others: a target's {what} differs from exp's; " + ONE_DESIGN)
    seen = unc.stack_seen(exp.stack) if stack_seen is None else stack_seen
    priced = [
        median_log_time_jacobian(*experiment_arrays(t), list(members), temperature)
        if members
        else log_time_jacobian(*experiment_arrays(t), params, temperature)
        for t in targets
    ]
    target_js = np.stack([np.asarray(j, dtype=float) for _, j in priced])
    spreads = tuple(spread(j, unc, seen) for j in target_js)
    now = spreads[0]
    if candidates is None:
        candidates = pooled_candidates(targets, microbenchmarks)
    kept, jacs, times = price(list(candidates), params, temperature, members)
    noise = unc.residual_sd if noise_sd is None else noise_sd
    micro = noise if micro_noise_sd is None else micro_noise_sd
    noise_var = np.array([(noise if c.kind == "run" else micro) ** 2 for c in kept])
    gpus = np.array([c.n_gpus for c in kept], dtype=float)
    # the stack's offset: one more unknown, shared by the targets and every run on its stack
    cov = np.zeros((len(SCALAR_NAMES) + 1,) * 2)
    cov[:-1, :-1], cov[-1, -1] = unc.cov, now.stack_sd**2
    on_stack = np.array([[float(c.kind == "run")] for c in kept]).reshape(len(kept), 1)
    jacs = np.hstack([jacs, on_stack])
    target_js = np.hstack([target_js, np.ones((len(targets), 1))])
    picks = greedy_design(target_js, jacs, cov, noise_var, budget, times * gpus) if kept else []
    fixed = now.residual_sd**2  # no measurement moves it
    before = math.sqrt(np.mean([s.log_sd**2 for s in spreads]))
    suggestions = []
    for i, var in picks:
        cov = condition(cov, jacs[i], noise_var[i])
        each = tuple(math.sqrt(float(t @ cov @ t) + fixed) for t in target_js)
        after = math.sqrt(var + fixed)
        s = Suggestion(kept[i], float(times[i]), float(times[i] * gpus[i]), before, after, each)
        suggestions.append(s)
        before = after
    iteration_s = tuple(float(out.iteration_s) for out, _ in priced)
    return Design(
        exp, iteration_s[0], now, tuple(suggestions), len(kept), targets, iteration_s, spreads
    )
