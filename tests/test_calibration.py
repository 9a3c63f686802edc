"""The fit recovers constants from synthetic measurements; profiles round-trip and layer."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from calibration import fit as fit_mod
from calibration import kernel_levels
from calibration.command import moved as calibrate_moved
from calibration.records import CollectiveRecord, GemmRecord, Measurements, Source
from diffcost import kernels
from diffcost import profiles as prof
from diffcost.arrays import cluster_arrays
from diffcost.config import load_cluster
from diffcost.gpus import FAMILY_CLUSTER
from diffcost.params import GEMM_GRID, GEMM_GRID_CLASSES, GEMM_GRID_LOG2_LO, default_params
from diffcost.specs import PRECISIONS

CLUSTER = "vtrain-a100"
TRUE_NVLINK_EFF = 0.6
TRUE_OVERHEAD_S = 30e-6
RECOVERY_REL = 0.03


def synthetic_collectives():
    """All-reduce times on 2-8 GPUs, 64 KiB - 1 GiB, made by the model with known constants."""
    params = prof.apply_values(
        default_params(),
        {"nvlink_eff": TRUE_NVLINK_EFF, "collective_overhead_s": TRUE_OVERHEAD_S},
    )
    cluster = cluster_arrays(load_cluster(CLUSTER))
    kind = jnp.eye(len(fit_mod.COLLECTIVES), dtype=jnp.result_type(float))[0]
    records = []
    for n in (2, 4, 8):
        for size in 2.0 ** np.arange(16, 31, 2):
            t = float(
                fit_mod._collective_time(kind, size, float(n), float(n), cluster, params, 1e-3)
            )
            records.append(
                CollectiveRecord(
                    "all_reduce",
                    size,
                    n,
                    n,
                    1,
                    1,
                    CLUSTER,
                    "fp32",
                    t,
                    "synthetic",
                    Source("synthetic", 0),
                )
            )
    return Measurements(e2e=[], collectives=records, gemms=[], skipped=[])


def test_fit_recovers_known_constants():
    meas = synthetic_collectives()
    cfg = fit_mod.FitConfig(steps=400, prior_weight=1e-7, huber_delta=0.05, tol=-1.0)
    result = fit_mod.fit(meas, cfg, progress=False)
    values = result.cluster_values[CLUSTER]
    assert values["nvlink_eff"] == pytest.approx(TRUE_NVLINK_EFF, rel=RECOVERY_REL)
    assert values["collective_overhead_s"] == pytest.approx(TRUE_OVERHEAD_S, rel=RECOVERY_REL)
    assert np.max(np.abs(result.residuals["coll"])) < 0.01
    assert result.losses[-1] < result.losses[0]


def test_every_calibrated_constant_has_a_prior_width():
    assert set(fit_mod.PRIOR_SD) == set(prof.FIELDS)
    assert all(sd > 0 for sd in fit_mod.PRIOR_SD.values())
    # the prior's curvature is 2 prior_weight / width^2 per raw constant
    problem = fit_mod.build_problem(synthetic_collectives())
    cfg = fit_mod.FitConfig()
    dev, clu = fit_mod.prior_curvature(problem, cfg)
    assert float(clu["nic_eff_logit"][0]) == pytest.approx(2 * cfg.prior_weight / 0.7**2)


def test_fit_step_compiles_once_and_reports_initial_residuals():
    meas = synthetic_collectives()
    problem = fit_mod.build_problem(meas)
    cfg = fit_mod.FitConfig(steps=3, tol=-1.0)
    step, opt = fit_mod.make_step(problem, cfg)
    tables = fit_mod.initial_tables(problem)
    state = opt.init(tables)
    with jax.numpy_dtype_promotion("standard"):
        for _ in range(3):
            tables, state, _, logs = step(tables, state, problem.data)
    jitted = step.fast if jax.default_backend() == "cpu" else step.plain
    # the tables a step returns have the types of the ones it was given: no second compile
    assert jitted._cache_size() == 1
    assert set(logs) == {"coll"}
    result = fit_mod.fit(meas, cfg, progress=False, problem=problem)
    at_defaults = (
        fit_mod.predict_log(*fit_mod.initial_tables(problem), problem.data, cfg.temperature)["coll"]
        - problem.data["coll"]["log_meas"]
    )
    np.testing.assert_allclose(result.initial_residuals["coll"], at_defaults, rtol=1e-5, atol=1e-6)
    assert not np.allclose(result.residuals["coll"], at_defaults)  # the fit moved


def test_prior_holds_constants_the_data_cannot_see():
    meas = synthetic_collectives()
    result = fit_mod.fit(meas, fit_mod.FitConfig(steps=100), progress=False)
    defaults = prof.to_values(default_params())
    # collectives say nothing about the optimizer or the host: they stay at the defaults
    for name in ("optimizer_bytes_per_param", "host_op_s", "iteration_overhead_s"):
        assert result.cluster_values[CLUSTER][name] == pytest.approx(defaults[name], rel=1e-3)


def test_profile_round_trip_and_layering(tmp_path, monkeypatch):
    monkeypatch.setattr(prof, "PROFILES_DIR", tmp_path)
    cluster = load_cluster(CLUSTER)
    params, note = prof.params_for(cluster)
    assert "datasheet defaults" in note
    prof.write_profile(
        prof.device_path("a100"), {"mem_eff": 0.7}, {"layer": "device", "key": "a100"}
    )
    prof.write_profile(
        prof.cluster_path(CLUSTER), {"nic_eff": 0.5}, {"layer": "cluster", "key": CLUSTER}
    )
    params, note = prof.params_for(cluster)
    assert "device profile device-a100.yaml" in note and "cluster profile" in note
    values = prof.to_values(params)
    assert values["mem_eff"] == pytest.approx(0.7) and values["nic_eff"] == pytest.approx(0.5)
    # another A100 cluster gets the device layer only
    other, note = prof.params_for(load_cluster("selene-a100-80g"))
    assert prof.to_values(other)["mem_eff"] == pytest.approx(0.7)
    assert prof.to_values(other)["nic_eff"] == pytest.approx(
        prof.to_values(default_params())["nic_eff"]
    )
    none, note = prof.params_for(cluster, "none")
    assert "defaults" in note and prof.to_values(none)["mem_eff"] != pytest.approx(0.7)


def test_profile_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("constants: {mem_eff: 1.5}\n")
    with pytest.raises(prof.ProfileError, match="mem_eff=1.5 is out of range"):
        prof.params_for(load_cluster(CLUSTER), bad)
    bad.write_text("constants: {memory_eff: 0.5}\n")
    with pytest.raises(prof.ProfileError, match="unknown constant 'memory_eff'"):
        prof.params_for(load_cluster(CLUSTER), bad)
    with pytest.raises(prof.ProfileError, match="does not exist"):
        prof.params_for(load_cluster(CLUSTER), tmp_path / "missing.yaml")
    with pytest.raises(prof.ProfileError, match="is a folder"):
        prof.params_for(load_cluster(CLUSTER), tmp_path)


def test_a_profile_fitted_on_another_gpu_is_refused(tmp_path):
    fitted = prof.write_profile(
        tmp_path / "a100.yaml", {"nic_eff": 0.5}, {"layer": "cluster+device", "key": CLUSTER}
    )
    params, note = prof.params_for(load_cluster("selene-a100-80g"), fitted)  # same GPU: fine
    assert prof.to_values(params)["nic_eff"] == pytest.approx(0.5)
    assert "fitted on vtrain-a100" in note and "device constants: datasheet defaults" in note
    with pytest.raises(prof.ProfileError, match=r"fitted on vtrain-a100 \(a100 GPUs\).*h100"):
        prof.params_for(load_cluster("dgx-h100"), fitted)
    device = prof.write_profile(
        tmp_path / "dev.yaml", {"mem_eff": 0.5}, {"layer": "device", "key": "h100"}
    )
    with pytest.raises(prof.ProfileError, match="fitted on h100"):
        prof.params_for(load_cluster(CLUSTER), device)


def test_assemble_gathers_layers():
    dev, clu = {}, {}
    p0 = default_params()
    for leaf in fit_mod.DEVICE_LEAVES:
        dev[leaf] = jnp.stack([getattr(p0, leaf), getattr(p0, leaf) + 1.0])
    for leaf in fit_mod.CLUSTER_LEAVES:
        clu[leaf] = jnp.stack([getattr(p0, leaf), getattr(p0, leaf) - 1.0, getattr(p0, leaf)])
    p = fit_mod.assemble(dev, clu, jnp.array([1, 0]), jnp.array([1, 2]))
    np.testing.assert_allclose(p.mem_eff_logit, [p0.mem_eff_logit + 1.0, p0.mem_eff_logit])
    np.testing.assert_allclose(p.nic_eff_logit, [p0.nic_eff_logit - 1.0, p0.nic_eff_logit])
    assert dataclasses.is_dataclass(p) and jax.tree_util.tree_leaves(p)


def test_fit_from_a_profile_keeps_what_the_data_cannot_see():
    meas = synthetic_collectives()
    problem = fit_mod.build_problem(meas)
    start = prof.apply_values(
        default_params(), {"optimizer_bytes_per_param": 12.0, "mem_eff": 0.5, "nvlink_eff": 0.9}
    )
    result = fit_mod.fit(meas, fit_mod.FitConfig(steps=100), False, problem, start={CLUSTER: start})
    # collectives say nothing about the optimizer or memory-bound kernels: they keep the
    # starting profile's values, not the datasheet's (28 B/param, 0.8)
    assert result.cluster_values[CLUSTER]["optimizer_bytes_per_param"] == pytest.approx(12.0)
    assert result.device_values["a100"]["mem_eff"] == pytest.approx(0.5, rel=1e-4)
    # "before" is the start's error, and the fit still finds the true link efficiency
    tables = fit_mod.initial_tables(problem, start={CLUSTER: start})
    at_start = np.asarray(
        fit_mod.predict_log(*tables, problem.data, 1e-3)["coll"] - problem.data["coll"]["log_meas"]
    )
    np.testing.assert_allclose(result.initial_residuals["coll"], at_start, rtol=1e-5, atol=1e-6)
    # and the fit moves the link efficiency from the start (0.9) toward the truth (0.6)
    assert TRUE_NVLINK_EFF - 0.02 < result.cluster_values[CLUSTER]["nvlink_eff"] < 0.85
    assert np.mean(np.abs(result.residuals["coll"])) < np.mean(np.abs(at_start)) / 2


def test_calibrate_command_writes_a_profile_and_reports_before_after(tmp_path, capsys):
    import json
    from pathlib import Path

    from diffcost import cli

    log = Path(__file__).parent / "data" / "readers_nccl_all_reduce.txt"
    out = tmp_path / "fitted.yaml"
    argv = ["calibrate", "--cluster", "dgx-h100", str(log), "--out", str(out), "--steps", "60"]
    assert cli.main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    coll = summary["rows"]["coll"]
    assert coll["rows"] > 0
    assert coll["mape_after_pct"] < coll["mape_before_pct"]
    assert summary["written"] == [str(out)]
    values = prof._read(out)["constants"]
    assert values["nvlink_eff"] == pytest.approx(summary["cluster"]["dgx-h100"]["nvlink_eff"])


# --- the GEMM shape grid ------------------------------------------------------------------------


def _grid_with(node, value, families=None):
    grid = jnp.zeros((GEMM_GRID,) * 3).at[node].set(value)
    return (
        grid if families is None else jnp.stack([jnp.zeros_like(grid)] * families).at[-1].set(grid)
    )


def _classes(high=None, low=None):
    """``Params.gemm_shape_log_eff`` from a 16-bit and an FP8/FP4 grid (None: all zero)."""
    zero = jnp.zeros((GEMM_GRID,) * 3)
    grids = {"high": zero if high is None else high, "low": zero if low is None else low}
    return jnp.stack([grids[c] for c in GEMM_GRID_CLASSES])


def test_shape_grid_interpolates_between_octave_nodes_and_clamps():
    dims = [2 ** (GEMM_GRID_LOG2_LO + i) for i in range(GEMM_GRID)]
    grid = _grid_with((3, 4, 5), 0.4)
    at = lambda m, n, k: float(kernels.shape_log_eff(grid, m, n, k))  # noqa: E731
    assert at(dims[3], dims[4], dims[5]) == pytest.approx(0.4)
    # halfway (in log2) to the next node along one dimension, and along all three
    assert at(dims[3] * 2**0.5, dims[4], dims[5]) == pytest.approx(0.2, abs=1e-6)
    assert at(*(d * 2**0.5 for d in (dims[3], dims[4], dims[5]))) == pytest.approx(0.05, abs=1e-6)
    assert at(dims[3], dims[4], dims[6]) == pytest.approx(0.0, abs=1e-9)
    # shapes past the edge nodes read the edge
    edge = _grid_with((0, GEMM_GRID - 1, 0), -0.3)
    assert float(kernels.shape_log_eff(edge, 1.0, 1e9, 0.0)) == pytest.approx(-0.3)
    # one table per row (the fit's layout) gives each row its own table's value
    rows = _grid_with((3, 4, 5), 0.4, families=2)
    got = kernels.shape_log_eff(rows, dims[3], dims[4], dims[5], row=jnp.array([0, 1]))
    np.testing.assert_allclose(got, [0.0, 0.4], atol=1e-7)


def test_shape_grid_reads_the_same_nodes_compiled_as_eager():
    """GEMM shapes on octave nodes (powers of two) read their node under jit too: compiled,
    log2 of a power of two came out one ulp low and 2048 x 256 x 1024 read a value 2.3 away
    from its node's."""
    grid = jnp.asarray(np.random.default_rng(0).standard_normal((GEMM_GRID,) * 3))
    m, n = jnp.array([2048.0, 4096, 1024, 3000]), jnp.array([256.0, 1024, 8192, 5000])
    k = jnp.array([1024.0, 4096, 2048, 700])
    eager = kernels.shape_log_eff(grid, m, n, k)
    np.testing.assert_allclose(jax.jit(kernels.shape_log_eff)(grid, m, n, k), eager, atol=1e-5)
    node = [int(np.log2(v)) - GEMM_GRID_LOG2_LO for v in (2048, 256, 1024)]
    assert float(eager[0]) == pytest.approx(float(grid[tuple(node)]))


