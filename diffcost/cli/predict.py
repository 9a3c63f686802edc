"""``diffcost predict``: one model + cluster + plan, as tables or one JSON object.

The tables (``print_prediction``) and the JSON object (``breakdown_dict``) are shared with
``diffcost search``, which prints its best plan the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
from rich.console import Console

from diffcost import config as config_mod
from diffcost import trace
from diffcost.arrays import GiB
from diffcost.cli import common, graph
from diffcost.interval import predict_interval
from diffcost.megatron_args import parse_megatron_args
from diffcost.simulate import STATUS_NAMES, Breakdown, time_part
from diffcost.specs import Experiment
from diffcost.stacks import STACK_NAMES, canonical

PART_LABELS = {
    "compute_s": "compute",
    "tp_comm_s": "tensor-parallel comm (exposed)",
    "cp_comm_s": "context-parallel comm (exposed)",
    "ep_comm_s": "expert all-to-all (exposed)",
    "zero_comm_s": "per-layer ZeRO gathers/scatters (exposed)",
    "pp_comm_s": "pipeline sends (fill/drain)",
    "dp_comm_s": "data-parallel sync (exposed)",
    "bubble_s": "pipeline bubble",
    "optimizer_s": "optimizer step",
    "overhead_s": "host overhead (iteration, microbatch steps)",
}
MEMORY_PARTS = (
    "weights_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "activations_bytes",
    "buffers_bytes",
    "memory_stage_bytes",
)
_VERDICT = {"ok": "[green]fits[/]", "oom": "[red]OUT OF MEMORY[/]", "invalid": "[red]INVALID[/]"}


def register(subparsers) -> None:
    """Add ``predict`` to the ``diffcost`` subcommands.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    p = subparsers.add_parser(
        "predict",
        help="predict one model + cluster + plan",
        description="Predict the iteration time (with its 80% interval: the calibration "
        "posterior of the cluster's profile propagated by the Jacobian, the model's residual "
        "spread and, for a --stack without runs in the profile, the stack spread), the time "
        "and memory breakdown, and warnings where the prediction extrapolates beyond the "
        "profile's runs (GPU family, stack, scale, constants at datasheet defaults).",
    )
    common.add_experiment_arguments(p, required=False)
    common.add_json_argument(p)
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto timeline")
    p.add_argument(
        "--megatron-args", metavar="ARGS", help="read model and plan from Megatron flags"
    )
    p.add_argument("--cluster", help="cluster preset (with --megatron-args)")
    p.add_argument(
        "--topology",
        metavar="NAME",
        help="price the collectives on a network graph: 'cluster' (the graph the cluster "
        "describes), a configs/topologies preset or a YAML file (sets cluster.topology)",
    )
    p.add_argument("--gpus", type=int, help="GPU count (with --megatron-args)")
    common.add_profile_argument(p)
    p.add_argument(
        "--stack",
        metavar="NAME",
        help="software stack of the run: " + ", ".join(STACK_NAMES) + ", or a framework "
        "(NeMo, Megatron-DeepSpeed, torchtitan, ...); default: the config's 'stack', else the "
        "stack the profile was fitted on. A known stack's calibrated offsets apply; a stack "
        "without end-to-end runs in the profile widens the 80%% interval and adds a warning",
    )
    graph.add_graph_arguments(p)
    p.set_defaults(func=run)


def _experiment(args: argparse.Namespace) -> Experiment:
    """The experiment of a CONFIG with overrides, or of ``--megatron-args``, on the
    ``--topology`` graph when given."""
    exp = _loaded(args)
    if getattr(args, "topology", None):
        exp = dataclasses.replace(
            exp, cluster=dataclasses.replace(exp.cluster, topology=args.topology)
        )
    return exp


