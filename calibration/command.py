"""``diffcost calibrate``: fit clusters' constants to measurement files and write profiles.

    diffcost calibrate --cluster vtrain-a100 ../shared/data/e2e/calibration.csv \
        ../shared/data/collectives/collectives.csv [--out profile.yaml] [--from PROFILE]

The fit starts from the constants the cluster uses today (its calibrated profile under
``diffcost/configs/profiles/``; ``--from FILE`` for another profile, ``--from none`` for the
datasheet defaults), and its prior pulls toward them: data about one level (say, nccl-tests
logs) refine that level and leave the rest as they were. Each calibrated cluster gets one
file with its device and cluster constants: ``<cluster>-profile.yaml`` in the current folder,
``--out FILE`` (one cluster) or ``--out FOLDER``. Predictions use it with ``--profile FILE``.
The shipped profiles under ``diffcost/configs/profiles/`` are rebuilt by
``python -m calibration.make_profiles``, never by this command.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console

from calibration import fit as fit_mod
from calibration import posterior, refit
from calibration.heldout import fill_uninformed, population_members, population_row
from calibration.readers import load
from calibration.records import FIT_PRECISIONS, Measurements, placed_kernels
from diffcost import profiles as prof
from diffcost.cli.common import make_table, print_json
from diffcost.config import load_cluster
from diffcost.gpus import cluster_family
from diffcost.params import default_params


def select(meas: Measurements, clusters: list[str]) -> Measurements:
    """The measurements of ``clusters`` (e2e and collectives) and of their GPU families (GEMMs)."""
    return meas.filter(cluster=clusters)


def _mape(resid: np.ndarray) -> float:
    return float(np.mean(np.abs(np.expm1(resid))) * 100) if resid.size else float("nan")


def write_layers(
    result: fit_mod.FitResult, clusters: list[str], meta: dict, uncertainty: dict | None = None
) -> list[Path]:
    """Write the fitted layers as the shipped profiles (``diffcost/configs/profiles/``): one
    ``device-<family>.yaml`` per GPU family, one ``<cluster>.yaml`` per cluster; each with its
    ``uncertainty`` block where ``uncertainty`` (``calibration.posterior.laplace``) has one."""
    uncertainty = uncertainty or {}
    written = []
    for fam, values in result.device_values.items():
        written.append(
            prof.write_profile(
                prof.device_path(fam),
                values,
                {"layer": "device", "key": fam, "gpu_family": fam, **meta},
                uncertainty.get(("device", fam)),
            )
        )
    for name in clusters:
        if name in result.cluster_values:
            written.append(
                prof.write_profile(
                    prof.cluster_path(name),
                    result.cluster_values[name],
                    {"layer": "cluster", "key": name, "gpu_family": cluster_family(name), **meta},
                    uncertainty.get(("cluster", name)),
                )
            )
    return written


def write_stack(path: Path, offsets: dict, meta: dict) -> Path:
    """Write a software stack's raw offsets (``diffcost.profiles.stack_offsets`` reads them)."""
    doc = {**meta, "offsets": {k: round(float(v), 6) for k, v in offsets.items()}}
    with open(path, "w") as fh:
        fh.write("# diffcost software stack offsets, raw units: log for positive constants, ")
        fh.write("logit for fractions\n")
        yaml.safe_dump(doc, fh, sort_keys=False)
    return path


def _population_form(row: dict) -> dict:
    """Raw cluster leaves in profile form, without the cluster's own shape grids (they
    describe one cluster's shapes, not a population's)."""
    grids = {fit_mod.CLUSTER_LAYER_LEAF, fit_mod.HEAD_LEAF}
    params = default_params().replace(**{k: v for k, v in row.items() if k not in grids})
    fields = [f for f in prof.CLUSTER_FIELDS if prof.FIELDS[f][0] not in grids]
    return prof.to_values(params, fields)


def population_values(result: fit_mod.FitResult, problem: fit_mod.Problem, clusters) -> dict:
    """The cluster constants a cluster no measurement names gets (``diffcost.profiles.
    population_path``): ``heldout.population_row`` of the fit's tables over ``clusters``, in
    profile form, without the cluster's own shape grids."""
    return _population_form(population_row(problem, result.tables, clusters))