def test_shape_grid_scales_compute_time_only_and_defaults_to_one():
    p0 = default_params()
    cluster = cluster_arrays(load_cluster(CLUSTER))
    rate = 1e14
    m, n, k = 4096.0, 4096.0, 4096.0
    plain = float(kernels.gemm_s(m, n, k, rate, cluster, p0, 1e-6))
    assert float(kernels.gemm_s(m, n, k, rate, cluster, p0, 1e-6, log_eff=0.0)) == plain
    node = tuple(int(np.log2(d)) - GEMM_GRID_LOG2_LO for d in (m, n, k))
    faster = p0.replace(gemm_shape_log_eff=_classes(high=_grid_with(node, np.log(2.0))))
    assert float(kernels.gemm_s(m, n, k, rate, cluster, faster, 1e-6)) == pytest.approx(
        plain / 2, rel=1e-3
    )
    # the default reads the 16-bit grid, not the FP8/FP4 one
    other = p0.replace(gemm_shape_log_eff=_classes(low=_grid_with(node, np.log(2.0))))
    assert float(kernels.gemm_s(m, n, k, rate, cluster, other, 1e-6)) == plain
    # gradients stay finite for an absent (zero-size) GEMM
    g = jax.grad(
        lambda t, d: kernels.gemm_s(d, n, k, rate, cluster, p0.replace(gemm_shape_log_eff=t), 1e-6),
        argnums=(0, 1),
    )(p0.gemm_shape_log_eff, 0.0)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g)


