"""A cluster without a profile of its own gets the population's cluster constants: the mean
of the clusters the shipped fit has end-to-end runs of."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calibration import command
from calibration import fit as fit_mod
from calibration.heldout import (
    Predictor,
    fill_uninformed,
    population_mixture,
    population_row,
    trained_keys,
    uninformed,
)
from calibration.readers import load
from diffcost import api, population
from diffcost import profiles as prof
from diffcost.config import load_cluster
from diffcost.interval import predict_interval
from diffcost.params import default_params
from diffcost.uncertainty import SCALAR_NAMES, Uncertainty
from diffcost.validate import validate

TEMPERATURE = fit_mod.FitConfig().temperature


def test_a_cluster_without_profile_gets_the_population(tmp_path, monkeypatch):
    monkeypatch.setattr(prof, "PROFILES_DIR", tmp_path)
    selene, vtrain = load_cluster("selene-a100-80g"), load_cluster("vtrain-a100")
    _, note = prof.params_for(selene)
    assert "datasheet defaults" in note
    prof.write_profile(
        prof.population_path(), {"host_op_s": 3e-5}, {"layer": "population", "key": "population"}
    )
    prof.write_profile(prof.cluster_path("vtrain-a100"), {"host_op_s": 7e-6}, {"layer": "cluster"})
    params, note = prof.params_for(selene)
    assert float(params.host_op_s) == pytest.approx(3e-5)
    assert "population.yaml" in note and "mean of the fitted clusters" in note
    own, note = prof.params_for(vtrain)  # a cluster's own profile wins
    assert float(own.host_op_s) == pytest.approx(7e-6) and "population.yaml" not in note
    none, _ = prof.params_for(selene, "none")
    assert float(none.host_op_s) == pytest.approx(float(default_params().host_op_s))


def test_population_values_average_raw_constants_and_leave_grids_out():
    p0 = default_params()
    clu = {
        leaf: jnp.stack([getattr(p0, leaf)] * 3) for leaf in fit_mod.CLUSTER_LEAVES
    }  # clusters a, b, c
    clu["host_op_log_s"] = jnp.log(jnp.array([1e-5, 4e-5, 9e-3]))
    clu[fit_mod.CLUSTER_LAYER_LEAF] = clu[fit_mod.CLUSTER_LAYER_LEAF].at[0].add(1.0)
    problem = fit_mod.Problem(families=[], clusters=["a", "b", "c"], data={}, counts={})
    result = fit_mod.FitResult({}, {}, {}, [], 0, 0.0, True, {}, {}, tables=({}, clu))
    values = command.population_values(result, problem, ["a", "b"])  # c is left out
    assert values["host_op_s"] == pytest.approx(2e-5)  # geometric mean: raw values are logs
    assert prof.CLUSTER_LAYER_FIELD not in values and prof.HEAD_FIELD not in values
    with pytest.raises(ValueError, match="at least one fitted cluster"):
        command.population_values(result, problem, [])


def test_a_cluster_with_collectives_only_takes_the_population_for_what_they_do_not_read():
    """A cluster with collective tables but no end-to-end runs keeps the network its tables
    fit and takes the population's host and overhead constants, not the datasheet defaults
    (``command.with_population``, as the shipped profiles are written); a cluster with runs
    keeps its own. Held out of the end-to-end rows, vtrain-a100 is such a cluster
    (``heldout.fill_uninformed``), and the population's slower host dispatch slows its runs."""
    data = Path(__file__).parent / "data"
    meas = load([data / "e2e_sample.csv", data / "readers_collectives.csv"])
    problem = fit_mod.build_problem(meas)
    clusters = np.asarray(problem.data["e2e"]["c"])
    vtrain, a3 = (problem.clusters.index(c) for c in ("vtrain-a100", "gcp-a3-mega"))
    dev, clu = fit_mod.initial_tables(problem)
    clu["host_op_log_s"] = jnp.full_like(clu["host_op_log_s"], np.log(3e-5))
    clu["host_op_log_s"] = clu["host_op_log_s"].at[np.array([vtrain, a3])].set(np.log(1e-5))
    clu["nvlink_eff_logit"] = clu["nvlink_eff_logit"].at[a3].set(2.0)
    with_runs = {problem.clusters[c] for c in clusters[clusters != vtrain]}
    result = fit_mod.FitResult({}, {}, {}, [], 0, 0.0, True, {}, {}, tables=(dev, clu))
    result = command.with_population(result, problem, with_runs, TEMPERATURE)
    assert result.cluster_values["gcp-a3-mega"]["host_op_s"] == pytest.approx(3e-5)
    assert float(result.tables[1]["nvlink_eff_logit"][a3]) == pytest.approx(2.0)
    assert result.cluster_values["vtrain-a100"]["host_op_s"] == pytest.approx(1e-5)  # has runs

    weights = {lvl: np.ones(n) for lvl, n in problem.counts.items()}
    weights["e2e"] = (clusters != vtrain).astype(float)  # vtrain-a100 held out
    population = population_row(problem, (dev, clu), with_runs)
    _, filled = fill_uninformed(problem, (dev, clu), weights, population, TEMPERATURE)
    assert float(filled["host_op_log_s"][vtrain]) == pytest.approx(np.log(3e-5))
    assert float(filled["nvlink_eff_logit"][vtrain]) == float(clu["nvlink_eff_logit"][vtrain])
    e2e = {"e2e": problem.data["e2e"]}
    # one compiled program for both tables (the same shapes), not two eager traces
    predict = jax.jit(lambda clu_t: fit_mod.predict_log(dev, clu_t, e2e, TEMPERATURE)["e2e"])
    before = predict(clu)[clusters == vtrain]
    after = predict(filled)[clusters == vtrain]
    assert np.all(np.isfinite(np.asarray(after))) and np.all(np.asarray(after > before))


