"""Which runs to measure: the variance formula against Bayes' rule, greedy picks that never
widen the target and never repeat, the preference for the constant the target is most
sensitive to, the candidate runs (valid, reproducible from their overrides), several targets
as one design, and the CLI."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from diffcost import cli, profiles
from diffcost import microbench as mb
from diffcost import suggest as sg
from diffcost.api import experiment_arrays, load, params_for
from diffcost.cli.suggest import merged
from diffcost.params import SCALAR_NAMES
from diffcost.uncertainty import (
    log_time_jacobian,
    prior_uncertainty,
    raw_scalars,
    with_raw_scalars,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "configs" / "examples" / "gpt-1b-vtrain.yaml")


def _random_problem(n=6, m=9, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, n))
    cov = 0.05 * (a @ a.T) + 0.01 * np.eye(n)
    return rng.normal(size=n), rng.normal(size=(m, n)), cov


def _posterior(cov, rows, noise_var):
    """Sigma after observing ``rows`` (information form: precision adds ``j j^T / s^2``)."""
    precision = np.linalg.inv(cov) + sum(np.outer(j, j) for j in rows) / noise_var
    return np.linalg.inv(precision)


def test_variance_after_is_bayes_rule():
    t, cands, cov = _random_problem()
    noise_var = 0.02
    for c in cands:
        direct = _posterior(cov, [c], noise_var)
        assert sg.variance_after(t, c, cov, noise_var) == pytest.approx(t @ direct @ t, rel=1e-9)
        np.testing.assert_allclose(sg.condition(cov, c, noise_var), direct, rtol=1e-8, atol=1e-12)
        assert sg.variance_after(t, c, cov, noise_var) < t @ cov @ t


def test_greedy_picks_are_distinct_and_never_widen_the_target():
    t, cands, cov = _random_problem(m=7, seed=1)
    noise_var = 0.01
    picks = sg.greedy_design(t, cands, cov, noise_var, budget=10)
    idx = [i for i, _ in picks]
    assert len(idx) == len(cands) and len(set(idx)) == len(idx)  # capped at m, no repeats
    variances = [t @ cov @ t] + [v for _, v in picks]
    assert all(b <= a + 1e-12 for a, b in zip(variances, variances[1:]))
    # the sequential rank-one updates give the joint posterior of every pick so far
    for k in range(1, len(idx) + 1):
        joint = _posterior(cov, cands[idx[:k]], noise_var)
        assert picks[k - 1][1] == pytest.approx(t @ joint @ t, rel=1e-7, abs=1e-12)
    # the first pick is the best single candidate
    singles = [sg.variance_after(t, c, cov, noise_var) for c in cands]
    assert idx[0] == int(np.argmin(singles))
    with pytest.raises(ValueError, match="budget"):
        sg.greedy_design(t, cands, cov, noise_var, budget=0)


def test_prefers_the_constant_the_target_is_most_sensitive_to():
    exp = load(EXAMPLE)
    params, _ = params_for(exp)
    _, jac = log_time_jacobian(*experiment_arrays(exp), params)
    jac = np.asarray(jac, dtype=float)
    unc = prior_uncertainty()  # uncorrelated constants at their prior widths
    share = jac**2 * np.diag(unc.cov)  # each constant's part of J Sigma J^T
    first, second = np.argsort(share)[::-1][:2]
    assert share[first] > share[second] > 0, SCALAR_NAMES[first]
    n = len(SCALAR_NAMES)
    aligned, other = np.eye(n)[first], np.eye(n)[second]
    # orthogonal to the target in the posterior metric: j Sigma J^T = 0
    g = unc.cov @ jac
    rng = np.random.default_rng(0)
    orthogonal = rng.normal(size=n)
    orthogonal -= (orthogonal @ g) / (g @ g) * g
    cands = np.stack([orthogonal, other, aligned])
    costs = [1.0, 2.0, 3.0]  # the aligned run is the dearest: only the variance puts it first
    picks = sg.greedy_design(jac, cands, unc.cov, 0.02**2, budget=3, costs=costs)
    assert [i for i, _ in picks] == [2, 1, 0]
    # alone, the orthogonal one tells nothing about the target
    v = jac @ unc.cov @ jac
    assert sg.variance_after(jac, orthogonal, unc.cov, 0.02**2) == pytest.approx(v, rel=1e-9)


def test_suggest_on_an_example():
    exp = load(EXAMPLE)
    params, _ = params_for(exp)
    unc = profiles.uncertainty_for(exp.cluster)
    design = sg.suggest(exp, params, unc, budget=4, microbenchmarks=False)
    assert design.n_candidates >= 4
    picked = [s.candidate.label for s in design.suggestions]
    assert len(picked) == 4 and len(set(picked)) == 4
    widths = [design.suggestions[0].width_before_pct] + [
        s.width_after_pct for s in design.suggestions
    ]
    assert widths[0] == pytest.approx(sg.width_pct(design.spread.log_sd))
    assert all(b <= a + 1e-9 for a, b in zip(widths, widths[1:]))
    assert widths[-1] >= sg.width_pct(unc.residual_sd) - 1e-9  # the residual spread stays
    for s in design.suggestions:
        run = s.candidate.experiment
        assert (
            s.candidate.kind == "run"
            and run.plan.n_gpus in (8, 16)
            and run.model.n_layers < exp.model.n_layers
        )
        assert s.gpu_s == pytest.approx(s.time_s * run.plan.n_gpus)
        # the overrides reproduce the run through the config loader (its plan checks included)
        again = load(EXAMPLE, s.candidate.overrides)
        assert again.plan == run.plan and again.model.n_layers == run.model.n_layers
    with pytest.raises(ValueError, match="budget"):
        sg.suggest(exp, params, unc, budget=0)
    with pytest.raises(ValueError, match="micro_noise_sd=-0.1"):
        sg.suggest(exp, params, unc, micro_noise_sd=-0.1)


def test_an_unseen_stack_is_narrowed_by_runs_not_by_microbenchmarks():
    exp = load(EXAMPLE)
    params, _ = params_for(exp)
    unc = profiles.uncertainty_for(exp.cluster).replace(stack_sd=0.15)
    with_stack = sg.width_pct(np.hypot(unc.residual_sd, unc.stack_sd))
    micro = sg.candidate_microbenchmarks(exp)
    assert {c.kind for c in micro} == {"gemm", "attention", "collective"}
    only_micro = sg.suggest(exp, params, unc, budget=3, candidates=micro, stack_seen=False)
    assert only_micro.suggestions[-1].width_after_pct >= with_stack
    design = sg.suggest(exp, params, unc, budget=1, stack_seen=False)
    assert design.suggestions[0].candidate.kind == "run"
    assert design.suggestions[0].width_after_pct < 0.5 * with_stack


@pytest.mark.parametrize("kind", ["gemm", "attention", "collective"])
def test_microbenchmark_jacobians_match_finite_differences(kind):
    exp = load(EXAMPLE)
    params, _ = params_for(exp)
    cand = next(c for c in sg.candidate_microbenchmarks(exp) if c.kind == kind)
    fn = {
        "gemm": mb.gemm_log_time_jacobian,
        "attention": mb.attention_log_time_jacobian,
        "collective": mb.collective_log_time_jacobian,
    }[kind]
    _, jac = fn(exp, cand.bench, params)
    jac = np.asarray(jac)
    assert np.abs(jac).max() > 0.05
    raw = np.asarray(raw_scalars(params))
    step = 1e-5
    for k in np.argsort(np.abs(jac))[::-1][:3]:  # the three largest entries
        plus, minus = raw.copy(), raw.copy()
        plus[k] += step
        minus[k] -= step
        hi = fn(exp, cand.bench, with_raw_scalars(params, plus))[0]
        lo = fn(exp, cand.bench, with_raw_scalars(params, minus))[0]
        assert jac[k] == pytest.approx((hi - lo) / (2 * step), rel=1e-4, abs=1e-8)


def test_candidates_are_valid_slices():
    exp = load(EXAMPLE)
    cands = sg.candidate_runs(exp)
    assert cands
    for c in cands:
        p = c.experiment.plan
        assert p.n_gpus in (8, 16) and p.microbatch == exp.plan.microbatch
        assert c.experiment.model.seq_len == exp.model.seq_len
        assert c.experiment.model.n_layers % p.pp == 0
        assert c.experiment.model.n_layers // p.pp in sg.LAYERS_PER_STAGE
    assert len({c.label for c in cands}) == len(cands)


def test_cli_suggest_json(capsys):
    assert cli.main(["suggest", EXAMPLE, "--budget", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) == {"target", "targets", "suggestions", "n_candidates", "noise_sd"}
    assert {s["kind"] for s in d["suggestions"]} <= {"run", "gemm", "attention", "collective"}
    assert d["target"]["iteration_s"] > 0 and len(d["suggestions"]) == 2
    first = d["suggestions"][0]
    assert first["gpu_s"] == pytest.approx(first["time_s"] * first["n_gpus"])
    assert first["target_width_after_pct"] <= first["target_width_before_pct"]


def test_suggested_runs_reproduce_from_a_target_with_overrides(capsys):
    target = ["plan.tp=4", "plan.dp=1", "plan.microbatch=2", "plan.global_batch=32"]
    argv = ["suggest", EXAMPLE, *target, "--budget", "3", "--runs-only", "--json"]
    assert cli.main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    exp = load(EXAMPLE, target)
    for s in d["suggestions"]:
        run = load(EXAMPLE, merged(target, s["overrides"]))
        assert run.plan.n_gpus == s["n_gpus"] and run.plan.microbatch == 2
        assert run.model.n_layers < exp.model.n_layers
        # the run loaded from the printed overrides is the run that was priced
        again = sg.suggest(exp, *_constants(exp), budget=1, candidates=[sg.Candidate("c", run)])
        assert again.suggestions[0].time_s == pytest.approx(s["time_s"], rel=1e-9)


def _constants(exp):
    return params_for(exp)[0], profiles.uncertainty_for(exp.cluster)


def test_cli_suggest_table_and_bad_budget(capsys):
    assert cli.main(["suggest", EXAMPLE, "--budget", "1", "--runs-only"]) == 0
    out = capsys.readouterr().out
    assert "what to measure" in out and "diffcost predict" in out
    assert cli.main(["suggest", EXAMPLE, "--budget", "0"]) == 2
    assert "--budget 0: must be at least 1" in capsys.readouterr().err
    assert cli.main(["suggest", EXAMPLE, "--micro-noise-sd", "-1"]) == 2
    assert "--micro-noise-sd -1.0: must be a positive number" in capsys.readouterr().err
    assert cli.main(["suggest", EXAMPLE, "--noise-sd", "nan"]) == 2
    assert "--noise-sd nan: must be a positive number" in capsys.readouterr().err


def test_noisier_microbenchmarks_shrink_the_target_less():
    exp = load(EXAMPLE)
    params, _ = params_for(exp)
    unc = profiles.uncertainty_for(exp.cluster)
    micro = sg.candidate_microbenchmarks(exp)
    sharp = sg.suggest(exp, params, unc, budget=2, candidates=micro, micro_noise_sd=0.01)
    blunt = sg.suggest(exp, params, unc, budget=2, candidates=micro, micro_noise_sd=0.2)
    assert blunt.suggestions[-1].log_sd_after > sharp.suggestions[-1].log_sd_after


def test_several_targets_minimise_their_mean_variance():
    rng = np.random.default_rng(3)
    _, cands, cov = _random_problem(m=9, seed=2)
    targets = rng.normal(size=(5, cands.shape[1]))
    noise_var = 0.01
    picks = sg.greedy_design(targets, cands, cov, noise_var, budget=3)
    idx = [i for i, _ in picks]
    # each pick's figure is the mean of the targets' variances under the joint posterior
    for k in range(1, 4):
        joint = _posterior(cov, cands[idx[:k]], noise_var)
        mean = np.mean([t @ joint @ t for t in targets])
        assert picks[k - 1][1] == pytest.approx(mean, rel=1e-7)
    # the first pick is the candidate of smallest mean variance, found by brute force
    means = [np.mean([sg.variance_after(t, c, cov, noise_var) for t in targets]) for c in cands]
    assert idx[0] == int(np.argmin(means))
    # one target as a row or as a vector: the same design
    one = sg.greedy_design(targets[0], cands, cov, noise_var, budget=3)
    assert one == sg.greedy_design(targets[:1], cands, cov, noise_var, budget=3)
    # the mean variance is not the variance of the mean: here the two pick differently
    of_mean = sg.greedy_design(targets.mean(0), cands, cov, noise_var, budget=3)
    assert [i for i, _ in of_mean] != idx


def test_several_plans_are_one_design():
    a = load(EXAMPLE)
    b = load(EXAMPLE, ["plan.tp=4", "plan.dp=1"])
    params, unc = _constants(a)
    micro = sg.candidate_microbenchmarks(a)
    one = sg.suggest(a, params, unc, budget=2, candidates=micro)
    # the same plan twice is the one-target design
    twice = sg.suggest(a, params, unc, budget=2, candidates=micro, others=[a])
    assert [s.candidate.label for s in twice.suggestions] == [
        s.candidate.label for s in one.suggestions
    ]
    for s, t in zip(one.suggestions, twice.suggestions):
        assert t.log_sd_after == pytest.approx(s.log_sd_after, rel=1e-9)
        assert t.targets_log_sd_after == pytest.approx((s.log_sd_after,) * 2, rel=1e-9)
    # two plans: each target's figures are its own, and the design's the root mean square
    both = sg.suggest(a, params, unc, budget=2, candidates=micro, others=[b])
    alone = sg.suggest(b, params, unc, budget=1, candidates=micro)
    assert both.targets == (a, b) and both.targets_iteration_s[1] == alone.iteration_s
    assert both.targets_spread[1].log_sd == pytest.approx(alone.spread.log_sd, rel=1e-9)
    first = both.suggestions[0]
    assert first.log_sd_before**2 == pytest.approx(
        (one.spread.log_sd**2 + alone.spread.log_sd**2) / 2, rel=1e-9
    )
    for s in both.suggestions:
        assert s.log_sd_after**2 == pytest.approx(np.mean(np.square(s.targets_log_sd_after)))
    with pytest.raises(ValueError, match="stack differs"):
        sg.suggest(a, params, unc, candidates=micro, others=[dataclasses.replace(b, stack="x")])


def test_cli_suggest_several_configs(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the table's header on one line, whatever the terminal
    other = tmp_path / "tp4.yaml"
    other.write_text(f"base: {EXAMPLE}\nplan:\n  tp: 4\n  dp: 1\n")
    argv = ["suggest", EXAMPLE, str(other), "plan.microbatch=2", "--budget", "2", "--runs-only"]
    assert cli.main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [t["config"] for t in d["targets"]] == [EXAMPLE, str(other)]
    assert d["target"] == d["targets"][0] and d["targets"][1]["n_gpus"] == 8
    for s in d["suggestions"]:
        assert len(s["targets_width_after_pct"]) == 2
        # a printed run is the first target's config with its overrides and the run's
        run = load(EXAMPLE, merged(["plan.microbatch=2"], s["overrides"]))
        assert run.plan.n_gpus == s["n_gpus"] and run.plan.microbatch == 2
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "targets' mean width" in out and f"target {other}" in out
    elsewhere = tmp_path / "h100.yaml"
    elsewhere.write_text(f"base: {EXAMPLE}\ncluster: dgx-h100\n")
    assert cli.main(["suggest", EXAMPLE, str(elsewhere)]) == 2
    assert f"{elsewhere}: its cluster differs" in capsys.readouterr().err


def test_pooled_runs_reproduce_from_the_first_target():
    a = load(EXAMPLE)
    b = load(EXAMPLE, ["plan.order=[dp,tp,cp,pp]", "plan.microbatch=2"])
    pooled = sg.pooled_candidates([a, b], microbenchmarks=False)
    own = sg.candidate_runs(a)
    assert pooled[: len(own)] == own  # the first target's, as they are
    later = pooled[len(own) :]
    assert later and all("order [dp,tp,cp,pp]" in c.label for c in later)
    for c in later:
        again = load(EXAMPLE, c.overrides)  # from the first target's config
        assert again.plan == c.experiment.plan and again.plan.microbatch == 2
        assert again.model.n_layers == c.experiment.model.n_layers
