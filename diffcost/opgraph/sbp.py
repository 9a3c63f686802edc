"""Per-operator sharding (SBP) of an operator graph on a 1-D device mesh, and its cost.

Every tensor of the step sits on the ``n`` devices of a mesh in one of OneFlow's SBP layouts:
``S(i)`` split along tensor axis ``i``, ``B`` broadcast (replicated) or ``P`` partial sums. An
operator's *signature* fixes the layouts of its inputs and outputs. The valid signatures come
from the operator's loop nest: every operator is a set of loops (a dot product's batch, free and
contracted dimensions; an elementwise operator's output axes; a reduction's kept and reduced
axes; a pooling window's axes of window and stride 1; a convolution's batch, output and input
channels), and splitting one loop over the mesh gives the signature where every tensor indexed
by that loop is ``S`` along the axis it indexes, every other input is ``B``, and an output that
the loop is summed out of is ``P``. With the all-``B`` signature (every device computes
everything) that reproduces OneFlow's tables: a matmul ``x @ w`` has ``S(0) x B -> S(0)`` (data
parallel), ``B x S(1) -> S(1)`` (column parallel), ``S(1) x S(0) -> P`` (row parallel) and
``B x B -> B``. Layout operators (reshape, transpose, broadcast) carry a split through when the
axis maps one to one.

Costs, all in seconds on one device (the devices run in lock step):

* **Compute** of an operator under a signature: the per-operator roofline of
  ``pricing.op_times_s`` with the split loop's GEMM dimension divided by ``n`` and the HBM
  traffic of its split tensors divided by ``n``; the backward pass costs ``BACKWARD_FACTOR``
  times the forward (a data and a weight gradient per product).
* **Re-layout** of a tensor between its producer's output layout and a consumer's input
  layout (``relayout_kind``): nothing (same layout, or a local slice: ``B -> S``, ``B -> P``,
  ``S -> P``), all-gather (``S -> B``), all-reduce (``P -> B``), reduce-scatter (``P -> S``) or
  all-to-all (``S(i) -> S(j)``), priced by ``diffcost.comm`` on the mesh's placement in the
  cluster.
* **Backward re-layouts** mirror the forward's: the gradient of a tensor flows from each
  consumer to the producer. A consumer hands back the gradient of an input in layout ``S(i)``
  for an ``S(i)`` input, ``B`` for a ``P`` input, and for a ``B`` input ``P`` when the operator
  is split (each device computed part of it) or ``B`` when it is replicated; a producer needs
  its output's gradient as ``S(i)`` for ``S(i)``, ``B`` for ``P`` or ``B``. So Megatron's
  column-parallel input (``B`` into a split matmul) all-reduces its gradient, and a
  data-parallel (``B``) weight all-reduces its gradient (the weight-gradient sync) while a
  split weight (``S``) does not.
* **Parameters** are nodes of their own whose signature is their stored layout (``B``
  replicated, ``S(i)`` sharded); the optimizer update of a stored shard moves
  ``Params.optimizer_bytes_per_param`` per element (the transformer core's constant; its
  default, 28, is Adam's seven fp32 passes: read weight, gradient, two moments; write weight,
  two moments). A sharded weight read as ``B`` is all-gathered in the
  forward and its gradient reduce-scattered: FSDP / ZeRO-3.

The search problem is a pairwise cost over the nodes' signature choices: ``node_s[i, s]`` plus
``edge_s[e, a, b]`` for each producer-consumer edge. ``diffcost.opgraph.sbp_search`` solves it.

References:
    Yuan et al., "OneFlow: Redesign the Distributed Deep Learning Framework from Scratch"
    (2021): SBP signatures and boxing; Chen et al., "AutoDDL" (TPDS 2024): analytic costs and
    coordinate descent over per-operator SBP; Shoeybi et al., "Megatron-LM" (2019).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import comm, smooth
from diffcost.arrays import ClusterArrays
from diffcost.kernels import memory_bound_s
from diffcost.opgraph.ir import GEMM_KINDS, Graph, Operator, Sbp
from diffcost.opgraph.pricing import GraphArrays, graph_arrays, op_times_s
from diffcost.params import Params

B, P = Sbp("B"), Sbp("P")
BACKWARD_FACTOR = {kind: 2.0 for kind in GEMM_KINDS}  # others: 1.0
RELAYOUTS = ("none", "all_gather", "all_reduce", "reduce_scatter", "all_to_all")
_SUM_REDUCTIONS = frozenset(("reduce_sum",))


def S(axis: int) -> Sbp:
    """The layout split along tensor axis ``axis``."""
    return Sbp("S", int(axis))


@dataclasses.dataclass(frozen=True)
class Loop:
    """One loop of an operator: its extent, the axis it indexes in each input and output (None:
    not indexed), the GEMM dimension (0-3 of ``(batch, m, n, k)``) it is, and whether the
    outputs it does not index are sums over it."""

    size: int
    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]
    gemm: int | None = None
    summed: bool = False


@dataclasses.dataclass(frozen=True)
class Signature:
    """One valid SBP signature of a node: layouts of its inputs and outputs, the divisor of
    each GEMM dimension, and whether the work is split (False: every device computes it all)."""

    name: str
    inputs: tuple[Sbp, ...]
    outputs: tuple[Sbp, ...]
    gemm_divisor: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)
    split: bool = False


@dataclasses.dataclass(frozen=True)
class Node:
    """A choice of the search: a forward operator (``op`` its index) or a stored tensor (a
    parameter or a data input, ``op`` = -1, ``tensor`` its id)."""

    name: str
    op: int
    tensor: int
    trained: bool
    signatures: tuple[Signature, ...]


@dataclasses.dataclass(frozen=True)
class Use:
    """Tensor ``tensor`` flows from output ``slot_out`` of node ``producer`` to input ``slot_in``
    of node ``consumer``; ``grad`` whether a gradient flows back along it."""

    producer: int
    slot_out: int
    consumer: int
    slot_in: int
    tensor: int
    grad: bool


@dataclasses.dataclass(frozen=True)
class SbpProblem:
    """The static SBP problem of a graph on a 1-D mesh of ``mesh_size`` devices."""

    graph: Graph
    mesh_size: int
    nodes: tuple[Node, ...]
    uses: tuple[Use, ...]

    @property
    def max_signatures(self) -> int:
        return max(len(n.signatures) for n in self.nodes)

    def valid(self) -> np.ndarray:
        """``[n_nodes, max_signatures]`` True where a node has that signature."""
        out = np.zeros((len(self.nodes), self.max_signatures), dtype=bool)
        for i, node in enumerate(self.nodes):
            out[i, : len(node.signatures)] = True
        return out

    def edges(self) -> np.ndarray:
        """``[n_uses, 2]`` (producer node, consumer node) of every use."""
        return np.asarray([(u.producer, u.consumer) for u in self.uses], np.int64).reshape(-1, 2)


def _attr(op: Operator, key: str, default=None):
    return dict(op.attributes).get(key, default)


def dot_loops(op: Operator, shapes) -> list[Loop]:
    """Loops of a ``dot_general``: batch, lhs free (GEMM m), rhs free (n), contracted (k)."""
    (lc, rc), (lb, rb) = _attr(op, "dimension_numbers")
    lhs, rhs = shapes
    lf = [a for a in range(len(lhs)) if a not in lc and a not in lb]
    rf = [a for a in range(len(rhs)) if a not in rc and a not in rb]
    loops = [Loop(lhs[a], (a, b), (j,), 0) for j, (a, b) in enumerate(zip(lb, rb))]
    loops += [Loop(lhs[a], (a, None), (len(lb) + j,), 1) for j, a in enumerate(lf)]
    loops += [Loop(rhs[a], (None, a), (len(lb) + len(lf) + j,), 2) for j, a in enumerate(rf)]
    loops += [Loop(lhs[a], (a, b), (None,), 3, summed=True) for a, b in zip(lc, rc)]
    return loops


def conv_loops(op: Operator, shapes) -> list[Loop]:
    """Loops of a convolution: batch (GEMM m), output channels (n), input channels (k, summed;
    ungrouped convolutions only). Spatial loops are not split (halo exchange not modelled)."""
    lhs_spec, rhs_spec, out_spec = _attr(op, "dimension_numbers")
    lhs, rhs = shapes
    loops = [
        Loop(lhs[lhs_spec[0]], (lhs_spec[0], None), (out_spec[0],), 1),
        Loop(rhs[rhs_spec[0]], (None, rhs_spec[0]), (out_spec[1],), 2),
    ]
    if _attr(op, "feature_group_count", 1) == 1 and _attr(op, "batch_group_count", 1) == 1:
        loops.append(Loop(lhs[lhs_spec[1]], (lhs_spec[1], rhs_spec[1]), (None,), 3, True))
    return loops


def reduction_loops(op: Operator, shapes, out_shape) -> list[Loop]:
    """Loops of a reduction: kept axes, and the reduced axes of a sum (partial sums)."""
    axes = _attr(op, "axes", ())
    kept = [a for a in range(len(shapes[0])) if a not in axes]
    loops = [Loop(shapes[0][a], (a,), (j,)) for j, a in enumerate(kept)]
    if op.primitive in _SUM_REDUCTIONS:
        loops += [Loop(shapes[0][a], (a,), (None,), summed=True) for a in axes]
    return loops


def view_axis(src, dst, axis: int, n: int) -> int | None:
    """The axis of ``dst`` (same size as ``src``, a reshape of it) whose contiguous ``n``
    blocks are those of ``src``'s ``axis``, or None."""
    before = math.prod(src[:axis])
    for j in range(len(dst)):
        if math.prod(dst[:j]) == before and dst[j] % n == 0 and src[axis] % n == 0:
            return j
    return None


