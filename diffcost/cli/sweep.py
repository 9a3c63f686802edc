"""``diffcost sweep``: every valid plan evaluated, the fastest listed, a CSV file and a plot.

``diffcost.sweep`` evaluates the plans and summarises them; this module shows a progress bar
while it runs, prints the report (or one JSON object), and writes the CSV file
(``write_csv``) and the Pareto plot (``plot_pareto``). Exit code 1 when no plan fits.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from diffcost import sweep
from diffcost.arrays import GiB
from diffcost.cli import common
from diffcost.config import ConfigError
from diffcost.population import median_note
from diffcost.profiles import params_for, population_members
from diffcost.simulate import STATUS_INVALID, STATUS_OK
from diffcost.space import load_space

PLOT_MEMORY_RANGE = 3.0  # the plot's memory axis ends at this multiple of the GPU memory
TOP_COLUMNS = ("plan", "iteration s", "tokens/s", "MFU %", "peak GiB")


def register(subparsers) -> None:
    """Add ``sweep`` to the ``diffcost`` subcommands.

    Args:
        subparsers: what ``ArgumentParser.add_subparsers`` returned.
    """
    w = subparsers.add_parser("sweep", help="evaluate every valid plan (sharded over devices)")
    add_arguments(w)
    w.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``sweep`` command's arguments to a parser.

    Args:
        parser: the command's parser.
    """
    common.add_space_arguments(parser)
    parser.add_argument("--out", metavar="FILE.csv", help="write one row per configuration")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="Pareto plot (default with --out: <stem>_pareto.png next to it)",
    )
    parser.add_argument(
        "--top", type=int, default=sweep.DEFAULT_TOP, metavar="K", help="fastest plans to list"
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=sweep.DEFAULT_CHUNK,
        metavar="N",
        help="configurations per compiled call",
    )
    common.add_profile_argument(parser)
    common.add_json_argument(parser)


def _gpus(n: int) -> str:
    """``1 GPU``, ``8 GPUs``."""
    return f"{n} GPU" + ("" if n == 1 else "s")


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------
def write_csv(path: str | os.PathLike, result: sweep.SweepResult) -> Path:
    """Write one row per configuration (columns: ``diffcost.sweep.csv_header()``).

    Args:
        path: the CSV file; its folder is created.
        result: a sweep.

    Returns:
        The path written.
    """
    columns = sweep.csv_columns(result)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = sweep.csv_header()
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(zip(*(columns[h] for h in header)))
    return path


def _annotate(ax, result: sweep.SweepResult, mem: np.ndarray, capacity: float, fits: bool):
    """Mark the fastest plan that fits, or say in the middle of the plot that none does."""
    if not fits:
        ax.text(
            0.5,
            0.5,
            f"no plan fits in {capacity:.0f} GiB",
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=12,
            color="#b22222",
        )
        return
    i = sweep.best(result, 1)[0]
    t = result.breakdown.iteration_s
    ax.annotate(
        f"fastest: {result.choices[i].label(result.space)}\n{t[i]:.3g} s, {mem[i]:.1f} GiB",
        xy=(mem[i], t[i]),
        xytext=(14, 14),
        textcoords="offset points",
        fontsize=8,
        bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "0.6", "alpha": 0.9},
        arrowprops={"arrowstyle": "->", "lw": 0.8},
    )


def _log_time_axis(ax, times: np.ndarray) -> None:
    """A logarithmic time axis with plain tick labels when the times span more than 10x."""
    from matplotlib import ticker

    if times.size and np.min(times) > 0 and np.max(times) > 10 * np.min(times):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(
            ticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else "")
        )


