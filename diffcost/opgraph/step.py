"""The training-step time of a graph model under an SBP assignment, by part, and the plans
``diffcost predict`` prices without a search.

A plan of a graph on a 1-D mesh is one signature per node of its ``sbp.SbpProblem``
(``choice``). Its step (``step_time``) is composed by ``compose_step``, the one overlap model
of graph steps (``opgraph.data_parallel`` is its special case with no re-layouts):

``T = forward + relayout + overlap(backward + backward relayouts, grad_sync) + optimizer +
overhead``

* ``forward_s``, ``backward_s``: every operator's roofline under its signature
  (``sbp.SbpParts.compute_s``, split by ``sbp.BACKWARD_FACTOR``);
* ``relayout_s``: the forward and backward re-layouts of activations (and the all-gathers of
  sharded parameters, FSDP), and the reduce-scatters that complete partial graph outputs; they
  block the pass they are in;
* ``grad_sync_s``: the backward re-layouts into trained stored tensors (the all-reduce of a
  replicated weight's gradient, data parallel; the reduce-scatter of a sharded one's, FSDP),
  bucketed as DDP, Horovod and FSDP do: one collective of the summed bytes per kind, each
  tensor's gradient once (its uses' gradients are summed on the device first);
* ``overlap``: the buckets are reduced while the backward runs; the two streams take the longer
  of the two, each slowed by ``Params.interference`` over the time they share (as the
  transformer core's overlapped communication); ``exposed_grad_sync_s`` is what the backward
  does not hide;
* ``optimizer_s``: the update of every trained stored shard (``Params.optimizer_bytes_per_param``
  per element);
* ``overhead_s``: the core's per-microbatch and per-iteration host steps.

The search (``sbp_search``) minimizes the serial pairwise cost (``SbpParts.costs``: every
gradient re-layout priced on its own, nothing overlapped, no host steps), a proxy of this
step time; the command line reports the step time of the plan it finds.

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

from diffcost import comm, smooth
from diffcost.arrays import ClusterArrays
from diffcost.opgraph.ir import Sbp
from diffcost.opgraph.sbp import (
    BACKWARD_FACTOR,
    RELAYOUTS,
    SbpParts,
    SbpProblem,
    gradient_in,
    gradient_out,
    relayout_kind,
)
from diffcost.params import Params

PARTS = ("compute_s", "relayout_s", "exposed_grad_sync_s", "optimizer_s", "overhead_s")


@struct.dataclass
class StepTime:
    """Seconds per training step on each device of the mesh, by part (``PARTS`` add up to
    ``iteration_s``; ``grad_sync_s`` is the whole gradient sync, most of it hidden)."""

    iteration_s: jnp.ndarray
    forward_s: jnp.ndarray
    backward_s: jnp.ndarray
    relayout_s: jnp.ndarray
    grad_sync_s: jnp.ndarray
    exposed_grad_sync_s: jnp.ndarray
    optimizer_s: jnp.ndarray
    overhead_s: jnp.ndarray

    # every part but the time (``population.median_breakdown`` scales them with it)
    TIME_PARTS = (
        "forward_s",
        "backward_s",
        "relayout_s",
        "grad_sync_s",
        "exposed_grad_sync_s",
        "optimizer_s",
        "overhead_s",
    )

    @property
    def compute_s(self):
        return self.forward_s + self.backward_s


def compose_step(
    forward_s,
    backward_s,
    relayout_s,
    backward_relayout_s,
    grad_sync_s,
    optimizer_s,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
) -> StepTime:
    """A graph step from its parts: the gradient sync overlapped with the backward.

    ``T = forward + relayout + overlap(backward + backward_relayout, grad_sync) + optimizer +
    overhead``, where ``relayout_s`` includes ``backward_relayout_s`` (the re-layouts that block
    the backward) and ``overlap(a, b) = smax(a + kappa smin(a, b), b + kappa smin(a, b))``:
    the longer stream, each slowed by ``Params.interference`` (``kappa``) over the time they
    share. ``overhead`` is ``microbatch_overhead_s + iteration_overhead_s``.

    Args:
        forward_s, backward_s: compute of the two passes (seconds).
        relayout_s: every re-layout that is not a gradient sync; ``backward_relayout_s``: the
            part of it in the backward pass.
        grad_sync_s: the (bucketed) gradient sync; optimizer_s: the update.
        params: calibrated constants; temperature: softness of the smooth min and max.
    """
    busy = backward_s + backward_relayout_s
    kappa = params.interference
    both = smooth.smin2(busy, grad_sync_s, temperature)
    overlapped = smooth.smax2(busy + kappa * both, grad_sync_s + kappa * both, temperature)
    exposed = overlapped - busy
    overhead = params.microbatch_overhead_s + params.iteration_overhead_s
    return StepTime(
        iteration_s=forward_s + backward_s + relayout_s + exposed + optimizer_s + overhead,
        forward_s=forward_s,
        backward_s=backward_s,
        relayout_s=relayout_s,
        grad_sync_s=grad_sync_s,
        exposed_grad_sync_s=exposed,
        optimizer_s=optimizer_s,
        overhead_s=overhead,
    )


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


def sync_buckets(problem: SbpProblem, choice) -> np.ndarray:
    """Bytes of the gradient sync of ``choice`` per collective (``[len(RELAYOUTS)]``): every
    gradient re-layout into a trained stored tensor, each (tensor, collective) once."""
    sync = _into_weights(problem)
    seen, out = set(), np.zeros(len(RELAYOUTS))
    for e, u in enumerate(problem.uses):
        if not (u.grad and sync[e]):
            continue
        consumer = problem.nodes[u.consumer].signatures[choice[u.consumer]]
        producer = problem.nodes[u.producer].signatures[choice[u.producer]]
        kind = relayout_kind(gradient_in(consumer, u.slot_in), gradient_out(producer, u.slot_out))
        if kind and (u.producer, u.slot_out, kind) not in seen:
            seen.add((u.producer, u.slot_out, kind))
            out[kind] += problem.graph.tensors[u.tensor].bytes
    return out


def bucketed_sync_s(buckets, mesh_size, cluster: ClusterArrays, params: Params, temperature):
    """Seconds of one collective per bucket of ``sync_buckets`` over the whole mesh (an empty
    bucket costs exactly 0)."""
    b = jnp.asarray(buckets, dtype=jnp.result_type(float))
    safe = jnp.where(b > 0, b, 1.0)
    args = (comm.place(float(mesh_size), 1.0, cluster.gpus_per_node), cluster, params, temperature)
    times = jnp.stack(
        [
            jnp.zeros(()),
            comm.all_gather_s(safe[1], *args),
            comm.all_reduce_s(safe[2], *args),
            comm.reduce_scatter_s(safe[3], *args),
            comm.all_to_all_s(safe[4] / mesh_size, *args),
        ]
    )
    return jnp.sum(jnp.where(b > 0, times, 0.0))


def step_time(
    problem: SbpProblem,
    parts: SbpParts,
    choice,
    cluster: ClusterArrays,
    params: Params,
    temperature=smooth.DEFAULT_TEMPERATURE,
) -> StepTime:
    """The step time of the assignment ``choice`` (one signature index per node), by part
    (module docstring); differentiable through ``parts`` (``sbp.sbp_parts``, priced on the same
    ``cluster`` and ``params``), ``cluster`` and ``params``."""
    c = np.asarray(choice, dtype=np.int64)
    if c.shape != (len(problem.nodes),):
        raise ValueError(f"step_time: {c.shape[0]} choices for {len(problem.nodes)} nodes")
    rows = np.arange(len(c))
    edges = problem.edges()
    e = np.arange(len(edges))
    fwd = parts.forward_s[e, c[edges[:, 0]], c[edges[:, 1]]]
    bwd = parts.backward_s[e, c[edges[:, 0]], c[edges[:, 1]]]
    blocking = jnp.asarray(1.0 - _into_weights(problem))
    compute = parts.compute_s[rows, c]
    share = jnp.asarray(_forward_share(problem))
    backward_relayout = jnp.sum(bwd * blocking)
    buckets = sync_buckets(problem, c)
    sync = bucketed_sync_s(buckets, problem.mesh_size, cluster, params, temperature)
    return compose_step(
        forward_s=jnp.sum(compute * share),
        backward_s=jnp.sum(compute * (1.0 - share)),
        relayout_s=jnp.sum(fwd) + backward_relayout + jnp.sum(parts.finish_s[rows, c]),
        backward_relayout_s=backward_relayout,
        grad_sync_s=sync,
        optimizer_s=jnp.sum(parts.optimizer_s[rows, c]),
        params=params,
        temperature=temperature,
    )


def _forward_share(problem: SbpProblem) -> np.ndarray:
    """Per node: the forward's share of its compute, ``1 / (1 + BACKWARD_FACTOR)``."""
    kinds = [problem.graph.operators[n.op].kind if n.op >= 0 else "" for n in problem.nodes]
    return np.asarray([1.0 / (1.0 + BACKWARD_FACTOR.get(k, 1.0)) for k in kinds]).reshape(-1)


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


