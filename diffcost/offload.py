"""CPU activation offloading: a share of the layers keeps its saved activations in host memory.

Megatron-Core's ``cpu_offloading`` (Transformer Engine's ``get_cpu_offload_context``, with
``cpu_offloading_activations`` on and ``cpu_offloading_weights`` off, as Megatron-Bridge's
performance recipes set it) copies the tensors a layer saves for its backward to pinned host
memory on a side stream while the next layer computes, and copies them back one layer ahead of
the backward. ``PlanSpec.offload_fraction`` is the share of the layers treated so
(``cpu_offloading_num_layers / n_layers``).

* **Time** (``copy_s``, used by ``stages.layer_parts_s``): each offloaded layer moves its saved
  activations once each way per microbatch over the GPU-host link (``ClusterSpec.host_link_GBps``,
  one direction: half the datasheet's both-directions figure), overlapped with that layer's
  forward and with its backward (recompute included) the way the model overlaps every other
  transfer (``stages._overlap``: each stream slows by the interference factor over the
  overlapping time). What the copy does not hide lengthens the layer.
* **Memory** (``resident_activation_bytes``, used by ``simulate.memory``): the offloaded layers'
  activations leave the GPU; one layer's worth stays as the staging buffer of the copies.

References:
    Transformer Engine, ``transformer_engine/pytorch/cpu_offload.py`` (the double-buffered
    group offload handler); Megatron-Core ``TransformerConfig.cpu_offloading*``.
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

    Args:
        core_s: [2] seconds of one layer's forward and backward (recompute included).
        host_copy_s: ``copy_s``, one direction.
        plan: the plan (``plan.offload``: share of the layers offloaded).
        overlap_fn: ``(compute_s, copy_s) -> seconds`` of the two streams run together.

    Returns:
        [2] seconds, ``plan.offload`` times each offloaded layer's exposed copy and
        interference; 0 without offloading.
    """
    return plan.offload * (overlap_fn(core_s, host_copy_s) - core_s)


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
