"""LoRA fine-tuning (``PlanSpec.lora_rank``): frozen base weights against full fine-tuning."""

import dataclasses

import jax.numpy as jnp
import pytest
from helpers import CLUSTER, LLAMA, arrays

from diffcost import config, default_params, kernels, workload
from diffcost.simulate import OPTIMIZER_STATE_BYTES, simulate, stage_times
from diffcost.specs import PlanSpec
from diffcost.stages import grad_bytes

REL = 1e-9
RANK = 16
FULL = PlanSpec(tp=2, dp=4, sequence_parallel=True, microbatch=1, global_batch=8)
LORA = dataclasses.replace(FULL, lora_rank=RANK)


def _adapter_params_per_layer(model, tp, modules):
    """r (k + n) per targeted GEMM on one GPU, from the model's shapes (tp-sharded)."""
    h, kv = model.hidden, model.kv_heads / model.heads
    qkv = (h, h * (1 + 2 * kv) / tp)  # (k, n) column-parallel
    proj = (h / tp, h)  # row-parallel
    fc1 = (h, model.ffn_hidden * 2 / tp)  # SwiGLU gate + up
    fc2 = (model.ffn_hidden / tp, h)
    shapes = {"attention": [qkv, proj], "mlp": [fc1, fc2], "all": [qkv, proj, fc1, fc2]}
    return sum(RANK * (k + n) for k, n in shapes[modules])


@pytest.mark.parametrize("modules", ["attention", "mlp", "all"])
def test_lora_trains_only_the_adapters(modules):
    plan = dataclasses.replace(LORA, lora_modules=modules)
    m, p, _ = arrays(LLAMA, plan)
    work = workload.layer_work(m, p)
    expected = _adapter_params_per_layer(LLAMA, plan.tp, modules)
    assert float(work.trained_params) == pytest.approx(expected, rel=REL)
    assert float(work.trained_embedding_params) == 0.0
    assert float(work.trained_expert_params) == 0.0
    # the base weights are all still held
    full = workload.layer_work(*arrays(LLAMA, FULL)[:2])
    assert float(work.dense_params) == float(full.dense_params)


def test_without_lora_every_parameter_is_trained():
    m, p, _ = arrays(LLAMA, FULL)
    work = workload.layer_work(m, p)
    assert float(work.lora) == 0.0
    assert float(work.trained_params) == float(work.dense_params)
    assert float(work.trained_embedding_params) == float(work.embedding_params)
    assert float(jnp.sum(work.adapter_gemms.flops)) == 0.0


def _kernel_times(plan):
    m, p, c = arrays(LLAMA, plan)
    work = workload.layer_work(m, p)
    params = default_params()
    return work, m, c, params, kernels.kernel_times(work, m, c, params, 1e-3)


def test_lora_skips_the_weight_gradient_gemms():
    """With flat shape grids a GEMM's forward, dgrad and wgrad take the same time, so full
    fine-tuning's GEMM backward is twice the forward G and LoRA's is G plus the adapters'."""
    work, m, c, params, full = _kernel_times(FULL)
    lora_work, _, _, _, lora = _kernel_times(LORA)
    adapters = kernels.adapter_gemm_s(lora_work, m, c, params, 1e-3)
    g = work.gemms
    rate = kernels.gemm_peak_flops(m, c, params)
    fwd_gemms = kernels.gemm_s(g.m, g.n, g.k, rate, c, params, 1e-3, jnp.zeros(5))
    gemm_fwd_s = float(jnp.sum(fwd_gemms))
    # forward: the same kernels plus the adapters
    assert float(lora.layer_s[0] - full.layer_s[0]) == pytest.approx(float(adapters[0]), rel=1e-6)
    # backward: one GEMM pass fewer (no wgrad), plus the adapters' backward
    saved = float(full.layer_s[1] - lora.layer_s[1] + adapters[1])
    assert saved == pytest.approx(gemm_fwd_s, rel=1e-6)
    # the LM head keeps its input gradient (dgrad) and drops its weight gradient
    assert float(full.head_s[1]) == pytest.approx(2 * float(full.head_s[0]), rel=1e-9)
    assert float(lora.head_s[1]) == pytest.approx(float(lora.head_s[0]), rel=1e-9)
    # rank-16 adapters on 2048-wide projections are a small part of the layer
    assert 0 < float(adapters[0]) < 0.05 * gemm_fwd_s


