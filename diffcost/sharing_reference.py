"""sharing_reference: exact, event-driven max-min fair sharing of links, the oracle for sharing.

``diffcost.sharing`` computes max-min fair rates and completion times with a fixed number of
smooth water-filling rounds and phases. This module computes the same quantities exactly, in
plain numpy with hard minima (no JAX), so tests and ``benchmarks/topology.py`` can measure the
smooth model's error:

* ``max_min_rates``: progressive filling. All unfrozen flows rise at one level; the level at
  which link ``l`` saturates is its remaining capacity over the unfrozen flows' fractions on
  it; at the lowest such level the flows crossing a saturated link freeze; repeat until every
  flow is frozen;
* ``completion_times_s``: a fluid, event-driven schedule. At every event (a flow starting or
  finishing) the rates of the running flows are recomputed by progressive filling, the clock
  advances to the next event, and every running flow's remaining bytes drop by ``rate * dt``.
  A flow's completion is its finish plus its path latency ``incidence @ latency_s``.

The conventions are ``diffcost.sharing``'s (its module docstring): a flow of 0 bytes or one that
crosses no link finishes at its start (plus its path latency).
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
        ValueError: malformed inputs (``check_flows``).
    """
    a = np.asarray(incidence, dtype=float)
    cap = np.asarray(capacity_Bps, dtype=float)
    check_flows(a, cap)
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


def completion_times_s(
    incidence, capacity_Bps, latency_s, flow_bytes, multiplicity=None, start_s=None
) -> np.ndarray:
    """Exact completion times of flows that share links max-min fairly.

    Args:
        incidence: (flows, links) fraction of each flow's bytes crossing each link.
        capacity_Bps: (links,) bytes/s, > 0.
        latency_s: (links,) seconds, >= 0.
        flow_bytes: (flows,) bytes, >= 0.
        multiplicity: (flows,) int >= 1, identical flows each row stands for; they are
            simulated as separate flows. Ones if None.
        start_s: (flows,) seconds >= 0, when each flow starts; all at 0 if None.

    Returns:
        (flows,) seconds from time 0.

    Raises:
        ValueError: malformed inputs (``check_flows``).
    """
    a = np.asarray(incidence, dtype=float)
    size = np.asarray(flow_bytes, dtype=float)
    lat = np.asarray(latency_s, dtype=float)
    check_flows(a, capacity_Bps, lat, size)
    start = np.zeros(len(size)) if start_s is None else np.asarray(start_s, dtype=float)
    if start.shape != size.shape or not np.isfinite(start).all() or (start < 0).any():
        raise ValueError(f"start_s: need {size.shape} finite times >= 0, got {start}")
    if multiplicity is not None:
        copies = np.asarray(multiplicity)
        if copies.shape != size.shape or (copies < 1).any() or (copies != np.round(copies)).any():
            raise ValueError(f"multiplicity: need {size.shape} whole numbers >= 1, got {copies}")
        rows = np.repeat(np.arange(len(size)), copies.astype(int))
        done = completion_times_s(a[rows], capacity_Bps, lat, size[rows], start_s=start[rows])
        return done[np.searchsorted(rows, np.arange(len(size)))]
    return _fluid_schedule(a, capacity_Bps, size, start) + a @ lat


def _fluid_schedule(a, capacity_Bps, size, start) -> np.ndarray:
    """Finish times of the flows: events are starts and finishes; rates are recomputed at each."""
    live = (size > 0) & (a > 0).any(axis=1)
    left = size.copy()
    finish = start.copy()  # a flow without bytes or links finishes at its start
    waiting = live & (start > 0)
    running = live & ~waiting
    now = 0.0
    while running.any() or waiting.any():
        rates = max_min_rates(a, capacity_Bps, running)
        to_go = np.full(a.shape[0], np.inf)
        to_go[running] = left[running] / rates[running]
        to_start = np.where(waiting, start - now, np.inf)
        dt = min(to_go.min(), to_start.min())
        done = running & (to_go <= dt * (1.0 + _TIE))
        arrived = waiting & (to_start <= dt * (1.0 + _TIE))
        now += dt
        left[running] -= rates[running] * dt
        finish[done] = now
        running = (running & ~done) | arrived
        waiting &= ~arrived
    return finish


def group_makespan_s(completion_s, group, n_groups: int) -> np.ndarray:
    """The largest completion time of each group (0 for a group without flows)."""
    out = np.zeros(n_groups)
    for g, t in zip(np.asarray(group), np.asarray(completion_s, dtype=float)):
        if 0 <= g < n_groups:
            out[g] = max(out[g], t)
    return out


def check_flows(incidence, capacity_Bps, latency_s=None, flow_bytes=None) -> None:
    """Raise a ``ValueError`` naming the field and the value when the inputs of a sharing
    computation are malformed: shapes that disagree, a capacity that is not positive, a
    fraction outside [0, 1], a negative latency or size, or a value that is not finite.

    Args:
        incidence: (flows, links). capacity_Bps: (links,). latency_s: (links,) or None.
        flow_bytes: (flows,) or None.
    """
    a = np.asarray(incidence, dtype=float)
    cap = np.asarray(capacity_Bps, dtype=float)
    if a.ndim != 2:
        raise ValueError(f"incidence: need a (flows, links) array, got shape {a.shape}")
    named = {"incidence": a, "capacity_Bps": cap}
    n_flows, n_links = a.shape
    shapes = {"capacity_Bps": (n_links,), "latency_s": (n_links,), "flow_bytes": (n_flows,)}
    for name, x in (("latency_s", latency_s), ("flow_bytes", flow_bytes)):
        if x is not None:
            named[name] = np.asarray(x, dtype=float)
    for name, x in named.items():
        if name != "incidence" and x.shape != shapes[name]:
            raise ValueError(
                f"{name}: need shape {shapes[name]} for incidence of shape {a.shape}, got {x.shape}"
            )
        if not np.isfinite(x).all():
            raise ValueError(f"{name}: every value must be finite, got {x[~np.isfinite(x)][0]}")
    if not (cap > 0).all():
        bad = int(np.argmin(cap))
        raise ValueError(f"capacity_Bps: link {bad} has capacity {cap[bad]}; need > 0")
    if (a < 0).any() or (a > 1).any():
        f, k = np.argwhere((a < 0) | (a > 1))[0]
        raise ValueError(f"incidence: flow {f}, link {k} has fraction {a[f, k]}; need [0, 1]")
    for name in ("latency_s", "flow_bytes"):
        if name in named and (named[name] < 0).any():
            bad = int(np.argmin(named[name]))
            raise ValueError(f"{name}: entry {bad} is {named[name][bad]}; need >= 0")
