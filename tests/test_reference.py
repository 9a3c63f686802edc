"""The closed-form pipeline model (diffcost.simulate) against the event-driven reference.

``pipeline_time(st, 0)[0]`` (pipeline + sends + exposed DP time) is compared with
``simulate_reference`` (pipeline + DP tail) on a grid of stage profiles, communication settings
and (p, m, v): exact (to EXACT_REL_TOL) on the groups listed in ``_EXACT_GROUPS``, within the
measured bounds elsewhere. Run with ``-s`` to see the discrepancy table.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from diffcost import smooth  # noqa: E402
from diffcost.params import default_params  # noqa: E402
from diffcost.reference import SCHEDULES, simulate_reference, stage_order  # noqa: E402
from diffcost.simulate import (  # noqa: E402
    StageTimes,
    pipeline_time,
    simulate,
    stage_times,
)
from diffcost.trace import timeline_events, write_trace  # noqa: E402

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "configs" / "examples").glob("*.yaml"))
E2E_REL_TOL = 5e-3  # smooth model at the default temperature vs the reference, example configs
EXACT_REL_TOL = 1e-9  # where the closed form is exact
HAVE_CONFIG = importlib.util.find_spec("diffcost.config") is not None

# Per-microbatch forward / backward of a stage's layers, and the first / last stage extras
# (embedding; LM head and loss), in arbitrary units.
F_MID, B_MID = 1.0, 2.0
EMB, HEAD = (0.02, 0.04), (0.3, 0.5)
N_LAYERS = 4  # DP buckets per stage
P2P = 0.02  # 2% of a stage's forward, like the example configs (1-2%)
C_SMALL, C_BIG = 0.15, 0.8  # a bucket's sync, below and above a layer's backward (0.5)
ONE_HOT = {name: np.eye(3)[i] for i, name in enumerate(SCHEDULES)}


def profile(name: str, p: int):
    """(fwd [3], bwd [3]) per stage kind."""
    if name == "uniform":
        return [F_MID] * 3, [B_MID] * 3
    if name == "heavy ends":  # the shape stage_times builds: embedding first, LM head last
        if p == 1:  # a single stage holds both (entries 0)
            f0, b0 = F_MID + EMB[0] + HEAD[0], B_MID + EMB[1] + HEAD[1]
            return [f0, F_MID, F_MID + HEAD[0]], [b0, B_MID, B_MID + HEAD[1]]
        return ([F_MID + EMB[0], F_MID, F_MID + HEAD[0]], [B_MID + EMB[1], B_MID, B_MID + HEAD[1]])
    if name == "heavy first":
        return [1.3, 1.0, 1.1], [2.5, 2.0, 2.2]
    if name == "mixed argmax":  # slowest forward on the first stage, slowest backward on the last
        return [1.4, 1.0, 1.0], [2.0, 2.0, 2.6]
    if name == "mid heavy":
        return [1.0, 1.3, 1.0], [2.0, 2.5, 2.0]
    raise ValueError(name)


def make_st(
    fwd,
    bwd,
    p,
    m,
    v,
    schedule,
    p2p=0.0,
    bucket=0.0,
    overlap=1.0,
    cadence="per kind",
    dp_after=(0.01, 0.0, 0.01),
) -> StageTimes:
    """A hand-built StageTimes. ``cadence``: "per kind" makes L * layer_bwd == bwd on every
    kind (the closed form's assumption); "stage_times" uses the middle layers' cadence
    everywhere, as ``stage_times`` does."""
    a = lambda x: jnp.asarray(x, dtype=jnp.float64)  # noqa: E731
    bwd_arr = a(bwd)
    layer_bwd = bwd_arr / N_LAYERS if cadence == "per kind" else jnp.full(3, bwd[1] / N_LAYERS)
    return StageTimes(
        fwd_s=a(fwd),
        bwd_s=bwd_arr,
        parts=jnp.zeros((3, 5)),
        p2p_s=a(p2p),
        dp_bucket_s=jnp.full(3, bucket, dtype=jnp.float64),
        dp_layers=a(N_LAYERS),
        layer_bwd_s=layer_bwd,
        dp_after_s=a(dp_after),
        n_microbatches=a(m),
        n_stages=a(p),
        chunks=a(v),
        overlap_dp=a(overlap),
        schedule=a(ONE_HOT[schedule]),
        optimizer_s=a(0.05),
        overhead_s=a(0.01),
        microbatch_overhead_s=a(0.0),  # only accounting: the host step is inside fwd_s
    )


@jax.jit
def _closed_form(st):
    """The closed form at temperature 0: pipeline makespan + sends + exposed DP time."""
    return pipeline_time(st, 0.0)[0]


@functools.partial(jax.jit, static_argnames="temperature")
def _closed_form_at(st, temperature):
    return pipeline_time(st, temperature)[0]


def _ref_total(st, schedule):
    r = simulate_reference(st, schedule)
    return r.pipeline_s + r.dp_tail_s


def _grid(schedule):
    for p in (1, 2, 4, 8):
        for m in sorted({1, p, 4 * p, 16}):
            for v in (1, 2, 4) if schedule == "interleaved" else (1,):
                if schedule == "interleaved" and m % p:
                    continue
                yield p, m, v


# --- 1. closed form vs reference on a grid ----------------------------------------------------

_AFTER = (0.01, 0.0, 0.01)  # dp_after_s per stage kind
_COMMS = {  # name: (p2p, bucket, overlap values, cadence, dp_after)
    "no comm": (0.0, 0.0, (1.0,), "per kind", _AFTER),
    "dp c<b": (0.0, C_SMALL, (0.0, 1.0), "per kind", _AFTER),
    "dp c>b": (0.0, C_BIG, (0.0, 1.0), "per kind", _AFTER),
    "p2p": (P2P, 0.0, (1.0,), "per kind", _AFTER),
    "p2p+dp": (P2P, C_SMALL, (0.0, 1.0), "per kind", _AFTER),
    # the middle stages' dp_after also shares their NIC with the drain's sends
    "p2p+after": (P2P, C_SMALL, (0.0, 1.0), "per kind", (0.0, 0.03, 0.005)),
    "st cadence": (P2P, C_SMALL, (1.0,), "stage_times", _AFTER),
}
_PROFILES = ("uniform", "heavy ends", "heavy first", "mixed argmax", "mid heavy")
_NO_SENDS = ("no comm", "dp c<b", "dp c>b")
_SENDS = ("p2p", "p2p+dp", "p2p+after", "st cadence")
_GROUPS = [(s, prof, comm) for s in SCHEDULES for prof in _PROFILES for comm in _COMMS]

# (schedule, profile, comm) groups where the closed form is exact on the whole grid
_EXACT_GROUPS = (
    {("gpipe", prof, comm) for prof in _PROFILES for comm in _NO_SENDS}
    | {
        ("gpipe", prof, comm)
        for prof in ("uniform", "heavy ends", "mixed argmax")
        for comm in _SENDS
    }
    | {("1f1b", prof, comm) for prof in _PROFILES for comm in _NO_SENDS}
    | {("1f1b", prof, comm) for prof in ("heavy ends", "mixed argmax") for comm in _SENDS}
    | {("interleaved", prof, comm) for prof in ("uniform", "heavy ends") for comm in _NO_SENDS}
    | {("interleaved", "uniform", comm) for comm in _SENDS}
)
# Elsewhere: max |closed - ref| / ref over the grid, per schedule (measured: gpipe 0.27%,
# 1F1B 0.71%, interleaved 12.2%; see the table with -s).
INEXACT_REL_BOUND = {"gpipe": 3e-3, "1f1b": 7.5e-3, "interleaved": 0.125}
# Interleaved, heavy ends (the profile stage_times builds), p >= 2, with sends: the closed form
# counts 2 (p v - 1) sends and the NIC sharing of every chunk's last backward; the reference
# hides 2 p (v - 1) of those sends and up to p (v - 1) sends' worth of NIC sharing in the
# slack of the middle stages. closed - ref lies in [0, INTERLEAVED_SEND_GAP p (v - 1) s].
INTERLEAVED_SEND_GAP = 3.0


@functools.cache
def _group(schedule, prof, comm):
    """Every grid case of a group: dicts with the closed form, the reference and rel."""
    p2p, bucket, overlaps, cadence, after = _COMMS[comm]
    cases = []
    for p, m, v in _grid(schedule):
        fwd, bwd = profile(prof, p)
        for ov in overlaps:
            st = make_st(
                fwd,
                bwd,
                p,
                m,
                v,
                schedule,
                p2p=p2p,
                bucket=bucket,
                overlap=ov,
                cadence=cadence,
                dp_after=after,
            )
            ref = _ref_total(st, schedule)
            closed = float(_closed_form(st))
            cases.append(
                dict(p=p, m=m, v=v, ov=ov, ref=ref, closed=closed, rel=(closed - ref) / ref)
            )
    return cases


def _case_id(e):
    return f"p{e['p']} m{e['m']} v{e['v']} ov{e['ov']:g}"


def _worst(cases):
    return max(cases, key=lambda e: abs(e["rel"]))


@pytest.mark.parametrize(
    "schedule,prof,comm", sorted(_EXACT_GROUPS), ids=lambda x: x.replace(" ", "_")
)
def test_closed_form_exact(schedule, prof, comm):
    bad = [e for e in _group(schedule, prof, comm) if abs(e["rel"]) > EXACT_REL_TOL]
    assert not bad, [(_case_id(e), e["closed"], e["ref"]) for e in bad]


def test_discrepancy_table():
    """Print every group's worst case; outside the exact groups assert the measured bounds."""
    print(
        "\npipeline_time(st, 0)[0] vs reference; rel = (closed - ref) / ref over p in {1,2,4,8},"
        " m in {1,p,4p,16}, v in {1,2,4}, overlap_dp in {0,1} (with DP buckets)"
    )
    print(f"{'schedule':12s} {'profile':13s} {'comm':11s} {'n':>4s} {'max|rel|':>10s}  worst case")
    worst_all = []
    for group in _GROUPS:
        cases = _group(*group)
        w = _worst(cases)
        tag = "exact" if group in _EXACT_GROUPS else ""
        print(
            f"{group[0]:12s} {group[1]:13s} {group[2]:11s} {len(cases):4d} {w['rel']:+10.2e}  "
            f"{_case_id(w):20s} {tag}"
        )
        if group not in _EXACT_GROUPS:
            worst_all += [(group, e) for e in cases]
    print("\nworst 20 cases outside the exact groups:")
    for (schedule, prof, comm), e in sorted(worst_all, key=lambda x: -abs(x[1]["rel"]))[:20]:
        print(f"  {schedule:12s} {prof:13s} {comm:11s} {_case_id(e):20s} {e['rel']:+.3%}")
    for schedule, bound in INEXACT_REL_BOUND.items():
        worst = max(abs(e["rel"]) for g, e in worst_all if g[0] == schedule)
        print(f"{schedule}: max |rel| {worst:.3e} (bound {bound:g})")
        assert worst <= bound


def test_interleaved_send_gap():
    """Interleaved on the heavy-ends profile with sends: the closed form over-counts sends that
    the reference hides in slack, by at most INTERLEAVED_SEND_GAP p (v - 1) sends."""
    checked = 0
    for comm in _SENDS:
        for e in _group("interleaved", "heavy ends", comm):
            if e["p"] < 2:
                continue
            gap = e["closed"] - e["ref"]
            bound = INTERLEAVED_SEND_GAP * e["p"] * (e["v"] - 1) * P2P
            assert -EXACT_REL_TOL * e["ref"] <= gap <= bound + EXACT_REL_TOL * e["ref"], e
            checked += 1
    assert checked > 50


def test_gpipe_mixed_bottlenecks():
    """GPipe's forward and backward phases have their own bottleneck stages: the reference
    takes (m - 1) (max F + max B), more than (m - 1) max W when they differ."""
    fwd, bwd = profile("mixed argmax", 4)
    st = make_st(fwd, bwd, 4, 16, 1, "gpipe")
    ref = _ref_total(st, "gpipe")
    assert float(_closed_form(st)) == pytest.approx(ref, rel=EXACT_REL_TOL)
    assert max(fwd) + max(bwd) > np.add(fwd, bwd).max()


def test_absent_stage_kinds_in_max():
    """With p = 1 only the first entries exist, with p = 2 no middle stage: maxima must skip
    the absent kinds."""
    for p, fwd, bwd in (
        (1, [1.0, 1.0, 1.5], [2.0, 2.0, 2.5]),
        (2, [1.0, 1.5, 1.0], [2.0, 2.5, 2.0]),
    ):
        st = make_st(fwd, bwd, p, 8, 1, "1f1b")
        ref = _ref_total(st, "1f1b")
        assert float(_closed_form(st)) == pytest.approx(ref, rel=EXACT_REL_TOL)


# --- reference internals ------------------------------------------------------------------------


def test_stage_orders_are_complete():
    for schedule in SCHEDULES:
        for p, m, v in _grid(schedule):
            for s in range(p):
                order = stage_order(schedule, s, p, m, v)
                assert sorted(order) == sorted(
                    (k, i, c) for k in "FB" for i in range(m) for c in range(v)
                )
                pos = {u: n for n, u in enumerate(order)}
                assert all(pos[("F", i, c)] < pos[("B", i, c)] for _, i, c in order)


def test_interleaved_order_megatron():
    # m == p: Megatron runs every forward first; chunks in groups of p microbatches
    assert stage_order("interleaved", 0, 2, 2, 2) == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 0, 1),
        ("F", 1, 1),
        ("B", 0, 1),
        ("B", 1, 1),
        ("B", 0, 0),
        ("B", 1, 0),
    ]
    # m = 4, p = 2, v = 2, last stage: warmup (v - 1) p = 2, then 1F1B
    assert stage_order("interleaved", 1, 2, 4, 2)[:6] == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 0, 1),
        ("B", 0, 1),
        ("F", 1, 1),
        ("B", 1, 1),
    ]
    # 1F1B: stage s warms up with p - s - 1 forwards
    assert stage_order("1f1b", 0, 3, 4)[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0)]


