"""A first cost of an operator graph on one GPU: a roofline per operator, in JAX.

Matrix products, convolutions (as implicit GEMMs) and unfused attention products take the
project's GEMM model (``kernels.gemm_s``: peak FLOP/s of the operand type times the calibrated
large-GEMM efficiency, the small-dimension falloff, the shape grid, a smooth maximum with the
operand traffic), times their batch count. A convolution's operand traffic is its tensors'
bytes (input, kernel, output: ``hbm_bytes``), not its implicit GEMM's ``m x k`` operand, which
holds every input element once per kernel tap (27 times for a 3x3x3 kernel) and is never
stored: implicit-GEMM kernels read an input tile once and reuse it across the taps on chip.
Every other operator is memory-bound: its HBM traffic over ``hbm_Bps x mem_eff``
(``kernels.memory_bound_s``). Elementwise and layout operators fuse the way XLA fuses them to
first order: a tensor produced by an elementwise or layout operator and read only by
elementwise, layout or reduction operators stays on chip (it is neither written nor read
through HBM) unless the step keeps it (an output, a gradient, a saved tensor). Views (reshape,
broadcast, squeeze, expand_dims) move nothing. Each operator that writes HBM is one kernel
launch (``Params.kernel_overhead_s``). Collectives cost nothing here: they need a mesh and the
cluster's links (the sharding step prices them).

The graph's structure is static (numpy, built once by ``graph_arrays``); the time is a smooth
function of ``Params`` and the cluster, so ``jax.grad`` w.r.t. either works.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import smooth
from diffcost.arrays import ClusterArrays
from diffcost.kernels import gemm_operand_bytes, gemm_s, memory_bound_s
from diffcost.opgraph.ir import GEMM_KINDS, Graph
from diffcost.params import Params
from diffcost.specs import PRECISIONS

VIEWS = frozenset(
    "reshape squeeze expand_dims broadcast_in_dim stop_gradient sharding_constraint "
    "optimization_barrier".split()
)
_FUSIBLE_PRODUCERS = frozenset(("elementwise", "layout"))
_FUSIBLE_CONSUMERS = frozenset(("elementwise", "layout", "reduction"))
_PRECISION_OF = {"float64": "fp32", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@struct.dataclass
class GraphArrays:
    """Per-operator arrays of a graph (``[n_ops]`` unless stated)."""

    gemm: jax.Array  # [n_ops, 4] (batch, m, n, k); zeros for non-GEMM operators
    is_gemm: jax.Array  # 1 for matmul, convolution, attention
    is_conv: jax.Array  # 1 for convolutions (GEMM traffic: ``hbm_bytes``)
    hbm_bytes: jax.Array  # bytes through HBM per execution, after fusion
    launches: jax.Array  # kernels launched per execution (0 or 1)
    count: jax.Array  # executions (loop trip counts)
    precision: jax.Array  # [n_ops, n_precisions] one-hot of the operand type
    backward: jax.Array  # 1 for backward-pass operators


def precision_index(dtype: str) -> int:
    """Index in ``PRECISIONS`` of a numpy dtype name (fp8/fp4 by prefix; others fp32)."""
    if dtype.startswith("float8"):
        return PRECISIONS.index("fp8")
    if dtype.startswith("float4"):
        return PRECISIONS.index("fp4")
    return PRECISIONS.index(_PRECISION_OF.get(dtype, "fp32"))


def on_chip(graph: Graph) -> np.ndarray:
    """Boolean per tensor: fused away (never written to or read from HBM)."""
    kept = set(graph.outputs) | set(graph.gradients) | set(graph.saved)
    users = graph.consumers()
    out = np.zeros(len(graph.tensors), dtype=bool)
    for t in graph.tensors:
        if t.producer < 0 or t.id in kept or not users[t.id]:
            continue
        producer = graph.operators[t.producer]
        readers = {graph.operators[i].kind for i in users[t.id]}
        out[t.id] = producer.kind in _FUSIBLE_PRODUCERS and readers <= _FUSIBLE_CONSUMERS
    return out


def graph_arrays(graph: Graph, dtype=None) -> GraphArrays:
    """The static per-operator arrays of ``graph`` for ``op_times_s``."""
    dtype = dtype or jnp.result_type(float)
    fused = on_chip(graph)
    n = len(graph.operators)
    gemm = np.zeros((n, 4))
    hbm, launches = np.zeros(n), np.zeros(n)
    precision = np.zeros((n, len(PRECISIONS)))
    for i, op in enumerate(graph.operators):
        precision[i, precision_index(op.dtype)] = 1.0
        if op.kind in GEMM_KINDS:
            gemm[i] = op.gemm
        if op.primitive in VIEWS or op.kind == "collective":
            continue
        size = lambda ids: sum(graph.tensors[t].bytes for t in set(ids) if fused[t])  # noqa: E731
        read = max(op.bytes_read - size(op.inputs), 0.0)
        written = max(op.bytes_written - size(op.outputs), 0.0)
        hbm[i] = read + written
        launches[i] = float(written > 0 or op.kind in GEMM_KINDS)
    as_array = lambda a: jnp.asarray(a, dtype=dtype)  # noqa: E731
    return GraphArrays(
        gemm=as_array(gemm),
        is_gemm=as_array([op.kind in GEMM_KINDS for op in graph.operators]),
        is_conv=as_array([op.kind == "convolution" for op in graph.operators]),
        hbm_bytes=as_array(hbm),
        launches=as_array(launches),
        count=as_array([op.count for op in graph.operators]),
        precision=as_array(precision),
        backward=as_array([op.phase == "backward" for op in graph.operators]),
    )


def op_times_s(
    arrays: GraphArrays,
    cluster: ClusterArrays,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
):
    """Seconds of every operator, all its executions, ``[n_ops]``."""
    rate = arrays.precision @ (cluster.peak_flops * params.gemm_eff)
    b, m, n, k = (arrays.gemm[:, i] for i in range(4))
    conv = arrays.is_conv
    io = conv * arrays.hbm_bytes / jnp.maximum(b, 1.0) + (1.0 - conv) * gemm_operand_bytes(m, n, k)
    gemm = b * gemm_s(m, n, k, jnp.maximum(rate, 1.0), cluster, params, temperature, io_bytes=io)
    memory = memory_bound_s(arrays.hbm_bytes, cluster, params)
    one = arrays.is_gemm * gemm + (1.0 - arrays.is_gemm) * memory
    return arrays.count * (one + arrays.launches * params.kernel_overhead_s)


def graph_time_s(
    graph: Graph | GraphArrays,
    cluster: ClusterArrays,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
):
    """Seconds of the graph's forward and backward passes on one GPU, ``[2]``; their sum is
    the step's compute time (one operator at a time, no overlap).

    Args:
        graph: a ``Graph`` (``from_jax``) or its ``graph_arrays`` (build those once outside a
            jitted or differentiated function).
        cluster: ``arrays.cluster_arrays`` of the cluster (one GPU of it runs the graph).
        params: calibrated constants.
        temperature: softness of the rooflines' smooth maxima.

    Returns:
        ``[forward_s, backward_s]``.
    """
    arrays = graph_arrays(graph) if isinstance(graph, Graph) else graph
    times = op_times_s(arrays, cluster, params, temperature)
    backward = jnp.sum(times * arrays.backward)
    return jnp.stack([jnp.sum(times) - backward, backward])
