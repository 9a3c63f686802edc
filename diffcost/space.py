"""The discrete plan space of a model on a GPU count: enumerate every valid plan as arrays.

Used by sweeps and benchmarks. Plans are produced directly as a batched ``PlanArrays`` (numpy
leaves, leading axis = configuration) so that millions of them cost no Python objects each.
"""

from __future__ import annotations

import itertools

import numpy as np

from diffcost.arrays import PlanArrays
from diffcost.config import _divisors
from diffcost.specs import RECOMPUTE_MODES, SCHEDULES, ZERO_STAGES, ModelSpec


def degree_tuples(n_gpus: int, model: ModelSpec, max_cp: int = 8):
    """(tp, pp, dp, cp) with ``tp*pp*dp*cp == n_gpus`` that pass the structural checks."""
    out = []
    for tp in _divisors(n_gpus):
        if model.heads % tp or model.kv_heads % tp:
            continue
        for pp in _divisors(n_gpus // tp):
            if model.n_layers % pp:
                continue
            for cp in _divisors(n_gpus // (tp * pp)):
                if cp > max_cp or model.seq_len % (2 * cp if cp > 1 else 1):
                    continue
                out.append((tp, pp, n_gpus // (tp * pp * cp), cp))
    return out


def enumerate_plans(
    model: ModelSpec,
    n_gpus: int,
    global_batch: int,
    microbatches=(1, 2, 4, 8, 16),
    chunks=(2, 3, 4, 6, 8),
    sequence_parallel: bool = True,
    overlap_dp: bool = True,
    overlap_tp: bool = False,
) -> tuple[PlanArrays, list[dict]]:
    """Every valid discrete plan: (batched PlanArrays with numpy leaves, plan descriptions).

    Valid: degrees multiply to ``n_gpus``; tp divides heads and kv_heads; pp * chunks divides
    the layers; dp * microbatch divides the global batch; cp splits the sequence in 2 cp
    chunks. Every ZeRO stage, recompute mode and schedule (interleaved with each chunk count
    that divides the layers and with a microbatch count that is a multiple of pp).
    """
    rows = []
    for tp, pp, dp, cp in degree_tuples(n_gpus, model):
        for mb in microbatches:
            if global_batch % (dp * mb):
                continue
            n_micro = global_batch // (dp * mb)
            schedules = [("gpipe", 1), ("1f1b", 1)] if pp > 1 else [("1f1b", 1)]
            if pp > 1 and n_micro % pp == 0:
                schedules += [("interleaved", v) for v in chunks if model.n_layers % (pp * v) == 0]
            for (sched, v), rec, zero in itertools.product(schedules, RECOMPUTE_MODES, ZERO_STAGES):
                rows.append((tp, pp, dp, cp, mb, sched, v, rec, zero))
    n = len(rows)
    cols = list(zip(*rows)) if rows else [()] * 9
    eye = np.eye

    def one_hot(values, choices):
        return (
            eye(len(choices))[[choices.index(v) for v in values]]
            if n
            else np.zeros((0, len(choices)))
        )

    tp, pp, dp, cp, mb, sched, v, rec, zero = cols
    f = lambda x: np.asarray(x, dtype=float).reshape(n)  # noqa: E731
    plans = PlanArrays(
        tp=f(tp),
        pp=f(pp),
        dp=f(dp),
        cp=f(cp),
        ep=np.ones(n),
        microbatch=f(mb),
        global_batch=np.full(n, float(global_batch)),
        chunks=f(v),
        sp=np.where(f(tp) > 1, float(sequence_parallel), 0.0),
        overlap_dp=np.full(n, float(overlap_dp)),
        overlap_tp=np.full(n, float(overlap_tp)),
        zero=one_hot(zero, ZERO_STAGES),
        recompute=one_hot(rec, RECOMPUTE_MODES),
        schedule=one_hot(sched, SCHEDULES),
        order=np.tile(np.arange(4.0), (n, 1)),
    )
    keys = ("tp", "pp", "dp", "cp", "microbatch", "schedule", "chunks", "recompute", "zero")
    return plans, [dict(zip(keys, r)) for r in rows]
