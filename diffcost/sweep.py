"""Exhaustive sweeps: every plan of a ``Space``, evaluated in fixed-size chunks over all devices.

``sweep`` enumerates a ``diffcost.space.Space`` (``space.enumerate_plans``) and ``evaluate``
runs ``jax.vmap(simulate)`` over the batched plans, the plan leaves that hold one value over
the whole batch passed once, unbatched (``batch_axes``). The batch axis is split into chunks of one
fixed size (the last chunk padded by repeating a row, the padding dropped afterwards), and each
chunk is sharded over every device JAX sees along a one-axis mesh ``("batch",)``; the model,
the cluster and the Params are replicated. One jit-compiled program serves every chunk: it is
compiled once per (devices, temperature) and, inside that, once per chunk size and dtype.
The result is the same ``Breakdown`` as ``simulate`` returns, with numpy leaves and a leading
axis over the configurations. ``sweep_members`` sweeps once per member of the population a
cluster without a profile of its own is predicted with and combines them as ``predict`` does.

Summaries of a result, as arrays and plain values: ``best`` (the fastest plans that fit),
``pareto_front`` (time against peak memory), ``status_counts``, ``smallest_memory``,
``csv_columns`` (one row per configuration) and ``plan_row``. Nothing here prints or writes
files: ``diffcost.cli.sweep`` (the ``diffcost sweep`` command) shows the progress, prints the
report, and writes the CSV file and the Pareto plot.

Several hosts:
    The same code runs over the devices of several hosts. Every process calls
    ``jax.distributed.initialize()`` before anything else touches JAX (on Slurm or Cloud TPU
    it finds the coordinator itself; elsewhere pass ``coordinator_address``,
    ``num_processes`` and ``process_id``), then runs the same program: ``jax.devices()``
    then lists every host's devices, so ``evaluate``'s mesh spans them all and each chunk is
    split across hosts. Every process enumerates the same plans (enumeration is
    deterministic), so no plan data travels between hosts: each process builds the global
    chunk from its own copy with ``jax.make_array_from_callback``, which materializes only the
    shards on its addressable devices. A process can read only those shards of the outputs,
    so when ``jax.process_count() > 1`` ``evaluate`` gathers each chunk's outputs with
    ``jax.experimental.multihost_utils.process_allgather`` (tiled along the batch axis), and
    every process returns the full ``Breakdown``; with one process that branch is skipped
    and the outputs are read directly. Write files from one process only
    (``jax.process_index() == 0``).

Examples:
    >>> from diffcost import space, sweep  # doctest: +SKIP
    >>> from diffcost.profiles import params_for  # doctest: +SKIP
    >>> s = space.load_space("gpt3-175b", "selene-a100-80g", 1024, 1536)  # doctest: +SKIP
    >>> result = sweep.sweep(s, params_for(s.cluster)[0])  # doctest: +SKIP
    >>> [result.choices[i] for i in sweep.best(result, 3)]  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from diffcost import smooth
from diffcost.arrays import GiB, PlanArrays, cluster_arrays, model_arrays
from diffcost.config import ConfigError
from diffcost.params import Params
from diffcost.population import median_breakdown
from diffcost.simulate import (
    STATUS_INVALID,
    STATUS_NAMES,
    STATUS_OK,
    Breakdown,
    simulate,
    time_part,
)
from diffcost.space import Choice, Space, enumerate_plans

BATCH_AXIS = "batch"
DEFAULT_CHUNK = 8192
DEFAULT_TOP = 10

ProgressFn = Callable[[int, int], None]


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------
def batch_axes(plans: PlanArrays):
    """``(in_axes, plans)`` for ``jax.vmap``: each leaf of the batched ``plans`` that holds one
    value over the whole batch is passed once, unbatched (axis None), the others along axis 0.

    What depends on unbatched leaves alone is then computed once per call rather than per
    configuration, and a ``lax.cond`` on them stays a branch under ``vmap`` (the LoRA
    adapters, ``kernels.adapter_gemm_s``) instead of a select that computes both sides. The
    values are the same either way. A batch of one configuration, or one whose leaves are all
    constant, keeps its first leaf batched (``vmap`` needs a batched input).
    """
    leaves, treedef = jax.tree_util.tree_flatten(plans)
    constant = [x.shape[0] > 1 and bool(np.all(x == x[:1])) for x in map(np.asarray, leaves)]
    if all(constant) or len(leaves[0]) == 1:
        constant = [False] * len(leaves)
    axes = [None if c else 0 for c in constant]
    values = [np.asarray(x)[0] if c else x for x, c in zip(leaves, constant)]
    return treedef.unflatten(axes), treedef.unflatten(values)


@functools.lru_cache(maxsize=16)
def _sharded_simulate(devices: tuple, temperature: float, axes_key: tuple):
    """(jitted vmap(simulate) with batch-sharded plans, row sharding, replicated sharding).

    One jit object per (devices, temperature, which plan leaves are batched: ``axes_key`` is
    the plans' treedef and their ``batch_axes`` leaves); jit's own cache then compiles it once
    per chunk size and dtype.
    """
    treedef, axes = axes_key
    mesh = Mesh(np.asarray(devices, dtype=object), (BATCH_AXIS,))
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXIS))
    whole = NamedSharding(mesh, PartitionSpec())
    plan_axes = treedef.unflatten(list(axes))
    plan_shardings = treedef.unflatten([whole if a is None else rows for a in axes])
    batched = jax.vmap(
        lambda model, plan, cluster, params: simulate(model, plan, cluster, params, temperature),
        in_axes=(None, plan_axes, None, None),
    )
    fn = jax.jit(batched, in_shardings=(whole, plan_shardings, whole, whole), out_shardings=rows)
    return fn, rows, whole


def _global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``x`` (the same on every process) as a global array laid out by ``sharding``."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _to_host(tree):
    """Numpy copies of a pytree of global arrays (gathered across processes when needed)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree_util.tree_map(np.asarray, tree)


def chunk_size(n: int, chunk: int, n_devices: int) -> int:
    """The chunk actually used for ``n`` configurations on ``n_devices``.

    ``chunk`` rounded up to a multiple of the device count; for a space smaller than that,
    the next power of two at or above ``n`` (so small spaces do not compute a full chunk of
    padding, and their sizes still share a few compilations).

    Raises:
        ConfigError: ``chunk`` is not a positive integer.
    """
    if chunk < 1:
        raise ConfigError(f"chunk={chunk}: need at least 1 configuration per chunk")
    if n < chunk:
        chunk = 1 << max(n - 1, 0).bit_length()
    return -(-chunk // n_devices) * n_devices


def evaluate(
    space: Space,
    plans: PlanArrays,
    params: Params,
    *,
    chunk: int = DEFAULT_CHUNK,
    devices: Sequence[jax.Device] | None = None,
    progress: ProgressFn | None = None,
    temperature: float = smooth.DEFAULT_TEMPERATURE,
    hoist_constants: bool = True,
) -> Breakdown:
    """Simulate every plan of a batch, in fixed-size chunks sharded over the devices.

    Args:
        space: fixes the model and cluster (``space.model``, ``space.cluster``).
        plans: batched ``PlanArrays`` with a leading axis of ``n`` configurations (numpy or
            JAX leaves, any float dtype; converted to JAX's default float).
        params: calibrated constants (replicated on every device).
        chunk: configurations per compiled call; rounded up to a multiple of the device count
            (see ``chunk_size``). The last chunk is padded by repeating the last plan.
        devices: the devices to shard the batch over; default every device JAX sees
            (every host's, after ``jax.distributed.initialize()``).
        progress: called as ``progress(done, n)``: with ``done = 0`` once the program is
            compiled, then after each chunk is on the host.
        temperature: relative softness of every max/min (static; 0 is the exact model).
        hoist_constants: pass the plan leaves that hold one value over the batch once,
            unbatched (``batch_axes``); False batches every leaf, so that every batch of a
            space compiles the same program whatever varies in it (``search.Evaluator``'s
            many small batches). The values are the same either way.

    Returns:
        A ``Breakdown`` with numpy leaves of leading dimension ``n`` (``status`` int32).

    Raises:
        ConfigError: ``chunk`` < 1, or the plan leaves disagree on ``n``.
    """
    dtype = jnp.result_type(float)
    devices = tuple(jax.devices() if devices is None else devices)

    as_float = lambda x: np.asarray(x, dtype=dtype)  # noqa: E731
    plans = jax.tree_util.tree_map(as_float, plans)
    sizes = {leaf.shape[0] if leaf.ndim else -1 for leaf in jax.tree_util.tree_leaves(plans)}
    if len(sizes) != 1 or -1 in sizes:
        raise ConfigError(f"plans: every leaf needs the same leading batch axis, got {sizes}")
    (n,) = sizes
    size = chunk_size(n, chunk, len(devices))
    if hoist_constants:
        axes, plans = batch_axes(plans)
        axes = jax.tree_util.tree_leaves(axes, is_leaf=lambda a: a is None)
    leaves, treedef = jax.tree_util.tree_flatten(plans)
    if not hoist_constants:
        axes = [0] * len(leaves)
    fn, rows, whole = _sharded_simulate(devices, float(temperature), (treedef, tuple(axes)))

    replicate = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda x: _global_array(as_float(x), whole), tree
    )
    model = replicate(model_arrays(space.model))
    cluster = replicate(cluster_arrays(space.cluster, n_gpus=space.n_gpus))
    params = replicate(params)
    once = [None if a == 0 else _global_array(x, whole) for x, a in zip(leaves, axes)]

    def chunk_of(take):
        """The plans of one chunk: batched leaves ``take(leaf)``, the others as they are."""
        parts = [x if a is None else take(leaf) for x, a, leaf in zip(once, axes, leaves)]
        return treedef.unflatten(parts)

    chunk_in = chunk_of(
        lambda x: jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype, sharding=rows)
    )
    # compiled ahead of the first chunk (cached: later calls lower and compile nothing)
    compiled = fn.lower(model, chunk_in, cluster, params).compile()
    out = jax.tree_util.tree_map(lambda s: np.empty((n, *s.shape[1:]), s.dtype), compiled.out_info)

    def launch(start):
        if start + size <= n:
            take = lambda x: x[start : start + size]  # noqa: E731
        else:  # the last chunk: pad by repeating the last plan
            index = np.minimum(np.arange(start, start + size), n - 1)
            take = lambda x: x[index]  # noqa: E731
        rows_in = chunk_of(lambda x: _global_array(take(x), rows))
        return start, compiled(model, rows_in, cluster, params)

    def collect(start, result):
        stop = min(start + size, n)
        for dst, src in zip(
            jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(_to_host(result))
        ):
            dst[start:stop] = src[: stop - start]
        if progress is not None:
            progress(stop, n)

    if progress is not None:
        progress(0, n)
    pending = None
    for start in range(0, n, size):
        launched = launch(start)  # dispatch the next chunk before reading the previous one
        if pending is not None:
            collect(*pending)
        pending = launched
    if pending is not None:
        collect(*pending)
    return out


