"""``Params.step_compute``: the compute rate of a training step's kernels against a lone
kernel's, read by end-to-end predictions only, and what a GPU family without runs gets."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from calibration import command
from calibration import fit as fit_mod
from calibration.heldout import E2E_ONLY_DEVICE_LEAVES, fill_uninformed, population_row
from calibration.readers import load
from diffcost import api, microbench
from diffcost.params import CONSTANT, SCALAR_NAMES, default_params

TEMPERATURE = fit_mod.FitConfig().temperature
DATA = Path(__file__).parent / "data"


def test_step_compute_is_a_device_constant_defaulting_to_no_change():
    c = CONSTANT["step_compute"]
    assert c.level == "device" and c.default == 1.0 and c.leaf in E2E_ONLY_DEVICE_LEAVES


def test_it_slows_a_training_step_but_not_a_kernel_measured_alone():
    exp = api.load("configs/examples/gpt3-175b.yaml")
    model, plan, cluster = api.experiment_arrays(exp)
    params = default_params()
    slow = params.replace(step_compute_log=params.step_compute_log + np.log(0.5))
    step = api.simulate_jit(model, plan, cluster, params).iteration_s
    slowed = api.simulate_jit(model, plan, cluster, slow).iteration_s
    assert float(slowed) > 1.3 * float(step)  # most of a 175B step is compute-bound kernels
    gemm = microbench.target_gemms(exp)[0]
    _, grad = microbench.gemm_log_time_jacobian(exp, gemm, params)
    assert float(np.asarray(grad)[SCALAR_NAMES.index("step_compute")]) == 0.0


def test_a_family_without_runs_takes_the_mean_of_the_families_with_runs():
    meas = load([DATA / "e2e_sample.csv", DATA / "readers_collectives.csv"])
    problem = fit_mod.build_problem(meas)
    fams = np.asarray(problem.data["e2e"]["d"])
    assert len(set(fams)) >= 3
    dev, clu = fit_mod.initial_tables(problem)
    values = np.log(np.linspace(0.7, 0.9, len(problem.families)))
    dev["step_compute_log"] = jnp.asarray(values, dev["step_compute_log"].dtype)
    lone = int(fams[0])
    weights = {lvl: np.ones(n) for lvl, n in problem.counts.items()}
    weights["e2e"] = (fams != lone).astype(float)
    with_runs = {problem.clusters[c] for c in np.asarray(problem.data["e2e"]["c"])[fams != lone]}
    population = population_row(problem, (dev, clu), with_runs)
    filled, _ = fill_uninformed(problem, (dev, clu), weights, population, TEMPERATURE)
    others = sorted(set(fams[fams != lone].tolist()))
    expect = np.mean(values[others])
    assert float(filled["step_compute_log"][lone]) == pytest.approx(expect, rel=1e-5)
    np.testing.assert_allclose(np.asarray(filled["step_compute_log"])[others], values[others],
                               rtol=1e-6)  # fmt: skip
    result = fit_mod.FitResult({}, {}, {}, [], 0, 0.0, True, {}, {}, tables=(dev, clu))
    shipped = command.with_population(result, problem, with_runs, TEMPERATURE)
    # every family of the problem has runs here: the shipped device values keep their own
    name = problem.families[lone]
    assert shipped.device_values[name]["step_compute"] == pytest.approx(np.exp(values[lone]))
