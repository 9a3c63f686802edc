"""Concurrent collectives sharing the links they cross: the per-link form of the network
path's contention (tables built with ``build_tables(links=True)``).

The collectives a layer's backward runs at the same time (``stages.shared_traffic``: the
gradient bucket, dense and expert, the next layer's tensor-parallel collectives, a pipeline
send) are flows of ``diffcost.sharing.completion_times_s`` on every link the tables load, one
flow per (collective, dimension, stream class):

* **its stream class** (``tables.STREAM_CLASSES``): the streams (flows between one source
  and one destination) of the collective's groups that stay on NVLink links, and those that
  cross a network link. The two are apart because their streams differ most in size and
  bottleneck (a hierarchical all-reduce's rings inside and across domains, ring channels
  within a node and through its NIC): streams of one flow move in step, so one class
  cannot finish before the other, nor absorb sharing with its slack;
* **its bytes on each link**: the buffer bytes each algorithm slot runs
  (``model.slot_coefficients``: calls, passes, NCCL's choice as the smooth minimum weighs it)
  times the class's bytes on the link per buffer byte (``NetworkTables.link_load``: every
  group of the dimension at once), looked up bilinearly in ``log size`` and ``log stride`` as
  the tier tables are;
* **its unit, a stream**: the flow stands for the class's streams; its size is their
  bytes-weighted mean size ``S = sum b^2 / sum b`` (``NetworkTables.link_stream``, per slot
  and class, slots taken to use different pairs), and its incidence on a link is its bytes
  there over ``S``: how many such streams cross the link. Max-min fair rates of these flows
  are then fair per stream, in bytes per second, as the exact reference
  (``diffcost.reference_network``) shares each stream; a collective only slows where it
  shares a link with another.

The delay of the bucket is its completion with the others minus its completion alone (the
same solver with the others absent); a flow's streams move in step, so one class whose
streams differ in size or path is the approximation (``docs/network.md`` quotes the error
against the exact reference).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from diffcost import sharing, smooth
from diffcost.network import model as netmodel
from diffcost.network.tables import NetworkTables
from diffcost.params import Params


def link_capacity_Bps(tables: NetworkTables, params: Params):
    """``[links]`` effective capacity of each loaded link: its tier's effective capacity
    (``model.tier_capacity_Bps``, so a what-if on the tier capacities scales its links)
    times the link's ``link_scale``."""
    return (tables.link_tier @ netmodel.tier_capacity_Bps(tables, params)) * tables.link_scale


def group_links(tables: NetworkTables, size, stride):
    """``([slots, classes, links] bytes per buffer byte, [slots, classes, 2] streams)`` of
    every group of ``size`` ranks ``stride`` apart, bilinear in the logs between the grid's
    divisors."""
    g = tables.log_grid.shape[0]
    i, wi = netmodel._hat(tables.log_grid, jnp.log(size))
    j, wj = netmodel._hat(tables.log_grid, jnp.log(stride))

    def at(table):
        corner = [table.at[(i + a) * g + j + b].get(mode="promise_in_bounds")
                  for a in (0, 1) for b in (0, 1)]  # fmt: skip
        return netmodel.bilinear(corner, wi, wj)

    return at(tables.link_load), at(tables.link_stream)


def flow_rows(items, g: netmodel.Group, links, params: Params, temperature):
    """``[([links] incidence in streams, stream bytes)]``, one per stream class, of
    collectives ``items`` (``model.traffic_row``'s) over group ``g`` with ``links =
    group_links(...)``."""
    load, streams = links
    used = jnp.minimum(g.size - 1.0, 1.0)
    coef = netmodel.slot_coefficients(items, g, params, temperature)
    slots = sorted(coef)
    out = []
    for c in range(load.shape[1]):
        on_links = used * sum(coef[s] * load[s, c] for s in slots)
        total = used * sum(coef[s] * streams[s, c, 0] for s in slots)
        squares = used * sum(coef[s] ** 2 * streams[s, c, 1] for s in slots)
        row = on_links * smooth.safe_div(total, squares)
        out.append((row, smooth.safe_div(squares, total)))
    return out


def shared_flows(traffic: dict, dims: dict, tables: NetworkTables, groups: dict, params,
                 temperature):  # fmt: skip
    """The flows of ``stages.shared_traffic``'s ``traffic``, one per (collective, dimension,
    stream class) (``dims`` ``{dimension: (size, stride)}``; ``groups`` ``{dimension:
    model.Group}``).

    Returns:
        ``([flows, links] incidence, [flows] stream bytes, [flows] numpy 1 for the bucket's,
        [links] capacity)``.
    """
    incidence, size, bucket = [], [], []
    for name, parts in traffic.items():
        for dim, items in parts:
            links = group_links(tables, *dims[dim])
            for row, unit in flow_rows(items, groups[dim], links, params, temperature):
                incidence.append(row)
                size.append(unit)
                bucket.append(1.0 if name == "bucket" else 0.0)
    mine = np.asarray(bucket)  # static: which rows are the bucket's
    return jnp.stack(incidence), jnp.stack(size), mine, link_capacity_Bps(tables, params)


def bucket_delay_s(traffic: dict, dims: dict, tables: NetworkTables, groups: dict, params,
                   temperature):  # fmt: skip
    """The gradient bucket's delay (seconds) from sharing links with the tensor-parallel
    collectives and the pipeline send (``shared_flows``' arguments).

    Returns:
        ``(delay, alone)``: the bucket's completion together minus alone, and alone.
    """
    return flows_delay_s(shared_flows(traffic, dims, tables, groups, params, temperature))


def flows_delay_s(flows):
    """``(delay, alone)`` of the bucket among ``shared_flows``' flows (``bucket_delay_s``);
    alone, the solver runs on the bucket's rows only (as many phases and rounds as they)."""
    incidence, size, mine, capacity = flows
    zeros = jnp.zeros_like(capacity)
    rows = np.flatnonzero(mine > 0)
    together = sharing.completion_times_s(incidence, capacity, zeros, size)[rows]
    alone = sharing.completion_times_s(incidence[rows], capacity, zeros, size[rows])
    done = [smooth.softmax_mean(t) for t in (together, alone)]
    return done[0] - done[1], done[1]
