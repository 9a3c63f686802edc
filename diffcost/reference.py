"""reference: an exact, event-driven simulation of one iteration, the oracle for the closed form.

``diffcost.simulate`` composes an iteration in closed form from the repeated units in a
``StageTimes``. This module unrolls the same execution graph task by task with hard maxima, in
plain Python (no JAX), so tests can check the closed form against it:

* every stage has a **compute stream** that runs its forward and backward tasks one at a time,
  strictly in the order of the pipeline schedule (``stage_order``); a task starts once the
  previous task on the stream has finished and its dependencies have arrived;
* a forward needs the previous virtual stage's forward of the same microbatch, a backward the
  next virtual stage's backward and its own forward; between two physical stages the
  activation (or its gradient) is a **send** of ``p2p_s`` seconds of work on a link;
* links are **fluid, processor-sharing** resources: the transfers active on a link share it
  equally, and remaining work is recomputed at every event. Forward sends use the link
  ``(src -> dst)``; backward sends leaving stage ``s`` use ``nic s``, which the stage's
  data-parallel transfers use too;
* every stage has a **DP stream**: the gradient buckets of its last backward (one per layer,
  ``dp_bucket_s`` of work each) become ready at the layer cadence ``layer_bwd_s`` from the start
  of that backward (all at its end without ``overlap_dp``) and go FIFO, one at a time, on
  ``nic s``; then ``dp_after_s`` of non-overlappable sync, once the stage's compute has ended.
  With interleaving each chunk's last backward emits that chunk's ``dp_layers / v`` buckets
  (``dp_buckets="per_chunk"``, the default; see ``simulate_reference``).

Iteration = max over stages of max(compute end, DP end) + optimizer + overhead.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable

import numpy as np

from diffcost import schedules

SCHEDULES = tuple(schedules.REGISTRY)
_EPS = 1e-12  # a transfer is complete when less than this fraction of its work remains


@dataclasses.dataclass
class ReferenceResult:
    """One unrolled iteration (seconds).

    ``events`` (with ``record=True``) holds ``(track, name, start_s, dur_s)`` with tracks named
    ``"stage <s>/compute"``, ``"stage <s>/p2p send"`` and ``"stage <s>/dp sync"``.
    """

    iteration_s: float
    pipeline_s: float  # max over stages of the compute stream's end
    dp_tail_s: float  # iteration - optimizer - overhead - pipeline
    compute_end_s: list[float]  # per stage
    stage_end_s: list[float]  # per stage: max(compute end, DP end)
    events: list[tuple[str, str, float, float]] | None = None


def schedule_name(st) -> str:
    """The schedule a one-hot ``st.schedule`` selects."""
    return SCHEDULES[int(np.argmax(np.asarray(st.schedule, dtype=float)))]


def stage_order(schedule: str, s: int, p: int, m: int, v: int = 1) -> list[tuple[str, int, int]]:
    """Compute-stream order of stage ``s``: a list of ``(F|B, microbatch, chunk)``, as the
    schedule's entry in ``diffcost.schedules`` gives it."""
    if schedule not in schedules.REGISTRY:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    return schedules.REGISTRY[schedule].order_fn(s, p, m, v)


# relative resolution of the event clock: remainders below it cannot advance ``now``
_CLOCK_RESOLUTION = 1e-12


class _Links:
    """Fluid links: the transfers active on a link progress at ``1 / n_active`` each."""

    def __init__(self):
        self.active: dict[str, list[list]] = {}  # link -> [[remaining, work, on_done], ...]

    def start(self, link: str, work: float, on_done: Callable[[], None]) -> None:
        self.active.setdefault(link, []).append([work, work, on_done])

    def next_time(self, now: float) -> float:
        t = math.inf
        for xs in self.active.values():
            if xs:
                t = min(t, now + min(x[0] for x in xs) * len(xs))
        return t

    def advance(self, dt: float, resolution: float = 0.0) -> list[Callable[[], None]]:
        """Progress every transfer by ``dt``; return the callbacks of those that finished.

        A transfer whose remaining time is below ``resolution`` (what the clock can still
        resolve at the current time) finishes now: otherwise float rounding of ``now + dt``
        could stall the clock on a remainder it cannot step over.
        """
        done = []
        for link, xs in self.active.items():
            if not xs:
                continue
            for x in xs:
                x[0] -= dt / len(xs)
            finished = [x[0] <= _EPS * x[1] or x[0] * len(xs) <= resolution for x in xs]
            done += [x[2] for x, f in zip(xs, finished) if f]
            self.active[link] = [x for x, f in zip(xs, finished) if not f]
        return done