def test_fit_learns_a_slow_gemm_shape():
    """A synthetic GEMM table, made by the model, in which one bf16 shape runs 30% slower: the
    fit lowers that node of the 16-bit grid, leaves its other nodes near 1, and leaves the FP8
    grid (the same shapes at their modelled FP8 times) near 1 everywhere."""
    cluster_name = FAMILY_CLUSTER["h100"]
    cluster = cluster_arrays(load_cluster(cluster_name))
    p0 = default_params()
    slow = (1024, 2048, 4096)
    records = []
    for precision in ("bf16", "fp8"):
        prec = jnp.eye(len(PRECISIONS))[PRECISIONS.index(precision)]
        for m in (512, 1024, 2048):
            for n in (1024, 2048, 4096):
                for k in (2048, 4096, 8192):
                    t = float(kernel_levels.gemm_time(m, n, k, prec, 0.0, cluster, p0, 0.0, 1e-3))
                    slower = (m, n, k) == slow and precision == "bf16"
                    records.append(
                        GemmRecord(
                            "h100",
                            1,
                            m,
                            n,
                            k,
                            precision,
                            t * (1.3 if slower else 1.0),
                            Source("synthetic", len(records) + 2),
                        )
                    )
    meas = Measurements(e2e=[], collectives=[], gemms=records, skipped=[])
    # 54 rows: full weight against the prior (this tests the grid, not the small-data prior)
    cfg = fit_mod.FitConfig(steps=300, tol=-1.0, full_rows=1)
    result = fit_mod.fit(meas, cfg, progress=False)
    grids = result.device_values["h100"]["gemm_shape_eff"]
    high = grids["high"]
    assert high["x".join(map(str, slow))] == pytest.approx(1 / 1.3, rel=0.05)
    others = [v for key, v in high.items() if key != "x".join(map(str, slow))]
    assert max(abs(np.log(v)) for v in others) < 0.05
    assert max((abs(np.log(v)) for v in grids.get("low", {}).values()), default=0.0) < 0.05
    assert np.max(np.abs(result.residuals["gemm"])) < 0.02


