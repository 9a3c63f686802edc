"""``diffcost.from_jax`` against XLA's own FLOP count, on the zoo.

    python benchmarks/workloads_from_jax.py [--quick] [--json]

For every zoo model (``diffcost.zoo``: ResNet-50, VGG-16, ViT-B/16, 3D U-Net, RetinaNet,
DLRM-DCNv2, DLRM with dot interaction, and the small CNN, MLP and transformer block of the
tests): trace the training step
(forward and the backward ``jax.vjp`` implies, w.r.t. the parameters) with ``from_jax``, shapes
only, and compare its FLOPs with ``cost_analysis()["flops"]`` of the same step compiled by XLA
for the CPU (compile only; nothing runs).

Figures per model: ``flops_err_pct`` (graph minus XLA over XLA, step), ``forward_err_pct``
(same for the forward alone), ``hlo_err_pct`` (step, against the same analysis of the lowered
module before XLA's optimization passes), ``ops`` (operators in the graph), ``trace_s``
(``from_jax`` wall time), ``gflops`` (the graph's step GFLOPs) and ``batch``. ``--quick`` uses
batch 1 for the image models and 256 for DLRM (same graphs, smaller dimensions). Target (issue 26):
``|flops_err_pct| <= 2`` on every model; exits non-zero otherwise.

The lead merges ``measure`` into ``benchmarks/workloads.py`` under the ``from_jax`` key.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diffcost import zoo  # noqa: E402
from diffcost.opgraph import from_jax  # noqa: E402
from diffcost.opgraph.xla import xla_flops  # noqa: E402

TARGET_PCT = 2.0
QUICK_BATCH = {"resnet50": 1, "vgg16": 1, "vit_b16": 1, "dlrm_dcnv2": 256, "dlrm_dot": 256}


def _err_pct(ours: float, xla: float) -> float:
    return round(100.0 * (ours - xla) / xla, 4)


def measure_model(name: str, batch: int | None = None) -> dict:
    m = zoo.model(name, batch)
    t0 = time.perf_counter()
    graph = from_jax(m.fn, *m.args, argnums=m.argnums)
    trace_s = time.perf_counter() - t0
    step = xla_flops(m.fn, *m.args, argnums=m.argnums)
    forward = xla_flops(m.fn, *m.args, argnums=m.argnums, backward=False)
    lowered = xla_flops(m.fn, *m.args, argnums=m.argnums, optimized=False)
    return {
        "flops_err_pct": _err_pct(graph.flops(), step),
        "forward_err_pct": _err_pct(graph.flops("forward"), forward),
        "hlo_err_pct": _err_pct(graph.flops(), lowered),
        "ops": len(graph.operators),
        "trace_s": round(trace_s, 3),
        "gflops": round(graph.flops() / 1e9, 3),
        "batch": m.batch,
    }


def measure(quick: bool = False) -> dict:
    """``{"from_jax": {model: figures}}`` for every zoo model."""
    out = {}
    for name in zoo.ZOO:
        out[name] = measure_model(name, QUICK_BATCH.get(name) if quick else None)
    return {"from_jax": out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batches")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    result = measure(args.quick)
    rows = result["from_jax"]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        head = ("model", "step err %", "fwd err %", "HLO err %", "ops", "trace s", "GFLOP")
        print("".join(f"{h:<18}" if i == 0 else f"{h:>11}" for i, h in enumerate(head)))
        for name, r in rows.items():
            print(
                f"{name:<18}{r['flops_err_pct']:>11.2f}{r['forward_err_pct']:>11.2f}"
                f"{r['hlo_err_pct']:>11.3f}"
                f"{r['ops']:>11}{r['trace_s']:>11.2f}{r['gflops']:>11.1f}"
            )
    worst = max(abs(r["flops_err_pct"]) for r in rows.values())
    if worst > TARGET_PCT:
        print(f"FAIL: worst |flops_err_pct| {worst:.2f} > {TARGET_PCT}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
