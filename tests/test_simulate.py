"""Invariants of the smooth simulator: monotonicity, exact zeros, batching, jit, gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CLUSTER, GPT, LLAMA, MOE, PLANS, arrays
from jax.test_util import check_grads

from diffcost import api, default_params, kernels, workload
from diffcost.arrays import stack
from diffcost.config import load_cluster
from diffcost.simulate import STATUS_INVALID, STATUS_OK, STATUS_OOM, Breakdown, simulate
from diffcost.specs import PRECISIONS

REL = 1e-9  # float64 equality of two computations of the same quantity
GRAD_RTOL = 2e-3  # finite differences vs reverse mode (central differences, eps 1e-4)

ALL_CASES = [(GPT, name) for name in PLANS] + [(LLAMA, "tp4pp2"), (LLAMA, "cp2"), (MOE, "dp8")]


def _run(model=GPT, plan=None, cluster=CLUSTER, params=None, temperature=1e-3):
    m, p, c = arrays(model, plan, cluster)
    return simulate(m, p, c, default_params(jnp.float64) if params is None else params, temperature)


@pytest.mark.parametrize("model,plan", ALL_CASES, ids=[f"{m.name}-{p}" for m, p in ALL_CASES])
def test_finite_positive_and_parts_sum(model, plan):
    b = _run(model, PLANS[plan] if model is not MOE else dataclasses.replace(PLANS[plan], ep=8))
    assert int(b.status) in (STATUS_OK, STATUS_OOM)
    for leaf in jax.tree_util.tree_leaves(b):
        assert np.all(np.isfinite(np.asarray(leaf)))
    assert float(b.iteration_s) > 0
    parts = sum(float(getattr(b, k)) for k in Breakdown.TIME_PARTS)
    assert parts == pytest.approx(float(b.iteration_s), rel=1e-9)
    assert 0 < float(b.mfu) < 1


def test_makespan_at_least_critical_path_compute():
    for name in PLANS:
        b = _run(plan=PLANS[name])
        assert float(b.iteration_s) >= float(b.compute_s)


def _scaled_cluster(**factors):
    gpu = CLUSTER.gpu
    if "flops" in factors:
        gpu = dataclasses.replace(
            gpu, peak_tflops={k: v * factors["flops"] for k, v in gpu.peak_tflops.items()}
        )
    if "hbm" in factors:
        gpu = dataclasses.replace(gpu, hbm_bandwidth_GBps=gpu.hbm_bandwidth_GBps * factors["hbm"])
    return dataclasses.replace(
        CLUSTER,
        gpu=gpu,
        nvlink_GBps=CLUSTER.nvlink_GBps * factors.get("nvlink", 1.0),
        nic_Gbps=CLUSTER.nic_Gbps * factors.get("nic", 1.0),
    )


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("what", ["flops", "hbm", "nvlink", "nic"])
def test_more_hardware_is_never_slower(plan, what):
    base = float(_run(plan=PLANS[plan]).iteration_s)
    for factor in (1.1, 2.0, 10.0):
        faster = float(
            _run(plan=PLANS[plan], cluster=_scaled_cluster(**{what: factor})).iteration_s
        )
        assert faster <= base * (1 + REL)


def test_tp1_means_no_tensor_parallel_traffic():
    for name in ("single", "dp8", "gpipe", "fsdp"):
        assert float(_run(plan=PLANS[name]).tp_comm_s) == 0.0
    assert float(_run(plan=PLANS["tp4pp2"]).tp_comm_s) > 0.0


def test_single_gpu_has_no_communication():
    b = _run(plan=PLANS["single"])
    for k in [k for k in Breakdown.TIME_PARTS if k.endswith("_comm_s")] + ["bubble_s"]:
        assert abs(float(getattr(b, k))) <= 1e-12 * float(b.iteration_s), k


def test_flash_attention_odds_move_only_flash_runs():
    """The odds ratio scales FlashAttention-2; cuDNN and unfused runs ignore it."""
    base = default_params(jnp.float64)
    faster = base.replace(attn_flash_log_odds=jnp.log(jnp.float64(2.0)))
    t = {
        (kind, name): float(_run(dataclasses.replace(GPT, attention=kind), params=p).iteration_s)
        for kind in ("unfused", "flash", "cudnn")
        for name, p in (("base", base), ("faster", faster))
    }
    assert t["cudnn", "base"] == t["flash", "base"]  # odds ratio 1: the same kernel speed
    assert t["flash", "faster"] < t["flash", "base"]
    assert t["cudnn", "faster"] == t["cudnn", "base"]
    assert t["unfused", "faster"] == t["unfused", "base"]


def test_fp8_casts_count_each_gemm_input_and_output_gradient():
    """4 B per element (read bf16, write FP8 and its transpose); nothing in 16 bits."""
    plan = PLANS["tp4pp2"]
    m16, p, _ = arrays(GPT, plan)
    work16 = workload.layer_work(m16, p)
    assert [float(work16.cast_fwd_bytes), float(work16.cast_bwd_bytes)] == [0.0, 0.0]
    m8, p, _ = arrays(dataclasses.replace(GPT, precision="fp8"), plan)
    t, h, f, tp = plan.microbatch * GPT.seq_len, GPT.hidden, GPT.ffn_hidden, plan.tp
    inputs = t * (h + h / tp + h + f / tp)  # QKV, attention output, FC1, FC2
    output_grads = t * (3 * h / tp + h + f / tp + h)
    work8 = workload.layer_work(m8, p)
    fwd, bwd = work8.cast_fwd_bytes, work8.cast_bwd_bytes
    assert float(fwd) == pytest.approx(4 * inputs, rel=1e-12)
    assert float(bwd) == pytest.approx(4 * output_grads, rel=1e-12)


def test_precision_classes_read_their_own_shape_grids():
    """An FP8 model's layer GEMMs read the FP8/FP4 shape grid and only its LM head the 16-bit
    one; a bf16 model reads only the 16-bit grid."""
    p0 = default_params(jnp.float64)
    twice = jnp.full(p0.gemm_shape_log_eff.shape[1:], np.log(2.0))  # every shape 2x faster
    zero = jnp.zeros_like(twice)
    grids = {"base": p0, "high": jnp.stack([twice, zero]), "low": jnp.stack([zero, twice])}
    h100 = load_cluster("dgx-h100")

    def times(precision, vocab):
        model = dataclasses.replace(GPT, precision=precision, vocab=vocab)
        return {
            name: float(
                _run(
                    model,
                    PLANS["single"],
                    h100,
                    p0 if name == "base" else p0.replace(gemm_shape_log_eff=g),
                ).compute_s
            )
            for name, g in grids.items()
        }

    t = times("bf16", GPT.vocab)
    assert t["high"] < 0.95 * t["base"]
    assert t["low"] == pytest.approx(t["base"], rel=REL)
    t = times("fp8", GPT.vocab)
    assert t["low"] < 0.995 * t["base"]  # the layers
    assert t["high"] < 0.995 * t["base"]  # the head
    t = times("fp8", 8)  # (almost) no head: the 16-bit grid has nothing left to speed up
    assert t["low"] < 0.995 * t["base"]
    assert t["high"] == pytest.approx(t["base"], rel=1e-4)


def test_shared_grid_table_reads_the_rows_of_its_base():
    """``grid=(table, base)`` gives what the same grids passed in Params give, for a bf16, an FP8
    and a relaxed half-and-half model whose grids sit at rows 2 and 3 of a shared table (as the
    calibration passes them)."""
    p0 = default_params(jnp.float64)
    rng = np.random.default_rng(0)
    shape = p0.gemm_shape_log_eff.shape
    own = jnp.asarray(rng.normal(0.0, 0.3, shape))
    table = jnp.concatenate([jnp.asarray(rng.normal(0.0, 0.3, shape)), own])  # [4, G, G, G]
    h100 = load_cluster("dgx-h100")
    half = 0.5 * np.eye(len(PRECISIONS))[[PRECISIONS.index("bf16"), PRECISIONS.index("fp8")]]
    for precision in ("bf16", "fp8", "relaxed"):
        model = dataclasses.replace(GPT, precision="bf16" if precision == "relaxed" else precision)
        m, p, c = arrays(model, PLANS["single"], h100)
        if precision == "relaxed":
            m = m.replace(precision=jnp.asarray(half.sum(axis=0)))
        plain = float(simulate(m, p, c, p0, 1e-3).iteration_s)
        direct = float(simulate(m, p, c, p0.replace(gemm_shape_log_eff=own), 1e-3).iteration_s)
        shared = float(simulate(m, p, c, p0, 1e-3, grid=(table, 2)).iteration_s)
        assert abs(direct / plain - 1.0) > 1e-3  # the grids matter here
        assert shared == pytest.approx(direct, rel=REL)


def test_lm_head_stays_in_16_bits_under_fp8():
    """FP8 training keeps the output layer in bf16: a larger vocabulary costs the same time."""
    h100 = load_cluster("dgx-h100")

    def vocab_cost(precision):
        t = [
            float(
                _run(
                    dataclasses.replace(GPT, precision=precision, vocab=v),
                    plan=PLANS["dp8"],
                    cluster=h100,
                ).iteration_s
            )
            for v in (32000, 128000)
        ]
        return t[1] - t[0]

    assert vocab_cost("fp8") > 0.0
    assert vocab_cost("fp8") == pytest.approx(vocab_cost("bf16"), rel=1e-4)


@pytest.mark.parametrize(
    "cluster_name, precision, follows",
    [
        ("dgx-h100", "bf16", "bf16"),
        ("dgx-h100", "fp16", "fp16"),
        ("dgx-h100", "fp8", "bf16"),  # TE keeps attention and the LM head in bf16
        ("generic-v100", "fp16", "fp16"),
        ("generic-v100", "fp32", "fp16"),  # no bf16 on a V100
    ],
)
def test_16_bit_kernels_follow_one_precision(cluster_name, precision, follows):
    """Attention runs at the model's 16-bit type (bf16 beside FP8), never the faster of the two:
    raising the other type's GEMM efficiency leaves the attention time alone."""
    cluster = load_cluster(cluster_name)
    model = dataclasses.replace(GPT, precision=precision, attention="cudnn")
    base = default_params(jnp.float64)

    def rate16(which, factor):
        i = PRECISIONS.index(which)
        eff = base.gemm_eff.at[i].multiply(factor)
        params = dataclasses.replace(base, gemm_eff_logit=jnp.log(eff / (1.0 - eff)))
        m, _, c = arrays(model, PLANS["dp8"], cluster)
        return float(kernels.half_peak_flops(m, c, params))

    other = "fp16" if follows == "bf16" else "bf16"
    rate = rate16(follows, 1.0)
    assert rate16(follows, 1.1) == pytest.approx(1.1 * rate, rel=1e-9)
    assert rate16(other, 1.1) == rate