def population_member_values(
    result: fit_mod.FitResult, problem: fit_mod.Problem, clusters
) -> dict[str, dict]:
    """{cluster: its constants in the form of ``population_values``} for each of ``clusters``:
    the population file's ``members`` (``diffcost.profiles.population_members``), whose mean
    log prediction is a profile-less cluster's (``diffcost.population``)."""
    rows = population_members(problem, result.tables, clusters)
    return {c: _population_form(row) for c, row in zip(sorted(clusters), rows)}


def with_population(
    result: fit_mod.FitResult, problem: fit_mod.Problem, clusters, temperature: float
) -> fit_mod.FitResult:
    """``result`` whose clusters without end-to-end runs take the population's value (over
    ``clusters``, ``population_row``) for every constant their measurements do not read
    (``heldout.fill_uninformed``): a cluster with collective tables only keeps the network
    they fit and gets the host and overhead constants of the clusters with runs; a GPU family
    without runs gets the mean of the families with runs for the device constants only runs
    read (``heldout.E2E_ONLY_DEVICE_LEAVES``)."""
    weights = {lvl: np.ones(n) for lvl, n in problem.counts.items()}
    population = population_row(problem, result.tables, clusters)
    dev, clu = fill_uninformed(problem, result.tables, weights, population, temperature)
    by_cluster, values = dict(result.params_by_cluster), dict(result.cluster_values)
    for j, name in enumerate(problem.clusters):
        fam = cluster_family(name)
        i = problem.families.index(fam) if fam in problem.families else 0
        by_cluster[name] = fit_mod.assemble(dev, clu, i, j)
        values[name] = prof.to_values(by_cluster[name], prof.CLUSTER_FIELDS)
    p0 = default_params()
    devices = {
        fam: prof.to_values(p0.replace(**{k: dev[k][i] for k in fit_mod.DEVICE_LEAVES}),
                            prof.DEVICE_FIELDS)
        for i, fam in enumerate(problem.families)
    }  # fmt: skip
    return dataclasses.replace(result, tables=(dev, clu), params_by_cluster=by_cluster,
                               cluster_values=values, device_values=devices)  # fmt: skip


def fitted_values(result: fit_mod.FitResult, cluster: str) -> dict:
    """Device and cluster constants of ``cluster`` after the fit, in profile form."""
    device = result.device_values.get(cluster_family(cluster), {})
    return {**device, **result.cluster_values[cluster]}


def output_paths(clusters: list[str], out: str | None) -> dict[str, Path]:
    """Where each cluster's profile goes; checked before fitting, so a bad ``--out`` does not
    cost a fit."""
    default = {c: Path(f"{c}-profile.yaml") for c in clusters}
    if out is None:
        paths = default
    elif Path(out).is_dir() or out.endswith(("/", os.sep)):
        paths = {c: Path(out) / p for c, p in default.items()}
    elif len(clusters) > 1:
        raise ValueError(
            f"--out {out}: one file holds one cluster's profile, but {len(clusters)} clusters "
            f"are calibrated ({', '.join(clusters)}); give a folder (--out DIR/) or leave --out "
            "out to write <cluster>-profile.yaml files here"
        )
    else:
        paths = {clusters[0]: Path(out)}
    for path in paths.values():
        if path.is_dir():
            raise ValueError(f"--out {path} is a folder; give a file name or a folder ending in /")
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ValueError(f"cannot write {path}: {parent} is not a writable folder")
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(f"cannot write {path}: the file is read-only")
    return paths


# The shape grids, summarised in ``moved`` as one row each (a node count, no before/after).
GRID_LABELS = {
    prof.GRID_FIELD: "GEMM shape grid",
    prof.LAYER_FIELD: "layer shape grid",
    prof.CLUSTER_LAYER_FIELD: "cluster layer shape grid",
    prof.HEAD_FIELD: "LM head shape grid",
}


def moved_cells(label: str, before: float, after: float) -> tuple[str, str]:
    """The before and after cells of a ``moved`` row: blank for a shape grid's summary row."""
    if label.split(":")[0] in GRID_LABELS.values():
        return "", ""
    return f"{before:.4g}", f"{after:.4g}"


