"""The sharding plan NVIDIA's HugeCTR DLRM-DCNv2 training picks, as ``dlrm_cost`` choices.

NVIDIA's MLPerf DLRM-DCNv2 runs (``SHARDING_PLAN=auto`` on one node, ``hier_auto`` on several)
plan the embedding tables with a greedy balancer of its own (``sharding/planner.py`` of the
MLPerf submission; the behaviour below is read from it, the code is ours):

* tables smaller than ``dp_threshold_gib`` (rows x ``ev_size`` x 8 bytes with Adagrad) are
  replicated (data parallel);
* every other table is cut into a power-of-two number of equal row shards (hashed rows: each
  shard serves the same share of the lookups), each shard into a different **bucket**: a GPU
  (``auto``) or a node (``hier_auto``: the node's GPUs all hold the shard, split row-wise);
* a bucket costs the lookups it serves (a table's multi-hot size over its shard count) plus
  ``mem_comm_bw_ratio / mem_comm_work_ratio`` per shard it holds, and may hold at most
  ``memory_cap_gib`` (times the GPUs per node for a node) of shards;
* shards go hottest first into the cheapest bucket that has room and no other shard of the
  same table; a shard that fits nowhere has its table split further. After each complete
  placement the hottest splittable table is split once more; of the plans found in
  ``max_search_iter`` rounds (and the plan holding every table in every bucket) the one with
  the cheapest most expensive bucket wins.

``mem_comm_bw_ratio`` is the ratio of memory to exchange bandwidth, which NVIDIA's configs set
per system (11 on one 8x H200 node, 67 on 16 DGX H100 nodes); ``cluster_bw_ratio`` computes it
from the cluster the same way (HBM over NVLink for a GPU bucket, a node's HBM over its NICs for
a node bucket), which reproduces both values.

A table cut into ``k`` shards is priced as ``k`` tables of ``rows / k`` rows and ``pooling / k``
lookups per sample, each sending partial pooled sums for every sample (a row-wise shard's
output): ``plan`` returns that split ``DlrmSpec`` with one ``TableChoice`` per shard.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diffcost.dlrm import DlrmSpec, TableSpec
from diffcost.dlrm_cost import DP, TW, TWRW, TableChoice
from diffcost.specs import ClusterSpec

GIB = 1e9  # the planner's "GB" (its unit memory cost is bytes x 1e-9)
ADAGRAD_BYTES_PER_VALUE = 8  # the value and its accumulator, fp32


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """The planner's settings (NVIDIA's defaults; ``mem_comm_bw_ratio`` None: from the
    cluster, ``cluster_bw_ratio``)."""

    mem_comm_bw_ratio: float | None = None
    mem_comm_work_ratio: float = 4.0
    dp_threshold_gib: float = 0.0
    memory_cap_gib: float = 60.0
    max_search_iter: int = 20


def cluster_bw_ratio(cluster: ClusterSpec, per_node: bool) -> float:
    """Memory over exchange bandwidth of one bucket: a GPU's HBM over its NVLink (one
    direction), or a node's HBM over its NICs."""
    hbm = cluster.gpu.hbm_bandwidth_GBps * 1e9
    if per_node:
        return cluster.gpus_per_node * hbm / (cluster.nics_per_node * cluster.nic_Gbps * 1e9 / 8)
    return hbm / (cluster.nvlink_GBps * 1e9 / 2)


@dataclasses.dataclass
class _State:
    """Shard counts per table and the shards placed per bucket."""

    splits: np.ndarray  # [T] shards per table (0 for a replicated table)
    buckets: list[list[int]]  # table ids held by each bucket


def _bucket_costs(state: _State, hotness, shard_cost):
    """Cost of every bucket: its lookups plus ``shard_cost`` per shard held."""
    out = np.zeros(len(state.buckets))
    for b, held in enumerate(state.buckets):
        out[b] = sum(hotness[t] / state.splits[t] for t in held) + shard_cost * len(held)
    return out


def _hottest_first(state: _State, hotness) -> list:
    """The sharded tables, hottest shard first (ties by table id)."""
    return sorted(np.flatnonzero(state.splits), key=lambda t: (-hotness[t] / state.splits[t], t))


