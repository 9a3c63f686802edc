"""Pipeline schedules as registered entries: closed form, sends, memory depth, task order.

Each :class:`Schedule` gives what the rest of the model needs to know about one schedule:

* ``makespan_fn(pipe, temperature)``: the compute makespan of one iteration's pipeline in
  closed form (``diffcost.simulate.pipeline_time`` mixes them by the plan's schedule weights);
* ``sends_fn(pipe)``: the pipeline sends on its critical path;
* ``in_flight_fn(p, m, v, temperature)``: microbatches whose activations the first and the last
  stage hold at once (``diffcost.simulate.memory``);
* ``order_fn(s, p, m, v)``: the exact compute-stream order of stage ``s`` as ``(F|B, microbatch,
  chunk)`` tasks, which ``diffcost.reference`` unrolls event by event;
* ``interleaved``: whether it runs ``v`` virtual stages (chunks) per rank.

``REGISTRY`` holds them in ``diffcost.specs.SCHEDULES`` order, the order of the plan's one-hot
``schedule`` weights; adding a schedule is one ``register`` call here and its name there.

References:
    Huang et al., "GPipe" (2019); Narayanan et al., "PipeDream-Flush" / Megatron-LM 1F1B and
    interleaved schedules (SC 2021), Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from diffcost import smooth
from diffcost.specs import SCHEDULES


class Pipeline(NamedTuple):
    """One iteration's pipeline, per stage kind (first, middle, last) where shaped [3].

    ``fwd_s`` and ``bwd_s`` are zero for stage kinds that do not exist; ``work_s = fwd + bwd``
    of the kinds that exist, ``w_s`` of every kind, ``sum_w_s`` the work of one microbatch
    through all stages, ``w_max_s`` the bottleneck's work (smooth), ``multi`` 0 with one stage
    and 1 with two or more, ``send_s`` one activation send.
    """

    p: jax.Array
    m: jax.Array
    v: jax.Array
    multi: jax.Array
    middle: jax.Array
    fwd_s: jax.Array
    bwd_s: jax.Array
    w_s: jax.Array
    sum_w_s: jax.Array
    w_max_s: jax.Array
    send_s: jax.Array


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One pipeline schedule (see the module docstring for each function)."""

    name: str
    makespan_fn: Callable[[Pipeline, float], jax.Array]
    sends_fn: Callable[[Pipeline], jax.Array]
    in_flight_fn: Callable[..., tuple[jax.Array, jax.Array]]
    order_fn: Callable[[int, int, int, int], list[tuple[str, int, int]]]
    interleaved: bool = False


REGISTRY: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    """Add ``schedule`` to ``REGISTRY`` (its name must be one of ``specs.SCHEDULES``)."""
    if schedule.name not in SCHEDULES:
        raise ValueError(f"schedule {schedule.name!r} is not in specs.SCHEDULES {SCHEDULES}")
    REGISTRY[schedule.name] = schedule
    return schedule


def _flat_sends(pipe: Pipeline):
    return 2.0 * (pipe.p - 1.0) * pipe.send_s


# --- GPipe: all forwards, then all backwards ---------------------------------------------


def _gpipe_makespan(pipe: Pipeline, tau):
    """``sum W + (m - 1) (max F + max B)``."""
    slowest = smooth.smooth_max(pipe.fwd_s, temperature=tau)
    slowest = slowest + smooth.smooth_max(pipe.bwd_s, temperature=tau)
    return pipe.sum_w_s + (pipe.m - 1.0) * slowest


def _gpipe_order(s, p, m, v):
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


register(Schedule("gpipe", _gpipe_makespan, _flat_sends, lambda p, m, v, tau: (m, m), _gpipe_order))


# --- 1F1B (PipeDream-flush) ---------------------------------------------------------------