def test_with_end_to_end_rows_alone_every_cluster_constant_is_uninformed():
    """A problem of runs alone (no collective or kernel rows) reads no cluster constant at
    another level, so a cluster without weighted runs takes the population's every constant."""
    data = Path(__file__).parent / "data"
    problem = fit_mod.build_problem(load([data / "e2e_sample.csv"]))
    assert set(problem.data) == {"e2e"}
    clusters = np.asarray(problem.data["e2e"]["c"])
    held = clusters == clusters[0]
    weights = {"e2e": (~held).astype(float)}
    tables = fit_mod.initial_tables(problem)
    free = uninformed(problem, tables, weights, TEMPERATURE)
    assert all(v.shape == (len(problem.clusters),) and v.all() for v in free.values())
    with_runs = {problem.clusters[c] for c in clusters[~held]}
    population = population_row(problem, tables, with_runs)
    _, filled = fill_uninformed(problem, tables, weights, population, TEMPERATURE)
    j = int(clusters[0])
    assert float(filled["host_op_log_s"][j]) == pytest.approx(float(population["host_op_log_s"]))


def test_a_held_out_cluster_is_predicted_by_the_mean_of_its_members_log_times():
    """``heldout.population_mixture``: a cluster no weighted run names is predicted once with
    each fitted cluster's constants, and ``Predictor.mean_log`` averages the log times. Time is
    convex in log host dispatch, so the mean is slower than the plug-in of the mean constants
    (``population_row``) when the members differ. A GPU family without runs likewise takes
    each fitted family's ``E2E_ONLY_DEVICE_LEAVES``."""
    data = Path(__file__).parent / "data"
    meas = load([data / "e2e_sample.csv", data / "readers_collectives.csv"])
    problem = fit_mod.build_problem(meas)
    clusters = np.asarray(problem.data["e2e"]["c"])
    held = problem.clusters.index("vtrain-a100")
    dev, clu = fit_mod.initial_tables(problem)
    spread = np.log(np.geomspace(3e-6, 3e-3, len(problem.clusters)))
    clu["host_op_log_s"] = jnp.asarray(spread, clu["host_op_log_s"].dtype)
    weights = {lvl: np.ones(n) for lvl, n in problem.counts.items()}
    weights["e2e"] = (clusters != held).astype(float)
    with_runs = {problem.clusters[c] for c in clusters[clusters != held]}
    members = population_mixture(problem, (dev, clu), weights, TEMPERATURE)
    families = set(np.asarray(problem.data["e2e"]["d"])[clusters != held].tolist())
    assert len(families) < len(problem.families)  # vtrain-a100's A100s: a family without runs
    assert len(members) == len(with_runs) * len(families) > 1  # each cluster x each family
    rows = [r for r, c in zip(meas.e2e, clusters) if c == held]
    fams, clus = trained_keys(problem, weights)
    predictor = Predictor(len(rows), len(problem.families), len(problem.clusters), TEMPERATURE)
    each = [predictor(rows, problem, tab, fams, clus, row) for tab, row in members]
    mixed = predictor.mean_log(rows, problem, members, fams, clus)
    np.testing.assert_allclose(mixed, np.mean(each, axis=0), rtol=1e-6)
    mean = population_row(problem, (dev, clu), with_runs)
    filled = fill_uninformed(problem, (dev, clu), weights, mean, TEMPERATURE)
    plug_in = predictor(rows, problem, filled, fams, clus, mean)
    assert np.all(mixed > plug_in + 1e-4)


