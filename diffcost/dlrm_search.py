"""Embedding-table sharding search: gradient descent over relaxed per-table choices.

``search`` picks a sharding type and a placement for every table of a DLRM
(``diffcost.dlrm_cost``):

1. **Relaxed descent.** Each table's type is a softmax over ``SHARDING_TYPES`` and its
   placement a softmax over the ranks, both at a temperature annealed from ``tau_start`` to
   ``tau_end``; the objective is ``log(iteration time)`` (the maxima over ranks smoothed at
   ``temperature``; for a cluster that takes the population, the members' mean log time:
   ``dlrm_cost.plan_cost``, which the exact evaluation uses too) plus a smooth penalty on the
   relative memory excess of the fullest rank, and on every other start a ramped entropy term
   that makes each table commit to one type and one rank (``objective``). Many random starts
   descend at once (``jax.vmap`` over ``descent.descend``: optax Adam under one
   ``lax.scan``), in one jit-compiled call.
2. **Rounding.** Each start's most probable type and rank per table, and ``samples`` plans
   drawn from its probabilities (canonicalized: ``dlrm_cost.canonical``), evaluated exactly
   (temperature 0).
3. **Polish.** A discrete local search from the best rounded plans, and (``greedy_start``,
   the default) from the greedy plan as well, so the result is never slower than greedy's
   (``DlrmSearchResult.started_from`` says which start the best plan came from, ``gradient``
   is the best plan of the rounded starts alone): every plan that changes one table's choice
   (another type at its rank, or its type at another rank) or swaps two tables' placement
   ranks is evaluated in one batch, and each walker moves to its best neighbour while that
   improves; where no single move improves and the problem is small enough (at most
   ``pair_limit`` of them), moves of two tables at once are tried as well.

Plans that do not fit in memory rank after every plan that fits (by peak memory among
themselves). Two baselines: ``greedy`` (TorchRec-planner-like: tables sorted by cost, each
given the choice that makes the partial plan fastest, i.e. the least-loaded rank and the
cheapest type that fits) and ``exhaustive`` (every combination; small cases only).

References:
    TorchRec's planner (``EmbeddingShardingPlanner``: enumerator, greedy proposer and
    partitioner), pytorch/torchrec; Lin et al. (HiPC 2022) pick shardings with their model.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import descent, smooth
from diffcost.dlrm import DlrmSpec, TableSpec
from diffcost.dlrm_cost import (
    SHARDING_TYPES,
    TW,
    ShardingPlan,
    ShardingProblem,
    TableChoice,
    canonical,
    options,
    plan_cost,
    table_costs,
)

EVAL_CHUNK = 2048  # plans per exact evaluation call (one compiled shape per problem)


@dataclasses.dataclass(frozen=True)
class DlrmSearchConfig:
    """Knobs of ``search`` (hashable: one compilation per configuration and problem shape)."""

    starts: int = 32
    steps: int = 200
    learning_rate: float = 0.1
    tau_start: float = 1.0
    tau_end: float = 0.05
    temperature: float = 1e-2  # softness of the maxima over ranks during descent
    memory_weight: float = 10.0
    commit_weight: float = 0.1  # entropy weight at the last step (ramped; every other start)
    samples: int = 8  # plans drawn from each start's final probabilities when rounding
    sample_tau: float = 1.0  # their softmax temperature
    walkers: int = 8
    max_rounds: int = 50
    pair_limit: int = 5000  # two-table moves per walker tried when single moves stop improving
    greedy_start: bool = True  # polish the greedy plan too (never worse than greedy then)
    seed: int = 0

    def __post_init__(self):
        for name in ("starts", "steps", "walkers", "max_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DlrmSearchConfig.{name}={value!r}: must be an integer >= 1")
        if not 0 < self.tau_end <= self.tau_start:
            raise ValueError(
                f"DlrmSearchConfig tau_start={self.tau_start}, tau_end={self.tau_end}: "
                "need 0 < tau_end <= tau_start"
            )


@dataclasses.dataclass(frozen=True)
class Scored:
    """One discrete plan, evaluated exactly."""

    choices: tuple[TableChoice, ...]
    iteration_s: float
    memory_peak_bytes: float
    fits: bool

    def key(self):
        """Fitting plans by time, then the rest by peak memory."""
        return (0, self.iteration_s) if self.fits else (1, self.memory_peak_bytes)


@dataclasses.dataclass(frozen=True)
class DlrmSearchResult:
    """What ``search`` found: the best plan, the best plan straight after rounding, counts;
    ``gradient`` the best plan polished from the rounded starts alone, ``greedy`` the greedy
    plan (None without ``greedy_start``) and ``started_from`` where the best plan's local
    search began: ``"gradient"`` (a rounded start) or ``"greedy"``."""

    best: Scored
    rounded: Scored
    evaluated: int
    seconds: float
    gradient: Scored | None = None
    greedy: Scored | None = None
    started_from: str = "gradient"


# ------------------------------------------------------------------------------------------
# Exact evaluation
# ------------------------------------------------------------------------------------------


@jax.jit
def _evaluate_batch(problem: ShardingProblem, kinds, ranks):
    """Exact cost of plans given as ``kinds [B, T]`` (-1: table left out) and ``ranks [B, T]``."""
    dtype = problem.model.batch.dtype
    types = jax.nn.one_hot(kinds, len(SHARDING_TYPES), dtype=dtype)
    places = jax.nn.one_hot(ranks, problem.layout.n_ranks, dtype=dtype)
    places = places * (kinds >= 0)[..., None].astype(dtype)
    out = jax.vmap(lambda t, r: plan_cost(problem, ShardingPlan(t, r), 0.0))(types, places)
    return out.iteration_s, out.memory_peak_bytes, out.memory_capacity_bytes


class Evaluator:
    """Exact, cached evaluation of discrete plans (tuples of ``TableChoice``, None for a table
    left out), in chunks of ``EVAL_CHUNK`` padded to that size."""

    def __init__(self, problem: ShardingProblem):
        self.problem = problem
        self.cache: dict[tuple, Scored] = {}

    def __call__(self, plans) -> list[Scored]:
        todo = list(dict.fromkeys(p for p in plans if p not in self.cache))
        for i in range(0, len(todo), EVAL_CHUNK):
            part = todo[i : i + EVAL_CHUNK]
            size = EVAL_CHUNK if len(part) > 64 else 64
            padded = part + [part[-1]] * (size - len(part))
            kinds = np.array([[-1 if c is None else c.kind for c in p] for p in padded])
            ranks = np.array([[0 if c is None else c.rank for c in p] for p in padded])
            time_s, peak, cap = jax.device_get(_evaluate_batch(self.problem, kinds, ranks))
            for j, p in enumerate(part):
                self.cache[p] = Scored(p, float(time_s[j]), float(peak[j]), bool(peak[j] <= cap[j]))
        return [self.cache[p] for p in plans]


def best_of(scored) -> Scored:
    return min(scored, key=Scored.key)


# ------------------------------------------------------------------------------------------
# Relaxed descent
# ------------------------------------------------------------------------------------------


def relaxed_plan(logits, tau) -> ShardingPlan:
    """Softmax probabilities of ``(type_logits [T, K], rank_logits [T, R])`` at ``tau``."""
    type_logits, rank_logits = logits
    return ShardingPlan(jax.nn.softmax(type_logits / tau), jax.nn.softmax(rank_logits / tau))


def objective(logits, problem: ShardingProblem, tau, temperature, memory_weight, commit):
    """``log(iteration time) + memory_weight * (excess + excess^2) + commit * entropy`` of the
    relaxed plan: the excess is the fullest rank's memory over capacity, relative (a smooth
    hinge); the entropy is the mean over tables of the type and placement distributions'.

    Without the entropy term a table spread over all ranks by its placement probabilities
    balances the load perfectly at no communication cost, which no discrete plan can do; the
    term, ramped in, makes each table commit to one rank and one type while it descends.
    """
    plan = relaxed_plan(logits, tau)
    out = plan_cost(problem, plan, temperature)
    over = out.memory_peak_bytes / out.memory_capacity_bytes - 1.0
    excess = smooth.smooth_relu(over, 1.0, temperature)
    entropy = jnp.mean(_entropy(plan.types) + _entropy(plan.ranks))
    return jnp.log(out.iteration_s) + memory_weight * (excess + excess**2) + commit * entropy


def _entropy(p):
    """Entropy of each row of probabilities ``p [T, n]`` (nats), finite at zeros."""
    return -jnp.sum(p * smooth.safe_log(p), axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _descend(problem: ShardingProblem, starts, cfg: DlrmSearchConfig):
    taus = descent.geometric(cfg.tau_start, cfg.tau_end, cfg.steps)
    ramp = descent.ramp(cfg.steps)
    opt = descent.adam(cfg.learning_rate, cfg.steps)

    def one(x0, commit):
        def loss(x, tau, c):
            return objective(x, problem, tau, cfg.temperature, cfg.memory_weight, c)

        x, values = descent.descend(loss, x0, opt, (taus, commit * ramp), finite_only=True)
        return x, values[-1]

    # every other start descends without the entropy term: both kinds find plans the other
    # misses (small problems gain from committing, large ones from balancing first)
    n = starts[0].shape[0]
    commits = cfg.commit_weight * (jnp.arange(n) % 2).astype(starts[0].dtype)
    return jax.vmap(one)(starts, commits)


def random_starts(key, n: int, n_tables: int, n_ranks: int, dtype, bias: float = 2.0):
    """``n`` random ``(type_logits, rank_logits)`` pairs (batched). Start ``s`` leans towards
    type ``s mod K`` for every table (its logit raised by ``bias``): the starts begin in every
    type's basin instead of near the uniform mixture."""
    k1, k2 = jax.random.split(key)
    lean = bias * jax.nn.one_hot(jnp.arange(n) % len(SHARDING_TYPES), len(SHARDING_TYPES))
    return (
        0.5 * jax.random.normal(k1, (n, n_tables, len(SHARDING_TYPES)), dtype)
        + lean[:, None, :].astype(dtype),
        0.5 * jax.random.normal(k2, (n, n_tables, n_ranks), dtype),
    )


