"""SimuMax node descriptions: readers, attention efficiency by shape, the simumax-b200 preset."""

import csv
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from calibration import fit as fit_mod
from calibration import kernel_levels
from calibration.readers import detect_kind, load
from calibration.records import AttentionRecord, GemmRecord, Measurements, ReaderError, Source
from calibration.simumax import (
    GIB,
    read_simumax_collective_fit,
    read_simumax_kernels,
    simumax_collective_s,
)
from diffcost import api, kernels
from diffcost.config import load_cluster
from diffcost.params import default_params
from diffcost.profiles import params_for
from diffcost.specs import PRECISIONS
from diffcost.workload import attention_shape, layer_work
from tests.helpers import LLAMA, SHARED_DATA, arrays

KERNELS = SHARED_DATA / "kernels" / "b200_simumax_kernels.csv"
COLL_FIT = SHARED_DATA / "collectives" / "b200_simumax_collective_fit.csv"
EXAMPLE = "configs/examples/llama3-70b-slice-simumax-b200.yaml"
REL = 1e-12  # the readers' arithmetic, float64
RECOVERY_REL = 0.03  # constants recovered from a noiseless synthetic table
needs_data = pytest.mark.skipif(not KERNELS.exists(), reason="shared data not present")


# --------------------------------------------------------------------------------------------
# Readers


@needs_data
def test_detect_kind_and_load_both_files():
    assert detect_kind(KERNELS) == "simumax-kernels"
    assert detect_kind(COLL_FIT) == "simumax-collectives"
    meas = load([KERNELS, COLL_FIT])
    counts = meas.counts()
    reasons = counts["skipped"]
    assert (counts["gemms"], counts["attention"], counts["memory"]) == (514, 64, 1)
    # 4 collectives x 3 group sizes, 15 message sizes each; p2p (efficiency 1.45) is skipped
    assert counts["collectives"] == 4 * 3 * 15
    assert sum(n for r, n in reasons.items() if r.startswith("p2p efficiency 1.4517 > 1")) == 1
    assert sum(n for r, n in reasons.items() if r.startswith("grouped GEMM")) == 108


@needs_data
def test_gemm_and_attention_rows_become_times():
    with open(KERNELS, newline="") as fh:
        rows = list(csv.DictReader(fh))
    meas = read_simumax_kernels(KERNELS)
    by_line = {g.where.line: g for g in meas.gemms}
    by_line.update({a.where.line: a for a in meas.attention})
    for line, row in enumerate(rows, start=2):
        if line not in by_line:
            continue
        rec, rate = by_line[line], float(row["efficiency"]) * float(row["peak_tflops"]) * 1e12
        if row["op"] == "gemm":
            b, m, n, k = (int(row[c]) for c in ("batch", "m", "n", "k"))
            assert rec.time_s == pytest.approx(2.0 * b * m * n * k / rate, rel=REL)
            # weight-gradient rows are turned to the model's orientation
            expect = (n, m) if row["layout"] == "NT" else (m, n)
            assert (rec.m, rec.n, rec.k) == (*expect, k)
        else:
            s, h = int(row["seq_len"]), int(row["heads"])
            d = int(row["qk_head_dim"]) + int(row["v_head_dim"])
            flops = (2.0 if row["op"] == "attention_fwd" else 5.0) * s * s * h * d
            assert rec.time_s == pytest.approx(flops / rate, rel=REL)
            assert rec.head_dim == d / 2 and rec.causal


@needs_data
def test_collective_fit_derives_simumax_times():
    meas = read_simumax_collective_fit(COLL_FIT)
    ar8 = [
        c
        for c in meas.collectives
        if c.collective == "all_reduce" and c.group_size == 8 and c.size_bytes == GIB
    ]
    assert len(ar8) == 1
    # all_reduce row: scale 2, offset -1, efficiency 0.7424, latency 5.5183, fixed 22.2316 us
    ring = GIB * 2 * (1 - 1 / 8) / (0.7424 * 900 * GIB)
    assert ar8[0].time_s == pytest.approx(ring + (5.5183 * 2 * 7 + 22.2316) * 1e-6, rel=REL)
    assert "derived from fitted NCCL parameters" in ar8[0].source_name
    # the all-to-all's fixed latency per group size comes from the notes
    a2a = [c for c in meas.collectives if c.collective == "all_to_all"]
    params = (1.0, -1.0, 0.5968, 900 * GIB, 7.3039, {2: 51.0578, 4: 19.2102, 8: 0.0})
    assert simumax_collective_s("all2all", 2**16, 2, params) == pytest.approx(
        a2a[0].time_s, rel=REL
    )
    assert (a2a[0].group_size, a2a[0].size_bytes) == (2, 2**16)