def _population_with_members(monkeypatch, tmp_path, members: dict) -> None:
    """A profiles folder holding only ``population.yaml``: the mean of ``members``'s host
    dispatch (raw values are logs: the geometric mean) and, when given, the members."""
    monkeypatch.setattr(prof, "PROFILES_DIR", tmp_path)
    mean = float(np.exp(np.mean(np.log([m["host_op_s"] for m in members.values()]))))
    meta = {"layer": "population", "key": "population"}
    prof.write_profile(prof.population_path(), {"host_op_s": mean}, {**meta, "members": members})


def test_a_cluster_without_profile_predicts_the_mean_of_the_members_log_times(
    tmp_path, monkeypatch
):
    """``diffcost.predict`` (and ``predict_interval``) on a cluster without a profile of its
    own: the population's predictive median, ``exp(mean log t(member))``, slower than the time
    at the mean constants (time is convex in log host dispatch); a cluster with its own
    profile, and a population file without members, keep their single prediction."""
    members = {"a": {"host_op_s": 1e-6}, "b": {"host_op_s": 3e-3}}
    _population_with_members(monkeypatch, tmp_path, members)
    exp = api.load("configs/examples/gpt-1b-vtrain.yaml", ["cluster=selene-a100-80g"])
    params, _ = api.params_for(exp)
    plug_in = float(api.predict(exp, params=params).iteration_s)
    each = [float(api.predict(exp, params=prof.apply_values(params, m)).iteration_s)
            for m in members.values()]  # fmt: skip
    median = float(np.exp(np.mean(np.log(each))))
    out = api.predict(exp)
    assert float(out.iteration_s) == pytest.approx(median, rel=1e-5)
    assert float(out.iteration_s) > plug_in * 1.01
    parts = sum(float(getattr(out, k)) for k in out.TIME_PARTS)
    mean_parts = np.mean([sum(float(getattr(api.predict(exp, params=prof.apply_values(
        params, m)), k)) for k in out.TIME_PARTS) for m in members.values()])  # fmt: skip
    assert parts == pytest.approx(mean_parts * median / np.mean(each), rel=1e-5)
    pred = predict_interval(exp)
    assert pred.iteration_s == pytest.approx(median, rel=1e-5) and pred.members == 2
    assert pred.low_s < pred.iteration_s < pred.high_s
    own = load_cluster("vtrain-a100")
    prof.write_profile(prof.cluster_path(own.name), {"host_op_s": 7e-6}, {"layer": "cluster"})
    assert prof.population_members(own) == [] and prof.population_members(exp.cluster, "none") == []
    prof.write_profile(prof.population_path(), {"host_op_s": 5e-5}, {"layer": "population"})
    assert prof.population_members(exp.cluster) == []  # an older file: the plug-in
    assert float(api.predict(exp).iteration_s) == pytest.approx(
        float(api.predict(exp, params=api.params_for(exp)[0]).iteration_s)
    )


