"""The plan constraints: every rule a plan must satisfy, declared once and evaluated four ways.

``RULES`` is the one table. A rule reads a few plan quantities by name (``reads``) and says
whether they satisfy it (``test``); it names its message for users (``explain``), whether
``check_plan(strict=False)`` skips it (``strict``: published runs may break it), and how a
relaxed plan is pushed towards it (``ratio``: a quantity that must be an integer, penalised by
``off_integer``; ``excess``: a log2 excess that must not be positive, penalised by its square).
The parallel dimensions appear in ``PLACED_DIMS`` order (tp, cp, dp, pp) throughout.

The quantities (one mapping, keys below; the builders make it from specs, arrays or a request):

=================  ==========================================================================
``heads``          attention heads; ``kv_heads`` key/value heads; ``n_layers`` (plus 2 with a
                   plan's ``split_edges`` over pp > 1: the places it splits); ``seq_len``
``experts``        experts per MoE layer (1 for a dense model)
``peak_flops``     the GPU's peak at the model's precision (0 where it has none)
``tp cp dp pp ep`` parallel degrees; ``microbatch``; ``global_batch``; ``chunks``
``interleaved``    1 for the interleaved pipeline schedule (a probability for a relaxed plan)
``n_microbatches`` global_batch / (dp * microbatch)
``n_gpus``         tp * cp * dp * pp; ``gpus`` the GPU count asked for; ``gpus_per_node``
=================  ==========================================================================

The consumers:

* ``problems``: the messages of the rules a ``ModelSpec`` / ``ClusterSpec`` / ``PlanSpec``
  breaks (``config.check_plan``); ``request_problems`` for a model, cluster and GPU count
  before any plan is chosen (``space.make_space``).
* ``holds``: exact integer evaluation of the rules a partial assignment can decide
  (``space.Space`` prunes its enumeration with it).
* ``is_valid``: a traced boolean for one plan's arrays (``simulate.plan_is_valid``).
* ``relaxed_penalties``: the smooth penalties of a relaxed plan (``search.objective``).

Examples:
    >>> from diffcost.specs import ClusterSpec, GpuSpec, ModelSpec, PlanSpec
    >>> m = ModelSpec("m", 4, 64, 256, 4, 4, 128, 1000)
    >>> c = ClusterSpec("c", GpuSpec("g", {"bf16": 1.0}, 1.0, 1.0), 8, 1.0, 0.0, 1, 1.0, 0.0)
    >>> problems(m, c, PlanSpec(tp=2, cp=2, dp=2, global_batch=4))
    []
    >>> [r.name for r in RULES if not r.test(spec_quantities(m, c, PlanSpec(cp=3)), EXACT)]
    ['nodes', 'context']
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp

from diffcost.specs import (
    PLACED_DIMS,
    SCHEDULES,
    ClusterSpec,
    ModelSpec,
    PlanSpec,
    pipeline_places,
)

DIVISIBILITY_TOL = 1e-6  # relative distance to an integer that still counts as divisible
_INTERLEAVED = SCHEDULES.index("interleaved")

Quantities = Mapping[str, Any]


class Ops(NamedTuple):
    """The arithmetic a rule's test is written in: exact on integers, or traced on arrays."""

    divides: Callable  # divides(a, b): b divides a
    equal: Callable
    all: Callable  # all(*conditions)
    any: Callable
    where: Callable  # where(condition, a, b)
    clip: Callable  # clip(x, lo, hi)


def _traced_divides(a, b):
    q = a / b
    return jnp.abs(q - jnp.round(q)) < DIVISIBILITY_TOL * jnp.maximum(1.0, q)


def _traced_equal(a, b):
    return jnp.abs(a - b) < DIVISIBILITY_TOL * jnp.maximum(1.0, jnp.abs(b))