def layout_loops(op: Operator, shapes, out_shape, n: int) -> list[Loop] | None:
    """Loops of a transpose, broadcast or view-like layout operator; None if not one."""
    if op.primitive == "transpose":
        perm = _attr(op, "permutation")
        return [Loop(out_shape[j], (a,), (j,)) for j, a in enumerate(perm)]
    if op.primitive == "broadcast_in_dim" and shapes:
        dims = _attr(op, "broadcast_dimensions")
        pairs = [(a, d) for a, d in enumerate(dims) if shapes[0][a] == out_shape[d]]
        mapped = {d for _, d in pairs}
        loops = [Loop(out_shape[d], (a,), (d,)) for a, d in pairs]
        return loops + [Loop(s, (None,), (d,)) for d, s in enumerate(out_shape) if d not in mapped]
    if len(shapes) == 1 and math.prod(shapes[0]) == math.prod(out_shape):
        moves = [(a, view_axis(shapes[0], out_shape, a, n)) for a in range(len(shapes[0]))]
        return [Loop(shapes[0][a], (a,), (j,)) for a, j in moves if j is not None]
    return None


def aligned_loops(shapes, out_shape) -> list[Loop]:
    """Loops of an operator whose inputs line up with its output axis by axis (elementwise,
    and layout operators such as slice or concatenate on the axes they leave alone): an input
    of equal size is split with the output, one of size 1 (broadcast) or rank 0 stays ``B``."""
    loops = []
    for d, size in enumerate(out_shape):
        axes = []
        for s in shapes:
            if len(s) == len(out_shape) and s[d] == size:
                axes.append(d)
            elif len(s) == 0 or (len(s) == len(out_shape) and s[d] == 1):
                axes.append(None)
            else:
                break
        else:
            loops.append(Loop(size, tuple(axes), (d,)))
    return loops