def test_validate_takes_the_members_median_for_a_cluster_without_profile(tmp_path, monkeypatch):
    members = {"a": {"host_op_s": 1e-6}, "b": {"host_op_s": 3e-3}}
    _population_with_members(monkeypatch, tmp_path / "profiles", members)
    lines = (Path(__file__).parent / "data" / "e2e_sample.csv").read_text().splitlines()
    csv_path = tmp_path / "selene.csv"
    csv_path.write_text("\n".join([lines[0]] + [x.replace(",vtrain-a100,", ",selene-a100-80g,")
                                                for x in lines[1:3]]) + "\n")  # fmt: skip
    params = prof.params_for(load_cluster("selene-a100-80g"), stack="megatron-deepspeed")[0]
    each = [[r["predicted_iter_s"] for r in validate(csv_path, params=prof.apply_values(
        params, m))["rows"]] for m in members.values()]  # fmt: skip
    out = validate(csv_path)
    got = [r["predicted_iter_s"] for r in out["rows"]]
    np.testing.assert_allclose(got, np.exp(np.mean(np.log(each), axis=0)), rtol=1e-5)
    assert "median over the population's 2 members" in next(iter(out["profiles"].values()))
    assert all(r["predicted_iter_s_low"] < r["predicted_iter_s"] for r in out["rows"])


def _host_dispatch_population(monkeypatch, tmp_path):
    """(members, experiment, the population's mean Params, an Uncertainty of host dispatch
    alone, variance 1 in log): two members whose host dispatch is far apart, on a cluster
    without a profile of its own."""
    members = {"a": {"host_op_s": 1e-6}, "b": {"host_op_s": 3e-3}}
    _population_with_members(monkeypatch, tmp_path, members)
    exp = api.load("configs/examples/gpt-1b-vtrain.yaml", ["cluster=selene-a100-80g"])
    k = SCALAR_NAMES.index("host_op_s")
    cov = np.zeros((len(SCALAR_NAMES), len(SCALAR_NAMES)))
    cov[k, k] = 1.0
    return members, exp, api.params_for(exp)[0], Uncertainty(cov=cov)


def test_the_median_s_interval_propagates_the_members_mean_jacobian(tmp_path, monkeypatch):
    """The posterior part of the interval of a population median is ``|dlog T / d raw|`` of
    the median itself: shifting a constant of every member alike moves the mean log time by
    the members' mean Jacobian, not by the Jacobian at the mean constants (host dispatch far
    apart in the two members makes the two differ)."""
    members, exp, params, unc = _host_dispatch_population(monkeypatch, tmp_path)
    pred = predict_interval(exp, uncertainty=unc)
    eps = 1e-2

    def median_log(shift: float) -> float:
        times = [float(api.predict(exp, params=prof.apply_values(
            params, {"host_op_s": m["host_op_s"] * np.exp(shift)})).iteration_s)
            for m in members.values()]  # fmt: skip
        return float(np.mean(np.log(times)))

    slope = (median_log(eps) - median_log(-eps)) / (2 * eps)
    assert pred.spread.posterior_sd == pytest.approx(abs(slope), rel=0.02)
    at_mean = predict_interval(exp, params=params, uncertainty=unc)
    assert abs(at_mean.spread.posterior_sd - abs(slope)) > 0.05 * abs(slope)


