"""CPU activation offloading (``PlanSpec.offload_fraction``, ``diffcost.offload``): its time
cost, its memory effect, its gradient, its config checks and the recipes that set it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CLUSTER, LLAMA, SHARED_DATA, arrays

from diffcost import default_params, offload, workload
from diffcost.config import ConfigError, load_experiment
from diffcost.runs import read_rows, row_to_specs
from diffcost.simulate import memory, simulate
from diffcost.specs import PlanSpec

TEMPERATURE = 1e-3
REL = 1e-12  # float64 agreement of two computations of the same quantity
PLAN = PlanSpec(dp=8, zero=3, microbatch=2, global_batch=32)


def _iteration_s(plan=PLAN, cluster=CLUSTER, model=LLAMA):
    m, p, c = arrays(model, plan, cluster)
    return float(simulate(m, p, c, default_params(jnp.float64), TEMPERATURE).iteration_s)


def _activations(plan):
    m, p, c = arrays(LLAMA, plan)
    return np.asarray(memory(m, p, c, TEMPERATURE)[3])


def test_no_offload_costs_nothing_whatever_the_host_link():
    slow = dataclasses.replace(CLUSTER, host_link_GBps=0.5)
    assert _iteration_s(cluster=slow) == pytest.approx(_iteration_s(), rel=REL)
    m, p, c = arrays(LLAMA, PLAN)
    core = jnp.array([1e-3, 2e-3])
    assert np.all(np.asarray(offload.exposed_s(core, 5e-3, p, lambda a, b: a + b)) == 0.0)


def test_cost_grows_with_offloaded_layers():
    times = [
        _iteration_s(dataclasses.replace(PLAN, offload_fraction=f)) for f in (0.0, 0.25, 0.5, 0.75)
    ]
    assert all(a < b for a, b in zip(times, times[1:])), times


def test_cost_grows_with_bytes_and_falls_with_host_bandwidth():
    plan = dataclasses.replace(PLAN, offload_fraction=0.5)

    def extra(cluster=CLUSTER, model=LLAMA):
        base = dataclasses.replace(plan, offload_fraction=0.0)
        return _iteration_s(plan, cluster, model) - _iteration_s(base, cluster, model)

    longer = dataclasses.replace(LLAMA, seq_len=2 * LLAMA.seq_len)
    assert extra(model=longer) > extra() > 0.0
    slower = dataclasses.replace(CLUSTER, host_link_GBps=CLUSTER.host_link_GBps / 4)
    assert extra(cluster=slower) > extra()
    m, p, c = arrays(LLAMA, plan)
    work = workload.layer_work(m, p)
    assert float(offload.copy_s(work, p, c)) == pytest.approx(
        float(offload.saved_bytes(work, p)) / (CLUSTER.host_link_GBps * 1e9 / 2), rel=REL
    )


def test_offloaded_layers_leave_the_gpu():
    kept = _activations(PLAN)
    half = _activations(dataclasses.replace(PLAN, offload_fraction=0.5))
    assert np.all(half < kept)
    m, p, _ = arrays(LLAMA, PLAN)
    layer = float(offload.saved_bytes(workload.layer_work(m, p), p))
    # half of the layers leave, one layer's staging buffer stays
    np.testing.assert_allclose(kept - half, (LLAMA.n_layers / 2 - 0.5) * layer, rtol=1e-9)


@pytest.mark.parametrize("precision, fp4", [("fp8", False), ("fp4", True)])
def test_low_precision_layers_copy_their_gemm_inputs_quantized(precision, fp4):
    """Transformer Engine keeps the inputs of QKV, FC1 and FC2 quantized (FP8 1 byte, NVFP4
    0.5625) and the attention output twice (16-bit and quantized); the norm inputs, Q/K/V and
    the SwiGLU input stay 16-bit: ``(8 + 2 q) h + (2 + q) h + 2 h (1 + 2 kv / heads)`` per
    token plus ``(4 + q) f`` at tp 1 (11.5 h + 5 f in FP8, 12.5 h + 6 f in bf16)."""
    plan = dataclasses.replace(PLAN, offload_fraction=0.5)
    h, f = LLAMA.hidden, LLAMA.ffn_hidden
    tokens = plan.microbatch * LLAMA.seq_len
    qkv = 2.0 * h * (1.0 + 2.0 * LLAMA.kv_heads / LLAMA.heads)
    for prec, q in (("bf16", 2.0), (precision, 0.5625 if fp4 else 1.0)):
        model = dataclasses.replace(LLAMA, precision=prec, dropout=False)  # no dropout masks
        m, p, _ = arrays(model, plan)
        per_token = (4.0 + 2.0 * q) * h + (2.0 + q if q < 2.0 else 2.0) * h + qkv + (4.0 + q) * f
        saved = float(offload.saved_bytes(workload.layer_work(m, p), p))
        assert saved == pytest.approx(tokens * per_token, rel=REL)


def test_copies_spread_over_every_layer():
    """k of L layers copy once each, spread over all L layers (TE's scheduler): the average
    layer overlaps k / L of one copy with its compute, so a copy longer than one layer's
    compute stays hidden while k / L of it fits."""
    m, p, _ = arrays(LLAMA, PLAN)
    core, copy = jnp.array([1.0, 2.0]), 3.0
    exact = lambda a, b: jnp.maximum(a, b)  # noqa: E731  no interference
    for share, exposed in ((0.25, [0.0, 0.0]), (0.5, [0.5, 0.0]), (0.0, [0.0, 0.0])):
        got = offload.exposed_s(core, copy, p.replace(offload=share), exact)
        np.testing.assert_allclose(np.asarray(got), exposed, atol=1e-15)


def test_gradient_is_finite():
    m, p, c = arrays(LLAMA, dataclasses.replace(PLAN, offload_fraction=0.5))
    params = default_params(jnp.float64)

    def time_of(offload_share, host_Bps):
        plan = p.replace(offload=offload_share)
        cluster = c.replace(host_Bps=host_Bps)
        return simulate(m, plan, cluster, params, TEMPERATURE).iteration_s

    d_share, d_host = jax.grad(time_of, argnums=(0, 1))(jnp.asarray(0.5), jnp.asarray(c.host_Bps))
    assert np.isfinite(d_share) and float(d_share) > 0.0
    assert np.isfinite(d_host) and float(d_host) < 0.0


@pytest.mark.parametrize("value", ["1.0", "1.5", "-0.1"])
def test_offload_fraction_out_of_range_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"offload_fraction.*\[0, 1\)|offload_fraction.*>= 0"):
        load_experiment("llama3-8b-fsdp", [f"plan.offload_fraction={value}"])


def test_host_link_must_be_positive():
    with pytest.raises(ConfigError, match=r"host_link_GBps=0.*> 0"):
        load_experiment("llama3-8b-fsdp", ["cluster.host_link_GBps=0"])


def test_offload_fraction_loads():
    exp = load_experiment("llama3-8b-fsdp", ["plan.offload_fraction=0.25"])
    assert exp.plan.offload_fraction == 0.25


@pytest.mark.skipif(not SHARED_DATA.exists(), reason="shared data not available")
def test_megatron_bridge_fsdp_recipes_offload_on_grace_blackwell_only():
    rows = read_rows(SHARED_DATA / "e2e" / "calibration.csv")
    cache: dict = {}
    # LLAMA3_70B FSDP FP8: 40 of 80 layers on GB200, 20 on GB300; LLAMA3_8B FSDP on H100: none
    for row, share in ((1700, 0.5), (1697, 0.25), (1763, 0.0)):
        _, plan, _, used = row_to_specs(rows[row - 1], cache)
        assert plan.offload_fraction == share
        assert any("offloaded" in u for u in used) == (share > 0)


_MEGATRON = "--num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "


@pytest.mark.parametrize(
    "flags, share",
    [
        ("", 0.0),
        ("--cpu-offloading", 0.0),  # the switch alone offloads Megatron's default of 0 layers
        ("--cpu-offloading-num-layers 2", 0.25),  # a count turns the switch on (validate_args)
        ("--cpu-offloading --cpu-offloading-num-layers 6", 0.75),
        ("--cpu-offloading-num-layers 0", 0.0),
    ],
)
def test_megatron_cpu_offloading_flags(flags, share):
    from diffcost.megatron_args import parse_megatron_args

    _, plan, ignored = parse_megatron_args(_MEGATRON + flags, n_gpus=4)
    assert (plan.offload_fraction, ignored) == (share, [])


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--cpu-offloading-num-layers 8", "0 to 7 of the 8 layers"),
        ("--cpu-offloading-num-layers 2 --pipeline-model-parallel-size 2", "one pipeline stage"),
        ("--cpu-offloading-num-layers 2 --recompute-activations", "recomputation"),
        ("--cpu-offloading-num-layers two", "not a number"),
    ],
)
def test_megatron_cpu_offloading_errors(flags, message):
    from diffcost.megatron_args import parse_megatron_args

    with pytest.raises(ValueError, match=message):
        parse_megatron_args(_MEGATRON + flags, n_gpus=4)
