"""partition_search: the partition problem by gradients and by coordinate descent.

``diffcost.partition`` defines the problem (``PartitionProblem``), its exact model and the
exact optimum (``solve_dp``). Two searches here find good partitions without enumerating them:

* ``solve_gradient``: the relaxed problem (layer shares on a simplex, recompute fractions) by
  Adam from many random starts in one ``jit``, then rounding and a discrete local search;
* ``solve_coordinate_descent``: AutoDDL-style descent on the stage boundaries with restarts.

Both give every stage the smallest recompute that fits (``diffcost.partition.stage_tables``).

References:
    Chen et al., "AutoDDL: Automatic Distributed Deep Learning with Near-Optimal Bandwidth
    Cost" (2023), coordinate descent over the strategy of one operator at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import descent, smooth
from diffcost.partition import (
    Partition,
    PartitionProblem,
    StageTables,
    as_partition,
    best_index,
    check_feasible,
    score,
    stage_ends,
    stage_tables,
    stage_work_s,
    uniform_partition,
)


# --- relaxed: gradient descent ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GradientSettings:
    """Static settings of the relaxed search (hashable: one compilation per settings).

    ``temperature`` softens the max over stages (``smooth.smooth_max``) and the recompute
    indicator, ``memory_temperature`` the memory hinge (``smooth.smooth_relu`` on the relative
    excess, in units of the capacity); the penalty weight grows geometrically
    from ``penalty_start`` to ``penalty_end`` over the steps, the learning rate follows a
    cosine decay from ``learning_rate``.
    """

    learning_rate: float = 0.05
    temperature: float = 1e-2
    memory_temperature: float = 1e-3
    penalty_start: float = 1.0
    penalty_end: float = 1e3
    init_scale: float = 0.3  # standard deviation of the random share logits
    recompute_init: float = 0.0  # mean of the random recompute logits (0: half recomputed)
    b2: float = 0.99  # Adam's second-moment decay (0.999 remembers early penalty gradients)
    polish_moves: int = 1000  # bound on local-search moves per start
    polish_any_pair: bool = False  # polish also moves layers between non-adjacent stages


def _relaxed(problem: PartitionProblem, share_logits, recompute_logits):
    """(layers, recompute) of the relaxation: simplex shares and recompute fractions, [p]."""
    n = jnp.asarray(float(problem.n_layers), dtype=share_logits.dtype)
    layers = n * jax.nn.softmax(share_logits)
    return layers, layers * jax.nn.sigmoid(recompute_logits)


def relaxed_time_s(problem: PartitionProblem, share_logits, recompute_logits, temperature):
    """Smooth iteration time ``T`` of the relaxed partition (``smooth_max`` over stages)."""
    layers, recompute = _relaxed(problem, share_logits, recompute_logits)
    p = problem.n_stages
    work = stage_work_s(problem, jnp.arange(p), layers, recompute, jnp.where)
    m = problem.n_microbatches
    return (
        jnp.sum(work)
        + (m - 1.0) * smooth.smooth_max(work, temperature=temperature)
        + 2.0 * (p - 1) * problem.send_s
        + problem.rest_s
    )


def relaxed_excess(problem: PartitionProblem, share_logits, recompute_logits, temperature):
    """Relative memory excess ``(M_s - cap) / cap`` per stage of the relaxed partition, [p].

    The indicator ``[recompute > 0]`` becomes ``smin(recompute, 1)`` (one layer's full
    activations phase in over the first recomputed layer).
    """
    layers, recompute = _relaxed(problem, share_logits, recompute_logits)
    p = problem.n_stages
    stage = jnp.arange(p)
    static = layers * problem.layer_static_bytes + stage_ends(
        problem, stage, problem.first_static_bytes, problem.last_static_bytes, jnp.where
    )
    act = problem.in_flight * (
        (layers - recompute) * problem.layer_act_bytes
        + recompute * problem.layer_act_recompute_bytes
    )
    rebuild = smooth.smin2(recompute, 1.0, temperature) * problem.layer_act_bytes
    memory = static + act + rebuild + problem.fixed_bytes
    return (memory - problem.capacity_bytes) / problem.capacity_bytes


def relaxed_objective(
    problem: PartitionProblem,
    share_logits,
    recompute_logits,
    penalty_weight,
    settings: GradientSettings = GradientSettings(),
):
    """``log T + w sum_s (h_s + h_s^2)`` with ``h_s = smooth_relu`` of the relative excess.

    The linear term makes the penalty exact once ``w`` exceeds the constraint's multiplier;
    the square keeps large violations from dominating early, while ``w`` is small.
    """
    tau = settings.temperature
    time_s = relaxed_time_s(problem, share_logits, recompute_logits, tau)
    excess = relaxed_excess(problem, share_logits, recompute_logits, tau)
    hinge = smooth.smooth_relu(excess, 1.0, settings.memory_temperature)
    return jnp.log(time_s) + penalty_weight * jnp.sum(hinge + hinge**2)


@functools.partial(jax.jit, static_argnames=("starts", "steps", "settings"))
def relaxed_search(
    problem: PartitionProblem,
    key: jax.Array,
    starts: int,
    steps: int,
    settings: GradientSettings = GradientSettings(),
):
    """Adam on the relaxed objective from ``starts`` random points, all in one ``jit``.

    Start 0 is the uniform partition; the others perturb the share logits (standard deviation
    ``init_scale``). Recompute logits are drawn around ``recompute_init``. ``jax.vmap``
    runs the starts together and ``jax.lax.scan`` the steps.

    Returns:
        (layers [starts, p], recompute [starts, p], objective [starts]): the relaxed solution
        of each start (real numbers) and its final objective.
    """
    p = problem.n_stages
    dtype = jnp.result_type(float)
    k_share, k_rec = jax.random.split(key)
    shares = settings.init_scale * jax.random.normal(k_share, (starts, p), dtype)
    shares = shares.at[0].set(0.0)
    recs = jax.random.normal(k_rec, (starts, p), dtype) + settings.recompute_init
    optimizer = descent.adam(settings.learning_rate, steps, b2=settings.b2)
    weights = descent.geometric(settings.penalty_start, settings.penalty_end, steps, dtype)

    def loss(x, weight):
        return relaxed_objective(problem, x[0], x[1], weight, settings)

    def run(x0):
        x, _ = descent.descend(loss, x0, optimizer, (weights,))
        return x, loss(x, settings.penalty_end)

    x, objective = jax.vmap(run)((shares, recs))
    layers, recompute = jax.vmap(lambda a, c: _relaxed(problem, a, c))(x[0], x[1])
    return layers, recompute, objective


def round_layers(layers_real, n_layers: int) -> np.ndarray:
    """Largest-remainder rounding of real stage sizes [..., p] to integers >= 1 summing to N.

    Floors (at least 1) get the missing layers in order of largest remainder; when the
    at-least-1 floors overshoot, the stages furthest above their real size give layers back.
    """
    x = np.asarray(layers_real, dtype=np.float64)
    out = np.maximum(np.floor(x), 1.0).astype(np.int64)
    for row, xr in zip(out.reshape(-1, out.shape[-1]), x.reshape(-1, x.shape[-1])):
        missing = n_layers - int(row.sum())
        while missing != 0:
            remainder = np.where(row > 1, xr - row, np.inf) if missing < 0 else xr - row
            i = int(np.argmin(remainder)) if missing < 0 else int(np.argmax(remainder))
            row[i] += 1 if missing > 0 else -1
            missing += -1 if missing > 0 else 1
    return out


def _moves(p: int, any_pair: bool = False) -> np.ndarray:
    """Moves of one layer from stage i to stage j, as deltas [moves, p].

    Adjacent stages only (one layer across one boundary: 2 (p - 1) moves), or with
    ``any_pair`` between any two stages (every boundary between them shifts by one).
    """
    src, dst = np.nonzero(~np.eye(p, dtype=bool))
    if not any_pair:
        src, dst = src[np.abs(src - dst) == 1], dst[np.abs(src - dst) == 1]
    delta = np.zeros((src.size, p), dtype=np.int64)
    delta[np.arange(src.size), src] -= 1
    delta[np.arange(src.size), dst] += 1
    return delta


def local_search(
    problem: PartitionProblem,
    tables: StageTables,
    layers,
    max_moves: int = 1000,
    any_pair: bool = False,
) -> np.ndarray:
    """Steepest descent by single-layer moves, on (memory excess, time) lexicographically.

    Each partition in the batch repeatedly takes its best move (``_moves``) while that
    strictly improves it; recompute follows the smallest-that-fits rule, and infeasible
    partitions first move towards feasibility.

    Args:
        problem, tables: the problem and its ``stage_tables``.
        layers: int array [k, p] (or [p]) of partitions to polish, together.
        max_moves: bound on the moves per partition.
        any_pair: also move layers between non-adjacent stages.

    Returns:
        The polished partitions, same shape as ``layers``.
    """
    layers = np.asarray(layers, dtype=np.int64)
    batch = np.atleast_2d(layers).copy()
    rows = np.arange(batch.shape[0])
    delta = _moves(problem.n_stages, any_pair)
    excess, time_s = score(problem, tables, batch)
    for _ in range(max_moves):
        cand = batch[:, None, :] + delta[None, :, :]
        cand = np.where(np.all(cand >= 1, axis=-1, keepdims=True), cand, batch[:, None, :])
        c_excess, c_time = score(problem, tables, cand)
        least = c_excess <= np.min(c_excess, axis=1, keepdims=True)
        j = np.argmin(np.where(least, c_time, np.inf), axis=1)
        b_excess, b_time = c_excess[rows, j], c_time[rows, j]
        better = (b_excess < excess) | ((b_excess == excess) & (b_time < time_s))
        if not np.any(better):
            break
        batch = np.where(better[:, None], cand[rows, j], batch)
        excess = np.where(better, b_excess, excess)
        time_s = np.where(better, b_time, time_s)
    return batch.reshape(layers.shape)


def solve_gradient(
    problem: PartitionProblem,
    starts: int = 64,
    steps: int = 500,
    seed: int = 0,
    settings: GradientSettings = GradientSettings(),
) -> Partition:
    """The relaxed problem by gradient descent, rounded and polished (DESIGN.md section 5).

    Variables: layer shares ``layers_s = n_layers softmax(a)_s`` (the sum holds by
    construction) and recompute fractions ``recompute_s = layers_s sigmoid(c_s)``; objective
    ``log T`` with a smooth max and a memory penalty annealed upwards (``relaxed_objective``);
    Adam with a cosine schedule over ``steps``, ``starts`` random starts (``relaxed_search``,
    one compilation per problem shape and settings). Each start is rounded (largest
    remainder, each >= 1), given the smallest recompute that fits, and polished by
    ``local_search``; the fastest feasible result is returned.

    Args:
        problem: the partition problem.
        starts: random starts run together (``jax.vmap``).
        steps: Adam steps (``jax.lax.scan``).
        seed: PRNG seed of the starts.
        settings: learning rate, temperatures and penalty schedule.

    Returns:
        The best feasible ``Partition`` found.

    Raises:
        InfeasiblePartitionError: no partition fits, with the smallest peak memory reachable.
        RuntimeError: the problem is feasible but no start reached a feasible partition.
    """
    tables = stage_tables(problem)
    check_feasible(problem, tables)
    layers_real, _, _ = relaxed_search(
        problem, jax.random.PRNGKey(seed), starts=starts, steps=steps, settings=settings
    )
    rounded = round_layers(np.asarray(layers_real), problem.n_layers)
    polished = local_search(
        problem, tables, rounded, settings.polish_moves, any_pair=settings.polish_any_pair
    )
    excess, time_s = score(problem, tables, polished)
    i = best_index(excess, time_s)
    if excess[i] > 0:
        raise RuntimeError(
            f"the gradient search found no feasible partition from {starts} starts although "
            "one exists (see solve_dp): raise starts, steps or settings.penalty_end"
        )
    return as_partition(problem, tables, polished[i])


# --- coordinate descent (AutoDDL) ---------------------------------------------------------------
def _descend_boundaries(problem: PartitionProblem, tables: StageTables, layers) -> np.ndarray:
    """Coordinate descent on the p - 1 boundaries until a sweep improves nothing.

    For boundary ``i`` (between stages ``i - 1`` and ``i``) every position strictly between
    its neighbours is tried with the others fixed; the best (by (excess, time)) is kept.
    """
    cuts = np.concatenate([[0], np.cumsum(layers)])
    p = problem.n_stages
    excess, time_s = score(problem, tables, np.diff(cuts))
    improved = True
    while improved:
        improved = False
        for i in range(1, p):
            positions = np.arange(cuts[i - 1] + 1, cuts[i + 1])
            cand = np.repeat(cuts[None, :], positions.size, axis=0)
            cand[:, i] = positions
            c_excess, c_time = score(problem, tables, np.diff(cand, axis=1))
            j = best_index(c_excess, c_time)
            if (c_excess[j], c_time[j]) < (excess, time_s):
                cuts, excess, time_s, improved = cand[j], c_excess[j], c_time[j], True
    return np.diff(cuts)


def random_partition(rng: np.random.Generator, n_layers: int, n_stages: int) -> np.ndarray:
    """A uniformly random composition of ``n_layers`` into ``n_stages`` parts >= 1."""
    cuts = np.sort(rng.choice(np.arange(1, n_layers), size=n_stages - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [n_layers]]))


def solve_coordinate_descent(
    problem: PartitionProblem, time_budget_s: float, seed: int = 0
) -> Partition:
    """AutoDDL-style coordinate descent over the stage boundaries, with random restarts.

    The first descent starts from the uniform partition; then random partitions
    (``random_partition``) restart it until ``time_budget_s`` is used (at least one descent
    runs). Recompute follows the smallest-that-fits rule throughout.

    Args:
        problem: the partition problem.
        time_budget_s: wall-clock budget in seconds.
        seed: seed of the random restarts.

    Returns:
        The best feasible ``Partition`` found.

    Raises:
        InfeasiblePartitionError: no partition fits, with the smallest peak memory reachable.
        RuntimeError: the problem is feasible but no descent reached a feasible partition.
    """
    deadline = time.perf_counter() + time_budget_s
    tables = stage_tables(problem)
    check_feasible(problem, tables)
    rng = np.random.default_rng(seed)
    start = uniform_partition(problem.n_layers, problem.n_stages)
    best, best_key = None, (np.inf, np.inf)
    while True:
        layers = _descend_boundaries(problem, tables, start)
        key = score(problem, tables, layers)
        if key < best_key:
            best, best_key = layers, key
        if time.perf_counter() >= deadline:
            break
        start = random_partition(rng, problem.n_layers, problem.n_stages)
    if best_key[0] > 0:
        raise RuntimeError("coordinate descent found no feasible partition: raise the budget")
    return as_partition(problem, tables, best)
