"""Peak memory per GPU against an independent calculation of what Megatron-Core allocates.

The reference below is plain numpy written from the published accounting, not from diffcost's
code:

* parameters on a stage: ``layers / pp`` transformer layers (matrices and column-parallel
  biases split by tp, norms and row-parallel biases replicated) plus the word embedding on the
  first stage and the output layer (or Megatron's copy of a tied embedding) on the last, split
  by tp; GPT-style models also hold learned absolute position embeddings (``s h``, not split)
  on the first stage (Megatron-LM ``megatron/training/theoretical_memory_usage.py``: the most
  loaded shard is ``(layers / pp + embedding) / tp``);
* bytes per parameter: the Megatron-Core distributed-optimizer table, bf16 parameters and fp32
  main gradients: 18 without and ``6 + 12 / d`` with the distributed optimizer (Rajbhandari
  et al., "ZeRO", 2020: 2 + 2 + 12 with mixed-precision Adam);
* activations of one layer and microbatch: Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models" (2022), Table 2 for GPT; for Llama-style layers
  the tensors saved for backward, enumerated as that paper's sec. 4.1 does (no dropout masks:
  Llama recipes train with dropout 0), with FlashAttention's fp32 softmax statistics (4 B per
  head and token);
* microbatches in flight at a rank's peak: the warm-up counts of Megatron's schedules
  (``forward_backward_pipelining_without_interleaving``: ``min(p - r, m)`` on rank ``r``;
  ``..._with_interleaving``: ``2 (p - r - 1) + (v - 1) p`` chunk forwards plus one, each
  ``1 / v`` of the rank's layers, every forward first when ``m = p``);
* full recompute: each layer's input per microbatch in flight, plus one layer's activations
  while it is recomputed;
* the first stage's embedding: 8 B token ids per token and, with dropout, a 1-byte mask;
* the last stage's logits: the 16-bit logits and the fp32 copy Megatron-Core's vocab-parallel
  cross entropy makes of them, ``6 s b V / t`` (Megatron-LM's theoretical memory counts the
  fp32 part, ``4 s b V / t``);
* no separate gradient buckets or send buffers (Megatron-Core's buckets are views of the
  gradient buffer; a received activation is the next layer's saved input).

diffcost's per-stage totals without the runtime reserve (``memory_stage_bytes -
RUNTIME_RESERVE_BYTES``, the memory ``torch.cuda.max_memory_allocated`` sees) must agree with it
within ``REFERENCE_RTOL`` on every stage. ``python tests/test_memory_reference.py`` prints the
table.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import CLUSTER

from diffcost import default_params
from diffcost.arrays import cluster_arrays, model_arrays, plan_arrays
from diffcost.simulate import RUNTIME_RESERVE_BYTES, simulate
from diffcost.specs import ModelSpec, PlanSpec

REFERENCE_RTOL = 0.02  # the target for memory against measurements

LLAMA3_8B = ModelSpec(
    "llama3-8b", 32, 4096, 14336, 32, 8, 8192, 128256, mlp="swiglu", norm="rmsnorm",
    tied_embeddings=False, bias=False, dropout=False,
)  # fmt: skip
LLAMA3_70B = ModelSpec(
    "llama3-70b", 80, 8192, 28672, 64, 8, 8192, 128256, mlp="swiglu", norm="rmsnorm",
    tied_embeddings=False, bias=False, dropout=False,
)  # fmt: skip
GPT3_175B = ModelSpec("gpt3-175b", 96, 12288, 49152, 96, 96, 2048, 51200, attention="unfused")

CONFIGS = {
    "llama3-8b tp1 pp1 dp8 distopt": (
        LLAMA3_8B,
        PlanSpec(dp=8, zero=1, microbatch=1, global_batch=128),
    ),
    "llama3-8b tp1 pp1 cp2 dp4 distopt": (
        LLAMA3_8B,
        PlanSpec(cp=2, dp=4, zero=1, microbatch=1, global_batch=128),
    ),
    "llama3-70b tp4 pp4 v5 dp8 SP distopt": (
        LLAMA3_70B,
        PlanSpec(
            tp=4, pp=4, dp=8, sequence_parallel=True, zero=1, microbatch=1, global_batch=128,
            schedule="interleaved", chunks=5,
        ),
    ),
    "gpt3-175b tp8 pp16 dp8 SP full recompute distopt": (
        GPT3_175B,
        PlanSpec(
            tp=8, pp=16, dp=8, sequence_parallel=True, zero=1, recompute="full", microbatch=1,
            global_batch=1536,
        ),
    ),
    "gpt3-175b tp8 pp8 dp16 SP selective": (
        GPT3_175B,
        PlanSpec(
            tp=8, pp=8, dp=16, sequence_parallel=True, recompute="selective", microbatch=1,
            global_batch=1024,
        ),
    ),
}  # fmt: skip


def _stage_params(m: ModelSpec, p: PlanSpec) -> np.ndarray:
    """Parameters held by one GPU of the first and of the last stage."""
    h, f, t = m.hidden, m.ffn_hidden, p.tp
    up = 2 if m.mlp == "swiglu" else 1  # gate and up projections
    qkv = h * (1 + 2 * m.kv_heads / m.heads)
    layer = (h * qkv + h * h + h * f * up + f * h) / t
    if m.bias:
        layer += (qkv + f * up) / t + 2 * h  # column-parallel biases split, row-parallel not
    norm = h * (2 if m.norm == "layernorm" else 1)
    layer += 2 * norm
    layers = m.n_layers / p.pp * layer
    word = m.vocab * h / t
    positions = m.seq_len * h if m.norm == "layernorm" and m.mlp == "gelu" else 0.0
    first = layers + word + positions
    last = layers + word + norm  # output layer (or the tied copy) and the final norm
    if p.pp == 1:
        first = last = first + norm + (0.0 if m.tied_embeddings else word)
    return np.array([first, last])


def _bytes_per_param(p: PlanSpec) -> float:
    """The distributed optimizer shards over the data-parallel group with context parallelism
    (Megatron-Core ``get_data_parallel_group(with_context_parallel=True)``)."""
    return 6.0 + 12.0 / (p.dp * p.cp) if p.zero == 1 else 18.0


def _layer_activations(m: ModelSpec, p: PlanSpec, mode: str) -> float:
    """Bytes one layer keeps for backward per microbatch."""
    s, b, h, a, t = m.seq_len // p.cp, p.microbatch, m.hidden, m.heads, p.tp
    sp = p.sequence_parallel and t > 1
    if mode == "full":
        return 2 * s * b * h / (t if sp else 1)
    if m.mlp == "gelu":  # Korthikanti et al. Table 2
        scores = 5 * a * m.seq_len / h if mode == "none" else 0.0
        if sp:
            return s * b * h * (34 + scores) / t
        return s * b * h * (10 + 24 / t + scores / t)
    kv = m.kv_heads / a
    replicated = 2 * h + 2 * h + 2 * h + 2 * h  # norm inputs, QKV and FC1 inputs (16-bit)
    split = 2 * h + 2 * 2 * h * kv + 2 * h + 2 * 2 * m.ffn_hidden + 2 * m.ffn_hidden
    split += 4 * a  # FlashAttention's fp32 log-sum-exp per head
    return s * b * (replicated / (t if sp else 1) + split / t)


def _in_flight(p: PlanSpec, rank: int) -> float:
    """Stage-loads of microbatch activations rank ``rank`` holds at its peak."""
    pp, m = p.pp, p.global_batch // (p.dp * p.microbatch)
    if p.schedule == "interleaved":
        v = p.chunks
        if m == pp:
            return float(m)
        return (2 * (pp - rank - 1) + (v - 1) * pp + 1) / v
    return float(min(pp - rank, m))


def reference_stage_bytes(m: ModelSpec, p: PlanSpec) -> np.ndarray:
    """Bytes one GPU of the first and of the last stage allocates at its peak."""
    static = _stage_params(m, p) * _bytes_per_param(p)
    s, b, t = m.seq_len // p.cp, p.microbatch, p.tp
    layers = m.n_layers / p.pp
    kept = _layer_activations(m, p, p.recompute)
    held = np.array([_in_flight(p, 0), _in_flight(p, p.pp - 1)])
    act = held * layers * kept
    if p.recompute == "full":
        act += _layer_activations(m, p, "none")
    embedding = held[0] * (8 * s * b + (s * b * m.hidden / t if m.dropout else 0.0))
    logits = 6 * s * b * m.vocab / t
    act += np.array([embedding + (logits if p.pp == 1 else 0.0), logits])
    return static + act


def diffcost_stage_bytes(m: ModelSpec, p: PlanSpec) -> np.ndarray:
    """diffcost's allocated bytes of the first and the last stage (exact model)."""
    params = default_params(np.float64)
    b = simulate(model_arrays(m), plan_arrays(p), cluster_arrays(CLUSTER), params, 0.0)
    return np.asarray(b.memory_stage_bytes) - RUNTIME_RESERVE_BYTES


