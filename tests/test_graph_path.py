"""calibration.graph_path: e2e rows of a fit priced on their clusters' graphs, padded to one grid
so that one vmapped simulation prices every GPU count."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GPT, PLANS

from calibration import fit as fit_mod
from calibration import graph_path
from calibration.graph_path import graph_arrays, graph_problem, pad_network
from calibration.records import E2ERecord, Measurements
from diffcost.config import load_cluster
from diffcost.network import model as netmodel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import network_pricing as NP  # noqa: E402  (GraphPricer: held-out rows priced row by row)

# float64 throughout: the padded batch and the row-by-row pricing differ by rounding only
LOSS_RTOL = 1e-10
LOOKUP_RTOL = 1e-12


@pytest.fixture(scope="module")
def rows():
    """Runs of 8, 16 and 32 GPUs on DGX H100 (grids of 4, 5 and 6 points), two sources."""
    cluster = load_cluster("dgx-h100")
    plans = [PLANS["dp8"], PLANS["fsdp"], PLANS["3d-interleaved"], PLANS["tp4pp2"]]
    return [E2ERecord(GPT, plan, cluster, 0.8 + 0.3 * i, "ab"[i % 2], i, (), None)
            for i, plan in enumerate(plans)]  # fmt: skip


def test_padding_leaves_every_lookup_of_the_job_unchanged(rows):
    tables = graph_arrays(rows[2]).network  # 32 GPUs
    n = 32
    padded = pad_network(tables, 9)
    assert padded.log_grid.shape == (9,) and padded.load.shape[0] == 81
    assert pad_network(tables, tables.log_grid.shape[0]) is tables
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    for size in divisors:
        for stride in (s for s in divisors if size * s <= n):
            args = (jnp.asarray(float(size)), jnp.asarray(float(stride)))
            np.testing.assert_allclose(netmodel.group_load(padded, *args),
                                       netmodel.group_load(tables, *args),
                                       rtol=LOOKUP_RTOL)  # fmt: skip
    with pytest.raises(ValueError, match="below"):
        pad_network(tables, 3)


def test_graph_fit_loss_is_the_mean_penalty_of_the_rows_priced_one_by_one(rows, monkeypatch):
    """The loss of the graph problem (no prior, every row at full weight) is the mean robust
    penalty of the log errors of the rows priced one at a time on their own, unpadded graphs
    with contention (``GraphPricer``), with the rows in buckets or in one padded stack; its
    gradient is finite and not zero."""
    problem = fit_mod.build_problem(Measurements(e2e=rows))
    on_graph = graph_problem(problem, rows, contention=True)
    # grids of 4 points (8 GPUs) in one bucket, of 5 and 6 padded to 6 in the other
    buckets = on_graph.data["e2e"]["cluster"]
    assert [b.network.log_grid.shape for b in buckets] == [(1, 4), (3, 6)]
    assert [list(r) for r in on_graph.data["e2e"]["rows"]] == [[0], [1, 2, 3]]
    assert problem.data["e2e"]["cluster"].network is None  # the problem itself is unchanged
    dev, clu = fit_mod.initial_tables(problem)
    key = jax.random.PRNGKey(0)
    # constants off their defaults, so that the comparison reads the tables
    dev = {k: v + 0.05 * jax.random.normal(key, v.shape, v.dtype) for k, v in dev.items()}
    cfg = fit_mod.FitConfig(prior_weight=0.0, full_rows=1)
    loss = fit_mod.make_loss(on_graph, cfg)((dev, clu), on_graph.data)

    fams, clus = set(problem.families), set(problem.clusters)
    pricer = NP.GraphPricer(
        len(fams), len(clus), cfg.temperature, paths=("comm", "graph_contention")
    )
    priced = pricer(rows, problem, (dev, clu), fams, clus)
    resid = priced["graph_contention"] - np.log([r.measured_iter_s for r in rows])
    penalty = np.asarray(fit_mod.robust_penalty(jnp.asarray(resid), cfg.huber_delta, 1.0))
    w = np.asarray(problem.data["e2e"]["weight"])
    np.testing.assert_allclose(float(loss), np.sum(w * penalty) / np.sum(w), rtol=LOSS_RTOL)
    # off one node the graph with contention prices differently from the existing path
    assert np.max(np.abs(priced["graph_contention"] - priced["comm"])) > 1e-6

    # one bucket: every row padded to the largest grid, one stack; the same loss
    monkeypatch.setattr(graph_path, "GRID_BUCKETS", ())
    one = graph_problem(problem, rows, contention=True)
    assert one.data["e2e"]["cluster"].network.log_grid.shape == (len(rows), 6)
    one_loss = fit_mod.make_loss(one, cfg)((dev, clu), one.data)
    np.testing.assert_allclose(float(one_loss), float(loss), rtol=LOSS_RTOL)

    grads = jax.grad(fit_mod.make_loss(on_graph, cfg))((dev, clu), on_graph.data)
    flat = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(grads)])
    assert np.all(np.isfinite(flat)) and np.any(flat != 0)


def test_graph_problem_checks_its_records(rows):
    problem = fit_mod.build_problem(Measurements(e2e=rows))
    with pytest.raises(ValueError, match="records"):
        graph_problem(problem, rows[:2])