def round_logits(logits, problem: ShardingProblem, tau, samples: int, seed: int):
    """Discrete plans near each start (a batch of logits, numpy): its most probable type and
    rank per table, and ``samples`` plans drawn from its softmax probabilities at ``tau``."""
    types, ranks = (np.asarray(x, dtype=float) for x in logits)
    rng = np.random.default_rng(seed)
    lay = problem.layout
    out = []
    for s in range(types.shape[0]):
        draws = [(types[s].argmax(-1), ranks[s].argmax(-1))]
        for _ in range(samples):
            draws.append((_sample(rng, types[s] / tau), _sample(rng, ranks[s] / tau)))
        out += [tuple(canonical(int(k), int(r), lay) for k, r in zip(*d)) for d in draws]
    return out


def _sample(rng: np.random.Generator, logits):
    """One index per row of ``logits [T, n]`` drawn from its softmax (Gumbel-max)."""
    return (logits + rng.gumbel(size=logits.shape)).argmax(-1)


# ------------------------------------------------------------------------------------------
# Local search, greedy, exhaustive
# ------------------------------------------------------------------------------------------


def table_moves(plan: tuple[TableChoice, ...], t: int, problem: ShardingProblem) -> list:
    """Other choices of table ``t``: another type at its rank, or its type at another rank."""
    lay, c = problem.layout, plan[t]
    moved = {canonical(k, c.rank, lay) for k in range(len(SHARDING_TYPES))}
    moved |= {canonical(c.kind, r, lay) for r in range(lay.n_ranks)}
    moved.discard(c)
    return sorted(moved, key=lambda o: (o.kind, o.rank))


