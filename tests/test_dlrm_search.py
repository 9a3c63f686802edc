"""Embedding-table sharding search against exhaustive search and the greedy planner."""

import dataclasses
import json

import numpy as np
import pytest

from diffcost import config, population, profiles
from diffcost.dlrm import TableSpec, load_dlrm
from diffcost.dlrm_cost import (
    RW,
    SHARDING_TYPES,
    TW,
    TableChoice,
    dlrm_cost,
    make_problem,
    one_hot_plan,
    plan_cost,
)
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
def tiny_spec():
    tables = (
        TableSpec("hot", rows=2_000_000, dim=128, pooling=60.0, zipf=0.2),
        TableSpec("mid", rows=300_000, dim=128, pooling=8.0, zipf=0.9),
        TableSpec("small", rows=5_000, dim=128, pooling=3.0, zipf=1.1),
    )
    return dataclasses.replace(BASE, name="tiny", tables=tables, batch_size=65536)


@pytest.fixture(scope="module")
def tiny(tiny_spec):
    return make_problem(tiny_spec, CLUSTER, 8, default_params())


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
    assert "median" not in out["profile"]  # dgx-h100 has a profile of its own


def test_command_reports_the_members_median_on_a_cluster_without_profile(tmp_path, capsys):
    """shard-embeddings on dgx-h200 (no profile): the plans' times are the members' median
    (``plan_cost``), and the note says so and what the search minimized."""
    from diffcost.cli import main

    path = tmp_path / "two.yaml"
    path.write_text(TWO_TABLES)
    argv = ["shard-embeddings", str(path), "--cluster", "dgx-h200", "--gpus", "8"]
    assert main(argv + ["--starts", "5", "--steps", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "median over the population's 11 members" in out["profile"]
    assert "the search minimizes their mean log time" in out["profile"]
    cluster = config.load_cluster("dgx-h200")
    params, members, _ = population.constants_for(cluster)
    problem = make_problem(load_dlrm(str(path)), cluster, 8, params, members=members)
    best = one_hot_plan(_choices(out["best"]), problem.layout)
    median, plug_in = (float(f(problem, best).iteration_s) for f in (plan_cost, dlrm_cost))
    assert out["best"]["iteration_s"] == pytest.approx(median, rel=1e-9)
    assert median > plug_in


def _choices(plan: dict) -> list[TableChoice]:
    """The ``TableChoice`` of each table of a printed plan (``type`` or ``type@rank``)."""
    out = []
    for t in plan["tables"]:
        name, _, rank = t["plan"].partition("@")
        out.append(TableChoice(SHARDING_TYPES.index(name), int(rank or 0)))
    return out


def test_a_cluster_without_profile_is_priced_at_the_members_median(tiny_spec):
    """On dgx-h200 (no profile of its own) a plan costs the population members' median,
    ``exp(mean log t(member))``, slower than at their mean constants (time is convex in
    them), its parts rescaled to it and its memory unchanged; the search's plans are priced
    so. A cluster with a profile (its ``make_problem`` has no members) costs ``dlrm_cost``."""
    cluster = config.load_cluster("dgx-h200")
    params, members, note = population.constants_for(cluster)
    problem = make_problem(tiny_spec, cluster, 8, params, members=members)
    plan = one_hot_plan(
        [TableChoice(TW, 0), TableChoice(RW, 0), TableChoice(TW, 3)], problem.layout
    )
    out, plug_in = plan_cost(problem, plan), dlrm_cost(problem, plan)
    each = [
        dlrm_cost(problem.replace(params=p), plan) for p in profiles.population_members(cluster)
    ]
    times = [float(o.iteration_s) for o in each]
    median = np.exp(np.mean(np.log(times)))
    assert float(out.iteration_s) == pytest.approx(median, rel=1e-12)
    assert float(out.iteration_s) > float(plug_in.iteration_s) * (1 + 1e-4)
    scale = median / np.mean(times)
    mean_comm = np.mean([float(o.comm_s) for o in each])
    assert float(out.comm_s) == pytest.approx(mean_comm * scale, rel=1e-12)
    assert float(out.memory_peak_bytes) == pytest.approx(float(plug_in.memory_peak_bytes))
    assert "median over the population's 11 members" in note
    found = search(problem, FAST).best
    again = plan_cost(problem, one_hot_plan(found.choices, problem.layout))
    assert found.iteration_s == pytest.approx(float(again.iteration_s), rel=1e-12)
    own = make_problem(tiny_spec, CLUSTER, 8, profiles.params_for(CLUSTER)[0])
    assert population.constants_for(CLUSTER)[1] is None
    assert float(plan_cost(own, plan).iteration_s) == float(dlrm_cost(own, plan).iteration_s)
