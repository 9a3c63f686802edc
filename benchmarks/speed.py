"""Speed of the simulator on this machine, measured in one run.

    python benchmarks/speed.py [--json]

Figures:
* ``compile_s``: first call of ``simulate_jit`` (trace + XLA compile) on the GPT-3 example;
* ``single_prediction_us``: median warm latency of one jitted prediction (dispatch included);
* ``sweep_configs_per_s``: ``jit(vmap(simulate))`` over every valid plan of GPT-3 175B on
  1,024 GPUs (degrees, microbatch, recompute, ZeRO stage, schedule, rank order), after a
  warm-up call, the plan leaves that do not vary passed unbatched as ``diffcost sweep`` does
  (``sweep.batch_axes``); ``sweep_configs_per_s_all_batched`` every leaf batched, same run;
* ``grad_cost_ratio``: warm time of ``jit(grad(iteration_s))`` with respect to Params and the
  relaxed plan, over the warm time of one prediction.

* ``vs_calculon_speedup``: sweep configs/s times ``calculon_ms_per_config`` (Calculon, a pure-
  Python analytical model, measured at 1.86 ms per configuration on one core of this machine
  class: ``benchmarks/peers.py``) over 1000.

Targets: single <= 1 ms, sweep >= 200,000 configs/s, grad ratio <= 5; project goals 100 us,
1,000,000 configs/s and 3x. Exits non-zero when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from peers import CALCULON_MS_PER_CONFIG, vs_calculon  # noqa: E402

from diffcost import api, space, sweep  # noqa: E402
from diffcost.params import default_params  # noqa: E402
from diffcost.simulate import simulate  # noqa: E402

TARGETS = {"single_prediction_us": 1000.0, "sweep_configs_per_s": 200_000.0, "grad_cost_ratio": 5.0}
GOALS = {"single_prediction_us": 100.0, "sweep_configs_per_s": 1_000_000.0, "grad_cost_ratio": 3.0}
EXAMPLE = ROOT / "configs" / "examples" / "gpt3-175b.yaml"


def _median_time(fn, repeats: int, inner: int = 1) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def measure() -> dict:
    exp = api.load(EXAMPLE)
    model, plan, cluster = api.experiment_arrays(exp)
    params = default_params()

    api.simulate_jit.clear_cache()
    t0 = time.perf_counter()
    jax.block_until_ready(api.simulate_jit(model, plan, cluster, params))
    compile_s = time.perf_counter() - t0

    single_s = _median_time(lambda: api.simulate_jit(model, plan, cluster, params), 7, 200)

    grad_fn = jax.jit(
        jax.grad(lambda pr, pl: simulate(model, pl, cluster, pr).iteration_s, argnums=(0, 1))
    )
    jax.block_until_ready(grad_fn(params, plan))
    grad_s = _median_time(lambda: grad_fn(params, plan), 7, 200)

    plans, _ = space.enumerate_plans(
        space.make_space(exp.model, exp.cluster, exp.plan.n_gpus, exp.plan.global_batch)
    )
    n = int(plans.tp.shape[0])
    plans = jax.tree_util.tree_map(lambda x: np.asarray(x, dtype=plan.tp.dtype), plans)
    one = lambda p: simulate(model, p, cluster, params).iteration_s  # noqa: E731
    axes, split = sweep.batch_axes(plans)  # as ``diffcost sweep`` batches them
    runs = {}
    for key, fn, args in (
        ("sweep_s", jax.jit(jax.vmap(one, in_axes=(axes,))), split),
        ("sweep_s_all_batched", jax.jit(jax.vmap(one)), plans),
    ):
        args = jax.device_put(args)
        jax.block_until_ready(fn(args))
        runs[key] = _median_time(lambda fn=fn, args=args: fn(args), 5)
    sweep_s = runs["sweep_s"]
    return {
        "single_prediction_us": single_s * 1e6,
        "sweep_configs_per_s": n / sweep_s,
        "sweep_configs_per_s_all_batched": n / runs["sweep_s_all_batched"],
        "grad_cost_ratio": grad_s / single_s,
        "compile_s": compile_s,
        "sweep_configs": n,
        "sweep_s": sweep_s,
        "grad_us": grad_s * 1e6,
        "calculon_ms_per_config": CALCULON_MS_PER_CONFIG,
        "vs_calculon_speedup": vs_calculon(n / sweep_s),
        "devices": [str(d) for d in jax.devices()],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = measure()
    missed = [
        k
        for k, target in TARGETS.items()
        if (out[k] > target if k != "sweep_configs_per_s" else out[k] < target)
    ]
    out["targets_missed"] = missed
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        t, g = TARGETS, GOALS
        print(f"compile (first call)        {out['compile_s']:.2f} s")
        print(
            f"single prediction (warm)    {out['single_prediction_us']:.1f} us "
            f"(target {t['single_prediction_us']:.0f}, goal {g['single_prediction_us']:.0f})"
        )
        print(
            f"vmapped sweep               {out['sweep_configs_per_s']:,.0f} configs/s over "
            f"{out['sweep_configs']:,} GPT-3 175B plans on 1,024 GPUs "
            f"(target {t['sweep_configs_per_s']:,.0f}, goal {g['sweep_configs_per_s']:,.0f})"
        )
        print(
            f"  every plan leaf batched   {out['sweep_configs_per_s_all_batched']:,.0f} configs/s"
        )
        print(
            f"gradient / prediction       {out['grad_cost_ratio']:.2f}x "
            f"(target {t['grad_cost_ratio']:.0f}, goal {g['grad_cost_ratio']:.0f})"
        )
        print(
            f"vs Calculon ({out['calculon_ms_per_config']} ms/config, measured on this machine "
            f"class)  {out['vs_calculon_speedup']:,.0f}x per config"
        )
        print("targets missed: " + (", ".join(missed) if missed else "none"))
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
