"""The training-step time of a graph model under an SBP assignment, by part, and the plans
``diffcost predict`` prices without a search.

A plan of a graph on a 1-D mesh is one signature per node of its ``sbp.SbpProblem``
(``choice``). Its step time is the sum (no overlap) of four parts, each from ``sbp.SbpParts``:

* ``compute_s``: every operator's forward and backward roofline under its signature;
* ``relayout_s``: the forward and backward re-layouts of activations (and the all-gathers of
  sharded parameters, FSDP), and the reduce-scatters that complete partial graph outputs;
* ``grad_sync_s``: the backward re-layouts into trained stored tensors: the all-reduce of a
  replicated weight's gradient (data parallel), the reduce-scatter of a sharded one's;
* ``optimizer_s``: the update of every trained stored shard.

Plans without a search:

* ``data_parallel_choice``: the batch inputs split along their leading axis, everything else
  stored replicated, and each operator, in order, the signature whose input layouts match what
  its producers hand it (the fewest bytes through collectives; then no new split but the
  batch's; then, for an operator computed from the batch, a split signature; then the fewest
  inputs re-laid out), so a product of a
  batch-split activation and a replicated weight is batch-split and the weight's gradient is
  all-reduced, and an operator that cannot be split (a gather) is replicated and the next one
  splits again;
* ``replicated_choice``: every device computes everything (the one-GPU step);
* ``choice_from_layouts``: a plan saved as ``{node name: signature name}`` (``layouts``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost.opgraph.ir import Sbp
from diffcost.opgraph.sbp import BACKWARD_FACTOR, SbpParts, SbpProblem, relayout_kind

PARTS = ("compute_s", "relayout_s", "grad_sync_s", "optimizer_s")


@struct.dataclass
class StepTime:
    """Seconds per training step on each device of the mesh, by part (their sum is
    ``iteration_s``)."""

    compute_s: jnp.ndarray
    relayout_s: jnp.ndarray
    grad_sync_s: jnp.ndarray
    optimizer_s: jnp.ndarray

    @property
    def iteration_s(self):
        return self.compute_s + self.relayout_s + self.grad_sync_s + self.optimizer_s


def _into_weights(problem: SbpProblem) -> np.ndarray:
    """Per use: 1 when it reads a trained stored tensor or a value computed from trained
    stored tensors alone (a reshaped bias): its backward re-layout is the gradient sync."""
    weight = [node.op < 0 and node.trained for node in problem.nodes]
    feeds: list[list[int]] = [[] for _ in problem.nodes]
    read: list[set[int]] = [set() for _ in problem.nodes]
    for u in problem.uses:
        feeds[u.consumer].append(u.producer)
        read[u.consumer].add(u.tensor)
    for i, node in enumerate(problem.nodes):  # nodes are in topological order
        if node.op >= 0 and feeds[i]:
            inputs = set(problem.graph.operators[node.op].inputs)
            weight[i] = all(weight[p] for p in feeds[i]) and read[i] == inputs
    return np.asarray([float(weight[u.producer]) for u in problem.uses]).reshape(-1)


def step_time(problem: SbpProblem, parts: SbpParts, choice) -> StepTime:
    """The step time of the assignment ``choice`` (one signature index per node), by part;
    differentiable through ``parts`` (``sbp.sbp_parts``)."""
    c = np.asarray(choice, dtype=np.int64)
    if c.shape != (len(problem.nodes),):
        raise ValueError(f"step_time: {c.shape[0]} choices for {len(problem.nodes)} nodes")
    rows = np.arange(len(c))
    edges = problem.edges()
    e = np.arange(len(edges))
    fwd = parts.forward_s[e, c[edges[:, 0]], c[edges[:, 1]]]
    bwd = parts.backward_s[e, c[edges[:, 0]], c[edges[:, 1]]]
    sync = jnp.asarray(_into_weights(problem))
    return StepTime(
        compute_s=jnp.sum(parts.compute_s[rows, c]),
        relayout_s=jnp.sum(fwd) + jnp.sum(bwd * (1.0 - sync)) + jnp.sum(parts.finish_s[rows, c]),
        grad_sync_s=jnp.sum(bwd * sync),
        optimizer_s=jnp.sum(parts.optimizer_s[rows, c]),
    )


def replicated_choice(problem: SbpProblem) -> tuple[int, ...]:
    """Every node replicated (the last signature of each)."""
    return tuple(len(n.signatures) - 1 for n in problem.nodes)


def _stored_index(node, want: Sbp) -> int:
    for s, sig in enumerate(node.signatures):
        if sig.outputs[0] == want:
            return s
    return len(node.signatures) - 1


def data_parallel_choice(problem: SbpProblem, batch_inputs) -> tuple[int, ...]:
    """Data parallelism: ``batch_inputs`` (tensor ids) split along axis 0, other stored
    tensors replicated, operators following their inputs (module docstring).

    Raises:
        ValueError: a batch input whose leading dimension the mesh size does not divide.
    """
    g, n = problem.graph, problem.mesh_size
    layout: dict[int, Sbp] = {}
    batch_axis: dict[int, int] = {}  # tensor -> its axis that carries the batch
    choice = []
    for node in problem.nodes:
        if node.op < 0:
            want = Sbp("S", 0) if node.tensor in batch_inputs and n > 1 else Sbp("B")
            s = _stored_index(node, want)
            if node.signatures[s].outputs[0] != want:
                size = g.tensors[node.tensor].shape[0]
                raise ValueError(
                    f"data parallel: batch {size} is not divisible by the mesh size {n}; "
                    f"give a batch that is a multiple of {n}"
                )
            layout[node.tensor] = want
            if node.tensor in batch_inputs:
                batch_axis[node.tensor] = 0
            choice.append(s)
            continue
        op = g.operators[node.op]
        sig = node.signatures[_follow(op, node.signatures, layout, batch_axis, g)]
        layout.update(zip(op.outputs, sig.outputs))
        batch_axis.update(_batch_axes(op, sig, batch_axis, g))
        choice.append(node.signatures.index(sig))
    return tuple(choice)


def _batch_axes(op, sig, batch_axis, graph) -> dict[int, int]:
    """The batch axis of each output of ``op`` under ``sig``: the axis it is split along when
    an input of the batch is split, else (replicated) axis 0 when its leading dimension is an
    input's batch dimension."""
    sizes = {graph.tensors[t].shape[a] for t, a in batch_axis.items() if t in op.inputs}
    split_batch = any(
        x.kind == "S" and batch_axis.get(t) == x.axis for t, x in zip(op.inputs, sig.inputs)
    )
    out = {}
    for t, x in zip(op.outputs, sig.outputs):
        shape = graph.tensors[t].shape
        if split_batch and x.kind == "S":
            out[t] = x.axis
        elif not split_batch and shape and shape[0] in sizes:
            out[t] = 0
    return out


