"""One data-parallel training step of an operator graph: every GPU runs the whole graph on its
own samples, and the parameters' gradients are all-reduced.

The step has the transformer core's parts (``diffcost.simulate``) where they mean the same:

``T = fwd + microbatch_overhead + overlap(bwd, all_reduce) + optimizer + iteration_overhead``

* ``fwd``, ``bwd``: ``pricing.graph_time_s`` of the graph at the per-GPU batch (per-operator
  rooflines and one ``kernel_overhead_s`` per launched kernel);
* ``all_reduce``: the gradients (``grad_bytes``) over the ``n_gpus`` data-parallel ranks,
  priced by ``comm.all_reduce_s`` on the cluster (ranks numbered node by node);
* ``overlap``: a data-parallel framework (Horovod, PyTorch DDP) all-reduces gradient buckets
  while the backward runs; the two streams take the longer of the two, each slowed by
  ``params.interference`` over the time they share (as the core's overlapped communication).
  The last bucket's all-reduce after the backward is not modelled separately;
* ``optimizer``: one memory-bound pass over ``n_params * params.optimizer_bytes_per_param``;
* ``microbatch_overhead``, ``iteration_overhead``: the host steps of ``Params``.

Differentiable w.r.t. the cluster and ``Params`` (the graph arrays are static).
"""

from __future__ import annotations

import jax
from flax import struct

from diffcost import comm, smooth
from diffcost.arrays import ClusterArrays
from diffcost.kernels import memory_bound_s
from diffcost.opgraph.pricing import GraphArrays, graph_time_s
from diffcost.params import Params


@struct.dataclass
class DataParallelStep:
    """Seconds of one data-parallel step and its parts."""

    iteration_s: jax.Array
    forward_s: jax.Array
    backward_s: jax.Array
    all_reduce_s: jax.Array  # the whole gradient all-reduce (most of it hidden)
    exposed_all_reduce_s: jax.Array  # what the backward does not hide
    optimizer_s: jax.Array
    overhead_s: jax.Array  # microbatch and iteration host steps


def data_parallel_step_s(
    arrays: GraphArrays,
    n_gpus,
    n_params,
    grad_bytes,
    cluster: ClusterArrays,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
) -> DataParallelStep:
    """One training step of the graph ``arrays`` (``pricing.graph_arrays`` at the per-GPU
    batch) data parallel over ``n_gpus`` GPUs of ``cluster``.

    Args:
        arrays: the graph's static arrays (forward and backward operators).
        n_gpus: data-parallel ranks (>= 1).
        n_params: trained parameters (the optimizer updates them all on every GPU).
        grad_bytes: bytes of the gradients all-reduced per step.
        cluster, params: the cluster's arrays and calibrated constants.
        temperature: softness of the smooth maxima.
    """
    fwd, bwd = graph_time_s(arrays, cluster, params, temperature)
    group = comm.place(n_gpus, 1.0, cluster.gpus_per_node)
    all_reduce = comm.all_reduce_s(grad_bytes, group, cluster, params, temperature)
    kappa = params.interference
    both = smooth.smin2(bwd, all_reduce, temperature)
    overlapped = smooth.smax2(bwd + kappa * both, all_reduce + kappa * both, temperature)
    optimizer = memory_bound_s(n_params * params.optimizer_bytes_per_param, cluster, params)
    overhead = params.microbatch_overhead_s + params.iteration_overhead_s
    return DataParallelStep(
        iteration_s=fwd + overlapped + optimizer + overhead,
        forward_s=fwd,
        backward_s=bwd,
        all_reduce_s=all_reduce,
        exposed_all_reduce_s=overlapped - bwd,
        optimizer_s=optimizer,
        overhead_s=overhead,
    )