def operator_loops(op: Operator, graph: Graph, n: int) -> list[Loop]:
    """The loops of ``op`` that a signature may split (multi-output operators: none)."""
    shapes = [graph.tensors[t].shape for t in op.inputs]
    if len(op.outputs) != 1:
        return []
    out_shape = graph.tensors[op.outputs[0]].shape
    if op.kind == "matmul" or op.kind == "attention":
        return dot_loops(op, shapes) if _attr(op, "dimension_numbers") else []
    if op.kind == "convolution":
        return conv_loops(op, shapes)
    if op.kind == "reduction" and _attr(op, "axes") is not None and len(shapes) == 1:
        return reduction_loops(op, shapes, out_shape)
    if op.kind == "reduction" and _attr(op, "window_dimensions") and len(shapes) == 1:
        window, strides = _attr(op, "window_dimensions"), _attr(op, "window_strides")
        free = [a for a, (w, s) in enumerate(zip(window, strides)) if w == 1 and s == 1]
        return [Loop(out_shape[a], (a,), (a,)) for a in free if shapes[0][a] == out_shape[a]]
    if op.kind == "layout":
        loops = layout_loops(op, shapes, out_shape, n)
        if loops is not None:
            return loops
    if op.kind in ("elementwise", "layout"):
        return aligned_loops(shapes, out_shape)
    return []


