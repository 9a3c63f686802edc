"""The ``diffcost`` command line: predict, validate, calibrate, explain, search and sweep."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np

from diffcost import config as config_mod
from diffcost.simulate import STATUS_NAMES, Breakdown, time_part
from diffcost.specs import Experiment

GiB = 2.0**30
_PART_LABELS = {
    "compute_s": "compute",
    "tp_comm_s": "tensor-parallel comm (exposed)",
    "cp_comm_s": "context-parallel comm (exposed)",
    "ep_comm_s": "expert all-to-all (exposed)",
    "zero_comm_s": "ZeRO-3 gathers/scatters (exposed)",
    "pp_comm_s": "pipeline sends (fill/drain)",
    "dp_comm_s": "data-parallel sync (exposed)",
    "bubble_s": "pipeline bubble",
    "optimizer_s": "optimizer step",
    "overhead_s": "host overhead (iteration, microbatch steps)",
}
_MEMORY_PARTS = (
    "weights_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "activations_bytes",
    "buffers_bytes",
    "memory_stage_bytes",
)


def _experiment(args) -> Experiment:
    if args.megatron_args is not None:
        from diffcost.megatron_args import parse_megatron_args

        if not args.cluster or not args.gpus:
            raise config_mod.ConfigError("--megatron-args needs --cluster NAME and --gpus N")
        model, plan, ignored = parse_megatron_args(args.megatron_args, args.gpus)
        cluster = config_mod.load_cluster(args.cluster)
        exp = Experiment(model=model, cluster=cluster, plan=plan, source="--megatron-args")
        config_mod.validate_experiment(exp, n_gpus=args.gpus)
        if ignored and not args.json:
            print(f"ignored Megatron flags: {' '.join(ignored)}", file=sys.stderr)
        return exp
    if not args.config:
        raise config_mod.ConfigError(
            "give a CONFIG file (or --megatron-args with --cluster/--gpus)"
        )
    return config_mod.load_experiment(args.config, args.overrides)


def breakdown_dict(exp: Experiment, b: Breakdown) -> dict:
    """The JSON object printed by ``predict --json``."""
    f = lambda x: float(np.asarray(x))  # noqa: E731
    stages = ["first", "last"] if exp.plan.pp > 1 else ["only"]
    memory = {
        s: {k.removesuffix("_bytes"): f(getattr(b, k)[i]) for k in _MEMORY_PARTS}
        for i, s in enumerate(stages)
    }
    return {
        "config": exp.source,
        "model": exp.model.name,
        "cluster": exp.cluster.name,
        "n_gpus": exp.plan.n_gpus,
        "iteration_s": f(b.iteration_s),
        "tokens_per_s": f(b.tokens_per_s),
        "mfu": f(b.mfu),
        "breakdown": {k: f(time_part(b, k)) for k in Breakdown.TIME_PARTS},
        "memory_peak_bytes": f(b.memory_peak_bytes),
        "memory_capacity_bytes": f(b.memory_capacity_bytes),
        "memory_by_stage_bytes": memory,
        "status": STATUS_NAMES[int(b.status)],
    }


def _print_prediction(exp: Experiment, d: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    p = exp.plan
    console.print(
        f"[bold]{exp.model.name}[/] on [bold]{exp.cluster.name}[/], {p.n_gpus} GPUs: "
        f"tp={p.tp} pp={p.pp} dp={p.dp} cp={p.cp} ep={p.ep} sp={p.sequence_parallel} "
        f"zero={p.zero} recompute={p.recompute} mb={p.microbatch} gb={p.global_batch} "
        f"schedule={p.schedule}" + (f"(v={p.chunks})" if p.schedule == "interleaved" else "")
    )
    console.print(
        f"iteration [bold]{d['iteration_s']:.4g} s[/]   tokens/s {d['tokens_per_s']:.4g}   "
        f"MFU {100 * d['mfu']:.1f}%"
    )
    t = Table(title="time per iteration")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    for key, value in d["breakdown"].items():
        t.add_row(_PART_LABELS[key], f"{value:.4g}", f"{100 * value / d['iteration_s']:.1f}%")
    console.print(t)
    m = Table(title="memory per GPU (GiB)")
    m.add_column("stage")
    for k in _MEMORY_PARTS:
        m.add_column(k.removesuffix("_bytes").replace("memory_stage", "total"), justify="right")
    for stage, parts in d["memory_by_stage_bytes"].items():
        m.add_row(stage, *(f"{parts[k.removesuffix('_bytes')] / GiB:.2f}" for k in _MEMORY_PARTS))
    console.print(m)
    cap = d["memory_capacity_bytes"] / GiB
    verdict = {"ok": "[green]fits[/]", "oom": "[red]OUT OF MEMORY[/]", "invalid": "[red]INVALID[/]"}
    console.print(
        f"peak {d['memory_peak_bytes'] / GiB:.2f} GiB of {cap:.0f} GiB: {verdict[d['status']]}"
    )


def cmd_predict(args) -> int:
    from diffcost import api

    exp = _experiment(args)
    params, note = api.params_for(exp, args.profile)
    b = api.predict(exp, params=params)
    d = breakdown_dict(exp, b)
    d["profile"] = note
    if args.trace:
        from diffcost import trace

        trace.write_experiment_trace(args.trace, exp, params)
        d["trace"] = args.trace
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        _print_prediction(exp, d)
        print(f"constants: {note}")
        if args.trace:
            print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    return 0


def cmd_calibrate(args) -> int:
    from calibration import command

    return command.run(args)


def cmd_validate(args) -> int:
    from diffcost.validate import validate

    out = validate(args.csv, profile=args.profile)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"validation against {args.csv}")
    for col in ("source", "rows", "predicted", "skipped", "MAPE %", "max APE %", "Kendall tau"):
        if col == "source":  # names are long; wrap them on a narrow terminal, never cut them
            t.add_column(col, overflow="fold", min_width=12)
        else:
            t.add_column(col, justify="right")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for name, s in [*out["by_source"].items(), ("all", out["summary"])]:
        t.add_row(
            name,
            str(s["rows"]),
            str(s["predicted"]),
            str(s["skipped"]),
            fmt(s["mape_pct"], ".1f"),
            fmt(s["max_ape_pct"], ".1f"),
            fmt(s["kendall_tau"], ".3f"),
        )
    console.print(t)
    for cluster, note in out.get("profiles", {}).items():
        console.print(f"constants for {cluster}: {note}")
    skipped = [r for r in out["rows"] if r["skipped"]]
    if skipped:
        console.print(f"[bold]{len(skipped)} rows skipped:[/]")
        for r in skipped:
            console.print(f"  row {r['row']} ({r['source']}, {r['model']}): {r['skipped']}")
    if args.rows:
        rt = Table(title="rows")
        for col in ("row", "source", "model", "measured s", "predicted s", "APE %", "defaults"):
            rt.add_column(col)
        for r in out["rows"]:
            if r["skipped"]:
                continue
            rt.add_row(
                str(r["row"]),
                r["source"],
                r["model"],
                f"{r['measured_iter_s']:.4g}",
                f"{r['predicted_iter_s']:.4g}",
                fmt(r["ape_pct"], ".1f"),
                "; ".join(r["defaults"]),
            )
        console.print(rt)
    else:
        console.print("per-row results and the defaults used: --rows or --json")
    return 0


def cmd_explain(args) -> int:
    from diffcost import explain

    if args.top is not None and args.top < 1:
        raise config_mod.ConfigError(f"--top {args.top}: must be at least 1")
    exp = config_mod.load_experiment(args.config, args.overrides)
    d = explain.explain(exp, profile=args.profile)
    d["elasticities"] = d["elasticities"][: args.top]
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        explain.print_table(exp, d)
    return 0


def _add_space_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model preset (e.g. gpt3-175b) or model YAML")
    p.add_argument("--cluster", required=True, help="cluster preset or cluster YAML")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per iteration")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's seq_len)")
    p.add_argument("--profile", help="calibrated profile file, or 'none' for datasheet defaults")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _plan_experiment(space, choice) -> Experiment:
    return Experiment(
        model=space.model,
        cluster=space.cluster,
        plan=space.plan_spec(choice),
        source=f"search {space.model.name} on {space.n_gpus} GPUs of {space.cluster.name}",
    )


def cmd_search(args) -> int:
    from diffcost import api
    from diffcost import search as search_mod
    from diffcost.profiles import params_for
    from diffcost.space import load_space

    space = load_space(args.model, args.cluster, args.gpus, args.global_batch, args.seq)
    if args.top < 1:
        raise config_mod.ConfigError(f"--top {args.top}: must be at least 1")
    params, note = params_for(space.cluster, args.profile)
    cfg = search_mod.SearchConfig(starts=args.starts, steps=args.steps, seed=args.seed)
    if not args.json:
        print(f"constants: {note}", file=sys.stderr)
        print(
            f"searching {args.starts} relaxed starts x {args.steps} steps "
            "(a first run compiles for a minute or two; later runs reuse the disk cache)...",
            file=sys.stderr,
        )
    result = search_mod.search(space, params, args.top, cfg)
    stats = {
        "seconds": result.seconds,
        "descent_s": result.descent_s,
        "rounding_s": result.rounding_s,
        "polish_s": result.polish_s,
        "evaluated": result.evaluated,
        "polish_rounds": result.rounds,
    }
    top = []
    for c in result.best:
        exp = _plan_experiment(space, c.choice)
        d = breakdown_dict(exp, api.predict(exp, params=params))
        top.append({"plan": c.choice.describe(space), "label": c.choice.label(space), **d})
    closest = result.closest
    out = {
        "model": space.model.name,
        "cluster": space.cluster.name,
        "n_gpus": space.n_gpus,
        "global_batch": space.global_batch,
        "seq_len": space.model.seq_len,
        "profile": note,
        "fits": bool(top),
        "search": stats,
        "top": top,
        "closest": {
            "plan": closest.choice.describe(space),
            "label": closest.choice.label(space),
            "memory_peak_bytes": closest.memory_peak_bytes,
            "memory_capacity_bytes": space.cluster.gpu.memory_GiB * GiB,
            "status": STATUS_NAMES[closest.status],
        },
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0 if top else 1
    if not top:
        cap = space.cluster.gpu.memory_GiB
        print(
            f"nothing fits: no plan of {space.model.name} on {space.n_gpus} GPUs of "
            f"{space.cluster.name} with global batch {space.global_batch} fits in {cap:g} GiB per "
            f"GPU. The smallest peak memory reached is {closest.memory_peak_bytes / GiB:.1f} GiB "
            f"({closest.choice.label(space)}); use more GPUs, a GPU with more memory, or a "
            "shorter sequence."
        )
        return 1
    _print_prediction(_plan_experiment(space, result.best[0].choice), top[0])
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"top {len(top)} plans found (seconds per iteration)")
    cols = ("#", "plan", "iteration", "vs best", "compute", "comm", "bubble", "other", "MFU %")
    for col in (*cols, "peak GiB"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    best_s = top[0]["iteration_s"]
    for i, d in enumerate(top, 1):
        parts = d["breakdown"]
        comm = sum(v for k, v in parts.items() if k.endswith("comm_s"))
        other = parts["optimizer_s"] + parts["overhead_s"]
        t.add_row(
            str(i),
            d["label"],
            f"{d['iteration_s']:.4g}",
            f"+{100 * (d['iteration_s'] / best_s - 1):.2f}%",
            f"{parts['compute_s']:.3g}",
            f"{comm:.3g}",
            f"{parts['bubble_s']:.3g}",
            f"{other:.3g}",
            f"{100 * d['mfu']:.1f}",
            f"{d['memory_peak_bytes'] / GiB:.1f}",
        )
    Console().print(t)
    print(
        f"search: {result.seconds:.2f} s (descent {result.descent_s:.2f} s, rounding "
        f"{result.rounding_s:.2f} s, polish {result.polish_s:.2f} s), {result.evaluated} "
        f"discrete plans evaluated exactly, {result.rounds} polish rounds (a first run also "
        f"compiles); comm = exposed communication, other = optimizer + overhead; constants: {note}"
    )
    return 0


def cmd_sweep(args) -> int:
    from diffcost import sweep

    return sweep.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffcost",
        description="Predict the iteration time and memory of distributed LLM training.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="predict one model + cluster + plan")
    p.add_argument("config", nargs="?", help="experiment YAML (configs/examples/...)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. plan.tp=4")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto timeline")
    p.add_argument(
        "--megatron-args", metavar="ARGS", help="read model and plan from Megatron flags"
    )
    p.add_argument("--cluster", help="cluster preset (with --megatron-args)")
    p.add_argument("--gpus", type=int, help="GPU count (with --megatron-args)")
    p.add_argument("--profile", help="calibrated profile file, or 'none' for datasheet defaults")
    p.set_defaults(func=cmd_predict)
    v = sub.add_parser("validate", help="compare predictions with measured runs (CSV)")
    v.add_argument("csv", help="CSV in the schema of shared/data/README.md")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument("--rows", action="store_true", help="print every row")
    v.add_argument("--profile", help="calibrated profile file, or 'none' for datasheet defaults")
    v.set_defaults(func=cmd_validate)
    c = sub.add_parser("calibrate", help="fit a cluster's constants to measurements")
    c.add_argument("data", nargs="+", help="measurement files or folders (CSV, nccl-tests logs)")
    c.add_argument(
        "--cluster",
        action="append",
        required=True,
        help="cluster preset to calibrate (repeat for a joint fit)",
    )
    c.add_argument(
        "--out",
        metavar="FILE|DIR/",
        help="profile file to write (one cluster), or a folder for <cluster>-profile.yaml "
        "files (default: <cluster>-profile.yaml here; the shipped profiles are rebuilt by "
        "python -m calibration.make_profiles)",
    )
    c.add_argument(
        "--from",
        dest="start",
        metavar="PROFILE",
        help="constants to start from and stay near where the data say nothing: a profile "
        "file, or 'none' for datasheet defaults (default: the cluster's calibrated profile)",
    )
    c.add_argument(
        "--steps", type=int, default=600, help="maximum optimizer steps (default: %(default)s)"
    )
    c.add_argument("--json", action="store_true", help="print one JSON summary")
    c.set_defaults(func=cmd_calibrate)
    e = sub.add_parser("explain", help="elasticity of iteration time to every hardware knob")
    e.add_argument("config", help="experiment YAML (configs/examples/...)")
    e.add_argument("overrides", nargs="*", help="key=value overrides, e.g. plan.tp=4")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--top", type=int, metavar="N", help="only the N largest magnitudes")
    e.add_argument("--profile", help="calibrated profile file, or 'none' for datasheet defaults")
    e.set_defaults(func=cmd_explain)
    s = sub.add_parser("search", help="find a fast plan that fits (gradient descent + polish)")
    _add_space_arguments(s)
    s.add_argument("--top", type=int, default=5, metavar="K", help="print the K best plans")
    s.add_argument("--starts", type=int, default=32, help="relaxed starts descending at once")
    s.add_argument("--steps", type=int, default=150, help="optimizer steps per start")
    s.add_argument("--seed", type=int, default=0, help="seed of the random starts")
    s.set_defaults(func=cmd_search)
    from diffcost import sweep

    w = sub.add_parser("sweep", help="evaluate every valid plan (sharded over devices)")
    sweep.add_arguments(w)
    w.set_defaults(func=cmd_sweep)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from diffcost.cache import enable_compilation_cache

    enable_compilation_cache()
    if getattr(args, "config", None) and "=" in args.config and args.command == "predict":
        parser.error(f"CONFIG must come first; got override {args.config!r}")
    try:
        return args.func(args)
    except (config_mod.ConfigError, ValueError, FileNotFoundError, OSError) as e:
        print(f"diffcost {args.command}: error: {e}", file=sys.stderr)
        return 2
