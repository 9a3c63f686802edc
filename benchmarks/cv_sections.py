"""Sections 2 to 6 of ``calibration_cv.py`` (its docstring describes them): the fit's wall
time, the cross-source fit, the datasheet defaults, the full fit's all-reduce residuals, the
robustness fit and the flat directions of the full fit's Hessian. Each takes the benchmark's
``calibration_cv.Study`` and returns its section of the results.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.flatten_util import ravel_pytree

from calibration import fit as F
from calibration.heldout import (
    ape_pct,
    by_group,
    metrics,
    run_fit,
    subset,
    trained_keys,
    weighted,
)
from calibration.identifiability import (
    flat_directions,
    grid_coverage,
    hessian_fd,
    hessian_fd_step,
    parameter_names,
)
from diffcost.gpus import preset_family

if TYPE_CHECKING:
    from calibration_cv import Study


MiB = 2**20
BUCKET_EDGES = [MiB * 4**i for i in range(6)]  # 1, 4, 16, 64, 256, 1024 MiB

# --------------------------------------------------------------------------------------------
# compile-time accounting (jax.monitoring duration events)

_EVENTS: list[tuple[float, str, float]] = []  # (perf_counter at report, event, seconds)


def _on_duration(event, duration, **_):
    _EVENTS.append((time.perf_counter(), event, float(duration)))


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _compile_seconds(t0: float, t1: float) -> dict:
    """Trace / lowering / backend-compile seconds reported between t0 and t1."""
    out = collections.defaultdict(float)
    for t, ev, d in _EVENTS:
        if t0 <= t <= t1 and ("compile" in ev or "trace" in ev or "mlir" in ev):
            key = ev.rsplit("/", 1)[-1]
            out[key] += d
    return dict(out)


def _compile_total(t0, t1) -> float:
    parts = _compile_seconds(t0, t1)
    keep = ("jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration")
    return float(sum(v for k, v in parts.items() if k in keep))


def fit_timing(st: Study) -> dict:
    """4. Wall time of one fit of the shared A100 set (first compile of its shape), split into
    compile and steps; leaves the A100 problem on ``st`` for the cross-source fit."""
    ar_av = (st.coll_kind == "all_reduce") & np.isin(st.coll_fam, ["a100", "v100"])
    st.meas_a = meas_a = subset(
        st.meas, e2e=st.is_vtrain, coll=ar_av, gemm=np.zeros(len(st.meas.gemms), bool)
    )
    st.say(f"fit_s: A100 set = {len(meas_a.e2e)} vTrain e2e + {len(meas_a.collectives)} "
           "all-reduce rows")  # fmt: skip
    t0 = time.perf_counter()
    st.P_a = P_a = F.build_problem(meas_a)
    t_build = time.perf_counter() - t0
    ones_a = {lvl: np.ones(P_a.counts[lvl]) for lvl in P_a.data}
    res_a, _, wall_a = run_fit(P_a, meas_a, ones_a, st.cfg)
    t1 = time.perf_counter()
    fit_s = t1 - t0
    compile_s = _compile_total(t0, t1)
    # Per-step time of the very step ``fit`` compiled (same closure, persistent-cache hit).
    step, opt = F.make_step(weighted(P_a, ones_a), st.cfg)
    tabs = F.initial_tables(P_a)
    state = opt.init(tabs)
    data_a = weighted(P_a, ones_a).data
    ts = time.perf_counter()
    tabs, state, lo, _ = step(tabs, state, data_a)
    jax.block_until_ready(lo)
    first_call = time.perf_counter() - ts
    reps = 10 if st.quick else 20
    ts = time.perf_counter()
    for _ in range(reps):
        tabs, state, lo, _ = step(tabs, state, data_a)
    jax.block_until_ready(lo)
    ms_step = (time.perf_counter() - ts) / reps * 1e3
    st.say(f"fit_s = {fit_s:.1f} s ({res_a.steps} steps, {ms_step:.1f} ms/step, "
           f"compile {compile_s:.1f} s)")  # fmt: skip
    return {
        "fit_s": fit_s,
        "build_problem_s": t_build,
        "fit_call_s": wall_a,
        "loop_s": res_a.seconds,
        "steps": res_a.steps,
        "converged": res_a.converged,
        "final_loss": res_a.losses[-1],
        "ms_per_step": ms_step,
        "steps_s_est": ms_step * res_a.steps / 1e3,
        "compile_s": compile_s,
        "compile_parts_s": _compile_seconds(t0, t1),
        "other_s_est": fit_s - compile_s - ms_step * res_a.steps / 1e3,
        "rows": dict(P_a.counts),
        "warm_first_call_s": first_call,
    }


def cross_source(st: Study) -> dict:
    """2. Fit on vTrain e2e + the A100 all-reduce tables; predict the MosaicML A100 rows."""
    P_a = st.P_a
    d_fam = np.array([P_a.families[i] for i in np.asarray(P_a.data["coll"]["d"])])
    w_cs = {"e2e": np.ones(P_a.counts["e2e"]), "coll": (d_fam == "a100").astype(float)}
    a100 = [preset_family(r.cluster) == "a100" for r in st.meas_a.collectives]
    res_cs, tab_cs, wall_cs = run_fit(P_a, subset(st.meas_a, coll=a100), w_cs, st.cfg)
    fams_cs, clus_cs = trained_keys(P_a, w_cs)
    st.idx_cs = idx = np.flatnonzero(st.is_mosaic_a100)
    st.cs_pred = pred = st.predict(idx, P_a, tab_cs, fams_cs, clus_cs)
    meas = st.log_meas[idx]
    cross = metrics(pred, meas)
    # vTrain runs unfused attention at 2,048 tokens: the MosaicML runs' FlashAttention share of
    # the layer, which grows with the sequence, is priced at its datasheet default
    seq = np.array([st.e2e[i].model.seq_len for i in idx])
    by_seq = {
        int(k): {**m, "mean_log_ratio": float(np.mean((pred - meas)[seq == k]))}
        for k, m in by_group(seq, pred, meas).items()
    }
    st.say(f"cross-source: MAPE {cross['mape_pct']:.1f}% on {cross['rows']} MosaicML A100 rows")
    fit_info = {
        "steps": res_cs.steps,
        "converged": res_cs.converged,
        "final_loss": res_cs.losses[-1],
        "fit_wall_s": wall_cs,
        "train_rows": {"e2e": int(w_cs["e2e"].sum()), "coll": int(w_cs["coll"].sum())},
        "a100_device_values": res_cs.device_values.get("a100"),
    }
    return {
        "metrics": cross,
        "by_cluster": by_group(st.e2e_cluster[idx], pred, meas),
        "by_seq_len": by_seq,
        "fit": fit_info,
    }


def defaults_by_source(st: Study) -> dict:
    """Every row at the datasheet defaults (no fit at all), per source; skipped when quick."""
    if st.quick:
        return {}
    t0 = time.perf_counter()
    pred = st.predict(range(len(st.e2e)), st.P, F.initial_tables(st.P), set(), set())
    st.timings["defaults_predict_s"] = time.perf_counter() - t0
    return by_group(st.src, pred, st.log_meas)


def _allreduce_buckets(r_coll: np.ndarray, size: np.ndarray, ar_mask: np.ndarray) -> list:
    """All-reduce residuals per message-size bucket (``BUCKET_EDGES``)."""
    buckets = []
    for i in range(len(BUCKET_EDGES) - 1):
        lo_b, hi_b = BUCKET_EDGES[i], BUCKET_EDGES[i + 1]
        last = i == len(BUCKET_EDGES) - 2
        m = ar_mask & (size >= lo_b) & ((size <= hi_b) if last else (size < hi_b))
        a = ape_pct(r_coll[m], 0.0)
        buckets.append(
            {
                "from_MiB": lo_b / MiB,
                "to_MiB": hi_b / MiB,
                "rows": int(m.sum()),
                "mape_pct": float(a.mean()) if a.size else None,
                "max_ape_pct": float(a.max()) if a.size else None,
                "mean_log_ratio": float(r_coll[m].mean()) if a.size else None,
            }
        )
    return buckets


def full_fit(st: Study) -> dict:
    """3. One fit on every row: the all-reduce residuals and the in-sample figures."""
    st.res_full, st.tab_full, wall = run_fit(st.P, st.meas, st.ones, st.cfg)
    res = st.res_full
    st.say(f"full fit: {res.steps} steps in {wall:.1f} s, loss {res.losses[-1]:.5f}")
    r_coll = res.residuals["coll"]
    kind, size, n = st.coll_kind, st.coll_size, st.coll_n
    ar_mask = (kind == "all_reduce") & (size >= MiB) & (n >= 2) & (n <= 8)
    ape_ar = ape_pct(r_coll[ar_mask], 0.0)
    by_cluster = by_group(st.coll_cluster, r_coll, np.zeros_like(r_coll), ar_mask)
    for v in by_cluster.values():
        v.pop("kendall_tau", None)
    gemms = st.meas.gemms
    in_sample = by_group(st.src, res.residuals["e2e"], np.zeros(len(st.e2e)))
    fit_info = {
        "steps": res.steps,
        "converged": res.converged,
        "final_loss": res.losses[-1],
        "fit_wall_s": wall,
        "in_sample_mape_pct": {
            lvl: float(ape_pct(r, 0.0).mean()) for lvl, r in res.residuals.items()
        },
        "in_sample_e2e_by_source": {
            k: {kk: v[kk] for kk in ("rows", "mape_pct", "max_ape_pct")}
            for k, v in in_sample.items()
        },
        "coll_by_source_kind": {
            f"{s}/{k}": float(ape_pct(r_coll[(st.coll_src == s) & (kind == k)], 0.0).mean())
            for s, k in sorted(set(zip(st.coll_src, kind)))
        },
        "gemm_by_gpu_precision": {
            f"{g}/{p}": float(ape_pct(res.residuals["gemm"][m], 0.0).mean())
            for g, p in sorted({(x.gpu, x.precision) for x in gemms})
            for m in [np.array([(x.gpu, x.precision) == (g, p) for x in gemms])]
        },
        "device_values": res.device_values,
        "cluster_values": res.cluster_values,
    }
    va = (st.coll_cluster == "vtrain-a100") & (kind == "all_reduce")
    meas_t = np.array([r.time_s for r in st.meas.collectives])[va]
    st.ar_plot = {"size": size[va], "n": n[va], "meas": meas_t, "pred": meas_t * np.exp(r_coll[va])}
    return {
        "allreduce": {
            "mape_pct": float(ape_ar.mean()),
            "max_ape_pct": float(ape_ar.max()),
            "rows": int(ar_mask.sum()),
        },
        "buckets": _allreduce_buckets(r_coll, size, ar_mask),
        "by_cluster": by_cluster,
        "full_fit": fit_info,
    }


def robustness(st: Study) -> dict:
    """5. 10% of one fold's training e2e rows x3: that fold's held-out vTrain MAPE."""
    rf = next((f for f in range(st.run_folds) if np.any((st.folds == f) & st.is_vtrain)), 0)
    _, _, w0, fams0, clus0 = st.fold_fits[rf]
    train_idx = np.flatnonzero(w0["e2e"] > 0)
    rng = np.random.default_rng(1234)
    bad = rng.choice(train_idx, size=int(round(0.1 * train_idx.size)), replace=False)
    corrupted = st.log_meas.copy()
    corrupted[bad] += np.log(3.0)
    res_r, tabs_r, _ = run_fit(st.P, subset(st.meas, e2e=st.folds != rf), w0, st.cfg, corrupted)
    held_v = np.flatnonzero((st.folds == rf) & st.is_vtrain)
    corr_pred = st.predict(held_v, st.P, tabs_r, fams0, clus0)
    clean_mape = float(ape_pct(st.cv_pred[held_v], st.log_meas[held_v]).mean())
    corr_mape = float(ape_pct(corr_pred, st.log_meas[held_v]).mean())
    st.say(f"robustness: clean {clean_mape:.2f}% -> corrupted {corr_mape:.2f}%")
    return {
        "clean_mape_pct": clean_mape,
        "corrupted_mape_pct": corr_mape,
        "ratio": corr_mape / clean_mape if clean_mape > 0 else None,
        "fold": int(rf),
        "heldout_vtrain_rows": int(held_v.size),
        "corrupted_rows": int(bad.size),
        "corrupted_by_source": dict(collections.Counter(st.src[bad].tolist())),
        "factor": 3.0,
        "steps": res_r.steps,
    }


def identifiability(st: Study) -> dict:
    """6. Flat directions of the full fit's Hessian over the scalar constants (the shape grids
    held at their fit; their node coverage reported instead: two gradients per node)."""
    t0 = time.perf_counter()
    all_names = parameter_names(st.P, st.tab_full)
    grids = (F.GRID_LEAF, F.LAYER_LEAF, F.CLUSTER_LAYER_LEAF, F.HEAD_LEAF)
    cols = np.flatnonzero([not any(g in n for g in grids) for n in all_names])
    if st.quick:
        H, t_hd = hessian_fd_step(weighted(st.P, st.ones), st.tab_full, st.cfg, cols)
        t_hc = 0.0
        method = "quick: central differences (h=3e-3) of the float32 gradient of fit's step"
    else:
        H, _, t_hc, t_hd = hessian_fd(st.meas, st.tab_full, st.cfg, cols)
        method = "central differences (h=1e-4) of jax.grad(make_loss), float64"
    prior_diag = np.asarray(ravel_pytree(F.prior_curvature(st.P, st.cfg))[0], float)[cols]
    if prior_diag.shape != (len(H),):
        raise RuntimeError(f"prior curvature {prior_diag.shape} against Hessian {H.shape}")
    flat = flat_directions(H, all_names[cols], prior_diag, 1e-6 if st.quick else 1e-9)
    flat["method"] = method
    flat["rows_in_quadratic_huber_region"] = {
        lvl: float(np.mean(np.abs(r) < st.cfg.huber_delta))
        for lvl, r in st.res_full.residuals.items()
    }
    flat["compile_s"], flat["differences_s"] = t_hc, t_hd
    for key, leaf in (
        ("gemm_shape_grid", F.GRID_LEAF),
        ("layer_shape_grid", F.LAYER_LEAF),
        ("cluster_layer_grid", F.CLUSTER_LAYER_LEAF),
        ("head_shape_grid", F.HEAD_LEAF),
    ):
        flat[key] = grid_coverage(st.P, st.tab_full, leaf)
    st.timings["hessian_s"] = time.perf_counter() - t0
    st.say(f"Hessian {len(H)}x{len(H)}: {flat['n_flat']} flat eigenvalues ({t_hc:.0f} s compile)")
    return flat
