"""Microbenchmarks of a target's kernels and collectives, as the model times them, with their
Jacobians ``d log t / d raw`` over ``diffcost.params.SCALAR_NAMES``.

A GEMM is one kernel ``(m x k) @ (k x n)`` at the model's precision: ``kernels.gemm_s`` at the
large-GEMM rate, its shape-grid factor, plus the per-kernel gap (``kernel_overhead_s``), as
the calibration's GEMM level times a row of a GEMM table. A collective is ``comm.collective_s``
on a group of ``size`` ranks with ``per_node`` of them per node, as the calibration's
collective level times a row of an nccl-tests table.

A fused attention kernel is ``kernels.fused_attention_s`` at the layer's attention shape and
its shape efficiency (``Params.attention_eff``), forward or backward, plus the per-kernel gap,
as the calibration's attention level times a row of an attention kernel table.

``target_gemms``, ``target_attention`` and ``target_collectives`` list what a target experiment
runs: its layer's GEMMs per GPU (QKV, attention output, and for a dense model the two MLP
GEMMs), its fused attention forward and backward, and its tensor- and data-parallel
collectives at their message sizes (the data-parallel one over two nodes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from diffcost import comm, kernels, smooth
from diffcost.api import experiment_arrays
from diffcost.arrays import ACT_BYTES, cluster_arrays, model_arrays
from diffcost.cache import fast_compile_jit
from diffcost.params import GEMM_GRID_CLASSES, Params
from diffcost.specs import Experiment
from diffcost.uncertainty import raw_scalars, with_raw_scalars
from diffcost.workload import layer_work

LOW_PRECISIONS = ("fp8", "fp4")  # GEMMs read the low-precision shape grid
GRAD_BYTES = 4.0  # a data-parallel gradient element reduced in fp32 (Megatron's main_grad)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM ``(m x k) @ (k x n)`` at the model's precision on one GPU."""

    name: str
    m: int
    n: int
    k: int


