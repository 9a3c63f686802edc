"""Where a JAX training step without recompute spends its time: one GPT step, in variants.

    python benchmarks/gpu_remat.py --out DIR [--budget-s 240] [--trace] [--quick]

On the H100 and H200 (``benchmarks/results/h100``, ``h200``) a ``gpu_measure.py`` step with full
recompute takes about as long as the same step without (0.85-1.06x), though it does a third
more matrix FLOPs, and the steps without recompute run 10-26% slower than their kernels predict
(docs/calibration.md; the figures in benchmarks/results/HISTORY.md, nineteenth session). This
script times one configuration of ``gpu_measure.py``'s GPT (default GPT-h1024-L24, 2,048
tokens, microbatch 8) built the same way, in variants that separate the suspects:

* ``loop``: the layers under ``lax.scan`` (as ``gpu_measure.py``), or unrolled in Python, which
  keeps no stacked residual buffers;
* ``recompute``: what a layer's backward keeps: everything (``none``), its input only
  (``full``), or the matrix products' outputs (``dots``, ``jax.checkpoint_policies.
  dots_saveable``), the rest recomputed.

Per variant it writes one row of ``remat.csv``: the step time (median of ``--steps`` after 3
warm-up), XLA's cost analysis of the compiled step (FLOPs, bytes accessed), its buffer
assignment, and counts of the optimized HLO's instructions by kind (once per while-loop body,
not per iteration). With ``--trace`` it also records 3 steps of each variant with
``jax.profiler`` and writes ``kernels.csv``: per variant and device, the time of every kernel
(or host event on a machine without a GPU) summed over the recorded steps, largest first.
``meta.json`` says where and when. Runs where only jax, optax and numpy are installed.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_measure as gm  # noqa: E402

# (loop, recompute): unroll only what the scan cannot tell apart
VARIANTS = (
    ("scan", "none"),
    ("scan", "full"),
    ("scan", "dots"),
    ("unrolled", "none"),
    ("unrolled", "full"),
)
# (name, layers, hidden, heads, seq, microbatch): gpu_measure's GPT-h1024-L24 at microbatch 8
CONFIG = ("GPT-h1024-L24", 24, 1024, 16, 2048, 8)
COLUMNS = (
    "model,layers,hidden,heads,seq_len,microbatch,loop,recompute,step_s,step_s_min,step_s_max,"
    "tflops_per_s,flops,bytes_accessed,peak_mem_gib"
).split(",")
# optimized-HLO instruction kinds counted per variant (column hlo_<kind>)
HLO_KINDS = ("fusion", "copy", "transpose", "dynamic-update-slice", "dynamic-slice", "while")
CUSTOM_CALLS = {"gemm": r"cublas", "attention": r"cudnn\$fmha|__cudnn"}
KERNEL_COLUMNS = ("loop", "recompute", "device", "name", "count", "total_us", "share")
TOP_KERNELS = 60  # kernels.csv keeps each variant's largest per device, then one "(other)" row


def hlo_counts(text: str) -> dict:
    """{hlo_<kind>: instructions} of an optimized HLO module's text, and the custom calls by
    target (``hlo_gemm``: cuBLAS, ``hlo_attention``: cuDNN attention)."""
    counts = collections.Counter()
    for line in text.splitlines():
        _, eq, rest = line.partition(" = ")
        op = re.search(r"([a-z][a-z0-9-]*)\(", rest) if eq else None
        if op:
            counts[op.group(1)] += 1
    out = {f"hlo_{k}": counts.get(k, 0) for k in HLO_KINDS}
    targets = re.findall(r'custom_call_target="([^"]+)"', text)
    for name, pattern in CUSTOM_CALLS.items():
        out[f"hlo_{name}"] = sum(1 for t in targets if re.search(pattern, t))
    return out


def cost(compiled) -> tuple[float, float]:
    """(FLOPs, bytes accessed) of XLA's cost analysis of a compiled program (nan if absent)."""
    try:
        c = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends have none
        return float("nan"), float("nan")
    if isinstance(c, (list, tuple)):
        c = c[0] if c else {}
    c = c or {}
    return float(c.get("flops", np.nan)), float(c.get("bytes accessed", np.nan))


