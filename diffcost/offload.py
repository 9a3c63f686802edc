"""CPU activation offloading: a share of the layers keeps its saved activations in host memory.

Megatron-Core's ``cpu_offloading`` (Transformer Engine's ``get_cpu_offload_context``, with
``cpu_offloading_activations`` on and ``cpu_offloading_weights`` off, as Megatron-Bridge's
performance recipes set it) copies the tensors a layer saves for its backward to pinned host
memory on a side stream while the next layer computes, and copies them back one layer ahead of
the backward. ``PlanSpec.offload_fraction`` is the share of the layers treated so
(``cpu_offloading_num_layers / n_layers``).

* **Time** (``copy_s``, used by ``stages.layer_parts_s``): each offloaded layer moves its saved
  activations once each way per microbatch over the GPU-host link (``ClusterSpec.host_link_GBps``,
  one direction: half the datasheet's both-directions figure). Transformer Engine spreads the
  copies over the whole pass rather than over the offloaded layer alone: its load-balanced
  handler (``cpu_offload_v1.py``, ``AsyncDoubleBufferGroupOffloadHandler.layer_window_map``)
  gives each of the ``k`` offloaded layers a window of ``L / k`` layers of forward to finish its
  copy in, and ``L / k`` layers of backward to bring it back; the later scheduler
  (``cpu_offload.py``, ``OffloadSynchronizer``, TE pull request #1762, late 2025) starts
  each copy as soon as the tensor is saved and waits for it only ``L - k`` layers later.
  Either way the copies are serialised on one side stream and hidden while they fit in the
  compute of all ``L`` layers, so the model overlaps ``offload_fraction`` of one layer's copy
  with every layer's forward and backward (recompute included) the way it overlaps every
  other transfer (``stages._overlap``: each stream slows by the interference factor over the
  overlapping time). What the copies do not hide lengthens the layer.
* **Bytes** (``saved_bytes``): what the layer saves for its backward
  (``layer_ops._saved_bytes``): with FP8/FP4 GEMMs Transformer Engine keeps the GEMM inputs
  quantized, which is what its handler copies (the quantized tensor's data and scales); the
  scheduler skips parameters and tensors under 2^20 elements (norm statistics, softmax
  statistics), which the count leaves out too. The first scheduler copies only the tensors TE
  modules mark (``mark_activation_offload``: norm inputs and outputs, Q/K/V and the attention
  output, the Linear inputs), not Megatron-Core's SwiGLU input; the later one copies every
  saved tensor, which the model follows.
* **Memory** (``resident_activation_bytes``, used by ``simulate.memory``): the offloaded layers'
  activations leave the GPU; one layer's worth stays as the staging buffer of the copies.

References:
    Transformer Engine, ``transformer_engine/pytorch/cpu_offload.py`` (``OffloadSynchronizer``,
    default scheduling), ``cpu_offload_v1.py`` (``AsyncDoubleBufferGroupOffloadHandler``) and
    ``docs/features/other_optimizations/cpu_offloading/cpu_offloading.rst``; Megatron-Core
    ``TransformerConfig.cpu_offloading*``.
"""

from __future__ import annotations

import jax.numpy as jnp

from diffcost.arrays import ClusterArrays, PlanArrays
from diffcost.workload import LayerWork


def saved_bytes(work: LayerWork, plan: PlanArrays):
    """Bytes one layer saves for its backward per microbatch under the plan's recompute mix
    (what offloading moves): ``work.activation_bytes`` weighted by ``plan.recompute``."""
    return jnp.sum(plan.recompute * work.activation_bytes)


def copy_s(work: LayerWork, plan: PlanArrays, cluster: ClusterArrays):
    """Seconds to copy one layer's saved activations one way between the GPU and host memory.

    Args:
        work: ``workload.layer_work(model, plan)``.
        plan, cluster: array pytrees of one configuration.

    Returns:
        A scalar (s), the same whether or not the plan offloads (``exposed_s`` weighs it).

    Examples:
        >>> import numpy as np
        >>> from diffcost import arrays, config, workload
        >>> exp = config.load_experiment("llama3-8b-fsdp")
        >>> m, p = arrays.model_arrays(exp.model), arrays.plan_arrays(exp.plan)
        >>> c = arrays.cluster_arrays(exp.cluster)
        >>> bool(copy_s(workload.layer_work(m, p), p, c) > 0)
        True
    """
    return saved_bytes(work, plan) / cluster.host_Bps


def exposed_s(core_s, host_copy_s, plan: PlanArrays, overlap_fn):
    """What the copies of the offloaded layers add to the average layer ([2]: forward, backward).

    ``k`` of ``L`` layers each copy ``host_copy_s`` one way, spread over the compute of all
    ``L`` layers: the average layer overlaps ``(k / L) * host_copy_s`` of copying with its own
    compute (one copy per window of ``L / k`` layers, which is the same for an overlap that
    scales with its inputs).

    Args:
        core_s: [2] seconds of one layer's forward and backward (recompute included).
        host_copy_s: ``copy_s``, one direction.
        plan: the plan (``plan.offload``: share of the layers offloaded).
        overlap_fn: ``(compute_s, copy_s) -> seconds`` of the two streams run together.

    Returns:
        [2] seconds, the exposed copy time and interference per layer; exactly 0 without
        offloading.
    """
    return overlap_fn(core_s, plan.offload * host_copy_s) - overlap_fn(core_s, 0.0 * host_copy_s)


def resident_activation_bytes(act_layer, layers, in_flight, plan: PlanArrays):
    """Activations a stage keeps on the GPU: the layers not offloaded, for every microbatch in
    flight, plus one layer's staging buffer while any layer is offloaded.

    Args:
        act_layer: bytes one layer saves per microbatch.
        layers: layers of the stage.
        in_flight: [2] microbatches whose activations the stage holds at its peak (first, last).
        plan: the plan (``plan.offload``).

    Returns:
        [2] bytes (first, last stage).
    """
    offload = plan.offload
    return layers * (1.0 - offload) * act_layer * in_flight + offload * act_layer
