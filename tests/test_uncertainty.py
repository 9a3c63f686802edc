"""How sure a prediction is: the posterior block round-trips, intervals widen where they should,
warnings fire where the data end, and bad blocks are refused with clear messages."""

import copy
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from test_calibration import CLUSTER, synthetic_collectives

from calibration import fit as fit_mod
from calibration import posterior
from diffcost import explain, extrapolation, predict_interval
from diffcost import profiles as prof
from diffcost import uncertainty as unc_mod
from diffcost.api import experiment_arrays, load, params_for
from diffcost.config import load_cluster
from diffcost.params import SCALAR_NAMES
from diffcost.uncertainty import Coverage, Uncertainty

# in range of vtrain-a100's runs
EXAMPLE = str(
    Path(__file__).resolve().parent.parent / "configs" / "examples" / "gpt-1b-vtrain.yaml"
)
ROUND_TRIP_TOL = 1e-5  # the block stores sds and correlations to 6 significant digits
COVERAGE = {
    "rows": 12,
    "stacks": ["NeMo"],
    "n_gpus": [8.0, 64.0],
    "model_params": [1e9, 8e9],
    "seq_len": [2048.0, 4096.0],
}


def _random_block(names, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(len(names), len(names)))
    cov = 0.01 * (a @ a.T + len(names) * np.eye(len(names)))
    return cov, unc_mod.to_block(names, cov, 0.05, 0.1, COVERAGE)


def _write(tmp_path, block, name="p.yaml"):
    path = tmp_path / name
    meta = {"layer": "cluster", "key": CLUSTER, "gpu_family": "a100"}
    values = {"gemm_eff": {"bf16": 0.8}, "attn_eff": 0.7, "host_op_s": 15e-6, "nvlink_eff": 0.8}
    return prof.write_profile(path, values, meta, block)


def test_posterior_round_trips_through_the_profile_yaml(tmp_path):
    names = ["gemm_eff.bf16", "attn_eff", "host_op_s", "nvlink_eff"]
    cov, block = _random_block(names)
    path = _write(tmp_path, block)
    unc = prof.uncertainty_for(load_cluster(CLUSTER), path)
    idx = [SCALAR_NAMES.index(n) for n in names]
    np.testing.assert_allclose(unc.cov[np.ix_(idx, idx)], cov, rtol=ROUND_TRIP_TOL, atol=1e-9)
    assert unc.residual_sd == 0.05 and unc.stack_sd == 0.1
    ranges = {k: tuple(v) for k, v in COVERAGE.items() if k not in ("rows", "stacks")}
    assert unc.cluster == Coverage(12, ("NeMo",), ranges)
    # a constant the block does not name keeps its prior width and no correlation
    other = SCALAR_NAMES.index("interference")
    assert unc.sd[other] == pytest.approx(unc_mod.PRIOR_SD[other])
    assert np.count_nonzero(unc.cov[other]) == 1


def _bad(block, path, value):
    """``block`` with the entry at ``path`` (keys / indices) set to ``value``."""
    out = copy.deepcopy(block)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("constants", 0), "gemm_eff.bf17", "unknown constant 'gemm_eff.bf17'"),
        (("sd",), [0.1, 0.2], "sd: 2 entries for 3 constants"),
        (("sd", 1), -0.1, "uncertainty.sd=-0.1: expected a finite number above 0"),
        (("correlation", 0, 1), 0.5, "correlation: the matrix is not symmetric"),
        (("correlation", 1, 1), 0.9, "1 on the diagonal"),
        (("residual_sd",), "wide", "residual_sd='wide': expected a finite number"),
        (("coverage", "n_gpus"), [64.0, 8.0], "n_gpus=[64, 8]: lowest above highest"),
        (("coverage", "rows"), -1, "rows=-1: expected a count"),
        (("spread",), 1.0, "unknown keys ['spread']"),
    ],
)
def test_bad_posterior_blocks_are_refused_with_the_field_named(tmp_path, path, value, message):
    _, block = _random_block(["gemm_eff.bf16", "attn_eff", "host_op_s"])
    profile = _write(tmp_path, _bad(block, path, value))
    with pytest.raises(prof.ProfileError) as err:
        prof.uncertainty_for(load_cluster(CLUSTER), profile)
    assert str(profile) in str(err.value) and message in str(err.value)