def test_fair_sharing_of_a_link():
    """Two sends of 1 s on one link, started 10 ms apart, share it: 2.00 s and 2.01 s."""
    st = make_st([0.01] * 3, [0.01] * 3, 2, 2, 1, "gpipe", p2p=1.0)
    events = simulate_reference(st, "gpipe", record=True).events
    sends = sorted((s + d) for t, n, s, d in events if t == "stage 0/p2p send")
    assert sends == pytest.approx([2.0, 2.01], abs=1e-12)
    starts = sorted(s for t, n, s, d in events if t == "stage 1/compute" and n.startswith("F"))
    assert starts == pytest.approx([2.0, 2.01], abs=1e-12)


def test_nic_shared_with_dp():
    """The drain's last backward send leaves while the stage's last bucket syncs on the same
    NIC: both run at half rate, so the send takes p2p + min(p2p, bucket)."""
    for bucket in (0.01, 0.3):
        st = make_st(
            [1.0] * 3, [2.0] * 3, 4, 4, 1, "gpipe", p2p=P2P, bucket=bucket, dp_after=(0.0, 0.0, 0.0)
        )
        events = simulate_reference(st, "gpipe", record=True).events
        for s in (1, 2, 3):
            last = [d for t, n, _, d in events if t == f"stage {s}/p2p send" and n[0] == "B"][-1]
            assert last == pytest.approx(P2P + min(P2P, bucket), rel=1e-9)
        ref = _ref_total(st, "gpipe")
        assert float(_closed_form(st)) == pytest.approx(ref, rel=EXACT_REL_TOL)


