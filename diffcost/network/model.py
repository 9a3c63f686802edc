"""Collectives of an iteration priced on a graph (``NetworkTables``), in JAX, with sharing.

The opt-in network path of the cost model (``diffcost.stages`` uses it when the cluster
arrays carry ``network`` tables). A group of a parallel dimension is looked up by its size
and stride in the tables (``entry``: bilinear in ``log size`` and ``log stride`` between the
divisors of the job's GPU count, exact at every discrete plan); one collective costs, as
``diffcost.network.cost.collective_time_s`` on the same flows,

    per algorithm: smooth_max over tiers (load_c * b / capacity_c) + latency steps,
    smooth_min over the algorithms NCCL chooses from, plus the reduction and the call overhead,

with ``b = msg_bytes + half_bw_bytes`` and each tier's capacity times ``nvlink_eff`` (NVLink)
or ``nic_eff`` (the network tiers); latencies scaled by ``nvlink_latency_scale`` and
``nic_latency_scale``. The tier capacities are inputs, so gradients reach every link class.

**Sharing** (``shared_delays_s``): collectives that the execution graph runs at the same time
are flows of ``diffcost.sharing``: each is one flow of one "byte" whose incidence on tier
``c`` is the bytes it puts on that tier's busiest link, so alone it takes exactly its
bandwidth time, and together they split each tier max-min fairly (they are taken to meet on
the busiest link of each tier, which the links of a symmetric layout load alike). The delay
of a flow is its shared completion minus its completion alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from diffcost import sharing, smooth
from diffcost.network.tables import SLOTS, NetworkTables
from diffcost.params import Params

_ZERO_BYTES = 1.0
_RING, _TREE, _HIER, _PAIRWISE, _SEND = range(len(SLOTS))
# the slots each collective chooses from, and the ring's passes over the buffer
_CHOICES = {
    "all_reduce": ((_RING, 2.0), (_TREE, 1.0), (_HIER, 1.0)),
    "reduce_scatter": ((_RING, 1.0),),
    "all_gather": ((_RING, 1.0),),
    "all_to_all": ((_PAIRWISE, 1.0),),
    "send": ((_SEND, 1.0),),
}
_REDUCTION = {"all_reduce": 1.0, "reduce_scatter": 0.5}  # passes of the reduction kernel


def _hat(log_grid, x):
    """Index of the grid cell below ``x`` (clamped to the grid's cells) and the linear weight
    of the cell above. The index is a count of the inner grid points at or below ``x`` (a
    reduction, which XLA computes once and does not fuse into the gather that reads it, where
    a chain of comparisons would be recomputed for every gathered value); no search (a batched
    sweep runs a search as a loop of gathers)."""
    log_grid = jnp.asarray(log_grid)
    i = jnp.sum((x[..., None] >= log_grid[1:-1]).astype(jnp.int32), axis=-1)
    lo = log_grid.at[i].get(mode="promise_in_bounds")
    hi = log_grid.at[i + 1].get(mode="promise_in_bounds")
    return i, smooth.clip_exact((x - lo) / (hi - lo), 0.0, 1.0)


def _cell_corners(table, g):
    """``[columns, (g - 1) ** 2, 4]``: per column of a ``[g * g, columns]`` table, the corners
    ``(i, j), (i, j + 1), (i + 1, j), (i + 1, j + 1)`` of every cell ``i (g - 1) + j``, so that
    reading a column at a cell is one gather of four contiguous values."""
    t = table.reshape(g, g, -1)
    corners = [t[:-1, :-1], t[:-1, 1:], t[1:, :-1], t[1:, 1:]]
    return jnp.stack(corners, axis=-1).reshape((g - 1) * (g - 1), -1, 4).transpose(1, 0, 2)


def _lookup(corners, log_grid, size, stride, columns):
    """``[value of each column in columns]`` at ``(size, stride)`` of a table's
    ``_cell_corners``, bilinear in the logs.

    One gather per column, of its cell's four corners: in a batched sweep each value is then
    a contiguous array over the batch, where one gather of every column's corners leaves the
    batch outermost and every later read of one column strided across all of them."""
    g = log_grid.shape[0]
    i, wi = _hat(log_grid, jnp.log(size))
    j, wj = _hat(log_grid, jnp.log(stride))
    cell = i * (g - 1) + j
    return [bilinear(corners[c].at[cell].get(mode="promise_in_bounds"), wi, wj) for c in columns]


def bilinear(v, wi, wj):
    """The blend of a cell's corners ``v = [(i, j), (i, j + 1), (i + 1, j), (i + 1, j + 1)]``
    at weights ``wi`` (along ``i``) and ``wj`` (along ``j``)."""
    low = (1.0 - wj) * v[0] + wj * v[1]
    high = (1.0 - wj) * v[2] + wj * v[3]
    return (1.0 - wi) * low + wi * high


def tier_capacity_Bps(tables: NetworkTables, params: Params):
    """``[tiers]`` effective capacities: NVLink times ``nvlink_eff``, the rest ``nic_eff``."""
    fast = tables.tier_nvlink
    return tables.tier_capacity_Bps * (fast * params.nvlink_eff + (1.0 - fast) * params.nic_eff)


@struct.dataclass
class Priced:
    """Per table row and slot, what a collective's time needs: ``s_per_byte`` (the busiest
    tier's seconds per buffer byte, a smooth maximum over tiers) and ``latency_s`` (scaled),
    ``[G * G, slots]`` each; the effective ``capacity`` of the tiers; and ``corners``, the
    ``_cell_corners`` of ``[s_per_byte | latency_s | tables.load]`` (``slots * (2 + tiers)``
    columns, ``[columns, cells, 4]``). Computed once per (tables, params), outside any batch
    over plans."""

    s_per_byte: jax.Array
    latency_s: jax.Array
    capacity: jax.Array
    corners: jax.Array


def priced(tables: NetworkTables, params: Params, temperature) -> Priced:
    capacity = tier_capacity_Bps(tables, params)
    s_per_byte = smooth.smooth_max(tables.load / capacity, temperature=temperature)
    scales = jnp.stack([params.nvlink_latency_scale, params.nic_latency_scale])
    latency_s = tables.latency_s @ scales
    rows = tables.load.shape[0]
    table = jnp.concatenate([s_per_byte, latency_s, tables.load.reshape(rows, -1)], axis=1)
    return Priced(s_per_byte, latency_s, capacity, _cell_corners(table, tables.log_grid.shape[0]))


@struct.dataclass
class Group:
    """One group of a dimension on the graph: ``size`` ranks; per slot (``{slot index:
    value}``, the slots looked up) its seconds per byte, latency and, where asked for, its
    ``[tiers]`` bytes on each tier's busiest link per buffer byte (``group_load``)."""

    size: jax.Array
    s_per_byte: dict
    latency_s: dict
    load: dict


def slots_of(names) -> tuple:
    """Indices in ``SLOTS`` of the algorithms collectives ``names`` choose from, sorted."""
    return tuple(sorted({slot for name in names for slot, _ in _CHOICES[name]}))


def group(tables: NetworkTables, prices: Priced, size, stride, slots=None, loads=()) -> Group:
    """The ``Group`` of ``size`` ranks ``stride`` apart, looked up in one gather per column.

    Args:
        slots: indices in ``SLOTS`` to look up (default all).
        loads: indices of the slots whose tier loads to look up too (contention).
    """
    n, tiers = len(SLOTS), tables.load.shape[-1]
    slots = tuple(range(n)) if slots is None else tuple(slots)
    cols = [*slots, *(n + s for s in slots)]
    cols += [2 * n + s * tiers + t for s in loads for t in range(tiers)]
    v = _lookup(prices.corners, tables.log_grid, size, stride, cols)
    k = len(slots)
    return Group(
        size,
        {s: v[i] for i, s in enumerate(slots)},
        {s: v[k + i] for i, s in enumerate(slots)},
        {s: jnp.stack(v[2 * k + i * tiers : 2 * k + (i + 1) * tiers]) for i, s in enumerate(loads)},
    )


def group_load(tables: NetworkTables, size, stride):
    """``[slots, tiers]`` bytes on each tier's busiest link per buffer byte of the group."""
    g = tables.log_grid.shape[0]
    corners = _cell_corners(tables.load.reshape(g * g, -1), g)
    v = _lookup(corners, tables.log_grid, size, stride, range(corners.shape[0]))
    return jnp.stack(v).reshape(tables.load.shape[1:])


def _present(msg_bytes):
    return msg_bytes / (msg_bytes + _ZERO_BYTES)


def _times(name, msg_bytes, g: Group, params: Params):
    present = _present(msg_bytes)
    b = msg_bytes + params.half_bw_bytes * present
    return [
        passes * (b * g.s_per_byte[slot] + present * g.latency_s[slot])
        for slot, passes in _CHOICES[name]
    ]


def collective_s(name, msg_bytes, g: Group, params: Params, temperature):
    """Seconds of collective ``name`` (a key of ``_CHOICES``) on a ``msg_bytes`` buffer over
    group ``g``: NCCL's choice a smooth minimum over the algorithms, plus the reduction and the
    call overhead; a group of one rank costs nothing."""
    times = _times(name, msg_bytes, g, params)
    t = times[0]
    if len(times) > 1:
        t = smooth.smooth_min_of(times, temperature=temperature)[0]
    used = jnp.minimum(g.size - 1.0, 1.0)
    t = t + _REDUCTION.get(name, 0.0) * msg_bytes / params.reduce_Bps
    return used * (t + params.collective_overhead_s * _present(msg_bytes))


def traffic_row(items, g: Group, load, params: Params, temperature):
    """``[tiers]`` bytes that collectives over group ``g`` put on each tier's busiest link.

    Args:
        items: ``(collective, msg_bytes, count)`` each (``count`` calls; a weight).
        g: the group; ``load``: its ``group_load`` (``[slots, tiers]``, or ``{slot: [tiers]}``
            of the slots the items use).

    Each collective's algorithms are weighted as its smooth minimum weighs them: the flow
    ``shared_delays_s`` shares.
    """
    coef = slot_coefficients(items, g, params, temperature)
    row = sum(coef[slot] * load[slot] for slot in sorted(coef))
    return jnp.minimum(g.size - 1.0, 1.0) * row


def slot_coefficients(items, g: Group, params: Params, temperature) -> dict:
    """``{slot: buffer bytes}`` that collectives ``items`` (``traffic_row``'s) over group ``g``
    run on each algorithm slot: calls times passes times ``msg_bytes + half_bw_bytes``, each
    collective's algorithms weighted as its smooth minimum weighs them (a group of one rank
    not excepted: ``traffic_row`` multiplies by ``min(size - 1, 1)``)."""
    coef: dict = {}
    for name, msg_bytes, count in items:
        b = msg_bytes + params.half_bw_bytes * _present(msg_bytes)
        choices = _CHOICES[name]
        weights = [1.0]
        if len(choices) > 1:
            times = _times(name, msg_bytes, g, params)
            weights = smooth.smooth_min_of(times, temperature=temperature)[1]
        for i, (slot, passes) in enumerate(choices):
            coef[slot] = coef.get(slot, 0.0) + count * passes * b * weights[i]
    return coef


def shared_delays_s(rows, capacity, temperature=sharing.DEFAULT_TEMPERATURE):
    """``[flows]`` delay of each of concurrent collectives (``rows``: ``[flows, tiers]``
    bytes on each tier's busiest link) from sharing the tiers max-min fairly: completion
    together minus completion alone (``sharing.few_flows_of``, all starting together).

    The rows are ``smooth.stored`` first: the unrolled solver reads them in many fused loops,
    each of which would otherwise recompute them from the table lookups."""
    rows = smooth.stored(jnp.stack(rows))
    tiers = range(len(capacity))
    together, alone = sharing.few_flows_of(
        [[row[t] for t in tiers] for row in rows], [capacity[t] for t in tiers], temperature
    )
    return jnp.stack([a - b for a, b in zip(together, alone)])