# --------------------------------------------------------------------------------------------
# Sweep and its summaries
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SweepResult:
    """Every configuration of a space and its prediction (``breakdown`` rows = ``choices``)."""

    space: Space
    choices: list[Choice]
    breakdown: Breakdown
    seconds: float  # wall time of the evaluation, compilation included
    configs_per_s: float  # configurations over the time after compilation
    devices: int
    compile_s: float = 0.0  # compilation (trace, lower, XLA), about 0 once cached


def sweep(space: Space, params: Params, **kw) -> SweepResult:
    """Enumerate every valid plan of ``space`` and evaluate it.

    Args:
        space: the plan space.
        params: calibrated constants.
        **kw: passed to ``evaluate`` (``chunk``, ``devices``, ``progress``, ``temperature``).

    Returns:
        A ``SweepResult``.
    """
    plans, choices = enumerate_plans(space)
    devices = kw.get("devices")
    n_devices = len(jax.devices() if devices is None else devices)
    user_progress = kw.pop("progress", None)
    compiled_at = []

    def progress(done, total):
        if not compiled_at:
            compiled_at.append(time.perf_counter())
        if user_progress is not None:
            user_progress(done, total)

    t0 = time.perf_counter()
    breakdown = evaluate(space, plans, params, progress=progress, **kw)
    t1 = time.perf_counter()
    running = t1 - compiled_at[0]
    return SweepResult(
        space=space,
        choices=choices,
        breakdown=breakdown,
        seconds=t1 - t0,
        configs_per_s=len(choices) / running if running > 0 else math.inf,
        devices=n_devices,
        compile_s=compiled_at[0] - t0,
    )


