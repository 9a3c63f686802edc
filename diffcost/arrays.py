"""Array pytrees of a model, a cluster and a plan: what the numerical core consumes.

Everything a sweep may vary or an optimizer may relax is a float leaf: parallel degrees and
microbatch size are floats, categorical choices are probability vectors (one-hot for a discrete
plan), the dimension order is a rank vector. Conversion from the static specs happens here, at
the edge, once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import specs
from diffcost.specs import ClusterSpec, ModelSpec, PlanSpec
from diffcost.topology import ring_share

GiB = 2.0**30
ACT_BYTES = 2.0  # activations and 16-bit weights are bf16/fp16 even when GEMMs run in fp8/fp4


@struct.dataclass
class ModelArrays:
    """Transformer shape as float leaves (counts), plus architecture switches in [0, 1]."""

    n_layers: jax.Array
    hidden: jax.Array
    ffn_hidden: jax.Array
    heads: jax.Array
    kv_heads: jax.Array
    seq_len: jax.Array
    vocab: jax.Array
    swiglu: jax.Array  # 1: three MLP matrices (gate, up, down); 0: two (GELU)
    tied: jax.Array  # 1: LM head shares the embedding matrix
    bias: jax.Array  # 1: linear layers have biases
    experts: jax.Array  # 1 for a dense model
    top_k: jax.Array
    capacity_factor: jax.Array
    flash: jax.Array  # 1: fused attention (flash or cudnn)
    flash2: jax.Array  # 1: FlashAttention-2
    triton: jax.Array  # 1: FlashAttention in Triton
    precision: jax.Array  # [n_precisions] one-hot: which peak the GEMMs run at
    dropout: jax.Array  # 1: dropout masks are kept for backward
    causal: jax.Array  # 1: causal attention (fused kernels skip the masked half)
    head_tokens: jax.Array  # fraction of the tokens the LM head and loss run on


@struct.dataclass
class ClusterArrays:
    """Hardware facts in SI units."""

    peak_flops: jax.Array  # [n_precisions] FLOP/s, 0 where the GPU has no such rate
    hbm_Bps: jax.Array
    memory_bytes: jax.Array
    gpus_per_node: jax.Array
    nvlink_Bps: jax.Array  # per GPU, one direction
    nvlink_latency_s: jax.Array
    nic_Bps: jax.Array  # per GPU share of the node's NICs, one direction
    nic_latency_s: jax.Array
    oversubscription: jax.Array
    host_Bps: jax.Array  # GPU <-> host memory, per GPU, one direction
    ring_share: jax.Array  # [RING_TABLE] NVLink share of a ring over n GPUs of a node
    # ``diffcost.network.tables.NetworkTables`` of the job on a topology graph, or None:
    # with it, collectives are priced on the graph (``diffcost.network.model``)
    network: Any = None


@struct.dataclass
class PlanArrays:
    """A (possibly relaxed) plan. Degrees and batch sizes are floats >= 1."""

    tp: jax.Array
    pp: jax.Array
    dp: jax.Array
    cp: jax.Array
    ep: jax.Array
    microbatch: jax.Array
    global_batch: jax.Array
    chunks: jax.Array  # virtual stages per pipeline rank
    split_edges: jax.Array  # [0, 1]: the embedding and the loss take a layer's place each
    sp: jax.Array  # sequence parallel in [0, 1]
    overlap_dp: jax.Array  # [0, 1]
    overlap_tp: jax.Array  # [0, 1]
    grad_reduce_fp32: jax.Array  # [0, 1]: 4- or 2-byte gradients (ZeRO 0-2)
    zero: jax.Array  # [4] probabilities of ZeRO stage 0..3
    gather_layer: jax.Array  # [0, 1]: ZeRO-2 gathers parameters per layer (FSDP SHARD_GRAD_OP)
    recompute: jax.Array  # [3] probabilities of none / selective / full
    offload: jax.Array  # [0, 1): share of the layers whose activations go to host memory
    schedule: jax.Array  # [3] probabilities of gpipe / 1f1b / interleaved
    order: jax.Array  # [4] rank of (tp, cp, dp, pp) from innermost (0) outwards
    lora: jax.Array  # [0, 1]: 1 when the base weights are frozen (LoRA fine-tuning)
    lora_rank: jax.Array  # adapter rank (0 without LoRA)
    lora_targets: jax.Array  # [4] 1 where QKV, attention output, FC1, FC2 carry adapters
    # 1.0: the step replays CUDA graphs (no host dispatch per op); a static setting of the
    # implementation, not relaxed by the plan search (which keeps the default, eager launches)
    cuda_graphs: float = struct.field(pytree_node=False, default=0.0)

    @property
    def n_microbatches(self):
        return self.global_batch / (self.dp * self.microbatch)

    @property
    def n_gpus(self):
        return self.dp * self.tp * self.pp * self.cp


def _as_float(dtype):
    """Converter to float leaves: ``dtype``, or JAX's default float (float64 under x64).

    Leaves are numpy arrays: building many configurations costs no device transfers, and jit
    or any jax.numpy operation takes them as they are.
    """
    dtype = jnp.result_type(float) if dtype is None else dtype
    return lambda v: np.asarray(v, dtype=dtype)


def _one_hot(index: int, n: int) -> np.ndarray:
    out = np.zeros(n)
    out[index] = 1.0
    return out


def _copied(spec, names, f) -> dict:
    """``{name: f(spec.name)}`` for the numeric fields copied as they are."""
    return {name: f(getattr(spec, name)) for name in names}


def _choice(menu, value, f):
    """One-hot leaf of ``value`` among ``menu``."""
    return f(_one_hot(menu.index(value), len(menu)))


def model_arrays(model: ModelSpec, dtype=None) -> ModelArrays:
    """Convert a ``ModelSpec`` to float leaves."""
    moe = model.moe
    f = _as_float(dtype)
    return ModelArrays(
        **_copied(model, ("n_layers", "hidden", "ffn_hidden", "heads", "kv_heads", "seq_len"), f),
        vocab=f(model.vocab),
        swiglu=f(1.0 if model.mlp == "swiglu" else 0.0),
        tied=f(1.0 if model.tied_embeddings else 0.0),
        bias=f(1.0 if model.bias else 0.0),
        experts=f(moe.experts if moe else 1),
        top_k=f(moe.top_k if moe else 1),
        capacity_factor=f(moe.capacity_factor if moe else 1.0),
        flash=f(1.0 if model.flash_attention else 0.0),
        flash2=f(1.0 if model.attention == "flash" else 0.0),
        triton=f(1.0 if model.attention == "triton" else 0.0),
        precision=_choice(specs.PRECISIONS, model.precision, f),
        dropout=f(1.0 if model.dropout else 0.0),
        causal=f(1.0 if model.causal else 0.0),
        head_tokens=f(model.head_tokens),
    )


def cluster_arrays(cluster: ClusterSpec, dtype=None, n_gpus: int | None = None) -> ClusterArrays:
    """Convert a ``ClusterSpec`` (config units) to SI units.

    With ``n_gpus`` and a cluster that names a ``topology``, the arrays carry the job's
    ``NetworkTables`` (``diffcost.network.attach.job_tables``), and collectives are priced on
    the graph; otherwise ``network`` is None.
    """
    gpu = cluster.gpu
    f = _as_float(dtype)
    peak = [gpu.peak_tflops.get(p, 0.0) * 1e12 for p in specs.PRECISIONS]
    nic_per_gpu = cluster.nics_per_node * cluster.nic_Gbps * 1e9 / 8 / cluster.gpus_per_node
    return ClusterArrays(
        peak_flops=f(peak),
        hbm_Bps=f(gpu.hbm_bandwidth_GBps * 1e9),
        memory_bytes=f(gpu.memory_GiB * GiB),
        gpus_per_node=f(cluster.gpus_per_node),
        nvlink_Bps=f(cluster.nvlink_GBps * 1e9 / 2),
        nvlink_latency_s=f(cluster.nvlink_latency_us * 1e-6),
        nic_Bps=f(nic_per_gpu),
        nic_latency_s=f(cluster.nic_latency_us * 1e-6),
        oversubscription=f(cluster.oversubscription),
        host_Bps=f(cluster.host_link_GBps * 1e9 / 2),
        ring_share=f(ring_share(cluster.intra_node, cluster.gpus_per_node)),
        network=_network(cluster, n_gpus, f),
    )


def _network(cluster: ClusterSpec, n_gpus, f):
    if not cluster.topology or n_gpus is None:
        return None
    from diffcost.network.attach import job_tables  # the graph layer sits above the arrays

    tables = job_tables(cluster, int(n_gpus))
    return jax.tree_util.tree_map(f, tables)


def plan_arrays(plan: PlanSpec, dtype=None) -> PlanArrays:
    """Convert a discrete ``PlanSpec`` to a one-hot ``PlanArrays``."""
    f = _as_float(dtype)
    order = np.array([plan.order.index(d) for d in specs.PLACED_DIMS], dtype=float)
    return PlanArrays(
        **_copied(plan, (*specs.PLACED_DIMS, "ep", "microbatch", "global_batch"), f),
        chunks=f(plan.chunks if plan.schedule == "interleaved" else 1),
        split_edges=f(1.0 if plan.split_edges else 0.0),
        sp=f(1.0 if (plan.sequence_parallel and plan.tp > 1) else 0.0),
        overlap_dp=f(1.0 if plan.overlap_dp else 0.0),
        overlap_tp=f(1.0 if plan.overlap_tp else 0.0),
        grad_reduce_fp32=f(1.0 if plan.grad_reduce_fp32 else 0.0),
        zero=_choice(specs.ZERO_STAGES, plan.zero, f),
        gather_layer=f(1.0 if plan.param_gather == "layer" else 0.0),
        recompute=_recompute_leaf(plan, f),
        offload=f(plan.offload_fraction),
        schedule=_choice(specs.SCHEDULES, plan.schedule, f),
        order=f(order),
        **lora_leaves(plan.lora_rank, plan.lora_modules, f),
        cuda_graphs=1.0 if plan.cuda_graphs else 0.0,
    )


def _recompute_leaf(plan: PlanSpec, f):
    """Probabilities of none / selective / full: ``recompute`` on ``recompute_fraction`` of the
    layers, none on the rest (time and saved activations are linear in them)."""
    menu, share = specs.RECOMPUTE_MODES, plan.recompute_fraction
    mode, none = (_one_hot(menu.index(m), len(menu)) for m in (plan.recompute, "none"))
    return f(share * mode + (1.0 - share) * none)


def lora_leaves(rank: int | None, modules: str, f=None, n: int | None = None) -> dict:
    """The ``lora``, ``lora_rank`` and ``lora_targets`` leaves of a plan (``n`` copies each
    along a leading axis when given)."""
    f = _as_float(None) if f is None else f
    on = rank is not None
    leaves = {
        "lora": f(1.0 if on else 0.0),
        "lora_rank": f(float(rank) if on else 0.0),
        "lora_targets": f(specs.LORA_MODULES[modules] if on else (0.0,) * 4),
    }
    if n is None:
        return leaves
    return {k: np.broadcast_to(v, (n, *np.shape(v))).copy() for k, v in leaves.items()}


def stack(trees):
    """Stack a list of identically shaped pytrees along a new leading (batch) axis (numpy)."""
    return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)
