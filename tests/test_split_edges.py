"""Megatron-Core's pipeline split with the embedding and the loss counted as a layer each
(``PlanSpec.split_edges``, ``account_for_embedding_in_pipeline_split`` and
``account_for_loss_in_pipeline_split``): how Llama 3.1 405B's 126 layers run on 8 x 4 or
16 x 8 virtual stages."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CLUSTER, LLAMA, arrays
from test_config_checks import load_with

from diffcost.config import ConfigError
from diffcost.params import default_params
from diffcost.runs import read_rows, row_to_specs
from diffcost.simulate import simulate
from diffcost.specs import PlanSpec
from diffcost.stages import stage_layers

E2E = Path(__file__).parent / "data" / "readers_e2e.csv"
MODEL = dataclasses.replace(LLAMA, n_layers=30)  # 30 + 2 places on 8 x 4 virtual stages
PLAN = PlanSpec(pp=8, microbatch=1, global_batch=16, schedule="interleaved", chunks=4)


def _layers(plan):
    m, p, _ = arrays(MODEL, plan, CLUSTER)
    return np.asarray(stage_layers(m, p))


def test_the_edges_take_a_layer_place_on_the_first_and_last_stage():
    """30 layers, the embedding and the loss make 32 places, 4 per stage: the first and the last
    stage run 3 layers, the others 4, and the stages hold every layer once. The plain split
    gives every stage 3.75; a single stage keeps all 30 either way."""
    split = _layers(dataclasses.replace(PLAN, split_edges=True))
    np.testing.assert_allclose(split, [3.0, 4.0, 3.0])
    assert split[0] + (PLAN.pp - 2) * split[1] + split[2] == MODEL.n_layers
    np.testing.assert_allclose(_layers(PLAN), [3.75] * 3)
    one = dataclasses.replace(PLAN, pp=1, schedule="1f1b", chunks=1, split_edges=True)
    np.testing.assert_allclose(_layers(one), [30.0] * 3)


def test_the_head_no_longer_sits_on_a_full_share_of_layers():
    """The LM head and loss stack on the last stage: with the split the bottleneck is a middle
    stage of 4 layers or the last one of 3 plus the head, both shorter than 3.75 plus the head;
    with one stage the split changes nothing."""

    def iteration(plan):
        m, p, c = arrays(MODEL, plan, CLUSTER)
        return float(simulate(m, p, c, default_params(jnp.float64), 1e-3).iteration_s)

    assert iteration(dataclasses.replace(PLAN, split_edges=True)) < iteration(PLAN)
    one = dataclasses.replace(PLAN, pp=1, dp=8, schedule="1f1b", chunks=1)
    assert iteration(dataclasses.replace(one, split_edges=True)) == iteration(one)


@pytest.mark.parametrize(
    "framework, layers, expected",
    [
        (
            "Megatron-Bridge (Megatron-Core)",
            "30",
            "split_edges (30 layers + embedding + loss on 32 stages)",
        ),
        ("Megatron-Bridge (Megatron-Core)", "32", None),
        ("Megatron-Bridge (Megatron-Core)", "29", "layers per stage=0.906 (uneven split)"),
        ("torchtitan (PyTorch FSDP2)", "30", "layers per stage=0.938 (uneven split)"),
    ],
)
def test_rows_that_megatron_core_cannot_split_evenly(framework, layers, expected):
    """A Megatron-Core row whose layers do not divide over its virtual stages but do with the
    embedding and the loss counted reads as that split, and says so; other stacks, and splits
    that do not divide either way, keep the fractional layers per stage of the plain split."""
    row = dict(read_rows(E2E)[2], framework=framework, n_layers=layers, zero="1")
    row.update(pp="8", dp="8", interleave_chunks="4")
    _, plan, _, used = row_to_specs(row, {})
    assert plan.split_edges == (expected is not None and expected.startswith("split_edges"))
    notes = [u for u in used if u.startswith(("split_edges", "layers per stage"))]
    assert notes == ([expected] if expected else [])


def test_config_checks_the_places_split_edges_divides(tmp_path):
    """A config may run Llama 3.1 405B's 126 layers on 8 stages with ``split_edges`` (128
    places), and the layer rule names the places when they do not divide."""
    plan = "{tp: 8, pp: 8, dp: 1, global_batch: 64, split_edges: true}"
    assert load_with(tmp_path, plan, model="llama3-405b").plan.split_edges
    with pytest.raises(ConfigError, match=r"n_layers=126 is not divisible by pp\*chunks = 8\*1"):
        load_with(tmp_path, "{tp: 8, pp: 8, dp: 1, global_batch: 64}", model="llama3-405b")
    with pytest.raises(
        ConfigError, match=r"n_layers \+ 2 = 126 \+ 2 = 128 \(split_edges\) is not divisible by"
    ):
        load_with(
            tmp_path,
            "{tp: 8, pp: 6, global_batch: 60, split_edges: true}",
            model="llama3-405b",
            cluster="dgx-h100",
        )