@pytest.mark.parametrize("name", ["single", "tp4pp2", "gpipe", "3d-interleaved"])
def test_host_step_runs_once_per_microbatch_on_every_stage(name):
    """A longer host step per microbatch costs ``m + (p - 1) / v`` steps: ``m`` on the
    bottleneck stage (reported as overhead) and, in the fill and drain, one per other stage
    (``1 / v`` with ``v`` interleaved chunks; reported as bubble)."""
    plan = PLANS[name]
    m, p, c = arrays(GPT, plan)
    base = default_params(jnp.float64)

    def run(extra_s):
        step = base.microbatch_overhead_s + extra_s
        return simulate(
            m, p, c, dataclasses.replace(base, microbatch_overhead_log_s=jnp.log(step)), 0.0
        )

    d = 1e-3
    a, b = run(0.0), run(d)
    n, fill = float(p.n_microbatches), (plan.pp - 1) / float(p.chunks)
    assert float(b.iteration_s - a.iteration_s) == pytest.approx((n + fill) * d, rel=1e-6)
    assert float(b.overhead_s - a.overhead_s) == pytest.approx(n * d, rel=1e-6)
    assert float(b.bubble_s - a.bubble_s) == pytest.approx(fill * d, abs=1e-9)


def test_dense_model_has_no_expert_traffic():
    for name in PLANS:
        assert float(_run(plan=PLANS[name]).ep_comm_s) == 0.0