def neighbours(plan: tuple[TableChoice, ...], problem: ShardingProblem) -> list[tuple]:
    """Plans one table away (``table_moves``), and plans where two tables swap their placement
    ranks (each keeping its type: a move that keeps the ranks' loads packed)."""
    lay = problem.layout
    out = []
    for t in range(len(plan)):
        out += [plan[:t] + (m,) + plan[t + 1 :] for m in table_moves(plan, t, problem)]
    for a, b in itertools.combinations(range(len(plan)), 2):
        ca, cb = plan[a], plan[b]
        swapped = (canonical(ca.kind, cb.rank, lay), canonical(cb.kind, ca.rank, lay))
        if swapped != (ca, cb):
            p = list(plan)
            p[a], p[b] = swapped
            out.append(tuple(p))
    return list(dict.fromkeys(out))  # a swap with a rank-free type can repeat a single move


def pair_neighbours(plan: tuple[TableChoice, ...], problem: ShardingProblem, limit: int):
    """Plans two tables away (both moved by ``table_moves``), or none when there are more
    than ``limit`` of them."""
    moves = [table_moves(plan, t, problem) for t in range(len(plan))]
    pairs = list(itertools.combinations(range(len(plan)), 2))
    if sum(len(moves[a]) * len(moves[b]) for a, b in pairs) > limit:
        return []
    out = []
    for a, b in pairs:
        for ma, mb in itertools.product(moves[a], moves[b]):
            p = list(plan)
            p[a], p[b] = ma, mb
            out.append(tuple(p))
    return out