def simulate_reference(
    st, schedule: str | None = None, record: bool = False, dp_buckets: str = "per_chunk"
) -> ReferenceResult:
    """Unroll one iteration of a concrete ``StageTimes`` event by event.

    Args:
        st: a ``diffcost.simulate.StageTimes`` (or anything with its fields) of concrete values.
        schedule: "gpipe", "1f1b" or "interleaved"; the argmax of ``st.schedule`` if None.
        record: keep every task and transfer as ``(track, name, start_s, dur_s)``.
        dp_buckets: interleaved with ``overlap_dp`` only. "per_chunk": the last backward of
            each chunk emits that chunk's ``dp_layers / v`` buckets at the layer cadence from
            its own start. "final_task": all ``dp_layers`` buckets follow the cadence from the
            start of the stage's final task (the last microbatch's chunk-0 backward, which lasts
            ``bwd_s / v``), so most of them become ready after the compute has ended.

    Returns:
        A ``ReferenceResult``.

    Raises:
        ValueError: fewer than one stage, microbatch or chunk, or an unknown ``dp_buckets``.
        RuntimeError: the schedule deadlocks (a task's dependencies never arrive).
    """
    run = _Run(st, schedule or schedule_name(st), record, dp_buckets)
    run.until_idle()
    p = run.p
    if any(run.nxt[s] < len(run.orders[s]) for s in range(p)) or not all(run.dp_after_started):
        raise RuntimeError(f"deadlock: schedule {run.schedule!r} stopped at positions {run.nxt}")
    stage_end = [max(run.compute_end[s], run.dp_end[s]) for s in range(p)]
    pipeline = max(run.compute_end)
    finish = max(stage_end)
    extra = float(np.asarray(st.optimizer_s)) + float(np.asarray(st.overhead_s))
    return ReferenceResult(
        iteration_s=finish + extra,
        pipeline_s=pipeline,
        dp_tail_s=finish - pipeline,
        compute_end_s=run.compute_end,
        stage_end_s=stage_end,
        events=run.events,
    )