def test_interleaved_bucket_semantics():
    """'final_task' lets all L buckets follow the cadence from the final chunk-0 backward
    (bwd / v long), so the cadence runs (v - 1) / v * bwd past the compute; 'per_chunk' does
    not."""
    v = 4
    st = make_st([1.0] * 3, [2.0] * 3, 2, 4, v, "interleaved", bucket=0.0, dp_after=(0, 0, 0))
    per_chunk = simulate_reference(st, dp_buckets="per_chunk")
    final = simulate_reference(st, dp_buckets="final_task")
    assert per_chunk.dp_tail_s == pytest.approx(0.0, abs=1e-12)
    assert final.dp_tail_s == pytest.approx((v - 1) / v * 2.0, rel=1e-12)


# --- 2. end to end ------------------------------------------------------------------------------


def _example(path):
    if not HAVE_CONFIG:
        pytest.skip("diffcost.config (the YAML loader) is not importable yet")
    from diffcost import api

    return api.experiment_arrays(api.load(path))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_match_reference(path):
    from diffcost.api import simulate_jit

    model, plan, cluster = _example(path)
    params = default_params()
    smooth_iter = float(
        simulate_jit(
            model, plan, cluster, params, temperature=smooth.DEFAULT_TEMPERATURE
        ).iteration_s
    )
    ref = simulate_reference(stage_times(model, plan, cluster, params, 0.0))
    rel = (smooth_iter - ref.iteration_s) / ref.iteration_s
    print(
        f"\n{path.stem}: smooth {smooth_iter:.6f} s, reference {ref.iteration_s:.6f} s "
        f"(pipeline {ref.pipeline_s:.6f}, dp tail {ref.dp_tail_s:.6f}), rel {rel:+.3e}"
    )
    assert abs(rel) <= E2E_REL_TOL


