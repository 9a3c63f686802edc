"""Plan search: gradient descent over relaxed plans, rounding, and a discrete local search.

``optimize`` finds a fast plan that fits in memory without enumerating the space:

1. **Relaxed descent.** A ``RelaxedPlan`` makes every choice continuous: the parallel degrees
   are ``2 ** (share * log2(n_gpus))`` with ``share`` on a simplex over (tp, cp, dp, pp), so
   their product is the GPU count by construction; the microbatch size, the expert-parallel
   degree and the interleaving depth live in log space between their bounds; the schedule,
   ZeRO stage, recompute mode and rank order are softmax mixtures whose temperature anneals
   from 1 to ``tau_end``. The objective is ``log(iteration time)`` plus smooth penalties: memory
   over capacity, degrees past their largest valid value, the plan rules' log2 excesses
   (``constraints.relaxed_penalties``: more virtual stages than layers, fewer sequences than
   dp * microbatch) and, ramped in over the second half, their ``sin^2`` divisibility terms
   (heads / tp, layers / pp, global batch / (dp * microbatch)). Many random starts descend at
   once (``jax.vmap``) under one ``jax.lax.scan`` of optax Adam steps, in one jit-compiled
   call.
2. **Rounding.** Each start's relaxed plan is rounded to nearby valid discrete plans: the
   ``neighbours`` valid degree tuples nearest in log2 space, the two nearest valid microbatch
   sizes, and the two most probable schedules, recompute modes and ZeRO stages.
   They are evaluated exactly (the same ``simulate`` that ``predict`` runs, batched).
3. **Polish.** A discrete local search from the best few: every plan one move away (one prime
   factor moved between two degrees; another microbatch size, schedule, interleaving depth,
   recompute mode, ZeRO stage, rank order or expert-parallel degree) is evaluated in one batch,
   and each walker moves to its best neighbour while that improves.

Plans that do not fit in memory (or are invalid) rank after every plan that fits; among them
the one with the smallest peak memory is kept, so a request where nothing fits reports how
close it got. Every returned plan passes ``config.check_plan``.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import constraints, descent, smooth
from diffcost.arrays import PlanArrays, cluster_arrays, lora_leaves, model_arrays
from diffcost.cache import fast_compile_jit
from diffcost.config import check_plan
from diffcost.params import Params
from diffcost.profiles import params_for
from diffcost.simulate import STATUS_OK, simulate
from diffcost.space import Choice, Space
from diffcost.specs import PLACED_DIMS, RECOMPUTE_MODES, SCHEDULES, ZERO_STAGES
from diffcost.sweep import evaluate as evaluate_plans

# index of each degree in the share vector and in a degree tuple (both in PLACED_DIMS order)
_TP, _CP, _DP, _PP = (PLACED_DIMS.index(d) for d in ("tp", "cp", "dp", "pp"))


@struct.dataclass
class RelaxedPlan:
    """Unconstrained variables of a relaxed plan (see the module docstring)."""

    shares: jax.Array  # [4] logits of the log2 shares of the degrees (PLACED_DIMS order)
    microbatch: jax.Array  # logit of log2(microbatch) between 0 and its bound
    ep: jax.Array  # logit of log2(ep) between 0 and min(log2 dp, log2 experts)
    chunks: jax.Array  # logit of log2(chunks) between 0 and log2(largest chunks)
    schedule: jax.Array  # [3] logits: gpipe, 1f1b, interleaved
    zero: jax.Array  # [4] logits: ZeRO stage 0..3
    recompute: jax.Array  # [3] logits: none, selective, full
    order: jax.Array  # [n_orders] logits of the space's rank orders


@struct.dataclass
class Bounds:
    """The space's numbers that the relaxed objective needs, as arrays (traced, not static)."""

    log2_gpus: jax.Array
    log2_max: jax.Array  # [4] log2 of the largest valid degree (PLACED_DIMS order)
    log2_mb_max: jax.Array
    log2_experts: jax.Array
    log2_chunks_max: jax.Array
    global_batch: jax.Array
    sequence_parallel: jax.Array
    overlap_dp: jax.Array
    overlap_tp: jax.Array
    grad_reduce_fp32: jax.Array
    gather_layer: jax.Array
    order_ranks: jax.Array  # [n_orders, 4]
    lora: dict  # the plan's fixed LoRA leaves (``arrays.lora_leaves``)


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """Knobs of ``optimize`` (defaults measured on benchmarks/search.py)."""

    starts: int = 32
    steps: int = 150
    learning_rate: float = 0.1
    tau_start: float = 1.0  # softmax temperature of the categorical choices, annealed
    tau_end: float = 0.05
    memory_weight: float = 10.0
    bound_weight: float = 10.0
    divisibility_weight: float = 0.1
    neighbours: int = 10  # valid degree tuples tried per start when rounding
    walkers: int = 12  # best rounded plans the local search starts from
    max_rounds: int = 30
    seed: int = 0

    def __post_init__(self):
        for name in ("starts", "steps", "neighbours", "walkers", "max_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SearchConfig.{name}={value!r}: must be an integer >= 1")
        if not 0 < self.tau_end <= self.tau_start:
            raise ValueError(
                f"SearchConfig temperatures tau_start={self.tau_start}, tau_end={self.tau_end}: "
                "need 0 < tau_end <= tau_start"
            )


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One evaluated discrete plan."""

    choice: Choice
    iteration_s: float
    memory_peak_bytes: float
    status: int

    @property
    def fits(self) -> bool:
        return self.status == STATUS_OK


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What ``optimize`` found. ``best`` is empty when nothing fits (see ``closest``)."""

    space: Space
    best: list[Candidate]  # fitting plans, fastest first (at most ``top``)
    closest: Candidate  # the plan with the smallest peak memory seen (useful when none fits)
    rounded_best: Candidate | None  # the best plan straight after rounding, before the polish
    evaluated: int  # distinct discrete plans evaluated exactly
    descent_s: float
    rounding_s: float
    polish_s: float
    seconds: float
    rounds: int


