"""Embedding-table sharding search against exhaustive search and the greedy planner."""

import dataclasses
import json

import numpy as np
import pytest

from diffcost import config
from diffcost.dlrm import TableSpec, load_dlrm
from diffcost.dlrm_cost import RW, TW, TableChoice, dlrm_cost, make_problem, one_hot_plan
from diffcost.dlrm_search import (
    DlrmSearchConfig,
    Evaluator,
    exhaustive,
    greedy,
    neighbours,
    search,
)
from diffcost.params import default_params

MAX_GAP = 0.02  # the bar: within 2% of the exhaustive optimum
CLUSTER = config.load_cluster("dgx-h100")
BASE = load_dlrm("dlrm-dcnv2")
FAST = DlrmSearchConfig(starts=10, steps=100, walkers=3)


@pytest.fixture(scope="module")
def tiny():
    tables = (
        TableSpec("hot", rows=2_000_000, dim=128, pooling=60.0, zipf=0.2),
        TableSpec("mid", rows=300_000, dim=128, pooling=8.0, zipf=0.9),
        TableSpec("small", rows=5_000, dim=128, pooling=3.0, zipf=1.1),
    )
    spec = dataclasses.replace(BASE, name="tiny", tables=tables, batch_size=65536)
    return make_problem(spec, CLUSTER, 8, default_params())


def test_search_is_within_two_percent_of_exhaustive(tiny):
    best = exhaustive(tiny)
    found = search(tiny, FAST)
    assert best.fits and found.best.fits
    assert found.best.iteration_s <= best.iteration_s * (1 + MAX_GAP)
    assert found.best.iteration_s >= best.iteration_s * (1 - 1e-12)  # nothing beats exhaustive
    assert greedy(tiny).iteration_s >= best.iteration_s * (1 - 1e-12)


def test_batched_evaluation_equals_one_by_one(tiny):
    plans = [
        (TableChoice(TW, 0), TableChoice(TW, 1), TableChoice(RW, 0)),
        (TableChoice(RW, 0), TableChoice(TW, 3), None),
    ]
    scored = Evaluator(tiny)(plans)
    for plan, s in zip(plans, scored):
        out = dlrm_cost(tiny, one_hot_plan(plan, tiny.layout), 0.0)
        assert s.iteration_s == pytest.approx(float(out.iteration_s), rel=1e-12)


def test_neighbours_move_one_table_or_swap_two(tiny):
    plan = (TableChoice(TW, 0), TableChoice(TW, 1), TableChoice(RW, 0))
    moved = neighbours(plan, tiny)
    assert len(moved) == len(set(moved)) and plan not in moved
    for other in moved:
        changed = [t for t, (a, b) in enumerate(zip(plan, other)) if a != b]
        assert len(changed) in (1, 2)
        if len(changed) == 2:  # a swap: types kept, ranks exchanged
            a, b = changed
            assert [other[a].kind, other[b].kind] == [plan[a].kind, plan[b].kind]
    swap = (TableChoice(TW, 1), TableChoice(TW, 0), TableChoice(RW, 0))
    assert swap in moved


def test_bad_settings_are_refused(tiny):
    with pytest.raises(ValueError, match="starts=0"):
        DlrmSearchConfig(starts=0)
    with pytest.raises(ValueError, match="tau_end"):
        DlrmSearchConfig(tau_start=0.1, tau_end=0.5)
    with pytest.raises(ValueError, match="exceeds limit=10"):
        exhaustive(tiny, limit=10)


def test_greedy_places_every_table(tiny):
    plan = greedy(tiny)
    assert len(plan.choices) == 3 and all(c is not None for c in plan.choices)
    assert np.isfinite(plan.iteration_s)


TWO_TABLES = """
batch_size: 8192
dense_features: 13
bottom_mlp: [64, 32]
top_mlp: [64, 1]
embedding_dim: 32
tables:
  - {name: big, rows: 1000000, pooling: 20, zipf: 0.5}
  - {name: small, rows: 1000, pooling: 2}
"""


def test_command_prints_a_plan(tmp_path, capsys):
    from diffcost.cli import main

    path = tmp_path / "two.yaml"
    path.write_text(TWO_TABLES)
    argv = ["shard-embeddings", str(path), "--cluster", "dgx-h100", "--gpus", "8"]
    code = main(argv + ["--starts", "5", "--steps", "20", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["best"]["fits"]
    assert [t["name"] for t in out["best"]["tables"]] == ["big", "small"]
    assert out["best"]["iteration_s"] <= out["greedy"]["iteration_s"] * (1 + 1e-9)
    # HugeCTR's planner cuts the hot table (20 of 22 lookups per sample) into row shards
    assert out["hugectr"]["shards"].get("big", 1) > 1 and out["hugectr"]["iteration_s"] > 0
    assert main(argv[:2] + ["--cluster", "dgx-h100", "--gpus", "3"]) == 2  # 8192 % 3 != 0
    assert "not divisible by n_gpus=3" in capsys.readouterr().err