def plot_pareto(path: str | os.PathLike, result: sweep.SweepResult) -> Path:
    """Write a PNG of iteration time against peak memory per GPU, with the Pareto front.

    Feasible configurations are small grey points, out-of-memory ones light red; the front is
    a line with markers; a dashed vertical line marks the GPU memory; the fastest feasible
    plan is annotated. When some plan fits, the memory axis stops at ``PLOT_MEMORY_RANGE``
    times the GPU memory (the legend counts the points beyond). The time axis is logarithmic
    when the points shown span more than 10x.

    Args:
        path: the PNG file; its folder is created.
        result: a sweep.

    Returns:
        The path written.
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, renders with Agg

    b, space = result.breakdown, result.space
    mem = b.memory_peak_bytes / GiB
    t = b.iteration_s
    capacity = float(np.max(b.memory_capacity_bytes)) / GiB
    front = sweep.result_front(result)
    shown = np.isfinite(mem) & np.isfinite(t) & (b.status != STATUS_INVALID)
    right = PLOT_MEMORY_RANGE * capacity
    beyond = shown & (mem > right) if front.size else np.zeros_like(shown)
    shown &= ~beyond
    ok = shown & (b.status == STATUS_OK)
    oom = shown & (b.status != STATUS_OK)

    fig = Figure(figsize=(9, 6), dpi=120)
    ax = fig.add_subplot()
    oom_label = "out of memory" + (
        f" ({int(beyond.sum()):,} beyond {right:.0f} GiB not shown)" if beyond.any() else ""
    )
    ax.scatter(mem[oom], t[oom], s=4, color="#f4a6a6", alpha=0.4, lw=0, label=oom_label)
    ax.scatter(mem[ok], t[ok], s=4, color="0.55", alpha=0.4, lw=0, label="fits")
    if front.size:
        ax.plot(mem[front], t[front], "o-", color="C0", ms=4, lw=1.5, label="Pareto front")
    _annotate(ax, result, mem, capacity, fits=bool(front.size))
    ax.axvline(capacity, color="k", ls="--", lw=1, label=f"GPU memory {capacity:.0f} GiB")
    if beyond.any():
        ax.set_xlim(0, right)
    _log_time_axis(ax, t[shown])
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("iteration time (s)")
    ax.set_title(
        f"{space.model.name} on {space.cluster.name}: {_gpus(space.n_gpus)}, global batch "
        f"{space.global_batch}, {len(result.choices):,} configurations",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize=8, markerscale=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------
class _RateColumn(ProgressColumn):
    """Configurations per second, once rich has a speed estimate."""

    def render(self, task):
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"{speed:,.0f} configurations/s")


def _progress_bar(enabled: bool) -> Progress:
    """A rich progress bar on stderr with a configurations/s column (disabled: no output)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=True,
    )


def _files(args: argparse.Namespace, result: sweep.SweepResult) -> tuple[str | None, str | None]:
    """Write the CSV file and the plot asked for; their paths (None: not written)."""
    plot = args.plot
    if plot is None and args.out:
        out = Path(args.out)
        plot = str(out.with_name(f"{out.stem}_pareto.png"))
    csv_path = str(write_csv(args.out, result)) if args.out else None
    plot_path = str(plot_pareto(plot, result)) if plot else None
    return csv_path, plot_path


def _summary(result: sweep.SweepResult, top: np.ndarray, note: str, files) -> dict:
    """The JSON object of ``sweep --json`` (``top``: the indices of the plans to list)."""
    space = result.space
    low = sweep.smallest_memory(result)
    counts = sweep.status_counts(result)
    return {
        "model": space.model.name,
        "cluster": space.cluster.name,
        "n_gpus": space.n_gpus,
        "global_batch": space.global_batch,
        "profile": note,
        "space_size": len(result.choices),
        "devices": result.devices,
        "sweep_s": result.seconds,
        "compile_s": result.compile_s,
        "configs_per_s": result.configs_per_s,
        "status_counts": counts,
        "fits": counts["ok"] > 0,
        "top": [sweep.plan_row(result, int(i)) for i in top],
        "smallest_memory": None if low is None else sweep.plan_row(result, low),
        "memory_capacity_gib": float(np.max(result.breakdown.memory_capacity_bytes)) / GiB,
        "pareto_size": int(sweep.result_front(result).size),
        "csv": files[0],
        "plot": files[1],
    }