def _bucket_emitters(orders, schedule, dp_buckets, overlap, n_buckets, v) -> list[dict]:
    """Per stage, {position in the order: buckets} of the backwards whose gradients are synced:
    the stage's final task, or (per_chunk, interleaved with overlap) each chunk's last one."""
    emit = [{len(order) - 1: n_buckets} for order in orders]
    if schedules.REGISTRY[schedule].interleaved and dp_buckets == "per_chunk" and overlap:
        for s, order in enumerate(orders):
            last = {c: pos for pos, (kd, _, c) in enumerate(order) if kd == "B"}
            emit[s] = {last[c]: n_buckets // v + (c < n_buckets % v) for c in range(v)}
    return emit


class _Run:
    """The state of one unrolled iteration: compute and DP streams per stage, links, events."""

    def __init__(self, st, schedule: str, record: bool, dp_buckets: str):
        if schedule not in schedules.REGISTRY:
            raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
        f = lambda x: np.asarray(x, dtype=float)  # noqa: E731
        self.fwd, self.bwd = f(st.fwd_s), f(st.bwd_s)
        self.bucket, self.layer_bwd, self.after = (
            f(st.dp_bucket_s),
            f(st.layer_bwd_s),
            f(st.dp_after_s),
        )
        self.p2p = float(f(st.p2p_s))
        p = self.p = int(round(float(f(st.n_stages))))
        m = int(round(float(f(st.n_microbatches))))
        n_buckets = int(round(float(f(st.dp_layers))))
        self.overlap = float(f(st.overlap_dp)) >= 0.5
        self.schedule = schedule
        v = self.v = (
            int(round(float(f(st.chunks)))) if schedules.REGISTRY[schedule].interleaved else 1
        )
        if p < 1 or m < 1 or v < 1:
            raise ValueError(f"need stages, microbatches and chunks >= 1, got {p}, {m}, {v}")
        if dp_buckets not in ("final_task", "per_chunk"):
            raise ValueError(f"unknown dp_buckets {dp_buckets!r}")
        self.n_virtual = p * v
        self.orders = [stage_order(schedule, s, p, m, v) for s in range(p)]
        self.emit = _bucket_emitters(self.orders, schedule, dp_buckets, self.overlap, n_buckets, v)
        # pending[(F|B, i, j)]: dependencies not yet arrived for microbatch i, virtual stage j.
        self.pending = {}
        for i in range(m):
            for j in range(self.n_virtual):
                self.pending[("F", i, j)] = int(j > 0)
                self.pending[("B", i, j)] = 1 + int(j < self.n_virtual - 1)
        self.events = [] if record else None
        self.heap: list = []
        self.seq = itertools.count()
        self.links = _Links()
        self.now = 0.0
        self.nxt = [0] * p  # next position in each stage's order
        self.busy = [False] * p
        self.compute_end = [0.0] * p
        self.dp_end = [0.0] * p
        self.dp_queue = [0] * p  # ready buckets waiting on the DP stream
        self.dp_busy = [False] * p
        self.dp_total = [sum(e.values()) for e in self.emit]
        self.dp_left = list(self.dp_total)  # buckets not yet synced
        self.dp_after_started = [False] * p
        self.dirty = set(range(p))

    def kind(self, s: int) -> int:
        """Index into the [3] arrays; a single stage is "first" (it holds the head)."""
        return 0 if s == 0 else (2 if s == self.p - 1 else 1)

    def at(self, t: float, fn) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), fn))

    def arrive(self, key) -> None:
        self.pending[key] -= 1
        self.dirty.add(key[2] % self.p)

    def transfer(self, link: str, work: float, track: str, name: str, on_done) -> None:
        t0 = self.now

        def done():
            if self.events is not None:
                self.events.append((track, name, t0, self.now - t0))
            on_done()

        if work <= 0.0:
            done()
        else:
            self.links.start(link, work, done)

    def send(self, s: int, key, link: str, label: str) -> None:
        """The activation (gradient) for ``key`` leaves stage ``s``: local or over ``link``."""
        dst = key[2] % self.p
        if dst == s:
            self.arrive(key)
        else:
            track = f"stage {s}/p2p send"
            self.transfer(link, self.p2p, track, f"{label} -> {dst}", lambda: self.arrive(key))

    def finish_task(self, s: int, pos: int, kd: str, i: int, j: int, t0: float) -> None:
        self.busy[s] = False
        self.compute_end[s] = self.now
        self.dirty.add(s)
        if self.events is not None:
            chunk = f".c{j // self.p}" if self.v > 1 else ""
            self.events.append((f"stage {s}/compute", f"{kd}{i}{chunk}", t0, self.now - t0))
        if kd == "F":
            self.arrive(("B", i, j))
            if j + 1 < self.n_virtual:
                self.send(s, ("F", i, j + 1), f"{s}->{(j + 1) % self.p}", f"F{i}")
        elif j > 0:
            self.send(s, ("B", i, j - 1), f"nic {s}", f"B{i}")
        if not self.overlap:  # every bucket is ready when the backward ends
            self.dp_queue[s] += self.emit[s].get(pos, 0)

    def bucket_ready(self, s: int) -> None:
        self.dp_queue[s] += 1
        self.dirty.add(s)

    def dp_done(self, s: int, is_bucket: bool) -> None:
        self.dp_busy[s] = False
        self.dp_end[s] = self.now
        if is_bucket:
            self.dp_left[s] -= 1
        self.dirty.add(s)

    def start_compute(self, s: int) -> None:
        """Start stage ``s``'s next task when the stream is free and its inputs have arrived."""
        if self.busy[s] or self.nxt[s] >= len(self.orders[s]):
            return
        kd, i, c = self.orders[s][self.nxt[s]]
        j = c * self.p + s
        if self.pending[(kd, i, j)]:
            return
        self.busy[s] = True
        self.nxt[s] += 1
        k = self.kind(s)
        dur = (self.fwd[k] if kd == "F" else self.bwd[k]) / self.v
        t0, pos, now = self.now, self.nxt[s] - 1, self.now
        self.at(now + dur, lambda: self.finish_task(s, pos, kd, i, j, t0))
        if self.overlap:  # one bucket per layer, at the layer cadence from the start
            for b in range(1, self.emit[s].get(pos, 0) + 1):
                self.at(now + b * self.layer_bwd[k], lambda: self.bucket_ready(s))

    def start_dp(self, s: int) -> None:
        """DP stream: buckets FIFO, then the non-overlappable sync after compute has ended."""
        if self.dp_busy[s]:
            return
        k, track = self.kind(s), f"stage {s}/dp sync"
        if self.dp_queue[s]:
            self.dp_queue[s] -= 1
            self.dp_busy[s] = True
            n = self.dp_total[s] - self.dp_left[s] + 1
            self.transfer(
                f"nic {s}", self.bucket[k], track, f"bucket {n}", lambda: self.dp_done(s, True)
            )
        elif (
            self.dp_left[s] == 0
            and self.nxt[s] == len(self.orders[s])
            and not self.busy[s]
            and not self.dp_after_started[s]
        ):
            self.dp_after_started[s] = True
            self.dp_busy[s] = True
            self.dp_end[s] = max(self.dp_end[s], self.now)
            self.transfer(
                f"nic {s}", self.after[k], track, "dp after", lambda: self.dp_done(s, False)
            )

    def until_idle(self) -> None:
        """Advance events and link transfers until nothing is left to run."""
        while True:
            while self.dirty:
                s = self.dirty.pop()
                self.start_compute(s)
                self.start_dp(s)
            t = min(self.heap[0][0] if self.heap else math.inf, self.links.next_time(self.now))
            if t == math.inf:
                return
            callbacks = self.links.advance(t - self.now, _CLOCK_RESOLUTION * max(1.0, abs(t)))
            self.now = t
            for cb in callbacks:
                cb()
            while self.heap and self.heap[0][0] <= self.now:
                heapq.heappop(self.heap)[2]()