# ------------------------------------------------------------------------------------------
# Relaxed descent
# ------------------------------------------------------------------------------------------


def bounds_for(space: Space, dtype=None) -> Bounds:
    """The arrays of ``space`` that the relaxed objective reads."""
    f = lambda v: np.asarray(v, dtype=dtype or jnp.result_type(float))  # noqa: E731
    m = space.model
    largest = np.array(space.degree_tuples(), dtype=float).max(axis=0)
    experts = m.moe.experts if m.moe else 1
    ranks = [[o.index(d) for d in PLACED_DIMS] for o in space.orders]
    return Bounds(
        log2_gpus=f(math.log2(space.n_gpus)),
        log2_max=f(np.log2(largest)),
        log2_mb_max=f(math.log2(max(space.microbatches))),
        log2_experts=f(math.log2(experts)),
        log2_chunks_max=f(math.log2(max(space.chunks))),
        global_batch=f(space.global_batch),
        sequence_parallel=f(float(space.sequence_parallel)),
        overlap_dp=f(float(space.overlap_dp)),
        overlap_tp=f(float(space.overlap_tp)),
        grad_reduce_fp32=f(float(space.grad_reduce_fp32)),
        gather_layer=f(float(space.param_gather == "layer")),
        order_ranks=f(ranks),
        lora=lora_leaves(space.lora_rank, space.lora_modules, f),
    )


def log2_degrees(r: RelaxedPlan, b: Bounds):
    """log2 of the degrees (PLACED_DIMS order): shares of log2(n_gpus) on the simplex."""
    return jax.nn.softmax(r.shares) * b.log2_gpus