def local_search(evaluate: Evaluator, seeds: list[Scored], max_rounds: int, pair_limit: int):
    """Steepest descent from every seed: over ``neighbours`` while that improves, then over
    ``pair_neighbours`` (where there are at most ``pair_limit``); (walkers, rounds)."""
    walkers = list(seeds)
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        moved = False
        for i, w in enumerate(walkers):
            plans = neighbours(w.choices, evaluate.problem)
            best = best_of(evaluate(plans)) if plans else w
            if best.key() >= w.key():
                pairs = pair_neighbours(w.choices, evaluate.problem, pair_limit)
                best = best_of(evaluate(pairs)) if pairs else w
            if best.key() < w.key():
                walkers[i], moved = best, True
        walkers = list({w.choices: w for w in walkers}.values())
        if not moved:
            break
    return walkers, rounds


def search(problem: ShardingProblem, cfg: DlrmSearchConfig | None = None) -> DlrmSearchResult:
    """Search the sharding plans of ``problem`` (see the module docstring)."""
    cfg = cfg or DlrmSearchConfig()
    t0 = time.perf_counter()
    dtype = problem.model.batch.dtype
    n_tables = problem.model.tables.rows.shape[0]
    starts = random_starts(
        jax.random.PRNGKey(cfg.seed), cfg.starts, n_tables, problem.layout.n_ranks, dtype
    )
    with jax.numpy_dtype_promotion("standard"):  # optax mixes its int32 step count in
        logits, _ = _descend(problem, starts, cfg)
    evaluate = Evaluator(problem)
    near = round_logits(jax.device_get(logits), problem, cfg.sample_tau, cfg.samples, cfg.seed)
    rounded = sorted(evaluate(near), key=Scored.key)
    walkers, _ = local_search(evaluate, rounded[: cfg.walkers], cfg.max_rounds, cfg.pair_limit)
    best, start, baseline = best_of(walkers), "gradient", None
    if cfg.greedy_start:
        baseline = greedy(problem, evaluate)
        polished, _ = local_search(evaluate, [baseline], cfg.max_rounds, cfg.pair_limit)
        if best_of(polished).key() < best.key():
            best, start = best_of(polished), "greedy"
    return DlrmSearchResult(
        best=best,
        rounded=rounded[0],
        evaluated=len(evaluate.cache),
        seconds=time.perf_counter() - t0,
        gradient=best_of(walkers),
        greedy=baseline,
        started_from=start,
    )