def step_events(problem: SbpProblem, parts: SbpParts, choice, cluster, params, names=None):
    """``(track, name, start_s, dur_s)`` of one step as ``step_time`` composes it: forward
    re-layouts and operators in order; the backward in reverse (its re-layouts on ``comm``)
    while the bucketed gradient sync runs on ``grad sync`` from the backward's start; what the
    backward does not hide (``exposed gradient sync``); the optimizer; the host steps. Every
    slice but the gradient sync's is on the critical path: they add up to ``iteration_s``.
    ``names`` maps stored tensor ids to labels."""
    names = names or {}
    c = np.asarray(choice, dtype=np.int64)
    f = lambda x: float(np.asarray(x))  # noqa: E731
    st = step_time(problem, parts, c, cluster, params)
    incoming: list[list[int]] = [[] for _ in problem.nodes]
    for e, u in enumerate(problem.uses):
        incoming[u.consumer].append(e)
    sync = _into_weights(problem)
    share = _forward_share(problem)
    events, t = [], 0.0

    def add(track, name, dur):
        nonlocal t
        if dur > 0:
            events.append((f"step/{track}", name, t, dur))
            t += dur

    def signature(i):
        return problem.nodes[i].signatures[c[i]].name

    def compute(i, backward):
        total = f(parts.compute_s[i, c[i]])
        return total * ((1.0 - share[i]) if backward else share[i])

    for i in range(len(problem.nodes)):
        for e in incoming[i]:
            u = problem.uses[e]
            dur = f(parts.forward_s[e, c[u.producer], c[i]])
            add("comm", f"re-layout {_label(problem, u.producer, names)} -> {signature(i)}", dur)
        add("compute", f"{_label(problem, i, names)} [{signature(i)}]", compute(i, False))
        add("comm", f"complete {_label(problem, i, names)}", f(parts.finish_s[i, c[i]]))
    if f(st.grad_sync_s) > 0:
        buckets = sync_buckets(problem, c)
        what = ", ".join(f"{RELAYOUTS[k]} {b / 1e6:.3g} MB" for k, b in enumerate(buckets) if b)
        events.append(("step/grad sync", f"gradient sync ({what})", t, f(st.grad_sync_s)))
    for i in reversed(range(len(problem.nodes))):
        add("compute", f"grad {_label(problem, i, names)}", compute(i, True))
        for e in incoming[i]:
            u = problem.uses[e]
            if not sync[e]:
                dur = f(parts.backward_s[e, c[u.producer], c[i]])
                add("comm", f"gradient of {_label(problem, u.producer, names)}", dur)
    add("comm", "exposed gradient sync", f(st.exposed_grad_sync_s))
    for i in range(len(problem.nodes)):
        add("optimizer", f"update {_label(problem, i, names)}", f(parts.optimizer_s[i, c[i]]))
    add("host", "microbatch and iteration host steps", f(st.overhead_s))
    return events
