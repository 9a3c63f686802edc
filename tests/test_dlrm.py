"""DLRM workloads and the cost of embedding-table sharding plans."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from diffcost import config
from diffcost.dlrm import (
    ConfigError,
    TableSpec,
    cache_hit_rate,
    dense_gemms,
    load_dlrm,
)
from diffcost.dlrm_cost import (
    CW,
    DP,
    RW,
    TW,
    TWRW,
    ShardingPlan,
    TableChoice,
    dlrm_cost,
    make_problem,
    one_hot_plan,
    options,
)
from diffcost.params import default_params

RTOL = 1e-9
CLUSTER = config.load_cluster("dgx-h100")
PARAMS = default_params()
BASE = load_dlrm("dlrm-dcnv2")


def small_spec(tables, batch=8192):
    return dataclasses.replace(BASE, name="small", tables=tuple(tables), batch_size=batch)


def table(rows=100_000, pooling=10.0, zipf=0.5, name="t"):
    return TableSpec(name=name, rows=rows, dim=128, pooling=pooling, zipf=zipf)


def cost(spec, choices, n_gpus=8, temperature=0.0):
    problem = make_problem(spec, CLUSTER, n_gpus, PARAMS)
    return dlrm_cost(problem, one_hot_plan(choices, problem.layout), temperature)


# --- the workload -------------------------------------------------------------------------------


def test_mlperf_preset_has_the_reference_shapes():
    spec = load_dlrm("dlrm-dcnv2")
    assert len(spec.tables) == 26
    assert [t.rows for t in spec.tables].count(40_000_000) == 5
    assert spec.tables[20].pooling == 100
    assert spec.bottom_mlp == (512, 256, 128) and spec.top_mlp == (1024, 1024, 512, 256, 1)
    assert spec.interaction_width == 27 * 128
    gemms = dense_gemms(spec)
    assert len(gemms) == 3 + 2 * 3 + 5
    assert gemms[3] == (512, 3456)  # DCN's V: 3456 -> 512


def _write(tmp_path, text):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return path


GOOD = """
batch_size: 1024
dense_features: 13
bottom_mlp: [64, 32]
top_mlp: [64, 1]
embedding_dim: 32
tables:
  - {rows: 1000, pooling: 2}