def test_a_correlation_matrix_that_is_not_positive_semidefinite_is_refused(tmp_path):
    _, block = _random_block(["gemm_eff.bf16", "attn_eff", "host_op_s"])
    block["correlation"] = [[1.0, 0.9, -0.9], [0.9, 1.0, 0.9], [-0.9, 0.9, 1.0]]
    with pytest.raises(prof.ProfileError, match="not positive semi-definite"):
        prof.uncertainty_for(load_cluster(CLUSTER), _write(tmp_path, block))


def test_every_shipped_profile_has_a_valid_posterior_block():
    # device, cluster and population profiles (stack files hold offsets, not constants)
    for path in sorted(
        set(prof.PROFILES_DIR.glob("*.yaml")) - set(prof.PROFILES_DIR.glob("stack-*"))
    ):
        doc = yaml.safe_load(path.read_text())
        parsed = unc_mod.parse_block(doc[prof.UNCERTAINTY_KEY], str(path))
        assert parsed["residual_sd"] > 0 and np.all(np.linalg.eigvalsh(parsed["cov"]) > -1e-9)


def test_interval_contains_the_prediction_and_widens_for_an_unknown_stack():
    seen = predict_interval(EXAMPLE)
    unseen = predict_interval(EXAMPLE, stack="an-unmeasured-framework")
    assert seen.stack_seen and not unseen.stack_seen
    assert seen.low_s < seen.iteration_s < seen.high_s
    assert unseen.iteration_s == seen.iteration_s
    assert unseen.low_s < seen.low_s and unseen.high_s > seen.high_s
    assert unseen.spread.stack_sd > 0 and seen.spread.stack_sd == 0
    # the stack the profile was fitted on (vTrain's Megatron-DeepSpeed) is seen
    assert predict_interval(EXAMPLE, stack="Megatron-DeepSpeed").stack_seen


def test_interval_widens_when_a_constant_s_posterior_widens():
    exp = load(EXAMPLE)
    unc = prof.uncertainty_for(exp.cluster)
    base = predict_interval(exp, uncertainty=unc)
    k = SCALAR_NAMES.index("gemm_eff.bf16")  # the example's GEMMs run in bf16
    cov = unc.cov.copy()
    cov[k, k] *= 16.0
    wider = predict_interval(exp, uncertainty=unc.replace(cov=cov))
    assert wider.spread.posterior_sd > base.spread.posterior_sd
    assert wider.high_s / wider.low_s > base.high_s / base.low_s


def test_jacobian_is_the_elasticity_of_log_constants_and_vmap_matches():
    exp = load(EXAMPLE)
    params, _ = params_for(exp)
    arrays = experiment_arrays(exp)
    out, jac = unc_mod.log_time_jacobian(*arrays, params)
    rows = {r["key"]: r["elasticity"] for r in explain.elasticities(exp, params)}
    for name in ("iteration_overhead_s", "host_op_s", "kernel_overhead_s"):
        assert float(jac[SCALAR_NAMES.index(name)]) == pytest.approx(rows[name], abs=1e-5)
    stacked = jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * 2), (*arrays, params))
    outs, jacs = unc_mod.log_time_jacobians(*stacked)
    np.testing.assert_allclose(np.asarray(jacs)[1], np.asarray(jac), rtol=1e-5, atol=1e-8)
    assert float(outs.iteration_s[0]) == pytest.approx(float(out.iteration_s), rel=1e-6)


def test_no_warning_for_an_in_range_shipped_example():
    assert predict_interval(EXAMPLE).warnings == ()


def test_warnings_for_an_out_of_range_gpu_count_and_a_family_without_runs():
    far = predict_interval(EXAMPLE, ["gpus=64", "plan.dp=16", "plan.global_batch=128"])
    assert any(
        w.startswith("GPUs 64 is far outside the fitted runs (2 to 8)") for w in far.warnings
    )
    mi350 = predict_interval(EXAMPLE, ["cluster=generic-mi350"])
    assert any("no end-to-end runs of mi350 GPUs" in w for w in mi350.warnings)
    assert not mi350.stack_seen  # no runs at all: the stack spread is added


