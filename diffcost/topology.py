"""How much of a GPU's NVLink bandwidth a ring over ``n`` GPUs of one node can use.

NCCL runs an all-reduce as rings through the group's GPUs; each ring takes one link direction
per hop, so the bandwidth a group reaches is the number of directed rings its links carry.

* ``switch`` (NVSwitch, NVL72): every GPU reaches every other at its full bandwidth: 1.
* ``mesh`` (a full point-to-point mesh, AMD Infinity Fabric): one link per peer, so a group of
  ``n`` uses ``(n - 1) / (gpus_per_node - 1)`` of the GPU's links.
* ``cube-mesh`` (NVIDIA DGX-1's hybrid cube-mesh, 8 V100 with 6 NVLinks each): rings must be
  Hamiltonian cycles of the group's subgraph. The share for the first ``n`` GPUs is twice the
  most edge-disjoint Hamiltonian cycles the links carry (one ring per direction), over the 6
  links of a GPU; two GPUs share their direct links. A group with no Hamiltonian cycle (GPUs
  0-4: GPU 4 reaches only GPU 0) relays through an intermediate GPU (NCCL's NVLink-via-GPU
  path), bounded by its weakest GPU's links (an upper bound: the vTrain V100 tables reach 80%
  of it there).

The table has one entry per group size ``0 .. RING_TABLE - 1``; the cost model interpolates it
piecewise linearly (exact at whole group sizes, smooth in between) and a group larger than the
table takes its last entry.

Each node topology is one registered :class:`IntraNodeTopology` (``INTRA_NODE``): its ring
share table and the node sizes it admits. Adding one is one ``register`` call in this file;
``ClusterSpec.intra_node`` is checked against the registry when a cluster is loaded.

References:
    NVIDIA, "DGX-1 System Architecture" white paper (2017), the hybrid cube-mesh;
    NCCL's topology search (rings over NVLink, PATH_NVB relays).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable

import numpy as np

RING_TABLE = 17  # group sizes 0..16 inside one node

# NVLink connections between the GPUs of a DGX-1 with V100 (``nvidia-smi topo -m``: NV1/NV2):
# two fully connected quads (0-3, 4-7: cube faces with their diagonals) joined GPU i to i + 4.
DGX1_LINKS = np.array(
    [
        [0, 1, 1, 2, 2, 0, 0, 0],
        [1, 0, 2, 1, 0, 2, 0, 0],
        [1, 2, 0, 2, 0, 0, 1, 0],
        [2, 1, 2, 0, 0, 0, 0, 1],
        [2, 0, 0, 0, 0, 1, 1, 2],
        [0, 2, 0, 0, 1, 0, 2, 1],
        [0, 0, 1, 0, 1, 2, 0, 2],
        [0, 0, 0, 1, 2, 1, 2, 0],
    ]
)


def _hamiltonian_cycles(links: np.ndarray) -> list[tuple]:
    """Every Hamiltonian cycle of the graph, as a sorted tuple of its undirected edges."""
    n = len(links)
    found = set()
    for rest in itertools.permutations(range(1, n)):
        if rest[0] > rest[-1]:  # each cycle once, not once per direction
            continue
        path = (0, *rest)
        edges = tuple(sorted(tuple(sorted((path[i], path[(i + 1) % n]))) for i in range(n)))
        if all(links[a, b] > 0 for a, b in edges):
            found.add(edges)
    return sorted(found)


def _max_packing(links: np.ndarray, cycles: list[tuple]) -> int:
    """Most cycles (repeats allowed) whose edges fit the link counts (exhaustive search)."""
    capacity = {
        (a, b): int(links[a, b]) for a in range(len(links)) for b in range(a + 1, len(links))
    }
    best = 0

    def grow(start, count):
        nonlocal best
        best = max(best, count)
        for j in range(start, len(cycles)):
            if all(capacity[e] > 0 for e in cycles[j]):
                for e in cycles[j]:
                    capacity[e] -= 1
                grow(j, count + 1)
                for e in cycles[j]:
                    capacity[e] += 1

    grow(0, 0)
    return best


def ring_links(links: np.ndarray) -> np.ndarray:
    """Directed rings (in links of bandwidth) over the first ``n`` GPUs, for ``n = 0..len``."""
    out = np.zeros(len(links) + 1)
    for n in range(2, len(links) + 1):
        sub = links[:n, :n]
        if n == 2:
            out[n] = sub[0, 1]
            continue
        cycles = _hamiltonian_cycles(sub)
        out[n] = 2 * _max_packing(sub, cycles) if cycles else sub.sum(axis=1).min()
    out[:2] = out[2]  # zero or one GPU moves nothing; their entries only keep the curve flat
    return out


@functools.cache
def _cube_mesh_share() -> tuple[float, ...]:
    return tuple(ring_links(DGX1_LINKS) / DGX1_LINKS.sum(axis=1).max())


@dataclasses.dataclass(frozen=True)
class IntraNodeTopology:
    """One NVLink topology inside a node.

    Attributes:
        name: the ``intra_node`` value that selects it.
        ring_share_fn: ``gpus_per_node -> [RING_TABLE]`` share of a GPU's NVLink bandwidth a
            ring over ``n`` GPUs uses, n = 0..RING_TABLE - 1.
        node_error_fn: ``gpus_per_node -> None``, or why that many GPUs cannot form this
            topology (said to the user when a cluster is loaded).
    """

    name: str
    ring_share_fn: Callable[[int], np.ndarray]
    node_error_fn: Callable[[int], str | None] = lambda gpus_per_node: None


INTRA_NODE: dict[str, IntraNodeTopology] = {}


def register(topology: IntraNodeTopology) -> IntraNodeTopology:
    """Add ``topology`` to ``INTRA_NODE`` under its name."""
    INTRA_NODE[topology.name] = topology
    return topology


def _mesh_share(gpus_per_node: int) -> np.ndarray:
    n = np.arange(RING_TABLE, dtype=float)
    peers = max(gpus_per_node - 1, 1)
    return np.clip(np.maximum(n - 1.0, 1.0) / peers, 0.0, 1.0)


def _cube_mesh_table(gpus_per_node: int) -> np.ndarray:
    share = np.array(_cube_mesh_share())
    out = np.full(RING_TABLE, share[-1])
    out[: len(share)] = share
    return out


register(IntraNodeTopology("switch", lambda gpus_per_node: np.ones(RING_TABLE)))
register(
    IntraNodeTopology(
        "mesh",
        _mesh_share,
        lambda g: (
            None
            if g <= RING_TABLE - 1
            else f"expected at most {RING_TABLE - 1} GPUs on one point-to-point mesh "
            "(use intra_node: switch)"
        ),
    )
)
register(
    IntraNodeTopology(
        "cube-mesh",
        _cube_mesh_table,
        lambda g: (
            None
            if g == 8
            else "DGX-1's hybrid cube-mesh has 8 GPUs; use intra_node: mesh or switch for other "
            "nodes"
        ),
    )
)
TOPOLOGIES = tuple(INTRA_NODE)


def ring_share(intra_node: str, gpus_per_node: int) -> np.ndarray:
    """Fraction of a GPU's NVLink bandwidth a ring over ``n`` GPUs of a node uses, n = 0..16."""
    if intra_node not in INTRA_NODE:
        raise ValueError(f"intra_node={intra_node!r}: expected one of {', '.join(INTRA_NODE)}")
    return INTRA_NODE[intra_node].ring_share_fn(gpus_per_node)
