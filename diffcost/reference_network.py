"""reference_network: exact, event-driven link sharing on the routed graph, the oracle for the
network path's contention.

With a topology and ``contention``, ``diffcost.stages.network_comm_times`` lets the collectives
that run at the same time under a layer's backward (``stages.shared_traffic``: the gradient
bucket, the next layer's tensor-parallel collectives, a pipeline send) share links through
``diffcost.sharing``: on tier tables each is one smooth flow whose incidence on a tier is the
bytes it puts on that tier's busiest link, so the three are taken to meet on the busiest link
of each tier; on per-link tables (``build_tables(links=True)``, ``network.link_sharing``) each
(collective, dimension) is one flow of streams on the links it crosses. This module computes
the same delay without either abstraction, in plain numpy/scipy with hard minima (no JAX):

* **flows**: every group of each dimension (``tables.groups_of``), with the algorithm NCCL's
  choice picks (the hard minimum of the per-algorithm times ``network.model`` soft-minimises),
  is the flows of that algorithm (``tables.slot_flows``: ring channels, double binary tree,
  hierarchical rings, pairwise, sends; the phases of one collective stream, as in the tables),
  each carrying its share of ``passes * count * (msg_bytes + half_bw_bytes)`` bytes; the
  traffic of one of the three (bucket, tp, send) between two ranks is one flow (one stream);
* **routing**: each flow on its least-cost paths with ECMP splits (``loads.incidence_entries``,
  sparse), every link at its own capacity times ``nvlink_eff`` (NVLink links) or ``nic_eff``;
* **sharing**: a fluid, event-driven schedule with exact max-min fair rates by progressive
  filling (as ``diffcost.sharing_reference``, on a sparse incidence): the rates are
  recomputed at every flow start and finish, the clock advances to the next one.

The bucket's makespan alone and together with the other two gives the exact delay;
``iteration`` runs ``reference.simulate_reference`` on the stage times with that delay in
place of the smooth one. ``benchmarks/topology.py`` (section ``sharing``, ``graph``) compares
them with the smooth in-program prediction (either form); ``docs/network.md`` quotes the
figures.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp

from diffcost import api, sharing, smooth, stages, workload
from diffcost.api import simulate_jit
from diffcost.network import design_config, link_sharing
from diffcost.network import model as netmodel
from diffcost.network.attach import job_topology
from diffcost.network.graph import Topology
from diffcost.network.loads import incidence_entries
from diffcost.network.tables import (
    SLOTS,
    TIERS,
    build_tables,
    groups_of,
    job_graph,
    link_tiers,
    slot_flows,
)
from diffcost.reference import simulate_reference

ROWS = ("bucket", "tp", "send")  # the order of stages.shared_traffic
# levels and finish times within this relative distance of the minimum count as ties
_TIE = 1e-9


@dataclasses.dataclass
class SharedFlows:
    """The routed flows of the concurrent collectives: a sparse ``(flows, links)`` incidence
    (fraction of each flow's bytes on each link), per-link capacity (bytes/s, efficiencies
    applied), bytes and row (index in ``ROWS``) per flow."""

    incidence: sp.csr_matrix
    capacity_Bps: np.ndarray
    flow_bytes: np.ndarray
    row: np.ndarray


@dataclasses.dataclass
class SharingComparison:
    """The bucket's bandwidth time (seconds) alone and shared, smooth and exact."""

    smooth_alone_s: float
    smooth_shared_s: float
    tiers_shared_s: float  # the smooth model's own rows (tiers or links) shared exactly
    exact_alone_s: float
    exact_shared_s: float
    flows: int
    links: int

    @property
    def smooth_delay_s(self) -> float:
        return self.smooth_shared_s - self.smooth_alone_s

    @property
    def exact_delay_s(self) -> float:
        return self.exact_shared_s - self.exact_alone_s

    @property
    def shared_err(self) -> float:
        """Relative error of the smooth shared bucket time against the exact one (0 where
        both are 0: no bucket traffic)."""
        gap = abs(self.smooth_shared_s - self.exact_shared_s)
        return gap / self.exact_shared_s if self.exact_shared_s > 0 else float(gap > 0)

    @property
    def smoothing_err(self) -> float:
        """Relative error of the smooth sharing against the exact sharing of its own rows
        (tiers or links): what the smoothing costs, apart from the abstraction."""
        gap = abs(self.smooth_shared_s - self.tiers_shared_s)
        return gap / self.tiers_shared_s if self.tiers_shared_s > 0 else float(gap > 0)