def _place(state: _State, hotness, table_gib, shard_cost, cap):
    """Place every shard, hottest first, into the cheapest bucket with room and without a
    shard of its table. Returns the table whose shard fits nowhere, or None."""
    state.buckets = [[] for _ in state.buckets]
    shards = [t for t in _hottest_first(state, hotness) for _ in range(int(state.splits[t]))]
    costs = np.zeros(len(state.buckets))
    memory = np.zeros(len(state.buckets))
    for t in shards:
        size = table_gib[t] / state.splits[t]
        for b in np.argsort(costs, kind="stable"):
            if t not in state.buckets[b] and memory[b] + size <= cap:
                state.buckets[b].append(t)
                costs[b] += hotness[t] / state.splits[t] + shard_cost
                memory[b] += size
                break
        else:
            return t
    return None


def _split(state: _State, t: int, n_buckets: int) -> bool:
    """Double table ``t``'s shards if there are buckets for them."""
    if state.splits[t] * 2 > n_buckets:
        return False
    state.splits[t] *= 2
    return True


def _split_hottest(state: _State, hotness, n_buckets: int) -> None:
    """Double the shards of the table with the hottest shard that can still be split."""
    for t in _hottest_first(state, hotness):
        if _split(state, t, n_buckets):
            return


def bucket_plan(hotness, table_gib, n_buckets: int, shard_cost: float, cap: float, cfg):
    """(shards per table, tables per bucket) of the planner; replicated tables have 0 shards.

    Args:
        hotness: lookups per sample of each table.
        table_gib: each table's size in the planner's GB.
        n_buckets: GPUs or nodes.
        shard_cost: cost of holding one shard.
        cap: GB a bucket may hold.
        cfg: a ``PlannerConfig``.
    """
    hotness, table_gib = np.asarray(hotness, float), np.asarray(table_gib, float)
    if table_gib.sum() / n_buckets > cap:
        raise ValueError(
            f"the tables ({table_gib.sum():.1f} GB) do not fit in {n_buckets} buckets of {cap} GB"
            " even split over all of them: use more GPUs or a larger memory_cap_gib"
        )
    replicated = table_gib < cfg.dp_threshold_gib
    cap = cap - table_gib[replicated].sum()
    if cap < 0:
        raise ValueError(
            f"dp_threshold_gib={cfg.dp_threshold_gib} replicates more than a bucket holds"
        )
    everywhere = _State(np.full(len(hotness), n_buckets), [list(range(len(hotness)))] * n_buckets)
    candidates = [(_bucket_costs(everywhere, hotness, shard_cost).max(), everywhere)]
    state = _State(np.where(replicated, 0, 1), [[] for _ in range(n_buckets)])
    for _ in range(cfg.max_search_iter):
        stuck = _place(state, hotness, table_gib, shard_cost, cap)
        if stuck is None:
            placed = _State(state.splits.copy(), [list(b) for b in state.buckets])
            candidates.append((_bucket_costs(placed, hotness, shard_cost).max(), placed))
            _split_hottest(state, hotness, n_buckets)
        elif not _split(state, stuck, n_buckets):
            break
    best = min(candidates, key=lambda c: c[0])[1]
    return best.splits, best.buckets


def plan(spec: DlrmSpec, cluster: ClusterSpec, n_gpus: int, cfg: PlannerConfig | None = None):
    """(split ``DlrmSpec``, ``TableChoice`` per table of it): HugeCTR's ``auto`` plan on one
    node, ``hier_auto`` on several (see the module docstring)."""
    cfg = cfg or PlannerConfig()
    g = min(cluster.gpus_per_node, n_gpus)
    per_node = n_gpus > g
    n_buckets = n_gpus // g if per_node else n_gpus
    ratio = cfg.mem_comm_bw_ratio or cluster_bw_ratio(cluster, per_node)
    shard_cost = ratio / cfg.mem_comm_work_ratio
    cap = cfg.memory_cap_gib * (g if per_node else 1)
    gib = [t.rows * t.dim * ADAGRAD_BYTES_PER_VALUE / GIB for t in spec.tables]
    hotness = [t.pooling for t in spec.tables]
    splits, buckets = bucket_plan(hotness, gib, n_buckets, shard_cost, cap, cfg)
    tables: list[TableSpec] = []
    choices: list[TableChoice] = []
    for t, table in enumerate(spec.tables):
        if splits[t] == 0:
            tables.append(table)
            choices.append(TableChoice(DP, 0))
            continue
        k = int(splits[t])
        for b in (b for b, held in enumerate(buckets) if t in held):
            name = table.name if k == 1 else f"{table.name}/{len(tables)}"
            rows = -(-table.rows // k)
            tables.append(
                dataclasses.replace(table, name=name, rows=rows, pooling=table.pooling / k)
            )
            choices.append(TableChoice(TWRW, b * g) if per_node else TableChoice(TW, b))
    return dataclasses.replace(spec, tables=tuple(tables)), tuple(choices)
