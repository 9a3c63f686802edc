"""ZeRO-2 with per-layer parameter gathers (``PlanSpec.param_gather: layer``, PyTorch FSDP's
``SHARD_GRAD_OP``) against DeepSpeed's ZeRO-2 (gathered after the step) and ZeRO-3."""

from __future__ import annotations

import argparse
import csv
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CLUSTER, GPT, arrays, write
from test_config_checks import load_with

from diffcost import api
from diffcost.cli import sweep as sweep_cli
from diffcost.config import ConfigError
from diffcost.params import default_params
from diffcost.runs import read_rows, row_to_specs
from diffcost.search import bounds_for, decode, random_starts
from diffcost.simulate import simulate
from diffcost.space import Space, make_space
from diffcost.specs import PlanSpec

# a slow fabric across two nodes, so the data-parallel collectives are worth seeing
SLOW = dataclasses.replace(CLUSTER, nic_Gbps=25.0)
EXAMPLE = "configs/examples/gpt3-175b.yaml"
ZERO2 = PlanSpec(dp=16, zero=2, microbatch=2, global_batch=64, overlap_dp=False)


def _run(plan, cluster=SLOW):
    m, p, c = arrays(GPT, plan, cluster)
    return simulate(m, p, c, default_params(jnp.float64), 1e-3)


def test_per_layer_gathers_replace_the_gather_after_the_step():
    """DeepSpeed's ZeRO-2 (without overlap) waits for the stage's parameter gather after the
    backward; FSDP's gathers each layer's under the forward instead (exposed ZeRO time, no
    gather after the step), and keeps them for the backward, so it is faster than ZeRO-3,
    which gathers again there. Memory is ZeRO-2's either way: the gathered parameters of
    every layer stay until the backward."""
    step = _run(ZERO2)
    layer = _run(dataclasses.replace(ZERO2, param_gather="layer"))
    full = _run(dataclasses.replace(ZERO2, zero=3))
    assert float(step.zero_comm_s) == 0.0
    assert float(layer.zero_comm_s) > 0.0
    assert float(layer.zero_comm_s) < float(full.zero_comm_s)
    assert float(layer.dp_comm_s) < float(step.dp_comm_s)
    assert float(layer.memory_peak_bytes) == float(step.memory_peak_bytes)
    assert float(layer.iteration_s) < float(full.iteration_s)


def test_per_layer_gathers_grow_with_the_data_parallel_group():
    """Weak scaling across nodes: the per-layer collectives' ring latency grows with the number
    of ranks, so the iteration slows with dp at a fixed per-GPU batch; DeepSpeed's ZeRO-2 with
    its gather hidden under the next forward barely moves."""

    def times(gather):
        out = []
        for dp in (16, 64, 256):
            plan = dataclasses.replace(
                ZERO2, dp=dp, global_batch=4 * dp, overlap_dp=True, param_gather=gather
            )
            out.append(float(_run(plan).iteration_s))
        return np.array(out)

    layer, step = times("layer"), times("step")
    assert np.all(np.diff(layer) > 0)
    assert layer[-1] / layer[0] - 1 > 2 * (step[-1] / step[0] - 1)


def test_gather_layer_only_changes_zero_2():
    """``gather_layer`` weighs ZeRO-2 only: at any other stage the leaf changes nothing."""
    for zero in (0, 1, 3):
        m, p, c = arrays(GPT, dataclasses.replace(ZERO2, zero=zero), SLOW)
        params = default_params(jnp.float64)
        t = [float(simulate(m, p.replace(gather_layer=g), c, params).iteration_s) for g in (0, 1)]
        assert t[0] == t[1]


def test_gradient_through_the_relaxed_choice_is_finite():
    m, p, c = arrays(GPT, dataclasses.replace(ZERO2, param_gather="layer"), SLOW)
    params = default_params(jnp.float64)

    def log_time(g):
        return jnp.log(simulate(m, p.replace(gather_layer=g), c, params, 1e-3).iteration_s)

    grad = jax.grad(log_time)(jnp.asarray(0.5))
    assert np.isfinite(float(grad)) and float(grad) != 0.0


@pytest.mark.parametrize(
    "framework, zero, expected",
    [
        ("llm-foundry/Composer (PyTorch FSDP)", "2", "layer"),
        ("torchtitan (PyTorch FSDP2)", "2", "layer"),
        ("llm-foundry/Composer (PyTorch FSDP)", "3", "step"),
        ("Megatron-DeepSpeed", "2", "step"),
    ],
)
def test_runs_take_the_stacks_meaning_of_zero_2(framework, zero, expected):
    """A run's ``zero`` = 2 is SHARD_GRAD_OP under an FSDP framework (said in its defaults)
    and DeepSpeed's ZeRO-2 elsewhere."""
    row = {
        "source": "t", "model": "m", "cluster": "dgx-h100", "framework": framework,
        "measured_iter_s": "1", "n_layers": "4", "hidden": "1024", "heads": "8",
        "seq_len": "2048", "n_gpus": "16", "tp": "1", "pp": "1", "microbatch": "1",
        "global_batch": "16", "zero": zero,
    }  # fmt: skip
    _, plan, _, used = row_to_specs(row, {})
    assert plan.param_gather == expected
    said = [u for u in used if u.startswith("param_gather=")]
    assert said == (
        ["param_gather=layer (ZeRO-2 as FSDP SHARD_GRAD_OP)"] if expected == "layer" else []
    )