def _f(x) -> float:
    return float(np.asarray(x))


def _choice(name, msg_bytes, group, params):
    """(slot, passes) of NCCL's choice for collective ``name``: the fastest algorithm."""
    times = [_f(t) for t in netmodel._times(name, msg_bytes, group, params)]
    return netmodel._CHOICES[name][int(np.argmin(times))]


def shared_flows(graph: Topology, n_gpus: int, traffic: dict, dims: dict, tables, params):
    """Route the collectives of ``traffic`` (``stages.shared_traffic``'s form) on ``graph``.

    Args:
        graph: the job's graph (``tables.job_graph``); ``n_gpus``: ranks 0..n_gpus-1.
        traffic: ``{row: [(dimension, [(collective, msg_bytes, count)])]}``, rows of ``ROWS``.
        dims: ``{dimension: (size, stride)}`` whole numbers (``job_traffic``).
        tables: the job's ``NetworkTables`` (NCCL's algorithm choice is priced on them).
        params: ``Params``.

    Returns:
        ``SharedFlows``.
    """
    prices = netmodel.priced(tables, params, 0.0)
    pairs: dict = {}  # (row, src, dst) -> bytes
    for r, name in enumerate(ROWS):
        for dim, items in traffic[name]:
            size, stride = dims[dim]
            if size < 2:
                continue
            group = netmodel.group(tables, prices, float(size), float(stride))
            ranks = groups_of(n_gpus, size, stride)
            for collective, msg_bytes, count in items:
                msg, count = _f(msg_bytes), _f(count)
                if msg <= 0 or count <= 0:
                    continue
                slot, passes = _choice(collective, msg, group, params)
                src, dst, share = slot_flows(graph, ranks, SLOTS[slot])
                b = passes * count * (msg + _f(params.half_bw_bytes) * msg / (msg + 1.0))
                for s, d, w in zip(src.tolist(), dst.tolist(), share.tolist()):
                    pairs[(r, s, d)] = pairs.get((r, s, d), 0.0) + w * b
    keys = list(pairs)
    row = np.array([k[0] for k in keys], dtype=int)
    src = np.array([k[1] for k in keys], dtype=int)
    dst = np.array([k[2] for k in keys], dtype=int)
    flow, link, frac = incidence_entries(graph, src, dst)
    incidence = sp.csr_matrix((frac, (flow, link)), shape=(len(keys), graph.n_links))
    return SharedFlows(
        incidence, link_capacity_Bps(graph, params), np.array(list(pairs.values())), row
    )


def link_capacity_Bps(graph: Topology, params) -> np.ndarray:
    """``[links]`` capacity times ``nvlink_eff`` on NVLink links, ``nic_eff`` elsewhere (as
    ``network.model.tier_capacity_Bps`` for the tiers)."""
    nvlink = link_tiers(graph) == TIERS.index("nvlink")
    eff = np.where(nvlink, _f(params.nvlink_eff), _f(params.nic_eff))
    return graph.capacity_Bps * eff


def max_min_rates(incidence: sp.csr_matrix, capacity_Bps, running) -> np.ndarray:
    """Exact max-min fair rates by progressive filling (``sharing_reference.max_min_rates``
    on a sparse incidence): 0 for a flow that does not run or crosses no link."""
    a_t = incidence.T.tocsr()
    crosses = (incidence > 0).astype(float).tocsr()
    unfrozen = running & (crosses.sum(axis=1).A1 > 0)
    rates = np.zeros(incidence.shape[0])
    while unfrozen.any():
        weight = a_t @ unfrozen.astype(float)
        used = a_t @ np.where(running & ~unfrozen, rates, 0.0)
        levels = np.full(len(capacity_Bps), np.inf)
        on = weight > 0
        levels[on] = np.maximum(capacity_Bps[on] - used[on], 0.0) / weight[on]
        level = levels.min()
        saturated = (levels <= level * (1.0 + _TIE)).astype(float)
        freeze = unfrozen & ((crosses @ saturated) > 0)
        rates[freeze] = level
        unfrozen &= ~freeze
    return rates