def trace_kernels(events: list, steps: int) -> list[tuple[str, str, int, float]]:
    """(device, name, count per step, microseconds per step) of the complete events of a
    Chrome/Perfetto trace, summed by name on each process, largest first: the ``TOP_KERNELS``
    largest of each process, then the rest of it as one ``(other)`` row."""
    procs = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            key = (procs.get(e.get("pid"), str(e.get("pid"))), e.get("name", ""))
            total[key] += float(e["dur"])
            count[key] += 1
    out, kept = [], collections.Counter()
    rest = collections.defaultdict(lambda: [0, 0.0])
    for (d, n), t in total.most_common():
        kept[d] += 1
        if kept[d] <= TOP_KERNELS:
            out.append((d, n, round(count[d, n] / steps), t / steps))
        else:
            rest[d][0] += count[d, n]
            rest[d][1] += t
    out += [(d, "(other)", round(c / steps), t / steps) for d, (c, t) in rest.items()]
    return out


def traced(compiled, params, state, tokens, steps: int = 3) -> list:
    """The Perfetto trace events of ``steps`` calls of ``compiled`` (already warm)."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                params, state, value = compiled(params, state, tokens)
            jax.block_until_ready(value)
        path = glob.glob(os.path.join(tmp, "**", "perfetto_trace.json.gz"), recursive=True)
        if not path:
            return []
        with gzip.open(path[0], "rt") as fh:
            doc = json.load(fh)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def measure(run, config, loop: str, recompute: str, trace: bool) -> tuple[dict, list]:
    """One variant's ``remat.csv`` row and, with ``trace``, its ``kernels.csv`` rows."""
    name, layers, h, heads, s, mb = config
    compiled, params, state, tokens = gm.compile_step(
        layers, h, s, gm.VOCAB, mb, heads, run.impl, recompute, unroll=loop == "unrolled"
    )
    peak = gm.assigned_bytes(compiled)
    peak_gib = np.nan if peak is None else peak / 2**30
    flops, nbytes = cost(compiled)
    times, params, state = gm.step_times(compiled, params, state, tokens, run.args.steps)
    t = float(np.median(times))
    row = dict(
        model=name, layers=layers, hidden=h, heads=heads, seq_len=s, microbatch=mb, loop=loop,
        recompute=recompute, step_s=t, step_s_min=min(times), step_s_max=max(times),
        tflops_per_s=gm._model_flops(layers, h, s, gm.VOCAB, mb * s) / t / 1e12, flops=flops,
        bytes_accessed=nbytes, peak_mem_gib=peak_gib, **hlo_counts(compiled.as_text()),
    )  # fmt: skip
    kernels = []
    if trace:
        events = traced(compiled, params, state, tokens)
        for device, kname, n, us in trace_kernels(events, 3):
            values = (loop, recompute, device, kname, n, us, us / (t * 1e6))
            kernels.append(dict(zip(KERNEL_COLUMNS, values)))
    return row, kernels


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for remat.csv, kernels.csv, meta.json")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip variants that start later")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--microbatch", type=int, default=CONFIG[5], help="sequences per step")
    p.add_argument("--trace", action="store_true", help="also record kernels with jax.profiler")
    p.add_argument("--quick", action="store_true", help="sizes / 16: a CPU smoke run")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run = gm.Run(argparse.Namespace(gpu=None, budget_s=args.budget_s, steps=args.steps))
    name, layers, h, heads, s, _ = CONFIG
    scale = gm.QUICK_SCALE if args.quick else 1
    config = (name, layers, h // scale, max(1, heads // scale), s // scale, args.microbatch)
    rows, kernels = [], []
    for loop, recompute in VARIANTS:
        got = run.attempt(
            f"{loop} {recompute}", lambda: measure(run, config, loop, recompute, args.trace)
        )
        if got:
            rows.append(got[0])
            kernels.extend(got[1])
            print(f"{loop:>8} {recompute:>4}: {got[0]['step_s']:.4f} s", flush=True)
    columns = list(COLUMNS) + [f"hlo_{k}" for k in (*HLO_KINDS, *CUSTOM_CALLS)]
    gm.write_csv(os.path.join(args.out, "remat.csv"), columns, rows)
    if args.trace:
        gm.write_csv(os.path.join(args.out, "kernels.csv"), KERNEL_COLUMNS, kernels)
    config = dict(zip(("model", "layers", "hidden", "heads", "seq_len", "microbatch"), config))
    gm.write_meta(args.out, run, attention=run.impl or "xla", config=config, rows=len(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