def test_oom_and_invalid_status():
    tiny = dataclasses.replace(CLUSTER, gpu=dataclasses.replace(CLUSTER.gpu, memory_GiB=1.0))
    assert int(_run(cluster=tiny).status) == STATUS_OOM
    assert float(_run(cluster=tiny).memory_excess_bytes) > 0
    bad = dataclasses.replace(PLANS["tp4pp2"], tp=3, dp=2)  # 16 heads not divisible by 3
    assert int(_run(plan=bad).status) == STATUS_INVALID
    assert np.isfinite(float(_run(plan=bad).iteration_s))


def test_zero_stages_shrink_memory_monotonically():
    peaks = []
    for z in (0, 1, 2, 3):
        peaks.append(float(_run(plan=dataclasses.replace(PLANS["fsdp"], zero=z)).memory_peak_bytes))
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]


def test_recompute_trades_time_for_memory():
    runs = [
        _run(plan=dataclasses.replace(PLANS["tp4pp2"], recompute=r))
        for r in ("none", "selective", "full")
    ]
    mem = [float(r.memory_peak_bytes) for r in runs]
    time = [float(r.iteration_s) for r in runs]
    assert mem[0] >= mem[1] > mem[2]
    assert time[0] <= time[1] < time[2]


def test_recompute_on_a_share_of_the_layers_is_between_none_and_full():
    """Full recompute on half the layers costs the mean of none and full in time, and keeps the
    mean of their saved activations (up to the smooth maxima's curvature)."""
    plan = PLANS["tp4pp2"]
    none, full, half = (
        _run(plan=dataclasses.replace(plan, recompute=r, recompute_fraction=f))
        for r, f in (("none", 1.0), ("full", 1.0), ("full", 0.5))
    )
    assert float(half.iteration_s) == pytest.approx(
        0.5 * (float(none.iteration_s) + float(full.iteration_s)), rel=1e-6
    )
    assert float(none.memory_peak_bytes) > float(half.memory_peak_bytes)
    assert float(half.memory_peak_bytes) > float(full.memory_peak_bytes)