def finish_times_s(incidence: sp.csr_matrix, capacity_Bps, flow_bytes) -> np.ndarray:
    """Finish of flows that start together, sharing max-min fairly: at every finish the rates
    are recomputed and the clock advances to the next (``sharing_reference``'s schedule)."""
    left = np.asarray(flow_bytes, dtype=float).copy()
    running = (left > 0) & (np.diff(incidence.indptr) > 0)
    finish = np.zeros(len(left))
    now = 0.0
    while running.any():
        rates = max_min_rates(incidence, capacity_Bps, running)
        to_go = np.where(running, left / np.where(running, rates, 1.0), np.inf)
        dt = to_go.min()
        done = running & (to_go <= dt * (1.0 + _TIE))
        now += dt
        left[running] -= rates[running] * dt
        finish[done] = now
        running &= ~done
    return finish


def exact_bucket_s(flows: SharedFlows) -> tuple[float, float]:
    """The bucket's makespan (seconds) alone and with the other rows' flows."""
    mine = flows.row == 0
    if not mine.any():
        return 0.0, 0.0
    alone = finish_times_s(flows.incidence[mine], flows.capacity_Bps, flows.flow_bytes[mine])
    shared = finish_times_s(flows.incidence, flows.capacity_Bps, flows.flow_bytes)
    return float(alone.max()), float(shared[mine].max())


def _smooth_rows(tables, params, traffic, dims, temperature):
    """The smooth model's bucket bandwidth time alone and shared, as
    ``stages.network_comm_times`` computes them (per link with ``tables.link_load``, else per
    tier: ``network.model.shared_delays_s``), and the flows it shares: ``(alone, shared,
    [flows, links or tiers] incidence, [links or tiers] capacity, [flows] sizes, [flows] 1 for
    the bucket's)``."""
    prices = netmodel.priced(tables, params, temperature)
    groups = {d: netmodel.group(tables, prices, *dims[d]) for d in dims}
    if tables.link_load is not None:
        flows = link_sharing.shared_flows(traffic, dims, tables, groups, params, temperature)
        delay, alone = link_sharing.flows_delay_s(flows)
        incidence, sizes, mine, capacity = flows
        return alone, alone + delay, incidence, capacity, sizes, mine

    def row(parts):
        out = 0.0
        for dim, items in parts:
            load = netmodel.group_load(tables, *dims[dim])
            out = out + netmodel.traffic_row(items, groups[dim], load, params, temperature)
        return out

    rows = [row(traffic[name]) for name in ROWS]
    delay = netmodel.shared_delays_s(rows, prices.capacity)[0]
    alone = smooth.safe_div(1.0, sharing.alone_rate_Bps(rows[0][None, :], prices.capacity)[0])
    ones, mine = jnp.ones(len(rows)), jnp.arange(len(rows)) == 0
    return alone, alone + delay, jnp.stack(rows), prices.capacity, ones, mine


_STRINGS: dict = {}  # the traffic's tree and its strings, recorded when _job_traffic traces


@jax.jit
def _job_traffic(model, plan, tables, params):
    """``(traffic leaves without the strings, dims, smooth (alone, shared))`` of one job."""
    traffic = stages.shared_traffic(workload.layer_work(model, plan), plan)
    dims = stages._dims(plan)
    leaves, tree = jax.tree_util.tree_flatten(traffic)
    _STRINGS["tree"] = tree
    _STRINGS["strings"] = [x if isinstance(x, str) else None for x in leaves]
    smooth_s = _smooth_rows(tables, params, traffic, dims, smooth.DEFAULT_TEMPERATURE)
    return [x for x in leaves if not isinstance(x, str)], dims, smooth_s


