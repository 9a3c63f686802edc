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
    """Index of the grid cell below ``x`` and the linear weight of the cell above."""
    last = log_grid.shape[0] - 2
    i = jnp.clip(jnp.searchsorted(log_grid, x, side="right") - 1, 0, last)
    width = log_grid[i + 1] - log_grid[i]
    return i, smooth.clip_exact((x - log_grid[i]) / width, 0.0, 1.0)


def _bilinear(table, log_grid, size, stride):
    """Row of ``table`` (``[G * G, ...]``) at ``(size, stride)``, bilinear in the logs."""
    g = log_grid.shape[0]
    i, wi = _hat(log_grid, jnp.log(size))
    j, wj = _hat(log_grid, jnp.log(stride))
    low = (1.0 - wj) * table[i * g + j] + wj * table[i * g + j + 1]
    high = (1.0 - wj) * table[(i + 1) * g + j] + wj * table[(i + 1) * g + j + 1]
    return (1.0 - wi) * low + wi * high


def tier_capacity_Bps(tables: NetworkTables, params: Params):
    """``[tiers]`` effective capacities: NVLink times ``nvlink_eff``, the rest ``nic_eff``."""
    fast = tables.tier_nvlink
    return tables.tier_capacity_Bps * (fast * params.nvlink_eff + (1.0 - fast) * params.nic_eff)


@struct.dataclass
class Priced:
    """Per table row and slot, what a collective's time needs: ``s_per_byte`` (the busiest
    tier's seconds per buffer byte, a smooth maximum over tiers) and ``latency_s`` (scaled),
    ``[G * G, slots]`` each; and the effective ``capacity`` of the tiers. Computed once per
    (tables, params), outside any batch over plans."""

    s_per_byte: jax.Array
    latency_s: jax.Array
    capacity: jax.Array


def priced(tables: NetworkTables, params: Params, temperature) -> Priced:
    capacity = tier_capacity_Bps(tables, params)
    s_per_byte = smooth.smooth_max(tables.load / capacity, temperature=temperature)
    scales = jnp.stack([params.nvlink_latency_scale, params.nic_latency_scale])
    return Priced(s_per_byte, tables.latency_s @ scales, capacity)


@struct.dataclass
class Group:
    """One group of a dimension on the graph: ``size`` ranks; per slot its seconds per byte
    and latency (``[slots]``)."""

    size: jax.Array
    s_per_byte: jax.Array
    latency_s: jax.Array


def group(tables: NetworkTables, prices: Priced, size, stride) -> Group:
    """The ``Group`` of ``size`` ranks ``stride`` apart."""
    per_byte = _bilinear(prices.s_per_byte, tables.log_grid, size, stride)
    return Group(size, per_byte, _bilinear(prices.latency_s, tables.log_grid, size, stride))


def group_load(tables: NetworkTables, size, stride):
    """``[slots, tiers]`` bytes on each tier's busiest link per buffer byte of the group."""
    return _bilinear(tables.load, tables.log_grid, size, stride)


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
        t = smooth.smooth_min(jnp.stack(times), temperature=temperature)
    used = jnp.minimum(g.size - 1.0, 1.0)
    t = t + _REDUCTION.get(name, 0.0) * msg_bytes / params.reduce_Bps
    return used * (t + params.collective_overhead_s * _present(msg_bytes))


def traffic_row(items, g: Group, load, params: Params, temperature):
    """``[tiers]`` bytes that collectives over group ``g`` put on each tier's busiest link.

    Args:
        items: ``(collective, msg_bytes, count)`` each (``count`` calls; a weight).
        g: the group; ``load``: its ``group_load``.

    Each collective's algorithms are weighted as its smooth minimum weighs them: the flow
    ``shared_delays_s`` shares.
    """
    coef = [0.0] * len(SLOTS)
    for name, msg_bytes, count in items:
        b = msg_bytes + params.half_bw_bytes * _present(msg_bytes)
        choices = _CHOICES[name]
        weights = [1.0]
        if len(choices) > 1:
            times = jnp.stack(_times(name, msg_bytes, g, params))
            weights = smooth.softmin_weights(times, temperature=temperature)
        for i, (slot, passes) in enumerate(choices):
            coef[slot] = coef[slot] + count * passes * b * weights[i]
    coef = jnp.stack([jnp.asarray(c, dtype=load.dtype) for c in coef])
    return jnp.minimum(g.size - 1.0, 1.0) * (coef @ load)


def shared_delays_s(rows, capacity, temperature=sharing.DEFAULT_TEMPERATURE):
    """``[flows]`` delay of each of concurrent collectives (``rows``: ``[flows, tiers]``
    bytes on each tier's busiest link) from sharing the tiers max-min fairly: completion
    together minus completion alone (``sharing.few_flows_completion_s``, all starting
    together)."""
    rows = jnp.stack(rows)
    together = sharing.few_flows_completion_s(rows, capacity, temperature)
    alone = smooth.smooth_max(rows / capacity, axis=-1, temperature=sharing.CAP_TEMPERATURE)
    return together - alone
