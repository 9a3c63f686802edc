"""The transformer layer as operators (``layer_ops``): ``LayerWork`` summed from them equals the
closed form it replaced (``closed_form_workload``), eagerly, under jit, vmap and gradients."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from closed_form_workload import closed_form_layer_work
from helpers import LLAMA, MOE, arrays

from diffcost import config, layer_ops, workload
from diffcost.specs import PlanSpec

REL = 1e-12
MODELS = sorted(p for p in (Path(__file__).parent.parent / "configs" / "models").glob("[!_]*.yaml"))
PLANS = {
    "single": PlanSpec(microbatch=2, global_batch=8),
    "tp8-sp-selective": PlanSpec(
        tp=8, dp=2, sequence_parallel=True, recompute="selective", global_batch=16
    ),
    "tp4-nosp-full": PlanSpec(tp=4, pp=2, recompute="full", microbatch=2, global_batch=16),
    "cp4-tp2-sp": PlanSpec(tp=2, cp=4, dp=2, sequence_parallel=True, global_batch=8),
    "ep8": PlanSpec(dp=16, ep=8, tp=2, sequence_parallel=True, global_batch=64),
    "lora-all": PlanSpec(tp=2, dp=4, lora_rank=16, lora_modules="all", global_batch=32),
    "lora-attention": PlanSpec(dp=8, lora_rank=8, global_batch=32, recompute="selective"),
}
# Architecture switches the presets leave at one value: each preset also runs with these.
VARIANTS = {
    "as-is": {},
    "encoder-unfused-fp8": {"causal": False, "attention": "unfused", "precision": "fp8"},
    "masked-head-no-dropout": {"head_tokens": 0.15, "dropout": False, "kv_heads": 1},
}


def assert_same_work(a, b, rel=REL):
    leaves_a = jax.tree_util.tree_leaves_with_path(a)
    leaves_b = jax.tree_util.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for (path, x), y in zip(leaves_a, leaves_b):
        np.testing.assert_allclose(x, y, rtol=rel, atol=0, err_msg=jax.tree_util.keystr(path))


def _model(path, variant):
    spec = config.load_model(path)
    return dataclasses.replace(spec, **VARIANTS[variant])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("path", MODELS, ids=[p.stem for p in MODELS])
def test_layer_work_from_operators_equals_the_closed_form(path, variant):
    spec = _model(path, variant)
    for plan in PLANS.values():
        m, p, _ = arrays(spec, plan)
        assert_same_work(workload.layer_work(m, p), closed_form_layer_work(m, p))


def _relaxed_plans():
    """Plans between discrete ones: fractional degrees, SP, recompute and LoRA mixtures."""
    _, p, _ = arrays(MOE, PLANS["ep8"])
    out = []
    for tp, sp, cp, ep, lora in ((1.5, 0.3, 1.0, 2.5, 0.0), (3.2, 0.9, 2.7, 6.1, 0.4)):
        out.append(
            p.replace(
                tp=jnp.asarray(tp),
                sp=jnp.asarray(sp),
                cp=jnp.asarray(cp),
                ep=jnp.asarray(ep),
                lora=jnp.asarray(lora),
                lora_rank=jnp.asarray(12.0),
                lora_targets=jnp.asarray([0.2, 0.5, 1.0, 0.0]),
                recompute=jnp.asarray([0.5, 0.3, 0.2]),
            )
        )
    return out


@pytest.mark.parametrize("spec", [MOE, LLAMA], ids=["moe", "llama"])
def test_relaxed_plans_under_jit_and_vmap(spec):
    m = arrays(spec)[0]
    plans = _relaxed_plans()
    batched = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *plans)
    got = jax.jit(jax.vmap(workload.layer_work, in_axes=(None, 0)))(m, batched)
    for i, p in enumerate(plans):
        one = jax.tree_util.tree_map(lambda x, i=i: x[i], got)
        assert_same_work(one, closed_form_layer_work(m, p))
        assert_same_work(jax.jit(workload.layer_work)(m, p), closed_form_layer_work(m, p))


def _scalar(work_fn, m):
    def f(plan):
        w = work_fn(m, plan)
        return (
            jnp.sum(w.gemms.flops)
            + w.attention_flops
            + w.attention_bytes
            + w.elementwise_bytes
            + jnp.sum(w.activation_bytes * jnp.asarray([1.0, 2.0, 3.0]))
            + w.dense_params
            + w.expert_params
            + w.kv_msg_bytes
            + w.ep_msg_bytes
            + w.p2p_msg_bytes
            + jnp.sum(w.adapter_gemms.flops)
            + jnp.sum(w.attention_shape)
        )

    return f


@pytest.mark.parametrize("spec", [MOE, LLAMA], ids=["moe", "llama"])
def test_gradients_equal_the_closed_form(spec):
    m = arrays(spec)[0]
    for p in _relaxed_plans():
        got = jax.grad(_scalar(workload.layer_work, m))(p)
        want = jax.grad(_scalar(closed_form_layer_work, m))(p)
        assert float(jnp.abs(got.tp)) > 0.0
        assert_same_work(got, want, rel=1e-10)


def test_operators_sum_per_kernel_class():
    m, p, _ = arrays(MOE, PLANS["ep8"])
    ops = layer_ops.layer_ops(m, p)
    work = workload.layer_work(m, p)
    assert set(layer_ops.KERNEL_CLASS.values()) == set(layer_ops.KERNEL_CLASSES)
    assert ops.m.shape == ops.flops.shape == (len(layer_ops.OPS),)
    assert ops.saved_bytes.shape == (len(layer_ops.RECOMPUTE_MODES), len(layer_ops.OPS))
    gemm_flops = float(ops.total("flops", "gemm"))
    assert gemm_flops == pytest.approx(float(jnp.sum(work.gemms.flops)), rel=REL)
    assert float(ops.total("flops", "memory")) == 0.0
    assert float(ops.forward_flops) == pytest.approx(float(work.forward_flops), rel=REL)
    # memory-bound and attention operators have no GEMM shape; GEMMs no HBM bytes of their own
    for name, kind in layer_ops.KERNEL_CLASS.items():
        (m_,) = np.asarray(ops.of("m", (name,)))
        (b_,) = np.asarray(ops.of("hbm_bytes", (name,)))
        assert (m_ > 0) == (kind == "gemm")
        assert (b_ > 0) == (kind != "gemm")
    # full recompute keeps the layer input only: the first norm's input
    full = np.asarray(ops.saved_bytes[2])
    assert np.count_nonzero(full) == 1 and full[layer_ops.OPS.index("norm_attn")] > 0
    with pytest.raises(ValueError, match="class 'conv'"):
        ops.total("flops", "conv")


# Flax module scope of each GEMM and attention operator in the zoo's encoder block.
BLOCK_SCOPES = {
    "qkv": ("/query", "/key", "/value"),
    "attention": ("/...qhd,...khd->...hqk", "/...hqk,...khd->...qhd"),
    "attn_out": ("/out",),
    "fc1": ("/Dense_0",),
    "fc2": ("/Dense_1",),
}


def test_builder_layer_against_the_imported_zoo_block():
    """The builder's layer at the zoo encoder block's shape (4 x 128 tokens, width 512, 8
    heads, GELU MLP 2048) against ``from_jax`` of the block: each GEMM and attention product
    to the FLOP; the whole forward within 1% (the builder prices norms, activation, softmax
    and residuals by their HBM bytes and counts no FLOPs for them)."""
    from diffcost import zoo
    from diffcost.arrays import model_arrays, plan_arrays
    from diffcost.opgraph import from_jax
    from diffcost.specs import ModelSpec

    block = zoo.model("transformer_block", batch=4)
    g = from_jax(block.fn, *block.args, argnums=block.argnums)
    spec = ModelSpec(
        name="block", n_layers=1, hidden=512, ffn_hidden=2048, heads=8, kv_heads=8, seq_len=128,
        vocab=32000, causal=False, dropout=False, attention="unfused",
    )  # fmt: skip
    ops = layer_ops.layer_ops(model_arrays(spec), plan_arrays(PlanSpec(microbatch=4)))
    products = g.select("forward", ["matmul", "attention"])
    for name, scopes in BLOCK_SCOPES.items():
        graph = sum(op.flops * op.count for op in products if op.scope.endswith(scopes))
        assert float(ops.of("flops", (name,))[0]) == graph, name
    assert float(ops.total("flops", "gemm") + ops.total("flops", "attention")) == sum(
        op.flops * op.count for op in products
    )
    total = g.flops("forward")
    assert float(ops.forward_flops) == pytest.approx(total, rel=0.01)
    assert float(ops.forward_flops) < total  # what is left: elementwise and reductions


def test_examples_in_docstrings():
    import doctest

    for module in (layer_ops, workload):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