def job_traffic(model, plan, tables, params):
    """``(traffic, dims, (smooth alone, smooth shared, tiers shared))`` of one job:
    ``stages.shared_traffic`` with concrete values, ``{dimension: (size, stride)}`` as whole
    numbers, and the bucket's bandwidth time in seconds: the smooth model's alone and shared
    (jitted), and ``tiers shared``, the exact max-min sharing of the same three tier rows
    (``finish_times_s``): the smooth model's own inputs, shared without smoothing."""
    numbers, dims, (alone, shared, rows, capacity, sizes, mine) = _job_traffic(
        model, plan, tables, params
    )
    it = iter(numbers)
    leaves = [next(it) if x is None else x for x in _STRINGS["strings"]]
    traffic = jax.tree_util.tree_unflatten(_STRINGS["tree"], leaves)
    dims = {d: (round(_f(s)), round(_f(t))) for d, (s, t) in dims.items()}
    rows, capacity, sizes = np.asarray(rows), np.asarray(capacity), np.asarray(sizes)
    done = finish_times_s(sp.csr_matrix(rows), capacity, sizes)
    return traffic, dims, (_f(alone), _f(shared), float(done[np.asarray(mine) > 0].max()))


def compare(graph, n_gpus, model, plan, tables, params) -> SharingComparison:
    """The bucket's bandwidth time alone and shared: smooth (tiers) against exact (graph), for
    the job ``model, plan`` of ``n_gpus`` ranks on ``graph`` (``tables.job_graph``) whose
    ``NetworkTables`` are ``tables``."""
    traffic, dims, smooth_s = job_traffic(model, plan, tables, params)
    flows = shared_flows(graph, n_gpus, traffic, dims, tables, params)
    exact_alone, exact_shared = exact_bucket_s(flows)
    return SharingComparison(*smooth_s, exact_alone, exact_shared, *flows.incidence.shape)


_stage_times = jax.jit(stages.stage_times, static_argnames=("temperature",))


def compare_job(model, plan, cluster, params, topology: Topology, n_gpus: int):
    """``compare`` for one job: ``cluster.network`` holds the tables of ``topology``.

    Returns:
        ``(SharingComparison, {"smooth_s", "reference_s", "reference_smooth_delay_s"})``: the
        iteration of ``simulate`` (default temperature), of ``simulate_reference`` on the stage
        times with the exact delay, and with the smooth one.
    """
    graph = job_graph(topology, n_gpus)
    c = compare(graph, n_gpus, model, plan, cluster.network, params)
    exact = _stage_times(model, plan, cluster, params, 0.0, shared_delay_s=c.exact_delay_s)
    smooth_delay = _stage_times(model, plan, cluster, params, 0.0, shared_delay_s=c.smooth_delay_s)
    iteration = {
        "smooth_s": _f(simulate_jit(model, plan, cluster, params).iteration_s),
        "reference_s": simulate_reference(exact).iteration_s,
        "reference_smooth_delay_s": simulate_reference(smooth_delay).iteration_s,
    }
    return c, iteration


def example_job(path):
    """``(model, plan, cluster, params, topology, n_gpus)`` of an example config on the graph
    its cluster describes (``topology: cluster``), or of a design config's job
    (``configs/designs``) on its topology; ``cluster.network`` holds the job's tables."""
    path = Path(path)
    if path.parent.name == "designs":
        spec = design_config.load_design(path)
        exp, topology = spec.experiment, spec.topology
        model, plan, cluster = api.experiment_arrays(exp)
        cluster = cluster.replace(network=build_tables(topology, exp.plan.n_gpus))
    else:
        exp = api.load(path, ["cluster.topology=cluster"])
        model, plan, cluster = api.experiment_arrays(exp)
        topology = job_topology(exp.cluster, exp.plan.n_gpus)
    return model, plan, cluster, api.params_for(exp)[0], topology, exp.plan.n_gpus