def run(args: argparse.Namespace) -> int:
    """Sweep the space, write the files asked for, print the report or the JSON object.

    Args:
        args: the parsed ``sweep`` arguments.

    Returns:
        0, or 1 when no plan fits in memory (the report says so).

    Raises:
        ConfigError: bad model, cluster, GPU count, batch, --top or --chunk.
        diffcost.profiles.ProfileError: a bad --profile.
    """
    if args.top < 0:
        raise ConfigError(f"--top {args.top}: need 0 or more")
    if args.chunk < 1:
        raise ConfigError(f"--chunk {args.chunk}: need at least 1")
    space = load_space(
        args.model,
        args.cluster,
        args.gpus,
        args.global_batch,
        seq=args.seq,
        param_gather=args.param_gather,
    )
    params, note = params_for(space.cluster, args.profile)
    members = population_members(space.cluster, args.profile)
    if members:  # as predict: every plan timed with each member, their median
        note += f"; {median_note(len(members))}"
    if not args.json:
        print(f"constants: {note}")

    with _progress_bar(not args.json and sys.stderr.isatty()) as bar:
        task = bar.add_task("compiling", total=None)
        kw = dict(
            chunk=args.chunk,
            progress=lambda done, total: bar.update(
                task, description="sweep", completed=done, total=total
            ),
        )
        if members:
            result = sweep.sweep_members(space, members, **kw)
        else:
            result = sweep.sweep(space, params, **kw)
    top = sweep.best(result, args.top)
    d = _summary(result, top, note, _files(args, result))
    if args.json:
        common.print_json(d)
    else:
        _print_report(result, top, d)
    return 0 if d["fits"] else 1  # as ``search``: exit code 1 when no plan fits


def _nothing_fits(result: sweep.SweepResult, head: str, d: dict) -> str:
    """The sentence saying that no plan fits, and the smallest peak memory reached."""
    low = sweep.smallest_memory(result)
    lowest = (
        "no valid plan to compare"
        if low is None
        else f"the smallest peak is {result.breakdown.memory_peak_bytes[low] / GiB:.1f} GiB, "
        f"reached by {result.choices[low].label(result.space)}"
    )
    return (
        f"[bold red]Nothing fits:[/] none of the {len(result.choices):,} plans of {head} "
        f"fits in {d['memory_capacity_gib']:.0f} GiB per GPU; {lowest}. Use more GPUs, a "
        "smaller model or sequence, or GPUs with more memory."
    )


def _print_report(result: sweep.SweepResult, top: np.ndarray, d: dict) -> None:
    """The fastest plans (or why none is listed), then the counts, timings and files."""
    console = Console()
    space, b = result.space, result.breakdown
    head = escape(
        f"{space.model.name} on {space.cluster.name}, {_gpus(space.n_gpus)}, global batch "
        f"{space.global_batch}"
    )
    counts = d["status_counts"]
    if top.size:
        rows = [
            (
                result.choices[i].label(space),
                f"{b.iteration_s[i]:.4g}",
                f"{b.tokens_per_s[i]:,.0f}",
                f"{100 * b.mfu[i]:.1f}",
                f"{b.memory_peak_bytes[i] / GiB:.1f}",
            )
            for i in top
        ]
        title = f"{head}: the {top.size} fastest plans that fit"
        console.print(common.make_table(title, TOP_COLUMNS, rows))
    elif counts["ok"] > 0:
        console.print(f"{head}: {counts['ok']:,} plans fit (--top 0: none listed)")
    else:
        console.print(_nothing_fits(result, head, d), soft_wrap=True)
    by_status = ", ".join(f"{v:,} {k}" for k, v in counts.items())
    files = [f for f in (d["csv"], d["plot"]) if f]
    wrote = f"; wrote {', '.join(files)}" if files else ""
    console.print(
        f"{len(result.choices):,} configurations ({by_status}) on {result.devices} device(s) "
        f"in {result.seconds:.2f} s (compilation {result.compile_s:.2f} s, then "
        f"{result.configs_per_s:,.0f} configurations/s); "
        f"Pareto front: {d['pareto_size']} plans{wrote}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
