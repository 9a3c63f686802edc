"""Iteration time and memory of DLRM training with sharded embedding tables.

Each table is sharded one of ``SHARDING_TYPES`` ways over ``R`` ranks (``G`` per node):

* ``table_wise``: the whole table on one rank, which looks up every sample's rows;
* ``row_wise``: rows split evenly over all ranks (hashed ids: each rank serves ``1 / R`` of the
  lookups); every rank sends partial pooled sums of all samples (a reduce-scatter);
* ``column_wise``: ``dim / COLUMN_SHARD_DIM`` column shards on consecutive ranks from the
  placement rank, each looking up every sample's narrower rows;
* ``table_row_wise``: rows split over the ``G`` ranks of one node, partial sums reduced inside
  the node first (a reduce-scatter over NVLink), then sent;
* ``data_parallel``: replicated on every rank; each rank looks up its own samples, the table's
  gradient joins the dense all-reduce and every rank updates the whole table.

A plan gives each table a probability vector over the types ``[T, K]`` and over the
placement ranks ``[T, R]`` (one-hot for a discrete plan; the relaxed search moves them
continuously). Every per-rank quantity (lookup seconds, bytes sent, bytes held) is linear in
those probabilities, so a one-hot plan costs exactly its discrete value.

Per iteration:

``T = max_r lookup_fwd_r + 2 max_r comm_r + dense_fwd + dense_bwd
      + max(max_r lookup_bwd_r, all_reduce) + launches``

* lookups (Lin et al.): bytes of the rows read over the bandwidth of a cache/HBM mix whose
  L2 share is ``dlrm.cache_hit_rate`` of the shard's rows; a random row read moves
  ``ROW_ACCESS_BYTES`` more than the row. The backward's fused optimizer reads and writes each
  looked-up row and its optimizer state;
* comm: the all-to-all of pooled embeddings (forward) and of their gradients (backward,
  the same volumes reversed, ``dlrm.exchange_bytes`` per value) on
  ``comm.all_to_all_links_s``, each rank at its own send and receive volume; table-row-wise
  adds its intra-node reduce-scatter;
* the dense part (bottom MLP, interaction, top MLP) runs data parallel on ``B / R`` samples
  per rank (``kernels.gemm_s``), its gradients (and those of data-parallel tables) all-reduced
  in ``dlrm.grad_bytes`` per value during the embedding backward;
* the slowest rank sets each phase (``smooth.smooth_max`` over ranks).

``DlrmBreakdown.forward_s`` is the forward pass alone (forward lookups, one all-to-all, the
dense forward and its kernels): what a forward-only pass such as an evaluation costs.

Memory per rank: its table shards with their optimizer state (replicated tables whole, with a
gradient buffer), the dense part's parameters, gradients and Adagrad state, activations, the
all-to-all buffers and ``simulate.RUNTIME_RESERVE_BYTES``.

References:
    Lin et al., "Building a Performance Model for Deep Learning Recommendation Model Training
    on GPUs" (HiPC 2022); TorchRec's sharding types and planner (pytorch/torchrec).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import comm, kernels, population, smooth
from diffcost.arrays import ClusterArrays, cluster_arrays
from diffcost.dlrm import L2_TO_HBM_BANDWIDTH, DlrmArrays, DlrmSpec, cache_hit_rate, dlrm_arrays
from diffcost.params import Params
from diffcost.simulate import RUNTIME_RESERVE_BYTES
from diffcost.specs import ClusterSpec

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
TW, RW, CW, TWRW, DP = range(len(SHARDING_TYPES))
COLUMN_SHARD_DIM = 32  # columns per column-wise shard (a table of dim 128: 4 shards)
ROW_ACCESS_BYTES = 32.0  # a random row read moves one more 32-byte sector on average
GRAD_BYTES = 4.0  # fp32 gradient buffers of the dense part and replicated tables (memory)
DENSE_STATE = 1.0  # Adagrad state per dense parameter
ACTIVATION_BYTES = 2.0
# Kernels per GEMM per iteration: its forward, dgrad and wgrad, each with an elementwise pass.
LAUNCHES_PER_GEMM = 6
LAUNCHES_FIXED = 8  # lookup forward and backward, all-to-alls, all-reduce, optimizer
LAUNCHES_PER_GEMM_FWD = 2  # of those, the forward GEMM and its elementwise pass
LAUNCHES_FIXED_FWD = 2  # the forward lookup and all-to-all


@struct.dataclass
class RankLayout:
    """How placement probabilities spread over ranks (constants of a problem).

    ``column_mask[t, j]``: 1 where table ``t`` has a ``j``-th column shard (placed ``j`` ranks
    after its placement rank, wrapping around); ``column_shards[t]``: its column shards.
    Ranks ``[i G, (i + 1) G)`` form node ``i``.
    """

    column_mask: jax.Array
    column_shards: jax.Array
    n_ranks: int = struct.field(pytree_node=False)
    gpus_per_node: int = struct.field(pytree_node=False)


@struct.dataclass
class ShardingProblem:
    """Everything the cost of a sharding plan depends on, as arrays (one configuration)."""

    model: DlrmArrays
    cluster: ClusterArrays
    params: Params
    layout: RankLayout
    # for a cluster that takes the population's median: its members with a leading axis
    # (``population.constants_for``), which ``plan_cost`` prices instead of ``params``
    members: Params | None = None


@struct.dataclass
class ShardingPlan:
    """Per-table probabilities: ``types [T, K]`` over ``SHARDING_TYPES``, ``ranks [T, R]`` over
    placement ranks (the node of a table-row-wise table is its rank's node; row-wise and data-
    parallel tables ignore theirs). One-hot rows are a discrete plan."""

    types: jax.Array
    ranks: jax.Array


@struct.dataclass
class DlrmBreakdown:
    """Cost of one plan: seconds per iteration and its parts, memory per rank."""

    iteration_s: jax.Array
    lookup_fwd_s: jax.Array  # slowest rank's forward lookups
    lookup_bwd_s: jax.Array  # slowest rank's backward lookups and table updates
    comm_s: jax.Array  # forward and backward all-to-alls (slowest rank each)
    dense_s: jax.Array  # dense forward and backward on one rank
    all_reduce_s: jax.Array  # dense and replicated-table gradients
    forward_s: jax.Array  # the forward pass alone (lookups, all-to-all, dense, its launches)
    rank_lookup_s: jax.Array  # [R] forward + backward lookups per rank
    rank_memory_bytes: jax.Array  # [R]
    memory_peak_bytes: jax.Array
    memory_capacity_bytes: jax.Array

    # the time parts (``population.median_breakdown`` scales them with the time)
    TIME_PARTS = (
        "lookup_fwd_s",
        "lookup_bwd_s",
        "comm_s",
        "dense_s",
        "all_reduce_s",
        "forward_s",
        "rank_lookup_s",
    )


def column_shards(dim: int) -> int:
    """Column shards of a table of width ``dim`` placed column-wise."""
    return max(1, dim // COLUMN_SHARD_DIM)


def rank_layout(dims, n_ranks: int, gpus_per_node: int, dtype=None) -> RankLayout:
    """The ``RankLayout`` of tables of widths ``dims`` on ``n_ranks`` ranks, ``gpus_per_node``
    per node (a group smaller than a node sits in one node)."""
    dtype = dtype or jnp.result_type(float)
    g = min(gpus_per_node, n_ranks)
    if n_ranks % g:
        raise ValueError(
            f"n_gpus={n_ranks} is invalid: expected a multiple of gpus_per_node={g} (whole nodes)"
        )
    shards = np.array([column_shards(int(d)) for d in dims])
    mask = np.arange(shards.max())[None, :] < shards[:, None]
    return RankLayout(
        column_mask=np.asarray(mask, dtype),
        column_shards=np.asarray(shards, dtype),
        n_ranks=n_ranks,
        gpus_per_node=g,
    )


def make_problem(
    spec: DlrmSpec, cluster: ClusterSpec, n_gpus: int, params: Params, dtype=None, members=None
):
    """The ``ShardingProblem`` of ``spec`` on ``n_gpus`` GPUs of ``cluster`` (``members``: the
    population's, with a leading axis, for a cluster without a profile of its own)."""
    dtype = dtype or jnp.result_type(float)
    if not isinstance(n_gpus, int) or isinstance(n_gpus, bool) or n_gpus < 1:
        raise ValueError(f"n_gpus={n_gpus!r} is invalid: expected a positive integer")
    if spec.batch_size % n_gpus:
        raise ValueError(
            f"{spec.name}: batch_size={spec.batch_size} is not divisible by n_gpus={n_gpus}"
            " (every rank trains the same number of samples)"
        )
    layout = rank_layout([t.dim for t in spec.tables], n_gpus, cluster.gpus_per_node, dtype)
    return ShardingProblem(
        model=dlrm_arrays(spec, cluster, dtype),
        cluster=cluster_arrays(cluster, dtype),
        params=params,
        layout=layout,
        members=members,
    )


# ------------------------------------------------------------------------------------------
# Per table and sharding type: totals that do not depend on placement
# ------------------------------------------------------------------------------------------


@struct.dataclass
class TableCosts:
    """Placement-independent totals per table and type ``[T, K]`` (``dp_update_s`` ``[T]``)."""

    lookup_fwd_s: jax.Array  # forward lookup seconds summed over the ranks holding shards
    lookup_bwd_s: jax.Array
    send_bytes: jax.Array  # [T] pooled bytes a rank holding all of a table sends to others
    recv_bytes: jax.Array  # bytes every rank receives
    memory_bytes: jax.Array  # bytes summed over the ranks holding shards
    dp_update_s: jax.Array  # [T] a replicated table's update on every rank


def table_costs(problem: ShardingProblem) -> TableCosts:
    """``TableCosts`` of every table under every sharding type (see the module docstring)."""
    m, c, p, lay = problem.model, problem.cluster, problem.params, problem.layout
    t = m.tables
    n, g = float(lay.n_ranks), float(lay.gpus_per_node)
    e = m.embedding_bytes
    ones = jnp.ones_like(t.rows)
    shard_rows = jnp.stack([t.rows, t.rows / n, t.rows, t.rows / g, t.rows], axis=-1)
    shard_dim = jnp.stack([t.dim, t.dim, t.dim / lay.column_shards, t.dim, t.dim], axis=-1)
    copies = jnp.stack([ones, ones, lay.column_shards, ones, ones], axis=-1)
    row_bytes = shard_dim * e
    hit = cache_hit_rate(shard_rows, row_bytes, t.zipf[:, None], m.l2_bytes)
    hbm_Bps = c.hbm_Bps * p.mem_eff
    bandwidth = 1.0 / (hit / (L2_TO_HBM_BANDWIDTH * hbm_Bps) + (1.0 - hit) / hbm_Bps)
    lookups = (m.batch * t.pooling)[:, None] * copies
    fwd = lookups * (row_bytes + ROW_ACCESS_BYTES) / bandwidth
    bwd = 2.0 * (1.0 + m.optimizer_state) * fwd  # read and write the row and its state
    pooled = m.batch * t.dim * m.exchange_bytes  # one pooled vector per sample
    others = (n - 1.0) / n
    local = pooled / n
    recv = jnp.stack([local * others, local * (n - 1.0), local * others, local * others, 0 * t.dim])
    params_bytes = t.rows * t.dim * e * (1.0 + m.optimizer_state)
    memory = jnp.stack([params_bytes] * 4 + [params_bytes + t.rows * t.dim * GRAD_BYTES], -1)
    update = kernels.memory_bound_s(2.0 * params_bytes, c, p)
    return TableCosts(fwd, bwd, pooled * others, recv.T, memory, update)


# ------------------------------------------------------------------------------------------
# Per rank
# ------------------------------------------------------------------------------------------


def shares(plan: ShardingPlan, layout: RankLayout):
    """(work, memory, send) shares ``[T, K, R]``: the fraction of a table's lookups, bytes
    and pooled output that each rank holds under each type, given the placement ``ranks``."""
    pi = plan.ranks
    n, g = layout.n_ranks, layout.gpus_per_node
    col = sum(
        layout.column_mask[:, j, None] * jnp.roll(pi, j, axis=-1)
        for j in range(layout.column_mask.shape[1])
    )
    col = col / layout.column_shards[:, None]
    node = node_total(pi, layout) / g
    even = jnp.full_like(pi, 1.0 / n)
    work = jnp.stack([pi, even, col, node, even], axis=1)
    memory = jnp.stack([pi, even, col, node, jnp.ones_like(pi)], axis=1)
    send = jnp.stack([pi, jnp.ones_like(pi), col, node, jnp.zeros_like(pi)], axis=1)
    return work, memory, send


def node_total(x, layout: RankLayout):
    """``x [..., R]`` summed over each node's ranks, repeated on every rank of the node."""
    n, g = layout.n_ranks, layout.gpus_per_node
    per_node = jnp.sum(x.reshape(*x.shape[:-1], n // g, g), axis=-1)
    return jnp.repeat(per_node, g, axis=-1)


def _a2a_s(others_bytes, links: comm.GroupLinks, params: Params):
    """All-to-all time of a rank moving ``others_bytes`` to (or from) the other ranks evenly."""
    n = links.group.size
    return comm.all_to_all_links_s(others_bytes * smooth.safe_div(n, n - 1.0), links, params)


def _dense_s(problem: ShardingProblem, temperature):
    """(forward, backward) seconds of the dense part on one rank's ``B / R`` samples."""
    m, c, p = problem.model, problem.cluster, problem.params
    b = m.batch / problem.layout.n_ranks
    rate = jnp.maximum(jnp.sum(m.precision * c.peak_flops * p.gemm_eff), 1.0)
    n, k = m.gemms[:, 0], m.gemms[:, 1]
    fwd = kernels.gemm_s(b, n, k, rate, c, p, temperature)
    bwd = kernels.gemm_s(b, k, n, rate, c, p, temperature) + kernels.gemm_s(
        k, n, b, rate, c, p, temperature
    )
    elementwise = kernels.memory_bound_s(b * m.elementwise_bytes, c, p)
    return jnp.sum(fwd) + elementwise, jnp.sum(bwd) + 2.0 * elementwise


def _rank_memory(problem, plan, costs, mem_share, send_r):
    """Bytes held by each rank ``[R]``."""
    m = problem.model
    tables = jnp.einsum("tk,tk,tkr->r", plan.types, costs.memory_bytes, mem_share)
    dense = m.dense_params * (4.0 + GRAD_BYTES + 4.0 * DENSE_STATE)
    b = m.batch / problem.layout.n_ranks
    widths = jnp.sum(m.gemms[:, 0])
    activations = 2.0 * b * (widths + m.elementwise_bytes / ACTIVATION_BYTES) * ACTIVATION_BYTES
    buffers = 2.0 * (send_r + jnp.sum(plan.types * costs.recv_bytes))  # outputs and gradients
    return tables + dense + activations + buffers + RUNTIME_RESERVE_BYTES


def dlrm_cost(problem: ShardingProblem, plan: ShardingPlan, temperature=0.0) -> DlrmBreakdown:
    """Iteration time and memory of one (possibly relaxed) sharding plan.

    Args:
        problem: from ``make_problem``.
        plan: per-table probabilities (one-hot for a discrete plan: ``one_hot_plan``).
        temperature: softness of the maxima over ranks and of the kernels' rooflines (static;
            0 is exact).

    Returns:
        A ``DlrmBreakdown``.
    """
    lay, m, c, p = problem.layout, problem.model, problem.cluster, problem.params
    costs = table_costs(problem)
    work, mem_share, send_share = shares(plan, lay)
    w = plan.types
    fwd_r = jnp.einsum("tk,tk,tkr->r", w, costs.lookup_fwd_s, work)
    bwd_r = jnp.einsum("tk,tk,tkr->r", w, costs.lookup_bwd_s, work)
    bwd_r = bwd_r + jnp.sum(w[:, DP] * costs.dp_update_s)
    send_r = jnp.einsum("tk,t,tkr->r", w, costs.send_bytes, send_share)
    recv = jnp.sum(w * costs.recv_bytes)
    world = comm.place(float(lay.n_ranks), 1.0, c.gpus_per_node)
    links = comm.group_links(world, c, p, temperature)
    a2a_r = smooth.smax2(_a2a_s(send_r, links, p), _a2a_s(recv, links, p), temperature)
    node_bytes = (w[:, TWRW] * m.batch * m.tables.dim * m.exchange_bytes) @ node_total(
        plan.ranks, lay
    )
    node_group = comm.place(float(lay.gpus_per_node), 1.0, c.gpus_per_node)
    comm_r = a2a_r + comm.reduce_scatter_s(node_bytes, node_group, c, p, temperature)
    grad_bytes = m.grad_bytes * (m.dense_params + jnp.sum(w[:, DP] * m.tables.rows * m.tables.dim))
    all_reduce = comm.all_reduce_s(grad_bytes, world, c, p, temperature)
    dense_fwd, dense_bwd = _dense_s(problem, temperature)
    lookup_fwd = smooth.smooth_max(fwd_r, temperature=temperature)
    lookup_bwd = smooth.smooth_max(bwd_r, temperature=temperature)
    comm_s = 2.0 * smooth.smooth_max(comm_r, temperature=temperature)
    launches = (LAUNCHES_PER_GEMM * m.gemms.shape[0] + LAUNCHES_FIXED) * p.kernel_overhead_s
    launches_fwd = (LAUNCHES_PER_GEMM_FWD * m.gemms.shape[0] + LAUNCHES_FIXED_FWD) * (
        p.kernel_overhead_s
    )
    iteration = (
        lookup_fwd
        + comm_s
        + dense_fwd
        + dense_bwd
        + smooth.smax2(lookup_bwd, all_reduce, temperature)
        + launches
    )
    memory_r = _rank_memory(problem, plan, costs, mem_share, send_r)
    return DlrmBreakdown(
        iteration_s=iteration,
        lookup_fwd_s=lookup_fwd,
        lookup_bwd_s=lookup_bwd,
        comm_s=comm_s,
        dense_s=dense_fwd + dense_bwd,
        all_reduce_s=all_reduce,
        forward_s=lookup_fwd + 0.5 * comm_s + dense_fwd + launches_fwd,
        rank_lookup_s=fwd_r + bwd_r,
        rank_memory_bytes=memory_r,
        memory_peak_bytes=smooth.smooth_max(memory_r, temperature=temperature),
        memory_capacity_bytes=c.memory_bytes,
    )


def plan_cost(problem: ShardingProblem, plan: ShardingPlan, temperature=0.0) -> DlrmBreakdown:
    """``dlrm_cost`` with the problem's constants, or where it has ``members`` their median
    (``population.median_breakdown``: the exponential of their mean log time, the parts
    rescaled to it), which the search minimizes and the command reports."""
    if problem.members is None:
        return dlrm_cost(problem, plan, temperature)
    each = jax.vmap(lambda p: dlrm_cost(problem.replace(params=p), plan, temperature))
    return population.median_breakdown(each(problem.members))


# ------------------------------------------------------------------------------------------
# Discrete plans
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TableChoice:
    """One table's discrete choice: a sharding type (index into ``SHARDING_TYPES``) and a
    placement rank (0 where the type ignores it; the first rank of the node for table-row-
    wise)."""

    kind: int
    rank: int

    def __str__(self):
        name = SHARDING_TYPES[self.kind]
        return name if self.kind in (RW, DP) else f"{name}@{self.rank}"


def canonical(kind: int, rank: int, layout: RankLayout) -> TableChoice:
    """The ``TableChoice`` that ``(kind, rank)`` is equivalent to."""
    if kind in (RW, DP):
        return TableChoice(kind, 0)
    if kind == TWRW:
        return TableChoice(kind, rank - rank % layout.gpus_per_node)
    return TableChoice(kind, rank)


def options(layout: RankLayout) -> list[TableChoice]:
    """Every distinct choice of one table on ``layout``."""
    kinds, ranks = range(len(SHARDING_TYPES)), range(layout.n_ranks)
    out = {canonical(k, r, layout) for k in kinds for r in ranks}
    return sorted(out, key=lambda o: (o.kind, o.rank))


def one_hot_plan(choices, layout: RankLayout, dtype=None) -> ShardingPlan:
    """The one-hot ``ShardingPlan`` of ``choices`` (a ``TableChoice`` per table, or None for a
    table left out: all-zero rows, which cost nothing)."""
    dtype = dtype or jnp.result_type(float)
    types = np.zeros((len(choices), len(SHARDING_TYPES)), dtype)
    ranks = np.zeros((len(choices), layout.n_ranks), dtype)
    for t, ch in enumerate(choices):
        if ch is not None:
            types[t, ch.kind] = 1.0
            ranks[t, ch.rank] = 1.0
    return ShardingPlan(types=types, ranks=ranks)


def fits(out: DlrmBreakdown):
    """Whether a (batch of) evaluated plans fits in memory (exact evaluation: temperature 0)."""
    return np.asarray(out.memory_peak_bytes) <= np.asarray(out.memory_capacity_bytes)