EXACT = Ops(
    divides=lambda a, b: a % b == 0,
    equal=operator.eq,
    all=lambda *xs: all(xs),
    any=lambda *xs: any(xs),
    where=lambda c, a, b: a if c else b,
    clip=lambda x, lo, hi: min(max(x, lo), hi),
)
TRACED = Ops(
    divides=_traced_divides,
    equal=_traced_equal,
    all=lambda *xs: functools.reduce(jnp.logical_and, xs),
    any=lambda *xs: functools.reduce(jnp.logical_or, xs),
    where=jnp.where,
    clip=jnp.clip,
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One plan constraint (see the module docstring)."""

    name: str
    reads: frozenset[str]
    test: Callable[[Quantities, Ops], Any]
    explain: Callable[[Quantities, ModelSpec, ClusterSpec], str]
    strict: bool = False  # skipped by ``problems(strict=False)``
    requires: tuple[str, ...] = ()  # its message is left out while one of these rules fails
    ratio: Callable[[Quantities], Any] | None = None  # must be an integer (relaxed: sin^2)
    excess: Callable[[Quantities], Any] | None = None  # log2 excess, must be <= 0 (relaxed)


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def join(values: Iterable[Any]) -> str:
    """``"1, 2, 4"``: values for a message."""
    return ", ".join(str(v) for v in values)


def off_integer(x):
    """``sin^2(pi x)``: 0 exactly where ``x`` is an integer, smooth, at most 1."""
    return jnp.sin(jnp.pi * x) ** 2


def context_chunks(cp, ops: Ops = EXACT):
    """Chunks context parallelism cuts the sequence into: 1 for cp = 1, else 2 * cp.

    Megatron-Core (with Transformer Engine) gives each of the cp ranks two of 2 * cp chunks,
    one from each end of the causal sequence, so that every rank has the same attention work;
    without context parallelism the sequence is not cut.
    """
    return cp * (1 + ops.clip(cp - 1, 0, 1))


def _gcd_traced(a, b):
    """gcd of two integer-valued float arrays, as their float type."""
    gcd = jnp.gcd(jnp.round(a).astype(int), jnp.round(b).astype(int))
    return gcd.astype(jnp.result_type(a))


# ------------------------------------------------------------------------------------------
# Messages (what ``config.check_plan`` reports), one per rule
# ------------------------------------------------------------------------------------------


def _gpus_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    tp, cp, dp, pp, gpus = (q[k] for k in ("tp", "cp", "dp", "pp", "gpus"))
    message = f"dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} = {q['n_gpus']} does not equal gpus={gpus}"
    others = tp * pp * cp
    if gpus % others == 0:
        message += f"; dp={gpus // others} would match"
    return message


def _nodes_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    per_node = q["gpus_per_node"]
    return (
        f"dp*tp*pp*cp = {q['n_gpus']} GPUs do not fit whole nodes of gpus_per_node={per_node} "
        f"(cluster {cluster.name!r}): use a multiple of {per_node} or one of "
        f"{join(divisors(per_node))}"
    )


def _heads_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    heads, kv_heads, tp = q["heads"], q["kv_heads"], q["tp"]
    field, value = ("heads", heads) if heads % tp else ("kv_heads", kv_heads)
    return (
        f"{field}={value} is not divisible by tp={tp}; valid tp values dividing both "
        f"heads={heads} and kv_heads={kv_heads}: {join(divisors(math.gcd(heads, kv_heads)))}"
    )


def _layers_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    n_layers, pp, chunks = (q[k] for k in ("n_layers", "pp", "chunks"))
    valid = join(d // chunks for d in divisors(n_layers) if d % chunks == 0)
    what = f"n_layers={n_layers}"
    if n_layers != model.n_layers:  # split_edges: the embedding and the loss take a place each
        what = f"n_layers + 2 = {model.n_layers} + 2 = {n_layers} (split_edges)"
    return (
        f"{what} is not divisible by pp*chunks = {pp}*{chunks} = {pp * chunks}; "
        f"valid pp values for chunks={chunks}: {valid or 'none (chunks must divide n_layers)'}"
    )


def _interleave_stages_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    pp = q["pp"]
    return f"schedule='interleaved' needs at least 2 pipeline stages, not pp={pp}; use 1f1b"


def _batch_min_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    dp, mb, gb = q["dp"], q["microbatch"], q["global_batch"]
    return (
        f"global_batch={gb} is smaller than dp*microbatch = {dp}*{mb} = {dp * mb}: fewer than "
        f"one microbatch per data-parallel rank; use global_batch >= {dp * mb} or a smaller "
        "microbatch"
    )


def _batch_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    dp, mb, gb = q["dp"], q["microbatch"], q["global_batch"]
    per_step = dp * mb
    lower = gb // per_step * per_step
    return (
        f"global_batch={gb} is not divisible by dp*microbatch = {dp}*{mb} = {per_step}: the "
        f"number of microbatches would be fractional ({q['n_microbatches']:g}); nearest valid "
        f"global_batch: {lower} or {lower + per_step}"
    )


def _interleave_batch_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    step = q["dp"] * q["microbatch"] * q["pp"]
    lower = q["global_batch"] // step * step
    nearest = f"{lower} or {lower + step}" if lower else f"{step}"
    return (
        f"schedule='interleaved' needs the number of microbatches "
        f"({q['n_microbatches']:g}) to be a multiple of pp={q['pp']}: the interleaved schedule "
        f"runs them in groups of pp; nearest valid global_batch: {nearest}"
    )


def _ep_dp_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    dp, experts = q["dp"], q["experts"]
    valid = join(d for d in divisors(dp) if experts % d == 0)
    return f"ep={q['ep']} does not divide dp={dp}; valid ep values: {valid}"


def _ep_experts_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    if model.moe is None:
        return (
            f"ep={q['ep']} needs a mixture-of-experts model, but model {model.name!r} has no "
            "moe; use ep=1 or add moe: {experts: N, top_k: K}"
        )
    return (
        f"moe.experts={q['experts']} is not divisible by ep={q['ep']}; valid ep values: "
        f"{join(divisors(q['experts']))}"
    )


def _context_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    seq_len, cp = q["seq_len"], q["cp"]
    valid = join([1] + [d // 2 for d in divisors(seq_len) if d % 2 == 0 and d > 2])
    return (
        f"seq_len={seq_len} is not divisible by 2*cp = {2 * cp}: context parallelism "
        f"splits the sequence into 2*cp chunks for load balancing; valid cp values: {valid}"
    )


def _precision_message(q: Quantities, model: ModelSpec, cluster: ClusterSpec) -> str:
    return (
        f"precision={model.precision!r} has no peak on GPU {cluster.gpu.name!r} of cluster "
        f"{cluster.name!r} (gpu.peak_tflops); this GPU has: "
        f"{join(sorted(cluster.gpu.peak_tflops))}"
    )


# ------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------


def _rule(name: str, reads: str, test, explain, **kw) -> Rule:
    return Rule(name, frozenset(reads.split()), test, explain, **kw)


RULES: tuple[Rule, ...] = (
    _rule(
        "gpus", "n_gpus gpus",
        lambda q, o: o.equal(q["n_gpus"], q["gpus"]),
        _gpus_message,
    ),
    _rule(
        "nodes", "n_gpus gpus_per_node",  # whole nodes, or a part of one
        lambda q, o: o.any(
            o.divides(q["n_gpus"], q["gpus_per_node"]), o.divides(q["gpus_per_node"], q["n_gpus"])
        ),
        _nodes_message,
        strict=True,  # published runs: 256 GPUs on 72-GPU NVL72 racks
    ),
    _rule(
        "heads", "heads kv_heads tp",
        lambda q, o: o.all(o.divides(q["heads"], q["tp"]), o.divides(q["kv_heads"], q["tp"])),
        _heads_message,
        ratio=lambda q: _gcd_traced(q["heads"], q["kv_heads"]) / q["tp"],
    ),
    _rule(
        "layers", "n_layers pp chunks",
        lambda q, o: o.divides(q["n_layers"], q["pp"] * q["chunks"]),
        _layers_message,
        strict=True,  # published runs give the first and last stages fewer layers
        ratio=lambda q: q["n_layers"] / q["pp"],  # the chunks: by the excess below
        excess=lambda q: (
            jnp.log2(q["pp"]) + jnp.log2(q["chunks"]) * q["interleaved"] - jnp.log2(q["n_layers"])
        ),
    ),
    _rule(
        "interleave_stages", "interleaved pp",
        lambda q, o: o.any(q["interleaved"] < 0.5, q["pp"] >= 2),
        _interleave_stages_message,
    ),
    _rule(
        "batch_min", "global_batch dp microbatch",
        lambda q, o: q["global_batch"] >= q["dp"] * q["microbatch"],
        _batch_min_message,
        excess=lambda q: jnp.log2(q["dp"] * q["microbatch"]) - jnp.log2(q["global_batch"]),
    ),
    _rule(
        "batch", "global_batch dp microbatch",
        lambda q, o: o.divides(q["global_batch"], q["dp"] * q["microbatch"]),
        _batch_message,
        strict=True,  # published runs with a fractional microbatch count
        requires=("batch_min",),
        ratio=lambda q: q["global_batch"] / (q["dp"] * q["microbatch"]),
    ),
    _rule(
        "interleave_batch", "n_microbatches interleaved pp",
        lambda q, o: o.divides(q["n_microbatches"], o.where(q["interleaved"] > 0.5, q["pp"], 1)),
        _interleave_batch_message,
        strict=True,
        requires=("batch_min", "batch"),
    ),
    _rule(
        "ep_dp", "ep dp",
        lambda q, o: o.divides(q["dp"], q["ep"]),
        _ep_dp_message,
    ),
    _rule(
        "ep_experts", "ep experts",
        lambda q, o: o.divides(q["experts"], q["ep"]),
        _ep_experts_message,
    ),
    _rule(
        "context", "seq_len cp",
        lambda q, o: o.divides(q["seq_len"], context_chunks(q["cp"], o)),
        _context_message,
    ),
    _rule(
        "precision", "peak_flops",
        lambda q, o: q["peak_flops"] > 0,
        _precision_message,
    ),
)  # fmt: skip


# ------------------------------------------------------------------------------------------
# The quantities, from a request, from specs, from arrays
# ------------------------------------------------------------------------------------------


def request_quantities(
    model: ModelSpec, cluster: ClusterSpec, gpus: int, global_batch: int
) -> dict[str, Any]:
    """The quantities a model, a cluster, a GPU count and a global batch fix (no plan yet).

    Args:
        model: the model.
        cluster: the cluster.
        gpus: the GPU count asked for (every plan's ``n_gpus`` must equal it).
        global_batch: sequences per iteration.

    Returns:
        A dict of integers (see the module docstring for the keys).
    """
    return {
        "heads": model.heads,
        "kv_heads": model.kv_heads,
        "n_layers": model.n_layers,
        "seq_len": model.seq_len,
        "experts": model.moe.experts if model.moe else 1,
        "peak_flops": cluster.gpu.peak_tflops.get(model.precision, 0.0),
        "gpus": gpus,
        "n_gpus": gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "global_batch": global_batch,
    }


def spec_quantities(
    model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, n_gpus: int | None = None
) -> dict[str, Any]:
    """Every quantity of a plan spec (``n_gpus``: the GPU count asked for, if any).

    Args:
        model: the model.
        cluster: the cluster.
        plan: the plan.
        n_gpus: the GPU count the plan must use; None: whatever it uses.

    Returns:
        A dict of integers (``n_microbatches`` a float when fractional).
    """
    gpus = plan.n_gpus if n_gpus is None else n_gpus
    q = request_quantities(model, cluster, gpus, plan.global_batch)
    q.update({k: getattr(plan, k) for k in (*PLACED_DIMS, "ep", "microbatch", "chunks")})
    q.update(
        interleaved=int(plan.schedule == "interleaved"),
        n_microbatches=plan.n_microbatches,
        n_gpus=plan.n_gpus,
    )
    if plan.split_edges and plan.pp > 1:  # the places the pipeline split divides
        q["n_layers"] = pipeline_places(model.n_layers)
    return q


def array_quantities(model, plan, cluster) -> dict[str, Any]:
    """Every quantity of one plan's arrays (``diffcost.arrays``), as traced values.

    Args:
        model: ``ModelArrays`` of one model.
        plan: ``PlanArrays`` of one plan (discrete or relaxed).
        cluster: ``ClusterArrays`` of one cluster.

    Returns:
        A dict of scalar arrays; ``gpus`` is the plan's own GPU count.
    """
    return {
        "heads": model.heads,
        "kv_heads": model.kv_heads,
        "n_layers": model.n_layers,
        "seq_len": model.seq_len,
        "experts": model.experts,
        "peak_flops": jnp.sum(model.precision * cluster.peak_flops),
        "tp": plan.tp,
        "cp": plan.cp,
        "dp": plan.dp,
        "pp": plan.pp,
        "ep": plan.ep,
        "microbatch": plan.microbatch,
        "global_batch": plan.global_batch,
        "chunks": plan.chunks,
        "interleaved": plan.schedule[_INTERLEAVED],
        "n_microbatches": plan.n_microbatches,
        "n_gpus": plan.n_gpus,
        "gpus": plan.n_gpus,
        "gpus_per_node": cluster.gpus_per_node,
    }


# ------------------------------------------------------------------------------------------
# The four evaluations
# ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _decidable(known: frozenset[str], new: frozenset[str] | None, strict: bool):
    """The rules that read only ``known`` quantities (and one of ``new``, when given)."""
    return tuple(
        r
        for r in RULES
        if r.reads <= known and (new is None or r.reads & new) and (strict or not r.strict)
    )


def holds(q: Quantities, new: Iterable[str] | None = None) -> bool:
    """True when ``q`` satisfies every rule it can decide (exact integer arithmetic).

    Args:
        q: some of the quantities (integers); a rule reading one that is missing is not
            evaluated, so a partial plan is checked as far as it goes.
        new: when given, only the rules that read one of these keys (those a caller that
            extends a checked partial plan has not evaluated yet).

    Returns:
        Whether every such rule holds (strict: every rule applies).

    Examples:
        >>> holds({"heads": 12, "kv_heads": 4, "tp": 4}), holds({"seq_len": 12, "cp": 4})
        (True, False)
    """
    rules = _decidable(frozenset(q), None if new is None else frozenset(new), True)
    return all(r.test(q, EXACT) for r in rules)


def _messages(q: Quantities, model: ModelSpec, cluster: ClusterSpec, strict: bool) -> list[str]:
    failed = [r for r in _decidable(frozenset(q), None, strict) if not r.test(q, EXACT)]
    names = {r.name for r in failed}
    return [r.explain(q, model, cluster) for r in failed if not names.intersection(r.requires)]


def problems(
    model: ModelSpec,
    cluster: ClusterSpec,
    plan: PlanSpec,
    n_gpus: int | None = None,
    strict: bool = True,
) -> list[str]:
    """Cross-check a plan against a model and a cluster: one message per rule it breaks.

    ``config.check_plan`` is this function. The messages come in table order.

    Args:
        model: the model.
        cluster: the cluster.
        plan: the plan.
        n_gpus: when given, dp*tp*pp*cp must equal it.
        strict: when False, skip the checks that published runs may violate (the rules marked
            ``strict``): ``n_layers`` divisible by ``pp*chunks`` (uneven first/last stages),
            ``global_batch`` divisible by ``dp*microbatch`` (and, interleaved, by
            ``dp*microbatch*pp``), and the GPU count filling whole nodes (e.g. 256 GPUs on
            72-GPU NVL72 racks).

    Returns:
        The messages; empty when the plan satisfies every rule. A rule's message is left out
        while a rule it ``requires`` fails.

    Examples:
        >>> from diffcost.specs import GpuSpec
        >>> m = ModelSpec("m", 4, 64, 256, 4, 4, 128, 1000)
        >>> c = ClusterSpec("c", GpuSpec("g", {"bf16": 1.0}, 1.0, 1.0), 8, 1.0, 0.0, 1, 1.0, 0.0)
        >>> problems(m, c, PlanSpec(tp=8, dp=1), n_gpus=8)
        ['heads=4 is not divisible by tp=8; valid tp values dividing both heads=4 and kv_heads=4: 1, 2, 4']
    """  # noqa: E501
    return _messages(spec_quantities(model, cluster, plan, n_gpus), model, cluster, strict)


def request_problems(
    model: ModelSpec, cluster: ClusterSpec, gpus: int, global_batch: int
) -> list[str]:
    """The messages of the rules a request breaks before any plan is chosen (GPUs that do
    not fill whole nodes, a precision the GPU lacks).

    Args:
        model: the model.
        cluster: the cluster.
        gpus: the GPU count.
        global_batch: sequences per iteration.

    Returns:
        One message per broken rule that reads only these quantities.
    """
    q = request_quantities(model, cluster, gpus, global_batch)
    return _messages(q, model, cluster, strict=True)


# Rules the validity mask leaves out: a job on part of a node or rack (128 GPUs of 72-GPU NVL72
# racks) runs and is predicted like any other; only the plan space keeps to whole nodes.
MASK_SKIPS = ("nodes",)


def is_valid(model, plan, cluster):
    """Whether one plan's arrays satisfy every rule but ``MASK_SKIPS``, as a traced boolean.

    Args:
        model: ``ModelArrays``; plan: ``PlanArrays`` (one plan); cluster: ``ClusterArrays``.

    Returns:
        A boolean scalar array: True exactly where ``problems(..., strict=True)`` reports
        nothing but ``MASK_SKIPS`` rules for the same discrete plan (degrees divide within
        ``DIVISIBILITY_TOL``).
    """
    q = array_quantities(model, plan, cluster)
    return TRACED.all(*(r.test(q, TRACED) for r in RULES if r.name not in MASK_SKIPS))


def relaxed_penalties(model, plan, cluster):
    """Smooth penalties that push a relaxed plan towards the rules.

    Args:
        model: ``ModelArrays``; plan: relaxed ``PlanArrays`` (one plan); cluster:
            ``ClusterArrays``.

    Returns:
        ``(divisibility, excess)``: the sum of ``off_integer`` of every rule's ``ratio``
        (0 on a plan that satisfies them), and the stacked ``excess`` terms (log2; a plan
        satisfies them where each is <= 0).
    """
    q = array_quantities(model, plan, cluster)
    ratios = [off_integer(r.ratio(q)) for r in RULES if r.ratio is not None]
    divisibility = functools.reduce(operator.add, ratios)
    excess = jnp.stack([r.excess(q) for r in RULES if r.excess is not None])
    return divisibility, excess
