"""The operator graph: operators with shapes, FLOPs and bytes, joined by tensor edges.

A ``Graph`` is the general workload of a training step: the operators of the forward pass and of
the backward pass that ``jax.vjp`` implies, each with its FLOPs (XLA's ``HloCostAnalysis``
convention: 2 per multiply-add, 1 per elementwise or reduction step, transcendentals apart), the
bytes it reads and writes, and for matrix products (and convolutions as implicit GEMMs) the GEMM
shape ``(batch, m, n, k)``. Tensors are the edges: each has one producer (an operator, or none
for an argument of the traced function) and any number of consumers. ``saved`` lists the
tensors the forward pass keeps for the backward pass (JAX's residuals).

Operators carry the static attributes sharding needs later (``attributes``: dot dimension
numbers, convolution dimension numbers, reduced axes), and an optional ``OperatorSharding``:
one SBP signature (``Sbp``: split along an axis, broadcast, partial sum) per input and output
tensor on each axis of a 1- or 2-D device mesh (OneFlow's SBP; AutoDDL). A graph traced from a
single-device function has no sharding; collectives appear as operators of kind
``"collective"`` when the traced function contains them (``shard_map``).

Everything here is static (plain Python and numpy); ``diffcost.opgraph.pricing`` turns a graph
into arrays for the differentiable cost.

References:
    OneFlow's SBP signatures (Yuan et al., "OneFlow", 2021); AutoDDL (Chen et al., TPDS 2024);
    XLA ``HloCostAnalysis`` (openxla/xla, ``xla/service/hlo_cost_analysis.cc``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Literal

import numpy as np

OP_KINDS = (
    "matmul",  # dot_general
    "convolution",
    "attention",  # the matrix products of a dot-product attention core
    "elementwise",
    "reduction",
    "gather",  # gathers, embedding lookups (bags: gather + reduction), scatters
    "layout",  # reshape, broadcast, transpose, slice, pad, concatenate: no arithmetic
    "collective",
)
GEMM_KINDS = ("matmul", "convolution", "attention")
PHASES = ("forward", "backward")
Phase = Literal["forward", "backward"]


@dataclasses.dataclass(frozen=True)
class Sbp:
    """The layout of one tensor along one mesh axis: ``"S"`` split along tensor ``axis``,
    ``"B"`` broadcast (replicated), ``"P"`` partial sums (each device holds an addend)."""

    kind: Literal["S", "B", "P"]
    axis: int | None = None

    def __post_init__(self):
        if self.kind not in ("S", "B", "P"):
            raise ValueError(f"Sbp.kind: {self.kind!r}; valid: 'S', 'B', 'P'")
        if (self.kind == "S") != (self.axis is not None):
            raise ValueError(f"Sbp: a split needs a tensor axis and only a split has one: {self}")


@dataclasses.dataclass(frozen=True)
class OperatorSharding:
    """One SBP signature per mesh axis for every input and output of an operator.

    ``inputs[i][a]`` is the layout of input ``i`` along mesh axis ``a`` (likewise ``outputs``);
    ``mesh_shape`` has one or two entries.
    """

    mesh_shape: tuple[int, ...]
    inputs: tuple[tuple[Sbp, ...], ...]
    outputs: tuple[tuple[Sbp, ...], ...]


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One array of the step. ``producer`` is an operator index, or -1 for an argument of the
    traced function (or a constant it closes over)."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    producer: int = -1

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Operator:
    """One operation of the step, executed ``count`` times (a loop body's trip count).

    ``flops``, ``transcendentals``, ``bytes_read`` and ``bytes_written`` are per execution.
    ``gemm`` is ``(batch, m, n, k)`` for the kinds in ``GEMM_KINDS`` (a convolution as the
    implicit GEMM whose ``2 batch m n k`` equals its FLOPs), else None. ``scope`` is the
    path of named calls (flax modules, jitted functions) that contains it.
    """

    name: str
    primitive: str
    kind: str
    phase: Phase
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    dtype: str
    flops: float
    transcendentals: float
    bytes_read: float
    bytes_written: float
    count: float = 1.0
    gemm: tuple[int, int, int, int] | None = None
    scope: str = ""
    attributes: tuple[tuple[str, object], ...] = ()
    sharding: OperatorSharding | None = None

    def __post_init__(self):
        if self.kind not in OP_KINDS:
            raise ValueError(f"Operator {self.name}: kind {self.kind!r}; valid: {OP_KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"Operator {self.name}: phase {self.phase!r}; valid: {PHASES}")


@dataclasses.dataclass(frozen=True)
class Graph:
    """Operators and tensors of one training step (or of a forward pass alone).

    ``inputs`` are the traced function's arguments (flattened), ``outputs`` its results,
    ``gradients`` the backward pass's results (the gradients w.r.t. the differentiated
    arguments), ``saved`` the tensors the forward pass keeps for the backward pass, ``notes``
    what the import approximated (loops of unknown trip count, conditionals).
    """

    tensors: tuple[Tensor, ...]
    operators: tuple[Operator, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    gradients: tuple[int, ...] = ()
    saved: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    def select(self, phase: Phase | None = None, kinds: Iterable[str] | None = None):
        """The operators of ``phase`` (None: both) whose kind is in ``kinds`` (None: all)."""
        kinds = None if kinds is None else set(kinds)
        for kind in kinds or ():
            if kind not in OP_KINDS:
                raise ValueError(f"Graph.select: kind {kind!r}; valid: {OP_KINDS}")
        return tuple(
            op
            for op in self.operators
            if (phase is None or op.phase == phase) and (kinds is None or op.kind in kinds)
        )

    def flops(self, phase: Phase | None = None, kinds: Iterable[str] | None = None) -> float:
        """Total FLOPs (times each operator's count) of the selected operators."""
        return float(sum(op.flops * op.count for op in self.select(phase, kinds)))

    def bytes_accessed(self, phase: Phase | None = None) -> float:
        """Bytes read plus written by the selected operators, each counted unfused."""
        ops = self.select(phase)
        return float(sum((op.bytes_read + op.bytes_written) * op.count for op in ops))

    @property
    def saved_bytes(self) -> int:
        """Bytes of the tensors kept for the backward pass that the forward pass computed (the
        activations; saved arguments such as weights are not counted)."""
        return sum(self.tensors[t].bytes for t in self.saved if self.tensors[t].producer >= 0)

    def saved_by(self) -> dict[int, tuple[int, ...]]:
        """For each operator whose outputs the backward pass reads from the forward, those
        saved tensors (operator index -> tensor ids)."""
        out: dict[int, tuple[int, ...]] = {}
        for t in self.saved:
            producer = self.tensors[t].producer
            if producer >= 0:
                out[producer] = (*out.get(producer, ()), t)
        return out

    def edges(self) -> np.ndarray:
        """``[n_edges, 2]`` int array of (producer operator, consumer operator) pairs, one per
        tensor use (an operator reading a tensor twice gives one edge)."""
        pairs = {
            (self.tensors[t].producer, i)
            for i, op in enumerate(self.operators)
            for t in op.inputs
            if self.tensors[t].producer >= 0
        }
        return np.asarray(sorted(pairs), dtype=np.int64).reshape(-1, 2)

    def consumers(self) -> tuple[tuple[int, ...], ...]:
        """For each tensor, the operators that read it."""
        users: list[list[int]] = [[] for _ in self.tensors]
        for i, op in enumerate(self.operators):
            for t in dict.fromkeys(op.inputs):
                users[t].append(i)
        return tuple(tuple(u) for u in users)

    def summary(self) -> dict[str, dict[str, float]]:
        """Operator count and FLOPs per (phase, kind), for reports."""
        out: dict[str, dict[str, float]] = {}
        for op in self.operators:
            row = out.setdefault(f"{op.phase}/{op.kind}", {"ops": 0, "flops": 0.0})
            row["ops"] += 1
            row["flops"] += op.flops * op.count
        return out