def _follow(op, signatures, layout, batch_axis, graph) -> int:
    """The signature of ``op`` that moves the fewest bytes through collectives given its
    inputs' layouts; then one that splits no input anew (an input wanted as ``S(i)`` already is,
    or carries the batch on axis ``i``: data parallelism splits the batch only); then, for an
    operator of the batch, a split one; then the fewest inputs re-laid out (a local slice
    included); then the first."""
    have = [layout.get(t, Sbp("B")) for t in op.inputs]
    of_batch = any(t in batch_axis for t in op.inputs)

    def fresh(t, h, w):
        return w.kind == "S" and h != w and batch_axis.get(t) != w.axis

    def key(j):
        sig = signatures[j]
        pairs = list(zip(op.inputs, have, sig.inputs))
        moved = sum(graph.tensors[t].bytes for t, h, w in pairs if relayout_kind(h, w) != 0)
        new_split = any(fresh(t, h, w) for t, h, w in pairs)
        changed = sum(h != w for _, h, w in pairs)
        return (moved, new_split, of_batch and not sig.split, changed, j)

    return min(range(len(signatures)), key=key)


def layouts(problem: SbpProblem, choice) -> dict[str, str]:
    """``{node name: signature name}`` of an assignment (what ``choice_from_layouts`` reads)."""
    return {n.name: n.signatures[s].name for n, s in zip(problem.nodes, choice)}