def test_shape_grid_profile_round_trip_and_errors(tmp_path):
    p0 = default_params()
    moved = p0.replace(gemm_shape_log_eff=_classes(low=_grid_with((1, 2, 3), np.log(0.8))))
    values = prof.to_values(moved, ("gemm_shape_eff",))
    assert values == {"gemm_shape_eff": {"low": {"256x512x1024": pytest.approx(0.8)}}}
    back = prof.apply_values(p0, values)
    np.testing.assert_allclose(back.gemm_shape_log_eff, moved.gemm_shape_log_eff, atol=1e-6)
    bad = tmp_path / "bad.yaml"
    for text, error in [
        (
            "{high: {'1000x512x1024': 0.9}}",
            r"gemm_shape_eff\.high\.1000x512x1024: expected 'MxNxK'",
        ),
        ("{high: {'256x512x1024': 0}}", "must be a number above 0"),
        ("{fp8: {'256x512x1024': 0.9}}", r"gemm_shape_eff\.fp8: unknown precision class"),
        ("{'256x512x1024': 0.9}", r"gemm_shape_eff\.256x512x1024: unknown precision class"),
    ]:
        bad.write_text(f"constants: {{gemm_shape_eff: {text}}}\n")
        with pytest.raises(prof.ProfileError, match=error):
            prof.params_for(load_cluster(CLUSTER), bad)