def decode(r: RelaxedPlan, b: Bounds, tau) -> PlanArrays:
    """The relaxed ``PlanArrays`` of ``r`` (categoricals at softmax temperature ``tau``).

    The rank order is the probability-weighted mixture of the orders' rank vectors (see
    ``simulate._strides`` for how mixed ranks place the dimensions).
    """
    lg = log2_degrees(r, b)
    tp, cp, dp, pp = (2.0 ** lg[i] for i in (_TP, _CP, _DP, _PP))
    lg_mb_room = smooth.clip_exact(jnp.log2(b.global_batch) - lg[_DP], 0.0, b.log2_mb_max)
    mb = 2.0 ** (jax.nn.sigmoid(r.microbatch) * lg_mb_room)
    ep = 2.0 ** (jax.nn.sigmoid(r.ep) * jnp.minimum(lg[_DP], b.log2_experts))
    chunks = 2.0 ** (jax.nn.sigmoid(r.chunks) * b.log2_chunks_max)
    return PlanArrays(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=ep,
        microbatch=mb,
        global_batch=b.global_batch,
        chunks=chunks,
        split_edges=jnp.zeros_like(b.global_batch),  # the plain split of the layers
        sp=b.sequence_parallel * smooth.clip_exact(tp - 1.0, 0.0, 1.0),
        overlap_dp=b.overlap_dp,
        overlap_tp=b.overlap_tp,
        grad_reduce_fp32=b.grad_reduce_fp32,
        zero=jax.nn.softmax(r.zero / tau),
        gather_layer=b.gather_layer,
        recompute=jax.nn.softmax(r.recompute / tau),
        offload=jnp.zeros_like(b.global_batch),  # activations stay on the GPU
        schedule=jax.nn.softmax(r.schedule / tau),
        order=jax.nn.softmax(r.order / tau) @ b.order_ranks,
        **b.lora,
    )


def objective(r: RelaxedPlan, model, cluster, params: Params, b: Bounds, tau, w_div, cfg_w):
    """log(iteration time) + penalties of one relaxed plan (a scalar; see module docstring)."""
    w_mem, w_bound = cfg_w
    plan = decode(r, b, tau)
    out = simulate(model, plan, cluster, params)
    excess = out.memory_excess_bytes / out.memory_capacity_bytes
    divis, rule_excess = constraints.relaxed_penalties(model, plan, cluster)
    over = jnp.concatenate(
        [
            jax.nn.relu(log2_degrees(r, b) - b.log2_max),  # a degree past its largest valid value
            jax.nn.relu(rule_excess),
        ]
    )
    return (
        jnp.log(out.iteration_s)
        + w_mem * (excess + excess**2)
        + w_bound * jnp.sum(over**2)
        + w_div * divis
    )


def random_starts(key, n: int, n_orders: int, dtype=None) -> RelaxedPlan:
    """``n`` random relaxed plans (a batched RelaxedPlan)."""
    dtype = dtype or jnp.result_type(float)
    k = jax.random.split(key, 8)
    normal = lambda i, *shape: jax.random.normal(k[i], (n, *shape), dtype)  # noqa: E731
    return RelaxedPlan(
        shares=normal(0, 4),
        microbatch=normal(1),
        ep=normal(2),
        chunks=normal(3),
        schedule=0.5 * normal(4, 3),
        zero=0.5 * normal(5, 4),
        recompute=0.5 * normal(6, 3),
        order=0.5 * normal(7, n_orders),
    )


def _descend(starts, model, cluster, params, bounds, steps, lr, taus, weights):
    """Adam on every start at once; returns (final relaxed plans, final objectives).

    One ``lax.scan`` of ``steps`` optax steps, ``vmap``-ed over the starts: one compiled
    program (its size does not grow with ``steps`` or the number of starts).
    """
    w_mem, w_bound, w_div = weights
    tau_k = descent.geometric(*taus, steps)
    wdiv_k = w_div * jnp.clip(2.0 * descent.ramp(steps) - 1.0, 0.0, 1.0)

    def loss(r, tau, wd):
        return objective(r, model, cluster, params, bounds, tau, wd, (w_mem, w_bound))

    opt = descent.adam(lr, steps)

    def one(r0):
        r, values = descent.descend(loss, r0, opt, (tau_k, wdiv_k), finite_only=True)
        return r, values[-1]

    return jax.vmap(one)(starts)


descend = fast_compile_jit(_descend, static_argnames=("steps", "lr", "taus", "weights"))


# ------------------------------------------------------------------------------------------
# Exact evaluation of discrete candidates
# ------------------------------------------------------------------------------------------