def greedy(problem: ShardingProblem, evaluate: Evaluator | None = None) -> Scored:
    """TorchRec-planner-like greedy: tables in decreasing order of their table-wise lookup
    cost; each takes the choice (type and rank) that makes the plan of the tables placed so
    far fastest among those that fit (the least-loaded rank, the cheapest type), or the
    smallest peak memory when none fits. ``evaluate``: an evaluator to share (its cache)."""
    costs = jax.device_get(table_costs(problem))
    order = np.argsort(-(costs.lookup_fwd_s[:, TW] + costs.lookup_bwd_s[:, TW]), kind="stable")
    evaluate = evaluate or Evaluator(problem)
    menu = options(problem.layout)
    plan: list = [None] * len(order)
    for t in order:
        trials = [tuple(plan[:t]) + (o,) + tuple(plan[t + 1 :]) for o in menu]
        plan = list(best_of(evaluate(trials)).choices)
    return evaluate([tuple(plan)])[0]


def exhaustive(problem: ShardingProblem, limit: int = 2_000_000) -> Scored:
    """The best of every plan (``len(options) ** T`` of them; refuses more than ``limit``)."""
    menu = options(problem.layout)
    n_tables = problem.model.tables.rows.shape[0]
    total = len(menu) ** n_tables
    if total > limit:
        raise ValueError(
            f"exhaustive search over {total} plans ({len(menu)} choices per table, "
            f"{n_tables} tables) exceeds limit={limit}"
        )
    kinds = np.array([o.kind for o in menu])
    ranks = np.array([o.rank for o in menu])
    best, best_key, lean, lean_peak = None, None, None, np.inf
    index = np.array(list(itertools.product(range(len(menu)), repeat=n_tables)))
    for i in range(0, total, EVAL_CHUNK):
        part = index[i : i + EVAL_CHUNK]
        pad = np.concatenate([part, np.repeat(part[-1:], EVAL_CHUNK - len(part), 0)])
        time_s, peak, cap = jax.device_get(_evaluate_batch(problem, kinds[pad], ranks[pad]))
        keys = np.where(peak <= cap, time_s, np.inf)[: len(part)]
        j = int(np.argmin(keys))
        m = int(np.argmin(peak[: len(part)]))
        if peak[m] < lean_peak:
            lean, lean_peak = tuple(menu[k] for k in part[m]), peak[m]
        if np.isfinite(keys[j]) and (best_key is None or keys[j] < best_key):
            best, best_key = tuple(menu[k] for k in part[j]), keys[j]
    return Evaluator(problem)([lean if best is None else best])[0]


def random_spec(rng: np.random.Generator, n_tables: int, batch_size: int, base: DlrmSpec):
    """A DLRM like ``base`` with ``n_tables`` random tables: rows log-uniform in [1e3, 4e7],
    pooling log-uniform in [1, 100], Zipf exponent uniform in [0, 1.2], width ``base``'s."""
    dim = base.bottom_mlp[-1]
    tables = tuple(
        TableSpec(
            name=f"t{i}",
            rows=int(10 ** rng.uniform(3.0, np.log10(4e7))),
            dim=dim,
            pooling=float(np.round(10 ** rng.uniform(0.0, 2.0))),
            zipf=float(rng.uniform(0.0, 1.2)),
        )
        for i in range(n_tables)
    )
    name = f"random-{n_tables}"
    return dataclasses.replace(base, name=name, tables=tables, batch_size=batch_size)
