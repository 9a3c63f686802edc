"""sharing_reference: exact, event-driven max-min fair sharing of links, the oracle for sharing.

``diffcost.sharing`` computes max-min fair rates and completion times with a fixed number of
smooth water-filling rounds and phases. This module computes the same quantities exactly, in
plain numpy with hard minima (no JAX), so tests and ``benchmarks/topology.py`` can measure the
smooth model's error:

* ``max_min_rates``: progressive filling. All unfrozen flows rise at one level; the level at
  which link ``l`` saturates is its remaining capacity over the unfrozen flows' fractions on
  it; at the lowest such level the flows crossing a saturated link freeze; repeat until every
  flow is frozen;
* ``completion_times_s``: a fluid, event-driven schedule. At every event (a flow finishing) the
  rates of the flows still running are recomputed by progressive filling, the clock advances
  to the next finish, and every running flow's remaining bytes drop by ``rate * dt``. A flow's
  completion is its finish plus its path latency ``incidence @ latency_s``.

The conventions are ``diffcost.sharing``'s (its module docstring): a flow of 0 bytes or one that
crosses no link takes no time beyond its path latency.
"""

from __future__ import annotations

import numpy as np

# levels and finish times within this relative distance of the minimum count as ties
_TIE = 1e-12


def max_min_rates(incidence, capacity_Bps, running=None) -> np.ndarray:
    """Exact max-min fair rates by progressive filling.

    Args:
        incidence: (flows, links) fraction of each flow's bytes crossing each link.
        capacity_Bps: (links,) bytes/s, > 0.
        running: (flows,) bool, the flows that compete; all if None.

    Returns:
        (flows,) bytes/s; 0 for a flow that does not run or crosses no link.

    Raises:
        ValueError: shapes disagree, or a capacity is not positive, or a fraction is outside
            [0, 1].
    """
    a = np.asarray(incidence, dtype=float)
    cap = np.asarray(capacity_Bps, dtype=float)
    _check(a, cap)
    running = np.ones(a.shape[0], bool) if running is None else np.asarray(running, bool)
    crosses = a > 0
    unfrozen = running & crosses.any(axis=1)
    rates = np.zeros(a.shape[0])
    while unfrozen.any():
        weight = a[unfrozen].sum(axis=0)
        used = a[running & ~unfrozen].T @ rates[running & ~unfrozen]
        on = weight > 0
        levels = np.full(cap.shape, np.inf)
        levels[on] = np.maximum(cap[on] - used[on], 0.0) / weight[on]
        level = levels.min()
        saturated = levels <= level * (1.0 + _TIE)
        freeze = unfrozen & crosses[:, saturated].any(axis=1)
        rates[freeze] = level
        unfrozen &= ~freeze
    return rates


def completion_times_s(incidence, capacity_Bps, latency_s, flow_bytes) -> np.ndarray:
    """Exact completion times of flows that start together and share links max-min fairly.

    Args:
        incidence: (flows, links) fraction of each flow's bytes crossing each link.
        capacity_Bps: (links,) bytes/s, > 0.
        latency_s: (links,) seconds, >= 0.
        flow_bytes: (flows,) bytes, >= 0.

    Returns:
        (flows,) seconds from the common start.

    Raises:
        ValueError: as ``max_min_rates``, or a negative size or latency.
    """
    a = np.asarray(incidence, dtype=float)
    size = np.asarray(flow_bytes, dtype=float)
    lat = np.asarray(latency_s, dtype=float)
    if size.shape != (a.shape[0],) or (size < 0).any():
        raise ValueError(f"flow_bytes: need {a.shape[0]} sizes >= 0, got {size!r}")
    if lat.shape != (a.shape[1],) or (lat < 0).any():
        raise ValueError(f"latency_s: need {a.shape[1]} latencies >= 0, got {lat!r}")
    left = size.copy()
    running = (size > 0) & (a > 0).any(axis=1)
    finish = np.zeros(a.shape[0])
    now = 0.0
    while running.any():
        rates = max_min_rates(a, capacity_Bps, running)
        to_go = np.full(a.shape[0], np.inf)
        to_go[running] = left[running] / rates[running]
        dt = to_go.min()
        done = running & (to_go <= dt * (1.0 + _TIE))
        now += dt
        left[running] -= rates[running] * dt
        finish[done] = now
        running &= ~done
    return finish + a @ lat


def group_makespan_s(completion_s, group, n_groups: int) -> np.ndarray:
    """The largest completion time of each group (0 for a group without flows)."""
    out = np.zeros(n_groups)
    for g, t in zip(np.asarray(group), np.asarray(completion_s, dtype=float)):
        if 0 <= g < n_groups:
            out[g] = max(out[g], t)
    return out


def _check(a: np.ndarray, cap: np.ndarray) -> None:
    if a.ndim != 2 or cap.shape != (a.shape[1],):
        raise ValueError(
            f"incidence (flows, links) {a.shape} and capacity_Bps (links,) {cap.shape} disagree"
        )
    if not (cap > 0).all():
        raise ValueError(f"capacity_Bps: every link needs a capacity > 0, got {cap.min()}")
    if (a < 0).any() or (a > 1).any():
        raise ValueError("incidence: fractions must lie in [0, 1]")
