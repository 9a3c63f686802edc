"""Pipeline partitions: the exact DP, the simulator it is read from, the gradient and coordinate
searches, infeasible problems, and the benchmark comparison (benchmarks/partition_compare.py)."""

import dataclasses
import doctest
import importlib.util
import itertools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CLUSTER, GPT, LLAMA, MOE, arrays
from jax.test_util import check_grads

from diffcost import default_params, partition, partition_search
from diffcost.partition import (
    InfeasiblePartitionError,
    evaluate,
    min_peak_memory,
    problem_for,
    solve_dp,
    uniform_partition,
    uniform_problem,
)
from diffcost.partition_search import (
    GradientSettings,
    relaxed_objective,
    solve_coordinate_descent,
    solve_gradient,
)
from diffcost.simulate import simulate
from diffcost.specs import PlanSpec

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "partition_compare.py"
_spec = importlib.util.spec_from_file_location("partition_compare", _PATH)
partition_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(partition_compare)

# Measured agreement of ``evaluate`` with the simulator on uniform partitions: at most 2.2e-16
# relative, i.e. rounding only (the evaluator recombines the simulator's terms in another
# order: per-layer time read off as W_middle / L and multiplied back, extras as differences).
SIMULATOR_REL = 1e-13
EXACT_REL = 1e-12  # the same formula evaluated in two batch shapes
GAP_TO_DP = 0.01  # gradient search vs the exact optimum on the benchmark case
GRAD_TOL = 1e-5  # reverse mode vs central differences (check_grads, float64)

SMALL_SETTINGS = GradientSettings(polish_moves=200)

SIMULATOR_CASES = {
    "gpt-tp2pp4-sp": (
        GPT,
        PlanSpec(tp=2, pp=4, dp=2, sequence_parallel=True, microbatch=2, global_batch=32),
    ),
    "gpt-pp3-m<p": (GPT, PlanSpec(pp=3, dp=2, zero=1, microbatch=1, global_batch=4)),
    "gpt-zero3": (
        GPT,
        PlanSpec(tp=2, pp=4, dp=2, zero=3, microbatch=1, global_batch=64, overlap_dp=False),
    ),
    "llama-zero2": (
        LLAMA,
        PlanSpec(tp=2, pp=2, dp=4, sequence_parallel=True, zero=2, global_batch=64),
    ),
    "moe-ep4": (MOE, PlanSpec(pp=2, dp=8, ep=4, zero=1, global_batch=64)),
}


def _compositions(n, p):
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        yield [bounds[i + 1] - bounds[i] for i in range(p)]


def _every_partition(n, p):
    """Every (layers, recompute) pair of n layers on p stages, as two int arrays [k, p]."""
    layers, recompute = [], []
    for c in _compositions(n, p):
        for r in itertools.product(*[range(k + 1) for k in c]):
            layers.append(c)
            recompute.append(r)
    return np.array(layers), np.array(recompute)


def _random_problem(rng, n, p, tightness):
    """A random problem whose capacity lies ``tightness`` of the way from the smallest
    reachable peak to the uniform partition's peak without recompute."""
    problem = uniform_problem(
        n,
        p,
        layer_s=rng.uniform(1.0, 2.0),
        recompute_layer_s=rng.uniform(0.2, 0.8),
        first_stage_s=rng.uniform(0.0, 2.0),
        last_stage_s=rng.uniform(0.0, 3.0),
        n_microbatches=float(rng.integers(1, 9)),
        layer_static_bytes=rng.uniform(0.2, 2.0),
        first_static_bytes=rng.uniform(0.0, 2.0),
        last_static_bytes=rng.uniform(0.0, 3.0),
        layer_act_recompute_bytes=rng.uniform(0.05, 0.4),
        fixed_bytes=rng.uniform(0.0, 1.0),
        send_s=rng.uniform(0.0, 0.1),
        rest_s=rng.uniform(0.0, 1.0),
    )
    peak, _ = min_peak_memory(problem)
    _, memory, _ = evaluate(problem, uniform_partition(n, p), np.zeros(p, dtype=int))
    capacity = peak + tightness * (np.max(memory) - peak)
    return problem.replace(capacity_bytes=np.float64(capacity))


def _brute_force(problem):
    """(best time, its layers, smallest peak memory) over every partition and recompute."""
    layers, recompute = _every_partition(problem.n_layers, problem.n_stages)
    time_s, memory, feasible = evaluate(problem, layers, recompute)
    time_s = np.where(feasible, time_s, np.inf)
    best = int(np.argmin(time_s))
    return time_s[best], layers[best], float(np.min(np.max(memory, axis=1)))