# --- 3. convergence -----------------------------------------------------------------------------

TEMPERATURES = (1e-2, 1e-3, 1e-4)


def _fmt(errs):
    return " ".join(f"{e:.2e}" for e in errs)


def _nonincreasing(errs):
    return all(b <= a * (1 + 1e-6) + 1e-15 for a, b in zip(errs, errs[1:], strict=False))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_smooth_converges_to_reference(schedule):
    """The smooth closed form converges to its temperature-0 value, here exact against the
    reference. Stage kinds 0.2% apart and a bucket sync close to a layer's backward keep the
    smooth maxima away from their limit at the larger temperatures."""
    fwd, bwd = [1.0, 1.0, 1.002], [2.0, 2.0, 2.004]
    v = 2 if schedule == "interleaved" else 1
    st = make_st(fwd, bwd, 4, 16, v, schedule, bucket=0.49)
    exact = float(_closed_form(st))
    assert exact == pytest.approx(_ref_total(st, schedule), rel=EXACT_REL_TOL)
    errs = [abs(float(_closed_form_at(st, t)) - exact) / exact for t in TEMPERATURES]
    print(f"\n{schedule}: rel error at {TEMPERATURES}: {_fmt(errs)}")
    assert _nonincreasing(errs) and errs[-1] < 1e-4


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_examples_converge(path):
    """``simulate`` converges to its temperature-0 closed form; its distance to the reference
    ends at the closed form's own structural gap (zero where it is exact)."""
    model, plan, cluster = _example(path)
    params = default_params()
    ref = simulate_reference(stage_times(model, plan, cluster, params, 0.0)).iteration_s
    exact = float(simulate(model, plan, cluster, params, 0.0).iteration_s)
    its = [float(simulate(model, plan, cluster, params, t).iteration_s) for t in TEMPERATURES]
    to_exact = [abs(i - exact) / exact for i in its]
    to_ref = [abs(i - ref) / ref for i in its]
    gap = abs(exact - ref) / ref
    print(
        f"\n{path.stem}: vs temperature 0 {_fmt(to_exact)}, vs reference {_fmt(to_ref)}, "
        f"structural gap {gap:.2e}"
    )
    assert _nonincreasing(to_exact) and to_exact[-1] < 1e-4
    assert to_ref[-1] <= gap + 1e-4
    if gap < 1e-9:
        assert _nonincreasing(to_ref) and to_ref[-1] < 1e-4


