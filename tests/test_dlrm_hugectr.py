"""HugeCTR's embedding planner (``auto`` / ``hier_auto``) as ``dlrm_cost`` choices."""

import dataclasses

import numpy as np
import pytest

from diffcost import config
from diffcost.dlrm import TableSpec, load_dlrm
from diffcost.dlrm_cost import DP, TW, TWRW, TableChoice, dlrm_cost, make_problem, one_hot_plan
from diffcost.dlrm_hugectr import PlannerConfig, bucket_plan, cluster_bw_ratio, plan
from diffcost.params import default_params

H100 = config.load_cluster("dgx-h100")
MLPERF = load_dlrm("dlrm-dcnv2", {"batch_size": 55296})


def test_bandwidth_ratio_reproduces_nvidias_configs():
    # MEM_COMM_BW_RATIO in NVIDIA's v4.0 configs: 67 on 16 DGX H100 nodes (hier_auto), 11 on
    # one 8x H200 node (auto); the argparse default 3.35e12 / 450e9 for one H100 node
    assert cluster_bw_ratio(H100, per_node=True) == pytest.approx(67.0, rel=1e-3)
    h200 = config.load_cluster("dgx-h200")
    assert cluster_bw_ratio(h200, per_node=False) == pytest.approx(11.0, rel=0.05)
    assert cluster_bw_ratio(H100, per_node=False) == pytest.approx(3.35e12 / 450e9, rel=1e-3)


def _check_buckets(splits, buckets, gib, cap, n_buckets):
    assert len(buckets) == n_buckets
    for held in buckets:
        assert len(held) == len(set(held)), "two shards of one table in a bucket"
        assert sum(gib[t] / splits[t] for t in held) <= cap + 1e-9
    for t, k in enumerate(splits):
        held_by = sum(t in b for b in buckets)
        if k == 0:
            assert held_by == 0
        else:
            assert held_by == k and (k & (k - 1)) == 0, f"table {t}: {k} shards"


def test_a_hot_table_is_split_over_the_buckets():
    hotness, gib = [100.0, 1.0, 1.0, 1.0], [1.0] * 4
    splits, buckets = bucket_plan(hotness, gib, 4, 0.5, 10.0, PlannerConfig())
    _check_buckets(splits, buckets, gib, 10.0, 4)
    assert splits[0] == 4 and list(splits[1:]) == [1, 1, 1]


def test_small_tables_are_replicated_and_big_ones_split_to_fit():
    hotness, gib = [5.0, 5.0, 5.0, 1.0], [30.0, 30.0, 30.0, 0.001]
    cfg = PlannerConfig(dp_threshold_gib=0.01)
    splits, buckets = bucket_plan(hotness, gib, 2, 1.0, 50.0, cfg)
    _check_buckets(splits, buckets, gib, 50.0 - 0.001, 2)
    assert splits[3] == 0
    assert sorted(splits[:3]) == [1, 1, 2]  # three 30 GB tables on two 50 GB buckets
    with pytest.raises(ValueError, match="do not fit"):
        bucket_plan(hotness, gib, 2, 1.0, 40.0, cfg)


def test_replicating_more_than_a_bucket_holds_is_an_error():
    with pytest.raises(ValueError, match="dp_threshold_gib"):
        bucket_plan([1.0], [5.0], 2, 1.0, 4.0, PlannerConfig(dp_threshold_gib=10.0))


@pytest.mark.parametrize("n_gpus", [8, 32])
def test_plan_splits_tables_into_shards_of_the_same_work(n_gpus):
    spec, choices = plan(MLPERF, H100, n_gpus, PlannerConfig(dp_threshold_gib=0.008))
    assert len(choices) == len(spec.tables)
    base = {t.name: t for t in MLPERF.tables}
    for name, t in base.items():
        shards = [s for s in spec.tables if s.name.split("/")[0] == name]
        assert sum(s.pooling for s in shards) == pytest.approx(t.pooling)
        assert sum(s.rows for s in shards) >= t.rows
    kinds = {c.kind for c in choices}
    if n_gpus == 8:
        assert kinds <= {TW, DP}
    else:
        assert kinds <= {TWRW, DP} and all(c.rank % H100.gpus_per_node == 0 for c in choices)
    hot = [s for s in spec.tables if s.name.split("/")[0] == "t20"]
    assert len(hot) > 1, "the table of 100 lookups per sample stays whole"


def test_splitting_the_hot_table_shortens_the_slowest_ranks_lookups():
    params = default_params()
    spec = dataclasses.replace(
        MLPERF,
        tables=(
            TableSpec("hot", 4_000_000, 128, 100.0, 1.0),
            TableSpec("cold", 1000, 128, 1.0, 1.0),
        ),
    )
    split, choices = plan(spec, H100, 8, PlannerConfig())
    whole = make_problem(spec, H100, 8, params)
    both_on_rank_0 = [TableChoice(TW, 0), TableChoice(TW, 0)]
    one_rank = dlrm_cost(whole, one_hot_plan(both_on_rank_0, whole.layout))
    problem = make_problem(split, H100, 8, params)
    planned = dlrm_cost(problem, one_hot_plan(choices, problem.layout))
    assert len(split.tables) > 2
    assert float(planned.lookup_fwd_s) < 0.5 * float(one_rank.lookup_fwd_s)
    assert np.isfinite(float(planned.iteration_s))


def test_the_command_reports_tables_the_planner_cannot_hold():
    from diffcost.cli.dlrm import hugectr_dict

    out = hugectr_dict(MLPERF, H100, 2, default_params())  # 209 GB of tables on 2 x 60 GB
    assert "do not fit" in out["error"]