def _batch(cases):
    ms, ps, cs = zip(*(arrays(m, p) for m, p in cases))
    return stack(ms), stack(ps), stack(cs)


def test_vmap_equals_loop_and_padding_changes_nothing():
    """One batch of every plan padded with copies of an unrelated configuration: each real
    row equals its configuration simulated alone (so the padding changes none of them), and
    so does each padding row. The batch is compiled once; an eager vmap compiles every
    batched primitive per batch size, which took minutes."""
    cases = [(GPT, PLANS[n]) for n in PLANS]
    pad = (LLAMA, PLANS["cp2"])
    params = default_params(jnp.float64)
    run = jax.jit(jax.vmap(lambda m, p, c: simulate(m, p, c, params)))
    padded = run(*_batch(cases + [pad] * 5))
    singles = [simulate(*arrays(m, p), params) for m, p in cases + [pad]]
    rows = [*range(len(cases)), *[len(cases)] * 5]  # padding rows compare with the pad alone
    for i, k in enumerate(rows):
        leaves = zip(jax.tree_util.tree_leaves(singles[k]), jax.tree_util.tree_leaves(padded))
        for a, b in leaves:
            # atol: a leaf that cancels to zero (seconds or bytes) is ~1e-17 either way
            np.testing.assert_allclose(np.asarray(b)[i], np.asarray(a), rtol=REL, atol=1e-12)


def test_jit_equals_eager_and_does_not_recompile():
    params = default_params(jnp.float64)
    m, p, c = arrays(plan=PLANS["3d-interleaved"])
    eager = simulate(m, p, c, params)
    api.simulate_jit.clear_cache()
    jitted = api.simulate_jit(m, p, c, params)
    for a, b in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12)
    m2, p2, c2 = arrays(LLAMA, PLANS["tp4pp2"])
    api.simulate_jit(m2, p2, c2, params)  # a different model and plan: same structure
    assert api.simulate_jit._cache_size() == 1


def test_specs_closed_over_as_constants_trace_under_jit():
    """The arrays of a spec are numpy; a jitted gradient that closes over them (as the speed
    benchmark does) sees numpy leaves, so the model may only index them statically."""
    params = default_params(jnp.float64)
    fp8 = dataclasses.replace(GPT, precision="fp8")
    m, p, c = arrays(fp8, PLANS["dp8"], load_cluster("dgx-h100"))
    assert isinstance(m.precision, np.ndarray)
    fn = jax.jit(jax.value_and_grad(lambda pl: simulate(m, pl, c, params).iteration_s))
    value, grad = fn(p)
    assert float(value) == pytest.approx(float(simulate(m, p, c, params).iteration_s), rel=1e-12)
    assert np.isfinite(float(grad.dp))


def _relaxed_fn(name, field):
    m, p, c = arrays(plan=PLANS[name])
    params = default_params(jnp.float64)

    def f(x):
        return simulate(m, p.replace(**{field: x}), c, params).iteration_s

    return f, getattr(p, field)


GRAD_CASES = [
    ("single", "tp"),
    ("single", "dp"),
    ("dp8", "dp"),
    ("tp4pp2", "tp"),
    ("tp4pp2", "microbatch"),
    ("3d-interleaved", "pp"),
    ("fsdp", "dp"),
    ("gpipe", "microbatch"),
    ("cp2", "cp"),
    ("single", "microbatch"),
    ("gpipe", "pp"),
]
FD_EPS = 1e-6