def test_calibrate_command_leaves_the_shipped_profiles_alone(tmp_path, monkeypatch, capsys):
    import json
    from pathlib import Path

    from diffcost import cli

    shipped = {p: p.read_bytes() for p in prof.PROFILES_DIR.glob("*.yaml")}
    log = Path(__file__).parent / "data" / "readers_nccl_all_reduce.txt"
    monkeypatch.chdir(tmp_path)
    argv = ["calibrate", "--cluster", "dgx-h100", str(log), "--steps", "30", "--json"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["written"] == ["dgx-h100-profile.yaml"]
    assert "device profile device-h100.yaml" in summary["started_from"]["dgx-h100"]
    written = prof._read(tmp_path / "dgx-h100-profile.yaml")
    assert written["gpu_family"] == "h100" and written["layer"] == "cluster+device"
    # constants the all-reduce log cannot see stay at the shipped profile's values
    shipped_values = prof.to_values(prof.params_for(load_cluster("dgx-h100"))[0])
    for name in ("optimizer_bytes_per_param", "iteration_overhead_s", "mem_eff"):
        assert written["constants"][name] == pytest.approx(shipped_values[name], rel=1e-3)
    assert {p: p.read_bytes() for p in prof.PROFILES_DIR.glob("*.yaml")} == shipped
    # one file cannot hold two clusters: refused before any fitting
    two = ["calibrate", "--cluster", "dgx-h100", "--cluster", "dgx-b200", str(log)]
    assert cli.main([*two, "--out", "both.yaml"]) == 2
    assert "one file holds one cluster's profile" in capsys.readouterr().err
    assert cli.main(["calibrate", "--cluster", "dgx-h100", str(log), "--steps", "0"]) == 2
    assert "--steps 0: must be at least 1" in capsys.readouterr().err


def test_moved_ranks_constants_by_their_move_in_prior_widths():
    before = prof.to_values(default_params())
    after = dict(before, nic_eff=0.5, host_op_s=before["host_op_s"] * 1.01)
    after["gemm_shape_eff"] = {"high": {"1024x1024x1024": 0.8, "128x128x128": 1.01}}
    rows = calibrate_moved(before, after)
    assert [r[0] for r in rows] == [
        "GEMM shape grid: 1 nodes moved > 5%",
        "nic_eff",
        "host_op_s",
    ]
    assert rows[1][1:] == (pytest.approx(before["nic_eff"]), pytest.approx(0.5))


def test_found_names_what_the_files_hold():
    from calibration.command import _found

    meas = synthetic_collectives()
    assert _found(meas) == f"{CLUSTER} ({len(meas.collectives)})"
    assert _found(Measurements()) == "no usable rows"


def test_a_level_with_few_rows_weighs_less_against_the_prior():
    """24 synthetic all-reduce rows: at full weight (full_rows=1) the fit moves the link
    efficiency most of the way to the truth; counted as 24 of 2,400 rows it stays nearer
    the datasheet, since the same data now carry a hundredth of the weight."""
    meas = synthetic_collectives()
    default = prof.to_values(default_params())["nvlink_eff"]
    moved = {}
    for full_rows in (1, 2400):
        cfg = fit_mod.FitConfig(steps=200, full_rows=full_rows, prior_weight=1e-4)
        moved[full_rows] = abs(
            fit_mod.fit(meas, cfg, progress=False).cluster_values[CLUSTER]["nvlink_eff"] - default
        )
    assert moved[1] > 0.5 * abs(TRUE_NVLINK_EFF - default)
    assert moved[2400] < 0.5 * moved[1]


PENALTY_DELTA = 0.2


def test_robust_penalty_blends_huber_into_cauchy():
    resid = jnp.linspace(-2.0, 2.0, 41)
    huber = fit_mod.robust_penalty(resid, PENALTY_DELTA, 0.0)
    cauchy = fit_mod.robust_penalty(resid, PENALTY_DELTA, 1.0)
    np.testing.assert_allclose(huber, huber_reference(resid, PENALTY_DELTA), rtol=1e-12)
    np.testing.assert_allclose(
        cauchy, 0.5 * PENALTY_DELTA**2 * np.log1p((resid / PENALTY_DELTA) ** 2), rtol=1e-12
    )
    # both are r^2 / 2 near zero, so small residuals are fitted the same way
    small = jnp.array([1e-3, -2e-3])
    for blend in (0.0, 0.5, 1.0):
        np.testing.assert_allclose(
            fit_mod.robust_penalty(small, PENALTY_DELTA, blend), small**2 / 2, rtol=1e-4
        )
    # a row 3x off pulls with Huber's capped delta, but with a small, fading pull under Cauchy's
    pull = jax.grad(lambda r, b: fit_mod.robust_penalty(r, PENALTY_DELTA, b))
    far = float(np.log(3.0))
    assert float(pull(far, 0.0)) == pytest.approx(PENALTY_DELTA)
    assert float(pull(far, 1.0)) < 0.2 * PENALTY_DELTA
    assert float(pull(2 * far, 1.0)) < float(pull(far, 1.0))


def huber_reference(resid, delta):
    """Huber's penalty written out in numpy, independent of the optax function the fit calls."""
    abs_r = np.abs(np.asarray(resid))
    return np.where(abs_r <= delta, 0.5 * abs_r**2, delta * (abs_r - 0.5 * delta))


def test_redescend_schedule():
    cfg = fit_mod.FitConfig(steps=100, redescend=(0.3, 0.6))
    assert fit_mod.redescend_at(cfg, 0) == 0.0 and fit_mod.redescend_at(cfg, 30) == 0.0
    assert fit_mod.redescend_at(cfg, 45) == pytest.approx(0.5)
    assert fit_mod.redescend_at(cfg, 60) == 1.0 and fit_mod.redescend_at(cfg, 99) == 1.0
    huber_only = fit_mod.FitConfig(steps=100, redescend=(1.0, 1.0))
    assert all(fit_mod.redescend_at(huber_only, i) == 0.0 for i in range(100))


def _corrupt(meas, fraction, factor, seed=0):
    rng = np.random.default_rng(seed)
    rows = list(meas.collectives)
    bad = rng.choice(len(rows), size=int(round(fraction * len(rows))), replace=False)
    for i in bad:
        rows[i] = dataclasses.replace(rows[i], time_s=rows[i].time_s * factor)
    return dataclasses.replace(meas, collectives=rows)


def test_redescending_penalty_resists_gross_outliers():
    """10% of the rows 3x too slow: Huber's capped pull still drags the fitted constants; the
    Cauchy end of the blend lets the fit return to the clean constants."""
    meas = _corrupt(synthetic_collectives(), 0.1, 3.0)
    base = dict(steps=400, prior_weight=1e-7, huber_delta=0.05, tol=-1.0)
    errors = {}
    for name, redescend in (("huber", (1.0, 1.0)), ("redescending", (0.3, 0.6))):
        cfg = fit_mod.FitConfig(**base, redescend=redescend)
        values = fit_mod.fit(meas, cfg, progress=False).cluster_values[CLUSTER]
        errors[name] = abs(values["nvlink_eff"] / TRUE_NVLINK_EFF - 1)
    assert errors["redescending"] < RECOVERY_REL
    assert errors["redescending"] < 0.5 * errors["huber"]