def moved(before: dict, after: dict, top: int = 8) -> list[tuple[str, float, float]]:
    """The constants the fit moved most, as (name, before, after), largest move first.

    Moves are measured in the fit's own units (raw log / logit over the prior width), so a
    fraction and a latency compare fairly. The nodes of each shape grid (GEMM, layer, LM head) are
    summarised as one entry: the number of nodes whose factor changed by more than 5%.
    """
    rows = []
    for name, (_leaf, kind) in prof.FIELDS.items():
        if name not in before or name not in after:
            continue
        if name in GRID_LABELS:
            b, a = before[name], after[name]
            if name != prof.GRID_FIELD:  # one grid, not one per precision class
                b, a = {"": b}, {"": a}
            changed = _grid_changes(b, a)
            if changed:
                rows.append((np.inf, f"{GRID_LABELS[name]}: {changed} nodes moved > 5%", 0.0, 0.0))
            continue
        pairs = (
            [(f"{name}.{p}", before[name][p], after[name][p]) for p in FIT_PRECISIONS]
            if name == "gemm_eff"
            else [(name, before[name], after[name])]
        )
        for label, b, a in pairs:
            raw = [prof._to_raw(kind, v) for v in (b, a)]
            score = abs(float(raw[1] - raw[0])) / fit_mod.PRIOR_SD[name]
            if score > 1e-3:
                rows.append((score, label, float(b), float(a)))
    rows.sort(key=lambda r: -r[0])
    return [(label, b, a) for _, label, b, a in rows[:top]]


def _grid_changes(before: dict, after: dict) -> int:
    count = 0
    for cls in set(before) | set(after):
        b, a = before.get(cls, {}), after.get(cls, {})
        count += sum(abs(np.log(a.get(k, 1.0) / b.get(k, 1.0))) > np.log(1.05) for k in {*b, *a})
    return count


def skipped_lines(meas: Measurements, examples: int = 3) -> list[str]:
    """One line per reason rows were skipped: how many, and the first few locations."""
    by_reason: dict[str, list[str]] = {}
    for where, reason in meas.skipped:
        by_reason.setdefault(reason, []).append(str(where))
    out = []
    for reason, places in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        more = f" and {len(places) - examples} more" if len(places) > examples else ""
        out.append(f"{len(places)} x {reason}: {', '.join(places[:examples])}{more}")
    return out


def _found(meas: Measurements) -> str:
    clusters = Counter(r.cluster.name for r in meas.e2e)
    clusters.update(r.cluster for r in meas.collectives if r.cluster)
    families = Counter(g.gpu for g in meas.gemms)
    parts = [f"{name} ({n})" for name, n in clusters.most_common()]
    parts += [f"GEMMs of {fam} GPUs ({n})" for fam, n in families.most_common()]
    kernels = Counter(a.gpu for a in meas.attention)
    parts += [f"attention kernels of {fam} GPUs ({n})" for fam, n in kernels.most_common()]
    return ", ".join(parts) if parts else "no usable rows"


def _measurements(args) -> tuple[Measurements, Measurements]:
    """Every usable record in the files, and those of the clusters to calibrate.

    Raises:
        ValueError: no measurement of those clusters in the files.
    """
    everything = load(args.data, cluster=args.cluster)
    meas = placed_kernels(select(everything, args.cluster))
    if not (meas.e2e or meas.collectives or meas.gemms or meas.attention or meas.memory):
        raise ValueError(
            f"no measurements for {', '.join(args.cluster)} in {', '.join(map(str, args.data))}"
            f"; the files hold: {_found(everything)}"
        )
    return everything, meas


def runs_stacks(meas: Measurements) -> dict[str, str | None]:
    """{cluster: the software stack of all its end-to-end runs} (None: runs of several
    stacks, or of a stack ``diffcost.stacks`` does not know): the stack whose shipped offsets
    a calibration of that cluster starts from (a cluster without runs: none)."""
    seen: dict[str, set] = {}
    for r in meas.e2e:
        seen.setdefault(r.cluster.name, set()).add(r.stack)
    return {c: next(iter(s)) if len(s) == 1 else None for c, s in seen.items()}


def member_starts(
    clusters: list[str], start: dict, profile, stacks: dict | None = None
) -> tuple[list[str], list[dict]]:
    """(member names, one start per member) where a calibrated cluster predicts as the median
    over the population's members (``diffcost.profiles.population_members``: no profile of its
    own and ``profile`` None, each member with the offsets of the cluster's ``stacks``):
    member ``i`` starts each such cluster at the population's member ``i`` and every other
    cluster at ``start``. ([], []) when no cluster does."""
    names, by_cluster, stacks = [], {}, stacks or {}
    for name in clusters:
        cluster = load_cluster(name)
        members = prof.population_named(cluster, profile, stack=stacks.get(name))
        if members:
            names, by_cluster[name] = list(members), list(members.values())
    starts = [
        {c: by_cluster[c][i] if c in by_cluster else p for c, p in start.items()}
        for i in range(len(names))
    ]
    return names, starts