def test_suggest_prices_its_target_as_predict_does(tmp_path, monkeypatch):
    """On a cluster without a profile ``suggest``'s target time and interval are
    ``predict_interval``'s: the members' median and its Jacobian, not the mean constants'."""
    from diffcost.suggest import suggest

    _, exp, params, unc = _host_dispatch_population(monkeypatch, tmp_path)
    pred = predict_interval(exp, uncertainty=unc)
    each = prof.population_members(exp.cluster, stack=exp.stack)
    design = suggest(exp, params, unc, budget=1, microbenchmarks=False, members=each)
    assert design.iteration_s == pytest.approx(pred.iteration_s, rel=1e-6)
    assert design.spread.posterior_sd == pytest.approx(pred.spread.posterior_sd, rel=1e-5)
    at_mean = suggest(exp, params, unc, budget=1, microbenchmarks=False)
    assert at_mean.iteration_s < pred.iteration_s / 1.01


def test_suggest_prices_its_candidates_as_predict_does(tmp_path, monkeypatch):
    """Each candidate ``suggest`` weighs on a cluster without a profile is priced as the
    members' median: a run's time is ``predict``'s of its experiment, a microbenchmark's the
    exponential of the members' mean log time; at the mean constants they would be faster."""
    from diffcost import suggest as sg

    _, exp, params, unc = _host_dispatch_population(monkeypatch, tmp_path)
    each = prof.population_members(exp.cluster, stack=exp.stack)
    cands = sg.candidate_runs(exp)[:3] + sg.candidate_microbenchmarks(exp)[:2]
    kept, jacs, times = sg.price(cands, params, members=each)
    assert len(kept) == len(cands) and jacs.shape == (len(cands), len(SCALAR_NAMES))
    for cand, t in zip(kept[:3], times[:3]):
        assert t == pytest.approx(float(api.predict(cand.experiment).iteration_s), rel=1e-5)
    for cand, t in zip(kept[3:], times[3:]):
        logs = [np.log(sg.price([cand], p)[2][0]) for p in each]
        assert t == pytest.approx(np.exp(np.mean(logs)), rel=1e-6)
    _, _, at_mean = sg.price(cands[:3], params)
    assert np.all(at_mean < times[:3] / 1.01)


def test_constants_for_gives_the_members_where_predict_takes_the_median():
    """``population.constants_for``: on dgx-h200 (no profile of its own) the mean constants,
    the members with a leading axis and a note that says the time is their median; on a
    cluster with a profile, or with ``--profile none``, ``params_for``'s alone."""
    h200 = load_cluster("dgx-h200")
    params, members, note = population.constants_for(h200)
    each = prof.population_members(h200)
    assert members.host_op_s.shape == (len(each),) and len(each) > 1
    assert note == f"{prof.params_for(h200)[1]}; {population.median_note(len(each))}"
    assert float(params.host_op_s) == float(prof.params_for(h200)[0].host_op_s)
    for cluster, profile in ((load_cluster("dgx-h100"), None), (h200, "none")):
        _, members, note = population.constants_for(cluster, profile)
        assert members is None and note == prof.params_for(cluster, profile)[1]


def test_tangent_weights_bound_the_median_and_touch_it_at_the_reference():
    """Member times linear in a plan ``x`` (a search's pairwise costs), weighted by
    ``tangent_weights`` at ``x0``: the sum equals the median ``exp(mean log t)`` at ``x0``
    with its gradient, and is above it everywhere else (arithmetic against geometric mean),
    so a plan that lowers the sum lowers the median."""
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.5, 2.0, (5, 3)), rng.uniform(0.1, 1.0, 5)  # t_m(x) = a_m . x + b_m
    x0 = np.array([0.2, 0.5, 0.3])
    w = population.tangent_weights(a @ x0 + b)

    def median(x):
        return jnp.exp(jnp.mean(jnp.log(a @ x + b)))

    def surrogate(x):
        return jnp.sum(w * (a @ x + b))

    assert float(surrogate(x0)) == pytest.approx(float(median(x0)), rel=1e-12)
    np.testing.assert_allclose(jax.grad(surrogate)(x0), jax.grad(median)(x0), rtol=1e-12)
    for x in rng.uniform(0.0, 1.0, (20, 3)):
        assert float(surrogate(x)) >= float(median(x)) * (1 - 1e-12)
