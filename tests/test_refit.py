"""The few-shot refit (``calibration.refit``): a handful of runs update fitted constants as a
maximum a posteriori estimate around them, its strength chosen by leave-one-out over the runs."""

import dataclasses

import numpy as np
import pytest
from helpers import GPT, LLAMA, PLANS

from calibration import fit as fit_mod
from calibration import posterior
from calibration import refit as refit_mod
from calibration.records import E2ERecord, Measurements
from diffcost import profiles as prof
from diffcost.config import load_cluster
from diffcost.params import default_params

CLUSTER = "vtrain-a100"
TRUE_GEMM_SHIFT = -0.6  # raw (logit) shift of the bf16 GEMM efficiency that made the "runs"
NOISE = 0.01  # log noise of the synthetic runs
LOO_RTOL = 1e-6


def _runs(n: int) -> Measurements:
    cluster = load_cluster(CLUSTER)
    plans = ["single", "dp8", "tp4pp2", "3d-interleaved", "fsdp", "gpipe", "cp2"]
    records = []
    for i in range(n):
        model = GPT if i % 2 == 0 else LLAMA
        plan = PLANS[plans[i % len(plans)]]
        plan = dataclasses.replace(plan, microbatch=plan.microbatch * (1 + i // len(plans)))
        plan = dataclasses.replace(plan, global_batch=plan.global_batch * (1 + i // len(plans)))
        records.append(E2ERecord(model, plan, cluster, 1.0, "synthetic", i, (), None))
    return Measurements(e2e=records)


def _problem_with_truth(n: int = 6):
    """(problem whose runs' times the model made at a slower bf16 GEMM, the start tables: the
    defaults, the true flat shift)."""
    problem = fit_mod.build_problem(_runs(n))
    start = fit_mod.initial_tables(problem)
    names = [e[1] for e in posterior.DEV_ENTRIES]
    truth = np.zeros(posterior.flat_scalars(start).size)
    truth[names.index("gemm_eff.bf16")] = TRUE_GEMM_SHIFT
    logs = _predict(refit_mod.add_flat(start, truth), problem)
    noise = NOISE * np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
    data = {"e2e": {**problem.data["e2e"], "log_meas": np.asarray(logs) + noise}}
    return fit_mod.Problem(problem.families, problem.clusters, data, problem.counts), start, truth


def _predict(tables, problem):
    return posterior.predict_log(*tables, problem.data, 1e-3)["e2e"]


def _prior_distance(start, tables, problem) -> float:
    move = posterior.flat_scalars(tables) - posterior.flat_scalars(start)
    return float(np.sum(np.square(move / posterior.prior_widths(problem))))


def test_loo_errors_equal_refits_without_each_run():
    rng = np.random.default_rng(0)
    design = rng.normal(size=(5, 7))
    var = rng.uniform(0.2, 2.0, size=7)
    resid = rng.normal(size=5)
    alpha = 0.3
    closed = refit_mod.loo_errors(design, var, resid, alpha)
    for i in range(5):
        keep = np.arange(5) != i
        j = design[keep]
        delta = var * (j.T @ np.linalg.solve((j * var) @ j.T + alpha * np.eye(4), resid[keep]))
        assert closed[i] == pytest.approx(resid[i] - design[i] @ delta, rel=LOO_RTOL)


def test_three_runs_move_the_rest_toward_the_truth_and_stay_near_the_prior():
    problem, start, _ = _problem_with_truth()
    shot, rest = np.arange(3), np.arange(3, 6)
    done = refit_mod.refit(problem, start, shot)
    # leave-one-out over the three runs picks a finite strength: they predict each other
    assert done.strength in refit_mod.STRENGTHS
    assert done.loo_mse[done.strength] < done.loo_mse[np.inf]
    meas = np.asarray(problem.data["e2e"]["log_meas"])[rest]
    before = np.abs(np.asarray(_predict(start, problem))[rest] - meas)
    after = np.abs(np.asarray(_predict(done.tables, problem))[rest] - meas)
    assert after.mean() < 0.5 * before.mean()
    # with the model's residual spread known, the runs are matched no closer than it
    floored = refit_mod.refit(problem, start, shot, noise_sd=0.05)
    assert floored.strength is None or floored.strength >= 0.05**2
    # an (almost) unregularised refit of the same runs moves the constants further
    loose = refit_mod.refit(problem, start, shot, strengths=(1e-9,))
    assert _prior_distance(start, done.tables, problem) < _prior_distance(
        start, loose.tables, problem
    )


def test_runs_that_contradict_each_other_leave_the_start():
    """Three runs measured twice, once 5% slower and once 5% faster than the start predicts:
    any update one copy asks for the other contradicts, so under leave-one-out no update
    beats the start's own errors and the constants stay."""
    runs = _runs(3)
    problem = fit_mod.build_problem(Measurements(e2e=runs.e2e * 2))
    start = fit_mod.initial_tables(problem)
    noise = 0.05 * np.repeat([1.0, -1.0], 3)
    data = {
        "e2e": {**problem.data["e2e"], "log_meas": np.asarray(_predict(start, problem)) + noise}
    }
    problem = fit_mod.Problem(problem.families, problem.clusters, data, problem.counts)
    done = refit_mod.refit(problem, start)
    assert done.strength is None
    assert _prior_distance(start, done.tables, problem) == 0.0


def test_calibrate_refits_a_handful_of_runs():
    problem, _, _ = _problem_with_truth()
    result, done = refit_mod.fit_with_runs(
        Measurements(), fit_mod.FitConfig(), False, problem, start=None, noise_sd=NOISE
    )
    assert done is not None and done.strength is not None
    before = np.abs(result.initial_residuals["e2e"]).mean()
    assert np.abs(result.residuals["e2e"]).mean() < 0.5 * before
    # the runs were made with a slower bf16 GEMM than the start's: the refit lowers it
    default = prof.to_values(default_params(family="a100"))["gemm_eff"]["bf16"]
    assert result.device_values["a100"]["gemm_eff"]["bf16"] < default


def test_a_refit_needs_a_run():
    problem, start, _ = _problem_with_truth(3)
    with pytest.raises(ValueError, match="at least one end-to-end run"):
        refit_mod.refit(problem, start, rows=[])


def test_calibrate_command_reports_the_few_shot_update(tmp_path, capsys):
    """``diffcost calibrate`` with a handful of end-to-end runs (12 of vTrain's): from the
    shipped profile (a residual spread known) the few-shot refit, its leave-one-out errors
    reported, never worse on the runs than the start; from the datasheet defaults the
    descent."""
    import json
    from pathlib import Path

    from diffcost import cli

    sample = Path(__file__).parent / "data" / "e2e_sample.csv"
    out = tmp_path / "fitted.yaml"
    argv = ["calibrate", "--cluster", "vtrain-a100", str(sample), "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    few = summary["few_shot"]
    assert few["runs"] == summary["rows"]["e2e"]["rows"] == 12
    assert "none" in few["loo_mean_abs_log_error"]
    e2e = summary["rows"]["e2e"]
    assert e2e["mape_after_pct"] <= e2e["mape_before_pct"] + 1e-6
    assert summary["written"] == [str(out)]
    assert summary["max_steps"] == fit_mod.FitConfig().steps  # the default step limit
    assert cli.main([*argv, "--from", "none", "--steps", "20"]) == 0
    assert json.loads(capsys.readouterr().out)["few_shot"] is None


def test_members_are_refitted_by_their_mean_log_time_and_shifted_alike():
    """A population start (a list of members): each run's residual is that of the members'
    mean log time, and the update is one shift of every member. Two members on either side of
    the start (bf16 GEMM efficiency +- 0.3 in logit) fit the same runs as the start does, to the first order."""
    problem, start, _ = _problem_with_truth()
    shot = np.arange(3)
    names = [e[1] for e in posterior.DEV_ENTRIES]
    spread = np.zeros(posterior.flat_scalars(start).size)
    spread[names.index("gemm_eff.bf16")] = 0.3
    members = [refit_mod.add_flat(start, spread), refit_mod.add_flat(start, -spread)]
    done = refit_mod.refit(problem, members, shot, strengths=(1e-2,))
    assert isinstance(done.tables, list) and len(done.tables) == 2
    shifts = [posterior.flat_scalars(t) - posterior.flat_scalars(m)
              for t, m in zip(done.tables, members)]  # fmt: skip
    np.testing.assert_allclose(shifts[0], shifts[1], atol=1e-6)
    assert np.abs(shifts[0]).max() > 1e-3  # the runs did move it
    logs = np.mean([np.asarray(_predict(m, problem)) for m in members], axis=0)
    meas = np.asarray(problem.data["e2e"]["log_meas"])
    np.testing.assert_allclose(done.initial_residuals, (logs - meas)[shot], rtol=1e-6)
    one = refit_mod.refit(problem, start, shot, strengths=(1e-2,))
    move = posterior.flat_scalars(one.tables) - posterior.flat_scalars(start)
    np.testing.assert_allclose(shifts[0], move, atol=0.05 * np.abs(move).max())


def _runs_on(tmp_path, cluster: str, n: int):
    """The first ``n`` runs of the shared e2e sample, moved to ``cluster``."""
    import csv
    from pathlib import Path

    sample = Path(__file__).parent / "data" / "e2e_sample.csv"
    with open(sample, newline="") as fh:
        rows = list(csv.DictReader(fh))[:n]
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**r, "cluster": cluster} for r in rows)
    return path


def test_calibrate_keeps_the_members_of_a_cluster_without_a_profile(tmp_path, capsys):
    """A handful of runs of a cluster without a profile of its own (selene-a100-80g, predicted
    as the median over the population's members): calibrate shifts every member alike and the
    profile keeps them, so predictions with it are that median, as before calibrating; the
    'before' column is the zero-shot median and validate reproduces the 'after' column."""
    import json

    from diffcost import api, cli
    from diffcost.validate import validate

    cluster = load_cluster("selene-a100-80g")
    n_members = prof.population_size(cluster)
    assert n_members > 1  # the shipped population lists members
    runs, out = _runs_on(tmp_path, cluster.name, 5), tmp_path / "selene.yaml"
    argv = ["calibrate", "--cluster", cluster.name, str(runs), "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["few_shot"]["members"] == n_members
    members = prof.population_members(cluster, out)
    assert len(members) == n_members == prof.population_size(cluster, out)
    assert list(prof.population_named(cluster, out)) == list(prof.population_named(cluster))
    e2e = summary["rows"]["e2e"]
    zero_shot = validate(str(runs))["summary"]["mape_pct"]
    assert e2e["mape_before_pct"] == pytest.approx(zero_shot, rel=1e-4)
    with_profile = validate(str(runs), profile=str(out))
    assert with_profile["summary"]["mape_pct"] == pytest.approx(e2e["mape_after_pct"], rel=1e-3)
    assert e2e["mape_after_pct"] < e2e["mape_before_pct"]
    exp = api.load("configs/examples/gpt3-175b.yaml")
    times = [float(api.predict(exp, params=p).iteration_s) for p in members]
    assert np.ptp(np.log(times)) > 1e-3  # the members still differ
    median = float(np.exp(np.mean(np.log(times))))
    assert float(api.predict(exp, profile=str(out)).iteration_s) == pytest.approx(median, 1e-5)


def test_a_profile_of_a_cluster_with_its_own_keeps_no_members(tmp_path, capsys):
    """vtrain-a100 has a shipped profile: calibrate refits one set of constants, as before."""
    from diffcost import cli

    runs, out = _runs_on(tmp_path, CLUSTER, 5), tmp_path / "vt.yaml"
    argv = ["calibrate", "--cluster", CLUSTER, str(runs), "--out", str(out), "--json"]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert prof.population_members(load_cluster(CLUSTER), out) == []


def test_malformed_members_of_a_profile_file_are_named(tmp_path):
    import yaml

    path = tmp_path / "bad.yaml"
    doc = {"layer": "cluster+device", "key": "selene-a100-80g", "constants": {}, "members": [1]}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(prof.ProfileError, match=r"bad.yaml: members: expected a mapping"):
        prof.population_members(load_cluster("selene-a100-80g"), path)