def member_values(
    problem: fit_mod.Problem, few: refit.Refit | None, names: list[str]
) -> dict[str, dict]:
    """{cluster: {member: constants in profile form}} of the members a few-shot refit shifted
    (``refit.fit_with_runs`` with ``member_starts``); {} when it refitted one set of
    constants."""
    if few is None or not isinstance(few.tables, list):
        return {}
    mean = fit_mod.result_from_tables(problem, refit.mean_tables(few.tables), {}, {}, [], 0, True)
    out: dict[str, dict] = {name: {} for name in problem.clusters}
    for member, tables in zip(names, few.tables):
        one = fit_mod.result_from_tables(problem, tables, {}, {}, [], 0.0, True)
        for name in problem.clusters:
            base, values = fitted_values(mean, name), fitted_values(one, name)
            out[name][member] = {k: v for k, v in values.items() if not _same(v, base.get(k))}
    return out


def _same(a, b) -> bool:
    """Whether two profile values (numbers, or nested mappings and lists of them) agree to
    float32 rounding: a member keeps only the constants where it differs from the mean."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(np.allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-5, atol=0))
    except (TypeError, ValueError):
        return a == b


def _write_profiles(
    args, paths: dict, result: fit_mod.FitResult, start_notes: dict, blocks: dict,
    members: dict | None = None,
) -> list:  # fmt: skip
    """Write one profile per calibrated cluster with fitted constants, its ``members``
    (``member_values``) and its ``uncertainty`` block (``blocks``,
    ``calibration.posterior.laplace``); the paths written."""
    members = members or {}
    written = []
    for name, path in paths.items():
        if name not in result.cluster_values:
            continue
        meta = {
            "layer": "cluster+device",
            "key": name,
            "gpu_family": cluster_family(name),
            "fitted_on": [str(p) for p in args.data],
            "started_from": start_notes[name],
            "command": "diffcost calibrate",
        }
        block = blocks.get(("cluster", name))
        values = fitted_values(result, name)
        written.append(prof.write_profile(path, values, meta, block, members.get(name)))
    return written


def _summary(args, meas, result: fit_mod.FitResult, start: dict, start_notes: dict, written):
    """The JSON summary of ``calibrate --json`` (also what the tables are printed from)."""
    rows = {
        level: {
            "rows": int(resid.size),
            "mape_before_pct": _mape(result.initial_residuals[level]),
            "mape_after_pct": _mape(resid),
        }
        for level, resid in result.residuals.items()
    }
    changes = {
        name: moved(prof.to_values(start[name]), fitted_values(result, name))
        for name in args.cluster
        if name in result.cluster_values
    }
    return {
        "clusters": args.cluster,
        "started_from": {c: start_notes[c] for c in args.cluster if c in start_notes},
        "rows": rows,
        "skipped": skipped_lines(meas),
        "steps": result.steps,
        "max_steps": args.steps,
        "seconds": result.seconds,
        "converged": result.converged,
        "written": [str(p) for p in written],
        "moved": {
            c: [{"constant": n, "before": b, "after": a} for n, b, a in v]
            for c, v in changes.items()
        },
        "device": result.device_values,
        "cluster": result.cluster_values,
    }


def few_shot_summary(few: refit.Refit | None) -> dict | None:
    """What the few-shot refit of a handful of runs did (``calibration.refit``), or None when
    the runs were fitted with the rest (``refit.fit_with_runs``)."""
    if few is None:
        return None
    return {
        "runs": int(few.residuals.size),
        "strength": few.strength,
        "loo_mean_abs_log_error": {
            ("none" if a == np.inf else f"{a:.3g}"): float(v) ** (1.0 / refit.LOO_POWER)
            for a, v in few.loo_mse.items()
        },
        "members": len(few.tables) if isinstance(few.tables, list) else 0,
    }


def _print_report(args, summary: dict, everything: Measurements, cfg: fit_mod.FitConfig) -> None:
    """Skipped rows, unused data, MAPE before and after, convergence, the constants that moved
    most, and the files written."""
    console = Console()
    for line in summary["skipped"]:
        console.print(f"skipped {line}")
    families = {cluster_family(c) for c in args.cluster}
    others = _found(
        Measurements(
            e2e=[r for r in everything.e2e if r.cluster.name not in args.cluster],
            collectives=[r for r in everything.collectives if r.cluster not in args.cluster],
            gemms=[g for g in everything.gemms if g.gpu not in families],
        )
    )
    if others != "no usable rows":
        console.print(f"not used (other clusters or GPUs): {others}")
    levels = [
        (level, str(r["rows"]), f"{r['mape_before_pct']:.1f}", f"{r['mape_after_pct']:.1f}")
        for level, r in summary["rows"].items()
    ]
    title = f"calibration of {', '.join(args.cluster)}"
    console.print(make_table(title, ("level", "rows", "MAPE before %", "MAPE after %"), levels))
    for name, note in summary["started_from"].items():
        console.print(f"{name} started from: {note} (the 'before' column)")
    stop = (
        f"converged after {summary['steps']} steps (loss changed < {cfg.tol:g} over "
        f"{cfg.patience} steps)"
        if summary["converged"]
        else f"stopped at the step limit, {summary['steps']} steps (not converged: raise --steps)"
    )
    if summary["steps"]:  # a few-shot refit of end-to-end runs alone takes no descent step
        console.print(f"{stop}, {summary['seconds']:.1f} s")
    few = summary.get("few_shot")
    if few is not None:
        how = (
            f"strength {few['strength']:.3g} chosen by leave-one-out over them"
            if few["strength"] is not None
            else "no update: leave-one-out over them did not beat the starting constants"
        )
        console.print(
            f"{few['runs']} end-to-end runs (fewer than {cfg.full_rows}): a few-shot update of "
            f"the starting constants (calibration.refit), {how}"
        )
        if few["members"]:
            console.print(
                f"the profile keeps the population's {few['members']} members, each shifted "
                "alike: predictions with it are the median over them, as without a profile"
            )
    for name, rows_moved in summary["moved"].items():
        if not rows_moved:
            console.print(f"{name}: no constant moved")
            continue
        cells = [
            (r["constant"], *moved_cells(r["constant"], r["before"], r["after"]))
            for r in rows_moved
        ]
        title = f"{name}: constants that moved most"
        console.print(make_table(title, ("constant", "before", "after"), cells))
    for p in summary["written"]:
        console.print(f"wrote {p} (use it with --profile {p})")
    for name in args.cluster:
        if name not in summary["cluster"]:
            console.print(f"no measurements of {name} in the files: no profile written for it")


def run(args) -> int:
    """``diffcost calibrate``: fit, write one profile per cluster, report before and after.

    Args:
        args: the parsed ``calibrate`` arguments (``calibration.cli.register``).

    Returns:
        0.

    Raises:
        ValueError: ``--steps`` below 1, a bad ``--out``, or no usable measurement.
        ConfigError: an unknown cluster preset.
    """
    if args.steps is None:
        args.steps = fit_mod.FitConfig().steps
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be at least 1")
    for name in args.cluster:
        load_cluster(name)  # an unknown preset fails here, with suggestions
    paths = output_paths(args.cluster, args.out)
    everything, meas = _measurements(args)
    problem = fit_mod.build_problem(meas)
    # A user's runs are one stack on their own cluster: its constants take the stack's effect
    # (the profile written has no stack offsets to apply), starting from its shipped offsets.
    stacks = runs_stacks(meas)
    start, start_notes = {}, {}
    for name in problem.clusters:
        cluster = load_cluster(name)
        stack = stacks.get(name)
        start[name], start_notes[name] = prof.params_for(cluster, args.start, stack=stack)
    cfg = fit_mod.FitConfig(steps=args.steps, stacks=False)
    # the starting profiles' residual spread: a few-shot refit matches runs no closer
    noise = max(
        prof.uncertainty_for(load_cluster(c), args.start).residual_sd for c in problem.clusters
    )
    names, starts = member_starts(problem.clusters, start, args.start, stacks)
    result, few = refit.fit_with_runs(meas, cfg, not args.json, problem, start, noise, starts)
    blocks, _ = posterior.laplace(problem, result, meas, cfg, start)
    members = member_values(problem, few, names)
    written = _write_profiles(args, paths, result, start_notes, blocks, members)
    summary = _summary(args, meas, result, start, start_notes, written)
    summary["few_shot"] = few_shot_summary(few)
    if args.json:
        print_json(summary)
    else:
        _print_report(args, summary, everything, cfg)
    return 0
