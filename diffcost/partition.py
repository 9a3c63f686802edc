"""partition: uneven pipeline stages and per-stage recompute; the model and the exact DP.

The simulator puts ``n_layers / pp`` layers on every stage. Real pipelines are uneven: the
embedding sits on the first stage, the LM head and loss on the last, and under 1F1B stage ``s``
holds ``min(p - s, m)`` microbatches of activations while the last holds one. The best partition
therefore puts fewer layers, or more recomputation, where memory is tight. This module turns
one plan into a small discrete problem (``PartitionProblem``) and solves it exactly
(``solve_dp``, dynamic programming over contiguous partitions); ``diffcost.partition_search``
solves it by gradients and by coordinate descent, and ``benchmarks/partition_compare.py``
times the three on the benchmark case (GPT-3 175B on Selene).

The model of one partition (``layers[s]`` layers and ``recompute[s]`` fully recomputed layers on
stage ``s``; ``[.]`` is 1 where the condition holds):

* stage work, one microbatch forward + backward:
  ``W_s = layers_s lw + recompute_s rc + [s = 0] first + [s = p-1] last``;
* iteration: ``T = sum_s W_s + (m - 1) max_s W_s + 2 (p - 1) send + rest``: the pipeline
  latency Alpa's inter-operator DP minimizes (Zheng et al. 2022, section 5.1), plus the fill
  and drain sends and the partition-independent rest of the iteration;
* memory: ``M_s = static(layers_s) + in_flight_s ((layers_s - recompute_s) act
  + recompute_s act_rc) + [recompute_s > 0] act + fixed``, feasible when every
  ``M_s <= capacity`` (``static`` includes the embedding on the first stage and the LM head
  and logits on the last).

Recompute only costs time and each stage's memory depends only on its own choice, so for a
stage with ``n`` layers the best recompute count is the smallest that fits: every solver uses
that rule, tabulated once by ``stage_tables``.

Limits: ``T`` is Alpa's pipeline model, not the simulator's 1F1B closed form (which adds the
round trip through the pipeline when warm-up leaves no slack: 0.4% more on the uniform benchmark
plan); it equals the simulator's GPipe form whenever the last stage bounds both forward and
backward. ``rest`` (exposed DP sync, optimizer) is taken from the uniform plan
without recompute and held fixed, while in the simulator it shrinks when recompute lengthens
the backward that hides the gradient buckets (0.7% of ``T`` for GPT-3 on 8 stages with every
layer recomputed) and grows with the largest stage's optimizer shard.

References:
    Zheng et al., "Alpa: Automating Inter- and Intra-Operator Parallelism for Distributed Deep
    Learning" (OSDI'22), section 5 (pipeline latency and the DP over stage partitions, with
    the enumeration of the bottleneck bound ``t_max``). Narayanan et al., "Efficient
    Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21), the 1F1B
    schedule and its in-flight microbatches. Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models" (MLSys'23), activation memory with and without
    recompute.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffcost import config, workload
from diffcost.arrays import GiB, cluster_arrays, model_arrays, plan_arrays
from diffcost.params import Params
from diffcost.simulate import memory, pipeline_time, stage_times
from diffcost.specs import ClusterSpec, ModelSpec, PlanSpec


@struct.dataclass
class PartitionProblem:
    """One plan's pipeline partition problem, in seconds and bytes (numpy float leaves).

    Times are per microbatch on one GPU; memory is per GPU. ``in_flight`` has shape
    ``[n_stages]``; every other leaf is a scalar. Build it with ``problem_for`` (from the
    simulator) or directly (tests, other cost models).
    """

    layer_s: np.ndarray  # forward + backward of one layer, no recompute
    recompute_layer_s: np.ndarray  # extra time of one fully recomputed layer
    first_stage_s: np.ndarray  # extra work of the first stage (embedding)
    last_stage_s: np.ndarray  # extra work of the last stage (LM head and loss)
    layer_static_bytes: np.ndarray  # weights + grads + optimizer states of one layer
    first_static_bytes: np.ndarray  # extra static memory of the first stage (embedding)
    last_static_bytes: np.ndarray  # extra memory of the last stage (LM head, logits)
    layer_act_bytes: np.ndarray  # activations one layer keeps for one microbatch
    layer_act_recompute_bytes: np.ndarray  # the same under full recompute (the layer input)
    in_flight: np.ndarray  # [n_stages] microbatches whose activations a stage holds at peak
    fixed_bytes: np.ndarray  # buffers, runtime reserve (and ZeRO-3 gathered layers)
    capacity_bytes: np.ndarray
    n_microbatches: np.ndarray
    send_s: np.ndarray  # one activation send between adjacent stages
    rest_s: np.ndarray  # DP tail, drain NIC sharing, optimizer, overhead: partition-independent
    n_layers: int = struct.field(pytree_node=False)

    @property
    def n_stages(self) -> int:
        return int(np.shape(self.in_flight)[0])


class Partition(NamedTuple):
    """A solution: layers and recomputed layers per stage (int arrays [p]), iteration time."""

    layers: np.ndarray
    recompute: np.ndarray
    time_s: float


class InfeasiblePartitionError(ValueError):
    """No partition fits in memory, even with every layer recomputed.

    ``min_peak_bytes`` is the smallest peak memory any partition reaches and ``layers`` a
    partition that reaches it (recomputing wherever that saves memory).
    """

    def __init__(self, problem: PartitionProblem, min_peak_bytes: float, layers: np.ndarray):
        self.min_peak_bytes = float(min_peak_bytes)
        self.layers = layers
        cap = float(problem.capacity_bytes)
        super().__init__(
            f"no partition of {problem.n_layers} layers over {problem.n_stages} stages fits in "
            f"capacity_bytes={cap:.4g} ({cap / GiB:.2f} GiB): the smallest peak memory "
            f"reachable, recomputing wherever it saves memory, is {self.min_peak_bytes:.4g} bytes "
            f"({self.min_peak_bytes / GiB:.2f} GiB, layers {layers.tolist()}); use more "
            "pipeline stages, a smaller microbatch, more tensor parallelism or a ZeRO stage"
        )


# --- from the simulator -------------------------------------------------------------------------
def _numpy_float(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def problem_for(
    model_spec: ModelSpec,
    plan_spec: PlanSpec,
    cluster_spec: ClusterSpec,
    params: Params,
) -> PartitionProblem:
    """The partition problem of a plan, read off the simulator at temperature 0.

    Every coefficient comes from ``simulate.stage_times``, ``simulate.pipeline_time`` and
    ``simulate.memory`` (or the workload functions they call), so the problem follows the
    simulator when its cost model changes. With ``L = n_layers / pp`` layers on every stage of
    the simulator's uniform plan and ``W_k = fwd_s[k] + bwd_s[k]`` for the stage kinds
    ``k = first, middle, last``:

    * ``layer_s = (W_middle - h) / L`` at recompute none, with ``h`` the host step every stage
      runs per microbatch; ``recompute_layer_s`` the difference of
      ``W_middle / L`` between recompute full and none (one extra forward per layer);
    * ``first_stage_s = W_first - W_middle`` (embedding forward + backward),
      ``last_stage_s = W_last - W_middle`` (LM head, loss and its all-reduce);
    * ``send_s = p2p_s``; ``rest_s`` = exposed DP sync + (sends - ``2 (p - 1) send``, i.e. the
      drain's NIC sharing with DP buckets) + optimizer + overhead of the uniform 1F1B plan,
      + ``(p + m - 1) h`` (the host step in ``sum W + (m - 1) max W``), so that ``T`` is an
      iteration time. It is held constant: in the simulator the DP tail
      and the optimizer step scale with the first stage's layers, which this neglects;
    * static memory ``S_k(L)`` = weights + grads + optimizer states of stage kind ``k``:
      ``layer_static_bytes = S_first(L + 1) - S_first(L)`` on a copy of the model without
      vocabulary (no embedding, head or logits), ``first_static_bytes`` the first stage's
      difference with and without vocabulary (embedding), ``last_static_bytes`` the last
      stage's difference of static + activation memory with and without vocabulary (LM head
      copy and fp32 logits);
    * ``layer_act_bytes``, ``layer_act_recompute_bytes``: ``workload.layer_activation_bytes``
      for recompute none and full (what ``simulate.memory`` multiplies by layers and
      in-flight microbatches);
    * ``fixed_bytes`` = buffers + runtime reserve of the uniform plan, plus what is left of the
      vocabulary-free first stage's static memory after ``L`` layers (ZeRO-3's two gathered
      layers). The gradient buffers are ``2 min(4 layers dense, DP_BUCKET_BYTES)``: constant
      whenever one layer's fp32 gradients exceed the bucket (every model of interest);
    * ``in_flight[s] = min(p - s, m)`` (1F1B), ``capacity_bytes`` the GPU memory.

    Args:
        model_spec, plan_spec, cluster_spec: the specs (``diffcost.config`` loaders). The plan's
            ``recompute`` and ``recompute_fraction`` are ignored (the problem chooses them per
            stage); its schedule must be ``1f1b`` and ``pp >= 2``.
        params: calibrated constants (e.g. ``diffcost.profiles.params_for(cluster)[0]``).

    Returns:
        A ``PartitionProblem`` with float64 numpy leaves (computed at JAX's default precision).

    Raises:
        ValueError: for a schedule other than 1f1b or fewer than two stages;
            ``config.ConfigError`` (a ValueError) where ``config.check_plan`` (not strict:
            ``n_layers`` need not divide by ``pp``) finds the plan invalid.
    """
    if plan_spec.schedule != "1f1b" or plan_spec.chunks != 1:
        raise ValueError(
            f"schedule={plan_spec.schedule!r}, chunks={plan_spec.chunks}: the partition problem "
            "models the 1f1b schedule with chunks=1"
        )
    if not 2 <= plan_spec.pp <= model_spec.n_layers:
        raise ValueError(
            f"pp={plan_spec.pp}: partitioning needs 2 to n_layers={model_spec.n_layers} stages"
        )
    problems = config.check_plan(model_spec, cluster_spec, plan_spec, strict=False)
    if problems:
        raise config.ConfigError("invalid plan:\n  - " + "\n  - ".join(problems))
    plan_none = dataclasses.replace(plan_spec, recompute="none", recompute_fraction=1.0)
    plan_full = dataclasses.replace(plan_spec, recompute="full", recompute_fraction=1.0)
    model, cluster = model_arrays(model_spec), cluster_arrays(cluster_spec)
    plan, plan_rc = plan_arrays(plan_none), plan_arrays(plan_full)
    dtype = model.n_layers.dtype
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype=dtype), params)
    terms = jax.tree_util.tree_map(
        _numpy_float, _simulator_terms(model, plan, plan_rc, cluster, params)
    )
    per_stage = model_spec.n_layers / plan_spec.pp
    p = plan_spec.pp
    work, work_rc = terms["work"], terms["work_rc"]
    send = terms["send"]
    m = terms["n_microbatches"]
    # The per-microbatch host step is on every stage whatever its layers: it adds the same
    # ``(p + m - 1) step`` to every partition's time.
    step = terms["host_step"]
    rest = (
        terms["dp_exposed"]
        + (terms["sends"] - 2.0 * (p - 1) * send)
        + terms["optimizer"]
        + terms["overhead"]
        + (p + m - 1.0) * step
    )
    static, act, buffers = terms["static"], terms["act"], terms["buffers"]
    static_nv, act_nv, static_more = terms["static_nv"], terms["act_nv"], terms["static_more"]
    layer_static = static_more[0] - static_nv[0]
    act_modes = terms["act_modes"]
    return PartitionProblem(
        layer_s=(work[1] - step) / per_stage,
        recompute_layer_s=(work_rc[1] - work[1]) / per_stage,
        first_stage_s=work[0] - work[1],
        last_stage_s=work[2] - work[1],
        layer_static_bytes=layer_static,
        first_static_bytes=static[0] - static_nv[0],
        last_static_bytes=(static[1] + act[1]) - (static_nv[1] + act_nv[1]),
        layer_act_bytes=act_modes[0],
        layer_act_recompute_bytes=act_modes[2],
        in_flight=np.minimum(p - np.arange(p, dtype=np.float64), m),
        fixed_bytes=buffers[0] + (static_nv[0] - per_stage * layer_static),
        capacity_bytes=_numpy_float(cluster.memory_bytes),
        n_microbatches=m,
        send_s=send,
        rest_s=rest,
        n_layers=int(model_spec.n_layers),
    )


def _simulator_terms(model, plan, plan_rc, cluster, params) -> dict:
    """The simulator's quantities ``problem_for`` reads, at temperature 0.

    Evaluated eagerly: it runs once per problem, and compiling it costs more than running it.

    ``plan`` has recompute none and ``plan_rc`` full; memory is evaluated for the model, the
    model without vocabulary (``_nv``) and that with one more layer per stage (``_more``).
    """
    st = stage_times(model, plan, cluster, params, 0.0)
    st_rc = stage_times(model, plan_rc, cluster, params, 0.0)
    _, _, sends, dp_exposed = pipeline_time(st, 0.0)
    no_vocab = model.replace(vocab=jnp.zeros_like(model.vocab))
    one_more = no_vocab.replace(n_layers=model.n_layers + plan.pp)

    def stage_memory(m):  # (static [first, last], activations [first, last], buffers [2])
        w, g, o, a, buf = memory(m, plan, cluster, 0.0)
        return w + g + o, a, buf

    static, act, buffers = stage_memory(model)
    static_nv, act_nv, _ = stage_memory(no_vocab)
    static_more, _, _ = stage_memory(one_more)
    return dict(
        work=st.fwd_s + st.bwd_s,
        work_rc=st_rc.fwd_s + st_rc.bwd_s,
        sends=sends,
        dp_exposed=dp_exposed,
        send=st.p2p_s,
        optimizer=st.optimizer_s,
        overhead=st.overhead_s,
        host_step=st.microbatch_overhead_s,
        static=static,
        act=act,
        buffers=buffers,
        static_nv=static_nv,
        act_nv=act_nv,
        static_more=static_more,
        act_modes=workload.layer_activation_bytes(model, plan),
        n_microbatches=plan.n_microbatches,
    )


# --- the exact model ----------------------------------------------------------------------------
def stage_ends(problem: PartitionProblem, stage, first, last, where=np.where):
    """``first`` on stage 0 and ``last`` on stage p - 1 (both on one stage when p = 1)."""
    return where(stage == 0, first, 0.0) + where(stage == problem.n_stages - 1, last, 0.0)


def stage_work_s(problem: PartitionProblem, stage, layers, recompute, where=np.where):
    """``W`` of stage index ``stage`` (broadcasts) with ``layers`` and ``recompute``."""
    return (
        layers * problem.layer_s
        + recompute * problem.recompute_layer_s
        + stage_ends(problem, stage, problem.first_stage_s, problem.last_stage_s, where)
    )


def _stage_memory_bytes(problem: PartitionProblem, stage, layers, recompute):
    """``M`` of stage index ``stage`` (broadcasts) with ``layers`` and ``recompute``."""
    in_flight = np.asarray(problem.in_flight)[stage]
    static = layers * problem.layer_static_bytes + stage_ends(
        problem, stage, problem.first_static_bytes, problem.last_static_bytes
    )
    act = in_flight * (
        (layers - recompute) * problem.layer_act_bytes
        + recompute * problem.layer_act_recompute_bytes
    )
    # recomputing a layer rebuilds its full activations for one microbatch at a time
    return static + act + (recompute > 0) * problem.layer_act_bytes + problem.fixed_bytes


def _pipeline_time_s(problem: PartitionProblem, work):
    """``T`` from stage works ``work`` [..., p] (Alpa's pipeline latency + sends + rest)."""
    p, m = problem.n_stages, float(problem.n_microbatches)
    return (
        np.sum(work, axis=-1)
        + (m - 1.0) * np.max(work, axis=-1)
        + 2.0 * (p - 1) * float(problem.send_s)
        + float(problem.rest_s)
    )


def evaluate(problem: PartitionProblem, layers, recompute):
    """Exact iteration time and per-stage memory of a partition.

    Args:
        problem: the partition problem.
        layers: int array [..., p], layers per stage (each >= 1, summing to ``n_layers``);
            leading axes batch several partitions.
        recompute: int array [..., p], fully recomputed layers per stage (0..layers).

    Returns:
        (time_s [...], memory_bytes [..., p], feasible [...]): the iteration time, each
        stage's peak memory, and whether every stage fits in ``capacity_bytes``.

    Raises:
        ValueError: a partition with the wrong number of stages, a stage without layers, a sum
            other than ``n_layers`` or a recompute count outside ``0..layers``.

    Examples:
        >>> prob = uniform_problem(n_layers=8, n_stages=4)  # W = 2.5, 2, 2, 3; m = 4
        >>> t, mem, ok = evaluate(prob, [2, 2, 2, 2], [0, 0, 0, 0])
        >>> float(t), mem.tolist(), bool(ok)  # 9.5 + 3 * 3; 2 + in-flight * 2
        (18.5, [10.0, 8.0, 6.0, 4.0], True)
    """
    layers = np.asarray(layers)
    recompute = np.asarray(recompute)
    p = problem.n_stages
    if layers.shape[-1:] != (p,) or recompute.shape != layers.shape:
        raise ValueError(
            f"layers shape {layers.shape}, recompute shape {recompute.shape}: both need the "
            f"same shape ending in n_stages={p}"
        )
    if np.any(layers < 1) or np.any(np.sum(layers, axis=-1) != problem.n_layers):
        raise ValueError(
            f"layers={layers.tolist()}: every stage needs >= 1 layer and they must sum to "
            f"n_layers={problem.n_layers}"
        )
    if np.any(recompute < 0) or np.any(recompute > layers):
        raise ValueError(f"recompute={recompute.tolist()}: each must be in 0..layers")
    stage = np.arange(p)
    work = stage_work_s(problem, stage, layers, recompute)
    memory = _stage_memory_bytes(problem, stage, layers, recompute)
    feasible = np.all(memory <= problem.capacity_bytes, axis=-1)
    return _pipeline_time_s(problem, work), memory, feasible


def uniform_problem(n_layers: int = 8, n_stages: int = 4, **fields) -> PartitionProblem:
    """A problem in round numbers (seconds and bytes of 1), for examples and tests.

    Every layer takes 1 s and 1 byte of static memory and keeps 1 byte of activations per
    microbatch (0.25 under recompute, which costs 0.5 s); the first stage has 0.5 s more,
    the last 1 s more; 4 microbatches; nothing else. ``fields`` replace any of these.
    """
    values = dict(
        layer_s=1.0,
        recompute_layer_s=0.5,
        first_stage_s=0.5,
        last_stage_s=1.0,
        layer_static_bytes=1.0,
        first_static_bytes=0.0,
        last_static_bytes=0.0,
        layer_act_bytes=1.0,
        layer_act_recompute_bytes=0.25,
        fixed_bytes=0.0,
        capacity_bytes=1e30,
        n_microbatches=4.0,
        send_s=0.0,
        rest_s=0.0,
    )
    values.update(fields)
    m = float(values["n_microbatches"])
    in_flight = values.pop("in_flight", np.minimum(n_stages - np.arange(n_stages), m))
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}
    return PartitionProblem(
        in_flight=np.asarray(in_flight, dtype=np.float64), n_layers=int(n_layers), **arrays
    )


# --- per-stage tables: the smallest recompute that fits -----------------------------------------
class StageTables(NamedTuple):
    """Per (stage s, layer count n in 0..n_layers) choices, arrays of shape [p, n_layers + 1].

    ``recompute`` is the smallest count that fits (where nothing fits, the count of least
    memory, so that local searches can move towards feasibility), ``work_s`` the
    stage's ``W`` with it, ``feasible`` whether it fits (False for ``n = 0``), ``excess_bytes``
    how far the best recompute count stays above capacity (0 where feasible) and
    ``min_memory_bytes`` the smallest memory any recompute count reaches.
    """

    recompute: np.ndarray
    work_s: np.ndarray
    feasible: np.ndarray
    excess_bytes: np.ndarray
    min_memory_bytes: np.ndarray


def stage_tables(problem: PartitionProblem) -> StageTables:
    """Tabulate the smallest recompute that fits for every stage and layer count.

    Memory is evaluated for every ``(s, n, r)`` with ``r <= n`` (``p (N + 1)^2`` values), so
    the rule is exact even where it is not monotone (``r = 1`` adds one layer's activations).
    """
    n_max, p = problem.n_layers, problem.n_stages
    stage = np.arange(p)[:, None, None]
    n = np.arange(n_max + 1)[None, :, None]
    r = np.arange(n_max + 1)[None, None, :]
    valid = r <= n
    mem = np.where(valid, _stage_memory_bytes(problem, stage, n, r), np.inf)
    fits = mem <= problem.capacity_bytes
    any_fit = np.any(fits, axis=-1)
    min_mem = np.min(mem, axis=-1)
    n2 = np.arange(n_max + 1)[None, :]
    # smallest r that fits; where none does, the r of least memory (for repair moves)
    rec = np.where(any_fit, np.argmax(fits, axis=-1), np.argmin(mem, axis=-1))
    work = stage_work_s(problem, np.arange(p)[:, None], n2, rec)
    excess = np.maximum(min_mem - problem.capacity_bytes, 0.0)
    feasible = any_fit & (n2 >= 1)
    return StageTables(rec, work, feasible, excess, min_mem)


def _lookup(tables: StageTables, layers: np.ndarray):
    """(work [..., p], excess [...] summed over stages, recompute [..., p]) of partitions."""
    stage = np.arange(layers.shape[-1])
    work = tables.work_s[stage, layers]
    excess = np.sum(tables.excess_bytes[stage, layers], axis=-1)
    return work, excess, tables.recompute[stage, layers]


def best_index(excess: np.ndarray, time_s: np.ndarray) -> int:
    """Index of the lexicographic minimum of (excess, time): feasible first, then fastest."""
    least = excess <= np.min(excess)
    return int(np.argmin(np.where(least, time_s, np.inf)))


def as_partition(problem: PartitionProblem, tables: StageTables, layers) -> Partition:
    """The ``Partition`` of ``layers`` [p] with the smallest recompute that fits, and its time."""
    layers = np.asarray(layers, dtype=np.int64)
    recompute = tables.recompute[np.arange(problem.n_stages), layers].astype(np.int64)
    time_s, _, _ = evaluate(problem, layers, recompute)
    return Partition(layers, recompute, float(time_s))


def uniform_partition(n_layers: int, n_stages: int) -> np.ndarray:
    """``n_layers // n_stages`` layers per stage, the remainder one each on the last stages."""
    layers = np.full(n_stages, n_layers // n_stages, dtype=np.int64)
    layers[n_stages - n_layers % n_stages :] += 1 if n_layers % n_stages else 0
    return layers


def uniform_time_s(problem: PartitionProblem, tables: StageTables | None = None) -> float | None:
    """Time of the uniform partition with the smallest recompute that fits; None if none fits."""
    tables = stage_tables(problem) if tables is None else tables
    layers = uniform_partition(problem.n_layers, problem.n_stages)
    _, excess, _ = _lookup(tables, layers)
    return None if excess > 0 else as_partition(problem, tables, layers).time_s


# --- exact: dynamic programming -----------------------------------------------------------------
def _shift_index(n_max: int) -> np.ndarray:
    """``idx[k, n] = k - n`` where ``n <= k``, else ``n_max + 1`` (an inf pad)."""
    k = np.arange(n_max + 1)[:, None]
    n = np.arange(n_max + 1)[None, :]
    return np.where(n <= k, k - n, n_max + 1)


def _min_sum_dp(cost: np.ndarray, combine=np.add):
    """Best contiguous partition: ``f_s[k] = min_n combine(f_{s-1}[k - n], cost[s, n])``.

    Args:
        cost: [..., p, N + 1], inf where a stage may not take ``n`` layers (always at n = 0).
        combine: ``np.add`` (minimize the sum) or ``np.maximum`` (minimize the maximum).

    Returns:
        (value [...] over all N layers, choice [p, ..., N + 1] of layers at each stage).
    """
    n_max = cost.shape[-1] - 1
    idx = _shift_index(n_max)
    f = cost[..., 0, :]
    choices = [np.broadcast_to(np.arange(n_max + 1), f.shape)]
    pad = np.full(f.shape[:-1] + (1,), np.inf)
    for s in range(1, cost.shape[-2]):
        cand = combine(np.concatenate([f, pad], axis=-1)[..., idx], cost[..., s, None, :])
        choice = np.argmin(cand, axis=-1)
        f = np.take_along_axis(cand, choice[..., None], axis=-1)[..., 0]
        choices.append(choice)
    return f[..., n_max], choices


def _backtrack(choices, n_max: int) -> np.ndarray:
    layers, k = [], n_max
    for choice in reversed(choices):
        n = int(choice[k]) if choice is not choices[0] else k
        layers.append(n)
        k -= n
    return np.asarray(layers[::-1], dtype=np.int64)


def min_peak_memory(problem: PartitionProblem, tables: StageTables | None = None):
    """The smallest peak memory over all partitions and recompute choices (minimax DP).

    Returns:
        (bytes, layers [p]) of a partition reaching it.
    """
    tables = stage_tables(problem) if tables is None else tables
    cost = tables.min_memory_bytes.copy()
    cost[:, 0] = np.inf
    value, choices = _min_sum_dp(cost, combine=np.maximum)
    return float(value), _backtrack(choices, problem.n_layers)


def check_feasible(problem: PartitionProblem, tables: StageTables) -> None:
    """Raise ``InfeasiblePartitionError`` when no partition fits in memory."""
    peak, layers = min_peak_memory(problem, tables)
    if not peak <= problem.capacity_bytes:
        raise InfeasiblePartitionError(problem, peak, layers)


def solve_dp(problem: PartitionProblem, chunk: int = 64) -> Partition:
    """The optimal partition, exactly, by dynamic programming over contiguous partitions.

    ``sum W + (m - 1) max W`` is minimized by enumerating the bound ``B`` on ``max W`` over
    the distinct values ``W(s, n)`` (Alpa's enumeration of ``t_max``): for each, a DP over
    stages minimizes ``sum W`` subject to ``W(s, n) <= B`` and feasibility, and the optimum is
    the best ``g(B) + (m - 1) B`` (at the optimal ``B`` the achieved maximum equals ``B``).
    Bounds run upwards from the smallest feasible one (binary search; feasibility is monotone
    in ``B``), ``chunk`` at a time as one batched DP, and stop once ``(m - 1) B`` plus the
    unconstrained minimum of ``sum W`` cannot beat the best found.

    Args:
        problem: the partition problem.
        chunk: bounds evaluated per batched DP.

    Returns:
        The optimal ``Partition`` (layers, recompute, time_s).

    Raises:
        InfeasiblePartitionError: no partition fits, with the smallest peak memory reachable.
    """
    tables = stage_tables(problem)
    check_feasible(problem, tables)
    n_max, m = problem.n_layers, float(problem.n_microbatches)
    work = np.where(tables.feasible, tables.work_s, np.inf)
    bounds = np.unique(work[np.isfinite(work)])

    def min_sums(b):  # g(B) for bounds b [k]
        cost = np.where(work[None] <= b[:, None, None], work[None], np.inf)
        return _min_sum_dp(cost)[0]

    lo, hi = 0, len(bounds) - 1  # the largest bound is always feasible (checked above)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if np.isfinite(min_sums(bounds[mid : mid + 1])[0]) else (mid + 1, hi)
    floor = min_sums(bounds[-1:])[0]  # g(B) >= g(max bound) for every B
    best_value, best_bound = np.inf, bounds[lo]
    for start in range(lo, len(bounds), chunk):
        b = bounds[start : start + chunk]
        if floor + (m - 1.0) * b[0] >= best_value:
            break
        values = min_sums(b) + (m - 1.0) * b
        i = int(np.argmin(values))
        if values[i] < best_value:
            best_value, best_bound = values[i], b[i]
    cost = np.where(work <= best_bound, work, np.inf)
    _, choices = _min_sum_dp(cost)
    return as_partition(problem, tables, _backtrack(choices, n_max))


def score(problem: PartitionProblem, tables: StageTables, layers):
    """Memory excess and iteration time of partitions, each stage with its smallest-fit recompute.

    Args:
        problem, tables: the problem and its ``stage_tables``.
        layers: int array [..., p], layers per stage.

    Returns:
        (excess, time_s), each [...]: bytes over the capacity on the worst stage (0 when
        the partition fits) and the iteration time in seconds.
    """
    work, excess, _ = _lookup(tables, layers)
    return excess, _pipeline_time_s(problem, work)