def test_lora_keeps_gradients_and_optimizer_state_of_the_adapters_only():
    full = simulate(*arrays(LLAMA, FULL), default_params())
    lora = simulate(*arrays(LLAMA, LORA), default_params())
    layers = LLAMA.n_layers / FULL.pp
    adapters = layers * _adapter_params_per_layer(LLAMA, FULL.tp, "attention")
    m, p, _ = arrays(LLAMA, LORA)
    assert float(lora.optimizer_bytes[0]) == pytest.approx(
        OPTIMIZER_STATE_BYTES * adapters, rel=REL
    )
    assert float(lora.grads_bytes[0]) == pytest.approx(float(grad_bytes(p)) * adapters, rel=REL)
    # full fine-tuning holds them for every parameter (~250 times more on this small model)
    assert float(full.optimizer_bytes[0]) > 100 * float(lora.optimizer_bytes[0])
    # the 16-bit base weights stay, plus the adapters
    extra = float(lora.weights_bytes[0] - full.weights_bytes[0])
    assert extra == pytest.approx(2.0 * adapters, rel=1e-6)
    assert float(lora.memory_peak_bytes) < float(full.memory_peak_bytes)


def test_lora_syncs_and_updates_only_the_adapters():
    params = default_params()
    full = stage_times(*arrays(LLAMA, FULL), params, 1e-3)
    lora = stage_times(*arrays(LLAMA, LORA), params, 1e-3)
    # a layer's adapter gradients are a latency-bound message (~20x faster here)
    assert float(lora.dp_bucket_s[0]) < 0.1 * float(full.dp_bucket_s[0])
    assert float(lora.optimizer_s) < 0.01 * float(full.optimizer_s)


def test_lora_plan_fields_are_validated():
    with pytest.raises(config.ConfigError, match="lora_rank"):
        config.load_experiment("gpt3-175b", ["plan.lora_rank=0"])
    with pytest.raises(config.ConfigError, match="lora_modules.*'attention'"):
        config.load_experiment("gpt3-175b", ["plan.lora_modules=qkv"])
    plan = config.load_experiment("gpt3-175b", ["plan.lora_rank=8"]).plan
    assert plan.lora_rank == 8 and plan.lora_modules == "attention"


def test_lora_model_flops_drop_the_weight_gradients():
    m, full, _ = arrays(LLAMA, FULL)
    _, lora, _ = arrays(LLAMA, LORA)
    ratio = workload.model_flops_per_iteration(m, lora) / workload.model_flops_per_iteration(
        m, full
    )
    assert float(ratio) == pytest.approx(2.0 / 3.0, rel=REL)


def test_a_plan_space_keeps_the_lora_setting_fixed():
    from diffcost import space

    sp = space.make_space(LLAMA, CLUSTER, 8, 16, lora_rank=RANK, lora_modules="mlp")
    plans, choices = space.enumerate_plans(sp)
    n = len(choices)
    assert n > 1 and plans.lora.shape == (n,) and (plans.lora == 1.0).all()
    assert (plans.lora_rank == RANK).all() and plans.lora_targets.shape == (n, 4)
    assert (plans.lora_targets == [0.0, 0.0, 1.0, 1.0]).all()
    spec = sp.plan_spec(choices[0])
    assert (spec.lora_rank, spec.lora_modules) == (RANK, "mlp")
    plain = space.enumerate_plans(space.make_space(LLAMA, CLUSTER, 8, 16))[0]
    assert (plain.lora == 0.0).all() and (plain.lora_targets == 0.0).all()