# --- 4. trace -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule,p,m,v", [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2)]
)
def test_trace_file(tmp_path, schedule, p, m, v):
    fwd, bwd = profile("heavy ends", p)
    st = make_st(fwd, bwd, p, m, v, schedule, p2p=P2P, bucket=C_BIG)
    events = timeline_events(st, schedule)
    path = write_trace(tmp_path / "trace.json", events, {"schedule": schedule, "p": p})
    doc = json.loads(Path(path).read_text())
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["schedule"] == schedule
    ev = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["name"] == "process_name"}
    assert sorted(procs.values()) == sorted(f"stage {s}" for s in range(p))
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert {"compute", "p2p send", "dp sync"} <= set(threads.values())
    slices = [e for e in ev if e["ph"] == "X"]
    compute = [e for e in slices if threads[(e["pid"], e["tid"])] == "compute"]
    assert len(compute) == 2 * m * p * v
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    ref = simulate_reference(st, schedule)
    end_us = max(e["ts"] + e["dur"] for e in compute)
    assert end_us == pytest.approx(ref.pipeline_s * 1e6, rel=1e-12)
    # slices on one track never partially overlap (Perfetto needs proper nesting)
    by_track = {}
    for e in sorted(slices, key=lambda e: e["ts"]):
        last = by_track.get((e["pid"], e["tid"]), -np.inf)
        assert e["ts"] >= last - 1e-6
        by_track[(e["pid"], e["tid"])] = e["ts"] + e["dur"]