def test_scale_and_default_warnings_on_given_coverage():
    exp = load(EXAMPLE)
    runs = Coverage(5, ("NeMo",), {"n_gpus": (1.0, 2.0), "seq_len": (1024.0, 1024.0)})
    unc = Uncertainty(cov=np.diag(unc_mod.PRIOR_SD**2), device=runs, cluster=runs)
    rows = [
        {"key": "host_op_s", "group": "calibration", "name": "host time", "elasticity": 0.3},
        {"key": "nic_eff", "group": "calibration", "name": "NIC", "elasticity": 0.05},
    ]
    out = extrapolation.warnings(exp, unc, "NeMo", rows)
    assert out[0].startswith("GPUs 8 is far outside the fitted runs (1 to 2)")
    assert "host time is at its datasheet default" in out[1] and len(out) == 2  # not NIC: 0.05
    assert "software stack 'torchtitan'" in extrapolation.warnings(exp, unc, "torchtitan", [])[0]


def test_laplace_narrows_what_the_data_touch_and_keeps_the_prior_elsewhere():
    meas = synthetic_collectives()
    problem = fit_mod.build_problem(meas)
    cfg = fit_mod.FitConfig(steps=100)
    result = fit_mod.fit(meas, cfg, progress=False, problem=problem)
    blocks, spreads = posterior.laplace(problem, result, meas, cfg)
    parsed = unc_mod.parse_block(blocks[("cluster", CLUSTER)], CLUSTER)
    sd = dict(zip(parsed["names"], np.sqrt(np.diag(parsed["cov"]))))
    prior = dict(zip(SCALAR_NAMES, unc_mod.PRIOR_SD))
    assert sd["nvlink_eff"] < 0.3 * prior["nvlink_eff"]  # all-reduce tables pin NVLink
    for name in ("optimizer_bytes_per_param", "host_op_s", "gemm_eff.bf16"):  # untouched
        assert sd[name] == pytest.approx(prior[name], rel=1e-4)
    assert parsed["coverage"].rows == 0 and spreads["stack_sd"] == 0.0


def test_calibrate_writes_a_posterior_block_its_predictions_read(tmp_path, capsys):
    from diffcost import cli

    log = Path(__file__).parent / "data" / "readers_nccl_all_reduce.txt"
    out = tmp_path / "fitted.yaml"
    argv = ["calibrate", "--cluster", "dgx-h100", str(log), "--out", str(out), "--steps", "60"]
    assert cli.main([*argv, "--json"]) == 0
    capsys.readouterr()
    unc = prof.uncertainty_for(load_cluster("dgx-h100"), out)
    k = SCALAR_NAMES.index("nvlink_eff")
    assert unc.sd[k] < unc_mod.PRIOR_SD[k]  # the all-reduce log informs NVLink
    assert unc.cluster.rows == 0  # no end-to-end runs in the files


def test_constants_a_profile_file_leaves_at_defaults_keep_their_prior_width():
    cluster = load_cluster(CLUSTER)
    layered = prof.uncertainty_for(cluster)
    alone = prof.uncertainty_for(cluster, prof.cluster_path(CLUSTER))  # no device constants
    k, j = SCALAR_NAMES.index("gemm_eff.bf16"), SCALAR_NAMES.index("host_op_s")
    assert layered.sd[k] < 0.5 * unc_mod.PRIOR_SD[k]
    assert alone.sd[k] == pytest.approx(unc_mod.PRIOR_SD[k])
    assert alone.sd[j] == pytest.approx(layered.sd[j])
    assert np.count_nonzero(alone.cov[k]) == 1


