"""Uneven pipeline partitions: the gradient search against the exact DP and coordinate descent.

    python benchmarks/partition_compare.py [--json]

``compare`` runs the three solvers (``diffcost.partition.solve_dp`` and the two of
``diffcost.partition_search``) on one problem and times them; ``partition_case`` builds the
benchmark case (GPT-3 175B on Selene, 16 pipeline stages, memory bound on the early stages).
``benchmarks/search.py`` reports it as its partition row; ``tests/test_partition.py`` checks the
case and the comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffcost import config  # noqa: E402
from diffcost.partition import (  # noqa: E402
    Partition,
    PartitionProblem,
    problem_for,
    score,
    solve_dp,
    stage_tables,
    uniform_partition,
    uniform_time_s,
)
from diffcost.partition_search import (  # noqa: E402
    GradientSettings,
    local_search,
    relaxed_search,
    round_layers,
    solve_coordinate_descent,
    solve_gradient,
)
from diffcost.profiles import params_for  # noqa: E402
from diffcost.specs import PlanSpec  # noqa: E402


def _partition_dict(partition: Partition) -> dict:
    """A partition as plain Python values: layers, recompute (per stage) and time_s."""
    return {
        "layers": partition.layers.tolist(),
        "recompute": partition.recompute.tolist(),
        "time_s": partition.time_s,
    }


def compare(
    problem: PartitionProblem,
    time_budget_s: float | None = None,
    starts: int = 64,
    steps: int = 500,
    seed: int = 0,
    settings: GradientSettings | None = None,
) -> dict:
    """DP, gradient search and coordinate descent on one problem, timed.

    The DP runs once (numpy, nothing to compile). The gradient search runs twice after its
    jit cache is cleared: ``gradient_compile_s`` is the first call minus the second, and
    ``gradient_time_s`` the second (warm) call. Coordinate descent gets ``time_budget_s``, or
    by default the gradient search's warm time. Two untimed ablations show where the gradient
    result comes from: ``gradient_rounded_s`` is the best start after rounding but before the
    local search, ``uniform_polished_s`` the same local search from the uniform partition
    with no gradient step.

    Args:
        problem: the partition problem.
        time_budget_s: coordinate descent's budget; None for the gradient search's warm time.
        starts, steps, seed, settings: of ``solve_gradient`` (settings None: its defaults).

    Returns:
        A dict of plain Python values: ``layers``, ``stages``, ``microbatches``, ``uniform_s``
        (None when no uniform partition fits), ``dp_s``, ``dp_time_s``, ``gradient_s``,
        ``gradient_time_s``, ``gradient_compile_s``, ``coordinate_s``, ``coordinate_time_s``,
        ``coordinate_budget_s``, ``gap_to_dp_pct``, ``gap_to_coordinate_pct`` (positive:
        gradient worse), ``gradient_rounded_s``, ``uniform_polished_s`` and the partitions
        ``dp``, ``gradient``, ``coordinate`` (layers, recompute, time_s each).

    Raises:
        InfeasiblePartitionError: no partition fits.
    """
    settings = GradientSettings() if settings is None else settings
    t0 = time.perf_counter()
    dp = solve_dp(problem)
    dp_time = time.perf_counter() - t0

    relaxed_search.clear_cache()
    run = lambda: solve_gradient(problem, starts, steps, seed, settings)  # noqa: E731
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    gradient = run()
    gradient_time = time.perf_counter() - t0

    budget = gradient_time if time_budget_s is None else float(time_budget_s)
    t0 = time.perf_counter()
    coordinate = solve_coordinate_descent(problem, budget, seed)
    coordinate_time = time.perf_counter() - t0

    tables = stage_tables(problem)
    layers_real, _, _ = relaxed_search(
        problem, jax.random.PRNGKey(seed), starts=starts, steps=steps, settings=settings
    )
    rounded = round_layers(np.asarray(layers_real), problem.n_layers)
    excess, rounded_s = score(problem, tables, rounded)
    uniform = uniform_partition(problem.n_layers, problem.n_stages)
    polished = local_search(problem, tables, uniform, any_pair=settings.polish_any_pair)
    polished_excess, polished_s = score(problem, tables, polished)
    pct = lambda a, b: 100.0 * (a / b - 1.0)  # noqa: E731
    return {
        "layers": problem.n_layers,
        "stages": problem.n_stages,
        "microbatches": float(problem.n_microbatches),
        "uniform_s": uniform_time_s(problem, tables),
        "dp_s": dp.time_s,
        "dp_time_s": dp_time,
        "gradient_s": gradient.time_s,
        "gradient_time_s": gradient_time,
        "gradient_compile_s": max(first - gradient_time, 0.0),
        "coordinate_s": coordinate.time_s,
        "coordinate_time_s": coordinate_time,
        "coordinate_budget_s": budget,
        "gap_to_dp_pct": pct(gradient.time_s, dp.time_s),
        "gap_to_coordinate_pct": pct(gradient.time_s, coordinate.time_s),
        "gradient_rounded_s": float(np.min(np.where(excess > 0, np.inf, rounded_s))),
        "uniform_polished_s": None if polished_excess > 0 else float(polished_s),
        "dp": _partition_dict(dp),
        "gradient": _partition_dict(gradient),
        "coordinate": _partition_dict(coordinate),
    }


# The split of configs/plans/megatron-3d-175b.yaml (tp 8 inside a node, 16 pipeline stages, dp 8:
# 1,024 GPUs) with 1F1B instead of interleaving, microbatch 4 (48 microbatches of the 1536
# sequences), the distributed optimizer (ZeRO-1) and no sequence parallelism (as in Megatron-LM
# before Korthikanti et al.): see ``partition_case``.
BENCHMARK_PLAN = dict(
    tp=8, pp=16, dp=8, microbatch=4, global_batch=1536, zero=1, sequence_parallel=False
)


def partition_case(
    model: str = "gpt3-175b",
    cluster: str = "selene-a100-80g",
    profile=None,
    **plan_fields,
) -> tuple[PartitionProblem, str]:
    """The benchmark case "non-uniform partition of a 96-layer model", or another one.

    Default: GPT-3 175B (96 layers, vocabulary 50257) on Selene (A100 80 GB) with the
    calibrated constants, ``BENCHMARK_PLAN``: tp 8 x pp 16 x dp 8 = 1,024 GPUs, microbatch 4,
    global batch 1536 (48 microbatches), ZeRO-1, no sequence parallelism, 1F1B. Why: with
    6 layers per stage and microbatch 4, the first stage holds 16 microbatches of activations
    (1.3 GB per layer and microbatch) and needs 129 GiB without recompute, the last stage
    20 GiB: memory binds on the early stages only, so the uniform partition recomputes there
    (4, 3, 3, ... layers) while the later stages have room, and the optimum moves layers to
    the back (4 or 5 layers early, 7 late) with less recompute, 4.9% faster. With sequence
    parallelism, or microbatch 1 or 2, the 16-stage optimum stays uniform (one layer is a
    sixth of a stage: recomputing is cheaper than moving it); 8-stage plans have uneven
    optima too, but a search space of C(95, 7) partitions instead of C(95, 15).

    Args:
        model, cluster: preset names or YAML paths (``diffcost.config``).
        profile: calibration profile (``diffcost.profiles.params_for``; None: default).
        plan_fields: ``PlanSpec`` fields replacing those of ``BENCHMARK_PLAN`` (schedule is
            1f1b).

    Returns:
        (problem, one-line description).
    """

    model_spec = config.load_model(model)
    cluster_spec = config.load_cluster(cluster)
    plan = PlanSpec(schedule="1f1b", **{**BENCHMARK_PLAN, **plan_fields})
    params, note = params_for(cluster_spec, profile)
    problem = problem_for(model_spec, plan, cluster_spec, params)
    description = (
        f"{model_spec.name} ({model_spec.n_layers} layers) on {cluster_spec.name}, "
        f"{plan.n_gpus} GPUs: tp {plan.tp} x pp {plan.pp} x dp {plan.dp}, microbatch "
        f"{plan.microbatch}, global batch {plan.global_batch} "
        f"({float(problem.n_microbatches):g} microbatches), ZeRO-{plan.zero}, sequence "
        f"parallel {'on' if plan.sequence_parallel else 'off'}, 1F1B; {note}"
    )
    return problem, description


def summary_line(c: dict) -> str:
    """One line of ``compare``'s result: each solver's time, its run time and the gaps."""
    return (
        f"DP {c['dp_s']:.4g} s in {c['dp_time_s']:.3f} s; gradient "
        f"{c['gradient_s']:.4g} s in {c['gradient_time_s']:.3f} s "
        f"(gap {c['gap_to_dp_pct']:.3f}%); coordinate descent "
        f"{c['coordinate_s']:.4g} s (gradient vs it {c['gap_to_coordinate_pct']:+.2f}%)"
    )


def main(argv=None) -> int:
    """Print the benchmark case and its comparison (``--json``: one JSON object)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    problem, description = partition_case()
    result = compare(problem)
    if args.json:
        print(json.dumps({"case": description, **result}, indent=2))
        return 0
    print(description)
    print(summary_line(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