class Evaluator:
    """Exact, cached evaluation of discrete plans: ``sweep.evaluate`` on batches padded to a
    few bucket sizes, every plan leaf batched (so a search compiles at most one program per
    bucket, whichever leaves its batches vary)."""

    BUCKETS = (64, 256, 1024, 4096)

    def __init__(self, space: Space, params: Params):
        self.space = space
        self.params = params
        self.cache: dict[Choice, Candidate] = {}

    def __call__(self, choices) -> list[Candidate]:
        todo = list(dict.fromkeys(c for c in choices if c not in self.cache))
        big = self.BUCKETS[-1]
        for i in range(0, len(todo), big):
            part = todo[i : i + big]
            size = next(b for b in self.BUCKETS if b >= len(part))
            padded = part + [part[-1]] * (size - len(part))
            plans = self.space.to_arrays(padded)
            out = evaluate_plans(self.space, plans, self.params, chunk=size, hoist_constants=False)
            for j, c in enumerate(part):
                self.cache[c] = Candidate(
                    c,
                    float(out.iteration_s[j]),
                    float(out.memory_peak_bytes[j]),
                    int(out.status[j]),
                )
        return [self.cache[c] for c in choices]


def rank_key(c: Candidate):
    """Fitting plans by time, then everything else by peak memory."""
    return (0, c.iteration_s) if c.fits else (1, c.memory_peak_bytes)


# ------------------------------------------------------------------------------------------
# Rounding and local search
# ------------------------------------------------------------------------------------------


