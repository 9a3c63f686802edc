"""trace: write a reference run as a Chrome / Perfetto JSON trace (open in ui.perfetto.dev).

One process per stage, one thread per stream ("compute", "p2p send", "dp sync"). Transfers
that overlap on one stream (fair-shared sends) go to extra lanes ("p2p send #2") so that every
track holds properly nested slices.
"""

from __future__ import annotations

import json
import os
import re

from diffcost.reference import simulate_reference

STREAMS = ("compute", "p2p send", "dp sync")


def timeline_events(breakdown_stage_times, schedule: str | None = None):
    """``(track, name, start_s, dur_s)`` of every task and transfer of one iteration."""
    return simulate_reference(breakdown_stage_times, schedule, record=True).events


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _json_default(obj):
    return obj.tolist() if hasattr(obj, "tolist") else str(obj)


def trace_events(events) -> list[dict]:
    """Chrome trace events ("M" names, "X" slices in microseconds) for ``events``."""
    splits = [(t.rpartition("/")[0] or "iteration", t.rpartition("/")[2]) for t, *_ in events]
    procs = sorted({proc for proc, _ in splits}, key=_natural)
    pid = {proc: i for i, proc in enumerate(procs)}
    out = [
        e
        for proc in procs
        for e in (
            {"ph": "M", "name": "process_name", "pid": pid[proc], "args": {"name": proc}},
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid[proc],
                "args": {"sort_index": pid[proc]},
            },
        )
    ]
    streams = list(STREAMS) + sorted({s for _, s in splits} - set(STREAMS))
    lanes: dict[tuple[str, str], list[float]] = {}  # end time of each lane of a track
    order = sorted(range(len(events)), key=lambda i: (events[i][2], -events[i][3]))
    for i in order:
        (proc, stream), (_, name, start, dur) = splits[i], events[i]
        ends = lanes.setdefault((proc, stream), [])
        lane = next((k for k, end in enumerate(ends) if end <= start + 1e-15), len(ends))
        if lane == len(ends):
            ends.append(0.0)
            tid = 100 * streams.index(stream) + lane
            label = stream if lane == 0 else f"{stream} #{lane + 1}"
            out += [
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid[proc],
                    "tid": tid,
                    "args": {"name": label},
                },
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid[proc],
                    "tid": tid,
                    "args": {"sort_index": tid},
                },
            ]
        ends[lane] = start + dur
        out.append(
            {
                "ph": "X",
                "name": name,
                "cat": stream,
                "pid": pid[proc],
                "tid": 100 * streams.index(stream) + lane,
                "ts": start * 1e6,
                "dur": dur * 1e6,
            }
        )
    return out


def write_trace(path, result_events, meta: dict | None = None) -> str:
    """Write ``result_events`` (``(track, name, start_s, dur_s)``) as a JSON trace at ``path``."""
    doc = {
        "traceEvents": trace_events(result_events),
        "displayTimeUnit": "ms",
        "otherData": dict(meta or {}),
    }
    path = os.fspath(path)
    with open(path, "w") as fh:
        json.dump(doc, fh, default=_json_default)
    return path


MAX_TRACE_TASKS = 500_000


def write_experiment_trace(path, exp, params=None) -> str:
    """Predicted timeline of one experiment as a trace: the exact reference schedule of the
    per-stage times (``simulate.stage_times`` at temperature 0), then the optimizer step and the
    per-iteration overhead on an "iteration" track.

    Raises:
        ValueError: the iteration has more than ``MAX_TRACE_TASKS`` compute tasks.
    """
    from diffcost import api
    from diffcost.params import default_params
    from diffcost.simulate import stage_times

    plan = exp.plan
    n_micro = plan.global_batch / (plan.dp * plan.microbatch)
    chunks = plan.chunks if plan.schedule == "interleaved" else 1
    tasks = 2 * n_micro * plan.pp * chunks
    if tasks > MAX_TRACE_TASKS:
        raise ValueError(
            f"a trace of {tasks:,.0f} compute tasks is too large (limit {MAX_TRACE_TASKS:,}); "
            "lower plan.global_batch for the trace"
        )
    model, plan_a, cluster = api.experiment_arrays(exp)
    params = default_params() if params is None else params
    st = stage_times(model, plan_a, cluster, params, 0.0)
    result = simulate_reference(st, plan.schedule, record=True)
    events = list(result.events)
    t = result.iteration_s - float(st.optimizer_s) - float(st.overhead_s)
    events.append(("iteration/optimizer", "optimizer step", t, float(st.optimizer_s)))
    events.append(
        (
            "iteration/overhead",
            "per-iteration overhead",
            t + float(st.optimizer_s),
            float(st.overhead_s),
        )
    )
    meta = {
        "model": exp.model.name,
        "cluster": exp.cluster.name,
        "plan": str(exp.plan),
        "iteration_s": result.iteration_s,
    }
    return write_trace(path, events, meta)
