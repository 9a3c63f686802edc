"""One data-parallel training step of an operator graph: every GPU runs the whole graph on its
own samples, and the parameters' gradients are all-reduced while the backward runs.

It is ``step.compose_step`` (the overlap model of every graph step) with no re-layouts:

``T = fwd + overlap(bwd, all_reduce) + optimizer + microbatch_overhead + iteration_overhead``

* ``fwd``, ``bwd``: ``pricing.graph_time_s`` of the graph at the per-GPU batch (per-operator
  rooflines and one ``kernel_overhead_s`` per launched kernel), or seconds priced elsewhere;
* ``all_reduce``: the gradients (``grad_bytes``) over the ``n_gpus`` data-parallel ranks as one
  bucketed collective, priced by ``comm.all_reduce_s`` on the cluster (ranks numbered node by
  node), as ``step.step_time`` prices a data-parallel assignment's gradient sync;
* ``overlap``: Horovod and PyTorch DDP all-reduce gradient buckets while the backward runs; the
  two streams take the longer of the two, each slowed by ``params.interference`` over the time
  they share. The last bucket's all-reduce after the backward is not modelled separately;
* ``optimizer``: one memory-bound pass over ``n_params * params.optimizer_bytes_per_param``;
* ``microbatch_overhead``, ``iteration_overhead``: the host steps of ``Params``.

So ``step.step_time`` of an SBP data-parallel assignment whose only collectives are the
weight-gradient all-reduces equals this function given that assignment's forward and backward
compute, gradient bytes and parameter count (``tests/test_data_parallel_graph.py``).

Differentiable w.r.t. the cluster and ``Params`` (the graph arrays are static).
"""

from __future__ import annotations

import jax.numpy as jnp

from diffcost import comm, smooth
from diffcost.arrays import ClusterArrays
from diffcost.kernels import memory_bound_s
from diffcost.opgraph.pricing import GraphArrays, graph_time_s
from diffcost.opgraph.step import StepTime, compose_step
from diffcost.params import Params


def data_parallel_step_s(
    graph: GraphArrays | jnp.ndarray,
    n_gpus,
    n_params,
    grad_bytes,
    cluster: ClusterArrays,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
) -> StepTime:
    """One training step of ``graph`` data parallel over ``n_gpus`` GPUs of ``cluster``.

    Args:
        graph: the graph's static arrays at the per-GPU batch (``pricing.graph_arrays``:
            forward and backward operators), or its ``[forward_s, backward_s]`` already priced.
        n_gpus: data-parallel ranks (>= 1).
        n_params: trained parameters (the optimizer updates them all on every GPU).
        grad_bytes: bytes of the gradients all-reduced per step.
        cluster, params: the cluster's arrays and calibrated constants.
        temperature: softness of the smooth maxima.

    Returns:
        ``step.StepTime`` (``grad_sync_s`` the all-reduce, ``relayout_s`` 0).
    """
    if isinstance(graph, GraphArrays):
        fwd, bwd = graph_time_s(graph, cluster, params, temperature)
    else:
        fwd, bwd = graph[0], graph[1]
    group = comm.place(n_gpus, 1.0, cluster.gpus_per_node)
    all_reduce = comm.all_reduce_s(grad_bytes, group, cluster, params, temperature)
    optimizer = memory_bound_s(n_params * params.optimizer_bytes_per_param, cluster, params)
    zero = jnp.zeros_like(fwd)
    return compose_step(fwd, bwd, zero, zero, all_reduce, optimizer, params, temperature)
