"""SBP on a 2-D device mesh: one signature per mesh axis for every node, priced per axis.

A mesh ``(d0, d1)`` of ``d0 d1`` consecutive GPUs: axis 1 groups ``d1`` adjacent ranks
(``comm.place(d1, 1, ...)``, inside a node when it fits), axis 0 groups ranks ``d1`` apart. A
node's 2-D signature is a pair of the 1-D signatures ``sbp.sbp_problem`` gives it on a mesh of
``d0`` and of ``d1`` devices (OneFlow's nd-SBP); a pair that splits the same loop on both axes
is valid only when ``d0 d1`` divides every tensor axis it splits. The replicated pair is last,
so ``sbp_search`` (which needs only the node and use structure and the costs) searches a
``MeshProblem`` unchanged.

Costs, per device:

* compute: the operator's roofline with each split GEMM dimension divided by the mesh axes that
  split it and every tensor's HBM bytes by the product of the axes it is split over;
* re-layout: per mesh axis, ``sbp.relayout_kind`` of that axis's layouts, a collective over
  that axis's groups on the bytes one device holds along the other axis (divided by the other
  axis's size when the tensor is split there); backward likewise on the gradient layouts;
* optimizer: the stored shard (divided by every axis that splits it); partial graph outputs
  reduce-scattered per axis.

So data parallelism on one axis and Megatron tensor parallelism on the other are one plan: a
column-parallel product is ``(S(0) x B -> S(0), B x S(1) -> S(1))``.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from diffcost import comm, smooth
from diffcost.arrays import ClusterArrays
from diffcost.kernels import memory_bound_s
from diffcost.opgraph.ir import Graph
from diffcost.opgraph.pricing import graph_arrays, op_times_s
from diffcost.opgraph.sbp import (
    Node,
    SbpParts,
    SbpProblem,
    candidate_arrays,
    gradient_in,
    relayout_codes,
    sbp_problem,
)
from diffcost.params import Params


@dataclasses.dataclass(frozen=True)
class MeshSignature:
    """A pair of 1-D signatures, one per mesh axis (``axes[0]`` on ``d0``)."""

    name: str
    axes: tuple
    index: tuple[int, int] = (0, 0)  # of ``axes`` among the node's 1-D signatures per axis


@dataclasses.dataclass(frozen=True)
class MeshProblem(SbpProblem):
    """An ``SbpProblem`` whose nodes carry ``MeshSignature``s on the mesh ``mesh_shape``."""

    mesh_shape: tuple[int, int] = (1, 1)
    axis_problems: tuple = ()  # the 1-D problems on d0 and on d1 devices


def _splits(sig, shapes) -> list[tuple[int, int]]:
    """(tensor position, axis) of every split tensor of a 1-D signature."""
    layouts = (*sig.inputs, *sig.outputs)
    return [(i, x.axis) for i, x in enumerate(layouts) if x.kind == "S" and i < len(shapes)]


def _pairs(a_sigs, b_sigs, shapes, total: int) -> tuple[MeshSignature, ...]:
    """Valid pairs; the same loop split on both axes needs ``total`` to divide its axes."""
    out = []
    for i, sa in enumerate(a_sigs):
        for j, sb in enumerate(b_sigs):
            same = (sa.inputs, sa.outputs) == (sb.inputs, sb.outputs) and sa.split
            if same and any(shapes[t][ax] % total for t, ax in _splits(sa, shapes)):
                continue
            out.append(MeshSignature(f"{sa.name} | {sb.name}", (sa, sb), (i, j)))
    return tuple(out)


def mesh_problem(graph: Graph, mesh_shape) -> MeshProblem:
    """The SBP problem of ``graph`` on a 2-D mesh ``(d0, d1)``.

    Raises:
        ValueError: a mesh that is not two sizes >= 1.
    """
    shape = tuple(int(d) for d in mesh_shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"mesh_problem: mesh_shape {mesh_shape}; need two sizes >= 1")
    a, b = sbp_problem(graph, shape[0]), sbp_problem(graph, shape[1])
    nodes = []
    for na, nb in zip(a.nodes, b.nodes):
        if na.op < 0:
            shapes = [graph.tensors[na.tensor].shape]
        else:
            op = graph.operators[na.op]
            shapes = [graph.tensors[t].shape for t in (*op.inputs, *op.outputs)]
        sigs = _pairs(na.signatures, nb.signatures, shapes, math.prod(shape))
        nodes.append(Node(na.name, na.op, na.tensor, na.trained, sigs))
    return MeshProblem(graph, math.prod(shape), tuple(nodes), a.uses, shape, (a, b))


def _divisor(layout_a, layout_b, shape) -> float:
    return (shape[0] if layout_a.kind == "S" else 1.0) * (shape[1] if layout_b.kind == "S" else 1.0)


def _shares(problem: MeshProblem):
    """``shares`` of ``sbp.candidate_arrays`` for pair signatures: GEMM divisors of both axes
    multiplied, each tensor's bytes divided by the product of the axes that split it."""
    d = problem.mesh_shape

    def shares(sig, tensors):
        sa, sb = sig.axes
        divisor = np.asarray(sa.gemm_divisor) * np.asarray(sb.gemm_divisor)
        layouts = zip(tensors, (*sa.inputs, *sa.outputs), (*sb.inputs, *sb.outputs))
        total = sum(t.bytes for t in tensors) or 1.0
        return divisor, sum(t.bytes / _divisor(x, y, d) for t, x, y in layouts) / total

    return shares