def loop_signature(loop: Loop, n: int) -> Signature:
    """The signature that splits ``loop`` over ``n`` devices."""
    ins = tuple(B if a is None else S(a) for a in loop.inputs)
    outs = tuple((P if loop.summed else B) if a is None else S(a) for a in loop.outputs)
    divisor = [1.0] * 4
    if loop.gemm is not None:
        divisor[loop.gemm] = float(n)
    name = " ".join(f"{x.kind}{'' if x.axis is None else x.axis}" for x in ins)
    name += " -> " + " ".join(f"{x.kind}{'' if x.axis is None else x.axis}" for x in outs)
    return Signature(name, ins, outs, tuple(divisor), split=True)


def replicated(n_in: int, n_out: int) -> Signature:
    """Every device computes the whole operator (all ``B``)."""
    return Signature("B", (B,) * n_in, (B,) * n_out)


def operator_signatures(op: Operator, graph: Graph, n: int) -> tuple[Signature, ...]:
    """The valid signatures of ``op`` on ``n`` devices: one per loop whose extent ``n``
    divides, distinct, and the replicated one (last)."""
    sigs: dict[tuple, Signature] = {}
    for loop in operator_loops(op, graph, n):
        indexed = loop.summed or any(a is not None for a in loop.outputs)
        if n > 1 and loop.size % n == 0 and indexed:
            sig = loop_signature(loop, n)
            sigs.setdefault((sig.inputs, sig.outputs), sig)
    return (*sigs.values(), replicated(len(op.inputs), len(op.outputs)))


def tensor_signatures(shape, n: int) -> tuple[Signature, ...]:
    """Stored layouts of a parameter or data input: split along any axis ``n`` divides, or
    replicated."""
    splits = [
        Signature(f"S{a}", (), (S(a),), split=True)
        for a, s in enumerate(shape)
        if n > 1 and s % n == 0
    ]
    return (*splits, Signature("B", (), (B,)))


def trained_inputs(graph: Graph) -> frozenset[int]:
    """Input tensors with a gradient: the graph's inputs matched in order, by shape, to its
    ``gradients``."""
    out, g = set(), list(graph.gradients)
    for t in graph.inputs:
        if g and graph.tensors[t].shape == graph.tensors[g[0]].shape:
            out.add(t)
            g.pop(0)
    return frozenset(out)


def _floating(dtype: str) -> bool:
    return np.issubdtype(np.dtype(dtype), np.inexact) or dtype.startswith("float")


def sbp_problem(graph: Graph, mesh_size: int) -> SbpProblem:
    """The SBP problem of ``graph``'s forward operators on a 1-D mesh of ``mesh_size``
    devices: a node per forward operator and per input tensor they read, a use per
    (tensor, consumer input)."""
    n = int(mesh_size)
    if n < 1:
        raise ValueError(f"sbp_problem: mesh_size {mesh_size}; must be >= 1")
    trained = trained_inputs(graph)
    nodes: list[Node] = []
    node_of: dict[int, tuple[int, int]] = {}  # tensor -> (node, output slot)
    grad = set(trained)
    used = {t for op in graph.select("forward") for t in op.inputs}
    for t in graph.inputs:
        if t in used:
            node_of[t] = (len(nodes), 0)
            sigs = tensor_signatures(graph.tensors[t].shape, n)
            nodes.append(Node(f"input {t}", -1, t, t in trained, sigs))
    uses = []
    for i, op in enumerate(graph.operators):
        if op.phase != "forward":
            continue
        me = len(nodes)
        for j, t in enumerate(op.inputs):
            if t in node_of:
                producer, slot = node_of[t]
                uses.append(Use(producer, slot, me, j, t, t in grad))
        if any(t in grad for t in op.inputs):  # gradients flow through floating outputs only
            grad.update(t for t in op.outputs if _floating(graph.tensors[t].dtype))
        for k, t in enumerate(op.outputs):
            node_of[t] = (me, k)
        nodes.append(Node(f"{i} {op.primitive}", i, -1, False, operator_signatures(op, graph, n)))
    return SbpProblem(graph, n, tuple(nodes), tuple(uses))


def relayout_kind(src: Sbp, dst: Sbp) -> int:
    """Index in ``RELAYOUTS`` of the collective that turns layout ``src`` into ``dst``."""
    if src == dst or src.kind == "B" or dst.kind == "P":
        return 0  # same, or a local slice / zero fill
    if dst.kind == "B":
        return 1 if src.kind == "S" else 2
    return 3 if src.kind == "P" else 4  # into S(j): reduce-scatter, or all-to-all from S(i)