@dataclasses.dataclass(frozen=True)
class Attention:
    """The target layer's fused attention kernel on one GPU, forward (``stage`` 0) or
    backward (1), at its shape (``diffcost.workload.layer_work``)."""

    name: str
    stage: int


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective (a ``comm.COLLECTIVES`` name) of ``msg_bytes`` over ``size`` ranks,
    ``per_node`` of them in each node."""

    name: str
    op: str
    msg_bytes: float
    size: int
    per_node: int


def target_gemms(exp: Experiment) -> list[Gemm]:
    """The GEMMs of one of ``exp``'s layers on one GPU (forward shapes; tokens of one
    microbatch, its context-parallel share)."""
    m, p = exp.model, exp.plan
    tokens = p.microbatch * m.seq_len // p.cp
    head_dim = m.hidden // m.heads
    out = [
        Gemm("QKV", tokens, (m.hidden + 2 * m.kv_heads * head_dim) // p.tp, m.hidden),
        Gemm("attention output", tokens, m.hidden, m.hidden // p.tp),
    ]
    if m.moe is None:  # expert GEMMs see a routed share of the tokens
        up = m.ffn_hidden * (2 if m.mlp == "swiglu" else 1)
        out.append(Gemm("MLP up", tokens, up // p.tp, m.hidden))
        out.append(Gemm("MLP down", tokens, m.hidden, m.ffn_hidden // p.tp))
    return out


def target_attention(exp: Experiment) -> list[Attention]:
    """The fused attention kernels of one of ``exp``'s layers, forward and backward (none for
    unfused attention)."""
    if not exp.model.flash_attention:
        return []
    return [Attention("attention forward", 0), Attention("attention backward", 1)]


def target_collectives(exp: Experiment) -> list[Collective]:
    """``exp``'s tensor-parallel collectives of one layer's activations (all-gather and
    reduce-scatter with sequence parallelism, else all-reduce) on one node, and its
    data-parallel gradient reduction of one layer (reduce-scatter under ZeRO, else all-reduce)
    over two nodes."""
    m, p, c = exp.model, exp.plan, exp.cluster
    out = []
    if 1 < p.tp <= c.gpus_per_node:
        act = ACT_BYTES * p.microbatch * m.seq_len / p.cp * m.hidden
        ops = ("all_gather", "reduce_scatter") if p.sequence_parallel else ("all_reduce",)
        out += [Collective(f"tensor-parallel {op}", op, act, p.tp, p.tp) for op in ops]
    if p.dp > 1:
        head_dim = m.hidden // m.heads
        attn = m.hidden * (m.hidden + 2 * m.kv_heads * head_dim) + m.hidden * m.hidden
        mlp = m.hidden * m.ffn_hidden * (3 if m.mlp == "swiglu" else 2)
        grad = GRAD_BYTES * (attn + mlp) / p.tp
        op = "reduce_scatter" if p.zero >= 1 else "all_reduce"
        n = 2 * c.gpus_per_node
        out.append(Collective(f"data-parallel {op}", op, grad, n, c.gpus_per_node))
    return out


def _gemm_log_time(raw, m, n, k, model, cluster, params: Params, temperature, row):
    p = with_raw_scalars(params, raw)
    rate = jnp.maximum(kernels.gemm_peak_flops(model, cluster, p), 1.0)
    log_eff = kernels.shape_log_eff(p.gemm_shape_log_eff, m, n, k, row=row)
    t = kernels.gemm_s(m, n, k, rate, cluster, p, temperature, log_eff) + p.kernel_overhead_s
    return jnp.log(t)


def _attention_log_time(raw, model, plan, cluster, params: Params, temperature, stage):
    p = with_raw_scalars(params, raw)
    work = layer_work(model, plan)
    rate = jnp.maximum(kernels.half_peak_flops(model, cluster, p), 1.0)
    eff = p.attention_eff(model.flash2, work.attention_shape, model.triton)
    flops, n_bytes = work.attention_flops, work.attention_bytes
    t = kernels.fused_attention_s(flops, n_bytes, rate, eff, cluster, p, temperature)
    return jnp.log(t[stage] + p.kernel_overhead_s)


def _collective_log_time(raw, msg_bytes, size, per_node, cluster, params, temperature, op):
    p = with_raw_scalars(params, raw)
    group = comm.place(size, cluster.gpus_per_node / per_node, cluster.gpus_per_node)
    return jnp.log(comm.collective_s(op, msg_bytes, group, cluster, p, temperature))


def _gemm_jacobian(params, m, n, k, model, cluster, temperature, row):
    raw = raw_scalars(params)
    args = (m, n, k, model, cluster, params, temperature, row)
    return jax.value_and_grad(_gemm_log_time)(raw, *args)


def _attention_jacobian(params, model, plan, cluster, temperature, stage):
    raw = raw_scalars(params)
    args = (model, plan, cluster, params, temperature, stage)
    return jax.value_and_grad(_attention_log_time)(raw, *args)


def _collective_jacobian(params, msg_bytes, size, per_node, cluster, temperature, op):
    raw = raw_scalars(params)
    args = (msg_bytes, size, per_node, cluster, params, temperature, op)
    return jax.value_and_grad(_collective_log_time)(raw, *args)


# one reverse pass each, compiled the fast way (``diffcost.cache``)
_gemm = fast_compile_jit(_gemm_jacobian, static_argnames=("temperature", "row"))
_attention = fast_compile_jit(_attention_jacobian, static_argnames=("temperature", "stage"))
_collective = fast_compile_jit(_collective_jacobian, static_argnames=("temperature", "op"))


def gemm_log_time_jacobian(
    exp: Experiment, gemm: Gemm, params: Params, temperature=smooth.DEFAULT_TEMPERATURE
):
    """(log seconds, ``d log t / d raw``) of one GEMM at ``exp``'s precision on its GPU."""
    row = GEMM_GRID_CLASSES.index("low" if exp.model.precision in LOW_PRECISIONS else "high")
    model, cluster = model_arrays(exp.model), cluster_arrays(exp.cluster)
    dims = (float(gemm.m), float(gemm.n), float(gemm.k))
    return _gemm(params, *dims, model, cluster, temperature=temperature, row=row)


def attention_log_time_jacobian(
    exp: Experiment, attn: Attention, params: Params, temperature=smooth.DEFAULT_TEMPERATURE
):
    """(log seconds, ``d log t / d raw``) of ``exp``'s fused attention kernel (one pass)."""
    model, plan, cluster = experiment_arrays(exp)
    return _attention(params, model, plan, cluster, temperature=temperature, stage=attn.stage)


def collective_log_time_jacobian(
    exp: Experiment, coll: Collective, params: Params, temperature=smooth.DEFAULT_TEMPERATURE
):
    """(log seconds, ``d log t / d raw``) of one collective on ``exp``'s cluster."""
    args = (float(coll.msg_bytes), float(coll.size), float(coll.per_node))
    cluster = cluster_arrays(exp.cluster)
    return _collective(params, *args, cluster, temperature=temperature, op=coll.op)