@pytest.mark.parametrize("name", CONFIGS)
def test_stage_memory_matches_the_megatron_core_reference(name):
    model, plan = CONFIGS[name]
    ref = reference_stage_bytes(model, plan)
    got = diffcost_stage_bytes(model, plan)
    stages = slice(0, 2 if plan.pp > 1 else 1)
    np.testing.assert_allclose(got[stages], ref[stages], rtol=REFERENCE_RTOL)


def test_the_reference_reproduces_korthikanti_table_2():
    """The GPT reference is the paper's closed form: selective recompute with SP is
    ``34 s b h / t`` per layer, and no recompute with SP adds ``5 a s^2 b / t``."""
    model, plan = CONFIGS["gpt3-175b tp8 pp8 dp16 SP selective"]
    s, b, h, a, t = model.seq_len, plan.microbatch, model.hidden, model.heads, plan.tp
    assert _layer_activations(model, plan, "selective") == pytest.approx(34 * s * b * h / t)
    extra = _layer_activations(model, plan, "none") - _layer_activations(model, plan, "selective")
    assert extra == pytest.approx(5 * a * s * s * b / t)


def test_interleaved_in_flight_matches_megatrons_memory_penalty():
    """Rank 0 of the interleaved schedule holds ``p (1 + (p - 1) / (p v))`` stage-loads
    (Megatron-LM's ``interleaved_schedule_memory_penalty``), the last rank ``p - (p - 1) / v``."""
    _, plan = CONFIGS["llama3-70b tp4 pp4 v5 dp8 SP distopt"]
    p, v = plan.pp, plan.chunks
    assert _in_flight(plan, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert _in_flight(plan, p - 1) == pytest.approx(p - (p - 1) / v)


def _held_peak(order, v: int) -> float:
    """Most chunk activations held at once in a rank's task order, in stage-loads."""
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak / v


@pytest.mark.parametrize("name", ["1f1b", "interleaved"])
@pytest.mark.parametrize("p, m, v", [(2, 8, 4), (4, 4, 3), (4, 8, 2), (4, 8, 5), (8, 16, 3)])
def test_in_flight_closed_forms_match_the_exact_task_order(name, p, m, v):
    """The memory model's microbatches in flight on the first and the last rank equal the
    peak of forwards not yet matched by their backward in each schedule's exact order."""
    from diffcost.schedules import REGISTRY

    schedule = REGISTRY[name]
    v = v if schedule.interleaved else 1
    first, last = schedule.in_flight_fn(float(p), float(m), float(v), 0.0)
    exact = [_held_peak(schedule.order_fn(s, p, m, v), v) for s in (0, p - 1)]
    np.testing.assert_allclose([float(first), float(last)], exact, rtol=1e-12)


def _table() -> None:
    gib = 2.0**30
    print(
        f"{'config':50s} {'stage':5s} {'reference GiB':>13s} {'diffcost GiB':>12s} {'diff %':>7s}"
    )
    for name, (model, plan) in CONFIGS.items():
        ref, got = reference_stage_bytes(model, plan), diffcost_stage_bytes(model, plan)
        for i, stage in enumerate(["first", "last"][: 2 if plan.pp > 1 else 1]):
            diff = 100 * (got[i] / ref[i] - 1)
            print(f"{name:50s} {stage:5s} {ref[i] / gib:13.2f} {got[i] / gib:12.2f} {diff:+7.2f}")


def test_dropout_masks_are_two_bytes_per_token_and_three_per_score():
    """Without dropout a layer keeps neither the two 1-byte hidden masks (split by SP) nor the
    unfused attention's score mask and dropout output (1 + 2 B per score)."""
    from diffcost.workload import layer_activation_bytes

    model, plan = CONFIGS["gpt3-175b tp8 pp8 dp16 SP selective"]
    s, b, h, a, t = model.seq_len, plan.microbatch, model.hidden, model.heads, plan.tp
    on, off = (
        np.asarray(layer_activation_bytes(model_arrays(mm), plan_arrays(plan)))
        for mm in (model, dataclasses.replace(model, dropout=False))
    )
    masks = 2 * s * b * h / t
    np.testing.assert_allclose(on - off, [masks + 3 * a * s * s * b / t, masks, 0.0], rtol=1e-12)


def test_megatron_flags_turn_dropout_off_only_when_both_rates_are_zero():
    from diffcost.megatron_args import parse_megatron_args

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 8"
    assert parse_megatron_args(base, n_gpus=1)[0].dropout
    assert parse_megatron_args(base + " --hidden-dropout 0.0", n_gpus=1)[0].dropout
    off = " --hidden-dropout 0.0 --attention-dropout 0"
    assert not parse_megatron_args(base + off, n_gpus=1)[0].dropout


if __name__ == "__main__":
    import jax

    jax.config.update("jax_enable_x64", True)
    _table()