class _Moves:
    """Valid values of each choice in a space, and the discrete neighbourhood of a plan."""

    def __init__(self, space: Space):
        self.space = space
        self.tuples = space.degree_tuples()  # (tp, cp, dp, pp)
        self.log_tuples = np.log2(np.array(self.tuples, dtype=float))
        # one prime factor moved between two degrees: L1 distance in log2 of 2 log2(prime)
        near = np.abs(self.log_tuples[:, None, :] - self.log_tuples[None, :, :]).sum(-1)
        self.adjacent = [np.nonzero((d > 0) & (d <= 2 * math.log2(3) + 1e-9))[0] for d in near]
        self.index = {t: i for i, t in enumerate(self.tuples)}

    def microbatches(self, dp):
        return self.space.microbatch_choices(dp)

    def complete(self, deg, mb_log2, ep_log2, sched_pref, chunks_log2, rec, zero, order):
        """The valid Choice on degree tuple ``deg`` closest to the given preferences."""
        tp, cp, dp, pp = deg
        mbs = self.microbatches(dp)
        if not mbs:
            return None
        mb = min(mbs, key=lambda v: abs(math.log2(v) - mb_log2))
        eps = self.space.ep_choices(dp)
        ep = min(eps, key=lambda v: abs(math.log2(v) - ep_log2))
        options = self.space.schedules(pp, self.space.global_batch // (dp * mb))
        sched, v = self._schedule(options, sched_pref, chunks_log2)
        return self.space.canonical(Choice(tp, cp, dp, pp, ep, mb, sched, v, rec, zero, order))

    @staticmethod
    def _schedule(options, preference, chunks_log2):
        for name in preference:
            matching = [o for o in options if o[0] == name]
            if matching:
                return min(matching, key=lambda o: abs(math.log2(o[1]) - chunks_log2))
        return options[0]

    def neighbours(self, c: Choice) -> list[Choice]:
        s = self.space
        out = []
        i = self.index[(c.tp, c.cp, c.dp, c.pp)]
        pref = (c.schedule, "1f1b", "gpipe")
        # a degree move shifts the best microbatch (cp and tp split a microbatch's tokens, dp
        # sets how many microbatches there are): each also tries the microbatch an octave up
        # and down, so a better plan two single moves away is not hidden behind a worse one
        for j in self.adjacent[i]:
            d = self.tuples[j]
            for shift in (0.0, -1.0, 1.0):
                n = self.complete(
                    d, math.log2(c.microbatch) + shift, math.log2(c.ep), pref,
                    math.log2(c.chunks), c.recompute, c.zero, c.order,
                )  # fmt: skip
                if n is not None:
                    out.append(n)
        for mb in self.microbatches(c.dp):
            if mb != c.microbatch:
                n = self.complete(
                    (c.tp, c.cp, c.dp, c.pp), math.log2(mb), math.log2(c.ep), pref,
                    math.log2(c.chunks), c.recompute, c.zero, c.order,
                )  # fmt: skip
                out.append(n)
        n_micro = s.global_batch // (c.dp * c.microbatch)
        for sched, v in s.schedules(c.pp, n_micro):
            if (sched, v) != (c.schedule, c.chunks):
                out.append(c._replace(schedule=sched, chunks=v))
        out += [c._replace(recompute=r) for r in RECOMPUTE_MODES if r != c.recompute]
        out += [c._replace(zero=z) for z in ZERO_STAGES if z != c.zero]
        out += [c._replace(order=o) for o in s.distinct_orders(c._asdict()) if o != c.order]
        out += [c._replace(ep=e) for e in s.ep_choices(c.dp) if e != c.ep]
        out = (s.canonical(n) for n in out if n is not None)
        return list(dict.fromkeys(n for n in out if n != c))


def round_relaxed(moves: _Moves, relaxed: RelaxedPlan, bounds: Bounds, k: int) -> list[Choice]:
    """Nearby valid discrete plans of each relaxed start (a batched RelaxedPlan, numpy)."""
    r = jax.tree_util.tree_map(np.asarray, relaxed)
    b = jax.tree_util.tree_map(np.asarray, bounds)
    shares = np.exp(r.shares - r.shares.max(-1, keepdims=True))
    lg = shares / shares.sum(-1, keepdims=True) * b.log2_gpus  # PLACED_DIMS order, as tuples
    dist = np.abs(lg[:, None, :] - moves.log_tuples[None, :, :]).sum(-1)
    nearest = np.argsort(dist, axis=1)[:, :k]
    sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    out = []
    for s in range(lg.shape[0]):
        room = np.clip(np.log2(b.global_batch) - lg[s, _DP], 0.0, b.log2_mb_max)
        mb_log2 = sigmoid(r.microbatch[s]) * room
        ep_log2 = sigmoid(r.ep[s]) * min(lg[s, _DP], b.log2_experts)
        chunks_log2 = sigmoid(r.chunks[s]) * b.log2_chunks_max
        sched_pref = [SCHEDULES[i] for i in np.argsort(-r.schedule[s])]
        recs = [RECOMPUTE_MODES[i] for i in np.argsort(-r.recompute[s])[:2]]
        zeros = [ZERO_STAGES[i] for i in np.argsort(-r.zero[s])[:2]]
        order = int(np.argmax(r.order[s]))
        for j in nearest[s]:
            deg = moves.tuples[j]
            for mb_shift in (0.0, 1.0 if mb_log2 % 1.0 >= 0.5 else -1.0):
                for pref in (sched_pref, sched_pref[1:] + sched_pref[:1]):
                    for rec in recs:
                        for zero in zeros:
                            c = moves.complete(
                                deg, mb_log2 + mb_shift, ep_log2, pref, chunks_log2,
                                rec, zero, order,
                            )  # fmt: skip
                            if c is not None:
                                out.append(c)
    return list(dict.fromkeys(out))


def local_search(evaluate: Evaluator, moves: _Moves, seeds: list[Candidate], max_rounds: int):
    """Steepest descent over discrete neighbourhoods from every seed at once."""
    walkers = list(seeds)
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        nbrs = [moves.neighbours(w.choice) for w in walkers]
        scored = evaluate([n for ns in nbrs for n in ns])
        moved = False
        pos = 0
        for i, ns in enumerate(nbrs):
            mine = scored[pos : pos + len(ns)]
            pos += len(ns)
            if mine:
                best = min(mine, key=rank_key)
                if rank_key(best) < rank_key(walkers[i]):
                    walkers[i] = best
                    moved = True
        walkers = list({w.choice: w for w in walkers}.values())
        if not moved:
            break
    return walkers, rounds


# ------------------------------------------------------------------------------------------
# The entry point
# ------------------------------------------------------------------------------------------


def search(space: Space, params: Params, top: int = 5, cfg: SearchConfig | None = None):
    """Search ``space`` (see the module docstring); returns a ``SearchResult``."""
    cfg = cfg or SearchConfig()
    t0 = time.perf_counter()
    dtype = jnp.result_type(float)
    bounds = bounds_for(space, dtype)
    evaluate = Evaluator(space, params)
    model = jax.tree_util.tree_map(jnp.asarray, model_arrays(space.model, dtype))
    cluster = jax.tree_util.tree_map(
        jnp.asarray, cluster_arrays(space.cluster, dtype, space.n_gpus)
    )
    starts = random_starts(jax.random.PRNGKey(cfg.seed), cfg.starts, len(space.orders), dtype)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes its int32 step count in
        relaxed, _ = descend(
            starts,
            model,
            cluster,
            params,
            jax.tree_util.tree_map(jnp.asarray, bounds),
            steps=cfg.steps,
            lr=cfg.learning_rate,
            taus=(cfg.tau_start, cfg.tau_end),
            weights=(cfg.memory_weight, cfg.bound_weight, cfg.divisibility_weight),
        )
    relaxed = jax.device_get(relaxed)
    t1 = time.perf_counter()

    moves = _Moves(space)
    rounded = evaluate(round_relaxed(moves, relaxed, bounds, cfg.neighbours))
    rounded = sorted(rounded, key=rank_key)
    rounded_best = rounded[0] if rounded else None
    t2 = time.perf_counter()

    walkers, rounds = local_search(evaluate, moves, rounded[: cfg.walkers], cfg.max_rounds)
    t3 = time.perf_counter()

    seen = list(evaluate.cache.values())
    fitting = sorted((c for c in seen if c.fits), key=rank_key)[:top]
    closest = min(seen, key=lambda c: (c.status == 2, c.memory_peak_bytes))
    if not fitting:  # walk towards the smallest memory to report how close the request gets
        lean = sorted(seen, key=lambda c: (c.status == 2, c.memory_peak_bytes))[: cfg.walkers]
        _memory_descent(evaluate, moves, lean, cfg.max_rounds)
        seen = list(evaluate.cache.values())
        fitting = sorted((c for c in seen if c.fits), key=rank_key)[:top]
        closest = min(seen, key=lambda c: (c.status == 2, c.memory_peak_bytes))
    for c in fitting:
        problems = check_plan(space.model, space.cluster, space.plan_spec(c.choice), space.n_gpus)
        if problems:  # the space's rules and the config checks disagree: a bug, say so loudly
            raise AssertionError(f"search produced an invalid plan {c.choice}: {problems}")
    t4 = time.perf_counter()
    return SearchResult(
        space=space,
        best=fitting,
        closest=closest,
        rounded_best=rounded_best,
        evaluated=len(evaluate.cache),
        descent_s=t1 - t0,
        rounding_s=t2 - t1,
        polish_s=t3 - t2 + (t4 - t3),
        seconds=t4 - t0,
        rounds=rounds,
    )


def _memory_descent(evaluate, moves, seeds, max_rounds):
    """Local search on peak memory alone (valid plans only): how small can it get?"""
    walkers = list(seeds)
    key = lambda c: (c.status == 2, c.memory_peak_bytes)  # noqa: E731
    for _ in range(max_rounds):
        moved = False
        for i, w in enumerate(walkers):
            scored = evaluate(moves.neighbours(w.choice))
            if scored:
                best = min(scored, key=key)
                if key(best) < key(w):
                    walkers[i], moved = best, True
        if not moved:
            break
    return walkers


def optimize(
    model,
    cluster,
    gpus: int,
    global_batch: int,
    seq: int | None = None,
    profile=None,
    top: int = 5,
    config: SearchConfig | None = None,
    **menus,
) -> SearchResult:
    """Find fast plans for a model on a cluster without enumerating the space.

    Args:
        model, cluster: preset names or YAML paths (or ``ModelSpec`` / ``ClusterSpec``).
        gpus, global_batch: the request; ``seq`` overrides the model's sequence length.
        profile: calibrated constants: None for the cluster's default profile, ``"none"`` for
            datasheet defaults, or a profile file.
        top: how many fitting plans to return.
        config: search knobs (``SearchConfig``); ``menus``: ``Space`` menus (microbatches, ...).

    Returns:
        A ``SearchResult``; ``result.best[0]`` is the fastest fitting plan found, and
        ``result.space.plan_spec(result.best[0].choice)`` its ``PlanSpec``.

    Raises:
        ConfigError: unknown presets, or a request with no valid plan at all.
    """
    from diffcost import config as config_mod
    from diffcost import space as space_mod

    if isinstance(model, str):
        model = config_mod.load_model(model, {"seq_len": seq} if seq else None)
    elif seq:
        model = dataclasses.replace(model, seq_len=seq)
    if isinstance(cluster, str):
        cluster = config_mod.load_cluster(cluster)
    space = space_mod.make_space(model, cluster, gpus, global_batch, **menus)
    params = params_for(cluster, profile, jnp.result_type(float))[0]
    return search(space, params, top, config)