def gradient_in(sig: Signature, slot: int) -> Sbp:
    """Layout of the gradient a consumer under ``sig`` hands back for input ``slot``."""
    x = sig.inputs[slot]
    if x.kind == "S":
        return x
    return B if x.kind == "P" or not sig.split else P


def gradient_out(sig: Signature, slot: int) -> Sbp:
    """Layout in which a producer under ``sig`` needs the gradient of output ``slot``."""
    x = sig.outputs[slot]
    return x if x.kind == "S" else B


def relayout_codes(problem: SbpProblem) -> tuple[np.ndarray, np.ndarray]:
    """``[n_uses, K, K]`` forward and backward ``RELAYOUTS`` indices per (producer signature,
    consumer signature) pair (0 where either does not exist or no gradient flows)."""
    k = problem.max_signatures
    fwd = np.zeros((len(problem.uses), k, k), dtype=np.int64)
    bwd = np.zeros_like(fwd)
    for e, u in enumerate(problem.uses):
        producer, consumer = problem.nodes[u.producer], problem.nodes[u.consumer]
        for a, ps in enumerate(producer.signatures):
            for b, cs in enumerate(consumer.signatures):
                fwd[e, a, b] = relayout_kind(ps.outputs[u.slot_out], cs.inputs[u.slot_in])
                if u.grad:
                    g = relayout_kind(gradient_in(cs, u.slot_in), gradient_out(ps, u.slot_out))
                    bwd[e, a, b] = g
    return fwd, bwd


def _shard_fraction(sig: Signature, tensors, n: int) -> float:
    """Share of an operator's tensor bytes one device touches under ``sig``."""
    layouts = (*sig.inputs, *sig.outputs)
    total = sum(t.bytes for t in tensors) or 1.0
    return sum(t.bytes / (n if x.kind == "S" else 1.0) for t, x in zip(tensors, layouts)) / total


def candidate_arrays(
    problem: SbpProblem, base: GraphArrays, dtype=None, shares=None
) -> GraphArrays:
    """``GraphArrays`` with one row per (operator node, signature), ``[n_nodes * K]``; stored
    tensors' rows are empty. ``shares(signature, tensors)`` gives a signature's GEMM divisors
    and the share of the operator's tensor bytes one device touches (default: the 1-D
    signature's on ``mesh_size`` devices)."""
    g, n, k = problem.graph, problem.mesh_size, problem.max_signatures
    if shares is None:
        shares = lambda sig, tensors: (sig.gemm_divisor, _shard_fraction(sig, tensors, n))  # noqa: E731
    rows = len(problem.nodes) * k
    gemm, hbm = np.zeros((rows, 4)), np.zeros(rows)
    pick = np.zeros(rows, dtype=np.int64)
    present = np.zeros(rows)
    factor = np.zeros(rows)
    base_gemm, base_hbm = np.asarray(base.gemm), np.asarray(base.hbm_bytes)
    for i, node in enumerate(problem.nodes):
        if node.op < 0:
            continue
        op = g.operators[node.op]
        tensors = [g.tensors[t] for t in (*op.inputs, *op.outputs)]
        for s, sig in enumerate(node.signatures):
            r = i * k + s
            pick[r], present[r] = node.op, 1.0
            divisor, share = shares(sig, tensors)
            gemm[r] = base_gemm[node.op] / np.asarray(divisor)
            hbm[r] = base_hbm[node.op] * share
            factor[r] = 1.0 + BACKWARD_FACTOR.get(op.kind, 1.0)
    f = lambda a: jnp.asarray(a, dtype=dtype or base.gemm.dtype)  # noqa: E731
    return GraphArrays(
        gemm=f(gemm),
        is_gemm=base.is_gemm[pick],
        is_conv=base.is_conv[pick],
        hbm_bytes=f(hbm),
        launches=base.launches[pick] * f(present),
        count=base.count[pick] * f(factor),  # forward plus backward executions
        precision=base.precision[pick],
        backward=jnp.zeros(rows, dtype=base.gemm.dtype),
    )


@struct.dataclass
class SbpCosts:
    """Seconds of every choice: ``node_s[i, s]`` (compute, optimizer update) and
    ``edge_s[e, a, b]`` (forward and backward re-layout of use ``e``)."""

    node_s: jnp.ndarray
    edge_s: jnp.ndarray