def sweep_members(space: Space, members: list[Params], **kw) -> SweepResult:
    """``sweep`` with each of ``members`` (the population's, ``profiles.population_members``),
    every plan's breakdowns combined as ``predict`` combines them
    (``population.median_breakdown``: the median time, the worst status, the mean memory).
    ``configs_per_s`` counts plans, each timed once per member; ``progress(done, total)``
    counts plan evaluations over every member."""
    user_progress = kw.pop("progress", None)
    results = []
    for m, params in enumerate(members):
        offset = m * len(results[0].choices) if results else 0

        def progress(done, total, offset=offset):
            if user_progress is not None:
                user_progress(offset + done, total * len(members))

        results.append(sweep(space, params, progress=progress, **kw))
    stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *(r.breakdown for r in results))
    running = sum(r.seconds - r.compile_s for r in results)
    first = results[0]
    return dataclasses.replace(
        first,
        breakdown=median_breakdown(stacked),
        seconds=sum(r.seconds for r in results),
        configs_per_s=len(first.choices) / running if running > 0 else math.inf,
        compile_s=sum(r.compile_s for r in results),
    )


def _feasible(iteration_s, memory_peak_bytes, ok_mask) -> np.ndarray:
    return (
        np.asarray(ok_mask, dtype=bool) & np.isfinite(iteration_s) & np.isfinite(memory_peak_bytes)
    )