"""


def test_a_minimal_file_loads(tmp_path):
    spec = load_dlrm(_write(tmp_path, GOOD))
    assert spec.tables[0] == TableSpec(name="t0", rows=1000, dim=32, pooling=2.0, zipf=0.0)


@pytest.mark.parametrize(
    "change, message",
    [
        (("tables:", "tabels:"), "did you mean 'tables'"),
        (("rows: 1000", "rows: -5"), "m.yaml: tables[0].rows=-5 is invalid"),
        (("rows: 1000", "rowz: 1000"), "did you mean 'tables[0].rows'"),
        (("pooling: 2", "pooling: many"), "tables[0].pooling='many' is invalid"),
        (("embedding_dim: 32", "embedding_dim: 16"), "tables[0].dim=16 is invalid: expected 32"),
        (("top_mlp: [64, 1]", "top_mlp: []"), "top_mlp=[] is invalid"),
        (("batch_size: 1024\n", "interaction: attention\nbatch_size: 1024\n"), "'dcn', 'dot'"),
        (("dense_features: 13\n", ""), "missing required key(s) 'dense_features'"),
    ],
)
def test_bad_files_name_the_field_and_what_is_valid(tmp_path, change, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_dlrm(_write(tmp_path, GOOD.replace(*change)))
    assert message in str(err.value)


def test_exchange_and_gradient_bytes_default_and_check(tmp_path):
    spec = load_dlrm(_write(tmp_path, GOOD))
    assert (spec.exchange_bytes, spec.grad_bytes) == (None, 4)
    with pytest.raises(ConfigError, match="exchange_bytes=3 is invalid"):
        load_dlrm(_write(tmp_path, GOOD + "exchange_bytes: 3\n"))


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="did you mean 'dlrm-dcnv2'"):
        load_dlrm("dlrm-dcnv3")


def test_problem_checks_the_gpu_count():
    with pytest.raises(ValueError, match="not divisible by n_gpus=3"):
        make_problem(small_spec([table()]), CLUSTER, 3, PARAMS)
    with pytest.raises(ValueError, match="multiple of gpus_per_node=8"):
        make_problem(small_spec([table()], batch=12 * 1024), CLUSTER, 12, PARAMS)


# --- lookups ------------------------------------------------------------------------------------


def test_cache_hit_rate_limits():
    l2 = 50.0 * 2**20
    rows = jnp.array([1e3, 1e8, 1e8, 1e8])
    zipf = jnp.array([0.0, 0.0, 1.0, 1.2])
    hit = np.asarray(cache_hit_rate(rows, 512.0, zipf, l2))
    assert hit[0] == pytest.approx(1.0)  # the table fits in L2
    assert hit[1] == pytest.approx(l2 / 512.0 / 1e8, rel=1e-6)  # uniform: the cached fraction
    assert hit[1] < hit[2] < hit[3] < 1.0  # more skew, more hits
    near_one = np.asarray(cache_hit_rate(1e8, 512.0, jnp.array([1.0 - 1e-8, 1.0 + 1e-8]), l2))
    assert near_one[0] == pytest.approx(hit[2], rel=1e-6) == near_one[1]


# --- costs --------------------------------------------------------------------------------------


def test_more_tables_on_one_rank_is_slower():
    spec = small_spec([table(name=f"t{i}") for i in range(8)])
    stacked = cost(spec, [TableChoice(TW, 0)] * 8)
    spread = cost(spec, [TableChoice(TW, i) for i in range(8)])
    assert float(stacked.iteration_s) > float(spread.iteration_s)
    assert float(stacked.lookup_fwd_s) == pytest.approx(8 * float(spread.lookup_fwd_s), rel=1e-6)
    loads = np.asarray(stacked.rank_lookup_s)
    assert loads[0] > 0 and np.all(loads[1:] == 0)


def test_row_wise_balances_a_hot_table():
    hot = table(rows=10_000_000, pooling=100.0, zipf=0.0, name="hot")
    spec = small_spec([hot] + [table(pooling=1.0, name=f"c{i}") for i in range(7)])
    cold = [TableChoice(TW, i) for i in range(1, 8)]
    table_wise = cost(spec, [TableChoice(TW, 0)] + cold)
    row_wise = cost(spec, [TableChoice(RW, 0)] + cold)
    tw, rw = np.asarray(table_wise.rank_lookup_s), np.asarray(row_wise.rank_lookup_s)
    assert tw.max() / tw.mean() > 3.0
    assert rw.max() / rw.mean() < tw.max() / tw.mean()
    assert rw.max() < tw.max()
    assert float(row_wise.comm_s) > float(table_wise.comm_s)  # partial sums of every sample


def test_a_table_too_big_for_one_gpu_fits_only_when_split():
    huge = table(rows=200_000_000, name="huge")  # 95 GiB of fp32 rows, 190 GiB with Adagrad
    spec = small_spec([huge])
    # column-wise: 4 shards of 32 columns, 48 GiB each
    for choice, fits in [(TW, False), (DP, False), (RW, True), (CW, True), (TWRW, True)]:
        out = cost(spec, [TableChoice(choice, 0)])
        assert bool(out.memory_peak_bytes <= out.memory_capacity_bytes) is fits, choice


def test_16_bit_exchange_halves_the_all_to_all_and_the_all_reduce():
    spec = small_spec([table(name=f"t{i}") for i in range(4)])
    choices = [TableChoice(TW, 0), TableChoice(CW, 2), TableChoice(TWRW, 0), TableChoice(DP, 0)]
    wide = cost(spec, choices, n_gpus=16)
    half = cost(dataclasses.replace(spec, exchange_bytes=2, grad_bytes=2), choices, n_gpus=16)
    assert float(half.comm_s) < float(wide.comm_s)
    assert float(half.all_reduce_s) < float(wide.all_reduce_s)
    # the lookups read the same fp32 rows
    np.testing.assert_allclose(half.rank_lookup_s, wide.rank_lookup_s, rtol=RTOL)
    # unset, the exchange takes the tables' bytes: an fp32 exchange is the default
    same = cost(dataclasses.replace(spec, exchange_bytes=4), choices, n_gpus=16)
    assert float(same.iteration_s) == float(wide.iteration_s)


def test_forward_is_part_of_the_iteration():
    spec = small_spec([table(name=f"t{i}", pooling=1.0 + i) for i in range(4)])
    out = cost(spec, [TableChoice(TW, i) for i in range(4)])
    assert 0.0 < float(out.forward_s) < 0.5 * float(out.iteration_s)
    assert float(out.forward_s) > float(out.lookup_fwd_s) + 0.5 * float(out.comm_s)


def test_single_gpu_has_no_communication():
    spec = small_spec([table(), table()])
    for kind in (TW, RW, CW, DP):
        out = cost(spec, [TableChoice(kind, 0)] * 2, n_gpus=1)
        assert float(out.comm_s) == 0.0 and float(out.all_reduce_s) == 0.0


def test_left_out_tables_cost_nothing():
    spec = small_spec([table(), table(rows=5_000_000)])
    both = cost(spec, [TableChoice(TW, 1), None])
    one = cost(small_spec([table()]), [TableChoice(TW, 1)])
    np.testing.assert_allclose(both.rank_lookup_s, one.rank_lookup_s, rtol=RTOL)
    assert float(both.comm_s) == pytest.approx(float(one.comm_s), rel=RTOL)


def test_smooth_cost_approaches_exact():
    spec = small_spec([table(name=f"t{i}", pooling=1.0 + i) for i in range(4)])
    choices = [TableChoice(TW, 0), TableChoice(CW, 2), TableChoice(RW, 0), TableChoice(TWRW, 0)]
    exact = float(cost(spec, choices).iteration_s)
    errors = [
        abs(float(cost(spec, choices, temperature=t).iteration_s) / exact - 1)
        for t in (1e-2, 1e-3, 1e-5)
    ]
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-4


def test_gradients_are_finite_and_match_finite_differences():
    spec = small_spec([table(name=f"t{i}", pooling=1.0 + 3 * i) for i in range(3)])
    problem = make_problem(spec, CLUSTER, 8, PARAMS)
    key = jax.random.PRNGKey(0)
    logits = (jax.random.normal(key, (3, 5)), jax.random.normal(jax.random.split(key)[0], (3, 8)))

    def f(types, ranks):
        plan = ShardingPlan(jax.nn.softmax(types), jax.nn.softmax(ranks))
        return jnp.log(dlrm_cost(problem, plan, 1e-2).iteration_s)

    grads = jax.grad(f, argnums=(0, 1))(*logits)
    assert all(np.all(np.isfinite(g)) for g in grads)
    check_grads(f, logits, order=1, modes=["rev"], eps=1e-6, rtol=1e-4)
    one_hot = one_hot_plan([TableChoice(RW, 0), TableChoice(DP, 0), None], problem.layout)
    g = jax.grad(lambda p: dlrm_cost(problem, p, 1e-2).iteration_s)(one_hot)
    assert np.all(np.isfinite(g.types)) and np.all(np.isfinite(g.ranks))


def test_options_are_distinct_choices():
    problem = make_problem(small_spec([table()], batch=16 * 512), CLUSTER, 16, PARAMS)
    menu = options(problem.layout)
    assert len(menu) == 16 + 1 + 16 + 2 + 1  # TW and CW per rank, RW, TWRW per node, DP