def _loaded(args: argparse.Namespace) -> Experiment:
    """The experiment of a CONFIG with overrides, or of ``--megatron-args``.

    Raises:
        ConfigError: neither given, or ``--megatron-args`` without ``--cluster`` and ``--gpus``.
    """
    if args.megatron_args is not None:
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
    """The JSON object printed by ``predict --json``.

    Args:
        exp: the experiment predicted.
        b: its prediction (scalar leaves; memory parts per stage: first and last).

    Returns:
        Plain Python values: names, ``iteration_s``, ``tokens_per_s``, ``mfu``, the time
        ``breakdown`` (seconds per part), peak and capacity bytes, ``memory_by_stage_bytes``
        and the ``status`` name.
    """
    f = lambda x: float(np.asarray(x))  # noqa: E731
    stages = ["first", "last"] if exp.plan.pp > 1 else ["only"]
    memory = {
        s: {k.removesuffix("_bytes"): f(getattr(b, k)[i]) for k in MEMORY_PARTS}
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


def print_prediction(exp: Experiment, d: dict) -> None:
    """Print the plan, the headline figures, the time and memory tables and the verdict.

    Args:
        exp: the experiment predicted.
        d: its ``breakdown_dict``.
    """
    console = Console()
    p = exp.plan
    share = f"({p.recompute_fraction:g} of layers)" if p.recompute_fraction < 1 else ""
    gather = "(per layer)" if p.param_gather == "layer" else ""
    console.print(
        f"[bold]{exp.model.name}[/] on [bold]{exp.cluster.name}[/], {p.n_gpus} GPUs: "
        f"tp={p.tp} pp={p.pp} dp={p.dp} cp={p.cp} ep={p.ep} sp={p.sequence_parallel} "
        f"zero={p.zero}{gather} recompute={p.recompute}{share} mb={p.microbatch} "
        f"gb={p.global_batch} schedule={p.schedule}"
        + (f"(v={p.chunks})" if p.schedule == "interleaved" else "")
        + (f" offload={p.offload_fraction:g} of layers" if p.offload_fraction else "")
    )
    interval = ""
    if d.get("iteration_s_low") is not None:
        interval = f" ({d['iteration_s_low']:.3g}–{d['iteration_s_high']:.3g})"
    console.print(
        f"iteration [bold]{d['iteration_s']:.4g} s[/]{interval}   tokens/s "
        f"{d['tokens_per_s']:.4g}   MFU {100 * d['mfu']:.1f}%"
    )
    times = [
        (PART_LABELS[key], f"{value:.4g}", f"{100 * value / d['iteration_s']:.1f}%")
        for key, value in d["breakdown"].items()
    ]
    console.print(common.make_table("time per iteration", ("part", "seconds", "share"), times))
    names = [k.removesuffix("_bytes") for k in MEMORY_PARTS]
    memory = [
        (stage, *(f"{parts[name] / GiB:.2f}" for name in names))
        for stage, parts in d["memory_by_stage_bytes"].items()
    ]
    columns = ("stage", *(name.replace("memory_stage", "total") for name in names))
    console.print(common.make_table("memory per GPU (GiB)", columns, memory))
    cap = d["memory_capacity_bytes"] / GiB
    console.print(
        f"peak {d['memory_peak_bytes'] / GiB:.2f} GiB of {cap:.0f} GiB: {_VERDICT[d['status']]}"
    )


def run(args: argparse.Namespace) -> int:
    """Predict, print the tables or the JSON object, write the trace when asked.

    Args:
        args: the parsed ``predict`` arguments.

    Returns:
        0.

    Raises:
        ConfigError: a bad config, override or Megatron flag.
        diffcost.profiles.ProfileError: a bad ``--profile``.
    """
    if args.graph or graph.graph_config(args.config):
        return graph.run_predict(args)
    exp = _experiment(args)
    if canonical(args.stack) in STACK_NAMES:
        exp = dataclasses.replace(exp, stack=canonical(args.stack))
    pred = predict_interval(exp, profile=args.profile, stack=args.stack)
    note = pred.profile
    d = breakdown_dict(exp, pred.breakdown)
    d["iteration_s_low"], d["iteration_s_high"] = pred.low_s, pred.high_s
    d["interval"] = {
        "level": 0.8,
        "log_sd": pred.spread.log_sd,
        "posterior_sd": pred.spread.posterior_sd,
        "residual_sd": pred.spread.residual_sd,
        "stack_sd": pred.spread.stack_sd,
        "stack": pred.stack,
        "stack_seen": pred.stack_seen,
    }
    d["warnings"] = list(pred.warnings)
    d["profile"] = note
    if args.trace:
        trace.write_experiment_trace(args.trace, exp, pred.params)
        d["trace"] = args.trace
    if args.json:
        common.print_json(d)
        return 0
    print_prediction(exp, d)
    print(f"constants: {note}")
    for warning in d["warnings"]:
        print(f"warning: {warning}")
    if args.trace:
        print(f"trace written to {args.trace} (open in https://ui.perfetto.dev)")
    return 0