def best(result: SweepResult, k: int = DEFAULT_TOP) -> np.ndarray:
    """Indices of the ``k`` fastest configurations with status ok, fastest first.

    Ties keep enumeration order. Fewer than ``k`` when fewer fit; empty when none does.
    """
    b = result.breakdown
    ok = np.flatnonzero(_feasible(b.iteration_s, b.memory_peak_bytes, b.status == STATUS_OK))
    order = np.argsort(b.iteration_s[ok], kind="stable")
    return ok[order[: max(int(k), 0)]]


def pareto_front(iteration_s, memory_peak_bytes, ok_mask) -> np.ndarray:
    """Indices of the Pareto-optimal configurations (less time, less memory), by memory.

    A feasible configuration (``ok_mask`` and finite values) is on the front when no other
    feasible one is at least as good in both and strictly better in one. Configurations with
    exactly the same (memory, time) are one point: the first index represents them. So every
    feasible configuration off the front is dominated by, or equal to, one on it. Sorting
    once makes this O(n log n).

    Args:
        iteration_s: [n] seconds.
        memory_peak_bytes: [n] bytes (any unit works).
        ok_mask: [n] bool, the configurations allowed on the front.

    Returns:
        int indices, memory ascending (so time descending).

    Examples:
        >>> pareto_front([3.0, 1.0, 2.0, 2.5], [1.0, 3.0, 2.0, 2.5], [True] * 4).tolist()
        [0, 2, 1]
    """
    t = np.asarray(iteration_s, dtype=float)
    m = np.asarray(memory_peak_bytes, dtype=float)
    idx = np.flatnonzero(_feasible(t, m, ok_mask))
    if idx.size == 0:
        return idx
    idx = idx[np.lexsort((t[idx], m[idx]))]  # memory, then time; stable for exact ties
    ts = t[idx]
    fastest_before = np.minimum.accumulate(np.concatenate([[np.inf], ts[:-1]]))
    return idx[ts < fastest_before]