def test_config_checks_param_gather(tmp_path):
    plan = load_with(
        tmp_path, "{tp: 8, pp: 4, dp: 2, global_batch: 64, zero: 2, param_gather: layer}"
    ).plan
    assert plan.param_gather == "layer"
    with pytest.raises(ConfigError, match=r"param_gather='layer' applies to ZeRO-2.*zero=3"):
        load_with(tmp_path, "{tp: 8, pp: 4, dp: 2, global_batch: 64, zero: 3, param_gather: layer}")
    with pytest.raises(ConfigError, match=r"plan.param_gather.*'step'.*'layer'"):
        load_with(
            tmp_path, "{tp: 8, pp: 4, dp: 2, global_batch: 64, zero: 2, param_gather: forward}"
        )


def test_space_and_search_carry_the_setting():
    """A search space's ZeRO-2 choices are planned with its ``param_gather``: the plan specs,
    the batched arrays and the relaxed decoding agree."""
    space = Space(GPT, CLUSTER, 16, 64, param_gather="layer")
    choices = [c for c in space.choices() if c.zero in (2, 3)][:4]
    assert {space.plan_spec(c).param_gather for c in choices if c.zero == 2} == {"layer"}
    assert {space.plan_spec(c).param_gather for c in choices if c.zero == 3} == {"step"}
    assert np.all(space.to_arrays(choices).gather_layer == 1.0)
    starts = random_starts(jax.random.PRNGKey(0), 1, len(space.orders))
    one = jax.tree_util.tree_map(lambda x: x[0], starts)
    assert float(decode(one, bounds_for(space), 1.0).gather_layer) == 1.0


def test_rows_file_reads_param_gather(tmp_path):
    """The shared MosaicML rows with ``zero`` = 2 are planned as SHARD_GRAD_OP."""
    path = write(
        tmp_path / "runs.csv",
        "source,model,cluster,framework,measured_iter_s,n_layers,hidden,heads,seq_len,n_gpus,"
        "tp,pp,microbatch,global_batch,zero\n"
        "s,MPT-1b,mosaic-h100,llm-foundry/Composer (PyTorch FSDP),0.6,24,2048,16,2048,128,1,1,"
        "12,1536,2\n",
    )
    _, plan, _, _ = row_to_specs(read_rows(path)[0], {})
    assert (plan.zero, plan.param_gather) == (2, "layer")


def test_graph_path_prices_per_layer_gathers_as_the_existing_path():
    """On its cluster's own graph the network path prices a SHARD_GRAD_OP plan within 0.1% of
    the existing path (its per-layer gathers and scatters included), and contention on the
    shared links only adds time."""
    exp = api.load(EXAMPLE, ["plan.zero=2", "plan.param_gather=layer", "cluster.topology=cluster"])
    model, plan, cluster = api.experiment_arrays(exp)
    params = api.params_for(exp)[0]
    alone = cluster.replace(network=cluster.network.replace(contention=False))
    graph = simulate(model, plan, alone, params)
    base = simulate(model, plan, cluster.replace(network=None), params)
    contended = simulate(model, plan, cluster, params)
    assert float(base.zero_comm_s) > 0.0
    assert float(graph.iteration_s) == pytest.approx(float(base.iteration_s), rel=1e-3)
    assert float(contended.iteration_s) >= float(graph.iteration_s)


def test_space_rejects_an_unknown_param_gather():
    with pytest.raises(ConfigError, match=r"param_gather='forward': expected 'step'.*'layer'"):
        make_space(GPT, CLUSTER, 16, 64, param_gather="forward")


def test_sweep_cli_takes_param_gather(tmp_path):
    """``diffcost sweep --param-gather layer`` prices the ZeRO-2 plans as SHARD_GRAD_OP: they
    change, the other stages do not."""

    def run(gather):
        parser = argparse.ArgumentParser()
        sweep_cli.add_arguments(parser)
        out = tmp_path / f"{gather}.csv"
        argv = ["llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "32"]
        argv += ["--chunk", "512", "--param-gather", gather, "--out", str(out), "--json"]
        assert sweep_cli.run(parser.parse_args(argv)) == 0
        with open(out) as fh:
            return list(csv.DictReader(fh))

    step, layer = run("step"), run("layer")
    assert [r["zero"] for r in step] == [r["zero"] for r in layer]
    moved = {r["zero"] for r, q in zip(step, layer) if r["iteration_s"] != q["iteration_s"]}
    assert moved == {"2"}