def _relayouts(problem: MeshProblem):
    """Per mesh axis, ``[n_uses, K, K]`` forward and backward relayout codes (those of the
    axis's 1-D problem, gathered by each pair's index) and the bytes each device holds along
    the other axis."""
    k, d = problem.max_signatures, problem.mesh_shape
    shape = (2, len(problem.uses), k, k)
    fwd, bwd = np.zeros(shape, np.int64), np.zeros(shape, np.int64)
    fwd_bytes, bwd_bytes = np.zeros(shape), np.zeros(shape)
    codes = [relayout_codes(p) for p in problem.axis_problems]
    for e, u in enumerate(problem.uses):
        size = problem.graph.tensors[u.tensor].bytes
        ps, cs = problem.nodes[u.producer].signatures, problem.nodes[u.consumer].signatures
        for ax in (0, 1):
            ip = np.asarray([s.index[ax] for s in ps])
            ic = np.asarray([s.index[ax] for s in cs])
            fwd[ax, e, : len(ps), : len(cs)] = codes[ax][0][e][np.ix_(ip, ic)]
            bwd[ax, e, : len(ps), : len(cs)] = codes[ax][1][e][np.ix_(ip, ic)]
            other = 1 - ax
            held = [s.axes[other].outputs[u.slot_out].kind == "S" for s in ps]
            fwd_bytes[ax, e, : len(ps), :] = (size / np.where(held, d[other], 1.0))[:, None]
            held = [gradient_in(s.axes[other], u.slot_in).kind == "S" for s in cs]
            bwd_bytes[ax, e, :, : len(cs)] = (size / np.where(held, d[other], 1.0))[None, :]
    return fwd, bwd, fwd_bytes, bwd_bytes


def _collective_s(code, size, n, group, cluster, params, temperature):
    """Seconds of the ``RELAYOUTS`` collective ``code`` on ``size`` bytes (arrays alike)."""
    args = (group, cluster, params, temperature)
    table = [
        jnp.zeros_like(size),
        comm.all_gather_s(size, *args),
        comm.all_reduce_s(size, *args),
        comm.reduce_scatter_s(size, *args),
        comm.all_to_all_s(size / n, *args),
    ]
    return sum(jnp.where(code == j, t, 0.0) for j, t in enumerate(table))


def _stored_and_partial(problem: MeshProblem):
    """``[N, K]`` elements of trained stored shards (the optimizer updates) and ``[2, N, K]``
    partial-output bytes per axis."""
    g, k, d = problem.graph, problem.max_signatures, problem.mesh_shape
    stored = np.zeros((len(problem.nodes), k))
    partial = np.zeros((2, len(problem.nodes), k))
    outputs = set(g.outputs)
    for i, node in enumerate(problem.nodes):
        for s, sig in enumerate(node.signatures):
            sa, sb = sig.axes
            if node.op < 0 and node.trained:
                div = _divisor(sa.outputs[0], sb.outputs[0], d)
                stored[i, s] = g.tensors[node.tensor].size / div
            if node.op >= 0:
                op = g.operators[node.op]
                for j, t in enumerate(op.outputs):
                    for ax in (0, 1) if t in outputs else ():
                        if sig.axes[ax].outputs[j].kind == "P":
                            partial[ax, i, s] += g.tensors[t].bytes
    return stored, partial


def mesh_parts(
    problem: MeshProblem,
    cluster: ClusterArrays,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
) -> SbpParts:
    """The costs of a 2-D problem by part (``sbp.SbpParts``; ``.costs()`` for the search)."""
    stored, partial = _stored_and_partial(problem)
    fwd, bwd, fwd_bytes, bwd_bytes = _relayouts(problem)
    arrays = (stored, partial, fwd, bwd, fwd_bytes, bwd_bytes)
    cand = candidate_arrays(problem, graph_arrays(problem.graph), shares=_shares(problem))
    static = (problem.mesh_shape, len(problem.nodes), temperature)
    return _price(cand, *(jnp.asarray(x) for x in arrays), cluster, params, *static)


@partial(jax.jit, static_argnums=(9, 10, 11))
def _price(cand, stored, partial_out, fwd, bwd, fwd_bytes, bwd_bytes, cluster, params, d, n, tau):
    compute = op_times_s(cand, cluster, params, tau).reshape(n, -1)
    stored = stored * params.optimizer_bytes_per_param
    optimizer = jnp.where(stored > 0, memory_bound_s(stored, cluster, params), 0.0)
    per_node = cluster.gpus_per_node
    groups = (comm.place(d[0], float(d[1]), per_node), comm.place(d[1], 1.0, per_node))
    forward = backward = finish = 0.0
    for ax in (0, 1):
        args = (float(d[ax]), groups[ax], cluster, params, tau)
        forward = forward + _collective_s(fwd[ax], fwd_bytes[ax], *args)
        backward = backward + _collective_s(bwd[ax], bwd_bytes[ax], *args)
        p = partial_out[ax]
        finish = finish + jnp.where(p > 0, comm.reduce_scatter_s(p, *args[1:]), 0.0)
    return SbpParts(
        compute_s=compute,
        optimizer_s=optimizer,
        finish_s=finish * jnp.ones_like(compute),
        forward_s=forward,
        backward_s=backward,
    )