def result_front(result: SweepResult) -> np.ndarray:
    """``pareto_front`` of a sweep's configurations with status ok."""
    b = result.breakdown
    return pareto_front(b.iteration_s, b.memory_peak_bytes, b.status == STATUS_OK)


def status_counts(result: SweepResult) -> dict[str, int]:
    """Configurations per status name (every name present)."""
    counts = np.bincount(result.breakdown.status, minlength=len(STATUS_NAMES))
    return {name: int(c) for name, c in zip(STATUS_NAMES, counts)}


def smallest_memory(result: SweepResult) -> int | None:
    """Index of the valid configuration with the smallest peak memory (None if none)."""
    b = result.breakdown
    valid = np.flatnonzero((b.status != STATUS_INVALID) & np.isfinite(b.memory_peak_bytes))
    if valid.size == 0:
        return None
    return int(valid[np.argmin(b.memory_peak_bytes[valid])])


# --------------------------------------------------------------------------------------------
# Rows for reports and files
# --------------------------------------------------------------------------------------------
def csv_header() -> list[str]:
    """The columns of a sweep's CSV file (``csv_columns``), in order."""
    return [
        *Choice._fields,
        "iteration_s",
        "tokens_per_s",
        "mfu",
        *Breakdown.TIME_PARTS,
        "memory_peak_gib",
        "memory_capacity_gib",
        "status",
        "pareto",
    ]


def _fmt(values) -> list[str]:
    """6 significant digits; each distinct value formatted once (sweeps repeat many)."""
    values = np.asarray(values, dtype=float) + 0.0  # + 0.0 turns -0 into 0
    distinct, index = np.unique(values, return_inverse=True)
    text = np.asarray([f"{v:.6g}" for v in distinct.tolist()], dtype=object)
    return text[index.reshape(-1)].tolist()


def csv_columns(result: SweepResult) -> dict[str, list]:
    """The columns of the sweep's CSV file, by ``csv_header()`` name, one entry per configuration.

    Choice fields as in ``Choice.describe`` (rank order spelled ``tp-cp-dp-pp``), times in
    seconds, memory in GiB, status by name, ``pareto`` 1 on the front. Floats are text with 6
    significant digits.

    Args:
        result: a sweep.

    Returns:
        ``{column: values}`` for every name of ``csv_header()``.
    """
    b, space = result.breakdown, result.space
    n = len(result.choices)
    fields = list(zip(*result.choices)) if n else [()] * len(Choice._fields)
    columns = dict(zip(Choice._fields, fields))
    names = ["-".join(o) for o in space.orders]
    columns["order"] = [names[i] for i in columns["order"]]
    on_front = np.zeros(n, dtype=np.int8)
    on_front[result_front(result)] = 1
    capacity = np.broadcast_to(b.memory_capacity_bytes, (n,))
    columns.update(
        {
            "iteration_s": _fmt(b.iteration_s),
            "tokens_per_s": _fmt(b.tokens_per_s),
            "mfu": _fmt(b.mfu),
            **{part: _fmt(time_part(b, part)) for part in Breakdown.TIME_PARTS},
            "memory_peak_gib": _fmt(b.memory_peak_bytes / GiB),
            "memory_capacity_gib": _fmt(capacity / GiB),
            "status": np.asarray(STATUS_NAMES)[b.status].tolist(),
            "pareto": on_front.tolist(),
        }
    )
    return columns


def plan_row(result: SweepResult, i: int) -> dict:
    """One configuration of a sweep as plain Python values (the JSON report's plan entries).

    Args:
        result: a sweep.
        i: the configuration's index.

    Returns:
        ``{"plan", "iteration_s", "tokens_per_s", "mfu", "memory_peak_gib"}``.
    """
    b = result.breakdown
    return {
        "plan": result.choices[i].describe(result.space),
        "iteration_s": float(b.iteration_s[i]),
        "tokens_per_s": float(b.tokens_per_s[i]),
        "mfu": float(b.mfu[i]),
        "memory_peak_gib": float(b.memory_peak_bytes[i] / GiB),
    }