def _one_f_one_b_makespan(pipe: Pipeline, tau):
    """With ``m >= p``: the slowest of three critical paths (bottleneck last, first, or in the
    middle, idling while round trips cross the stages after it), plus ``(m - 1) max(0, (sum W +
    2 (p - 1) s) / p - max W)`` for the round trip when warmup leaves no slack; with fewer
    microbatches than stages, ``sum W + (m - 1) max W``."""
    p, m = pipe.p, pipe.m
    w0, w1, w2 = pipe.w_s
    simple = pipe.sum_w_s + (m - 1.0) * pipe.w_max_s
    paths = jnp.stack(
        [
            pipe.sum_w_s + (m - 1.0) * w2,
            m * w0 + smooth.smooth_relu(2.0 * (w2 + (p - 2.0) * w1) - (p - 1.0) * w0, w0, tau),
            pipe.middle * (w0 + 2.0 * w2 + (m + p - 4.0) * w1),
        ]
    )
    steady = pipe.multi * smooth.clip_exact(m - p + 1.0, 0.0, 1.0)  # m >= p >= 2
    makespan = steady * smooth.smooth_max(paths, temperature=tau) + (1.0 - steady) * simple
    round_trip = (pipe.sum_w_s + _flat_sends(pipe)) / p
    wait = pipe.multi * smooth.smooth_relu(round_trip - pipe.w_max_s, pipe.w_max_s, tau)
    return makespan + (m - 1.0) * wait


def _one_f_one_b_order(s, p, m, v):
    # warm up with the forwards the stages below still need, then one forward / one backward,
    # then drain the backwards still owed
    w = min(p - s - 1, m)
    order = [("F", i, 0) for i in range(w)]
    for k in range(m - w):
        order += [("F", w + k, 0), ("B", k, 0)]
    return order + [("B", i, 0) for i in range(m - w, m)]


register(
    Schedule(
        "1f1b",
        _one_f_one_b_makespan,
        _flat_sends,
        lambda p, m, v, tau: (smooth.smin2(p, m, tau), jnp.ones_like(m)),
        _one_f_one_b_order,
    )
)


# --- interleaved (v virtual stages per rank) ----------------------------------------------


def _interleaved_makespan(pipe: Pipeline, tau):
    """``m max W + (sum W - max W) / v``."""
    return pipe.m * pipe.w_max_s + (pipe.sum_w_s - pipe.w_max_s) / pipe.v


def _interleaved_in_flight(p, m, v, tau):
    """Stage-loads of activations held at the peak by the first and the last rank.

    Rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) p`` chunk forwards and holds one more
    in the steady state, each chunk ``1 / v`` of the rank's layers (Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``; ``_interleaved_order`` below): the first
    rank ``p (1 + (p - 1) / (p v))`` (Korthikanti et al. 2022, sec. 4.2.3, the
    ``interleaved_schedule_memory_penalty`` of Megatron-LM's theoretical memory), the last
    ``p - (p - 1) / v``. With ``m = p`` every forward runs first and each rank holds all ``m``.
    """
    first = smooth.smin2(p * (1.0 + (p - 1.0) / (p * v)), m, tau)
    all_warm = 1.0 - smooth.clip_exact(m - p, 0.0, 1.0)  # 1 at m = p
    last = smooth.smin2(p - (p - 1.0) / v, m, tau)
    return first, all_warm * m + (1.0 - all_warm) * last


def _interleaved_order(s, p, m, v):
    # "virtual microbatches" k = 0 .. m v - 1 go through the chunks in groups of p
    # microbatches; backwards visit the chunks in reverse. Stage s warms up with
    # 2 (p - s - 1) + (v - 1) p forwards (all of them when m == p), then alternates forward
    # k + warmup / backward k, then drains.
    if m % p:
        raise ValueError(f"interleaved needs microbatches ({m}) divisible by stages ({p})")
    total = m * v

    def task(kind, k):
        chunk = (k // p) % v
        return kind, (k // (p * v)) * p + k % p, (chunk if kind == "F" else v - 1 - chunk)

    warm = total if m == p else min(2 * (p - s - 1) + (v - 1) * p, total)
    order = [task("F", k) for k in range(warm)]
    for k in range(total - warm):
        order += [task("F", k + warm), task("B", k)]
    return order + [task("B", k) for k in range(total - warm, total)]


register(
    Schedule(
        "interleaved",
        _interleaved_makespan,
        lambda pipe: 2.0 * (pipe.p * pipe.v - 1.0) * pipe.send_s * pipe.multi,
        _interleaved_in_flight,
        _interleaved_order,
        interleaved=True,
    )
)

if tuple(REGISTRY) != SCHEDULES:
    raise ImportError(f"schedules registered {tuple(REGISTRY)}, specs.SCHEDULES {SCHEDULES}")


def interleaved_weight(weights):
    """The weight of the interleaved schedules in a plan's one-hot (or relaxed) ``schedule``."""
    return sum(weights[k] for k, s in enumerate(REGISTRY.values()) if s.interleaved)


def mix(weights, values):
    """``sum_k weights[k] * values[k]`` over the registry's schedules."""
    return sum(w * x for w, x in zip(weights, values))