@pytest.mark.parametrize("name,field", GRAD_CASES)
def test_gradient_wrt_relaxed_plan_matches_finite_differences(name, field):
    """Where the model is smooth the gradient matches finite differences; at the kinks of the
    placement (a group that just fills a node) it is a subgradient between the one-sided ones."""
    f, x0 = _relaxed_fn(name, field)
    g = float(jax.grad(f)(x0))
    assert np.isfinite(g)
    f0 = float(f(x0))
    right = (float(f(x0 + FD_EPS)) - f0) / FD_EPS
    left = (f0 - float(f(x0 - FD_EPS))) / FD_EPS
    tol = GRAD_RTOL * max(abs(right), abs(left), 1e-3 * f0 / float(x0))
    if abs(right - left) <= tol:
        assert g == pytest.approx(0.5 * (right + left), abs=tol)
    else:
        assert min(left, right) - tol <= g <= max(left, right) + tol


@pytest.mark.parametrize("field", ["tp", "dp", "cp", "pp"])
def test_gradient_at_one_rank_is_the_feasible_side_derivative(field):
    """At degree 1 (no group at all) the gradient is the derivative towards degree > 1."""
    f, x0 = _relaxed_fn("single", field)
    assert float(x0) == 1.0
    g = float(jax.grad(f)(x0))
    right = (float(f(x0 + FD_EPS)) - float(f(x0))) / FD_EPS
    assert g == pytest.approx(right, rel=GRAD_RTOL, abs=1e-9)


def test_gradient_wrt_params_matches_finite_differences():
    m, p, c = arrays(plan=PLANS["3d-interleaved"])
    params = default_params(jnp.float64)
    check_grads(
        lambda pr: simulate(m, p, c, pr).iteration_s,
        (params,),
        order=1,
        modes=["rev"],
        eps=1e-5,
        atol=1e-6,
        rtol=GRAD_RTOL,
    )


@pytest.mark.parametrize("name", list(PLANS))
def test_gradients_are_finite_everywhere(name):
    m, p, c = arrays(plan=PLANS[name])
    params = default_params(jnp.float64)
    grads = jax.grad(lambda pr, pl, cl: simulate(m, pl, cl, pr).iteration_s, argnums=(0, 1, 2))(
        params, p, c
    )
    for leaf in jax.tree_util.tree_leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf)))


def test_zero_byte_collectives_have_finite_gradients():
    from diffcost import comm
    from diffcost.arrays import cluster_arrays as ca

    c = ca(CLUSTER, jnp.float64)
    params = default_params(jnp.float64)
    for fn in (comm.all_reduce_s, comm.reduce_scatter_s, comm.all_to_all_s):

        def t(msg, n):
            return fn(msg, comm.place(n, 1.0, c.gpus_per_node), c, params, 1e-3)

        assert float(t(0.0, 8.0)) == pytest.approx(0.0, abs=1e-12)
        assert float(t(1e6, 1.0)) == 0.0
        g = jax.grad(t, argnums=(0, 1))(0.0, 8.0)
        assert all(np.isfinite(float(x)) for x in g)


def test_relaxed_categoricals_interpolate():
    m, p, c = arrays(plan=PLANS["tp4pp2"])
    params = default_params(jnp.float64)
    t = {}
    for name, vec in {"none": [1, 0, 0], "full": [0, 0, 1], "mix": [0.5, 0, 0.5]}.items():
        t[name] = float(
            simulate(m, p.replace(recompute=jnp.asarray(vec, jnp.float64)), c, params).iteration_s
        )
    assert t["none"] < t["mix"] < t["full"]


def test_16_bit_gradients_halve_the_gradient_sync_and_buffer():
    """``grad_reduce_fp32`` off: 2-byte instead of 4-byte gradients in the ZeRO 0-2 sync and in
    memory; the sync stays bandwidth-bound (more than 2/5 of the fp32 one, latency included)
    and ZeRO-3's per-microbatch 16-bit reduce-scatter does not change."""
    serial = dataclasses.replace(PLANS["dp8"], overlap_dp=False)
    fp32, b16 = (_run(plan=dataclasses.replace(serial, grad_reduce_fp32=f)) for f in (True, False))
    np.testing.assert_allclose(b16.grads_bytes, 0.5 * fp32.grads_bytes, rtol=REL)
    ratio = float(b16.dp_comm_s) / float(fp32.dp_comm_s)
    assert 0.4 < ratio < 1.0
    # only the embedding's backward (its gradient scatter) moves fewer bytes in compute
    assert 0.999 * float(fp32.compute_s) < float(b16.compute_s) < float(fp32.compute_s)
    fsdp = [
        _run(plan=dataclasses.replace(PLANS["fsdp"], grad_reduce_fp32=f)) for f in (True, False)
    ]
    assert float(fsdp[0].zero_comm_s) == float(fsdp[1].zero_comm_s)