@pytest.mark.parametrize("seed", range(12))
def test_dp_is_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, p = int(rng.integers(8, 13)), int(rng.integers(3, 5))
    if n == 12 and p == 4:  # keep the enumeration small: 11 layers at most on 4 stages
        n = 11
    problem = _random_problem(rng, n, p, tightness=rng.uniform(0.05, 1.0))
    best_s, _, peak = _brute_force(problem)
    result = solve_dp(problem)
    assert result.time_s == pytest.approx(best_s, rel=EXACT_REL)
    time_s, _, feasible = evaluate(problem, result.layers, result.recompute)
    assert bool(feasible) and float(time_s) == result.time_s
    assert min_peak_memory(problem)[0] == pytest.approx(peak, rel=EXACT_REL)


def test_dp_takes_the_smallest_recompute_that_fits():
    """Every partition needs recompute here; one fewer recomputed layer would not fit."""
    problem = uniform_problem(8, 4, capacity_bytes=6.0)
    result = solve_dp(problem)
    _, memory, feasible = evaluate(problem, result.layers, result.recompute)
    assert bool(feasible) and result.recompute.sum() > 0
    for s in np.nonzero(result.recompute)[0]:
        fewer = result.recompute.copy()
        fewer[s] -= 1
        assert not evaluate(problem, result.layers, fewer)[2]


@pytest.mark.parametrize("name", list(SIMULATOR_CASES))
def test_uniform_partition_matches_simulator(name):
    """Time against simulate(gpipe) (equal to ``sum W + (m-1) max W`` when the last stage bounds
    forward and backward; the exposed DP sync in ``rest_s`` is the same for gpipe and 1f1b),
    memory of the first and last stage against simulate(1f1b)."""
    model, plan = SIMULATOR_CASES[name]
    params = default_params(jnp.float64)
    problem = problem_for(model, plan, CLUSTER, params)
    layers = uniform_partition(model.n_layers, plan.pp)
    for mode, recompute in (("none", np.zeros_like(layers)), ("full", layers)):
        time_s, memory, _ = evaluate(problem, layers, recompute)
        plan_mode = dataclasses.replace(plan, recompute=mode)
        gpipe = simulate(
            *arrays(model, dataclasses.replace(plan_mode, schedule="gpipe")), params, 0.0
        )
        one_f_one_b = simulate(*arrays(model, plan_mode), params, 0.0)
        if mode == "none":  # rest_s is read at recompute none (see the module's limits)
            assert float(time_s) == pytest.approx(float(gpipe.iteration_s), rel=SIMULATOR_REL)
        stage_bytes = np.asarray(one_f_one_b.memory_stage_bytes)
        assert memory[0] == pytest.approx(stage_bytes[0], rel=SIMULATOR_REL)
        assert memory[-1] == pytest.approx(stage_bytes[1], rel=SIMULATOR_REL)


def test_problem_for_rejects_other_schedules():
    with pytest.raises(ValueError, match="1f1b"):
        problem_for(GPT, PlanSpec(pp=4, schedule="gpipe"), CLUSTER, default_params(jnp.float64))
    with pytest.raises(ValueError, match="at least 2|2 to"):
        problem_for(GPT, PlanSpec(dp=2), CLUSTER, default_params(jnp.float64))


def test_evaluate_rejects_invalid_partitions():
    problem = uniform_problem(8, 4)
    with pytest.raises(ValueError, match="sum"):
        evaluate(problem, [2, 2, 2, 1], [0, 0, 0, 0])
    with pytest.raises(ValueError, match=">= 1"):
        evaluate(problem, [4, 0, 2, 2], [0, 0, 0, 0])
    with pytest.raises(ValueError, match="recompute"):
        evaluate(problem, [2, 2, 2, 2], [3, 0, 0, 0])


def test_round_layers_keeps_the_sum_and_at_least_one_layer():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = int(rng.integers(2, 17))
        n = int(rng.integers(p, 97))
        shares = rng.dirichlet(np.full(p, rng.choice([0.05, 1.0, 50.0])))
        rounded = partition_search.round_layers(n * shares, n)
        assert rounded.sum() == n and rounded.min() >= 1
        assert np.all(np.abs(rounded - n * shares) < 1.0 + p)