def test_predict_cli_prints_the_interval_and_the_warnings(capsys):
    import json

    from diffcost import cli

    assert cli.main(["predict", EXAMPLE, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["iteration_s_low"] < d["iteration_s"] < d["iteration_s_high"]
    assert d["warnings"] == [] and d["interval"]["stack_seen"]
    # a stack no profile knows: the same constants, a wider interval and a warning
    assert cli.main(["predict", EXAMPLE, "--stack", "my-own-trainer"]) == 0
    text = capsys.readouterr().out
    low = f"{d['iteration_s_low']:.3g}"
    assert f"{d['iteration_s']:.4g} s (" in text and "software stack 'my-own-trainer'" in text
    assert f"({low}–" not in text  # the unseen stack widened it
    # a framework of a calibrated stack: its offsets apply, and vtrain-a100 has no runs of it
    assert cli.main(["predict", EXAMPLE, "--stack", "torchtitan", "--json"]) == 0
    fsdp = json.loads(capsys.readouterr().out)
    assert fsdp["interval"]["stack"] == "pytorch-fsdp" and not fsdp["interval"]["stack_seen"]
    assert fsdp["iteration_s"] != pytest.approx(d["iteration_s"], rel=1e-6)
    assert "stack-pytorch-fsdp.yaml" in fsdp["profile"]


def test_a_cluster_without_runs_sees_no_stack_and_says_so():
    """selene-a100-80g has no runs and no profile: population constants, the stack spread and
    a warning, whatever stack is named."""
    plain = predict_interval("gpt3-175b.yaml")
    named = predict_interval("gpt3-175b.yaml", stack="megatron-core")
    for p in (plain, named):
        assert not p.stack_seen and p.spread.stack_sd > 0
        assert any("no end-to-end runs of selene-a100-80g" in w for w in p.warnings)


def test_fold_covariance_narrows_what_kept_rows_touch_and_is_the_prior_without_rows():
    meas = synthetic_collectives()
    problem = fit_mod.build_problem(meas)
    cfg = fit_mod.FitConfig(steps=100)
    tables = fit_mod.fit(meas, cfg, progress=False, problem=problem).tables
    prior = posterior.prior_widths(problem) ** 2
    n = problem.counts["coll"]
    none = posterior.fold_covariance(problem, tables, {"coll": np.zeros(n)}, cfg)
    np.testing.assert_allclose(none, np.diag(prior), rtol=1e-12)
    cov = posterior.fold_covariance(problem, tables, {"coll": np.ones(n)}, cfg)
    ncl = len(posterior.CLU_ENTRIES)
    nf_nd = len(problem.families) * len(posterior.DEV_ENTRIES)
    names = [name for _, name, *_ in posterior.CLU_ENTRIES]
    j = nf_nd + problem.clusters.index(CLUSTER) * ncl + names.index("nvlink_eff")
    assert cov[j, j] < 0.1 * prior[j]  # the all-reduce tables pin NVLink
    half = posterior.fold_covariance(problem, tables, {"coll": np.ones(n)}, cfg, n // 2)
    assert half[j, j] == pytest.approx(cov[j, j], rel=0.5)  # half the rows, each counted twice
    k = nf_nd + problem.clusters.index(CLUSTER) * ncl + names.index("host_op_s")
    assert cov[k, k] == pytest.approx(prior[k], rel=1e-6)  # no collective moves it


def test_flat_jacobians_place_each_row_at_its_family_and_cluster():
    problem = fit_mod.Problem(["a100", "h100"], ["x", "y", "z"], data={}, counts={})
    jac = np.arange(2 * len(SCALAR_NAMES), dtype=float).reshape(2, -1) + 1.0
    full = posterior.flat_jacobians(problem, jac, families=[1, 0], clusters=[2, 0])
    nd, ncl = len(posterior.DEV_ENTRIES), len(posterior.CLU_ENTRIES)
    dev_k = [k for k, *_ in posterior.DEV_ENTRIES]
    clu_k = [k for k, *_ in posterior.CLU_ENTRIES]
    np.testing.assert_array_equal(full[0, nd : 2 * nd], jac[0, dev_k])
    np.testing.assert_array_equal(full[0, 2 * nd + 2 * ncl :], jac[0, clu_k])
    np.testing.assert_array_equal(full[1, :nd], jac[1, dev_k])
    np.testing.assert_array_equal(full[1, 2 * nd : 2 * nd + ncl], jac[1, clu_k])
    assert np.count_nonzero(full, axis=1).tolist() == [len(SCALAR_NAMES)] * 2