def choice_from_layouts(problem: SbpProblem, plan: dict[str, str], source: str = "plan"):
    """The assignment a ``layouts`` dict names.

    Raises:
        ValueError: a node missing from ``plan``, an unknown node, or a signature the node
            does not have on this mesh (naming ``source``, the node and the valid ones).
    """
    names = {n.name for n in problem.nodes}
    unknown = sorted(set(plan) - names)
    if unknown:
        raise ValueError(f"{source}: nodes {unknown[:5]} are not in this graph")
    choice = []
    for node in problem.nodes:
        if node.name not in plan:
            raise ValueError(f"{source}: no layout for node {node.name!r}")
        valid = [sig.name for sig in node.signatures]
        if plan[node.name] not in valid:
            raise ValueError(
                f"{source}: node {node.name!r} has layout {plan[node.name]!r}; valid on a "
                f"mesh of {problem.mesh_size}: {valid}"
            )
        choice.append(valid.index(plan[node.name]))
    return tuple(choice)


def _label(problem: SbpProblem, i: int, names) -> str:
    node = problem.nodes[i]
    if node.op < 0:
        return names.get(node.tensor, node.name)
    op = problem.graph.operators[node.op]
    return f"{op.scope}/{op.primitive}" if op.scope else f"{node.op} {op.primitive}"


def step_events(problem: SbpProblem, parts: SbpParts, choice, names=None):
    """``(track, name, start_s, dur_s)`` of one step, one operation after another as the step
    time adds them: forward re-layouts and operators in order, then the backward in reverse
    (gradient re-layouts on ``comm``, into stored tensors on ``grad sync``), then the optimizer.
    ``names`` maps stored tensor ids to labels."""
    names = names or {}
    c = np.asarray(choice, dtype=np.int64)
    f = lambda x: float(np.asarray(x))  # noqa: E731
    incoming: list[list[int]] = [[] for _ in problem.nodes]
    for e, u in enumerate(problem.uses):
        incoming[u.consumer].append(e)
    sync = _into_weights(problem)
    events, t = [], 0.0

    def add(track, name, dur):
        nonlocal t
        if dur > 0:
            events.append((f"step/{track}", name, t, dur))
            t += dur

    def signature(i):
        return problem.nodes[i].signatures[c[i]].name

    def compute_share(i, backward):
        node = problem.nodes[i]
        if node.op < 0:
            return 0.0
        factor = BACKWARD_FACTOR.get(problem.graph.operators[node.op].kind, 1.0)
        total = f(parts.compute_s[i, c[i]])
        return total * (factor if backward else 1.0) / (1.0 + factor)

    for i in range(len(problem.nodes)):
        for e in incoming[i]:
            u = problem.uses[e]
            dur = f(parts.forward_s[e, c[u.producer], c[i]])
            add("comm", f"re-layout {_label(problem, u.producer, names)} -> {signature(i)}", dur)
        add("compute", f"{_label(problem, i, names)} [{signature(i)}]", compute_share(i, False))
        add("comm", f"complete {_label(problem, i, names)}", f(parts.finish_s[i, c[i]]))
    for i in reversed(range(len(problem.nodes))):
        add("compute", f"grad {_label(problem, i, names)}", compute_share(i, True))
        for e in incoming[i]:
            u = problem.uses[e]
            dur = f(parts.backward_s[e, c[u.producer], c[i]])
            track = "grad sync" if sync[e] else "comm"
            add(track, f"gradient of {_label(problem, u.producer, names)}", dur)
    for i in range(len(problem.nodes)):
        add("optimizer", f"update {_label(problem, i, names)}", f(parts.optimizer_s[i, c[i]]))
    return events