def test_relaxed_gradients_are_finite_and_match_finite_differences():
    problem = uniform_problem(12, 4, capacity_bytes=20.0, n_microbatches=8.0)
    fn = jax.jit(lambda a, c: relaxed_objective(problem, a, c, 10.0))
    rng = np.random.default_rng(1)
    for _ in range(3):
        shares, recompute = rng.normal(size=4), rng.normal(size=4)
        check_grads(fn, (shares, recompute), order=1, modes=("rev",), atol=GRAD_TOL, rtol=GRAD_TOL)
    grad = jax.jit(jax.grad(lambda a, c: relaxed_objective(problem, a, c, 1e3), argnums=(0, 1)))
    extremes = [
        (np.zeros(4), np.zeros(4)),
        (np.array([40.0, -40.0, 0.0, 0.0]), np.array([60.0, -60.0, 0.0, -60.0])),
        (np.full(4, 3.0), np.full(4, -80.0)),
    ]
    for shares, recompute in extremes:
        for g in grad(shares, recompute):
            assert np.all(np.isfinite(np.asarray(g)))


@pytest.fixture(scope="module")
def gpt3_case():
    problem, description = partition_compare.partition_case()
    return problem, partition_compare.compare(problem)


def test_benchmark_case_is_memory_bound_and_non_uniform(gpt3_case):
    problem, result = gpt3_case
    layers = uniform_partition(problem.n_layers, problem.n_stages)
    _, memory, feasible = evaluate(problem, layers, np.zeros_like(layers))
    assert not feasible and memory[0] > problem.capacity_bytes >= memory[-1]
    assert result["uniform_s"] is not None and result["dp_s"] < result["uniform_s"]
    assert len(set(result["dp"]["layers"])) > 1


def test_gradient_search_on_benchmark_case(gpt3_case):
    problem, result = gpt3_case
    found = result["gradient"]
    layers, recompute = np.array(found["layers"]), np.array(found["recompute"])
    time_s, _, feasible = evaluate(problem, layers, recompute)
    assert bool(feasible) and layers.sum() == problem.n_layers and layers.min() >= 1
    assert float(time_s) == found["time_s"] == result["gradient_s"]
    assert result["dp_s"] <= result["gradient_s"] <= (1.0 + GAP_TO_DP) * result["dp_s"]
    assert result["gradient_s"] <= result["coordinate_s"] * (1.0 + EXACT_REL)
    assert result["dp_time_s"] < 1.0


def test_relaxed_search_compiles_once_per_shape():
    problem = uniform_problem(12, 4, capacity_bytes=20.0, n_microbatches=8.0)
    solve_gradient(problem, starts=8, steps=100, settings=SMALL_SETTINGS)
    size = partition_search.relaxed_search._cache_size()
    other = problem.replace(layer_s=np.float64(1.7), capacity_bytes=np.float64(25.0))
    solve_gradient(other, starts=8, steps=100, seed=3, settings=SMALL_SETTINGS)
    assert partition_search.relaxed_search._cache_size() == size


@pytest.mark.parametrize("seed", range(4))
def test_searches_return_feasible_partitions_on_small_problems(seed):
    rng = np.random.default_rng(100 + seed)
    problem = _random_problem(rng, 12, 4, tightness=rng.uniform(0.05, 0.6))
    optimum = solve_dp(problem).time_s
    for result in (
        solve_gradient(problem, starts=8, steps=100, seed=seed, settings=SMALL_SETTINGS),
        solve_coordinate_descent(problem, time_budget_s=0.01, seed=seed),
    ):
        time_s, _, feasible = evaluate(problem, result.layers, result.recompute)
        assert bool(feasible) and result.layers.sum() == 12 and result.layers.min() >= 1
        assert result.time_s == float(time_s) >= optimum * (1.0 - EXACT_REL)


def test_infeasible_problem_raises_with_the_smallest_reachable_memory():
    rng = np.random.default_rng(7)
    problem = _random_problem(rng, 9, 3, tightness=0.5)
    _, _, peak = _brute_force(problem)
    problem = problem.replace(capacity_bytes=np.float64(0.99 * peak))
    for solve in (
        solve_dp,
        lambda pr: solve_gradient(pr, starts=8, steps=100, settings=SMALL_SETTINGS),
        lambda pr: solve_coordinate_descent(pr, time_budget_s=0.01),
        partition_compare.compare,
    ):
        with pytest.raises(InfeasiblePartitionError, match="smallest peak memory") as info:
            solve(problem)
        assert info.value.min_peak_bytes == pytest.approx(peak, rel=EXACT_REL)
        assert info.value.layers.sum() == 9
    assert partition.uniform_time_s(problem) is None


def test_docstring_examples():
    assert doctest.testmod(partition).failed == 0