def _bad_copy(tmp_path, column, value, op="gemm"):
    with open(KERNELS, newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = reader.fieldnames, list(reader)
    row = next(r for r in rows if r["op"] == op)
    row[column] = value
    path = tmp_path / "bad.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, header)
        writer.writeheader()
        writer.writerows([rows[-1], row])  # a skipped row, then the bad one
    return path


@needs_data
@pytest.mark.parametrize(
    "column, value, op",
    [
        ("efficiency", "fast", "gemm"),
        ("efficiency", "-0.5", "gemm"),
        ("layout", "XY", "gemm"),
        ("m", "", "gemm"),
        ("seq_len", "4096.5", "attention_fwd"),
        ("op", "conv2d", "gemm"),
    ],
)
def test_malformed_row_names_file_line_field_and_value(tmp_path, column, value, op):
    path = _bad_copy(tmp_path, column, value, op)
    with pytest.raises(ReaderError) as err:
        load([path])
    text = str(err.value)
    assert text.startswith(f"{path}:3:")
    assert f"'{column}'" in text
    assert repr(value) in text or value in text


# --------------------------------------------------------------------------------------------
# Attention efficiency by shape


def _shapes():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(0.0, 3.0, size=(16, 4)))


def test_default_shape_terms_reproduce_the_single_constant_exactly():
    """At the defaults the shape odds, backward odds and ceiling change nothing, bit for bit."""
    params = default_params()
    for flash2 in (0.0, 1.0):
        old = jax.nn.sigmoid(params.attn_eff_logit + flash2 * params.attn_flash_log_odds)
        eff = params.attention_eff(flash2, _shapes())
        assert np.array_equal(np.asarray(eff), np.full(eff.shape, float(old)))


def test_triton_odds_multiply_flashattention2_odds():
    """Triton FlashAttention's odds are attn_triton_odds times FlashAttention-2's, at every shape
    and in both passes, and at its default (< 1) its attention takes longer than FA2's."""
    params = default_params(family="h100")
    odds = lambda e: e / (jnp.exp(params.attn_ceiling_log) - e)  # noqa: E731
    shapes = _shapes()
    flash = params.attention_eff(1.0, shapes)
    triton = params.attention_eff(0.0, shapes, 1.0)
    assert np.allclose(np.asarray(odds(triton) / odds(flash)), float(params.attn_triton_odds))
    model, plan, cluster = arrays(dataclasses.replace(LLAMA, attention="flash"))
    work = layer_work(model, plan)
    times = [
        kernels.kernel_times(work, m, cluster, params, 1e-3).attention_s
        for m in (model, model.replace(flash2=0.0 * model.flash2, triton=1.0 + 0 * model.triton))
    ]
    assert np.all(np.asarray(times[1]) > np.asarray(times[0]) * 1.5)  # forward and backward


def test_ceiling_scales_both_passes_at_every_shape():
    params = default_params()
    raised = params.replace(attn_ceiling_log=jnp.log(1.25))
    shapes = _shapes()
    ratio = raised.attention_eff(0.0, shapes) / params.attention_eff(0.0, shapes)
    assert np.allclose(np.asarray(ratio), 1.25, rtol=1e-12)


def test_default_kernel_times_do_not_depend_on_the_attention_shape():
    model, plan, cluster = arrays(LLAMA)
    work = layer_work(model, plan)
    params = default_params()
    at = lambda w, p: kernels.kernel_times(w, model, cluster, p, 1e-3).attention_s  # noqa: E731
    moved = work.replace(attention_shape=jnp.zeros(4) + 3.0)
    assert np.array_equal(np.asarray(at(work, params)), np.asarray(at(moved, params)))
    steeper = params.replace(attn_seq_log_odds=jnp.asarray(0.3))
    assert not np.allclose(np.asarray(at(work, steeper)), np.asarray(at(moved, steeper)))


def test_attention_shape_octaves():
    octaves = attention_shape(8192.0, 64.0, 16.0, 8.0)
    assert np.allclose(np.asarray(octaves), [1.0, -1.0, -1.0, 3.0])


def test_attention_kernel_time_gradient_is_finite():
    cluster = _b200_arrays()
    params = default_params().replace(
        **{leaf: jnp.asarray(0.2) for leaf in kernel_levels.ATTENTION_ONLY_LEAVES}
    )
    shape = attention_shape(8192.0, 64.0, 16.0, 8.0)  # off the reference in every term

    def log_time(p, stage):
        t = kernel_levels.attention_time(4e12, 1e9, shape, stage, 0.0, cluster, p, 1e-3)
        return jnp.log(t)

    for stage in (0, 1):
        grads = jax.grad(log_time)(params, stage)
        leaves = jax.tree_util.tree_leaves(grads)
        assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
        assert float(grads.attn_seq_log_odds if stage == 0 else grads.attn_bwd_seq_log_odds) != 0.0
    check_grads(lambda p: params.replace(attn_eff_logit=p).attention_eff(0.0, shape), (0.3,), 1)


def _b200_arrays():
    from diffcost.arrays import cluster_arrays

    return cluster_arrays(load_cluster("simumax-b200"), jnp.float64)


