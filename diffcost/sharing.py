"""sharing: concurrent flows split the links they cross, max-min fairly, smoothly.

A set of flows crosses a network of directed links. Routing gives, per flow and link, the
fraction of the flow's bytes that crosses the link (``incidence``, flows x links; an ECMP split
gives fractions, a single path ones and zeros). A flow sending at rate ``r_f`` loads link ``l``
with ``incidence[f, l] * r_f``; the rates are **max-min fair**: no flow can go faster without
slowing a flow that is already no faster than it. Fluid network simulators (Proteus's
executor, ASTRA-sim's analytical network, SimGrid) share links this way.

**Water-filling** (progressive filling) computes them: every unfrozen flow rises at one common
level; a link saturates when the frozen flows' load plus the level times the unfrozen flows'
weight reaches its capacity; the flows crossing it freeze at that level; repeat. The level at
which link ``l`` saturates is ``rem_l / w_l`` (remaining capacity over unfrozen weight), so the
next bottleneck is the link with the largest *congestion* ``y_l = w_l / rem_l``. Each round
saturates at least one link and freezes at least one flow, so ``min(flows, links)`` rounds are
exact. This module runs that many rounds with three smooth surrogates (``diffcost.smooth``):

* the largest congestion is ``softmax_mean``, a smooth maximum that is exact where the top
  values tie (the links of a symmetric collective do) and otherwise slightly below the maximum,
  so the level can overshoot a nearly tied link's saturation by a fraction of the softness; the
  remaining capacity is clipped at zero (``clip_exact``: a guard against that and rounding);
* a link *saturates* by a sigmoid gate: fully when its congestion is within ``GATE_SLACK *
  temperature`` of the maximum, not at all below; a flow freezes by the product of its links'
  gates. A link that saturated only in part keeps its congestion (its remaining capacity and
  unfrozen weight shrink together) and freezes the rest of its flows in the next round, so its
  load stays at its capacity; one that saturated fully keeps an unfrozen remainder of
  ``exp(-GATE_SLACK)`` or less, which the floor ``CAPACITY_FLOOR * capacity`` under its
  remaining capacity turns into a negligible congestion;
* a flow freezes at ``smin2(level, ceiling)``, the level capped by the fastest flow's alone
  rate (the exact filling never exceeds it), so the tiny unfrozen remainders a sigmoid leaves
  cannot pick up a level that diverges once every flow is frozen.

**Completion times** of flows that start together follow in phases: rates for the flows still
running, the next finish ``dt = 1 / softmax_mean(rate / remaining bytes)``, every flow advanced by
``rate * dt``, and the flows whose finish falls within the gate's slack of ``dt`` marked done by
the same sigmoid gate (flows that finish together, as the steps of a ring collective do, leave
in one phase). At least one flow finishes per phase, so ``flows`` phases are exact. Flows may
start later (``start_s``): a start is one more event (the next event is the earlier of the next
finish and the next start, and the default phases double); a waiting flow sends nothing. One
row may stand for ``multiplicity`` identical flows. A flow's completion is the sum of the phase
lengths until it finished, plus its path latency
(``incidence @ latency_s``: the expected latency over its ECMP paths; latency delays the
flow's end and does not hold bandwidth). The makespan of a group (a collective is a group of
flows) is the ``softmax_mean`` of its flows' completions (exact when they tie).

Error: a flow whose bottleneck is within the gate's slack (``GATE_SLACK * temperature``,
0.3% at the default) of the current bottleneck freezes at the current level, and a flow that
would finish within the slack of the phase's end finishes at its end; both err by at most about
the slack. ``benchmarks/topology.py`` measures the error against the exact, event-driven
reference (``diffcost.sharing_reference``) on a random corpus; ``docs/sharing.md`` quotes it.

Everything has fixed shapes (flows x links), so ``jax.vmap`` over a corpus or a sweep works;
gradients with respect to ``capacity_Bps``, ``flow_bytes`` and ``latency_s`` are finite, in
float32 too (the gates divide by their maximum held constant, and ``1 / top`` is not formed
where it exceeds its cap: a phase with nothing left to run has congestions near 1e-20).

``few_flows_completion_s`` is the same model for a few flows of one unit that start together
(the three flows the cost model's network path shares per plan), with the phases and rounds
unrolled and only as many rounds per phase as flows can still run.

References:
    D. Bertsekas and R. Gallager, "Data Networks" (1992), section 6.5.2: max-min fairness and
    progressive filling. J. Duan et al., "Proteus" (TPDS 2024): bandwidth sharing between
    concurrent communications in the executor.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from diffcost import smooth

# relative softness of the smooth maxima and width of the saturation and finish gates
DEFAULT_TEMPERATURE = 1e-4
# a gate opens fully this many widths below the maximum: the slack is GATE_SLACK * temperature
GATE_SLACK = 30.0
# capacity headroom in the congestion ``w / (rem + CAPACITY_FLOOR * c)``: rounding cannot
# make a saturated link's remaining capacity negative and its congestion infinite
CAPACITY_FLOOR = 1e-9
# a finished flow's remaining bytes in ``rate / (remaining + DONE_FLOOR * bytes)``
DONE_FLOOR = 1e-6
# the cap of the level at a flow's alone rate is sharper than the gates
CAP_TEMPERATURE = 1e-6
# ``_capped_inverse`` forms ``1 / x`` only below this many times its cap
INVERSE_RANGE = 10.0
# ``few_flows_completion_s`` caps levels and phases at this many times the sums of the flows'
# alone rates and times, which no real level or phase reaches
FEW_HEADROOM = 2.0


def _gate_log_open(x, xstar, temperature):
    """log of (1 - gate): the gate opens where ``x`` is within the slack of the maximum ``xstar``.

    ``x`` (n,) and ``xstar`` (scalar) are non-negative; where ``xstar`` is zero nothing opens.
    """
    on, arg = _gate_arg(x, xstar, temperature)
    return jnp.where(on, jax.nn.log_sigmoid(-arg), 0.0)


def _gate_arg(x, xstar, temperature):
    """Where ``xstar > 0``, and the gate's argument ``(x / xstar - 1 + slack) / temperature``.

    Both are divided by ``xstar`` held constant first: the quotient's gradient is then formed
    from numbers near one, not from ``xstar ** 2``, which underflows in float32 where a phase
    has nothing left to run (``xstar`` ~ 1e-20).
    """
    on = xstar > 0
    scale = jax.lax.stop_gradient(jnp.where(on, xstar, 1.0))
    ratio = (x / scale) / jnp.where(on, xstar / scale, 1.0)
    return on, (ratio - (1.0 - GATE_SLACK * temperature)) / temperature


def _capped_inverse(x, cap, temperature):
    """``smin2(1 / x, cap)`` for ``x >= 0``: the cap where ``1 / x`` exceeds ``INVERSE_RANGE``
    times it (where ``smin2`` gives the cap to rounding), so that neither the value nor the
    gradient of ``1 / x`` is formed where ``x`` tends to zero (double ``where``)."""
    ok = x * cap > 1.0 / INVERSE_RANGE
    inverse = 1.0 / jnp.where(ok, x, 1.0)
    return jnp.where(ok, smooth.smin2(inverse, cap, temperature), cap)


def alone_rate_Bps(incidence: jax.Array, capacity_Bps: jax.Array) -> jax.Array:
    """The rate each flow would get alone: ``min over its links of capacity / fraction``.

    Args:
        incidence: (flows, links) fraction of each flow's bytes crossing each link, in [0, 1].
        capacity_Bps: (links,) capacity per direction, bytes/s, > 0.

    Returns:
        (flows,) bytes/s; 0 for a flow that crosses no link.
    """
    demand = incidence / capacity_Bps[None, :]  # seconds per byte of the flow, per link
    return smooth.safe_div(1.0, smooth.smooth_max(demand, axis=-1, temperature=CAP_TEMPERATURE))


def max_min_rates(
    incidence: jax.Array,
    capacity_Bps: jax.Array,
    weight: jax.Array | None = None,
    rounds: int | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
) -> jax.Array:
    """Max-min fair rates of concurrent flows on shared links, by smooth water-filling.

    Args:
        incidence: (flows, links) fraction of each flow's bytes that crosses each directed
            link (ones along a single path; ECMP splits give fractions).
        capacity_Bps: (links,) capacity of each link, bytes/s, > 0.
        weight: (flows,) >= 0, how many copies of each flow compete: 1 for a running flow,
            0 for an absent or finished one, ``k`` for ``k`` identical flows on the same links
            (each gets the returned rate); ones if None.
        rounds: water-filling rounds (static); ``min(flows, links)``, which is exact, if None.
        temperature: relative softness of the maxima and gates (``DEFAULT_TEMPERATURE``).

    Returns:
        (flows,) rates in bytes/s. A flow with weight 0 gets the rate it would get joining
        at the final level (meaningless; mask it).

    Examples:
        >>> import jax.numpy as jnp
        >>> r = max_min_rates(jnp.ones((2, 1)), jnp.array([10.0]))
        >>> [round(float(x), 3) for x in r]
        [5.0, 5.0]
    """
    n_flows, n_links = incidence.shape
    rounds = min(n_flows, n_links) if rounds is None else rounds
    weight = jnp.ones((n_flows,), incidence.dtype) if weight is None else weight
    eff = incidence * weight[:, None]
    crosses = (incidence > 0).astype(incidence.dtype)
    # no flow rises above the fastest flow's alone rate
    ceiling = smooth.smooth_max(alone_rate_Bps(incidence, capacity_Bps), temperature=temperature)

    def fill(carry, _):
        active, frozen_Bps, level = carry
        unfrozen = jnp.sum(eff * active[:, None], axis=0)  # (links,) weight still rising
        # rounding can leave a saturated link a capacity slightly below zero: clip it to zero
        used = jnp.sum(eff * frozen_Bps[:, None], axis=0)
        rem = smooth.clip_exact(capacity_Bps - used, 0.0, capacity_Bps)
        congestion = unfrozen / (rem + CAPACITY_FLOOR * capacity_Bps)
        top = smooth.softmax_mean(congestion, temperature=temperature)
        level = _capped_inverse(top, ceiling, CAP_TEMPERATURE)
        log_open = _gate_log_open(congestion, top, temperature)  # (links,) log(1 - saturated)
        still = active * jnp.exp(jnp.sum(crosses * log_open[None, :], axis=1))
        frozen_Bps = frozen_Bps + (active - still) * level
        return (still, frozen_Bps, level), None

    init = (
        jnp.ones((n_flows,), incidence.dtype),
        jnp.zeros((n_flows,), incidence.dtype),
        jnp.zeros((), incidence.dtype),
    )
    (active, frozen_Bps, level), _ = jax.lax.scan(fill, init, None, length=rounds)
    return frozen_Bps + active * level


def completion_times_s(
    incidence: jax.Array,
    capacity_Bps: jax.Array,
    latency_s: jax.Array,
    flow_bytes: jax.Array,
    multiplicity: jax.Array | None = None,
    start_s: jax.Array | None = None,
    phases: int | None = None,
    rounds: int | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
) -> jax.Array:
    """When each of a set of flows finishes, sharing links max-min fairly.

    Args:
        incidence: (flows, links) fraction of each flow's bytes crossing each directed link.
        capacity_Bps: (links,) bytes/s, > 0.
        latency_s: (links,) seconds added to the completion of a flow crossing the link
            (weighted by the fraction crossing it).
        flow_bytes: (flows,) bytes, >= 0. A flow of 0 bytes, or one that crosses no link,
            takes no time beyond its start and path latency (padding: 0 bytes, a zero row).
        multiplicity: (flows,) >= 1, how many identical flows (same links, same size) each row
            stands for, so that a symmetric set is one row per class; ones if None.
        start_s: (flows,) >= 0, when each flow starts; all at 0 if None. A later start is one
            more event: the default phases double. Time 0 is the earliest start: at exactly 0
            the gradient with respect to a start is the one from below (0).
        phases: phases of the fluid schedule (static); ``flows`` (``2 * flows`` with
            ``start_s``), which is exact, if None.
        rounds: water-filling rounds per phase (static); ``min(flows, links)`` if None.
        temperature: relative softness (``DEFAULT_TEMPERATURE``).

    Returns:
        (flows,) completion times in seconds from time 0.

    Examples:
        >>> import jax.numpy as jnp
        >>> t = completion_times_s(jnp.ones((2, 1)), jnp.array([10.0]), jnp.zeros(1),
        ...                        jnp.array([10.0, 20.0]))
        >>> [round(float(x), 3) for x in t]
        [2.0, 3.0]
    """
    n_flows = incidence.shape[0]
    dtype = incidence.dtype
    phases = (n_flows if start_s is None else 2 * n_flows) if phases is None else phases
    live = (flow_bytes > 0) & (jnp.sum(incidence, axis=1) > 0)
    size = jnp.where(live, flow_bytes, 1.0)
    copies = jnp.ones((n_flows,), dtype) if multiplicity is None else multiplicity
    start = jnp.zeros((n_flows,), dtype) if start_s is None else start_s
    # every running flow gets at least the first water level, so all finish by half this
    # horizon; it caps the phases that come after the last event
    first_level = smooth.safe_div(
        1.0, smooth.smooth_max(copies @ incidence / capacity_Bps, temperature=temperature)
    )
    horizon = 2.0 * (
        smooth.smooth_max(start, temperature=temperature)
        + smooth.safe_div(smooth.smooth_max(size, temperature=temperature), first_level)
    )
    floor = DONE_FLOOR * horizon

    def phase(carry, _):
        running, waiting, sent, elapsed, clock = carry
        rates = max_min_rates(incidence, capacity_Bps, running * copies, rounds, temperature)
        left = size * smooth.smax2(1.0 - sent, 0.0, temperature)
        finish = smooth.safe_div(running * rates, left + (1.0 - running) * DONE_FLOOR * size)
        until = smooth.clip_exact(start - clock, 0.0, horizon)  # a start's event rate: 1/until
        arrive = waiting / (until + floor)
        top = smooth.softmax_mean(jnp.concatenate([finish, arrive]), temperature=temperature)
        dt = _capped_inverse(top, horizon, temperature)
        elapsed = elapsed + (running + waiting) * dt
        sent = sent + (1.0 - waiting) * rates * dt / size  # a waiting flow sends nothing
        keep_running = jnp.exp(_gate_log_open(finish, top, temperature))
        keep_waiting = jnp.exp(_gate_log_open(arrive, top, temperature))
        running = running * keep_running + waiting * (1.0 - keep_waiting)
        return (running, waiting * keep_waiting, sent, elapsed, clock + dt), None

    later = live & (start > 0)
    zeros = jnp.zeros((n_flows,), dtype)
    init = ((live & ~later).astype(dtype), later.astype(dtype), zeros, zeros, jnp.zeros((), dtype))
    (_, waiting, _, elapsed, _), _ = jax.lax.scan(phase, init, None, length=phases)
    # a flow without bytes or links completes at its start
    return jnp.where(live, elapsed, start) + incidence @ latency_s


def group_makespan_s(
    completion_s: jax.Array,
    group: jax.Array,
    n_groups: int,
    temperature: float = DEFAULT_TEMPERATURE,
) -> jax.Array:
    """The smooth maximum completion time of each group of flows (a collective, a send).

    Args:
        completion_s: (flows,) completion times, >= 0.
        group: (flows,) int, the group of each flow in ``[0, n_groups)``; -1 for none.
        n_groups: number of groups (static).
        temperature: relative softness.

    Returns:
        (n_groups,) seconds; 0 for a group without flows.
    """
    member = group[None, :] == jnp.arange(n_groups)[:, None]
    return smooth.softmax_mean(
        jnp.where(member, completion_s[None, :], 0.0), axis=-1, temperature=temperature
    )


def makespan_s(
    incidence: jax.Array,
    capacity_Bps: jax.Array,
    latency_s: jax.Array,
    flow_bytes: jax.Array,
    group: jax.Array,
    n_groups: int,
    multiplicity: jax.Array | None = None,
    start_s: jax.Array | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
) -> jax.Array:
    """Makespan of each of ``n_groups`` concurrent groups of flows (from time 0).

    ``completion_times_s`` then ``group_makespan_s``; the arguments are theirs.

    Returns:
        (n_groups,) seconds.
    """
    done = completion_times_s(
        incidence,
        capacity_Bps,
        latency_s,
        flow_bytes,
        multiplicity=multiplicity,
        start_s=start_s,
        temperature=temperature,
    )
    return group_makespan_s(done, group, n_groups, temperature)


def _few_rates(work_s, crosses, running, rounds, cap, temperature):
    """Max-min fair rates (flow units/s) of a few flows on links of capacity one, by
    ``rounds`` unrolled water-filling rounds (``few_flows_completion_s``).

    Args:
        work_s: ``[flow][link]`` seconds one unit of each flow takes on each link alone.
        crosses: ``[flow][link]`` bool, the flow crosses the link.
        running: ``[flow]`` weight of each flow in [0, 1].
        rounds: static; exact for ``rounds`` running flows.
        cap: the largest level (numerical: above every real level).

    Returns:
        ``[flow]`` rates; a flow that does not run gets the level it would join at.
    """
    links = range(len(work_s[0]))
    load = [[w * r for w in row] for row, r in zip(work_s, running)]
    active = [jnp.ones_like(r) for r in running]
    frozen = [jnp.zeros_like(r) for r in running]
    for r in range(rounds):
        unfrozen = [smooth.sum_of([row[k] * a for row, a in zip(load, active)]) for k in links]
        if r == 0:
            rem = [1.0 for _ in links]
        else:
            used = [smooth.sum_of([row[k] * z for row, z in zip(load, frozen)]) for k in links]
            rem = [smooth.clip_exact(1.0 - u, 0, 1) for u in used]
        congestion = [u / (c + CAPACITY_FLOOR) for u, c in zip(unfrozen, rem)]
        top = smooth.softmax_mean_of(congestion, temperature=temperature)
        level = _min_inverse(top, cap)
        if r == rounds - 1:
            return [z + a * level for z, a in zip(frozen, active)]
        keep = [_gate_keep(c, top, temperature) for c in congestion]  # 1 - saturated
        still = [
            a * _prod_of([jnp.where(on[k], keep[k], 1.0) for k in links])
            for a, on in zip(active, crosses)
        ]
        frozen = [z + (a - s) * level for z, a, s in zip(frozen, active, still)]
        active = still


def _prod_of(xs):
    return math.prod(xs[1:], start=xs[0])


def _min_inverse(x, cap):
    """``min(1 / x, cap)`` for ``x >= 0``, ``cap >= 0``, without forming ``1 / x`` above the cap
    (double ``where``): finite, with a finite gradient, where ``x`` is 0."""
    ok = x * cap > 1.0
    return jnp.where(ok, 1.0 / jnp.where(ok, x, 1.0), cap)


def _gate_keep(x, xstar, temperature):
    """The square of 1 - the gate of ``_gate_log_open``: the same gate, shut to ``exp(-2 *
    GATE_SLACK)`` at the maximum, so that what it leaves of a frozen or finished flow on a
    saturated link (over the ``CAPACITY_FLOOR``) stays below the congestion of links 1e4
    times less loaded."""
    on, arg = _gate_arg(x, xstar, temperature)
    return jnp.where(on, jax.nn.sigmoid(-arg) ** 2, 1.0)


def few_flows_completion_s(
    incidence: jax.Array, capacity_Bps: jax.Array, temperature: float = DEFAULT_TEMPERATURE
) -> jax.Array:
    """When each of a few flows of one unit that start together finishes, sharing links
    max-min fairly: ``completion_times_s`` with unit sizes, no latency and no starts,
    specialised for a handful of flows (``diffcost.network.model.shared_delays_s``: three).

    The phases and rounds are unrolled: phase ``p`` has at most ``flows - p`` flows running and
    runs that many rounds (``flows (flows + 1) / 2`` rounds in all, against ``flows ** 2`` for
    ``completion_times_s``), the last round of a phase forms no gates, a flow's share of a link
    is kept as seconds per unit over a capacity of one, and the levels and phase lengths are
    capped exactly (``min(1 / top, cap)``, far above every real value) instead of smoothly.
    The gates, their slack and the smooth maxima are ``completion_times_s``'s, so is the error.
    ``few_flows_of`` is the same on lists of per-flow, per-link values.

    Args:
        incidence: (flows, links) bytes one unit of each flow puts on each link, >= 0 (any
            scale: a zero row is an absent flow).
        capacity_Bps: (links,) bytes/s, > 0.
        temperature: relative softness (``DEFAULT_TEMPERATURE``).

    Returns:
        (flows,) seconds from time 0; 0 for an absent flow.

    Examples:
        >>> import jax.numpy as jnp
        >>> rows = jnp.array([[10.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
        >>> t = few_flows_completion_s(rows, jnp.array([10.0, 10.0]))
        >>> [round(float(x), 3) for x in t]
        [2.0, 2.0, 1.0]
    """
    flows, links = incidence.shape
    rows = [[incidence[f, k] for k in range(links)] for f in range(flows)]
    together, _ = few_flows_of(rows, [capacity_Bps[k] for k in range(links)], temperature)
    return jnp.stack(together)


def few_flows_of(rows, capacity_Bps, temperature: float = DEFAULT_TEMPERATURE):
    """``few_flows_completion_s`` on ``rows`` (``[flow][link]`` bytes, arrays of one shape) and
    ``capacity_Bps`` (``[link]``), element by element: ``([flow] completion together, [flow]
    completion alone)``, alone the smooth maximum over the links of bytes over capacity.

    Lists of arrays and no stacked axes: in a batched sweep the flows and links are then
    elementwise arithmetic that fuses, where small trailing axes of three would be reduced
    and broadcast as separate loops.
    """
    n = len(rows)
    work_s = [[b / c for b, c in zip(row, capacity_Bps)] for row in rows]
    crosses = [[w > 0 for w in row] for row in work_s]
    alone_s = [smooth.smooth_max_of(row, temperature=CAP_TEMPERATURE) for row in work_s]
    running = [(a > 0).astype(a.dtype) for a in alone_s]
    # no level exceeds the sum of the alone rates, no phase the sum of the alone times
    cap = FEW_HEADROOM * jax.lax.stop_gradient(
        smooth.sum_of([smooth.safe_div(1.0, a) for a in alone_s])
    )
    horizon = FEW_HEADROOM * jax.lax.stop_gradient(smooth.sum_of(alone_s))
    left = [jnp.ones_like(r) for r in running]
    elapsed = [jnp.zeros_like(r) for r in running]
    for p in range(n):
        rates = _few_rates(work_s, crosses, running, n - p, cap, temperature)
        finish = [
            r * v / (x + (1.0 - r + DONE_FLOOR) * DONE_FLOOR)
            for r, v, x in zip(running, rates, left)
        ]
        top = smooth.softmax_mean_of(finish, temperature=temperature)
        dt = _min_inverse(top, horizon)
        elapsed = [e + r * dt for e, r in zip(elapsed, running)]
        if p < n - 1:
            left = [smooth.clip_exact(x - v * dt, 0.0, 1.0) for x, v in zip(left, rates)]
            running = [r * _gate_keep(f, top, temperature) for r, f in zip(running, finish)]
    return elapsed, alone_s