@struct.dataclass
class SbpParts:
    """``SbpCosts`` by part: per node and signature ``[n_nodes, K]`` the compute (forward plus
    backward), the optimizer update of a stored tensor and the reduce-scatter that completes a
    partial graph output; per use and signature pair ``[n_uses, K, K]`` the forward re-layout
    and the backward one (of the gradient)."""

    compute_s: jnp.ndarray
    optimizer_s: jnp.ndarray
    finish_s: jnp.ndarray
    forward_s: jnp.ndarray
    backward_s: jnp.ndarray

    def costs(self) -> SbpCosts:
        """The search's pairwise costs: the parts summed."""
        node = self.compute_s + self.optimizer_s + self.finish_s
        return SbpCosts(node_s=node, edge_s=self.forward_s + self.backward_s)


def _unfinished_bytes(problem: SbpProblem) -> np.ndarray:
    """Bytes of graph outputs a node's signature leaves as partial sums ``[n_nodes, K]``: the
    step's results must be complete, so these are reduce-scattered."""
    outputs = set(problem.graph.outputs)
    out = np.zeros((len(problem.nodes), problem.max_signatures))
    for i, node in enumerate(problem.nodes):
        if node.op < 0:
            continue
        op = problem.graph.operators[node.op]
        for s, sig in enumerate(node.signatures):
            for t, x in zip(op.outputs, sig.outputs):
                if t in outputs and x.kind == "P":
                    out[i, s] += problem.graph.tensors[t].bytes
    return out


def _stored_elements(problem: SbpProblem) -> np.ndarray:
    """Elements of every trained stored shard (the optimizer updates) per signature
    ``[n_nodes, K]``."""
    k = problem.max_signatures
    out = np.zeros((len(problem.nodes), k))
    for i, node in enumerate(problem.nodes):
        if node.op < 0 and node.trained:
            size = problem.graph.tensors[node.tensor].size
            for s, sig in enumerate(node.signatures):
                out[i, s] = size / (problem.mesh_size if sig.split else 1)
    return out


def sbp_costs(
    problem: SbpProblem,
    cluster: ClusterArrays,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
) -> SbpCosts:
    """The costs of ``problem`` on ``cluster`` (the mesh: ``mesh_size`` consecutive GPUs).

    Differentiable w.r.t. ``cluster`` and ``params`` (the structure is static numpy)."""
    return sbp_parts(problem, cluster, params, temperature).costs()


def sbp_parts(
    problem: SbpProblem,
    cluster: ClusterArrays,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
) -> SbpParts:
    """``sbp_costs`` by part (compute, optimizer, completion, forward and backward
    re-layouts), for reports and step times."""
    fwd, bwd = relayout_codes(problem)
    size = np.asarray([problem.graph.tensors[u.tensor].bytes for u in problem.uses], float)
    return _price(
        candidate_arrays(problem, graph_arrays(problem.graph)),
        jnp.asarray(_stored_elements(problem)),
        jnp.asarray(_unfinished_bytes(problem)),
        jnp.asarray(size.reshape(-1)),
        jnp.asarray(fwd),
        jnp.asarray(bwd),
        cluster,
        params,
        float(problem.mesh_size),
        len(problem.nodes),
        temperature,
    )


@partial(jax.jit, static_argnums=(8, 9, 10))
def _price(cand, stored, partial_out, size, fwd, bwd, cluster, params, n, n_nodes, temperature):
    compute = op_times_s(cand, cluster, params, temperature).reshape(n_nodes, -1)
    stored = stored * params.optimizer_bytes_per_param
    optimizer = jnp.where(stored > 0, memory_bound_s(stored, cluster, params), 0.0)
    group = comm.place(n, 1.0, cluster.gpus_per_node)
    args = (group, cluster, params, temperature)
    finish = jnp.where(partial_out > 0, comm.reduce_scatter_s(partial_out, *args), 0.0)
    table = jnp.stack(
        [
            jnp.zeros_like(size),
            comm.all_gather_s(size, *args),
            comm.all_reduce_s(size, *args),
            comm.reduce_scatter_s(size, *args),
            comm.all_to_all_s(size / n, *args),
        ]
    )  # [RELAYOUTS, n_uses]
    rows = jnp.arange(size.shape[0])[:, None, None]
    return SbpParts(
        compute_s=compute,
        optimizer_s=optimizer,
        finish_s=finish,
        forward_s=table[fwd, rows],
        backward_s=table[bwd, rows],
    )