TRUE = {
    "attn_eff_logit": 0.4,
    "attn_seq_log_odds": 0.5,
    "attn_dim_log_odds": -0.3,
    "attn_heads_log_odds": 0.7,
    "attn_group_log_odds": 0.2,
    "attn_bwd_log_odds": -0.4,
    "attn_bwd_seq_log_odds": 0.2,
    "attn_bwd_dim_log_odds": 0.1,
    "attn_bwd_heads_log_odds": 0.3,
    "attn_bwd_group_log_odds": -0.2,
}


def _synthetic_attention() -> Measurements:
    """Kernel times the model gives at ``TRUE`` constants, on a grid of shapes."""
    cluster = _b200_arrays()
    params = default_params().replace(**{k: jnp.asarray(v) for k, v in TRUE.items()})
    records = []
    grid = [
        (s, h, d, g, stage)
        for s in (1024, 8192, 65536)
        for h in (8, 32)
        for d in (64, 256)
        for g in (1, 8)
        for stage in ("fwd", "bwd")
    ]
    for s, h, d, g, stage in grid:
        flops = 4.0 * s * s * h * d
        n_bytes = 2.0 * s * d * (2 * h + 2 * h / g)
        shape = attention_shape(float(s), float(d), float(h), float(g))
        t = kernel_levels.attention_time(
            flops, n_bytes, shape, int(stage == "bwd"), 0.0, cluster, params, 1e-3
        )
        records.append(
            AttentionRecord(
                "b200", stage, 1, s, h, h // g, float(d), True, float(t), Source("x", 0)
            )
        )
    return Measurements(attention=records)


def test_fit_recovers_attention_shape_constants():
    # the default prior holds gemm_eff (which scales attention's rate too) at its true value
    cfg = fit_mod.FitConfig(steps=800, huber_delta=0.05, tol=-1.0)
    result = fit_mod.fit(_synthetic_attention(), cfg, progress=False)
    values = result.device_values["b200"]
    assert values["attn_eff"] == pytest.approx(jax.nn.sigmoid(TRUE["attn_eff_logit"]), rel=0.02)
    names = ("seq", "dim", "heads", "group", "bwd", "bwd_seq", "bwd_dim", "bwd_heads", "bwd_group")
    for name in names:
        want = math.exp(TRUE[f"attn_{name}_log_odds"])
        assert values[f"attn_{name}_odds"] == pytest.approx(want, rel=RECOVERY_REL)
    assert np.max(np.abs(result.residuals["attn"])) < 0.01


def test_shape_constants_are_held_for_families_without_attention_rows():
    gemm = GemmRecord("h100", 1, 2048, 2048, 2048, "bf16", 2e-5, Source("x", 0))
    meas = Measurements(gemms=[gemm], attention=_synthetic_attention().attention[:4])
    problem = fit_mod.build_problem(meas)
    loss = fit_mod.make_loss(problem, fit_mod.FitConfig())
    dev, clu = fit_mod.initial_tables(problem)
    moved = {k: v + 0.1 for k, v in dev.items()}  # off the prior's centre: every leaf pulls
    grads = jax.jit(jax.grad(loss))((moved, clu), problem.data)[0]  # compiled: eager took ~70 s
    b200, h100 = problem.families.index("b200"), problem.families.index("h100")
    for leaf in kernel_levels.ATTENTION_ONLY_LEAVES:
        assert float(grads[leaf][b200]) != 0.0
        assert float(grads[leaf][h100]) == 0.0
    assert float(grads["gemm_eff_logit"][h100][PRECISIONS.index("bf16")]) != 0.0


# --------------------------------------------------------------------------------------------
# The preset and its profile


@needs_data
def test_calibrate_command_fits_the_node_from_its_tables(tmp_path, capsys):
    from diffcost import cli

    out = tmp_path / "simumax.yaml"
    argv = ["calibrate", "--cluster", "simumax-b200", str(KERNELS), str(COLL_FIT)]
    argv += ["--from", "none", "--out", str(out), "--steps", "150", "--json"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["rows"]) == {"attn", "coll", "gemm", "mem"}
    for level in summary["rows"].values():
        assert level["mape_after_pct"] < level["mape_before_pct"]
    assert summary["written"] == [str(out)]
    assert params_for(load_cluster("simumax-b200"), out)[0].attn_seq_odds > 1.0


def test_preset_loads_with_the_stated_hardware():
    cluster = load_cluster("simumax-b200")
    assert cluster.gpus_per_node == 8
    assert cluster.gpu.peak_tflops["bf16"] == 2250
    assert cluster.gpu.hbm_bandwidth_GBps == 8000
    assert cluster.nvlink_GBps == 1800  # 900 GB/s per direction, both counted


def test_example_predicts_finite_values_with_the_shipped_profile():
    exp = api.load(EXAMPLE)
    _, note = params_for(exp.cluster)
    assert "device-b200.yaml" in note and "simumax-b200.yaml" in note
    out = api.predict(EXAMPLE)
    assert np.isfinite(out.iteration_s) and out.iteration_s > 0
    assert np.isfinite(out.memory_peak_bytes) and out.memory_peak_bytes > 0
